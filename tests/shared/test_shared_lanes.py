"""Shared lanes (SPEC L11) through the assembled relay and a real redis-server: three
relays in one test process (``relay.serve`` on loopback), each with its own records."""

from __future__ import annotations

import functools
import json
import queue
import random
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import trio
from fakes.upstream import FakeUpstream, Script
from helpers.assembled import config_from, records, start_relay, wait_for
from helpers.redis_server import RedisServer, acl_user_only
from helpers.shared_helpers import Peak, body, shared_config

import relay
from relay import Served


async def three(nursery: trio.Nursery, tmp_path: Path, up: FakeUpstream, url: str,
                **kw: Any) -> list[Served]:
    out = []
    for n in range(3):
        (tmp_path / f"r{n}").mkdir(exist_ok=True)
        out.append(await start_relay(nursery, shared_config(up, url, f"r{n}", **kw),
                                     tmp_path / f"r{n}"))
    return out


def queued(redis: RedisServer) -> int:
    return int(redis.command("ZCARD", "{relay:up}:w").strip()[1:])


def lane(served: Served) -> Any:
    return served.relay.providers["up"].lane


async def all_idle(relays: list[Served], redis: RedisServer) -> None:
    """Every relay's view (refreshed by its renewals) and the server: 0 and 0."""
    await wait_for(lambda: all(lane(s).statistics().running == 0
                               and lane(s).statistics().queued == 0
                               and lane(s).held_here == 0 for s in relays), limit_s=10)
    assert redis.command("ZCARD", "{relay:up}:h").strip() == b":0"
    assert redis.command("ZCARD", "{relay:up}:w").strip() == b":0"


@acl_user_only
async def test_three_relays_under_load_with_cut_offs_never_exceed_lanes(
        tmp_path: Path, redis: RedisServer, upstream: FakeUpstream,
        client: httpx.AsyncClient) -> None:
    upstream.scripts["slow"] = Script(chunks=["a", "b", "c", "d"], chunk_delay_s=0.03)
    peak = Peak(upstream)
    rng = random.Random(14)
    async with trio.open_nursery() as nursery:
        # A lease of 4 s bounds each command at 1.0 s (the default's bound): a loaded
        # machine took up to 0.5 s, which a 2 s lease's 0.5 s bound counted as a dead
        # server (every shared request then answered coordination_unavailable).
        relays = await three(nursery, tmp_path, upstream, redis.url, queue_max=200,
                             lease_s=4.0)
        statuses: list[int | str] = []

        async def one(i: int) -> None:
            stream = i % 2 == 0
            with trio.move_on_after(rng.uniform(0.05, 0.4) if i % 17 == 0 else 60) as cut:
                r = await client.post(f"{relays[i % 3].url}/v1/chat/completions",
                                      json=body("up/slow", stream=stream))
                statuses.append(r.status_code)
            if cut.cancelled_caught:
                statuses.append("cut")

        async with trio.open_nursery() as load:
            for i in range(90):
                load.start_soon(one, i)
                await trio.sleep(0.005)
        assert statuses.count(200) + statuses.count("cut") == 90, statuses
        assert peak.peak == 4  # exactly lanes: never more, and the slots were all used
        await all_idle(relays, redis)
        mine = {r["relay_id"] for n in range(3) for r in records(tmp_path / f"r{n}")}
        assert mine == {"r0", "r1", "r2"}
        nursery.cancel_scope.cancel()


async def test_priority_orders_the_queue_across_relays(
        tmp_path: Path, redis: RedisServer, upstream: FakeUpstream,
        client: httpx.AsyncClient) -> None:
    upstream.scripts["hold"] = Script(hang=True)
    async with trio.open_nursery() as nursery:
        a, b, c = await three(nursery, tmp_path, upstream, redis.url, lanes=1)
        done: list[str] = []

        async def ask(served: Served, text: str, priority: str = "normal",
                      model: str = "up/m1") -> None:
            r = await client.post(f"{served.url}/v1/chat/completions",
                                  json={**body(model), "messages": [
                                      {"role": "user", "content": text}]},
                                  headers={"X-Relay-Priority": priority})
            done.append(f"{text}:{r.status_code}")

        holder = trio.CancelScope()

        async def hold() -> None:
            with holder:
                await ask(a, "holder", "normal", "up/hold")

        async with trio.open_nursery() as waiting:
            waiting.start_soon(hold)
            await upstream.wait_for_requests(1)
            for n in range(3):  # queued first, on relay b
                waiting.start_soon(ask, b, f"normal{n}")
                await wait_for(lambda n=n: queued(redis) == n + 1)
            waiting.start_soon(ask, c, "urgent", "interactive")  # later, on relay c
            await wait_for(lambda: queued(redis) == 4)
            holder.cancel()  # the holder's client leaves: its slot frees
        order = [r.json["messages"][0]["content"] for r in upstream.requests]
        assert order == ["holder", "urgent", "normal0", "normal1", "normal2"], order
        assert sorted(done) == ["normal0:200", "normal1:200", "normal2:200", "urgent:200"]
        await all_idle([a, b, c], redis)
        nursery.cancel_scope.cancel()


