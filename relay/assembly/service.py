"""Running relay as a user service: systemd unit and launchd LaunchAgent (SPEC O3).

    relay service install --systemd|--launchd [--config FILE] [--print]
    relay service uninstall --systemd|--launchd

What a service lacks, and how the generated files supply it:

- **A PATH.** Services start with a minimal PATH, so the CLI adapters' tools (``claude``,
  ``codex``, ``gemini``, and ``node``, which they run on) would not be found. The files set
  ``PATH`` to the folders where this shell finds them, plus the usual ones.
- **The provider keys.** They live in an environment file, ``~/.config/relay/env``
  (``KEY=VALUE`` lines), created empty and owner-only (0600) if missing; relay never
  writes a secret into it, nor into the unit. systemd reads it with ``EnvironmentFile=``;
  launchd has no such key, so the LaunchAgent runs ``relay serve --env-file FILE``, which
  loads the same lines before reading the config (`load_env_file`; values are never
  logged).
- **Time to drain.** On stop, systemd and launchd send SIGTERM and, after a timeout, kill.
  relay drains for ``drain_grace_s``, then stops what remains (CLI tools get their
  ``interrupt_grace_s``), so the timeout given is longer than both plus a margin. systemd's
  ``KillMode=mixed`` sends the SIGTERM to relay alone: the CLI tools it runs keep going
  through the grace and are stopped by relay itself.
- **Restarts.** On failure only (``Restart=on-failure``; launchd ``KeepAlive`` with
  ``SuccessfulExit = false``); exit status 2, a config error, is not retried by systemd.

The config is validated at install time (with the env file's variables), and its absolute
path is written into the unit: a service has no useful working directory.
"""

from __future__ import annotations

import math
import os
import plistlib
import re
import shutil
import stat
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

import attrs

from relay.adapters import ADAPTERS
from relay.config import Config, default_config_path, parse_config
from relay.vocab.errors import ConfigError

__all__ = ["LAUNCHD_LABEL", "install", "launchd_plist", "load_env_file", "systemd_unit",
           "uninstall"]

SYSTEMD_UNIT = "relay.service"
LAUNCHD_LABEL = "local.relay"
STOP_MARGIN_S = 15.0  # beyond drain grace + interrupt grace + relay's own 2 s wait
TOOLS = ("node", "claude", "codex", "gemini")
_ENV_LINE = re.compile(r"^(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)\s*=(.*)$")


# --- the environment file ------------------------------------------------------------------

def env_file_path(home: Path) -> Path:
    return home / ".config" / "relay" / "env"


def parse_env_file(text: str, source: str) -> dict[str, str]:
    """``KEY=VALUE`` lines; blank lines and ``#`` comments skipped; ``export `` allowed;
    a value in matching single or double quotes is unquoted.

    Raises:
        ConfigError: naming every malformed line by number (never showing its value).
    """
    values: dict[str, str] = {}
    problems = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = _ENV_LINE.match(line)
        if match is None:
            problems.append(f"{source}: line {number}: expected KEY=VALUE")
            continue
        key, value = match.group(1), match.group(2).strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        values[key] = value
    if problems:
        raise ConfigError(problems)
    return values


def load_env_file(path: str | os.PathLike[str]) -> list[str]:
    """Load an environment file into ``os.environ`` (its values win) for ``relay serve
    --env-file``.

    Returns:
        the names it set (for a log line: the values are never shown).

    Raises:
        ConfigError: the file cannot be read or has malformed lines.
    """
    file = Path(path).expanduser()
    try:
        text = file.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError([f"{file}: cannot read the environment file: "
                           f"{exc.strerror or exc}"]) from exc
    values = parse_env_file(text, str(file))
    os.environ.update(values)
    return sorted(values)


def _ensure_env_file(path: Path) -> str:
    """Create the env file empty and owner-only when missing; never touch one that exists."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    if not path.exists():
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        os.chmod(path, 0o600)  # whatever the umask did
        return (f"created {path} (empty, mode 0600): put the provider keys there, one "
                "KEY=VALUE a line (e.g. OPENAI_API_KEY=...)")
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        return (f"WARNING: {path} is readable by others (mode {mode:04o}); "
                f"run: chmod 600 {path}")
    return f"keys are read from {path}"


class _AssumeSet(Mapping[str, str]):
    """The environment for validating at install time: a variable that is missing here
    may be set in the env file later; `install` reports those itself."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self.env = env

    def __getitem__(self, key: str) -> str:
        return self.env.get(key) or "(set when the service runs)"

    def __iter__(self) -> Iterator[str]:
        return iter(self.env)

    def __len__(self) -> int:
        return len(self.env)


