"""Shared lanes (SPEC L11): what a slot counted across relays costs, on a real server.

    python -m bench.shared                 # the full run: 3 relays x 10,000 requests
    python -m bench.shared --requests 500  # a quick run (per relay)

Starts its own ``redis-server`` on a free loopback port and reports, in one run:

1. **acquire + release** of an uncontended slot (``async with lane.slot(): pass``),
   p50/p99, on a local `Lane` and on a `SharedLane` (three Lua scripts' worth of round
   trips: ACQUIRE and RELEASE);
2. the **contended hand-off**: relay A holds the only slot, relay B's request waits; the
   time from A starting to give the slot back to B's request holding it (A's RELEASE
   grants it on the server and publishes the wake-up B's subscription receives), p50/p99
   — target p99 <= 5 ms on loopback. A lost wake-up (pub/sub is at most once) is made up
   by B's next renewal (lease / 4), which would show here as a p99 of that size;
3. **3 relays x N requests** through the assembled relays (HTTP, the ``openai`` adapter,
   a fake upstream that takes a few ms per answer), 1 in 17 cut off by its client: the
   upstream's highest concurrency must equal ``lanes`` exactly, and at the end every
   relay's shared lane must show 0 running and 0 queued (and the server hold no slot).

4. **one script call on three clients** (``EVALSHA`` of a script shaped like RELEASE: 5
   keys, 10 arguments), sequential, p50/p99: relay's own client (hiredis's parser,
   relay's trio I/O), coredis and valkey-glide, both under trio too — where they are
   installed (``pip install coredis valkey-glide``: not relay's dependencies); why
   relay keeps its own (see ``relay/redis/resp.py``).

Exits non-zero when a check of part 3 fails. The numbers are printed, not asserted.
"""

from __future__ import annotations

import argparse
import functools
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from fakes.upstream import FakeUpstream, Script, serve_fake_upstream  # noqa: E402
from helpers.redis_server import REDIS, RedisServer  # noqa: E402
from helpers.shared_helpers import Peak, body, shared_config  # noqa: E402

import relay  # noqa: E402
from relay.capacity.lanes import Lane  # noqa: E402
from relay.shared.coordinator import Coordinator  # noqa: E402
from relay.shared.lane import SharedLane  # noqa: E402
from relay.vocab.profile import Profile  # noqa: E402

LEASE_S = 2.0


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))] * 1000


def line(name: str, values: list[float]) -> str:
    return (f"{name:<34} n={len(values):<6} p50 {pct(values, 50):7.3f} ms   "
            f"p99 {pct(values, 99):7.3f} ms   mean {statistics.fmean(values) * 1000:7.3f} ms")


