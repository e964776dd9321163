-- ACQUIRE: Redisson tryAcquire(permits), preceded by trySetRate when the limiter does not exist and,
-- with ARGV[8] = '1' (rate_source: config), by updateRate when Redis holds another config that the rule
-- itself wrote (the hash field erlRuleConfig records what the rule wrote: rate:interval:type:keepAlive).
-- Documented in src/script/mod.rs (ACQUIRE).
local config = redis.call('hmget', KEYS[1], 'rate', 'interval', 'type', 'keepAliveTime', 'erlRuleConfig')
local now = nowMs(ARGV[2])
local change = 0
if not isInitialized(config) then
  change = trySetRate(ARGV[4], ARGV[5], ARGV[6], ARGV[7])
  if change == 1 and ARGV[8] == '1' then
    redis.call('hset', KEYS[1], 'erlRuleConfig', ARGV[4] .. ':' .. ARGV[5] .. ':' .. ARGV[6] .. ':' .. ARGV[7])
  end
elseif ARGV[8] == '1' then
  local held = config[1] .. ':' .. config[2] .. ':' .. config[3] .. ':' .. (config[4] or '0')
  local wanted = ARGV[4] .. ':' .. ARGV[5] .. ':' .. ARGV[6] .. ':' .. ARGV[7]
  if held ~= wanted then
    if config[5] == false or config[5] == held then
      updateRate(ARGV[4], ARGV[5], ARGV[6], ARGV[7], now)
      redis.call('hset', KEYS[1], 'erlRuleConfig', wanted)
      change = 2
    else
      change = 3
    end
  end
end
if change == 1 or change == 2 then
  config = redis.call('hmget', KEYS[1], 'rate', 'interval', 'type', 'keepAliveTime')
end
local rate = tonumber(config[1])
local interval = tonumber(config[2])
local keepAlive = tonumber(config[4]) or 0
local valueName, permitsName = names(config[3])
local requested = tonumber(ARGV[1])
if requested > rate then
  return {2, 0, 0, rate, interval, tonumber(config[3]), change}
end
local value = redis.call('get', valueName)
if value == false then
  redis.call('set', valueName, rate)
  value = rate
else
  value = tonumber(value)
  local released = sumPermits(redis.call('zrangebyscore', permitsName, 0, now - interval))
  if released > 0 then
    redis.call('zremrangebyscore', permitsName, 0, now - interval)
    if value + released > rate then
      value = rate - sumPermits(redis.call('zrange', permitsName, 0, -1))
    else
      value = value + released
    end
    redis.call('set', valueName, value)
  end
end
local oldest = redis.call('zrange', permitsName, 0, 0, 'withscores')
local oldestScore = oldest[2] and tonumber(oldest[2])
local code, amount = 0, 0
if value < requested then
  amount = 3 + interval - (now - (oldestScore or now))
else
  redis.call('zadd', permitsName, now, struct.pack('Bc0I', string.len(ARGV[3]), ARGV[3], requested))
  amount = redis.call('decrby', valueName, requested)
  code = 1
  oldestScore = math.min(oldestScore or now, now)
end
local reset = 0
if oldestScore then
  reset = math.max(0, oldestScore + interval - now)
end
if keepAlive > 0 then
  redis.call('pexpire', KEYS[1], keepAlive)
  redis.call('pexpire', valueName, keepAlive)
  redis.call('pexpire', permitsName, keepAlive)
else
  local ttl = redis.call('pttl', KEYS[1])
  if ttl > 0 then
    redis.call('pexpire', valueName, ttl)
    redis.call('pexpire', permitsName, ttl)
  end
end
return {code, amount, reset, rate, interval, tonumber(config[3]), change}
