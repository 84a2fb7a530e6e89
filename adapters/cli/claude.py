"""Claude Code (``claude``) as a provider: kind ``claude-cli``.

- oneshot: ``claude -p --output-format stream-json --verbose --include-partial-messages``
  with the prompt on stdin; a stop is SIGINT to the process group (claude prints an
  ``aborted_streaming`` result and exits 0 — success is never read from the exit code).
- session: ``claude -p --input-format stream-json …`` kept warm; each request writes one
  ``user`` message and reads to its ``result``; a stop writes the ``control_request``
  interrupt and waits for the aborted ``result``. Between requests the process is given a
  fresh conversation with ``/clear`` (confirmed by its own ``result`` before the next
  request uses it), so no request sees another's context (SPEC P2). A warm process is
  started for one model and system prompt; another pair gets another process.

Text deltas come from the ``stream_event`` lines; the final answer from ``result``.
Retries are off (``CLAUDE_CODE_MAX_RETRIES=0``) so a 401 or 429 surfaces in a second.

Disguised failures (SPEC E2), in this adapter only: a ``result`` marked success
(``is_error: false``) whose answer is at most 600 characters and holds a known auth
phrase is ``auth_required``; one holding a known usage-limit phrase (or an error type
``grace_daily_limit_reached``) is ``quota_exhausted``. Longer answers pass, whatever they
mention. Because a short answer may be such a notice, the first 600 characters are held
back until the result is read: a disguised failure never reaches the client as text.
A quota notice keeps the warm process; an auth failure retires it (a fresh process picks
up a new login) and is never retried by another path.
"""

from __future__ import annotations

import functools
import itertools
import json
from pathlib import Path
from typing import Any

import attrs
import trio

from relay.adapters.limits import usage_reset_s
from relay.vocab.errors import RelayError
from relay.vocab.events import Call, EventSink, Usage
from relay.vocab.limits import RateLimits

from .base import (
    Broken,
    CLIAdapter,
    CLISettings,
    Outcome,
    Streamer,
    Turned,
    Warm,
    tool_error,
)
from .process import ToolProcess
from .session import Event, State, Wire

__all__ = ["AUTH_PHRASES", "E2_FENCE", "QUOTA_PHRASES", "ClaudeCLIAdapter", "ClaudeSettings",
           "disguised_failure"]

E2_FENCE = 600  # characters: longer answers are never read as failure notices
# Seen in the wild (SPEC E2, seed 003); compared lower-case, curly apostrophes straightened.
AUTH_PHRASES = ("failed to authenticate", "oauth session expired", "not logged in",
                "invalid api key", "oauth token has expired")
QUOTA_PHRASES = ("usage limit reached", "hit your limit", "reached your usage limit",
                 "your limit resets", "limit will reset")
QUOTA_ERROR_TYPES = ("grace_daily_limit_reached",)
CLEAR_S = 5.0   # a warm process must confirm /clear within this, or it is replaced
LOGIN_ACTION = "run `claude login` (or set ANTHROPIC_API_KEY), then retry"
NETWORK_ACTION = ("check this machine's network connection (claude reaches its API itself, "
                  "with its own proxy settings), then retry")
QUOTA_WORDS = ("quota", "usage limit", "billing", "credit balance", "hit your limit",
               "limit reached")


@attrs.frozen(kw_only=True)
class ClaudeSettings(CLISettings):
    pass


def _plain(text: str) -> str:
    return text.lower().replace("\u2019", "'")


def _error_types(*events: dict[str, Any] | None) -> set[str]:
    found = set()
    for event in events:
        for key in ("error_type", "api_error_type", "error"):
            value = (event or {}).get(key)
            if isinstance(value, str):
                found.add(value)
    return found


def disguised_failure(provider: str, text: str, result: dict[str, Any],
                      assistant: dict[str, Any] | None = None) -> RelayError | None:
    """SPEC E2: a success-marked result that is really a login or usage-limit notice.

    Only for results claude marked success; only answers of at most `E2_FENCE`
    characters are read for phrases (both kinds).
    """
    message = (assistant or {}).get("message") or {}
    if _error_types(result, assistant, message) & set(QUOTA_ERROR_TYPES):
        return _quota(provider, text or json.dumps(result, ensure_ascii=False))
    if len(text) > E2_FENCE:
        return None
    plain = _plain(text)
    if any(phrase in plain for phrase in AUTH_PHRASES):
        return _auth(provider, text, disguised=True)
    if any(phrase in plain for phrase in QUOTA_PHRASES):
        return _quota(provider, text)
    return None


def _auth(provider: str, words: str, *, disguised: bool = False) -> RelayError:
    how = " (in an answer claude marked as a success)" if disguised else ""
    return tool_error("auth_required", provider, f"claude is not logged in{how}: {words}. "
                      f"To fix it: {LOGIN_ACTION}.", words, status=401, action=LOGIN_ACTION)


