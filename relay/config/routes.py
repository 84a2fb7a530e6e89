"""Routes (SPEC F1-F4, F9): a model name clients can use, its targets checked against the
providers the file defines.

A route's name may be a pattern (F9): ``*`` matches any run of characters (``/``
included), every other character itself; its targets may hold ``{model}``, the name the
client asked for (``primary = "anthropic/{model}"``). A pattern is consulted only for a
name nothing else knows: an exact route, ``PROVIDER/MODEL`` or a bare model a provider
lists wins (`relay.engine.plan.make_plan`). Among the patterns that match a name, the one
with the longest literal prefix (the text before its first ``*``) wins; on a tie, the one
with more literal characters in all; on a tie again, the one the file defines first —
`best_pattern` is the one place that decides.
"""

from __future__ import annotations

import functools
import re
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
                 defined: Sequence[str] | None = None, any_model: bool = False
                 ) -> str | None:
    """What is wrong with a ``provider/model`` target, or None. ``defined``: every
    provider name the file defines (some may have problems of their own, so they are not
    in ``providers``), for the list of known names; ``any_model``: check the provider
    only (a pattern route's ``{model}`` target)."""
    provider, slash, model = target.partition("/")
    if not slash or not model:
        return f"{target!r} must be PROVIDER/MODEL"
    pconf = providers.get(provider)
    if pconf is None:
        names = list(defined if defined is not None else providers)
        return (f"{target!r} names no provider{did_you_mean(provider, names)} (providers "
                f"defined: {', '.join(names) or 'none'})")
    if pconf.models_configured and not any_model and \
            model.partition("?")[0] not in pconf.models:
        return (f"{target!r}: provider {provider!r} lists only "
                f"{', '.join(pconf.models)}")
    return None


MODEL = "{model}"  # in a pattern route's targets: the name the client asked for
_BRACES = re.compile(r"[{}]")


def is_pattern(name: str) -> bool:
    """Whether a route name is a pattern (SPEC F9)."""
    return "*" in name


def literal_prefix(pattern: str) -> str:
    return pattern.partition("*")[0]


@functools.lru_cache(maxsize=256)
def _compiled(pattern: str) -> re.Pattern[str]:
    return re.compile(".*".join(re.escape(part) for part in pattern.split("*")), re.DOTALL)


def pattern_matches(pattern: str, name: str) -> bool:
    """Whether ``name`` matches the route pattern (``*``: any run of characters)."""
    return _compiled(pattern).fullmatch(name) is not None


def _specificity(pattern: str) -> tuple[int, int]:
    return len(literal_prefix(pattern)), len(pattern.replace("*", ""))


def best_pattern(routes: Mapping[str, RouteConfig], name: str) -> RouteConfig | None:
    """The pattern route ``name`` resolves to, its targets' ``{model}`` replaced by
    ``name`` (its ``name`` stays the pattern), or None when no pattern matches.
    The longest literal prefix wins, then the most literal characters, then the first
    defined (see the module docstring)."""
    best: RouteConfig | None = None
    for route in routes.values():   # in the file's order: a tie keeps the first
        if route.is_pattern and pattern_matches(route.name, name) and (
                best is None or _specificity(route.name) > _specificity(best.name)):
            best = route
    if best is None:
        return None
    return attrs.evolve(best, primary=best.primary.replace(MODEL, name),
                        fallbacks=tuple(t.replace(MODEL, name) for t in best.fallbacks))


def _pattern_problem(name: str) -> str | None:
    if "**" in name:
        return "'**' matches what one '*' does: write a single '*'"
    if not name.replace("*", ""):
        return ("a pattern of '*' alone would answer every unknown name with this route's "
                "model; give it a literal part, as in 'claude-*'")
    if _BRACES.search(name):
        return "a pattern holds no '{' or '}' ('*' is its only wildcard)"
    if any(ch.isspace() or not ch.isprintable() for ch in name):
        return "a pattern holds no spaces or control characters"
    return None


def _template_problem(target: str, pattern: bool) -> str | None:
    """What is wrong with the placeholders of a target, or None."""
    provider, _, model = target.partition("/")
    if not _BRACES.search(target):
        return None
    if not pattern:
        return (f"{target!r}: only a pattern route's targets may use {MODEL} (this route's "
                "name has no '*')")
    if _BRACES.search(provider):
        return f"{target!r}: {MODEL} may stand only in the model part (PROVIDER/{MODEL})"
    if _BRACES.search(model.replace(MODEL, "")):
        return (f"{target!r}: the only placeholder is {MODEL} (the name the client asked "
                "for)")
    return None


def _load_route(name: str, table: Any, providers: Mapping[str, ProviderConfig],
                raw_providers: Mapping[str, Any], problems: list[str]) -> RouteConfig | None:
    where = f'routes."{name}"' if is_pattern(name) else f"routes.{name}"
    if not name or "/" in name:
        problems.append(f"[{where}]: a route name must be non-empty and contain no '/'")
        return None
    if is_pattern(name) and (bad := _pattern_problem(name)) is not None:
        problems.append(f"[{where}]: bad pattern {name!r}: {bad}")
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
        problem = _template_problem(target, is_pattern(name))
        if problem is None:
            # A {model} target names its model per request (a provider that lists its
            # models answers a name outside them with a 404 then): its provider now.
            problem = check_target(target, providers, defined=list(raw_providers),
                                   any_model=MODEL in target)
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
