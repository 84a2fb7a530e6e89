"""One INFO line per HTTP exchange (issue 15, item 10; SPEC 9): method, path, status,
duration, request id, model, bytes — never a body, never a header's value, never the
query string; ``relay serve --quiet`` turns it off."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import httpx
import pytest
import trio
from helpers.assembled import chat, start_relay, wait_for

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "tok-SECRET-1234567890"
CONFIG = """
[server]
records = "records.jsonl"
token_env = "RELAY_ACCESS_TOKEN"
[providers.fake]
adapter = "fake"
models = ["echo"]
"""
LINE = re.compile(r"^(?P<method>\S+) (?P<path>\S+) (?P<status>\d+|-) (?P<ms>\d+\.\d) ms "
                  r"request=(?P<id>[0-9a-f]{16})(?: model=(?P<model>\S+))? "
                  r"in=(?P<bytes_in>\d+) B out=(?P<bytes_out>\d+) B(?: reason=(?P<reason>\S+))?$")


def lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "relay.access"]


def by_id(caplog: pytest.LogCaptureFixture, request_id: str) -> dict[str, str]:
    found = [m for line in lines(caplog) if (m := LINE.match(line)) and m["id"] == request_id]
    assert len(found) == 1, lines(caplog)      # one line per exchange
    return {k: v for k, v in found[0].groupdict().items() if v is not None}


async def test_one_line_per_exchange_and_never_a_secret(
        nursery: trio.Nursery, tmp_path: Path, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RELAY_ACCESS_TOKEN", TOKEN)
    caplog.set_level(logging.INFO, logger="relay.access")
    served = await start_relay(nursery, CONFIG, tmp_path)
    url = served.url
    auth = {"Authorization": f"Bearer {TOKEN}", "x-api-key": TOKEN,
            "Content-Type": "application/json", "Cookie": "session=COOKIE-SECRET"}
    async with httpx.AsyncClient(trust_env=False, timeout=30.0) as client:
        body = json.dumps(chat("fake/echo", "BODY-MARKER words")).encode()
        r = await client.post(f"{url}/v1/chat/completions", content=body, headers=auth)
        assert r.status_code == 200
        await wait_for(lambda: any(r.headers["x-relay-request-id"] in x
                                   for x in lines(caplog)))
        line = by_id(caplog, r.headers["x-relay-request-id"])
        assert (line["method"], line["path"], line["status"], line["model"]) == (
            "POST", "/v1/chat/completions", "200", "fake/echo")
        assert int(line["bytes_in"]) == len(body)
        assert int(line["bytes_out"]) == len(r.content)
        assert "reason" not in line

        # Streamed: the line comes at the end, with every byte that went out.
        body = json.dumps(chat("fake/echo?chunks=20", stream=True)).encode()
        r = await client.post(f"{url}/v1/chat/completions", content=body, headers=auth)
        await wait_for(lambda: any(r.headers["x-relay-request-id"] in x
                                   for x in lines(caplog)))
        line = by_id(caplog, r.headers["x-relay-request-id"])
        assert line["status"] == "200" and int(line["bytes_out"]) == len(r.content)

        # A model name that would write a log line of its own is quoted and escaped.
        forged = "nope/x\n2026-01-01 INFO relay.access: GET /forged 200"
        r = await client.post(f"{url}/v1/chat/completions", json=chat(forged), headers=auth)
        assert r.status_code == 404
        await wait_for(lambda: any(r.headers["x-relay-request-id"] in x
                                   for x in lines(caplog)))
        [text] = [x for x in lines(caplog) if r.headers["x-relay-request-id"] in x]
        assert "\n" not in text and "\\n2026-01-01" in text
        assert text.endswith("reason=unknown_model")

        # Quart routes too; the query string (where a key may be) is never written.
        r = await client.get(f"{url}/relay/v1/requests?limit=5&key=QUERY-SECRET",
                             headers=auth)
        assert r.status_code == 200
        await wait_for(lambda: any(r.headers["x-relay-request-id"] in x
                                   for x in lines(caplog)))
        line = by_id(caplog, r.headers["x-relay-request-id"])
        assert (line["method"], line["path"], line["status"]) == (
            "GET", "/relay/v1/requests?…", "200")

        # Refused by the guard: the status and the reason; no token, no line without one.
        r = await client.post(f"{url}/v1/chat/completions", json=chat("fake/echo"),
                              headers={"Authorization": "Bearer wrong-TOKEN-guess"})
        assert r.status_code == 401
        await wait_for(lambda: any(r.headers["x-relay-request-id"] in x
                                   for x in lines(caplog)))
        line = by_id(caplog, r.headers["x-relay-request-id"])
        assert (line["status"], line["reason"], line["bytes_in"]) == (
            "401", "unauthorized", "0")
    text = "\n".join(lines(caplog))
    assert len(lines(caplog)) == 5
    for secret in (TOKEN, "COOKIE-SECRET", "BODY-MARKER", "QUERY-SECRET", "wrong-TOKEN",
                   "Bearer", "words"):
        assert secret not in text, secret


LISTENING = re.compile(rb"relay listening on (http://\S+:\d+)")


async def serve_and_ask(tmp_path: Path, *flags: str) -> tuple[str, str]:
    """``relay serve`` as a child (this tree, PYTHONPATH), one chat request, SIGTERM;
    returns (the request's id, everything the daemon wrote to stderr)."""
    (tmp_path / "relay.toml").write_text(textwrap.dedent("""
        [providers.fake]
        adapter = "fake"
        models = ["echo"]
    """))
    env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}
    env["PYTHONPATH"] = str(ROOT)
    env["XDG_STATE_HOME"] = str(tmp_path / "state")
    proc = await trio.lowlevel.open_process(
        [sys.executable, "-m", "relay", "serve", "--config", "relay.toml", "--port", "0",
         *flags], cwd=tmp_path, env=env, stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    log = bytearray()
    try:
        async with trio.open_nursery() as nursery:
            listening = trio.Event()

            async def pump() -> None:
                assert proc.stderr is not None
                while chunk := await proc.stderr.receive_some():
                    log.extend(chunk)
                    if LISTENING.search(log):
                        listening.set()
                listening.set()

            nursery.start_soon(pump)
            with trio.fail_after(20):
                await listening.wait()
            found = LISTENING.search(log)
            assert found, log.decode(errors="replace")
            async with httpx.AsyncClient(trust_env=False, timeout=30.0) as client:
                r = await client.post(f"{found[1].decode()}/v1/chat/completions",
                                      json=chat("fake/echo"))
                assert r.status_code == 200
            proc.send_signal(signal.SIGTERM)   # drains, then exits: stderr is complete
            with trio.fail_after(20):
                await proc.wait()
    finally:
        if proc.returncode is None:
            proc.kill()
        with trio.CancelScope(shield=True), trio.move_on_after(5):
            await proc.wait()
    return r.headers["x-relay-request-id"], log.decode(errors="replace")


async def test_relay_serve_writes_the_line(tmp_path: Path) -> None:
    request_id, log = await serve_and_ask(tmp_path)
    [line] = [x for x in log.splitlines() if "relay.access" in x]
    assert f" request={request_id} " in line, line
    assert " INFO relay.access: POST /v1/chat/completions 200 " in line, line
    assert " model=fake/echo " in line


async def test_relay_serve_quiet_turns_it_off(tmp_path: Path) -> None:
    request_id, log = await serve_and_ask(tmp_path, "--quiet")
    assert "relay.access" not in log and "POST /v1/chat" not in log, log
    # The rest of the log is still there (the attempt's own line names the request).
    assert "relay listening on" in log and f"attempt_completed request={request_id}" in log
