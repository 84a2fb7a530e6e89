"""The ``anthropic`` adapter (SPEC P1): its translations table by table, then the assembled
relay in front of a fake Anthropic API on loopback (tests/fakes/fake_anthropic.py) that speaks
the real wire format — plain and streamed text, tool calls both ways, every error class,
streams cut before their final event, and a client stop closing the upstream connection.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import openai
import pytest
import trio
from fakes.fake_anthropic import KEY, FakeAnthropic, Script, error_body, serve_fake_anthropic
from helpers.assembled import FAKE_ONLY, chat, lane_idle, sse_events, start_relay, wait_for
from helpers.cloud_helpers import (
    content_of,
    e1,
    finishes,
    http_client,
    one_record,
    posts,
    raw_post,
    stop_closes_upstream,
    tool_calls_of,
)
from helpers.raw_http import read_until

from relay.adapters.http.anthropic import (
    STOP_REASONS,
    AnthropicAdapter,
    MessageReader,
    messages_request,
    usage_of,
)
from relay.adapters.http.base import upstream_failure
from relay.vocab.errors import REASONS, RelayError
from relay.vocab.events import Call, Delta, Finish, Skipped, Usage

KEY_ENV = "RELAY_TEST_ANTHROPIC_KEY"
CHAT = "/v1/chat/completions"
LONG = "Anthropic explains at length. " * 100


@pytest.fixture(autouse=True)
def _key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KEY_ENV, KEY)


@pytest.fixture
async def fake(nursery: trio.Nursery) -> FakeAnthropic:
    server: FakeAnthropic = await nursery.start(serve_fake_anthropic)
    return server


def config(url: str, key_env: str = KEY_ENV, extra: str = "") -> str:
    return FAKE_ONLY + f"""
