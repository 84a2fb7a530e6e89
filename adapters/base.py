"""The adapter contract, and the helpers every HTTP adapter shares.

An adapter kind is one class: its ``kind`` (the registry key), its ``Settings`` (an attrs
class of the keys its providers take beyond the common ones), and its own recommended
profile, longest call and typical call (SPEC L2, L3: there is no global default). An
instance serves one provider:

- ``async with adapter:`` opens what it holds for its life (an HTTP client, a pool of
  warm processes) inside relay's own nursery;
- ``check_call(call)`` refuses, before anything is queued, a request field it cannot
  honour (``unsupported``, SPEC A1) — never dropping one silently;
- ``run(call, events)`` sends `relay.events` to ``events`` and returns when the answer is
  complete, or raises `RelayError`. Every await in it is cancellable, and a cancel closes
  the upstream (HTTP: by leaving ``async with client.stream``; CLI: interrupt, grace,
  kill). It runs inside its lane's slot, so the slot is released only after it returns.

HTTP adapters read every body through `relay.http` (bounded and decompressed by relay,
SPEC O5) and every stream through one reader, `HTTPAdapter.read_sse` over `SSEDecoder`:
lines end at CR, LF or CRLF only, and a line or event over `MAX_SSE_BYTES` is
``bad_upstream_response`` before it is ever buffered whole. The answer text a stream
accumulates is bounded by ``max_upstream_bytes`` too (`HTTPAdapter.bounded`).
"""

from __future__ import annotations

import email.utils
import json
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from types import TracebackType
from typing import Any, NamedTuple

import trio

from relay.api.adapter import Adapter
from relay.api.http import (
    ERROR_BODY_MAX_BYTES,
    AsyncClient,
    Response,
    UpstreamBody,
    make_client,
    read_answer,
    read_error_text,
    transport_errors,
)
from relay.vocab.errors import RelayError
from relay.vocab.events import Delta, Event, EventSink

__all__ = ["AUTH_REASONS", "CONTEXT_PHRASES", "DRAIN_AFTER_FINAL_S", "MAX_SSE_BYTES",
           "QUOTA_PHRASES", "HTTPAdapter", "SSEDecoder", "SSETooLarge",
           "parse_retry_after", "upstream_failure"]

MAX_SSE_BYTES = 8 * 1024 * 1024  # SPEC O5: the longest SSE line, and the largest event
DRAIN_AFTER_FINAL_S = 1.0  # after a stream's final event, how long the rest may take


