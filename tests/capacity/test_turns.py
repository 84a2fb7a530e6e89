"""Turns between clients in a lane's queue (SPEC L14), on virtual time.

Inside a priority class, clients waiting for the same provider take turns, weighted by
``weight``; each client's own requests keep their order; a client that was idle rejoins at
the current turn (no credit saved up); a waiter that leaves gives its turn back.
"""

from __future__ import annotations

import functools

import pytest
import trio
import trio.testing

from relay.capacity.lanes import Lane
from relay.vocab.errors import RelayError
from relay.vocab.profile import Profile


def lane(lanes: int = 1, queue_max: int = 1000, queue_timeout_s: float = 600.0) -> Lane:
    return Lane("p", Profile(lanes=lanes, queue_max=queue_max,
                             queue_timeout_s=queue_timeout_s, run_timeout_s=60.0))


class Log:
    """Who started, in order, and when each request queued and started."""

    def __init__(self) -> None:
        self.starts: list[str] = []
        self.waited: dict[str, float] = {}

    async def request(self, ln: Lane, client: str, label: str, run_s: float = 1.0, *,
                      weight: float = 1.0, priority: str = "normal") -> None:
        t0 = trio.current_time()
        async with ln.slot(priority, client=client, weight=weight):
            self.starts.append(label)
            self.waited[label] = trio.current_time() - t0
            await trio.sleep(run_s)


async def burst(nursery: trio.Nursery, log: Log, ln: Lane, client: str, n: int,
                run_s: float = 1.0, *, weight: float = 1.0) -> None:
    for i in range(n):
        nursery.start_soon(functools.partial(log.request, ln, client, f"{client}{i}", run_s,
                                             weight=weight))
        await trio.testing.wait_all_tasks_blocked()  # (their arrival order is theirs)


async def test_a_late_clients_one_request_starts_next(
        nursery: trio.Nursery, autojump_clock: trio.abc.Clock) -> None:
    # The experiment: 2 lanes, 0.5 s answers; an agent sends 60 at once, half a
    # second later a person sends one. FIFO made the person wait 15 s; turns: 0 s.
    ln, log = lane(lanes=2), Log()
    await burst(nursery, log, ln, "agent", 60, 0.5)
    await trio.sleep(0.5)
    t0 = trio.current_time()
    async with trio.open_nursery() as inner:
        inner.start_soon(log.request, ln, "person", "person", 0.5)
    assert log.waited["person"] < 0.5 + 1e-9, log.waited["person"]
    assert trio.current_time() - t0 <= 1.0 + 1e-9
    # It started as soon as slots came free: the agent's 2 first, the 2 that took their
    # slots in the very tick it arrived, and at most the one beside it.
    assert log.starts.index("person") <= 5


async def test_two_clients_alternate_and_keep_their_own_order(
        nursery: trio.Nursery, autojump_clock: trio.abc.Clock) -> None:
    ln, log = lane(lanes=1), Log()
    await burst(nursery, log, ln, "a", 6)   # a0 starts; a1..a5 wait
    await burst(nursery, log, ln, "b", 3)
    await trio.testing.wait_all_tasks_blocked()
    while len(log.starts) < 9:
        await trio.sleep(1.0)
    assert log.starts == ["a0", "b0", "a1", "b1", "a2", "b2", "a3", "a4", "a5"]


async def test_three_clients_take_turns(
        nursery: trio.Nursery, autojump_clock: trio.abc.Clock) -> None:
    ln, log = lane(lanes=1), Log()
    await burst(nursery, log, ln, "a", 5)
    await burst(nursery, log, ln, "b", 5)
    await burst(nursery, log, ln, "c", 2)
    while len(log.starts) < 12:
        await trio.sleep(1.0)
    assert log.starts == ["a0", "b0", "c0", "a1", "b1", "c1", "a2", "b2", "a3", "b3",
                          "a4", "b4"]


async def test_a_weight_2_client_starts_twice_as_often_while_both_wait(
        nursery: trio.Nursery, autojump_clock: trio.abc.Clock) -> None:
    ln, log = lane(lanes=1), Log()
    await burst(nursery, log, ln, "light", 20)
    await burst(nursery, log, ln, "heavy", 20, weight=2.0)
    while len(log.starts) < 40:
        await trio.sleep(1.0)
    first = log.starts[:30]  # while both wait
    heavy = sum(1 for s in first if s.startswith("heavy"))
    light = sum(1 for s in first if s.startswith("light"))
    assert abs(heavy - 2 * light) <= 2, first
    assert [s for s in log.starts if s.startswith("heavy")] == [f"heavy{i}" for i in range(20)]
    assert [s for s in log.starts if s.startswith("light")] == [f"light{i}" for i in range(20)]


