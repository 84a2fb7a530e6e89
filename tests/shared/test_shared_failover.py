"""Shared lanes (SPEC L11, O6) on the servers teams run, with real processes and a TCP
proxy of the test's own (`redis_proxy`): a release whose reply was lost with its
connection, a managed failover behind the same name (``REPLICAOF`` switched, the primary
answering ``READONLY``), a subscription a NAT silently forgot. Leases are short and real;
every wait is on a condition, bounded."""

from __future__ import annotations

import contextlib
import hashlib
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from fakes.upstream import FakeUpstream, Script
from helpers.assembled import records, start_relay, wait_for
from helpers.redis_proxy import open_proxy
from helpers.redis_server import RedisServer, Sentinel, acl_user_only, require_redis
from helpers.shared_helpers import Peak, body, shared_config

from relay import Served
from relay.shared import lane_scripts


def lane(served: Served) -> Any:
    return served.relay.providers["up"].lane


def sha(script: str) -> bytes:
    return hashlib.sha1(script.encode()).hexdigest().encode()


async def test_a_release_whose_reply_was_lost_is_not_recorded_as_expired(
        tmp_path: Path, redis: RedisServer, upstream: FakeUpstream,
        client: httpx.AsyncClient) -> None:
    async with open_proxy(redis.port) as proxy, trio.open_nursery() as nursery:
        served = await start_relay(nursery, shared_config(upstream, proxy.url, "r", lanes=2),
                                   tmp_path)
        # The first request loads the scripts (EVAL after NOSCRIPT); the second's
        # RELEASE then goes by EVALSHA, runs on the server, and its reply is lost.
        r = await client.post(f"{served.url}/v1/chat/completions", json=body("up/m1"))
        assert r.status_code == 200
        proxy.drop_reply_once(sha(lane_scripts.RELEASE))
        r = await client.post(f"{served.url}/v1/chat/completions", json=body("up/m1"))
        assert r.status_code == 200
        assert proxy.dropped.is_set()
        await wait_for(lambda: len(records(tmp_path)) == 2)
        second = records(tmp_path)[1]
        assert second["status"] == 200
        assert "lease_expired" not in second["attempts"][0], second
        assert redis.command("ZCARD", "{relay:up}:h") == b":0\r\n"
        await wait_for(lambda: lane(served).statistics().running == 0)
        nursery.cancel_scope.cancel()


async def post(client: httpx.AsyncClient, url: str, model: str,
               out: list[Any] | None = None) -> None:
    with contextlib.suppress(httpx.TransportError):
        r = await client.post(f"{url}/v1/chat/completions", json=body(model))
        if out is not None:
            out.append(r)


LEASE = 3.0  # a command's bound is then 0.75 s: a loaded machine stays well inside it
LANES = 3


class Load:
    """Requests from eight clients, round-robin over the relays, until stopped; each
    result with the time it was sent and answered. A 503 (the server gone, a failover
    under way) is retried after a short pause, as a client honouring Retry-After would,
    only sooner."""

    def __init__(self, client: httpx.AsyncClient, relays: list[Served]) -> None:
        self.client = client
        self.relays = relays
        self.results: list[tuple[float, float, int | str]] = []
        self.stop = trio.Event()

    async def run(self) -> None:
        async with trio.open_nursery() as nursery:
            for n in range(8):
                nursery.start_soon(self._worker, n)

    async def _worker(self, n: int) -> None:
        i = n
        while not self.stop.is_set():
            url = self.relays[i % len(self.relays)].url
            i += 1
            sent = trio.current_time()
            try:
                r = await self.client.post(f"{url}/v1/chat/completions",
                                           json=body("up/slow"))
                outcome: int | str = r.status_code
                if r.status_code != 200:
                    outcome = f"{r.status_code} {r.json()['error']['code']}"
            except httpx.TransportError as exc:
                outcome = type(exc).__name__
            self.results.append((sent, trio.current_time(), outcome))
            if outcome != 200:
                await trio.sleep(0.05)

    def first_ok_sent_after(self, t: float) -> float:
        """When the first request sent after ``t`` that got its answer was answered."""
        return min(done for sent, done, outcome in self.results
                   if sent >= t and outcome == 200)

    def oks_after(self, t: float) -> int:
        return sum(1 for sent, _, outcome in self.results if sent >= t and outcome == 200)


