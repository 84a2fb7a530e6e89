"""Every failure a client can see, as one small tree.

A failure is a `RelayError` with a stable ``reason``. The reason decides everything else:
the ``phase`` (which part of the path failed), the HTTP status, OpenAI's error ``type``,
and whether a retry could help. SPEC E1 is the table; `REASONS` below is that table in
code, and the only place it lives::

    RelayError(reason, message, ...)
      phase capacity    429  provider_queue_full, provider_queue_timeout   (+ Retry-After)
                        429  client_limit (a client's day or month is spent, L14: Retry-
                             After = the window's reset, up to a month)
                        400  request_too_large   (its own token estimate exceeds a per-
                             minute budget, L12: not retryable, fallback-eligible)
      phase quota       429  quota_exhausted                               (Retry-After 600)
      phase rate_limit  429  rate_limited                         (+ the provider's Retry-After)
      phase auth        502  auth_required                                 (upstream said 401/403)
      phase timeout     504  run_timeout, attempt_timeout, first_token_timeout,
                             stall_timeout, budget_exhausted
      phase upstream    502  upstream_unavailable, upstream_error, bad_upstream_response,
                             stream_cut
      phase rejected    400  context_too_long; rejected (the provider's own 4xx)
      phase request     4xx  unsupported, invalid_request, unknown_model, unauthorized,
                             forbidden_origin, bad_host, forbidden_model (403, L14)
      phase shutdown    503  shutting_down                                 (+ Retry-After)
      phase coordination 503 coordination_unavailable, coordination_lost  (+ Retry-After:
                             the lease; shared lanes' server unreachable, lease lost)
      phase internal    500  internal_error

    ConfigError         not a client's failure: the config file is wrong (exit 2)

Foreign exceptions are translated once, at the boundary where they happen, with
``raise RelayError(...) from exc``; nothing else in relay inspects httpx or OS errors.

The provider's words (SPEC E1): ``message`` (relay's summary followed by the provider's
words) and ``upstream_message`` (the words alone) are each kept whole up to
`MAX_WORDS_BYTES`; beyond, the head is kept with a marker giving the length read
(`cut_marker`: ``… [N bytes]``, or ``… [≥ N bytes]`` when reading stopped at a bound).
Secrets are redacted before the cut (`relay.vocab.redact`). Both happen here, once, when the
error is made, so every exit — the OpenAI and Anthropic bodies, in-band stream errors,
log lines, check warnings — carries the same bounded, redacted text.
"""

from __future__ import annotations

import math
import re
from typing import Any, Final

import attrs

from .limits import RateLimits
from .redact import head, redact, redact_obj

__all__ = ["DEFAULT_ACTIONS", "MAX_RETRY_AFTER_S", "MAX_WORDS_BYTES", "REASONS", "ConfigError",
           "Reason", "RelayError", "bound_text", "cut_marker", "excerpt", "untraced"]

MAX_WORDS_BYTES: Final = 64 * 1024  # SPEC E1: the provider's words are whole up to this
MAX_RETRY_AFTER_S: Final = 86_400.0  # SPEC L12a: no Retry-After says more than a day


@attrs.frozen
class Reason:
    phase: str
    status: int
    type: str
    # x-should-retry: only where waiting and sending the same request again can help.
    should_retry: bool = False
    retry_after_s: float | None = None  # fixed Retry-After for this reason, if any


