"""Hostile and careless clients at the front, through the assembled relay (SPEC O4, O5, A1).

- Connections are closed on every route, raw or Quart: on ``Connection: close``, for
  HTTP/1.0, and after the keep-alive idle timeout; a client that reuses its connection
  keeps it. 1,100 pollers that stay connected do not use up relay's file limit.
- Numbers that JSON cannot carry (``1e999``, ``NaN``, ``-Infinity``) and nesting deeper
  than `MAX_JSON_DEPTH` are a 400 at the front, before any provider is called.
- ``/relay/v1/requests?limit=`` takes ASCII digits only.
- The Host header is ``name[:digits]``, nothing else.
"""

from __future__ import annotations

import functools
import json
import os
import re
import resource
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import h2.config
import h2.connection
import httpx
import pytest
import trio
from fakes.fake_anthropic import KEY as ANTHROPIC_KEY
from fakes.fake_anthropic import FakeAnthropic, serve_fake_anthropic
from fakes.fake_gemini import KEY as GEMINI_KEY
from fakes.fake_gemini import FakeGemini, serve_fake_gemini
from fakes.upstream import FakeUpstream
from helpers.assembled import FAKE_ONLY, chat, config_from, lane_idle, start_relay, wait_for
from helpers.cloud_helpers import http_client, posts

import relay
from relay import Served
from relay.assembly.server import KEEP_ALIVE_TIMEOUT_S
from relay.dialects.openai_chat import MAX_JSON_DEPTH
from relay.vocab.errors import REASONS

ROOT = Path(__file__).resolve().parents[2]
CHAT = "/v1/chat/completions"
MESSAGES = "/v1/messages"
FANOUT = "/relay/v1/fanout"


def port_of(served: Served) -> int:
    return int(served.url.rpartition(":")[2])


# --- a raw HTTP/1 client: the test decides every byte and sees when the server closes ------

