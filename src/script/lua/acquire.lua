-- ACQUIRE: Redisson tryAcquire(permits), preceded by trySetRate when the limiter does not exist and,
-- with ARGV[8] = '1' (rate_source: config), by updateRate when Redis holds another config that the rule
-- itself wrote (the hash field erlRuleConfig records what the rule wrote: rate:interval:type:keepAlive).
-- Documented in src/script/mod.rs (ACQUIRE): arguments, replies.
--
-- Written for cost: the common path runs no Lua function of the prelude (the prelude is inlined only into
-- the cold branch that creates or updates a limiter), passes Redis the strings it already has (a Lua number
-- passed to redis.call is formatted with %.14g), and answers with one integer when the limiter's config is
-- the one sent: the permits left (acquired) or minus the delay (rejected; the delay is always >= 4).
--
-- ARGV: 1 now (ms; empty = Redis TIME), 2 the member's random bytes, 3 permits, 4 rate, 5 interval (ms),
-- 6 type ('2': a sliding window counter; '3': a calendar quota, 5 then its period's end), 7 keepAliveTime (ms; a
-- counter's slices; a calendar period's start), 8 '1' = apply 4-7 as rate_source: config; for a lease (rules with
-- `lease` only): 9 the most permits to lease, 10 the lease's age (ms), 11-14 the previous lease to settle
-- first (random, granted, used, ms its last use came before its expiry; 11 empty = none).
--
-- A lease takes up to ARGV[9] permits, never more than are free, in one member scored now + age: every use
-- of the lease happens at or before that score, so the window covers each use for at least the interval.
-- (The VM asks for what its last lease served, so one with little traffic holds little: src/lease.rs.)
local nowArg = ARGV[1]
local now
if nowArg == '' then
  local t = redis.call('time')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  nowArg = string.format('%d', now)
else
  now = tonumber(nowArg)
end
-- Type '2': a sliding window counter (ARGV 7 its slices), in one hash, KEYS[2] ({name}:counter); no config in Redis.
if ARGV[6] == '2' then
--@function counterWindow
--@function counterDelay
  local rate, interval, requested = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[3])
  if requested > rate then
    return {2, 0, 0, rate, interval, 0, 0, 0}
  end
  local sum, current, first, width, counts = counterWindow(KEYS[2], now, interval, tonumber(ARGV[7]))
  if sum + requested > rate then
    return -counterDelay(counts, first, current, width, interval, now, sum + requested - rate)
  end
  -- The expiry moves with a slice's first permits only: the hash then outlives its newest slice's window.
  if redis.call('hincrby', KEYS[2], string.format('%d', current), requested) == requested then
    redis.call('pexpire', KEYS[2], interval + width)
  end
  return rate - sum - requested
end
-- Type '3': a calendar quota, in the hash KEYS[2] ({name}:counter): one field per period, its start (ms,
-- ARGV 7), expiring at the period's end (ms, ARGV 5) and 1 s more (clocks that differ a little).
if ARGV[6] == '3' then
  local rate, requested, finish = tonumber(ARGV[4]), tonumber(ARGV[3]), tonumber(ARGV[5])
  if requested > rate then
    return {2, 0, 0, rate, finish - tonumber(ARGV[7]), 0, 0, 0}
  end
  local used = tonumber(redis.call('hget', KEYS[2], ARGV[7]) or '0')
  if used + requested > rate then
    return -(3 + math.max(0, finish - now))
  end
  if redis.call('hincrby', KEYS[2], ARGV[7], requested) == requested then
    redis.call('pexpireat', KEYS[2], finish + 1000)
  end
  return rate - used - requested
end
local config = redis.call('hmget', KEYS[1], 'rate', 'interval', 'type', 'keepAliveTime')
local change = 0
if config[1] == false or config[2] == false or config[3] == false
    or (ARGV[8] == '1' and (config[1] ~= ARGV[4] or config[2] ~= ARGV[5] or config[3] ~= ARGV[6]
        or (config[4] or '0') ~= ARGV[7])) then
