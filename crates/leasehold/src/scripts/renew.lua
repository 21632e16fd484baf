-- leasehold protocol v1: renew (heartbeat) many leases in one call
-- KEYS[1] leases   KEYS[2] holders   KEYS[2+k] cancel marker of the k-th task id
-- ARGV[1] ttl ms, then pairs: ARGV[2k] task id, ARGV[2k+1] fencing token
-- Reply: {now_ms, code_1, value_1, code_2, value_2, ...} in argument order, where
--   code 1 = renewed (value = new deadline), 0 = gone, 2 = superseded (another token holds it),
--   3 = cancelled (value = the reason; the lease is still held but not extended).
-- A lease that no longer exists is never re-created: that would over-admit.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[1])
local out = {now}
local k = 0
for i = 2, #ARGV, 2 do
  k = k + 1
  local id, token = ARGV[i], ARGV[i + 1]
  local score = redis.call('ZSCORE', KEYS[1], id)
  local meta = redis.call('HGET', KEYS[2], id)
  local code, value = 0, 0
  if score and tonumber(score) <= now then
    -- Expired but not reaped yet: reap it now so it cannot be mistaken for a holder.
    redis.call('ZREM', KEYS[1], id)
    redis.call('HDEL', KEYS[2], id)
  elseif score and meta then
    local sep = string.find(meta, ':', 1, true)
    local cancelled = redis.call('GET', KEYS[2 + k])
    if string.sub(meta, 1, sep - 1) ~= token then
      code = 2
    elseif cancelled then
      code, value = 3, cancelled
    else
      value = math.max(tonumber(score), now + ttl)
      redis.call('ZADD', KEYS[1], 'XX', value, id)
      code = 1
    end
  end
  out[#out + 1] = code
  out[#out + 1] = value
end
return out
