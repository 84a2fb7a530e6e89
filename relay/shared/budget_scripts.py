"""The Lua scripts of a shared provider's token budgets (SPEC L12 with L11); see
`relay.shared.budget` for how relays use them.

Keys of one lane (``KEYS``, all in the lane's ``{prefix:provider}`` cluster slot)::

    B   hash  for each budget (``requests``, ``tokens``, ``input``, ``output``) its
              header limit (``<kind>:hdr``), level (``<kind>:lvl``) and the server time
              it was last stored (``<kind>:at``, ms); the hold (``hold`` until, ms;
              ``hold_cause``, ``hold_reason``, ``hold_since``); ``seq``, the token
              waiters' arrival counter; ``first``/``first_due``, the first start after a
              hold; ``f:<member>`` the need ("in out") and ``c:<member>`` the budgets a
              header counted of each request in flight; ``born``, when the keys were
              made (``<kind>:new``: made anew after they were lost, see below);
              ``g0``-``g15``, ``gi``: the last 16 settled requests' grants and what
              they used ("member ms in out"), for a header that comes after its
              request's settlement and for what was granted since a header's request
              (``gev``: the latest grant of those pushed out of the ring)
    T   zset  token waiter member -> rank * 2^40 + arrival (priority class, then FIFO)
    TX  zset  token waiter member -> when its place ends (ms) unless it asks again
    F   zset  request in flight (member) -> its start, the grant (ms)
    H   zset  the lane's holders (`relay.shared.lane_scripts`): member -> its lease's end

Every script's ``ARGV`` begins with 1 when the calling relay has found the keys before:
if ``B`` is gone then (a server restart, a failover to a replica that never had them),
the keys were lost: no level is known, so the first start goes alone and the next header
sets each budget (even above what relay would have guessed).

The rules these scripts keep are `relay.capacity.budget`'s, on the server's clock
(``TIME``, in ms): the table in its theory of operation is their one description and
names the script that keeps each. What is theirs alone is the token queue: only the head
of ``T`` takes tokens (SPEC L9: no barging past the head, whichever relay it is on); when
it has taken them, leaves, or a settlement gives tokens back, the (new) head's relay is
told at once (``g <member>`` on its wake-up channel, as a slot's grant is). A connection
check (a probe) passes the queue, as it passes a hold. The keys expire a day and an hour
after their last use (a hold lasts at most a day).
"""

# layers: long because it holds the token budgets' five Lua scripts whole, each an atomic
# unit on the server that keeps rows of `relay.capacity.budget`'s one table.

from __future__ import annotations

__all__ = ["SCRIPTS", "TOKENS_LEAVE", "TOKENS_PEEK", "TOKENS_SEEN", "TOKENS_SETTLE",
           "TOKENS_TAKE"]

