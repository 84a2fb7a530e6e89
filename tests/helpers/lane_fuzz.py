"""A randomized lane fuzz on virtual time (SPEC L6-L10): the engine.

Theory of operation. One seed makes one run: a random profile, random arrivals (each with
a priority, a run time and sometimes a client that leaves after a while), random profile
reloads (`update_profile`: lanes, queue_max, queue_timeout_s, rpm), and two same-tick
races on purpose: a holder that, as it gives its slot back, cancels the waiter about to be
granted it (just before or just after the release), and a holder that makes a new request
arrive in the very tick it releases. Times are drawn on a 0.5 s grid in half the seeds, so
queue timeouts, pacer starts and releases often fall in one tick.

Everything runs on a `trio.testing.MockClock` that jumps to the next deadline. A checker
task wakes at every virtual instant at which anything happens, waits until every other
task is blocked (the state is settled for that instant) and checks:

- ``idle``: a free slot never idles while someone waits and the pacer allows a start (the
  pacer as SPEC L9 defines it: fewer than rpm starts in the last 60 s; `window`) — and, with token
  budgets (``tokens=True``, SPEC L12), while the budget has room for the head's need;
- ``leak``: the lane's running/queued equal the clients inside a slot / waiting (a grant
  that races a cancel leaks no slot, a waiter that left is not counted);
- ``overdue``: no one waits past their queue timeout;
- ``wait_idle``: while nothing runs or waits, no `wait_idle()` caller is still blocked.

And at each event:

- ``capacity``: a start never makes running exceed the lanes;
- ``pacer``: no 60 s ever hold more than rpm starts (`window`);
- ``budget`` (``tokens=True``): a start never takes more input tokens than the fuzz's own
  model of the bucket holds (``itpm``, refilled continuously, settled when each request
  ends to a random use of what it reserved);
- ``queue_max``: a request is queued only while fewer than queue_max wait, and refused
  with ``provider_queue_full`` only when queue_max already wait;
- ``timeout``: ``provider_queue_timeout`` comes exactly ``queue_timeout_s`` after arrival;
- ``wait_idle``: when `wait_idle()` returns, nothing runs or waits;
- ``order`` (checked at the end, over the whole history): no request starts while another
  one that waits since an earlier instant has a better key and starts or leaves only
  later — a better class, or the same class, the same client and an earlier arrival:
  priority order, each client's requests in their order (FIFO within a class when there
  is one client), no barging;
- ``turns`` (``clients=True``, SPEC L14; checked at the end, over the history of events in
  their order): requests come from a few clients with weights (one of them sends bursts);
  whenever two clients both have waiters of one class, the starts of that class each
  makes while both wait stay within weighted round robin's bound, ``|n_k / w_k - n_j /
  w_j| <= 1 / w_k + 1 / w_j`` (start-time fair queueing's: one turn of each, whatever
  the bursts, the leaving waiters and the grants handed back) — the rule that "a
  client's burst never delays another client's one request by more than one start per
  waiting client" rests on;
- ``end``: 0 running and 0 queued at the end, and `wait_idle()` returns.

Real time (``slack`` > 0, `run_seed_real_time`): for lanes whose state lives elsewhere
(a shared lane, SPEC L11: every step is a round trip to the coordination server), the
same run plays in real time, its durations scaled by ``scale``, and the checker samples
every ``slack / 4`` s instead of stepping through instants. Then a rule holds within
``slack``: a free slot may idle while someone waits for at most ``slack`` (the hand-off
latency), timeouts come within ``slack``, no window shortened by ``slack`` holds more
than rpm starts,
FIFO within a class is judged between arrivals more than ``slack`` apart; the lanes'
numbers are only compared with the model at the end (they are the server's, as of the
last reply), and the ``queue_max`` rules are left to the assembled tests.

The interface is a factory: an async context manager that, given a profile, yields the
lane object(s) under test. Several objects must share one state (a shared lane, SPEC L11:
one per relay); arrivals go to a random one, reloads to all. A lane object offers
``slot(priority, on_queued=...)``, ``statistics()`` (running, capacity, queued,
queue_max — global numbers for a shared lane), ``update_profile(profile)`` and
``wait_idle()``. ``on_queued`` must be called synchronously when the request joins the
queue (the fuzz reads a request's arrival order from it). The engine drives virtual time,
so a shared implementation must run against an in-process store.

Used by ``tests/capacity/test_lane_fuzz.py`` (a fixed set of seeds) and
``python -m bench.lane_fuzz`` (the long form).
"""

from __future__ import annotations

import functools
import math
import random
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any, Protocol

