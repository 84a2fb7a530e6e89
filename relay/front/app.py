"""The HTTP front of one relay: the guard, then the relay routes in raw ASGI (chat in
each dialect, embeddings, token counts, fan-out), the routes programs poll in raw ASGI
too (health, models, status: `relay.front.info`), then Quart for the rest (the status
page, recent requests, metrics, checks, reload). Which is which is the table of
`relay.front.paths`; a path it does not hold gets the 404 that lists the paths relay
serves.

Quart (with the Flask and hypercorn-asyncio modules it brings) is ~10 MB of relay's
memory and a third of its import time, ~0.2 s: it is imported the first time one of its
routes is asked for, in a worker thread, so the event loop goes on serving meanwhile; a
relay nobody opens the status page of never imports it.

The guard is rebuilt whenever the engine's config object changes (a reload), so the
front never needs to be told.
"""

from __future__ import annotations

import sys
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
from .gemini import serve_gemini
from .guard import Guard
from .info import serve_info
from .metrics import Metrics
from .ollama.routes import serve_ollama
from .paths import gemini_method, google_client, match, not_served
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
        self._quart: Any = None  # the Quart app, once built (`_app`)
        self._importing = trio.Lock()
        self.guard = Guard(relay, self._route)

    async def _app(self) -> Any:
        """The Quart app, built the first time a Quart route is asked for: its modules
        imported in a worker thread, once, while the loop goes on serving (unless they
        are imported already: another relay in this process, or a test on virtual time
        that imports them so that no virtual time passes meanwhile)."""
        if self._quart is None:
            async with self._importing:
                if self._quart is None:
                    make = (_make_quart_app() if _ROUTES in sys.modules
                            else await trio.to_thread.run_sync(_make_quart_app))
                    self._quart = make(self.relay, self.metrics)
        return self._quart

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.guard.config is not self.relay.config:  # reloaded: rebuild from it
            self.guard = Guard(self.relay, self._route)
        await self.guard(scope, receive, send)

    async def _route(self, scope: Scope, receive: Receive, send: Send, body: bytes) -> None:
        served = match(scope["path"])
        # Ollama's API (SPEC A10), and its "Ollama is running" at / on [server] ollama_port
        if (served is not None and served.kind.startswith("ollama")) or (
                scope["path"] == "/" and scope.get("relay.ollama")):
            await serve_ollama(self.relay, scope, receive, send, body, self.guard._record)
            return
        if served is None:
            await not_served(self.relay, scope, send)
            return
        if served.kind == "stored":  # stored responses (SPEC A7)
            await serve_stored(self.relay, scope, send)
            return
        if served.kind == "info" and not gemini_method(scope["path"]) and not (
                scope["path"].startswith("/v1/models") and google_client(scope)):
            await serve_info(self.relay, scope, send, served)
            return
        # Google's Gemini API (SPEC A9); Google's newer SDKs use /v1/models/{model}:{method}
        # and list the models at GET /v1/models, in Google's shape to a Google client.
        if served.kind in ("gemini", "info"):
            await serve_gemini(self.relay, scope, receive, send, body, self.guard._record)
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

        await (await self._app())(scope, replay, send)


_ROUTES = f"{__package__}.routes"


def _make_quart_app() -> Callable[[Engine, Metrics], Any]:
    """`relay.front.routes.make_quart_app`, its module imported the first time it is
    asked for, here and nowhere else: Quart comes with it (a module of this same layer,
    imported late on purpose, not a layer dodged)."""
    from .routes import make_quart_app
    return make_quart_app
