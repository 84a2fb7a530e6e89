"""A fake OpenAI-compatible HTTP upstream on loopback, for relay's tests.

Built directly on trio sockets + h11 so tests can see exactly when relay opens
and closes connections to it.  Usage, inside a test::

    up = await nursery.start(serve_fake_upstream)
    up.scripts["m1"] = Script(chunks=["a", "b"], chunk_delay_s=0.01)
    ...  # point relay's `openai` adapter at `up.url`
    await up.wait_for_requests(1)
    assert up.requests[0].json["model"] == "m1"

Every connection gets its own task with a per-connection nursery holding a
reader task that owns all socket reads: bytes go into h11, and EOF or a reset
marks the connection closed at once (`Conn.closed_at`, `closed_by="peer"`) and
cancels whatever the response is doing (delay, hang, stall, streaming).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from http import HTTPStatus
from typing import Any, Literal

import attrs
import h11
import trio

from fakes.agent_turns import decide, from_chat

__all__ = [
    "CREATED",
    "Conn",
    "FakeUpstream",
    "Recorded",
    "Script",
    "error_body",
    "serve_fake_upstream",
]

CREATED = 1_700_000_000
"""The `created` timestamp used in every completion object."""

COMPLETION_ID = "chatcmpl-fake"

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    409: "conflict_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
}


def error_body(status: int, message: str | None = None, code: str | None = None) -> dict[str, Any]:
    """An OpenAI-shaped error body for `status`."""
    err_type = _ERROR_TYPES.get(status, "server_error" if status >= 500 else "error")
    return {
        "error": {
            "message": message or f"fake upstream error {status}",
            "type": err_type,
            "code": code,
        }
    }


def _default_chunks() -> list[str]:
    return ["Hello", " world"]


def _default_usage() -> dict[str, Any]:
    return {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}


@attrs.define
class Script:
    """How the upstream answers requests for one model name.

    Chunk counters (`stall_after`, `cut_after`, `malformed_at`) count content
    chunks, after any `max_tokens` truncation; a value >= the number of chunks
    acts after the last content chunk, before tool-call deltas and the finish
    chunk.  Streaming always starts with the role chunk, so `stall_after=0`
    means "headers + role chunk, then hang".

    Non-streamed requests: the delays (`first_byte_delay_s`, then
    `chunk_delay_s` per chunk) all happen before the headers; `stall_after`
    hangs without ever sending headers; `cut_after` closes the connection
    without sending a response; `malformed_at` answers 200 with a body that
    is not valid JSON (`{not json`).  `hang` applies to both modes, and the
    first-byte delay applies to error answers as well.
    """

    status: int = 200
    error_body: dict[str, Any] | None = None
    headers: dict[str, str] = attrs.field(factory=dict)
    chunks: list[str] = attrs.field(factory=_default_chunks)
    first_byte_delay_s: float = 0
    chunk_delay_s: float = 0
    stall_after: int | None = None
    cut_after: int | None = None
    # None means "stop", or "tool_calls" when `tool_calls` is set; "length"
    # wins when max_tokens truncates the chunks.
    finish_reason: str | None = None
    omit_done: bool = False
    malformed_at: int | None = None
    tool_calls: list[dict[str, Any]] | None = None
    usage: dict[str, Any] | None = attrs.field(factory=_default_usage)
    hang: bool = False


@attrs.define
class Recorded:
    """One request as received (recorded once its body is fully read)."""

    method: str
    path: str  # as sent, including any query string
    headers: dict[str, str]  # lower-case keys; repeated headers joined by ", "
    json: Any  # parsed body, or None (empty or invalid body)
    received_at: float  # trio.current_time()
    conn_id: int
    body: bytes = b""


@attrs.define
class Conn:
    """One TCP connection accepted by the fake."""

    conn_id: int
    opened_at: float
    closed_at: float | None = None
    requests: int = 0
    # "peer": our read saw EOF/reset or a write failed; "server": we closed it
    closed_by: Literal["peer", "server"] | None = None

    @property
    def is_open(self) -> bool:
        return self.closed_at is None


class _Abort(Exception):
    """Close the connection now, without finishing the response."""


class FakeUpstream:
    """State and observations of one running fake upstream.

    Get one from `serve_fake_upstream`.  Mutate `scripts`, `default_script`
    and `models` freely between (or during) requests; a script is looked up
    when a request arrives.
    """

    def __init__(self, port: int, models: list[str] | None = None) -> None:
        self.port = port
        self.base_url = f"http://127.0.0.1:{port}"
        self.url = f"{self.base_url}/v1"
        self.scripts: dict[str, Script] = {}
        self.sequences: dict[str, list[Script]] = {}
        self.default_script = Script()
        # Play an agent's model (agent_turns) for models without a script of their own.
        self.agent = False
        # Optional: the script for a request, chosen from its body (an "agent" that calls
        # a tool, then answers from the tool's result); None falls back to the scripts.
        self.decide: Callable[[Any], Script | None] | None = None
        self.models: list[str] = list(models) if models is not None else ["m1"]
        self.requests: list[Recorded] = []
        self.connections: list[Conn] = []
        self._active = 0
        self._changed = trio.Event()

    # -- observation -------------------------------------------------------

    @property
    def open_connections(self) -> int:
        return sum(1 for c in self.connections if c.closed_at is None)

    def active_responses(self) -> int:
        """Requests recorded whose response is not finished or aborted yet
        (includes ones still in a delay or `hang`)."""
        return self._active

    def script_for(self, model: str) -> Script:
        """The script for one request. A list in `sequences` is played in order, one
        script per request, its last one repeating: `[Script(status=500), Script()]`
        fails once, then answers."""
        seq = self.sequences.get(model)
        if seq:
            return seq.pop(0) if len(seq) > 1 else seq[0]
        return self.scripts.get(model, self.default_script)

    async def wait_until(self, predicate: Callable[[], bool]) -> None:
        """Wait until `predicate()` is true; re-checked on every change of
        requests, connections or active responses (no polling)."""
        if predicate():
            await trio.lowlevel.checkpoint()
            return
        while not predicate():
            await self._changed.wait()

    async def wait_for_requests(self, n: int) -> None:
        await self.wait_until(lambda: len(self.requests) >= n)

    async def wait_for_connections(self, n: int) -> None:
        """Until at least `n` connections have been accepted (ever)."""
        await self.wait_until(lambda: len(self.connections) >= n)

    async def wait_all_closed(self) -> None:
        await self.wait_until(lambda: all(c.closed_at is not None for c in self.connections))

    async def wait_no_active_responses(self) -> None:
        await self.wait_until(lambda: self._active == 0)

    # -- internals ---------------------------------------------------------

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def _set_active(self, delta: int) -> None:
        self._active += delta
        self._notify()

    async def _handle(self, stream: trio.SocketStream) -> None:
        info = Conn(conn_id=len(self.connections), opened_at=trio.current_time())
        self.connections.append(info)
        self._notify()
        await _Connection(self, stream, info).run()


class _Connection:
    def __init__(self, up: FakeUpstream, stream: trio.SocketStream, info: Conn) -> None:
        self.up = up
        self.stream = stream
        self.info = info
        self.h11 = h11.Connection(h11.SERVER)
        self._data = trio.Event()
        self._cancel = trio.CancelScope()

    # -- lifecycle ---------------------------------------------------------

    def _mark_closed(self, by: Literal["peer", "server"]) -> None:
        if self.info.closed_at is None:
            self.info.closed_at = trio.current_time()
            self.info.closed_by = by
            self.up._notify()

    async def run(self) -> None:
        try:
            with self._cancel:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._reader)
                    try:
                        await self._serve()
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        self._mark_closed("peer")
                    except _Abort:
                        pass
                    self._cancel.cancel()
        finally:
            self._mark_closed("server")
            await trio.aclose_forcefully(self.stream)

    async def _reader(self) -> None:
        try:
            while True:
                data = await self.stream.receive_some(65536)
                if not data:
                    break
                self.h11.receive_data(data)
                self._data.set()
                self._data = trio.Event()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        self._mark_closed("peer")
        self._cancel.cancel()

    # -- h11 plumbing ------------------------------------------------------

    async def _next_event(self) -> h11.Event | type[h11.PAUSED]:
        while True:
            event = self.h11.next_event()
            if event is not h11.NEED_DATA:
                assert not isinstance(event, type) or event is h11.PAUSED
                return event
            if self.h11.they_are_waiting_for_100_continue:
                await self._send(h11.InformationalResponse(status_code=100, headers=[]))
            await self._data.wait()

    async def _send(
        self,
        event: h11.Request | h11.InformationalResponse | h11.Response | h11.Data | h11.EndOfMessage,
    ) -> None:
        await self.stream.send_all(self.h11.send(event))

    async def _send_simple(
        self,
        status: int,
        body: bytes,
        content_type: str = "application/json",
        extra: dict[str, str] | None = None,
    ) -> None:
        headers = _merge_headers(
            [("content-type", content_type), ("content-length", str(len(body)))],
            extra,
        )
        await self._send(h11.Response(status_code=status, headers=headers, reason=_reason(status)))
        if body:
            await self._send(h11.Data(data=body))
        await self._send(h11.EndOfMessage())

    async def _send_json(self, status: int, obj: Any, extra: dict[str, str] | None = None) -> None:
        await self._send_simple(status, _dumps(obj).encode(), extra=extra)

    # -- request loop ------------------------------------------------------

    async def _serve(self) -> None:
        while True:
            try:
                event = await self._next_event()
                if not isinstance(event, h11.Request):  # ConnectionClosed/PAUSED
                    return
                body = bytearray()
                while True:
                    part = await self._next_event()
                    if isinstance(part, h11.Data):
                        body += part.data
                    elif isinstance(part, h11.EndOfMessage):
                        break
                    else:  # ConnectionClosed mid-body
                        return
            except h11.RemoteProtocolError as exc:
                if self.h11.our_state in (h11.IDLE, h11.SEND_RESPONSE):
                    status = exc.error_status_hint
                    await self._send_json(status, error_body(status, str(exc)))
                return

            self._record(event, bytes(body))
            self.up._set_active(+1)
            try:
                await self._respond(event, bytes(body))
            finally:
                self.up._set_active(-1)

            if self.h11.our_state is h11.DONE and self.h11.their_state is h11.DONE:
                self.h11.start_next_cycle()
            else:
                return

    def _record(self, req: h11.Request, body: bytes) -> None:
        headers: dict[str, str] = {}
        for name, value in req.headers:
            key = name.decode("latin-1").lower()
            val = value.decode("latin-1")
            headers[key] = f"{headers[key]}, {val}" if key in headers else val
        parsed: Any = None
        if body:
            try:
                parsed = json.loads(body)
            except ValueError:
                parsed = None
        self.info.requests += 1
        self.up.requests.append(
            Recorded(
                method=req.method.decode("ascii"),
                path=req.target.decode("latin-1"),
                headers=headers,
                json=parsed,
                received_at=trio.current_time(),
                conn_id=self.info.conn_id,
                body=body,
            )
        )
        self.up._notify()

    async def _respond(self, req: h11.Request, body: bytes) -> None:
        method = req.method.decode("ascii").upper()
        path = req.target.decode("latin-1").split("?", 1)[0]

        if path == "/v1/chat/completions":
            if method != "POST":
                await self._method_not_allowed(method, path)
                return
            await self._chat(body)
        elif path == "/v1/models":
            if method != "GET":
                await self._method_not_allowed(method, path)
                return
            await self._send_json(
                200,
                {"object": "list", "data": [_model_obj(m) for m in self.up.models]},
            )
        elif path.startswith("/v1/models/") and method == "GET":
            model = path[len("/v1/models/") :]
            if model in self.up.models:
                await self._send_json(200, _model_obj(model))
            else:
                await self._send_json(
                    404,
                    error_body(
                        404,
                        f"The model '{model}' does not exist",
                        "model_not_found",
                    ),
                )
        else:
            await self._send_json(404, error_body(404, f"Invalid URL ({method} {path})"))

    async def _method_not_allowed(self, method: str, path: str) -> None:
        await self._send_json(405, error_body(405, f"Method {method} not allowed for {path}"))

    async def _chat(self, raw: bytes) -> None:
        try:
            req = json.loads(raw)
        except ValueError:
            await self._send_json(
                400,
                error_body(400, "We could not parse the JSON body of your request."),
            )
            return
        if not isinstance(req, dict):
            await self._send_json(400, error_body(400, "The request body must be a JSON object."))
            return
        model = req.get("model")
        if not isinstance(model, str) or not model:
            await self._send_json(400, error_body(400, "you must provide a model parameter"))
            return

        script = self.up.script_for(model)
        if self.up.agent and model not in self.up.scripts and model not in self.up.sequences:
            kind, name, text = decide(from_chat(req))
            if kind == "fail":
                script = Script(status=int(text))
            elif kind == "text":
                script = Script(chunks=[text[:len(text) // 2], text[len(text) // 2:]])
            else:
                script = Script(chunks=[], tool_calls=[
                    {"id": f"call_{len(self.up.requests)}", "type": "function",
                     "function": {"name": name, "arguments": text}}])
        decided = self.up.decide(req) if self.up.decide is not None else None
        script = decided or script
        if script.hang:
            await trio.sleep_forever()
        if script.first_byte_delay_s > 0:
            await trio.sleep(script.first_byte_delay_s)
        if script.status != 200:
            await self._send_json(
                script.status,
                script.error_body if script.error_body is not None else error_body(script.status),
                extra=script.headers,
            )
            return

        chunks = list(script.chunks)
        truncated = False
        limit = _as_int(req.get("max_completion_tokens", req.get("max_tokens")))
        if limit is not None and limit < len(chunks):
            chunks = chunks[: max(limit, 0)]
            truncated = True
        tool_calls = None if truncated or not script.tool_calls else _norm_tools(script.tool_calls)
        if truncated:
            finish = "length"
        elif script.finish_reason is not None:
            finish = script.finish_reason
        else:
            finish = "tool_calls" if tool_calls else "stop"

        if req.get("stream") is True:
            opts = req.get("stream_options")
            include_usage = isinstance(opts, dict) and opts.get("include_usage") is True
            await self._stream(script, model, chunks, tool_calls, finish, include_usage)
        else:
            await self._complete(script, model, chunks, tool_calls, finish)

    @staticmethod
    def _hits(value: int | None, i: int, n: int) -> bool:
        """Does counter `value` trigger at step `i` (0..n; n = after the last
        content chunk)?"""
        if value is None:
            return False
        return value == i if i < n else value >= n

    async def _complete(
        self,
        script: Script,
        model: str,
        chunks: list[str],
        tool_calls: list[dict[str, Any]] | None,
        finish: str,
    ) -> None:
        n = len(chunks)
        for i in range(n + 1):
            if self._hits(script.stall_after, i, n):
                await trio.sleep_forever()
            if self._hits(script.cut_after, i, n):
                raise _Abort
            if i < n and script.chunk_delay_s > 0:
                await trio.sleep(script.chunk_delay_s)
        if script.malformed_at is not None:
            await self._send_simple(200, b"{not json", extra=script.headers)
            return
        message: dict[str, Any] = {
            "role": "assistant",
            "content": "".join(chunks) if (chunks or not tool_calls) else None,
        }
        if tool_calls:
            message["tool_calls"] = tool_calls
        obj: dict[str, Any] = {
            "id": COMPLETION_ID,
            "object": "chat.completion",
            "created": CREATED,
            "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": finish}],
        }
        if script.usage is not None:
            obj["usage"] = script.usage
        await self._send_json(200, obj, extra=script.headers)

    async def _stream(
        self,
        script: Script,
        model: str,
        chunks: list[str],
        tool_calls: list[dict[str, Any]] | None,
        finish: str,
        include_usage: bool,
    ) -> None:
        headers = _merge_headers(
            [("content-type", "text/event-stream"), ("cache-control", "no-cache")],
            script.headers,
        )
        await self._send(h11.Response(status_code=200, headers=headers, reason=b"OK"))

        def chunk(delta: dict[str, Any], finish_reason: str | None = None) -> Any:
            obj: dict[str, Any] = {
                "id": COMPLETION_ID,
                "object": "chat.completion.chunk",
                "created": CREATED,
                "model": model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}],
            }
            if include_usage:  # as OpenAI does when include_usage is on
                obj["usage"] = None
            return obj

        await self._event(chunk({"role": "assistant", "content": ""}))
        n = len(chunks)
        for i in range(n + 1):
            if self._hits(script.stall_after, i, n):
                await trio.sleep_forever()
            if self._hits(script.cut_after, i, n):
                raise _Abort
            if self._hits(script.malformed_at, i, n):
                await self._event_raw("{not json")
            if i == n:
                break
            if script.chunk_delay_s > 0:
                await trio.sleep(script.chunk_delay_s)
            await self._event(chunk({"content": chunks[i]}))

        for idx, tc in enumerate(tool_calls or []):
            fn = tc["function"]
            args: str = fn["arguments"]
            half = len(args) // 2
            first = {
                "index": idx,
                "id": tc["id"],
                "type": tc["type"],
                "function": {"name": fn["name"], "arguments": ""},
            }
            await self._event(chunk({"tool_calls": [first]}))
            for piece in (args[:half], args[half:]):
                delta = {"index": idx, "function": {"arguments": piece}}
                await self._event(chunk({"tool_calls": [delta]}))

        await self._event(chunk({}, finish))
        if include_usage and script.usage is not None:
            final = chunk({})
            final["choices"] = []
            final["usage"] = script.usage
            await self._event(final)
        if not script.omit_done:
            await self._event_raw("[DONE]")
        await self._send(h11.EndOfMessage())

    async def _event(self, obj: Any) -> None:
        await self._event_raw(_dumps(obj))

    async def _event_raw(self, data: str) -> None:
        await self._send(h11.Data(data=f"data: {data}\n\n".encode()))


def _dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))


def _reason(status: int) -> bytes:
    try:
        return HTTPStatus(status).phrase.encode()
    except ValueError:
        return b""


def _as_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _model_obj(model: str) -> dict[str, Any]:
    return {"id": model, "object": "model", "created": 0, "owned_by": "fake"}


def _norm_tools(tool_calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Fill in OpenAI tool_call defaults: id, type, string arguments."""
    out: list[dict[str, Any]] = []
    for i, tc in enumerate(tool_calls):
        fn = dict(tc.get("function") or {})
        args = fn.get("arguments", "")
        if not isinstance(args, str):
            args = _dumps(args)
        fn["name"] = fn.get("name", f"tool_{i}")
        fn["arguments"] = args
        out.append(
            {
                **tc,
                "id": tc.get("id", f"call_{i}"),
                "type": tc.get("type", "function"),
                "function": fn,
            }
        )
    return out


def _merge_headers(
    base: Iterable[tuple[str, str]], extra: dict[str, str] | None
) -> list[tuple[str, str]]:
    """`base` headers, overridden (case-insensitively) / extended by `extra`."""
    merged: dict[str, tuple[str, str]] = {k.lower(): (k, v) for k, v in base}
    for k, v in (extra or {}).items():
        merged[k.lower()] = (k, v)
    return list(merged.values())


async def serve_fake_upstream(
    *,
    models: list[str] | None = None,
    task_status: trio.TaskStatus[FakeUpstream] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve a fake upstream on 127.0.0.1 (random port) until cancelled.

    `up = await nursery.start(serve_fake_upstream)`.  Cancelling closes the
    listener and every connection (each marked `closed_by="server"`).
    """
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    up = FakeUpstream(port, models)
    async with trio.open_nursery() as nursery:
        await nursery.start(trio.serve_listeners, up._handle, listeners)
        task_status.started(up)
