"""Gemini CLI (``gemini``) as a provider: kind ``gemini-cli``.

- oneshot: ``gemini -p "" --output-format stream-json --skip-trust`` with the prompt on
  stdin; events ``init``, ``message`` (assistant deltas), ``tool_use``, ``tool_result``,
  ``error``, and the final ``result`` (``status`` success or error). The exit code of a
  failed run is the HTTP status mod 256 (401 → 145, 429 → 173), 41 when not logged in.
  A stop is SIGINT to the process group: gemini's launcher ignores signals sent to its
  own pid and, killed alone, orphans the child that does the work — so relay also sets
  ``GEMINI_CLI_NO_RELAUNCH=true`` (one process) and kills the whole group.
- session: ``gemini --acp`` kept warm (ACP, JSON-RPC 2.0 lines): ``initialize`` once,
  then per request a fresh ``session/new`` (no request sees another's context) and
  ``session/prompt``; text streams from ``session/update`` ``agent_message_chunk``s, the
  turn ends with the prompt's response (``stopReason``). A stop is the notification
  ``session/cancel``, confirmed by ``stopReason: cancelled``. A warm process is started
  for one model and system prompt (``GEMINI_SYSTEM_MD`` is per process).

relay writes a system settings file (``GEMINI_CLI_SYSTEM_SETTINGS_PATH``, in its private
folder) that turns gemini's retries off (``general.maxAttempts = 1``: a 429 surfaces in
seconds, not minutes), telemetry and update checks off, and — for a plain answerer (SPEC
P2a) — gemini's tools off, with ``--approval-mode plan`` (read-only). gemini ignores that
file when a folder above it is writable by others (as ``/tmp`` is): keep the state
directory in your home. The system prompt replaces gemini's (``GEMINI_SYSTEM_MD``).
Without ``model`` gemini's router first classifies every prompt (more requests, more
retries): name a model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs
import trio

from relay.vocab.errors import RelayError
from relay.vocab.events import Call, EventSink, Usage

from .base import (
    Broken,
    CLIAdapter,
    CLISettings,
    Outcome,
    Rpc,
    Streamer,
    Turned,
    Warm,
    refuse,
    tool_error,
)
from .process import REAP_S, ToolProcess
from .session import Event, State, Wire

__all__ = ["GeminiCLIAdapter", "GeminiSettings", "gemini_failure"]

LOGIN_ACTION = ("set GEMINI_API_KEY (or run `gemini` once in a terminal and log in), then "
                "retry")
# Every built-in tool of gemini-cli 0.61: excluded for a plain answerer.
BUILTIN_TOOLS = ("run_shell_command", "web_fetch", "google_web_search", "write_file",
                 "replace", "read_file", "read_many_files", "list_directory", "glob",
                 "grep_search", "search_file_content", "save_memory", "write_todos",
                 "invoke_agent", "update_topic", "exit_plan_mode", "enter_plan_mode")
EXIT_NOT_LOGGED_IN = 41
EXIT_CODES = {42: "input error", 44: "sandbox error", 52: "configuration error",
              53: "turn limit reached", 54: "tool execution error",
              55: "untrusted working folder"}


@attrs.frozen(kw_only=True)
class GeminiSettings(CLISettings):
    pass


def _status_from_exit(rc: int | None) -> int | None:
    """gemini exits with the HTTP status mod 256 (401 → 145, 429 → 173, 500 → 244)."""
    if rc is not None and 144 <= rc <= 255:
        return rc + 256
    return None


def gemini_failure(provider: str, message: str, *, rc: int | None = None,
                   code: Any = None) -> RelayError:
    """A failure in gemini's own words → relay's reason (by its code, exit code, words)."""
    status = code if isinstance(code, int) and 400 <= code < 600 else _status_from_exit(rc)
    low = message.lower()
    if status != 429 and (rc == EXIT_NOT_LOGGED_IN or code == EXIT_NOT_LOGGED_IN or status in (
            401, 403) or any(w in low for w in (
                "api key is missing", "api key not valid", "set an auth method",
                "invalid auth method", "must specify the gemini_api_key",
                "unauthenticated"))):
        return tool_error("auth_required", provider, f"gemini is not logged in: {message}. "
                          f"To fix it: {LOGIN_ACTION}.", message, status=status or 401,
                          action=LOGIN_ACTION)
    if status == 429 or "resource_exhausted" in low or "quota" in low:
        if "quota" in low:
            return tool_error("quota_exhausted", provider, f"gemini's quota is used up: "
                              f"{message}", message, status=429,
                              action="wait for the quota to reset, or raise it")
        return RelayError("rate_limited", f"provider {provider!r}: gemini was rate limited: "
                          f"{message}", provider=provider, upstream_status=429,
                          upstream_message=message, retry_after_s=30.0)
    if "exceeds the maximum number of tokens" in low or "context window" in low:
        return tool_error("context_too_long", provider, f"the conversation is too long for "
                          f"the model: {message}", message, status=status)
    if status is not None and 400 <= status < 500:
        return tool_error("rejected", provider, f"gemini's API refused the request: "
                          f"{message}", message, status=status)
    if status is None and ("fetch failed" in low or "econnrefused" in low):
        return tool_error("upstream_unavailable", provider, f"gemini could not reach its "
                          f"API: {message}", message, action="check this machine's network "
                          "connection (gemini reaches its API itself), then retry")
    what = EXIT_CODES.get(rc or 0)
    return tool_error("upstream_error", provider, f"gemini failed"
                      f"{f' ({what})' if what else ''}: {message}", message, status=status)


def _stderr_error(words: str) -> str:
    """gemini -o json writes its fatal error as JSON on stderr; keep its message."""
    for line in words.splitlines():
        line = line.strip()
        if line.startswith("{") and '"error"' in line:
            try:
                error = json.loads(line).get("error") or {}
            except ValueError:
                continue
            if isinstance(error, dict) and error.get("message"):
                return str(error["message"])
    return words


class GeminiCLIAdapter(CLIAdapter):
    kind = "gemini-cli"
    Settings = GeminiSettings
    tool = "gemini"
    package = "@google/gemini-cli"
    own_credentials = frozenset({"GEMINI_API_KEY", "GOOGLE_API_KEY",
                                 "GOOGLE_APPLICATION_CREDENTIALS"})
    login_action = LOGIN_ACTION

    @property
    def settings_file(self) -> Path:
        return self.private / "system-settings.json"

    def prepare(self) -> None:
        settings: dict[str, Any] = {
            "general": {"maxAttempts": 1, "retryFetchErrors": False,
                        "enableAutoUpdate": False, "enableAutoUpdateNotification": False},
            "telemetry": {"enabled": False},
            "privacy": {"usageStatisticsEnabled": False},
        }
        if not self.settings.agent_tools:
            settings["tools"] = {"exclude": list(BUILTIN_TOOLS)}
        self.settings_file.write_text(json.dumps(settings, indent=2), encoding="utf-8")

    def env(self, system_file: Path | None) -> dict[str, str]:
        extra = {"GEMINI_CLI_NO_RELAUNCH": "true", "NO_COLOR": "1",
                 "GEMINI_CLI_SYSTEM_SETTINGS_PATH": str(self.settings_file)}
        if system_file is not None:
            extra["GEMINI_SYSTEM_MD"] = str(system_file)
        return self.environment(extra)

    def argv(self, model: str | None, *, session: bool) -> list[str]:
        argv = [self.command, *(["--acp"] if session else
                                ["-p", "", "--output-format", "stream-json"]), "--skip-trust"]
        if not self.settings.agent_tools:
            argv += ["--approval-mode", "plan"]
        if model:
            argv += ["-m", model]
        return [*argv, *self.settings.args]

    # --- oneshot ------------------------------------------------------------------------
    async def run_oneshot(self, call: Call, system: str | None, prompt: str,
                          events: EventSink, folder: Path) -> None:
        system_file = None
        if system is not None:
            system_file = folder / "system.md"
            system_file.write_text(system, encoding="utf-8")
        argv = self.argv(self.model_for(call), session=False)
        await self.oneshot(argv, self.env(system_file), prompt.encode(), self._read_stream,
                           self.streamer(events))

    async def _read_stream(self, tool: ToolProcess, streamer: Streamer) -> Outcome:
        signals: list[str] = []
        while True:
            event = await tool.receive_json()
            if event is None:
                with trio.move_on_after(REAP_S):
                    await tool.wait_exit()
                rc = tool.returncode
                words = tool.stderr_text()
                # gemini's own fatal errors have codes of their own; anything else is a
                # tool that died.
                if words and (rc == EXIT_NOT_LOGGED_IN or rc in EXIT_CODES
                              or _status_from_exit(rc) is not None):
                    raise gemini_failure(self.name, _stderr_error(words), rc=rc)
                raise self.ended_early(tool)
            kind = event.get("type")
            if kind == "message" and event.get("role") == "assistant":
                piece = str(event.get("content") or "")
                if not event.get("delta") and streamer.buffer.chars:
                    piece = "\n\n" + piece
                await streamer.delta(piece)   # the streamer keeps the text (linear)
            elif kind == "error":
                signals.append(str(event.get("message") or event))
            elif kind == "result":
                if event.get("status") == "success":
                    return Outcome(streamer.seen, usage=_usage(event.get("stats") or {}),
                                   error_signal="; ".join(signals) or None)
                error = event.get("error") or {}
                message = str(error.get("message") or "; ".join(signals) or event)
                with trio.move_on_after(REAP_S):   # its exit code is the HTTP status
                    await tool.wait_exit()
                raise gemini_failure(self.name, message, rc=tool.returncode)

    # --- session ------------------------------------------------------------------------
    async def run_session(self, call: Call, system: str | None, prompt: str,
                          events: EventSink) -> None:
        model = self.model_for(call)

        async def start() -> Warm:
            tool = await self.spawn(self.argv(model, session=True),
                                    self.env(self.system_file(system)))
            wire = Wire()
            try:
                rpc = Rpc(tool, wire, jsonrpc=True, answer=_answer)
                reply = await rpc.wait_response(await rpc.request("initialize", {
                    "protocolVersion": 1, "clientCapabilities": {
                        "fs": {"readTextFile": False, "writeTextFile": False}}}))
                if reply is None:
                    raise self.ended_early(tool, " (initialize)")
                if "error" in reply:
                    error = reply["error"]
                    raise gemini_failure(self.name, str(error.get("message")),
                                         code=error.get("code"))
                wire.handle(Event.REPLY)
            except BaseException:
                with trio.CancelScope(shield=True, deadline=trio.current_time() + 5):
                    await tool.aclose()
                raise
            return Warm(tool, key=(model, system), state={"rpc": rpc}, wire=wire)

        await self.session_turn((model, system), start, None,
                                lambda w, s: self._converse(w, s, prompt),
                                self._interrupt, self.streamer(events))

    async def _converse(self, warm: Warm, streamer: Streamer, prompt: str) -> Turned:
        rpc: Rpc = warm.state["rpc"]
        wire = warm.wire
        state = warm.state
        state.update(session=None)
        try:
            reply = await rpc.wait_response(await rpc.request(
                "session/new", {"cwd": str(self.workdir), "mcpServers": []}))
            if reply is None:
                raise Broken(self.ended_early(warm.tool, " (session/new)"))
            wire.handle(Event.REPLY)
            if "error" in reply:
                error = reply["error"]
                return Turned(gemini_failure(self.name, str(error.get("message")),
                                             code=error.get("code")))
            session = (reply.get("result") or {}).get("sessionId")
            if not isinstance(session, str):
                raise RelayError("bad_upstream_response", f"provider {self.name!r}: "
                                 f"gemini's reply to session/new has no sessionId: {reply}",
                                 provider=self.name, upstream_message=str(reply))
            state["session"] = session
            prompt_id = await rpc.request("session/prompt", {
                "sessionId": session, "prompt": [{"type": "text", "text": prompt}]},
                Event.SEND_TURN)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise Broken(self.ended_early(warm.tool)) from exc

        async def on_message(msg: dict[str, Any]) -> None:
            params = msg.get("params") or {}
            update = params.get("update") or {}
            if msg.get("method") != "session/update" or params.get("sessionId") != session:
                return
            content = update.get("content") or {}
            if update.get("sessionUpdate") == "agent_message_chunk" and content.get(
                    "type") == "text":
                await streamer.delta(str(content.get("text") or ""))

        reply = await rpc.wait_response(prompt_id, on_message)
        if reply is None:
            raise Broken(self.ended_early(warm.tool))
        wire.handle(Event.TURN_END)   # the prompt's response ends the turn
        state.update(session=None)
        if "error" in reply:
            error = reply["error"]
            return Turned(gemini_failure(self.name, str(error.get("message")),
                                         code=error.get("code")))
        result = reply.get("result") or {}
        reason = result.get("stopReason")
        quota = ((result.get("_meta") or {}).get("quota") or {}).get("token_count") or {}
        usage = _usage(quota) if quota else None
        if reason in ("end_turn", "max_tokens", "max_turn_requests"):
            return Turned(Outcome(streamer.seen,
                                  finish="length" if reason == "max_tokens" else "stop",
                                  usage=usage))
        if reason == "refusal":
            return Turned(tool_error("rejected", self.name, "gemini refused to answer",
                                     json.dumps(result), status=400))
        return Turned(tool_error("upstream_error", self.name, f"gemini ended the turn "
                                 f"({reason})", json.dumps(result)))

    async def _interrupt(self, warm: Warm) -> bool:
        """Settle what the wire says is outstanding; True once the process is idle."""
        rpc: Rpc = warm.state["rpc"]
        wire = warm.wire
        if wire.state is State.AWAITING_REPLY:   # session/new: its reply ends it
            if await rpc.wait_response(wire.pending) is None:
                return False
            wire.handle(Event.REPLY)
        if wire.state is State.IN_TURN:
            await rpc.notify("session/cancel", {"sessionId": warm.state["session"]},
                             Event.SEND_INTERRUPT)
        if wire.state is State.INTERRUPTING:
            # The prompt's response (stopReason cancelled) confirms it.
            if await rpc.wait_response(wire.pending) is None:
                return False
            wire.handle(Event.TURN_END)
        return wire.ready


def _answer(msg: dict[str, Any]) -> dict[str, Any]:
    if msg.get("method") == "session/request_permission":   # a plain answerer: no
        return {"result": {"outcome": {"outcome": "cancelled"}}}
    return refuse(msg)


def _usage(stats: dict[str, Any]) -> Usage | None:
    prompt = stats.get("input_tokens")
    completion = stats.get("output_tokens")
    if not isinstance(prompt, int) and not isinstance(completion, int):
        return None
    total = stats.get("total_tokens")
    if not isinstance(total, int) and isinstance(prompt, int) and isinstance(completion, int):
        total = prompt + completion
    # input_tokens counts the cached ones too; ``cached`` (stream-json's stats) says how
    # many (SPEC L12a).
    cached = stats.get("cached")
    return Usage(prompt if isinstance(prompt, int) else None,
                 completion if isinstance(completion, int) else None,
                 total if isinstance(total, int) else None,
                 cache_read_tokens=cached if type(cached) is int and cached >= 0 else None)
