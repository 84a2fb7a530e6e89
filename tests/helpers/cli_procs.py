"""Helpers for the CLI adapter tests: relay with CLI providers, and the processes left.

`open_cli_relay` serves a relay in its own nursery and, when the block ends, closes it
and asserts that no process of the tools is left (live ones: a zombie holds nothing) and
that every lane was idle. `tool_processes` finds live processes by a marker in their
command line (the fake CLIs' folder, or a real tool's name under a test HOME).
"""

from __future__ import annotations

import functools
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import trio

import relay
from helpers.assembled import config_from, lane_idle
from relay import Served

FAKE_CLI = Path(__file__).parents[1] / "fakes" / "fake_cli"


def tool_processes(marker: str) -> list[tuple[int, str]]:
    """(pid, command line) of live processes whose command line or environment holds
    ``marker``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
            state = stat[stat.rfind(b")") + 2:].split()[0]
            if state in (b"Z", b"X"):
                continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode("utf-8", "replace")
            environ = b""
            if marker not in cmdline:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    environ = f.read()
        except OSError:
            continue
        if marker in cmdline or marker.encode() in environ:
            found.append((int(entry), cmdline))
    return found


@asynccontextmanager
async def open_cli_relay(text: str, tmp_path: Path, *, marker: str | None = None
                         ) -> AsyncIterator[Served]:
    """``marker``: what the tools' processes carry (default: ``tmp_path``, which the
    providers' ``env`` holds, so other test runs on this machine are never counted)."""
    marker = marker or str(tmp_path)
    config = config_from(text, tmp_path)
    async with trio.open_nursery() as nursery:
        served: Served = await nursery.start(functools.partial(relay.serve, config, port=0))
        try:
            yield served
            with trio.fail_after(10):   # requests end (and write their records) first
                await served.relay.idle.wait()
            assert lane_idle(served), "a lane is still taken after the test"
        finally:
            nursery.cancel_scope.cancel()
    left = tool_processes(marker)
    assert not left, f"tool processes outlived the relay: {left}"
