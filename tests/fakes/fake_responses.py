"""A fake OpenAI-compatible server that speaks the Responses API itself, on loopback.

``POST /v1/responses`` answers a Response object, or — with ``"stream": true`` — the
events OpenAI streams (``response.created`` … ``response.completed``, each with its
``sequence_number``). ``GET /v1/models`` lists its models. Per model a `Script` says what
to answer; by default it plays the model of an agent's tool round trip
(`agent_turns`): a function or custom tool call when asked, then ``RELAY-DONE …``.
Every answer starts with a reasoning item carrying ``encrypted_content``, as OpenAI's
reasoning models answer, so a test can see it passed back. Requests are recorded
(`FakeServer.requests`); ``stored`` counts requests that asked to be stored upstream.

    fake = await nursery.start(serve_fake_responses)
    fake.scripts["m"] = Script(status=429, error=error_body(429, "slow down"))
"""

from __future__ import annotations

import json
from typing import Any

import attrs
import trio

from fakes.agent_turns import decide, from_responses
from fakes.fake_http import Abort, Exchange, FakeServer, serve_fake

__all__ = ["FakeResponses", "Script", "error_body", "serve_fake_responses"]

CREATED = 1_700_000_000


def error_body(status: int, message: str, code: str | None = None) -> dict[str, Any]:
    kind = {401: "invalid_request_error", 429: "rate_limit_error"}.get(
        status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "code": code, "param": None}}


@attrs.define
class Script:
    """How one model answers. ``text`` given: that text in these pieces, no tool call;
    ``failed_after``: a ``response.failed`` event after that many pieces; ``cut_after``:
    the connection dropped after that many pieces; ``incomplete``: ends
    ``response.incomplete`` (max_output_tokens)."""

    status: int = 200
    error: dict[str, Any] | None = None
    text: list[str] | None = None
    failed_after: int | None = None
    cut_after: int | None = None
    incomplete: bool = False
    chunk_delay_s: float = 0.0
    headers: dict[str, str] = attrs.field(factory=dict)  # sent with a 200 (rate limits)


