"""The upstream client's pool (relay/api/pool.py, `DirectPool`: httpcore's HTTP/1.1
connections, pooled by relay; `CorkedStream`: a request's head and body in one write)
and its cookie jar (none kept).

Real sockets: a tiny HTTP/1.1 server on loopback that counts its connections and can
close a keep-alive connection right after answering (as a server whose keep-alive
timeout passed does), and relay's own client, `make_client`.
"""

from __future__ import annotations

import httpcore
import pytest
import trio
from helpers.pool_server import BODY, Server, _client, _get, idle_connections

from relay.api.http import HTTPSettings, make_client
from relay.api.pool import CorkedBackend, CorkedStream, DirectPool


async def test_the_plain_pool_is_lean_and_a_connection_is_reused(server: Server) -> None:
    async with _client(server.port) as client:
        assert type(client._pool) is DirectPool
        for _ in range(20):
            assert await _get(client, server.port) == BODY
    assert server.connections == 1


async def test_a_proxy_pool_is_left_alone() -> None:
    client = make_client(HTTPSettings(proxy="http://127.0.0.1:9"))
    async with client:
        assert type(client._pool) is not DirectPool


async def test_concurrent_requests_stay_within_max_connections(server: Server) -> None:
    server.hold = True
    async with _client(server.port, max_connections=2) as client:
        async with trio.open_nursery() as nursery:
            for _ in range(5):
                nursery.start_soon(_get, client, server.port)
            with trio.fail_after(5):
                while server.holding < 2:
                    await trio.sleep(0.005)
            pool = client._pool
            with trio.fail_after(5):  # the 3 others wait in the pool for a connection
                while pool.waiting < 3:
                    await trio.sleep(0.005)
            assert server.connections == 2
            assert pool.connections == 2
            server.release.set()
        for _ in range(5):  # then the two connections serve everything
            await _get(client, server.port)
    assert server.connections == 2


async def test_a_connection_the_server_closed_while_idle_is_not_reused(
        server: Server) -> None:
    """Within the sweep interval too: the expiry check before reuse sees the EOF."""
    server.close_after_answer = True
    async with _client(server.port) as client:
        for i in range(5):
            assert await _get(client, server.port) == BODY
            with trio.fail_after(5):
                while server.open:  # the server has closed the one it answered on
                    await trio.sleep(0.005)
            assert server.connections == i + 1


async def test_an_upstream_cookie_is_not_sent_back(server: Server) -> None:
    """One client serves every caller of a provider: a cookie set in one answer must not
    ride along on the next caller's request."""
    server.set_cookie = True
    async with _client(server.port) as client:
        await _get(client, server.port)
        await _get(client, server.port)
    assert len(server.heads) == 2
    assert b"cookie:" not in server.heads[1]


class _Recorded(trio.abc.Stream):
    """The socket side of a connection, recording each write (and failing on request)."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.fail_writes = False

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await trio.lowlevel.checkpoint()
        if self.fail_writes:
            raise trio.BrokenResourceError("the server is gone")
        self.writes.append(bytes(data))

    async def wait_send_all_might_not_block(self) -> None:
        await trio.lowlevel.checkpoint()

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        await trio.lowlevel.checkpoint()
        return b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"

    async def aclose(self) -> None:
        await trio.lowlevel.checkpoint()


HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n"


async def test_a_request_head_leaves_with_its_body_in_one_write() -> None:
    inner = _Recorded()
    stream = CorkedStream(inner)
    await stream.write(HEAD)
    await stream.write(b"{}")
    await stream.write(b"")  # h11's end of message, for a content-length body
    assert inner.writes == [HEAD + b"{}"]
    get = b"GET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n"
    await stream.write(get)
    await stream.write(b"")
    assert inner.writes == [HEAD + b"{}"]  # held until the answer is awaited
    assert (await stream.read(100)).startswith(b"HTTP/1.1 200")
    assert inner.writes == [HEAD + b"{}", get]


async def test_a_held_head_that_cannot_be_written() -> None:
    inner = _Recorded()
    inner.fail_writes = True
    stream = CorkedStream(inner)
    await stream.write(HEAD)
    with pytest.raises(httpcore.WriteError):  # with its body: the write's own failure
        await stream.write(b"{}")
    await stream.write(HEAD)
    await stream.read(100)  # before the answer: dropped, as httpcore drops it, and read


async def test_a_post_through_the_corked_pool(server: Server) -> None:
    async with _client(server.port) as client:
        pool = client._pool
        assert isinstance(pool._network_backend, CorkedBackend)
        for _ in range(3):
            assert await _get(client, server.port) == BODY
    assert server.connections == 1


async def test_a_cancelled_close_still_closes_every_connection(server: Server) -> None:
    """A relay stopping closes its clients inside a cancelled scope: every pooled
    connection is closed all the same, not only the first one tried."""
    client = _client(server.port, max_connections=3)
    await idle_connections(client, server, 3)
    assert client._pool.connections == 3
    with trio.CancelScope() as scope:
        scope.cancel()
        await client.aclose()
    with trio.fail_after(5):
        while server.open:
            await trio.sleep(0.005)
    assert client._pool.connections == 0


async def test_sweeps_and_requests_side_by_side(server: Server) -> None:
    """A sweep closes expired idle connections while other requests take idle ones: each
    connection is closed once and given to one request at a time (a sweep that removed
    them one by one across its awaits failed with ValueError under load)."""
    async with _client(server.port, max_connections=8) as client:
        pool = client._pool
        pool.SWEEP_S = 0.0  # every request sweeps
        pool._keepalive_expiry = 0.0  # and every idle connection has expired

        async def worker() -> None:
            for _ in range(15):
                assert await _get(client, server.port) == BODY

        async with trio.open_nursery() as nursery:
            for _ in range(16):
                nursery.start_soon(worker)
        assert pool.connections <= 8
