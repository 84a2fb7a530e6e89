"""The lane fuzz, long form (SPEC L7-L10; the engine is tests/helpers/lane_fuzz.py).

    python -m bench.lane_fuzz --seeds 500            # seeds 0..499 (about 20-40 s)
    python -m bench.lane_fuzz --seed 137 --verbose   # one seed again, every violation
    python -m bench.lane_fuzz --seeds 200 --mutant forget-no-hand-off

Each seed is one random run on virtual time: arrivals with random priorities, run times
and impatient clients, queue timeouts, rpm pacing, profile reloads, and cancels in the
very tick a slot is granted. It prints what was checked, how often each thing happened,
and every violation with the seed that reproduces it; the exit status is 1 when there
was any. ``--mutant`` runs it against the lane with one fixed bug put back (to see that
the fuzz still finds it).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from helpers.lane_fuzz import KINDS, MUTANTS, local_lane, run_seed  # type: ignore[import-not-found]

CHECKS = {
    "idle": "a free slot never idles while someone waits and the pacer allows a start",
    "leak": "lane running/queued == requests holding a slot / waiting (no leaked slot, "
            "also when a grant races a cancel)",
    "overdue": "no one waits past their queue timeout",
    "wait_idle": "wait_idle() returns when nothing runs or waits, and only then",
    "capacity": "a start never makes running exceed the lanes",
    "pacer": "two starts are never closer than 60 / rpm",
    "queue_max": "queued only below queue_max; refused as full only at queue_max",
    "timeout": "provider_queue_timeout exactly queue_timeout_s after arrival",
    "order": "priority order and FIFO within a class for every start (no barging)",
    "error": "capacity errors are 429, phase capacity, with a retry time",
    "end": "0 running, 0 queued at the end, and wait_idle() returns",
    "budget": "a start never takes more input tokens than the bucket holds (--tokens)",
    "turns": "clients that both wait start within weighted round robin's bound (--clients)",
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.lane_fuzz", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=500, help="how many seeds (default 500)")
    parser.add_argument("--start", type=int, default=0, help="the first seed (default 0)")
    parser.add_argument("--seed", type=int, help="run only this seed")
    parser.add_argument("--arrivals", type=int, default=150, help="requests per seed")
    parser.add_argument("--mutant", choices=sorted(MUTANTS), help="a fixed bug put back")
    parser.add_argument("--verbose", action="store_true", help="print every violation")
    parser.add_argument("--clients", action="store_true",
                        help="requests from a few weighted clients, one in bursts (SPEC L14)")
    args = parser.parse_args(argv)
    seeds = [args.seed] if args.seed is not None else list(
        range(args.start, args.start + args.seeds))
    factory = MUTANTS[args.mutant] if args.mutant else local_lane
    print(f"lane fuzz: {len(seeds)} seed(s) from {seeds[0]}, {args.arrivals} arrivals each, "
          f"lane: {args.mutant or 'relay.lanes.Lane'}")
    print("checked at every settled instant / every event:")
    for kind in KINDS:
        print(f"  {kind:10} {CHECKS[kind]}")
    totals: Counter[str] = Counter()
    kinds: Counter[str] = Counter()
    bad: dict[int, list[str]] = {}
    started = time.perf_counter()
    for seed in seeds:
        report = run_seed(factory, seed, arrivals=args.arrivals, clients=args.clients)
        totals.update(report.counts)
        if report.violations:
            kinds.update(v.kind for v in report.violations)
            bad[seed] = [f"{report.profile}: {v}" for v in report.violations]
    elapsed = time.perf_counter() - started
    print(f"ran in {elapsed:.1f} s; what happened, over all seeds:")
    for key, n in sorted(totals.items()):
        print(f"  {key:36} {n}")
    if not bad:
        print("violations: none")
        return 0
    print(f"violations: {sum(kinds.values())} in {len(bad)} seed(s): "
          + ", ".join(f"{k} {n}" for k, n in kinds.most_common()))
    for seed, lines in bad.items():
        shown = lines if args.verbose else lines[:2]
        for line in shown:
            print(f"  {line}")
        if len(lines) > len(shown):
            print(f"  ... {len(lines) - len(shown)} more in seed {seed}")
        print(f"  reproduce: python -m bench.lane_fuzz --seed {seed} --verbose"
              + (f" --mutant {args.mutant}" if args.mutant else "")
              + (" --clients" if args.clients else ""))
    return 1


if __name__ == "__main__":
    sys.exit(main())
