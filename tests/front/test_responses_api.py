"""``/v1/responses`` — the Responses dialect, the response store and the pass-through
(SPEC A7).

First the dialect on its own (the translation field by field, custom tools both ways,
hosted tools, the stream's events in order), then the assembled relay on loopback: the
official ``openai`` client's ``responses.create`` (plain, streamed, with tools) against
an OpenAI-compatible provider that speaks only chat completions (tests/fakes/upstream.py),
the anthropic adapter (tests/fakes/fake_anthropic.py) and a provider that speaks Responses
itself (tests/fakes/fake_responses.py); the store (``previous_response_id``, GET, DELETE,
eviction); errors as real statuses before the stream and ``response.failed`` in it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import trio
from fakes.fake_anthropic import KEY as ANTHROPIC_KEY
from fakes.fake_anthropic import FakeAnthropic, serve_fake_anthropic
from fakes.fake_responses import FakeResponses, serve_fake_responses
from fakes.fake_responses import Script as RScript
from fakes.upstream import FakeUpstream, Script
from helpers.assembled import FAKE_ONLY, lane_idle, records, start_relay, wait_for, with_upstream
from helpers.cloud_helpers import e1, http_client, posts, sse_blocks

from relay import Served
from relay.dialects.base import Answer
from relay.dialects.openai_responses import RESPONSES, ResponsesTurn
from relay.engine.response_store import ResponseStore
from relay.vocab.errors import RelayError
from relay.vocab.events import Delta, Finish, Usage

RESP = "/v1/responses"
PROFILE = """[providers.oa.profile]
lanes = 2
queue_max = 4
queue_timeout_s = 10
run_timeout_s = 20"""
# openai's streams leave inner async generators for trio to finalize; each is closed.
pytestmark = pytest.mark.filterwarnings(
    "ignore:Async generator '(openai|httpx|httpcore)\\.:ResourceWarning")

SHELL = {"type": "function", "name": "shell", "description": "run a command",
         "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}},
                        "required": ["cmd"]}}
PATCH = {"type": "custom", "name": "apply_patch", "description": "apply a patch",
         "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"}}


def turn(**body: Any) -> tuple[ResponsesTurn, Any]:
    t = RESPONSES.turn(lambda _id: None)
    chat = t.parse(json.dumps({"model": "up/m1", **body}).encode())
    return t, chat


# --- the translation -------------------------------------------------------------------

def test_input_items_become_chat_messages() -> None:
    t, chat = turn(instructions="be brief", input=[
        {"role": "developer", "content": "dev rules"},
        {"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "look: "},
            {"type": "input_image", "image_url": "data:image/png;base64,iVBOR"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "X"},
        {"type": "message", "role": "assistant", "content": [
            {"type": "output_text", "text": "I will run it"}]},
        {"type": "function_call", "call_id": "c1", "name": "shell",
         "arguments": '{"cmd":"ls"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "a.txt"},
        {"type": "custom_tool_call", "call_id": "c2", "name": "apply_patch",
         "input": "*** Begin Patch"},
        {"type": "custom_tool_call_output", "call_id": "c2", "output": [
            {"type": "input_text", "text": "done"}]},
        {"type": "web_search_call", "id": "ws_1", "status": "completed"},
    ], max_output_tokens=99, temperature=0.3, tools=[SHELL, PATCH],
        tool_choice={"type": "function", "name": "shell"},
        text={"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}},
        reasoning={"effort": "low"}, store=False, include=["reasoning.encrypted_content"])
    assert chat.messages == [
        {"role": "system", "content": "be brief"},
        {"role": "system", "content": "dev rules"},
        {"role": "user", "content": [
            {"type": "text", "text": "look: "},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBOR"}}]},
        {"role": "assistant", "content": "I will run it", "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "shell", "arguments": '{"cmd":"ls"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "a.txt"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c2", "type": "function", "function": {
                "name": "apply_patch", "arguments": '{"input": "*** Begin Patch"}'}}]},
        {"role": "tool", "tool_call_id": "c2", "content": "done"},
    ]
    params = chat.params
    assert params["max_tokens"] == 99 and params["temperature"] == 0.3
    assert params["reasoning_effort"] == "low"
    assert params["tool_choice"] == {"type": "function", "function": {"name": "shell"}}
    assert params["response_format"] == {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object"}}}
    shell, patch = params["tools"]
    assert shell == {"type": "function", "function": {
        "name": "shell", "description": "run a command", "parameters": SHELL["parameters"]}}
    # The custom tool: a function with one string argument, its grammar in the words.
    fn = patch["function"]
    assert fn["name"] == "apply_patch" and fn["parameters"]["required"] == ["input"]
    assert "start: /.+/" in fn["parameters"]["properties"]["input"]["description"]
    assert set(params) == {"max_tokens", "temperature", "reasoning_effort", "tool_choice",
                           "response_format", "tools"}  # nothing of Responses' own, raw
    assert t.translation.ignored == ["input.reasoning", "input.web_search_call"]
    assert t.translation.problems == []
    # The request as sent, for a provider that speaks Responses: whole.
    assert chat.responses["input"][2]["encrypted_content"] == "X"
    assert chat.responses["store"] is False


def test_namespaces_and_hosted_tools() -> None:
    t, chat = turn(input="hi", tools=[
        {"type": "namespace", "name": "agents", "description": "sub-agents", "tools": [
            {"type": "function", "name": "spawn", "parameters": {"type": "object"}}]},
        {"type": "web_search", "external_web_access": False}], tool_choice="auto")
    assert [f["function"]["name"] for f in chat.params["tools"]] == ["agents__spawn"]
    assert t.translation.ignored == ["tools.web_search"]  # offered: dropped, reported
    item = t.tool_item("resp_x", 0, {"id": "c", "function": {"name": "agents__spawn",
                                                             "arguments": "{}"}})
    assert item["name"] == "spawn" and item["namespace"] == "agents"
    # A hosted tool the request requires is refused by name.
    t, _ = turn(input="hi", tools=[{"type": "web_search"}],
                tool_choice={"type": "web_search"})
    assert [e.reason for e in t.translation.problems] == ["unsupported"]
    assert "web_search" in t.translation.problems[0].message
    t, _ = turn(input="hi", tools=[{"type": "file_search", "vector_store_ids": ["v"]}],
                tool_choice="required")
    assert t.translation.problems and t.translation.problems[0].param == "tool_choice"


@pytest.mark.parametrize(("body", "reason", "param"), [
    ({"input": "hi", "background": True}, "unsupported", "background"),
    ({"input": "hi", "conversation": "conv_1"}, "unsupported", "conversation"),
    ({"input": 5}, "invalid_request", "input"),
    ({"input": []}, "invalid_request", "input"),
    ({"input": "hi", "max_output_tokens": 0}, "invalid_request", "max_output_tokens"),
    ({"input": "hi", "stream": "yes"}, "invalid_request", "stream"),
    ({"input": "hi", "temperature": 1e999}, "invalid_request", "temperature"),
])
def test_refused_requests(body: dict[str, Any], reason: str, param: str) -> None:
    with pytest.raises(RelayError) as err:
        turn(**body)
    assert (err.value.reason, err.value.param) == (reason, param)


def test_unknown_fields_are_refused_on_the_translation_only() -> None:
    t, chat = turn(input="hi", moderation={"mode": "block"}, prompt_cache_key="k",
                   truncation="auto")
    assert [p.param for p in t.translation.problems] == ["moderation"]
    assert t.translation.ignored == ["truncation", "prompt_cache_key"]
    assert chat.responses["moderation"] == {"mode": "block"}  # passed through as sent


def test_previous_response_id_is_expanded_before_any_adapter() -> None:
    before = [{"type": "message", "role": "user", "content": "first"}]
    stored = {"output": [{"type": "message", "role": "assistant",
                          "content": [{"type": "output_text", "text": "one"}]}]}
    t = RESPONSES.turn(lambda rid: (before, stored) if rid == "resp_a" else None)
    chat = t.parse(json.dumps({"model": "m", "input": "second",
                               "previous_response_id": "resp_a"}).encode())
    assert chat.messages == [{"role": "user", "content": "first"},
                             {"role": "assistant", "content": "one"},
                             {"role": "user", "content": "second"}]
    assert "previous_response_id" not in chat.responses
    assert len(chat.responses["input"]) == 3 and t.input_items == chat.responses["input"]


# --- rendering ---------------------------------------------------------------------------

def _stream(t: ResponsesTurn, events: list[Any], error: RelayError | None = None
            ) -> list[tuple[str | None, Any]]:
    enc = t.encoder("rq1", 123, True)
    enc.begin("up/m1")
    out = b""
    for ev in events:
        if isinstance(ev, Delta):
            out += enc.delta(ev)
        elif isinstance(ev, Finish):
            out += enc.finish(ev)
        else:
            enc.set_usage(ev)
    out += enc.error(error) if error is not None else enc.done()
    return sse_blocks(out.decode())


def test_stream_events_in_order_with_custom_tool_input_streamed() -> None:
    final: list[dict[str, Any]] = []
    t = RESPONSES.turn(lambda _id: None, final.append)
    t.parse(json.dumps({"model": "m", "input": "hi", "tools": [PATCH, SHELL]}).encode())
    args = json.dumps({"input": "*** Begin Patch\n+é \U0001f600\n*** End Patch"})
    cut = [args[:5], args[5:19], args[19:32], args[32:33], args[33:]]
    events = [Delta(content="Hel"), Delta(content="lo"),
              Delta(tool_calls=[{"index": 0, "id": "call_1", "type": "function",
                                 "function": {"name": "apply_patch", "arguments": ""}}]),
              *[Delta(tool_calls=[{"index": 0, "function": {"arguments": p}}]) for p in cut],
              Delta(tool_calls=[{"index": 1, "id": "call_2", "function": {
                  "name": "shell", "arguments": '{"cmd":'}}]),
              Delta(tool_calls=[{"index": 1, "function": {"arguments": '"ls"}'}}]),
              Finish("tool_calls"), Usage(5, 6, 11)]
    blocks = _stream(t, events)
    kinds = [name for name, _ in blocks]
    assert kinds == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", *["response.custom_tool_call_input.delta"] * (
            kinds.count("response.custom_tool_call_input.delta")),
        "response.custom_tool_call_input.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    assert kinds.count("response.custom_tool_call_input.delta") >= 3  # streamed, not whole
    assert [data["sequence_number"] for _, data in blocks] == list(range(len(blocks)))
    assert all(name == data["type"] for name, data in blocks)
    deltas = "".join(d["delta"] for n, d in blocks if n == "response.custom_tool_call_input.delta")
    assert deltas == "*** Begin Patch\n+é \U0001f600\n*** End Patch"
    done = blocks[-1][1]["response"]
    assert done["status"] == "completed" and done["usage"]["total_tokens"] == 11
    msg, patch, shell = done["output"]
    assert msg["content"][0]["text"] == "Hello"
    assert patch == {"id": patch["id"], "type": "custom_tool_call", "status": "completed",
                     "call_id": "call_1", "name": "apply_patch", "input": deltas}
    assert shell["type"] == "function_call" and shell["arguments"] == '{"cmd":"ls"}'
    assert final == [done]  # handed over (to be stored) before the last event went out


def test_cut_off_and_failed_streams() -> None:
    t = RESPONSES.turn(lambda _id: None)
    t.parse(b'{"model": "m", "input": "hi"}')
    blocks = _stream(t, [Delta(content="par"), Finish("length")])
    assert blocks[-1][0] == "response.incomplete"
    assert blocks[-1][1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    error = RelayError("stream_cut", "provider 'up' broke off the answer", provider="up")
    blocks = _stream(t, [Delta(content="par")], error)
    name, data = blocks[-1]
    assert name == "response.failed"
    failed = data["response"]
    assert failed["status"] == "failed"
    assert failed["error"]["code"] == "stream_cut"
    assert failed["error"]["relay"]["phase"] == "upstream"  # E1, whole
    assert failed["output"][0]["content"][0]["text"] == "par"


def test_plain_answer_renders_custom_and_namespaced_calls() -> None:
    t = RESPONSES.turn(lambda _id: None)
    t.parse(json.dumps({"model": "m", "input": "hi", "tools": [PATCH, {
        "type": "namespace", "name": "ns", "description": "", "tools": [SHELL]}]}).encode())
    message = {"role": "assistant", "content": None, "reasoning_content": "hmm",
               "tool_calls": [
                   {"id": "c1", "function": {"name": "apply_patch",
                                             "arguments": '{"input": "P"}'}},
                   {"id": "c2", "function": {"name": "ns__shell", "arguments": "{}"}}]}
    body = t.render(Answer(id="rq2", created=1, model="up/m1",
                           choices={0: {"message": message, "finish_reason": "tool_calls"}},
                           usage=None))
    reasoning, patch, shell = body["output"]
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "hmm"}]
    assert (patch["type"], patch["input"]) == ("custom_tool_call", "P")
    assert (shell["type"], shell["name"], shell["namespace"]) == ("function_call", "shell",
                                                                  "ns")
    assert body["id"] == "resp_rq2" and body["status"] == "completed"


# --- the store on its own ------------------------------------------------------------------

def test_store_bounds_entries_bytes_and_age() -> None:
    now = [0.0]
    store = ResponseStore(max_entries=2, max_bytes=400, max_age_s=10, clock=lambda: now[0])
    item = [{"type": "message", "role": "user", "content": "x" * 50}]
    for n in range(3):
        assert store.put(f"resp_{n}", {"id": f"resp_{n}", "output": []}, item)
    assert store.get("resp_0") is None and "evicted" in (store.forgotten("resp_0") or "")
    assert store.get("resp_2") is not None
    assert not store.put("resp_big", {"output": []}, [{"content": "y" * 500}])
    assert "was not stored" in (store.forgotten("resp_big") or "")
    now[0] = 11.0
    assert store.get("resp_2") is None and "expired" in (store.forgotten("resp_2") or "")
    assert len(store) == 0 and store.bytes == 0
    assert store.put("resp_3", {"output": []}, item) and store.delete("resp_3")
    assert store.forgotten("resp_3") == "was deleted" and store.bytes == 0


# --- the assembled relay: a provider that speaks only chat completions --------------------

def oai(served: Served, http: httpx.AsyncClient) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=served.url + "/v1", api_key="x", max_retries=0,
                              http_client=http)


async def test_openai_client_plain_and_streamed_through_chat_completions(
        nursery: trio.Nursery, tmp_path: Path, upstream: FakeUpstream) -> None:
    served = await start_relay(nursery, with_upstream(upstream), tmp_path)
    async with http_client() as http:
        c = oai(served, http)
        done = await c.responses.create(model="up/m1", input="hi", instructions="brief")
        assert done.output_text == "Hello world" and done.status == "completed"
        assert done.usage is not None and done.usage.total_tokens == 5
        sent = posts(upstream)[-1].json
        assert sent["messages"] == [{"role": "system", "content": "brief"},
                                    {"role": "user", "content": "hi"}]
        assert upstream.requests[-1].path == "/v1/chat/completions"

        kinds, text = [], ""
        stream = await c.responses.create(model="up/m1", input="hi", stream=True)
        async for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                text += event.delta
            if event.type == "response.completed":
                final = event.response
        assert text == "Hello world" and final.output_text == "Hello world"
        assert kinds[:2] == ["response.created", "response.in_progress"]
        assert kinds[-1] == "response.completed"
    rec = records(tmp_path)
    assert [r["status"] for r in rec] == [200, 200] and rec[1]["stream"] is True
    assert lane_idle(served)


async def test_function_tool_round_trip_and_the_store(
        nursery: trio.Nursery, tmp_path: Path, upstream: FakeUpstream) -> None:
    """A tool call, its output sent back by previous_response_id, the final answer; the
    upstream sees the whole conversation each time (it keeps none)."""
    upstream.agent = True
    served = await start_relay(nursery, with_upstream(upstream), tmp_path)
    async with http_client() as http:
        c = oai(served, http)
        first = await c.responses.create(
            model="up/m2", input='RELAY-CALL shell {"cmd": "ls"}', tools=[SHELL])
        call = first.output[0]
        assert call.type == "function_call" and call.name == "shell"
        assert json.loads(call.arguments) == {"cmd": "ls"}
        second = await c.responses.create(
            model="up/m2", previous_response_id=first.id, tools=[SHELL],
            input=[{"type": "function_call_output", "call_id": call.call_id,
                    "output": "a.txt b.txt"}])
        assert second.output_text == "RELAY-DONE a.txt b.txt"
        sent = posts(upstream)[-1].json["messages"]
        assert [m["role"] for m in sent] == ["user", "assistant", "tool"]
        assert sent[1]["tool_calls"][0]["id"] == call.call_id

        got = await c.responses.retrieve(second.id)
        assert got.output_text == "RELAY-DONE a.txt b.txt"
        items = (await http.get(f"{served.url}{RESP}/{second.id}/input_items")).json()
        assert [i["type"] for i in items["data"]] == ["message", "function_call",
                                                      "function_call_output"]
        await c.responses.delete(second.id)
        with pytest.raises(openai.NotFoundError) as gone:
            await c.responses.retrieve(second.id)
        assert second.id in gone.value.message and "deleted" in gone.value.message
        with pytest.raises(openai.NotFoundError) as nf:
            await c.responses.create(model="up/m2", input="more",
                                     previous_response_id=second.id)
        assert nf.value.body["param"] == "previous_response_id"  # type: ignore[index]

        # store=false: answered, never kept.
        quiet = await c.responses.create(model="up/m2", input="hi", store=False)
        r = await http.get(f"{served.url}{RESP}/{quiet.id}")
        assert r.status_code == 404 and quiet.id in r.json()["error"]["message"]


async def test_evicted_ids_are_a_404_naming_them(nursery: trio.Nursery, tmp_path: Path,
                                                 client: httpx.AsyncClient) -> None:
    served = await start_relay(nursery, FAKE_ONLY, tmp_path)
    served.relay.responses = ResponseStore(max_entries=2)
    ids = []
    for n in range(3):
        r = await client.post(served.url + RESP, json={"model": "fake/echo", "input": f"t{n}"})
        ids.append(r.json()["id"])
    r = await client.post(served.url + RESP, json={
        "model": "fake/echo", "input": "next", "previous_response_id": ids[0]})
    err = e1(r, 404, "invalid_request")
    assert ids[0] in err["message"] and "evicted" in err["message"]
    assert err["param"] == "previous_response_id"
    r = await client.post(served.url + RESP, json={
        "model": "fake/echo", "input": "next", "previous_response_id": ids[2]})
    assert r.status_code == 200 and r.json()["output"][0]["content"][0]["text"] == "next"
    for method in ("GET", "DELETE"):  # the 4th response pushed out ids[1]; ids[2] is held
        r = await client.request(method, f"{served.url}{RESP}/{ids[2]}")
        assert r.status_code == 200, r.text
    assert r.json() == {"id": ids[2], "object": "response", "deleted": True}
    assert (await client.get(f"{served.url}{RESP}/{ids[1]}")).status_code == 404
    r = await client.get(f"{served.url}{RESP}/resp_never")
    assert e1(r, 404, "invalid_request")["message"].startswith("response 'resp_never'")
    r = await client.put(f"{served.url}{RESP}/{ids[0]}", json={})
    assert r.status_code == 405


async def test_custom_tool_translated_both_ways(nursery: trio.Nursery, tmp_path: Path,
                                                upstream: FakeUpstream,
                                                client: httpx.AsyncClient) -> None:
    upstream.agent = True
    served = await start_relay(nursery, with_upstream(upstream), tmp_path)
    body = {"model": "up/m2", "tools": [PATCH], "stream": True,
            "input": 'RELAY-CALL apply_patch {"input": "*** Begin Patch\\n*** End Patch"}'}
    r = await client.post(served.url + RESP, json=body)
    blocks = sse_blocks(r.text)
    tool = posts(upstream)[-1].json["tools"][0]
    assert tool["type"] == "function" and tool["function"]["name"] == "apply_patch"
    done = [d for n, d in blocks if n == "response.custom_tool_call_input.done"]
    assert done and done[0]["input"] == "*** Begin Patch\n*** End Patch"
    call = blocks[-1][1]["response"]["output"][0]
    assert call["type"] == "custom_tool_call"
    r = await client.post(served.url + RESP, json={
        "model": "up/m2", "tools": [PATCH], "previous_response_id": blocks[-1][1][
            "response"]["id"], "input": [{"type": "custom_tool_call_output",
                                          "call_id": call["call_id"], "output": "applied"}]})
    assert r.json()["output"][0]["content"][0]["text"] == "RELAY-DONE applied"
    back = posts(upstream)[-1].json["messages"]
    assert back[1]["tool_calls"][0]["function"] == {
        "name": "apply_patch", "arguments": json.dumps({"input": call["input"]})}


async def test_hosted_tools_and_reasoning_items_are_reported(
        nursery: trio.Nursery, tmp_path: Path, upstream: FakeUpstream,
        client: httpx.AsyncClient) -> None:
    served = await start_relay(nursery, with_upstream(upstream), tmp_path)
    r = await client.post(served.url + RESP, json={
        "model": "up/m1", "tools": [SHELL, {"type": "web_search"}],
        "input": [{"type": "reasoning", "id": "rs", "summary": []},
                  {"role": "user", "content": "hi"}]})
    assert r.status_code == 200, r.text
    assert r.headers["x-relay-ignored-fields"] == "input.reasoning, tools.web_search"
    assert [t["function"]["name"] for t in posts(upstream)[-1].json["tools"]] == ["shell"]
    r = await client.post(served.url + RESP, json={
        "model": "up/m1", "input": "hi", "tools": [{"type": "code_interpreter"}],
        "tool_choice": {"type": "code_interpreter"}})
    err = e1(r, 400, "unsupported")
    assert "code_interpreter" in err["message"] and err["param"] == "tool_choice"
    rec = records(tmp_path)
    assert rec[0]["ignored_fields"] == ["input.reasoning", "tools.web_search"]
    assert rec[1]["reason"] == "unsupported"
    assert len(posts(upstream)) == 1


async def test_errors_before_and_inside_the_stream(nursery: trio.Nursery, tmp_path: Path,
                                                   upstream: FakeUpstream) -> None:
    upstream.scripts["m2"] = Script(status=500)
    upstream.scripts["cut"] = Script(chunks=["Hello", " world"], cut_after=1)
    served = await start_relay(nursery, with_upstream(upstream), tmp_path)
    async with http_client() as http:
        r = await http.post(served.url + RESP, json={"model": "up/m2", "input": "hi",
                                                     "stream": True})
        e1(r, 502, "upstream_error")  # nothing sent yet: a real status, x-should-retry
        c = oai(served, http)
        with pytest.raises(openai.APIStatusError) as err:
            await c.responses.create(model="up/m2", input="hi")
        assert err.value.status_code == 502 and err.value.code == "upstream_error"
        assert err.value.response.headers["x-should-retry"] == "false"
        stream = await c.responses.create(model="up/cut", input="hi", stream=True)
        events = [e async for e in stream]
        assert events[-1].type == "response.failed"
        failed = events[-1].response
        assert failed.status == "failed" and failed.error is not None
        assert failed.error.code == "stream_cut"
        assert failed.output[0].content[0].text == "Hello"  # type: ignore[union-attr]
    await wait_for(lambda: len(records(tmp_path)) == 3)
    assert records(tmp_path)[2]["reason"] == "stream_cut"
    assert served.relay.responses.get(failed.id) is None  # a failed response is not kept


# --- the anthropic adapter ---------------------------------------------------------------

async def test_responses_through_the_anthropic_adapter(
        nursery: trio.Nursery, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake: FakeAnthropic = await nursery.start(serve_fake_anthropic)
    fake.agent = True
    monkeypatch.setenv("FAKE_ANTHROPIC_KEY", ANTHROPIC_KEY)
    served = await start_relay(nursery, f"""
