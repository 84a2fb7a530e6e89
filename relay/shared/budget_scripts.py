"""The Lua scripts of a shared provider's token budgets (SPEC L12 with L11); see
`relay.shared.budget` for how relays use them.

Keys of one lane (``KEYS``, all in the lane's ``{prefix:provider}`` cluster slot)::

    B   hash  for each budget (``requests``, ``tokens``, ``input``, ``output``) its
              header limit (``<kind>:hdr``), level (``<kind>:lvl``) and the server time
              it was last refilled (``<kind>:at``, ms); the hold (``hold`` until, ms;
              ``hold_cause``, ``hold_reason``, ``hold_since``); ``seq``, the token
              waiters' arrival counter
    T   zset  token waiter member -> rank * 2^40 + arrival (priority class, then FIFO)
    TX  zset  token waiter member -> when its place ends (ms) unless it asks again

The rules these scripts keep are `relay.capacity.budget`'s, on the server's clock
(``TIME``, in ms): the table in its theory of operation is their one description, names
the script that keeps each, and marks where these scripts differ from the local budget
today. What is theirs alone is the token queue: only the head of ``T`` takes tokens (SPEC
L9: no barging past the head, whichever relay it is on); when it has taken them, leaves,
or a settlement gives tokens back, the (new) head's relay is told at once (``g <member>``
on its wake-up channel, as a slot's grant is). A connection check (a probe) passes the
queue, as it passes a hold. The keys expire an hour after their last use.
"""

from __future__ import annotations

__all__ = ["SCRIPTS", "TOKENS_LEAVE", "TOKENS_PEEK", "TOKENS_SEEN", "TOKENS_SETTLE",
           "TOKENS_TAKE"]

_BUDGET_PRELUDE = r"""
local B, T, TX, F = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
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

-- Token waiters whose relay stopped asking (it died, or lost the server) leave; a
-- request in flight (F: member -> its start; f:<member>: its input) is forgotten an hour
-- after its start if its settlement never came.
local function prune()
  for _, w in ipairs(redis.call('ZRANGEBYSCORE', TX, '-inf', now)) do
    redis.call('ZREM', T, w)
    redis.call('ZREM', TX, w)
  end
  for _, m in ipairs(redis.call('ZRANGEBYSCORE', F, '-inf', now - 3600000)) do
    redis.call('ZREM', F, m)
    redis.call('HDEL', B, 'f:' .. m)
  end
end

-- Tell the head of the token queue's relay to ask again now (CHAN: the channel prefix).
local function wake(chan)
  local head = redis.call('ZRANGE', T, 0, 0)[1]
  if head and chan ~= '' then
    redis.call('PUBLISH', chan .. string.match(head, '^(.*)|'), 'g ' .. head)
  end
end

-- The first start after a hold goes alone for at most this long (its relay may die).
local FIRST_MS = 30000

-- Its answer is back (or it ended): the rest may start; the head is told.
local function first_done(chan)
  if (redis.call('HGET', B, 'first') or '') ~= '' then
    redis.call('HSET', B, 'first', '')
    wake(chan)
  end
end

-- Every reply goes through this: the keys expire an hour after their last use.
local function done(reply)
  for _, k in ipairs({B, T, TX, F}) do redis.call('PEXPIRE', k, 3600000) end
  return reply
end
"""

