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

Accounts (SPEC L13, `relay.capacity.account`). The slots, the pacer and the budgets are
each account's (a provider without accounts has one, ``""``); the queue is the lane's
alone. The head starts on the account that can start it soonest — a free slot, its pacer,
its budgets and holds — ties going to the best fit where every account's token figures
are configured, else to the most room, free slots counted with the budgets once these are
known (`_choose`, `_fits_better`); a waiter
that names its conversation's account (``prefer``) waits for that one up to the profile's
``affinity_wait_s``, and one that names accounts that failed it (``avoid``) never starts
there. An account that is out (a refused key) is left out of the choice until it is due
again, unless every account is. A waiter held back only for reasons of its own — its
model's budgets, its conversation's account, the accounts it avoids — may be passed by one
that can start now (`_waits_for_itself`), so no slot idles while an account could start
someone.

`tests/helpers/lane_fuzz.py` checks these rules at every step of random runs (SPEC L7-L10,
the turns between clients of L14, and lanes split over two accounts).

All bookkeeping is synchronous between checkpoints, so no lock is needed.
"""
# layers: long because admission is one rule decided in one place (`Lane._hand_off`):
# slots, the priority queue, the pacer and the token budgets, each waiting the same way.

from __future__ import annotations

import contextlib
import heapq
import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType

import attrs
import trio

from relay.vocab.errors import RelayError
from relay.vocab.events import LaneStatistics
from relay.vocab.limits import RateLimits
from relay.vocab.profile import ModelLimits, Profile

from .account import Account
from .budget import Learned, Need, Reservation, held_error, too_large
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
    account: Account | None = None  # the account it runs on (SPEC L13; a local lane's)
    shared_account: str = ""  # ... on a shared lane (L11), which has no `Account` here

    @property
    def account_name(self) -> str:
        """The account's name ("" for a provider without accounts)."""
        return self.account.name if self.account is not None else self.shared_account

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
    # SPEC L13: the account that served its conversation last (it waits for it up to
    # the profile's affinity_wait_s from ``since``), the accounts it must not use (they
    # failed it), and the account it was granted.
    prefer: str | None = None
    avoid: frozenset[str] = frozenset()
    since: float = 0.0
    account: Account | None = None

    def __lt__(self, other: _Waiter) -> bool:
        return (self.rank, self.tag, self.seq) < (other.rank, other.tag, other.seq)



def _fits_better(here: tuple[float, float, float], best: tuple[float, float, float],
                 fit: bool) -> bool:
    """Of two accounts that can start a request as soon, whether ``here`` (its
    `Account.headroom`) is the better choice. With ``fit`` (every account's token figures
    configured: relay's count of them is its own) and both budgets known, the one it
    leaves fuller (best fit: the other keeps its room whole for a large request, where an
    even spread leaves two halves too small for it); else the most room (work spreads: a
    bucket learned from headers is run to its edge on one account less often)."""
    if fit and here[0] < 1.0 and best[0] < 1.0 and here[0] != best[0]:
        return here[0] < best[0]
    return _room(here) > _room(best)


def _room(headroom: tuple[float, float, float]) -> tuple[float, float, float]:
    """`Account.headroom` for an even spread: once its budgets are known, the scarcer of
    their share left and its free slots' (an account whose slots are nearly all taken
    by small requests has no room for a large one that only its budgets could hold)."""
    budgets, tokens, slots = headroom
    return (min(budgets, slots) if budgets < 1.0 else budgets, tokens, slots)


