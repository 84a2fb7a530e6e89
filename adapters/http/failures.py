"""An upstream's failure, read: its HTTP status and its words mapped to relay's reasons
(SPEC E1, F2) — auth, quota, rate limits with Retry-After, context too long."""

from __future__ import annotations

import email.utils
import json
import re
import time
from collections.abc import Mapping
from typing import Any, NamedTuple

import attrs

from relay.adapters.limits import (
    body_limits,
    body_retry_s,
    exhausted_reset_s,
    figure,
    read_limits,
)
from relay.vocab.errors import RelayError
from relay.vocab.limits import RateLimits

__all__ = ["AUTH_REASONS", "CONTEXT_PHRASES", "QUOTA_PHRASES", "parse_retry_after",
           "upstream_failure"]


def parse_retry_after(headers: Mapping[str, str], ignored: list[str] | None = None
                      ) -> float | None:
    """Seconds from ``retry-after-ms``, ``retry-after`` (seconds or an HTTP date). A
    value that is not a finite, non-negative figure is ignored and named in ``ignored``
    (SPEC L12a: ``inf``, ``1e400``, ``-1`` say nothing relay can wait for)."""
    said = ignored if ignored is not None else []
    ms = headers.get("retry-after-ms")
    if ms:
        try:
            seconds = figure(float(ms) / 1000)
        except ValueError:
            seconds = None
        if seconds is not None:
            return seconds
        said.append(f"retry-after-ms: {ms[:40]}")
    value = headers.get("retry-after")
    if not value:
        return None
    try:
        seconds = figure(float(value))
    except ValueError:
        seconds = _http_date_s(value)
    if seconds is None:
        said.append(f"retry-after: {value[:40]}")
    return seconds


def _http_date_s(value: str) -> float | None:
    """An HTTP date as seconds from now (never below 0); None: not a date."""
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, OverflowError):
        return None
    return max(0.0, when.timestamp() - time.time())


# Words that mean the same failure whatever the provider's error shape (lower case).
# A conversation longer than the model's context (a larger model may fit: SPEC F2).
CONTEXT_PHRASES = (
    "context_length_exceeded", "maximum context length",     # OpenAI-compatible servers
    "prompt is too long",                                      # Anthropic
    "exceeds the maximum number of tokens",                    # Gemini ("input token count")
)
# An account out of money or out of its allowance: waiting a minute will not help.
QUOTA_PHRASES = (
    "insufficient_quota", "billing_error",                     # OpenAI; Anthropic's type
    "credit balance is too low", "credits are depleted",       # Anthropic; Gemini prepay
    "limit: 0",                                                # Gemini: no allowance at all
)
# A bad key that a provider reports without a 401/403 (Gemini: 400 INVALID_ARGUMENT).
AUTH_REASONS = ("API_KEY_INVALID", "API_KEY_SERVICE_BLOCKED")


class _Said(NamedTuple):
    """What a provider's error body says, whatever its shape."""

    message: str
    code: str | None = None     # OpenAI's code, or Google's status word
    type: str | None = None     # OpenAI's or Anthropic's error type
    retry_s: float | None = None  # google.rpc.RetryInfo retryDelay
    windows: tuple[str, ...] = ()  # google.rpc.QuotaFailure quota ids and metrics
    reasons: tuple[str, ...] = ()  # google.rpc.ErrorInfo reasons


def _error_fields(text: str) -> _Said:
    """Read an error body: OpenAI's ``{"error": {message, type, code}}``, Anthropic's
    ``{"type": "error", "error": {type, message}}``, Google's ``{"error": {code, message,
    status, details}}`` (also wrapped in a list), or plain text."""
    try:
        body = json.loads(text)
    except ValueError:
        return _Said(text.strip())
    if isinstance(body, list) and body and isinstance(body[0], dict):
        body = body[0]
    err = body.get("error", body) if isinstance(body, dict) else body
    if isinstance(err, str):
        return _Said(err)
    if not isinstance(err, dict):
        return _Said(text.strip())

    def word(key: str) -> str | None:
        value = err.get(key)
        return value if isinstance(value, str) else None

    message = str(err.get("message") or err.get("msg") or text.strip())
    retry_s: float | None = None
    windows: list[str] = []
    reasons: list[str] = []
    for detail in err.get("details") or ():
        if not isinstance(detail, dict):
            continue
        kind = str(detail.get("@type", ""))
        if kind.endswith("RetryInfo"):
            retry_s = _duration_s(detail.get("retryDelay"))
        elif kind.endswith("QuotaFailure"):
            for violation in detail.get("violations") or ():
                if isinstance(violation, dict):
                    windows += [str(violation.get(k, "")) for k in ("quotaId", "quotaMetric")]
                    dimensions = violation.get("quotaDimensions")
                    if isinstance(dimensions, dict) and dimensions.get("model"):
                        windows.append("model")  # a model's own quota (SPEC L12a)
        elif kind.endswith("ErrorInfo") and isinstance(detail.get("reason"), str):
            reasons.append(detail["reason"])
    return _Said(message, word("code") or word("status"), word("type"), retry_s,
                 tuple(w for w in windows if w), tuple(reasons))


def _duration_s(value: Any) -> float | None:
    """A protobuf Duration as JSON (``"43s"``, ``"0.5s"``) in seconds."""
    if isinstance(value, str) and value.endswith("s"):
        try:
            return figure(float(value[:-1]))
        except ValueError:
            return None
    return None


