"""Lanes: how many requests a provider runs at once, and the queue in front of them.

Theory of operation. A `Lane` owns ``capacity`` slots. ``async with lane.slot(priority,
client=...)`` either takes a free slot at once or waits in one priority queue
(interactive before normal before background, SPEC L8; inside a class, clients take
turns, SPEC L14 — below). A freed slot is handed straight to the head of the queue (no
barging), and only when the pacer allows a start (SPEC L9): the waiter itself sleeps
until the pacer's next start time, so the wait counts as queue time, is cancellable, and
no slot is taken while it cannot be used.

Turns between clients (SPEC L14), start-time fair queueing inside each class. Each class
has a virtual clock ``V``: the turn (virtual start tag) of the latest start in that
class. A request of client ``k`` gets the tag ``S = max(V, F[k])`` when it queues (or
starts at once), and its client's next free turn becomes ``F[k] = S + 1 / weight``. The
queue's order is ``(class, S, arrival)``. So a client's own requests keep their order
(its tags grow); two clients that both wait start in the ratio of their weights (a
weight-2 client's tags step by 1/2: two starts for one); and a client that was idle
rejoins at ``V`` — no credit saved up while away — so a request of a client with nothing
waiting is behind at most one waiter of each other client (the ones whose tag is ``V``
too, arrived earlier): a burst of 200 delays it by at most one start per waiting client,
never the burst. With a single client (``default``: relay without ``[clients]``) the
order is exactly FIFO inside a class. A waiter that leaves without starting (its client
gone, its queue timeout, a grant handed back in its own tick) gives its turn back: its
client's later waiters in that class move up one turn each, so leaving never costs the
client a turn. `Lane.estimate` counts only the waiters that rank before a new request's
tag: a new client's request waits about one start per waiting client, not the queue.

The pacer is a sliding window: at most ``rpm`` starts in any 60 s (`Pacer`). A burst
below ``rpm`` starts at once — as a provider's own request limit allows it (a continuous
bucket of ``rpm`` requests, or a fixed or sliding minute) — and never more than ``rpm``
in a minute, however the starts fall.

The slot is the body of the ``async with``: the caller runs its adapter inside it, so the
slot is given back only after the adapter's scope has exited, cleanup included (SPEC L6).

Edges:
- queue full → ``provider_queue_full`` at once; waited past ``queue_timeout_s`` →
  ``provider_queue_timeout`` (SPEC L7), each with an honest estimate of when to retry
  (`Lane.estimate_wait_s`: what the running requests have left, then the queue ahead);
- a waiter cancelled in the very tick it is granted a slot hands the slot back (a naive
  limiter leaks it, notes/trio-stack.md Q5), and that grant was no start: the pacer
  forgets it, so the next waiter may start in its place;
- when a slot is free but the pacer says "not yet", only the head of the queue sleeps
  until the pacer's next start; a waiter that leaves (client gone, its queue timeout)
  hands off again, so a new head takes over that wait — else the free slot idled until
  every waiter had timed out;
- `update_profile` changes capacity and limits in place: running work is never revoked,
  waiters are granted at once when capacity grows, a new rpm applies at the next start,
  counting the starts of the last minute (SPEC L10); `wait_idle` returns when nothing
  runs or waits (an adapter retires then).

Token budgets (SPEC L12) are one more thing the head of the queue waits for, exactly as it
waits for the pacer: a request brings its `Need` (estimated input, output reservation);
the head starts only when its lane, the pacer, every budget of `Lane.budget` and any hold
allow, and sleeps until the earliest moment they all do (no barging: the waiters behind it
wait too, and no slot idles while it could start). The head is the head of the fair
order (turns between clients, below). One exception, because budgets are per model (SPEC
L12a, `relay.capacity.meter`): while the head waits only for its own model's budgets, a
waiter of another model that could start now does (`Lane._passer`: the first in the fair
order whose model is not itself waiting) — one model's empty bucket never slows the
others; the account's budgets, a hold on the account and the pacer are passed by nobody,
and a waiter of the head's own model never passes it. The grant reserves its need; the
dispatcher settles it once the answer's usage is known. A request whose need exceeds a
budget's whole limit is refused at once (``request_too_large``); one that would still be
held by the provider when its queue timeout passes — or that has a fallback to go to
(``leave_if_held``) — leaves at once with the hold's Retry-After.

`tests/helpers/lane_fuzz.py` checks these rules at every step of random runs (SPEC L7-L10,
and the turns between clients of L14).

All bookkeeping is synchronous between checkpoints, so no lock is needed.
"""
# layers: long because admission is one rule decided in one place (`Lane._hand_off`):
# slots, the priority queue, the pacer and the token budgets, each waiting the same way.

