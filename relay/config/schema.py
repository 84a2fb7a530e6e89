"""The config file's tables as frozen attrs classes (SPEC 9): ``[server]``, routes, the
whole `Config`; a provider's own (`ProviderConfig`, `Profile`) live in the vocabulary."""

from __future__ import annotations

import os
import socket
import urllib.parse
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
from attrs import validators as v

from relay.api.adapter import Adapter
from relay.vocab.profile import (
    MAX_UPSTREAM_BYTES,
    ProviderConfig,
    not_negative,
    positive,
)

from .clients import ClientConfig
from .coordination_url import parse_url

Registry = Mapping[str, "type[Adapter]"]


@attrs.frozen(kw_only=True)
class _ProfileTable:
    """The file's ``profile`` table: every field optional, laid over the adapter's."""

    lanes: int | None = None
    queue_max: int | None = None
    queue_timeout_s: float | None = None
    run_timeout_s: float | None = None
    rpm: float | None = None
    interrupt_grace_s: float | None = None
    tpm: float | None = None
    itpm: float | None = None
    otpm: float | None = None
    max_hold_s: float | None = None
    first_starts: int | None = None
    affinity_wait_s: float | None = None


@attrs.frozen(kw_only=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = attrs.field(default=8765, validator=[v.ge(0), v.le(65535)])
    # SPEC A10: Ollama's API on a second loopback port as well (apps look for 11434); 0 = off
    ollama_port: int = attrs.field(default=0, validator=[v.ge(0), v.le(65535)])
    records: str | None = None  # per-request JSON lines; relative to the config file
    records_max_bytes: int = attrs.field(default=10 * 1024 * 1024, validator=v.ge(1024))
    records_keep: int = attrs.field(default=3, validator=v.ge(0))
    heartbeat_s: float = attrs.field(default=15.0, validator=positive)
    write_timeout_s: float = attrs.field(default=5.0, validator=positive)
    drain_grace_s: float = attrs.field(default=10.0, validator=not_negative)
    token_env: str | None = None
    allowed_hosts: tuple[str, ...] = ()
    cors_origins: tuple[str, ...] = ()
    max_body_bytes: int = attrs.field(default=16 * 1024 * 1024, validator=v.ge(1024))
    body_timeout_s: float = attrs.field(default=30.0, validator=positive)
    check_on_start: bool = False  # run a connection check of every provider at start-up
    # SPEC O5: the most a non-streamed upstream body may hold (after decompression), and
    # the most answer text a stream may accumulate; beyond, bad_upstream_response.
    max_upstream_bytes: int = attrs.field(default=MAX_UPSTREAM_BYTES, validator=v.ge(1024))
    # SPEC L11: shared lanes through a Redis or Valkey server. The URL (which may hold a
    # password) is given here or, better, read from the variable ``coordination_url_env``.
    coordination_url: str | None = attrs.field(default=None, repr=False)
    coordination_url_env: str | None = None
    relay_id: str | None = None  # this relay's name in shared lanes and records (hostname)
    coordination_prefix: str = "relay"
    coordination_lease_s: float = attrs.field(default=10.0, validator=[positive, v.le(3600)])


COMMON_PROVIDER_KEYS = ("adapter", "models", "prefill", "check_interval_s", "check_model",
                        "profile", "strict_fields", "shared", "limits", "prices",
                        "accounts")


def _optional_positive(inst: object, attr: attrs.Attribute[Any], value: float | None) -> None:
    if value is not None and value <= 0:
        raise ValueError(f"must be > 0, got {value!r}")


@attrs.frozen(kw_only=True)
class RouteConfig:
    """A model name clients can use: a primary target and ordered fallbacks (SPEC F1-F4).

    Without attempt timeouts, each attempt is bounded by its provider's profile alone;
    ``budget_s`` defaults to the sum of the attempt timeouts when every attempt has one.
    """

    primary: str
    fallbacks: tuple[str, ...] = ()
    primary_timeout_s: float | None = attrs.field(default=None, validator=_optional_positive)
    fallback_timeout_s: float | None = attrs.field(default=None, validator=_optional_positive)
    budget_s: float | None = attrs.field(default=None, validator=_optional_positive)
    retries: int = attrs.field(default=0, validator=[v.ge(0), v.le(10)])
    first_token_timeout_s: float | None = attrs.field(default=None,
                                                      validator=_optional_positive)
    stall_timeout_s: float | None = attrs.field(default=None, validator=_optional_positive)
    name: str = ""

    @property
    def targets(self) -> tuple[str, ...]:
        return (self.primary, *self.fallbacks)

    @property
    def is_pattern(self) -> bool:
        """A pattern's name (SPEC F9: ``claude-*``); see `relay.config.routes`."""
        return "*" in self.name

    def total_budget_s(self) -> float | None:
        """``budget_s``, else the sum of every attempt's timeout (None: unbounded)."""
        if self.budget_s is not None:
            return self.budget_s
        tries = 1 + self.retries
        if self.primary_timeout_s is None:
            return None
        if self.fallbacks and self.fallback_timeout_s is None:
            return None
        return tries * (self.primary_timeout_s
                        + len(self.fallbacks) * (self.fallback_timeout_s or 0.0))


@attrs.frozen(kw_only=True)
class Config:
    server: ServerConfig
    providers: Mapping[str, ProviderConfig]
    routes: Mapping[str, RouteConfig] = attrs.field(factory=dict)
    source: str = "<config>"  # the file it came from, or "<packaged default>"
    records_path: Path | None = None  # None: records off
    warnings: tuple[str, ...] = ()
    server_overrides: Mapping[str, Any] = attrs.field(factory=dict)  # kept for reloads
    # SPEC L14: ``[clients.NAME]``; empty: every request is the client ``default``.
    clients: Mapping[str, ClientConfig] = attrs.field(factory=dict)

    def secrets(self, environ: Mapping[str, str] | None = None) -> tuple[str, ...]:
        """Every configured secret's value (SPEC E1): relay's token and each client's, each
        provider's key,
        the values of its ``headers``, ``proxy`` and CLI ``env`` tables. Values are read
        from ``environ`` (default: the process environment) now, as the adapters read
        them; `relay.vocab.redact` keeps those long enough to redact."""
        env = os.environ if environ is None else environ
        names = [self.server.token_env] if self.server.token_env else []
        values: list[str] = []
        for provider in self.providers.values():
            names += provider.secret_envs
            values += provider.secret_values
        values += [env.get(name) or "" for name in names]
        values += [c.token for c in self.clients.values() if c.token]  # SPEC L14
        url = self.coordination_url(env)
        if url:  # SPEC E1: the coordination password is a secret too
            values += [url, *_url_passwords(url)]
        return tuple(dict.fromkeys(value for value in values if value))

    def coordination_url(self, environ: Mapping[str, str] | None = None) -> str | None:
        """The shared lanes' server (SPEC L11): ``coordination_url``, or the value of the
        variable ``coordination_url_env`` names; None when neither is set."""
        server = self.server
        if server.coordination_url_env:
            env = os.environ if environ is None else environ
            return env.get(server.coordination_url_env) or None
        return server.coordination_url

    @property
    def relay_id(self) -> str:
        """This relay's name in shared lanes and records (default: the host name)."""
        return self.server.relay_id or socket.gethostname() or "relay"

    @property
    def shared_providers(self) -> tuple[str, ...]:
        return tuple(name for name, p in self.providers.items() if p.shared)


def _url_passwords(url: str) -> tuple[str, ...]:
    """Every password ``url`` holds: the server's (before the ``@`` or ``?password=``) and
    a Sentinel URL's ``?sentinel_password=``."""
    try:
        target = parse_url(url)
    except ValueError:  # (refused at load; the URL as a whole is still redacted)
        try:
            return (urllib.parse.unquote(urllib.parse.urlsplit(url).password or ""),)
        except ValueError:
            return ()
    return tuple(p for p in (target.password, target.sentinel_password) if p)
