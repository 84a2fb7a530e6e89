"""What a provider says of its limits, read (SPEC L12): the rate-limit headers of both
families, a 429's "when" in each form it comes, and a CLI tool's usage-window notice."""

from __future__ import annotations

import datetime
import json
import time

import pytest

from relay.adapters.http.failures import upstream_failure
from relay.adapters.limits import (
    body_limits,
    body_retry_s,
    go_duration_s,
    read_limits,
    reset_time_s,
    usage_reset_s,
)
from relay.vocab.limits import Window


@pytest.mark.parametrize(("text", "seconds"), [
    ("6m0s", 360.0), ("1.2s", 1.2), ("250ms", 0.25), ("1h2m3.5s", 3723.5), ("20", 20.0),
    ("", None), ("soon", None), ("5x", None),
])
def test_openai_resets_are_go_durations(text: str, seconds: float | None) -> None:
    assert go_duration_s(text) == seconds


def test_both_header_families_are_read_into_one_value() -> None:
    now = time.time()
    later = datetime.datetime.fromtimestamp(now + 30, datetime.UTC).isoformat()
    limits = read_limits({
        "x-ratelimit-limit-requests": "100", "x-ratelimit-remaining-requests": "99",
        "x-ratelimit-reset-requests": "600ms",
        "x-ratelimit-limit-tokens": "40000", "x-ratelimit-remaining-tokens": "38000",
        "x-ratelimit-reset-tokens": "3s",
        "anthropic-ratelimit-input-tokens-limit": "40000",
        "anthropic-ratelimit-input-tokens-remaining": "1000",
        "anthropic-ratelimit-input-tokens-reset": later,
        "anthropic-ratelimit-output-tokens-limit": "16000",
        "anthropic-ratelimit-output-tokens-remaining": "16000",
    })
    assert limits is not None
    assert limits.windows["requests"] == Window(100, 99, 0.6)
    assert limits.windows["tokens"] == Window(40000, 38000, 3.0)
    window = limits.windows["input"]
    assert (window.limit, window.remaining) == (40000, 1000)
    assert window.reset_s is not None and 28 <= window.reset_s <= 30
    assert limits.windows["output"] == Window(16000, 16000, None)
    assert read_limits({"content-type": "application/json"}) is None


def test_anthropic_resets_are_rfc_3339_times() -> None:
    assert reset_time_s("2026-01-01T00:00:30Z", now=datetime.datetime(
        2026, 1, 1, tzinfo=datetime.UTC).timestamp()) == 30.0
    assert reset_time_s("not a time") is None


def test_a_429_that_says_when_holds_in_each_form() -> None:
    def hold(headers: dict[str, str], body: dict[str, object]) -> tuple[float | None, str]:
        error = upstream_failure("p", 429, json.dumps(body), headers)
        assert error.reason == "rate_limited"
        limits = error.limits
        return (limits.hold_s, limits.cause) if limits is not None else (None, "")

    openai = {"error": {"message": "Rate limit reached for gpt-x in organization org-1 on "
                                   "tokens per min (TPM): Limit 40000, Used 39000, "
                                   "Requested 6000. Please try again in 7.5s. Visit …",
                        "type": "tokens", "code": "rate_limit_exceeded"}}
    assert hold({"retry-after-ms": "2500"}, openai) == (2.5, "retry-after-ms: 2500")
    assert hold({"retry-after": "12"}, openai) == (12.0, "retry-after: 12")
    assert hold({}, openai) == (7.5, "the 429's body: try again in 7.5 s")
    google = {"error": {"code": 429, "status": "RESOURCE_EXHAUSTED", "message": "slow down",
                        "details": [{"@type": "type.googleapis.com/google.rpc.RetryInfo",
                                     "retryDelay": "43s"}]}}
    assert hold({}, google) == (43.0, "RetryInfo retryDelay 43 s")
    used_up = {"x-ratelimit-limit-tokens": "40000", "x-ratelimit-remaining-tokens": "0",
               "x-ratelimit-reset-tokens": "9s"}
    assert hold(used_up, {"error": {"message": "slow down"}})[0] == 9.0
    assert hold({}, {"error": {"message": "slow down"}}) == (None, "")  # said nothing


def test_a_429_body_names_the_budget_it_met() -> None:
    assert body_limits("… on input tokens per min (ITPM): Limit 40,000, Used 39,500, "
                       "Requested 900.") == {"input": Window(40000, 500)}
    assert body_limits("This request would exceed the rate limit for your organization "
                       "of 16,000 output tokens per minute.") == {"output": Window(16000)}
    assert body_limits("Too many requests") == {}
    assert body_retry_s("Please try again in 1m30s.") == 90.0


def test_a_usage_window_notice_says_when_it_resets() -> None:
    now = 1_753_400_000.0
    assert usage_reset_s("Claude AI usage limit reached|1753441200", now) == 41_200.0
    # 3:30am in Kolkata (UTC+5:30) is 22:00 UTC: from 20:00 UTC, two hours.
    at_20_utc = datetime.datetime(2026, 3, 1, 20, 0, tzinfo=datetime.UTC).timestamp()
    assert usage_reset_s("You've hit your limit · resets 3:30am (Asia/Calcutta)",
                         at_20_utc) == 7200.0
    assert usage_reset_s("You've reached your usage limit. Try again after your limit "
                         "resets.", now) is None
