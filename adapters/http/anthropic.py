"""Anthropic's Messages API (``POST {base_url}/messages``), behind relay's OpenAI shapes.

Theory of operation. relay speaks OpenAI's chat shapes inside; this adapter translates a
`Call` into a Messages request (`messages_request`, pure, so `check_call` can refuse what
it cannot translate before anything is queued) and Anthropic's answer back into relay
events (`MessageReader`, sans-IO: fed one stream event, or one whole message, at a time).
A client that spoke Messages itself gets its request passed on unchanged
(`native_request`, SPEC A1a, A6): thinking blocks with their signatures, ``cache_control``,
``context_management`` and the rest as sent, with its ``anthropic-version`` and
``anthropic-beta`` headers; the answer's signatures and redacted thinking come back to it
as ``reasoning_signature`` and ``redacted_thinking`` delta fields.

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

Token counts (SPEC A6): ``POST {base_url}/messages/count_tokens`` with the request the
answer would have had, less the fields that only say how to answer (`COUNT_FIELDS`
are what the counter takes); its ``input_tokens``.

Prefill (SPEC F8): Anthropic continues a final assistant message, but refuses one that
ends in whitespace; that whitespace is cut from the request and from the start of the
continuation, so the client's text joins up exactly.
"""

from __future__ import annotations

import json
from typing import Any

import attrs

from relay.api.adapter import Capabilities
from relay.api.fields import ACCOUNTING, EFFORT, LIMITS, OUTPUT, column
from relay.api.http import HTTPSettings
from relay.vocab.errors import RelayError, excerpt
from relay.vocab.events import Call, Delta, Event, EventSink, Finish, Skipped, Usage
from relay.vocab.profile import Profile

from .anthropic_request import DEFAULT_MAX_TOKENS, messages_request, native_request
from .base import upstream_failure
from .cloud import CloudAdapter
from .whole import count_of, post_json, unreadable

__all__ = ["ERROR_STATUS", "STOP_REASONS", "AnthropicAdapter", "AnthropicSettings",
           "MessageReader", "messages_request"]

ANTHROPIC_VERSION = "2023-06-01"
# What /v1/messages/count_tokens takes of a Messages request (it refuses max_tokens,
# stream, temperature, metadata …: they say how to answer, not what is read).
COUNT_FIELDS = frozenset({"model", "messages", "system", "tools", "tool_choice", "thinking",
                          "cache_control", "output_config", "mcp_servers",
                          "context_management", "speed"})

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

@attrs.frozen(kw_only=True)
class AnthropicSettings(HTTPSettings):
    max_tokens: int = attrs.field(default=DEFAULT_MAX_TOKENS,
                                  validator=attrs.validators.ge(1))
    """``max_tokens`` for requests that give none (Anthropic requires one)."""


# --- answer: Messages → relay events ---------------------------------------------------------

def usage_of(raw: Any) -> Usage:
    """Anthropic's usage → relay's (SPEC L12a). Anthropic's ``input_tokens`` is only the
    uncached part: the prompt is it, the cache reads (``cache_read_input_tokens``) and the
    cache writes (``cache_creation_input_tokens``) together, and the two cache figures are
    kept apart (None: Anthropic did not say)."""
    raw = raw if isinstance(raw, dict) else {}
    read = count_of(raw.get("cache_read_input_tokens"))
    write = count_of(raw.get("cache_creation_input_tokens"))
    prompt = (count_of(raw.get("input_tokens")) or 0) + (read or 0) + (write or 0)
    completion = count_of(raw.get("output_tokens")) or 0
    return Usage(prompt, completion, prompt + completion, cache_read_tokens=read,
                 cache_write_tokens=write)


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
            thought, signature = block.get("thinking"), block.get("signature")
            out = [Delta(extra={"reasoning_content": thought})] if thought else []
            if isinstance(signature, str) and signature:  # whole (non-streamed)
                out.append(Delta(extra={"reasoning_signature": signature}))
            return out
        if kind == "redacted_thinking":
            data = block.get("data")
            return [Delta(extra={"redacted_thinking": data})] if isinstance(data, str) else []
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
        if kind == "signature_delta":
            signature = delta.get("signature")
            return [Delta(extra={"reasoning_signature": signature})] if isinstance(
                signature, str) and signature else []
        if kind == "citations_delta":
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
    capabilities = Capabilities(tools=True, prefill=True, count_tokens=True, vision=True,
                                thinking=True, context_tokens=200_000)
    default_base_url = "https://api.anthropic.com/v1"
    default_key_env = "ANTHROPIC_API_KEY"
    # SPEC A1a: it speaks Messages (a Messages request passes, unchanged); a chat
    # request's fields are translated where Messages has them, hints it has not are
    # dropped and reported, the rest refused.
    fields = column(
        speaks="anthropic",
        translated=(*LIMITS, "temperature", "top_p", "top_k", "stop", "tools", "tool_choice",
                    "parallel_tool_calls", "user", "stream_options"),
        advisory=("presence_penalty", "frequency_penalty", "seed", *EFFORT,
                  *(f for f in ACCOUNTING if f != "user")),
        refused=("functions", "function_call", *(f for f in OUTPUT if f != "stop")))

    def key_headers(self, key: str) -> dict[str, str]:
        return {"x-api-key": key, "anthropic-version": ANTHROPIC_VERSION}

    @classmethod
    def recommended_profile(cls, settings: Any) -> Profile:
        # A cloud: many requests at once, metered (rpm 50 is the first usage tier's); 2
        # at once until a model's first answer has told its limits (SPEC L12a).
        return Profile(lanes=8, queue_max=64, queue_timeout_s=60.0, run_timeout_s=600.0,
                       rpm=50.0, first_starts=2)

    @classmethod
    def max_call_s(cls, settings: Any) -> float:
        return 300.0  # long answers at a few dozen tokens a second

    @classmethod
    def typical_call_s(cls, settings: Any) -> float:
        return 15.0

    def check_request(self, call: Call) -> None:
        if native_request(call) is None:
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
        native = native_request(call)
        body, strip = native or messages_request(call, self.settings.max_tokens)
        reader = MessageReader(self.name, strip)
        await self.post(f"{self.base_url}/messages", body, stream=call.stream,
                        events=events,
                        read_stream=lambda resp: self._read_stream(resp, reader, events),
                        read_whole=lambda text: self._emit_whole(text, reader, events),
                        headers=self._client_headers(call) if native else None)

    def _client_headers(self, call: Call) -> dict[str, str]:
        """The client's ``anthropic-version`` (instead of relay's) and ``anthropic-beta``
        (with any the provider's ``headers`` set)."""
        out = {k: v for k, v in call.inbound.headers.items() if k == "anthropic-version"}
        own = [v for k, v in self.headers.items() if k.lower() == "anthropic-beta"]
        betas = [b.strip() for value in (*own, call.inbound.headers.get("anthropic-beta"))
                 for b in (value or "").split(",") if b.strip()]
        if betas:
            out["anthropic-beta"] = ",".join(dict.fromkeys(betas))
        return out

    async def count_tokens(self, call: Call) -> int:
        self.refuse_without_key()
        body, _ = messages_request(call, self.settings.max_tokens)
        body = {key: value for key, value in body.items() if key in COUNT_FIELDS}
        answer = await post_json(self, f"{self.base_url}/messages/count_tokens", body,
                                 "a token count")
        tokens = count_of(answer.get("input_tokens"))
        if tokens is None:
            raise unreadable(self.name, "a token count without input_tokens",
                             json.dumps(answer))
        return tokens

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
