"""Turns between clients (SPEC L14) through the assembled relay (config → relay → HTTP
through its ASGI app → a fake upstream on loopback), on virtual time (see test_tokens.py's
clock): issue 35's experiment. Each client is a `[clients.NAME]` with its own token."""

from __future__ import annotations

import pytest
import trio
import trio.testing
from fakes.fake_metered import Limits, Metered, serve_metered
from helpers.metered import ask, config, lane_of, ok, relay_for, send

MODEL = "p/m-out150"  # 0.2 s to the first token, 150 tokens at 500 a second: 0.5 s


@pytest.fixture
def clock() -> trio.testing.MockClock:
    return trio.testing.MockClock(autojump_threshold=0.02)


WEIGHTS = {"agent": 1, "person": 1, "batch": 2}


@pytest.fixture(autouse=True)
def _tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    for who in WEIGHTS:
        monkeypatch.setenv(f"RELAY_TEST_{who.upper()}_TOKEN", f"tok-{who}")


def with_clients(text: str) -> str:
    return text + "".join(f"""
[clients.{who}]
token_env = "RELAY_TEST_{who.upper()}_TOKEN"
weight = {weight}
""" for who, weight in WEIGHTS.items())


async def test_a_persons_request_starts_within_one_answer_of_an_agents_burst(
        nursery: trio.Nursery, clock: trio.testing.MockClock, tmp_path: object,
        ) -> None:
    fake: Metered = await nursery.start(serve_metered, Limits())
    text = with_clients(config(fake.base_url).replace("lanes = 8", "lanes = 2"))
    async with relay_for(tmp_path, text) as r:  # type: ignore[arg-type]
        t0 = trio.current_time()
        agent = [send(nursery, r, ask(f"agent task {i}", model=MODEL, max_tokens=150),
                      token="tok-agent") for i in range(60)]
        await trio.sleep(0.5)
        asked = trio.current_time()
        person = send(nursery, r, ask("person hello", model=MODEL, max_tokens=150),
                      token="tok-person")
        await person.done.wait()
        answered = trio.current_time()
        assert ok(person), person.text()
        # Its answer takes 0.5 s; it waited at most one answer for a slot — not the
        # agent's 58 queued requests (15 s: 29 rounds of 0.5 s on 2 lanes, FIFO).
        assert answered - asked <= 0.5 + 0.5 + 0.3, answered - asked
        assert sum(1 for a in agent if a.done.is_set()) <= 6  # the agent's burst waits
        for a in agent:
            await a.done.wait()
        assert all(ok(a) for a in agent)
        assert trio.current_time() - t0 >= 14.5  # (the agent's burst really was 15 s)
        assert lane_of(r).statistics().queued == 0


async def test_three_clients_take_turns_weighted(
        nursery: trio.Nursery, clock: trio.testing.MockClock, tmp_path: object,
        ) -> None:
    # One lane: "agent" and "batch" (weight 2) send 12 each at once, "person" 2: while all
    # wait, batch starts twice for each of agent's, and the person's 2 come within the
    # first rounds.
    fake: Metered = await nursery.start(serve_metered, Limits())
    text = with_clients(config(fake.base_url).replace("lanes = 8", "lanes = 1"))
    async with relay_for(tmp_path, text) as r:  # type: ignore[arg-type]
        done: list[str] = []

        async def one(who: str, i: int) -> None:
            res = send(nursery, r, ask(f"{who} {i}", model=MODEL, max_tokens=150),
                       token=f"tok-{who}")
            await res.done.wait()
            assert ok(res), res.text()
            done.append(who)

        async with trio.open_nursery() as inner:
            for who, n in (("agent", 12), ("batch", 12), ("person", 2)):
                for i in range(n):
                    inner.start_soon(one, who, i)
                    await trio.sleep(0.001)  # (arrivals in this order)
        first = done[:12]
        assert first.count("person") == 2, done
        assert first.count("batch") >= 2 * first.count("agent") - 2, done
        assert first.count("agent") >= 2, done
