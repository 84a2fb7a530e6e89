"""A CLI tool answers whatever a caller asks: relay's other secrets stay out of its
environment (found in review: a caller could ask a tool to print them)."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.assembled import config_from

from relay import adapters


@pytest.mark.parametrize(("kind", "own"), [("claude-cli", "ANTHROPIC_API_KEY"),
                                           ("codex-cli", "OPENAI_API_KEY"),
                                           ("gemini-cli", "GEMINI_API_KEY")])
def test_a_tool_gets_its_own_credentials_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              kind: str, own: str) -> None:
    for name in ("RELAY_TOKEN", "NVIDIA_API_KEY", "DASHSCOPE_API_KEY", "MY_SECRET",
                 "ANTHROPIC_API_KEY", "OPENAI_API_KEY", "GEMINI_API_KEY"):
        monkeypatch.setenv(name, "s3cret-" + name)
    monkeypatch.setenv("HARMLESS_SETTING", "1")
    config = config_from(f"""
[providers.tool]
adapter = "{kind}"
env = {{ EXPLICIT_TOKEN = "chosen" }}
""", tmp_path)
    adapter = adapters.ADAPTERS[kind](config.providers["tool"])
    env = adapter.environment()  # type: ignore[attr-defined]
    assert env[own] == "s3cret-" + own
    assert env["HARMLESS_SETTING"] == "1"
    assert env["EXPLICIT_TOKEN"] == "chosen"      # an explicit `env` setting wins
    for name in ("RELAY_TOKEN", "NVIDIA_API_KEY", "DASHSCOPE_API_KEY", "MY_SECRET"):
        assert name not in env
