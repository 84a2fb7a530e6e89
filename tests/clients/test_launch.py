"""``relay launch AGENT`` (SPEC 9, issue 36 item 2): each coding agent answers through
relay with no set-up of its own, and the user's files stay as they were.

- The real agents (``claude``, ``codex``, ``gemini``, ``qwen``, ``opencode`` — installed
  by `.ci/install-clis.sh` — and ``aider``, in a venv of its own there), each run by
  ``relay launch`` inside a network namespace that has only loopback, against
  ``relay serve`` on the packaged default config: each answers (rc 0, the fake's echo of
  the prompt), the record shows its request on ``fake/echo``, and the files of a fake
  HOME full of the user's own settings for every agent keep their bytes. Claude Code,
  Codex and the Gemini CLI send their own default model names, which the packaged
  default's pattern routes (SPEC F9) send to the fake; Qwen Code, opencode and aider
  take relay's first model, ``fake/echo``. A test skips, saying why,
  when its agent, ``ip netns`` or root is missing.
- A stand-in agent (a script named like the real one) shows what ``relay launch`` hands
  over — variables, flags, a settings file — and that it exits with the agent's code and
  passes SIGTERM on; ``--print`` shows the same with the token masked; with no relay
  running, one line says how to start it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
from helpers import netns_stage
from helpers.assembled import start_relay
from helpers.daemons import RELAY, child_env

from relay.assembly.launch import AGENTS
from relay.config import PACKAGED_DEFAULT

PROMPT = "Say hello."

# The user's own files, one or more per agent: relay must leave every byte as it is.
USER_FILES = {
    ".claude/settings.json": '{"theme": "dark", "env": {"MY_SETTING": "kept"}}\n',
    ".codex/config.toml": 'model = "gpt-5-codex"\n[model_providers.mine]\nname = "mine"\n'
                          'base_url = "http://127.0.0.1:9/v1"\n',
    ".gemini/settings.json": '{"ui": {"theme": "GitHub"}}\n',
    # (Qwen Code itself rewrites a settings file without its current "$version")
    ".qwen/settings.json": '{"ui": {"theme": "GitHub"}, "$version": 4}\n',
    ".config/opencode/opencode.json": '{"$schema": "https://opencode.ai/config.json", '
                                      '"theme": "system"}\n',
    ".aider.conf.yml": "dark-mode: true\n",
}

# (agent, its arguments, relay launch's own options): each answers PROMPT in one turn.
RUNS = [
    # Claude Code, Codex and the Gemini CLI send their own default model names: the
    # packaged default's pattern routes (SPEC F9) send them to the fake.
    ("claude", ["-p", PROMPT], []),
    ("codex", ["exec", "--skip-git-repo-check", PROMPT], []),
    ("gemini", ["-p", PROMPT, "--skip-trust"], []),
    ("qwen", ["-p", PROMPT], []),
    ("opencode", ["run", PROMPT], []),
    ("aider", ["--message", PROMPT, "--no-git", "--dry-run", "--yes-always"], []),
]


class Stage(netns_stage.Stage):
    """The namespace with ``relay serve`` on the packaged default (records kept here)."""

    tool = "ip"  # (each test checks for its own agent)
    fakes = "agent_fakes.py"

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.name = f"relaylaunch-{os.getpid()}"

    def config(self, ports: dict[str, int]) -> str:
        text = PACKAGED_DEFAULT.read_text(encoding="utf-8")
        return text.replace("[server]\n", '[server]\nrecords = "records.jsonl"\n', 1)


@pytest.fixture(scope="module")
def stage() -> Iterator[Stage]:
    yield from netns_stage.open_stage(Stage, "iproute2", "the coding agents")


def snapshot(home: Path) -> dict[str, bytes]:
    return {str(p.relative_to(home)): p.read_bytes() for p in home.rglob("*")
            if p.is_file() and not p.is_symlink()}


@pytest.mark.parametrize(("agent", "args", "options"), RUNS, ids=[r[0] for r in RUNS])
def test_each_agent_answers_through_relay_and_leaves_the_users_files(
        stage: Stage, tmp_path: Path, agent: str, args: list[str],
        options: list[str]) -> None:
    if shutil.which(AGENTS[agent].command) is None:
        pytest.skip(f"`{agent}` is not installed ({AGENTS[agent].install}; "
                    ".ci/install-clis.sh installs it)")
    home, work = tmp_path / "home", tmp_path / "work"
    work.mkdir()
    for name, text in USER_FILES.items():
        (home / name).parent.mkdir(parents=True, exist_ok=True)
        (home / name).write_text(text)
    before = snapshot(home)
    # The Gemini CLI reads a settings file only below folders nobody else may write to:
    # the runtime folder a login session has (/run/user/UID), not /tmp.
    runtime = Path(tempfile.mkdtemp(prefix="relay-launch-", dir="/run"))
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home),
           "TMPDIR": str(home), "XDG_RUNTIME_DIR": str(runtime),
           "PYTHONPATH": str(netns_stage.ROOT), "RELAY_URL": stage.url}
    seen = len(stage.records())
    try:
        done = subprocess.run(["ip", "netns", "exec", stage.name, sys.executable, "-m",
                               "relay", "launch", agent, *options, *args], cwd=work,
                              env=env, stdin=subprocess.DEVNULL, capture_output=True,
                              timeout=180, check=False)
    finally:
        leftovers = list((runtime / "relay").glob("*")) if (runtime / "relay").exists() else []
        shutil.rmtree(runtime, ignore_errors=True)
    out, err = done.stdout.decode(errors="replace"), done.stderr.decode(errors="replace")
    assert done.returncode == 0, (out[-2000:], err[-3000:])
    assert PROMPT in out  # the fake's echo: the answer came through relay
    new = stage.records()[seen:]
    assert new and all(r["provider"] == "fake" and r["model"] == "echo" for r in new), new
    assert any(r["status"] == 200 for r in new)
    after = snapshot(home)
    assert {name: after.get(name) for name in before} == before  # every byte kept
    assert leftovers == []  # the temporary settings are gone


# --- what relay launch hands over, with a stand-in agent ----------------------------------

STAND_IN = """#!{python}
import json, os, signal, sys, time
from pathlib import Path
seen = {{"argv": sys.argv[1:], "env": dict(os.environ), "files": {{}}}}
for name in ("GEMINI_CLI_SYSTEM_SETTINGS_PATH", "QWEN_CODE_SYSTEM_SETTINGS_PATH"):
    if name in os.environ:
        seen["files"][name] = Path(os.environ[name]).read_text()
