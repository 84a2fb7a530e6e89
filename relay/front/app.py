"""The HTTP front of one relay: the guard, then the relay routes in raw ASGI (chat in
each dialect, embeddings, token counts, fan-out), then Quart for the rest (models,
status, health, metrics). Which is which is the table of `relay.front.paths`; a path it
does not hold gets the 404 that lists the paths relay serves.

Quart (with the Flask and hypercorn-asyncio modules it brings) is a third of relay's
import time, ~0.2 s: `relay serve` imports it in a worker thread as it starts listening
(`Front.warm`), so the chat routes answer meanwhile; a Quart route asked for before then
waits for it (as does the first one of an embedded relay, which imports it then).

The guard is rebuilt whenever the engine's config object changes (a reload), so the
front never needs to be told.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import trio

from relay.engine.engine import Engine
from relay.vocab.errors import RelayError

from .asgi import Message, Receive, Scope, Send, send_error
from .chat import Chat
from .endpoints import CountTokens, Embed
from .exchange import Exchange, Handler
from .fanout import Fanout
from .guard import Guard
from .metrics import Metrics
from .paths import match, not_served
from .responses import ResponsesChat, serve_stored

__all__ = ["Front"]

# The handler of each kind of relay route in the table of `relay.front.paths`.
_HANDLERS: dict[str, Callable[[], Handler]] = {"chat": Chat, "embeddings": Embed,
                                       "count_tokens": CountTokens, "fanout": Fanout,
                                       "responses": ResponsesChat}


class Front:
    """The ASGI app of one relay."""

    def __init__(self, relay: Engine, metrics: Metrics) -> None:
        self.relay = relay
        self.metrics = metrics
        self._quart: Any = None  # the Quart app, once built (`warm`)
        self.guard = Guard(relay, self._route)

    async def warm(self) -> None:
        """Import Quart's modules in a worker thread, so the event loop goes on serving
        meanwhile (the server calls this as it starts listening)."""
        if self._quart is None:
            await trio.to_thread.run_sync(_make_quart_app)
        self._app()

    def _app(self) -> Any:
        """The Quart app, built the first time it is needed (if `warm` has not run, or is
        still importing, the import finishes here, on the loop: once)."""
        if self._quart is None:
            self._quart = _make_quart_app()(self.relay, self.metrics)
        return self._quart

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.guard.config is not self.relay.config:  # reloaded: rebuild from it
            self.guard = Guard(self.relay, self._route)
        await self.guard(scope, receive, send)

    async def _route(self, scope: Scope, receive: Receive, send: Send, body: bytes) -> None:
        served = match(scope["path"])
        if served is None:
            await not_served(self.relay, scope, send)
            return
        if served.kind == "stored":  # stored responses (SPEC A7)
            await serve_stored(self.relay, scope, send)
            return
        if served.dialect is not None:  # a relay route, in raw ASGI
            if scope["method"] not in served.methods:
                wrong = RelayError("invalid_request", f"use {'|'.join(served.methods)} for "
                                   f"{scope['path']}", status=405)
                self.guard._record(scope, wrong)
                await send_error(send, wrong, served.dialect)
                return
            await Exchange(self.relay, scope, receive, send, served.dialect).serve(
                body, _HANDLERS[served.kind]())
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self._app()(scope, replay, send)


def _make_quart_app() -> Callable[[Engine, Metrics], Any]:
    """`relay.front.routes.make_quart_app`, its module imported the first time it is
    asked for (the one place it is: Quart comes with it)."""
    from .routes import make_quart_app
    return make_quart_app
