#!lua flags=no-writes
-- leasehold protocol v1: snapshot (read only)
-- KEYS[1] leases   KEYS[2] holders
-- Reply: {now_ms, id_1, token_1, acquired_ms_1, deadline_ms_1, id_2, ...}, live leases only,
-- earliest deadline first.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local live = redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. now, '+inf', 'WITHSCORES')
local out = {now}
for i = 1, #live, 2 do
  local id = live[i]
  local meta = redis.call('HGET', KEYS[2], id)
  local token, acquired = 0, 0
  if meta then
    local sep = string.find(meta, ':', 1, true)
    token = tonumber(string.sub(meta, 1, sep - 1))
    acquired = tonumber(string.sub(meta, sep + 1))
  end
  out[#out + 1] = id
  out[#out + 1] = token
  out[#out + 1] = acquired
  out[#out + 1] = tonumber(live[i + 1])
end
return out
