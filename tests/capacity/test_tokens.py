"""Token budgets (SPEC L12), through the assembled relay, against a provider that meters
tokens with continuous buckets (tests/fakes/fake_metered.py), on virtual time.

The clock jumps only after 20 ms of real idleness (not at once, as `autojump_clock`
does): the fake provider is a real server on loopback, and a clock that jumped while a
request was in flight on the socket would make the provider's minute pass in no time.
"""

from __future__ import annotations

import functools
from pathlib import Path

import httpx
import pytest
import trio
import trio.testing
from fakes.fake_metered import Limits, Metered, prompt_tokens, prose, serve_metered
from helpers.assembled import ASGIResult, asgi_request, sse_events, start_relay
from helpers.daemons import run_relay, write
from helpers.metered import ask, config, lane_of, ok, records, relay_for, send
from helpers.webdriver import open_browser

from relay.capacity.budget import Budget, Need, estimate_input
from relay.vocab.events import Call
from relay.vocab.limits import RateLimits, Window
from relay.vocab.profile import Profile


@pytest.fixture
def clock() -> trio.testing.MockClock:
    return trio.testing.MockClock(autojump_threshold=0.02)


@pytest.fixture
async def fake(nursery: trio.Nursery) -> Metered:
    server: Metered = await nursery.start(functools.partial(
        serve_metered, Limits(rpm=60, itpm=3000, otpm=3000)))
    return server


@pytest.fixture(autouse=True)
def _key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_METERED_KEY", "sk-fake-metered")


# --- the estimate -------------------------------------------------------------------------

def test_the_estimate_is_near_the_providers_count_and_not_below_it_for_prose() -> None:
    for tokens, seed in ((50, 1), (600, 2), (6000, 3)):
        text = prose(tokens, seed)
        truth = prompt_tokens([{"role": "user", "content": text}])
        guess = estimate_input(Call(request_id="x", provider="p", model="m",
                                    messages=[{"role": "user", "content": text}],
                                    stream=False))
        assert truth <= guess <= truth * 1.25, (tokens, truth, guess)


# --- configured budgets -------------------------------------------------------------------

async def test_configured_budgets_keep_a_burst_inside_the_limits_with_notices_that_say_why(
        nursery: trio.Nursery, clock: trio.testing.MockClock, fake: Metered,
        tmp_path: Path) -> None:
    # The provider sends no headers: the configured figures are all relay knows.
    fake.configure(Limits(rpm=60, itpm=3000, otpm=3000), send_headers=False)
    text = config(fake.base_url, "rpm = 60\nitpm = 3000\notpm = 3000")
    async with relay_for(tmp_path, text) as r:
        start = trio.current_time()
        results = [send(nursery, r, ask(prose(600, i), max_tokens=100, stream=i % 3 == 0))
                   for i in range(12)]
        for res in results:
            await res.done.wait()
        took = trio.current_time() - start
        assert all(ok(res) for res in results), [res.status for res in results]
        assert fake.rejected == []  # not one 429 upstream
        # A perfect pacer needs (input - one full bucket) / refill: relay's estimate is
        # a little high (it never undercounts prose), so it is a little slower than that.
        ideal = (sum(fake.prompts) - 3000) / 50.0
        assert ideal <= took <= ideal * 1.3 + 5, (took, ideal)
        # A queued stream heard what it waited for.
        notices = [line for res in results for line in res.text().splitlines()
                   if line.startswith(": waiting for the provider's input tokens budget")]
        assert notices, [res.text()[:300] for res in results]
        recs = records(tmp_path)
        # Reserved covers used: relay's first estimates of prose are high; once it has
        # learned the provider's count, within a few tokens of it (the edge margin's 1 %).
        assert all(0 < rec["tokens_used"] <= rec["tokens_reserved"] * 1.01 for rec in recs)
        assert any(rec["token_wait_ms"] > 0 for rec in recs)
        assert not any(rec["tokens_estimated"] for rec in recs)  # usage was reported
        assert lane_of(r).statistics().running == 0


# --- header-learned budgets ---------------------------------------------------------------

