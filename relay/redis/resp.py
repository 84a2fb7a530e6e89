"""A small Redis (and Valkey) client on trio, for the shared lanes' coordinator (SPEC L11).

Why relay's own: the coordinator sends a handful of Lua scripts and one subscription.
Measured again with hiredis as the parser (`python -m bench.shared`, part 4: one EVALSHA
of RELEASE's shape, loopback, p50/p99): this client 0.077/0.200 ms, coredis 6.9.0
0.202/0.839 ms, valkey-glide 2.6.0 0.133/0.239 ms, both under trio; and a blocking call
cancelled by a trio scope left glide's pipelined connection stuck (`coordination`). The
wire format itself is hiredis's (`resp_wire`).

Theory of operation. `open_client` gives a `Client` (no task of its own: its connection
closes when the ``async with`` ends). Commands share one connection, pipelined, and the
callers read the replies themselves — no reader task, so no hand-over between tasks::

    caller ── send lock: a place at the end of the line, then its bytes ──▶ server
    the first caller in line reads: each reply to the oldest place, until its own;
    then the next caller still waiting reads

- A caller cancelled while it waits leaves its place: its reply is read and dropped, so
  the connection stays in step (the command may have run: every coordinator script is
  safe to run twice). A reader cancelled mid-reply leaves what came in the buffer for the
  next. Nothing here retries.
- A write cut short (a broken socket, a cancel: half a command, or none, would put the
  connection out of step), an end of stream, a reply that does not parse, a
  ``READONLY``/``LOADING``/``MASTERDOWN`` reply (not the primary: a failover), or
  `Client.reset` (the caller's deadline passed: the server may be stuck) fails the
  connection: every waiting command gets `ConnectionLost`, and the next command connects
  anew. The caller bounds each command (the coordinator's ``command_timeout_s``); the
  set-up of a connection is bounded here by ``timeout_s``.
- `Client.script` sends ``EVALSHA`` with the script's SHA-1, and once ``EVAL`` with its
  source when the server does not have it (a restart, ``SCRIPT FLUSH``).
- `Client.subscribe` opens a connection of its own for ``SUBSCRIBE``; its messages are read
  in the caller's task (`resp_pubsub`, with pings for a health check).
- A ``redis+sentinel://`` URL: every connection asks the Sentinels where the primary is
  (`resp_sentinel`) and checks ``ROLE`` there; `Client.follow_primary` asks again and
  fails a connection to a server they no longer name.

What a URL may say: `relay.config.coordination_url`. No error message here quotes the URL:
it may hold a password.
"""

from __future__ import annotations

import hashlib
import logging
from collections import deque
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import attrs
import trio

from relay.api import eager
from relay.config.coordination_url import CoordinationTarget, parse_url

from . import sentinel
from .pubsub import Subscription
from .wire import ConnectionLost, Reader, RespError, encode

__all__ = ["Client", "ConnectionLost", "RespError", "Script", "Subscription", "open_client",
           "parse_url"]

logger = logging.getLogger(__name__)

_TRANSPORT = (OSError, trio.BrokenResourceError, trio.ClosedResourceError)

# Replies of a server that is not (or not yet) a usable primary: a managed failover that
# kept the name (READONLY: now a replica), a server loading its data (LOADING), a replica
# that lost its primary (MASTERDOWN). They fail the connection like a broken socket: the
# next command connects anew (and, through Sentinels, asks them where the primary is).
FAILOVER_CODES = frozenset({"READONLY", "LOADING", "MASTERDOWN"})


@attrs.frozen
class Script:
    source: str
    sha: str = attrs.field(default=attrs.Factory(
        lambda self: hashlib.sha1(self.source.encode()).hexdigest(), takes_self=True))


@attrs.define(eq=False)
class _Place:
    """One command's place in line for its reply."""

    event: trio.Event = attrs.field(factory=trio.Event)  # its reply, or its turn to read
    done: bool = False
    value: Any = None
    error: BaseException | None = None
    left: bool = False  # its caller is gone (cancelled): the reply is read and dropped


