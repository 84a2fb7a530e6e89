"""A desktop chat app's ordinary request through every adapter kind (SPEC A1a, issue 13).

Chat apps send ``temperature``, ``top_p``, ``presence_penalty``, ``frequency_penalty``,
``max_tokens`` and ``stream_options`` with every request. Each adapter kind answers it
(200, plain and streamed, through the official ``openai`` client), naming in
``X-Relay-Ignored-Fields`` and the record what it dropped; before issue 13 a CLI-tool
provider refused it with a 400 for ``temperature``. Also here: ``strict_fields = true``
refuses instead, a fallback that drops other fields says so in the stream, and a stream
that asked for usage gets one from every provider (relay's estimate, marked, when the
provider reports none).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import trio
from fakes.fake_anthropic import KEY as ANTHROPIC_KEY
from fakes.fake_anthropic import FakeAnthropic, serve_fake_anthropic
from fakes.fake_gemini import KEY as GEMINI_KEY
from fakes.fake_gemini import FakeGemini, serve_fake_gemini
from fakes.upstream import FakeUpstream, Script, serve_fake_upstream
from helpers.assembled import records
from helpers.cli_procs import open_cli_relay
from helpers.cloud_helpers import every_kind_config, one_record, sse_blocks

from relay import ConfigError, Served, parse_config

# openai's AsyncStream leaves its inner async generators to trio to finalize.
pytestmark = pytest.mark.filterwarnings("ignore:Async generator 'openai\\.:ResourceWarning")

CHAT_APP = {"temperature": 0.7, "top_p": 0.9, "presence_penalty": 0.1,
            "frequency_penalty": 0.2, "max_tokens": 256}
HINTS = ["temperature", "top_p", "presence_penalty", "frequency_penalty"]
# What each kind drops of the chat app's body (the rest it honours or translates).
DROPPED = {"fake/echo": HINTS, "up/m1": [], "ant/claude-x": HINTS[2:], "gem/g": [],
           "claude/ok": [*HINTS, "max_tokens"], "codex/ok": [*HINTS, "max_tokens"],
           "gemini/ok": [*HINTS, "max_tokens"]}


def config(up: FakeUpstream, ant: FakeAnthropic, gem: FakeGemini, tmp_path: Path,
           extra: str = "") -> str:
    return every_kind_config(up.url, ant.url, gem.url, tmp_path / "fake-cli.jsonl",
                             up_models=("m1", "bare", "cut"), extra=extra)


@pytest.fixture
async def fakes(nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch
                ) -> tuple[FakeUpstream, FakeAnthropic, FakeGemini]:
    monkeypatch.setenv("RELAY_TEST_ANTHROPIC_KEY", ANTHROPIC_KEY)
    monkeypatch.setenv("RELAY_TEST_GEMINI_KEY", GEMINI_KEY)
    up: FakeUpstream = await nursery.start(serve_fake_upstream)
    ant: FakeAnthropic = await nursery.start(serve_fake_anthropic)
    gem: FakeGemini = await nursery.start(serve_fake_gemini)
    return up, ant, gem


@pytest.fixture
async def served(fakes: Any, tmp_path: Path) -> AsyncIterator[Served]:
    async with open_cli_relay(config(*fakes, tmp_path, """
