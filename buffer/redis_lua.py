"""The Redis ring's server-side scripts. Each runs atomically, so any number of producers and
consumers can share a run. Keys of a run (one hash tag, so they share a cluster slot):

- ``meta`` (hash): capacity, head, tail, evicted, sampled, rejected, dropped, version, maxp, leaves
- ``ring`` (hash): per slot ``i<slot>`` trajectory id, ``v<slot>`` policy version, ``u<slot>``
  use count, ``r<slot>`` the reference quantities written back by the learner (msgpack)
- ``ids`` (hash): trajectory id -> position (held trajectories only)
- ``tree`` (hash): the sum tree of priorities, node -> sum (prioritized runs only)
- ``r:<trajectory id>`` (string): the record's bytes. Producers write them with a plain MSET in
  the same MULTI/EXEC as the INSERT script (so record bytes never pass through Lua, which copies
  them twice, and nothing is half-written); the learner reads them with a plain MGET after the
  SAMPLE script picked the ids. The scripts touch these keys by name (KEYS[5] is their prefix);
  they share the run's hash tag, so this also holds on Redis Cluster.
"""

from __future__ import annotations

# KEYS: meta ring ids tree. ARGV[1] = capacity. Creates missing fields only, checks capacity.
_PRELUDE = """
local meta, ring, ids, tree, rec = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local cap = tonumber(ARGV[1])
local function ensure()
  local leaves = 1
  while leaves < cap do leaves = leaves * 2 end
  local defaults = {capacity = cap, head = 0, tail = 0, evicted = 0, sampled = 0,
                    rejected = 0, dropped = 0, version = 0, maxp = 1, leaves = leaves}
  for k, v in pairs(defaults) do redis.call('HSETNX', meta, k, v) end
  local held = tonumber(redis.call('HGET', meta, 'capacity'))
  if held ~= cap then
    return redis.error_reply('CAPACITY this run was created with capacity ' .. held ..
      ' but the client asks for ' .. cap .. ': use a new run id, or reset the run')
  end
  return nil
end
local function num(x) return string.format('%.17g', x) end
local leaves = 0
local function tget(i)
  local v = redis.call('HGET', tree, i)
  if v then return tonumber(v) end
  return 0
end
local function tset(slot, value)
  local i = leaves + slot
  redis.call('HSET', tree, i, num(value))
  i = math.floor(i / 2)
  while i >= 1 do
    local c = redis.call('HMGET', tree, 2 * i, 2 * i + 1)
    redis.call('HSET', tree, i, num((tonumber(c[1]) or 0) + (tonumber(c[2]) or 0)))
    i = math.floor(i / 2)
  end
end
"""

OPEN = (
    _PRELUDE
    + """
local err = ensure()
if err then return err end
return redis.call('HMGET', meta, 'head', 'tail')
"""
)

# ARGV: capacity, prioritized (0/1), then (traj_id, version) per record, whose bytes the same
# transaction has just written to rec .. traj_id. Returns {inserted, evicted, duplicates, size}.
INSERT = (
    _PRELUDE
    + """
local err = ensure()
if err then return err end
local prio = ARGV[2] == '1'
local m = redis.call('HMGET', meta, 'head', 'tail', 'maxp', 'leaves')
local head, tail, maxp = tonumber(m[1]), tonumber(m[2]), tonumber(m[3])
leaves = tonumber(m[4])
local inserted, evicted, dup = 0, 0, 0
-- Batched: a handful of calls per chunk of 1000 records instead of several per record.
local function chunked(cmd, key, list)
  for k = 1, #list, 4000 do
    redis.call(cmd, key, unpack(list, k, math.min(k + 3999, #list)))
  end
end
local tids = {}
for k = 3, #ARGV, 2 do tids[#tids + 1] = ARGV[k] end
local held = {}
for k = 1, #tids, 4000 do
  local got = redis.call('HMGET', ids, unpack(tids, k, math.min(k + 3999, #tids)))
  for j = 1, #got do held[k + j - 1] = got[j] end
end
local seen = {}
local ringset, idset, rdel, olds = {}, {}, {}, {}
local prio_slots = {}
for j, tid in ipairs(tids) do
  if held[j] or seen[tid] then
    dup = dup + 1
  else
    seen[tid] = true
    local slot = head % cap
    if head - cap >= tail then
      olds[#olds + 1] = 'i' .. slot
      tail = tail + 1
      evicted = evicted + 1
    end
    local n = #ringset
    ringset[n + 1] = 'i' .. slot
    ringset[n + 2] = tid
    ringset[n + 3] = 'v' .. slot
    ringset[n + 4] = ARGV[2 * j + 2]
    ringset[n + 5] = 'u' .. slot
    ringset[n + 6] = 0
    rdel[#rdel + 1] = 'r' .. slot
    idset[#idset + 1] = tid
    idset[#idset + 1] = head
    prio_slots[#prio_slots + 1] = slot
    head = head + 1
    inserted = inserted + 1
  end
end
-- The evicted ids are read before their slots are overwritten. A batch longer than M evicts
-- some of its own records: those are found from the order of its writes.
local evict_ids = {}
if #olds > 0 then
  for k = 1, #olds, 4000 do
    local got = redis.call('HMGET', ring, unpack(olds, k, math.min(k + 3999, #olds)))
    for j = 1, #got do
      if got[j] then evict_ids[#evict_ids + 1] = got[j] end
    end
  end
  local last = {}
  for k = 1, #ringset, 6 do
    local f = ringset[k]
    if last[f] then evict_ids[#evict_ids + 1] = last[f] end
    last[f] = ringset[k + 1]
  end
end
if #ringset > 0 then
  chunked('HSET', ring, ringset)
  chunked('HDEL', ring, rdel)
  chunked('HSET', ids, idset)
end
if #evict_ids > 0 then  -- after the HSETs: a record of this batch may be among them
  chunked('HDEL', ids, evict_ids)
  local keys = {}
  for j, tid in ipairs(evict_ids) do keys[j] = rec .. tid end
  for k = 1, #keys, 4000 do
    redis.call('DEL', unpack(keys, k, math.min(k + 3999, #keys)))
  end
end
if prio then
  for _, slot in ipairs(prio_slots) do tset(slot, maxp) end
end
redis.call('HSET', meta, 'head', head, 'tail', tail)
redis.call('HINCRBY', meta, 'evicted', evicted)
return {inserted, evicted, dup, head - tail}
"""
)