# ARGV: need_in, need_out, configured tpm, itpm, otpm, probe (1: a connection check),
# member, rank, place_ms (how long its place lasts unless it asks again), the channel
# prefix. Reply: {0, kind...} started (the need is taken from those budgets); {wait_ms,
# 'hold', cause, reason} held; {wait_ms, 'first'} behind the first start after a hold;
# {wait_ms, 'queue', ahead} behind ``ahead`` earlier waiters; {wait_ms, '<kind> <free>
# <want>'} the head, not yet; {-1, kind, cost, limit} too large for a whole minute. A
# reply other than "not yet" or "behind" has taken the member out of the queue.
TOKENS_TAKE = _BUDGET_PRELUDE + r"""
local need_in, need_out = tonumber(ARGV[1]), tonumber(ARGV[2])
local cfg = {requests = '0', tokens = ARGV[3], input = ARGV[4], output = ARGV[5]}
local probe, member, rank = ARGV[6] == '1', ARGV[7], tonumber(ARGV[8])
local place_ms, chan = tonumber(ARGV[9]), ARGV[10]
local cost = {requests = 1, tokens = need_in + need_out, input = need_in, output = need_out}
prune()
local function out()  -- the member leaves the queue (the next head may go at once)
  if probe then return end
  local was_head = redis.call('ZRANGE', T, 0, 0)[1] == member
  redis.call('ZREM', T, member)
  redis.call('ZREM', TX, member)
  if was_head then wake(chan) end
end
if not probe then
  if not redis.call('ZSCORE', T, member) then
    local seq = redis.call('HINCRBY', B, 'seq', 1)
    redis.call('ZADD', T, rank * 1099511627776 + seq, member)
  end
  redis.call('ZADD', TX, now + place_ms, member)
  local hold = tonumber(redis.call('HGET', B, 'hold') or '0')
  if hold > now then
    local said = redis.call('HMGET', B, 'hold_cause', 'hold_reason')
    return done({hold - now, 'hold', said[1] or '', said[2] or 'rate_limited'})
  end
  if redis.call('ZRANGE', T, 0, 0)[1] ~= member then
    local score = redis.call('ZSCORE', T, member)
    local ahead = #redis.call('ZRANGEBYSCORE', T, '-inf', '(' .. score)
    return done({place_ms, 'queue', ahead})
  end
  -- After a hold the first start goes alone: the rest wait until its answer is back
  -- (then a provider that said nothing more meets one 429 a window, not one a relay).
  local first = redis.call('HMGET', B, 'first', 'first_until')
  if first[1] and first[1] ~= '' and tonumber(first[2] or '0') > now then
    return done({math.min(place_ms, tonumber(first[2]) - now), 'first'})
  end
end
local wait, what = 0, ''
local levels = {}
for _, kind in ipairs(KINDS) do
  local limit = limit_of(kind, cfg[kind])
  if limit > 0 then
    if kind ~= 'requests' and cost[kind] > limit then
      out()
      return done({-1, kind, cost[kind], tostring(limit)})
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
if wait > 0 then return done({wait, what}) end
local took = {0}
for kind, lvl in pairs(levels) do
  store(kind, lvl - cost[kind])
  table.insert(took, kind)
end
redis.call('ZADD', F, now, member)
redis.call('HSET', B, 'f:' .. member, tostring(need_in))
if not probe and redis.call('HGET', B, 'first_due') == '1' then
  redis.call('HSET', B, 'first', member, 'first_until', tostring(now + FIRST_MS),
             'first_due', '0')
end
out()
return done(took)
"""

# A token waiter leaves (its queue timeout, a hold it does not wait out, its client
# gone). ARGV: member, the channel prefix.
TOKENS_LEAVE = _BUDGET_PRELUDE + r"""
local was_head = redis.call('ZRANGE', T, 0, 0)[1] == ARGV[1]
redis.call('ZREM', T, ARGV[1])
redis.call('ZREM', TX, ARGV[1])
prune()
if was_head then wake(ARGV[2]) end
return done({0})
"""

# ARGV: reserved in, reserved out, used in, used out, configured tpm, itpm, otpm, the
# channel prefix, member, then the budgets it was taken from (TOKENS_TAKE's reply). The
# settlement and the first start after a hold: the table's rows; the head may fit now.
TOKENS_SETTLE = _BUDGET_PRELUDE + r"""
local r_in, r_out, u_in, u_out = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]),
                                 tonumber(ARGV[4])
local cfg = {tokens = ARGV[5], input = ARGV[6], output = ARGV[7]}
local back = {tokens = r_in + r_out - u_in - u_out, input = r_in - u_in, output = r_out - u_out}
local took = {}
for j = 10, #ARGV do took[ARGV[j]] = true end
local gave = false
for kind, b in pairs(back) do
  local limit = limit_of(kind, cfg[kind])
  if limit > 0 and took[kind] then
    store(kind, math.min(limit, level_of(kind, limit) + b))
    gave = gave or b > 0
  end
end
-- What was used, for the status's "used in the last minute" of every relay together: a
-- ring of 60 one-second counters (u<slot>, stamped with their second in us<slot>).
local sec = math.floor(now / 1000)
local slot = tostring(sec % 60)
if redis.call('HGET', B, 'us' .. slot) ~= tostring(sec) then
  redis.call('HSET', B, 'u' .. slot, '0', 'us' .. slot, tostring(sec))
end
redis.call('HINCRBY', B, 'u' .. slot, u_in + u_out)
if ARGV[9] ~= '' then
  redis.call('ZREM', F, ARGV[9])
  redis.call('HDEL', B, 'f:' .. ARGV[9])
end
prune()
if ARGV[9] ~= '' and redis.call('HGET', B, 'first') == ARGV[9] then
  first_done(ARGV[8])
elseif gave then
  wake(ARGV[8])
end
return done({0})
"""

