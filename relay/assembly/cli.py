"""The ``relay`` command line (SPEC 9).

    relay serve [--config FILE] [--host H] [--port N] [--env-file FILE]
    relay config check [--config FILE]
    relay status [--url URL]
    relay check [PROVIDER…] [--url URL]
    relay service install|uninstall --systemd|--launchd [--config FILE] [--print]

A config error prints every problem (file, table, key, what is wrong) and exits 2.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from typing import Any

import trio

from relay.adapters import ADAPTERS
from relay.adapters._process import become_subreaper
from relay.api.http import get_json, post_json
from relay.config import Config, load_config
from relay.vocab.errors import ConfigError

from . import service
from .server import serve

__all__ = ["main"]

logger = logging.getLogger("relay")
DEFAULT_URL = "http://127.0.0.1:8765"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="relay", description="A local OpenAI-API relay "
                                     "with honest traffic control.")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the daemon")
    serve.add_argument("--config", help="config file (default: ./profiles.toml if present, "
                       "else the packaged default)")
    serve.add_argument("--host", help="address to bind (default from the config: 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port (default from the config: 8765)")
    serve.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING …")
    serve.add_argument("--env-file", help="load KEY=VALUE lines into the environment "
                       "first (provider keys for a service; values are never logged)")
    config = sub.add_parser("config", help="configuration tools")
    config_sub = config.add_subparsers(dest="config_command", required=True)
    check = config_sub.add_parser("check", help="validate and print the resolved config")
    check.add_argument("--config")
    status = sub.add_parser("status", help="the lanes of a running daemon")
    status.add_argument("--url", default=os.environ.get("RELAY_URL", DEFAULT_URL))
    checks = sub.add_parser("check", help="run connection checks on a running daemon")
    checks.add_argument("providers", nargs="*", help="provider names (default: all)")
    checks.add_argument("--url", default=os.environ.get("RELAY_URL", DEFAULT_URL))
    service = sub.add_parser("service", help="run relay as a systemd or launchd service")
    service_sub = service.add_subparsers(dest="service_command", required=True)
    for action in ("install", "uninstall"):
        cmd = service_sub.add_parser(action, help=f"{action} the user unit / LaunchAgent")
        kind = cmd.add_mutually_exclusive_group(required=True)
        kind.add_argument("--systemd", dest="kind", action="store_const", const="systemd",
                          help="~/.config/systemd/user/relay.service")
        kind.add_argument("--launchd", dest="kind", action="store_const", const="launchd",
                          help="~/Library/LaunchAgents/local.relay.plist")
        if action == "install":
            cmd.add_argument("--config", help="config file (default: ./profiles.toml if "
                             "present, else the packaged default)")
            cmd.add_argument("--print", action="store_true", dest="print_only",
                             help="write the unit / plist to stdout instead")
    return parser


def _load(path: str | None, overrides: dict[str, Any] | None = None) -> Config | None:
    try:
        config = load_config(path, ADAPTERS, server_overrides=overrides)
    except ConfigError as exc:
        print("relay: the configuration has problems:", file=sys.stderr)
        for problem in exc.problems:
            print(f"  {problem}", file=sys.stderr)
        return None
    for warning in config.warnings:
        print(f"relay: {warning}", file=sys.stderr)
    return config


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "serve":
        overrides = {k: v for k, v in (("host", args.host), ("port", args.port))
                     if v is not None}
        if args.env_file is not None:
            try:
                names = service.load_env_file(args.env_file)
            except ConfigError as exc:
                print("relay: " + "\n  ".join(exc.problems), file=sys.stderr)
                return 2
            print(f"relay: environment from {args.env_file}: {', '.join(names) or '(none)'}",
                  file=sys.stderr)
        config = _load(args.config, overrides)
        if config is None:
            return 2
        logging.basicConfig(level=args.log_level.upper(),
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        # SPEC O5: orphans of the CLI tools' processes come to relay, which ends them
        # with their turn (the daemon only: an embedding program keeps its own tree).
        become_subreaper()
        try:
            trio.run(run_daemon, config)
        except BaseException as exc:
            # A problem only found while starting (SPEC L11: a shared provider's profile
            # differs from the one the relays sharing it agreed on) is a config error.
            problems = _config_problems(exc)
            if not problems:
                raise
            print("relay: the configuration has problems:", file=sys.stderr)
            for problem in problems:
                print(f"  {problem}", file=sys.stderr)
            return 2
        return 0
    if args.command == "config":
        config = _load(args.config)
        if config is None:
            return 2
        print(describe_config(config))
        return 0
    if args.command == "status":
        return _status(args.url)
    if args.command == "service":
        if args.service_command == "install":
            return service.install(args.kind, config_path=args.config,
                                   print_only=args.print_only)
        return service.uninstall(args.kind)
    if args.command == "check":
        return _check(args.url, args.providers)
    return 2  # pragma: no cover - argparse refuses other commands


async def run_daemon(config: Config) -> None:
    """Serve until SIGTERM/SIGINT: the first drains (SPEC O3), a second stops at once."""
    shutdown = trio.Event()
    async with trio.open_nursery() as nursery:
        async def watch_signals(task_status: trio.TaskStatus[None]) -> None:
            with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT,
                                           signal.SIGHUP) as signals:
                task_status.started()
                async for signum in signals:
                    if signum == signal.SIGHUP:
                        nursery.start_soon(reload)
                    elif not shutdown.is_set():
                        logger.info("%s: draining (a second signal stops at once)",
                                    signal.Signals(signum).name)
                        shutdown.set()
                    else:
                        logger.info("second signal: stopping now")
                        nursery.cancel_scope.cancel()

        async def reload() -> None:
            if running is None:
                logger.warning("SIGHUP before relay was listening: ignored")
                return
            try:
                changes = await running.relay.reload()
            except ConfigError as exc:
                logger.error("SIGHUP: the config has problems; nothing changed:\n  %s",
                             "\n  ".join(exc.problems))
            else:
                logger.info("SIGHUP: reloaded (%s)", "; ".join(changes) or "no changes")

        async def run_server(task_status: trio.TaskStatus[Any]) -> None:
            await serve(config, shutdown=shutdown, task_status=task_status)
            nursery.cancel_scope.cancel()  # drained: stop the signal watcher

        running = None
        await nursery.start(watch_signals)
        served = running = await nursery.start(run_server)
        names = ", ".join(served.relay.providers)
        print(f"relay listening on {served.url} (config {config.source}; providers: "
              f"{names}; records: {config.records_path})", file=sys.stderr, flush=True)


def _config_problems(exc: BaseException) -> list[str]:
    """The problems of the ConfigError(s) inside ``exc`` (exception groups included),
    when that is all it holds."""
    if isinstance(exc, ConfigError):
        return list(exc.problems)
    if isinstance(exc, BaseExceptionGroup):
        matched, rest = exc.split(ConfigError)
        if matched is not None and rest is None:
            return [p for e in _leaves(matched) for p in e.problems]
    return []


def _leaves(group: BaseExceptionGroup[Any]) -> list[ConfigError]:
    out: list[ConfigError] = []
    for e in group.exceptions:
        if isinstance(e, BaseExceptionGroup):
            out += _leaves(e)
        elif isinstance(e, ConfigError):
            out.append(e)
    return out


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
    if not config.providers:
        lines.append("  (none)")
    return "\n".join(lines)


def _check(url: str, names: list[str]) -> int:
    """Check each provider (all by default) and print one readable line each."""
    token = os.environ.get("RELAY_TOKEN")
    base = url.rstrip("/")
    try:
        if not names:
            code, body = get_json(base + "/relay/v1/status", token=token)
            if code != 200:
                print(f"relay: status answered {code}: "
                      f"{body.get('error', {}).get('message')}", file=sys.stderr)
                return 1
            names = list(body["providers"])
        failed = False
        for name in names:
            code, body = post_json(f"{base}/relay/v1/providers/{name}/check", token=token,
                                   timeout_s=900.0)
            if code != 200:
                print(f"{name}: {body.get('error', {}).get('message')}")
                failed = True
                continue
            state = body["status"]["state"]
            mark = {"answered": "ok", "busy": "busy", "failed": "FAILED"}[body["outcome"]]
            detail = body["message"]
            if body.get("answer"):
                detail += f": {body['answer'].strip()[:60]!r}"
            print(f"{name}: {mark} — {state}; {detail}")
            failed |= body["outcome"] == "failed"
    except OSError as exc:
        print(f"relay: {exc}", file=sys.stderr)
        return 1
    return 1 if failed else 0


def _status(url: str) -> int:
    token_env = os.environ.get("RELAY_TOKEN")
    try:
        code, body = get_json(url.rstrip("/") + "/relay/v1/status", token=token_env)
    except OSError as exc:
        print(f"relay: {exc}", file=sys.stderr)
        return 1
    if code != 200:
        print(f"relay: status answered {code}: {body.get('error', {}).get('message')}",
              file=sys.stderr)
        return 1
    rows = [("PROVIDER", "ADAPTER", "STATE", "RUNNING", "QUEUED", "MODELS")]
    for name, p in body["providers"].items():
        lanes = p["lanes"]
        state = p["state"] + (f" ({p['state_reason']})" if p.get("state_reason") else "")
        rows.append((name, p["adapter"], state, f"{lanes['running']}/{lanes['capacity']}",
                     f"{lanes['queued']}/{lanes['queue_max']}",
                     ", ".join(p["models"][:4]) + (" …" if len(p["models"]) > 4 else "")))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    return 0
