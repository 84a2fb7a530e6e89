"""The profile and the provider's static description: what every layer may know of a
provider (SPEC L1, 9). Pure data; imports nothing of relay.

`Profile` is how much traffic a provider takes; `ProviderConfig` is one provider as the
config file describes it (its adapter kind's own settings included). Loading and
validating them is `relay.config`'s business.
"""

from __future__ import annotations

import functools
import ipaddress
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
from attrs import validators as v

from .prices import Price

__all__ = [
    "ACCOUNT_PROFILE_KEYS",
    "MAX_UPSTREAM_BYTES",
    "PROFILE_FIELDS",
    "REQUIRED_PROFILE_FIELDS",
    "AccountConfig",
    "ModelLimits",
    "Profile",
    "ProviderConfig",
    "default_state_dir",
    "is_loopback_host",
    "not_negative",
    "positive",
]


# SPEC O5: the most a non-streamed upstream body may hold (after decompression), and the
# most answer text a stream may accumulate ([server] max_upstream_bytes).
MAX_UPSTREAM_BYTES = 32 * 1024 * 1024


def positive(inst: object, attr: attrs.Attribute[Any], value: float) -> None:
    if value <= 0:  # the caller names the key (validation_problems)
        raise ValueError(f"must be > 0, got {value!r}")


def not_negative(inst: object, attr: attrs.Attribute[Any], value: float) -> None:
    if value < 0:
        raise ValueError(f"must be >= 0, got {value!r}")


@attrs.frozen(kw_only=True)
class Profile:
    """How much traffic a provider takes (SPEC L1).

    lanes: requests that run at once. queue_max: requests allowed to wait.
    queue_timeout_s: longest wait. run_timeout_s: longest run. rpm: request starts per
    minute (0 = unpaced). interrupt_grace_s: CLI tools, how long an interrupt may take
    to be confirmed before the process group is killed. tpm, itpm, otpm: token budgets
    per minute (SPEC L12) — tokens in and out together, input, output; 0 = not set (a
    provider that sends rate-limit headers needs none: relay learns them). max_hold_s:
    the longest a provider's 429 may hold every start (SPEC L12a; a usage-window notice
    that names its reset may hold up to a day). first_starts: until a model has been
    answered once, at most this many of its requests run at once (its first answer's
    headers tell its limits; 0 = no such wait: local servers, CLI tools).
    affinity_wait_s: with several accounts (SPEC L13), how long a conversation waits for
    the account that served it last before it starts on another.
    """

    lanes: int = attrs.field(validator=v.ge(1))
    queue_max: int = attrs.field(validator=v.ge(0))
    queue_timeout_s: float = attrs.field(validator=positive)
    run_timeout_s: float = attrs.field(validator=positive)
    rpm: float = attrs.field(default=0.0, validator=not_negative)
    interrupt_grace_s: float = attrs.field(default=5.0, validator=not_negative)
    tpm: float = attrs.field(default=0.0, validator=not_negative)
    itpm: float = attrs.field(default=0.0, validator=not_negative)
    otpm: float = attrs.field(default=0.0, validator=not_negative)
    max_hold_s: float = attrs.field(default=900.0, validator=positive)
    first_starts: int = attrs.field(default=0, validator=v.ge(0))
    affinity_wait_s: float = attrs.field(default=2.0, validator=not_negative)


@attrs.frozen(kw_only=True)
class ModelLimits:
    """One model's own configured budgets (``[providers.NAME.limits."MODEL"]``, SPEC
    L12a): per minute, 0 = not set."""

    rpm: float = attrs.field(default=0.0, validator=not_negative)
    tpm: float = attrs.field(default=0.0, validator=not_negative)
    itpm: float = attrs.field(default=0.0, validator=not_negative)
    otpm: float = attrs.field(default=0.0, validator=not_negative)


PROFILE_FIELDS = tuple(a.name for a in attrs.fields(Profile))
REQUIRED_PROFILE_FIELDS = tuple(
    a.name for a in attrs.fields(Profile) if a.default is attrs.NOTHING
)


ACCOUNT_PROFILE_KEYS = ("lanes", "rpm", "tpm", "itpm", "otpm", "max_hold_s", "first_starts")


@attrs.frozen(kw_only=True)
class AccountConfig:
    """One of a provider's accounts (SPEC L13, ``[[providers.NAME.accounts]]``): its
    adapter settings (the provider's with the account's key, base URL, headers or CLI
    environment laid over them) and its profile (the provider's with its own figures)."""

    name: str
    settings: Any = attrs.field(repr=False)
    profile: Profile


@attrs.frozen(kw_only=True)
class ProviderConfig:
    name: str
    adapter: str
    profile: Profile
    settings: Any  # the adapter kind's own attrs settings instance
    models: tuple[str, ...] = ()
    models_configured: bool = False  # the file listed them: only those are accepted
    prefill: bool = False
    check_interval_s: float | None = None  # periodic connection checks (off by default)
    check_model: str | None = None  # the model a check asks (default: the first known)
    strict_fields: bool = False  # refuse advisory request fields instead of dropping them (A1a)
    max_upstream_bytes: int = MAX_UPSTREAM_BYTES  # [server] max_upstream_bytes (SPEC O5)
    # SPEC L11: lanes, queue and pacer counted across every relay on the same coordination
    # server (``[server] coordination_url`` and ``coordination_prefix``).
    shared: bool = False
    # What must never leave relay (SPEC E1): the variables holding this provider's key,
    # and the secret values its settings hold (headers, proxy, CLI env). Read by
    # `Config.secrets`; never shown.
    secret_envs: tuple[str, ...] = attrs.field(default=(), repr=False)
    secret_values: tuple[str, ...] = attrs.field(default=(), repr=False)
    # Every variable this config names for a secret (each `*_env` setting of the server
    # and of every provider: token_env, api_key_env …): kept from CLI tools (SPEC O5).
    secret_env: frozenset[str] = frozenset()
    # The profile keys the file itself set (the rest are the adapter's), for `relay
    # config check` to say where each figure comes from (SPEC L12).
    profile_from_file: frozenset[str] = frozenset()
    # SPEC L12a: each model's own configured budgets, by model name.
    limits: Mapping[str, ModelLimits] = attrs.field(factory=dict)
    # SPEC O7: ``[providers.NAME.prices."MODEL"]``, over the packaged price table.
    prices: Mapping[str, Price] = attrs.field(factory=dict)
    # SPEC L13: ``[[providers.NAME.accounts]]``; none: the provider is its one account.
    accounts: tuple[AccountConfig, ...] = ()

    def account_profiles(self) -> list[tuple[str, Profile]]:
        """(name, profile) of each account: ``("", profile)`` without accounts."""
        return ([(a.name, a.profile) for a in self.accounts] if self.accounts
                else [("", self.profile)])



@functools.lru_cache(maxsize=256)  # every request's Host; a bounded cache (any client may vary it)
def is_loopback_host(host: str) -> bool:
    if host.lower() in ("localhost", "localhost.", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def default_state_dir() -> Path:
    """Where relay keeps its records with the packaged default config (SPEC A5)."""
    home = Path.home()
    if sys.platform == "darwin":
        return home / "Library" / "Application Support" / "relay"
    if sys.platform == "win32":
        return Path(os.environ.get("LOCALAPPDATA", home / "AppData" / "Local")) / "relay"
    state = os.environ.get("XDG_STATE_HOME")
    return (Path(state) if state else home / ".local" / "state") / "relay"
