"""The Ollama dialect: what clients of Ollama's API send to ``/api/chat``,
``/api/generate``, ``/api/embed`` and ``/api/embeddings``, and what they get back
(SPEC A10), for any provider behind relay.

A request is checked against its schema (`relay.dialects.schemas`, as every front's: a
400 naming each bad field's path), then translated into relay's own `ChatInput`
(OpenAI's message shapes), so the same queue, lanes, fallbacks and adapters serve it:

=======================================  ==================================================
Ollama request                           relay (OpenAI shapes)
=======================================  ==================================================
``messages[]`` system / user / assistant  the same roles; ``images`` (base64) as
                                         ``image_url`` parts (data: URLs, the type read
                                         from the bytes)
``tool_calls[].function.arguments``      a JSON string; the call's ``id``, or one relay
(an object)                              makes
role ``tool`` (``tool_name``,            a ``tool`` message answering the call of that
``tool_call_id``)                        ``id``, else the earliest unanswered one of that
                                         name, else the earliest unanswered one
``/api/generate``: ``system``,           a system message and a user message
``prompt``, ``images``
``tools``                                function tools (the same shape)
``format`` ``"json"`` / a JSON schema    ``response_format`` json_object / json_schema
``options``: ``temperature``, ``top_p``,  the chat-level params of those names (named back
``top_k``, ``seed``, ``stop``, the        to the client as ``options.…``); ``num_predict``
penalties, ``num_predict``               → ``max_tokens`` (-1 and -2, no limit: nothing)
``think`` ``low``/``medium``/``high``      ``reasoning_effort``
``logprobs``, ``top_logprobs``           the same
=======================================  ==================================================

Everything else is the dialect's own (SPEC A1a; `relay.api.fields.OWN_FIELDS`):
``think`` as a boolean, ``keep_alive``, the other ``options`` (``num_ctx``, …), and
``/api/generate``'s ``template``, ``raw``, ``context`` (dropped and reported by a
provider's column) and ``suffix`` (refused: fill-in-the-middle is not a chat). No adapter
speaks Ollama's API, so these never reach a provider.

The answers: ``{"model", "created_at", "message": {"role", "content", "thinking",
"tool_calls"}, "done", "done_reason", "total_duration", "load_duration",
"prompt_eval_count", "prompt_eval_duration", "eval_count", "eval_duration"}`` for chat
(``"response"`` in place of ``"message"`` for generate), durations in nanoseconds on the
relay's clock from the request's start: the prompt's until the first answer byte, the
answer's after it. A tool call's ``arguments`` is an *object* (a client drops a string in
silence). A stream is newline-delimited JSON: a line per piece of text, the tool calls
whole in one line (Ollama's clients read them whole), then the ``done`` line; a failure
after the first line is one ``{"error": …}`` line and no ``done`` line (both clients raise
it). A line with empty content is the stream's heartbeat and waiting notice: NDJSON has
no comment, and an Ollama client shows nothing while it waits.

Errors are ``{"error": "REASON: message"}`` with relay's fields beside it in ``relay``
(Ollama's clients read only ``error``).
"""

# layers: long because it maps every Ollama field both ways: the request into relay's call
# (options, format, images, tools) and relay's events into NDJSON answers.

from __future__ import annotations

import json
import time
from typing import Any

import attrs

from relay.vocab.errors import RelayError
from relay.vocab.events import Delta, Finish, Inbound, Usage

from .base import Answer, ChatInput, dumps
from .openai_chat import bad_request, load_json
from .schemas import OLLAMA_CHAT_SCHEMA, OLLAMA_EMBED_SCHEMA, OLLAMA_GENERATE_SCHEMA
from .typed import check

__all__ = ["OLLAMA", "OllamaDialect", "OllamaEmbedInput", "ollama_error",
           "parse_ollama_embed"]

# options → chat-level params (the rest are the dialect's own, ``options.NAME``)
_OPTIONS = ("temperature", "top_p", "top_k", "seed", "stop", "presence_penalty",
            "frequency_penalty")
_DONE = {"tool_calls": "stop"}  # Ollama ends a turn of tool calls with "stop"
_MAGIC = (("iVBOR", "image/png"), ("/9j/", "image/jpeg"), ("R0lGOD", "image/gif"),
          ("UklGR", "image/webp"))


