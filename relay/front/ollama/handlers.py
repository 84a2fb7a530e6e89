"""The relay routes of Ollama's API (SPEC A10): ``/api/chat`` and ``/api/generate`` are
chat requests like every dialect's (`relay.front.chat.Chat`: one plan, one dispatcher,
one writer; the stream is the dialect's newline-delimited JSON), ``/api/embed`` and
``/api/embeddings`` embeddings requests like ``/v1/embeddings``
(`relay.front.endpoints.Embed`: through the provider's lane, answered whole).

A chat with nothing to answer (no messages; a generate without a prompt) is how Ollama's
clients load a model: it is answered at once with ``done_reason: "load"`` once the
model resolves, and no provider is asked.
"""

from __future__ import annotations

from typing import Any

import attrs
import trio

from relay.api.adapter import EmbedCall, Embeddings
from relay.dialects.base import ChatInput
from relay.dialects.ollama import OllamaDialect, parse_ollama_embed
from relay.dialects.openai_embeddings import render_embeddings
from relay.engine.engine import Engine
from relay.engine.plan import make_plan
from relay.engine.stops import RequestStop
from relay.engine.unary import run_whole
from relay.vocab.errors import RelayError, untraced

from ..chat import Chat, priority_of
from ..endpoints import Embed, _kinds_that, _plan
from ..exchange import Exchange

__all__ = ["OllamaChat", "OllamaEmbed", "resolve_name"]

_LATEST = ":latest"


def resolve_name(relay: Engine, name: str) -> str:
    """``NAME:latest`` is ``NAME`` (Ollama's clients append it to a name without a tag),
    unless something is known by the longer name (an upstream Ollama's model)."""
    if not name.endswith(_LATEST):
        return name
    bare = name.removesuffix(_LATEST)
    known = set(relay.known_names())
    known.update(m for p in relay.providers.values() for m in p.models)
    if name in known or bare in known:
        return name if name in known else bare
    try:
        make_plan(relay, name, None)
    except RelayError:
        return bare
    return name


@attrs.define(eq=False)
class OllamaChat(Chat):
    """``/api/chat`` and ``/api/generate`` (the exchange's dialect says which)."""

    parsed: ChatInput | None = None
    loading: str | None = None  # the model of a request with nothing to answer

    def parse(self, exchange: Exchange, body: bytes) -> ChatInput:
        assert self.parsed is not None
        return self.parsed

    def prepare(self, exchange: Exchange, body: bytes) -> None:
        chat = exchange.dialect.parse(body)
        chat.model = resolve_name(exchange.relay, chat.model)
        self.parsed = chat
        if any(m["role"] != "system" for m in chat.messages):
            super().prepare(exchange, body)
            exchange.progress_events = False  # (SSE events have no place in NDJSON)
            return
        self.priority = priority_of(exchange)
        exchange.record.requested_model = chat.model
        _plan(exchange, chat.model)
        self.loading = chat.model

    async def run(self, exchange: Exchange, nursery: trio.Nursery, stop: RequestStop
                  ) -> None:
        if self.loading is None:
            await super().run(exchange, nursery, stop)
            return
        dialect = exchange.dialect
        assert isinstance(dialect, OllamaDialect)
        await exchange.send_json(200, dialect.loaded(self.loading))


@attrs.define(eq=False)
class OllamaEmbed(Embed):
    """``/api/embed`` (``{"embeddings": [[…]]}``) or, ``old``, ``/api/embeddings``
    (``{"embedding": […]}``)."""

    old: bool = False
    ignored: list[str] = attrs.field(factory=list)

    def prepare(self, exchange: Exchange, body: bytes) -> None:
        self.priority = priority_of(exchange)
        request = parse_ollama_embed(body, old=self.old)
        self.ignored = request.ignored
        self.plan, target = _plan(exchange, resolve_name(exchange.relay, request.model))
        provider = target.provider
        adapter = provider.adapter
        if not adapter.capabilities.embeddings:
            raise RelayError(
                "unsupported", f"provider {provider.name!r} ({provider.config.adapter}) makes "
                f"no embeddings; the adapter kinds that do: "
                f"{_kinds_that(exchange.relay, 'embeddings')}", provider=provider.name,
                param="model")
        self.call = EmbedCall(request_id=exchange.record.id, provider=provider.name,
                              model=target.model, inputs=request.inputs,
                              params=request.params)
        adapter.check_embed(self.call)  # a plain 400, before anything is queued

    async def run(self, exchange: Exchange, nursery: trio.Nursery, stop: RequestStop
                  ) -> None:
        assert self.plan is not None and self.call is not None
        call = self.call
        target = self.plan.targets[0]
        started = trio.current_time()
        failed: RelayError | None = None
        try:
            result: Embeddings = await run_whole(
                self.plan, exchange.record, stop, self.priority,
                lambda adapter: adapter.embed(call),
                gate=exchange.relay.clients.gate(exchange.client))
            # (checked as /v1/embeddings checks them: every number finite)
            checked = render_embeddings(result.vectors, model=target.name,
                                        encoding_format="float",
                                        prompt_tokens=result.prompt_tokens,
                                        provider=target.provider.name)
        except RelayError as exc:
            failed = untraced(exc)  # kept as data: a traceback would hold this frame
        if failed is not None:
            exchange.fail(failed)
            await exchange.send_error(failed)
            return
        tokens = result.prompt_tokens
        exchange.record.usage = {"prompt_tokens": tokens, "completion_tokens": None,
                                 "total_tokens": tokens}
        vectors = [entry["embedding"] for entry in checked["data"]]
        body: dict[str, Any] = ({"embedding": vectors[0]} if self.old else {
            "model": target.name, "embeddings": vectors,
            "total_duration": int((trio.current_time() - started) * 1e9),
            "load_duration": 0, "prompt_eval_count": tokens or 0})
        ignored = [*self.ignored, *result.ignored]
        headers = ([(b"x-relay-ignored-fields", ", ".join(ignored).encode())]
                   if ignored else [])
        await exchange.send_json(200, body, headers)
