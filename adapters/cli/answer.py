"""What a CLI turn produces: the conversation rendered into the tool's input (SPEC P2),
the answer text accumulated and bounded (`TextBuffer`, `Streamer`), and a turn's outcome
with its salvage (SPEC E3). Used by `adapters._cli`."""

from __future__ import annotations

import logging
from typing import Any

import attrs

from relay.vocab.errors import RelayError
from relay.vocab.events import Delta, EventSink, Finish, Recovered, Usage
from relay.vocab.profile import MAX_UPSTREAM_BYTES

__all__ = ["MAX_ANSWER_BYTES", "Outcome", "Streamer", "TextBuffer", "render", "salvage",
           "tool_error"]

logger = logging.getLogger(__name__)

# SPEC O5: the answer text a turn accumulates is bounded like a non-streamed upstream
# body; an adapter uses its provider's `[server] max_upstream_bytes` (this by default).
MAX_ANSWER_BYTES = MAX_UPSTREAM_BYTES


# --- the conversation, rendered (SPEC P2) ------------------------------------------------

_LABELS = {"user": "User", "assistant": "Assistant", "system": "System"}
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
    """(system prompt or None, the prompt): the system/developer messages before the
    first turn go to the tool's system-prompt option; a single user turn is sent as it
    is; several turns become a transcript with role labels, in which a system message
    in the middle of the conversation (Claude Code sends them, SPEC A6) is a System turn.

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
                if turns:
                    turns.append(("system", text))
                else:
                    system.append(text)
            continue
        if role not in ("user", "assistant") or message.get("tool_calls") or \
                message.get("function_call"):
            what = "tool calls" if role == "assistant" else f"{role!r} messages"
            raise RelayError(
                "unsupported", f"provider {provider!r} is a command-line tool that answers "
                f"text; it cannot take {what} (messages[{i}])", provider=provider,
                param="messages")
        turns.append((str(role), _text_of(message, i, provider)))
    if all(role == "system" for role, _ in turns):
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
