"""Routes: fallbacks, one time budget, retries, and streams that break (SPEC F1-F8).

The first half runs the assembled relay's ASGI app on virtual time with the fake
provider, so budgets are exact; the second goes through real sockets to a fake upstream
that misbehaves on cue, counting what each target saw.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
import trio.testing
from fakes.upstream import FakeUpstream, Script, error_body
from helpers.assembled import (
    ASGIResult,
    asgi_request,
    chat,
    config_from,
    lane_idle,
    records,
    sse_events,
    wait_for,
)

import relay
from relay import ConfigError, Relay, open_relay

FAKE = """
[server]
records = "records.jsonl"
[providers.fake]
adapter = "fake"
models = ["echo"]
[providers.fake.profile]
lanes = 4
queue_max = 8
queue_timeout_s = 100
run_timeout_s = 500
[providers.other]
adapter = "fake"
models = ["echo"]
"""


def route(name: str, primary: str, fallbacks: list[str], **keys: Any) -> str:
    lines = [f"[routes.{name}]", f'primary = "{primary}"',
             "fallbacks = [" + ", ".join(f'"{f}"' for f in fallbacks) + "]"]
    lines += [f"{k} = {v}" for k, v in keys.items()]
    return "\n".join(lines) + "\n"


@pytest.fixture
def make(tmp_path: Path) -> Any:
    def build(extra: str) -> Any:
        return open_relay(config_from(FAKE + extra, tmp_path), discover=False)
    return build


async def call(r: Relay, body: dict[str, Any]) -> ASGIResult:
    result = ASGIResult()
    await asgi_request(r.app, "/v1/chat/completions", body, result)
    return result


def started(r: Relay, name: str) -> int:
    adapter: Any = r.providers[name].adapter
    return int(adapter.started)


# --- config ----------------------------------------------------------------------------

def test_a_target_listed_twice_is_a_startup_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        config_from(FAKE + route("r", "fake/echo", ["other/echo", "fake/echo"]), tmp_path)
    assert any("listed twice" in p and "[routes.r]" in p for p in info.value.problems)


def test_budget_defaults_to_the_sum_of_attempt_timeouts(tmp_path: Path) -> None:
    cfg = config_from(FAKE + route("r", "fake/echo", ["other/echo"], primary_timeout_s=20,
                                   fallback_timeout_s=30), tmp_path)
    assert cfg.routes["r"].total_budget_s() == 50
    cfg = config_from(FAKE + route("r", "fake/echo", ["other/echo"]), tmp_path)
    assert cfg.routes["r"].total_budget_s() is None   # no invented default (F4)


def test_unknown_targets_are_startup_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        config_from(FAKE + route("r", "nope/x", ["fake/zzz"]), tmp_path)
    text = "\n".join(info.value.problems)
    assert "[routes.r] primary" in text and "[routes.r] fallbacks[0]" in text


# --- budgets on virtual time ---------------------------------------------------------------

async def test_a_fast_failure_leaves_the_fallback_its_full_own_timeout(
        make: Any, autojump_clock: trio.abc.Clock) -> None:
    extra = route("r", "fake/echo?fail=upstream_error", ["other/echo?delay_s=29&reply=fb"],
                  primary_timeout_s=10, fallback_timeout_s=30)
    async with make(extra) as r:
        t0 = trio.current_time()
        res = await call(r, chat("r"))
        assert res.status == 200, res.text()
        assert res.json()["choices"][0]["message"]["content"] == "fb"
        assert res.json()["model"] == "other/echo?delay_s=29&reply=fb"
        assert trio.current_time() - t0 == pytest.approx(29)
        rec = r.records.recent[-1]
        assert rec["fallback_triggered"] is True
        assert [(a["role"], a["ok"], a["failure"]) for a in rec["attempts"]] == [
            ("primary", False, "upstream_error"), ("fallback", True, None)]


async def test_a_slow_primary_leaves_the_fallback_what_is_left(
        make: Any, autojump_clock: trio.abc.Clock) -> None:
    extra = route("r", "fake/echo?delay_s=1000", ["other/echo?delay_s=40"],
                  primary_timeout_s=60, fallback_timeout_s=60, budget_s=90)
    async with make(extra) as r:
        t0 = trio.current_time()
        res = await call(r, chat("r"))
        assert trio.current_time() - t0 == pytest.approx(90)
        assert res.status == 504
        err = res.json()["error"]
        assert err["code"] == "budget_exhausted"
        assert "attempt_timeout" in err["message"]   # the attempts are listed
        attempts = r.records.recent[-1]["attempts"]
        assert [a["failure"] for a in attempts] == ["attempt_timeout", "budget_exhausted"]


async def test_no_budget_left_means_no_fallback(make: Any,
                                                autojump_clock: trio.abc.Clock) -> None:
    extra = route("r", "fake/echo?delay_s=1000", ["other/echo"], primary_timeout_s=60,
                  fallback_timeout_s=60, budget_s=60)
    async with make(extra) as r:
        res = await call(r, chat("r"))
        assert res.status == 504 and res.json()["error"]["code"] == "budget_exhausted"
        assert started(r, "other") == 0


async def test_a_late_primary_answer_is_discarded_and_its_cleanup_runs_beside(
        make: Any, autojump_clock: trio.abc.Clock) -> None:
    # The primary ignores its stop for 20 s (like a CLI tool): it keeps its lane that long,
    # while the fallback answers; the request ends when both have.
    extra = route("r", "fake/echo?delay_s=1000&ignore_stop_s=20&reply=late",
                  ["other/echo?delay_s=5&reply=fb"], primary_timeout_s=10,
                  fallback_timeout_s=10)
    async with make(extra) as r:
        t0 = trio.current_time()
        res = ASGIResult()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(asgi_request, r.app, "/v1/chat/completions", chat("r"), res)
            await res.complete.wait()
            assert trio.current_time() - t0 == pytest.approx(15)
            assert res.json()["choices"][0]["message"]["content"] == "fb"
            assert r.providers["fake"].lane.statistics().running == 1  # still cleaning up
        assert trio.current_time() - t0 == pytest.approx(30)
        rec = r.records.recent[-1]
        primary, fallback = rec["attempts"]
        assert primary["failure"] == "attempt_timeout" and fallback["ok"] is True
        assert rec["released_at"] == primary["released_at"] > fallback["released_at"]


async def test_never_fall_back_on_rejected_or_auth(make: Any,
                                                   autojump_clock: trio.abc.Clock) -> None:
    extra = (route("a", "fake/echo?fail=rejected", ["other/echo"])
             + route("b", "fake/echo?fail=auth_required", ["other/echo"]))
    async with make(extra) as r:
        assert (await call(r, chat("a"))).json()["error"]["code"] == "rejected"
        assert (await call(r, chat("b"))).json()["error"]["code"] == "auth_required"
        assert started(r, "other") == 0


async def test_a_body_names_its_own_fallbacks(make: Any,
                                              autojump_clock: trio.abc.Clock) -> None:
    async with make("") as r:
        res = await call(r, chat("fake/echo?fail=rate_limited",
                                 fallbacks=["other/echo?reply=mine"]))
        assert res.json()["choices"][0]["message"]["content"] == "mine"
        # An empty list turns a route's fallbacks off.
        res = await call(r, chat("fake/echo?fail=rate_limited", fallbacks=[]))
        assert res.status == 429
        res = await call(r, chat("fake/echo", fallbacks=["nope/x"]))
        assert res.status == 404 and res.json()["error"]["param"] == "fallbacks"


async def test_retries_honour_retry_after_within_the_budget(
        make: Any, autojump_clock: trio.abc.Clock) -> None:
    # The fake fails with retry_after_s = 2: one retry after 2 s, then the fallback.
    extra = route("r", "fake/echo?fail=rate_limited", ["other/echo?reply=fb"], retries=1)
    async with make(extra) as r:
        t0 = trio.current_time()
        res = await call(r, chat("r"))
        assert res.json()["choices"][0]["message"]["content"] == "fb"
        assert trio.current_time() - t0 == pytest.approx(2)
        assert started(r, "fake") == 2 and started(r, "other") == 1


async def test_a_retry_that_does_not_fit_the_budget_moves_on_at_once(
        make: Any, autojump_clock: trio.abc.Clock) -> None:
    extra = route("r", "fake/echo?fail=rate_limited", ["other/echo?reply=fb"], retries=3,
                  budget_s=1)
    async with make(extra) as r:
        t0 = trio.current_time()
        res = await call(r, chat("r"))
        assert res.json()["choices"][0]["message"]["content"] == "fb"
        assert trio.current_time() == t0 and started(r, "fake") == 1


async def test_a_timed_out_attempt_is_never_retried(make: Any,
                                                    autojump_clock: trio.abc.Clock) -> None:
    extra = route("r", "fake/echo?delay_s=100", ["other/echo?reply=fb"], retries=2,
                  primary_timeout_s=5, fallback_timeout_s=5)
    async with make(extra) as r:
        res = await call(r, chat("r"))
        assert res.json()["choices"][0]["message"]["content"] == "fb"
        assert started(r, "fake") == 1


async def test_a_cut_stream_continues_on_a_prefill_fallback(
        make: Any, autojump_clock: trio.abc.Clock) -> None:
    extra = route("r", "fake/echo?reply=one two three four&cut_after=2",
                  ["other/echo?reply=one two three four"])
    async with make(extra) as r:
        res = await call(r, chat("r", stream=True))
        events = sse_events(res.text())
        assert events[-1] == "[DONE]"
        text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1])
        assert text == "one two three four"     # one complete answer, nothing repeated
        finishes = [e for e in events[:-1] if e["choices"][0]["finish_reason"]]
        assert len(finishes) == 1


@pytest.mark.parametrize("stream", [True, False])
async def test_a_continued_answers_usage_is_the_sum_of_its_attempts(
        make: Any, autojump_clock: trio.abc.Clock, stream: bool) -> None:
    """SPEC L12a: the cut attempt's part counts too (it reported no usage: relay's
    estimate, marked so), not only the continuation's own usage."""
    extra = route("r", "fake/echo?reply=one two three four&cut_after=2",
                  ["other/echo?reply=one two three four"])
    body = chat("r", stream=stream, **({"stream_options": {"include_usage": True}}
                                       if stream else {}))
    async with make(extra) as r:
        res = await call(r, body)
        if stream:
            (usage,) = [e["usage"] for e in sse_events(res.text())[:-1] if e.get("usage")]
        else:
            usage = res.json()["usage"]
        record = r.records.recent[-1]
    assert record["usage"] == usage
    if stream:
        # "one two" came from the cut attempt (no usage: 7 characters, 2 tokens by
        # relay's estimate), " three four" from the continuation (2 reported): 4 in all,
        # where the continuation's own 2 were reported before.
        assert usage["completion_tokens"] == 4 and usage["estimated"] is True, usage
        assert usage["total_tokens"] == usage["prompt_tokens"] + 4
    else:
        # Nothing was sent when the first attempt broke: the fallback answered anew, and
        # its usage is the answer's.
        assert usage == {"prompt_tokens": 1, "completion_tokens": 4, "total_tokens": 5}