# ARGV: capacity, batch, seed (1..2^31-2), samples_per_insert (<0: off), slack, min_size,
# max_staleness (<0: off), prioritized (0/1).
# Returns {0, reason, dropped} when it cannot hand out a batch, else
# {1, version, size, skipped, dropped, slots, ids, uses, versions, refs, probs}; the caller then
# reads the records' bytes with MGET.
SAMPLE = (
    _PRELUDE
    + """
local err = ensure()
if err then return err end
local B, x = tonumber(ARGV[2]), tonumber(ARGV[3])
local spi, slack, min_size = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local max_stale, prio = tonumber(ARGV[7]), ARGV[8] == '1'
local function rnd()  -- Park-Miller minimal standard generator, exact in doubles
  x = (x * 48271) % 2147483647
  return x / 2147483647
end
local m = redis.call('HMGET', meta, 'head', 'tail', 'sampled', 'version', 'leaves')
local head, tail, sampled, version = tonumber(m[1]), tonumber(m[2]), tonumber(m[3]), tonumber(m[4])
leaves = tonumber(m[5])
local floor = nil
local dropped = 0
if max_stale >= 0 then
  floor = version - max_stale
  while tail < head do
    local slot = tail % cap
    local v = redis.call('HGET', ring, 'v' .. slot)
    if v and tonumber(v) >= floor then break end
    local tid = redis.call('HGET', ring, 'i' .. slot)
    if tid then
      redis.call('HDEL', ids, tid)
      redis.call('DEL', rec .. tid)
    end
    redis.call('HDEL', ring, 'i' .. slot, 'v' .. slot, 'u' .. slot, 'r' .. slot)
    if prio then tset(slot, 0) end
    tail = tail + 1
    dropped = dropped + 1
  end
  if dropped > 0 then
    redis.call('HSET', meta, 'tail', tail)
    redis.call('HINCRBY', meta, 'dropped', dropped)
  end
end
local n = head - tail
local need = math.max(B, min_size)
if n < need then
  return {0, 'cannot sample ' .. B .. ' from a buffer holding ' .. n .. ' (need ' .. need .. ')',
          dropped}
end
if spi >= 0 and sampled + B > spi * head + slack then
  return {0, 'rate limited: ' .. sampled .. ' sampled + ' .. B .. ' > ' .. ARGV[4] .. ' x ' ..
          head .. ' inserted + ' .. slack, dropped}
end
local slots, versions, probs = {}, {}, {}
local skipped = 0
local function hmget_all(fields)
  local out = {}
  for k = 1, #fields, 4000 do
    local got = redis.call('HMGET', ring, unpack(fields, k, math.min(k + 3999, #fields)))
    for j = 1, #got do out[k + j - 1] = got[j] end
  end
  return out
end
if not prio then
  -- Partial Fisher-Yates over the window's offsets, in rounds: draw what is missing, read the
  -- versions in one call, keep the fresh ones.
  local swaps = {}
  local i = 0
  while #slots < B and i < n do
    local cand, vf = {}, {}
    while #cand < B - #slots and i < n do
      local j = i + math.floor(rnd() * (n - i))
      local vi, vj = swaps[i] or i, swaps[j] or j
      swaps[j] = vi
      local slot = (tail + vj) % cap
      cand[#cand + 1] = slot
      vf[#vf + 1] = 'v' .. slot
      i = i + 1
    end
    local vs = hmget_all(vf)
    for k, slot in ipairs(cand) do
      local v = vs[k]
      if not v or (floor and tonumber(v) < floor) then
        skipped = skipped + 1
      else
        slots[#slots + 1] = slot
        versions[#versions + 1] = tonumber(v)
      end
    end
  end
else
  local total = tget(1)
  local zeroed = {}
  while #slots < B do
    local rest = tget(1)
    if rest <= 0 then break end
    local mass = rnd() * rest
    local i = 1
    while i < leaves do
      local left = tget(2 * i)
      if mass < left or tget(2 * i + 1) <= 0 then
        i = 2 * i
      else
        mass = mass - left
        i = 2 * i + 1
      end
    end
    local slot = i - leaves
    local p = tget(i)
    if p <= 0 then break end
    zeroed[#zeroed + 1] = {slot, p}
    tset(slot, 0)
    local v = redis.call('HGET', ring, 'v' .. slot)
    if not v or (floor and tonumber(v) < floor) then
      skipped = skipped + 1
    else
      slots[#slots + 1] = slot
      versions[#versions + 1] = tonumber(v)
      probs[#probs + 1] = num(p / total)
    end
  end
  for _, z in ipairs(zeroed) do tset(z[1], z[2]) end
end
if skipped > 0 then redis.call('HINCRBY', meta, 'dropped', skipped) end
if #slots < B then
  return {0, 'fewer than ' .. B .. ' trajectories within max_staleness', dropped + skipped}
end
local ifields, rfields, ufields = {}, {}, {}
for k, slot in ipairs(slots) do
  ifields[k] = 'i' .. slot
  rfields[k] = 'r' .. slot
  ufields[k] = 'u' .. slot
end
local tids, refs, uses = hmget_all(ifields), hmget_all(rfields), hmget_all(ufields)
local uset = {}
for k = 1, #slots do
  uses[k] = (tonumber(uses[k]) or 0) + 1
  uset[2 * k - 1] = ufields[k]
  uset[2 * k] = uses[k]
end
for k = 1, #uset, 4000 do
  redis.call('HSET', ring, unpack(uset, k, math.min(k + 3999, #uset)))
end
redis.call('HINCRBY', meta, 'sampled', B)
return {1, version, n, skipped, dropped, slots, tids, uses, versions, refs, probs}
"""
)

