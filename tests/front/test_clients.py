"""Clients (SPEC L14) through the assembled relay, on real sockets: each client's token
in its dialect's header, a wrong one refused in the dialect's shape, the client's name
(never its token) in records, logs, the status and `relay ps`, its default priority and
the downward-only override, and ``forbidden_model`` before anything is queued."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from helpers.assembled import chat, records, start_relay, wait_for

from relay import Served

AGENT_TOKEN = "agent-token-0123456789"
CHAT_TOKEN = "chat-token-9876543210"
SERVER_TOKEN = "server-token-5555555555"

CONFIG = """
[server]
records = "records.jsonl"
token_env = "RELAY_TEST_SERVER_TOKEN"
[providers.fake]
adapter = "fake"
models = ["echo"]
[providers.other]
adapter = "fake"
models = ["echo"]
[routes.fast]
primary = "fake/echo"
[clients.agent]
token_env = "RELAY_TEST_AGENT_TOKEN"
priority = "background"
models = ["fake/*", "fast"]
[clients.chat]
token_env = "RELAY_TEST_CHAT_TOKEN"
priority = "interactive"
"""


@pytest.fixture
def tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RELAY_TEST_AGENT_TOKEN", AGENT_TOKEN)
    monkeypatch.setenv("RELAY_TEST_CHAT_TOKEN", CHAT_TOKEN)
    monkeypatch.setenv("RELAY_TEST_SERVER_TOKEN", SERVER_TOKEN)


def bearer(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


def gemini_body() -> dict[str, Any]:
    return {"contents": [{"role": "user", "parts": [{"text": "hi"}]}]}


# Every dialect's path, its body, and how its 401 looks (SPEC E1: the dialect's shape).
def openai_401(r: httpx.Response) -> None:
    err = r.json()["error"]
    assert err["code"] == "unauthorized" and err["type"] == "authentication_error", err
    assert err["relay"]["reason"] == "unauthorized"


def anthropic_401(r: httpx.Response) -> None:
    body = r.json()
    assert body["type"] == "error", body
    assert body["error"]["type"] == "authentication_error", body


def google_401(r: httpx.Response) -> None:
    err = r.json()["error"]
    assert err["code"] == 401 and err["status"] == "UNAUTHENTICATED", err
    assert err["details"][0]["reason"] == "unauthorized", err


def ollama_401(r: httpx.Response) -> None:
    body = r.json()
    assert isinstance(body["error"], str) and body["error"].startswith("unauthorized"), body


DIALECTS: list[tuple[str, str, dict[str, Any], Any]] = [
    ("chat", "/v1/chat/completions", chat("fake/echo"), openai_401),
    ("responses", "/v1/responses", {"model": "fake/echo", "input": "hi"}, openai_401),
    ("messages", "/v1/messages", {"model": "fake/echo", "max_tokens": 20, "messages": [
        {"role": "user", "content": "hi"}]}, anthropic_401),
    ("gemini", "/v1beta/models/fake/echo:generateContent", gemini_body(), google_401),
    ("embeddings", "/v1/embeddings", {"model": "fake/echo", "input": "hi"}, openai_401),
    ("ollama", "/api/chat", {"model": "fake/echo", "stream": False, "messages": [
        {"role": "user", "content": "hi"}]}, ollama_401),
]


async def test_a_wrong_or_missing_token_is_a_401_in_every_dialects_shape(
        nursery: trio.Nursery, tmp_path: Path, client: httpx.AsyncClient,
        tokens: None) -> None:
    served = await start_relay(nursery, CONFIG, tmp_path)
    for name, path, body, shape in DIALECTS:
        header = "x-api-key" if name == "messages" else (
            "x-goog-api-key" if name == "gemini" else "authorization")
        wrong = "wrong-token-000000" if header != "authorization" else "Bearer wrong-token-0"
        for headers in ({}, {header: wrong}):
            r = await client.post(served.url + path, json=body, headers=headers)
            assert r.status_code == 401, (name, headers, r.text)
            assert r.headers["x-should-retry"] == "false"
            shape(r)
    assert served.relay.providers["fake"].adapter.started == 0  # type: ignore[attr-defined]
    # Each client's token, in the header its dialect uses, is that client.
    ok = {"chat": bearer(AGENT_TOKEN), "messages": {"x-api-key": CHAT_TOKEN},
          "gemini": {"x-goog-api-key": AGENT_TOKEN}, "ollama": bearer(CHAT_TOKEN)}
    for name, path, body, _ in DIALECTS:
        if name in ok:
            r = await client.post(served.url + path, json=body, headers=ok[name])
            assert r.status_code == 200, (name, r.text)
    r = await client.post(served.url + "/v1beta/models/fake/echo:generateContent?key="
                          + CHAT_TOKEN, json=gemini_body())
    assert r.status_code == 200, r.text
    await wait_for(lambda: len(records(tmp_path)) >= 17)
    answered = [(rec["endpoint"], rec["client"]) for rec in records(tmp_path)
                if rec["status"] == 200]
    assert answered == [("/v1/chat/completions", "agent"), ("/v1/messages", "chat"),
                        ("/v1beta/models/fake/echo:generateContent", "agent"),
                        ("/api/chat", "chat"),
                        ("/v1beta/models/fake/echo:generateContent", "chat")]


async def test_the_server_token_is_the_client_default(
        nursery: trio.Nursery, tmp_path: Path, client: httpx.AsyncClient,
        tokens: None) -> None:
    served = await start_relay(nursery, CONFIG, tmp_path)
    r = await client.post(served.url + "/v1/chat/completions", json=chat("other/echo"),
                          headers=bearer(SERVER_TOKEN))
    assert r.status_code == 200, r.text
    await wait_for(lambda: bool(records(tmp_path)))
    assert records(tmp_path)[0]["client"] == "default"


async def test_a_tokenless_default_client_takes_requests_without_a_token(
        nursery: trio.Nursery, tmp_path: Path, client: httpx.AsyncClient,
        tokens: None) -> None:
    config = CONFIG.replace('token_env = "RELAY_TEST_SERVER_TOKEN"\n', "") + """
