"""Anthropic's Messages API (``POST {base_url}/messages``), behind relay's OpenAI shapes.

Theory of operation. relay speaks OpenAI's chat shapes inside; this adapter translates a
`Call` into a Messages request (`messages_request`, pure, so `check_call` can refuse what
it cannot translate before anything is queued) and Anthropic's answer back into relay
events (`MessageReader`, sans-IO: fed one stream event, or one whole message, at a time).

Requests: system and developer messages become ``system``; user and assistant turns
become content blocks (text; images from ``data:`` URLs as base64 sources and from
http(s) URLs as url sources; PDFs from ``data:`` URLs as documents); assistant
``tool_calls`` become ``tool_use`` blocks and ``tool`` messages ``tool_result`` blocks in
a user turn; consecutive turns of one role are merged. ``max_tokens`` is required by
Anthropic: the request's ``max_completion_tokens`` or ``max_tokens``, else the
provider's ``max_tokens`` setting. Fields it cannot honour are refused by name
(``unsupported``), never dropped; a field whose value asks for nothing (``n = 1``, a
penalty of 0) passes.

Answers: ``text_delta`` → content, ``tool_use`` + ``input_json_delta`` → tool-call
deltas, ``thinking_delta`` → ``reasoning_content``; ``stop_reason`` → finish reason by
`STOP_REASONS` (``max_tokens`` is ``length``, never ``stop``, SPEC E4). The answer is
complete only at ``message_stop``: the finish is held until then, so a stream cut after
``message_delta`` is ``stream_cut`` and never reaches the client as complete. Errors —
HTTP statuses, Anthropic's error bodies and an ``event: error`` inside the stream — go
through the shared `upstream_failure`.

Prefill (SPEC F8): Anthropic continues a final assistant message, but refuses one that
ends in whitespace; that whitespace is cut from the request and from the start of the
continuation, so the client's text joins up exactly.
"""

from __future__ import annotations

import json
from typing import Any

import attrs

from relay.api.adapter import Capabilities
from relay.api.http import HTTPSettings
from relay.vocab.errors import RelayError, excerpt
from relay.vocab.events import Call, Delta, Event, EventSink, Finish, Skipped, Usage
from relay.vocab.profile import Profile

from .base import upstream_failure
from .cloud import CloudAdapter, data_url, obj, stop_sequences, tool_calls

__all__ = ["ERROR_STATUS", "STOP_REASONS", "AnthropicAdapter", "AnthropicSettings",
           "MessageReader", "messages_request"]

ANTHROPIC_VERSION = "2023-06-01"
DEFAULT_MAX_TOKENS = 4096

# stop_reason → OpenAI's finish_reason. pause_turn (a server tool's loop paused) and the
# context window running out are cut-off answers: reported as such (SPEC E4).
STOP_REASONS: dict[str, str] = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "max_tokens": "length",
    "model_context_window_exceeded": "length",
    "pause_turn": "length",
    "tool_use": "tool_calls",
    "refusal": "content_filter",
}

# An error type inside a stream → the HTTP status Anthropic gives that type, so an
# ``event: error`` maps exactly like the same error before the headers.
ERROR_STATUS: dict[str, int] = {
    "invalid_request_error": 400,
    "authentication_error": 401,
    "billing_error": 402,
    "permission_error": 403,
    "not_found_error": 404,
    "request_too_large": 413,
    "rate_limit_error": 429,
    "api_error": 500,
    "timeout_error": 504,
    "overloaded_error": 529,
}

# OpenAI request field → Messages field, passed as given.
_SAME: dict[str, str] = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k"}
_TOOL_CHOICE: dict[str, dict[str, Any]] = {
    "auto": {"type": "auto"}, "none": {"type": "none"}, "required": {"type": "any"}}


@attrs.frozen(kw_only=True)
class AnthropicSettings(HTTPSettings):
    max_tokens: int = attrs.field(default=DEFAULT_MAX_TOKENS,
                                  validator=attrs.validators.ge(1))
    """``max_tokens`` for requests that give none (Anthropic requires one)."""


