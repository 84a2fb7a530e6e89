"""SPEC E1/E4/A1/A2 through the assembled relay: the ``openai`` adapter in front of the fake
upstream (tests/fakes/upstream.py), and the official ``openai`` client in front of relay.

For each way an upstream can fail, the client must see the E1 status, ``code``, ``type``,
``phase``, the provider's own status and its whole message, the right ``x-should-retry``
and ``Retry-After`` — and the request's record must say the same.
"""

from __future__ import annotations

import json
import ssl
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import attrs
import httpx
import openai
import pytest
import trio
from fakes.upstream import FakeUpstream, Script, error_body
from helpers.assembled import (
    FAKE_ONLY,
    chat,
    lane_idle,
    records,
    sse_events,
    start_relay,
    wait_for,
    with_upstream,
)

from relay import Served
from relay.vocab.errors import REASONS

CHAT = "/v1/chat/completions"
# One TLS context for every client here: building one per client (httpx's default) costs
# ~30 ms, and these clients only speak plain HTTP on loopback anyway.
TLS = ssl.create_default_context()


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    """conftest's ``client``, without the per-test TLS context."""
    async with httpx.AsyncClient(trust_env=False, verify=TLS, timeout=httpx.Timeout(30.0)) as c:
        yield c

# A provider's long message: it must reach the client whole (E1: never truncated).
LONG = ("The provider explains at length: " + "".join(
    f"detail {i:04d}; " for i in range(400)))[:4990].ljust(4990, ".") + " [the end]"
assert len(LONG) == 5000


def up_config(url: str, *, run_timeout_s: float = 20.0) -> str:
    """The fake provider and an ``up`` provider (openai adapter, no preset) at ``url``."""
    return FAKE_ONLY + f"""
[providers.up]
adapter = "openai"
base_url = "{url}"
models = ["m1", "m2"]
[providers.up.profile]
lanes = 1
queue_max = 4
queue_timeout_s = 10
run_timeout_s = {run_timeout_s}
"""


@attrs.frozen
class Case:
    script: Script
    status: int
    reason: str
    upstream_status: int | None
    retry_after: str | None = None
    upstream_message: str | None = LONG


CASES: dict[str, Case] = {
    "401": Case(Script(status=401, error_body=error_body(401, LONG, "invalid_api_key")),
                502, "auth_required", 401),
    "403": Case(Script(status=403, error_body=error_body(403, LONG)), 502, "auth_required",
                403),
    "429 retry-after 7": Case(Script(status=429, headers={"retry-after": "7"},
                                     error_body=error_body(429, LONG, "rate_limit_exceeded")),
                              429, "rate_limited", 429, retry_after="7"),
    "429 insufficient_quota": Case(
        Script(status=429, error_body=error_body(429, LONG, "insufficient_quota")),
        429, "quota_exhausted", 429, retry_after="600"),
    "400 context_length_exceeded": Case(
        Script(status=400, error_body=error_body(400, LONG, "context_length_exceeded")),
        400, "context_too_long", 400),
    "400 context phrase": Case(
        Script(status=400, error_body=error_body(
            400, "This model's maximum context length is 8192 tokens. " + LONG)),
        400, "context_too_long", 400,
        upstream_message="This model's maximum context length is 8192 tokens. " + LONG),
    "400 other": Case(Script(status=400, error_body=error_body(400, LONG, "invalid_value")),
                      400, "rejected", 400),
    "404": Case(Script(status=404, error_body=error_body(404, LONG, "model_not_found")),
                404, "rejected", 404),
    "422": Case(Script(status=422, error_body=error_body(422, LONG)), 422, "rejected", 422),
    "500": Case(Script(status=500, error_body=error_body(500, LONG)), 502, "upstream_error",
                500),
    "503": Case(Script(status=503, headers={"retry-after": "3"},
                       error_body=error_body(503, LONG)), 502, "upstream_error", 503),
    "malformed 200": Case(Script(malformed_at=0), 502, "bad_upstream_response", None,
                          upstream_message="{not json"),
}


