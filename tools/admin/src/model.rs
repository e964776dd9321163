//! The limiter as Redisson 4.x `RRateLimiter` lays it out in Redis (DESIGN.md), without I/O: the config
//! hash's fields parsed and checked, the permit members of the window decoded and summed. Times are ms
//! since the epoch, durations ms.

use edge_rate_limiter::config::LimiterType;
use serde::Serialize;

use crate::error::{AdminError, Result};
use crate::units::human_ms;

/// A limiter's config, as the fields of its hash.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Config {
    /// `rate`: permits per interval.
    pub rate: u64,
    /// `interval`: the window, ms.
    pub interval_ms: u64,
    /// `type`: `"0"` overall, `"1"` per client.
    #[serde(rename = "type", serialize_with = "serialize_type")]
    pub limiter_type: LimiterType,
    /// `keepAliveTime`: ms after which unused keys expire; 0 = never (absent, as Redisson < 3.36 writes).
    pub keep_alive_ms: u64,
}

fn serialize_type<S: serde::Serializer>(limiter_type: &LimiterType, serializer: S) -> Result<S::Ok, S::Error> {
    serializer.serialize_str(type_name(*limiter_type))
}

/// The type as the tool names it: `overall` or `per-client`.
pub fn type_name(limiter_type: LimiterType) -> &'static str {
    match limiter_type {
        LimiterType::Overall => "overall",
        LimiterType::PerClient => "per-client",
    }
}

impl Config {
    /// The arguments the filter's `SET_RATE`, `TRY_SET_RATE` and `UPDATE_RATE` scripts take first, as
    /// text: rate, interval (ms), type (Redisson's ordinal), keepAliveTime (ms).
    pub fn script_args(&self) -> [String; 4] {
        [
            self.rate.to_string(),
            self.interval_ms.to_string(),
            self.limiter_type.redisson_ordinal().to_string(),
            self.keep_alive_ms.to_string(),
        ]
    }
}

/// The config from the values of `HMGET name rate interval type keepAliveTime`.
///
/// # Errors
/// [`AdminError::NotInitialized`] when `rate`, `interval` or `type` is missing,
/// [`AdminError::InvalidConfig`] when a field is not what Redisson writes.
pub fn parse_config(name: &str, fields: &[Option<Vec<u8>>; 4]) -> Result<Config> {
    let [rate, interval, limiter_type, keep_alive] = fields;
    let number = |field: &'static str, value: &Option<Vec<u8>>, min: u64| -> Result<u64> {
        let value = value.as_ref().ok_or(AdminError::NotInitialized { name: name.to_string(), field })?;
        let text = String::from_utf8_lossy(value);
        text.parse::<u64>().ok().filter(|n| *n >= min).ok_or_else(|| AdminError::InvalidConfig {
            name: name.to_string(),
            field,
            value: text.into_owned(),
        })
    };
    let rate = number("rate", rate, 1)?;
    let interval_ms = number("interval", interval, 1)?;
    let ordinal = number("type", limiter_type, 0)?;
    let limiter_type = i64::try_from(ordinal).ok().and_then(LimiterType::from_redisson_ordinal).ok_or_else(|| {
        AdminError::InvalidConfig { name: name.to_string(), field: "type", value: ordinal.to_string() }
    })?;
    let keep_alive_ms = match keep_alive {
        None => 0,
        some => number("keepAliveTime", some, 0)?,
    };
    Ok(Config { rate, interval_ms, limiter_type, keep_alive_ms })
}

/// Checks the rule the filter's configuration enforces too: keep-alive 0 or at least the interval (a
/// shorter expiry would forget permits still in the window).
///
/// # Errors
/// [`AdminError::Usage`], naming both durations.
pub fn check_keep_alive(config: &Config) -> Result<()> {
    if config.keep_alive_ms != 0 && config.keep_alive_ms < config.interval_ms {
        return Err(AdminError::Usage(format!(
            "keep-alive {} is shorter than the interval {}: use 0 (never expire) or at least the interval",
            human_ms(config.keep_alive_ms),
            human_ms(config.interval_ms)
        )));
    }
    Ok(())
}

