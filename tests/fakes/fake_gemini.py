"""A fake Gemini API on loopback, speaking its real wire format.

``POST /v1beta/models/{model}:generateContent`` answers a ``GenerateContentResponse``;
``:streamGenerateContent?alt=sse`` streams them as ``data: {…}`` events separated by
``\\r\\n\\r\\n``, the last candidate chunk carrying ``finishReason`` and
``usageMetadata``. ``GET /v1beta/models`` pages the model list. A missing or wrong key
gets Gemini's own answer — 400 INVALID_ARGUMENT with an ``API_KEY_INVALID`` ErrorInfo.
Misbehaviour is scripted per model::

    fake = await nursery.start(serve_fake_gemini)
    fake.scripts["gemini-x"] = Script(chunks=["a", "b"], omit_finish=True)
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import unquote

import attrs
import trio

from fakes.fake_http import Abort, Exchange, FakeServer, serve_fake

__all__ = ["KEY", "FakeGemini", "Script", "error_body", "serve_fake_gemini"]

KEY = "AIza-test"

STATUS_WORDS = {400: "INVALID_ARGUMENT", 403: "PERMISSION_DENIED", 404: "NOT_FOUND",
                429: "RESOURCE_EXHAUSTED", 500: "INTERNAL", 503: "UNAVAILABLE",
                504: "DEADLINE_EXCEEDED"}


def error_body(status: int, message: str | None = None,
               details: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    err: dict[str, Any] = {"code": status, "message": message or f"fake error {status}",
                           "status": STATUS_WORDS.get(status, "UNKNOWN")}
    if details is not None:
        err["details"] = details
    return {"error": err}


def quota_failure(quota_id: str) -> dict[str, Any]:
    return {"@type": "type.googleapis.com/google.rpc.QuotaFailure", "violations": [{
        "quotaMetric": "generativelanguage.googleapis.com/generate_content_free_tier_requests",
        "quotaId": quota_id, "quotaDimensions": {"location": "global", "model": "gemini-x"},
        "quotaValue": "10"}]}


def retry_info(delay: str) -> dict[str, Any]:
    return {"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": delay}


@attrs.define
class Script:
    """How one model answers. ``cut_after`` drops the connection after that many text
    chunks; ``omit_finish`` ends the stream cleanly without any finishReason;
    ``error_after`` sends an error object as a stream event; ``stall_after`` hangs."""

    status: int = 200
    error: dict[str, Any] | None = None
    headers: dict[str, str] = attrs.field(factory=dict)
    chunks: list[str] = attrs.field(factory=lambda: ["Hello", " world"])
    thoughts: list[str] = attrs.field(factory=list)
    function_calls: list[dict[str, Any]] = attrs.field(factory=list)
    finish_reason: str | None = None
    block_reason: str | None = None
    usage: dict[str, Any] = attrs.field(factory=lambda: {
        "promptTokenCount": 8, "candidatesTokenCount": 2, "thoughtsTokenCount": 1,
        "totalTokenCount": 11})
    first_byte_delay_s: float = 0.0
    chunk_delay_s: float = 0.0
    hang: bool = False
    stall_after: int | None = None
    cut_after: int | None = None
    omit_finish: bool = False
    error_after: int | None = None
    stream_error: dict[str, Any] = attrs.field(
        factory=lambda: error_body(503, "The model is overloaded. Please try again later."))


class FakeGemini(FakeServer):
    def __init__(self, port: int) -> None:
        super().__init__(port)
        self.url = f"{self.base_url}/v1beta"
        self.scripts: dict[str, Script] = {}
        self.default = Script()
        self.models = [("gemini-test-flash", ["generateContent", "countTokens"]),
                       ("text-embedding-test", ["embedContent"]),
                       ("gemini-test-pro", ["generateContent"])]

    async def respond(self, ex: Exchange) -> None:
        if ex.request.headers.get("x-goog-api-key") != KEY:
            await ex.send_json(400, error_body(
                400, "API key not valid. Please pass a valid API key.",
                [{"@type": "type.googleapis.com/google.rpc.ErrorInfo",
                  "reason": "API_KEY_INVALID", "domain": "googleapis.com"}]))
            return
        path = unquote(ex.path)
        if path == "/v1beta/models" and ex.method == "GET":
            await self._models(ex)
            return
        name, _, method = path.removeprefix("/v1beta/models/").partition(":")
        if ex.method == "POST" and path.startswith("/v1beta/models/") and method in (
                "generateContent", "streamGenerateContent"):
            await self._generate(ex, name, stream=method == "streamGenerateContent")
            return
        await ex.send_json(404, error_body(404, f"Not found: {ex.method} {path}"))

    async def _models(self, ex: Exchange) -> None:
        token = dict(p.partition("=")[::2] for p in ex.query.split("&") if p).get("pageToken")
        start = int(token) if token else 0
        page = self.models[start:start + 2]
        body: dict[str, Any] = {"models": [
            {"name": f"models/{m}", "displayName": m, "supportedGenerationMethods": methods}
            for m, methods in page]}
        if start + 2 < len(self.models):
            body["nextPageToken"] = str(start + 2)
        await ex.send_json(200, body)

    async def _generate(self, ex: Exchange, model: str, *, stream: bool) -> None:
        req = ex.json
        if not isinstance(req, dict) or not req.get("contents"):
            await ex.send_json(400, error_body(400, "* GenerateContentRequest.contents: "
                                               "contents is not specified"))
            return
        if stream and "alt=sse" not in ex.query:
            await ex.send_json(400, error_body(400, "this fake streams SSE only"))
            return
        script = self.scripts.get(model, self.default)
        if script.hang:
            await trio.sleep_forever()
        if script.first_byte_delay_s:
            await trio.sleep(script.first_byte_delay_s)
        if script.status != 200:
            await ex.send_json(script.status, script.error or error_body(script.status),
                               script.headers)
            return
        if script.block_reason:
            blocked = {"promptFeedback": {"blockReason": script.block_reason},
                       "usageMetadata": {"promptTokenCount": 8, "totalTokenCount": 8}}
            if stream:
                await ex.start_sse()
                await ex.send_raw(b"data: " + json.dumps(blocked).encode() + b"\r\n\r\n")
                await ex.end()
            else:
                await ex.send_json(200, blocked)
            return
        chunks = list(script.chunks)
        finish = script.finish_reason or "STOP"
        limit = (req.get("generationConfig") or {}).get("maxOutputTokens")
        if isinstance(limit, int) and limit < len(chunks):
            chunks, finish = chunks[:limit], "MAX_TOKENS"
        calls = [] if finish == "MAX_TOKENS" else script.function_calls
        if stream:
            await self._stream(ex, script, chunks, calls, finish)
            return
        parts: list[dict[str, Any]] = [{"text": t, "thought": True} for t in script.thoughts]
        if chunks:
            parts.append({"text": "".join(chunks)})
        parts += [self._call_part(c) for c in calls]
        await ex.send_json(200, {
            "candidates": [{"content": {"parts": parts, "role": "model"},
                            "finishReason": finish, "index": 0}],
            "usageMetadata": script.usage, "modelVersion": model, "responseId": "resp-1"},
            script.headers)

    @staticmethod
    def _call_part(call: dict[str, Any]) -> dict[str, Any]:
        part: dict[str, Any] = {"functionCall": {"name": call["name"], "args": call["args"]}}
        if call.get("signature"):
            part["thoughtSignature"] = call["signature"]
        return part

    async def _stream(self, ex: Exchange, script: Script, chunks: list[str],
                      calls: list[dict[str, Any]], finish: str) -> None:
        async def send(parts: list[dict[str, Any]], last: bool = False) -> None:
            cand: dict[str, Any] = {"content": {"parts": parts, "role": "model"}, "index": 0}
            if last and not script.omit_finish:
                cand["finishReason"] = finish
            obj = {"candidates": [cand], "usageMetadata": script.usage,
                   "modelVersion": "gemini-test", "responseId": "resp-1"}
            await ex.send_raw(b"data: " + json.dumps(obj).encode() + b"\r\n\r\n")

        await ex.start_sse(script.headers)
        for thought in script.thoughts:
            await send([{"text": thought, "thought": True}])
        n = len(chunks)
        for i in range(n):
            if script.stall_after == i:
                await trio.sleep_forever()
            if script.cut_after == i:
                raise Abort
            if script.error_after == i:
                await ex.send_raw(b"data: " + json.dumps(script.stream_error).encode()
                                  + b"\r\n\r\n")
                await ex.end()
                return
            if script.chunk_delay_s:
                await trio.sleep(script.chunk_delay_s)
            await send([{"text": chunks[i]}], last=i == n - 1 and not calls)
        if script.cut_after == n:
            raise Abort
        if calls:
            await send([self._call_part(c) for c in calls], last=True)
        elif not chunks:
            await send([], last=True)
        await ex.end()


async def serve_fake_gemini(
        *, task_status: trio.TaskStatus[FakeGemini] = trio.TASK_STATUS_IGNORED) -> None:
    await serve_fake(FakeGemini, task_status=task_status)
