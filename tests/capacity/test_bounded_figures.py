"""A provider's figures are bounded (SPEC L12a), through the assembled relay.

A provider gone wrong — ``retry-after: inf``, ``1e400``, ``-1``, a limit of ``-5``, a
remaining of ``-1000000000``, a reset of ``inf`` — once made that request a 500, every
later request to the provider a 500, and ``GET /relay/v1/status`` a 500 for the whole
relay until a restart; a negative limit refused every later request as too large, and
``retry-after: 999999999`` became every client's Retry-After. Now an unusable figure is
ignored (and logged once per provider, naming the header and the value), a 429's hold
lasts at most ``max_hold_s``, and a request that times out waiting for a token budget
says which budget, what it needs and what is free, with the refill time as Retry-After.
"""

from __future__ import annotations

import functools
import logging
import math
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
import trio.testing
from fakes.fake_metered import Limits, Metered, prose, serve_metered
from fakes.upstream import FakeUpstream, Script
from helpers.assembled import ASGIResult, asgi_request, chat, config_from, start_relay

from relay import open_relay
from relay.adapters.http.failures import parse_retry_after
from relay.adapters.limits import read_limits

CHAT = "/v1/chat/completions"


def config(up: FakeUpstream, profile: str = "") -> str:
    return f"""
[server]
records = "records.jsonl"
[providers.up]
adapter = "openai"
base_url = "{up.url}"
models = ["m1"]
[providers.up.profile]
lanes = 2
queue_max = 8
queue_timeout_s = 10
run_timeout_s = 20
{profile}
"""


def unusable(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if "relay cannot use" in r.getMessage()]


async def status(client: httpx.AsyncClient, url: str) -> dict[str, Any]:
    """The status (and the metrics beside it), each answered and finite."""
    metrics = await client.get(f"{url}/metrics")
    assert metrics.status_code == 200, metrics.text
    values = [line.rsplit(" ", 1)[-1].lower() for line in metrics.text.splitlines()
              if line and not line.startswith("#")]
    assert not {"inf", "+inf", "-inf", "nan"} & set(values), metrics.text
    r = await client.get(f"{url}/relay/v1/status")
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


def finite(obj: Any) -> bool:
    """No float in ``obj`` is inf or NaN (JSON has no word for them)."""
    if isinstance(obj, float):
        return math.isfinite(obj)
    if isinstance(obj, dict):
        return all(finite(v) for v in obj.values())
    if isinstance(obj, list):
        return all(finite(v) for v in obj)
    return True


# --- the parsers, figure by figure ---------------------------------------------------------

@pytest.mark.parametrize("headers", [
    {"retry-after": "inf"}, {"retry-after": "1e400"}, {"retry-after": "-1"},
    {"retry-after": "NaN"}, {"retry-after-ms": "1e400"}, {"retry-after": "soon"},
])
def test_an_unusable_retry_after_is_ignored_and_named(headers: dict[str, str]) -> None:
    ignored: list[str] = []
    assert parse_retry_after(headers, ignored) is None
    ((name, value),) = headers.items()
    assert ignored == [f"{name}: {value}"]


def test_a_usable_retry_after_ms_wins_and_a_bad_one_falls_back() -> None:
    ignored: list[str] = []
    assert parse_retry_after({"retry-after-ms": "inf", "retry-after": "3"}, ignored) == 3.0
    assert ignored == ["retry-after-ms: inf"]


def test_unusable_rate_limit_headers_are_ignored_the_rest_kept() -> None:
    limits = read_limits({"x-ratelimit-limit-tokens": "-5",
                          "x-ratelimit-remaining-tokens": "-1000000000",
                          "x-ratelimit-reset-tokens": "inf",
                          "x-ratelimit-limit-requests": "100",
                          "x-ratelimit-remaining-requests": "nan"})
    assert limits is not None
    assert limits.windows["tokens"].limit is None
    assert limits.windows["tokens"].remaining is None
    assert limits.windows["tokens"].reset_s is None
    assert limits.windows["requests"].limit == 100
    assert limits.windows["requests"].remaining is None
    assert sorted(limits.ignored) == [
        "x-ratelimit-limit-tokens: -5", "x-ratelimit-remaining-requests: nan",
        "x-ratelimit-remaining-tokens: -1000000000", "x-ratelimit-reset-tokens: inf"]


# --- through the assembled relay ------------------------------------------------------------

@pytest.mark.parametrize("header", [("retry-after", "inf"), ("retry-after", "1e400"),
                                    ("retry-after-ms", "1e400"), ("retry-after", "-1")])
