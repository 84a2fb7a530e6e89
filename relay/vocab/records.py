"""The per-request record: one JSON line, written once per request (SPEC A5, O5).

Every request gets exactly one record — answered, failed, stopped or crashed — because
the front writes it from a synchronous ``finally`` if it has not been written before.
Times are ISO 8601 UTC, taken from trio's monotonic clock and a wall-clock anchor fixed
at start (so durations are honest even when the system clock jumps). The file rotates by
size: ``records`` → ``records.1`` → … → ``records.N``.

What a record claims. It is relay's account of a request: the outcome relay decided
(status, reason, phase), the attempts, queue and run times, when a stop was asked and
when every lane the request held was given back. It is written as soon as all of that is
final, and for an answer that is *before its last byte is handed to the server* — so a
client holding a complete answer always has its record in the file, and a kill -9 just
after the last byte cannot lose it (before, 4-5 of ~1,250-3,200 answers completed under
load had none). It does not claim the client read the answer: status 200 means the
answer was complete and handed over; a client that vanishes or stalls during that very
last write is not recorded as 499. Written at the request's real end instead, and so
lost by a kill -9 between the last byte and that end (they could not have been written
sooner, their release times were not known): a request one of whose attempts is still
cleaning up (stopped by a timeout while a fallback answered), and a fan-out request
(its record merges the branches' at the end).

Writing. Each record goes out with one unbuffered ``write(2)`` (an ``O_APPEND``
descriptor, no user-space buffer) inside the call that ends its request: nothing is
batched or held back in normal operation, so well inside the 50 ms SPEC O5 allows, and a
kill -9 loses no record that had been written. Faults never touch serving; each is
logged once as an ERROR (and once more, a WARNING, when it is over), not per record, and
shown in ``GET /relay/v1/status`` (``records``: writing, failing since, why, how many
kept back, how many dropped):

- a full disk (ENOSPC), a read-only file or file system, a directory (or anything not a
  regular file) at the path, a missing parent that cannot be made, a directory removed
  while relay runs (it is made at start only): the records are kept back in memory, in
  order. The backlog is bounded by ``BACKLOG_MAX_BYTES`` (4 MiB, some 4,000-10,000
  records): beyond, the oldest are dropped, counted, said once in the log, and the count
  logged when writing resumes and kept in the status. Writing is retried every
  ``RETRY_S``, by a task of relay's own (`serve_retries`) and when a record arrives;
- when space comes back, whatever is kept back is written oldest first, as many whole
  lines as the file system takes, and the rest as space allows: a write cut short by a
  full disk keeps the whole lines that made it and truncates away the part of the next,
  so the file never keeps half a record (issue 29: the backlog was written as one block
  and undone whole, again and again, when it did not fit all at once);
- at stop (SIGTERM, the end of ``open_relay``), one last try writes whatever fits; what
  does not is dropped, and the log says how many;
- a file whose last line has no newline (a kill -9 or a crash mid-write): the next record
  starts on a new line, never glued onto the fragment; readers should skip a line that
  does not parse;
- the file moved, removed or replaced behind relay's back (checked before each write):
  it is opened again at the path.
"""

from __future__ import annotations

import datetime as dt
import errno
import json
import logging
import math
import os
import stat
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import trio

from .redact import redact_obj

__all__ = ["Attempt", "Clock", "Record", "RecordWriter"]

# layers: long because the writer keeps every fault of its file (a full disk, a short
# write, read-only, vanished, rotation) in one place, beside the record it writes; a
# split would move code that another branch edits (issue 29, merged in parallel).

logger = logging.getLogger(__name__)