class HTTPAdapter(Adapter):
    """An adapter that talks HTTP: one pooled client for its life, sized by its lanes,
    and a key from the environment (``key_env``; ``key_missing`` when it is unset)."""

    _client: AsyncClient
    headers: dict[str, str]
    key_env: str | None = None
    key_missing: bool = False

    async def __aenter__(self) -> HTTPAdapter:
        self._client = make_client(self.settings,
                                   max_connections=max(4, self.provider.profile.lanes * 2))
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self._client.aclose()

    @classmethod
    def key_env_for(cls, settings: Any) -> str | None:
        """The environment variable holding the key (``api_key_env`` or the kind's
        default), or None."""
        return settings.api_key_env  # type: ignore[no-any-return]

    @classmethod
    def secret_envs(cls, settings: Any) -> list[str]:
        env = cls.key_env_for(settings)
        return [env] if env else []

    @property
    def max_upstream_bytes(self) -> int:
        return self.provider.max_upstream_bytes

    def bounded(self, events: EventSink) -> EventSink:
        """``events``, refusing an answer whose text grows past ``max_upstream_bytes``
        (what relay accumulates of it for prefill, checks and records: SPEC O5)."""
        return _BoundedSink(events, self.name, self.max_upstream_bytes)

    async def post(self, url: str, body: Any, *, stream: bool,
                   read_stream: Callable[[Response], Awaitable[None]],
                   read_whole: Callable[[str], Awaitable[None]]) -> None:
        """POST ``body`` and hand the answer to ``read_stream`` (the open response) or
        ``read_whole`` (its text, at most ``max_upstream_bytes``). Inside ``async with
        client.stream``, so a stop closes the upstream connection; an error status becomes
        its relay error."""
        with transport_errors(self.name):
            async with self._client.stream("POST", url, json=body,
                                           headers=self.headers) as resp:
                if resp.status_code != 200:
                    raise await self.failed(resp)
                if stream:
                    await read_stream(resp)
                else:
                    await read_whole(await read_answer(resp, self.name,
                                                       self.max_upstream_bytes))

    async def get_text(self, url: str, what: str) -> str:
        """GET a document (a model list page) as text, bounded like an answer.

        Raises:
            RelayError: the mapped upstream failure, or ``bad_upstream_response``.
        """
        self.refuse_without_key()
        with transport_errors(self.name, what):
            async with self._client.stream("GET", url, headers=self.headers) as resp:
                if resp.status_code != 200:
                    raise await self.failed(resp)
                return await read_answer(resp, self.name, self.max_upstream_bytes, what)

    async def failed(self, resp: Response) -> RelayError:
        """The relay error for an error answer, its body read only as far as needed."""
        text = await read_error_text(resp, self.name,
                                     min(ERROR_BODY_MAX_BYTES, self.max_upstream_bytes))
        return upstream_failure(self.name, resp.status_code, text, resp.headers,
                                key_hint=self.key_env)

    async def read_sse(self, resp: Response,
                       handle: Callable[[str | None, str], Awaitable[bool]], *,
                       complete: Callable[[], bool] | None = None) -> None:
        """Feed every event of a streamed answer to ``handle``, which returns True once
        the final event has come; the rest of the body is then read, undecoded, for at
        most `DRAIN_AFTER_FINAL_S` (so the pooled connection can be reused without a
        stuck body holding the lane).

        Complete (SPEC E4) means ``complete()`` when given, else the final event came.
        A body that ends — cleanly or by a dropped connection — while incomplete is
        ``stream_cut``; a connection that drops once complete is a complete answer.

        Raises:
            RelayError: ``stream_cut``; ``bad_upstream_response`` for a line or event
                over `MAX_SSE_BYTES` or a body that cannot be decoded; whatever
                ``handle`` raises.
        """
        decoder = SSEDecoder()
        final = False

        def done() -> bool:
            return complete() if complete is not None else final

        try:
            with trio.CancelScope() as tail:
                body = UpstreamBody(resp, self.name)
                while not final and (piece := await body.piece()) is not None:
                    final = await self._handle_events(decoder.feed(piece), handle)
                if not final:
                    final = await self._handle_events(decoder.end(), handle)
                else:
                    tail.deadline = trio.current_time() + DRAIN_AFTER_FINAL_S
                    await body.drain()
        except SSETooLarge as exc:
            raise RelayError("bad_upstream_response", f"provider {self.name!r} sent {exc}; "
                             "relay stopped reading the stream there", provider=self.name
                             ) from exc
        except RelayError as exc:
            if exc.reason != "upstream_unavailable":
                raise
            if not done():
                raise RelayError("stream_cut", f"provider {self.name!r} broke off the answer "
                                 f"before it was complete: {exc.message}",
                                 provider=self.name) from exc
            return  # the connection dropped once the answer was complete
        if not done():
            raise RelayError("stream_cut", f"provider {self.name!r} ended the stream before "
                             "its final event: the answer is incomplete", provider=self.name)

    @staticmethod
    async def _handle_events(events: Iterator[tuple[str | None, str]],
                             handle: Callable[[str | None, str], Awaitable[bool]]) -> bool:
        for name, data in events:
            if await handle(name, data):
                return True  # what follows the final event is not read
        return False

    def refuse_without_key(self) -> None:
        """An unset key is refused before anything is sent (``auth_required``)."""
        if self.key_missing:
            action = f"set the environment variable {self.key_env} to the provider's API key"
            raise RelayError("auth_required", f"provider {self.name!r} needs an API key: "
                             f"{action}, then restart relay", provider=self.name,
                             action=action)


