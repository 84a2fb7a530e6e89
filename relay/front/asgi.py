"""The ASGI vocabulary of the front: message types, headers, JSON and error answers, and
the table of the routes relay serves in raw ASGI, each in its dialect."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from typing import Any

from relay.dialects.anthropic_messages import ANTHROPIC
from relay.dialects.base import Dialect, dumps
from relay.dialects.openai_chat import OPENAI
from relay.dialects.openai_responses import RESPONSES
from relay.vocab.errors import RelayError

__all__ = ["BODY_FOLLOWS", "RELAY_ROUTES", "Message", "Receive", "Scope", "Send", "header",
           "send_error", "send_json"]

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

# The relay routes: served in raw ASGI, each in its dialect (SPEC A1, A6, A7).
RELAY_ROUTES: dict[str, Dialect] = {"/v1/chat/completions": OPENAI, "/v1/messages": ANTHROPIC,
                                    "/v1/responses": RESPONSES}


# True while `send_json` sends its http.response.start: the body follows at once, so the
# server may hold the head back and send both in one write (relay.assembly.server).
BODY_FOLLOWS: ContextVar[bool] = ContextVar("relay_body_follows", default=False)


def header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return str(value.decode("latin-1"))
    return None


async def send_json(send: Send, status: int, obj: Any,
                    headers: list[tuple[bytes, bytes]] | None = None) -> None:
    body = dumps(obj)
    follows = BODY_FOLLOWS.set(True)
    try:
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                *(headers or [])]})
    finally:
        BODY_FOLLOWS.reset(follows)
    await send({"type": "http.response.body", "body": body})


async def send_error(send: Send, error: RelayError, dialect: Dialect = OPENAI) -> None:
    await send_json(send, error.status, dialect.error_body(error), error.headers())
