"""The Redis ring's server-side scripts. Each runs atomically, so any number of producers and
consumers can share a run. Keys of a run (one hash tag, so they share a cluster slot):

- ``meta`` (hash): capacity, head, tail, evicted, evicted_unused (evicted with a use count of
  0), sampled, taken (of those, by ``take``), rejected, dropped, version, maxp, leaves
- ``dig`` (sorted set): digest of each inserted chunk's trajectory ids -> its first position
  (trimmed below the tail), so a producer's retry of a chunk that had landed is not stored twice
- ``tree`` (hash): the sum tree of priorities, node -> sum (prioritized runs only)
- ``ver`` (string): per slot (position mod M), 4 bytes big-endian: policy version + 1 of the
  trajectory held there, 0 = none
- ``use`` (string): per slot, the use count as a big-endian u32 (``BITFIELD ... #slot``); its top
  bit marks a record that ``take`` handed out (``redis_layout.TAKEN``)
- ``chunks`` (sorted set): one member per inserted chunk, score = its first position, member =
  its end position (exclusive)
- ``r:<start>`` (hash): the records of the chunk that starts at position ``start``: field
  ``<offset>`` = the record's bytes, field ``f<offset>`` = the reference quantities the learner
  wrote back (msgpack). Positions only grow, so a field is written once and never reused; a
  chunk is deleted whole (UNLINK) once the tail has passed its end.
- ``stage:<id>`` (hash): a producer's chunk on its way in. The producer writes it with a plain
  HSET (native, no Lua) in the same MULTI/EXEC as the INSERT script, which renames it to
  ``r:<start>`` (O(1)) once it has given the chunk its positions.

Where the time goes (measured, docs/buffer.md): record bytes passed through Lua cost about 3.4 us
per 2 KB record (Lua makes a string of each argument), and Lua's string handling plus one hash
operation per record per field were most of the older scripts' time. Now no script does work per
record in the hot paths: INSERT is O(1) per chunk (plus two range writes), SAMPLE is O(1) (the
rate limiter, the staleness front, the window, the chunks the client has not seen yet); the
client draws the positions, then reads records, reference quantities and use counts with plain
commands in one MULTI/EXEC.
"""

from __future__ import annotations

