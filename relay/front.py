"""The HTTP front: one guard layer, the relay routes (raw ASGI), and Quart for the rest.

Theory of operation. `Front` is the ASGI app. Every HTTP request first passes `Guard`
(SPEC O4): Host, token, Origin and content-type checks, the body read whole under a size
limit and a deadline, and the request id. Then ``POST /v1/chat/completions`` is served
here, in raw ASGI, so that the request's own task is the one writer — the only code that
calls ``send`` (DESIGN). Everything else (models, status, health) is a small Quart app.

A chat request's life, inside one nursery per request::

    request task ── writer: turns events into SSE or one JSON body; heartbeats; notices
     ├─ watcher: ASGI receive(); on http.disconnect → cancel the request's nursery
     └─ attempt: lane.slot(priority) → run-timeout scope → adapter.run(call, sink)
                 └─ sends Delta/Finish/Usage … then Ended(error | None), last

Every stop is a cancelled scope: the client leaving cancels the nursery; the run timeout
is the attempt's ``move_on_after``; a drain cancels the attempt's stop scope and the
writer still reports ``shutting_down``. The attempt sends ``Ended`` only after the lane's
``async with`` has exited, so by then the slot is back (SPEC L6, C4). A channel that
closes without ``Ended`` is an internal error, never a silent end. No cancel scope or
nursery spans a ``yield`` anywhere here.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import secrets
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import trio

from .anthropic_api import ANTHROPIC
from .config import is_loopback_host
from .dispatch import Dispatcher, Plan, make_plan
from .errors import RelayError
from .events import Call
from .lanes import PRIORITIES
from .openai_api import OPENAI
from .records import Record
from .writers import Dialect, JSONWriter, StreamWriter

if TYPE_CHECKING:
    from .core import Relay, RequestStop

__all__ = ["Front"]

logger = logging.getLogger(__name__)

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

CHANNEL_SIZE = 64
# The relay routes: served here in raw ASGI, each in its dialect (SPEC A1, A6).
RELAY_ROUTES: dict[str, Dialect] = {"/v1/chat/completions": OPENAI, "/v1/messages": ANTHROPIC}


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


async def send_json(send: Send, status: int, obj: Any,
                    headers: list[tuple[bytes, bytes]] | None = None) -> None:
    body = _dumps(obj)
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()), *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


async def send_error(send: Send, error: RelayError, dialect: Dialect = OPENAI) -> None:
    await send_json(send, error.status, dialect.error_body(error), error.headers())


# --- the guard layer (SPEC O4) ------------------------------------------------------------

def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return str(value.decode("latin-1"))
    return None


def _host_name(host: str) -> str:
    if host.startswith("["):
        return host[1:].partition("]")[0]
    return host.rpartition(":")[0] if host.count(":") == 1 else host


class Guard:
    """One ASGI layer in front of every route. The inner app gets the whole body at
    once, then the real ``receive`` (so it still sees ``http.disconnect``)."""

    def __init__(self, relay: Relay, inner: Callable[[Scope, Receive, Send, bytes],
                                                     Awaitable[None]]) -> None:
        self.relay = relay
        self.inner = inner
        server = relay.config.server
        self.loopback = is_loopback_host(server.host)
        self.allowed_hosts = {h.lower() for h in server.allowed_hosts}
        self.origins = set(server.cors_origins)
        self.token = os.environ.get(server.token_env) if server.token_env else None
        self.max_body = server.max_body_bytes
        self.body_timeout_s = server.body_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        request_id = secrets.token_hex(8)
        scope["relay.request_id"] = request_id
        origin = _header(scope, b"origin")
        extra = [(b"x-relay-request-id", request_id.encode())]
        if origin is not None and origin in self.origins:
            extra += [(b"access-control-allow-origin", origin.encode()), (b"vary", b"origin"),
                      (b"access-control-expose-headers",
                       b"x-relay-request-id, retry-after, x-should-retry")]

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), *extra]}
            await send(message)

        dialect = RELAY_ROUTES.get(scope["path"], OPENAI)
        refusal = self._refusal(scope, origin)
        if refusal is not None:
            self._record(scope, refusal)
            await send_error(send_with_id, refusal, dialect)
            return
        if scope["method"] == "OPTIONS" and origin is not None:  # an allowed preflight
            await send_with_id({"type": "http.response.start", "status": 204, "headers": [
                (b"access-control-allow-methods", b"GET, POST, OPTIONS"),
                (b"access-control-allow-headers",
                 b"authorization, content-type, x-relay-priority, x-relay-progress"),
                (b"access-control-max-age", b"600")]})
            await send_with_id({"type": "http.response.body", "body": b""})
            return
        body = await self._read_body(scope, receive, send_with_id, dialect)
        if body is None:
            return
        await self.inner(scope, receive, send_with_id, body)

    def _refusal(self, scope: Scope, origin: str | None) -> RelayError | None:
        host = _header(scope, b"host")
        if host is None and self.loopback:
            return RelayError("bad_host", "a request without a Host header is not accepted")
        if host is not None:
            name = _host_name(host.strip()).lower()
            if not (is_loopback_host(name) or (not self.loopback and name in self.allowed_hosts)):
                return RelayError("bad_host", f"Host {host!r} is not accepted: relay answers "
                                  "only requests addressed to its own loopback name (a "
                                  "foreign Host is how DNS rebinding attacks look)")
        # A page relay serves itself (the status page at /) posts with its own origin:
        # exactly "http://" + the Host it loaded from, which passed the check above.
        same_origin = host is not None and origin == f"http://{host.strip().lower()}"
        if origin is not None and origin not in self.origins and not same_origin:
            return RelayError("forbidden_origin", f"requests from the browser origin "
                              f"{origin!r} are not allowed; add it to [server] cors_origins "
                              "to allow it")
        # The status page (/) holds no data; it asks for the token and sends it itself.
        if self.token is not None and scope["path"] not in ("/healthz", "/") and scope[
                "method"] != "OPTIONS":
            scheme, _, value = (_header(scope, b"authorization") or "").partition(" ")
            if scheme.lower() != "bearer":
                # Anthropic's clients send their key as x-api-key.
                value = _header(scope, b"x-api-key") or ""
            if not value or not hmac.compare_digest(value.strip().encode(),
                                                    self.token.encode()):
                return RelayError("unauthorized", "this relay requires a token: send "
                                  "'Authorization: Bearer <token>' or 'x-api-key: <token>' "
                                  "(the value of the variable named by [server] token_env)")
        if scope["method"] in ("POST", "PUT", "PATCH"):
            length = _header(scope, b"content-length")
            has_body = _header(scope, b"transfer-encoding") is not None or (
                length is not None and length.strip() != "0")
            ctype = (_header(scope, b"content-type") or "").split(";")[0].strip().lower()
            if has_body and not (ctype == "application/json" or ctype.endswith("+json")):
                return RelayError("invalid_request", f"request bodies must be "
                                  f"application/json, not {ctype or 'untyped'}", status=415)
            if length is not None and length.strip().isdigit() and int(length) > self.max_body:
                return RelayError("invalid_request", f"the body is {int(length)} bytes; the "
                                  f"limit is {self.max_body} ([server] max_body_bytes)",
                                  status=413)
        return None

    def _record(self, scope: Scope, error: RelayError | None) -> None:
        """A chat request refused here (or whose client left while sending its body,
        ``error`` None) still gets its one record (DESIGN invariant 5)."""
        if scope["path"] in RELAY_ROUTES or scope["path"] == "/relay/v1/fanout":
            now = trio.current_time()
            if error is None:
                record = Record(id=scope["relay.request_id"], started_at=now, status=499,
                                reason="client_disconnected", phase="stop",
                                stop_requested_at=now)
            else:
                record = Record(id=scope["relay.request_id"], started_at=now,
                                status=error.status, reason=error.reason, phase=error.phase)
            self.relay.records.write(record)

    async def _read_body(self, scope: Scope, receive: Receive, send: Send,
                         dialect: Dialect) -> bytes | None:
        body = bytearray()
        with trio.move_on_after(self.body_timeout_s):
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    self._record(scope, None)  # gone while sending: still one record
                    return None
                body += message.get("body", b"")
                if len(body) > self.max_body:
                    error = RelayError("invalid_request", f"the body is over the limit of "
                                       f"{self.max_body} bytes ([server] max_body_bytes)",
                                       status=413)
                    self._record(scope, error)
                    await send_error(send, error, dialect)
                    return None
                if not message.get("more_body"):
                    return bytes(body)
        error = RelayError("invalid_request", f"the body did not arrive within "
                           f"{self.body_timeout_s:g} s ([server] body_timeout_s)", status=408)
        self._record(scope, error)
        await send_error(send, error, dialect)
        return None


async def _lifespan(receive: Receive, send: Send) -> None:
    # relay keeps its services in its own nursery, not in lifespan hooks (DESIGN).
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


# --- the front ----------------------------------------------------------------------------

class Front:
    """The ASGI app of one relay."""

    def __init__(self, relay: Relay) -> None:
        from .routes import make_quart_app

        self.relay = relay
        self.quart = make_quart_app(relay)
        self.configure()

    def configure(self) -> None:
        """(Re)build the guard from the relay's current config (a reload calls this)."""
        self.guard = Guard(self.relay, self._route)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.guard(scope, receive, send)

    async def _route(self, scope: Scope, receive: Receive, send: Send, body: bytes) -> None:
        dialect = RELAY_ROUTES.get(scope["path"])
        if dialect is not None:
            if scope["method"] != "POST":
                wrong = RelayError("invalid_request", f"use POST for {scope['path']}",
                                   status=405)
                self.guard._record(scope, wrong)
                await send_error(send, wrong, dialect)
                return
            await ChatRequest(self.relay, scope, receive, send, dialect).serve(body)
            return
        if scope["path"] == "/relay/v1/fanout":
            from .fanout import FanoutRequest

            if scope["method"] != "POST":
                wrong = RelayError("invalid_request", "use POST for /relay/v1/fanout",
                                   status=405)
                self.guard._record(scope, wrong)
                await send_error(send, wrong)
                return
            await FanoutRequest(self.relay, scope, receive, send, OPENAI).serve(body)
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.quart(scope, replay, send)  # type: ignore[arg-type]