[server]
records = "records.jsonl"
[providers.ant]
adapter = "anthropic"
base_url = "{fake.url}"
api_key_env = "FAKE_ANTHROPIC_KEY"
models = ["claude-x"]
""", tmp_path)
    async with http_client() as http:
        c = oai(served, http)
        events = [e async for e in await c.responses.create(
            model="ant/claude-x", input='RELAY-CALL shell {"cmd": "pwd"}', tools=[SHELL],
            instructions="you are a test", stream=True)]
        final = events[-1].response
        call = next(i for i in final.output if i.type == "function_call")
        assert json.loads(call.arguments) == {"cmd": "pwd"}  # type: ignore[union-attr]
        sent = posts(fake)[-1].json
        assert sent["system"] == [{"type": "text", "text": "you are a test"}]
        assert sent["tools"][0]["name"] == "shell"
        done = await c.responses.create(
            model="ant/claude-x", previous_response_id=final.id, tools=[SHELL],
            input=[{"type": "function_call_output", "call_id": call.call_id,  # type: ignore[union-attr]
                    "output": "/work"}])
        assert done.output_text == "RELAY-DONE /work"
        results = posts(fake)[-1].json["messages"][-1]["content"]
        assert results[0]["type"] == "tool_result"


# --- a provider that speaks Responses itself: passed through ------------------------------

async def passing(nursery: trio.Nursery, tmp_path: Path, chat_url: str = "http://127.0.0.1:9/v1"
                  ) -> tuple[Served, FakeResponses]:
    fake: FakeResponses = await nursery.start(serve_fake_responses)
    served = await start_relay(nursery, f"""
