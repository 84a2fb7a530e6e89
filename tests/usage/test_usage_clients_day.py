"""`relay usage --by client,model` after a day's mix of three clients (in miniature), as a
person runs it (a subprocess on the config's database), matches the records to the cent
— each client and model's requests, failures, tokens and the sum of its records'
``cost_usd`` — and after a restart says the same, then counts what came after it once
(SPEC O7, L14; issue 35's "Done when")."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from helpers.assembled import chat, records, start_relay
from helpers.daemons import child_env

from relay.usage.db import usage_db_path

TOKENS = {"RELAY_TEST_CODE_TOKEN": "code-token-0123456789",
          "RELAY_TEST_CODEX_TOKEN": "codex-token-0123456789",
          "RELAY_TEST_APP_TOKEN": "app-token-0123456789"}

# Prices large enough that every request moves the cents, with digits past them; one
# model has none (its rows' cost is unknown, never 0).
CONFIG = """
[server]
records = "records.jsonl"
[providers.fake]
adapter = "fake"
models = ["echo", "big", "free"]
[providers.fake.prices."echo"]
input = 1234.5678
output = 9876.54321
[providers.fake.prices."big"]
input = 3333.3333
output = 17777.7777
[providers.other]
adapter = "fake"
models = ["echo"]
[providers.other.prices."echo"]
input = 555.55
output = 4444.4444
[routes.fast]
primary = "other/echo"
[clients.claude-code]
token_env = "RELAY_TEST_CODE_TOKEN"
models = ["fake/*", "fast"]
usd_per_day = 100000
[clients.codex]
token_env = "RELAY_TEST_CODEX_TOKEN"
tokens_per_day = 10000000
[clients.chat-app]
token_env = "RELAY_TEST_APP_TOKEN"
"""

WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota",
         "kappa", "lambda", "mu"]
CLIENT_MODELS = {"RELAY_TEST_CODE_TOKEN": ["fake/echo", "fake/big", "fast"],
                 "RELAY_TEST_CODEX_TOKEN": ["fake/big", "fake/echo", "other/echo",
                                            "fake/echo?fail=upstream_error&fail_after=1"],
                 "RELAY_TEST_APP_TOKEN": ["fake/free", "fake/echo", "nope/x"]}


@pytest.fixture
def tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in TOKENS.items():
        monkeypatch.setenv(name, value)


async def a_day(client: httpx.AsyncClient, url: str, rng: random.Random, n: int) -> None:
    """``n`` requests of the three clients, mixed: models, sizes, streams, failures."""
    for _ in range(n):
        var = rng.choice(sorted(CLIENT_MODELS))
        model = rng.choice(CLIENT_MODELS[var])
        text = " ".join(rng.choices(WORDS, k=rng.randint(1, 40)))
        stream = rng.random() < 0.4
        r = await client.post(f"{url}/v1/chat/completions", headers={
            "authorization": f"Bearer {TOKENS[var]}"}, json=chat(
            model, text, stream=stream, **({"stream_options": {"include_usage": True}}
                                            if stream else {})))
        assert r.status_code in (200, 404, 502), r.text  # (nope/x: a refusal; a failure)


def by_client_model(recs: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    """What the records sum to, by client and model, counted here on their own: the cost
    is the sum of the known ``cost_usd``; unknown (None) when no record of the row had one
    and some used tokens; a row of token-less refusals cost $0 (docs/operators.md)."""
    out: dict[tuple[str, str], dict[str, Any]] = defaultdict(lambda: {
        "requests": 0, "failures": 0, "input_tokens": 0, "output_tokens": 0,
        "cost_usd": 0.0, "priced": 0, "unpriced": 0})
    for rec in recs:
        row = out[(rec["client"], rec["model"] or "")]
        row["requests"] += 1
        row["failures"] += rec["status"] >= 400
        usage = rec.get("usage") or {}
        row["input_tokens"] += usage.get("prompt_tokens") or 0
        row["output_tokens"] += usage.get("completion_tokens") or 0
        if rec["cost_usd"] is not None:
            row["cost_usd"] += rec["cost_usd"]
            row["priced"] += 1
        elif usage:
            row["unpriced"] += 1
    for row in out.values():
        if not row["priced"] and row["unpriced"]:
            row["cost_usd"] = None
    return dict(out)


def relay_usage(tmp_path: Path) -> dict[tuple[str, str], dict[str, Any]]:
    done = subprocess.run([sys.executable, "-m", "relay", "usage", "--config",
                           str(tmp_path / "profiles.toml"), "--since", "1d", "--by",
                           "client,model", "--json"], cwd=tmp_path, env=child_env(tmp_path),
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["source"] == f"database {usage_db_path(tmp_path / 'records.jsonl')}"
    return {(row["client"], row["model"]): row for row in report["rows"]}


def assert_to_the_cent(tmp_path: Path) -> dict[tuple[str, str], dict[str, Any]]:
    said = relay_usage(tmp_path)
    want = by_client_model(records(tmp_path))
    assert sorted(said) == sorted(want)
    assert {c for c, _ in want} == {"claude-code", "codex", "chat-app"}
    for key, row in want.items():
        got = said[key]
        for name in ("requests", "failures", "input_tokens", "output_tokens", "priced",
                     "unpriced"):
            assert got[name] == row[name], (key, name, got, row)
        if row["cost_usd"] is None:
            assert got["cost_usd"] is None, (key, got)
        else:
            assert round(got["cost_usd"], 2) == round(row["cost_usd"], 2), (key, got, row)
            assert got["cost_usd"] == pytest.approx(row["cost_usd"], abs=1e-9)
    priced = [row["cost_usd"] for row in want.values() if row["cost_usd"]]
    assert len(priced) >= 4 and sum(priced) > 1  # real money moved: cents are tested
    return said


async def run_relay(tmp_path: Path, client: httpx.AsyncClient, seed: int, n: int) -> None:
    async with trio.open_nursery() as nursery:
        served = await start_relay(nursery, CONFIG, tmp_path)
        await a_day(client, served.url, random.Random(seed), n)
        nursery.cancel_scope.cancel()  # (its last read into the database at the stop)


async def test_relay_usage_by_client_and_model_is_the_records_to_the_cent_across_a_restart(
        tmp_path: Path, client: httpx.AsyncClient, tokens: None) -> None:
    (tmp_path / "profiles.toml").write_text(CONFIG)
    await run_relay(tmp_path, client, seed=1, n=90)
    before = assert_to_the_cent(tmp_path)
    # A restart with nothing new: the same answer, nothing counted twice.
    async with trio.open_nursery() as nursery:
        await start_relay(nursery, CONFIG, tmp_path)
        nursery.cancel_scope.cancel()
    assert relay_usage(tmp_path) == before
    # Then more of the day: the records, both runs', still to the cent.
    await run_relay(tmp_path, client, seed=2, n=60)
    after = assert_to_the_cent(tmp_path)
    assert sum(r["requests"] for r in after.values()) == 150
