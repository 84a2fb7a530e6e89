"""One chat request, in any dialect: parse, plan, run, write, record.

A chat request's life, inside one nursery per request::

    request task ── writer: turns events into SSE or one JSON body; heartbeats; notices
     ├─ watcher: ASGI receive(); on http.disconnect → cancel the request's nursery
     └─ dispatcher: attempts, each lane.slot(priority) → adapter.run(call, sink)
                    └─ sends Delta/Finish/Usage … then Ended(error | None), last

The request's task is the one writer — the only code that calls ``send`` (DESIGN).
Every stop is a cancelled scope: the client leaving cancels the nursery; the attempt's
deadlines (its own timeout, the budget, the provider's run timeout, first token, stall)
are watched by the dispatcher, which cancels that attempt's scope; a drain cancels the
request's stop scope and the writer still reports ``shutting_down``. ``Ended`` comes only
once the outcome is known; the request ends only when every attempt's lane is given back
(SPEC L6, C4). A channel that closes without ``Ended`` is an internal error, never a
silent end. No cancel scope or nursery spans a ``yield`` anywhere here.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import trio

from relay.dialects.base import Dialect
from relay.engine.dispatch import Dispatcher
from relay.engine.lanes import PRIORITIES
from relay.engine.plan import Plan, make_plan
from relay.engine.stops import RequestStop
from relay.front.writers import JSONWriter, StreamWriter
from relay.vocab.errors import RelayError
from relay.vocab.events import Call
from relay.vocab.records import Record

from .asgi import Message, Receive, Scope, Send, header, send_error, send_json

if TYPE_CHECKING:
    from relay.engine.engine import Engine

__all__ = ["CHANNEL_SIZE", "ChatRequest"]

logger = logging.getLogger(__name__)

CHANNEL_SIZE = 64


# --- one chat request ---------------------------------------------------------------------

class ChatRequest:
    """One chat request, in any dialect: parse, plan, run, write, record."""

    def __init__(self, relay: Engine, scope: Scope, receive: Receive, send: Send,
                 dialect: Dialect) -> None:
        self.relay = relay
        self.dialect = dialect
        self.scope = scope
        self.receive = receive
        self._send = send
        self.answered = False  # the last byte of the answer has been handed to the server
        self.server = relay.config.server
        now = trio.current_time()
        self.record = Record(id=scope["relay.request_id"], started_at=now)
        self.headers_sent = False
        self.client_gone = False
        self.request_scope = trio.CancelScope()  # the request's nursery's, once it runs

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.body" and not message.get("more_body"):
            self.answered = True  # from here on, a disconnect is the normal end
        await self._send(message)

    async def send_json(self, status: int, obj: Any,
                        headers: list[tuple[bytes, bytes]] | None = None) -> None:
        await send_json(self.send, status, obj, headers)

    async def send_error(self, error: RelayError) -> None:
        await send_error(self.send, error, self.dialect)

    async def serve(self, body: bytes) -> None:
        record = self.record
        ended = False
        try:
            refused: RelayError | None = None
            try:
                call, plan, priority = self._prepare(body)
            except RelayError as exc:
                refused = exc
            if refused is not None:
                self.fail(refused)
                await self.send_error(refused)
            else:
                await self._run(call, plan, priority)
            ended = True
        except Exception as exc:  # a bug: still one record, still an E1 body if we can
            logger.exception("request %s crashed", record.id)
            kind = type(exc).__name__
            error = RelayError("internal_error", f"relay failed unexpectedly ({kind}); see "
                               f"its log for request {record.id}")
            self.fail(error)
            ended = True
            with trio.move_on_after(1.0, shield=True):
                if not self.headers_sent:
                    await self.send_error(error)
                elif not self.answered:
                    # Headers are out: the failure goes in-band and the stream ends, so the
                    # client sees an error, not a cut connection it would retry (SPEC A2).
                    tail = self.dialect.encoder(record.id, 0, False).error(error)
                    await self.send({"type": "http.response.body", "body": tail,
                                     "more_body": False})
        finally:
            if not ended and record.reason is None:
                # Cancelled from outside this request: the server is stopping.
                if record.stop_requested_at is None:
                    record.stop_requested_at = trio.current_time()
                record.status, record.reason, record.phase = 503, "shutting_down", "shutdown"
            self.relay.records.write(record)

    def fail(self, error: RelayError) -> None:
        self.record.status = error.status
        self.record.reason = error.reason
        self.record.phase = error.phase

    def _prepare(self, body: bytes) -> tuple[Call, Plan, str]:
        record = self.record
        priority = self._priority()
        record.priority = priority
        chat = self.dialect.parse(body)
        record.stream = chat.stream
        if self.relay.draining:
            raise RelayError("shutting_down", "relay is shutting down and takes no new "
                             "requests; retry when it is back", retry_after_s=5.0)
        plan = make_plan(self.relay, chat.model, chat.fallbacks)
        primary = plan.targets[0]
        record.route = plan.route.name if plan.route else None
        record.provider, record.model = primary.provider.name, primary.model
        call = Call(request_id=record.id, provider=primary.provider.name, model=primary.model,
                    messages=chat.messages, stream=chat.stream, params=chat.params)
        if len(plan.targets) == 1:
            primary.provider.adapter.check_call(call)  # a plain 400, before anything else
        self.include_usage = chat.include_usage
        self.progress_events = (header(self.scope, b"x-relay-progress") or "").strip() == "events"
        return call, plan, priority

    def _priority(self) -> str:
        priority = (header(self.scope, b"x-relay-priority") or "normal").strip().lower()
        if priority not in PRIORITIES:
            raise RelayError("invalid_request", f"X-Relay-Priority must be one of "
                             f"{', '.join(PRIORITIES)}, not {priority!r}")
        return priority

    async def _run(self, call: Call, plan: Plan, priority: str) -> None:
        record = self.record
        out, events = trio.open_memory_channel[Any](CHANNEL_SIZE)
        writer = (StreamWriter if call.stream else JSONWriter)(self, plan.targets[0].name)
        stop = RequestStop()
        dispatcher = Dispatcher(self.relay, plan, call, priority, record, stop, call.stream)
        self.relay.track(stop)
        try:
            async with trio.open_nursery() as nursery:
                watcher = trio.CancelScope()
                self.request_scope = nursery.cancel_scope
                nursery.start_soon(self._watch_disconnect, nursery.cancel_scope, watcher)
                nursery.start_soon(dispatcher.run, nursery, out)
                async with events:
                    await writer.pump(events)
                # Answered. A timed-out attempt may still be cleaning up beside us: the
                # request ends when it has (its lane is held until then).
                watcher.cancel()
        finally:
            self.relay.untrack(stop)
            if stop.requested_at is not None and record.stop_requested_at is None:
                record.stop_requested_at = stop.requested_at
            releases = [a.released_at for a in record.attempts if a.released_at is not None]
            record.released_at = max(releases) if releases else None
            timeouts = [r for r in dispatcher.runs if r.error is not None
                        and r.error.phase == "timeout" and r.stopped_at is not None]
            if timeouts and record.stop_requested_at is None:
                record.stop_requested_at = timeouts[0].stopped_at
        if self.client_gone:
            record.status, record.reason, record.phase = 499, "client_disconnected", "stop"

    def drop_client(self) -> None:
        """The client takes nothing: stop the request as if it had left."""
        self.client_gone = True
        if self.record.stop_requested_at is None:
            self.record.stop_requested_at = trio.current_time()
        self.request_scope.cancel()

    async def _watch_disconnect(self, request_scope: trio.CancelScope,
                                watcher: trio.CancelScope) -> None:
        with watcher:
            while (await self.receive())["type"] != "http.disconnect":
                pass
        if watcher.cancelled_caught:
            return
        if self.answered:
            return
        self.client_gone = True
        if self.record.stop_requested_at is None:
            self.record.stop_requested_at = trio.current_time()
        request_scope.cancel()


