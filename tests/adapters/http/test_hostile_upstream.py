"""relay against a hostile upstream (SPEC E1, O5): bounded bodies, one SSE reader, every
httpx failure mapped, secrets redacted at every exit.

Each assembled test goes config text → `relay.serve` → real HTTP on loopback →
the ``openai`` (or ``anthropic``/``gemini``) adapter → `hostile_upstream.Hostile`, and
checks what the client, the status, the log and the records got.
"""

from __future__ import annotations

import gzip
import io
import json
import logging
import time
import zlib
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from fakes.hostile_upstream import PIECE, TEXT, Hostile, MiB, Plan, gzip_answer, serve_hostile
from helpers.assembled import chat, config_from, records, sse_events, start_relay, wait_for
from helpers.httpx_errors import _httpx_exception_classes, _instance

import relay
from relay.adapters.http.base import MAX_SSE_BYTES, SSEDecoder, SSETooLarge
from relay.api.body import PIECE_BYTES, UpstreamBody, read_answer, read_error_text
from relay.api.http import transport_errors
from relay.vocab import redact
from relay.vocab.errors import MAX_WORDS_BYTES, REASONS, RelayError, bound_text

CHAT = "/v1/chat/completions"
DEFAULT_BOUND = 32 * MiB
ERROR_BODY_MAX = 160 * 1024  # what the client may get back, at most, for any of these
# What loopback socket buffers may hold beyond what relay read (tcp_rmem + tcp_wmem).
SLACK = 16 * MiB

KEY_ENV = "HOSTILE_TEST_KEY"
KEY = "sk-hostile-0123456789abcdef"
HEADER_SECRET = "org-header-secret-4242"


@pytest.fixture
async def up(nursery: trio.Nursery) -> Hostile:
    server: Hostile = await nursery.start(serve_hostile)
    return server


def config(up: Hostile, *, adapter: str = "openai", server: str = "", extra: str = "",
           models: tuple[str, ...] = ("m",)) -> str:
    return f"""
[server]
records = "records.jsonl"
{server}
[providers.up]
adapter = "{adapter}"
base_url = "{up.url}"
models = {json.dumps(list(models))}
{extra}
[providers.up.profile]
lanes = 2
queue_max = 4
queue_timeout_s = 10
run_timeout_s = 300
"""


def e1(r: httpx.Response, status: int, reason: str) -> dict[str, Any]:
    """An E1 answer with a real status and a body of at most `ERROR_BODY_MAX`."""
    assert r.status_code == status, r.text[:2000]
    assert len(r.content) < ERROR_BODY_MAX, len(r.content)
    err = r.json()["error"]
    assert err["code"] == reason and err["relay"]["reason"] == reason, err["message"][:500]
    assert err["relay"]["phase"] == REASONS[reason].phase
    return err  # type: ignore[no-any-return]


def utf8(text: str) -> int:
    return len(text.encode())


def sse_data(body: bytes) -> list[Any]:
    """The `data:` payloads of relay's SSE body, lines split at LF only (conftest's
    `sse_events` uses ``str.splitlines``, which would split at U+2028 too)."""
    out: list[Any] = []
    for line in body.decode().split("\n"):
        if line.startswith("data: "):
            out.append(line[6:] if line[6:] == "[DONE]" else json.loads(line[6:]))
    return out


# --- 1. non-streamed bodies are bounded, after decompression -----------------------------

async def test_a_huge_answer_is_refused_at_the_bound_and_not_read_past_it(
        nursery: trio.Nursery, tmp_path: Path, up: Hostile,
        client: httpx.AsyncClient) -> None:
    # A valid, complete answer of 64 MiB: twice the default max_upstream_bytes.
    up.plans["m"] = Plan("huge", size=64 * MiB)
    served = await start_relay(nursery, config(up), tmp_path)
    r = await client.post(served.url + CHAT, json=chat("up/m"))
    err = e1(r, 502, "bad_upstream_response")
    assert "max_upstream_bytes" in err["message"] and str(DEFAULT_BOUND) in err["message"]
    with trio.fail_after(5):
        await up.wait_all_closed()
    # Reading stopped at the bound: the upstream could not hand over the rest.
    assert up.sent["m"] < DEFAULT_BOUND + SLACK < 64 * MiB


