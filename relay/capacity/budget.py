"""Token budgets (SPEC L12): what a provider lets start per minute, mirrored on relay's side.

Theory of operation. A provider meters continuous buckets: each budget (request starts,
tokens, input tokens, output tokens, per minute) holds at most its limit and refills at
limit / 60 per second. `Budget` keeps the same buckets, on a clock it is given (trio's,
so tests run on virtual time), as a small pure object that the lane (`relay.capacity.lanes`)
asks: ``wait_s(need)`` (how long until a request needing ``need`` could start; the lane's
head waits exactly that, as it waits for the pacer, SPEC L9), ``reserve`` at the start,
``settle`` at the end (to the usage the answer reported, or relay's estimate of what was
sent and read, marked so), ``observe`` for an answer's headers, ``hold`` for a 429 that
said when or a usage-window notice. The provider is the truth: where a configured figure
(maybe this relay's share of the account) and a header (the account's ceiling) disagree,
the lower limit wins, and a header's ``remaining`` may lower relay's count, and raise it
only as far as no reading of when the provider reckoned it could make too much (below).

A shared provider (``shared = true``) keeps the same rules in Lua on the coordination
server (`relay.shared.budget_scripts`, on the server's clock). This table is the rules' one
description, with where this module ("here") and the scripts ("there") keep each
(tests/shared/test_budget_rules.py feeds both the same events and compares them).

  rule                                                    here             there
  ------------------------------------------------------- ---------------- -------------
  a budget's limit: the lower of the configured figure    _Bucket.limit    limit_of
  and the last header's
  a bucket: at most its limit, refilled at (limit less    _Bucket.level_at level_of
  what others take, below) / 60 a second since its level
  was last stored; stored only when a take, a settlement
  or a header moves it (a look stores nothing): a changed
  limit refills from there
  a budget left without a limit keeps its level and       _gone            (its keys)
  instant; given one again, it goes on from them
  the need: the estimated input plus the output           `.estimate`      the same
  reservation (docs/tokens.md); a queued one's input as   Need.current     (taken after
  the estimate says it when it starts                                      the slot)
  a need above a budget's whole limit never starts:       too_large        TOKENS_TAKE
  judged first, for every request (a hold or a queue
  does not wait for it)
  a need starts when every budget holds the need and a    wait_s,          TOKENS_TAKE
  margin, 1 % of its limit (``EDGE_MARGIN``: 0.6 s of     edge_want
  refill, for relay taking before the provider admits,
  on another clock), at most the whole limit (a request
  start: 1); else it waits for the refill
  every start is recorded, a budget known or not; it      reserve, active  TOKENS_TAKE
  takes the need from every budget with a limit and is
  in flight until settled
  a header's limit sets the budget's; a new one is whole  observe,         TOKENS_SEEN
  (its remaining, if said, sets it, below)                _window
  a header's remaining counts what the provider admitted  _window, _late   TOKENS_SEEN
  (the output reservation too): when min(limit,
  remaining) is lower than relay's level by more than
  the margin (``EDGE_MARGIN`` of the limit: a provider
  rounds, on another clock; a hair's difference would
  take off again what started since), or the budget
  is new, it sets the level to it less the whole need of
  what was granted after the answering request
  (``started_at``: its grant), still in flight
  the requests in flight granted at or before it are then _window          TOKENS_SEEN
  counted for that budget (``Reservation.counted``)                        (c:<member>)
  it raises relay's level when it says more by more than  _window, _since  since,
  the margin, from a request begun after the last header                   <kind>:set
  that set the level (``told``), less every grant made
  since ``RECKON_S`` before that request's (the last
  ``SETTLED_KEPT`` settled ones with what they used; an
  older one pushed out: not known, no raise); those in
  flight granted before that are then counted, and its
  own
  others on the key: at each header with a remaining     _Bucket.learn,   learn,
  after the first, from a request that took from this     _Bucket.others,  others_of,
  budget, and nothing granted since ``RECKON_S`` before   _measure         mine
  its request in flight (every request in flight is in
  its figure then, however the provider reckoned it),
  what they took since the last such one is
  how far relay's count less the header's figure grew
  since then, plus what the refill left them (not while
  the bucket is whole); a header not so that sets the
  level ends the measure (the next such one starts it
  anew: its figure may hold what relay took off again); a
  decayed sum of it over a decayed
  sum of the seconds (``OTHERS_TAU_S``), at least
  ``OTHERS_MIN_S``, is their rate, 0 to ``OTHERS_CAP`` of
  the limit; the level is stored (at the old rate) first
  a counted request's input beyond its reservation was    _Bucket.own_     TOKENS_SETTLE
  relay's own, not others': settled, it comes off         error
  a request such a header saw in flight (not counted):    _Bucket.settled_ TOKENS_SETTLE
  settled, its input beyond its reservation comes off     heard            (h:<member>)
  the measure's start, and off their take where the
  measure took it for theirs (decayed as it went in)
  settlement: each budget it took from gets back what     settle           TOKENS_SETTLE
  was reserved and not used (or gives what was used
  beyond), up to its limit; a counted budget, only its
  output (its real input is in the header's figure);
  request starts stay taken
  a header's reset sets nothing (an adapter turns a              -                -
  used-up budget's reset into a hold)
  a hold: no start until it ends but a connection         hold, hold_left  TOKENS_SEEN,
  check's; a later end replaces it; at most max_hold_s                     TOKENS_TAKE
  (a usage window: a day; `bounded_hold`)
  an answer begun after the hold began, fine, ends it     observe(ok)      TOKENS_SEEN
  the first start once a hold is over (a connection       _probe           first,
  check's too) goes alone until an answer is back, it is                   first_due
  settled or a new hold comes (there: or its relay is
  gone, its slot's lease in the lane's holders ended)
  the keys lost (a restart, a failover): the first start  (a process's     born, <kind>:new
  goes alone and the next header sets each level, even   restart starts
  above relay's guess; the keys last a day and an hour    whole)
  after their last use (no hold outlasts them)

The caller (`relay.engine.metering`) gives ``observe`` the answering attempt's upstream
start as ``started_at``: its own reservation's ``at`` (``SharedBudget.seen``: how long ago
that was; the scripts read the grant's own instant where they still have it). A grant
made before or with it is in the provider's remaining; one made after is not.
"""