async def test_a_cut_stream_without_a_prefill_fallback_ends_in_band(
        make: Any, autojump_clock: trio.abc.Clock, tmp_path: Path) -> None:
    text = FAKE.replace('[providers.other]\nadapter = "fake"',
                        '[providers.other]\nadapter = "fake"\nprefill = false')
    extra = route("r", "fake/echo?reply=one two three&cut_after=2", ["other/echo"])
    async with open_relay(config_from(text + extra, tmp_path), discover=False) as r:
        res = await call(r, chat("r", stream=True))
        events = sse_events(res.text())
        assert events[-1]["error"]["code"] == "stream_cut"
        assert "[DONE]" not in events
        assert started(r, "other") == 0


async def test_first_token_and_stall_limits(make: Any,
                                            autojump_clock: trio.abc.Clock) -> None:
    extra = (route("ft", "fake/echo?delay_s=100", ["other/echo?reply=fb"],
                   first_token_timeout_s=3)
             + route("st", "fake/echo?chunks=5&chunk_delay_s=50", ["other/echo"],
                     stall_timeout_s=10))
    async with make(extra) as r:
        t0 = trio.current_time()
        res = await call(r, chat("ft", stream=True))
        assert trio.current_time() - t0 == pytest.approx(3)
        assert "fb" in res.text()
        assert r.records.recent[-1]["attempts"][0]["failure"] == "first_token_timeout"
        t0 = trio.current_time()
        res = await call(r, chat("st", stream=True))
        # The first chunk reached the client; the fallback can continue from it.
        assert trio.current_time() - t0 == pytest.approx(10)
        assert r.records.recent[-1]["attempts"][0]["failure"] == "stall_timeout"


