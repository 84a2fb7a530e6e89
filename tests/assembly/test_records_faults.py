"""The records file under faults (SPEC O5, A5), through the assembled relay.

A full disk (a real, small tmpfs, filled and then freed), a read-only file system, an
immutable file, a directory in the file's place, a partial last line (what a kill -9
mid-write leaves), and kill -9 of ``relay serve`` under load: serving is never affected,
each fault is logged once, writing resumes when the fault is over and what was kept back
meanwhile is written, and the file never holds half a record glued to another.

Mounting needs root (CAP_SYS_ADMIN); where it is not permitted those tests skip, saying so.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import logging
import math
import os
import random
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from helpers.assembled import chat, config_from, start_relay, wait_for
from helpers.faults import ROOT, ask, child_env, config, parsed, read_only, small_fs, start_serve

from relay import open_relay
from relay.vocab.records import Clock, Record, RecordWriter


def lines_of(path: Path) -> list[str]:
    return path.read_bytes().decode().split("\n") if path.exists() else []








def warnings_about(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    """relay.records' warnings that a fault began (``text`` in them), or that one ended
    (``text`` == "written to")."""
    kind = "written to" if text == "written to" else "cannot write"
    return [r.getMessage() for r in caplog.records if r.name == "relay.vocab.records"
            and kind in r.getMessage() and text in r.getMessage()]




def fill(fs: Path) -> Path:
    """Fill the file system to the last byte (again: what was freed since — the usage
    database beside the records checkpoints its log now and then); returns the filler."""
    filler = fs / "filler"
    with open(filler, "ab", buffering=0) as f:
        for size in (65536, 4096, 512, 64, 8, 1):
            try:
                while True:
                    f.write(b"\0" * size)
            except OSError as exc:
                assert exc.errno == 28, exc   # ENOSPC
    return filler


async def test_records_survive_a_full_disk(
        nursery: trio.Nursery, tmp_path: Path, client: httpx.AsyncClient,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    with small_fs(tmp_path / "fs", "256k") as fs:
        path = fs / "records.jsonl"
        served = await start_relay(nursery, config(path), tmp_path)
        ids = [await ask(client, served.url)]
        assert [r["id"] for r in parsed(path)] == ids
        filler = fill(fs)
        # The records file's own last page still has room: ask until the disk says no.
        for _ in range(40):
            fill(fs)
            ids.append(await ask(client, served.url, stream=len(ids) % 2 == 0))
            if warnings_about(caplog, "cannot write"):
                break
        assert warnings_about(caplog, "No space left on device")
        written = parsed(path)             # whole lines only: the short write was undone
        for _ in range(5):                 # serving goes on, records are kept back
            ids.append(await ask(client, served.url))
        assert parsed(path) == written
        assert len(warnings_about(caplog, "cannot write")) == 1   # once, not per record
        filler.unlink()                    # space returns: everything kept back is written

        async def all_written() -> None:
            while [r["id"] for r in parsed(path)] != ids:
                await trio.sleep(0.1)
                ids.append(await ask(client, served.url))

        with trio.fail_after(10):
            await all_written()
        assert len(warnings_about(caplog, "written to")) == 1
        assert len(warnings_about(caplog, "cannot write")) == 1


async def test_records_survive_a_read_only_file_system(
        nursery: trio.Nursery, tmp_path: Path, client: httpx.AsyncClient,
        caplog: pytest.LogCaptureFixture) -> None:
    with small_fs(tmp_path / "fs", "1m") as fs:
        path = fs / "records.jsonl"
        path.write_text('{"id":"from-before"}\n')
        await remount(fs, "ro")
        served = await start_relay(nursery, config(path), tmp_path)
        ids = [await ask(client, served.url) for _ in range(4)]
        assert len(warnings_about(caplog, "Read-only file system")) == 1
        assert [r["id"] for r in parsed(path)] == ["from-before"]
        await remount(fs, "rw")

        async def all_written() -> None:
            while [r["id"] for r in parsed(path)] != ["from-before", *ids]:
                await trio.sleep(0.1)
                ids.append(await ask(client, served.url))

        with trio.fail_after(10):
            await all_written()


async def remount(fs: Path, mode: str) -> None:
    await trio.run_process(["mount", "-o", f"remount,{mode}", str(fs)])




async def test_records_survive_a_read_only_file(
        nursery: trio.Nursery, tmp_path: Path, client: httpx.AsyncClient,
        caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "records.jsonl"
    path.write_text('{"id":"from-before"}\n')
    with read_only(path):
        served = await start_relay(nursery, config(path), tmp_path)
        ids = [await ask(client, served.url) for _ in range(4)]
        assert len(warnings_about(caplog, "cannot write")) == 1
        assert [r["id"] for r in parsed(path)] == ["from-before"]

    async def all_written() -> None:
        while [r["id"] for r in parsed(path)] != ["from-before", *ids]:
            await trio.sleep(0.1)
            ids.append(await ask(client, served.url))

    with trio.fail_after(10):
        await all_written()


async def test_records_survive_a_directory_in_their_place(
        nursery: trio.Nursery, tmp_path: Path, client: httpx.AsyncClient,
        caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "records.jsonl"
    path.mkdir()                                        # at start-up
    served = await start_relay(nursery, config(path), tmp_path)
    ids = [await ask(client, served.url) for _ in range(3)]
    assert len(warnings_about(caplog, "Is a directory")) == 1
    path.rmdir()

    async def all_written() -> None:
        while not path.is_file() or [r["id"] for r in parsed(path)] != ids:
            await trio.sleep(0.1)
            ids.append(await ask(client, served.url))

    with trio.fail_after(10):
        await all_written()
    # Replaced behind relay's back while it runs: the records went into the removed file.
    path.unlink()
    path.mkdir()
    late = [await ask(client, served.url) for _ in range(3)]
    assert len(warnings_about(caplog, "Is a directory")) == 2   # once per fault
    path.rmdir()

    async def late_written() -> None:
        while not path.is_file() or [r["id"] for r in parsed(path)] != late:
            await trio.sleep(0.1)
            late.append(await ask(client, served.url))

    with trio.fail_after(10):
        await late_written()


async def test_a_partial_last_line_is_never_appended_to(
        nursery: trio.Nursery, tmp_path: Path, client: httpx.AsyncClient) -> None:
    # What a kill -9 in the middle of a write leaves. The next record was glued onto it:
    # {"id":"8aebb8218e2{"id":"0ff6c64e31601c3c",...
    path = tmp_path / "records.jsonl"
    path.write_text('{"id":"whole"}\n{"id":"8aebb8218e2')
    served = await start_relay(nursery, config(path), tmp_path)
    rid = await ask(client, served.url)
    lines = lines_of(path)
    assert lines[:2] == ['{"id":"whole"}', '{"id":"8aebb8218e2']
    assert json.loads(lines[2])["id"] == rid and lines[3:] == [""]


async def test_the_record_is_written_before_the_last_byte_goes_out(
        tmp_path: Path, autojump_clock: trio.abc.Clock) -> None:
    # It was written after the last byte had been handed to the server: a kill -9 in
    # between left a client with a complete answer and no record.
    path = tmp_path / "records.jsonl"
    async with open_relay(config_from(config(path), tmp_path), discover=False) as r:
        for body in (chat("fake/echo"), chat("fake/echo", stream=True),
                     chat("nope/x"), {"model": "fake/echo"}):
            seen: dict[str, Any] = {}
            raw = json.dumps(body).encode()
            scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
                     "method": "POST", "scheme": "http", "path": "/v1/chat/completions",
                     "raw_path": b"/v1/chat/completions", "query_string": b"",
                     "root_path": "", "client": ("127.0.0.1", 5555),
                     "server": ("127.0.0.1", 8765),
                     "headers": [(b"host", b"127.0.0.1:8765"),
                                 (b"content-type", b"application/json"),
                                 (b"content-length", str(len(raw)).encode())]}
            sent = False

            async def receive(raw: bytes = raw) -> dict[str, Any]:
                nonlocal sent
                if not sent:
                    sent = True
                    return {"type": "http.request", "body": raw, "more_body": False}
                await trio.sleep_forever()
                raise AssertionError

            async def send(message: dict[str, Any], seen: dict[str, Any] = seen) -> None:
                if message["type"] == "http.response.start":
                    seen["status"] = message["status"]
                    seen["id"] = dict(message["headers"])[b"x-relay-request-id"].decode()
                elif not message.get("more_body"):   # the last byte: already recorded?
                    seen["recorded"] = [x["id"] for x in parsed(path)]

            with trio.move_on_after(30):
                await r.app(scope, receive, send)
            assert seen["id"] in seen["recorded"], (body, seen)
        assert [x["status"] for x in parsed(path)] == [200, 200, 404, 400]


# --- kill -9 of relay serve under load ---------------------------------------------------





async def test_kill_9_under_load_loses_no_answered_record(tmp_path: Path) -> None:
    path = tmp_path / "records.jsonl"
    conf = tmp_path / "relay.toml"
    conf.write_text(config(path))
    answered: list[str] = []
    proc, url = await start_serve(tmp_path, conf)
    try:
        async with httpx.AsyncClient(trust_env=False, timeout=10) as client:
            async def load(n: int) -> None:
                with contextlib.suppress(httpx.TransportError):
                    while True:
                        answered.append(await ask(client, url, stream=n % 2 == 0))

            async with trio.open_nursery() as nursery:
                for n in range(8):
                    nursery.start_soon(load, n)
                await wait_for(lambda: len(answered) >= 300, limit_s=30)
                proc.send_signal(signal.SIGKILL)   # while requests are in flight
                with trio.fail_after(5):
                    await proc.wait()
    finally:
        if proc.returncode is None:
            proc.kill()
    raw = path.read_bytes()
    lines = raw.decode(errors="replace").split("\n")
    whole = [json.loads(line) for line in lines[:-1]]   # all but a possible fragment
    ids = {r["id"] for r in whole}
    missing = [rid for rid in answered if rid not in ids]
    assert missing == [], f"{len(missing)} of {len(answered)} answered had no record"
    # What a kill in the middle of a write leaves (simulated, the kill rarely lands
    # there): the next relay starts a new line instead of appending to it.
    path.write_bytes(path.read_bytes() + b'{"id":"8aebb8218e2')
    proc, url = await start_serve(tmp_path, conf)
    try:
        async with httpx.AsyncClient(trust_env=False, timeout=10) as client:
            rid = await ask(client, url)
            await wait_for(lambda: path.read_bytes().endswith(b"\n"))
    finally:
        proc.kill()
        with trio.move_on_after(5):
            await proc.wait()
    tail = path.read_bytes().decode().split("\n")
    assert tail[-3].endswith('{"id":"8aebb8218e2') and json.loads(tail[-2])["id"] == rid
    assert tail[-1] == ""


def test_only_this_tree_is_tested(tmp_path: Path) -> None:
    # The subprocess above imports relay from this tree, not from wherever the venv's
    # editable install points.
    done = subprocess.run([sys.executable, "-c", "import relay; print(relay.__file__)"],
                          cwd=tmp_path, env=child_env(tmp_path), capture_output=True,
                          text=True, check=True)
    assert Path(done.stdout.strip()).resolve().is_relative_to(ROOT)



async def test_rotation_keeps_whole_lines_in_every_file(
        nursery: trio.Nursery, tmp_path: Path, client: httpx.AsyncClient) -> None:
    path = tmp_path / "records.jsonl"
    text = config(path).replace("[server]", "[server]\nrecords_max_bytes = 2048\n"
                                "records_keep = 2")
    served = await start_relay(nursery, text, tmp_path)
    ids = [await ask(client, served.url) for _ in range(12)]
    files = [path, path.with_name("records.jsonl.1"), path.with_name("records.jsonl.2")]
    assert all(f.exists() for f in files)
    assert not path.with_name("records.jsonl.3").exists()
    kept = [r["id"] for f in reversed(files) for r in parsed(f)]
    assert kept == ids[-len(kept):] and len(kept) >= 4
    assert all(f.stat().st_size <= 2048 for f in files)


def _record(n: int) -> Record:
    return Record(id=f"r{n}", started_at=0.0)


def test_what_is_kept_back_is_bounded_and_the_loss_is_told(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        path = tmp_path / "records.jsonl"
        path.mkdir()
        writer = RecordWriter(path, max_bytes=1 << 20, keep=1, clock=Clock())
        writer.BACKLOG_MAX_BYTES = 2000
        writer.RETRY_S = 0.0
        for n in range(40):
            writer.write(_record(n))
        assert writer.fault is not None and "Is a directory" in writer.fault
        path.rmdir()
        writer.write(_record(40))
        assert writer.fault is None
        ids = [r["id"] for r in parsed(path)]
        assert ids[-1] == "r40" and len(ids) < 41      # the oldest were dropped ...
        assert ids == [f"r{n}" for n in range(41 - len(ids), 41)]   # ... the rest in order
        told = warnings_about(caplog, "written to")
        assert len(told) == 1 and f"{41 - len(ids)} older ones were dropped" in told[0]
        writer.close()

    trio.run(main)


def test_a_fifo_in_the_files_place_is_a_fault_not_a_hang(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        path = tmp_path / "records.jsonl"
        os.mkfifo(path)
        writer = RecordWriter(path, max_bytes=1 << 20, keep=1, clock=Clock())
        writer.write(_record(1))   # (opened write-only and blocking, it would hang here)
        assert writer.fault is not None and "not a regular file" in writer.fault
        writer.close()

    trio.run(main)


async def test_a_records_times_read_as_datetime_writes_them() -> None:
    # The clock formats each whole second once and adds the milliseconds: it must give
    # datetime's text to the character, across second ends, a microsecond from them, and
    # where a time rounds up to the next second.
    clock = Clock()
    now = trio.current_time()
    edge = math.ceil(clock._anchor + now) - clock._anchor   # a second's end, in trio time
    times = [now, edge, edge - 1e-7, edge - 4e-7, edge - 6e-7, edge + 1e-6, edge - 1e-3,
             edge - 5e-4, *(now + random.uniform(-1e6, 1e6) for _ in range(20_000))]
    for t in times:
        want = dt.datetime.fromtimestamp(clock._anchor + t, tz=dt.UTC).isoformat(
            timespec="milliseconds").replace("+00:00", "Z")
        assert clock.iso(t) == want, t
    assert clock.iso(None) is None


# --- issue 29: a full disk partly freed, then SIGTERM, on relay serve ----------------------

async def test_a_partly_freed_disk_takes_what_fits_and_sigterm_counts_the_rest(
        tmp_path: Path) -> None:
    # A 64 KiB tmpfs with a 32 KiB filler; 150 requests fill the rest; the filler is
    # deleted and 20 more are answered; then SIGTERM. The backlog was written as one block
    # and undone whole again and again: ~120 records were lost although 32 KiB came back.
    with small_fs(tmp_path / "fs", "64k") as fs:
        path = fs / "records.jsonl"
        filler = fs / "filler"
        filler.write_bytes(b"\0" * 32768)
        conf = tmp_path / "relay.toml"
        conf.write_text(config(path))
        proc, url = await start_serve(tmp_path, conf)
        assert proc.stderr is not None
        log = bytearray()

        async def read_log() -> None:
            assert proc.stderr is not None
            while chunk := await proc.stderr.receive_some():
                log.extend(chunk)

        ids: list[str] = []
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(read_log)
                async with httpx.AsyncClient(trust_env=False, timeout=10) as client:
                    for n in range(150):
                        ids.append(await ask(client, url, stream=n % 2 == 0))
                    full = parsed(path)
                    assert len(full) < 150 and [r["id"] for r in full] == ids[:len(full)]
                    assert b"No space left on device" in log
                    filler.unlink()
                    for n in range(20):
                        ids.append(await ask(client, url, stream=n % 2 == 0))
                    proc.send_signal(signal.SIGTERM)
                    with trio.fail_after(20):
                        await proc.wait()
        finally:
            if proc.returncode is None:
                proc.kill()
        assert proc.returncode == 0, log.decode()
        text = log.decode()
        written = parsed(path)   # whole lines only (parsed fails on a partial one)
        # Oldest first and in order: the records written are the first ones answered.
        assert [r["id"] for r in written] == ids[:len(written)]
        assert len(written) > len(full) + 40, (len(full), len(written))  # 32 KiB came back
        dropped = len(ids) - len(written)
        assert f"relay stops: {dropped} request records kept back are dropped" in text, text
        # ... and only what the file system could not take: no record would have fit.
        longest = max(len(json.dumps(r, separators=(",", ":"))) + 1 for r in written)
        page = os.statvfs(fs).f_frsize
        room = os.statvfs(fs).f_bavail * page + (-path.stat().st_size) % page
        assert room < longest, (room, longest)
        # The fault said once as an ERROR (not per record), and the partial resume told.
        assert text.count("cannot write request records") == 1, text
        assert "ERROR" in text.split("cannot write request records")[0].rsplit("\n", 1)[-1]
        assert "kept back went into" in text


def test_at_close_what_fits_is_written_and_the_rest_counted(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # Space comes back just before relay stops, with no retry in between: the last try at
    # close writes as many whole records as fit, oldest first, and counts the rest.
    async def main() -> None:
        with small_fs(tmp_path / "fs", "64k") as fs:
            path = fs / "records.jsonl"
            writer = RecordWriter(path, max_bytes=1 << 20, keep=1, clock=Clock())
            writer.RETRY_S = 3600.0   # only close() tries again
            writer.write(_record(0))
            filler = fill(fs)
            for n in range(1, 400):
                writer.write(_record(n))
            assert writer.fault is not None and "ENOSPC" in writer.fault
            before = len(parsed(path))
            status = writer.status()
            assert status["writing"] is False and status["kept_back"] == 400 - before
            os.truncate(filler, filler.stat().st_size - 4096)   # one page back
            writer.close()
            ids = [r["id"] for r in parsed(path)]
            assert ids == [f"r{n}" for n in range(len(ids))] and len(ids) > before
            told = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR
                    and "relay stops" in r.getMessage()]
            assert len(told) == 1, told
            assert told[0].startswith(f"relay stops: {400 - len(ids)} request records "
                                      "kept back are dropped"), told
            assert writer.status()["dropped"] == 400 - len(ids)

    trio.run(main)
