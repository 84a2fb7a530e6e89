"""A request's objects are freed by their reference counts as it ends, not left for the
cycle collector.

Every reference cycle through a request (a closure over its exchange, an attempt's sink
that points back at its run, hypercorn's connection objects that point at one another)
kept the whole request — exchange, record, dispatcher, channels, tasks, the connection's
parser and buffers — alive until a collection found it: thousands of objects a second
under load, a higher peak of memory, and a heap left fragmented after it (the bench's
"RSS after the load"). These tests run real requests through the assembled relay on
loopback with the collector off, then ask it what it would have had to free.
"""

from __future__ import annotations

import gc
import json
import warnings
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from fakes.upstream import FakeUpstream, Script
from helpers.assembled import chat, lane_idle, records, start_relay, wait_for, with_upstream

from relay.assembly.server import BoundedWriteTCPServer

# What must never wait for the collector: one of each per request or per connection,
# relay's and its server's (the test's own clients and fake upstream are not asked).
PER_REQUEST = {"Exchange", "Chat", "ResponsesChat", "Dispatcher", "Run", "AttemptSink",
               "Record", "RequestStop", "StreamWriter", "JSONWriter", "ResponsesTurn",
               "BoundedWriteTCPServer", "H11Protocol", "HTTPStream", "ProtocolWrapper"}


def relays(obj: Any) -> bool:
    kind = type(obj)
    return kind.__name__ in PER_REQUEST and kind.__module__.startswith(("relay.",
                                                                         "hypercorn."))


@contextmanager
def collector_off() -> Iterator[None]:
    # What earlier tests left for the collector is freed first, and is not this test's to
    # judge: an unclosed socket found there warns in whichever test collects it (the
    # suite's order decides which), and this test is about its own requests' cycles.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.set_debug(0)
        gc.enable()


