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
from typing import Any, ClassVar, Generic, TypeVar

import attrs
import trio

from relay.api.adapter import Adapter
from relay.vocab.errors import RelayError
from relay.vocab.events import Call, Delta, EventSink, Finish, Recovered, Usage
from relay.vocab.profile import MAX_UPSTREAM_BYTES, Profile, default_state_dir

from ._process import REAP_S, ToolProcess, spawn_tool
from ._session import Event, ProtocolError, Wire

__all__ = ["MAX_ANSWER_BYTES", "Broken", "CLIAdapter", "CLISettings", "Outcome", "Rpc",
           "Streamer", "TextBuffer", "Turned", "Warm", "WarmPool", "refuse", "render",
           "salvage", "tool_error"]

logger = logging.getLogger(__name__)

MODES = ("oneshot", "session")
CLOSE_S = 2.0   # closing the pool: how long a warm process may take to exit on its own
SUPPORTED_PARAMS = frozenset({"n", "stream_options", "user", "metadata"})
# SPEC O5: the answer text a turn accumulates is bounded like a non-streamed upstream
# body; an adapter uses its provider's `[server] max_upstream_bytes` (this by default).
MAX_ANSWER_BYTES = MAX_UPSTREAM_BYTES

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


# --- the conversation, rendered (SPEC P2) ------------------------------------------------

_LABELS = {"user": "User", "assistant": "Assistant"}
_TRANSCRIPT_HEAD = ("The conversation so far, oldest turn first. Reply to the last User "
                    "turn as the Assistant; write only the reply.")


def _text_of(message: dict[str, Any], index: int, provider: str) -> str:
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    pieces = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text":
            raise RelayError(
                "unsupported", f"provider {provider!r} is a command-line tool that takes "
                f"text only; messages[{index}].content[{j}] is of type {kind!r}",
                provider=provider, param="messages")
        pieces.append(str(part.get("text", "")))
    return "".join(pieces)


def render(messages: list[dict[str, Any]], provider: str) -> tuple[str | None, str]:
    """(system prompt or None, the prompt): system/developer messages go to the tool's
    system-prompt option; a single user turn is sent as it is; several turns become a
    transcript with role labels.

    Raises:
        RelayError: ``unsupported`` for parts or roles a text-only tool cannot take.
    """
    system: list[str] = []
    turns: list[tuple[str, str]] = []
    for i, message in enumerate(messages):
        role = message.get("role")
        if role in ("system", "developer"):
            text = _text_of(message, i, provider)
            if text.strip():
                system.append(text)
            continue
        if role not in _LABELS or message.get("tool_calls") or message.get("function_call"):
            what = "tool calls" if role == "assistant" else f"{role!r} messages"
            raise RelayError(
                "unsupported", f"provider {provider!r} is a command-line tool that answers "
                f"text; it cannot take {what} (messages[{i}])", provider=provider,
                param="messages")
        turns.append((str(role), _text_of(message, i, provider)))
    if not turns:
        raise RelayError("invalid_request", "the conversation has no user message",
                         param="messages")
    system_prompt = "\n\n".join(system) if system else None
    if len(turns) == 1 and turns[0][0] == "user" and not turns[0][1].lstrip().startswith(
            "/"):
        return system_prompt, turns[0][1]
    # A transcript never starts with "/": a tool must not take a turn for a command.
    body = "\n\n".join(f"{_LABELS[role]}: {text}" for role, text in turns)
    return system_prompt, f"{_TRANSCRIPT_HEAD}\n\n{body}"


# --- a turn's result -------------------------------------------------------------------

@attrs.define
class Outcome:
    """What a tool's turn produced, once its final event said it completed."""

    text: str
    finish: str = "stop"
    usage: Usage | None = None
    error_signal: str | None = None  # an error signalled at the end of a completed run