/// The changes `update-rate` asks for; `None` keeps the current value.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Update {
    /// New rate, permits per interval.
    pub rate: Option<u64>,
    /// New interval, ms.
    pub interval_ms: Option<u64>,
    /// New type.
    pub limiter_type: Option<LimiterType>,
    /// New keepAliveTime, ms (0 = never expire).
    pub keep_alive_ms: Option<u64>,
}

impl Update {
    /// `current` with the changes applied (not checked: see [`check_keep_alive`]).
    pub fn apply(&self, current: &Config) -> Config {
        Config {
            rate: self.rate.unwrap_or(current.rate),
            interval_ms: self.interval_ms.unwrap_or(current.interval_ms),
            limiter_type: self.limiter_type.unwrap_or(current.limiter_type),
            keep_alive_ms: self.keep_alive_ms.unwrap_or(current.keep_alive_ms),
        }
    }
}

/// What the tool knows of one permit member.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Member {
    /// Length of its random part (16 for Redisson 4.x and the filter, 8 for Redisson 3.17-3.20).
    pub random_len: usize,
    /// Permits it took.
    pub permits: u32,
}

/// Decodes a member written by Lua `struct.pack('Bc0I', #random, random, permits)`: one length byte, the
/// random bytes, the permits as a 4-byte little-endian unsigned integer. `None` for any other shape.
pub fn decode_member(member: &[u8]) -> Option<Member> {
    let (&len, rest) = member.split_first()?;
    let random_len = usize::from(len);
    let permits: [u8; 4] = rest.get(random_len..)?.try_into().ok()?;
    Some(Member { random_len, permits: u32::from_le_bytes(permits) })
}

/// The permits currently in a limiter's window.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Window {
    /// Members (successful acquires) in the window.
    pub acquires: u64,
    /// Permits they took.
    pub permits: u64,
    /// Acquire time of the oldest, ms since the epoch.
    pub oldest_ms: Option<u64>,
    /// Its age at `now`, ms.
    pub oldest_age_ms: Option<u64>,
    /// Acquire time of the newest, ms since the epoch.
    pub newest_ms: Option<u64>,
    /// Its age at `now`, ms.
    pub newest_age_ms: Option<u64>,
    /// Members in the sorted set that the tool cannot decode (not Redisson's `Bc0I` format).
    pub unreadable: u64,
}

/// Summarizes the `(member, score)` pairs of the window (scores: acquire times, ms since the epoch) at
/// `now_ms` (ms since the epoch).
pub fn summarize(members: &[(Vec<u8>, f64)], now_ms: u64) -> Window {
    let mut window = Window {
        acquires: 0,
        permits: 0,
        oldest_ms: None,
        oldest_age_ms: None,
        newest_ms: None,
        newest_age_ms: None,
        unreadable: 0,
    };
    for (member, score) in members {
        match decode_member(member) {
            Some(decoded) => {
                window.acquires += 1;
                window.permits += u64::from(decoded.permits);
            }
            None => window.unreadable += 1,
        }
        let score = score_ms(*score);
        window.oldest_ms = Some(window.oldest_ms.map_or(score, |oldest| oldest.min(score)));
        window.newest_ms = Some(window.newest_ms.map_or(score, |newest| newest.max(score)));
    }
    window.oldest_age_ms = window.oldest_ms.map(|ms| now_ms.saturating_sub(ms));
    window.newest_age_ms = window.newest_ms.map(|ms| now_ms.saturating_sub(ms));
    window
}

