"""``POST /v1/messages/count_tokens`` (SPEC A6) through the assembled relay with the
official anthropic client: the provider's own counter where it has one (Anthropic's
``/v1/messages/count_tokens``, Gemini's ``:countTokens``, fakes that count
deterministically: tests/fakes/fake_endpoints.py), relay's local estimate everywhere else
(marked ``x-relay-estimated: true``; SPEC A9), and a count that does not wait behind a
running answer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anthropic
import pytest
import trio
from fakes.fake_anthropic import KEY as ANTHROPIC_KEY
from fakes.fake_anthropic import Script
from fakes.fake_endpoints import (
    CountingAnthropic,
    EmbeddingGemini,
    serve_counting_anthropic,
    serve_embedding_gemini,
)
from fakes.fake_gemini import KEY as GEMINI_KEY
from fakes.upstream import FakeUpstream
from helpers.assembled import lane_idle, records, start_relay, wait_for
from helpers.cloud_helpers import http_client

from relay import Served

COUNT = "/v1/messages/count_tokens"
SYSTEM = "Be brief."                          # 2 words
USER: Any = [{"role": "user", "content": "count these five words please"}]  # 5
TOOLS: Any = [{"name": "get_weather", "description": "Get the weather.",  # 1 + 3
               "input_schema": {"type": "object",
                                "properties": {"city": {"type": "string"}}}}]
WORDS = 2 + 5 + 4


@pytest.fixture(autouse=True)
def _keys(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RELAY_TEST_ANTHROPIC_KEY", ANTHROPIC_KEY)
    monkeypatch.setenv("RELAY_TEST_GEMINI_KEY", GEMINI_KEY)


@pytest.fixture
async def ant(nursery: trio.Nursery) -> CountingAnthropic:
    server: CountingAnthropic = await nursery.start(serve_counting_anthropic)
    return server


@pytest.fixture
async def gem(nursery: trio.Nursery) -> EmbeddingGemini:
    server: EmbeddingGemini = await nursery.start(serve_embedding_gemini)
    return server


def config(ant: CountingAnthropic, gem: EmbeddingGemini, up: FakeUpstream) -> str:
    return f"""
