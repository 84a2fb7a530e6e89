"""Google's Gemini API on relay's front (SPEC A9): ``/v1beta/models`` and everything under
``/v1beta/models/{model}``, where ``{model}`` may hold ``/`` (``fake/echo``) and ``:``
(``ollama/qwen3:8b``) — the method is what follows the *last* ``:``.

========================================================  ================================
``GET /v1beta/models``                                    every route and provider/model
``GET /v1beta/models/{model}``                            one, or 404 ``NOT_FOUND``
``POST …/{model}:generateContent``                        a chat request, answered whole
``POST …/{model}:streamGenerateContent?alt=sse``          the same, streamed (SSE)
``POST …/{model}:countTokens``                            its counter, else relay's estimate
``POST …/{model}:embedContent``, ``:batchEmbedContents``  embeddings, through the lane
========================================================  ================================

The same paths under Google's v1, ``/v1/models/{model}:{method}`` (the default API
version of its SDKs), are served here too, and so are ``GET /v1/models`` and
``/v1/models/{model}`` when a Google client asks (`relay.front.paths.google_client`: its
key in ``x-goog-api-key`` or ``?key=``, or ``x-goog-api-client``); to anyone else they are
OpenAI's (`relay.front.info`).

``:streamGenerateContent`` without ``?alt=sse`` — where Google streams one JSON array —
is refused with a 400 that says to add it (every Google SDK and the Gemini CLI send it).
Chat requests and counts are relay routes like the others: one `Exchange` each (record,
drain, disconnects), the Gemini dialect's parsing and shapes, and every error in
Google's shape (`relay.dialects.gemini_render.google_error`).
"""

from __future__ import annotations

import logging
import urllib.parse
from collections.abc import Callable
from typing import Any

import attrs

from relay.api.adapter import Embeddings
from relay.capacity.estimate import estimate_input
from relay.config import ClientConfig
from relay.dialects.base import ChatInput, dumps
from relay.dialects.gemini_generate import (
    GEMINI,
    GEMINI_SDK,
    parse_gemini_body,
    parse_gemini_embed,
    render_gemini_embeddings,
)
from relay.dialects.openai_chat import load_json
from relay.dialects.openai_embeddings import EmbeddingsInput
from relay.engine.engine import Engine
from relay.engine.plan import Target
from relay.vocab.errors import RelayError
from relay.vocab.events import Call

from .asgi import Receive, Scope, Send, header, send_error, send_json
from .chat import Chat, priority_of
from .endpoints import CountTokens, Embed, _plan
from .exchange import Exchange
from .info import client_of, find_model, listed, refresh_models
from .paths import GEMINI_METHODS

__all__ = ["GeminiChat", "GeminiCount", "GeminiEmbed", "serve_gemini"]

logger = logging.getLogger(__name__)

_PREFIX = "/v1beta/models"
_METHODS = GEMINI_METHODS


def _model_entry(ident: str, owner: str) -> dict[str, Any]:
    return {"name": f"models/{ident}", "baseModelId": ident, "version": owner,
            "displayName": ident, "description": f"{ident} through relay ({owner})",
            "supportedGenerationMethods": list(_METHODS)}


def _model_name(name: str) -> str:
    """The model as relay resolves it: ``models/`` (Google's resource prefix) removed."""
    return name.removeprefix("models/")


async def _get(relay: Engine, client: ClientConfig,
               name: str) -> dict[str, Any] | RelayError:
    if not name:  # the models this client may use (SPEC L14)
        await refresh_models(relay)
        return {"models": [_model_entry(ident, owner)
                           for ident, owner in listed(relay, client)]}
    found = await find_model(relay, client, _model_name(name))
    if isinstance(found, RelayError):
        return found
    return _model_entry(found["id"], found["owned_by"])