[providers.claude]
adapter = "anthropic"
base_url = "{url}"
api_key_env = "{key_env}"
{extra}
[providers.claude.profile]
lanes = 2
queue_max = 8
queue_timeout_s = 10
run_timeout_s = 300
rpm = 0
"""


def call(messages: list[dict[str, Any]], stream: bool = False, **params: Any) -> Call:
    return Call(request_id="r1", provider="claude", model="claude-x", messages=messages,
                stream=stream, params=params)


def user(content: Any) -> dict[str, Any]:
    return {"role": "user", "content": content}


TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
TOOL_CALL = {"id": "toolu_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}

# --- request translation, table by table ----------------------------------------------------

REQUESTS: dict[str, tuple[list[dict[str, Any]], dict[str, Any], dict[str, Any]]] = {
    "system lifted, turns as blocks, default max_tokens": (
        [{"role": "system", "content": "be brief"}, {"role": "developer", "content": "x"},
         user("hi")], {},
        {"system": [{"type": "text", "text": "be brief"}, {"type": "text", "text": "x"}],
         "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
         "max_tokens": 4096}),
    "fields": (
        [user("hi")], {"max_tokens": 10, "temperature": 0.5, "top_p": 0.9, "top_k": 3,
                       "stop": "END", "user": "u-1"},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
         "max_tokens": 10, "temperature": 0.5, "top_p": 0.9, "top_k": 3,
         "stop_sequences": ["END"], "metadata": {"user_id": "u-1"}}),
    "max_completion_tokens wins, stop list": (
        [user("hi")], {"max_tokens": 10, "max_completion_tokens": 20, "stop": ["a", "b"]},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
         "max_tokens": 20, "stop_sequences": ["a", "b"]}),
    "content parts: text, data: image, http image, pdf": (
        [user([{"type": "text", "text": "see"},
               {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBOR"}},
               {"type": "image_url", "image_url": {"url": "https://x.test/a.jpg"}},
               {"type": "file", "file": {"file_data": "data:application/pdf;base64,JVBE"}}])],
        {},
        {"messages": [{"role": "user", "content": [
            {"type": "text", "text": "see"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "iVBOR"}},
            {"type": "image", "source": {"type": "url", "url": "https://x.test/a.jpg"}},
            {"type": "document", "source": {"type": "base64",
                                            "media_type": "application/pdf",
                                            "data": "JVBE"}}]}],
         "max_tokens": 4096}),
    "tools, tool calls and results, turns merged": (
        [user("weather?"), {"role": "assistant", "content": "Let me look.",
                            "tool_calls": [TOOL_CALL]},
         {"role": "tool", "tool_call_id": "toolu_1", "content": "12 C"},
         user("and so?")],
        {"tools": [TOOL], "tool_choice": "required", "parallel_tool_calls": False},
        {"messages": [
            {"role": "user", "content": [{"type": "text", "text": "weather?"}]},
            {"role": "assistant", "content": [
                {"type": "text", "text": "Let me look."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                 "input": {"city": "Oslo"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1",
                 "content": [{"type": "text", "text": "12 C"}]},
                {"type": "text", "text": "and so?"}]}],
         "max_tokens": 4096,
         "tools": [{"name": "get_weather", "description": "Weather in a city",
                    "input_schema": TOOL["function"]["parameters"]}],  # type: ignore[index]
         "tool_choice": {"type": "any", "disable_parallel_tool_use": True}}),
    "tool_choice by name; empty text dropped": (
        [user(""), user("hi")],
        {"tool_choice": {"type": "function", "function": {"name": "f"}}},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
         "max_tokens": 4096, "tool_choice": {"type": "tool", "name": "f"}}),
    "neutral values and nulls pass": (
        [user("hi")], {"n": 1, "presence_penalty": 0, "frequency_penalty": 0.0,
                       "seed": None, "response_format": {"type": "text"}},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
         "max_tokens": 4096}),
}


@pytest.mark.parametrize(("messages", "params", "expected"), REQUESTS.values(), ids=REQUESTS)
def test_request_translation(messages: list[dict[str, Any]], params: dict[str, Any],
                             expected: dict[str, Any]) -> None:
    body, strip = messages_request(call(messages, **params))
    assert body == {"model": "claude-x", **expected}
    assert strip == ""
    body, _ = messages_request(call(messages, stream=True, **params))
    assert body["stream"] is True


def test_cache_control_markers_go_on_the_matching_blocks() -> None:
    """SPEC L12a: a chat part's ``cache_control`` goes on its block, a message's on the
    message's last block (an assistant's tool call, a tool result), a tool's on the
    tool; a prefill keeps its marker when its whitespace is cut."""
    mark = {"type": "ephemeral"}
    body, _ = messages_request(call([
        user([{"type": "text", "text": "a", "cache_control": mark},
              {"type": "text", "text": "b"}]),
        {"role": "assistant", "content": "c", "cache_control": mark, "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "r", "cache_control": mark},
        {"role": "assistant", "content": [{"type": "text", "text": "d ",
                                           "cache_control": mark}]}],
        tools=[{"type": "function", "function": {"name": "f"}, "cache_control": mark}]))
    user_turn, calls, results, prefill = body["messages"]
    assert user_turn["content"] == [{"type": "text", "text": "a", "cache_control": mark},
                                    {"type": "text", "text": "b"}]
    assert "cache_control" not in calls["content"][0]
    assert calls["content"][1]["cache_control"] == mark   # the tool_use block
    assert results["content"][0]["cache_control"] == mark
    assert prefill["content"] == [{"type": "text", "text": "d", "cache_control": mark}]
    assert body["tools"][0]["cache_control"] == mark


def test_prefill_whitespace_is_cut_and_not_repeated() -> None:
    body, strip = messages_request(call([user("hi"), {"role": "assistant",
                                                      "content": "Hello "}]))
    assert body["messages"][-1] == {"role": "assistant",
                                    "content": [{"type": "text", "text": "Hello"}]}
    assert strip == " "
    reader = MessageReader("claude", strip)
    assert reader.feed({"type": "content_block_start", "index": 0,
                        "content_block": {"type": "text", "text": ""}}) == []
    assert reader.feed({"type": "content_block_delta", "index": 0, "delta": {
        "type": "text_delta", "text": " world"}}) == [Delta(content="world")]
    assert reader.feed({"type": "content_block_delta", "index": 0, "delta": {
        "type": "text_delta", "text": " again"}}) == [Delta(content=" again")]


REFUSED: dict[str, tuple[list[dict[str, Any]], dict[str, Any], str, str]] = {
    "n > 1": ([user("hi")], {"n": 2}, "unsupported", "n"),
    "logit_bias": ([user("hi")], {"logit_bias": {"50256": -100}}, "unsupported",
                   "logit_bias"),
    "response_format json": ([user("hi")], {"response_format": {"type": "json_object"}},
                             "unsupported", "response_format"),
    "logprobs": ([user("hi")], {"logprobs": True}, "unsupported", "logprobs"),
    "audio part": ([user([{"type": "input_audio", "input_audio": {"data": "x",
                                                                   "format": "wav"}}])],
                   {}, "unsupported", "messages"),
    "ftp image": ([user([{"type": "image_url", "image_url": {"url": "ftp://x/y.png"}}])],
                  {}, "unsupported", "messages"),
    "arguments not JSON": ([{"role": "assistant", "tool_calls": [
        {"id": "t", "type": "function", "function": {"name": "f", "arguments": "{nope"}}]}],
        {}, "invalid_request", "messages"),
    "non-function tool": ([user("hi")], {"tools": [{"type": "web_search"}]}, "unsupported",
                          "tools"),
    "function role": ([{"role": "function", "name": "f", "content": "x"}], {},
                      "unsupported", "messages"),
}


@pytest.mark.parametrize(("messages", "params", "reason", "param"), REFUSED.values(),
                         ids=REFUSED)
def test_what_cannot_be_sent_is_refused_by_name(messages: list[dict[str, Any]],
                                                 params: dict[str, Any], reason: str,
                                                 param: str) -> None:
    adapter = object.__new__(AnthropicAdapter)
    adapter.name = "claude"
    adapter.settings = AnthropicAdapter.Settings()
    adapter.provider = SimpleNamespace(strict_fields=False)
    with pytest.raises(RelayError) as info:
        adapter.check_call(call(messages, **params))
    assert (info.value.reason, info.value.param) == (reason, param)
    assert param in info.value.message or "messages[" in info.value.message


# --- answer translation ---------------------------------------------------------------------

@pytest.mark.parametrize(("stop_reason", "finish"), [*STOP_REASONS.items(), (None, "stop")])
def test_stop_reasons(stop_reason: str | None, finish: str) -> None:
    events = MessageReader("claude").whole({"content": [{"type": "text", "text": "x"}],
                                            "stop_reason": stop_reason, "usage": {}})
    assert [e for e in events if isinstance(e, Finish)] == [Finish(finish)]
    assert STOP_REASONS["max_tokens"] == "length"  # never "stop" (SPEC E4)


@pytest.mark.parametrize(("raw", "usage"), [
    ({"input_tokens": 10, "output_tokens": 4}, Usage(10, 4, 14)),
    ({"input_tokens": 10, "cache_creation_input_tokens": 5, "cache_read_input_tokens": 20,
      "output_tokens": 4}, Usage(35, 4, 39, cache_read_tokens=20, cache_write_tokens=5)),
    ({"input_tokens": 10, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0,
      "output_tokens": 4}, Usage(10, 4, 14, cache_read_tokens=0, cache_write_tokens=0)),
    ({}, Usage(0, 0, 0)),
    (None, Usage(0, 0, 0)),
])
def test_usage(raw: Any, usage: Usage) -> None:
    assert usage_of(raw) == usage


STREAM = [
    {"type": "message_start", "message": {"usage": {"input_tokens": 9, "output_tokens": 1}}},
    {"type": "content_block_start", "index": 0, "content_block": {"type": "thinking",
                                                                  "thinking": ""}},
    {"type": "content_block_delta", "index": 0, "delta": {"type": "thinking_delta",
                                                          "thinking": "hmm"}},
    {"type": "content_block_delta", "index": 0, "delta": {"type": "signature_delta",
                                                          "signature": "s"}},
    {"type": "content_block_stop", "index": 0},
    {"type": "content_block_start", "index": 1, "content_block": {"type": "text",
                                                                  "text": ""}},
    {"type": "ping"},
    {"type": "content_block_delta", "index": 1, "delta": {"type": "text_delta",
                                                          "text": "Hi"}},
    {"type": "content_block_stop", "index": 1},
    {"type": "content_block_start", "index": 2, "content_block": {
        "type": "tool_use", "id": "toolu_9", "name": "f", "input": {}}},
    {"type": "content_block_delta", "index": 2, "delta": {"type": "input_json_delta",
                                                          "partial_json": ""}},
    {"type": "content_block_delta", "index": 2, "delta": {"type": "input_json_delta",
                                                          "partial_json": '{"a":'}},
    {"type": "content_block_delta", "index": 2, "delta": {"type": "input_json_delta",
                                                          "partial_json": "1}"}},
    {"type": "content_block_stop", "index": 2},
    {"type": "message_delta", "delta": {"stop_reason": "tool_use", "stop_sequence": None},
     "usage": {"output_tokens": 7}},
    {"type": "some_future_event"},
    {"type": "message_stop"},
]
EXPECTED = [
    Delta(extra={"reasoning_content": "hmm"}),
    Delta(extra={"reasoning_signature": "s"}),   # for a Messages client, byte for byte
    Delta(content="Hi"),
    Delta(tool_calls=[{"index": 0, "id": "toolu_9", "type": "function",
                       "function": {"name": "f", "arguments": ""}}]),
    Delta(tool_calls=[{"index": 0, "function": {"arguments": '{"a":'}}]),
    Delta(tool_calls=[{"index": 0, "function": {"arguments": "1}"}}]),
    Skipped("stream event 'some_future_event' not relayed"),
    Usage(9, 7, 16),
    Finish("tool_calls"),
]


def test_stream_events_in_order() -> None:
    reader = MessageReader("claude")
    got = []
    for event in STREAM:
        assert not reader.done  # the finish is held until message_stop
        got += reader.feed(event)
    assert got == EXPECTED
    assert reader.done


def test_whole_message() -> None:
    events = MessageReader("claude").whole({
        "type": "message", "content": [
            {"type": "text", "text": "Let me check."},
            {"type": "tool_use", "id": "toolu_2", "name": "f", "input": {"a": 1}}],
        "stop_reason": "tool_use", "usage": {"input_tokens": 3, "output_tokens": 2}})
    assert events == [
        Delta(content="Let me check."),
        Delta(tool_calls=[{"index": 0, "id": "toolu_2", "type": "function",
                           "function": {"name": "f", "arguments": ""}}]),
        Delta(tool_calls=[{"index": 0, "function": {"arguments": '{"a": 1}'}}]),
        Usage(3, 2, 5), Finish("tool_calls")]


ERRORS: dict[str, tuple[int, dict[str, Any], dict[str, str], str, float | None]] = {
    "authentication_error": (401, error_body(401, "invalid x-api-key"), {},
                             "auth_required", None),
    "permission_error": (403, error_body(403, "no access"), {}, "auth_required", None),
    "rate_limit_error": (429, error_body(429, "slow down"), {"retry-after": "7"},
                         "rate_limited", 7.0),
    "overloaded_error 529": (529, error_body(529, "Overloaded"), {}, "upstream_error",
                             None),
    "api_error 500": (500, error_body(500, "Internal"), {}, "upstream_error", None),
    "invalid_request_error": (400, error_body(400, "messages: roles must alternate"), {},
                              "rejected", None),
    "prompt is too long": (400, error_body(
        400, "prompt is too long: 208310 tokens > 200000 maximum"), {},
        "context_too_long", None),
    "credit balance": (400, error_body(400, "Your credit balance is too low to access the "
                                       "Anthropic API."), {}, "quota_exhausted", None),
    "billing_error": (402, error_body(402, "billing", "billing_error"), {},
                      "quota_exhausted", None),
    "not_found_error": (404, error_body(404, "model: claude-nope"), {}, "rejected", None),
    "request_too_large": (413, error_body(413, "too big"), {}, "rejected", None),
    "not JSON": (502, {"html": "<h1>Bad gateway</h1>"}, {}, "upstream_error", None),
}


@pytest.mark.parametrize(("status", "body", "headers", "reason", "retry"), ERRORS.values(),
                         ids=ERRORS)
def test_error_mapping(status: int, body: dict[str, Any], headers: dict[str, str],
                       reason: str, retry: float | None) -> None:
    error = upstream_failure("claude", status, json.dumps(body), headers,
                             key_hint=KEY_ENV)
    assert error.reason == reason
    assert error.upstream_status == status
    if retry is not None:
        assert error.retry_after_s == retry
    if reason == "rejected":
        assert error.status == status
        assert body["error"]["message"] in error.message


def test_error_event_in_the_stream() -> None:
    reader = MessageReader("claude")
    with pytest.raises(RelayError) as info:
        reader.feed(error_body(529, "Overloaded", "overloaded_error"))
    assert info.value.reason == "upstream_error"
    assert info.value.upstream_status is None  # the provider sent a 200
    assert info.value.upstream_message == "Overloaded"
    with pytest.raises(RelayError) as info:
        reader.feed(error_body(429, "slow", "rate_limit_error"))
    assert info.value.reason == "rate_limited"


# --- through the assembled relay ----------------------------------------------------------

async def test_plain_and_streamed_text(nursery: trio.Nursery, tmp_path: Path,
                                       fake: FakeAnthropic) -> None:
    served = await start_relay(nursery, config(fake.url), tmp_path)
    messages = [{"role": "system", "content": "be brief"}, user("hi")]
    async with http_client() as client:
        r = await client.post(served.url + CHAT, json={"model": "claude/claude-test-1",
                                                       "messages": messages})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["choices"][0]["message"] == {"role": "assistant",
                                                 "content": "Hello world"}
        assert body["choices"][0]["finish_reason"] == "stop"
        # The fake's 12 uncached and 3 read from the cache: 15, 3 of them cached (L12a).
        assert body["usage"] == {"prompt_tokens": 15, "completion_tokens": 5,
                                 "total_tokens": 20,
                                 "prompt_tokens_details": {"cached_tokens": 3}}
        assert body["model"] == "claude/claude-test-1"

        r = await client.post(served.url + CHAT, json={
            "model": "claude/claude-test-1", "messages": messages, "stream": True,
            "stream_options": {"include_usage": True}})
        events = sse_events(r.text)
    assert content_of(events) == "Hello world"
    assert finishes(events) == ["stop"]
    assert events[-1] == "[DONE]"
    assert events[-2]["usage"]["total_tokens"] == 20

    sent = posts(fake)
    assert [q.path for q in sent] == ["/v1/messages", "/v1/messages"]
    assert sent[0].headers["x-api-key"] == KEY
    assert sent[0].headers["anthropic-version"] == "2023-06-01"
    assert sent[0].json == {"model": "claude-test-1", "max_tokens": 4096,
                            "system": [{"type": "text", "text": "be brief"}],
                            "messages": [{"role": "user",
                                          "content": [{"type": "text", "text": "hi"}]}]}
    assert sent[1].json["stream"] is True
    rec = await one_record(tmp_path, 2)
    assert rec["usage"] == {"prompt_tokens": 15, "completion_tokens": 5, "total_tokens": 20,
                            "cache_read_tokens": 3}
    assert lane_idle(served)


async def test_max_tokens_is_length_never_stop(nursery: trio.Nursery, tmp_path: Path,
                                               fake: FakeAnthropic) -> None:
    served = await start_relay(nursery, config(fake.url), tmp_path)
    async with http_client() as client:
        r = await client.post(served.url + CHAT, json=chat("claude/m", max_tokens=1))
        assert r.json()["choices"][0]["finish_reason"] == "length"
        assert r.json()["choices"][0]["message"]["content"] == "Hello"
        r = await client.post(served.url + CHAT, json=chat("claude/m", max_tokens=1,
                                                           stream=True))
    events = sse_events(r.text)
    assert (content_of(events), finishes(events), events[-1]) == ("Hello", ["length"],
                                                                  "[DONE]")
    assert [q.json["max_tokens"] for q in posts(fake)] == [1, 1]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
async def test_tool_call_both_ways(nursery: trio.Nursery, tmp_path: Path,
                                   fake: FakeAnthropic, stream: bool) -> None:
    fake.scripts["m"] = Script(chunks=["Checking."], tool_uses=[
        {"id": "toolu_7", "name": "get_weather", "input": {"city": "Oslo"}}])
    served = await start_relay(nursery, config(fake.url), tmp_path)
    async with http_client() as client:
        r = await client.post(served.url + CHAT, json=chat(
            "claude/m", "weather?", tools=[TOOL], stream=stream))
        assert r.status_code == 200, r.text
        if stream:
            events = sse_events(r.text)
            assert finishes(events) == ["tool_calls"]
            assert content_of(events) == "Checking."
            calls = tool_calls_of(events)
            assert calls == {0: {"id": "toolu_7", "name": "get_weather",
                                 "arguments": '{"city": "Oslo"}'}}
        else:
            choice = r.json()["choices"][0]
            assert choice["finish_reason"] == "tool_calls"
            assert choice["message"]["content"] == "Checking."
            assert choice["message"]["tool_calls"] == [{
                "id": "toolu_7", "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]
        assert posts(fake)[0].json["tools"] == [{
            "name": "get_weather", "description": "Weather in a city",
            "input_schema": TOOL["function"]["parameters"]}]  # type: ignore[index]

        # the other way: the tool's result goes back as a tool_result block
        fake.scripts["m"] = Script(chunks=["It is 12 C in Oslo."])
        r = await client.post(served.url + CHAT, json={"model": "claude/m", "stream": stream,
                                                       "tools": [TOOL], "messages": [
            user("weather?"),
            {"role": "assistant", "content": None, "tool_calls": [
                {**TOOL_CALL, "id": "toolu_7"}]},
            {"role": "tool", "tool_call_id": "toolu_7", "content": "12 C"}]})
        assert r.status_code == 200, r.text
    assert posts(fake)[1].json["messages"][1:] == [
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_7",
                                           "name": "get_weather",
                                           "input": {"city": "Oslo"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_7",
                                      "content": [{"type": "text", "text": "12 C"}]}]}]


STATUS_CASES = {
    "401": (Script(status=401, error=error_body(401, LONG)), 502, "auth_required"),
    "403": (Script(status=403, error=error_body(403, LONG)), 502, "auth_required"),
    "429": (Script(status=429, error=error_body(429, LONG), headers={"retry-after": "7"}),
            429, "rate_limited"),
    "529 overloaded": (Script(status=529, error=error_body(529, LONG, "overloaded_error")),
                       502, "upstream_error"),
    "500": (Script(status=500, error=error_body(500, LONG)), 502, "upstream_error"),
    "400 invalid": (Script(status=400, error=error_body(400, LONG)), 400, "rejected"),
    "400 too long": (Script(status=400, error=error_body(
        400, "prompt is too long: 208310 tokens > 200000 maximum")), 400, "context_too_long"),
    "400 credit": (Script(status=400, error=error_body(
        400, "Your credit balance is too low to access the Anthropic API.")), 429,
        "quota_exhausted"),
}


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize(("script", "status", "reason"), STATUS_CASES.values(),
                         ids=STATUS_CASES)
async def test_error_statuses(nursery: trio.Nursery, tmp_path: Path, fake: FakeAnthropic,
                              script: Script, status: int, reason: str,
                              stream: bool) -> None:
    fake.scripts["m"] = script
    served = await start_relay(nursery, config(fake.url), tmp_path)
    async with http_client() as client:
        r = await client.post(served.url + CHAT, json=chat("claude/m", stream=stream))
    err = e1(r, status, reason)
    assert err["relay"]["provider"] == "claude"
    assert err["relay"]["upstream_status"] == script.status
    assert err["relay"]["upstream_message"] == (script.error or {})["error"]["message"]
    if reason == "rate_limited":
        assert r.headers["retry-after"] == "7"
    if reason == "auth_required":
        assert KEY_ENV in err["relay"]["action"]
    if reason == "rejected":
        assert LONG in err["message"]
    assert len(posts(fake)) == 1  # no hidden retries (F6)
    rec = await one_record(tmp_path)
    assert (rec["status"], rec["reason"]) == (status, reason)
    assert lane_idle(served)


async def test_error_event_before_and_after_content(nursery: trio.Nursery, tmp_path: Path,
                                                    fake: FakeAnthropic) -> None:
    served = await start_relay(nursery, config(fake.url), tmp_path)
    async with http_client() as client:
        fake.scripts["m"] = Script(error_after=0)  # nothing answered yet: a real status
        r = await client.post(served.url + CHAT, json=chat("claude/m", stream=True))
        err = e1(r, 502, "upstream_error")
        assert err["relay"]["upstream_message"] == "Overloaded"

        fake.scripts["m"] = Script(error_after=1, stream_error=error_body(
            429, "Number of request tokens has exceeded your rate limit", "rate_limit_error"))
        r = await client.post(served.url + CHAT, json=chat("claude/m", stream=True))
    assert r.status_code == 200
    events = sse_events(r.text)
    assert content_of(events) == "Hello"
    assert finishes(events) == [] and "[DONE]" not in events
    assert events[-1]["error"]["code"] == "rate_limited"
    assert lane_idle(served)


@pytest.mark.parametrize("script", [
    pytest.param(Script(end_before="message_stop"), id="ends before message_stop"),
    pytest.param(Script(end_before="message_delta"), id="ends before message_delta"),
    pytest.param(Script(chunks=["Hello", " world"], cut_after=1), id="connection dropped"),
])
async def test_stream_cut_before_its_final_event(nursery: trio.Nursery, tmp_path: Path,
                                                 fake: FakeAnthropic, script: Script) -> None:
    fake.scripts["m"] = script
    served = await start_relay(nursery, config(fake.url), tmp_path)
    async with http_client() as client:
        r = await client.post(served.url + CHAT, json=chat("claude/m", stream=True))
        assert r.status_code == 200
        events = sse_events(r.text)
        assert finishes(events) == []  # never reported as complete (E4)
        assert "[DONE]" not in events
        assert events[-1]["error"]["code"] == "stream_cut"
        assert content_of(events) == ("Hello" if script.cut_after else "Hello world")
    rec = await one_record(tmp_path)
    assert (rec["status"], rec["reason"], rec["phase"]) == (502, "stream_cut", "upstream")
    assert lane_idle(served)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
async def test_a_timeout_awaiting_headers_closes_the_upstream(nursery: trio.Nursery,
                                                              tmp_path: Path, fake: FakeAnthropic,
                                                              stream: bool) -> None:
    """SPEC C2: the adapter awaits headers that never come; the attempt's timeout stops
    it, and the upstream connection is closed at once."""
    fake.scripts["hung"] = Script(hang=True)
    route = """