/// A sorted-set score (acquire time, ms) as an integer; negative or not finite scores count as 0.
#[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
fn score_ms(score: f64) -> u64 {
    if score.is_finite() && score > 0.0 {
        score as u64
    } else {
        0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fields(rate: &str, interval: &str, ty: &str, keep: Option<&str>) -> [Option<Vec<u8>>; 4] {
        [Some(rate.into()), Some(interval.into()), Some(ty.into()), keep.map(Into::into)]
    }

    #[test]
    fn configs_parse_as_redisson_writes_them() {
        let config = parse_config("n", &fields("5", "60000", "1", Some("3600000"))).unwrap();
        assert_eq!(
            config,
            Config { rate: 5, interval_ms: 60_000, limiter_type: LimiterType::PerClient, keep_alive_ms: 3_600_000 }
        );
        assert_eq!(parse_config("n", &fields("5", "1000", "0", None)).unwrap().keep_alive_ms, 0);
    }

    #[test]
    fn missing_and_invalid_fields_are_named() {
        let no_rate = [None, Some(b"1000".to_vec()), Some(b"0".to_vec()), None];
        assert_eq!(parse_config("n", &no_rate), Err(AdminError::NotInitialized { name: "n".into(), field: "rate" }));
        assert_eq!(
            parse_config("n", &fields("0", "1000", "0", None)),
            Err(AdminError::InvalidConfig { name: "n".into(), field: "rate", value: "0".into() })
        );
        assert_eq!(
            parse_config("n", &fields("5", "1000", "7", None)),
            Err(AdminError::InvalidConfig { name: "n".into(), field: "type", value: "7".into() })
        );
        assert!(matches!(
            parse_config("n", &fields("5", "x", "0", None)),
            Err(AdminError::InvalidConfig { field: "interval", .. })
        ));
    }

    #[test]
    fn members_decode_as_bc0i() {
        let mut member = vec![16u8];
        member.extend([7u8; 16]);
        member.extend(3u32.to_le_bytes());
        assert_eq!(decode_member(&member), Some(Member { random_len: 16, permits: 3 }));
        let mut old = vec![8u8];
        old.extend([1u8; 8]);
        old.extend(258u32.to_le_bytes());
        assert_eq!(decode_member(&old), Some(Member { random_len: 8, permits: 258 }));
        assert_eq!(decode_member(&member[..20]), None, "truncated");
        assert_eq!(decode_member(&[member.clone(), vec![0]].concat()), None, "trailing byte");
        assert_eq!(decode_member(b""), None);
    }

    #[test]
    fn windows_sum_permits_and_find_the_oldest_and_newest() {
        let member = |permits: u32| [vec![16u8], vec![0u8; 16], permits.to_le_bytes().to_vec()].concat();
        let members = vec![(member(1), 1_000.0), (member(2), 1_500.0), (b"junk".to_vec(), 1_200.0)];
        let window = summarize(&members, 2_000);
        assert_eq!((window.acquires, window.permits, window.unreadable), (2, 3, 1));
        assert_eq!((window.oldest_ms, window.oldest_age_ms), (Some(1_000), Some(1_000)));
        assert_eq!((window.newest_ms, window.newest_age_ms), (Some(1_500), Some(500)));
        assert_eq!(summarize(&[], 5).oldest_ms, None);
    }

    #[test]
    fn keep_alive_must_cover_the_interval() {
        let config = Config { rate: 1, interval_ms: 60_000, limiter_type: LimiterType::Overall, keep_alive_ms: 1_000 };
        assert!(check_keep_alive(&config).is_err());
        assert!(check_keep_alive(&Config { keep_alive_ms: 0, ..config }).is_ok());
        assert!(check_keep_alive(&Config { keep_alive_ms: 60_000, ..config }).is_ok());
    }

    #[test]
    fn updates_keep_what_they_do_not_change() {
        let current = Config { rate: 5, interval_ms: 60_000, limiter_type: LimiterType::Overall, keep_alive_ms: 0 };
        assert_eq!(Update::default().apply(&current), current);
        let update = Update { rate: Some(9), keep_alive_ms: Some(120_000), ..Update::default() };
        assert_eq!(update.apply(&current), Config { rate: 9, keep_alive_ms: 120_000, ..current });
    }
}
