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
from typing import Any, TypeVar

import attrs

from relay.api.adapter import Adapter
from relay.vocab.errors import ConfigError
from relay.vocab.prices import Price
from relay.vocab.profile import (
    MAX_UPSTREAM_BYTES,
    REQUIRED_PROFILE_FIELDS,
    ModelLimits,
    Profile,
    ProviderConfig,
    default_state_dir,
)

from .accounts import load_accounts
from .clients import ClientConfig, load_clients
from .routes import best_pattern, check_target, load_routes
from .schema import COMMON_PROVIDER_KEYS, Config, RouteConfig, ServerConfig, _ProfileTable
from .server import _check_coordination, _check_server, check_shared
from .structure import (
    did_you_mean,
    structure_table,
    toml_problem,
    unknown_key,
    validation_problems,
)

Registry = Mapping[str, "type[Adapter]"]

__all__ = [
    "COMMON_PROVIDER_KEYS",
    "MAX_UPSTREAM_BYTES",
    "PACKAGED_DEFAULT",
    "ClientConfig",
    "Config",
    "Registry",
    "RouteConfig",
    "ServerConfig",
    "best_pattern",
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
        data = file.read_bytes()
    except OSError as exc:
        raise ConfigError([f"{file}: cannot read: {exc.strerror or exc}"]) from exc
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[:exc.start].count(b"\n") + 1
        column = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
        raise ConfigError([f"{file}: line {line}, column {column}: not UTF-8 text (byte "
                           f"0x{data[exc.start]:02x}); save the file as UTF-8"]) from exc
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
        raise ConfigError([toml_problem(source, text, exc)]) from exc

    problems: list[str] = []
    warnings: list[str] = []
    if server_overrides:
        if not isinstance(data.get("server", {}), dict):
            data["server"] = {}
        data["server"] = {**data.get("server", {}), **server_overrides}
    tables = ("server", "providers", "routes", "clients")
    for key in data:
        if key not in tables:
            problems.append(f"[{key}]: unknown table{did_you_mean(key, tables)}; expected "
                            "[server], [providers.NAME], [routes.NAME] or [clients.NAME]")

    server = structure_table(data.get("server", {}), ServerConfig, "server", problems)
    clients: dict[str, ClientConfig] = {}
    if server is not None:
        _check_server(server, env, problems, clients=bool(data.get("clients")))
        _check_coordination(server, env, problems)
        clients = load_clients(data.get("clients", {}), server.token_env, server.host, env,
                               problems)

    providers: dict[str, ProviderConfig] = {}
    raw_providers = data.get("providers", {})
    if not isinstance(raw_providers, dict):
        problems.append("[providers]: must be a table of [providers.NAME] tables")
        raw_providers = {}
    for name, table in raw_providers.items():
        provider = _load_provider(name, table, adapters, problems, warnings)
        if provider is not None:
            providers[name] = provider

    routes = load_routes(data.get("routes", {}), providers, raw_providers, problems)

    if server is not None:
        check_shared(server, providers, problems)
    if problems:
        raise ConfigError([f"{source}: {p}" for p in problems])
    assert server is not None
    del packaged  # the packaged default never names a records path: it uses the state dir
    secret_env = _secret_env([server, *(s for p in providers.values()
                                        for s in (p.settings, *(a.settings
                                                                for a in p.accounts))),
                              *clients.values()])
    providers = {name: attrs.evolve(p, max_upstream_bytes=server.max_upstream_bytes,
                                    secret_env=secret_env) for name, p in providers.items()}
    return Config(server=server, providers=providers, routes=routes, source=source,
                  records_path=_records_path(server, base_dir),
                  server_overrides=dict(server_overrides or {}), clients=clients,
                  warnings=tuple(f"{source}: {w}" for w in warnings))


def _records_path(server: ServerConfig, base_dir: Path | None) -> Path:
    """``[server] records``, relative to the config file; default: the state dir's."""
    if server.records is None:
        return default_state_dir() / "relay-requests.jsonl"
    records = Path(server.records).expanduser()
    return records if records.is_absolute() else (base_dir or Path.cwd()) / records


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
    adapter = registry.get(kind) if isinstance(kind, str) else None
    if adapter is None:
        _unknown_kind(where, kind, table, registry, problems)
        return None
    assert isinstance(kind, str)   # the registry's keys are names

    before = len(problems)
    common = {k: table[k] for k in COMMON_PROVIDER_KEYS if k in table}
    rest = {k: val for k, val in table.items() if k not in COMMON_PROVIDER_KEYS}
    settings = structure_table(rest, adapter.Settings, where, problems,
                              also_valid=COMMON_PROVIDER_KEYS)
    if settings is not None:
        for key, message in adapter.settings_problems(settings):
            problems.append(f"[{where}] {key}: {message}")
    values = _common(where, common, adapter, problems)
    overrides = structure_table(common.get("profile", {}), _ProfileTable,
                                f"{where}.profile", problems)
    if settings is None or overrides is None or len(problems) > before:
        return None
    limits = _model_limits(where, common.get("limits", {}), problems)
    prices = _model_prices(where, common.get("prices", {}), problems)
    profile = _profile(where, name, kind, adapter, settings, overrides, problems, warnings)
    if profile is None or limits is None or prices is None:
        return None
    accounts = load_accounts(where, common.get("accounts"), rest, adapter, profile, problems)
    if accounts is None:
        return None
    every = [settings, *(a.settings for a in accounts)]
    return ProviderConfig(
        name=name, adapter=kind, profile=profile, settings=settings, **values, limits=limits,
        prices=prices, accounts=accounts,
        secret_envs=tuple(dict.fromkeys(e for s in every for e in adapter.secret_envs(s))),
        secret_values=tuple(dict.fromkeys(v for s in every
                                          for v in adapter.secret_values(s))),
        profile_from_file=frozenset(k for k, val in attrs.asdict(overrides).items()
                                    if val is not None))


def _model_limits(where: str, table: Any, problems: list[str]
                  ) -> dict[str, ModelLimits] | None:
    """``[providers.NAME.limits."MODEL"]``: each model's own budgets (SPEC L12a)."""
    if not isinstance(table, dict):
        problems.append(f"[{where}.limits]: must be a table of models, each a table "
                        "(rpm, tpm, itpm, otpm)")
        return None
    limits: dict[str, ModelLimits] = {}
    for model, figures in table.items():
        found = structure_table(figures, ModelLimits, f'{where}.limits."{model}"', problems)
        if found is not None:
            limits[model] = found
    return limits if len(limits) == len(table) else None


def _model_prices(where: str, table: Any, problems: list[str]) -> dict[str, Price] | None:
    """``[providers.NAME.prices."MODEL"]``: US dollars per million tokens (SPEC O7)."""
    if not isinstance(table, dict):
        problems.append(f"[{where}.prices]: must be a table of models, each a table "
                        "(input, cached_input, cache_write, output)")
        return None
    prices: dict[str, Price] = {}
    for model, figures in table.items():
        found = structure_table(figures, Price, f'{where}.prices."{model}"', problems)
        if found is not None:
            prices[model] = found
    return prices if len(prices) == len(table) else None


def _unknown_kind(where: str, kind: Any, table: dict[str, Any],
                  registry: Mapping[str, Any], problems: list[str]) -> None:
    # Without a kind, which keys are valid is not known: name the ones no kind takes.
    kinds = ", ".join(sorted(registry))
    settings_keys = sorted({f.name for a in registry.values()
                            for f in attrs.fields(a.Settings)})
    for key in table:
        if key not in COMMON_PROVIDER_KEYS and key not in settings_keys:
            problems.append(unknown_key(where, key, [*COMMON_PROVIDER_KEYS, *settings_keys],
                                        more=" (which of the last ones apply depends on "
                                        "the adapter)"))
    if kind is None:
        problems.append(f"[{where}] adapter: missing; one of: {kinds}")
    else:
        problems.append(f"[{where}] adapter: unknown adapter kind {kind!r}"
                        f"{did_you_mean(str(kind), sorted(registry))}; known kinds: {kinds}")


def _common(where: str, common: dict[str, Any], adapter: Any, problems: list[str]
            ) -> dict[str, Any]:
    """The common keys every provider takes, as `ProviderConfig` fields."""
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
    strict_fields = common.get("strict_fields", False)
    if not isinstance(strict_fields, bool):
        problems.append(f"[{where}] strict_fields: expected true or false")
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
    return {"models": models, "models_configured": bool(models), "prefill": prefill,
            "strict_fields": strict_fields, "check_model": check_model, "shared": shared is True,
            "check_interval_s": float(interval) if interval is not None else None}


def _profile(where: str, name: str, kind: str, adapter: Any, settings: Any,
             overrides: _ProfileTable, problems: list[str], warnings: list[str]
             ) -> Profile | None:
    """The adapter's recommended profile with the file's overrides laid over it, checked
    (SPEC L2, L3)."""
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
    return profile
