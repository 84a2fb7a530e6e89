"""Stops on real loopback sockets, through the assembled relay (SPEC C1 to C5).

Each test measures, on trio's clock, the time from the client's stop to the fake upstream
seeing its connection closed: the bound asserted is generous (0.5 s); the measured
figure is typically a few milliseconds.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from fakes.upstream import FakeUpstream, Script
from helpers.assembled import (
    FAKE_ONLY,
    chat,
    config_from,
    lane_idle,
    records,
    sse_events,
    start_relay,
    wait_for,
    with_upstream,
)
from helpers.raw_http import BOUND_S, close, raw_post, read_until

import relay


async def upstream_closed_within(up: FakeUpstream, since: float) -> float:
    with trio.fail_after(5):
        await up.wait_all_closed()
    latency = max(c.closed_at or 0 for c in up.connections) - since
    assert latency < BOUND_S, f"upstream closed {latency * 1000:.1f} ms after the stop"
    return latency


@pytest.mark.parametrize("how", ["fin", "rst"])
async def test_client_leaving_mid_stream_closes_the_upstream(
        nursery: trio.Nursery, tmp_path: Path, upstream: FakeUpstream, how: str) -> None:
    upstream.scripts["slow"] = Script(chunks=["tok "] * 200, chunk_delay_s=0.02)
    served = await start_relay(nursery, with_upstream(upstream), tmp_path)
    stream = await raw_post(served.url, chat("up/slow", stream=True))
    await read_until(stream, b'"content":"tok "')
    stopped = await close(stream, how)
    await upstream_closed_within(upstream, stopped)
    await wait_for(lambda: lane_idle(served) and len(records(tmp_path)) == 1)
    rec = records(tmp_path)[0]
    assert rec["status"] == 499 and rec["reason"] == "client_disconnected"
    assert rec["stop_requested_at"] and rec["released_at"]
    assert rec["stop_requested_at"] <= rec["released_at"]


@pytest.mark.parametrize("how", ["fin", "rst"])
async def test_client_leaving_a_non_stream_request_closes_the_upstream(
        nursery: trio.Nursery, tmp_path: Path, upstream: FakeUpstream, how: str) -> None:
    upstream.scripts["slow"] = Script(first_byte_delay_s=30)
    served = await start_relay(nursery, with_upstream(upstream), tmp_path)
    stream = await raw_post(served.url, chat("up/slow"))
    with trio.fail_after(5):
        await upstream.wait_for_requests(1)
    stopped = await close(stream, how)
    await upstream_closed_within(upstream, stopped)
    await wait_for(lambda: lane_idle(served))


async def test_a_queued_client_that_leaves_never_reaches_the_upstream(
        nursery: trio.Nursery, tmp_path: Path, upstream: FakeUpstream) -> None:
    upstream.scripts["stall"] = Script(stall_after=1)
    served = await start_relay(nursery, with_upstream(upstream), tmp_path)
    lane = served.relay.providers["up"].lane
    holder = await raw_post(served.url, chat("up/stall", stream=True))
    with trio.fail_after(5):
        await upstream.wait_for_requests(1)
    queued = await raw_post(served.url, chat("up/m1", stream=True))
    await read_until(queued, b": waiting")      # 200 at once, then the waiting notice
    assert lane.statistics().queued == 1
    stopped = await close(queued, "fin")
    await wait_for(lambda: lane.statistics().queued == 0)
    assert trio.current_time() - stopped < BOUND_S
    assert len(upstream.requests) == 1          # never sent upstream
    stopped = await close(holder, "rst")
    await upstream_closed_within(upstream, stopped)
    await wait_for(lambda: lane_idle(served) and len(records(tmp_path)) == 2)
    assert {r["reason"] for r in records(tmp_path)} == {"client_disconnected"}


async def test_a_reader_that_stops_reading_is_dropped(
        nursery: trio.Nursery, tmp_path: Path, upstream: FakeUpstream) -> None:
    upstream.scripts["big"] = Script(chunks=["x" * 30000] * 400)  # ~12 MB, as fast as it goes
    text = with_upstream(upstream).replace('records = "records.jsonl"',
                                           'records = "records.jsonl"\nwrite_timeout_s = 0.5')
    served = await start_relay(nursery, text, tmp_path)
    stream = await raw_post(served.url, chat("up/big", stream=True), rcvbuf=4096)
    with trio.fail_after(5):
        await upstream.wait_for_requests(1)
    t0 = trio.current_time()
    # The client reads nothing. relay's write blocks, then is bounded by write_timeout_s.
    with trio.fail_after(5):
        await upstream.wait_all_closed()
    await wait_for(lambda: lane_idle(served))
    dropped = trio.current_time() - t0
    assert 0.4 < dropped < 3.0, dropped
    await stream.aclose()
    await wait_for(lambda: len(records(tmp_path)) == 1)
    assert records(tmp_path)[0]["status"] == 499


async def test_shutdown_with_requests_in_flight_releases_every_lane(
        tmp_path: Path, upstream: FakeUpstream, client: httpx.AsyncClient) -> None:
    upstream.scripts["stall"] = Script(stall_after=2)
    config = config_from(with_upstream(upstream), tmp_path)
    streams: list[trio.SocketStream] = []
    try:
        await _shutdown_in_flight(tmp_path, upstream, config, streams)
    finally:
        for s in streams:
            await s.aclose()


async def _shutdown_in_flight(tmp_path: Path, upstream: FakeUpstream, config: relay.Config,
                              streams: list[trio.SocketStream]) -> None:
    async with trio.open_nursery() as server:
        served = await server.start(functools.partial(relay.serve, config, port=0))
        streams.append(await raw_post(served.url, chat("up/stall", stream=True)))
        streams.append(await raw_post(served.url, chat("up/m1")))          # queued behind it
        streams.append(await raw_post(served.url, chat("fake/echo?delay_s=60")))
        fake = served.relay.providers["fake"].adapter
        await wait_for(lambda: served.relay.providers["up"].lane.statistics().queued == 1
                       and getattr(fake, "active", 0) == 1)
        server.cancel_scope.cancel()
    # Everything has stopped by the time the server's nursery exits.
    assert lane_idle(served)
    assert getattr(fake, "active", 1) == 0
    with trio.fail_after(2):
        await upstream.wait_all_closed()
    recs = records(tmp_path)
    assert len(recs) == 3
    assert all(r["stop_requested_at"] for r in recs)
    assert {r["reason"] for r in recs} == {"shutting_down"}


async def test_drain_finishes_short_work_and_stops_the_rest(
        tmp_path: Path, client: httpx.AsyncClient) -> None:
    text = FAKE_ONLY.replace('records = "records.jsonl"',
                             'records = "records.jsonl"\ndrain_grace_s = 1.0')
    config = config_from(text, tmp_path)
    shutdown = trio.Event()
    results: dict[str, Any] = {}
    async with trio.open_nursery() as nursery:
        served = await nursery.start(functools.partial(relay.serve, config, port=0,
                                                       shutdown=shutdown))
        url = f"{served.url}/v1/chat/completions"

        async def call(name: str, body: dict[str, Any]) -> None:
            results[name] = await client.post(url, json=body)

        nursery.start_soon(call, "short", chat("fake/echo?delay_s=0.3"))
        nursery.start_soon(call, "long", chat("fake/echo?chunks=100&chunk_delay_s=0.1",
                                              stream=True))
        fake = served.relay.providers["fake"].adapter
        await wait_for(lambda: getattr(fake, "active", 0) == 2)
        t0 = trio.current_time()
        shutdown.set()
    # relay.serve returned by itself: drained.
    assert 0.9 < trio.current_time() - t0 < 4.0
    assert results["short"].status_code == 200
    events = sse_events(results["long"].text)
    assert events[-1]["error"]["code"] == "shutting_down"
    assert lane_idle(served)
