local config = redis.call('hmget', KEYS[1], 'rate', 'interval', 'type')
if not isInitialized(config) then return 0 end
updateRate(KEYS, ARGV[1], ARGV[2], ARGV[3], ARGV[4], nowMs(ARGV[5]))
return 1
