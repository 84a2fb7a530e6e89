"""A provider's rate-limit headers, read (SPEC L12): on every answer, stream or not, error
or not, into a `RateLimits` for the engine's budgets.

OpenAI: ``x-ratelimit-{limit,remaining,reset}-{requests,tokens}``, resets as Go durations
(``6m0s``, ``1.2s``, ``250ms``, ``1h2m3.5s``). Anthropic:
``anthropic-ratelimit-{requests,tokens,input-tokens,output-tokens}-{limit,remaining,reset}``,
resets as RFC 3339 times. The limits are read as per minute (both publish per-minute
figures). A ``429``'s hold ("no start before") is the first of: ``retry-after-ms``,
``retry-after``, the body's "try again in 2.1s", Gemini's ``RetryInfo``, the latest reset
of a window the headers say is used up.
"""

from __future__ import annotations

import datetime
import math
import re
import time
import zoneinfo
from collections.abc import Callable, Mapping

from relay.vocab.limits import RateLimits, Window

__all__ = ["body_limits", "body_retry_s", "exhausted_reset_s", "figure", "go_duration_s",
           "read_limits", "reset_time_s", "usage_reset_s"]

_OPENAI = {"requests": "requests", "tokens": "tokens"}
_ANTHROPIC = {"requests": "requests", "tokens": "tokens", "input-tokens": "input",
              "output-tokens": "output"}
_GO_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(h|ms|us|µs|ns|m|s)")
_SCALE = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
# OpenAI's 429 body: "Please try again in 2.1s." / "in 250ms" / "in 1m30s".
_TRY_AGAIN = re.compile(r"try again in ((?:\d+(?:\.\d*)?(?:h|ms|m|s))+)", re.IGNORECASE)


def figure(value: float) -> float | None:
    """A provider's figure as relay may use it: finite and not negative, else None (an
    ``inf``, ``1e400`` or ``-5`` in a header is a provider gone wrong, SPEC L12a)."""
    return value if math.isfinite(value) and value >= 0 else None


def go_duration_s(value: str) -> float | None:
    """``6m0s`` → 360.0, ``1.2s`` → 1.2, ``250ms`` → 0.25; a bare number is seconds.
    None: not a duration (unparseable, non-finite or negative)."""
    value = value.strip()
    try:
        return figure(float(value))
    except ValueError:
        pass
    pos, total = 0, 0.0
    for match in _GO_PART.finditer(value):
        if match.start() != pos:
            return None
        total += float(match[1]) * _SCALE[match[2]]
        pos = match.end()
    return figure(total) if pos == len(value) and pos > 0 else None


def reset_time_s(value: str, now: float | None = None) -> float | None:
    """An RFC 3339 time (Anthropic's resets) as seconds from now (never below 0)."""
    text = value.strip().replace("Z", "+00:00").replace("z", "+00:00")
    try:
        when = datetime.datetime.fromisoformat(text)
    except ValueError:
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=datetime.UTC)
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


def body_retry_s(text: str) -> float | None:
    """The "try again in 2.1s" of an error body, in seconds."""
    match = _TRY_AGAIN.search(text)
    return go_duration_s(match[1]) if match else None


def _number(value: str) -> float | None:
    try:
        return figure(float(value.strip()))
    except ValueError:
        return None


def _read(headers: Mapping[str, str], name: str, parse: Callable[[str], float | None],
          ignored: list[str]) -> float | None:
    """One header's figure; one that is there but unusable is named in ``ignored``."""
    value = headers.get(name)
    if value is None:
        return None
    number = parse(value)
    if number is None:
        ignored.append(f"{name}: {value[:40]}")
    return number


