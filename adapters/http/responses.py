"""The pass-through of ``/v1/responses`` (SPEC A7): an OpenAI-compatible server that
speaks Responses itself (the ``openai`` adapter's ``responses`` setting) is given the
request as the client sent it, and its answer comes back as it is.

Its events and its response object travel to the Responses dialect inside a delta's
extra fields (``responses_event``, ``responses_body``), untouched; beside them relay
reads what it needs itself: the text (for the record, its bounds and deadlines), the
usage, and the end — ``response.completed`` (``stop``, or ``tool_calls`` when the output
calls a tool), ``response.incomplete`` (``length``, ``content_filter``). A
``response.failed`` or ``error`` event is that failure, classified like the same error
as an answer. Streams are read by the one SSE reader every HTTP adapter shares, bodies
through relay's bounded reader (SPEC O5).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from relay.vocab.errors import RelayError, excerpt
from relay.vocab.events import Delta, EventSink, Finish, Skipped, Usage

__all__ = ["ResponsesReader"]

_CALLS = ("function_call", "custom_tool_call", "local_shell_call", "shell_call",
          "apply_patch_call", "computer_call", "mcp_approval_request")


def _usage(raw: Any) -> Usage | None:
    if not isinstance(raw, dict):
        return None

    def num(key: str) -> int | None:
        val = raw.get(key)
        return val if isinstance(val, int) and not isinstance(val, bool) else None
    # input_tokens counts the cached ones too; input_tokens_details says how many (L12a).
    details = raw.get("input_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return Usage(num("input_tokens"), num("output_tokens"), num("total_tokens"),
                 cache_read_tokens=cached if type(cached) is int and cached >= 0 else None)


def _finish(response: dict[str, Any]) -> str:
    if response.get("status") == "incomplete":
        details = response.get("incomplete_details") or {}
        return "content_filter" if details.get("reason") == "content_filter" else "length"
    output = response.get("output") or ()
    if any(isinstance(i, dict) and i.get("type") in _CALLS for i in output):
        return "tool_calls"
    return "stop"


def _text(response: dict[str, Any]) -> str:
    return "".join(part.get("text") or "" for item in response.get("output") or ()
                   if isinstance(item, dict) and item.get("type") == "message"
                   for part in item.get("content") or () if isinstance(part, dict)
                   and part.get("type") == "output_text")


class ResponsesReader:
    """Reads one passed-through answer into relay's events. ``failure`` makes the relay
    error for an error object the provider sent inside a 200 answer."""

    def __init__(self, provider: str, events: EventSink,
                 failure: Callable[[Any], RelayError]) -> None:
        self.provider = provider
        self.events = events
        self.failure = failure
        self.final = False

    async def event(self, name: str | None, data: str) -> bool:
        """One SSE event; True once the response's final event has come."""
        try:
            event = json.loads(data)
            if not isinstance(event, dict):
                raise ValueError("not an object")
        except ValueError:
            await self.events.send(Skipped(f"{name or 'event'}: not JSON: "
                                           f"{excerpt(data, 120)!r}"))
            return False
        kind = event.get("type") or name
        event["type"] = kind
        found = event.get("response")
        response: dict[str, Any] = found if isinstance(found, dict) else {}
        if kind == "error":
            raise self.failure(event.get("error") if isinstance(event.get("error"), dict)
                               else event)
        if kind == "response.failed":
            raise self.failure(response.get("error") or {"message": "response.failed"})
        text = event.get("delta") if kind == "response.output_text.delta" else None
        await self.events.send(Delta(content=text if isinstance(text, str) and text
                                     else None, extra={"responses_event": event}))
        if kind in ("response.completed", "response.incomplete"):
            usage = _usage(response.get("usage"))
            if usage is not None:
                await self.events.send(usage)
            await self.events.send(Finish(_finish(response)))
            self.final = True
        return self.final

    async def whole(self, text: str) -> None:
        """A non-streamed answer: one response object."""
        try:
            body = json.loads(text)
            if not isinstance(body, dict):
                raise ValueError("not an object")
        except ValueError as exc:
            raise RelayError("bad_upstream_response", f"provider {self.provider!r} sent a "
                             f"response relay cannot read: {excerpt(text, 300)!r}",
                             provider=self.provider, upstream_message=text) from exc
        if body.get("status") == "failed" or isinstance(body.get("error"), dict):
            raise self.failure(body.get("error") or {"message": "the response failed"})
        if not isinstance(body.get("output"), list):
            raise RelayError("bad_upstream_response", f"provider {self.provider!r} sent a "
                             "response without an output list", provider=self.provider,
                             upstream_message=text)
        await self.events.send(Delta(content=_text(body) or None,
                                     extra={"responses_body": body}))
        usage = _usage(body.get("usage"))
        if usage is not None:
            await self.events.send(usage)
        await self.events.send(Finish(_finish(body)))
