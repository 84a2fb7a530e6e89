"""A client's limits (SPEC L14, O7) through the assembled relay, on virtual time: the
per-day limits answer ``client_limit`` 429 at once with the UTC day's reset as
Retry-After (the records' wall clock is relay's, anchored once: virtual time moves it)
and survive a restart (seeded from the records file); a dollar limit reserves each
request's estimated cost, so a burst overshoots by at most what was running; per-minute
limits and lanes wait like any waiter, their notices naming the limit, bounded by the
provider's queue timeout."""

from __future__ import annotations

import datetime as dt
import math
from pathlib import Path
from typing import Any

import trio
from helpers.assembled import ASGIResult, asgi_request, chat, config_from, records

from relay import Relay, open_relay

TOKEN = "agent-token-0123456789"
OTHER = "other-token-0123456789"
ENV = {"AGENT_TOKEN": TOKEN, "OTHER_TOKEN": OTHER}

BASE = """
[server]
records = "records.jsonl"
heartbeat_s = 1000
[providers.fake]
adapter = "fake"
models = ["echo"]
[providers.fake.profile]
lanes = 20
queue_max = 20
queue_timeout_s = 100
run_timeout_s = 5000
[providers.fake.prices."echo?delay_s=10"]
input = 0.0
output = 1000000.0     # a dollar a completion token
[providers.two]
adapter = "fake"
models = ["echo"]
[clients.other]
token_env = "OTHER_TOKEN"
"""


def agent(limits: str) -> str:
    return BASE + f"""
[clients.agent]
token_env = "AGENT_TOKEN"
{limits}
"""


def send(nursery: trio.Nursery, r: Relay, body: dict[str, Any], token: str = TOKEN,
         headers: dict[str, str] | None = None) -> ASGIResult:
    result = ASGIResult()
    nursery.start_soon(lambda: asgi_request(r.app, "/v1/chat/completions", body, result,
                                            headers={"authorization": f"Bearer {token}",
                                                     **(headers or {})}))
    return result


async def answered(r: Relay, body: dict[str, Any], token: str = TOKEN) -> ASGIResult:
    async with trio.open_nursery() as nursery:
        result = send(nursery, r, body, token)
    return result


def day_reset_s(r: Relay) -> float:
    """Seconds from relay's wall clock now to the next UTC midnight."""
    wall = r.clock.wall(trio.current_time())
    now = dt.datetime.fromtimestamp(wall, tz=dt.UTC)
    midnight = now.replace(hour=0, minute=0, second=0, microsecond=0) + dt.timedelta(days=1)
    return midnight.timestamp() - wall


async def test_a_spent_day_is_a_429_until_the_utc_day_resets_and_a_restart_keeps_it(
        tmp_path: Path, autojump_clock: Any) -> None:
    config = config_from(agent("tokens_per_day = 10"), tmp_path, environ=ENV)
    words = chat("fake/echo", "one two three")   # 3 in, 3 out: 6 tokens each
    async with open_relay(config, discover=False) as r:
        assert (await answered(r, words)).status == 200
        assert (await answered(r, words)).status == 200   # 6 of 10 used: admitted
        refused = await answered(r, words)                # 12 of 10
        assert refused.status == 429, refused.body
        error = refused.json()["error"]
        assert error["code"] == "client_limit" and "12 tokens today of its 10" in (
            error["message"]), error
        assert int(refused.headers["retry-after"]) == math.ceil(day_reset_s(r))
        assert refused.headers["x-should-retry"] == "true"
        # Another client is not held back by this one's limit.
        assert (await answered(r, words, OTHER)).status == 200
    # A restart: this day's spend is read back from the records.
    async with open_relay(config, discover=False) as r:
        assert (await answered(r, words)).status == 429
        await trio.sleep(day_reset_s(r) + 1)              # the next UTC day
        assert (await answered(r, words)).status == 200
    spent = [(rec["client"], rec["status"]) for rec in records(tmp_path)]
    assert spent == [("agent", 200), ("agent", 200), ("agent", 429), ("other", 200),
                     ("agent", 429), ("agent", 200)]


