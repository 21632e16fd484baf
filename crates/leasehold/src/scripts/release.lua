-- leasehold protocol v1: release
-- KEYS[1] leases   KEYS[2] holders
-- ARGV[1] task id   ARGV[2] fencing token, or '*' for an operator's forced release   ARGV[3] channel
-- Reply: {1} if a lease was removed (and announced on the channel), {0} otherwise.
local id = ARGV[1]
local meta = redis.call('HGET', KEYS[2], id)
if not meta then
  -- No metadata: remove any stray member too, but announce nothing.
  redis.call('ZREM', KEYS[1], id)
  return {0}
end
local sep = string.find(meta, ':', 1, true)
local token = string.sub(meta, 1, sep - 1)
if ARGV[2] ~= '*' and ARGV[2] ~= token then
  return {0}
end
redis.call('HDEL', KEYS[2], id)
if redis.call('ZREM', KEYS[1], id) == 0 then
  return {0}
end
redis.call('PUBLISH', ARGV[3], 'released:' .. token .. ':' .. id)
return {1}