class TextBuffer:
    """Answer text gathered piece by piece: linear in its size (pieces are joined when
    read, once), and bounded (SPEC O5): more than ``limit`` bytes of UTF-8 is
    ``bad_upstream_response``, raised by the `append` that crosses it."""

    def __init__(self, provider: str, limit: int = MAX_ANSWER_BYTES) -> None:
        self.provider = provider
        self.limit = limit
        self.size = 0     # bytes (UTF-8) so far
        self.chars = 0    # characters so far
        self._pieces: list[str] = []

    def append(self, piece: str) -> None:
        """Add ``piece``.

        Raises:
            RelayError: ``bad_upstream_response`` when the text would exceed the limit.
        """
        size = len(piece) if piece.isascii() else len(piece.encode("utf-8", "surrogatepass"))
        if self.size + size > self.limit:
            raise RelayError("bad_upstream_response", f"provider {self.provider!r}: the "
                             f"tool's answer is larger than {self.limit} bytes (relay's "
                             "limit for one answer, [server] max_upstream_bytes)",
                             provider=self.provider)
        self.size += size
        self.chars += len(piece)
        self._pieces.append(piece)

    @property
    def text(self) -> str:
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""


class Streamer:
    """Sends a turn's text to the sink as deltas. ``hold`` characters are held back until
    the final event has been checked (claude: its answer may be a disguised failure, and
    a short one must become a real HTTP status, not text, SPEC E2 / A2). The text seen is
    a `TextBuffer`: linear work, and bounded by ``limit``."""

    def __init__(self, events: EventSink, *, provider: str, hold: int = 0,
                 limit: int = MAX_ANSWER_BYTES) -> None:
        self.events = events
        self.hold = hold
        self.buffer = TextBuffer(provider, limit)   # every delta so far
        self.sent = 0                               # characters of it sent
        self._unsent: list[str] = []                # the deltas not sent yet

    @property
    def seen(self) -> str:
        return self.buffer.text

    @property
    def any_sent(self) -> bool:
        return self.sent > 0

    def restart(self) -> None:
        """Forget the text held back (nothing was sent): the turn starts again."""
        assert not self.any_sent
        self.buffer = TextBuffer(self.buffer.provider, self.buffer.limit)
        self._unsent.clear()

    async def delta(self, text: str) -> None:
        """One piece of the answer.

        Raises:
            RelayError: ``bad_upstream_response`` when the answer grows over the limit.
        """
        if not text:
            return
        self.buffer.append(text)
        self._unsent.append(text)
        if self.buffer.chars > self.hold:
            chunk = "".join(self._unsent)
            await self.events.send(Delta(content=chunk))
            self._unsent.clear()
            self.sent = self.buffer.chars

    async def finish(self, outcome: Outcome, provider: str) -> None:
        """The final answer: what was not streamed yet, usage, recovered, finish.

        Raises:
            RelayError: ``bad_upstream_response`` when the final text is over the limit.
        """
        final = outcome.text
        TextBuffer(self.buffer.provider, self.buffer.limit).append(final)   # bounded too
        seen = self.seen
        if final.startswith(seen[:self.sent]):
            rest = final[self.sent:]
        else:  # the final event disagrees with the deltas: the deltas already went out
            logger.warning("provider %s: the final answer differs from the streamed text; "
                           "keeping what was streamed", provider)
            rest = seen[self.sent:]
        if rest:
            await self.events.send(Delta(content=rest))
            self.sent += len(rest)
        if outcome.usage is not None:
            await self.events.send(outcome.usage)
        if outcome.error_signal is not None:
            await self.events.send(Recovered(outcome.error_signal))
        await self.events.send(Finish(outcome.finish))


def salvage(outcome: Outcome, provider: str, tool: str) -> Outcome:
    """SPEC E3: a completed run with an error signal at the end keeps its answer when it
    has one (the record is marked recovered); with no text it is a failure."""
    if outcome.error_signal is not None and not outcome.text.strip():
        raise RelayError("bad_upstream_response", f"provider {provider!r}: {tool} said the "
                         f"run completed but gave no answer, and signalled an error: "
                         f"{outcome.error_signal}", provider=provider,
                         upstream_message=outcome.error_signal)
    return outcome


def tool_error(reason: str, provider: str, said: str, words: str, *,
               status: int | None = None, action: str | None = None) -> RelayError:
    """A failure in the tool's own words (``upstream_message``, whole)."""
    return RelayError(reason, f"provider {provider!r}: {said}", provider=provider,
                      upstream_status=status, upstream_message=words or None, action=action)