async def test_a_client_stop_ends_every_attempt(make: Any,
                                                autojump_clock: trio.abc.Clock) -> None:
    extra = route("r", "fake/echo?delay_s=1000", ["other/echo?delay_s=1000"],
                  primary_timeout_s=5)
    async with make(extra) as r:
        res = ASGIResult()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(asgi_request, r.app, "/v1/chat/completions",
                               chat("r", stream=True), res)
            await trio.sleep(6)   # the fallback is running
            assert r.providers["other"].lane.statistics().running == 1
            res.disconnect.set()
        assert r.providers["fake"].lane.statistics().running == 0
        assert r.providers["other"].lane.statistics().running == 0


# --- through real sockets, with a fake upstream that misbehaves on cue --------------------

UPSTREAM = """
[server]
records = "records.jsonl"
[providers.a]
adapter = "openai"
base_url = "{url}"
[providers.a.profile]
lanes = 2
queue_max = 8
queue_timeout_s = 10
run_timeout_s = 20
[providers.b]
adapter = "openai"
base_url = "{url}"
prefill = {prefill}
[providers.b.profile]
lanes = 2
queue_max = 8
queue_timeout_s = 10
run_timeout_s = 20
[routes.r]
primary = "a/p"
fallbacks = ["b/f"]
primary_timeout_s = {pt}
fallback_timeout_s = 2
retries = {retries}
first_token_timeout_s = 1
stall_timeout_s = 1
"""


