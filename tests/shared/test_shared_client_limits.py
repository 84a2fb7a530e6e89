"""A client's limits across relays (SPEC L14 with L11): two relays with one coordination
server (a real redis-server) count a client's per-minute and dollar limits together,
through the assembled relays (config → relay → HTTP on loopback → a fake upstream).
Real time (a real server): short figures with margins."""

from __future__ import annotations

import datetime as dt
import math
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from helpers.assembled import records, start_relay, wait_for
from helpers.redis_server import RedisServer

from relay import Served

CONFIG = """
[server]
records = "records.jsonl"
coordination_url = "{url}"
relay_id = "{relay_id}"
coordination_lease_s = 2
[providers.fake]
adapter = "fake"
models = ["echo"]
[providers.fake.profile]
queue_timeout_s = 1.5
[providers.fake.prices."echo"]
input = 0.0
output = 1000000.0     # a dollar a completion token
[clients.capped]
token_env = "RELAY_TEST_CAPPED_TOKEN"
rpm = 3
[clients.payer]
token_env = "RELAY_TEST_PAYER_TOKEN"
usd_per_day = 1
"""


@pytest.fixture(autouse=True)
def _tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    for who in ("capped", "payer"):
        monkeypatch.setenv(f"RELAY_TEST_{who.upper()}_TOKEN", f"tok-{who}")


async def two(nursery: trio.Nursery, tmp_path: Path, url: str) -> list[Served]:
    """Two relays with one coordination server and no shared provider: the clients'
    limits alone bring the server in."""
    out = []
    for n in range(2):
        (tmp_path / f"r{n}").mkdir(exist_ok=True)
        out.append(await start_relay(nursery, CONFIG.format(url=url, relay_id=f"r{n}"),
                                     tmp_path / f"r{n}"))
    return out


async def ask(client: httpx.AsyncClient, served: Served, who: str) -> httpx.Response:
    return await client.post(f"{served.url}/v1/chat/completions",
                              json={"model": "fake/echo", "max_tokens": 2, "messages": [
                                  {"role": "user", "content": "two words"}]},
                              headers={"Authorization": f"Bearer tok-{who}"})


def answered(tmp_path: Path, who: str) -> list[dict[str, Any]]:
    return [r for n in range(2) for r in records(tmp_path / f"r{n}")
            if r["client"] == who and r["status"] == 200]


def day_reset_s() -> float:
    now = dt.datetime.now(tz=dt.UTC)
    midnight = now.replace(hour=0, minute=0, second=0, microsecond=0) + dt.timedelta(days=1)
    return midnight.timestamp() - now.timestamp()


async def test_a_clients_rpm_holds_across_two_relays(
        tmp_path: Path, redis: RedisServer, client: httpx.AsyncClient) -> None:
    # rpm = 3: three start on relay r0; relay r1's one more waits at the client's gate
    # (SPEC L14: it waits like any waiter) until its queue timeout (1.5 s), then is
    # refused with the minute's end as Retry-After. Per relay, r1 would have started it.
    async with trio.open_nursery() as nursery:
        r0, r1 = await two(nursery, tmp_path, redis.url)
        first = time.monotonic()
        for _ in range(3):
            assert (await ask(client, r0, "capped")).status_code == 200
        asked = time.monotonic()
        refused = await ask(client, r1, "capped")
        waited = time.monotonic() - asked
        assert refused.status_code == 429, refused.text
        error = refused.json()["error"]
        assert error["code"] == "provider_queue_timeout", error
        assert "rpm limit of 3 requests a minute across relays" in error["message"], error
        assert 1.4 <= waited <= 4.0, waited
        retry = int(refused.headers["retry-after"])
        # The minute from the first of the three starts, as the server counted it.
        assert 60 - (time.monotonic() - first) - 2 <= retry <= 60, retry
        # Together: no more than rpm in the minute.
        await wait_for(lambda: len(records(tmp_path / "r1")) == 1)
        assert len(answered(tmp_path, "capped")) == 3
        # Another client is not held back by this one's limit.
        assert (await ask(client, r1, "payer")).status_code == 200
        nursery.cancel_scope.cancel()


async def test_a_clients_dollar_limit_holds_across_two_relays(
        tmp_path: Path, redis: RedisServer, client: httpx.AsyncClient) -> None:
    # usd_per_day = 1: relay r0's request costs $2 (2 words back at $1 each); relay
    # r1 has spent nothing itself, but the server holds r0's spend: client_limit at once,
    # Retry-After the UTC day's reset.
    async with trio.open_nursery() as nursery:
        r0, r1 = await two(nursery, tmp_path, redis.url)
        first = await ask(client, r0, "payer")
        assert first.status_code == 200, first.text
        day = dt.datetime.now(tz=dt.UTC).strftime("%Y-%m-%d")
        key = "{relay:client:payer}:d:" + day
        await wait_for(lambda: redis.command("HGET", key, "u:r0").endswith(b"\r\n2.0\r\n"))
        with trio.fail_after(1.0):  # at once: nothing waits
            refused = await ask(client, r1, "payer")
        assert refused.status_code == 429, refused.text
        error = refused.json()["error"]
        assert error["code"] == "client_limit", error
        assert "across relays" in error["message"] and "$2.0000 today" in error["message"]
        assert abs(int(refused.headers["retry-after"]) - math.ceil(day_reset_s())) <= 2
        await wait_for(lambda: len(records(tmp_path / "r1")) == 1)
        assert [r["cost_usd"] for r in answered(tmp_path, "payer")] == [2.0]
        (rec,) = [r for r in records(tmp_path / "r1") if r["client"] == "payer"]
        assert rec["status"] == 429 and rec["reason"] == "client_limit"
        nursery.cancel_scope.cancel()