# KEYS: meta, dig, tree, ver, use, chunks, rec (the chunks' key prefix) [, stage]. ARGV[1] =
# capacity. ensure() creates a missing run and checks the capacity (an error reply on a
# mismatch).
_PRELUDE = """
local meta, dig, tree, ver, use, chunks, rec =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7]
local cap = tonumber(ARGV[1])
local COUNTERS = {'capacity', 'evicted', 'evicted_unused', 'sampled', 'taken', 'rejected',
                  'dropped', 'version', 'leaves', 'maxp'}
local function ensure()
  local held = redis.call('HGET', meta, 'capacity')
  if not held then
    local leaves = 1
    while leaves < cap do leaves = leaves * 2 end
    local defaults = {capacity = cap, head = 0, tail = 0, evicted = 0, sampled = 0,
                      rejected = 0, dropped = 0, version = 0, maxp = 1, leaves = leaves}
    for k, v in pairs(defaults) do redis.call('HSETNX', meta, k, v) end
    held = cap
  end
  held = tonumber(held)
  if held ~= cap then
    return redis.error_reply('CAPACITY this run was created with capacity ' .. tostring(held) ..
      ' but the client asks for ' .. cap .. ': use a new run id, or reset the run')
  end
  -- The window's bookkeeping, checked before any script trusts it (a hand-written meta.head
  -- would otherwise fail deep inside a script, or leave tail > head waiting forever).
  local ht = redis.call('HMGET', meta, 'head', 'tail', unpack(COUNTERS))
  local h, t = tonumber(ht[1]), tonumber(ht[2])
  if not h or not t or h ~= math.floor(h) or t ~= math.floor(t) or t < 0 or t > h
      or h - t > cap then
    return redis.error_reply('CORRUPT meta head=' .. tostring(ht[1]) .. ' tail=' ..
      tostring(ht[2]) .. ' (need integers with 0 <= tail <= head <= tail + capacity ' ..
      cap .. ')')
  end
  -- Every other field a script or the client reads as a number (absent: never counted yet).
  for i, name in ipairs(COUNTERS) do
    local raw = ht[i + 2]
    if raw then
      local x = tonumber(raw)
      local whole = name ~= 'maxp'
      if not x or x ~= x or x == math.huge or x == -math.huge
          or (whole and x ~= math.floor(x)) then
        return redis.error_reply('CORRUPT meta ' .. name .. '=' .. tostring(raw) .. ' (need ' ..
          (whole and 'an integer' or 'a finite number') .. ')')
      end
    end
  end
  return nil
end
local function num(x) return string.format('%.17g', x) end
-- Chunks whose positions all lie below the tail go, oldest first.
local function drop_chunks(new_tail)
  while true do
    local low = redis.call('ZRANGE', chunks, 0, 0, 'WITHSCORES')
    if #low == 0 or tonumber(low[1]) > new_tail then return end
    redis.call('UNLINK', rec .. low[2])
    redis.call('ZREM', chunks, low[1])
  end
end
-- Write blob (4 bytes per position) for positions [p0, p0 + count) into a per-slot string,
-- in at most two ranges (the ring wraps).
local function set_slots(key, p0, count, blob)
  if count <= 0 then return end
  local s0 = p0 % cap
  local first = math.min(count, cap - s0)
  redis.call('SETRANGE', key, s0 * 4, string.sub(blob, 1, first * 4))
  if count > first then
    redis.call('SETRANGE', key, 0, string.sub(blob, first * 4 + 1, count * 4))
  end
end
-- Positions in [p0, p0 + count) whose use count (``use``) is 0: evicted unused. Runs over the
-- evicted positions only (about one insert's worth), in at most two ranges.
local function count_unused(p0, count)
  if count <= 0 then return 0 end
  local zeros, s0 = 0, p0 % cap
  local first = math.min(count, cap - s0)
  local spans = {{s0, first}}
  if count > first then spans[2] = {0, count - first} end
  for _, sp in ipairs(spans) do
    local raw = redis.call('GETRANGE', use, sp[1] * 4, (sp[1] + sp[2]) * 4 - 1)
    for i = 0, sp[2] - 1 do
      local j = i * 4
      if string.sub(raw, j + 1, j + 4) == '\0\0\0\0' or #raw < j + 4 then zeros = zeros + 1 end
    end
  end
  return zeros
end
local function slot_version(slot)  -- nil: no trajectory there
  local raw = redis.call('GETRANGE', ver, slot * 4, slot * 4 + 3)
  if #raw < 4 then return nil end
  local a, b, c, d = string.byte(raw, 1, 4)
  local v = ((a * 256 + b) * 256 + c) * 256 + d
  if v == 0 then return nil end
  return v - 1
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
local m = redis.call('HMGET', meta, 'head', 'tail')
return {m[1], m[2]}
"""
)

