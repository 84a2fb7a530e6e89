"""The Anthropic Messages dialect, answers: relay's `Answer` and stream events rendered
as Anthropic's shapes, and errors as Anthropic's error bodies (SPEC A6, E1).
`relay.dialects.anthropic_messages` parses the requests; see its docstring for the
translation tables.
"""

from __future__ import annotations

import json
from typing import Any

from relay.dialects.base import Answer, dumps
from relay.vocab.errors import RelayError
from relay.vocab.events import Delta, Finish, Usage

__all__ = ["STOP_REASONS", "AnthropicRender", "AnthropicStream"]


# relay's finish_reason → Anthropic's stop_reason.
STOP_REASONS: dict[str, str] = {
    "stop": "end_turn",
    "length": "max_tokens",
    "tool_calls": "tool_use",
    "function_call": "tool_use",
    "content_filter": "refusal",
}
# An error's Anthropic type: by relay reason first, then by HTTP status.
_TYPE_BY_REASON: dict[str, str] = {
    "auth_required": "authentication_error",
    "quota_exhausted": "billing_error",
}
_TYPE_BY_STATUS: dict[int, str] = {
    400: "invalid_request_error", 401: "authentication_error", 402: "billing_error",
    403: "permission_error", 404: "not_found_error", 408: "timeout_error",
    413: "request_too_large", 429: "rate_limit_error", 504: "timeout_error",
    529: "overloaded_error",
}
def _tool_input(arguments: Any) -> dict[str, Any]:
    if isinstance(arguments, dict):
        return arguments
    try:
        value = json.loads(arguments) if arguments else {}
    except (TypeError, ValueError):
        value = None
    # A model's arguments that are not a JSON object still reach the client, whole.
    return value if isinstance(value, dict) else {"_arguments": arguments}


def _usage(usage: Usage | None) -> dict[str, int]:
    """Anthropic's usage (SPEC L12a): ``input_tokens`` is the uncached part of the prompt,
    beside the cache reads and writes (0 when the provider did not say, as Anthropic
    always gives both)."""
    if usage is None:
        return {"input_tokens": 0, "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": 0, "output_tokens": 0}
    read, write = usage.cache_read_tokens or 0, usage.cache_write_tokens or 0
    return {"input_tokens": max(0, (usage.prompt_tokens or 0) - read - write),
            "cache_creation_input_tokens": write, "cache_read_input_tokens": read,
            "output_tokens": usage.completion_tokens or 0}


class AnthropicRender:
    """Answers, stream encoders and error bodies in Anthropic's Messages shapes (the
    dialect, `relay.dialects.anthropic_messages.ANTHROPIC`, adds the parsing)."""

    def error_body(self, error: RelayError) -> dict[str, Any]:
        kind = _TYPE_BY_REASON.get(error.reason) or _TYPE_BY_STATUS.get(error.status) or (
            "api_error" if error.status >= 500 else "invalid_request_error")
        relay = {**error.body()["error"]["relay"], "code": error.reason,
                 "param": error.param}
        return {"type": "error",
                "error": {"type": kind, "message": error.message, "relay": relay}}

    def render(self, answer: Answer) -> dict[str, Any]:
        choice = answer.choices.get(0) or {"message": {}, "finish_reason": None}
        message = choice["message"]
        content: list[dict[str, Any]] = []
        if message.get("reasoning_content") or message.get("reasoning_signature"):
            # The signature is the provider's (Anthropic), byte for byte, or none.
            content.append({"type": "thinking",
                            "thinking": message.get("reasoning_content") or "",
                            "signature": message.get("reasoning_signature") or ""})
        if isinstance(message.get("redacted_thinking"), str):
            content.append({"type": "redacted_thinking", "data": message["redacted_thinking"]})
        if message.get("content"):
            content.append({"type": "text", "text": message["content"]})
        for k, call in enumerate(message.get("tool_calls") or ()):
            fn = call.get("function") or {}
            content.append({"type": "tool_use", "id": call.get("id") or f"toolu_{k}",
                            "name": fn.get("name") or "",
                            "input": _tool_input(fn.get("arguments"))})
        return {"id": f"msg_{answer.id}", "type": "message", "role": "assistant",
                "model": answer.model, "content": content,
                "stop_reason": STOP_REASONS.get(choice.get("finish_reason") or "", "end_turn"),
                "stop_sequence": None, "usage": _usage(answer.usage)}

    def encoder(self, request_id: str, created: int, include_usage: bool) -> AnthropicStream:
        return AnthropicStream(request_id)