# --- request: OpenAI shapes → Messages ------------------------------------------------------

def _text(part: Any, where: str) -> str:
    text = part.get("text") if isinstance(part, dict) else None
    if not isinstance(text, str):
        raise RelayError("invalid_request", f"{where}.text must be a string",
                         param="messages")
    return text


def _unsupported(what: str, where: str) -> RelayError:
    return RelayError("unsupported", f"the anthropic adapter cannot send {what} "
                      f"({where}); remove it or choose another provider", param="messages")


def _image_block(part: dict[str, Any], where: str) -> dict[str, Any]:
    image = part.get("image_url")
    url = image.get("url") if isinstance(image, dict) else image
    if not isinstance(url, str):
        raise RelayError("invalid_request", f"{where}.image_url.url must be a string",
                         param="messages")
    inline = data_url(url)
    if inline is not None:
        return {"type": "image", "source": {"type": "base64", "media_type": inline[0],
                                            "data": inline[1]}}
    if url.startswith(("http://", "https://")):
        return {"type": "image", "source": {"type": "url", "url": url}}
    raise _unsupported("an image that is neither a base64 data: URL nor an http(s) URL",
                       where)


def _blocks(content: Any, where: str, *, images: bool) -> list[dict[str, Any]]:
    """OpenAI content (a string or parts) → Messages content blocks (empty text dropped:
    Anthropic refuses empty text blocks)."""
    if content is None:
        return []
    if isinstance(content, str):
        return [{"type": "text", "text": content}] if content else []
    out: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = part.get("type")
        if kind == "text":
            if text := _text(part, at):
                out.append({"type": "text", "text": text})
        elif kind == "image_url" and images:
            out.append(_image_block(part, at))
        elif kind == "file" and images:
            inline = data_url(str(obj(part.get("file")).get("file_data") or ""))
            if inline is None or inline[0] != "application/pdf":
                raise _unsupported("a file other than a PDF as a base64 data: URL", at)
            out.append({"type": "document", "source": {"type": "base64",
                        "media_type": inline[0], "data": inline[1]}})
        else:
            raise _unsupported(f"a content part of type {kind!r}", at)
    return out


def _add(turns: list[dict[str, Any]], role: str, blocks: list[dict[str, Any]]) -> None:
    if not blocks:
        return
    if turns and turns[-1]["role"] == role:
        turns[-1]["content"].extend(blocks)
    else:
        turns.append({"role": role, "content": list(blocks)})


def _tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise RelayError("invalid_request", "'tools' must be a list", param="tools")
    out = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or \
                not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise RelayError("unsupported", f"tools[{i}]: the anthropic adapter takes "
                             "function tools ({'type': 'function', 'function': {'name', …}})"
                             " only", param="tools")
        spec: dict[str, Any] = {"name": fn["name"], "input_schema": fn.get("parameters")
                                or {"type": "object", "properties": {}}}
        if fn.get("description"):
            spec["description"] = fn["description"]
        out.append(spec)
    return out


def _tool_choice(choice: Any) -> dict[str, Any]:
    if isinstance(choice, str) and choice in _TOOL_CHOICE:
        return dict(_TOOL_CHOICE[choice])
    if isinstance(choice, dict) and isinstance((choice.get("function") or {}).get("name"),
                                               str):
        return {"type": "tool", "name": choice["function"]["name"]}
    raise RelayError("unsupported", f"tool_choice {choice!r} has no Messages equivalent; "
                     "use auto, none, required or a function", param="tool_choice")