class _BoundedSink:
    """An `EventSink` that counts the answer text passing through it."""

    def __init__(self, inner: EventSink, provider: str, limit: int) -> None:
        self.inner = inner
        self.provider = provider
        self.limit = limit
        self.size = 0

    async def send(self, event: Event) -> None:
        if isinstance(event, Delta):
            self.size += _delta_bytes(event)
            if self.size > self.limit:
                raise RelayError(
                    "bad_upstream_response",
                    f"provider {self.provider!r} sent an answer longer than "
                    f"max_upstream_bytes ({self.limit} bytes of text); relay stopped it "
                    "there. Raise [server] max_upstream_bytes if answers this long are "
                    "expected.", provider=self.provider)
        await self.inner.send(event)


def _text_bytes(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode())


def _delta_bytes(delta: Delta) -> int:
    size = _text_bytes(delta.content) if delta.content else 0
    for call in delta.tool_calls or ():
        fn = call.get("function") if isinstance(call, dict) else None
        if isinstance(fn, dict):
            size += sum(_text_bytes(v) for v in fn.values() if isinstance(v, str))
    for value in (delta.extra or {}).values():
        if isinstance(value, str):
            size += _text_bytes(value)
    return size


class SSETooLarge(ValueError):
    """An SSE line or event longer than the decoder's bound."""


class SSEDecoder:
    """Server-sent events from the bytes of a body, incrementally (the WHATWG rules relay
    needs).

    ``feed(piece)`` yields ``(event, data)`` for each event a blank line ends (one with
    data; comments such as ``: keepalive`` and ``id:``/``retry:`` fields are ignored);
    ``end()`` yields the one in progress when the body ends without its blank line.

    Lines end at CR, LF or CRLF and nowhere else: split as bytes, so a U+2028, U+2029 or
    U+0085 inside a JSON string (llama.cpp, vLLM and LM Studio send raw UTF-8) stays in
    its line. Each byte is scanned once: the unfinished line is kept aside and never
    rescanned. A line, or an event's data, over ``max_bytes`` raises `SSETooLarge` before
    it is buffered past that.
    """

    def __init__(self, max_bytes: int = MAX_SSE_BYTES) -> None:
        self.max_bytes = max_bytes
        self.event: str | None = None
        self.data: list[str] = []
        self._data_bytes = 0
        self._partial = bytearray()  # the line not yet ended
        self._after_cr = False       # the last line ended with CR: an LF next is its end
        self._started = False        # (for the byte-order mark a stream may start with)

    def feed(self, piece: bytes) -> Iterator[tuple[str | None, str]]:
        if self._after_cr and piece[:1] == b"\n":
            piece = piece[1:]  # the LF of a CRLF split across two pieces
        self._after_cr = False
        if not piece:
            return
        if not self._started:
            self._started = True
            piece = piece.removeprefix(b"\xef\xbb\xbf")
        lines = piece.splitlines(keepends=True)  # bytes: at CR, LF, CRLF only
        last = lines[-1]
        if not last.endswith((b"\n", b"\r")):
            lines.pop()
        else:
            last = b""
            self._after_cr = lines[-1].endswith(b"\r")
        for line in lines:
            stripped = line.rstrip(b"\r\n")
            if self._partial:
                self._grow(stripped)
                stripped, self._partial = bytes(self._partial), bytearray()
            elif len(stripped) > self.max_bytes:
                raise SSETooLarge(f"an SSE line longer than {self.max_bytes} bytes")
            event = self._line(stripped.decode("utf-8", "replace"))
            if event is not None:
                yield event
        if last:
            self._grow(last)

    def end(self) -> Iterator[tuple[str | None, str]]:
        """What the body left unfinished: its last line and event, if they had data."""
        if self._partial:
            line, self._partial = bytes(self._partial), bytearray()
            event = self._line(line.decode("utf-8", "replace"))
            if event is not None:
                yield event
        event = self._dispatch()
        if event is not None:
            yield event

    def _grow(self, more: bytes) -> None:
        if len(self._partial) + len(more) > self.max_bytes:
            raise SSETooLarge(f"an SSE line longer than {self.max_bytes} bytes (no line end "
                              f"after {len(self._partial) + len(more)} bytes)")
        self._partial += more

    def _line(self, line: str) -> tuple[str | None, str] | None:
        if not line:
            return self._dispatch()
        if line.startswith(":"):
            return None
        field, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if field == "event":
            self.event = value
        elif field == "data":
            self._data_bytes += _text_bytes(value) + 1
            if self._data_bytes > self.max_bytes:
                raise SSETooLarge(f"an SSE event longer than {self.max_bytes} bytes")
            self.data.append(value)
        return None

    def _dispatch(self) -> tuple[str | None, str] | None:
        event, data = self.event, self.data
        self.event, self.data, self._data_bytes = None, [], 0
        return (event, "\n".join(data)) if data else None


