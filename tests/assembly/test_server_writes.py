"""relay's connection handler (relay/assembly/server.py) sends a JSON answer's head and
body in one write; every other head goes out as hypercorn hands it over. Real: trio's
memory stream as the socket, hypercorn's events, the ASGI ``send_json`` flag."""

from __future__ import annotations

import trio
import trio.testing
from hypercorn.events import Closed, RawData

from relay.assembly.server import BoundedWriteTCPServer
from relay.front.asgi import BODY_FOLLOWS

HEAD = b"HTTP/1.1 200 \r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n"


def _server() -> tuple[BoundedWriteTCPServer, list[bytes]]:
    writes: list[bytes] = []
    stream = trio.testing.MemorySendStream()

    async def hook() -> None:
        writes.append(stream.get_data_nowait())

    stream.send_all_hook = hook
    server = BoundedWriteTCPServer(None, None, None, None, stream, write_timeout_s=5.0)
    return server, writes


async def test_a_json_head_waits_for_its_body() -> None:
    server, writes = _server()
    token = BODY_FOLLOWS.set(True)
    try:
        await server.protocol_send(RawData(data=HEAD))
    finally:
        BODY_FOLLOWS.reset(token)
    assert writes == []
    await server.protocol_send(RawData(data=b"{}"))
    assert writes == [HEAD + b"{}"]


async def test_a_stream_head_goes_out_at_once() -> None:
    server, writes = _server()
    await server.protocol_send(RawData(data=HEAD))
    assert writes == [HEAD]


async def test_a_held_head_goes_out_before_the_connection_closes() -> None:
    server, writes = _server()

    class Protocol:
        async def handle(self, event: object) -> None:
            pass

    server.protocol = Protocol()  # type: ignore[assignment]
    token = BODY_FOLLOWS.set(True)
    try:
        await server.protocol_send(RawData(data=HEAD))
    finally:
        BODY_FOLLOWS.reset(token)
    with trio.move_on_after(1):
        await server.protocol_send(Closed())
    assert writes[:1] == [HEAD]
