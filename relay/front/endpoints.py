"""The relay routes that answer whole: ``POST /v1/embeddings`` (SPEC A8) and
``POST /v1/messages/count_tokens`` (SPEC A6).

Each is a `Handler` of the `Exchange` lifecycle chat uses — one record, the stop handle a
drain reaches, the request's nursery and its disconnect watcher — with the engine's
`run_whole` (lane slot, deadlines, retries, the record's times) in place of a dispatcher
and a writer. Nothing is sent before the answer is whole (SPEC A2); then one JSON body in
the route's dialect, or its error (OpenAI's shape for embeddings, Anthropic's for token
counts).

The front asks the adapter's `Capabilities` before it calls anything: a provider that
makes no embeddings is a 400 ``unsupported`` that names it and the adapter kinds that
can. A token count is answered on every provider (SPEC A6, A9): by the provider's own
counter where it has one, else by relay's local estimate (`relay.capacity.estimate`, the
one the token budgets use; no call, no lane) with ``x-relay-estimated: true``.
"""

from __future__ import annotations

from typing import Any

import attrs
import trio

from relay.api.adapter import EmbedCall, Embeddings
from relay.capacity.estimate import estimate_input
from relay.dialects.anthropic_messages import parse_messages_body
from relay.dialects.base import dumps
from relay.dialects.openai_chat import load_request
from relay.dialects.openai_embeddings import (
    EmbeddingsInput,
    parse_embeddings_body,
    render_embeddings,
)
from relay.engine.engine import Engine
from relay.engine.plan import Plan, Target
from relay.engine.stops import RequestStop
from relay.engine.unary import run_whole
from relay.vocab.errors import RelayError, untraced
from relay.vocab.events import Call

from .chat import plan_for, priority_of, refuse_when_draining
from .exchange import Exchange

__all__ = ["CountTokens", "Embed"]


def _plan(exchange: Exchange, model: str, *, costs: bool = True) -> tuple[Plan, Target]:
    refuse_when_draining(exchange)
    plan = plan_for(exchange, model, None, costs=costs)
    target = plan.targets[0]
    record = exchange.record
    record.route = plan.route.name if plan.route else None
    record.provider, record.model = target.provider.name, target.model
    return plan, target


def _kinds_that(relay: Engine, capability: str) -> str:
    kinds = [kind for kind in relay.registry
             if getattr(relay.registry[kind].capabilities, capability)]
    return ", ".join(kinds) or "none"


def _settle(exchange: Exchange, stop: RequestStop) -> bool:
    record = exchange.record
    if stop.requested_at is not None and record.stop_requested_at is None:
        record.stop_requested_at = stop.requested_at
    releases = [a.released_at for a in record.attempts if a.released_at is not None]
    record.released_at = max(releases) if releases else None
    return True  # the call ran inside the request's task: whatever ran has ended


@attrs.define(eq=False)
class Embed:
    """``POST /v1/embeddings``: through the provider's lane, like a chat request."""

    plan: Plan | None = None
    call: EmbedCall | None = None
    encoding_format: str = "float"
    priority: str = "normal"

    def prepare(self, exchange: Exchange, body: bytes) -> None:
        self.priority = priority_of(exchange)
        request = self.parse(body)
        self.plan, target = _plan(exchange, request.model)
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
        self.encoding_format = request.encoding_format
        adapter.check_embed(self.call)  # a plain 400, before anything is queued

    def parse(self, body: bytes) -> EmbeddingsInput:
        """The request in the route's dialect (OpenAI's here)."""
        return parse_embeddings_body(body)

    async def run(self, exchange: Exchange, nursery: trio.Nursery, stop: RequestStop
                  ) -> None:
        assert self.plan is not None and self.call is not None
        call = self.call
        target = self.plan.targets[0]
        failed: RelayError | None = None
        try:
            result: Embeddings = await run_whole(
                self.plan, exchange.record, stop, self.priority,
                lambda adapter: adapter.embed(call),
                gate=exchange.relay.clients.gate(exchange.client))
            body = self.render(result, target)
        except RelayError as exc:
            failed = untraced(exc)  # kept as data: a traceback would hold this frame
        if failed is not None:
            exchange.fail(failed)
            await exchange.send_error(failed)
            return
        tokens = result.prompt_tokens
        exchange.record.usage = {"prompt_tokens": tokens, "completion_tokens": None,
                                 "total_tokens": tokens}
        headers = ([(b"x-relay-ignored-fields", ", ".join(result.ignored).encode())]
                   if result.ignored else [])
        await exchange.send_json(200, body, headers)

    def render(self, result: Embeddings, target: Target) -> Any:
        """The answer in the route's dialect (OpenAI's here)."""
        return render_embeddings(result.vectors, model=target.name,
                                 encoding_format=self.encoding_format,
                                 prompt_tokens=result.prompt_tokens,
                                 provider=target.provider.name)

    def settle(self, exchange: Exchange, stop: RequestStop) -> bool:
        return _settle(exchange, stop)


ESTIMATED = [(b"x-relay-estimated", b"true")]


@attrs.define(eq=False)
class CountTokens:
    """``POST /v1/messages/count_tokens``: the provider's own counter, outside the lane
    (a metadata call: see `relay.engine.unary`), or relay's estimate where it has none
    (``estimate``: the count, marked ``x-relay-estimated: true``)."""

    plan: Plan | None = None
    call: Call | None = None
    priority: str = "normal"
    estimate: int | None = None

    def prepare(self, exchange: Exchange, body: bytes) -> None:
        self.priority = priority_of(exchange)
        data: dict[str, Any] = load_request(body)
        # A count takes no max_tokens; the Messages parser (shared with /v1/messages, so
        # the body is checked the same way) wants one: lend it one, then take it back.
        lent = "max_tokens" not in data
        if lent:
            data["max_tokens"] = 1
        chat = parse_messages_body(dumps(data))
        self.plan, target = _plan(exchange, chat.model, costs=False)  # a count is free
        provider = target.provider
        adapter = provider.adapter
        params = {k: v for k, v in chat.params.items() if k != "stream"}
        if lent:
            params.pop("max_tokens", None)
        self.call = Call(request_id=exchange.record.id, provider=provider.name,
                         model=target.model, messages=chat.messages, stream=False,
                         params=params)
        if not adapter.capabilities.count_tokens:
            self.estimate = estimate_input(self.call)  # the request as the client wrote it
            return
        adapter.check_call(self.call)  # a plain 400, before anything is sent

    async def run(self, exchange: Exchange, nursery: trio.Nursery, stop: RequestStop
                  ) -> None:
        assert self.plan is not None and self.call is not None
        if self.estimate is not None:   # no counter of its own: relay's estimate (L12)
            await exchange.send_json(200, self.answer(self.estimate), ESTIMATED)
            return
        call = self.call
        failed: RelayError | None = None
        try:
            tokens = await run_whole(self.plan, exchange.record, stop, self.priority,
                                     lambda adapter: adapter.count_tokens(call), lane=False)
        except RelayError as exc:
            failed = untraced(exc)  # kept as data: a traceback would hold this frame
        if failed is not None:
            exchange.fail(failed)
            await exchange.send_error(failed)
            return
        await exchange.send_json(200, self.answer(tokens))

    def answer(self, tokens: int) -> dict[str, Any]:
        """The count in the route's dialect (Anthropic's here)."""
        return {"input_tokens": tokens}

    def settle(self, exchange: Exchange, stop: RequestStop) -> bool:
        return _settle(exchange, stop)
