"""The one writer of a chat request: events in, an HTTP answer out.

A writer reads the request's event channel — the adapters' `Delta`/`Finish`/`Usage`/
`Skipped`, and the dispatcher's `Queued`/`Started`/`AttemptStarted`/`Ended` — and is the
only code that calls ASGI ``send`` for its request (DESIGN). What the bytes look like is a
*dialect*'s business (OpenAI's chat completions, Anthropic's messages): the writer keeps
the timing and the rules that are the same for every dialect:

- a plain answer is sent whole, once the outcome is known (SPEC A2);
- a stream sends its headers at the first answer byte, or at once when the request has to
  wait (then a waiting notice every 2 s), or with the first heartbeat; heartbeats every
  ``heartbeat_s`` while nothing flows (SPEC A2, C3);
- ready events are coalesced into one ``send`` (hypercorn's cost is per send);
- a failure after the headers goes in-band and the stream ends without its "done" marker;
  a channel that ends without `Ended` is an internal error, never a silent end;
- the advisory fields the attempt's target dropped (SPEC A1a) go in the record and in
  ``X-Relay-Ignored-Fields`` when the headers go out; a later attempt that drops others
  says so in an SSE comment; a stream that asked for usage gets relay's estimate, marked
  ``estimated``, when the provider reported none.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

import trio

from relay.api import eager
from relay.config import ServerConfig
from relay.dialects.base import Answer, Dialect, dumps, merge_delta, new_choice
from relay.vocab.errors import RelayError
from relay.vocab.events import (
    AttemptStarted,
    Delta,
    Ended,
    Finish,
    LaneStatistics,
    Queued,
    Recovered,
    Skipped,
    Started,
    Usage,
)
from relay.vocab.records import Record

from .asgi import Message

__all__ = ["JSONWriter", "Responder", "StreamWriter"]

COALESCE_MAX = 256  # events folded into one `send` when they are ready together
WAITING_NOTICE_S = 2.0


class Responder(Protocol):
    """What a writer needs of the request it answers (`relay.front.exchange.Exchange`)."""

    dialect: Dialect
    record: Record
    server: ServerConfig
    include_usage: bool
    progress_events: bool
    ignored_fields: tuple[str, ...]
    dialect_ignored: tuple[str, ...]
    prompt_chars: int

    @property
    def headers_sent(self) -> bool: ...

    async def send(self, message: Message) -> None: ...
    async def send_json(self, status: int, obj: Any,
                        headers: list[tuple[bytes, bytes]] | None = None) -> None: ...
    async def send_error(self, error: RelayError) -> None: ...
    def fail(self, error: RelayError) -> None: ...
    async def write(self, data: bytes, *, more: bool = True) -> None: ...
    def all_ignored(self) -> list[str]: ...


class _Writer:
    def __init__(self, request: Responder, model: str) -> None:
        self.request = request
        self.dialect = request.dialect
        self.model = model  # "provider/model" of the attempt that answers
        self.send = request.send
        self.record = request.record
        self.created = int(time.time())

    def _note(self, event: Any) -> None:
        if isinstance(event, Usage):
            self.record.usage = event.as_dict()
        elif isinstance(event, Skipped):
            self.record.skipped_events.append(event.detail)
        elif isinstance(event, Recovered):  # SPEC E3: a salvaged answer
            self.record.recovered = True

    async def send_error(self, error: RelayError) -> None:
        self.request.fail(error)
        await self.request.send_error(error)

    def _ignored(self, event: AttemptStarted) -> bytes:
        """The target's dropped fields: in the record, and in the headers while they are
        not out; after, an SSE comment when they differ from what the headers said."""
        if not self.request.headers_sent:
            self.request.ignored_fields = event.ignored
            self.record.ignored_fields = self.request.all_ignored()
            return b""
        self.record.ignored_fields = list(dict.fromkeys(
            [*self.request.dialect_ignored, *event.ignored]))
        if event.ignored == self.request.ignored_fields:
            return b""
        self.request.ignored_fields = event.ignored
        names = ", ".join(event.ignored) or "none"
        return self._comment(f"relay: {event.model} ignores the request fields: {names}")

    def _comment(self, text: str) -> bytes:
        """An SSE comment, or what the dialect's stream writes instead (`StreamEncoder`
        may have a ``comment``: the Gemini dialect's, for clients whose parser cannot
        skip a comment line)."""
        encoder = getattr(self, "encoder", None)
        write = getattr(encoder, "comment", None)
        return write(text) if write is not None else f": {text}\n\n".encode()


def _chars(delta: Delta) -> int:
    """A delta's answer characters (text and tool-call arguments)."""
    total = len(delta.content or "")
    for call in delta.tool_calls or ():
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict) and isinstance(function.get("arguments"), str):
            total += len(function["arguments"])
    return total


