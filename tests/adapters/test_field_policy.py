"""The field policy (SPEC A1a): every field of every dialect, through every adapter kind.

First the table itself: every known field has a treatment in every adapter kind's column
(a field added to a dialect without one fails here), and the treatments SPEC A1a names
are the ones the columns give. Then the walk, through the assembled relay: every field of
the OpenAI chat dialect and of the Messages dialect, sent to a provider of every kind
(fake upstreams behind the HTTP adapters, the fake CLI tools behind the CLI ones), must be
refused by name, or answered — its advisory drops named in ``X-Relay-Ignored-Fields`` —
and nothing of one dialect may reach a provider of another raw: what each fake upstream
received is checked against that upstream's own dialect.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from fakes.fake_anthropic import KEY as ANTHROPIC_KEY
from fakes.fake_anthropic import FakeAnthropic, serve_fake_anthropic
from fakes.fake_gemini import KEY as GEMINI_KEY
from fakes.fake_gemini import FakeGemini, serve_fake_gemini
from fakes.upstream import FakeUpstream, serve_fake_upstream
from helpers.assembled import records, start_relay, wait_for
from helpers.cli_procs import open_cli_relay
from helpers.cloud_helpers import every_kind_config

from relay import Served
from relay.adapters import ADAPTERS
from relay.api.fields import (
    ADVISORY,
    CHAT_FIELDS,
    NEUTRAL,
    OWN_FIELDS,
    PASSED,
    REFUSED,
    RELAY_FIELDS,
    TRANSLATED,
    admit,
)
from relay.dialects.anthropic_messages import parse_messages_body
from relay.dialects.openai_chat import OPENAI
from relay.vocab.errors import RelayError
from relay.vocab.events import Call

TOOL = {"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {}}}}
ATOOL = {"name": "f", "input_schema": {"type": "object", "properties": {}}}
HISTORY = [{"role": "user", "content": "hi there"}]

# An example that asks for something, for every chat-level field (the field first; any
# companion it needs after it). Values are distinctive, so a leak is found by its value.
CHAT_EXAMPLES: dict[str, dict[str, Any]] = {
    "temperature": {"temperature": 0.123}, "top_p": {"top_p": 0.456},
    "top_k": {"top_k": 17}, "presence_penalty": {"presence_penalty": 0.31},
    "frequency_penalty": {"frequency_penalty": 0.32}, "seed": {"seed": 424242},
    "reasoning_effort": {"reasoning_effort": "low"}, "verbosity": {"verbosity": "high"},
    "user": {"user": "user-7"}, "metadata": {"metadata": {"tag": "meta-7"}},
    "safety_identifier": {"safety_identifier": "safety-7"}, "store": {"store": True},
    "service_tier": {"service_tier": "flex"},
    "prompt_cache_key": {"prompt_cache_key": "cache-key-7"},
    "prompt_cache_retention": {"prompt_cache_retention": "24h"},
    "prompt_cache_options": {"prompt_cache_options": {"mode": "explicit"}},
    "prediction": {"prediction": {"type": "content", "content": "predicted-7"}},
    "max_tokens": {"max_tokens": 77}, "max_completion_tokens": {"max_completion_tokens": 78},
    "stream_options": {"stream_options": {"include_usage": True}},
    "tools": {"tools": [TOOL]}, "tool_choice": {"tool_choice": "required"},
    "parallel_tool_calls": {"parallel_tool_calls": False, "tools": [TOOL]},
    "functions": {"functions": [{"name": "g", "parameters": {"type": "object"}}]},
    "function_call": {"function_call": "auto",
                      "functions": [{"name": "g", "parameters": {"type": "object"}}]},
    "stop": {"stop": ["STOP-7"]}, "n": {"n": 2}, "logprobs": {"logprobs": True},
    "top_logprobs": {"top_logprobs": 3, "logprobs": True},
    "logit_bias": {"logit_bias": {"50256": -100}},
    "response_format": {"response_format": {"type": "json_object"}},
    "modalities": {"modalities": ["text", "audio"]},
    "audio": {"audio": {"voice": "alloy", "format": "wav"}},
    "web_search_options": {"web_search_options": {"search_context_size": "low"}},
    "moderation": {"moderation": {"mode": "block"}},
}
# Messages fields: the dialect's own, and those it translates into chat terms.
THINKING = {"role": "assistant", "content": [
    {"type": "thinking", "thinking": "hmm", "signature": "sig-7"},
    {"type": "text", "text": "so"}]}
OWN_EXAMPLES: dict[str, dict[str, Any]] = {
    "thinking": {"thinking": {"type": "enabled", "budget_tokens": 2048}},
    "content.thinking": {"messages": [*HISTORY, THINKING, *HISTORY]},
    "content.redacted_thinking": {"messages": [*HISTORY, {"role": "assistant", "content": [
        {"type": "redacted_thinking", "data": "redacted-7"}]}, *HISTORY]},
    "cache_control": {"system": [{"type": "text", "text": "sys",
                                  "cache_control": {"type": "ephemeral"}}]},
    "context_management": {"context_management": {"edits": [
        {"type": "clear_thinking_20251015", "keep": "all"}]}},
    "output_config.effort": {"output_config": {"effort": "high"}},
    "service_tier": {"service_tier": "standard_only"}, "inference_geo": {"inference_geo": "us"},
    "speed": {"speed": "fast"}, "diagnostics": {"diagnostics": {"previous_message_id": "m"}},
    "user_profile_id": {"user_profile_id": "profile-7"},
    "workspace_id": {"workspace_id": "wrkspc_7"},
    "tools.defer_loading": {"tools": [{**ATOOL, "defer_loading": True}]},
    "tools.eager_input_streaming": {"tools": [{**ATOOL, "eager_input_streaming": True}]},
    "tools.input_examples": {"tools": [{**ATOOL, "input_examples": [{"x": 1}]}]},
    "tools.allowed_callers": {"tools": [{**ATOOL, "allowed_callers": ["direct"]}]},
    "container": {"container": "container-7"},
    "mcp_servers": {"mcp_servers": [{"type": "url", "url": "https://x.test", "name": "x"}]},
}
MESSAGES_CHAT_EXAMPLES: dict[str, dict[str, Any]] = {
    "stop_sequences": {"stop_sequences": ["STOP-7"]}, "temperature": {"temperature": 0.123},
    "top_p": {"top_p": 0.456}, "top_k": {"top_k": 17}, "tools": {"tools": [ATOOL]},
    "tool_choice": {"tool_choice": {"type": "any"}, "tools": [ATOOL]},
    "tool_choice.disable_parallel_tool_use": {"tool_choice": {
        "type": "auto", "disable_parallel_tool_use": True}, "tools": [ATOOL]},
    "metadata": {"metadata": {"user_id": "user-7"}},
    "output_config.format": {"output_config": {"format": {"type": "json_schema",
                                                          "schema": {"type": "object"}}}},
    "mid-conversation system": {"messages": [*HISTORY, {"role": "system", "content": "s"},
                                             *HISTORY]},
    "unknown field": {"brand_new_field": {"x": 1}},
}
KINDS = list(ADAPTERS)
NON_NATIVE = {"openai": [k for k in KINDS if ADAPTERS[k].fields.speaks != "openai"],
              "anthropic": [k for k in KINDS if ADAPTERS[k].fields.speaks != "anthropic"]}


# --- the table ------------------------------------------------------------------------------

def test_every_known_field_has_a_treatment_in_every_column() -> None:
    missing = [(kind, name) for kind in KINDS for name in CHAT_FIELDS
               if name not in ADAPTERS[kind].fields.rules]
    assert not missing, f"fields without a treatment: {missing}"
    for kind in KINDS:
        column = ADAPTERS[kind].fields
        assert set(column.rules) <= set(CHAT_FIELDS), kind   # no rule for an unknown name
        for dialect, own in OWN_FIELDS.items():
            assert {d for d, _ in column.own} <= set(OWN_FIELDS), kind
            assert {n for d, n in column.own if d == dialect} <= set(own), kind
            if column.speaks != dialect:   # another dialect's fields are never passed raw
                assert all(column.treat_own(dialect, name, "x", {}) is not PASSED
                           for name in own), kind
    # The walk below covers every field: a new one needs an example there.
    assert set(CHAT_EXAMPLES) == set(CHAT_FIELDS)
    assert set(OWN_EXAMPLES) == set(OWN_FIELDS["anthropic"])


def test_what_relay_reads_itself_is_no_providers_field() -> None:
    for dialect, fields in RELAY_FIELDS.items():
        body = {"model": "m", "messages": HISTORY, "stream": False, "system": "s",
                "max_tokens": 5, "fallbacks": ["fake/echo"]}
        body = {k: v for k, v in body.items() if k in fields or k == "max_tokens"}
        if dialect == "anthropic":
            chat = parse_messages_body(json.dumps(body).encode())
            assert chat.inbound.body is not None and "fallbacks" not in chat.inbound.body
        else:
            chat = OPENAI.parse(json.dumps(body).encode())
        assert chat.fallbacks == ["fake/echo"]
        assert not set(chat.params) & fields and not set(chat.inbound.own) & fields


@pytest.mark.parametrize("dialect", ["openai", "anthropic"])
def test_stream_null_asks_for_nothing(dialect: str) -> None:
    body = {"model": "m", "messages": HISTORY, "stream": None, "max_tokens": 5}
    parse = parse_messages_body if dialect == "anthropic" else OPENAI.parse
    chat = parse(json.dumps(body).encode())
    assert chat.stream is False and "stream" not in chat.params
    with pytest.raises(RelayError) as info:
        parse(json.dumps({**body, "stream": "yes"}).encode())
    assert info.value.param == "stream"


def treat(kind: str, name: str, value: Any, params: dict[str, Any] | None = None) -> Any:
    return ADAPTERS[kind].fields.treat(name, value, params or {})


@pytest.mark.parametrize("kind", NON_NATIVE["openai"])
def test_what_spec_a1a_names_is_treated_so(kind: str) -> None:
    """SPEC A1a's own examples, column by column (independent of how the table is built)."""
    adapter = ADAPTERS[kind]
    # neutral: a value that asks for nothing, for every kind
    assert treat(kind, "tools", []) is NEUTRAL
    assert treat(kind, "tool_choice", "auto") is NEUTRAL
    assert treat(kind, "tool_choice", "none") is NEUTRAL
    assert treat(kind, "parallel_tool_calls", True) is NEUTRAL
    assert treat(kind, "n", 1) is NEUTRAL
    assert treat(kind, "temperature", None) is NEUTRAL
    # refused: what the answer would silently lose
    assert treat(kind, "logprobs", True) is REFUSED
    assert treat(kind, "n", 2) in (REFUSED, TRANSLATED)
    # tools: offered (tool_choice absent or auto) are advisory without tool calls; a
    # required tool call is refused, with the tools (the amended A1a)
    tools = treat(kind, "tools", [TOOL])
    assert tools is (TRANSLATED if adapter.capabilities.tools else ADVISORY)
    for choice in ("auto", "none"):
        offered = {"tools": [TOOL], "tool_choice": choice}
        assert treat(kind, "tools", [TOOL], offered) is tools
        if not adapter.capabilities.tools:
            assert treat(kind, "tool_choice", choice, offered) is NEUTRAL
            assert treat(kind, "parallel_tool_calls", False, offered) is NEUTRAL
    for choice in ("required", {"type": "function", "function": {"name": "f"}}):
        required = {"tools": [TOOL], "tool_choice": choice}
        want = TRANSLATED if adapter.capabilities.tools else REFUSED
        assert treat(kind, "tools", [TOOL], required) is want, choice
        assert treat(kind, "tool_choice", choice, required) is want, choice
    if kind in ("fake", "anthropic", "claude-cli", "codex-cli", "gemini-cli"):
        assert treat(kind, "response_format", {"type": "json_object"}) is REFUSED
    # advisory: hints, dropped and reported
    hints = ["seed", "reasoning_effort", "metadata", "prompt_cache_key", "presence_penalty",
             "frequency_penalty"]
    if kind.endswith("-cli"):
        hints += ["temperature", "top_p", "top_k", "max_tokens", "max_completion_tokens",
                  "user"]
    for name in hints:
        expected = TRANSLATED if kind == "gemini" and name in (
            "seed", "presence_penalty", "frequency_penalty") else ADVISORY
        assert treat(kind, name, CHAT_EXAMPLES[name][name]) is expected, (kind, name)
    # a field the table does not know is refused, never forwarded raw
    assert treat(kind, "brand_new_field", 1) is REFUSED


