"""Reading an upstream body: decompressed by relay, in bounded pieces (SPEC O5).

Bodies are read through `UpstreamBody`, never whole: relay decompresses them itself, in
pieces of at most `PIECE_BYTES`, so a body is measured *after* decompression and reading
stops at the bound — a 1 MB gzip body that inflates to 1 GB never exists in memory.
`read_answer` refuses a body over ``max_upstream_bytes``; `read_error_text` keeps the
head of an error body and says how much it read. Only ``gzip`` and ``deflate`` are asked
for and decoded.
"""

from __future__ import annotations

import zlib
from collections.abc import AsyncIterator, Mapping
from typing import Protocol

from relay.api.http import transport_errors
from relay.api.inflate import Inflate
from relay.vocab.errors import RelayError, cut_marker

__all__ = ["PIECE_BYTES", "Body", "UpstreamBody", "read_answer", "read_error_text"]

PIECE_BYTES = 64 * 1024  # the most a decoded piece of a body holds


class Body(Protocol):
    """What a body is read from: an open upstream response."""

    @property
    def headers(self) -> Mapping[str, str]: ...

    def aiter_raw(self) -> AsyncIterator[bytes]: ...

class UpstreamBody:
    """The decoded body of an open httpx response, in pieces of at most `PIECE_BYTES`.

    Transport failures are mapped as `transport_errors` maps them; a body that cannot
    be decoded, or has an encoding relay did not ask for, is ``bad_upstream_response``.
    ``read`` counts the decoded bytes handed out so far.
    """

    def __init__(self, resp: Body, provider: str, what: str = "answer") -> None:
        self.provider = provider
        self.what = what
        self.read = 0
        self._raw: AsyncIterator[bytes] = resp.aiter_raw()
        self._ended = False
        codings = [c.strip().lower() for c in resp.headers.get("content-encoding", "")
                   .split(",") if c.strip() and c.strip().lower() != "identity"]
        if len(codings) > 1 or (codings and codings[0] not in ("gzip", "x-gzip",
                                                                "deflate")):
            raise RelayError("bad_upstream_response", f"provider {provider!r} sent its "
                             f"{what} with content-encoding {', '.join(codings)!r}; relay "
                             "asks for gzip or deflate only", provider=provider)
        self._inflate = Inflate(codings[0]) if codings else None

    async def piece(self, most: int = PIECE_BYTES) -> bytes | None:
        """The next decoded bytes (at most ``most``), or None at the end of the body."""
        while True:
            if self._inflate is not None:
                out = self._take(most)
                if out:
                    self.read += len(out)
                    return out
            if self._ended:
                return None
            try:  # (per piece: no context manager to enter on the way that succeeds)
                chunk = await anext(self._raw, None)
            except Exception:  # (trio.Cancelled is not one: a stop passes through)
                with transport_errors(self.provider, self.what):
                    raise
            if chunk is None:
                self._ended = True
                continue  # whatever zlib still holds comes out first
            if self._inflate is None:
                self.read += len(chunk)
                return chunk
            self._inflate.feed(chunk)

    def _take(self, most: int) -> bytes:
        assert self._inflate is not None
        try:
            return self._inflate.take(most)
        except zlib.error as exc:
            raise RelayError("bad_upstream_response", f"provider {self.provider!r} sent a "
                             f"{self._inflate.encoding} {self.what} relay cannot decode "
                             f"({exc})", provider=self.provider) from exc

    async def drain(self) -> None:
        """Read the rest of the body without decoding it (so the pooled connection can be
        reused); the caller bounds it in time."""
        with transport_errors(self.provider, self.what):
            async for _ in self._raw:
                pass
        self._ended = True


async def read_answer(resp: Body, provider: str, limit: int,
                      what: str = "answer") -> str:
    """The whole body as text, read through `UpstreamBody`.

    Raises:
        RelayError: ``bad_upstream_response`` naming ``max_upstream_bytes`` when the
            body, decompressed, is larger than ``limit`` (reading stops there); the
            mapped transport failure.
    """
    body = UpstreamBody(resp, provider, what)
    # Pieces in a list, joined once at the end: a growing bytearray may be copied on
    # realloc, and then two copies of the body exist at once.
    pieces: list[bytes] = []
    size = 0
    while (piece := await body.piece(min(PIECE_BYTES, limit + 1 - size))) is not None:
        pieces.append(piece)
        size += len(piece)
        if size > limit:
            raise RelayError(
                "bad_upstream_response",
                f"provider {provider!r} sent a {what} larger than max_upstream_bytes "
                f"({limit} bytes, counted after decompression); relay stopped reading it "
                f"there. Raise [server] max_upstream_bytes if answers this large are "
                "expected.", provider=provider)
    data = b"".join(pieces)
    pieces.clear()
    return data.decode("utf-8", "replace")


async def read_error_text(resp: Body, provider: str, limit: int) -> str:
    """An error body as text: whole up to ``limit`` decoded bytes; beyond, its head and
    ``… [≥ N bytes]`` (N: the bytes read), and the rest is never read.

    A body that breaks off or cannot be decoded keeps what was read (the status already
    says what went wrong), so this never raises a relay error of its own.
    """
    data = bytearray()
    try:
        body = UpstreamBody(resp, provider, "error answer")
        while (piece := await body.piece(min(PIECE_BYTES, limit + 1 - len(data)))) is not None:
            data += piece
            if len(data) > limit:
                head = bytes(data[:limit]).decode("utf-8", "ignore")
                return head + cut_marker(len(data), at_bound=True)
    except RelayError:
        pass
    return data.decode("utf-8", "replace")
