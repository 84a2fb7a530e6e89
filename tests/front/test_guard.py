"""The guard layer (SPEC O4) and request validation, through the assembled relay.

Every refusal is checked the same way (`refused`): its 4xx, an E1-shaped JSON body whose
``code`` is the reason, ``x-should-retry: false``, an ``x-relay-request-id`` — and that
nothing reached a provider (`untouched`): the fake provider never started, the fake
upstream saw no request, every lane is idle.
"""

from __future__ import annotations

import contextlib
import functools
import json
import ssl
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from fakes.upstream import FakeUpstream
from helpers.assembled import (
    FAKE_ONLY,
    chat,
    config_from,
    lane_idle,
    sse_events,
    start_relay,
    with_upstream,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import relay
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


def fake_config(server: str = "") -> str:
    """FAKE_ONLY with extra ``[server]`` keys."""
    return FAKE_ONLY.replace("[server]\n", f"[server]\n{server}\n", 1)


def refused(r: httpx.Response, status: int, reason: str,
            param: str | None = None) -> dict[str, Any]:
    """Assert an E1 refusal; return its ``error`` object."""
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json"), r.headers
    err = r.json()["error"]
    assert err["code"] == reason, err
    assert err["type"] == REASONS[reason].type
    assert err["param"] == param, err
    assert err["message"]
    assert err["relay"]["reason"] == reason
    assert err["relay"]["phase"] == REASONS[reason].phase
    assert set(err["relay"]) == {"phase", "reason", "provider", "retry_after_s", "action",
                                 "upstream_status", "upstream_message"}
    assert r.headers["x-should-retry"] == "false"
    assert "retry-after" not in r.headers
    assert len(r.headers["x-relay-request-id"]) >= 8
    return err  # type: ignore[no-any-return]


def untouched(served: Served, upstream: FakeUpstream | None = None) -> None:
    assert served.relay.providers["fake"].adapter.started == 0  # type: ignore[attr-defined]
    if upstream is not None:
        assert upstream.requests == []
    assert lane_idle(served)


def port_of(served: Served) -> int:
    return int(served.url.rpartition(":")[2])


# --- Host (DNS rebinding) -----------------------------------------------------------------

@pytest.mark.parametrize("host", ["evil.example", "evil.example:8765", "127.0.0.1.nip.io",
                                  "localhost.evil.example", "10.0.0.1", "[2001:db8::1]:80"])
async def test_foreign_host_is_refused(nursery: trio.Nursery, tmp_path: Path,
                                       upstream: FakeUpstream, client: httpx.AsyncClient,
                                       host: str) -> None:
    served = await start_relay(nursery, with_upstream(upstream), tmp_path)
    for model in ("fake/echo", "up/m1"):
        r = await client.post(served.url + CHAT, json=chat(model), headers={"host": host})
        err = refused(r, 403, "bad_host")
        assert host in err["message"]
    r = await client.get(served.url + "/v1/models", headers={"host": host})
    refused(r, 403, "bad_host")
    untouched(served, upstream)


async def test_loopback_hosts_are_accepted(nursery: trio.Nursery, tmp_path: Path,
                                           client: httpx.AsyncClient) -> None:
    served = await start_relay(nursery, FAKE_ONLY, tmp_path)
    port = port_of(served)
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "localhost",
                 f"LOCALHOST:{port}", "127.0.0.1"):
        r = await client.post(served.url + CHAT, json=chat("fake/echo"), headers={"host": host})
        assert r.status_code == 200, (host, r.text)
        assert r.json()["choices"][0]["message"]["content"] == "hello"
    assert served.relay.providers["fake"].adapter.started == 6  # type: ignore[attr-defined]
    assert lane_idle(served)


# --- Origin and CORS ----------------------------------------------------------------------

@pytest.mark.parametrize("origin", ["http://evil.example", "null", "http://localhost:3000"])
async def test_foreign_origin_is_refused(nursery: trio.Nursery, tmp_path: Path,
                                         client: httpx.AsyncClient, origin: str) -> None:
    served = await start_relay(nursery, FAKE_ONLY, tmp_path)
    r = await client.post(served.url + CHAT, json=chat("fake/echo"),
                          headers={"origin": origin})
    refused(r, 403, "forbidden_origin")
    assert "access-control-allow-origin" not in r.headers
    r = await client.options(served.url + CHAT, headers={
        "origin": origin, "access-control-request-method": "POST"})
    refused(r, 403, "forbidden_origin")
    untouched(served)


