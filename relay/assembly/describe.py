"""What `relay config check` and `relay status` print: a config's resolved providers,
token budgets and routes, where the coding agents' own model names (and any the command
line names) resolve to, and the records line of a running daemon's status."""

from __future__ import annotations

from typing import Any

from relay.adapters import ADAPTERS
from relay.config import Config, RouteConfig, best_pattern
from relay.vocab.profile import ACCOUNT_PROFILE_KEYS

__all__ = ["AGENT_MODELS", "describe_config", "describe_providers", "describe_records",
           "resolution"]

# The model names the coding agents send by default, seen on the wire from the versions
# .ci/install-clis.sh pins (claude-code 2.1.332, codex 0.171.0, gemini-cli 0.61.0; Claude
# Code's dated ids are its aliases' own): `relay config check` shows where each goes
# (SPEC F9).
AGENT_MODELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("Claude Code", ("claude-opus-5-5", "claude-sonnet-4-5-20250929",
                     "claude-haiku-4-5-20251001")),
    ("Codex", ("gpt-6.2-sol",)),
    ("Gemini CLI", ("gemini-3.1-pro-preview", "gemini-3.5-flash-lite")),
)


def _targets(route: RouteConfig) -> str:
    said = route.primary
    if route.fallbacks:
        said += ", then " + ", then ".join(route.fallbacks)
    return said


def _route_line(route: RouteConfig) -> str:
    limits = [f"{key} {getattr(route, key):g} s" for key in (
        "primary_timeout_s", "fallback_timeout_s", "budget_s", "first_token_timeout_s",
        "stall_timeout_s") if getattr(route, key) is not None]
    if route.retries:
        limits.append(f"retries {route.retries}")
    name = f'"{route.name}" (pattern)' if route.is_pattern else route.name
    return f"  {name}: {_targets(route)}" + (f"; {', '.join(limits)}" if limits else "")


def resolution(config: Config, name: str) -> str:
    """Where a request for model ``name`` goes under ``config``, as relay resolves it
    (`relay.engine.plan.make_plan`), from the file alone: a provider's discovered models
    are not known here (one that lists ``name`` would take a bare name first)."""
    route = config.routes.get(name)
    if route is not None and not route.is_pattern:
        return f"route {name}: {_targets(route)}"
    head, slash, rest = name.partition("/")
    if slash:
        provider = config.providers.get(head)
        if provider is not None:
            if provider.models_configured and rest not in provider.models:
                return (f"404 unknown_model: provider {head!r} lists only "
                        f"{', '.join(provider.models)}")
            return f"provider {head}, model {rest} (no route)"
    else:
        owners = [p.name for p in config.providers.values() if name in p.models]
        if len(owners) > 1:
            return f"404 unknown_model: listed by several providers ({', '.join(owners)})"
        if owners:
            return f"provider {owners[0]}, model {name} (no route)"
    found = best_pattern(config.routes, name)
    if found is not None:
        return f'route "{found.name}": {_targets(found)}'
    return "404 unknown_model: no route, provider or route pattern takes it"


def _client_lines(config: Config) -> list[str]:
    """``[clients.NAME]`` (SPEC L14): each client's token variable (never the token), its
    priority, models, weight and limits."""
    if not config.clients:
        return ["clients: none ([clients] not set): every request is the client 'default'"
                + (f", with the token from {config.server.token_env}"
                   if config.server.token_env else "")]
    lines = ["clients:"]
    for name, c in config.clients.items():
        token = (f"token from {c.token_env}" if c.token_env else
                 f"token from {config.server.token_env} ([server])"
                 if config.server.token_env else "no token: the requests without one")
        lines.append(f"  {name}: {token}; priority {c.priority}, weight {c.weight:g}; "
                     f"models: {', '.join(c.models)}; {c.limits_text()}")
    return lines


def describe_config(config: Config, names: tuple[str, ...] = ()) -> str:
    """The config as `relay config check` prints it; ``names``: model names to resolve
    beside the agents' own (`AGENT_MODELS`)."""
    server = config.server
    lines = [f"config: {config.source}",
             f"server: {server.host}:{server.port}  heartbeat {server.heartbeat_s:g} s, "
             f"write timeout {server.write_timeout_s:g} s, drain grace "
             f"{server.drain_grace_s:g} s, token "
             f"{'from ' + server.token_env if server.token_env else 'off'}",
             f"records: {config.records_path}"]
    if config.shared_providers:
        lines.append(f"shared lanes: relay_id {config.relay_id}, prefix "
                     f"{server.coordination_prefix}, lease {server.coordination_lease_s:g} s, "
                     "server from " + (f"${server.coordination_url_env}"
                                       if server.coordination_url_env
                                       else "coordination_url"))
    lines.append("providers:")
    for name, p in config.providers.items():
        prof = p.profile
        models = ", ".join(p.models) if p.models else "(discovered)"
        detail = ADAPTERS[p.adapter].describe_settings(p.settings)
        lines.append(f"  {name}: adapter {p.adapter}; lanes {prof.lanes}, queue_max "
                     f"{prof.queue_max}, queue_timeout {prof.queue_timeout_s:g} s, run_timeout "
                     f"{prof.run_timeout_s:g} s, rpm {prof.rpm:g}, interrupt_grace "
                     f"{prof.interrupt_grace_s:g} s; models: {models}"
                     + (f"; {detail}" if detail else "")
                     + ("; shared across relays (SPEC L11)" if p.shared else ""))
        lines.append(f"    token budgets: {_budgets_line(p)}")
        lines += _account_lines(p)
    if not config.providers:
        lines.append("  (none)")
    lines.append("routes:")
    lines += [_route_line(route) for route in config.routes.values()] or ["  (none)"]
    lines += _client_lines(config)
    lines.append("model names, resolved (an exact route, PROVIDER/MODEL or a listed model "
                 "first, then the pattern with the longest literal prefix):")
    asked = [(name, "asked") for name in names]
    asked += [(name, agent) for agent, models in AGENT_MODELS for name in models]
    for name, who in asked:
        lines.append(f"  {name} ({who}) -> {resolution(config, name)}")
    return "\n".join(lines)


