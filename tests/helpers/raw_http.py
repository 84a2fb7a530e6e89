"""Raw HTTP/1.1 on a loopback socket: a request written by hand, a response read up to a
marker, a connection closed at a chosen moment."""

from __future__ import annotations

import json
import socket
import struct
from typing import Any

import trio

BOUND_S = 0.5


async def raw_post(url: str, body: dict[str, Any], *, rcvbuf: int | None = None
                   ) -> trio.SocketStream:
    host, _, port = url.removeprefix("http://").partition(":")
    sock = trio.socket.socket(trio.socket.AF_INET, trio.socket.SOCK_STREAM)
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    await sock.connect((host, int(port)))
    stream = trio.SocketStream(sock)
    data = json.dumps(body).encode()
    await stream.send_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: " + host.encode()
                          + b"\r\nContent-Type: application/json\r\nContent-Length: "
                          + str(len(data)).encode() + b"\r\n\r\n" + data)
    return stream


async def read_until(stream: trio.SocketStream, marker: bytes) -> bytes:
    seen = b""
    with trio.fail_after(5):
        while marker not in seen:
            chunk = await stream.receive_some(65536)
            assert chunk, f"closed before {marker!r}: {seen!r}"
            seen += chunk
    return seen


async def close(stream: trio.SocketStream, how: str) -> float:
    if how == "rst":  # SO_LINGER 0: the kernel sends RST instead of FIN
        stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    await stream.aclose()
    return trio.current_time()