class FakeResponses(FakeServer):
    def __init__(self, port: int) -> None:
        super().__init__(port)
        self.url = f"{self.base_url}/v1"
        self.scripts: dict[str, Script] = {}
        self.models = ["gpt-fake", "gpt-fake-2"]
        self.count = 0

    async def respond(self, ex: Exchange) -> None:
        if ex.path == "/v1/models" and ex.method == "GET":
            await ex.send_json(200, {"object": "list", "data": [
                {"id": m, "object": "model", "created": 0, "owned_by": "fake"}
                for m in self.models]})
        elif ex.path == "/v1/responses" and ex.method == "POST":
            await self._responses(ex)
        else:
            await ex.send_json(404, error_body(404, f"no route {ex.method} {ex.path}"))

    async def _responses(self, ex: Exchange) -> None:
        req = ex.json
        if not isinstance(req, dict) or not isinstance(req.get("model"), str):
            await ex.send_json(400, error_body(400, "you must provide a model parameter"))
            return
        if "fallbacks" in req or "previous_response_id" in req:
            await ex.send_json(400, error_body(400, "unexpected field (relay's own)"))
            return
        script = self.scripts.get(req["model"], Script())
        kind, _, status = decide(from_responses(req))
        if kind == "fail" and req["model"] not in self.scripts:
            script = Script(status=int(status))
        if script.status != 200:
            await ex.send_json(script.status, script.error or error_body(script.status,
                                                                         "fake error"))
            return
        self.count += 1
        rid = f"resp_up{self.count}"
        output = self._output(req, script, rid)
        usage = {"input_tokens": 11, "input_tokens_details": {"cached_tokens": 0},
                 "output_tokens": 7, "output_tokens_details": {"reasoning_tokens": 3},
                 "total_tokens": 18}
        status = "incomplete" if script.incomplete else "completed"
        response = {"id": rid, "object": "response", "created_at": CREATED,
                    "status": status, "model": req["model"], "output": output,
                    "usage": usage, "error": None,
                    "incomplete_details": {"reason": "max_output_tokens"}
                    if script.incomplete else None, "store": req.get("store", True)}
        if req.get("stream") is True:
            await self._stream(ex, script, response)
        else:
            await ex.send_json(200, response, script.headers)

    def _output(self, req: dict[str, Any], script: Script, rid: str) -> list[dict[str, Any]]:
        reasoning = {"id": f"rs_{rid}", "type": "reasoning", "summary": [
            {"type": "summary_text", "text": "thinking it over"}],
            "encrypted_content": f"ENCRYPTED-{rid}"}
        if script.text is not None:
            kind, name, text = "text", "", "".join(script.text)
        else:
            kind, name, text = decide(from_responses(req))
        if kind == "text":
            return [reasoning, {"id": f"msg_{rid}", "type": "message", "status": "completed",
                                "role": "assistant", "content": [
                                    {"type": "output_text", "text": text,
                                     "annotations": []}]}]
        custom = any(t.get("type") == "custom" and t.get("name") == name
                     for t in req.get("tools") or ())
        if custom:
            return [reasoning, {"id": f"ctc_{rid}", "type": "custom_tool_call",
                                "status": "completed", "call_id": f"call_{rid}",
                                "name": name, "input": json.loads(text).get("input", "")}]
        return [reasoning, {"id": f"fc_{rid}", "type": "function_call", "status": "completed",
                            "call_id": f"call_{rid}", "name": name, "arguments": text}]

    async def _stream(self, ex: Exchange, script: Script, response: dict[str, Any]) -> None:
        seq = 0

        async def event(kind: str, **fields: Any) -> None:
            nonlocal seq
            data = json.dumps({"type": kind, **fields, "sequence_number": seq})
            seq += 1
            await ex.send_raw(f"event: {kind}\ndata: {data}\n\n".encode())

        await ex.start_sse(script.headers)
        start = {**response, "status": "in_progress", "output": [], "usage": None}
        await event("response.created", response=start)
        await event("response.in_progress", response=start)
        for index, item in enumerate(response["output"]):
            at = {"output_index": index}
            if item["type"] == "message":
                await event("response.output_item.added", **at,
                            item={**item, "status": "in_progress", "content": []})
                ids = {"item_id": item["id"], **at, "content_index": 0}
                await event("response.content_part.added", **ids,
                            part={"type": "output_text", "text": "", "annotations": []})
                text = item["content"][0]["text"]
                pieces = script.text or [text[:len(text) // 2], text[len(text) // 2:]]
                for i, piece in enumerate(pieces):
                    if script.cut_after == i:
                        raise Abort
                    if script.failed_after == i:
                        await event("response.failed", response={
                            **start, "status": "failed", "error": {
                                "code": "server_error", "message": "FAKE-FAILED mid-way"}})
                        await ex.end()
                        return
                    if script.chunk_delay_s:
                        await trio.sleep(script.chunk_delay_s)
                    await event("response.output_text.delta", **ids, delta=piece)
                await event("response.output_text.done", **ids, text=text)
                await event("response.content_part.done", **ids, part=item["content"][0])
            elif item["type"] == "function_call":
                await event("response.output_item.added", **at,
                            item={**item, "status": "in_progress", "arguments": ""})
                args = item["arguments"]
                for piece in (args[:len(args) // 2], args[len(args) // 2:]):
                    await event("response.function_call_arguments.delta",
                                item_id=item["id"], **at, delta=piece)
                await event("response.function_call_arguments.done", item_id=item["id"],
                            **at, arguments=args)
            elif item["type"] == "custom_tool_call":
                await event("response.output_item.added", **at,
                            item={**item, "status": "in_progress", "input": ""})
                await event("response.custom_tool_call_input.delta", item_id=item["id"],
                            **at, delta=item["input"])
                await event("response.custom_tool_call_input.done", item_id=item["id"],
                            **at, input=item["input"])
            else:
                await event("response.output_item.added", **at, item=item)
            await event("response.output_item.done", **at, item=item)
        final = "response.incomplete" if script.incomplete else "response.completed"
        await event(final, response=response)
        await ex.end()


async def serve_fake_responses(
        *, task_status: trio.TaskStatus[FakeResponses] = trio.TASK_STATUS_IGNORED) -> None:
    await serve_fake(FakeResponses, task_status=task_status)
