"""``relay usage``: tokens, requests and cost, by day, client, provider, account and model
(SPEC O7), as a table or as JSON.

    relay usage [--since 7d|24h|today|DATE] [--by day,client,provider,account,model]
                [--json] [--config FILE | --db FILE | --records FILE…]

By default it reads the usage database beside the records file of the config (the file
``relay serve`` would read): instant for a year of records. ``--db`` names a database;
``--records`` reads records files themselves — several relays' (SPEC L11), rotated ones
too — into a temporary database (a database that does not exist yet is read that way from
the config's records, saying so).
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import sys
from pathlib import Path
from typing import Any

from relay.usage import tail
from relay.usage.db import connect, query, save, usage_db_path
from relay.usage.report import (
    DEFAULT_BY,
    DEFAULT_SINCE,
    answer,
    parse_by,
    parse_since,
    table,
    window,
)
from relay.usage.rollup import Rollup

__all__ = ["add_parser", "main", "read_records"]


def add_parser(sub: Any) -> None:
    """``relay usage``'s arguments, on the command line's subparsers."""
    cmd = sub.add_parser("usage", help="tokens, requests and cost (from the usage database)")
    cmd.add_argument("--since", default=DEFAULT_SINCE, help="a duration back (30m, 24h, "
                     "7d, 4w), 'today', a date (2025-01-31) or an ISO time (default: "
                     f"{DEFAULT_SINCE})")
    cmd.add_argument("--by", default=DEFAULT_BY, help="comma-separated: day or hour, "
                     f"client, provider, account, model (default: {DEFAULT_BY})")
    cmd.add_argument("--json", action="store_true", help="JSON for scripts")
    where = cmd.add_mutually_exclusive_group()
    where.add_argument("--config", help="the config whose records' database to read "
                       "(default: ./profiles.toml if present, else the packaged default)")
    where.add_argument("--db", help="a usage database (FILE.usage.sqlite)")
    where.add_argument("--records", nargs="+", metavar="FILE", help="records files to "
                       "read instead (several relays', rotated ones too)")


def read_records(paths: list[Path]) -> sqlite3.Connection:
    """Records files rolled up into a temporary (in-memory) database."""
    conn = connect(":memory:")
    for path in paths:
        rollup = Rollup()
        with open(path, "rb") as f:
            for line in f:
                if not line.endswith(b"\n"):
                    break  # the line being written
                try:
                    rollup.add(json.loads(line))
                except (ValueError, AttributeError):
                    rollup.skipped += 1
        save(conn, rollup, (None, 0))
    return conn


def _source(args: argparse.Namespace) -> tuple[sqlite3.Connection, str] | str:
    """The database to ask and what it is, or what is wrong."""
    if args.records:
        paths = [Path(p) for p in args.records]
        missing = [str(p) for p in paths if not p.is_file()]
        if missing:
            return f"no records file at {', '.join(missing)}"
        return read_records(paths), "records " + ", ".join(map(str, paths))
    if args.db:
        if not Path(args.db).is_file():
            return f"no usage database at {args.db}"
        return connect(args.db, create=False), f"database {args.db}"
    # Imported here, as the config is read: a question to a database (--db, --records)
    # imports no more than the database's reader (bench.usage times both).
    from relay.adapters import ADAPTERS
    from relay.config import load_config
    from relay.vocab.errors import ConfigError
    try:
        config = load_config(args.config, ADAPTERS)
    except ConfigError as exc:
        return "the configuration has problems:\n  " + "\n  ".join(exc.problems)
    if config.records_path is None:
        return f"{config.source} keeps no records ([server] records is off): no usage"
    db = usage_db_path(config.records_path)
    if db.is_file():
        return connect(db, create=False), f"database {db}"
    found = tail.files(config.records_path)
    if not found:
        return f"no usage database at {db} and no records at {config.records_path} yet"
    print(f"relay: no usage database at {db} yet (relay makes it when it runs); reading "
          f"the records instead", file=sys.stderr)
    return read_records(found), "records " + ", ".join(map(str, found))


def main(args: argparse.Namespace) -> int:
    try:
        since, by = parse_since(args.since), parse_by(args.by)
    except ValueError as exc:
        print(f"relay usage: {exc}", file=sys.stderr)
        return 2
    try:
        found = _source(args)
        if isinstance(found, str):
            print(f"relay usage: {found}", file=sys.stderr)
            return 1
        conn, source = found
        try:
            start, end = window(since)
            report = answer(query(conn, start, end, by), start, end, by, source)
        finally:
            conn.close()
    except (sqlite3.Error, OSError) as exc:
        print(f"relay usage: cannot read usage: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(report, indent=1) if args.json else table(report))
    return 0
