"""The ``relay`` command line (SPEC 9).

    relay serve [--config FILE] [--host H] [--port N] [--env-file FILE] [--quiet]
    relay config check [--config FILE] [--model NAME …]
    relay status [--url URL] [--config FILE]
    relay check [PROVIDER…] [--url URL] [--config FILE]
    relay launch AGENT [--model M] [--url URL] [--print] [-- ARGS…]
    relay ps [--url URL] [--config FILE] [--json]
    relay usage [--since 7d|DATE] [--by day,client,…] [--json] [--db FILE|--records FILE…]
    relay service install|uninstall --systemd|--launchd [--config FILE] [--print]

A config error prints every problem (file, table, key, what is wrong) and exits 2; so
does an address ``serve`` cannot listen on (one line: the port, and how to pick another).
``status``, ``check``, ``ps`` and ``launch`` find the daemon by ``--url``, then
``RELAY_URL``, then the config's ``[server]`` host and port (the file ``serve`` would
read), then 127.0.0.1:8765, and say which URL they tried (`daemon_url`).
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from relay.config import Config

# Each command imports what it uses, in its own branch of `main`: ``relay usage`` reads a
# SQLite file and never imports the daemon (trio, the adapters, the front; ~0.4 s of a
# command's start), and ``relay status`` never imports the server.

GC_YOUNG_OBJECTS = 10_000  # gc's first threshold in the daemon (Python's default: 700)

__all__ = ["main"]

logger = logging.getLogger("relay")


def _parser() -> argparse.ArgumentParser:
    from . import launch, usage
    from .remote import DEFAULT_URL
    parser = argparse.ArgumentParser(prog="relay", description="A local daemon that relays AI "
                                     "requests to cloud APIs, local servers and "
                                     "command-line AI tools, with honest traffic control.")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the daemon")
    serve.add_argument("--config", help="config file (default: ./profiles.toml if present, "
                       "else the packaged default)")
    serve.add_argument("--host", help="address to bind (default from the config: 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port (default from the config: 8765)")
    serve.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING …")
    serve.add_argument("--quiet", action="store_true",
                       help="no log line per HTTP exchange (the relay.access logger)")
    serve.add_argument("--env-file", help="load KEY=VALUE lines into the environment "
                       "first (provider keys for a service; values are never logged)")
    config = sub.add_parser("config", help="configuration tools")
    config_sub = config.add_subparsers(dest="config_command", required=True)
    check = config_sub.add_parser("check", help="validate and print the resolved config")
    check.add_argument("--config")
    check.add_argument("--model", action="append", default=[], metavar="NAME",
                       help="also show where a request for this model name goes "
                       "(repeatable)")
    status = sub.add_parser("status", help="the lanes of a running daemon")
    checks = sub.add_parser("check", help="run connection checks on a running daemon")
    checks.add_argument("providers", nargs="*", help="provider names (default: all)")
    ps = sub.add_parser("ps", help="what runs and waits now on a running daemon")
    ps.add_argument("--json", action="store_true", help="the status's requests as JSON")
    launched = sub.add_parser("launch", allow_abbrev=False, help="run a coding agent on "
                              "the running relay", description=launch.DESCRIPTION,
                              usage="relay launch AGENT [--model M] [--url URL] [--print] "
                              "[-- ARGS…]")
    launched.add_argument("agent", choices=sorted(launch.AGENTS))
    launched.add_argument("--model", help="a route or PROVIDER/MODEL of relay's "
                          "(default: the agent's own, or relay's first model)")
    launched.add_argument("--print", action="store_true", dest="print_only",
                          help="show what it would set (keys masked) without running")
    for cmd in (status, checks, ps, launched):
        cmd.add_argument("--url", help="the daemon's URL (default: $RELAY_URL, else the "
                         "config's [server] host and port, else " + DEFAULT_URL + ")")
        cmd.add_argument("--config", help="the config whose [server] host and port to use "
                         "(default: ./profiles.toml if present, else the packaged default)")
    usage.add_parser(sub)
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
    from relay.adapters import ADAPTERS
    from relay.config import load_config
    from relay.vocab.errors import ConfigError
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
    # long because it is the one dispatcher of every subcommand (serve's set-up included)
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["launch"]:
        return _launch(argv)
    if argv[:1] == ["usage"]:
        return _usage(argv)
    args = _parser().parse_args(argv)
    if args.command == "serve":
        from relay.adapters.cli.process import become_subreaper
        from relay.front.guard import ACCESS_LOG
        from relay.vocab.errors import ConfigError

        from . import service
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
        # The daemon's format names no thread, process or source line: logging need not
        # look them up for each of the two lines a request logs (the logging HOWTO's
        # "Optimization"; ~1/3 of a line's cost), nor the caller's file and line (the
        # same HOWTO's ``_srcfile = None``: a frame walk, ~15 % of what is left). An
        # embedding program keeps its own.
        logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False
        logging._srcfile = None
        if args.quiet:
            logging.getLogger(ACCESS_LOG).setLevel(logging.WARNING)
        # The cycle collector's youngest generation at 10,000 objects, not 700: what a
        # request or a waiting notice holds for a few milliseconds to a few seconds (cancel
        # scopes, events, a connection's parser state) is mostly freed by its reference
        # count before a collection sees it, instead of being moved into the old
        # generation, whose full collections each walk every waiting request's objects
        # (~0.4 s with 2,000 queued streams, once every ~4 s). Cycles are still collected;
        # they wait a little longer. The daemon only: an embedding program keeps its own.
        import gc
        gc.set_threshold(GC_YOUNG_OBJECTS, *gc.get_threshold()[1:])
        # SPEC O5: orphans of the CLI tools' processes come to relay, which ends them
        # with their turn (the daemon only: an embedding program keeps its own tree).
        become_subreaper()
        return _run_daemon(config)
    if args.command == "config":
        import functools

        import trio

        from relay.shared.deployment import check_server

        from .describe import describe_config
        config = _load(args.config)
        if config is None:
            return 2
        print(describe_config(config, tuple(args.model)))
        url = config.coordination_url()
        if config.shared_providers and url:  # (SPEC O6: its rights, its eviction policy)
            for line in trio.run(functools.partial(
                    check_server, url, prefix=config.server.coordination_prefix)):
                print(line)
        return 0
    from . import remote
    if args.command == "status":
        return remote._status(remote.daemon_url(args.url, args.config))
    if args.command == "service":
        from . import service
        if args.service_command == "install":
            return service.install(args.kind, config_path=args.config,
                                   print_only=args.print_only)
        return service.uninstall(args.kind)
    if args.command == "check":
        return remote._check(remote.daemon_url(args.url, args.config), args.providers)
    if args.command == "ps":
        return remote._ps(remote.daemon_url(args.url, args.config, announce=not args.json),
                          args.json)
    return 2  # pragma: no cover - argparse refuses other commands


def _launch(argv: list[str]) -> int:
    """``relay launch``: what relay does not take, and everything after ``--``, is the
    agent's."""
    cut = argv.index("--") if "--" in argv else len(argv)
    args, passed = _parser().parse_known_args(argv[:cut])
    from . import launch
    from .remote import daemon_url
    return launch.main(args, passed + argv[cut + 1:],
                       daemon_url(args.url, args.config, announce=False))


