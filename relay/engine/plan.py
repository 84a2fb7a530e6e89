"""A request's plan: the targets a model name resolves to, in the order they are tried
(SPEC A1, F1, F3)."""

from __future__ import annotations

from typing import Any

import attrs

from relay.config import RouteConfig, check_target
from relay.vocab.errors import RelayError

from .engine import Engine
from .providers import Provider

__all__ = ["Plan", "Target", "make_plan"]


@attrs.frozen
class Target:
    provider: Provider
    model: str
    role: str  # primary | fallback

    @property
    def name(self) -> str:
        return f"{self.provider.name}/{self.model}"


@attrs.frozen
class Plan:
    targets: list[Target]
    route: RouteConfig | None = None

    @property
    def retries(self) -> int:
        return self.route.retries if self.route else 0

    def timeout_for(self, target: Target) -> float | None:
        if self.route is None:
            return None
        if target.role == "primary":
            return self.route.primary_timeout_s
        return self.route.fallback_timeout_s


def make_plan(relay: Engine, model: str, body_fallbacks: Any) -> Plan:
    """Resolve ``model`` (a route, ``provider/model`` or a bare model) and the body's own
    ``fallbacks`` (which replace the route's; ``[]`` means none).

    Raises:
        RelayError: ``unknown_model`` or ``invalid_request``.
    """
    route = relay.config.routes.get(model)
    if route is not None:
        provider, name = relay.resolve(route.primary)
        fallbacks = list(route.fallbacks)
    else:
        provider, name = relay.resolve(model)
        fallbacks = []
    if body_fallbacks is not None:
        if not isinstance(body_fallbacks, list) or not all(
                isinstance(f, str) for f in body_fallbacks):
            raise RelayError("invalid_request", "'fallbacks' must be a list of "
                             "PROVIDER/MODEL strings", param="fallbacks")
        fallbacks = body_fallbacks
    targets = [Target(provider, name, "primary")]
    seen = {targets[0].name}
    for entry in fallbacks:
        problem = check_target(entry, {n: p.config for n, p in relay.providers.items()})
        if problem is not None:
            raise RelayError("unknown_model", f"fallback {problem}", param="fallbacks")
        fb_provider, fb_model = relay.resolve(entry)
        target = Target(fb_provider, fb_model, "fallback")
        if target.name in seen:
            raise RelayError("invalid_request", f"fallback {entry!r} is listed twice (or "
                             "is the primary); each target is tried at most once",
                             param="fallbacks")
        seen.add(target.name)
        targets.append(target)
    return Plan(targets, route)
