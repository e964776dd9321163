"""An independent Redisson-compatible `RRateLimiter` client: the Java side of the interop tests, in Python.

Written from DESIGN.md ("Facts: Redisson's RRateLimiter layout") and Redisson's own scripts as quoted in
`/work/shared/seeds/` (3.x/4.x `tryAcquire` with `struct.pack('Bc0I', ...)`), and nothing else: it shares no
code with the filter's scripts (`src/script.rs`), so when both enforce one limiter correctly, the layout
really is the documented one and not merely one both sides agree on by construction.

Like a Redisson instance, a client has its own id (a random UUID, used for the PER_CLIENT keys) and its
own clock (`now_ms`, epoch ms, injectable for tests). Each operation is one Lua script, run with EVALSHA
(redis-py loads it with EVAL on NOSCRIPT):

    KEYS  1 config hash `N`, 2 `{N}:value`, 3 `{N}:value:<id>`, 4 `{N}:permits`, 5 `{N}:permits:<id>`

Permit members are Redisson 4.x's 21 bytes: `struct.pack('Bc0I', 16, random, permits)`.
"""

from __future__ import annotations

import os
import time
import uuid
from typing import Callable, NamedTuple

import redis as redis_py

OVERALL = 0
PER_CLIENT = 1

# Shared opening of the acquire-side scripts: the config (asserted present, as Redisson does) and the value
# and permits keys of the limiter's type.
_CONFIG = """
local rate = redis.call('hget', KEYS[1], 'rate')
local interval = redis.call('hget', KEYS[1], 'interval')
local type = redis.call('hget', KEYS[1], 'type')
assert(rate ~= false and interval ~= false and type ~= false, 'RateLimiter is not initialized')
rate = tonumber(rate)
interval = tonumber(interval)
local keepAlive = tonumber(redis.call('hget', KEYS[1], 'keepAliveTime') or '0') or 0
local valueName = KEYS[2]
local permitsName = KEYS[4]
if type == '1' then
    valueName = KEYS[3]
    permitsName = KEYS[5]
end
"""

# Permits carried by a list of members (Redisson's release loop).
_SUM = """
local function sumPermits(members)
    local total = 0
    for _, member in ipairs(members) do
        local _random, permits = struct.unpack('Bc0I', member)
        total = total + permits
    end
    return total
end
"""

# Redisson trySetRate (4.x, with keepAliveTime): HSETNX only; an existing config is never overwritten.
# ARGV: rate, interval ms, type, keepAliveTime ms. Returns 1 if the limiter was created.
TRY_SET_RATE = """
redis.call('hsetnx', KEYS[1], 'rate', ARGV[1])
redis.call('hsetnx', KEYS[1], 'interval', ARGV[2])
redis.call('hsetnx', KEYS[1], 'keepAliveTime', ARGV[4])
local created = redis.call('hsetnx', KEYS[1], 'type', ARGV[3])
if created == 1 and tonumber(ARGV[4]) > 0 then
    redis.call('pexpire', KEYS[1], ARGV[4])
end
return created
"""

# Redisson setRate: HSET of the config and a full reset of the state. ARGV as TRY_SET_RATE.
SET_RATE = """
redis.call('hset', KEYS[1], 'rate', ARGV[1], 'interval', ARGV[2], 'type', ARGV[3], 'keepAliveTime', ARGV[4])
if tonumber(ARGV[4]) > 0 then
    redis.call('pexpire', KEYS[1], ARGV[4])
end
redis.call('del', KEYS[2], KEYS[3], KEYS[4], KEYS[5])
return 1
"""

# Redisson 4.4+ setRate keeping state ("updateRate"). ARGV: rate, interval ms, type, keepAliveTime ms, now ms.
# Returns 0 (nothing written) if the limiter does not exist.
UPDATE_RATE = _SUM + """
if redis.call('hexists', KEYS[1], 'rate') == 0 then
    return 0
end
local oldType = redis.call('hget', KEYS[1], 'type')
redis.call('hset', KEYS[1], 'rate', ARGV[1], 'interval', ARGV[2], 'type', ARGV[3], 'keepAliveTime', ARGV[4])
local keepAlive = tonumber(ARGV[4])
if keepAlive > 0 then
    redis.call('pexpire', KEYS[1], keepAlive)
end
if oldType ~= ARGV[3] then
    redis.call('del', KEYS[2], KEYS[3], KEYS[4], KEYS[5])
    return 1
end
local valueName = KEYS[2]
local permitsName = KEYS[4]
if ARGV[3] == '1' then
    valueName = KEYS[3]
    permitsName = KEYS[5]
end
local windowStart = tonumber(ARGV[5]) - tonumber(ARGV[2])
redis.call('zremrangebyscore', permitsName, 0, windowStart)
local inWindow = sumPermits(redis.call('zrange', permitsName, 0, -1))
if inWindow > 0 or redis.call('exists', valueName) == 1 then
    redis.call('set', valueName, math.max(0, tonumber(ARGV[1]) - inWindow))
    if keepAlive > 0 then
        redis.call('pexpire', valueName, keepAlive)
        redis.call('pexpire', permitsName, keepAlive)
    end
end
return 1
"""

