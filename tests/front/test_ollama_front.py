"""Ollama's API on relay's front (SPEC A10), in plain HTTP through the assembled relay:
the NDJSON stream (its type, the default ``stream: true``, what a queued request sees),
the field policy on Ollama's names, images, a model load, errors in Ollama's shape, the
content types Ollama takes, a client that leaves, and ``[server] ollama_port`` (its ``/``,
a port Ollama itself holds, a port that is the main one).
"""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from fakes.upstream import FakeUpstream, serve_fake_upstream
from helpers.assembled import config_from, lane_idle, records, start_relay, wait_for

import relay
from relay.assembly.server import ListenError
from relay.vocab.errors import ConfigError

PNG = ("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA60e6k"
       "gAAAABJRU5ErkJggg==")


def _config(up: FakeUpstream, extra: str = "") -> str:
    return f"""
[server]
records = "records.jsonl"
{extra}
[providers.fake]
adapter = "fake"
models = ["echo"]
[providers.fake.profile]
lanes = 1
queue_max = 4
queue_timeout_s = 10
run_timeout_s = 20
[providers.up]
adapter = "openai"
base_url = "{up.url}"
models = ["m1"]
[providers.up.profile]
lanes = 2
queue_max = 4
queue_timeout_s = 10
run_timeout_s = 20
"""


@pytest.fixture
async def stage(nursery: trio.Nursery, tmp_path: Path) -> Any:
    up: FakeUpstream = await nursery.start(serve_fake_upstream)
    served = await start_relay(nursery, _config(up), tmp_path)
    async with httpx.AsyncClient(base_url=served.url, trust_env=False, timeout=20) as http:
        yield served, up, http


def _lines(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.split("\n") if line]


async def test_a_stream_is_ndjson_by_default_and_a_queued_one_sees_empty_lines(
        stage: Any) -> None:
    served, _, http = stage
    body = {"model": "fake/echo", "messages": [{"role": "user", "content": "one two"}]}
    r = await http.post("/api/chat", json=body)  # no "stream": Ollama streams
    assert r.headers["content-type"] == "application/x-ndjson"
    lines = _lines(r.text)
    assert "".join(x["message"]["content"] for x in lines) == "one two"
    assert [x["done"] for x in lines] == [False] * (len(lines) - 1) + [True]
    assert lines[-1]["done_reason"] == "stop" and lines[-1]["total_duration"] > 0
    # The one lane busy: the second waits, and sees lines with no text meanwhile
    # (NDJSON has no comment; an Ollama client shows nothing while it waits).
    got: dict[str, str] = {}

    async def ask(name: str, model: str) -> None:
        got[name] = (await http.post("/api/generate", json={
            "model": model, "prompt": "after the wait"})).text
    async with trio.open_nursery() as nursery:
        nursery.start_soon(ask, "first", "fake/echo?delay_s=2.5")
        await wait_for(lambda: served.relay.providers["fake"].lane.statistics().running == 1)
        nursery.start_soon(ask, "second", "fake/echo")
    waited = _lines(got["second"])
    assert waited[0] == {**waited[0], "response": "", "done": False}
    assert "".join(x["response"] for x in waited) == "after the wait"
    assert waited[-1]["done"] is True


