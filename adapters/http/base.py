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

from collections.abc import Awaitable, Callable, Iterator
from types import TracebackType
from typing import Any

import trio

from relay.adapters.limits import read_limits
from relay.api.adapter import Adapter
from relay.api.body import UpstreamBody, read_answer, read_error_text
from relay.api.http import (
    ERROR_BODY_MAX_BYTES,
    Response,
    UpstreamClient,
    make_client,
    transport_errors,
    upstream_url,
)
from relay.vocab.errors import RelayError
from relay.vocab.events import Delta, Event, EventSink
from relay.vocab.limits import RateLimits

from .failures import (
    AUTH_REASONS,
    CONTEXT_PHRASES,
    QUOTA_PHRASES,
    parse_retry_after,
    upstream_failure,
)
from .sse import MAX_SSE_BYTES, SSEDecoder, SSETooLarge

__all__ = ["AUTH_REASONS", "CONTEXT_PHRASES", "DRAIN_AFTER_FINAL_S", "MAX_SSE_BYTES",
           "QUOTA_PHRASES", "HTTPAdapter", "SSEDecoder", "SSETooLarge",
           "parse_retry_after", "upstream_failure"]

DRAIN_AFTER_FINAL_S = 1.0  # after a stream's final event, how long the rest may take


class HTTPAdapter(Adapter):
    """An adapter that talks HTTP: one pooled client for its life, sized by its lanes,
    and a key from the environment (``key_env``; ``key_missing`` when it is unset)."""

    _client: UpstreamClient
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

    def unreachable_action(self) -> str | None:
        """What to do when nothing listens at the provider's address (None: start the
        server or fix ``base_url``); a kind that knows its server says how to start it."""
        return None

    @property
    def max_upstream_bytes(self) -> int:
        return self.provider.max_upstream_bytes

    def bounded(self, events: EventSink) -> EventSink:
        """``events``, refusing an answer whose text grows past ``max_upstream_bytes``
        (what relay accumulates of it for prefill, checks and records: SPEC O5)."""
        return _BoundedSink(events, self.name, self.max_upstream_bytes)

    async def post(self, url: str, body: Any, *, stream: bool,
                   read_stream: Callable[[Response], Awaitable[None]],
                   read_whole: Callable[[str], Awaitable[None]],
                   events: EventSink | None,
                   headers: dict[str, str] | None = None) -> None:
        """POST ``body`` and hand the answer to ``read_stream`` (the open response) or
        ``read_whole`` (its text, at most ``max_upstream_bytes``). Inside ``async with
        client.stream``, so a stop closes the upstream connection; an error status becomes
        its relay error. ``headers`` are sent besides (over) the adapter's own.

        The answer's rate-limit headers (SPEC L12) go to ``events`` as a `RateLimits`
        before anything of the answer, or ride on the error of an error answer. ``events``
        has no default: a call says where its answer's headers go (the attempt's sink),
        or ``None`` for an answer read whole outside the token budgets (embeddings)."""
        sent = self.headers
        if headers:
            over = {k.lower() for k in headers}
            sent = {**{k: v for k, v in self.headers.items() if k.lower() not in over},
                    **headers}
        with transport_errors(self.name, unreachable=self.unreachable_action()):
            async with self._client.stream("POST", upstream_url(url), json=body,
                                           headers=sent) as resp:
                if resp.status_code != 200:
                    raise await self.failed(resp)
                if events is not None:  # (an empty one says "answered" all the same)
                    await events.send(read_limits(resp.headers) or RateLimits())
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
        with transport_errors(self.name, what, unreachable=self.unreachable_action()):
            async with self._client.stream("GET", upstream_url(url),
                                           headers=self.headers) as resp:
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