async def serve_gemini(relay: Engine, scope: Scope, receive: Receive, send: Send,
                       body: bytes, refused: Callable[[Scope, RelayError], None]) -> None:
    """Answer one request under ``/v1beta/models`` (see the module docstring);
    ``refused`` records a request refused before its exchange (the guard's)."""
    path, method = scope["path"], scope["method"]
    name = path.removeprefix(_PREFIX).removeprefix("/v1/models").removeprefix("/")
    if method == "GET":
        try:
            answer = await _get(relay, client_of(relay, scope), name)
        except Exception as exc:  # a bug: still a Google-shaped error, never a bare 500
            logger.error("%s crashed", path, exc_info=exc)
            answer = RelayError("internal_error", f"relay failed unexpectedly "
                                f"({type(exc).__name__}); see its log")
        if isinstance(answer, RelayError):
            await send_error(send, answer, GEMINI)
        else:
            await send_json(send, 200, answer)
        return
    model, colon, verb = name.rpartition(":")
    error: RelayError | None = None
    if method != "POST":
        error = RelayError("invalid_request", f"use GET or POST for {path}", status=405)
    elif not colon or verb not in _METHODS or not model:
        error = RelayError("invalid_request", f"relay does not serve POST {path}: a model's "
                           f"methods are {', '.join(_METHODS)} "
                           f"(POST {_PREFIX}/{{model}}:{{method}})", status=404)
    elif verb == "streamGenerateContent" and "sse" not in urllib.parse.parse_qs(
            (scope.get("query_string") or b"").decode("latin-1")).get("alt", ()):
        error = RelayError("invalid_request", "relay streams Server-Sent Events only: add "
                           "?alt=sse to :streamGenerateContent (a JSON array stream is not "
                           "served)", param="alt")
    if error is not None:
        refused(scope, error)
        await send_error(send, error, GEMINI)
        return
    handler: Any
    if verb == "countTokens":
        handler = GeminiCount(model=_model_name(model))
    elif verb in ("embedContent", "batchEmbedContents"):
        handler = GeminiEmbed(model=_model_name(model), batch=verb == "batchEmbedContents")
    else:
        handler = GeminiChat(model=_model_name(model), stream=verb == "streamGenerateContent")
    # Google's SDKs name themselves in x-goog-api-client; their stream parsers cannot
    # skip an SSE comment (relay.dialects.gemini_render.GeminiRender).
    sdk = "google-genai-sdk/" in (header(scope, b"x-goog-api-client") or "")
    await Exchange(relay, scope, receive, send, GEMINI_SDK if sdk else GEMINI).serve(
        body, handler)


@attrs.define(eq=False)
class GeminiChat(Chat):
    """A chat request in the Gemini dialect: the model and the streaming from the path."""

    model: str = ""
    stream: bool = False

    def parse(self, exchange: Exchange, body: bytes) -> ChatInput:
        return parse_gemini_body(body, self.model, stream=self.stream)


@attrs.define(eq=False)
class GeminiCount(CountTokens):
    """``:countTokens``: the provider's own counter, else relay's estimate (as
    ``/v1/messages/count_tokens``, SPEC A6, A9), for ``{"contents": …}`` or
    ``{"generateContentRequest": {…}}``; ``{"totalTokens": N}``."""

    model: str = ""

    def prepare(self, exchange: Exchange, body: bytes) -> None:
        self.priority = priority_of(exchange)
        data = load_json(body)
        inner = (data.get("generateContentRequest", data.get("generate_content_request"))
                 if isinstance(data, dict) else None)
        if inner is not None:
            if not isinstance(inner, dict):
                raise RelayError("invalid_request", "'generateContentRequest' must be an "
                                 "object", param="generateContentRequest")
            body = dumps(inner)
        chat = parse_gemini_body(body, self.model, stream=False)
        self.plan, target = _plan(exchange, chat.model, costs=False)  # a count is free
        exchange.record.requested_model = chat.model
        provider = target.provider
        adapter = provider.adapter
        call = Call(request_id=exchange.record.id, provider=provider.name,
                    model=target.model, messages=chat.messages, stream=False,
                    params=chat.params, inbound=chat.inbound)
        if not adapter.capabilities.count_tokens:
            self.call, self.estimate = call, estimate_input(call)  # relay's own (L12)
            return
        # Sorted as a generation would be (a plain 400 before anything is sent): the
        # gemini adapter gets the request itself, another only what it honours.
        self.call = adapter.admit(call).call

    def answer(self, tokens: int) -> dict[str, Any]:
        return {"totalTokens": tokens}


@attrs.define(eq=False)
class GeminiEmbed(Embed):
    """``:embedContent`` and ``:batchEmbedContents``: embeddings through the provider's
    lane (as ``POST /v1/embeddings``, SPEC A8), in Google's shapes."""

    model: str = ""
    batch: bool = False

    def parse(self, body: bytes) -> EmbeddingsInput:
        return parse_gemini_embed(body, self.model, batch=self.batch)

    def render(self, result: Embeddings, target: Target) -> Any:
        return render_gemini_embeddings(result.vectors, batch=self.batch,
                                        provider=target.provider.name)
