"""Helpers the cloud-API tests share (test_anthropic, test_gemini, test_messages_api)."""

from __future__ import annotations

import json
import ssl
from pathlib import Path
from typing import Any

import httpx
import trio
from fakes.fake_http import FakeServer

from helpers.assembled import records, wait_for
from helpers.cli_procs import FAKE_CLI
from relay.vocab.errors import REASONS

BOUND_S = 0.5  # a stop must close the upstream connection within this
# One TLS context for every client: building one per client costs ~30 ms.
TLS = ssl.create_default_context()


def http_client() -> httpx.AsyncClient:
    return httpx.AsyncClient(trust_env=False, verify=TLS, timeout=httpx.Timeout(30.0))


def posts(server: FakeServer) -> list[Any]:
    """The POST requests the fake got (model discovery's GETs left out)."""
    return [r for r in server.requests if r.method == "POST"]


def e1(r: httpx.Response, status: int, reason: str) -> dict[str, Any]:
    """Assert an OpenAI-shaped E1 answer with a real status; return its error object."""
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == reason, err
    assert err["type"] == REASONS[reason].type
    assert err["relay"]["reason"] == reason
    assert err["relay"]["phase"] == REASONS[reason].phase
    assert r.headers["x-should-retry"] == ("true" if REASONS[reason].should_retry
                                           else "false")
    return err  # type: ignore[no-any-return]


def sse_blocks(text: str) -> list[tuple[str | None, Any]]:
    """``(event name, JSON data)`` of every event in an SSE body (comments skipped)."""
    out: list[tuple[str | None, Any]] = []
    for block in text.replace("\r\n", "\n").split("\n\n"):
        name, data = None, []
        for line in block.splitlines():
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].strip())
        if data:
            joined = "\n".join(data)
            out.append((name, joined if joined == "[DONE]" else json.loads(joined)))
    return out


def content_of(events: list[Any]) -> str:
    return "".join(e["choices"][0]["delta"].get("content") or "" for e in events
                   if isinstance(e, dict) and e.get("choices"))


def finishes(events: list[Any]) -> list[str]:
    return [e["choices"][0]["finish_reason"] for e in events
            if isinstance(e, dict) and e.get("choices") and e["choices"][0]["finish_reason"]]


def tool_calls_of(events: list[Any]) -> dict[int, dict[str, Any]]:
    """OpenAI stream chunks' tool-call deltas, assembled by index."""
    calls: dict[int, dict[str, Any]] = {}
    for e in events:
        if not isinstance(e, dict) or not e.get("choices"):
            continue
        for call in e["choices"][0]["delta"].get("tool_calls") or ():
            slot = calls.setdefault(call["index"], {"id": None, "name": "", "arguments": ""})
            slot["id"] = call.get("id") or slot["id"]
            slot["name"] += (call.get("function") or {}).get("name") or ""
            slot["arguments"] += (call.get("function") or {}).get("arguments") or ""
    return calls


async def one_record(tmp_path: Path, n: int = 1) -> dict[str, Any]:
    await wait_for(lambda: len(records(tmp_path)) >= n)
    return records(tmp_path)[n - 1]


async def raw_post(url: str, path: str, body: dict[str, Any]) -> trio.SocketStream:
    """A request on a raw socket, so the test decides exactly when the client leaves."""
    host, _, port = url.removeprefix("http://").partition(":")
    stream = await trio.open_tcp_stream(host, int(port))
    data = json.dumps(body).encode()
    await stream.send_all(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: "
                          f"application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode()
                          + data)
    return stream


async def stop_closes_upstream(server: FakeServer, stream: trio.SocketStream) -> float:
    """Leave (close the client socket) and measure how long until the fake sees the
    upstream connection of the last request closed. Asserts it is under `BOUND_S`."""
    conn = server.connections[posts(server)[-1].conn_id]
    assert conn.closed_at is None
    await stream.aclose()
    stopped = trio.current_time()
    with trio.fail_after(5):
        await server.wait_until(lambda: conn.closed_at is not None)
    assert conn.closed_by == "peer"
    assert conn.closed_at is not None
    latency = conn.closed_at - stopped
    assert latency < BOUND_S, f"upstream closed {latency * 1000:.1f} ms after the stop"
    return latency


def every_kind_config(up_url: str, ant_url: str, gem_url: str, cli_log: Path, *,
                      up_models: tuple[str, ...] = ("m1",), extra: str = "") -> str:
    """A config with a provider of every adapter kind: the fake, ``up`` (openai), ``ant``
    (anthropic), ``gem`` (gemini) at the given fake servers, and the three fake CLI tools
    (logging what they are sent to ``cli_log``)."""
    models = ", ".join(f'"{m}"' for m in up_models)
    text = f"""
[server]
records = "records.jsonl"
[providers.fake]
adapter = "fake"
[providers.up]
adapter = "openai"
base_url = "{up_url}"
models = [{models}]
[providers.up.profile]
lanes = 4
queue_max = 8
queue_timeout_s = 10
run_timeout_s = 20
[providers.ant]
adapter = "anthropic"
base_url = "{ant_url}"
api_key_env = "RELAY_TEST_ANTHROPIC_KEY"
models = ["claude-x"]
[providers.ant.profile]
rpm = 0
[providers.gem]
adapter = "gemini"
base_url = "{gem_url}"
api_key_env = "RELAY_TEST_GEMINI_KEY"
models = ["g"]
[providers.gem.profile]
rpm = 0
"""
    for tool in ("claude", "codex", "gemini"):
        text += f"""
[providers.{tool}]
adapter = "{tool}-cli"
command = "{FAKE_CLI / tool}"
env = {{ FAKE_CLI_LOG = "{cli_log}" }}
"""
    return text + extra
