"""Sentinel, for relay's Redis client (`relay.redis.resp`): where the primary is, as the
Sentinels say (``SENTINEL get-master-addr-by-name``), and the primary's own word
(``ROLE``) on it. No message here quotes a URL or a password."""

from __future__ import annotations

from typing import Any

import trio

from relay.config.coordination_url import CoordinationTarget

from .wire import ConnectionLost, Reader, RespError, encode

__all__ = ["ask", "check_role"]

_TRANSPORT = (OSError, trio.BrokenResourceError, trio.ClosedResourceError)


async def ask(target: CoordinationTarget, timeout_s: float,
              preferred: tuple[str, int] | None) -> tuple[tuple[str, int], tuple[str, int]]:
    """The primary's address, as the first Sentinel that knows it says (asked anew for
    every connection: after a failover they name the promoted replica), and that
    Sentinel (asked first next time: ``preferred``). Each is given its share of
    ``timeout_s``.

    Raises:
        ConnectionLost: no Sentinel names the primary.
    """
    assert target.master_name is not None
    problems = []
    for host, port in sorted(target.sentinels, key=lambda s: s != preferred):
        try:
            with trio.fail_after(timeout_s / len(target.sentinels)):
                stream = await trio.open_tcp_stream(host, port)
                async with stream:
                    commands: list[tuple[str, ...]] = (
                        [("AUTH", target.sentinel_password)] if target.sentinel_password
                        else [])
                    commands.append(("SENTINEL", "get-master-addr-by-name",
                                     target.master_name))
                    await stream.send_all(b"".join(encode(c) for c in commands))
                    reader = Reader(stream)
                    replies = [await reader.reply() for _ in commands]
        except (trio.TooSlowError, ConnectionLost, *_TRANSPORT) as exc:
            problems.append(f"{host}:{port}: {type(exc).__name__}")
            continue
        reply = replies[-1]
        if isinstance(reply, list) and len(reply) == 2 and str(reply[1]).isdigit():
            return (str(reply[0]), int(reply[1])), (host, port)
        refused = next((r for r in replies if isinstance(r, RespError)), None)
        problems.append(f"{host}:{port}: {refused.code}" if refused is not None
                        else f"{host}:{port}: does not know it")
    raise ConnectionLost(f"no Sentinel names the primary {target.master_name!r} "
                         f"({'; '.join(problems)})")


def check_role(reply: Any) -> None:
    """The server the Sentinels named must say it is the primary (`ROLE`); a user not
    allowed ROLE is taken at the Sentinels' word (a wrong one answers READONLY)."""
    if isinstance(reply, RespError):
        if reply.code == "NOPERM":
            return
        raise reply
    if not (isinstance(reply, list) and reply and reply[0] == "master"):
        role = reply[0] if isinstance(reply, list) and reply else reply
        raise ConnectionLost(f"the server the Sentinels named is not the primary (its "
                             f"role: {role}); a failover under way?")