class _Connection:
    """One pipelined connection (see the module docstring). The callers read the replies
    themselves, one at a time: the first in line reads until its own has come, handing
    each earlier one to its place, then wakes the next caller still waiting."""

    def __init__(self, reader: Reader) -> None:
        self._reader = reader
        self._places: deque[_Place] = deque()
        self._send_lock = trio.Lock()
        self._reading = False
        self._read_scope = trio.CancelScope()  # the reading caller's: `fail` stops it
        self.broken: BaseException | None = None

    async def call(self, data: bytes, timeout_s: float) -> Any:
        place = _Place()
        async with self._send_lock:
            # A cancel that lands as the lock is handed over is raised here, before the
            # command has a place: nothing was sent, the connection is in step.
            await trio.lowlevel.checkpoint_if_cancelled()
            if self.broken is not None:
                raise ConnectionLost(str(self.broken)) from self.broken
            self._places.append(place)
            await self._send(data, timeout_s)
        try:
            await self._wait(place)
        except BaseException:
            place.left = True
            self._pass_on()
            raise
        if place.error is not None:
            raise ConnectionLost(str(place.error)) from place.error
        if isinstance(place.value, RespError):
            if place.value.code in FAILOVER_CODES:  # not the primary (any more)
                self.fail(ConnectionLost(f"the server is not a usable primary now "
                                         f"({place.value})"))
                raise ConnectionLost(str(self.broken)) from place.value
            raise place.value
        return place.value

    async def _send(self, data: bytes, timeout_s: float) -> None:
        """The whole command, or the connection fails (half a command, or a place with
        none, would put it out of step). A plain socket takes it at once, with no cancel
        point (one was just passed); TLS may yield inside, so it is shielded, bounded."""
        stream = self._reader.stream
        try:
            if type(stream) is trio.SocketStream:
                await eager.send_all(stream, data)
                return
            with trio.CancelScope(shield=True, deadline=trio.current_time() + timeout_s
                                  ) as bounded:
                await stream.send_all(data)
        except BaseException as exc:
            self.fail(ConnectionLost(f"writing to the coordination server: {exc!r}"))
            if isinstance(exc, _TRANSPORT):
                raise ConnectionLost(f"writing to the coordination server: {exc}") from exc
            raise
        if bounded.cancelled_caught:
            self.fail(ConnectionLost(f"the coordination server took no command within "
                                     f"{timeout_s:g} s"))
            raise ConnectionLost(str(self.broken))

    async def _wait(self, place: _Place) -> None:
        while not place.done:
            if self._reading:
                place.event = trio.Event()
                await place.event.wait()
                continue
            self._reading = True
            self._read_scope = trio.CancelScope()
            try:
                with self._read_scope:  # cancelled only by `fail`: its place is failed then
                    await self._read_until(place)
            except Exception as exc:  # (a reply that does not parse is as bad as none)
                self.fail(exc if isinstance(exc, ConnectionLost) else ConnectionLost(
                    f"reading from the coordination server: {exc!r}"))
            finally:
                self._reading = False
                self._pass_on()

    async def _read_until(self, place: _Place) -> None:
        while not place.done:
            value = await self._reader.reply()
            if not self._places:
                raise ConnectionLost("the coordination server sent a reply no command "
                                     "asked for")
            head = self._places.popleft()
            head.value, head.done = value, True
            head.event.set()

    def _pass_on(self) -> None:
        """No one reads: the first caller still waiting reads next."""
        if not self._reading:
            for place in self._places:
                if not place.left:
                    place.event.set()
                    return

    def fail(self, error: BaseException) -> None:
        """Fail every waiting command; the connection takes no more (`Client` closes
        it when it connects anew, or at its end)."""
        if self.broken is None:
            self.broken = error
        while self._places:
            place = self._places.popleft()
            place.error, place.done = self.broken, True
            place.event.set()
        self._read_scope.cancel()

    async def aclose(self) -> None:
        self.fail(ConnectionLost("the connection to the coordination server was closed"))
        await self._reader.stream.aclose()