def _is_quota(said: _Said, lowered: str) -> bool | None:
    """True: the allowance is used up; False: a short-window rate limit; None: unknown."""
    if any(p in lowered for p in QUOTA_PHRASES) or "quota" in (said.code or "").lower():
        return True
    windows = " ".join(said.windows).lower()
    if "perday" in windows or "per_day" in windows:
        return True
    if any(w in windows for w in ("perminute", "per_minute", "persecond", "per_second")):
        return False
    if "per day" in lowered or "daily" in lowered:
        return True
    return None


def _said_when(headers: Mapping[str, str], text: str, said: _Said,
               limits: RateLimits | None, ignored: list[str]) -> tuple[float | None, str]:
    """When a 429 said a start may come again, and what said so (SPEC L12): the
    ``retry-after-ms``/``retry-after`` header, the body's "try again in …", Gemini's
    ``RetryInfo``, or the reset of a window the headers say is used up."""
    retry = parse_retry_after(headers, ignored)
    if retry is not None:
        name = ("retry-after-ms" if headers.get("retry-after-ms")
                and not any(i.startswith("retry-after-ms:") for i in ignored)
                else "retry-after")
        return retry, f"{name}: {headers.get(name)}"
    retry = body_retry_s(text)
    if retry is not None:
        return retry, f"the 429's body: try again in {retry:g} s"
    if said.retry_s is not None:
        return said.retry_s, f"RetryInfo retryDelay {said.retry_s:g} s"
    retry = exhausted_reset_s(limits)
    if retry is not None:
        return retry, f"a used-up budget's reset header: {retry:g} s"
    return None, ""


# OpenAI's 429 names the model it met: "Rate limit reached for gpt-4o in organization …".
_FOR_MODEL = re.compile(r"rate limit reached for \S+ in ", re.IGNORECASE)


def _names_model(limits: RateLimits, text: str, said: _Said) -> bool:
    """A 429 that met one model's limit (SPEC L12a): its body names the model, its quota
    is a model's (Gemini's ``quotaDimensions.model``, a ``…PerModel…`` quota id), or it
    carries rate-limit headers, which describe the answering model's own window. Its hold
    is the model's; a 429 that names none holds the account."""
    if limits.windows or _FOR_MODEL.search(text):
        return True
    return any(w == "model" or "permodel" in w.lower() for w in said.windows)


def upstream_failure(
    provider: str, status: int, text: str, headers: Mapping[str, str], *,
    key_hint: str | None = None, in_stream: bool = False,
) -> RelayError:
    """Map a provider's HTTP error answer to a relay error (one mapping for every HTTP
    adapter). The provider's words go to the client whole, in ``upstream_message``.

    ``in_stream``: the error arrived inside a 200 stream (Anthropic's ``event: error``);
    ``status`` is then the one its error type stands for, and no upstream status is
    reported, since the provider sent none.
    """
    said = _error_fields(text)
    message = said.message
    limits = read_limits(headers) if headers else None
    where = (f"provider {provider!r} reported an error inside the stream" if in_stream
             else f"provider {provider!r} answered {status}")
    said_it = f"{where}: {message}"
    common: dict[str, Any] = {"provider": provider,
                              "upstream_status": None if in_stream else status,
                              "upstream_message": message, "limits": limits}
    lowered = f"{said.code} {said.type} {message}".lower()
    if status in (401, 403) or any(r in AUTH_REASONS for r in said.reasons):
        action = (f"check the API key in the environment variable {key_hint}"
                  if key_hint else "check the provider's API key or login")
        return RelayError("auth_required", f"{said_it}. Authentication failed: {action}.",
                          action=action, **common)
    quota = _is_quota(said, lowered)
    if status == 429 or said.code == "RESOURCE_EXHAUSTED":
        if quota:
            return RelayError("quota_exhausted", f"{said_it}. The account's quota is used "
                              "up.", **common)
        ignored: list[str] = []
        retry, cause = _said_when(headers, text, said, limits, ignored)
        taught = body_limits(text)  # the budget it met, named in its words
        if taught and (limits is None or not limits.windows):
            limits = common["limits"] = RateLimits(
                windows=taught, ignored=limits.ignored if limits is not None else ())
        if retry is not None or ignored:  # it said when: every start waits (L12)
            base = limits or RateLimits()
            common["limits"] = attrs.evolve(base, hold_s=retry, cause=cause,
                                            ignored=base.ignored + tuple(ignored),
                                            names_model=_names_model(base, text, said))
        return RelayError("rate_limited", f"{said_it}. The provider is rate limiting; retry "
                          "after the time it gave.",
                          retry_after_s=retry if retry is not None else 1.0,
                          **common)
    if 400 <= status < 500:
        if any(p in lowered for p in QUOTA_PHRASES):
            return RelayError("quota_exhausted", f"{said_it}. The account's quota is used "
                              "up.", **common)
        if any(p in lowered for p in CONTEXT_PHRASES):
            return RelayError("context_too_long", f"{said_it}. The conversation is longer "
                              "than this model's context.", **common)
        return RelayError("rejected", said_it, status=status, **common)
    return RelayError("upstream_error", f"{said_it}. The provider failed on its side.",
                      **common)
