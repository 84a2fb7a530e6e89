"""The per-request record: one JSON line, written once, when the request ends (SPEC A5).

Every request gets exactly one record — answered, failed, stopped or crashed — because
the front writes it from a synchronous ``finally``. Times are ISO 8601 UTC, taken from
trio's monotonic clock and a wall-clock anchor fixed at start (so durations are honest
even when the system clock jumps). The file rotates by size: ``records`` →
``records.1`` → … → ``records.N``.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import trio

from .redact import redact_obj

__all__ = ["Attempt", "Clock", "Record", "RecordWriter"]

logger = logging.getLogger(__name__)


class Clock:
    """Monotonic trio time → wall-clock ISO strings, anchored once."""

    def __init__(self) -> None:
        self._anchor = time.time() - trio.current_time()

    def iso(self, t: float | None) -> str | None:
        if t is None:
            return None
        stamp = dt.datetime.fromtimestamp(self._anchor + t, tz=dt.UTC)
        return stamp.isoformat(timespec="milliseconds").replace("+00:00", "Z")


@attrs.define(kw_only=True)
class Attempt:
    provider: str
    model: str
    role: str = "primary"
    ok: bool = False
    started: float = 0.0
    duration_ms: float | None = None
    failure: str | None = None
    released_at: float | None = None


@attrs.define(kw_only=True)
class Record:
    id: str
    started_at: float
    route: str | None = None
    provider: str | None = None
    model: str | None = None
    priority: str = "normal"
    stream: bool = False
    status: int = 200
    reason: str | None = None
    phase: str | None = None
    queue_ms: float | None = None
    run_ms: float | None = None
    recovered: bool = False
    usage: dict[str, Any] | None = None
    fallback_triggered: bool = False
    stop_requested_at: float | None = None
    released_at: float | None = None
    attempts: list[Attempt] = attrs.field(factory=list)
    skipped_events: list[str] = attrs.field(factory=list)

    def as_json(self, clock: Clock) -> dict[str, Any]:
        out = attrs.asdict(self, recurse=False)
        for key in ("started_at", "stop_requested_at", "released_at"):
            out[key] = clock.iso(out[key])
        out["attempts"] = [
            {"provider": a.provider, "model": a.model, "role": a.role, "ok": a.ok,
             "duration_ms": a.duration_ms, "failure": a.failure,
             "released_at": clock.iso(a.released_at)}
            for a in self.attempts
        ]
        if not self.skipped_events:
            del out["skipped_events"]
        return out


class RecordWriter:
    """Appends records to a file, rotating by size. Writing is synchronous (a small
    append to the page cache) so it can run in ``finally`` even when cancelled."""

    def __init__(self, path: Path | None, *, max_bytes: int, keep: int, clock: Clock) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.keep = keep
        self.clock = clock
        self._file: Any = None
        self._failed = False
        self._closed = False
        self.recent: list[dict[str, Any]] = []  # the last few, for status and tests
        # Called with each record as it is written (metrics count requests here: this is
        # the one place every request ends, SPEC A5).
        self.observers: list[Callable[[Record], None]] = []

    def write(self, record: Record) -> None:
        line = redact_obj(record.as_json(self.clock))  # SPEC E1: records are an exit
        self.recent.append(line)
        if len(self.recent) > 200:
            del self.recent[:100]
        for observe in self.observers:
            try:
                observe(record)
            except Exception:  # an observer's bug must never cost the record
                logger.exception("a record observer failed on request %s", record.id)
        if self.path is None or self._failed or self._closed:
            return
        data = json.dumps(line, separators=(",", ":"), default=str) + "\n"
        try:
            if self._file is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115
            if self._file.tell() + len(data) > self.max_bytes and self._file.tell() > 0:
                self._rotate()
            self._file.write(data)
            self._file.flush()
        except OSError as exc:
            self._failed = True
            logger.error("cannot write request records to %s: %s; records are off",
                         self.path, exc)

    def _rotate(self) -> None:
        assert self.path is not None
        self._file.close()
        self._file = None
        if self.keep == 0:
            os.truncate(self.path, 0)
        else:
            for i in range(self.keep - 1, 0, -1):
                older = self.path.with_name(f"{self.path.name}.{i}")
                if older.exists():
                    os.replace(older, self.path.with_name(f"{self.path.name}.{i + 1}"))
            os.replace(self.path, self.path.with_name(f"{self.path.name}.1"))
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115

    def close(self) -> None:
        self._closed = True
        if self._file is not None:
            self._file.close()
            self._file = None
