"""The shared lane's state on the coordination server, as Lua scripts (SPEC L11).

Each script runs atomically on the server and is the only code that changes a shared
lane's keys, so relays never race one another: they race only the server's order of
scripts. Times are the server's (``TIME``, in milliseconds), never a relay's.

Keys of one lane (``KEYS``; ``{prefix:provider}`` keeps them in one cluster slot)::

    H   zset  holder member  -> its lease's expiry (ms)
    W   zset  waiter member  -> rank * 2^40 + arrival number (priority class, then FIFO)
    WX  zset  waiter member  -> its lease's expiry: a dead relay's waiters leave too
    M   hash  the stored profile (lanes, queue_max, rpm, set_by, pver), the epoch, the
              quiet period's end, the arrival counter, "l:<instance>" (each relay's lease)
    R   zset  relay instance -> its lease's expiry (the relays present)
    P   zset  member -> when it started (ms): the pacer's window (SPEC L9: at most rpm
              starts in any 60 s, `relay.capacity.pacer`), the last minute's starts; a
              grant handed straight back is removed, so it was no start

A member is ``<instance>|<n>``, an instance ``<relay_id>#<random>``: one relay process.
A grant to a waiter is published on ``<channel prefix><instance>`` as ``g <member>``; a
relay whose waiter heads a queue the pacer (or the quiet period) holds back is told when
to ask again as ``p <lane> <ms>``. Pub/sub is at most once: every script's reply also
lists the grants it made, and the renewal (`SYNC`) lists this relay's waiters that were
granted, so a lost message costs at most one renewal tick.

Common ``ARGV``: instance, relay_id, lease_ms, the epoch the relay knows, lanes,
queue_max, rpm, the channel prefix, the lane's name; then the script's own. A relay that
knows another epoch than the stored one (the state was lost and made anew: a server
restart) gets ``stale`` and re-registers (`SYNC`) first. After the state is made anew by
a relay that had known it, or within one lease of the server's own start, no grant is
made for one lease (the quiet period): the holders of before re-register within it, so
nothing is over-admitted. Likewise after a failover: the state names the server that
wrote it (its ``run_id``, field ``srv``); a state found on another server (the promoted
replica, whose copy may lack the last grants) answers ACQUIRE and PUMP ``stale``; the
first `SYNC` there makes a new epoch and starts a quiet period, so every relay registers
its holders and waiters again, as after a restart. ``INFO`` is
asked with ``pcall``: where an ACL user may not run it, this and the server's uptime are
unknown (a failover is then followed by the relays' reconnecting, without the quiet
period). Every reply starts with its status, the lane's global running
and queued, the ms until a start may be possible again (-1: none pending), and the
grants it made.
"""

from __future__ import annotations

__all__ = ["ACQUIRE", "CLAIM", "LEAVE", "PUMP", "RELEASE", "SYNC"]

