"""The OpenAI Chat Completions dialect: what clients send to ``/v1/chat/completions`` and
what they get back (SPEC A1, A2, E1).

relay's internal lingua franca *is* OpenAI's chat shape (messages with roles and content
parts, tool calls as deltas), so parsing here only checks the fields relay reads itself;
everything else passes through to the adapter as ``params``. Other dialects (Anthropic's
``/v1/messages``) translate into the same `ChatInput` and render the same `Answer`.
"""

from __future__ import annotations

import json
import math
from typing import Any, NoReturn

from relay.dialects.base import Answer, ChatInput, dumps
from relay.vocab.errors import RelayError
from relay.vocab.events import Delta, Finish, Usage

from .schemas import CHAT_SCHEMA
from .typed import INT_MAX, check

__all__ = ["CHAT_SCHEMA", "INT_MAX", "MAX_JSON_DEPTH", "OPENAI", "OpenAIDialect",
           "bad_request", "load_json", "load_request", "parse_chat_body", "usage_body"]

# How deep a request body may nest (objects and arrays; the body itself is level 1). Real
# requests, JSON schemas of tools included, stay far below it; relay and every encoder
# after it (httpx, the dialects, the records) take it with room to spare on the stack.
MAX_JSON_DEPTH = 128
_CONTAINERS = {dict, list}
_NUMBERS = {int, float, bool}


def bad_request(message: str, param: str | None = None) -> RelayError:
    return RelayError("invalid_request", message, param=param)


def usage_body(usage: Usage) -> dict[str, Any]:
    """``usage`` in OpenAI's shape: ``prompt_tokens`` counts every prompt token, cached or
    not, and ``prompt_tokens_details.cached_tokens`` those read from the provider's cache
    (SPEC L12a; there only when the provider said). ``estimated`` is relay's one addition
    (SPEC A1a); the cache writes have no OpenAI field (the record keeps them)."""
    out: dict[str, Any] = {"prompt_tokens": usage.prompt_tokens,
                           "completion_tokens": usage.completion_tokens,
                           "total_tokens": usage.total_tokens}
    if usage.estimated:
        out["estimated"] = True
    if usage.cache_read_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": usage.cache_read_tokens}
    return out





def load_json(body: bytes) -> Any:
    """A request body as JSON that every encoder down the line can write back.

    Python's parser takes ``NaN``, ``Infinity`` and ``1e999`` (as ``inf``), which no
    provider accepts and httpx refuses to encode; and it nests as deep as the interpreter's
    stack allows, deeper than an encoder running further down that stack can. So both are
    refused here, naming where: numbers must be finite, and containers (objects and arrays)
    nest at most `MAX_JSON_DEPTH` levels (the body's own object is level 1).

    Raises:
        RelayError: ``invalid_request``.
    """
    try:
        data = json.loads(body)
    except RecursionError as exc:
        raise bad_request(f"the JSON body is nested too deeply (the limit is "
                          f"{MAX_JSON_DEPTH} levels)") from exc
    except ValueError as exc:  # includes invalid UTF-8
        raise bad_request(f"the body is not valid JSON: {exc}") from exc
    if not _fits(data):
        _refuse(data)
    return data


def _fits(data: Any) -> bool:
    """Whether every number in ``data`` is finite and it nests at most `MAX_JSON_DEPTH`
    levels: one level at a time, with the common cases decided at C speed."""
    if isinstance(data, float):
        return math.isfinite(data)
    level = [data] if isinstance(data, dict | list) else []
    depth = 0
    while level:
        depth += 1
        below: list[Any] = []
        for container in level:
            children = container.values() if isinstance(container, dict) else container
            kinds = set(map(type, children))
            if not _all_finite(children, kinds):
                return False
            if not kinds.isdisjoint(_CONTAINERS):
                if depth >= MAX_JSON_DEPTH:
                    return False
                below += [x for x in children if type(x) is dict or type(x) is list]
        level = below
    return True


def _all_finite(values: Any, kinds: set[type]) -> bool:
    if float not in kinds:
        return True
    if kinds <= _NUMBERS:
        return all(map(math.isfinite, values))  # at C speed
    return all(math.isfinite(x) for x in values if type(x) is float)


def _refuse(data: Any) -> NoReturn:
    """Name the first place where ``data`` does not fit (`_fits` said it does not).

    Raises:
        RelayError: ``invalid_request``, always.
    """
    if not isinstance(data, dict | list):
        raise bad_request(f"the body must be a finite number, not {data!r}")
    # Depth first, with an explicit stack: (value, depth, parent entry, key in the parent).
    stack: list[tuple[Any, int, Any, str | int | None]] = [(data, 1, None, None)]
    while stack:
        entry = stack.pop()
        value, depth = entry[0], entry[1]
        for key, item in value.items() if isinstance(value, dict) else enumerate(value):
            if isinstance(item, dict | list):
                if depth >= MAX_JSON_DEPTH:
                    where, param = _where(entry, key)
                    raise bad_request(f"the JSON body nests deeper than {MAX_JSON_DEPTH} "
                                      f"levels (at {where})", param)
                stack.append((item, depth + 1, entry, key))
            elif isinstance(item, float) and not math.isfinite(item):
                where, param = _where(entry, key)
                raise bad_request(f"'{where}' must be a finite number, not {item!r} (JSON "
                                  "has no NaN or Infinity; 1e999 overflows)", param)
    raise AssertionError("_refuse: the body fits")


