"""The RESP2 wire format, as relay's Redis client (`relay.engine.resp`) speaks it: commands
encoded as arrays of bulk strings, and replies parsed off a stream, in order."""

from __future__ import annotations

from typing import Any

import trio

__all__ = ["MAX_REPLY_BYTES", "ConnectionLost", "Reader", "RespError", "encode"]

MAX_REPLY_BYTES = 8 * 1024 * 1024  # a reply longer than this is a server gone wrong


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


class _Incomplete(Exception):  # not all of a reply has arrived yet
    pass


def _parse(buf: bytearray, pos: int) -> tuple[Any, int]:
    """One RESP2 reply from ``buf`` at ``pos``, and where the next begins (`_Incomplete`:
    not all of it has arrived; `ConnectionLost`: it is not RESP)."""
    end = buf.find(b"\r\n", pos)
    if end < 0:
        raise _Incomplete
    kind, line, pos = buf[pos], bytes(buf[pos + 1:end]), end + 2
    try:
        if kind == 0x2B:  # +simple
            return line.decode(), pos
        if kind == 0x2D:  # -error
            return RespError(line.decode(errors="replace")), pos
        if kind == 0x3A:  # :integer
            return int(line), pos
        if kind == 0x24:  # $bulk
            size = int(line)
            if size < 0:
                return None, pos
            if len(buf) < pos + size + 2:
                raise _Incomplete
            return bytes(buf[pos:pos + size]).decode(errors="replace"), pos + size + 2
        if kind == 0x2A:  # *array
            count = int(line)
            if count < 0:
                return None, pos
            items = []
            for _ in range(count):
                item, pos = _parse(buf, pos)
                items.append(item)
            return items, pos
    except ValueError as exc:
        raise ConnectionLost("the coordination server sent a reply that is not RESP") from exc
    raise ConnectionLost(f"the coordination server sent a reply that is not RESP "
                         f"(type byte {kind!r})")


class Reader:
    """Replies off one stream, in order."""

    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = stream
        self._buf = bytearray()

    async def reply(self) -> Any:
        while True:
            if self._buf:
                try:
                    value, used = _parse(self._buf, 0)
                except _Incomplete:
                    pass
                except RecursionError as exc:  # nested past reason: not a server of ours
                    raise ConnectionLost("the coordination server sent a reply nested too "
                                         "deeply") from exc
                else:
                    del self._buf[:used]
                    return value
            if len(self._buf) > MAX_REPLY_BYTES:
                raise ConnectionLost(f"the coordination server sent a reply of more than "
                                     f"{MAX_REPLY_BYTES} bytes")
            data = await self.stream.receive_some(65536)
            if not data:
                raise ConnectionLost("the coordination server closed the connection")
            self._buf += data
