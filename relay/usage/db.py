"""The usage database: an SQLite file of rollups, one transaction per batch, and the
queries `relay usage`, the status page and ``GET /relay/v1/usage`` ask.

Three tables hold the same rows at three grains — ``usage_minute``, ``usage_hour`` and
``usage_day`` (UTC days) — keyed by (``t``: the first minute of the row, client, provider,
account, model), each with the counts of `relay.usage.rollup.COUNTS`. A batch adds to all
three in one transaction, with the position in the records it has read up to (`position`),
so the database never counts a record twice nor skips one, whatever stops it. A question
over a time range reads minutes at its ragged edges, hours up to whole days, and days in
between: a year of a busy user's requests (a million) answers in tens of milliseconds
(bench/usage.py).

Days and hours in an answer are the local time's (of the machine that asks); a local day
that does not start on a UTC day (most of them) is read from hours and minutes.
"""

from __future__ import annotations

import datetime as dt
import sqlite3
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .rollup import COUNTS, Key, Rollup

__all__ = ["DIMENSIONS", "TIMES", "Position", "buckets", "connect", "position", "query",
           "save", "total", "usage_db_path"]

SCHEMA_VERSION = 1
TABLES = (("usage_minute", 1), ("usage_hour", 60), ("usage_day", 1440))
TIMES = ("day", "hour")  # the time dimensions (local), at most one per question
DIMENSIONS = (*TIMES, "client", "provider", "account", "model")
_KEYS = ("client", "provider", "account", "model")
RANGES_PER_QUERY = 500  # (three parameters each: well under SQLite's 32,766)

# The file identity (`relay.usage.tail`) and offset read up to; None: nothing read yet.
Position = tuple[str | None, int]


def usage_db_path(records: Path) -> Path:
    """The database beside a records file: ``relay-requests.jsonl`` →
    ``relay-requests.usage.sqlite``."""
    return records.with_name(records.stem + ".usage.sqlite")


def connect(path: Path | str, *, create: bool = True) -> sqlite3.Connection:
    """Open (and with ``create``, make) the database. Autocommit: `save` opens its own
    transaction. Raises sqlite3.Error (a full disk: ``database or disk is full``)."""
    if not create:
        uri = f"file:{Path(path).resolve()}?mode=ro"
        conn = sqlite3.connect(uri, uri=True, isolation_level=None,
                               check_same_thread=False)
    else:
        conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    try:
        conn.execute("PRAGMA busy_timeout = 5000")
        if create:
            conn.execute("PRAGMA journal_mode = WAL")  # a reader never waits for a batch
            conn.execute("PRAGMA synchronous = NORMAL")
            _create(conn)
    except BaseException:
        conn.close()
        raise
    return conn


def _create(conn: sqlite3.Connection) -> None:
    version = conn.execute("PRAGMA user_version").fetchone()[0]
    if version == SCHEMA_VERSION:
        return
    if version not in (0, SCHEMA_VERSION):
        raise sqlite3.DatabaseError(f"the usage database's schema is version {version}; "
                                    f"this relay knows {SCHEMA_VERSION}")
    counts = ", ".join(f"{name} {'REAL' if name == 'cost_usd' else 'INTEGER'} NOT NULL"
                       for name in COUNTS)
    conn.execute("BEGIN IMMEDIATE")
    try:
        for table, _ in TABLES:
            conn.execute(f"CREATE TABLE IF NOT EXISTS {table} (t INTEGER NOT NULL, "
                         "client TEXT NOT NULL, provider TEXT NOT NULL, account TEXT NOT "
                         f"NULL, model TEXT NOT NULL, {counts}, PRIMARY KEY (t, client, "
                         "provider, account, model)) WITHOUT ROWID")
        conn.execute("CREATE TABLE IF NOT EXISTS position (id INTEGER PRIMARY KEY CHECK "
                     "(id = 1), file TEXT, offset INTEGER NOT NULL, records INTEGER NOT "
                     "NULL)")
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise


def position(conn: sqlite3.Connection) -> tuple[Position, int]:
    """Where the database has read the records up to, and how many it has rolled up."""
    row = conn.execute("SELECT file, offset, records FROM position WHERE id = 1").fetchone()
    return ((None, 0), 0) if row is None else ((row[0], row[1]), row[2])


_UPSERT = {table: (f"INSERT INTO {table} VALUES (?, ?, ?, ?, ?, "
                   + ", ".join("?" for _ in COUNTS) + ") ON CONFLICT DO UPDATE SET "
                   + ", ".join(f"{c} = {c} + excluded.{c}" for c in COUNTS))
           for table, _ in TABLES}


