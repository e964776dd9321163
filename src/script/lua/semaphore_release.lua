-- SEMAPHORE_RELEASE: gives back a gateway's in-flight permits of one or more semaphores (layout as
-- SEMAPHORE_ACQUIRE, Redisson's RPermitExpirableSemaphore): those whose requests ended, every semaphore of
-- one destination in one call. KEYS, per semaphore: 1 its name, 2 `{name}:timeout`, 3 `redisson_sc:{name}`.
-- ARGV: 1 the publish command; then per semaphore: the number of its permits, and their ids (16 bytes
-- each). A permit still held is removed and counted back to the free permits, and the new count published
-- (Redisson's release); one already reclaimed after its lease ended, or released, is not there and changes
-- nothing. Reply: the permits given back.
--@standalone
local total = 0
local a = 2
for k = 1, #KEYS, 3 do
  local n = tonumber(ARGV[a])
  if n > 0 then
    local removed = redis.call('zrem', KEYS[k + 1], unpack(ARGV, a + 1, a + n))
    if removed > 0 then
      local value = redis.call('incrby', KEYS[k], removed)
      redis.call(ARGV[1], KEYS[k + 2], value)
      total = total + removed
    end
  end
  a = a + 1 + n
end
return total
