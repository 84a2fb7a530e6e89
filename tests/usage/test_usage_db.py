"""The usage database through the assembled relay (SPEC O7): config → relay → requests →
records → database. It holds what the records hold, to the cent, after requests, after a
restart (never twice), when deleted (rebuilt from the records), and after a full disk
(held back, then caught up); its state is in the status, and /metrics counts tokens."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import httpx
import pytest
import trio
from helpers.assembled import FAKE_ONLY, chat, start_relay
from helpers.faults import config, small_fs
from helpers.usage_records import answered, expected, generated, lines, write_lines

from relay.usage.db import usage_db_path

SINCE = "2000-01-01"  # everything


async def usage_of(client: httpx.AsyncClient, url: str) -> dict[tuple[str, str], dict]:
    r = await client.get(f"{url}/relay/v1/usage",
                         params={"since": SINCE, "by": "client,provider,model"})
    assert r.status_code == 200, r.text
    return answered(r.json()["rows"])


async def ask_some(client: httpx.AsyncClient, url: str, n: int) -> None:
    for i in range(n):
        r = await client.post(f"{url}/v1/chat/completions",
                              json=chat("fake/echo", f"hello {i}", stream=i % 2 == 1,
                                        stream_options={"include_usage": True}))
        assert r.status_code == 200, r.text
    r = await client.post(f"{url}/v1/chat/completions", json=chat("nope/x"))
    assert r.status_code == 404  # a refusal: a request of no provider, a failure


async def matches(client: httpx.AsyncClient, url: str, records: Path) -> bool:
    return await usage_of(client, url) == expected(lines(records))


async def run_until_matches(tmp_path: Path, client: httpx.AsyncClient, asks: int) -> None:
    path = tmp_path / "records.jsonl"
    async with trio.open_nursery() as nursery:
        served = await start_relay(nursery, FAKE_ONLY, tmp_path)
        await ask_some(client, served.url, asks)
        with trio.fail_after(10):
            while not await matches(client, served.url, path):
                await trio.sleep(0.1)
        nursery.cancel_scope.cancel()


async def test_the_database_is_the_records_to_the_cent_across_restarts_and_a_rebuild(
        tmp_path: Path, client: httpx.AsyncClient) -> None:
    path = tmp_path / "records.jsonl"
    # A clients' relay's records (client, cost_usd), then this relay's (without them).
    write_lines(path, generated(400))
    await run_until_matches(tmp_path, client, 6)
    db = usage_db_path(path)
    assert db.is_file()
    # A restart reads only what is new: nothing counted twice.
    await run_until_matches(tmp_path, client, 3)
    # Deleted (with its journal): made again from the records, rotated ones included.
    for extra in ("", "-wal", "-shm"):
        await trio.Path(f"{db}{extra}").unlink(missing_ok=True)
    await trio.Path(path).rename(path.with_name(path.name + ".1"))
    write_lines(path.with_name(path.name + ".2"), generated(50, seed=2))
    async with trio.open_nursery() as nursery:
        served = await start_relay(nursery, FAKE_ONLY, tmp_path)
        await ask_some(client, served.url, 2)
        every = [path.with_name(path.name + s) for s in (".2", ".1", "")]
        with trio.fail_after(10):
            while await usage_of(client, served.url) != expected(lines(*every)):
                await trio.sleep(0.1)
        nursery.cancel_scope.cancel()


async def test_the_status_shows_the_database_and_metrics_count_tokens(
        tmp_path: Path, client: httpx.AsyncClient) -> None:
    async with trio.open_nursery() as nursery:
        served = await start_relay(nursery, FAKE_ONLY, tmp_path)
        await ask_some(client, served.url, 4)
        status = (await client.get(f"{served.url}/relay/v1/status")).json()
        assert status["usage"]["path"] == str(usage_db_path(tmp_path / "records.jsonl"))
        assert status["usage"]["writing"] is True
        text = (await client.get(f"{served.url}/metrics")).text
        records = lines(tmp_path / "records.jsonl")
        samples = {tuple(sorted(re.findall(r'(\w+)="([^"]*)"', labels))): float(value)
                   for labels, value in re.findall(r"relay_tokens_total\{([^}]*)\} (\S+)",
                                                   text)}
        for kind, key in (("input", "prompt_tokens"), ("output", "completion_tokens")):
            want = sum((r["usage"] or {}).get(key) or 0 for r in records)
            assert want > 0
            labels = (("client", "default"), ("kind", kind), ("model", "echo"),
                      ("provider", "fake"))
            assert samples.get(labels) == want, text
        assert "# TYPE relay_cost_usd_total counter" in text
        nursery.cancel_scope.cancel()


async def test_a_bad_question_is_a_400(tmp_path: Path, client: httpx.AsyncClient) -> None:
    async with trio.open_nursery() as nursery:
        served = await start_relay(nursery, FAKE_ONLY, tmp_path)
        for params in ({"since": "yesterdayish"}, {"by": "client,colour"},
                       {"by": "day,hour"}):
            r = await client.get(f"{served.url}/relay/v1/usage", params=params)
            assert r.status_code == 400, r.text
            assert r.json()["error"]["type"] == "invalid_request_error"
        nursery.cancel_scope.cancel()


def fill(fs: Path) -> Path:
    """Fill the file system to the last byte; returns the filler."""
    filler = fs / "filler"
    with open(filler, "wb", buffering=0) as f:
        for size in (65536, 4096, 512, 64, 8, 1):
            try:
                while True:
                    f.write(b"\0" * size)
            except OSError as exc:
                assert exc.errno == 28, exc   # ENOSPC
    return filler


async def test_a_full_disk_holds_the_database_back_then_it_catches_up(
        tmp_path: Path, client: httpx.AsyncClient, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    with small_fs(tmp_path / "fs", "1m") as fs:
        path = fs / "records.jsonl"
        write_lines(path, generated(300))
        filler = fill(fs)
        async with trio.open_nursery() as nursery:
            served = await start_relay(nursery, config(path), tmp_path)
            url = served.url

            async def usage_status() -> dict:
                return (await client.get(f"{url}/relay/v1/status")).json()["usage"]

            with trio.fail_after(10):
                while (await usage_status())["writing"]:
                    await trio.sleep(0.05)
            status = await usage_status()
            assert "full" in status["reason"], status
            assert status["failing_since"] is not None
            r = await client.post(f"{url}/v1/chat/completions", json=chat("fake/echo"))
            assert r.status_code == 200, r.text   # serving goes on
            errors = [m.getMessage() for m in caplog.records if m.name == "relay.usage.store"
                      and m.levelno == logging.ERROR]
            assert len(errors) == 1, errors      # once, not per try
            filler.unlink()                      # space returns: it catches up
            with trio.fail_after(20):
                while not (await usage_status())["writing"] or not await matches(
                        client, url, path):
                    await trio.sleep(0.1)
            nursery.cancel_scope.cancel()
