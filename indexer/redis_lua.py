"""Server-side scripts of the Redis index (see :mod:`kvroute.indexer.redis_index` for the layout).

Block values are binary strings with one byte per worker slot holding its tier bits, so the lookup
script can skip over runs of identical blocks with one (interned) string comparison each and only
decode bytes where the holders or their tiers change.
"""

# KEYS: slots, owners, next, counts. ARGV: block prefix, worker, ttl, then (kind, tier bit, packed keys)*.
# kind: "s" store, "r" remove, "c" clear (retire the slot; the next store allocates a fresh one).
WRITE = r"""
local slots, owners, nextk, counts = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local bprefix, worker, ttl = ARGV[1], ARGV[2], tonumber(ARGV[3])
local slot = redis.call('HGET', slots, worker)
if slot then slot = tonumber(slot) end
local i = 4
while i <= #ARGV do
  local kind, tb, packed = ARGV[i], tonumber(ARGV[i + 1]), ARGV[i + 2]
  i = i + 3
  if kind == 'c' then
    if slot then
      redis.call('HDEL', slots, worker)
      redis.call('HDEL', owners, slot)
      redis.call('HDEL', counts, slot .. ':any', slot .. ':0', slot .. ':1', slot .. ':2', slot .. ':3',
                 slot .. ':4', slot .. ':5')
      slot = nil
    end
  elseif kind == 's' or slot then
    if not slot then
      slot = redis.call('INCR', nextk) - 1
      redis.call('HSET', slots, worker, slot)
      redis.call('HSET', owners, slot, worker)
    end
    local bitval = bit.lshift(1, tb)
    local off = slot * 8 + 7 - tb
    local dtier, dany = 0, 0
    for j = 1, #packed, 8 do
      local k = bprefix .. string.sub(packed, j, j + 7)
      if kind == 's' then
        -- One call reads the slot's byte as it was and sets the tier bit.
        local r = redis.call('BITFIELD', k, 'GET', 'u8', slot * 8, 'SET', 'u1', off, 1)
        if r[2] == 0 then
          dtier = dtier + 1
          if r[1] == 0 then dany = dany + 1 end
        end
        if ttl > 0 then redis.call('EXPIRE', k, ttl) end
      else
        -- Read first: a removal must never create a key (it would have no TTL).
        local byte = string.byte(redis.call('GETRANGE', k, slot, slot)) or 0
        if bit.band(byte, bitval) ~= 0 then
          redis.call('SETBIT', k, off, 0)
          dtier = dtier - 1
          if byte == bitval then dany = dany - 1 end
        end
      end
    end
    if dtier ~= 0 then redis.call('HINCRBY', counts, slot .. ':' .. tb, dtier) end
    if dany ~= 0 then redis.call('HINCRBY', counts, slot .. ':any', dany) end
  end
end
return slot
"""

# KEYS: owners. ARGV: block prefix, packed keys (8 bytes each, in chain order).
# Returns a flat array: worker, blocks, gpu, cpu, storage, remote, worker, ...
LOOKUP = r"""
local flat = redis.call('HGETALL', KEYS[1])
local owner = {}
for i = 1, #flat, 2 do owner[tonumber(flat[i])] = flat[i + 1] end
local bprefix, packed = ARGV[1], ARGV[2]
local n = math.floor(#packed / 8)
local res, alive = {}, nil
local prev, run, count = nil, 0, 0
local function flush()
  if run == 0 or prev == nil then return end
  for _, s in ipairs(alive) do
    local b = string.byte(prev, s + 1) or 0
    local r = res[s]
    local m = bit.bor(b, bit.rshift(b, 3))
    if bit.band(m, 1) ~= 0 then r[2] = r[2] + run
    elseif bit.band(m, 2) ~= 0 then r[3] = r[3] + run
    else r[4] = r[4] + run end
    if bit.band(b, 7) == 0 then r[5] = r[5] + run end
  end
end
local done, pos = false, 0
while not done and pos < n do
  local m = math.min(256, n - pos)
  local names = {}
  for j = 1, m do
    local at = (pos + j - 1) * 8
    names[j] = bprefix .. string.sub(packed, at + 1, at + 8)
  end
  local vals = redis.call('MGET', unpack(names))
  for j = 1, m do
    local v = vals[j]
    if not v then done = true break end
    if v ~= prev then
      if alive == nil then
        alive = {}
        for s, _ in pairs(owner) do
          local b = string.byte(v, s + 1)
          if b and b ~= 0 then
            alive[#alive + 1] = s
            res[s] = {0, 0, 0, 0, 0}
          end
        end
      else
        flush()
        count = count + run
        run = 0
        local keep = {}
        for _, s in ipairs(alive) do
          local b = string.byte(v, s + 1)
          if b and b ~= 0 then keep[#keep + 1] = s else res[s][1] = count end
        end
        alive = keep
      end
      if #alive == 0 then done = true break end
      prev = v
    end
    run = run + 1
  end
  pos = pos + m
end
local out = {}
if alive then
  flush()
  count = count + run
  for _, s in ipairs(alive) do res[s][1] = count end
end
for s, r in pairs(res) do
  if r[1] > 0 then
    out[#out + 1] = owner[s]
    for t = 1, 5 do out[#out + 1] = r[t] end
  end
end
return out
"""
