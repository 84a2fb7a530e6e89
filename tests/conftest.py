"""Shared test helpers: a relay assembled from config text, served on loopback port 0.

Assembled tests go config text → `relay.serve` (the embedding API) → real HTTP on
loopback, with fake upstream servers (`upstream.py`) behind the ``openai`` adapter.
"""

from __future__ import annotations

import functools
import json
import textwrap
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from upstream import FakeUpstream, serve_fake_upstream

import relay
import relay.front.routes  # (see below)
from relay import Served, parse_config

# Quart's routes are imported once for the whole session, not by a relay's first Quart
# route (which imports them in a worker thread, and virtual time runs on while a thread
# works: a test on `autojump_clock` would see seconds pass). tests/test_paths.py checks
# the import-at-first-route path in a clean interpreter.


@pytest.fixture(autouse=True)
def _state_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Default record locations resolve under the test's own folder, never ~/.local/state.
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy"):
        monkeypatch.delenv(var, raising=False)


def config_from(text: str, tmp_path: Path, **kw: Any) -> relay.Config:
    return parse_config(textwrap.dedent(text), source="test.toml", base_dir=tmp_path, **kw)


async def start_relay(nursery: trio.Nursery, text: str, tmp_path: Path) -> Served:
    config = config_from(text, tmp_path)
    served: Served = await nursery.start(functools.partial(relay.serve, config, port=0))
    return served


@pytest.fixture
async def upstream(nursery: trio.Nursery) -> FakeUpstream:
    up: FakeUpstream = await nursery.start(serve_fake_upstream)
    return up


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(trust_env=False, timeout=httpx.Timeout(30.0)) as c:
        yield c


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


# --- skips: their reasons shown, and failures in CI ---------------------------------------

def _trio_skip(call: Any) -> BaseException | None:
    """The skip a trio test raised, when pytest-trio re-raised it without its reason.

    pytest-trio 0.8 runs the test inside ``trio.run``, finds the `Skipped` in the
    exception group trio wraps it in, and calls ``pytest.skip()`` with no message, so the
    summary read ``SKIPPED [20] …/_pytest/python.py:187: Skipped``. The original is that
    bare skip's ``__context__`` (the group): its one leaf carries the reason and the line.
    """
    excinfo = call.excinfo
    if excinfo is None or not isinstance(excinfo.value, pytest.skip.Exception):
        return None
    group = excinfo.value.__context__
    leaves: list[BaseException] = []
    todo = [group] if isinstance(group, BaseExceptionGroup) else []
    while todo:
        exc = todo.pop()
        if isinstance(exc, BaseExceptionGroup):
            todo += exc.exceptions
        else:
            leaves.append(exc)
    if len(leaves) == 1 and isinstance(leaves[0], pytest.skip.Exception):
        return leaves[0]
    return None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: Any) -> Any:
    """Every skip shows its own reason and line in the summary (`_trio_skip`); with
    RELAY_STRICT_SKIPS=1 (set by .ci/run) a skipped test fails: CI installs every outside
    tool a test needs, so a skip there means something is missing."""
    import os

    outcome = yield
    report = outcome.get_result()
    original = _trio_skip(call) if report.skipped else None
    if original is not None and isinstance(report.longrepr, tuple):
        path, line, _ = report.longrepr
        # Where the test (or its fixture) called pytest.skip: the innermost frame that
        # pytest would show, i.e. not one that hides itself from tracebacks.
        info = pytest.ExceptionInfo.from_exception(original)
        frames = [entry for entry in info.traceback
                  if not entry.frame.f_locals.get("__tracebackhide__")
                  and not entry.frame.f_globals.get("__tracebackhide__")]
        if frames:
            path, line = str(frames[-1].path), frames[-1].lineno + 1
        report.longrepr = (path, line, f"Skipped: {original.msg}")
    if report.skipped and os.environ.get("RELAY_STRICT_SKIPS") == "1" and not hasattr(
            report, "wasxfail"):
        report.outcome = "failed"
        report.longrepr = f"skipped, and skips are failures in CI: {report.longrepr}"
