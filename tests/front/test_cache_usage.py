"""Cached prompt tokens (SPEC L12a), through the assembled relay: every provider's cache
figures reach every front in that front's own fields, plain and streamed, and the record
keeps both; ``cache_control`` markers reach the Anthropic upstream from the Messages
front and from chat content parts; a continued answer's usage is the sum of its attempts.

The upstreams are the fakes of tests/fakes/: Anthropic (with `fakes.fake_prompt_cache`,
which counts cache reads and writes as Anthropic does), an OpenAI-compatible server and
Gemini. The clients are the official ``openai`` and ``anthropic`` ones where a front has
one here, and plain HTTP for the Gemini front.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
import trio
from fakes.fake_anthropic import KEY as ANTHROPIC_KEY
from fakes.fake_anthropic import FakeAnthropic, serve_fake_anthropic
from fakes.fake_anthropic import Script as AScript
from fakes.fake_gemini import KEY as GEMINI_KEY
from fakes.fake_gemini import FakeGemini, serve_fake_gemini
from fakes.fake_gemini import Script as GScript
from fakes.fake_prompt_cache import PromptCache
from fakes.fake_responses import FakeResponses, serve_fake_responses
from fakes.upstream import FakeUpstream, Script
from helpers.assembled import FAKE_ONLY, records, sse_events, start_relay, wait_for
from helpers.cloud_helpers import http_client, sse_blocks

pytestmark = pytest.mark.filterwarnings(
    "ignore:Async generator '(anthropic|openai|httpx2|httpcore2)\\.:ResourceWarning")

CHAT = "/v1/chat/completions"
SYSTEM = " ".join(f"rule{i}" for i in range(30))   # 30 tokens to the fake cache

# Each provider's cache figures, as it reports them, and what they mean in relay's terms:
# (every prompt token, read from the cache, written to it (None: it does not say)).
ANTHROPIC_USAGE = {"input_tokens": 4, "cache_read_input_tokens": 30,
                   "cache_creation_input_tokens": 6, "output_tokens": 5}
OPENAI_USAGE = {"prompt_tokens": 50, "completion_tokens": 2, "total_tokens": 52,
                "prompt_tokens_details": {"cached_tokens": 32, "audio_tokens": 0}}
GEMINI_USAGE = {"promptTokenCount": 45, "cachedContentTokenCount": 20,
                "candidatesTokenCount": 2, "totalTokenCount": 47}
EXPECTED = {"claude/cached": (40, 30, 6), "up/m1": (50, 32, None),
            "gem/gemini-cached": (45, 20, None)}


@pytest.fixture(autouse=True)
def _keys(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RELAY_TEST_ANTHROPIC_KEY", ANTHROPIC_KEY)
    monkeypatch.setenv("RELAY_TEST_GEMINI_KEY", GEMINI_KEY)


@pytest.fixture
async def fake(nursery: trio.Nursery) -> FakeAnthropic:
    server: FakeAnthropic = await nursery.start(serve_fake_anthropic)
    return server


@pytest.fixture
async def gemini(nursery: trio.Nursery) -> FakeGemini:
    server: FakeGemini = await nursery.start(serve_fake_gemini)
    return server


def config(fake: FakeAnthropic, upstream: FakeUpstream | None = None,
           gemini: FakeGemini | None = None, extra: str = "") -> str:
    text = FAKE_ONLY + f"""
[providers.claude]
adapter = "anthropic"
base_url = "{fake.url}"
api_key_env = "RELAY_TEST_ANTHROPIC_KEY"
models = ["cached", "claude-test-1", "whole"]
[providers.claude.profile]
lanes = 2
queue_max = 8
rpm = 0
"""
    if upstream is not None:
        text += f"""
[providers.up]
adapter = "openai"
base_url = "{upstream.url}"
models = ["m1"]
[providers.up.profile]
lanes = 2
queue_max = 8
queue_timeout_s = 10
run_timeout_s = 20
"""
    if gemini is not None:
        text += f"""
