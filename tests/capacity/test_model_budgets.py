"""Budgets per model (SPEC L12a), through the assembled relay, against a provider that
meters each model apart and whose headers describe the answering model's window
(`fakes.fake_metered` with ``models``), on virtual time (see test_tokens.py's clock)."""

from __future__ import annotations

import functools
import subprocess
import sys
from pathlib import Path

import pytest
import trio
import trio.testing
from fakes.fake_metered import Limits, Metered, prose, serve_metered
from helpers.metered import ask, config, lane_of, ok, records, relay_for, send

SMALL, BIG = "small-out10", "big-out10"


@pytest.fixture
def clock() -> trio.testing.MockClock:
    return trio.testing.MockClock(autojump_threshold=0.02)


@pytest.fixture
async def fake(nursery: trio.Nursery) -> Metered:
    server: Metered = await nursery.start(functools.partial(
        serve_metered, Limits(), models={SMALL: Limits(tpm=6000),
                                         BIG: Limits(tpm=600_000)}))
    return server


@pytest.fixture(autouse=True)
def _key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_METERED_KEY", "sk-fake-metered")


async def test_each_model_keeps_the_budget_its_own_headers_describe(
        nursery: trio.Nursery, clock: trio.testing.MockClock, fake: Metered,
        tmp_path: Path) -> None:
    async with relay_for(tmp_path, config(fake.base_url)) as r:
        first = send(nursery, r, ask(prose(2500, 1), model=f"p/{SMALL}", max_tokens=10))
        await first.done.wait()
        short = send(nursery, r, ask("hello", model=f"p/{BIG}", max_tokens=10))
        await short.done.wait()
        assert ok(first) and ok(short)
        # The big model's 600,000 does not become the small model's limit: the next
        # ~4,000-token request waits for the small model's own budget, and no 429 comes.
        start = trio.current_time()
        small = send(nursery, r, ask(prose(4000, 2), model=f"p/{SMALL}", max_tokens=10))
        # ... nor does the small model's 6,000 make an ~8,000-token request to the big
        # model "too large": it starts at once, while the small one waits.
        big = send(nursery, r, ask(prose(8000, 3), model=f"p/{BIG}", max_tokens=10))
        await big.done.wait()
        assert ok(big), big.text()
        assert trio.current_time() - start < 2.0
        assert not small.done.is_set()
        await small.done.wait()
        assert ok(small), small.text()
        assert fake.rejected == []
        status = lane_of(r).budget.status(lambda t: None)
        assert status["budgets"] == {}  # nothing configured for the whole provider
        figures = {m: s["budgets"]["tokens"]["limit_per_minute"]
                   for m, s in status["models"].items()}
        assert figures == {SMALL: 6000, BIG: 600_000}


async def test_a_429_that_names_one_model_holds_that_model_and_its_fallback_goes_at_once(
        nursery: trio.Nursery, clock: trio.testing.MockClock, fake: Metered,
        tmp_path: Path) -> None:
    # No headers: relay learns only from the 429's body, which names the model.
    fake.configure(Limits(), send_headers=False,
                   models={SMALL: Limits(tpm=6000), BIG: Limits(tpm=600_000)})
    extra = f"""
[routes.r]
primary = "p/{SMALL}"
fallbacks = ["p/{BIG}"]
"""
    async with relay_for(tmp_path, config(fake.base_url, extra=extra)) as r:
        fill = send(nursery, r, ask(prose(5000, 1), model=f"p/{SMALL}", max_tokens=10))
        await fill.done.wait()
        assert ok(fill)
        start = trio.current_time()
        routed = send(nursery, r, ask(prose(4000, 2), model="r", max_tokens=10))
        await routed.done.wait()
        assert ok(routed), routed.text()
        assert trio.current_time() - start < 2.0  # the fallback was tried at once
        assert fake.rejected_models == [SMALL]
        rec = records(tmp_path)[-1]
        assert [(a["model"], a["failure"]) for a in rec["attempts"]] == [
            (SMALL, "rate_limited"), (BIG, None)]
        # The hold is the small model's: the big one starts at once, the account is free.
        status = lane_of(r).budget.status(lambda t: None)
        assert status["hold"] is None
        assert "try again in" in status["models"][SMALL]["hold"]["cause"]
        direct = send(nursery, r, ask("hi", model=f"p/{BIG}", max_tokens=10))
        await direct.done.wait()
        assert ok(direct) and trio.current_time() - start < 3.0


