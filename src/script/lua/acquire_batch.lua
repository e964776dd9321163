-- ACQUIRE_BATCH: the acquire calls of several requests in one script call (request coalescing,
-- docs/configuration.md, "Request coalescing"), or the settle calls of one tick. Each segment is one call
-- exactly as it would have been sent alone, ACQUIRE, ACQUIRE_ALL, GIVE_BACK or SEMAPHORE_ACQUIRE (an
-- in-flight permit) with its own KEYS and ARGV, run in arrival order, so each request is decided as if it
-- had been sent alone in that order. A Redis or script error in one segment is that segment's alone: the
-- others still run. Documented in src/script/mod.rs (ACQUIRE_BATCH).
--
-- KEYS: every segment's keys, segment after segment. ARGV: 1 the number of segments, then per segment:
-- its script ('1' ACQUIRE, '2' ACQUIRE_ALL, '3' GIVE_BACK, '4' SEMAPHORE_ACQUIRE), its number of keys, its
-- number of arguments, its arguments.
--
-- Reply, a flat array (webdis re-encodes nested arrays' integers and drops nils: keep it flat), per
-- segment: 1 and the integer of a bare integer reply; 2, n and the n elements of an array reply; 3 and the
-- error text of a failed segment: its first word the error code Redis would have answered the call alone
-- with (WRONGTYPE, OOM, ERR...), without the script name and line Redis appends to a script's error.
--@wrap acquire acquire
--@wrap acquireAll acquireAll
--@wrap giveBack settle
--@wrap semaphoreAcquire semaphoreAcquire
-- Out of memory (maxmemory, noeviction): Redis refuses a script's first write that may grow memory, but
-- none after a write went through, so one segment's write would let every later one write past maxmemory.
-- A write that changes nothing (ZADD XX of a member that is not there, on the first call's permits key)
-- asks first: refused, the whole batch is refused as each call alone would be.
-- A batch of one segment needs no probe: its first write is refused as the call alone would be.
if ARGV[1] ~= '1' then
  local probed, probeError = pcall(redis.call, 'zadd', KEYS[4], 'XX', '0', '')
  if not probed then
    local text = type(probeError) == 'table' and probeError.err or tostring(probeError)
    if string.find(text, 'OOM', 1, true) == 1 then
      return redis.error_reply(text)
    end
  end
end
local reply = {}
local k = 1
local a = 2
for _ = 1, tonumber(ARGV[1]) do
  local script, keyCount, argCount = ARGV[a], tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
  a = a + 3
  -- unpack copies in C (a Lua loop cost a few microseconds of Redis time per call).
  local keys = {unpack(KEYS, k, k + keyCount - 1)}
  local args = {unpack(ARGV, a, a + argCount - 1)}
  k = k + keyCount
  a = a + argCount
  local run = settle
  if script == '1' then
    run = acquire
  elseif script == '2' then
    run = acquireAll
  elseif script == '4' then
    run = semaphoreAcquire
  end
  local ok, result = pcall(run, keys, args)
  if ok and type(result) == 'table' and result.err == nil then
    reply[#reply + 1] = 2
    reply[#reply + 1] = #result
    for i = 1, #result do
      reply[#reply + 1] = result[i]
    end
  elseif ok and type(result) == 'number' then
    reply[#reply + 1] = 1
    reply[#reply + 1] = result
  else
    local text
    if type(result) == 'table' then
      text = result.err or 'ERR script error'
    else
      text = tostring(result)
      if not string.find(text, '^[A-Z][A-Z]+ ') then
        text = 'ERR ' .. text
      end
    end
    reply[#reply + 1] = 3
    reply[#reply + 1] = (string.gsub(text, '[\r\n]', ' '))
  end
end
return reply
