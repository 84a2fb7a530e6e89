"""Shared lanes (SPEC L11) when things go wrong, with real processes: kill -9 of a relay
holding slots, a relay and the server stopped (SIGSTOP) and resumed, a server restart
that loses the state, and a profile mismatch at start. ``relay serve`` children run this
tree (PYTHONPATH); leases are short and real; every wait is on a condition, bounded."""

from __future__ import annotations

import contextlib
import signal
from pathlib import Path
from typing import Any

import httpx
import trio
from fakes.upstream import FakeUpstream, Script
from helpers.assembled import records, start_relay, wait_for
from helpers.redis_server import RedisServer, acl_user_only, require_redis
from helpers.shared_helpers import Peak, body, shared_config, start_serve

from relay import Served


def lane(served: Served) -> Any:
    return served.relay.providers["up"].lane


async def post(client: httpx.AsyncClient, url: str, model: str,
               out: list[Any] | None = None) -> None:
    with contextlib.suppress(httpx.TransportError):
        r = await client.post(f"{url}/v1/chat/completions", json=body(model))
        if out is not None:
            out.append(r)


async def _kill(child: Any) -> None:
    """The ``relay serve`` child killed and reaped; shielded and bounded (it runs in a
    ``finally``, maybe under a cancel)."""
    with contextlib.suppress(ProcessLookupError):
        child.proc.kill()
    with trio.CancelScope(shield=True), trio.move_on_after(10):
        await child.proc.wait()

@acl_user_only
async def test_kill_9_of_a_relay_holding_slots_gives_them_back_within_the_lease(
        tmp_path: Path, redis: RedisServer, upstream: FakeUpstream,
        client: httpx.AsyncClient) -> None:
    upstream.scripts["hold"] = Script(hang=True)
    lease = 2.0
    child = await start_serve(tmp_path, shared_config(upstream, redis.url, "doomed", lanes=2,
                                                      lease_s=lease), name="doomed")
    try:
        async with trio.open_nursery() as nursery:
            for _ in range(2):
                nursery.start_soon(post, client, child.url, "up/hold")
            await upstream.wait_until(lambda: upstream.active_responses() == 2)
            (tmp_path / "b").mkdir()
            b = await start_relay(nursery, shared_config(upstream, redis.url, "survivor",
                                                         lanes=2, lease_s=lease), tmp_path / "b")
            got: list[httpx.Response] = []
            nursery.start_soon(post, client, b.url, "up/m1", got)
            await wait_for(lambda: lane(b).statistics().queued == 1)
            killed_at = trio.current_time()
            child.proc.kill()  # SIGKILL: no release, no goodbye
            with trio.fail_after(lease + 2.0):  # Done-when: within the lease plus 2 s
                await wait_for(lambda: bool(got), limit_s=60)
            assert got[0].status_code == 200
            print(f"slot back {trio.current_time() - killed_at:.2f} s after kill -9")
            nursery.cancel_scope.cancel()
    finally:
        await _kill(child)


async def test_a_profile_mismatch_stops_the_second_relay_at_start_with_exit_2(
        tmp_path: Path, redis: RedisServer, upstream: FakeUpstream) -> None:
    async with trio.open_nursery() as nursery:
        (tmp_path / "a").mkdir()
        await start_relay(nursery, shared_config(upstream, redis.url, "first", lanes=4),
                          tmp_path / "a")
        child = await start_serve(tmp_path, shared_config(upstream, redis.url, "second",
                                                          lanes=2), name="second", wait=False)
        with trio.fail_after(30):
            code = await child.proc.wait()
        said = child.text()
        assert code == 2, said
        assert "lanes 2" in said and "lanes 4" in said, said
        assert "'second'" in said and "'first'" in said, said
        assert "Traceback" not in said, said
        nursery.cancel_scope.cancel()


