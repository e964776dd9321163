//! The Redis side of the limiter: Lua scripts with the effects of Redisson 4.x `RedissonRateLimiter`
//! operations (DESIGN.md, "Redisson's RRateLimiter layout"), the commands that run them, and the acquire
//! script's reply.
//!
//! Every script takes the same five `KEYS` ([`LimiterKeys`]: config hash, value, client value, permits,
//! client permits), all in one cluster hash slot, and is built from one Lua prelude, so an operation is
//! written once. The filter runs [`ACQUIRE`] once per rule and request: Redisson's `tryAcquire`, preceded
//! by `trySetRate` (`HSETNX`: an existing limiter is obeyed, never overwritten; an expired or deleted one
//! is re-created in the same round trip), and optionally by `updateRate` when the configuration must win.
//! The other scripts serve operators and tests.

use std::sync::LazyLock;

use sha1::{Digest, Sha1};

use crate::config::LimiterType;
use crate::key::LimiterKeys;
use crate::resp::{Command, Reply};

/// Lua shared by every script (Lua 5.1 as embedded in Redis 7, with the `struct` library).
///
/// - `nowMs(arg)`: `arg` as ms since the epoch, or Redis's own `TIME` when `arg` is empty.
/// - `sumPermits(members)`: permits carried by permit members, `struct.pack('Bc0I', #random, random,
///   permits)` as Redisson 4.x writes them (16 random bytes; 8 for Redisson 3.17-3.20: `Bc0` reads both).
/// - `names(type)`: the value and permits keys of a limiter type (`'1'` = per client).
/// - `keepAliveOrPersist(keepAlive)`: `PEXPIRE` of the hash, or `PERSIST` when keepAlive is 0 (a
///   limiter written without keep-alive never expires, even if it had a TTL before).
/// - `syncTtl(type)`: the value and permits keys take the hash's TTL (or none), so no key of a limiter
///   outlives its config: a plain `SET` drops a key's TTL, and a stale value key left behind an expired
///   limiter would skew the limiter re-created later.
/// - `trySetRate(...)`: `HSETNX` of the four config fields; when it creates the limiter, `PEXPIRE` of the
///   hash with the keep-alive and deletion of any value and permits keys left from an earlier life, so a
///   new limiter starts full; returns 1 if created.
/// - `updateRate(...)`: `HSET` of the config keeping state: a type change deletes all state; otherwise
///   permits outside the new window are dropped and value = max(0, rate - permits still in the window);
///   then the keep-alive is applied to every key.
macro_rules! lua_prelude {
    () => {
        r"
local function nowMs(arg)
  if arg ~= nil and arg ~= '' then return tonumber(arg) end
  local t = redis.call('time')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function sumPermits(members)
  local total = 0
  for _, member in ipairs(members) do
    local _, permits = struct.unpack('Bc0I', member)
    total = total + permits
  end
  return total
end
local function names(limiterType)
  if limiterType == '1' then return KEYS[3], KEYS[5] end
  return KEYS[2], KEYS[4]
end
local function keepAliveOrPersist(keepAlive)
  if tonumber(keepAlive) > 0 then
    redis.call('pexpire', KEYS[1], keepAlive)
  else
    redis.call('persist', KEYS[1])
  end
end
local function syncTtl(limiterType)
  local valueName, permitsName = names(limiterType)
  local ttl = redis.call('pttl', KEYS[1])
  if ttl > 0 then
    redis.call('pexpire', valueName, ttl)
    redis.call('pexpire', permitsName, ttl)
  else
    redis.call('persist', valueName)
    redis.call('persist', permitsName)
  end
end
local function trySetRate(rate, interval, limiterType, keepAlive)
  redis.call('hsetnx', KEYS[1], 'rate', rate)
  redis.call('hsetnx', KEYS[1], 'interval', interval)
  redis.call('hsetnx', KEYS[1], 'keepAliveTime', keepAlive)
  local created = redis.call('hsetnx', KEYS[1], 'type', limiterType)
  if created == 1 then
    if tonumber(keepAlive) > 0 then
      redis.call('pexpire', KEYS[1], keepAlive)
    end
    redis.call('del', KEYS[2], KEYS[3], KEYS[4], KEYS[5])
  end
  return created
end
local function updateRate(rate, interval, limiterType, keepAlive, now)
  local oldType = redis.call('hget', KEYS[1], 'type')
  redis.call('hset', KEYS[1], 'rate', rate, 'interval', interval, 'type', limiterType, 'keepAliveTime', keepAlive)
  if oldType ~= limiterType then
    redis.call('del', KEYS[2], KEYS[3], KEYS[4], KEYS[5])
  else
    local valueName, permitsName = names(limiterType)
    redis.call('zremrangebyscore', permitsName, 0, now - tonumber(interval))
    local used = sumPermits(redis.call('zrange', permitsName, 0, -1))
    redis.call('set', valueName, math.max(0, tonumber(rate) - used))
  end
  keepAliveOrPersist(keepAlive)
  syncTtl(limiterType)
end
local function isInitialized(config)
  return config[1] ~= false and config[2] ~= false and config[3] ~= false
end
"
    };
}

