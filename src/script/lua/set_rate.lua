redis.call('hset', KEYS[1], 'rate', ARGV[1], 'interval', ARGV[2], 'type', ARGV[3], 'keepAliveTime', ARGV[4])
keepAliveOrPersist(KEYS, ARGV[4])
redis.call('del', KEYS[2], KEYS[3], KEYS[4], KEYS[5])
return 1
