-- SEMAPHORE_ACQUIRE: one in-flight permit of a semaphore shared with Redisson's RPermitExpirableSemaphore
-- (layout as Redisson 4.7.0 and 3.52.0 `RedissonPermitExpirableSemaphore`; docs/redisson.md, "Semaphores"),
-- taken by a gateway for one request, with a lease. KEYS: 1 the semaphore's name (the permits free, a
-- decimal string), 2 `{name}:timeout` (a sorted set: one member per permit held, its 16 id bytes, scored by
-- the lease's end in ms since the epoch), 3 `redisson_sc:{name}` (the channel Redisson's waiters listen
-- on). ARGV: 1 the semaphore's permits, set when it does not exist yet (Redisson's trySetPermits), 2 the
-- lease's end (ms since the epoch), 3 now (ms since the epoch, the caller's clock, as Redisson's client
-- passes its own), 4 the permit's id (16 bytes), 5 the publish command (`publish`, or `spublish` where
-- Redisson listens on sharded channels).
-- Permits whose lease ended are reclaimed first (all of them, as Redisson's availablePermits does; its
-- tryAcquire reclaims as many as it asks for), each back to the free count, the new count published.
-- Reply, a flat array of integers: {1, permits free after this one} when taken; {0, permits free, end of
-- the earliest lease (ms; -1 when no permit is held or the earliest has no lease)} when none is free.
--@standalone
local free = redis.call('get', KEYS[1])
if free == false then
  redis.call('set', KEYS[1], ARGV[1])
  redis.call(ARGV[5], KEYS[3], ARGV[1])
  free = ARGV[1]
end
free = tonumber(free)
local expired = redis.call('zrangebyscore', KEYS[2], 0, ARGV[3])
if #expired > 0 then
  redis.call('zrem', KEYS[2], unpack(expired))
  free = redis.call('incrby', KEYS[1], #expired)
  if free > 0 then redis.call(ARGV[5], KEYS[3], free) end
end
if free >= 1 then
  redis.call('decrby', KEYS[1], 1)
  redis.call('zadd', KEYS[2], ARGV[2], ARGV[4])
  local ttl = redis.call('pttl', KEYS[1])
  if ttl > 0 then redis.call('pexpire', KEYS[2], ttl) end
  return {1, free - 1}
end
-- The earliest end goes back as Redis wrote the score (a string of digits): webdis 0.1.x re-encodes an
-- integer reply above 2^31 wrongly (`$0` then its first digits), and a time in ms since the epoch is one.
local first = redis.call('zrange', KEYS[2], 0, 0, 'WITHSCORES')
local earliest = -1
if first[2] ~= nil and first[2] ~= '922337203685477' then earliest = first[2] end
return {0, free, earliest}