# Redisson tryAcquire(permits) (4.x). ARGV: permits, now ms, the new member's random bytes.
# Returns nil when the permits were taken, else the delay in ms until the oldest permit is released.
TRY_ACQUIRE = _CONFIG + _SUM + """
local wanted = tonumber(ARGV[1])
local now = tonumber(ARGV[2])
assert(rate >= wanted, 'Requested permits amount cannot exceed defined rate')
local member = struct.pack('Bc0I', string.len(ARGV[3]), ARGV[3], wanted)
local res = nil
local value = redis.call('get', valueName)
if value == false then
    redis.call('set', valueName, rate)
    redis.call('zadd', permitsName, now, member)
    redis.call('decrby', valueName, wanted)
else
    value = tonumber(value)
    local expired = redis.call('zrangebyscore', permitsName, 0, now - interval)
    local released = sumPermits(expired)
    if released > 0 then
        redis.call('zremrangebyscore', permitsName, 0, now - interval)
        if value + released > rate then
            value = rate - sumPermits(redis.call('zrange', permitsName, 0, -1))
        else
            value = value + released
        end
        redis.call('set', valueName, value)
    end
    if value < wanted then
        local oldest = redis.call('zrange', permitsName, 0, 0, 'withscores')
        res = 3 + interval - (now - tonumber(oldest[2]))
    else
        redis.call('zadd', permitsName, now, member)
        redis.call('decrby', valueName, wanted)
    end
end
if keepAlive > 0 then
    redis.call('pexpire', KEYS[1], keepAlive)
    redis.call('pexpire', valueName, keepAlive)
    redis.call('pexpire', permitsName, keepAlive)
else
    local ttl = redis.call('pttl', KEYS[1])
    if ttl > 0 then
        redis.call('pexpire', valueName, ttl)
        redis.call('pexpire', permitsName, ttl)
    end
end
return res
"""

# Redisson availablePermits. ARGV: now ms. The release step without the cap; a missing value is the rate.
AVAILABLE_PERMITS = _CONFIG + _SUM + """
local value = redis.call('get', valueName)
if value == false then
    redis.call('set', valueName, rate)
    return rate
end
value = tonumber(value)
local expired = redis.call('zrangebyscore', permitsName, 0, tonumber(ARGV[1]) - interval)
local released = sumPermits(expired)
if released > 0 then
    redis.call('zremrangebyscore', permitsName, 0, tonumber(ARGV[1]) - interval)
    value = value + released
    redis.call('set', valueName, value)
end
return value
"""

#: Random bytes in a permit member (Redisson 4.x `ServiceManager.generateIdArray()`).
MEMBER_RANDOM_LEN = 16


def suffix_name(name: str, suffix: str) -> str:
    """Redisson's `suffixName`: `name:suffix` if the name holds a `{`, else `{name}:suffix`."""
    return f"{name}:{suffix}" if "{" in name else f"{{{name}}}:{suffix}"


class Acquired(NamedTuple):
    """The outcome of `try_acquire`: whether the permits were taken, else Redisson's delay in ms."""

    acquired: bool
    delay_ms: int


class RateLimiter:
    """`redissonClient.getRateLimiter(name)` of one Redisson client instance.

    `client_id` defaults to a fresh UUID (one per instance, as Redisson's), `now_ms` to this process's
    wall clock in epoch ms.
    """

    def __init__(self, redis: redis_py.Redis, name: str, *, client_id: str | None = None,
                 now_ms: Callable[[], int] | None = None):
        self.redis = redis
        self.name = name
        self.client_id = client_id or str(uuid.uuid4())
        self.now_ms = now_ms or (lambda: int(time.time() * 1000))
        self.keys = [
            name,
            suffix_name(name, "value"),
            f"{suffix_name(name, 'value')}:{self.client_id}",
            suffix_name(name, "permits"),
            f"{suffix_name(name, 'permits')}:{self.client_id}",
        ]
        self._scripts = {source: redis.register_script(source)
                         for source in (TRY_SET_RATE, SET_RATE, UPDATE_RATE, TRY_ACQUIRE, AVAILABLE_PERMITS)}

    def _run(self, source: str, *args: object):
        return self._scripts[source](keys=self.keys, args=list(args))

    def try_set_rate(self, rate_type: int, rate: int, interval_ms: int, keep_alive_ms: int = 0) -> bool:
        """Creates the limiter unless it exists (its config is then left as it is); True if created."""
        return self._run(TRY_SET_RATE, rate, interval_ms, rate_type, keep_alive_ms) == 1

    def set_rate(self, rate_type: int, rate: int, interval_ms: int, keep_alive_ms: int = 0) -> None:
        """Writes the config and resets the state (all permits available again)."""
        self._run(SET_RATE, rate, interval_ms, rate_type, keep_alive_ms)

    def update_rate(self, rate_type: int, rate: int, interval_ms: int, keep_alive_ms: int = 0) -> bool:
        """Writes the config keeping consumed permits (no burst); False if the limiter does not exist."""
        return self._run(UPDATE_RATE, rate, interval_ms, rate_type, keep_alive_ms, self.now_ms()) == 1

    def try_acquire(self, permits: int = 1) -> Acquired:
        """Takes `permits` now if available: (True, 0), else (False, delay until the oldest is released)."""
        delay = self._run(TRY_ACQUIRE, permits, self.now_ms(), os.urandom(MEMBER_RANDOM_LEN))
        return Acquired(True, 0) if delay is None else Acquired(False, int(delay))

    def available_permits(self) -> int:
        """Permits available now (releases the permits that left the window)."""
        return int(self._run(AVAILABLE_PERMITS, self.now_ms()))

    def config(self) -> dict[str, int]:
        """`HGETALL` of the config hash as ints: rate, interval, type, keepAliveTime."""
        return {key.decode(): int(value) for key, value in self.redis.hgetall(self.name).items()}
