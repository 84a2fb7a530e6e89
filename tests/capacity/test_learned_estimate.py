"""The estimate learns what the provider counts (SPEC L12), through the assembled relay,
against a provider that counts Korean at a set rate (`fakes.fake_metered`
``cjk_chars_per_token``), on virtual time (see test_tokens.py's clock)."""

from __future__ import annotations

import functools
import random
from pathlib import Path

import pytest
import trio
import trio.testing
from fakes.fake_metered import Limits, Metered, serve_metered
from helpers.metered import ask, config, lane_of, ok, records, relay_for, send


def korean(chars: int, seed: int) -> str:
    """Hangul words of 2-5 syllables, about ``chars`` syllables in all."""
    rng = random.Random(seed)
    words, total = [], 0
    while total < chars:
        n = rng.randint(2, 5)
        words.append("".join(chr(0xAC00 + rng.randrange(11172)) for _ in range(n)))
        total += n
    return " ".join(words)


@pytest.fixture
def clock() -> trio.testing.MockClock:
    return trio.testing.MockClock(autojump_threshold=0.02)


@pytest.fixture
async def fake(nursery: trio.Nursery) -> Metered:
    server: Metered = await nursery.start(functools.partial(
        serve_metered, Limits(itpm=40_000, otpm=40_000)))
    server.cjk_chars_per_token = 1.5
    return server


async def test_a_korean_prompt_the_provider_takes_is_not_refused_and_reservations_learn(
        nursery: trio.Nursery, clock: trio.testing.MockClock, fake: Metered,
        tmp_path: Path) -> None:
    async with relay_for(tmp_path, config(fake.base_url)) as r:
        for i in range(12):  # answers teach relay what the provider counts
            res = send(nursery, r, ask(korean(1500, i), model="p/m-out10", max_tokens=10))
            await res.done.wait()
            assert ok(res), res.text()
        reserved = records(tmp_path)[-1]["tokens_reserved"] - 10
        told = fake.prompts[-1]
        # Relay's own count is ~1.3x the provider's; after 12 answers it reserves within
        # 15 % of what the provider counts (it reserved 1.3x at first).
        # (The first request reserved nothing: no budget was known before its answer.)
        assert records(tmp_path)[1]["tokens_reserved"] - 10 > 1.2 * fake.prompts[1]
        assert told * 0.95 < reserved < told * 1.15, (reserved, told)
        status = lane_of(r).budget.status(lambda t: None)["models"]["m-out10"]
        assert status["budgets"]["input"]["limit_per_minute"] == 40_000
        # 45,000 syllables: relay's estimate is over the 40,000 a minute; the provider
        # counts about 30,000 and answers it.
        big = send(nursery, r, ask(korean(45_000, 99), model="p/m-out10", max_tokens=10))
        await big.done.wait()
        assert ok(big), big.text()[:300]
        assert fake.rejected == []


async def test_a_burst_of_korean_counted_at_twice_relays_estimate_meets_no_429(
        nursery: trio.Nursery, clock: trio.testing.MockClock, tmp_path: Path) -> None:
    # bench.tokens' "korean 0.5" burst, smaller: the provider counts two tokens a Hangul
    # syllable, relay's first estimate one. Relay starts 2 before the model's first
    # answer; the rest queue on that first estimate. They must start on what the first
    # answers taught (the estimate learned while they waited: Need.current), and an
    # answer saying relay counts too few is believed at once.
    fake: Metered = await nursery.start(functools.partial(
        serve_metered, Limits(rpm=100, itpm=20_000, otpm=16_000)))
    fake.cjk_chars_per_token = 0.5
    fake.tokens_per_s, fake.first_token_s = 100.0, 0.3
    profile = "first_starts = 2\nrpm = 100\nitpm = 20000\notpm = 16000"
    async with relay_for(tmp_path, config(fake.base_url, profile, extra="")) as r:
        burst = [send(nursery, r, ask(korean(3000 if i % 6 == 0 else 100, i),
                                      model="p/m-out400", max_tokens=400 if i % 6 == 0
                                      else 150, stream=i % 10 < 3))
                 for i in range(30)]
        for res in burst:
            await res.done.wait()
        assert all(ok(res) for res in burst), [res.status for res in burst]
        assert fake.rejected == []  # the provider never had to say 429
        # ... and relay did not wait much longer than the provider's buckets made it:
        # ~35,000 input tokens at 20,000 a minute, 20,000 of them at once (the ideal
        # pacer: ~46 s).
        assert trio.current_time() < 60
