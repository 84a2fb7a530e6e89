"""Codex (``codex``) as a provider: kind ``codex-cli``.

- oneshot: ``codex exec --json --ephemeral …`` with the prompt on stdin; JSONL events
  ``thread.started``, ``turn.started``, ``item.completed`` (the ``agent_message`` holds
  the whole answer: exec sends no text deltas), ``turn.completed`` (success, with usage)
  or ``turn.failed``. A stop is SIGINT to the process group: the Node launcher *spawns*
  the native binary on Node 20, and killing the launcher alone would orphan it.
- session: ``codex app-server`` kept warm (JSON-RPC lines): ``initialize`` once, then per
  request a fresh ``thread/start`` (ephemeral: no request sees another's context) and
  ``turn/start``; text streams from ``item/agentMessage/delta``; the turn ends with
  ``turn/completed`` (status completed, failed or interrupted). A stop is
  ``turn/interrupt``, confirmed by ``turn/completed``.

The system prompt replaces codex's agent prompt (``model_instructions_file`` for exec,
``baseInstructions`` per thread). As a plain answerer (SPEC P2a) codex runs read-only
sandboxed with approvals ``never`` and web search off, in relay's own working folder.

Retries (SPEC F6): codex retries 5 times by default. With ``model_provider`` set (the
codex provider id from your ``config.toml``) relay turns that provider's retries off;
the built-in ``openai`` provider cannot be overridden, so relay also stops at the first
``Reconnecting… n/5`` event codex prints and fails with codex's own words. Analytics
are off (``analytics.enabled=false``: 5 s of start-up otherwise, notes/cli-tools.md).
"""

from __future__ import annotations

import json
import re
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
    TextBuffer,
    Turned,
    Warm,
    refuse,
    tool_error,
)
from .process import ToolProcess
from .session import Event, State, Wire

__all__ = ["CodexCLIAdapter", "CodexSettings", "codex_failure"]

LOGIN_ACTION = "run `codex login` (or set the API key variable of codex's model provider)"
_STATUS = re.compile(r"unexpected status (\d{3})")


@attrs.frozen(kw_only=True)
class CodexSettings(CLISettings):
    # The codex model provider (a [model_providers.ID] of codex's config.toml) to use;
    # relay then turns its retries off. None: codex's own default provider.
    model_provider: str | None = None


def _toml_str(value: str) -> str:
    return json.dumps(value)  # a JSON string is a valid TOML basic string


def codex_failure(provider: str, message: str, info: Any = None) -> RelayError:
    """A failure in codex's own words (``turn.failed``, an ``error`` event, a failed
    turn's ``codexErrorInfo``) → relay's reason."""
    low = message.lower()
    found = _STATUS.search(message)
    status = int(found.group(1)) if found else None
    if isinstance(info, dict):  # {"httpConnectionFailed": {"httpStatusCode": 401}} …
        for detail in info.values():
            if isinstance(detail, dict) and isinstance(detail.get("httpStatusCode"), int):
                status = status or detail["httpStatusCode"]
        info = next(iter(info), None)
    if info == "unauthorized" or status in (401, 403) or "missing environment variable" \
            in low or "not logged in" in low or "please login" in low:
        missing = re.search(r"missing environment variable: `([^`]+)`", message, re.I)
        action = (f"set the environment variable {missing.group(1)} to the provider's API "
                  "key (relay passes its environment to codex)") if missing else LOGIN_ACTION
        return tool_error("auth_required", provider, f"codex is not logged in: {message}. "
                          f"To fix it: {action}.", message, status=status or 401,
                          action=action)
    if info == "usageLimitExceeded" or "quota exceeded" in low or "usage limit" in low:
        return tool_error("quota_exhausted", provider, f"codex's quota is used up: {message}",
                          message, status=429, action="check the plan and billing details")
    if info == "rateLimitExceeded" or status == 429:
        return RelayError("rate_limited", f"provider {provider!r}: codex was rate limited: "
                          f"{message}", provider=provider, upstream_status=429,
                          upstream_message=message, retry_after_s=30.0)
    if info == "contextWindowExceeded" or "context window" in low or \
            "context_length_exceeded" in low:
        return tool_error("context_too_long", provider, f"the conversation is too long for "
                          f"the model: {message}", message, status=status)
    if info == "badRequest" or (status is not None and 400 <= status < 500):
        return tool_error("rejected", provider, f"codex's API refused the request: {message}",
                          message, status=status or 400)
    if status is None and any(w in low for w in ("waiting for network", "connection failed",
                                                 "error sending request",
                                                 "stream disconnected")):
        return tool_error("upstream_unavailable", provider, f"codex could not reach its API: "
                          f"{message}", message, action="check this machine's network "
                          "connection (codex reaches its API itself), then retry")
    return tool_error("upstream_error", provider, f"codex reported an error: {message}",
                      message, status=status)


