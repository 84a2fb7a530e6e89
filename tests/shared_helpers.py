"""Helpers of the shared-lane tests (SPEC L11): relay configs that share one provider
through a real ``redis-server``, and a fake upstream that counts how many requests it
serves at once."""

from __future__ import annotations

from typing import Any

from upstream import FakeUpstream

__all__ = ["Peak", "shared_config"]


def shared_config(up: FakeUpstream, url: str, relay_id: str, *, lanes: int = 4,
                  queue_max: int = 64, queue_timeout_s: float = 30, rpm: float = 0,
                  lease_s: float = 2.0, records: str = "records.jsonl",
                  extra: str = "") -> str:
    return f"""
[server]
records = "{records}"
coordination_url = "{url}"
relay_id = "{relay_id}"
coordination_lease_s = {lease_s}
[providers.up]
adapter = "openai"
base_url = "{up.url}"
models = ["m1", "slow"]
shared = true
[providers.up.profile]
lanes = {lanes}
queue_max = {queue_max}
queue_timeout_s = {queue_timeout_s}
run_timeout_s = 60
rpm = {rpm}
[providers.fake]
adapter = "fake"
models = ["echo"]
{extra}
"""


class Peak:
    """The most requests the upstream served at once, watched from its own counter."""

    def __init__(self, up: FakeUpstream) -> None:
        self.up = up
        self.peak = 0
        self.samples: list[int] = []
        original = up._set_active

        def set_active(delta: int) -> None:
            original(delta)
            self.peak = max(self.peak, up.active_responses())

        up._set_active = set_active  # type: ignore[method-assign]

    def __repr__(self) -> str:
        return f"Peak({self.peak})"


def body(model: str, **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], **extra}
