"""Lane notices (SPEC A2): telling the writer that an attempt waits in its provider's
queue (`Queued`, so it sends waiting notices) and that the wait is over (`Started`).

Neither is ever dropped. A `Queued` that finds the writer's channel full goes as soon as
there is room, unless the wait ends first; once the writer may have been told that the
request waits, the next grant must say so before any token of that attempt, even if it
has to wait for room.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import trio

from relay.api import eager
from relay.vocab.events import LaneStatistics, Queued, Started

from .attempt import Run

__all__ = ["LaneNotices"]


class LaneNotices:
    """One dispatcher's notices to its writer (``out``)."""

    def __init__(self, nursery: trio.Nursery, out: trio.MemorySendChannel[Any]) -> None:
        self._nursery = nursery
        self._out = out
        # True from the moment the writer may have been told that this request waits in a
        # queue (a `Queued` sent, or on its way) until it is told the wait is over.
        self.waiting = False

    def queued(self, run: Run, statistics: Callable[[], LaneStatistics] | None = None
               ) -> None:
        """The attempt has to wait in its provider's queue (the lane calls this at once,
        synchronously), or at its client's gate (``statistics``: the gate's, SPEC L14):
        tell the writer, so it sends waiting notices."""
        run.queued_at = trio.current_time()
        if run.sink.closed:
            return
        notice = Queued(statistics or run.target.provider.lane.statistics)
        self.waiting = True  # told now or later: the grant must end the notices
        try:
            self._out.send_nowait(notice)
            return
        except trio.WouldBlock:
            pass
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            return  # the request is already over (its writer has gone)
        # The writer is behind (a slow client): the notice goes as soon as there is room,
        # unless the wait ends first (`drop`).
        run.notice = trio.CancelScope()
        self._nursery.start_soon(self._send_late, run.notice, notice)

    async def started(self, run: Run) -> None:
        """The attempt holds its slot. If the writer may be sending waiting notices, it
        must hear that the wait is over (never dropped), before any token of this
        attempt."""
        if self.waiting:
            run.poke()
            await eager.send(self._out, Started())
            self.waiting = False

    async def _send_late(self, scope: trio.CancelScope, notice: Queued) -> None:
        with scope:
            try:
                await self._out.send(notice)
            except (trio.ClosedResourceError, trio.BrokenResourceError):
                pass  # the request is over

    @staticmethod
    def drop(run: Run) -> None:
        """The wait is over: a `Queued` still on its way is not sent."""
        if run.notice is not None:
            run.notice.cancel()
            run.notice = None