async def test_status_metrics_and_records_say_shared_global_and_held_here(
        tmp_path: Path, redis: RedisServer, upstream: FakeUpstream,
        client: httpx.AsyncClient) -> None:
    upstream.scripts["hold"] = Script(hang=True)

    async def post(url: str, json_body: dict[str, Any]) -> None:
        await client.post(url, json=json_body)

    async with trio.open_nursery() as nursery:
        a, b, _ = await three(nursery, tmp_path, upstream, redis.url, lanes=2)
        async with trio.open_nursery() as held:
            for _ in range(2):
                held.start_soon(post, f"{a.url}/v1/chat/completions", body("up/hold"))
            await upstream.wait_for_requests(2)
            held.start_soon(post, f"{b.url}/v1/chat/completions", body("up/m1"))
            await wait_for(lambda: lane(b).statistics().queued == 1)
            await wait_for(lambda: lane(a).statistics().queued == 1, limit_s=5)  # renewal
            sa = (await client.get(f"{a.url}/relay/v1/status")).json()["providers"]
            sb = (await client.get(f"{b.url}/relay/v1/status")).json()["providers"]
            assert sa["up"]["lanes"] == {"running": 2, "capacity": 2, "queued": 1,
                                         "queue_max": 64, "shared": True, "held_here": 2}
            assert sb["up"]["lanes"] == {"running": 2, "capacity": 2, "queued": 1,
                                         "queue_max": 64, "shared": True, "held_here": 0}
            assert sa["fake"]["lanes"]["shared"] is False
            metrics = (await client.get(f"{a.url}/metrics")).text
            assert 'relay_lane_running{provider="up",scope="global"} 2.0' in metrics
            assert 'relay_lane_queued{provider="up",scope="global"} 1.0' in metrics
            assert 'relay_lane_running{provider="fake"} 0.0' in metrics
            assert 'relay_lane_held_here{provider="up"} 2.0' in metrics
            held.cancel_scope.cancel()
        r = await client.post(f"{b.url}/v1/chat/completions", json=body("up/m1"))
        assert r.status_code == 200
        (answered,) = [r for r in records(tmp_path / "r1") if r["status"] == 200]
        assert answered["relay_id"] == "r1" and answered["attempts"][0]["released_at"]
        assert "lease_expired" not in answered["attempts"][0]
        nursery.cancel_scope.cancel()


async def test_server_unreachable_answers_503_at_once_and_falls_back_to_a_local_provider(
        tmp_path: Path, upstream: FakeUpstream, client: httpx.AsyncClient) -> None:
    text = shared_config(upstream, "redis://127.0.0.1:9/0", "lonely", lease_s=3) + """
[routes.safe]
primary = "up/m1"
fallbacks = ["fake/echo"]
"""
    async with trio.open_nursery() as nursery:
        served = await start_relay(nursery, text, tmp_path)
        with trio.fail_after(1.0):  # at once: nothing waits on a dead server
            r = await client.post(f"{served.url}/v1/chat/completions", json=body("up/m1"))
        assert r.status_code == 503, r.text
        err = r.json()["error"]
        assert err["code"] == "coordination_unavailable"
        assert err["relay"]["phase"] == "coordination"
        assert r.headers["retry-after"] == "3" and r.headers["x-should-retry"] == "true"
        local = await client.post(f"{served.url}/v1/chat/completions", json=body("fake/echo"))
        assert local.status_code == 200
        routed = await client.post(f"{served.url}/v1/chat/completions", json=body("safe"))
        assert routed.status_code == 200, routed.text
        (rec,) = [x for x in records(tmp_path) if x["route"] == "safe"]
        assert rec["fallback_triggered"] is True
        assert rec["attempts"][0]["failure"] == "coordination_unavailable"
        assert upstream.requests == []
        nursery.cancel_scope.cancel()


