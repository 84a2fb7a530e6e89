"""The ``relay`` commands that ask a running daemon (SPEC 9): ``status``, ``check``,
``ps``, and where to find it (`daemon_url`, which ``launch`` uses too)."""

from __future__ import annotations

import json
import os
import sys
import tomllib
from pathlib import Path

from relay.api.http import get_json, post_json
from relay.config import PACKAGED_DEFAULT, default_config_path

from .describe import describe_providers, describe_records, describe_requests

__all__ = ["DEFAULT_URL", "daemon_url"]

DEFAULT_URL = "http://127.0.0.1:8765"


class _Daemon:
    """Where `daemon_url` found the daemon: its URL, what said so, the token to send."""

    def __init__(self, url: str, source: str, token: str | None) -> None:
        self.url, self.source, self.token = url.rstrip("/"), source, token

    def unreachable(self, exc: OSError) -> str:
        return (f"relay: {exc}\n  (the URL came from {self.source}.) Is `relay serve` "
                "running there? Point to the daemon with --url URL or RELAY_URL=URL.")


def daemon_url(url: str | None, config: str | None, *, announce: bool = True) -> _Daemon:
    """The daemon to ask (SPEC 9): ``--url``, then ``RELAY_URL``, then the config's
    ``[server]`` host and port — the file ``relay serve`` would read — then
    127.0.0.1:8765. Prints the URL and where it came from to stderr (unless not
    ``announce``: ``relay launch``, whose stderr is the agent's).

    Only the config's ``[server]`` table is read, not validated: a daemon may be running
    on a file that has since gained a problem. The token is the config's ``token_env``
    variable's value, else ``RELAY_TOKEN``'s.
    """
    token_env, host_port, note = "RELAY_TOKEN", None, ""
    path = Path(config) if config is not None else default_config_path()
    try:
        server = tomllib.loads(path.read_text(encoding="utf-8")).get("server", {})
    except (OSError, ValueError) as exc:
        server, note = None, f"; {path} could not be read ({exc})"
    if isinstance(server, dict):
        if isinstance(server.get("token_env"), str):
            token_env = server["token_env"]
        host, port = server.get("host", "127.0.0.1"), server.get("port", 8765)
        if isinstance(host, str) and isinstance(port, int) and 0 < port < 65536:
            # A daemon bound to every address is reached on loopback.
            host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
            host_port = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    token = os.environ.get(token_env) or os.environ.get("RELAY_TOKEN")
    if url is not None:
        found = _Daemon(url, "--url", token)
    elif os.environ.get("RELAY_URL"):
        found = _Daemon(os.environ["RELAY_URL"], "RELAY_URL", token)
    elif host_port is not None:
        packaged = path.resolve() == PACKAGED_DEFAULT.resolve()
        what = "the packaged default config" if packaged else path
        found = _Daemon(f"http://{host_port}", f"[server] host and port of {what}", token)
    else:
        found = _Daemon(DEFAULT_URL, f"relay's default{note}", token)
    if announce:
        print(f"relay: asking the daemon at {found.url} (from {found.source})",
              file=sys.stderr, flush=True)
    return found


def _check(daemon: _Daemon, names: list[str]) -> int:
    """Check each provider (all by default) and print one readable line each."""
    token = daemon.token
    base = daemon.url
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
        print(daemon.unreachable(exc), file=sys.stderr)
        return 1
    return 1 if failed else 0


def _status(daemon: _Daemon) -> int:
    try:
        code, body = get_json(daemon.url + "/relay/v1/status", token=daemon.token)
    except OSError as exc:
        print(daemon.unreachable(exc), file=sys.stderr)
        return 1
    if code != 200:
        print(f"relay: status answered {code}: {body.get('error', {}).get('message')}",
              file=sys.stderr)
        return 1
    print(describe_providers(body["providers"]))
    records = body.get("records")
    if isinstance(records, dict):  # (absent from a daemon older than issue 29)
        print(describe_records(records))
    return 0


def _ps(daemon: _Daemon, as_json: bool) -> int:
    """What runs and waits now: the status's ``requests``, as a table or as JSON."""
    try:
        code, body = get_json(daemon.url + "/relay/v1/status", token=daemon.token)
    except OSError as exc:
        print(daemon.unreachable(exc), file=sys.stderr)
        return 1
    if code != 200 or "requests" not in body:
        why = (f"answered {code}: {body.get('error', {}).get('message')}" if code != 200
               else "has no requests list (a relay older than `relay ps`)")
        print(f"relay: status {why}", file=sys.stderr)
        return 1
    print(json.dumps(body["requests"], indent=1) if as_json
          else describe_requests(body["requests"]))
    return 0
