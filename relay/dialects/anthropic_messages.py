"""The Anthropic Messages dialect: what clients send to ``/v1/messages`` and what they get
back (SPEC A6), for any provider behind relay.

A Messages request is checked the way Anthropic checks it (a clear 400 naming the field)
and translated into relay's own `ChatInput` — OpenAI's message shapes — so the same
queue, lanes, fallbacks and adapters serve it; the `Answer` and the stream's events are
rendered back as Anthropic's. Translation tables:

==============================  ==========================================================
Messages request                relay (OpenAI shapes)
==============================  ==========================================================
``system`` (string or blocks)   a ``system`` message (blocks joined by blank lines)
text / image / document blocks  text / ``image_url`` (data: or http URL) / ``file`` parts
``tool_use`` (assistant)        ``tool_calls`` with JSON ``arguments``
``tool_result`` (user)          a ``tool`` message (``is_error``: its text says so)
``thinking`` (assistant)        dropped: relay's providers do not take reasoning back
``max_tokens``, ``stop_sequences``, ``temperature``, ``top_p``, ``top_k``: the same
``tools``, ``tool_choice``      function tools; auto/any/tool/none → auto/required/…/none
``metadata.user_id``            ``user``
==============================  ==========================================================

Other fields pass through to the provider as they came (an adapter that cannot honour
one refuses it by name); ``n`` is refused here, since a message has one answer.

Errors keep relay's reason visible: ``{"type": "error", "error": {"type", "message",
"relay": {…E1's relay object, "code", "param"}}}``, with the same HTTP statuses and headers
(``x-should-retry``, ``retry-after``) as the OpenAI dialect.
"""

from __future__ import annotations

import json
from typing import Any

from relay.dialects.base import Answer, ChatInput, dumps
from relay.dialects.openai_chat import INT_MAX, load_request
from relay.dialects.openai_chat import bad_request as _bad
from relay.vocab.errors import RelayError
from relay.vocab.events import Delta, Finish, Usage

__all__ = ["ANTHROPIC", "STOP_REASONS", "AnthropicDialect", "AnthropicStream",
           "parse_messages_body"]


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
_TOOL_CHOICE: dict[str, Any] = {"auto": "auto", "any": "required", "none": "none"}
# The fields this dialect reads itself; everything else passes through.
_OWN = {"model", "messages", "max_tokens", "system", "stream", "stop_sequences",
        "temperature", "top_p", "top_k", "tools", "tool_choice", "metadata", "fallbacks"}


def _number(data: dict[str, Any], key: str, *, whole: bool = False) -> None:
    value = data.get(key)
    kinds = (int,) if whole else (int, float)
    if value is not None and (isinstance(value, bool) or not isinstance(value, kinds)):
        raise _bad(f"'{key}' must be a {'whole number' if whole else 'number'}", key)


# --- request: Messages → relay -------------------------------------------------------------

def _check_source(block: dict[str, Any], where: str, media: tuple[str, ...]) -> str:
    """A base64 or url source → the URL relay's OpenAI shapes use."""
    source = block.get("source")
    if not isinstance(source, dict):
        raise _bad(f"{where}.source must be an object", "messages")
    kind = source.get("type")
    if kind == "base64":
        mime, data = source.get("media_type"), source.get("data")
        if not isinstance(mime, str) or not isinstance(data, str):
            raise _bad(f"{where}.source needs media_type and data", "messages")
        if not mime.startswith(media):
            raise _bad(f"{where}.source.media_type {mime!r} is not one of {media}",
                       "messages")
        return f"data:{mime};base64,{data}"
    if kind == "url" and isinstance(source.get("url"), str):
        return str(source["url"])
    raise RelayError("unsupported", f"{where}.source of type {kind!r}: relay takes base64 "
                     "and url sources", param="messages")


