-- ACQUIRE_ALL: the acquires of several rules of one request, all or nothing: every limiter is checked
-- first (creating or updating its config as ACQUIRE does, settling a previous lease, releasing what left
-- the window), and permits are taken only if every one admits. A request rejected by one rule takes no
-- permits from the others. A Redis error on one limiter's keys (say WRONGTYPE: its config key is not a
-- hash) is that limiter's alone: it answers code 4 and the error, and the others still decide. Documented in
-- src/script/mod.rs (ACQUIRE_ALL): arguments, replies.
--
-- KEYS: five per limiter, as every script takes them (config hash, value, client value, permits, client
-- permits). ARGV: 1 now (ms; empty = Redis TIME), 2 '1' = a limiter's error stops the others' charge (the
-- request fails closed), then 13 per limiter: the member's random bytes, permits, rate, interval (ms),
-- type ('2': a sliding window counter, '3': a calendar quota, in one hash, its second key, {name}:counter), keepAliveTime (ms; a counter's slices; a calendar quota's period start, its interval then the period's end), '1' = apply as rate_source: config, the most permits to lease (0 = no lease),
-- the lease's age (ms), and the previous lease to settle (random, granted, used, ms before its expiry of
-- its last use; random empty = none).
--
-- Written for clarity over speed (a request of one rule runs ACQUIRE, which inlines the same steps: its
-- release, keep-alive and trySetRate code is repeated here as functions on purpose): one function per step.
local PER_LIMITER = 13
local nowArg = ARGV[1]
local errorsStopCharge = ARGV[2] == '1'
local now
if nowArg == '' then
  local t = redis.call('time')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  nowArg = string.format('%d', now)
else
  now = tonumber(nowArg)
end

-- The limiter's config after trySetRate / updateRate as ACQUIRE applies them, and the change code.
local function resolveConfig(keys, a)
  local config = redis.call('hmget', keys[1], 'rate', 'interval', 'type', 'keepAliveTime')
  local rate, interval, limiterType, keepAlive = ARGV[a + 3], ARGV[a + 4], ARGV[a + 5], ARGV[a + 6]
  local wanted = rate .. ':' .. interval .. ':' .. limiterType .. ':' .. keepAlive
  local change = 0
  if not isInitialized(config) then
    change = trySetRate(keys, rate, interval, limiterType, keepAlive)
    if change == 1 and ARGV[a + 7] == '1' then
      redis.call('hset', keys[1], 'erlRuleConfig', wanted)
    end
  elseif ARGV[a + 7] == '1' and (config[1] ~= rate or config[2] ~= interval or config[3] ~= limiterType
      or (config[4] or '0') ~= keepAlive) then
    local held = config[1] .. ':' .. config[2] .. ':' .. config[3] .. ':' .. (config[4] or '0')
    local record = redis.call('hget', keys[1], 'erlRuleConfig')
    if record == false or record == held then
      updateRate(keys, rate, interval, limiterType, keepAlive, now)
      redis.call('hset', keys[1], 'erlRuleConfig', wanted)
      change = 2
    else
      change = 3
    end
  end
  if change == 1 or change == 2 then
    config = redis.call('hmget', keys[1], 'rate', 'interval', 'type', 'keepAliveTime')
  end
  return config, change
end

-- The permits free now: the value after releasing the permits that left the window (Redisson tryAcquire),
-- the window's start lagging `now` by the clock guard as ACQUIRE's does.
local function freePermits(valueName, permitsName, rate, interval, rateText)
  local value = redis.call('get', valueName)
  if value == false then
    redis.call('set', valueName, rateText)
    return rate
  end
  value = tonumber(value)
  local cutoff = string.format('%d', now - interval - math.min(20, math.floor(interval / 50)))
  local released = sumPermits(redis.call('zrangebyscore', permitsName, 0, cutoff))
  if released > 0 then
    redis.call('zremrangebyscore', permitsName, 0, cutoff)
    value = value + released
    if value > rate then
      value = rate - sumPermits(redis.call('zrange', permitsName, 0, -1))
    end
    redis.call('set', valueName, string.format('%d', value))
  end
  return value
end

