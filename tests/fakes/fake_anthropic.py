"""A fake Anthropic Messages API on loopback, speaking its real wire format.

``POST /v1/messages`` answers a message object, or — with ``"stream": true`` — the SSE
events Anthropic documents (``message_start``, ``content_block_start``, ``ping``,
``content_block_delta`` with ``text_delta`` / ``input_json_delta`` / ``thinking_delta``,
``content_block_stop``, ``message_delta``, ``message_stop``; ``error`` on cue). ``GET
/v1/models`` pages the model list. It checks ``x-api-key`` and ``anthropic-version`` as
Anthropic does, and scripts misbehaviour per model::

    fake = await nursery.start(serve_fake_anthropic)
    fake.scripts["claude-x"] = Script(chunks=["a", "b"], cut_after=1)
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import attrs
import trio

from fakes.agent_turns import decide, from_messages
from fakes.fake_http import Abort, Exchange, FakeServer, serve_fake

__all__ = ["KEY", "FakeAnthropic", "Script", "error_body", "serve_fake_anthropic"]

KEY = "sk-ant-test"

TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
         404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
         500: "api_error", 529: "overloaded_error"}


def error_body(status: int, message: str | None = None, kind: str | None = None
               ) -> dict[str, Any]:
    return {"type": "error", "error": {"type": kind or TYPES.get(status, "api_error"),
                                       "message": message or f"fake error {status}"},
            "request_id": "req_fake"}


@attrs.define
class Script:
    """How one model answers.

    ``cut_after`` drops the connection after that many text chunks; ``end_before`` ends
    the body cleanly just before the named event (``message_delta`` or ``message_stop``);
    ``error_after`` sends ``event: error`` (``stream_error``) after that many chunks;
    ``stall_after`` hangs after that many chunks; ``hang`` never answers at all.
    """

    status: int = 200
    error: dict[str, Any] | None = None
    headers: dict[str, str] = attrs.field(factory=dict)
    chunks: list[str] = attrs.field(factory=lambda: ["Hello", " world"])
    tool_uses: list[dict[str, Any]] = attrs.field(factory=list)
    thinking: list[str] = attrs.field(factory=list)
    stop_reason: str | None = None
    usage: dict[str, Any] = attrs.field(factory=lambda: {
        "input_tokens": 12, "cache_read_input_tokens": 3, "output_tokens": 5})
    first_byte_delay_s: float = 0.0
    chunk_delay_s: float = 0.0
    hang: bool = False
    stall_after: int | None = None
    cut_after: int | None = None
    end_before: str | None = None
    error_after: int | None = None
    stream_error: dict[str, Any] = attrs.field(
        factory=lambda: error_body(529, "Overloaded", "overloaded_error"))


class FakeAnthropic(FakeServer):
    def __init__(self, port: int) -> None:
        super().__init__(port)
        self.url = f"{self.base_url}/v1"
        self.scripts: dict[str, Script] = {}
        self.default = Script()
        # Optional: the script for a request, chosen from its body; None: the scripts.
        self.decide: Callable[[Any], Script | None] | None = None
        self.models = ["claude-test-1", "claude-test-2", "claude-test-3"]
        self.page_size = 2
        self.agent = False  # play an agent's model (agent_turns) for unscripted models

    async def respond(self, ex: Exchange) -> None:
        if ex.request.headers.get("x-api-key") != KEY:
            await ex.send_json(401, error_body(401, "invalid x-api-key"))
        elif "anthropic-version" not in ex.request.headers:
            await ex.send_json(400, error_body(400, "anthropic-version: header is required"))
        elif ex.path == "/v1/messages" and ex.method == "POST":
            await self._messages(ex)
        elif ex.path == "/v1/models" and ex.method == "GET":
            await self._models(ex)
        else:
            await ex.send_json(404, error_body(404, f"Not found: {ex.method} {ex.path}"))

    async def _models(self, ex: Exchange) -> None:
        after = dict(p.partition("=")[::2] for p in ex.query.split("&") if p).get("after_id")
        start = self.models.index(after) + 1 if after in self.models else 0
        page = self.models[start:start + self.page_size]
        await ex.send_json(200, {
            "data": [{"type": "model", "id": m, "display_name": m,
                      "created_at": "2025-01-01T00:00:00Z"} for m in page],
            "has_more": start + self.page_size < len(self.models),
            "first_id": page[0] if page else None, "last_id": page[-1] if page else None})

    async def _messages(self, ex: Exchange) -> None:
        req = ex.json
        if not isinstance(req, dict) or not isinstance(req.get("max_tokens"), int):
            await ex.send_json(400, error_body(400, "max_tokens: Field required"))
            return
        script = self.scripts.get(str(req.get("model")), self.default)
        if self.agent and str(req.get("model")) not in self.scripts:
            kind, name, text = decide(from_messages(req))
            if kind == "fail":
                script = Script(status=int(text))
            elif kind == "text":
                script = Script(chunks=[text])
            else:
                script = Script(chunks=[], tool_uses=[{"id": f"toolu_{len(self.requests)}",
                                                       "name": name,
                                                       "input": json.loads(text)}])
        decided = self.decide(req) if self.decide is not None else None
        script = decided or script
        if script.hang:
            await trio.sleep_forever()
        if script.first_byte_delay_s:
            await trio.sleep(script.first_byte_delay_s)
        if script.status != 200:
            await ex.send_json(script.status, script.error or error_body(script.status),
                               script.headers)
            return
        chunks = list(script.chunks)
        stop = script.stop_reason or ("tool_use" if script.tool_uses else "end_turn")
        if req["max_tokens"] < len(chunks):
            chunks, stop = chunks[:req["max_tokens"]], "max_tokens"
        if req.get("stream") is True:
            await self._stream(ex, script, str(req["model"]), chunks, stop)
            return
        content: list[dict[str, Any]] = [{"type": "thinking", "thinking": "".join(
            script.thinking), "signature": "sig"}] if script.thinking else []
        if chunks:
            content.append({"type": "text", "text": "".join(chunks)})
        content += [{"type": "tool_use", **t} for t in script.tool_uses if stop != "max_tokens"]
        await ex.send_json(200, {
            "id": "msg_fake", "type": "message", "role": "assistant", "model": req["model"],
            "content": content, "stop_reason": stop, "stop_sequence": None,
            "usage": script.usage}, script.headers)

    async def _stream(self, ex: Exchange, script: Script, model: str, chunks: list[str],
                      stop: str) -> None:
        async def event(name: str, data: dict[str, Any]) -> None:
            if script.end_before == name:
                await ex.end()
                raise Abort
            await ex.send_raw(f"event: {name}\ndata: {json.dumps(data)}\n\n".encode())

        await ex.start_sse(script.headers)
        await event("message_start", {"type": "message_start", "message": {
            "id": "msg_fake", "type": "message", "role": "assistant", "model": model,
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {**script.usage, "output_tokens": 1}}})
        index = 0
        if script.thinking:
            await event("content_block_start", {"type": "content_block_start", "index": 0,
                        "content_block": {"type": "thinking", "thinking": "",
                                          "signature": ""}})
            for piece in script.thinking:
                await event("content_block_delta", {"type": "content_block_delta",
                            "index": 0, "delta": {"type": "thinking_delta",
                                                  "thinking": piece}})
            await event("content_block_delta", {"type": "content_block_delta", "index": 0,
                        "delta": {"type": "signature_delta", "signature": "sig"}})
            await event("content_block_stop", {"type": "content_block_stop", "index": 0})
            index = 1
        await event("content_block_start", {"type": "content_block_start", "index": index,
                    "content_block": {"type": "text", "text": ""}})
        await event("ping", {"type": "ping"})
        n = len(chunks)
        for i in range(n + 1):
            if script.stall_after == i:
                await trio.sleep_forever()
            if script.cut_after == i:
                raise Abort
            if script.error_after == i:
                await event("error", script.stream_error)
                await ex.end()
                return
            if i == n:
                break
            if script.chunk_delay_s:
                await trio.sleep(script.chunk_delay_s)
            await event("content_block_delta", {"type": "content_block_delta",
                        "index": index, "delta": {"type": "text_delta", "text": chunks[i]}})
        await event("content_block_stop", {"type": "content_block_stop", "index": index})
        for tool in script.tool_uses if stop != "max_tokens" else ():
            index += 1
            await event("content_block_start", {"type": "content_block_start",
                        "index": index, "content_block": {"type": "tool_use",
                                                          "id": tool["id"],
                                                          "name": tool["name"],
                                                          "input": {}}})
            args = json.dumps(tool["input"])
            for piece in ("", args[:len(args) // 2], args[len(args) // 2:]):
                await event("content_block_delta", {"type": "content_block_delta",
                            "index": index, "delta": {"type": "input_json_delta",
                                                      "partial_json": piece}})
            await event("content_block_stop", {"type": "content_block_stop", "index": index})
        await event("message_delta", {"type": "message_delta", "delta": {
            "stop_reason": stop, "stop_sequence": None},
            "usage": {"output_tokens": script.usage.get("output_tokens", 0)}})
        await event("message_stop", {"type": "message_stop"})
        await ex.end()


async def serve_fake_anthropic(
        *, task_status: trio.TaskStatus[FakeAnthropic] = trio.TASK_STATUS_IGNORED) -> None:
    await serve_fake(FakeAnthropic, task_status=task_status)
