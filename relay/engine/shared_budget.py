"""Token budgets on the coordination server (SPEC L12 on a shared provider, L11).

A provider with ``shared = true`` keeps its token budgets and its hold where its lanes
are kept: on the coordination server, in one hash per lane moved only by the Lua scripts
below, on the server's clock (``TIME``), never a relay's. What any relay takes, settles
and learns from a provider's headers (or its 429s, or a usage-window notice) moves the
same buckets, so the relays sharing one key stay inside its limits together.

The buckets are `relay.engine.budget`'s: at most their limit (the lower of the configured
figure a relay sends and the last header), refilled continuously; a header's
``remaining`` only ever lowers a level; a hold stops every start on every relay but a
connection check's, and an answer begun after the hold began ends it.

`SharedBudget.take` runs once the request holds its shared slot (`SharedLane.slot`): the
slot is counted across relays first, then the tokens, so on a shared provider a holder
may wait for tokens while it holds its slot (the provider's budget is every relay's: no
other request could start in its place without overdrawing it). It asks again when the
server says the need may fit, and at least every `SharedBudget.POLL_S` (another relay's
settlement may free tokens sooner).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import trio

from relay.vocab.errors import RelayError
from relay.vocab.limits import RateLimits

from .budget import Need, too_large

if TYPE_CHECKING:
    from .shared_lane import SharedLane

__all__ = ["SCRIPTS", "TOKENS_SEEN", "TOKENS_SETTLE", "TOKENS_TAKE", "SharedBudget"]


# One hash per lane, ``KEYS[1]`` = ``{prefix:lane}:b``: for each budget (``requests``,
# ``tokens``, ``input``, ``output``) its header limit (``<kind>:hdr``), level
# (``<kind>:lvl``) and the server time it was last refilled (``<kind>:at``, ms); the hold
# (``hold`` until, ms; ``hold_cause``, ``hold_reason``, ``hold_since``). The buckets are
# the local `Budget`'s, on the server's clock: at most the limit (the lower of the
# configured figure a relay sends and the last header), refilled at limit / 60,000 a ms.
# The hash expires an hour after its last use.

_BUDGET_PRELUDE = r"""
local B = KEYS[1]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local KINDS = {'requests', 'tokens', 'input', 'output'}

local function limit_of(kind, cfg)
  local hdr = tonumber(redis.call('HGET', B, kind .. ':hdr') or '0')
  cfg = tonumber(cfg or '0')
  if cfg > 0 and hdr > 0 then return math.min(cfg, hdr) end
  if cfg > 0 then return cfg end
  return hdr
end

local function level_of(kind, limit)
  local lvl = tonumber(redis.call('HGET', B, kind .. ':lvl') or 'nan')
  local at = tonumber(redis.call('HGET', B, kind .. ':at') or '0')
  if lvl == nil or lvl ~= lvl then return limit end
  return math.min(limit, lvl + (now - at) * limit / 60000)
end

local function store(kind, lvl)
  redis.call('HSET', B, kind .. ':lvl', tostring(lvl), kind .. ':at', tostring(now))
end
"""

# ARGV: need_in, need_out, configured tpm, itpm, otpm, probe (1: a connection check).
# Reply: {0} started (the need is taken); {wait_ms, 'hold', cause, reason} held;
# {wait_ms, '<kind> <free> <want>'} not yet; {-1, kind, cost, limit} too large for a
# whole minute.
TOKENS_TAKE = _BUDGET_PRELUDE + r"""
local need_in, need_out = tonumber(ARGV[1]), tonumber(ARGV[2])
local cfg = {requests = '0', tokens = ARGV[3], input = ARGV[4], output = ARGV[5]}
local cost = {requests = 1, tokens = need_in + need_out, input = need_in, output = need_out}
local wait, what = 0, ''
local hold = tonumber(redis.call('HGET', B, 'hold') or '0')
if ARGV[6] ~= '1' and hold > now then
  local said = redis.call('HMGET', B, 'hold_cause', 'hold_reason')
  return {hold - now, 'hold', said[1] or '', said[2] or 'rate_limited'}
end
local levels = {}
for _, kind in ipairs(KINDS) do
  local limit = limit_of(kind, cfg[kind])
  if limit > 0 then
    if kind ~= 'requests' and cost[kind] > limit then
      return {-1, kind, cost[kind], tostring(limit)}
    end
    local lvl = level_of(kind, limit)
    levels[kind] = lvl
    local want = math.min(cost[kind], limit)
    if lvl < want - 1e-6 then
      local w = math.ceil((want - lvl) * 60000 / limit)
      if w > wait then wait, what = w, kind .. ' ' .. math.floor(lvl) .. ' ' .. want end
    end
  end
end
redis.call('PEXPIRE', B, 3600000)
if wait > 0 then return {wait, what} end
for kind, lvl in pairs(levels) do store(kind, lvl - cost[kind]) end
return {0}
"""

# ARGV: reserved in, reserved out, used in, used out, configured tpm, itpm, otpm.
TOKENS_SETTLE = _BUDGET_PRELUDE + r"""
local r_in, r_out, u_in, u_out = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]),
                                 tonumber(ARGV[4])
local cfg = {tokens = ARGV[5], input = ARGV[6], output = ARGV[7]}
local back = {tokens = r_in + r_out - u_in - u_out, input = r_in - u_in, output = r_out - u_out}
for kind, b in pairs(back) do
  local limit = limit_of(kind, cfg[kind])
  if limit > 0 then store(kind, math.min(limit, level_of(kind, limit) + b)) end