-- Keep-alive as ACQUIRE refreshes it: the limiter's keys take keepAliveTime, or the hash's TTL.
local function refreshTtl(keys, keepAlive, valueName, permitsName)
  if keepAlive and (tonumber(keepAlive) or 0) > 0 then
    redis.call('pexpire', keys[1], keepAlive)
    redis.call('pexpire', valueName, keepAlive)
    redis.call('pexpire', permitsName, keepAlive)
  else
    local ttl = redis.call('pttl', keys[1])
    if ttl > 0 then
      redis.call('pexpire', valueName, ttl)
      redis.call('pexpire', permitsName, ttl)
    end
  end
end

-- The text of an error raised by redis.call inside pcall (a string, or a table with `err`).
local function errorText(err)
  if type(err) == 'table' then
    return tostring(err.err or err['err'] or 'error')
  end
  return tostring(err)
end

-- Check: every limiter, in order. Permits asked of one limiter by two rules are counted together.
local limiters = {}
local asked = {}
local everyOneAdmits = true
for i = 1, #KEYS / 5 do
  local keys = {KEYS[5 * i - 4], KEYS[5 * i - 3], KEYS[5 * i - 2], KEYS[5 * i - 1], KEYS[5 * i]}
  local a = 2 + PER_LIMITER * (i - 1)
  local limiter = {keys = keys, a = a, code = 1, amount = 0, value = 0, taken = 0, rate = 0, interval = 0,
                   limiterType = 0, change = 0, requested = tonumber(ARGV[a + 2])}
  local ok, err = pcall(function()
    if ARGV[a + 5] == '3' then
      -- A calendar quota: the field of its period (start ARGV a+6, end ARGV a+4), in keys[2] ({name}:counter).
      local rate, finish = tonumber(ARGV[a + 3]), tonumber(ARGV[a + 4])
      limiter.counter, limiter.rate, limiter.valueName = true, rate, keys[2]
      limiter.interval, limiter.field, limiter.expireAt = finish - tonumber(ARGV[a + 6]), ARGV[a + 6], finish + 1000
      local requested, before = limiter.requested, asked[keys[2]] or 0
      if requested + before > rate then
        limiter.code = 2
        everyOneAdmits = false
        return
      end
      local used = tonumber(redis.call('hget', keys[2], ARGV[a + 6]) or '0')
      limiter.value = rate - used
      if used + before + requested > rate then
        limiter.code, limiter.amount = 0, 3 + math.max(0, finish - now)
        everyOneAdmits = false
      else
        asked[keys[2]] = before + requested
      end
      return
    end
    if ARGV[a + 5] == '2' then
      -- A sliding window counter (ARGV a+6 its slices), in one hash, keys[2] ({name}:counter); no config in Redis.
      local rate, interval = tonumber(ARGV[a + 3]), tonumber(ARGV[a + 4])
      limiter.counter, limiter.rate, limiter.interval, limiter.valueName = true, rate, interval, keys[2]
      local requested, before = limiter.requested, asked[keys[2]] or 0
      if requested + before > rate then
        limiter.code = 2
        everyOneAdmits = false
        return
      end
      local sum, current, first, width, counts = counterWindow(keys[2], now, interval, tonumber(ARGV[a + 6]))
      limiter.value, limiter.current, limiter.width = rate - sum, current, width
      if sum + before + requested > rate then
        limiter.code = 0
        limiter.amount = counterDelay(counts, first, current, width, interval, now, sum + before + requested - rate)
        everyOneAdmits = false
      else
        asked[keys[2]] = before + requested
      end
      return
    end
    local config, change = resolveConfig(keys, a)
    local rate, interval = tonumber(config[1]), tonumber(config[2])
    local valueName, permitsName = names(keys, config[3])
    limiter.config, limiter.change, limiter.rate, limiter.interval = config, change, rate, interval
    limiter.limiterType, limiter.valueName, limiter.permitsName = tonumber(config[3]), valueName, permitsName
    local requested = limiter.requested
    if requested + (asked[valueName] or 0) > rate then
      -- More than the rate, alone or with the request's earlier rules on this limiter: no wait grants it.
      limiter.code = 2
      everyOneAdmits = false
      return
    end
    local lease = tonumber(ARGV[a + 8])
    if lease > 0 and ARGV[a + 10] ~= '' then
      giveBack(valueName, permitsName, ARGV[a + 10], ARGV[a + 11], ARGV[a + 12], ARGV[a + 13], rate)
    end
    -- `value` (the permits free, reported) and what is left of them for this rule after the request's
    -- earlier rules on the same limiter (checked).
    local value = freePermits(valueName, permitsName, rate, interval, config[1])
    limiter.value = value
    if value - (asked[valueName] or 0) < requested then
      local oldest = redis.call('zrange', permitsName, 0, 0, 'withscores')[2]
      limiter.code, limiter.amount = 0, 3 + interval + math.min(20, math.floor(interval / 50)) - (now - (tonumber(oldest) or now))
      everyOneAdmits = false
    else
      asked[valueName] = (asked[valueName] or 0) + requested
    end
  end)
  if not ok then
    limiter.code, limiter.error = 4, errorText(err)
    if errorsStopCharge then
      everyOneAdmits = false
    end
  end
  limiters[i] = limiter
