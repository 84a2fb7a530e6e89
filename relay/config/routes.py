"""Routes (SPEC F1-F4): a model name clients can use, its targets checked against the
providers the file defines."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from relay.api.adapter import Adapter
from relay.vocab.profile import (
    ProviderConfig,
)

from .schema import RouteConfig
from .structure import (
    did_you_mean,
    structure_table,
)

Registry = Mapping[str, "type[Adapter]"]


def check_target(target: str, providers: Mapping[str, ProviderConfig], *,
                 defined: Sequence[str] | None = None) -> str | None:
    """What is wrong with a ``provider/model`` target, or None. ``defined``: every
    provider name the file defines (some may have problems of their own, so they are not
    in ``providers``), for the list of known names."""
    provider, slash, model = target.partition("/")
    if not slash or not model:
        return f"{target!r} must be PROVIDER/MODEL"
    pconf = providers.get(provider)
    if pconf is None:
        names = list(defined if defined is not None else providers)
        return (f"{target!r} names no provider{did_you_mean(provider, names)} (providers "
                f"defined: {', '.join(names) or 'none'})")
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
    route = structure_table(table, RouteConfig, where, problems, hidden=("name",))
    if route is None:
        return None
    ok = True
    for key, target in [("primary", route.primary)] + [
            (f"fallbacks[{i}]", t) for i, t in enumerate(route.fallbacks)]:
        if target.partition("/")[0] not in providers and target.partition("/")[0] in \
                raw_providers:
            ok = False  # that provider's own table already has a problem
            continue
        problem = check_target(target, providers, defined=list(raw_providers))
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


def load_routes(raw_routes: Any, providers: Mapping[str, ProviderConfig],
                raw_providers: Any, problems: list[str]) -> dict[str, RouteConfig]:
    """Every ``[routes.NAME]`` table (SPEC F1-F4)."""
    routes: dict[str, RouteConfig] = {}
    if not isinstance(raw_routes, dict):
        problems.append("[routes]: must be a table of [routes.NAME] tables")
        return routes
    for name, table in raw_routes.items():
        route = _load_route(name, table, providers, raw_providers, problems)
        if route is not None:
            routes[name] = route
    return routes
