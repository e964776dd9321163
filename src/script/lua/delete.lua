return redis.call('del', KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5])