end

-- Charge every limiter only if all admit. A lease takes only what the request's later rules on the same
-- limiter leave (`ahead`: permits those still need), so the value never goes below zero.
local charged = {}
for _, limiter in ipairs(limiters) do
  if limiter.code == 1 and everyOneAdmits and limiter.counter then
    local ok, err = pcall(function()
      charged[limiter.valueName] = (charged[limiter.valueName] or 0) + limiter.requested
      -- The expiry moves with a slice's (a period's) first permits only, as ACQUIRE's.
      local field = limiter.field or string.format('%d', limiter.current)
      if redis.call('hincrby', limiter.valueName, field, limiter.requested) == limiter.requested then
        if limiter.field then
          redis.call('pexpireat', limiter.valueName, limiter.expireAt)
        else
          redis.call('pexpire', limiter.valueName, limiter.interval + limiter.width)
        end
      end
      limiter.value = limiter.value - charged[limiter.valueName]
      limiter.amount, limiter.taken = limiter.value, limiter.requested
    end)
    if not ok then
      limiter.code, limiter.error = 4, errorText(err)
    end
  elseif limiter.code == 1 and everyOneAdmits then
    local ok, err = pcall(function()
      local a = limiter.a
      local value = tonumber(redis.call('get', limiter.valueName))
      local taken, score = limiter.requested, nowArg
      local lease = tonumber(ARGV[a + 8])
      local ahead = asked[limiter.valueName] - (charged[limiter.valueName] or 0) - limiter.requested
      if lease > taken then
        taken = math.max(limiter.requested, math.min(lease, value - ahead))
        if taken > limiter.requested then
          score = string.format('%d', now + tonumber(ARGV[a + 9]))
        end
      elseif lease == 0 then
        -- Stamps in order, as ACQUIRE does.
        local newest = redis.call('zrange', limiter.permitsName, -1, -1, 'withscores')[2]
        if newest and tonumber(newest) > now then score = newest end
      end
      charged[limiter.valueName] = (charged[limiter.valueName] or 0) + limiter.requested
      redis.call('zadd', limiter.permitsName, score, struct.pack('Bc0I', string.len(ARGV[a + 1]), ARGV[a + 1], taken))
      limiter.value = redis.call('decrby', limiter.valueName, taken)
      limiter.amount, limiter.taken = limiter.value, taken
    end)
    if not ok then
      limiter.code, limiter.error = 4, errorText(err)
    end
  elseif limiter.code == 1 then
    limiter.code, limiter.amount = 3, limiter.value
  elseif limiter.code == 0 then
    limiter.value = math.max(0, limiter.value)
  end
  if limiter.code ~= 4 and not limiter.counter then
    pcall(refreshTtl, limiter.keys, limiter.config[4], limiter.valueName, limiter.permitsName)
  end
end

-- Reply: 8 integers per limiter (zeros after code 4), then the error text of each limiter with code 4, in
-- order.
local reply = {}
for _, limiter in ipairs(limiters) do
  if limiter.code == 4 then
    for _, number in ipairs({4, 0, 0, 0, 0, 0, 0, 0}) do
      reply[#reply + 1] = number
    end
  else
    for _, number in ipairs({limiter.code, limiter.amount, limiter.value, limiter.rate, limiter.interval,
                             limiter.limiterType, limiter.change, limiter.taken}) do
      reply[#reply + 1] = number
    end
  end
end
for _, limiter in ipairs(limiters) do
  if limiter.code == 4 then
    reply[#reply + 1] = limiter.error
  end
end
return reply
