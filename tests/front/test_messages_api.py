"""``POST /v1/messages`` — the Anthropic Messages dialect on relay's front (SPEC A6).

First the translations table by table (request in, answer and stream events out, error
bodies), then the assembled relay: the official ``anthropic`` client against an
OpenAI-compatible upstream (tests/fakes/upstream.py), the fake provider, and the ``anthropic``
and ``gemini`` adapters behind it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest
import trio
from fakes.fake_anthropic import KEY as ANTHROPIC_KEY
from fakes.fake_anthropic import FakeAnthropic, serve_fake_anthropic
from fakes.fake_anthropic import Script as AScript
from fakes.fake_gemini import KEY as GEMINI_KEY
from fakes.fake_gemini import FakeGemini, serve_fake_gemini
from fakes.upstream import FakeUpstream, Script, error_body
from helpers.assembled import FAKE_ONLY, lane_idle, start_relay, with_upstream
from helpers.cloud_helpers import (
    http_client,
    one_record,
    posts,
    raw_post,
    sse_blocks,
)
from helpers.raw_http import read_until

from relay.dialects.anthropic_messages import ANTHROPIC, STOP_REASONS, parse_messages_body
from relay.dialects.base import Answer
from relay.vocab.errors import REASONS, RelayError
from relay.vocab.events import Delta, Finish, Usage

MESSAGES = "/v1/messages"
LONG = "The provider explains at length. " * 80

# The anthropic client reads streams through async generators that trio finalizes
# itself when a stream ends early or with an error; the response is closed all the same.
pytestmark = pytest.mark.filterwarnings(
    "ignore:Async generator '(anthropic|httpx2|httpcore2)\\.:ResourceWarning")


def body(**kw: Any) -> dict[str, Any]:
    return {"model": "fake/echo", "max_tokens": 64,
            "messages": [{"role": "user", "content": "hello"}], **kw}


def parse(data: dict[str, Any]) -> Any:
    return parse_messages_body(json.dumps(data).encode())


# --- request translation ---------------------------------------------------------------

IMG = {"type": "base64", "media_type": "image/png", "data": "iVBOR"}
REQUESTS: dict[str, tuple[dict[str, Any], list[dict[str, Any]], dict[str, Any]]] = {
    "string content, system string": (
        body(system="be brief"),
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}],
        {"max_tokens": 64}),
    "system blocks joined; fields": (
        body(system=[{"type": "text", "text": "a", "cache_control": {"type": "ephemeral"}},
                     {"type": "text", "text": "b"}],
             stop_sequences=["END"], temperature=0.2, top_p=0.9, top_k=5,
             metadata={"user_id": "u-1"}, stream=True),
        [{"role": "system", "content": "a\n\nb"}, {"role": "user", "content": "hello"}],
        {"max_tokens": 64, "stop": ["END"], "temperature": 0.2, "top_p": 0.9, "top_k": 5,
         "user": "u-1"}),
    "images and documents": (
        body(messages=[{"role": "user", "content": [
            {"type": "text", "text": "see"}, {"type": "image", "source": IMG},
            {"type": "image", "source": {"type": "url", "url": "https://x.test/a.png"}},
            {"type": "document", "source": {"type": "base64",
                                            "media_type": "application/pdf", "data": "JV"}}]}]),
        [{"role": "user", "content": [
            {"type": "text", "text": "see"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBOR"}},
            {"type": "image_url", "image_url": {"url": "https://x.test/a.png"}},
            {"type": "file", "file": {"file_data": "data:application/pdf;base64,JV",
                                      "filename": "document.pdf"}}]}],
        {"max_tokens": 64}),
    "tool use and results; thinking dropped": (
        body(tools=[{"name": "f", "description": "d", "input_schema": {"type": "object"}}],
             tool_choice={"type": "any", "disable_parallel_tool_use": True},
             messages=[
                 {"role": "user", "content": "go"},
                 {"role": "assistant", "content": [
                     {"type": "thinking", "thinking": "hmm", "signature": "s"},
                     {"type": "text", "text": "Calling."},
                     {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"a": 1}}]},
                 {"role": "user", "content": [
                     {"type": "tool_result", "tool_use_id": "toolu_1", "content": "ok"},
                     {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
                      "content": [{"type": "text", "text": "boom"}]},
                     {"type": "text", "text": "and?"}]}]),
        [{"role": "user", "content": "go"},
         {"role": "assistant", "content": "Calling.", "tool_calls": [
             {"id": "toolu_1", "type": "function",
              "function": {"name": "f", "arguments": '{"a": 1}'}}]},
         {"role": "tool", "tool_call_id": "toolu_1", "content": "ok"},
         {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: boom"},
         {"role": "user", "content": "and?"}],
        {"max_tokens": 64, "tools": [{"type": "function", "function": {
            "name": "f", "parameters": {"type": "object"}, "description": "d"}}],
         "tool_choice": "required", "parallel_tool_calls": False}),
    "tool_choice tool; the dialect's own fields stay out of the params": (
        body(tool_choice={"type": "tool", "name": "f"}, service_tier="auto",
             thinking={"type": "disabled"}),
        [{"role": "user", "content": "hello"}],
        {"max_tokens": 64, "tool_choice": {"type": "function", "function": {"name": "f"}}}),
    "a system message mid-conversation stays in its place": (
        body(system="first", messages=[
            {"role": "user", "content": "hello"},
            {"role": "system", "content": [{"type": "text", "text": "env: linux",
                                            "cache_control": {"type": "ephemeral"}}]},
            {"role": "assistant", "content": "hi"},
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "and?"}]),
        [{"role": "system", "content": "first"}, {"role": "user", "content": "hello"},
         {"role": "system", "content": "env: linux"},
         {"role": "assistant", "content": "hi"},
         {"role": "system", "content": "be brief"}, {"role": "user", "content": "and?"}],
        {"max_tokens": 64}),
    "output_config.format becomes a JSON schema; tools keep strict": (
        body(output_config={"format": {"type": "json_schema", "schema": {"type": "object"}},
                            "effort": "low"},
             tools=[{"name": "f", "input_schema": {"type": "object"}, "strict": True}]),
        [{"role": "user", "content": "hello"}],
        {"max_tokens": 64, "response_format": {"type": "json_schema", "json_schema": {
            "name": "output", "schema": {"type": "object"}, "strict": True}},
         "tools": [{"type": "function", "function": {
             "name": "f", "parameters": {"type": "object"}, "strict": True}}]}),
}


@pytest.mark.parametrize(("data", "messages", "params"), REQUESTS.values(), ids=REQUESTS)
def test_request_translation(data: dict[str, Any], messages: list[dict[str, Any]],
                             params: dict[str, Any]) -> None:
    chat = parse(data)
    assert chat.model == "fake/echo"
    assert chat.messages == messages
    assert chat.params == params
    assert chat.stream is bool(data.get("stream"))


INVALID: dict[str, tuple[Any, str | None, str]] = {
    "not an object": ([1], None, "JSON object"),
    "no model": ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}, "model",
                 "'model'"),
    "no max_tokens": ({"model": "m", "messages": [{"role": "user", "content": "x"}]},
                      "max_tokens", "'max_tokens' is required"),
    "max_tokens 0": (body(max_tokens=0), "max_tokens", "'max_tokens'"),
    "max_tokens true": (body(max_tokens=True), "max_tokens", "'max_tokens'"),
    "no messages": (body(messages=[]), "messages", "non-empty"),
    "tool role in messages": (body(messages=[{"role": "tool", "content": "x"}]),
                              "messages", "messages[0].role"),
    "system message content a number": (body(messages=[{"role": "system", "content": 3}]),
                                        "messages", "messages[0].content"),
    "content a number": (body(messages=[{"role": "user", "content": 5}]), "messages",
                         "messages[0].content"),
    "block without type": (body(messages=[{"role": "user", "content": [{"text": "x"}]}]),
                           "messages", "messages[0].content[0]"),
    "text not a string": (body(messages=[{"role": "user", "content": [
        {"type": "text", "text": 1}]}]), "messages", "messages[0].content[0].text"),
    "image without source": (body(messages=[{"role": "user", "content": [
        {"type": "image"}]}]), "messages", "messages[0].content[0].source"),
    "image not an image": (body(messages=[{"role": "user", "content": [
        {"type": "image", "source": {**IMG, "media_type": "text/html"}}]}]), "messages",
        "media_type"),
    "tool_result without id": (body(messages=[{"role": "user", "content": [
        {"type": "tool_result", "content": "x"}]}]), "messages", "tool_use_id"),
    "tool_use without input object": (body(messages=[{"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": "x"}]}]), "messages",
        "messages[0].content[0]"),
    "stream not a bool": (body(stream="yes"), "stream", "'stream'"),
    "temperature a string": (body(temperature="hot"), "temperature", "'temperature'"),
    "top_k a float": (body(top_k=1.5), "top_k", "'top_k'"),
    "stop_sequences a string": (body(stop_sequences="END"), "stop_sequences",
                                "'stop_sequences'"),
    "tool without schema": (body(tools=[{"name": "f"}]), "tools", "input_schema"),
    "tool_choice bad": (body(tool_choice={"type": "sometimes"}), "tool_choice",
                        "'tool_choice.type'"),
    "system a number": (body(system=3), "system", "'system'"),
    "n": (body(n=2), "n", "one answer"),
    "metadata a string": (body(metadata="x"), "metadata", "'metadata'"),
}


@pytest.mark.parametrize(("data", "param", "words"), INVALID.values(), ids=INVALID)
def test_invalid_requests_name_the_field(data: Any, param: str | None, words: str) -> None:
    with pytest.raises(RelayError) as info:
        parse(data)
    assert info.value.reason == "invalid_request"
    # the field's path (relay.dialects.typed), or the field itself
    got = info.value.param
    assert got == param or (got or "").startswith((f"{param}[", f"{param}.")), (got, param)
    assert words in info.value.message


@pytest.mark.parametrize("data", [
    body(tools=[{"type": "web_search_20250305", "name": "web_search"}]),
    body(messages=[{"role": "user", "content": [{"type": "search_result", "source": "x"}]}]),
    body(messages=[{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                                 "content": [{"type": "image",
                                                              "source": IMG}]}]}]),
    body(messages=[{"role": "user", "content": [{"type": "image", "source": {
        "type": "file", "file_id": "f"}}]}]),
], ids=["server tool", "search_result block", "image in a tool result", "file source"])
def test_what_relay_cannot_translate_is_unsupported(data: dict[str, Any]) -> None:
    with pytest.raises(RelayError) as info:
        parse(data)
    assert info.value.reason == "unsupported"
    assert info.value.status == 400


# --- answers, streams and errors out ------------------------------------------------------

@pytest.mark.parametrize(("finish", "stop_reason"), [*STOP_REASONS.items(), (None, "end_turn")])
def test_render(finish: str | None, stop_reason: str) -> None:
    answer = Answer(id="abc", created=0, model="p/m", usage=Usage(7, 3, 10), choices={0: {
        "index": 0, "finish_reason": finish, "message": {
            "role": "assistant", "content": "Hi", "reasoning_content": "hmm",
            "tool_calls": [{"id": "call_1", "type": "function",
                            "function": {"name": "f", "arguments": '{"a": 1}'}},
                           {"id": None, "type": "function",
                            "function": {"name": "g", "arguments": "{oops"}}]}}})
    assert ANTHROPIC.render(answer) == {
        "id": "msg_abc", "type": "message", "role": "assistant", "model": "p/m",
        "content": [{"type": "thinking", "thinking": "hmm", "signature": ""},
                    {"type": "text", "text": "Hi"},
                    {"type": "tool_use", "id": "call_1", "name": "f", "input": {"a": 1}},
                    {"type": "tool_use", "id": "toolu_1", "name": "g",
                     "input": {"_arguments": "{oops"}}],
        "stop_reason": stop_reason, "stop_sequence": None,
        "usage": {"input_tokens": 7, "cache_creation_input_tokens": 0,
                  "cache_read_input_tokens": 0, "output_tokens": 3}}


def test_stream_encoder() -> None:
    enc = ANTHROPIC.encoder("abc", 0, False)
    enc.begin("p/m")
    out = enc.delta(Delta(content="Hel")) + enc.delta(Delta(content="lo"))
    out += enc.delta(Delta(tool_calls=[{"index": 0, "id": "call_1", "type": "function",
                                        "function": {"name": "f", "arguments": ""}}]))
    out += enc.delta(Delta(tool_calls=[{"index": 0, "function": {"arguments": '{"a":1}'}}]))
    out += enc.delta(Delta(content="ignored", index=1))
    out += enc.finish(Finish("tool_calls"))
    enc.set_usage(Usage(5, 2, 7))
    out += enc.done()
    assert sse_blocks(out.decode()) == [
        ("message_start", {"type": "message_start", "message": {
            "id": "msg_abc", "type": "message", "role": "assistant", "model": "p/m",
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": 0, "cache_creation_input_tokens": 0,
                      "cache_read_input_tokens": 0, "output_tokens": 0}}}),
        ("content_block_start", {"type": "content_block_start", "index": 0,
                                 "content_block": {"type": "text", "text": ""}}),
        ("content_block_delta", {"type": "content_block_delta", "index": 0,
                                 "delta": {"type": "text_delta", "text": "Hel"}}),
        ("content_block_delta", {"type": "content_block_delta", "index": 0,
                                 "delta": {"type": "text_delta", "text": "lo"}}),
        ("content_block_stop", {"type": "content_block_stop", "index": 0}),
        ("content_block_start", {"type": "content_block_start", "index": 1,
                                 "content_block": {"type": "tool_use", "id": "call_1",
                                                   "name": "f", "input": {}}}),
        ("content_block_delta", {"type": "content_block_delta", "index": 1, "delta": {
            "type": "input_json_delta", "partial_json": '{"a":1}'}}),
        ("content_block_stop", {"type": "content_block_stop", "index": 1}),
        ("message_delta", {"type": "message_delta",
                           "delta": {"stop_reason": "tool_use", "stop_sequence": None},
                           "usage": {"input_tokens": 5, "cache_creation_input_tokens": 0,
                                     "cache_read_input_tokens": 0, "output_tokens": 2}}),
        ("message_stop", {"type": "message_stop"}),
    ]


@pytest.mark.parametrize(("reason", "status", "kind"), [
    ("invalid_request", 400, "invalid_request_error"),
    ("unsupported", 400, "invalid_request_error"),
    ("unknown_model", 404, "not_found_error"),
    ("unauthorized", 401, "authentication_error"),
    ("forbidden_origin", 403, "permission_error"),
    ("provider_queue_full", 429, "rate_limit_error"),
    ("rate_limited", 429, "rate_limit_error"),
    ("quota_exhausted", 429, "billing_error"),
    ("auth_required", 502, "authentication_error"),
    ("run_timeout", 504, "timeout_error"),
    ("upstream_error", 502, "api_error"),
    ("stream_cut", 502, "api_error"),
    ("shutting_down", 503, "api_error"),
    ("internal_error", 500, "api_error"),
])
def test_error_bodies(reason: str, status: int, kind: str) -> None:
    error = RelayError(reason, "what happened", provider="p", param="x")
    assert error.status == status == REASONS[reason].status
    got = ANTHROPIC.error_body(error)
    assert got["type"] == "error"
    assert got["error"]["type"] == kind
    assert got["error"]["message"] == "what happened"
    relay = got["error"]["relay"]
    assert (relay["reason"], relay["code"], relay["phase"], relay["provider"],
            relay["param"]) == (reason, reason, REASONS[reason].phase, "p", "x")


# --- the assembled relay -------------------------------------------------------------------

def anthropic_errors(r: httpx.Response, status: int, reason: str) -> dict[str, Any]:
    """Assert an Anthropic-shaped error answer; return its error object."""
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    data = r.json()
    assert data["type"] == "error"
    err = data["error"]
    assert err["relay"]["reason"] == reason
    assert r.headers["x-should-retry"] == ("true" if REASONS[reason].should_retry
                                           else "false")
    return err  # type: ignore[no-any-return]


async def test_plain_and_streamed_with_the_fake_provider(nursery: trio.Nursery,
                                                         tmp_path: Path) -> None:
    served = await start_relay(nursery, FAKE_ONLY, tmp_path)
    async with http_client() as client:
        r = await client.post(served.url + MESSAGES, json=body())
        assert r.status_code == 200, r.text
        assert r.json()["content"] == [{"type": "text", "text": "hello"}]
        assert r.json()["stop_reason"] == "end_turn"
        assert r.headers["x-relay-request-id"]

        r = await client.post(served.url + MESSAGES, json=body(stream=True))
        events = sse_blocks(r.text)
    assert r.headers["content-type"].startswith("text/event-stream")
    names = [name for name, _ in events]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    text = "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta")
    assert text == "hello"
    rec = await one_record(tmp_path, 2)
    assert (rec["status"], rec["stream"]) == (200, True)


async def test_errors_in_the_anthropic_shape(nursery: trio.Nursery, tmp_path: Path) -> None:
    served = await start_relay(nursery, FAKE_ONLY, tmp_path)
    async with http_client() as client:
        r = await client.post(served.url + MESSAGES, json={"model": "fake/echo"})
        err = anthropic_errors(r, 400, "invalid_request")
        assert err["type"] == "invalid_request_error"
        assert err["relay"]["param"] == "max_tokens, messages"   # every missing field

        r = await client.post(served.url + MESSAGES, content=b"{nope",
                              headers={"content-type": "application/json"})
        anthropic_errors(r, 400, "invalid_request")

        r = await client.post(served.url + MESSAGES, json=body(model="nope/x"))
        assert anthropic_errors(r, 404, "unknown_model")["type"] == "not_found_error"

        r = await client.post(served.url + MESSAGES, json=body(),
                              headers={"x-relay-priority": "urgent"})
        assert "X-Relay-Priority" in anthropic_errors(r, 400, "invalid_request")["message"]

        r = await client.get(served.url + MESSAGES)
        assert anthropic_errors(r, 405, "invalid_request")["type"] == "invalid_request_error"

        r = await client.post(served.url + MESSAGES, content=b"x=1",
                              headers={"content-type": "application/x-www-form-urlencoded"})
        anthropic_errors(r, 415, "invalid_request")

        r = await client.post(served.url + MESSAGES, json=body(
            model="fake/echo?fail=rate_limited"))
        err = anthropic_errors(r, 429, "rate_limited")
        assert err["type"] == "rate_limit_error"
        assert "retry-after" in r.headers


async def test_a_stream_that_fails_after_content_ends_with_an_error_event(
        nursery: trio.Nursery, tmp_path: Path) -> None:
    served = await start_relay(nursery, FAKE_ONLY, tmp_path)
    async with http_client() as client:
        r = await client.post(served.url + MESSAGES, json=body(
            model="fake/echo?reply=one two three&cut_after=1", stream=True))
    assert r.status_code == 200
    events = sse_blocks(r.text)
    assert events[0][0] == "message_start"
    name, data = events[-1]
    assert name == "error"
    assert data["type"] == "error" and data["error"]["relay"]["reason"] == "stream_cut"
    assert "message_stop" not in [n for n, _ in events]
    rec = await one_record(tmp_path)
    assert rec["reason"] == "stream_cut"


def sdk(url: str, retries: int = 0) -> anthropic.AsyncAnthropic:
    """The official client (it runs under trio: httpx2 speaks anyio)."""
    return anthropic.AsyncAnthropic(base_url=url, api_key="unused", max_retries=retries)


USER: Any = [{"role": "user", "content": "hi"}]


async def test_anthropic_client_with_an_openai_compatible_upstream(
        nursery: trio.Nursery, tmp_path: Path, upstream: FakeUpstream) -> None:
    served = await start_relay(nursery, with_upstream(upstream), tmp_path)
    async with sdk(served.url) as client:
        message = await client.messages.create(model="up/m1", max_tokens=50, messages=USER,
                                               system="be brief")
        assert message.content[0].type == "text" and message.content[0].text == "Hello world"
        assert message.stop_reason == "end_turn"
        assert (message.usage.input_tokens, message.usage.output_tokens) == (3, 2)
        assert message.model == "up/m1"
        sent = upstream.requests[-1].json
        assert sent["messages"] == [{"role": "system", "content": "be brief"},
                                    {"role": "user", "content": "hi"}]
        assert sent["max_tokens"] == 50

        async with client.messages.stream(model="up/m1", max_tokens=50,
                                          messages=USER) as stream:
            text = "".join([t async for t in stream.text_stream])
            final = await stream.get_final_message()
        assert text == "Hello world"
        assert final.stop_reason == "end_turn"
        assert final.usage.output_tokens == 2

        # max_tokens reached is max_tokens, never end_turn (E4)
        message = await client.messages.create(model="up/m1", max_tokens=1, messages=USER)
        assert message.stop_reason == "max_tokens"

        with pytest.raises(anthropic.NotFoundError) as nf:
            await client.messages.create(model="nope/x", max_tokens=5, messages=USER)
        assert nf.value.status_code == 404
        assert isinstance(nf.value.body, dict)
        assert nf.value.body["error"]["relay"]["reason"] == "unknown_model"

        # (A short Retry-After: a longer one holds the provider's next starts, SPEC L12,
        # and the stream below would wait behind it with its 200 already out.)
        upstream.scripts["m2"] = Script(status=429, headers={"retry-after-ms": "1"},
                                        error_body=error_body(429, LONG))
        with pytest.raises(anthropic.RateLimitError) as rl:
            await client.messages.create(model="up/m2", max_tokens=5, messages=USER)
        assert rl.value.response.headers["retry-after"] == "1"
        assert isinstance(rl.value.body, dict)
        assert rl.value.body["error"]["relay"]["upstream_message"] == LONG

        upstream.scripts["m2"] = Script(status=401, error_body=error_body(401, LONG))
        with pytest.raises(anthropic.APIStatusError) as auth:
            await client.messages.create(model="up/m2", max_tokens=5, messages=USER,
                                         stream=True)
        assert auth.value.status_code == 502
        assert isinstance(auth.value.body, dict)
        assert auth.value.body["error"]["type"] == "authentication_error"

        upstream.scripts["m2"] = Script(status=400, error_body=error_body(400, LONG))
        with pytest.raises(anthropic.BadRequestError) as bad:
            await client.messages.create(model="up/m2", max_tokens=5, messages=USER)
        assert LONG in bad.value.message

        upstream.scripts["m2"] = Script(chunks=["Hello", " world"], cut_after=1)
        got = ""
        with pytest.raises(anthropic.APIStatusError) as cut:
            async with client.messages.stream(model="up/m2", max_tokens=5,
                                              messages=USER) as stream:
                async for piece in stream.text_stream:
                    got += piece
        assert got == "Hello"
        assert isinstance(cut.value.body, dict)
        assert cut.value.body["error"]["relay"]["reason"] == "stream_cut"
    assert lane_idle(served)


async def test_anthropic_client_honours_should_retry(nursery: trio.Nursery, tmp_path: Path,
                                                     upstream: FakeUpstream) -> None:
    upstream.scripts["m1"] = Script(status=500, error_body=error_body(500, LONG))
    served = await start_relay(nursery, with_upstream(upstream), tmp_path)
    async with sdk(served.url, retries=3) as client:
        with pytest.raises(anthropic.InternalServerError) as exc:
            await client.messages.create(model="up/m1", max_tokens=5, messages=USER)
    assert exc.value.response.headers["x-should-retry"] == "false"
    assert len(upstream.requests) == 1


async def test_anthropic_client_tool_use_round_trip(nursery: trio.Nursery, tmp_path: Path,
                                                    upstream: FakeUpstream) -> None:
    upstream.scripts["m1"] = Script(chunks=[], tool_calls=[{
        "id": "call_9", "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'}}])
    served = await start_relay(nursery, with_upstream(upstream), tmp_path)
    tools: Any = [{"name": "get_weather", "description": "Weather in a city",
                   "input_schema": {"type": "object",
                                    "properties": {"city": {"type": "string"}}}}]
    async with sdk(served.url) as client:
        message = await client.messages.create(model="up/m1", max_tokens=50, messages=USER,
                                               tools=tools)
        assert message.stop_reason == "tool_use"
        (block,) = message.content
        assert block.type == "tool_use"
        assert (block.id, block.name, block.input) == ("call_9", "get_weather",
                                                      {"city": "Oslo"})
        assert upstream.requests[-1].json["tools"] == [{"type": "function", "function": {
            "name": "get_weather", "parameters": tools[0]["input_schema"],
            "description": "Weather in a city"}}]

        async with client.messages.stream(model="up/m1", max_tokens=50, messages=USER,
                                          tools=tools) as stream:
            final = await stream.get_final_message()
        assert final.stop_reason == "tool_use"
        assert final.content[0].type == "tool_use"
        assert final.content[0].input == {"city": "Oslo"}

        upstream.scripts["m1"] = Script(chunks=["12 C"])
        history: Any = [
            *USER, {"role": "assistant", "content": [block.model_dump()]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_9",
                                          "content": "12 C"}]}]
        message = await client.messages.create(model="up/m1", max_tokens=50,
                                               messages=history, tools=tools)
        assert message.content[0].type == "text"
    assert upstream.requests[-1].json["messages"][1:] == [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_9", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_9", "content": "12 C"}]


async def test_anthropic_client_with_the_fake_provider_and_heartbeats(
        nursery: trio.Nursery, tmp_path: Path) -> None:
    config = FAKE_ONLY.replace("[server]\n", "[server]\nheartbeat_s = 0.05\n", 1)
    served = await start_relay(nursery, config, tmp_path)
    async with sdk(served.url) as client:
        message = await client.messages.create(model="fake/echo", max_tokens=50,
                                               messages=USER)
        assert message.content[0].type == "text" and message.content[0].text == "hi"
        # heartbeats (SSE comments) before the first token: the client ignores them
        async with client.messages.stream(model="fake/echo?delay_s=0.2&reply=a b c",
                                          max_tokens=50, messages=USER) as stream:
            text = "".join([t async for t in stream.text_stream])
        assert text == "a b c"


async def test_client_stop_on_messages_closes_the_upstream(nursery: trio.Nursery,
                                                           tmp_path: Path,
                                                           upstream: FakeUpstream) -> None:
    upstream.scripts["slow"] = Script(chunks=["tok "] * 300, chunk_delay_s=0.01)
    served = await start_relay(nursery, with_upstream(upstream), tmp_path)
    stream = await raw_post(served.url, MESSAGES, body(model="up/slow", stream=True))
    await read_until(stream, b'"text":"tok "')
    conn = upstream.connections[upstream.requests[-1].conn_id]
    await stream.aclose()
    stopped = trio.current_time()
    with trio.fail_after(5):
        await upstream.wait_until(lambda: conn.closed_at is not None)
    assert conn.closed_at is not None and conn.closed_at - stopped < 0.5
    assert conn.closed_by == "peer"
    rec = await one_record(tmp_path)
    assert (rec["status"], rec["reason"]) == (499, "client_disconnected")
    assert lane_idle(served)


async def test_messages_through_the_anthropic_adapter(nursery: trio.Nursery, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RELAY_TEST_ANTHROPIC_KEY", ANTHROPIC_KEY)
    fake: FakeAnthropic = await nursery.start(serve_fake_anthropic)
    fake.scripts["t"] = AScript(chunks=["Checking."], tool_uses=[
        {"id": "toolu_5", "name": "f", "input": {"a": 1}}])
    served = await start_relay(nursery, FAKE_ONLY + f"""
