"""What a provider said about its limits on one answer (SPEC L12), as plain data.

An HTTP adapter reads the rate-limit headers of every answer — OpenAI's
``x-ratelimit-{limit,remaining,reset}-{requests,tokens}``, Anthropic's
``anthropic-ratelimit-{requests,tokens,input-tokens,output-tokens}-{limit,remaining,reset}``
— into a `RateLimits` and hands it to the engine: as an event sent into its sink before the
answer (stream or not), or on the `RelayError` of an error answer. A ``429`` that says when
(``retry-after``, ``retry-after-ms``, a reset header, the body's "try again in 2.1s",
Gemini's ``RetryInfo``) and a CLI tool's usage-window notice with its reset time carry a
``hold_s``: no start on that provider until then. The engine's budgets move to them
(`relay.capacity.budget`). Pure data; imports nothing of relay.
"""

from __future__ import annotations

import attrs

__all__ = ["KINDS", "RateLimits", "Window"]

# The budgets a provider meters: request starts, tokens (input and output together), and
# input and output tokens apart (Anthropic's ITPM and OTPM).
KINDS = ("requests", "tokens", "input", "output")


@attrs.frozen(slots=True)
class Window:
    """One budget as a header described it: its limit per minute, what remains, and in
    how many seconds it is whole again (None: not said)."""

    limit: float | None = None
    remaining: float | None = None
    reset_s: float | None = None


@attrs.frozen(slots=True)
class RateLimits:
    """What one answer said. ``windows``: by kind (`KINDS`). ``hold_s``: the provider said
    "no start for this long" (a 429 that says when, a usage-window notice); ``cause`` says
    who said it, in words (``retry-after: 12``, ``the body: try again in 2.1s``)."""

    windows: dict[str, Window] = attrs.field(factory=dict)
    hold_s: float | None = None
    cause: str = ""
    family: str = ""  # "openai", "anthropic": whose headers these were
    # Figures that could not be used (non-finite, negative, unparseable), each as
    # ``header: value``: ignored, and logged once per provider (SPEC L12a).
    ignored: tuple[str, ...] = ()
    # The 429 named the model it met (its body says so, or it carries the model's own
    # rate-limit headers): its hold is the model's, not the account's (SPEC L12a).
    names_model: bool = False
