"""``[clients.NAME]``: the programs relay serves, each with its own token, default
priority, models and limits (SPEC L14, O7).

Who a request is:

- without ``[clients]``, everyone is the client ``default`` (``[server] token_env``, when
  set, is the one token every request must carry: relay as before);
- with ``[clients]``, a request names its client by the token it carries (the value of
  that client's ``token_env``). ``[server] token_env``, when set as well, is the token
  of the client ``default`` (whose settings a ``[clients.default]`` table may give; that
  table then names no ``token_env`` of its own). A request without a token is the client
  ``default`` only when ``[clients.default]`` exists without a token (and ``[server]``
  names none): a loopback relay may let its token-less programs be one client. Otherwise
  it is refused (401 ``unauthorized``), as is a token no client has.

Every token is read from its variable at load, so a missing or empty one is a config
error naming the client; two clients with the same token are one too (a token names one
client). Tokens are never shown: not by ``relay config check``, not in a record, a log
line, the status or a metric (`Config.secrets` redacts them).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from typing import Any

import attrs
from attrs import validators as v

from relay.vocab.profile import is_loopback_host, positive

from .structure import structure_table

__all__ = ["DEFAULT_CLIENT", "PRIORITY_NAMES", "ClientConfig", "load_clients"]

DEFAULT_CLIENT = "default"
PRIORITY_NAMES = ("interactive", "normal", "background")  # highest first (SPEC L8)


def _priority(inst: object, attr: attrs.Attribute[Any], value: str) -> None:
    if value not in PRIORITY_NAMES:
        raise ValueError(f"must be one of {', '.join(PRIORITY_NAMES)}, got {value!r}")


def _patterns(inst: object, attr: attrs.Attribute[Any], value: tuple[str, ...]) -> None:
    if not value or not all(isinstance(m, str) and m.strip() for m in value):
        raise ValueError("must be a non-empty list of model names or patterns "
                         "(a route name or PROVIDER/MODEL; '*' matches any text)")


@attrs.frozen(kw_only=True)
class ClientConfig:
    """One ``[clients.NAME]`` table (SPEC L14). A limit of 0 is none."""

    name: str = DEFAULT_CLIENT
    token_env: str | None = None
    priority: str = attrs.field(default="normal", validator=_priority)
    models: tuple[str, ...] = attrs.field(default=("*",), validator=_patterns)
    weight: float = attrs.field(default=1.0, validator=positive)
    lanes: int = attrs.field(default=0, validator=v.ge(0))
    rpm: float = attrs.field(default=0.0, validator=v.ge(0))
    tpm: float = attrs.field(default=0.0, validator=v.ge(0))
    tokens_per_day: int = attrs.field(default=0, validator=v.ge(0))
    usd_per_day: float = attrs.field(default=0.0, validator=v.ge(0))
    usd_per_month: float = attrs.field(default=0.0, validator=v.ge(0))
    # The token's value, read at load (never from the file; never shown).
    token: str | None = attrs.field(default=None, repr=False)

    def may_use(self, model: str) -> bool:
        """The client may name ``model`` (a route, ``PROVIDER/MODEL``, a bare name): it
        matches one of its ``models`` (``*`` matches any text, ``/`` included)."""
        return any(fnmatch.fnmatchcase(model, pattern) for pattern in self.models)

    @property
    def minute_limited(self) -> bool:
        return bool(self.lanes or self.rpm or self.tpm)

    @property
    def spend_limited(self) -> bool:
        return bool(self.tokens_per_day or self.usd_per_day or self.usd_per_month)

    def limits_text(self) -> str:
        """Its limits in words (``relay config check``)."""
        parts = [f"{key} {getattr(self, key):g}" for key in (
            "lanes", "rpm", "tpm", "tokens_per_day", "usd_per_day", "usd_per_month")
            if getattr(self, key)]
        return ", ".join(parts) or "no limits"


def load_clients(raw: Any, server_token_env: str | None, host: str,
                 env: Mapping[str, str], problems: list[str]) -> dict[str, ClientConfig]:
    """The ``[clients]`` tables, checked; ``{}`` without them (every request is the
    client ``default``: see the module docstring)."""
    if not isinstance(raw, dict):
        problems.append("[clients]: must be a table of [clients.NAME] tables")
        return {}
    clients: dict[str, ClientConfig] = {}
    for name, table in raw.items():
        where = f"clients.{name}"
        if not name or name != name.strip() or any(c in name for c in "/\"' "):
            problems.append(f"[{where}]: a client name must be non-empty, without spaces, "
                            "quotes or '/'")
            continue
        if isinstance(table, dict) and "models" in table and isinstance(
                table["models"], list):
            table = {**table, "models": tuple(table["models"])}
        found = structure_table(table, ClientConfig, where, problems,
                                hidden=("name", "token"))
        if found is None:
            continue
        token: str | None = None
        server_token = server_token_env
        if found.token_env is not None:
            token = env.get(found.token_env) or None
            if token is None:
                problems.append(f"[{where}] token_env: the environment variable "
                                f"{found.token_env} is not set (or empty); client {name!r} "
                                "sends its value as its token")
                continue
            if name == DEFAULT_CLIENT and server_token:
                problems.append(f"[{where}] token_env: [server] token_env is the token of "
                                "the client 'default' already; give it in one place")
                continue
        elif name != DEFAULT_CLIENT:
            problems.append(f"[{where}] token_env: missing; name the environment variable "
                            f"holding the token of client {name!r} (only the client "
                            "'default' may have none: it is then the token-less requests)")
            continue
        clients[name] = attrs.evolve(found, name=name, token=token)
    _check_tokens(clients, server_token_env, host, env, problems)
    return clients


def _check_tokens(clients: dict[str, ClientConfig], server_token_env: str | None,
                  host: str, env: Mapping[str, str], problems: list[str]) -> None:
    owners: dict[str, str] = {}
    if server_token_env and env.get(server_token_env):
        owners[env[server_token_env]] = f"{DEFAULT_CLIENT} ([server] token_env)"
    for name, client in clients.items():
        if client.token is None:
            continue
        other = owners.setdefault(client.token, name)
        if other != name:
            problems.append(f"[clients.{name}] token_env: {client.token_env} holds the same "
                            f"token as client {other}; each client needs a token of its own")
    tokenless = (DEFAULT_CLIENT in clients and clients[DEFAULT_CLIENT].token is None
                 and not server_token_env)
    if tokenless and not is_loopback_host(host):
        problems.append(f"[clients.{DEFAULT_CLIENT}] token_env: required when host is "
                        f"{host!r} (not a loopback address): a request without a token "
                        "would be served")
