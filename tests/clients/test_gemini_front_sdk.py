"""Google's own Python SDK (``google-genai``) against relay's Gemini front (SPEC A9):
generate, stream, count tokens (a provider's counter, or relay's estimate), the model
list on the SDK's default API version (v1) and on v1beta, embeddings, a function call,
and automatic function calling with a Python function, each through the assembled relay.

The SDK's client is synchronous here, run in a worker thread (``trio.to_thread``): its
async client is built on asyncio (``aiohttp`` or ``httpx`` under asyncio's loop), which
does not run under trio. It is pointed at relay with ``http_options.base_url``.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest
import trio
from fakes.fake_endpoints import EmbeddingGemini, serve_embedding_gemini
from fakes.fake_gemini import KEY as GEMINI_KEY
from fakes.upstream import FakeUpstream, Script, serve_fake_upstream
from google import genai
from google.genai import errors, types
from helpers.assembled import FAKE_ONLY, lane_idle, start_relay, wait_for
from helpers.cloud_helpers import one_record, posts


def _config(up: FakeUpstream, gem: EmbeddingGemini) -> str:
    return FAKE_ONLY + f"""[providers.fake.profile]
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
[providers.gem]
adapter = "gemini"
base_url = "{gem.url}"
api_key_env = "RELAY_TEST_GEMINI_KEY"
models = ["g"]
[providers.gem.profile]
rpm = 0
"""


@pytest.fixture
async def stage(nursery: trio.Nursery, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                ) -> tuple[Any, FakeUpstream, EmbeddingGemini, genai.Client]:
    monkeypatch.setenv("RELAY_TEST_GEMINI_KEY", GEMINI_KEY)
    up: FakeUpstream = await nursery.start(serve_fake_upstream)
    gem: EmbeddingGemini = await nursery.start(serve_embedding_gemini)
    served = await start_relay(nursery, _config(up, gem), tmp_path)
    client = genai.Client(api_key="any", http_options=types.HttpOptions(
        base_url=served.url, timeout=20_000))
    return served, up, gem, client


async def _in_thread(fn: Any, *args: Any, **kw: Any) -> Any:
    return await trio.to_thread.run_sync(functools.partial(fn, *args, **kw))


async def test_generate_stream_and_count(
        stage: tuple[Any, FakeUpstream, EmbeddingGemini, genai.Client],
        tmp_path: Path) -> None:
    served, _, gem, client = stage
    got = await _in_thread(client.models.generate_content, model="fake/echo",
                           contents="hello from the SDK")
    assert got.text == "hello from the SDK"
    assert got.candidates[0].finish_reason == types.FinishReason.STOP
    assert got.usage_metadata.total_token_count > 0
    record = await one_record(tmp_path)
    assert (record["provider"], record["status"]) == ("fake", 200)
    assert record["endpoint"] == "/v1/models/fake/echo:generateContent"

    def stream() -> list[str]:
        return [chunk.text or "" for chunk in client.models.generate_content_stream(
            model="fake/echo", contents="one two three four")]

    pieces = await trio.to_thread.run_sync(stream)
    assert "".join(pieces) == "one two three four" and len(pieces) > 2

    # Queued behind another request, the stream's waiting notices (empty lines for
    # Google's SDKs, which cannot skip an SSE comment) do not disturb it.
    async with httpx.AsyncClient(trust_env=False) as other, trio.open_nursery() as busy:
        busy.start_soon(functools.partial(other.post, json={"contents": [{"parts": [
            {"text": "busy"}]}]}), served.url + "/v1beta/models/"
            + quote("fake/echo?delay_s=2.5") + ":generateContent")
        await wait_for(lambda: served.relay.providers["fake"].lane.statistics().running == 1)
        pieces = await trio.to_thread.run_sync(stream)
        assert "".join(pieces) == "one two three four"
        queued = await one_record(tmp_path, 4)  # (the busy request's ended before it)
        assert queued["endpoint"].endswith(":streamGenerateContent")
        assert queued["queue_ms"] > 2000  # it waited through at least one notice

    counted = await _in_thread(client.models.count_tokens, model="gem/g",
                               contents="count these four words")
    assert counted.total_tokens == 4
    assert posts(gem)[-1].path.endswith("/models/g:countTokens")

    # A provider without a counter of its own: relay's estimate (SPEC A9, L12).
    counted = await _in_thread(client.models.count_tokens, model="fake/echo",
                               contents="count these four words")
    assert 4 <= counted.total_tokens <= 12
    # relay's errors reach the SDK as its APIError, with Google's status and relay's words.
    with pytest.raises(errors.ClientError) as caught:
        await _in_thread(client.models.generate_content, model="nobody/x", contents="x")
    assert caught.value.code == 404 and caught.value.status == "NOT_FOUND"
    # The SDK's default API version is v1 (POST /v1/models/{model}:…, served above), and
    # its model list is Google's there too (GET /v1/models to a Google client); v1beta's.
    for api in (None, "v1beta"):
        listing = genai.Client(api_key="any", http_options=types.HttpOptions(
            base_url=served.url, api_version=api))
        listed = await _in_thread(lambda c=listing: [m.name for m in c.models.list()])
        assert "models/fake/echo" in listed and "models/up/m1" in listed, api
        one = await _in_thread(listing.models.get, model="fake/echo")
        assert one.name == "models/fake/echo", api
        with pytest.raises(errors.ClientError) as caught:
            await _in_thread(listing.models.get, model="nobody/x")
        assert (caught.value.code, caught.value.status) == (404, "NOT_FOUND")
    await wait_for(lambda: lane_idle(served))


async def test_embeddings_on_v1_and_v1beta(
        stage: tuple[Any, FakeUpstream, EmbeddingGemini, genai.Client]) -> None:
    served, _, gem, client = stage
    for api in (None, "v1beta"):
        sdk = genai.Client(api_key="any", http_options=types.HttpOptions(
            base_url=served.url, api_version=api))
        got = await _in_thread(sdk.models.embed_content, model="gem/g",
                               contents=["one text", "another text"],
                               config=types.EmbedContentConfig(output_dimensionality=8))
        assert [len(e.values) for e in got.embeddings] == [8, 8], api
        sent = posts(gem)[-1]
        assert sent.path.endswith("/models/g:batchEmbedContents")
        assert [r["content"]["parts"][0]["text"] for r in sent.json["requests"]] == [
            "one text", "another text"]
        assert sent.json["requests"][0]["outputDimensionality"] == 8
    # A provider that makes no embeddings: Google's 400, naming it.
    with pytest.raises(errors.ClientError) as caught:
        await _in_thread(client.models.embed_content, model="fake/echo", contents="x")
    assert caught.value.code == 400 and "makes no embeddings" in str(caught.value.message)
    await wait_for(lambda: lane_idle(served))


def get_weather(city: str) -> dict[str, str]:
    """The weather in a city.

    Args:
        city: the city's name.
    """
    return {"sky": f"sunny in {city}"}


async def test_automatic_function_calling_with_a_python_function(
        stage: tuple[Any, FakeUpstream, EmbeddingGemini, genai.Client]) -> None:
    served, up, _, client = stage

    def agent(req: dict[str, Any]) -> Script | None:
        """Call the tool with a value for every argument its schema requires; then
        answer from the tool's result (the schema reached the model, or the call fails)."""
        last = req["messages"][-1]
        if last["role"] == "tool":
            result = json.loads(last["content"])
            return Script(chunks=[f"Answer: {result.get('result', result)['sky']}"])
        fn = req["tools"][0]["function"]
        args = {name: "Oslo" for name in fn["parameters"].get("required", [])}
        return Script(chunks=[], tool_calls=[{"id": "call_1", "type": "function",
                                              "function": {"name": fn["name"],
                                                           "arguments": json.dumps(args)}}])

    up.decide = agent
    got = await _in_thread(client.models.generate_content, model="up/m1",
                           contents="What is the weather in Oslo?",
                           config=types.GenerateContentConfig(tools=[get_weather]))
    assert got.text == "Answer: sunny in Oslo"
    first, second = (r.json for r in posts(up)[-2:])
    assert first["tools"][0]["function"]["parameters"]["required"] == ["city"]
    assert second["messages"][-1] == {"role": "tool", "tool_call_id": "call_1",
                                      "content": json.dumps({"result": {
                                          "sky": "sunny in Oslo"}})}
    # The SDK's history holds the call and its answer: the round trip went through relay.
    history = got.automatic_function_calling_history
    assert history[1].parts[0].function_call.args == {"city": "Oslo"}
    await wait_for(lambda: lane_idle(served))