@pytest.mark.parametrize("kind", NON_NATIVE["anthropic"])
def test_the_messages_own_fields_elsewhere(kind: str) -> None:
    column = ADAPTERS[kind].fields
    for name in ("thinking", "output_config.effort", "context_management",
                 "content.thinking", "cache_control"):
        assert column.treat_own("anthropic", name, {"x": 1}, {}) is ADVISORY, name
    assert column.treat_own("anthropic", "thinking", {"type": "disabled"}, {}) is NEUTRAL
    assert column.treat_own("anthropic", "brand_new_field", 1, {}) is REFUSED


def test_strict_fields_refuses_the_advisory_ones() -> None:
    call = Call(request_id="r", provider="p", model="m", messages=HISTORY, stream=False,
                params={"temperature": 0.5, "n": 1})
    admitted = admit(ADAPTERS["claude-cli"].fields, call, provider="p", kind="claude-cli")
    assert admitted.ignored == ("temperature",) and admitted.call.params == {}
    with pytest.raises(RelayError) as info:
        admit(ADAPTERS["claude-cli"].fields, call, provider="p", kind="claude-cli",
              strict=True)
    assert (info.value.reason, info.value.param) == ("unsupported", "temperature")
    assert "strict_fields" in info.value.message


# --- the walk, through the assembled relay ----------------------------------------------

