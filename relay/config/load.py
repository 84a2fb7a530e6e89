"""Configuration: frozen attrs classes, one strict cattrs converter, every problem at once.

A config file (SPEC 9) has a ``[server]`` table and one ``[providers.NAME]`` table per
provider. A provider's keys are the common ones (`COMMON_PROVIDER_KEYS`) plus the
settings its adapter kind declares (an attrs class on the adapter). Unknown keys are
errors. There is no global default profile (SPEC L2): a provider's profile is its
adapter's recommended one with the file's ``profile`` table laid over it, and a field
that neither gives is a startup error naming the provider and the field.

Loading never stops at the first problem: `load_config` collects them all and raises one
`ConfigError` whose lines each name the file, the table and the key.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import attrs

from relay.vocab.errors import ConfigError
from relay.vocab.profile import (
    MAX_UPSTREAM_BYTES,
    REQUIRED_PROFILE_FIELDS,
    Profile,
    ProviderConfig,
    default_state_dir,
    is_loopback_host,
)

from .schema import COMMON_PROVIDER_KEYS, Config, RouteConfig, ServerConfig, _ProfileTable
from .structure import structure_table, validation_problems

if TYPE_CHECKING:
    from relay.api.adapter import Adapter

Registry = Mapping[str, "type[Adapter]"]

__all__ = [
    "COMMON_PROVIDER_KEYS",
    "MAX_UPSTREAM_BYTES",
    "PACKAGED_DEFAULT",
    "Config",
    "Registry",
    "RouteConfig",
    "ServerConfig",
    "check_target",
    "default_config_path",
    "load_config",
    "parse_config",
]

T = TypeVar("T")

# The packaged default config (SPEC O1), shipped inside the relay package.
PACKAGED_DEFAULT = Path(__file__).parent.parent / "profiles.toml"


# --- loading -----------------------------------------------------------------------------

def default_config_path() -> Path:
    """``./profiles.toml`` if present, else the packaged default (SPEC 9)."""
    local = Path("profiles.toml")
    if local.is_file():
        return local
    return PACKAGED_DEFAULT


def load_config(path: str | os.PathLike[str] | None, adapters: Registry, *,
                server_overrides: Mapping[str, Any] | None = None) -> Config:
    """Read and validate a config file (default: `default_config_path`).

    ``server_overrides`` (the command line's ``--host``/``--port``) are laid over the
    ``[server]`` table *before* validation, so they face the same safety checks.

    Raises:
        ConfigError: listing every problem, each with file, table and key.
    """
    file = Path(path) if path is not None else default_config_path()
    packaged = file.resolve() == PACKAGED_DEFAULT.resolve()
    try:
        text = file.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError([f"{file}: cannot read: {exc.strerror or exc}"]) from exc
    return parse_config(text, adapters, source=str(file), base_dir=file.parent,
                        packaged=packaged, server_overrides=server_overrides)


def parse_config(
    text: str, adapters: Registry, *, source: str = "<config>", base_dir: Path | None = None,
    packaged: bool = False, environ: Mapping[str, str] | None = None,
    server_overrides: Mapping[str, Any] | None = None,
) -> Config:
    """Validate config text; see `load_config`. ``environ`` defaults to os.environ."""
    env = os.environ if environ is None else environ
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError([f"{source}: not valid TOML: {exc}"]) from exc

    problems: list[str] = []
    warnings: list[str] = []
    if server_overrides:
        if not isinstance(data.get("server", {}), dict):
            data["server"] = {}
        data["server"] = {**data.get("server", {}), **server_overrides}
    for key in data:
        if key not in ("server", "providers", "routes"):
            problems.append(f"[{key}]: unknown table (expected [server], [providers.NAME] "
                            "or [routes.NAME])")

    server = structure_table(data.get("server", {}), ServerConfig, "server", problems)
    if server is not None:
        _check_server(server, env, problems)
        _check_coordination(server, env, problems)

    providers: dict[str, ProviderConfig] = {}
    raw_providers = data.get("providers", {})
    if not isinstance(raw_providers, dict):
        problems.append("[providers]: must be a table of [providers.NAME] tables")
        raw_providers = {}
    for name, table in raw_providers.items():
        provider = _load_provider(name, table, adapters, problems, warnings)
        if provider is not None:
            providers[name] = provider

    routes: dict[str, RouteConfig] = {}
    raw_routes = data.get("routes", {})
    if not isinstance(raw_routes, dict):
        problems.append("[routes]: must be a table of [routes.NAME] tables")
        raw_routes = {}
    for name, table in raw_routes.items():
        route = _load_route(name, table, providers, raw_providers, problems)
        if route is not None:
            routes[name] = route

    if server is not None:
        shared = [name for name, p in providers.items() if p.shared]
        if shared and not (server.coordination_url or server.coordination_url_env):
            problems.append(
                f"[providers.{shared[0]}] shared: a shared provider needs the coordination "
                "server: set [server] coordination_url (redis://HOST:PORT/DB) or "
                "coordination_url_env (the variable holding that URL)")
    if problems:
        raise ConfigError([f"{source}: {p}" for p in problems])
    assert server is not None
    providers = {name: attrs.evolve(p, max_upstream_bytes=server.max_upstream_bytes)
                 for name, p in providers.items()}
    records: Path | None
    if server.records is not None:
        records = Path(server.records).expanduser()
        if not records.is_absolute():
            records = (base_dir or Path.cwd()) / records
    else:
        records = default_state_dir() / "relay-requests.jsonl"
    del packaged  # the packaged default never names a records path: it uses the state dir
    secret_env = _secret_env([server, *(p.settings for p in providers.values())])
    providers = {name: attrs.evolve(p, secret_env=secret_env) for name, p in providers.items()}
    return Config(server=server, providers=providers, routes=routes, source=source,
                  records_path=records, server_overrides=dict(server_overrides or {}),
                  warnings=tuple(f"{source}: {w}" for w in warnings))


def _secret_env(tables: list[Any]) -> frozenset[str]:
    """The variables named by the ``*_env`` settings of these attrs instances."""
    names = set()
    for table in tables:
        if attrs.has(type(table)):
            for field in attrs.fields(type(table)):
                value = getattr(table, field.name)
                if field.name.endswith("_env") and isinstance(value, str) and value:
                    names.add(value)
    return frozenset(names)


def check_target(target: str, providers: Mapping[str, ProviderConfig]) -> str | None:
    """What is wrong with a ``provider/model`` target, or None."""
    provider, slash, model = target.partition("/")
    if not slash or not model:
        return f"{target!r} must be PROVIDER/MODEL"
    pconf = providers.get(provider)
    if pconf is None:
        return f"{target!r} names no provider (known: {', '.join(providers) or 'none'})"
    if pconf.models_configured and model.partition("?")[0] not in pconf.models:
        return (f"{target!r}: provider {provider!r} lists only "
                f"{', '.join(pconf.models)}")
    return None


def _load_route(name: str, table: Any, providers: Mapping[str, ProviderConfig],
                raw_providers: Mapping[str, Any], problems: list[str]) -> RouteConfig | None:
    where = f"routes.{name}"
    if not name or "/" in name:
        problems.append(f"[{where}]: a route name must be non-empty and contain no '/'")
        return None
    if name in raw_providers:
        problems.append(f"[{where}]: the name is also a provider's; choose another")
        return None
    route = structure_table(table, RouteConfig, where, problems)
    if route is None:
        return None
    ok = True
    for key, target in [("primary", route.primary)] + [
            (f"fallbacks[{i}]", t) for i, t in enumerate(route.fallbacks)]:
        if target.partition("/")[0] not in providers and target.partition("/")[0] in \
                raw_providers:
            ok = False  # that provider's own table already has a problem
            continue
        problem = check_target(target, providers)
        if problem is not None:
            problems.append(f"[{where}] {key}: {problem}")
            ok = False
    seen: set[str] = set()
    for target in route.targets:
        if target in seen:
            problems.append(f"[{where}] fallbacks: {target!r} is listed twice; each target "
                            "is tried at most once per request")
            ok = False
        seen.add(target)
    return attrs.evolve(route, name=name) if ok else None


def _check_server(server: ServerConfig, env: Mapping[str, str], problems: list[str]) -> None:
    if server.token_env is not None and not env.get(server.token_env):
        problems.append(f"[server] token_env: the environment variable {server.token_env} "
                        "is not set (or empty); clients must send its value as a bearer token")
    if not is_loopback_host(server.host):
        if server.token_env is None:
            problems.append(f"[server] token_env: required when host is {server.host!r} "
                            "(not a loopback address): name the variable holding the token")
        if not server.allowed_hosts:
            problems.append(f"[server] allowed_hosts: required when host is {server.host!r}: "
                            "list the Host names clients use to reach relay")


_COORDINATION_SCHEMES = ("redis", "rediss", "valkey", "valkeys", "unix")


def coordination_url_problem(url: str) -> str | None:
    """What is wrong with a coordination URL (SPEC L11), or None. Never quotes the URL:
    it may hold a password."""
    scheme, _, rest = url.partition("://")
    if not rest or scheme.lower() not in _COORDINATION_SCHEMES:
        return ("must be a Redis or Valkey URL: redis://[:PASSWORD@]HOST:PORT/DB, "
                "rediss://… (TLS) or unix:///PATH")
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


def _load_provider(
    name: str, table: Any, registry: Mapping[str, Any],
    problems: list[str], warnings: list[str],
) -> ProviderConfig | None:
    where = f"providers.{name}"
    if not name or "/" in name or name != name.strip():
        problems.append(f"[{where}]: a provider name must be non-empty and contain no '/' "
                        "(clients write PROVIDER/MODEL)")
        return None
    if not isinstance(table, dict):
        problems.append(f"[{where}]: must be a table")
        return None
    kind = table.get("adapter")
    if kind is None:
        problems.append(f"[{where}] adapter: missing; one of: {', '.join(sorted(registry))}")
        return None
    adapter = registry.get(kind) if isinstance(kind, str) else None
    if adapter is None:
        problems.append(f"[{where}] adapter: unknown adapter kind {kind!r}; "
                        f"known kinds: {', '.join(sorted(registry))}")
        return None

    before = len(problems)
    common = {k: table[k] for k in COMMON_PROVIDER_KEYS if k in table}
    rest = {k: val for k, val in table.items() if k not in COMMON_PROVIDER_KEYS}
    settings = structure_table(rest, adapter.Settings, where, problems)
    if settings is not None:
        for key, message in adapter.settings_problems(settings):
            problems.append(f"[{where}] {key}: {message}")

    models: tuple[str, ...] = ()
    if "models" in common:
        m = common["models"]
        if not (isinstance(m, list) and all(isinstance(x, str) and x for x in m)):
            problems.append(f"[{where}] models: must be a list of non-empty strings")
        else:
            models = tuple(m)
    prefill = common.get("prefill", adapter.capabilities.prefill)
    if not isinstance(prefill, bool):
        problems.append(f"[{where}] prefill: expected true or false")
    check_model = common.get("check_model")
    if check_model is not None and not (isinstance(check_model, str) and check_model):
        problems.append(f"[{where}] check_model: must be a model name")
    shared = common.get("shared", False)
    if not isinstance(shared, bool):
        problems.append(f"[{where}] shared: expected true or false")
    interval = common.get("check_interval_s")
    if interval is not None and (isinstance(interval, bool)
                                 or not isinstance(interval, int | float) or interval <= 0):
        problems.append(f"[{where}] check_interval_s: must be a number of seconds > 0")

    overrides = structure_table(common.get("profile", {}), _ProfileTable,
                                f"{where}.profile", problems)
    if settings is None or overrides is None or len(problems) > before:
        return None

    recommended = adapter.recommended_profile(settings)
    fields = attrs.asdict(recommended) if recommended is not None else {}
    fields.update({k: val for k, val in attrs.asdict(overrides).items() if val is not None})
    missing = [f for f in REQUIRED_PROFILE_FIELDS if f not in fields]
    if missing:
        problems.append(
            f"[{where}.profile] {', '.join(missing)}: adapter {kind!r} declares no "
            f"recommended profile here, so provider {name!r} must set "
            f"{', '.join(missing)} (relay has no global default profile)")
        return None
    with attrs.validators.disabled():
        profile = Profile(**fields)
    invalid = validation_problems(profile, f"{where}.profile")
    if invalid:
        problems.extend(invalid)
        return None

    max_call = adapter.max_call_s(settings)
    if profile.run_timeout_s < max_call:
        problems.append(
            f"[{where}.profile] run_timeout_s: {profile.run_timeout_s:g} s is shorter than "
            f"the {max_call:g} s a call to adapter {kind!r} may take; it would cut "
            f"legitimate calls off. Raise it to at least {max_call:g}.")
        return None
    typical = adapter.typical_call_s(settings)
    if profile.lanes == 1 and profile.queue_timeout_s < typical:
        warnings.append(
            f"[{where}.profile] queue_timeout_s: WARNING {profile.queue_timeout_s:g} s with "
            f"1 lane is shorter than a typical {kind!r} call ({typical:g} s): a request "
            "queued behind one running call will time out in the queue.")
    return ProviderConfig(
        name=name, adapter=kind, profile=profile, settings=settings, models=models,
        models_configured=bool(models), prefill=prefill,
        check_interval_s=float(interval) if interval is not None else None,
        check_model=check_model, shared=shared is True,
        secret_envs=tuple(adapter.secret_envs(settings)),
        secret_values=tuple(adapter.secret_values(settings)))
