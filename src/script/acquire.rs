//! The acquire command (Redisson `tryAcquire` with trySetRate and, if asked, updateRate: see
//! [`super::ACQUIRE`]): its arguments and its reply.

use crate::config::LimiterType;
use crate::key::LimiterKeys;
use crate::resp::{Command, Reply};

use super::{Invocation, ACQUIRE};

/// The hash field where [`super::ACQUIRE`] records the config a rule wrote (`rate_source: config`):
/// `rate:interval:type:keepAliveTime`, next to Redisson's four fields.
pub const RULE_CONFIG_FIELD: &str = "erlRuleConfig";

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
    /// Redis held another config the rule had written, replaced keeping state (updateRate), as asked.
    Updated,
    /// Redis holds a config someone else wrote over the rule's (an operator, a Java service): it stands.
    Kept,
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
        Reply::Error(_) if reply.error_code() == Some("NOSCRIPT") => return Err(ReplyError::NoScript),
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
            3 => ConfigChange::Kept,
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
