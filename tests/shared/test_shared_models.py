"""Budgets per model on a shared provider (SPEC L12a with L11): two relays, one real
redis-server, a provider that meters each model apart (tests/fakes/fake_metered.py with
``models``). Real time: the budgets live on the server's clock."""

from __future__ import annotations

import functools
from pathlib import Path

import httpx
import trio
from fakes.fake_metered import Limits, Metered, prose, serve_metered
from helpers.assembled import start_relay
from helpers.redis_server import RedisServer, acl_user_only

from relay import Served

pytestmark = acl_user_only  # on real time (helpers.redis_server)

SMALL, BIG = "small-out10", "big-out10"


def shared(url: str, redis_url: str, relay_id: str) -> str:
    return f"""
[server]
records = "records.jsonl"
coordination_url = "{redis_url}"
relay_id = "{relay_id}"
coordination_lease_s = 4
[providers.p]
adapter = "openai"
base_url = "{url}/v1"
shared = true
[providers.p.profile]
lanes = 16
queue_max = 64
queue_timeout_s = 30
run_timeout_s = 60
"""


async def test_each_model_keeps_its_own_shared_budget_across_relays(
        tmp_path: Path, redis: RedisServer) -> None:
    async with trio.open_nursery() as nursery:
        fake: Metered = await nursery.start(functools.partial(
            serve_metered, Limits(), models={SMALL: Limits(tpm=6000),
                                             BIG: Limits(tpm=600_000)}))
        relays: list[Served] = []
        for n in range(2):
            (tmp_path / f"r{n}").mkdir()
            relays.append(await start_relay(nursery, shared(fake.base_url, redis.url,
                                                             f"r{n}"), tmp_path / f"r{n}"))
        async with httpx.AsyncClient(trust_env=False, timeout=60.0) as client:
            async def ask(served: Served, model: str, tokens: int, seed: int
                          ) -> httpx.Response:
                return await client.post(f"{served.url}/v1/chat/completions", json={
                    "model": f"p/{model}", "max_tokens": 10,
                    "messages": [{"role": "user", "content": prose(tokens, seed)}]})

            # Each relay hears each model's headers once.
            for n, served in enumerate(relays):
                for model in (SMALL, BIG):
                    r = await ask(served, model, 200, n)
                    assert r.status_code == 200, r.text
            # The small model's 6,000 a minute is one budget for both relays: 2 x 2,400
            # tokens at once from the two fit; a third must wait for the refill. The big
            # model is not slowed by it: ~8,000 tokens start at once.
            start = trio.current_time()
            results: dict[str, float] = {}

            async def timed(name: str, served: Served, model: str, tokens: int) -> None:
                r = await ask(served, model, tokens, len(results) + 10)
                assert r.status_code == 200, r.text
                results[name] = trio.current_time() - start

            async with trio.open_nursery() as inner:
                inner.start_soon(timed, "small a", relays[0], SMALL, 2400)
                inner.start_soon(timed, "small b", relays[1], SMALL, 2400)
                await trio.sleep(0.3)
                inner.start_soon(timed, "small c", relays[0], SMALL, 2400)
                inner.start_soon(timed, "big", relays[1], BIG, 8000)
        assert fake.rejected == [], fake.rejected_models
        assert results["big"] < 2.0, results
        assert results["small c"] > 10.0, results  # it waited for the shared refill
        async with httpx.AsyncClient(trust_env=False) as client:
            status = (await client.get(f"{relays[1].url}/relay/v1/status")).json()
        models = status["providers"]["p"]["budgets"]["models"]
        assert models[SMALL]["budgets"]["tokens"]["limit_per_minute"] == 6000
        assert models[BIG]["budgets"]["tokens"]["limit_per_minute"] == 600_000
        nursery.cancel_scope.cancel()