async def test_a_dollar_limit_reserves_the_estimate_so_a_burst_overshoots_by_what_runs(
        tmp_path: Path, autojump_clock: Any) -> None:
    # Each request reserves its output reservation (max_tokens 4) at $1 a token: $4; it
    # costs what it says: 4 words back, $4. With $10 a day, three start (0, 4, 8 < 10),
    # the rest of the burst is refused at once; spent: $12, over by less than ran.
    config = config_from(agent("usd_per_day = 10"), tmp_path, environ=ENV)
    body = chat("fake/echo?delay_s=10", "a b c d", max_tokens=4)
    async with open_relay(config, discover=False) as r:
        async with trio.open_nursery() as nursery:
            burst = [send(nursery, r, body) for _ in range(10)]
        statuses = sorted(result.status or 0 for result in burst)
        assert statuses == [200] * 3 + [429] * 7, statuses
        assert r.clients.spent("agent") == {"tokens_today": 3 * 8, "usd_today": 12.0,
                                            "usd_this_month": 12.0, "usd_reserved": 0.0}
        late = await answered(r, body)   # spent: refused, until the day's reset
        assert late.status == 429 and late.json()["error"]["code"] == "client_limit"
        assert int(late.headers["retry-after"]) == math.ceil(day_reset_s(r))
    costs = [rec["cost_usd"] for rec in records(tmp_path) if rec["status"] == 200]
    assert costs == [4.0, 4.0, 4.0]


async def test_a_month_limit_resets_at_the_months_end(tmp_path: Path,
                                                      autojump_clock: Any) -> None:
    config = config_from(agent("usd_per_month = 3"), tmp_path, environ=ENV)
    body = chat("fake/echo?delay_s=10", "a b c d", max_tokens=4)
    async with open_relay(config, discover=False) as r:
        assert (await answered(r, body)).status == 200
        refused = await answered(r, body)
        wall = r.clock.wall(trio.current_time())
        now = dt.datetime.fromtimestamp(wall, tz=dt.UTC)
        first = (now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
                 + dt.timedelta(days=32)).replace(day=1)
        assert refused.status == 429, refused.body
        assert int(refused.headers["retry-after"]) == math.ceil(first.timestamp() - wall)
        assert "usd_per_month" in refused.json()["error"]["relay"]["action"]


async def test_a_clients_rpm_makes_its_requests_wait_with_notices_naming_it(
        tmp_path: Path, autojump_clock: Any) -> None:
    config = config_from(agent("rpm = 2"), tmp_path, environ=ENV)
    async with open_relay(config, discover=False) as r:
        t0 = trio.current_time()
        async with trio.open_nursery() as nursery:
            results = [send(nursery, r, chat("fake/echo", stream=True),
                            headers={"x-relay-progress": "events"}) for _ in range(3)]
            other = send(nursery, r, chat("fake/echo"), OTHER)
        starts = sorted((res.pieces[-1][0] - t0) for res in results)
        assert starts[:2] == [0.0, 0.0] and 60.0 <= starts[2] < 61.0, starts
        assert other.pieces[-1][0] == t0   # another client never waits for this one
        waited = [res.text() for res in results if "relay.waiting" in res.text()]
        assert len(waited) == 1 and "client 'agent''s rpm limit of 2" in waited[0], waited
    queued = [rec["queue_ms"] for rec in records(tmp_path) if rec["client"] == "agent"]
    assert sorted(q or 0 for q in queued)[-1] >= 60_000


async def test_a_clients_lanes_hold_across_providers_and_queue_timeout_applies(
        tmp_path: Path, autojump_clock: Any) -> None:
    config = config_from(agent("lanes = 1").replace(
        "queue_timeout_s = 100", "queue_timeout_s = 15"), tmp_path, environ=ENV)
    async with open_relay(config, discover=False) as r:
        t0 = trio.current_time()
        async with trio.open_nursery() as nursery:
            first = send(nursery, r, chat("two/echo?delay_s=10"))
            await trio.sleep(1)
            second = send(nursery, r, chat("fake/echo?delay_s=10"))
            await trio.sleep(1)
            third = send(nursery, r, chat("fake/echo"))
        assert first.status == second.status == 200
        assert second.pieces[-1][0] - t0 == 20.0  # after the first, on another provider
        assert third.status == 429, third.body    # waited 15 s: its queue timeout
        error = third.json()["error"]
        assert error["code"] == "provider_queue_timeout"
        assert "client 'agent''s lanes limit" in error["message"], error
