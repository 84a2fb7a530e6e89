"""What a new user meets on the command line (issue 15, SPEC 9), as subprocesses.

- The packaged default's LM Studio and Ollama entries, with neither server running, say
  so plainly — in the error a client gets, in `relay check`, in the status the page shows
  (and on the page itself, in headless Chromium).
- `relay serve` on a port in use: one line naming the port and how to pick another, exit 2.
- `relay status` / `relay check` find the daemon by ``--url``, then ``RELAY_URL``, then
  the config's ``[server]`` host and port (the file ``serve`` reads), then
  127.0.0.1:8765, and print the URL they tried.
"""

from __future__ import annotations

import functools
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import trio
from helpers.assembled import chat
from helpers.daemons import FAKE_CONFIG, RELAY, child_env, daemon, run_relay, write
from helpers.page_scripts import card
from helpers.webdriver import open_browser

import relay
from relay.config import PACKAGED_DEFAULT

SAYS = {
    "lmstudio": "nothing listens on 127.0.0.1:1234 — start LM Studio's server, or remove "
                "[providers.lmstudio]",
    "ollama": "nothing listens on 127.0.0.1:11434 — start Ollama (`ollama serve`), or "
              "remove [providers.ollama]",
}


def taken(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


@pytest.fixture
def no_local_servers() -> None:
    busy = [port for port in (1234, 11434) if taken(port)]
    if busy:
        pytest.skip(f"something listens on 127.0.0.1:{busy[0]} here: the test needs the "
                    "packaged default's LM Studio and Ollama ports unused")


@pytest.fixture
def free_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    yield port


async def test_the_packaged_defaults_absent_servers_say_what_to_do(
        tmp_path: Path, no_local_servers: None) -> None:
    config = relay.load_config(PACKAGED_DEFAULT)
    async with trio.open_nursery() as nursery:
        served = await nursery.start(functools.partial(relay.serve, config, port=0))
        async with httpx.AsyncClient(trust_env=False, timeout=30.0) as client:
            r = await client.post(served.url + "/v1/chat/completions",
                                  json=chat("lmstudio/qwen3-8b"))
            assert r.status_code == 502
            error = r.json()["error"]
            assert SAYS["lmstudio"] in error["message"]
            assert error["relay"]["action"] == ("start LM Studio's server, or remove "
                                                "[providers.lmstudio] from the config")
            done = await run_relay(tmp_path, "check", "--url", served.url)
            out = done.stdout.decode()
            assert done.returncode == 1, out     # two providers failed
            lines = dict(line.split(": ", 1) for line in out.splitlines())
            assert lines["fake"].startswith("ok — connected"), out
            for name, says in SAYS.items():
                assert lines[name].startswith("FAILED — failing;"), out
                assert says in lines[name], out
                assert lines[name].count(says.partition(" — ")[2]) == 1, out  # said once
            status = (await client.get(served.url + "/relay/v1/status")).json()
            for name, says in SAYS.items():
                entry = status["providers"][name]
                assert entry["state"] == "failing"
                assert entry["state_reason"] == "upstream_unavailable"
                assert says in entry["warning"]    # what the status page shows
        nursery.cancel_scope.cancel()


async def test_the_status_page_shows_what_to_start(tmp_path: Path,
                                                   no_local_servers: None) -> None:
    config = relay.load_config(PACKAGED_DEFAULT)
    async with trio.open_nursery() as nursery:
        served = await nursery.start(functools.partial(relay.serve, config, port=0))
        async with httpx.AsyncClient(trust_env=False, timeout=30.0) as client:
            r = await client.post(served.url + "/relay/v1/providers/lmstudio/check")
            assert r.json()["outcome"] == "failed", r.text
        async with open_browser(tmp_path) as browser:
            await browser.get(served.url + "/")
            shown = await browser.wait_for(
                card("lmstudio", "warning").replace("return e ? e.textContent : null;",
                                                    "return e && !e.hidden && e.textContent;"))
            assert SAYS["lmstudio"] in shown, shown
        nursery.cancel_scope.cancel()


# --- serve on a port in use ------------------------------------------------------------

async def test_serve_on_a_port_in_use_is_one_line_and_exit_2(tmp_path: Path,
                                                             free_port: int) -> None:
    write(tmp_path, "relay.toml", FAKE_CONFIG)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", free_port))
        holder.listen()
        done = await run_relay(tmp_path, "serve", "--config", "relay.toml", "--port",
                               str(free_port))
    err = done.stderr.decode()
    assert done.returncode == 2, err
    assert err.count("\n") == 1 and err.endswith("\n"), err
    assert err.startswith(f"relay: cannot listen on 127.0.0.1:{free_port}: port {free_port} "
                          "is already in use"), err
    assert f"relay serve --port {free_port + 1}" in err and "[server] port" in err
    assert not (tmp_path / "r.jsonl").exists()


# --- where status and check look for the daemon ---------------------------------------

def env_with(tmp_path: Path, **extra: str) -> dict[str, str]:
    return {**child_env(tmp_path), **extra}


async def cli(tmp_path: Path, *args: str, cwd: Path | None = None,
              env: dict[str, str] | None = None) -> subprocess.CompletedProcess[bytes]:
    with trio.fail_after(30):
        return await trio.run_process([*RELAY, *args], cwd=cwd or tmp_path,
                                      env=env or child_env(tmp_path), capture_stdout=True,
                                      capture_stderr=True, check=False)


async def test_without_a_daemon_status_says_which_url_and_how_to_name_another(
        tmp_path: Path, free_port: int) -> None:
    write(tmp_path, "profiles.toml", f"[server]\nport = {free_port}\n"
          "[providers.fake]\nadapter = \"fake\"\n")
    done = await cli(tmp_path, "status")
    err = done.stderr.decode()
    assert done.returncode == 1, err
    assert (f"relay: asking the daemon at http://127.0.0.1:{free_port} (from [server] host "
            "and port of profiles.toml)") in err
    assert f"cannot reach relay at http://127.0.0.1:{free_port}" in err
    assert "--url" in err and "RELAY_URL" in err
    assert "Traceback" not in err


async def test_status_and_check_find_the_daemon_the_config_names(
        tmp_path: Path, free_port: int) -> None:
    served_dir = tmp_path / "served"
    served_dir.mkdir()
    config = write(served_dir, "profiles.toml", FAKE_CONFIG.replace(
        "[server]\n", f"[server]\nport = {free_port}\n"))
    async with daemon(served_dir) as (_proc, log):
        url = f"http://127.0.0.1:{free_port}"
        assert log.url == url, log.text
        # ./profiles.toml, as `relay serve` found it in the same folder.
        for args in (("status",), ("check", "fake")):
            done = await cli(served_dir, *args)
            assert done.returncode == 0, done.stderr.decode()
            assert f"asking the daemon at {url} (from [server] host and port of " \
                   "profiles.toml)" in done.stderr.decode()
        assert done.stdout.decode().startswith("fake: ok — connected")
        # --config from another folder.
        done = await cli(tmp_path, "status", "--config", str(config))
        assert done.returncode == 0, done.stderr.decode()
        assert f"asking the daemon at {url} (from [server] host and port of {config})" \
            in done.stderr.decode()
        assert done.stdout.decode().split()[:2] == ["PROVIDER", "ADAPTER"]
        # RELAY_URL wins over the config; --url wins over RELAY_URL.
        dead = f"http://127.0.0.1:{free_port + 1 if free_port < 65535 else 1}"
        done = await cli(served_dir, "status", env=env_with(tmp_path, RELAY_URL=dead))
        assert done.returncode == 1
        assert f"asking the daemon at {dead} (from RELAY_URL)" in done.stderr.decode()
        done = await cli(served_dir, "status", "--url", url,
                         env=env_with(tmp_path, RELAY_URL=dead))
        assert done.returncode == 0, done.stderr.decode()
        assert f"asking the daemon at {url} (from --url)" in done.stderr.decode()


async def test_without_a_usable_config_status_tries_127_0_0_1_8765(tmp_path: Path) -> None:
    if taken(8765):   # then it would ask someone else's daemon
        pytest.skip("something listens on 127.0.0.1:8765 here; the test asks that address")
    done = await cli(tmp_path, "status", "--config", "missing.toml")
    err = done.stderr.decode()
    assert "asking the daemon at http://127.0.0.1:8765 (from relay's default; " \
           "missing.toml could not be read" in err, err
    # Without --config, in a folder with no profiles.toml: the packaged default's address.
    done = await cli(tmp_path, "status", env=env_with(tmp_path, RELAY_URL=""))
    assert "asking the daemon at http://127.0.0.1:8765 (from [server] host and port of " \
           "the packaged default config)" in done.stderr.decode()