async def test_a_429_that_names_no_model_holds_the_whole_provider(
        nursery: trio.Nursery, clock: trio.testing.MockClock, tmp_path: Path) -> None:
    from fakes.fake_http import Exchange, FakeServer, serve_fake

    class Overloaded(FakeServer):
        async def respond(self, ex: Exchange) -> None:
            await ex.send_json(429, {"error": {"message": "Too many requests.",
                                               "type": "requests", "code": None}},
                               {"retry-after": "30"})

    server = await nursery.start(serve_fake, Overloaded)
    async with relay_for(tmp_path, config(server.base_url)) as r:
        res = send(nursery, r, ask("hi", model=f"p/{SMALL}", max_tokens=10))
        await res.done.wait()
        assert res.status == 429
        status = lane_of(r).budget.status(lambda t: None)
        assert status["hold"] is not None and status["hold"]["cause"] == "retry-after: 30"
        assert lane_of(r).budget.hold_left(scope=BIG) > 25  # every model waits


async def test_configured_per_model_figures_pace_that_model_and_judge_its_size(
        nursery: trio.Nursery, clock: trio.testing.MockClock, fake: Metered,
        tmp_path: Path) -> None:
    fake.configure(Limits(), send_headers=False,
                   models={SMALL: Limits(tpm=3000), BIG: Limits(tpm=600_000)})
    extra = f'[providers.p.limits."{SMALL}"]\ntpm = 3000\nrpm = 30\n'
    async with relay_for(tmp_path, config(fake.base_url, extra=extra)) as r:
        too_big = send(nursery, r, ask(prose(4000, 1), model=f"p/{SMALL}", max_tokens=10))
        fine = send(nursery, r, ask(prose(4000, 1), model=f"p/{BIG}", max_tokens=10))
        await too_big.done.wait()
        await fine.done.wait()
        assert too_big.status == 400, too_big.text()
        error = too_big.json()["error"]
        assert error["code"] == "request_too_large" and "3,000 tokens" in error["message"]
        assert ok(fine)
        start = trio.current_time()
        burst = [send(nursery, r, ask(prose(900, i), model=f"p/{SMALL}", max_tokens=10))
                 for i in range(6)]
        for res in burst:
            await res.done.wait()
        assert all(ok(res) for res in burst)
        assert fake.rejected == []
        # 6 of ~920 tokens against 3,000 a minute: the last waited for the refill.
        assert trio.current_time() - start > 30


