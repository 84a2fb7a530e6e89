"""relay's local token estimate (SPEC L12): cheap, no network call, no tokenizer.

ASCII text at 4 characters a token, other characters (CJK, most accented scripts) about a
token each; 4 tokens a message beyond its text, 3 for the reply's priming; tool
definitions and calls by their JSON; an image part a flat `IMAGE_TOKENS`. docs/tokens.md
says how it was made and how far off it was on the tests' corpora. The output reservation
is the request's own limit, else the provider's, else a learned percentile of the model's
answers (`relay.engine.budget.Budget.learned_output`), never below `OUTPUT_FLOOR`.
"""

from __future__ import annotations

import json
import math
from typing import Any

from relay.vocab.events import Call

__all__ = ["IMAGE_TOKENS", "MESSAGE_OVERHEAD", "OUTPUT_FLOOR", "estimate_input",
           "estimate_text", "output_reservation"]

OUTPUT_FLOOR = 256          # tokens reserved for an answer of unknown length
MESSAGE_OVERHEAD = 4        # tokens a chat message costs beyond its text (role, framing)
IMAGE_TOKENS = 1000         # an image part, roughly (providers count 85-1,600)


def estimate_text(text: str) -> int:
    """Tokens in ``text``, locally and cheaply: ASCII at 4 characters a token, other
    characters (CJK, most accented scripts) a token each (docs/tokens.md has how far off
    this was)."""
    if not text:
        return 0
    n = len(text)
    if text.isascii():
        return math.ceil(n / 4)
    wide = (len(text.encode()) - n) // 2  # about one per non-ASCII character
    return math.ceil(max(0, n - wide) / 4) + wide


def _content_tokens(content: Any) -> int:
    if isinstance(content, str):
        return estimate_text(content)
    if isinstance(content, list):
        total = 0
        for part in content:
            if isinstance(part, dict):
                kind = part.get("type")
                if kind in ("image_url", "image", "input_image"):
                    total += IMAGE_TOKENS
                elif isinstance(part.get("text"), str):
                    total += estimate_text(part["text"])
                else:
                    total += estimate_text(json.dumps(part, ensure_ascii=False))
            elif isinstance(part, str):
                total += estimate_text(part)
        return total
    if content is None:
        return 0
    return estimate_text(json.dumps(content, ensure_ascii=False))


def estimate_input(call: Call) -> int:
    """The input tokens ``call`` will cost, estimated locally (no network call)."""
    total = 3
    for message in call.messages:
        total += MESSAGE_OVERHEAD
        total += _content_tokens(message.get("content"))
        for key in ("tool_calls", "function_call"):
            if message.get(key):
                total += estimate_text(json.dumps(message[key], ensure_ascii=False))
    for key in ("tools", "functions", "response_format"):
        if call.params.get(key):
            total += estimate_text(json.dumps(call.params[key], ensure_ascii=False))
    return total


def output_reservation(call: Call, learned: int | None, provider_max: int | None = None
                       ) -> int:
    """The request's own output limit, else the provider's, else the learned percentile
    (never below `OUTPUT_FLOOR`)."""
    for key in ("max_completion_tokens", "max_tokens", "max_output_tokens"):
        value = call.params.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    if provider_max:
        return provider_max
    return max(OUTPUT_FLOOR, learned or 0)