async def test_a_gzip_bomb_is_measured_after_decompression(
        nursery: trio.Nursery, tmp_path: Path, up: Hostile,
        client: httpx.AsyncClient) -> None:
    # 40 MiB of answer in about 40 KB of gzip: the bound counts the 40 MiB.
    up.plans["m"] = Plan("gzip_bomb", size=40 * MiB)
    assert len(gzip_answer(40 * MiB)) < MiB
    served = await start_relay(nursery, config(up), tmp_path)
    r = await client.post(served.url + CHAT, json=chat("up/m"))
    err = e1(r, 502, "bad_upstream_response")
    assert "max_upstream_bytes" in err["message"] and "decompression" in err["message"]
    assert up.requests[0].headers["accept-encoding"] == "gzip, deflate"


async def test_a_compressed_answer_under_the_bound_is_answered(
        nursery: trio.Nursery, tmp_path: Path, up: Hostile,
        client: httpx.AsyncClient) -> None:
    up.plans["m"] = Plan("gzip_bomb", size=3 * MiB)
    served = await start_relay(nursery, config(up), tmp_path)
    r = await client.post(served.url + CHAT, json=chat("up/m"))
    assert r.status_code == 200, r.text[:500]
    content = r.json()["choices"][0]["message"]["content"]
    assert set(content) == {"a"} and len(content) > 3 * MiB - 200


async def test_the_bound_is_the_configured_one(nursery: trio.Nursery, tmp_path: Path,
                                               up: Hostile, client: httpx.AsyncClient) -> None:
    up.plans["m"] = Plan("huge", size=300_000)
    served = await start_relay(nursery, config(up, server="max_upstream_bytes = 200000"),
                               tmp_path)
    r = await client.post(served.url + CHAT, json=chat("up/m"))
    err = e1(r, 502, "bad_upstream_response")
    assert "200000" in err["message"]


def response(data: bytes, encoding: str | None = None) -> httpx.Response:
    headers = {"content-encoding": encoding} if encoding else {}
    return httpx.Response(200, headers=headers, stream=httpx.ByteStream(data))


async def pieces_of(resp: httpx.Response) -> list[bytes]:
    body = UpstreamBody(resp, "up")
    out = []
    while (piece := await body.piece()) is not None:
        out.append(piece)
    return out


def _deflate(data: bytes, wbits: int) -> bytes:
    comp = zlib.compressobj(6, zlib.DEFLATED, wbits)
    return comp.compress(data) + comp.flush()


TEXTS = {"identity": (None, lambda d: d), "gzip": ("gzip", gzip.compress),
         "x-gzip": ("x-gzip", gzip.compress),
         "deflate (zlib)": ("deflate", lambda d: _deflate(d, zlib.MAX_WBITS)),
         "deflate (raw)": ("deflate", lambda d: _deflate(d, -zlib.MAX_WBITS)),
         "two gzip members": ("gzip", lambda d: gzip.compress(d[:500]) + gzip.compress(d[500:]))}


@pytest.mark.parametrize("name", TEXTS)
async def test_bodies_are_decoded_by_relay(name: str) -> None:
    encoding, encode = TEXTS[name]
    data = json.dumps({"text": "ok " * 2000}).encode()
    assert b"".join(await pieces_of(response(encode(data), encoding))) == data


async def test_a_bomb_comes_out_in_bounded_pieces() -> None:
    data = gzip.compress(b"\0" * (16 * MiB))
    pieces = await pieces_of(response(data, "gzip"))  # one 16 KB network chunk
    assert sum(map(len, pieces)) == 16 * MiB
    assert max(map(len, pieces)) <= PIECE_BYTES