[routes.fallback-drops]
primary = "up/cut"
fallbacks = ["fake/echo"]
"""), tmp_path) as s:
        yield s


@pytest.mark.parametrize("model", list(DROPPED))
async def test_a_chat_apps_body_is_answered_by_every_kind(served: Served, tmp_path: Path,
                                                          model: str) -> None:
    messages: Any = [{"role": "system", "content": "You are helpful."},
                     {"role": "user", "content": "hello there"}]
    dropped = sorted(DROPPED[model])
    async with httpx.AsyncClient(trust_env=False, timeout=30) as http:
        client = openai.AsyncOpenAI(base_url=served.url + "/v1", api_key="x",
                                    max_retries=0, http_client=http)
        raw = await client.chat.completions.with_raw_response.create(
            model=model, messages=messages, **CHAT_APP)
        assert raw.http_response.status_code == 200
        assert names(raw.headers) == dropped
        done = raw.parse()
        assert done.choices[0].message.content
        assert done.choices[0].finish_reason == "stop"

        raw_stream = await client.chat.completions.with_raw_response.create(
            model=model, messages=messages, stream=True,
            stream_options={"include_usage": True}, **CHAT_APP)
        assert names(raw_stream.headers) == dropped
        chunks = [chunk async for chunk in raw_stream.parse()]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == done.choices[0].message.content
    usage = chunks[-1].usage   # include_usage is honoured, whoever answers
    assert usage is not None and usage.completion_tokens and usage.total_tokens
    await one_record(tmp_path, 2)
    assert all(sorted(r["ignored_fields"]) == dropped for r in records(tmp_path))


def names(headers: Any) -> list[str]:
    """The names X-Relay-Ignored-Fields lists (in the request's order), sorted."""
    value = headers.get("x-relay-ignored-fields")
    return sorted(value.split(", ")) if value else []


async def test_strict_fields_refuses_what_would_be_dropped(fakes: Any, tmp_path: Path) -> None:
    text = config(*fakes, tmp_path).replace(
        '[providers.claude]\nadapter = "claude-cli"',
        '[providers.claude]\nadapter = "claude-cli"\nstrict_fields = true')
    async with open_cli_relay(text, tmp_path) as served, httpx.AsyncClient(
            trust_env=False, timeout=30) as http:
        body = {"model": "claude/ok", "messages": [{"role": "user", "content": "hi"}]}
        r = await http.post(served.url + "/v1/chat/completions",
                            json={**body, "temperature": 0.5})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert (error["code"], error["param"]) == ("unsupported", "temperature")
        assert "strict_fields" in error["message"]
        r = await http.post(served.url + "/v1/chat/completions", json=body)
        assert r.status_code == 200 and "x-relay-ignored-fields" not in r.headers
        # A neutral value asks for nothing: strict or not, it passes.
        r = await http.post(served.url + "/v1/chat/completions",
                            json={**body, "n": 1, "tools": [], "presence_penalty": 0})
        assert r.status_code == 200, r.text


def test_strict_fields_is_a_boolean() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config('[providers.f]\nadapter = "fake"\nstrict_fields = "yes"\n',
                     source="t.toml")
    assert "strict_fields: expected true or false" in str(info.value)
    config = parse_config('[providers.f]\nadapter = "fake"\nstrict_fields = true\n',
                          source="t.toml")
    assert config.providers["f"].strict_fields is True


async def test_a_fallback_that_drops_other_fields_says_so_in_the_stream(
        served: Served, fakes: Any, tmp_path: Path) -> None:
    up = fakes[0]
    up.scripts["cut"] = Script(chunks=["hello ", "there"], cut_after=1)
    async with httpx.AsyncClient(trust_env=False, timeout=30) as http:
        r = await http.post(served.url + "/v1/chat/completions", json={
            "model": "fallback-drops", "stream": True, "temperature": 0.5,
            "messages": [{"role": "user", "content": "hello there"}]})
    assert r.status_code == 200
    # The primary (OpenAI-compatible) honours temperature: the header named nothing.
    assert "x-relay-ignored-fields" not in r.headers
    assert ": relay: fake/echo ignores the request fields: temperature\n\n" in r.text
    text = "".join(d["choices"][0]["delta"].get("content") or "" for _, d in sse_blocks(
        r.text) if isinstance(d, dict) and d.get("choices"))
    assert text == "hello there"   # continued by the fallback
    rec = await one_record(tmp_path)
    assert rec["ignored_fields"] == ["temperature"] and rec["fallback_triggered"]


async def test_a_plain_answers_header_names_the_answering_targets_drops(
        served: Served, fakes: Any, tmp_path: Path) -> None:
    fakes[0].scripts["cut"] = Script(status=503)
    async with httpx.AsyncClient(trust_env=False, timeout=30) as http:
        r = await http.post(served.url + "/v1/chat/completions", json={
            "model": "fallback-drops", "top_p": 0.5,
            "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200, r.text
    assert r.headers["x-relay-ignored-fields"] == "top_p"


async def test_usage_is_estimated_when_the_provider_reports_none(
        served: Served, fakes: Any, tmp_path: Path) -> None:
    fakes[0].scripts["bare"] = Script(chunks=["four", " words", " of", " text"], usage=None)
    async with httpx.AsyncClient(trust_env=False, timeout=30) as http:
        r = await http.post(served.url + "/v1/chat/completions", json={
            "model": "up/bare", "stream": True, "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": "x" * 400}]})
        events = [d for _, d in sse_blocks(r.text)]
        usage = events[-2]["usage"]
        assert events[-1] == "[DONE]" and events[-2]["choices"] == []
        # About four characters a token: 400 in the prompt, 18 in the answer.
        assert usage == {"prompt_tokens": 100, "completion_tokens": 5, "total_tokens": 105,
                         "estimated": True}
        rec = await one_record(tmp_path)
        assert rec["usage"]["estimated"] is True
        # Without include_usage, no usage chunk (as OpenAI does).
        r = await http.post(served.url + "/v1/chat/completions", json={
            "model": "up/bare", "stream": True,
            "messages": [{"role": "user", "content": "x"}]})
        assert all("usage" not in d for _, d in sse_blocks(r.text) if isinstance(d, dict))