def _quota(provider: str, words: str) -> RelayError:
    error = tool_error("quota_exhausted", provider, "claude's usage limit is reached "
                       f"({words}). The installation and login are fine; call again after "
                       "the limit resets.", words, status=429,
                       action="wait until the usage limit resets")
    reset = usage_reset_s(words)
    if reset:  # SPEC L12: no start on this provider until the reset
        error.retry_after_s = reset  # (not the reason's 10 minutes: the notice said when)
        error.limits = RateLimits(hold_s=reset, cause=f"claude's usage-limit notice: "
                                  f"{words[:120]}")
    return error


def _marked_failure(provider: str, text: str, result: dict[str, Any],
                    assistant: dict[str, Any] | None) -> RelayError:
    """A result claude itself marks as an error: classified from its own fields."""
    errors = [str(e) for e in result.get("errors") or ()]
    words = text or "; ".join(errors) or json.dumps(result, ensure_ascii=False)
    status = result.get("api_error_status")
    status = status if isinstance(status, int) else None
    kinds = _error_types(result, assistant)
    plain = _plain(words)
    if status in (401, 403) or "authentication_failed" in kinds or "authentication_error" \
            in kinds or any(p in plain for p in AUTH_PHRASES):
        return _auth(provider, words)
    if status == 429 or kinds & {"rate_limit", "rate_limit_error"}:
        if any(w in plain for w in QUOTA_WORDS):
            return _quota(provider, words)
        return RelayError("rate_limited", f"provider {provider!r}: claude was rate limited: "
                          f"{words}", provider=provider, upstream_status=429,
                          upstream_message=words, retry_after_s=60.0)
    if "prompt is too long" in plain or "context window" in plain:
        return tool_error("context_too_long", provider, f"the conversation is too long for "
                          f"the model: {words}", words, status=status)
    if status is not None and 400 <= status < 500:
        return tool_error("rejected", provider, f"claude's API refused the request: {words}",
                          words, status=status)
    if "connection" in plain or "fetch failed" in plain or "econnrefused" in plain:
        return tool_error("upstream_unavailable", provider, f"claude could not reach its API: "
                          f"{words}", words, status=status, action=NETWORK_ACTION)
    return tool_error("upstream_error", provider, f"claude reported an error "
                      f"({result.get('subtype')}, {result.get('terminal_reason')}): {words}",
                      words, status=status)


def classify(provider: str, result: dict[str, Any],
             assistant: dict[str, Any] | None) -> Outcome | RelayError:
    """The final ``result`` event → the answer, or the failure it really is."""
    text = result.get("result") if isinstance(result.get("result"), str) else ""
    assert isinstance(text, str)
    if result.get("is_error") is not False or result.get("subtype") != "success":
        return _marked_failure(provider, text, result, assistant)   # never salvaged (E3)
    disguised = disguised_failure(provider, text, result, assistant)
    if disguised is not None:
        return disguised
    usage = result.get("usage") if isinstance(result.get("usage"), dict) else {}
    assert isinstance(usage, dict)

    def num(key: str) -> int | None:
        value = usage.get(key)
        return value if type(value) is int and value >= 0 else None

    # Anthropic's counts: input_tokens is the uncached part (SPEC L12a).
    read, write = num("cache_read_input_tokens"), num("cache_creation_input_tokens")
    prompt = (num("input_tokens") or 0) + (read or 0) + (write or 0)
    completion = num("output_tokens") or 0
    errors = [str(e) for e in result.get("errors") or ()]
    return Outcome(
        text=text, finish="length" if result.get("stop_reason") == "max_tokens" else "stop",
        usage=Usage(prompt, completion, prompt + completion, cache_read_tokens=read,
                    cache_write_tokens=write) if usage else None,
        error_signal="; ".join(errors) or None)   # completed, but with errors: E3


async def read_turn(tool: ToolProcess, streamer: Streamer, wire: Wire | None = None
                    ) -> tuple[dict[str, Any], dict[str, Any] | None] | None:
    """Read claude's stream-json events to the turn's ``result``; None if the output
    ends first. Text deltas of the answer go to ``streamer``. ``wire``: a warm process's
    (its reads go through it)."""
    assistant: dict[str, Any] | None = None
    while True:
        event = await (tool.receive_json() if wire is None else
                       wire.receive(tool.receive_json))
        if event is None:
            return None
        kind = event.get("type")
        if kind == "stream_event":
            inner = event.get("event") or {}
            delta = inner.get("delta") or {}
            if (inner.get("type") == "content_block_delta" and delta.get("type") ==
                    "text_delta" and event.get("parent_tool_use_id") is None):
                await streamer.delta(str(delta.get("text") or ""))
        elif kind == "assistant" and event.get("parent_tool_use_id") is None:
            assistant = event
        elif kind == "result":
            return event, assistant


def _user_line(text: str) -> dict[str, Any]:
    return {"type": "user", "message": {"role": "user", "content": [
        {"type": "text", "text": text}]}, "parent_tool_use_id": None, "session_id": ""}


