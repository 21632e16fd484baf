-- leasehold protocol v1: cancel a task, held or not
-- KEYS[1] leases   KEYS[2] the task's cancel marker
-- ARGV[1] task id   ARGV[2] reason   ARGV[3] marker ttl ms   ARGV[4] channel
-- Reply: {1} if the task held a live lease, {0} otherwise (it may be queued or not started).
-- The marker is written before the message: it is the truth, which acquire and renew read. The
-- message only makes the cancel fast; it may be lost. The lease is read first, so that a foreign
-- value in `leases` fails the call (WRONGTYPE) before the marker is written.
-- A marker ttl other than a plain decimal integer from 1 to 2^53 - 1 fails with a `LEASEHOLD`
-- error before anything is written (§2).
local ttl = ARGV[3] or ''
if #ARGV ~= 4 or #ttl > 16 or not string.match(ttl, '^[1-9]%d*$') or tonumber(ttl) > 9007199254740991 then
  return redis.error_reply('LEASEHOLD invalid marker ttl (ARGV[3]) or argument count: ' .. string.format('%q', ttl) .. ', ' .. #ARGV .. ' arguments')
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local id = ARGV[1]
local score = redis.call('ZSCORE', KEYS[1], id)
redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[3])
-- pcall: a refused PUBLISH (an ACL without this channel) must not fail a cancel already written.
redis.pcall('PUBLISH', ARGV[4], 'cancelled:' .. string.len(id) .. ':' .. id .. ':' .. ARGV[2])
if score and tonumber(score) > now then
  return {1}
end
return {0}
