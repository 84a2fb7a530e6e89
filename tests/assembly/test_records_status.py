"""A records file that cannot be written is an ERROR and shows (issue 29, SPEC O5, A3).

Through the assembled relay: the file made immutable while relay writes to it (root
ignores file modes; ``chattr +i`` stops root too) and its directory removed while relay
runs. Each is one ERROR in the log (not one per record), and ``GET /relay/v1/status``
says so in its top-level ``records`` object — as do ``relay status`` (a real process) and
the status page (a real headless Chromium) — until writing resumes, by relay's own retry
task, with no request needed, and what was kept back is written in order.
"""

from __future__ import annotations

import datetime as dt
import logging
import shutil
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from helpers.assembled import start_relay
from helpers.faults import ask, child_env, config, parsed, read_only, small_fs
from helpers.webdriver import open_browser

RECORDS_LOGGER = "relay.vocab.records"


def logged(caplog: pytest.LogCaptureFixture, level: int, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == RECORDS_LOGGER
            and r.levelno == level and text in r.getMessage()]


async def records_status(client: httpx.AsyncClient, url: str) -> dict[str, Any]:
    r = await client.get(f"{url}/relay/v1/status")
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    assert set(body) == {"providers", "requests", "draining", "records", "usage"}
    return body["records"]  # type: ignore[no-any-return]


async def wait_writing(client: httpx.AsyncClient, url: str) -> dict[str, Any]:
    """Poll the status until records are written again (relay's own retry, no request)."""
    with trio.fail_after(10):
        while not (status := await records_status(client, url))["writing"]:
            await trio.sleep(0.05)
    return status


async def relay_status_cli(tmp_path: Path, url: str) -> str:
    done = await trio.run_process([sys.executable, "-m", "relay", "status", "--url", url],
                                  capture_stdout=True, capture_stderr=True, cwd=tmp_path,
                                  env=child_env(tmp_path))
    return done.stdout.decode()


def assert_failing(status: dict[str, Any], path: Path, reason: str, kept: int) -> None:
    assert status["path"] == str(path) and status["writing"] is False
    assert reason in status["reason"] and status["kept_back"] == kept
    since = dt.datetime.fromisoformat(status["failing_since"])
    assert abs((dt.datetime.now(dt.UTC) - since).total_seconds()) < 60


async def test_an_immutable_file_is_an_error_shown_until_it_is_writable(
        nursery: trio.Nursery, tmp_path: Path, client: httpx.AsyncClient,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    path = tmp_path / "records.jsonl"
    served = await start_relay(nursery, config(path), tmp_path)
    ids = [await ask(client, served.url)]
    status = await records_status(client, served.url)
    assert status == {"path": str(path), "writing": True, "failing_since": None,
                      "reason": None, "kept_back": 0, "dropped": 0}
    with read_only(path):   # while relay has it open
        ids += [await ask(client, served.url) for _ in range(3)]
        status = await records_status(client, served.url)
        assert_failing(status, path, "Operation not permitted", 3)
        assert len(logged(caplog, logging.ERROR, "cannot write request records")) == 1
        out = await relay_status_cli(tmp_path, served.url)
        assert f"records: NOT WRITTEN to {path} since {status['failing_since']}" in out, out
        assert "Operation not permitted (EPERM); 3 kept back in memory" in out
        assert [r["id"] for r in parsed(path)] == ids[:1]
    status = await wait_writing(client, served.url)
    assert status["kept_back"] == 0 and status["dropped"] == 0
    assert [r["id"] for r in parsed(path)] == ids
    told = logged(caplog, logging.WARNING, "written to")
    assert len(told) == 1 and "3 kept back were written" in told[0], told
    assert f"records: {path} (writing)" in await relay_status_cli(tmp_path, served.url)


async def test_a_read_only_file_system_is_an_error_in_the_status(
        nursery: trio.Nursery, tmp_path: Path, client: httpx.AsyncClient,
        caplog: pytest.LogCaptureFixture) -> None:
    with small_fs(tmp_path / "fs", "1m") as fs:
        path = fs / "records.jsonl"
        path.write_text('{"id":"from-before"}\n')
        await trio.run_process(["mount", "-o", "remount,ro", str(fs)])
        served = await start_relay(nursery, config(path), tmp_path)
        ids = [await ask(client, served.url) for _ in range(2)]
        assert_failing(await records_status(client, served.url), path,
                       "Read-only file system (EROFS)", 2)
        assert len(logged(caplog, logging.ERROR, "Read-only file system")) == 1
        await trio.run_process(["mount", "-o", "remount,rw", str(fs)])
        await wait_writing(client, served.url)
        assert [r["id"] for r in parsed(path)] == ["from-before", *ids]


async def test_a_removed_directory_is_an_error_shown_on_the_page_until_it_is_back(
        nursery: trio.Nursery, tmp_path: Path, client: httpx.AsyncClient,
        caplog: pytest.LogCaptureFixture) -> None:
    folder = tmp_path / "records"
    path = folder / "records.jsonl"
    served = await start_relay(nursery, config(path), tmp_path)
    first = await ask(client, served.url)
    assert [r["id"] for r in parsed(path)] == [first]
    shutil.rmtree(folder)   # relay does not make it again where nobody looks
    kept = [await ask(client, served.url, stream=n % 2 == 0) for n in range(3)]
    assert not folder.exists()
    status = await records_status(client, served.url)
    assert_failing(status, path, f"its directory {folder} was removed", 3)
    errors = logged(caplog, logging.ERROR, "cannot write request records")
    assert len(errors) == 1 and "was removed" in errors[0]
    out = await relay_status_cli(tmp_path, served.url)
    assert f"records: NOT WRITTEN to {path}" in out and "was removed" in out, out
    banner = ("const b = document.getElementById('records-banner');"
              " return !b.hidden && b.className === arguments[0] && b.textContent;")
    async with open_browser(tmp_path) as browser:
        await browser.get(served.url + "/")
        text = await browser.wait_for(banner, "s-bad")
        assert text.startswith(f"Request records are not being written to {path} (its "
                               f"directory {folder} was removed (ENOENT)) since "), text
        assert "3 kept back in memory" in text
        folder.mkdir()
        await wait_writing(client, served.url)
        await browser.wait_for("return document.getElementById('records-banner').hidden;")
    assert [r["id"] for r in parsed(path)] == kept
    assert len(logged(caplog, logging.WARNING, "written to")) == 1
