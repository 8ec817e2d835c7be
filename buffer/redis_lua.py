"""The Redis ring's server-side scripts. Each runs atomically, so any number of producers and
consumers can share a run. Keys of a run (one hash tag, so they share a cluster slot):

- ``meta`` (hash): capacity, head, tail, evicted, sampled, rejected, dropped, version, maxp, leaves
- ``ids`` (hash): trajectory id -> position (held trajectories only)
- ``tree`` (hash): the sum tree of priorities, node -> sum (prioritized runs only)
- ``sid``, ``sver``, ``suse``, ``sref`` (hashes keyed by slot number): the trajectory id, its
  policy version, its use count (absent = 0) and the reference quantities written back by the
  learner (msgpack). One hash per field and numeric field names: the scripts pass slot numbers
  straight to Redis and do no string work per record (Lua's string handling, not Redis, was
  most of the scripts' time).
- ``r:<trajectory id>`` (string): the record's bytes. Producers write them with a plain MSET in
  the same MULTI/EXEC as the INSERT script (so record bytes never pass through Lua, which copies
  them twice, and nothing is half-written); the learner reads them with a plain MGET after the
  SAMPLE script picked the ids. The scripts touch these keys by name (KEYS[8] is their prefix);
  they share the run's hash tag, so this also holds on Redis Cluster.
"""

from __future__ import annotations