def messages_request(call: Call, default_max_tokens: int = DEFAULT_MAX_TOKENS
                     ) -> tuple[dict[str, Any], str]:
    """The Messages request for ``call``, and the whitespace cut from the end of a final
    assistant message (a prefill), which the continuation will not repeat.

    Raises:
        RelayError: ``unsupported`` (a part or field it cannot send) or
            ``invalid_request`` (tool arguments that are not JSON), naming the field.
    """
    system: list[dict[str, Any]] = []
    turns: list[dict[str, Any]] = []
    for i, message in enumerate(call.messages):
        where, role = f"messages[{i}]", message.get("role")
        content = message.get("content")
        if role in ("system", "developer"):
            system += _blocks(content, where, images=False)
        elif role == "user":
            _add(turns, "user", _blocks(content, where, images=True))
        elif role == "assistant":
            blocks = _blocks(content, where, images=False)
            for j, (call_id, name, args, _) in enumerate(tool_calls(message, where)):
                if call_id is None:
                    raise RelayError("invalid_request", f"{where}.tool_calls[{j}] needs an "
                                     "id", param="messages")
                blocks.append({"type": "tool_use", "id": call_id, "name": name,
                               "input": args})
            _add(turns, "assistant", blocks)
        elif role == "tool":
            if not isinstance(message.get("tool_call_id"), str):
                raise RelayError("invalid_request", f"{where}.tool_call_id is required",
                                 param="messages")
            result: dict[str, Any] = {"type": "tool_result",
                                      "tool_use_id": message["tool_call_id"]}
            texts = _blocks(content, where, images=False)
            if texts:
                result["content"] = texts
            _add(turns, "user", [result])
        else:
            raise _unsupported(f"a message with role {role!r}", where)

    stripped = ""
    last = turns[-1] if turns else None
    if last is not None and last["role"] == "assistant" and last["content"][-1]["type"] == \
            "text":
        text = last["content"][-1]["text"]
        kept = text.rstrip()
        stripped = text[len(kept):]
        if kept:
            last["content"][-1] = {"type": "text", "text": kept}
        else:
            last["content"].pop()
            if not last["content"]:
                turns.pop()

    params = call.params
    body: dict[str, Any] = {
        "model": call.model, "messages": turns,
        "max_tokens": params.get("max_completion_tokens") or params.get("max_tokens")
        or default_max_tokens}
    if system:
        body["system"] = system
    for ours, theirs in _SAME.items():
        if params.get(ours) is not None:
            body[theirs] = params[ours]
    stop = params.get("stop")
    if stop is not None:
        body["stop_sequences"] = stop_sequences(stop)
    if params.get("tools") is not None:
        body["tools"] = _tools(params["tools"])
    if params.get("tool_choice") is not None:
        body["tool_choice"] = _tool_choice(params["tool_choice"])
    if params.get("parallel_tool_calls") is False:
        body["tool_choice"] = {**body.get("tool_choice", {"type": "auto"}),
                               "disable_parallel_tool_use": True}
    if params.get("user") is not None:
        body["metadata"] = {"user_id": str(params["user"])}
    if call.stream:
        body["stream"] = True
    return body, stripped


# --- answer: Messages → relay events ---------------------------------------------------------

def usage_of(raw: Any) -> Usage:
    """Anthropic's usage → relay's. Cached prompt tokens count as prompt tokens."""
    raw = raw if isinstance(raw, dict) else {}

    def num(key: str) -> int:
        val = raw.get(key)
        return val if isinstance(val, int) and not isinstance(val, bool) else 0

    prompt = num("input_tokens") + num("cache_creation_input_tokens") + \
        num("cache_read_input_tokens")
    completion = num("output_tokens")
    return Usage(prompt, completion, prompt + completion)