@acl_user_only
async def test_a_stopped_server_gives_honest_503s_and_service_resumes(
        tmp_path: Path, redis: RedisServer, upstream: FakeUpstream,
        client: httpx.AsyncClient) -> None:
    upstream.scripts["hold"] = Script(hang=True)
    lease = 3.0
    async with trio.open_nursery() as nursery:
        served = await start_relay(nursery, shared_config(upstream, redis.url, "r", lanes=2,
                                                          lease_s=lease), tmp_path)
        held: list[httpx.Response] = []
        nursery.start_soon(post, client, served.url, "up/hold", held)
        await upstream.wait_for_requests(1)
        redis.pause()
        try:
            # The holder cannot renew: it is stopped — its upstream call closed — before
            # its lease can end on the server (at half the lease after its last renewal;
            # the rest of the lease is this check's margin on a busy machine).
            with trio.fail_after(lease):
                await upstream.wait_until(lambda: upstream.active_responses() == 0)
            # Its client hears why once the slot is given up (the release to the stopped
            # server waits out its own command timeout first).
            with trio.fail_after(lease + 5):
                await wait_for(lambda: bool(held), limit_s=60)
            assert held[0].status_code == 503
            assert held[0].json()["error"]["code"] == "coordination_lost"
            # Its release could not reach the server: the record says so.
            await wait_for(lambda: any(r["reason"] == "coordination_lost"
                                       for r in records(tmp_path)))
            (lost,) = [r for r in records(tmp_path) if r["reason"] == "coordination_lost"]
            assert lost["status"] == 503 and lost["relay_id"] == "r"
            assert lost["attempts"][0]["lease_expired"] is True, lost
            # New requests: an honest 503 at once, with Retry-After = the lease.
            with trio.fail_after(2.0):
                r = await client.post(f"{served.url}/v1/chat/completions",
                                      json=body("up/m1"))
            assert r.status_code == 503
            assert r.json()["error"]["code"] == "coordination_unavailable"
            assert r.headers["retry-after"] == "3"
            local = await client.post(f"{served.url}/v1/chat/completions",
                                      json=body("fake/echo"))
            assert local.status_code == 200  # local providers never wait on the server
        finally:
            redis.resume()
        with trio.fail_after(10):
            while True:
                r = await client.post(f"{served.url}/v1/chat/completions",
                                      json=body("up/m1"))
                if r.status_code == 200:
                    break
                assert r.json()["error"]["relay"]["phase"] == "coordination", r.text
                await trio.sleep(0.1)
        await wait_for(lambda: lane(served).held_here == 0)
        nursery.cancel_scope.cancel()


@acl_user_only
async def test_a_server_restart_loses_the_state_and_nothing_is_over_admitted(
        tmp_path: Path, redis: RedisServer, upstream: FakeUpstream,
        client: httpx.AsyncClient) -> None:
    upstream.scripts["hold"] = Script(hang=True)
    peak = Peak(upstream)
    lease = 2.0
    async with trio.open_nursery() as nursery:
        (tmp_path / "a").mkdir()
        (tmp_path / "b").mkdir()
        a = await start_relay(nursery, shared_config(upstream, redis.url, "a", lanes=2,
                                                     lease_s=lease), tmp_path / "a")
        b = await start_relay(nursery, shared_config(upstream, redis.url, "b", lanes=2,
                                                     lease_s=lease), tmp_path / "b")
        holds = trio.CancelScope()

        async def hold() -> None:
            with holds:
                async with trio.open_nursery() as n:
                    for _ in range(2):
                        n.start_soon(post, client, a.url, "up/hold")

        nursery.start_soon(hold)
        await upstream.wait_until(lambda: upstream.active_responses() == 2)
        redis.restart()  # every key is gone
        got: list[httpx.Response] = []
        nursery.start_soon(post, client, b.url, "up/m1", got)
        # a's holders register again within one lease; b's request waits meanwhile
        await wait_for(lambda: b"a#" in redis.command("ZRANGE", "{relay:up}:h", "0", "-1")
                       and redis.command("ZCARD", "{relay:up}:h").strip() == b":2",
                       limit_s=lease * 2)
        with trio.move_on_after(lease * 1.5):
            await wait_for(lambda: bool(got), limit_s=60)
        assert not got, got[0].text  # still waiting: never 3 at once
        assert peak.peak == 2
        holds.cancel()
        with trio.fail_after(lease * 3):
            await wait_for(lambda: bool(got), limit_s=60)
        assert got[0].status_code == 200 and peak.peak == 2
        nursery.cancel_scope.cancel()


@acl_user_only
async def test_a_relay_paused_longer_than_its_lease_over_admits_until_it_wakes(
        tmp_path: Path, redis: RedisServer, upstream: FakeUpstream,
        client: httpx.AsyncClient) -> None:
    """Documented (docs/operators.md): a relay stopped (SIGSTOP, a suspended laptop) for longer than
    its lease loses its slot on the server, which grants it to another relay while the
    stopped relay's own call is still open at the upstream — so the upstream sees more
    than ``lanes`` until the stopped relay wakes. When it wakes, its request is stopped
    at once (``coordination_lost``)."""
    upstream.scripts["hold"] = Script(hang=True)
    lease = 2.0
    child = await start_serve(tmp_path, shared_config(upstream, redis.url, "sleepy", lanes=1,
                                                      lease_s=lease), name="sleepy")
    try:
        async with trio.open_nursery() as nursery:
            mine: list[httpx.Response] = []
            nursery.start_soon(post, client, child.url, "up/hold", mine)
            await upstream.wait_until(lambda: upstream.active_responses() == 1)
            (tmp_path / "b").mkdir()
            b = await start_relay(nursery, shared_config(upstream, redis.url, "awake", lanes=1,
                                                         lease_s=lease), tmp_path / "b")
            child.proc.send_signal(signal.SIGSTOP)
            try:
                nursery.start_soon(post, client, b.url, "up/hold")
                # Past the lease, the server takes the slot back and grants it to b:
                with trio.fail_after(lease * 3):
                    await upstream.wait_until(lambda: upstream.active_responses() == 2)
            finally:
                child.proc.send_signal(signal.SIGCONT)
            # Awake again: its own request is stopped at once; back to one at a time.
            with trio.fail_after(lease):
                await wait_for(lambda: bool(mine), limit_s=60)
            assert mine[0].status_code == 503
            assert mine[0].json()["error"]["code"] == "coordination_lost"
            await upstream.wait_until(lambda: upstream.active_responses() == 1)
            nursery.cancel_scope.cancel()
    finally:
        await _kill(child)