def _tool_text(content: Any, where: str, is_error: bool) -> str:
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    elif isinstance(content, list):
        pieces = []
        for k, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or \
                    not isinstance(part.get("text"), str):
                raise RelayError("unsupported", f"{where}.content[{k}]: relay passes tool "
                                 "results as text blocks only", param="messages")
            pieces.append(part["text"])
        text = "\n".join(pieces)
    else:
        raise _bad(f"{where}.content must be a string or a list of blocks", "messages")
    # OpenAI's tool message has no error flag: the text carries it.
    return f"Error: {text}" if is_error else text


def _user_turn(content: list[Any], where: str) -> list[dict[str, Any]]:
    """One user turn's blocks → tool messages (first) and a user message."""
    tools: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = block["type"]
        if kind == "text":
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image":
            parts.append({"type": "image_url",
                          "image_url": {"url": _check_source(block, at, ("image/",))}})
        elif kind == "document":
            url = _check_source(block, at, ("application/pdf",))
            parts.append({"type": "file", "file": {"file_data": url,
                                                   "filename": "document.pdf"}})
        elif kind == "tool_result":
            if not isinstance(block.get("tool_use_id"), str):
                raise _bad(f"{at}.tool_use_id must be a string", "messages")
            tools.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                          "content": _tool_text(block.get("content"), at,
                                                block.get("is_error") is True)})
        elif kind in ("thinking", "redacted_thinking"):
            continue
        else:
            raise RelayError("unsupported", f"{at}: relay cannot pass a {kind!r} block in a "
                             "user turn", param="messages")
    out = list(tools)
    if parts:
        single = len(parts) == 1 and parts[0]["type"] == "text"
        out.append({"role": "user", "content": parts[0]["text"] if single else parts})
    return out


def _assistant_turn(content: list[Any], where: str) -> dict[str, Any]:
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = block["type"]
        if kind == "text":
            texts.append(block["text"])
        elif kind == "tool_use":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str) \
                    or not isinstance(block.get("input", {}), dict):
                raise _bad(f"{at} needs an id, a name and an input object", "messages")
            calls.append({"id": block["id"], "type": "function", "function": {
                "name": block["name"], "arguments": json.dumps(block.get("input") or {})}})
        elif kind in ("thinking", "redacted_thinking"):
            continue
        else:
            raise RelayError("unsupported", f"{at}: relay cannot pass a {kind!r} block in "
                             "an assistant turn", param="messages")
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or None}
    if calls:
        message["tool_calls"] = calls
    return message


