"""The listener loop: hypercorn's HTTP machinery, with relay's own accept loop.

Why not ``hypercorn.trio.serve``: hypercorn shields every socket write with no deadline,
so one client that stops reading blocks its request, and even shutdown, forever
(notes/trio-stack.md Q2, Q4; pgjones/hypercorn#262). relay serves connections with a
`TCPServer` subclass whose writes keep hypercorn's shield but get a deadline inside it
(``[server] write_timeout_s``): a reader that takes nothing for that long is dropped, and
its request sees ``http.disconnect`` and stops like any other. The subclass is handed to
``trio.serve_listeners`` directly, so hypercorn's module globals are never touched (an
embedding program's own hypercorn servers are unaffected). hypercorn is pinned (0.18.*)
and a test drives a stalled reader through it.

The same subclass makes every connection close when it should — on ``Connection: close``,
for HTTP/1.0, and after ``KEEP_ALIVE_TIMEOUT_S`` idle — whatever app answered it. hypercorn
closes a connection (or arms its keep-alive timer) from inside the app's last ``send``,
just after it has told the app ``http.disconnect``; quart-trio cancels its request on that
message, so those steps were cancelled and the connection stayed open until the client
left (a file descriptor per poller, until relay could accept nothing). They run shielded,
with a deadline; tests/front/test_front_hostile.py pins it.

Shutdown: `serve_http` stops accepting when ``shutdown`` is set, lets idle keep-alive
connections close, drains the relay (grace, then ``shutting_down``), and returns. A
cancel of the caller's scope stops everything at once (SPEC O2).
"""

from __future__ import annotations

import errno
import logging
import math
import socket
from functools import partial
from typing import Any

import attrs
import trio
from hypercorn.config import Config as HyperConfig
from hypercorn.events import Closed, RawData, Updated
from hypercorn.protocol.h2 import H2Protocol
from hypercorn.trio.tcp_server import MAX_RECV, TCPServer
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.typing import ConnectionState
from hypercorn.utils import wrap_app

from relay.api import eager
from relay.config import Config
from relay.front.asgi import BODY_FOLLOWS
from relay.vocab.profile import is_loopback_host

from .relay import Relay, open_relay

# layers: long because the server subclass and the listener loop (with its second,
# Ollama listener) share hypercorn's machinery and are read together.

__all__ = ["KEEP_ALIVE_TIMEOUT_S", "BoundedWriteTCPServer", "ListenError", "Served", "serve",
           "serve_http"]

logger = logging.getLogger(__name__)

# How long closing a connection (or arming its keep-alive timer) may take once it is
# shielded: these touch only the local socket and hypercorn's own task group.
CLOSE_TIMEOUT_S = 1.0
# An idle keep-alive connection is closed after this long (hypercorn's default, named).
KEEP_ALIVE_TIMEOUT_S = 5.0


