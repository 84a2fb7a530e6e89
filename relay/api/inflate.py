"""Bounded decompression of an upstream body (`relay.api.body.UpstreamBody` uses it)."""

from __future__ import annotations

import zlib
from typing import Any

__all__ = ["Inflate"]


class Inflate:
    """zlib decompression with bounded output: ``take(n)`` gives at most ``n`` bytes."""

    def __init__(self, encoding: str) -> None:
        self.encoding = encoding
        self._gzip = encoding in ("gzip", "x-gzip")
        self._d: Any = zlib.decompressobj(zlib.MAX_WBITS | 16) if self._gzip else None
        self._input = b""
        self._more = False  # the last take was full: zlib may hold more output

    def feed(self, data: bytes) -> None:
        self._input += data

    def take(self, n: int) -> bytes:
        if self._d is None:  # deflate: zlib-wrapped (RFC 1950) or, as some servers send, raw
            if len(self._input) < 2:
                return b""
            cmf, flg = self._input[0], self._input[1]
            wrapped = cmf & 0x0F == 8 and (cmf * 256 + flg) % 31 == 0
            self._d = zlib.decompressobj(zlib.MAX_WBITS if wrapped else -zlib.MAX_WBITS)
        if not self._input and not self._more:
            return b""
        out: bytes = self._d.decompress(self._input, n)
        self._input = self._d.unconsumed_tail
        self._more = len(out) == n
        if self._d.eof:
            rest = self._d.unused_data
            self._more = False
            self._input = b""
            if self._gzip and rest.startswith(b"\x1f\x8b"):  # another gzip member follows
                self._d = zlib.decompressobj(zlib.MAX_WBITS | 16)
                self._input = rest
        return out
