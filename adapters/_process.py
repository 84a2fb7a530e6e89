"""Command-line tools as child processes: spawn, talk in JSON lines, stop, kill, reap.

Theory of operation. Every tool runs in a process group — and session — of its own
(``start_new_session=True``), so one signal reaches the tool and whatever it started: the
native binary codex's Node launcher spawns, the copy of itself gemini relaunches. Its
stdout is read as JSON lines by whoever holds the process (one request at a time), its
stdin takes JSON lines or a prompt, and its stderr goes to an anonymous temporary file:
nobody has to read it while the tool runs (a full stderr pipe would block the tool), and
its words are there, whole, when a failure needs them (SPEC E1: never cut).

Stopping (SPEC C2, L6) is `ToolProcess.stop`: send the tool's own interrupt (SIGINT to
the group for a one-shot process; a protocol message for a warm one), wait up to the
profile's ``interrupt_grace_s`` for the tool to confirm, then SIGKILL the group — and, on
Linux, any process left in the tool's session — and reap it. Callers run it shielded,
with a deadline, from the ``finally`` of the attempt, so the lane the attempt holds is
given back only once no process of the request is left.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import trio

from relay.vocab.errors import RelayError

__all__ = ["REAP_S", "ToolProcess", "session_members", "spawn_tool"]

logger = logging.getLogger(__name__)

REAP_S = 2.0          # after SIGKILL: how long reaping (and the group's exit) may take
_GONE_POLL_S = 0.005  # while waiting for the killed session's members to be gone
STDERR_KEEP = 4 * 1024 * 1024  # stderr words kept for a failure (more is very unusual)


async def spawn_tool(argv: Sequence[str], *, env: Mapping[str, str], cwd: str | Path,
                     provider: str, install_hint: str) -> ToolProcess:
    """Start a tool in a new session (its own process group).

    Raises:
        RelayError: ``upstream_unavailable`` when the command cannot be started (not
            installed, not executable), with ``action`` saying how to install it.
    """
    stderr = tempfile.TemporaryFile()  # noqa: SIM115 - owned by the ToolProcess
    try:
        proc = await trio.lowlevel.open_process(
            list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr,
            env=dict(env), cwd=str(cwd), start_new_session=True)
    except OSError as exc:
        stderr.close()
        what = ("is not installed (not found on PATH)" if isinstance(exc, FileNotFoundError)
                else f"cannot be started: {exc.strerror or exc}")
        raise RelayError(
            "upstream_unavailable", f"provider {provider!r}: the command {argv[0]!r} {what}. "
            f"{install_hint}, or set `command` in [providers.{provider}]",
            provider=provider, action=install_hint, upstream_message=str(exc)) from exc
    return ToolProcess(proc, stderr, argv[0])


class ToolProcess:
    """One running tool. Not shared: one task talks to it at a time."""

    def __init__(self, proc: trio.Process, stderr: IO[bytes], name: str) -> None:
        self.proc = proc
        self.pid = proc.pid
        self.name = name
        self._stderr = stderr
        self._buf = bytearray()
        self._closed = False

    # --- talking ------------------------------------------------------------------------
    async def send_line(self, obj: Any) -> None:
        """Write one JSON line to the tool's stdin.

        Raises:
            trio.BrokenResourceError: the tool has closed its stdin (it died).
        """
        await self.send_bytes(json.dumps(obj, ensure_ascii=False).encode() + b"\n")

    async def send_bytes(self, data: bytes) -> None:
        assert self.proc.stdin is not None
        await self.proc.stdin.send_all(data)

    async def close_stdin(self) -> None:
        if self.proc.stdin is not None:
            await self.proc.stdin.aclose()

    async def receive_line(self) -> bytes | None:
        """The next stdout line (without its newline); None at end of output.

        Cancellable without loss: bytes already read stay buffered for the next call.
        """
        assert self.proc.stdout is not None
        while True:
            end = self._buf.find(b"\n")
            if end >= 0:
                line = bytes(self._buf[:end])
                del self._buf[:end + 1]
                return line
            try:
                chunk = await self.proc.stdout.receive_some(1 << 16)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                chunk = b""
            if not chunk:
                if self._buf:
                    line = bytes(self._buf)
                    self._buf.clear()
                    return line
                return None
            self._buf += chunk

    async def receive_json(self) -> dict[str, Any] | None:
        """The next stdout line that is a JSON object (others are skipped and logged);
        None at end of output."""
        while True:
            line = await self.receive_line()
            if line is None:
                return None
            line = line.strip()
            if not line:
                continue
            try:
                obj = json.loads(line)
            except ValueError:
                logger.debug("%s printed a line that is not JSON: %.200r", self.name, line)
                continue
            if isinstance(obj, dict):
                return obj

    # --- what it said and how it ended --------------------------------------------------
    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    @property
    def returncode(self) -> int | None:
        return self.proc.poll()

    def stderr_text(self) -> str:
        """Everything the tool wrote to stderr so far (up to `STDERR_KEEP` bytes)."""
        try:
            self._stderr.seek(0)
            data = self._stderr.read(STDERR_KEEP)
        except (OSError, ValueError):
            return ""
        return data.decode("utf-8", "replace").strip()

    async def wait_exit(self) -> int:
        return await self.proc.wait()

    # --- stopping -----------------------------------------------------------------------
    def signal_group(self, sig: int) -> None:
        """Send ``sig`` to the tool's whole process group (a no-op once it is gone)."""
        try:
            os.killpg(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def kill_all(self) -> None:
        """SIGKILL the process group, then any process left in the tool's session (one
        that made a process group of its own is still in the session)."""
        self.signal_group(signal.SIGKILL)
        for pid in session_members(self.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    async def stop(self, grace_s: float,
                   interrupt: Callable[[], Awaitable[bool]] | None = None) -> bool:
        """The stop protocol: interrupt, wait up to ``grace_s`` for it to be confirmed,
        then kill unless it was. Returns True when the tool confirmed in time.

        ``interrupt`` sends the tool's own interrupt and waits for its confirmation,
        returning True once confirmed (a warm process then lives on); without one, the
        process group gets SIGINT and the confirmation is the process's exit. Call it
        shielded, with a deadline of at least ``grace_s + REAP_S``.
        """
        confirmed = False
        if self.alive:
            with trio.move_on_after(grace_s):
                if interrupt is not None:
                    try:
                        confirmed = await interrupt()
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        confirmed = False   # it has gone already
                else:
                    self.signal_group(signal.SIGINT)
                    await self.proc.wait()
                    confirmed = True
        if interrupt is None or not confirmed:
            await self.aclose()
        return confirmed

    async def aclose(self) -> None:
        """Kill whatever is left of the tool and reap it (bounded by `REAP_S`)."""
        if self._closed:
            return
        self._closed = True
        self.kill_all()
        with trio.CancelScope(shield=True), trio.move_on_after(REAP_S):
            await self.proc.wait()
            await _wait_session_gone(self.pid)
            if self.proc.stdin is not None:
                await self.proc.stdin.aclose()
            if self.proc.stdout is not None:
                await self.proc.stdout.aclose()
        self._stderr.close()


def session_members(sid: int) -> list[int]:
    """Live processes (not zombies) whose session id is ``sid`` (Linux; elsewhere [])."""
    if not sys.platform.startswith("linux"):
        return []
    found = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # pid (comm) state ppid pgrp session ... — comm may hold spaces and parentheses.
        fields = stat[stat.rfind(b")") + 2:].split()
        if len(fields) > 3 and fields[0] not in (b"Z", b"X") and int(fields[3]) == sid:
            found.append(int(entry))
    return found


async def _wait_session_gone(sid: int) -> None:
    """After SIGKILL: wait until the kernel has taken every member of the session down
    (the caller bounds this)."""
    delay = _GONE_POLL_S
    while True:
        members = session_members(sid)
        if not members:
            return
        for pid in members:  # a member that appeared after the first kill
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        await trio.sleep(delay)
        delay = min(delay * 2, 0.05)