import attrs
import trio
import trio.lowlevel
import trio.testing

from relay.capacity.budget import Need, edge_want
from relay.capacity.lanes import PRIORITIES, Lane
from relay.vocab.errors import RelayError
from relay.vocab.profile import Profile

__all__ = ["KINDS", "MUTANTS", "FuzzReport", "LaneFactory", "LaneUnderTest", "Violation",
           "fuzz_lanes", "local_lane", "run_seed", "run_seed_real_time"]

EPS = 1e-9
KINDS = ("idle", "leak", "overdue", "wait_idle", "capacity", "pacer", "queue_max",
         "timeout", "order", "error", "end", "budget", "turns")


class _Stats(Protocol):
    @property
    def running(self) -> int: ...
    @property
    def capacity(self) -> int: ...
    @property
    def queued(self) -> int: ...
    @property
    def queue_max(self) -> int: ...


class LaneUnderTest(Protocol):
    def slot(self, priority: str = ..., *,
             on_queued: Callable[[], None] | None = ...) -> AbstractAsyncContextManager[Any]: ...
    def statistics(self) -> _Stats: ...
    def update_profile(self, profile: Profile) -> None: ...
    async def wait_idle(self) -> None: ...


LaneFactory = Callable[[Profile], AbstractAsyncContextManager[Sequence[LaneUnderTest]]]


@asynccontextmanager
async def local_lane(profile: Profile) -> AsyncIterator[Sequence[LaneUnderTest]]:
    """The factory for relay's own (one-process) lane."""
    yield [Lane("fuzz", profile)]


def _split(profile: Profile) -> list[tuple[str, Profile]]:
    """SPEC L13: the profile's lanes over two accounts, where the fuzz's model of the
    lane still holds (no pacer, no token budget: those are each account's own, and the
    model knows one); else one account. A reload may so add or remove account b."""
    if profile.lanes < 2 or profile.rpm or profile.itpm or profile.tpm or profile.otpm:
        return [("a", profile)]
    half = profile.lanes // 2
    return [("a", attrs.evolve(profile, lanes=profile.lanes - half)),
            ("b", attrs.evolve(profile, lanes=half))]


class _Accounts(Lane):
    """relay's lane with its slots over accounts (SPEC L13), as `_split` says."""

    def __init__(self, name: str, profile: Profile) -> None:
        super().__init__(name, profile, accounts=_split(profile))

    def update_profile(self, profile: Profile, limits: Any = None,
                       accounts: Any = None) -> None:
        super().update_profile(profile, limits, _split(profile))


@asynccontextmanager
async def accounts_lane(profile: Profile) -> AsyncIterator[Sequence[LaneUnderTest]]:
    """The factory for relay's lane over two accounts (one while paced or budgeted)."""
    yield [_Accounts("fuzz", profile)]


# --- bugs this fuzz found, put back, to show it still sees them -----------------------------

class _ForgetsToHandOff(Lane):
    """Bug 1: a waiter that leaves does not hand off again (a paced free slot idles)."""

    def _forget(self, waiter: Any) -> None:
        waiter.cancelled = True
        self._live -= 1
        self._maybe_idle()


class _CountsHandedBackGrants(Lane):
    """A grant cancelled in its own tick still counts as a start for the pacer."""

    def _unstart(self, waiter: Any) -> None:
        pass


class _IgnoresClients(Lane):
    """No turns: every client's request gets the same turn (FIFO within a class)."""

    def _take_turn(self, rank: int, client: str, step: float) -> float:
        return 0.0


class _KeepsTheTurnOfALeaver(Lane):
    """A waiter that leaves keeps its turn: its client falls behind (SPEC L14)."""

    def _give_turn_back(self, gone: Any) -> None:
        pass


class _ReturnsIdleTooEarly(Lane):
    """`wait_idle` checkpoints after its check, so it may return while busy."""

    async def wait_idle(self) -> None:
        while not (self._borrowed == 0 and self._live == 0):
            await self._idle.wait()
        await trio.lowlevel.checkpoint()


def _mutant(cls: type[Lane]) -> LaneFactory:
    @asynccontextmanager
    async def factory(profile: Profile) -> AsyncIterator[Sequence[LaneUnderTest]]:
        yield [cls("fuzz", profile)]
    return factory


MUTANTS: dict[str, LaneFactory] = {
    "forget-no-hand-off": _mutant(_ForgetsToHandOff),
    "handed-back-grant-paced": _mutant(_CountsHandedBackGrants),
    "wait-idle-early": _mutant(_ReturnsIdleTooEarly),
    "no-turns": _mutant(_IgnoresClients),
    "leaver-keeps-turn": _mutant(_KeepsTheTurnOfALeaver),
}