@pytest.fixture
async def served(nursery: trio.Nursery, tmp_path: Path, upstream: FakeUpstream,
                 request: pytest.FixtureRequest) -> AsyncIterator[relay.Served]:
    keys = {"prefill": "false", "pt": 2, "retries": 0, **getattr(request, "param", {})}
    config = config_from(UPSTREAM.format(url=upstream.url, **keys), tmp_path)
    yield await nursery.start(functools.partial(relay.serve, config, port=0))


def seen(up: FakeUpstream, model: str) -> list[float]:
    return [r.received_at for r in up.requests if (r.json or {}).get("model") == model]


async def post(client: httpx.AsyncClient, served: relay.Served, **body: Any) -> httpx.Response:
    return await client.post(f"{served.url}/v1/chat/completions",
                             json=chat("r", **body))


def answer(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["message"]["content"])


@pytest.mark.parametrize("served", [{"retries": 1}], indirect=True)
async def test_429_with_retry_after_is_retried_after_it(
        served: relay.Served, upstream: FakeUpstream, client: httpx.AsyncClient) -> None:
    upstream.sequences["p"] = [Script(status=429, headers={"retry-after": "1"},
                                      error_body=error_body(429, "slow down")), Script()]
    t0 = trio.current_time()
    assert answer(await post(client, served)) == "Hello world"
    times = seen(upstream, "p")
    assert len(times) == 2 and times[1] - times[0] >= 0.95
    assert seen(upstream, "f") == []
    assert trio.current_time() - t0 < 3


async def test_429_without_retry_after_falls_back(
        served: relay.Served, upstream: FakeUpstream, client: httpx.AsyncClient,
        tmp_path: Path) -> None:
    upstream.scripts["p"] = Script(status=429, error_body=error_body(429, "busy"))
    upstream.scripts["f"] = Script(chunks=["from b"])
    r = await post(client, served)
    assert answer(r) == "from b" and r.json()["model"] == "b/f"
    assert len(seen(upstream, "p")) == 1 and len(seen(upstream, "f")) == 1
    await wait_for(lambda: len(records(tmp_path)) == 1)
    rec = records(tmp_path)[0]
    assert rec["fallback_triggered"] and rec["route"] == "r"
    assert [a["failure"] for a in rec["attempts"]] == ["rate_limited", None]


@pytest.mark.parametrize("served", [{"retries": 1}], indirect=True)
async def test_500_once_is_retried_503_always_falls_back(
        served: relay.Served, upstream: FakeUpstream, client: httpx.AsyncClient) -> None:
    upstream.sequences["p"] = [Script(status=500), Script()]
    assert answer(await post(client, served)) == "Hello world"
    assert len(seen(upstream, "p")) == 2
    upstream.sequences.clear()
    upstream.scripts["p"] = Script(status=503)
    upstream.scripts["f"] = Script(chunks=["b"])
    assert answer(await post(client, served)) == "b"
    assert len(seen(upstream, "p")) == 4   # 2 more: the try and its one retry


async def test_a_reset_before_headers_and_no_answer_at_all_fall_back(
        served: relay.Served, upstream: FakeUpstream, client: httpx.AsyncClient) -> None:
    upstream.scripts["f"] = Script(chunks=["b"])
    upstream.scripts["p"] = Script(cut_after=0)      # closes without answering
    assert answer(await post(client, served)) == "b"
    upstream.scripts["p"] = Script(hang=True)        # never answers
    t0 = trio.current_time()
    assert answer(await post(client, served)) == "b"
    assert 1.9 < trio.current_time() - t0 < 4        # the primary's 2 s attempt timeout


