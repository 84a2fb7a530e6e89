"""trio operations without the trip through the scheduler when nothing has to wait.

trio yields after every operation, even one that did not wait; on relay's request path
most do not (a channel with room, a free lock, a socket that takes a write whole). Each
helper here is a cancel point as trio's own (``checkpoint_if_cancelled``: a cancelled
task does nothing), then the non-blocking form, and trio's own form when it must wait.
The schedule point is the caller's next real wait.
"""

from __future__ import annotations

import os
from typing import Any, TypeVar

import trio

__all__ = ["acquire", "receive", "send", "send_all", "write_now"]

T = TypeVar("T")


async def send(channel: trio.MemorySendChannel[T], value: T) -> None:
    await trio.lowlevel.checkpoint_if_cancelled()
    try:
        channel.send_nowait(value)
    except trio.WouldBlock:
        await channel.send(value)


async def receive(channel: trio.MemoryReceiveChannel[T]) -> T:
    """Raises: trio.EndOfChannel, as ``channel.receive``."""
    await trio.lowlevel.checkpoint_if_cancelled()
    try:
        return channel.receive_nowait()
    except trio.WouldBlock:
        return await channel.receive()


async def acquire(lock: trio.Lock) -> None:
    await trio.lowlevel.checkpoint_if_cancelled()
    try:
        lock.acquire_nowait()
    except trio.WouldBlock:
        await lock.acquire()


async def send_all(stream: trio.abc.Stream, data: Any) -> None:
    """``stream.send_all(data)``; what a socket takes whole at once is written directly
    (on loopback a write almost never waits), what it does not by ``send_all``, which
    waits for room. The caller is the stream's one writer."""
    await trio.lowlevel.checkpoint_if_cancelled()
    sent = write_now(stream, data)
    if sent < len(data):
        await stream.send_all(memoryview(data)[sent:] if sent else data)


def write_now(stream: trio.abc.Stream, data: Any) -> int:
    """Write what a socket stream takes at once, without waiting (no cancel point: call
    it after one); how many bytes that was — 0 for another kind of stream, or when the
    socket has no room. A caller that bounds the rest in time opens its deadline scope
    only when some is left: on loopback, almost never. Raises trio's errors, as
    ``send_all`` would: ``ClosedResourceError``, ``BrokenResourceError``."""
    if not data or type(stream) is not trio.SocketStream or stream.socket.did_shutdown_SHUT_WR:
        return 0
    fd = stream.socket.fileno()
    if fd == -1:
        raise trio.ClosedResourceError("the socket was already closed")
    try:
        return os.write(fd, data)
    except BlockingIOError:
        return 0
    except OSError as exc:  # the peer is gone (EPIPE, ECONNRESET): as send_all says it
        raise trio.BrokenResourceError(f"socket connection broken: {exc}") from exc