def e1(r: httpx.Response, status: int, reason: str) -> dict[str, Any]:
    """Assert an E1 answer with a real HTTP status; return its ``error`` object."""
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json"), r.headers
    assert r.headers["x-relay-request-id"]
    err = r.json()["error"]
    check_error(err, reason)
    retry = REASONS[reason].should_retry
    assert r.headers["x-should-retry"] == ("true" if retry else "false")
    return err  # type: ignore[no-any-return]


def check_error(err: dict[str, Any], reason: str) -> None:
    assert err["code"] == reason, err
    assert err["type"] == REASONS[reason].type
    assert err["relay"]["reason"] == reason
    assert err["relay"]["phase"] == REASONS[reason].phase
    assert err["message"]


async def one_record(tmp_path: Path, n: int = 1) -> dict[str, Any]:
    await wait_for(lambda: len(records(tmp_path)) >= n)
    return records(tmp_path)[n - 1]


# --- the E1 mapping, non-streamed and streamed before any byte ---------------------------

# (A malformed event inside a stream is skipped, not fatal: test_malformed_event_is_skipped.)
E1_PARAMS = [pytest.param(case, stream, id=f"{name}-{'stream' if stream else 'plain'}")
             for name, case in CASES.items() for stream in (False, True)
             if not (stream and case.reason == "bad_upstream_response")]


@pytest.mark.parametrize(("case", "stream"), E1_PARAMS)
async def test_upstream_failure_maps_to_e1(nursery: trio.Nursery, tmp_path: Path,
                                           upstream: FakeUpstream, client: httpx.AsyncClient,
                                           case: Case, stream: bool) -> None:
    upstream.scripts["m1"] = case.script
    served = await start_relay(nursery, with_upstream(upstream), tmp_path)
    r = await client.post(served.url + CHAT, json=chat("up/m1", stream=stream))
    err = e1(r, case.status, case.reason)
    relay_part = err["relay"]
    assert relay_part["provider"] == "up"
    assert relay_part["upstream_status"] == case.upstream_status
    assert relay_part["upstream_message"] == case.upstream_message  # whole, never cut
    if case.retry_after is None:
        assert "retry-after" not in r.headers
    else:
        assert r.headers["retry-after"] == case.retry_after
        assert relay_part["retry_after_s"] == float(case.retry_after)
    if case.reason == "auth_required":
        assert relay_part["action"]
        assert "key" in relay_part["action"] or "login" in relay_part["action"]
    if case.reason == "rejected":
        assert LONG in err["message"]  # the provider's words go to the client
    assert len(upstream.requests) == 1  # relay itself never retried (F6)

    rec = await one_record(tmp_path)
    assert (rec["status"], rec["reason"], rec["phase"]) == (
        case.status, case.reason, REASONS[case.reason].phase)
    assert (rec["provider"], rec["model"], rec["stream"]) == ("up", "m1", stream)
    assert rec["attempts"][0]["failure"] == case.reason
    assert rec["attempts"][0]["ok"] is False
    assert rec["released_at"] is not None
    assert lane_idle(served)


