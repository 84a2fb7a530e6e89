"""The stack's ceiling: hypercorn (on trio, as relay runs it) serving a raw ASGI app that
answers every request with a fixed chat-completion JSON body — no Quart, no relay.

    python -m bench.ceiling PORTFILE

`bench.overhead` runs it as a process of its own and loads it like relay (section 2):
what relay does per request is everything between this and its own figure.

``POST /stream`` is the stack's floor for a queued streamed request (section 6): an SSE
answer held open with a waiting notice every 2 s, as relay sends one to each request
queued on a lane, and nothing else — what hypercorn and trio alone hold per stream.
"""

from __future__ import annotations

import json
import sys
from functools import partial
from typing import Any

import trio

# About the size of relay's own answer to the bench's plain request.
BODY = json.dumps({
    "id": "chatcmpl-ceiling", "object": "chat.completion", "created": 1700000000,
    "model": "up/fast", "choices": [{"index": 0, "message": {
        "role": "assistant", "content": "Hello world"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7},
}, separators=(",", ":")).encode()
HEADERS = [(b"content-type", b"application/json"), (b"content-length", str(len(BODY)).encode())]
WAITING = b": waiting, starts when earlier requests finish (running 1/1, queued 10000, 2 s)\n\n"


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):  # the request body, read whole
        pass
    if scope["path"] == "/stream":
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        while True:
            await send({"type": "http.response.body", "body": WAITING, "more_body": True})
            await trio.sleep(2.0)
    await send({"type": "http.response.start", "status": 200, "headers": HEADERS})
    await send({"type": "http.response.body", "body": BODY})


async def serve(portfile: str) -> None:
    from hypercorn.config import Config
    from hypercorn.trio import serve as hypercorn_serve

    from bench.overhead import _exit_with_parent, _write_json_atomically

    config = Config()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = None
    config.errorlog = None
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(partial(hypercorn_serve, app, config))  # type: ignore[arg-type]
        nursery.start_soon(_exit_with_parent, nursery)
        _write_json_atomically(portfile, {"port": int(binds[0].rpartition(":")[2])})


if __name__ == "__main__":
    trio.run(serve, sys.argv[1])
