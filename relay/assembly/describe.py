"""What `relay config check` and `relay status` print: a config's resolved providers and
token budgets, and the records line of a running daemon's status."""

from __future__ import annotations

from typing import Any

from relay.adapters import ADAPTERS
from relay.config import Config

__all__ = ["describe_config", "describe_records"]


def describe_config(config: Config) -> str:
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
    if not config.providers:
        lines.append("  (none)")
    return "\n".join(lines)


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
    return "; ".join(said) + (". Where a configured figure and a header disagree, the "
                              "lower limit wins; the provider's 'remaining' always moves "
                              "the budget")


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
    rows += [(q["provider"], q["model"], q["client"], q["priority"], q["state"],
              _duration(q["for_s"])) for q in lines]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True))
                     .rstrip() for row in rows)