def parse_retry_after(headers: Mapping[str, str]) -> float | None:
    """Seconds from ``retry-after-ms``, ``retry-after`` (seconds or an HTTP date)."""
    ms = headers.get("retry-after-ms")
    if ms:
        try:
            return max(0.0, float(ms) / 1000)
        except ValueError:
            pass
    value = headers.get("retry-after")
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


# Words that mean the same failure whatever the provider's error shape (lower case).
# A conversation longer than the model's context (a larger model may fit: SPEC F2).
CONTEXT_PHRASES = (
    "context_length_exceeded", "maximum context length",     # OpenAI-compatible servers
    "prompt is too long",                                      # Anthropic
    "exceeds the maximum number of tokens",                    # Gemini ("input token count")
)
# An account out of money or out of its allowance: waiting a minute will not help.
QUOTA_PHRASES = (
    "insufficient_quota", "billing_error",                     # OpenAI; Anthropic's type
    "credit balance is too low", "credits are depleted",       # Anthropic; Gemini prepay
    "limit: 0",                                                # Gemini: no allowance at all
)
# A bad key that a provider reports without a 401/403 (Gemini: 400 INVALID_ARGUMENT).
AUTH_REASONS = ("API_KEY_INVALID", "API_KEY_SERVICE_BLOCKED")


class _Said(NamedTuple):
    """What a provider's error body says, whatever its shape."""

    message: str
    code: str | None = None     # OpenAI's code, or Google's status word
    type: str | None = None     # OpenAI's or Anthropic's error type
    retry_s: float | None = None  # google.rpc.RetryInfo retryDelay
    windows: tuple[str, ...] = ()  # google.rpc.QuotaFailure quota ids and metrics
    reasons: tuple[str, ...] = ()  # google.rpc.ErrorInfo reasons


def _error_fields(text: str) -> _Said:
    """Read an error body: OpenAI's ``{"error": {message, type, code}}``, Anthropic's
    ``{"type": "error", "error": {type, message}}``, Google's ``{"error": {code, message,
    status, details}}`` (also wrapped in a list), or plain text."""
    try:
        body = json.loads(text)
    except ValueError:
        return _Said(text.strip())
    if isinstance(body, list) and body and isinstance(body[0], dict):
        body = body[0]
    err = body.get("error", body) if isinstance(body, dict) else body
    if isinstance(err, str):
        return _Said(err)
    if not isinstance(err, dict):
        return _Said(text.strip())

    def word(key: str) -> str | None:
        value = err.get(key)
        return value if isinstance(value, str) else None

    message = str(err.get("message") or err.get("msg") or text.strip())
    retry_s: float | None = None
    windows: list[str] = []
    reasons: list[str] = []
    for detail in err.get("details") or ():
        if not isinstance(detail, dict):
            continue
        kind = str(detail.get("@type", ""))
        if kind.endswith("RetryInfo"):
            retry_s = _duration_s(detail.get("retryDelay"))
        elif kind.endswith("QuotaFailure"):
            for violation in detail.get("violations") or ():
                if isinstance(violation, dict):
                    windows += [str(violation.get(k, "")) for k in ("quotaId", "quotaMetric")]
        elif kind.endswith("ErrorInfo") and isinstance(detail.get("reason"), str):
            reasons.append(detail["reason"])
    return _Said(message, word("code") or word("status"), word("type"), retry_s,
                 tuple(w for w in windows if w), tuple(reasons))


