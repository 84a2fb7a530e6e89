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
a ``system`` message (any       a ``system`` message in its place (Claude Code sends them
place in ``messages``)          mid-conversation)
text / image / document blocks  text / ``image_url`` (data: or http URL) / ``file`` parts
``tool_use`` (assistant)        ``tool_calls`` with JSON ``arguments``
``tool_result`` (user)          a ``tool`` message (``is_error``: its text says so)
``max_tokens``, ``stop_sequences``, ``temperature``, ``top_p``, ``top_k``: the same
``tools``, ``tool_choice``      function tools (``strict`` kept); auto/any/tool/none →
                                auto/required/…/none
``metadata.user_id``            ``user``
``output_config.format``        ``response_format`` (a JSON schema)
==============================  ==========================================================

Everything else is the dialect's own (SPEC A1a; `relay.api.fields.OWN_FIELDS`):
``thinking``, ``context_management``, ``output_config.effort``, ``cache_control`` markers,
thinking blocks passed back (``content.thinking``), … go in the call's
`relay.vocab.events.Inbound` — never into the chat-level params — with the request
itself, so the ``anthropic`` adapter gets the request unchanged (signatures byte for
byte) and every other provider has them dropped and reported, or refused, by its column.
``n`` is refused here, since a message has one answer.

Errors keep relay's reason visible: ``{"type": "error", "error": {"type", "message",
"relay": {…E1's relay object, "code", "param"}}}``, with the same HTTP statuses and headers
(``x-should-retry``, ``retry-after``) as the OpenAI dialect.
"""

from __future__ import annotations

import json
from typing import Any

from relay.dialects.base import ChatInput
from relay.dialects.openai_chat import INT_MAX, load_request
from relay.dialects.openai_chat import bad_request as _bad
from relay.vocab.errors import RelayError
from relay.vocab.events import Inbound

from .anthropic_render import STOP_REASONS, AnthropicRender, AnthropicStream
from .schemas import MESSAGES_SCHEMA
from .typed import check

__all__ = ["ANTHROPIC", "MESSAGES_SCHEMA", "PASSED_HEADERS", "STOP_REASONS",
           "AnthropicDialect", "AnthropicStream", "parse_messages_body"]


_TOOL_CHOICE: dict[str, Any] = {"auto": "auto", "any": "required", "none": "none"}
# The fields this dialect translates into chat terms; every other one is its own.
_TRANSLATED = {"model", "messages", "max_tokens", "system", "stream", "stop_sequences",
               "temperature", "top_p", "top_k", "tools", "tool_choice", "metadata",
               "fallbacks", "output_config"}
# A tool's keys that chat-level tools have (the others are the dialect's own).
_TOOL_KEYS = {"name", "description", "input_schema", "type", "strict", "cache_control"}
# The headers a provider that speaks Messages gets as the client sent them.
PASSED_HEADERS = ("anthropic-version", "anthropic-beta")


class _Own:
    """The dialect's own fields a request uses, as they are found (see `Inbound.own`)."""

    def __init__(self) -> None:
        self.fields: dict[str, Any] = {}

    def note(self, name: str, value: Any = True) -> None:
        if value is not None:
            self.fields.setdefault(name, value)

    def blocks(self, blocks: Any) -> None:
        """Markers inside a list of blocks: ``cache_control``."""
        for block in blocks if isinstance(blocks, list) else ():
            if isinstance(block, dict) and block.get("cache_control") is not None:
                self.note("cache_control")


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


def _user_turn(content: list[Any], where: str, own: _Own) -> list[dict[str, Any]]:
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
            own.blocks(block.get("content"))
            tools.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                          "content": _tool_text(block.get("content"), at,
                                                block.get("is_error") is True)})
        elif kind in ("thinking", "redacted_thinking"):
            own.note(f"content.{kind}")
        else:
            raise RelayError("unsupported", f"{at}: relay cannot pass a {kind!r} block in a "
                             "user turn", param="messages")
    out = list(tools)
    if parts:
        single = len(parts) == 1 and parts[0]["type"] == "text"
        out.append({"role": "user", "content": parts[0]["text"] if single else parts})
    return out


def _assistant_turn(content: list[Any], where: str, own: _Own) -> dict[str, Any]:
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
            own.note(f"content.{kind}")
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


def _system(system: Any, where: str = "system", param: str = "system") -> str | None:
    if system is None or isinstance(system, str):
        return system or None
    if not isinstance(system, list):
        raise _bad(f"'{where}' must be a string or a list of text blocks", param)
    texts = []
    for i, block in enumerate(system):
        if not isinstance(block, dict) or block.get("type") != "text" or \
                not isinstance(block.get("text"), str):
            raise _bad(f"{where}[{i}] must be a text block", param)
        texts.append(block["text"])
    return "\n\n".join(texts) or None


def _tools(tools: Any, own: _Own) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise _bad("'tools' must be a list", "tools")
    own.blocks(tools)
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
        if isinstance(tool.get("strict"), bool):
            fn["strict"] = tool["strict"]
        for key in tool:
            if key not in _TOOL_KEYS:
                own.note(f"tools.{key}", tool[key])
        out.append({"type": "function", "function": fn})
    return out


