"""Every HTTP adapter reports every answer's rate-limit headers (SPEC L12, issue 33 item 5),
through the assembled relay.

The `/v1/responses` pass-through and the ``gemini`` adapter never did: Codex against
OpenAI was warned at 1,000 tokens left and relay sent its next 5,000-token request
straight into a 429; after a hold, every other request on a Gemini provider waited for
the first one's whole streamed answer. `HTTPAdapter.post` now takes the answer's sink as
an argument it has no default for, so a call cannot forget where the headers go.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import trio
from fakes.fake_gemini import KEY as GEMINI_KEY
from fakes.fake_gemini import FakeGemini, serve_fake_gemini
from fakes.fake_gemini import Script as GScript
from fakes.fake_responses import FakeResponses, serve_fake_responses
from fakes.fake_responses import Script as RScript
from helpers.assembled import start_relay

# 1,000 tokens of 10,000 left: a request of ~5,000 cannot start for ~24 s.
LOW = {"x-ratelimit-limit-tokens": "10000", "x-ratelimit-remaining-tokens": "1000"}
PROFILE = """lanes = 4
queue_max = 8
queue_timeout_s = 2
run_timeout_s = 300"""
BIG = "word " * 5000


def refused_for_tokens(r: httpx.Response) -> None:
    assert r.status_code == 429, r.text
    error = r.json()["error"]
    assert error["code"] == "provider_queue_timeout", error
    assert "tokens budget" in error["message"], error["message"]


@pytest.mark.parametrize("stream", [False, True])
async def test_a_passed_through_responses_answer_reports_its_headers(
        nursery: trio.Nursery, tmp_path: Path, client: httpx.AsyncClient,
        stream: bool) -> None:
    fake: FakeResponses = await nursery.start(serve_fake_responses)
    fake.scripts["gpt-fake"] = RScript(text=["fine"], headers=LOW)
    served = await start_relay(nursery, f"""
[server]
records = "records.jsonl"
[providers.oa]
adapter = "openai"
base_url = "{fake.url}"
responses = true
models = ["gpt-fake"]
[providers.oa.profile]
{PROFILE}
""", tmp_path)
    url = f"{served.url}/v1/responses"
    first = await client.post(url, json={"model": "oa/gpt-fake", "input": "hi",
                                         "stream": stream})
    assert first.status_code == 200, first.text
    # The headers said 1,000 tokens left: the large request waits for the budget (and
    # here times out) instead of being sent into the provider's 429.
    refused_for_tokens(await client.post(url, json={"model": "oa/gpt-fake", "input": BIG}))
    assert len([r for r in fake.requests if r.method == "POST"]) == 1


@pytest.mark.parametrize("stream", [False, True])
async def test_a_gemini_answer_reports_its_headers(
        nursery: trio.Nursery, tmp_path: Path, client: httpx.AsyncClient,
        monkeypatch: pytest.MonkeyPatch, stream: bool) -> None:
    monkeypatch.setenv("RELAY_TEST_GEMINI_KEY", GEMINI_KEY)
    gem: FakeGemini = await nursery.start(serve_fake_gemini)
    gem.scripts["g"] = GScript(headers=LOW)
    served = await start_relay(nursery, f"""
[server]
records = "records.jsonl"
[providers.gem]
adapter = "gemini"
base_url = "{gem.url}"
api_key_env = "RELAY_TEST_GEMINI_KEY"
models = ["g"]
[providers.gem.profile]
{PROFILE}
""", tmp_path)
    url = f"{served.url}/v1/chat/completions"
    first = await client.post(url, json={"model": "gem/g", "stream": stream,
                                         "messages": [{"role": "user", "content": "hi"}]})
    assert first.status_code == 200, first.text
    refused_for_tokens(await client.post(url, json={
        "model": "gem/g", "messages": [{"role": "user", "content": BIG}]}))
    assert len([r for r in gem.requests if r.method == "POST"]) == 1