# ARGV: capacity, then (traj_id, priority) pairs. Returns how many were held.
PRIORITIES = (
    _PRELUDE
    + """
local err = ensure()
if err then return err end
local m = redis.call('HMGET', meta, 'maxp', 'leaves')
local maxp = tonumber(m[1])
leaves = tonumber(m[2])
local found = 0
for k = 2, #ARGV, 2 do
  local pos = redis.call('HGET', ids, ARGV[k])
  if pos then
    local p = tonumber(ARGV[k + 1])
    tset(tonumber(pos) % cap, p)
    if p > maxp then maxp = p end
    found = found + 1
  end
end
redis.call('HSET', meta, 'maxp', num(maxp))
return found
"""
)

# ARGV: capacity, then (traj_id, packed reference quantities) pairs, stored for held ones.
WRITE_BACK = (
    _PRELUDE
    + """
local err = ensure()
if err then return err end
local found = 0
for k = 2, #ARGV, 2 do
  local pos = redis.call('HGET', ids, ARGV[k])
  if pos then
    redis.call('HSET', ring, 'r' .. (tonumber(pos) % cap), ARGV[k + 1])
    found = found + 1
  end
end
return found
"""
)

# ARGV: capacity, then slots whose records failed to decode. Empties them (the sampler skips
# empty slots) and counts them as rejected.
QUARANTINE = (
    _PRELUDE
    + """
local err = ensure()
if err then return err end
leaves = tonumber(redis.call('HGET', meta, 'leaves'))
for k = 2, #ARGV do
  local slot = ARGV[k]
  local tid = redis.call('HGET', ring, 'i' .. slot)
  if tid then
    redis.call('HDEL', ids, tid)
    redis.call('DEL', rec .. tid)
  end
  redis.call('HDEL', ring, 'i' .. slot, 'v' .. slot, 'u' .. slot, 'r' .. slot)
  if redis.call('EXISTS', tree) == 1 then tset(tonumber(slot), 0) end
end
redis.call('HINCRBY', meta, 'rejected', #ARGV - 1)
return #ARGV - 1
"""
)
