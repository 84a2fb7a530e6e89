"""Whatever JSON a client sends, the cloud translations answer with a `RelayError` (a
clear 4xx) or a request — never a crash that would surface as a 500 (SPEC O4)."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from relay.adapters.http.anthropic import messages_request
from relay.adapters.http.gemini import gemini_request
from relay.dialects.anthropic_messages import parse_messages_body
from relay.dialects.openai_chat import OPENAI
from relay.vocab.errors import RelayError
from relay.vocab.events import Call

KEYS = ["role", "content", "type", "text", "image_url", "url", "tool_calls", "function",
        "name", "arguments", "id", "tool_call_id", "file", "file_data", "input_audio",
        "data", "format", "source", "media_type", "input", "tool_use_id", "is_error",
        "extra_content", "google", "thought_signature", "parameters", "json_schema",
        "schema", "input_schema", "disable_parallel_tool_use", "user_id"]
SCALARS = (st.none() | st.booleans() | st.integers(-3, 3) | st.sampled_from(
    ["", "user", "assistant", "tool", "system", "text", "image_url", "file", "function",
     "data:image/png;base64,AA", "https://x.test/a.png", "{}", '{"a":1}', "{", "auto",
     "required", "none", "tool", "any", "base64", "url", "image", "tool_use",
     "tool_result", "json_object", "json_schema", "input_audio", "document"]))
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
    st.sampled_from(KEYS), inner, max_size=4), max_leaves=25)
PARAMS = ["tools", "tool_choice", "stop", "response_format", "max_tokens",
          "max_completion_tokens", "temperature", "top_p", "top_k", "n", "user",
          "parallel_tool_calls", "seed"]
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "developer", "user", "assistant", "tool"])},
    optional={"content": JSON, "tool_calls": JSON, "tool_call_id": JSON, "name": JSON})


def _openai_call(messages: list[Any], params: dict[str, Any]) -> Call | None:
    body = json.dumps({**params, "model": "p/m", "messages": messages}).encode()
    try:
        chat = OPENAI.parse(body)  # what the front lets through
    except RelayError:
        return None
    return Call(request_id="r", provider="p", model="m", messages=chat.messages,
                stream=False, params=chat.params)


@settings(max_examples=200, deadline=None)
@given(st.lists(MESSAGE, min_size=1, max_size=4),
       st.dictionaries(st.sampled_from(PARAMS), JSON, max_size=3))
def test_adapters_translate_or_refuse(messages: list[Any], params: dict[str, Any]) -> None:
    call = _openai_call(messages, params)
    if call is None:
        return
    for translate in (messages_request, gemini_request):
        try:
            translate(call)
        except RelayError as exc:
            assert 400 <= exc.status < 500


ANTHROPIC_BLOCK = st.dictionaries(st.sampled_from(KEYS), JSON, max_size=5)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant"]),
     "content": st.one_of(st.text(max_size=3), st.lists(ANTHROPIC_BLOCK, max_size=3))}),
    min_size=1, max_size=4),
    st.dictionaries(st.sampled_from(["system", "tools", "tool_choice", "stop_sequences",
                                     "metadata", "temperature", "top_k", "stream"]),
                    JSON, max_size=3))
def test_the_messages_dialect_parses_or_refuses(messages: list[Any],
                                                extra: dict[str, Any]) -> None:
    body = json.dumps({"model": "p/m", "max_tokens": 5, "messages": messages, **extra})
    try:
        chat = parse_messages_body(body.encode())
    except RelayError as exc:
        assert 400 <= exc.status < 500
        return
    call = Call(request_id="r", provider="p", model="m", messages=chat.messages,
                stream=chat.stream, params=chat.params)
    for translate in (messages_request, gemini_request):
        try:
            translate(call)
        except RelayError as exc:
            assert 400 <= exc.status < 500