_BUDGET_PRELUDE = r"""
local B, T, TX, F, H = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local KINDS = {'requests', 'tokens', 'input', 'output'}
local MARGIN = 0.01  -- relay.capacity.budget.EDGE_MARGIN
local RECKON_MS = 2500  -- relay.capacity.budget.RECKON_S
-- relay.capacity.budget.OTHERS_TAU_S, OTHERS_MIN_S, OTHERS_CAP: what others on the key take
local OTHERS_TAU_S, OTHERS_MIN_S, OTHERS_CAP = 60, 5, 0.5
local DAY_MS = 86400000  -- the longest hold (relay.capacity.budget.USAGE_WINDOW_MAX_HOLD_S)
-- ARGV[1], before the script's own: 1 when this relay has found these keys before.
local known = table.remove(ARGV, 1) == '1'

-- The keys are made anew (their first use, or the server lost them: a restart, a
-- failover to a replica that never had them). Lost (a relay had known them): no level
-- is known, so the first start goes alone and its answer's header sets each level.
-- (HGET and HSET: the commands the documented ACL user may run, docs/operators.md)
if not redis.call('HGET', B, 'born') then
  redis.call('HSET', B, 'born', tostring(now))
  if known then
    for _, kind in ipairs(KINDS) do redis.call('HSET', B, kind .. ':new', '1') end
    redis.call('HSET', B, 'first', '', 'first_due', '1')
  end
end

local function limit_of(kind, cfg)
  local hdr = tonumber(redis.call('HGET', B, kind .. ':hdr') or '0')
  cfg = tonumber(cfg or '0')
  if cfg > 0 and hdr > 0 then return math.min(cfg, hdr) end
  if cfg > 0 then return cfg end
  return hdr
end

-- What others on the key take a minute (`_Bucket.others`): <kind>:os (the tokens the
-- headers said were gone beyond the relays' count, decayed) over <kind>:osp (the seconds
-- they span, decayed).
local function others_of(kind, limit)
  local f = redis.call('HMGET', B, kind .. ':os', kind .. ':osp')
  local seen, span = tonumber(f[1] or '0') or 0, tonumber(f[2] or '0') or 0
  if span <= 0 then return 0 end
  local rate = seen / math.max(span, OTHERS_MIN_S) * 60
  return math.min(math.max(rate, 0), limit * OTHERS_CAP)
end

-- What a budget refills a minute for the relays: its limit less what others take.
local function refill_of(kind, limit)
  return limit - others_of(kind, limit)
end

local function level_of(kind, limit)
  local lvl = tonumber(redis.call('HGET', B, kind .. ':lvl') or 'nan')
  local at = tonumber(redis.call('HGET', B, kind .. ':at') or '0')
  if lvl == nil or lvl ~= lvl then return limit end
  return math.min(limit, lvl + math.max(0, now - at) * refill_of(kind, limit) / 60000)
end

local function store(kind, lvl)
  redis.call('HSET', B, kind .. ':lvl', tostring(lvl), kind .. ':at', tostring(now))
end

-- Token waiters whose relay stopped asking (it died, or lost the server) leave; a
-- request in flight (F: member -> its start; f:<member>: its need "in out"; c:<member>:
-- the budgets a header set while it was in flight) is forgotten an hour after its start
-- if its settlement never came.
local function forget(m)
  redis.call('ZREM', F, m)
  redis.call('HDEL', B, 'f:' .. m, 'c:' .. m, 'h:' .. m)
end
local function prune()
  for _, w in ipairs(redis.call('ZRANGEBYSCORE', TX, '-inf', now)) do
    redis.call('ZREM', T, w)
    redis.call('ZREM', TX, w)
  end
  for _, m in ipairs(redis.call('ZRANGEBYSCORE', F, '-inf', now - 3600000)) do forget(m) end
end

-- Tell the head of the token queue's relay to ask again now (CHAN: the channel prefix).
local function wake(chan)
  local head = redis.call('ZRANGE', T, 0, 0)[1]
  if head and chan ~= '' then
    redis.call('PUBLISH', chan .. string.match(head, '^(.*)|'), 'g ' .. head)
  end
end

-- Its answer is back (or it ended): the rest may start; the head is told.
local function first_done(chan)
  if (redis.call('HGET', B, 'first') or '') ~= '' then
    redis.call('HSET', B, 'first', '')
    wake(chan)
  end
end

-- Every reply goes through this: the keys expire a day and an hour after their last use
-- (no hold outlasts them: a hold is at most a day).
local function done(reply)
  for _, k in ipairs({B, T, TX, F}) do redis.call('PEXPIRE', k, DAY_MS + 3600000) end
  return reply
end
"""

# ARGV: need_in, need_out, configured tpm, itpm, otpm, probe (1: a connection check),
# member, rank, place_ms (how long its place lasts unless it asks again), the channel
# prefix. Reply: {0, kind...} started (the need is taken from those budgets); {-1, kind,
# cost, limit} too large for a whole minute (judged first, for every request); {wait_ms,
# 'hold', cause, reason} held; {wait_ms, 'first'} behind the first start after a hold;
# {wait_ms, 'queue', ahead} behind ``ahead`` earlier waiters; {wait_ms, '<kind> <free>
# <want>'} the head, not yet. A reply other than "not yet" or "behind" has taken the
# member out of the queue.
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
local limits = {}
for _, kind in ipairs(KINDS) do
  local limit = limit_of(kind, cfg[kind])
  if limit > 0 then
    if kind ~= 'requests' and cost[kind] > limit then
      out()
      return done({-1, kind, cost[kind], tostring(limit)})
    end
    limits[kind] = limit
  end