_PRELUDE = r"""
local H, W, WX, M, R, P = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local instance, relay_id, lease = ARGV[1], ARGV[2], tonumber(ARGV[3])
local known, chan, lane_name = ARGV[4], ARGV[8], ARGV[9]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local S = {}
local granted = {}

-- This server's run_id and uptime (false, 0 where an ACL user may not run INFO).
local function server_id()
  local info = redis.pcall('INFO', 'server')
  if type(info) ~= 'string' then return false, 0 end
  return string.match(info, 'run_id:(%x+)') or false,
         tonumber(string.match(info, 'uptime_in_seconds:(%d+)')) or 0
end
S.run_id, S.uptime = server_id()

local function load()
  local m = redis.call('HMGET', M, 'epoch', 'lanes', 'queue_max', 'rpm', 'quiet', 'set_by',
                       'pver', 'srv')
  if not m[1] then return false end
  S.epoch, S.lanes, S.queue_max, S.rpm = m[1], tonumber(m[2]), tonumber(m[3]), tonumber(m[4])
  S.quiet, S.set_by, S.pver = tonumber(m[5]), m[6], tonumber(m[7])
  -- The state was written by another server (a failover: the promoted replica has it,
  -- but maybe not the last grants): no grant until SYNC has the holders registered again.
  S.moved = (m[8] and S.run_id and m[8] ~= S.run_id) or false
  if S.moved then S.quiet = math.max(S.quiet, now + lease) end
  return true
end

local function owner(member) return string.match(member, '^(.*)|') end

local function prune()
  local gone = redis.call('ZRANGEBYSCORE', H, '-inf', now)
  for _, h in ipairs(gone) do
    redis.call('ZREM', H, h)
  end
  local left = redis.call('ZRANGEBYSCORE', WX, '-inf', now)
  for _, w in ipairs(left) do
    redis.call('ZREM', W, w)
    redis.call('ZREM', WX, w)
  end
  local dead = redis.call('ZRANGEBYSCORE', R, '-inf', now)
  for _, i in ipairs(dead) do
    redis.call('ZREM', R, i)
    redis.call('HDEL', M, 'l:' .. i)
  end
  return #gone
end

-- The pacer (SPEC L9): at most n = max(1, floor(rpm)) starts in any 60 n / rpm s; the
-- earliest time the next start may be made.
local function paced_until()
  if S.rpm <= 0 then return -1e15 end
  local n = math.max(1, math.floor(S.rpm))
  local nth = redis.call('ZRANGE', P, -n, -n, 'WITHSCORES')
  if not nth[2] then return -1e15 end
  return tonumber(nth[2]) + 60000 * n / S.rpm
end

local function grant(member)
  local l = tonumber(redis.call('HGET', M, 'l:' .. owner(member)) or lease)
  redis.call('ZADD', P, now, member)
  -- Older than a minute a start never counts again (this one is the last).
  -- (only the commands of the documented ACL line: ZRANGEBYSCORE and ZREM)
  for _, old in ipairs(redis.call('ZRANGEBYSCORE', P, '-inf', '(' .. (now - 60000))) do
    redis.call('ZREM', P, old)
  end
  redis.call('ZADD', H, now + l, member)
end

-- A grant handed straight back was no start.
local function unstart(member)
  redis.call('ZREM', P, member)
end

-- Grant free slots to the heads of the queue as far as the pacer and the quiet period
-- allow. Returns the ms until a start may be possible again (-1: nothing to wait for).
local function pump()
  local free = S.lanes - redis.call('ZCARD', H)
  while free > 0 do
    local head = redis.call('ZRANGE', W, 0, 0)[1]
    if not head then return -1 end
    local due = math.max(S.quiet, paced_until())
    if now < due then
      local ms = math.ceil(due - now)
      redis.call('PUBLISH', chan .. owner(head), 'p ' .. lane_name .. ' ' .. ms)
      return ms
    end
    redis.call('ZREM', W, head)
    redis.call('ZREM', WX, head)
    grant(head)
    table.insert(granted, head)
    -- Published to its own relay too: the reply that lists it may never be read (the
    -- call that made it was cancelled), and a renewal tick is too long to idle a slot.
    redis.call('PUBLISH', chan .. owner(head), 'g ' .. head)
    free = free - 1
  end
  return -1
end

local function keep()
  for _, k in ipairs({H, W, WX, M, R, P}) do
    if redis.call('PTTL', k) < lease then redis.call('PEXPIRE', k, lease) end
  end
end

local function counts()
  return redis.call('ZCARD', H), redis.call('ZCARD', W)
end

local function reply(status, wait)
  keep()
  local running, queued = counts()
  return {status, running, queued, wait or -1, granted}
end
"""

