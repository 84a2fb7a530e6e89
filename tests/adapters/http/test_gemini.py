"""The ``gemini`` adapter (SPEC P1): its translations table by table, then the assembled
relay in front of a fake Gemini API on loopback (tests/fakes/fake_gemini.py) that speaks the
real wire format — plain and streamed text, function calls both ways, every error class,
streams cut before their final chunk, and a client stop closing the upstream connection.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import openai
import pytest
import trio
from fakes.fake_gemini import (
    KEY,
    FakeGemini,
    Script,
    error_body,
    quota_failure,
    retry_info,
    serve_fake_gemini,
)
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

from relay.adapters.http.base import upstream_failure
from relay.adapters.http.gemini import (
    BROKEN,
    FINISH_REASONS,
    REFUSALS,
    CandidateReader,
    GeminiAdapter,
    gemini_request,
    split_tool_call_id,
    tool_call_id,
    usage_of,
)
from relay.vocab.errors import RelayError
from relay.vocab.events import Call, Delta, Finish, Skipped, Usage

KEY_ENV = "RELAY_TEST_GEMINI_KEY"
CHAT = "/v1/chat/completions"
LONG = "Gemini explains at length. " * 100


@pytest.fixture(autouse=True)
def _key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KEY_ENV, KEY)


@pytest.fixture
async def fake(nursery: trio.Nursery) -> FakeGemini:
    server: FakeGemini = await nursery.start(serve_fake_gemini)
    return server


def config(url: str, key_env: str = KEY_ENV) -> str:
    return FAKE_ONLY + f"""
