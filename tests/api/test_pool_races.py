"""`DirectPool` under cancels and odd URLs (a second read of the pool found each of these;
every test here failed on the pool as first written).

Real sockets, the tiny server of tests/api/test_pool.py.
"""

from __future__ import annotations

import gc
import warnings
from typing import Any

import httpx
import pytest
import trio
from helpers.pool_server import BODY, Server, _client, _get, idle_connections, serve

from relay.api.http import HTTPSettings, UpstreamClient, make_client, transport_errors
from relay.api.pool import CorkedBackend, DirectPool
from relay.vocab.errors import RelayError


@pytest.fixture
async def server(nursery: trio.Nursery) -> Server:
    return await serve(nursery)


async def test_a_request_cancelled_while_the_sweep_closes_loses_no_slot(
        server: Server) -> None:
    client = _client(server.port, max_connections=2)
    async with client:
        pool = client._pool
        await idle_connections(client, server, 2)
        assert pool.connections == 2
        for idle in pool._idle.values():  # both past their keep-alive, a sweep due
            for connection in idle:
                connection._expire_at = 0.0
        pool._swept_at = -1e9
        with trio.CancelScope() as scope:  # a client gone as the sweep runs
            scope.cancel()
            await _get(client, server.port)
        assert pool.connections == 0
        # and two requests at once get their two connections (no slot held by a ghost)
        client._extensions["timeout"]["pool"] = 2.0
        await idle_connections(client, server, 2)
        assert pool.connections == 2


class _CancelAfterConnect(CorkedBackend):
    """Cancels the request's scope as its connection is made, so the cancel lands on
    httpcore's first checkpoint, before its own cleanup guards the connection."""

    scope: trio.CancelScope | None = None

    async def connect_tcp(self, *args: Any, **kwargs: Any) -> Any:
        stream = await super().connect_tcp(*args, **kwargs)
        if self.scope is not None:
            self.scope.cancel()
        return stream


async def test_a_new_connection_cancelled_before_its_request_is_closed(
        server: Server) -> None:
    backend = _CancelAfterConnect()
    pool = DirectPool(max_connections=4, keepalive_expiry=5.0,
                      ssl_context=httpx.create_ssl_context, network_backend=backend)
    client = UpstreamClient(pool, {"connect": 5.0, "read": None, "write": 5.0, "pool": 5.0})
    async with client:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with trio.CancelScope() as scope:
                backend.scope = scope
                await _get(client, server.port)
            assert scope.cancelled_caught
            assert pool.connections == 0
            gc.collect()
        assert not [w for w in caught if issubclass(w.category, ResourceWarning)]
    with trio.fail_after(5):
        while server.open:  # the server saw it closed
            await trio.sleep(0.005)


@pytest.mark.parametrize("url", ["http://:8080/v1/chat/completions", "http:///v1/models"])
async def test_a_base_url_without_a_host_is_a_base_url_to_fix(url: str) -> None:
    async with make_client(HTTPSettings(connect_timeout_s=2)) as client:
        with pytest.raises(RelayError) as info, transport_errors("p"):
            async with client.stream("POST", url, json={}):
                pass
    assert isinstance(info.value.__cause__, httpx.UnsupportedProtocol)
    assert "base_url" in (info.value.action or "")


async def test_a_closed_client_refuses_requests(server: Server) -> None:
    client = _client(server.port)
    async with client:
        assert await _get(client, server.port) == BODY
    with pytest.raises(RuntimeError):
        await _get(client, server.port)
    assert server.connections == 1


async def test_a_providers_own_content_type_is_kept(server: Server) -> None:
    own = {"Content-Type": "application/json; charset=utf-8"}
    async with _client(server.port) as client, client.stream(
            "POST", f"http://127.0.0.1:{server.port}/x", json={}, headers=own):
        pass
    assert b"content-type: application/json; charset=utf-8" in server.heads[-1]
