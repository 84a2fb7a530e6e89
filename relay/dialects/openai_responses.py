"""The OpenAI Responses dialect: what clients send to ``/v1/responses`` (SPEC A7) — the
Codex CLI, the OpenAI Agents SDK's default model, ``client.responses.create``.

A request is checked (a 400 naming the field) and made into two forms, both in the one
`ChatInput`:

- the *translation* into relay's own request (OpenAI chat shapes), for every provider
  that does not speak Responses itself — the tables below;
- the request *as sent* (``ChatInput.responses``: ``previous_response_id`` already
  expanded, relay's own ``fallbacks`` removed), for an OpenAI-compatible provider that
  does (``Capabilities.responses``): there it is passed through whole, reasoning items,
  hosted tools and every other field included.

The front (`relay.front.responses`) asks the primary target's capability and uses the
translation's ``problems`` (refusals) and ``ignored`` (advisory fields, dropped and
reported in ``X-Relay-Ignored-Fields``) only when the translation is what runs.

==================================  ===================================================
Responses request                   relay (OpenAI chat shapes)
==================================  ===================================================
``instructions``                    a ``system`` message first (never inherited)
``input`` text                      one ``user`` message
``message`` items                   messages; ``developer`` → ``system``; input_text,
                                    output_text, refusal → text; input_image →
                                    ``image_url``; input_file → ``file``
``function_call`` /                 an assistant message's ``tool_calls`` (a custom
``custom_tool_call``                tool's ``input`` as the one string argument)
``*_call_output``                   ``tool`` messages
``reasoning`` items                 dropped, reported as ``input.reasoning``
hosted tools' call items            dropped, reported as ``input.<type>``
``tools``: function                 function tools
``tools``: custom (free-form)        a function with one string argument, ``input``; the
                                    calls come back as ``custom_tool_call`` items
``tools``: namespace                its tools as functions named ``NAMESPACE__NAME``;
                                    the calls come back with their ``namespace``
``tools``: hosted (web_search, …)   offered: dropped, reported as ``tools.<type>``;
                                    named by ``tool_choice``: refused (400)
``tool_choice``                     auto/none/required; a function or custom tool by
                                    name; ``allowed_tools`` narrows ``tools``
``text.format``                     ``response_format`` (json_object, json_schema)
``reasoning.effort``                ``reasoning_effort``
``max_output_tokens``               ``max_tokens``
``temperature``, ``top_p``, ``user``, ``parallel_tool_calls``: the same;
``top_logprobs`` → ``logprobs`` + ``top_logprobs``
==================================  ===================================================

Neutral, accepted and dropped: ``store`` (relay's own store), ``include`` (items relay
cannot make are never there), ``stream_options``, ``truncation: "disabled"``,
``background: false``, ``service_tier: "auto"``. Advisory on the translation (dropped and
reported): `ADVISORY`. Refused everywhere: ``background: true``, ``conversation``,
``prompt`` (relay keeps no conversations or prompt templates). Any other field is
refused on the translation (a field of one dialect never reaches a provider of another
raw) and passed through where the provider speaks Responses.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from relay.dialects.base import ChatInput
from relay.dialects.openai_chat import bad_request, load_request
from relay.vocab.errors import RelayError
from relay.vocab.events import Inbound

from .responses_render import ResponsesRender, new_response_id
from .responses_translate import (
    ADVISORY,
    FIELDS,
    HOSTED_TOOLS,
    Translation,
    tool_choice,
    translate_fields,
    translate_input,
    translate_tools,
    unsupported,
)
from .schemas import RESPONSES_SCHEMA
from .typed import check

__all__ = ["ADVISORY", "FIELDS", "HOSTED_TOOLS", "RESPONSES", "RESPONSES_SCHEMA", "Lookup",
           "ResponsesDialect", "ResponsesTurn", "Translation", "new_response_id"]

# What a stored response gives back: (its whole input, its response object) or None.
Lookup = Callable[[str], "tuple[list[dict[str, Any]], dict[str, Any]] | None"]

# --- the dialect ---------------------------------------------------------------------------

def check_request(data: dict[str, Any]) -> None:
    """What relay refuses whatever the provider (it keeps no conversations)."""
    if not isinstance(data.get("stream", False), bool | None):
        raise bad_request("'stream' must be true or false", "stream")
    if data.get("background"):
        raise unsupported("relay does not run responses in the background: leave out "
                           "'background' and wait for the answer (or stream it)", "background")
    for key, what in (("conversation", "conversations"), ("prompt", "prompt templates")):
        if data.get(key) is not None:
            raise unsupported(f"relay keeps no {what}: leave out {key!r} and send the "
                               "whole input (or previous_response_id)", key)
    store = data.get("store")
    if store is not None and not isinstance(store, bool):
        raise bad_request("'store' must be true or false", "store")
    instructions = data.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad_request("'instructions' must be a string", "instructions")


def expand(data: dict[str, Any], lookup: Lookup) -> list[dict[str, Any]]:
    """The request's whole input: a previous response's input and output, then its own.

    Raises:
        RelayError: ``invalid_request`` (404) naming an id the store does not hold.
    """
    raw = data.get("input")
    if isinstance(raw, str):
        own: list[dict[str, Any]] = [{"type": "message", "role": "user", "content": raw}]
    elif isinstance(raw, list):
        own = raw
    else:
        raise bad_request("'input' must be a string or a list of items", "input")
    previous = data.get("previous_response_id")
    if previous is None:
        if not own:
            raise bad_request("'input' must not be empty", "input")
        return own
    if not isinstance(previous, str) or not previous:
        raise bad_request("'previous_response_id' must be a response id", "previous_response_id")
    found = lookup(previous)
    if found is None:
        raise RelayError("invalid_request", f"previous response {previous!r} not found",
                         status=404, param="previous_response_id")
    before, response = found
    output = [item for item in response.get("output") or () if isinstance(item, dict)]
    return [*before, *output, *own]


class ResponsesTurn(ResponsesRender):
    """One ``/v1/responses`` request: parsed against the store it is given (``lookup``),
    and rendered back — ``on_final`` is handed the finished response object before the
    client gets its last byte, so a follow-up naming it always finds it stored."""

    name = "responses"

    def __init__(self, lookup: Lookup,
                 on_final: Callable[[dict[str, Any]], None] | None = None) -> None:
        super().__init__(on_final)
        self.lookup = lookup
        self.translation = Translation()
        self.input_items: list[dict[str, Any]] = []

    def parse(self, body: bytes) -> ChatInput:
        data = load_request(body)
        check(data, RESPONSES_SCHEMA)
        check_request(data)
        items = expand(data, self.lookup)
        self.input_items = items
        t = self.translation = Translation()
        instructions = data.get("instructions")
        if instructions:
            t.messages.append({"role": "system", "content": instructions})
        translate_input(items, t)
        if data.get("tools") is not None:
            tools = translate_tools(data["tools"], t)
            choice = tool_choice(data.get("tool_choice"), tools, t)
            if choice == "required" and not tools:
                t.refuse(unsupported("tool_choice 'required' leaves only tools relay cannot "
                                      "run for this provider (OpenAI runs them itself)",
                                      "tool_choice"))
            if tools:
                t.params["tools"] = tools
                if choice is not None:
                    t.params["tool_choice"] = choice
        elif data.get("tool_choice") not in (None, "auto", "none"):
            tool_choice(data.get("tool_choice"), [], t)
        translate_fields(data, t)
        if not any(m["role"] != "system" for m in t.messages):
            raise bad_request("the input holds no message to answer", "input")
        self.custom, self.namespaced = t.custom, t.namespaced
        self.echo = _echo(data)
        passed = {k: v for k, v in data.items() if k not in ("fallbacks",
                                                             "previous_response_id")}
        passed["input"] = items
        return ChatInput(model=data["model"], messages=t.messages,
                         stream=bool(data.get("stream")), params=t.params,
                         fallbacks=data.get("fallbacks"), include_usage=True,
                         responses=passed, inbound=Inbound(names=t.names))


def _echo(data: dict[str, Any]) -> dict[str, Any]:
    """The request fields a Response object repeats."""
    return {
        "instructions": data.get("instructions"),
        "max_output_tokens": data.get("max_output_tokens"),
        "metadata": data.get("metadata") or {},
        "parallel_tool_calls": data.get("parallel_tool_calls", True),
        "previous_response_id": data.get("previous_response_id"),
        "reasoning": data.get("reasoning") or {"effort": None, "summary": None},
        "store": data.get("store", True),
        "temperature": data.get("temperature"),
        "text": data.get("text") or {"format": {"type": "text"}},
        "tool_choice": data.get("tool_choice", "auto"),
        "tools": data.get("tools") or [],
        "top_p": data.get("top_p"),
        "truncation": data.get("truncation") or "disabled",
        "user": data.get("user"),
    }


class ResponsesDialect(ResponsesRender):
    """The route's dialect for what needs no request (error bodies); a request is served
    by a `ResponsesTurn` bound to the engine's store."""

    name = "responses"

    def parse(self, body: bytes) -> ChatInput:
        return ResponsesTurn(lambda _id: None).parse(body)

    def turn(self, lookup: Lookup,
             on_final: Callable[[dict[str, Any]], None] | None = None) -> ResponsesTurn:
        return ResponsesTurn(lookup, on_final)


RESPONSES = ResponsesDialect()
