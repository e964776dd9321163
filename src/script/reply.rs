//! The acquire scripts' replies, read without building a generic value in the common cases
//! ([`decode_acquire_reply`], [`decode_acquire_all_reply`]).

use crate::prelude::*;

use crate::config::LimiterType;
use crate::quote::quoted;
use crate::resp::{decode_integers, decode_reply, Integers, Reply};

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
    /// [`super::ACQUIRE_ALL`] only: this limiter had the permits, but another limiter of the call rejected,
    /// so none were taken.
    Untaken {
        /// Permits free.
        available: u64,
    },
}

/// The decoded reply of the acquire script.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AcquireReply {
    /// The decision.
    pub outcome: AcquireOutcome,
    /// Permits available in the window after the call, when the reply says (the remaining permits when
    /// acquired; for a rejection only the full reply carries it: the short one says only the delay).
    pub available: Option<u64>,
    /// The limiter's config in Redis, when it is not the one the command carried (`None`: the same).
    pub effective: Option<EffectiveConfig>,
    /// Whether this call wrote the limiter's config.
    pub change: ConfigChange,
    /// Permits the acquire took, when the reply says (a lease's size; `None`: the permits asked).
    pub granted: Option<u64>,
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

impl core::fmt::Display for ReplyError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            ReplyError::NoScript => write!(f, "Redis does not have the acquire script (NOSCRIPT)"),
            ReplyError::Redis(text) => write!(f, "Redis error: {text}"),
            ReplyError::Unexpected(what) => {
                write!(f, "unexpected reply to the acquire script: {what}")
            }
        }
    }
}

/// A reply in a few words for an error message (its content quoted, never raw).
fn describe(reply: &Reply) -> String {
    match reply {
        Reply::Simple(text) => format!("simple string {}", quoted(text)),
        Reply::Error(text) => format!("error {}", quoted(text)),
        Reply::Integer(value) => format!("integer {value}"),
        Reply::Bulk(bytes) => format!("bulk string {}", quoted(bytes)),
        Reply::Array(items) => format!("array of {} elements", items.len()),
        Reply::Null => "null".to_string(),
    }
}

/// Decodes the acquire script's reply (raw RESP bytes; webdis re-encodes integers inside arrays as bulk
/// strings of digits, which read the same):
///
/// ```text
/// :4                                          acquired, 4 permits left (config as sent)
/// :-1503                                      rejected: Redisson's delay 1503 ms (config as sent)
/// *2 remaining taken                          a lease call acquired `taken` permits (config as sent)
/// *8 code amount available rate interval type change taken
///                                             the config in Redis differs from the one sent, or was written
/// ```
///
/// `code` 1 = acquired (`amount` = permits left), 0 = rejected (`amount` = Redisson's delay in ms), 2 =
/// more permits than the rate. `change`: 0 none, 1 created, 2 updated, 3 kept. `taken`: permits taken.
///
/// # Errors
/// [`ReplyError::NoScript`] for `-NOSCRIPT`, [`ReplyError::Redis`] for other error replies,
/// [`ReplyError::Unexpected`] for anything else (not RESP, another shape or values).
pub fn decode_acquire_reply(bytes: &[u8]) -> Result<AcquireReply, ReplyError> {
    let mut numbers = [0i64; FULL_REPLY];
    match decode_integers(bytes, &mut numbers) {
        // A bare integer, the config as sent: the permits left, or minus the delay.
        Some(Integers::Bare) => {
            let [value, ..] = numbers;
            let (outcome, available) = if value >= 0 {
                (AcquireOutcome::Acquired { remaining: value.unsigned_abs() }, Some(value.unsigned_abs()))
            } else {
                (AcquireOutcome::Rejected { delay_ms: value.unsigned_abs() }, None)
            };
            Ok(AcquireReply { outcome, available, effective: None, change: ConfigChange::None, granted: None })
        }
        // A lease call, the config as sent: the permits left and those taken.
        Some(Integers::Array(2)) => {
            let [remaining, taken, ..] = numbers;
            let remaining = non_negative(remaining, "remaining permits")?;
            Ok(AcquireReply {
                outcome: AcquireOutcome::Acquired { remaining },
                available: Some(remaining),
                effective: None,
                change: ConfigChange::None,
                granted: Some(non_negative(taken, "permits taken")?),
            })
        }
        Some(Integers::Array(FULL_REPLY)) => decode_full(&numbers),
        Some(Integers::Array(other)) => Err(ReplyError::Unexpected(format!("an array of {other} elements"))),
        None => Err(error_of(bytes)),
    }
}

