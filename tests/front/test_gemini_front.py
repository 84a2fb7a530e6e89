"""Google's Gemini API on relay's front (SPEC A9): ``/v1beta/models/{model}:generateContent``,
``:streamGenerateContent?alt=sse``, ``:countTokens`` and the model routes.

First the translation (the dialect is pure), then the assembled relay on loopback: the
fake provider, an OpenAI-compatible upstream (a tool round trip, ids matched), the
``anthropic`` adapter, and the ``gemini`` adapter (native: the request reaches it
unchanged); Google-shaped errors everywhere under ``/v1beta`` (the guard's refusals and
the unknown path included).
"""

from __future__ import annotations

import copy
import functools
import itertools
import json
import re
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest
import trio
from fakes.fake_anthropic import KEY as ANTHROPIC_KEY
from fakes.fake_anthropic import FakeAnthropic
from fakes.fake_endpoints import (
    CountingAnthropic,
    EmbeddingGemini,
    serve_counting_anthropic,
    serve_embedding_gemini,
)
from fakes.fake_gemini import KEY as GEMINI_KEY
from fakes.fake_gemini import FakeGemini
from fakes.upstream import FakeUpstream, Script, serve_fake_upstream
from helpers.assembled import FAKE_ONLY, lane_idle, start_relay, wait_for
from helpers.cloud_helpers import http_client, one_record, posts, sse_blocks
from hypothesis import given, settings
from hypothesis import strategies as st

from relay.dialects.base import Answer
from relay.dialects.gemini_generate import GEMINI, GEMINI_SDK, parse_gemini_body
from relay.vocab.errors import RelayError
from relay.vocab.events import Delta, Finish, Usage

GEN = "/v1beta/models/{}:generateContent"
STREAM = "/v1beta/models/{}:streamGenerateContent?alt=sse"
COUNT = "/v1beta/models/{}:countTokens"
TOOL = {"functionDeclarations": [{
    "name": "list_directory", "description": "List a folder",
    "parametersJsonSchema": {"type": "object", "properties": {"path": {"type": "string"}},
                             "required": ["path"]}}]}


def req(text: str = "hello", **kw: Any) -> dict[str, Any]:
    return {"contents": [{"role": "user", "parts": [{"text": text}]}], **kw}


def parse(data: dict[str, Any], stream: bool = False) -> Any:
    return parse_gemini_body(json.dumps(data).encode(), "m", stream=stream)


def refusal(data: Any) -> RelayError:
    with pytest.raises(RelayError) as caught:
        parse_gemini_body(json.dumps(data).encode(), "m", stream=False)
    return caught.value


# --- the request, translated ----------------------------------------------------------------

def test_contents_system_and_generation_config() -> None:
    chat = parse(req(
        systemInstruction={"parts": [{"text": "be brief"}, {"text": "and kind"}]},
        generationConfig={"temperature": 0.2, "topP": 0.9, "topK": 5, "maxOutputTokens": 64,
                          "stopSequences": ["END"], "candidateCount": 1, "seed": 7,
                          "thinkingConfig": {"thinkingBudget": 0}},
        safetySettings=[{"category": "HARM_CATEGORY_HARASSMENT", "threshold": "BLOCK_NONE"}]),
        stream=True)
    assert chat.model == "m" and chat.stream and chat.include_usage
    assert chat.messages == [{"role": "system", "content": "be brief\nand kind"},
                             {"role": "user", "content": "hello"}]
    assert chat.params == {"temperature": 0.2, "top_p": 0.9, "top_k": 5, "seed": 7,
                           "max_tokens": 64, "stop": ["END"]}
    # The client's names, for what relay reports; its own fields kept for the field policy.
    assert chat.inbound.names["top_p"] == "generationConfig.topP"
    assert chat.inbound.names["max_tokens"] == "generationConfig.maxOutputTokens"
    assert set(chat.inbound.own) == {"generationConfig.thinkingConfig", "safetySettings"}
    assert chat.inbound.dialect == "gemini" and chat.inbound.body is not None
    assert chat.inbound.body["safetySettings"][0]["threshold"] == "BLOCK_NONE"