def _estimate(chars: int) -> int:
    return (chars + 3) // 4  # about four characters a token


class _Attempts:
    """A continued answer's usage is the sum of its attempts' (SPEC L12a: a prefill
    continuation reported only its own). An attempt that reported none counts relay's
    estimate of its prompt and of the text it gave, marked estimated."""

    def __init__(self, prompt_chars: int) -> None:
        self.prompt_chars = prompt_chars
        self.before: Usage | None = None  # the attempts this one continues
        self.reported: Usage | None = None  # this attempt's own
        self.chars = 0  # this attempt's answer text

    def fresh(self) -> None:
        """An attempt that starts the answer over: what came before is void."""
        self.before, self.reported, self.chars = None, None, 0

    def continued(self) -> None:
        """An attempt that continues the text so far: the last one's usage is kept."""
        last = self.reported or self.estimate()
        self.before = last if self.before is None else self.before.plus(last)
        self.reported, self.chars = None, 0

    def estimate(self) -> Usage:
        prompt, completion = _estimate(self.prompt_chars), _estimate(self.chars)
        return Usage(prompt, completion, prompt + completion, estimated=True)

    def total(self, usage: Usage) -> Usage:
        """The whole answer's usage, ``usage`` being the latest attempt's."""
        return usage if self.before is None else self.before.plus(usage)


async def _next_event(events: trio.MemoryReceiveChannel[Any]) -> Any:
    """The next event, or None once the channel is closed (`relay.api.eager`)."""
    try:
        return await eager.receive(events)
    except trio.EndOfChannel:
        return None


class JSONWriter(_Writer):
    """A plain answer: nothing is sent until the outcome is known (SPEC A2)."""

    async def pump(self, events: trio.MemoryReceiveChannel[Any]) -> None:
        choices: dict[int, dict[str, Any]] = {}
        usage: Usage | None = None
        attempts = _Attempts(self.request.prompt_chars)
        while (event := await _next_event(events)) is not None:
            if isinstance(event, Delta):
                merge_delta(choices.setdefault(event.index, new_choice(event.index)), event)
                attempts.chars += _chars(event)
            elif isinstance(event, Finish):
                choices.setdefault(event.index, new_choice(event.index))["finish_reason"] = (
                    event.reason)
            elif isinstance(event, AttemptStarted):
                self.model = event.model
                self._ignored(event)
                if not event.continues:  # whatever an earlier attempt produced is void
                    choices.clear()
                    usage = self.record.usage = None
                    self.record.recovered = False
                    attempts.fresh()
                else:
                    attempts.continued()
            elif isinstance(event, Ended):
                if event.error is not None:
                    await self.send_error(event.error)
                    return
                if attempts.before is not None and attempts.reported is None:
                    usage = attempts.total(attempts.estimate())  # the last said nothing
                    self._note(usage)
                answer = Answer(id=self.record.id, created=self.created, model=self.model,
                                choices=choices, usage=usage)
                await self.request.send_json(200, self.dialect.render(answer))
                return
            else:
                if isinstance(event, Usage):
                    attempts.reported = event
                    usage = event = attempts.total(event)
                self._note(event)
        raise RuntimeError("the attempt ended without saying how")


