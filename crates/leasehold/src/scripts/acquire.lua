-- leasehold protocol v1: acquire
-- KEYS[1] leases (ZSET task id -> deadline ms)   KEYS[2] holders (HASH task id -> "token:acquired_ms")
-- KEYS[3] fence (STRING counter)   KEYS[4] this task's cancel marker (STRING reason)
-- KEYS[5] epoch (HASH id, detected)   KEYS[6] quarantine (STRING, with a TTL)
-- ARGV[1] task id   ARGV[2] ttl ms   ARGV[3] limit   ARGV[4] the epoch the caller last saw, or ''
-- Reply (epoch = the quota's current epoch id):
--   {1, epoch, token, acquired_ms, deadline_ms, now_ms}  acquired (a new admission)
--   {2, epoch, token, acquired_ms, deadline_ms, now_ms}  held (this id already held a lease; extended)
--   {0, epoch, earliest_deadline_ms, now_ms}             full
--   {3, epoch, reason}                                   cancelled (a cancel marker exists)
--   {4, epoch, quarantine_left_ms, now_ms}               quarantined after a detected dataset loss
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local id = ARGV[1]
local ttl = tonumber(ARGV[2])
local limit = tonumber(ARGV[3])

-- Dataset loss: a caller that saw another epoch (or one that vanished) proves the quota's state
-- was lost while leases may still run. Admissions pause for one ttl, once per epoch.
-- The epoch check is the same in renew.lua: a script cannot call another, so keep both in step.
local epoch = redis.call('HGET', KEYS[5], 'id')
local stale = ARGV[4] ~= '' and ARGV[4] ~= epoch
if not epoch then
  epoch = t[1] .. '.' .. t[2]
  redis.call('HSET', KEYS[5], 'id', epoch)
end
if stale and redis.call('HSETNX', KEYS[5], 'detected_ms', now) == 1 then
  redis.call('SET', KEYS[6], epoch, 'PX', ttl)
end

-- A cancelled task is never admitted, nor extended.
local cancelled = redis.call('GET', KEYS[4])
if cancelled then
  return {3, epoch, cancelled}
end

-- Reap expired leases and their metadata; no janitor runs anywhere else.
local expired = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now)
if #expired > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
  for i = 1, #expired, 1000 do
    redis.call('HDEL', KEYS[2], unpack(expired, i, math.min(i + 999, #expired)))
  end
end

local score = redis.call('ZSCORE', KEYS[1], id)
local meta = redis.call('HGET', KEYS[2], id)
if score and meta then
  local deadline = math.max(tonumber(score), now + ttl)
  redis.call('ZADD', KEYS[1], 'XX', deadline, id)
  local sep = string.find(meta, ':', 1, true)
  return {2, epoch, tonumber(string.sub(meta, 1, sep - 1)), tonumber(string.sub(meta, sep + 1)), deadline, now}
end
-- Half a lease (written from outside): drop it so it neither holds a slot nor answers `held`.
if score then
  redis.call('ZREM', KEYS[1], id)
elseif meta then
  redis.call('HDEL', KEYS[2], id)
end

local quarantine_left = redis.call('PTTL', KEYS[6])
if quarantine_left > 0 then
  return {4, epoch, quarantine_left, now}
end

if redis.call('ZCARD', KEYS[1]) < limit then
  local token = redis.call('INCR', KEYS[3])
  local deadline = now + ttl
  redis.call('ZADD', KEYS[1], deadline, id)
  redis.call('HSET', KEYS[2], id, string.format('%d:%d', token, now))
  return {1, epoch, token, now, deadline, now}
end

local first = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
return {0, epoch, tonumber(first[2]), now}
