"""One attempt's moving parts: what its adapter sends into (`AttemptSink`), what of the
answer reached the client (`Delivered`), and the attempt's own state (`Run`) that the
dispatcher watches (deadlines, progress, outcome)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

import attrs
import trio

from relay.vocab.errors import RelayError
from relay.vocab.events import Call, Delta, Finish, Usage
from relay.vocab.limits import RateLimits
from relay.vocab.records import Attempt

from .plan import Target

__all__ = ["AttemptSink", "Changes", "Delivered", "Run", "check_response"]


@attrs.define
class Delivered:
    """What of a streamed answer has reached the client, across attempts."""

    text: str = ""              # choice 0's text
    other_output: bool = False  # tool calls, extra fields, more choices: not continuable

    @property
    def any(self) -> bool:
        return bool(self.text) or self.other_output


class AttemptSink:
    """What an adapter sends into. Forwards events to the writer, tracks progress, and
    drops everything once the attempt is over.

    What it counts as sent — choice 0's text (for a prefill), other output, the choices
    opened and finished — is what the writer has been handed, never an event whose
    hand-over was cancelled: a fallback continues after exactly what reached the client
    (F8). The token times are the provider's progress: while a send waits for a slow
    client the adapter cannot read its upstream, so the stall clock starts again when the
    writer takes the event (a slow reader is waited for, SPEC C3; the writer bounds it).
    """

    def __init__(self, out: trio.MemorySendChannel[Any],
                 wake: Callable[[], None] | None = None) -> None:
        self._out = out
        # Tells the dispatcher its deadlines changed: on the first token (the first-token
        # limit ends) and when a blocked send completes (the stall clock starts again).
        # Later tokens only push the stall deadline on, which it re-checks when it wakes.
        self._wake = wake or (lambda: None)
        self.open_choices: set[int] = set()
        self.finished: set[int] = set()
        self.closed = False
        self.pieces: list[str] = []  # choice 0's text handed to the writer (for a prefill)
        self.other_output = False  # tool calls or extra fields: cannot be continued
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self._in_flight: trio.Event | None = None  # set when a blocked send has ended
        # SPEC L12: the answer's rate-limit headers go to the provider's budgets (never to
        # the writer), and its reported usage settles the attempt's reservation.
        self.on_limits: Callable[[RateLimits], None] | None = None
        self.usage: Usage | None = None
        self.read_chars = 0  # answer text this attempt read (for a stopped settlement)

    async def send(self, event: Any) -> None:
        if isinstance(event, RateLimits):
            if self.on_limits is not None and not self.closed:
                self.on_limits(event)
            return
        if isinstance(event, Usage) and not event.estimated:
            self.usage = event
        elif isinstance(event, Delta) and event.content:
            self.read_chars += len(event.content)
        if self.closed:
            # The attempt was left (timed out, or the request moved on): a late result is
            # never used. Its scope is cancelled too; this only makes sure.
            raise trio.ClosedResourceError("this attempt is over; its results are void")
        if isinstance(event, Delta):
            now = trio.current_time()
            self.last_token_at = now
            if self.first_token_at is None:
                self.first_token_at = now
                self._wake()
        # Hand the event over without a trip through the scheduler when the channel has
        # room: the writer then wakes to a batch it can coalesce into one send. The
        # adapter's next read of the network is its checkpoint; a full channel (a slow
        # client) still blocks here, so backpressure holds.
        gone = False
        try:
            try:
                self._out.send_nowait(event)
            except trio.WouldBlock:
                await self._send_blocked(event)
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            # The request is ending (its client left, a drain): the dispatcher or the
            # writer closed the channel while this task ran. Not the adapter's failure.
            gone = True
        if gone:
            self.closed = True
            await trio.lowlevel.checkpoint()  # its scope is cancelled by now: a stop
            raise trio.ClosedResourceError("this attempt is over; its results are void")
        self._handed_over(event)  # not reached when the hand-over was cancelled

    async def _send_blocked(self, event: Any) -> None:
        done = self._in_flight = trio.Event()
        try:
            await self._out.send(event)
        finally:
            self._in_flight = None
            done.set()
            if self.last_token_at is not None:
                self.last_token_at = trio.current_time()
            self._wake()

    def _handed_over(self, event: Any) -> None:
        if isinstance(event, Delta):
            self.open_choices.add(event.index)
            if event.content and event.index == 0:
                self.pieces.append(event.content)  # joined only when read: no O(n²)
            if event.tool_calls or event.extra or event.index != 0:
                self.other_output = True
        elif isinstance(event, Finish):
            self.open_choices.add(event.index)
            self.finished.add(event.index)

    @property
    def blocked(self) -> bool:
        """A send is waiting for the writer (the client reads slowly)."""
        return self._in_flight is not None

    async def settle(self) -> None:
        """Return once no send is half done. Call it after cancelling the attempt: a
        blocked send then either completes (the writer had already taken the event) or is
        abandoned, within a tick — only then does the sink say what was sent."""
        if self._in_flight is not None:
            await self._in_flight.wait()

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    @property
    def complete(self) -> bool:
        """Every choice the writer was handed has been handed its finish too."""
        return bool(self.finished) and self.open_choices <= self.finished


class Changes:
    """What the dispatcher waits on for an attempt: each ``poke`` wakes whoever waits on
    the current ``event``, once. The sink pokes it and the `Run` holds it; neither holds
    the other through it, so an attempt's objects form no reference cycle and are freed
    by their reference counts as the request ends, not by the cycle collector."""

    __slots__ = ("event",)

    def __init__(self) -> None:
        self.event = trio.Event()

    def poke(self) -> None:
        self.event.set()
        self.event = trio.Event()


@attrs.define(eq=False)
class Run:
    """One attempt in flight, as the dispatcher sees it."""

    target: Target
    call: Call
    sink: AttemptSink
    record: Attempt
    changes: Changes = attrs.field(factory=Changes)
    scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    queued_at: float | None = None  # when it joined its provider's queue (it had to wait)
    notice: trio.CancelScope | None = None  # a Queued notice still on its way to the writer
    running_since: float | None = None
    run_deadline: float = math.inf
    finished_at: float | None = None
    stopped_at: float | None = None  # when the dispatcher stopped it (a timeout)
    # The dispatcher has decided this attempt's outcome itself (it timed out, or its
    # answer had already reached the client whole): its task no longer writes one.
    left: bool = False
    error: RelayError | None = None
    has_fallback: bool = False  # a later target of the plan may take it (SPEC L12 holds)
    # SPEC L13: the accounts it must not use (they failed this request), and the one its
    # lane slot is on ("" for a provider without accounts; None before it has one).
    avoid: frozenset[str] = frozenset()
    account: str | None = None
    conversation: str | None = None  # its call's conversation, once asked (`needs`)

    @property
    def changed(self) -> trio.Event:
        return self.changes.event

    def poke(self) -> None:
        self.changes.poke()


def check_response(run: Run, stream: bool) -> None:
    """F8: a response check is part of the attempt. JSON modes must give JSON."""
    fmt = run.call.params.get("response_format")
    if stream or not isinstance(fmt, dict):
        return
    if fmt.get("type") in ("json_object", "json_schema"):
        try:
            json.loads(run.sink.text)
        except ValueError as exc:
            raise RelayError("bad_upstream_response", f"{run.target.name} was asked "
                             f"for JSON ({fmt['type']}) and answered text that is not "
                             "JSON", provider=run.target.provider.name) from exc
