"""The Lua scripts of the map layout (router/index/redis_map.py).

A model's map is one hash: field = a block hash (8 bytes, little-endian), value = its holders,
12 bytes each: the replica's id (4 bytes) and the block's recency stamp in that replica (a
little-endian double). Fields of another length are the replicas' counters: ``c<id>`` the
capacity, ``t<id>`` the highest stamp given, ``n<id>`` the blocks held. Each replica also has
a sorted set of its blocks by stamp, read only to evict its least recent ones.

Every command a script runs counts in ``INFO commandstats``: the flush reads every field its
batch touches with one ``HMGET`` and writes them back with one ``HSET``, whatever the batch
holds (chunked past ``CHUNK`` arguments: Lua's ``unpack`` is bounded by its C stack).
"""

from __future__ import annotations

CHUNK = 1000  # arguments per command built in Lua (even: ZADD takes score, member pairs)

_HOLDERS = """
local CHUNK = {chunk}
local function find(v, id)  -- the position of id's entry in a holders value, or nil
  if not v then return nil end
  for p = 1, #v, 12 do
    if string.sub(v, p, p + 3) == id then return p end
  end
  return nil
end
local function without(v, p) return string.sub(v, 1, p - 1) .. string.sub(v, p + 12) end
local function upto(t, c) return math.min(#t, c + CHUNK - 1) end
"""