def test_a_header_does_not_forget_what_relay_started_after_the_answering_request() -> None:
    # bench/tokens.py's burst met a 429: the first stream's header (the provider had
    # counted only that request) raised relay's configured budget back up while relay
    # was still starting the rest of the burst. The budget itself, on a clock it is
    # given (a pure object: the race is in when a header arrives, not in the wire).
    now = [0.0]
    profile = Profile(lanes=8, queue_max=8, queue_timeout_s=60, run_timeout_s=60, itpm=3000)
    budget = Budget(profile, lambda: now[0])
    first = budget.reserve(Need(600, 0))
    now[0] = 0.001
    second = budget.reserve(Need(600, 0))   # started before the first's header came back
    assert first is not None and second is not None
    said = RateLimits({"input": Window(limit=3000, remaining=2400)})  # only the first
    budget.observe(said, started_at=0.0, ok=True, own=first)
    level = budget.status(lambda t: None)["budgets"]["input"]["remaining"]
    assert level <= 3000 - 1200 + 1       # not 2,400: the second is still taken

    # A header lower than relay's count (another client of the key spent 1,400) sets
    # the budget to it, less what started after the answering request.
    budget = Budget(profile, lambda: now[0])
    now[0] = 0.0
    first = budget.reserve(Need(600, 0))
    now[0] = 0.001
    budget.reserve(Need(600, 0))
    said = RateLimits({"input": Window(limit=3000, remaining=1000)})
    budget.observe(said, started_at=0.0, ok=True, own=first)
    level = budget.status(lambda t: None)["budgets"]["input"]["remaining"]
    assert 1000 - 600 - 1 <= level <= 1000 - 600 + 1


@pytest.mark.parametrize("kind", ["openai", "anthropic"])
async def test_budgets_learned_from_headers_alone_keep_a_burst_inside_the_limits(
        nursery: trio.Nursery, clock: trio.testing.MockClock, fake: Metered,
        tmp_path: Path, kind: str) -> None:
    path = "/v1/chat/completions"
    async with relay_for(tmp_path, config(fake.base_url, kind=kind)) as r:
        for i in range(3):  # three small requests show relay the provider's headers
            res = send(nursery, r, ask(f"hello {i}", max_tokens=100), path)
            await res.done.wait()
            assert ok(res)
        # The headers describe the answering model's window (SPEC L12a): its budgets.
        status = lane_of(r).budget.status(lambda t: None)["models"]["m-out100"]["budgets"]
        assert status["input"]["limit_per_minute"] == 3000
        assert status["input"]["source"] == "header"
        start = trio.current_time()
        results = [send(nursery, r, ask(prose(600, i), max_tokens=100, stream=i % 2 == 0),
                        path) for i in range(10)]
        for res in results:
            await res.done.wait()
        assert all(ok(res) for res in results), [(res.status, res.text()[-300:])
                                                 for res in results if not ok(res)]
        assert fake.rejected == []
        ideal = (sum(fake.prompts) - 3000) / 50.0
        assert trio.current_time() - start <= ideal * 1.3 + 5


async def test_a_configured_figure_lower_than_the_header_wins(
        nursery: trio.Nursery, clock: trio.testing.MockClock, fake: Metered,
        tmp_path: Path) -> None:
    async with relay_for(tmp_path, config(fake.base_url, "itpm = 1500")) as r:
        res = send(nursery, r, ask("hello", max_tokens=10))
        await res.done.wait()
        status = lane_of(r).budget.status(lambda t: None)
        budgets = status["budgets"]  # the provider's (the account's), configured
        assert budgets["input"]["limit_per_minute"] == 1500  # this relay's share
        assert (budgets["input"]["configured"], budgets["input"]["header"]) == (1500, None)
        assert budgets["input"]["source"] == "configured"
        model = status["models"]["m-out100"]["budgets"]  # the model's, from its headers
        assert model["input"]["limit_per_minute"] == 3000
        assert model["output"]["source"] == "header"  # learned: none configured
        # Both apply: a request of 2,000 input tokens could never start (SPEC L12a).
        res = send(nursery, r, ask(prose(2000, 9), max_tokens=10))
        await res.done.wait()
        assert res.status == 400 and "1,500 input tokens" in res.text(), res.text()


# --- holds --------------------------------------------------------------------------------