/// One limiter's part of an [`super::ACQUIRE_ALL`] reply: its decision, or the Redis error its keys raised
/// (e.g. `WRONGTYPE ...`: the limiter's config key is not a hash).
pub type LimiterReply = Result<AcquireReply, String>;

/// Decodes the reply of [`super::ACQUIRE_ALL`] over `limiters` limiters: the full form of
/// [`decode_acquire_reply`] for each (8 integers), in order, `code` 3 = had the permits but took none
/// ([`AcquireOutcome::Untaken`]), `code` 4 = a Redis error on this limiter's keys (its other integers 0),
/// then one bulk string per limiter of code 4, in order: its error.
///
/// ```text
/// *16 :1 :4 :4 :5 :2000 :0 :0 :1  :1 :8 :8 :9 :60000 :0 :0 :1        both acquired
/// *17 :4 :0 :0 :0 :0 :0 :0 :0  :1 :8 ...  $73 WRONGTYPE Operation...  the first limiter's keys failed
/// ```
///
/// # Errors
/// As [`decode_acquire_reply`] (an error reply is the whole call's); another shape, or an error count
/// that does not match the codes 4, is [`ReplyError::Unexpected`].
pub fn decode_acquire_all_reply(bytes: &[u8], limiters: usize) -> Result<Vec<LimiterReply>, ReplyError> {
    let mut numbers = vec![0i64; FULL_REPLY * limiters];
    let errors: Vec<String> = match decode_integers(bytes, &mut numbers) {
        Some(Integers::Array(count)) if count == numbers.len() => Vec::new(),
        Some(_) => return Err(ReplyError::Unexpected(format!("not {} integers", numbers.len()))),
        None => match decode_reply(bytes) {
            Ok(Reply::Array(items)) if items.len() > numbers.len() => {
                let (head, tail) = items.split_at(numbers.len());
                for (slot, item) in numbers.iter_mut().zip(head) {
                    *slot = integer_of(item).ok_or_else(|| ReplyError::Unexpected(describe(item)))?;
                }
                tail.iter()
                    .map(|item| match item {
                        Reply::Bulk(text) => Ok(core::str::from_utf8(text).unwrap_or("(not UTF-8)").into()),
                        other => Err(ReplyError::Unexpected(describe(other))),
                    })
                    .collect::<Result<_, _>>()?
            }
            Ok(Reply::Array(_)) => return Err(ReplyError::Unexpected(format!("not {} integers", numbers.len()))),
            _ => return Err(error_of(bytes)),
        },
    };
    let failed = numbers.chunks_exact(FULL_REPLY).filter(|n| n.first() == Some(&LIMITER_ERROR)).count();
    if failed != errors.len() {
        return Err(ReplyError::Unexpected(format!("{failed} limiter error(s) and {} error text(s)", errors.len())));
    }
    let mut errors = errors.into_iter();
    numbers
        .chunks_exact(FULL_REPLY)
        .map(|numbers| match numbers.first() {
            Some(&LIMITER_ERROR) => Ok(Err(errors.next().unwrap_or_default())),
            _ => decode_full(numbers).map(Ok),
        })
        .collect()
}

/// The code of a limiter whose keys raised a Redis error in [`super::ACQUIRE_ALL`].
const LIMITER_ERROR: i64 = 4;

/// An integer reply, or a bulk string of decimal digits (webdis's form of an integer inside an array).
fn integer_of(item: &Reply) -> Option<i64> {
    match item {
        Reply::Integer(value) => Some(*value),
        Reply::Bulk(bytes) => core::str::from_utf8(bytes).ok().filter(|t| !t.starts_with('+'))?.parse().ok(),
        _ => None,
    }
}

/// Integers in a full reply: code, amount, available, rate, interval, type, change, taken.
const FULL_REPLY: usize = 8;

