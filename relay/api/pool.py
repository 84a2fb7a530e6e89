"""The upstream connection pool: httpcore's, with a cheaper assignment of requests, and
each request's head and body sent in one write."""

from __future__ import annotations

import time
from typing import Any

import httpcore

__all__ = ["CorkedBackend", "LeanPool"]


class LeanPool(httpcore.AsyncConnectionPool):
    """httpcore's pool, assigning requests without re-scanning every connection.

    httpcore 1.0.9 runs `_assign_requests_to_connections` as each request enters and as
    each response closes, and every run asks each pooled connection ``has_expired()`` —
    a ``poll()`` of its socket — and, per idle one, counts the whole pool again: with 32
    connections that was most of the pool's cost per request (issue 16's profile).

    Same decisions, found cheaper: a connection is checked for expiry (keep-alive
    timeout, or the server closed it while idle) *before it is reused* — the check that
    matters — and the whole pool is swept for expired ones at most every `SWEEP_S`
    seconds (httpcore too closes them only when a request comes or goes). The rest is
    httpcore's: the oldest available connection first, a new one while under
    ``max_connections``, else an idle one closed to make room.
    """

    SWEEP_S = 1.0
    _swept_at = -SWEEP_S  # class default: the first run sweeps

    @classmethod
    def install(cls, transport: Any) -> None:
        """Make an httpx transport's plain pool (not a proxy's) a `LeanPool`: the same
        object and settings, only these two methods differ."""
        if type(transport._pool) is httpcore.AsyncConnectionPool:
            transport._pool.__class__ = cls
            transport._pool._network_backend = CorkedBackend(transport._pool._network_backend)

    def _assign_requests_to_connections(self) -> list[httpcore.AsyncConnectionInterface]:
        closing: list[httpcore.AsyncConnectionInterface] = []
        now = time.monotonic()
        sweep = now - self._swept_at >= self.SWEEP_S
        if sweep:
            self._swept_at = now
        kept = []
        for connection in self._connections:
            if connection.is_closed():
                continue
            if sweep and connection.has_expired():
                closing.append(connection)
                continue
            kept.append(connection)
        while len(kept) > self._max_keepalive_connections:  # httpcore's rule, as it counts
            idle = next((c for c in kept if c.is_idle()), None)
            if idle is None:
                break
            kept.remove(idle)
            closing.append(idle)
        self._connections = kept
        for pool_request in self._requests:
            if pool_request.is_queued():
                self._assign(pool_request, closing)
        return closing

    def _assign(self, pool_request: Any, closing: list[httpcore.AsyncConnectionInterface]
                ) -> None:
        origin = pool_request.request.url.origin
        for connection in list(self._connections):
            if connection.can_handle_request(origin) and connection.is_available():
                if connection.is_idle() and connection.has_expired():  # before reuse
                    self._connections.remove(connection)
                    closing.append(connection)
                    continue
                pool_request.assign_to_connection(connection)
                return
        if len(self._connections) >= self._max_connections:
            idle = next((c for c in self._connections if c.is_idle()), None)
            if idle is None:
                return  # it waits for a connection
            self._connections.remove(idle)
            closing.append(idle)
        connection = self.create_connection(origin)
        self._connections.append(connection)
        pool_request.assign_to_connection(connection)


def _is_request_head(data: bytes) -> bool:
    """A request line and headers, nothing after them (h11 writes the head alone)."""
    end = data.find(b"\r\n\r\n")
    return end >= 0 and end == len(data) - 4 and data[:data.find(b"\r\n")].endswith(
        (b" HTTP/1.1", b" HTTP/1.0"))


class CorkedStream(httpcore.AsyncNetworkStream):
    """A connection that holds a request's head back until what follows it — its body,
    or the wait for the answer — so a request leaves in one write, not two (each write
    on loopback wakes the upstream once more: ~0.1 ms a request at concurrency 1).

    A held head goes out with the next write, or before the next read; a failure to
    write it then is the same ``WriteError`` the write would have raised, and on a read
    it is dropped as httpcore drops one (the server may have answered and closed)."""

    def __init__(self, stream: httpcore.AsyncNetworkStream) -> None:
        self._stream = stream
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
        await self._stream.write(buffer, timeout)

    async def read(self, max_bytes: int,
                   timeout: float | None = None) -> bytes:  # noqa: ASYNC109
        if self._held:
            held, self._held = self._held, b""
            try:
                await self._stream.write(held, self._held_timeout)
            except httpcore.WriteError:
                pass  # as httpcore does: the answer (or the EOF) is read next
        return await self._stream.read(max_bytes, timeout)

    async def aclose(self) -> None:
        self._held = b""
        await self._stream.aclose()

    async def start_tls(self, ssl_context: Any, server_hostname: str | None = None,
                        timeout: float | None = None,  # noqa: ASYNC109
                        ) -> httpcore.AsyncNetworkStream:
        return CorkedStream(await self._stream.start_tls(ssl_context, server_hostname,
                                                         timeout))

    def get_extra_info(self, info: str) -> Any:
        return self._stream.get_extra_info(info)


class CorkedBackend(httpcore.AsyncNetworkBackend):
    """httpcore's network backend, its connections `CorkedStream`."""

    def __init__(self, backend: httpcore.AsyncNetworkBackend) -> None:
        self._backend = backend

    async def connect_tcp(self, host: str, port: int,
                          timeout: float | None = None,  # noqa: ASYNC109
                          local_address: str | None = None,
                          socket_options: Any = None) -> httpcore.AsyncNetworkStream:
        return CorkedStream(await self._backend.connect_tcp(
            host, port, timeout=timeout, local_address=local_address,
            socket_options=socket_options))

    async def connect_unix_socket(self, path: str,
                                  timeout: float | None = None,  # noqa: ASYNC109
                                  socket_options: Any = None) -> httpcore.AsyncNetworkStream:
        return CorkedStream(await self._backend.connect_unix_socket(
            path, timeout=timeout, socket_options=socket_options))

    async def sleep(self, seconds: float) -> None:
        await self._backend.sleep(seconds)
