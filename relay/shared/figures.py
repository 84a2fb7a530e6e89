"""A shared lane's figures as of now (SPEC L11): what the status and ``/metrics`` read.

A relay learns a shared lane's global running and queued from every reply of the
coordination server (each script's reply carries them: grants, releases, renewals). A
relay whose requests all wait, or that sends none, hears nothing between its renewals
(every ``lease / 4``: 2.5 s by default), and its figures were that old: 1.5 s into a
burst its status could say ``running 0, queued 120`` while four ran upstream. So a
status or metrics read first asks the server (`refresh`): one read-only script (`COUNTS`)
per shared lane, all at once, bounded by one command's time; a server that does not
answer then leaves the last figures (never a slow or failed status).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Protocol, runtime_checkable

import trio

from relay.vocab.errors import RelayError

__all__ = ["COUNTS", "Counted", "refresh"]

logger = logging.getLogger(__name__)

# KEYS: a lane's keys (`relay.shared.lane_scripts`: H, W, …). Read only: the holders and
# the waiters as the server counts them now.
COUNTS = r"""
return {redis.call('ZCARD', KEYS[1]), redis.call('ZCARD', KEYS[2])}
"""


@runtime_checkable
class Counted(Protocol):
    """A lane whose figures a status read refreshes (`SharedLane`, `SharedAccounts`)."""

    async def refresh_figures(self) -> None: ...


async def refresh(lanes: Iterable[object], timeout_s: float = 0.5) -> None:
    """Refresh every shared lane of ``lanes`` at once (others are left alone), within
    ``timeout_s``; a lane the server does not answer for keeps its last figures."""
    counted = [lane for lane in lanes if isinstance(lane, Counted)]
    if not counted:
        await trio.lowlevel.checkpoint()
        return

    async def one(lane: Counted) -> None:
        try:
            await lane.refresh_figures()
        except RelayError as exc:
            logger.debug("shared lane figures not refreshed: %s", exc.message)

    with trio.move_on_after(timeout_s):
        async with trio.open_nursery() as nursery:
            for lane in counted:
                nursery.start_soon(one, lane)