[server]
records = "records.jsonl"
[providers.fake]
adapter = "fake"
models = ["echo"]
[providers.ant]
adapter = "anthropic"
base_url = "{ant.url}"
api_key_env = "RELAY_TEST_ANTHROPIC_KEY"
models = ["claude-test-1", "claude-test-2"]
[providers.ant.profile]
lanes = 1
queue_max = 4
queue_timeout_s = 10
run_timeout_s = 300
[providers.gem]
adapter = "gemini"
base_url = "{gem.url}"
api_key_env = "RELAY_TEST_GEMINI_KEY"
models = ["gemini-test-flash"]
[providers.gem.profile]
lanes = 1
queue_max = 4
queue_timeout_s = 10
run_timeout_s = 300
rpm = 0
[providers.up]
adapter = "openai"
base_url = "{up.url}"
models = ["m1"]
[providers.up.profile]
lanes = 1
queue_max = 4
queue_timeout_s = 10
run_timeout_s = 20
[routes.counter]
primary = "ant/claude-test-1"
"""


def sdk(served: Served) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=served.url, api_key="unused", max_retries=0)


def counts(tmp_path: Path) -> list[dict[str, Any]]:
    return [r for r in records(tmp_path) if r.get("endpoint") == COUNT]


async def test_anthropic_counts_with_its_own_counter(
        nursery: trio.Nursery, tmp_path: Path, ant: CountingAnthropic, gem: EmbeddingGemini,
        upstream: FakeUpstream) -> None:
    served = await start_relay(nursery, config(ant, gem, upstream), tmp_path)
    async with sdk(served) as client:
        got = await client.messages.count_tokens(model="ant/claude-test-1", system=SYSTEM,
                                                 messages=USER, tools=TOOLS)
        assert got.input_tokens == WORDS
        sent = ant.requests[-1]
        assert sent.path == "/v1/messages/count_tokens"
        # What the counter takes, and nothing it refuses (max_tokens above all).
        assert sent.json == {
            "model": "claude-test-1",
            "messages": [{"role": "user", "content": [
                {"type": "text", "text": "count these five words please"}]}],
            "system": [{"type": "text", "text": SYSTEM}],
            "tools": [{"name": "get_weather", "description": "Get the weather.",
                       "input_schema": TOOLS[0]["input_schema"]}]}
        assert sent.headers["anthropic-version"]

        by_route = await client.messages.count_tokens(model="counter", messages=USER)
        assert by_route.input_tokens == 5
        # Claude Code adds ?beta=true (and anthropic-beta headers).
        async with http_client() as http:
            r = await http.post(served.url + COUNT + "?beta=true", json={
                "model": "ant/claude-test-1", "messages": USER},
                headers={"anthropic-beta": "token-counting-2024-11-01"})
        assert r.status_code == 200 and r.json() == {"input_tokens": 5}

        ant.status = 429
        with pytest.raises(anthropic.RateLimitError) as limited:
            await client.messages.count_tokens(model="ant/claude-test-1", messages=USER)
        body = limited.value.body
        assert isinstance(body, dict) and body["type"] == "error"
        assert body["error"]["type"] == "rate_limit_error"
        assert body["error"]["relay"]["reason"] == "rate_limited"
    recs = counts(tmp_path)
    assert [r["status"] for r in recs] == [200, 200, 200, 429]
    assert (recs[0]["provider"], recs[0]["model"]) == ("ant", "claude-test-1")
    assert recs[1]["route"] == "counter"
    assert recs[0]["attempts"][0]["ok"] and recs[0]["run_ms"] is not None
    assert recs[0]["queue_ms"] is None  # a metadata call: not queued in the lane


async def test_gemini_counts_with_its_own_counter(
        nursery: trio.Nursery, tmp_path: Path, ant: CountingAnthropic, gem: EmbeddingGemini,
        upstream: FakeUpstream) -> None:
    served = await start_relay(nursery, config(ant, gem, upstream), tmp_path)
    async with sdk(served) as client:
        got = await client.messages.count_tokens(model="gem/gemini-test-flash",
                                                 system=SYSTEM, messages=USER, tools=TOOLS)
    assert got.input_tokens == WORDS
    sent = gem.requests[-1]
    assert sent.path == "/v1beta/models/gemini-test-flash:countTokens"
    inner = sent.json["generateContentRequest"]
    assert inner["model"] == "models/gemini-test-flash"
    assert inner["systemInstruction"] == {"parts": [{"text": SYSTEM}]}
    assert inner["contents"] == [{"role": "user", "parts": [
        {"text": "count these five words please"}]}]
    assert inner["tools"][0]["functionDeclarations"][0]["name"] == "get_weather"
    assert "generationConfig" not in inner
    assert counts(tmp_path)[0]["provider"] == "gem"


@pytest.mark.parametrize("model", ["up/m1", "fake/echo"])
async def test_a_provider_without_a_counter_gets_relays_estimate_marked(
        nursery: trio.Nursery, tmp_path: Path, ant: CountingAnthropic, gem: EmbeddingGemini,
        upstream: FakeUpstream, model: str) -> None:
    served = await start_relay(nursery, config(ant, gem, upstream), tmp_path)
    async with sdk(served) as client:
        plain = await client.messages.with_raw_response.count_tokens(
            model=model, messages=USER)
        with_tools = await client.messages.with_raw_response.count_tokens(
            model=model, messages=USER, system=SYSTEM, tools=TOOLS)
    assert plain.headers["x-relay-estimated"] == "true"
    # relay's local estimate (relay.capacity.estimate: the one token budgets use): the
    # words, a message's framing, the tools' JSON — more with the system and the tools.
    tokens = (await plain.parse()).input_tokens
    more = (await with_tools.parse()).input_tokens
    assert 5 <= tokens <= 15 and more > tokens + 6
    assert not upstream.requests  # nothing was sent anywhere: no call, no lane
    await wait_for(lambda: len(counts(tmp_path)) == 2)
    record = counts(tmp_path)[0]
    assert (record["provider"], record["status"]) == (model.partition("/")[0], 200)


async def test_bad_requests_and_unknown_models_are_anthropic_shaped(
        nursery: trio.Nursery, tmp_path: Path, ant: CountingAnthropic, gem: EmbeddingGemini,
        upstream: FakeUpstream) -> None:
    served = await start_relay(nursery, config(ant, gem, upstream), tmp_path)
    async with http_client() as http:
        r = await http.post(served.url + COUNT, json={"model": "ant/claude-test-1"})
        assert r.status_code == 400
        assert r.json()["type"] == "error"
        assert r.json()["error"]["relay"]["reason"] == "invalid_request"
        r = await http.post(served.url + COUNT, json={"model": "nope/x", "messages": USER})
        assert r.status_code == 404
        assert r.json()["error"]["type"] == "not_found_error"
        r = await http.get(served.url + COUNT)
        assert r.status_code == 405 and r.json()["type"] == "error"
    assert not [q for q in ant.requests if q.method == "POST"]
    assert [r["status"] for r in counts(tmp_path)] == [400, 404, 405]


async def test_a_count_does_not_wait_behind_a_running_answer(
        nursery: trio.Nursery, tmp_path: Path, ant: CountingAnthropic, gem: EmbeddingGemini,
        upstream: FakeUpstream) -> None:
    """Claude Code counts tokens beside a running message; with one lane, a count queued
    behind that message would wait for the whole answer."""
    served = await start_relay(nursery, config(ant, gem, upstream), tmp_path)
    ant.scripts["claude-test-2"] = Script(hang=True)
    async with sdk(served) as client, trio.open_nursery() as running:
        running.start_soon(lambda: client.messages.create(
            model="ant/claude-test-2", max_tokens=10, messages=USER))
        await wait_for(lambda: served.relay.providers["ant"].lane.statistics().running == 1)
        with trio.fail_after(5):
            got = await client.messages.count_tokens(model="ant/claude-test-1",
                                                     messages=USER)
        assert got.input_tokens == 5
        assert served.relay.providers["ant"].lane.statistics().running == 1
        running.cancel_scope.cancel()
    await wait_for(lambda: lane_idle(served))
