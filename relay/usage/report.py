"""A usage question and its answer, shared by `relay usage` and ``GET /relay/v1/usage``:
``since`` and ``by`` read, the answer as JSON (for scripts and the status page) and as a
table (for a person).

``since``: a duration back from now (``30m``, ``24h``, ``7d``, ``4w``), ``today`` (local
midnight), a local date (``2025-01-31``) or an ISO 8601 time. ``by``: a comma-separated
list of ``day``, ``hour`` (local), ``client``, ``provider``, ``account``, ``model`` — at
most one of day and hour.
"""

from __future__ import annotations

import datetime as dt
import re
import time
from typing import Any

from .db import DIMENSIONS, TIMES, total

__all__ = ["DEFAULT_BY", "DEFAULT_SINCE", "answer", "cost_text", "parse_by", "parse_since", "table",
           "window"]

DEFAULT_SINCE = "7d"
DEFAULT_BY = "client,model"
_DURATION = re.compile(r"(\d+(?:\.\d+)?)\s*(m|min|h|d|w)\Z")
_MINUTES = {"m": 1, "min": 1, "h": 60, "d": 1440, "w": 10080}
_HEADS = {"requests": "REQUESTS", "failures": "FAILED", "input_tokens": "INPUT",
          "output_tokens": "OUTPUT", "cache_read_tokens": "CACHE READ",
          "cache_write_tokens": "CACHE WRITE"}


def parse_since(text: str, now: float | None = None) -> float:
    """``since`` as a ``time.time()`` (ValueError: says what is accepted)."""
    now = time.time() if now is None else now
    text = text.strip()
    if (m := _DURATION.match(text)) is not None:
        return now - float(m[1]) * _MINUTES[m[2]] * 60
    if text == "today":
        return dt.datetime.fromtimestamp(now).replace(
            hour=0, minute=0, second=0, microsecond=0).timestamp()
    try:
        when = dt.datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(f"since {text!r} is not a duration (30m, 24h, 7d, 4w), 'today', "
                         "a date (2025-01-31) or an ISO 8601 time") from None
    return when.timestamp()  # (a naive date or time is local)


def parse_by(text: str) -> list[str]:
    """``by`` as a list of dimensions (ValueError: says which are accepted)."""
    by = [part.strip() for part in text.split(",") if part.strip()]
    wrong = [d for d in by if d not in DIMENSIONS]
    if wrong:
        raise ValueError(f"by: {', '.join(wrong)} is not one of {', '.join(DIMENSIONS)}")
    if len(set(by)) != len(by):
        raise ValueError("by: a dimension is named twice")
    if sum(d in TIMES for d in by) > 1:
        raise ValueError("by: day or hour, not both")
    return by


def window(since: float, now: float | None = None) -> tuple[int, int]:
    """The minutes ``[start, end)`` from ``since`` to now (the current minute included)."""
    now = time.time() if now is None else now
    return int(since // 60), int(now // 60) + 1


def _iso(minute: int) -> str:
    return dt.datetime.fromtimestamp(minute * 60).astimezone().isoformat(timespec="minutes")


def answer(rows: list[dict[str, Any]], start: int, end: int, by: list[str],
           source: str) -> dict[str, Any]:
    """The JSON answer: the window (local ISO times), the rows and their total."""
    return {"since": _iso(start), "until": _iso(end), "by": by, "source": source,
            "rows": rows, "total": total(rows)}


def cost_text(row: dict[str, Any]) -> str:
    """``$1.23``; ``≥ $1.23`` when some requests' cost is unknown; ``—`` when none is
    known."""
    cost = row["cost_usd"]
    if cost is None:
        return "—"
    money = f"${cost:,.2f}" if cost >= 1 or cost == 0 else f"${cost:.4f}"
    return f"≥ {money}" if row["unpriced"] else money


def table(report: dict[str, Any]) -> str:
    """The answer as a table a person reads, with a total line."""
    by, rows = report["by"], report["rows"]
    head = f"usage since {report['since']} (until {report['until']}; {report['source']})"
    if not rows:
        return head + "\nno requests"
    lines = [[d.upper() for d in by] + [*_HEADS.values(), "COST"]]
    for row in [*rows, *([report["total"]] if len(rows) > 1 else [])]:
        names = [str(row.get(d, "")) or ("(none)" if d in row else "") for d in by]
        if row is report["total"]:
            names = ["total", *[""] * (len(by) - 1)] if by else []
        lines.append(names + [f"{row[c]:,}" for c in _HEADS] + [cost_text(row)])
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    numeric = range(len(by), len(lines[0]))
    out = [head]
    for line in lines:
        out.append("  ".join(cell.rjust(w) if i in numeric else cell.ljust(w)
                             for i, (cell, w) in enumerate(zip(line, widths, strict=True)))
                   .rstrip())
    unpriced = report["total"]["unpriced"]
    if unpriced:
        out.append(f"(— or ≥: {unpriced:,} requests have no known price; their cost is not "
                   "counted)")
    return "\n".join(out)
