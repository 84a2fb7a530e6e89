"""relay's Redis client on a server that is no longer (or not yet) the primary (SPEC O6):
``READONLY``, ``LOADING`` and ``MASTERDOWN`` replies fail the connection — the caller
gets `ConnectionLost` — and the next command connects anew, where a plain error reply
leaves the connection as it is. A fake server on loopback (its commands parsed by the
client's own fallback parser) answers the first connection's commands with the code."""

from __future__ import annotations

from functools import partial

import pytest
import trio

from relay.redis import resp
from relay.redis.wire import _NOT_YET, PyParser


class Fake:
    """Each connection's commands; the first connection answers ``code`` to any command
    but its set-up (CLIENT SETNAME)."""

    def __init__(self, code: str) -> None:
        self.code = code
        self.connections: list[list[list[str]]] = []

    async def handle(self, stream: trio.SocketStream) -> None:
        index = len(self.connections)
        commands: list[list[str]] = []
        self.connections.append(commands)
        parser = PyParser()
        async with stream:
            while data := await stream.receive_some(65536):
                parser.feed(data)
                while (command := parser.gets()) is not _NOT_YET:
                    commands.append(command)
                    if command[0] == "CLIENT":
                        await stream.send_all(b"+OK\r\n")
                    elif command[0] == "BAD":
                        await stream.send_all(b"-ERR unknown command\r\n")
                    elif index == 0:
                        await stream.send_all(f"-{self.code} not now\r\n".encode())
                    else:
                        await stream.send_all(b"+PONG\r\n")


@pytest.mark.parametrize("code", ["READONLY", "LOADING", "MASTERDOWN"])
async def test_a_failover_reply_fails_the_connection_and_the_next_command_reconnects(
        nursery: trio.Nursery, code: str) -> None:
    fake = Fake(code)
    listeners = await nursery.start(partial(trio.serve_tcp, fake.handle, 0,
                                            host="127.0.0.1"))
    port = listeners[0].socket.getsockname()[1]
    async with resp.open_client(f"redis://127.0.0.1:{port}/0", timeout_s=2,
                                name="t") as client:
        with pytest.raises(resp.RespError):  # a plain error: the connection stays
            await client.execute("BAD")
        with pytest.raises(resp.ConnectionLost, match=f"not a usable primary.*{code}"):
            await client.execute("PING")
        assert len(fake.connections) == 1
        assert await client.execute("PING") == "PONG"
        assert len(fake.connections) == 2
        assert [c[0] for c in fake.connections[0]] == ["CLIENT", "BAD", "PING"]