class Clock:
    """Monotonic trio time → wall-clock ISO strings, anchored once."""

    def __init__(self) -> None:
        self._anchor = time.time() - trio.current_time()
        self._second = -1   # the last whole second formatted, and its text: a record's
        self._text = ""     # times mostly fall in one (four of them for each request)

    def wall(self, t: float) -> float:
        """Trio time ``t`` as a ``time.time()``."""
        return self._anchor + t

    def iso(self, t: float | None) -> str | None:
        if t is None:
            return None
        stamp = self._anchor + t
        second = math.floor(stamp)
        us = round((stamp - second) * 1_000_000)  # to the microsecond first, as datetime
        if us == 1_000_000:
            second, us = second + 1, 0
        if second != self._second:
            self._second = second
            self._text = dt.datetime.fromtimestamp(second, tz=dt.UTC).strftime(
                "%Y-%m-%dT%H:%M:%S")
        return f"{self._text}.{us // 1000:03d}Z"


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
    # SPEC L11: a shared slot whose release never reached the coordination server (or
    # found its lease already expired): the server took it back only at the lease's end.
    lease_expired: bool = False
    account: str | None = None  # SPEC L13: the provider's account it ran on (None: one)


@attrs.define(kw_only=True)
class Record:
    id: str
    started_at: float
    requested_model: str | None = None  # the model as the client named it (a refusal too)
    endpoint: str | None = None  # the request's path (/v1/embeddings, a path not served …)
    route: str | None = None
    provider: str | None = None
    account: str | None = None  # SPEC L13: the account of the provider that answered
    model: str | None = None
    priority: str = "normal"
    client: str = "default"  # SPEC L14: the client the token named (never the token)
    stream: bool = False
    status: int = 200
    reason: str | None = None
    phase: str | None = None
    queue_ms: float | None = None
    run_ms: float | None = None
    recovered: bool = False
    usage: dict[str, Any] | None = None
    # The client's advisory fields the answering target dropped (SPEC A1a).
    ignored_fields: list[str] = attrs.field(factory=list)
    fallback_triggered: bool = False
    stop_requested_at: float | None = None
    released_at: float | None = None
    attempts: list[Attempt] = attrs.field(factory=list)
    skipped_events: list[str] = attrs.field(factory=list)
    relay_id: str | None = None  # the relay that served it (and held its slots, SPEC L11)
    # SPEC L12: the tokens its attempts reserved from the provider's budgets, what they
    # used (the provider's usage; relay's estimate when it reported none: marked), how
    # long it waited for tokens, and the provider's hold that delayed it.
    tokens_reserved: int | None = None
    tokens_used: int | None = None
    tokens_estimated: bool = False
    token_wait_ms: float | None = None
    held_by: str | None = None
    # SPEC O7: what it cost in US dollars (its usage at its model's price; None: a price
    # it needs is not known; 0 on a CLI tool's subscription). Set as it is written.
    cost_usd: float | None = None

    def as_json(self, clock: Clock) -> dict[str, Any]:
        out = attrs.asdict(self, recurse=False)
        for key in ("started_at", "stop_requested_at", "released_at"):
            out[key] = clock.iso(out[key])
        out["attempts"] = [
            {"provider": a.provider, "model": a.model, "role": a.role, "ok": a.ok,
             "duration_ms": a.duration_ms, "failure": a.failure,
             "released_at": clock.iso(a.released_at),
             **({"lease_expired": True} if a.lease_expired else {}),
             **({"account": a.account} if a.account else {})}
            for a in self.attempts
        ]
        if not self.skipped_events:
            del out["skipped_events"]
        return out


# One encoder, made once (json.dumps with arguments builds one per call).
_encode = json.JSONEncoder(separators=(",", ":"), default=str).encode