class Fakes:
    def __init__(self, up: FakeUpstream, ant: FakeAnthropic, gem: FakeGemini) -> None:
        self.up, self.ant, self.gem = up, ant, gem


@pytest.fixture
async def walk(nursery: trio.Nursery, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
               ) -> AsyncIterator[tuple[Served, Fakes, httpx.AsyncClient]]:
    monkeypatch.setenv("RELAY_TEST_ANTHROPIC_KEY", ANTHROPIC_KEY)
    monkeypatch.setenv("RELAY_TEST_GEMINI_KEY", GEMINI_KEY)
    up: FakeUpstream = await nursery.start(serve_fake_upstream)
    ant: FakeAnthropic = await nursery.start(serve_fake_anthropic)
    gem: FakeGemini = await nursery.start(serve_fake_gemini)
    log = tmp_path / "fake-cli.jsonl"
    text = every_kind_config(up.url, ant.url, gem.url, log)
    async with open_cli_relay(text, tmp_path) as served, httpx.AsyncClient(
            trust_env=False, timeout=30) as client:
        yield served, Fakes(up, ant, gem), client


MODEL = {"fake": "fake/echo", "openai": "up/m1", "anthropic": "ant/claude-x",
         "gemini": "gem/g", "claude-cli": "claude/ok", "codex-cli": "codex/ok",
         "gemini-cli": "gemini/ok"}