[routes.r]
primary = "claude/hung"
primary_timeout_s = 0.3
budget_s = 10
"""
    served = await start_relay(nursery, config(fake.url) + route, tmp_path)
    async with http_client() as client:
        r = await client.post(served.url + CHAT, json=chat("r", stream=stream))
    e1(r, 504, "attempt_timeout")
    conn = fake.connections[posts(fake)[-1].conn_id]
    with trio.fail_after(5):
        await fake.wait_until(lambda: conn.closed_at is not None)
    assert conn.closed_by == "peer"
    await wait_for(lambda: lane_idle(served))


async def test_client_stop_mid_stream_closes_the_upstream(nursery: trio.Nursery,
                                                          tmp_path: Path,
                                                          fake: FakeAnthropic) -> None:
    fake.scripts["slow"] = Script(chunks=["tok "] * 500, chunk_delay_s=0.01)
    served = await start_relay(nursery, config(fake.url), tmp_path)
    stream = await raw_post(served.url, CHAT, chat("claude/slow", stream=True))
    await read_until(stream, b'"content":"tok "')
    latency = await stop_closes_upstream(fake, stream)
    assert latency < 0.5
    rec = await one_record(tmp_path)
    assert (rec["status"], rec["reason"]) == (499, "client_disconnected")
    assert rec["stop_requested_at"] <= rec["released_at"]
    assert lane_idle(served)


async def test_a_cut_stream_continues_from_a_prefill_on_anthropic(
        nursery: trio.Nursery, tmp_path: Path, fake: FakeAnthropic) -> None:
    """SPEC F8: the fake provider breaks off after "Hello "; the route falls back to the
    anthropic adapter, which continues the sent text (prefill) — its trailing space cut
    from the request (Anthropic refuses it) and from the continuation."""
    fake.scripts["m"] = Script(chunks=[" big", " world"])
    route = """