@acl_user_only
async def test_a_waiter_that_left_while_the_server_was_stopped_does_not_block_the_queue(
        tmp_path: Path, redis: RedisServer, upstream: FakeUpstream,
        client: httpx.AsyncClient) -> None:
    """A waiter whose client left while the server was stopped: its LEAVE timed out
    here. Left on the server, it would head the queue until its lease ends (the slot
    granted to it would idle). It is gone soon after the server is back — the timed-out
    command lands late, and the renewal tries it again (`Coordinator.orphans`)."""
    upstream.scripts["hold"] = Script(hang=True)
    lease = 4.0
    async with trio.open_nursery() as nursery:
        (tmp_path / "a").mkdir()
        (tmp_path / "b").mkdir()
        a = await start_relay(nursery, shared_config(upstream, redis.url, "a", lanes=1,
                                                     lease_s=lease), tmp_path / "a")
        b = await start_relay(nursery, shared_config(upstream, redis.url, "b", lanes=1,
                                                     lease_s=lease), tmp_path / "b")
        coord_b = b.relay.coordinator
        assert coord_b is not None
        nursery.start_soon(post, client, a.url, "up/hold")
        await upstream.wait_for_requests(1)
        waiter = trio.CancelScope()

        async def wait_on_b() -> None:
            with waiter:
                await post(client, b.url, "up/m1")

        nursery.start_soon(wait_on_b)

        def queued() -> bytes:
            return redis.command("ZCARD", "{relay:up}:w").strip()

        await wait_for(lambda: queued() == b":1")
        redis.pause()
        try:
            waiter.cancel()  # its LEAVE cannot reach the stopped server
            await wait_for(lambda: bool(coord_b.orphans))
        finally:
            redis.resume()
        resumed = trio.current_time()
        await wait_for(lambda: queued() == b":0" and not coord_b.orphans, limit_s=lease)
        # Well before its lease could have ended it (>= 2 s after the resume here).
        assert trio.current_time() - resumed < 1.5
        nursery.cancel_scope.cancel()


async def test_a_server_that_comes_up_after_the_relay_is_used_then(
        tmp_path: Path, upstream: FakeUpstream, client: httpx.AsyncClient) -> None:
    redis = RedisServer(require_redis(), tmp_path / "redis")  # its port, not started yet
    async with trio.open_nursery() as nursery:
        served = await start_relay(nursery, shared_config(upstream, redis.url, "early",
                                                          lease_s=1.0), tmp_path)
        r = await client.post(f"{served.url}/v1/chat/completions", json=body("up/m1"))
        assert r.status_code == 503
        assert r.json()["error"]["code"] == "coordination_unavailable"
        redis.start()
        try:
            with trio.fail_after(10):  # registered at its next try (quiet: one lease)
                while (await client.post(f"{served.url}/v1/chat/completions",
                                         json=body("up/m1"))).status_code != 200:
                    await trio.sleep(0.1)
        finally:
            redis.stop()
        nursery.cancel_scope.cancel()


async def test_a_password_protected_server_and_a_wrong_password(
        tmp_path: Path, upstream: FakeUpstream, client: httpx.AsyncClient,
        monkeypatch: Any, caplog: Any) -> None:
    secret = "correct-horse-battery"
    redis = RedisServer(require_redis(), tmp_path / "redis", password=secret)
    redis.start()
    try:
        good = redis.url.replace("redis://", f"redis://:{secret}@")
        bad = redis.url.replace("redis://", "redis://:wrong-password-here@")
        for name, url, status in (("good", good, 200), ("bad", bad, 503)):
            monkeypatch.setenv("RELAY_COORD", url)
            text = shared_config(upstream, "x", name, lease_s=1.0).replace(
                'coordination_url = "x"', 'coordination_url_env = "RELAY_COORD"')
            (tmp_path / name).mkdir()
            async with trio.open_nursery() as nursery:
                served = await start_relay(nursery, text, tmp_path / name)
                with trio.fail_after(10):
                    while True:
                        r = await client.post(f"{served.url}/v1/chat/completions",
                                              json=body("up/m1"))
                        if r.status_code == status or status == 503:
                            break
                        await trio.sleep(0.1)
                assert r.status_code == status, r.text
                assert secret not in r.text and "wrong-password-here" not in r.text
                nursery.cancel_scope.cancel()
        assert b"relay" in redis.command("KEYS", "*")  # the good one wrote its keys
    finally:
        redis.stop()
    logged = "\n".join(caplog.messages)
    assert secret not in logged and "wrong-password-here" not in logged