[server]
records = "records.jsonl"
[providers.oa]
adapter = "openai"
base_url = "{fake.url}"
responses = true
models = ["gpt-fake", "gpt-fake-2", "gpt-429"]
{PROFILE}
[providers.chat]
adapter = "openai"
base_url = "{chat_url}"
models = ["m1"]
{PROFILE.replace("oa.", "chat.")}
""", tmp_path)
    return served, fake


async def test_pass_through_plain_and_streamed(nursery: trio.Nursery, tmp_path: Path,
                                               upstream: FakeUpstream) -> None:
    served, fake = await passing(nursery, tmp_path, upstream.url)
    assert served.relay.providers["oa"].adapter.capabilities.responses
    assert not served.relay.providers["chat"].adapter.capabilities.responses
    hosted = {"type": "web_search", "external_web_access": False}
    async with http_client() as http:
        c = oai(served, http)
        first = await c.responses.create(
            model="oa/gpt-fake", input='RELAY-CALL shell {"cmd": "ls"}',
            tools=[SHELL, hosted], include=["reasoning.encrypted_content"])
        sent = posts(fake)[-1]
        assert sent.path == "/v1/responses"
        assert sent.json["tools"][1] == hosted  # the same dialect: passed as sent
        assert sent.json["include"] == ["reasoning.encrypted_content"]
        reasoning, call = first.output
        assert reasoning.type == "reasoning"
        assert reasoning.encrypted_content == "ENCRYPTED-resp_up1"  # type: ignore[union-attr]
        assert first.id.startswith("resp_") and first.id != "resp_up1"  # relay's id
        assert first.model == "oa/gpt-fake"

        kinds, text = [], ""
        stream = await c.responses.create(
            model="oa/gpt-fake", previous_response_id=first.id, tools=[SHELL], stream=True,
            input=[{"type": "function_call_output", "call_id": call.call_id,  # type: ignore[union-attr]
                    "output": "x.txt"}])
        async for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                text += event.delta
            if event.type == "response.completed":
                final = event.response
        assert text == "RELAY-DONE x.txt" == final.output_text
        assert [e for e in kinds if e.endswith("delta")] == [
            "response.output_text.delta"] * 2
        # relay expanded the id: the upstream got the whole conversation, reasoning
        # with its encrypted content included, and no previous_response_id.
        sent = posts(fake)[-1].json
        assert "previous_response_id" not in sent
        assert [i.get("type") for i in sent["input"]] == [
            "message", "reasoning", "function_call", "function_call_output"]
        assert sent["input"][1]["encrypted_content"] == "ENCRYPTED-resp_up1"
        stored = await c.responses.retrieve(final.id)
        assert stored.output_text == "RELAY-DONE x.txt" and stored.id == final.id
        assert stored.previous_response_id == first.id

        # The same conversation to the chat-only provider: translated, reasoning dropped
        # and reported.
        r = await http.post(served.url + RESP, json={
            "model": "chat/m1", "previous_response_id": final.id, "input": "more"})
        assert r.status_code == 200, r.text
        assert r.headers["x-relay-ignored-fields"] == "input.reasoning"
        sent = posts(upstream)[-1].json["messages"]
        assert [m["role"] for m in sent] == ["user", "assistant", "tool", "assistant",
                                             "user"]
        assert "ENCRYPTED" not in json.dumps(sent)
    assert lane_idle(served)


async def test_pass_through_custom_tools_natively_and_errors(nursery: trio.Nursery,
                                                             tmp_path: Path) -> None:
    served, fake = await passing(nursery, tmp_path)
    fake.scripts["gpt-fake-2"] = RScript(text=["Hel", "lo", "!"], failed_after=2)
    fake.scripts["gpt-429"] = RScript(status=429, error={"error": {
        "message": "slow down", "type": "rate_limit_error", "code": "rate_limit_exceeded"}})
    async with http_client() as http:
        events = sse_blocks((await http.post(served.url + RESP, json={
            "model": "oa/gpt-fake", "tools": [PATCH], "stream": True,
            "input": 'RELAY-CALL apply_patch {"input": "PATCH"}'})).text)
        assert posts(fake)[-1].json["tools"] == [PATCH]  # native: not translated
        kinds = [n for n, _ in events]
        assert "response.custom_tool_call_input.delta" in kinds
        assert events[-1][1]["response"]["output"][1]["input"] == "PATCH"
        assert [d["sequence_number"] for _, d in events] == list(range(len(events)))

        r = await http.post(served.url + RESP, json={"model": "oa/gpt-429", "input": "hi"})
        err = e1(r, 429, "rate_limited")
        assert err["relay"]["upstream_message"] and "slow down" in err["message"]

        events = sse_blocks((await http.post(served.url + RESP, json={
            "model": "oa/gpt-fake-2", "input": "hi", "stream": True})).text)
        name, data = events[-1]
        assert name == "response.failed" and data["response"]["error"]["code"] == \
            "upstream_error"
        assert "FAKE-FAILED" in data["response"]["error"]["message"]


def test_responses_setting_defaults_to_the_openai_preset(tmp_path: Path) -> None:
    from helpers.assembled import config_from

    from relay.adapters.http.openai_compat import OpenAIAdapter

    config = config_from("""
