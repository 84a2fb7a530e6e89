"""The response store of ``/v1/responses`` (SPEC A7): ``store`` and
``previous_response_id``, owned by the engine, not by any dialect or provider.

A stored response is the Responses object the client got (``output`` included) and the
whole input that led to it (every earlier turn already expanded). A request naming
``previous_response_id`` is expanded by relay into that input, that output and its own
input *before any adapter sees it*, so every provider stays stateless: no upstream, and
no CLI tool's warm session least of all, keeps a conversation for relay.

Bounded three ways; whichever bound is reached first evicts the oldest entries:

- `MAX_ENTRIES` responses (1,000),
- `MAX_BYTES` of JSON (64 MiB: each entry counted as its response plus its whole
  expanded input, so a long conversation's turns count what they repeat),
- `MAX_AGE_S` since it was stored (24 hours).

A response larger than the byte bound by itself is not stored. The store lives in
memory only: it is lost when relay restarts. An id relay does not hold — never stored,
evicted, deleted, or from before a restart — is a 404 naming it (`forgotten` says which
of those it was for the ids it still remembers losing).
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import attrs
import trio

__all__ = ["MAX_AGE_S", "MAX_BYTES", "MAX_ENTRIES", "ResponseStore", "StoredResponse"]

logger = logging.getLogger(__name__)

MAX_ENTRIES = 1000
MAX_BYTES = 64 * 1024 * 1024
MAX_AGE_S = 24 * 3600.0
_REMEMBER_LOST = 4096  # how many lost ids the store can still explain


@attrs.frozen
class StoredResponse:
    id: str
    response: dict[str, Any]   # the Responses object as the client got it
    input: list[dict[str, Any]]  # the whole input that led to it (earlier turns expanded)
    size: int
    stored_at: float


class ResponseStore:
    """Responses by id, in memory, bounded by entries, bytes and age (the module
    docstring). Items are shared, never copied or changed: callers must not mutate what
    they put in or get back."""

    def __init__(self, *, max_entries: int = MAX_ENTRIES, max_bytes: int = MAX_BYTES,
                 max_age_s: float = MAX_AGE_S,
                 clock: Callable[[], float] = trio.current_time) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.max_age_s = max_age_s
        self.clock = clock
        self.bytes = 0
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lost: OrderedDict[str, str] = OrderedDict()  # id → why it is gone

    def __len__(self) -> int:
        return len(self._entries)

    def describe(self) -> str:
        return (f"at most {self.max_entries} responses, {self.max_bytes // (1024 * 1024)} "
                f"MiB, {self.max_age_s / 3600:g} h each; lost when relay restarts")

    def put(self, response_id: str, response: dict[str, Any],
            input_items: list[dict[str, Any]]) -> bool:
        """Store a response; False when it is too large to keep (it is then forgotten)."""
        size = len(json.dumps(response, separators=(",", ":"))) + len(
            json.dumps(input_items, separators=(",", ":")))
        self.delete(response_id)
        if size > self.max_bytes:
            self._forget(response_id, f"was not stored: with its input it is {size} bytes, "
                         f"more than the store holds ({self.max_bytes} bytes)")
            logger.info("response %s not stored: %d bytes", response_id, size)
            return False
        self._entries[response_id] = StoredResponse(response_id, response, input_items, size,
                                                    self.clock())
        self.bytes += size
        self._lost.pop(response_id, None)
        self._evict()
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        self._expire()
        return self._entries.get(response_id)

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self.bytes -= entry.size
        self._forget(response_id, "was deleted")
        return True

    def forgotten(self, response_id: str) -> str | None:
        """Why the store no longer holds an id it did hold (for as many lost ids as it
        remembers), or None."""
        self._expire()
        return self._lost.get(response_id)

    def _evict(self) -> None:
        self._expire()
        while self._entries and (len(self._entries) > self.max_entries
                                 or self.bytes > self.max_bytes):
            old_id, old = self._entries.popitem(last=False)
            self.bytes -= old.size
            self._forget(old_id, f"was evicted to make room (the store keeps "
                         f"{self.describe()})")

    def _expire(self) -> None:
        cutoff = self.clock() - self.max_age_s
        while self._entries:
            old_id, old = next(iter(self._entries.items()))
            if old.stored_at > cutoff:
                break
            del self._entries[old_id]
            self.bytes -= old.size
            self._forget(old_id, f"expired (the store keeps responses for "
                         f"{self.max_age_s / 3600:g} h)")

    def _forget(self, response_id: str, why: str) -> None:
        self._lost[response_id] = why
        self._lost.move_to_end(response_id)
        while len(self._lost) > _REMEMBER_LOST:
            self._lost.popitem(last=False)
