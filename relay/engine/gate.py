"""A client's gate (SPEC L14): its per-minute limits (``rpm``, ``tpm``) and ``lanes``,
passed by each of its attempts, in order, before the provider's lane.

An attempt waits at the gate like any waiter — in order of arrival, cancellable, up to
its provider's ``queue_timeout_s``, its waiting notices naming the limit — then holds
one of the client's lanes until it leaves its provider's lane. ``lanes`` counts the
client's attempts running at once, across providers; ``rpm`` its starts in any 60 s
(the providers' own pacer, `relay.capacity.pacer`); ``tpm`` its tokens in any 60 s:
each attempt's estimate (input and output reservation) as it starts, settled to what it
used as it leaves.

Across relays (SPEC L11: ``[server] coordination_url`` set), ``rpm`` and ``tpm`` hold for
every relay together: the head of the gate, once this relay's own count lets it pass,
asks the coordination server (`relay.shared.client_limits`), which counts the start or
says how long to wait — waited exactly like a limit of its own. A chat attempt's request
is first admitted there under its client's per-day and per-month limits (``admit``, once
per request: `relay.engine.clients`). ``lanes`` stays per relay. The order of the
waiters is each relay's own (arrival, on that relay); across relays, whichever head asks
first when the minute allows.
"""

from __future__ import annotations

import collections
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Protocol

import trio

from relay.capacity.estimate import estimate_input, output_reservation
from relay.capacity.pacer import Pacer
from relay.config import ClientConfig
from relay.vocab.errors import RelayError
from relay.vocab.events import Call, LaneStatistics, Usage
from relay.vocab.records import Record

__all__ = ["Gate", "SharedMinute"]


class SharedMinute(Protocol):
    """What the gate asks of the coordination server (`relay.shared.client_limits`)."""

    def new_member(self) -> str: ...
    async def start(self, client: str, member: str, tokens: int, rpm: float, tpm: float
                    ) -> tuple[str, float, float] | None: ...
    def used_soon(self, client: str, member: str, estimate: int, used: int) -> None: ...


