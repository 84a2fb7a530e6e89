"""What a shared lane tells a client or an operator when it refuses (SPEC L7, L11)."""

from __future__ import annotations

import math
from typing import Any

from relay.vocab.errors import RelayError
from relay.vocab.events import LaneStatistics

from .coordinator import LOST_FRACTION, Coordinator

__all__ = ["capacity_error", "lost_error", "mismatch_problem"]


def capacity_error(name: str, reason: str, stats: LaneStatistics, retry: float,
                   waited_s: float | None) -> RelayError:
    """``provider_queue_full`` / ``provider_queue_timeout`` with the global numbers."""
    numbers = (f"{stats.running}/{stats.capacity} running, {stats.queued} queued "
               f"(queue_max {stats.queue_max}) across every relay sharing it")
    if reason == "provider_queue_full":
        message = (f"shared provider {name!r} is at capacity: {numbers}. This request was "
                   f"not started. Retry in about {math.ceil(retry)} s, when earlier "
                   "requests (connection checks included) have finished.")
    else:
        message = (f"waited {waited_s or 0:.0f} s for earlier requests to shared provider "
                   f"{name!r} (connection checks included) to finish: {numbers}. This "
                   f"request was not started. Retry in about {math.ceil(retry)} s, once "
                   "they have finished.")
    return RelayError(reason, message, provider=name, retry_after_s=retry)


def lost_error(name: str, coord: Coordinator, *, taken_back: bool,
               waiting: bool) -> RelayError:
    """``coordination_lost``: a slot (or a place in the queue) whose lease ended."""
    what = "its place in the queue" if waiting else "its slot"
    why = ("the coordination server took it back (its lease had expired)" if taken_back
           else f"its lease could not be renewed within {coord.lease_s * LOST_FRACTION:g} s "
           f"({coord.down_reason})")
    return RelayError(
        "coordination_lost",
        f"shared provider {name!r}: this request lost {what}: {why}. It was stopped so "
        f"that no more than the provider's lanes run across relays. Retry in about "
        f"{math.ceil(coord.lease_s)} s.", provider=name, retry_after_s=coord.lease_s)


def mismatch_problem(name: str, mine: tuple[int, int, float], stored: list[Any],
                     coord: Coordinator) -> str:
    """A config problem: this relay's lanes/queue_max/rpm differ from the stored ones."""
    lanes, queue_max, rpm, set_by = stored
    return (f"[providers.{name}.profile]: shared provider {name!r} has lanes {mine[0]}, "
            f"queue_max {mine[1]}, rpm {mine[2]:g} here (relay {coord.relay_id!r}), but "
            f"relay {set_by!r} stored lanes {lanes}, queue_max {queue_max}, rpm "
            f"{float(rpm):g} on the coordination server (prefix {coord.prefix!r}); every "
            "relay sharing it must agree on lanes, queue_max and rpm")
