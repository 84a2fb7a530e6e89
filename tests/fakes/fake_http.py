"""A small HTTP/1.1 server on trio sockets + h11, for fake cloud APIs in tests.

The approach of tests/fakes/upstream.py, made generic: every connection has a reader task that
owns all socket reads, so EOF or a reset marks the connection closed at once
(`Conn.closed_at`, ``closed_by="peer"``) and cancels whatever the response is doing
(a delay, a hang, a stream). A fake API subclasses `FakeServer` and implements
``respond(exchange)``; `Exchange` has what a response needs: JSON answers, an SSE stream
started and fed event by event, a clean end, or `Abort` to drop the connection mid-body.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from http import HTTPStatus
from typing import Any, Literal

import attrs
import h11
import trio

__all__ = ["Abort", "Conn", "Exchange", "FakeServer", "Recorded", "serve_fake"]


@attrs.define
class Recorded:
    """One request as received (recorded once its body is fully read)."""

    method: str
    path: str  # as sent, with its query string
    headers: dict[str, str]  # lower-case keys
    json: Any  # the parsed body, or None
    received_at: float
    conn_id: int


@attrs.define
class Conn:
    conn_id: int
    opened_at: float
    closed_at: float | None = None
    closed_by: Literal["peer", "server"] | None = None


class Abort(Exception):
    """Drop the connection now, in the middle of whatever was being sent."""


class FakeServer:
    """Observations of one running fake; subclasses answer in ``respond``."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.base_url = f"http://127.0.0.1:{port}"
        self.requests: list[Recorded] = []
        self.connections: list[Conn] = []
        self._changed = trio.Event()

    async def respond(self, exchange: Exchange) -> None:
        raise NotImplementedError

    def notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def wait_until(self, predicate: Callable[[], bool]) -> None:
        """Until ``predicate()`` holds; re-checked on every change (no polling)."""
        await trio.lowlevel.checkpoint()
        while not predicate():
            await self._changed.wait()

    async def wait_for_requests(self, n: int) -> None:
        await self.wait_until(lambda: len(self.requests) >= n)

    async def wait_all_closed(self) -> None:
        await self.wait_until(lambda: all(c.closed_at is not None for c in self.connections))

    async def _handle(self, stream: trio.SocketStream) -> None:
        conn = Conn(len(self.connections), trio.current_time())
        self.connections.append(conn)
        self.notify()
        await _Connection(self, stream, conn).run()


class Exchange:
    """One request and the means to answer it."""

    def __init__(self, connection: _Connection, request: Recorded) -> None:
        self._c = connection
        self.request = request
        self.method = request.method
        self.path = request.path.split("?", 1)[0]
        self.query = request.path.partition("?")[2]
        self.json = request.json

    async def send_json(self, status: int, obj: Any,
                        headers: dict[str, str] | None = None) -> None:
        body = json.dumps(obj).encode()
        await self._c.send(h11.Response(status_code=status, reason=_reason(status),
                                        headers=[("content-type", "application/json"),
                                                 ("content-length", str(len(body))),
                                                 *(headers or {}).items()]))
        await self._c.send(h11.Data(data=body))
        await self._c.send(h11.EndOfMessage())

    async def start_sse(self, headers: dict[str, str] | None = None) -> None:
        await self._c.send(h11.Response(status_code=200, reason=b"OK", headers=[
            ("content-type", "text/event-stream"), ("cache-control", "no-cache"),
            *(headers or {}).items()]))

    async def send_raw(self, data: bytes) -> None:
        await self._c.send(h11.Data(data=data))

    async def end(self) -> None:
        await self._c.send(h11.EndOfMessage())


class _Connection:
    def __init__(self, server: FakeServer, stream: trio.SocketStream, conn: Conn) -> None:
        self.server = server
        self.stream = stream
        self.conn = conn
        self.h11 = h11.Connection(h11.SERVER)
        self.data = trio.Event()
        self.cancel = trio.CancelScope()

    def mark_closed(self, by: Literal["peer", "server"]) -> None:
        if self.conn.closed_at is None:
            self.conn.closed_at = trio.current_time()
            self.conn.closed_by = by
            self.server.notify()

    async def run(self) -> None:
        try:
            with self.cancel:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self.reader)
                    try:
                        await self.serve()
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        self.mark_closed("peer")
                    except Abort:
                        pass
                    self.cancel.cancel()
        finally:
            self.mark_closed("server")
            await trio.aclose_forcefully(self.stream)

    async def reader(self) -> None:
        try:
            while data := await self.stream.receive_some(65536):
                self.h11.receive_data(data)
                self.data.set()
                self.data = trio.Event()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        self.mark_closed("peer")
        self.cancel.cancel()

    async def next_event(self) -> Any:
        while True:
            event = self.h11.next_event()
            if event is not h11.NEED_DATA:
                return event
            await self.data.wait()

    async def send(self, event: Any) -> None:
        await self.stream.send_all(self.h11.send(event))

    async def serve(self) -> None:
        while True:
            event = await self.next_event()
            if not isinstance(event, h11.Request):
                return
            body = bytearray()
            while True:
                part = await self.next_event()
                if isinstance(part, h11.Data):
                    body += part.data
                elif isinstance(part, h11.EndOfMessage):
                    break
                else:
                    return
            try:
                parsed = json.loads(body) if body else None
            except ValueError:
                parsed = None
            recorded = Recorded(
                method=event.method.decode(), path=event.target.decode("latin-1"),
                headers={k.decode().lower(): v.decode("latin-1") for k, v in event.headers},
                json=parsed, received_at=trio.current_time(), conn_id=self.conn.conn_id)
            self.server.requests.append(recorded)
            self.server.notify()
            await self.server.respond(Exchange(self, recorded))
            if self.h11.our_state is h11.DONE and self.h11.their_state is h11.DONE:
                self.h11.start_next_cycle()
            else:
                return


def _reason(status: int) -> bytes:
    try:
        return HTTPStatus(status).phrase.encode()
    except ValueError:
        return b""


async def serve_fake(server_type: type[FakeServer], *,
                     task_status: trio.TaskStatus[Any] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve a ``server_type`` on 127.0.0.1 (a free port) until cancelled."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    server = server_type(listeners[0].socket.getsockname()[1])
    async with trio.open_nursery() as nursery:
        await nursery.start(trio.serve_listeners, server._handle, listeners)
        task_status.started(server)
