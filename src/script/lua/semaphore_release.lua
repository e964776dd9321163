-- SEMAPHORE_RELEASE: gives back a gateway's in-flight permits of one semaphore (layout as
-- SEMAPHORE_ACQUIRE, Redisson's RPermitExpirableSemaphore): those whose requests ended. KEYS: 1 the
-- semaphore's name, 2 `{name}:timeout`, 3 `redisson_sc:{name}`. ARGV: 1 the publish command, 2... the
-- permits' ids (16 bytes each). A permit still held is removed and counted back to the free permits, and
-- the new count published (Redisson's release); one already reclaimed after its lease ended, or released,
-- is not there and changes nothing. Reply: the permits given back.
--@standalone
local ids = {}
for i = 2, #ARGV do ids[#ids + 1] = ARGV[i] end
if #ids == 0 then return 0 end
local removed = redis.call('zrem', KEYS[2], unpack(ids))
if removed > 0 then
  local value = redis.call('incrby', KEYS[1], removed)
  redis.call(ARGV[1], KEYS[3], value)
end
return removed
