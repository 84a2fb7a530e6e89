"""A hostile upstream on loopback: an HTTP server that answers like a provider gone wrong.

It speaks enough of three wire formats — OpenAI chat completions (``POST
…/chat/completions``), Anthropic Messages (``POST …/messages``) and Gemini
(``POST …/models/M:generateContent`` / ``:streamGenerateContent``) — to misbehave in
each, and picks the misbehaviour by model name (`Hostile.plans`)::

    up = await nursery.start(serve_fake, Hostile)
    up.plans["m"] = Plan("huge", size=64 * MiB)

Plans (``size`` is the body's length, decompressed for ``gzip_bomb``):

- ``huge``: a valid, complete JSON answer of exactly ``size`` bytes, sent lazily;
- ``gzip_bomb``: the same answer gzip-compressed (``content-encoding: gzip``): a few KB
  on the wire for every MB it inflates to;
- ``bad_gzip``: ``content-encoding: gzip`` over bytes that are not gzip;
- ``sse_unterminated``: a 200 SSE stream whose first line is ``data: `` and ``size``
  bytes with no line end, then the body ends;
- ``separators``: a normal stream (or answer) whose text holds raw U+2028, U+2029 and
  U+0085 inside the JSON strings, as llama.cpp, vLLM and LM Studio send them;
  ``TEXT`` is what the client must get;
- ``echo_401``: a 401 whose body echoes every request header (the key among them), and
  is padded with its message repeated to ``size`` bytes;
- ``echo_stream``: a stream whose first event is not JSON and echoes the request
  headers, then a normal answer;
- ``long_stream``: a valid stream of ``size`` bytes of answer text in 64 KiB deltas;
- ``no_blank_lines``: an OpenAI stream whose events are ``data:`` lines with no blank
  line between them (so, to an SSE reader, one event of many lines); text ``TEXT``.

Observations: `sent` counts the body bytes each model's answers put on the wire before
the peer stopped taking them (the server sends in 64 KiB pieces, so a reader that stops
early is visible); the requests and connections are `FakeServer`'s.
"""

from __future__ import annotations

import json
import zlib
from functools import cache
from typing import Any, Literal

import attrs
import h11
import trio

from fakes.fake_http import Exchange, FakeServer, serve_fake

__all__ = ["PIECE", "TEXT", "Hostile", "MiB", "Plan", "gzip_answer", "serve_hostile"]

MiB = 1024 * 1024
PIECE = 64 * 1024
TEXT = "line one\u2028line two\u2029para\u0085next — done"  # what `separators` says

Kind = Literal["huge", "gzip_bomb", "bad_gzip", "sse_unterminated", "separators",
               "echo_401", "echo_stream", "long_stream", "no_blank_lines"]


@attrs.define
class Plan:
    kind: Kind
    size: int = 0


def _answer_parts(size: int) -> tuple[bytes, bytes, int]:
    """An OpenAI chat completion of exactly ``size`` bytes: its head, its tail, and how
    many filler bytes of content go between them."""
    head = b'{"id":"chatcmpl-h","object":"chat.completion","created":1,"model":"m",' \
           b'"choices":[{"index":0,"message":{"role":"assistant","content":"'
    tail = b'"},"finish_reason":"stop"}]}'
    return head, tail, max(0, size - len(head) - len(tail))


