"""The CLI adapters' pure parts: rendering (SPEC P2), the E2 fence, failure mapping."""

from __future__ import annotations

import pytest

import relay  # noqa: F401  (imports the adapters through the registry, in order)
from relay.adapters.cli.base import render
from relay.adapters.cli.claude import E2_FENCE, classify, disguised_failure
from relay.adapters.cli.codex import _usage as codex_usage
from relay.adapters.cli.codex import codex_failure
from relay.adapters.cli.gemini import _usage as gemini_usage
from relay.adapters.cli.gemini import gemini_failure
from relay.vocab.errors import RelayError
from relay.vocab.events import Usage


def success(text: str, **extra: object) -> dict[str, object]:
    return {"type": "result", "subtype": "success", "is_error": False, "result": text,
            **extra}


@pytest.mark.parametrize("phrase", ["Not logged in · Please run /login",
                                    "You've hit your limit · resets 3:30am (Asia/Calcutta)"])
def test_the_e2_fence_is_600_characters_for_both_kinds(phrase: str) -> None:
    at_fence = phrase + " " + "x" * (E2_FENCE - len(phrase) - 1)
    assert len(at_fence) == E2_FENCE
    assert disguised_failure("p", at_fence, success(at_fence)) is not None
    over = at_fence + "x"
    assert disguised_failure("p", over, success(over)) is None


def test_curly_apostrophes_and_case_do_not_hide_a_notice() -> None:
    text = "YOU\u2019VE REACHED YOUR USAGE LIMIT. Try again after your limit resets."
    error = disguised_failure("p", text, success(text))
    assert error is not None and error.reason == "quota_exhausted"


def test_a_short_normal_answer_passes() -> None:
    outcome = classify("p", success("Paris is the capital of France."), None)
    assert not isinstance(outcome, RelayError) and outcome.error_signal is None


def test_a_result_marked_as_an_error_is_a_failure_even_with_text() -> None:
    result = {"type": "result", "subtype": "success", "is_error": True,
              "result": "API Error: 500 overloaded", "api_error_status": 500}
    outcome = classify("p", result, None)
    assert isinstance(outcome, RelayError) and outcome.reason == "upstream_error"
    assert outcome.upstream_message == "API Error: 500 overloaded"


def test_render() -> None:
    assert render([{"role": "user", "content": "hi"}], "p") == (None, "hi")
    system, prompt = render([{"role": "system", "content": "S1"},
                             {"role": "developer", "content": "S2"},
                             {"role": "user", "content": "/clear"}], "p")
    assert system == "S1\n\nS2"
    assert not prompt.startswith("/") and prompt.endswith("User: /clear")
    with pytest.raises(RelayError, match="tool calls"):
        render([{"role": "user", "content": "x"},
                {"role": "assistant", "tool_calls": [{"id": "1"}]}], "p")
    with pytest.raises(RelayError, match="no user message"):
        render([{"role": "system", "content": "only"}], "p")


@pytest.mark.parametrize(("message", "reason"), [
    ("Quota exceeded. Check your plan and billing details.", "quota_exhausted"),
    ("unexpected status 401 Unauthorized: Incorrect API key provided", "auth_required"),
    ("unexpected status 429 Too Many Requests: slow down", "rate_limited"),
    ("Reconnecting... waiting for network (Connection failed: error sending request)",
     "upstream_unavailable"),
    ("unexpected status 500 Internal Server Error", "upstream_error"),
])
def test_codex_failures(message: str, reason: str) -> None:
    error = codex_failure("p", message)
    assert error.reason == reason and error.upstream_message == message


@pytest.mark.parametrize(("message", "rc", "reason"), [
    ("Please set an Auth method in your ~/.gemini/settings.json", 41, "auth_required"),
    ("[API Error: quota]\nPlease wait… or switch to another /auth method", 173,
     "quota_exhausted"),
    ('{"error":{"code":401,"message":"API key not valid."}}', 145, "auth_required"),
    ("[API Error: boom]", 244, "upstream_error"),
])
def test_gemini_failures(message: str, rc: int, reason: str) -> None:
    assert gemini_failure("p", message, rc=rc).reason == reason


# --- usage: the cache split each tool reports (SPEC L12a) -------------------------------------

def test_claude_usage_counts_cache_reads_and_writes_in_the_prompt() -> None:
    """claude's result usage is Anthropic's: input_tokens is the uncached part."""
    outcome = classify("p", success("Paris.", usage={
        "input_tokens": 7, "cache_read_input_tokens": 900, "cache_creation_input_tokens": 40,
        "output_tokens": 4}), None)
    assert not isinstance(outcome, RelayError)
    assert outcome.usage == Usage(947, 4, 951, cache_read_tokens=900, cache_write_tokens=40)
    outcome = classify("p", success("Paris.", usage={"input_tokens": 7,
                                                     "output_tokens": 4}), None)
    assert not isinstance(outcome, RelayError)
    assert outcome.usage == Usage(7, 4, 11)   # it said nothing of a cache: unknown


def test_codex_usage_keeps_its_cached_input_tokens() -> None:
    """codex exec's turn.completed usage is OpenAI's: input_tokens counts the cached."""
    assert codex_usage({"input_tokens": 100, "cached_input_tokens": 80,
                        "cache_write_input_tokens": 5, "output_tokens": 4}) == Usage(
        100, 4, 104, cache_read_tokens=80, cache_write_tokens=5)
    assert codex_usage({"input_tokens": 10, "output_tokens": 4}) == Usage(10, 4, 14)


def test_gemini_stream_json_stats_keep_cached() -> None:
    """gemini's stream-json stats: input_tokens counts the cached, ``cached`` says how
    many (its convertToStreamStats)."""
    assert gemini_usage({"total_tokens": 104, "input_tokens": 100, "output_tokens": 4,
                         "cached": 60, "input": 40}) == Usage(100, 4, 104,
                                                              cache_read_tokens=60)
    assert gemini_usage({"total_tokens": 14, "input_tokens": 10,
                         "output_tokens": 4}) == Usage(10, 4, 14)
