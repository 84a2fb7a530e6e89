"""Command-line tools as child processes: spawn, read bounded lines, stop, kill, reap.

Theory of operation. Every tool runs in a process group — and session — of its own
(``start_new_session=True``), so one signal reaches the tool and whatever it started: the
native binary codex's Node launcher spawns, the copy of itself gemini relaunches. Its
stdout is read as lines by whoever holds the process (one request at a time), its stdin
takes JSON lines or a prompt, and its stderr goes to an anonymous temporary file: nobody
has to read it while the tool runs (a full stderr pipe would block the tool), and its
words are there, whole, when a failure needs them (SPEC E1: never cut).

Output (SPEC O5). `ToolProcess.receive_line` is the one line reader for a tool's output:
incremental (each byte is looked at once, however the output is cut into reads), a line
ends at LF, CR or CRLF, and a line longer than `LINE_MAX` (8 MiB) is
``bad_upstream_response``; no more than `LINE_MAX` + 1 bytes are ever buffered.

Stopping (SPEC C2, L6) is `ToolProcess.stop`: send the tool's own interrupt (SIGINT to
the group for a one-shot process; a protocol message for a warm one), wait up to the
profile's ``interrupt_grace_s`` for the tool to confirm, then kill the tool and every
process of its run (below) and reap it. Callers run it shielded, with a deadline, from
the ``finally`` of the attempt, so the lane the attempt holds is given back only once no
process of the request is left.

Containment (SPEC O5): no process a tool starts for a turn outlives the turn — after a
stop and after a successful answer alike. A one-shot run ends with `ToolProcess.aclose`
(the tool and everything of its run die); a warm process's turn ends with
`ToolProcess.end_turn`: the process itself stays, with the processes it had when its
first turn began (`begin_turn`: codex's native binary under its launcher, gemini's
relaunched copy), and everything else of its run dies. On Linux a run's processes are
found in ``/proc``, each by any one of:

- descent: the tool is an ancestor (the parent chain);
- the tool's process group or session (what the signals reach);
- the run's mark: every tool gets ``RELAY_TOOL_RUN=<unique id>`` in its environment, and
  its descendants inherit it — also one that called ``setsid()`` or double forked, which
  the parent chain and the session no longer lead to;
- under ``relay serve``, relay is the child subreaper (`become_subreaper`, called by the
  serve command only): a process whose parent dies is re-parented to relay instead of
  init, so nothing a tool starts leaves relay's tree, even one that also cleared its
  environment. Such an adopted process that carries no live run's mark (and is not a
  fork of relay itself on its way to ``exec``) is killed at the next end of a turn. Relay
  reaps adopted processes by pid (``waitpid(pid)``), only those trio does not own —
  never ``waitpid(-1)``, which would take trio's own children's exit status. (So under
  ``relay serve`` every child relay starts itself is a tool started by `spawn_tool`:
  another child would count as adopted.)

Embedded in another program (no subreaper), a process that left the tool's tree and its
session *and* cleared its environment is out of reach. The kill is SIGKILL, repeated
until nothing of the run is left alive (a process that forks while it is being killed
is found by the next look), bounded by `REAP_S`. ``/proc`` is read in a worker thread
(`trio.to_thread.run_sync`), never on the event loop.

macOS (and other systems without ``/proc``) get the process group only: the interrupt
and the kill reach the tool's process group, and a descendant that made a group or
session of its own (``setsid()``, a double-forked daemon) is not found there and may
outlive its turn.
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import tempfile
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import trio

from relay.vocab.errors import RelayError

from .proctree import (
    RUN_VAR,
    _attached,
    _forget_reaped,
    _live_runs,
    _owned,
    _stat,
    _sweep,
    become_subreaper,
    is_subreaper,
)

__all__ = ["LINE_MAX", "REAP_S", "RUN_VAR", "ToolProcess", "become_subreaper", "spawn_tool"]

logger = logging.getLogger(__name__)

REAP_S = 2.0          # after SIGKILL: how long reaping (and the run's exit) may take
_GONE_POLL_S = 0.005  # while waiting for the killed run's processes to be gone
STDERR_KEEP = 4 * 1024 * 1024  # stderr words kept for a failure (more is very unusual)
LINE_MAX = 8 * 1024 * 1024     # SPEC O5: the longest line of a tool's output
_READ_SIZE = 1 << 16
_LF, _CR = 0x0A, 0x0D

_LINUX = sys.platform.startswith("linux")

_run_numbers = itertools.count(1)


async def spawn_tool(argv: Sequence[str], *, env: Mapping[str, str], cwd: str | Path,
                     provider: str, install_hint: str) -> ToolProcess:
    """Start a tool in a new session (its own process group), marked as a run of its own.

    Raises:
        RelayError: ``upstream_unavailable`` when the command cannot be started (not
            installed, not executable), with ``action`` saying how to install it.
    """
    run = f"{os.getpid()}-{next(_run_numbers)}-{secrets.token_hex(6)}"
    stderr = tempfile.TemporaryFile()  # noqa: SIM115 - owned by the ToolProcess
    _live_runs.add(run)   # before the fork: a sweep never takes a new tool for an orphan
    try:
        proc = await trio.lowlevel.open_process(
            list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr,
            env={**env, RUN_VAR: run}, cwd=str(cwd), start_new_session=True)
    except OSError as exc:
        _live_runs.discard(run)
        stderr.close()
        what = ("is not installed (not found on PATH)" if isinstance(exc, FileNotFoundError)
                else f"cannot be started: {exc.strerror or exc}")
        raise RelayError(
            "upstream_unavailable", f"provider {provider!r}: the command {argv[0]!r} {what}. "
            f"{install_hint}, or set `command` in [providers.{provider}]",
            provider=provider, action=install_hint, upstream_message=str(exc)) from exc
    except BaseException:
        _live_runs.discard(run)
        stderr.close()
        raise
    _owned[proc.pid] = proc
    tool = ToolProcess(proc, stderr, argv[0], provider=provider, run=run)
    if _LINUX:   # one small read: when it started (nothing of its run started before)
        stat = _stat(proc.pid)
        tool.started = stat.start if stat is not None else 0
    return tool


class ToolProcess:
    """One running tool. Not shared: one task talks to it at a time."""

    def __init__(self, proc: trio.Process, stderr: IO[bytes], name: str, *,
                 provider: str | None = None, run: str = "") -> None:
        self.proc = proc
        self.pid = proc.pid
        self.name = name
        self.provider = provider
        self.run = run
        self._stderr = stderr
        self._buf = bytearray()   # output read but not yet returned as lines
        self._scan = 0            # how much of _buf is known to hold no line end
        self._skip_lf = False     # the last line ended with a CR: a LF next belongs to it
        self._eof = False
        self._unreadable = False  # a line was too long: the output cannot be followed
        self._own: frozenset[tuple[int, int]] | None = None   # see begin_turn
        self.started = 0          # its start time (/proc clock ticks), where known
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
        """The next stdout line, without its line end (LF, CR or CRLF); None at the end of
        the output.

        Cancellable without loss: bytes already read stay buffered for the next call.

        Raises:
            RelayError: ``bad_upstream_response`` for a line longer than `LINE_MAX`
                (after that the output has ended, as far as callers are concerned).
        """
        assert self.proc.stdout is not None
        # (noqa, ASYNC913: a line already buffered returns at once; otherwise it reads.)
        while True:  # noqa: ASYNC913
            line = self._next_line()
            if line is not None:
                return line
            if self._eof or self._unreadable:
                if self._buf and not self._unreadable:
                    line = bytes(self._buf)
                    self._buf.clear()
                    return line
                return None
            # Never more than one byte past the limit: enough to know a line is too long.
            want = min(_READ_SIZE, LINE_MAX + 1 - len(self._buf))
            try:
                chunk = await self.proc.stdout.receive_some(want)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                chunk = b""
            if not chunk:
                self._eof = True
            self._buf += chunk

    def _next_line(self) -> bytes | None:
        """A whole line from the buffer, or None (then the buffer holds no line end)."""
        buf = self._buf
        if self._skip_lf and buf:
            self._skip_lf = False
            if buf[0] == _LF:
                del buf[:1]
        lf = buf.find(b"\n", self._scan)
        cr = buf.find(b"\r", self._scan, lf if lf >= 0 else len(buf))
        end = cr if cr >= 0 else lf
        if end < 0:
            self._scan = len(buf)
            if len(buf) > LINE_MAX:
                self._overlong()
            return None
        line = bytes(buf[:end])
        if buf[end] == _CR and end + 1 == len(buf):
            self._skip_lf = True      # the LF of a CRLF may come with the next read
            del buf[:end + 1]
        else:
            del buf[:end + (2 if buf[end] == _CR and buf[end + 1] == _LF else 1)]
        self._scan = 0
        return line

    def _overlong(self) -> None:
        self._unreadable = True
        self._buf = bytearray()
        self._scan = 0
        tool = os.path.basename(self.name)
        raise RelayError(
            "bad_upstream_response",
            f"provider {self.provider!r}: {tool} printed a line longer than "
            f"{LINE_MAX // (1024 * 1024)} MiB (relay's limit for one line of a tool's "
            "output); relay stopped reading it and stopped the tool",
            provider=self.provider)

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

    async def stop(self, grace_s: float,
                   interrupt: Callable[[], Awaitable[bool]] | None = None) -> bool:
        """The stop protocol: interrupt, wait up to ``grace_s`` for it to be confirmed,
        then kill unless it was. Returns True when the tool confirmed in time.

        ``interrupt`` sends the tool's own interrupt and waits for its confirmation,
        returning True once confirmed (a warm process then lives on, and the processes
        its turn started die: `end_turn`); without one, the process group gets SIGINT
        and the confirmation is the process's exit. Call it shielded, with a deadline of
        at least ``grace_s + REAP_S``.
        """
        confirmed = False
        if self.alive:
            # (noqa, ASYNC912: with no interrupt to send there is nothing to await here.)
            with trio.move_on_after(grace_s):  # noqa: ASYNC912
                if interrupt is not None:
                    try:
                        confirmed = await interrupt()
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        confirmed = False   # it has gone already
                    except RelayError as exc:   # its output cannot be followed
                        logger.info("%s: no confirmed interrupt: %s", self.name, exc.message)
                        confirmed = False
                else:
                    self.signal_group(signal.SIGINT)
                    await self.proc.wait()
                    confirmed = True
        if interrupt is None or not confirmed:
            await self.aclose()
        else:
            await self.end_turn()
        return confirmed

    async def begin_turn(self) -> None:
        """A warm process's turn begins. At its first turn, the processes it has (itself
        and those under it: a launcher's native binary) become its own, which outlive
        every turn; whatever else of its run is alive at `end_turn` dies then."""
        if _LINUX and not self._closed and self._own is None:
            # Shielded (and bounded): a stop lands in the turn itself, never between the
            # pool handing the process out and the turn beginning.
            with trio.CancelScope(shield=True), trio.move_on_after(REAP_S):
                self._own = await trio.to_thread.run_sync(
                    functools.partial(_attached, self.pid), abandon_on_cancel=True)

    async def end_turn(self) -> None:
        """A warm process's turn has ended: kill every process of its run but the process
        itself and its own (`begin_turn`; without it: those under it now). Bounded by
        `REAP_S`, shielded."""
        if not _LINUX or self._closed:
            return
        with trio.CancelScope(shield=True), trio.move_on_after(REAP_S):
            own = self._own
            if own is None:
                own = await trio.to_thread.run_sync(
                    functools.partial(_attached, self.pid), abandon_on_cancel=True)
            await self._contain(own)

    async def aclose(self) -> None:
        """Kill the tool and every process of its run, and reap it (bounded by
        `REAP_S`)."""
        if self._closed:
            return
        self._closed = True
        self.signal_group(signal.SIGKILL)
        try:
            with trio.CancelScope(shield=True), trio.move_on_after(REAP_S):
                await self._contain(frozenset())
                await self.proc.wait()
                if self.proc.stdin is not None:
                    await self.proc.stdin.aclose()
                if self.proc.stdout is not None:
                    await self.proc.stdout.aclose()
        finally:
            _live_runs.discard(self.run)
            if self.proc.returncode is not None:
                _owned.pop(self.pid, None)
            self._stderr.close()

    async def _contain(self, spare: frozenset[tuple[int, int]]) -> None:
        """SIGKILL every process of this run but ``spare`` ((pid, start time) pairs) until
        none is left alive; the caller bounds it. Linux only (elsewhere: nothing)."""
        if not _LINUX:
            return
        delay = _GONE_POLL_S
        sweep = functools.partial(_sweep, self.pid, self.started, self.run, spare,
                                  is_subreaper())
        while True:
            _forget_reaped()
            left = await trio.to_thread.run_sync(sweep, abandon_on_cancel=True)
            if not left:
                return
            logger.debug("%s (pid %d): killed or reaping %s of its run", self.name,
                         self.pid, left)
            await trio.sleep(delay)
            delay = min(delay * 2, 0.05)