async def three_on(nursery: trio.Nursery, tmp_path: Path, up: FakeUpstream, url: str
                   ) -> list[Served]:
    out = []
    for n in range(3):
        (tmp_path / f"r{n}").mkdir(exist_ok=True)
        out.append(await start_relay(nursery, shared_config(
            up, url, f"r{n}", lanes=LANES, queue_max=200, lease_s=LEASE), tmp_path / f"r{n}"))
    return out


async def idle_on(relays: list[Served], server: RedisServer) -> None:
    """Nothing leaked: every relay's view and the (new) primary say 0 and 0 — on the
    server within one lease (a holder released on the old primary just before the
    failover may still be in the replica's copy until its lease ends)."""
    await wait_for(lambda: all(lane(s).statistics().running == 0
                               and lane(s).statistics().queued == 0
                               and lane(s).held_here == 0 for s in relays), limit_s=3 * LEASE)
    with trio.fail_after(LEASE + 1.0):
        while server.command("ZCARD", "{relay:up}:h").strip() != b":0":
            await trio.sleep(0.05)
    assert server.command("ZCARD", "{relay:up}:w").strip() == b":0"


def on(server: RedisServer) -> int:
    """How many of the relays' connections (commands, subscriptions) the server has."""
    return server.command("CLIENT", "LIST").count(b" name=relay:")


def report(what: str, load: Load, started: float, done: float, resumed: float,
           moved: float) -> None:
    outcomes: dict[Any, int] = {}
    for *_, outcome in load.results:
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    print(f"{what}: failover {done - started:.2f} s, grants again {resumed - done:.2f} s "
          f"after it, every relay on the new primary {moved - done:.2f} s after it (lease "
          f"{LEASE:g} s); answers {outcomes}")


def in_sync(replica: RedisServer) -> bool:
    return b"master_link_status:up" in replica.command("INFO", "replication")


def slow(upstream: FakeUpstream) -> Peak:
    upstream.scripts["slow"] = Script(chunks=["a", "b", "c"], chunk_delay_s=0.03)
    return Peak(upstream)


async def test_a_failover_behind_the_same_name_under_load_never_exceeds_lanes(
        tmp_path: Path, upstream: FakeUpstream, client: httpx.AsyncClient) -> None:
    """The managed case: the name (here the proxy's port) now leads to the promoted
    replica, and the old primary, a replica now, answers READONLY to the connections
    still open to it."""
    binary = require_redis()
    a = RedisServer(binary, tmp_path / "a")
    b = RedisServer(binary, tmp_path / "b", args=("--replicaof", "127.0.0.1", str(a.port)))
    peak = slow(upstream)
    try:
        a.start()
        b.start()
        async with open_proxy(a.port) as proxy, trio.open_nursery() as nursery:
            relays = await three_on(nursery, tmp_path, upstream, proxy.url)
            load = Load(client, relays)
            async with trio.open_nursery() as running:
                running.start_soon(load.run)
                await wait_for(lambda: load.oks_after(0) >= 20 and in_sync(b), limit_s=20)
                started = trio.current_time()
                b.command("REPLICAOF", "NO", "ONE")
                a.command("REPLICAOF", "127.0.0.1", str(b.port))
                proxy.retarget(b.port)
                done = trio.current_time()
                # Every relay's commands moved (their subscriptions may stay on the old
                # primary, a replica now: what is published reaches it too).
                await wait_for(lambda: on(b) >= 3, limit_s=LEASE + 5)
                moved = trio.current_time()
                await wait_for(lambda: load.oks_after(moved) >= 10, limit_s=LEASE + 15)
                load.stop.set()
            resumed = load.first_ok_sent_after(done)
            report("same name", load, started, done, resumed, moved)
            assert peak.peak == LANES  # never more, and all used
            assert resumed - done <= LEASE + 1.0
            await idle_on(relays, b)
            nursery.cancel_scope.cancel()
    finally:
        a.stop()
        b.stop()