def _output_config(config: Any, params: dict[str, Any], own: _Own) -> None:
    """``format`` → ``response_format``; the rest (``effort``) is the dialect's own."""
    if not isinstance(config, dict):
        raise _bad("'output_config' must be an object", "output_config")
    for key, value in config.items():
        if key != "format" or value is None:
            own.note(f"output_config.{key}", value)
            continue
        if not isinstance(value, dict) or value.get("type") != "json_schema" or \
                not isinstance(value.get("schema"), dict):
            raise _bad("'output_config.format' must be {'type': 'json_schema', 'schema': "
                       "{…}}", "output_config")
        params["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "output", "schema": value["schema"], "strict": True}}


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


def _messages(system: Any, raw: list[Any], own: _Own) -> list[dict[str, Any]]:
    """``system`` and ``messages`` → relay's messages (system messages kept in place)."""
    messages: list[dict[str, Any]] = []
    own.blocks(system)
    text = _system(system)
    if text is not None:
        messages.append({"role": "system", "content": text})
    for i, message in enumerate(raw):
        where = f"messages[{i}]"
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ("user", "assistant", "system"):
            raise _bad(f"{where}.role must be 'user', 'assistant' or 'system'", "messages")
        if role == "system":  # mid-conversation (Claude Code): a system message there
            own.blocks(message.get("content"))
            text = _system(message.get("content"), f"{where}.content", "messages")
            if text is not None:
                messages.append({"role": "system", "content": text})
            continue
        blocks = _blocks(message.get("content"), where)
        own.blocks(blocks)
        if role == "user":
            messages += _user_turn(blocks, where, own)
        else:
            messages.append(_assistant_turn(blocks, where, own))

    return messages


def _params(data: dict[str, Any], max_tokens: int, own: _Own
            ) -> tuple[dict[str, Any], dict[str, str]]:
    """The request's other fields → relay's params, and the client's names for the ones
    renamed on the way (so a drop is reported under the name the client used)."""
    params: dict[str, Any] = {"max_tokens": max_tokens}
    names: dict[str, str] = {}
    stop = data.get("stop_sequences")
    if stop is not None:
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise _bad("'stop_sequences' must be a list of strings", "stop_sequences")
        if stop:
            params["stop"], names["stop"] = stop, "stop_sequences"
    for key in ("temperature", "top_p", "top_k"):
        if data.get(key) is not None:
            params[key] = data[key]
    if data.get("tools") is not None:
        params["tools"] = _tools(data["tools"], own)
    if data.get("tool_choice") is not None:
        _tool_choice(data["tool_choice"], params)
        names["parallel_tool_calls"] = "tool_choice.disable_parallel_tool_use"
    metadata = data.get("metadata")
    if metadata is not None:
        if not isinstance(metadata, dict):
            raise _bad("'metadata' must be an object", "metadata")
        if isinstance(metadata.get("user_id"), str):
            params["user"], names["user"] = metadata["user_id"], "metadata"
    if data.get("output_config") is not None:
        _output_config(data["output_config"], params, own)
        names["response_format"] = "output_config.format"
    return params, names


def parse_messages_body(body: bytes) -> ChatInput:
    """A Messages request → relay's `ChatInput`: the chat-level translation, and the
    request itself with its own fields in ``inbound``.

    Raises:
        RelayError: ``invalid_request`` naming the field; ``unsupported`` for blocks
            relay cannot translate.
    """
    data = load_request(body)
    if "n" in data:
        raise _bad("'n' is not a Messages API field: a message has one answer", "n")
    check(data, MESSAGES_SCHEMA)
    max_tokens = data.get("max_tokens")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or \
            not 1 <= max_tokens <= INT_MAX:
        raise _bad(f"'max_tokens' is required: a whole number from 1 to {INT_MAX}",
                   "max_tokens")
    raw = data.get("messages")
    if not isinstance(raw, list) or not raw:
        raise _bad("'messages' must be a non-empty list of messages", "messages")
    if data.get("stream") is not None and not isinstance(data["stream"], bool):  # null: no
        raise _bad("'stream' must be true or false", "stream")
    for key in ("temperature", "top_p"):
        _number(data, key)
    _number(data, "top_k", whole=True)
    if "n" in data:
        raise _bad("'n' is not a Messages API field: a message has one answer", "n")

    own = _Own()
    messages = _messages(data.get("system"), raw, own)
    params, names = _params(data, max_tokens, own)
    for key, value in data.items():
        if key not in _TRANSLATED:
            own.note(key, value)
    inbound = Inbound(dialect="anthropic", own=own.fields, names=names,
                      body={k: v for k, v in data.items() if k != "fallbacks"},
                      turns=len(messages))
    return ChatInput(model=data["model"], messages=messages, stream=bool(data.get("stream")),
                     params=params, fallbacks=data.get("fallbacks"), include_usage=True,
                     inbound=inbound)


class AnthropicDialect(AnthropicRender):
    """Requests and answers in Anthropic's Messages shapes."""

    name = "anthropic"
    passed_headers = PASSED_HEADERS

    def parse(self, body: bytes) -> ChatInput:
        return parse_messages_body(body)


ANTHROPIC = AnthropicDialect()