# KEYS: see above, in that order. ARGV[1] = capacity. ensure() creates missing fields only and
# checks the capacity.
_PRELUDE = """
local meta, ids, tree, sid, sver, suse, sref, rec =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8]
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
local function chunked(cmd, key, list)
  for k = 1, #list, 4000 do
    redis.call(cmd, key, unpack(list, k, math.min(k + 3999, #list)))
  end
end
local function hmget_all(key, fields)
  local out = {}
  for k = 1, #fields, 4000 do
    local got = redis.call('HMGET', key, unpack(fields, k, math.min(k + 3999, #fields)))
    for j = 1, #got do out[k + j - 1] = got[j] end
  end
  return out
end
local function del_records(tids)
  local keys = {}
  for j, tid in ipairs(tids) do keys[j] = rec .. tid end
  for k = 1, #keys, 4000 do
    redis.call('DEL', unpack(keys, k, math.min(k + 3999, #keys)))
  end
end
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
local tids = {}
for k = 3, #ARGV, 2 do tids[#tids + 1] = ARGV[k] end
local held = hmget_all(ids, tids)
local inserted, evicted, dup = 0, 0, 0
local seen, idset, verset, slots, posset, olds = {}, {}, {}, {}, {}, {}
for j = 1, #tids do
  local tid = tids[j]
  if held[j] or seen[tid] then
    dup = dup + 1  -- a retried batch that had landed, or an id twice in one batch
  else
    seen[tid] = true
    -- One number-to-string conversion per record: Redis would otherwise format each number
    -- passed to redis.call with sprintf, and that was a third of this script's time.
    local slot = tostring(head % cap)
    if head - cap >= tail then
      olds[#olds + 1] = slot
      tail = tail + 1
      evicted = evicted + 1
    end
    local n = #idset
    idset[n + 1] = slot
    idset[n + 2] = tid
    verset[n + 1] = slot
    verset[n + 2] = ARGV[2 * j + 2]
    posset[n + 1] = tid
    posset[n + 2] = tostring(head)
    slots[#slots + 1] = slot
    head = head + 1
    inserted = inserted + 1
  end
end
-- Evicted ids are read before their slots are overwritten; a batch longer than M also evicts
-- some of its own records, found from the order of its writes.
local evict = {}
if #olds > 0 then
  for _, tid in ipairs(hmget_all(sid, olds)) do
    if tid then evict[#evict + 1] = tid end
  end
  if #slots > cap then
    local last = {}
    for k = 1, #idset, 2 do
      local slot = idset[k]
      if last[slot] then evict[#evict + 1] = last[slot] end
      last[slot] = idset[k + 1]
    end
  end
end
if #slots > 0 then
  chunked('HSET', sid, idset)
  chunked('HSET', sver, verset)
  chunked('HDEL', suse, slots)
  chunked('HDEL', sref, slots)
  chunked('HSET', ids, posset)
end
if #evict > 0 then  -- after the HSETs: a record of this batch may be among them
  chunked('HDEL', ids, evict)
  del_records(evict)
end
if prio then
  for _, slot in ipairs(slots) do tset(tonumber(slot), maxp) end
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
local function empty_slot(slot)
  redis.call('HDEL', sid, slot)
  redis.call('HDEL', sver, slot)
  redis.call('HDEL', suse, slot)
  redis.call('HDEL', sref, slot)
end
if max_stale >= 0 then
  -- Drop the too-stale oldest: O(1) amortized, each trajectory is dropped once.
  floor = version - max_stale
  local gone = {}
  while tail < head do
    local slot = tail % cap
    local v = tonumber(redis.call('HGET', sver, slot))
    if v and v >= floor then break end
    local tid = redis.call('HGET', sid, slot)
    if tid then gone[#gone + 1] = tid end
    empty_slot(slot)
    if prio then tset(slot, 0) end
    tail = tail + 1
    dropped = dropped + 1
  end
  if #gone > 0 then
    chunked('HDEL', ids, gone)
    del_records(gone)
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
if not prio then
  -- Partial Fisher-Yates over the window's offsets, in rounds: draw what is missing, read
  -- their versions in one call, keep the usable ones.
  local swaps = {}
  local i = 0
  while #slots < B and i < n do
    local cand = {}
    while #cand < B - #slots and i < n do
      local j = i + math.floor(rnd() * (n - i))
      local vi, vj = swaps[i] or i, swaps[j] or j
      swaps[j] = vi
      cand[#cand + 1] = tostring((tail + vj) % cap)
      i = i + 1
    end
    local vs = hmget_all(sver, cand)
    for k = 1, #cand do
      local v = vs[k]
      if v then v = tonumber(v) end
      if not v or (floor and v < floor) then
        skipped = skipped + 1  -- stale, or an emptied (quarantined) slot
      else
        slots[#slots + 1] = cand[k]
        versions[#versions + 1] = v
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
    slot = tostring(slot)
    local v = tonumber(redis.call('HGET', sver, slot))
    if not v or (floor and v < floor) then
      skipped = skipped + 1
    else
      slots[#slots + 1] = slot
      versions[#versions + 1] = v
      probs[#probs + 1] = num(p / total)
    end
  end
  for _, z in ipairs(zeroed) do tset(z[1], z[2]) end
end
if skipped > 0 then redis.call('HINCRBY', meta, 'dropped', skipped) end
if #slots < B then
  return {0, 'fewer than ' .. B .. ' trajectories within max_staleness', dropped + skipped}
end
local tids, refs, uses = hmget_all(sid, slots), hmget_all(sref, slots), hmget_all(suse, slots)
local uset = {}
for k = 1, #slots do
  local u = (tonumber(uses[k]) or 0) + 1
  uses[k] = u
  uset[2 * k - 1] = slots[k]
  uset[2 * k] = u
end
chunked('HSET', suse, uset)
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
local tids = {}
for k = 2, #ARGV, 2 do tids[#tids + 1] = ARGV[k] end
local pos = hmget_all(ids, tids)
local set = {}
for j = 1, #tids do
  if pos[j] then
    set[#set + 1] = tonumber(pos[j]) % cap
    set[#set + 1] = ARGV[2 * j + 1]
  end
end
chunked('HSET', sref, set)
return #set / 2
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
local gone = {}
for k = 2, #ARGV do
  local slot = tonumber(ARGV[k])
  local tid = redis.call('HGET', sid, slot)
  if tid then gone[#gone + 1] = tid end
  redis.call('HDEL', sid, slot)
  redis.call('HDEL', sver, slot)
  redis.call('HDEL', suse, slot)
  redis.call('HDEL', sref, slot)
  if redis.call('EXISTS', tree) == 1 then tset(slot, 0) end
end
if #gone > 0 then
  chunked('HDEL', ids, gone)
  del_records(gone)
end
redis.call('HINCRBY', meta, 'rejected', #ARGV - 1)
return #ARGV - 1
"""
)
