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
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import trio

from .config import is_loopback_host
from .dispatch import AttemptStarted, Dispatcher, Ended, Plan, Queued, Started, make_plan
from .errors import RelayError
from .events import Call, Delta, Finish, Skipped, Usage
from .lanes import PRIORITIES
from .records import Record

if TYPE_CHECKING:
    from .core import Relay

__all__ = ["Front"]

logger = logging.getLogger(__name__)

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

CHANNEL_SIZE = 64
COALESCE_MAX = 256  # events folded into one `send` when they are ready together
WAITING_NOTICE_S = 2.0
DRAIN_AFTER_DONE_S = 1.0
INT_MAX = 2**31 - 1
RELAY_ROUTES = frozenset({"/v1/chat/completions"})


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


async def send_json(send: Send, status: int, obj: Any,
                    headers: list[tuple[bytes, bytes]] | None = None) -> None:
    body = _dumps(obj)
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()), *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


async def send_error(send: Send, error: RelayError) -> None:
    await send_json(send, error.status, error.body(), error.headers())


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

        refusal = self._refusal(scope, origin)
        if refusal is not None:
            self._record(scope, refusal)
            await send_error(send_with_id, refusal)
            return
        if scope["method"] == "OPTIONS" and origin is not None:  # an allowed preflight
            await send_with_id({"type": "http.response.start", "status": 204, "headers": [
                (b"access-control-allow-methods", b"GET, POST, OPTIONS"),
                (b"access-control-allow-headers",
                 b"authorization, content-type, x-relay-priority, x-relay-progress"),
                (b"access-control-max-age", b"600")]})
            await send_with_id({"type": "http.response.body", "body": b""})
            return
        body = await self._read_body(scope, receive, send_with_id)
        if body is None:
            return
        await self.inner(scope, receive, send_with_id, body)

    def _refusal(self, scope: Scope, origin: str | None) -> RelayError | None:
        host = _header(scope, b"host")
        if host is not None:
            name = _host_name(host.strip()).lower()
            if not (is_loopback_host(name) or (not self.loopback and name in self.allowed_hosts)):
                return RelayError("bad_host", f"Host {host!r} is not accepted: relay answers "
                                  "only requests addressed to its own loopback name (a "
                                  "foreign Host is how DNS rebinding attacks look)")
        if origin is not None and origin not in self.origins:
            return RelayError("forbidden_origin", f"requests from the browser origin "
                              f"{origin!r} are not allowed; add it to [server] cors_origins "
                              "to allow it")
        if self.token is not None and scope["path"] != "/healthz" and scope["method"] != "OPTIONS":
            given = _header(scope, b"authorization") or ""
            scheme, _, value = given.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(
                    value.strip().encode(), self.token.encode()):
                return RelayError("unauthorized", "this relay requires a token: send "
                                  "'Authorization: Bearer <token>' (the value of the "
                                  "variable named by [server] token_env)")
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

    def _record(self, scope: Scope, error: RelayError) -> None:
        """A chat request refused here still gets its one record (DESIGN invariant 5)."""
        if scope["path"] in RELAY_ROUTES:
            record = Record(id=scope["relay.request_id"], started_at=trio.current_time(),
                            status=error.status, reason=error.reason, phase=error.phase)
            self.relay.records.write(record)

    async def _read_body(self, scope: Scope, receive: Receive, send: Send) -> bytes | None:
        body = bytearray()
        with trio.move_on_after(self.body_timeout_s):
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return None
                body += message.get("body", b"")
                if len(body) > self.max_body:
                    error = RelayError("invalid_request", f"the body is over the limit of "
                                       f"{self.max_body} bytes ([server] max_body_bytes)",
                                       status=413)
                    self._record(scope, error)
                    await send_error(send, error)
                    return None
                if not message.get("more_body"):
                    return bytes(body)
        error = RelayError("invalid_request", f"the body did not arrive within "
                           f"{self.body_timeout_s:g} s ([server] body_timeout_s)", status=408)
        self._record(scope, error)
        await send_error(send, error)
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
        self.guard = Guard(relay, self._route)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.guard(scope, receive, send)

    async def _route(self, scope: Scope, receive: Receive, send: Send, body: bytes) -> None:
        if scope["path"] in RELAY_ROUTES:
            if scope["method"] != "POST":
                await send_error(send, RelayError("invalid_request", "use POST for "
                                                  "/v1/chat/completions", status=405))
                return
            await ChatRequest(self.relay, scope, receive, send).serve(body)
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