async def test_rate_limit_retry_after_forms(nursery: trio.Nursery, tmp_path: Path,
                                            upstream: FakeUpstream,
                                            client: httpx.AsyncClient) -> None:
    served = await start_relay(nursery, with_upstream(upstream), tmp_path)
    # (A 429 that says when holds every start on the provider until then, SPEC L12: the
    # short holds first, each over before the next request.)
    for headers, expected in (({}, "1"), ({"retry-after-ms": "1"}, "1"),
                              ({"retry-after": "30"}, "30")):
        upstream.scripts["m1"] = Script(status=429, headers=headers)
        r = await client.post(served.url + CHAT, json=chat("up/m1"))
        e1(r, 429, "rate_limited")
        assert r.headers["retry-after"] == expected, headers
        assert r.headers["x-should-retry"] == "true"
    # The 30 s hold outlasts the queue timeout (10 s): the next request is not sent, and
    # hears when the hold ends.
    sent = len(upstream.requests)
    r = await client.post(served.url + CHAT, json=chat("up/m1"))
    e1(r, 429, "rate_limited")
    assert 28 <= int(r.headers["retry-after"]) <= 30
    assert "retry-after: 30" in r.json()["error"]["message"]
    assert len(upstream.requests) == sent


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
async def test_connection_refused(nursery: trio.Nursery, tmp_path: Path,
                                  client: httpx.AsyncClient, stream: bool) -> None:
    sock = trio.socket.socket()
    await sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    served = await start_relay(nursery, up_config(f"http://127.0.0.1:{port}/v1"), tmp_path)
    r = await client.post(served.url + CHAT, json=chat("up/m1", stream=stream))
    err = e1(r, 502, "upstream_unavailable")
    assert err["relay"]["provider"] == "up"
    assert "retry-after" not in r.headers
    rec = await one_record(tmp_path)
    assert (rec["status"], rec["reason"], rec["phase"]) == (502, "upstream_unavailable",
                                                            "upstream")
    assert lane_idle(served)


async def test_plain_connection_closed_without_answer(nursery: trio.Nursery, tmp_path: Path,
                                                      upstream: FakeUpstream,
                                                      client: httpx.AsyncClient) -> None:
    upstream.scripts["m1"] = Script(cut_after=1)
    served = await start_relay(nursery, with_upstream(upstream), tmp_path)
    r = await client.post(served.url + CHAT, json=chat("up/m1"))
    e1(r, 502, "upstream_unavailable")
    rec = await one_record(tmp_path)
    assert (rec["status"], rec["reason"], rec["phase"]) == (502, "upstream_unavailable",
                                                            "upstream")
    assert lane_idle(served)


# --- streams that break after the headers ------------------------------------------------

def content_of(events: list[Any]) -> str:
    return "".join(e["choices"][0]["delta"].get("content") or "" for e in events
                   if isinstance(e, dict) and e.get("choices"))


def finishes(events: list[Any]) -> list[str]:
    return [e["choices"][0]["finish_reason"] for e in events
            if isinstance(e, dict) and e.get("choices") and e["choices"][0]["finish_reason"]]


@pytest.mark.parametrize("cut_after", [1, 2], ids=["mid-content", "before-finish"])
async def test_stream_cut_mid_answer(nursery: trio.Nursery, tmp_path: Path,
                                     upstream: FakeUpstream, client: httpx.AsyncClient,
                                     cut_after: int) -> None:
    upstream.scripts["m1"] = Script(chunks=["Hello", " world"], cut_after=cut_after)
    served = await start_relay(nursery, with_upstream(upstream), tmp_path)
    r = await client.post(served.url + CHAT, json=chat("up/m1", stream=True))
    assert r.status_code == 200  # the headers were out with the first byte
    assert r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert "[DONE]" not in events
    assert finishes(events) == []  # never reported as complete (E4)
    assert content_of(events) == "Hello world"[:5 if cut_after == 1 else None]
    last = events[-1]
    assert set(last) == {"error"}
    check_error(last["error"], "stream_cut")
    assert last["error"]["relay"]["provider"] == "up"
    rec = await one_record(tmp_path)
    assert (rec["reason"], rec["phase"]) == ("stream_cut", "upstream")
    assert rec["status"] == REASONS["stream_cut"].status
    assert lane_idle(served)