# KEYS[1] the model's map, KEYS[1 + j] replica j's recency zset (j = 1..R).
# ARGV[1] ttl ms; ARGV[2] '1': refresh every key's TTL and recount the zsets; ARGV[3] refresh
# budget B (0: every block of a record is rewritten); ARGV[4] the head's freshness bound as a
# fraction of the capacity; then per replica j: its id (4 bytes), its capacity, '1' if that
# capacity is known (stored back); then the ops, three arguments each, in order:
# 'r' record / 'f' forget, j, the block hashes (8n bytes); 'c', j, '' (replica j's capacity
# changed: trim it).
# Returns {members written, replica 1's blocks, ..., replica R's blocks}.
FLUSH = (
    _HOLDERS
    + """
local map = KEYS[1]
local R = #KEYS - 1
local ttl, touch = ARGV[1], ARGV[2] == '1'
local budget, freshf = tonumber(ARGV[3]), tonumber(ARGV[4])
local rid, cap, known = {{}}, {{}}, {{}}
for j = 1, R do
  local a = 5 + 3 * (j - 1)
  rid[j], cap[j], known[j] = ARGV[a], tonumber(ARGV[a + 1]), ARGV[a + 2] == '1'
end
local first = 5 + 3 * R

local val, dirty, seen = {{}}, {{}}, {{}}
local function load(fields)  -- one HMGET per CHUNK fields
  for c = 1, #fields, CHUNK do
    local got = redis.call('HMGET', map, unpack(fields, c, upto(fields, c)))
    for i = 1, #got do
      if got[i] then val[fields[c + i - 1]] = got[i] end
    end
  end
end
local want = {{}}
local function need(f)
  if not seen[f] then
    seen[f] = true
    want[#want + 1] = f
  end
end
for j = 1, R do
  need('c' .. rid[j])
  need('t' .. rid[j])
  need('n' .. rid[j])
end
for o = first, #ARGV, 3 do
  if ARGV[o] ~= 'c' then
    local blob = ARGV[o + 2]
    for p = 1, #blob, 8 do need(string.sub(blob, p, p + 7)) end
  end
end
load(want)

local function stamp(f, id)
  local v = val[f]
  local p = find(v, id)
  if p then return (struct.unpack('<d', v, p + 4)) end
  return nil
end
local function put(f, id, s)
  local v = val[f] or ''
  local p = find(v, id)
  if p then v = without(v, p) end
  val[f] = v .. id .. struct.pack('<d', s)
  dirty[f] = true
end
local function drop(f, id)
  local p = find(val[f], id)
  if p then
    val[f] = without(val[f], p)
    dirty[f] = true
  end
end

local top, card, zs = {{}}, {{}}, {{}}
for j = 1, R do
  local id = rid[j]
  local stored = tonumber(val['c' .. id])
  if known[j] then
    if stored ~= cap[j] then
      val['c' .. id] = tostring(cap[j])
      dirty['c' .. id] = true
    end
  elseif stored then
    cap[j] = stored
  end
  top[j] = tonumber(val['t' .. id]) or 0
  card[j] = tonumber(val['n' .. id])
  zs[j] = {{}}  -- member -> its new stamp, or false: removed
end

local written = 0
-- A record: as RedisIndex's (router/index/redis.py), stamps in place of scores. Unbounded
-- (B = 0): the blocks get top+1 .. top+n, block 1 the most recent. Bounded: generations (a
-- chain whose head stamps g is up to date when block i stamps g - (i - 1)); the held run and
-- the blocks that follow g are found by binary search, since refreshes extend a prefix.
local function record(j, blob)
  local id, z = rid[j], zs[j]
  local n = #blob / 8
  local function m(i) return string.sub(blob, 8 * i - 7, 8 * i) end
  local function w(i, s)
    local f = m(i)
    put(f, id, s)
    z[f] = s
    written = written + 1
  end
  local t = top[j]
  if budget == 0 then
    for i = n, 1, -1 do w(i, t + n - i + 1) end
    top[j] = t + n
    return
  end
  local function sc(i) return stamp(m(i), id) end
  local k = 0
  local s1 = sc(1)
  if s1 then
    if sc(n) then
      k = n
    else
      local lo, hi = 1, n - 1
      while lo < hi do
        local mid = math.floor((lo + hi + 1) / 2)
        if sc(mid) then lo = mid else hi = mid - 1 end
      end
      k = lo
    end
  end
  local g, f = t + n, 0
  if k > 0 then
    -- Stamps given since the head's bound its rank from above: a fresh head keeps g.
    local fresh = math.max(budget, math.floor(cap[j] * freshf))
    if t - s1 < fresh then
      g, f = s1, 1
      if sc(k) >= g - (k - 1) then
        f = k
      else
        local lo, hi = 1, k - 1
        while lo < hi do
          local mid = math.floor((lo + hi + 1) / 2)
          local sm = sc(mid)
          if sm and sm >= g - (mid - 1) then lo = mid else hi = mid - 1 end
        end
        f = lo
      end
    end
  end
  local last = math.min(k, f + budget)
  for i = last, f + 1, -1 do w(i, g - (i - 1)) end
  if last == k then
    for i = n, k + 1, -1 do w(i, g - (i - 1)) end
  else  -- the chain has not caught up with g yet: new blocks go just below their parent
    local sk = sc(k)
    for i = n, k + 1, -1 do w(i, sk - (i - k)) end
  end
  if g > top[j] then top[j] = g end
end

for o = first, #ARGV, 3 do
  local kind, j, blob = ARGV[o], tonumber(ARGV[o + 1]), ARGV[o + 2]
  if kind == 'r' then
    record(j, blob)
  elseif kind == 'f' then
    for p = 1, #blob, 8 do
      local f = string.sub(blob, p, p + 7)
      drop(f, rid[j])
      zs[j][f] = false
    end
  end
end

-- Each replica's zset, then its trim to capacity: the least recent blocks leave both.
local victims, gone, missing = {{}}, {{}}, {{}}
for j = 1, R do
  local key = KEYS[1 + j]
  local add, rem = {{}}, {{}}
  for f, s in pairs(zs[j]) do
    if s then
      add[#add + 1] = s
      add[#add + 1] = f
    else
      rem[#rem + 1] = f
    end
  end
  local delta = 0
  for c = 1, #add, CHUNK do delta = delta + redis.call('ZADD', key, unpack(add, c, upto(add, c))) end
  for c = 1, #rem, CHUNK do delta = delta - redis.call('ZREM', key, unpack(rem, c, upto(rem, c))) end
  local c = card[j]
  if touch or not c then
    c = redis.call('ZCARD', key)
  else
    c = c + delta
  end
  if c > cap[j] then
    local popped = redis.call('ZPOPMIN', key, c - cap[j])
    for x = 1, #popped, 2 do
      local f = popped[x]
      victims[#victims + 1] = j
      gone[#gone + 1] = f
      if not seen[f] then
        seen[f] = true
        missing[#missing + 1] = f
      end
    end
    if #popped / 2 < c - cap[j] then c = redis.call('ZCARD', key) else c = cap[j] end
  end
  card[j] = c
end
load(missing)
for x = 1, #gone do drop(gone[x], rid[victims[x]]) end
for j = 1, R do
  local id = rid[j]
  val['t' .. id], val['n' .. id] = tostring(top[j]), tostring(card[j])
  dirty['t' .. id], dirty['n' .. id] = true, true
end

local set, del = {{}}, {{}}
for f in pairs(dirty) do
  local v = val[f]
  if v and #v > 0 then
    set[#set + 1] = f
    set[#set + 1] = v
  else
    del[#del + 1] = f
  end
end
for c = 1, #set, CHUNK do redis.call('HSET', map, unpack(set, c, upto(set, c))) end
for c = 1, #del, CHUNK do redis.call('HDEL', map, unpack(del, c, upto(del, c))) end
if touch then
  for k = 1, #KEYS do redis.call('PEXPIRE', KEYS[k], ttl) end
end
local out = {{written}}
for j = 1, R do out[j + 1] = card[j] end
return out
"""
)