class MessageReader:
    """Anthropic's answer → relay events, without I/O.

    ``feed(event)`` takes one decoded stream event and returns the relay events it
    means; ``whole(message)`` does the same for a non-streamed message. ``done`` is True
    once ``message_stop`` has come (only then is the finish sent).
    """

    def __init__(self, provider: str, strip: str = "") -> None:
        self.provider = provider
        self.strip = strip            # whitespace the prefill lost: not repeated
        self.kinds: dict[int, str] = {}  # content block index → its type
        self.tool_of: dict[int, int] = {}  # block index → tool-call ordinal
        self.stop_reason: str | None = None
        self.usage: dict[str, Any] = {}
        self.done = False

    def _content(self, text: str) -> list[Event]:
        n = 0
        while n < len(text) and n < len(self.strip) and text[n] == self.strip[n]:
            n += 1
        self.strip = self.strip[n:] if n == len(text) else ""
        text = text[n:]
        return [Delta(content=text)] if text else []

    def _start(self, index: int, block: dict[str, Any]) -> list[Event]:
        kind = str(block.get("type"))
        self.kinds[index] = kind
        if kind == "text":
            return self._content(str(block.get("text") or ""))
        if kind == "tool_use":
            ordinal = self.tool_of[index] = len(self.tool_of)
            out: list[Event] = [Delta(tool_calls=[{
                "index": ordinal, "id": block.get("id"), "type": "function",
                "function": {"name": block.get("name"), "arguments": ""}}])]
            if block.get("input"):  # whole input up front (non-streamed, server tools)
                out.append(self._args(index, json.dumps(block["input"])))
            return out
        if kind == "thinking":
            thought = block.get("thinking")
            return [Delta(extra={"reasoning_content": thought})] if thought else []
        if kind == "redacted_thinking":
            return []
        return [Skipped(f"content block of type {kind!r} not relayed")]

    def _args(self, index: int, partial: str) -> Delta:
        return Delta(tool_calls=[{"index": self.tool_of[index],
                                  "function": {"arguments": partial}}])

    def _delta(self, index: int, delta: dict[str, Any]) -> list[Event]:
        kind = delta.get("type")
        if kind == "text_delta":
            return self._content(str(delta.get("text") or ""))
        if kind == "input_json_delta" and index in self.tool_of:
            partial = str(delta.get("partial_json") or "")
            return [self._args(index, partial)] if partial else []
        if kind == "thinking_delta":
            thought = delta.get("thinking")
            return [Delta(extra={"reasoning_content": thought})] if thought else []
        if kind in ("signature_delta", "citations_delta"):
            return []
        return [Skipped(f"content_block_delta of type {kind!r} not relayed")]

    def _finish(self) -> list[Event]:
        self.done = True
        reason = STOP_REASONS.get(self.stop_reason or "")
        out: list[Event] = [usage_of(self.usage)]
        if reason is None:
            out.append(Skipped(f"unknown stop_reason {self.stop_reason!r}, relayed as stop"))
            reason = "tool_calls" if self.tool_of else "stop"
        out.append(Finish(reason))
        return out

    def feed(self, event: dict[str, Any]) -> list[Event]:
        """One stream event (its JSON data).

        Raises:
            RelayError: the mapped failure of an ``error`` event.
        """
        kind = event.get("type")
        if kind == "message_start":
            message = event.get("message") or {}
            self.usage.update(message.get("usage") or {})
            return []
        if kind == "content_block_start":
            return self._start(int(event.get("index", 0)), event.get("content_block") or {})
        if kind == "content_block_delta":
            return self._delta(int(event.get("index", 0)), event.get("delta") or {})
        if kind == "message_delta":
            delta = event.get("delta") or {}
            self.stop_reason = delta.get("stop_reason") or self.stop_reason
            self.usage.update({k: v for k, v in (event.get("usage") or {}).items()
                               if v is not None})
            return []
        if kind == "message_stop":
            return self._finish()
        if kind in ("content_block_stop", "ping"):
            return []
        if kind == "error":
            raise self.error(event)
        return [Skipped(f"stream event {kind!r} not relayed")]

    def error(self, event: dict[str, Any]) -> RelayError:
        err = event.get("error")
        status = ERROR_STATUS.get(str(err.get("type")) if isinstance(err, dict) else "", 500)
        return upstream_failure(self.provider, status, json.dumps(event), {}, in_stream=True)

    def whole(self, message: dict[str, Any]) -> list[Event]:
        """A non-streamed message."""
        out: list[Event] = []
        for index, block in enumerate(message.get("content") or ()):
            if isinstance(block, dict):
                out += self._start(index, block)
        self.stop_reason = message.get("stop_reason")
        self.usage = dict(message.get("usage") or {})
        return out + self._finish()


