"""Lanes: how many requests a provider runs at once, and the queue in front of them.

Theory of operation. A `Lane` owns ``capacity`` slots. ``async with lane.slot(priority)``
either takes a free slot at once or waits in a priority queue (interactive before
normal before background, FIFO inside a class, SPEC L8). A freed slot is handed straight
to the next waiter (no barging), and only when the pacer allows a start (SPEC L9): the
waiter itself sleeps until the pacer's next start time, so the wait counts as queue time,
is cancellable, and no slot is taken while it cannot be used.

The slot is the body of the ``async with``: the caller runs its adapter inside it, so the
slot is given back only after the adapter's scope has exited, cleanup included (SPEC L6).

Edges:
- queue full → ``provider_queue_full`` at once; waited past ``queue_timeout_s`` →
  ``provider_queue_timeout`` (SPEC L7), each with an honest estimate of when to retry
  (`Lane.estimate_wait_s`: what the running requests have left, then the queue ahead);
- a waiter cancelled in the very tick it is granted a slot hands the slot back (a naive
  limiter leaks it, notes/trio-stack.md Q5), and that grant was no start: the pacer
  forgets it, so the next waiter may start at once;
- when a slot is free but the pacer says "not yet", only the head of the queue sleeps
  until the pacer's next start; a waiter that leaves (client gone, its queue timeout)
  hands off again, so a new head takes over that wait — else the free slot idled until
  every waiter had timed out;
- `update_profile` changes capacity and limits in place: running work is never revoked,
  waiters are granted at once when capacity grows, a new rpm applies at the next start
  (SPEC L10); `wait_idle` returns when nothing runs or waits (an adapter retires then).

`tests/lane_fuzz.py` checks these rules at every step of random runs (SPEC L7-L10).

All bookkeeping is synchronous between checkpoints, so no lock is needed.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import math
from collections.abc import Callable
from types import TracebackType

import attrs
import trio

from relay.vocab.errors import RelayError
from relay.vocab.events import LaneStatistics
from relay.vocab.profile import Profile

__all__ = ["PRIORITIES", "Lane", "LaneStatistics", "Ticket"]

PRIORITIES = {"interactive": 0, "normal": 1, "background": 2}
_UNPACED = contextlib.nullcontext()


@attrs.define(eq=False)
class Ticket:
    """One holder of a slot: when it queued, started and released (monotonic times)."""

    priority: str
    queued_at: float
    started_at: float | None = None
    released_at: float | None = None
    lease_expired: bool = False  # a shared lane's release never reached its server (L11)

    @property
    def queue_s(self) -> float:
        end = self.started_at if self.started_at is not None else trio.current_time()
        return end - self.queued_at


@attrs.define(eq=False)
class _Waiter:
    rank: int
    seq: int
    event: trio.Event = attrs.field(factory=trio.Event)
    granted: bool = False
    cancelled: bool = False
    # Set at the grant: the start it counts as, and the pacer's last start before it, so
    # that a grant handed straight back (cancelled in the same tick) is not a start.
    start_no: int = 0
    paced_from: float = -math.inf
    granted_at: float = 0.0  # when the slot became its own (its start, for the estimate)

    def __lt__(self, other: _Waiter) -> bool:
        return (self.rank, self.seq) < (other.rank, other.seq)


class Lane:
    """The slots and queue of one provider. See the module docstring."""

    shared = False  # `relay.engine.lane_api.LaneLike`: counted in this process alone

    def __init__(self, name: str, profile: Profile, *, expected_run_s: float = 10.0) -> None:
        self.name = name
        self._profile = profile
        self._borrowed = 0
        self._live = 0  # waiters neither granted nor cancelled
        self._heap: list[_Waiter] = []
        self._seq = itertools.count()
        # The pacer (SPEC L9): when the last request started, and how many have; the next
        # start is due 60 / rpm after the last one, with the rpm of the current profile.
        self._last_start = -math.inf
        self._starts = 0
        # How long a slot is held, for honest Retry-After figures: the adapter's typical
        # call time until a hold has been seen, then a running average of the holds seen
        # (the first one replaces the guess). And when each slot held now was taken.
        self._avg_run_s = expected_run_s
        self._holds_seen = 0
        self._held_since: list[float] = []
        self._idle = trio.Event()
        self._idle.set()

    @property
    def profile(self) -> Profile:
        return self._profile

    @property
    def _next_start(self) -> float:
        """The pacer's earliest next start (-inf when unpaced)."""
        rpm = self._profile.rpm
        return self._last_start + 60.0 / rpm if rpm > 0 else -math.inf

    def update_profile(self, profile: Profile) -> None:
        """Apply a reloaded profile in place: never revokes a running slot. A new rpm
        applies at once (the next start is due 60 / rpm after the last one)."""
        self._profile = profile
        self._hand_off()

    async def wait_idle(self) -> None:
        """Return once nothing runs or waits here: no slot held, no waiter (a removed
        provider's last request has ended). When it returns the lane *is* idle, at that
        moment: the check and the return are one synchronous step, so a caller can retire
        what the lane guards before anything else runs. (It always checkpoints first.)"""
        await trio.lowlevel.checkpoint()
        while not (self._borrowed == 0 and self._live == 0):
            await self._idle.wait()

    def _busy(self) -> None:
        if self._idle.is_set():
            self._idle = trio.Event()

    def _maybe_idle(self) -> None:
        if self._borrowed == 0 and self._live == 0:
            self._idle.set()

    def statistics(self) -> LaneStatistics:
        return LaneStatistics(running=self._borrowed, capacity=self._profile.lanes,
                              queued=self._live, queue_max=self._profile.queue_max)

    @property
    def held_here(self) -> int:
        """Slots this relay holds (all of them: the lane is this process's alone)."""
        return self._borrowed

    async def claim_check(self, interval_s: float) -> bool:
        """A local lane's interval checks are this relay's own: always run them."""
        await trio.lowlevel.checkpoint()
        return True

    def estimate_wait_s(self, priority: str = "normal") -> float:
        """When a request of ``priority`` arriving now could expect to start (seconds from
        now; for Retry-After). See `estimate`."""
        return self.estimate(priority)[0]

    def estimate(self, priority: str = "normal") -> tuple[float, list[float], float, int]:
        """When a request of ``priority`` arriving now could expect to start, and what
        that rests on: ``(wait_s, left_s, call_s, ahead)`` — what each running request
        has left (shortest first), the expected call time, the waiters ahead.

        Each running request has left what its expected call time leaves after what it
        has run — or, once it has run longer than expected, as long again as it is over
        (a call far over the lane's average has shown it is a long one) — never more
        than its run timeout and interrupt grace allow. The expected call time is the
        lane's average hold (the adapter's typical call time until one is seen), or the
        median of what the running requests have run so far when that is longer (the
        average is stale: no request has finished, or the calls got longer). The
        ``ahead`` waiters of the same or a higher class then take the slots as they come
        free, one expected call each, and the pacer spaces every start by 60 / rpm.
        """
        now = trio.current_time()
        rank = PRIORITIES.get(priority, PRIORITIES["normal"])
        prof = self._profile
        lanes = max(1, prof.lanes)
        bound = prof.run_timeout_s + prof.interrupt_grace_s
        ran = sorted(now - t for t in self._held_since)
        call = self._avg_run_s
        if ran:
            call = max(call, ran[len(ran) // 2])
        call = min(call, bound)
        left = sorted(min(max(bound - t, 0.0), abs(self._avg_run_s - t)) for t in ran)
        # When each of the ``lanes`` slots comes free: the held ones beyond capacity (a
        # reload took lanes away) must end before their slot counts.
        free = [0.0] * max(0, lanes - len(left)) + left[max(0, len(left) - lanes):]
        heapq.heapify(free)
        ahead = sum(1 for w in self._heap if not w.cancelled and w.rank <= rank)
        gap = 60.0 / prof.rpm if prof.rpm > 0 else 0.0
        start = self._next_start - now - gap  # the pacer's last start, from now
        steps = min(ahead, 4096) + 1
        for _ in range(steps):
            start = max(heapq.heappop(free), start + gap)
            heapq.heappush(free, start + call)
        start += (ahead + 1 - steps) * max(call / lanes, gap)  # a huge queue: its rate
        return max(0.0, start), left, call, ahead

    def slot(
        self, priority: str = "normal", *, on_queued: Callable[[], None] | None = None,
    ) -> _Slot:
        """Hold one slot for the body of the ``async with``.

        Args:
            priority: ``interactive``, ``normal`` or ``background``.
            on_queued: called (synchronously) when the request has to wait.

        Raises:
            RelayError: ``provider_queue_full`` or ``provider_queue_timeout``.
        """
        return _Slot(self, priority, on_queued)

    async def _acquire(self, priority: str, on_queued: Callable[[], None] | None) -> Ticket:
        rank = PRIORITIES.get(priority)
        if rank is None:  # before any bookkeeping: a lane must not look busy after it
            raise ValueError(f"unknown priority {priority!r}; one of {', '.join(PRIORITIES)}")
        await trio.lowlevel.checkpoint_if_cancelled()
        now = trio.current_time()
        ticket = Ticket(priority=priority, queued_at=now)
        self._busy()
        if self._borrowed < self._profile.lanes and self._live == 0 and now >= self._next_start:
            self._take(ticket, now)  # (a cancel point above; the schedule point is the
            return ticket            # holder's next wait: no trip through the scheduler)
        if self._live >= self._profile.queue_max:
            self._maybe_idle()
            raise self._capacity_error("provider_queue_full", priority=priority)

        waiter = _Waiter(rank, next(self._seq))
        heapq.heappush(self._heap, waiter)
        self._live += 1
        try:
            if on_queued is not None:
                on_queued()  # inside the try: if it raises, the waiter still leaves
            # (noqa, ASYNC912: a waiter granted before the loop runs has nothing to await.)
            with trio.move_on_at(now + self._profile.queue_timeout_s):  # noqa: ASYNC912
                while not waiter.granted:
                    # Woken by a grant, by the pacer's next start, or (the head of the
                    # queue) to sleep until that start when a slot is free but paced.
                    event = waiter.event = trio.Event()
                    pacer = self._next_start  # (no scope held by every waiter when unpaced)
                    with trio.move_on_at(pacer) if pacer > trio.current_time() else _UNPACED:
                        await event.wait()
                    if not waiter.granted and trio.current_time() >= self._next_start:
                        self._hand_off()  # the pacer allows a start now
        except BaseException:
            # Cancelled from outside (client gone, shutdown) or anything else. Granted in
            # the same tick? Then the slot is ours and must go back, or it leaks.
            if waiter.granted:
                self._unstart(waiter)
                self._held_since.remove(waiter.granted_at)
                self._give_back()
            else:
                self._forget(waiter)
            raise
        if not waiter.granted:
            self._forget(waiter)
            raise self._capacity_error("provider_queue_timeout", waited_s=trio.current_time() - now,
                                       priority=priority)
        ticket.started_at = waiter.granted_at
        return ticket

    def _take(self, ticket: Ticket, now: float) -> None:
        self._borrowed += 1
        self._held_since.append(now)
        ticket.started_at = now
        self._last_start = now
        self._starts += 1

    def _unstart(self, waiter: _Waiter) -> None:
        """A grant handed straight back was no start: the pacer forgets it, unless
        another request has started since."""
        if self._starts == waiter.start_no:
            self._last_start = waiter.paced_from

    def _hand_off(self) -> None:
        """Give free slots to the first waiters, as far as the pacer allows."""
        now = trio.current_time()
        while self._borrowed < self._profile.lanes and self._live > 0:
            if now < self._next_start:
                # A slot is free but the pacer says not yet: make sure the head of the
                # queue sleeps until the pacer's next start (it may be sleeping without
                # a deadline), so the free slot is not left idle (SPEC L9).
                while self._heap and self._heap[0].cancelled:
                    heapq.heappop(self._heap)
                if self._heap:
                    self._heap[0].event.set()
                return
            waiter = heapq.heappop(self._heap)
            if waiter.cancelled:
                continue
            self._borrowed += 1
            self._held_since.append(now)
            self._live -= 1
            waiter.granted = True
            waiter.granted_at = now
            waiter.paced_from = self._last_start
            self._last_start = now
            self._starts += 1
            waiter.start_no = self._starts
            waiter.event.set()

    def _forget(self, waiter: _Waiter) -> None:
        waiter.cancelled = True
        self._live -= 1
        # It may have been the head, woken to sleep until the pacer's next start for a
        # free slot: hand off again, or that slot idles until every waiter times out.
        self._hand_off()
        self._maybe_idle()
        if len(self._heap) > 2 * self._live + 16:  # lazy deletion: compact now and then
            self._heap = [w for w in self._heap if not w.cancelled]
            heapq.heapify(self._heap)

    def _give_back(self) -> None:
        self._borrowed -= 1
        self._hand_off()
        self._maybe_idle()

    def _release(self, ticket: Ticket) -> None:
        now = trio.current_time()
        ticket.released_at = now
        if ticket.started_at is not None:
            self._held_since.remove(ticket.started_at)
            self._holds_seen += 1
            weight = max(0.2, 1.0 / self._holds_seen)
            self._avg_run_s += weight * ((now - ticket.started_at) - self._avg_run_s)
        self._give_back()

    def _capacity_error(self, reason: str, waited_s: float | None = None,
                        priority: str = "normal") -> RelayError:
        stats = self.statistics()
        wait, left, call, ahead = self.estimate(priority)
        retry = max(1.0, wait)
        numbers = (f"{stats.running}/{stats.capacity} running, {stats.queued} queued "
                   f"(queue_max {stats.queue_max})")
        if reason == "provider_queue_full":
            message = (f"provider {self.name!r} is at capacity: {numbers}. This request was "
                       f"not started. Retry in about {math.ceil(retry)} s, when earlier "
                       "requests (connection checks included) have finished.")
        else:
            message = (f"waited {waited_s or 0:.0f} s for earlier requests to provider "
                       f"{self.name!r} (connection checks included) to finish: {numbers}. "
                       f"This request was not started. Retry in about {math.ceil(retry)} s, "
                       "once they have finished.")
        message += f" ({_basis(left, call, ahead, self._profile.rpm)})"
        return RelayError(reason, message, provider=self.name, retry_after_s=retry,
                          action=self._capacity_action(reason))


    def _capacity_action(self, reason: str) -> str:
        """What to do about a capacity failure: wait, or give the lane more room — never
        re-check the connection (SPEC L7; seed 000: that advice made the jam worse)."""
        p, table = self._profile, f"[providers.{self.name}.profile]"
        if reason == "provider_queue_full":
            return (f"retry after the time in Retry-After; if the queue is often full, "
                    f"raise queue_max (now {p.queue_max}) in {table}, or lanes (now "
                    f"{p.lanes}) if the provider really runs more requests at once")
        return (f"retry after the time in Retry-After; if requests often wait this long, "
                f"raise queue_timeout_s (now {p.queue_timeout_s:g} s) in {table}, or "
                f"lanes (now {p.lanes}) if the provider really runs more at once")


def _basis(left: list[float], call: float, ahead: int, rpm: float) -> str:
    """What an estimate rests on, in words: "estimated: the running requests have about
    50-60 s left; 2 waiting ahead, about 90 s each"."""
    low, high = (math.ceil(left[0]), math.ceil(left[-1])) if left else (0, 0)
    said = f"estimated: the running requests have about {low}"
    said += f"-{high} s left" if high != low else " s left"
    if ahead:
        said += f"; {ahead} waiting ahead, about {math.ceil(call)} s each"
    if rpm:
        said += f"; one start every {60 / rpm:g} s"
    return said


class _Slot:
    """`Lane.slot`'s context manager: acquire on entry, release on exit, whatever ends the
    body. A class, not ``@asynccontextmanager``: a generator cost more than the lane."""

    __slots__ = ("_lane", "_on_queued", "_priority", "_ticket")

    def __init__(self, lane: Lane, priority: str,
                 on_queued: Callable[[], None] | None) -> None:
        self._lane, self._priority, self._on_queued = lane, priority, on_queued
        self._ticket: Ticket | None = None

    async def __aenter__(self) -> Ticket:
        self._ticket = await self._lane._acquire(self._priority, self._on_queued)
        return self._ticket

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        ticket, self._ticket = self._ticket, None
        assert ticket is not None
        self._lane._release(ticket)
