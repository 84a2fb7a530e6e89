"""What an adapter is given (`Call`) and what it emits (`Delta`, `Finish`, `Usage`).

Every provider's answer is normalised to these few events (SPEC F8), so the writer, the
records and the fallback logic never see a provider's own wire format. An adapter sends
them to an `EventSink` and returns when the answer is complete; a call that ends without
a `Finish` for every choice is a cut-off answer, never a complete one (SPEC E4).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import attrs

from relay.vocab.errors import RelayError
from relay.vocab.limits import RateLimits

__all__ = ["AttemptStarted", "Call", "Delta", "Ended", "Event", "EventSink", "Finish",
           "Inbound", "LaneStatistics", "Queued", "RateLimits", "Recovered", "Skipped", "Started",
           "Usage"]


@attrs.frozen(kw_only=True)
class Inbound:
    """The client's own request, as far as the field policy (SPEC A1a) needs it beyond the
    chat-level ``params`` its dialect translated it into.

    dialect: the client's dialect (``openai`` chat, ``anthropic`` Messages, …). own: its
    fields that have no chat-level equivalent (Messages' ``thinking``,
    ``context_management``, …; nested ones by a dotted name, ``content.thinking``), which
    never reach a provider of another dialect. names: a chat-level param → the client's
    name for it where they differ (``stop`` ← ``stop_sequences``), so that what relay
    reports names the client's field. body, headers: the request as the client sent it
    (relay's own fields removed) and the headers of its dialect (``anthropic-beta``), for
    a provider that speaks that dialect: it gets them unchanged. turns: how many of the
    call's messages that body's conversation makes (a continuation relay adds, SPEC F8,
    comes after them). session: the client's marker of its conversation, if it sent one.
    """

    dialect: str = "openai"
    own: dict[str, Any] = attrs.field(factory=dict)
    names: dict[str, str] = attrs.field(factory=dict)
    body: dict[str, Any] | None = None
    headers: dict[str, str] = attrs.field(factory=dict)
    turns: int = 0
    # The client's own marker of its conversation (SPEC L13: a ``session_id`` header,
    # ``X-Relay-Session``, Claude Code's session header): never sent upstream.
    session: str | None = None


@attrs.frozen(kw_only=True)
class Call:
    """One attempt's request, as an adapter sees it.

    ``params`` holds every request field relay does not interpret itself (``max_tokens``,
    ``tools``, ``response_format``, ``seed``, …) in OpenAI's chat terms, exactly as the
    client sent them (or as its dialect translated them), so an OpenAI-compatible adapter
    can pass them through unchanged (SPEC A1). ``inbound`` is the rest of what the client
    sent (`Inbound`). Once an adapter has admitted a call (`relay.api.fields`), ``params``
    holds only what it honours.
    """

    request_id: str
    provider: str
    model: str
    messages: list[dict[str, Any]]
    stream: bool
    params: dict[str, Any] = attrs.field(factory=dict)
    # A ``/v1/responses`` request as sent (``previous_response_id`` expanded), for an
    # adapter that speaks Responses itself (``Capabilities.responses``: passed through);
    # every other adapter answers ``messages`` and ``params``, its translation (SPEC A7).
    responses: dict[str, Any] | None = None
    inbound: Inbound = attrs.field(factory=Inbound)


@attrs.frozen(slots=True)
class Delta:
    """A piece of one choice's answer: text, tool-call deltas (OpenAI's delta shape), and
    any other delta fields the provider sent (``reasoning_content``, ``refusal``, …)."""

    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    extra: dict[str, Any] | None = None
    index: int = 0


@attrs.frozen(slots=True)
class Finish:
    """The choice is complete. ``reason`` is OpenAI's ``finish_reason``: ``stop``,
    ``length`` (cut off: reported as such, SPEC E4), ``tool_calls``, ``content_filter``."""

    reason: str
    index: int = 0


@attrs.frozen(slots=True)
class Usage:
    """Token counts. ``estimated``: relay's own estimate, for a provider that reported none
    (SPEC A1a: ``stream_options.include_usage`` is honoured for every provider).

    ``prompt_tokens`` is every prompt token, as OpenAI counts it: cache reads and cache
    writes included. ``cache_read_tokens`` (read from the provider's prompt cache) and
    ``cache_write_tokens`` (written to it: Anthropic's ``cache_creation_input_tokens``)
    say how much of it was which (None: the provider did not say; SPEC L12a)."""

    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    total_tokens: int | None = None
    estimated: bool = False
    cache_read_tokens: int | None = None
    cache_write_tokens: int | None = None

    def plus(self, other: Usage) -> Usage:
        """Both counts together (a continued answer's attempts, SPEC L12a); a count
        neither side knows stays unknown, and an estimate in either makes an estimate."""
        def add(a: int | None, b: int | None) -> int | None:
            return None if a is None and b is None else (a or 0) + (b or 0)
        return Usage(add(self.prompt_tokens, other.prompt_tokens),
                     add(self.completion_tokens, other.completion_tokens),
                     add(self.total_tokens, other.total_tokens),
                     estimated=self.estimated or other.estimated,
                     cache_read_tokens=add(self.cache_read_tokens, other.cache_read_tokens),
                     cache_write_tokens=add(self.cache_write_tokens,
                                            other.cache_write_tokens))

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"prompt_tokens": self.prompt_tokens,
                               "completion_tokens": self.completion_tokens,
                               "total_tokens": self.total_tokens}
        if self.estimated:
            out["estimated"] = True
        if self.cache_read_tokens is not None:
            out["cache_read_tokens"] = self.cache_read_tokens
        if self.cache_write_tokens is not None:
            out["cache_write_tokens"] = self.cache_write_tokens
        return out


@attrs.frozen(slots=True)
class Skipped:
    """The provider sent something unreadable that relay skipped (a malformed stream
    event); it goes to the request's record, never to the client."""

    detail: str


@attrs.frozen(slots=True)
class Recovered:
    """The answer was salvaged (SPEC E3): the tool said the run completed and gave text,
    but also signalled an error at the end (``detail``, in its own words). The writer
    marks the request's record ``recovered``; the client sees the answer only."""

    detail: str


# `RateLimits` (the answer's rate-limit headers, SPEC L12) is for the engine's budgets:
# the attempt's sink keeps it and never hands it to the writer.
Event = Delta | Finish | Usage | Skipped | Recovered | RateLimits


class EventSink(Protocol):
    """Where an adapter sends its events. ``send`` may block (backpressure from a slow
    client) and is cancellable like every await."""

    async def send(self, event: Event) -> None: ...


@attrs.frozen
class LaneStatistics:
    """A lane's numbers at one moment (SPEC A3): what status, notices and tests read."""

    running: int
    capacity: int
    queued: int
    queue_max: int
    # What the head of the queue waits for besides a slot (SPEC L12): the provider's
    # token budget or a hold, in words with its numbers; None when only for a slot.
    waiting_for: str | None = None


# --- what the engine tells the writer besides the adapters' own events ----------------------

@attrs.frozen(slots=True)
class Queued:
    """The attempt has to wait in its provider's queue; ``statistics`` reads that lane's
    numbers whenever the writer has a waiting notice to send."""

    statistics: Callable[[], LaneStatistics]


@attrs.frozen(slots=True)
class Started:
    """The attempt holds a slot; the adapter is running."""


@attrs.frozen(slots=True)
class AttemptStarted:
    """A new attempt begins. ``continues``: it continues the text already sent (prefill);
    otherwise whatever an earlier attempt produced is void."""

    model: str  # "provider/model", as the answer reports it
    continues: bool
    # The client's advisory fields this target drops (SPEC A1a), for the answer's
    # X-Relay-Ignored-Fields and the record.
    ignored: tuple[str, ...] = ()


@attrs.frozen(slots=True)
class Ended:
    """The request's outcome is known; ``error`` says how it failed."""

    error: RelayError | None
