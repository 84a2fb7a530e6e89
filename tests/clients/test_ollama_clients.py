"""Ollama's own clients against relay's Ollama front (SPEC A10): ``ollama-python`` (the
PyPI ``ollama`` package) and ``ollama-js`` (the npm ``ollama`` package, run by node as a
subprocess) — list, show, chat (plain, streamed, with tools and a tool round trip, with
``format``), generate and embed — on the fake provider and on an OpenAI-compatible
upstream (tests/fakes/upstream.py; embeddings from tests/fakes/fake_endpoints.py), on
relay's main port and on ``[server] ollama_port``.

ollama-python's client is synchronous here, in a worker thread: its async client runs on
asyncio. ollama-js is installed by .ci/install-clis.sh (globally, as the CLIs are); without
node or the package the JS tests skip, saying how to install it.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import socket
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import ollama
import pytest
import trio
from fakes.fake_endpoints import FakeEmbeddings, serve_fake_embeddings, vector_for
from fakes.upstream import FakeUpstream, Script, serve_fake_upstream
from helpers.assembled import lane_idle, records, start_relay, wait_for

OLLAMA_JS = "0.6.4"  # the pin in .ci/install-clis.sh
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def config(up: FakeUpstream, emb: FakeEmbeddings, ollama_port: int) -> str:
    return f"""