async def test_the_coordination_password_is_redacted_everywhere(
        tmp_path: Path, upstream: FakeUpstream, client: httpx.AsyncClient,
        monkeypatch: Any) -> None:
    secret = "s3cret-coordination-pass"
    monkeypatch.setenv("RELAY_COORD", f"redis://:{secret}@127.0.0.1:9/0")
    text = shared_config(upstream, "unused", "r").replace(
        'coordination_url = "unused"', 'coordination_url_env = "RELAY_COORD"')
    config = config_from(text, tmp_path)
    assert secret in config.secrets()
    async with trio.open_nursery() as nursery:
        served = await start_relay(nursery, text, tmp_path)
        r = await client.post(f"{served.url}/v1/chat/completions", json=body("up/m1"))
        assert r.status_code == 503 and secret not in r.text
        status = await client.get(f"{served.url}/relay/v1/status")
        assert secret not in status.text
        nursery.cancel_scope.cancel()
    assert secret not in json.dumps(records(tmp_path))


async def test_a_reload_stores_the_new_profile_for_every_relay(
        tmp_path: Path, redis: RedisServer, upstream: FakeUpstream,
        caplog: Any) -> None:
    caplog.set_level("INFO", logger="relay.shared.lane")
    async with trio.open_nursery() as nursery:
        a, b, _ = await three(nursery, tmp_path, upstream, redis.url, lanes=2)
        new = config_from(shared_config(upstream, redis.url, "r0", lanes=3, queue_max=9),
                          tmp_path / "r0")
        changes = await a.relay.reload(new)
        assert any("provider up: profile changed" in c for c in changes), changes
        await wait_for(lambda: lane(a).statistics().capacity == 3)
        # The others apply it in place at their next renewal, and log it.
        await wait_for(lambda: lane(b).statistics().capacity == 3
                       and lane(b).statistics().queue_max == 9)
        assert any("profile changed by relay r0: lanes 2→3" in m for m in caplog.messages)
        nursery.cancel_scope.cancel()


async def test_one_relay_runs_a_shared_providers_interval_check_per_interval(
        tmp_path: Path, redis: RedisServer, upstream: FakeUpstream) -> None:
    async with trio.open_nursery() as nursery:
        a, b, c = await three(nursery, tmp_path, upstream, redis.url)
        won = [await lane(s).claim_check(30.0) for s in (a, b, c)]
        assert won == [True, False, False]
        assert await a.relay.providers["fake"].lane.claim_check(30.0)  # local: its own
        nursery.cancel_scope.cancel()


async def test_a_stored_profile_expires_one_lease_after_the_last_relay_left(
        tmp_path: Path, redis: RedisServer, upstream: FakeUpstream) -> None:
    lease = 1.0
    async with trio.open_nursery() as nursery:
        await start_relay(nursery, shared_config(upstream, redis.url, "gone", lanes=2,
                                                 lease_s=lease), tmp_path)
        nursery.cancel_scope.cancel()
    left_at = trio.current_time()
    assert redis.command("EXISTS", "{relay:up}:m").strip() == b":1"
    await wait_for(lambda: redis.command("EXISTS", "{relay:up}:m").strip() == b":0",
                   limit_s=lease + 2)
    assert trio.current_time() - left_at <= lease + 0.5
    async with trio.open_nursery() as nursery:  # a different profile is welcome now
        (tmp_path / "new").mkdir()
        served = await start_relay(nursery, shared_config(upstream, redis.url, "new", lanes=5,
                                                          lease_s=lease), tmp_path / "new")
        assert lane(served).statistics().capacity == 5
        nursery.cancel_scope.cancel()


