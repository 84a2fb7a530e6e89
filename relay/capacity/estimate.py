"""relay's local token estimate (SPEC L12): cheap, no network call, no tokenizer.

words, digits and punctuation counted as `estimate_text` says (a regular expression, no
vocabulary); 4 tokens a message beyond its text, 3 for the reply's priming; tool
definitions and calls by their JSON; an image part a flat `IMAGE_TOKENS`. docs/tokens.md
says how it was made and how far off it was on the tests' corpora. The output reservation
is the request's own limit, else the provider's, else a learned percentile of the model's
answers (`Learned`), never below `OUTPUT_FLOOR`.
"""

from __future__ import annotations

import collections
import json
import math
import re
from typing import Any

from relay.vocab.events import Call

__all__ = ["IMAGE_TOKENS", "MESSAGE_OVERHEAD", "OUTPUT_FLOOR", "Learned", "estimate_input",
           "estimate_text", "output_reservation"]

OUTPUT_FLOOR = 256          # tokens reserved for an answer of unknown length
MESSAGE_OVERHEAD = 4        # tokens a chat message costs beyond its text (role, framing)
IMAGE_TOKENS = 1000         # an image part, roughly (providers count 85-1,600)
LEARNED_SAMPLES = 100       # answers per model kept for the percentile


_PIECES = re.compile(r"[^\W\d_]+|\d{1,3}|[^\w\s]|_")


def estimate_text(text: str) -> int:
    """Tokens in ``text``, locally: a word is a token and one more for every 6 letters
    after its first, a CJK character a token (other scripts' words one more every 4),
    digits a token per 3, each punctuation mark a token; spaces are free. Within about
    -5 % to +20 % of OpenAI's encodings on English, code, JSON and German, over on
    Chinese (docs/tokens.md)."""
    if not text:
        return 0
    total = 0
    for piece in _PIECES.findall(text):
        first = piece[0]
        if first.isascii():
            total += 1 + (len(piece) - 1) // 6 if first.isalpha() else 1
        elif not first.isalpha():
            total += 1
        elif ord(first) >= 0x2E80:  # CJK and after: about a token a character
            total += len(piece)
        else:
            total += 1 + (len(piece) - 1) // 4
    return total


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


class Learned:
    """The lengths of a provider's recent reported answers, by model: the output
    reservation of a request that sets no limit of its own (SPEC L12). Kept by each
    relay, shared provider or not (a relay's own answers are sample enough)."""

    def __init__(self) -> None:
        self._seen: dict[str, collections.deque[int]] = {}

    def learn(self, model: str, output_tokens: int) -> None:
        """A reported answer's length, for the output reservation of the next ones."""
        seen = self._seen.setdefault(model, collections.deque(maxlen=LEARNED_SAMPLES))
        seen.append(output_tokens)

    def output(self, model: str) -> int | None:
        """The 90th percentile of the model's last answers (None: fewer than 3)."""
        seen = self._seen.get(model)
        if not seen or len(seen) < 3:
            return None
        ordered = sorted(seen)
        return ordered[min(len(ordered) - 1, math.ceil(0.9 * len(ordered)) - 1)]
