-- leasehold protocol v1: renew (heartbeat) many leases in one call
-- Sent after common.lua, whose functions it uses (integer, refuse, check_types via check_epoch,
-- raise_fence).
-- KEYS[1] leases   KEYS[2] holders   KEYS[3] fence   KEYS[4] epoch   KEYS[5] quarantine
-- KEYS[6] limit   KEYS[6+k] cancel marker of the k-th task id
-- ARGV[1] ttl ms   ARGV[2] the epoch the renewed leases were last confirmed in, or ''
-- ARGV[3] the highest seq the caller saw in that epoch, or 0
-- ARGV[4] the highest fencing token the caller has seen in this quota, in any epoch, or 0
-- then at most 5000 pairs: ARGV[2k+3] task id, ARGV[2k+4] fencing token
-- Reply: {now_ms, epoch, seq, code_1, value_1, code_2, value_2, ...} in argument order, where
--   code 1 = renewed (value = new deadline), 0 = gone, 2 = superseded (another token holds it),
--   3 = cancelled (value = the reason; the lease is still held but not extended).
-- A lease that no longer exists is never re-created: that would over-admit. The one exception is
-- a caller from before a dataset loss, during the quarantine that loss started: its leases were
-- forgotten, not expired, and re-registering them is how the quota learns who still runs. Even
-- then only up to the stored limit: leases admitted before the loss was detected keep theirs.
-- Arguments are checked (common.lua) before anything is written.
local ttl = integer(ARGV[1], 1, MAX)
if not ttl then return refuse('ttl (ARGV[1])', ARGV[1]) end
if not integer(ARGV[3], 0, MAX) then return refuse('seq (ARGV[3])', ARGV[3]) end
if not integer(ARGV[4], 0, MAX) then return refuse('highest token (ARGV[4])', ARGV[4]) end
if #ARGV % 2 ~= 0 then return refuse('pairs (a task id without its token)', #ARGV) end
-- Bounded so that no call fails halfway, after a stale caller's epoch writes, on Lua's stack
-- (the cancel markers are read with one MGET).
if #ARGV > 4 + 2 * 5000 then return refuse('pairs (more than 5000)', (#ARGV - 4) / 2) end
for i = 6, #ARGV, 2 do
  if not integer(ARGV[i], 1, MAX) then return refuse('token (ARGV[' .. i .. '])', ARGV[i]) end
end

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

-- Dataset loss (common.lua): the epoch in force, and whether this caller saw another; a stale
-- caller raised the fence to every token it has seen.
local epoch, seq, stale = check_epoch(t, now, ttl, ARGV[2], ARGV[3], ARGV[4], KEYS[6])
-- The quarantine is read only here, by its TTL, and only by a stale call, which check_epoch
-- made fail (WRONGTYPE) if a key of another type is there.
local reregister = stale and redis.call('PTTL', KEYS[5]) > 0
-- Slots left for re-registered leases: nil while no limit is stored (it was lost too).
local room
if reregister then
  local limit = tonumber(redis.call('HGET', KEYS[6], 'limit'))
  room = limit and limit - redis.call('ZCOUNT', KEYS[1], '(' .. now, '+inf')
end

local out = {now, epoch, seq}
local changed = false
-- MGET, as in acquire.lua: a marker key of another type (written from outside) is no marker,
-- rather than an error that would fail every lease of the call.
local n = (#ARGV - 4) / 2
local markers = n > 0 and redis.call('MGET', unpack(KEYS, 7, 6 + n)) or {}
local k = 0
for i = 5, #ARGV, 2 do
  k = k + 1
  local id, token = ARGV[i], ARGV[i + 1]
  local score = redis.call('ZSCORE', KEYS[1], id)
  local meta = redis.call('HGET', KEYS[2], id)
  local cancelled = markers[k]
  local code, value = 0, 0
  if score and tonumber(score) <= now then
    -- Expired but not reaped yet: reap it now so it cannot be mistaken for a holder.
    redis.call('ZREM', KEYS[1], id)
    redis.call('HDEL', KEYS[2], id)
  elseif score and meta then
    local sep = string.find(meta, ':', 1, true)
    if string.sub(meta, 1, sep - 1) ~= token then
      code = 2
    elseif cancelled then
      code, value = 3, cancelled
    else
      value = math.max(tonumber(score), now + ttl)
      redis.call('ZADD', KEYS[1], 'XX', value, id)
      code = 1
      changed = true
    end
  elseif reregister and not score and not meta and (not room or room > 0) then
    if room then room = room - 1 end
    value = now + ttl
    redis.call('ZADD', KEYS[1], value, id)
    redis.call('HSET', KEYS[2], id, token .. ':' .. string.format('%d', now))
    -- Tokens issued after the loss must still exceed every token in use.
    raise_fence(tonumber(token))
    code = 1
    changed = true
    if cancelled then
      code, value = 3, cancelled
    end
  end
  out[#out + 1] = code
  out[#out + 1] = value
end
if changed then
  out[3] = redis.call('HINCRBY', KEYS[4], 'seq', 1)
end
return out
