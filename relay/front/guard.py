"""The guard: one ASGI layer in front of every route, raw or Quart (SPEC O4).

Host, token, Origin and content-type checks, the body read whole under a size limit and
a deadline, and the request id. The inner app gets the whole body at once, then the real
``receive`` (so it still sees ``http.disconnect``).

It sees every exchange, so it writes the one INFO line per exchange (SPEC 9; logger
``relay.access``, which ``relay serve --quiet`` turns off)::

    POST /v1/chat/completions 200 812.4 ms request=3f2a… model=fake/echo in=97 B out=301 B

Method, path (never the query string: a client may put a key there), the status sent,
the duration, the request id, the model asked for, the body bytes each way, and the
outcome when the record names one (``reason=client_disconnected``) — never a body or a
header's value. Values from the client are quoted and escaped when they are not plain,
so no client can write a line of its own into the log.
"""

from __future__ import annotations

import functools
import hmac
import ipaddress
import json
import logging
import os
import secrets
import urllib.parse
from collections.abc import Awaitable, Callable

import trio

from relay.config.clients import DEFAULT_CLIENT
from relay.dialects.base import Dialect
from relay.dialects.gemini_generate import GEMINI
from relay.engine.engine import Engine
from relay.vocab.errors import RelayError
from relay.vocab.profile import is_loopback_host
from relay.vocab.records import Record

from .asgi import Message, Receive, Scope, Send, header, send_error
from .paths import dialect_for, google_client, match

__all__ = ["ACCESS_LOG", "Guard", "dialect_for"]

ACCESS_LOG = "relay.access"
access_log = logging.getLogger(ACCESS_LOG)


@functools.lru_cache(maxsize=256)  # every request's Host; a bounded cache (any client may vary it)
def _host_name(host: str) -> str | None:
    """The name in a Host header, or None when the header is not ``name[:digits]``.

    ``name`` is a bracketed IPv6 literal (no zone) or a name without ``:``, ``[``, ``]``,
    ``@`` or ``/``; whatever follows it must be a ``:`` and a port number, or nothing.
    """
    if host.startswith("["):
        name, bracket, port = host[1:].partition("]")
        try:
            ipaddress.IPv6Address(name)
        except ValueError:
            return None
        if not bracket or "%" in name:
            return None
    else:
        name = host.partition(":")[0]
        port = host[len(name):]
        if not name or any(c in name for c in "[]@/\\ "):
            return None
    if port and not (port[0] == ":" and port[1:].isascii() and port[1:].isdigit()):
        return None
    return name


