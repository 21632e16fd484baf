#!lua flags=no-writes
-- leasehold protocol v1: snapshot (read only)
-- KEYS[1] leases   KEYS[2] holders   KEYS[3] limit   KEYS[4] quarantine
-- Reply: {now_ms, stored_limit, stored_version, quarantine_left_ms, id_1, token_1, acquired_ms_1,
-- deadline_ms_1, id_2, ...}, live leases only, earliest deadline first; stored_limit 0 when none
-- is stored, quarantine_left_ms 0 when no quarantine is in force.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local stored = redis.call('HMGET', KEYS[3], 'limit', 'version')
local live = redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. now, '+inf', 'WITHSCORES')
local out = {now}
if stored[1] and stored[2] then
  out[2], out[3] = tonumber(stored[1]), tonumber(stored[2])
else
  out[2], out[3] = 0, 0
end
-- PTTL answers -2 (no key) or -1 (no TTL, never written so by the protocol): no quarantine.
-- As in acquire.lua, a key of another type there fails the call (WRONGTYPE) rather than
-- reading as a quarantine by its TTL.
local quarantine_left = redis.call('PTTL', KEYS[4])
if quarantine_left ~= -2 then redis.call('GET', KEYS[4]) end
out[4] = math.max(quarantine_left, 0)
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