[providers.claude]
adapter = "anthropic"
base_url = "{fake.url}"
api_key_env = "RELAY_TEST_ANTHROPIC_KEY"
models = ["t", "e"]
[providers.claude.profile]
rpm = 0
""", tmp_path)
    tools: Any = [{"name": "f", "input_schema": {"type": "object"}}]
    async with sdk(served.url) as client:
        message = await client.messages.create(model="claude/t", max_tokens=50,
                                               messages=USER, tools=tools, extra_body={"top_k": 3},
                                               stop_sequences=["END"])
        assert [b.type for b in message.content] == ["text", "tool_use"]
        assert message.stop_reason == "tool_use"
        async with client.messages.stream(model="claude/t", max_tokens=50, messages=USER,
                                          tools=tools) as stream:
            final = await stream.get_final_message()
        assert [b.type for b in final.content] == ["text", "tool_use"]
        assert final.content[1].type == "tool_use" and final.content[1].input == {"a": 1}

        fake.scripts["e"] = AScript(error_after=1)
        with pytest.raises(anthropic.APIStatusError) as exc:
            async with client.messages.stream(model="claude/e", max_tokens=50,
                                              messages=USER) as stream:
                async for _ in stream.text_stream:
                    pass
        assert isinstance(exc.value.body, dict)
        assert exc.value.body["error"]["relay"]["reason"] == "upstream_error"
    sent = posts(fake)[0].json
    assert sent["tools"] == [{"name": "f", "input_schema": {"type": "object"}}]
    assert (sent["top_k"], sent["stop_sequences"], sent["max_tokens"]) == (3, ["END"], 50)


async def test_messages_through_the_gemini_adapter(nursery: trio.Nursery, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RELAY_TEST_GEMINI_KEY", GEMINI_KEY)
    fake: FakeGemini = await nursery.start(serve_fake_gemini)
    served = await start_relay(nursery, FAKE_ONLY + f"""
[providers.gem]
adapter = "gemini"
base_url = "{fake.url}"
api_key_env = "RELAY_TEST_GEMINI_KEY"
models = ["g"]
[providers.gem.profile]
rpm = 0
""", tmp_path)
    async with sdk(served.url) as client:
        message = await client.messages.create(model="gem/g", max_tokens=50, messages=USER)
        assert message.content[0].type == "text" and message.content[0].text == "Hello world"
        assert message.usage.input_tokens == 8
        async with client.messages.stream(model="gem/g", max_tokens=50,
                                          messages=USER) as stream:
            assert "".join([t async for t in stream.text_stream]) == "Hello world"
    assert posts(fake)[0].json["generationConfig"] == {"maxOutputTokens": 50}
    assert lane_idle(served)
