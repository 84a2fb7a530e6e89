"""Tests of the fake OpenAI upstream (tests/fakes/upstream.py) itself."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator
from contextlib import aclosing
from functools import partial
from typing import Any, cast

import httpx
import pytest
import trio

from fakes.upstream import CREATED, FakeUpstream, Script, serve_fake_upstream

CHAT = "/chat/completions"


def _client(up: FakeUpstream) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=up.url, trust_env=False, timeout=5)


def _lines(resp: httpx.Response) -> AsyncGenerator[str, None]:
    return cast(AsyncGenerator[str, None], resp.aiter_lines())


async def _sse(resp: httpx.Response) -> list[str]:
    """All `data:` payloads of a streamed response, in order."""
    out: list[str] = []
    async with aclosing(_lines(resp)) as lines:
        async for line in lines:
            if line.startswith("data: "):
                out.append(line[len("data: ") :])
            else:
                assert line == "", line
    return out


def _chat(model: str = "m1", stream: bool = False, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
    if stream:
        body["stream"] = True
    body.update(extra)
    return body


def _chunk(model: str, delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {
        "id": "chatcmpl-fake",
        "object": "chat.completion.chunk",
        "created": CREATED,
        "model": model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }


async def test_stream_shape_and_done(nursery: trio.Nursery) -> None:
    up: FakeUpstream = await nursery.start(serve_fake_upstream)
    up.scripts["m2"] = Script(chunks=["a", "b", "c"])
    body = _chat("m2", stream=True)
    async with _client(up) as client, client.stream("POST", CHAT, json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"] == "text/event-stream"
        assert r.headers["transfer-encoding"] == "chunked"
        events = await _sse(r)
    assert events[-1] == "[DONE]"
    assert [json.loads(e) for e in events[:-1]] == [
        _chunk("m2", {"role": "assistant", "content": ""}),
        _chunk("m2", {"content": "a"}),
        _chunk("m2", {"content": "b"}),
        _chunk("m2", {"content": "c"}),
        _chunk("m2", {}, "stop"),
    ]  # and no usage chunk: the request did not ask for one
    assert len(up.requests) == 1
    rec = up.requests[0]
    assert (rec.method, rec.path, rec.conn_id) == ("POST", "/v1/chat/completions", 0)
    assert rec.json == _chat("m2", stream=True)
    assert rec.headers["content-type"] == "application/json"
    await up.wait_all_closed()  # the client closed its pool
    assert up.connections[0].closed_by == "peer"
    assert up.active_responses() == 0


async def test_stream_usage_chunk_when_requested(nursery: trio.Nursery) -> None:
    up: FakeUpstream = await nursery.start(serve_fake_upstream)
    body = _chat(stream=True, stream_options={"include_usage": True})
    async with _client(up) as client, client.stream("POST", CHAT, json=body) as r:
        events = await _sse(r)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all("usage" in c for c in chunks)
    assert [c["usage"] for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}


async def test_non_stream_shape(nursery: trio.Nursery) -> None:
    up: FakeUpstream = await nursery.start(serve_fake_upstream)
    async with _client(up) as client:
        r = await client.post(CHAT, json=_chat())
    assert r.status_code == 200
    assert r.headers["content-type"] == "application/json"
    assert r.json() == {
        "id": "chatcmpl-fake",
        "object": "chat.completion",
        "created": CREATED,
        "model": "m1",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Hello world"},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
    }


async def test_max_tokens_truncates_with_length(nursery: trio.Nursery) -> None:
    up: FakeUpstream = await nursery.start(serve_fake_upstream)
    up.default_script = Script(chunks=["a", "b", "c"])
    async with _client(up) as client:
        body = _chat(stream=True, max_tokens=2)
        async with client.stream("POST", CHAT, json=body) as r:
            events = await _sse(r)
        r2 = await client.post(CHAT, json=_chat(max_completion_tokens=1))
        r3 = await client.post(CHAT, json=_chat(max_tokens=3))
    chunks = [json.loads(e) for e in events[:-1]]
    assert [c["choices"][0]["delta"].get("content") for c in chunks] == ["", "a", "b", None]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert r2.json()["choices"][0]["message"]["content"] == "a"
    assert r2.json()["choices"][0]["finish_reason"] == "length"
    assert r3.json()["choices"][0]["finish_reason"] == "stop"
    # Keep-alive: one connection served all three requests.
    assert len(up.connections) == 1
    assert up.connections[0].requests == 3


async def test_error_status_with_headers(nursery: trio.Nursery) -> None:
    up: FakeUpstream = await nursery.start(serve_fake_upstream)
    up.scripts["busy"] = Script(status=429, headers={"retry-after": "7"})
    custom = {"error": {"message": "nope", "type": "server_error", "code": "x"}}
    up.scripts["down"] = Script(status=503, error_body=custom)
    async with _client(up) as client:
        async with client.stream("POST", CHAT, json=_chat("busy", stream=True)) as r:
            await r.aread()
        r2 = await client.post(CHAT, json=_chat("down"))
    assert r.status_code == 429
    assert r.headers["retry-after"] == "7"
    assert r.headers["content-type"] == "application/json"
    err = r.json()["error"]
    assert set(err) == {"message", "type", "code"}
    assert err["type"] == "rate_limit_error"
    assert err["code"] is None
    assert r2.status_code == 503
    assert r2.json() == custom


async def test_bad_path_and_bad_json(nursery: trio.Nursery) -> None:
    up: FakeUpstream = await nursery.start(serve_fake_upstream)
    async with _client(up) as client:
        r404 = await client.post("/v1/chat/completions", json=_chat())  # doubled /v1
        r400 = await client.post(
            CHAT, content=b"{nope", headers={"content-type": "application/json"}
        )
    assert r404.status_code == 404
    assert "message" in r404.json()["error"]
    assert r400.status_code == 400
    assert r400.json()["error"]["type"] == "invalid_request_error"
    assert [rq.path for rq in up.requests] == ["/v1/v1/chat/completions", "/v1/chat/completions"]
    assert up.requests[1].json is None
    assert up.requests[1].body == b"{nope"


async def test_cut_after_gives_incomplete_stream(nursery: trio.Nursery) -> None:
    up: FakeUpstream = await nursery.start(serve_fake_upstream)
    up.default_script = Script(chunks=["a", "b", "c"], cut_after=2)
    events: list[str] = []
    async with _client(up) as client, client.stream("POST", CHAT, json=_chat(stream=True)) as r:
        with pytest.raises(httpx.RemoteProtocolError):
            async with aclosing(_lines(r)) as lines:
                async for line in lines:
                    if line:
                        events.append(line)
    contents = [json.loads(e[6:])["choices"][0]["delta"].get("content") for e in events]
    assert contents == ["", "a", "b"]
    assert up.connections[0].closed_by == "server"
    assert up.active_responses() == 0


async def test_stall_then_client_close_is_seen_quickly(nursery: trio.Nursery) -> None:
    up: FakeUpstream = await nursery.start(serve_fake_upstream)
    up.default_script = Script(chunks=["a", "b", "c"], stall_after=1)
    async with _client(up) as client:
        async with client.stream("POST", CHAT, json=_chat(stream=True)) as r:
            seen: list[str] = []
            # Stop reading by cancelling (as relay does when its client goes away);
            # `break` would leave httpx's nested async generators unfinalized.
            with trio.CancelScope() as reading:
                async for line in r.aiter_lines():
                    if line:
                        seen.append(line)
                    if len(seen) >= 2:  # role chunk + "a"; then the fake stalls
                        assert up.open_connections == 1
                        assert up.active_responses() == 1
                        t0 = trio.current_time()
                        reading.cancel()
            assert reading.cancelled_caught
            assert len(seen) == 2
        # Abandoning an unfinished streamed response makes httpx drop the connection.
        with trio.fail_after(2):
            await up.wait_all_closed()
        closed_at = up.connections[0].closed_at
        assert closed_at is not None
        assert closed_at - t0 < 0.5
        assert up.connections[0].closed_by == "peer"
        await up.wait_no_active_responses()


async def test_request_recorded_before_first_byte_delay(nursery: trio.Nursery) -> None:
    up: FakeUpstream = await nursery.start(serve_fake_upstream)
    up.default_script = Script(first_byte_delay_s=30)
    async with _client(up) as client, trio.open_nursery() as inner:
        t0 = trio.current_time()
        inner.start_soon(partial(client.post, CHAT, json=_chat()))
        with trio.fail_after(2):
            await up.wait_for_requests(1)
        assert up.requests[0].received_at - t0 < 1
        assert up.requests[0].json == _chat()
        assert up.active_responses() == 1
        inner.cancel_scope.cancel()  # abandon the request mid-delay
    with trio.fail_after(2):
        await up.wait_all_closed()
    assert up.connections[0].closed_by == "peer"
    assert up.active_responses() == 0


async def test_models(nursery: trio.Nursery) -> None:
    up: FakeUpstream = await nursery.start(serve_fake_upstream)
    async with _client(up) as client:
        r = await client.get("/models")
        up.models = ["a", "b"]
        r2 = await client.get("/models")
        r3 = await client.get("/models/b")
        r4 = await client.get("/models/zzz")
    assert r.json() == {
        "object": "list",
        "data": [{"id": "m1", "object": "model", "created": 0, "owned_by": "fake"}],
    }
    assert [m["id"] for m in r2.json()["data"]] == ["a", "b"]
    assert r3.json()["id"] == "b"
    assert r4.status_code == 404


async def test_tool_calls(nursery: trio.Nursery) -> None:
    up: FakeUpstream = await nursery.start(serve_fake_upstream)
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"x":1}'}}
    up.default_script = Script(chunks=[], tool_calls=[call])
    async with _client(up) as client:
        async with client.stream("POST", CHAT, json=_chat(stream=True)) as r:
            events = await _sse(r)
        r2 = await client.post(CHAT, json=_chat())
    deltas = [json.loads(e)["choices"][0]["delta"] for e in events[:-1]]
    assert deltas[1] == {
        "tool_calls": [
            {
                "index": 0,
                "id": "call_1",
                "type": "function",
                "function": {"name": "f", "arguments": ""},
            }
        ]
    }
    pieces = [d["tool_calls"][0]["function"]["arguments"] for d in deltas[2:4]]
    assert len(pieces) == 2
    assert "".join(pieces) == '{"x":1}'
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "tool_calls"
    choice = r2.json()["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": None, "tool_calls": [call]}
    assert choice["finish_reason"] == "tool_calls"


async def test_omit_done_and_malformed(nursery: trio.Nursery) -> None:
    up: FakeUpstream = await nursery.start(serve_fake_upstream)
    up.scripts["nodone"] = Script(omit_done=True)
    up.scripts["bad"] = Script(malformed_at=1)
    async with _client(up) as client:
        async with client.stream("POST", CHAT, json=_chat("nodone", stream=True)) as r:
            nodone = await _sse(r)
        async with client.stream("POST", CHAT, json=_chat("bad", stream=True)) as r:
            bad = await _sse(r)
    assert json.loads(nodone[-1])["choices"][0]["finish_reason"] == "stop"
    assert "[DONE]" not in nodone
    assert bad[2] == "{not json"
    assert json.loads(bad[1])["choices"][0]["delta"] == {"content": "Hello"}
    assert json.loads(bad[3])["choices"][0]["delta"] == {"content": " world"}
    assert bad[-1] == "[DONE]"


async def test_cancel_stops_server_and_closes_sockets() -> None:
    errors: list[Exception] = []
    server = trio.CancelScope()

    async def run(task_status: trio.TaskStatus[FakeUpstream] = trio.TASK_STATUS_IGNORED) -> None:
        with server:
            await serve_fake_upstream(task_status=task_status)

    async with (
        httpx.AsyncClient(trust_env=False, timeout=5) as client,
        trio.open_nursery() as nursery,
    ):
        up: FakeUpstream = await nursery.start(run)
        up.default_script = Script(hang=True)

        async def call() -> None:
            try:
                await client.post(up.url + CHAT, json=_chat())
            except httpx.HTTPError as exc:
                errors.append(exc)

        nursery.start_soon(call)
        with trio.fail_after(2):
            await up.wait_for_requests(1)
        assert up.open_connections == 1
        server.cancel()
    assert len(errors) == 1
    assert isinstance(errors[0], httpx.RemoteProtocolError)
    assert up.open_connections == 0
    assert up.connections[0].closed_by == "server"
    assert up.active_responses() == 0
    with pytest.raises(OSError):
        stream = await trio.open_tcp_stream("127.0.0.1", up.port)
        await stream.aclose()