@pytest.mark.parametrize("encoding", ["br", "zstd", "gzip, gzip"])
async def test_an_encoding_relay_did_not_ask_for_is_refused(encoding: str) -> None:
    with pytest.raises(RelayError) as info:
        await pieces_of(response(b"xx", encoding))
    assert info.value.reason == "bad_upstream_response" and encoding in info.value.message


async def test_read_answer_and_read_error_text_stop_at_their_bounds() -> None:
    assert await read_answer(response(b"a" * 1000), "up", 1000) == "a" * 1000
    with pytest.raises(RelayError, match="max_upstream_bytes \\(999 bytes"):
        await read_answer(response(gzip.compress(b"a" * 1000), "gzip"), "up", 999)
    assert await read_error_text(response(b"e" * 1000), "up", 1000) == "e" * 1000
    cut = await read_error_text(response(gzip.compress(b"e" * 5000), "gzip"), "up", 1000)
    assert cut == "e" * 1000 + "… [≥ 1001 bytes]"  # asked zlib for one byte past it
    # An error body that cannot be decoded keeps what was read: the status says enough.
    assert await read_error_text(response(b"not gzip", "gzip"), "up", 1000) == ""


async def test_a_reload_changes_the_bound(nursery: trio.Nursery, tmp_path: Path, up: Hostile,
                                          client: httpx.AsyncClient) -> None:
    up.plans["m"] = Plan("huge", size=300_000)
    served = await start_relay(nursery, config(up, server="max_upstream_bytes = 200000"),
                               tmp_path)
    e1(await client.post(served.url + CHAT, json=chat("up/m")), 502, "bad_upstream_response")
    await served.relay.reload(config_from(config(up, server="max_upstream_bytes = 400000"),
                                          tmp_path))
    r = await client.post(served.url + CHAT, json=chat("up/m"))
    assert r.status_code == 200, r.text[:300]


# --- 4. a body httpx cannot decode is a 502, never a bare 500 ----------------------------

@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
async def test_an_undecodable_body_is_bad_upstream_response(
        nursery: trio.Nursery, tmp_path: Path, up: Hostile, client: httpx.AsyncClient,
        stream: bool) -> None:
    up.plans["m"] = Plan("bad_gzip")
    served = await start_relay(nursery, config(up), tmp_path)
    r = await client.post(served.url + CHAT, json=chat("up/m", stream=stream))
    err = e1(r, 502, "bad_upstream_response")
    assert "gzip" in err["message"]
    assert r.headers["x-should-retry"] == "false"






@pytest.mark.parametrize("cls", _httpx_exception_classes(), ids=lambda c: c.__name__)
def test_every_httpx_exception_is_mapped(cls: type[BaseException]) -> None:
    exc = _instance(cls)
    with pytest.raises(RelayError) as info, transport_errors("up", "answer"):
        raise exc
    assert info.value.reason in REASONS
    assert info.value.__cause__ is exc
    assert info.value.provider == "up"


def test_the_exception_walk_sees_the_whole_tree() -> None:
    names = {c.__name__ for c in _httpx_exception_classes()}
    assert {"DecodingError", "TooManyRedirects", "HTTPStatusError", "InvalidURL",
            "CookieConflict", "StreamConsumed", "ReadTimeout", "RemoteProtocolError",
            "UnsupportedProtocol", "ProxyError"} <= names


# --- 3. one SSE reader: CR/LF/CRLF only, 8 MiB lines and events ---------------------------

