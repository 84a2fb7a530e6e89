"""``relay usage`` as a person and a script run it (SPEC O7, 9): a subprocess, on the
database a relay kept (``--config``), on records files directly (``--records``, two
relays'), as a table and as JSON, and on a generated year of records."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import trio
from helpers.assembled import FAKE_ONLY, chat, start_relay
from helpers.daemons import child_env
from helpers.usage_records import answered, expected, generated, lines, write_lines

from relay.usage.db import usage_db_path


def usage(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "relay", "usage", *args], cwd=tmp_path,
                          env=child_env(tmp_path), capture_output=True, text=True,
                          timeout=60, check=False)


def as_json(tmp_path: Path, *args: str) -> dict[str, Any]:
    done = usage(tmp_path, *args, "--json")
    assert done.returncode == 0, done.stderr
    report: dict[str, Any] = json.loads(done.stdout)
    return report


async def test_relay_usage_reads_the_relays_database_as_a_table_and_json(
        tmp_path: Path, client: httpx.AsyncClient) -> None:
    conf = tmp_path / "profiles.toml"
    conf.write_text(FAKE_ONLY)
    path = tmp_path / "records.jsonl"
    write_lines(path, generated(300))
    async with trio.open_nursery() as nursery:
        served = await start_relay(nursery, FAKE_ONLY, tmp_path)
        for i in range(3):
            r = await client.post(f"{served.url}/v1/chat/completions",
                                  json=chat("fake/echo", f"hi {i}"))
            assert r.status_code == 200
        nursery.cancel_scope.cancel()  # (its last read into the database at the stop)
    assert usage_db_path(path).is_file()
    report = as_json(tmp_path, "--config", str(conf), "--since", "30d",
                     "--by", "client,provider,model")
    assert report["source"] == f"database {usage_db_path(path)}"
    assert answered(report["rows"]) == expected(lines(path))
    # The table: one line per client and model, tokens with separators, cost or "—".
    done = usage(tmp_path, "--config", str(conf), "--by", "client,model")
    assert done.returncode == 0, done.stderr
    text = done.stdout.splitlines()
    assert text[1].split()[:4] == ["CLIENT", "MODEL", "REQUESTS", "FAILED"]
    echo = next(line for line in text if line.startswith("default ") and " echo " in line)
    assert echo.split()[2] == "3" and echo.endswith("—")  # the fake has no price
    by_model = {(r["client"], r["model"]): r for r in as_json(
        tmp_path, "--config", str(conf), "--by", "client,model")["rows"]}
    for (who, model), row in by_model.items():
        if row["cost_usd"] is not None:
            line = next(x for x in text if x.startswith(who + " ") and f" {model} " in x)
            money = row["cost_usd"]  # cents from a dollar up, else four decimals
            said = f"${money:,.2f}" if money >= 1 else f"${money:.4f}"
            assert line.endswith(("≥ " if row["unpriced"] else "") + said), line
    assert text[-2].startswith("total")
    # A bad question: exit 2, and says what is accepted.
    done = usage(tmp_path, "--config", str(conf), "--since", "last tuesday")
    assert done.returncode == 2 and "a duration" in done.stderr


def test_relay_usage_reads_two_relays_records_files(tmp_path: Path) -> None:
    one, two = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    write_lines(one, generated(200, seed=3))
    write_lines(two, generated(150, seed=4))
    report = as_json(tmp_path, "--records", str(one), str(two), "--since", "7d",
                     "--by", "client,provider,model")
    assert answered(report["rows"]) == expected(lines(one, two))
    assert report["total"]["requests"] == 350
    assert not usage_db_path(one).exists()  # read, not kept


def test_relay_usage_by_day_over_a_generated_year(tmp_path: Path) -> None:
    path = tmp_path / "year.jsonl"
    records = generated(20000, days=365, seed=5)
    write_lines(path, records)
    report = as_json(tmp_path, "--records", str(path), "--since", "400d", "--by", "day")
    days = [row["day"] for row in report["rows"]]
    assert days == sorted(days) and 330 <= len(days) <= 366
    assert sum(row["requests"] for row in report["rows"]) == 20000
    want = sum(r["usage"]["prompt_tokens"] for r in records if r["usage"])
    assert report["total"]["input_tokens"] == want
    cost = sum(r["cost_usd"] for r in records if r["cost_usd"] is not None)
    assert round(report["total"]["cost_usd"], 2) == round(cost, 2)
    assert report["total"]["unpriced"] == sum(
        1 for r in records if r["usage"] and r["cost_usd"] is None)


def test_relay_usage_on_a_database_imports_none_of_the_daemon(tmp_path: Path) -> None:
    # A person's `relay usage` starts in a few tens of milliseconds: it reads SQLite and
    # imports neither trio, httpx, Quart nor relay's engine and front (~0.4 s).
    path = tmp_path / "records.jsonl"
    write_lines(path, generated(50))
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "relay", "usage",
                           "--records", str(path), "--json"], cwd=tmp_path,
                          env=child_env(tmp_path), capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["total"]["requests"] == 50
    imported = {line.rpartition("|")[2].strip() for line in done.stderr.splitlines()
                if line.startswith("import time:")}
    assert "relay.usage.db" in imported
    heavy = {"trio", "httpx", "quart", "attrs", "relay.engine", "relay.front",
             "relay.adapters", "relay.assembly.relay"}
    assert not imported & heavy, sorted(imported & heavy)