def _event(name: str, obj: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + dumps(obj) + b"\n\n"


class AnthropicStream:
    """Anthropic's SSE: ``message_start``, then content blocks (``content_block_start``,
    ``…_delta``, ``…_stop``) opened as the answer's kind changes (text, a tool call,
    thinking), then ``message_delta`` (stop reason, usage) and ``message_stop``. A failure
    after the headers is ``event: error`` and the stream ends."""

    def __init__(self, request_id: str) -> None:
        self.id = f"msg_{request_id}"
        self.model = ""
        self.begin("")

    def begin(self, model: str) -> None:
        self.model = model
        self.started = False
        self.block: tuple[str, int] | None = None  # ("text"|"thinking", 0) or ("tool", k)
        self.index = -1
        self.stop_reason: str | None = None
        self.usage: Usage | None = None

    def _start(self) -> bytes:
        if self.started:
            return b""
        self.started = True
        return _event("message_start", {"type": "message_start", "message": {
            "id": self.id, "type": "message", "role": "assistant", "model": self.model,
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": _usage(None)}})

    def _close(self) -> bytes:
        if self.block is None:
            return b""
        self.block = None
        return _event("content_block_stop", {"type": "content_block_stop",
                                             "index": self.index})

    def _open(self, key: tuple[str, int], block: dict[str, Any]) -> bytes:
        if self.block == key:
            return b""
        out = self._close()
        self.block, self.index = key, self.index + 1
        return out + _event("content_block_start", {"type": "content_block_start",
                                                    "index": self.index,
                                                    "content_block": block})

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return _event("content_block_delta", {"type": "content_block_delta",
                                              "index": self.index, "delta": delta})

    def delta(self, event: Delta) -> bytes:
        if event.index != 0:
            return b""  # a message has one answer (n is refused on the way in)
        out = self._start()
        extra = event.extra or {}
        reasoning = extra.get("reasoning_content")
        if isinstance(reasoning, str) and reasoning:
            out += self._open(("thinking", 0), {"type": "thinking", "thinking": "",
                                                "signature": ""})
            out += self._delta({"type": "thinking_delta", "thinking": reasoning})
        signature = extra.get("reasoning_signature")
        if isinstance(signature, str) and signature:  # ends its thinking block
            out += self._open(("thinking", 0), {"type": "thinking", "thinking": "",
                                                "signature": ""})
            out += self._delta({"type": "signature_delta", "signature": signature})
            out += self._close()
        redacted = extra.get("redacted_thinking")
        if isinstance(redacted, str):
            out += self._close() + self._open(("redacted", 0), {
                "type": "redacted_thinking", "data": redacted}) + self._close()
        if event.content:
            out += self._open(("text", 0), {"type": "text", "text": ""})
            out += self._delta({"type": "text_delta", "text": event.content})
        for call in event.tool_calls or ():
            k = int(call.get("index", 0))
            fn = call.get("function") or {}
            out += self._open(("tool", k), {
                "type": "tool_use", "id": call.get("id") or f"toolu_{self.id[4:]}_{k}",
                "name": fn.get("name") or "", "input": {}})
            args = fn.get("arguments")
            if args:
                out += self._delta({"type": "input_json_delta", "partial_json": args
                                    if isinstance(args, str) else json.dumps(args)})
        return out

    def finish(self, event: Finish) -> bytes:
        if event.index != 0:
            return b""
        self.stop_reason = STOP_REASONS.get(event.reason, "end_turn")
        return self._start() + self._close()

    def set_usage(self, usage: Usage) -> None:
        self.usage = usage

    def done(self) -> bytes:
        return (self._start() + self._close() + _event("message_delta", {
            "type": "message_delta",
            "delta": {"stop_reason": self.stop_reason or "end_turn", "stop_sequence": None},
            "usage": _usage(self.usage)}) + _event("message_stop", {"type": "message_stop"}))

    def error(self, error: RelayError) -> bytes:
        return _event("error", AnthropicRender().error_body(error))