[providers.gem]
adapter = "gemini"
base_url = "{gemini.url}"
api_key_env = "RELAY_TEST_GEMINI_KEY"
models = ["gemini-cached"]
[providers.gem.profile]
rpm = 0
"""
    return text + extra


async def the_record(tmp_path: Path, n: int) -> dict[str, Any]:
    await wait_for(lambda: len(records(tmp_path)) >= n)
    return records(tmp_path)[n - 1]


def record_usage(expected: tuple[int, int, int | None]) -> dict[str, Any]:
    """What a record's usage keeps of ``expected`` (a cache write only when said)."""
    prompt, read, write = expected
    out = {"cache_read_tokens": read}
    if write is not None:
        out["cache_write_tokens"] = write
    return {"prompt_tokens": prompt, **out}


# --- every front and every caching provider, plain and streamed -----------------------------

def _chat_usage(body: dict[str, Any] | None, events: list[Any] | None) -> dict[str, Any]:
    if body is not None:
        return body["usage"]  # type: ignore[no-any-return]
    assert events is not None
    (usage,) = [e["usage"] for e in events if isinstance(e, dict) and e.get("usage")]
    return usage  # type: ignore[no-any-return]


async def ask(http: httpx.AsyncClient, url: str, front: str, model: str,
              stream: bool) -> dict[str, Any]:
    """The usage the client got, in ``front``'s own shape."""
    if front == "chat":
        r = await http.post(url + CHAT, json={
            "model": model, "messages": [{"role": "user", "content": "hi"}],
            "stream": stream, **({"stream_options": {"include_usage": True}}
                                 if stream else {})})
        assert r.status_code == 200, r.text
        return _chat_usage(None if stream else r.json(), sse_events(r.text) if stream
                           else None)
    if front == "messages":
        r = await http.post(url + "/v1/messages", json={
            "model": model, "max_tokens": 64, "stream": stream,
            "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200, r.text
        if not stream:
            return r.json()["usage"]  # type: ignore[no-any-return]
        (delta,) = [d for name, d in sse_blocks(r.text) if name == "message_delta"]
        return delta["usage"]  # type: ignore[no-any-return]
    if front == "responses":
        r = await http.post(url + "/v1/responses", json={"model": model, "input": "hi",
                                                         "stream": stream})
        assert r.status_code == 200, r.text
        if not stream:
            return r.json()["usage"]  # type: ignore[no-any-return]
        (done,) = [d for name, d in sse_blocks(r.text) if name == "response.completed"]
        return done["response"]["usage"]  # type: ignore[no-any-return]
    path = (f"/v1beta/models/{model}:streamGenerateContent?alt=sse" if stream
            else f"/v1beta/models/{model}:generateContent")
    r = await http.post(url + path, json={"contents": [{"role": "user",
                                                        "parts": [{"text": "hi"}]}]})
    assert r.status_code == 200, r.text
    if not stream:
        return r.json()["usageMetadata"]  # type: ignore[no-any-return]
    return [d for _, d in sse_blocks(r.text)][-1]["usageMetadata"]  # type: ignore[no-any-return]


def in_front_terms(front: str, usage: dict[str, Any]) -> tuple[int, int, int | None]:
    """A front's usage → (every prompt token, read from the cache, written to it)."""
    if front == "chat":
        assert set(usage) == {"prompt_tokens", "completion_tokens", "total_tokens",
                              "prompt_tokens_details"}, usage   # nothing of relay's own
        return usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"], None
    if front == "messages":
        read, write = usage["cache_read_input_tokens"], usage["cache_creation_input_tokens"]
        return usage["input_tokens"] + read + write, read, write
    if front == "responses":
        return usage["input_tokens"], usage["input_tokens_details"]["cached_tokens"], None
    return usage["promptTokenCount"], usage["cachedContentTokenCount"], None


@pytest.mark.parametrize("front", ["chat", "messages", "responses", "gemini"])
async def test_every_front_reports_every_providers_cache_in_its_own_fields(
        nursery: trio.Nursery, tmp_path: Path, fake: FakeAnthropic, gemini: FakeGemini,
        upstream: FakeUpstream, front: str) -> None:
    fake.scripts["cached"] = AScript(usage=ANTHROPIC_USAGE)
    upstream.scripts["m1"] = Script(usage=OPENAI_USAGE)
    gemini.scripts["gemini-cached"] = GScript(usage=GEMINI_USAGE)
    served = await start_relay(nursery, config(fake, upstream, gemini), tmp_path)
    n = 0
    async with http_client() as http:
        for model, (prompt, read, write) in EXPECTED.items():
            for stream in (False, True):
                usage = await ask(http, served.url, front, model, stream)
                n += 1
                # Only Messages has a cache-write field (0 when the provider did not
                # say, as Anthropic always gives it).
                said = (write or 0) if front == "messages" else None
                assert in_front_terms(front, usage) == (prompt, read, said), (
                    model, stream, usage)
                record = await the_record(tmp_path, n)
                assert f'{record["provider"]}/{record["model"]}' == model
                kept = {k: record["usage"].get(k) for k in record_usage(
                    (prompt, read, write))}
                assert kept == record_usage((prompt, read, write)), (model, stream, record)
                assert ("cache_write_tokens" in record["usage"]) == (write is not None)


async def test_a_provider_that_says_nothing_of_its_cache(
        nursery: trio.Nursery, tmp_path: Path, fake: FakeAnthropic,
        upstream: FakeUpstream) -> None:
    """What each front writes for "none": Responses and Messages their fields at 0 (the
    official shapes always have them), chat no details; the record no cache fields."""
    upstream.scripts["m1"] = Script(usage={"prompt_tokens": 9, "completion_tokens": 2,
                                           "total_tokens": 11})
    served = await start_relay(nursery, config(fake, upstream), tmp_path)
    async with http_client() as http:
        chat = await ask(http, served.url, "chat", "up/m1", False)
        messages = await ask(http, served.url, "messages", "up/m1", True)
        responses = await ask(http, served.url, "responses", "up/m1", False)
    assert chat == {"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11}
    assert messages == {"input_tokens": 9, "cache_creation_input_tokens": 0,
                        "cache_read_input_tokens": 0, "output_tokens": 2}
    assert responses["input_tokens_details"] == {"cached_tokens": 0}
    record = await the_record(tmp_path, 3)
    assert record["usage"] == {"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11}


# --- the official clients, and cache_control reaching Anthropic ----------------------------

def oai(url: str, http: httpx.AsyncClient) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0,
                              http_client=http)


@pytest.mark.parametrize("stream", [False, True])
async def test_chat_content_parts_cache_control_reaches_anthropic(
        nursery: trio.Nursery, tmp_path: Path, fake: FakeAnthropic, stream: bool) -> None:
    """The openai client marks its system part; the Anthropic upstream gets the marker on
    the matching block, writes the prefix the first time and reads it the second; the
    client sees ``prompt_tokens_details.cached_tokens``, the record both figures."""
    cache = PromptCache()
    fake.decide = cache.decide
    served = await start_relay(nursery, config(fake), tmp_path)
    messages: Any = [
        {"role": "system", "content": [{"type": "text", "text": SYSTEM,
                                        "cache_control": {"type": "ephemeral"}}]},
        {"role": "user", "content": "hi there"}]
    got = []
    async with http_client() as http:
        c = oai(served.url, http)
        for _ in range(2):
            if stream:
                chunks = await c.chat.completions.create(
                    model="claude/claude-test-1", messages=messages, stream=True,
                    stream_options={"include_usage": True})
                (usage,) = [ch.usage async for ch in chunks if ch.usage]
            else:
                done = await c.chat.completions.create(model="claude/claude-test-1",
                                                       messages=messages)
                usage = done.usage
            assert usage is not None and usage.prompt_tokens_details is not None
            got.append((usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens))
    assert got == [(32, 0), (32, 30)]
    sent = [r.json for r in fake.requests if r.method == "POST"]
    assert sent[0]["system"] == [{"type": "text", "text": SYSTEM,
                                  "cache_control": {"type": "ephemeral"}}]
    assert cache.marked == [["system[0]"], ["system[0]"]]
    first, second = await the_record(tmp_path, 1), await the_record(tmp_path, 2)
    assert (first["usage"]["cache_read_tokens"], first["usage"]["cache_write_tokens"]) == (
        0, 30)
    assert (second["usage"]["cache_read_tokens"], second["usage"]["cache_write_tokens"]) == (
        30, 0)
    assert second["usage"]["prompt_tokens"] == 32


async def test_chat_message_and_tool_cache_control_reach_anthropic(
        nursery: trio.Nursery, tmp_path: Path, fake: FakeAnthropic) -> None:
    """A marker on a whole chat message (its last block gets it, as LiteLLM and
    OpenRouter take it), on an image part, and on a tool."""
    cache = PromptCache()
    fake.decide = cache.decide
    served = await start_relay(nursery, config(fake), tmp_path)
    ephemeral = {"type": "ephemeral"}
    body = {"model": "claude/claude-test-1", "messages": [
        {"role": "system", "content": SYSTEM, "cache_control": ephemeral},
        {"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "https://x.test/a.png"},
             "cache_control": {"type": "ephemeral", "ttl": "1h"}},
            {"type": "text", "text": "what is it"}]}],
        "tools": [{"type": "function", "cache_control": ephemeral,
                   "function": {"name": "look", "parameters": {"type": "object"}}}]}
    async with http_client() as http:
        r = await http.post(served.url + CHAT, json=body)
        assert r.status_code == 200, r.text
    sent = next(q.json for q in fake.requests if q.method == "POST")
    assert sent["system"] == [{"type": "text", "text": SYSTEM, "cache_control": ephemeral}]
    assert sent["messages"][0]["content"][0]["cache_control"] == {"type": "ephemeral",
                                                                  "ttl": "1h"}
    assert "cache_control" not in sent["messages"][0]["content"][1]
    assert sent["tools"][0]["cache_control"] == ephemeral
    assert cache.marked == [["tools[0]", "system[0]", "messages[0].content[0]"]]
    assert r.json()["usage"]["prompt_tokens"] == sum(cache.usages[0][k] for k in (
        "input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens"))


def sdk(url: str) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=url, api_key="unused", max_retries=0)