# --- one chat request ---------------------------------------------------------------------

class ChatRequest:
    """One chat request, in any dialect: parse, plan, run, write, record."""

    def __init__(self, relay: Relay, scope: Scope, receive: Receive, send: Send,
                 dialect: Dialect) -> None:
        self.relay = relay
        self.dialect = dialect
        self.scope = scope
        self.receive = receive
        self._send = send
        self.answered = False  # the last byte of the answer has been handed to the server
        # Written before the last byte goes out whenever it is final by then (records.py
        # says what a record claims): ``record_early`` says whether it is, settling it.
        self.recorded = False
        self.record_early: Callable[[], bool] | None = None
        self.server = relay.config.server
        now = trio.current_time()
        self.record = Record(id=scope["relay.request_id"], started_at=now)
        self.headers_sent = False
        self.client_gone = False
        self.request_scope = trio.CancelScope()  # the request's nursery's, once it runs

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.body" and not message.get("more_body"):
            self.answered = True  # from here on, a disconnect is the normal end
            if not self.recorded and self.record_early is not None and self.record_early():
                self.recorded = True  # a kill -9 after the last byte cannot lose it now
                self.relay.records.write(self.record)
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
                self.record_early = lambda: True  # nothing ran: the record is final
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
            if not self.recorded:
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
        self.progress_events = (_header(self.scope, b"x-relay-progress") or "").strip() == "events"
        return call, plan, priority

    def _priority(self) -> str:
        priority = (_header(self.scope, b"x-relay-priority") or "normal").strip().lower()
        if priority not in PRIORITIES:
            raise RelayError("invalid_request", f"X-Relay-Priority must be one of "
                             f"{', '.join(PRIORITIES)}, not {priority!r}")
        return priority

    async def _run(self, call: Call, plan: Plan, priority: str) -> None:
        from .core import RequestStop

        record = self.record
        out, events = trio.open_memory_channel[Any](CHANNEL_SIZE)
        writer = (StreamWriter if call.stream else JSONWriter)(self, plan.targets[0].name)
        stop = RequestStop()
        dispatcher = Dispatcher(self.relay, plan, call, priority, record, stop, call.stream)
        self.record_early = lambda: self._settle(stop, dispatcher)
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
            self._settle(stop, dispatcher)
        if self.client_gone:
            record.status, record.reason, record.phase = 499, "client_disconnected", "stop"

    def _settle(self, stop: RequestStop, dispatcher: Dispatcher) -> bool:
        """Fill in the record's stop and release times; True when they are final (every
        attempt has ended and given its lane back)."""
        record = self.record
        if stop.requested_at is not None and record.stop_requested_at is None:
            record.stop_requested_at = stop.requested_at
        releases = [a.released_at for a in record.attempts if a.released_at is not None]
        record.released_at = max(releases) if releases else None
        timeouts = [r for r in dispatcher.runs if r.error is not None
                    and r.error.phase == "timeout" and r.stopped_at is not None]
        if timeouts and record.stop_requested_at is None:
            record.stop_requested_at = timeouts[0].stopped_at
        return all(r.finished_at is not None for r in dispatcher.runs)

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


