"""``relay service install|uninstall`` and ``relay serve --env-file`` (SPEC O3, issue 8).

The unit and the plist are generated into a HOME of the test's own. The systemd unit is
always parsed and checked key by key (configparser; the unit format is INI-like), and is
also given to ``systemd-analyze verify`` when that tool is installed (an extra, never a
skip). The plist is read back with plistlib. Then the LaunchAgent's own command line is
run, as launchd would, to show ``--env-file`` provides the keys.
"""

from __future__ import annotations

import configparser
import os
import plistlib
import shlex
import shutil
import signal
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from helpers.daemons import RELAY, daemon, write

from relay.assembly.cli import main
from relay.assembly.service import parse_env_file
from relay.vocab.errors import ConfigError

SECRET = "sk-test-SECRET-value-123"
CONFIG = """
[server]
records = "r.jsonl"
drain_grace_s = 40
[providers.fake]
adapter = "fake"
models = ["echo"]
[providers.fake.profile]
interrupt_grace_s = 8
"""


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    return home


@pytest.fixture
def tools(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``node`` and ``claude`` in a folder of their own (a space and a ``$`` in its name),
    first on PATH: the service's PATH must find them there."""
    folder = tmp_path / "tool bin $x"
    folder.mkdir()
    for name in ("node", "claude"):
        tool = folder / name
        tool.write_text("#!/bin/sh\nexit 0\n")
        tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{folder}:/usr/bin:/bin")
    return folder


@pytest.fixture
def config(tmp_path: Path) -> Path:
    folder = tmp_path / "my configs %h $HOME"  # systemd specifiers and variables, escaped
    folder.mkdir()
    return write(folder, "relay.toml", CONFIG)


def unit_words(value: str, *, exec_line: bool = False) -> list[str]:
    """An ExecStart=/Environment= value as systemd splits it (quotes, %%, and $$ on an
    Exec line)."""
    words = [w.replace("%%", "%") for w in shlex.split(value)]
    return [w.replace("$$", "$") for w in words] if exec_line else words


def read_unit(path: Path) -> configparser.SectionProxy:
    parser = configparser.ConfigParser(interpolation=None, strict=True)
    parser.optionxform = str  # type: ignore[assignment,method-assign]  # keys keep case
    parser.read_string(path.read_text())
    assert parser["Install"]["WantedBy"] == "default.target"
    return parser["Service"]


def service_path(home: Path, env: str) -> list[str]:
    return env.removeprefix("PATH=").split(":")


# --- systemd -------------------------------------------------------------------------------

def test_systemd_unit(home: Path, tools: Path, config: Path, tmp_path: Path,
                      capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["service", "install", "--systemd", "--config", str(config)]) == 0
    out = capsys.readouterr().out
    unit = home / ".config" / "systemd" / "user" / "relay.service"
    assert f"wrote {unit}" in out
    assert "systemctl --user enable --now relay.service" in out

    service = read_unit(unit)
    assert unit_words(service["ExecStart"], exec_line=True) == [
        sys.executable, "-m", "relay", "serve", "--config", str(config.resolve())]
    assert service["Restart"] == "on-failure"
    assert service["ExecReload"] == "/bin/kill -HUP $MAINPID"  # SIGHUP reloads
    assert service["RestartPreventExitStatus"] == "2"
    assert service["KillSignal"] == "SIGTERM"
    assert service["KillMode"] == "mixed"
    assert int(service["TimeoutStopSec"]) > 40 + 8 + 2  # drain + interrupt grace + wait
    env_file = home / ".config" / "relay" / "env"
    assert service["EnvironmentFile"] == str(env_file)
    path_env, unbuffered = unit_words(service["Environment"])
    assert unbuffered == "PYTHONUNBUFFERED=1"
    dirs = service_path(home, path_env)
    assert dirs[0] == str(tools)  # where this shell finds node and claude
    for usual in (home / ".local" / "bin", home / ".npm-global" / "bin", "/usr/local/bin",
                  "/usr/bin", "/bin"):
        assert str(usual) in dirs

    # The env file: created empty, owner-only, in an owner-only folder.
    assert env_file.read_bytes() == b""
    assert stat.S_IMODE(env_file.stat().st_mode) == 0o600
    assert stat.S_IMODE(env_file.parent.stat().st_mode) == 0o700

    analyze = shutil.which("systemd-analyze")
    if analyze is not None:  # an extra check where the tool is installed
        runtime = tmp_path / "runtime"
        runtime.mkdir(mode=0o700)
        done = subprocess.run(
            [analyze, "--user", "verify", str(unit)], capture_output=True, text=True,
            env={**os.environ, "XDG_RUNTIME_DIR": str(runtime)}, timeout=30, check=False)
        assert done.returncode == 0, done.stderr
        assert "relay.service" not in done.stderr, done.stderr  # no warning about it


def test_systemd_uninstall_removes_the_unit_and_keeps_the_keys(
        home: Path, config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["service", "install", "--systemd", "--config", str(config)]) == 0
    unit = home / ".config" / "systemd" / "user" / "relay.service"
    wants = unit.parent / "default.target.wants" / "relay.service"
    wants.parent.mkdir()
    wants.symlink_to(unit)  # what `systemctl --user enable` does
    env_file = home / ".config" / "relay" / "env"
    env_file.write_text(f"OPENAI_API_KEY={SECRET}\n")
    capsys.readouterr()

    assert main(["service", "uninstall", "--systemd"]) == 0
    out = capsys.readouterr().out
    assert not unit.exists() and not wants.is_symlink()
    assert env_file.read_text() == f"OPENAI_API_KEY={SECRET}\n"
    assert f"kept {env_file}" in out
    assert main(["service", "uninstall", "--systemd"]) == 0
    assert "nothing to remove" in capsys.readouterr().out


def test_install_leaves_an_existing_env_file_alone_and_never_shows_it(
        home: Path, config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    env_file = home / ".config" / "relay" / "env"
    env_file.parent.mkdir(parents=True)
    env_file.write_text(f"OPENAI_API_KEY={SECRET}\n")
    env_file.chmod(0o644)
    assert main(["service", "install", "--systemd", "--config", str(config)]) == 0
    captured = capsys.readouterr()
    assert env_file.read_text() == f"OPENAI_API_KEY={SECRET}\n"
    assert stat.S_IMODE(env_file.stat().st_mode) == 0o644  # the user's file: only warned
    assert f"chmod 600 {env_file}" in captured.out
    unit = (home / ".config" / "systemd" / "user" / "relay.service").read_text()
    assert SECRET not in captured.out + captured.err + unit


def test_print_writes_nothing(home: Path, config: Path,
                              capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["service", "install", "--systemd", "--config", str(config), "--print"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("# Written by `relay service install --systemd`")
    assert "[Service]" in text and "TimeoutStopSec=" in text
    assert main(["service", "install", "--launchd", "--config", str(config), "--print"]) == 0
    agent = plistlib.loads(capsys.readouterr().out.encode())
    assert agent["Label"] == "local.relay"
    assert list(home.iterdir()) == []  # no unit, no plist, no env file, no log folder


def test_a_config_with_problems_installs_nothing(
        home: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = write(tmp_path, "bad.toml", "[server]\nprot = 1\n")
    assert main(["service", "install", "--systemd", "--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "nothing was installed" in err and "prot" in err
    assert list(home.iterdir()) == []


def test_a_token_from_the_env_file_is_accepted_and_a_missing_one_is_named(
        home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("RELAY_SVC_TOKEN", raising=False)
    cfg = write(tmp_path, "t.toml", '[server]\ntoken_env = "RELAY_SVC_TOKEN"\n' + CONFIG
                .replace("[server]\n", "", 1))
    assert main(["service", "install", "--systemd", "--config", str(cfg)]) == 0
    env_file = home / ".config" / "relay" / "env"
    assert f"RELAY_SVC_TOKEN (the token, [server] token_env) is not set: put it in " \
           f"{env_file}" in capsys.readouterr().err
    env_file.write_text("RELAY_SVC_TOKEN=tok\n")
    assert main(["service", "install", "--systemd", "--config", str(cfg)]) == 0
    assert "RELAY_SVC_TOKEN" not in capsys.readouterr().err


# --- launchd -------------------------------------------------------------------------------

def test_launchd_plist(home: Path, tools: Path, config: Path,
                       capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["service", "install", "--launchd", "--config", str(config)]) == 0
    plist = home / "Library" / "LaunchAgents" / "local.relay.plist"
    assert f"wrote {plist}" in capsys.readouterr().out
    agent: dict[str, Any] = plistlib.loads(plist.read_bytes())
    env_file = home / ".config" / "relay" / "env"
    assert agent["Label"] == "local.relay"
    assert agent["ProgramArguments"] == [sys.executable, "-m", "relay", "serve", "--config",
                                         str(config.resolve()), "--env-file", str(env_file)]
    assert agent["RunAtLoad"] is True
    assert agent["KeepAlive"] == {"SuccessfulExit": False}  # restarted on failure only
    assert agent["ExitTimeOut"] > 40 + 8 + 2
    dirs = agent["EnvironmentVariables"]["PATH"].split(":")
    assert dirs[0] == str(tools) and "/usr/bin" in dirs
    logs = home / "Library" / "Logs" / "relay"
    assert Path(agent["StandardOutPath"]).parent == logs
    assert Path(agent["StandardErrorPath"]).parent == logs
    assert logs.is_dir()
    assert stat.S_IMODE(env_file.stat().st_mode) == 0o600

    assert main(["service", "uninstall", "--launchd"]) == 0
    assert not plist.exists() and env_file.exists()


async def test_the_launch_agent_command_gets_its_keys_from_the_env_file(
        home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Run the plist's own ProgramArguments as launchd would: the token comes from the
    env file (it is nowhere else), and its value never reaches the log."""
    monkeypatch.delenv("RELAY_SVC_TOKEN", raising=False)
    cfg = write(tmp_path, "t.toml", '[server]\ntoken_env = "RELAY_SVC_TOKEN"\n' + CONFIG
                .replace("[server]\n", "", 1).replace("drain_grace_s = 40", "drain_grace_s = 1"))
    env_file = home / ".config" / "relay" / "env"
    env_file.parent.mkdir(parents=True)
    env_file.write_text(f"# keys\nexport RELAY_SVC_TOKEN=\"{SECRET}\"\n")
    assert main(["service", "install", "--launchd", "--config", str(cfg), "--print"]) == 0
    argv = plistlib.loads(capsys.readouterr().out.encode())["ProgramArguments"]
    assert argv[:4] == [*RELAY, "serve"]
    async with daemon(tmp_path, *argv[4:], "--port", "0") as (proc, log):
        assert log.url is not None, log.text
        async with httpx.AsyncClient(trust_env=False, timeout=10.0) as client:
            refused = await client.get(f"{log.url}/relay/v1/status")
            assert refused.status_code == 401
            ok = await client.get(f"{log.url}/relay/v1/status",
                                  headers={"Authorization": f"Bearer {SECRET}"})
            assert ok.status_code == 200, ok.text
        proc.send_signal(signal.SIGTERM)
        with trio.fail_after(10):
            await proc.wait()
        assert proc.returncode == 0, log.text
    assert f"environment from {env_file}: RELAY_SVC_TOKEN" in log.text
    assert SECRET not in log.text


async def test_serve_with_a_bad_env_file_exits_2(tmp_path: Path) -> None:
    write(tmp_path, "relay.toml", CONFIG)
    write(tmp_path, "env", f"GOOD=1\nthis line has {SECRET} and no equals sign\n")
    with trio.fail_after(20):
        done = await trio.run_process(
            [*RELAY, "serve", "--config", "relay.toml", "--env-file", "env", "--port", "0"],
            cwd=tmp_path, capture_stdout=True, capture_stderr=True, check=False)
    err = done.stderr.decode()
    assert done.returncode == 2, err
    assert "env: line 2: expected KEY=VALUE" in err
    assert SECRET not in err and "listening" not in err


def test_env_file_syntax() -> None:
    text = ("# a comment\n\nA=1\nexport B = two\nC='quoted value'\nD=\"x=y\"\nE=\n"
            "F=it's\n")
    assert parse_env_file(text, "env") == {"A": "1", "B": "two", "C": "quoted value",
                                           "D": "x=y", "E": "", "F": "it's"}
    with pytest.raises(ConfigError) as caught:
        parse_env_file(f"ok=1\n{SECRET}\n1BAD=x\n", "env")
    assert caught.value.problems == ["env: line 2: expected KEY=VALUE",
                                     "env: line 3: expected KEY=VALUE"]
