-- Lua shared by every script (Lua 5.1 as embedded in Redis 7, with the `struct` library). Every script
-- takes the same five KEYS per limiter: config hash, value, client value, permits, client permits (one
-- hash slot); the functions take them as `keys` (ACQUIRE_ALL passes each limiter's five in turn).
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
-- giveBack(valueName, permitsName, random, granted, used, early, rate[, renamed[, score]]): settles the
--   permit member (random, granted): it becomes (renamed, used) scored `early` ms before it (renamed: the
--   random bytes of the member that stays; absent or empty: `random`; used 0: the member goes), and the
--   value changes by granted - used permits. Unused permits (used < granted) go back to the value, never
--   above `rate`; an excess (used > granted) is charged: value - (used - granted), even below zero (a
--   negative value rejects every acquire until enough permits left the window). So value + the permits of
--   the members stay what they were (but for that cap): value + sum(members in the window) = rate holds as
--   before. The value is SET with KEEPTTL, and only when it changes; a missing value key is left missing
--   (the window counts as full then). The member that stays is added before the old one goes, so the
--   permits key is never emptied and keeps its TTL (renamed bytes are unique: a reservation's random). How
--   a lease is settled, a rejected all-or-nothing request returns what it took, and a reservation becomes
--   what it really cost. Exact even if the window moved meanwhile: a member already released (it left the
--   window, its permits went back to the value) or unknown is not found and nothing changes. `score`: the
--   member's score as the acquire wrote it (ms; the gateway's clock), when the caller knows it: the member
--   that stays is added at score - early (ZADD NX) and the old one removed, and if it was not there the
--   added one goes again (1 command less than reading the score first); absent or empty: ZSCORE. A member
--   that only goes (used 0) is removed at once (ZREM answers whether it was there). Returns 1 if the member
--   was found, else 0.
-- counterWindow(hashName, now, interval, slices): a sliding window counter (rule `layout`
--   "sliding_window_counter"): one hash, one field per slice of interval / slices ms (the field: the slice's
--   index since the epoch; its value: the permits taken in it). Returns the permits of every slice that
--   overlaps the last interval, (now - interval, now], the current slice, the first slice counted, the slice
--   width and the counts by slice; slices before the first are deleted. Counting every overlapping slice
--   whole, a sliding window never holds more than the rate.
-- counterDelay(counts, first, current, width, interval, now, need): ms until `need` permits of the counted
--   slices leave the window (a slice stops being counted once its end is an interval old), plus 3 as
--   Redisson's delay has them (the gateway's local block ends 3 ms before a delay does).
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
local function names(keys, limiterType)
  if limiterType == '1' then return keys[3], keys[5] end
  return keys[2], keys[4]
end
local function keepAliveOrPersist(keys, keepAlive)
  if tonumber(keepAlive) > 0 then
    redis.call('pexpire', keys[1], keepAlive)
  else
    redis.call('persist', keys[1])
  end
end
local function syncTtl(keys, limiterType)
  local valueName, permitsName = names(keys, limiterType)
  local ttl = redis.call('pttl', keys[1])
  if ttl > 0 then
    redis.call('pexpire', valueName, ttl)
    redis.call('pexpire', permitsName, ttl)
  else
    redis.call('persist', valueName)
    redis.call('persist', permitsName)
  end
end
local function trySetRate(keys, rate, interval, limiterType, keepAlive)
  redis.call('hsetnx', keys[1], 'rate', rate)
  redis.call('hsetnx', keys[1], 'interval', interval)
  redis.call('hsetnx', keys[1], 'keepAliveTime', keepAlive)
  local created = redis.call('hsetnx', keys[1], 'type', limiterType)
  if created == 1 then
    if tonumber(keepAlive) > 0 then
      redis.call('pexpire', keys[1], keepAlive)
    end
    redis.call('del', keys[2], keys[3], keys[4], keys[5])
  end
  return created
end
local function updateRate(keys, rate, interval, limiterType, keepAlive, now)
  local oldType = redis.call('hget', keys[1], 'type')
  redis.call('hset', keys[1], 'rate', rate, 'interval', interval, 'type', limiterType, 'keepAliveTime', keepAlive)
  if oldType ~= limiterType then
    redis.call('del', keys[2], keys[3], keys[4], keys[5])
  else
    local valueName, permitsName = names(keys, limiterType)
    redis.call('zremrangebyscore', permitsName, 0, now - tonumber(interval))
    local used = sumPermits(redis.call('zrange', permitsName, 0, -1))
    redis.call('set', valueName, math.max(0, tonumber(rate) - used))
  end
  keepAliveOrPersist(keys, keepAlive)
  syncTtl(keys, limiterType)
end
local function isInitialized(config)
  return config[1] ~= false and config[2] ~= false and config[3] ~= false
end
local function giveBack(valueName, permitsName, random, granted, used, early, rate, renamed, score)
  local member = struct.pack('Bc0I', string.len(random), random, tonumber(granted))
  if tonumber(used) == 0 then
    if redis.call('zrem', permitsName, member) == 0 then return 0 end
  else
    local kept = random
    if renamed ~= nil and renamed ~= '' then kept = renamed end
    local settled = struct.pack('Bc0I', string.len(kept), kept, tonumber(used))
    if score ~= nil and score ~= '' and settled ~= member then
      local at = score
      if early ~= '0' then at = string.format('%d', tonumber(score) - tonumber(early)) end
      local added = redis.call('zadd', permitsName, 'NX', at, settled)
      if redis.call('zrem', permitsName, member) == 0 then
        if added == 1 then redis.call('zrem', permitsName, settled) end
        return 0
      end
    else
      local found = redis.call('zscore', permitsName, member)
      if found == false then return 0 end
      redis.call('zadd', permitsName, string.format('%d', tonumber(found) - tonumber(early)), settled)
      if settled ~= member then redis.call('zrem', permitsName, member) end
    end
  end
  local unused = tonumber(granted) - tonumber(used)
  if unused ~= 0 then
    local value = redis.call('get', valueName)
    if value ~= false then
      value = tonumber(value) + unused
      if unused > 0 then value = math.min(tonumber(rate), value) end
      redis.call('set', valueName, string.format('%d', value), 'keepttl')
    end
  end
  return 1
end
local function counterWindow(hashName, now, interval, slices)
  local width = math.max(1, math.floor(interval / slices))
  local current = math.floor(now / width)
  local first = math.floor((now - interval) / width)
  local fields = redis.call('hgetall', hashName)
  local counts, sum, stale = {}, 0, {}
  for i = 1, #fields, 2 do
    local slice = tonumber(fields[i])
    if slice < first then
      stale[#stale + 1] = fields[i]
    else
      local count = tonumber(fields[i + 1])
      counts[slice] = (counts[slice] or 0) + count
      sum = sum + count
    end
  end
  if #stale > 0 then
    redis.call('hdel', hashName, unpack(stale))
  end
  return sum, current, first, width, counts
end
local function counterDelay(counts, first, current, width, interval, now, need)
  local freed = 0
  local last = current
  for slice, _ in pairs(counts) do
    if slice > last then last = slice end
  end
  for slice = first, last do
    freed = freed + (counts[slice] or 0)
    if freed >= need then
      return 3 + (slice + 1) * width + interval - now
    end
  end
  return 3 + (last + 1) * width + interval - now
end