from __future__ import annotations

import contextlib
import heapq
import itertools
import math
from collections.abc import Callable, Mapping
from types import TracebackType

import attrs
import trio

from relay.vocab.errors import RelayError
from relay.vocab.events import LaneStatistics
from relay.vocab.limits import RateLimits
from relay.vocab.profile import ModelLimits, Profile

from .budget import Need, Reservation, held_error, too_large
from .meter import Meter
from .pacer import Pacer

__all__ = ["PRIORITIES", "Lane", "LaneStatistics", "Ticket"]

PRIORITIES = {"interactive": 0, "normal": 1, "background": 2}
_PASS_SCAN = 64  # waiters looked at for one that may pass a head waiting for its model
_UNPACED = contextlib.nullcontext()


@attrs.define(eq=False)
class Ticket:
    """One holder of a slot: when it queued, started and released (monotonic times)."""

    priority: str
    queued_at: float
    started_at: float | None = None
    released_at: float | None = None
    lease_expired: bool = False  # a shared lane's release never reached its server (L11)
    reservation: Reservation | None = None  # its token budgets' share (SPEC L12)
    token_wait_s: float = 0.0  # of its queue time, how long the head waited for tokens
    held_by: str | None = None  # the provider's hold that delayed it, if one did
    # A shared lane's take from its model's budgets (SPEC L12a): the budgets it took.
    model_kinds: frozenset[str] | None = None

    @property
    def queue_s(self) -> float:
        end = self.started_at if self.started_at is not None else trio.current_time()
        return end - self.queued_at


@attrs.define(eq=False)
class _Waiter:
    rank: int
    seq: int
    client: str = "default"
    tag: float = 0.0  # its turn: its virtual start in its class (SPEC L14)
    step: float = 1.0  # 1 / its client's weight: how far its start moves its client on
    event: trio.Event = attrs.field(factory=trio.Event)
    granted: bool = False
    cancelled: bool = False
    granted_at: float = 0.0  # when the slot became its own (its start, for the estimate)
    need: Need | None = None  # its token budgets' need (SPEC L12)
    probe: bool = False  # a connection check: may pass a hold
    reservation: Reservation | None = None
    token_wait_s: float = 0.0  # time it spent as a head that only waited for tokens
    head_since: float | None = None
    held_by: str | None = None

    def __lt__(self, other: _Waiter) -> bool:
        return (self.rank, self.tag, self.seq) < (other.rank, other.tag, other.seq)


