"""How fast `relay usage` answers from a year of a busy user's usage database.

    python -m bench.usage [--requests N] [--keep DIR]

Builds a usage database of N requests (default 1,000,000) spread over the last 365 days
(busier by day than by night, three clients, six models, 5 % failures, 10 % unpriced) the
way relay builds it — `Rollup` batches saved by `relay.usage.db.save` — then times
``relay usage`` as a person runs it (a subprocess, Python's start included: wall clock,
``--runs`` runs each, median and worst) for a few questions, on the database (``--db``)
and through a config (``--config``: the config is read and checked first, as a plain
``relay usage`` does), and the query alone in this process (the best of the runs).
Target (issue 35): the command under a second.
"""

from __future__ import annotations

import argparse
import random
import statistics
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


# A config as a person's: its records beside the bench's database (bench.jsonl →
# bench.usage.sqlite), providers of every HTTP kind and a CLI tool (reading the config
# checks them: their adapters' modules are imported).
CONFIG = """
[server]
records = "bench.jsonl"
[providers.openai]
adapter = "openai"
base_url = "https://api.openai.com/v1"
models = ["gpt-5", "gpt-5-mini"]
[providers.openai.profile]
lanes = 4
queue_max = 100
queue_timeout_s = 60
run_timeout_s = 600
[providers.anthropic]
adapter = "anthropic"
models = ["claude-sonnet-4-5", "claude-haiku-4-5"]
[providers.gemini]
adapter = "gemini"
models = ["gemini-2.5-pro", "gemini-2.5-flash"]
[providers.claude]
adapter = "claude-cli"
"""


def timed(command: list[str], runs: int) -> list[float]:
    """Each run's wall clock, in seconds: the whole command, as a subprocess."""
    walls = []
    for _ in range(runs):
        started = time.perf_counter()
        done = subprocess.run(command, capture_output=True, check=False)
        walls.append(time.perf_counter() - started)
        assert done.returncode == 0, done.stderr.decode()
    return walls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1_000_000)
    parser.add_argument("--runs", type=int, default=5, help="runs of each command")
    parser.add_argument("--keep", help="build the database in this folder (kept)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.keep or tmp)
        db = folder / "bench.usage.sqlite"
        if not db.exists():
            build(db, args.requests)
        config = folder / "bench.toml"
        config.write_text(CONFIG)
        relay = [sys.executable, "-m", "relay", "usage"]
        print(f"relay usage as a subprocess, {args.runs} runs each: median / worst wall "
              "clock; the query alone: its best run")
        print(f"{'question':48} {'--db':>15} {'--config':>15} {'query':>7}  < 1000 ms")
        worst_of_all = 0.0
        for since, by in QUESTIONS:
            asked = ["--since", since, "--by", by, "--json"]
            on_db = timed([*relay, "--db", str(db), *asked], args.runs)
            on_config = timed([*relay, "--config", str(config), *asked], args.runs)
            conn = connect(db, create=False)
            start, end = window(parse_since(since))
            alone = []
            for _ in range(args.runs):
                began = time.perf_counter()
                rows = query(conn, start, end, parse_by(by))
                alone.append(time.perf_counter() - began)
            conn.close()
            worst = max(*on_db, *on_config)
            worst_of_all = max(worst_of_all, worst)
            what = f"--since {since} --by {by} ({len(rows):,} rows)"
            print(f"{what:48} {ms(on_db):>15} {ms(on_config):>15} "
                  f"{min(alone) * 1000:>4.0f} ms  {'ok' if worst < 1 else 'MISSED'}")
        print(f"worst command: {worst_of_all * 1000:.0f} ms "
              f"({'under' if worst_of_all < 1 else 'OVER'} a second)")


def ms(walls: list[float]) -> str:
    return f"{statistics.median(walls) * 1000:.0f} / {max(walls) * 1000:.0f} ms"


if __name__ == "__main__":
    main()
