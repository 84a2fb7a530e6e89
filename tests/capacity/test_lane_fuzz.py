"""The lane fuzz (tests/helpers/lane_fuzz.py) over a fixed set of seeds, on virtual time.

The long form: ``python -m bench.lane_fuzz --seeds 500``. Each seed is reproducible:
``python -m bench.lane_fuzz --seed N --verbose``.
"""

from __future__ import annotations

import pytest
from helpers.lane_fuzz import MUTANTS, accounts_lane, local_lane, run_seed

SEEDS = range(24)


@pytest.mark.parametrize("seed", SEEDS)
def test_the_lane_keeps_every_rule_at_every_step(seed: int) -> None:
    report = run_seed(local_lane, seed)
    assert [str(v) for v in report.violations] == [], report.profile
    counts = report.counts
    assert counts["arrivals"] >= 150 and counts["steps checked"] > 100
    assert counts.get("started", 0) > 0


@pytest.mark.parametrize("seed", range(12))
def test_the_lane_over_two_accounts_keeps_every_rule(seed: int) -> None:
    # SPEC L13: the lanes split over two accounts (one when the run's profile is paced;
    # a reload adds or removes the second): one queue, so every rule stays as it was.
    unpaced = seed % 3 != 0  # (the pacer binds: one account, its rpm; a reload may split)
    report = run_seed(accounts_lane, seed, clients=seed % 2 == 1, unpaced=unpaced,
                      reload_rpm=not unpaced)
    assert [str(v) for v in report.violations] == [], report.profile
    assert report.counts.get("started", 0) > 0


@pytest.mark.parametrize("seed", range(12))
def test_the_lane_keeps_every_rule_with_a_token_budget(seed: int) -> None:
    # SPEC L12: the head waits for tokens as it waits for the pacer; the fuzz's own model
    # of the bucket says when it could start, and that no start overdraws it.
    report = run_seed(local_lane, seed, tokens=True)
    assert [str(v) for v in report.violations] == [], report.profile
    assert report.counts.get("started after waiting, with a budget", 0) > 0


@pytest.mark.parametrize("seed", range(12))
def test_the_lane_keeps_every_rule_while_the_pacer_binds(seed: int) -> None:
    report = run_seed(local_lane, seed, paced=True)
    assert [str(v) for v in report.violations] == [], report.profile
    assert report.counts.get("started after waiting", 0) > 0


@pytest.mark.parametrize("seed", range(16))
def test_the_lane_keeps_every_rule_with_clients_taking_turns(seed: int) -> None:
    # SPEC L14: a few clients with weights, one in bursts; the fuzz checks turns (weighted
    # round robin's bound while two clients wait) and each client's own order.
    report = run_seed(local_lane, seed, clients=True, tokens=seed % 4 == 3)
    assert [str(v) for v in report.violations] == [], report.profile
    assert report.counts.get("turn checks", 0) > 0


def test_turns_are_checked_often() -> None:
    starts = checks = 0
    for seed in range(8):
        counts = run_seed(local_lane, seed, clients=True).counts
        starts += counts.get("started after waiting", 0)
        checks += counts.get("turn checks", 0)
    assert starts > 100 and checks > 1000, (starts, checks)


def test_the_fuzz_exercises_what_it_claims() -> None:
    totals: dict[str, int] = {}
    for seed in SEEDS:
        for key, n in run_seed(local_lane, seed).counts.items():
            totals[key] = totals.get(key, 0) + n
    for key in ("started after waiting", "provider_queue_full", "provider_queue_timeout",
                "cancelled while queued", "cancelled while running", "profile changes",
                "cancels at the instant of a grant", "left in a release's tick",
                "wait_idle returned"):
        assert totals.get(key, 0) > 0, (key, totals)


@pytest.mark.parametrize(("mutant", "kind", "paced"), [
    # bug 1: the pacer left a slot idle (reached where the sliding minute binds for
    # longer than a waiter's queue timeout would allow in the usual draws)
    ("forget-no-hand-off", "idle", True),
    ("handed-back-grant-paced", "idle", False),
    ("wait-idle-early", "wait_idle", False),
    # SPEC L14: no turns at all (FIFO within a class), and a leaver keeping its turn
    ("no-turns", "turns", False),
    ("leaver-keeps-turn", "turns", False),
])
def test_the_fuzz_finds_the_bugs_it_found(mutant: str, kind: str, paced: bool) -> None:
    # The lane with one fixed bug put back: the fuzz must see it within a few seeds.
    found = []
    clients = kind == "turns"
    for seed in range(200):
        found = [v for v in run_seed(MUTANTS[mutant], seed, paced=paced,
                                     clients=clients).violations
                 if v.kind == kind]
        if found:
            break
    assert found, f"no {kind} violation in 200 seeds with {mutant}"