async def test_stream_cut_before_any_content(nursery: trio.Nursery, tmp_path: Path,
                                             upstream: FakeUpstream,
                                             client: httpx.AsyncClient) -> None:
    """Only the empty role chunk came before the cut: no answer byte was ready, so the
    client gets a real 502 (A2), not a 200 with an in-band error."""
    upstream.scripts["m1"] = Script(cut_after=0)
    served = await start_relay(nursery, with_upstream(upstream), tmp_path)
    r = await client.post(served.url + CHAT, json=chat("up/m1", stream=True))
    e1(r, 502, "stream_cut")
    rec = await one_record(tmp_path)
    assert (rec["status"], rec["reason"], rec["phase"]) == (502, "stream_cut", "upstream")
    assert lane_idle(served)


async def test_failure_after_heartbeat_is_in_band(nursery: trio.Nursery, tmp_path: Path,
                                                  upstream: FakeUpstream,
                                                  client: httpx.AsyncClient) -> None:
    """A first byte slower than heartbeat_s gets its 200 and heartbeats; a failure after
    that arrives in-band as the whole E1 body (A2). (Its hold outlasts the queue timeout,
    10 s: relay does not wait it out, which tests/capacity/test_tokens.py covers.)"""
    upstream.scripts["m1"] = Script(status=429, first_byte_delay_s=0.4,
                                    headers={"retry-after": "30"},
                                    error_body=error_body(429, LONG))
    config = with_upstream(upstream).replace("[server]\n", "[server]\nheartbeat_s = 0.1\n", 1)
    served = await start_relay(nursery, config, tmp_path)
    r = await client.post(served.url + CHAT, json=chat("up/m1", stream=True))
    assert r.status_code == 200
    assert r.text.startswith(": keepalive\n\n")
    events = sse_events(r.text)
    assert len(events) == 1 and "[DONE]" not in events
    err = events[0]["error"]
    check_error(err, "rate_limited")
    assert err["relay"]["upstream_status"] == 429
    assert err["relay"]["upstream_message"] == LONG
    assert err["relay"]["retry_after_s"] == 30.0
    rec = await one_record(tmp_path)
    assert (rec["reason"], rec["phase"]) == ("rate_limited", "rate_limit")
    assert lane_idle(served)


async def test_stream_without_done_is_complete(nursery: trio.Nursery, tmp_path: Path,
                                               upstream: FakeUpstream,
                                               client: httpx.AsyncClient) -> None:
    upstream.scripts["m1"] = Script(omit_done=True)
    served = await start_relay(nursery, with_upstream(upstream), tmp_path)
    r = await client.post(served.url + CHAT, json=chat("up/m1", stream=True))
    assert r.status_code == 200
    events = sse_events(r.text)
    assert content_of(events) == "Hello world"
    assert finishes(events) == ["stop"]
    assert events[-1] == "[DONE]"
    assert not any(isinstance(e, dict) and "error" in e for e in events)
    rec = await one_record(tmp_path)
    assert (rec["status"], rec["reason"]) == (200, None)


async def test_malformed_event_is_skipped(nursery: trio.Nursery, tmp_path: Path,
                                          upstream: FakeUpstream,
                                          client: httpx.AsyncClient) -> None:
    upstream.scripts["m1"] = Script(malformed_at=1)
    served = await start_relay(nursery, with_upstream(upstream), tmp_path)
    r = await client.post(served.url + CHAT, json=chat("up/m1", stream=True))
    assert r.status_code == 200
    events = sse_events(r.text)  # every event relay sends is JSON
    assert content_of(events) == "Hello world"
    assert finishes(events) == ["stop"]
    assert events[-1] == "[DONE]"
    rec = await one_record(tmp_path)
    assert rec["status"] == 200
    assert len(rec["skipped_events"]) == 1
    assert "not json" in rec["skipped_events"][0]


# --- E4: a cut-off answer says so ---------------------------------------------------------

