-- SEMAPHORE_ACQUIRE: in-flight permits of semaphores shared with Redisson's RPermitExpirableSemaphore
-- (layout as Redisson 4.7.0 and 3.52.0 `RedissonPermitExpirableSemaphore`; docs/redisson.md, "Semaphores"),
-- one per request, with a lease: the acquires of several requests in one call (coalesced as rate acquires
-- are), each run as if alone, in order. KEYS, per permit: 1 the semaphore's name (the permits free, a
-- decimal string), 2 `{name}:timeout` (a sorted set: one member per permit held, its 16 id bytes, scored by
-- the lease's end in ms since the epoch), 3 `redisson_sc:{name}` (the channel Redisson's waiters listen on).
-- ARGV: 1 now (ms since the epoch, the caller's clock, as Redisson's client passes its own), 2 the publish
-- command (`publish`, or `spublish` where Redisson listens on sharded channels); then per permit: the
-- semaphore's permits, set when it does not exist yet (Redisson's trySetPermits), the lease's end (ms since
-- the epoch), the permit's id (16 bytes).
-- Permits whose lease ended are reclaimed first (all of them, as Redisson's availablePermits does; its
-- tryAcquire reclaims as many as it asks for), each back to the free count, the new count published.
-- Reply, a flat array, three elements per permit: 1, the permits free after it, -1 when taken; 0, the
-- permits free, the end of the earliest lease (ms, a string of digits; -1 when no permit is held or the
-- earliest has no lease) when none was free. The end goes back as Redis wrote the score: webdis 0.1.x
-- re-encodes an integer reply above 2^31 wrongly (`$0` then its first digits), and such a time is one.
--@standalone
local reply = {}
local a = 3
for k = 1, #KEYS, 3 do
  local free = redis.call('get', KEYS[k])
  if free == false then
    redis.call('set', KEYS[k], ARGV[a])
    redis.call(ARGV[2], KEYS[k + 2], ARGV[a])
    free = ARGV[a]
  end
  free = tonumber(free)
  local expired = redis.call('zrangebyscore', KEYS[k + 1], 0, ARGV[1])
  if #expired > 0 then
    redis.call('zrem', KEYS[k + 1], unpack(expired))
    free = redis.call('incrby', KEYS[k], #expired)
    if free > 0 then redis.call(ARGV[2], KEYS[k + 2], free) end
  end
  if free >= 1 then
    redis.call('decrby', KEYS[k], 1)
    redis.call('zadd', KEYS[k + 1], ARGV[a + 1], ARGV[a + 2])
    local ttl = redis.call('pttl', KEYS[k])
    if ttl > 0 then redis.call('pexpire', KEYS[k + 1], ttl) end
    reply[#reply + 1] = 1
    reply[#reply + 1] = free - 1
    reply[#reply + 1] = -1
  else
    local first = redis.call('zrange', KEYS[k + 1], 0, 0, 'WITHSCORES')
    local earliest = -1
    if first[2] ~= nil and first[2] ~= '922337203685477' then earliest = first[2] end
    reply[#reply + 1] = 0
    reply[#reply + 1] = free
    reply[#reply + 1] = earliest
  end
  a = a + 3
end
return reply