/// A Lua script run with `EVALSHA` (falling back to `EVAL` on `NOSCRIPT`).
#[derive(Debug)]
pub struct Script {
    /// Short name for logs and errors.
    pub name: &'static str,
    /// The Lua source.
    pub source: &'static str,
    sha: LazyLock<String>,
}

impl Script {
    const fn new(name: &'static str, source: &'static str, sha: fn() -> String) -> Self {
        Script { name, source, sha: LazyLock::new(sha) }
    }

    /// SHA-1 of the source, lowercase hex: the script's name in Redis's script cache.
    pub fn sha(&self) -> &str {
        &self.sha
    }

    /// The command running this script on a limiter's keys with `args` as `ARGV`.
    pub fn command(&self, invocation: Invocation, keys: &LimiterKeys, args: &[&[u8]]) -> Command {
        let command = match invocation {
            Invocation::BySha => Command::new("EVALSHA").arg(self.sha()),
            Invocation::BySource => Command::new("EVAL").arg(self.source),
        };
        let command = command
            .arg("5")
            .arg(&keys.config)
            .arg(&keys.value)
            .arg(&keys.client_value)
            .arg(&keys.permits)
            .arg(&keys.client_permits);
        args.iter().fold(command, |command, arg| command.arg(arg))
    }
}

fn sha1_hex(source: &str) -> String {
    Sha1::digest(source.as_bytes()).iter().map(|b| format!("{b:02x}")).collect()
}

macro_rules! script {
    ($name:literal, $body:literal) => {{
        const SOURCE: &str = concat!("-- edge-rate-limiter ", $name, lua_prelude!(), $body);
        Script::new($name, SOURCE, || sha1_hex(SOURCE))
    }};
}

/// Acquire: Redisson `tryAcquire(permits)`, preceded by `trySetRate` when the limiter does not exist and,
/// if asked, by `updateRate` when Redis holds another config than the arguments.
///
/// `ARGV`: 1 permits requested, 2 now (ms since the epoch; empty = Redis `TIME`), 3 the new member's
/// random bytes, 4 rate, 5 interval (ms), 6 type (`0`/`1`), 7 keepAliveTime (ms), 8 `1` = apply 4-7 with
/// `updateRate` (keeping state) if they differ from Redis's.
///
/// Reply, an array of integers only (webdis drops nil array elements):
/// `{code, amount, reset_ms, rate, interval_ms, type, change}`. `code` 1 = acquired and `amount` is the
/// permits left; 0 = rejected and `amount` is Redisson's delay in ms (`3 + interval - (now - oldest)`);
/// 2 = more permits requested than the rate (no wait can grant them; Redisson raises an error).
/// `reset_ms`: until the oldest permit of the window is released. rate, interval and type: the config in
/// Redis after the call. `change`: 0 none, 1 created (trySetRate), 2 updated (updateRate).
pub static ACQUIRE: Script = script!(
    "acquire",
    r"
local config = redis.call('hmget', KEYS[1], 'rate', 'interval', 'type', 'keepAliveTime')
local now = nowMs(ARGV[2])
local change = 0
if not isInitialized(config) then
  change = trySetRate(ARGV[4], ARGV[5], ARGV[6], ARGV[7])
elseif ARGV[8] == '1' and (config[1] ~= ARGV[4] or config[2] ~= ARGV[5] or config[3] ~= ARGV[6] or (config[4] or '0') ~= ARGV[7]) then
  updateRate(ARGV[4], ARGV[5], ARGV[6], ARGV[7], now)
  change = 2
end
if change ~= 0 then
  config = redis.call('hmget', KEYS[1], 'rate', 'interval', 'type', 'keepAliveTime')
end
local rate = tonumber(config[1])
local interval = tonumber(config[2])
local keepAlive = tonumber(config[4]) or 0
local valueName, permitsName = names(config[3])
local requested = tonumber(ARGV[1])
if requested > rate then
  return {2, 0, 0, rate, interval, tonumber(config[3]), change}
end
local value = redis.call('get', valueName)
if value == false then
  redis.call('set', valueName, rate)
  value = rate
else
  value = tonumber(value)
  local released = sumPermits(redis.call('zrangebyscore', permitsName, 0, now - interval))
  if released > 0 then
    redis.call('zremrangebyscore', permitsName, 0, now - interval)
    if value + released > rate then
      value = rate - sumPermits(redis.call('zrange', permitsName, 0, -1))
    else
      value = value + released
    end
    redis.call('set', valueName, value)
  end
end
local oldest = redis.call('zrange', permitsName, 0, 0, 'withscores')
local oldestScore = oldest[2] and tonumber(oldest[2])
local code, amount = 0, 0
if value < requested then
  amount = 3 + interval - (now - (oldestScore or now))
else
  redis.call('zadd', permitsName, now, struct.pack('Bc0I', string.len(ARGV[3]), ARGV[3], requested))
  amount = redis.call('decrby', valueName, requested)
  code = 1
  oldestScore = math.min(oldestScore or now, now)
end
local reset = 0
if oldestScore then
  reset = math.max(0, oldestScore + interval - now)
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
return {code, amount, reset, rate, interval, tonumber(config[3]), change}
"
);

