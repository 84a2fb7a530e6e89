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
the lower limit wins, and a header's ``remaining`` may lower relay's count, never raise it.

A shared provider (``shared = true``) keeps the same rules in Lua on the coordination
server (`relay.shared.budget_scripts`, on the server's clock). This table is the rules' one
description, with where this module ("here") and the scripts ("there") keep each; ``d<n>``:
the two differ today (notes below; tests/shared/test_budget_rules.py feeds both the same
events: these are its xfail cases, which issue 33 is to end).

  rule                                                 today  here             there
  ---------------------------------------------------- ------ ---------------- -------------
  a budget's limit: the lower of the configured figure        _Bucket.limit    limit_of
  and the last header's
  a configured figure changed (a reload)               d1     update_profile   (each call's)
  a bucket: at most its limit, refilled at limit / 60         _Bucket.refill   level_of
  a second since its last stored refill
  the need: the estimated input plus the output               `.estimate`      the same
  reservation (docs/tokens.md)
  a need starts when every budget holds min(need,             wait_s           TOKENS_TAKE
  limit) (a request start: 1); else it waits for the
  refill
  a start takes the need from every budget with a      d2     reserve          TOKENS_TAKE
  limit; it is in flight until settled
  a need above a budget's whole limit never starts     d3     too_large        TOKENS_TAKE
  settlement: each budget it took from gets back what  d4     settle           TOKENS_SETTLE
  was reserved and not used (or gives what was used
  beyond), up to its limit; request starts stay taken
  a header's limit sets the budget's (a new one        d5     observe          TOKENS_SEEN
  appears)
  a header's remaining lowers the level to it (never   d6 d7  observe, _late   TOKENS_SEEN
  raises it) less what relay started since the
  answering request, its own aside: their input, one
  start each
  a header's reset sets nothing (an adapter turns a           -                -
  used-up budget's reset into a hold)
  a hold: no start until it ends but a connection      d8     hold, hold_left  TOKENS_SEEN,
  check's; a later end replaces it; no cap                                     TOKENS_TAKE
  an answer begun after the hold began, fine, ends it         observe(ok)      TOKENS_SEEN
  the first start after a hold goes alone until an     d9 d10 _probe           first,
  answer is back, it is settled or a new hold comes                            first_due

- d1: a changed figure refills the time since the last stored refill at its new rate, and
  here each look stores one (status, wait_s), there only a take, a settlement, a header;
  a figure removed and set again within a minute starts whole here, at its old level there.
- d2: here a start while no budget is known reserves nothing (`Budget.active` is false:
  the lane asks nothing), so a later header does not count it as started since.
- d3: during a hold the lane refuses it at once here; the scripts say "held" (they judge
  the size only for the head of the token queue, once no hold stands).
- d4: here a request started before a header lowered a level gives back no input (the
  header counted what it sent), only output; the scripts give back both.
- d5: a limit without a remaining, for a budget not known yet: empty here, whole there.
- d6: here the output reserved by requests in flight is taken off a ``remaining`` as well
  (tokens and output: the provider counts output as it is produced); not there.
- d7: a remaining at or above the (new) limit: here the level becomes the limit less what
  started since; there it stays (only a remaining below the level moves it).
- d8: the scripts' keys expire an hour after their last use (a start never settled is
  forgotten an hour after it began): a hold, or a header's limit, unused that long is gone.
- d9: there the first start goes alone for at most 30 s (``FIRST_MS``: its relay may die).
- d10: here a connection check started after the hold is the first start; never there.

