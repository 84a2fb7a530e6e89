"""A provider that reckons a whole answer's rate-limit headers at its end (SPEC L12a),
through the assembled relay, on virtual time (see tests/capacity/test_tokens.py).

Such a header's ``remaining`` already holds the requests relay started while that answer
ran; relay cannot tell it from a provider that reckons at admission, so it takes them
off again when the header tightens its count. The next header of a request begun after
that one gives back what was taken off twice: the count rises to that header's figure
less every grant since ``RECKON_S`` before its request's (`relay.capacity.budget`).
"""

from __future__ import annotations

import functools
from pathlib import Path

import httpx
import pytest
import trio
import trio.testing
from fakes.fake_metered import Limits, Metered, prompt_tokens, prose, serve_metered
from helpers.metered import ask, config, ok, relay_for, send

LIMITS = Limits(rpm=600, itpm=3000, otpm=300_000)  # input: 50 tokens a second
MODEL = "p/m-out5000"  # answers of 5,000 tokens (10 s), cut by max_tokens where set


@pytest.fixture
def clock() -> trio.testing.MockClock:
    return trio.testing.MockClock(autojump_threshold=0.02)


@pytest.fixture(autouse=True)
def _key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_METERED_KEY", "sk-fake-metered")


async def test_what_a_header_reckoned_at_the_answers_end_took_off_twice_comes_back(
        nursery: trio.Nursery, clock: trio.testing.MockClock, tmp_path: Path) -> None:
    fake: Metered = await nursery.start(functools.partial(serve_metered, LIMITS))
    async with relay_for(tmp_path, config(fake.base_url, "rpm = 600\nitpm = 3000")) as r:
        # One model; a short request first shows relay the provider's headers.
        first = send(nursery, r, ask("hello", model=MODEL, max_tokens=10))
        await first.done.wait()
        # A and eight more, one a second, each answered whole after 10 s (5,000 tokens):
        # A's header, at its end, holds the eight.
        long = [send(nursery, r, ask(prose(180, 0), model=MODEL))]
        await trio.sleep(0.5)
        # Another program on the key takes 1,000 input tokens: A's header says less than
        # relay counts, and tightens it (less the eight, already in the figure).
        other = [{"role": "user", "content": prose(1000, 9)}]
        async with httpx.AsyncClient(trust_env=False) as direct:
            got = await direct.post(fake.base_url + "/v1/chat/completions", json={
                "model": "m-out1", "messages": other})
            assert got.status_code == 200
        for i in range(8):
            await trio.sleep(1.0)
            long.append(send(nursery, r, ask(prose(180, 1 + i), model=MODEL)))
        await fake.wait_until(lambda: fake.answered >= 3)  # A's answer and the other's
        # Five short ones now: the provider has room for three at once, and the rest
        # within seconds; relay's count, less the eight a second time, had none.
        start = trio.current_time()
        short = [send(nursery, r, ask(prose(180, 20 + i), model=MODEL, max_tokens=10))
                 for i in range(5)]
        for res in short:
            await res.done.wait()
        took = trio.current_time() - start
        for res in long:
            await res.done.wait()
        assert all(ok(res) for res in long + short)
        assert fake.rejected == []
        # The eight (~1,500 tokens) came off twice: relay counted about -350 where the
        # provider had 1,005. The first short request waits for the refill to its need
        # (~12 s: no header newer than A's had come); its own header gives the rest
        # back, and the other four start at once: ~13 s, where the count never given
        # back took ~30 s (five needs and the debt, refilled at 50 tokens a second).
        size = prompt_tokens([{"role": "user", "content": prose(180, 20)}])
        assert (5 * size + 1_300) / 50 > 25
        assert took < 20, took