[server]
records = "records.jsonl"
ollama_port = {ollama_port}
[providers.fake]
adapter = "fake"
models = ["echo"]
[providers.up]
adapter = "openai"
base_url = "{up.url}"
models = ["m1"]
[providers.up.profile]
lanes = 2
queue_max = 4
queue_timeout_s = 10
run_timeout_s = 20
[providers.emb]
adapter = "openai"
base_url = "{emb.url}"
models = ["e1"]
[providers.emb.profile]
lanes = 2
queue_max = 4
queue_timeout_s = 10
run_timeout_s = 20
[routes.helper]
primary = "up/m1"
"""


def _weather_agent(body: Any) -> Script | None:
    """The upstream's model: asked with tools, it calls get_weather; given the tool's
    result, it answers with it."""
    messages = body.get("messages") or []
    if body.get("response_format"):
        return Script(chunks=['{"a": ', '1}'])
    if messages and messages[-1].get("role") == "tool":
        return Script(chunks=["It is ", messages[-1]["content"]])
    if body.get("tools"):
        return Script(chunks=[], tool_calls=[{"id": "call_w1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}])
    return None


@pytest.fixture
async def stage(nursery: trio.Nursery, tmp_path: Path) -> Any:
    up: FakeUpstream = await nursery.start(serve_fake_upstream)
    up.decide = _weather_agent
    emb: FakeEmbeddings = await nursery.start(serve_fake_embeddings)
    served = await start_relay(nursery, config(up, emb, free_port()), tmp_path)
    assert served.ollama_url is not None
    return served, up


def host_of(stage: Any, where: str) -> str:
    served, _ = stage
    return str(served.ollama_url if where == "ollama_port" else served.url)


@pytest.fixture
def clients() -> Iterator[Callable[[str], ollama.Client]]:
    """ollama-python clients, closed after the test."""
    made: list[ollama.Client] = []

    def make(host: str) -> ollama.Client:
        made.append(ollama.Client(host=host))
        return made[-1]
    yield make
    for client in made:
        client.close()


async def in_thread(fn: Any, *args: Any, **kw: Any) -> Any:
    return await trio.to_thread.run_sync(functools.partial(fn, *args, **kw))


WHERE = pytest.mark.parametrize("where", ["main", "ollama_port"])


@WHERE
async def test_list_show_and_version(stage: Any, clients: Any, where: str) -> None:
    client = clients(host_of(stage, where))
    listed = await in_thread(client.list)
    assert [m.model for m in listed.models] == ["helper", "fake/echo", "up/m1", "emb/e1"]
    assert listed.models[1].details.family == "fake"
    shown = await in_thread(client.show, "up/m1:latest")  # clients append :latest
    assert shown.capabilities == ["completion", "tools", "vision", "embedding", "thinking"]
    assert shown.modelinfo["relay.context_length"] > 0
    fake = await in_thread(client.show, "fake/echo")
    assert fake.capabilities == ["completion"]
    route = await in_thread(client.show, "helper")
    assert "tools" in route.capabilities  # a route: its primary's provider
    with pytest.raises(ollama.ResponseError) as missing:
        await in_thread(client.show, "nope/x")
    assert missing.value.status_code == 404
    assert "unknown_model" in missing.value.error


@WHERE
@pytest.mark.parametrize("model", ["fake/echo", "up/m1"])
async def test_chat_plain_streamed_and_generate(stage: Any, clients: Any, where: str,
                                                model: str,
                                                tmp_path: Path) -> None:
    client = clients(host_of(stage, where))
    expected = "say this back" if model == "fake/echo" else "Hello world"
    said = [{"role": "user", "content": "say this back"}]
    got = await in_thread(client.chat, model=model + ":latest", messages=said)
    assert got.message.content == expected
    assert (got.done, got.done_reason) == (True, "stop")
    assert got.prompt_eval_count > 0 and got.eval_count > 0
    assert got.total_duration >= got.eval_duration > 0

    def streamed() -> list[Any]:
        return list(client.chat(model=model, messages=said, stream=True))
    parts = await in_thread(streamed)
    assert "".join(p.message.content for p in parts) == expected
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    assert parts[-1].done_reason == "stop" and parts[-1].eval_count > 0
    generated = await in_thread(client.generate, model=model, prompt="say this back",
                                system="be brief")
    assert generated.response == expected and generated.done
    await wait_for(lambda: len(records(tmp_path)) == 3)
    assert {r["endpoint"] for r in records(tmp_path)} == {"/api/chat", "/api/generate"}
    assert all(r["status"] == 200 and r["model"] == model.partition("/")[2]
               for r in records(tmp_path))


@WHERE
@pytest.mark.parametrize("stream", [False, True])
async def test_tools_and_a_tool_round_trip(stage: Any, clients: Any, where: str,
                                           stream: bool) -> None:
    _, up = stage
    client = clients(host_of(stage, where))
    messages: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]

    def ask() -> Any:
        answer = client.chat(model="up/m1", messages=messages, tools=[WEATHER],
                             stream=stream)
        if not stream:
            return answer.message
        parts = list(answer)
        calls = [c for p in parts for c in (p.message.tool_calls or ())]
        return ollama.Message(role="assistant", tool_calls=calls,
                              content="".join(p.message.content for p in parts))
    first = await in_thread(ask)
    assert len(first.tool_calls) == 1
    call = first.tool_calls[0].function
    assert (call.name, call.arguments) == ("get_weather", {"city": "Paris"})  # an object
    messages += [first, {"role": "tool", "content": "sunny", "tool_name": "get_weather"}]
    second = await in_thread(ask)
    assert second.content == "It is sunny"
    sent = up.requests[-1].json
    assert sent["tools"][0]["function"]["name"] == "get_weather"
    assistant, tool = sent["messages"][1], sent["messages"][2]
    assert json.loads(assistant["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}
    assert tool == {"role": "tool", "content": "sunny",
                    "tool_call_id": assistant["tool_calls"][0]["id"]}


@WHERE
async def test_format_json_and_schema(stage: Any, clients: Any, where: str) -> None:
    _, up = stage
    client = clients(host_of(stage, where))
    said = [{"role": "user", "content": "json please"}]
    got = await in_thread(client.chat, model="up/m1", messages=said, format="json")
    assert json.loads(got.message.content) == {"a": 1}
    assert up.requests[-1].json["response_format"] == {"type": "json_object"}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    await in_thread(client.chat, model="up/m1", messages=said, format=schema)
    assert up.requests[-1].json["response_format"] == {
        "type": "json_schema", "json_schema": {"name": "output", "schema": schema}}
    # The fake cannot answer in JSON: refused, naming the client's field (SPEC A1a).
    with pytest.raises(ollama.ResponseError) as refused:
        await in_thread(client.chat, model="fake/echo", messages=said, format="json")
    assert refused.value.status_code == 400
    assert "unsupported" in refused.value.error and "'format'" in refused.value.error


@WHERE
async def test_embed_and_the_older_embeddings(stage: Any, clients: Any, where: str, tmp_path: Path
                                              ) -> None:
    client = clients(host_of(stage, where))
    got = await in_thread(client.embed, model="emb/e1:latest", input=["one", "two"])
    assert [list(v) for v in got.embeddings] == [vector_for("one"), vector_for("two")]
    old = await in_thread(client.embeddings, model="emb/e1", prompt="three")
    assert list(old.embedding) == vector_for("three")
    with pytest.raises(ollama.ResponseError) as refused:
        await in_thread(client.embed, model="fake/echo", input="x")
    assert refused.value.status_code == 400 and "makes no embeddings" in refused.value.error
    await wait_for(lambda: len(records(tmp_path)) == 3)
    assert [r["endpoint"] for r in records(tmp_path)] == [
        "/api/embed", "/api/embeddings", "/api/embed"]


async def test_a_failure_mid_stream_is_an_error_line_the_client_raises(
        stage: Any, clients: Any, tmp_path: Path) -> None:
    served, _ = stage
    client = clients(served.url)
    seen: list[str] = []

    def consume() -> None:
        for part in client.chat(model="fake/echo?chunks=4&fail=upstream_error&fail_after=2",
                                messages=[{"role": "user", "content": "x"}], stream=True):
            seen.append(part.message.content)
    with pytest.raises(ollama.ResponseError) as failed:
        await in_thread(consume)
    assert "upstream_error" in failed.value.error
    assert "".join(seen) == "t0 t1 "  # what came before the failure, and no done line
    await wait_for(lambda: len(records(tmp_path)) == 1)
    assert records(tmp_path)[0]["reason"] == "upstream_error"
    assert lane_idle(served)


async def test_calls_that_manage_weights_are_refused_clearly(stage: Any, clients: Any
                                                            ) -> None:
    served, _ = stage
    client = clients(served.url)
    for call in (functools.partial(client.pull, "llama3"),
                 functools.partial(client.delete, "fake/echo"),
                 functools.partial(client.copy, "fake/echo", "other")):
        with pytest.raises(ollama.ResponseError) as refused:
            await in_thread(call)
        assert refused.value.status_code == 400
        assert "does not store models" in refused.value.error


# --- ollama-js ----------------------------------------------------------------------------

JS = r"""
const { Ollama } = require('ollama');
const weather = JSON.parse(process.argv[3]);
(async () => {
  const o = new Ollama({ host: process.argv[2] });
  const out = {};
  out.version = (await o.version()).version;
  out.list = (await o.list()).models.map((m) => m.name);
  out.show = (await o.show({ model: 'up/m1' })).capabilities;
  const said = [{ role: 'user', content: 'say this back' }];
  out.plain = (await o.chat({ model: 'fake/echo', messages: said })).message.content;
  let text = '';
  let last = null;
  for await (const part of await o.chat({ model: 'up/m1', messages: said, stream: true })) {
    text += part.message.content;
    last = part;
  }
  out.streamed = [text, last.done, last.done_reason];
  const messages = [{ role: 'user', content: 'Weather in Paris?' }];
  const first = (await o.chat({ model: 'up/m1', messages, tools: [weather] })).message;
  out.call = first.tool_calls[0].function;
  messages.push(first, { role: 'tool', content: 'sunny', tool_name: 'get_weather' });
  out.round = (await o.chat({ model: 'up/m1', messages, tools: [weather] })).message.content;
  out.format = (await o.chat({ model: 'up/m1', messages: said, format: 'json' })).message.content;
  out.generate = (await o.generate({ model: 'fake/echo', prompt: 'gen this' })).response;
  out.embed = (await o.embed({ model: 'emb/e1', input: 'one' })).embeddings[0].length;
  try {
    await o.chat({ model: 'nope', messages: said });
  } catch (e) {
    out.error = [e.status_code, e.error];
  }
  console.log(JSON.stringify(out));
})().catch((e) => { console.error(e); process.exit(1); });
"""


def _ollama_js() -> str:
    """NODE_PATH holding the npm package ``ollama`` at its pin, or skip saying how."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip("node and npm are not installed (apt-get install nodejs npm; "
                    ".ci/install-clis.sh installs ollama-js)")
    root = subprocess.run(["npm", "root", "-g"], capture_output=True, text=True,
                          timeout=60, check=False).stdout.strip()
    package = Path(root) / "ollama" / "package.json"
    have = json.loads(package.read_text()).get("version") if package.exists() else None
    if have != OLLAMA_JS:
        pytest.skip(f"ollama-js {OLLAMA_JS} is not installed globally (found {have}): "
                    f"npm install -g ollama@{OLLAMA_JS}, or run .ci/install-clis.sh")
    return root


