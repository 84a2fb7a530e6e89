"""One account of a provider (SPEC L13): its slots, its pacer, its budgets and its state.

A provider may have several accounts — API keys, organisations, logged-in configurations
of a CLI tool. Each has its own ``lanes`` (slots), ``rpm`` pacer, token budgets and holds
(a `Meter`: the account's and each model's), and its own state: an account whose key is
refused (``auth_required``) or whose server does not answer is *out* of the choice for a
while (30 s, doubling on each failure in a row up to 10 min), then tried again by the
next request that needs it — an answer clears it. A connection check (a probe) may use
an account that is out: it is how one shows it has recovered. A provider without
accounts has one, named ``""``.

The lane (`relay.capacity.lanes.Lane`) keeps the one queue and asks each account when it
could start a waiter (`Account.ready_at`); the waiter starts on the account that can start
it soonest, ties going to the best fit where the token figures are configured, else to
the one with most headroom (`Account.headroom`).
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable, Mapping
from typing import Any

from relay.vocab.profile import ModelLimits, Profile

from .budget import Learned, Need
from .meter import Meter
from .pacer import Pacer

__all__ = ["OUT_FIRST_S", "OUT_MAX_S", "Account"]

OUT_FIRST_S = 30.0   # an account that failed is out of the choice this long, at first
OUT_MAX_S = 600.0    # ... doubling on each failure in a row, up to this


class Account:
    """One account's slots, pacer, budgets and state (see the module docstring)."""

    __slots__ = ("_clock", "_recent", "borrowed", "failures", "meter", "name", "out_message",
                 "out_reason", "out_until", "pacer", "profile", "started")

    def __init__(self, name: str, profile: Profile, clock: Callable[[], float],
                 limits: Mapping[str, ModelLimits] | None = None,
                 learned: Learned | None = None) -> None:
        self.name = name
        self.profile = profile
        self._clock = clock
        self.borrowed = 0  # slots of this account held now
        self.started = 0   # starts made on it (for the status)
        self.pacer = Pacer()
        self.meter = Meter(profile, clock, limits, learned=learned)
        self.out_until = -math.inf
        self.out_reason: str | None = None
        self.out_message: str | None = None
        self.failures = 0  # failures in a row that took it out
        # The tokens of the starts of the last minute (when, tokens): what it has taken,
        # known budget or not — so that work spreads by tokens, not by requests.
        self._recent: collections.deque[tuple[float, int]] = collections.deque()

    # --- admission ------------------------------------------------------------------------
    @property
    def free(self) -> bool:
        return self.borrowed < self.profile.lanes

    def usable(self, now: float, probe: bool = False, out_too: bool = False) -> bool:
        """In the choice: not out (a check may use one that is, to see it recover)."""
        return probe or out_too or now >= self.out_until

    def next_start(self) -> float:
        """The pacer's earliest next start (-inf when unpaced)."""
        return self.pacer.next_start(self.profile.rpm)

    def ready_at(self, need: Need | None, now: float, probe: bool = False,
                 out_too: bool = False) -> float:
        """When a waiter of ``need`` could start here: a free slot (inf: none now), the
        pacer, every budget and hold (``probe``: a check passes holds and may use an
        account that is out; ``out_too``: every account is out, so this one is tried)."""
        if not self.free or not self.usable(now, probe, out_too):
            return math.inf
        ready = self.next_start()
        if self.meter.active:
            wait = self.meter.wait_s(need, probe=probe, now=now)
            if wait > 0:
                ready = max(ready, now + wait)
        return ready

    def headroom(self, need: Need | None, now: float) -> tuple[float, float, float]:
        """How much room it has (larger: more): the least share left of the budgets
        ``need`` takes from (1.0 while none is known), then the fewest tokens started
        in the last minute (a provider meters tokens: with limits not yet known, work
        spreads by tokens, not by requests), then its free share of slots."""
        lanes = max(1, self.profile.lanes)
        return (round(self.meter.headroom(need), 3), -self.recent_tokens(now),
                (lanes - self.borrowed) / lanes)

    def recent_tokens(self, now: float) -> int:
        recent = self._recent
        while recent and recent[0][0] <= now - 60.0:
            recent.popleft()
        return sum(tokens for _, tokens in recent)

    def took(self, need: Need | None, now: float) -> None:
        """A start on it (its need's tokens count for a minute, `headroom`)."""
        self.started += 1
        if need is not None:
            self._recent.append((now, need.input + need.output))
            if len(self._recent) > 4096:
                self._recent.popleft()

    def untook(self, need: Need | None, at: float) -> None:
        """A start handed straight back: it took nothing."""
        self.started -= 1
        if need is not None:
            try:
                self._recent.remove((at, need.input + need.output))
            except ValueError:
                pass

    # --- state ------------------------------------------------------------------------------
    def failed(self, reason: str, message: str, now: float) -> None:
        """Its key was refused, its server did not answer: out of the choice a while."""
        self.failures += 1
        self.out_until = now + min(OUT_MAX_S, OUT_FIRST_S * 2 ** (self.failures - 1))
        self.out_reason, self.out_message = reason, message

    def answered(self) -> None:
        self.failures = 0
        self.out_until = -math.inf
        self.out_reason = self.out_message = None

    def state(self, now: float) -> str:
        """``ok``, ``held`` (a 429 or usage window), or ``out`` (failing, with a reason)."""
        if now < self.out_until:
            return "out"
        return "held" if self.meter.any_hold_left(now) > 0 else "ok"

    def why_not(self, need: Need | None, now: float) -> str:
        """Why it cannot start ``need`` now, in a few words (for an error naming each
        account)."""
        if now < self.out_until:
            return (f"{self.out_reason} for {math.ceil(self.out_until - now)} s more"
                    + (f" ({self.out_message})" if self.out_message else ""))
        scope = need.scope if need is not None else None
        held = self.meter.hold_left(now, scope)
        if held > 0:
            cause = self.meter.holder(scope).hold_state
            return (f"held {math.ceil(held)} s" + (f" ({cause.cause})" if cause is not None
                                                   and cause.cause else ""))
        if not self.free:
            return f"all {self.profile.lanes} lanes busy"
        why = self.meter.waiting_for(need, now) if self.meter.active else None
        return why or "ready"

    def status(self, iso: Callable[[float | None], str | None], now: float) -> dict[str, Any]:
        return {"name": self.name, "state": self.state(now),
                "state_reason": self.out_reason if now < self.out_until else None,
                "out_until": iso(self.out_until) if now < self.out_until else None,
                "warning": self.out_message if now < self.out_until else None,
                "running": self.borrowed, "capacity": self.profile.lanes,
                "started": self.started, "rpm": self.profile.rpm,
                "budgets": self.meter.status(iso)}
