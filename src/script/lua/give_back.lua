-- GIVE_BACK: settles one permit member with giveBack: returns permits a request took and did not use (a
-- request an all-or-nothing rule set rejected after this limiter admitted it, keys in another hash slot),
-- or turns a reservation into its real cost (fewer permits go back, more are charged). ARGV: 1 random,
-- 2 granted, 3 used (permits), 4 early (ms), 5 (optional; empty or absent = random) the random bytes of
-- the member that stays; 6-8 (optional) what the acquire that wrote the member knew: its score (ms), the
-- limiter's rate and type ('0' overall, '1' per client; '2' a sliding window counter, then 9 its slice width). With them the config hash is not read (a member
-- found is a member of that type's permits key; a limiter deleted or re-created since has none) and the
-- score is not looked up (giveBack's `score`). Documented in src/script/mod.rs (GIVE_BACK).
--@function names
--@function giveBack
if ARGV[8] == '2' then
  -- A sliding window counter (ARGV 9 its slice width, ms): the permits are in the slice of the acquire's
  -- time (ARGV 6) of its hash, KEYS[2] ({name}:counter); used - granted goes into that slice while it is
  -- there (a slice deleted has left the window: nothing to settle), never below zero.
  local field = string.format('%d', math.floor(tonumber(ARGV[6]) / tonumber(ARGV[9])))
  local held = redis.call('hget', KEYS[2], field)
  if held == false then
    return 0
  end
  local delta = math.max(tonumber(ARGV[3]) - tonumber(ARGV[2]), -tonumber(held))
  if delta ~= 0 then
    redis.call('hincrby', KEYS[2], field, delta)
  end
  return 1
end
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
