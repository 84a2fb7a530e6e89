"""A tiny HTTP/1.1 server on a free loopback port for the pool's tests: it counts its
connections and answers as told."""

from __future__ import annotations

from typing import Any

import trio

from relay.api.http import HTTPSettings, make_client

BODY = b'{"ok":true}'


class Server:
    def __init__(self) -> None:
        self.port = 0
        self.connections = 0
        self.open = 0
        self.close_after_answer = False
        self.release = trio.Event()
        self.hold = False
        self.holding = 0
        self.set_cookie = False
        self.heads: list[bytes] = []

    async def handle(self, stream: trio.SocketStream) -> None:
        self.connections += 1
        self.open += 1
        buf = b""
        try:
            while True:
                while b"\r\n\r\n" not in buf:
                    data = await stream.receive_some(65536)
                    if not data:
                        return
                    buf += data
                head, _, buf = buf.partition(b"\r\n\r\n")  # GETs: no body
                self.heads.append(head.lower())
                if self.hold:
                    self.holding += 1
                    await self.release.wait()
                cookie = b"set-cookie: session=S1; Path=/\r\n" if self.set_cookie else b""
                await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                                      b"%scontent-length: %d\r\n\r\n%s"
                                      % (cookie, len(BODY), BODY))
                if self.close_after_answer:
                    return
        finally:
            self.open -= 1
            await stream.aclose()


async def serve(nursery: trio.Nursery) -> Server:
    """The server, listening on a free loopback port (also tests/api/test_pool_races.py's)."""
    srv = Server()
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    srv.port = listeners[0].socket.getsockname()[1]
    await nursery.start(trio.serve_listeners, srv.handle, listeners)
    return srv


async def idle_connections(client: Any, server: Server, n: int) -> None:
    """``n`` requests held by the server at once, then answered: ``n`` idle connections
    (also tests/api/test_pool_races.py's)."""
    server.hold, server.holding, server.release = True, 0, trio.Event()
    async with trio.open_nursery() as nursery:
        for _ in range(n):
            nursery.start_soon(_get, client, server.port)
        with trio.fail_after(5):
            while server.holding < n:
                await trio.sleep(0.005)
        server.release.set()
    server.hold = False


def _client(port: int, max_connections: int = 4):  # type: ignore[no-untyped-def]
    return make_client(HTTPSettings(base_url=f"http://127.0.0.1:{port}"),
                       max_connections=max_connections)


async def _get(client, port: int) -> bytes:  # type: ignore[no-untyped-def]
    async with client.stream("GET", f"http://127.0.0.1:{port}/x") as resp:
        assert resp.status_code == 200
        return b"".join([piece async for piece in resp.aiter_raw()])
