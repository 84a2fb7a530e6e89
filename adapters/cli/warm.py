"""Warm CLI processes (SPEC P2 "session" mode): the pool of at most ``lanes`` of them,
and the small JSON-RPC helper the codex and gemini protocols share. What may be reused
is decided by each process's `Wire` (``_session.py``). Used by `adapters._cli`."""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar

import attrs
import trio

from relay.vocab.errors import RelayError

from .answer import Outcome
from .process import REAP_S, ToolProcess
from .session import Event, Wire

__all__ = ["CLOSE_S", "Broken", "Rpc", "Turned", "Warm", "WarmPool", "refuse"]

logger = logging.getLogger(__name__)

CLOSE_S = 2.0   # closing the pool: how long a warm process may take to exit on its own

# --- warm processes ---------------------------------------------------------------------

W = TypeVar("W", bound="Warm")


@attrs.define(eq=False)
class Warm:
    """A warm process, its protocol state (`Wire`) and what its adapter knows about it."""

    tool: ToolProcess
    key: Any = None          # what it was started for (model, system prompt …)
    uses: int = 0
    state: dict[str, Any] = attrs.field(factory=dict)
    wire: Wire = attrs.field(factory=Wire)

    async def aclose(self) -> None:
        """Kill and reap it (bounded, shielded: `ToolProcess.aclose`)."""
        self.wire.handle(Event.CLOSE)
        await self.tool.aclose()