# --- the adapter --------------------------------------------------------------------------

class AnthropicAdapter(CloudAdapter):
    kind = "anthropic"
    Settings = AnthropicSettings
    # Anthropic continues a final assistant message.
    capabilities = Capabilities(tools=True, prefill=True)
    default_base_url = "https://api.anthropic.com/v1"
    default_key_env = "ANTHROPIC_API_KEY"
    supported_params = frozenset({
        "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "stop",
        "tools", "tool_choice", "parallel_tool_calls", "user", "stream_options"})
    neutral_params = {"n": 1, "presence_penalty": 0, "frequency_penalty": 0,
                      "logprobs": False, "response_format": {"type": "text"},
                      "thinking": {"type": "disabled"}}

    def key_headers(self, key: str) -> dict[str, str]:
        return {"x-api-key": key, "anthropic-version": ANTHROPIC_VERSION}

    @classmethod
    def recommended_profile(cls, settings: Any) -> Profile:
        # A cloud: many requests at once, metered (rpm 50 is the first usage tier's).
        return Profile(lanes=8, queue_max=64, queue_timeout_s=60.0, run_timeout_s=600.0,
                       rpm=50.0)

    @classmethod
    def max_call_s(cls, settings: Any) -> float:
        return 300.0  # long answers at a few dozen tokens a second

    @classmethod
    def typical_call_s(cls, settings: Any) -> float:
        return 15.0

    def check_call(self, call: Call) -> None:
        super().check_call(call)
        messages_request(call, self.settings.max_tokens)

    async def models(self) -> list[str]:
        if self.provider.models_configured:
            return list(self.provider.models)
        names: list[str] = []
        after = ""
        for _ in range(20):
            page = await self.get_json(f"{self.base_url}/models?limit=1000{after}",
                                       "model list")
            try:
                names += [str(m["id"]) for m in page["data"]]
                last = page.get("last_id")
            except (KeyError, TypeError) as exc:
                raise self.unreadable("a model list", json.dumps(page)) from exc
            if not page.get("has_more") or not last:
                break
            after = f"&after_id={last}"
        return names

    async def run(self, call: Call, events: EventSink) -> None:
        self.refuse_without_key()
        events = self.bounded(events)
        body, strip = messages_request(call, self.settings.max_tokens)
        reader = MessageReader(self.name, strip)
        await self.post(f"{self.base_url}/messages", body, stream=call.stream,
                        read_stream=lambda resp: self._read_stream(resp, reader, events),
                        read_whole=lambda text: self._emit_whole(text, reader, events))

    async def _read_stream(self, resp: Any, reader: MessageReader, events: EventSink) -> None:
        async def handle(name: str | None, data: str) -> bool:
            try:
                event = json.loads(data)
                if not isinstance(event, dict):
                    raise ValueError("not an object")
            except ValueError:
                await events.send(Skipped(f"{name or 'event'}: not JSON: "
                                          f"{excerpt(data, 120)!r}"))
                return False
            event.setdefault("type", name)
            for out in reader.feed(event):
                await events.send(out)
            return reader.done

        await self.read_sse(resp, handle)

    async def _emit_whole(self, text: str, reader: MessageReader, events: EventSink) -> None:
        try:
            message = json.loads(text)
            if isinstance(message, dict) and message.get("type") == "error":
                raise reader.error(message)  # an error body with a 200 status
            if not isinstance(message, dict) or not isinstance(message.get("content"), list):
                raise ValueError("no content")
        except ValueError as exc:
            raise self.unreadable("an answer", text) from exc
        for out in reader.whole(message):
            await events.send(out)