# layers: long because its theory of operation holds the one table of the token-budget
# rules that this module and the shared Lua scripts (relay.shared.budget_scripts) both keep.

from __future__ import annotations

import collections
import math
from collections.abc import Callable, Iterator
from typing import Any

import attrs

from relay.vocab.errors import RelayError
from relay.vocab.limits import KINDS, RateLimits
from relay.vocab.profile import Profile

from .estimate import OUTPUT_FLOOR, Learned, estimate_input, estimate_text, output_reservation

__all__ = ["EDGE_MARGIN", "OUTPUT_FLOOR", "RECKON_S", "USAGE_WINDOW_MAX_HOLD_S", "Budget",
           "Learned", "Need", "Reservation", "bounded_hold", "edge_want", "estimate_input",
           "estimate_text", "held_error", "output_reservation", "too_large",
           "too_large_error"]

# (The estimate lives in `relay.capacity.estimate`; re-exported here, where it is used.)

_PROFILE_KEYS = {"tokens": "tpm", "input": "itpm", "output": "otpm"}
_WHAT = {"requests": "request starts", "tokens": "tokens", "input": "input tokens",
         "output": "output tokens"}

# A start needs this share of a budget's limit free beyond its own need (0.6 s of refill):
# relay takes before the provider admits, on another clock, and rounds otherwise.
EDGE_MARGIN = 0.01

# Others on the same key (another program, another relay not sharing this one's server):
# what the provider's headers say is gone beyond relay's own count, learned as a rate
# (tokens a minute) over about a minute (decayed sums, time constant ``OTHERS_TAU_S``; at
# least ``OTHERS_MIN_S`` of samples count, so a single answer cannot make it large), and
# at most ``OTHERS_CAP`` of the limit (relay always keeps half the refill).
OTHERS_TAU_S = 60.0
OTHERS_MIN_S = 5.0
OTHERS_CAP = 0.5

# A grant reaches the provider within this many seconds: one made so long before the
# answering request's may still have been admitted after it. A header raises relay's
# count only to its figure less every grant made since then (``Budget._window``).
RECKON_S = 2.5
# The settled grants kept for that (a header may come after requests granted since its
# own have settled); an older one pushed out makes the window unknown (no raise).
SETTLED_KEPT = 16


