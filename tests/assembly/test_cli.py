"""The real command line (SPEC 9), run as subprocesses: ``python -m relay ...``.

Every child runs in the test's own folder with XDG_STATE_HOME inside it; every wait is
bounded, and a daemon is always killed in ``finally``.
"""

from __future__ import annotations

import gc
import logging
import re
import signal
import sys
import sysconfig
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from helpers.assembled import FAKE_ONLY, chat, records, start_relay, wait_for
from helpers.daemons import (
    FAKE_CONFIG,
    child_env,
    daemon,
    run_relay,
    write,
)

# --- config check / serve with a bad config -------------------------------------------------

async def test_config_check_prints_every_problem_and_exits_2(tmp_path: Path) -> None:
    write(tmp_path, "bad.toml", """
        [server]
        prot = 8765
        [providers.x]
        adapter = "nope"
    """)
    done = await run_relay(tmp_path, "config", "check", "--config", "bad.toml")
    err = done.stderr.decode()
    assert done.returncode == 2, err
    lines = [line.strip() for line in err.splitlines()]
    typo = [line for line in lines if "[server]" in line and "prot" in line]
    kind = [line for line in lines if "[providers.x] adapter" in line and "'nope'" in line]
    assert len(typo) == 1 and typo[0].startswith("bad.toml: "), err
    assert len(kind) == 1 and kind[0].startswith("bad.toml: "), err
    assert "fake" in kind[0] and "openai" in kind[0]  # the known kinds
    assert "Traceback" not in err
    assert done.stdout == b""  # nothing resolved is printed for a bad config


async def test_serve_with_a_bad_config_exits_2_and_never_listens(tmp_path: Path) -> None:
    write(tmp_path, "bad.toml", """
        [providers.lm]
        adapter = "openai"
        preset = "lmstudio"
        [providers.lm.profile]
        run_timeout_s = 30
    """)
    done = await run_relay(tmp_path, "serve", "--config", "bad.toml", "--port", "0")
    err = done.stderr.decode()
    assert done.returncode == 2, err
    assert "[providers.lm.profile] run_timeout_s" in err
    assert "bad.toml" in err
    assert "listening" not in err
    assert "Traceback" not in err
    assert not (tmp_path / "state").exists()  # nothing was started, nothing recorded


async def test_config_check_without_config_uses_the_packaged_default(tmp_path: Path) -> None:
    done = await run_relay(tmp_path, "config", "check")  # tmp_path holds no profiles.toml
    out = done.stdout.decode()
    assert done.returncode == 0, done.stderr.decode()
    providers = re.findall(r"^  (\w+): adapter (\S+);", out, re.MULTILINE)
    assert providers == [("fake", "fake"), ("lmstudio", "openai"), ("ollama", "openai")], out
    lmstudio = next(line for line in out.splitlines() if line.startswith("  lmstudio:"))
    assert "lanes 1," in lmstudio and "run_timeout 180 s" in lmstudio  # SPEC L5
    assert re.search(r"^config: .*profiles\.toml$", out, re.MULTILINE), out
    assert f"records: {tmp_path / 'state' / 'relay'}" in out  # SPEC A5: the state dir


async def test_config_check_prints_warnings_but_succeeds(tmp_path: Path) -> None:
    write(tmp_path, "profiles.toml", """
        [providers.lm]
        adapter = "openai"
        preset = "lmstudio"
        [providers.lm.profile]
        queue_timeout_s = 5
    """)
    done = await run_relay(tmp_path, "config", "check")  # ./profiles.toml wins
    err = done.stderr.decode()
    assert done.returncode == 0, err
    assert "profiles.toml: [providers.lm.profile] queue_timeout_s: WARNING" in err
    out = done.stdout.decode()
    assert "  lm: adapter openai; lanes 1," in out
    assert "fake" not in out


# --- the daemon ------------------------------------------------------------------------------

async def test_serve_answers_reports_status_and_drains_on_sigterm(tmp_path: Path) -> None:
    write(tmp_path, "relay.toml", FAKE_CONFIG)
    async with daemon(tmp_path, "--config", "relay.toml", "--port", "0") as (proc, log):
        assert log.url is not None, f"the daemon did not start:\n{log.text}"
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+", log.url), log.url
        assert not log.url.endswith(":0")  # --port 0: the bound port is reported
        async with httpx.AsyncClient(trust_env=False, timeout=10.0) as client:
            r = await client.post(f"{log.url}/v1/chat/completions",
                                  json=chat("fake/echo", "hello from the cli"))
            assert r.status_code == 200, r.text
            body: dict[str, Any] = r.json()
            assert body["choices"][0]["message"]["content"] == "hello from the cli"
        await wait_for(lambda: len(records(tmp_path, "r.jsonl")) == 1)

        status = await run_relay(tmp_path, "status", "--url", log.url)
        out = status.stdout.decode()
        assert status.returncode == 0, status.stderr.decode()
        header, *rows = out.splitlines()
        assert header.split() == ["PROVIDER", "ADAPTER", "STATE", "RUNNING", "QUEUED",
                                  "MODELS"], out
        fake = [row for row in rows if row.split()[0] == "fake"]
        assert len(fake) == 1, out
        at = header.index("RUNNING")
        assert fake[0][at:].split()[0] == "0/4", out
        assert fake[0][header.index("QUEUED"):].split()[0] == "0/64", out
        assert fake[0].split()[1] == "fake"

        proc.send_signal(signal.SIGTERM)
        with trio.fail_after(5):
            await proc.wait()
        assert proc.returncode == 0, log.text
    recs = records(tmp_path, "r.jsonl")
    assert len(recs) == 1
    assert recs[0]["provider"] == "fake" and recs[0]["status"] == 200
    assert not (tmp_path / "state").exists()  # the file named its own records path