class BoundedWriteTCPServer(TCPServer):
    """hypercorn's connection handler, with every socket write bounded in time, and its
    keep-alive timer kept by the connection's reader (no task of its own)."""

    def __init__(self, *args: Any, write_timeout_s: float,
                 live: set[BoundedWriteTCPServer] | None = None) -> None:
        super().__init__(*args)
        self.write_timeout_s = write_timeout_s
        self._held = b""  # a response head whose body follows at once
        # hypercorn arms its keep-alive timer through ``idle_task`` (once, as the
        # connection starts idle): relay's reader keeps it instead (`_read_data`).
        self.idle_task = self  # type: ignore[assignment]
        self._live = live if live is not None else set()
        self._idle = False
        self._idle_deadline = math.inf  # the reader's deadline: set while idle
        self._reading: trio.CancelScope | None = None  # the reader's wait, while it waits

    async def run(self) -> None:
        self._live.add(self)
        try:
            await super().run()
        finally:
            self._live.discard(self)
            # hypercorn's connection objects point at one another (the protocol sends
            # through this server's bound method; the disconnect call holds the task
            # group): undone once every task of the connection has ended, so a
            # connection is freed by reference counts as it closes, not left with its
            # buffers for the cycle collector.
            for name in ("protocol", "idle_task"):
                vars(self).pop(name, None)
            task_group = vars(self).pop("_task_group", None)
            if task_group is not None:
                vars(task_group).pop("spawn_app", None)

    # --- the keep-alive timer -----------------------------------------------------------
    # hypercorn's own starts a task per idle period; relay's used to hold one per
    # connection. Here the reader's wait for the next bytes has the deadline: now +
    # ``keep_alive_timeout`` while the connection is idle, none while a request runs.
    # What happens when it passes is hypercorn's: an idle connection is closed. A
    # draining relay (`terminate`) closes idle connections at once; a busy one closes
    # after its answer (hypercorn's protocols see ``context.terminated``).

    async def restart(self, task_group: Any, action: Any) -> None:  # hypercorn: idle
        self._set_idle(True)
        await trio.lowlevel.checkpoint_if_cancelled()

    async def stop(self) -> None:  # hypercorn: busy (relay's Updated events come here
        self._set_idle(False)      # as calls; this is the interface's other half)
        await trio.lowlevel.checkpoint_if_cancelled()

    def terminate(self) -> None:
        """relay is draining (``context.terminated`` is set): an idle connection closes
        now, a busy one once idle."""
        if self._idle:
            self._set_idle(True)

    def _set_idle(self, idle: bool) -> None:
        # Only moves a deadline: nothing here checkpoints, so no cancellation can cut it.
        self._idle = idle
        if not idle:
            self._idle_deadline = math.inf
        elif self.context.terminated.is_set():
            self._idle_deadline = -math.inf
        else:
            self._idle_deadline = trio.current_time() + self.config.keep_alive_timeout
        if self._reading is not None:
            self._reading.deadline = self._idle_deadline

    async def _read_data(self) -> None:
        """hypercorn's reader, with the keep-alive deadline on its wait. (hypercorn's
        ``read_timeout`` is not used: relay turns it off, as it would cut streams.)"""
        _call_on_disconnect(self._task_group)  # set up by now; no request has come yet
        while True:
            reading = self._reading = trio.CancelScope(deadline=self._idle_deadline)
            try:
                with reading:
                    data = await self.stream.receive_some(MAX_RECV)
            except (trio.ClosedResourceError, trio.BrokenResourceError):
                break
            finally:
                self._reading = None
            if reading.cancelled_caught:  # idle for keep_alive_timeout, or draining
                with trio.CancelScope(shield=True), trio.move_on_after(CLOSE_TIMEOUT_S):
                    await self._initiate_server_close()
                break
            await self.protocol.handle(RawData(bytes(data)))  # (bytes: no copy)
            if not data:
                break
            if not self._idle and isinstance(self.protocol.protocol, H2Protocol) and (
                    self.protocol.protocol.idle):
                # HTTP/2 by prior knowledge: h11 took the preface for a request (busy),
                # and hypercorn says idle again only as a stream closes. A connection
                # that opens no stream is idle, and closes as an idle one does.
                self._set_idle(True)
        await self.protocol.handle(Closed())

    async def protocol_send(self, event: Any) -> None:
        if isinstance(event, RawData):
            if self._held:
                event, self._held = RawData(data=self._held + event.data), b""
            elif BODY_FOLLOWS.get():
                # relay's JSON answers: the head waits for its body (the next write), so
                # both leave in one write, one wake-up of the client, not two.
                self._held = event.data
                return
        elif self._held:  # anything else: what is held goes first
            await self.protocol_send(RawData(data=b""))
        if isinstance(event, Updated):
            # Two per request: the keep-alive deadline moves (hypercorn's own took a lock).
            self._set_idle(event.idle)
            return
        if isinstance(event, Closed):
            # hypercorn sends this from inside the app's last ``send``, after it has put
            # ``http.disconnect`` in the app's queue. quart-trio cancels its request
            # nursery on that message, so the close (``send_eof()`` checkpoints) would be
            # cancelled before it ran, and the connection would stay open until the
            # client left. It is quick and local.
            with trio.CancelScope(shield=True,
                                  deadline=trio.current_time() + CLOSE_TIMEOUT_S):
                await super().protocol_send(event)
            return
        if not isinstance(event, RawData):
            await super().protocol_send(event)
            return
        if not event.data:  # h11's end of a body whose length was given: nothing to write
            await trio.lowlevel.checkpoint_if_cancelled()
            return
        # A cancel point as trio's lock is: a cancelled task writes nothing (at a hard
        # stop, not hypercorn's bare 500).
        await eager.acquire(self.send_lock)
        try:
            # What the socket takes at once is written without a scope (nothing waits, so
            # nothing can cut it). The rest keeps hypercorn's shield (a half-written frame
            # poisons the connection), but bounded: the shielded scope has its own
            # deadline (one scope, not a shield around a `fail_after`).
            gone = timed_out = False
            data = event.data
            try:
                sent = eager.write_now(self.stream, data)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                gone, sent = True, len(data)
            if sent < len(data):
                with trio.CancelScope(shield=True, deadline=trio.current_time()  # noqa: ASYNC912
                                      + self.write_timeout_s) as bounded:  # (a write may wait)
                    try:
                        await self.stream.send_all(memoryview(data)[sent:] if sent else data)
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        gone = True
                timed_out = bounded.cancelled_caught
            if gone or timed_out:  # the client left, or takes nothing
                await self.stream.aclose()  # closes even when cancelled; wakes the reader
                with trio.CancelScope(shield=True), trio.move_on_after(1.0):
                    await self.protocol.handle(Closed())  # → http.disconnect → stop
        finally:
            self.send_lock.release()


