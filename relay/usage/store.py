"""`UsageStore`: the relay's own task that keeps the usage database up to date.

The database follows the records file the way a reader would, never the request: about
once a second (`INTERVAL_S`) a task of relay's own reads the whole lines written since
the last batch — from the file and, past a rotation, the rotated ones (`relay.usage.tail`)
— and adds them, with the position read up to, in one transaction in a worker thread
(SQLite calls block). A request pays nothing for it: the records writer does exactly what
it did before, and nothing waits for the database.

What the database holds is exactly what the records hold, once each: the position moves
in the same transaction as the counts, so a kill -9, a restart or a failed write neither
loses a record nor counts one twice. At start (and whenever the file at the database's
path is not the one open: removed, replaced), what the records hold past the database's
position is read — all of them, for a database made anew: the rebuild, in batches of
`BATCH_BYTES`, each committed, so a rebuild cut short goes on where it stopped. At stop
(after the records writer's last write), one last read, shielded, within the drain grace.

Faults never touch serving. A database that cannot be written (a full disk, a read-only
file system, a file that is no database) is logged once as an ERROR (and once more, a
WARNING, when it is over), shown in ``GET /relay/v1/status`` (``usage``: writing, failing
since, why, how far behind), and tried again every `RETRY_S`; nothing is lost meanwhile,
the records are read from where the database stopped. Records that never reached the file
(the records' own faults, SPEC O5) never reach the database either.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import sqlite3
import time
from pathlib import Path
from typing import Any

import trio

from . import tail
from .db import connect, position, query, save, usage_db_path
from .rollup import Rollup

__all__ = ["UsageStore"]

logger = logging.getLogger(__name__)


class UsageStore:
    """The usage database of one records file (see the module docstring)."""

    INTERVAL_S = 1.0          # how often the records are read for new lines
    RETRY_S = 5.0             # while the database cannot be written: try again this often
    BATCH_BYTES = 4 << 20     # of records per transaction (a rebuild is many)

    def __init__(self, records: Path, db: Path | None = None) -> None:
        self.records = records
        self.path = usage_db_path(records) if db is None else db
        self._conn: sqlite3.Connection | None = None
        self._id: tuple[int, int] | None = None  # (st_dev, st_ino) of the open database
        self._lock = trio.Lock()     # one SQLite call at a time, on one connection
        self._fault: str | None = None
        self._failing_since: float | None = None
        self._seen: tuple[int, int, int] | None = None  # the records file at the last read
        self.behind = 0              # bytes of records not read yet, at the last read
        self.rolled_up = 0           # records added since relay started
        self._retry_at = 0.0

    def status(self) -> dict[str, Any]:
        """The ``usage`` entry of ``GET /relay/v1/status``, as the records' own."""
        since = self._failing_since
        return {"path": str(self.path), "writing": self._fault is None,
                "failing_since": None if since is None else _iso_wall(since),
                "reason": self._fault, "behind_bytes": self.behind}

    # --- the task ----------------------------------------------------------------------
    async def serve(self) -> None:
        """Read new records into the database about once a second, until cancelled (in
        relay's own nursery)."""
        while True:
            if self._changed() or (self._fault is not None
                                   and time.monotonic() >= self._retry_at):
                await self.catch_up()
            await trio.sleep(self.INTERVAL_S)

    def _changed(self) -> bool:
        """Whether the records file (or the database file) changed since the last read:
        a cheap stat instead of a thread, most seconds."""
        try:
            st = os.stat(self.records)
            seen: tuple[int, int, int] | None = (st.st_ino, st.st_size, st.st_mtime_ns)
        except OSError:
            seen = None
        if seen != self._seen or self.behind:
            return True
        return self._conn is None or self._id != _file_id(self.path)

    async def catch_up(self) -> None:
        """Read every record the database lacks, batch by batch (each batch its own
        thread call and transaction: a query waits for one batch at most)."""
        while True:
            async with self._lock:
                more = await trio.to_thread.run_sync(self._step)
            if not more:
                return

    async def close(self, grace_s: float) -> None:
        """One last read (the records writer has written its last), shielded, within
        ``grace_s``; then close the database."""
        try:
            with trio.CancelScope(shield=True, deadline=trio.current_time() + grace_s):
                await self.catch_up()
        finally:
            if self.behind:
                logger.warning("relay stops with %d bytes of records not in the usage "
                               "database %s; it reads them at the next start", self.behind,
                               self.path)
            # Closed at once, without a checkpoint (a cancelled caller must not leave the
            # file open): no thread uses it any more — a worker-thread call is never
            # abandoned, so the serving task's last one has returned before this runs.
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    # --- in the worker thread ------------------------------------------------------------
    def _open(self) -> sqlite3.Connection:
        """The connection, (re)opened when the file at the path is not the one open."""
        if self._conn is not None and self._id == _file_id(self.path):
            return self._conn
        if self._conn is not None:
            logger.warning("the usage database %s was removed or replaced: it is made again "
                           "from the records", self.path)
            self._conn.close()
            self._conn = None
        self._conn = connect(self.path)
        self._id = _file_id(self.path)
        return self._conn

    def _step(self) -> bool:
        """Read one batch into the database; whether more is left to read now."""
        try:
            st = os.stat(self.records)
            self._seen = (st.st_ino, st.st_size, st.st_mtime_ns)
        except OSError:
            self._seen = None
        try:
            conn = self._open()
            (file, offset), _ = position(conn)
            chunk = tail.read(self.records, file, offset, self.BATCH_BYTES)
            if (chunk.file, chunk.offset) != (file, offset):
                rollup = Rollup()
                for line in chunk.lines:
                    try:
                        rollup.add(json.loads(line))
                    except (ValueError, AttributeError):
                        rollup.skipped += 1  # a fragment a crash left, or no record
                save(conn, rollup, (chunk.file, chunk.offset))
                self.rolled_up += rollup.records
        except (sqlite3.Error, OSError) as exc:
            self._failed(exc)
            return False
        self.behind = chunk.behind
        self._recovered()
        return bool(chunk.behind) and bool(chunk.lines)

    def _failed(self, exc: BaseException) -> None:
        if self._conn is not None:
            self._conn.close()  # opened again next time: the file may have changed
            self._conn = None
        what = f"{type(exc).__name__}: {exc}"
        if self._fault is None:
            self._failing_since = time.time()
        if what != self._fault:
            logger.error("cannot write the usage database %s: %s. Serving goes on; the "
                         "records it lacks are read when this works again (tried every "
                         "%g s)", self.path, what, self.RETRY_S)
        self._fault = what
        self._retry_at = time.monotonic() + self.RETRY_S

    def _recovered(self) -> None:
        if self._fault is None:
            return
        logger.warning("the usage database %s is written again (after %s, for %.1f s)",
                       self.path, self._fault, time.time() - (self._failing_since or 0))
        self._fault = self._failing_since = None

    def _query(self, start: int, end: int, by: list[str]) -> list[dict[str, Any]]:
        return query(self._open(), start, end, by)

    async def query(self, start: int, end: int, by: list[str]) -> list[dict[str, Any]]:
        """`relay.usage.db.query` on this database (raises sqlite3.Error, OSError)."""
        async with self._lock:
            return await trio.to_thread.run_sync(self._query, start, end, by)


def _file_id(path: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _iso_wall(stamp: float) -> str:
    return dt.datetime.fromtimestamp(stamp, tz=dt.UTC).isoformat(
        timespec="milliseconds").replace("+00:00", "Z")
