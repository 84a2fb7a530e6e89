"""SIGTERM drains `relay serve` (SPEC O3, issue 8): a real subprocess, a full lane.

One lane, four requests: A runs (it ends within the grace), B waits and then also ends
within the grace, C (streamed) and D wait behind them and would take a minute. On SIGTERM
relay stops accepting, A and B get their answers, C gets an in-band ``shutting_down``
error once its headers are out, D a plain 503; every request has its record, the stopped
ones with the time the stop was asked (and, for the one that held the lane, when it was
released); the process exits 0 within the grace plus one second. A second signal stops
at once.
"""

from __future__ import annotations

import datetime as dt
import json
import signal
from pathlib import Path
from typing import Any

import httpx
import trio
from helpers.assembled import chat, records, wait_for
from helpers.daemons import daemon, write

GRACE_S = 3.0
CONFIG = f"""
[server]
records = "r.jsonl"
drain_grace_s = {GRACE_S}
[providers.slow]
adapter = "fake"
models = ["echo"]
[providers.slow.profile]
lanes = 1
queue_max = 8
queue_timeout_s = 120
run_timeout_s = 120
"""


class Outcome:
    def __init__(self) -> None:
        self.status: int | None = None
        self.body = ""
        self.headers: dict[str, str] = {}
        self.done_at: float | None = None
        self.error: Exception | None = None


async def send(client: httpx.AsyncClient, url: str, body: dict[str, Any],
               out: Outcome) -> None:
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
            out.status, out.headers = r.status_code, dict(r.headers)
            async for text in r.aiter_text():
                out.body += text
    except httpx.TransportError as exc:
        out.error = exc
    out.done_at = trio.current_time()


async def lanes(client: httpx.AsyncClient, url: str) -> tuple[int, int]:
    lane = (await client.get(f"{url}/relay/v1/status")).json()["providers"]["slow"]["lanes"]
    return lane["running"], lane["queued"]


async def wait_lanes(client: httpx.AsyncClient, url: str, want: tuple[int, int]) -> None:
    with trio.fail_after(10):
        while await lanes(client, url) != want:
            await trio.sleep(0.02)


async def test_sigterm_drains_answers_what_fits_and_stops_the_rest(tmp_path: Path) -> None:
    write(tmp_path, "relay.toml", CONFIG)
    outcomes = {name: Outcome() for name in "ABCD"}
    bodies = {
        "A": chat("slow/echo?delay_s=2", "answer A"),       # running at SIGTERM; ends in it
        "B": chat("slow/echo?delay_s=0.3", "answer B"),     # queued; ends within the grace
        "C": chat("slow/echo?delay_s=60", "never", stream=True),  # runs, then is stopped
        "D": chat("slow/echo?delay_s=60", "never"),         # still queued: stopped there
    }
    async with daemon(tmp_path, "--config", "relay.toml", "--port", "0") as (proc, log):
        url = log.url
        assert url is not None, log.text
        async with httpx.AsyncClient(trust_env=False, timeout=30.0) as client, \
                trio.open_nursery() as nursery:
            for n, name in enumerate("ABCD"):
                nursery.start_soon(send, client, url, bodies[name], outcomes[name])
                await wait_lanes(client, url, (1, n))
            sent_at = trio.current_time()
            proc.send_signal(signal.SIGTERM)

            # It stops accepting: a new request is refused (or, if it slipped in as the
            # listener closed, told that relay is shutting down).
            await wait_for(lambda: "draining" in log.text, limit_s=5)
            async with httpx.AsyncClient(trust_env=False, timeout=5.0) as fresh:
                try:
                    late = await fresh.post(f"{url}/v1/chat/completions",
                                            json=chat("slow/echo"))
                except httpx.ConnectError:
                    pass
                else:
                    assert late.status_code == 503, late.text
            with trio.fail_after(GRACE_S + 5):
                await proc.wait()
            exited_after = trio.current_time() - sent_at
        assert proc.returncode == 0, log.text
    assert GRACE_S - 0.2 <= exited_after <= GRACE_S + 1.0, exited_after
    assert "Traceback" not in log.text, log.text

    a, b, c, d = (outcomes[name] for name in "ABCD")
    for answered, text in ((a, "answer A"), (b, "answer B")):
        assert answered.status == 200 and answered.error is None, answered.body
        assert json.loads(answered.body)["choices"][0]["message"]["content"] == text
        assert answered.done_at is not None and answered.done_at > sent_at  # in the drain
    assert c.status == 200 and c.error is None  # headers were out: the error is in-band
    events = [line[6:] for line in c.body.splitlines() if line.startswith("data: ")]
    assert "[DONE]" not in events, c.body
    assert json.loads(events[-1])["error"]["code"] == "shutting_down", c.body
    assert d.status == 503 and d.error is None, d.body
    assert json.loads(d.body)["error"]["code"] == "shutting_down"
    assert d.headers.get("retry-after"), d.headers

    by_text = _records_by_request(tmp_path)
    assert len(records(tmp_path, "r.jsonl")) == 4 and set(by_text) == set("ABCD"), \
        records(tmp_path, "r.jsonl")
    for name in "AB":
        assert by_text[name]["status"] == 200
        assert by_text[name]["stop_requested_at"] is None
    for name in "CD":
        stopped = by_text[name]
        assert (stopped["status"], stopped["reason"]) == (503, "shutting_down"), stopped
        assert stopped["stop_requested_at"] is not None, stopped
    # C held the lane: released after the stop was asked, and promptly.
    lag = _seconds(by_text["C"]["released_at"]) - _seconds(by_text["C"]["stop_requested_at"])
    assert 0 <= lag < 1.0, by_text["C"]
    # D never held one: nothing to release.
    assert by_text["D"]["released_at"] is None
    assert all(att["released_at"] is None for att in by_text["D"]["attempts"])