[routes.r]
primary = "fake/echo?reply=Hello big world&cut_after=1"
fallbacks = ["claude/m"]
"""
    served = await start_relay(nursery, config(fake.url) + route, tmp_path)
    async with http_client() as client:
        r = await client.post(served.url + CHAT, json=chat("r", stream=True))
    events = sse_events(r.text)
    assert content_of(events) == "Hello big world"
    assert finishes(events) == ["stop"] and events[-1] == "[DONE]"
    sent = posts(fake)[0].json["messages"]
    assert sent[-1] == {"role": "assistant", "content": [{"type": "text", "text": "Hello"}]}
    rec = await one_record(tmp_path)
    assert rec["fallback_triggered"] is True
    assert [a["failure"] for a in rec["attempts"]] == ["stream_cut", None]


async def test_a_missing_key_is_refused_before_the_upstream(nursery: trio.Nursery,
                                                            tmp_path: Path,
                                                            fake: FakeAnthropic) -> None:
    served = await start_relay(nursery, config(fake.url, key_env="RELAY_TEST_NO_SUCH_KEY"),
                               tmp_path)
    async with http_client() as client:
        r = await client.post(served.url + CHAT, json=chat("claude/m"))
    err = e1(r, 502, "auth_required")
    assert "RELAY_TEST_NO_SUCH_KEY" in err["relay"]["action"]
    assert posts(fake) == []


async def test_wrong_key_is_auth_required(nursery: trio.Nursery, tmp_path: Path,
                                          fake: FakeAnthropic,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KEY_ENV, "sk-ant-wrong")
    served = await start_relay(nursery, config(fake.url), tmp_path)
    async with http_client() as client:
        r = await client.post(served.url + CHAT, json=chat("claude/m", stream=True))
    err = e1(r, 502, "auth_required")
    assert err["relay"]["upstream_message"] == "invalid x-api-key"


async def test_models_are_discovered_across_pages(nursery: trio.Nursery, tmp_path: Path,
                                                  fake: FakeAnthropic) -> None:
    served = await start_relay(nursery, config(fake.url), tmp_path)
    provider = served.relay.providers["claude"]
    await wait_for(lambda: "claude-test-3" in provider.models)  # discovery at start
    async with http_client() as client:
        r = await client.get(served.url + "/v1/models")
    ids = [m["id"] for m in r.json()["data"]]
    assert {"claude/claude-test-1", "claude/claude-test-2", "claude/claude-test-3"} <= set(ids)
    assert [q.path for q in fake.requests[:2]] == [
        "/v1/models?limit=1000", "/v1/models?limit=1000&after_id=claude-test-2"]


async def test_unsupported_field_is_a_plain_400(nursery: trio.Nursery, tmp_path: Path,
                                                fake: FakeAnthropic) -> None:
    served = await start_relay(nursery, config(fake.url), tmp_path)
    async with http_client() as client:
        r = await client.post(served.url + CHAT, json=chat("claude/m", n=3))
    err = e1(r, 400, "unsupported")
    assert err["param"] == "n"
    assert posts(fake) == []


# --- the official openai client, with this adapter behind relay -----------------------------

openai_gens = pytest.mark.filterwarnings("ignore:Async generator 'openai\\.:ResourceWarning")


@openai_gens
async def test_openai_client(nursery: trio.Nursery, tmp_path: Path,
                             fake: FakeAnthropic) -> None:
    served = await start_relay(nursery, config(fake.url), tmp_path)
    msgs: Any = [{"role": "user", "content": "hi"}]
    async with http_client() as http:
        c = openai.AsyncOpenAI(base_url=served.url + "/v1", api_key="x", max_retries=0,
                               http_client=http)
        done = await c.chat.completions.create(model="claude/m", messages=msgs)
        assert done.choices[0].message.content == "Hello world"
        assert done.usage is not None and done.usage.total_tokens == 20

        stream = await c.chat.completions.create(model="claude/m", messages=msgs,
                                                 stream=True)
        text = "".join([ch.choices[0].delta.content or "" async for ch in stream
                        if ch.choices])
        assert text == "Hello world"

        fake.scripts["t"] = Script(chunks=[], tool_uses=[
            {"id": "toolu_3", "name": "get_weather", "input": {"city": "Oslo"}}])
        tools: Any = [TOOL]
        done = await c.chat.completions.create(model="claude/t", messages=msgs, tools=tools)
        assert done.choices[0].finish_reason == "tool_calls"
        tc: Any = done.choices[0].message.tool_calls
        assert tc is not None and tc[0].function.name == "get_weather"
        assert json.loads(tc[0].function.arguments) == {"city": "Oslo"}

        fake.scripts["e"] = Script(status=429, error=error_body(429, LONG),
                                   headers={"retry-after": "3"})
        with pytest.raises(openai.RateLimitError) as rl:
            await c.chat.completions.create(model="claude/e", messages=msgs)
        assert rl.value.code == "rate_limited"
        assert rl.value.response.headers["retry-after"] == "3"

        fake.scripts["e"] = Script(status=401, error=error_body(401, "invalid x-api-key"))
        with pytest.raises(openai.APIStatusError) as auth:
            await c.chat.completions.create(model="claude/e", messages=msgs)
        assert (auth.value.status_code, auth.value.code) == (502, "auth_required")

        fake.scripts["e"] = Script(end_before="message_stop")
        stream = await c.chat.completions.create(model="claude/e", messages=msgs,
                                                 stream=True)
        with pytest.raises(openai.APIError) as cut:
            async for _ in stream:
                pass
        assert isinstance(cut.value.body, dict) and cut.value.body["code"] == "stream_cut"
    assert lane_idle(served)


def test_reasons_used_here_exist() -> None:
    for _, _, reason in STATUS_CASES.values():
        assert reason in REASONS
