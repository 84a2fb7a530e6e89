"""The ``[server]`` table's checks that need more than its types: the safety rules of
SPEC O4 and the coordination server of shared lanes (SPEC L11)."""

from __future__ import annotations

from collections.abc import Mapping

from relay.api.adapter import Adapter
from relay.vocab.profile import (
    ProviderConfig,
    is_loopback_host,
)

from .coordination_url import parse_url
from .schema import ServerConfig

Registry = Mapping[str, "type[Adapter]"]


def _check_server(server: ServerConfig, env: Mapping[str, str], problems: list[str], *,
                  clients: bool = False) -> None:
    if server.token_env is not None and not env.get(server.token_env):
        problems.append(f"[server] token_env: the environment variable {server.token_env} "
                        "is not set (or empty); clients must send its value as a bearer token")
    if server.ollama_port and server.ollama_port == server.port:
        problems.append(f"[server] ollama_port: {server.ollama_port} is [server] port too; "
                        "Ollama's API is served on the main port already: pick another "
                        "port (11434, where Ollama's apps look), or 0 (off)")
    if not is_loopback_host(server.host):
        if server.token_env is None and not clients:  # (with clients: their tokens)
            problems.append(f"[server] token_env: required when host is {server.host!r} "
                            "(not a loopback address): name the variable holding the token")
        if not server.allowed_hosts:
            problems.append(f"[server] allowed_hosts: required when host is {server.host!r}: "
                            "list the Host names clients use to reach relay")


_COORDINATION_SCHEMES = ("redis", "rediss", "valkey", "valkeys", "unix", "redis+sentinel",
                         "valkey+sentinel")


def coordination_url_problem(url: str) -> str | None:
    """What is wrong with a coordination URL (SPEC L11), or None. Never quotes the URL:
    it may hold a password."""
    scheme, _, rest = url.partition("://")
    if not rest or scheme.lower() not in _COORDINATION_SCHEMES:
        return ("must be a Redis or Valkey URL: redis://[:PASSWORD@]HOST:PORT/DB, "
                "rediss://… (TLS), unix:///PATH or "
                "redis+sentinel://HOST:PORT[,HOST:PORT…]/MASTER_NAME")
    try:
        parse_url(url)
    except ValueError as exc:
        return str(exc)
    return None


def _check_coordination(server: ServerConfig, env: Mapping[str, str],
                        problems: list[str]) -> None:
    if server.coordination_url and server.coordination_url_env:
        problems.append("[server] coordination_url_env: give coordination_url or "
                        "coordination_url_env, not both")
    if server.coordination_url is not None:
        problem = coordination_url_problem(server.coordination_url)
        if problem:
            problems.append(f"[server] coordination_url: {problem}")
    if server.coordination_url_env:
        value = env.get(server.coordination_url_env)
        if not value:
            problems.append(f"[server] coordination_url_env: the environment variable "
                            f"{server.coordination_url_env} is not set (or empty)")
        elif (problem := coordination_url_problem(value)) is not None:
            problems.append(f"[server] coordination_url_env: the value of "
                            f"{server.coordination_url_env} {problem}")
    for key in ("relay_id", "coordination_prefix"):
        value = getattr(server, key)
        if value is not None and (not value or any(c.isspace() or c in "{}|" for c in value)):
            problems.append(f"[server] {key}: must be a non-empty name without spaces, "
                            "'{', '}' or '|'")


def check_shared(server: ServerConfig, providers: Mapping[str, ProviderConfig],
                 problems: list[str]) -> None:
    """A shared provider needs the coordination server (SPEC L11)."""
    shared = [name for name, p in providers.items() if p.shared]
    if shared and not (server.coordination_url or server.coordination_url_env):
        problems.append(
            f"[providers.{shared[0]}] shared: a shared provider needs the coordination "
            "server: set [server] coordination_url (redis://HOST:PORT/DB) or "
            "coordination_url_env (the variable holding that URL)")