class Lane:
    """The slots and queue of one provider. See the module docstring."""

    shared = False  # `relay.capacity.lane_api.LaneLike`: counted in this process alone

    def __init__(self, name: str, profile: Profile, *, expected_run_s: float = 10.0,
                 limits: Mapping[str, ModelLimits] | None = None) -> None:
        self.name = name
        self._profile = profile
        self._borrowed = 0
        self._live = 0  # waiters neither granted nor cancelled
        self._heap: list[_Waiter] = []
        self._seq = itertools.count()
        # Turns between clients (SPEC L14): per class, the virtual clock (the tag of the
        # latest start); per class and client, the client's next free turn.
        self._vtime = [0.0] * len(PRIORITIES)
        self._turns: dict[tuple[int, str], float] = {}
        # The pacer (SPEC L9): at most rpm starts in any 60 s, with the current profile's.
        self._pacer = Pacer()
        # How long a slot is held, for honest Retry-After figures: the adapter's typical
        # call time until a hold has been seen, then a running average of the holds seen
        # (the first one replaces the guess). And when each slot held now was taken.
        self._avg_run_s = expected_run_s
        self._holds_seen = 0
        self._held_since: list[float] = []
        self._idle = trio.Event()
        self._idle.set()
        # SPEC L12, L12a: the provider's token budgets and holds, the account's and each
        # model's; a change (a settlement, a header, a hold) may let the head start
        # sooner, or must make it wait longer.
        self.budget = Meter(profile, trio.current_time, limits)
        self.budget.on_change = self._budget_changed

    def _budget_changed(self) -> None:
        if self._live:
            self._hand_off()
            for waiter in self._heap:  # a hold may make a waiter with a fallback leave
                if not waiter.cancelled and not waiter.granted:
                    waiter.event.set()

    def observe(self, limits: RateLimits | None, *, scope: str = "",
                started_at: float | None = None, ok: bool = False,
                reason: str = "rate_limited", own: Reservation | None = None) -> None:
        """What an answer for model ``scope`` said of the provider's limits (SPEC L12a)."""
        self.budget.observe(limits, scope=scope, started_at=started_at, ok=ok,
                            reason=reason, own=own)

    def settle(self, ticket: Ticket, used_in: int, used_out: int) -> None:
        """Move the ticket's reservation to what the answer used (SPEC L12)."""
        self.budget.settle(ticket.reservation, used_in, used_out)

    @property
    def profile(self) -> Profile:
        return self._profile

    @property
    def _next_start(self) -> float:
        """The pacer's earliest next start (-inf when unpaced)."""
        return self._pacer.next_start(self._profile.rpm)

    def update_profile(self, profile: Profile,
                       limits: Mapping[str, ModelLimits] | None = None) -> None:
        """Apply a reloaded profile (and models' limits) in place: never revokes a running
        slot. A new rpm applies at once, to the starts of the last minute."""
        self._profile = profile
        self.budget.update_profile(profile, limits)
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
        waiting_for = None
        if self._live and self.budget.active:
            head = self._head()
            waiting_for = self.budget.waiting_for(head.need if head else None)
        return LaneStatistics(running=self._borrowed, capacity=self._profile.lanes,
                              queued=self._live, queue_max=self._profile.queue_max,
                              waiting_for=waiting_for)

    @property
    def held_here(self) -> int:
        """Slots this relay holds (all of them: the lane is this process's alone)."""
        return self._borrowed

    async def claim_check(self, interval_s: float) -> bool:
        """A local lane's interval checks are this relay's own: always run them."""
        await trio.lowlevel.checkpoint()
        return True

    def estimate_wait_s(self, priority: str = "normal", client: str = "default") -> float:
        """When a request of ``priority`` from ``client`` arriving now could expect to
        start (seconds from now; for Retry-After). See `estimate`."""
        return self.estimate(priority, client)[0]

    def estimate(self, priority: str = "normal", client: str = "default",
                 ) -> tuple[float, list[float], float, int]:
        """When a request of ``priority`` from ``client`` arriving now could expect to
        start, and what that rests on: ``(wait_s, left_s, call_s, ahead)`` — what each
        running request has left (shortest first), the expected call time, the waiters
        ahead of it.

        Each running request has left what its expected call time leaves after what it
        has run — or, once it has run longer than expected, as long again as it is over
        (a call far over the lane's average has shown it is a long one) — never more
        than its run timeout and interrupt grace allow. The expected call time is the
        lane's average hold (the adapter's typical call time until one is seen), or the
        median of what the running requests have run so far when that is longer (the
        average is stale: no request has finished, or the calls got longer). The
        ``ahead`` waiters — every waiter of a higher class, and those of its own class
        whose turn comes before the turn it would get (SPEC L14: for a client with
        nothing waiting, at most one per waiting client) — then take the slots as they
        come free, one expected call each, and the pacer lets at most rpm of those starts
        and the last minute's fall in any 60 s. (Later arrivals of a higher class, or of
        another client whose turn ties, may still go first: it is an estimate.)
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
        turn = self._turn_of(rank, client)
        ahead = sum(1 for w in self._heap if not w.cancelled and (
            w.rank < rank or (w.rank == rank and w.tag <= turn)))
        pacer = self._pacer.copy(now)  # its window, from now (a simulation's own)
        steps = min(ahead, 4096) + 1
        start = 0.0
        for _ in range(steps):
            start = max(heapq.heappop(free), pacer.next_start(prof.rpm))
            pacer.add(start)
            heapq.heappush(free, start + call)
        gap = 60.0 / prof.rpm if prof.rpm > 0 else 0.0
        start += (ahead + 1 - steps) * max(call / lanes, gap)  # a huge queue: its rate
        start = max(start, self.budget.hold_left(now))  # the provider's hold (SPEC L12)
        return max(0.0, start), left, call, ahead

    def slot(
        self, priority: str = "normal", *, client: str = "default", weight: float = 1.0,
        on_queued: Callable[[], None] | None = None,
        need: Need | None = None, leave_if_held: bool = False, probe: bool = False,
    ) -> _Slot:
        """Hold one slot for the body of the ``async with``.

        Args:
            priority: ``interactive``, ``normal`` or ``background``.
            client: who asks (SPEC L14): inside a class, clients take turns.
            weight: the client's share of the turns (a weight-2 client starts twice as
                often as a weight-1 one while both wait); positive and finite.
            on_queued: called (synchronously) when the request has to wait.
            need: its token budgets' need (SPEC L12); None: it takes no tokens.
            leave_if_held: leave at once while the provider holds every start (the
                request has a fallback to go to).
            probe: a connection check: it may pass a hold (it shows whether the limit
                has lifted).

        Raises:
            RelayError: ``provider_queue_full``, ``provider_queue_timeout``,
                ``request_too_large``; ``rate_limited`` when held (see above).
        """
        if not (weight > 0 and math.isfinite(weight)):
            raise ValueError(f"a client's weight must be positive and finite, not {weight!r}")
        return _Slot(self, priority, on_queued, need, leave_if_held, probe, client,
                     1.0 / weight)

    # --- turns between clients (SPEC L14; the module docstring) -----------------------------
    def _turn_of(self, rank: int, client: str) -> float:
        """The turn a request of ``client`` in class ``rank`` would get now."""
        return max(self._vtime[rank], self._turns.get((rank, client), -math.inf))

    def _take_turn(self, rank: int, client: str, step: float) -> float:
        """Give a request its turn (it queues or starts now); its client's next moves on."""
        turn = self._turn_of(rank, client)
        self._turns[(rank, client)] = turn + step
        if len(self._turns) > 2 * self._live + 64:  # forget clients the clock has passed
            self._turns = {key: f for key, f in self._turns.items()
                           if f > self._vtime[key[0]]}
        return turn

    def _started_turn(self, rank: int, turn: float) -> None:
        self._vtime[rank] = max(self._vtime[rank], turn)

    def _give_turn_back(self, gone: _Waiter) -> None:
        """A waiter left without starting: its client's later waiters in its class move
        up one turn each (from its turn on), so leaving costs the client no turn."""
        later = sorted((w for w in self._heap
                        if w.client == gone.client and w.rank == gone.rank
                        and w.seq > gone.seq and not w.cancelled and not w.granted),
                       key=lambda w: w.seq)
        turn = gone.tag
        for w in later:
            w.tag, turn = turn, turn + w.step
        self._turns[(gone.rank, gone.client)] = turn
        if later:
            heapq.heapify(self._heap)

    def _ready_at(self, waiter: _Waiter | None, now: float) -> float:
        """When ``waiter`` (the head) could start: the pacer, its budgets, a hold."""
        ready = self._next_start
        if waiter is not None and self.budget.active:
            waiter.need = self.budget.current(waiter.need)  # as learned while it waited
            wait = self.budget.wait_s(waiter.need, probe=waiter.probe, now=now)
            if wait > 0:
                ready = max(ready, now + wait)
        return ready

    def _head(self) -> _Waiter | None:
        while self._heap and self._heap[0].cancelled:
            heapq.heappop(self._heap)
        return self._heap[0] if self._heap else None

    def _held_error(self, priority: str, why: str, scope: str,
                    client: str = "default") -> RelayError:
        return held_error(self.name, self.budget.holder(scope), why,
                          max(1.0, self.estimate(priority, client)[0],
                              self.budget.hold_left(scope=scope)))

    def _refuse_early(self, need: Need | None, leave_if_held: bool, probe: bool,
                      priority: str, now: float, client: str) -> None:
        """Before queueing (SPEC L12): a need larger than a whole budget never starts;
        a hold goes on past the queue timeout, or the request has a fallback to go to."""
        if need is not None and (found := self.budget.too_large(need)):
            raise too_large(self.name, need, *found)
        scope = need.scope if need is not None else ""
        held = 0.0 if probe else self.budget.hold_left(now, scope)
        if held > 0 and (leave_if_held or held > self._profile.queue_timeout_s):
            raise self._held_error(priority, "it has a fallback to go to" if leave_if_held
                                   else "longer than this request may wait "
                                   f"(queue_timeout_s {self._profile.queue_timeout_s:g})",
                                   scope, client)

    def _still_held(self, waiter: _Waiter, leave_if_held: bool, deadline: float,
                    priority: str) -> None:
        """A waiter woken while the provider holds every start: noted, and it leaves
        when it has a fallback or the hold outlasts its queue timeout."""
        current = trio.current_time()
        scope = waiter.need.scope if waiter.need is not None else ""
        held = (0.0 if waiter.probe or waiter.granted
                else self.budget.hold_left(current, scope))
        if held <= 0:
            return
        hold = self.budget.holder(scope).hold_state
        if waiter.held_by is None and hold is not None:
            waiter.held_by = hold.cause
        if leave_if_held or current + held > deadline:
            raise self._held_error(priority, "it has a fallback to go to" if leave_if_held
                                   else "past this request's queue timeout", scope,
                                   waiter.client)

    async def _acquire(self, priority: str, on_queued: Callable[[], None] | None,
                       need: Need | None = None, leave_if_held: bool = False,
                       probe: bool = False, client: str = "default",
                       step: float = 1.0) -> Ticket:
        # long because a waiter's whole life reads best whole: refusals, the fast path,
        # its wake-ups (slot, pacer, budgets, holds), and the hand-back on a cancel.
        rank = PRIORITIES.get(priority)
        if rank is None:  # before any bookkeeping: a lane must not look busy after it
            raise ValueError(f"unknown priority {priority!r}; one of {', '.join(PRIORITIES)}")
        await trio.lowlevel.checkpoint_if_cancelled()
        now = trio.current_time()
        budget = self.budget if self.budget.active else None
        if budget is not None:
            self._refuse_early(need, leave_if_held, probe, priority, now, client)
        ticket = Ticket(priority=priority, queued_at=now)
        self._busy()
        if (self._borrowed < self._profile.lanes and self._live == 0
                and now >= self._next_start
                and (budget is None or budget.wait_s(need, probe=probe, now=now) == 0)):
            self._take(ticket, now)  # (a cancel point above; the schedule point is the
            self._started_turn(rank, self._take_turn(rank, client, step))
            ticket.reservation = self.budget.reserve(need) if budget else None
            return ticket            # holder's next wait: no trip through the scheduler)
        if self._live >= self._profile.queue_max:
            self._maybe_idle()
            raise self._capacity_error("provider_queue_full", priority=priority,
                                       client=client)

        waiter = _Waiter(rank, next(self._seq), client, self._take_turn(rank, client, step),
                         step, need=need, probe=probe)
        heapq.heappush(self._heap, waiter)
        self._live += 1
        deadline = now + self._profile.queue_timeout_s
        try:
            if on_queued is not None:
                on_queued()  # inside the try: if it raises, the waiter still leaves
            if self.budget.active:  # it may be the new head, and able to start now (a
                self._hand_off()    # check passing a hold; a smaller need, ahead)
            # (noqa, ASYNC912: a waiter granted before the loop runs has nothing to await.)
            with trio.move_on_at(deadline):  # noqa: ASYNC912
                while not waiter.granted:
                    # Woken by a grant, by the pacer's next start or the budgets' (the
                    # head of the queue sleeps until then when a slot is free), by a
                    # change of the budgets (a settlement, a header, a hold).
                    event = waiter.event = trio.Event()
                    current = trio.current_time()
                    wake = self._ready_at(self._head(), current)
                    with trio.move_on_at(wake) if wake > current else _UNPACED:
                        await event.wait()
                    self._still_held(waiter, leave_if_held, deadline, priority)
                    current = trio.current_time()
                    if not waiter.granted and current >= self._ready_at(self._head(),
                                                                        current):
                        self._hand_off()  # the pacer and the budgets allow a start now
        except BaseException:
            # Cancelled from outside (client gone, shutdown) or anything else. Granted in
            # the same tick? Then the slot is ours and must go back, or it leaks.
            if waiter.granted:
                self._unstart(waiter)
                self._held_since.remove(waiter.granted_at)
                self.budget.cancel(waiter.reservation)
                self._give_back()
            else:
                self._forget(waiter)
            raise
        if not waiter.granted:
            self._forget(waiter)
            waited = trio.current_time() - now
            raise (self._budget_timeout(waiter.need, waited)
                   or self._capacity_error("provider_queue_timeout", waited_s=waited,
                                           priority=priority, client=client))
        ticket.started_at = waiter.granted_at
        ticket.reservation = waiter.reservation
        ticket.token_wait_s = waiter.token_wait_s
        ticket.held_by = waiter.held_by
        return ticket

    def _take(self, ticket: Ticket, now: float) -> None:
        self._borrowed += 1
        self._held_since.append(now)
        ticket.started_at = now
        self._pacer.add(now)

    def _unstart(self, waiter: _Waiter) -> None:
        """A grant handed straight back was no start: the pacer forgets it, and its
        client keeps its turn."""
        self._pacer.remove(waiter.granted_at)
        self._give_turn_back(waiter)

    def _hand_off(self) -> None:
        """Give free slots to the first waiters, as far as the pacer and the token
        budgets allow."""
        now = trio.current_time()
        while self._borrowed < self._profile.lanes and self._live > 0:
            head = self._head()
            if head is None:
                return
            ready = self._ready_at(head, now)
            if now < ready:
                # A slot is free but the pacer or a budget says not yet: make sure the
                # head of the queue sleeps until then (it may be sleeping without a
                # deadline), so the free slot is not left idle (SPEC L9, L12).
                if ready > self._next_start and head.head_since is None:
                    head.head_since = now  # it waits for tokens, not for a slot
                head.event.set()
                passer = self._passer(head, now)
                if passer is None:
                    return
                self._heap.remove(passer)
                heapq.heapify(self._heap)
                self._grant(passer, now)
                continue
            self._grant(heapq.heappop(self._heap), now)

    def _passer(self, head: _Waiter, now: float) -> _Waiter | None:
        """A waiter of another model that may start before a head waiting only for its
        own model's budgets (SPEC L12a: one model's empty bucket does not slow the
        others): the first in queue order whose model is not waiting, and that can start
        now. A head held back by the pacer or the account's budgets is passed by nobody."""
        if now < self._next_start or not self.budget.active:
            return None
        blocked: set[str] = set()
        candidates = sorted(w for w in self._heap if not w.cancelled and not w.granted)
        for waiter in candidates[:_PASS_SCAN]:
            scope = waiter.need.scope if waiter.need is not None else ""
            if scope in blocked:
                continue
            if self._ready_at(waiter, now) <= now:
                return waiter if waiter is not head else None
            if not self.budget.waits_for_model(waiter.need, now):
                return None  # the account's budgets or a hold: nobody passes
            blocked.add(scope)
        return None

    def _grant(self, waiter: _Waiter, now: float) -> None:
        """Give ``waiter`` (taken off the queue) a slot, its reservation and a start."""
        self._borrowed += 1
        self._held_since.append(now)
        self._live -= 1
        waiter.granted = True
        waiter.granted_at = now
        self._started_turn(waiter.rank, waiter.tag)
        if waiter.head_since is not None:
            waiter.token_wait_s = now - waiter.head_since
        if self.budget.active:
            waiter.reservation = self.budget.reserve(waiter.need)
        self._pacer.add(now)
        waiter.event.set()

    def _forget(self, waiter: _Waiter) -> None:
        waiter.cancelled = True
        self._live -= 1
        self._give_turn_back(waiter)
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
        if ticket.reservation is not None and not ticket.reservation.settled:
            need = ticket.reservation.need  # nobody settled it: count it as reserved
            self.budget.settle(ticket.reservation, need.input, need.output)
        if ticket.started_at is not None:
            self._held_since.remove(ticket.started_at)
            self._holds_seen += 1
            weight = max(0.2, 1.0 / self._holds_seen)
            self._avg_run_s += weight * ((now - ticket.started_at) - self._avg_run_s)
        self._give_back()

    def _capacity_error(self, reason: str, waited_s: float | None = None,
                        priority: str = "normal", client: str = "default") -> RelayError:
        stats = self.statistics()
        wait, left, call, ahead = self.estimate(priority, client)
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


    def _budget_timeout(self, need: Need | None, waited_s: float) -> RelayError | None:
        """A queue timeout while a lane was free and a token budget was not (SPEC L12a):
        it says which budget, what it needs and what is free, and the refill time is its
        Retry-After. None: the lanes were full, or no budget held it back."""
        head = self._head()
        need = head.need if head is not None and head.need is not None else need
        stats = self.statistics()
        if need is None or not self.budget.active or stats.running >= stats.capacity:
            return None
        why = self.budget.waiting_for(need)
        if why is None:
            return None
        wait = self.budget.wait_s(need)  # (inf: until the first answer after a hold)
        refill = max(1.0, wait if math.isfinite(wait) else self.estimate()[0])
        return RelayError(
            "provider_queue_timeout", f"waited {waited_s:.0f} s for provider {self.name!r}: "
            f"{why} ({stats.running}/{stats.capacity} lanes running). This request was not "
            f"started. Retry in about {math.ceil(refill)} s, when the budget has refilled.",
            provider=self.name, retry_after_s=refill,
            action=(f"retry after the time in Retry-After; if requests often wait this "
                    f"long, check the token figures (tpm, itpm, otpm) in "
                    f"[providers.{self.name}.profile] against the provider's limits"))

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
        said += f"; at most {rpm:g} starts a minute"
    return said


class _Slot:
    """`Lane.slot`'s context manager: acquire on entry, release on exit, whatever ends the
    body. A class, not ``@asynccontextmanager``: a generator cost more than the lane."""

    __slots__ = ("_client", "_lane", "_leave", "_need", "_on_queued", "_priority", "_probe",
                 "_step", "_ticket")

    def __init__(self, lane: Lane, priority: str,
                 on_queued: Callable[[], None] | None, need: Need | None = None,
                 leave_if_held: bool = False, probe: bool = False,
                 client: str = "default", step: float = 1.0) -> None:
        self._lane, self._priority, self._on_queued = lane, priority, on_queued
        self._need, self._leave, self._probe = need, leave_if_held, probe
        self._client, self._step = client, step
        self._ticket: Ticket | None = None

    async def __aenter__(self) -> Ticket:
        self._ticket = await self._lane._acquire(self._priority, self._on_queued,
                                                 self._need, self._leave, self._probe,
                                                 self._client, self._step)
        return self._ticket

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        ticket, self._ticket = self._ticket, None
        assert ticket is not None
        self._lane._release(ticket)