/// Redisson `trySetRate`: `ARGV` rate, interval (ms), type, keepAliveTime (ms). Replies 1 if the limiter
/// was created, 0 if it existed (its config is left as it is).
pub static TRY_SET_RATE: Script = script!(
    "trySetRate",
    r"
return trySetRate(ARGV[1], ARGV[2], ARGV[3], ARGV[4])
"
);

/// Redisson `setRate`: writes the config and resets the state (value and permits, overall and this
/// client's). `ARGV` rate, interval (ms), type, keepAliveTime (ms; 0 also removes an earlier TTL).
/// Replies 1.
pub static SET_RATE: Script = script!(
    "setRate",
    r"
redis.call('hset', KEYS[1], 'rate', ARGV[1], 'interval', ARGV[2], 'type', ARGV[3], 'keepAliveTime', ARGV[4])
keepAliveOrPersist(ARGV[4])
redis.call('del', KEYS[2], KEYS[3], KEYS[4], KEYS[5])
return 1
"
);

/// Redisson 4.4+ `setRate` keeping state (`updateRate`): consumed permits stay consumed, so changing a
/// rate causes no burst. `ARGV` rate, interval (ms), type, keepAliveTime (ms), now (ms; empty = Redis
/// `TIME`). Replies 1, or 0 if the limiter does not exist (nothing is written).
pub static UPDATE_RATE: Script = script!(
    "updateRate",
    r"
local config = redis.call('hmget', KEYS[1], 'rate', 'interval', 'type')
if not isInitialized(config) then return 0 end
updateRate(ARGV[1], ARGV[2], ARGV[3], ARGV[4], nowMs(ARGV[5]))
return 1
"
);

/// Redisson `availablePermits`: releases the permits that left the window and replies the permits
/// available now (a missing value key is set to the rate). The keys it writes take the hash's TTL
/// (Redisson's plain `SET` would leave a value key without one). `ARGV` now (ms; empty = Redis `TIME`).
/// Error reply `RateLimiter is not initialized` when the limiter does not exist.
pub static AVAILABLE_PERMITS: Script = script!(
    "availablePermits",
    r"
local config = redis.call('hmget', KEYS[1], 'rate', 'interval', 'type')
if not isInitialized(config) then return redis.error_reply('RateLimiter is not initialized') end
local valueName, permitsName = names(config[3])
local value = redis.call('get', valueName)
if value == false then
  redis.call('set', valueName, config[1])
  syncTtl(config[3])
  return tonumber(config[1])
end
local now = nowMs(ARGV[1])
local released = sumPermits(redis.call('zrangebyscore', permitsName, 0, now - tonumber(config[2])))
if released > 0 then
  redis.call('zremrangebyscore', permitsName, 0, now - tonumber(config[2]))
  value = tonumber(value) + released
  redis.call('set', valueName, value)
  syncTtl(config[3])
end
return tonumber(value)
"
);