def _seconds(iso: str) -> float:
    return dt.datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


def _records_by_request(tmp_path: Path) -> dict[str, dict[str, Any]]:
    """Records matched to the requests A-D by their order of arrival (one lane, FIFO:
    the fake's delay in the model name tells them apart)."""
    out: dict[str, dict[str, Any]] = {}
    for rec in records(tmp_path, "r.jsonl"):
        delay = rec["model"].partition("delay_s=")[2]
        if delay == "2":
            out["A"] = rec
        elif delay == "0.3":
            out["B"] = rec
        elif rec["stream"]:
            out["C"] = rec
        else:
            out["D"] = rec
    return out


async def test_a_second_sigterm_stops_at_once(tmp_path: Path) -> None:
    write(tmp_path, "relay.toml", CONFIG.replace(f"drain_grace_s = {GRACE_S}",
                                                 "drain_grace_s = 60"))
    out = Outcome()
    async with daemon(tmp_path, "--config", "relay.toml", "--port", "0") as (proc, log):
        url = log.url
        assert url is not None, log.text
        async with httpx.AsyncClient(trust_env=False, timeout=30.0) as client, \
                trio.open_nursery() as nursery:
            nursery.start_soon(send, client, url, chat("slow/echo?delay_s=60", "x"), out)
            await wait_lanes(client, url, (1, 0))
            proc.send_signal(signal.SIGTERM)
            await wait_for(lambda: "draining" in log.text, limit_s=5)
            sent_at = trio.current_time()
            proc.send_signal(signal.SIGTERM)
            with trio.fail_after(10):
                await proc.wait()
            stopped_after = trio.current_time() - sent_at
            with trio.fail_after(5):
                while out.done_at is None:
                    await trio.sleep(0.02)
        assert proc.returncode == 0, log.text
    assert stopped_after < 2.0, stopped_after  # not the 60 s grace
    assert "second signal: stopping now" in log.text
    assert "Traceback" not in log.text, log.text
    assert out.error is not None or out.status == 503, (out.status, out.body)
    recs = records(tmp_path, "r.jsonl")
    assert len(recs) == 1, recs  # even stopped at once, the request has its record
    assert recs[0]["reason"] == "shutting_down" and recs[0]["stop_requested_at"], recs[0]
