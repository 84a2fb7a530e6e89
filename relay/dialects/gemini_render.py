"""The Gemini dialect, answers: relay's `Answer` and stream events rendered as Google's
``GenerateContentResponse`` shapes, and errors as Google's error bodies (SPEC A9, E1).
`relay.dialects.gemini_generate` parses the requests; see its docstring for the
translation tables.

An answer is ``{"candidates": [{"content": {"role": "model", "parts": […]},
"finishReason", "index"}], "usageMetadata", "modelVersion", "responseId"}``; its parts
are ``{"text", "thought": true}`` for reasoning, ``{"text"}``, and ``{"functionCall":
{"id", "name", "args"}}`` — the id is the provider's tool call id, which the client sends
back in its ``functionResponse`` (matched on the way in). A stream is ``data: {…}``
events separated by ``\\r\\n\\r\\n`` (as Google's own), text as it comes; tool calls are
sent whole (Gemini never splits one), with the last event, which carries the
``finishReason`` and ``usageMetadata``. A failure after the headers is ``data:
{"error": …}`` and the stream ends.

Errors are ``{"error": {"code", "message", "status", "details": [ErrorInfo
(relay's reason, domain ``relay``, its E1 fields as metadata), BadRequest (the field
at fault), RetryInfo (when a retry may help)], "relay": {…E1's relay object}}}``.
"""

from __future__ import annotations

import json
from typing import Any

from relay.dialects.base import Answer, dumps
from relay.vocab.errors import RelayError
from relay.vocab.events import Delta, Finish, Usage

__all__ = ["FINISH_REASONS", "GOOGLE_STATUS", "GeminiRender", "GeminiStream", "comment",
           "google_error"]

# relay's finish_reason → Gemini's finishReason.
FINISH_REASONS: dict[str, str] = {"stop": "STOP", "length": "MAX_TOKENS",
                                  "tool_calls": "STOP", "function_call": "STOP",
                                  "content_filter": "SAFETY"}
# An HTTP status → Google's canonical status word.
GOOGLE_STATUS: dict[int, str] = {
    400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED",
    404: "NOT_FOUND", 405: "UNIMPLEMENTED", 408: "DEADLINE_EXCEEDED", 409: "ABORTED",
    413: "INVALID_ARGUMENT", 415: "INVALID_ARGUMENT", 429: "RESOURCE_EXHAUSTED",
    499: "CANCELLED", 500: "INTERNAL", 501: "UNIMPLEMENTED", 502: "UNAVAILABLE",
    503: "UNAVAILABLE", 504: "DEADLINE_EXCEEDED"}
_SEP = b"\r\n\r\n"


def google_error(error: RelayError) -> dict[str, Any]:
    """``error`` in Google's shape, relay's reason and action inside (SPEC A9, E1)."""
    relay = {**error.body()["error"]["relay"], "code": error.reason, "param": error.param}
    metadata = {key: str(value) for key, value in relay.items()
                if value is not None and key not in ("reason", "code")}
    details: list[dict[str, Any]] = [{
        "@type": "type.googleapis.com/google.rpc.ErrorInfo", "reason": error.reason,
        "domain": "relay", "metadata": metadata}]
    if error.param is not None:
        details.append({"@type": "type.googleapis.com/google.rpc.BadRequest",
                        "fieldViolations": [{"field": error.param,
                                             "description": error.message}]})
    if error.retry_after_s is not None and error.should_retry:
        details.append({"@type": "type.googleapis.com/google.rpc.RetryInfo",
                        "retryDelay": f"{max(1, round(error.retry_after_s))}s"})
    status = GOOGLE_STATUS.get(error.status) or (
        "INTERNAL" if error.status >= 500 else "FAILED_PRECONDITION")
    return {"error": {"code": error.status, "message": error.message, "status": status,
                      "details": details, "relay": relay}}


def comment(text: str, *, comments: bool = True) -> bytes:
    """A waiting notice or heartbeat: an SSE comment (SPEC A2, A9); or, for a client
    whose parser cannot skip a comment line, an empty line (see `GeminiRender`)."""
    return f": {text}\n\n".encode() if comments else b"\r\n"


def _args(arguments: Any) -> dict[str, Any]:
    """A tool call's arguments as the object ``functionCall.args`` is."""
    if isinstance(arguments, dict):
        return arguments
    try:
        value = json.loads(arguments) if arguments else {}
    except (TypeError, ValueError):
        value = None
    # A model's arguments that are not a JSON object still reach the client, whole.
    return value if isinstance(value, dict) else {"_arguments": arguments}


# The gemini adapter carries Gemini's thought signature inside a tool call's id, urlsafe
# and unpadded, after this mark (adapters/http/gemini_request.py, `tool_call_id`).
_SIGNATURE = "__ts_"


def _call_part(call: dict[str, Any], k: int, request_id: str) -> dict[str, Any]:
    fn = call.get("function") or {}
    ident = call.get("id") or f"call_{request_id}_{k}"
    part: dict[str, Any] = {"functionCall": {"id": ident, "name": fn.get("name") or "",
                                             "args": _args(fn.get("arguments"))}}
    packed = ident.partition(_SIGNATURE)[2]
    if packed:  # Gemini 3 wants it back with the call: the client keeps the part whole
        part["thoughtSignature"] = (packed.replace("-", "+").replace("_", "/")
                                    + "=" * (-len(packed) % 4))
    return part


