"""Google's own Python SDK (``google-genai``) against relay's Gemini front (SPEC A9):
generate, stream, count tokens and a function call, each through the assembled relay.

The SDK's client is synchronous here, run in a worker thread (``trio.to_thread``): its
async client is built on asyncio (``aiohttp`` or ``httpx`` under asyncio's loop), which
does not run under trio. It is pointed at relay with ``http_options.base_url``.
"""

from __future__ import annotations

import functools
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

    # relay's errors reach the SDK as its APIError, with Google's status and relay's words.
    with pytest.raises(errors.ClientError) as caught:
        await _in_thread(client.models.count_tokens, model="fake/echo", contents="x")
    assert caught.value.code == 400 and "token counter" in str(caught.value.message)
    with pytest.raises(errors.ClientError) as caught:
        await _in_thread(client.models.generate_content, model="nobody/x", contents="x")
    assert caught.value.code == 404 and caught.value.status == "NOT_FOUND"
    # The SDK's default API version is v1 (POST /v1/models/{model}:…, served above);
    # the model list is Google's under v1beta (GET /v1/models is OpenAI's).
    beta = genai.Client(api_key="any", http_options=types.HttpOptions(
        base_url=served.url, api_version="v1beta"))
    listed = await _in_thread(lambda: [m.name for m in beta.models.list()])
    assert "models/fake/echo" in listed and "models/up/m1" in listed
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