async def test_an_unterminated_sse_line_is_refused_at_8_MiB(
        nursery: trio.Nursery, tmp_path: Path, up: Hostile,
        client: httpx.AsyncClient) -> None:
    up.plans["m"] = Plan("sse_unterminated", size=64 * MiB)
    served = await start_relay(nursery, config(up), tmp_path)
    r = await client.post(served.url + CHAT, json=chat("up/m", stream=True))
    err = e1(r, 502, "bad_upstream_response")  # before any answer byte: a real status
    assert str(MAX_SSE_BYTES) in err["message"]
    with trio.fail_after(5):
        await up.wait_all_closed()
    assert up.sent["m"] < MAX_SSE_BYTES + SLACK < 64 * MiB


@pytest.mark.parametrize("adapter", ["openai", "anthropic", "gemini"])
async def test_unicode_line_separators_stay_inside_their_event(
        nursery: trio.Nursery, tmp_path: Path, up: Hostile, client: httpx.AsyncClient,
        monkeypatch: pytest.MonkeyPatch, adapter: str) -> None:
    monkeypatch.setenv(KEY_ENV, KEY)
    up.plans["m"] = Plan("separators")
    served = await start_relay(
        nursery, config(up, adapter=adapter, extra=f'api_key_env = "{KEY_ENV}"'), tmp_path)
    r = await client.post(served.url + CHAT, json=chat("up/m", stream=True))
    assert r.status_code == 200
    events = sse_data(r.content)
    assert events[-1] == "[DONE]"
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events
                   if isinstance(e, dict) and e.get("choices"))
    assert text == TEXT
    await wait_for(lambda: len(records(tmp_path)) >= 1)
    assert "skipped_events" not in records(tmp_path)[0]


async def test_data_lines_without_blank_lines_between_are_each_a_chunk(
        nursery: trio.Nursery, tmp_path: Path, up: Hostile,
        client: httpx.AsyncClient) -> None:
    # Some OpenAI-compatible servers leave out the blank line: an SSE reader then sees one
    # event of many data lines; the openai adapter reads each line as its own chunk.
    up.plans["m"] = Plan("no_blank_lines")
    served = await start_relay(nursery, config(up), tmp_path)
    r = await client.post(served.url + CHAT, json=chat("up/m", stream=True))
    events = sse_data(r.content)
    assert events[-1] == "[DONE]"
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events
                   if isinstance(e, dict) and e.get("choices")) == TEXT
    await wait_for(lambda: len(records(tmp_path)) >= 1)
    assert "skipped_events" not in records(tmp_path)[0]


def test_sse_lines_end_at_cr_lf_and_crlf_only() -> None:
    stream = ("data: a\u2028b\u2029c\u0085d\x0be\x0cf\x1cg\r\n\r\n"   # CRLF
              "data: two\r\rdata: three\n\n"                          # CR, LF
              ": a comment\nevent: named\ndata: x\ndata: y\n\n").encode()
    expected = [(None, "a\u2028b\u2029c\u0085d\x0be\x0cf\x1cg"), (None, "two"),
                (None, "three"), ("named", "x\ny")]
    whole = list(SSEDecoder().feed(stream))
    assert whole == expected
    # The same bytes in every split, one byte at a time included (a CRLF split in two).
    for size in (1, 2, 3, 7):
        decoder = SSEDecoder()
        got = [e for i in range(0, len(stream), size) for e in
               decoder.feed(stream[i:i + size])]
        assert got + list(decoder.end()) == expected, size


def test_sse_decoder_keeps_what_a_body_leaves_unfinished() -> None:
    decoder = SSEDecoder()
    assert list(decoder.feed(b"\xef\xbb\xbfdata: first\n\ndata: last")) == [(None, "first")]
    assert list(decoder.end()) == [(None, "last")]


def test_an_sse_line_is_refused_before_it_is_buffered_past_the_bound() -> None:
    decoder = SSEDecoder(max_bytes=1000)
    list(decoder.feed(b"data: " + b"a" * 990))
    with pytest.raises(SSETooLarge, match="1000 bytes"):
        list(decoder.feed(b"a" * 100))
    assert len(decoder._partial) <= 1000
    with pytest.raises(SSETooLarge):
        list(SSEDecoder(max_bytes=1000).feed(b"data: " + b"a" * 1000 + b"\n"))