async def test_queue_max_is_counted_across_relays(
        tmp_path: Path, redis: RedisServer, upstream: FakeUpstream,
        client: httpx.AsyncClient) -> None:
    upstream.scripts["hold"] = Script(hang=True)

    async def post(url: str, model: str) -> None:
        await client.post(f"{url}/v1/chat/completions", json=body(model))

    async with trio.open_nursery() as nursery:
        a, b, c = await three(nursery, tmp_path, upstream, redis.url, lanes=1, queue_max=2)
        async with trio.open_nursery() as held:
            held.start_soon(post, a.url, "up/hold")
            await upstream.wait_for_requests(1)
            held.start_soon(post, a.url, "up/m1")
            await wait_for(lambda: queued(redis) == 1)
            held.start_soon(post, b.url, "up/m1")
            await wait_for(lambda: queued(redis) == 2)
            r = await client.post(f"{c.url}/v1/chat/completions", json=body("up/m1"))
            assert r.status_code == 429, r.text
            err = r.json()["error"]
            assert err["code"] == "provider_queue_full"
            assert "1/1 running, 2 queued (queue_max 2) across every relay" in err["message"]
            held.cancel_scope.cancel()
        await all_idle([a, b, c], redis)
        nursery.cancel_scope.cancel()


async def test_a_lost_wake_up_is_made_up_by_the_next_renewal(
        tmp_path: Path, redis: RedisServer, upstream: FakeUpstream,
        client: httpx.AsyncClient) -> None:
    """Pub/sub is at most once: a grant published while the waiter's relay is not
    subscribed is lost; that relay's next renewal (every lease / 4) finds it granted."""
    upstream.scripts["hold"] = Script(hang=True)
    lease = 2.0
    async with trio.open_nursery() as nursery:
        a, b, _ = await three(nursery, tmp_path, upstream, redis.url, lanes=1, lease_s=lease)
        coord_b = b.relay.coordinator
        assert coord_b is not None
        holder = trio.CancelScope()

        async def hold() -> None:
            with holder:
                await client.post(f"{a.url}/v1/chat/completions", json=body("up/hold"))

        got: list[float] = []

        async def wait_on_b() -> None:
            r = await client.post(f"{b.url}/v1/chat/completions", json=body("up/m1"))
            assert r.status_code == 200
            got.append(trio.current_time())

        nursery.start_soon(hold)
        await upstream.wait_for_requests(1)
        nursery.start_soon(wait_on_b)
        await wait_for(lambda: queued(redis) == 1)
        # b's subscription is cut: the grant a's release publishes reaches no one.
        assert redis.command("CLIENT", "KILL", "TYPE", "pubsub").strip() != b":0"
        released = trio.current_time()
        holder.cancel()
        await wait_for(lambda: bool(got), limit_s=lease)
        assert got[0] - released <= coord_b.tick_s + 0.5, got[0] - released
        nursery.cancel_scope.cancel()


async def test_a_waiting_notice_shows_the_global_numbers(
        tmp_path: Path, redis: RedisServer, upstream: FakeUpstream,
        client: httpx.AsyncClient) -> None:
    upstream.scripts["hold"] = Script(hang=True)
    async with trio.open_nursery() as nursery:
        a, b, _ = await three(nursery, tmp_path, upstream, redis.url, lanes=1)

        async def hold() -> None:
            await client.post(f"{a.url}/v1/chat/completions", json=body("up/hold"))

        async with trio.open_nursery() as held:
            held.start_soon(hold)
            await upstream.wait_for_requests(1)
            async with client.stream("POST", f"{b.url}/v1/chat/completions",
                                     json=body("up/m1", stream=True),
                                     headers={"X-Relay-Progress": "events"}) as r:
                first = b""
                async for chunk in r.aiter_bytes():
                    first += chunk
                    if b"\n\n" in first:
                        break
            # b holds nothing: the running slot is a's, and the numbers say so.
            assert first.startswith(b'event: relay.waiting\ndata: {"running":1,"capacity":1,'
                                    b'"queued":1'), first
            held.cancel_scope.cancel()
        nursery.cancel_scope.cancel()


async def test_a_removed_shared_provider_is_no_longer_renewed_once_idle(
        tmp_path: Path, redis: RedisServer, upstream: FakeUpstream) -> None:
    async with trio.open_nursery() as nursery:
        a, _, _ = await three(nursery, tmp_path, upstream, redis.url)
        coord = a.relay.coordinator
        assert coord is not None and "up" in coord.lanes
        text = shared_config(upstream, redis.url, "r0").split("[providers.up]")[0] + """
[providers.fake]
adapter = "fake"
models = ["echo"]
"""
        await a.relay.reload(config_from(text, tmp_path / "r0"))
        await wait_for(lambda: "up" not in coord.lanes)
        nursery.cancel_scope.cancel()