async def test_max_tokens_reports_length(nursery: trio.Nursery, tmp_path: Path,
                                         upstream: FakeUpstream,
                                         client: httpx.AsyncClient) -> None:
    upstream.scripts["m1"] = Script(chunks=["Hello", " world"])
    served = await start_relay(nursery, with_upstream(upstream), tmp_path)
    r = await client.post(served.url + CHAT, json=chat("up/m1", max_tokens=1))
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert (choice["message"]["content"], choice["finish_reason"]) == ("Hello", "length")
    r = await client.post(served.url + CHAT, json=chat("up/m1", max_tokens=1, stream=True))
    events = sse_events(r.text)
    assert content_of(events) == "Hello"
    assert finishes(events) == ["length"]
    assert events[-1] == "[DONE]"
    assert [q.json["max_tokens"] for q in upstream.requests] == [1, 1]


# --- tool calls and field pass-through (A1) -----------------------------------------------

TOOL_CALLS = [{"id": "call_1", "type": "function",
               "function": {"name": "f", "arguments": "{\"a\":1}"}}]


async def test_tool_calls_pass_through(nursery: trio.Nursery, tmp_path: Path,
                                       upstream: FakeUpstream,
                                       client: httpx.AsyncClient) -> None:
    upstream.scripts["m1"] = Script(chunks=[], tool_calls=TOOL_CALLS)
    served = await start_relay(nursery, with_upstream(upstream), tmp_path)
    r = await client.post(served.url + CHAT, json=chat("up/m1"))
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["message"]["tool_calls"] == TOOL_CALLS
    assert choice["message"]["content"] is None
    assert choice["finish_reason"] == "tool_calls"

    r = await client.post(served.url + CHAT, json=chat("up/m1", stream=True))
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    assert finishes(events) == ["tool_calls"]
    calls: dict[int, dict[str, Any]] = {}
    for e in events[:-1]:
        for call in (e["choices"][0]["delta"].get("tool_calls") or ()) if e["choices"] else ():
            slot = calls.setdefault(call["index"], {"id": None, "name": "", "arguments": ""})
            slot["id"] = call.get("id") or slot["id"]
            slot["name"] += (call.get("function") or {}).get("name") or ""
            slot["arguments"] += (call.get("function") or {}).get("arguments") or ""
    assert calls == {0: {"id": "call_1", "name": "f", "arguments": "{\"a\":1}"}}
    assert json.loads(calls[0]["arguments"]) == {"a": 1}


PASSED = {
    "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}}],
    "tool_choice": "auto",
    "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object"}, "strict": True}},
    "seed": 42,
    "reasoning_effort": "low",
    "temperature": 0.25,
    "top_p": 0.5,
    "stop": ["\n\n"],
    "user": "u-1",
    "metadata": {"k": "v"},
    "parallel_tool_calls": False,
    "x_vendor_extension": {"nested": [1, 2, {"deep": None}]},
}


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
async def test_request_fields_pass_through(nursery: trio.Nursery, tmp_path: Path,
                                           upstream: FakeUpstream, client: httpx.AsyncClient,
                                           stream: bool) -> None:
    served = await start_relay(nursery, with_upstream(upstream), tmp_path)
    upstream.scripts["Qwen/Qwen3-8B"] = Script(chunks=['{"a":', ' 1}'])  # JSON was asked
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    body = {"model": "up/Qwen/Qwen3-8B", "messages": messages, "stream": stream, **PASSED}
    r = await client.post(served.url + CHAT, json=body)
    assert r.status_code == 200, r.text
    sent = upstream.requests[-1].json
    assert sent["model"] == "Qwen/Qwen3-8B"
    assert sent["messages"] == messages
    assert sent["stream"] is stream
    for key, value in PASSED.items():
        assert sent[key] == value, key
    extra = set(sent) - set(PASSED) - {"model", "messages", "stream"}
    assert extra == ({"stream_options"} if stream else set())
    if stream:
        assert r.headers["content-type"].startswith("text/event-stream")
        assert all(e["model"] == "up/Qwen/Qwen3-8B" for e in sse_events(r.text)[:-1])
    else:
        assert r.json()["model"] == "up/Qwen/Qwen3-8B"


