-- Lua shared by every script (Lua 5.1 as embedded in Redis 7, with the `struct` library). Every script
-- takes the same five KEYS: config hash, value, client value, permits, client permits (one hash slot).
--
-- nowMs(arg): arg as ms since the epoch, or Redis's own TIME when arg is empty.
-- sumPermits(members): permits carried by permit members, struct.pack('Bc0I', #random, random, permits)
--   as Redisson 4.x writes them (16 random bytes; 8 for Redisson 3.17-3.20: 'Bc0' reads both).
-- names(type): the value and permits keys of a limiter type ('1' = per client).
-- keepAliveOrPersist(keepAlive): PEXPIRE of the hash, or PERSIST when keepAlive is 0 (a limiter
--   written without keep-alive never expires, even if it had a TTL before).
-- syncTtl(type): the value and permits keys take the hash's TTL (or none), so no key of a limiter
--   outlives its config: a plain SET drops a key's TTL, and a stale value key left behind an expired
--   limiter would skew the limiter re-created later.
-- trySetRate(...): HSETNX of the four config fields; when it creates the limiter, PEXPIRE of the hash
--   with the keep-alive and deletion of any value and permits keys left from an earlier life, so a new
--   limiter starts full; returns 1 if created.
-- updateRate(...): HSET of the config keeping state: a type change deletes all state; otherwise permits
--   outside the new window are dropped and value = max(0, rate - permits still in the window); then the
--   keep-alive is applied to every key.
-- (Full-line comments are stripped by build.rs: they are not sent to Redis.)
local function nowMs(arg)
  if arg ~= nil and arg ~= '' then return tonumber(arg) end
  local t = redis.call('time')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function sumPermits(members)
  local total = 0
  for _, member in ipairs(members) do
    local _, permits = struct.unpack('Bc0I', member)
    total = total + permits
  end
  return total
end
local function names(limiterType)
  if limiterType == '1' then return KEYS[3], KEYS[5] end
  return KEYS[2], KEYS[4]
end
local function keepAliveOrPersist(keepAlive)
  if tonumber(keepAlive) > 0 then
    redis.call('pexpire', KEYS[1], keepAlive)
  else
    redis.call('persist', KEYS[1])
  end
end
local function syncTtl(limiterType)
  local valueName, permitsName = names(limiterType)
  local ttl = redis.call('pttl', KEYS[1])
  if ttl > 0 then
    redis.call('pexpire', valueName, ttl)
    redis.call('pexpire', permitsName, ttl)
  else
    redis.call('persist', valueName)
    redis.call('persist', permitsName)
  end
end
local function trySetRate(rate, interval, limiterType, keepAlive)
  redis.call('hsetnx', KEYS[1], 'rate', rate)
  redis.call('hsetnx', KEYS[1], 'interval', interval)
  redis.call('hsetnx', KEYS[1], 'keepAliveTime', keepAlive)
  local created = redis.call('hsetnx', KEYS[1], 'type', limiterType)
  if created == 1 then
    if tonumber(keepAlive) > 0 then
      redis.call('pexpire', KEYS[1], keepAlive)
    end
    redis.call('del', KEYS[2], KEYS[3], KEYS[4], KEYS[5])
  end
  return created
end
local function updateRate(rate, interval, limiterType, keepAlive, now)
  local oldType = redis.call('hget', KEYS[1], 'type')
  redis.call('hset', KEYS[1], 'rate', rate, 'interval', interval, 'type', limiterType, 'keepAliveTime', keepAlive)
  if oldType ~= limiterType then
    redis.call('del', KEYS[2], KEYS[3], KEYS[4], KEYS[5])
  else
    local valueName, permitsName = names(limiterType)
    redis.call('zremrangebyscore', permitsName, 0, now - tonumber(interval))
    local used = sumPermits(redis.call('zrange', permitsName, 0, -1))
    redis.call('set', valueName, math.max(0, tonumber(rate) - used))
  end
  keepAliveOrPersist(keepAlive)
  syncTtl(limiterType)
end
local function isInitialized(config)
  return config[1] ~= false and config[2] ~= false and config[3] ~= false
end