async def test_a_renewal_never_reports_a_waiter_whose_acquire_is_still_on_its_way(
        redis: RedisServer, nursery: trio.Nursery) -> None:
    """Regression: a renewal sent while a request's ACQUIRE had not reached the server
    yet listed that request; the server knew no such waiter and answered "gone", and
    the request failed with coordination_lost (seen after a server restart, where the
    re-registration and the retried ACQUIRE race)."""
    from relay.capacity.lanes import Ticket
    from relay.shared.coordinator import Coordinator
    from relay.shared.lane import SharedLane, _Member
    from relay.vocab.profile import Profile

    coord = Coordinator(redis.url, prefix="relay", lease_s=2.0, relay_id="r")
    lane = SharedLane("up", Profile(lanes=1, queue_max=4, queue_timeout_s=10,
                                    run_timeout_s=60), coord)
    await nursery.start(coord.serve)
    on_its_way = _Member(coord.new_member(), 1, Ticket(priority="normal",
                                                       queued_at=trio.current_time()))
    lane._waiters[on_its_way.member] = on_its_way  # as _acquire does before ACQUIRE
    await lane.sync()
    assert not on_its_way.gone


@acl_user_only
async def test_a_late_renewal_does_not_fail_a_waiting_request(
        tmp_path: Path, upstream: FakeUpstream, redis: RedisServer,
        client: httpx.AsyncClient) -> None:
    # Relay B's event loop is busy for longer than the point where a holder would stop
    # (half a lease without a renewal), but less than a lease: its waiting request holds
    # nothing the server could give twice, so it must not fail (it answered 503
    # coordination_unavailable "not connected yet" though the server answered). B runs
    # in its own thread and trio run, so only its loop is blocked; A holds the one slot.
    upstream.scripts["slow"] = Script(first_byte_delay_s=6)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    text_b = shared_config(upstream, redis.url, "b", lanes=1, lease_s=4)
    ready: queue.Queue[tuple[Served, trio.lowlevel.TrioToken, trio.Event]] = queue.Queue()

    def run_b() -> None:
        async def serve_b() -> None:
            shutdown = trio.Event()
            async with trio.open_nursery() as nursery:
                served: Served = await nursery.start(functools.partial(
                    relay.serve, config_from(text_b, tmp_path / "b"), port=0,
                    shutdown=shutdown))
                ready.put((served, trio.lowlevel.current_trio_token(), shutdown))
        trio.run(serve_b)

    thread = threading.Thread(target=run_b, daemon=True)
    thread.start()
    served_b, token_b, shutdown_b = await trio.to_thread.run_sync(ready.get)
    try:
        async with trio.open_nursery() as nursery:
            a = await start_relay(nursery, shared_config(upstream, redis.url, "a", lanes=1,
                                                         lease_s=4), tmp_path / "a")
            answers: dict[str, tuple[int, str]] = {}

            async def ask(name: str, url: str, model: str) -> None:
                r = await client.post(f"{url}/v1/chat/completions", json=body(model))
                answers[name] = (r.status_code, r.text)

            nursery.start_soon(ask, "a", a.url, "up/slow")
            await wait_for(lambda: lane(a).held_here == 1)
            nursery.start_soon(ask, "b", served_b.url, "up/m1")
            await wait_for(lambda: lane(served_b).statistics().queued == 1)
            # B's loop does nothing for 2.5 s: past its holders' stop (2 s after its last
            # renewal at most), inside its lease (4 s).
            await trio.to_thread.run_sync(functools.partial(
                trio.from_thread.run_sync, time.sleep, 2.5, trio_token=token_b))
            with trio.fail_after(20):
                while "b" not in answers or "a" not in answers:
                    await trio.sleep(0.05)
            assert answers["a"][0] == 200, answers["a"]
            assert answers["b"][0] == 200, answers["b"]
            nursery.cancel_scope.cancel()
    finally:
        with trio.CancelScope(shield=True, deadline=trio.current_time() + 15):
            await trio.to_thread.run_sync(functools.partial(
                trio.from_thread.run_sync, shutdown_b.set, trio_token=token_b))
            await trio.to_thread.run_sync(thread.join, 10)
