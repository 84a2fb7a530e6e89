"""The shared lane's state on the coordination server, as Lua scripts (SPEC L11).

Each script runs atomically on the server and is the only code that changes a shared
lane's keys, so relays never race one another: they race only the server's order of
scripts. Times are the server's (``TIME``, in milliseconds), never a relay's.

Keys of one lane (``KEYS``; ``{prefix:provider}`` keeps them in one cluster slot)::

    H   zset  holder member  -> its lease's expiry (ms)
    W   zset  waiter member  -> rank * 2^50 + its turn (priority class, then turns
              between clients, SPEC L14: below); a tie goes to the earlier arrival
    WX  zset  waiter member  -> its lease's expiry: a dead relay's waiters leave too
    M   hash  the stored profile (lanes, queue_max, rpm, set_by, pver), the epoch, the
              quiet period's end, the arrival counter, "l:<instance>" (each relay's lease);
              the turns: "v:<rank>" each class's clock, "f:<rank>:<client>" each client's
              next free turn, "w:<member>" each waiter's (and holder's) "rank turn step
              arrival client"
    R   zset  relay instance -> its lease's expiry (the relays present)
    P   zset  member -> when it started (ms): the pacer's window (SPEC L9: at most rpm
              starts in any 60 s, `relay.capacity.pacer`), the last minute's starts; a
              grant handed straight back is removed, so it was no start

Turns between clients (SPEC L14) are the local lane's rule (`relay.capacity.lanes`, its
theory of operation), kept here in integer ticks: start-time fair queueing inside each
class. A request of client ``k`` with weight ``w`` gets the turn ``S = max(V, F[k])``
when it queues (or starts at once), and ``F[k] = S + step`` with ``step = TURN / w``
(`TURN` ticks a turn, sent by the relay); a start moves its class's clock ``V`` to its
turn. The queue's order is (class, turn, arrival): a client's own requests keep their
order, clients that wait start in the ratio of their weights, an idle client rejoins at
``V`` (no credit saved while away), and a waiter that leaves without starting (LEAVE, a
grant handed back, a dead relay's place) hands its turn back: its client's later waiters
in the class move up one turn each. With one client (``default``) it is FIFO inside a
class. The scores are exact: a class spans 2^50 ticks (2^30 turns of a weight-1 client),
below 2^53.

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

# layers: long because a shared lane's state is one set of Lua scripts sharing one
# prelude (the queue with its turns, the pacer, the leases), each an atomic unit.

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

-- Turns between clients (SPEC L14; the module docstring). Integers in ticks.
local CLASS = 1125899906842624  -- 2^50: one priority class's span of scores
local function fmt(x) return string.format('%.0f', x) end

-- A waiter's (or holder's) rank, turn, step, arrival and client; nil when unknown.
local function info(member)
  local v = redis.call('HGET', M, 'w:' .. member)
  if not v then return nil end
  local rank, tag, step, seq, client = string.match(v, '^(%d+) (%d+) (%d+) (%d+) (.*)$')
  return {rank = tonumber(rank), tag = tonumber(tag), step = tonumber(step),
          seq = tonumber(seq), client = client}
end

local function set_info(member, i)
  redis.call('HSET', M, 'w:' .. member, i.rank .. ' ' .. fmt(i.tag) .. ' ' .. fmt(i.step)
             .. ' ' .. fmt(i.seq) .. ' ' .. i.client)
end

-- Give a request its turn (it queues or starts now); its client's next moves on.
local function register(member, rank, client, step)
  local v = tonumber(redis.call('HGET', M, 'v:' .. rank) or '0')
  local f = tonumber(redis.call('HGET', M, 'f:' .. rank .. ':' .. client) or '0')
  local i = {rank = rank, tag = math.max(v, f), step = math.max(1, step),
             seq = redis.call('HINCRBY', M, 'seq', 1), client = client}
  redis.call('HSET', M, 'f:' .. rank .. ':' .. client, fmt(i.tag + i.step))
  set_info(member, i)
  return i
end

local function enqueue(member, i)
  redis.call('ZADD', W, i.rank * CLASS + i.tag, member)
  redis.call('ZADD', WX, now + lease, member)
end

local function started_turn(i)
  if not i then return end
  local v = tonumber(redis.call('HGET', M, 'v:' .. i.rank) or '0')
  if i.tag > v then redis.call('HSET', M, 'v:' .. i.rank, fmt(i.tag)) end
end

-- A request that leaves without starting (or whose grant went back) hands its turn
-- back: its client's later waiters in its class move up one turn each, from its turn on.
local function give_turn_back(i)
  if not i then return end
  local later = {}
  local lo, hi = i.rank * CLASS + i.tag, (i.rank + 1) * CLASS
  for _, m in ipairs(redis.call('ZRANGEBYSCORE', W, '(' .. fmt(lo), '(' .. fmt(hi))) do
    local o = info(m)
    if o and o.client == i.client and o.seq > i.seq then
      table.insert(later, {m, o})
    end
  end
  table.sort(later, function(a, b) return a[2].seq < b[2].seq end)
  local turn = i.tag
  for _, pair in ipairs(later) do
    local m, o = pair[1], pair[2]
    o.tag, turn = turn, turn + o.step
    set_info(m, o)
    redis.call('ZADD', W, o.rank * CLASS + o.tag, m)
  end
  redis.call('HSET', M, 'f:' .. i.rank .. ':' .. i.client, fmt(turn))
end

-- The head of the queue: the least (class, turn); a tie to the earlier arrival (only
-- different clients tie: a client's own turns grow).
local function queue_head()
  local first = redis.call('ZRANGE', W, 0, 0, 'WITHSCORES')
  if not first[1] then return nil end
  local tied = redis.call('ZRANGEBYSCORE', W, first[2], first[2])
  if #tied < 2 then return first[1] end
  local best, best_seq = nil, nil
  for _, m in ipairs(tied) do
    local o = info(m)
    local seq = o and o.seq or 0
    if best == nil or seq < best_seq then best, best_seq = m, seq end
  end
  return best
end

-- A waiter or holder is gone for good: its turn's record goes too.
local function forget(member)
  redis.call('HDEL', M, 'w:' .. member)
end

local function prune()
  local gone = redis.call('ZRANGEBYSCORE', H, '-inf', now)
  for _, h in ipairs(gone) do
    redis.call('ZREM', H, h)
    forget(h)
  end
  local left = redis.call('ZRANGEBYSCORE', WX, '-inf', now)
  for _, w in ipairs(left) do
    redis.call('ZREM', W, w)
    redis.call('ZREM', WX, w)
    give_turn_back(info(w))
    forget(w)
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
    local head = queue_head()
    if not head then return -1 end
    local due = math.max(S.quiet, paced_until())
    if now < due then
      local ms = math.ceil(due - now)
      redis.call('PUBLISH', chan .. owner(head), 'p ' .. lane_name .. ' ' .. ms)
      return ms
    end
    redis.call('ZREM', W, head)
    redis.call('ZREM', WX, head)
    started_turn(info(head))
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
# (member, rank, client, step) quadruples (a re-registered waiter takes a turn anew).
# Reply: {"mismatch", lanes, queue_max, rpm, set_by} at start when
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
  local w, rank, client, step = ARGV[i + 1], tonumber(ARGV[i + 2]), ARGV[i + 3],
                                tonumber(ARGV[i + 4])
  i = i + 4
  if redis.call('ZSCORE', W, w) then
    redis.call('ZADD', WX, now + lease, w)
  elseif redis.call('ZSCORE', H, w) then
    redis.call('ZADD', H, now + lease, w)
    table.insert(woken, w)
  elseif rereg then
    enqueue(w, register(w, rank, client, step))
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

# Ask for a slot. ARGV[10] member, ARGV[11] rank, ARGV[12] client, ARGV[13] its step (the
# ticks of its turn: `TURN` / its weight). Reply status: granted | queued | full |
# stale. Asking twice with one member is harmless (the reply says where it stands).
ACQUIRE = _PRELUDE + r"""
if not load() or S.epoch ~= known or S.moved then return {'stale', 0, 0, -1, {}} end
local member, rank, client, step = ARGV[10], tonumber(ARGV[11]), ARGV[12],
                                  tonumber(ARGV[13])