def _bad(message: str, param: str | None = None) -> RelayError:
    return RelayError("invalid_request", message, param=param)


_ROLES = {"system", "developer", "user", "assistant", "tool", "function"}


def parse_chat_body(body: bytes) -> dict[str, Any]:
    """Check what relay itself reads from a chat body; everything else passes through.

    Raises:
        RelayError: ``invalid_request`` naming the field.
    """
    try:
        data = json.loads(body)
    except RecursionError as exc:
        raise _bad("the JSON body is nested too deeply") from exc
    except ValueError as exc:  # includes invalid UTF-8
        raise _bad(f"the body is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise _bad("the body must be a JSON object")
    model = data.get("model")
    if not isinstance(model, str) or not model.strip():
        raise _bad("'model' is required: a route name, PROVIDER/MODEL, or a model name",
                   "model")
    messages = data.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("'messages' must be a non-empty list of messages", "messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise _bad(f"messages[{i}] must be an object", "messages")
        role = message.get("role")
        if not isinstance(role, str) or role not in _ROLES:
            raise _bad(f"messages[{i}].role must be one of {', '.join(sorted(_ROLES))}",
                       "messages")
        content = message.get("content")
        if content is not None and not isinstance(content, str | list):
            raise _bad(f"messages[{i}].content must be a string or a list of parts",
                       "messages")
        for j, part in enumerate(content if isinstance(content, list) else ()):
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise _bad(f"messages[{i}].content[{j}] must be an object with a 'type'",
                           "messages")
            if part["type"] == "text" and not isinstance(part.get("text"), str):
                raise _bad(f"messages[{i}].content[{j}].text must be a string", "messages")
    if not isinstance(data.get("stream", False), bool):
        raise _bad("'stream' must be true or false", "stream")
    for key in ("max_tokens", "max_completion_tokens", "n"):
        value = data.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or not 1 <= value <= INT_MAX):
            raise _bad(f"'{key}' must be a whole number from 1 to {INT_MAX}", key)
    options = data.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise _bad("'stream_options' must be an object", "stream_options")
    return data


class ChatRequest:
    def __init__(self, relay: Relay, scope: Scope, receive: Receive, send: Send) -> None:
        self.relay = relay
        self.scope = scope
        self.receive = receive
        self._send = send
        self.answered = False  # the last byte of the answer has been handed to the server
        self.server = relay.config.server
        now = trio.current_time()
        self.record = Record(id=scope["relay.request_id"], started_at=now)
        self.headers_sent = False
        self.client_gone = False

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.body" and not message.get("more_body"):
            self.answered = True  # from here on, a disconnect is the normal end
        await self._send(message)

    async def serve(self, body: bytes) -> None:
        record = self.record
        ended = False
        try:
            try:
                call, plan, priority = self._prepare(body)
            except RelayError as exc:
                self._fail(exc)
                await send_error(self.send, exc)
                ended = True
                return
            await self._run(call, plan, priority)
            ended = True
        except Exception as exc:  # a bug: still one record, still an E1 body if we can
            logger.exception("request %s crashed", record.id)
            kind = type(exc).__name__
            error = RelayError("internal_error", f"relay failed unexpectedly ({kind}); see "
                               f"its log for request {record.id}")
            self._fail(error)
            ended = True
            if not self.headers_sent:
                with trio.move_on_after(1.0, shield=True):
                    await send_error(self.send, error)
        finally:
            if not ended and record.reason is None:
                # Cancelled from outside this request: the server is stopping.
                if record.stop_requested_at is None:
                    record.stop_requested_at = trio.current_time()
                record.status, record.reason, record.phase = 503, "shutting_down", "shutdown"
            self.relay.records.write(record)

    def _fail(self, error: RelayError) -> None:
        self.record.status = error.status
        self.record.reason = error.reason
        self.record.phase = error.phase

    def _prepare(self, body: bytes) -> tuple[Call, Plan, str]:
        record = self.record
        priority = (_header(self.scope, b"x-relay-priority") or "normal").strip().lower()
        if priority not in PRIORITIES:
            raise _bad(f"X-Relay-Priority must be one of {', '.join(PRIORITIES)}, not "
                       f"{priority!r}")
        record.priority = priority
        data = parse_chat_body(body)
        record.stream = bool(data.get("stream", False))
        if self.relay.draining:
            raise RelayError("shutting_down", "relay is shutting down and takes no new "
                             "requests; retry when it is back", retry_after_s=5.0)
        plan = make_plan(self.relay, data["model"], data.get("fallbacks"))
        primary = plan.targets[0]
        record.route = plan.route.name if plan.route else None
        record.provider, record.model = primary.provider.name, primary.model
        params = {k: v for k, v in data.items()
                  if k not in ("model", "messages", "stream", "fallbacks")}
        call = Call(request_id=record.id, provider=primary.provider.name, model=primary.model,
                    messages=data["messages"], stream=record.stream, params=params)
        if len(plan.targets) == 1:
            primary.provider.adapter.check_call(call)  # a plain 400, before anything else
        self.client_model = data["model"]
        self.include_usage = bool((data.get("stream_options") or {}).get("include_usage"))
        self.progress_events = (_header(self.scope, b"x-relay-progress") or "").strip() == "events"
        return call, plan, priority

    async def _run(self, call: Call, plan: Plan, priority: str) -> None:
        from .core import RequestStop

        record = self.record
        out, events = trio.open_memory_channel[Any](CHANNEL_SIZE)
        writer = (StreamWriter if call.stream else JSONWriter)(self, plan.targets[0].name)
        stop = RequestStop(trio.CancelScope())
        dispatcher = Dispatcher(self.relay, plan, call, priority, record, stop, call.stream)
        self.relay.track(stop)
        try:
            async with trio.open_nursery() as nursery:
                watcher = trio.CancelScope()
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


class _Writer:
    def __init__(self, request: ChatRequest, model: str) -> None:
        self.request = request
        self.relay = request.relay
        self.model = model  # "provider/model" of the attempt that answers
        self.send = request.send
        self.record = request.record
        self.created = int(time.time())
        self.completion_id = f"chatcmpl-{self.record.id}"
        self.usage: Usage | None = None

    def _note(self, event: Any) -> None:
        if isinstance(event, Usage):
            self.usage = event
            self.record.usage = event.as_dict()
        elif isinstance(event, Skipped):
            self.record.skipped_events.append(event.detail)

    def _finish_record(self, error: RelayError | None) -> None:
        if error is not None:
            self.request._fail(error)


class JSONWriter(_Writer):
    """A non-streamed answer: nothing is sent until the attempt has ended (SPEC A2)."""

    async def pump(self, events: trio.MemoryReceiveChannel[Any]) -> None:
        choices: dict[int, dict[str, Any]] = {}
        async for event in events:
            if isinstance(event, AttemptStarted):
                self.model = event.model
                if not event.continues:  # whatever an earlier attempt produced is void
                    choices.clear()
                    self.usage = self.record.usage = None
            elif isinstance(event, Delta):
                _merge(choices.setdefault(event.index, _new_choice(event.index)), event)
            elif isinstance(event, Finish):
                choices.setdefault(event.index, _new_choice(event.index))["finish_reason"] = (
                    event.reason)
            elif isinstance(event, Ended):
                self._finish_record(event.error)
                if event.error is not None:
                    await send_error(self.send, event.error)
                    return
                body: dict[str, Any] = {
                    "id": self.completion_id, "object": "chat.completion",
                    "created": self.created, "model": self.model,
                    "choices": [choices[i] for i in sorted(choices)]}
                if self.usage is not None:
                    body["usage"] = self.usage.as_dict()
                await send_json(self.send, 200, body)
                return
            else:
                self._note(event)
        raise RuntimeError("the attempt ended without saying how")


def _new_choice(index: int) -> dict[str, Any]:
    return {"index": index, "message": {"role": "assistant", "content": None},
            "finish_reason": None}


def _merge(choice: dict[str, Any], delta: Delta) -> None:
    message = choice["message"]
    if delta.content is not None:
        message["content"] = (message["content"] or "") + delta.content
    for call in delta.tool_calls or ():
        calls = message.setdefault("tool_calls", [])
        index = call.get("index", len(calls))
        while len(calls) <= index:
            calls.append({"id": None, "type": "function",
                          "function": {"name": "", "arguments": ""}})
        slot = calls[index]
        if call.get("id"):
            slot["id"] = call["id"]
        if call.get("type"):
            slot["type"] = call["type"]
        function = call.get("function") or {}
        if function.get("name"):
            slot["function"]["name"] += function["name"]
        if function.get("arguments"):
            args = function["arguments"]
            slot["function"]["arguments"] += args if isinstance(args, str) else json.dumps(args)
    for key, value in (delta.extra or {}).items():
        old = message.get(key)
        message[key] = old + value if isinstance(old, str) and isinstance(value, str) else value


class StreamWriter(_Writer):
    """A streamed answer: SSE, heartbeats, waiting notices, coalesced sends (SPEC A2, C3)."""

    def __init__(self, request: ChatRequest, model: str) -> None:
        super().__init__(request, model)
        self.heartbeat_s = request.server.heartbeat_s
        self.last_write = trio.current_time()
        self.queued_at: float | None = None
        self.queued_on: Any = None  # the provider whose queue we wait in
        self.roles_sent: set[int] = set()
        self._set_model(model)

    def _set_model(self, model: str) -> None:
        self.model = model
        prefix = _dumps({"id": self.completion_id, "object": "chat.completion.chunk",
                         "created": self.created, "model": model})
        self.chunk_head = b"data: " + prefix[:-1] + b',"choices":[{"index":'

    async def _start(self) -> None:
        if not self.request.headers_sent:
            self.request.headers_sent = True
            await self.send({"type": "http.response.start", "status": 200, "headers": [
                (b"content-type", b"text/event-stream; charset=utf-8"),
                (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]})

    async def _write(self, data: bytes, *, more: bool = True) -> None:
        await self._start()
        await self.send({"type": "http.response.body", "body": data, "more_body": more})
        self.last_write = trio.current_time()

    def _chunk(self, index: int, delta: dict[str, Any], finish: str | None = None) -> bytes:
        if index not in self.roles_sent:
            self.roles_sent.add(index)
            delta = {"role": "assistant", **delta}
        tail = b'null' if finish is None else _dumps(finish)
        return (self.chunk_head + str(index).encode() + b',"delta":' + _dumps(delta)
                + b',"finish_reason":' + tail + b"}]}\n\n")

    def _waiting_notice(self) -> bytes:
        stats = self.queued_on.lane.statistics()
        now = trio.current_time()
        elapsed = now - (self.queued_at if self.queued_at is not None else now)
        if self.request.progress_events:
            return b"event: relay.waiting\ndata: " + _dumps({
                "running": stats.running, "capacity": stats.capacity,
                "queued": stats.queued, "elapsed_s": round(elapsed, 1)}) + b"\n\n"
        return (f": waiting, starts when earlier requests finish (running {stats.running}/"
                f"{stats.capacity}, queued {stats.queued}, {elapsed:.0f} s)\n\n").encode()

    async def pump(self, events: trio.MemoryReceiveChannel[Any]) -> None:
        start = trio.current_time()
        next_notice = float("inf")
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
                    await self._write(b": keepalive\n\n")
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
                    delta: dict[str, Any] = {}
                    if event.content is not None:
                        delta["content"] = event.content
                    if event.tool_calls:
                        delta["tool_calls"] = event.tool_calls
                    if event.extra:
                        delta.update(event.extra)
                    out += self._chunk(event.index, delta)
                elif isinstance(event, Finish):
                    out += self._chunk(event.index, {}, event.reason)
                elif isinstance(event, AttemptStarted):
                    self._set_model(event.model)
                    self.usage = self.record.usage = None
                elif isinstance(event, Queued):
                    self.queued_on = event.provider
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
            self._finish_record(ended.error)
            if ended.error is not None:
                if not self.request.headers_sent and not out:
                    await send_error(self.send, ended.error)
                    return
                out += b"data: " + _dumps(ended.error.body()) + b"\n\n"
                await self._write(bytes(out), more=False)
                return
            if self.request.include_usage and self.usage is not None:
                out += b"data: " + _dumps({
                    "id": self.completion_id, "object": "chat.completion.chunk",
                    "created": self.created, "model": self.model,
                    "choices": [], "usage": self.usage.as_dict()}) + b"\n\n"
            out += b"data: [DONE]\n\n"
            await self._write(bytes(out), more=False)
            return