@cache
def gzip_answer(size: int) -> bytes:
    """`_answer_parts` of ``size`` bytes, gzip-compressed (computed once per size)."""
    head, tail, filler = _answer_parts(size)
    comp = zlib.compressobj(9, zlib.DEFLATED, zlib.MAX_WBITS | 16)
    out = [comp.compress(head)]
    block = b"a" * MiB
    for _ in range(filler // MiB):
        out.append(comp.compress(block))
    out.append(comp.compress(b"a" * (filler % MiB)))
    out.append(comp.compress(tail))
    out.append(comp.flush())
    return b"".join(out)


class Hostile(FakeServer):
    def __init__(self, port: int) -> None:
        super().__init__(port)
        self.url = f"{self.base_url}/v1"
        self.plans: dict[str, Plan] = {}
        self.sent: dict[str, int] = {}

    async def respond(self, exchange: Exchange) -> None:
        path = exchange.path
        body = exchange.json if isinstance(exchange.json, dict) else {}
        if path.endswith("/chat/completions"):
            dialect, model = "openai", str(body.get("model"))
        elif path.endswith("/messages"):
            dialect, model = "anthropic", str(body.get("model"))
        elif ":" in path and "/models/" in path:
            dialect, model = "gemini", path.rpartition("/models/")[2].partition(":")[0]
        else:
            await exchange.send_json(404, {"error": {"message": f"no route {path}"}})
            return
        plan = self.plans.get(model)
        if plan is None:
            await exchange.send_json(404, {"error": {"message": f"no plan for {model}"}})
            return
        stream = bool(body.get("stream")) or "streamGenerateContent" in path
        await _PLANS[plan.kind](self, exchange, plan, model, dialect, stream)

    # --- sending -----------------------------------------------------------------------
    async def start(self, ex: Exchange, status: int, headers: dict[str, str]) -> None:
        await ex._c.send(h11.Response(status_code=status, headers=list(headers.items())))

    async def send(self, ex: Exchange, model: str, data: bytes) -> None:
        """Send ``data`` in `PIECE`-sized writes, counting what the peer took."""
        for i in range(0, len(data), PIECE):
            await ex.send_raw(data[i:i + PIECE])
            self.sent[model] = self.sent.get(model, 0) + len(data[i:i + PIECE])

    async def send_filler(self, ex: Exchange, model: str, n: int, byte: bytes = b"a") -> None:
        block = byte * PIECE
        while n > 0:
            await self.send(ex, model, block[:n])
            n -= PIECE


# --- the plans -------------------------------------------------------------------------------

async def _huge(up: Hostile, ex: Exchange, plan: Plan, model: str, dialect: str,
                stream: bool) -> None:
    head, tail, filler = _answer_parts(plan.size)
    await up.start(ex, 200, {"content-type": "application/json",
                             "content-length": str(plan.size)})
    await up.send(ex, model, head)
    await up.send_filler(ex, model, filler)
    await up.send(ex, model, tail)
    await ex.end()


async def _gzip_bomb(up: Hostile, ex: Exchange, plan: Plan, model: str, dialect: str,
                     stream: bool) -> None:
    data = gzip_answer(plan.size)
    await up.start(ex, 200, {"content-type": "application/json", "content-encoding": "gzip",
                             "content-length": str(len(data))})
    await up.send(ex, model, data)
    await ex.end()


async def _bad_gzip(up: Hostile, ex: Exchange, plan: Plan, model: str, dialect: str,
                    stream: bool) -> None:
    data = b"this is not gzip, whatever the header says " * 20
    headers = {"content-encoding": "gzip", "content-length": str(len(data)),
               "content-type": "text/event-stream" if stream else "application/json"}
    await up.start(ex, 200, headers)
    await up.send(ex, model, data)
    await ex.end()


async def _sse_unterminated(up: Hostile, ex: Exchange, plan: Plan, model: str,
                            dialect: str, stream: bool) -> None:
    await ex.start_sse()
    await up.send(ex, model, b"data: ")
    await up.send_filler(ex, model, plan.size)
    await ex.end()


def _openai_chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {"id": "chatcmpl-h", "object": "chat.completion.chunk", "created": 1,
            "model": "m", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def _stream_events(dialect: str, pieces: list[str]) -> list[bytes]:
    """A complete, valid stream in ``dialect`` whose text is ``pieces`` joined; raw
    UTF-8 (``ensure_ascii=False``), as local servers send it."""
    def data(obj: Any, event: str | None = None) -> bytes:
        line = f"data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode()
        return (f"event: {event}\n".encode() + line) if event else line

    if dialect == "openai":
        return ([data(_openai_chunk({"role": "assistant"}))]
                + [data(_openai_chunk({"content": p})) for p in pieces]
                + [data(_openai_chunk({}, "stop")), b"data: [DONE]\n\n"])
    if dialect == "anthropic":
        start = {"type": "message_start", "message": {
            "id": "msg_h", "type": "message", "role": "assistant", "model": "m",
            "content": [], "stop_reason": None, "usage": {"input_tokens": 1,
                                                          "output_tokens": 0}}}
        return ([data(start, "message_start"),
                 data({"type": "content_block_start", "index": 0,
                       "content_block": {"type": "text", "text": ""}}, "content_block_start")]
                + [data({"type": "content_block_delta", "index": 0,
                         "delta": {"type": "text_delta", "text": p}}, "content_block_delta")
                   for p in pieces]
                + [data({"type": "content_block_stop", "index": 0}, "content_block_stop"),
                   data({"type": "message_delta", "delta": {"stop_reason": "end_turn"},
                         "usage": {"output_tokens": 3}}, "message_delta"),
                   data({"type": "message_stop"}, "message_stop")])
    out = []
    for i, p in enumerate(pieces):
        cand: dict[str, Any] = {"content": {"role": "model", "parts": [{"text": p}]},
                                "index": 0}
        if i == len(pieces) - 1:
            cand["finishReason"] = "STOP"
        out.append(data({"candidates": [cand], "modelVersion": "m"}))
    return out


def _whole(dialect: str, text: str) -> dict[str, Any]:
    if dialect == "openai":
        return {"id": "chatcmpl-h", "object": "chat.completion", "created": 1, "model": "m",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                             "finish_reason": "stop"}]}
    if dialect == "anthropic":
        return {"id": "msg_h", "type": "message", "role": "assistant", "model": "m",
                "content": [{"type": "text", "text": text}], "stop_reason": "end_turn",
                "usage": {"input_tokens": 1, "output_tokens": 3}}
    return {"candidates": [{"content": {"role": "model", "parts": [{"text": text}]},
                            "finishReason": "STOP", "index": 0}]}