def _hidden_retry(message: str) -> bool:
    """codex announces each of its own retries as ``Reconnecting... n/5 (…)``."""
    return message.startswith("Reconnecting")


class CodexCLIAdapter(CLIAdapter):
    kind = "codex-cli"
    Settings = CodexSettings
    tool = "codex"
    package = "@openai/codex"
    own_credentials = frozenset({"OPENAI_API_KEY", "CODEX_API_KEY"})
    login_action = LOGIN_ACTION

    @classmethod
    def describe_settings(cls, settings: Any) -> str:
        provider = settings.model_provider or "codex's default (its retries stay on)"
        return f"{super().describe_settings(settings)}, model provider {provider}"

    def env(self) -> dict[str, str]:
        return self.environment({"NO_COLOR": "1"})

    def config_args(self) -> list[str]:
        args = ["-c", "analytics.enabled=false"]
        if not self.settings.agent_tools:
            args += ["-c", 'web_search="disabled"', "-c", 'approval_policy="never"']
        provider = self.settings.model_provider
        if provider:
            args += ["-c", f"model_provider={_toml_str(provider)}",
                     "-c", f"model_providers.{provider}.request_max_retries=0",
                     "-c", f"model_providers.{provider}.stream_max_retries=0"]
        return args

    # --- oneshot ------------------------------------------------------------------------
    async def run_oneshot(self, call: Call, system: str | None, prompt: str,
                          events: EventSink, folder: Path) -> None:
        argv = [self.command, "exec", "--json", "--skip-git-repo-check", "--ephemeral",
                "--color", "never", "-C", str(self.workdir), *self.config_args()]
        if not self.settings.agent_tools:
            argv += ["--sandbox", "read-only"]
        model = self.model_for(call)
        if model:
            argv += ["-m", model]
        if system is not None:
            path = folder / "instructions.md"
            path.write_text(system, encoding="utf-8")
            argv += ["-c", f"model_instructions_file={_toml_str(str(path))}"]
        argv += [*self.settings.args, "-"]    # "-": the prompt comes on stdin
        await self.oneshot(argv, self.env(), prompt.encode(), self._read_exec,
                           self.streamer(events))

    async def _read_exec(self, tool: ToolProcess, streamer: Streamer) -> Outcome:
        signals: list[str] = []
        while True:
            event = await tool.receive_json()
            if event is None:
                raise self.ended_early(tool)
            kind = event.get("type")
            if kind == "item.completed":
                item = event.get("item") or {}
                if item.get("type") == "agent_message" and isinstance(item.get("text"), str):
                    # exec sends no deltas: each message is one (the streamer keeps them)
                    await streamer.delta(("\n\n" if streamer.buffer.chars else "")
                                         + item["text"])
            elif kind == "error":
                message = str(event.get("message") or "")
                if _hidden_retry(message):
                    raise codex_failure(self.name, message)   # no hidden retries (F6)
                signals.append(message)
            elif kind == "turn.failed":   # a failure, never salvaged (E3)
                error = event.get("error") or {}
                raise codex_failure(self.name, str(error.get("message") or
                                                   "; ".join(signals) or event))
            elif kind == "turn.completed":
                return Outcome(streamer.seen, usage=_usage(event.get("usage")),
                               error_signal="; ".join(signals) or None)

    # --- session ------------------------------------------------------------------------
    async def run_session(self, call: Call, system: str | None, prompt: str,
                          events: EventSink) -> None:
        model = self.model_for(call)
        await self.session_turn(None, self._start, None,
                                lambda w, s: self._converse(w, s, model, system, prompt),
                                self._interrupt, self.streamer(events))

    async def _start(self) -> Warm:
        argv = [self.command, "app-server", *self.config_args(), *self.settings.args]
        tool = await self.spawn(argv, self.env())
        wire = Wire()
        try:
            rpc = Rpc(tool, wire, jsonrpc=False, answer=refuse)
            reply = await rpc.wait_response(await rpc.request(
                "initialize", {"clientInfo": {"name": "relay", "version": "1"}}))
            if reply is None or "error" in reply:
                raise self.ended_early(tool, " (initialize)") if reply is None else \
                    codex_failure(self.name, str(reply["error"].get("message")))
            wire.handle(Event.REPLY)
            await rpc.notify("initialized")
        except BaseException:
            with trio.CancelScope(shield=True, deadline=trio.current_time() + 5):
                await tool.aclose()
            raise
        return Warm(tool, state={"rpc": rpc}, wire=wire)

    async def _converse(self, warm: Warm, streamer: Streamer, model: str | None,
                        system: str | None, prompt: str) -> Turned:
        # long because it is codex's turn protocol (thread/start, turn/start, the events in
        # their order, the final item) read top to bottom, as the CLI note gives it.
        rpc: Rpc = warm.state["rpc"]
        wire = warm.wire
        state = warm.state
        state.update(thread=None, turn=None)
        params: dict[str, Any] = {"cwd": str(self.workdir), "ephemeral": True}
        if model:
            params["model"] = model
        if system is not None:
            params["baseInstructions"] = system
        if not self.settings.agent_tools:
            params.update(sandbox="read-only", approvalPolicy="never")
        try:
            reply = await rpc.wait_response(await rpc.request("thread/start", params))
            if reply is None:
                raise Broken(self.ended_early(warm.tool, " (thread/start)"))
            wire.handle(Event.REPLY)
            if "error" in reply:
                return Turned(codex_failure(self.name, str(reply["error"].get("message"))))
            thread = state["thread"] = _field(self.name, reply, "thread/start",
                                              "result", "thread", "id")
            await rpc.request("turn/start", {
                "threadId": thread, "input": [{"type": "text", "text": prompt,
                                               "text_elements": []}]}, Event.SEND_TURN)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise Broken(self.ended_early(warm.tool)) from exc
        texts = TextBuffer(self.name, self.answer_limit)
        signals: list[str] = []
        usage: Usage | None = None
        while True:
            msg = await rpc.read()
            if msg is None:
                raise Broken(self.ended_early(warm.tool))
            if "method" not in msg:
                if wire.pending is not None and msg.get("id") == wire.pending:
                    wire.handle(Event.REPLY)
                    if "error" in msg:   # the turn never started
                        wire.handle(Event.TURN_END)
                        return Turned(codex_failure(self.name,
                                                    str(msg["error"].get("message"))))
                    state["turn"] = _field(self.name, msg, "turn/start", "result", "turn",
                                           "id")
                continue
            params = msg.get("params") or {}
            if params.get("threadId") != thread:
                continue   # an earlier request's late news, or the account's
            method = msg["method"]
            if method == "item/agentMessage/delta":
                await streamer.delta(str(params.get("delta") or ""))
            elif method == "item/completed":
                item = params.get("item") or {}
                if item.get("type") == "agentMessage" and isinstance(item.get("text"), str):
                    texts.append(("\n\n" if texts.chars else "") + item["text"])
            elif method == "thread/tokenUsage/updated":
                last = (params.get("tokenUsage") or {}).get("last") or {}
                usage = Usage(last.get("inputTokens"), last.get("outputTokens"),
                              last.get("totalTokens"),
                              cache_read_tokens=_count(last.get("cachedInputTokens")),
                              cache_write_tokens=_count(last.get("cacheWriteInputTokens")))
            elif method == "error":
                error = params.get("error") or {}
                message = str(error.get("message") or "")
                if params.get("willRetry") or _hidden_retry(message):
                    # A hidden retry (F6): stop the turn (the caller interrupts it).
                    raise codex_failure(self.name, message, error.get("codexErrorInfo"))
                signals.append(message)
            elif method == "turn/completed":
                turn = params.get("turn") or {}
                status = turn.get("status")
                wire.handle(Event.TURN_END)
                state["turn"] = None
                if status == "completed":
                    return Turned(Outcome(texts.text, usage=usage,
                                          error_signal="; ".join(signals) or None))
                error = turn.get("error") or {}
                message = str(error.get("message") or "; ".join(signals) or
                              f"the turn ended {status}")
                return Turned(codex_failure(self.name, message, error.get("codexErrorInfo")))

    async def _interrupt(self, warm: Warm) -> bool:
        """Settle what the wire says is outstanding; True once the process is idle."""
        rpc: Rpc = warm.state["rpc"]
        wire = warm.wire
        state = warm.state
        if wire.state is State.AWAITING_REPLY:   # thread/start: its reply ends it
            if await rpc.wait_response(wire.pending) is None:
                return False
            wire.handle(Event.REPLY)
        if wire.state is State.IN_TURN:
            if wire.pending is not None:   # turn/start's reply names the turn to stop
                reply = await rpc.wait_response(wire.pending)
                if reply is None:
                    return False
                wire.handle(Event.REPLY)
                if "error" in reply:
                    wire.handle(Event.TURN_END)
                    return True
                state["turn"] = ((reply.get("result") or {}).get("turn") or {}).get("id")
            thread, turn = state.get("thread"), state.get("turn")
            if turn is None:
                return False   # no turn id to interrupt: not confirmable
            await rpc.request("turn/interrupt", {"threadId": thread, "turnId": turn},
                              Event.SEND_INTERRUPT)
        if wire.state is State.INTERRUPTING:
            thread = state.get("thread")
            while True:   # its (empty) response and the turn's end may come in either order
                msg = await rpc.read()
                if msg is None:
                    return False
                if "method" not in msg:
                    if wire.pending is not None and msg.get("id") == wire.pending:
                        wire.handle(Event.REPLY)
                    continue
                params = msg.get("params") or {}
                if msg.get("method") == "turn/completed" and params.get("threadId") == thread:
                    wire.handle(Event.TURN_END)
                    break
        return wire.ready


