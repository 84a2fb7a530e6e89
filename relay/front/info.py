"""The routes that programs poll, in raw ASGI: ``/healthz``, ``/v1/models``,
``/v1/models/{model}`` and ``/relay/v1/status``.

A client lists the models as it starts, a service monitor asks for health, the status
page polls the status: these answer without Quart, so a relay whose status page (and
other routes of `relay.front.routes`) nobody opens never imports it (~10 MB and 0.2 s).
Each is a GET (HEAD answers the same head without the body), never recorded: only the
relay routes are (DESIGN invariant 5).

A model list shows the models the asking client may use (SPEC L14: its ``[clients.NAME]
models``, names and ``*`` patterns, matched against each name the list would show — a
route by its name, a pattern route by its pattern, a provider's model as
``PROVIDER/MODEL``); a model it may not use is ``forbidden_model`` when looked up, as when
named in a request. Every dialect's list (Gemini's, Ollama's) filters through `listed`.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from relay.config import ClientConfig
from relay.config.clients import DEFAULT_CLIENT
from relay.engine.engine import Engine
from relay.engine.plan import pattern_for
from relay.shared import figures
from relay.vocab.errors import RelayError

from .asgi import Message, Scope, Send, send_error, send_json
from .paths import Served

__all__ = ["client_of", "find_model", "forbidden_model", "listed", "refresh_models",
           "route_names", "serve_info"]

logger = logging.getLogger(__name__)


def _entry(ident: str, owner: str) -> dict[str, Any]:
    return {"id": ident, "object": "model", "created": 0, "owned_by": owner}


async def serve_info(relay: Engine, scope: Scope, send: Send, served: Served) -> None:
    method = scope["method"]
    if method not in ("GET", "HEAD"):
        await send_error(send, RelayError("invalid_request", f"use GET for "
                                          f"{served.shown}", status=405))
        return
    if method == "HEAD":
        send = _without_body(send)
    found = served.pattern.match(scope["path"])
    assert found is not None  # the front matched it
    try:
        answer = await _ANSWERS[served.rule](relay, client_of(relay, scope),
                                             **found.groupdict())
    except Exception as exc:  # a bug: still an E1 body, never a bare 500
        logger.error("%s crashed", scope["path"], exc_info=exc)
        answer = RelayError("internal_error", f"relay failed unexpectedly "
                            f"({type(exc).__name__}); see its log")
    if isinstance(answer, RelayError):
        await send_error(send, answer)
    else:
        await send_json(send, 200, answer)


def _without_body(send: Send) -> Send:
    async def send_head(message: Message) -> None:
        await send({**message, "body": b""} if message["type"] == "http.response.body"
                   else message)
    return send_head


def client_of(relay: Engine, scope: Scope) -> ClientConfig:
    """The client asking (SPEC L14), as the guard named it from its token."""
    return relay.clients.client(scope.get("relay.client", DEFAULT_CLIENT))


def listed(relay: Engine, client: ClientConfig) -> list[tuple[str, str]]:
    """The model list ``client`` sees, as ``(name, owner)``: the exact routes (owner
    ``relay``), then every provider's ``PROVIDER/MODEL`` — those it may use."""
    names = [(name, "relay") for name in route_names(relay)]
    names += [(ident, ident.partition("/")[0]) for ident in relay.model_ids()]
    return [(name, owner) for name, owner in names if client.may_use(name)]


def forbidden_model(client: ClientConfig, refused: list[str]) -> RelayError:
    """403 ``forbidden_model``: ``client`` may not use the models ``refused``."""
    return RelayError("forbidden_model", f"client {client.name!r} may not use "
                      f"{', '.join(map(repr, refused))}; the models it may use: "
                      f"{', '.join(client.models)}", param="model",
                      action=f"name one of those models, or add it to models in "
                             f"[clients.{client.name}]")


async def _healthz(relay: Engine, client: ClientConfig) -> dict[str, Any]:
    return {"status": "draining" if relay.draining else "ok"}


async def _refresh_models(relay: Engine) -> None:
    async with trio.open_nursery() as nursery:
        for provider in relay.providers.values():
            nursery.start_soon(provider.refresh_models)


async def _models(relay: Engine, client: ClientConfig) -> dict[str, Any]:
    await _refresh_models(relay)
    return {"object": "list",
            "data": [_entry(name, owner) for name, owner in listed(relay, client)]}


def route_names(relay: Engine) -> list[str]:
    """The routes a model list shows: the exact ones. A pattern (SPEC F9: ``claude-*``)
    is no model a client can pick; a name it matches is answered by `_model`."""
    return [name for name, route in relay.config.routes.items() if not route.is_pattern]


async def _model(relay: Engine, client: ClientConfig,
                 model: str) -> dict[str, Any] | RelayError:
    """One entry of ``/v1/models`` (SPEC A1, A8): a route name, ``PROVIDER/MODEL`` (the
    model may hold ``/``), or a bare model exactly one provider lists; one the client
    may not use is ``forbidden_model`` (SPEC L14)."""
    if not client.may_use(model):
        return forbidden_model(client, [model])
    await _refresh_models(relay)
    if model in route_names(relay):
        return _entry(model, "relay")
    if model in relay.model_ids():
        return _entry(model, model.partition("/")[0])
    owners = [p.name for p in relay.providers.values() if model in p.models]
    if len(owners) == 1:
        return _entry(model, owners[0])
    if pattern_for(relay, model) is not None:
        return _entry(model, "relay")   # a request for it would take that route (F9)
    if owners:
        names = ", ".join(f"{owner}/{model}" for owner in owners)
        words = f"is offered by several providers; name one of: {names}"
    else:
        words = (f"is not known. Known models: "
                 f"{', '.join(relay.known_names()) or '(none discovered yet)'}")
    return RelayError("unknown_model", f"model {model!r} {words}", param="model")


async def _status(relay: Engine, client: ClientConfig) -> dict[str, Any]:
    # SPEC L11: a shared lane's figures as of now, not as of this relay's last reply.
    await figures.refresh(p.lane for p in relay.providers.values())
    # Built without a checkpoint from one provider set: a reload swaps it whole (SPEC L10).
    # ``requests``: what runs and waits now, every provider's (`relay ps`).
    providers = relay.providers
    return {"providers": {name: p.status(relay.clock) for name, p in providers.items()},
            "requests": [line for p in providers.values() for line in p.ps(relay.clock)],
            "draining": relay.draining, "records": relay.records.status(),
            "usage": None if relay.usage is None else relay.usage.status()}


# The model list and lookup, for the other dialects' model routes (Gemini's, SPEC A9).
refresh_models = _refresh_models
find_model = _model

_ANSWERS: dict[str, Callable[..., Awaitable[dict[str, Any] | RelayError]]] = {
    "/healthz": _healthz, "/v1/models": _models, "/v1/models/<path:model>": _model,
    "/relay/v1/status": _status}