async def test_serve_host_flag_off_loopback_needs_a_token(tmp_path: Path) -> None:
    write(tmp_path, "relay.toml", FAKE_CONFIG)
    async with daemon(tmp_path, "--config", "relay.toml", "--host", "0.0.0.0",
                      "--port", "0") as (proc, log):
        assert log.url is None, f"it listens on {log.url} with no token:\n{log.text}"
        with trio.fail_after(5):
            await log.closed.wait()
        with trio.fail_after(5):
            await proc.wait()
        assert proc.returncode == 2, log.text
        assert "[server] token_env" in log.text
        assert "[server] allowed_hosts" in log.text


async def test_status_without_a_daemon_fails_cleanly(tmp_path: Path) -> None:
    done = await run_relay(tmp_path, "status", "--url", "http://127.0.0.1:1")
    err = done.stderr.decode()
    assert done.returncode == 1, err
    assert "cannot reach relay at http://127.0.0.1:1" in err
    assert "Traceback" not in err


# --- help ----------------------------------------------------------------------------------

async def test_module_help(tmp_path: Path) -> None:
    done = await run_relay(tmp_path, "--help")
    assert done.returncode == 0, done.stderr.decode()
    out = done.stdout.decode()
    assert out.startswith("usage: relay")
    for command in ("serve", "config", "status"):
        assert command in out


async def test_console_script_help(tmp_path: Path) -> None:
    script = Path(sysconfig.get_path("scripts")) / "relay"
    if not script.exists():
        pytest.skip(f"relay is not installed in {sys.prefix} (no console script)")
    with trio.fail_after(20):
        done = await trio.run_process([str(script), "serve", "--help"], cwd=tmp_path,
                                      env=child_env(tmp_path), capture_stdout=True,
                                      capture_stderr=True, check=False)
    assert done.returncode == 0, done.stderr.decode()
    out = done.stdout.decode()
    for flag in ("--config", "--host", "--port"):
        assert flag in out


async def test_no_command_is_a_usage_error(tmp_path: Path) -> None:
    done = await run_relay(tmp_path)
    assert done.returncode == 2
    assert b"usage: relay" in done.stderr


async def test_sighup_reloads_and_check_runs(tmp_path: Path) -> None:
    write(tmp_path, "relay.toml", FAKE_CONFIG)
    async with daemon(tmp_path, "--config", "relay.toml", "--port", "0") as (proc, log):
        assert log.url is not None, log.text
        write(tmp_path, "relay.toml", FAKE_CONFIG + "\n[providers.fake.profile]\nlanes = 7\n")
        proc.send_signal(signal.SIGHUP)

        async def capacity() -> int:
            async with httpx.AsyncClient(trust_env=False, timeout=10.0) as client:
                r = await client.get(f"{log.url}/relay/v1/status")
                return int(r.json()["providers"]["fake"]["lanes"]["capacity"])

        with trio.fail_after(10):
            while await capacity() != 7:
                await trio.sleep(0.05)
        checked = await run_relay(tmp_path, "check", "--url", log.url)
        assert checked.returncode == 0, checked.stderr.decode()
        assert checked.stdout.decode().startswith("fake: ok — connected"), checked.stdout
        proc.send_signal(signal.SIGTERM)
        with trio.fail_after(5):
            await proc.wait()
        assert proc.returncode == 0


async def test_serve_sets_the_daemons_gc_threshold_and_embedding_keeps_its_own(
        tmp_path: Path) -> None:
    # `relay serve` collects young objects every 10,000, not every 700 (what a request or
    # a waiting notice holds briefly is freed before a collection moves it into the old
    # generation, whose full passes walk every waiting request); the rest of Python's
    # thresholds stay. Its log records skip the caller's frame (its format names no
    # file or line). An embedding program's collector and logging are its own: serving
    # relay from it changes neither.
    write(tmp_path, "relay.toml", FAKE_CONFIG)
    probe = ("import gc, logging, sys; import relay.assembly.cli as cli; "
             "cli._run_daemon = lambda config: print(*gc.get_threshold(), "
             "int(logging._srcfile is None)) or 0; "
             "sys.exit(cli.main(['serve', '--config', 'relay.toml']))")
    with trio.fail_after(20):
        done = await trio.run_process([sys.executable, "-c", probe], cwd=tmp_path,
                                      env=child_env(tmp_path), capture_stdout=True,
                                      capture_stderr=True, check=False)
    assert done.returncode == 0, done.stderr.decode()
    young, *older, no_caller = map(int, done.stdout.split())
    assert young == 10_000 and older == list(gc.get_threshold()[1:])
    assert no_caller == 1

    before = gc.get_threshold()
    srcfile = logging._srcfile
    assert srcfile is not None
    async with trio.open_nursery() as nursery:
        served = await start_relay(nursery, FAKE_ONLY, tmp_path)
        async with httpx.AsyncClient() as client:
            resp = await client.post(f"{served.url}/v1/chat/completions", json=chat("echo"))
            assert resp.status_code == 200
        assert gc.get_threshold() == before
        assert logging._srcfile == srcfile
        nursery.cancel_scope.cancel()
