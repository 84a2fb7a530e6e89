"""What the HTTP adapters' non-chat calls share (embeddings, token counts): a POST whose
answer is one JSON object, read through relay's bounded reader (SPEC O5), and the checks
an answer's numbers must pass before relay hands them on."""

from __future__ import annotations

import json
from typing import Any

from relay.vocab.errors import RelayError, excerpt

from .base import HTTPAdapter

__all__ = ["count_of", "post_json", "vector_of"]


async def post_json(adapter: HTTPAdapter, url: str, body: Any, what: str) -> dict[str, Any]:
    """POST ``body`` and return the answer's JSON object. A stop closes the upstream
    connection (the POST runs inside ``async with client.stream``).

    Raises:
        RelayError: the mapped upstream failure; ``bad_upstream_response`` for an answer
            that is not a JSON object (``what`` names it in the message).
    """
    answer: dict[str, Any] = {}

    async def read(text: str) -> None:
        try:
            value = json.loads(text)
        except ValueError:
            value = None
        if not isinstance(value, dict):
            raise unreadable(adapter.name, what, text)
        answer.update(value)

    async def no_stream(_: Any) -> None:  # pragma: no cover - stream=False never streams
        raise AssertionError("not streamed")

    # (An answer read whole — embeddings, a token count — goes through no token budget.)
    await adapter.post(url, body, stream=False, read_stream=no_stream, read_whole=read,
                       events=None)
    return answer


def unreadable(provider: str, what: str, text: str) -> RelayError:
    return RelayError("bad_upstream_response", f"provider {provider!r} sent {what} relay "
                      f"cannot read: {excerpt(text, 300)!r}", provider=provider,
                      upstream_message=text)


def vector_of(value: Any) -> list[float] | None:
    """``value`` as a vector: a non-empty list of numbers (not booleans), else None."""
    if not isinstance(value, list) or not value:
        return None
    kinds = set(map(type, value))
    if not kinds <= {int, float}:
        return None
    return value


def count_of(value: Any) -> int | None:
    """``value`` as a token count: a whole number ≥ 0, else None."""
    return value if type(value) is int and value >= 0 else None
