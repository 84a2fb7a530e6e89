"""A provider's budgets as the provider meters them (SPEC L12a): the account's, and one
per model.

Theory of operation. A rate-limit header describes the answering model's own window at
that account (OpenAI meters each model, Anthropic each model class, Gemini each model's
quota). So `Meter` keeps one `Budget` for the account — the profile's configured `rpm`-
free figures (`tpm`, `itpm`, `otpm`: what the user gave for the whole provider) and the
holds of 429s that name no model — and one `Budget` per model *scope* (`scope_of`: the
model's name less a date or ``-latest`` suffix) for everything the provider said about
that model: the budgets its headers describe, the hold of a 429 that names it, and the
figures `[providers.NAME.limits."MODEL"]` configures (``rpm`` included: a model's
request budget). A request takes from the account's budgets and its own model's, never
from another model's: one model's empty bucket or 429 does not slow the others.

Before the first answer (`Profile.first_starts`, N > 0): until a model has been answered
once, at most N of its requests run at once; the first answer's headers (seconds away)
tell relay the model's budgets and its usage what the provider counts of relay's
estimate (`relay.capacity.estimate.InputRatio`), so a burst at start-up does not run
into the limits it could have read. A streamed answer's headers come at its start: the
gate opens when the first answer is whole (settled), or with an error answer. The
others wait at most `FIRST_WAIT_S` after the first start (a long non-streamed answer
brings its headers only at its end). 0 turns this off (local servers
and CLI tools, which send no headers).

The lane (`relay.capacity.lanes`) asks a `Meter` exactly what it asked a `Budget`; the
grant is a `Grant`, the reservations it made in each budget.

Bounded: at most `MAX_MODELS` model budgets; the least recently used one that holds
nothing (no request in flight, no hold, no configured figure) is forgotten first.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from relay.vocab.limits import RateLimits
from relay.vocab.profile import ModelLimits, Profile

from .budget import Budget, Learned, Need, Reservation

__all__ = ["CACHE_LIFETIME_S", "MAX_MODELS", "Conversations", "Grant", "Meter", "scope_of"]

MAX_MODELS = 256
FIRST_WAIT_S = 10.0  # the longest the first-answer gate keeps a model's other requests
_SUFFIX = re.compile(r"(?:-\d{8}|-\d{4}-\d{2}-\d{2}|-latest)$")


def scope_of(model: str) -> str:
    """A model's budget scope: ``claude-sonnet-4-5-20250929`` and ``claude-sonnet-4-5``
    (or ``…-latest``) are one model to the provider's limits."""
    return _SUFFIX.sub("", model)


@attrs.define(eq=False)
class Grant(Reservation):
    """One start's reservations: in the account's budgets and its model's."""

    parts: tuple[tuple[Budget, Reservation], ...] = ()
    scope: str = ""
    first: bool = False  # started before its model's first answer (counted in the gate)


