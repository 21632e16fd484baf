-- leasehold protocol v1: acquire, for one or more task ids in order
-- Sent after common.lua, whose functions it uses (integer, refuse, check_types, check_epoch,
-- fence_in_force).
-- KEYS[1] leases (ZSET task id -> deadline ms)   KEYS[2] holders (HASH task id -> "token:acquired_ms")
-- KEYS[3] fence (STRING counter)   KEYS[4] epoch (HASH id, seq, detected_ms)   KEYS[5] quarantine (STRING, with a TTL)
-- KEYS[6] waiting (STRING, with a TTL: someone was refused lately)   KEYS[7] limit (HASH limit, version)
-- KEYS[7+k] the cancel marker of the k-th task id
-- ARGV[1] ttl ms   ARGV[2] limit   ARGV[3] the epoch the caller last saw, or ''   ARGV[4] limit version
-- ARGV[5] the highest seq the caller saw in that epoch, or 0
-- ARGV[6] the highest fencing token the caller has seen in this quota, in any epoch, or 0
-- ARGV[6+k] the k-th task id (at least one, at most 1000: more is refused before any write)
-- Reply: {epoch, now_ms, seq, then four values per task id, in argument order}:
--   1, token, acquired_ms, deadline_ms   acquired (a new admission)
--   2, token, acquired_ms, deadline_ms   held (this id already held a lease; extended)
--   0, earliest_deadline_ms, 0, 0        full
--   3, reason, 0, 0                      cancelled (a cancel marker exists)
--   4, quarantine_left_ms, 0, 0          quarantined after a detected dataset loss
--   5, stored_limit, stored_version, 0   limit mismatch (same version, another limit is stored)
-- Task ids are served in order: one call for k ids answers exactly what k calls in a row would
-- (a task id listed twice is answered `held` the second time).
-- Arguments are checked (common.lua) before anything is written.
local ttl = integer(ARGV[1], 1, MAX)
if not ttl then return refuse('ttl (ARGV[1])', ARGV[1]) end
local limit = integer(ARGV[2], 1, 1000000)
if not limit then return refuse('limit (ARGV[2])', ARGV[2]) end
local version = integer(ARGV[4], 0, MAX)
if not version then return refuse('limit version (ARGV[4])', ARGV[4]) end
if not integer(ARGV[5], 0, MAX) then return refuse('seq (ARGV[5])', ARGV[5]) end
if not integer(ARGV[6], 0, MAX) then return refuse('highest token (ARGV[6])', ARGV[6]) end
if #ARGV < 7 then return refuse('task ids (none given)', '') end
-- Bounded so that no call fails halfway, after its first writes, on Lua's stack.
if #ARGV > 6 + 1000 then return refuse('task ids (more than 1000)', #ARGV - 6) end
-- A foreign value in one of the quota's keys fails the call (WRONGTYPE) before anything is
-- written (common.lua): a full, quarantined or mismatched quota is answered without reading the
-- fence, and reaping and a new limit write before the leases and holders are read. The epoch is
-- read before anything is written.
local stored = check_types(KEYS[7])

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

-- Dataset loss (common.lua): the epoch in force, and whether this caller saw another.
local epoch, seq, stale = check_epoch(t, now, ttl, ARGV[3], ARGV[5], ARGV[6], nil)
local extended = false