[providers.oa]
adapter = "openai"
preset = "openai"
models = ["gpt-5"]
[providers.vl]
adapter = "openai"
preset = "vllm"
models = ["q"]
[providers.vl_on]
adapter = "openai"
preset = "vllm"
responses = true
models = ["q"]
[providers.oa_off]
adapter = "openai"
preset = "openai"
responses = false
models = ["gpt-5"]
""", tmp_path)
    speaks = {name: OpenAIAdapter(p).capabilities.responses
              for name, p in config.providers.items()}
    assert speaks == {"oa": True, "vl": False, "vl_on": True, "oa_off": False}


async def test_a_passed_through_primary_falls_back_to_a_translated_provider(
        nursery: trio.Nursery, tmp_path: Path, upstream: FakeUpstream) -> None:
    served, fake = await passing(nursery, tmp_path, upstream.url)
    fake.scripts["gpt-fake-2"] = RScript(status=500)
    async with http_client() as http:
        c = oai(served, http)
        done = await c.responses.create(model="oa/gpt-fake-2", input="hi",
                                        extra_body={"fallbacks": ["chat/m1"]})
        assert done.output_text == "Hello world" and done.model == "chat/m1"
        assert posts(fake)[-1].path == "/v1/responses"
        assert posts(upstream)[-1].json["messages"] == [{"role": "user", "content": "hi"}]
    rec = records(tmp_path)[-1]
    assert [(a["provider"], a["failure"]) for a in rec["attempts"]] == [
        ("oa", "upstream_error"), ("chat", None)]
    assert rec["fallback_triggered"] is True
