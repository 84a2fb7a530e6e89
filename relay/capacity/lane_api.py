"""The lane interface: what the dispatcher, the checks, status and metrics may ask a lane.

Two implementations keep the same contract (SPEC L6-L11): `relay.capacity.lanes.Lane`, a
provider's slots counted in this process, and `relay.shared.lane.SharedLane`, the
same slots, queue and pacer counted across every relay on one Redis/Valkey server
(``shared = true``). The dispatcher cannot tell them apart: ``async with
lane.slot(priority)`` waits (priority classes, turns between clients within a class,
``queue_max``, the queue timeout, the pacer) and holds one slot for the body, given back
only after the body — the adapter's scope, cleanup included — has exited. A grant that
races a cancel is handed back, never leaked. A shared lane may also end the body itself:
when this relay cannot renew the slot's lease in time, the body is cancelled and the
``async with`` raises ``coordination_lost`` (before the lease can expire on the server).

Turns between clients inside a class (SPEC L14) are both lanes' rule:
``slot(priority, client=..., weight=...)`` on a `Lane` and on a `SharedLane` (whose queue
on the coordination server takes the same turns across relays: docs/architecture.md,
"The queue's rule"); without a client, a request is ``default``'s (FIFO inside a class).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Protocol

from relay.vocab.events import LaneStatistics
from relay.vocab.profile import Profile

from .lanes import Ticket

__all__ = ["LaneLike"]


class LaneLike(Protocol):
    """A provider's lane, local or shared (see the module docstring)."""

    name: str

    @property
    def shared(self) -> bool:
        """Counted across relays (SPEC L11): the numbers below are then global."""

    @property
    def profile(self) -> Profile: ...

    @property
    def held_here(self) -> int:
        """Slots this relay holds right now."""

    def slot(self, priority: str = "normal", *, on_queued: Callable[[], None] | None = None,
             ) -> AbstractAsyncContextManager[Ticket]:
        """Hold one slot for the body of the ``async with``.

        Raises:
            RelayError: ``provider_queue_full``, ``provider_queue_timeout``; a shared
                lane also ``coordination_unavailable`` and ``coordination_lost``.
        """

    def statistics(self) -> LaneStatistics:
        """Running, capacity, queued, queue_max (a shared lane: every relay's)."""

    def estimate_wait_s(self) -> float:
        """When a request arriving now could expect to start, roughly."""

    def update_profile(self, profile: Profile) -> None:
        """A reload (SPEC L10): applied in place, running work untouched."""

    async def wait_idle(self) -> None:
        """Return once nothing runs or waits on this relay's side of the lane."""

    async def claim_check(self, interval_s: float) -> bool:
        """Whether this relay runs the provider's interval check now (a shared lane: one
        relay per interval across relays)."""
