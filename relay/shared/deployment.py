"""What the shared lanes need of their coordination server (SPEC O6), said and checked:
the least-privilege ACL line, the eviction policy, and a probe `relay config check` runs.

The rights (Redis 7 / Valkey ACL), for a prefix ``P`` (``coordination_prefix``): the
keys ``~{P:*`` (each lane's keys are ``{P:provider}:…``, the braces keep them in one
cluster slot), the wake-up channels ``&P:wake:*``, and the commands the client sends
(``EVALSHA``, ``EVAL``, ``SUBSCRIBE``, ``PING``) and its scripts run. ``INFO`` (the
server's identity and uptime: a restart or a failover seen from the server's side),
``CONFIG GET`` (the eviction policy), ``ROLE`` (a Sentinel's answer checked) and
``CLIENT SETNAME`` are used when allowed and not needed; ``SELECT`` only for a DB other
than 0.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import trio

from relay.redis import resp

__all__ = ["acl_line", "check_server", "eviction_policy", "eviction_warning",
           "warn_about_eviction"]

logger = logging.getLogger(__name__)

NEEDED = ("evalsha", "eval", "subscribe", "ping",
          # what the scripts run (relay.shared.lane_scripts)
          "time", "hget", "hmget", "hset", "hdel", "hincrby", "zadd", "zrem", "zscore",
          "zcard", "zrange", "zrangebyscore", "pttl", "pexpire", "publish", "set")
OPTIONAL = ("info", "config|get", "role", "client|setname", "select")


def acl_line(prefix: str = "relay", user: str = "relay") -> str:
    """The ``ACL SETUSER`` line relay needs, for ``coordination_prefix = prefix``."""
    return (f"ACL SETUSER {user} on >PASSWORD resetkeys ~{{{prefix}:* resetchannels "
            f"&{prefix}:wake:* -@all " + " ".join(f"+{c}" for c in NEEDED + OPTIONAL))


EVICTION_FIX = ("set maxmemory-policy noeviction (CONFIG SET maxmemory-policy noeviction, "
                "or the managed service's parameter), or give the shared lanes a server of "
                "their own")


def eviction_warning(policy: str) -> str | None:
    """What to say about ``policy``, or None (``noeviction``: lane keys are never evicted)."""
    if policy == "noeviction":
        return None
    return (f"the coordination server's maxmemory-policy is {policy}: under memory pressure "
            f"it may evict the shared lanes' keys (every one has a TTL), and a lane whose "
            f"holders were evicted lets more than its lanes run; {EVICTION_FIX}")


async def eviction_policy(client: resp.Client) -> str | None:
    """``CONFIG GET maxmemory-policy``, or ``INFO memory`` where CONFIG is refused or
    renamed (managed services); None when neither is allowed."""
    try:
        reply = await client.execute("CONFIG", "GET", "maxmemory-policy")
        if isinstance(reply, list) and len(reply) == 2:
            return str(reply[1])
    except resp.RespError:
        pass
    try:
        info = await client.execute("INFO", "memory")
    except resp.RespError:
        return None
    found = re.search(r"maxmemory_policy:(\S+)", str(info))
    return found.group(1) if found else None


async def warn_about_eviction(client: resp.Client, timeout_s: float) -> None:
    """At start: a policy that may evict lane keys is a loud warning (SPEC O6)."""
    policy = None
    with trio.move_on_after(timeout_s):  # noqa: ASYNC912 (execute's I/O is the checkpoint)
        try:
            policy = await eviction_policy(client)
        except (resp.ConnectionLost, resp.RespError) as exc:
            logger.debug("shared lanes: the eviction policy could not be read (%s)", exc)
            return
    if policy is None:
        logger.info("shared lanes: the coordination server's maxmemory-policy could not be "
                    "read (CONFIG and INFO refused); it must be noeviction")
    elif (warning := eviction_warning(policy)) is not None:
        logger.warning("shared lanes: %s", warning)


# Each command the scripts run, on keys and a channel of the prefix, with pcall: the
# refused ones are named. The probe's keys expire within a second.
_PROBE = r"""
local h, z, c, chan = KEYS[1], KEYS[2], KEYS[3], ARGV[1]
local refused = {}
local function try(name, ...)
  local r = redis.pcall(...)
  if type(r) == 'table' and r.err and (string.find(r.err, "can't") or
      string.find(r.err, 'NOPERM') or string.find(r.err, 'no permissions')) then
    table.insert(refused, name)
  end