class Gate:
    """One client's per-minute limits and lanes (SPEC L14): its attempts pass here, in
    order, before they enter their provider's lane."""

    def __init__(self, name: str, settings: Callable[[str], ClientConfig], *,
                 shared: Callable[[], SharedMinute | None] = lambda: None,
                 admit: Callable[[str], Awaitable[None]] | None = None) -> None:
        self.name = name
        self._settings = settings
        self._shared = shared  # the coordination server's count, when there is one
        self._admit = admit    # a request's admission across relays (per day and month)
        self.running = 0
        self._pacer = Pacer()
        self._tokens: collections.deque[list[float]] = collections.deque()  # [at, tokens]
        self._tokens_sum = 0.0  # of the entries in _tokens: kept as they come and go
        self._cut = -math.inf   # entries started at or before it have left the minute
        self._waiting: list[object] = []   # in arrival order; only the first may pass
        self._changed = trio.Event()
        self.waiting_for: str | None = None  # what the first waiter waits for, in words

    def statistics(self) -> LaneStatistics:
        """The gate's numbers for a waiting notice."""
        config = self._settings(self.name)
        return LaneStatistics(running=self.running, capacity=config.lanes or self.running,
                              queued=len(self._waiting), queue_max=0,
                              waiting_for=self.waiting_for)

    def _poke(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def _tokens_in_minute(self, now: float) -> float:
        """Tokens of the starts of the last 60 s: a running sum (re-adding every entry
        cost ~1 ms a request at 18,000 of them)."""
        self._cut = max(self._cut, now - 60.0)
        while self._tokens and self._tokens[0][0] <= self._cut:
            self._tokens_sum -= self._tokens.popleft()[1]
        if not self._tokens:
            self._tokens_sum = 0.0  # (no float drift outlives an idle minute)
        return self._tokens_sum

    def _blocked(self, config: ClientConfig, tokens: int, now: float
                 ) -> tuple[str | None, float]:
        """What holds the next start back, in words, and until when (inf: a release)."""
        where = f"client {self.name!r}"
        if config.lanes and self.running >= config.lanes:
            return (f"{where}'s lanes limit: {self.running} of its {config.lanes} running "
                    f"([clients.{self.name}] lanes)", math.inf)
        if config.rpm:
            at = self._pacer.next_start(config.rpm)
            if at > now:
                return (f"{where}'s rpm limit of {config.rpm:g} requests a minute "
                        f"([clients.{self.name}] rpm)", at)
        if config.tpm:
            used = self._tokens_in_minute(now)
            if used and used + tokens > config.tpm:
                return (f"{where}'s tpm limit: {used:.0f} of its {config.tpm:g} tokens a "
                        f"minute used ([clients.{self.name}] tpm)", self._tokens[0][0] + 60.0)
        return None, now

    async def _across(self, shared: SharedMinute, member: str, config: ClientConfig,
                      tokens: int) -> tuple[str | None, float]:
        """Ask the coordination server for the start (it counts it, or says how long to
        wait): what holds it back, in words, and until when; (None, now) to go (the
        server counted it, or could not be asked: this relay's own count stands)."""
        said = await shared.start(self.name, member, tokens, config.rpm, config.tpm)
        now = trio.current_time()
        if said is None or said[0] == "ok":
            return None, now
        limit, wait_s, seen = said
        where = f"client {self.name!r}"
        if limit == "rpm":
            return (f"{where}'s rpm limit of {config.rpm:g} requests a minute across "
                    f"relays ({seen:.0f} started in the last minute; [clients.{self.name}] "
                    "rpm)", now + wait_s)
        return (f"{where}'s tpm limit across relays: {seen:.0f} of its {config.tpm:g} "
                f"tokens a minute used ([clients.{self.name}] tpm)", now + wait_s)

    @asynccontextmanager
    async def enter_call(self, call: Call, queue_timeout_s: float,
                         on_wait: Callable[[], None], record: Record,
                         usage: Callable[[], Usage | None]) -> AsyncIterator[None]:
        """`enter` for a chat attempt: its tokens estimated (input and output
        reservation) and settled to its ``usage`` as it leaves; its wait at the gate is
        queue time in its ``record``."""
        if self._admit is not None and self._shared() is not None:
            await self._admit(record.id)  # (``client_limit`` before anything is queued)
        began = trio.current_time()
        # (its tokens count only against a tpm limit: not estimated for a client without)
        tokens = (estimate_input(call) + output_reservation(call, None)
                  if self._settings(self.name).tpm else 0)
        async with self.enter(tokens, began + queue_timeout_s, on_wait) as passed:
            waited = trio.current_time() - began
            if waited > 0:
                record.queue_ms = round((record.queue_ms or 0.0) + waited * 1000, 3)
            try:
                yield
            finally:
                used = usage()
                if used is not None and used.total_tokens is not None:
                    passed.used(used.total_tokens)

    @asynccontextmanager
    async def enter(self, tokens: int, deadline: float,
                    on_wait: Callable[[], None]) -> AsyncIterator[_Pass]:
        """Pass the gate (waiting, in order, while a limit holds the client back), then
        hold one of its lanes until the block ends. ``on_wait`` is called once, when it
        first has to wait.

        Raises:
            RelayError: ``provider_queue_timeout`` at ``deadline``, naming the limit.
        """
        config = self._settings(self.name)
        if not config.minute_limited:
            yield _Pass(None)
            return
        me = object()
        self._waiting.append(me)
        told = False
        member: str | None = None  # its start on the coordination server, once counted
        shared = self._shared()
        try:
            while True:
                now = trio.current_time()
                config = self._settings(self.name)
                why, until = (self._blocked(config, tokens, now) if self._waiting[0] is me
                              else ("earlier requests of the same client", math.inf))
                if why is None and shared is not None and (config.rpm or config.tpm):
                    member = member or shared.new_member()
                    why, until = await self._across(shared, member, config, tokens)
                    now = trio.current_time()
                if why is None:
                    break
                if self._waiting[0] is me:
                    self.waiting_for = why
                if not told:
                    told = True
                    on_wait()
                if now >= deadline:
                    raise RelayError(
                        "provider_queue_timeout", f"the request waited until its queue "
                        f"timeout for {why}", retry_after_s=max(1.0, min(until, now + 60)
                                                               - now),
                        action=f"send fewer requests at once, or raise the limit in "
                               f"[clients.{self.name}]")
                with trio.move_on_at(min(until, deadline)):
                    await self._changed.wait()
        finally:
            self._waiting.remove(me)
            if not self._waiting:
                self.waiting_for = None
            self._poke()
        now = trio.current_time()
        self.running += 1
        self._pacer.add(now)
        entry = [now, float(tokens)]
        self._tokens.append(entry)
        self._tokens_sum += entry[1]
        try:
            yield _Pass(entry, self.name, shared if member else None, member, tokens, self)
        finally:
            self.running -= 1
            self._poke()


class _Pass:
    """An attempt through its client's gate: what it used is settled here (and on the
    coordination server, when its start was counted there)."""

    def __init__(self, entry: list[float] | None, client: str = "",
                 shared: SharedMinute | None = None, member: str | None = None,
                 estimate: int = 0, gate: Gate | None = None) -> None:
        self._entry = entry
        self._gate = gate
        self._client, self._shared, self._member = client, shared, member
        self._estimate = estimate

    def used(self, tokens: int) -> None:
        """The attempt used ``tokens`` (its reported usage), not its estimate."""
        if self._entry is not None:
            gate = self._gate
            if gate is not None and self._entry[0] > gate._cut:  # (still in the minute)
                gate._tokens_sum += float(tokens) - self._entry[1]
            self._entry[1] = float(tokens)
        if self._shared is not None and self._member is not None:
            self._shared.used_soon(self._client, self._member, self._estimate, tokens)
