"""A relay assembled from config text, served on loopback port 0, and what the tests read
of it (records, SSE events, lane state); an in-memory ASGI client for virtual time.

Assembled tests go config text → `relay.serve` (the embedding API) → real HTTP on
loopback, with fake upstream servers (`fakes/upstream.py`) behind the ``openai`` adapter.
The fixtures (`upstream`, `client`, a state folder per test) are `tests/conftest.py`'s.
"""

from __future__ import annotations

import functools
import json
import textwrap
from pathlib import Path
from typing import Any

import trio
from fakes.upstream import FakeUpstream

import relay
from relay import Served, parse_config


def config_from(text: str, tmp_path: Path, **kw: Any) -> relay.Config:
    return parse_config(textwrap.dedent(text), source="test.toml", base_dir=tmp_path, **kw)


async def start_relay(nursery: trio.Nursery, text: str, tmp_path: Path) -> Served:
    config = config_from(text, tmp_path)
    served: Served = await nursery.start(functools.partial(relay.serve, config, port=0))
    return served


def records(tmp_path: Path, name: str = "records.jsonl") -> list[dict[str, Any]]:
    path = tmp_path / name
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def chat(model: str, content: str = "hello", **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": content}], **extra}


def sse_events(text: str) -> list[Any]:
    """The `data:` payloads of an SSE body, JSON-decoded ("[DONE]" kept as a string)."""
    out: list[Any] = []
    for block in text.split("\n\n"):
        for line in block.splitlines():
            if line.startswith("data: "):
                data = line[6:]
                out.append(data if data == "[DONE]" else json.loads(data))
    return out


async def wait_for(predicate: Any, *, limit_s: float = 5.0, step: float = 0.005) -> None:
    """Wait (bounded) for a condition that no event announces, checking it every step."""
    with trio.fail_after(limit_s):
        while not predicate():
            await trio.sleep(step)


def lane_idle(served: Served) -> bool:
    return all(p.lane.statistics().running == 0 and p.lane.statistics().queued == 0
               for p in served.relay.providers.values())


FAKE_ONLY = """
[server]
records = "records.jsonl"
[providers.fake]
adapter = "fake"
models = ["echo"]
"""


def with_upstream(up: FakeUpstream, profile: str = "", extra: str = "") -> str:
    """A config with the fake provider and an ``up`` provider at the fake upstream."""
    return FAKE_ONLY + f"""
[providers.up]
adapter = "openai"
base_url = "{up.url}"
models = ["m1", "m2", "slow", "stall", "cut", "big", "Qwen/Qwen3-8B"]
{extra}
[providers.up.profile]
lanes = 1
queue_max = 4
queue_timeout_s = 10
run_timeout_s = 20
{profile}
"""


# --- an in-memory ASGI client, for the request path on virtual time ----------------------

class ASGIResult:
    """What one in-memory request got, with the (virtual) time of every body piece."""

    def __init__(self) -> None:
        self.status: int | None = None
        self.status_at: float | None = None
        self.headers: dict[str, str] = {}
        self.pieces: list[tuple[float, bytes]] = []
        self.complete = trio.Event()  # the last body piece was sent
        self.done = trio.Event()      # the app has returned
        self.disconnect = trio.Event()  # set it to make the client leave

    @property
    def body(self) -> bytes:
        return b"".join(p for _, p in self.pieces)

    def json(self) -> Any:
        return json.loads(self.body)

    def text(self) -> str:
        return self.body.decode()


async def asgi_request(app: Any, path: str, body: Any, result: ASGIResult, *,
                       method: str = "POST", headers: dict[str, str] | None = None) -> None:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    hdrs = [(b"host", b"127.0.0.1:8765"), (b"content-type", b"application/json"),
            (b"content-length", str(len(raw)).encode())]
    hdrs += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": method, "scheme": "http", "path": path, "raw_path": path.encode(),
             "query_string": b"", "root_path": "", "headers": hdrs,
             "client": ("127.0.0.1", 5555), "server": ("127.0.0.1", 8765)}
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": raw, "more_body": False}
        with trio.CancelScope() as scope_:
            async def either(ev: trio.Event) -> None:
                await ev.wait()
                scope_.cancel()
            async with trio.open_nursery() as n:
                n.start_soon(either, result.disconnect)
                n.start_soon(either, result.complete)
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if result.disconnect.is_set():
            raise OSError("client gone")
        if message["type"] == "http.response.start":
            result.status = message["status"]
            result.status_at = trio.current_time()
            result.headers = {k.decode(): v.decode() for k, v in message["headers"]}
        elif message["type"] == "http.response.body":
            if message.get("body"):
                result.pieces.append((trio.current_time(), message["body"]))
            if not message.get("more_body"):
                result.complete.set()

    try:
        await app(scope, receive, send)
    finally:
        result.complete.set()
        result.done.set()
