"""``POST /v1/messages`` as Claude Code uses it (SPEC A6, issue 13), through the assembled relay.

The request is the one Claude Code 2.1.332 sends (its shape captured against a fake API):
system blocks with ``cache_control``, a ``role: "system"`` message after the user's turn,
``thinking``, ``context_management``, ``output_config``, ``metadata.user_id``, the
``anthropic-beta`` header — and ``tools: []`` when run with ``--tools ""``. Shown:

- an OpenAI-compatible provider gets it translated — the system message in its place, and
  nothing of the Messages dialect raw (before: a 400 for the system message, and
  ``thinking``, ``output_config``, ``context_management`` forwarded raw);
- a CLI-tool provider answers ``tools: []`` (before: a 400 for ``tools``), with the system
  message in the transcript; its default tools, only offered, are dropped and reported
  (SPEC A1a amended), and a required tool call is refused naming every field at once;
- the ``anthropic`` adapter gets the request unchanged: thinking and redacted-thinking
  blocks with their signatures byte for byte, ``cache_control``, ``anthropic-version`` and
  ``anthropic-beta``; the answer's thinking signature comes back to the client;
- every refusal of the guard under ``/v1/messages`` is Anthropic-shaped.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from fakes.fake_anthropic import KEY as ANTHROPIC_KEY
from fakes.fake_anthropic import FakeAnthropic, serve_fake_anthropic
from fakes.fake_anthropic import Script as AScript
from fakes.upstream import FakeUpstream, Script, serve_fake_upstream
from helpers.cli_procs import FAKE_CLI, open_cli_relay
from helpers.cloud_helpers import one_record, sse_blocks

from relay.adapters.http.anthropic import MessageReader
from relay.dialects.anthropic_messages import ANTHROPIC, parse_messages_body
from relay.dialects.base import Answer
from relay.vocab.events import Call, Delta, Finish, Usage

MESSAGES = "/v1/messages"
BETAS = ("claude-code-20250219,interleaved-thinking-2025-05-14,context-management-2025-06-27,"
         "effort-2025-11-24")
ENV = "# Environment\n - Primary working directory: /tmp/work\n - Platform: linux"
READ = {"name": "Read", "description": "Reads a file",
        "input_schema": {"type": "object", "properties": {"file_path": {"type": "string"}},
                         "required": ["file_path"]}}


def claude_code_body(tools: list[Any], **kw: Any) -> dict[str, Any]:
    """What Claude Code 2.1.332 sends for ``claude -p hello``."""
    return {
        "model": kw.pop("model", "up/m1"),
        "messages": kw.pop("messages", [
            {"role": "user", "content": "hello"},
            {"role": "system", "content": [{"type": "text", "text": ENV,
                                            "cache_control": {"type": "ephemeral"}}]}]),
        "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.332"},
                   {"type": "text", "text": "You are a Claude agent.",
                    "cache_control": {"type": "ephemeral"}}],
        "tools": tools,
        "metadata": {"user_id": json.dumps({"device_id": "d-1", "session_id": "s-1"})},
        "max_tokens": 32000,
        "thinking": {"type": "adaptive", "display": "omitted"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "high"},
        "stream": True, **kw}


HEADERS = {"anthropic-version": "2023-06-01", "anthropic-beta": BETAS, "x-api-key": "unused"}
# What the Messages dialect has that an OpenAI-compatible server must never see raw.
MESSAGES_ONLY = ("cache_control", "thinking", "context_management", "output_config",
                 "input_schema", "adaptive", "clear_thinking", "signature", "user_id")


def config(up: FakeUpstream, ant: FakeAnthropic, tmp_path: Path, extra: str = "") -> str:
    return f"""
