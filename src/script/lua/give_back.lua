-- GIVE_BACK: settles one permit member with giveBack: returns permits a request took and did not use (a
-- request an all-or-nothing rule set rejected after this limiter admitted it, keys in another hash slot),
-- or turns a reservation into its real cost (fewer permits go back, more are charged). ARGV: 1 random,
-- 2 granted, 3 used (permits), 4 early (ms), 5 (optional; empty or absent = random) the random bytes of
-- the member that stays. Documented in src/script/mod.rs (GIVE_BACK).
--@function names
--@function giveBack
local config = redis.call('hmget', KEYS[1], 'rate', 'type')
if config[1] == false or config[2] == false then
  return 0
end
local valueName, permitsName = names(KEYS, config[2])
return giveBack(valueName, permitsName, ARGV[1], ARGV[2], ARGV[3], ARGV[4], config[1], ARGV[5])