async def test_allowed_origin_and_preflight(nursery: trio.Nursery, tmp_path: Path,
                                            client: httpx.AsyncClient) -> None:
    served = await start_relay(nursery, fake_config('cors_origins = ["http://app.local"]'),
                               tmp_path)
    app = {"origin": "http://app.local"}
    r = await client.options(served.url + CHAT, headers={
        **app, "access-control-request-method": "POST",
        "access-control-request-headers": "content-type, authorization"})
    assert r.status_code == 204, r.text
    assert r.headers["access-control-allow-origin"] == "http://app.local"
    assert "POST" in r.headers["access-control-allow-methods"]
    allowed = {h.strip() for h in r.headers["access-control-allow-headers"].split(",")}
    assert {"content-type", "authorization"} <= allowed
    assert served.relay.providers["fake"].adapter.started == 0  # type: ignore[attr-defined]

    r = await client.post(served.url + CHAT, json=chat("fake/echo", "hi app"), headers=app)
    assert r.status_code == 200, r.text
    assert r.headers["access-control-allow-origin"] == "http://app.local"
    assert r.json()["choices"][0]["message"]["content"] == "hi app"
    # a refusal to the allowed origin is still readable by its page
    r = await client.post(served.url + CHAT, json=chat("nope/x"), headers=app)
    refused(r, 404, "unknown_model", "model")
    assert r.headers["access-control-allow-origin"] == "http://app.local"
    # another origin stays refused
    r = await client.post(served.url + CHAT, json=chat("fake/echo"),
                          headers={"origin": "http://app.local.evil.example"})
    refused(r, 403, "forbidden_origin")
    assert lane_idle(served)


# --- content type ("simple" POSTs) --------------------------------------------------------

@pytest.mark.parametrize("ctype", ["text/plain", "text/plain;charset=UTF-8",
                                   "application/x-www-form-urlencoded",
                                   "multipart/form-data; boundary=x", None])
async def test_non_json_body_is_refused(nursery: trio.Nursery, tmp_path: Path,
                                        client: httpx.AsyncClient, ctype: str | None) -> None:
    served = await start_relay(nursery, FAKE_ONLY, tmp_path)
    headers = {} if ctype is None else {"content-type": ctype}
    r = await client.post(served.url + CHAT, content=json.dumps(chat("fake/echo")).encode(),
                          headers=headers)
    assert ("content-type" in r.request.headers) == (ctype is not None)
    refused(r, 415, "invalid_request")
    untouched(served)


async def test_json_content_type_variants_are_accepted(nursery: trio.Nursery, tmp_path: Path,
                                                       client: httpx.AsyncClient) -> None:
    served = await start_relay(nursery, FAKE_ONLY, tmp_path)
    for ctype in ("application/json", "application/json; charset=utf-8", "Application/JSON"):
        r = await client.post(served.url + CHAT, content=json.dumps(chat("fake/echo")),
                              headers={"content-type": ctype})
        assert r.status_code == 200, (ctype, r.text)


# --- body size and deadline ---------------------------------------------------------------