@pytest.mark.parametrize("stream", [False, True])
async def test_messages_front_cache_control_reaches_anthropic(
        nursery: trio.Nursery, tmp_path: Path, fake: FakeAnthropic, stream: bool) -> None:
    """The anthropic client's markers (system, a message block, a tool) arrive as sent;
    its usage is Anthropic's: ``input_tokens`` the uncached part beside the cache reads
    and writes."""
    cache = PromptCache()
    fake.decide = cache.decide
    served = await start_relay(nursery, config(fake), tmp_path)
    ephemeral: Any = {"type": "ephemeral"}
    kw: Any = {
        "model": "claude/claude-test-1", "max_tokens": 64,
        "system": [{"type": "text", "text": SYSTEM, "cache_control": ephemeral}],
        "tools": [{"name": "look", "input_schema": {"type": "object"},
                   "cache_control": ephemeral}],
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": "a long document " * 5, "cache_control": ephemeral},
            {"type": "text", "text": "so what"}]}]}
    got = []
    async with sdk(served.url) as c:
        for _ in range(2):
            if stream:
                async with c.messages.stream(**kw) as s:
                    message = await s.get_final_message()
            else:
                message = await c.messages.create(**kw)
            u = message.usage
            got.append((u.input_tokens, u.cache_read_input_tokens,
                        u.cache_creation_input_tokens))
    tool = cache.usages[0]["cache_creation_input_tokens"] - 30 - 15
    assert tool > 0
    assert got == [(2, 0, 30 + 15 + tool), (2, 30 + 15 + tool, 0)]
    assert cache.marked == [["tools[0]", "system[0]", "messages[0].content[0]"]] * 2
    sent = [q.json for q in fake.requests if q.method == "POST"]
    assert sent[0]["messages"] == kw["messages"] and sent[0]["system"] == kw["system"]
    second = await the_record(tmp_path, 2)
    assert second["usage"]["prompt_tokens"] == 2 + 30 + 15 + tool
    assert (second["usage"]["cache_read_tokens"], second["usage"]["cache_write_tokens"]) == (
        30 + 15 + tool, 0)