def read_limits(headers: Mapping[str, str]) -> RateLimits | None:
    """The rate-limit headers of one answer, or None when it sent none. A figure that is
    not a finite, non-negative number is ignored and named in ``ignored``."""
    windows: dict[str, Window] = {}
    ignored: list[str] = []
    family = ""
    for prefix, names, reset, who in (
            ("x-ratelimit-", _OPENAI, go_duration_s, "openai"),
            ("anthropic-ratelimit-", _ANTHROPIC, reset_time_s, "anthropic")):
        for name, kind in names.items():
            if prefix == "x-ratelimit-":
                keys = (f"{prefix}limit-{name}", f"{prefix}remaining-{name}",
                         f"{prefix}reset-{name}")
            else:
                keys = (f"{prefix}{name}-limit", f"{prefix}{name}-remaining",
                         f"{prefix}{name}-reset")
            if keys[0] not in headers and keys[1] not in headers:
                continue
            family = family or who
            window = Window(_read(headers, keys[0], _number, ignored),
                            _read(headers, keys[1], _number, ignored),
                            _read(headers, keys[2], reset, ignored))
            if kind in windows:  # both families: keep the tighter reading
                old = windows[kind]
                if (old.remaining is not None and window.remaining is not None
                        and old.remaining <= window.remaining):
                    continue
            windows[kind] = window
    if not windows and not ignored:
        return None
    return RateLimits(windows=windows, family=family, ignored=tuple(ignored))


def exhausted_reset_s(limits: RateLimits | None) -> float | None:
    """The latest reset among the windows the headers say are used up."""
    if limits is None:
        return None
    resets = [w.reset_s for w in limits.windows.values()
              if w.remaining is not None and w.remaining <= 0 and w.reset_s is not None]
    return max(resets) if resets else None


# A CLI tool's usage-window notice (SPEC E2's strings): "Claude AI usage limit
# reached|1753441200" (the reset, in Unix seconds), "You've hit your limit · resets 3:30am
# (Asia/Calcutta)" (a time of day in a zone).
_EPOCH = re.compile(r"limit reached\|(\d{9,11})\b", re.IGNORECASE)
_CLOCK = re.compile(r"resets\s+(?:at\s+)?(\d{1,2})(?::(\d{2}))?\s*([ap]m)?\s*"
                    r"(?:\(([A-Za-z_]+(?:/[A-Za-z_+-]+)*)\))?", re.IGNORECASE)


def usage_reset_s(words: str, now: float | None = None) -> float | None:
    """When a usage-window notice says the limit resets, as seconds from now; None when
    it says no time (then no hold: the quota's own Retry-After stands)."""
    wall = time.time() if now is None else now
    match = _EPOCH.search(words)
    if match:
        return max(0.0, int(match[1]) - wall)
    match = _CLOCK.search(words)
    if not match:
        return None
    hour, minute = int(match[1]), int(match[2] or 0)
    if match[3]:
        hour = hour % 12 + (12 if match[3].lower() == "pm" else 0)
    if hour > 23 or minute > 59:
        return None
    try:
        zone: datetime.tzinfo = zoneinfo.ZoneInfo(match[4]) if match[4] else datetime.UTC
    except (zoneinfo.ZoneInfoNotFoundError, ValueError):
        zone = datetime.UTC
    here = datetime.datetime.fromtimestamp(wall, zone)
    when = here.replace(hour=hour, minute=minute, second=0, microsecond=0)
    if when <= here:
        when += datetime.timedelta(days=1)
    return when.timestamp() - wall


# A 429's body names the limit it met: OpenAI's "… on tokens per min (TPM): Limit 40000,
# Used 39000, Requested 6000. …", Anthropic's "… exceed the rate limit for your
# organization … of 40,000 input tokens per minute." A provider that sends no rate-limit
# headers still teaches relay its budget this way.
_OPENAI_BODY = re.compile(r"per min(?:ute)? \((RPM|TPM|ITPM|OTPM)\): Limit ([\d,]+), Used "
                          r"([\d,]+)", re.IGNORECASE)
_ANTHROPIC_BODY = re.compile(r"rate limit for your organization.*? of ([\d,]+) "
                             r"(input tokens|output tokens|tokens|requests) per minute",
                             re.IGNORECASE | re.DOTALL)
_CODES = {"rpm": "requests", "tpm": "tokens", "itpm": "input", "otpm": "output"}
_WORDS = {"requests": "requests", "tokens": "tokens", "input tokens": "input",
          "output tokens": "output"}


def body_limits(text: str) -> dict[str, Window]:
    """The budget a 429's body says it met (limit, and what remains when it says)."""
    match = _OPENAI_BODY.search(text)
    if match:
        limit, used = float(match[2].replace(",", "")), float(match[3].replace(",", ""))
        return {_CODES[match[1].lower()]: Window(limit, max(0.0, limit - used))}
    match = _ANTHROPIC_BODY.search(text)
    if match:
        return {_WORDS[match[2].lower()]: Window(float(match[1].replace(",", "")))}
    return {}