def _where(entry: tuple[Any, int, Any, str | int | None],
           key: str | int) -> tuple[str, str | None]:
    """The path to ``key`` inside ``entry`` (``messages[0].content``), and its top field."""
    keys: list[Any] = [key]
    while entry[2] is not None:
        keys.append(entry[3])
        entry = entry[2]
    keys.reverse()
    path = "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in keys).lstrip(".")
    return path, keys[0] if isinstance(keys[0], str) else None


def load_request(body: bytes) -> dict[str, Any]:
    """A request body as a JSON object naming a ``model`` (every dialect starts here).

    Raises:
        RelayError: ``invalid_request``.
    """
    data = load_json(body)
    if not isinstance(data, dict):
        raise bad_request("the body must be a JSON object")
    model = data.get("model")
    if not isinstance(model, str) or not model.strip():
        raise bad_request("'model' is required: a route name, PROVIDER/MODEL, or a model name",
                   "model")
    return data


def parse_chat_body(body: bytes) -> dict[str, Any]:
    """Check a chat body: every field's type and range (`CHAT_SCHEMA`), and what the
    schema cannot say (a text part holds its text); everything else passes through.

    Raises:
        RelayError: ``invalid_request`` naming the field.
    """
    data = load_request(body)
    check(data, CHAT_SCHEMA)
    for i, message in enumerate(data["messages"]):
        content = message.get("content")
        if type(content) is list:
            for j, part in enumerate(content):
                if part["type"] == "text" and type(part.get("text")) is not str:
                    raise bad_request(f"messages[{i}].content[{j}].text must be a string",
                                      f"messages[{i}].content[{j}].text")
    return data


class OpenAIDialect:
    """Requests and answers in OpenAI's exact shapes."""

    name = "openai"

    def parse(self, body: bytes) -> ChatInput:
        data = parse_chat_body(body)
        params = {k: v for k, v in data.items()
                  if k not in ("model", "messages", "stream", "fallbacks")}
        return ChatInput(
            model=data["model"], messages=data["messages"],
            stream=bool(data.get("stream", False)), params=params,
            fallbacks=data.get("fallbacks"),
            include_usage=bool((data.get("stream_options") or {}).get("include_usage")))

    def error_body(self, error: RelayError) -> dict[str, Any]:
        return error.body()

    def render(self, answer: Answer) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": f"chatcmpl-{answer.id}", "object": "chat.completion",
            "created": answer.created, "model": answer.model,
            "choices": [answer.choices[i] for i in sorted(answer.choices)]}
        if answer.usage is not None:
            body["usage"] = usage_body(answer.usage)
        return body

    def encoder(self, request_id: str, created: int, include_usage: bool) -> OpenAIStream:
        return OpenAIStream(request_id, created, include_usage)


class OpenAIStream:
    """SSE chunks: ``data: {chat.completion.chunk}``, then ``data: [DONE]``."""

    def __init__(self, request_id: str, created: int, include_usage: bool) -> None:
        self.id = f"chatcmpl-{request_id}"
        self.created = created
        self.include_usage = include_usage
        self.usage: Usage | None = None
        self.roles_sent: set[int] = set()
        self.model = ""
        self.head = b""

    def begin(self, model: str) -> None:
        self.model = model
        self.usage = None
        prefix = dumps({"id": self.id, "object": "chat.completion.chunk",
                        "created": self.created, "model": model})
        self.head = b"data: " + prefix[:-1] + b',"choices":[{"index":'

    def _chunk(self, index: int, delta: dict[str, Any], finish: str | None = None) -> bytes:
        if index not in self.roles_sent:
            self.roles_sent.add(index)
            delta = {"role": "assistant", **delta}
        tail = b"null" if finish is None else dumps(finish)
        return (self.head + str(index).encode() + b',"delta":' + dumps(delta)
                + b',"finish_reason":' + tail + b"}]}\n\n")

    def delta(self, event: Delta) -> bytes:
        delta: dict[str, Any] = {}
        if event.content is not None:
            delta["content"] = event.content
        if event.tool_calls:
            delta["tool_calls"] = event.tool_calls
        if event.extra:
            delta.update(event.extra)
        return self._chunk(event.index, delta)

    def finish(self, event: Finish) -> bytes:
        return self._chunk(event.index, {}, event.reason)

    def set_usage(self, usage: Usage) -> None:
        self.usage = usage

    def done(self) -> bytes:
        out = b""
        if self.include_usage and self.usage is not None:
            out += b"data: " + dumps({
                "id": self.id, "object": "chat.completion.chunk", "created": self.created,
                "model": self.model, "choices": [], "usage": usage_body(self.usage)}) + b"\n\n"
        return out + b"data: [DONE]\n\n"

    def error(self, error: RelayError) -> bytes:
        # The official clients raise `data: {"error": …}` as an APIError (SPEC A2).
        return b"data: " + dumps(error.body()) + b"\n\n"


OPENAI = OpenAIDialect()