def test_config_check_lists_each_models_figures(tmp_path: Path) -> None:
    conf = tmp_path / "relay.toml"
    conf.write_text(config("http://127.0.0.1:9", extra='[providers.p.limits."gpt-4o"]\n'
                                                      "tpm = 30000\nitpm = 20000\n"))
    out = subprocess.run([sys.executable, "-m", "relay", "config", "check", "--config", str(conf)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert ("model 'gpt-4o': tpm 30000, itpm 20000 per minute (from "
            '[providers.p.limits."gpt-4o"])') in out.stdout
    conf.write_text(config("http://127.0.0.1:9", extra='[providers.p.limits."gpt-4o"]\n'
                                                      "tpmm = 3\n"))
    out = subprocess.run([sys.executable, "-m", "relay", "config", "check", "--config", str(conf)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert 'providers.p.limits."gpt-4o"' in out.stdout + out.stderr


@pytest.mark.parametrize("first_starts", [None, 0])
async def test_before_a_models_first_answer_few_start(
        nursery: trio.Nursery, clock: trio.testing.MockClock, tmp_path: Path,
        first_starts: int | None) -> None:
    # Nothing configured: the provider's headers are all relay will know, and before the
    # first answer it knows nothing. The Anthropic adapter's own profile starts 2 of a
    # model until its first answer is back (SPEC L12a); 0 turns that off.
    fake: Metered = await nursery.start(functools.partial(
        serve_metered, Limits(itpm=3000, otpm=30_000)))
    own = "" if first_starts is None else f"first_starts = {first_starts}"
    async with relay_for(tmp_path, config(fake.base_url, own, kind="anthropic")) as r:
        burst = [send(nursery, r, ask(prose(1200, i), model="p/m-out20", max_tokens=20),
                      "/v1/chat/completions") for i in range(12)]
        for res in burst:
            await res.done.wait()
        if first_starts is None:
            assert fake.rejected == []
            assert all(ok(res) for res in burst)
            assert lane_of(r).budget.status(lambda t: None)["first_answer_pending"] == []
        else:
            assert len(fake.rejected) >= 3  # all 8 lanes started at once, blind


async def test_the_first_answer_gate_holds_the_others_ten_seconds_at_most(
        nursery: trio.Nursery, clock: trio.testing.MockClock, tmp_path: Path) -> None:
    # A non-streamed answer brings its headers only at its end, 30 s away here: the other
    # requests start 10 s after the first ones, not 30 s.
    fake: Metered = await nursery.start(functools.partial(
        serve_metered, Limits(itpm=300_000, otpm=300_000)))
    fake.first_token_s = 30.0
    async with relay_for(tmp_path, config(fake.base_url, kind="anthropic")) as r:
        start = trio.current_time()
        burst = [send(nursery, r, ask(f"hello {i}", model="p/m-out20", max_tokens=20))
                 for i in range(5)]
        for res in burst:
            await res.done.wait()
        assert all(ok(res) for res in burst)
        assert 40 <= trio.current_time() - start < 45  # (10 s, then a 30 s answer)


async def test_a_header_a_hair_under_relays_count_takes_nothing_off_again(
        nursery: trio.Nursery, clock: trio.testing.MockClock, tmp_path: Path) -> None:
    # A non-streamed answer's headers said at its end: what started after it is in the
    # provider's remaining already. Relay's count is the provider's here (a CJK character
    # a token on both sides), so the header says a hair less (it rounds down): that is
    # no news, and the requests started since must not come off again (relay waited up
    # to ~10 s for nothing on the bench's Korean and steady rows).
    fake: Metered = await nursery.start(functools.partial(
        serve_metered, Limits(itpm=20_000, otpm=20_000)))
    fake.tokens_per_s, fake.first_token_s = 100.0, 0.3
    async with relay_for(tmp_path, config(fake.base_url)) as r:
        warm = send(nursery, r, ask("안녕", model="p/m-out400", max_tokens=10))
        await warm.done.wait()
        long = send(nursery, r, ask("안녕 하세요", model="p/m-out400", max_tokens=400))
        await trio.sleep(0.5)
        later = [send(nursery, r, ask("가나다라 " * 1200, model="p/m-out400",
                                      max_tokens=400)) for _ in range(2)]
        await long.done.wait()  # its headers: at its end, the two later ones in them
        assert ok(long) and not any(x.done.is_set() for x in later)
        budget = lane_of(r).budget.status(lambda t: None)["models"]["m-out400"]
        told = fake.buckets["itpm"].now(trio.current_time())
        assert abs(budget["budgets"]["input"]["remaining"] - told) <= 0.01 * 20_000, (
            budget["budgets"]["input"]["remaining"], told)
        for x in later:
            await x.done.wait()
            assert ok(x), x.text()[:300]
        assert fake.rejected == []
