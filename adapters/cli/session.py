"""The warm-process protocol as an explicit state table (SPEC P2, C2, L6).

Theory of operation. A warm tool process (codex ``app-server``, gemini ``--acp``, claude
``--input-format stream-json``) is one conversation over two pipes: relay writes
newline-framed messages to the tool's stdin, the tool writes lines to its stdout. A
process may serve the next request only when both pipes are at a message boundary and
the tool owes relay nothing — no reply, no turn. `Wire` is that knowledge, kept in one
place, in the manner of h11's ``_state.py``: a state, events that move it, and a table
(`TRANSITIONS`) that says which event is legal in which state. The table drives the
behaviour: the pool asks `Wire.keepable` / `Wire.ready` whether a process may be reused,
and each adapter's interrupt asks `Wire.state` / `Wire.pending` what is outstanding.
An event the table does not allow is a bug in relay: `ProtocolError`, and the wire is
out of sync from then on (never reused).

States::

    IDLE            at a message boundary, nothing outstanding: may take a request
    WRITING         a message is being written to stdin (then: the state it leads to)
    AWAITING_REPLY  a call was written (thread/start, session/new); its reply is due
    IN_TURN         a turn runs; its final event is due (codex: maybe turn/start's reply)
    INTERRUPTING    the tool's own interrupt was sent; the turn's final event is due
    CLEARING        claude: ``/clear`` was written; its result is due (read before reuse)
    OUT_OF_SYNC     a write or read was cut mid-message: stdin holds half a line, or the
                    output can no longer be framed. Never reused: it is closed
    CLOSED          relay closed it, or its output ended

Why a cut *write* is out of sync: trio's ``send_all`` may have written any prefix of the
line when a stop lands; the tool then reads that prefix glued onto the next request's
first line and never answers it (the bug this module exists for: a prompt over 64 KiB,
the pipe's buffer, stopped mid-write). Why a cancelled *read* is not: `ToolProcess`'s
reads are cancellable without loss (bytes already read stay buffered, trio's
``receive_some`` takes nothing when cancelled), so the interrupt can go on reading where
the turn stopped. A read that fails any other way (an over-long line, a broken pipe) is
a cut.

Everything here is synchronous except `Wire.send` and `Wire.receive`, which wrap one
write or one read with the events they imply.
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import trio

__all__ = ["KEEPABLE", "TRANSITIONS", "Event", "ProtocolError", "State", "Wire"]

T = TypeVar("T")


class State(enum.Enum):
    IDLE = "idle"
    WRITING = "writing"
    AWAITING_REPLY = "awaiting-reply"
    IN_TURN = "in-turn"
    INTERRUPTING = "interrupting"
    CLEARING = "clearing"
    OUT_OF_SYNC = "out-of-sync"
    CLOSED = "closed"


class Event(enum.Enum):
    # relay writes (each goes through WRITING; WRITTEN or CUT ends the write)
    SEND_CALL = "send-call"            # a request whose reply is all of it
    SEND_TURN = "send-turn"            # a message that starts a turn
    SEND_INTERRUPT = "send-interrupt"  # the tool's own interrupt for the turn
    SEND_CLEAR = "send-clear"          # claude: /clear (a fresh conversation)
    SEND_ANSWER = "send-answer"        # an answer to a request from the tool
    SEND_NOTE = "send-note"            # a notification that changes nothing (initialized)
    WRITTEN = "written"                # the message is wholly written
    # the tool says
    REPLY = "reply"                    # the reply to `Wire.pending` came
    TURN_END = "turn-end"              # the turn's final event came (whatever its status)
    CLEARED = "cleared"                # claude: /clear's result came
    # either side
    CUT = "cut"                        # a write or read was cut mid-message
    CLOSE = "close"                    # closed by relay, or its output ended


class ProtocolError(Exception):
    """An event the table does not allow in the current state: a bug in relay."""


# Where each write leads once WRITTEN. Every other (state, event) pair below.
_SENDS: dict[State, dict[Event, State]] = {
    State.IDLE: {Event.SEND_CALL: State.AWAITING_REPLY, Event.SEND_TURN: State.IN_TURN,
                 Event.SEND_CLEAR: State.CLEARING, Event.SEND_NOTE: State.IDLE},
    State.AWAITING_REPLY: {Event.SEND_ANSWER: State.AWAITING_REPLY},
    State.IN_TURN: {Event.SEND_INTERRUPT: State.INTERRUPTING,
                    Event.SEND_ANSWER: State.IN_TURN},
    State.INTERRUPTING: {Event.SEND_ANSWER: State.INTERRUPTING},
}
_RECEIVES: dict[State, dict[Event, State]] = {
    State.AWAITING_REPLY: {Event.REPLY: State.IDLE},
    State.IN_TURN: {Event.REPLY: State.IN_TURN, Event.TURN_END: State.IDLE},
    State.INTERRUPTING: {Event.REPLY: State.INTERRUPTING, Event.TURN_END: State.IDLE},
    State.CLEARING: {Event.CLEARED: State.IDLE},
}

#: The whole table, (state, event) → next state. WRITING's WRITTEN leads to the state the
#: write was for (`_SENDS`); CUT leads every live state to OUT_OF_SYNC; CLOSE leads every
#: state to CLOSED.
TRANSITIONS: dict[tuple[State, Event], State] = {
    **{(s, e): State.WRITING for s, sends in _SENDS.items() for e in sends},
    **{(s, e): to for s, receives in _RECEIVES.items() for e, to in receives.items()},
    **{(s, Event.CUT): State.OUT_OF_SYNC for s in State if s is not State.CLOSED},
    (State.CLOSED, Event.CUT): State.CLOSED,   # a cut after the end changes nothing
    **{(s, Event.CLOSE): State.CLOSED for s in State},
}

#: States a process may be handed back to the pool in: at a message boundary, and what is
#: outstanding (claude's /clear result) is settled by the adapter's ``ready`` before the
#: next request uses it.
KEEPABLE = frozenset({State.IDLE, State.CLEARING})


class Wire:
    """The protocol state of one warm process (not shared: one task talks to it)."""

    def __init__(self) -> None:
        self.state = State.IDLE
        self.pending: Any = None   # the id of the request whose reply is due
        self._after: State | None = None   # while WRITING: the state the write leads to
        self._reply_id: Any = None          # while WRITING: the request id it carries

    def __repr__(self) -> str:
        return f"<Wire {self.state.value} pending={self.pending!r}>"

    @property
    def keepable(self) -> bool:
        """May go back to the pool (`KEEPABLE`)."""
        return self.state in KEEPABLE

    @property
    def ready(self) -> bool:
        """May take a request now."""
        return self.state is State.IDLE

    @property
    def in_sync(self) -> bool:
        """Both pipes are at a message boundary: the tool's own interrupt can be sent."""
        return self.state not in (State.WRITING, State.OUT_OF_SYNC, State.CLOSED)

    def handle(self, event: Event, *, reply_id: Any = None) -> State:
        """Move by ``event`` (``reply_id``: the id the request being sent carries, which
        its REPLY will answer). Synchronous: no checkpoint.

        Raises:
            ProtocolError: the table does not allow ``event`` now (the wire is then out
                of sync: never reused).
        """
        was = self.state
        if was is State.WRITING and event is Event.WRITTEN:
            assert self._after is not None
            to = self._after
            if self._reply_id is not None:
                self.pending = self._reply_id
        else:
            found = TRANSITIONS.get((was, event))
            if found is None or (event is Event.REPLY and self.pending is None):
                if was is not State.CLOSED:
                    self.state = State.OUT_OF_SYNC
                    self.pending = None
                what = "no request is waiting for one" if found is not None else \
                    f"not allowed in state {was.value}"
                raise ProtocolError(f"warm process protocol: {event.value}: {what}")
            to = found
            if to is State.WRITING:
                self._after = _SENDS[was][event]
                self._reply_id = reply_id
            elif event is Event.REPLY:
                self.pending = None
        if to is not State.WRITING:
            self._after = self._reply_id = None
        if to in (State.IDLE, State.CLEARING, State.OUT_OF_SYNC, State.CLOSED):
            self.pending = None    # nothing can be due any more
        self.state = to
        return to

    async def send(self, event: Event, write: Callable[[], Awaitable[None]], *,
                   reply_id: Any = None) -> None:
        """One write of ``event``'s message: WRITING until ``write`` returns, then the
        state it leads to; any other way out of ``write`` (a stop, a broken pipe) is a
        CUT and the exception goes on.

        Raises:
            ProtocolError: ``event`` is not allowed now (nothing is written).
        """
        # A stop that is already due lands here, before a byte is written: still in sync.
        await trio.lowlevel.checkpoint_if_cancelled()
        self.handle(event, reply_id=reply_id)
        try:
            await write()
        except BaseException:
            self.handle(Event.CUT)
            raise
        self.handle(Event.WRITTEN)

    async def receive(self, read: Callable[[], Awaitable[T]]) -> T:
        """One read: a cancelled read changes nothing (reads are lossless); a failed one
        is a CUT. An end of output (None) is CLOSE."""
        try:
            got = await read()
        except trio.Cancelled:
            raise
        except BaseException:
            self.handle(Event.CUT)
            raise
        if got is None:
            self.handle(Event.CLOSE)
        return got
