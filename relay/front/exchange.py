"""One HTTP exchange on a relay route: the request lifecycle that chat (every dialect) and
fan-out share.

An `Exchange` owns what every relay route needs, whatever it runs: the record (written
exactly once, in a synchronous ``finally``), the stop handle the relay can reach (a
drain), the request's nursery, turning ``http.disconnect`` into the nursery's
cancellation (relay's server calls `Exchange.drop_client` as the client leaves; under
another ASGI server a watcher task waits on ``receive``), the bounded stream write, and
the request's `Phase`. What runs inside is a `Handler`: `relay.front.chat.Chat` or
`relay.front.fanout.Fanout`.

The phase is the request's one explicit state, moved only by the transitions below
(an illegal one raises); ``headers_sent``, ``answered`` and ``client_gone`` are read off
it::

    received ──▶ running ──▶ headers_sent ──▶ answered ──▶ ended
       │            │             └──▶ gone_mid_stream ──▶ ended
       └────────────┴──▶ gone ──▶ ended         (every phase but answered ──▶ ended too:
                                                  a crash, or relay stopping)
"""

from __future__ import annotations

import enum
import logging
from typing import Any, Protocol

import trio

from relay.dialects.base import Dialect
from relay.engine.engine import Engine
from relay.engine.stops import RequestStop
from relay.vocab.errors import RelayError, untraced
from relay.vocab.records import Record

from .asgi import Message, Receive, Scope, Send, send_error, send_json

__all__ = ["Exchange", "Handler", "Phase"]

logger = logging.getLogger(__name__)


class Phase(enum.Enum):
    RECEIVED = "received"                # the guard handed over the whole body
    RUNNING = "running"                  # planned; its dispatchers run; nothing sent yet
    HEADERS_SENT = "headers_sent"        # http.response.start is out
    ANSWERED = "answered"                # the last body byte was handed to the server
    GONE = "gone"                        # the client left before any header
    GONE_MID_STREAM = "gone_mid_stream"  # the client left after the headers
    ENDED = "ended"                      # the record is written


_NEXT: dict[Phase, frozenset[Phase]] = {
    Phase.RECEIVED: frozenset({Phase.RUNNING, Phase.HEADERS_SENT, Phase.GONE, Phase.ENDED}),
    Phase.RUNNING: frozenset({Phase.HEADERS_SENT, Phase.GONE, Phase.ENDED}),
    Phase.HEADERS_SENT: frozenset({Phase.ANSWERED, Phase.GONE_MID_STREAM, Phase.ENDED}),
    Phase.ANSWERED: frozenset({Phase.ENDED}),
    Phase.GONE: frozenset({Phase.ENDED}),
    Phase.GONE_MID_STREAM: frozenset({Phase.ENDED}),
    Phase.ENDED: frozenset(),
}


class Handler(Protocol):
    """What runs inside an exchange."""

    def prepare(self, exchange: Exchange, body: bytes) -> None:
        """Parse and plan; raise `RelayError` to refuse (nothing has run)."""

    async def run(self, exchange: Exchange, nursery: trio.Nursery, stop: RequestStop
                  ) -> None:
        """Run inside the request's nursery and write the whole answer."""

    def settle(self, exchange: Exchange, stop: RequestStop) -> bool:
        """Fold what ran (attempts, stop and release times) into ``exchange.record``; sync
        and idempotent. True when that is final: every attempt has ended."""


