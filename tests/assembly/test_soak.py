"""The soak (SPEC C5): mixed traffic with 1 request in 17 cut off ends with nothing held.

CI runs it for 60 s (CI=true); a developer's run of the suite takes 8 s of it. The
seed's 10 minutes: ``python -m bench.soak --minutes 10``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.soak import soak


async def test_soak_leaves_no_lane_task_connection_or_record_behind() -> None:
    duration = 60.0 if os.environ.get("CI") == "true" else 8.0
    report = await soak(duration, quiet=True)
    assert report["problems"] == [], report
    assert report["requests"] > 100
    assert sum(report["cut"].values()) > 0
    assert all(s["running"] == 0 and s["queued"] == 0 for s in report["lanes"].values())