/// Redisson `delete`: removes every key of the limiter (config, value and permits, overall and this
/// client's). Replies the number of keys removed.
pub static DELETE: Script = script!(
    "delete",
    r"
return redis.call('del', KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5])
"
);

/// Length of the random part of a permit member, bytes (Redisson 4.x; 3.17-3.20 wrote 8).
pub const MEMBER_RANDOM_LEN: usize = 16;

/// Where the acquire time comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Clock {
    /// The gateway's clock, ms since the epoch (Redisson uses the client's clock the same way).
    Gateway(u64),
    /// Redis's `TIME`: one clock for every gateway, no skew.
    Redis,
}

/// One acquire: which limiter, how many permits, at what time, and the config to create it with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Acquire {
    /// The limiter's keys.
    pub keys: LimiterKeys,
    /// Permits to take.
    pub permits: u64,
    /// Acquire time.
    pub clock: Clock,
    /// Random bytes of the new member, unique per acquire.
    pub member_random: [u8; MEMBER_RANDOM_LEN],
    /// Config written if the limiter does not exist (or applied, with `apply_config`): permits per interval.
    pub rate: u64,
    /// Config: interval, ms.
    pub interval_ms: u64,
    /// Config: type.
    pub limiter_type: LimiterType,
    /// Config: keepAliveTime, ms (0 = none).
    pub keep_alive_ms: u64,
    /// Whether to apply the config with `updateRate` when Redis holds another one.
    pub apply_config: bool,
}

/// How the script is named in the command.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Invocation {
    /// `EVALSHA <sha>`: the usual, short form.
    BySha,
    /// `EVAL <source>`: after Redis answered `NOSCRIPT` (its script cache was flushed or it restarted).
    BySource,
}

impl Acquire {
    /// The `EVALSHA` (or `EVAL`) command running [`ACQUIRE`] for this acquire.
    pub fn command(&self, invocation: Invocation) -> Command {
        let now = match self.clock {
            Clock::Gateway(ms) => ms.to_string(),
            Clock::Redis => String::new(),
        };
        let args = [
            self.permits.to_string(),
            now,
            String::new(),
            self.rate.to_string(),
            self.interval_ms.to_string(),
            self.limiter_type.redisson_ordinal().to_string(),
            self.keep_alive_ms.to_string(),
            if self.apply_config { "1" } else { "0" }.to_string(),
        ];
        let mut argv: Vec<&[u8]> = args.iter().map(|a| a.as_bytes()).collect();
        if let Some(random) = argv.get_mut(2) {
            *random = &self.member_random;
        }
        ACQUIRE.command(invocation, &self.keys, &argv)
    }
}

/// A limiter's config as Redis holds it (which may differ from the plugin configuration: Redis wins).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EffectiveConfig {
    /// Permits per interval.
    pub rate: u64,
    /// Interval, ms.
    pub interval_ms: u64,
    /// Overall or per client.
    pub limiter_type: LimiterType,
}

/// What the acquire decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AcquireOutcome {
    /// The permits were taken; `remaining` permits are left in the window.
    Acquired {
        /// Permits left.
        remaining: u64,
    },
    /// Not enough permits; Redisson's delay until the oldest permit is released, ms.
    Rejected {
        /// Delay, ms (Redisson: `3 + interval - (now - oldest acquire time)`).
        delay_ms: u64,
    },
    /// More permits requested than the limiter's rate: no wait will ever grant them.
    ExceedsRate,
}

/// The decoded reply of the acquire script.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AcquireReply {
    /// The decision.
    pub outcome: AcquireOutcome,
    /// Time until the oldest permit in the window is released, ms (0 when the window is empty).
    pub reset_ms: u64,
    /// The limiter's config in Redis.
    pub effective: EffectiveConfig,
    /// Whether this call wrote the limiter's config.
    pub change: ConfigChange,
}

/// What an acquire did to the limiter's config.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConfigChange {
    /// Nothing: the limiter existed and was used as it is.
    None,
    /// The limiter did not exist and was created (trySetRate).
    Created,
    /// Redis held another config, replaced keeping state (updateRate), as asked.
    Updated,
}

