"""The upstream connection pool: httpcore's, with a cheaper assignment of requests."""

from __future__ import annotations

import time
from typing import Any

import httpcore

__all__ = ["LeanPool"]


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