-- Reap expired leases and their metadata; no janitor runs anywhere else.
local expired = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now)
if #expired > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
  for i = 1, #expired, 1000 do
    redis.call('HDEL', KEYS[2], unpack(expired, i, math.min(i + 999, #expired)))
  end
end

-- The limit is the quota's, not each caller's: a higher version replaces it (a deploy takes
-- effect at its first acquire, for everyone), a lower one is admitted against it (old workers
-- follow), and equal versions must agree or nothing new is admitted. A lower limit evicts
-- nobody: admissions stop until fewer than it are live.
local stored_limit, stored_version = tonumber(stored[1]), tonumber(stored[2])
local mismatch = false
if not stored_limit or not stored_version or version > stored_version then
  redis.call('HSET', KEYS[7], 'limit', ARGV[2], 'version', ARGV[4])
elseif version == stored_version and limit ~= stored_limit then
  mismatch = true
else
  limit = stored_limit
end

local n = #ARGV - 6
local ids = {unpack(ARGV, 7, 6 + n)}
local markers = redis.call('MGET', unpack(KEYS, 8, 7 + n))
local scores = redis.call('ZMSCORE', KEYS[1], unpack(ids))
local metas = {}
for k = 1, n do
  if scores[k] then
    metas = redis.call('HMGET', KEYS[2], unpack(ids))
    break
  end
end

-- Read once per call, when first needed, and kept up to date by this call's own writes.
local count, quarantine_left, fence, earliest
-- The latest expiry hint given to a refused task id, if any was refused.
local refused
-- Admissions are gathered and written once at the end.
local admitted, admitted_meta = {}, {}
local answered = {}

-- The earliest deadline of the live leases, this call's admissions included (not written yet:
-- they expire at now + ttl), read once and kept until an extension may change it.
local function earliest_hint()
  if not earliest then
    local lowest = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')[2]
    earliest = lowest and tonumber(lowest) or now + ttl
    if #admitted > 0 then earliest = math.min(earliest, now + ttl) end
  end
  return earliest
end

local out = {epoch, now, seq}
for k = 1, n do
  local id = ids[k]
  local code, a, b, c = 0, 0, 0, 0
  local first = answered[id]
  if first then
    -- Listed twice: the second attempt finds what the first one left. A refusal's hint is
    -- read again: a lease extended in between may have been the earliest.
    code, a, b, c = out[first], out[first + 1], out[first + 2], out[first + 3]
    if code == 1 then code = 2 end
    if code == 0 then
      a = earliest_hint()
      refused = math.max(refused or 0, a)
    end
  elseif markers[k] then
    -- A cancelled task is never admitted, nor extended.
    code, a = 3, markers[k]
  elseif scores[k] and metas[k] then
    local deadline = math.max(tonumber(scores[k]), now + ttl)
    redis.call('ZADD', KEYS[1], 'XX', deadline, id)
    extended = true
    -- The extended lease may have been the earliest: read the hint again when needed.
    earliest = nil
    local sep = string.find(metas[k], ':', 1, true)
    code, a, b, c = 2, tonumber(string.sub(metas[k], 1, sep - 1)), tonumber(string.sub(metas[k], sep + 1)), deadline
  else
    -- Half a lease (written from outside) is no lease: drop it so it neither holds a slot nor
    -- answers `held`. A stray holders field is overwritten by an admission, dropped otherwise.
    if scores[k] then
      redis.call('ZREM', KEYS[1], id)
      if count then count = count - 1 end
    end
    quarantine_left = quarantine_left or redis.call('PTTL', KEYS[5])
    count = count or redis.call('ZCARD', KEYS[1])
    if not mismatch and quarantine_left <= 0 and count < limit then
      -- A missing fence also goes above the highest token this caller saw.
      fence = (fence or fence_in_force(tonumber(ARGV[6]))) + 1
      if fence > MAX then
        -- 2^53 - 1 admissions: tokens could no longer be told apart. Nothing admitted yet is
        -- written; what this call changed before stays (reaping, the epoch, a new stored
        -- limit, held leases of earlier ids extended), all of it right as it is.
        return redis.error_reply('LEASEHOLD fencing tokens exhausted')
      end
      local deadline = now + ttl
      admitted[#admitted + 1] = deadline
      admitted[#admitted + 1] = id
      admitted_meta[#admitted_meta + 1] = id
      admitted_meta[#admitted_meta + 1] = string.format('%d:%d', fence, now)
      count = count + 1
      if earliest then earliest = math.min(earliest, deadline) end
      code, a, b, c = 1, fence, now, deadline
    else
      if not scores[k] then
        redis.call('HDEL', KEYS[2], id)
      end
      if mismatch then
        -- Told before the quarantine: waiting it out would not help.
        code, a, b = 5, stored_limit, stored_version
      elseif quarantine_left > 0 then
        code, a = 4, quarantine_left
      else
        code, a = 0, earliest_hint()
        refused = math.max(refused or 0, a)
      end
    end
  end
  answered[id] = answered[id] or #out + 1
  out[#out + 1] = code
  out[#out + 1] = a
  out[#out + 1] = b
  out[#out + 1] = c
end

if refused then
  -- Someone was refused and may wait: releases are announced while this marker lives. The
  -- refused caller retries by the earliest deadline, or within its own ttl, whichever is first,
  -- and that retry renews the marker; it is never shortened, so callers with another ttl
  -- cannot cut a waiter's marker short.
  local want = math.max(2 * ttl, refused - now + ttl)
  if redis.call('PTTL', KEYS[6]) < want then
    redis.call('SET', KEYS[6], '1', 'PX', want)
  end
end
if #admitted > 0 then
  -- Every key written here was checked at the start (a foreign value failed the call then).
  redis.call('HSET', KEYS[2], unpack(admitted_meta))
  redis.call('SET', KEYS[3], string.format('%d', fence))
  redis.call('ZADD', KEYS[1], unpack(admitted))
end
if extended or #admitted > 0 then
  out[3] = redis.call('HINCRBY', KEYS[4], 'seq', 1)
end
return out