def edge_want(cost: float, limit: float) -> float:
    """What a budget of ``limit`` must hold for a need of ``cost`` to start: the need and
    the margin at the bucket's edge, at most the whole limit."""
    return min(cost + limit * EDGE_MARGIN, limit)


@attrs.frozen(slots=True)
class Need:
    """What one request will take: its estimated input and its output reservation, of
    the budgets of its model's ``scope`` (`relay.capacity.meter`)."""

    input: int
    output: int
    scope: str = ""
    # False: relay cannot tell how much of the input the provider will count (a prompt it
    # may read from its cache): never refused as too large, it is sent (SPEC L12a).
    sure: bool = True
    estimate: int = 0  # relay's own estimate of the whole prompt (for the learning)
    script: str = ""  # the prompt's script (`relay.capacity.estimate.script_of`)
    # Relay's raw estimate (`estimate_input`, before the learned ratio) and, of it, the
    # message framing (`estimate_framing`): what the answer's count is learned against.
    raw: int = 0
    framing: int = 0
    least: int | None = None  # the fewest input tokens the provider may count (too_large)
    # The input as the estimate says it now (`relay.capacity.estimate.InputRatio` learns
    # while the request waits): a queued request is admitted on what was learned by
    # then, not on what was known when it queued. None: its input stays as it is.
    relearn: Callable[[], int] | None = attrs.field(default=None, eq=False, repr=False)

    def current(self) -> Need:
        """This need with its input as the estimate says it now (`relearn`)."""
        if self.relearn is None:
            return self
        now = self.relearn()
        return self if now == self.input else attrs.evolve(self, input=now)

    def cost(self, kind: str) -> int:
        if kind == "requests":
            return 1
        if kind == "tokens":
            return self.input + self.output
        return self.input if kind == "input" else self.output


@attrs.define(eq=False)
class Reservation:
    need: Need
    at: float  # when it was granted: the attempt's upstream start (SPEC L12a)
    settled: bool = False
    kinds: frozenset[str] | None = None  # the budgets it took from (None: every one)
    # The budgets whose level a provider's header set while it was in flight, granted at
    # or before the answering request: they hold its real input already.
    counted: set[str] = attrs.Factory(set)
    # The budgets whose measure of others' take (`_Bucket.learn`) saw it in flight: the
    # measure's age (``_Bucket.aged``) where it took its estimate's error for others'
    # (its first clean header had one before it), None where it was only in the
    # measure's start.
    heard: dict[str, float | None] = attrs.Factory(dict)