REASONS: Final[dict[str, Reason]] = {
    "provider_queue_full": Reason("capacity", 429, "rate_limit_error", True),
    "provider_queue_timeout": Reason("capacity", 429, "rate_limit_error", True),
    # SPEC L12: could never start here (a larger tier may take it: fallback-eligible).
    "request_too_large": Reason("capacity", 400, "invalid_request_error"),
    "quota_exhausted": Reason("quota", 429, "insufficient_quota", False, 600.0),
    "rate_limited": Reason("rate_limit", 429, "rate_limit_error", True),
    "auth_required": Reason("auth", 502, "authentication_error"),
    "run_timeout": Reason("timeout", 504, "timeout_error"),
    "attempt_timeout": Reason("timeout", 504, "timeout_error"),
    "first_token_timeout": Reason("timeout", 504, "timeout_error"),
    "stall_timeout": Reason("timeout", 504, "timeout_error"),
    "budget_exhausted": Reason("timeout", 504, "timeout_error"),
    "upstream_unavailable": Reason("upstream", 502, "server_error"),
    "upstream_error": Reason("upstream", 502, "server_error"),
    "bad_upstream_response": Reason("upstream", 502, "server_error"),
    "stream_cut": Reason("upstream", 502, "server_error"),
    "context_too_long": Reason("rejected", 400, "invalid_request_error"),
    "rejected": Reason("rejected", 400, "invalid_request_error"),
    "unsupported": Reason("request", 400, "invalid_request_error"),
    "invalid_request": Reason("request", 400, "invalid_request_error"),
    "unknown_model": Reason("request", 404, "invalid_request_error"),
    "unauthorized": Reason("request", 401, "authentication_error"),
    "forbidden_origin": Reason("request", 403, "invalid_request_error"),
    "bad_host": Reason("request", 403, "invalid_request_error"),
    "shutting_down": Reason("shutdown", 503, "server_error", False, 5.0),
    # SPEC L11: a shared lane's server (Redis/Valkey) is unreachable, or this relay could
    # not renew a slot's lease in time; Retry-After is the lease (``coordination_lease_s``).
    "coordination_unavailable": Reason("coordination", 503, "server_error", True),
    "coordination_lost": Reason("coordination", 503, "server_error", True),
    "internal_error": Reason("internal", 500, "server_error"),
    # SPEC L14, O7: a client's per-day or per-month limit is spent (Retry-After: the
    # window's reset, up to a month away); a client names a model outside its list.
    "client_limit": Reason("capacity", 429, "rate_limit_error", True),
    "forbidden_model": Reason("request", 403, "invalid_request_error"),
}
MAX_WINDOW_RETRY_AFTER_S: Final = 32 * 86_400.0  # client_limit: a month's reset


# What to do next (``action``) for the reasons where a person can act (issue 15). The
# place that raises one says it true to its cause (the address nothing listens on, the
# profile key to raise, with its value); these are the fallback when it has nothing more
# to say, so none of these errors goes out with "action": null. A capacity failure never
# says "check the connection" (SPEC L7: that advice made seed 000's jam worse).
DEFAULT_ACTIONS: Final[dict[str, str]] = {
    "provider_queue_full": "retry after the time in Retry-After; if the queue is often "
                           "full, raise queue_max (or lanes, if the provider really runs "
                           "more at once) in [providers.{provider}.profile]",
    "provider_queue_timeout": "retry after the time in Retry-After; if requests often wait "
                              "this long, raise queue_timeout_s (or lanes) in "
                              "[providers.{provider}.profile]",
    "client_limit": "wait for the window's reset (Retry-After), or raise the client's "
                    "limit in [clients.NAME]",
    "request_too_large": "shorten the conversation or lower max_tokens, or send it to a "
                         "provider with a larger budget (a route's fallback may)",
    "auth_required": "check the provider's API key or login, then retry",
    "run_timeout": "if calls really take this long, raise run_timeout_s in "
                   "[providers.{provider}.profile]; otherwise ask for a shorter answer",
    "attempt_timeout": "raise the route's primary_timeout_s or fallback_timeout_s, or ask "
                       "for a shorter answer",
    "first_token_timeout": "raise the route's first_token_timeout_s if the model is slow "
                           "to start (a long prompt, a model still loading)",
    "stall_timeout": "raise the route's stall_timeout_s if the model pauses this long "
                     "between tokens",
    "budget_exhausted": "raise the route's budget_s, or shorten its attempt timeouts so "
                        "that its fallbacks get their turn",
    "upstream_unavailable": "check that provider {provider} is running and reachable "
                            "(`relay check {provider}` tries it), then retry",
    "unknown_model": "use a model that GET /v1/models lists: a route name, PROVIDER/MODEL, "
                     "or a bare model name that one provider lists",
}