def request(method: str, path: str, *, version: str = "1.1", host: str = "127.0.0.1",
            headers: dict[str, str] | None = None, body: bytes = b"") -> bytes:
    lines = [f"{method} {path} HTTP/{version}", f"Host: {host}"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    if body or method == "POST":
        lines += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


class Conn:
    """One client connection; `response` reads exactly one answer off it."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.buffer = b""

    @classmethod
    async def open(cls, port: int) -> Conn:
        return cls(await trio.open_tcp_stream("127.0.0.1", port))

    async def response(self, data: bytes) -> tuple[int, dict[str, str], bytes]:
        await self.stream.send_all(data)
        while b"\r\n\r\n" not in self.buffer:
            await self._more()
        head, _, self.buffer = self.buffer.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip()
                   for k, _, v in (line.partition(":") for line in lines[1:])}
        if "content-length" in headers:
            size = int(headers["content-length"])
            while len(self.buffer) < size:
                await self._more()
            body, self.buffer = self.buffer[:size], self.buffer[size:]
        else:  # chunked (SSE): read to the last chunk
            while b"0\r\n\r\n" not in self.buffer:
                await self._more()
            body, _, self.buffer = self.buffer.partition(b"0\r\n\r\n")
        return int(lines[0].split()[1]), headers, body

    async def _more(self) -> None:
        chunk = await self.stream.receive_some(65536)
        assert chunk, f"the server closed before a whole answer: {self.buffer[:200]!r}"
        self.buffer += chunk

    async def closed_within(self, seconds: float) -> bool:
        """Whether the server closes this connection (EOF) within ``seconds``."""
        with trio.move_on_after(seconds):
            while True:
                try:
                    chunk = await self.stream.receive_some(65536)
                except trio.BrokenResourceError:  # a reset is a close too
                    return True
                if not chunk:
                    return True
                self.buffer += chunk
        return False

    async def aclose(self) -> None:
        await self.stream.aclose()

    async def __aenter__(self) -> Conn:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stream.aclose()


def chat_body(model: str = "fake/echo") -> bytes:
    return json.dumps(chat(model)).encode()


# Every kind of answer relay gives: Quart routes (and their 404/405), and the raw routes.
ROUTES = {
    "healthz": ("GET", "/healthz", b""),
    "status": ("GET", "/relay/v1/status", b""),
    "models": ("GET", "/v1/models", b""),
    "metrics": ("GET", "/metrics", b""),
    "requests": ("GET", "/relay/v1/requests?limit=3", b""),
    "page": ("GET", "/", b""),
    "404": ("GET", "/nope", b""),
    "405": ("POST", "/healthz", b"{}"),
    "check": ("POST", "/relay/v1/providers/fake/check", b""),
    "chat": ("POST", CHAT, chat_body()),
    "refused": ("GET", CHAT, b""),  # the guard's own 405
}


@pytest.mark.parametrize("route", list(ROUTES))
async def test_connection_close_is_honoured_on_every_route(
        nursery: trio.Nursery, tmp_path: Path, route: str) -> None:
    served = await start_relay(nursery, FAKE_ONLY, tmp_path)
    method, path, body = ROUTES[route]
    async with await Conn.open(port_of(served)) as conn:
        with trio.fail_after(10):
            status, _, _ = await conn.response(request(
                method, path, headers={"Connection": "close"}, body=body))
        assert status < 500, status
        assert await conn.closed_within(2.0), f"{route}: still open after Connection: close"


@pytest.mark.parametrize("route", list(ROUTES))
async def test_http_1_0_connections_are_closed_on_every_route(
        nursery: trio.Nursery, tmp_path: Path, route: str) -> None:
    served = await start_relay(nursery, FAKE_ONLY, tmp_path)
    method, path, body = ROUTES[route]
    async with await Conn.open(port_of(served)) as conn:
        with trio.fail_after(10):
            status, _, _ = await conn.response(request(method, path, version="1.0", body=body))
        assert status < 500, status
        assert await conn.closed_within(2.0), f"{route}: an HTTP/1.0 connection stayed open"


async def test_idle_keep_alive_connections_are_closed_on_every_route(
        nursery: trio.Nursery, tmp_path: Path) -> None:
    served = await start_relay(nursery, FAKE_ONLY, tmp_path)
    closed_after: dict[str, float | None] = {}

    async def one(route: str) -> None:
        method, path, body = ROUTES[route]
        async with await Conn.open(port_of(served)) as conn:
            with trio.fail_after(10):
                status, _, _ = await conn.response(request(method, path, body=body))
            assert status < 500, (route, status)
            answered = trio.current_time()
            closed = await conn.closed_within(KEEP_ALIVE_TIMEOUT_S + 5)
            closed_after[route] = trio.current_time() - answered if closed else None

    async with trio.open_nursery() as clients:  # all at once: one idle timeout in all
        for route in ROUTES:
            clients.start_soon(one, route)
    for route, after in closed_after.items():
        assert after is not None, f"{route}: an idle keep-alive connection was never closed"
        assert KEEP_ALIVE_TIMEOUT_S - 0.5 < after < KEEP_ALIVE_TIMEOUT_S + 2, (route, after)


async def test_a_draining_relay_closes_idle_connections_at_once_and_busy_ones_after(
        nursery: trio.Nursery, tmp_path: Path) -> None:
    # The keep-alive deadline is the connection reader's own (no timer task): a drain
    # must still reach a connection that waits idle for its next request, at once, and
    # let a busy one finish its answer before it closes.
    shutdown = trio.Event()
    config = config_from(FAKE_ONLY.replace("[server]\n", "[server]\ndrain_grace_s = 5\n"),
                         tmp_path)
    served: Served = await nursery.start(functools.partial(
        relay.serve, config, port=0, shutdown=shutdown))
    method, path, body = ROUTES["chat"]
    async with await Conn.open(port_of(served)) as idle, \
            await Conn.open(port_of(served)) as busy:
        with trio.fail_after(10):
            status, _, _ = await idle.response(request(method, path, body=body))
        assert status == 200
        slow = json.dumps(chat("fake/echo?delay_s=3")).encode()  # the drain waits for it
        await busy.stream.send_all(request("POST", "/v1/chat/completions", body=slow))
        await wait_for(lambda: served.relay.providers["fake"].lane.statistics().running)
        shutdown.set()
        assert await idle.closed_within(1.0), "an idle connection outlived the drain"
        with trio.fail_after(10):
            status, _, answer = await busy.response(b"")
        assert status == 200 and json.loads(answer)["choices"], answer
        assert await busy.closed_within(2.0), "a busy connection stayed open after its answer"


async def test_an_http2_connection_that_opens_no_stream_is_closed_as_idle(
        nursery: trio.Nursery, tmp_path: Path) -> None:
    # HTTP/2 by prior knowledge: h11 takes the preface for a request (busy), and hypercorn
    # says idle again only as a stream closes. One that never opens a stream held its file
    # descriptor until relay stopped (a way past the file limit, as the pollers below).
    served = await start_relay(nursery, FAKE_ONLY, tmp_path)
    h2c = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    h2c.initiate_connection()
    async with await Conn.open(port_of(served)) as conn:
        await conn.stream.send_all(h2c.data_to_send())
        opened = trio.current_time()
        assert await conn.closed_within(KEEP_ALIVE_TIMEOUT_S + 5), "an idle h2c stayed open"
        after = trio.current_time() - opened
    assert KEEP_ALIVE_TIMEOUT_S - 0.5 < after < KEEP_ALIVE_TIMEOUT_S + 2, after


def connection_tasks() -> int:
    """The connection handlers running in this trio run (trio.serve_listeners' tasks)."""
    count, tasks = 0, [trio.lowlevel.current_root_task()]
    while tasks:
        task = tasks.pop()
        count += task.name.endswith("._run_handler")
        tasks += [child for nursery in task.child_nurseries for child in nursery.child_tasks]
    return count


@pytest.mark.parametrize("route", list(ROUTES))
async def test_a_connection_the_client_closes_at_once_ends_on_the_server_too(
        nursery: trio.Nursery, tmp_path: Path, route: str) -> None:
    # Regression: a client that closed as soon as it had its answer (while its request
    # was still finishing) left the connection's tasks running until relay stopped,
    # ~15 KB each: relay's memory grew with every connection a client ever opened.
    served = await start_relay(nursery, FAKE_ONLY, tmp_path)
    method, path, body = ROUTES[route]
    for _ in range(10):
        async with await Conn.open(port_of(served)) as conn:
            with trio.fail_after(10):
                status, _, _ = await conn.response(request(method, path, body=body))
            assert status < 500, status
    # Well before the keep-alive timeout, which is not what may end them.
    with trio.fail_after(KEEP_ALIVE_TIMEOUT_S / 2):
        while connection_tasks():
            await trio.sleep(0.01)


async def test_keep_alive_stays_on_for_a_client_that_reuses_its_connection(
        nursery: trio.Nursery, tmp_path: Path) -> None:
    served = await start_relay(nursery, FAKE_ONLY, tmp_path)
    seen = []
    async with await Conn.open(port_of(served)) as conn:
        with trio.fail_after(20):
            for _ in range(2):
                for route in ROUTES:
                    method, path, body = ROUTES[route]
                    status, headers, _ = await conn.response(request(method, path, body=body))
                    assert headers.get("connection", "").lower() != "close", (route, headers)
                    seen.append((route, status))
    assert [s for _, s in seen] == [s for _, s in seen[:len(ROUTES)]] * 2
    assert dict(seen)["chat"] == dict(seen)["healthz"] == 200


# --- 1,100 silent pollers against a file limit of 1,024 -------------------------------------

LISTENING = re.compile(rb"relay listening on (http://\S+:\d+) ")
FILE_LIMIT = 1024
POLLERS = 1100
# `relay serve` with the file limit lowered first; PYTHONPATH makes it run this tree.
LIMITED = ("import os, resource, sys; "
           f"resource.setrlimit(resource.RLIMIT_NOFILE, ({FILE_LIMIT}, {FILE_LIMIT})); "
           "os.execv(sys.executable, [sys.executable, '-m', 'relay', *sys.argv[1:]])")


@asynccontextmanager
async def limited_daemon(tmp_path: Path, config: str) -> AsyncIterator[tuple[int, str]]:
    """``relay serve`` as a subprocess under RLIMIT_NOFILE 1024: (pid, url)."""
    (tmp_path / "relay.toml").write_text(textwrap.dedent(config))
    env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}
    env["PYTHONPATH"] = str(ROOT)
    env["XDG_STATE_HOME"] = str(tmp_path / "state")
    proc = await trio.lowlevel.open_process(
        [sys.executable, "-c", LIMITED, "serve", "--config", "relay.toml", "--port", "0"],
        cwd=tmp_path, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE)
    log = bytearray()
    url: list[str] = []
    try:
        async with trio.open_nursery() as nursery:
            ready = trio.Event()

            async def pump() -> None:
                assert proc.stderr is not None
                while chunk := await proc.stderr.receive_some():
                    log.extend(chunk)
                    if not url and (m := LISTENING.search(log)):
                        url.append(m.group(1).decode())
                        ready.set()
                ready.set()

            nursery.start_soon(pump)
            with trio.fail_after(20):
                await ready.wait()
            assert url, log.decode(errors="replace")
            try:
                yield proc.pid, url[0]
            finally:
                nursery.cancel_scope.cancel()
    finally:
        if proc.returncode is None:
            proc.kill()
        with trio.CancelScope(shield=True), trio.move_on_after(5):
            await proc.wait()


async def test_silent_pollers_do_not_use_up_the_file_limit(tmp_path: Path) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < POLLERS + 200:  # this process holds every poller's socket
        if hard != resource.RLIM_INFINITY and hard < POLLERS + 200:
            pytest.skip(f"the test needs {POLLERS + 200} open files; the hard limit is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (POLLERS + 200, hard))
    async with limited_daemon(tmp_path, FAKE_ONLY) as (pid, url):
        limits = trio.Path(f"/proc/{pid}/limits")
        if await limits.exists():  # the limit really is in place
            text = await limits.read_text()
            line = next(x for x in text.splitlines() if "open files" in x)
            assert line.split()[3:5] == [str(FILE_LIMIT)] * 2, line
        port = int(url.rpartition(":")[2])
        pollers: list[Conn] = []
        answered = 0
        gate = trio.Semaphore(32)

        async def poll() -> None:
            nonlocal answered
            async with gate:
                conn = await Conn.open(port)
                pollers.append(conn)  # held open, silent, to the end of the test
                status, _, _ = await conn.response(request("GET", "/healthz"))
                assert status == 200
                answered += 1

        try:
            with trio.fail_after(60):
                async with trio.open_nursery() as nursery:
                    for _ in range(POLLERS):
                        nursery.start_soon(poll)
            assert answered == POLLERS
            # Every poller is still connected (from its side): relay serves a chat request.
            async with http_client() as client:
                with trio.fail_after(20):
                    r = await client.post(url + CHAT, json=chat("fake/echo"))
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["content"] == "hello"
        finally:
            for conn in pollers:
                await conn.aclose()


# --- numbers JSON cannot carry, and nesting deeper than the encoders take -------------------

@pytest.fixture
async def fakes(nursery: trio.Nursery, upstream: FakeUpstream,
                monkeypatch: pytest.MonkeyPatch) -> tuple[FakeUpstream, FakeAnthropic, FakeGemini]:
    monkeypatch.setenv("RELAY_TEST_ANTHROPIC_KEY", ANTHROPIC_KEY)
    monkeypatch.setenv("RELAY_TEST_GEMINI_KEY", GEMINI_KEY)
    claude: FakeAnthropic = await nursery.start(serve_fake_anthropic)
    gem: FakeGemini = await nursery.start(serve_fake_gemini)
    upstream.models = ["m1", "m2"]
    return upstream, claude, gem


def every_http_adapter(fakes: tuple[FakeUpstream, FakeAnthropic, FakeGemini]) -> str:
    up, claude, gem = fakes
    profile = "[providers.{0}.profile]\nlanes = 2\nqueue_max = 8\nqueue_timeout_s = 10\n"
    return FAKE_ONLY + f"""
[providers.up]
adapter = "openai"
base_url = "{up.url}"
models = ["m1", "m2"]
{profile.format("up")}run_timeout_s = 30
[providers.claude]
adapter = "anthropic"
base_url = "{claude.url}"
api_key_env = "RELAY_TEST_ANTHROPIC_KEY"
{profile.format("claude")}run_timeout_s = 300
rpm = 0
[providers.gem]
adapter = "gemini"
base_url = "{gem.url}"
api_key_env = "RELAY_TEST_GEMINI_KEY"
{profile.format("gem")}run_timeout_s = 300
rpm = 0
"""


MODELS = ["up/m1", "claude/claude-test-1", "gem/gemini-test-flash"]


def no_upstream_call(fakes: tuple[FakeUpstream, FakeAnthropic, FakeGemini]) -> None:
    up, claude, gem = fakes
    assert [r for r in up.requests if r.method == "POST"] == []
    assert posts(claude) == [] and posts(gem) == []


def invalid(r: httpx.Response, path: str) -> tuple[str, str | None]:
    """Assert a 400 ``invalid_request`` in the route's dialect: (message, param)."""
    assert r.status_code == 400, r.text
    assert r.headers["x-should-retry"] == "false"
    body = r.json()
    if path == MESSAGES:
        assert body["type"] == "error", body
        err = body["error"]
        assert err["type"] == "invalid_request_error"
        assert err["relay"]["code"] == err["relay"]["reason"] == "invalid_request"
        return err["message"], err["relay"]["param"]
    err = body["error"]
    assert err["code"] == err["relay"]["reason"] == "invalid_request", err
    assert err["type"] == REASONS["invalid_request"].type
    return err["message"], err["param"]


def raw_body(path: str, model: str, extra: str, stream: bool = False) -> bytes:
    """A valid body for ``path`` with ``extra`` (raw JSON text) spliced into it."""
    head = (f'"models":["{model}"]' if path == FANOUT else f'"model":"{model}"')
    tokens = ',"max_tokens":16' if path == MESSAGES else ""
    return (f'{{{head}{tokens},"stream":{json.dumps(stream)},'
            f'"messages":[{{"role":"user","content":"hi"}}],{extra}}}').encode()


@pytest.mark.parametrize("path", [CHAT, MESSAGES, FANOUT])
@pytest.mark.parametrize("number", ["1e999", "-1e400", "NaN", "Infinity", "-Infinity"])
async def test_non_finite_numbers_are_a_400_naming_the_field(
        nursery: trio.Nursery, tmp_path: Path, fakes: Any, path: str, number: str) -> None:
    served = await start_relay(nursery, every_http_adapter(fakes), tmp_path)
    async with http_client() as client:
        for model in MODELS:
            for stream in (False, True):
                r = await client.post(served.url + path, content=raw_body(
                    path, model, f'"temperature":{number}', stream),
                    headers={"content-type": "application/json"})
                message, param = invalid(r, path)
                assert param == "temperature", (model, r.text)
                assert "'temperature' must be a finite number" in message
        # Deeper in the body: the path to it is named, the top field is the param.
        r = await client.post(served.url + path, content=raw_body(
            path, MODELS[0], f'"metadata":{{"scores":[1,2,{number}]}}'),
            headers={"content-type": "application/json"})
        message, param = invalid(r, path)
        assert param == "metadata" and "'metadata.scores[2]'" in message, message
    no_upstream_call(fakes)
    assert lane_idle(served)


def nested(depth: int) -> str:
    """A JSON value whose arrays nest ``depth`` levels."""
    return "[" * depth + "]" * depth


@pytest.mark.parametrize("path", [CHAT, MESSAGES, FANOUT])
async def test_bodies_nested_deeper_than_the_limit_are_a_400(
        nursery: trio.Nursery, tmp_path: Path, fakes: Any, path: str) -> None:
    served = await start_relay(nursery, every_http_adapter(fakes), tmp_path)
    # The body's own object is level 1, so "x" at `MAX_JSON_DEPTH` levels nests one too
    # deep. Around 980 levels the encoders run out of stack (a branch's internal_error).
    depths = [MAX_JSON_DEPTH, MAX_JSON_DEPTH + 1, 500, *range(960, 1001, 2), 5000]
    async with http_client() as client:
        for model in MODELS:
            for depth in depths:
                r = await client.post(served.url + path, content=raw_body(
                    path, model, f'"x":{nested(depth)}'),
                    headers={"content-type": "application/json"})
                message, _ = invalid(r, path)
                assert f"{MAX_JSON_DEPTH} levels" in message, (model, depth, message)
    no_upstream_call(fakes)
    assert lane_idle(served)


def depth_of(value: Any) -> int:
    if isinstance(value, dict):
        return 1 + max(map(depth_of, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(depth_of, value), default=0)
    return 0


def body_with_tool_at_depth(path: str, model: str, depth: int) -> dict[str, Any]:
    """A body whose one tool's JSON schema makes it nest exactly ``depth`` levels."""
    for levels in range(depth // 2, 0, -1):
        for leaf in ({"type": "string"}, {"type": "string", "enum": ["a"]}):
            schema: dict[str, Any] = leaf
            for _ in range(levels):
                schema = {"type": "object", "properties": {"a": schema}}
            tool = ({"type": "function", "function": {"name": "f", "parameters": schema}}
                    if path == CHAT else {"name": "f", "input_schema": schema})
            body = {"model": model, "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 16, "tools": [tool]}
            if depth_of(body) == depth:
                return body
    raise AssertionError(depth)


@pytest.mark.parametrize("path", [CHAT, MESSAGES])
async def test_a_body_at_the_depth_limit_reaches_every_http_adapter(
        nursery: trio.Nursery, tmp_path: Path, fakes: Any, path: str) -> None:
    served = await start_relay(nursery, every_http_adapter(fakes), tmp_path)
    up, claude, gem = fakes
    async with http_client() as client:
        for model in MODELS:
            body = body_with_tool_at_depth(path, model, MAX_JSON_DEPTH)
            r = await client.post(served.url + path, json=body)
            assert r.status_code == 200, (model, r.text)
            too_deep = body_with_tool_at_depth(path, model, MAX_JSON_DEPTH + 1)
            invalid(await client.post(served.url + path, json=too_deep), path)
    assert len([r for r in up.requests if r.method == "POST"]) == 1
    assert len(posts(claude)) == len(posts(gem)) == 1
    assert lane_idle(served)


# --- ?limit= ---------------------------------------------------------------------------------

async def test_requests_limit_takes_ascii_digits_only(nursery: trio.Nursery,
                                                      tmp_path: Path) -> None:
    served = await start_relay(nursery, FAKE_ONLY, tmp_path)
    async with http_client() as client:
        for _ in range(3):
            assert (await client.post(served.url + CHAT, json=chat("fake/echo"))).is_success
        for bad in ("%C2%B2", "%D9%A3", "-1", "1.5", "x", "", "%EF%BC%91"):  # ², ٣, fullwidth 1
            r = await client.get(served.url + "/relay/v1/requests?limit=" + bad)
            _, param = invalid(r, "")
            assert param == "limit", (bad, r.text)
        for good, count in (("0", 0), ("2", 2), ("0002", 2), ("200", 3), ("9" * 5000, 3)):
            r = await client.get(served.url + "/relay/v1/requests?limit=" + good)
            assert r.status_code == 200, (good[:10], r.text)
            assert len(r.json()["requests"]) == count, good[:10]


# --- the Host header --------------------------------------------------------------------------

GOOD_HOSTS = ["localhost", "localhost:{port}", "LOCALHOST:{port}", "localhost.:{port}",
              "127.0.0.1", "127.0.0.1:{port}", "127.0.0.2:80", "[::1]", "[::1]:{port}",
              "[0:0:0:0:0:0:0:1]:{port}", "localhost:0080"]
EVIL_HOSTS = ["localhost:80@evil", "127.0.0.1:evil.com", "[::1].evil.com", "[::1]evil.com",
              "[::1]:80@evil", "localhost:", "localhost:80:80", "[::1]:80:80", "[::1",
              "[::1%25eth0]", "[localhost]", "[127.0.0.1]", "::1", "evil@localhost",
              "localhost/evil", "localhost:\xb2", "localhost:\xb9\xb2", "127.0.0.1 evil",
              ":80", "[]", "[::1]:", "localhost:-1", "localhost:+80", "evil.example",
              "localhost.evil.example:{port}"]


def host_table(port: int) -> list[tuple[str, bool]]:
    return ([(h.format(port=port), True) for h in GOOD_HOSTS]
            + [(h.format(port=port), False) for h in EVIL_HOSTS])


async def test_the_host_header_is_a_loopback_name_and_an_optional_port(
        nursery: trio.Nursery, tmp_path: Path) -> None:
    served = await start_relay(nursery, FAKE_ONLY, tmp_path)
    wrong = []
    async with http_client() as client:
        for host, good in host_table(port_of(served)):
            for method, path in (("GET", "/healthz"), ("POST", CHAT)):
                r = await client.request(method, served.url + path, json=chat("fake/echo"),
                                         headers={"host": host.encode("latin-1")})
                if good and r.status_code != 200:
                    wrong.append((host, path, r.status_code, "should be accepted"))
                elif not good and (r.status_code != 403
                                   or r.json()["error"]["code"] != "bad_host"):
                    wrong.append((host, path, r.status_code, "should be bad_host"))
    assert wrong == []
    accepted = sum(good for _, good in host_table(0))
    assert served.relay.providers["fake"].adapter.started == accepted  # type: ignore[attr-defined]


async def test_off_loopback_only_allowed_hosts_and_a_port_are_accepted(
        nursery: trio.Nursery, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RELAY_TEST_TOKEN", "s3cret")
    config = FAKE_ONLY.replace("[server]", '[server]\nhost = "0.0.0.0"\n'
                               'token_env = "RELAY_TEST_TOKEN"\n'
                               'allowed_hosts = ["relay.lan", "192.0.2.7"]')
    served: Served = await nursery.start(functools.partial(
        relay.serve, config_from(config, tmp_path), port=0))
    port = port_of(served)
    table = [("relay.lan", True), (f"relay.lan:{port}", True), ("RELAY.LAN", True),
             ("192.0.2.7:80", True), (f"localhost:{port}", True),
             ("relay.lan:80@evil", False), ("relay.lan:evil.com", False),
             ("relay.lan.evil.com", False), ("evil.com", False), ("192.0.2.7:x", False),
             ("[relay.lan]", False), ("relay.lan:", False)]
    wrong = []
    async with http_client() as client:
        for host, good in table:
            r = await client.get(f"http://127.0.0.1:{port}/v1/models",
                                 headers={"host": host, "authorization": "Bearer s3cret"})
            if (r.status_code == 200) != good:
                wrong.append((host, r.status_code))
            if not good and r.status_code == 403:
                assert r.json()["error"]["code"] == "bad_host"
    assert wrong == []


async def test_an_http2_request_refused_on_its_headers_ends_its_connection_not_relay(
        nursery: trio.Nursery, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """hypercorn takes HTTP/2 with prior knowledge on relay's port. A POST refused on its
    headers (no token) while its body's DATA frame is still on its way made hypercorn 0.18
    raise KeyError in that connection, which went up through the listener and ended
    ``relay.serve`` for everyone. Now only that connection ends, logged."""
    monkeypatch.setenv("RELAY_TEST_TOKEN", "t0ken-for-h2")
    served = await start_relay(nursery, FAKE_ONLY.replace(
        "[server]\n", '[server]\ntoken_env = "RELAY_TEST_TOKEN"\n', 1), tmp_path)
    async with httpx.AsyncClient(http1=False, http2=True, trust_env=False) as h2:
        for _ in range(3):
            try:
                r = await h2.post(served.url + "/v1/chat/completions", json=chat("fake/echo"))
            except httpx.HTTPError:
                continue  # the connection it came on may be closed under it
            assert r.status_code == 401, r.text
    async with httpx.AsyncClient(trust_env=False) as h1:
        r = await h1.post(served.url + "/v1/chat/completions", json=chat("fake/echo"),
                          headers={"authorization": "Bearer t0ken-for-h2"})
    assert r.status_code == 200, r.text
