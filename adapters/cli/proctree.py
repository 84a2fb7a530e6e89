"""A CLI tool run's process tree, read from ``/proc`` (Linux; worker threads only: every
function here blocks): which processes belong to a run, and killing and reaping them
(SPEC O5). Used by `adapters._process`."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
from typing import NamedTuple

import trio

logger = logging.getLogger(__name__)

RUN_VAR = "RELAY_TOOL_RUN"     # the run's mark, in every tool's environment
_live_runs: set[str] = set()
_owned: dict[int, trio.Process] = {}
_adopted: set[int] = set()   # adopted processes relay killed or saw dead (see _sweep)


class _Stat(NamedTuple):
    ppid: int
    pgrp: int
    sid: int
    zombie: bool
    start: int   # clock ticks after boot: with the pid, names one process for good


_PF_KTHREAD = 0x00200000


def _stat(pid: int) -> _Stat | None:
    """A process's /proc stat; None when it is gone or a kernel thread."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # pid (comm) state ppid pgrp session tty tpgid flags … starttime — comm may hold
    # spaces and ")".
    fields = stat[stat.rfind(b")") + 2:].split()
    try:
        if int(fields[6]) & _PF_KTHREAD:
            return None
        return _Stat(int(fields[1]), int(fields[2]), int(fields[3]),
                     fields[0] in (b"Z", b"X"), int(fields[19]))
    except (IndexError, ValueError):
        return None


def _processes() -> dict[int, _Stat]:
    found = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return {}
    for entry in entries:
        if entry.isdigit():
            stat = _stat(int(entry))
            if stat is not None:
                found[int(entry)] = stat
    return found


def _run_of(pid: int) -> str | None:
    """The run mark in a process's environment (as it was at its exec), if any."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            data = f.read()
    except OSError:
        return None
    key = RUN_VAR.encode() + b"="
    at = data.find(key)
    while at > 0 and data[at - 1] != 0:
        at = data.find(key, at + 1)
    if at < 0:
        return None
    end = data.find(b"\0", at)
    return data[at + len(key):end if end >= 0 else len(data)].decode("ascii", "replace")


def _exe(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return None


def _attached(pid: int) -> frozenset[tuple[int, int]]:
    """``pid`` and every live process whose parent chain leads to it, as (pid, start)."""
    procs = _processes()
    children: dict[int, list[int]] = {}
    for child, info in procs.items():
        children.setdefault(info.ppid, []).append(child)
    found: set[tuple[int, int]] = set()
    seen: set[int] = set()
    todo = [pid]
    while todo:
        p = todo.pop()
        stat = procs.get(p)
        if stat is None or stat.zombie or p in seen:
            continue
        seen.add(p)
        found.add((p, stat.start))
        todo.extend(children.get(p, ()))
    return frozenset(found)


def _sweep(tool: int, born: int, run: str, spare: frozenset[tuple[int, int]],
           adopt: bool) -> list[int]:
    """One look at every process: SIGKILL those of the run (``tool``, started at
    ``born``, marked ``run``) that are alive and not spared, and (``adopt``: relay is
    the subreaper) reap the zombies relay adopted. Returns what is left to do: the pids
    killed now, and adopted zombies seen for the first time (reaped by the next look)."""
    # long because one pass over /proc must decide each process's fate with the same
    # snapshot (owned, attached, adopted, a run's mark); split, the pieces race.
    me = os.getpid()
    procs = _processes()
    lineage: dict[int, str] = {}

    def line_of(pid: int) -> str:
        """'tool' (``tool`` is on its parent chain), 'other' (another tool relay owns),
        'adopted' (relay adopted it, or an ancestor) or 'none'."""
        path = []
        verdict = "none"
        for _ in range(len(procs) + 1):
            if pid in lineage:
                verdict = lineage[pid]
                break
            if pid == tool:
                verdict = "tool"
                break
            if pid in _owned:
                verdict = "other"
                break
            if pid == me:
                verdict = "adopted"
                break
            stat = procs.get(pid)
            if stat is None or pid <= 1:
                break
            path.append(pid)
            pid = stat.ppid
        for p in path:
            lineage[p] = verdict
        return verdict

    relay_exe = None
    kill: list[int] = []
    left: list[int] = []
    for pid, stat in procs.items():
        if pid == me or (pid, stat.start) in spare:
            continue
        if stat.zombie:
            # An adopted zombie is reaped by pid — never one trio owns, and only once a
            # second look (or our own kill) has shown it is not a tool trio has just
            # started and not yet registered.
            if adopt and stat.ppid == me and pid not in _owned:
                if pid in _adopted:
                    _reap(pid)
                else:
                    _adopted.add(pid)
                    left.append(pid)
            continue
        line = line_of(pid)
        if line == "other":
            continue
        if line == "tool" or stat.sid == tool or stat.pgrp == tool:
            kill.append(pid)
            continue
        if line == "none" and stat.start < born:
            continue   # older than the tool: not of its run (and not adopted)
        mark = _run_of(pid)
        if mark == run:
            kill.append(pid)
        elif (line == "adopted" and adopt and mark not in _live_runs
              and stat.sid not in _owned and stat.pgrp not in _owned):
            relay_exe = relay_exe or _exe(me)
            if _exe(pid) != relay_exe:   # not a fork of relay's own on its way to exec
                kill.append(pid)
    for pid in kill:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue
        except PermissionError:
            logger.warning("process %d (of a tool's run) cannot be killed: not permitted", pid)
            continue
        if adopt and procs[pid].ppid == me and pid not in _owned:
            _adopted.add(pid)
        left.append(pid)
    zombies = {pid for pid, stat in procs.items() if stat.zombie}
    _adopted.intersection_update(zombies | set(kill))
    return left


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
    _adopted.discard(pid)


_LINUX = sys.platform.startswith("linux")
_PR_SET_CHILD_SUBREAPER = 36
_flags = {"subreaper": False}  # changed only on the event loop


def is_subreaper() -> bool:
    return _flags["subreaper"]


def become_subreaper() -> bool:
    """Make this process the child subreaper (Linux ``PR_SET_CHILD_SUBREAPER``): orphans of
    the tools' processes are re-parented to relay, which kills and reaps them (see the
    module docstring). For ``relay serve`` only — an embedding program keeps its own
    process tree. False (and nothing changed) where it is not available."""
    if not _LINUX:
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return False
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong,
                      ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    if prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        logger.warning("cannot become the child subreaper: %s",
                       os.strerror(ctypes.get_errno()))
        return False
    _flags["subreaper"] = True
    return True


def _forget_reaped() -> None:
    """Drop the processes trio has reaped from `_owned` (on the event loop)."""
    for pid, proc in list(_owned.items()):
        if proc.poll() is not None:
            del _owned[pid]
