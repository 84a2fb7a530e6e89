"""What every dialect shares: relay's one internal chat request (`ChatInput`), a finished
answer (`Answer`), and the protocols a dialect implements (`Dialect`, `StreamEncoder`).

A dialect is pure: it parses a body into a `ChatInput`, renders an `Answer` or an error
body, and encodes stream events into bytes. It does no I/O and knows nothing of lanes,
providers or HTTP; the front's writers call it.
"""

from __future__ import annotations

import json
from typing import Any, Protocol

import attrs

from relay.vocab.errors import RelayError
from relay.vocab.events import Delta, Finish, Inbound, Usage

__all__ = ["Answer", "ChatInput", "Dialect", "StreamEncoder", "dumps", "merge_delta",
           "new_choice"]


# json.dumps with any argument builds a new encoder per call (a third of its time for a
# stream's chunk): one, made once, does the same.
_encode = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode


def dumps(obj: Any) -> bytes:
    return _encode(obj).encode()


@attrs.define(kw_only=True)
class ChatInput:
    """A chat request in relay's own terms (OpenAI's message shapes), whatever dialect
    it arrived in; ``inbound``: what the field policy needs of the client's own request
    (SPEC A1a, `relay.vocab.events.Inbound`)."""

    model: str
    messages: list[dict[str, Any]]
    stream: bool
    params: dict[str, Any]
    fallbacks: Any = None
    include_usage: bool = False
    # The request as a client of the Responses API sent it, for a provider that speaks
    # Responses itself (SPEC A7); None for every other dialect.
    responses: dict[str, Any] | None = None
    inbound: Inbound = attrs.field(factory=Inbound)


@attrs.define(kw_only=True)
class Answer:
    """A finished plain answer: choices in OpenAI's message shape, by index."""

    id: str
    created: int
    model: str
    choices: dict[int, dict[str, Any]]
    usage: Usage | None


class StreamEncoder(Protocol):
    def begin(self, model: str) -> None: ...
    def delta(self, event: Delta) -> bytes: ...
    def finish(self, event: Finish) -> bytes: ...
    def set_usage(self, usage: Usage) -> None: ...
    def done(self) -> bytes: ...
    def error(self, error: RelayError) -> bytes: ...


class Dialect(Protocol):
    name: str

    def parse(self, body: bytes) -> ChatInput: ...
    def error_body(self, error: RelayError) -> dict[str, Any]: ...
    def render(self, answer: Answer) -> dict[str, Any]: ...
    def encoder(self, request_id: str, created: int,
                include_usage: bool) -> StreamEncoder: ...


def new_choice(index: int) -> dict[str, Any]:
    return {"index": index, "message": {"role": "assistant", "content": None},
            "finish_reason": None}


def merge_delta(choice: dict[str, Any], delta: Delta) -> None:
    """Fold one delta into a choice in OpenAI's message shape (tool calls by index)."""
    message = choice["message"]
    if delta.content is not None:
        message["content"] = (message["content"] or "") + delta.content
    for call in delta.tool_calls or ():
        calls = message.setdefault("tool_calls", [])
        index = call.get("index", len(calls))
        while len(calls) <= index:
            calls.append({"id": None, "type": "function",
                          "function": {"name": "", "arguments": ""}})
        slot = calls[index]
        if call.get("id"):
            slot["id"] = call["id"]
        if call.get("type"):
            slot["type"] = call["type"]
        function = call.get("function") or {}
        if function.get("name"):
            slot["function"]["name"] += function["name"]
        if function.get("arguments"):
            args = function["arguments"]
            slot["function"]["arguments"] += args if isinstance(args, str) else json.dumps(args)
    for key, value in (delta.extra or {}).items():
        old = message.get(key)
        message[key] = old + value if isinstance(old, str) and isinstance(value, str) else value
