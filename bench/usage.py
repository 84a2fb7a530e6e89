"""How fast `relay usage` answers from a year of a busy user's usage database.

    python -m bench.usage [--requests N] [--keep DIR]

Builds a usage database of N requests (default 1,000,000) spread over the last 365 days
(busier by day than by night, three clients, six models, 5 % failures, 10 % unpriced) the
way relay builds it — `Rollup` batches saved by `relay.usage.db.save` — then times
``relay usage`` as a person runs it (a subprocess, Python's start included) for a few
questions, and the query alone in this process. Target (issue 35): under a second.
"""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from relay.usage.db import connect, query, save
from relay.usage.report import parse_by, parse_since, window
from relay.usage.rollup import Rollup

CLIENTS = ("claude-code", "codex", "chat-app")
MODELS = (("anthropic", "claude-sonnet-4-5"), ("anthropic", "claude-haiku-4-5"),
          ("openai", "gpt-5"), ("openai", "gpt-5-mini"), ("gemini", "gemini-2.5-pro"),
          ("gemini", "gemini-2.5-flash"))
QUESTIONS = (("7d", "client,model"), ("24h", "hour"), ("365d", "client,model"),
             ("365d", "day,client"), ("400d", "day,client,provider,model"))


def build(db: Path, requests: int) -> float:
    rng = random.Random(35)
    now = int(time.time() // 60)
    conn = connect(db)
    started = time.perf_counter()
    batch = Rollup()
    for i in range(requests):
        minute = now - rng.randrange(365 * 1440)
        if (minute // 60) % 24 < 7 and rng.random() < 0.7:  # quieter at night
            minute -= 9 * 60
        provider, model = rng.choice(MODELS)
        prompt, completion = rng.randint(100, 30000), rng.randint(10, 4000)
        failed = rng.random() < 0.05
        counts = [1.0, float(failed), prompt, completion, prompt // 3, prompt // 20,
                  0.0, 0.0, 0.0]
        if rng.random() < 0.9:
            counts[6], counts[7] = prompt * 3e-6 + completion * 15e-6, 1
        else:
            counts[8] = 1
        key = (minute, rng.choice(CLIENTS), provider, "", model)
        row = batch.rows.get(key)
        if row is None:
            batch.rows[key] = counts
        else:
            for j, value in enumerate(counts):
                row[j] += value
        batch.records += 1
        if len(batch.rows) >= 50_000 or i == requests - 1:
            save(conn, batch, ("bench", i))
            batch = Rollup()
    rows = conn.execute("SELECT COUNT(*) FROM usage_minute").fetchone()[0]
    conn.close()
    print(f"built {requests:,} requests in {time.perf_counter() - started:.1f} s: "
          f"{rows:,} minute rows, {db.stat().st_size / 1e6:.0f} MB")
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1_000_000)
    parser.add_argument("--keep", help="build the database in this folder (kept)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.keep or tmp)
        db = folder / "bench.usage.sqlite"
        if not db.exists():
            build(db, args.requests)
        print(f"{'question':44} {'relay usage (process)':>22} {'query alone':>12}  target")
        for since, by in QUESTIONS:
            command = [sys.executable, "-m", "relay", "usage", "--db", str(db), "--since",
                       since, "--by", by, "--json"]
            started = time.perf_counter()
            done = subprocess.run(command, capture_output=True, check=False)
            wall = time.perf_counter() - started
            assert done.returncode == 0, done.stderr.decode()
            conn = connect(db, create=False)
            start, end = window(parse_since(since))
            began = time.perf_counter()
            rows = query(conn, start, end, parse_by(by))
            alone = time.perf_counter() - began
            conn.close()
            what = f"--since {since} --by {by} ({len(rows):,} rows)"
            print(f"{what:44} {wall * 1000:>19.0f} ms {alone * 1000:>9.0f} ms  < 1000 ms "
                  f"{'ok' if wall < 1 else 'MISSED'}")


if __name__ == "__main__":
    main()
