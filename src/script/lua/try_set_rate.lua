return trySetRate(KEYS, ARGV[1], ARGV[2], ARGV[3], ARGV[4])
