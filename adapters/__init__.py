"""The adapter registry: one line per adapter kind (SPEC L4).

A kind's profile travels with its class (``recommended_profile``); adding a kind is one
file plus one line here. A kind's module is imported the first time it is looked up, so
a relay pays (in start-up time and memory) only for the kinds its config uses.

The repository keeps the adapters in its top-level ``adapters/`` folder; they are installed
as ``relay.adapters`` (setuptools' package-dir), so relay claims no global package name.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping

from relay.api.adapter import Adapter

__all__ = ["ADAPTERS", "Adapter"]

_KINDS: dict[str, str] = {
    "fake": "fake:FakeAdapter",
    "openai": "http.openai_compat:OpenAIAdapter",
    "anthropic": "http.anthropic:AnthropicAdapter",
    "gemini": "http.gemini:GeminiAdapter",
    "claude-cli": "cli.claude:ClaudeCLIAdapter",
    "codex-cli": "cli.codex:CodexCLIAdapter",
    "gemini-cli": "cli.gemini:GeminiCLIAdapter",
}


class _Registry(Mapping[str, type[Adapter]]):
    def __init__(self, kinds: dict[str, str]) -> None:
        self._kinds = kinds
        self._loaded: dict[str, type[Adapter]] = {}

    def __getitem__(self, kind: str) -> type[Adapter]:
        cls = self._loaded.get(kind)
        if cls is None:
            module, _, name = self._kinds[kind].partition(":")
            cls = getattr(importlib.import_module(f"{__name__}.{module}"), name)
            assert cls.kind == kind, f"adapter {name} says its kind is {cls.kind!r}"
            self._loaded[kind] = cls
        return cls

    def __iter__(self) -> Iterator[str]:
        return iter(self._kinds)

    def __len__(self) -> int:
        return len(self._kinds)


ADAPTERS: Mapping[str, type[Adapter]] = _Registry(_KINDS)