def cut_marker(length: int, *, at_bound: bool = False) -> str:
    """The marker that ends cut words: ``… [N bytes]`` (N: the whole text's UTF-8
    length), or ``… [≥ N bytes]`` when reading stopped at a bound after N bytes."""
    return f"… [{'≥ ' if at_bound else ''}{length} bytes]"


_MARKER = re.compile(r"… \[(≥ )?(\d+) bytes\]\Z")


def excerpt(text: str, n: int) -> str:
    """The first ``n`` characters of upstream text, for a message or a record: redacted
    before the cut (a secret straddling it leaves nothing behind)."""
    return head(text, n)


def _utf8_len(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode())


def bound_text(text: str, limit: int = MAX_WORDS_BYTES) -> str:
    """``text`` whole if its UTF-8 form fits in ``limit`` bytes; else its head and a
    `cut_marker`, together at most ``limit`` bytes.

    A text that already ends with a marker (a body whose reading stopped at a bound, or
    one cut before) keeps that marker's length: cutting twice says what the first read.
    """
    if len(text) * 4 <= limit or _utf8_len(text) <= limit:
        return text
    offset = max(0, len(text) - 40)
    tail = _MARKER.search(text, offset)
    if tail is not None:
        head = text[:tail.start()]
        marker = cut_marker(int(tail[2]), at_bound=tail[1] is not None)
    else:
        head, marker = text, cut_marker(_utf8_len(text))
    room = max(0, limit - len(marker.encode()))
    # Cut on a character boundary: at most ``room`` bytes of the head.
    return head[:room].encode()[:room].decode("utf-8", "ignore") + marker


class RelayError(Exception):
    """A failure with a stable reason; see the module docstring for the tree.

    Args:
        reason: a key of `REASONS`.
        message: what happened and what to do, for a person.
        status: overrides the reason's status (a provider's own 4xx for ``rejected``;
            413/415/408 for bodies that are too large, not JSON, or too slow).
        provider: the provider that failed, if any.
        retry_after_s: when a retry may help; becomes ``Retry-After``.
        action: what the user should do (``auth_required``: how to log in); without
            one, the reason's `DEFAULT_ACTIONS` entry, if it has one.
        upstream_status, upstream_message: the provider's own status and words.
        param: the request field at fault, as OpenAI's ``param``.
        limits: what the provider's answer said of its limits (its rate-limit headers,
            and for a 429 that said when, the hold; SPEC L12), for the engine's budgets.

    ``message`` and ``upstream_message`` are redacted and then bounded (the module
    docstring): where the provider's words appear inside ``message``, it is they that are
    cut, so relay's own summary before them and its advice after them stay whole.
    """

    def __init__(
        self,
        reason: str,
        message: str,
        *,
        status: int | None = None,
        provider: str | None = None,
        retry_after_s: float | None = None,
        action: str | None = None,
        upstream_status: int | None = None,
        upstream_message: str | None = None,
        param: str | None = None,
        limits: RateLimits | None = None,
        _words_in_message: str | None = None,
    ) -> None:
        if reason not in REASONS:
            raise ValueError(f"unknown relay error reason {reason!r}")
        message = redact(message)
        words = redact(upstream_message) if upstream_message is not None else None
        slot = _words_in_message if _words_in_message is not None else words
        self.upstream_message = bound_text(words) if words is not None else None
        self.message, self._words_in_message = _bound_message(message, slot,
                                                              self.upstream_message)
        super().__init__(self.message)
        spec = REASONS[reason]
        self.reason = reason
        self.status = status if status is not None else spec.status
        self.provider = provider
        self.retry_after_s = retry_after_s if retry_after_s is not None else spec.retry_after_s
        if action is None and reason in DEFAULT_ACTIONS:
            action = DEFAULT_ACTIONS[reason].format(provider=provider or "NAME")
        self.action = redact(action) if action is not None else None
        self.upstream_status = upstream_status
        self.param = param
        self.limits = limits

    @property
    def retry_after_s(self) -> float | None:
        """When a retry may help, in seconds: never non-finite, negative or past a day
        (SPEC L12a: a provider's ``retry-after: 1e400`` reaches no client)."""
        return self._retry_after_s

    @retry_after_s.setter
    def retry_after_s(self, value: float | None) -> None:
        most = (MAX_WINDOW_RETRY_AFTER_S if getattr(self, "reason", None) == "client_limit"
                else MAX_RETRY_AFTER_S)
        self._retry_after_s = (None if value is None or math.isnan(value)
                               else min(max(0.0, value), most))

    @property
    def phase(self) -> str:
        return REASONS[self.reason].phase

    @property
    def type(self) -> str:
        return REASONS[self.reason].type

    @property
    def should_retry(self) -> bool:
        return REASONS[self.reason].should_retry

    def __repr__(self) -> str:
        return f"RelayError({self.reason!r}, {self.message!r})"

    def with_message(self, message: str) -> RelayError:
        """The same failure, told differently (e.g. with the attempts that led to it)."""
        return RelayError(self.reason, message, status=self.status, provider=self.provider,
                          retry_after_s=self.retry_after_s, action=self.action,
                          upstream_status=self.upstream_status,
                          upstream_message=self.upstream_message, param=self.param,
                          limits=self.limits, _words_in_message=self._words_in_message)

    def body(self) -> dict[str, Any]:
        """The OpenAI-shaped error body (SPEC E1): the words bounded as the module
        docstring says, every string redacted (the serializer is an exit too)."""
        return redact_obj({
            "error": {
                "message": self.message,
                "type": self.type,
                "code": self.reason,
                "param": self.param,
                "relay": {
                    "phase": self.phase,
                    "reason": self.reason,
                    "provider": self.provider,
                    "retry_after_s": self.retry_after_s,
                    "action": self.action,
                    "upstream_status": self.upstream_status,
                    "upstream_message": self.upstream_message,
                },
            }
        })

    def headers(self) -> list[tuple[bytes, bytes]]:
        """``x-should-retry`` always; ``Retry-After`` (whole seconds) where it helps."""
        out = [(b"x-should-retry", b"true" if self.should_retry else b"false")]
        if self.retry_after_s is not None and (self.should_retry or self.phase in
                                               ("quota", "shutdown")):
            seconds = max(1, math.ceil(self.retry_after_s))
            out.append((b"retry-after", str(seconds).encode()))
        return out