# KEYS[1] the model's map. ARGV[1] the prompt's block hashes (8n bytes), then the candidates'
# ids. Returns each candidate's leading run of held blocks, found by MemoryIndex's binary
# search (router/index/memory.py: the same probes, so the same answer on the same held set)
# over one HMGET of every block: in Lua, so that the gateway sends one argument and reads one
# integer per candidate (redis-py packs and parses an n-field HMGET in Python: ~1 ms for
# 250 blocks, against ~0.3 ms for this).
MATCH = (
    _HOLDERS
    + """
local blob = ARGV[1]
local n = #blob / 8
local fields, vals = {{}}, {{}}
for i = 1, n do fields[i] = string.sub(blob, 8 * i - 7, 8 * i) end
for c = 1, n, CHUNK do
  local got = redis.call('HMGET', KEYS[1], unpack(fields, c, upto(fields, c)))
  for i = 1, #got do vals[c + i - 1] = got[i] end
end
local out = {{}}
for a = 2, #ARGV do
  local id = ARGV[a]
  local function held(i) return find(vals[i + 1], id) ~= nil end  -- i: 0-based
  local run = 0
  if n > 0 and held(0) then
    if held(n - 1) then
      run = n
    else
      local lo, hi = 1, n - 1  -- block lo-1 is held, block hi is not
      while lo < hi do
        local mid = math.floor((lo + hi) / 2)
        if held(mid) then lo = mid + 1 else hi = mid end
      end
      run = lo
    end
  end
  out[a - 1] = run
end
return out
"""
)

# KEYS[1] the model's map, KEYS[2] the replica's zset. ARGV[1] the replica's id.
# Removes the replica from every block it holds, its counters and its zset; returns how many
# blocks it held.
DROP = (
    _HOLDERS
    + """
local id = ARGV[1]
local members = redis.call('ZRANGE', KEYS[2], 0, -1)
for c = 1, #members, CHUNK do
  local part = {{unpack(members, c, upto(members, c))}}
  local got = redis.call('HMGET', KEYS[1], unpack(part))
  local set, del = {{}}, {{}}
  for i = 1, #part do
    local v = got[i]
    local p = find(v or nil, id)
    if p then
      v = without(v, p)
      if #v == 0 then
        del[#del + 1] = part[i]
      else
        set[#set + 1] = part[i]
        set[#set + 1] = v
      end
    end
  end
  if #set > 0 then redis.call('HSET', KEYS[1], unpack(set)) end
  if #del > 0 then redis.call('HDEL', KEYS[1], unpack(del)) end
end
redis.call('HDEL', KEYS[1], 'c' .. id, 't' .. id, 'n' .. id)
redis.call('DEL', KEYS[2])
return #members
"""
)


def script(body: str) -> str:
    return body.format(chunk=CHUNK)
