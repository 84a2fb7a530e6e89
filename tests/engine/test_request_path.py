"""The request path on virtual time: run timeouts, waiting notices, heartbeats, drains.

The assembled relay (config → `open_relay` → its ASGI app) driven by an in-memory ASGI
client, so every timing below is exact.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from helpers.assembled import ASGIResult, asgi_request, chat, config_from, sse_events

from relay import Relay, open_relay

CONFIG = """
[server]
records = "records.jsonl"
heartbeat_s = 15
[providers.fake]
adapter = "fake"
models = ["echo"]
[providers.fake.profile]
lanes = 1
queue_max = 2
queue_timeout_s = 100
run_timeout_s = 50
interrupt_grace_s = 3
"""


@pytest.fixture
async def relay_(tmp_path: Path) -> AsyncIterator[Relay]:
    async with open_relay(config_from(CONFIG, tmp_path), discover=False) as r:
        yield r


def start(nursery: trio.Nursery, r: Relay, body: dict[str, Any],
          headers: dict[str, str] | None = None) -> ASGIResult:
    result = ASGIResult()
    nursery.start_soon(lambda: asgi_request(r.app, "/v1/chat/completions", body, result,
                                            headers=headers))
    return result


def stats(r: Relay) -> tuple[int, int]:
    s = r.providers["fake"].lane.statistics()
    return s.running, s.queued


async def test_run_timeout_keeps_the_slot_until_the_adapter_stopped(
        nursery: trio.Nursery, relay_: Relay, autojump_clock: trio.abc.Clock) -> None:
    t0 = trio.current_time()
    res = start(nursery, relay_, chat("fake/echo?delay_s=1000&ignore_stop_s=3"))
    await res.complete.wait()   # the client hears at once, at the run timeout (50 s) ...
    assert res.status_at == t0 + 50
    assert stats(relay_) == (1, 0)   # ... but the fake ignores the stop for 3 s: slot held
    await trio.sleep(2.9)
    assert stats(relay_) == (1, 0)
    await res.done.wait()            # the request ends only when its attempt has
    assert trio.current_time() - t0 == pytest.approx(53.0)
    assert stats(relay_) == (0, 0)
    assert res.status == 504
    assert res.json()["error"]["code"] == "run_timeout"
    rec = relay_.records.recent[-1]
    assert rec["reason"] == "run_timeout" and rec["status"] == 504
    assert rec["stop_requested_at"] is not None and rec["released_at"] is not None
    assert rec["stop_requested_at"] < rec["released_at"]
    assert rec["attempts"][0]["failure"] == "run_timeout"


async def test_a_queued_stream_gets_200_at_once_and_notices_every_2s(
        nursery: trio.Nursery, relay_: Relay, autojump_clock: trio.abc.Clock) -> None:
    t0 = trio.current_time()
    first = start(nursery, relay_, chat("fake/echo?delay_s=9"))
    await trio.testing.wait_all_tasks_blocked()
    second = start(nursery, relay_, chat("fake/echo", "hi", stream=True))
    await trio.testing.wait_all_tasks_blocked()
    assert second.status == 200 and second.status_at == t0
    await second.done.wait()
    notices = [(t - t0, p) for t, p in second.pieces if p.startswith(b": waiting")]
    assert [t for t, _ in notices] == [0, 2, 4, 6, 8]
    assert notices[0][1] == (b": waiting, starts when earlier requests finish "
                             b"(running 1/1, queued 1, 0 s)\n\n")
    assert b"4 s)" in notices[2][1]
    events = sse_events(second.text())
    assert events[-1] == "[DONE]"
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1]) == "hi"
    await first.done.wait()
    assert first.status == 200 and stats(relay_) == (0, 0)


async def test_progress_events_on_request(nursery: trio.Nursery, relay_: Relay,
                                          autojump_clock: trio.abc.Clock) -> None:
    start(nursery, relay_, chat("fake/echo?delay_s=3"))
    await trio.testing.wait_all_tasks_blocked()
    second = start(nursery, relay_, chat("fake/echo", stream=True),
                   headers={"x-relay-progress": "events"})
    await second.done.wait()
    text = second.text()
    assert text.startswith('event: relay.waiting\ndata: {"running":1,"capacity":1,'
                           '"queued":1,"elapsed_s":0')
    assert text.count("event: relay.waiting") == 2   # at 0 s and 2 s


async def test_a_slow_first_byte_gets_200_and_heartbeats(
        nursery: trio.Nursery, relay_: Relay, autojump_clock: trio.abc.Clock) -> None:
    t0 = trio.current_time()
    res = start(nursery, relay_, chat("fake/echo?delay_s=40", stream=True))
    await res.done.wait()
    beats = [t - t0 for t, p in res.pieces if p == b": keepalive\n\n"]
    assert beats == [15, 30]
    assert res.status_at == t0 + 15     # headers went out with the first heartbeat
    assert sse_events(res.text())[-1] == "[DONE]"


async def test_non_stream_sends_nothing_until_it_ends(
        nursery: trio.Nursery, relay_: Relay, autojump_clock: trio.abc.Clock) -> None:
    t0 = trio.current_time()
    start(nursery, relay_, chat("fake/echo?delay_s=20"))
    await trio.testing.wait_all_tasks_blocked()
    res = start(nursery, relay_, chat("fake/echo?delay_s=20"))
    await res.done.wait()
    assert res.status_at == t0 + 40 and len(res.pieces) == 1
    assert res.json()["choices"][0]["message"]["content"] == "hello"


async def test_a_queued_client_that_leaves_never_reaches_the_provider(
        nursery: trio.Nursery, relay_: Relay, autojump_clock: trio.abc.Clock) -> None:
    fake: Any = relay_.providers["fake"].adapter
    first = start(nursery, relay_, chat("fake/echo?delay_s=30"))
    await trio.testing.wait_all_tasks_blocked()
    second = start(nursery, relay_, chat("fake/echo", stream=True))
    await trio.sleep(5)
    assert stats(relay_) == (1, 1)
    second.disconnect.set()
    await trio.testing.wait_all_tasks_blocked()
    assert stats(relay_) == (1, 0)      # left the queue at once
    await first.done.wait()
    assert fake.started == 1            # the second never reached the provider
    rec = next(r for r in relay_.records.recent if r["status"] == 499)
    assert rec["reason"] == "client_disconnected" and rec["attempts"][0]["ok"] is False
    assert rec["attempts"][0]["failure"] == "stopped"     # not the provider's failure


async def test_a_full_queue_stays_a_real_429(nursery: trio.Nursery, relay_: Relay,
                                             autojump_clock: trio.abc.Clock) -> None:
    for _ in range(3):   # 1 running + 2 queued (queue_max 2)
        start(nursery, relay_, chat("fake/echo?delay_s=10", stream=True))
        await trio.testing.wait_all_tasks_blocked()
    res = start(nursery, relay_, chat("fake/echo", stream=True))
    await res.done.wait()
    assert res.status == 429
    assert res.headers["x-should-retry"] == "true" and int(res.headers["retry-after"]) >= 1
    err = res.json()["error"]
    assert err["code"] == "provider_queue_full" and err["relay"]["phase"] == "capacity"


async def test_a_queue_timeout_after_the_200_arrives_in_band(
        nursery: trio.Nursery, tmp_path: Path, autojump_clock: trio.abc.Clock) -> None:
    text = CONFIG.replace("queue_timeout_s = 100", "queue_timeout_s = 5")
    async with open_relay(config_from(text, tmp_path), discover=False) as r:
        first = start(nursery, r, chat("fake/echo?delay_s=30"))
        await trio.testing.wait_all_tasks_blocked()
        res = start(nursery, r, chat("fake/echo", stream=True))
        await res.done.wait()
        await first.done.wait()
        events = sse_events(res.text())
        assert res.status == 200
        assert events[-1]["error"]["code"] == "provider_queue_timeout"
        assert "[DONE]" not in events


async def test_a_failure_after_the_first_bytes_arrives_in_band(
        nursery: trio.Nursery, relay_: Relay, autojump_clock: trio.abc.Clock) -> None:
    res = start(nursery, relay_, chat("fake/echo?chunks=3&fail=upstream_error&fail_after=2",
                                      stream=True))
    await res.done.wait()
    events = sse_events(res.text())
    assert [e["choices"][0]["delta"]["content"] for e in events[:2]] == ["t0 ", "t1 "]
    assert events[2]["error"]["code"] == "upstream_error"
    assert len(events) == 3     # no finish chunk, no [DONE]: never a complete answer


async def test_a_cut_answer_is_never_complete(nursery: trio.Nursery, relay_: Relay,
                                              autojump_clock: trio.abc.Clock) -> None:
    res = start(nursery, relay_, chat("fake/echo?chunks=3&cut_after=2", stream=True))
    await res.done.wait()
    events = sse_events(res.text())
    assert events[-1]["error"]["code"] == "stream_cut"
    plain = start(nursery, relay_, chat("fake/echo?chunks=3&cut_after=2"))
    await plain.done.wait()
    assert plain.status == 502 and plain.json()["error"]["code"] == "stream_cut"


async def test_max_tokens_cut_is_reported_as_length(
        nursery: trio.Nursery, relay_: Relay, autojump_clock: trio.abc.Clock) -> None:
    res = start(nursery, relay_, chat("fake/echo?chunks=5", max_tokens=2))
    await res.done.wait()
    assert res.json()["choices"][0]["finish_reason"] == "length"


async def test_drain_lets_short_work_finish_and_stops_the_rest(
        nursery: trio.Nursery, relay_: Relay, autojump_clock: trio.abc.Clock) -> None:
    short = start(nursery, relay_, chat("fake/echo?delay_s=2"))
    await trio.testing.wait_all_tasks_blocked()
    long_stream = start(nursery, relay_, chat("fake/echo?chunks=100&chunk_delay_s=1",
                                              stream=True))
    long_plain = start(nursery, relay_, chat("fake/echo?delay_s=1000"))
    await trio.sleep(1)
    t0 = trio.current_time()
    await relay_.drain(10.0)
    assert trio.current_time() - t0 == pytest.approx(10.0)
    await short.done.wait()
    await long_stream.done.wait()
    await long_plain.done.wait()
    assert short.status == 200
    assert sse_events(long_stream.text())[-1]["error"]["code"] == "shutting_down"
    assert long_plain.status == 503 and long_plain.json()["error"]["code"] == "shutting_down"
    assert long_plain.headers["retry-after"] == "5"
    assert stats(relay_) == (0, 0)
    late = start(nursery, relay_, chat("fake/echo"))
    await late.done.wait()
    assert late.status == 503
    by_reason = sorted(str(r["reason"]) for r in relay_.records.recent)
    assert by_reason.count("shutting_down") == 3
    stopped = [a["failure"] for r in relay_.records.recent for a in r["attempts"]
               if r["reason"] == "shutting_down"]
    assert stopped == ["stopped", "stopped"]   # the third never reached an attempt
