-- ACQUIRE_BATCH: the acquire calls of several requests in one script call (request coalescing,
-- docs/configuration.md, "Request coalescing"), or the settle calls of one tick. Each segment is one call
-- exactly as it would have been sent alone, ACQUIRE, ACQUIRE_ALL, GIVE_BACK, SEMAPHORE_ACQUIRE (an
-- in-flight permit) or SEMAPHORE_RELEASE (permits given back, riding with the acquires) with its own KEYS
-- and ARGV, run in arrival order, so each request is decided as if it
-- had been sent alone in that order. A Redis or script error in one segment is that segment's alone: the
-- others still run. Documented in src/script/mod.rs (ACQUIRE_BATCH).
--
-- KEYS: every segment's keys, segment after segment. ARGV: 1 the number of segments, then per segment:
-- its script ('1' ACQUIRE, '2' ACQUIRE_ALL, '3' GIVE_BACK, '4' SEMAPHORE_ACQUIRE, a gate's '5', '6', '7',
-- or '8' SEMAPHORE_RELEASE), its number of keys, its number of arguments, its arguments.
--
-- A gate joins a request's in-flight permits and its rate acquire in one batch (docs/configuration.md,
-- "In-flight limits"): '5' is a SEMAPHORE_ACQUIRE that gates the next segment, '6' and '7' an ACQUIRE and
-- an ACQUIRE_ALL gated by the '5's right before them. A '5' refused closes the gate: the '5's and the '6'
-- or '7' after it are skipped, each answering the error SKIPPED, so a request refused by an in-flight rule
-- takes nothing of its later permits nor of its rates. A '5' that fails (an error) leaves the gate as it
-- was: its request follows its failure mode with what the others took. Any segment but a '5' opens the
-- gate again.
--
-- Reply, a flat array (webdis re-encodes nested arrays' integers and drops nils: keep it flat), per
-- segment: 1 and the integer of a bare integer reply; 2, n and the n elements of an array reply; 3 and the
-- error text of a failed segment: its first word the error code Redis would have answered the call alone
-- with (WRONGTYPE, OOM, ERR...), without the script name and line Redis appends to a script's error.
--@wrap acquire acquire
--@wrap acquireAll acquireAll
--@wrap giveBack settle
--@wrap semaphoreAcquire semaphoreAcquire
--@wrap semaphoreRelease semaphoreRelease
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
local open = true
for _ = 1, tonumber(ARGV[1]) do
  local script, keyCount, argCount = ARGV[a], tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
  a = a + 3
  local skip = not open and (script == '5' or script == '6' or script == '7')
  if script ~= '5' then open = true end
  local ok, result = false, {err = 'SKIPPED a permit of the request was not taken'}
  if not skip then
    local run = settle
    if script == '1' or script == '6' then
      run = acquire
    elseif script == '2' or script == '7' then
      run = acquireAll
    elseif script == '4' or script == '5' then
      run = semaphoreAcquire
    elseif script == '8' then
      run = semaphoreRelease
    end
    -- unpack copies in C (a Lua loop cost a few microseconds of Redis time per call).
    ok, result = pcall(run, {unpack(KEYS, k, k + keyCount - 1)}, {unpack(ARGV, a, a + argCount - 1)})
  end
  k = k + keyCount
  a = a + argCount
  if script == '5' and ok and type(result) == 'table' and result[1] == 0 then open = false end
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
