"""The upstream connection pool: HTTP/1.1 connections of httpcore's, pooled by relay, and
each request's head and body sent in one write."""

from __future__ import annotations

import ssl
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpcore
import trio
from httpcore._backends.trio import TrioStream

from . import eager

__all__ = ["CorkedBackend", "CorkedStream", "DirectPool"]

CLOSE_TIMEOUT_S = 1.0  # closing a response touches only the local socket


class DirectPool:
    """One provider's HTTP/1.1 connections, without httpcore's pool around them.

    httpcore 1.0.9's pool re-decides every queued request's connection, under a lock, each
    time a request comes or a response closes, and wraps each response twice: with 32
    connections that was a quarter of relay's CPU per request (issue 16's profile). Here
    a request takes the oldest idle connection to its origin — checked first: one past its
    keep-alive, or that the server closed while it was idle (a poll of its socket), is
    closed instead — or opens one; its connection is idle again the moment its response
    is closed whole, and closed if the body was left unfinished (httpcore's rule: its
    ``HTTP11Connection`` decides). At most ``max_connections`` are open: a request beyond
    them closes an idle connection to another origin, or waits for one to be freed, up to
    the pool timeout (``PoolTimeout``). Idle connections past their keep-alive are swept
    at most every `SWEEP_S` seconds (httpcore too closes them only as requests come and
    go). The TLS context is made when the first https connection is (it costs ~40 ms).
    """

    SWEEP_S = 1.0

    def __init__(self, *, max_connections: int, keepalive_expiry: float | None,
                 ssl_context: Callable[[], ssl.SSLContext],
                 network_backend: httpcore.AsyncNetworkBackend) -> None:
        self._max = max_connections
        self._keepalive_expiry = keepalive_expiry
        self._make_ssl_context = ssl_context
        self._ssl_context: ssl.SSLContext | None = None
        self._network_backend = network_backend
        # By origin (`_key`).
        self._idle: dict[tuple[bytes, bytes, int], deque[httpcore.AsyncHTTP11Connection]] = {}
        self._open: set[httpcore.AsyncHTTP11Connection] = set()
        self._opening = 0
        self._freed = trio.lowlevel.ParkingLot()
        self._swept_at = time.monotonic()
        self._closed = False

    @property
    def connections(self) -> int:
        """Open (or opening) connections, busy or idle."""
        return len(self._open) + self._opening

    @property
    def waiting(self) -> int:
        """Requests waiting for a connection to be freed."""
        return self._freed.statistics().tasks_waiting

    async def handle_async_request(self, request: httpcore.Request) -> httpcore.Response:
        scheme = request.url.scheme
        if scheme not in (b"http", b"https"):
            raise httpcore.UnsupportedProtocol(
                f"Request URL has an unsupported protocol '{scheme.decode()}://'." if scheme
                else "Request URL is missing an 'http://' or 'https://' protocol.")
        if not request.url.host:  # (httpx parsed http://:8080/v1 as a relative URL)
            raise httpcore.UnsupportedProtocol(
                "Request URL is missing an 'http://' or 'https://' protocol.")
        if self._closed:
            raise RuntimeError("the upstream client has been closed")
        timeouts = request.extensions.get("timeout", {})
        connection = await self._connection_for(request.url.origin, timeouts)
        try:
            response = await connection.handle_async_request(request)
        except BaseException:
            await self._release(connection)  # httpcore closed it or left it idle, mostly
            raise
        response.stream = _Released(response.stream, self, connection)
        return response

    async def _connection_for(self, origin: httpcore.Origin, timeouts: dict[str, Any]
                              ) -> httpcore.AsyncHTTP11Connection:
        await self._sweep()
        while True:
            idle = self._idle.get(_key(origin))
            while idle:
                connection = idle.popleft()
                if not connection.has_expired():
                    return connection
                await self._close(connection)
            if self.connections < self._max:
                return await self._connect(origin, timeouts)
            other = next((q for q in self._idle.values() if q), None)
            if other is not None:  # room made for this origin
                await self._close(other.popleft())
                continue
            with trio.move_on_after(timeouts.get("pool") or float("inf")) as waited:
                await self._freed.park()
            if waited.cancelled_caught:
                raise httpcore.PoolTimeout("no connection was freed in time")

    async def _connect(self, origin: httpcore.Origin, timeouts: dict[str, Any]
                       ) -> httpcore.AsyncHTTP11Connection:
        self._opening += 1
        try:
            host, timeout = origin.host.decode("ascii"), timeouts.get("connect")
            stream = await self._network_backend.connect_tcp(host, origin.port,
                                                             timeout=timeout)
            if origin.scheme == b"https":
                try:
                    stream = await stream.start_tls(self._tls(), host, timeout)
                except BaseException:
                    await stream.aclose()
                    raise
        except BaseException:
            self._freed.unpark()  # a failed connect frees its place
            raise
        finally:
            self._opening -= 1
        connection = httpcore.AsyncHTTP11Connection(origin, stream, self._keepalive_expiry)
        connection._state_lock = _EagerLock()  # type: ignore[assignment]  # (httpcore 1.0.9's)
        self._open.add(connection)
        return connection

    def _tls(self) -> ssl.SSLContext:
        if self._ssl_context is None:
            self._ssl_context = self._make_ssl_context()
            self._ssl_context.set_alpn_protocols(["http/1.1"])
        return self._ssl_context

    async def _release(self, connection: httpcore.AsyncHTTP11Connection) -> None:
        """A request is done with ``connection``: idle again, or closed and gone. One
        httpcore left neither — a new connection cancelled before its first request
        began (httpcore's state lock comes before its own cleanup) — is closed here."""
        if not connection.is_idle() and not connection.is_closed():
            with trio.CancelScope(shield=True), trio.move_on_after(CLOSE_TIMEOUT_S):
                await connection.aclose()
        if connection.is_idle() and not self._closed:
            self._idle.setdefault(_key(connection._origin), deque()).append(connection)
        else:
            self._open.discard(connection)
        self._freed.unpark()

    async def _close(self, connection: httpcore.AsyncHTTP11Connection) -> None:
        self._open.discard(connection)
        self._freed.unpark()
        await connection.aclose()  # a trio socket's aclose closes even when cancelled

    async def _sweep(self) -> None:
        now = time.monotonic()
        if now - self._swept_at < self.SWEEP_S:
            return
        self._swept_at = now
        # Taken out of the idle lists all at once, before the first close awaits: another
        # request may take an idle connection meanwhile, or add an origin.
        expired: list[httpcore.AsyncHTTP11Connection] = []
        for idle in self._idle.values():
            stale = [c for c in idle if c.has_expired()]
            if stale:
                expired += stale
                kept = [c for c in idle if c not in stale]
                idle.clear()  # in place: a request may hold this very list across an await
                idle.extend(kept)
        # Closed as one: a cancel landing on the first close must not leave the others
        # counted as open, neither idle nor closed (a slot lost for good).
        for connection in expired:
            self._open.discard(connection)
        self._freed.unpark_all()
        with trio.CancelScope(shield=True), trio.move_on_after(  # noqa: ASYNC912
                CLOSE_TIMEOUT_S):
            for connection in expired:
                await connection.aclose()

    async def aclose(self) -> None:
        """Close every connection. Shielded (as httpcore's pool closes them): a cancelled
        close of one must not leave the others open; each touches only a local socket.
        A request after this is refused (as httpx refuses one on a closed client)."""
        self._closed = True
        self._idle.clear()
        # (no connection open: nothing to wait for)
        with trio.CancelScope(shield=True), trio.move_on_after(  # noqa: ASYNC912
                CLOSE_TIMEOUT_S):
            for connection in list(self._open):
                await self._close(connection)