async def test_stream_usage_only_when_asked(nursery: trio.Nursery, tmp_path: Path,
                                            upstream: FakeUpstream,
                                            client: httpx.AsyncClient) -> None:
    served = await start_relay(nursery, with_upstream(upstream), tmp_path)
    r = await client.post(served.url + CHAT, json=chat("up/m1", stream=True))
    events = sse_events(r.text)
    assert not any("usage" in e for e in events[:-1])  # the client did not ask
    assert upstream.requests[-1].json["stream_options"] == {"include_usage": True}
    r = await client.post(served.url + CHAT, json=chat(
        "up/m1", stream=True, stream_options={"include_usage": True}))
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    assert events[-2]["choices"] == []
    assert events[-2]["usage"]["total_tokens"] == 5
    rec = await one_record(tmp_path, 2)
    assert rec["usage"]["total_tokens"] == 5


# --- the official openai client -----------------------------------------------------------

# openai's AsyncStream leaves its inner async generators to be finalized by trio after
# [DONE] or an error; trio warns about each. The stream and its response are closed.
openai_gens = pytest.mark.filterwarnings(
    "ignore:Async generator 'openai\\.:ResourceWarning")


def oai(served: Served, http: httpx.AsyncClient, retries: int = 0) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=served.url + "/v1", api_key="x", max_retries=retries,
                              http_client=http)


@openai_gens
async def test_openai_client(nursery: trio.Nursery, tmp_path: Path,
                             upstream: FakeUpstream) -> None:
    served = await start_relay(nursery, with_upstream(upstream), tmp_path)
    messages: Any = [{"role": "user", "content": "hi"}]
    async with httpx.AsyncClient(trust_env=False, verify=TLS) as http:
        c = oai(served, http)
        done = await c.chat.completions.create(model="up/m1", messages=messages)
        assert done.choices[0].message.content == "Hello world"
        assert done.choices[0].finish_reason == "stop"
        assert done.usage is not None and done.usage.total_tokens == 5

        stream = await c.chat.completions.create(model="up/m1", messages=messages, stream=True)
        text, reasons = "", []
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                reasons.append(chunk.choices[0].finish_reason)
        assert text == "Hello world"
        assert reasons[-1] == "stop"

        models = [m.id async for m in c.models.list()]
        assert "up/m1" in models and "fake/echo" in models

        with pytest.raises(openai.NotFoundError) as nf:
            await c.chat.completions.create(model="nope/x", messages=messages)
        assert nf.value.status_code == 404
        assert nf.value.code == "unknown_model"
        assert "up/m1" in nf.value.message

        # (A short Retry-After: a longer one would hold the provider's next starts, and
        # the stream below would be queued behind it, its 200 already out; SPEC L12.)
        upstream.scripts["m2"] = Script(status=429, headers={"retry-after-ms": "1"},
                                        error_body=error_body(429, LONG))
        with pytest.raises(openai.RateLimitError) as rl:
            await c.chat.completions.create(model="up/m2", messages=messages)
        assert rl.value.status_code == 429
        assert rl.value.response.headers["retry-after"] == "1"
        assert rl.value.code == "rate_limited"
        assert isinstance(rl.value.body, dict)
        assert rl.value.body["relay"]["upstream_message"] == LONG

        upstream.scripts["m2"] = Script(status=401, error_body=error_body(401, LONG))
        with pytest.raises(openai.APIStatusError) as auth:
            await c.chat.completions.create(model="up/m2", messages=messages, stream=True)
        assert auth.value.status_code == 502
        assert auth.value.code == "auth_required"

        upstream.scripts["m2"] = Script(chunks=["Hello", " world"], cut_after=1)
        stream = await c.chat.completions.create(model="up/m2", messages=messages, stream=True)
        got = ""
        with pytest.raises(openai.APIError) as cut:
            async for chunk in stream:
                got += chunk.choices[0].delta.content or "" if chunk.choices else ""
        assert got == "Hello"
        assert isinstance(cut.value.body, dict)
        assert cut.value.body["code"] == "stream_cut"
    assert lane_idle(served)