end
try('time', 'TIME')
try('hset', 'HSET', h, 'f', '1')
try('hget', 'HGET', h, 'f')
try('hmget', 'HMGET', h, 'f')
try('hincrby', 'HINCRBY', h, 'n', 1)
try('hdel', 'HDEL', h, 'f')
try('zadd', 'ZADD', z, 1, 'm')
try('zscore', 'ZSCORE', z, 'm')
try('zcard', 'ZCARD', z)
try('zrange', 'ZRANGE', z, 0, 0)
try('zrangebyscore', 'ZRANGEBYSCORE', z, '-inf', '+inf')
try('zrem', 'ZREM', z, 'm')
try('pttl', 'PTTL', h)
try('set', 'SET', c, '1', 'NX', 'PX', 1000)
try('publish', 'PUBLISH', chan, 'check')
try('pexpire', 'PEXPIRE', h, 1000)
redis.pcall('PEXPIRE', z, 1000)
return refused
"""


async def check_server(url: str, *, prefix: str, timeout_s: float = 3.0) -> list[str]:
    """What `relay config check` says about the coordination server: one line each,
    warnings first word ``WARNING``. Never raises for a server it cannot use."""
    lines: list[str] = []
    try:
        with trio.fail_after(timeout_s * 4):
            async with resp.open_client(url, timeout_s=timeout_s,
                                        name="relay:config-check") as client:
                await _probe(client, prefix, lines)
    except trio.TooSlowError:
        lines.append(f"WARNING coordination server: no answer within {timeout_s * 4:g} s")
    except resp.RespError as exc:
        lines.append(f"WARNING coordination server: refused the connection's set-up "
                     f"({exc.code}); check the user and password in the URL")
    except (resp.ConnectionLost, OSError) as exc:
        lines.append(f"WARNING coordination server: unreachable now ({exc}); relay serve "
                     "answers coordination_unavailable for shared providers until it is")
    return lines


async def _probe(client: resp.Client, prefix: str, lines: list[str]) -> None:
    refused: list[str] = []
    base = "{" + f"{prefix}:relay-config-check" + "}"
    try:
        answer: Any = await client.script(resp.Script(_PROBE), [f"{base}:h", f"{base}:z",
                                                                f"{base}:c"],
                                          [f"{prefix}:wake:relay-config-check"])
        refused += [str(name) for name in answer]
    except resp.RespError as exc:
        if exc.code not in ("NOPERM", "ERR"):
            raise
        refused.append("eval/evalsha")
    try:
        await client.execute("PING")   # (the subscription's health check sends it)
    except resp.RespError:
        refused.append("ping")
    try:
        async with client.subscribe(f"{prefix}:wake:relay-config-check"):
            pass
    except resp.RespError:
        refused.append("subscribe")
    if refused:
        lines.append(f"WARNING coordination server: refused {', '.join(refused)}: shared "
                     f"lanes need these rights (replace PASSWORD, keep the user's name):\n"
                     f"    {acl_line(prefix)}")
    else:
        lines.append("coordination server: reachable; every command the shared lanes use "
                     "is allowed")
    policy = await eviction_policy(client)
    if policy is None:
        lines.append("coordination server: its maxmemory-policy could not be read (CONFIG "
                     "and INFO refused); it must be noeviction")
    elif (warning := eviction_warning(policy)) is not None:
        lines.append(f"WARNING {warning}")
    else:
        lines.append("coordination server: maxmemory-policy noeviction")