def _field(provider: str, msg: dict[str, Any], what: str, *path: str) -> Any:
    """``msg[path…]``, or ``bad_upstream_response`` when codex's reply lacks it."""
    value: Any = msg
    for key in path:
        value = value.get(key) if isinstance(value, dict) else None
    if value is None:
        raise RelayError("bad_upstream_response", f"provider {provider!r}: codex's reply to "
                         f"{what} has no {'.'.join(path)}: {msg}", provider=provider,
                         upstream_message=str(msg))
    return value


def _count(value: Any) -> int | None:
    return value if type(value) is int and value >= 0 else None


def _usage(raw: Any) -> Usage | None:
    """``turn.completed``'s usage: OpenAI's counts (``input_tokens`` counts the cached
    ones too; ``cached_input_tokens`` and ``cache_write_input_tokens`` say how many,
    SPEC L12a)."""
    if not isinstance(raw, dict):
        return None
    prompt = raw.get("input_tokens")
    completion = raw.get("output_tokens")
    total = prompt + completion if isinstance(prompt, int) and isinstance(completion, int) \
        else None
    return Usage(prompt, completion, total,
                 cache_read_tokens=_count(raw.get("cached_input_tokens")),
                 cache_write_tokens=_count(raw.get("cache_write_input_tokens")))
