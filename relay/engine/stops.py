"""Stop handles: how the relay reaches one in-flight request from outside (a drain).

A stop is always a cancelled scope (SPEC C1): every dispatcher of the request (a fan-out
has several) runs inside a scope made here, and `RequestStop.stop` cancels them all and
notes why and when.
"""

from __future__ import annotations

import attrs
import trio

from relay.vocab.errors import RelayError

__all__ = ["RequestStop"]


@attrs.define(eq=False)
class RequestStop:
    """A handle on one in-flight request, so the relay can stop it (a drain)."""

    error: RelayError | None = None
    requested_at: float | None = None
    scopes: list[trio.CancelScope] = attrs.field(factory=list)

    def open_scope(self) -> trio.CancelScope:
        scope = trio.CancelScope()
        if self.error is not None:
            scope.cancel()
        self.scopes.append(scope)
        return scope

    def stop(self, error: RelayError) -> None:
        if self.error is None:
            self.error = error
            self.requested_at = trio.current_time()
        for scope in self.scopes:
            scope.cancel()