# KEYS[8]: the stage hash the same transaction has just written (fields 0..n-1: the records).
# ARGV: capacity, n, prioritized (0/1), digest of the chunk's ids ('' = none), the versions blob
# (4 bytes big-endian per record: version + 1). Returns {inserted, evicted, duplicates, size,
# first position, evicted unused}.
INSERT = (
    _PRELUDE
    + """
local stage = KEYS[8]
local err = ensure()
if err then
  redis.call('UNLINK', stage)
  return err
end
local n, prio, digest, vblob = tonumber(ARGV[2]), ARGV[3] == '1', ARGV[4], ARGV[5]
local m = redis.call('HMGET', meta, 'head', 'tail', 'maxp', 'leaves')
local head, tail, maxp = tonumber(m[1]), tonumber(m[2]), tonumber(m[3])
leaves = tonumber(m[4])
if redis.call('HLEN', stage) ~= n then
  redis.call('UNLINK', stage)
  return redis.error_reply('STAGE the chunk holds ' .. n .. ' records but its stage does not')
end
if digest ~= '' then
  redis.call('ZREMRANGEBYSCORE', dig, '-inf', '(' .. tail)
  local at = redis.call('ZSCORE', dig, digest)
  if at then  -- a retried chunk that had landed
    redis.call('UNLINK', stage)
    return {0, 0, n, head - tail, tonumber(at), 0}
  end
end
local start = head
head = head + n
local new_tail = math.max(tail, head - cap)
local evicted = new_tail - tail
-- Held positions evicted now, read before their slots take the new records' counts; a batch
-- longer than M evicts some of its own records too, which no one has used.
local unused = count_unused(tail, math.min(new_tail, start) - tail)
  + math.max(0, new_tail - start)
drop_chunks(new_tail)
-- A batch longer than M evicts some of its own records: they are never read (below the tail)
-- and go with their chunk.
if head > new_tail then
  redis.call('RENAME', stage, rec .. start)
  redis.call('ZADD', chunks, start, head)
else
  redis.call('UNLINK', stage)
end
local first = math.max(start, new_tail)
local count = head - first
set_slots(ver, first, count, string.sub(vblob, (first - start) * 4 + 1))
set_slots(use, first, count, string.rep('\\0', count * 4))
if prio then
  for p = first, head - 1 do tset(p % cap, maxp) end
end
redis.call('HSET', meta, 'head', head, 'tail', new_tail)
if evicted > 0 then redis.call('HINCRBY', meta, 'evicted', evicted) end
if unused > 0 then redis.call('HINCRBY', meta, 'evicted_unused', unused) end
if digest ~= '' then redis.call('ZADD', dig, start, digest) end
return {n, evicted, 0, head - new_tail, start, unused}
"""
)

# ARGV: capacity, batch, seed (1..2^31-2), samples_per_insert (<0: off), slack, min_size,
# max_staleness (<0: off), prioritized (0/1), the newest chunk start the client knows (-1: none),
# then positions to leave out (prioritized redraws). Drops the too-stale oldest, checks the window
# and the rate limiter, and counts the batch as sampled. Returns {0, reason, dropped} when it
# cannot hand out a batch, else {1, version, head, tail, dropped, chunks, positions, probs}:
# chunks = {end, start, ...} of the chunks newer than the client knows; uniform sampling leaves
# the draw of positions to the client (B distinct positions of [tail, head)), prioritized
# sampling walks the sum tree here and returns the positions and their probabilities.
SAMPLE = (
    _PRELUDE
    + """
local err = ensure()
if err then return err end
local B, x = tonumber(ARGV[2]), tonumber(ARGV[3])
local spi, slack, min_size = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local max_stale, prio, known = tonumber(ARGV[7]), ARGV[8] == '1', ARGV[9]
local m = redis.call('HMGET', meta, 'head', 'tail', 'sampled', 'version', 'leaves')
local head, tail, sampled, version = tonumber(m[1]), tonumber(m[2]), tonumber(m[3]), tonumber(m[4])
leaves = tonumber(m[5])
local dropped = 0
if max_stale >= 0 then
  -- Drop the too-stale oldest (and emptied slots): O(1) amortized, each is dropped once.
  local floor, t0 = version - max_stale, tail
  while tail < head do
    local v = slot_version(tail % cap)
    if v and v >= floor then break end
    if prio then tset(tail % cap, 0) end
    tail = tail + 1
    dropped = dropped + 1
  end
  if dropped > 0 then
    drop_chunks(tail)
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
local fresh = redis.call('ZRANGEBYSCORE', chunks, '(' .. known, '+inf', 'WITHSCORES')
if not prio then
  redis.call('HINCRBY', meta, 'sampled', B)
  return {1, version, head, tail, dropped, fresh, {}, {}}
end
local function rnd()  -- Park-Miller minimal standard generator, exact in doubles
  x = (x * 48271) % 2147483647
  return x / 2147483647
end
local zeroed = {}
local function zero(slot)
  local p = tget(leaves + slot)
  if p > 0 then
    zeroed[#zeroed + 1] = {slot, p}
    tset(slot, 0)
  end
  return p
end
for k = 10, #ARGV do zero(tonumber(ARGV[k]) % cap) end
local total = tget(1)
local positions, probs = {}, {}
while #positions < B do
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
  local p = zero(slot)
  if p <= 0 then break end
  positions[#positions + 1] = tail + (slot - tail) % cap
  probs[#probs + 1] = num(p / total)
end
for _, z in ipairs(zeroed) do tset(z[1], z[2]) end
if #positions < B then
  return {0, 'fewer than ' .. B .. ' trajectories with a priority', dropped}
end
redis.call('HINCRBY', meta, 'sampled', B)
return {1, version, head, tail, dropped, fresh, positions, probs}
"""
)