def test_an_sse_event_is_bounded_across_its_data_lines() -> None:
    decoder = SSEDecoder(max_bytes=1000)
    with pytest.raises(SSETooLarge, match="event"):
        list(decoder.feed(b"data: " + b"a" * 400 + b"\n" + (b"data: " + b"b" * 400 + b"\n") * 2))


def test_the_sse_decoder_is_linear_in_the_bytes_it_is_fed() -> None:
    # Just under the 8 MiB bound, in 1 KiB pieces: rescanning the unfinished line on
    # every piece would touch ~32 GB; reading each byte once takes milliseconds.
    decoder = SSEDecoder()
    piece = b"a" * 1024
    started = time.perf_counter()
    assert list(decoder.feed(b"data: ")) == []
    for _ in range(MAX_SSE_BYTES // 1024 - 1):
        assert list(decoder.feed(piece)) == []
    events = list(decoder.feed(b"\n\n"))
    assert time.perf_counter() - started < 3.0
    assert len(events) == 1 and len(events[0][1]) == MAX_SSE_BYTES - 1024


async def test_a_stream_answer_is_bounded_too(nursery: trio.Nursery, tmp_path: Path,
                                             up: Hostile, client: httpx.AsyncClient) -> None:
    # 33 MiB of answer text in valid 64 KiB deltas: past max_upstream_bytes.
    up.plans["m"] = Plan("long_stream", size=DEFAULT_BOUND + MiB)
    served = await start_relay(nursery, config(up), tmp_path)
    async with client.stream("POST", served.url + CHAT,
                             json=chat("up/m", stream=True)) as r:
        assert r.status_code == 200
        last = b""
        async for piece in r.aiter_bytes():
            last = (last + piece)[-4 * PIECE:]
    tail = last.decode("utf-8", "replace")
    assert "[DONE]" not in tail
    error = json.loads(tail[tail.rindex("data: {") + 6:].split("\n\n")[0])["error"]
    assert error["code"] == "bad_upstream_response"
    assert "max_upstream_bytes" in error["message"]


# --- 2. the 64 KiB bound on the provider's words -------------------------------------------

async def test_a_huge_error_body_is_cut_with_the_length_read(
        nursery: trio.Nursery, tmp_path: Path, up: Hostile,
        client: httpx.AsyncClient) -> None:
    up.plans["m"] = Plan("echo_401", size=5 * MiB)
    served = await start_relay(nursery, config(up), tmp_path)
    r = await client.post(served.url + CHAT, json=chat("up/m"))
    err = e1(r, 502, "auth_required")
    words, message = err["relay"]["upstream_message"], err["message"]
    assert utf8(words) <= MAX_WORDS_BYTES and utf8(message) <= MAX_WORDS_BYTES
    # Reading stopped at a bound (an error body is read up to 1 MiB): "≥ N bytes".
    marker = words[words.rindex("… [≥ "):]
    read = int(marker.removeprefix("… [≥ ").removesuffix(" bytes]"))
    assert MiB < read < 5 * MiB
    assert words.startswith('{"error": {"message": "Incorrect API key provided.')
    # relay's summary before the words and its advice after them are whole.
    assert message.startswith("provider 'up' answered 401: {\"error\"")
    assert marker in message
    assert message.endswith("Authentication failed: check the provider's API key or login.")


async def test_error_words_over_64_KiB_read_whole_give_their_length(
        nursery: trio.Nursery, tmp_path: Path, up: Hostile,
        client: httpx.AsyncClient) -> None:
    up.plans["m"] = Plan("echo_401", size=100 * 1024)
    served = await start_relay(nursery, config(up), tmp_path)
    r = await client.post(served.url + CHAT, json=chat("up/m"))
    err = e1(r, 502, "auth_required")
    words = err["relay"]["upstream_message"]
    assert utf8(words) <= MAX_WORDS_BYTES
    assert words.startswith("Incorrect API key provided.")
    length = int(words[words.rindex("… [") + 3:].removesuffix(" bytes]"))
    assert 100 * 1024 <= length < 110 * 1024  # the words' whole length: nothing unread
    assert err["message"].endswith("check the provider's API key or login.")


def test_bound_text_keeps_the_head_and_a_marker() -> None:
    assert bound_text("short") == "short"
    exact = "é" * (MAX_WORDS_BYTES // 2)
    assert bound_text(exact) == exact
    cut = bound_text("é" * MAX_WORDS_BYTES)
    assert utf8(cut) <= MAX_WORDS_BYTES and cut.endswith(f"… [{2 * MAX_WORDS_BYTES} bytes]")
    assert cut.startswith("ééé")
    # A text already cut at a read bound keeps that count through a second cut.
    read = "x" * 100_000 + "… [≥ 1048577 bytes]"
    assert bound_text(read).endswith("… [≥ 1048577 bytes]")
    assert bound_text(bound_text(read), 1000).endswith("… [≥ 1048577 bytes]")


def test_a_retold_error_keeps_its_advice_and_the_attempts() -> None:
    words = "w" * 200_000
    error = RelayError("upstream_error", f"provider 'a' answered 500: {words}. The provider "
                       "failed on its side.", upstream_message=words)
    assert utf8(error.message) <= MAX_WORDS_BYTES
    assert error.message.endswith("… [200000 bytes]. The provider failed on its side.")
    retold = error.with_message(f"{error.message} (attempts: primary a/m: upstream_error; "
                                "fallback b/m: upstream_error)")
    assert utf8(retold.message) <= MAX_WORDS_BYTES
    assert retold.message.startswith("provider 'a' answered 500: www")
    assert retold.message.endswith("… [200000 bytes]. The provider failed on its side. "
                                   "(attempts: primary a/m: upstream_error; fallback b/m: "
                                   "upstream_error)")
    assert retold.upstream_message == error.upstream_message
    body = retold.body()["error"]
    assert body["message"] == retold.message


# --- 5. secrets are redacted at every exit --------------------------------------------------

async def test_an_echoed_key_is_redacted_everywhere(
        nursery: trio.Nursery, tmp_path: Path, up: Hostile, client: httpx.AsyncClient,
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    monkeypatch.setenv(KEY_ENV, KEY)
    up.plans["m"] = Plan("echo_401")
    up.plans["s"] = Plan("echo_stream")
    text = config(up, server="check_on_start = true", models=("m", "s"), extra=f"""
api_key_env = "{KEY_ENV}"
check_model = "m"
headers = {{ "X-Org" = "{HEADER_SECRET}", "X-Short" = "tiny" }}
""")
    served = await start_relay(nursery, text, tmp_path)
    provider = served.relay.providers["up"]
    await wait_for(lambda: provider.state == "failing")  # the start-up check ran
    # The upstream really did echo them: relay had them in hand.
    assert KEY in up.requests[0].headers["authorization"]
    assert up.requests[0].headers["x-org"] == HEADER_SECRET

    r = await client.post(served.url + CHAT, json=chat("up/m"))
    err = e1(r, 502, "auth_required")
    assert "[redacted]" in err["message"] and "[redacted]" in err["relay"]["upstream_message"]
    assert '"x-short": "tiny"' in err["relay"]["upstream_message"]  # short values stay

    status = (await client.get(served.url + "/relay/v1/status")).json()
    warning = status["providers"]["up"]["warning"]
    assert "Incorrect API key provided" in warning and "[redacted]" in warning

    s = await client.post(served.url + CHAT, json=chat("up/s", stream=True))
    assert s.status_code == 200 and sse_events(s.text)[-1] == "[DONE]"
    await wait_for(lambda: len(records(tmp_path)) >= 3)
    skipped = [e for rec in records(tmp_path) for e in rec.get("skipped_events", ())]
    assert skipped and all("[redacted]" in e for e in skipped)

    checked = [rec for rec in caplog.records if rec.getMessage().startswith("check up:")]
    assert checked and "[redacted]" in checked[0].getMessage()
    for where, said in [("client", r.text), ("status", json.dumps(status)),
                        ("log", caplog.text), ("records", (tmp_path / "records.jsonl")
                                               .read_text()),
                        ("recent", json.dumps(served.relay.records.recent))]:
        assert KEY not in said and HEADER_SECRET not in said, where


async def test_exception_text_in_any_log_line_is_redacted(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gemini_key = "AIzaSyHOSTILE-test-key-0123456789"
    monkeypatch.setenv("GEMINI_API_KEY", gemini_key)
    text = """
[server]
records = "records.jsonl"
[providers.g]
adapter = "gemini"
models = ["gemini-x"]
"""
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    log = logging.getLogger("relay.test_hostile")
    log.propagate = False
    log.setLevel(logging.INFO)
    url = ("https://generativelanguage.googleapis.com/v1beta/models/x:generateContent"
           f"?key={gemini_key}")
    try:
        async with relay.open_relay(config_from(text, tmp_path), discover=False) as opened:
            log.addHandler(handler)  # a handler added after the relay opened
            try:
                raise OSError(f"cannot reach {url}")
            except OSError:
                log.exception("request to %s failed", url)
            log.warning("stack", stack_info=True)
            # A reload's new secrets are redacted from then on.
            header = "X-Reloaded-Secret-Value"
            reloaded = config_from(text.replace('models = ["gemini-x"]', f'models = '
                                   f'["gemini-x"]\nheaders = {{ "X-A" = "{header}" }}'),
                                   tmp_path)
            await opened.reload(reloaded)
            log.info("header %s", header)
        logged = out.getvalue()
        assert gemini_key not in logged and header not in logged, logged
        assert "OSError: cannot reach https://generativelanguage.googleapis.com/v1beta/models/" \
               "x:generateContent?key=[redacted]" in logged
        assert "header [redacted]" in logged
        # Once the relay has closed, its secrets are no longer held.
        assert gemini_key not in redact.active()
    finally:
        log.removeHandler(handler)
        log.propagate = True
        log.setLevel(logging.NOTSET)


def test_config_lists_every_configured_secret(tmp_path: Path) -> None:
    text = """
[server]
records = "records.jsonl"
token_env = "RELAY_TOKEN_T"
[providers.o]
adapter = "openai"
preset = "openai"
headers = { "X-Org" = "org-header-value" }
proxy = "http://user:proxy-password-1@127.0.0.1:3128"
[providers.c]
adapter = "claude-cli"
command = "claude"
env = { SOME_TOKEN = "cli-env-secret-value", RETRIES = "0" }
"""
    env = {"RELAY_TOKEN_T": "relay-token-value", "OPENAI_API_KEY": "sk-openai-value"}
    config = config_from(text, tmp_path, environ=env)
    secrets = set(config.secrets(env))
    assert {"relay-token-value", "sk-openai-value", "org-header-value",
            "http://user:proxy-password-1@127.0.0.1:3128", "proxy-password-1",
            "cli-env-secret-value", "0"} <= secrets
    redact.install(test_config_lists_every_configured_secret, secrets)
    try:
        assert redact.redact("key sk-openai-value, retries 0") == "key [redacted], retries 0"
    finally:
        redact.uninstall(test_config_lists_every_configured_secret)
    assert "sk-openai-value" not in repr(config)


def test_max_upstream_bytes_is_validated(tmp_path: Path) -> None:
    assert config_from("[server]\n", tmp_path).server.max_upstream_bytes == DEFAULT_BOUND
    with pytest.raises(relay.ConfigError, match="max_upstream_bytes"):
        config_from("[server]\nmax_upstream_bytes = 10\n", tmp_path)
