-- leasehold protocol v1: cancel a task, held or not
-- Sent after common.lua, whose functions it uses (integer, refuse).
-- KEYS[1] leases   KEYS[2] the task's cancel marker
-- ARGV[1] task id   ARGV[2] reason   ARGV[3] marker ttl ms   ARGV[4] channel
-- Reply: {1} if the task held a live lease, {0} otherwise (it may be queued or not started).
-- The marker is written before the message: it is the truth, which acquire and renew read. The
-- message only makes the cancel fast; it may be lost. The lease is read first, so that a foreign
-- value in `leases` fails the call (WRONGTYPE) before the marker is written.
-- Arguments are checked (common.lua) before anything is written.
if #ARGV ~= 4 then return refuse('argument count (want 4)', #ARGV) end
if not integer(ARGV[3], 1, MAX) then return refuse('marker ttl (ARGV[3])', ARGV[3]) end
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
