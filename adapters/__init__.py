"""The adapter registry: one line per adapter kind (SPEC L4).

A kind's profile travels with its class (``recommended_profile``); adding a kind is one
file plus one line here. Note: PyPI has an unrelated package also called ``adapters``;
the two cannot share one environment.
"""

from __future__ import annotations

from .anthropic import AnthropicAdapter
from .base import Adapter
from .claude_cli import ClaudeCLIAdapter
from .codex_cli import CodexCLIAdapter
from .fake import FakeAdapter
from .gemini import GeminiAdapter
from .gemini_cli import GeminiCLIAdapter
from .openai_compat import OpenAIAdapter

__all__ = ["ADAPTERS", "Adapter"]

ADAPTERS: dict[str, type[Adapter]] = {
    FakeAdapter.kind: FakeAdapter,
    OpenAIAdapter.kind: OpenAIAdapter,
    AnthropicAdapter.kind: AnthropicAdapter,
    GeminiAdapter.kind: GeminiAdapter,
    ClaudeCLIAdapter.kind: ClaudeCLIAdapter,
    CodexCLIAdapter.kind: CodexCLIAdapter,
    GeminiCLIAdapter.kind: GeminiCLIAdapter,
}