# --- the PATH a service gets -----------------------------------------------------------------

def service_path(home: Path, config: Config | None = None) -> str:
    """Where this shell finds the CLI tools and node, then the usual folders."""
    names = list(TOOLS)
    if config is not None:
        for provider in config.providers.values():
            command = getattr(provider.settings, "command", None)
            if isinstance(command, str) and command:
                names.append(command)
    dirs = []
    for name in names:
        found = shutil.which(name)
        if found:
            dirs.append(str(Path(found).parent))
    dirs += [str(home / ".local" / "bin"), str(home / ".npm-global" / "bin")]
    if sys.platform == "darwin":
        dirs += ["/opt/homebrew/bin"]
    dirs += ["/usr/local/bin", "/usr/bin", "/bin"]
    return ":".join(dict.fromkeys(dirs))


def stop_timeout_s(config: Config) -> int:
    """Longer than relay's whole drain: grace, then the slowest interrupt grace, then the
    2 s relay waits for stopped requests, plus a margin."""
    interrupt = max((p.profile.interrupt_grace_s for p in config.providers.values()),
                    default=0.0)
    return math.ceil(config.server.drain_grace_s + interrupt + 2.0 + STOP_MARGIN_S)


# --- the files -------------------------------------------------------------------------------

def _systemd_value(arg: str, *, exec_line: bool = False) -> str:
    """One ExecStart/Environment word: ``%`` escaped (specifiers), ``$`` too on an
    ``Exec*`` line (where it expands variables), quoted when needed."""
    escaped = arg.replace("%", "%%")
    if exec_line:
        escaped = escaped.replace("$", "$$")
    if re.fullmatch(r"[A-Za-z0-9_@%+=:,./-]+", escaped):
        return escaped
    return '"' + escaped.replace("\\", "\\\\").replace('"', '\\"') + '"'


def systemd_unit(*, argv: list[str], env_file: Path, path: str, stop_timeout: int,
                 config_source: str) -> str:
    exec_start = " ".join(_systemd_value(a, exec_line=True) for a in argv)
    env_file_value = str(env_file).replace("%", "%%")
    return f"""\
# Written by `relay service install --systemd` for {config_source}.
# Provider keys: {env_file} (KEY=VALUE lines; relay never writes secrets here).
# Start:  systemctl --user daemon-reload && systemctl --user enable --now relay.service
# Logs:   journalctl --user -u relay.service -f
# Reload the config (SIGHUP): systemctl --user reload relay.service
[Unit]
Description=relay: a local OpenAI-API relay with honest traffic control

[Service]
Type=exec
ExecStart={exec_start}
EnvironmentFile={env_file_value}
Environment={_systemd_value("PATH=" + path)} PYTHONUNBUFFERED=1
ExecReload=/bin/kill -HUP $MAINPID
Restart=on-failure
RestartSec=2
# Exit status 2 is a config error: restarting would not fix it.
RestartPreventExitStatus=2
# SIGTERM drains (drain_grace_s); the timeout outlasts the whole drain. KillMode=mixed
# signals relay alone: the CLI tools it runs are stopped by relay, then killed if needed.
KillSignal=SIGTERM
KillMode=mixed
TimeoutStopSec={stop_timeout}

[Install]
WantedBy=default.target
"""


def launchd_plist(*, argv: list[str], path: str, stop_timeout: int, logs: Path,
                  workdir: Path) -> bytes:
    agent = {
        "Label": LAUNCHD_LABEL,
        "ProgramArguments": argv,
        "RunAtLoad": True,
        "KeepAlive": {"SuccessfulExit": False},  # restart on failure only
        "ExitTimeOut": stop_timeout,             # SIGTERM, then SIGKILL after this
        "EnvironmentVariables": {"PATH": path, "PYTHONUNBUFFERED": "1"},
        "WorkingDirectory": str(workdir),
        "StandardOutPath": str(logs / "relay.out.log"),
        "StandardErrorPath": str(logs / "relay.err.log"),
        "ProcessType": "Background",
    }
    return plistlib.dumps(agent, sort_keys=False)