async def test_one_429_holds_every_queued_request_and_a_queued_stream_waits_it_out(
        nursery: trio.Nursery, clock: trio.testing.MockClock, fake: Metered,
        tmp_path: Path) -> None:
    # No headers, no budgets: relay learns only from the 429's body ("try again in …").
    fake.configure(Limits(rpm=600, itpm=3000, otpm=30000), send_headers=False)
    async with relay_for(tmp_path, config(fake.base_url)) as r:
        results = [send(nursery, r, ask(prose(1200, i), max_tokens=50, stream=True))
                   for i in range(12)]
        for res in results:
            await res.done.wait()
        # The first requests went out before relay knew anything: several met the
        # limit at once. From then on, each 429 set a hold, and no second 429 came within
        # it: the first request after a hold goes alone, the rest wait for its answer.
        first = fake.rejected[0]
        later = [t for t in fake.rejected if t > first]
        assert len(later) == len(set(later)), str([round(t, 2) for t in fake.rejected])
        for a, b in zip([first, *later], later, strict=False):
            assert b - a >= 1.0, fake.rejected
        # Every stream that was queued (its 200 and waiting notices out) ended complete:
        # none ended in a 429 it could have waited out.
        queued = [res for res in results if ": waiting" in res.text()]
        assert len(queued) >= 4
        assert all(ok(res) for res in queued), [res.text()[-300:] for res in queued
                                                if not ok(res)]
        failed = [res for res in results if not ok(res)]
        assert all(res.status == 429 for res in failed)
        assert len(failed) == fake.rejected.count(first)  # only those that met it first
        assert any(rec["held_by"] for rec in records(tmp_path))
        notices = [line for res in results for line in res.text().splitlines()
                   if "waiting for the provider's hold" in line]
        assert notices


async def test_a_hold_sends_a_request_with_a_fallback_elsewhere_at_once(
        nursery: trio.Nursery, clock: trio.testing.MockClock, fake: Metered,
        tmp_path: Path) -> None:
    other: Metered = await nursery.start(functools.partial(serve_metered, Limits()))
    extra = f"""
[providers.q]
adapter = "openai"
base_url = "{other.base_url}/v1"
[providers.q.profile]
lanes = 4
queue_max = 10
queue_timeout_s = 60
run_timeout_s = 60
[routes.r]
primary = "p/m-out10"
fallbacks = ["q/m-out10"]
"""
    fake.configure(Limits(rpm=600, itpm=1000, otpm=30000))
    async with relay_for(tmp_path, config(fake.base_url, extra=extra)) as r:
        lane_of(r).budget.hold(trio.current_time() + 30, "retry-after: 30")
        res = send(nursery, r, ask("hi", model="r"))
        await res.done.wait()
        assert ok(res) and res.json()["model"] == "q/m-out10"
        assert fake.requests == []  # the held provider was not asked
        res = send(nursery, r, ask("hi", model="p/m-out10"))  # no fallback: it waits
        with trio.move_on_after(10):
            await res.done.wait()
        assert not res.done.is_set()
        await res.done.wait()
        assert ok(res)
        assert trio.current_time() >= 30


# --- too large ----------------------------------------------------------------------------

async def test_a_request_larger_than_a_whole_budget_is_refused_at_once_or_falls_back(
        nursery: trio.Nursery, clock: trio.testing.MockClock, fake: Metered,
        tmp_path: Path) -> None:
    other: Metered = await nursery.start(functools.partial(serve_metered, Limits()))
    extra = f"""
[providers.big]
adapter = "openai"
base_url = "{other.base_url}/v1"
[providers.big.profile]
lanes = 4
queue_max = 10
queue_timeout_s = 60
run_timeout_s = 60
[routes.r]
primary = "p/m-out10"
fallbacks = ["big/m-out10"]
"""
    async with relay_for(tmp_path, config(fake.base_url, "itpm = 3000", extra)) as r:
        long = prose(4000, 9)
        res = send(nursery, r, ask(long, model="p/m-out10"))
        await res.done.wait()
        assert res.status == 400
        error = res.json()["error"]
        assert error["code"] == "request_too_large"
        assert error["relay"]["phase"] == "capacity"
        assert res.headers["x-should-retry"] == "false"
        assert "3,000 input tokens" in error["message"]
        needed = estimate_input(Call(request_id="x", provider="p", model="m", stream=False,
                                     messages=[{"role": "user", "content": long}]))
        assert f"{needed:,} input tokens" in error["message"]
        assert fake.requests == []
        res = send(nursery, r, ask(long, model="r"))
        await res.done.wait()
        assert ok(res) and res.json()["model"] == "big/m-out10"


# --- settlement ---------------------------------------------------------------------------

