local config = redis.call('hmget', KEYS[1], 'rate', 'interval', 'type')
if not isInitialized(config) then return redis.error_reply('RateLimiter is not initialized') end
local valueName, permitsName = names(KEYS, config[3])
local value = redis.call('get', valueName)
if value == false then
  redis.call('set', valueName, config[1])
  syncTtl(KEYS, config[3])
  return tonumber(config[1])
end
local now = nowMs(ARGV[1])
local released = sumPermits(redis.call('zrangebyscore', permitsName, 0, now - tonumber(config[2])))
if released > 0 then
  redis.call('zremrangebyscore', permitsName, 0, now - tonumber(config[2]))
  value = tonumber(value) + released
  redis.call('set', valueName, value)
  syncTtl(KEYS, config[3])
end
return tonumber(value)