# ARGV: configured tpm, itpm, otpm; hold_ms (0: none), cause, reason, ok (1: an answer
# came back; one begun after any hold: it has lifted), began (ms ago it began), the
# channel prefix, its member ('' : not known), then (kind, limit, remaining) triples (''
# for a figure not said). What a header's limit and remaining, a hold and an answer do:
# the table's rows (`relay.capacity.budget`).
TOKENS_SEEN = _BUDGET_PRELUDE + r"""
local cfg = {requests = '0', tokens = ARGV[1], input = ARGV[2], output = ARGV[3]}
local hold_ms, cause, reason, ok = tonumber(ARGV[4]), ARGV[5], ARGV[6], ARGV[7]
local began, own = now - tonumber(ARGV[8]), ARGV[10]
-- What requests started at or after the answering one (its own aside) take of a budget:
-- they may not be in the provider's count yet (a burst's first answers come back while
-- the relays are still starting the rest).
local late_n, late_in  -- (read once, when a header first lowers a budget)
local function late(kind)
  if not late_n then
    late_n, late_in = 0, 0
    for _, m in ipairs(redis.call('ZRANGEBYSCORE', F, began, '+inf')) do
      if m ~= own then
        late_n = late_n + 1
        late_in = late_in + tonumber(redis.call('HGET', B, 'f:' .. m) or '0')
      end
    end
  end
  if kind == 'requests' then return late_n end
  return (kind == 'input' or kind == 'tokens') and late_in or 0
end
local i = 11
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
    if remaining < lvl then store(kind, remaining - late(kind)) end
  end
  i = i + 3
end
local hold = tonumber(redis.call('HGET', B, 'hold') or '0')
if hold_ms > 0 then
  if now + hold_ms > hold then
    redis.call('HSET', B, 'hold', tostring(now + hold_ms), 'hold_cause', cause,
               'hold_reason', reason, 'hold_since', tostring(now))
  end
  redis.call('HSET', B, 'first', '', 'first_due', '1')  -- after it, one start alone
elseif ok == '1' then
  if hold > now then
    local since = tonumber(redis.call('HGET', B, 'hold_since') or '0')
    if began >= since then redis.call('HSET', B, 'hold', '0') end
  end
  first_done(ARGV[9])
end
return done({0})
"""

# What the budgets are now, for the status (read at each renewal; nothing changes).
# ARGV: configured tpm, itpm, otpm. Reply: {hold_left_ms, hold_cause, waiters, tokens used
# in the last minute by every relay, then (kind, limit, level, header limit) for each
# budget with a limit}, numbers as strings.
TOKENS_PEEK = _BUDGET_PRELUDE + r"""
local cfg = {requests = '0', tokens = ARGV[1], input = ARGV[2], output = ARGV[3]}
local hold = tonumber(redis.call('HGET', B, 'hold') or '0')
local used, sec, fields = 0, math.floor(now / 1000), {}
for slot = 0, 59 do
  table.insert(fields, 'u' .. slot)
  table.insert(fields, 'us' .. slot)
end
local ring = redis.call('HMGET', B, unpack(fields))
for j = 1, 120, 2 do
  local stamp = tonumber(ring[j + 1] or '')
  if stamp and stamp > sec - 60 then used = used + tonumber(ring[j] or '0') end
end
local out = {tostring(math.max(0, hold - now)), redis.call('HGET', B, 'hold_cause') or '',
             tostring(redis.call('ZCARD', T)), tostring(used)}
for _, kind in ipairs(KINDS) do
  local limit = limit_of(kind, cfg[kind])
  if limit > 0 then
    table.insert(out, kind)
    table.insert(out, tostring(limit))
    table.insert(out, tostring(level_of(kind, limit)))
    table.insert(out, redis.call('HGET', B, kind .. ':hdr') or '0')
  end
end
return out
"""

SCRIPTS = {"TOKENS_TAKE": TOKENS_TAKE, "TOKENS_LEAVE": TOKENS_LEAVE,
           "TOKENS_SETTLE": TOKENS_SETTLE, "TOKENS_SEEN": TOKENS_SEEN,
           "TOKENS_PEEK": TOKENS_PEEK}
