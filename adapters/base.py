"""The adapter contract, and the helpers every HTTP adapter shares.

An adapter kind is one class: its ``kind`` (the registry key), its ``Settings`` (an attrs
class of the keys its providers take beyond the common ones), and its own recommended
profile, longest call and typical call (SPEC L2, L3: there is no global default). An
instance serves one provider:

- ``async with adapter:`` opens what it holds for its life (an HTTP client, a pool of
  warm processes) inside relay's own nursery;
- ``check_call(call)`` refuses, before anything is queued, a request field it cannot
  honour (``unsupported``, SPEC A1) — never dropping one silently;
- ``run(call, events)`` sends `relay.events` to ``events`` and returns when the answer is
  complete, or raises `RelayError`. Every await in it is cancellable, and a cancel closes
  the upstream (HTTP: by leaving ``async with client.stream``; CLI: interrupt, grace,
  kill). It runs inside its lane's slot, so the slot is released only after it returns.
"""

from __future__ import annotations

import email.utils
import json
import time
from collections.abc import Mapping
from types import TracebackType
from typing import Any, ClassVar

from relay.config import Profile, ProviderConfig
from relay.errors import RelayError
from relay.events import Call, EventSink

__all__ = ["Adapter", "parse_retry_after", "upstream_failure"]


class Adapter:
    kind: ClassVar[str]
    Settings: ClassVar[type[Any]]
    prefill: ClassVar[bool] = False
    # Request fields this kind can honour; None: everything passes through.
    supported_params: ClassVar[frozenset[str] | None] = None

    def __init__(self, provider: ProviderConfig) -> None:
        self.provider = provider
        self.name = provider.name
        self.settings = provider.settings

    # --- what the kind declares (used by config validation) -----------------------------
    @classmethod
    def recommended_profile(cls, settings: Any) -> Profile | None:
        """This kind's own profile for these settings, or None (then the file must give
        every field)."""
        return None

    @classmethod
    def max_call_s(cls, settings: Any) -> float:
        """The longest a legitimate call may take; ``run_timeout_s`` may not be shorter."""
        return 0.0

    @classmethod
    def typical_call_s(cls, settings: Any) -> float:
        return 10.0

    @classmethod
    def describe_settings(cls, settings: Any) -> str:
        """One line for ``relay config check`` (never a secret)."""
        return ""

    @classmethod
    def settings_problems(cls, settings: Any) -> list[tuple[str, str]]:
        """(key, what is wrong) for settings that are well typed but still wrong."""
        return []

    # --- an instance's life -----------------------------------------------------------------
    async def __aenter__(self) -> Adapter:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        return None

    def check_call(self, call: Call) -> None:
        """Raise ``unsupported`` for a field this kind cannot honour."""
        if self.supported_params is None:
            return
        for key in call.params:
            if key not in self.supported_params:
                raise RelayError(
                    "unsupported",
                    f"provider {self.name!r} ({self.kind}) cannot honour the request field "
                    f"{key!r}; remove it or choose another provider",
                    provider=self.name, param=key)

    def listed_name(self, model: str) -> str:
        """The name under which ``model`` would be listed (the fake strips its options)."""
        return model

    async def run(self, call: Call, events: EventSink) -> None:
        raise NotImplementedError

    async def models(self) -> list[str]:
        """Discover the provider's models (may raise `RelayError`)."""
        return list(self.provider.models)


def parse_retry_after(headers: Mapping[str, str]) -> float | None:
    """Seconds from ``retry-after-ms``, ``retry-after`` (seconds or an HTTP date)."""
    ms = headers.get("retry-after-ms")
    if ms:
        try:
            return max(0.0, float(ms) / 1000)
        except ValueError:
            pass
    value = headers.get("retry-after")
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def _error_fields(text: str) -> tuple[str, str | None, str | None]:
    """(message, code, type) from a provider's error body, whatever its shape."""
    try:
        body = json.loads(text)
    except ValueError:
        return text.strip(), None, None
    err = body.get("error", body) if isinstance(body, dict) else body
    if isinstance(err, dict):
        message = err.get("message") or err.get("msg") or text.strip()
        code = err.get("code") if isinstance(err.get("code"), str) else None
        etype = err.get("type") if isinstance(err.get("type"), str) else None
        status = err.get("status") if isinstance(err.get("status"), str) else None
        return str(message), code or status, etype
    if isinstance(err, str):
        return err, None, None
    return text.strip(), None, None


def upstream_failure(
    provider: str, status: int, text: str, headers: Mapping[str, str], *,
    key_hint: str | None = None,
) -> RelayError:
    """Map a provider's HTTP error answer to a relay error (one mapping for every HTTP
    adapter). The provider's words go to the client whole, in ``upstream_message``."""
    message, code, etype = _error_fields(text)
    said = f"provider {provider!r} answered {status}: {message}"
    common: dict[str, Any] = {"provider": provider, "upstream_status": status,
                              "upstream_message": message}
    lowered = f"{code} {etype} {message}".lower()
    if status in (401, 403):
        action = (f"check the API key in the environment variable {key_hint}"
                  if key_hint else "check the provider's API key or login")
        return RelayError("auth_required", f"{said}. Authentication failed: {action}.",
                          action=action, **common)
    if status == 429 or code == "RESOURCE_EXHAUSTED":
        if "insufficient_quota" in lowered or "quota" in (code or "").lower():
            return RelayError("quota_exhausted", f"{said}. The account's quota is used up.",
                              **common)
        return RelayError("rate_limited", f"{said}. The provider is rate limiting; retry "
                          "after the time it gave.", retry_after_s=parse_retry_after(headers)
                          or 1.0, **common)
    if 400 <= status < 500:
        if "context_length_exceeded" in lowered or "maximum context length" in lowered:
            return RelayError("context_too_long", f"{said}. The conversation is longer than "
                              "this model's context.", **common)
        return RelayError("rejected", said, status=status, **common)
    return RelayError("upstream_error", f"{said}. The provider failed on its side.", **common)