PROVIDER = {kind: model.partition("/")[0] for kind, model in MODEL.items()}
# What a request to each upstream may hold at its top level: its own dialect's fields.
MESSAGES_KEYS = {"model", "messages", "max_tokens", "system", "stream", "stop_sequences",
                 "temperature", "top_p", "top_k", "tools", "tool_choice", "metadata"}
GEMINI_KEYS = {"contents", "systemInstruction", "generationConfig", "tools", "toolConfig"}
CHAT_KEYS = {"model", "messages", "stream", *CHAT_FIELDS}
# Messages-only words that must never appear in an OpenAI or Gemini request.
MESSAGES_ONLY = ("input_schema", "cache_control", "stop_sequences", "tool_use", "thinking",
                 "redacted_thinking", "signature", "context_management", "output_config",
                 "defer_loading", "budget_tokens", "user_id", "sig-7", "redacted-7")


def expected(kind: str, dialect: str, fields: dict[str, Any]
             ) -> tuple[RelayError | None, tuple[str, ...]]:
    """What the column says of a request with ``fields``: its refusal, or what it drops."""
    body = {"model": MODEL[kind], "messages": HISTORY, **fields}
    if dialect == "anthropic":
        chat = parse_messages_body(json.dumps({"max_tokens": 64, **body}).encode())
    else:
        chat = OPENAI.parse(json.dumps(body).encode())
    call = Call(request_id="r", provider=PROVIDER[kind], model="m", messages=chat.messages,
                stream=True, params=chat.params, inbound=chat.inbound)
    adapter = ADAPTERS[kind]
    try:
        return None, admit(adapter.fields, call, provider=PROVIDER[kind], kind=kind).ignored
    except RelayError as exc:
        return exc, ()


