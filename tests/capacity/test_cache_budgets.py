"""Cached prompts as the provider counts them (SPEC L12a), through the assembled relay:
Anthropic's input budget counts no cache reads, and a conversation whose last answer was
read from the cache is expected to be read from it again (`fakes.fake_metered` with
``cache_s``: Anthropic's prompt cache), on virtual time (see test_tokens.py's clock)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
import trio.testing
from fakes.fake_metered import Limits, Metered, prose, serve_metered
from helpers.metered import config, lane_of, records, relay_for, send

PATH = "/v1/messages"


@pytest.fixture
def clock() -> trio.testing.MockClock:
    return trio.testing.MockClock(autojump_threshold=0.02)


@pytest.fixture
async def fake(nursery: trio.Nursery) -> Metered:
    server: Metered = await nursery.start(functools.partial(
        serve_metered, Limits(itpm=30_000, otpm=30_000)))
    server.cache_s = 300.0
    return server


@pytest.fixture(autouse=True)
def _key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_METERED_KEY", "sk-fake-metered")


def turn(system: str, history: list[dict[str, Any]]) -> dict[str, Any]:
    """A coding agent's turn: a long system prompt marked for the cache, the history."""
    return {"model": "p/m-out20", "max_tokens": 20, "messages": history,
            "system": [{"type": "text", "text": system,
                        "cache_control": {"type": "ephemeral"}}]}


async def test_a_conversation_read_from_the_cache_is_neither_refused_nor_held(
        nursery: trio.Nursery, clock: trio.testing.MockClock, fake: Metered,
        tmp_path: Path) -> None:
    system = prose(16_000, 1)
    history: list[dict[str, Any]] = []
    start = trio.current_time()
    async with relay_for(tmp_path, config(fake.base_url, kind="anthropic")) as r:
        for n in range(8):  # the prompt grows past the 30,000-token input limit
            history.append({"role": "user", "content": prose(2500, 10 + n)})
            res = send(nursery, r, turn(system, history), PATH)
            await res.done.wait()
            assert res.status == 200, (n, res.text()[:400], fake.prompts)
            answer = res.json()
            history.append({"role": "assistant", "content": answer["content"][0]["text"]})
        usage = answer["usage"]
        # The client sees the cache in Messages' own fields; input_tokens is the rest.
        assert usage["cache_read_input_tokens"] > 30_000
        assert usage["input_tokens"] + usage["cache_creation_input_tokens"] < 3_000
        assert fake.rejected == []
        # Uncached: ~18,500 at first, then ~2,500 a turn: 38,500 in all, 8,500 beyond the
        # full bucket, 17 s of its refill; the whole prompts (~40,000 at the end, ~220,000
        # in all) would have taken minutes, and the last ones never fitted.
        assert trio.current_time() - start < 25
        rec = records(tmp_path)[-1]
        assert rec["usage"]["cache_read_tokens"] == usage["cache_read_input_tokens"]
        # The budget counted what the provider counts: the uncached part.
        assert rec["tokens_used"] < 3_000 + 20
        # relay's count of the input budget follows the provider's own bucket (which
        # counted the uncached parts alone), not the whole prompts.
        status = lane_of(r).budget.status(lambda t: None)["models"]["m-out20"]
        truth = fake.buckets["itpm"].now(trio.current_time())
        assert abs(status["budgets"]["input"]["remaining"] - truth) < 1_000, truth


async def test_a_marked_prompt_relay_cannot_judge_is_sent_not_refused(
        nursery: trio.Nursery, clock: trio.testing.MockClock, fake: Metered,
        tmp_path: Path) -> None:
    system = prose(20_000, 2)
    history = [{"role": "user", "content": prose(2000, 3)}]
    # Another program (or this relay before a restart) had the same conversation: the
    # provider has its prompt in its cache, relay knows nothing of it.
    async with httpx.AsyncClient(trust_env=False) as client:
        first = await client.post(f"{fake.base_url}/v1/messages",
                                  json={**turn(system, history), "model": "m-out20"})
        assert first.status_code == 200
    history += [{"role": "assistant", "content": "tok"},
                {"role": "user", "content": prose(12_000, 4)}]
    async with relay_for(tmp_path, config(fake.base_url, kind="anthropic")) as r:
        # The model's limits are known (30,000 input tokens a minute) ...
        hello = send(nursery, r, {"model": "p/m-out20", "max_tokens": 5,
                                  "messages": [{"role": "user", "content": "hello"}]}, PATH)
        await hello.done.wait()
        assert hello.status == 200
        # ... and this ~34,000-token prompt is over them as a whole, but it marks its
        # prefix for the cache: relay sends it, and the provider reads 22,000 from it.
        res = send(nursery, r, turn(system, history), PATH)
        await res.done.wait()
        assert res.status == 200, res.text()[:400]
        assert res.json()["usage"]["cache_read_input_tokens"] > 20_000
        # Unmarked, the same prompt could never start: refused at once.
        plain = send(nursery, r, {"model": "p/m-out20", "max_tokens": 20,
                                  "system": system, "messages": history}, PATH)
        await plain.done.wait()
        assert plain.status == 400 and "request_too_large" in plain.text()