class RecordWriter:
    """Appends records to a file, one JSON line each, rotating by size (see the module
    docstring for what a record claims and what a fault costs).

    Writing is synchronous — one ``write(2)`` of whole lines on an ``O_APPEND``
    descriptor, no user-space buffer — so it can run in ``finally`` even when cancelled,
    and a line written is in the kernel's hands at once.
    """

    RETRY_S = 0.5                      # while the file cannot be written: retry this often
    BACKLOG_MAX_BYTES = 4 * 1024 * 1024  # what is kept back meanwhile; older ones are dropped

    def __init__(self, path: Path | None, *, max_bytes: int, keep: int, clock: Clock) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.keep = keep
        self.clock = clock
        self._fd: int | None = None
        self._id: tuple[int, int] | None = None  # (st_dev, st_ino) of the open file
        self._size = 0                  # its length, as far as we wrote it
        self._newline = False           # it does not end with a newline: start one first
        self._made_parent = False       # the directory is made at the first open only
        self._backlog: deque[bytes] = deque()  # lines not written yet (a fault)
        self._backlog_bytes = 0
        self._fault: str | None = None  # what is wrong, while records cannot be written
        self._failing_since: float | None = None  # time.time() the fault began
        self._kept = 0                  # lines kept back in this fault
        self._late = 0                  # ... of which written since (space came back)
        self._lost = 0                  # ... of which dropped from a full backlog
        self._dropped = 0               # lines dropped since relay started (any fault)
        self._retry_at = 0.0            # time.monotonic() of the next attempt
        self._wake = trio.Event()       # set when a fault begins (`serve_retries`)
        self._closed = False
        self.recent: list[dict[str, Any]] = []  # the last few, for status and tests
        self.relay_id: str | None = None  # this relay's name (SPEC 9), set by the engine
        # Called with each record as it is written (metrics count requests here: this is
        # the one place every request ends, SPEC A5).
        self.observers: list[Callable[[Record], None]] = []
        # Called with each record before it is written, to complete it (its cost, SPEC
        # O7; a client's spend settled, L14): what they set is in the line.
        self.completers: list[Callable[[Record], None]] = []

    @property
    def fault(self) -> str | None:
        """Why records cannot be written right now (None: they are)."""
        return self._fault

    def status(self) -> dict[str, Any]:
        """The ``records`` entry of ``GET /relay/v1/status``: where records go, whether
        they are being written and, while not, since when, why, how many are kept back
        in memory; and how many were dropped since relay started."""
        since = self._failing_since
        return {"path": None if self.path is None else str(self.path),
                "writing": self.path is not None and self._fault is None,
                "failing_since": None if since is None else _iso_wall(since),
                "reason": self._fault, "kept_back": len(self._backlog),
                "dropped": self._dropped}

    def write(self, record: Record) -> None:
        if record.relay_id is None:
            record.relay_id = self.relay_id
        for complete in self.completers:
            try:
                complete(record)
            except Exception:  # a bug there must never cost the record
                logger.exception("completing the record of request %s failed", record.id)
        line = redact_obj(record.as_json(self.clock))  # SPEC E1: records are an exit
        self.recent.append(line)
        if len(self.recent) > 200:
            del self.recent[:100]
        for observe in self.observers:
            try:
                observe(record)
            except Exception:  # an observer's bug must never cost the record
                logger.exception("a record observer failed on request %s", record.id)
        if self.path is None or self._closed:
            return
        data = (_encode(line) + "\n").encode()
        self._backlog.append(data)
        self._backlog_bytes += len(data)
        if self._fault is not None:
            self._kept += 1
            self._bound_backlog()
            if time.monotonic() < self._retry_at:
                return
        self._flush()

    async def serve_retries(self) -> None:
        """While records cannot be written, try again every ``RETRY_S`` even when no
        request ends, so writing resumes (and the status says so) as soon as the fault is
        over. Runs until cancelled, in relay's own nursery."""
        while True:
            if self._fault is None or self._closed:
                await self._wake.wait()
                self._wake = trio.Event()
                continue
            await trio.sleep(max(0.0, self._retry_at - time.monotonic()))
            if (self._fault is not None and not self._closed
                    and time.monotonic() >= self._retry_at):
                self._flush()

    def _bound_backlog(self) -> None:
        """Keep at most ``BACKLOG_MAX_BYTES`` back (always the newest line): the oldest go
        first, counted, and said once per fault."""
        while self._backlog_bytes > self.BACKLOG_MAX_BYTES and len(self._backlog) > 1:
            self._backlog_bytes -= len(self._backlog.popleft())
            if not self._lost:
                logger.error("more than %d KiB of request records are kept back for %s: "
                             "the oldest are dropped from now on (counted; the count is "
                             "logged when writing resumes or relay stops)",
                             self.BACKLOG_MAX_BYTES // 1024, self.path)
            self._lost += 1
            self._dropped += 1

    def _flush(self) -> None:
        """Write what is pending, oldest first, as many whole lines as the file takes; on
        an error keep the rest and note the fault (never raises: serving goes on whatever
        the disk does)."""
        late = self._late
        try:
            while self._backlog:
                self._open()
                assert self._fd is not None
                batch, size = self._take_batch()
                if self._size + size > self.max_bytes and self._size > 0:
                    self._rotate()
                    continue
                done, error = self._append(batch)
                for _ in range(done):
                    self._backlog_bytes -= len(self._backlog.popleft())
                if self._fault is not None:
                    self._late += done
                if error is not None:
                    if done:
                        # Cut short by a full disk after some whole lines: what is left
                        # of its last block may still take the next (smaller) ones.
                        continue
                    raise error
        except OSError as exc:
            self._failed(exc)
            if self._late > late:   # some space came back, not enough for all
                logger.warning("request records: %d kept back went into %s, %d are "
                               "still kept back (%s)", self._late - late, self.path,
                               len(self._backlog), self._fault)
        else:
            self._recovered()

    def _take_batch(self) -> tuple[list[bytes], int]:
        """The pending lines that fit before the next rotation (at least one)."""
        batch: list[bytes] = []
        size = 0
        for data in self._backlog:
            if batch and self._size + size + len(data) > self.max_bytes:
                break
            batch.append(data)
            size += len(data)
        return batch, size

    def _open(self) -> None:
        """Open the file if it is not, or again if it was moved, removed or replaced.

        The directory is made at the first open only: one removed later (a cleaned-up
        folder, an unmounted disk) is a fault until it is back, not a new directory made
        where nobody looks (issue 29).
        """
        assert self.path is not None
        if self._fd is not None:
            try:
                st = os.stat(self.path)
                if (st.st_dev, st.st_ino) == self._id:
                    return
            except FileNotFoundError:
                pass
            self._close_fd()
        if not self._made_parent:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        elif not self.path.parent.is_dir():
            raise OSError(errno.ENOENT, f"its directory {self.path.parent} was removed")
        # Nothing at the path (a FIFO, a device) may block the loop in open(): read-write
        # and non-blocking; what is not a regular file is refused just below.
        fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC
                     | os.O_NONBLOCK, 0o644)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise OSError(errno.EINVAL, "not a regular file")
            # A last line without its newline (a kill -9 or a crash mid-write): the next
            # record starts on a line of its own, never glued onto that fragment.
            self._newline = st.st_size > 0 and os.pread(fd, 1, st.st_size - 1) != b"\n"
        except BaseException:
            os.close(fd)
            raise
        self._fd, self._id, self._size = fd, (st.st_dev, st.st_ino), st.st_size
        self._made_parent = True

    def _append(self, batch: list[bytes]) -> tuple[int, OSError | None]:
        """One write of whole lines. Cut short (a full disk: ``write(2)`` takes what fits,
        then refuses), the whole lines that made it stay and the part of the next is
        truncated away, so the file never keeps half a record.

        Returns:
            how many of ``batch`` are in the file, and the error that stopped the rest.
        """
        assert self._fd is not None
        lead = b"\n" if self._newline else b""
        data = lead + b"".join(batch)
        start = self._size
        written = 0
        view = memoryview(data)
        try:
            while written < len(data):
                n = os.write(self._fd, view[written:])
                if n == 0:  # (never seen on a regular file; never loop on it)
                    raise OSError(errno.ENOSPC, "the file took no more bytes")
                written += n
                self._size += n
        except OSError as exc:
            error = exc
        else:
            self._newline = False
            return len(batch), None
        whole = data.rfind(b"\n", 0, written) + 1   # the bytes of whole lines (0: none)
        if self._size > start + whole:
            try:
                os.ftruncate(self._fd, start + whole)
                self._size = start + whole
            except OSError:
                self._newline = True  # could not undo it: the next line starts anew
                return data.count(b"\n", len(lead), whole), error
        if whole:
            self._newline = False
        return data.count(b"\n", len(lead), whole), error

    def _rotate(self) -> None:
        assert self.path is not None
        self._close_fd()
        if self.keep == 0:
            os.truncate(self.path, 0)
        else:
            for i in range(self.keep - 1, 0, -1):
                older = self.path.with_name(f"{self.path.name}.{i}")
                if older.exists():
                    os.replace(older, self.path.with_name(f"{self.path.name}.{i + 1}"))
            os.replace(self.path, self.path.with_name(f"{self.path.name}.1"))
        self._open()

    def _failed(self, exc: OSError) -> None:
        self._close_fd()  # reopened at the next attempt: what is at the path may change
        what = f"{exc.strerror or exc}" + (f" ({errno.errorcode.get(exc.errno, exc.errno)})"
                                           if exc.errno else "")
        if self._fault is None:
            self._kept, self._late, self._lost = len(self._backlog), 0, 0
            self._failing_since = time.time()
            self._wake.set()
        if what != self._fault:  # once per fault, not once per record
            # ERROR: every request's record is at stake (issue 29: a WARNING was missed).
            logger.error("cannot write request records to %s: %s. Serving goes on; "
                         "records are kept back in memory (up to %d KiB, then the oldest "
                         "are dropped and counted) and written, oldest first, when this "
                         "works again (tried every %g s).", self.path, what,
                         self.BACKLOG_MAX_BYTES // 1024, self.RETRY_S)
        self._fault = what
        self._retry_at = time.monotonic() + self.RETRY_S

    def _recovered(self) -> None:
        if self._fault is None:
            return
        assert self._failing_since is not None
        lost = (f"; {self._lost} older ones were dropped (more than "
                f"{self.BACKLOG_MAX_BYTES // 1024} KiB kept back)" if self._lost else "")
        logger.warning("request records are written to %s again (after %s, for %.1f s): "
                       "%d kept back were written%s", self.path, self._fault,
                       time.time() - self._failing_since, self._late, lost)
        self._fault, self._failing_since = None, None
        self._kept = self._late = self._lost = 0

    def _close_fd(self) -> None:
        if self._fd is not None:
            fd, self._fd, self._id = self._fd, None, None
            try:
                os.close(fd)
            except OSError:
                pass

    def close(self) -> None:
        """Write what was kept back (one last try: as many whole lines as fit, oldest
        first), count and log what could not be, then close the file."""
        if self._closed:
            return
        if self._backlog and self.path is not None:
            self._flush()
            if self._backlog:
                left = len(self._backlog)
                self._dropped += left
                logger.error("relay stops: %d request records kept back are dropped, "
                             "%s cannot take them (%s); of %d kept back since %s, %d were "
                             "written and %d dropped before (more than %d KiB kept back)",
                             left, self.path, self._fault, self._kept,
                             _iso_wall(self._failing_since or time.time()), self._late,
                             self._lost, self.BACKLOG_MAX_BYTES // 1024)
                self._backlog.clear()
                self._backlog_bytes = 0
        self._closed = True
        self._close_fd()


def _iso_wall(stamp: float) -> str:
    """A ``time.time()`` as ISO 8601 UTC, to the millisecond (as records' times)."""
    return dt.datetime.fromtimestamp(stamp, tz=dt.UTC).isoformat(
        timespec="milliseconds").replace("+00:00", "Z")