async def test_oversized_body_is_refused(nursery: trio.Nursery, tmp_path: Path,
                                         client: httpx.AsyncClient) -> None:
    served = await start_relay(nursery, fake_config("max_body_bytes = 2048"), tmp_path)
    big = json.dumps(chat("fake/echo", "x" * 3000)).encode()
    r = await client.post(served.url + CHAT, content=big,
                          headers={"content-type": "application/json"})
    assert r.request.headers["content-length"] == str(len(big))
    err = refused(r, 413, "invalid_request")
    assert "2048" in err["message"]

    async def chunked() -> AsyncIterator[bytes]:
        for i in range(0, len(big), 512):
            yield big[i:i + 512]

    r = await client.post(served.url + CHAT, content=chunked(),
                          headers={"content-type": "application/json"})
    assert "content-length" not in r.request.headers
    assert r.request.headers["transfer-encoding"] == "chunked"
    refused(r, 413, "invalid_request")
    untouched(served)

    # just under the limit is served, chunked or not
    fits = json.dumps(chat("fake/echo", "y" * 1900)).encode()
    assert len(fits) <= 2048
    r = await client.post(served.url + CHAT, content=fits,
                          headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text

    async def fits_chunked() -> AsyncIterator[bytes]:
        yield fits[:1000]
        yield fits[1000:]

    r = await client.post(served.url + CHAT, content=fits_chunked(),
                          headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text
    assert lane_idle(served)


def _parse_raw_response(raw: bytes) -> tuple[int, dict[str, str], bytes] | None:
    head, sep, rest = raw.partition(b"\r\n\r\n")
    if not sep:
        return None
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        key, _, value = line.partition(":")
        headers[key.strip().lower()] = value.strip()
    if len(rest) < int(headers.get("content-length", "0")):
        return None
    return status, headers, rest


async def test_slow_body_times_out(nursery: trio.Nursery, tmp_path: Path) -> None:
    served = await start_relay(nursery, fake_config("body_timeout_s = 0.5"), tmp_path)
    port = port_of(served)
    sock = await trio.open_tcp_stream("127.0.0.1", port)
    async with sock:
        await sock.send_all(
            f"POST {CHAT} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
            "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n".encode())
        await sock.send_all(b'{"model":"')
        sent_at = trio.current_time()
        raw = b""
        parsed = None
        with trio.fail_after(5):
            while parsed is None:
                data = await sock.receive_some(65536)
                assert data, f"connection closed before a full answer: {raw!r}"
                raw += data
                parsed = _parse_raw_response(raw)
        waited = trio.current_time() - sent_at
    status, headers, body = parsed
    assert 0.4 <= waited <= 2.0, waited
    assert status == 408
    assert headers["x-should-retry"] == "false"
    assert headers["x-relay-request-id"]
    err = json.loads(body)["error"]
    assert err["code"] == err["relay"]["reason"] == "invalid_request"
    assert err["relay"]["phase"] == "request"
    assert "body_timeout_s" in err["message"]
    untouched(served)


# --- the relay token ----------------------------------------------------------------------

async def _answer(stream: trio.SocketStream) -> bytes:
    """One answer's head, lower-cased (its body, of a content-length, read and dropped)."""
    data = b""
    with trio.fail_after(5):
        while b"\r\n\r\n" not in data:
            data += await stream.receive_some(65536)
        head, _, body = data.partition(b"\r\n\r\n")
        length = int(head.lower().partition(b"content-length: ")[2].split(b"\r\n")[0])
        while len(body) < length:
            body += await stream.receive_some(65536)
    return head.lower()


async def test_a_refusal_before_the_body_is_read_tells_the_client_not_to_reuse_it(
        nursery: trio.Nursery, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The guard refuses on the headers alone (here, no token) while the body is still
    coming: hypercorn closes such a connection after the answer, so the answer must say
    ``Connection: close`` — a keep-alive client would otherwise send its next request on
    a connection that is closing, and get no answer at all. A refusal of a request without
    a body keeps the connection."""
    monkeypatch.setenv("RELAY_TEST_TOKEN", "s3cret-token")
    served = await start_relay(nursery, fake_config(
        'token_env = "RELAY_TEST_TOKEN"\nmax_body_bytes = 1024'), tmp_path)
    port = int(served.url.rsplit(":", 1)[1])
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n"
                              b"content-type: application/json\r\ncontent-length: 50\r\n\r\n")
        head = await _answer(stream)  # the body has not been sent
        assert head.startswith(b"http/1.1 401") and b"\r\nconnection: close" in head, head
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with contextlib.AsyncExitStack() as streams:
        streams.push_async_callback(lambda: stream.aclose())
        # A body over the limit, refused mid-way: whatever the answer says is what the
        # connection does — `Connection: close` and then its end, or another answer on it.
        big = b'{"model": "fake/echo", "pad": "' + b"x" * 2000 + b'"}'
        await stream.send_all(b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n"
                              b"authorization: Bearer s3cret-token\r\n"
                              b"content-type: application/json\r\n"
                              b"transfer-encoding: chunked\r\n\r\n"
                              + b"%x\r\n%s\r\n0\r\n\r\n" % (len(big), big))
        head = await _answer(stream)
        assert head.startswith(b"http/1.1 413"), head
        if b"\r\nconnection: close" in head:
            with trio.fail_after(5):
                while await stream.receive_some(65536):
                    pass  # the server closes it
            await stream.aclose()
            stream = await trio.open_tcp_stream("127.0.0.1", port)
        for _ in range(2):  # no body: the same connection answers again
            await stream.send_all(b"GET /v1/models HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n")
            head = await _answer(stream)
            assert head.startswith(b"http/1.1 401") and b"connection: close" not in head, head


async def test_token(nursery: trio.Nursery, tmp_path: Path, client: httpx.AsyncClient,
                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RELAY_TEST_TOKEN", "s3cret-token")
    served = await start_relay(nursery, fake_config('token_env = "RELAY_TEST_TOKEN"'), tmp_path)
    url = served.url + CHAT
    for auth in (None, "Bearer wrong", "Bearer s3cret-token-and-more", "Bearer s3cret",
                 "Basic s3cret-token", "s3cret-token", "Bearer"):
        headers = {} if auth is None else {"authorization": auth}
        r = await client.post(url, json=chat("fake/echo"), headers=headers)
        refused(r, 401, "unauthorized")
    r = await client.get(served.url + "/v1/models")
    refused(r, 401, "unauthorized")
    r = await client.get(served.url + "/nope")
    refused(r, 401, "unauthorized")
    untouched(served)

    good = {"authorization": "Bearer s3cret-token"}
    r = await client.post(url, json=chat("fake/echo"), headers=good)
    assert r.status_code == 200, r.text
    r = await client.post(url, json=chat("fake/echo"), headers={"authorization":
                                                               "bearer s3cret-token"})
    assert r.status_code == 200, r.text
    r = await client.get(served.url + "/v1/models", headers=good)
    assert r.status_code == 200
    r = await client.get(served.url + "/healthz")
    assert r.status_code == 200, r.text
    assert r.json() == {"status": "ok"}
    assert lane_idle(served)


def test_token_env_must_be_set(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RELAY_TEST_TOKEN", raising=False)
    with pytest.raises(relay.ConfigError, match="RELAY_TEST_TOKEN"):
        config_from(fake_config('token_env = "RELAY_TEST_TOKEN"'), tmp_path)


# --- request validation -------------------------------------------------------------------

def _body(**fields: Any) -> bytes:
    return json.dumps({**chat("fake/echo"), **fields}).encode()


DEEP = b"[" * 100_000 + b"]" * 100_000
OK = chat("fake/echo")

INVALID: list[tuple[str, bytes, str | None]] = [
    ("not json", b"{not json", None),
    ("empty body", b"", None),
    ("a list", b"[1, 2]", None),
    ("a string", b'"hello"', None),
    ("null", b"null", None),
    ("missing model", json.dumps({"messages": OK["messages"]}).encode(), "model"),
    ("empty model", _body(model=""), "model"),
    ("model not a string", _body(model=5), "model"),
    ("missing messages", json.dumps({"model": "fake/echo"}).encode(), "messages"),
    ("empty messages", _body(messages=[]), "messages"),
    ("messages not a list", _body(messages="hi"), "messages"),
    ("message not an object", _body(messages=["hi"]), "messages[0]"),
    ("message without role", _body(messages=[{"content": "hi"}]), "messages[0].role"),
    ("unknown role", _body(messages=[{"role": "robot", "content": "hi"}]),
     "messages[0].role"),
    ("content a number", _body(messages=[{"role": "user", "content": 5}]),
     "messages[0].content"),
    ("stream a string", _body(stream="yes"), "stream"),
    ("stream a number", _body(stream=1), "stream"),
    ("max_tokens 0", _body(max_tokens=0), "max_tokens"),
    ("max_tokens negative", _body(max_tokens=-1), "max_tokens"),
    ("max_tokens huge", _body(max_tokens=10**12), "max_tokens"),
    ("max_tokens float", _body(max_tokens=1.5), "max_tokens"),
    ("max_tokens bool", _body(max_tokens=True), "max_tokens"),
    ("max_tokens string", _body(max_tokens="10"), "max_tokens"),
    ("max_completion_tokens 0", _body(max_completion_tokens=0), "max_completion_tokens"),
    ("n 0", _body(n=0), "n"),
    ("stream_options not an object", _body(stream=True, stream_options="x"),
     "stream_options"),
    ("deeply nested lists", DEEP, None),
    ("deeply nested field", _body(metadata=None).replace(b"null", DEEP), None),
    ("invalid UTF-8", b'{"model":"fake/echo","messages":[{"role":"user","content":"\xff\xfe"}]}',
     None),
]


@pytest.mark.parametrize(("body", "param"), [(b, p) for _, b, p in INVALID],
                         ids=[name for name, _, _ in INVALID])
async def test_invalid_request(nursery: trio.Nursery, tmp_path: Path,
                               client: httpx.AsyncClient, body: bytes,
                               param: str | None) -> None:
    served = await start_relay(nursery, FAKE_ONLY, tmp_path)
    r = await client.post(served.url + CHAT, content=body,
                          headers={"content-type": "application/json"})
    refused(r, 400, "invalid_request", param)
    untouched(served)


@pytest.mark.parametrize("model", ["nope/x", "zzz", "fake/", "fake/nope", "/echo", "up/m1"])
async def test_unknown_model(nursery: trio.Nursery, tmp_path: Path,
                             client: httpx.AsyncClient, model: str) -> None:
    served = await start_relay(nursery, FAKE_ONLY, tmp_path)
    for stream in (False, True):
        r = await client.post(served.url + CHAT, json=chat(model, stream=stream))
        err = refused(r, 404, "unknown_model", "model")
        assert "fake/echo" in err["message"]
        assert model in err["message"]
    untouched(served)


async def test_bare_model_resolves(nursery: trio.Nursery, tmp_path: Path,
                                   client: httpx.AsyncClient) -> None:
    served = await start_relay(nursery, FAKE_ONLY, tmp_path)
    r = await client.post(served.url + CHAT, json=chat("echo", "bare"))
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "fake/echo"   # the model that answered, provider included
    assert r.json()["choices"][0]["message"]["content"] == "bare"


async def test_priority_header(nursery: trio.Nursery, tmp_path: Path,
                               client: httpx.AsyncClient) -> None:
    served = await start_relay(nursery, FAKE_ONLY, tmp_path)
    for bad in ("urgent", "high", "interactive,normal"):
        r = await client.post(served.url + CHAT, json=chat("fake/echo"),
                              headers={"x-relay-priority": bad})
        err = refused(r, 400, "invalid_request")
        assert "X-Relay-Priority" in err["message"]
    untouched(served)
    for good in ("interactive", "normal", "background", "Background"):
        r = await client.post(served.url + CHAT, json=chat("fake/echo"),
                              headers={"x-relay-priority": good})
        assert r.status_code == 200, (good, r.text)


@pytest.mark.parametrize(("field", "value"), [
    ("tool_choice", "required"),
    ("n", 3),
    ("response_format", {"type": "json_object"}),
    ("logprobs", True),
])
async def test_unsupported_field(nursery: trio.Nursery, tmp_path: Path,
                                 client: httpx.AsyncClient, field: str, value: Any) -> None:
    served = await start_relay(nursery, FAKE_ONLY, tmp_path)
    for stream in (False, True):
        r = await client.post(served.url + CHAT,
                              json=chat("fake/echo", stream=stream, **{field: value}))
        err = refused(r, 400, "unsupported", field)
        assert field in err["message"]
        assert err["relay"]["provider"] == "fake"
    untouched(served)


# --- paths and methods --------------------------------------------------------------------

async def test_unknown_path_and_wrong_method(nursery: trio.Nursery, tmp_path: Path,
                                             client: httpx.AsyncClient) -> None:
    served = await start_relay(nursery, FAKE_ONLY, tmp_path)
    refused(await client.get(served.url + "/nope"), 404, "invalid_request")
    refused(await client.post(served.url + "/v1/nope", json=OK), 404, "invalid_request")
    refused(await client.get(served.url + "/v1/chat/completions/"), 404, "invalid_request")
    refused(await client.get(served.url + CHAT), 405, "invalid_request")
    refused(await client.put(served.url + CHAT, json=OK), 405, "invalid_request")
    refused(await client.delete(served.url + "/v1/models"), 405, "invalid_request")
    refused(await client.post(served.url + "/healthz", json={}), 405, "invalid_request")
    untouched(served)


# --- a property: whatever the body, a clear 4xx (or a real answer), never a 5xx ------------

JSON_SCALARS = (st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8)
                | st.sampled_from(["fake/echo", "echo", "user", "assistant", "", "fake/"]))
JSON_VALUES = st.recursive(
    JSON_SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        st.sampled_from(["role", "content", "text", "type", "model", "name"]) | st.text(max_size=5),
        inner, max_size=4),
    max_leaves=12)
MESSAGES = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant", "tool"]) | JSON_VALUES},
        optional={"content": st.text(max_size=20) | st.lists(
            st.fixed_dictionaries({"type": st.just("text")},
                                  optional={"text": JSON_VALUES})) | JSON_VALUES,
            "name": JSON_VALUES}),
    max_size=3) | JSON_VALUES
CHATLIKE = st.fixed_dictionaries(
    {"model": st.sampled_from(["fake/echo", "echo", "nope/x", "fake/echo?chunks=2"])
     | JSON_VALUES, "messages": MESSAGES},
    optional={key: JSON_VALUES for key in (
        "stream", "max_tokens", "max_completion_tokens", "n", "stream_options",
        "temperature", "stop", "seed", "user", "metadata")}
    | {"stream": st.booleans(), "max_tokens": st.integers(-2, 5)})
BODIES = (JSON_VALUES.map(lambda v: json.dumps(v).encode())
          | CHATLIKE.map(lambda v: json.dumps(v).encode())
          | st.binary(max_size=64))



@contextlib.contextmanager
def relay_in_thread(text: str, tmp_path: Path) -> Iterator[tuple[Served, trio.lowlevel.TrioToken]]:
    """A relay in its own thread and trio run, for a sync (hypothesis) test."""
    config = config_from(text, tmp_path)
    ready = threading.Event()
    box: dict[str, Any] = {}

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            box["served"] = await nursery.start(functools.partial(relay.serve, config, port=0))
            box["token"] = trio.lowlevel.current_trio_token()
            box["cancel"] = nursery.cancel_scope.cancel
            ready.set()

    def run() -> None:
        try:
            trio.run(main)
        except BaseException as exc:  # reported by the test thread
            box["error"] = exc
        finally:
            ready.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert ready.wait(10)
    if "error" in box:
        raise box["error"]
    try:
        yield box["served"], box["token"]
    finally:
        trio.from_thread.run_sync(box["cancel"], trio_token=box["token"])
        thread.join(10)
        assert not thread.is_alive()
        if "error" in box:
            raise box["error"]


def test_any_body_gets_a_clear_answer(tmp_path: Path) -> None:
    with relay_in_thread(FAKE_ONLY, tmp_path) as (served, token), httpx.Client(
            trust_env=False, verify=TLS, timeout=10) as client:

        @settings(max_examples=50, deadline=None, database=None,
                  suppress_health_check=[HealthCheck.too_slow])
        @given(body=BODIES, background=st.booleans())
        def check(body: bytes, background: bool) -> None:
            headers = {"content-type": "application/json"}
            if background:
                headers["x-relay-priority"] = "background"
            r = client.post(served.url + CHAT, content=body, headers=headers)
            assert r.status_code < 500, (body, r.text)
            if r.status_code == 200:
                if r.headers["content-type"].startswith("text/event-stream"):
                    last = sse_events(r.text)[-1]
                    assert last == "[DONE]" or last["error"]["code"] in REASONS, r.text
                else:
                    assert r.json()["object"] == "chat.completion"
            else:
                assert 400 <= r.status_code < 500
                err = r.json()["error"]
                assert err["code"] in REASONS
                assert err["code"] == err["relay"]["reason"]
                assert r.headers["x-should-retry"] == "false"
            assert trio.from_thread.run_sync(lane_idle, served, trio_token=token)

        check()


@pytest.mark.parametrize("role", [[], {"a": 1}])
async def test_unhashable_role_is_a_400(nursery: trio.Nursery, tmp_path: Path,
                                        client: httpx.AsyncClient, role: Any) -> None:
    served = await start_relay(nursery, FAKE_ONLY, tmp_path)
    r = await client.post(served.url + CHAT,
                          json=chat("fake/echo", messages=[{"role": role, "content": "hi"}]))
    refused(r, 400, "invalid_request", "messages[0].role")
    untouched(served)


@pytest.mark.parametrize("text", [None, 5, ["a"]])
async def test_non_string_part_text_is_a_400(nursery: trio.Nursery, tmp_path: Path,
                                             client: httpx.AsyncClient, text: Any) -> None:
    served = await start_relay(nursery, FAKE_ONLY, tmp_path)
    body = {"model": "fake/echo",
            "messages": [{"role": "user", "content": [{"type": "text", "text": text}]}]}
    r = await client.post(served.url + CHAT, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "invalid_request"
    assert lane_idle(served)


async def test_content_parts_are_read(nursery: trio.Nursery, tmp_path: Path,
                                      client: httpx.AsyncClient) -> None:
    served = await start_relay(nursery, FAKE_ONLY, tmp_path)
    body = {"model": "fake/echo", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "two"}, {"type": "text", "text": "parts"}]}]}
    r = await client.post(served.url + CHAT, json=body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "two parts"


async def test_a_refused_chat_request_still_gets_its_one_record(
        nursery: trio.Nursery, tmp_path: Path, client: httpx.AsyncClient) -> None:
    from helpers.assembled import records, wait_for

    served = await start_relay(nursery, FAKE_ONLY, tmp_path)
    r = await client.post(served.url + CHAT, json=chat("fake/echo"),
                          headers={"host": "evil.example"})
    refused(r, 403, "bad_host")
    r = await client.post(served.url + CHAT, content=b"hi", headers={"content-type": "text/plain"})
    refused(r, 415, "invalid_request")
    await wait_for(lambda: len(records(tmp_path)) == 2)
    assert [(x["status"], x["reason"]) for x in records(tmp_path)] == [
        (403, "bad_host"), (415, "invalid_request")]


async def test_headers_that_trickle_in_are_dropped(nursery: trio.Nursery,
                                                    tmp_path: Path) -> None:
    # Slowloris on the headers: hypercorn's keep-alive timer (5 s) runs until a request's
    # headers are complete, so a connection that never finishes them is closed.
    served = await start_relay(nursery, FAKE_ONLY, tmp_path)
    stream = await trio.open_tcp_stream("127.0.0.1", port_of(served))
    await stream.send_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    t0 = trio.current_time()
    closed = False
    with trio.fail_after(10):
        while not closed:
            try:
                await stream.send_all(b"X-Slow: 1\r\n")
            except trio.BrokenResourceError:
                break
            with trio.move_on_after(0.5):
                closed = await stream.receive_some(100) == b""
    assert 4.5 < trio.current_time() - t0 < 7
    await stream.aclose()
    untouched(served)


async def test_the_token_may_come_as_x_api_key(nursery: trio.Nursery, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch,
                                               client: httpx.AsyncClient) -> None:
    monkeypatch.setenv("RELAY_TEST_TOKEN", "s3cret")
    served = await start_relay(nursery, FAKE_ONLY.replace(
        "[server]", '[server]\ntoken_env = "RELAY_TEST_TOKEN"'), tmp_path)
    ok = await client.post(served.url + CHAT, json=chat("fake/echo"),
                           headers={"x-api-key": "s3cret"})
    assert ok.status_code == 200, ok.text
    bad = await client.post(served.url + CHAT, json=chat("fake/echo"),
                            headers={"x-api-key": "nope"})
    refused(bad, 401, "unauthorized")


async def test_a_request_without_host_is_refused_on_loopback(nursery: trio.Nursery,
                                                             tmp_path: Path) -> None:
    served = await start_relay(nursery, FAKE_ONLY, tmp_path)
    stream = await trio.open_tcp_stream("127.0.0.1", port_of(served))
    body = json.dumps(chat("fake/echo")).encode()
    await stream.send_all(b"POST /v1/chat/completions HTTP/1.0\r\nContent-Type: "
                          b"application/json\r\nContent-Length: " + str(len(body)).encode()
                          + b"\r\n\r\n" + body)
    seen = b""
    with trio.fail_after(5):
        while chunk := await stream.receive_some(65536):
            seen += chunk
    await stream.aclose()
    assert seen.startswith(b"HTTP/1.0 403") or seen.startswith(b"HTTP/1.1 403"), seen[:100]
    assert b'"bad_host"' in seen
    untouched(served)