class Meter:
    """A provider's (an account's) budgets: see the module docstring."""

    def __init__(self, profile: Profile, clock: Callable[[], float],
                 limits: Mapping[str, ModelLimits] | None = None,
                 learned: Learned | None = None) -> None:
        self._clock = clock
        # The output reservation's percentile, by model (one for a provider's accounts:
        # how long a model answers is the model's, not the account's).
        self.learned = learned if learned is not None else Learned()
        self.account = Budget(profile, clock)
        self.account.on_change = self._changed
        self._models: dict[str, Budget] = {}  # by scope, least recently used first
        self._limits: dict[str, ModelLimits] = {}
        self._answered: set[str] = set()  # scopes answered at least once
        self._first: dict[str, int] = {}  # scope: starts in flight before its first answer
        self._first_at: dict[str, float] = {}  # scope: when its first start went
        self.on_change: Callable[[], None] = lambda: None
        self.update_profile(profile, limits)

    def _changed(self) -> None:
        self.on_change()

    # --- configuration ------------------------------------------------------------------
    def update_profile(self, profile: Profile,
                       limits: Mapping[str, ModelLimits] | None = None) -> None:
        self._profile = profile
        if limits is not None:
            self._limits = {scope_of(m): figures for m, figures in limits.items()}
        self.account.update_profile(profile)
        for scope in set(self._limits) | set(self._models):
            budget = self._model(scope, create=scope in self._limits)
            if budget is not None:
                budget.update_profile(self._model_profile(scope))
        self.on_change()

    def _model_profile(self, scope: str) -> Profile:
        figures = self._limits.get(scope, ModelLimits())
        return attrs.evolve(self._profile, rpm=figures.rpm, tpm=figures.tpm,
                            itpm=figures.itpm, otpm=figures.otpm)

    def _model(self, scope: str, *, create: bool) -> Budget | None:
        budget = self._models.pop(scope, None)
        if budget is None:
            if not create or not scope:
                return None
            budget = Budget(self._model_profile(scope), self._clock, requests=True)
            budget.on_change = self._changed
            self._forget_some()
        self._models[scope] = budget  # (most recently used last)
        return budget

    def _forget_some(self) -> None:
        while len(self._models) >= MAX_MODELS:
            for scope, budget in self._models.items():
                if (scope not in self._limits and not budget.busy
                        and budget.hold_left() <= 0):
                    del self._models[scope]
                    break
            else:
                return  # every one holds something: keep them (bounded by the traffic)

    def budgets(self, scope: str | None) -> list[Budget]:
        """The budgets a request of model ``scope`` takes from."""
        model = self._models.get(scope) if scope else None
        return [self.account] if model is None else [self.account, model]

    @property
    def active(self) -> bool:
        """Anything to ask before a start: a budget, a hold, or the first-answer gate."""
        return (self._profile.first_starts > 0 or self.account.active
                or any(b.active for b in self._models.values()))

    # --- admission ------------------------------------------------------------------------
    def _gated(self, scope: str, now: float) -> float:
        """How long a start of ``scope`` still waits for its model's first answer (0:
        none); never longer than `FIRST_WAIT_S` after its first start (an answer that
        takes long, its headers with it, must not hold the others all that time)."""
        first = self._profile.first_starts
        if (first <= 0 or scope in self._answered or self._first.get(scope, 0) < first):
            return 0.0
        return max(0.0, self._first_at.get(scope, now) + FIRST_WAIT_S - now)

    def current(self, need: Need | None) -> Need | None:
        """A waiter's need as the estimate says it now (`Need.current`: relay learned
        what the provider counts while it waited)."""
        return None if need is None else need.current()

    def too_large(self, need: Need) -> tuple[str, int, float] | None:
        """(kind, need, limit) of a budget ``need`` could never fit; a need relay is not
        sure of (a prompt the provider may read from its cache) is sent, not refused."""
        if not need.sure:
            return None
        if need.least is not None:  # judged on the fewest the provider may count
            need = attrs.evolve(need, input=min(need.input, need.least))
        for budget in self.budgets(need.scope):
            found = budget.too_large(need)
            if found is not None:
                return found
        return None

    def hold_left(self, now: float | None = None, scope: str | None = None) -> float:
        return max(b.hold_left(now) for b in self.budgets(scope))

    def any_hold_left(self, now: float | None = None) -> float:
        """The longest hold of the account or any of its models."""
        return max([self.account.hold_left(now),
                    *(b.hold_left(now) for b in self._models.values())])

    def holder(self, scope: str | None) -> Budget:
        """The budget whose hold lasts longest for ``scope`` (the account's when none)."""
        return max(self.budgets(scope), key=lambda b: b.hold_left())

    def wait_s(self, need: Need | None, *, probe: bool = False, now: float | None = None
               ) -> float:
        scope = need.scope if need is not None else None
        wait = max(b.wait_s(need, probe=probe, now=now) for b in self.budgets(scope))
        if need is not None and not probe:  # (woken sooner by its model's first answer)
            wait = max(wait, self._gated(need.scope, self._clock() if now is None else now))
        return wait

    def headroom(self, need: Need | None) -> float:
        """The least share left after ``need`` in the budgets it takes from."""
        scope = need.scope if need is not None else None
        return min(b.headroom(need) for b in self.budgets(scope))

    def waits_for_model(self, need: Need | None, now: float) -> bool:
        """A start of ``need`` waits only for its own model (its budgets, hold or first
        answer), not for the account's: a request of another model may go before it."""
        if need is None or not need.scope or self.account.wait_s(need, now=now) > 0:
            return False
        model = self._models.get(need.scope)
        return ((model is not None and model.wait_s(need, now=now) > 0)
                or self._gated(need.scope, now) > 0)

    def waiting_for(self, need: Need | None, now: float | None = None) -> str | None:
        scope = need.scope if need is not None else None
        for budget in self.budgets(scope):
            why = budget.waiting_for(need, now)
            if why is not None:
                return why
        if need is not None and self._gated(need.scope, self._clock()):
            return (f"waiting for the provider's first answer for model {need.scope!r} "
                    f"(relay starts {self._profile.first_starts} before it has read the "
                    "model's limits)")
        return None

    def reserve(self, need: Need | None) -> Grant | None:
        if need is None:
            return None
        parts = []
        for budget in self.budgets(need.scope):
            reservation = budget.reserve(need)
            if reservation is not None:
                parts.append((budget, reservation))
        first = self._profile.first_starts > 0 and need.scope not in self._answered
        if first:
            self._first[need.scope] = self._first.get(need.scope, 0) + 1
            self._first_at.setdefault(need.scope, self._clock())
        return Grant(need, self._clock(), parts=tuple(parts), scope=need.scope,
                     first=first)

    def _ended(self, grant: Grant) -> None:
        if grant.first:
            grant.first = False
            left = self._first.get(grant.scope, 0) - 1
            if left > 0:
                self._first[grant.scope] = left
            else:
                self._first.pop(grant.scope, None)

    def cancel(self, grant: Reservation | None) -> None:
        """A grant handed straight back: it took nothing."""
        if isinstance(grant, Grant) and not grant.settled:
            grant.settled = True
            self._ended(grant)
            for budget, part in grant.parts:
                budget.cancel(part)
            self.on_change()

    def settle(self, grant: Reservation | None, used_in: int, used_out: int, *,
               count: bool = True) -> None:
        """Move a grant's reservations to what was used (`Budget.settle`)."""
        if not isinstance(grant, Grant) or grant.settled:
            return
        grant.settled = True
        self._ended(grant)
        if count:
            self._answered.add(grant.scope)
            self._first_at.pop(grant.scope, None)
        for budget, part in grant.parts:
            budget.settle(part, used_in, used_out, count=count)
        self.on_change()

    # --- what the provider said -------------------------------------------------------------
    def observe(self, limits: RateLimits | None, *, scope: str = "",
                started_at: float | None = None, ok: bool = False,
                reason: str = "rate_limited", own: Reservation | None = None) -> None:
        """An answer's headers (the model's budgets) and hold: a 429 that names its model
        (or carries the model's rate-limit headers) holds the model, else the account."""
        if scope and not ok:  # (a 200's headers may come at its start: the gate opens
            self._answered.add(scope)  # at its settlement, its usage learned too)
            self._first_at.pop(scope, None)
        mine = dict(own.parts) if isinstance(own, Grant) else {}
        windows = limits.windows if limits is not None else {}
        model = self._model(scope, create=bool(windows) or bool(
            limits is not None and limits.hold_s and limits.names_model))
        if limits is not None and windows and model is not None:
            model.observe(attrs.evolve(limits, hold_s=None), started_at=started_at,
                          own=mine.get(model))
        if limits is not None and limits.hold_s:
            held = model if model is not None and limits.names_model else self.account
            held.observe(RateLimits(hold_s=limits.hold_s, cause=limits.cause),
                         reason=reason)
        if ok:
            for budget in self.budgets(scope):
                budget.observe(None, started_at=started_at, ok=True, own=mine.get(budget))
        self.on_change()

    def hold(self, until: float, cause: str, reason: str = "rate_limited",
             scope: str = "") -> None:
        budget = self._model(scope, create=True) if scope else self.account
        assert budget is not None
        budget.hold(until, cause, reason)

    # --- visibility ---------------------------------------------------------------------------
    def status(self, iso: Callable[[float | None], str | None]) -> dict[str, Any]:
        """The account's budgets (as `Budget.status`), and ``models``: each model's."""
        status = self.account.status(iso)
        status["models"] = {scope: budget.status(iso)
                            for scope, budget in sorted(self._models.items())}
        if status["tokens_limit"] is None:  # the chart's line: the largest model's
            status["tokens_limit"] = max((m["tokens_limit"] or 0
                                          for m in status["models"].values()),
                                         default=0) or None
        status["first_answer_pending"] = sorted(s for s, n in self._first.items() if n)
        return status