class WarmPool(Generic[W]):
    """At most ``size`` warm processes (SPEC P2): idle ones wait here between requests.

    `take` gives an idle process started for the same key, or starts one (retiring an
    idle one of another key when the pool is full); a process found dead is replaced.
    `give_back` keeps a process its `Wire` says may be reused; anything else is killed.

    Every process is in exactly one place: ``idle`` (the list), ``busy`` (taken: being
    made ready, or serving a request), or counted in ``starting``; each move between
    them happens with no checkpoint in between, so two takes never act on the same
    entry (one that awaits re-reads the list afterwards).
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self.idle: list[W] = []
        self.busy: set[W] = set()
        self.starting = 0   # processes being started
        self.closed = False
        self._slots = trio.Semaphore(size)
        self.started = 0  # processes ever started (tests: restarts)

    @property
    def total(self) -> int:
        return len(self.idle) + len(self.busy) + self.starting

    async def take(self, key: Any, start: Callable[[], Awaitable[W]],
                   ready: Callable[[W], Awaitable[bool]] | None = None) -> W:
        """An idle process for ``key``, made ready (``ready`` False, or its wire not
        ready: replace it), or a new one. Waits only when every process is busy (the lane
        normally prevents that)."""
        await self._slots.acquire()
        try:
            while True:
                dead = [w for w in self.idle if not w.tool.alive]
                if dead:   # taken out all at once, before any await
                    self.idle = [w for w in self.idle if w not in dead]
                    for warm in dead:
                        logger.info("warm %s process %d had exited (rc %s); replacing it",
                                    warm.tool.name, warm.tool.pid, warm.tool.returncode)
                        await warm.aclose()
                    continue   # the list may have changed meanwhile: look again
                match = next((w for w in self.idle if w.key == key), None)
                if match is None:
                    break
                self.idle.remove(match)
                self.busy.add(match)   # still counted while it is made ready
                try:
                    ok = (ready is None or await ready(match)) and match.wire.ready
                except BaseException:   # a stop while making it ready: it is nobody's now
                    self.busy.discard(match)
                    with trio.CancelScope(shield=True,
                                          deadline=trio.current_time() + 2 * REAP_S):
                        await match.aclose()
                    raise
                if ok:
                    return match
                self.busy.discard(match)
                await match.aclose()
            if self.total >= self.size and self.idle:
                await self.idle.pop(0).aclose()   # room for one of this key
            self.starting += 1
            try:
                warm = await start()
            finally:
                self.starting -= 1
            self.started += 1
            self.busy.add(warm)
            return warm
        except BaseException:
            self._slots.release()
            raise

    def give_back(self, warm: W, *, keep: bool) -> bool:
        """Return a taken process; kept only when ``keep``, it is alive, its wire says
        it may be reused and the pool is open. False: the caller must `Warm.aclose` it."""
        self.busy.discard(warm)
        self._slots.release()
        if keep and warm.tool.alive and warm.wire.keepable and not self.closed:
            warm.uses += 1
            self.idle.append(warm)
            return True
        return False

    async def aclose(self) -> None:
        """Close every idle process: stdin closed (each tool exits on that), then killed
        whatever is left after `CLOSE_S`. A process handed back later is not kept."""
        self.closed = True
        idle, self.idle = self.idle, []
        # (noqa, ASYNC912: an empty pool has nothing to await; the loops await each close.)
        with trio.CancelScope(shield=True), trio.move_on_after(CLOSE_S + REAP_S):  # noqa: ASYNC912
            for warm in idle:
                try:
                    await warm.tool.close_stdin()
                except trio.BrokenResourceError:
                    pass
            with trio.move_on_after(CLOSE_S):  # noqa: ASYNC912 (as above)
                for warm in idle:
                    await warm.tool.wait_exit()
            for warm in idle:
                await warm.aclose()
            for warm in list(self.busy):   # a copy: requests hand theirs back meanwhile
                await warm.tool.aclose()     # (its wire is its request's: it sees the end)



@attrs.define
class Turned:
    """A warm turn that reached its final event: the outcome or the tool's failure, and
    whether the process may serve the next request."""

    result: Outcome | RelayError
    keep: bool = True


class Broken(Exception):
    """A warm process died or broke mid-turn (its error says how)."""

    def __init__(self, error: RelayError) -> None:
        super().__init__(error.message)
        self.error = error


class Rpc:
    """Newline-delimited JSON-RPC with a warm tool (codex ``app-server``, gemini ACP).

    Every write and read goes through the process's `Wire` (a cut write leaves it out of
    sync). `read` returns the tool's next response or notification; requests *from* the
    tool (approvals, file access) are answered at once by ``answer`` — a plain answerer
    approves nothing — and never returned.
    """

    def __init__(self, tool: ToolProcess, wire: Wire, *, jsonrpc: bool,
                 answer: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
        self.tool = tool
        self.wire = wire
        self.jsonrpc = jsonrpc
        self.answer = answer
        self._next = 0

    def _frame(self, msg: dict[str, Any]) -> dict[str, Any]:
        return {"jsonrpc": "2.0", **msg} if self.jsonrpc else msg

    async def request(self, method: str, params: Any, event: Event = Event.SEND_CALL
                      ) -> int:
        """Send a request (``event``: what it is to the protocol); returns its id, which
        is the wire's `pending` once written."""
        self._next += 1
        line = self._frame({"id": self._next, "method": method, "params": params})
        await self.wire.send(event, functools.partial(self.tool.send_line, line),
                             reply_id=self._next)
        return self._next

    async def notify(self, method: str, params: Any = None,
                     event: Event = Event.SEND_NOTE) -> None:
        msg: dict[str, Any] = {"method": method}
        if params is not None:
            msg["params"] = params
        await self.wire.send(event, functools.partial(self.tool.send_line, self._frame(msg)))

    async def read(self) -> dict[str, Any] | None:
        while True:
            msg = await self.wire.receive(self.tool.receive_json)
            if msg is None:
                return None
            if "method" in msg and "id" in msg:   # the tool asks us something
                line = self._frame({"id": msg["id"], **self.answer(msg)})
                await self.wire.send(Event.SEND_ANSWER,
                                     functools.partial(self.tool.send_line, line))
                continue
            return msg

    async def wait_response(self, request_id: int,
                            on_message: Callable[[dict[str, Any]], Awaitable[None]] | None = None,
                            ) -> dict[str, Any] | None:
        """Read to the response to ``request_id`` (None: the output ended first);
        everything before it goes to ``on_message``. The caller tells the wire what the
        response was (a REPLY, a TURN_END)."""
        while True:
            msg = await self.read()
            if msg is None:
                return None
            if msg.get("id") == request_id and "method" not in msg:
                return msg
            if on_message is not None:
                await on_message(msg)


def refuse(msg: dict[str, Any]) -> dict[str, Any]:
    return {"error": {"code": -32601, "message": "relay runs this tool as a plain answerer "
                      f"and approves nothing ({msg.get('method')})"}}
