-- leasehold protocol v1: common.lua, the functions acquire.lua, renew.lua and set_limit.lua share.
-- A script cannot call another, so each of the three is sent to Redis as this file followed by
-- the script's own file, in one `EVAL`/`SCRIPT LOAD` body (PROTOCOL.md §5). Defines locals only.

-- Arguments are checked before anything is written: a call with a malformed one (a foreign or
-- buggy client) fails with a `LEASEHOLD` error and changes nothing. Integers are plain decimal
-- (no sign, no leading zero, no exponent) up to 2^53 - 1, where Lua's doubles are exact.
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

-- `<seconds>.<microseconds>` of an epoch id as two integers, nil for an id of another form.
local function stamp(id)
  local s, u = string.match(id or '', '^(%d+)%.(%d+)$')
  if s then return tonumber(s), tonumber(u) end
end
local function later(s1, u1, s2, u2)
  return s1 > s2 or (s1 == s2 and u1 > u2)
end

-- The keys acquire and renew share (KEYS[1] leases, KEYS[2] holders, KEYS[3] fence, KEYS[5]
-- quarantine) and the quota's `limit_key`: a foreign value in one of them fails the call here
-- (WRONGTYPE), before it writes anything, rather than halfway, or never (the quarantine is read
-- by its TTL, which a key of any type has); so does a fence that holds no token (a `LEASEHOLD`
-- error). Only commands the least-privilege ACL of the README
-- grants. Returns the stored limit and version (HMGET), which acquire needs anyway.
local function check_types(limit_key)
  -- A string that is no token in the fence would fail the first admission's arithmetic, after
  -- the reaping and the limit were written.
  local fence = redis.call('GET', KEYS[3])
  if fence and not integer(fence, 0, MAX) then
    error({err = 'LEASEHOLD foreign value in ' .. KEYS[3] .. ': ' .. string.format('%q', string.sub(fence, 1, 64)) .. ' is no fencing token'})
  end
  redis.call('GET', KEYS[5])
  redis.call('ZCARD', KEYS[1])
  redis.call('HGET', KEYS[2], '')
  return redis.call('HMGET', limit_key, 'limit', 'version')
end

-- The fence in force (PROTOCOL.md §5.2 step 8), and whether it is stored: the counter, or when
-- it is missing, the highest of `floor` (a token the caller knows of) and the tokens among the
-- holders' values (the fence was lost without the holders: an eviction, a DEL), so that no new
-- token repeats one in use. `holders` is read only if it exists: not for a new quota.
local function fence_in_force(floor)
  local stored = redis.call('GET', KEYS[3])
  if stored then return tonumber(stored), true end
  local highest = floor
  if redis.call('EXISTS', KEYS[2]) == 1 then
    for _, meta in ipairs(redis.call('HVALS', KEYS[2])) do
      local sep = string.find(meta, ':', 1, true)
      local token = sep and integer(string.sub(meta, 1, sep - 1), 1, MAX)
      if token and token > highest then highest = token end
    end
  end
  return highest, false
end

-- Raises the fence to at least `token` (an integer); stores the fence in force if it is missing.
local function raise_fence(token)
  local fence, stored = fence_in_force(token)
  if token > fence or not stored then
    redis.call('SET', KEYS[3], string.format('%d', math.max(fence, token)))
  end
end

-- Dataset loss (PROTOCOL.md §5.2 step 1, §8), for acquire and renew, whose KEYS[3], KEYS[4] and
-- KEYS[5] are the fence, the epoch and the quarantine. A caller that saw another epoch (or one
-- that vanished) proves the quota's state was lost while leases may still run. Admissions pause
-- for one ttl, once per epoch. A caller that saw this epoch at a higher seq than stored proves a
-- partial loss (a failover to a lagging replica, an older copy restored): a new epoch makes it a
-- loss like any other. `seq` counts the calls that changed a lease, so that losing only refusals
-- quarantines nobody.
-- `t` is this call's TIME and `now` it in ms; `sent`, `sent_seq` and `highest_token` are the
-- epoch id the caller saw (or ''), the highest seq it saw in it and the highest fencing token it
-- saw in this quota (checked arguments); `unchecked_limit_key` is the quota's limit key when the
-- caller has not run check_types yet (renew: it needs the check only when this call writes),
-- nil when it has (acquire). Returns the epoch id in force, its stored seq, and whether the
-- call is stale.
local function check_epoch(t, now, ttl, sent, sent_seq, highest_token, unchecked_limit_key)
  local mark = redis.call('HMGET', KEYS[4], 'id', 'seq')
  local epoch, seq = mark[1], tonumber(mark[2]) or 0
  local stale = sent ~= '' and sent ~= epoch
  -- The store went back: the caller saw this epoch further along, or a later epoch than the
  -- stored one (a copy from before an earlier loss came back). Ids are parsed only off the
  -- common path, where the caller sends the stored id.
  local went_back = sent == epoch and tonumber(sent_seq) > seq
  if stale then
    local ss, su = stamp(sent)
    local es, eu = stamp(epoch)
    went_back = ss and es and later(ss, su, es, eu)
  end
  if unchecked_limit_key and (stale or went_back or not epoch) then
    -- This call writes below, and reads the other keys after that.
    check_types(unchecked_limit_key)
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
  -- A caller from before the loss raises the fence to the highest token it has seen, so that
  -- the tokens issued from now on exceed those too, not only the re-registered ones (a holder
  -- that finished before the loss never re-registers its token).
  if stale then
    raise_fence(tonumber(highest_token))
  end
  return epoch, seq, stale
end