async def test_ollama_field_names_under_the_field_policy(stage: Any, tmp_path: Path) -> None:
    _, _, http = stage
    body = {"model": "fake/echo", "stream": False, "keep_alive": "5m",
            "options": {"num_ctx": 4096, "temperature": 0.2, "num_predict": 1},
            "messages": [{"role": "user", "content": "cut me short"}]}
    r = await http.post("/api/chat", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["message"]["content"] == "cut "  # num_predict → max_tokens
    assert r.json()["done_reason"] == "length"
    ignored = r.headers["x-relay-ignored-fields"].split(", ")
    assert set(ignored) == {"options.temperature", "keep_alive", "options.num_ctx"}
    await wait_for(lambda: len(records(tmp_path)) == 1)
    assert set(records(tmp_path)[0]["ignored_fields"]) == set(ignored)
    refused = await http.post("/api/generate", json={
        "model": "fake/echo", "prompt": "x", "suffix": "y", "options": {"bogus": 1}})
    assert refused.status_code == 400
    error = refused.json()
    assert error["error"].startswith("unsupported: ") and "'suffix'" in error["error"]
    assert error["relay"]["param"] == "suffix, options"
    wrong = await http.post("/api/chat", json={**body, "options": {"temperature": "hot"}})
    assert wrong.status_code == 400
    assert wrong.json()["relay"]["param"] == "options.temperature"


async def test_images_become_image_parts_and_think_an_effort(stage: Any) -> None:
    _, up, http = stage
    r = await http.post("/api/chat", json={
        "model": "up/m1", "stream": False, "think": "high", "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "what is this?", "images": [PNG]}]})
    assert r.status_code == 200, r.text
    sent = up.requests[-1].json
    assert sent["reasoning_effort"] == "high"
    assert sent["messages"][1]["content"] == [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}}]


async def test_nothing_to_answer_loads_the_model_and_asks_no_provider(stage: Any) -> None:
    _, up, http = stage
    r = await http.post("/api/generate", json={"model": "up/m1:latest"})
    assert r.status_code == 200
    assert _lines(r.text)[-1] | {"done": True, "done_reason": "load"} == _lines(r.text)[-1]
    r = await http.post("/api/chat", json={"model": "up/m1", "messages": []})
    assert r.json()["done_reason"] == "load"
    assert up.requests == []
    missing = await http.post("/api/chat", json={"model": "nope"})
    assert missing.status_code == 404
    assert missing.json()["error"].startswith("unknown_model: ")


async def test_errors_and_content_types_in_ollamas_shape(stage: Any, tmp_path: Path) -> None:
    _, _, http = stage
    r = await http.get("/api/chat")
    assert (r.status_code, r.json()["relay"]["reason"]) == (405, "invalid_request")
    r = await http.get("/api/nothing")
    assert r.status_code == 404 and r.json()["error"].startswith("invalid_request: ")
    # Ollama's documented calls are `curl -d`, which says form-encoded: taken.
    raw = json.dumps({"model": "fake/echo", "prompt": "curl", "stream": False})
    r = await http.post("/api/generate", content=raw, headers={
        "content-type": "application/x-www-form-urlencoded"})
    assert r.json()["response"] == "curl"
    # … but not from a browser page of another origin.
    r = await http.post("/api/generate", content=raw, headers={
        "content-type": "text/plain", "origin": "http://evil.example"})
    assert r.status_code == 403 and r.json()["relay"]["reason"] == "forbidden_origin"
    assert (await http.get("/")).headers["content-type"].startswith("text/html")
    await wait_for(lambda: len(records(tmp_path)) == 4)
    assert [(x["endpoint"], x["status"]) for x in records(tmp_path)] == [
        ("/api/chat", 405), ("/api/nothing", 404), ("/api/generate", 200),
        ("/api/generate", 403)]


async def test_a_client_that_leaves_mid_stream_stops_it(stage: Any, tmp_path: Path) -> None:
    served, _, http = stage
    body = {"model": "fake/echo?chunks=50&chunk_delay_s=0.1", "prompt": "x"}
    async with http.stream("POST", "/api/generate", json=body) as r:
        async for line in r.aiter_lines():
            assert json.loads(line)["done"] is False
            break
    await wait_for(lambda: len(records(tmp_path)) == 1)
    assert records(tmp_path)[0]["reason"] == "client_disconnected"
    await wait_for(lambda: lane_idle(served))


def _leaves(error: BaseException) -> list[BaseException]:
    if isinstance(error, BaseExceptionGroup):
        return [leaf for inner in error.exceptions for leaf in _leaves(inner)]
    return [error]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_ollama_port_serves_ollamas_root_and_every_path(nursery: trio.Nursery,
                                                              tmp_path: Path) -> None:
    up: FakeUpstream = await nursery.start(serve_fake_upstream)
    port = _free_port()
    served = await start_relay(nursery, _config(up, f"ollama_port = {port}"), tmp_path)
    assert served.ollama_url == f"http://127.0.0.1:{port}"
    async with httpx.AsyncClient(base_url=served.ollama_url, trust_env=False) as http:
        root = await http.get("/")
        assert (root.status_code, root.text) == (200, "Ollama is running")
        assert (await http.head("/")).status_code == 200
        version = (await http.get("/api/version")).json()["version"]
        assert tuple(int(n) for n in version.split(".")) >= (0, 6, 4)
        ps_during: list[Any] = []

        async def slow() -> None:
            await http.post("/api/generate", json={
                "model": "fake/echo?delay_s=1", "prompt": "x", "stream": False})
        async with trio.open_nursery() as inner:
            inner.start_soon(slow)
            await wait_for(lambda: served.relay.providers["fake"].lane.statistics().running)
            ps_during = (await http.get("/api/ps")).json()["models"]
        assert [m["name"] for m in ps_during] == ["fake/echo?delay_s=1"]
        assert (await http.get("/api/ps")).json() == {"models": []}
        # Ollama's port is Ollama's: its OpenAI-compatible paths are there too.
        r = await http.post("/v1/chat/completions", json={
            "model": "fake/echo", "messages": [{"role": "user", "content": "v1"}]})
        assert r.json()["choices"][0]["message"]["content"] == "v1"


async def test_an_ollama_port_held_by_ollama_is_refused_clearly(tmp_path: Path) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        config = config_from(f"""
[server]
ollama_port = {port}
[providers.fake]
adapter = "fake"
""", tmp_path)
        failed: list[ListenError] = []
        try:
            with trio.fail_after(10):
                async with trio.open_nursery() as nursery:
                    await nursery.start(relay.serve, config)
        except* ListenError as group:
            failed = [e for e in _leaves(group) if isinstance(e, ListenError)]
        assert len(failed) == 1, failed
        assert "Ollama itself" in str(failed[0]) and "ollama_port" in str(failed[0])
    with pytest.raises(ConfigError, match="ollama_port"):
        config_from("[server]\nport = 9000\nollama_port = 9000\n[providers.fake]\n"
                    "adapter = \"fake\"\n", tmp_path)
