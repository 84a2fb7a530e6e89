"""Records as the clients' relay writes them (``client`` and ``cost_usd``), generated,
and what a records file sums to, counted here on its own (not by relay's rollup)."""

from __future__ import annotations

import datetime as dt
import json
import random
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

CLIENTS = ("claude-code", "codex", "chat-app")
MODELS = (("anthropic", "claude-sonnet-4-5"), ("openai", "gpt-5"), ("gemini", "gemini-2.5-pro"))


def generated(n: int, *, days: float = 3.0, seed: int = 1,
              now: float | None = None) -> list[dict[str, Any]]:
    """``n`` records of the last ``days``: three clients, three models, some failed,
    some with an unknown price (``cost_usd`` null), cache reads and writes."""
    rng = random.Random(seed)
    now = time.time() if now is None else now
    out = []
    for i in range(n):
        started = now - rng.random() * days * 86400
        provider, model = rng.choice(MODELS)
        prompt, completion = rng.randint(10, 20000), rng.randint(1, 3000)
        failed = rng.random() < 0.05
        out.append({
            "id": f"gen-{seed}-{i}",
            "started_at": dt.datetime.fromtimestamp(started, tz=dt.UTC).strftime(
                "%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z",
            "client": rng.choice(CLIENTS), "provider": provider, "model": model,
            "status": 502 if failed else 200, "reason": "upstream_error" if failed else None,
            "usage": None if failed else {
                "prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion,
                "cache_read_tokens": prompt // 3, "cache_write_tokens": prompt // 10},
            "cost_usd": None if failed else (None if rng.random() < 0.1 else round(
                prompt * 3e-6 + completion * 15e-6, 8)),
        })
    return out


def write_lines(path: Path, records: list[dict[str, Any]]) -> None:
    with open(path, "a", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, separators=(",", ":")) + "\n")


def lines(*paths: Path) -> list[dict[str, Any]]:
    out = []
    for path in paths:
        out += [json.loads(x) for x in path.read_text().splitlines() if x]
    return out


def expected(records: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    """By (client, provider/model): requests, failures, tokens, and the cost in cents
    (None where no request had a known price)."""
    out: dict[tuple[str, str], dict[str, Any]] = defaultdict(lambda: {
        "requests": 0, "failures": 0, "input_tokens": 0, "output_tokens": 0,
        "cache_read_tokens": 0, "cache_write_tokens": 0, "cost": None})
    for r in records:
        row = out[(r.get("client") or "default",
                   f"{r.get('provider') or ''}/{r.get('model') or ''}")]
        row["requests"] += 1
        row["failures"] += r["status"] >= 400
        usage = r.get("usage") or {}
        for key, name in (("prompt_tokens", "input_tokens"),
                          ("completion_tokens", "output_tokens"),
                          ("cache_read_tokens", "cache_read_tokens"),
                          ("cache_write_tokens", "cache_write_tokens")):
            row[name] += usage.get(key) or 0
        if r.get("cost_usd") is not None:
            row["cost"] = (row["cost"] or 0) + r["cost_usd"]
    for row in out.values():
        row["cost"] = None if row["cost"] is None else round(row["cost"], 2)
    return dict(out)


def answered(rows: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    """A usage answer's rows (by client, provider, model) in `expected`'s shape."""
    out = {}
    for row in rows:
        out[(row["client"], f"{row['provider']}/{row['model']}")] = {
            **{k: row[k] for k in ("requests", "failures", "input_tokens", "output_tokens",
                                   "cache_read_tokens", "cache_write_tokens")},
            "cost": None if row["cost_usd"] is None or not row["priced"]
            else round(row["cost_usd"], 2)}
    return out