@attrs.define
class _Bucket:
    configured: float = 0.0          # the profile's figure per minute (0: not set)
    header: float | None = None      # the provider's figure, from its last header
    header_at: float | None = None
    level: float = 0.0               # as stored at ``at`` (a take, a settlement, a header)
    at: float = -math.inf            # -inf: never stored, whole
    remaining_said: float | None = None  # the last header's remaining, as it said
    # What others on the key take (`_Bucket.others`): decayed sums of the tokens the
    # headers said were gone beyond relay's count (``seen``) over the seconds they span
    # (``span``); the last header with a remaining (``heard``) and relay's count less its
    # figure then (``gap``: what the next one is measured from).
    seen: float = 0.0
    span: float = 0.0
    heard: float | None = None
    gap: float = 0.0
    aged: float = 0.0  # the seconds ``seen`` has been decayed by, in all
    told: float = -math.inf  # when a header last set the level (``Budget._window``)
    owed: float = 0.0  # what the last header to set the level took off for grants

    @property
    def others(self) -> float:
        """Tokens (or requests) a minute others on the key take, as learned: at most
        ``OTHERS_CAP`` of the limit, never below 0."""
        if self.span <= 0.0:
            return 0.0
        rate = self.seen / max(self.span, OTHERS_MIN_S) * 60.0
        return min(max(rate, 0.0), self.limit * OTHERS_CAP)

    @property
    def refill(self) -> float:
        """What it refills a minute for relay: the limit less what others take."""
        return self.limit - self.others

    def learn(self, now: float, level: float, gap: float) -> None:
        """A header with a remaining: ``level`` is relay's count then (stored at ``now``),
        ``gap`` relay's count less the header's figure (less what was granted after the
        answering request). What others took since the last header is how far the gap
        grew since then, plus what the refill already left them (unless the bucket is
        whole: it left them nothing). A gap that grew and shrank again (an estimate
        settled, a header reckoned at the answer's end) adds up to nothing."""
        if self.heard is not None:
            span = max(0.0, now - self.heard)
            took = gap - self.gap
            if level < self.limit - 1e-6:  # (whole, the refill left them nothing)
                took += self.others * span / 60.0
            decay = math.exp(-span / OTHERS_TAU_S)
            self.seen = self.seen * decay + took
            self.span = self.span * decay + span
            self.aged += span
        self.heard, self.gap = now, gap

    def own_error(self, more: float) -> None:
        """A counted request used ``more`` than relay reserved of it (its real input was
        in a header's figure, and the gap took it for others'): it was relay's own."""
        if self.heard is not None:
            self.seen -= more

    def settled_heard(self, more: float, taken: float | None) -> None:
        """A request a clean header saw in flight, not counted, used ``more`` input than
        relay reserved of it: its settlement moves relay's count by as much, which is no
        take of others' (the measure's start held it: it comes off that too), and where
        the measure took it for others' (``taken``: the measure's age then), it was
        relay's own: it comes off as decayed as it went in."""
        if self.heard is not None:
            self.gap -= more
        if taken is not None:
            self.seen -= more * math.exp(-(self.aged - taken) / OTHERS_TAU_S)

    @property
    def limit(self) -> float:
        figures = [f for f in (self.configured or None, self.header) if f]
        return min(figures) if figures else 0.0

    @property
    def source(self) -> str:
        if self.header and (not self.configured or self.header <= self.configured):
            return "header"
        return "configured"

    def level_at(self, now: float) -> float:
        """The level at ``now``: the stored one refilled since, at the limit as it is."""
        limit = self.limit
        if self.at == -math.inf:
            return limit
        return min(limit, self.level + max(0.0, now - self.at) * self.refill / 60.0)

    def store(self, now: float, level: float | None = None) -> None:
        self.level = self.level_at(now) if level is None else level
        self.at = now

    def wait_s(self, cost: float, now: float) -> float:
        want = edge_want(cost, self.limit)
        level = self.level_at(now)
        if level >= want - 1e-6:  # (a float's last bits are no reason to wait)
            return 0.0
        return (want - level) * 60.0 / self.refill


@attrs.define
class Hold:
    until: float
    since: float
    cause: str
    reason: str = "rate_limited"  # or quota_exhausted: a usage window (SPEC E2)


