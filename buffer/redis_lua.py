"""The Redis ring's server-side scripts. Each runs atomically, so any number of producers and
consumers can share a run. Keys of a run (one hash tag, so they share a cluster slot):

- ``meta`` (hash): capacity, head, tail, evicted, sampled, rejected, dropped, version, maxp, leaves
- ``ring`` (hash): per slot ``b<slot>`` record bytes, ``i<slot>`` trajectory id, ``v<slot>``
  policy version, ``u<slot>`` use count
- ``ids`` (hash): trajectory id -> position (held trajectories only)
- ``tree`` (hash): the sum tree of priorities, node -> sum (prioritized runs only)
"""

from __future__ import annotations

# KEYS: meta ring ids tree. ARGV[1] = capacity. Creates missing fields only, checks capacity.
_PRELUDE = """
local meta, ring, ids, tree = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
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

# ARGV: capacity, prioritized (0/1), then (traj_id, version, bytes) per record.
# Returns {inserted, evicted, duplicates, size}.
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
for k = 3, #ARGV, 3 do
  local tid, ver, blob = ARGV[k], ARGV[k + 1], ARGV[k + 2]
  if redis.call('HEXISTS', ids, tid) == 1 then
    dup = dup + 1
  else
    local slot = head % cap
    if head - cap >= tail then
      local old = redis.call('HGET', ring, 'i' .. slot)
      if old then redis.call('HDEL', ids, old) end
      tail = tail + 1
      evicted = evicted + 1
    end
    redis.call('HSET', ring, 'b' .. slot, blob, 'i' .. slot, tid, 'v' .. slot, ver, 'u' .. slot, 0)
    redis.call('HSET', ids, tid, head)
    if prio then tset(slot, maxp) end
    head = head + 1
    inserted = inserted + 1
  end
end
redis.call('HSET', meta, 'head', head, 'tail', tail)
redis.call('HINCRBY', meta, 'evicted', evicted)
return {inserted, evicted, dup, head - tail}
"""
)

# ARGV: capacity, batch, seed (1..2^31-2), samples_per_insert (<0: off), slack, min_size,
# max_staleness (<0: off), prioritized (0/1).
# Returns {0, reason, dropped} when it cannot hand out a batch, else
# {1, version, size, skipped, dropped, slots, blobs, uses, versions, probs}.
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
    if tid then redis.call('HDEL', ids, tid) end
    redis.call('HDEL', ring, 'b' .. slot, 'i' .. slot, 'v' .. slot, 'u' .. slot)
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
if not prio then
  local swaps = {}
  local i = 0
  while #slots < B and i < n do
    local j = i + math.floor(rnd() * (n - i))
    local vi, vj = swaps[i] or i, swaps[j] or j
    swaps[j] = vi
    local slot = (tail + vj) % cap
    local v = redis.call('HGET', ring, 'v' .. slot)
    if not v or (floor and tonumber(v) < floor) then
      skipped = skipped + 1
    else
      slots[#slots + 1] = slot
      versions[#versions + 1] = tonumber(v)
    end
    i = i + 1
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
local fields = {}
local uses = {}
for k, slot in ipairs(slots) do
  fields[k] = 'b' .. slot
  uses[k] = redis.call('HINCRBY', ring, 'u' .. slot, 1)
end
local blobs = {}
for k = 1, #fields, 1000 do
  local chunk = redis.call('HMGET', ring, unpack(fields, k, math.min(k + 999, #fields)))
  for _, b in ipairs(chunk) do blobs[#blobs + 1] = b end
end
redis.call('HINCRBY', meta, 'sampled', B)
return {1, version, n, skipped, dropped, slots, blobs, uses, versions, probs}
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

# ARGV: capacity, then (traj_id, bytes) pairs. Replaces the stored bytes of held ones.
WRITE_BACK = (
    _PRELUDE
    + """
local err = ensure()
if err then return err end
local found = 0
for k = 2, #ARGV, 2 do
  local pos = redis.call('HGET', ids, ARGV[k])
  if pos then
    redis.call('HSET', ring, 'b' .. (tonumber(pos) % cap), ARGV[k + 1])
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
  if tid then redis.call('HDEL', ids, tid) end
  redis.call('HDEL', ring, 'b' .. slot, 'i' .. slot, 'v' .. slot, 'u' .. slot)
  if redis.call('EXISTS', tree) == 1 then tset(tonumber(slot), 0) end
end
redis.call('HINCRBY', meta, 'rejected', #ARGV - 1)
return #ARGV - 1
"""
)