def cyclic_garbage() -> list[Any]:
    """What a collection now would free (it is freed; the list keeps it for the report)."""
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        found = list(gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    return found


def cycle_through(start: Any, among: list[Any]) -> str:
    """One reference cycle back to ``start`` through ``among``, as type names."""
    ids = {id(o) for o in among}
    came_from: dict[int, Any] = {id(start): None}
    queue = deque([start])
    while queue:
        obj = queue.popleft()
        for ref in gc.get_referents(obj):
            if ref is start:
                path = [obj]
                while came_from[id(path[-1])] is not None:
                    path.append(came_from[id(path[-1])])
                return " -> ".join(getattr(o, "__qualname__", type(o).__qualname__)
                                   for o in [*reversed(path), start])
            if id(ref) in ids and id(ref) not in came_from:
                came_from[id(ref)] = obj
                queue.append(ref)
    return "(reachable from a cycle, not in one)"


def assert_no_request_in_cycles() -> None:
    garbage = cyclic_garbage()
    kept = [o for o in garbage if relays(o)]
    cycles = sorted({cycle_through(o, garbage) for o in kept})
    assert not kept, (f"{len(kept)} per-request objects were left for the cycle collector "
                      f"(of {len(garbage)} in all); their cycles:\n" + "\n".join(cycles))


def connections_ended() -> bool:
    """Every connection relay served is closed (its socket)."""
    return all(o.stream.socket.fileno() == -1 for o in gc.get_objects()
               if isinstance(o, BoundedWriteTCPServer))


async def exercise(client: httpx.AsyncClient, url: str) -> int:
    """Each front, plain and streamed, through the openai adapter; returns how many."""
    bodies: list[tuple[str, dict[str, Any]]] = []
    for stream in (False, True):
        bodies += [
            ("/v1/chat/completions", chat("up/m1", stream=stream)),
            ("/v1/messages", {**chat("up/m1", stream=stream), "max_tokens": 100}),
            ("/v1/responses", {"model": "up/m1", "input": "hello", "stream": stream}),
            ("/v1/responses", {"model": "up/m1", "input": "hi", "stream": stream,
                               "store": False}),
            ("/v1/chat/completions", chat("fake/echo", stream=stream)),
        ]
    for path, body in bodies:
        async with client.stream("POST", url + path, json=body) as resp:
            assert resp.status_code == 200, await resp.aread()
            await resp.aread()
    return len(bodies)


async def test_answered_requests_and_their_connections_form_no_cycles(
        nursery: trio.Nursery, upstream: FakeUpstream, tmp_path: Path) -> None:
    upstream.scripts["m1"] = Script(chunks=["Hel", "lo"])
    served = await start_relay(nursery, with_upstream(upstream), tmp_path)
    async with httpx.AsyncClient(trust_env=False, timeout=10.0) as warm:
        before = await exercise(warm, served.url)  # imports, caches, pools: made once
    await wait_for(connections_ended)
    with collector_off():
        for _ in range(2):  # a keep-alive connection's second round, then a new one
            async with httpx.AsyncClient(trust_env=False, timeout=10.0) as client:
                count = await exercise(client, served.url)
                count += await exercise(client, served.url)
        await wait_for(lambda: len(records(tmp_path)) == before + 2 * count)
        await wait_for(connections_ended)
        assert_no_request_in_cycles()


async def test_a_client_that_leaves_mid_stream_leaves_no_cycles(
        nursery: trio.Nursery, upstream: FakeUpstream, tmp_path: Path) -> None:
    upstream.scripts["m1"] = Script(chunks=["tok"] * 50, chunk_delay_s=0.05)
    served = await start_relay(nursery, with_upstream(upstream), tmp_path)

    async def leave_after_first_chunk() -> None:
        async with httpx.AsyncClient(trust_env=False, timeout=10.0) as client, \
                client.stream("POST", served.url + "/v1/chat/completions",
                              json=chat("up/m1", stream=True)) as resp:
            async for _ in resp.aiter_bytes():
                break  # and the connection closes with the client

    await leave_after_first_chunk()  # warm
    await wait_for(lambda: len(records(tmp_path)) == 1)
    await wait_for(connections_ended)
    with collector_off():
        for _ in range(3):
            await leave_after_first_chunk()
        await wait_for(lambda: len(records(tmp_path)) == 4)
        await wait_for(lambda: all(r["reason"] == "client_disconnected"
                                   for r in records(tmp_path)))
        await wait_for(connections_ended)
        assert_no_request_in_cycles()


# --- failures: a refusal, an upstream's error, a fallback, a failed fan-out branch ---------

ROUTES = """
[routes.fb]
primary = "up/m2"
fallbacks = ["fake/echo"]
"""

FAILURES: dict[str, tuple[str, Any]] = {
    "bad_json": ("/v1/chat/completions", b"{not json"),
    "unknown_model": ("/v1/chat/completions", chat("nope/x")),
    "unknown_previous_response": ("/v1/responses", {
        "model": "up/m1", "input": "x", "previous_response_id": "resp_nope"}),
    "upstream_500": ("/v1/chat/completions", chat("up/m2")),
    "upstream_500_streamed": ("/v1/chat/completions", chat("up/m2", stream=True)),
    "messages_upstream_500": ("/v1/messages", {**chat("up/m2"), "max_tokens": 5}),
    "responses_upstream_500": ("/v1/responses", {"model": "up/m2", "input": "x"}),
    "adapter_failure_mid_stream": ("/v1/chat/completions", chat(
        "fake/echo?fail=upstream_error&fail_after=1&chunks=3", stream=True)),
    "fallback_after_a_failure": ("/v1/chat/completions", chat("fb")),
    "fanout_with_a_failed_branch": ("/relay/v1/fanout", {
        "messages": [{"role": "user", "content": "a"}], "models": ["fake/echo", "up/m2"]}),
    "embeddings_upstream_404": ("/v1/embeddings", {"model": "up/m1", "input": "x"}),
    "count_tokens_unsupported": ("/v1/messages/count_tokens", chat("up/m2")),
}


async def fail(client: httpx.AsyncClient, url: str, case: str) -> None:
    path, body = FAILURES[case]
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with client.stream("POST", url + path, content=content,
                             headers={"content-type": "application/json"}) as resp:
        await resp.aread()


@pytest.mark.parametrize("case", list(FAILURES))
async def test_failed_and_refused_requests_form_no_cycles(
        nursery: trio.Nursery, upstream: FakeUpstream, tmp_path: Path, case: str) -> None:
    # A failure is kept as data (the record, the writer's error); its traceback held the
    # frames it passed through, the request's own among them.
    upstream.scripts["m1"] = Script(chunks=["Hel", "lo"])
    upstream.scripts["m2"] = Script(status=500)
    served = await start_relay(nursery, with_upstream(upstream) + ROUTES, tmp_path)
    async with httpx.AsyncClient(trust_env=False, timeout=10.0) as warm:
        await fail(warm, served.url, case)
    await wait_for(lambda: len(records(tmp_path)) == 1)
    await wait_for(connections_ended)
    with collector_off():
        async with httpx.AsyncClient(trust_env=False, timeout=10.0) as client:
            for _ in range(2):
                await fail(client, served.url, case)
        await wait_for(lambda: len(records(tmp_path)) == 3)
        await wait_for(lambda: lane_idle(served))
        await wait_for(connections_ended)
        assert_no_request_in_cycles()
