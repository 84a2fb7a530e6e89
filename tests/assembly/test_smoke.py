"""The assembled relay answers through the embedding API, plain and streamed."""

from __future__ import annotations

from pathlib import Path

import httpx
import trio
from fakes.upstream import FakeUpstream
from helpers.assembled import (
    FAKE_ONLY,
    chat,
    lane_idle,
    records,
    sse_events,
    start_relay,
    wait_for,
    with_upstream,
)


async def test_fake_plain_and_stream(nursery: trio.Nursery, tmp_path: Path,
                                     client: httpx.AsyncClient) -> None:
    served = await start_relay(nursery, FAKE_ONLY, tmp_path)
    r = await client.post(f"{served.url}/v1/chat/completions", json=chat("fake/echo", "hi you"))
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "hi you"}
    assert body["choices"][0]["finish_reason"] == "stop"
    assert r.headers["x-relay-request-id"]
    r = await client.post(f"{served.url}/v1/chat/completions",
                          json=chat("fake/echo", "a b c", stream=True))
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1])
    assert text == "a b c"
    assert events[-2]["choices"][0]["finish_reason"] == "stop"
    assert lane_idle(served)
    await wait_for(lambda: len(records(tmp_path)) == 2)  # written as each request ends
    recs = records(tmp_path)
    assert recs[0]["provider"] == "fake" and recs[0]["status"] == 200
    assert recs[0]["released_at"] is not None


async def test_openai_upstream_plain_and_stream(nursery: trio.Nursery, tmp_path: Path,
                                                upstream: FakeUpstream,
                                                client: httpx.AsyncClient) -> None:
    served = await start_relay(nursery, with_upstream(upstream), tmp_path)
    r = await client.post(f"{served.url}/v1/chat/completions", json=chat("up/m1"))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "Hello world"
    assert r.json()["usage"]["total_tokens"] == 5
    r = await client.post(f"{served.url}/v1/chat/completions", json=chat("up/m1", stream=True))
    events = sse_events(r.text)
    assert "".join(e["choices"][0]["delta"].get("content", "")
                   for e in events[:-1] if e["choices"]) == "Hello world"
    assert upstream.requests[-1].json["model"] == "m1"
    assert upstream.requests[-1].json["stream"] is True
    await wait_for(lambda: len(records(tmp_path)) == 2)
    recs = records(tmp_path)
    assert recs[-1]["usage"]["total_tokens"] == 5