[server]
records = "records.jsonl"
{extra}
[providers.up]
adapter = "openai"
base_url = "{up.url}"
models = ["m1"]
[providers.up.profile]
lanes = 2
queue_max = 4
queue_timeout_s = 10
run_timeout_s = 20
[providers.ant]
adapter = "anthropic"
base_url = "{ant.url}"
api_key_env = "RELAY_TEST_ANTHROPIC_KEY"
models = ["claude-x"]
[providers.ant.profile]
rpm = 0
[providers.claude]
adapter = "claude-cli"
command = "{FAKE_CLI / 'claude'}"
env = {{ FAKE_CLI_LOG = "{tmp_path / 'fake-cli.jsonl'}" }}
"""


@pytest.fixture
async def fakes(nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch
                ) -> tuple[FakeUpstream, FakeAnthropic]:
    monkeypatch.setenv("RELAY_TEST_ANTHROPIC_KEY", ANTHROPIC_KEY)
    up: FakeUpstream = await nursery.start(serve_fake_upstream)
    ant: FakeAnthropic = await nursery.start(serve_fake_anthropic)
    return up, ant


def names(r: httpx.Response) -> set[str]:
    value = r.headers.get("x-relay-ignored-fields")
    return set(value.split(", ")) if value else set()


async def test_claude_codes_request_through_an_openai_compatible_provider(
        fakes: Any, tmp_path: Path) -> None:
    up, ant = fakes
    up.scripts["m1"] = Script(chunks=[], tool_calls=[{
        "id": "call_1", "type": "function",
        "function": {"name": "Read", "arguments": '{"file_path": "/tmp/work/a.txt"}'}}])
    async with open_cli_relay(config(up, ant, tmp_path), tmp_path) as served, \
            httpx.AsyncClient(trust_env=False, timeout=30) as client:
        r = await client.post(served.url + MESSAGES, json=claude_code_body([READ]),
                              headers=HEADERS)
        assert r.status_code == 200, r.text
        events = sse_blocks(r.text)
        starts = [d["content_block"] for n, d in events if n == "content_block_start"]
        assert starts == [{"type": "tool_use", "id": "call_1", "name": "Read", "input": {}}]
        stop = next(d for n, d in events if n == "message_delta")["delta"]["stop_reason"]
        assert stop == "tool_use"
    sent = up.requests[-1]
    body = sent.json
    assert [m["role"] for m in body["messages"]] == ["system", "user", "system"]
    assert body["messages"][1:] == [{"role": "user", "content": "hello"},
                                    {"role": "system", "content": ENV}]
    assert body["tools"] == [{"type": "function", "function": {
        "name": "Read", "description": "Reads a file", "parameters": READ["input_schema"]}}]
    assert body["max_tokens"] == 32000
    assert body["user"] == claude_code_body([])["metadata"]["user_id"]   # translated
    raw = sent.body.decode()
    leaked = [word for word in MESSAGES_ONLY if word in raw]
    assert not leaked, (leaked, raw)
    assert "anthropic-beta" not in sent.headers
    assert names(r) == {"thinking", "context_management", "output_config.effort",
                        "cache_control"}
    rec = await one_record(tmp_path)
    assert set(rec["ignored_fields"]) == names(r)


async def test_claude_code_with_no_tools_through_a_cli_provider(fakes: Any,
                                                                 tmp_path: Path) -> None:
    async with open_cli_relay(config(*fakes, tmp_path), tmp_path) as served, \
            httpx.AsyncClient(trust_env=False, timeout=30) as client:
        r = await client.post(served.url + MESSAGES, headers=HEADERS, json=claude_code_body(
            [], model="claude/echo", tool_choice={"type": "auto"}, stream=False))
        assert r.status_code == 200, r.text
        text = r.json()["content"][-1]["text"]
        # The system prompt goes by the tool's option; the mid-conversation system
        # message is a turn of the transcript, after the user's.
        assert text.startswith("system=x-anthropic-billing-header"), text
        assert "User: hello\n\nSystem: # Environment" in text, text
        assert {"thinking", "max_tokens", "metadata"} <= names(r)

        # Its default tools, only offered, are dropped and reported: it answers as chat.
        r = await client.post(served.url + MESSAGES, headers=HEADERS, json=claude_code_body(
            [{**READ, "defer_loading": True}], model="claude/echo", stream=False))
        assert r.status_code == 200, r.text
        assert "tools" in names(r) and "tools.defer_loading" not in names(r), names(r)
        assert "Reads a file" not in r.json()["content"][-1]["text"]   # never sent on

        # A tool call required is refused, naming every refused field at once, in
        # Anthropic's shape.
        r = await client.post(served.url + MESSAGES, headers=HEADERS, json=claude_code_body(
            [READ], model="claude/echo", tool_choice={"type": "any"},
            stop_sequences=["END"]))
        assert r.status_code == 400, r.text
        error = r.json()
        assert error["type"] == "error"
        assert error["error"]["type"] == "invalid_request_error"
        assert error["error"]["relay"]["code"] == "unsupported"
        assert error["error"]["relay"]["param"] == "stop_sequences, tools, tool_choice"
        for name in ("'tools'", "'tool_choice'", "'stop_sequences'"):
            assert name in error["error"]["message"], error


HISTORY = [
    {"role": "user", "content": "read a.txt"},
    {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "I should read it.",
         "signature": "EqQBCkYIBxgCKkBz+/=ö\\u00e9sig"},
        {"type": "redacted_thinking", "data": "EmwKAhgBEgy3va3pzix/LafPsn4a"},
        {"type": "tool_use", "id": "toolu_1", "name": "Read",
         "input": {"file_path": "/tmp/work/a.txt"}}]},
    {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "SECRET-42",
         "cache_control": {"type": "ephemeral"}}]},
    {"role": "system", "content": "Reminder: be brief."},
]


async def test_claude_codes_request_reaches_anthropic_unchanged(fakes: Any,
                                                                tmp_path: Path) -> None:
    up, ant = fakes
    ant.scripts["claude-x"] = AScript(chunks=["It says ", "SECRET-42."],
                                      thinking=["deep ", "thought"])
    body = claude_code_body([READ], model="ant/claude-x", messages=copy.deepcopy(HISTORY),
                            brand_new_field={"kept": True})
    headers = {**HEADERS, "anthropic-version": "2023-01-01"}
    async with open_cli_relay(config(up, ant, tmp_path), tmp_path) as served, \
            httpx.AsyncClient(trust_env=False, timeout=30) as client:
        r = await client.post(served.url + MESSAGES, json=body, headers=headers)
        assert r.status_code == 200, r.text
        assert "x-relay-ignored-fields" not in r.headers   # nothing dropped: all passed
        events = sse_blocks(r.text)
        plain = await client.post(served.url + MESSAGES, json={**body, "stream": False},
                                  headers=headers)
    sent = [x for x in ant.requests if x.method == "POST"]
    assert len(sent) == 2
    assert sent[0].json == {**body, "model": "claude-x"}          # every field as sent
    assert sent[1].json == {**body, "model": "claude-x", "stream": False} or \
        sent[1].json == {k: v for k, v in {**body, "model": "claude-x"}.items()
                         if k != "stream"}
    assert sent[0].headers["anthropic-version"] == "2023-01-01"   # the client's
    assert sent[0].headers["anthropic-beta"] == BETAS
    # The answer's thinking comes back with its signature (for the next turn to send).
    deltas = [d["delta"] for n, d in events if n == "content_block_delta"]
    assert {"type": "signature_delta", "signature": "sig"} in deltas
    assert "".join(d.get("thinking", "") for d in deltas) == "deep thought"
    assert plain.json()["content"][0] == {"type": "thinking", "thinking": "deep thought",
                                          "signature": "sig"}


async def test_thinking_history_to_an_openai_compatible_provider_is_dropped_and_reported(
        fakes: Any, tmp_path: Path) -> None:
    up, ant = fakes
    async with open_cli_relay(config(up, ant, tmp_path), tmp_path) as served, \
            httpx.AsyncClient(trust_env=False, timeout=30) as client:
        r = await client.post(served.url + MESSAGES, headers=HEADERS, json=claude_code_body(
            [READ], messages=copy.deepcopy(HISTORY), stream=False))
        assert r.status_code == 200, r.text
    raw = up.requests[-1].body.decode()
    assert not [w for w in (*MESSAGES_ONLY, "redacted", "EqQB", "EmwK") if w in raw], raw
    body = up.requests[-1].json
    assert body["messages"][-3:] == [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "toolu_1", "type": "function", "function": {
                "name": "Read", "arguments": '{"file_path": "/tmp/work/a.txt"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "SECRET-42"},
        {"role": "system", "content": "Reminder: be brief."}]
    assert {"content.thinking", "content.redacted_thinking", "cache_control",
            "thinking"} <= names(r)


def test_the_native_request_continues_a_partly_sent_answer() -> None:
    """A fallback to the anthropic adapter after part of an answer reached the client
    (SPEC F8) continues it: relay's continuation comes after the client's own turns."""
    from relay.adapters.http.anthropic_request import native_request  # new in issue 13

    chat = parse_messages_body(json.dumps(claude_code_body(
        [], model="ant/x", messages=copy.deepcopy(HISTORY), stream=False)).encode())
    call = Call(request_id="r", provider="ant", model="claude-x",
                messages=[*chat.messages, {"role": "assistant", "content": "It says "}],
                stream=True, params=chat.params, inbound=chat.inbound)
    native = native_request(call)
    assert native is not None
    body, strip = native
    assert strip == " "   # Anthropic refuses a final assistant text ending in whitespace
    assert body["model"] == "claude-x" and body["stream"] is True
    assert body["messages"][:-1] == HISTORY   # the client's turns, untouched
    assert body["messages"][-1] == {"role": "assistant",
                                    "content": [{"type": "text", "text": "It says"}]}
    assert chat.inbound.body is not None and chat.inbound.body["messages"] == HISTORY
    plain = Call(request_id="r", provider="ant", model="claude-x", messages=chat.messages,
                 stream=False, params=chat.params, inbound=chat.inbound)
    assert native_request(plain) == ({k: v for k, v in {**chat.inbound.body,
                                                        "model": "claude-x"}.items()
                                      if k != "stream"}, "")


def test_redacted_thinking_and_signatures_come_back_to_a_messages_client() -> None:
    reader = MessageReader("ant")
    events = reader.whole({"content": [
        {"type": "thinking", "thinking": "hmm", "signature": "sig-1"},
        {"type": "redacted_thinking", "data": "opaque-1"},
        {"type": "text", "text": "Hi"}], "stop_reason": "end_turn", "usage": {}})
    assert events[:3] == [Delta(extra={"reasoning_content": "hmm"}),
                          Delta(extra={"reasoning_signature": "sig-1"}),
                          Delta(extra={"redacted_thinking": "opaque-1"})]
    answer = Answer(id="a", created=0, model="ant/x", usage=Usage(1, 1, 2), choices={0: {
        "index": 0, "finish_reason": "stop", "message": {
            "role": "assistant", "content": "Hi", "reasoning_content": "hmm",
            "reasoning_signature": "sig-1", "redacted_thinking": "opaque-1"}}})
    assert ANTHROPIC.render(answer)["content"] == [
        {"type": "thinking", "thinking": "hmm", "signature": "sig-1"},
        {"type": "redacted_thinking", "data": "opaque-1"},
        {"type": "text", "text": "Hi"}]
    enc = ANTHROPIC.encoder("a", 0, True)
    enc.begin("ant/x")
    out = b"".join(enc.delta(e) for e in events if isinstance(e, Delta))
    out += enc.finish(Finish("stop")) + enc.done()
    blocks = [(n, d) for n, d in sse_blocks(out.decode()) if n and n.startswith("content")]
    assert [(n, d.get("content_block") or d.get("delta")) for n, d in blocks] == [
        ("content_block_start", {"type": "thinking", "thinking": "", "signature": ""}),
        ("content_block_delta", {"type": "thinking_delta", "thinking": "hmm"}),
        ("content_block_delta", {"type": "signature_delta", "signature": "sig-1"}),
        ("content_block_stop", None),
        ("content_block_start", {"type": "redacted_thinking", "data": "opaque-1"}),
        ("content_block_stop", None),
        ("content_block_start", {"type": "text", "text": ""}),
        ("content_block_delta", {"type": "text_delta", "text": "Hi"}),
        ("content_block_stop", None)]


# --- the guard's refusals, under /v1/messages -------------------------------------------

def anthropic_shaped(status: int, raw: bytes, reason: str) -> None:
    data = json.loads(raw)
    assert data["type"] == "error", data
    assert data["error"]["relay"]["reason"] == reason, data
    assert isinstance(data["error"]["type"], str) and data["error"]["message"]
    assert "code" in data["error"]["relay"]


async def raw_exchange(port: int, head: str, body: bytes = b"") -> tuple[int, bytes]:
    """One request on a raw socket (a Host header of our choosing, a body that stalls)."""
    sock = await trio.open_tcp_stream("127.0.0.1", port)
    async with sock:
        await sock.send_all(head.encode() + body)
        raw = b""
        with trio.fail_after(5):
            while True:
                data = await sock.receive_some(65536)
                raw += data
                head_, sep, rest = raw.partition(b"\r\n\r\n")
                if sep:
                    length = next((int(line.split(b":")[1]) for line in head_.split(b"\r\n")
                                   if line.lower().startswith(b"content-length:")), None)
                    if length is not None and len(rest) >= length:
                        return int(head_.split()[1]), rest[:length]
                assert data, raw


@pytest.mark.parametrize("path", [MESSAGES, "/v1/messages/count_tokens"])
async def test_every_guard_refusal_under_messages_is_anthropic_shaped(
        fakes: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    monkeypatch.setenv("RELAY_TEST_TOKEN", "s3cret-token")
    text = config(*fakes, tmp_path, 'token_env = "RELAY_TEST_TOKEN"\nmax_body_bytes = 2048\n'
                  "body_timeout_s = 0.5")
    async with open_cli_relay(text, tmp_path) as served, httpx.AsyncClient(
            trust_env=False, timeout=30) as client:
        url, port = served.url + path, int(served.url.rpartition(":")[2])
        auth = {"x-api-key": "s3cret-token"}
        small = {"model": "ant/claude-x", "max_tokens": 5,
                 "messages": [{"role": "user", "content": "hi"}]}
        r = await client.post(url, json=small, headers={**auth, "host": "evil.example"})
        assert r.status_code == 403
        anthropic_shaped(403, r.content, "bad_host")
        r = await client.post(url, json=small)
        assert r.status_code == 401
        anthropic_shaped(401, r.content, "unauthorized")
        r = await client.post(url, content=b"x=1", headers={
            **auth, "content-type": "application/x-www-form-urlencoded"})
        assert r.status_code == 415
        anthropic_shaped(415, r.content, "invalid_request")
        r = await client.post(url, json={**small, "pad": "x" * 3000}, headers=auth)
        assert r.status_code == 413
        anthropic_shaped(413, r.content, "invalid_request")
        status, raw = await raw_exchange(port, (
            f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nx-api-key: s3cret-token\r\n"
            "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n"), b'{"model":')
        assert status == 408
        anthropic_shaped(408, raw, "invalid_request")
        if path == MESSAGES:
            r = await client.get(url, headers=auth)
            assert r.status_code == 405
            anthropic_shaped(405, r.content, "invalid_request")