async def test_an_idle_client_saves_up_no_credit(
        nursery: trio.Nursery, autojump_clock: trio.abc.Clock) -> None:
    # "b" stays away while "a" runs 10 alone; then both send 6: they alternate, "b" does
    # not get the 10 turns it missed. (It joins at the current turn, the one a9 had: one
    # start before "a" again — at most one start per waiting client, no more.)
    ln, log = lane(lanes=1), Log()
    await burst(nursery, log, ln, "a", 10)
    while len(log.starts) < 10:
        await trio.sleep(1.0)
    await burst(nursery, log, ln, "x", 1)  # holds the slot while the two bursts queue
    await burst(nursery, log, ln, "b", 6)
    for i in range(6):
        nursery.start_soon(log.request, ln, "a", f"a{10 + i}")
        await trio.testing.wait_all_tasks_blocked()
    while len(log.starts) < 23:
        await trio.sleep(1.0)
    after = log.starts[11:]
    assert after == ["b0", "b1", "a10", "b2", "a11", "b3", "a12", "b4", "a13", "b5",
                     "a14", "a15"], after


async def test_priority_still_comes_first(
        nursery: trio.Nursery, autojump_clock: trio.abc.Clock) -> None:
    ln, log = lane(lanes=1), Log()
    await burst(nursery, log, ln, "a", 3)
    nursery.start_soon(functools.partial(log.request, ln, "b", "b-background",
                                         priority="background"))
    await trio.testing.wait_all_tasks_blocked()
    nursery.start_soon(functools.partial(log.request, ln, "a", "a-interactive",
                                         priority="interactive"))
    await trio.testing.wait_all_tasks_blocked()
    while len(log.starts) < 5:
        await trio.sleep(1.0)
    assert log.starts == ["a0", "a-interactive", "a1", "a2", "b-background"]


async def test_a_leaving_waiter_gives_its_clients_turn_back(
        nursery: trio.Nursery, autojump_clock: trio.abc.Clock) -> None:
    # a1 and a2 leave (their client gone) while they wait: a3 takes a1's turn, so "a"
    # still alternates with "b" rather than falling two turns behind (b0 joined at a0's
    # turn, the current one: it goes first).
    ln, log = lane(lanes=1), Log()
    await burst(nursery, log, ln, "a", 1)
    scopes = {}
    for i in range(1, 6):
        scope = scopes[i] = trio.CancelScope()

        async def one(i: int = i, scope: trio.CancelScope = scope) -> None:
            with scope:
                await log.request(ln, "a", f"a{i}")
        nursery.start_soon(one)
        await trio.testing.wait_all_tasks_blocked()
    await burst(nursery, log, ln, "b", 4)
    scopes[1].cancel()
    scopes[2].cancel()
    await trio.testing.wait_all_tasks_blocked()
    assert ln.statistics().queued == 3 + 4
    while len(log.starts) < 8:
        await trio.sleep(1.0)
    assert log.starts == ["a0", "b0", "a3", "b1", "a4", "b2", "a5", "b3"], log.starts
    assert ln.statistics().queued == 0


async def test_the_estimate_counts_one_start_per_waiting_client(
        nursery: trio.Nursery, autojump_clock: trio.abc.Clock) -> None:
    # 2 lanes, calls of 10 s (the lane's guess), 40 of "agent" queued: a new client
    # expects one start (its own turn comes after one of the agent's); the agent's next
    # request expects the whole queue.
    ln, log = lane(lanes=2), Log()
    await burst(nursery, log, ln, "agent", 42, 10.0)
    wait_new, _, call, ahead_new = ln.estimate("normal", "person")
    wait_agent, _, _, ahead_agent = ln.estimate("normal", "agent")
    assert ahead_new <= 1 and ahead_agent == 40
    assert wait_new <= call + 1e-9 and wait_agent >= 20 * call - 1e-9
    assert ln.estimate_wait_s("normal", "person") == wait_new
    # A refusal's Retry-After follows it too: the queue is full for everyone, but the
    # person is told to come back after about one call, the agent after the whole queue.
    full = lane(lanes=1, queue_max=4)
    await burst(nursery, log, full, "agent", 5, 10.0)
    refused: dict[str, RelayError] = {}
    for who in ("person", "agent"):
        with pytest.raises(RelayError) as info:
            async with full.slot(client=who):
                pass
        refused[who] = info.value
    assert refused["person"].reason == "provider_queue_full"
    person, agent = refused["person"].retry_after_s, refused["agent"].retry_after_s
    assert person is not None and agent is not None and person < 25 <= agent
    assert "waiting ahead" not in refused["person"].message  # its turn is the next
    assert "4 waiting ahead" in refused["agent"].message


async def test_a_bad_weight_is_refused() -> None:
    ln = lane()
    for weight in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="weight"):
            ln.slot(client="a", weight=weight)
    assert ln.statistics().queued == 0