class ListenError(OSError):
    """relay could not listen on its address: the port is taken, the address is not this
    machine's, the port needs privileges. ``str()`` is one line for a person: the address,
    why, and how to pick another; ``errno`` is the socket's."""

    def __init__(self, host: str, port: int, exc: OSError, *, ollama: bool = False) -> None:
        where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        if ollama:  # [server] ollama_port (SPEC A10)
            why = (f"[server] ollama_port {port} is already in use (Ollama itself, most "
                   f"likely, listens on {where}): stop Ollama, or set [server] ollama_port "
                   "to another port, or to 0 (off); relay serves Ollama's API on its main "
                   "port as well" if exc.errno == errno.EADDRINUSE else
                   f"[server] ollama_port {port}: {exc.strerror or exc}; set another port, "
                   "or 0 (off)")
        elif exc.errno == errno.EADDRINUSE:
            why = (f"port {port} is already in use (another relay, or another program, "
                   f"listens on {where}). Pick another port: relay serve --port "
                   f"{port + 1 if 0 < port < 65535 else 8766}, or set [server] port in "
                   "the config")
        elif exc.errno == errno.EACCES:
            why = (f"port {port} needs privileges this user lacks. Pick a port above 1023: "
                   "relay serve --port 8765, or set [server] port in the config")
        elif exc.errno == errno.EADDRNOTAVAIL:
            why = (f"{host} is not an address of this machine. Pick one it has: relay "
                   "serve --host 127.0.0.1, or set [server] host in the config")
        else:
            why = (f"{exc.strerror or exc}. Pick another address: relay serve --host H "
                   "--port N, or set [server] host and port in the config")
        super().__init__(exc.errno, f"cannot listen on {where}: {why}")
        self.host, self.port = host, port

    def __str__(self) -> str:
        return str(self.strerror)