[providers.gem]
adapter = "gemini"
base_url = "{url}"
api_key_env = "{key_env}"
[providers.gem.profile]
lanes = 2
queue_max = 8
queue_timeout_s = 10
run_timeout_s = 300
rpm = 0
"""


def call(messages: list[dict[str, Any]], stream: bool = False, **params: Any) -> Call:
    return Call(request_id="r1", provider="gem", model="gemini-x", messages=messages,
                stream=stream, params=params)


def user(content: Any) -> dict[str, Any]:
    return {"role": "user", "content": content}


TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "additionalProperties": False}}}
SIGNATURE = "Cr8BAdHtim+9/abcdA=="  # valid base64, as real signatures are

# --- request translation, table by table ----------------------------------------------------

REQUESTS: dict[str, tuple[list[dict[str, Any]], dict[str, Any], dict[str, Any]]] = {
    "roles and system instruction": (
        [{"role": "system", "content": "be brief"}, user("hi"),
         {"role": "assistant", "content": "Hello"}, user("again")], {},
        {"systemInstruction": {"parts": [{"text": "be brief"}]},
         "contents": [{"role": "user", "parts": [{"text": "hi"}]},
                      {"role": "model", "parts": [{"text": "Hello"}]},
                      {"role": "user", "parts": [{"text": "again"}]}]}),
    "generation config": (
        [user("hi")], {"max_tokens": 10, "temperature": 0.5, "top_p": 0.9, "top_k": 4,
                       "seed": 7, "stop": "END", "n": 2, "presence_penalty": 0.1,
                       "frequency_penalty": 0.2},
        {"contents": [{"role": "user", "parts": [{"text": "hi"}]}],
         "generationConfig": {"maxOutputTokens": 10, "temperature": 0.5, "topP": 0.9,
                              "topK": 4, "seed": 7, "stopSequences": ["END"],
                              "candidateCount": 2, "presencePenalty": 0.1,
                              "frequencyPenalty": 0.2}}),
    "json formats": (
        [user("hi")], {"max_completion_tokens": 5, "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}},
        {"contents": [{"role": "user", "parts": [{"text": "hi"}]}],
         "generationConfig": {"maxOutputTokens": 5, "responseMimeType": "application/json",
                              "responseJsonSchema": {"type": "object"}}}),
    "parts: text, image, pdf, audio": (
        [user([{"type": "text", "text": "see"},
               {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBOR"}},
               {"type": "file", "file": {"file_data": "data:application/pdf;base64,JVBE"}},
               {"type": "input_audio", "input_audio": {"data": "UklG", "format": "wav"}}])],
        {},
        {"contents": [{"role": "user", "parts": [
            {"text": "see"}, {"inlineData": {"mimeType": "image/png", "data": "iVBOR"}},
            {"inlineData": {"mimeType": "application/pdf", "data": "JVBE"}},
            {"inlineData": {"mimeType": "audio/wav", "data": "UklG"}}]}]}),
    "function calls and responses, signature from the id": (
        [user("weather?"),
         {"role": "assistant", "content": None, "tool_calls": [
             {"id": tool_call_id(SIGNATURE), "type": "function",
              "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
             {"id": "call_plain", "type": "function",
              "function": {"name": "get_time", "arguments": ""}}]},
         {"role": "tool", "tool_call_id": "call_plain", "content": "noon"},
         {"role": "tool", "tool_call_id": "x", "name": "get_weather",
          "content": '{"temp": 12}'}],
        {"tools": [TOOL], "tool_choice": "required"},
        {"contents": [
            {"role": "user", "parts": [{"text": "weather?"}]},
            {"role": "model", "parts": [
                {"functionCall": {"name": "get_weather", "args": {"city": "Oslo"}},
                 "thoughtSignature": SIGNATURE},
                {"functionCall": {"name": "get_time", "args": {}}}]},
            {"role": "user", "parts": [
                {"functionResponse": {"name": "get_time", "response": {"result": "noon"}}},
                {"functionResponse": {"name": "get_weather", "response": {"temp": 12}}}]}],
         "tools": [{"functionDeclarations": [{
             "name": "get_weather", "description": "Weather in a city",
             "parametersJsonSchema": TOOL["function"]["parameters"]}]}],  # type: ignore[index]
         "toolConfig": {"functionCallingConfig": {"mode": "ANY"}}}),
    "tool_choice by name; neutral values and user pass": (
        [user("hi")], {"tool_choice": {"type": "function", "function": {"name": "f"}},
                       "parallel_tool_calls": True, "logprobs": False, "user": "u-1"},
        {"contents": [{"role": "user", "parts": [{"text": "hi"}]}],
         "toolConfig": {"functionCallingConfig": {"mode": "ANY",
                                                  "allowedFunctionNames": ["f"]}}}),
}


@pytest.mark.parametrize(("messages", "params", "expected"), REQUESTS.values(), ids=REQUESTS)
def test_request_translation(messages: list[dict[str, Any]], params: dict[str, Any],
                             expected: dict[str, Any]) -> None:
    assert gemini_request(call(messages, **params)) == expected


@pytest.mark.parametrize("signature", [SIGNATURE, "YQ==", "YWI=", "a+b/cA==", ""])
def test_thought_signature_round_trips_in_the_id(signature: str) -> None:
    made = tool_call_id(signature)
    assert made.startswith("call_")
    assert all(ch.isalnum() or ch in "_-" for ch in made)
    assert split_tool_call_id(made) == (signature or None)


REFUSED: dict[str, tuple[list[dict[str, Any]], dict[str, Any], str, str]] = {
    "http image": ([user([{"type": "image_url",
                           "image_url": {"url": "https://x.test/a.png"}}])], {},
                   "unsupported", "messages"),
    "logprobs": ([user("hi")], {"logprobs": True}, "unsupported", "logprobs"),
    "parallel_tool_calls false": ([user("hi")], {"parallel_tool_calls": False,
                                                 "tools": [TOOL]},
                                  "unsupported", "parallel_tool_calls"),
    "logit_bias": ([user("hi")], {"logit_bias": {"1": 5}}, "unsupported", "logit_bias"),
    "tool answer with no call": ([{"role": "tool", "tool_call_id": "nope", "content": "x"}],
                                 {}, "invalid_request", "messages"),
    "response_format unknown": ([user("hi")], {"response_format": {"type": "grammar"}},
                                "unsupported", "response_format"),
}


@pytest.mark.parametrize(("messages", "params", "reason", "param"), REFUSED.values(),
                         ids=REFUSED)
def test_what_cannot_be_sent_is_refused_by_name(messages: list[dict[str, Any]],
                                                 params: dict[str, Any], reason: str,
                                                 param: str) -> None:
    adapter = object.__new__(GeminiAdapter)
    adapter.name = "gem"
    adapter.provider = SimpleNamespace(strict_fields=False)
    with pytest.raises(RelayError) as info:
        adapter.check_call(call(messages, **params))
    assert (info.value.reason, info.value.param) == (reason, param)


# --- answer translation ---------------------------------------------------------------------

def candidate(reason: str | None, parts: list[dict[str, Any]] | None = None,
              index: int = 0) -> dict[str, Any]:
    cand: dict[str, Any] = {"content": {"role": "model", "parts": parts or [{"text": "x"}]},
                            "index": index}
    if reason:
        cand["finishReason"] = reason
    return cand


@pytest.mark.parametrize(("reason", "finish"), FINISH_REASONS.items())
def test_finish_reasons(reason: str, finish: str) -> None:
    events = CandidateReader("gem").feed({"candidates": [candidate(reason)]})
    assert events[-1] == Finish(finish)
    assert FINISH_REASONS["MAX_TOKENS"] == "length"


@pytest.mark.parametrize("reason", list(REFUSALS))
def test_refusals_are_rejected_with_the_reason(reason: str) -> None:
    with pytest.raises(RelayError) as info:
        CandidateReader("gem").feed({"candidates": [candidate(reason)]})
    assert info.value.reason == "rejected"
    assert reason in info.value.message


@pytest.mark.parametrize("reason", [*BROKEN, "SOMETHING_NEW"])
def test_broken_finishes_are_bad_upstream_responses(reason: str) -> None:
    with pytest.raises(RelayError) as info:
        CandidateReader("gem").feed({"candidates": [candidate(reason)]})
    assert info.value.reason == "bad_upstream_response"
    assert reason in info.value.message


def test_blocked_prompt_is_rejected() -> None:
    with pytest.raises(RelayError) as info:
        CandidateReader("gem").feed({"promptFeedback": {"blockReason": "PROHIBITED_CONTENT"}})
    assert info.value.reason == "rejected"
    assert "PROHIBITED_CONTENT" in info.value.message


def test_parts_and_function_calls() -> None:
    reader = CandidateReader("gem")
    events = reader.feed({"candidates": [candidate(None, [
        {"text": "pondering", "thought": True}, {"text": "Hi"},
        {"executableCode": {"code": "1+1"}}])]})
    assert events == [Delta(extra={"reasoning_content": "pondering"}), Delta(content="Hi"),
                      Skipped("a part of kind executableCode not relayed")]
    assert not reader.complete
    events = reader.feed({"candidates": [candidate("STOP", [
        {"functionCall": {"name": "f", "args": {"a": 1}}, "thoughtSignature": SIGNATURE},
        {"functionCall": {"name": "g", "args": {}}}])],
        "usageMetadata": {"promptTokenCount": 5, "candidatesTokenCount": 3,
                          "totalTokenCount": 8}})
    first, second = events[0], events[1]
    assert isinstance(first, Delta) and isinstance(second, Delta)
    assert first.tool_calls and second.tool_calls
    assert first.tool_calls[0]["function"] == {"name": "f", "arguments": '{"a": 1}'}
    assert split_tool_call_id(first.tool_calls[0]["id"]) == SIGNATURE
    assert second.tool_calls[0]["index"] == 1
    assert split_tool_call_id(second.tool_calls[0]["id"]) is None
    assert events[2:] == [Usage(5, 3, 8), Finish("tool_calls")]
    assert reader.complete


def test_several_candidates_complete_only_together() -> None:
    reader = CandidateReader("gem")
    reader.feed({"candidates": [candidate("STOP", index=0), candidate(None, index=1)]})
    assert not reader.complete
    assert reader.feed({"candidates": [candidate("MAX_TOKENS", index=1)]})[-1] == \
        Finish("length", 1)
    assert reader.complete


@pytest.mark.parametrize(("raw", "usage"), [
    ({"promptTokenCount": 8, "candidatesTokenCount": 2, "thoughtsTokenCount": 5,
      "totalTokenCount": 15}, Usage(8, 7, 15)),
    ({"promptTokenCount": 8, "totalTokenCount": 8}, Usage(8, None, 8)),
    ({}, Usage(None, None, None)),
])
def test_usage(raw: dict[str, Any], usage: Usage) -> None:
    assert usage_of(raw) == usage


ERRORS: dict[str, tuple[int, dict[str, Any], str, float | None]] = {
    "401": (401, error_body(401, "Request had invalid authentication credentials."),
            "auth_required", None),
    "403": (403, error_body(403, "Method doesn't allow unregistered callers."),
            "auth_required", None),
    "400 API_KEY_INVALID": (400, error_body(400, "API key not valid.", [{
        "@type": "type.googleapis.com/google.rpc.ErrorInfo", "reason": "API_KEY_INVALID"}]),
        "auth_required", None),
    "429 per minute, RetryInfo": (429, error_body(
        429, "You exceeded your current quota, please check your plan and billing details.",
        [quota_failure("GenerateRequestsPerMinutePerProjectPerModel-FreeTier"),
         retry_info("43s")]), "rate_limited", 43.0),
    "429 per day": (429, error_body(
        429, "You exceeded your current quota, please check your plan and billing details.",
        [quota_failure("GenerateRequestsPerDayPerProjectPerModel-FreeTier"),
         retry_info("20s")]), "quota_exhausted", None),
    "429 limit 0": (429, error_body(429, "Quota exceeded for metric: x, limit: 0"),
                    "quota_exhausted", None),
    "429 plain": (429, error_body(429, "Resource has been exhausted (e.g. check quota)."),
                  "rate_limited", 1.0),
    "400 too long": (400, error_body(
        400, "The input token count (1200000) exceeds the maximum number of tokens allowed "
        "(1048576)."), "context_too_long", None),
    "400 invalid": (400, error_body(400, "* GenerateContentRequest.contents: bad"),
                    "rejected", None),
    "404": (404, error_body(404, "models/nope is not found for API version v1beta"),
            "rejected", None),
    "500": (500, error_body(500, "Internal error encountered."), "upstream_error", None),
    "503": (503, error_body(503, "The model is overloaded."), "upstream_error", None),
    "list-wrapped": (429, [error_body(429, "per day quota", [
        quota_failure("GenerateRequestsPerDay")])], "quota_exhausted", None),  # type: ignore[dict-item]
}


@pytest.mark.parametrize(("status", "body", "reason", "retry"), ERRORS.values(), ids=ERRORS)
def test_error_mapping(status: int, body: dict[str, Any], reason: str,
                       retry: float | None) -> None:
    error = upstream_failure("gem", status, json.dumps(body), {}, key_hint=KEY_ENV)
    assert error.reason == reason
    assert error.upstream_status == status
    if retry is not None:
        assert error.retry_after_s == retry


# --- through the assembled relay ----------------------------------------------------------

async def test_plain_and_streamed_text(nursery: trio.Nursery, tmp_path: Path,
                                       fake: FakeGemini) -> None:
    served = await start_relay(nursery, config(fake.url), tmp_path)
    messages = [{"role": "system", "content": "be brief"}, user("hi")]
    async with http_client() as client:
        r = await client.post(served.url + CHAT, json={"model": "gem/gemini-test-flash",
                                                       "messages": messages})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["choices"][0]["message"] == {"role": "assistant",
                                                 "content": "Hello world"}
        assert body["choices"][0]["finish_reason"] == "stop"
        assert body["usage"] == {"prompt_tokens": 8, "completion_tokens": 3,
                                 "total_tokens": 11}

        r = await client.post(served.url + CHAT, json={
            "model": "gem/gemini-test-flash", "messages": messages, "stream": True})
    events = sse_events(r.text)
    assert content_of(events) == "Hello world"
    assert finishes(events) == ["stop"]
    assert events[-1] == "[DONE]"
    sent = posts(fake)
    assert [q.path for q in sent] == [
        "/v1beta/models/gemini-test-flash:generateContent",
        "/v1beta/models/gemini-test-flash:streamGenerateContent?alt=sse"]
    assert sent[0].headers["x-goog-api-key"] == KEY
    assert sent[0].json == {"systemInstruction": {"parts": [{"text": "be brief"}]},
                            "contents": [{"role": "user", "parts": [{"text": "hi"}]}]}
    assert lane_idle(served)


async def test_max_tokens_is_length(nursery: trio.Nursery, tmp_path: Path,
                                    fake: FakeGemini) -> None:
    served = await start_relay(nursery, config(fake.url), tmp_path)
    async with http_client() as client:
        r = await client.post(served.url + CHAT, json=chat("gem/m", max_tokens=1))
        assert r.json()["choices"][0]["finish_reason"] == "length"
        r = await client.post(served.url + CHAT, json=chat("gem/m", max_tokens=1,
                                                           stream=True))
    events = sse_events(r.text)
    assert (content_of(events), finishes(events)) == ("Hello", ["length"])


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
async def test_function_call_both_ways(nursery: trio.Nursery, tmp_path: Path,
                                       fake: FakeGemini, stream: bool) -> None:
    fake.scripts["m"] = Script(chunks=[], function_calls=[
        {"name": "get_weather", "args": {"city": "Oslo"}, "signature": SIGNATURE}])
    served = await start_relay(nursery, config(fake.url), tmp_path)
    async with http_client() as client:
        r = await client.post(served.url + CHAT, json=chat("gem/m", "weather?", tools=[TOOL],
                                                           stream=stream))
        assert r.status_code == 200, r.text
        if stream:
            events = sse_events(r.text)
            assert finishes(events) == ["tool_calls"]
            (got,) = tool_calls_of(events).values()
        else:
            choice = r.json()["choices"][0]
            assert choice["finish_reason"] == "tool_calls"
            (tc,) = choice["message"]["tool_calls"]
            got = {"id": tc["id"], **tc["function"]}
        assert got["name"] == "get_weather"
        assert json.loads(got["arguments"]) == {"city": "Oslo"}
        assert posts(fake)[0].json["tools"] == [{"functionDeclarations": [{
            "name": "get_weather", "description": "Weather in a city",
            "parametersJsonSchema": TOOL["function"]["parameters"]}]}]  # type: ignore[index]

        # the other way: the client echoes the call (its id carries the signature)
        fake.scripts["m"] = Script(chunks=["12 C in Oslo."])
        r = await client.post(served.url + CHAT, json={"model": "gem/m", "stream": stream,
                                                       "tools": [TOOL], "messages": [
            user("weather?"),
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": got["id"], "type": "function",
                "function": {"name": "get_weather", "arguments": got["arguments"]}}]},
            {"role": "tool", "tool_call_id": got["id"], "content": '{"temp": 12}'}]})
        assert r.status_code == 200, r.text
    assert posts(fake)[1].json["contents"][1:] == [
        {"role": "model", "parts": [{"functionCall": {"name": "get_weather",
                                                      "args": {"city": "Oslo"}},
                                     "thoughtSignature": SIGNATURE}]},
        {"role": "user", "parts": [{"functionResponse": {"name": "get_weather",
                                                         "response": {"temp": 12}}}]}]


STATUS_CASES = {
    "401": (Script(status=401, error=error_body(401, LONG)), 502, "auth_required"),
    "403": (Script(status=403, error=error_body(403, LONG)), 502, "auth_required"),
    "429 rate": (Script(status=429, error=error_body(429, LONG, [
        quota_failure("GenerateRequestsPerMinutePerProjectPerModel-FreeTier"),
        retry_info("7s")])), 429, "rate_limited"),
    "429 quota": (Script(status=429, error=error_body(429, LONG, [
        quota_failure("GenerateRequestsPerDayPerProjectPerModel-FreeTier")])), 429,
        "quota_exhausted"),
    "500": (Script(status=500, error=error_body(500, LONG)), 502, "upstream_error"),
    "503": (Script(status=503, error=error_body(503, LONG)), 502, "upstream_error"),
    "400 invalid": (Script(status=400, error=error_body(400, LONG)), 400, "rejected"),
    "400 too long": (Script(status=400, error=error_body(
        400, "The input token count (1200000) exceeds the maximum number of tokens "
        "allowed (1048576).")), 400, "context_too_long"),
}


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize(("script", "status", "reason"), STATUS_CASES.values(),
                         ids=STATUS_CASES)
async def test_error_statuses(nursery: trio.Nursery, tmp_path: Path, fake: FakeGemini,
                              script: Script, status: int, reason: str,
                              stream: bool) -> None:
    fake.scripts["m"] = script
    served = await start_relay(nursery, config(fake.url), tmp_path)
    async with http_client() as client:
        r = await client.post(served.url + CHAT, json=chat("gem/m", stream=stream))
    err = e1(r, status, reason)
    assert err["relay"]["upstream_status"] == script.status
    assert err["relay"]["upstream_message"] == (script.error or {})["error"]["message"]
    if reason == "rate_limited":
        assert r.headers["retry-after"] == "7"
    if reason == "quota_exhausted":
        assert r.headers["retry-after"] == "600"
    if reason == "rejected":
        assert LONG in err["message"]
    assert len(posts(fake)) == 1
    rec = await one_record(tmp_path)
    assert (rec["status"], rec["reason"]) == (status, reason)
    assert lane_idle(served)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
async def test_safety_and_blocked_prompts_are_rejected(nursery: trio.Nursery,
                                                       tmp_path: Path, fake: FakeGemini,
                                                       stream: bool) -> None:
    served = await start_relay(nursery, config(fake.url), tmp_path)
    async with http_client() as client:
        fake.scripts["m"] = Script(chunks=[], finish_reason="SAFETY")
        r = await client.post(served.url + CHAT, json=chat("gem/m", stream=stream))
        err = e1(r, 400, "rejected")
        assert "SAFETY" in err["message"]
        fake.scripts["m"] = Script(block_reason="PROHIBITED_CONTENT")
        r = await client.post(served.url + CHAT, json=chat("gem/m", stream=stream))
        err = e1(r, 400, "rejected")
        assert "PROHIBITED_CONTENT" in err["message"]


async def test_safety_after_content_is_in_band(nursery: trio.Nursery, tmp_path: Path,
                                               fake: FakeGemini) -> None:
    fake.scripts["m"] = Script(chunks=["Sure, ", "here"], finish_reason="RECITATION")
    served = await start_relay(nursery, config(fake.url), tmp_path)
    async with http_client() as client:
        r = await client.post(served.url + CHAT, json=chat("gem/m", stream=True))
    events = sse_events(r.text)
    assert r.status_code == 200
    assert content_of(events) == "Sure, " and finishes(events) == []
    assert events[-1]["error"]["code"] == "rejected"
    assert "RECITATION" in events[-1]["error"]["message"]


async def test_error_event_inside_the_stream(nursery: trio.Nursery, tmp_path: Path,
                                             fake: FakeGemini) -> None:
    fake.scripts["m"] = Script(error_after=1)
    served = await start_relay(nursery, config(fake.url), tmp_path)
    async with http_client() as client:
        r = await client.post(served.url + CHAT, json=chat("gem/m", stream=True))
    events = sse_events(r.text)
    assert content_of(events) == "Hello"
    assert events[-1]["error"]["code"] == "upstream_error"
    assert events[-1]["error"]["relay"]["upstream_message"] == (
        "The model is overloaded. Please try again later.")


@pytest.mark.parametrize("script", [
    pytest.param(Script(omit_finish=True), id="ends without finishReason"),
    pytest.param(Script(cut_after=1), id="connection dropped"),
])
async def test_stream_cut_before_its_final_chunk(nursery: trio.Nursery, tmp_path: Path,
                                                 fake: FakeGemini, script: Script) -> None:
    fake.scripts["m"] = script
    served = await start_relay(nursery, config(fake.url), tmp_path)
    async with http_client() as client:
        r = await client.post(served.url + CHAT, json=chat("gem/m", stream=True))
    assert r.status_code == 200
    events = sse_events(r.text)
    assert finishes(events) == [] and "[DONE]" not in events
    assert events[-1]["error"]["code"] == "stream_cut"
    assert content_of(events) == ("Hello" if script.cut_after else "Hello world")
    rec = await one_record(tmp_path)
    assert (rec["status"], rec["reason"]) == (502, "stream_cut")
    assert lane_idle(served)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
async def test_a_timeout_awaiting_headers_closes_the_upstream(nursery: trio.Nursery,
                                                              tmp_path: Path, fake: FakeGemini,
                                                              stream: bool) -> None:
    """SPEC C2: the adapter awaits headers that never come; the attempt's timeout stops
    it, and the upstream connection is closed at once."""
    fake.scripts["hung"] = Script(hang=True)
    route = """