class _Released:
    """A response body whose connection goes back to the pool when it is closed."""

    def __init__(self, stream: Any, pool: DirectPool,
                 connection: httpcore.AsyncHTTP11Connection) -> None:
        self._stream = stream
        self._pool = pool
        self._connection = connection
        self._closed = False

    def __aiter__(self) -> AsyncIterator[bytes]:
        return aiter(self._stream)  # httpcore's own iterator, no layer of ours

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        # Shielded as httpcore shields it: a half-closed response poisons its connection.
        # (One scope, shielded with a deadline of its own: every request closes one.)
        with trio.CancelScope(shield=True, deadline=trio.current_time() + CLOSE_TIMEOUT_S):
            await self._stream.aclose()  # httpcore: idle again, or closed
        await self._pool._release(self._connection)


def _key(origin: httpcore.Origin) -> tuple[bytes, bytes, int]:
    """An origin as a dict key (httpcore's `Origin` is not hashable)."""
    return origin.scheme, origin.host, origin.port


def _is_request_head(data: bytes) -> bool:
    """A request line and headers, nothing after them (h11 writes the head alone)."""
    end = data.find(b"\r\n\r\n")
    return end >= 0 and end == len(data) - 4 and data[:data.find(b"\r\n")].endswith(
        (b" HTTP/1.1", b" HTTP/1.0"))


class _EagerLock:
    """httpcore's per-connection state lock (taken twice a request), acquired without a
    trip through the scheduler when it is free. A cancel point still."""

    def __init__(self) -> None:
        self._lock = trio.Lock()

    async def __aenter__(self) -> _EagerLock:
        await eager.acquire(self._lock)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._lock.release()