class ClaudeCLIAdapter(CLIAdapter):
    kind = "claude-cli"
    Settings = ClaudeSettings
    tool = "claude"
    package = "@anthropic-ai/claude-code"
    own_credentials = frozenset({"ANTHROPIC_API_KEY", "ANTHROPIC_AUTH_TOKEN",
                                 "CLAUDE_CODE_OAUTH_TOKEN"})
    login_action = LOGIN_ACTION

    def __init__(self, provider: Any) -> None:
        super().__init__(provider)
        self._ids = itertools.count(1)

    def env(self) -> dict[str, str]:
        return self.environment({
            "CLAUDE_CODE_MAX_RETRIES": "0",                  # a 401/429 surfaces at once
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",  # no telemetry, updates …
            "NO_COLOR": "1",
        })

    def argv(self, model: str | None, system_file: Path | None, *, session: bool) -> list[str]:
        argv = [self.command, "-p", "--output-format", "stream-json", "--verbose",
                "--include-partial-messages", "--no-session-persistence"]
        if session:
            argv += ["--input-format", "stream-json"]   # slash commands stay: /clear
        else:
            argv += ["--disable-slash-commands"]
        if not self.settings.agent_tools:
            argv += ["--tools", "", "--strict-mcp-config"]  # a plain answerer (SPEC P2a)
        if model:
            argv += ["--model", model]
        if system_file is not None:
            argv += ["--system-prompt-file", str(system_file)]
        return [*argv, *self.settings.args]

    # --- oneshot ------------------------------------------------------------------------
    async def run_oneshot(self, call: Call, system: str | None, prompt: str,
                          events: EventSink, folder: Path) -> None:
        system_file = None
        if system is not None:
            system_file = folder / "system-prompt.md"
            system_file.write_text(system, encoding="utf-8")
        argv = self.argv(self.model_for(call), system_file, session=False)

        async def read(tool: ToolProcess, streamer: Streamer) -> Outcome:
            turn = await read_turn(tool, streamer)
            if turn is None:
                raise self.ended_early(tool)
            outcome = classify(self.name, *turn)
            if isinstance(outcome, RelayError):
                raise outcome
            return outcome

        await self.oneshot(argv, self.env(), prompt.encode(), read,
                           self.streamer(events, hold=E2_FENCE))

    # --- session ------------------------------------------------------------------------
    async def run_session(self, call: Call, system: str | None, prompt: str,
                          events: EventSink) -> None:
        model = self.model_for(call)

        async def start() -> Warm:
            argv = self.argv(model, self.system_file(system), session=True)
            return Warm(await self.spawn(argv, self.env()), key=(model, system))

        await self.session_turn((model, system), start, self._ready,
                                lambda warm, streamer: self._converse(warm, streamer, prompt),
                                self._interrupt, self.streamer(events, hold=E2_FENCE))

    async def _ready(self, warm: Warm) -> bool:
        """A warm process that was cleared after its last request: read the ``/clear``
        confirmation (a ``result``) before it takes the next one."""
        wire = warm.wire
        if wire.state is not State.CLEARING:
            return wire.ready
        with trio.move_on_after(CLEAR_S):
            while True:
                event = await wire.receive(warm.tool.receive_json)
                if event is None:
                    return False
                if event.get("type") == "result":
                    wire.handle(Event.CLEARED)
                    return True
        return False

    async def _clear(self, warm: Warm) -> bool:
        """Start a fresh conversation for the next request (confirmed in `_ready`)."""
        try:
            await warm.wire.send(Event.SEND_CLEAR, functools.partial(
                warm.tool.send_line, _user_line("/clear")))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return False
        return True

    async def _converse(self, warm: Warm, streamer: Streamer, prompt: str) -> Turned:
        tool, wire = warm.tool, warm.wire
        try:
            await wire.send(Event.SEND_TURN, functools.partial(tool.send_line,
                                                               _user_line(prompt)))
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise Broken(self.ended_early(tool)) from exc
        turn = await read_turn(tool, streamer, wire)
        if turn is None:
            raise Broken(self.ended_early(tool))
        wire.handle(Event.TURN_END)
        outcome = classify(self.name, *turn)
        if isinstance(outcome, RelayError) and outcome.reason == "auth_required":
            return Turned(outcome, keep=False)   # a fresh process picks up a new login
        # Every other outcome — a quota notice included (SPEC E2) — keeps the process.
        return Turned(outcome, keep=await self._clear(warm))

    async def _interrupt(self, warm: Warm) -> bool:
        """Settle what the wire says is outstanding; True once a fresh conversation is
        on its way (/clear written)."""
        tool, wire = warm.tool, warm.wire
        if wire.state is State.IN_TURN:
            await wire.send(Event.SEND_INTERRUPT, functools.partial(tool.send_line, {
                "type": "control_request", "request_id":
                    f"relay-interrupt-{next(self._ids)}", "request": {"subtype": "interrupt"}}))
        if wire.state is State.INTERRUPTING:
            while True:
                event = await wire.receive(tool.receive_json)
                if event is None:
                    return False
                if event.get("type") == "result":   # the aborted turn's result: confirmed
                    wire.handle(Event.TURN_END)
                    break
        if wire.state is State.IDLE:
            return await self._clear(warm)
        return wire.keepable
