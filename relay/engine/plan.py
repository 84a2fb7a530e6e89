"""A request's plan: the targets a model name resolves to, in the order they are tried
(SPEC A1, F1, F3)."""

from __future__ import annotations

import logging
from typing import Any

import attrs
import trio

from relay.capacity.lanes import Lane
from relay.config import RouteConfig, best_pattern, check_target
from relay.shared.accounts import SharedAccounts
from relay.vocab.errors import RelayError

from .engine import Engine
from .providers import Provider

__all__ = ["ACCOUNT_FAILURES", "FALLBACK_ON", "RETRY_ON", "Plan", "Target", "make_plan",
           "moves", "pattern_for"]

logger = logging.getLogger("relay.dispatch")

# F2: the failures a different target may fix.
FALLBACK_ON = frozenset({
    "run_timeout", "attempt_timeout", "first_token_timeout", "stall_timeout",
    "rate_limited", "quota_exhausted", "stream_cut", "bad_upstream_response",
    "upstream_unavailable", "upstream_error", "context_too_long",
    "provider_queue_full", "provider_queue_timeout",
    "request_too_large",  # a provider with a larger budget may take it (SPEC L12)
    "coordination_unavailable", "coordination_lost",  # the next target may be local (L11)
})
# F3: the failures the same target may fix when asked again (never a timeout or a 4xx).
RETRY_ON = frozenset({"rate_limited", "upstream_error", "upstream_unavailable", "stream_cut"})


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

    def timeout_error(self, reason: str, target: Target, own: float | None) -> RelayError:
        """The failure of an attempt on ``target`` stopped at one of its deadlines
        (``own``: its attempt timeout)."""
        name, provider, route = target.name, target.provider.name, self.route
        if reason == "attempt_timeout":
            said = f"{name} did not answer within its attempt timeout of {own:g} s"
        elif reason == "budget_exhausted":
            said = (f"route {route.name if route else ''!r} ran out of its "
                    f"{route.total_budget_s() if route else 0:g} s budget while {name} "
                    "was answering")
        elif reason == "run_timeout":
            limit = target.provider.config.profile.run_timeout_s
            said = (f"provider {provider!r} did not finish within its run timeout of "
                    f"{limit:g} s ([providers.{provider}.profile] run_timeout_s)")
        elif reason == "first_token_timeout":
            said = (f"{name} sent no first token within {route.first_token_timeout_s:g} s "
                    if route else "")
        else:
            said = (f"{name} stalled: no token for {route.stall_timeout_s:g} s" if route
                    else "")
        return RelayError(reason, f"{said.rstrip()}; it was stopped", provider=provider,
                          action=self.timeout_action(reason, target))

    def timeout_action(self, reason: str, target: Target) -> str:
        """What to do about a timeout of ``target`` (issue 15): the limit that fired, its
        value and where it is set; a limit is raised only if calls really take that long."""
        route, table = self.route, f"[routes.{self.route.name if self.route else ''}]"
        if reason == "run_timeout":
            limit = target.provider.config.profile.run_timeout_s
            return (f"if calls really take over {limit:g} s, raise run_timeout_s in "
                    f"[providers.{target.provider.name}.profile]; otherwise ask for a "
                    "shorter answer (max_tokens)")
        if route is None:  # the other limits are a route's
            return "retry; ask for a shorter answer if it keeps happening"
        if reason == "attempt_timeout":
            key = "primary_timeout_s" if target.role == "primary" else "fallback_timeout_s"
            return (f"raise {key} (now {self.timeout_for(target) or 0:g} s) in {table} if "
                    f"{target.name} needs longer, or ask for a shorter answer")
        if reason == "budget_exhausted":
            return (f"raise budget_s (now {route.total_budget_s() or 0:g} s) in {table}, or "
                    "shorten its attempt timeouts so that its fallbacks get their turn")
        if reason == "first_token_timeout":
            return (f"raise first_token_timeout_s (now {route.first_token_timeout_s or 0:g} "
                    f"s) in {table} if {target.name} is slow to start (a long prompt, a "
                    "model still loading)")
        return (f"raise stall_timeout_s (now {route.stall_timeout_s or 0:g} s) in {table} "
                f"if {target.name} pauses this long between tokens")