async def _separators(up: Hostile, ex: Exchange, plan: Plan, model: str, dialect: str,
                      stream: bool) -> None:
    if not stream:
        await ex.send_json(200, _whole(dialect, TEXT))
        return
    # Split so a separator sits inside a JSON string of every event but the last.
    pieces = ["line one\u2028line", " two\u2029para", "\u0085next", " — done"]
    assert "".join(pieces) == TEXT
    await ex.start_sse()
    for event in _stream_events(dialect, pieces):
        await up.send(ex, model, event)
    await ex.end()


def _echo(ex: Exchange) -> str:
    """The request's headers, the key first (as a careless server's error page has it)."""
    headers = ex.request.headers
    first = {k: headers[k] for k in ("authorization", "x-api-key", "x-goog-api-key", "x-org")
             if k in headers}
    return "request headers: " + json.dumps({**first, **headers})


async def _echo_401(up: Hostile, ex: Exchange, plan: Plan, model: str, dialect: str,
                    stream: bool) -> None:
    said = f"Incorrect API key provided. {_echo(ex)}."
    message = " ".join([said] * (plan.size // (len(said) + 1) + 1))
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error",
                                 "code": "invalid_api_key"}}).encode()
    await up.start(ex, 401, {"content-type": "application/json",
                             "content-length": str(len(body))})
    await up.send(ex, model, body)
    await ex.end()


async def _echo_stream(up: Hostile, ex: Exchange, plan: Plan, model: str, dialect: str,
                       stream: bool) -> None:
    await ex.start_sse()
    await up.send(ex, model, f"data: not JSON; {_echo(ex)}\n\n".encode())
    for event in _stream_events(dialect, ["hello"]):
        await up.send(ex, model, event)
    await ex.end()


async def _long_stream(up: Hostile, ex: Exchange, plan: Plan, model: str, dialect: str,
                       stream: bool) -> None:
    await ex.start_sse()
    piece = "a" * PIECE
    for i in range(0, plan.size, PIECE):
        chunk = _openai_chunk({"content": piece[:plan.size - i]})
        await up.send(ex, model, f"data: {json.dumps(chunk)}\n\n".encode())
    await up.send(ex, model, f"data: {json.dumps(_openai_chunk({}, 'stop'))}\n\n".encode())
    await up.send(ex, model, b"data: [DONE]\n\n")
    await ex.end()


async def _no_blank_lines(up: Hostile, ex: Exchange, plan: Plan, model: str, dialect: str,
                          stream: bool) -> None:
    await ex.start_sse()
    for event in _stream_events("openai", ["line one\u2028line", " two\u2029para",
                                           "\u0085next", " — done"]):
        await up.send(ex, model, event.replace(b"\n\n", b"\n"))
    await ex.end()


_PLANS = {"huge": _huge, "gzip_bomb": _gzip_bomb, "bad_gzip": _bad_gzip,
          "sse_unterminated": _sse_unterminated, "separators": _separators,
          "echo_401": _echo_401, "echo_stream": _echo_stream, "long_stream": _long_stream,
          "no_blank_lines": _no_blank_lines}


async def serve_hostile(*, task_status: trio.TaskStatus[Hostile] = trio.TASK_STATUS_IGNORED
                        ) -> None:
    """Serve a `Hostile` on 127.0.0.1 (a free port) until cancelled."""
    await serve_fake(Hostile, task_status=task_status)