async def test_the_output_reservation_is_a_learned_percentile_of_the_models_answers(
        nursery: trio.Nursery, clock: trio.testing.MockClock, fake: Metered,
        tmp_path: Path) -> None:
    # SPEC L12: no max_tokens anywhere: the floor (256) until three answers have been
    # reported, then their 90th percentile; a request's own max_tokens still wins.
    async with relay_for(tmp_path, config(fake.base_url, "itpm = 30000\notpm = 30000")) as r:
        for body in [ask("hi", model="p/m-out1000")] * 4 + [
                ask("hi", model="p/m-out1000", max_tokens=50)]:
            res = send(nursery, r, body)
            await res.done.wait()
            assert ok(res), (res.status, res.text()[-500:])
    reserved = [rec["tokens_reserved"] for rec in records(tmp_path)]
    assert reserved[1:3] == reserved[:2]            # the floor, three times
    assert reserved[3] - reserved[0] == 1000 - 256   # then what the answers were
    assert reserved[4] - reserved[0] == 50 - 256     # its own limit


async def test_a_stopped_request_settles_to_what_was_sent_and_read(
        nursery: trio.Nursery, clock: trio.testing.MockClock, fake: Metered,
        tmp_path: Path) -> None:
    fake.tokens_per_s = 10.0  # a slow answer: 1,000 tokens in 100 s
    async with relay_for(tmp_path, config(fake.base_url, "itpm = 3000\notpm = 3000")) as r:
        res = send(nursery, r, ask(prose(300, 4), model="p/m-out1000", stream=True))
        while len(res.pieces) < 3:
            await trio.sleep(1)
        res.disconnect.set()
        await res.done.wait()
        with trio.fail_after(30):
            while lane_of(r).statistics().running:
                await trio.sleep(0.5)
        rec = records(tmp_path)[-1]
        assert rec["tokens_estimated"] is True  # the provider reported no usage
        text = prose(300, 4)
        sent = estimate_input(Call(request_id="x", provider="p", model="m", stream=True,
                                   messages=[{"role": "user", "content": text}]))
        assert rec["tokens_reserved"] == sent + 256  # no max_tokens: the floor
        got = "".join(e["choices"][0]["delta"].get("content") or ""
                      for e in sse_events(res.text()) if isinstance(e, dict)
                      and e.get("choices"))
        # Settled to what was sent (the input) and read (a few pieces of the answer,
        # at relay's estimate), not to the reservation nor to the whole 1,000 tokens.
        read = rec["tokens_used"] - sent
        assert len(got) // 4 <= read < 1000, (read, len(got))
        budget = lane_of(r).budget.status(lambda t: None)
        assert budget["reserved_output"] == 0
        assert budget["used_last_minute"] == rec["tokens_used"]


# --- visibility: status, metrics, page -----------------------------------------------------

async def test_status_metrics_and_page_show_each_budget_its_source_and_the_hold(
        nursery: trio.Nursery, fake: Metered, tmp_path: Path) -> None:
    # Real time: a real browser reads the page.
    served = await start_relay(nursery, config(fake.base_url, "itpm = 2000"), tmp_path)
    async with httpx.AsyncClient(trust_env=False, timeout=30.0) as client:
        for i in range(3):
            r = await client.post(f"{served.url}/v1/chat/completions",
                                  json=ask(prose(200, i), model="p/m-out10"))
            assert r.status_code == 200, r.text
        lane_of(served.relay).budget.hold(trio.current_time() + 120, "retry-after: 120")
        status = (await client.get(f"{served.url}/relay/v1/status")).json()
        budgets = status["providers"]["p"]["budgets"]
        assert budgets["budgets"]["input"]["limit_per_minute"] == 2000
        assert budgets["budgets"]["input"]["source"] == "configured"
        model = budgets["models"]["m-out10"]["budgets"]  # the model's own (SPEC L12a)
        assert model["input"]["header"] == 3000  # what the provider said
        assert model["input"]["header_at"] is not None
        assert model["output"]["source"] == "header"
        assert budgets["used_last_minute"] == sum(fake.prompts) + 3 * 10
        assert budgets["per_minute"][-1] == budgets["used_last_minute"]
        assert budgets["hold"]["cause"] == "retry-after: 120"
        assert 100 < budgets["hold"]["left_s"] <= 120
        metrics = (await client.get(f"{served.url}/metrics")).text
        assert ('relay_token_budget_limit{account="",budget="input",model="",provider="p",'
                'source="configured"} 2000.0') in metrics
        assert ('relay_token_budget_limit{account="",budget="input",model="m-out10",'
                'provider="p",source="header"} 3000.0') in metrics
        assert f'relay_tokens_used_total{{provider="p"}} {sum(fake.prompts) + 30}.0' in metrics
        assert 'relay_provider_hold_seconds{account="",model="",provider="p"} 1' in metrics
        async with open_browser(tmp_path) as browser:
            await browser.get(served.url + "/")
            bars = await browser.wait_for(
                "const c = document.querySelector('[data-provider=\"p\"] "
                "[data-field=\"tokens-chart\"]'); return c && [...c.querySelectorAll('.bar')]"
                ".filter(b => b.style.height !== '0%').length;")
            assert bars >= 1
            assert await browser.execute(
                "return document.querySelectorAll('[data-provider=\"p\"] .chart .limit')"
                ".length;") == 1
            held = await browser.wait_for(
                "const e = document.querySelector('[data-provider=\"p\"] "
                "[data-field=\"hold\"]'); return e && e.textContent;")
            assert "retry-after: 120" in held
            text = await browser.execute(
                "return document.querySelector('[data-provider=\"p\"] "
                "[data-field=\"tokens\"]').textContent;")
            assert "input 2,000/min (configured)" in text
            assert "m-out10: " in text and "input 3,000/min (header)" in text
    nursery.cancel_scope.cancel()