class Guard:
    """One ASGI layer in front of every route. The inner app gets the whole body at
    once, then the real ``receive`` (so it still sees ``http.disconnect``)."""

    def __init__(self, relay: Engine, inner: Callable[[Scope, Receive, Send, bytes],
                                                     Awaitable[None]]) -> None:
        self.relay = relay
        self.inner = inner
        self.config = relay.config  # the config this guard was built from
        server = relay.config.server
        self.loopback = is_loopback_host(server.host)
        self.allowed_hosts = {h.lower() for h in server.allowed_hosts}
        self.origins = set(server.cors_origins)
        # SPEC L14: every token relay accepts, with the client it names ([server]
        # token_env: the client ``default``); compared in constant time, each of them.
        token = os.environ.get(server.token_env) if server.token_env else None
        self.tokens: list[tuple[bytes, str]] = [(token.encode(), DEFAULT_CLIENT)] if token else []
        self.tokens += [(c.token.encode(), c.name) for c in relay.config.clients.values()
                        if c.token]
        default = relay.config.clients.get(DEFAULT_CLIENT)
        # A request without a token is the client ``default`` when that client has none.
        self.tokenless = not self.tokens or (default is not None and default.token is None
                                             and not token)
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
        exchange = _Logged(trio.current_time())
        try:
            await self._serve(scope, receive, send, exchange)
        finally:
            exchange.log(scope)  # synchronous: it runs when cancelled too

    async def _serve(self, scope: Scope, receive: Receive, send: Send,
                     exchange: _Logged) -> None:
        request_id = scope["relay.request_id"]
        origin = header(scope, b"origin")
        extra = [(b"x-relay-request-id", request_id.encode())]
        if origin is not None and origin in self.origins:
            extra += [(b"access-control-allow-origin", origin.encode()), (b"vary", b"origin"),
                      (b"access-control-expose-headers",
                       b"x-relay-request-id, retry-after, x-should-retry, "
                       b"x-relay-ignored-fields")]

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), *extra]}
                exchange.status = message["status"]
            else:
                exchange.bytes_out += len(message.get("body", b""))
            await send(message)

        async def send_closing(message: Message) -> None:
            # A refusal before the body was read whole: hypercorn closes the connection
            # after it (the rest of the body is still coming), so the client is told not
            # to send another request on it. (Refused on its headers, a body may in fact
            # have arrived whole: the client reconnects for nothing, once.)
            if (message["type"] == "http.response.start" and _has_body(scope)
                    and not scope.get("relay.body_read")):
                message = {**message, "headers": [*message.get("headers", ()),
                                                  (b"connection", b"close")]}
            await send_with_id(message)

        dialect = dialect_for(scope["path"])
        if scope["path"].startswith("/v1/models") and google_client(scope):
            dialect = GEMINI  # Google's model list and methods under v1 (SPEC A9)
        refusal = self._refusal(scope, origin)
        if refusal is not None:
            self._record(scope, refusal)
            await send_error(send_closing, refusal, dialect)
            return
        if scope["method"] == "OPTIONS" and origin is not None:  # an allowed preflight
            await send_closing({"type": "http.response.start", "status": 204, "headers": [
                (b"access-control-allow-methods", b"GET, POST, OPTIONS"),
                (b"access-control-allow-headers",
                 b"authorization, content-type, x-relay-priority, x-relay-progress, "
                 b"x-goog-api-key, x-goog-api-client"),
                (b"access-control-max-age", b"600")]})
            await send_with_id({"type": "http.response.body", "body": b""})
            return
        body = await self._read_body(scope, receive, send_closing, dialect)  # (refusals)
        if body is None:
            return
        exchange.bytes_in = len(body)
        await self.inner(scope, receive, send_with_id, body)

    def _refusal(self, scope: Scope, origin: str | None) -> RelayError | None:
        host = header(scope, b"host")
        if host is None and self.loopback:
            return RelayError("bad_host", "a request without a Host header is not accepted")
        if host is not None:
            name = _host_name(host.strip())
            if name is None or not (is_loopback_host(name.lower()) or (
                    not self.loopback and name.lower() in self.allowed_hosts)):
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
        if self.tokens and scope["path"] not in ("/healthz", "/") and scope[
                "method"] != "OPTIONS":
            client = self._client(scope)
            if client is None:
                return RelayError("unauthorized", "this relay requires a token: send "
                                  "'Authorization: Bearer <token>' or 'x-api-key: <token>' "
                                  "('x-goog-api-key: <token>' or '?key=<token>' on "
                                  "Google's paths): the value of the variable named by "
                                  "[server] token_env, or by your client's [clients.NAME] "
                                  "token_env")
            scope["relay.client"] = client
        if scope["method"] in ("POST", "PUT", "PATCH"):
            length = header(scope, b"content-length")
            ctype = (header(scope, b"content-type") or "").split(";")[0].strip().lower()
            # (Ollama's API takes any type, as Ollama does: its documented calls are
            # `curl -d`, form-typed; a browser's cross-origin post sends an Origin.)
            ollama = scope["path"].startswith("/api/") and origin is None
            if _has_body(scope) and not (ctype == "application/json" or ctype.endswith(
                    "+json") or ollama):
                return RelayError("invalid_request", f"request bodies must be "
                                  f"application/json, not {ctype or 'untyped'}", status=415)
            if length is not None and length.strip().isdigit() and int(length) > self.max_body:
                return RelayError("invalid_request", f"the body is {int(length)} bytes; the "
                                  f"limit is {self.max_body} ([server] max_body_bytes)",
                                  status=413)
        return None

    def _client(self, scope: Scope) -> str | None:
        """The client the request's token names (SPEC L14); None: refused (a wrong token,
        or none where every request needs one)."""
        scheme, _, value = (header(scope, b"authorization") or "").partition(" ")
        if scheme.lower() != "bearer":
            # Anthropic's clients send their key as x-api-key; Google's (under /v1beta,
            # and under /v1/models, its SDKs' default version: SPEC A9) as
            # x-goog-api-key or ?key=.
            value = header(scope, b"x-api-key") or ""
            path = scope["path"]
            if not value and (path.startswith(("/v1beta/", "/v1/models/"))
                              or path == "/v1/models"):
                value = header(scope, b"x-goog-api-key") or _query_key(scope)
        presented = value.strip().encode()
        if not presented:
            return DEFAULT_CLIENT if self.tokenless else None
        found: str | None = None
        for token, name in self.tokens:  # every one: no early exit
            if hmac.compare_digest(presented, token) and found is None:
                found = name
        return found

    def _record(self, scope: Scope, error: RelayError | None) -> None:
        """A relay-route request refused here (or whose client left while sending its body,
        ``error`` None) still gets its one record (DESIGN invariant 5)."""
        served = match(scope["path"])
        if served is not None and served.relay_route:
            now = trio.current_time()
            if error is None:
                record = Record(id=scope["relay.request_id"], started_at=now,
                                endpoint=scope["path"], status=499,
                                reason="client_disconnected", phase="stop",
                                stop_requested_at=now)
            else:
                record = Record(id=scope["relay.request_id"], started_at=now,
                                endpoint=scope["path"], status=error.status,
                                reason=error.reason, phase=error.phase)
            record.client = scope.get("relay.client", DEFAULT_CLIENT)
            scope["relay.record"] = record  # for the exchange's log line
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
                scope["relay.body_read"] = not message.get("more_body")
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