/// Why a reply that is not made of integers is no decision.
fn error_of(bytes: &[u8]) -> ReplyError {
    match decode_reply(bytes) {
        Ok(reply @ Reply::Error(_)) if reply.error_code() == Some("NOSCRIPT") => ReplyError::NoScript,
        Ok(Reply::Error(text)) => ReplyError::Redis(text),
        Ok(other) => ReplyError::Unexpected(describe(&other)),
        Err(error) => ReplyError::Unexpected(error.to_string()),
    }
}

fn non_negative(value: i64, what: &str) -> Result<u64, ReplyError> {
    u64::try_from(value).map_err(|_| ReplyError::Unexpected(format!("negative {what}: {value}")))
}

/// One full reply: `code amount available rate interval type change taken`.
fn decode_full(numbers: &[i64]) -> Result<AcquireReply, ReplyError> {
    let &[code, amount, available, rate, interval, limiter_type, change, taken] = numbers else {
        return Err(ReplyError::Unexpected(format!("{} integers", numbers.len())));
    };
    // A value below zero (a rate lowered under the permits in the window) is no permit available.
    let available = u64::try_from(available).unwrap_or(0);
    let outcome = match code {
        1 => AcquireOutcome::Acquired { remaining: non_negative(amount, "remaining permits")? },
        0 => AcquireOutcome::Rejected { delay_ms: non_negative(amount, "delay")? },
        2 => AcquireOutcome::ExceedsRate,
        3 => AcquireOutcome::Untaken { available },
        other => return Err(ReplyError::Unexpected(format!("outcome code {other}"))),
    };
    let limiter_type = LimiterType::from_redisson_ordinal(limiter_type)
        .ok_or_else(|| ReplyError::Unexpected(format!("limiter type {limiter_type}")))?;
    Ok(AcquireReply {
        outcome,
        available: Some(available),
        effective: Some(EffectiveConfig {
            rate: non_negative(rate, "rate")?,
            interval_ms: non_negative(interval, "interval")?,
            limiter_type,
        }),
        change: match change {
            0 => ConfigChange::None,
            1 => ConfigChange::Created,
            2 => ConfigChange::Updated,
            3 => ConfigChange::Kept,
            other => return Err(ReplyError::Unexpected(format!("config change code {other}"))),
        },
        granted: (code == 1).then(|| non_negative(taken, "permits taken")).transpose()?,
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing, clippy::panic)]
    use super::*;

    #[test]
    fn replies_decode_from_integers_or_webdis_bulk_strings() {
        let acquired = decode_acquire_reply(b":8\r\n").unwrap();
        assert_eq!(acquired.outcome, AcquireOutcome::Acquired { remaining: 8 });
        assert_eq!((acquired.available, acquired.effective, acquired.change), (Some(8), None, ConfigChange::None));
        let rejected = decode_acquire_reply(b":-1503\r\n").unwrap();
        assert_eq!((rejected.outcome, rejected.available), (AcquireOutcome::Rejected { delay_ms: 1503 }, None));
        let webdis = decode_acquire_reply(
            b"*8\r\n$1\r\n0\r\n$4\r\n1503\r\n$2\r\n-1\r\n$1\r\n3\r\n$4\r\n2000\r\n$1\r\n0\r\n$1\r\n3\r\n$1\r\n0\r\n",
        )
        .unwrap();
        assert_eq!((webdis.outcome, webdis.available), (AcquireOutcome::Rejected { delay_ms: 1503 }, Some(0)));
        assert_eq!(webdis.change, ConfigChange::Kept);
        let full = decode_acquire_reply(b"*8\r\n:1\r\n:8\r\n:8\r\n:10\r\n:60000\r\n:1\r\n:1\r\n:1\r\n").unwrap();
        assert_eq!(
            full,
            AcquireReply {
                outcome: AcquireOutcome::Acquired { remaining: 8 },
                available: Some(8),
                effective: Some(EffectiveConfig {
                    rate: 10,
                    interval_ms: 60_000,
                    limiter_type: LimiterType::PerClient
                }),
                change: ConfigChange::Created,
                granted: Some(1),
            }
        );
        let exceeds = decode_acquire_reply(b"*8\r\n:2\r\n:0\r\n:0\r\n:1\r\n:60000\r\n:0\r\n:0\r\n:0\r\n").unwrap();
        assert_eq!(exceeds.outcome, AcquireOutcome::ExceedsRate);
    }

    #[test]
    fn a_combined_reply_carries_each_limiters_error_after_the_integers() {
        let both = b"*16\r\n:1\r\n:4\r\n:4\r\n:5\r\n:2000\r\n:0\r\n:0\r\n:1\r\n:3\r\n:8\r\n:8\r\n:9\r\n:60000\r\n:0\r\n:0\r\n:0\r\n";
        let replies = decode_acquire_all_reply(both, 2).unwrap();
        assert_eq!(replies[0].as_ref().unwrap().outcome, AcquireOutcome::Acquired { remaining: 4 });
        assert_eq!(replies[1].as_ref().unwrap().outcome, AcquireOutcome::Untaken { available: 8 });
        // webdis re-encodes the integers as bulk strings and keeps the error text as it is.
        let error = "WRONGTYPE Operation against a key holding the wrong kind of value";
        let mut broken = b"*17\r\n".to_vec();
        for number in ["4", "0", "0", "0", "0", "0", "0", "0", "1", "8", "8", "9", "60000", "0", "0", "1"] {
            broken.extend_from_slice(format!("${}\r\n{number}\r\n", number.len()).as_bytes());
        }
        broken.extend_from_slice(format!("${}\r\n{error}\r\n", error.len()).as_bytes());
        let replies = decode_acquire_all_reply(&broken, 2).unwrap();
        assert_eq!(replies[0], Err(error.to_string()), "the first limiter's keys failed");
        assert_eq!(
            replies[1].as_ref().unwrap().outcome,
            AcquireOutcome::Acquired { remaining: 8 },
            "the other decided"
        );
        // A code 4 without its text, or a text without a code 4, is no reply the script gives.
        let mut missing = broken.clone();
        missing.truncate(broken.len() - error.len() - 6);
        missing[1..3].copy_from_slice(b"16");
        assert!(matches!(decode_acquire_all_reply(&missing, 2), Err(ReplyError::Unexpected(_))));
        let mut extra = both.to_vec();
        extra[1..3].copy_from_slice(b"17");
        extra.extend_from_slice(b"$3\r\nERR\r\n");
        assert!(matches!(decode_acquire_all_reply(&extra, 2), Err(ReplyError::Unexpected(_))));
        assert_eq!(
            decode_acquire_all_reply(b"-ERR whole call\r\n", 2),
            Err(ReplyError::Redis("ERR whole call".into())),
            "an error reply is the whole call's"
        );
    }

    #[test]
    fn error_and_malformed_replies_are_typed() {
        assert_eq!(
            decode_acquire_reply(b"-NOSCRIPT No matching script. Please use EVAL.\r\n"),
            Err(ReplyError::NoScript)
        );
        assert_eq!(
            decode_acquire_reply(b"-NOAUTH Authentication required.\r\n"),
            Err(ReplyError::Redis("NOAUTH Authentication required.".into()))
        );
        for bad in [
            &b"$-1\r\n"[..],
            b"*6\r\n:1\r\n:1\r\n:1\r\n:1\r\n:1\r\n:1\r\n",
            b"*3\r\n:0\r\n:1\r\n:1\r\n",
            b"*7\r\n:1\r\n:1\r\n:1\r\n:1\r\n:1\r\n:0\r\n:0\r\n",
            b"*8\r\n:5\r\n:1\r\n:1\r\n:1\r\n:1\r\n:0\r\n:0\r\n:0\r\n",
            b"*8\r\n:1\r\n:-1\r\n:1\r\n:1\r\n:1\r\n:0\r\n:0\r\n:1\r\n",
            b"*8\r\n:1\r\n:1\r\n:1\r\n:1\r\n:1\r\n:7\r\n:0\r\n:1\r\n",
            b"*2\r\n:4\r\n:-1\r\n",
            b"<html>",
            b"*3\r\n$1\r\nx\r\n:1\r\n:1\r\n",
        ] {
            assert!(
                matches!(decode_acquire_reply(bad), Err(ReplyError::Unexpected(_))),
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
    }
}