--@prelude
  local wanted = ARGV[4] .. ':' .. ARGV[5] .. ':' .. ARGV[6] .. ':' .. ARGV[7]
  if not isInitialized(config) then
    change = trySetRate(KEYS, ARGV[4], ARGV[5], ARGV[6], ARGV[7])
    if change == 1 and ARGV[8] == '1' then
      redis.call('hset', KEYS[1], 'erlRuleConfig', wanted)
    end
  else
    local held = config[1] .. ':' .. config[2] .. ':' .. config[3] .. ':' .. (config[4] or '0')
    local record = redis.call('hget', KEYS[1], 'erlRuleConfig')
    if record == false or record == held then
      updateRate(KEYS, ARGV[4], ARGV[5], ARGV[6], ARGV[7], now)
      redis.call('hset', KEYS[1], 'erlRuleConfig', wanted)
      change = 2
    else
      change = 3
    end
  end
  if change == 1 or change == 2 then
    config = redis.call('hmget', KEYS[1], 'rate', 'interval', 'type', 'keepAliveTime')
  end
end
local rate = tonumber(config[1])
local interval = tonumber(config[2])
local valueName, permitsName = KEYS[2], KEYS[4]
if config[3] == '1' then
  valueName, permitsName = KEYS[3], KEYS[5]
end
local requested = tonumber(ARGV[3])
if requested > rate then
  return {2, 0, 0, rate, interval, tonumber(config[3]), change, 0}
end
local lease = tonumber(ARGV[9] or '0')
if lease > 0 and ARGV[11] ~= '' then
--@function giveBack
  giveBack(valueName, permitsName, ARGV[11], ARGV[12], ARGV[13], ARGV[14], rate)
end
-- `stale`: the value in Redis is not `value` yet (created, or permits released); it is written once, with
-- the permits this call takes already subtracted (one SET instead of SET then DECRBY: the same value).
local value = redis.call('get', valueName)
local stale = false
if value == false then
  value = rate
  stale = true
else
  value = tonumber(value)
  -- The clock guard: members leave `min(20, interval / 50)` ms after the window passed them (Redisson: at
  -- once). Another client's call stamped up to that much earlier than this one may reach Redis after it,
  -- and its window still counts them: freeing them now would let it admit over the rate (docs/redisson.md,
  -- "Clocks"). A refusal's delay waits for the guard too.
  local cutoff = string.format('%d', now - interval - math.min(20, math.floor(interval / 50)))
  local released = 0
  for _, member in ipairs(redis.call('zrangebyscore', permitsName, 0, cutoff)) do
    local _, permits = struct.unpack('Bc0I', member)
    released = released + permits
  end
  if released > 0 then
    redis.call('zremrangebyscore', permitsName, 0, cutoff)
    value = value + released
    if value > rate then
      value = rate
      for _, member in ipairs(redis.call('zrange', permitsName, 0, -1)) do
        local _, permits = struct.unpack('Bc0I', member)
        value = value - permits
      end
    end
    stale = true
  end
end
local code, amount, taken = 0, 0, 0
if value < requested then
  local oldest = redis.call('zrange', permitsName, 0, 0, 'withscores')[2]
  code, amount = 0, 3 + interval + math.min(20, math.floor(interval / 50)) - (now - (tonumber(oldest) or now))
else
  taken = requested
  local score = nowArg
  if lease > requested then
    taken = math.min(lease, value)
    if taken > requested then
      score = string.format('%d', now + tonumber(ARGV[10]))
    end
  elseif lease == 0 then
    -- Stamps in order: a call stamped before the newest member (another gateway's, sent a few ms later but
    -- run first) takes that member's score, so the window by scores never holds more than the rate.
    local newest = redis.call('zrange', permitsName, -1, -1, 'withscores')[2]
    if newest and tonumber(newest) > now then score = newest end
  end
  redis.call('zadd', permitsName, score, struct.pack('Bc0I', string.len(ARGV[2]), ARGV[2], taken))
  if stale then
    value = value - taken
    redis.call('set', valueName, string.format('%d', value))
    stale = false
  else
    value = redis.call('decrby', valueName, taken)
  end
  code, amount = 1, value
end
if stale then
  redis.call('set', valueName, string.format('%d', value))
end
local keepAlive = config[4]
if keepAlive and (tonumber(keepAlive) or 0) > 0 then
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
if change == 0 and config[1] == ARGV[4] and config[2] == ARGV[5] and config[3] == ARGV[6] then
  if code == 0 then
    return -amount
  elseif lease > 0 then
    return {amount, taken}
  end
  return amount
end
return {code, amount, value, rate, interval, tonumber(config[3]), change, taken}