@attrs.frozen
class Served:
    """What `serve_http` (and `relay.serve`) report once listening; ``ollama_url``: the
    ``[server] ollama_port`` listener's, when it is on."""

    relay: Relay
    urls: list[str]
    ollama_url: str | None = None

    @property
    def url(self) -> str:
        return self.urls[0]


def _call_on_disconnect(task_group: Any) -> None:
    """Each request's ``http.disconnect`` also reaches its exchange as a call, made as
    hypercorn queues the message: the exchange then needs no task of its own waiting on
    ``receive`` for it. The scope says so (``relay.disconnect_calls``); the exchange puts
    its handler in ``relay.on_disconnect`` while it runs, and a disconnect that came
    before is marked (``relay.gone``). Messages go into the app's queue as before, and
    without a trip through the scheduler when it has room (the body's two)."""
    spawn_app = task_group.spawn_app

    async def spawn(app: Any, config: Any, scope: dict[str, Any], send: Any) -> Any:
        scope["relay.disconnect_calls"] = True
        put = await spawn_app(app, config, scope, send)
        queue = getattr(put, "__self__", None)

        async def watched(message: dict[str, Any]) -> None:
            if message["type"] == "http.disconnect":
                scope["relay.gone"] = True
                if (handler := scope.get("relay.on_disconnect")) is not None:
                    handler()
            if isinstance(queue, trio.MemorySendChannel):
                await eager.send(queue, message)
            else:
                await put(message)
        return watched
    task_group.spawn_app = spawn


