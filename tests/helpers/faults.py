"""A `relay serve` whose records folder fails as disks do: read-only, full (a small
filesystem), gone."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from helpers.assembled import FAKE_ONLY, chat
from helpers.daemons import child_env

ROOT = Path(__file__).resolve().parents[2]


def parsed(path: Path) -> list[dict[str, Any]]:
    """Every line of a records file; each must be whole JSON (the last may be empty)."""
    out = []
    raw = path.read_bytes() if path.exists() else b""
    assert raw == b"" or raw.endswith(b"\n"), f"the file ends inside a line: {raw[-80:]!r}"
    for line in raw.decode().splitlines():
        out.append(json.loads(line))
    return out


def config(records: Path) -> str:
    return FAKE_ONLY.replace('records = "records.jsonl"', f'records = "{records}"')


async def ask(client: httpx.AsyncClient, url: str, **extra: Any) -> str:
    """One chat request; it must be answered; returns its request id."""
    r = await client.post(f"{url}/v1/chat/completions", json=chat("fake/echo", **extra))
    assert r.status_code == 200, r.text
    if extra.get("stream"):
        assert r.text.rstrip().endswith("data: [DONE]")
    else:
        assert r.json()["choices"][0]["message"]["content"] == "hello"
    return r.headers["x-relay-request-id"]


@contextlib.contextmanager
def small_fs(where: Path, size: str) -> Iterator[Path]:
    """A real tmpfs of ``size`` mounted at ``where`` (skips where mounting is refused)."""
    where.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root (CAP_SYS_ADMIN); not root here")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs",
                           str(where)], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"mounting a tmpfs is not permitted here: {done.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


@contextlib.contextmanager
def read_only(path: Path) -> Iterator[None]:
    """The file made read-only: immutable for root (who ignores modes), 0444 otherwise."""
    if os.geteuid() == 0:
        done = subprocess.run(["chattr", "+i", str(path)], capture_output=True, text=True,
                              check=False)
        if done.returncode != 0:
            pytest.skip(f"cannot make a file read-only for root here: {done.stderr.strip()}")
        try:
            yield
        finally:
            subprocess.run(["chattr", "-i", str(path)], check=False)
    else:
        path.chmod(0o444)
        try:
            yield
        finally:
            path.chmod(0o644)


async def start_serve(tmp_path: Path, conf: Path) -> tuple[trio.Process, str]:
    proc = await trio.lowlevel.open_process(
        [sys.executable, "-m", "relay", "serve", "--config", str(conf), "--port", "0",
         "--log-level", "WARNING"], cwd=tmp_path, env=child_env(tmp_path), stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    assert proc.stderr is not None
    data = b""
    with trio.fail_after(20):
        while b"relay listening on " not in data or not data.endswith(b"\n"):
            chunk = await proc.stderr.receive_some()
            assert chunk, f"relay serve exited: {data.decode(errors='replace')}"
            data += chunk
    url = data.split(b"relay listening on ")[1].split()[0].decode()
    return proc, url