def _usage(argv: list[str]) -> int:
    """``relay usage``, its own parser: what it imports is the usage database's reader
    (and the config's loader when it reads the config), not the daemon's modules."""
    from . import usage
    parser = argparse.ArgumentParser(prog="relay")
    usage.add_parser(parser.add_subparsers(dest="command", required=True))
    return usage.main(parser.parse_args(argv))


def _run_daemon(config: Config) -> int:
    """``trio.run(run_daemon)``; an address it cannot listen on is one line and exit 2."""
    import trio

    from relay.vocab.errors import ConfigError

    from .server import ListenError
    failed: ListenError | None = None
    problems: list[str] = []
    try:
        trio.run(run_daemon, config)
    except* ListenError as group:
        failed = next(e for e in _leaves(group) if isinstance(e, ListenError))
    except* ConfigError as group:
        # A problem only found while starting (SPEC L11: a shared provider's profile
        # differs from the one the relays sharing it agreed on) is a config error.
        problems = [p for leaf in _leaves(group) if isinstance(leaf, ConfigError)
                    for p in leaf.problems]
    if problems:
        print("relay: the configuration has problems:", file=sys.stderr)
        for problem in problems:
            print(f"  {problem}", file=sys.stderr)
        return 2
    if failed is not None:
        print(f"relay: {failed}", file=sys.stderr)
        return 2
    return 0


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in _leaves(inner)]
    return [exc]


async def run_daemon(config: Config) -> None:
    """Serve until SIGTERM/SIGINT: the first drains (SPEC O3), a second stops at once."""
    import signal

    import trio

    from relay.vocab.errors import ConfigError

    from .server import serve
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
                changes = await running.relay.reload_from_file()
            except ConfigError as exc:
                logger.error("SIGHUP: the config has problems; nothing changed:\n  %s",
                             "\n  ".join(exc.problems))
            else:
                if changes is not None:  # (None: a reload waiting its turn covers it)
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