def test_parts_media_and_tool_round_trip_ids() -> None:
    chat = parse({"contents": [
        {"role": "user", "parts": [{"text": "see"}, {"inlineData": {
            "mimeType": "image/png", "data": "iVBOR"}}, {"fileData": {
                "mimeType": "application/pdf", "fileUri": "https://x.test/a.pdf"}}]},
        {"role": "model", "parts": [
            {"text": "thinking", "thought": True, "thoughtSignature": "c2ln"},
            {"text": "Calling."},
            {"functionCall": {"name": "ls", "args": {"path": "/"}}},
            {"functionCall": {"id": "abc", "name": "cat", "args": {"f": "x"}}}]},
        {"role": "user", "parts": [
            {"functionResponse": {"id": "abc", "name": "cat", "response": {"out": "x!"}}},
            {"functionResponse": {"name": "ls", "response": {"output": "a b"}}},
            {"text": "and?"}]}],
        "tools": [{"functionDeclarations": [
            {"name": "ls", "parameters": {"type": "OBJECT", "properties": {
                "path": {"type": "STRING", "nullable": True}}, "propertyOrdering": ["path"]}},
            {"name": "cat", "description": "read"}]}],
        "toolConfig": {"functionCallingConfig": {"mode": "ANY"}}})
    assert chat.messages == [
        {"role": "user", "content": [
            {"type": "text", "text": "see"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBOR"}},
            {"type": "file", "file": {"file_data": "https://x.test/a.pdf",
                                      "filename": "file"}}]},
        {"role": "assistant", "content": "Calling.", "tool_calls": [
            {"id": "call_1_2", "type": "function",
             "function": {"name": "ls", "arguments": '{"path": "/"}'}},
            {"id": "abc", "type": "function",
             "function": {"name": "cat", "arguments": '{"f": "x"}'}}]},
        {"role": "tool", "tool_call_id": "abc", "content": '{"out": "x!"}'},
        {"role": "tool", "tool_call_id": "call_1_2", "content": '{"output": "a b"}'},
        {"role": "user", "content": "and?"}]
    assert chat.params["tools"] == [
        {"type": "function", "function": {"name": "ls", "parameters": {
            "type": "object", "properties": {"path": {"type": ["string", "null"]}}}}},
        {"type": "function", "function": {"name": "cat", "description": "read",
                                          "parameters": {"type": "object",
                                                         "properties": {}}}}]
    assert chat.params["tool_choice"] == "required"
    assert set(chat.inbound.own) == {"contents.thought", "contents.thoughtSignature"}


@pytest.mark.parametrize(("config", "choice", "tools"), [
    ({"mode": "AUTO"}, "auto", ["a", "b"]),
    ({"mode": "NONE"}, "none", ["a", "b"]),
    ({"mode": "ANY", "allowedFunctionNames": ["b"]},
     {"type": "function", "function": {"name": "b"}}, ["b"]),
    ({"mode": "ANY", "allowedFunctionNames": ["a", "b"]}, "required", ["a", "b"]),
    ({"mode": "AUTO", "allowedFunctionNames": ["a"]}, "auto", ["a"]),
])
def test_function_calling_modes(config: dict[str, Any], choice: Any, tools: list[str]) -> None:
    chat = parse(req(tools=[{"functionDeclarations": [{"name": "a"}, {"name": "b"}]}],
                     toolConfig={"functionCallingConfig": config}))
    assert chat.params["tool_choice"] == choice
    assert [t["function"]["name"] for t in chat.params["tools"]] == tools
    assert chat.inbound.names["tool_choice"] == "toolConfig"


def test_json_answers_map_to_response_format() -> None:
    schema = {"type": "object", "properties": {"model_choice": {"type": "string"}}}
    chat = parse(req(generationConfig={"responseMimeType": "application/json",
                                       "responseJsonSchema": schema}))
    assert chat.params["response_format"] == {"type": "json_schema", "json_schema": {
        "name": "output", "schema": schema}}
    chat = parse(req(generationConfig={"responseMimeType": "application/json",
                                       "responseSchema": {"type": "OBJECT"}}))
    assert chat.params["response_format"]["json_schema"]["schema"] == {"type": "object"}
    chat = parse(req(generationConfig={"responseMimeType": "application/json"}))
    assert chat.params["response_format"] == {"type": "json_object"}
    assert "response_format" not in parse(req(generationConfig={
        "responseMimeType": "text/plain"})).params


@pytest.mark.parametrize(("data", "param"), [
    ({}, "contents"),
    ({"contents": []}, "contents"),
    ({"contents": "hi"}, "contents"),
    ({"contents": [{"role": "assistant", "parts": [{"text": "x"}]}]}, "contents[0].role"),
    ({"contents": [{"parts": [{"text": 5}]}]}, "contents[0].parts[0].text"),
    ({"contents": [{"parts": [{}]}]}, "contents[0].parts[0]"),
    ({"contents": [{"parts": [{"functionCall": {"name": "f", "args": [1]}}]}]},
     "contents[0].parts[0].functionCall.args"),
    (req(generationConfig={"temperature": "hot"}), "generationConfig.temperature"),
    (req(generationConfig={"topK": True}), "generationConfig.topK"),
    (req(generationConfig={"maxOutputTokens": 0}), "generationConfig.maxOutputTokens"),
    (req(generationConfig={"maxOutputTokens": 2**40}), "generationConfig.maxOutputTokens"),
    (req(generationConfig={"stopSequences": "END"}), "generationConfig.stopSequences"),
    (req(generationConfig={"stopSequences": [5]}), "generationConfig.stopSequences[0]"),
    (req(generationConfig=[]), "generationConfig"),
    (req(generationConfig={"responseJsonSchema": {}}), "generationConfig.responseJsonSchema"),
    (req(tools={"functionDeclarations": []}), "tools"),
    (req(tools=[{"functionDeclarations": [{"description": "x"}]}]),
     "tools[0].functionDeclarations[0].name"),
    (req(toolConfig={"functionCallingConfig": {"mode": "SOMETIMES"}}),
     "toolConfig.functionCallingConfig.mode"),
    (req(systemInstruction=5), "systemInstruction"),
    # the dialect's own fields, typed too (GEMINI_SCHEMA) though relay passes them on
    (req(safetySettings={"category": "x"}), "safetySettings"),
    (req(generationConfig={"thinkingConfig": {"thinkingBudget": "lots"}}),
     "generationConfig.thinkingConfig.thinkingBudget"),
    (req(labels={"team": 5}), "labels.team"),
    (req(cachedContent=7), "cachedContent"),
    # nothing left to answer once thoughts are set aside (a CLI tool named `messages`)
    ({"contents": [{"role": "user", "parts": []}]}, "contents"),
    ({"contents": [{"role": "user", "parts": [{"text": "hm", "thought": True}]}]},
     "contents"),
    ({"contents": [{"role": "user", "parts": [
        {"functionResponse": {"name": "ghost", "response": {}}}]}]}, "contents[0].parts[0]"),
])
def test_wrong_types_name_the_field(data: Any, param: str) -> None:
    error = refusal(data)
    assert error.reason == "invalid_request" and error.status == 400
    assert error.param == param, error.message
    assert param in error.message


def test_refused_translations() -> None:
    error = refusal(req(generationConfig={"candidateCount": 2}))
    assert (error.reason, error.param) == ("unsupported", "generationConfig.candidateCount")
    error = refusal(req(generationConfig={"responseMimeType": "text/x.enum"}))
    assert error.reason == "unsupported"
    error = refusal({"contents": [{"parts": [{"executableCode": {"code": "1"}}]}]})
    assert (error.reason, error.param) == ("unsupported",
                                           "contents[0].parts[0].executableCode")


def test_snake_case_names_are_googles_names_too() -> None:
    # What google-genai's automatic function calling sends: parameters_json_schema.
    schema = {"type": "object", "properties": {"city_name": {"type": "string"}},
              "required": ["city_name"]}
    snake = {"contents": [{"role": "user", "parts": [{"text": "hi"}]},
                          {"role": "model", "parts": [{"function_call": {
                              "name": "get_weather", "args": {"city_name": "Oslo"}}}]},
                          {"role": "user", "parts": [{"function_response": {
                              "name": "get_weather", "response": {"sky_now": "sun"}}}]}],
             "system_instruction": {"parts": [{"text": "be brief"}]},
             "tools": [{"function_declarations": [{
                 "name": "get_weather", "parameters_json_schema": schema}]}],
             "tool_config": {"function_calling_config": {
                 "mode": "ANY", "allowed_function_names": ["get_weather"]}},
             "generation_config": {"max_output_tokens": 64, "top_p": 0.5,
                                   "thinking_config": {"thinking_budget": 0}},
             "safety_settings": []}
    camel = {"contents": [{"role": "user", "parts": [{"text": "hi"}]},
                          {"role": "model", "parts": [{"functionCall": {
                              "name": "get_weather", "args": {"city_name": "Oslo"}}}]},
                          {"role": "user", "parts": [{"functionResponse": {
                              "name": "get_weather", "response": {"sky_now": "sun"}}}]}],
             "systemInstruction": {"parts": [{"text": "be brief"}]},
             "tools": [{"functionDeclarations": [{
                 "name": "get_weather", "parametersJsonSchema": schema}]}],
             "toolConfig": {"functionCallingConfig": {
                 "mode": "ANY", "allowedFunctionNames": ["get_weather"]}},
             "generationConfig": {"maxOutputTokens": 64, "topP": 0.5,
                                  "thinkingConfig": {"thinkingBudget": 0}},
             "safetySettings": []}
    got, want = parse(snake), parse(camel)
    assert got.messages == want.messages and got.params == want.params
    # the schema is the tool's, whole (free-form values keep their own names)
    assert got.params["tools"][0]["function"]["parameters"] == schema
    assert got.params["max_tokens"] == 64 and got.params["top_p"] == 0.5
    assert got.inbound.body == want.inbound.body  # the gemini adapter gets Google's names
    assert set(got.inbound.own) == {"generationConfig.thinkingConfig", "safetySettings"}


def test_an_unknown_name_is_googles_400_naming_it() -> None:
    error = refusal(req(bogusField=1))
    assert (error.reason, error.status, error.param) == ("invalid_request", 400,
                                                         "bogusField")
    assert error.message == ('Invalid JSON payload received. Unknown name "bogusField": '
                             "Cannot find field.")
    error = refusal(req(generationConfig={"temprature": 1, "top_k": 3},
                        tools=[{"functionDeclarations": [{"name": "f", "paramters": {}}]}]))
    assert error.message == (
        'Invalid JSON payload received. Unknown name "temprature" at '
        "'generationConfig': Cannot find field.\n"
        'Unknown name "paramters" at \'tools[0].functionDeclarations[0]\': Cannot find '
        "field.")
    assert error.param == ("generationConfig.temprature, "
                           "tools[0].functionDeclarations[0].paramters")
    error = refusal(req(generationConfig={"topK": 3, "top_k": 4}))
    assert (error.reason, error.param) == ("invalid_request", "generationConfig.topK")
    assert "both spellings" in error.message


# --- the answer, rendered -------------------------------------------------------------------

def test_render_answer_with_text_thoughts_and_calls() -> None:
    answer = Answer(id="r1", created=0, model="fake/echo", choices={0: {
        "index": 0, "finish_reason": "tool_calls", "message": {
            "role": "assistant", "content": "Listing.", "reasoning_content": "hmm",
            "tool_calls": [{"id": "call_9", "type": "function", "function": {
                "name": "ls", "arguments": '{"path": "/"}'}}]}}},
        usage=Usage(5, 3, 8))
    assert GEMINI.render(answer) == {
        "candidates": [{"content": {"role": "model", "parts": [
            {"text": "hmm", "thought": True}, {"text": "Listing."},
            {"functionCall": {"id": "call_9", "name": "ls", "args": {"path": "/"}}}]},
            "finishReason": "STOP", "index": 0}],
        "usageMetadata": {"promptTokenCount": 5, "candidatesTokenCount": 3,
                          "totalTokenCount": 8},
        "modelVersion": "fake/echo", "responseId": "r1"}


def test_stream_sends_text_as_it_comes_and_calls_whole_at_the_end() -> None:
    enc = GEMINI.encoder("r1", 0, True)
    enc.begin("up/m1")
    out = enc.delta(Delta(content="Hel"))
    out += enc.delta(Delta(tool_calls=[{"index": 0, "id": "c1", "function": {
        "name": "ls", "arguments": '{"pa'}}]))
    out += enc.delta(Delta(tool_calls=[{"index": 0, "function": {"arguments": 'th": "/"}'}}]))
    out += enc.finish(Finish("tool_calls"))
    enc.set_usage(Usage(4, 2, 6))
    out += enc.done()
    assert out.count(b"\r\n\r\n") == 2
    events = [e for _, e in sse_blocks(out.decode())]
    assert events[0]["candidates"][0]["content"]["parts"] == [{"text": "Hel"}]
    last = events[1]
    assert last["candidates"][0]["content"]["parts"] == [
        {"functionCall": {"id": "c1", "name": "ls", "args": {"path": "/"}}}]
    assert last["candidates"][0]["finishReason"] == "STOP"
    assert last["usageMetadata"]["totalTokenCount"] == 6
    assert last["modelVersion"] == "up/m1" and last["responseId"] == "r1"
    # Notices: SSE comments, or empty lines for Google's SDKs, whose parsers cannot skip one.
    assert enc.comment("waiting") == b": waiting\n\n"
    assert GEMINI_SDK.encoder("r1", 0, True).comment("waiting") == b"\r\n"


def test_a_thought_signature_from_the_gemini_adapter_goes_back_to_the_client() -> None:
    answer = Answer(id="r1", created=0, model="gem/g", choices={0: {
        "index": 0, "finish_reason": "tool_calls", "message": {
            "role": "assistant", "content": None, "tool_calls": [{
                "id": "call_ab12__ts_c2-9_w", "type": "function",
                "function": {"name": "ls", "arguments": "{}"}}]}}}, usage=None)
    part = GEMINI.render(answer)["candidates"][0]["content"]["parts"][0]
    assert part == {"functionCall": {"id": "call_ab12__ts_c2-9_w", "name": "ls", "args": {}},
                    "thoughtSignature": "c2+9/w=="}


def test_error_body_is_googles_with_relays_reason_inside() -> None:
    error = RelayError("provider_queue_full", "the queue is full", provider="up",
                       retry_after_s=3.0)
    body = GEMINI.error_body(error)["error"]
    assert (body["code"], body["status"]) == (429, "RESOURCE_EXHAUSTED")
    assert body["message"] == "the queue is full"
    info = body["details"][0]
    assert info["reason"] == "provider_queue_full" and info["domain"] == "relay"
    assert info["metadata"]["phase"] == "capacity" and info["metadata"]["provider"] == "up"
    assert body["details"][-1] == {"@type": "type.googleapis.com/google.rpc.RetryInfo",
                                   "retryDelay": "3s"}
    assert body["relay"]["reason"] == "provider_queue_full"


# --- the assembled relay --------------------------------------------------------------------

def google(r: httpx.Response, status: int, reason: str) -> dict[str, Any]:
    """Assert a Google-shaped error with relay's reason inside; return its error object."""
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == status and isinstance(err["status"], str), err
    assert err["details"][0]["reason"] == reason, err
    assert err["relay"]["reason"] == reason
    assert "x-should-retry" in r.headers
    return err  # type: ignore[no-any-return]


async def test_fake_echo_generate_stream_and_models(nursery: trio.Nursery,
                                                    tmp_path: Path) -> None:
    served = await start_relay(nursery, FAKE_ONLY, tmp_path)
    async with http_client() as c:
        r = await c.post(served.url + GEN.format("fake/echo"), json=req("hi there"))
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["candidates"][0]["content"] == {"role": "model",
                                                    "parts": [{"text": "hi there"}]}
        assert body["candidates"][0]["finishReason"] == "STOP"
        assert body["modelVersion"] == "fake/echo" and body["responseId"]
        record = await one_record(tmp_path)
        assert record["endpoint"] == "/v1beta/models/fake/echo:generateContent"
        assert (record["provider"], record["model"], record["status"]) == ("fake", "echo", 200)

        # %2F-encoded, the models/ prefix, streamed; temperature dropped and reported.
        r = await c.post(served.url + STREAM.format("models%2Ffake%2Fecho"),
                         json=req("one two three", generationConfig={"temperature": 0.5}))
        assert r.status_code == 200, r.text
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-relay-ignored-fields"] == "generationConfig.temperature"
        events = [e for _, e in sse_blocks(r.text)]
        text = "".join(p.get("text", "") for e in events
                       for p in e["candidates"][0]["content"]["parts"])
        assert text == "one two three" and len(events) >= 3
        assert events[-1]["candidates"][0]["finishReason"] == "STOP"
        assert events[-1]["usageMetadata"]["totalTokenCount"] > 0

        r = await c.get(served.url + "/v1beta/models")
        assert {"name": "models/fake/echo"}.items() <= r.json()["models"][0].items()
        r = await c.get(served.url + "/v1beta/models/fake%2Fecho")
        assert r.json()["name"] == "models/fake/echo"
        assert "generateContent" in r.json()["supportedGenerationMethods"]
        google(await c.get(served.url + "/v1beta/models/fake/nope"), 404, "unknown_model")
    await wait_for(lambda: lane_idle(served))


async def test_googles_v1_methods_take_googles_key_too(
        nursery: trio.Nursery, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Google's SDKs default to ``/v1``: a model's method there takes the token as
    ``x-goog-api-key`` or ``?key=``, as under ``/v1beta`` (issue 33: it was a 401)."""
    monkeypatch.setenv("RELAY_TEST_TOKEN", "s3cret-token")
    config = FAKE_ONLY.replace("[server]", '[server]\ntoken_env = "RELAY_TEST_TOKEN"')
    served = await start_relay(nursery, config, tmp_path)
    gen = served.url + "/v1/models/fake/echo:generateContent"
    async with http_client() as c:
        r = await c.post(gen, json=req(), headers={"x-goog-api-key": "s3cret-token"})
        assert r.status_code == 200, r.text
        assert (await c.post(gen + "?key=s3cret-token", json=req())).status_code == 200
        google(await c.post(gen, json=req(), headers={"x-goog-api-key": "wrong"}), 401,
               "unauthorized")
        google(await c.post(gen + "?key=wrong", json=req()), 401, "unauthorized")
        # Google's model list under v1 takes Google's key (its SDKs' default version) and
        # answers in Google's shape; OpenAI's other paths under /v1 do not take it.
        r = await c.get(served.url + "/v1/models", headers={"x-goog-api-key": "s3cret-token"})
        assert r.status_code == 200 and "models/fake/echo" in [
            m["name"] for m in r.json()["models"]], r.text
        r = await c.get(served.url + "/v1/models/fake/echo?key=s3cret-token")
        assert r.json()["name"] == "models/fake/echo"
        google(await c.get(served.url + "/v1/models", headers={"x-goog-api-key": "wrong"}),
               401, "unauthorized")
        r = await c.post(served.url + "/v1/chat/completions", json={
            "model": "fake/echo", "messages": [{"role": "user", "content": "hi"}]},
            headers={"x-goog-api-key": "s3cret-token"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"
        # An OpenAI client (its token as a bearer) gets OpenAI's list at the same path.
        r = await c.get(served.url + "/v1/models",
                        headers={"authorization": "Bearer s3cret-token"})
        assert r.json()["object"] == "list" and "models/fake/echo" not in r.text


async def test_errors_under_v1beta_are_googles(nursery: trio.Nursery, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RELAY_TEST_TOKEN", "s3cret-token")
    config = FAKE_ONLY.replace("[server]", '[server]\ntoken_env = "RELAY_TEST_TOKEN"\n'
                                            "max_body_bytes = 4096")
    served = await start_relay(nursery, config, tmp_path)
    url = served.url
    key = {"x-goog-api-key": "s3cret-token"}
    async with http_client() as c:
        gen = url + GEN.format("fake/echo")
        # The token: x-goog-api-key or ?key=, and the guard's refusals in Google's shape.
        err = google(await c.post(gen, json=req()), 401, "unauthorized")
        assert err["status"] == "UNAUTHENTICATED" and "x-goog-api-key" in err["message"]
        google(await c.post(gen, json=req(), headers={"x-goog-api-key": "wrong"}), 401,
               "unauthorized")
        assert (await c.post(gen, json=req(), headers=key)).status_code == 200
        assert (await c.post(gen + "?key=s3cret-token", json=req())).status_code == 200
        google(await c.post(gen, json=req(), headers={**key, "host": "evil.test"}), 403,
               "bad_host")
        google(await c.post(gen, json=req(), headers={**key, "origin": "http://evil.test"}),
               403, "forbidden_origin")
        google(await c.post(gen, content=b"x", headers={**key, "content-type": "text/plain"}),
               415, "invalid_request")
        google(await c.post(gen, json=req("x" * 5000), headers=key), 413, "invalid_request")
        # The unknown path, method and model; what relay cannot serve.
        err = google(await c.post(url + "/v1beta/models/fake/echo:predict", json=req(),
                                  headers=key), 404, "invalid_request")
        assert "generateContent" in err["message"]
        err = google(await c.get(url + "/v1beta/cachedContents", headers=key), 404,
                     "invalid_request")
        assert "/v1beta/models" in err["message"]
        google(await c.delete(url + "/v1beta/models/fake/echo", headers=key), 405,
               "invalid_request")
        err = google(await c.post(url + "/v1beta/models/fake/echo:streamGenerateContent",
                                  json=req(), headers=key), 400, "invalid_request")
        assert "alt=sse" in err["message"]
        google(await c.post(url + GEN.format("nobody/x"), json=req(), headers=key), 404,
               "unknown_model")
        err = google(await c.post(gen, json=req(generationConfig={"topK": "5"}),
                                  headers=key), 400, "invalid_request")
        assert err["details"][1]["fieldViolations"][0]["field"] == "generationConfig.topK"
        google(await c.post(gen, json=req(generationConfig={"candidateCount": 3}),
                            headers=key), 400, "unsupported")
        google(await c.post(gen, content=b"{", headers={**key, "content-type":
                                                        "application/json"}),
               400, "invalid_request")
        # Tools the fake cannot call: refused, said why; a count it cannot make itself:
        # relay's estimate, marked as one.
        err = google(await c.post(gen, json=req(tools=[TOOL], toolConfig={
            "functionCallingConfig": {"mode": "ANY"}}), headers=key), 400, "unsupported")
        assert "tool" in err["message"]
        r = await c.post(url + COUNT.format("fake/echo"), json=req(), headers=key)
        assert r.status_code == 200 and r.headers["x-relay-estimated"] == "true"
        assert r.json()["totalTokens"] > 0
    await wait_for(lambda: lane_idle(served))


async def test_a_browser_page_may_send_googles_headers(nursery: trio.Nursery,
                                                       tmp_path: Path) -> None:
    config = FAKE_ONLY.replace("[server]", '[server]\ncors_origins = ["http://app.local"]')
    served = await start_relay(nursery, config, tmp_path)
    app = {"origin": "http://app.local"}
    async with http_client() as c:
        r = await c.options(served.url + GEN.format("fake/echo"), headers={
            **app, "access-control-request-method": "POST",
            "access-control-request-headers": "content-type, x-goog-api-key"})
        assert r.status_code == 204, r.text
        allowed = {h.strip() for h in r.headers["access-control-allow-headers"].split(",")}
        assert {"content-type", "x-goog-api-key", "x-goog-api-client"} <= allowed
        r = await c.post(served.url + GEN.format("fake/echo"), json=req("from a page"),
                         headers={**app, "x-goog-api-key": "unused"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == (
            "http://app.local")


def _up_config(up: FakeUpstream, ant: FakeAnthropic, gem: FakeGemini) -> str:
    return FAKE_ONLY + f"""
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
[providers.gem]
adapter = "gemini"
base_url = "{gem.url}"
api_key_env = "RELAY_TEST_GEMINI_KEY"
models = ["g"]
[providers.gem.profile]
rpm = 0
"""


@pytest.fixture
async def three(nursery: trio.Nursery, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                ) -> tuple[Any, FakeUpstream, FakeAnthropic, FakeGemini]:
    monkeypatch.setenv("RELAY_TEST_ANTHROPIC_KEY", ANTHROPIC_KEY)
    monkeypatch.setenv("RELAY_TEST_GEMINI_KEY", GEMINI_KEY)
    up: FakeUpstream = await nursery.start(serve_fake_upstream)
    ant: CountingAnthropic = await nursery.start(serve_counting_anthropic)  # counts too
    gem: EmbeddingGemini = await nursery.start(serve_embedding_gemini)  # counts too
    served = await start_relay(nursery, _up_config(up, ant, gem), tmp_path)
    return served, up, ant, gem


async def test_tool_round_trip_through_an_openai_upstream(
        three: tuple[Any, FakeUpstream, FakeAnthropic, FakeGemini]) -> None:
    served, up, _, _ = three
    up.scripts["m1"] = Script(chunks=["Looking."], tool_calls=[{
        "id": "call_77", "type": "function",
        "function": {"name": "list_directory", "arguments": '{"path": "/tmp"}'}}])
    ask = req("list /tmp", tools=[TOOL], systemInstruction={"parts": [{"text": "sys"}]},
              generationConfig={"temperature": 0.1, "maxOutputTokens": 50,
                                "thinkingConfig": {"includeThoughts": True}})
    async with http_client() as c:
        r = await c.post(served.url + STREAM.format("up/m1"), json=ask)
        assert r.status_code == 200, r.text
        # thinkingConfig has no knob at an OpenAI-compatible server: dropped and reported.
        assert r.headers["x-relay-ignored-fields"] == "generationConfig.thinkingConfig"
        events = [e for _, e in sse_blocks(r.text)]
        parts = [p for e in events for p in e["candidates"][0]["content"]["parts"]]
        assert parts == [{"text": "Looking."}, {"functionCall": {
            "id": "call_77", "name": "list_directory", "args": {"path": "/tmp"}}}]
        sent = posts(up)[-1].json
        assert sent["messages"] == [{"role": "system", "content": "sys"},
                                    {"role": "user", "content": "list /tmp"}]
        assert sent["tools"][0]["function"]["name"] == "list_directory"
        assert sent["temperature"] == 0.1 and sent["max_tokens"] == 50
        assert "thinkingConfig" not in json.dumps(sent)

        # The client runs the tool and sends its answer back, matched by the call's id.
        up.scripts["m1"] = Script(chunks=["It holds a and b."])
        ask["contents"] += [{"role": "model", "parts": [p for p in parts]},
                            {"role": "user", "parts": [{"functionResponse": {
                                "id": "call_77", "name": "list_directory",
                                "response": {"output": "a\nb"}}}]}]
        r = await c.post(served.url + GEN.format("up/m1"), json=ask)
        assert r.status_code == 200, r.text
        assert r.json()["candidates"][0]["content"]["parts"] == [{"text": "It holds a and b."}]
        sent = posts(up)[-1].json
        assert sent["messages"][2]["tool_calls"][0]["id"] == "call_77"
        assert sent["messages"][3] == {"role": "tool", "tool_call_id": "call_77",
                                       "content": json.dumps({"output": "a\nb"})}


async def test_native_to_the_gemini_adapter_and_translated_to_anthropic(
        three: tuple[Any, FakeUpstream, FakeAnthropic, FakeGemini]) -> None:
    served, _, ant, gem = three
    native = req("hi", safetySettings=[{"category": "HARM_CATEGORY_HARASSMENT",
                                        "threshold": "BLOCK_NONE"}],
                 generationConfig={"thinkingConfig": {"thinkingBudget": 0}, "topK": 3},
                 cachedContent="cachedContents/abc")
    async with http_client() as c:
        r = await c.post(served.url + STREAM.format("gem/g"), json=native)
        assert r.status_code == 200, r.text
        assert "x-relay-ignored-fields" not in r.headers
        text = "".join(p.get("text", "") for _, e in sse_blocks(r.text)
                       for p in e["candidates"][0]["content"]["parts"])
        assert text == "Hello world"
        sent = posts(gem)[-1]
        assert sent.json == native  # every field as the client sent it
        assert sent.path.endswith("/models/g:streamGenerateContent?alt=sse")

        # Counted by Gemini itself, the request as sent (its own fields too).
        r = await c.post(served.url + COUNT.format("gem/g"), json={
            "generateContentRequest": {"model": "models/gem/g", **req("count me please"),
                                       "safetySettings": []}})
        assert r.status_code == 200, r.text
        assert r.json() == {"totalTokens": 3}
        sent = posts(gem)[-1]
        assert sent.path.endswith("/models/g:countTokens")
        assert sent.json["generateContentRequest"]["safetySettings"] == []
        assert sent.json["generateContentRequest"]["model"] == "models/g"

        # To the anthropic adapter: translated; Gemini's own fields are not sent.
        plain = req("hi", generationConfig={"topK": 3, "maxOutputTokens": 30,
                                            "thinkingConfig": {"thinkingBudget": 0}},
                    safetySettings=[])
        r = await c.post(served.url + GEN.format("ant/claude-x"), json=plain)
        assert r.status_code == 200, r.text
        assert r.headers["x-relay-ignored-fields"] == (
            "generationConfig.thinkingConfig, safetySettings")
        sent = posts(ant)[-1].json
        assert sent["top_k"] == 3 and sent["max_tokens"] == 30
        assert "thinking" not in sent and "safetySettings" not in sent
        # A field only Google knows is refused elsewhere, named.
        err = google(await c.post(served.url + GEN.format("ant/claude-x"), json={
            **plain, "cachedContent": "cachedContents/abc"}), 400, "unsupported")
        assert "cachedContent" in err["message"]
        # Anthropic counts tokens itself.
        r = await c.post(served.url + COUNT.format("ant/claude-x"), json=req("count me"))
        assert r.status_code == 200, r.text
        assert isinstance(r.json()["totalTokens"], int)


async def test_waiting_notice_and_failure_in_band(nursery: trio.Nursery,
                                                  tmp_path: Path) -> None:
    config = FAKE_ONLY + "[providers.fake.profile]\nlanes = 1\nqueue_max = 4\n"
    served = await start_relay(nursery, config, tmp_path)
    async with http_client() as c, trio.open_nursery() as inner:
        # (the fake's knobs follow a "?" in the model: escaped in a Gemini path)
        inner.start_soon(functools.partial(c.post, json=req()),
                         served.url + GEN.format(quote("fake/echo?delay_s=0.5")))
        await wait_for(lambda: served.relay.providers["fake"].lane.statistics().running == 1)
        for headers, notice in (({}, b": waiting"),
                                ({"x-goog-api-client": "google-genai-sdk/1.0 gl-node/v22"},
                                 b"\r\n")):
            async with c.stream("POST", served.url + STREAM.format("fake/echo"),
                                json=req(), headers=headers) as r:
                assert r.status_code == 200
                first = await r.aiter_raw().__anext__()
                assert first.startswith(notice), first
                await r.aclose()
            await wait_for(lambda: served.relay.providers["fake"].lane.statistics().queued == 0)
        # A failure after the headers: a Google error object in-band, then the end.
        r = await c.post(served.url + STREAM.format(
            quote("fake/echo?fail=stall_timeout&fail_after=1")), json=req("a b c"))
        events = [e for _, e in sse_blocks(r.text)]
        assert events[0]["candidates"][0]["content"]["parts"] == [{"text": "a "}]
        assert events[-1]["error"]["details"][0]["reason"] == "stall_timeout"
    await wait_for(lambda: lane_idle(served))



# --- any value in any field: a 4xx naming it, or a request -------------------------------------

_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**63) | st.floats(allow_nan=False,
                                                                        allow_infinity=False)
    | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                max_size=3),
    max_leaves=8)
_PLACES = ["contents", "contents[0]", "contents[0].role", "contents[0].parts",
           "contents[0].parts[0]", "contents[0].parts[0].text",
           "contents[0].parts[0].functionCall", "contents[0].parts[0].inlineData",
           "contents[0].parts[0].functionResponse", "systemInstruction", "tools",
           "tools[0]", "tools[0].functionDeclarations",
           "tools[0].functionDeclarations[0]",
           "tools[0].functionDeclarations[0].parameters",
           "tools[0].functionDeclarations[0].parametersJsonSchema", "toolConfig",
           "toolConfig.functionCallingConfig", "toolConfig.functionCallingConfig.mode",
           "toolConfig.functionCallingConfig.allowedFunctionNames", "generationConfig",
           *(f"generationConfig.{k}" for k in (
               "temperature", "topP", "topK", "seed", "maxOutputTokens", "stopSequences",
               "candidateCount", "responseMimeType", "responseSchema", "responseJsonSchema",
               "responseLogprobs", "logprobs", "presencePenalty", "frequencyPenalty",
               "thinkingConfig"))]


def _put(body: dict[str, Any], place: str, value: Any) -> dict[str, Any]:
    """A copy of ``body`` with ``value`` at ``place`` (a dotted path with [0] indexes)."""
    body = copy.deepcopy(body)
    keys = [k for part in place.split(".") for k in re.split(r"\[(\d+)\]", part) if k]
    node: Any = body
    for key, after in itertools.pairwise(keys):
        slot: Any = int(key) if key.isdigit() else key
        if isinstance(node, list):
            while len(node) <= slot:
                node.append({})
        elif not isinstance(node.get(slot), (dict, list)):
            node[slot] = [] if after.isdigit() else {}
        node = node[slot]
    last: Any = int(keys[-1]) if keys[-1].isdigit() else keys[-1]
    node[last] = value
    return body


@settings(max_examples=400, deadline=None)
@given(place=st.sampled_from(_PLACES), value=_JSON)
def test_any_value_anywhere_is_a_request_or_a_named_refusal(place: str, value: Any) -> None:
    body = _put(req("x", tools=[TOOL], generationConfig={"temperature": 1}), place, value)
    try:
        chat = parse(body)
    except RelayError as error:
        assert error.status in (400, 404), error
        assert error.param is None or error.param.split(".")[0].split("[")[0] in (
            place.split(".")[0].split("[")[0], "alt"), (error.param, place)
        return
    json.dumps(chat.messages), json.dumps(chat.params)  # what adapters get: plain JSON