@attrs.frozen
class Violation:
    seed: int
    at: float
    kind: str
    detail: str

    def __str__(self) -> str:
        return f"seed {self.seed} t={self.at:g} {self.kind}: {self.detail}"


@attrs.define
class FuzzReport:
    seed: int
    profile: str = ""
    violations: list[Violation] = attrs.field(factory=list)
    counts: dict[str, int] = attrs.field(factory=dict)

    def count(self, key: str, n: int = 1) -> None:
        self.counts[key] = self.counts.get(key, 0) + n


@attrs.define(eq=False)
class _Client:
    n: int
    priority: str
    lane: int
    run_s: float
    patience_s: float | None
    arrived_at: float = math.nan
    timeout_s: float = math.nan
    order: int | None = None          # arrival order, from on_queued (or at a direct start)
    queued_at: float | None = None
    started_at: float | None = None
    ended_at: float | None = None
    left_at: float | None = None      # left without a slot: refused, timed out, cancelled
    outcome: str = "new"
    stats_before: Any = None
    scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    tokens: int = 0  # its input tokens (with token budgets)
    who: str = "default"  # its client (SPEC L14), and the client's weight
    weight: float = 1.0
    was_queued: bool = False  # on_queued was called

    @property
    def waiting(self) -> bool:
        return self.queued_at is not None and self.started_at is None and self.left_at is None

    @property
    def running(self) -> bool:
        return self.started_at is not None and self.ended_at is None

    def key(self) -> tuple[int, int]:
        assert self.order is not None
        return (PRIORITIES[self.priority], self.order)

    def goes_before(self, other: _Client) -> bool:
        """A better class, or the same class and client and an earlier arrival."""
        if self.priority != other.priority:
            return PRIORITIES[self.priority] < PRIORITIES[other.priority]
        return self.who == other.who and self.key() < other.key()


def window(rpm: float) -> tuple[int, float]:
    """SPEC L9's pacer, as the fuzz reads it: at most ``n`` starts in any ``span`` s —
    ``rpm`` in 60 s, and a fraction read as its rate (``n = max(1, floor(rpm))``)."""
    n = max(1, math.floor(rpm))
    return n, 60.0 * n / rpm


def _profile_str(p: Profile) -> str:
    return (f"lanes={p.lanes} queue_max={p.queue_max} queue_timeout_s={p.queue_timeout_s:g} "
            f"rpm={p.rpm:g}")


