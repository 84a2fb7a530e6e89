"""``relay launch AGENT``: run a coding agent against the running relay (SPEC 9).

Each agent is one `Agent` record in `AGENTS`: the variables, flags and temporary files
that point it at relay (base URL, key, model) and turn its own retries, telemetry and
update checks off — for that one process: its environment, its command line, or a file
in a temporary folder that a variable names (the agent's *system* settings for the
Gemini CLI and Qwen Code, which read their auth type and retries only from files). The
user's own files are never written; the agent still reads them (its login, MCP servers,
memory), so nothing the user set up is lost.

The agent runs as a child of ``relay launch`` in the same process group: the terminal's
Ctrl-C reaches it directly, and a SIGINT or SIGTERM sent to ``relay launch`` itself is
passed on (a SIGINT only when the terminal did not already deliver it: ``relay launch``
is not the terminal's foreground group, or there is no terminal). ``relay launch`` exits
with the agent's code (128 + N when a signal N ended it).

Placeholders in the record's values: ``{url}`` (relay's base URL, no trailing ``/``),
``{key}`` (relay's token, else a placeholder relay accepts), ``{model}``, ``{dir}`` (the
temporary folder: ``$XDG_RUNTIME_DIR``, else relay's state folder).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from types import FrameType
from typing import Any

import attrs

from relay.api.http import get_json
from relay.vocab.profile import default_state_dir

__all__ = ["AGENTS", "Agent", "main"]

DESCRIPTION = ("Run a coding agent with relay's base URL, key and model, and its own "
               "retries, telemetry and update checks off, for that process only (your "
               "files are never written). What relay does not take, and all after --, "
               "goes to the agent.")
NO_TOKEN = "relay"  # the key an agent sends when relay has no token (any value is taken)
KEY_SHOWN = "…masked…"

Template = str | Mapping[str, Any]


@attrs.frozen
class Agent:
    """How one agent is pointed at relay (placeholders: the module docstring)."""

    command: str
    install: str                               # how to get it, said when it is missing
    env: Mapping[str, Template] = {}           # set (a mapping is written as JSON)
    model_env: Mapping[str, Template] = {}     # set only when a model is chosen
    args: tuple[str, ...] = ()                 # before the user's arguments
    model_args: tuple[str, ...] = ()
    unset: tuple[str, ...] = ()                # removed: keys it would send instead
    files: Mapping[str, Template] = {}         # written in the temporary folder
    needs_model: bool = False  # no default of its own relay can serve: pick relay's first


_GEMINI_SETTINGS = {  # the Gemini CLI's system settings, which override the user's
    "security": {"auth": {"selectedType": "gemini-api-key"}},  # (else "gateway" auth)
    "general": {"maxAttempts": 1, "enableAutoUpdate": False,
                "enableAutoUpdateNotification": False},
    "privacy": {"usageStatisticsEnabled": False},
    "telemetry": {"enabled": False},
}

AGENTS: dict[str, Agent] = {
    "claude": Agent(
        command="claude", install="npm install -g @anthropic-ai/claude-code",
        env={"ANTHROPIC_BASE_URL": "{url}", "ANTHROPIC_AUTH_TOKEN": "{key}",
             "CLAUDE_CODE_MAX_RETRIES": "0",
             "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",  # updates, telemetry, reports
             "DISABLE_AUTOUPDATER": "1", "DISABLE_TELEMETRY": "1"},
        # Its main and background models alike (a background model relay has no route
        # for would fail in the middle of a session).
        model_env={name: "{model}" for name in (
            "ANTHROPIC_MODEL", "ANTHROPIC_SMALL_FAST_MODEL", "ANTHROPIC_DEFAULT_OPUS_MODEL",
            "ANTHROPIC_DEFAULT_SONNET_MODEL", "ANTHROPIC_DEFAULT_HAIKU_MODEL")},
        unset=("ANTHROPIC_API_KEY",)),  # it would send this key (and ask about it) first
    "codex": Agent(
        # A provider of its own for this run, by -c overrides: no config file, and the
        # user's ~/.codex (login, MCP servers, profiles) stays as it is.
        command="codex", install="npm install -g @openai/codex",
        env={"RELAY_LAUNCH_KEY": "{key}"},
        args=("-c", 'model_provider="relay"', "-c", 'model_providers.relay.name="relay"',
              "-c", 'model_providers.relay.base_url="{url}/v1"',
              "-c", 'model_providers.relay.env_key="RELAY_LAUNCH_KEY"',
              "-c", 'model_providers.relay.wire_api="responses"',
              "-c", "model_providers.relay.supports_websockets=false",
              "-c", "model_providers.relay.request_max_retries=0",
              "-c", "model_providers.relay.stream_max_retries=0",
              "-c", "analytics.enabled=false", "-c", "feedback.enabled=false",
              "-c", "check_for_update_on_startup=false"),
        model_args=("-c", 'model="{model}"')),
    "gemini": Agent(
        command="gemini", install="npm install -g @google/gemini-cli",
        env={"GOOGLE_GEMINI_BASE_URL": "{url}", "GEMINI_API_KEY": "{key}",
             "GEMINI_CLI_SYSTEM_SETTINGS_PATH": "{dir}/settings.json",
             # One process, not a launcher and a child that ignore a signal to the PID.
             "GEMINI_CLI_NO_RELAUNCH": "true"},
        model_env={"GEMINI_MODEL": "{model}"},
        unset=("GOOGLE_API_KEY", "GOOGLE_GENAI_USE_VERTEXAI", "GOOGLE_GENAI_USE_GCA"),
        files={"settings.json": _GEMINI_SETTINGS}),
    "qwen": Agent(
        command="qwen", install="npm install -g @qwen-code/qwen-code",
        env={"OPENAI_BASE_URL": "{url}/v1", "OPENAI_API_KEY": "{key}",
             "QWEN_CODE_SYSTEM_SETTINGS_PATH": "{dir}/settings.json",
             "QWEN_CODE_NO_RELAUNCH": "true"},
        model_env={"OPENAI_MODEL": "{model}"},
        files={"settings.json": {
            "security": {"auth": {"selectedType": "openai"}},
            "model": {"generationConfig": {"maxRetries": 0}},
            "general": {"disableAutoUpdate": True, "disableUpdateNag": True},
            "privacy": {"usageStatisticsEnabled": False},
            "telemetry": {"enabled": False}}},
        needs_model=True),
    "opencode": Agent(
        command="opencode", install="npm install -g opencode-ai",
        env={"OPENCODE_CONFIG_CONTENT": {  # merged over the user's own config
                 "autoupdate": False, "share": "disabled",
                 "provider": {"relay": {
                     "npm": "@ai-sdk/openai-compatible", "name": "relay",
                     "options": {"baseURL": "{url}/v1", "apiKey": "{key}"},
                     "models": {"{model}": {"name": "{model}"}}}},
                 "model": "relay/{model}"},
             "OPENCODE_DISABLE_AUTOUPDATE": "1", "OPENCODE_DISABLE_MODELS_FETCH": "1",
             "OPENCODE_DISABLE_SHARE": "1"},
        needs_model=True),
    "aider": Agent(
        command="aider", install="pipx install aider-chat",
        env={"OPENAI_API_BASE": "{url}/v1", "OPENAI_API_KEY": "{key}",
             "AIDER_CHECK_UPDATE": "false", "AIDER_ANALYTICS_DISABLE": "true",
             "AIDER_SHOW_MODEL_WARNINGS": "false"},
        model_env={"AIDER_MODEL": "openai/{model}"},  # litellm's OpenAI-compatible prefix
        needs_model=True),
}


@attrs.frozen
class Plan:
    """What one launch sets: the command line, the variables, the files."""

    argv: list[str]
    env: dict[str, str]      # set
    unset: tuple[str, ...]
    files: dict[str, str]    # name in the temporary folder → text
    secret: str | None       # the key, masked when shown


def plan(agent: Agent, *, url: str, token: str | None, model: str | None, folder: str,
         passed: list[str]) -> Plan:
    values = {"{url}": url.rstrip("/"), "{key}": token or NO_TOKEN, "{model}": model or "",
              "{dir}": folder}

    def fill(value: Any) -> Any:
        if isinstance(value, str):
            for name, text in values.items():
                value = value.replace(name, text)
            return value
        if isinstance(value, Mapping):
            return {fill(k): fill(v) for k, v in value.items()}
        return value

    def text(value: Template) -> str:
        filled = fill(value)
        return filled if isinstance(filled, str) else json.dumps(filled)

    env = {name: text(value) for name, value in agent.env.items()}
    args = [fill(arg) for arg in agent.args]
    if model:
        env.update({name: text(value) for name, value in agent.model_env.items()})
        args += [fill(arg) for arg in agent.model_args]
    return Plan(argv=[agent.command, *args, *passed], env=env, unset=agent.unset,
                files={name: text(value) for name, value in agent.files.items()},
                secret=token)


def show(found: Plan, *, url: str, source: str, model: str | None) -> str:
    """The plan as a person reads it (``--print``), the key masked."""
    def mask(value: str) -> str:
        return value.replace(found.secret, KEY_SHOWN) if found.secret else value

    chosen = model or "the agent's own default"
    lines = [f"# relay at {url} (from {source}); model: {chosen}"]
    lines += [f"unset {name}" for name in found.unset]
    lines += [f"export {name}={shlex.quote(mask(value))}" for name, value in found.env.items()]
    for name, body in found.files.items():
        lines.append(f"# file {name} (in a private temporary folder, removed afterwards): "
                     f"{mask(body)}")
    lines.append(shlex.join(mask(arg) for arg in found.argv))
    return "\n".join(lines)


def _models(url: str, token: str | None) -> list[str] | str:
    """The relay's model names (``GET /v1/models``), or what it answered instead; raises
    OSError when none answers."""
    code, body = get_json(url + "/v1/models", token=token)
    if code != 200:
        message = body.get("error", {}).get("message") if isinstance(body, dict) else body
        return f"relay at {url} answered {code}: {message}"
    return [entry["id"] for entry in body.get("data", []) if isinstance(entry, dict)
            and isinstance(entry.get("id"), str)]


def _private_folder() -> Path:
    """Where the temporary folders go: ``$XDG_RUNTIME_DIR`` (the user's own, mode 0700),
    else relay's state folder. Not the system's temporary folder: the Gemini CLI skips a
    settings file below a folder others may write to (``/tmp``)."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    base = Path(runtime) / "relay" if runtime and Path(runtime).is_dir() else (
        default_state_dir() / "launch")
    base.mkdir(mode=0o700, parents=True, exist_ok=True)
    return base


