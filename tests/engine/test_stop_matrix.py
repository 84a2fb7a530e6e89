"""The stop-path matrix: every state a request can be in, times every kind of stop.

States: queued, pacing (waiting for the RPM pacer), waiting for the upstream's headers,
streaming, writing to a reader that stopped reading, and a CLI-like interrupt pending (an
adapter slow to confirm its stop). Stops: the client's FIN, its RST, the provider's run
timeout, a route's attempt timeout, and a SIGTERM-style drain. Each runs on real loopback
sockets through the assembled relay and checks that the upstream stopped (its connection
closed, or — for a request still waiting — it was never reached) and that the lane was
released within the stop's bound.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import trio
from fakes.upstream import FakeUpstream, Script
from helpers.assembled import chat, config_from, lane_idle, records, wait_for
from helpers.raw_http import close, raw_post, read_until

import relay

LIMIT_S = 0.5          # the run / attempt timeout in the timeout columns
DRAIN_GRACE_S = 0.2
SLOW_STOP_S = 0.5      # the "CLI" adapter's delay in confirming a stop
BOUND_S = 1.0          # generous: measured figures are milliseconds

STATES = ["queued", "pacing", "headers", "streaming", "slow_reader", "interrupt_pending"]
STOPS = ["fin", "rst", "run_timeout", "attempt_timeout", "drain"]
# A waiting request has no run to time out: those two pairs are not combinations.
CASES = [(state, stop) for state in STATES for stop in STOPS
         if not (state in ("queued", "pacing") and stop == "run_timeout")]


def config(up: FakeUpstream, stop: str) -> str:
    run = LIMIT_S if stop == "run_timeout" else 20
    text = f"""
[server]
records = "records.jsonl"
write_timeout_s = 3
drain_grace_s = {DRAIN_GRACE_S}
"""
    # rpm = 1: at most one start in any 60 s, so the second request waits on the pacer.
    for name, extra in [("up", ""), ("paced", "rpm = 1\n")]:
        text += f"""
[providers.{name}]
adapter = "openai"
base_url = "{up.url}"
[providers.{name}.profile]
lanes = {1 if name == "up" else 2}
queue_max = 4
queue_timeout_s = 90
run_timeout_s = {run}
{extra}"""
    text += f"""
[providers.fake]
adapter = "fake"
models = ["echo"]
[providers.fake.profile]
lanes = 1
queue_max = 4
queue_timeout_s = 20
run_timeout_s = {run}
interrupt_grace_s = 2
"""
    for target in ("up/m1", "up/slow", "up/hang", "up/big", "paced/m1",
                   f"fake/echo?delay_s=100&ignore_stop_s={SLOW_STOP_S}"):
        name = "r_" + target.split("/")[0] + "_" + target.split("/")[1].split("?")[0]
        text += f"""
[routes.{name}]
primary = "{target}"
primary_timeout_s = {LIMIT_S}
"""
    return text


def model_for(state: str, stop: str) -> str:
    target = {"queued": "up/m1", "pacing": "paced/m1", "headers": "up/hang",
              "streaming": "up/slow", "slow_reader": "up/big",
              "interrupt_pending": f"fake/echo?delay_s=100&ignore_stop_s={SLOW_STOP_S}"}[state]
    if stop == "attempt_timeout":
        return "r_" + target.split("/")[0] + "_" + target.split("/")[1].split("?")[0]
    return target


async def reach(state: str, served: relay.Served, up: FakeUpstream,
                stream: trio.SocketStream) -> None:
    """Wait until the request under test is in ``state``."""
    providers = served.relay.providers
    if state == "queued":
        await wait_for(lambda: providers["up"].lane.statistics().queued == 1)
    elif state == "pacing":
        await wait_for(lambda: providers["paced"].lane.statistics().queued == 1)
    elif state == "headers":
        await wait_for(lambda: any((r.json or {}).get("model") == "hang"
                                   for r in up.requests))
    elif state == "streaming":
        await read_until(stream, b'"content":"s"')
    elif state == "slow_reader":
        await wait_for(lambda: any((r.json or {}).get("model") == "big"
                                   for r in up.requests))
    else:
        fake: Any = providers["fake"].adapter
        await wait_for(lambda: fake.active == 1)


@pytest.mark.parametrize(("state", "stop"), CASES)
async def test_stop(state: str, stop: str, tmp_path: Path, upstream: FakeUpstream) -> None:
    upstream.scripts["slow"] = Script(chunks=["s"] * 400, chunk_delay_s=0.02)
    upstream.scripts["hang"] = Script(first_byte_delay_s=60)
    upstream.scripts["stall"] = Script(stall_after=1)
    upstream.scripts["big"] = Script(chunks=["x" * 30000] * 400)
    cfg = config_from(config(upstream, stop), tmp_path)
    shutdown = trio.Event()
    holders: list[trio.SocketStream] = []
    async with trio.open_nursery() as nursery:
        served = await nursery.start(functools.partial(relay.serve, cfg, port=0,
                                                       shutdown=shutdown))
        if state == "queued":   # the only lane is taken by a stalled stream
            holders.append(await raw_post(served.url, chat("up/stall", stream=True)))
            await wait_for(lambda: served.relay.providers["up"].lane.statistics().running)
        if state == "pacing":   # the pacer's one start a minute is spent
            holders.append(await raw_post(served.url, chat("paced/m1")))
            await read_until(holders[-1], b"Hello world")
        before = len(upstream.requests)
        stream = await raw_post(served.url, chat(model_for(state, stop), stream=True),
                                rcvbuf=4096 if state == "slow_reader" else None)
        await reach(state, served, upstream, stream)
        t0 = trio.current_time()
        if stop in ("fin", "rst"):
            await close(stream, stop)
        elif stop == "drain":
            shutdown.set()
        allowed = BOUND_S + (LIMIT_S if "timeout" in stop else 0) + (
            DRAIN_GRACE_S if stop == "drain" else 0) + (
            SLOW_STOP_S if state == "interrupt_pending" else 0)
        target = served.relay.providers[model_for(state, "fin").split("/")[0]]
        with trio.fail_after(allowed + 2):
            # The request under test: left its queue, or its upstream call closed, and
            # its lane released.
            while True:
                stats = target.lane.statistics()
                # queued: the holder keeps its slot; the request under test must leave.
                busy = stats.queued if state == "queued" else stats.queued + stats.running
                if busy == 0:
                    break
                await trio.sleep(0.005)
        if state in ("headers", "streaming", "slow_reader"):
            # The upstream call itself was stopped: its response is no longer active.
            await upstream.wait_no_active_responses()
        elapsed = trio.current_time() - t0
        assert elapsed < allowed, f"released {elapsed:.3f} s after the stop"
        if state == "interrupt_pending" and stop in ("fin", "rst"):
            assert elapsed >= SLOW_STOP_S * 0.9   # the slot was held while it stopped
        if state in ("queued", "pacing"):
            new = [r for r in upstream.requests[before:]
                   if (r.json or {}).get("model") == "m1"]
            assert new == [], "a waiting request reached the upstream"
        for holder in holders:
            await holder.aclose()
        if stop != "drain":
            shutdown.set()
    await stream.aclose()
    # Everything is closed once relay is down; every request has its one record.
    with trio.fail_after(5):
        await upstream.wait_all_closed()
    assert lane_idle(served)
    recs = records(tmp_path)
    assert recs, "no record"
    for rec in recs:
        if rec["stop_requested_at"] and rec["run_ms"] is not None:
            assert rec["released_at"], rec
