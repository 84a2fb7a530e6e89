"""Shared providers with accounts (SPEC L13 with L11), and a shared lane's figures as of
now: three relays in one test process (``relay.serve`` on loopback) and a real
redis-server."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import trio
from fakes.upstream import FakeUpstream, Script
from helpers.assembled import start_relay, wait_for
from helpers.redis_server import RedisServer
from helpers.shared_helpers import body, shared_config

from relay import Served


def zcard(redis: RedisServer, key: str) -> int:
    return int(redis.command("ZCARD", key).strip()[1:])


async def test_status_and_metrics_show_the_shared_lane_as_of_now(
        tmp_path: Path, redis: RedisServer, upstream: FakeUpstream,
        client: httpx.AsyncClient) -> None:
    # r1 and r2 renew every 2.5 s (the default lease of 10 s); r2 sends nothing and r0's
    # last reply is of its own last grant: before a status read asked the server, r2 said
    # "running 0, queued 0" and r0 "queued 0" while 4 ran and 3 waited. (r0's lease of
    # 2 s only ends the server's quiet period after its start sooner.)
    upstream.scripts["hold"] = Script(hang=True)
    async with trio.open_nursery() as nursery:
        relays: list[Served] = []
        for n, lease in enumerate((2.0, 10.0, 10.0)):
            (tmp_path / f"r{n}").mkdir()
            relays.append(await start_relay(nursery, shared_config(
                upstream, redis.url, f"r{n}", lease_s=lease), tmp_path / f"r{n}"))
        r0, r1, _ = relays

        async def post(served: Served, model: str) -> None:
            await client.post(f"{served.url}/v1/chat/completions", json=body(model))

        async def figures() -> list[tuple[Any, ...]]:
            out = []
            for served in relays:
                lanes = (await client.get(f"{served.url}/relay/v1/status")).json()[
                    "providers"]["up"]["lanes"]
                metrics = (await client.get(f"{served.url}/metrics")).text
                out.append((lanes["running"], lanes["queued"],
                            'relay_lane_queued{provider="up",scope="global"} '
                            f'{float(lanes["queued"])}' in metrics))
            return out

        async with trio.open_nursery() as load:
            first = trio.CancelScope()

            async def held() -> None:
                with first:
                    await post(r0, "up/hold")

            load.start_soon(held)
            for _ in range(3):
                load.start_soon(post, r0, "up/hold")
            await upstream.wait_for_requests(4)
            for _ in range(3):
                load.start_soon(post, r1, "up/hold")
            await wait_for(lambda: zcard(redis, "{relay:up}:w") == 3)
            assert await figures() == [(4, 3, True)] * 3
            first.cancel()  # a slot frees: r1's first waiter takes it
            await wait_for(lambda: zcard(redis, "{relay:up}:w") == 2)
            assert zcard(redis, "{relay:up}:h") == 4
            assert await figures() == [(4, 2, True)] * 3
            load.cancel_scope.cancel()
        nursery.cancel_scope.cancel()