async def measure_slots(url: str, n: int) -> dict[str, list[float]]:
    """Part 1 and 2's times, in seconds: ``local`` and ``shared`` acquire+release of an
    uncontended slot (``n`` in all, alternating in halves), and ``handoff`` (``n // 4``).
    `bench.overhead` reports them too (its section 7)."""
    profile = Profile(lanes=1, queue_max=4, queue_timeout_s=10, run_timeout_s=60)
    local = Lane("bench", profile)
    async with trio.open_nursery() as nursery:
        a = Coordinator(url, prefix="bench-slot", lease_s=LEASE_S, relay_id="a")
        b = Coordinator(url, prefix="bench-slot", lease_s=LEASE_S, relay_id="b")
        lane_a = SharedLane("bench", profile, a)
        lane_b = SharedLane("bench", profile, b)
        await nursery.start(a.serve)
        await nursery.start(b.serve)
        times: dict[str, list[float]] = {"local": [], "shared": [], "handoff": []}
        for kind, lane in (("local", local), ("shared", lane_a)) * 2:
            for _ in range(n // 2):
                t = time.perf_counter()
                async with lane.slot():
                    pass
                times[kind].append(time.perf_counter() - t)

        for _ in range(n // 4):
            queued = trio.Event()
            granted_at: list[float] = []
            released_at: list[float] = []

            async def wait_on_b(queued: trio.Event = queued,
                                granted_at: list[float] = granted_at) -> None:
                async with lane_b.slot(on_queued=queued.set):
                    granted_at.append(time.perf_counter())

            async with lane_a.slot():
                nursery.start_soon(wait_on_b)
                await queued.wait()
                released_at.append(time.perf_counter())
            with trio.fail_after(5):
                while not granted_at:  # noqa: ASYNC110 (a bench's bounded poll)
                    await trio.sleep(0.0001)
            times["handoff"].append(granted_at[0] - released_at[0])
        nursery.cancel_scope.cancel()
    return times


async def slot_costs(url: str, n: int) -> None:
    times = await measure_slots(url, n)
    print(line("acquire+release, local lane", times["local"]))
    print(line("acquire+release, shared lane", times["shared"]))
    ratio = statistics.median(times["shared"]) / statistics.median(times["local"])
    extra = pct(times["shared"], 50) - pct(times["local"], 50)
    print(f"{'':<34} a shared slot costs {extra:.3f} ms more at p50 ({ratio:.0f}x a "
          "local one)")
    print(line("contended hand-off (A -> B)", times["handoff"]))
    print(f"{'':<34} p99 target <= 5 ms: "
          f"{'met' if pct(times['handoff'], 99) <= 5 else 'MISSED'}")


_SHAPED = "return {'released', #KEYS, #ARGV, -1, {}}"  # (RELEASE's reply shape)


async def client_costs(url: str, port: int, n: int) -> None:
    """Part 4: one EVALSHA's round trip on relay's client, coredis and valkey-glide."""
    from relay.redis import resp
    script = resp.Script(_SHAPED)
    keys = [f"{{bench:c}}:{k}" for k in ["h", "w", "wx", "m", "r"]]
    argv = ["inst", "relay", 2000, "", 4, 64, "0.0", "bench:wake:", "c", "member"]
    times: dict[str, list[float]] = {}

    async def run(name: str, call: Any) -> None:
        for _ in range(50):  # warm up
            await call()
        out = times[name] = []
        for _ in range(n):
            t = time.perf_counter()
            await call()
            out.append(time.perf_counter() - t)

    async with resp.open_client(url, timeout_s=5, name="bench") as client:
        await client.execute("SCRIPT", "LOAD", _SHAPED)
        await run("relay (hiredis parser)", lambda: client.execute(
            "EVALSHA", script.sha, len(keys), *keys, *argv))
    try:
        import coredis
    except ImportError:
        print(f"{'coredis':<34} not installed (pip install coredis)")
    else:
        redis_c = coredis.Redis(host="127.0.0.1", port=port, decode_responses=True)
        async with redis_c:
            await run(f"coredis {coredis.__version__}", lambda: redis_c.evalsha(
                script.sha, keys=keys, args=[str(a) for a in argv]))
    try:
        from importlib.metadata import version

        import glide
    except ImportError:
        print(f"{'valkey-glide':<34} not installed (pip install valkey-glide)")
    else:
        g = await glide.GlideClient.create(glide.GlideClientConfiguration(
            [glide.NodeAddress("127.0.0.1", port)]))
        try:
            await run(f"valkey-glide {version('valkey-glide')}", lambda: g.custom_command(
                ["EVALSHA", script.sha, str(len(keys)), *keys, *map(str, argv)]))
        finally:
            await g.close()
    for name, values in times.items():
        print(line(f"EVALSHA, {name}", values))


def wait_until_granting(server: RedisServer) -> None:
    """A fresh server grants nothing for one lease (see relay/engine/shared_scripts):
    return once it has been up that long."""
    while int(server.command("INFO", "server").split(b"uptime_in_seconds:")[1]
              .split()[0]) < LEASE_S + 1:
        time.sleep(0.1)


async def three_relays(url: str, n: int, tmp: Path, *, lanes: int = 4,
                       concurrency: int = 24) -> bool:
    rng = random.Random(17)
    async with trio.open_nursery() as nursery:
        up: FakeUpstream = await nursery.start(serve_fake_upstream)
        up.scripts["slow"] = Script(chunks=["a", "b", "c"], chunk_delay_s=0.002)
        peak = Peak(up)
        relays: list[relay.Served] = []
        for k in range(3):
            folder = tmp / f"r{k}"
            folder.mkdir()
            text = shared_config(up, url, f"r{k}", lanes=lanes, queue_max=concurrency * 3,
                                 lease_s=LEASE_S)
            config = relay.parse_config(text, source="bench.toml", base_dir=folder)
            relays.append(await nursery.start(functools.partial(relay.serve, config,
                                                                port=0)))
        counts = {"ok": 0, "cut": 0, "other": 0}
        started = time.perf_counter()

        async def worker(k: int, quota: int, client: httpx.AsyncClient) -> None:
            base = relays[k].url
            for i in range(quota):
                cut = rng.randrange(17) == 0
                stream = i % 2 == 0
                with trio.move_on_after(rng.uniform(0.001, 0.02) if cut else 60) as scope:
                    r = await client.post(f"{base}/v1/chat/completions",
                                          json=body("up/slow", stream=stream))
                    counts["ok" if r.status_code == 200 else "other"] += 1
                if scope.cancelled_caught:
                    counts["cut"] += 1

        limits = httpx.Limits(max_connections=concurrency * 3)
        per_worker = n // (concurrency // 3 or 1)
        async with (httpx.AsyncClient(trust_env=False, timeout=60, limits=limits) as client,
                    trio.open_nursery() as load):
            for k in range(3):
                for _ in range(concurrency // 3):
                    load.start_soon(worker, k, per_worker, client)
        took = time.perf_counter() - started
        total = sum(counts.values())
        print(f"3 relays x {total // 3} requests in {took:.1f} s ({total / took:.0f}/s): "
              f"{counts['ok']} answered, {counts['cut']} cut off, {counts['other']} other")

        def idle() -> bool:
            return all(r.relay.providers["up"].lane.statistics().running == 0
                       and r.relay.providers["up"].lane.statistics().queued == 0
                       for r in relays)
        with trio.move_on_after(LEASE_S * 2):  # the numbers arrive with renewals
            while not idle():  # noqa: ASYNC110 (no event announces them)
                await trio.sleep(0.05)
        stats = [r.relay.providers["up"].lane.statistics() for r in relays]
        print(f"upstream's highest concurrency: {peak.peak} (lanes {lanes}); at the end: "
              + ", ".join(f"r{k} {s.running} running {s.queued} queued"
                          for k, s in enumerate(stats)))
        nursery.cancel_scope.cancel()
    ok = peak.peak == lanes and idle() and counts["other"] == 0
    print("checks:", "ok" if ok else "FAILED")
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=10_000,
                        help="requests per relay in part 3 (default 10,000)")
    parser.add_argument("--slots", type=int, default=2000,
                        help="acquire+release rounds in part 1 (default 2,000)")
    args = parser.parse_args()
    if REDIS is None:
        print("bench.shared: redis-server is not installed (.ci/install-redis.sh)")
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer(REDIS, Path(tmp) / "redis")
        server.start()
        try:
            wait_until_granting(server)
            trio.run(slot_costs, server.url, args.slots)
            trio.run(client_costs, server.url, server.port, args.slots)
            ok: Any = trio.run(three_relays, server.url, args.requests, Path(tmp))
            left = server.command("ZCARD", "{relay:up}:h").strip()
            print(f"slots held on the server at the end: {left.decode()[1:]}")
        finally:
            server.stop()
    return 0 if ok and left == b":0" else 1


if __name__ == "__main__":
    sys.exit(main())