def pattern_for(relay: Engine, model: str) -> RouteConfig | None:
    """The pattern route (SPEC F9) that takes ``model``, a name no exact route or
    provider resolves, its targets' ``{model}`` filled in; None if none does. A name
    that names a provider (``PROVIDER/…``), or a bare name some provider lists, is no
    pattern's: the provider's 404, or the choice between providers, is the client's."""
    head, slash, _ = model.partition("/")
    if head in relay.providers if slash else any(
            model in p.models for p in relay.providers.values()):
        return None
    return best_pattern(relay.config.routes, model)


def _resolve(relay: Engine, model: str) -> tuple[RouteConfig | None, tuple[Provider, str]]:
    """``model`` as an exact name (``PROVIDER/MODEL``, a bare model), else through the
    pattern route it matches (SPEC F9: exact names first), else the exact name's
    ``unknown_model`` (naming what is known): never another model in silence."""
    try:
        return None, relay.resolve(model)
    except RelayError as exc:
        unknown = exc
    route = pattern_for(relay, model)
    if route is None:
        raise unknown
    try:
        return route, relay.resolve(route.primary)
    except RelayError as exc:
        raise RelayError(
            "unknown_model", f"model {model!r} matches the route pattern {route.name!r}, "
            f"whose target {route.primary!r} is not known: {exc.message}", param="model",
            action=exc.action) from None


def make_plan(relay: Engine, model: str, body_fallbacks: Any) -> Plan:
    """Resolve ``model`` (a route, ``provider/model``, a bare model, or a name a route
    pattern matches) and the body's own ``fallbacks`` (which replace the route's; ``[]``
    means none).

    Raises:
        RelayError: ``unknown_model`` or ``invalid_request``.
    """
    route = relay.config.routes.get(model)
    if route is not None and not route.is_pattern:
        provider, name = relay.resolve(route.primary)
        fallbacks = list(route.fallbacks)
    else:
        route, (provider, name) = _resolve(relay, model)
        fallbacks = list(route.fallbacks) if route is not None else []
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
            raise RelayError("unknown_model", f"fallback {problem}", param="fallbacks",
                             action="name configured targets in 'fallbacks' "
                             "(PROVIDER/MODEL; GET /v1/models lists them), or leave it out")
        fb_provider, fb_model = relay.resolve(entry)
        target = Target(fb_provider, fb_model, "fallback")
        if target.name in seen:
            raise RelayError("invalid_request", f"fallback {entry!r} is listed twice (or "
                             "is the primary); each target is tried at most once",
                             param="fallbacks")
        seen.add(target.name)
        targets.append(target)
    return Plan(targets, route)


# SPEC L13: the failures that are an account's, not the request's: another account of the
# same provider is tried at once.
ACCOUNT_FAILURES = frozenset({"rate_limited", "quota_exhausted", "auth_required"})


def moves(target: Target, error: RelayError | None, account: str | None,
          avoid: frozenset[str], deadline: float, request_id: str) -> frozenset[str] | None:
    """The accounts to avoid when an attempt on ``target`` failed for its account's sake
    — a rate limit, a quota or usage window, a refused key (SPEC L13: a same-target retry,
    F3) — and another account of the provider is left to try in time; else None."""
    lane = target.provider.lane
    if (error is None or error.reason not in ACCOUNT_FAILURES or not account
            or not isinstance(lane, Lane | SharedAccounts)
            or trio.current_time() >= deadline):
        return None
    avoid = avoid | {account}
    if not lane.others(avoid):
        return None
    logger.info("account_moved request=%s target=%s from=%s reason=%s: another account of "
                "the provider takes it", request_id, target.name, account, error.reason)
    return avoid