class CorkedStream(TrioStream):
    """httpcore's trio connection, with cheaper reads and writes, and a request's head
    held back until what follows it — its body, or the wait for the answer — so a
    request leaves in one write, not two (each write on loopback wakes the upstream once
    more: ~0.1 ms a request at concurrency 1).

    httpcore's own wraps every read and write in ``trio.fail_after`` and an exception
    mapping, both generator context managers: ~6 % of relay's CPU per request (issue
    16's profile). Here a read with no timeout (relay's answers: its own scopes own their
    deadlines) has no scope at all, a write's timeout is one plain `trio.CancelScope`,
    and failures become the same httpcore errors (``ReadError``, ``WriteTimeout``, …).

    A held head goes out with the next write, or before the next read; a failure to
    write it then is the same ``WriteError`` the write would have raised, and on a read
    it is dropped as httpcore drops one (the server may have answered and closed)."""

    def __init__(self, stream: trio.abc.Stream) -> None:
        super().__init__(stream)
        self._held = b""
        self._held_timeout: float | None = None

    # (The ``timeout`` parameters are httpcore's interface.)
    async def write(self, buffer: bytes,
                    timeout: float | None = None) -> None:  # noqa: ASYNC109
        if not buffer:  # h11's end of a message without a body (or with a length)
            return
        if self._held:
            buffer, self._held = self._held + buffer, b""
        elif _is_request_head(buffer):
            self._held, self._held_timeout = buffer, timeout
            return
        await self._send(buffer, timeout)

    async def _send(self, buffer: bytes, timeout: float | None) -> None:  # noqa: ASYNC109
        await trio.lowlevel.checkpoint_if_cancelled()
        try:
            # What the socket takes at once needs no deadline scope (on loopback: all).
            sent = eager.write_now(self._stream, buffer)
            if sent == len(buffer):
                return
            rest = memoryview(buffer)[sent:] if sent else buffer
            if timeout is None:
                await self._stream.send_all(rest)
                return
            with trio.CancelScope(deadline=trio.current_time() + timeout) as scope:
                await self._stream.send_all(rest)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise httpcore.WriteError(exc) from exc
        if scope.cancelled_caught:
            raise httpcore.WriteTimeout("the write did not complete in time")

    async def read(self, max_bytes: int,
                   timeout: float | None = None) -> bytes:  # noqa: ASYNC109
        if self._held:
            held, self._held = self._held, b""
            try:
                await self._send(held, self._held_timeout)
            except httpcore.WriteError:
                pass  # as httpcore does: the answer (or the EOF) is read next
        try:
            if timeout is None:
                return bytes(await self._stream.receive_some(max_bytes))  # (no copy of bytes)
            with trio.CancelScope(deadline=trio.current_time() + timeout):
                return bytes(await self._stream.receive_some(max_bytes))  # (no copy of bytes)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise httpcore.ReadError(exc) from exc
        raise httpcore.ReadTimeout("no data arrived in time")

    async def aclose(self) -> None:
        self._held = b""
        await self._stream.aclose()

    async def start_tls(self, ssl_context: Any, server_hostname: str | None = None,
                        timeout: float | None = None,  # noqa: ASYNC109
                        ) -> httpcore.AsyncNetworkStream:
        tls = await super().start_tls(ssl_context, server_hostname, timeout)
        assert isinstance(tls, TrioStream)
        return CorkedStream(tls._stream)

    def get_extra_info(self, info: str) -> Any:
        if info == "is_readable" and isinstance(self._stream, trio.SocketStream):
            return self._stream.socket.is_readable()  # (httpcore's asks twice over)
        return super().get_extra_info(info)


class CorkedBackend(httpcore.AsyncNetworkBackend):
    """httpcore's trio network backend, its connections `CorkedStream`."""

    def __init__(self) -> None:
        self._backend = httpcore.TrioBackend()

    async def connect_tcp(self, host: str, port: int,
                          timeout: float | None = None,  # noqa: ASYNC109
                          local_address: str | None = None,
                          socket_options: Any = None) -> httpcore.AsyncNetworkStream:
        stream = await self._backend.connect_tcp(host, port, timeout=timeout,
                                                 local_address=local_address,
                                                 socket_options=socket_options)
        assert isinstance(stream, TrioStream)
        return CorkedStream(stream._stream)

    async def connect_unix_socket(self, path: str,
                                  timeout: float | None = None,  # noqa: ASYNC109
                                  socket_options: Any = None) -> httpcore.AsyncNetworkStream:
        stream = await self._backend.connect_unix_socket(path, timeout=timeout,
                                                         socket_options=socket_options)
        assert isinstance(stream, TrioStream)
        return CorkedStream(stream._stream)

    async def sleep(self, seconds: float) -> None:
        await trio.sleep(seconds)