def _writes_bounded(app: Any) -> Any:
    """Mark the requests whose every write this server bounds (``relay.writes_bounded``):
    HTTP/1.x, each body a socket write in `BoundedWriteTCPServer.protocol_send`. The
    exchange then leaves out its own bound, which is for what a server cannot see (an
    HTTP/2 stream waiting on flow control; an ASGI server that is not relay's).

    And give the app an ASGI ``receive`` that takes a message already in hypercorn's
    queue (the body, as it arrived) without a trip through the scheduler: a cancel point
    still, and a wait when the queue is empty, as hypercorn's own."""
    async def bounded(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope.get("http_version") in ("1.1", "1.0"):
            scope["relay.writes_bounded"] = True
        await app(scope, _eager(receive), send)
    return bounded


def _eager(receive: Any) -> Any:
    queue = getattr(receive, "__self__", None)  # hypercorn's: the app queue's ``receive``
    if not isinstance(queue, trio.MemoryReceiveChannel):
        return receive
    return partial(eager.receive, queue)


async def _connection(make: Any, stream: trio.SocketStream) -> None:
    """One client's connection. A failure of hypercorn's on one (0.18 raises KeyError for
    an HTTP/2 stream's data that comes after its answer, e.g. a refusal on the headers)
    ends that connection, logged, and never the listener with every other request."""
    try:
        await make(stream)
    except Exception:
        logger.exception("a client connection failed inside the HTTP server; it is "
                         "closed, and relay serves on")
        await stream.aclose()  # (closes even when cancelled)


async def serve_http(
    relay: Relay, *, port: int | None = None,
    shutdown: trio.Event | None = None,
    task_status: trio.TaskStatus[Served] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``relay.app`` until cancelled, or until ``shutdown`` is set (then drain).

    Raises:
        ListenError: the address cannot be listened on (a port in use, say).
    """
    server = relay.config.server
    host = server.host
    port = port if port is not None else server.port
    cfg = HyperConfig()
    cfg.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    cfg.accesslog = None
    cfg.read_timeout = None  # it runs while a response streams and would cut it
    cfg.keep_alive_timeout = KEEP_ALIVE_TIMEOUT_S
    # (hypercorn's graceful_timeout is not used: relay runs its own accept loop and its
    # own drain, `Relay.drain`, then cancels what is left.)
    app = wrap_app(_writes_bounded(relay.app), cfg.wsgi_max_body_size, "asgi")
    try:
        sockets = cfg.create_sockets()
    except OSError as exc:  # a port in use, an address not this machine's: one line (issue 15)
        raise ListenError(host, port, exc) from exc
    listeners, urls = _listen(sockets.insecure_sockets, cfg.backlog)
    ollama, ollama_urls = _listen_ollama(server, cfg, sockets.insecure_sockets)
    context = WorkerContext(None)
    live: set[BoundedWriteTCPServer] = set()  # the connections being served

    def handler(app: Any) -> Any:
        return partial(_connection, partial(
            BoundedWriteTCPServer, app, cfg, context, ConnectionState({}),
            write_timeout_s=server.write_timeout_s, live=live))
    async with trio.open_nursery() as connections:
        async with trio.open_nursery() as accepting:
            accepting.start_soon(partial(trio.serve_listeners, handler(app), listeners,
                                         handler_nursery=connections))
            if ollama:
                ollama_app = wrap_app(_writes_bounded(_on_ollama_port(relay.app)),
                                      cfg.wsgi_max_body_size, "asgi")
                accepting.start_soon(partial(trio.serve_listeners, handler(ollama_app),
                                             ollama, handler_nursery=connections))
            task_status.started(Served(relay, urls, ollama_urls[0] if ollama_urls else None))
            if shutdown is None:
                await trio.sleep_forever()
            await shutdown.wait()
            logger.info("relay is draining: no new connections; in-flight requests get "
                        "%g s", server.drain_grace_s)
            accepting.cancel_scope.cancel()
        for listener in [*listeners, *ollama]:
            await listener.aclose()
        await context.terminated.set()  # busy connections close after their answer
        for connection in list(live):
            connection.terminate()  # idle keep-alive connections close now
        await relay.drain(server.drain_grace_s)
        connections.cancel_scope.cancel()


def _listen(sockets: Any, backlog: int) -> tuple[list[trio.SocketListener], list[str]]:
    listeners, urls = [], []
    for sock in sockets:
        sock.listen(backlog)
        listeners.append(trio.SocketListener(trio.socket.from_stdlib_socket(sock)))
        name, bound_port = sock.getsockname()[:2]
        urls.append(f"http://[{name}]:{bound_port}" if ":" in name
                    else f"http://{name}:{bound_port}")
    return listeners, urls


def _listen_ollama(server: Any, cfg: HyperConfig, main: Any
                   ) -> tuple[list[trio.SocketListener], list[str]]:
    """``[server] ollama_port`` (SPEC A10): a second port on loopback (the main host when
    it is one, else 127.0.0.1), for the apps that look for Ollama at 127.0.0.1:11434."""
    if not server.ollama_port:
        return [], []
    host = server.host if is_loopback_host(server.host) else "127.0.0.1"
    # (bound here, not by hypercorn's create_sockets: that leaves a socket open when
    # the port is taken)
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host.strip("[]"), server.ollama_port))
        sock.setblocking(False)
    except OSError as exc:
        for opened in (sock, *main):
            opened.close()
        raise ListenError(host, server.ollama_port, exc, ollama=True) from exc
    return _listen([sock], cfg.backlog)


def _on_ollama_port(app: Any) -> Any:
    """Mark the requests that came to ``ollama_port``: there ``/`` is Ollama's."""
    async def marked(scope: dict[str, Any], receive: Any, send: Any) -> None:
        scope["relay.ollama"] = True
        await app(scope, receive, send)
    return marked


async def serve(
    config: Config, *, port: int | None = None,
    shutdown: trio.Event | None = None,
    task_status: trio.TaskStatus[Served] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run a relay and its HTTP front until cancelled (or ``shutdown`` is set: drain).

    ``task_status.started`` gets a `Served` with the bound URLs and the `Relay`.
    ``port`` overrides the config's (0: any free port); the host is the config's, whose
    safety rules were checked when it was loaded.
    """
    async with open_relay(config) as relay:
        await serve_http(relay, port=port, shutdown=shutdown,
                         task_status=task_status)