@pytest.mark.parametrize("how", ["SENTINEL FAILOVER", "kill -9"])
async def test_a_sentinel_failover_under_load_never_exceeds_lanes(
        tmp_path: Path, upstream: FakeUpstream, client: httpx.AsyncClient, how: str) -> None:
    binary = require_redis()
    a = RedisServer(binary, tmp_path / "a")
    b = RedisServer(binary, tmp_path / "b", args=("--replicaof", "127.0.0.1", str(a.port)))
    sentinels = [Sentinel(binary, tmp_path / f"s{n}", a.port) for n in range(3)]
    peak = slow(upstream)
    try:
        for server in (a, b, *sentinels):
            server.start()
        url = ("redis+sentinel://" + ",".join(f"127.0.0.1:{s.port}" for s in sentinels)
               + "/lanes/0")
        async with trio.open_nursery() as nursery:
            relays = await three_on(nursery, tmp_path, upstream, url)
            load = Load(client, relays)
            async with trio.open_nursery() as running:
                running.start_soon(load.run)
                # (the Sentinels must know the replica before they can promote it)
                await wait_for(lambda: load.oks_after(0) >= 20 and in_sync(b) and b"num-slaves"
                               in sentinels[0].command("SENTINEL", "master", "lanes")
                               and sentinels[0].command("SENTINEL", "replicas", "lanes")
                               .startswith(b"*1"), limit_s=20)
                started = trio.current_time()
                if how == "kill -9":
                    a.stop()
                else:
                    assert sentinels[0].command("SENTINEL", "FAILOVER", "lanes") == b"+OK\r\n"
                await wait_for(lambda: all(s.primary() == b.port for s in sentinels)
                               and b"role:master" in b.command("INFO", "replication"),
                               limit_s=20, step=0.02)
                done = trio.current_time()
                await wait_for(lambda: on(b) == 6, limit_s=LEASE + 5)  # every relay moved
                moved = trio.current_time()
                await wait_for(lambda: load.oks_after(moved) >= 10, limit_s=LEASE + 15)
                load.stop.set()
            resumed = load.first_ok_sent_after(done)
            report(how, load, started, done, resumed, moved)
            assert peak.peak == LANES
            # A relay asks the Sentinels at every renewal: it may learn of the switch up
            # to one tick (lease / 4) after they made it; then one quiet lease.
            assert resumed - done <= LEASE + LEASE / 4 + 0.5
            await idle_on(relays, b)
            nursery.cancel_scope.cancel()
    finally:
        for server in (*sentinels, a, b):
            server.stop()


@acl_user_only
async def test_a_subscription_silently_dropped_on_the_way_is_noticed_and_renewed(
        tmp_path: Path, redis: RedisServer, upstream: FakeUpstream,
        client: httpx.AsyncClient, caplog: pytest.LogCaptureFixture) -> None:
    """A NAT forgets the subscription's connection (the proxy stops forwarding it, the
    sockets stay open) while the command connection stays up: the missed pong is noticed
    within one ping interval, logged once, and the grant that follows arrives by pub/sub
    on the new subscription, sooner than a renewal tick would bring it."""
    upstream.scripts["hold"] = Script(hang=True)
    lease = 4.0  # a ping interval (lease / 4) of 1 s, a renewal tick of 1 s
    async with open_proxy(redis.port) as proxy, trio.open_nursery() as nursery:
        (tmp_path / "a").mkdir()
        (tmp_path / "b").mkdir()
        a = await start_relay(nursery, shared_config(upstream, redis.url, "a", lanes=1,
                                                     lease_s=lease), tmp_path / "a")
        b = await start_relay(nursery, shared_config(upstream, proxy.url, "b", lanes=1,
                                                     lease_s=lease), tmp_path / "b")
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
        await wait_for(lambda: lane(b).statistics().queued == 1)
        assert proxy.blackhole_subscriptions() == 1
        cut = trio.current_time()
        await wait_for(lambda: coord_b.subscription_renewals == 1, limit_s=2 * coord_b.ping_s)
        noticed = trio.current_time() - cut
        await wait_for(lambda: coord_b.subscribed.is_set(), limit_s=1.0)
        renewed = trio.current_time() - cut
        print(f"a silent subscription noticed after {noticed:.2f} s, subscribed again "
              f"after {renewed:.2f} s (ping interval {coord_b.ping_s:g} s)")
        assert renewed <= coord_b.ping_s + 0.2
        # The command connection was never touched: b still answers, and its waiter is
        # granted by the new subscription's wake-up, well inside a renewal tick.
        assert coord_b.available
        released = trio.current_time()
        holder.cancel()
        await wait_for(lambda: bool(got), limit_s=lease)
        print(f"granted {got[0] - released:.3f} s after the release")
        assert got[0] - released < coord_b.tick_s / 2
        warned = [r for r in caplog.records if "did not answer a ping" in r.getMessage()]
        assert len(warned) == 1
        nursery.cancel_scope.cancel()