def _account_lines(p: Any) -> list[str]:
    """Each account (SPEC L13): where its key or login comes from (never the key), and
    the figures it sets apart from the provider's."""
    if not p.accounts:
        return []
    lines = [f"    accounts ({len(p.accounts)}; one queue, each request on the account "
             "that can start it soonest, a conversation on the one that served it):"]
    kind = ADAPTERS[p.adapter]
    for account in p.accounts:
        own = [f"{key} {getattr(account.profile, key):g}" for key in ACCOUNT_PROFILE_KEYS
               if getattr(account.profile, key) != getattr(p.profile, key)]
        detail = kind.describe_settings(account.settings)
        key_env = getattr(account.settings, "api_key_env", None)
        env = getattr(account.settings, "env", None)
        said = [f"key from ${key_env}" if key_env else "",
                f"env {', '.join(sorted(env))}" if env else "", detail,
                ", ".join(own)]
        lines.append(f"      {account.name}: " + ("; ".join(s for s in said if s)
                                                 or "the provider's settings"))
    return lines


def _budgets_line(p: Any) -> str:
    """Each token budget (SPEC L12) and where its figure comes from."""
    said = []
    for key, what in (("rpm", "requests"), ("tpm", "tokens"), ("itpm", "input tokens"),
                      ("otpm", "output tokens")):
        value = getattr(p.profile, key)
        if key in p.profile_from_file:
            where = f"[providers.{p.name}.profile] {key}"
        else:
            where = f"adapter {p.adapter!r}'s own profile"
        if value:
            said.append(f"{key} {value:g} {what}/min (from {where})")
        else:
            said.append(f"{key} not set (learned from the provider's rate-limit headers, "
                        "if it sends them)")
    for model, figures in sorted(p.limits.items()):
        own = [f"{key} {getattr(figures, key):g}" for key in ("rpm", "tpm", "itpm", "otpm")
               if getattr(figures, key)]
        said.append(f"model {model!r}: {', '.join(own) or 'nothing set'} per minute "
                    f'(from [providers.{p.name}.limits."{model}"])')
    if p.profile.first_starts:
        said.append(f"{p.profile.first_starts} at once of a model until its first answer")
    return "; ".join(said) + (". The provider's figures and holds are per model (SPEC "
                              "L12a); the ones above for the whole provider apply as well. "
                              "Where a configured figure and a header disagree, the lower "
                              "limit wins; the provider's 'remaining' always moves the "
                              "budget")


def describe_records(r: dict[str, Any]) -> str:
    """The ``records`` entry of the status as one line for ``relay status``."""
    if not r.get("path"):
        return "records: off"
    dropped = f"; {r['dropped']} dropped since relay started" if r.get("dropped") else ""
    if r.get("writing"):
        return f"records: {r['path']} (writing){dropped}"
    return (f"records: NOT WRITTEN to {r['path']} since {r.get('failing_since')}: "
            f"{r.get('reason')}; {r.get('kept_back')} kept back in memory{dropped}")


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes}m{secs:02d}s" if minutes < 60 else f"{minutes // 60}h{minutes % 60:02d}m"


def describe_requests(lines: list[dict[str, Any]]) -> str:
    """``relay ps``: the status's ``requests`` as a table (FOR: time in the present
    state)."""
    if not lines:
        return "nothing runs or waits"
    rows = [("PROVIDER", "MODEL", "CLIENT", "PRIORITY", "STATE", "FOR")]
    rows += [(q["provider"] + (f" ({q['account']})" if q.get("account") else ""),
              q["model"], q["client"], q["priority"], q["state"], _duration(q["for_s"]))
             for q in lines]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True))
                     .rstrip() for row in rows)


def describe_providers(providers: dict[str, Any]) -> str:
    """The status's providers as `relay status` prints them: a table of their lanes."""
    rows = [("PROVIDER", "ADAPTER", "STATE", "RUNNING", "QUEUED", "MODELS")]
    for name, p in providers.items():
        lanes = p["lanes"]
        state = p["state"] + (f" ({p['state_reason']})" if p.get("state_reason") else "")
        rows.append((name, p["adapter"], state, f"{lanes['running']}/{lanes['capacity']}",
                     f"{lanes['queued']}/{lanes['queue_max']}",
                     ", ".join(p["models"][:4]) + (" …" if len(p["models"]) > 4 else "")))
        for account in p.get("accounts") or ():  # SPEC L13: a line per account
            hold = (account.get("budgets") or {}).get("hold")
            said = account.get("state", "")
            if account.get("state_reason"):
                said += f" ({account['state_reason']})"
            elif hold:
                said += f" ({hold.get('reason', 'rate_limited')}, {hold['left_s']:.0f} s)"
            rows.append((f"  account {account['name']}", "", said,
                         f"{account.get('running', 0)}/{account.get('capacity', 0)}", "",
                         f"{account.get('started', 0)} started"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True))
                     .rstrip() for row in rows)