class _Fuzz:
    def __init__(self, lanes: Sequence[LaneUnderTest], profile: Profile, seed: int,
                 rng: random.Random, report: FuzzReport, grid: float | None,
                 slack: float = 0.0, scale: float = 1.0, clients: bool = False) -> None:
        self.real_time = slack > 0
        # SPEC L14: requests from a few clients (name -> weight), and the history of
        # queue events in their order: ("q" | "s" | "l", request).
        self.weights = {"a": 1.0, "b": 1.0, "c": 2.0, "d": 0.5} if clients else {}
        self.events: list[tuple[str, _Client]] = []
        self.eps = max(EPS, slack)
        self.scale = scale
        self.idle_since: float | None = None
        self.watchers_since: float | None = None
        self.lanes = lanes
        self.profile = profile
        self.seed = seed
        self.rng = rng
        self.report = report
        self.grid = grid
        self.clients: list[_Client] = []
        self.spawned = 0
        self.order = 0
        self.starts: list[float] = []  # when each request started
        self.idle_watchers = 0
        # A reload in the same tick as a grant decided before it: that start may still
        # follow the profile before the reload.
        self.reloaded_at = -math.inf
        self.before_reload = profile
        self.idle_episode = False
        self.seen_overdue: set[int] = set()
        # SPEC L12 (``tokens``): the fuzz's own model of the input bucket.
        self.itpm = profile.itpm
        self.level, self.level_at = profile.itpm, 0.0

    # --- helpers --------------------------------------------------------------------------
    def fail(self, kind: str, detail: str) -> None:
        self.report.violations.append(Violation(self.seed, trio.current_time(), kind, detail))

    def draw(self, low: float, high: float) -> float:
        x = self.rng.uniform(low, high)
        if self.grid is not None:
            x = max(self.grid, round(x / self.grid) * self.grid)
        return x

    def waiting(self) -> list[_Client]:
        return [c for c in self.clients if c.waiting]

    def running(self) -> list[_Client]:
        return [c for c in self.clients if c.running]

    def in_window(self, rpm: float, now: float, shorter: float = 0.0) -> tuple[int, int]:
        """``(starts, n)``: the starts in the window that ends ``now`` (``shorter`` by
        that much), and how many the pacer allows in it."""
        n, span = window(rpm)
        return sum(1 for t in self.starts if t > now - span + shorter), n

    def pacer_allows(self, now: float) -> bool:
        if self.profile.rpm <= 0:
            return True
        made, n = self.in_window(self.profile.rpm, now)
        return made < n

    def bucket(self, now: float) -> float:
        """The model's input bucket now (continuous refill, at most ``itpm``)."""
        self.level = min(self.itpm, self.level + (now - self.level_at) * self.itpm / 60.0)
        self.level_at = now
        return self.level

    def budget_allows(self, now: float) -> bool:
        waiting = self.waiting()
        if not self.itpm or not waiting:
            return True
        if self.weights:  # which one heads the queue is the turns' business: all could
            return self.bucket(now) >= max(edge_want(c.tokens, self.itpm)
                                           for c in waiting) - 1e-6
        head = min(waiting, key=_Client.key)  # (its need and the margin at the edge)
        return self.bucket(now) >= edge_want(head.tokens, self.itpm) - 1e-6

    def state(self) -> str:
        stats = self.lanes[0].statistics()
        waiting = ", ".join(f"#{c.n}({c.priority[:3]} since {c.queued_at:g}, timeout at "
                            f"{c.arrived_at + c.timeout_s:g})" for c in self.waiting())
        tokens = ""
        if self.itpm:
            head = min(self.waiting(), key=_Client.key, default=None)
            tokens = (f"; input bucket {self.bucket(trio.current_time()):.3f} of "
                      f"{self.itpm:g}, head needs {head.tokens if head else 0}")
        return (f"lane running={stats.running}/{stats.capacity} queued={stats.queued}; "
                f"model running={len(self.running())} waiting=[{waiting}]; last start="
                f"{self.starts[-1] if self.starts else '-'}; {_profile_str(self.profile)}{tokens}")

    # --- one client ---------------------------------------------------------------------
    def _queued(self, c: _Client) -> None:
        c.queued_at = trio.current_time()
        c.order = self.order
        self.order += 1
        c.was_queued = True
        self.events.append(("q", c))
        stats = c.stats_before
        if not self.real_time and stats is not None and stats.queued >= stats.queue_max:
            self.fail("queue_max", f"#{c.n} was queued with {stats.queued} already queued, "
                      f"queue_max {stats.queue_max}")

    def _started(self, c: _Client) -> None:
        now = trio.current_time()
        if c.order is None:          # started without queueing
            c.order = self.order
            self.order += 1
            c.queued_at = now
        elif c.was_queued:
            self.events.append(("s", c))
        c.started_at = now
        c.outcome = "started"
        self.report.count("started")
        if c.queued_at is not None and c.queued_at < now:
            self.report.count("started after waiting")
        running = len(self.running())
        self.starts.append(now)
        lanes, rpms = self.profile.lanes, [self.profile.rpm]
        if now - self.reloaded_at <= (self.eps if self.real_time else 0.0):
            old = self.before_reload
            lanes = max(lanes, old.lanes)
            rpms.append(old.rpm)
        if running > lanes:
            self.fail("capacity", f"#{c.n} started with {running} running > lanes "
                      f"{self.profile.lanes}; {self.state()}")
        windows = [self.in_window(rpm, now, self.eps) for rpm in rpms if rpm > 0]
        if len(windows) == len(rpms) and all(made > n for made, n in windows):
            made, n = windows[0]
            self.fail("pacer", f"#{c.n} made {made} starts in a window that allows {n} "
                      f"(rpm {self.profile.rpm:g}); {self.state()}")
        if self.itpm:
            if self.bucket(now) < c.tokens - 1e-6:
                self.fail("budget", f"#{c.n} started needing {c.tokens} input tokens with "
                          f"{self.level:.3f} in the bucket; {self.state()}")
            self.level -= c.tokens
            if c.queued_at is not None and c.queued_at < now:
                self.report.count("started after waiting, with a budget")

    def _settle(self, c: _Client, lane: Any, ticket: Any) -> None:
        """The request ends: it used a random part of what it reserved."""
        used = self.rng.randint(0, c.tokens)
        self.level = min(self.itpm, self.bucket(trio.current_time()) + c.tokens - used)
        lane.settle(ticket, used, 0)

    def _race(self, c: _Client) -> None:
        """As ``c`` gives its slot back: cancel the waiter the lane should grant it to."""
        waiting = self.waiting()
        if not waiting:
            return
        if self.rng.random() < 0.7:
            target = min(waiting, key=_Client.key)
        else:
            target = self.rng.choice(waiting)
        target.scope.cancel()
        target.outcome = "cancelled in a release's tick"
        self.report.count("cancels at the instant of a grant")

    async def client(self, c: _Client, nursery: trio.Nursery) -> None:
        lane = self.lanes[c.lane]
        c.arrived_at = now = trio.current_time()
        c.timeout_s = self.profile.queue_timeout_s
        self.clients.append(c)
        self.report.count("arrivals")
        if c.patience_s is not None:
            c.scope.deadline = now + c.patience_s
        # The lane's own numbers just before it decides (no checkpoint in between).
        stats = c.stats_before = lane.statistics()
        race = self.rng.random()
        try:
            with c.scope:
                try:
                    on_queued = functools.partial(self._queued, c)
                    mine: dict[str, Any] = {"need": Need(c.tokens, 0)} if self.itpm else {}
                    if self.weights:
                        mine.update(client=c.who, weight=c.weight)
                    slot = lane.slot(c.priority, on_queued=on_queued, **mine)
                    async with slot as ticket:
                        self._started(c)
                        try:
                            await trio.sleep(c.run_s)
                        finally:
                            if self.itpm:
                                self._settle(c, lane, ticket)
                            if race < 0.10:
                                self._race(c)          # just before the release
                            elif race < 0.16:
                                self.spawn(nursery)    # an arrival in the release's tick
                            c.ended_at = trio.current_time()
                    if 0.16 <= race < 0.22:
                        self._race(c)                  # just after the release
                except RelayError as exc:
                    self.refused(c, exc, stats)
        finally:
            if c.started_at is None and c.left_at is None:
                c.left_at = trio.current_time()
                if c.was_queued:
                    self.events.append(("l", c))
                if c.outcome == "new":
                    c.outcome = "cancelled while queued" if c.queued_at is not None else (
                        "cancelled on arrival")
            if c.running:
                c.ended_at = trio.current_time()
        if c.outcome == "cancelled while queued":
            self.report.count("cancelled while queued")
        elif c.outcome == "cancelled in a release's tick":
            self.report.count("left in a release's tick")
        elif c.scope.cancelled_caught and c.started_at is not None:
            self.report.count("cancelled while running")

    def refused(self, c: _Client, exc: RelayError, stats: _Stats) -> None:
        now = trio.current_time()
        c.left_at = now
        c.outcome = exc.reason
        if c.was_queued:
            self.events.append(("l", c))
        self.report.count(exc.reason)
        if exc.phase != "capacity" or exc.status != 429 or not exc.retry_after_s:
            self.fail("error", f"#{c.n}: {exc.reason} with phase {exc.phase}, status "
                      f"{exc.status}, retry_after_s {exc.retry_after_s}")
        if exc.reason == "provider_queue_full":
            if c.queued_at is not None or (not self.real_time
                                           and stats.queued < stats.queue_max):
                self.fail("queue_max", f"#{c.n} refused as full with {stats.queued} queued, "
                          f"queue_max {stats.queue_max}")
        elif exc.reason == "provider_queue_timeout":
            due = c.arrived_at + c.timeout_s
            if c.queued_at is None or abs(now - due) > self.eps:
                self.fail("timeout", f"#{c.n} timed out at {now:g}, due at {due:g}")
        else:
            self.fail("error", f"#{c.n}: unexpected {exc.reason}: {exc.message}")

    def spawn(self, nursery: trio.Nursery, who: str | None = None) -> None:
        rng = self.rng
        priority = rng.choices(list(PRIORITIES), weights=[2, 5, 3])[0]
        mean_run = max(0.5 * self.scale, 3.0 * self.profile.queue_timeout_s / 10)
        run_s = self.draw(0.0, 2 * mean_run)
        patience = self.draw(0.0, 1.5 * self.profile.queue_timeout_s + mean_run) if (
            rng.random() < 0.25) else None
        if who is None:
            who = rng.choice(list(self.weights)) if self.weights else "default"
        self.spawned += 1
        c = _Client(n=self.spawned, priority=priority,
                    lane=rng.randrange(len(self.lanes)), run_s=run_s, patience_s=patience,
                    tokens=rng.randint(1, int(self.itpm) // 2) if self.itpm else 0,
                    who=who, weight=self.weights.get(who, 1.0))
        nursery.start_soon(self.client, c, nursery)

    async def watch_idle(self, lane: LaneUnderTest) -> None:
        self.idle_watchers += 1
        try:
            await lane.wait_idle()
        finally:
            self.idle_watchers -= 1
        stats = lane.statistics()
        self.report.count("wait_idle returned")
        if self.real_time:
            # A shared lane's wait_idle is about its own relay's side (what a retiring
            # adapter there waits for): none of this lane object's clients runs or waits.
            index = self.lanes.index(lane)
            if any(c.lane == index for c in (*self.running(), *self.waiting())):
                self.fail("wait_idle", f"wait_idle() of lane {index} returned while its "
                          f"clients run or wait; {self.state()}")
        elif stats.running or stats.queued or self.running() or self.waiting():
            self.fail("wait_idle", f"wait_idle() returned while not idle; {self.state()}")

    # --- the checker ----------------------------------------------------------------------
    def check_settled(self) -> None:
        now = trio.current_time()
        self.report.count("steps checked")
        stats = self.lanes[0].statistics()
        running, waiting = self.running(), self.waiting()
        if not self.real_time and (stats.running, stats.queued) != (len(running), len(waiting)):
            self.fail("leak", self.state())
        if not self.real_time and stats.capacity != self.profile.lanes:
            self.fail("leak", f"capacity {stats.capacity} != lanes {self.profile.lanes}")
        idle = (bool(waiting) and len(running) < self.profile.lanes
                and self.pacer_allows(now) and self.budget_allows(now))
        if self.real_time:  # idle for longer than the slack: a slot left idle
            if idle and now - self.reloaded_at <= 2 * self.eps:
                idle = False  # a reload's new profile is reaching every relay
            self.idle_since = (self.idle_since if self.idle_since is not None else now) \
                if idle else None
            idle = self.idle_since is not None and now - self.idle_since > self.eps
        if idle and not self.idle_episode:
            self.fail("idle", f"a free slot idles while {len(waiting)} wait and the pacer "
                      f"allows a start; {self.state()}")
        self.idle_episode = idle
        for c in waiting:
            if now > c.arrived_at + c.timeout_s + self.eps and c.n not in self.seen_overdue:
                self.seen_overdue.add(c.n)
                self.fail("overdue", f"#{c.n} still waits at {now:g}, its queue timeout was "
                          f"at {c.arrived_at + c.timeout_s:g}; {self.state()}")
        stuck = not running and not waiting and self.idle_watchers > 0
        if self.real_time:
            self.watchers_since = (self.watchers_since if self.watchers_since is not None
                                   else now) if stuck else None
            stuck = self.watchers_since is not None and now - self.watchers_since > self.eps
        if stuck:
            self.fail("wait_idle", f"nothing runs or waits but {self.idle_watchers} "
                      "wait_idle() caller(s) still wait")

    async def sampler(self) -> None:
        """The real-time checker: every ``slack / 4`` s."""
        while True:
            self.check_settled()
            await trio.sleep(self.eps / 4)

    async def checker(self) -> None:
        while True:
            await trio.testing.wait_all_tasks_blocked()
            self.check_settled()
            ahead = trio.lowlevel.current_statistics().seconds_to_next_deadline
            if not math.isfinite(ahead):
                await trio.sleep_forever()
            await trio.sleep(max(ahead, 0.0))

    def check_turns(self) -> None:
        """Over the history of events, in order: two clients that both wait in one class
        start within weighted round robin's bound of each other (SPEC L14).

        Inside one virtual instant the fuzz sees the events in its tasks' order, not
        the lane's (a granted task runs after an arrival of the same tick), so an instant
        is read the way that never blames the lane: leaves first, then the starts of
        requests that waited from before, then arrivals, then starts and leaves of those
        arrivals; a
        start of ``k`` is judged as if every start of ``j`` in the same instant came
        before it (and when those were all its waiters, its wait ended before the start).
        """
        def at(event: tuple[str, _Client]) -> tuple[float, int]:
            kind, c = event
            if kind == "l":
                t = c.left_at or 0.0
                return (t, 0 if (c.queued_at or 0.0) < t else 4)
            if kind == "q":
                return (c.queued_at or 0.0, 2)
            t = c.started_at or 0.0
            return (t, 1 if (c.queued_at or 0.0) < t else 3)
        events = sorted(self.events, key=at)  # (stable: the same instant keeps its order)
        ahead: dict[tuple[float, str, str], int] = {}  # starts per instant, class, client
        for kind, c in events:
            if kind == "s":
                slot = (c.started_at or 0.0, c.priority, c.who)
                ahead[slot] = ahead.get(slot, 0) + 1
        backlog: dict[tuple[str, str], int] = {}
        # (class, client k, client j) -> starts of k and of j while both have waited
        both: dict[tuple[str, str, str], list[int]] = {}
        reported: dict[tuple[str, str, str], list[int]] = {}
        for kind, c in events:
            key = (c.priority, c.who)
            if kind == "q":
                backlog[key] = backlog.get(key, 0) + 1
                if backlog[key] == 1:
                    for (prio, who), n in backlog.items():
                        if prio == c.priority and who != c.who and n:
                            both[(prio, c.who, who)] = [0, 0]
                            both[(prio, who, c.who)] = [0, 0]
                continue
            if kind == "s":
                now = c.started_at or 0.0
                ahead[(now, c.priority, c.who)] -= 1
                ended: list[tuple[str, str, str]] = []
                for (prio, k, j), counts in both.items():
                    if prio != c.priority or c.who not in (k, j):
                        continue
                    other = j if c.who == k else k
                    same = ahead.get((now, prio, other), 0)  # its starts of this instant
                    if backlog.get((prio, other), 0) <= same:
                        ended.append((prio, k, j))  # they may all have come first,
                        continue                    # ending its wait: the stretch is over
                    counts[0 if c.who == k else 1] += 1
                    sk, sj = 1.0 / self.weights[k], 1.0 / self.weights[j]
                    if (c.who == k and counts[0] * sk - (counts[1] + same) * sj > sk + sj + 1e-6
                            and counts is not reported.get((prio, k, j))):
                        self.report.violations.append(Violation(
                            self.seed, c.started_at or 0.0, "turns",
                            f"#{c.n} of client {k} (weight {self.weights[k]:g}, {c.priority}) "
                            f"made its {counts[0]}th start while client {j} (weight "
                            f"{self.weights[j]:g}) waited and made {counts[1]}"))
                        reported[(prio, k, j)] = counts  # once per stretch of both waiting
                for pair in ended:
                    both.pop(pair, None)
            backlog[key] -= 1
            if not backlog[key]:
                both = {pair: n for pair, n in both.items()
                        if not (pair[0] == c.priority and c.who in pair[1:])}
        self.report.count("turn checks", len(self.events))

    def check_order(self) -> None:
        """Over the whole history: a start never overtakes a better key waiting since
        an earlier instant (priority order, FIFO within a class, no barging)."""
        started = [c for c in self.clients if c.started_at is not None]
        queued = [c for c in self.clients if c.queued_at is not None and c.order is not None]
        for w in started:
            assert w.started_at is not None
            for v in queued:
                if v is w or not v.goes_before(w):
                    continue
                if (self.real_time and v.priority == w.priority and v.queued_at is not None
                        and w.queued_at is not None
                        and v.queued_at > w.queued_at - self.eps):
                    continue  # arrivals within the slack: their order is the server's
                assert v.queued_at is not None
                out = v.started_at if v.started_at is not None else v.left_at
                if v.queued_at < w.started_at - self.eps and out is not None and (
                        out > w.started_at + self.eps):
                    self.report.violations.append(Violation(
                        self.seed, w.started_at, "order",
                        f"#{w.n} ({w.priority}, arrival {w.order}) started before #{v.n} "
                        f"({v.priority}, arrival {v.order}), which waited since "
                        f"{v.queued_at:g} and {v.outcome} at {out:g}"))


def _random_profile(rng: random.Random, grid: float | None, scale: float = 1.0,
                    paced: bool = False) -> Profile:
    # paced: the pacer binds nearly all the time, and waiters outlive its window (a
    # sliding minute holds a free slot back for tens of seconds, longer than the usual
    # queue timeouts: the states where a leaving head must hand off again are reached).
    timeout = rng.choice([60.0, 120.0] if paced else [1.0, 2.0, 5.0, 10.0, 30.0]) * scale
    return Profile(lanes=rng.randint(1, 4), queue_max=rng.choice([0, 1, 2, 4, 8, 16, 64]),
                   queue_timeout_s=timeout, run_timeout_s=600.0,
                   # (a window of few starts binds often: 0.5 and 1 are one start a
                   # window, as the old one-start-every-60/rpm-s pacer was)
                   rpm=rng.choice([1.0, 2.0, 3.0, 4.0] if paced else
                                  [0.0, 0.0, 0.5, 1.0, 2.0, 3.0, 6.0, 12.0, 60.0, 120.0])
                   / scale)


async def fuzz_lanes(factory: LaneFactory, seed: int, *, arrivals: int = 150,
                     reload_rpm: bool = True, slack: float = 0.0,
                     scale: float = 1.0, tokens: bool = False,
                     paced: bool = False, clients: bool = False,
                     unpaced: bool = False) -> FuzzReport:
    """One seeded run. Must run on a MockClock that autojumps (threshold 0), unless
    ``slack`` > 0: then in real time (see the module docstring).

    Args:
        factory: makes the lane object(s) under test (see the module docstring).
        seed: everything random in the run follows from it.
        arrivals: how many requests arrive.
        reload_rpm: reloads may change rpm too (otherwise only the other fields).
        slack: real time: how far a rule may be off (seconds).
        scale: every duration of the run (timeouts, runs, the pacer's gap) times this.
        tokens: an input token budget too (``itpm``, SPEC L12; a local lane only): each
            request needs a random part of it and settles to a random use.
        paced: profiles where the pacer binds (few starts a minute, long queue timeouts).
        clients: requests from a few clients with weights, one of them in bursts (SPEC
            L14; a local lane only): the ``turns`` rule is checked.
        unpaced: rpm 0 from the start (with ``reload_rpm`` False: all along).
    """
    rng = random.Random(seed)
    grid = 0.5 * scale if seed % 2 == 0 else None
    profile = _random_profile(rng, grid, scale, paced)
    if unpaced:
        profile = attrs.evolve(profile, rpm=0.0)
    if tokens:
        profile = attrs.evolve(profile, itpm=float(rng.choice([60, 600, 6000])))
    report = FuzzReport(seed=seed, profile=_profile_str(profile))
    async with factory(profile) as lanes:
        fuzz = _Fuzz(lanes, profile, seed, rng, report, grid, slack, scale, clients)
        async with trio.open_nursery() as outer:
            outer.start_soon(fuzz.sampler if fuzz.real_time else fuzz.checker)
            async with trio.open_nursery() as nursery:
                load = rng.uniform(0.3, 3.0)  # offered load, in lanes' worth of work
                for _ in range(arrivals):
                    mean_run = max(0.5 * scale, 3.0 * fuzz.profile.queue_timeout_s / 10)
                    await trio.sleep(fuzz.draw(0.0, 2 * mean_run / (load * fuzz.profile.lanes)))
                    fuzz.spawn(nursery)
                    if clients and rng.random() < 0.08:  # a burst of one client
                        for _ in range(rng.randint(3, 12)):
                            fuzz.spawn(nursery, who=rng.choice("ab"))
                    roll = rng.random()
                    if roll < 0.04:
                        fuzz.before_reload, fuzz.reloaded_at = fuzz.profile, trio.current_time()
                        fresh = attrs.evolve(_random_profile(rng, grid, scale, paced),
                                             itpm=fuzz.profile.itpm)
                        if not reload_rpm:
                            fresh = attrs.evolve(fresh, rpm=fuzz.profile.rpm)
                        fuzz.profile = fresh
                        report.count("profile changes")
                        for lane in lanes:
                            lane.update_profile(fuzz.profile)
                    elif roll < 0.10:
                        nursery.start_soon(fuzz.watch_idle, rng.choice(lanes))
            if fuzz.real_time:  # the lanes' numbers are the server's: let them arrive
                with trio.move_on_after(10.0):
                    while any(lane.statistics().running or lane.statistics().queued
                              for lane in lanes):
                        await trio.sleep(fuzz.eps)
            else:
                await trio.testing.wait_all_tasks_blocked()
            fuzz.check_settled()
            for lane in lanes:
                stats = lane.statistics()
                if stats.running or stats.queued:
                    fuzz.fail("end", f"{stats.running} running, {stats.queued} queued at "
                              "the end")
                with trio.move_on_after(1.0) as waited:
                    await lane.wait_idle()
                if waited.cancelled_caught:
                    fuzz.fail("end", "wait_idle() did not return at the end")
            fuzz.check_order()
            if clients:
                fuzz.check_turns()
            outer.cancel_scope.cancel()
    return report


def run_seed_real_time(factory: LaneFactory, seed: int = 0, *, slack: float = 0.05,
                       scale: float = 0.2, **kw: Any) -> FuzzReport:
    """`fuzz_lanes` in a fresh trio run, in real time (see the module docstring)."""
    report: FuzzReport = trio.run(functools.partial(fuzz_lanes, factory, seed, slack=slack,
                                                    scale=scale, **kw))
    return report


def run_seed(factory: LaneFactory = local_lane, seed: int = 0, **kw: Any) -> FuzzReport:
    """`fuzz_lanes` in a fresh trio run on its own virtual clock."""
    clock = trio.testing.MockClock(autojump_threshold=0)
    report: FuzzReport = trio.run(functools.partial(fuzz_lanes, factory, seed, **kw),
                                  clock=clock)
    return report
