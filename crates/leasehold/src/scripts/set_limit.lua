-- leasehold protocol v1: set_limit, the operator's change of a quota's stored limit
-- Sent after common.lua, whose functions it uses (integer, refuse).
-- KEYS[1] limit (HASH limit, version)
-- ARGV[1] limit   ARGV[2] version, or '' for one above the stored version (1 when none is stored)
-- Reply: {code, limit, version}: the limit in force after the call
--   1  stored: the call's limit and version replaced the stored ones (or none was stored)
--   0  kept: a higher version is stored, and stays (or '' was sent and the stored version is
--      already the largest, 2^53 - 1: there is no version above it)
--   5  mismatch: the same version is stored with another limit (as acquire's code 5)
-- Versions are compared as numbers; clients keep them at most 2^53 - 1, where doubles are exact.
-- Arguments are checked (common.lua) before anything is written.
local limit = integer(ARGV[1], 1, 1000000)
if not limit then return refuse('limit (ARGV[1])', ARGV[1]) end
if ARGV[2] ~= '' and not integer(ARGV[2], 0, MAX) then
  return refuse('limit version (ARGV[2])', ARGV[2])
end

local stored = redis.call('HMGET', KEYS[1], 'limit', 'version')
local stored_limit, stored_version = tonumber(stored[1]), tonumber(stored[2])
local version
if ARGV[2] == '' then
  if stored_version and stored_version >= MAX then
    if stored_limit then return {0, stored_limit, stored_version} end
    -- An incomplete key (written from outside) is replaced, within the range of versions.
    version = MAX
  else
    version = (stored_version or 0) + 1
  end
else
  version = tonumber(ARGV[2])
end
if not stored_limit or not stored_version or version > stored_version then
  redis.call('HSET', KEYS[1], 'limit', ARGV[1], 'version', string.format('%.0f', version))
  return {1, limit, version}
end
if version == stored_version and limit ~= stored_limit then
  return {5, stored_limit, stored_version}
end
return {0, stored_limit, stored_version}
