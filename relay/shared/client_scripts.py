"""The Lua scripts of a client's limits on the coordination server (SPEC L14 with L11);
see `relay.shared.client_limits` for how relays use them.

Keys of one client (``KEYS``, all in the client's ``{prefix:client:NAME}`` cluster slot)::

    MIN  zset  the client's starts of the last minute: "<member> <tokens>" -> its start
               (ms, the server's ``TIME``): ``rpm`` counts them (the pacer's rule,
               `relay.capacity.pacer`: at most n = max(1, floor(rpm)) in 60 n / rpm s),
               ``tpm`` sums their tokens (an estimate at the start, settled to the use)
    D    hash  this UTC day's spend, per relay: "u:<relay>" dollars, "t:<relay>" tokens
    MO   hash  this UTC month's spend, per relay: "u:<relay>" dollars
    R    zset  the requests admitted and not yet settled: request id -> when its
               reservation ends (ms) unless settled first (a relay that died)
    RS   hash  request id -> its reserved dollars (the estimate)
    WHO  zset  relay id -> when it last wrote its spend (ms)

Each relay writes its own spend (what its records say, `relay.engine.clients`) as a
total, never an increment: writing it again is harmless, and a server that lost its state
has it back at each relay's next request. A client's spend is the sum over the relays
that wrote it; its reservations are every relay's. The day's and month's keys are named
by the relay (UTC, its wall clock) and expire two days and 32 days after their last use.
"""

from __future__ import annotations

__all__ = ["CLIENT_ADMIT", "CLIENT_SPENT", "CLIENT_START", "CLIENT_USED"]

_TIME = r"""
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

# A start at the client's gate. KEYS: MIN. ARGV: member, tokens (its estimate), rpm, tpm.
# Reply: {"ok", 0, 0} (counted) or {"rpm" | "tpm", ms to wait, starts | tokens used}.
CLIENT_START = _TIME + r"""
local MIN = KEYS[1]
local member, tokens, rpm, tpm = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]),
                                 tonumber(ARGV[4])
for _, old in ipairs(redis.call('ZRANGEBYSCORE', MIN, '-inf', '(' .. (now - 60000))) do
  redis.call('ZREM', MIN, old)
end
local starts = redis.call('ZRANGE', MIN, 0, -1, 'WITHSCORES')
if rpm > 0 then
  local n = math.max(1, math.floor(rpm))
  local nth = redis.call('ZRANGE', MIN, -n, -n, 'WITHSCORES')
  if nth[2] then
    local due = tonumber(nth[2]) + 60000 * n / rpm
    if now < due then return {'rpm', math.ceil(due - now), #starts / 2} end
  end
end
if tpm > 0 then
  local used = 0
  for i = 1, #starts, 2 do
    used = used + tonumber(string.match(starts[i], ' (%d+)$') or '0')
  end
  if used > 0 and used + tokens > tpm then
    return {'tpm', math.max(1, math.ceil(tonumber(starts[2]) + 60000 - now)), used}
  end
end
redis.call('ZADD', MIN, now, member .. ' ' .. tokens)
redis.call('PEXPIRE', MIN, 61000)
return {'ok', 0, 0}
"""

# A start's tokens settled to what it used. KEYS: MIN. ARGV: member, estimate, used.
CLIENT_USED = r"""
local MIN = KEYS[1]
local at = redis.call('ZSCORE', MIN, ARGV[1] .. ' ' .. ARGV[2])
if at then
  redis.call('ZREM', MIN, ARGV[1] .. ' ' .. ARGV[2])
  redis.call('ZADD', MIN, at, ARGV[1] .. ' ' .. ARGV[3])
end
return 1
"""

_SPEND = _TIME + r"""
local D, MO, R, RS, WHO = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local relay = ARGV[1]
-- This relay's own spend, as a total (ARGV 2-4: dollars today, tokens today, dollars
-- this month).
redis.call('HSET', D, 'u:' .. relay, ARGV[2], 't:' .. relay, ARGV[3])
redis.call('HSET', MO, 'u:' .. relay, ARGV[4])
redis.call('ZADD', WHO, now, relay)
for _, gone in ipairs(redis.call('ZRANGEBYSCORE', WHO, '-inf', now - 32 * 86400000)) do
  redis.call('ZREM', WHO, gone)
end
for _, gone in ipairs(redis.call('ZRANGEBYSCORE', R, '-inf', now)) do
  redis.call('ZREM', R, gone)
  redis.call('HDEL', RS, gone)
end
local function keep(ttl)
  redis.call('PEXPIRE', D, 2 * 86400000)
  redis.call('PEXPIRE', MO, 32 * 86400000)
  redis.call('PEXPIRE', WHO, 32 * 86400000)
  for _, k in ipairs({R, RS}) do
    if redis.call('PTTL', k) < ttl then redis.call('PEXPIRE', k, ttl) end
  end
end
"""

# Admit a request under its client's per-day and per-month limits, across relays.
# KEYS: D, MO, R, RS, WHO. ARGV: relay, its dollars today, tokens today, dollars this
# month, the request id, its estimated dollars, how long its reservation may last (ms).
# Reply: {"ok" | "over", dollars today, tokens today, dollars this month, reserved} —
# every relay's spend, and the reservations of the requests admitted before it.
CLIENT_ADMIT = _SPEND + r"""
local id, estimate, ttl = ARGV[5], tonumber(ARGV[6]), tonumber(ARGV[7])
local usd_day, tokens_day, usd_month = 0, 0, 0
for _, who in ipairs(redis.call('ZRANGE', WHO, 0, -1)) do
  local d = redis.call('HMGET', D, 'u:' .. who, 't:' .. who)
  usd_day = usd_day + tonumber(d[1] or '0')
  tokens_day = tokens_day + tonumber(d[2] or '0')
  usd_month = usd_month + tonumber(redis.call('HGET', MO, 'u:' .. who) or '0')
end
local reserved = 0
for _, other in ipairs(redis.call('ZRANGE', R, 0, -1)) do
  if other ~= id then reserved = reserved + tonumber(redis.call('HGET', RS, other) or '0') end
end
local out = {tostring(usd_day), tostring(tokens_day), tostring(usd_month), tostring(reserved)}
-- The limits (ARGV 8-10: dollars a day, dollars a month, tokens a day; 0: none).
local lim_day, lim_month, lim_tokens = tonumber(ARGV[8]), tonumber(ARGV[9]),
                                       tonumber(ARGV[10])
if (lim_day > 0 and usd_day + reserved >= lim_day)
    or (lim_month > 0 and usd_month + reserved >= lim_month)
    or (lim_tokens > 0 and tokens_day >= lim_tokens) then
  keep(ttl)
  return {'over', unpack(out)}
end
if estimate > 0 then
  redis.call('ZADD', R, now + ttl, id)
  redis.call('HSET', RS, id, ARGV[6])
end
keep(ttl)
return {'ok', unpack(out)}
"""

# A request's record is written: this relay's spend (its total) and the request's
# reservation settled. KEYS: D, MO, R, RS, WHO. ARGV: relay, its dollars today, tokens
# today, dollars this month, the request id.
CLIENT_SPENT = _SPEND + r"""
redis.call('ZREM', R, ARGV[5])
redis.call('HDEL', RS, ARGV[5])
keep(3600000)
return 1
"""