/// Why a reply is not an acquire decision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReplyError {
    /// `-NOSCRIPT`: Redis does not have the script cached; send it again by source.
    NoScript,
    /// Any other Redis error reply, e.g. `NOAUTH Authentication required.` or a Lua error.
    Redis(String),
    /// A reply the script cannot produce (wrong shape or values).
    Unexpected(String),
}

impl std::fmt::Display for ReplyError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ReplyError::NoScript => write!(f, "Redis does not have the acquire script (NOSCRIPT)"),
            ReplyError::Redis(text) => write!(f, "Redis error: {text}"),
            ReplyError::Unexpected(what) => {
                write!(f, "unexpected reply to the acquire script: {what}")
            }
        }
    }
}

/// Decodes the acquire script's reply.
///
/// # Errors
/// [`ReplyError::NoScript`] for `-NOSCRIPT`, [`ReplyError::Redis`] for other error replies,
/// [`ReplyError::Unexpected`] for anything not shaped like the script's answer.
pub fn decode_acquire_reply(reply: &Reply) -> Result<AcquireReply, ReplyError> {
    let items = match reply {
        Reply::Error(text) if reply.error_code() == Some("NOSCRIPT") => {
            let _ = text;
            return Err(ReplyError::NoScript);
        }
        Reply::Error(text) => return Err(ReplyError::Redis(text.clone())),
        Reply::Array(items) if items.len() == 7 => items,
        other => return Err(ReplyError::Unexpected(format!("{other:?}"))),
    };
    let mut numbers = [0i64; 7];
    for (slot, item) in numbers.iter_mut().zip(items) {
        *slot = item.as_integer().ok_or_else(|| ReplyError::Unexpected(format!("not an integer: {item:?}")))?;
    }
    let [code, amount, reset, rate, interval, limiter_type, change] = numbers;
    let non_negative = |value: i64, what: &str| {
        u64::try_from(value).map_err(|_| ReplyError::Unexpected(format!("negative {what}: {value}")))
    };
    let outcome = match code {
        1 => AcquireOutcome::Acquired { remaining: non_negative(amount, "remaining permits")? },
        0 => AcquireOutcome::Rejected { delay_ms: non_negative(amount, "delay")? },
        2 => AcquireOutcome::ExceedsRate,
        other => return Err(ReplyError::Unexpected(format!("outcome code {other}"))),
    };
    let limiter_type = LimiterType::from_redisson_ordinal(limiter_type)
        .ok_or_else(|| ReplyError::Unexpected(format!("limiter type {limiter_type}")))?;
    Ok(AcquireReply {
        outcome,
        reset_ms: non_negative(reset, "reset time")?,
        effective: EffectiveConfig {
            rate: non_negative(rate, "rate")?,
            interval_ms: non_negative(interval, "interval")?,
            limiter_type,
        },
        change: match change {
            0 => ConfigChange::None,
            1 => ConfigChange::Created,
            2 => ConfigChange::Updated,
            other => return Err(ReplyError::Unexpected(format!("config change code {other}"))),
        },
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]
    use super::*;
    use crate::resp::decode_reply;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn acquire() -> Acquire {
        Acquire {
            keys: LimiterKeys::new("erl:r:alice", "client-1"),
            permits: 2,
            clock: Clock::Gateway(1_700_000_000_123),
            member_random: [7; MEMBER_RANDOM_LEN],
            rate: 10,
            interval_ms: 60_000,
            limiter_type: LimiterType::PerClient,
            keep_alive_ms: 3_600_000,
            apply_config: false,
        }
    }

    #[test]
    fn script_sha_is_sha1_hex_of_the_source() {
        let sha = ACQUIRE.sha();
        assert_eq!(sha.len(), 40);
        assert!(sha.bytes().all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()));
        assert_eq!(
            Sha1::digest(b"abc").iter().map(|b| format!("{b:02x}")).collect::<String>(),
            "a9993e364706816aba3e25717850c26c9cd0d89d"
        );
    }

    #[test]
    fn command_carries_keys_then_arguments_in_script_order() {
        let command = acquire().command(Invocation::BySha);
        let args: Vec<&[u8]> = command.args().iter().map(Vec::as_slice).collect();
        assert_eq!(args[0], b"EVALSHA");
        assert_eq!(args[1], ACQUIRE.sha().as_bytes());
        assert_eq!(
            &args[2..8],
            &[
                &b"5"[..],
                b"erl:r:alice",
                b"{erl:r:alice}:value",
                b"{erl:r:alice}:value:client-1",
                b"{erl:r:alice}:permits",
                b"{erl:r:alice}:permits:client-1"
            ]
        );
        assert_eq!(&args[8..], &[&b"2"[..], b"1700000000123", &[7u8; 16], b"10", b"60000", b"1", b"3600000", b"0"]);
        let by_source = acquire().command(Invocation::BySource);
        assert_eq!(by_source.args()[0], b"EVAL");
        assert_eq!(by_source.args()[1], ACQUIRE.source.as_bytes());
        assert_eq!(&by_source.args()[2..], &command.args()[2..]);
    }

    #[test]
    fn redis_clock_sends_no_time_and_apply_config_sets_the_flag() {
        let mut acquire = acquire();
        acquire.clock = Clock::Redis;
        acquire.apply_config = true;
        let command = acquire.command(Invocation::BySha);
        assert_eq!(command.args()[9], b"", "an empty time makes the script read Redis TIME");
        assert_eq!(command.args()[15], b"1");
    }

    #[test]
    fn every_script_shares_the_prelude_and_has_its_own_sha() {
        let scripts = [&ACQUIRE, &TRY_SET_RATE, &SET_RATE, &UPDATE_RATE, &AVAILABLE_PERMITS, &DELETE];
        let shas: std::collections::HashSet<&str> = scripts.iter().map(|s| s.sha()).collect();
        assert_eq!(shas.len(), scripts.len());
        assert!(scripts.iter().all(|s| s.source.contains("local function sumPermits")));
    }

    #[test]
    fn replies_decode_from_integers_or_webdis_bulk_strings() {
        let native = decode_reply(b"*7\r\n:1\r\n:8\r\n:59000\r\n:10\r\n:60000\r\n:0\r\n:1\r\n").unwrap();
        let expected = AcquireReply {
            outcome: AcquireOutcome::Acquired { remaining: 8 },
            reset_ms: 59_000,
            effective: EffectiveConfig { rate: 10, interval_ms: 60_000, limiter_type: LimiterType::Overall },
            change: ConfigChange::Created,
        };
        assert_eq!(decode_acquire_reply(&native), Ok(expected));
        let webdis = decode_reply(
            b"*7\r\n$1\r\n0\r\n$4\r\n1503\r\n$4\r\n1500\r\n$1\r\n3\r\n$4\r\n2000\r\n$1\r\n1\r\n$1\r\n0\r\n",
        )
        .unwrap();
        let decoded = decode_acquire_reply(&webdis).unwrap();
        assert_eq!(decoded.outcome, AcquireOutcome::Rejected { delay_ms: 1503 });
        assert_eq!(decoded.effective.limiter_type, LimiterType::PerClient);
        assert_eq!(decoded.change, ConfigChange::None);
    }

    #[test]
    fn error_and_malformed_replies_are_typed() {
        let noscript = decode_reply(b"-NOSCRIPT No matching script. Please use EVAL.\r\n").unwrap();
        assert_eq!(decode_acquire_reply(&noscript), Err(ReplyError::NoScript));
        let noauth = decode_reply(b"-NOAUTH Authentication required.\r\n").unwrap();
        assert_eq!(decode_acquire_reply(&noauth), Err(ReplyError::Redis("NOAUTH Authentication required.".into())));
        for bad in [
            &b"$-1\r\n"[..],
            b"*6\r\n:1\r\n:1\r\n:1\r\n:1\r\n:1\r\n:1\r\n",
            b"*7\r\n:5\r\n:1\r\n:1\r\n:1\r\n:1\r\n:0\r\n:0\r\n",
            b"*7\r\n:1\r\n:-1\r\n:1\r\n:1\r\n:1\r\n:0\r\n:0\r\n",
            b"*7\r\n:1\r\n:1\r\n:1\r\n:1\r\n:1\r\n:7\r\n:0\r\n",
        ] {
            assert!(
                matches!(decode_acquire_reply(&decode_reply(bad).unwrap()), Err(ReplyError::Unexpected(_))),
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
    }
}