def _blocks(content: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise _bad(f"{where}.content must be a string or a list of content blocks",
                   "messages")
    for j, block in enumerate(content):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise _bad(f"{where}.content[{j}] must be an object with a 'type'", "messages")
        if block["type"] == "text" and not isinstance(block.get("text"), str):
            raise _bad(f"{where}.content[{j}].text must be a string", "messages")
    return content


def _system(system: Any) -> str | None:
    if system is None or isinstance(system, str):
        return system or None
    if not isinstance(system, list):
        raise _bad("'system' must be a string or a list of text blocks", "system")
    texts = []
    for i, block in enumerate(system):
        if not isinstance(block, dict) or block.get("type") != "text" or \
                not isinstance(block.get("text"), str):
            raise _bad(f"system[{i}] must be a text block", "system")
        texts.append(block["text"])
    return "\n\n".join(texts) or None


def _tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise _bad("'tools' must be a list", "tools")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
            raise _bad(f"tools[{i}] must be an object with a 'name'", "tools")
        if tool.get("type") not in (None, "custom"):
            raise RelayError("unsupported", f"tools[{i}]: relay passes client tools only, "
                             f"not Anthropic's server tool {tool['type']!r}", param="tools")
        schema = tool.get("input_schema")
        if not isinstance(schema, dict):
            raise _bad(f"tools[{i}].input_schema must be an object", "tools")
        fn: dict[str, Any] = {"name": tool["name"], "parameters": schema}
        if isinstance(tool.get("description"), str):
            fn["description"] = tool["description"]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: Any, params: dict[str, Any]) -> None:
    kind = choice.get("type") if isinstance(choice, dict) else None
    kind = kind if isinstance(kind, str) else None  # a list or a dict names no choice
    if kind in _TOOL_CHOICE:
        params["tool_choice"] = _TOOL_CHOICE[kind]
    elif kind == "tool" and isinstance(choice.get("name"), str):
        params["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    else:
        raise _bad("'tool_choice' must be {'type': 'auto' | 'any' | 'none'} or "
                   "{'type': 'tool', 'name': …}", "tool_choice")
    if choice.get("disable_parallel_tool_use") is True:
        params["parallel_tool_calls"] = False


def parse_messages_body(body: bytes) -> ChatInput:
    """A Messages request → relay's `ChatInput`.

    Raises:
        RelayError: ``invalid_request`` naming the field; ``unsupported`` for blocks
            relay cannot translate.
    """
    data = load_request(body)
    max_tokens = data.get("max_tokens")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or \
            not 1 <= max_tokens <= INT_MAX:
        raise _bad(f"'max_tokens' is required: a whole number from 1 to {INT_MAX}",
                   "max_tokens")
    raw = data.get("messages")
    if not isinstance(raw, list) or not raw:
        raise _bad("'messages' must be a non-empty list of messages", "messages")
    if not isinstance(data.get("stream", False), bool):
        raise _bad("'stream' must be true or false", "stream")
    for key in ("temperature", "top_p"):
        _number(data, key)
    _number(data, "top_k", whole=True)
    if "n" in data:
        raise _bad("'n' is not a Messages API field: a message has one answer", "n")

    messages: list[dict[str, Any]] = []
    system = _system(data.get("system"))
    if system is not None:
        messages.append({"role": "system", "content": system})
    for i, message in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
            raise _bad(f"{where}.role must be 'user' or 'assistant'", "messages")
        blocks = _blocks(message.get("content"), where)
        if message["role"] == "user":
            messages += _user_turn(blocks, where)
        else:
            messages.append(_assistant_turn(blocks, where))

    params: dict[str, Any] = {"max_tokens": max_tokens}
    stop = data.get("stop_sequences")
    if stop is not None:
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise _bad("'stop_sequences' must be a list of strings", "stop_sequences")
        if stop:
            params["stop"] = stop
    for key in ("temperature", "top_p", "top_k"):
        if data.get(key) is not None:
            params[key] = data[key]
    if data.get("tools") is not None:
        params["tools"] = _tools(data["tools"])
    if data.get("tool_choice") is not None:
        _tool_choice(data["tool_choice"], params)
    metadata = data.get("metadata")
    if metadata is not None:
        if not isinstance(metadata, dict):
            raise _bad("'metadata' must be an object", "metadata")
        if isinstance(metadata.get("user_id"), str):
            params["user"] = metadata["user_id"]
    params.update({k: v for k, v in data.items() if k not in _OWN})
    return ChatInput(model=data["model"], messages=messages, stream=bool(data.get("stream")),
                     params=params, fallbacks=data.get("fallbacks"), include_usage=True)


# --- answers: relay → Messages -------------------------------------------------------------

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
    return {"input_tokens": (usage.prompt_tokens or 0) if usage else 0,
            "output_tokens": (usage.completion_tokens or 0) if usage else 0}


class AnthropicDialect:
    """Requests and answers in Anthropic's Messages shapes."""

    name = "anthropic"

    def parse(self, body: bytes) -> ChatInput:
        return parse_messages_body(body)

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
        if message.get("reasoning_content"):
            content.append({"type": "thinking", "thinking": message["reasoning_content"],
                            "signature": ""})
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
            "usage": {"input_tokens": 0, "output_tokens": 0}}})

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
        reasoning = (event.extra or {}).get("reasoning_content")
        if isinstance(reasoning, str) and reasoning:
            out += self._open(("thinking", 0), {"type": "thinking", "thinking": "",
                                                "signature": ""})
            out += self._delta({"type": "thinking_delta", "thinking": reasoning})
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
        return _event("error", ANTHROPIC.error_body(error))


ANTHROPIC = AnthropicDialect()
