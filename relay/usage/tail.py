"""Reading a records file, and the ones it rotated to, from where the database stopped.

A records file only grows (one ``write(2)`` of whole lines at a time, SPEC O5) until it
rotates: ``records`` → ``records.1`` → … (renamed, so its content stays as it was). A
file is known by its first line — it never changes, whatever name the file has now — so
a position is (the file's first line's hash, the offset read up to). Reading from a
position finds that file among the rotated ones and goes on from the offset, then
through every newer file; when no file has it (it rotated out while nobody read, or the
files were removed), every file there is newer than it and is read whole. A database
made anew (no position) reads every file, oldest first: the rebuild.

Only whole lines are read (up to the last newline): the line being written is read next
time. A line that does not parse (what a crash left mid-write) is skipped.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

__all__ = ["FIRST_LINE_MAX", "Chunk", "files", "identity", "read"]

FIRST_LINE_MAX = 1 << 20  # a first line longer than this is no record: the file is skipped


def files(path: Path) -> list[Path]:
    """A records file and its rotated ones that exist, oldest first."""
    rotated = re.compile(re.escape(path.name) + r"\.(\d+)\Z")
    found: list[tuple[int, Path]] = []
    try:
        names = os.listdir(path.parent)
    except OSError:
        return []
    for name in names:
        if (m := rotated.match(name)) is not None:
            found.append((-int(m[1]), path.with_name(name)))
    found.sort()
    return [p for _, p in found] + ([path] if path.exists() else [])


def identity(fd: int) -> str | None:
    """A file's identity: the hash of its first line (None: no whole line yet)."""
    head = b""
    while len(head) < FIRST_LINE_MAX:
        data = os.pread(fd, 65536, len(head))
        if not data:
            return None
        cut = data.find(b"\n")
        if cut >= 0:
            return hashlib.sha1(head + data[:cut + 1]).hexdigest()
        head += data
    return None


class Chunk:
    """What one `read` found: whole lines, and the position after them."""

    def __init__(self, lines: list[bytes], file: str | None, offset: int,
                 behind: int) -> None:
        self.lines, self.file, self.offset = lines, file, offset
        self.behind = behind  # bytes of whole and partial lines left to read after these


def read(path: Path, file: str | None, offset: int, max_bytes: int) -> Chunk:
    """Whole lines after the position (``file``, ``offset``), about ``max_bytes`` of
    them at most (at least one line when there is one), through the rotated files
    oldest first."""
    for _ in range(5):
        chunk = _read(path, file, offset, max_bytes)
        if chunk is not None:
            return chunk
    return Chunk([], file, offset, 0)  # rotating again and again: next time


def _inodes(names: list[Path]) -> list[int]:
    out = []
    for name in names:
        try:
            out.append(os.stat(name).st_ino)
        except OSError:
            out.append(-1)
    return out


def _read(path: Path, file: str | None, offset: int, max_bytes: int) -> Chunk | None:
    """`read`, or None when the files rotated while they were opened."""
    opened: list[int] = []
    try:
        # (identity, descriptor, from, size) of the files after the position
        todo: list[tuple[str, int, int, int]] = []
        names = files(path)
        for each in names:
            try:
                fd = os.open(each, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
            except OSError:
                return None  # rotated away meanwhile
            opened.append(fd)
        if [os.fstat(fd).st_ino for fd in opened] != _inodes(names) or files(path) != names:
            return None  # a rotation in between: what each name is was not one moment's
        for fd in opened:
            ident = identity(fd)
            if ident is None:
                continue
            size = os.fstat(fd).st_size
            if ident == file:   # the file read last: what is older is read already
                todo = [(ident, fd, min(offset, size), size)]
            else:
                todo.append((ident, fd, 0, size))
        lines: list[bytes] = []
        taken = behind = 0
        at: tuple[str | None, int] = (file, offset)
        full = False  # read as much as asked: the rest is for next time
        for ident, fd, start, size in todo:
            want = size - start
            if full:
                behind += want
                continue
            data = os.pread(fd, min(want, max(max_bytes - taken, 1)), start)
            whole = data.rfind(b"\n") + 1
            if len(data) < want:
                full = True
                if whole == 0:  # a line longer than what was left to take: that line
                    data = os.pread(fd, want, start)
                    whole = data.find(b"\n") + 1
            # (a rotated file's last line without its newline — a crash mid-write — is
            # never finished: it is left behind with its file)
            lines.extend(data[:whole].split(b"\n")[:-1])
            taken += whole
            at = (ident, start + whole)
            behind += want - whole
        return Chunk(lines, at[0], at[1], behind)
    finally:
        for fd in opened:
            os.close(fd)
