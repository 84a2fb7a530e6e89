"""A small TCP proxy of the tests' own between relay and a real ``redis-server`` (SPEC O6),
in the test's trio run, on a free loopback port: what a NAT, a load balancer or a managed
service's "same name" does to relay's connections, on demand.

- `drop_reply_once(marker)`: the first command whose bytes hold ``marker`` reaches the
  server, which runs it; its reply (with whatever else came in the same read) is dropped
  and the connection closed both ways — a reply lost with its connection;
- `blackhole_subscriptions()`: every connection that sent ``SUBSCRIBE`` stops forwarding
  either way while its sockets stay open — a NAT that silently forgot it;
- `retarget(port)`: new connections go to another server (the managed name now points
  at the promoted replica); old ones are left as they are unless `close_all` is called.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import AsyncIterator

import attrs
import trio

__all__ = ["RedisProxy", "open_proxy"]


@attrs.define(eq=False)
class _Link:
    client: trio.SocketStream
    server: trio.SocketStream
    subscriber: bool = False
    blackholed: bool = False
    drop_next_reply: bool = False
    scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)


class RedisProxy:
    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self.links: list[_Link] = []
        self._drop_marker: bytes | None = None
        self.dropped = trio.Event()  # a reply was dropped (`drop_reply_once`)
        self.connections = 0  # accepted so far

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def drop_reply_once(self, marker: bytes) -> None:
        self._drop_marker = marker

    def blackhole_subscriptions(self) -> int:
        n = 0
        for link in self.links:
            if link.subscriber and not link.blackholed:
                link.blackholed = True
                n += 1
        return n

    def retarget(self, port: int) -> None:
        self.target_port = port

    def close_all(self) -> None:
        for link in self.links:
            link.scope.cancel()

    async def _handle(self, client: trio.SocketStream) -> None:
        self.connections += 1
        try:
            server = await trio.open_tcp_stream("127.0.0.1", self.target_port)
        except OSError:
            await client.aclose()
            return
        link = _Link(client, server)
        self.links.append(link)
        try:
            with link.scope:
                async with client, server, trio.open_nursery() as nursery:
                    nursery.start_soon(self._up, link, nursery.cancel_scope)
                    nursery.start_soon(self._down, link, nursery.cancel_scope)
        finally:
            self.links.remove(link)

    async def _up(self, link: _Link, scope: trio.CancelScope) -> None:
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            while data := await link.client.receive_some(65536):
                if b"SUBSCRIBE" in data.upper():
                    link.subscriber = True
                if link.blackholed:
                    continue
                if self._drop_marker is not None and self._drop_marker in data:
                    self._drop_marker = None
                    link.drop_next_reply = True
                await link.server.send_all(data)
        scope.cancel()

    async def _down(self, link: _Link, scope: trio.CancelScope) -> None:
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            while data := await link.server.receive_some(65536):
                if link.blackholed:
                    continue
                if link.drop_next_reply:
                    self.dropped.set()
                    break  # the server ran it; its reply goes nowhere, the link closes
                await link.client.send_all(data)
        scope.cancel()


@contextlib.asynccontextmanager
async def open_proxy(target_port: int) -> AsyncIterator[RedisProxy]:
    proxy = RedisProxy(target_port)
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(functools.partial(
            trio.serve_tcp, proxy._handle, 0, host="127.0.0.1"))
        proxy.port = listeners[0].socket.getsockname()[1]
        try:
            yield proxy
        finally:
            proxy.close_all()
            nursery.cancel_scope.cancel()
