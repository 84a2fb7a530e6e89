"""A deterministic fake provider: the packaged default config's, and the tests'.

It answers at once by default, and can be told to behave badly through its settings or,
per request, through the model name's query part (``fake/echo?chunks=5&chunk_delay_s=0.1``):

- ``reply``: the answer text (default: the last user message, or ``ok``); split into
  words, one chunk each, or into ``chunks`` numbered pieces;
- ``delay_s``: before the first chunk; ``chunk_delay_s``: before each further chunk;
- ``fail``: a relay error reason to fail with, after ``fail_after`` chunks (default 0);
  ``cut``: end after ``cut_after`` chunks without a finish (a cut-off answer);
- ``finish``: the finish reason (default ``stop``; ``max_tokens`` cuts with ``length``,
  and a ``stop`` sequence ends the answer before it);
- a call ending in an assistant message continues it (a prefill, SPEC F8);
- ``ignore_stop_s``: on a stop, keep working (shielded, bounded) for this long, like a
  CLI tool that is slow to confirm its interrupt (SPEC L6).

The instance counts what happened (``started``, ``completed``, ``stopped``, ``active``)
so tests can see whether a request ever reached a provider.
"""

from __future__ import annotations

import math
from typing import Any
from urllib.parse import parse_qsl

import attrs
import trio

from relay.api.adapter import Adapter, Capabilities
from relay.api.fields import ACCOUNTING, EFFORT, LIMITS, OUTPUT, SAMPLING, TOOLS, column
from relay.vocab.errors import REASONS, RelayError
from relay.vocab.events import Call, Delta, EventSink, Finish, Usage
from relay.vocab.profile import Profile

__all__ = ["FakeAdapter", "FakeSettings"]


@attrs.frozen(kw_only=True)
class FakeSettings:
    reply: str | None = None
    delay_s: float = 0.0
    chunk_delay_s: float = 0.0


_KNOBS: dict[str, type] = {
    "reply": str, "chunks": int, "delay_s": float, "chunk_delay_s": float, "fail": str,
    "fail_after": int, "cut_after": int, "finish": str, "ignore_stop_s": float,
}


class FakeAdapter(Adapter):
    kind = "fake"
    Settings = FakeSettings
    # A call ending in an assistant message continues it.
    capabilities = Capabilities(prefill=True)
    # It bounds and stops its answer; it samples nothing (SPEC A1a). Tools are refused
    # only when a call is required; offered tools are dropped and reported.
    fields = column(translated=(*LIMITS, "stop", "stream_options"),
                    advisory=(*SAMPLING, *EFFORT, *ACCOUNTING),
                    refused=(*TOOLS, *(f for f in OUTPUT if f != "stop")))

    def __init__(self, provider: Any) -> None:
        super().__init__(provider)
        self.started = 0
        self.completed = 0
        self.stopped = 0
        self.active = 0

    @classmethod
    def recommended_profile(cls, settings: Any) -> Profile:
        return Profile(lanes=4, queue_max=64, queue_timeout_s=30.0, run_timeout_s=60.0)

    @classmethod
    def typical_call_s(cls, settings: Any) -> float:
        return 0.1

    async def models(self) -> list[str]:
        return list(self.provider.models) or ["echo"]

    def check_request(self, call: Call) -> None:
        self._knobs(call.model)

    def listed_name(self, model: str) -> str:
        return model.partition("?")[0]

    def _knobs(self, model: str) -> dict[str, Any]:
        _, _, query = model.partition("?")
        knobs: dict[str, Any] = attrs.asdict(self.settings)
        for key, raw in parse_qsl(query, keep_blank_values=True):
            kind = _KNOBS.get(key)
            if kind is None:
                raise RelayError("invalid_request", f"fake model option {key!r} is unknown; "
                                 f"known: {', '.join(_KNOBS)}", param="model")
            try:
                knobs[key] = kind(raw)
            except ValueError as exc:
                raise RelayError("invalid_request", f"fake model option {key}={raw!r} is "
                                 f"not a {kind.__name__}", param="model") from exc
        if "fail" in knobs and knobs["fail"] not in REASONS:
            raise RelayError("invalid_request", f"fake model option fail={knobs['fail']!r} "
                             "is not a relay error reason", param="model")
        return knobs

    async def run(self, call: Call, events: EventSink) -> None:
        knobs = self._knobs(call.model)
        pieces = _stopped(_pieces(call, knobs), call.params.get("stop"))
        limit = call.params.get("max_completion_tokens") or call.params.get("max_tokens")
        finish = knobs.get("finish", "stop")
        if isinstance(limit, int) and limit < len(pieces):
            pieces, finish = pieces[:limit], "length"
        self.started += 1
        self.active += 1
        try:
            await trio.sleep(knobs["delay_s"])
            for i, piece in enumerate(pieces):
                if "fail" in knobs and i == knobs.get("fail_after", 0):
                    raise _failure(self.name, knobs["fail"])
                if i == knobs.get("cut_after", -1):
                    return  # ends without a Finish: a cut-off answer
                if i and knobs["chunk_delay_s"]:
                    await trio.sleep(knobs["chunk_delay_s"])
                await events.send(Delta(content=piece))
            if "fail" in knobs and knobs.get("fail_after", 0) >= len(pieces):
                raise _failure(self.name, knobs["fail"])
            if knobs.get("cut_after", -1) >= len(pieces):
                return
            prompt = sum(len(str(m.get("content", "")).split()) for m in call.messages)
            await events.send(Usage(prompt, len(pieces), prompt + len(pieces)))
            await events.send(Finish(finish))
            self.completed += 1
        except trio.Cancelled:
            self.stopped += 1
            grace = knobs.get("ignore_stop_s", 0.0)
            if grace > 0:
                # Slow to stop, like a CLI tool: shielded, and bounded by its own deadline.
                with trio.CancelScope(shield=True), trio.move_on_after(grace):
                    await trio.sleep(math.inf)
            raise
        finally:
            self.active -= 1


