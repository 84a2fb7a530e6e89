"""``/v1/responses`` on the front (SPEC A7): a chat request like any other — the same
`Exchange` lifecycle, plan, lanes, fallbacks and record — in the Responses dialect,
bound to the engine's response store (`relay.engine.response_store`).

`ResponsesChat` is the `Handler` of ``POST /v1/responses``. Before anything is planned it
expands ``previous_response_id`` from the store (no provider ever keeps the
conversation); it asks the primary target's adapter whether it speaks Responses itself
(``Capabilities.responses``): then the request is passed through whole, otherwise its
translation runs — its refusals are a 400, its advisory drops are named in
``X-Relay-Ignored-Fields`` and the record. The finished response is stored (unless the
request said ``store: false``) before the client gets its last byte.

`serve_stored` answers ``GET``/``DELETE /v1/responses/{id}`` (and ``GET
…/{id}/input_items``) from the store.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

import attrs

from relay.api.fields import refusal_of
from relay.dialects.openai_responses import RESPONSES, ResponsesTurn, new_response_id
from relay.engine.engine import Engine
from relay.engine.plan import Target
from relay.vocab.errors import RelayError

from .asgi import Scope, Send, send_error, send_json
from .chat import Chat
from .exchange import Exchange

__all__ = ["PREFIX", "ResponsesChat", "serve_stored"]

logger = logging.getLogger(__name__)

PREFIX = "/v1/responses/"


def speaks_responses(target: Target) -> bool:
    return target.provider.adapter.capabilities.responses


def _not_held(relay: Engine, response_id: str, param: str | None = None) -> RelayError:
    store = relay.responses
    why = store.forgotten(response_id)
    if why is None:
        why = (f"is not one relay holds (it keeps responses in memory: {store.describe()}; "
               "a response made with store=false is never kept)")
    return RelayError("invalid_request", f"response {response_id!r} not found: it {why}",
                      status=404, param=param)


@attrs.define(eq=False)
class ResponsesChat(Chat):
    """The `Handler` of ``POST /v1/responses`` (the module docstring)."""

    turn: ResponsesTurn | None = None

    def prepare(self, exchange: Exchange, body: bytes) -> None:
        # The turn holds these two functions, and the exchange holds the turn: they close
        # over the relay, the store and the id, and reach the turn by a weak reference,
        # never over the exchange or the turn themselves (no reference cycle: a request's
        # objects are freed by their reference counts as it ends).
        relay, store, request_id = exchange.relay, exchange.relay.responses, exchange.record.id

        def lookup(response_id: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
            entry = store.get(response_id)
            if entry is None:
                raise _not_held(relay, response_id, "previous_response_id")
            return entry.input, entry.response

        def keep(response: dict[str, Any]) -> None:
            held = this_turn()
            if held is not None and held.echo.get("store", True) is not False:
                store.put(new_response_id(request_id), response, held.input_items)

        turn = self.turn = RESPONSES.turn(lookup, keep)
        this_turn = weakref.ref(turn)
        exchange.dialect = turn
        try:
            super().prepare(exchange, body)
        except RelayError as exc:
            # The primary's own refusals and the translation's, in one 400 (SPEC A1a).
            problems = turn.translation.problems
            if exc.reason != "unsupported" or not problems:
                raise
            raise refusal_of([*problems, exc]) from None
        assert self.plan is not None
        translation = turn.translation
        if speaks_responses(self.plan.targets[0]):
            if translation.problems and not all(map(speaks_responses, self.plan.targets)):
                # A fallback that would need the translation cannot take this request.
                kept = [t for t in self.plan.targets if speaks_responses(t)]
                for target in self.plan.targets:
                    if target not in kept:
                        logger.info("request %s: fallback %s left out: %s",
                                    exchange.record.id, target.name,
                                    translation.problems[0].message)
                self.plan = attrs.evolve(self.plan, targets=kept)
            return
        if translation.problems:
            raise refusal_of(translation.problems)
        if translation.ignored:
            exchange.dialect_ignored = tuple(translation.ignored)
            exchange.record.ignored_fields = exchange.all_ignored()


async def serve_stored(relay: Engine, scope: Scope, send: Send) -> None:
    """``GET``/``DELETE /v1/responses/{id}``, ``GET /v1/responses/{id}/input_items``."""
    rest = scope["path"][len(PREFIX):]
    response_id, _, tail = rest.partition("/")
    method = scope["method"]
    if tail not in ("", "input_items") or not response_id or (
            tail and method != "GET") or method not in ("GET", "DELETE"):
        await send_error(send, RelayError(
            "invalid_request", f"{method} {scope['path']}: relay serves GET and DELETE "
            f"{PREFIX}{{id}} and GET {PREFIX}{{id}}/input_items", status=405
            if tail in ("", "input_items") and response_id else 404), RESPONSES)
        return
    entry = relay.responses.get(response_id)
    if entry is None:
        await send_error(send, _not_held(relay, response_id), RESPONSES)
        return
    if method == "DELETE":
        relay.responses.delete(response_id)
        await send_json(send, 200, {"id": response_id, "object": "response",
                                    "deleted": True})
    elif tail:
        items = [{"id": item.get("id") or f"item_{response_id[5:]}_{i}", **item}
                 for i, item in enumerate(entry.input)]
        await send_json(send, 200, {"object": "list", "data": items,
                                    "first_id": items[0]["id"] if items else None,
                                    "last_id": items[-1]["id"] if items else None,
                                    "has_more": False})
    else:
        await send_json(send, 200, entry.response)