class Budget:
    """One provider's token and request budgets (see the module docstring)."""

    def __init__(self, profile: Profile, clock: Callable[[], float], *,
                 requests: bool = False) -> None:
        self._clock = clock
        # A model's budget (`relay.capacity.meter`) keeps a configured rpm as a request
        # budget; the account's rpm is the lane's pacer.
        self._keys = {"requests": "rpm", **_PROFILE_KEYS} if requests else _PROFILE_KEYS
        self._buckets: dict[str, _Bucket] = {}  # the budgets with a limit
        self._gone: dict[str, _Bucket] = {}  # without one now: their level waits
        self._inflight: set[Reservation] = set()  # reservations not yet settled
        # The last settled ones, with what they used, and the latest grant of those
        # pushed out (``_since``).
        self._settled: collections.deque[tuple[Reservation, Need]] = collections.deque()
        self._pushed_out = -math.inf
        # After a hold, one request goes first; the rest wait until its answer comes
        # back (a 200), so a provider that said nothing more meets one 429 a window.
        self._probe_due = False
        self._probe: Reservation | None = None
        self.learned = Learned()  # the output reservation's percentile (SPEC L12)
        self.hold_state: Hold | None = None
        self._minutes: collections.deque[tuple[int, int]] = collections.deque()
        self._recent: collections.deque[tuple[float, int]] = collections.deque()
        self.on_change: Callable[[], None] = lambda: None
        self.update_profile(profile)

    # --- configuration ------------------------------------------------------------------
    def update_profile(self, profile: Profile) -> None:
        self.max_hold_s = profile.max_hold_s
        for kind, key in self._keys.items():
            figure = float(getattr(profile, key))
            bucket = self._buckets.get(kind) or self._gone.get(kind)
            if bucket is None:
                if not figure:
                    continue
                bucket = _Bucket()
            bucket.configured = figure
            self._place(kind, bucket)
        self.on_change()

    def _place(self, kind: str, bucket: _Bucket) -> None:
        """Among the budgets (in `KINDS`' order) while it has a limit, else aside with
        its level and instant (set again, it goes on from them)."""
        self._buckets.pop(kind, None)
        self._gone.pop(kind, None)
        if not bucket.limit:
            self._gone[kind] = bucket
            return
        self._buckets[kind] = bucket
        self._buckets = {k: self._buckets[k] for k in KINDS if k in self._buckets}

    @property
    def busy(self) -> bool:
        """A reservation in flight."""
        return bool(self._inflight)

    @property
    def active(self) -> bool:
        """Always: every start is recorded, a budget known or not, so a provider's first
        header can tell what started after its answering request (SPEC L12a)."""
        return True

    def _kinds(self) -> Iterator[tuple[str, _Bucket]]:
        return iter(list(self._buckets.items()))

    # --- admission ------------------------------------------------------------------------
    def too_large(self, need: Need) -> tuple[str, int, float] | None:
        """(kind, need, limit) for a budget ``need`` exceeds as a whole, or None."""
        for kind, bucket in self._kinds():
            if kind != "requests" and need.cost(kind) > bucket.limit:
                return kind, need.cost(kind), bucket.limit
        return None

    def headroom(self, need: Need | None, now: float | None = None) -> float:
        """The least share left after ``need``, over its budgets (1.0: none set)."""
        now = self._clock() if now is None else now
        room = 1.0
        for kind, bucket in self._kinds():
            cost = need.cost(kind) if need is not None else 0
            room = min(room, (bucket.level_at(now) - cost) / bucket.limit)
        return room

    def hold_left(self, now: float | None = None) -> float:
        now = self._clock() if now is None else now
        if self.hold_state is None:
            return 0.0
        if now >= self.hold_state.until:
            self.hold_state = None
            return 0.0
        return self.hold_state.until - now

    def wait_s(self, need: Need | None, *, probe: bool = False, now: float | None = None
               ) -> float:
        """How long until a request needing ``need`` could start (0.0: now). ``probe``:
        a connection check, which may pass a hold (it is how a lifted limit shows)."""
        now = self._clock() if now is None else now
        wait = 0.0 if probe else self.hold_left(now)
        if self._probe is not None and not probe:
            return math.inf  # woken when the first answer after the hold comes back
        if need is None:
            return wait
        for kind, bucket in self._kinds():
            wait = max(wait, bucket.wait_s(min(need.cost(kind), bucket.limit), now))
        return wait

    def waiting_for(self, need: Need | None, now: float | None = None) -> str | None:
        """What a head that cannot start yet waits for, in words with its numbers."""
        now = self._clock() if now is None else now
        held = self.hold_left(now)
        if held > 0 and self.hold_state is not None:
            return (f"waiting for the provider's hold ({self.hold_state.cause}): no start "
                    f"for about {math.ceil(held)} s")
        if self._probe is not None:
            return ("waiting for the first request after the provider's hold to be "
                    "answered")
        if need is None:
            return None
        worst: tuple[float, str] | None = None
        for kind, bucket in self._kinds():
            want = math.ceil(edge_want(need.cost(kind), bucket.limit))
            wait = bucket.wait_s(need.cost(kind), now)
            if wait > 0 and (worst is None or wait > worst[0]):
                free = max(0, math.floor(bucket.level_at(now)))
                worst = (wait, f"waiting for the provider's {_WHAT[kind]} budget: "
                               f"{free:,} of {want:,} free, about {math.ceil(wait)} s")
        return worst[1] if worst else None

    def reserve(self, need: Need | None) -> Reservation | None:
        if need is None:
            return None
        now = self._clock()
        kinds = []
        for kind, bucket in self._kinds():
            bucket.store(now, bucket.level_at(now) - need.cost(kind))
            kinds.append(kind)
        reservation = Reservation(need, now, kinds=frozenset(kinds))
        self._inflight.add(reservation)
        if self._probe_due and self.hold_left(now) <= 0:
            self._probe_due, self._probe = False, reservation
        return reservation

    def cancel(self, reservation: Reservation | None) -> None:
        """A grant handed straight back: it took nothing."""
        if reservation is not None and reservation is self._probe:
            self._probe, self._probe_due = None, True
        self.settle(reservation, 0, 0, count=False)

    def settle(self, reservation: Reservation | None, used_in: int, used_out: int, *,
               count: bool = True) -> None:
        """Move a reservation to what was used (a budget gives back what was reserved
        and not used, and takes what was used beyond it). A budget a header set while it
        was in flight (``counted``) holds its real input already: only its output is
        settled there."""
        if reservation is None or reservation.settled:
            return
        reservation.settled = True
        self._inflight.discard(reservation)
        if reservation is self._probe:
            self._probe = None  # it ended without a 429 (a 429 set a new hold first)
        now = self._clock()
        need, used = reservation.need, Need(used_in, used_out)
        for kind, bucket in self._kinds():
            if kind == "requests" or (reservation.kinds is not None
                                      and kind not in reservation.kinds):
                continue
            back = need.cost(kind) - used.cost(kind)
            if count and kind in reservation.counted:
                back = 0 if kind == "input" else need.output - used.output
                if kind in ("input", "tokens"):
                    bucket.own_error(used_in - need.input)
            if (kind in reservation.heard and kind not in reservation.counted
                    and kind in ("input", "tokens")):
                bucket.settled_heard(used_in - need.input, reservation.heard[kind])
            bucket.store(now, min(bucket.limit, bucket.level_at(now) + back))
        if count:
            self._count(now, used_in + used_out)
        self._settled.append((reservation, used))
        if len(self._settled) > SETTLED_KEPT:
            self._pushed_out = max(self._pushed_out, self._settled.popleft()[0].at)
        self.on_change()

    # --- what the provider said -------------------------------------------------------------
    def observe(self, limits: RateLimits | None, *, started_at: float | None = None,
                ok: bool = False, reason: str = "rate_limited",
                own: Reservation | None = None) -> None:
        """An answer's rate-limit headers (and hold); see the module docstring.
        ``started_at``: the answering attempt's upstream start (its reservation's
        ``at``); ``own``: its reservation."""
        now = self._clock()
        if limits is not None:
            for kind, window in limits.windows.items():
                if kind in KINDS:
                    self._window(kind, window.limit, window.remaining, now, started_at, own)
            if limits.hold_s is not None and limits.hold_s > 0:
                hold_s, cause = bounded_hold(limits, self.max_hold_s, reason)
                self.hold(now + hold_s, cause, reason)
        if ok:
            self._probe = None  # an answer came back: the rest may start
            if (self.hold_state is not None and started_at is not None
                    and started_at >= self.hold_state.since):
                self.hold_state = None  # an answer begun after the hold: it has lifted
        self.on_change()

    def _window(self, kind: str, limit: float | None, remaining: float | None, now: float,
                started_at: float | None, own: Reservation | None) -> None:
        """One budget's limit and remaining, as a header said them."""
        created = kind not in self._buckets  # it had no limit before this header
        bucket = self._header_limit(kind, limit, now)
        if bucket is None or not bucket.limit or remaining is None:
            return
        bucket.remaining_said = remaining
        # The provider's remaining counts what it admitted: relay takes off only what it
        # granted after the answering request (not in the provider's count yet); whether
        # to move at all is decided on the header's own figure (below).
        said = min(bucket.limit, remaining)
        level = bucket.level_at(now)
        bucket.store(now, level)  # (at the refill as it was: the rate may change below)
        theirs = said - self._late(kind, started_at, own)
        # It tightens relay's count (or starts it) when it says less by more than the
        # margin at the edge (a provider rounds, on another clock: a hair is no news, and
        # what started since would come off it again).
        tighten = created or said < level - bucket.limit * EDGE_MARGIN
        # It raises relay's count when it says more by as much, less every grant made
        # since ``RECKON_S`` before its request's (whenever the provider reckoned it,
        # none of those may be in it), by at most what the last header to set the count
        # took off for grants its figure may hold (``owed``; relay's estimate of those
        # in flight may be low): a count taken off twice comes back (SPEC L12a). Only a
        # request begun after the last header that set the count can: its figure was
        # reckoned after that one's.
        newer = started_at is not None and started_at > bucket.told
        floor = None if tighten or not newer else self._since(kind, started_at, own)
        lifted = min(said - (floor or 0), level + bucket.owed)
        lift = floor is not None and lifted > level + bucket.limit * EDGE_MARGIN
        clean = self._measure(kind, bucket, now, level, level - theirs, created,
                              started_at, own)
        if tighten or lift:
            new = theirs if tighten else lifted
            # (what it took off for grants its figure may hold already: the next raise's
            # bound; the level before is set aside, and what it owed with it)
            bucket.owed = min(bucket.limit, said - new)
            bucket.store(now, new)
            bucket.told = now
            # What others take is measured between clean headers on relay's count: one
            # this header moved is no take of theirs. Not clean, its figure may hold what
            # relay took off again: the measure starts anew at the next clean header.
            if clean:
                bucket.gap = new - theirs
            elif not created:
                bucket.heard = None
            if started_at is not None:
                self._counted(kind, started_at if tighten else started_at - RECKON_S, own)

    def _measure(self, kind: str, bucket: _Bucket, now: float, level: float, gap: float,
                 created: bool, started_at: float | None, own: Reservation | None) -> bool:
        """What others take, measured at a header (``gap``: relay's count less its figure)
        where it is clean (returned): nothing relay granted since ``RECKON_S`` before the
        answering request is in flight, so every request in flight is in the provider's
        figure (whether it reckoned it at the request's admission or at its answer's
        end), at its real input (each one's error comes off at its settlement:
        `_Bucket.settled_heard`); and the answering request took from this budget (one
        begun before a model's budget was known here is in the figure, not in the count)."""
        clean = own is not None and not self._late("requests", None if started_at is None
                                                   else started_at - RECKON_S, own)
        if created:  # (requests begun before it are in none of its counts: the measure
            bucket.heard = None  # starts at the next clean header)
        elif clean:
            measured = bucket.heard is not None
            bucket.learn(now, level, gap)
            for r in self._inflight:
                r.heard.setdefault(kind, bucket.aged if measured else None)
        return clean

    def _header_limit(self, kind: str, limit: float | None, now: float) -> _Bucket | None:
        """A header's limit of a budget of ``kind`` (None: it said none); the budget."""
        bucket = self._buckets.get(kind)
        if limit:
            if bucket is None:
                bucket = self._gone.get(kind) or _Bucket()
            else:
                bucket.store(now)  # refilled at its old limit, up to now
            bucket.header, bucket.header_at = limit, now
            self._place(kind, bucket)
            bucket.store(now)  # held to the new limit (a new one: whole)
        return bucket

    def _counted(self, kind: str, before: float, own: Reservation | None) -> None:
        """The requests in flight granted at or before ``before``, and ``own``: their
        real input is in the provider's count of a budget of ``kind`` now."""
        for r in self._inflight:
            if r.at <= before or r is own:
                r.counted.add(kind)

    def _since(self, kind: str, started_at: float | None, own: Reservation | None
               ) -> float | None:
        """What every grant made since ``RECKON_S`` before ``started_at``, ``own`` aside,
        takes of a budget of ``kind``: its need in flight, what it used settled. None:
        not known (no start, or a settled one of then no longer kept)."""
        if started_at is None or self._pushed_out > started_at - RECKON_S:
            return None
        since = started_at - RECKON_S
        return (sum(r.need.cost(kind) for r in self._inflight
                    if r is not own and r.at > since)
                + sum(used.cost(kind) for r, used in self._settled
                      if r is not own and r.at > since))

    def _late(self, kind: str, started_at: float | None, own: Reservation | None) -> int:
        """What requests granted after ``started_at`` (all, when None), ``own`` (the
        answering request's) aside, take of a budget of ``kind``."""
        return sum(r.need.cost(kind) for r in self._inflight
                   if r is not own and (started_at is None or r.at > started_at))

    def _outstanding_out(self) -> int:  # output tokens reserved by requests in flight
        return sum(r.need.output for r in self._inflight)

    def hold(self, until: float, cause: str, reason: str = "rate_limited") -> None:
        now = self._clock()
        if self.hold_state is None or until > self.hold_state.until:
            self.hold_state = Hold(until=until, since=now, cause=cause, reason=reason)
        self._probe_due, self._probe = True, None
        self.on_change()

    # --- visibility ---------------------------------------------------------------------------
    def _count(self, now: float, tokens: int) -> None:
        minute = int(now // 60)
        if self._minutes and self._minutes[-1][0] == minute:
            self._minutes[-1] = (minute, self._minutes[-1][1] + tokens)
        else:
            self._minutes.append((minute, tokens))
        while self._minutes and self._minutes[0][0] <= minute - 60:
            self._minutes.popleft()
        self._recent.append((now, tokens))
        while self._recent and self._recent[0][0] <= now - 60:
            self._recent.popleft()

    def used_last_minute(self, now: float) -> int:
        while self._recent and self._recent[0][0] <= now - 60:
            self._recent.popleft()
        return sum(t for _, t in self._recent)

    def status(self, iso: Callable[[float | None], str | None]) -> dict[str, Any]:
        """The per-provider ``budgets`` object of the status (SPEC L12)."""
        now = self._clock()
        budgets: dict[str, Any] = {}
        for kind, bucket in self._kinds():
            budgets[kind] = {
                "limit_per_minute": bucket.limit,
                "remaining": max(0, math.floor(bucket.level_at(now))),
                "source": bucket.source,
                "configured": bucket.configured or None,
                "header": bucket.header,
                "header_at": iso(bucket.header_at),
                "others_per_minute": round(bucket.others),
            }
        held = self.hold_left(now)
        minute = int(now // 60)
        history = dict(self._minutes)
        return {
            "budgets": budgets,
            "used_last_minute": self.used_last_minute(now),
            "reserved_output": self._outstanding_out(),
            "hold": ({"until": iso(self.hold_state.until), "left_s": round(held, 3),
                      "cause": self.hold_state.cause, "reason": self.hold_state.reason}
                     if self.hold_state is not None and held > 0 else None),
            # Tokens used per minute over the last hour, oldest first (the page's chart).
            "per_minute": [history.get(m, 0) for m in range(minute - 59, minute + 1)],
            "tokens_limit": (self._buckets["tokens"].limit if "tokens" in self._buckets
                             else sum(self._buckets[k].limit for k in ("input", "output")
                                      if k in self._buckets) or None),
        }


USAGE_WINDOW_MAX_HOLD_S = 86_400.0  # a usage-window notice that names its reset (L12a)


def bounded_hold(limits: RateLimits, max_hold_s: float, reason: str) -> tuple[float, str]:
    """The hold relay keeps for what a provider said, and its cause in words: no longer
    than ``max_hold_s`` for a 429, a day for a usage-window notice (SPEC L12a)."""
    said = limits.hold_s or 0.0
    cause = limits.cause or "the provider said wait"
    cap = USAGE_WINDOW_MAX_HOLD_S if reason == "quota_exhausted" else max_hold_s
    if said <= cap:
        return said, cause
    what = "a day" if reason == "quota_exhausted" else f"max_hold_s, {cap:g} s"
    return cap, f"{cause}; held {cap:g} s ({what})"


def held_error(provider: str, budget: Budget, why: str, retry_after_s: float) -> RelayError:
    """A request the provider's hold keeps from starting (it has a fallback to go to, or
    the hold outlasts its queue timeout): the hold's own reason, and when it ends."""
    held = budget.hold_state
    left = budget.hold_left()
    cause = held.cause if held is not None else "the provider said wait"
    return RelayError(
        held.reason if held is not None else "rate_limited",
        f"provider {provider!r} holds every start for about {math.ceil(left)} s more "
        f"({cause}); {why}. This request was not sent.", provider=provider,
        retry_after_s=retry_after_s,
        action="retry after the time in Retry-After; relay holds the provider's queue "
               "until then")


def too_large_error(provider: str, budget: Budget, need: Need) -> RelayError | None:
    """``request_too_large`` for a need larger than one of the budgets' whole minute."""
    found = budget.too_large(need)
    if found is None:
        return None
    return too_large(provider, need, *found)


def too_large(provider: str, need: Need, kind: str, cost: int, limit: float) -> RelayError:
    """``request_too_large``: ``need`` costs ``cost`` of a ``kind`` budget of ``limit``."""
    key = _PROFILE_KEYS.get(kind, kind)
    what = _WHAT[kind]
    return RelayError(
        "request_too_large", f"this request needs about {cost:,} {what} (estimated: "
        f"{need.input:,} in, {need.output:,} reserved for the answer), more than provider "
        f"{provider!r} allows in a whole minute ({limit:,.0f} {what}, {key}); it could "
        "never start there.", provider=provider)
