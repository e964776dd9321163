-- SEMAPHORE_EXTEND: moves the lease's end of a gateway's in-flight permits of one semaphore (layout as
-- SEMAPHORE_ACQUIRE, Redisson's RPermitExpirableSemaphore), the gateway's tick doing it for every permit it
-- holds while their requests run. KEYS: 1 the semaphore's name, 2 `{name}:timeout`, 3 `redisson_sc:{name}`.
-- ARGV: 1 the leases' new end (ms since the epoch), 2 now (ms since the epoch), 3 the publish command, 4...
-- the permits' ids. Permits whose lease ended are reclaimed first (as Redisson's updateLeaseTime does), so
-- a lease that ended is not revived; the others get the new end (`ZADD XX`: only a permit still held).
-- Reply: the permits whose lease moved.
--@standalone
local expired = redis.call('zrangebyscore', KEYS[2], 0, ARGV[2])
if #expired > 0 then
  redis.call('zrem', KEYS[2], unpack(expired))
  local value = redis.call('incrby', KEYS[1], #expired)
  if value > 0 then redis.call(ARGV[3], KEYS[3], value) end
end
local scored = {}
for i = 4, #ARGV do
  scored[#scored + 1] = ARGV[1]
  scored[#scored + 1] = ARGV[i]
end
if #scored == 0 then return 0 end
return redis.call('zadd', KEYS[2], 'XX', 'CH', unpack(scored))