# ARGV: capacity, then (position, priority) pairs. Returns how many were held.
PRIORITIES = (
    _PRELUDE
    + """
local err = ensure()
if err then return err end
local m = redis.call('HMGET', meta, 'maxp', 'leaves', 'head', 'tail')
local maxp, head, tail = tonumber(m[1]), tonumber(m[3]), tonumber(m[4])
leaves = tonumber(m[2])
local found = 0
for k = 2, #ARGV, 2 do
  local pos = tonumber(ARGV[k])
  if pos >= tail and pos < head and slot_version(pos % cap) then
    local p = tonumber(ARGV[k + 1])
    tset(pos % cap, p)
    if p > maxp then maxp = p end
    found = found + 1
  end
end
redis.call('HSET', meta, 'maxp', num(maxp))
return found
"""
)

# ARGV: capacity, then (position, its chunk's start, packed reference quantities) triples,
# stored for the positions still held. Returns how many were held.
WRITE_BACK = (
    _PRELUDE
    + """
local err = ensure()
if err then return err end
local m = redis.call('HMGET', meta, 'head', 'tail')
local head, tail = tonumber(m[1]), tonumber(m[2])
local found = 0
for k = 2, #ARGV, 3 do
  local pos, start = tonumber(ARGV[k]), ARGV[k + 1]
  local off = pos - tonumber(start)
  if pos >= tail and pos < head and redis.call('HEXISTS', rec .. start, off) == 1 then
    redis.call('HSET', rec .. start, 'f' .. off, ARGV[k + 2])
    found = found + 1
  end
end
return found
"""
)

# ARGV: capacity, then (position, its chunk's start) pairs whose records failed to decode.
# Empties them (samples skip empty positions) and counts them as rejected.
QUARANTINE = (
    _PRELUDE
    + """
local err = ensure()
if err then return err end
local m = redis.call('HMGET', meta, 'head', 'tail', 'leaves')
local head, tail = tonumber(m[1]), tonumber(m[2])
leaves = tonumber(m[3])
local prio = redis.call('EXISTS', tree) == 1
for k = 2, #ARGV, 2 do
  local pos, start = tonumber(ARGV[k]), ARGV[k + 1]
  if pos >= tail and pos < head then
    local off = pos - tonumber(start)
    redis.call('HDEL', rec .. start, off, 'f' .. off)
    redis.call('SETRANGE', ver, (pos % cap) * 4, '\\0\\0\\0\\0')
    if prio then tset(pos % cap, 0) end
  end
end
redis.call('HINCRBY', meta, 'rejected', (#ARGV - 1) / 2)
return (#ARGV - 1) / 2
"""
)