async def test_config_check_prints_each_budget_and_where_it_comes_from(tmp_path: Path) -> None:
    write(tmp_path, "profiles.toml", """
        [providers.cloud]
        adapter = "openai"
        preset = "openai"
        [providers.cloud.profile]
        itpm = 40000
        otpm = 16000
    """)
    done = await run_relay(tmp_path, "config", "check")
    assert done.returncode == 0, done.stderr.decode()
    line = next(line for line in done.stdout.decode().splitlines()
                if line.startswith("    token budgets:"))
    assert "rpm 500 requests/min (from adapter 'openai''s own profile)" in line
    assert "itpm 40000 input tokens/min (from [providers.cloud.profile] itpm)" in line
    assert "otpm 16000 output tokens/min (from [providers.cloud.profile] otpm)" in line
    assert "tpm not set (learned from the provider's rate-limit headers" in line
    assert "the lower limit wins" in line


async def test_a_connection_check_passes_a_hold_and_its_answer_ends_it_early(
        nursery: trio.Nursery, clock: trio.testing.MockClock, fake: Metered,
        tmp_path: Path) -> None:
    async with relay_for(tmp_path, config(fake.base_url, own='check_model = "m-out5"')) as r:
        budget = lane_of(r).budget
        budget.hold(trio.current_time() + 600, "retry-after: 600")
        waiting = send(nursery, r, ask("queued behind the hold", model="p/m-out10"))
        with trio.move_on_after(5):
            await waiting.done.wait()
        assert not waiting.done.is_set()  # held
        check = ASGIResult()
        nursery.start_soon(functools.partial(
            asgi_request, r.app, "/relay/v1/providers/p/check", b"", check))
        await check.done.wait()
        assert check.status == 200, check.text()
        assert check.json()["status"]["state"] == "connected", check.text()
        # The check's answer shows the limit has lifted: the hold ends, the queue moves.
        await waiting.done.wait()
        assert ok(waiting), waiting.text()
        assert trio.current_time() < 60
        assert budget.status(lambda t: None)["hold"] is None


@pytest.mark.parametrize("mode", ["configured", "headers", "neither"])
async def test_sixty_seconds_of_twice_the_input_limit_meet_no_429(
        nursery: trio.Nursery, clock: trio.testing.MockClock, fake: Metered,
        tmp_path: Path, mode: str) -> None:
    profile = "rpm = 60\nitpm = 3000\notpm = 3000" if mode == "configured" else ""
    if mode == "neither":  # the control: no figure, no header, and so 429s
        fake.configure(Limits(rpm=60, itpm=3000, otpm=3000), send_headers=False)
    async with relay_for(tmp_path, config(fake.base_url, profile)) as r:
        if mode == "headers":  # three small requests show relay the provider's headers
            for i in range(3):
                res = send(nursery, r, ask(f"hello {i}", max_tokens=20))
                await res.done.wait()
        results = []
        start = trio.current_time()
        i = 0
        while trio.current_time() - start < 60:  # 100 input tokens a second: twice 3,000/min
            text = prose(400 if i % 4 else 800, 100 + i)
            results.append(send(nursery, r, ask(text, max_tokens=50, stream=i % 3 == 0)))
            await trio.sleep(prompt_tokens([{"role": "user", "content": text}]) / 100.0)
            i += 1
        for res in results:
            await res.done.wait()
        assert len(results) >= 10
        if mode == "neither":
            assert fake.rejected  # the workload does go over the limit
            return
        assert fake.rejected == []
        assert all(ok(res) for res in results), [res.text()[-200:] for res in results
                                                 if not ok(res)]
