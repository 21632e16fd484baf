-- leasehold protocol v1: release, for one or more leases in order
-- KEYS[1] leases   KEYS[2] holders   KEYS[3] waiting (STRING, with a TTL: someone was refused lately)
-- ARGV[1] channel, then pairs: ARGV[2k] task id, ARGV[2k+1] fencing token, or '*' for an
-- operator's forced release (at least one pair, at most 1000)
-- Reply: one value per pair, in argument order: 1 if a lease was removed, 0 otherwise. A removal
-- is announced on the channel when someone may be waiting (the waiting marker exists) or when it
-- was forced (its holder must learn it). One call for k pairs answers exactly what k calls in a
-- row would. A call without a complete pair, or with more than 1000, fails with a `LEASEHOLD`
-- error before anything is read (§2).
if #ARGV < 3 or #ARGV % 2 == 0 or #ARGV > 2001 then
  return redis.error_reply('LEASEHOLD invalid pairs (ARGV[2..]): ' .. (#ARGV - 1) .. ' values, want 2 to 2000 and even')
end
local ids, wanted = {}, {}
for k = 2, #ARGV, 2 do
  ids[#ids + 1] = ARGV[k]
  wanted[#wanted + 1] = ARGV[k + 1]
end
local metas = redis.call('HMGET', KEYS[2], unpack(ids))
local scores = redis.call('ZMSCORE', KEYS[1], unpack(ids))

local someone_waits = redis.call('EXISTS', KEYS[3]) == 1
local unhold, unlease, announce = {}, {}, {}
local gone = {}
local out = {}
for k = 1, #ids do
  local id = ids[k]
  local released = 0
  local meta = not gone[id] and metas[k]
  if not meta then
    -- No metadata: remove any stray member too, but announce nothing.
    if scores[k] and not gone[id] then
      unlease[#unlease + 1] = id
      gone[id] = true
    end
  else
    local token = string.sub(meta, 1, string.find(meta, ':', 1, true) - 1)
    if wanted[k] == '*' or wanted[k] == token then
      unhold[#unhold + 1] = id
      gone[id] = true
      if scores[k] then
        unlease[#unlease + 1] = id
        if someone_waits or wanted[k] == '*' then
          announce[#announce + 1] = 'released:' .. token .. ':' .. id
        end
        released = 1
      end
    end
  end
  out[k] = released
end

if #unhold > 0 then
  redis.call('HDEL', KEYS[2], unpack(unhold))
end
if #unlease > 0 then
  redis.call('ZREM', KEYS[1], unpack(unlease))
end
-- pcall: a refused PUBLISH (an ACL without this channel) must not fail a release already done;
-- waiters still learn of it from their polls.
for _, message in ipairs(announce) do
  redis.pcall('PUBLISH', ARGV[1], message)
end
return out
