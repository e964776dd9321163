//! The Redis side of a decision: the acquire Lua script, the command that runs it, and its reply.
//!
//! The script has the effects of Redisson 4.x `RedissonRateLimiter.tryAcquire` (DESIGN.md, "Redisson's
//! RRateLimiter layout"), preceded by Redisson's `trySetRate` when the limiter does not exist: the config
//! fields are written with `HSETNX`, so a limiter that exists (created by a Java service, an operator, or
//! another gateway) is obeyed and never overwritten, and a limiter that expired or was deleted is
//! re-created in the same round trip. One `EVALSHA` per rule and request, atomic in Redis.

use std::sync::LazyLock;

use sha1::{Digest, Sha1};

use crate::config::LimiterType;
use crate::key::LimiterKeys;
use crate::resp::{Command, Reply};

/// The acquire script (Lua 5.1 as embedded in Redis 7, with the `struct` library).
///
/// `KEYS`: 1 config hash, 2 value, 3 client value, 4 permits, 5 client permits (as [`LimiterKeys`]).
/// `ARGV`: 1 permits requested, 2 now (ms since the epoch), 3 the new member's random bytes,
/// 4 rate, 5 interval (ms), 6 type (`0`/`1`), 7 keepAliveTime (ms): 4-7 are written only if the limiter
/// does not exist.
///
/// Reply, an array of integers only (webdis drops nil array elements):
/// `{code, amount, reset_ms, rate, interval_ms, type, created}` where `code` 1 = acquired and `amount` is
/// the permits left; 0 = rejected and `amount` is Redisson's delay in ms; 2 = more permits requested than
/// the limiter's rate (can never succeed; Redisson raises an error). `reset_ms` is when the oldest permit
/// of the window is released; rate, interval and type are the limiter's config as Redis holds it.
pub const ACQUIRE_SCRIPT: &str = r"-- edge-rate-limiter acquire: Redisson 4.x RRateLimiter tryAcquire (+ trySetRate when missing)
local config = redis.call('hmget', KEYS[1], 'rate', 'interval', 'type', 'keepAliveTime')
local created = 0
if config[1] == false or config[2] == false or config[3] == false then
  redis.call('hsetnx', KEYS[1], 'rate', ARGV[4])
  redis.call('hsetnx', KEYS[1], 'interval', ARGV[5])
  redis.call('hsetnx', KEYS[1], 'keepAliveTime', ARGV[7])
  created = redis.call('hsetnx', KEYS[1], 'type', ARGV[6])
  if created == 1 and tonumber(ARGV[7]) > 0 then
    redis.call('pexpire', KEYS[1], ARGV[7])
  end
  config = redis.call('hmget', KEYS[1], 'rate', 'interval', 'type', 'keepAliveTime')
end
local rate = tonumber(config[1])
local interval = tonumber(config[2])
local limiterType = tonumber(config[3])
local keepAlive = tonumber(config[4]) or 0
local valueName, permitsName = KEYS[2], KEYS[4]
if config[3] == '1' then
  valueName, permitsName = KEYS[3], KEYS[5]
end
local requested = tonumber(ARGV[1])
local now = tonumber(ARGV[2])
if requested > rate then
  return {2, 0, 0, rate, interval, limiterType, created}
end
local function sumPermits(members)
  local total = 0
  for _, member in ipairs(members) do
    local _, permits = struct.unpack('Bc0I', member)
    total = total + permits
  end
  return total
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
local code, amount = 0, 0
if value < requested then
  local oldest = redis.call('zrange', permitsName, 0, 0, 'withscores')
  amount = 3 + interval - (now - tonumber(oldest[2] or now))
else
  redis.call('zadd', permitsName, now, struct.pack('Bc0I', string.len(ARGV[3]), ARGV[3], requested))
  amount = redis.call('decrby', valueName, requested)
  code = 1
end
local oldest = redis.call('zrange', permitsName, 0, 0, 'withscores')
local reset = 0
if oldest[2] then
  reset = math.max(0, tonumber(oldest[2]) + interval - now)
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
return {code, amount, reset, rate, interval, limiterType, created}
";

/// SHA-1 of [`ACQUIRE_SCRIPT`], lowercase hex: the `EVALSHA` name of the script in Redis's script cache.
pub fn acquire_script_sha() -> &'static str {
    static SHA: LazyLock<String> =
        LazyLock::new(|| Sha1::digest(ACQUIRE_SCRIPT.as_bytes()).iter().map(|b| format!("{b:02x}")).collect());
    &SHA
}