[clients.default]
priority = "background"
"""
    served = await start_relay(nursery, config, tmp_path)
    url = served.url + "/v1/chat/completions"
    assert (await client.post(url, json=chat("fake/echo"))).status_code == 200
    r = await client.post(url, json=chat("fake/echo"), headers=bearer("not-a-client-token"))
    assert r.status_code == 401, r.text   # a wrong token is never the token-less client
    assert (await client.post(url, json=chat("fake/echo"),
                              headers=bearer(CHAT_TOKEN))).status_code == 200
    await wait_for(lambda: len(records(tmp_path)) == 3)
    assert [(r["client"], r["priority"], r["status"]) for r in records(tmp_path)] == [
        ("default", "background", 200), ("default", "normal", 401),
        ("chat", "interactive", 200)]


async def test_priority_is_the_clients_and_the_header_may_only_lower_it(
        nursery: trio.Nursery, tmp_path: Path, client: httpx.AsyncClient,
        tokens: None) -> None:
    served = await start_relay(nursery, CONFIG, tmp_path)
    url = served.url + "/v1/chat/completions"
    asked = [(CHAT_TOKEN, None), (CHAT_TOKEN, "background"), (AGENT_TOKEN, None),
             (AGENT_TOKEN, "interactive"), (AGENT_TOKEN, "normal"), (CHAT_TOKEN, "normal")]
    for token, priority in asked:
        headers = bearer(token) | ({"x-relay-priority": priority} if priority else {})
        r = await client.post(url, json=chat("fake/echo"), headers=headers)
        assert r.status_code == 200, r.text
    await wait_for(lambda: len(records(tmp_path)) == len(asked))
    assert [(r["client"], r["priority"]) for r in records(tmp_path)] == [
        ("chat", "interactive"), ("chat", "background"), ("agent", "background"),
        ("agent", "background"), ("agent", "background"), ("chat", "normal")]


async def test_a_model_outside_the_clients_list_is_forbidden_before_anything_runs(
        nursery: trio.Nursery, tmp_path: Path, client: httpx.AsyncClient,
        tokens: None) -> None:
    served = await start_relay(nursery, CONFIG, tmp_path)
    url = served.url + "/v1/chat/completions"
    for body in (chat("other/echo"), chat("fake/echo", fallbacks=["other/echo"])):
        r = await client.post(url, json=body, headers=bearer(AGENT_TOKEN))
        assert r.status_code == 403, r.text
        err = r.json()["error"]
        assert err["code"] == "forbidden_model" and "'other/echo'" in err["message"], err
        assert "fake/*, fast" in err["message"] and "[clients.agent]" in err["relay"]["action"]
    r = await client.post(served.url + "/v1/embeddings", json={
        "model": "other/echo", "input": "x"}, headers=bearer(AGENT_TOKEN))
    assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden_model", r.text
    r = await client.post(served.url + "/v1/messages", json={
        "model": "other/echo", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]},
        headers={"x-api-key": AGENT_TOKEN})
    assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error", r.text
    assert served.relay.providers["other"].adapter.started == 0  # type: ignore[attr-defined]
    # A route it may use, and a pattern's models; another client may use any.
    for model, token in (("fast", AGENT_TOKEN), ("fake/echo?delay_s=0", AGENT_TOKEN),
                         ("other/echo", CHAT_TOKEN)):
        r = await client.post(url, json=chat(model), headers=bearer(token))
        assert r.status_code == 200, (model, r.text)
    await wait_for(lambda: len(records(tmp_path)) == 7)
    refusals = [r for r in records(tmp_path) if r["status"] == 403]
    assert len(refusals) == 4 and all(r["attempts"] == [] for r in refusals)
    assert {r["reason"] for r in refusals} == {"forbidden_model"}


async def test_tokens_never_reach_records_logs_status_or_metrics(
        nursery: trio.Nursery, tmp_path: Path, client: httpx.AsyncClient, tokens: None,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    served = await start_relay(nursery, CONFIG, tmp_path)
    url = served.url + "/v1/chat/completions"
    # A token in the answer (the fake echoes the prompt), in the model name, in a query.
    for token in (AGENT_TOKEN, CHAT_TOKEN):
        r = await client.post(url, json=chat("fake/echo", f"say {SERVER_TOKEN} {token}"),
                              headers=bearer(token))
        assert r.status_code == 200
        r = await client.post(url + f"?key={token}", json=chat(f"fake/{token}"),
                              headers=bearer(token))
        assert r.status_code == 404
    status = await client.get(served.url + "/relay/v1/status", headers=bearer(CHAT_TOKEN))
    metrics = await client.get(served.url + "/metrics", headers=bearer(CHAT_TOKEN))
    await wait_for(lambda: len(records(tmp_path)) == 4)
    seen = "\n".join([(tmp_path / "records.jsonl").read_text(), status.text, metrics.text,
                      caplog.text, json.dumps([r.getMessage() for r in caplog.records])])
    assert "agent" in seen and "[redacted]" in seen
    for token in (AGENT_TOKEN, CHAT_TOKEN, SERVER_TOKEN):
        assert token not in seen


async def test_relay_ps_names_the_client(nursery: trio.Nursery, tmp_path: Path,
                                         client: httpx.AsyncClient, tokens: None) -> None:
    served: Served = await start_relay(nursery, CONFIG, tmp_path)
    url = served.url + "/v1/chat/completions"

    async def slow(token: str) -> None:
        await client.post(url, json=chat("fake/echo?delay_s=1"), headers=bearer(token))

    nursery.start_soon(slow, AGENT_TOKEN)
    nursery.start_soon(slow, CHAT_TOKEN)

    async def requests() -> list[dict[str, Any]]:
        r = await client.get(served.url + "/relay/v1/status", headers=bearer(AGENT_TOKEN))
        return r.json()["requests"]  # type: ignore[no-any-return]

    with trio.fail_after(5):
        while len(listed := await requests()) < 2:
            await trio.sleep(0.01)
    assert sorted((r["client"], r["priority"]) for r in listed) == [
        ("agent", "background"), ("chat", "interactive")]