def save(conn: sqlite3.Connection, rollup: Rollup, to: Position) -> None:
    """Add a batch to every table and move the position to ``to``, in one transaction
    (on any error, none of it: the batch is read again next time)."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        for table, minutes in TABLES:
            rows: dict[Key, list[float]] = (rollup.rows if minutes == 1
                                             else rollup.coarser(minutes))
            conn.executemany(_UPSERT[table], ((*key, *counts) for key, counts in rows.items()))
        conn.execute("INSERT INTO position VALUES (1, ?, ?, ?) ON CONFLICT DO UPDATE SET "
                     "file = excluded.file, offset = excluded.offset, "
                     "records = records + excluded.records", (*to, rollup.records))
        conn.execute("COMMIT")
    except BaseException:
        try:
            conn.execute("ROLLBACK")
        except sqlite3.Error:
            pass  # (no transaction left to undo: SQLite undid it itself)
        raise


# --- questions ---------------------------------------------------------------------------

def _local(minute: int) -> dt.datetime:
    return dt.datetime.fromtimestamp(minute * 60)  # naive, local: arithmetic in wall time


def _minute(local: dt.datetime) -> int:
    return int(local.timestamp()) // 60


def buckets(start: int, end: int, time: str | None) -> list[tuple[str, int, int]]:
    """``[start, end)`` (minutes) cut into local days or hours (``time``), each with its
    label (``2025-01-31``, ``2025-01-31T14:00+01:00``); one unlabelled bucket without."""
    if time is None:
        return [("", start, end)]
    out: list[tuple[str, int, int]] = []
    here = _local(start).replace(minute=0, second=0, microsecond=0)
    if time == "day":
        here = here.replace(hour=0)
    while (lo := _minute(here)) < end:
        if time == "day":
            label = here.date().isoformat()
            here = here.replace(hour=0) + dt.timedelta(days=1)
            hi = _minute(here)
        else:  # an hour: 60 minutes, whatever the clock says (a DST change)
            label = here.astimezone().isoformat(timespec="minutes")
            hi = lo + 60
            here = _local(hi)
        out.append((label, max(lo, start), min(hi, end)))
    return out


def _segments(lo: int, hi: int) -> Iterable[tuple[int, int, int]]:
    """``[lo, hi)`` as (table index, from, to): minutes at the edges, then hours, then
    whole UTC days."""
    def up(x: int, n: int) -> int:
        return -(-x // n) * n
    h_lo, h_hi = up(lo, 60), hi - hi % 60
    if h_lo >= h_hi:
        yield 0, lo, hi
        return
    yield 0, lo, h_lo
    yield 0, h_hi, hi
    d_lo, d_hi = up(h_lo, 1440), h_hi - h_hi % 1440
    if d_lo >= d_hi:
        yield 1, h_lo, h_hi
        return
    yield 1, h_lo, d_lo
    yield 1, d_hi, h_hi
    yield 2, d_lo, d_hi


def query(conn: sqlite3.Connection, start: int, end: int,
          by: list[str]) -> list[dict[str, Any]]:
    """The rows of ``[start, end)`` (minutes since the epoch) grouped by ``by`` (of
    `DIMENSIONS`; at most one of `TIMES`), in that order, each with the `COUNTS` (and
    ``cost_usd`` None where no request was priced and some were not)."""
    time = next((d for d in by if d in TIMES), None)
    keys = [d for d in by if d in _KEYS]
    cut = buckets(start, end, time)
    ranges: list[list[tuple[int, int, int]]] = [[], [], []]
    for index, (_, lo, hi) in enumerate(cut):
        for table, a, b in _segments(lo, hi):
            if a < b:
                ranges[table].append((index, a, b))
    sums = ", ".join(f"SUM({c})" for c in COUNTS)
    group = ", ".join(["r.b", *(f"u.{k}" for k in keys)])
    found: dict[tuple[Any, ...], list[float]] = {}
    for (name, _), parts in zip(TABLES, ranges, strict=True):
        for at in range(0, len(parts), RANGES_PER_QUERY):
            chunk = parts[at:at + RANGES_PER_QUERY]
            values = ", ".join("(?, ?, ?)" for _ in chunk)
            sql = (f"WITH r(b, lo, hi) AS (VALUES {values}) SELECT {group}, {sums} "
                   f"FROM r JOIN {name} u ON u.t >= r.lo AND u.t < r.hi GROUP BY {group}")
            for got in conn.execute(sql, [x for part in chunk for x in part]):
                head, counts = tuple(got[:1 + len(keys)]), got[1 + len(keys):]
                have = found.get(head)
                if have is None:
                    found[head] = list(counts)
                else:
                    for i, value in enumerate(counts):
                        have[i] += value
    out = []
    for head in sorted(found):
        named = dict(zip(keys, head[1:], strict=True))
        row: dict[str, Any] = {d: cut[head[0]][0] if d in TIMES else named[d] for d in by}
        out.append(_counted(row, found[head]))
    return out


def _counted(row: dict[str, Any], counts: list[float]) -> dict[str, Any]:
    for name, amount in zip(COUNTS, counts, strict=True):
        row[name] = amount if name == "cost_usd" else int(amount)
    if row["priced"] == 0 and row["unpriced"] > 0:
        row["cost_usd"] = None  # nothing priced: unknown, never 0
    return row


def total(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The rows summed (as a row of no dimension)."""
    counts = [sum(float(r[c] or 0) for r in rows) for c in COUNTS]
    return _counted({}, counts)