async def test_googles_unknown_name_and_an_estimated_count_over_http(
        stage: tuple[Any, FakeUpstream, EmbeddingGemini, genai.Client]) -> None:
    served, _, _, _ = stage
    body = {"contents": [{"parts": [{"text": "hello there"}]}]}
    async with httpx.AsyncClient(trust_env=False, base_url=served.url) as http:
        r = await http.post("/v1/models/fake/echo:generateContent",
                            json={**body, "bogusField": 1})
        error = r.json()["error"]
        assert (r.status_code, error["status"]) == (400, "INVALID_ARGUMENT")
        assert error["message"].startswith(
            'Invalid JSON payload received. Unknown name "bogusField": Cannot find field.')
        assert error["details"][0]["reason"] == "invalid_request"
        for path in ("/v1/models/fake/echo:countTokens",
                     "/v1beta/models/fake/echo:countTokens"):
            r = await http.post(path, json=body)
            assert r.status_code == 200 and r.headers["x-relay-estimated"] == "true"
            assert r.json()["totalTokens"] >= 2
        r = await http.post("/v1/messages/count_tokens", json={
            "model": "fake/echo", "messages": [{"role": "user", "content": "hello there"}]})
        assert r.status_code == 200 and r.headers["x-relay-estimated"] == "true"
        assert r.json()["input_tokens"] >= 2
        # A provider's own counter is no estimate.
        r = await http.post("/v1beta/models/gem/g:countTokens", json=body)
        assert r.status_code == 200 and "x-relay-estimated" not in r.headers
        # GET /v1/models stays OpenAI's for a client that is not Google's.
        r = await http.get("/v1/models")
        assert r.json()["object"] == "list" and "models" not in r.json()
        r = await http.get("/v1/models", params={"key": "k"})
        assert "models/fake/echo" in [m["name"] for m in r.json()["models"]]
        r = await http.post("/v1/models/gem/g:embedContent", json={
            "content": {"parts": [{"text": "one"}]}})
        assert r.status_code == 200 and len(r.json()["embedding"]["values"]) > 0
        r = await http.post("/v1beta/models/gem/g:batchEmbedContents", json={
            "requests": [{"model": "models/gem/g", "content": {"parts": [{"text": "a"}]},
                          "task_type": "RETRIEVAL_QUERY"}]})
        error = r.json()["error"]
        assert r.status_code == 400 and error["details"][0]["reason"] == "unsupported"
        assert "taskType" in error["message"]
    await wait_for(lambda: lane_idle(served))


