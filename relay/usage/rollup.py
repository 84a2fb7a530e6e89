"""A record in usage's terms: the key it is rolled up under and what it counts (pure).

A record (one JSON line of the records file, SPEC A5) is rolled up by the minute it
started (UTC), its client (``"default"`` without clients, SPEC L14), provider, account
(``""`` until accounts exist) and model, and counts:

- ``requests`` (every record: answers, failures, refusals, connection checks) and
  ``failures`` (status 400 and above, a client gone included);
- tokens: ``input_tokens`` (the prompt, as OpenAI counts it: cache reads and writes
  included), ``output_tokens`` (the completion), ``cache_read_tokens`` and
  ``cache_write_tokens`` (of the prompt, what the provider read from and wrote to its
  cache; 0 where it did not say);
- cost: ``cost_usd`` (the sum of the records' known costs), ``priced`` (records with a
  known cost) and ``unpriced`` (records that used tokens and whose cost is unknown:
  ``cost_usd`` null or absent). An unknown cost is counted apart, never summed as 0.
"""

from __future__ import annotations

import calendar
from typing import Any

__all__ = ["COUNTS", "Key", "Rollup", "counts_of", "key_of", "minute_of"]

# What each rollup row counts, in the database's column order.
COUNTS = ("requests", "failures", "input_tokens", "output_tokens", "cache_read_tokens",
          "cache_write_tokens", "cost_usd", "priced", "unpriced")
# (minute, client, provider, account, model): the minute is whole minutes since the epoch.
Key = tuple[int, str, str, str, str]


def minute_of(iso: str, _cache: dict[str, int] = {}) -> int:  # noqa: B006 - a cache
    """Whole minutes since the epoch of a record's ISO 8601 UTC time
    (``2025-01-31T14:05:06.123Z``); records of one minute share one parse."""
    head = iso[:16]
    minute = _cache.get(head)
    if minute is None:
        if len(_cache) > 4096:
            _cache.clear()
        year, month, day = int(head[0:4]), int(head[5:7]), int(head[8:10])
        hour, mins = int(head[11:13]), int(head[14:16])
        if head[4] != "-" or head[10] != "T" or head[13] != ":":
            raise ValueError(f"not an ISO 8601 time: {iso!r}")
        minute = calendar.timegm((year, month, day, hour, mins, 0, 0, 0, 0)) // 60
        _cache[head] = minute
    return minute


def _count(value: Any) -> int:
    return value if type(value) is int and value > 0 else 0


def key_of(line: dict[str, Any]) -> Key:
    """The rollup key of a record (ValueError: it has no readable start time)."""
    started = line.get("started_at")
    if not isinstance(started, str):
        raise ValueError("no started_at")
    return (minute_of(started), str(line.get("client") or "default"),
            str(line.get("provider") or ""), str(line.get("account") or ""),
            str(line.get("model") or ""))


def counts_of(line: dict[str, Any]) -> list[float]:
    """What a record counts, in `COUNTS`' order."""
    usage = line.get("usage")
    if not isinstance(usage, dict):
        usage = {}
    tokens_in, tokens_out = _count(usage.get("prompt_tokens")), _count(
        usage.get("completion_tokens"))
    status = line.get("status")
    failed = 1 if type(status) is int and status >= 400 else 0
    cost = line.get("cost_usd")
    if isinstance(cost, int | float) and not isinstance(cost, bool) and cost >= 0:
        priced, unpriced, cost_usd = 1, 0, float(cost)
    else:
        priced, unpriced, cost_usd = 0, 1 if tokens_in or tokens_out else 0, 0.0
    return [1, failed, tokens_in, tokens_out, _count(usage.get("cache_read_tokens")),
            _count(usage.get("cache_write_tokens")), cost_usd, priced, unpriced]


class Rollup:
    """Records summed by key, ready to be added to the database in one transaction."""

    def __init__(self) -> None:
        self.rows: dict[Key, list[float]] = {}
        self.records = 0    # records rolled up
        self.skipped = 0    # lines that were no record (a fragment a crash left)

    def add(self, line: dict[str, Any]) -> None:
        try:
            key = key_of(line)
        except (ValueError, TypeError):
            self.skipped += 1
            return
        counts = counts_of(line)
        row = self.rows.get(key)
        if row is None:
            self.rows[key] = counts
        else:
            for i, value in enumerate(counts):
                row[i] += value
        self.records += 1

    def coarser(self, minutes: int) -> dict[Key, list[float]]:
        """The same rows summed by ``minutes`` (60: by hour; 1440: by UTC day), keyed by
        the first minute of each."""
        out: dict[Key, list[float]] = {}
        for (minute, *rest), counts in self.rows.items():
            key = (minute - minute % minutes, rest[0], rest[1], rest[2], rest[3])
            row = out.get(key)
            if row is None:
                out[key] = list(counts)
            else:
                for i, value in enumerate(counts):
                    row[i] += value
        return out
