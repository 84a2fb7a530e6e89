"""Fan-out (SPEC A4): several models at once, each in its own lane; one stop ends all."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import trio
from fakes.upstream import FakeUpstream, Script
from helpers.assembled import lane_idle, records, sse_events, start_relay, wait_for
from helpers.raw_http import BOUND_S, close, read_until

CONFIG = """
[server]
records = "records.jsonl"
[providers.fake]
adapter = "fake"
models = ["echo"]
[providers.up]
adapter = "openai"
base_url = "{url}"
[providers.up.profile]
lanes = 2
queue_max = 4
queue_timeout_s = 10
run_timeout_s = 20
"""

BODY = {"messages": [{"role": "user", "content": "one two"}]}


async def test_plain_fanout_answers_every_model(nursery: trio.Nursery, tmp_path: Path,
                                                upstream: FakeUpstream,
                                                client: httpx.AsyncClient) -> None:
    served = await start_relay(nursery, CONFIG.format(url=upstream.url), tmp_path)
    upstream.scripts["bad"] = Script(status=500)
    r = await client.post(f"{served.url}/relay/v1/fanout", json={
        **BODY, "models": ["fake/echo", "up/m1", "up/bad"]})
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert [x["model"] for x in results] == ["fake/echo", "up/m1", "up/bad"]
    assert results[0]["response"]["choices"][0]["message"]["content"] == "one two"
    assert results[1]["response"]["choices"][0]["message"]["content"] == "Hello world"
    assert results[2]["ok"] is False and results[2]["error"]["code"] == "upstream_error"
    await wait_for(lambda: len(records(tmp_path)) == 1)
    rec = records(tmp_path)[0]
    assert rec["route"] == "(fanout)" and len(rec["attempts"]) == 3


async def test_streamed_fanout_tags_events_with_their_model(
        nursery: trio.Nursery, tmp_path: Path, upstream: FakeUpstream,
        client: httpx.AsyncClient) -> None:
    served = await start_relay(nursery, CONFIG.format(url=upstream.url), tmp_path)
    r = await client.post(f"{served.url}/relay/v1/fanout", json={
        **BODY, "stream": True, "models": ["fake/echo", "up/m1"]})
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    text: dict[str, str] = {"fake/echo": "", "up/m1": ""}
    for e in events[:-1]:
        if "chunk" in e:
            text[e["model"]] += e["chunk"]["choices"][0]["delta"].get("content") or ""
    assert text == {"fake/echo": "one two", "up/m1": "Hello world"}
    assert sorted(e["model"] for e in events[:-1] if e.get("done")) == ["fake/echo", "up/m1"]


async def test_one_client_stop_ends_every_branch(nursery: trio.Nursery, tmp_path: Path,
                                                 upstream: FakeUpstream) -> None:
    upstream.scripts["slow"] = Script(chunks=["x"] * 500, chunk_delay_s=0.02)
    upstream.scripts["stall"] = Script(stall_after=1)
    served = await start_relay(nursery, CONFIG.format(url=upstream.url), tmp_path)
    host, _, port = served.url.removeprefix("http://").partition(":")
    stream = await trio.open_tcp_stream(host, int(port))
    data = json.dumps({**BODY, "stream": True, "models": [
        "up/slow", "up/stall", "fake/echo?chunks=1000&chunk_delay_s=0.05"]}).encode()
    await stream.send_all(b"POST /relay/v1/fanout HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                          b"Content-Type: application/json\r\nContent-Length: "
                          + str(len(data)).encode() + b"\r\n\r\n" + data)
    await read_until(stream, b'"model":"up/slow"')
    await wait_for(lambda: upstream.active_responses() == 2)
    fake = served.relay.providers["fake"].adapter
    assert getattr(fake, "active", 0) == 1
    stopped = await close(stream, "fin")
    with trio.fail_after(5):
        await upstream.wait_all_closed()
    latency = max(c.closed_at or 0 for c in upstream.connections) - stopped
    assert latency < BOUND_S
    await wait_for(lambda: lane_idle(served) and getattr(fake, "active", 1) == 0)


async def test_fanout_refuses_bad_model_lists(nursery: trio.Nursery, tmp_path: Path,
                                              upstream: FakeUpstream,
                                              client: httpx.AsyncClient) -> None:
    served = await start_relay(nursery, CONFIG.format(url=upstream.url), tmp_path)
    url = f"{served.url}/relay/v1/fanout"
    for models in ([], "fake/echo", ["fake/echo", "fake/echo"], [1]):
        r = await client.post(url, json={**BODY, "models": models})
        assert r.status_code == 400 and r.json()["error"]["param"] == "models", r.text
    r = await client.post(url, json={**BODY, "models": ["fake/echo", "nope/x"]})
    assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_model"
    assert getattr(served.relay.providers["fake"].adapter, "started", 1) == 0
