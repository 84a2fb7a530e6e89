"""The RESP2 wire format, as relay's Redis client (`relay.redis.resp`) speaks it: commands
encoded as arrays of bulk strings, and replies parsed off a stream, in order.

Replies are parsed by ``hiredis``'s `Reader` (sans-IO, incremental, in C), configured
with relay's error classes: an error reply is a `RespError` object, inside an array too
(a script's reply may hold one). Where hiredis has no wheel, `PyParser` does the same in
Python, incrementally too: each element is parsed once, as it completes, and a reply
that has only partly arrived resumes where it stopped (a 2 MiB array costs twice a
1 MiB one, never four times; ``tests/redis/test_resp_parser.py`` measures it).
"""

from __future__ import annotations

from typing import Any, Protocol

import trio

try:
    import hiredis
    HAVE_HIREDIS = True
except ImportError:  # pragma: no cover - hiredis has wheels where relay runs
    HAVE_HIREDIS = False

__all__ = ["HAVE_HIREDIS", "MAX_REPLY_BYTES", "ConnectionLost", "HiredisParser", "PyParser",
           "Reader", "RespError", "encode", "new_parser"]

MAX_REPLY_BYTES = 8 * 1024 * 1024  # a reply longer than this is a server gone wrong
MAX_DEPTH = 32  # arrays nested deeper than this: not a server of ours


class RespError(Exception):
    """The server answered an error (``-ERR …``, ``-NOSCRIPT …``, ``-WRONGPASS …``)."""

    @property
    def code(self) -> str:
        return str(self).partition(" ")[0]


class ConnectionLost(ConnectionError):
    """The connection could not be made, or broke, before the reply came."""


def encode(args: tuple[Any, ...]) -> bytes:
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        data = arg if isinstance(arg, bytes) else str(arg).encode()
        parts += (b"$%d\r\n" % len(data), data, b"\r\n")
    return b"".join(parts)


_NOT_YET: Any = object()  # a parser's "not all of a reply has arrived"


def _not_resp(detail: str = "") -> ConnectionLost:
    return ConnectionLost("the coordination server sent a reply that is not RESP" + detail)


class Parser(Protocol):
    def feed(self, data: bytes | bytearray) -> None: ...
    def gets(self) -> Any: ...  # one reply, or _NOT_YET


class _HiredisProtocolError(Exception):
    pass


class HiredisParser:
    """``hiredis.Reader``: replies as str (UTF-8, errors replaced), `RespError` objects."""

    def __init__(self) -> None:
        self._reader = hiredis.Reader(protocolError=_HiredisProtocolError,
                                      replyError=RespError, notEnoughData=_NOT_YET,
                                      encoding="utf-8", errors="replace")

    def feed(self, data: bytes | bytearray) -> None:
        self._reader.feed(bytes(data))

    def gets(self) -> Any:
        try:
            return self._reader.gets()
        except _HiredisProtocolError as exc:
            raise _not_resp(f" ({exc})") from exc


class PyParser:
    """The fallback: RESP2 in Python, incremental. ``_pos`` is where the next element
    starts in ``_buf``; ``_stack`` holds the arrays still being filled (each: its items
    and how many it still needs). Consumed bytes are dropped once they outweigh the rest,
    so the buffer's copying stays linear too."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._pos = 0
        self._stack: list[tuple[list[Any], int]] = []

    def feed(self, data: bytes | bytearray) -> None:
        if self._pos and self._pos >= len(self._buf) - self._pos:
            del self._buf[:self._pos]
            self._pos = 0
        self._buf += data

    def gets(self) -> Any:
        while True:
            value = self._element()
            if value is _NOT_YET:
                return _NOT_YET
            if isinstance(value, _Open):
                if len(self._stack) >= MAX_DEPTH:
                    raise ConnectionLost("the coordination server sent a reply nested "
                                         "too deeply")
                self._stack.append(([], value.count))
                continue
            while self._stack:  # a complete element: into its array, closing full ones
                items, _ = self._stack[-1]
                items.append(value)
                if len(items) < self._stack[-1][1]:
                    break
                self._stack.pop()
                value = items
            else:
                return value

    def _element(self) -> Any:
        """One element at ``_pos`` (an `_Open` for a non-empty array), or _NOT_YET."""
        buf, pos = self._buf, self._pos
        end = buf.find(b"\r\n", pos)
        if end < 0:
            return _NOT_YET
        kind, line, start = buf[pos], bytes(buf[pos + 1:end]), end + 2
        try:
            if kind == 0x2B:  # +simple
                value: Any = line.decode(errors="replace")
            elif kind == 0x2D:  # -error
                value = RespError(line.decode(errors="replace"))
            elif kind == 0x3A:  # :integer
                value = int(line)
            elif kind == 0x24:  # $bulk
                size = int(line)
                if size < 0:
                    value = None
                else:
                    if len(buf) < start + size + 2:
                        return _NOT_YET
                    value = bytes(buf[start:start + size]).decode(errors="replace")
                    start += size + 2
            elif kind == 0x2A:  # *array
                count = int(line)
                value = None if count < 0 else [] if count == 0 else _Open(count)
            else:
                raise _not_resp(f" (type byte {kind!r})")
        except ValueError as exc:
            raise _not_resp() from exc
        self._pos = start
        return value


class _Open:
    """An array's header: ``count`` elements follow."""

    __slots__ = ("count",)

    def __init__(self, count: int) -> None:
        self.count = count


def new_parser(prefer_hiredis: bool = True) -> Parser:
    return HiredisParser() if prefer_hiredis and HAVE_HIREDIS else PyParser()


class Reader:
    """Replies off one stream, in order."""

    def __init__(self, stream: trio.abc.Stream, parser: Parser | None = None) -> None:
        self.stream = stream
        self._parser = parser if parser is not None else new_parser()
        self._pending = 0  # bytes read since the last whole reply (about: see `reply`)

    async def reply(self) -> Any:
        while True:
            value = self._parser.gets()
            if value is not _NOT_YET:
                # (Bytes of the next replies may be in the buffer already: the cap below
                # counts from here, so it is off by at most one read.)
                self._pending = 0
                return value
            if self._pending > MAX_REPLY_BYTES:
                raise ConnectionLost(f"the coordination server sent a reply of more than "
                                     f"{MAX_REPLY_BYTES} bytes")
            data = await self.stream.receive_some(65536)
            if not data:
                raise ConnectionLost("the coordination server closed the connection")
            self._pending += len(data)
            self._parser.feed(data)
