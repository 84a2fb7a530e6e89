"""The one SSE reader of the HTTP adapters (SPEC O5): lines end at CR, LF or CRLF only;
a line or an event over `MAX_SSE_BYTES` is refused before it is buffered past it."""

from __future__ import annotations

from collections.abc import Iterator

__all__ = ["MAX_SSE_BYTES", "SSEDecoder", "SSETooLarge"]

MAX_SSE_BYTES = 8 * 1024 * 1024  # the longest SSE line, and the largest event


def _text_bytes(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode())


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
