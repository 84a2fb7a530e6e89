"""A subscription of relay's Redis client (`relay.redis.resp.Client.subscribe`): its
messages, and the pings of its health check (`relay.shared.coordinator`)."""

from __future__ import annotations

import trio

from .wire import ConnectionLost, Reader, RespError, encode

__all__ = ["Subscription"]

_TRANSPORT = (OSError, trio.BrokenResourceError, trio.ClosedResourceError)


class Subscription:
    """One subscribed connection: its messages read by `message` in one task; `ping`
    may be sent from another (a pong is counted by `message` as it reads it)."""

    def __init__(self, reader: Reader, address: tuple[str, int] | None) -> None:
        self._reader = reader
        self.address = address  # where it went (a Sentinel's answer), or None
        self.pongs = 0
        self._pong = trio.Event()

    async def message(self) -> str:
        """The next message's data (`ConnectionLost`: the connection ended)."""
        while True:
            try:
                item = await self._reader.reply()
            except _TRANSPORT as exc:
                raise ConnectionLost(f"reading the subscription: {exc}") from exc
            if isinstance(item, list) and len(item) == 3 and item[0] == "message":
                return str(item[2])
            # A pong; or an error reply, which only a PING gets here (a user refused
            # it): the server answered, so the connection is alive all the same.
            if ((isinstance(item, list) and item and item[0] == "pong")
                    or isinstance(item, RespError)):
                self.pongs += 1
                self._pong.set()
                self._pong = trio.Event()

    async def ping(self) -> None:
        """Send a PING on the subscription (`ConnectionLost`: it could not be sent)."""
        try:
            await self._reader.stream.send_all(encode(("PING",)))
        except _TRANSPORT as exc:
            raise ConnectionLost(f"pinging the subscription: {exc}") from exc

    async def pong(self, after: int) -> None:
        """Until more than ``after`` pongs have been read."""
        while self.pongs <= after:
            await self._pong.wait()