async def test_responses_client_sees_cached_tokens(
        nursery: trio.Nursery, tmp_path: Path, fake: FakeAnthropic) -> None:
    fake.scripts["cached"] = AScript(usage=ANTHROPIC_USAGE)
    served = await start_relay(nursery, config(fake), tmp_path)
    async with http_client() as http:
        c = oai(served.url, http)
        done = await c.responses.create(model="claude/cached", input="hi")
        events = await c.responses.create(model="claude/cached", input="hi", stream=True)
        (completed,) = [e async for e in events if e.type == "response.completed"]
    for response in (done, completed.response):
        assert response.usage is not None
        assert response.usage.input_tokens == 40
        assert response.usage.input_tokens_details.cached_tokens == 30


async def test_a_continued_answers_cache_figures_are_summed(
        nursery: trio.Nursery, tmp_path: Path, fake: FakeAnthropic) -> None:
    """SPEC L12a, F8: the stream breaks after "Hello " (the fake provider: no usage,
    relay's estimate) and the Anthropic fallback continues it, reading its cache; the
    answer's usage is the sum, its cache figures the continuation's."""
    fake.scripts["whole"] = AScript(chunks=[" big", " world"], usage=ANTHROPIC_USAGE)
    route = """
[routes.r]
primary = "fake/echo?reply=Hello big world&cut_after=1"
fallbacks = ["claude/whole"]
"""
    served = await start_relay(nursery, config(fake, extra=route), tmp_path)
    async with http_client() as http:
        r = await http.post(served.url + CHAT, json={
            "model": "r", "messages": [{"role": "user", "content": "hello"}],
            "stream": True, "stream_options": {"include_usage": True}})
    usage = _chat_usage(None, sse_events(r.text))
    assert usage["estimated"] is True
    assert usage["prompt_tokens"] > 40 and usage["prompt_tokens_details"] == {
        "cached_tokens": 30}
    record = await the_record(tmp_path, 1)
    assert [a["failure"] for a in record["attempts"]] == ["stream_cut", None]
    assert record["usage"]["prompt_tokens"] == usage["prompt_tokens"]
    assert (record["usage"]["cache_read_tokens"], record["usage"]["cache_write_tokens"]) == (
        30, 6)


async def test_a_passed_through_responses_answer_keeps_its_cached_tokens(
        nursery: trio.Nursery, tmp_path: Path) -> None:
    """A provider that speaks Responses itself: its answer reaches the client as it is,
    and the record keeps its ``input_tokens_details.cached_tokens`` (here 0: it says so,
    which is not unknown)."""
    up: FakeResponses = await nursery.start(serve_fake_responses)
    served = await start_relay(nursery, FAKE_ONLY + f"""
[providers.oa]
adapter = "openai"
base_url = "{up.url}"
responses = true
models = ["gpt-fake"]
[providers.oa.profile]
lanes = 2
queue_max = 8
queue_timeout_s = 10
run_timeout_s = 20
""", tmp_path)
    async with http_client() as http:
        for n, stream in enumerate((False, True), start=1):
            r = await http.post(served.url + "/v1/responses", json={
                "model": "oa/gpt-fake", "input": "hi", "stream": stream})
            assert r.status_code == 200, r.text
            record = await the_record(tmp_path, n)
            assert record["usage"]["prompt_tokens"] == 11
            assert record["usage"]["cache_read_tokens"] == 0, record["usage"]
            assert "cache_write_tokens" not in record["usage"]