class Exchange:
    """One request on a relay route. See the module docstring."""

    def __init__(self, relay: Engine, scope: Scope, receive: Receive, send: Send,
                 dialect: Dialect) -> None:
        self.relay = relay
        self.dialect = dialect
        self.scope = scope
        self.receive = receive
        self._send = send
        self.server = relay.config.server
        self.writes_bounded = scope.get("relay.writes_bounded", False)
        # SPEC L14: the client the guard found by the token (never the token itself).
        self.client: str = scope.get("relay.client", "default")
        self.record = Record(id=scope["relay.request_id"], started_at=trio.current_time(),
                             endpoint=scope["path"], client=self.client)
        scope["relay.record"] = self.record  # the guard's log line reads the model, reason
        self.phase = Phase.RECEIVED
        self.request_scope = trio.CancelScope()  # the request's nursery's, once it runs
        self.include_usage = False
        self.progress_events = False
        # SPEC A1a: the advisory fields the target dropped, as X-Relay-Ignored-Fields when
        # the headers go out; and the prompt's size, should relay have to estimate usage.
        self.ignored_fields: tuple[str, ...] = ()
        self.prompt_chars = 0
        # The record is written before the last byte goes out whenever it is final by
        # then (relay.vocab.records says what a record claims): ``_final`` settles it and
        # says whether it is. (What it settles is held as data, not in a closure over
        # this exchange: a request's objects are then freed by their reference counts,
        # not left for the cycle collector.)
        self.recorded = False
        self._refused = False
        self._running: tuple[Handler, RequestStop] | None = None
        # Fields the dialect's own translation dropped (the Responses API's), reported with
        # the target's own drops (``ignored_fields``, SPEC A1a).
        self.dialect_ignored: tuple[str, ...] = ()

    # --- the phase ------------------------------------------------------------------------
    def advance(self, phase: Phase) -> None:
        if phase not in _NEXT[self.phase]:
            raise RuntimeError(f"request {self.record.id}: {self.phase.value} → "
                               f"{phase.value} is not a transition")
        self.phase = phase

    @property
    def headers_sent(self) -> bool:
        return self.phase in (Phase.HEADERS_SENT, Phase.ANSWERED, Phase.GONE_MID_STREAM)

    @property
    def answered(self) -> bool:
        return self.phase is Phase.ANSWERED

    @property
    def client_gone(self) -> bool:
        return self.phase in (Phase.GONE, Phase.GONE_MID_STREAM)

    # --- sending --------------------------------------------------------------------------
    async def send(self, message: Message) -> None:
        if self.client_gone:
            # It left while this task ran (relay's server says so the moment it happens,
            # not at our next wait): the request's scope is cancelled, so stop here.
            await trio.lowlevel.checkpoint_if_cancelled()
            return  # (shielded: there is no one to send to)
        if message["type"] == "http.response.start":
            self.advance(Phase.HEADERS_SENT)
        elif not message.get("more_body"):
            self.advance(Phase.ANSWERED)  # from here on, a disconnect is the normal end
            if not self.recorded and self._final():
                self.recorded = True  # a kill -9 after the last byte cannot lose it now
                self.relay.records.write(self.record)
        await self._send(message)

    def _final(self) -> bool:
        if self._refused:
            return True
        if self._running is None:
            return False
        handler, stop = self._running
        return handler.settle(self, stop)

    async def send_json(self, status: int, obj: Any,
                        headers: list[tuple[bytes, bytes]] | None = None) -> None:
        await send_json(self.send, status, obj, [*(headers or ()), *self._ignored_header()])

    def all_ignored(self) -> list[str]:
        """Every field dropped and reported for this answer, the dialect's first."""
        return list(dict.fromkeys([*self.dialect_ignored, *self.ignored_fields]))

    def _ignored_header(self) -> list[tuple[bytes, bytes]]:
        ignored = self.all_ignored()
        if not ignored:
            return []
        return [(b"x-relay-ignored-fields", ", ".join(ignored).encode())]

    async def send_error(self, error: RelayError) -> None:
        await send_error(self.send, error, self.dialect)

    async def start_stream(self) -> None:
        """Send the stream's headers (once)."""
        if not self.headers_sent:
            # (SSE, or the dialect's own stream: Ollama's newline-delimited JSON)
            kind = getattr(self.dialect, "stream_type", b"text/event-stream; charset=utf-8")
            await self.bounded_send({"type": "http.response.start", "status": 200,
                                     "headers": [
                (b"content-type", kind),
                (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no"),
                *self._ignored_header()]})

    async def write(self, data: bytes, *, more: bool = True) -> None:
        """One piece of a stream, headers first if they are not out yet; bounded."""
        await self.start_stream()
        await self.bounded_send({"type": "http.response.body", "body": data,
                                 "more_body": more})

    async def bounded_send(self, message: Message) -> None:
        # relay's server bounds each socket write (write_timeout_s), and over HTTP/1.x a
        # send is one write: no second bound (a scope per piece of every stream). This one
        # is for what that bound cannot see, e.g. an HTTP/2 stream waiting on flow
        # control, or another ASGI server: a reader that takes nothing for longer is
        # dropped like one that left (SPEC C3).
        if self.writes_bounded:
            await self.send(message)
            return
        with trio.move_on_after(self.server.write_timeout_s + 1.0) as bounded:
            await self.send(message)
        if bounded.cancelled_caught:
            self.drop_client()
            await trio.lowlevel.checkpoint()  # the request's scope is cancelled: stop here

    def fail(self, error: RelayError) -> None:
        self.record.status = error.status
        self.record.reason = error.reason
        self.record.phase = error.phase

    # --- the lifecycle --------------------------------------------------------------------
    async def serve(self, body: bytes, handler: Handler) -> None:
        record = self.record
        normal_end = False
        try:
            refused: RelayError | None = None
            try:
                handler.prepare(self, body)
            except RelayError as exc:
                refused = untraced(exc)  # kept as data: a traceback would hold this frame
            if refused is not None:
                self.fail(refused)
                self._refused = True  # nothing ran: the record is final
                await self.send_error(refused)
            else:
                self.advance(Phase.RUNNING)
                await self._run(handler)
            normal_end = True
        except Exception as exc:  # a bug: still one record, still an E1 body if we can
            logger.exception("request %s crashed", record.id)
            error = RelayError("internal_error", f"relay failed unexpectedly "
                               f"({type(exc).__name__}); see its log for request {record.id}")
            self.fail(error)
            normal_end = True
            with trio.move_on_after(1.0, shield=True):
                await self._report_crash(error)
        finally:
            if not normal_end and record.reason is None:
                # Cancelled from outside this request: the server is stopping.
                if record.stop_requested_at is None:
                    record.stop_requested_at = trio.current_time()
                record.status, record.reason, record.phase = 503, "shutting_down", "shutdown"
            if not self.recorded:
                self.relay.records.write(record)
            self.phase = Phase.ENDED  # whatever it was: the record is written

    async def _report_crash(self, error: RelayError) -> None:
        if self.phase in (Phase.RECEIVED, Phase.RUNNING):
            await self.send_error(error)
        elif self.phase is Phase.HEADERS_SENT:
            # Headers are out: the failure goes in-band and the stream ends, so the
            # client sees an error, not a cut connection it would retry (SPEC A2).
            tail = self.dialect.encoder(self.record.id, 0, False).error(error)
            await self.send({"type": "http.response.body", "body": tail, "more_body": False})

    async def _run(self, handler: Handler) -> None:
        stop = RequestStop()
        self._running = (handler, stop)
        self.relay.track(stop)
        try:
            async with trio.open_nursery() as nursery:
                watcher = None
                self.request_scope = nursery.cancel_scope
                if self.scope.get("relay.disconnect_calls"):
                    # relay's server calls us as the client leaves: no task waits for it.
                    self.scope["relay.on_disconnect"] = self.drop_client
                    if self.scope.get("relay.gone"):  # it left before we ran
                        self.drop_client()
                else:
                    watcher = trio.CancelScope()
                    nursery.start_soon(self._watch_disconnect, watcher)
                await handler.run(self, nursery, stop)
                # Answered. A timed-out attempt may still be cleaning up beside us: the
                # request ends when it has (its lane is held until then).
                if watcher is not None:
                    watcher.cancel()
        finally:
            self.scope["relay.on_disconnect"] = None
            self.relay.untrack(stop)
            handler.settle(self, stop)
        if self.client_gone:
            self.record.status, self.record.reason, self.record.phase = (
                499, "client_disconnected", "stop")

    def drop_client(self) -> None:
        """The client takes nothing, or has left: stop the request."""
        if self.client_gone or self.answered:
            return
        self.advance(Phase.GONE_MID_STREAM if self.headers_sent else Phase.GONE)
        if self.record.stop_requested_at is None:
            self.record.stop_requested_at = trio.current_time()
        self.request_scope.cancel()

    async def _watch_disconnect(self, watcher: trio.CancelScope) -> None:
        with watcher:
            while (await self.receive())["type"] != "http.disconnect":
                pass
        if not watcher.cancelled_caught:
            self.drop_client()