def _pieces(call: Call, knobs: dict[str, Any]) -> list[str]:
    pieces = _answer(call, knobs)
    last = call.messages[-1] if call.messages else {}
    prefix = last.get("content") if last.get("role") == "assistant" else None
    if isinstance(prefix, str) and "".join(pieces).startswith(prefix):
        # A prefill: continue the answer after the text already given.
        out, seen = [], ""
        for piece in pieces:
            if len(seen) >= len(prefix):
                out.append(piece)
            elif len(seen) + len(piece) > len(prefix):
                out.append(piece[len(prefix) - len(seen):])
            seen += piece
        return out
    return pieces


def _stopped(pieces: list[str], stop: Any) -> list[str]:
    """The pieces up to the first stop sequence (which is not part of the answer)."""
    stops = [stop] if isinstance(stop, str) else [s for s in stop or () if isinstance(s, str)]
    text = "".join(pieces)
    cut = min((i for i in (text.find(s) for s in stops if s) if i >= 0), default=-1)
    if cut < 0:
        return pieces
    out: list[str] = []
    seen = 0
    for piece in pieces:
        if seen + len(piece) > cut:
            if cut > seen:
                out.append(piece[:cut - seen])
            break
        out.append(piece)
        seen += len(piece)
    return out


def _answer(call: Call, knobs: dict[str, Any]) -> list[str]:
    if "chunks" in knobs:
        return [f"t{i} " for i in range(max(0, knobs["chunks"]))]
    reply = knobs.get("reply")
    if reply is None:
        reply = "ok"
        for message in reversed(call.messages):
            if message.get("role") == "user":
                content = message.get("content")
                if isinstance(content, list):
                    content = " ".join(p["text"] for p in content if isinstance(p, dict)
                                       and isinstance(p.get("text"), str))
                if isinstance(content, str) and content.strip():
                    reply = content
                break
    words = reply.split(" ")
    return [w + " " for w in words[:-1]] + [words[-1]] if words else [reply]


def _failure(provider: str, reason: str) -> RelayError:
    # A fixed Retry-After of 2 s where a retry may help; a reason with its own (quota:
    # 600 s) keeps it.
    retry = None if REASONS[reason].retry_after_s is not None else 2.0
    return RelayError(reason, f"the fake provider {provider!r} was told to fail with "
                      f"{reason!r}", provider=provider, retry_after_s=retry,
                      upstream_message=f"fake failure: {reason}")