/// Length of the random part of a permit member, bytes (Redisson 4.x; 3.17-3.20 wrote 8).
pub const MEMBER_RANDOM_LEN: usize = 16;

/// One acquire: which limiter, how many permits, at what time, and the config to create it with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Acquire {
    /// The limiter's keys.
    pub keys: LimiterKeys,
    /// Permits to take.
    pub permits: u64,
    /// Acquire time, milliseconds since the Unix epoch (the gateway's clock, as Redisson uses the client's).
    pub now_ms: u64,
    /// Random bytes of the new member, unique per acquire.
    pub member_random: [u8; MEMBER_RANDOM_LEN],
    /// Config written if the limiter does not exist: permits per interval.
    pub rate: u64,
    /// Config written if the limiter does not exist: interval, ms.
    pub interval_ms: u64,
    /// Config written if the limiter does not exist: type.
    pub limiter_type: LimiterType,
    /// Config written if the limiter does not exist: keepAliveTime, ms (0 = none).
    pub keep_alive_ms: u64,
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
    /// The `EVALSHA` (or `EVAL`) command running [`ACQUIRE_SCRIPT`] for this acquire.
    pub fn command(&self, invocation: Invocation) -> Command {
        let command = match invocation {
            Invocation::BySha => Command::new("EVALSHA").arg(acquire_script_sha()),
            Invocation::BySource => Command::new("EVAL").arg(ACQUIRE_SCRIPT),
        };
        let k = &self.keys;
        command
            .arg("5")
            .arg(&k.config)
            .arg(&k.value)
            .arg(&k.client_value)
            .arg(&k.permits)
            .arg(&k.client_permits)
            .arg(self.permits.to_string())
            .arg(self.now_ms.to_string())
            .arg(self.member_random)
            .arg(self.rate.to_string())
            .arg(self.interval_ms.to_string())
            .arg(self.limiter_type.redisson_ordinal().to_string())
            .arg(self.keep_alive_ms.to_string())
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
    /// Whether this call created the limiter (trySetRate wrote the config).
    pub created: bool,
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
    let [code, amount, reset, rate, interval, limiter_type, created] = numbers;
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
        created: created == 1,
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
            now_ms: 1_700_000_000_123,
            member_random: [7; MEMBER_RANDOM_LEN],
            rate: 10,
            interval_ms: 60_000,
            limiter_type: LimiterType::PerClient,
            keep_alive_ms: 3_600_000,
        }
    }

    #[test]
    fn script_sha_is_sha1_hex_of_the_source() {
        let sha = acquire_script_sha();
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
        assert_eq!(args[1], acquire_script_sha().as_bytes());
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
        assert_eq!(&args[8..], &[&b"2"[..], b"1700000000123", &[7u8; 16], b"10", b"60000", b"1", b"3600000"]);
        let by_source = acquire().command(Invocation::BySource);
        assert_eq!(by_source.args()[0], b"EVAL");
        assert_eq!(by_source.args()[1], ACQUIRE_SCRIPT.as_bytes());
        assert_eq!(&by_source.args()[2..], &command.args()[2..]);
    }

    #[test]
    fn replies_decode_from_integers_or_webdis_bulk_strings() {
        let native = decode_reply(b"*7\r\n:1\r\n:8\r\n:59000\r\n:10\r\n:60000\r\n:0\r\n:1\r\n").unwrap();
        let expected = AcquireReply {
            outcome: AcquireOutcome::Acquired { remaining: 8 },
            reset_ms: 59_000,
            effective: EffectiveConfig { rate: 10, interval_ms: 60_000, limiter_type: LimiterType::Overall },
            created: true,
        };
        assert_eq!(decode_acquire_reply(&native), Ok(expected));
        let webdis = decode_reply(
            b"*7\r\n$1\r\n0\r\n$4\r\n1503\r\n$4\r\n1500\r\n$1\r\n3\r\n$4\r\n2000\r\n$1\r\n1\r\n$1\r\n0\r\n",
        )
        .unwrap();
        let decoded = decode_acquire_reply(&webdis).unwrap();
        assert_eq!(decoded.outcome, AcquireOutcome::Rejected { delay_ms: 1503 });
        assert_eq!(decoded.effective.limiter_type, LimiterType::PerClient);
        assert!(!decoded.created);
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
