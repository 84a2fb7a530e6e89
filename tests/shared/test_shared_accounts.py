"""Shared providers with accounts (SPEC L13 with L11), and a shared lane's figures as of
now: three relays in one test process (``relay.serve`` on loopback) and a real
redis-server."""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from fakes.fake_accounts import KeyedMetered, key_of
from fakes.fake_http import Exchange, serve_fake
from fakes.fake_metered import Limits
from fakes.upstream import FakeUpstream, Script
from helpers.assembled import records, start_relay, wait_for
from helpers.redis_server import RedisServer
from helpers.shared_helpers import body, shared_config

from relay import Served

KEYS = {"KEY_A": "sk-shared-a", "KEY_B": "sk-shared-b"}


class PerKey(KeyedMetered):
    """`KeyedMetered` that also counts the requests each key has in progress at once
    (429s included), and may answer one key's every request 429."""

    def __init__(self, port: int) -> None:
        super().__init__(port)
        self.active_by: collections.Counter[str] = collections.Counter()
        self.peak_by: collections.Counter[str] = collections.Counter()
        self.refuse: str | None = None
        self.slow: dict[str, float] = {}  # a key's answers take this long more

    async def respond(self, ex: Exchange) -> None:
        key = key_of(ex.request.headers)
        self.active_by[key] += 1
        self.peak_by[key] = max(self.peak_by[key], self.active_by[key])
        try:
            await trio.sleep(self.slow.get(key, 0.0))
            if key == self.refuse:
                self.refused[key] += 1
                await self._reject(ex, trio.current_time(), 1.0, "rpm", 1,
                                   str(ex.json.get("model")), False)
                return
            await super().respond(ex)
        finally:
            self.active_by[key] -= 1


@pytest.fixture(autouse=True)
def _keys(monkeypatch: pytest.MonkeyPatch) -> None:
    for env, key in KEYS.items():
        monkeypatch.setenv(env, key)


@pytest.fixture
async def keyed(nursery: trio.Nursery) -> PerKey:
    server: PerKey = await nursery.start(serve_fake, PerKey)
    server.configure(Limits(rpm=100_000))
    server.first_token_s, server.answer_tokens = 0.05, 10
    return server


def accounts_config(url: str, redis_url: str, relay_id: str) -> str:
    return f"""
[server]
records = "records.jsonl"
coordination_url = "{redis_url}"
relay_id = "{relay_id}"
coordination_lease_s = 2.0
[providers.p]
adapter = "openai"
base_url = "{url}/v1"
models = ["m"]
shared = true
[[providers.p.accounts]]
name = "a"
api_key_env = "KEY_A"
[[providers.p.accounts]]
name = "b"
api_key_env = "KEY_B"
[providers.p.profile]
lanes = 2
queue_max = 200
queue_timeout_s = 30
run_timeout_s = 30
"""


async def three_with_accounts(nursery: trio.Nursery, tmp_path: Path, url: str,
                              redis_url: str) -> list[Served]:
    out = []
    for n in range(3):
        (tmp_path / f"r{n}").mkdir()
        out.append(await start_relay(nursery, accounts_config(url, redis_url, f"r{n}"),
                                     tmp_path / f"r{n}"))
    return out


async def burst(client: httpx.AsyncClient, relays: list[Served], n: int) -> list[int]:
    statuses: list[int] = []

    async def one(i: int) -> None:
        r = await client.post(f"{relays[i % 3].url}/v1/chat/completions",
                              json={"model": "p/m", "stream": i % 2 == 0, "messages": [
                                  {"role": "user", "content": f"question {i}"}]})
        statuses.append(r.status_code)

    async with trio.open_nursery() as load:
        for i in range(n):
            load.start_soon(one, i)
    return statuses


async def test_three_relays_spread_over_two_shared_accounts_within_each_ones_lanes(
        tmp_path: Path, redis: RedisServer, keyed: PerKey,
        client: httpx.AsyncClient) -> None:
    async with trio.open_nursery() as nursery:
        relays = await three_with_accounts(nursery, tmp_path, keyed.base_url, redis.url)
        await wait_for(lambda: all(s.relay.providers["p"].lane.statistics().capacity == 4
                                   for s in relays))
        statuses = await burst(client, relays, 60)
        assert statuses == [200] * 60
        a, b = KEYS["KEY_A"], KEYS["KEY_B"]
        # Each account's lanes across the three relays: never more, and both used fully
        # (together: the work spread over both at once).
        assert keyed.peak_by == {a: 2, b: 2}, keyed.peak_by
        assert keyed.served[a] + keyed.served[b] == 60
        assert min(keyed.served[a], keyed.served[b]) >= 15, keyed.served
        said = [r for n in range(3) for r in records(tmp_path / f"r{n}")]
        assert {r["account"] for r in said} == {"a", "b"}
        assert {r["relay_id"] for r in said} == {"r0", "r1", "r2"}
        entry = (await client.get(f"{relays[0].url}/relay/v1/status")).json()[
            "providers"]["p"]
        assert [x["name"] for x in entry["accounts"]] == ["a", "b"]
        assert all(x["capacity"] == 2 and x["shared"] for x in entry["accounts"])
        assert entry["lanes"]["capacity"] == 4
        metrics = (await client.get(f"{relays[0].url}/metrics")).text
        assert 'relay_account_capacity{account="a",provider="p"} 2.0' in metrics
        for key in ("{relay:p#a}:h", "{relay:p#b}:h", "{relay:p#a}:w", "{relay:p#b}:w"):
            assert zcard(redis, key) == 0
        nursery.cancel_scope.cancel()


async def test_a_waiting_request_starts_on_whichever_account_frees_first(
        tmp_path: Path, redis: RedisServer, keyed: PerKey,
        client: httpx.AsyncClient) -> None:
    # Account a answers in 1.5 s, b in about 0.1 s. Every request waits on both accounts
    # at once, so b's slots take the queue while a's first two still run: a request
    # queued on one account alone would wait there behind a's slow answers while b idles.
    a, b = KEYS["KEY_A"], KEYS["KEY_B"]
    keyed.slow[a] = 1.5
    async with trio.open_nursery() as nursery:
        relays = await three_with_accounts(nursery, tmp_path, keyed.base_url, redis.url)
        statuses = await burst(client, relays, 30)
        assert statuses == [200] * 30
        # (a's two slots: the first requests, and at most one more each once they end)
        assert keyed.served[a] <= 4 and keyed.peak_by[b] == 2, (keyed.served, keyed.peak_by)
        nursery.cancel_scope.cancel()


async def test_a_429_on_one_shared_account_moves_the_work_to_the_other(
        tmp_path: Path, redis: RedisServer, keyed: PerKey,
        client: httpx.AsyncClient) -> None:
    keyed.refuse = KEYS["KEY_A"]  # account a answers every request 429 (retry in 1 s)
    async with trio.open_nursery() as nursery:
        relays = await three_with_accounts(nursery, tmp_path, keyed.base_url, redis.url)
        statuses = await burst(client, relays, 24)
        assert statuses == [200] * 24  # no client failure
        assert keyed.served == {KEYS["KEY_B"]: 24}
        assert keyed.refused[KEYS["KEY_A"]] >= 1
        said = [r for n in range(3) for r in records(tmp_path / f"r{n}")]
        assert {r["account"] for r in said} == {"b"}
        moved = [r for r in said if len(r["attempts"]) > 1]
        assert moved, said
        for r in moved:
            assert [(x["account"], x.get("failure")) for x in r["attempts"]] == [
                ("a", "rate_limited"), ("b", None)], r["attempts"]
        nursery.cancel_scope.cancel()


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
