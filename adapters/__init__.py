"""The adapter registry: one line per adapter kind (SPEC L4).

A kind's profile travels with its class (``recommended_profile``); adding a kind is one
file plus one line here. Note: PyPI has an unrelated package also called ``adapters``;
the two cannot share one environment.
"""

from __future__ import annotations

from .base import Adapter
from .fake import FakeAdapter
from .openai_compat import OpenAIAdapter

__all__ = ["ADAPTERS", "Adapter"]

ADAPTERS: dict[str, type[Adapter]] = {
    FakeAdapter.kind: FakeAdapter,
    OpenAIAdapter.kind: OpenAIAdapter,
}
