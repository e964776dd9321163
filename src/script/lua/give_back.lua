-- GIVE_BACK: returns permits a request took and did not use (a request an all-or-nothing rule set rejected
-- after this limiter admitted it, keys in another hash slot): giveBack of the member. Documented in
-- src/script/mod.rs (GIVE_BACK).
--@function names
--@function giveBack
local config = redis.call('hmget', KEYS[1], 'rate', 'type')
if config[1] == false or config[2] == false then
  return 0
end
local valueName, permitsName = names(KEYS, config[2])
return giveBack(valueName, permitsName, ARGV[1], ARGV[2], ARGV[3], ARGV[4], config[1])