async def send(walk: Any, kind: str, dialect: str, fields: dict[str, Any]
               ) -> tuple[httpx.Response, Any]:
    """One streamed request to ``kind``; what its upstream received (or None)."""
    served, fakes, client = walk
    upstream = {"openai": fakes.up, "anthropic": fakes.ant, "gemini": fakes.gem}.get(kind)
    before = len(upstream.requests) if upstream else 0
    body: dict[str, Any] = {"model": MODEL[kind], "messages": HISTORY, "stream": True}
    if dialect == "anthropic":
        body["max_tokens"] = 64
    body.update(fields)
    path = "/v1/messages" if dialect == "anthropic" else "/v1/chat/completions"
    resp = await client.post(served.url + path, json=body)
    got = [r for r in upstream.requests[before:] if r.method == "POST"] if upstream else []
    return resp, (got[-1].json if got else None)


def check(kind: str, dialect: str, fields: dict[str, Any], resp: httpx.Response,
          sent: Any) -> None:
    """The answer agrees with the column, and the upstream got only its own dialect."""
    refusal, ignored = expected(kind, dialect, fields)
    where = (kind, dialect, fields)
    if refusal is not None:
        assert resp.status_code == 400, (where, resp.text)
        text = resp.text
        assert '"unsupported"' in text and f'"param":"{refusal.param}"' in text, (where, text)
        assert sent is None, where   # refused before anything reached the provider
        return
    assert resp.status_code == 200, (where, resp.text)
    header = resp.headers.get("x-relay-ignored-fields")
    assert (header.split(", ") if header else []) == list(ignored), (where, header, ignored)
    if sent is None:
        assert kind not in ("openai", "anthropic", "gemini"), where
        return
    raw = json.dumps(sent)
    if kind == "anthropic":
        if dialect == "anthropic":   # passed: every field as the client sent it
            for key, value in fields.items():
                assert sent[key] == value, (where, sent)
        else:
            assert set(sent) <= MESSAGES_KEYS, (where, sorted(sent))
    elif kind == "gemini":
        assert set(sent) <= GEMINI_KEYS, (where, sorted(sent))
    else:
        assert set(sent) <= CHAT_KEYS, (where, sorted(sent))
    if kind != "anthropic" and dialect == "anthropic":
        leaked = [w for w in MESSAGES_ONLY if w in raw]
        assert not leaked, (where, leaked, raw)
    for name in ignored:   # what was dropped is nowhere in what was sent
        if name in fields and not isinstance(fields[name], bool):
            assert json.dumps(fields[name]) not in raw, (where, name, raw)


HTTP_KINDS = ["fake", "openai", "anthropic", "gemini"]