@openai_gens
async def test_openai_client_obeys_should_retry(nursery: trio.Nursery, tmp_path: Path,
                                                upstream: FakeUpstream) -> None:
    """With retries on, the official client would resend a 502 — unless relay says no."""
    upstream.scripts["m1"] = Script(status=500, error_body=error_body(500, LONG))
    served = await start_relay(nursery, with_upstream(upstream), tmp_path)
    async with httpx.AsyncClient(trust_env=False, verify=TLS) as http:
        with pytest.raises(openai.InternalServerError) as exc:
            await oai(served, http, retries=3).chat.completions.create(
                model="up/m1", messages=[{"role": "user", "content": "hi"}])
    assert exc.value.status_code == 502
    assert exc.value.response.headers["x-should-retry"] == "false"
    assert len(upstream.requests) == 1


@openai_gens
async def test_openai_client_run_timeout(nursery: trio.Nursery, tmp_path: Path,
                                         upstream: FakeUpstream) -> None:
    upstream.scripts["m1"] = Script(first_byte_delay_s=5)
    served = await start_relay(nursery, up_config(upstream.url, run_timeout_s=0.5), tmp_path)
    async with httpx.AsyncClient(trust_env=False, verify=TLS) as http:
        started = trio.current_time()
        with pytest.raises(openai.APIStatusError) as exc:
            await oai(served, http, retries=2).chat.completions.create(
                model="up/m1", messages=[{"role": "user", "content": "hi"}])
        took = trio.current_time() - started
    assert exc.value.status_code == 504
    assert exc.value.code == "run_timeout"
    assert exc.value.response.headers["x-should-retry"] == "false"
    assert 0.4 <= took < 3.0, took
    assert len(upstream.requests) == 1  # no retry, below relay or above it
    # the stop reached the upstream: relay closed its connection (SPEC C2)
    with trio.fail_after(2):
        await upstream.wait_until(lambda: upstream.connections[0].closed_by == "peer")
    await upstream.wait_no_active_responses()
    rec = await one_record(tmp_path)
    assert (rec["status"], rec["reason"], rec["phase"]) == (504, "run_timeout", "timeout")
    assert rec["stop_requested_at"] is not None and rec["released_at"] is not None
    assert lane_idle(served)


async def test_a_json_answer_that_is_not_json_is_a_failure_not_a_success(
        nursery: trio.Nursery, tmp_path: Path, upstream: FakeUpstream,
        client: httpx.AsyncClient) -> None:
    served = await start_relay(nursery, with_upstream(upstream), tmp_path)
    upstream.scripts["m1"] = Script(chunks=["Sure! Here is", " your JSON"])
    r = await client.post(served.url + CHAT, json=chat(
        "up/m1", response_format={"type": "json_object"}))
    assert r.status_code == 502
    assert r.json()["error"]["code"] == "bad_upstream_response"


def test_an_error_inside_the_stream_keeps_its_class() -> None:
    # Found in review: an in-stream error was always upstream_error, so a refusal could be
    # retried or fall back (SPEC F2 forbids it).
    from relay.adapters.http.openai_compat import _inband_error

    refusal = _inband_error("up", {"message": "no", "type": "invalid_request_error",
                                   "code": "content_policy_violation"})
    assert refusal.reason == "rejected" and refusal.status == 400
    assert refusal.upstream_message == "no"
    limited = _inband_error("up", {"message": "slow", "type": "rate_limit_error"})
    assert limited.reason == "rate_limited"
    assert _inband_error("up", {"message": "?"}).reason == "upstream_error"