class StreamWriter(_Writer):
    """A streamed answer: SSE, heartbeats, waiting notices, coalesced sends."""

    def __init__(self, request: Responder, model: str) -> None:
        super().__init__(request, model)
        self.heartbeat_s = request.server.heartbeat_s
        self.last_write = trio.current_time()
        self.queued_at: float | None = None
        # The statistics of the lane we wait in, while we wait.
        self.queued_on: Callable[[], LaneStatistics] | None = None
        self.encoder = self.dialect.encoder(self.record.id, self.created,
                                            request.include_usage)
        self.encoder.begin(model)
        self._keepalive = self._comment("keepalive")
        self.usage_seen = False
        self.attempts = _Attempts(request.prompt_chars)  # for the usage (and its estimate)

    async def _write(self, data: bytes, *, more: bool = True) -> None:
        await self.request.write(data, more=more)  # headers first; bounded (SPEC C3)
        self.last_write = trio.current_time()

    def _waiting_notice(self) -> bytes:
        assert self.queued_on is not None  # only sent while queued
        stats = self.queued_on()
        now = trio.current_time()
        elapsed = now - (self.queued_at if self.queued_at is not None else now)
        if self.request.progress_events:
            data: dict[str, Any] = {"running": stats.running, "capacity": stats.capacity,
                    "queued": stats.queued, "elapsed_s": round(elapsed, 1)}
            if stats.waiting_for:  # the provider's token budget or hold (SPEC L12)
                data["waiting_for"] = stats.waiting_for
            return b"event: relay.waiting\ndata: " + dumps(data) + b"\n\n"
        if stats.waiting_for:
            return self._comment(f"{stats.waiting_for} (running {stats.running}/"
                                 f"{stats.capacity}, queued {stats.queued}, {elapsed:.0f} s)")
        return self._comment(f"waiting, starts when earlier requests finish (running "
                             f"{stats.running}/{stats.capacity}, queued {stats.queued}, "
                             f"{elapsed:.0f} s)")

    async def pump(self, events: trio.MemoryReceiveChannel[Any]) -> None:
        # long because it is the stream's one loop: every event kind, heartbeats, notices and
        # the coalesced send decided where each other can be seen (SPEC A2, C3).
        start = trio.current_time()
        next_notice = float("inf")
        encoder = self.encoder
        while True:
            if self.request.headers_sent:
                next_beat = self.last_write + self.heartbeat_s
            else:
                next_beat = start + self.heartbeat_s
            first = None
            with trio.move_on_at(min(next_beat, next_notice)):
                try:
                    first = await events.receive()
                except trio.EndOfChannel:
                    raise RuntimeError("the attempt ended without saying how") from None
            if first is None:
                now = trio.current_time()
                if now >= next_notice:
                    next_notice = now + WAITING_NOTICE_S
                    await self._write(self._waiting_notice())
                elif now >= next_beat:
                    await self._write(self._keepalive)
                continue
            batch = [first]
            while len(batch) < COALESCE_MAX:
                try:
                    batch.append(events.receive_nowait())
                except (trio.WouldBlock, trio.EndOfChannel):
                    break
            out = bytearray()
            ended: Ended | None = None
            for event in batch:
                if isinstance(event, Delta):
                    out += encoder.delta(event)
                    self.attempts.chars += _chars(event)
                elif isinstance(event, Finish):
                    out += encoder.finish(event)
                elif isinstance(event, Usage):
                    self.attempts.reported = event
                    event = self.attempts.total(event)
                    encoder.set_usage(event)
                    self.usage_seen = True
                    self._note(event)
                elif isinstance(event, AttemptStarted):
                    self.model = event.model
                    out += self._ignored(event)
                    self.usage_seen = False  # this attempt's is to come (else an estimate)
                    if not event.continues:
                        encoder.begin(event.model)
                        self.record.usage = None
                        self.record.recovered = False
                        self.attempts.fresh()
                    else:
                        self.attempts.continued()
                elif isinstance(event, Queued):
                    self.queued_on = event.statistics
                    self.queued_at = trio.current_time()
                    next_notice = self.queued_at  # at once, then every 2 s
                elif isinstance(event, Started):
                    next_notice = float("inf")
                elif isinstance(event, Ended):
                    ended = event
                else:
                    self._note(event)
            if ended is None:
                if out:
                    await self._write(bytes(out))
                continue
            if ended.error is not None:
                if not self.request.headers_sent and not out:
                    await self.send_error(ended.error)  # nothing sent yet: a real status
                    return
                self.request.fail(ended.error)
                out += encoder.error(ended.error)
                await self._write(bytes(out), more=False)
                return
            if self.request.include_usage and not self.usage_seen:
                # Asked for usage, and the provider reported none: relay's estimate.
                usage = self.attempts.total(self.attempts.estimate())
                encoder.set_usage(usage)
                self._note(usage)
            out += encoder.done()
            await self._write(bytes(out), more=False)
            return