(A lower limit holds the level to it at once there, at the next refill here: the same as
soon as any time has passed.)
"""

# layers: long because its theory of operation holds the one table of the token-budget
# rules that this module and the shared Lua scripts (relay.shared.budget_scripts) both keep.

from __future__ import annotations

import collections
import math
from collections.abc import Callable
from typing import Any

import attrs

from relay.vocab.errors import RelayError
from relay.vocab.limits import KINDS, RateLimits
from relay.vocab.profile import Profile

from .estimate import OUTPUT_FLOOR, Learned, estimate_input, estimate_text, output_reservation

__all__ = ["OUTPUT_FLOOR", "USAGE_WINDOW_MAX_HOLD_S", "Budget", "Learned", "Need",
           "Reservation", "bounded_hold", "estimate_input", "estimate_text", "held_error",
           "output_reservation", "too_large", "too_large_error"]

# (The estimate lives in `relay.capacity.estimate`; re-exported here, where it is used.)

_PROFILE_KEYS = {"tokens": "tpm", "input": "itpm", "output": "otpm"}
_WHAT = {"requests": "request starts", "tokens": "tokens", "input": "input tokens",
         "output": "output tokens"}


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
    least: int | None = None  # the fewest input tokens the provider may count (too_large)

    def cost(self, kind: str) -> int:
        if kind == "requests":
            return 1
        if kind == "tokens":
            return self.input + self.output
        return self.input if kind == "input" else self.output


@attrs.define(eq=False)
class Reservation:
    need: Need
    at: float
    settled: bool = False
    kinds: frozenset[str] | None = None  # the budgets it took from (None: every one)


@attrs.define
class _Bucket:
    configured: float = 0.0          # the profile's figure per minute (0: not set)
    header: float | None = None      # the provider's figure, from its last header
    header_at: float | None = None
    level: float = 0.0
    at: float = -math.inf
    remaining_said: float | None = None  # the last header's remaining, as it said

    @property
    def limit(self) -> float:
        figures = [f for f in (self.configured or None, self.header) if f]
        return min(figures) if figures else 0.0

    @property
    def source(self) -> str:
        if self.header and (not self.configured or self.header <= self.configured):
            return "header"
        return "configured"

    def refill(self, now: float) -> None:
        limit = self.limit
        if self.at == -math.inf:
            self.level = limit
        elif now > self.at:
            self.level = min(limit, self.level + (now - self.at) * limit / 60.0)
        self.at = now

    def wait_s(self, cost: float) -> float:
        if self.level >= cost - 1e-6:  # (a float's last bits are no reason to wait)
            return 0.0
        return (cost - self.level) * 60.0 / self.limit


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
        self._buckets: dict[str, _Bucket] = {}
        self._inflight: set[Reservation] = set()  # reservations not yet settled
        self._tightened_at = -math.inf  # when a header last lowered a level
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
            bucket = self._buckets.get(kind)
            if bucket is None and figure:
                bucket = self._buckets[kind] = _Bucket()
            if bucket is not None:
                bucket.configured = figure
                if not bucket.limit:
                    del self._buckets[kind]
        self.on_change()

    @property
    def busy(self) -> bool:
        """A reservation in flight."""
        return bool(self._inflight)

    @property
    def active(self) -> bool:
        """Any budget known (configured or learned), or a hold."""
        return (bool(self._buckets) or self.hold_state is not None or self._probe_due
                or self._probe is not None)

    def _live(self, now: float) -> dict[str, _Bucket]:
        for bucket in self._buckets.values():
            bucket.refill(now)
        return self._buckets

    # --- admission ------------------------------------------------------------------------
    def too_large(self, need: Need) -> tuple[str, int, float] | None:
        """(kind, need, limit) for a budget ``need`` exceeds as a whole, or None."""
        for kind, bucket in self._buckets.items():
            if kind != "requests" and need.cost(kind) > bucket.limit:
                return kind, need.cost(kind), bucket.limit
        return None

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
        for kind, bucket in self._live(now).items():
            wait = max(wait, bucket.wait_s(min(need.cost(kind), bucket.limit)))
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
        for kind, bucket in self._live(now).items():
            cost = min(need.cost(kind), bucket.limit)
            wait = bucket.wait_s(cost)
            if wait > 0 and (worst is None or wait > worst[0]):
                free = max(0, math.floor(bucket.level))
                worst = (wait, f"waiting for the provider's {_WHAT[kind]} budget: "
                               f"{free:,} of {cost:,} free, about {math.ceil(wait)} s")
        return worst[1] if worst else None

    def reserve(self, need: Need | None) -> Reservation | None:
        if need is None:
            return None
        now = self._clock()
        live = self._live(now)
        for kind, bucket in live.items():
            bucket.level -= need.cost(kind)
        reservation = Reservation(need, now, kinds=frozenset(live))
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
        and not used, and takes what was used beyond it)."""
        if reservation is None or reservation.settled:
            return
        reservation.settled = True
        self._inflight.discard(reservation)
        if reservation is self._probe:
            self._probe = None  # it ended without a 429 (a 429 set a new hold first)
        now = self._clock()
        used = Need(used_in, used_out)
        # A header that lowered a level after this reservation was made already counted
        # its real input: only its output is settled then (else it would count twice).
        counted = self._tightened_at >= reservation.at and count
        for kind, bucket in self._live(now).items():
            if kind == "requests" or (counted and kind == "input") or (
                    reservation.kinds is not None and kind not in reservation.kinds):
                continue
            back = reservation.need.cost(kind) - used.cost(kind)
            if counted and kind == "tokens":
                back = reservation.need.output - used.output
            bucket.level = min(bucket.limit, bucket.level + back)
        if count:
            self._count(now, used_in + used_out)
        self.on_change()

    # --- what the provider said -------------------------------------------------------------
    def observe(self, limits: RateLimits | None, *, started_at: float | None = None,
                ok: bool = False, reason: str = "rate_limited",
                own: Reservation | None = None) -> None:
        """An answer's rate-limit headers (and hold); see the module docstring.
        ``started_at``, ``own``: the answering attempt's start and reservation."""
        now = self._clock()
        if limits is not None:
            for kind, window in limits.windows.items():
                if kind not in KINDS:
                    continue
                bucket = self._buckets.get(kind)
                created = bucket is None
                if window.limit:
                    if bucket is None:
                        bucket = self._buckets[kind] = _Bucket()
                    bucket.refill(now)
                    bucket.header, bucket.header_at = window.limit, now
                if bucket is None or window.remaining is None:
                    continue
                bucket.refill(now)
                bucket.remaining_said = window.remaining
                pending = self._outstanding_out() if kind in ("tokens", "output") else 0
                said = min(bucket.limit, window.remaining - pending)
                # The provider's count only tightens relay's (or starts it), less what
                # relay started since the answering request (not in it yet, maybe).
                if created or said < bucket.level:
                    bucket.level = said - self._late(kind, started_at, own)
                    self._tightened_at = now
            if limits.hold_s is not None and limits.hold_s > 0:
                hold_s, cause = bounded_hold(limits, self.max_hold_s, reason)
                self.hold(now + hold_s, cause, reason)
        if ok:
            self._probe = None  # an answer came back: the rest may start
            if (self.hold_state is not None and started_at is not None
                    and started_at >= self.hold_state.since):
                self.hold_state = None  # an answer begun after the hold: it has lifted
        self.on_change()

    def _outstanding_out(self) -> int:  # output tokens reserved by requests in flight
        return sum(r.need.output for r in self._inflight)

    def _late(self, kind: str, started_at: float | None, own: Reservation | None) -> int:
        """What requests started since ``started_at`` (all, when None) take of a budget
        of ``kind``, ``own`` (the answering request's) aside; output is counted apart."""
        late = [r for r in self._inflight
                if r is not own and (started_at is None or r.at >= started_at)]
        if kind == "requests":
            return len(late)
        return sum(r.need.input for r in late) if kind in ("input", "tokens") else 0

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
        for kind, bucket in self._live(now).items():
            budgets[kind] = {
                "limit_per_minute": bucket.limit,
                "remaining": max(0, math.floor(bucket.level)),
                "source": bucket.source,
                "configured": bucket.configured or None,
                "header": bucket.header,
                "header_at": iso(bucket.header_at),
            }
        held = self.hold_left(now)
        minute = int(now // 60)
        history = dict(self._minutes)
        return {
            "budgets": budgets,
            "used_last_minute": self.used_last_minute(now),
            "reserved_output": self._outstanding_out(),
            "hold": ({"until": iso(self.hold_state.until), "left_s": round(held, 3),
                      "cause": self.hold_state.cause}
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
