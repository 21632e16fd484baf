-- leasehold protocol v1: renew (heartbeat) many leases in one call
-- KEYS[1] leases   KEYS[2] holders   KEYS[3] fence   KEYS[4] epoch   KEYS[5] quarantine
-- KEYS[6] limit   KEYS[6+k] cancel marker of the k-th task id
-- ARGV[1] ttl ms   ARGV[2] the epoch the renewed leases were last confirmed in, or ''
-- ARGV[3] the highest seq the caller saw in that epoch, or 0
-- ARGV[4] the highest fencing token the caller has seen in this quota, in any epoch, or 0
-- then pairs: ARGV[2k+3] task id, ARGV[2k+4] fencing token
-- Reply: {now_ms, epoch, seq, code_1, value_1, code_2, value_2, ...} in argument order, where
--   code 1 = renewed (value = new deadline), 0 = gone, 2 = superseded (another token holds it),
--   3 = cancelled (value = the reason; the lease is still held but not extended).
-- A lease that no longer exists is never re-created: that would over-admit. The one exception is
-- a caller from before a dataset loss, during the quarantine that loss started: its leases were
-- forgotten, not expired, and re-registering them is how the quota learns who still runs. Even
-- then only up to the stored limit: leases admitted before the loss was detected keep theirs.
-- Arguments are checked before anything is written: a call with a malformed one (a foreign or
-- buggy client) fails with a `LEASEHOLD` error and changes nothing. Integers are plain decimal
-- (no sign, no leading zero, no exponent) up to 2^53 - 1, where Lua's doubles are exact.
-- The same checks are in acquire.lua: a script cannot call another, so keep them in step.
local function integer(v, least, most)
  if not v or #v > 16 or not string.match(v, '^%d+$') or (#v > 1 and string.byte(v) == 48) then
    return nil
  end
  local n = tonumber(v)
  if n < least or n > most then return nil end
  return n
end
local MAX = 9007199254740991
local function refuse(what, v)
  return redis.error_reply('LEASEHOLD invalid ' .. what .. ': ' .. string.format('%q', tostring(v)))
end
local ttl = integer(ARGV[1], 1, MAX)
if not ttl then return refuse('ttl (ARGV[1])', ARGV[1]) end
if not integer(ARGV[3], 0, MAX) then return refuse('seq (ARGV[3])', ARGV[3]) end
if not integer(ARGV[4], 0, MAX) then return refuse('highest token (ARGV[4])', ARGV[4]) end
if #ARGV % 2 ~= 0 then return refuse('pairs (a task id without its token)', #ARGV) end
for i = 6, #ARGV, 2 do
  if not integer(ARGV[i], 1, MAX) then return refuse('token (ARGV[' .. i .. '])', ARGV[i]) end
end

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

-- The epoch check is the same in acquire.lua: a script cannot call another, so keep both in step.
-- `<seconds>.<microseconds>` of an epoch id as two integers, nil for an id of another form.
local function stamp(id)
  local s, u = string.match(id or '', '^(%d+)%.(%d+)$')
  if s then return tonumber(s), tonumber(u) end
end
local function later(s1, u1, s2, u2)
  return s1 > s2 or (s1 == s2 and u1 > u2)
end
local sent = ARGV[2]
local mark = redis.call('HMGET', KEYS[4], 'id', 'seq')
local epoch, seq = mark[1], tonumber(mark[2]) or 0
local stale = sent ~= '' and sent ~= epoch
-- The store went back: the caller saw this epoch further along, or a later epoch than the
-- stored one (a copy from before an earlier loss came back). Ids are parsed only off the
-- common path, where the caller sends the stored id.
local went_back = sent == epoch and tonumber(ARGV[3]) > seq
if stale then
  local ss, su = stamp(sent)
  local es, eu = stamp(epoch)
  went_back = ss and es and later(ss, su, es, eu)
end
if went_back then
  epoch, stale = nil, true
  redis.call('HDEL', KEYS[4], 'detected_ms')
end
if not epoch then
  -- Later than the id the caller sent, so that ids only grow, even across servers whose clocks
  -- differ.
  local s, u = tonumber(t[1]), tonumber(t[2])
  local ss, su = stamp(sent)
  if ss and not later(s, u, ss, su) then
    s, u = ss, su + 1
    if u > 999999 then s, u = s + 1, 0 end
  end
  epoch, seq = string.format('%d.%d', s, u), 0
  redis.call('HSET', KEYS[4], 'id', epoch, 'seq', 0)
end
if stale and redis.call('HSETNX', KEYS[4], 'detected_ms', now) == 1 then
  redis.call('SET', KEYS[5], epoch, 'PX', ttl)
end
-- As in acquire.lua: tokens issued from now on exceed every token this caller has seen.
if stale and tonumber(ARGV[4]) > tonumber(redis.call('GET', KEYS[3]) or '0') then
  redis.call('SET', KEYS[3], ARGV[4])
end
-- The quarantine is read only here, by its TTL: as in acquire.lua, a key of another type there
-- fails the call (WRONGTYPE) instead of reading as a quarantine.
local function quarantined()
  local left = redis.call('PTTL', KEYS[5])
  if left ~= -2 then redis.call('GET', KEYS[5]) end
  return left > 0
end
local reregister = stale and quarantined()
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
    if tonumber(redis.call('GET', KEYS[3]) or '0') < tonumber(token) then
      redis.call('SET', KEYS[3], token)
    end
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
