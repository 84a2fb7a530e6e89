"""What the three command-line tool adapters share (SPEC L5, P2, P2a, C2, E3).

Theory of operation. A CLI adapter serves one provider whose answers come from a tool
started on this machine (``claude``, ``codex``, ``gemini``). Each request is either

- **oneshot**: a fresh process per request, its prompt on stdin, its JSON events read
  from stdout until the tool's final event; or
- **session**: a warm process taken from a pool of at most ``lanes`` of them, given a
  fresh conversation (codex ``thread/start``, gemini ``session/new``, claude ``/clear``),
  and handed back after the turn — or killed and replaced when it died, broke, or did not
  confirm an interrupt in time. A process the pool finds dead is replaced on the spot.
  What may be reused is decided by the process's `Wire` (``_session.py``, the protocol
  as a state table): one whose write or read was cut mid-message is out of sync, and is
  closed rather than handed on.

Either way, the OpenAI conversation is rendered into the tool's input (`render`): the
system messages through the tool's system-prompt option, the turns as a labelled
transcript; parts the tool cannot take (images, audio, files, tool calls) are
``unsupported``. Success is decided by the tool's final event, never by its exit code
(claude and gemini exit 0 on a signal); an answer whose final event says completed but
that also came with an error signal is salvaged and marked recovered (SPEC E3).

A stop (client gone, run timeout, shutdown) is a cancelled scope that reaches the await
reading the tool's output (or writing its input); the ``finally`` of the attempt then
runs the tool's stop protocol (`ToolProcess.stop`) shielded and bounded by
``interrupt_grace_s`` plus a kill — while the attempt still holds its lane (SPEC L6).

The tools run as plain answerers (P2a) in relay's own working folder
(``<state dir>/cli/<provider>/work`` unless ``workdir`` says otherwise) with their agent
tools off or read-only, unless the provider sets ``agent_tools = true``.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import TracebackType
from typing import Any, ClassVar

import attrs
import trio

from relay.api.adapter import Adapter
from relay.api.fields import ACCOUNTING, EFFORT, LIMITS, OUTPUT, SAMPLING, TOOLS, column
from relay.vocab.errors import RelayError
from relay.vocab.events import Call, EventSink
from relay.vocab.profile import Profile, default_state_dir

from .answer import MAX_ANSWER_BYTES, Outcome, Streamer, TextBuffer, render, salvage, tool_error
from .process import REAP_S, ToolProcess, spawn_tool
from .session import ProtocolError
from .warm import Broken, Rpc, Turned, Warm, WarmPool, refuse

__all__ = ["MAX_ANSWER_BYTES", "Broken", "CLIAdapter", "CLISettings", "Outcome", "Rpc",
           "Streamer", "TextBuffer", "Turned", "Warm", "WarmPool", "refuse", "render",
           "salvage", "tool_error"]

logger = logging.getLogger(__name__)

MODES = ("oneshot", "session")
# SPEC A1a: a tool answers text; it cannot sample, bound, stop or call tools as asked.
# Hints are dropped and reported; what would change the answer's meaning is refused.
# Tools count as refused only when a call is required: tools merely offered (AUTO or
# no choice) are dropped and reported like a hint (amended A1a, `Column.treat`).
CLI_FIELDS = column(translated=("stream_options",),
                    advisory=(*SAMPLING, *EFFORT, *ACCOUNTING, *LIMITS),
                    refused=(*TOOLS, *OUTPUT))

# SPEC L5: 3 lanes; queue waits of up to 10 minutes; a run limit above the tools' own
# 10-minute limit (claude sends `x-stainless-timeout: 600` with every API request).
CLI_PROFILE = Profile(lanes=3, queue_max=16, queue_timeout_s=600.0, run_timeout_s=660.0,
                      interrupt_grace_s=5.0)
CLI_MAX_CALL_S = 600.0
CLI_TYPICAL_CALL_S = 60.0


@attrs.frozen(kw_only=True)
class CLISettings:
    """Keys every CLI provider takes (SPEC 9), besides the common ones.

    command: the tool (default: its name on PATH). args: extra arguments, after relay's
    own. env: added to the tool's environment. model: used for ``PROVIDER/default``
    (else the tool's own default). workdir: the tool's working folder (default: relay's
    own, under the state directory). mode: ``oneshot`` or ``session``. agent_tools: let
    the tool use its agent tools (shell, edits, web) — off by default (SPEC P2a).
    """

    command: str | None = None
    args: tuple[str, ...] = ()
    env: dict[str, str] = attrs.field(factory=dict)
    model: str | None = None
    workdir: str | None = None
    mode: str = "oneshot"
    agent_tools: bool = False


# --- the adapter ---------------------------------------------------------------------------

# A tool answers whatever a caller asks, and some can run commands: relay's other secrets
# must not be in its environment (a caller could ask it to print them).
_CREDENTIAL = re.compile(r"(KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|AUTH)", re.IGNORECASE)


class CLIAdapter(Adapter):
    """The shared half of the claude, codex and gemini adapters."""

    tool: ClassVar[str]            # the command's default name
    package: ClassVar[str]         # its npm package
    login_action: ClassVar[str]    # what to do when it is not logged in
    # Credentials the tool itself may use; every other credential-looking variable of
    # relay's environment (other providers' keys, relay's own token) is kept from it.
    own_credentials: ClassVar[frozenset[str]] = frozenset()
    fields = CLI_FIELDS
    # SPEC O5: the most answer text one turn may bring (for [server] max_upstream_bytes).
    @property
    def answer_limit(self) -> int:
        """The most answer text a turn may accumulate: ``[server] max_upstream_bytes``."""
        return self.provider.max_upstream_bytes

    def __init__(self, provider: Any) -> None:
        super().__init__(provider)
        base = default_state_dir() / "cli" / self.name
        self.private = base / "private"   # relay's own files for the tool
        self.workdir = Path(self.settings.workdir).expanduser() if self.settings.workdir \
            else base / "work"
        self.command = self.settings.command or self.tool
        self.grace_s = provider.profile.interrupt_grace_s
        self.pool: WarmPool[Any] | None = None

    # --- what the kind declares -----------------------------------------------------------
    @classmethod
    def recommended_profile(cls, settings: Any) -> Profile:
        return CLI_PROFILE

    @classmethod
    def max_call_s(cls, settings: Any) -> float:
        return CLI_MAX_CALL_S

    @classmethod
    def typical_call_s(cls, settings: Any) -> float:
        return CLI_TYPICAL_CALL_S

    @classmethod
    def describe_settings(cls, settings: Any) -> str:
        tools = "agent tools ON" if settings.agent_tools else "plain answerer"
        return (f"command {settings.command or cls.tool}, mode {settings.mode}, model "
                f"{settings.model or '(the tool default)'}, {tools}")

    @classmethod
    def settings_problems(cls, settings: Any) -> list[tuple[str, str]]:
        problems = []
        if settings.mode not in MODES:
            problems.append(("mode", f"must be one of {', '.join(MODES)}, got "
                             f"{settings.mode!r}"))
        if settings.command is not None and not settings.command.strip():
            problems.append(("command", "must not be empty"))
        if settings.model is not None and not settings.model.strip():
            problems.append(("model", "must not be empty"))
        return problems

    # --- life -----------------------------------------------------------------------------
    async def __aenter__(self) -> CLIAdapter:
        for folder in (self.private, self.workdir):
            folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.prepare()
        if self.settings.mode == "session":
            self.pool = WarmPool(self.provider.profile.lanes)
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        if self.pool is not None:
            await self.pool.aclose()

    def prepare(self) -> None:
        """Write relay's own files for the tool (sync, small), once at start."""

    async def models(self) -> list[str]:
        return list(self.provider.models) or [self.settings.model or "default"]

    def model_for(self, call: Call) -> str | None:
        """``PROVIDER/default`` → the settings' model, or None (the tool's own default)."""
        if call.model == "default":
            model: str | None = self.settings.model
            return model
        return call.model

    def check_request(self, call: Call) -> None:
        render(call.messages, self.name)

    def system_file(self, system: str | None) -> Path | None:
        """The system prompt as a file of relay's own (tools take it by path), named by
        its hash so one prompt is written once."""
        if system is None:
            return None
        path = self.private / f"system-{hashlib.sha256(system.encode()).hexdigest()[:24]}.md"
        if not path.exists():
            path.write_text(system, encoding="utf-8")
        return path

    def environment(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        """relay's environment without relay's secrets, relay's defaults for the tool
        (``extra``, which the provider's ``env`` overrides), then the provider's ``env``.

        Withheld (SPEC O5): every variable the config names for a secret — any
        provider's ``api_key_env``, relay's ``[server] token_env``, whatever they are
        called (`ProviderConfig.secret_env`) — and every other credential-looking name;
        the tool's own credentials (``own_credentials``) pass."""
        secret = self.provider.secret_env
        env = {k: v for k, v in os.environ.items() if k in self.own_credentials
               or (k not in secret and not _CREDENTIAL.search(k))}
        env.update(extra or {})
        env.update(self.settings.env)   # an explicit setting wins: the user chose it
        return env

    @property
    def install_hint(self) -> str:
        return f"install it with `npm install -g {self.package}`"

    async def spawn(self, argv: list[str], env: dict[str, str]) -> ToolProcess:
        return await spawn_tool(argv, env=env, cwd=self.workdir, provider=self.name,
                                install_hint=self.install_hint)

    def streamer(self, events: EventSink, hold: int = 0) -> Streamer:
        """A request's `Streamer`, bounded by `answer_limit`."""
        return Streamer(events, provider=self.name, hold=hold, limit=self.answer_limit)

    def request_dir(self, call: Call) -> Path:
        """A private folder for one request's files (a system-prompt file …)."""
        return Path(tempfile.mkdtemp(prefix=f"req-{call.request_id}-", dir=self.private))

    # --- running -------------------------------------------------------------------------
    async def run(self, call: Call, events: EventSink) -> None:
        system, prompt = render(call.messages, self.name)
        if self.pool is None:
            folder = self.request_dir(call)
            try:
                await self.run_oneshot(call, system, prompt, events, folder)
            finally:
                shutil.rmtree(folder, ignore_errors=True)
        else:
            await self.run_session(call, system, prompt, events)

    async def run_oneshot(self, call: Call, system: str | None, prompt: str,
                          events: EventSink, folder: Path) -> None:
        raise NotImplementedError

    async def run_session(self, call: Call, system: str | None, prompt: str,
                          events: EventSink) -> None:
        raise NotImplementedError

    async def oneshot(self, argv: list[str], env: dict[str, str], stdin: bytes,
                      read: Callable[[ToolProcess, Streamer], Awaitable[Outcome]],
                      streamer: Streamer) -> None:
        """Run one process to its final event: write ``stdin``, ``read`` its events (it
        streams deltas through ``streamer`` and returns the outcome, or raises the
        failure), then finish the answer. Any way out but a final event — a failure, a
        stop — runs the stop protocol: SIGINT to the group, grace, kill."""
        tool = await self.spawn(argv, env)
        done = False
        try:
            try:
                await tool.send_bytes(stdin)
                await tool.close_stdin()
            except trio.BrokenResourceError:
                pass  # it died at once: its output and stderr tell why
            outcome = await read(tool, streamer)
            done = True
            # The final event came: give the tool a moment to exit (its exit code may
            # say an error came at the end, SPEC E3). Its status and words are read
            # now: once relay has killed it (still running: no error of its own) the
            # status is relay's SIGKILL, and its stderr file is closed.
            with trio.move_on_after(REAP_S):
                await tool.wait_exit()
            rc = tool.returncode
            if rc is None:
                logger.info("provider %s: %s process %d still ran %.0f s after its final "
                            "event; killing it", self.name, self.tool, tool.pid, REAP_S)
            elif rc != 0 and outcome.error_signal is None:
                words = tool.stderr_text()
                outcome.error_signal = (f"{self.tool} exited with status {rc} after its "
                                        "final event" + (f": {words}" if words else ""))
        finally:
            with trio.CancelScope(shield=True,
                                  deadline=trio.current_time() + self.grace_s + 2 * REAP_S):
                if done:
                    await tool.aclose()     # whatever it left behind
                else:
                    await tool.stop(self.grace_s)
        await streamer.finish(salvage(outcome, self.name, self.tool), self.name)

    async def session_turn(
        self, key: Any, start: Callable[[], Awaitable[Warm]],
        ready: Callable[[Warm], Awaitable[bool]] | None,
        converse: Callable[[Warm, Streamer], Awaitable[Turned]],
        interrupt: Callable[[Warm], Awaitable[bool]], streamer: Streamer,
    ) -> None:
        """One request on a warm process. ``converse`` runs the turn to its final event
        and says whether the process may serve again; a process that broke before
        anything reached the client is replaced and the turn tried once more on the new
        one — never for a failure the tool reported (an auth failure is not retried by
        another path, SPEC E2). A stop runs ``interrupt`` within the grace period; a
        process that does not confirm in time is killed, and one whose wire is out of
        sync gets SIGINT, the grace period, then the kill (`_stop_warm`)."""
        assert self.pool is not None
        for attempt in (1, 2):
            warm = await self.pool.take(key, start, ready)
            turned: Turned | None = None
            broken: Broken | None = None
            keep = False
            try:
                await warm.tool.begin_turn()   # SPEC O5: what the turn starts ends with it
                try:
                    turned = await converse(warm, streamer)
                    keep = turned.keep
                except Broken as exc:
                    broken = exc
            finally:
                # (noqa, ASYNC912: cleanup whose every branch awaits, bounded by the grace.)
                with trio.CancelScope(shield=True,  # noqa: ASYNC912
                                      deadline=trio.current_time() + self.grace_s + REAP_S):
                    try:
                        if turned is None and broken is None:   # a stop, or a crash
                            keep = await self._stop_warm(warm, interrupt)
                        elif keep:
                            await warm.tool.end_turn()  # the turn's own processes end
                    finally:
                        if not self.pool.give_back(warm, keep=keep):
                            await warm.aclose()
            if turned is not None:
                if isinstance(turned.result, RelayError):
                    raise turned.result
                await streamer.finish(salvage(turned.result, self.name, self.tool),
                                      self.name)
                return
            assert broken is not None
            if attempt == 2 or streamer.any_sent:
                raise broken.error
            streamer.restart()   # what the broken process said is not part of the answer
            logger.warning("provider %s: warm %s process %d broke (%s); retrying on a fresh "
                           "process", self.name, self.tool, warm.tool.pid, broken.error.message)

    async def _stop_warm(self, warm: Warm,
                         interrupt: Callable[[Warm], Awaitable[bool]]) -> bool:
        """A turn stopped on a warm process: True when it may serve again. In sync, the
        tool's own interrupt, confirmed within the grace period (else killed). Out of
        sync — a write or read was cut, so no message can be framed — the process's
        group gets SIGINT, the grace period, then SIGKILL, as a one-shot process does.
        Runs in a ``finally``: a bug in the protocol (`ProtocolError`) is logged and the
        process killed, never raised over the exception already on its way."""
        if not warm.wire.in_sync:
            logger.info("provider %s: warm %s process %d is out of sync (%s); closing it",
                        self.name, self.tool, warm.tool.pid, warm.wire.state.value)
            await warm.tool.stop(self.grace_s)
            return False
        try:
            confirmed = await warm.tool.stop(self.grace_s, functools.partial(interrupt, warm))
        except ProtocolError:
            logger.exception("provider %s: warm %s process %d: interrupt failed", self.name,
                             self.tool, warm.tool.pid)
            return False
        return confirmed and warm.wire.keepable

    def ended_early(self, tool: ToolProcess, said: str = "") -> RelayError:
        """The tool's output ended before its final event: it died or broke."""
        rc = tool.returncode
        words = tool.stderr_text()
        how = f"exited with status {rc}" if rc is not None else "closed its output"
        return tool_error("upstream_unavailable", self.name,
                          f"{self.tool} {how} before its final event{said}"
                          + (f": {words}" if words else ""), words,
                          action=f"retry (relay starts a fresh {self.tool} process); if it "
                          f"keeps failing, run `{self.command}` in a terminal and see what "
                          "it says")
