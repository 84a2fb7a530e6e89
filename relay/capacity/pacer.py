"""The rpm pacer (SPEC L9): at most ``rpm`` starts in any 60 s, on a sliding window.

A burst below ``rpm`` starts at once, as a provider's own request limit lets it (a
continuous bucket of ``rpm`` requests, a fixed minute or a sliding one: a sliding window
is inside all three), and no minute ever holds more than ``rpm`` starts, however they
fall. The shared lanes' pacer (`relay.shared.lane_scripts`) is the same rule on the
coordination server.
"""

from __future__ import annotations

import bisect
import math

__all__ = ["Pacer"]


class Pacer:
    """At most ``rpm`` starts in any 60 s (SPEC L9): a sliding window over the starts.

    ``rpm`` below 1, or with a fraction, is read as its rate: at most ``n = max(1,
    floor(rpm))`` starts in any ``60 n / rpm`` s (``rpm = 0.5``: one start in any 120 s).
    It keeps the start times of the last minute (older ones can never hold a start back
    again), so a start handed straight back can be forgotten exactly, and a reloaded
    ``rpm`` applies at once to the starts already made.
    """

    __slots__ = ("_starts",)

    def __init__(self, starts: list[float] | None = None) -> None:
        self._starts: list[float] = starts or []  # ascending

    @staticmethod
    def window(rpm: float) -> tuple[int, float]:
        """``(n, seconds)``: at most n starts in any window of that many seconds."""
        n = max(1, math.floor(rpm))
        return n, 60.0 * n / rpm

    def next_start(self, rpm: float) -> float:
        """The earliest time the next start may be made (-inf: now)."""
        if rpm <= 0:
            return -math.inf
        n, span = self.window(rpm)
        return self._starts[-n] + span if len(self._starts) >= n else -math.inf

    def add(self, at: float) -> None:
        starts = self._starts
        starts.append(at)
        # Older than 60 s, a start never counts again but as the last one (n starts in
        # 60 n / rpm s: n >= 2 spans at most 60 s), whatever rpm a reload brings.
        if starts[0] < at - 60.0:
            del starts[:bisect.bisect_left(starts, at - 60.0)]

    def remove(self, at: float) -> None:
        """Forget one start made at ``at`` (a grant handed straight back)."""
        i = bisect.bisect_left(self._starts, at)
        if i < len(self._starts) and self._starts[i] == at:
            del self._starts[i]

    def copy(self, now: float) -> Pacer:
        """A copy on a clock that reads 0 at ``now`` (for a simulation)."""
        return Pacer([t - now for t in self._starts])