def _query_key(scope: Scope) -> str:
    """The ``key`` of the query string (Google's clients may put their key there)."""
    query = scope.get("query_string") or b""
    values: list[str] = urllib.parse.parse_qs(query.decode("latin-1")).get("key", [])
    return values[0] if values else ""


def _has_body(scope: Scope) -> bool:
    length = header(scope, b"content-length")
    return header(scope, b"transfer-encoding") is not None or (
        length is not None and length.strip() != "0")


class _Logged:
    """What the exchange's log line says, gathered as the exchange goes."""

    def __init__(self, started: float) -> None:
        self.started = started
        self.status: int | None = None
        self.bytes_in = 0
        self.bytes_out = 0

    def log(self, scope: Scope) -> None:
        if not access_log.isEnabledFor(logging.INFO):
            return
        record: Record | None = scope.get("relay.record")  # relay routes: the record
        model = (record.requested_model or record.model) if record is not None else None
        line = (f"{_plain(scope['method'])} {_plain(scope['path'])}"
                f"{'?…' if scope.get('query_string') else ''} {self.status or '-'} "
                f"{(trio.current_time() - self.started) * 1000:.1f} ms "
                f"request={scope['relay.request_id']}"
                + (f" model={_plain(model)}" if model else "")
                + f" in={self.bytes_in} B out={self.bytes_out} B")
        if record is not None and record.reason is not None:
            line += f" reason={record.reason}"  # a failure, or a client that left
        access_log.info("%s", line)


def _plain(value: str, limit: int = 200) -> str:
    """``value`` as is when it is plain printable ASCII without spaces or quotes, else
    JSON-quoted (control characters escaped); at most ``limit`` characters of it."""
    value = value if len(value) <= limit else value[:limit] + "…"
    if value.isascii() and value.isprintable() and not any(c in value for c in ' "\\'):
        return value
    return json.dumps(value)


async def _lifespan(receive: Receive, send: Send) -> None:
    # relay keeps its services in its own nursery, not in lifespan hooks (DESIGN).
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