class Lane:
    """The slots and queue of one provider. See the module docstring."""

    shared = False  # `relay.capacity.lane_api.LaneLike`: counted in this process alone

    def __init__(self, name: str, profile: Profile, *, expected_run_s: float = 10.0,
                 limits: Mapping[str, ModelLimits] | None = None,
                 accounts: Sequence[tuple[str, Profile]] = ()) -> None:
        self.name = name
        self._profile = profile
        self._borrowed = 0  # slots held now, every account's
        self._live = 0  # waiters neither granted nor cancelled
        self._heap: list[_Waiter] = []
        self._seq = itertools.count()
        # Turns between clients (SPEC L14): per class, the virtual clock (the tag of the
        # latest start); per class and client, the client's next free turn.
        self._vtime = [0.0] * len(PRIORITIES)
        self._turns: dict[tuple[int, str], float] = {}
        # How long a slot is held, for honest Retry-After figures: the adapter's typical
        # call time until a hold has been seen, then a running average of the holds seen
        # (the first one replaces the guess). And when each slot held now was taken.
        self._avg_run_s = expected_run_s
        self._holds_seen = 0
        self._held_since: list[float] = []
        self._idle = trio.Event()
        self._idle.set()
        # SPEC L13: the accounts, each with its slots, pacer (SPEC L9) and budgets (SPEC
        # L12, L12a: the account's and each model's); a change of a budget (a settlement,
        # a header, a hold) may let the head start sooner, or must make it wait longer.
        self._limits = limits
        self._learned = Learned()  # how long each model answers: one for every account
        self.accounts: list[Account] = []
        self._capacity = 0
        self._set_accounts(accounts or [("", profile)])

    def _set_accounts(self, accounts: Sequence[tuple[str, Profile]]) -> None:
        """The accounts as configured now: a kept one (by name) keeps its pacer, budgets
        and state; a removed one's running requests still give their slots back."""
        kept = {a.name: a for a in self.accounts}
        fresh: list[Account] = []
        for name, profile in accounts:
            account = kept.get(name)
            if account is None:
                account = Account(name, profile, trio.current_time, self._limits,
                                  self._learned)
                account.meter.on_change = self._budget_changed
            else:
                account.profile = profile
                account.meter.update_profile(profile, self._limits)
            fresh.append(account)
        self.accounts = fresh
        self._capacity = sum(a.profile.lanes for a in fresh)

    @property
    def budget(self) -> Meter:
        """The (first) account's budgets: a provider without accounts has one."""
        return self.accounts[0].meter

    def account(self, name: str) -> Account | None:
        return next((a for a in self.accounts if a.name == name), None)

    def _budget_changed(self) -> None:
        if self._live:
            self._hand_off()
            for waiter in self._heap:  # a hold may make a waiter with a fallback leave
                if not waiter.cancelled and not waiter.granted:
                    waiter.event.set()

    def observe(self, limits: RateLimits | None, *, scope: str = "",
                started_at: float | None = None, ok: bool = False,
                reason: str = "rate_limited", own: Reservation | None = None,
                account: Account | None = None) -> None:
        """What an answer for model ``scope`` said of the limits of the account it ran on
        (SPEC L12a, L13)."""
        meter = account.meter if account is not None else self.budget
        meter.observe(limits, scope=scope, started_at=started_at, ok=ok, reason=reason,
                      own=own)

    def settle(self, ticket: Ticket, used_in: int, used_out: int) -> None:
        """Move the ticket's reservation to what the answer used (SPEC L12)."""
        meter = ticket.account.meter if ticket.account is not None else self.budget
        meter.settle(ticket.reservation, used_in, used_out)

    def account_failed(self, account: Account, reason: str, message: str) -> None:
        """Its key was refused, its server did not answer (SPEC L13): it leaves the
        choice a while, and the waiters choose again."""
        account.failed(reason, message, trio.current_time())
        self._budget_changed()

    def account_answered(self, account: Account) -> None:
        if account.out_reason is not None:
            account.answered()
            self._budget_changed()
        else:
            account.failures = 0

    def others(self, avoid: frozenset[str]) -> list[Account]:
        """The accounts a request that failed on ``avoid`` may still move to: those in
        the choice now (one that is out would fail it again)."""
        now = trio.current_time()
        return [a for a in self.accounts if a.name not in avoid and a.usable(now)]

    @property
    def profile(self) -> Profile:
        return self._profile

    def update_profile(self, profile: Profile,
                       limits: Mapping[str, ModelLimits] | None = None,
                       accounts: Sequence[tuple[str, Profile]] | None = None) -> None:
        """Apply a reloaded profile (and models' limits, and accounts) in place: never
        revokes a running slot. A new rpm applies at once, to the starts of the last
        minute."""
        if limits is not None:
            self._limits = limits
        if accounts is None:  # (a provider without accounts: its profile is its one's)
            accounts = ([("", profile)] if len(self.accounts) == 1
                        and not self.accounts[0].name
                        else [(a.name, a.profile) for a in self.accounts])
        self._profile = profile
        self._set_accounts(accounts)
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
        head = self._head() if self._live else None
        if head is not None:
            account, _ = self._choose(head, trio.current_time())
            if account is not None:
                waiting_for = account.meter.waiting_for(head.need)
        return LaneStatistics(running=self._borrowed, capacity=self._capacity,
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
        lanes = max(1, self._capacity)
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
        # The pacer: the one account's window, from now (a simulation's own); several
        # accounts pace at their rates' sum, from a fresh window (an estimate).
        rpm = sum(a.profile.rpm for a in self.accounts)
        if any(a.profile.rpm <= 0 for a in self.accounts):
            rpm = 0.0
        pacer = (self.accounts[0].pacer.copy(now) if len(self.accounts) == 1
                 else Pacer())
        steps = min(ahead, 4096) + 1
        start = 0.0
        for _ in range(steps):
            start = max(heapq.heappop(free), pacer.next_start(rpm))
            pacer.add(start)
            heapq.heappush(free, start + call)
        gap = 60.0 / rpm if rpm > 0 else 0.0
        start += (ahead + 1 - steps) * max(call / lanes, gap)  # a huge queue: its rate
        start = max(start, self.hold_left(now))  # the provider's hold (SPEC L12)
        return max(0.0, start), left, call, ahead

    def slot(
        self, priority: str = "normal", *, client: str = "default", weight: float = 1.0,
        on_queued: Callable[[], None] | None = None,
        need: Need | None = None, leave_if_held: bool = False, probe: bool = False,
        prefer: str | None = None, avoid: frozenset[str] = frozenset(),
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
                has lifted) and use an account that is out.
            prefer: the account that served its conversation last (SPEC L13): it waits
                for it up to the profile's ``affinity_wait_s``.
            avoid: accounts it must not use (they failed it: SPEC L13).

        Raises:
            RelayError: ``provider_queue_full``, ``provider_queue_timeout``,
                ``request_too_large``; ``rate_limited`` when held (see above).
        """
        if not (weight > 0 and math.isfinite(weight)):
            raise ValueError(f"a client's weight must be positive and finite, not {weight!r}")
        return _Slot(self, priority, on_queued, need, leave_if_held, probe, client,
                     1.0 / weight, prefer, avoid)

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

    # --- the choice of an account (SPEC L13; relay.capacity.account) ------------------------
    def _choose(self, waiter: _Waiter, now: float) -> tuple[Account | None, float]:
        """The account ``waiter`` would start on, and when (inf: none has a slot for it
        now): the one that can start it soonest (its slot, pacer, budgets, holds), ties
        to the best fit (`_fits_better`); its conversation's account while that one can start it
        within ``affinity_wait_s`` of its arrival. Accounts that are out are left out,
        unless every one it may use is."""
        if waiter.need is not None:  # as the estimate says it now (learned while queued)
            waiter.need = waiter.need.current()
        accounts = self.accounts
        if len(accounts) == 1 and not waiter.avoid:  # (the common case, kept cheap)
            one = accounts[0]
            return one, one.ready_at(waiter.need, now, waiter.probe, out_too=True)
        left = [a for a in accounts if a.name not in waiter.avoid]
        everyone_out = not any(a.usable(now) for a in left)
        best: Account | None = None
        best_at, room = math.inf, (0.0, 0.0, 0.0)
        preferred = None
        fit = all(a.profile.itpm or a.profile.tpm for a in left)  # (`_fits_better`)
        for account in left:
            at = account.ready_at(waiter.need, now, waiter.probe, everyone_out)
            if account.name == waiter.prefer:
                preferred = (account, at)
            if at > best_at or at == math.inf:
                continue
            here = account.headroom(waiter.need, now)
            if best is None or at < best_at or _fits_better(here, room, fit):
                best, best_at, room = account, at, here
        if preferred is not None and len(left) > 1:
            account, at = preferred
            until = waiter.since + self._profile.affinity_wait_s
            if at <= now:
                return account, at
            scope = waiter.need.scope if waiter.need is not None else None
            if (now < until and account.usable(now, waiter.probe, everyone_out)
                    and now + account.meter.hold_left(now, scope) < until):
                return account, min(at, until)  # it waits for its conversation's account
        if best is None:  # no account it may use has a free slot now
            return None, math.inf
        return best, best_at

    def _ready_at(self, waiter: _Waiter | None, now: float) -> float:
        """When ``waiter`` (the head) could start: a slot, the pacer, budgets, holds."""
        if waiter is None:
            return math.inf
        return self._choose(waiter, now)[1]

    def _waits_for_itself(self, waiter: _Waiter, now: float) -> bool:
        """A free account, its pacer ready, that ``waiter`` cannot start on for reasons
        of its own — its model's budgets (SPEC L12a), its conversation's account (L13),
        an account that failed it — so another waiter may start there before it. What
        holds an account back for everyone (its budgets, a hold, the pacer) is passed by
        nobody."""
        if waiter.prefer is not None and now < waiter.since + self._profile.affinity_wait_s:
            chosen = self._choose(waiter, now)[0]
            if chosen is not None and chosen.name == waiter.prefer:
                return True
        for account in self.accounts:
            if (not account.free or not account.usable(now, waiter.probe)
                    or account.next_start() > now):
                continue
            if account.name in waiter.avoid:
                return True
            if account.meter.waits_for_model(waiter.need, now):
                return True
        return False

    def _in_choice(self, now: float) -> list[Account]:
        """The accounts not out (all of them, when every one is)."""
        return [a for a in self.accounts if a.usable(now)] or self.accounts

    def hold_left(self, now: float | None = None, scope: str | None = None) -> float:
        """How long the provider holds every start of ``scope``: the shortest hold of its
        accounts in the choice (SPEC L12, L13)."""
        now = trio.current_time() if now is None else now
        return min(a.meter.hold_left(now, scope) for a in self._in_choice(now))

    def _holder(self, scope: str | None, now: float) -> Meter:
        return min(self._in_choice(now), key=lambda a: a.meter.hold_left(now, scope)).meter

    def _head(self) -> _Waiter | None:
        while self._heap and self._heap[0].cancelled:
            heapq.heappop(self._heap)
        return self._heap[0] if self._heap else None

    def _held_error(self, priority: str, why: str, scope: str,
                    client: str = "default") -> RelayError:
        now = trio.current_time()
        return held_error(self.name, self._holder(scope, now).holder(scope), why,
                          max(1.0, self.estimate(priority, client)[0],
                              self.hold_left(now, scope)))

    def _refuse_early(self, need: Need | None, leave_if_held: bool, probe: bool,
                      priority: str, now: float, client: str,
                      avoid: frozenset[str]) -> None:
        """Before queueing (SPEC L12): a need larger than a whole budget (of every
        account) never starts; a hold goes on past the queue timeout, or the request has
        a fallback to go to."""
        if need is not None:
            found = [a.meter.too_large(need) for a in self.accounts if a.name not in avoid]
            if found and all(found):
                raise too_large(self.name, need, *found[0])  # type: ignore[misc]
        scope = need.scope if need is not None else ""
        held = 0.0 if probe else self.hold_left(now, scope)
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
                else self.hold_left(current, scope))
        if held <= 0:
            return
        hold = self._holder(scope, current).holder(scope).hold_state
        if waiter.held_by is None and hold is not None:
            waiter.held_by = hold.cause
        if leave_if_held or current + held > deadline:
            raise self._held_error(priority, "it has a fallback to go to" if leave_if_held
                                   else "past this request's queue timeout", scope,
                                   waiter.client)

    async def _acquire(self, priority: str, on_queued: Callable[[], None] | None,
                       need: Need | None = None, leave_if_held: bool = False,
                       probe: bool = False, client: str = "default",
                       step: float = 1.0, prefer: str | None = None,
                       avoid: frozenset[str] = frozenset()) -> Ticket:
        # long because a waiter's whole life reads best whole: refusals, the fast path,
        # its wake-ups (slot, pacer, budgets, holds), and the hand-back on a cancel.
        rank = PRIORITIES.get(priority)
        if rank is None:  # before any bookkeeping: a lane must not look busy after it
            raise ValueError(f"unknown priority {priority!r}; one of {', '.join(PRIORITIES)}")
        await trio.lowlevel.checkpoint_if_cancelled()
        now = trio.current_time()
        self._refuse_early(need, leave_if_held, probe, priority, now, client, avoid)
        ticket = Ticket(priority=priority, queued_at=now)
        self._busy()
        waiter: _Waiter | None = None
        if self._borrowed < self._capacity and self._live == 0:
            if len(self.accounts) == 1 and not avoid:  # (the common case: no waiter made)
                account: Account | None = self.accounts[0]
                ready = self.accounts[0].ready_at(need, now, probe, out_too=True)
            else:
                waiter = self._waiter(rank, client, step, need, probe, prefer, avoid, now)
                account, ready = self._choose(waiter, now)
            if account is not None and now >= ready:
                self._take(ticket, now, account, need)  # (a cancel point above; the
                self._started_turn(rank, self._take_turn(rank, client, step))  # schedule
                ticket.reservation = account.meter.reserve(need)  # point is the holder's
                return ticket                 # next wait: no trip through the scheduler)
        if self._live >= self._profile.queue_max:
            self._maybe_idle()
            raise self._capacity_error("provider_queue_full", priority=priority,
                                       client=client)

        if waiter is None:
            waiter = self._waiter(rank, client, step, need, probe, prefer, avoid, now)
        waiter.tag = self._take_turn(rank, client, step)
        heapq.heappush(self._heap, waiter)
        self._live += 1
        deadline = now + self._profile.queue_timeout_s
        try:
            if on_queued is not None:
                on_queued()  # inside the try: if it raises, the waiter still leaves
            self._hand_off()  # it may be the new head, and able to start now (a check
            # passing a hold; a smaller need, ahead)
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
                account = waiter.account
                assert account is not None
                self._unstart(waiter)
                self._held_since.remove(waiter.granted_at)
                account.meter.cancel(waiter.reservation)
                self._give_back(account)
            else:
                self._forget(waiter)
            raise
        if not waiter.granted:
            self._forget(waiter)
            waited = trio.current_time() - now
            raise (self._budget_timeout(waiter, waited)
                   or self._capacity_error("provider_queue_timeout", waited_s=waited,
                                           priority=priority, client=client))
        ticket.started_at = waiter.granted_at
        ticket.reservation = waiter.reservation
        ticket.token_wait_s = waiter.token_wait_s
        ticket.held_by = waiter.held_by
        ticket.account = waiter.account
        return ticket

    def _waiter(self, rank: int, client: str, step: float, need: Need | None, probe: bool,
                prefer: str | None, avoid: frozenset[str], now: float) -> _Waiter:
        return _Waiter(rank, next(self._seq), client, 0.0, step, need=need, probe=probe,
                       prefer=prefer if len(self.accounts) > 1 else None, avoid=avoid,
                       since=now)

    def _start_on(self, account: Account, need: Need | None, now: float) -> None:
        """A start on ``account``: its slot, its pacer, the lane's count of slots held."""
        self._borrowed += 1
        account.borrowed += 1
        account.took(need, now)
        account.pacer.add(now)
        self._held_since.append(now)

    def _take(self, ticket: Ticket, now: float, account: Account,
              need: Need | None) -> None:
        self._start_on(account, need, now)
        ticket.started_at = now
        ticket.account = account

    def _unstart(self, waiter: _Waiter) -> None:
        """A grant handed straight back was no start: the pacer forgets it, and its
        client keeps its turn."""
        assert waiter.account is not None
        waiter.account.pacer.remove(waiter.granted_at)
        waiter.account.untook(waiter.need, waiter.granted_at)
        self._give_turn_back(waiter)

    def _hand_off(self) -> None:
        """Give free slots to the first waiters, as far as the pacer and the token
        budgets allow."""
        now = trio.current_time()
        while self._borrowed < self._capacity and self._live > 0:
            head = self._head()
            if head is None:
                return
            account, ready = self._choose(head, now)
            if account is None or now < ready:
                # A slot is free but the pacer or a budget says not yet: make sure the
                # head of the queue sleeps until then (it may be sleeping without a
                # deadline), so the free slot is not left idle (SPEC L9, L12).
                if (account is not None and account.free and ready > account.next_start()
                        and head.head_since is None):
                    head.head_since = now  # it waits for tokens, not for a slot
                head.event.set()
                found = self._passer(head, now)
                if found is None:
                    return
                passer, account = found
                self._heap.remove(passer)
                heapq.heapify(self._heap)
                self._grant(passer, now, account)
                continue
            self._grant(heapq.heappop(self._heap), now, account)

    def _passer(self, head: _Waiter, now: float) -> tuple[_Waiter, Account] | None:
        """A waiter that may start before a head that waits for reasons of its own
        (`_waits_for_itself`: its model's budgets, SPEC L12a — one model's empty bucket
        does not slow the others; its conversation's account, L13): the first in queue
        order that can start now and whose model is not itself waiting. A head held back
        by the pacer or an account's budgets is passed by nobody."""
        if not self._waits_for_itself(head, now):
            return None
        blocked: set[str] = set()
        candidates = sorted(w for w in self._heap if not w.cancelled and not w.granted)
        for waiter in candidates[:_PASS_SCAN]:
            if waiter is head:
                continue
            scope = waiter.need.scope if waiter.need is not None else ""
            if scope in blocked:
                continue
            account, ready = self._choose(waiter, now)
            if account is not None and ready <= now:
                return waiter, account
            if not self._waits_for_itself(waiter, now):
                return None  # the account's budgets or a hold: nobody passes
            if waiter.prefer is None and not waiter.avoid:
                blocked.add(scope)
        return None

    def _grant(self, waiter: _Waiter, now: float, account: Account) -> None:
        """Give ``waiter`` (taken off the queue) a slot of ``account``, its reservation
        and a start."""
        self._start_on(account, waiter.need, now)
        self._live -= 1
        waiter.granted = True
        waiter.granted_at = now
        waiter.account = account
        self._started_turn(waiter.rank, waiter.tag)
        if waiter.head_since is not None:
            waiter.token_wait_s = now - waiter.head_since
        waiter.reservation = account.meter.reserve(waiter.need)
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

    def _give_back(self, account: Account) -> None:
        self._borrowed -= 1
        account.borrowed -= 1
        self._hand_off()
        self._maybe_idle()

    def _release(self, ticket: Ticket) -> None:
        now = trio.current_time()
        ticket.released_at = now
        account = ticket.account
        assert account is not None
        if ticket.reservation is not None and not ticket.reservation.settled:
            need = ticket.reservation.need  # nobody settled it: count it as reserved
            account.meter.settle(ticket.reservation, need.input, need.output)
        if ticket.started_at is not None:
            self._held_since.remove(ticket.started_at)
            self._holds_seen += 1
            weight = max(0.2, 1.0 / self._holds_seen)
            self._avg_run_s += weight * ((now - ticket.started_at) - self._avg_run_s)
        self._give_back(account)

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


    def _budget_timeout(self, waiter: _Waiter, waited_s: float) -> RelayError | None:
        """A queue timeout while a lane was free and a token budget was not (SPEC L12a):
        it says which budget, what it needs and what is free, and the refill time is its
        Retry-After; with several accounts, what held each one (SPEC L13). None: the
        lanes were full, or no budget held it back."""
        head = self._head()
        subject = head if head is not None and head.need is not None else waiter
        need = subject.need
        now = trio.current_time()
        stats = self.statistics()
        if need is None or stats.running >= stats.capacity:
            return None
        account, _ = self._choose(subject, now)
        if account is None:
            return None
        why = account.meter.waiting_for(need)
        if why is None:
            return None
        wait = account.meter.wait_s(need)  # (inf: until the first answer after a hold)
        refill = max(1.0, wait if math.isfinite(wait) else self.estimate()[0])
        if len(self.accounts) > 1:
            why = "; ".join(f"account {a.name!r}: {a.why_not(need, now)}"
                            for a in self.accounts)
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

    __slots__ = ("_avoid", "_client", "_lane", "_leave", "_need", "_on_queued", "_prefer",
                 "_priority", "_probe", "_step", "_ticket")

    def __init__(self, lane: Lane, priority: str,
                 on_queued: Callable[[], None] | None, need: Need | None = None,
                 leave_if_held: bool = False, probe: bool = False,
                 client: str = "default", step: float = 1.0, prefer: str | None = None,
                 avoid: frozenset[str] = frozenset()) -> None:
        self._lane, self._priority, self._on_queued = lane, priority, on_queued
        self._need, self._leave, self._probe = need, leave_if_held, probe
        self._client, self._step = client, step
        self._prefer, self._avoid = prefer, avoid
        self._ticket: Ticket | None = None

    async def __aenter__(self) -> Ticket:
        self._ticket = await self._lane._acquire(self._priority, self._on_queued,
                                                 self._need, self._leave, self._probe,
                                                 self._client, self._step, self._prefer,
                                                 self._avoid)
        return self._ticket

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        ticket, self._ticket = self._ticket, None
        assert ticket is not None
        self._lane._release(ticket)