async def test_a_429_with_an_unusable_retry_after_harms_nothing(
        nursery: trio.Nursery, tmp_path: Path, upstream: FakeUpstream,
        client: httpx.AsyncClient, caplog: pytest.LogCaptureFixture,
        header: tuple[str, str]) -> None:
    caplog.set_level(logging.WARNING, logger="relay")
    name, value = header
    upstream.scripts["m1"] = Script(status=429, headers={name: value})
    served = await start_relay(nursery, config(upstream), tmp_path)
    for _ in range(2):
        r = await client.post(served.url + CHAT, json=chat("up/m1"))
        assert r.status_code == 429, r.text
        assert r.json()["error"]["code"] == "rate_limited"
        assert 1 <= int(r.headers["retry-after"]) <= 60  # relay's own, not the figure
        assert finite(r.json())
    # Said once, naming the header and its value; the status still answers.
    assert unusable(caplog) == [
        f"provider up sent a figure relay cannot use, ignored: {name}: {value} (not a "
        "finite, non-negative number; said once per header)"]
    body = await status(client, served.url)
    assert finite(body)
    # The provider recovers: so does every later request.
    upstream.scripts["m1"] = Script()
    r = await client.post(served.url + CHAT, json=chat("up/m1"))
    assert r.status_code == 200, r.text


async def test_a_hold_lasts_at_most_max_hold_s(
        nursery: trio.Nursery, tmp_path: Path, upstream: FakeUpstream,
        client: httpx.AsyncClient) -> None:
    upstream.scripts["m1"] = Script(status=429, headers={"retry-after": "999999999"})
    served = await start_relay(nursery, config(upstream, "max_hold_s = 30"), tmp_path)
    r = await client.post(served.url + CHAT, json=chat("up/m1"))
    assert r.status_code == 429
    assert r.headers["retry-after"] == "30"
    assert r.json()["error"]["relay"]["retry_after_s"] == 30
    hold = (await status(client, served.url))["providers"]["up"]["budgets"]["hold"]
    assert 0 < hold["left_s"] <= 30
    assert hold["cause"] == "retry-after: 999999999; held 30 s (max_hold_s, 30 s)"
    # The next request is refused at once (the hold outlasts its queue timeout), with
    # the capped hold's Retry-After, and nothing is sent.
    sent = len(upstream.requests)
    r = await client.post(served.url + CHAT, json=chat("up/m1"))
    assert r.status_code == 429
    assert 1 <= int(r.headers["retry-after"]) <= 30
    assert len(upstream.requests) == sent


async def test_a_day_long_retry_after_is_held_the_default_900_s(
        nursery: trio.Nursery, tmp_path: Path, upstream: FakeUpstream,
        client: httpx.AsyncClient) -> None:
    upstream.scripts["m1"] = Script(status=429, headers={"retry-after": "86400"})
    served = await start_relay(nursery, config(upstream), tmp_path)
    r = await client.post(served.url + CHAT, json=chat("up/m1"))
    assert r.headers["retry-after"] == "900"


async def test_hostile_rate_limit_headers_on_answers_are_ignored(
        nursery: trio.Nursery, tmp_path: Path, upstream: FakeUpstream,
        client: httpx.AsyncClient, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="relay")
    upstream.scripts["m1"] = Script(headers={
        "x-ratelimit-limit-tokens": "-5", "x-ratelimit-remaining-tokens": "-1000000000",
        "x-ratelimit-reset-tokens": "inf", "x-ratelimit-limit-requests": "1e400",
        "x-ratelimit-remaining-requests": "nan"})
    served = await start_relay(nursery, config(upstream), tmp_path)
    for stream in (False, True, False):
        r = await client.post(served.url + CHAT, json=chat("up/m1", stream=stream))
        assert r.status_code == 200, r.text  # never request_too_large, never in debt
    body = await status(client, served.url)
    assert finite(body)
    budgets = body["providers"]["up"]["budgets"]
    assert budgets is None or "tokens" not in budgets.get("budgets", {}), budgets
    logged = unusable(caplog)
    assert len(logged) == 5, logged  # each header once, however often it came
    assert any("x-ratelimit-limit-tokens: -5" in line for line in logged)


# --- a request that times out waiting for a token budget ------------------------------------

@pytest.fixture
def clock() -> trio.testing.MockClock:
    return trio.testing.MockClock(autojump_threshold=0.02)


async def test_a_budget_timeout_says_which_budget_and_waits_the_refill(
        tmp_path: Path, clock: trio.testing.MockClock) -> None:
    async with trio.open_nursery() as nursery:
        fake: Metered = await nursery.start(functools.partial(
            serve_metered, Limits(rpm=600, itpm=60_000, otpm=60_000), send_headers=False))
        text = f"""
[server]
records = "records.jsonl"
[providers.p]
adapter = "openai"
base_url = "{fake.base_url}/v1"
[providers.p.profile]
lanes = 8
queue_max = 100
queue_timeout_s = 5
run_timeout_s = 600
tpm = 1000
"""
        async with open_relay(config_from(text, tmp_path), discover=False) as r:
            first, second = ASGIResult(), ASGIResult()
            big = {"model": "p/m-out5", "max_tokens": 5,
                   "messages": [{"role": "user", "content": prose(700, 1)}]}
            await asgi_request(r.app, CHAT, big, first)
            assert first.status == 200, first.text()
            await asgi_request(r.app, CHAT, big, second)
        nursery.cancel_scope.cancel()
    assert second.status == 429, second.text()
    error = second.json()["error"]
    assert error["code"] == "provider_queue_timeout"
    message = error["message"]
    assert "tokens budget" in message and " free, about " in message, message
    assert "earlier requests" not in message
    # Retry-After: when the budget has refilled enough (1,000 a minute: tens of seconds).
    assert int(second.headers["retry-after"]) > 5, second.headers