@WHERE
async def test_ollama_js(stage: Any, where: str, tmp_path: Path) -> None:
    root = _ollama_js()
    script = tmp_path / "drive.cjs"
    script.write_text(JS)
    env = {**os.environ, "NODE_PATH": root}
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy"):
        env.pop(var, None)
    with trio.fail_after(60):
        done = await trio.run_process(["node", str(script), host_of(stage, where),
                                       json.dumps(WEATHER)], env=env, capture_stdout=True,
                                      capture_stderr=True, check=False)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    out = json.loads(done.stdout)
    version = tuple(int(n) for n in out["version"].split("."))
    assert version >= (0, 6, 4)  # what VS Code's Ollama provider gates on
    assert out["list"] == ["helper", "fake/echo", "up/m1", "emb/e1"]
    assert "tools" in out["show"]
    assert out["plain"] == "say this back"
    assert out["streamed"] == ["Hello world", True, "stop"]
    assert out["call"] == {"index": 0, "name": "get_weather", "arguments": {"city": "Paris"}}
    assert out["round"] == "It is sunny"
    assert json.loads(out["format"]) == {"a": 1}
    assert out["generate"] == "gen this"
    assert out["embed"] == len(vector_for("one"))
    assert out["error"][0] == 404 and "unknown_model" in out["error"][1]