# Register, renew, re-register after a lost state, or store a reloaded profile.
# ARGV[10] mode: start | renew | reload; then n holders, the holders; n waiters, then
# (member, rank) pairs. Reply: {"mismatch", lanes, queue_max, rpm, set_by} at start when
# the stored profile differs, else {"ok", running, queued, wait, granted, epoch, lanes,
# queue_max, rpm, set_by, pver, lost holders, granted waiters, gone waiters, reclaimed}.
SYNC = _PRELUDE + r"""
local mode = ARGV[10]
local known_before = known
if not load() then
  local quiet = now - S.uptime * 1000 + lease
  if known ~= '' then quiet = math.max(quiet, now + lease) end
  redis.call('HSET', M, 'epoch', t[1] .. '.' .. t[2], 'lanes', ARGV[5], 'queue_max', ARGV[6],
             'rpm', ARGV[7], 'quiet', quiet, 'set_by', relay_id,
             'pver', 1, 'seq', 0)
  load()
end
if S.moved then  -- a new epoch: every relay registers its holders and waiters again
  S.epoch, S.moved = t[1] .. '.' .. t[2], false
  redis.call('HSET', M, 'epoch', S.epoch, 'quiet', S.quiet)
end
if S.run_id then redis.call('HSET', M, 'srv', S.run_id) end
if mode == 'start' and (S.lanes ~= tonumber(ARGV[5]) or S.queue_max ~= tonumber(ARGV[6])
                        or S.rpm ~= tonumber(ARGV[7])) then
  return {'mismatch', S.lanes, S.queue_max, tostring(S.rpm), S.set_by}
end
if mode == 'reload' and (S.lanes ~= tonumber(ARGV[5]) or S.queue_max ~= tonumber(ARGV[6])
                         or S.rpm ~= tonumber(ARGV[7])) then
  S.lanes, S.queue_max, S.rpm, S.set_by, S.pver =
    tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7]), relay_id, S.pver + 1
  redis.call('HSET', M, 'lanes', ARGV[5], 'queue_max', ARGV[6], 'rpm', ARGV[7],
             'set_by', relay_id, 'pver', S.pver)
end
local reclaimed = prune()
local rereg = known_before ~= S.epoch
redis.call('ZADD', R, now + lease, instance)
redis.call('HSET', M, 'l:' .. instance, lease)
local lost, woken, gone = {}, {}, {}
local i = 11
for _ = 1, tonumber(ARGV[i]) do
  i = i + 1
  local h = ARGV[i]
  if rereg or redis.call('ZSCORE', H, h) then
    redis.call('ZADD', H, now + lease, h)
  else
    table.insert(lost, h)
  end
end
i = i + 1
local nw = tonumber(ARGV[i])
for _ = 1, nw do
  local w, rank = ARGV[i + 1], tonumber(ARGV[i + 2])
  i = i + 2
  if redis.call('ZSCORE', W, w) then
    redis.call('ZADD', WX, now + lease, w)
  elseif redis.call('ZSCORE', H, w) then
    redis.call('ZADD', H, now + lease, w)
    table.insert(woken, w)
  elseif rereg then
    local seq = redis.call('HINCRBY', M, 'seq', 1)
    redis.call('ZADD', W, rank * 1099511627776 + seq, w)
    redis.call('ZADD', WX, now + lease, w)
  else
    table.insert(gone, w)
  end
end
local wait = pump()
local out = reply('ok', wait)
for _, v in ipairs({S.epoch, S.lanes, S.queue_max, tostring(S.rpm), S.set_by, S.pver}) do
  table.insert(out, v)
end
table.insert(out, lost)
table.insert(out, woken)
table.insert(out, gone)
table.insert(out, reclaimed)
return out
"""

# Ask for a slot. ARGV[10] member, ARGV[11] rank. Reply status: granted | queued | full |
# stale. Asking twice with one member is harmless (the reply says where it stands).
ACQUIRE = _PRELUDE + r"""
if not load() or S.epoch ~= known or S.moved then return {'stale', 0, 0, -1, {}} end
local member, rank = ARGV[10], tonumber(ARGV[11])
prune()
if redis.call('ZSCORE', H, member) then return reply('granted') end
if redis.call('ZSCORE', W, member) then return reply('queued', pump()) end
local running, queued = counts()
local due = math.max(S.quiet, paced_until())
if queued == 0 and running < S.lanes and now >= due then
  grant(member)
  return reply('granted')
end
if queued >= S.queue_max then return reply('full') end
local seq = redis.call('HINCRBY', M, 'seq', 1)
redis.call('ZADD', W, rank * 1099511627776 + seq, member)
redis.call('ZADD', WX, now + lease, member)
local wait = pump()
if redis.call('ZSCORE', H, member) then return reply('granted') end
return reply('queued', wait)
"""

# A waiter leaves (its queue timeout, its client gone). ARGV[10] member. A grant that
# landed on it meanwhile is given back, and was no start: the pacer forgets it. Reply
# status: left | returned | gone | stale.
LEAVE = _PRELUDE + r"""
if not load() or S.epoch ~= known then return {'stale', 0, 0, -1, {}} end
local member = ARGV[10]
prune()
if redis.call('ZREM', W, member) == 1 then
  redis.call('ZREM', WX, member)
  return reply('left', pump())
end
if redis.call('ZSCORE', H, member) then
  unstart(member)
  redis.call('ZREM', H, member)
  return reply('returned', pump())
end
return reply('gone', pump())
"""

# A holder gives its slot back. ARGV[10] member. Reply status: released | gone (its
# lease had expired: the slot was already taken back) | stale.
RELEASE = _PRELUDE + r"""
if not load() or S.epoch ~= known then return {'stale', 0, 0, -1, {}} end
local member = ARGV[10]
prune()
local had = redis.call('ZREM', H, member)
return reply(had == 1 and 'released' or 'gone', pump())
"""

# Grant what the pacer or the quiet period now allows (asked at the time a reply named).
PUMP = _PRELUDE + r"""
if not load() or S.epoch ~= known or S.moved then return {'stale', 0, 0, -1, {}} end
prune()
return reply('ok', pump())
"""

# One relay per interval runs a shared provider's connection check. KEYS[1] the claim,
# ARGV[1] the relay, ARGV[2] the interval in ms. Reply: 1 claimed, 0 another relay has it.
CLAIM = r"""
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return 1 end
return 0
"""