async def test_a_function_call_and_its_answer(
        stage: tuple[Any, FakeUpstream, EmbeddingGemini, genai.Client]) -> None:
    served, up, _, client = stage
    up.scripts["m1"] = Script(chunks=[], tool_calls=[{
        "id": "call_w1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}])
    weather = types.FunctionDeclaration(
        name="get_weather", description="The weather in a city",
        parameters=types.Schema(type=types.Type.OBJECT, properties={
            "city": types.Schema(type=types.Type.STRING)}, required=["city"]))
    config = types.GenerateContentConfig(
        tools=[types.Tool(function_declarations=[weather])],
        tool_config=types.ToolConfig(function_calling_config=types.FunctionCallingConfig(
            mode=types.FunctionCallingConfigMode.ANY)),
        automatic_function_calling=types.AutomaticFunctionCallingConfig(disable=True))
    ask = [types.Content(role="user", parts=[types.Part(text="Weather in Oslo?")])]
    got = await _in_thread(client.models.generate_content, model="up/m1", contents=ask,
                           config=config)
    call = got.function_calls[0]
    assert (call.id, call.name, call.args) == ("call_w1", "get_weather", {"city": "Oslo"})
    sent = posts(up)[-1].json
    assert sent["tool_choice"] == "required"
    assert sent["tools"][0]["function"]["parameters"] == {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}

    up.scripts["m1"] = Script(chunks=["It is sunny in Oslo."])
    ask += [got.candidates[0].content, types.Content(role="user", parts=[
        types.Part.from_function_response(name="get_weather", response={"sky": "sunny"})])]
    answer = await _in_thread(client.models.generate_content, model="up/m1", contents=ask,
                              config=config.model_copy(update={"tool_config": None}))
    assert answer.text == "It is sunny in Oslo."
    messages = posts(up)[-1].json["messages"]
    assert messages[1]["tool_calls"][0]["id"] == "call_w1"
    assert messages[2] == {"role": "tool", "tool_call_id": "call_w1",
                           "content": '{"sky": "sunny"}'}
    await wait_for(lambda: lane_idle(served))