@pytest.mark.parametrize("kind", HTTP_KINDS)
async def test_every_chat_field_through_every_kind(walk: Any, kind: str) -> None:
    for fields in CHAT_EXAMPLES.values():
        resp, sent = await send(walk, kind, "openai", fields)
        check(kind, "openai", fields, resp, sent)


@pytest.mark.parametrize("kind", HTTP_KINDS)
async def test_every_messages_field_through_every_kind(walk: Any, kind: str) -> None:
    for fields in [*OWN_EXAMPLES.values(), *MESSAGES_CHAT_EXAMPLES.values()]:
        resp, sent = await send(walk, kind, "anthropic", fields)
        check(kind, "anthropic", fields, resp, sent)


@pytest.mark.parametrize("kind", ["claude-cli", "codex-cli", "gemini-cli"])
async def test_every_field_through_every_cli_kind(walk: Any, kind: str) -> None:
    """A tool run per request costs time: the refused fields one by one (nothing runs),
    the ones it accepts all in one request per dialect."""
    for dialect, examples in (("openai", CHAT_EXAMPLES),
                              ("anthropic", {**OWN_EXAMPLES, **MESSAGES_CHAT_EXAMPLES})):
        accepted: dict[str, Any] = {}
        for fields in examples.values():
            refusal, _ = expected(kind, dialect, fields)
            if refusal is not None or "messages" in fields:
                resp, sent = await send(walk, kind, dialect, fields)
                check(kind, dialect, fields, resp, sent)
            else:
                accepted.update(fields)
        resp, sent = await send(walk, kind, dialect, accepted)
        check(kind, dialect, accepted, resp, sent)


# --- offered tools on a provider without tool calls; every refusal at once (issue 27) -----

RTOOL = {"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}}
# (path, body with offered tools, the same requiring a call) per dialect
OFFERED: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "openai": ("/v1/chat/completions",
               {"messages": HISTORY, "tools": [TOOL], "tool_choice": "auto",
                "parallel_tool_calls": False},
               {"tool_choice": "required"}),
    "anthropic": ("/v1/messages",
                  {"messages": HISTORY, "max_tokens": 64, "tools": [
                      {**ATOOL, "defer_loading": True}],
                   "tool_choice": {"type": "auto", "disable_parallel_tool_use": True}},
                  {"tool_choice": {"type": "any"}}),
    "responses": ("/v1/responses",
                  {"input": "hi there", "tools": [RTOOL, {"type": "web_search"}],
                   "tool_choice": "auto", "parallel_tool_calls": False},
                  {"tool_choice": {"type": "function", "name": "f"}}),
}


def error_of(dialect: str, resp: httpx.Response) -> dict[str, Any]:
    """The E1 fields of a refusal in the dialect's own shape."""
    body = resp.json()
    if dialect == "anthropic":
        assert body["type"] == "error", body
        return {**body["error"]["relay"], "message": body["error"]["message"]}
    return body["error"]


@pytest.mark.parametrize("dialect", list(OFFERED))
@pytest.mark.parametrize("stream", [False, True])
async def test_offered_tools_are_advisory_on_fake_echo(walk: Any, tmp_path: Path,
                                                       dialect: str, stream: bool) -> None:
    """Offered tools are dropped and reported — the header and the record — and the
    answer is the fake's echo; a required tool call is a 400 naming the tool fields."""
    served, _fakes, client = walk
    path, body, required = OFFERED[dialect]
    body = {"model": "fake/echo", "stream": stream, **body}
    resp = await client.post(served.url + path, json=body)
    assert resp.status_code == 200, resp.text
    header = resp.headers["x-relay-ignored-fields"].split(", ")
    assert "tools" in header, header
    assert not {"tool_choice", "parallel_tool_calls",
                "tool_choice.disable_parallel_tool_use", "tools.defer_loading"} & set(header)
    assert "there" in resp.text   # the echo (streamed: word by word)
    rec = records(tmp_path)[-1]
    assert rec["status"] == 200 and "tools" in rec["ignored_fields"], rec
    if dialect == "responses":
        assert "tools.web_search" in header and "tools.web_search" in rec["ignored_fields"]

    resp = await client.post(served.url + path, json={**body, **required})
    assert resp.status_code == 400, resp.text
    error = error_of(dialect, resp)
    assert error["code"] == "unsupported", error
    assert {"tools", "tool_choice"} <= set(error["param"].split(", ")), error
    assert "'tools'" in error["message"] and "'tool_choice'" in error["message"], error


