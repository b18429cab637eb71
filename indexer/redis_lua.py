"""Server-side scripts of the Redis index (see :mod:`kvroute.indexer.redis_index` for the layout).

Block values are binary strings with one byte per worker slot holding its tier bits, so the lookup
script can skip over runs of identical blocks with one (interned) string comparison each and only
decode bytes where the holders or their tiers change.
"""

# KEYS: slots, owners, next, counts. ARGV: name width L, worker, ttl, then (kind, tier bit, names)*
# where names are block key names of L bytes each, concatenated.
# kind: "s" store, "r" remove, "c" clear (retire the slot; the next store allocates a fresh one).
WRITE = r"""
local slots, owners, nextk, counts = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local width, worker, ttl = tonumber(ARGV[1]), ARGV[2], tonumber(ARGV[3])
local slot = redis.call('HGET', slots, worker)
if slot then slot = tonumber(slot) end
local i = 4
while i <= #ARGV do
  local kind, tb, names_all = ARGV[i], tonumber(ARGV[i + 1]), ARGV[i + 2]
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
    local dtier, dany = 0, 0
    local n = math.floor(#names_all / width)
    local pos = 0
    while pos < n do
      local m = math.min(256, n - pos)
      local names = {}
      for j = 1, m do
        local at = (pos + j - 1) * width
        names[j] = string.sub(names_all, at + 1, at + width)
      end
      -- One MGET per chunk, then a SET (with its TTL) only where a value changes: measured several
      -- times cheaper from Lua than SETBIT/BITFIELD per key.
      local vals = redis.call('MGET', unpack(names))
      for j = 1, m do
        local k, v = names[j], vals[j]
        local byte = 0
        if v then byte = string.byte(v, slot + 1) or 0 else v = '' end
        local has = bit.band(byte, bitval) ~= 0
        if kind == 's' and not has then
          local nb = bit.bor(byte, bitval)
          if #v <= slot then
            v = v .. string.rep('\0', slot - #v) .. string.char(nb)
          else
            v = string.sub(v, 1, slot) .. string.char(nb) .. string.sub(v, slot + 2)
          end
          if ttl > 0 then redis.call('SET', k, v, 'EX', ttl) else redis.call('SET', k, v) end
          dtier = dtier + 1
          if byte == 0 then dany = dany + 1 end
        elseif kind == 's' then
          if ttl > 0 then redis.call('EXPIRE', k, ttl) end
        elseif has then
          local nb = bit.band(byte, bit.bnot(bitval))
          v = string.sub(v, 1, slot) .. string.char(nb) .. string.sub(v, slot + 2)
          if string.find(v, '[^%z]') then
            redis.call('SET', k, v, 'KEEPTTL')
          else
            redis.call('DEL', k)
          end
          dtier = dtier - 1
          if nb == 0 then dany = dany - 1 end
        end
      end
      pos = pos + m
    end
    if dtier ~= 0 then redis.call('HINCRBY', counts, slot .. ':' .. tb, dtier) end
    if dany ~= 0 then redis.call('HINCRBY', counts, slot .. ':any', dany) end
  end
end
return slot
"""

# KEYS: owners. ARGV: name length L, the block keys' names concatenated (L bytes each, chain order).
# Returns a flat array: worker, blocks, gpu, cpu, storage, remote, worker, ...
LOOKUP = r"""
local flat = redis.call('HGETALL', KEYS[1])
local owner = {}
for i = 1, #flat, 2 do owner[tonumber(flat[i])] = flat[i + 1] end
local width, names_all = tonumber(ARGV[1]), ARGV[2]
local n = math.floor(#names_all / width)
-- Per matching slot: its current tier byte and where that byte's run started; settled on change.
local res, cur, start, alive = {}, {}, {}, nil
local prev, count = nil, 0
local function bytes_of(v)
  local out = {}
  for from = 1, #v, 4000 do
    local part = {string.byte(v, from, math.min(#v, from + 3999))}
    for j = 1, #part do out[from + j - 1] = part[j] end
  end
  return out
end
local function credit(s, run, b)
  if run <= 0 then return end
  local r = res[s]
  local m = bit.bor(b, bit.rshift(b, 3))
  if bit.band(m, 1) ~= 0 then r[2] = r[2] + run
  elseif bit.band(m, 2) ~= 0 then r[3] = r[3] + run
  else r[4] = r[4] + run end
  if bit.band(b, 7) == 0 then r[5] = r[5] + run end
end
local done, pos = false, 0
while not done and pos < n do
  local m = math.min(256, n - pos)
  local names = {}
  for j = 1, m do
    local at = (pos + j - 1) * width
    names[j] = string.sub(names_all, at + 1, at + width)
  end
  local vals = redis.call('MGET', unpack(names))
  for j = 1, m do
    local v = vals[j]
    if not v then done = true break end
    if v ~= prev then
      local bytes = bytes_of(v)
      if alive == nil then
        alive = {}
        for s, _ in pairs(owner) do
          local b = bytes[s + 1]
          if b and b ~= 0 then
            alive[#alive + 1] = s
            cur[s], start[s], res[s] = b, 0, {0, 0, 0, 0, 0}
          end
        end
      else
        local keep = {}
        for _, s in ipairs(alive) do
          local b, c = bytes[s + 1] or 0, cur[s]
          if b ~= c then
            credit(s, count - start[s], c)
            if b == 0 then res[s][1] = count else cur[s], start[s] = b, count end
          end
          if b ~= 0 then keep[#keep + 1] = s end
        end
        alive = keep
      end
      if #alive == 0 then done = true break end
      prev = v
    end
    count = count + 1
  end
  pos = pos + m
end
local out = {}
for _, s in ipairs(alive or {}) do
  credit(s, count - start[s], cur[s])
  res[s][1] = count
end
for s, r in pairs(res) do
  if r[1] > 0 then
    out[#out + 1] = owner[s]
    for t = 1, 5 do out[#out + 1] = r[t] end
  end
end
return out
"""
