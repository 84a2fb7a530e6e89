"""OpenAI's embeddings shapes (``POST /v1/embeddings``, SPEC A8): the request checked and
read, the answer rendered, with floats or base64 as the client asks.

The request: ``model``; ``input`` as a text, a list of texts, a list of token ids or a
list of lists of token ids (one vector per text or token list); ``encoding_format``
``float`` (the default) or ``base64``. Every other field passes to the provider as it
came (``dimensions``, ``user``, a server's own ``input_type`` or ``truncate``); an
adapter that cannot send one refuses it by name. ``fallbacks`` is refused: another
model's vectors cannot be compared with the first one's.

The answer: ``{"object": "list", "data": [{"object": "embedding", "index", "embedding"}],
"model", "usage": {"prompt_tokens", "total_tokens"}}``. ``base64`` is the vector as
little-endian float32 (what OpenAI sends, and what the official clients decode — they ask
for it by default); relay asks every provider for floats, so a float it cannot hold as a
float32 (beyond ±3.4e38) is the provider's broken answer, never an ``inf``.
"""

from __future__ import annotations

import array
import base64
import math
import sys
from typing import Any

import attrs

from relay.vocab.errors import RelayError

from .openai_chat import INT_MAX, bad_request, load_request
from .schemas import EMBEDDINGS_SCHEMA, ENCODINGS
from .typed import check

__all__ = ["EMBEDDINGS_SCHEMA", "ENCODINGS", "EmbeddingsInput", "parse_embeddings_body",
           "render_embeddings"]



@attrs.frozen(kw_only=True)
class EmbeddingsInput:
    model: str
    inputs: list[str] | list[list[int]]
    encoding_format: str
    params: dict[str, Any]


def _token(value: Any) -> bool:
    return type(value) is int and 0 <= value <= INT_MAX


def _inputs(raw: Any) -> list[str] | list[list[int]]:
    if isinstance(raw, str):
        return [raw]
    if isinstance(raw, list) and raw:
        if all(isinstance(item, str) for item in raw):
            return list(raw)
        if all(_token(item) for item in raw):
            return [list(raw)]
        if all(isinstance(item, list) and item and all(_token(t) for t in item)
               for item in raw):
            return [list(item) for item in raw]
    raise bad_request("'input' must be a text, a non-empty list of texts, a list of token "
                      "ids, or a list of non-empty lists of token ids", "input")


def parse_embeddings_body(body: bytes) -> EmbeddingsInput:
    """An embeddings request → what relay reads of it.

    Raises:
        RelayError: ``invalid_request`` naming the field; ``unsupported`` for
            ``fallbacks``.
    """
    data = load_request(body)
    check(data, EMBEDDINGS_SCHEMA)
    encoding = data.get("encoding_format")
    if encoding is None:
        encoding = "float"
    if encoding not in ENCODINGS:
        raise bad_request(f"'encoding_format' must be one of {', '.join(ENCODINGS)}, not "
                          f"{encoding!r}", "encoding_format")
    if data.get("fallbacks") is not None:
        raise RelayError("unsupported", "'fallbacks' cannot be used for embeddings: another "
                         "model's vectors cannot be compared with the first model's",
                         param="fallbacks")
    params = {k: v for k, v in data.items()
              if k not in ("model", "input", "encoding_format", "fallbacks")}
    return EmbeddingsInput(model=data["model"], inputs=_inputs(data.get("input")),
                           encoding_format=encoding, params=params)


def _base64(packed: array.array[float]) -> str:
    if sys.byteorder != "little":  # pragma: no cover - every platform relay runs on is LE
        packed.byteswap()
    return base64.b64encode(packed.tobytes()).decode("ascii")


def render_embeddings(vectors: list[list[float]], *, model: str, encoding_format: str,
                      prompt_tokens: int | None, provider: str) -> dict[str, Any]:
    """The answer body. ``prompt_tokens`` None (the provider counts none) is reported
    as 0, the shape's only way to say it.

    Raises:
        RelayError: ``bad_upstream_response`` for a number that is not finite, or not
            finite as a float32.
    """
    data: list[dict[str, Any]] = []
    for index, vector in enumerate(vectors):
        if not all(map(math.isfinite, vector)):
            raise _broken(provider, index, "a number that is not finite")
        embedding: Any = vector
        if encoding_format == "base64":
            packed = array.array("f", vector)  # beyond a float32's range: inf, silently
            if not all(map(math.isfinite, packed)):
                raise _broken(provider, index, "a number too large for a float32")
            embedding = _base64(packed)
        data.append({"object": "embedding", "index": index, "embedding": embedding})
    tokens = prompt_tokens or 0
    return {"object": "list", "data": data, "model": model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def _broken(provider: str, index: int, what: str) -> RelayError:
    return RelayError("bad_upstream_response", f"provider {provider!r} sent an embedding "
                      f"with {what} (vector {index})", provider=provider)