def _duration_s(value: Any) -> float | None:
    """A protobuf Duration as JSON (``"43s"``, ``"0.5s"``) in seconds."""
    if isinstance(value, str) and value.endswith("s"):
        try:
            return max(0.0, float(value[:-1]))
        except ValueError:
            return None
    return None


def _is_quota(said: _Said, lowered: str) -> bool | None:
    """True: the allowance is used up; False: a short-window rate limit; None: unknown."""
    if any(p in lowered for p in QUOTA_PHRASES) or "quota" in (said.code or "").lower():
        return True
    windows = " ".join(said.windows).lower()
    if "perday" in windows or "per_day" in windows:
        return True
    if any(w in windows for w in ("perminute", "per_minute", "persecond", "per_second")):
        return False
    if "per day" in lowered or "daily" in lowered:
        return True
    return None


def upstream_failure(
    provider: str, status: int, text: str, headers: Mapping[str, str], *,
    key_hint: str | None = None, in_stream: bool = False,
) -> RelayError:
    """Map a provider's HTTP error answer to a relay error (one mapping for every HTTP
    adapter). The provider's words go to the client whole, in ``upstream_message``.

    ``in_stream``: the error arrived inside a 200 stream (Anthropic's ``event: error``);
    ``status`` is then the one its error type stands for, and no upstream status is
    reported, since the provider sent none.
    """
    said = _error_fields(text)
    message = said.message
    where = (f"provider {provider!r} reported an error inside the stream" if in_stream
             else f"provider {provider!r} answered {status}")
    said_it = f"{where}: {message}"
    common: dict[str, Any] = {"provider": provider,
                              "upstream_status": None if in_stream else status,
                              "upstream_message": message}
    lowered = f"{said.code} {said.type} {message}".lower()
    if status in (401, 403) or any(r in AUTH_REASONS for r in said.reasons):
        action = (f"check the API key in the environment variable {key_hint}"
                  if key_hint else "check the provider's API key or login")
        return RelayError("auth_required", f"{said_it}. Authentication failed: {action}.",
                          action=action, **common)
    quota = _is_quota(said, lowered)
    if status == 429 or said.code == "RESOURCE_EXHAUSTED":
        if quota:
            return RelayError("quota_exhausted", f"{said_it}. The account's quota is used "
                              "up.", **common)
        retry = parse_retry_after(headers)
        return RelayError("rate_limited", f"{said_it}. The provider is rate limiting; retry "
                          "after the time it gave.",
                          retry_after_s=retry if retry is not None else said.retry_s or 1.0,
                          **common)
    if 400 <= status < 500:
        if any(p in lowered for p in QUOTA_PHRASES):
            return RelayError("quota_exhausted", f"{said_it}. The account's quota is used "
                              "up.", **common)
        if any(p in lowered for p in CONTEXT_PHRASES):
            return RelayError("context_too_long", f"{said_it}. The conversation is longer "
                              "than this model's context.", **common)
        return RelayError("rejected", said_it, status=status, **common)
    return RelayError("upstream_error", f"{said_it}. The provider failed on its side.",
                      **common)