def usage_metadata(usage: Usage | None) -> dict[str, int]:
    if usage is None:
        return {"promptTokenCount": 0, "candidatesTokenCount": 0, "totalTokenCount": 0}
    prompt, answer = usage.prompt_tokens or 0, usage.completion_tokens or 0
    out = {"promptTokenCount": prompt, "candidatesTokenCount": answer,
           "totalTokenCount": usage.total_tokens or prompt + answer}
    if usage.cache_read_tokens is not None:   # (counted in promptTokenCount too, L12a)
        out["cachedContentTokenCount"] = usage.cache_read_tokens
    return out


class GeminiRender:
    """Answers, stream encoders and error bodies in Google's shapes (the dialect,
    `relay.dialects.gemini_generate.GEMINI`, adds the parsing).

    ``comments``: whether a stream's waiting notices and heartbeats are SSE comments. Google's
    own SDKs cannot skip one: the JavaScript SDK (the Gemini CLI's) matches each event
    with ``/^\\s*data: (.*)(?:\\n\\n|\\r\\r|\\r\\n\\r\\n)/`` at the start of its buffer,
    so a comment there stalls the stream for good, and the Python SDK parses a line
    without ``data:`` as JSON and fails. For them (`GEMINI_SDK`) a notice is an empty
    line, which both skip.
    """

    def __init__(self, *, comments: bool = True) -> None:
        self.comments = comments

    def error_body(self, error: RelayError) -> dict[str, Any]:
        return google_error(error)

    def render(self, answer: Answer) -> dict[str, Any]:
        candidates = []
        for index in sorted(answer.choices):
            choice = answer.choices[index]
            message = choice["message"]
            parts: list[dict[str, Any]] = []
            if message.get("reasoning_content"):
                parts.append({"text": message["reasoning_content"], "thought": True})
            if message.get("content"):
                parts.append({"text": message["content"]})
            parts += [_call_part(call, k, answer.id)
                      for k, call in enumerate(message.get("tool_calls") or ())]
            candidates.append({
                "content": {"role": "model", "parts": parts},
                "finishReason": FINISH_REASONS.get(choice.get("finish_reason") or "stop",
                                                   "OTHER"),
                "index": index})
        return {"candidates": candidates, "usageMetadata": usage_metadata(answer.usage),
                "modelVersion": answer.model, "responseId": answer.id}

    def encoder(self, request_id: str, created: int, include_usage: bool) -> GeminiStream:
        return GeminiStream(request_id, comments=self.comments)


class GeminiStream:
    """Google's SSE (see the module docstring)."""

    def __init__(self, request_id: str, *, comments: bool = True) -> None:
        self.id = request_id
        self.comments = comments
        self.begin("")

    def begin(self, model: str) -> None:
        self.model = model
        self.calls: dict[int, dict[int, dict[str, Any]]] = {}  # by candidate, by index
        self.finished: dict[int, str] = {}
        self.usage: Usage | None = None

    def comment(self, text: str) -> bytes:
        return comment(text, comments=self.comments)

    def _event(self, candidates: list[dict[str, Any]], usage: bool = False) -> bytes:
        obj: dict[str, Any] = {"candidates": candidates}
        if usage:
            obj["usageMetadata"] = usage_metadata(self.usage)
        obj["modelVersion"], obj["responseId"] = self.model, self.id
        return b"data: " + dumps(obj) + _SEP

    def delta(self, event: Delta) -> bytes:
        parts: list[dict[str, Any]] = []
        reasoning = (event.extra or {}).get("reasoning_content")
        if isinstance(reasoning, str) and reasoning:
            parts.append({"text": reasoning, "thought": True})
        if event.content:
            parts.append({"text": event.content})
        for call in event.tool_calls or ():  # gathered: sent whole with the last event
            slots = self.calls.setdefault(event.index, {})
            k = int(call.get("index", len(slots)))
            slot = slots.setdefault(k, {"id": None, "function": {"name": "",
                                                                 "arguments": ""}})
            if call.get("id"):
                slot["id"] = call["id"]
            fn = call.get("function") or {}
            if fn.get("name"):
                slot["function"]["name"] += fn["name"]
            args = fn.get("arguments")
            if isinstance(args, dict):
                slot["function"]["arguments"] = args
            elif isinstance(args, str) and args:
                slot["function"]["arguments"] += args
        if not parts:
            return b""
        return self._event([{"content": {"role": "model", "parts": parts},
                             "index": event.index}])

    def finish(self, event: Finish) -> bytes:
        self.finished[event.index] = FINISH_REASONS.get(event.reason, "OTHER")
        return b""

    def set_usage(self, usage: Usage) -> None:
        self.usage = usage

    def done(self) -> bytes:
        candidates = []
        for index in sorted({*self.finished, *self.calls} or {0}):
            slots = self.calls.get(index, {})
            parts = [_call_part(slots[k], k, self.id) for k in sorted(slots)]
            candidates.append({"content": {"role": "model", "parts": parts},
                               "finishReason": self.finished.get(index, "STOP"),
                               "index": index})
        return self._event(candidates, usage=True)

    def error(self, error: RelayError) -> bytes:
        return b"data: " + dumps(google_error(error)) + _SEP