def unit_path(kind: str, home: Path) -> Path:
    if kind == "systemd":
        return home / ".config" / "systemd" / "user" / SYSTEMD_UNIT
    return home / "Library" / "LaunchAgents" / f"{LAUNCHD_LABEL}.plist"


def _load_for_service(path: str | None, env_file: Path) -> Config:
    file = Path(path) if path is not None else default_config_path()
    file = file.expanduser().resolve()
    try:
        text = file.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError([f"{file}: cannot read: {exc.strerror or exc}"]) from exc
    env = dict(os.environ)
    if env_file.exists():
        env.update(parse_env_file(env_file.read_text(encoding="utf-8"), str(env_file)))
    config = parse_config(text, ADAPTERS, source=str(file), base_dir=file.parent,
                          environ=_AssumeSet(env))
    token_env = config.server.token_env
    if token_env and not env.get(token_env):
        config = _with_warning(config, f"{token_env} (the token, [server] token_env) is "
                               f"not set: put it in {env_file}, or the service will not "
                               "start")
    return config


def _with_warning(config: Config, warning: str) -> Config:
    return attrs.evolve(config, warnings=(*config.warnings, warning))


def install(kind: str, *, config_path: str | None, print_only: bool,
            home: Path | None = None) -> int:
    """``relay service install``; returns the exit status."""
    home = home if home is not None else Path.home()
    env_file = env_file_path(home)
    try:
        config = _load_for_service(config_path, env_file)
    except ConfigError as exc:
        print("relay: the configuration has problems; nothing was installed:",
              file=sys.stderr)
        for problem in exc.problems:
            print(f"  {problem}", file=sys.stderr)
        return 2
    for warning in config.warnings:
        print(f"relay: {warning}", file=sys.stderr)
    argv = [sys.executable, "-m", "relay", "serve", "--config", config.source]
    path = service_path(home, config)
    timeout = stop_timeout_s(config)
    target = unit_path(kind, home)
    if kind == "systemd":
        data = systemd_unit(argv=argv, env_file=env_file, path=path, stop_timeout=timeout,
                            config_source=config.source).encode()
        start = ("systemctl --user daemon-reload && "
                 "systemctl --user enable --now relay.service")
        logs = "journalctl --user -u relay.service -f"
    else:
        log_dir = home / "Library" / "Logs" / "relay"
        data = launchd_plist(argv=[*argv, "--env-file", str(env_file)], path=path,
                             stop_timeout=timeout, logs=log_dir,
                             workdir=Path(config.source).parent)
        start = f"launchctl bootstrap gui/$(id -u) {target}"
        logs = f"tail -f {log_dir / 'relay.err.log'}"
    if print_only:
        sys.stdout.write(data.decode())
        return 0
    note = _ensure_env_file(env_file)
    if kind == "launchd":
        (home / "Library" / "Logs" / "relay").mkdir(parents=True, exist_ok=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    existed = target.exists()
    target.write_bytes(data)
    print(f"relay: {'replaced' if existed else 'wrote'} {target}")
    print(f"relay: {note}")
    print(f"relay: start it with: {start}")
    print(f"relay: its log: {logs}; its records: {config.records_path}")
    return 0


def uninstall(kind: str, *, home: Path | None = None) -> int:
    """``relay service uninstall``: removes the unit or plist; keeps the env file."""
    home = home if home is not None else Path.home()
    target = unit_path(kind, home)
    if kind == "systemd":
        wants = target.parent / "default.target.wants" / SYSTEMD_UNIT
        if wants.is_symlink() and Path(os.readlink(wants)).name == SYSTEMD_UNIT:
            wants.unlink()  # the link `systemctl --user enable` made
        stop = "systemctl --user stop relay.service && systemctl --user daemon-reload"
    else:
        stop = f"launchctl bootout gui/$(id -u)/{LAUNCHD_LABEL}"
    if not target.exists():
        print(f"relay: {target} is not installed; nothing to remove")
        return 0
    target.unlink()
    print(f"relay: removed {target}")
    print(f"relay: if it is still running: {stop}")
    print(f"relay: kept {env_file_path(home)} (it holds your keys; delete it yourself)")
    return 0