CACHE_LIFETIME_S = 300.0  # a provider's prompt cache (Anthropic's default, OpenAI's least)
CONVERSATIONS = 4096      # conversations remembered (least recently seen forgotten)


@attrs.define
class _Cached:
    at: float
    ratio: float   # the provider's prompt count over relay's estimate, last time
    cached: int    # prompt tokens the provider has in its cache now (read + written)


class Conversations:
    """What the last answer of each conversation said of the provider's prompt cache
    (SPEC L12a): a conversation whose last answer was read mostly from the cache, within
    the cache's lifetime, is expected to be read from it again. Bounded (`CONVERSATIONS`)."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._seen: dict[str, _Cached] = {}

    def expect(self, key: str) -> _Cached | None:
        """The conversation's cache as last seen, if it may still be there."""
        seen = self._seen.get(key)
        if seen is None or self._clock() - seen.at > CACHE_LIFETIME_S:
            return None
        return seen

    def saw(self, key: str, estimate: int, prompt: int, cached: int) -> None:
        """An answer: relay estimated ``estimate``, the provider counted ``prompt``, of
        which ``cached`` is in its cache now (read from it, or written to it)."""
        self._seen.pop(key, None)
        if cached <= 0 or estimate <= 0:
            return
        while len(self._seen) >= CONVERSATIONS:
            del self._seen[next(iter(self._seen))]
        self._seen[key] = _Cached(self._clock(), prompt / estimate, cached)

    def uncached(self, key: str, estimate: int) -> int | None:
        """The part of a prompt of ``estimate`` (relay's count) expected *not* to be read
        from the cache, in relay's units; None: nothing known."""
        seen = self.expect(key)
        if seen is None:
            return None
        cached = seen.cached / seen.ratio if seen.ratio > 0 else 0.0
        return max(1, math.ceil(estimate - cached))