def _bound_message(message: str, slot: str | None,
                   words: str | None) -> tuple[str, str | None]:
    """``message`` bounded; returns it and the words as they now appear inside it.

    ``slot`` is the provider's words as they appear in ``message`` (whole, or as cut
    before); they are re-cut from ``words`` (the bounded ``upstream_message``) to the room
    the rest of the message leaves.
    """
    if _utf8_len(message) <= MAX_WORDS_BYTES:
        return message, slot if slot and slot in message else None
    if slot and words and len(slot) > 64 and slot in message:
        before, _, after = message.partition(slot)
        room = MAX_WORDS_BYTES - _utf8_len(before) - _utf8_len(after)
        if room >= 256:
            fitted = bound_text(words, room)
            return before + fitted + after, fitted
    return bound_text(message), None


class ConfigError(Exception):
    """The configuration is wrong; ``problems`` lists every problem found, each with its
    file, table and key."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("invalid configuration:\n  " + "\n  ".join(problems))


def untraced(error: RelayError) -> RelayError:
    """``error``, without the tracebacks of its chain (causes, contexts, a group's
    members), for an error kept as data once caught: in an attempt's run, a refusal about
    to be sent, the record. A traceback holds the frames it passed through, the catcher's
    own among them, which hold the request: a reference cycle that kept each failed
    request whole for the cycle collector. (A crash is logged with its traceback first.)"""
    seen: set[int] = set()
    pending: list[BaseException] = [error]
    while pending:
        link = pending.pop()
        if id(link) in seen:
            continue
        seen.add(id(link))
        link.__traceback__ = None
        pending += [e for e in (link.__cause__, link.__context__) if e is not None]
        if isinstance(link, BaseExceptionGroup):
            pending += link.exceptions
    return error