# --- warm processes ---------------------------------------------------------------------

W = TypeVar("W", bound="Warm")


@attrs.define(eq=False)
class Warm:
    """A warm process, its protocol state (`Wire`) and what its adapter knows about it."""

    tool: ToolProcess
    key: Any = None          # what it was started for (model, system prompt …)
    uses: int = 0
    state: dict[str, Any] = attrs.field(factory=dict)
    wire: Wire = attrs.field(factory=Wire)

    async def aclose(self) -> None:
        """Kill and reap it (bounded, shielded: `ToolProcess.aclose`)."""
        self.wire.handle(Event.CLOSE)
        await self.tool.aclose()


class WarmPool(Generic[W]):
    """At most ``size`` warm processes (SPEC P2): idle ones wait here between requests.

    `take` gives an idle process started for the same key, or starts one (retiring an
    idle one of another key when the pool is full); a process found dead is replaced.
    `give_back` keeps a process its `Wire` says may be reused; anything else is killed.

    Every process is in exactly one place: ``idle`` (the list), ``busy`` (taken: being
    made ready, or serving a request), or counted in ``starting``; each move between
    them happens with no checkpoint in between, so two takes never act on the same
    entry (one that awaits re-reads the list afterwards).
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self.idle: list[W] = []
        self.busy: set[W] = set()
        self.starting = 0   # processes being started
        self.closed = False
        self._slots = trio.Semaphore(size)
        self.started = 0  # processes ever started (tests: restarts)

    @property
    def total(self) -> int:
        return len(self.idle) + len(self.busy) + self.starting

    async def take(self, key: Any, start: Callable[[], Awaitable[W]],
                   ready: Callable[[W], Awaitable[bool]] | None = None) -> W:
        """An idle process for ``key``, made ready (``ready`` False, or its wire not
        ready: replace it), or a new one. Waits only when every process is busy (the lane
        normally prevents that)."""
        await self._slots.acquire()
        try:
            while True:
                dead = [w for w in self.idle if not w.tool.alive]
                if dead:   # taken out all at once, before any await
                    self.idle = [w for w in self.idle if w not in dead]
                    for warm in dead:
                        logger.info("warm %s process %d had exited (rc %s); replacing it",
                                    warm.tool.name, warm.tool.pid, warm.tool.returncode)
                        await warm.aclose()
                    continue   # the list may have changed meanwhile: look again
                match = next((w for w in self.idle if w.key == key), None)
                if match is None:
                    break
                self.idle.remove(match)
                self.busy.add(match)   # still counted while it is made ready
                try:
                    ok = (ready is None or await ready(match)) and match.wire.ready
                except BaseException:   # a stop while making it ready: it is nobody's now
                    self.busy.discard(match)
                    with trio.CancelScope(shield=True,
                                          deadline=trio.current_time() + 2 * REAP_S):
                        await match.aclose()
                    raise
                if ok:
                    return match
                self.busy.discard(match)
                await match.aclose()
            if self.total >= self.size and self.idle:
                await self.idle.pop(0).aclose()   # room for one of this key
            self.starting += 1
            try:
                warm = await start()
            finally:
                self.starting -= 1
            self.started += 1
            self.busy.add(warm)
            return warm
        except BaseException:
            self._slots.release()
            raise

    def give_back(self, warm: W, *, keep: bool) -> bool:
        """Return a taken process; kept only when ``keep``, it is alive, its wire says
        it may be reused and the pool is open. False: the caller must `Warm.aclose` it."""
        self.busy.discard(warm)
        self._slots.release()
        if keep and warm.tool.alive and warm.wire.keepable and not self.closed:
            warm.uses += 1
            self.idle.append(warm)
            return True
        return False

    async def aclose(self) -> None:
        """Close every idle process: stdin closed (each tool exits on that), then killed
        whatever is left after `CLOSE_S`. A process handed back later is not kept."""
        self.closed = True
        idle, self.idle = self.idle, []
        # (noqa, ASYNC912: an empty pool has nothing to await; the loops await each close.)
        with trio.CancelScope(shield=True), trio.move_on_after(CLOSE_S + REAP_S):  # noqa: ASYNC912
            for warm in idle:
                try:
                    await warm.tool.close_stdin()
                except trio.BrokenResourceError:
                    pass
            with trio.move_on_after(CLOSE_S):  # noqa: ASYNC912 (as above)
                for warm in idle:
                    await warm.tool.wait_exit()
            for warm in idle:
                await warm.aclose()
            for warm in list(self.busy):   # a copy: requests hand theirs back meanwhile
                await warm.tool.aclose()     # (its wire is its request's: it sees the end)


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
    supported_params = SUPPORTED_PARAMS
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

    def check_call(self, call: Call) -> None:
        super().check_call(call)
        if (call.params.get("n") or 1) != 1:
            raise RelayError("unsupported", f"provider {self.name!r} answers with one "
                             "choice only; 'n' must be 1", provider=self.name, param="n")
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
                          + (f": {words}" if words else ""), words)


@attrs.define
class Turned:
    """A warm turn that reached its final event: the outcome or the tool's failure, and
    whether the process may serve the next request."""

    result: Outcome | RelayError
    keep: bool = True


class Broken(Exception):
    """A warm process died or broke mid-turn (its error says how)."""

    def __init__(self, error: RelayError) -> None:
        super().__init__(error.message)
        self.error = error


class Rpc:
    """Newline-delimited JSON-RPC with a warm tool (codex ``app-server``, gemini ACP).

    Every write and read goes through the process's `Wire` (a cut write leaves it out of
    sync). `read` returns the tool's next response or notification; requests *from* the
    tool (approvals, file access) are answered at once by ``answer`` — a plain answerer
    approves nothing — and never returned.
    """

    def __init__(self, tool: ToolProcess, wire: Wire, *, jsonrpc: bool,
                 answer: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
        self.tool = tool
        self.wire = wire
        self.jsonrpc = jsonrpc
        self.answer = answer
        self._next = 0

    def _frame(self, msg: dict[str, Any]) -> dict[str, Any]:
        return {"jsonrpc": "2.0", **msg} if self.jsonrpc else msg

    async def request(self, method: str, params: Any, event: Event = Event.SEND_CALL
                      ) -> int:
        """Send a request (``event``: what it is to the protocol); returns its id, which
        is the wire's `pending` once written."""
        self._next += 1
        line = self._frame({"id": self._next, "method": method, "params": params})
        await self.wire.send(event, functools.partial(self.tool.send_line, line),
                             reply_id=self._next)
        return self._next

    async def notify(self, method: str, params: Any = None,
                     event: Event = Event.SEND_NOTE) -> None:
        msg: dict[str, Any] = {"method": method}
        if params is not None:
            msg["params"] = params
        await self.wire.send(event, functools.partial(self.tool.send_line, self._frame(msg)))

    async def read(self) -> dict[str, Any] | None:
        while True:
            msg = await self.wire.receive(self.tool.receive_json)
            if msg is None:
                return None
            if "method" in msg and "id" in msg:   # the tool asks us something
                line = self._frame({"id": msg["id"], **self.answer(msg)})
                await self.wire.send(Event.SEND_ANSWER,
                                     functools.partial(self.tool.send_line, line))
                continue
            return msg

    async def wait_response(self, request_id: int,
                            on_message: Callable[[dict[str, Any]], Awaitable[None]] | None = None,
                            ) -> dict[str, Any] | None:
        """Read to the response to ``request_id`` (None: the output ended first);
        everything before it goes to ``on_message``. The caller tells the wire what the
        response was (a REPLY, a TURN_END)."""
        while True:
            msg = await self.read()
            if msg is None:
                return None
            if msg.get("id") == request_id and "method" not in msg:
                return msg
            if on_message is not None:
                await on_message(msg)


def refuse(msg: dict[str, Any]) -> dict[str, Any]:
    return {"error": {"code": -32601, "message": "relay runs this tool as a plain answerer "
                      f"and approves nothing ({msg.get('method')})"}}
