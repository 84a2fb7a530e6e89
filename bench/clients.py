"""Turns between clients (SPEC L14): a light client's wait beside a heavy one's.

    python -m bench.clients [--minutes 10] [--seed 0]

One provider with 2 lanes and 0.5 s answers (relay's own `Lane`, on virtual time: the
figures are the queue's, not the machine's). First issue 35's experiment: an agent sends
60 requests at once and half a second later a person sends one — the person's wait. Then
a longer run: a heavy client sends bursts of 60 (one every 20 s on average), a light client
one request every few seconds (2-6 s apart); it prints the p50 and p99 queue wait of each,
with turns (two clients) and without (every request as one client: FIFO in the class).
"""

from __future__ import annotations

import argparse
import functools
import random
import sys

import trio
import trio.testing

from relay.capacity.lanes import Lane
from relay.vocab.profile import Profile

ANSWER_S = 0.5


def _lane() -> Lane:
    return Lane("bench", Profile(lanes=2, queue_max=100_000, queue_timeout_s=10_000.0,
                                 run_timeout_s=60.0))


async def _request(lane: Lane, client: str, waits: list[float]) -> None:
    asked = trio.current_time()
    async with lane.slot("normal", client=client):
        waits.append(trio.current_time() - asked)
        await trio.sleep(ANSWER_S)


async def experiment(turns: bool) -> float:
    """Issue 35: 60 of an agent at once, a person's one half a second later."""
    lane, agent, person = _lane(), [], []  # type: ignore[var-annotated]
    async with trio.open_nursery() as nursery:
        for _ in range(60):
            nursery.start_soon(_request, lane, "agent" if turns else "default", agent)
        await trio.sleep(0.5)
        nursery.start_soon(_request, lane, "person" if turns else "default", person)
    return float(person[0])


async def day(turns: bool, minutes: float, seed: int) -> dict[str, list[float]]:
    rng = random.Random(seed)
    lane = _lane()
    waits: dict[str, list[float]] = {"light": [], "heavy": []}
    end = minutes * 60.0

    async def heavy(nursery: trio.Nursery) -> None:
        while trio.current_time() < end:
            await trio.sleep(rng.expovariate(1 / 20.0))
            for _ in range(60):
                nursery.start_soon(_request, lane, "heavy" if turns else "default",
                                   waits["heavy"])

    async def light(nursery: trio.Nursery) -> None:
        while trio.current_time() < end:
            await trio.sleep(rng.uniform(2.0, 6.0))
            nursery.start_soon(_request, lane, "light" if turns else "default",
                               waits["light"])

    async with trio.open_nursery() as nursery:
        nursery.start_soon(heavy, nursery)
        nursery.start_soon(light, nursery)
    return waits


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def _run(fn: functools.partial[object]) -> object:
    return trio.run(fn, clock=trio.testing.MockClock(autojump_threshold=0))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.clients", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0, help="length of the run")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(f"one provider, 2 lanes, {ANSWER_S:g} s answers (virtual time)")
    print("issue 35: an agent sends 60 at once, a person sends 1 half a second later")
    for turns in (False, True):
        wait = _run(functools.partial(experiment, turns))
        print(f"  {'with turns   ' if turns else 'without turns'}  the person waits "
              f"{wait:.2f} s")
    print(f"{args.minutes:g} minutes: a heavy client's bursts of 60 (every ~20 s), a light "
          "client's 1 request every 2-6 s; queue wait in seconds")
    print(f"  {'':13}  {'light p50':>9} {'light p99':>9}  {'heavy p50':>9} {'heavy p99':>9}"
          f"  {'requests':>8}")
    for turns in (False, True):
        waits = _run(functools.partial(day, turns, args.minutes, args.seed))
        assert isinstance(waits, dict)
        light, heavy = waits["light"], waits["heavy"]
        print(f"  {'with turns' if turns else 'without turns':13}  {_pct(light, 0.5):9.2f} "
              f"{_pct(light, 0.99):9.2f}  {_pct(heavy, 0.5):9.2f} {_pct(heavy, 0.99):9.2f}"
              f"  {len(light) + len(heavy):8}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