signal.signal(signal.SIGTERM, lambda *_: sys.exit(42))
Path(os.environ["STAND_IN_OUT"]).write_text(json.dumps(seen))
if "--wait" in sys.argv:
    time.sleep(60)
sys.exit(int(os.environ.get("STAND_IN_RC", "0")))
"""

TOKEN_CONFIG = """
[server]
token_env = "LAUNCH_TEST_TOKEN"
records = "records.jsonl"
[providers.fake]
adapter = "fake"
models = ["echo"]
"""
TOKEN = "sk-launch-secret-0123456789"


def stand_ins(folder: Path) -> Path:
    folder.mkdir()
    for agent in AGENTS.values():
        script = folder / agent.command
        script.write_text(STAND_IN.format(python=sys.executable))
        script.chmod(0o755)
    return folder


def launch_env(tmp_path: Path, url: str, **extra: str) -> dict[str, str]:
    env = child_env(tmp_path)
    env.update(PATH=f"{tmp_path / 'bin'}{os.pathsep}{env.get('PATH', '')}",
               RELAY_URL=url, RELAY_TOKEN=TOKEN, STAND_IN_OUT=str(tmp_path / "seen"),
               ANTHROPIC_API_KEY="sk-ant-users-own", XDG_RUNTIME_DIR=str(tmp_path / "run"))
    env.update(extra)
    (tmp_path / "run").mkdir(exist_ok=True, mode=0o700)
    return env


async def launch(tmp_path: Path, env: dict[str, str], *args: str,
                 ) -> subprocess.CompletedProcess[bytes]:
    with trio.fail_after(60):
        return await trio.run_process([*RELAY, "launch", *args], cwd=tmp_path, env=env,
                                      capture_stdout=True, capture_stderr=True, check=False)


async def test_launch_hands_each_agent_relays_url_key_and_model(
        nursery: trio.Nursery, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LAUNCH_TEST_TOKEN", TOKEN)
    served = await start_relay(nursery, TOKEN_CONFIG.replace(
        'records = "records.jsonl"', f'records = "{tmp_path}/records.jsonl"'), tmp_path)
    stand_ins(tmp_path / "bin")
    env = launch_env(tmp_path, served.url, STAND_IN_RC="3")
    seen: dict[str, Any] = {}
    for agent in AGENTS:
        done = await launch(tmp_path, env, agent, "--model", "fake/echo", "-x", "--", "--url")
        assert done.returncode == 3, done.stderr.decode()  # the agent's own code
        seen[agent] = json.loads((tmp_path / "seen").read_text())
        # What relay does not take, and all after "--", reaches the agent, in order.
        assert seen[agent]["argv"][-2:] == ["-x", "--url"]
    url = served.url
    claude = seen["claude"]["env"]
    assert (claude["ANTHROPIC_BASE_URL"], claude["ANTHROPIC_AUTH_TOKEN"]) == (url, TOKEN)
    assert "ANTHROPIC_API_KEY" not in claude  # the user's own key is not sent to relay
    assert claude["ANTHROPIC_MODEL"] == claude["ANTHROPIC_SMALL_FAST_MODEL"] == "fake/echo"
    assert claude["CLAUDE_CODE_MAX_RETRIES"] == "0"
    assert claude["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"] == "1"
    codex = seen["codex"]
    assert seen["codex"]["env"]["RELAY_LAUNCH_KEY"] == TOKEN
    overrides = codex["argv"][1:-2:2]
    assert f'model_providers.relay.base_url="{url}/v1"' in overrides
    assert 'model="fake/echo"' in overrides and "analytics.enabled=false" in overrides
    assert "model_providers.relay.request_max_retries=0" in overrides
    gemini = seen["gemini"]
    assert (gemini["env"]["GOOGLE_GEMINI_BASE_URL"], gemini["env"]["GEMINI_API_KEY"],
            gemini["env"]["GEMINI_MODEL"]) == (url, TOKEN, "fake/echo")
    settings = json.loads(gemini["files"]["GEMINI_CLI_SYSTEM_SETTINGS_PATH"])
    assert settings["security"]["auth"]["selectedType"] == "gemini-api-key"
    assert settings["general"]["maxAttempts"] == 1
    assert settings["privacy"]["usageStatisticsEnabled"] is False
    qwen = seen["qwen"]
    assert (qwen["env"]["OPENAI_BASE_URL"], qwen["env"]["OPENAI_API_KEY"],
            qwen["env"]["OPENAI_MODEL"]) == (f"{url}/v1", TOKEN, "fake/echo")
    assert json.loads(qwen["files"]["QWEN_CODE_SYSTEM_SETTINGS_PATH"])["model"][
        "generationConfig"]["maxRetries"] == 0
    opencode = json.loads(seen["opencode"]["env"]["OPENCODE_CONFIG_CONTENT"])
    assert opencode["model"] == "relay/fake/echo"
    assert opencode["provider"]["relay"]["options"] == {"baseURL": f"{url}/v1",
                                                        "apiKey": TOKEN}
    aider = seen["aider"]["env"]
    assert (aider["OPENAI_API_BASE"], aider["OPENAI_API_KEY"], aider["AIDER_MODEL"]) == (
        f"{url}/v1", TOKEN, "openai/fake/echo")
    # The temporary settings went with the agent.
    assert list((tmp_path / "run" / "relay").iterdir()) == []

    # --print: the same, nothing run, the token masked.
    (tmp_path / "seen").unlink()
    for agent in AGENTS:
        done = await launch(tmp_path, env, agent, "--print", "-p", "hi")
        shown = done.stdout.decode()
        assert done.returncode == 0 and TOKEN not in shown and "…masked…" in shown, shown
        assert url in shown and shown.splitlines()[-1].startswith(f"{agent} ")
        assert shown.splitlines()[-1].endswith("-p hi")
        assert not (tmp_path / "seen").exists()
    shown = (await launch(tmp_path, env, "opencode", "--print")).stdout.decode()
    assert "model: fake/echo" in shown  # relay's first model, for an agent with none
    assert "unset ANTHROPIC_API_KEY" in (await launch(tmp_path, env, "claude", "--print")
                                         ).stdout.decode()


async def test_launch_passes_sigterm_on_and_exits_with_the_agents_code(
        nursery: trio.Nursery, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LAUNCH_TEST_TOKEN", TOKEN)
    served = await start_relay(nursery, TOKEN_CONFIG.replace(
        'records = "records.jsonl"', f'records = "{tmp_path}/records.jsonl"'), tmp_path)
    stand_ins(tmp_path / "bin")
    env = launch_env(tmp_path, served.url)
    proc = await trio.lowlevel.open_process([*RELAY, "launch", "gemini", "--wait"],
                                            cwd=tmp_path, env=env)
    try:
        with trio.fail_after(30):
            while not (tmp_path / "seen").exists():  # the agent has started
                await trio.sleep(0.02)
            proc.send_signal(15)
            assert await proc.wait() == 42  # the stand-in's answer to SIGTERM
    finally:
        proc.kill()


async def test_launch_without_a_relay_says_how_to_start_it(tmp_path: Path) -> None:
    stand_ins(tmp_path / "bin")
    env = launch_env(tmp_path, "http://127.0.0.1:9")
    done = await launch(tmp_path, env, "claude", "-p", "hi")
    err = done.stderr.decode().strip()
    assert done.returncode == 1 and len(err.splitlines()) == 1, err
    assert "http://127.0.0.1:9" in err and "relay serve" in err
    assert not (tmp_path / "seen").exists()  # the agent never ran


async def test_launch_of_an_agent_not_installed_says_how_to_install_it(
        tmp_path: Path) -> None:
    env = launch_env(tmp_path, "http://127.0.0.1:9", PATH=str(tmp_path / "empty"))
    done = await launch(tmp_path, env, "qwen")
    assert done.returncode == 127
    assert "npm install -g @qwen-code/qwen-code" in done.stderr.decode()