def _terminal_delivered_it() -> bool:
    """Whether a SIGINT just received came from the terminal, which sent it to the
    agent as well: ``relay launch`` is its terminal's foreground process group."""
    for fd in (0, 1, 2):
        with contextlib.suppress(OSError):
            if os.isatty(fd):
                return os.tcgetpgrp(fd) == os.getpgrp()
    return False


def run(found: Plan) -> int:
    """Run the agent to its end: its exit code (128 + N after signal N)."""
    env = {k: v for k, v in os.environ.items() if k not in found.unset}
    env.update(found.env)
    try:
        child = subprocess.Popen(found.argv, env=env)
    except OSError as exc:
        print(f"relay: cannot run {found.argv[0]}: {exc}", file=sys.stderr)
        return 127

    def forward(signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT and _terminal_delivered_it():
            return
        with contextlib.suppress(ProcessLookupError):
            child.send_signal(signum)

    before = {signum: signal.signal(signum, forward)
              for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        code = child.wait()  # (PEP 475: a handled signal resumes the wait)
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)
    return code if code >= 0 else 128 - code


def main(args: argparse.Namespace, passed: list[str], daemon: Any) -> int:
    """``relay launch`` (``daemon``: where `relay.assembly.remote.daemon_url` found relay)."""
    agent = AGENTS[args.agent]
    if not args.print_only and shutil.which(agent.command) is None:
        print(f"relay: {agent.command} is not installed ({agent.install})", file=sys.stderr)
        return 127
    try:
        models = _models(daemon.url, daemon.token)
    except OSError as exc:
        print(f"relay: no relay answers at {daemon.url} (from {daemon.source}: {exc}); "
              "start it with `relay serve`, or name it with --url URL or RELAY_URL=URL",
              file=sys.stderr)
        return 1
    if isinstance(models, str):  # (a token relay refuses, say)
        print(f"relay: {models}", file=sys.stderr)
        return 1
    model = args.model
    if model is None and agent.needs_model:
        model = next((m for m in models if "*" not in m), None)
        if model is None:
            print(f"relay: relay at {daemon.url} lists no model; name one with --model",
                  file=sys.stderr)
            return 1
    with tempfile.TemporaryDirectory(prefix=f"launch-{agent.command}-",
                                     dir=_private_folder()) as folder:
        found = plan(agent, url=daemon.url, token=daemon.token, model=model,
                     folder=folder, passed=passed)
        if args.print_only:
            print(show(found, url=daemon.url, source=daemon.source, model=model))
            return 0
        for name, body in found.files.items():
            path = Path(folder) / name
            path.write_text(body, encoding="utf-8")
            path.chmod(0o600)  # it may hold relay's token
        return run(found)
