"""The guard: one ASGI layer in front of every route, raw or Quart (SPEC O4).

Host, token, Origin and content-type checks, the body read whole under a size limit and
a deadline, and the request id. The inner app gets the whole body at once, then the real
``receive`` (so it still sees ``http.disconnect``).
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import secrets
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import trio

from relay.dialects.base import Dialect
from relay.vocab.errors import RelayError
from relay.vocab.profile import is_loopback_host
from relay.vocab.records import Record

from .asgi import Message, Receive, Scope, Send, header, send_error
from .paths import dialect_for, match

if TYPE_CHECKING:
    from relay.engine.engine import Engine

__all__ = ["Guard"]


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
        origin = header(scope, b"origin")
        extra = [(b"x-relay-request-id", request_id.encode())]
        if origin is not None and origin in self.origins:
            extra += [(b"access-control-allow-origin", origin.encode()), (b"vary", b"origin"),
                      (b"access-control-expose-headers",
                       b"x-relay-request-id, retry-after, x-should-retry")]

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), *extra]}
            await send(message)

        dialect = dialect_for(scope["path"])
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
        if self.token is not None and scope["path"] not in ("/healthz", "/") and scope[
                "method"] != "OPTIONS":
            scheme, _, value = (header(scope, b"authorization") or "").partition(" ")
            if scheme.lower() != "bearer":
                # Anthropic's clients send their key as x-api-key.
                value = header(scope, b"x-api-key") or ""
            if not value or not hmac.compare_digest(value.strip().encode(),
                                                    self.token.encode()):
                return RelayError("unauthorized", "this relay requires a token: send "
                                  "'Authorization: Bearer <token>' or 'x-api-key: <token>' "
                                  "(the value of the variable named by [server] token_env)")
        if scope["method"] in ("POST", "PUT", "PATCH"):
            length = header(scope, b"content-length")
            has_body = header(scope, b"transfer-encoding") is not None or (
                length is not None and length.strip() != "0")
            ctype = (header(scope, b"content-type") or "").split(";")[0].strip().lower()
            if has_body and not (ctype == "application/json" or ctype.endswith("+json")):
                return RelayError("invalid_request", f"request bodies must be "
                                  f"application/json, not {ctype or 'untyped'}", status=415)
            if length is not None and length.strip().isdigit() and int(length) > self.max_body:
                return RelayError("invalid_request", f"the body is {int(length)} bytes; the "
                                  f"limit is {self.max_body} ([server] max_body_bytes)",
                                  status=413)
        return None

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