[routes.r]
primary = "gem/hung"
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
                                                          fake: FakeGemini) -> None:
    fake.scripts["slow"] = Script(chunks=["tok "] * 500, chunk_delay_s=0.01)
    served = await start_relay(nursery, config(fake.url), tmp_path)
    stream = await raw_post(served.url, CHAT, chat("gem/slow", stream=True))
    await read_until(stream, b'"content":"tok "')
    await stop_closes_upstream(fake, stream)
    rec = await one_record(tmp_path)
    assert (rec["status"], rec["reason"]) == (499, "client_disconnected")
    assert lane_idle(served)


async def test_key_problems_are_auth_required(nursery: trio.Nursery, tmp_path: Path,
                                              fake: FakeGemini,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    served = await start_relay(nursery, config(fake.url, key_env="RELAY_TEST_NO_KEY"),
                               tmp_path)
    async with http_client() as client:
        r = await client.post(served.url + CHAT, json=chat("gem/m"))
        assert "RELAY_TEST_NO_KEY" in e1(r, 502, "auth_required")["relay"]["action"]
        assert posts(fake) == []
    monkeypatch.setenv(KEY_ENV, "wrong")
    served = await start_relay(nursery, config(fake.url), tmp_path)
    async with http_client() as client:
        r = await client.post(served.url + CHAT, json=chat("gem/m"))
    err = e1(r, 502, "auth_required")  # Gemini says 400 API_KEY_INVALID
    assert err["relay"]["upstream_status"] == 400


async def test_models_are_discovered(nursery: trio.Nursery, tmp_path: Path,
                                     fake: FakeGemini) -> None:
    served = await start_relay(nursery, config(fake.url), tmp_path)
    names = await served.relay.providers["gem"].adapter.models()
    assert names == ["gemini-test-flash", "gemini-test-pro"]  # embeddings left out
    assert {q.path for q in fake.requests} == {  # relay's own discovery asks the same
        "/v1beta/models?pageSize=1000", "/v1beta/models?pageSize=1000&pageToken=2"}


# --- the official openai client, with this adapter behind relay -----------------------------

openai_gens = pytest.mark.filterwarnings("ignore:Async generator 'openai\\.:ResourceWarning")


@openai_gens
async def test_openai_client(nursery: trio.Nursery, tmp_path: Path, fake: FakeGemini) -> None:
    served = await start_relay(nursery, config(fake.url), tmp_path)
    msgs: Any = [{"role": "user", "content": "hi"}]
    async with http_client() as http:
        c = openai.AsyncOpenAI(base_url=served.url + "/v1", api_key="x", max_retries=0,
                               http_client=http)
        done = await c.chat.completions.create(model="gem/m", messages=msgs)
        assert done.choices[0].message.content == "Hello world"
        stream = await c.chat.completions.create(model="gem/m", messages=msgs, stream=True)
        text = "".join([ch.choices[0].delta.content or "" async for ch in stream
                        if ch.choices])
        assert text == "Hello world"

        fake.scripts["t"] = Script(chunks=[], function_calls=[
            {"name": "get_weather", "args": {"city": "Oslo"}}])
        tools: Any = [TOOL]
        done = await c.chat.completions.create(model="gem/t", messages=msgs, tools=tools)
        tc: Any = done.choices[0].message.tool_calls
        assert done.choices[0].finish_reason == "tool_calls"
        assert tc[0].function.name == "get_weather"

        fake.scripts["e"] = Script(status=429, error=error_body(429, LONG, [
            quota_failure("GenerateRequestsPerDayPerProjectPerModel-FreeTier")]))
        with pytest.raises(openai.RateLimitError) as rl:
            await c.chat.completions.create(model="gem/e", messages=msgs)
        assert rl.value.code == "quota_exhausted"

        fake.scripts["e"] = Script(status=503, error=error_body(503, LONG))
        with pytest.raises(openai.InternalServerError) as ise:
            await c.chat.completions.create(model="gem/e", messages=msgs)
        assert ise.value.code == "upstream_error"
    assert lane_idle(served)