# Several refused fields in one request, per dialect: (body, the fields the 400 names).
MANY: dict[str, tuple[dict[str, Any], str]] = {
    "openai": ({"messages": HISTORY, "n": 2, "parallel_tool_calls": False, "logprobs": True,
                "tools": [TOOL], "tool_choice": "required"},
               "n, parallel_tool_calls, logprobs, tools, tool_choice"),
    "anthropic": ({"messages": HISTORY, "max_tokens": 64, "tools": [ATOOL],
                   "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
                   "container": "c-1", "mcp_servers": [{"type": "url", "url": "u"}]},
                  "tools, tool_choice, container, mcp_servers"),
    "responses": ({"input": "hi", "tools": [RTOOL], "tool_choice": "required",
                   "parallel_tool_calls": False, "top_logprobs": 2,
                   "brand_new_field": 1},
                  "brand_new_field, tools, tool_choice, parallel_tool_calls, top_logprobs"),
}


@pytest.mark.parametrize("dialect", list(MANY))
async def test_every_refused_field_in_one_400(walk: Any, dialect: str) -> None:
    """shell-gpt's case: one 400 names every refused field, in the dialect's shape."""
    served, _fakes, client = walk
    body, fields = MANY[dialect]
    resp = await client.post(served.url + OFFERED[dialect][0],
                             json={"model": "fake/echo", **body})
    assert resp.status_code == 400, resp.text
    error = error_of(dialect, resp)
    assert error["code"] == "unsupported"
    assert set(error["param"].split(", ")) == set(fields.split(", ")), error
    for name in fields.split(", "):
        assert name in error["message"], (name, error)


ONE_LANE = """
[server]
records = "records.jsonl"
[providers.fake]
adapter = "fake"
models = ["echo"]
[providers.fake.profile]
lanes = 1
queue_max = 8
queue_timeout_s = 30
run_timeout_s = 30
"""


@pytest.mark.parametrize("dialect", list(OFFERED))
async def test_offered_tools_dropped_on_a_queued_stream_are_in_its_headers(
        nursery: trio.Nursery, tmp_path: Path, dialect: str) -> None:
    """A queued stream has its 200 at once, with waiting notices: the drop is known
    before the queue (the attempt is admitted first), so its headers name it too."""
    served = await start_relay(nursery, ONE_LANE, tmp_path)
    path, body, _required = OFFERED[dialect]
    async with httpx.AsyncClient(trust_env=False, timeout=30) as client:
        async def hold() -> None:   # takes the one lane for a while
            r = await client.post(served.url + "/v1/chat/completions", json={
                "model": "fake/echo?delay_s=0.5", "messages": HISTORY})
            assert r.status_code == 200, r.text

        nursery.start_soon(hold)
        await wait_for(lambda: served.relay.providers["fake"].lane.statistics().running == 1)
        resp = await client.post(served.url + path,
                                 json={"model": "fake/echo", "stream": True, **body})
    assert resp.status_code == 200, resp.text
    assert ": waiting" in resp.text, resp.text[:300]   # it was queued
    assert "tools" in resp.headers["x-relay-ignored-fields"].split(", ")
    await wait_for(lambda: len(records(tmp_path)) == 2)
    # The holder's record may land after the stream's (its lane is free before its
    # record is written): pick the streamed one, not the last line.
    [streamed] = [r for r in records(tmp_path) if r["stream"]]
    assert "tools" in streamed["ignored_fields"]
