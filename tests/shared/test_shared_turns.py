"""Turns between clients (SPEC L14) on a shared provider (SPEC L11): the queue on the
coordination server takes the local lane's turns — start-time fair queueing by client and
weight inside each class, one queue across relays. Three relays in one test process
(``relay.serve`` on loopback), a real redis-server, each client with its own token."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from fakes.upstream import FakeUpstream, Script
from helpers.assembled import start_relay, wait_for
from helpers.redis_server import RedisServer, acl_user_only
from helpers.shared_helpers import body, shared_config

from relay import Served

WEIGHTS = {"heavy": 1, "light": 1, "batch": 2, "other": 1}
CLIENTS = "".join(f"""
[clients.{who}]
token_env = "RELAY_TEST_{who.upper()}_TOKEN"
weight = {weight}
""" for who, weight in WEIGHTS.items())


@pytest.fixture(autouse=True)
def _tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    for who in WEIGHTS:
        monkeypatch.setenv(f"RELAY_TEST_{who.upper()}_TOKEN", f"tok-{who}")


async def three(nursery: trio.Nursery, tmp_path: Path, up: FakeUpstream, url: str,
                **kw: Any) -> list[Served]:
    out = []
    for n in range(3):
        (tmp_path / f"r{n}").mkdir(exist_ok=True)
        out.append(await start_relay(nursery, shared_config(up, url, f"r{n}", extra=CLIENTS,
                                                            **kw), tmp_path / f"r{n}"))
    return out


def queued(redis: RedisServer) -> int:
    return int(redis.command("ZCARD", "{relay:up}:w").strip()[1:])


def texts(up: FakeUpstream) -> list[str]:
    return [r.json["messages"][0]["content"] for r in up.requests]


async def ask(client: httpx.AsyncClient, served: Served, who: str, text: str,
              model: str = "up/m1", done: list[str] | None = None) -> None:
    r = await client.post(f"{served.url}/v1/chat/completions",
                          json={**body(model), "messages": [{"role": "user",
                                                             "content": text}]},
                          headers={"Authorization": f"Bearer tok-{who}"})
    if done is not None:
        done.append(f"{text}:{r.status_code}")


async def all_idle(redis: RedisServer) -> None:
    await wait_for(lambda: redis.command("ZCARD", "{relay:up}:h").strip() == b":0"
                   and queued(redis) == 0, limit_s=10)


@acl_user_only  # (the room's long tests run as the documented ACL user only)
async def test_a_light_clients_request_starts_within_one_answer_of_a_heavy_burst_elsewhere(
        tmp_path: Path, redis: RedisServer, upstream: FakeUpstream,
        client: httpx.AsyncClient) -> None:
    # 2 lanes, 0.4 s answers. "heavy" sends 32 on relay r0 (2 run, 30 queue); then
    # "light" sends one on relay r1: it starts at the next free slot (within one answer),
    # not behind the 30 (FIFO: 15 rounds of 0.4 s, 6 s).
    upstream.scripts["slow"] = Script(first_byte_delay_s=0.4)
    async with trio.open_nursery() as nursery:
        r0, r1, _ = await three(nursery, tmp_path, upstream, redis.url, lanes=2,
                                lease_s=4.0)
        async with trio.open_nursery() as heavy:
            for i in range(32):
                heavy.start_soon(ask, client, r0, "heavy", f"heavy {i}", "up/slow")
            await wait_for(lambda: queued(redis) == 30, limit_s=10)
            await upstream.wait_for_requests(2)
            seen = len(upstream.requests)
            asked = trio.current_time()
            light: list[str] = []
            await ask(client, r1, "light", "light 0", "up/slow", light)
            took = trio.current_time() - asked
            assert light == ["light 0:200"]
            print(f"light's request answered in {took:.2f} s (0.4 s answers, 2 lanes, "
                  f"heavy's 30 queued on another relay)")
            order = texts(upstream)
            # It was the next start: at most the other lane's next start came first.
            assert order.index("light 0") <= seen + 1, (seen, order, took)
            # Its answer, plus at most one answer (and margin for a loaded machine); FIFO
            # would be 15 rounds (6 s).
            assert took <= 0.4 + 0.4 + 1.5, took
            assert queued(redis) >= 26  # the heavy burst still waits
            heavy.cancel_scope.cancel()
        await all_idle(redis)
        nursery.cancel_scope.cancel()


async def test_weights_and_each_clients_own_order_across_relays(
        tmp_path: Path, redis: RedisServer, upstream: FakeUpstream,
        client: httpx.AsyncClient) -> None:
    # One lane, held by "other"'s request. "heavy" (weight 1) queues 6 on relay r0, then
    # "batch" (weight 2) 6 on relay r1. When the slot frees, the server starts them in
    # turns: batch twice for each of heavy's, each client's own in order.
    upstream.scripts["hold"] = Script(hang=True)
    async with trio.open_nursery() as nursery:
        r0, r1, r2 = await three(nursery, tmp_path, upstream, redis.url, lanes=1)
        done: list[str] = []
        holder = trio.CancelScope()

        async def hold() -> None:
            with holder:
                await ask(client, r2, "other", "holder", "up/hold")

        async with trio.open_nursery() as waiting:
            waiting.start_soon(hold)
            await upstream.wait_for_requests(1)
            n = 0
            for who, served in (("heavy", r0), ("batch", r1)):
                for i in range(6):
                    waiting.start_soon(ask, client, served, who, f"{who} {i}", "up/m1", done)
                    n += 1
                    await wait_for(lambda n=n: queued(redis) == n)
            holder.cancel()
        order = texts(upstream)[1:]
        # Turns (ticks of 1/weight): heavy 0,1,2,3,4,5; batch 0,.5,1,1.5,2,2.5; a tie
        # goes to the earlier arrival (heavy's).
        assert order == ["heavy 0", "batch 0", "batch 1", "heavy 1", "batch 2", "batch 3",
                         "heavy 2", "batch 4", "batch 5", "heavy 3", "heavy 4", "heavy 5"
                         ], order
        assert sorted(done) == sorted(f"{w} {i}:200" for w in ("heavy", "batch")
                                      for i in range(6))
        await all_idle(redis)
        nursery.cancel_scope.cancel()


async def test_a_leaving_waiter_hands_its_turn_back(
        tmp_path: Path, redis: RedisServer, upstream: FakeUpstream,
        client: httpx.AsyncClient) -> None:
    # One lane, held. "heavy" queues 3 on r0, "light" 3 on r1 (turns: heavy 0,1,2; light
    # 0,1,2). Heavy's first leaves (its client gone): its later two move up one turn each
    # (to 0 and 1), so heavy loses no turn: heavy 1 starts first (a tie with light 0,
    # which arrived later), heavy 2 before light 1. (Without the hand-back: light 0 first,
    # heavy 2 after light 1.)
    upstream.scripts["hold"] = Script(hang=True)
    async with trio.open_nursery() as nursery:
        r0, r1, r2 = await three(nursery, tmp_path, upstream, redis.url, lanes=1)
        done: list[str] = []
        holder = trio.CancelScope()
        gone = trio.CancelScope()

        async def hold() -> None:
            with holder:
                await ask(client, r2, "other", "holder", "up/hold")

        async def leaves() -> None:
            with gone:
                await ask(client, r0, "heavy", "heavy 0", "up/m1", done)

        async with trio.open_nursery() as waiting:
            waiting.start_soon(hold)
            await upstream.wait_for_requests(1)
            waiting.start_soon(leaves)
            await wait_for(lambda: queued(redis) == 1)
            n = 1
            for who, served, first in (("heavy", r0, 1), ("light", r1, 0)):
                for i in range(first, 3):
                    waiting.start_soon(ask, client, served, who, f"{who} {i}", "up/m1", done)
                    n += 1
                    await wait_for(lambda n=n: queued(redis) == n)
            gone.cancel()
            await wait_for(lambda: queued(redis) == 5)
            holder.cancel()
        order = texts(upstream)[1:]
        assert order == ["heavy 1", "light 0", "heavy 2", "light 1", "light 2"], order
        await all_idle(redis)
        nursery.cancel_scope.cancel()
