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
