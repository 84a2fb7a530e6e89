"""Shared lanes (SPEC L11) through the assembled relay and a real redis-server."""

from __future__ import annotations

from pathlib import Path

import httpx
import trio
from conftest import start_relay, wait_for
from redis_server import RedisServer, redis_fixture  # noqa: F401  (the fixture)
from shared_helpers import Peak, body, shared_config
from upstream import FakeUpstream, Script


async def test_three_relays_never_run_more_than_lanes_at_the_upstream(
        tmp_path: Path, redis: RedisServer, upstream: FakeUpstream,
        client: httpx.AsyncClient) -> None:
    upstream.scripts["slow"] = Script(chunks=["a", "b", "c"], chunk_delay_s=0.05)
    peak = Peak(upstream)
    async with trio.open_nursery() as nursery:
        relays = []
        for n in range(3):
            (tmp_path / f"r{n}").mkdir()
            relays.append(await start_relay(
                nursery, shared_config(upstream, redis.url, f"r{n}"), tmp_path / f"r{n}"))
        results: list[int] = []

        async def one(i: int) -> None:
            r = await client.post(f"{relays[i % 3].url}/v1/chat/completions",
                                  json=body("up/slow"))
            results.append(r.status_code)

        async with trio.open_nursery() as load:
            for i in range(30):
                load.start_soon(one, i)
        assert results == [200] * 30
        assert peak.peak == 4
        for served in relays:
            await wait_for(lambda s=served: s.relay.providers["up"].lane.statistics().running == 0)
        nursery.cancel_scope.cancel()
