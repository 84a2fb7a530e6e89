"""Another program on the same key (issue 33, SPEC L12a): relay learns the rate it takes
from the provider's headers and leaves it that room, through the assembled relay, against
a metering fake provider (`fakes.fake_metered`), on virtual time (see test_tokens.py's
clock)."""

from __future__ import annotations

import functools
from pathlib import Path

import httpx
import pytest
import trio
import trio.testing
from fakes.fake_metered import Limits, Metered, prompt_tokens, prose, serve_metered
from helpers.metered import ask, config, lane_of, ok, relay_for, send

OURS, THEIRS = "m-out10", "other-out10"
LIMITS = Limits(rpm=600, itpm=6000, otpm=60_000)  # 100 input tokens a second


@pytest.fixture
def clock() -> trio.testing.MockClock:
    return trio.testing.MockClock(autojump_threshold=0.02)


@pytest.fixture
async def fake(nursery: trio.Nursery) -> Metered:
    server: Metered = await nursery.start(functools.partial(serve_metered, LIMITS))
    return server


@pytest.fixture(autouse=True)
def _key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_METERED_KEY", "sk-fake-metered")


async def other_program(base_url: str, stop: trio.Event, every_s: float) -> None:
    """Another program on the key: a ~60-token request straight to the provider every
    ``every_s``, whatever the buckets say (never retried), until ``stop``."""
    text = prose(55, 77)
    async with httpx.AsyncClient(trust_env=False, timeout=60.0) as client:
        start, n = trio.current_time(), 0
        while not stop.is_set():
            with trio.move_on_at(start + n * every_s):
                await stop.wait()
            if stop.is_set():
                return
            await client.post(base_url + "/v1/chat/completions", json={
                "model": THEIRS, "messages": [{"role": "user", "content": text}]})
            n += 1


async def test_what_another_program_on_the_key_takes_is_learned_and_left_to_it(
        nursery: trio.Nursery, clock: trio.testing.MockClock, fake: Metered,
        tmp_path: Path) -> None:
    # Relay's traffic: ~1,500-token requests at twice the input limit, answered at once
    # (10 tokens): each waits in the queue for the refill with nothing of relay's in
    # flight, so no header tells relay of the other program's take meanwhile. Relay
    # learns its rate from the headers it does see (what they say is gone beyond its own
    # count) and refills its count at the limit less that rate: its requests meet no 429
    # (without it, a start into a bucket the other program had emptied: 429s).
    their_input = prompt_tokens([{"role": "user", "content": prose(55, 77)}])
    every_s = (their_input + 10) / (0.3 * LIMITS.itpm / 60)  # 30 % of the limit's tokens
    our_input = sum(prompt_tokens([{"role": "user", "content": prose(1500, i)}])
                    for i in range(16))
    async with relay_for(tmp_path, config(fake.base_url)) as r:
        for i in range(3):  # relay sees the provider's headers
            res = send(nursery, r, ask(f"hello {i}", model=f"p/{OURS}", max_tokens=10))
            await res.done.wait()
            assert ok(res)
        stop = trio.Event()
        nursery.start_soon(other_program, fake.base_url, stop, every_s)
        results = []
        start = trio.current_time()
        for i in range(16):
            results.append(send(nursery, r, ask(prose(1500, i), model=f"p/{OURS}",
                                                max_tokens=10)))
            await trio.sleep(7.5)  # 1,500 tokens every 7.5 s: twice the input limit
        for res in results:
            await res.done.wait()
        took = trio.current_time() - start
        stop.set()
        ours = [m for m in fake.rejected_models if m == OURS]
        assert ours == [], f"{len(ours)} of relay's requests met a 429"
        assert all(ok(res) for res in results)
        # The status shows the rate learned: about the other program's 30 %.
        budgets = lane_of(r).budget.status(lambda t: None)["models"][OURS]["budgets"]
        others = budgets["input"]["others_per_minute"]
        assert 0.2 * LIMITS.itpm <= others <= 0.4 * LIMITS.itpm, budgets["input"]
        # ... and the queue still moves at what the key leaves relay: its requests end
        # within 10 % of an ideal pacer's time (a whole bucket, then the refill less the
        # other program's input rate).
        ideal = (our_input - LIMITS.itpm) / (LIMITS.itpm / 60 - their_input / every_s)
        assert took <= ideal * 1.1, (took, ideal)
