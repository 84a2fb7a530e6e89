"""Shared lanes (SPEC L11, O6) on the servers teams run, with real processes and a TCP
proxy of the test's own (`redis_proxy`): a release whose reply was lost with its
connection, a managed failover behind the same name (``REPLICAOF`` switched, the primary
answering ``READONLY``), a subscription a NAT silently forgot. Leases are short and real;
every wait is on a condition, bounded."""

from __future__ import annotations

import contextlib
import hashlib
from pathlib import Path
from typing import Any

import httpx
import trio
from conftest import records, start_relay, wait_for
from redis_proxy import open_proxy
from redis_server import RedisServer, redis_fixture  # noqa: F401
from shared_helpers import body, shared_config
from upstream import FakeUpstream

from relay import Served
from relay.engine import shared_scripts


def lane(served: Served) -> Any:
    return served.relay.providers["up"].lane


def sha(script: str) -> bytes:
    return hashlib.sha1(script.encode()).hexdigest().encode()


async def test_a_release_whose_reply_was_lost_is_not_recorded_as_expired(
        tmp_path: Path, redis: RedisServer, upstream: FakeUpstream,
        client: httpx.AsyncClient) -> None:
    async with open_proxy(redis.port) as proxy, trio.open_nursery() as nursery:
        served = await start_relay(nursery, shared_config(upstream, proxy.url, "r", lanes=2),
                                   tmp_path)
        # The first request loads the scripts (EVAL after NOSCRIPT); the second's
        # RELEASE then goes by EVALSHA, runs on the server, and its reply is lost.
        r = await client.post(f"{served.url}/v1/chat/completions", json=body("up/m1"))
        assert r.status_code == 200
        proxy.drop_reply_once(sha(shared_scripts.RELEASE))
        r = await client.post(f"{served.url}/v1/chat/completions", json=body("up/m1"))
        assert r.status_code == 200
        assert proxy.dropped.is_set()
        await wait_for(lambda: len(records(tmp_path)) == 2)
        second = records(tmp_path)[1]
        assert second["status"] == 200
        assert "lease_expired" not in second["attempts"][0], second
        assert redis.command("ZCARD", "{relay:up}:h") == b":0\r\n"
        await wait_for(lambda: lane(served).statistics().running == 0)
        nursery.cancel_scope.cancel()


async def post(client: httpx.AsyncClient, url: str, model: str,
               out: list[Any] | None = None) -> None:
    with contextlib.suppress(httpx.TransportError):
        r = await client.post(f"{url}/v1/chat/completions", json=body(model))
        if out is not None:
            out.append(r)