prune()
if redis.call('ZSCORE', H, member) then return reply('granted') end
if redis.call('ZSCORE', W, member) then return reply('queued', pump()) end
local running, queued = counts()
local due = math.max(S.quiet, paced_until())
if queued == 0 and running < S.lanes and now >= due then
  local i = register(member, rank, client, step)
  started_turn(i)
  grant(member)
  return reply('granted')
end
if queued >= S.queue_max then return reply('full') end
enqueue(member, register(member, rank, client, step))
local wait = pump()
if redis.call('ZSCORE', H, member) then return reply('granted') end
return reply('queued', wait)
"""

# A waiter leaves (its queue timeout, its client gone). ARGV[10] member. A grant that
# landed on it meanwhile is given back, and was no start: the pacer forgets it. Either
# way its client keeps its turn (its later waiters move up). Reply
# status: left | returned | gone | stale.
LEAVE = _PRELUDE + r"""
if not load() or S.epoch ~= known then return {'stale', 0, 0, -1, {}} end
local member = ARGV[10]
prune()
local i = info(member)
forget(member)
if redis.call('ZREM', W, member) == 1 then
  redis.call('ZREM', WX, member)
  give_turn_back(i)
  return reply('left', pump())
end
if redis.call('ZSCORE', H, member) then
  unstart(member)
  redis.call('ZREM', H, member)
  give_turn_back(i)
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
forget(member)
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