class Client:
    """Commands, scripts and subscriptions on one server. Made by `open_client`."""

    def __init__(self, target: CoordinationTarget, *, timeout_s: float, name: str) -> None:
        self._target = target
        self._timeout_s = timeout_s
        self._name = name
        self._connection: _Connection | None = None
        self._connecting = trio.Lock()
        self._sentinel: tuple[str, int] | None = None  # the Sentinel that answered last
        self.primary: tuple[str, int] | None = None  # the primary they named last
        self._connected_to: tuple[str, int] | None = None  # the command connection's

    async def execute(self, *args: Any) -> Any:
        """Send one command and return its reply.

        Raises:
            RespError: the server's error reply.
            ConnectionLost: no connection, or it broke before the reply.
        """
        connection = self._connection
        if connection is None or connection.broken is not None:
            connection = await self._connect()
        return await connection.call(encode(args), self._timeout_s)

    async def script(self, script: Script, keys: list[str], args: list[Any]) -> Any:
        """Run a Lua script by its SHA-1, sending its source once if the server lacks it."""
        try:
            return await self.execute("EVALSHA", script.sha, len(keys), *keys, *args)
        except RespError as exc:
            if exc.code != "NOSCRIPT":
                raise
        return await self.execute("EVAL", script.source, len(keys), *keys, *args)

    async def aclose(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            await connection.aclose()

    def reset(self) -> None:
        """Drop the connection (a command's deadline passed: the server may be stuck);
        the next command connects again."""
        if self._connection is not None:
            self._connection.fail(ConnectionLost("dropped after a command got no reply "
                                                 "in time"))

    async def _connect(self) -> _Connection:
        async with self._connecting:
            connection = self._connection
            if connection is not None and connection.broken is None:
                return connection
            if connection is not None:
                self._connection = None
                await connection.aclose()  # (a broken one's stream: closes even when cancelled)
            reader, self._connected_to = await self._open()
            connection = self._connection = _Connection(reader)
            return connection

    async def follow_primary(self) -> tuple[str, int] | None:
        """Where the Sentinels say the primary is now (None: the URL names no Sentinels).
        A connection to another server fails (the next command connects to the primary):
        the old primary may take writes for a while after a failover.

        Raises:
            ConnectionLost: no Sentinel answers.
        """
        if not self._target.sentinels:
            return None
        found = await self._ask_sentinels()
        if (self._connection is not None and self._connected_to is not None
                and self._connected_to != found):
            self._connection.fail(ConnectionLost("the Sentinels name another primary now"))
        return found

    async def reachable(self) -> None:
        """Connect and close again: a plain socket, no set-up, no command (a stuck server
        still accepts, a dead one does not).

        Raises:
            ConnectionLost: it cannot be connected to.
        """
        await (await self._dial())[0].aclose()

    async def _dial(self) -> tuple[trio.abc.Stream, tuple[str, int] | None]:
        """A connected stream, and the address it went to (a Sentinel's answer)."""
        t = self._target
        if t.sentinels:
            host, port = await self._ask_sentinels()
        else:
            host, port = t.host, t.port
        try:
            with trio.fail_after(self._timeout_s):
                if t.path is not None:
                    return await trio.open_unix_socket(t.path), None
                return await trio.open_tcp_stream(host, port), (host, port)
        except trio.TooSlowError as exc:
            raise ConnectionLost(f"cannot connect: no answer in {self._timeout_s:g} s") from exc
        except OSError as exc:
            raise ConnectionLost(f"cannot connect: {exc.strerror or exc}") from exc

    async def _ask_sentinels(self) -> tuple[str, int]:
        """The primary's address (`sentinel.ask`); a new one is logged."""
        found, self._sentinel = await sentinel.ask(self._target, self._timeout_s,
                                                        self._sentinel)
        if found != self.primary:
            if self.primary is not None:
                logger.warning("the Sentinels name a new primary for %r: %s:%d (was %s:%d)",
                               self._target.master_name, *found, *self.primary)
            self.primary = found
        return found

    async def _open(self) -> tuple[Reader, tuple[str, int] | None]:
        """A connected stream, authenticated and set up (its replies read here)."""
        stream, address = await self._dial()
        try:
            return await self._set_up(stream), address
        except trio.TooSlowError as exc:
            await stream.aclose()
            raise ConnectionLost(f"no answer to the set-up within {self._timeout_s:g} s "
                                 "(a stopped server?)") from exc
        except BaseException:
            await stream.aclose()  # closes even when cancelled
            raise

    async def _set_up(self, stream: trio.abc.Stream) -> Reader:
        t = self._target
        commands: list[tuple[Any, ...]] = []
        if t.password is not None:
            commands.append(("AUTH", *([t.username] if t.username else []), t.password))
        commands += [("SELECT", t.db)] if t.db else []
        # Best-effort: a managed service or an ACL user may refuse it (its name only
        # helps an operator reading CLIENT LIST).
        commands.append(("CLIENT", "SETNAME", self._name))
        if t.sentinels:  # (what a Sentinel names may be out of date: a failover under way)
            commands.append(("ROLE",))
        with trio.fail_after(self._timeout_s):
            try:
                if t.ssl_context is not None:  # (a refused certificate is a broken stream)
                    stream = trio.SSLStream(stream, t.ssl_context, server_hostname=t.host)
                    await stream.do_handshake()
                reader = Reader(stream)
                await stream.send_all(b"".join(encode(c) for c in commands))
                for command in commands:
                    reply = await reader.reply()
                    if command == ("ROLE",):
                        sentinel.check_role(reply)
                    elif isinstance(reply, RespError) and command[0] != "CLIENT":
                        if reply.code in FAILOVER_CODES:
                            raise ConnectionLost(f"the server is not a usable primary now "
                                                 f"({reply})")
                        raise reply
            except _TRANSPORT as exc:  # (a refused certificate: the SSL error is the cause)
                raise ConnectionLost(f"setting up the connection: {exc.__cause__ or exc!r}"
                                     ) from exc
        return reader

    @asynccontextmanager
    async def subscribe(self, channel: str) -> AsyncIterator[Subscription]:
        """A subscription to ``channel`` on a connection of its own (raises as `execute`)."""
        reader, address = await self._open()
        try:
            confirmed = None
            with trio.move_on_after(self._timeout_s):
                try:
                    await reader.stream.send_all(encode(("SUBSCRIBE", channel)))
                    confirmed = await reader.reply()
                except _TRANSPORT as exc:
                    raise ConnectionLost(f"subscribing: {exc}") from exc
            if confirmed is None:
                raise ConnectionLost(f"no answer to SUBSCRIBE within {self._timeout_s:g} s")
            if isinstance(confirmed, RespError):
                raise confirmed
            yield Subscription(reader, address)
        finally:
            await reader.stream.aclose()  # closes even when cancelled


def open_client(url: str, *, timeout_s: float, name: str
                ) -> AbstractAsyncContextManager[Client]:
    """A `Client` for ``url`` until the ``async with`` ends (its connections close then).

    Raises:
        ValueError: the URL is not one this client can use (see the module docstring).
    """
    return _client(parse_url(url), timeout_s, name)


@asynccontextmanager
async def _client(target: CoordinationTarget, timeout_s: float, name: str) -> AsyncIterator[Client]:
    client = Client(target, timeout_s=timeout_s, name=name)
    try:
        yield client
    finally:
        await client.aclose()