def ollama_error(error: RelayError) -> dict[str, Any]:
    """``{"error": "REASON: message"}``, relay's fields beside it (SPEC A10, E1)."""
    relay = error.body()["error"]["relay"]
    text = f"{error.reason}: {error.message}"
    if error.action and error.action not in text:
        text += f" ({error.action})"
    return {"error": text, "relay": {**relay, "param": error.param}}


def _image(data: str) -> dict[str, Any]:
    mime = next((m for prefix, m in _MAGIC if data.startswith(prefix)), "image/png")
    return {"type": "image_url", "image_url": {"url": f"data:{mime};base64,{data}"}}


def _content(text: str | None, images: list[str] | None) -> Any:
    if not images:
        return text or ""
    parts: list[dict[str, Any]] = [{"type": "text", "text": text}] if text else []
    return parts + [_image(i) for i in images]


def _messages(data: dict[str, Any], own: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    unanswered: list[tuple[str, str]] = []  # (id, name) of the calls not yet answered
    for i, message in enumerate(data.get("messages") or ()):
        role, text = message["role"], message.get("content")
        if message.get("thinking"):
            own["messages.thinking"] = True
        if role == "tool":
            out.append({"role": "tool", "content": text or "",
                        "tool_call_id": _answered(unanswered, message, i)})
            continue
        entry: dict[str, Any] = {"role": role,
                                 "content": _content(text, message.get("images"))}
        calls = []
        for j, call in enumerate(message.get("tool_calls") or ()):
            function = call["function"]
            ident = call.get("id") or f"call_{i}_{j}"
            unanswered.append((ident, function["name"]))
            calls.append({"id": ident, "type": "function", "function": {
                "name": function["name"],
                "arguments": json.dumps(function.get("arguments") or {})}})
        if calls and role == "assistant":
            entry["tool_calls"] = calls
            entry["content"] = entry["content"] or None
        out.append(entry)
    return out


def _answered(unanswered: list[tuple[str, str]], message: dict[str, Any], i: int) -> str:
    ident, name = message.get("tool_call_id"), message.get("tool_name")
    for match in (lambda c, n: c == ident, lambda c, n: n == name, lambda c, n: True):
        found = next((k for k, (c, n) in enumerate(unanswered) if match(c, n)), None)
        if found is not None:
            return unanswered.pop(found)[0]
    raise bad_request(f"'messages[{i}]' (role tool) answers no earlier tool call",
                      f"messages[{i}]")


def _params(data: dict[str, Any], own: dict[str, Any]
            ) -> tuple[dict[str, Any], dict[str, str]]:
    params: dict[str, Any] = {}
    names: dict[str, str] = {}
    for key, value in (data.get("options") or {}).items():
        if key in _OPTIONS:
            params[key], names[key] = value, f"options.{key}"
        elif key == "num_predict":
            if value is not None and value > 0:  # -1, -2: no limit
                params["max_tokens"], names["max_tokens"] = value, "options.num_predict"
        else:
            own[f"options.{key}"] = value
    form = data.get("format")
    if form == {}:  # an empty schema constrains nothing: no format asked (as no field)
        form = None
    if isinstance(form, dict) and not _schema_like(form):
        raise bad_request("'format' must be \"json\" or a JSON schema (an object with "
                          "\"type\", \"properties\", \"enum\" …)", "format")
    if isinstance(form, dict):
        params["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "output", "schema": form}}
    elif form == "json":
        params["response_format"] = {"type": "json_object"}
    elif form:
        raise bad_request(f"'format' must be \"json\" or a JSON schema, not {form!r}",
                          "format")
    if "response_format" in params:
        names["response_format"] = "format"
    think = data.get("think")
    if isinstance(think, str):
        params["reasoning_effort"], names["reasoning_effort"] = think, "think"
    elif think is not None:
        own["think"] = think
    for key in ("logprobs", "top_logprobs"):
        if data.get(key) is not None:
            params[key] = data[key]
    if data.get("tools"):
        params["tools"] = [{"type": "function", "function": t["function"]}
                           for t in data["tools"]]
    return params, names


def _parse(body: bytes, generate: bool) -> ChatInput:
    data = load_json(body)
    if not isinstance(data, dict):
        raise bad_request("the body must be a JSON object")
    check(data, OLLAMA_GENERATE_SCHEMA if generate else OLLAMA_CHAT_SCHEMA)
    own: dict[str, Any] = {k: data[k] for k in ("keep_alive", "template", "raw", "context",
                                                 "suffix") if data.get(k) is not None}
    if generate:
        messages = [{"role": "system", "content": data["system"]}] if data.get(
            "system") else []
        if data.get("prompt") or data.get("images"):
            messages.append({"role": "user",
                             "content": _content(data.get("prompt"), data.get("images"))})
    else:
        messages = _messages(data, own)
    params, names = _params(data, own)
    inbound = Inbound(dialect="ollama", own=own, names=names, turns=len(messages))
    return ChatInput(model=data["model"], messages=messages,
                     stream=data.get("stream") is not False, params=params,
                     fallbacks=data.get("fallbacks"), include_usage=True, inbound=inbound)


@attrs.frozen(kw_only=True)
class OllamaEmbedInput:
    model: str
    inputs: list[str]
    params: dict[str, Any]
    ignored: list[str]
    old: bool  # /api/embeddings: one ``prompt``, one ``embedding``


def parse_ollama_embed(body: bytes, *, old: bool) -> OllamaEmbedInput:
    """``/api/embed`` (``input``: a text or texts) or ``/api/embeddings`` (``prompt``).
    ``dimensions`` passes; ``truncate``, ``keep_alive`` and ``options`` are dropped and
    named in ``ignored`` (a provider truncates or refuses as it does)."""
    data = load_json(body)
    if not isinstance(data, dict):
        raise bad_request("the body must be a JSON object")
    check(data, OLLAMA_EMBED_SCHEMA)
    key = "prompt" if old else "input"
    raw = data.get(key)
    inputs = [raw] if isinstance(raw, str) else list(raw or ())
    if not inputs or not all(inputs):
        raise bad_request(f"'{key}' must be a non-empty text" + ("" if old else
                          " or a non-empty list of them"), key)
    params = {"dimensions": data["dimensions"]} if data.get("dimensions") else {}
    ignored = [k for k in ("truncate", "keep_alive", "options") if data.get(k) is not None]
    return OllamaEmbedInput(model=data["model"], inputs=inputs, params=params,
                            ignored=ignored, old=old)


def _arguments(raw: Any) -> dict[str, Any]:
    """A tool call's arguments as the object Ollama's clients read (a string is dropped
    in silence by them): JSON text parsed; what is not an object is kept under
    ``arguments``, never lost."""
    if isinstance(raw, dict):
        return raw
    try:
        value = json.loads(raw) if isinstance(raw, str) and raw.strip() else {}
    except ValueError:
        return {"arguments": raw}
    return value if isinstance(value, dict) else {"arguments": value}


def _tool_calls(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for index, call in enumerate(calls):
        function = call.get("function") or {}
        entry: dict[str, Any] = {"function": {"index": index, "name": function.get("name", ""),
                                              "arguments": _arguments(
                                                  function.get("arguments"))}}
        if call.get("id"):
            entry["id"] = call["id"]
        out.append(entry)
    return out


def _now() -> str:
    stamp = time.time()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(stamp)) + \
        f".{int(stamp % 1 * 1e6):06d}Z"


@attrs.define
class _Clock:
    """A request's durations, in nanoseconds (Ollama's unit), on the monotonic clock."""

    start: int = attrs.field(factory=time.monotonic_ns)
    first: int | None = None

    def mark(self) -> None:
        if self.first is None:
            self.first = time.monotonic_ns()

    def durations(self, usage: Usage | None) -> dict[str, Any]:
        end = time.monotonic_ns()
        first = self.first if self.first is not None else end
        return {"total_duration": end - self.start, "load_duration": 0,
                "prompt_eval_count": (usage.prompt_tokens or 0) if usage else 0,
                "prompt_eval_duration": first - self.start,
                "eval_count": (usage.completion_tokens or 0) if usage else 0,
                "eval_duration": end - first}


class OllamaDialect:
    """Ollama's chat (``generate`` False) or generate shapes. One instance per request
    (`fresh`): it holds the request's clock, for the durations."""

    name = "ollama"
    stream_type = b"application/x-ndjson"

    def __init__(self, *, generate: bool = False) -> None:
        self.generate = generate
        self.clock = _Clock()

    def fresh(self) -> OllamaDialect:
        return OllamaDialect(generate=self.generate)

    def parse(self, body: bytes) -> ChatInput:
        return _parse(body, self.generate)

    def error_body(self, error: RelayError) -> dict[str, Any]:
        return ollama_error(error)

    def chunk(self, model: str, content: str = "", *, thinking: str | None = None,
              tool_calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"model": model, "created_at": _now()}
        if self.generate:
            out["response"] = content
            if thinking:
                out["thinking"] = thinking
        else:
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if thinking:
                message["thinking"] = thinking
            if tool_calls:
                message["tool_calls"] = _tool_calls(tool_calls)
            out["message"] = message
        return out

    def last(self, model: str, reason: str, usage: Usage | None, **fields: Any
             ) -> dict[str, Any]:
        return {**self.chunk(model, **fields), "done": True,
                "done_reason": _DONE.get(reason, reason), **self.clock.durations(usage)}

    def render(self, answer: Answer) -> dict[str, Any]:
        choice = answer.choices.get(0) or {"message": {}, "finish_reason": "stop"}
        message = choice["message"]
        self.clock.mark()
        return self.last(answer.model, choice.get("finish_reason") or "stop", answer.usage,
                         content=message.get("content") or "",
                         thinking=message.get("reasoning_content"),
                         tool_calls=message.get("tool_calls"))

    def loaded(self, model: str) -> dict[str, Any]:
        """The answer to a request with nothing to answer (Ollama loads the model)."""
        return {**self.chunk(model), "done": True, "done_reason": "load"}

    def encoder(self, request_id: str, created: int, include_usage: bool) -> OllamaStream:
        return OllamaStream(self)


class OllamaStream:
    """Newline-delimited JSON (see the module docstring)."""

    def __init__(self, dialect: OllamaDialect) -> None:
        self.dialect = dialect
        self.model = ""
        self.usage: Usage | None = None
        self.reason = "stop"
        self.calls: dict[int, dict[str, Any]] = {}

    def begin(self, model: str) -> None:
        self.model, self.calls = model, {}

    def _line(self, obj: dict[str, Any]) -> bytes:
        return dumps(obj) + b"\n"

    def delta(self, event: Delta) -> bytes:
        self.dialect.clock.mark()
        for call in event.tool_calls or ():  # gathered: a call goes out whole
            slot = self.calls.setdefault(call.get("index", len(self.calls)), {
                "id": None, "function": {"name": "", "arguments": ""}})
            slot["id"] = call.get("id") or slot["id"]
            function = call.get("function") or {}
            slot["function"]["name"] += function.get("name") or ""
            args = function.get("arguments") or ""
            slot["function"]["arguments"] += args if isinstance(args, str) else json.dumps(args)
        thinking = (event.extra or {}).get("reasoning_content")
        if not event.content and not thinking:
            return b""
        return self._line({**self.dialect.chunk(self.model, event.content or "",
                                                thinking=thinking), "done": False})

    def finish(self, event: Finish) -> bytes:
        self.reason = event.reason
        if not self.calls:
            return b""
        calls = [self.calls[i] for i in sorted(self.calls)]
        self.calls = {}
        return self._line({**self.dialect.chunk(self.model, tool_calls=calls),
                           "done": False})

    def set_usage(self, usage: Usage) -> None:
        self.usage = usage

    def done(self) -> bytes:
        return self._line(self.dialect.last(self.model, self.reason, self.usage))

    def error(self, error: RelayError) -> bytes:
        return self._line(ollama_error(error))

    def comment(self, text: str) -> bytes:
        """A heartbeat or waiting notice: a line with no text (NDJSON has no comment)."""
        return self._line({**self.dialect.chunk(self.model), "done": False})


OLLAMA = OllamaDialect()  # for errors (every /api/ path); requests get `fresh` ones


_SCHEMA_WORDS = frozenset({"type", "properties", "items", "enum", "const", "anyOf", "oneOf",
                           "allOf", "$ref", "$schema", "$defs", "required", "format"})


def _schema_like(form: dict[str, Any]) -> bool:
    """Whether ``format`` reads as a JSON schema: a schema keyword, and a ``type`` (when
    given) that names types."""
    if not _SCHEMA_WORDS & form.keys():
        return False
    kind = form.get("type")
    return kind is None or isinstance(kind, str) or (
        isinstance(kind, list) and all(isinstance(k, str) for k in kind))