end
local hold = tonumber(redis.call('HGET', B, 'hold') or '0')
if not probe then
  if not redis.call('ZSCORE', T, member) then
    local seq = redis.call('HINCRBY', B, 'seq', 1)
    redis.call('ZADD', T, rank * 1099511627776 + seq, member)
  end
  redis.call('ZADD', TX, now + place_ms, member)
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
  -- (then a provider that said nothing more meets one 429 a window, not one a relay),
  -- or it ends, or its relay is gone (its slot's lease in H ended).
  local first = redis.call('HGET', B, 'first') or ''
  if first ~= '' then
    if tonumber(redis.call('ZSCORE', H, first) or '0') > now then
      return done({place_ms, 'first'})
    end
    redis.call('HSET', B, 'first', '')
  end
end
local wait, what = 0, ''
local levels = {}
for kind, limit in pairs(limits) do
  local lvl = level_of(kind, limit)
  levels[kind] = lvl
  local want = math.min(cost[kind] + limit * MARGIN, limit)  -- the margin at the edge
  if lvl < want - 1e-6 then
    local w = math.ceil((want - lvl) * 60000 / refill_of(kind, limit))
    if w > wait then
      wait, what = w, kind .. ' ' .. math.floor(lvl) .. ' ' .. math.ceil(want)
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
redis.call('HSET', B, 'f:' .. member, need_in .. ' ' .. need_out)
redis.call('HDEL', B, 'c:' .. member, 'h:' .. member)
-- A start once the hold is over (a connection check too) is the first after it.
if hold <= now and redis.call('HGET', B, 'first_due') == '1' then
  redis.call('HSET', B, 'first', member, 'first_due', '0')
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
local member = ARGV[9]
local back = {tokens = r_in + r_out - u_in - u_out, input = r_in - u_in, output = r_out - u_out}
-- A budget a header set while it was in flight holds its real input: only its output.
local counted = {}
if member ~= '' then
  for kind in string.gmatch(redis.call('HGET', B, 'c:' .. member) or '', '%S+') do
    if kind == 'input' then back.input = 0 else back[kind] = r_out - u_out end
    counted[kind] = true
  end
end
-- The budgets whose measure of others' take saw it in flight (h:<member>: "kind=AGE",
-- taken for others' at that age of the measure, or "kind=-", in its start only).
local heard = {}
if member ~= '' then
  for kind, age in string.gmatch(redis.call('HGET', B, 'h:' .. member) or '',
                                 '(%a+)=(%S+)') do
    heard[kind] = age
  end
end
local took = {}
for j = 10, #ARGV do took[ARGV[j]] = true end
local gave = false
for kind, b in pairs(back) do
  local limit = limit_of(kind, cfg[kind])
  if limit > 0 and took[kind] then
    store(kind, math.min(limit, level_of(kind, limit) + b))
    gave = gave or b > 0
    -- (its input beyond the reservation was in the header's figure, and taken for
    -- others': it was the relays' own)
    if counted[kind] and kind ~= 'output' and redis.call('HGET', B, kind .. ':heard') then
      local seen = tonumber(redis.call('HGET', B, kind .. ':os') or '0') or 0
      redis.call('HSET', B, kind .. ':os', tostring(seen - (u_in - r_in)))
    end
    -- (a clean header saw it in flight: its input's error is no take of others', and
    -- comes off the measure's start; where the measure took it for theirs, off that too:
    -- `_Bucket.settled_heard`)
    local taken = heard[kind]
    if taken ~= nil and not counted[kind] and (kind == 'input' or kind == 'tokens') then
      if redis.call('HGET', B, kind .. ':heard') then
        local gap = tonumber(redis.call('HGET', B, kind .. ':gap') or '0') or 0
        redis.call('HSET', B, kind .. ':gap', tostring(gap - (u_in - r_in)))
      end
      if taken ~= '-' then
        local f = redis.call('HMGET', B, kind .. ':os', kind .. ':age')
        local age = (tonumber(f[2] or '0') or 0) - (tonumber(taken) or 0)
        local err = (u_in - r_in) * math.exp(-age / OTHERS_TAU_S)
        redis.call('HSET', B, kind .. ':os', tostring((tonumber(f[1] or '0') or 0) - err))
      end
    end
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
-- Its grant and what it used, for a header that comes after this (the last 16 kept;
-- the latest grant of one pushed out, or of one not known, in gev).
local start = member ~= '' and redis.call('ZSCORE', F, member)
local gev = tonumber(redis.call('HGET', B, 'gev') or '') or -1
if start then
  local n = redis.call('HINCRBY', B, 'gi', 1) % 16
  local old = string.match(redis.call('HGET', B, 'g' .. n) or '', '^%S+ (%S+)')
  if old then gev = math.max(gev, tonumber(old)) end
  redis.call('HSET', B, 'g' .. n, member .. ' ' .. start .. ' ' .. u_in .. ' ' .. u_out)
else
  gev = now
end
redis.call('HSET', B, 'gev', tostring(gev))
if member ~= '' then forget(member) end
prune()
if member ~= '' and redis.call('HGET', B, 'first') == member then
  first_done(ARGV[8])
elseif gave then
  wake(ARGV[8])
end
return done({0})
"""

# ARGV: configured tpm, itpm, otpm; hold_ms (0: none), cause, reason, ok (1: an answer
# came back; one begun after any hold: it has lifted), began (ms ago it began upstream:
# its grant), the channel prefix, its member ('' : not known), then (kind, limit,
# remaining) triples ('' for a figure not said). What a header's limit and remaining, a
# hold and an answer do: the table's rows (`relay.capacity.budget`).
TOKENS_SEEN = _BUDGET_PRELUDE + r"""
local cfg = {requests = '0', tokens = ARGV[1], input = ARGV[2], output = ARGV[3]}
local hold_ms, cause, reason, ok = math.min(tonumber(ARGV[4]), DAY_MS), ARGV[5], ARGV[6],
                                   ARGV[7]
local own = ARGV[10]
-- The answering request's grant: its start in F (exact), or kept at its settlement
-- (g0-g15: the last 16 settled), else as its relay said.
local ring_read  -- the ring: {member, grant, used in, used out} (read once, if asked)
local function settled()
  if not ring_read then
    ring_read = {}
    local ring = {}
    for n = 0, 15 do ring[n + 1] = 'g' .. n end
    for _, v in ipairs(redis.call('HMGET', B, unpack(ring))) do
      local m, g, ui, uo = string.match(v or '', '^(%S+) (%S+) (%S+) (%S+)$')
      if m then table.insert(ring_read, {m, tonumber(g), tonumber(ui), tonumber(uo)}) end
    end
  end
  return ring_read
end
local began = tonumber(own ~= '' and redis.call('ZSCORE', F, own) or '')
if not began and own ~= '' then
  for _, e in ipairs(settled()) do
    if e[1] == own then began = e[2] end
  end
end
-- (mine: it took from this budget; a request that did not is in the header's figure and
-- in none of the relays' counts here: no measure of others from it)
local mine = began ~= nil
began = began or now - tonumber(ARGV[8])
-- What requests granted after the answering one (its own aside) take of a budget: they
-- are not in the provider's count yet (a burst's first answers come back while the
-- relays are still starting the rest).
local late_cost  -- (read once, when a header first sets a budget)
local function late(kind)
  if not late_cost then
    late_cost = {requests = 0, tokens = 0, input = 0, output = 0}
    for _, m in ipairs(redis.call('ZRANGEBYSCORE', F, '(' .. began, '+inf')) do
      if m ~= own then
        local f = redis.call('HGET', B, 'f:' .. m) or ''
        local i, o = string.match(f, '^(%S+) (%S+)$')
        i, o = tonumber(i) or 0, tonumber(o) or 0
        late_cost.requests = late_cost.requests + 1
        late_cost.tokens = late_cost.tokens + i + o
        late_cost.input = late_cost.input + i
        late_cost.output = late_cost.output + o
      end
    end
  end
  return late_cost[kind]
end
-- The requests in flight granted since RECKON_MS before the answering one (its own aside):
-- the provider may not have them in its count yet.
local recent_n
local function recent()
  if not recent_n then
    recent_n = 0
    for _, m in ipairs(redis.call('ZRANGEBYSCORE', F, '(' .. (began - RECKON_MS), '+inf')) do
      if m ~= own then recent_n = recent_n + 1 end
    end
  end
  return recent_n
end
-- What every grant since RECKON_MS before the answering one's (its own aside) takes of a
-- budget: its need in flight, what it used settled (`Budget._since`); nil: not known.
local function since(kind)
  if (tonumber(redis.call('HGET', B, 'gev') or '') or -1) > began - RECKON_MS then
    return nil
  end
  local sum = 0
  local function add(i, o)
    if kind == 'requests' then sum = sum + 1
    elseif kind == 'tokens' then sum = sum + i + o
    elseif kind == 'input' then sum = sum + i
    else sum = sum + o end
  end
  for _, m in ipairs(redis.call('ZRANGEBYSCORE', F, '(' .. (began - RECKON_MS), '+inf')) do
    if m ~= own then
      local i, o = string.match(redis.call('HGET', B, 'f:' .. m) or '', '^(%S+) (%S+)$')
      add(tonumber(i) or 0, tonumber(o) or 0)
    end
  end
  for _, e in ipairs(settled()) do
    if e[1] ~= own and e[2] > began - RECKON_MS then add(e[3], e[4]) end
  end
  return sum
end
-- A header with a remaining: what others took since the last one (`_Bucket.learn`); the
-- requests in flight are marked seen by it (h:<member>, for TOKENS_SETTLE).
local function learn(kind, limit, level, gap)
  local f = redis.call('HMGET', B, kind .. ':heard', kind .. ':gap', kind .. ':os',
                       kind .. ':osp', kind .. ':age')
  local heard = tonumber(f[1] or '')
  local age = tonumber(f[5] or '0') or 0
  if heard then
    local span = math.max(0, now - heard) / 1000
    local took = gap - (tonumber(f[2] or '0') or 0)
    if level < limit - 1e-6 then  -- (whole, the refill left them nothing)
      took = took + others_of(kind, limit) * span / 60
    end
    local decay = math.exp(-span / OTHERS_TAU_S)
    redis.call('HSET', B, kind .. ':os', tostring((tonumber(f[3] or '0') or 0) * decay + took),
               kind .. ':osp', tostring((tonumber(f[4] or '0') or 0) * decay + span))
    age = age + span
    redis.call('HSET', B, kind .. ':age', tostring(age))
  end
  redis.call('HSET', B, kind .. ':heard', tostring(now), kind .. ':gap', tostring(gap))
  -- (the requests in flight, seen by it: h:<member>, for TOKENS_SETTLE)
  local mark = kind .. '=' .. (heard and tostring(age) or '-')
  for _, m in ipairs(redis.call('ZRANGE', F, 0, -1)) do
    local h = redis.call('HGET', B, 'h:' .. m) or ''
    if not string.find(' ' .. h, ' ' .. kind .. '=', 1, true) then
      redis.call('HSET', B, 'h:' .. m, h == '' and mark or h .. ' ' .. mark)
    end
  end
end
-- The requests granted at or before ``upto`` (and its own) hold their real input in
-- that budget now.
local function counted(kind, upto)
  local those = redis.call('ZRANGEBYSCORE', F, '-inf', upto)
  if own ~= '' and redis.call('ZSCORE', F, own) then table.insert(those, own) end
  for _, m in ipairs(those) do
    local c = redis.call('HGET', B, 'c:' .. m) or ''
    if not string.find(' ' .. c .. ' ', ' ' .. kind .. ' ', 1, true) then
      redis.call('HSET', B, 'c:' .. m, c == '' and kind or c .. ' ' .. kind)
    end
  end
end
local i = 11
while ARGV[i] do
  local kind, limit, remaining = ARGV[i], tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2])
  local created = false
  if limit and limit > 0 then
    local old = limit_of(kind, cfg[kind])
    created = old == 0  -- it had no limit before this header
    redis.call('HSET', B, kind .. ':hdr', tostring(limit))
    local new = limit_of(kind, cfg[kind])
    store(kind, math.min(new, level_of(kind, old > 0 and old or new)))
  end
  local now_limit = limit_of(kind, cfg[kind])
  if remaining and now_limit > 0 then
    created = created or redis.call('HGET', B, kind .. ':new') == '1'
    -- (decided on the header's own figure: a provider that computes a whole answer's
    -- headers at its end has those requests in it already)
    -- (less by more than the margin at the edge: a provider rounds, on another clock)
    local said = math.min(now_limit, remaining)
    local level = level_of(kind, now_limit)
    store(kind, level)  -- (at the refill as it was: the rate may change below)
    local theirs = said - late(kind)
    local tighten = created or said < level - now_limit * MARGIN
    -- (it raises the count when it says more by as much, less every grant since
    -- RECKON_MS before its request's: `Budget._window`)
    -- (only from a request begun after the last header that set the count: <kind>:set;
    -- by at most what headers took off for later grants: <kind>:owe)
    local floor, lifted = nil, 0
    if not tighten and began > (tonumber(redis.call('HGET', B, kind .. ':set') or '')
                                or -1) then
      floor = since(kind)
    end
    local owed = tonumber(redis.call('HGET', B, kind .. ':owe') or '0') or 0
    if floor ~= nil then lifted = math.min(said - floor, level + owed) end
    local lift = floor ~= nil and lifted > level + now_limit * MARGIN
    -- (others are learned only from a header of a request of this budget with nothing
    -- granted since RECKON_MS before it in flight: `Budget._measure`)
    local clean = mine and recent() == 0
    if created then  -- (requests begun before it are in none of its counts)
      redis.call('HDEL', B, kind .. ':heard')
    elseif clean then
      learn(kind, now_limit, level, level - theirs)
    end
    if tighten or lift then
      local new = theirs
      if not tighten then new = lifted end
      redis.call('HSET', B, kind .. ':owe', tostring(math.min(now_limit, said - new)))
      store(kind, new)
      redis.call('HSET', B, kind .. ':set', tostring(now))
      -- (others are measured between clean headers on the relays' count; not clean, the
      -- measure starts anew at the next clean header: `Budget._window`)
      if clean then
        redis.call('HSET', B, kind .. ':gap', tostring(new - theirs))
      elseif not created then
        redis.call('HDEL', B, kind .. ':heard')
      end
      counted(kind, tighten and began or began - RECKON_MS)
    end
    redis.call('HDEL', B, kind .. ':new')
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

# What the budgets are now, for the status (read at each renewal; nothing else changes).
# ARGV: configured tpm, itpm, otpm. Reply: {hold_left_ms, hold_cause, waiters, tokens used
# in the last minute by every relay, then (kind, limit, level, header limit, what others
# take a minute) for each budget with a limit}, numbers as strings.
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
    table.insert(out, tostring(others_of(kind, limit)))
  end
end
return done(out)
"""

SCRIPTS = {"TOKENS_TAKE": TOKENS_TAKE, "TOKENS_LEAVE": TOKENS_LEAVE,
           "TOKENS_SETTLE": TOKENS_SETTLE, "TOKENS_SEEN": TOKENS_SEEN,
           "TOKENS_PEEK": TOKENS_PEEK}
