"""The HTTP front of one relay: the guard, then the relay routes in raw ASGI (chat in
each dialect, fan-out), then Quart for the rest (models, status, health, metrics).

The guard is rebuilt whenever the engine's config object changes (a reload), so the
front never needs to be told.
"""

from __future__ import annotations

from relay.dialects.openai_chat import OPENAI
from relay.engine.engine import Engine
from relay.vocab.errors import RelayError

from .asgi import RELAY_ROUTES, Message, Receive, Scope, Send, send_error
from .chat import Chat
from .exchange import Exchange
from .fanout import Fanout
from .guard import Guard
from .metrics import Metrics
from .responses import PREFIX as RESPONSES_PREFIX
from .responses import ResponsesChat, serve_stored
from .routes import make_quart_app

__all__ = ["Front"]


class Front:
    """The ASGI app of one relay."""

    def __init__(self, relay: Engine, metrics: Metrics) -> None:
        self.relay = relay
        self.quart = make_quart_app(relay, metrics)
        self.guard = Guard(relay, self._route)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.guard.config is not self.relay.config:  # reloaded: rebuild from it
            self.guard = Guard(self.relay, self._route)
        await self.guard(scope, receive, send)

    async def _route(self, scope: Scope, receive: Receive, send: Send, body: bytes) -> None:
        dialect = RELAY_ROUTES.get(scope["path"])
        if dialect is not None:
            if scope["method"] != "POST":
                wrong = RelayError("invalid_request", f"use POST for {scope['path']}",
                                   status=405)
                self.guard._record(scope, wrong)
                await send_error(send, wrong, dialect)
                return
            handler = ResponsesChat() if scope["path"] == "/v1/responses" else Chat()
            await Exchange(self.relay, scope, receive, send, dialect).serve(body, handler)
            return
        if scope["path"].startswith(RESPONSES_PREFIX):  # stored responses (SPEC A7)
            await serve_stored(self.relay, scope, send)
            return
        if scope["path"] == "/relay/v1/fanout":
            if scope["method"] != "POST":
                wrong = RelayError("invalid_request", "use POST for /relay/v1/fanout",
                                   status=405)
                self.guard._record(scope, wrong)
                await send_error(send, wrong)
                return
            await Exchange(self.relay, scope, receive, send, OPENAI).serve(body, Fanout())
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.quart(scope, replay, send)  # type: ignore[arg-type]
