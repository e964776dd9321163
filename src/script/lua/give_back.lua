-- GIVE_BACK: settles one permit member with giveBack: returns permits a request took and did not use (a
-- request an all-or-nothing rule set rejected after this limiter admitted it, keys in another hash slot),
-- or turns a reservation into its real cost (fewer permits go back, more are charged). ARGV: 1 random,
-- 2 granted, 3 used (permits), 4 early (ms), 5 (optional; empty or absent = random) the random bytes of
-- the member that stays; 6-8 (optional) what the acquire that wrote the member knew: its score (ms), the
-- limiter's rate and type ('0' overall, '1' per client). With them the config hash is not read (a member
-- found is a member of that type's permits key; a limiter deleted or re-created since has none) and the
-- score is not looked up (giveBack's `score`). Documented in src/script/mod.rs (GIVE_BACK).
--@function names
--@function giveBack
local rate, limiterType = ARGV[7], ARGV[8]
if ARGV[6] == nil or ARGV[6] == '' then
  local config = redis.call('hmget', KEYS[1], 'rate', 'type')
  if config[1] == false or config[2] == false then
    return 0
  end
  rate, limiterType = config[1], config[2]
end
local valueName, permitsName = names(KEYS, limiterType)
return giveBack(valueName, permitsName, ARGV[1], ARGV[2], ARGV[3], ARGV[4], rate, ARGV[5], ARGV[6])