async def test_a_slow_first_token_and_a_stall_fall_back(
        served: relay.Served, upstream: FakeUpstream, client: httpx.AsyncClient,
        tmp_path: Path) -> None:
    upstream.scripts["f"] = Script(chunks=["b"])
    upstream.scripts["p"] = Script(first_byte_delay_s=10)
    t0 = trio.current_time()
    r = await post(client, served, stream=True)
    assert 0.9 < trio.current_time() - t0 < 2.5
    assert sse_events(r.text)[-1] == "[DONE]"
    upstream.scripts["p"] = Script(chunks=["a", "b", "c"], stall_after=1)
    r = await post(client, served, stream=True)
    # Part of the answer reached the client and b cannot continue it: a clean in-band
    # error, never a complete answer.
    events = sse_events(r.text)
    assert events[-1]["error"]["code"] == "stall_timeout"
    await wait_for(lambda: len(records(tmp_path)) == 2)
    assert records(tmp_path)[0]["attempts"][0]["failure"] == "first_token_timeout"


@pytest.mark.parametrize("served", [{"prefill": "true"}], indirect=True)
async def test_a_cut_stream_continues_from_a_prefill(
        served: relay.Served, upstream: FakeUpstream, client: httpx.AsyncClient) -> None:
    upstream.scripts["p"] = Script(chunks=["Hello", " wor", "ld"], cut_after=2)
    upstream.scripts["f"] = Script(chunks=["ld", "!"])
    r = await post(client, served, stream=True)
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1]
                   if e["choices"])
    assert text == "Hello world!"
    continued = next(q for q in upstream.requests if (q.json or {}).get("model") == "f")
    assert continued.json["messages"][-1] == {"role": "assistant", "content": "Hello wor"}


@pytest.mark.parametrize("served", [{"prefill": "true"}], indirect=True)
async def test_a_fallback_that_rejects_the_prefill_shows_the_original_failure(
        served: relay.Served, upstream: FakeUpstream, client: httpx.AsyncClient) -> None:
    upstream.scripts["p"] = Script(chunks=["Hello", " wor", "ld"], cut_after=2)
    upstream.scripts["f"] = Script(status=400, error_body=error_body(
        400, "assistant prefill is not supported"))
    events = sse_events((await post(client, served, stream=True)).text)
    assert events[-1]["error"]["code"] == "stream_cut"


async def test_malformed_events_and_a_missing_done_are_not_failures(
        served: relay.Served, upstream: FakeUpstream, client: httpx.AsyncClient) -> None:
    upstream.scripts["p"] = Script(chunks=["x", "y"], malformed_at=1, omit_done=True)
    events = sse_events((await post(client, served, stream=True)).text)
    assert events[-1] == "[DONE]" and seen(upstream, "f") == []


async def test_context_too_long_falls_back_a_content_refusal_does_not(
        served: relay.Served, upstream: FakeUpstream, client: httpx.AsyncClient) -> None:
    upstream.scripts["f"] = Script(chunks=["big"])
    upstream.scripts["p"] = Script(status=400, error_body=error_body(
        400, "This model's maximum context length is 8192 tokens",
        code="context_length_exceeded"))
    assert answer(await post(client, served)) == "big"
    words = "Your request was rejected as a result of our safety system."
    upstream.scripts["p"] = Script(status=400, error_body=error_body(
        400, words, code="content_policy_violation"))
    r = await post(client, served)
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "rejected"
    assert r.json()["error"]["relay"]["upstream_message"] == words
    assert len(seen(upstream, "f")) == 1


async def test_a_primary_that_is_down_and_recovers(
        served: relay.Served, upstream: FakeUpstream, client: httpx.AsyncClient) -> None:
    upstream.scripts["p"] = Script(status=503)
    upstream.scripts["f"] = Script(chunks=["b"])
    for _ in range(5):
        assert answer(await post(client, served)) == "b"
    upstream.scripts["p"] = Script(chunks=["a"])   # back
    for _ in range(3):
        assert answer(await post(client, served)) == "a"
    assert len(seen(upstream, "p")) == 8 and len(seen(upstream, "f")) == 5
    await wait_for(lambda: lane_idle(served))