end
return {0}
"""

# ARGV: configured tpm, itpm, otpm; hold_ms (0: none), cause, reason, ok (1: an answer
# began after any hold: it has lifted), began (ms ago it began), then (kind, limit,
# remaining) triples ('' for a figure not said). A header's remaining only ever lowers a
# level (a header may be late).
TOKENS_SEEN = _BUDGET_PRELUDE + r"""
local cfg = {requests = '0', tokens = ARGV[1], input = ARGV[2], output = ARGV[3]}
local hold_ms, cause, reason, ok = tonumber(ARGV[4]), ARGV[5], ARGV[6], ARGV[7]
local began = now - tonumber(ARGV[8])
local i = 9
while ARGV[i] do
  local kind, limit, remaining = ARGV[i], tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2])
  if limit and limit > 0 then
    local old = limit_of(kind, cfg[kind])
    local lvl = old > 0 and level_of(kind, old) or limit
    redis.call('HSET', B, kind .. ':hdr', tostring(limit))
    local new = limit_of(kind, cfg[kind])
    store(kind, math.min(new, lvl))
  end
  local now_limit = limit_of(kind, cfg[kind])
  if remaining and now_limit > 0 then
    local lvl = level_of(kind, now_limit)
    if remaining < lvl then store(kind, remaining) end
  end
  i = i + 3
end
local hold = tonumber(redis.call('HGET', B, 'hold') or '0')
if hold_ms > 0 and now + hold_ms > hold then
  redis.call('HSET', B, 'hold', tostring(now + hold_ms), 'hold_cause', cause,
             'hold_reason', reason, 'hold_since', tostring(now))
elseif ok == '1' and hold > now then
  local since = tonumber(redis.call('HGET', B, 'hold_since') or '0')
  if began >= since then redis.call('HSET', B, 'hold', '0') end
end
redis.call('PEXPIRE', B, 3600000)
return {0}
"""

SCRIPTS = {"TOKENS_TAKE": TOKENS_TAKE, "TOKENS_SETTLE": TOKENS_SETTLE,
           "TOKENS_SEEN": TOKENS_SEEN}



class SharedBudget:
    """One shared provider's token budgets and hold (see the module docstring)."""

    POLL_S = 1.0

    def __init__(self, lane: SharedLane) -> None:
        self.lane = lane
        coord = lane._coord
        self._keys = ["{" + f"{coord.prefix}:{lane.name}" + "}:b"]
        # (its three scripts, `SCRIPTS`, are the coordinator's to run, beside its own)

    def _configured(self) -> list[str]:
        p = self.lane._local
        return [repr(float(p.tpm)), repr(float(p.itpm)), repr(float(p.otpm))]

    async def _call(self, script: str, *args: Any) -> list[Any]:
        reply: list[Any] = await self.lane._coord.call(script, self._keys, list(args),
                                                       provider=self.lane.name)
        return reply

    async def take(self, need: Need, *, deadline: float, leave_if_held: bool,
                   probe: bool) -> tuple[float, str | None]:
        """Wait until ``need`` fits the shared budgets, and take it. Returns how long it
        waited and the hold that delayed it (None: none did).

        Raises:
            RelayError: ``request_too_large``; the hold's reason (a fallback to go to, or
                the hold outlasts the queue timeout); ``provider_queue_timeout``;
                ``coordination_unavailable``.
        """
        began = trio.current_time()
        held_by: str | None = None
        name = self.lane.name
        while True:
            reply = await self._call("TOKENS_TAKE", need.input, need.output,
                                     *self._configured(), 1 if probe else 0)
            code = int(reply[0])
            if code == 0:
                return trio.current_time() - began, held_by
            if code < 0:
                raise too_large(name, need, str(reply[1]), int(reply[2]), float(reply[3]))
            now, wait = trio.current_time(), code / 1000
            if reply[1] == "hold":
                held_by = str(reply[2]) or "the provider said wait"
                if leave_if_held or now + wait > deadline:
                    why = ("it has a fallback to go to" if leave_if_held else
                           "past this request's queue timeout")
                    raise RelayError(
                        str(reply[3]) or "rate_limited",
                        f"provider {name!r} holds every start for about {math.ceil(wait)} "
                        f"s more ({held_by}); {why}. This request was not sent.",
                        provider=name, retry_after_s=max(1.0, wait))
            if now >= deadline:
                raise RelayError(
                    "provider_queue_timeout", f"waited {now - began:.0f} s for provider "
                    f"{name!r}'s shared token budget ({reply[1]}): this request was not "
                    f"sent. Retry in about {math.ceil(wait)} s.", provider=name,
                    retry_after_s=max(1.0, wait))
            await trio.sleep(min(wait, self.POLL_S, max(0.0, deadline - now)))

    async def settle(self, need: Need, used_in: int, used_out: int) -> None:
        await self._call("TOKENS_SETTLE", need.input, need.output, used_in, used_out,
                         *self._configured())

    async def seen(self, limits: RateLimits | None, *, ok: bool = False,
                   began_s_ago: float = 0.0, reason: str = "rate_limited") -> None:
        """An answer's rate-limit headers and hold, for every relay sharing the
        provider."""
        if limits is None and not ok:
            return
        triples: list[Any] = []
        for kind, window in (limits.windows.items() if limits is not None else ()):
            triples += [kind, "" if window.limit is None else repr(float(window.limit)),
                        "" if window.remaining is None else repr(float(window.remaining))]
        hold_ms = int((limits.hold_s or 0) * 1000) if limits is not None else 0
        await self._call("TOKENS_SEEN", *self._configured(), hold_ms,
                         limits.cause if limits is not None else "", reason,
                         1 if ok else 0, int(began_s_ago * 1000), *triples)
