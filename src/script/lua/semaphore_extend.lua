-- SEMAPHORE_EXTEND: moves the lease's end of a gateway's in-flight permits of one or more semaphores
-- (layout as SEMAPHORE_ACQUIRE, Redisson's RPermitExpirableSemaphore), the gateway's tick doing it for every
-- permit it holds while their requests run, every semaphore of one destination in one call. KEYS, per
-- semaphore: 1 its name, 2 `{name}:timeout`, 3 `redisson_sc:{name}`. ARGV: 1 now (ms since the epoch),
-- 2 the publish command; then per semaphore: the leases' new end (ms since the epoch), the number of its
-- permits, and their ids. Permits whose lease ended are reclaimed first (as Redisson's updateLeaseTime
-- does), so a lease that ended is not revived; the others get the new end (`ZADD XX`: only a permit still
-- held). Reply: the permits whose lease moved.
--@standalone
local total = 0
local a = 3
for k = 1, #KEYS, 3 do
  local expired = redis.call('zrangebyscore', KEYS[k + 1], 0, ARGV[1])
  if #expired > 0 then
    redis.call('zrem', KEYS[k + 1], unpack(expired))
    local value = redis.call('incrby', KEYS[k], #expired)
    if value > 0 then redis.call(ARGV[2], KEYS[k + 2], value) end
  end
  local n = tonumber(ARGV[a + 1])
  if n > 0 then
    local scored = {}
    for i = a + 2, a + 1 + n do
      scored[#scored + 1] = ARGV[a]
      scored[#scored + 1] = ARGV[i]
    end
    total = total + redis.call('zadd', KEYS[k + 1], 'XX', 'CH', unpack(scored))
  end
  a = a + 2 + n
end
return total
