//! The limiter as Redisson 4.x `RRateLimiter` lays it out in Redis (DESIGN.md), without I/O: the config
//! hash's fields parsed and checked, the permit members of the window decoded and summed (the filter's
//! reservations and settled costs apart, by their random bytes). Times are ms since the epoch, durations
//! ms, amounts permits.

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

/// The first bytes of the random part of a reservation's member: the filter's "reserve, then settle"
/// (rules with `cost`, issue 24) reserves permits at the request with a member whose random bytes are
/// `-r` and 14 base-62 characters (src/limiter/reservation.rs, `RESERVED_MARK`).
pub const RESERVED_MARK: &[u8] = b"-r";
/// The first bytes of the random part of a settled member: the reservation's, `-r` replaced by `-s`, once
/// the filter settled it at its real cost (GIVE_BACK with `renamed`; `SETTLED_MARK`).
pub const SETTLED_MARK: &[u8] = b"-s";

/// What a permit member is, by the first bytes of its random part. The filter's other members are 16
/// letters and digits, never `-`; Redisson's are 16 (or 8) random bytes, which start with one of the two
/// marks once in 32,768.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemberKind {
    /// An acquire, a lease, a Redisson client's: permits taken.
    Plain,
    /// [`RESERVED_MARK`]: a reservation in flight (its response has not ended).
    Reservation,
    /// [`SETTLED_MARK`]: a reservation settled at what its response really cost.
    Settled,
}

/// What the tool knows of one permit member.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Member {
    /// Length of its random part (16 for Redisson 4.x and the filter, 8 for Redisson 3.17-3.20).
    pub random_len: usize,
    /// Permits it took.
    pub permits: u32,
    /// What it is, by its random bytes.
    pub kind: MemberKind,
}

/// Decodes a member written by Lua `struct.pack('Bc0I', #random, random, permits)`: one length byte, the
/// random bytes, the permits as a 4-byte little-endian unsigned integer. `None` for any other shape.
pub fn decode_member(member: &[u8]) -> Option<Member> {
    let (&len, rest) = member.split_first()?;
    let random_len = usize::from(len);
    let random = rest.get(..random_len)?;
    let permits: [u8; 4] = rest.get(random_len..)?.try_into().ok()?;
    let kind = if random.starts_with(RESERVED_MARK) {
        MemberKind::Reservation
    } else if random.starts_with(SETTLED_MARK) {
        MemberKind::Settled
    } else {
        MemberKind::Plain
    };
    Some(Member { random_len, permits: u32::from_le_bytes(permits), kind })
}

/// One reservation or settled cost in the window.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Held {
    /// Permits it holds (reserved, or what the response cost).
    pub permits: u64,
    /// Its score: when it was reserved, ms since the epoch (a settled member keeps it).
    pub acquired_ms: u64,
    /// Its age at `now`, ms.
    pub age_ms: u64,
}

/// The members of one kind in the window ([`MemberKind::Reservation`] or [`MemberKind::Settled`]).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct HeldTotal {
    /// How many.
    pub count: u64,
    /// Their permits, summed.
    pub permits: u64,
    /// Each one, oldest first.
    pub members: Vec<Held>,
}

impl HeldTotal {
    fn add(&mut self, held: Held) {
        self.count += 1;
        self.permits += held.permits;
        self.members.push(held);
    }
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
    /// The filter's reservations in flight among them (random bytes `-r...`; counted in `acquires` and
    /// `permits` too).
    pub reservations: HeldTotal,
    /// The filter's settled costs among them (random bytes `-s...`; counted in `acquires` and `permits`
    /// too).
    pub settled: HeldTotal,
}

/// Summarizes the `(member, score)` pairs of the window (scores: acquire times, ms since the epoch) at
/// `now_ms` (ms since the epoch); reservations and settled costs are listed oldest first.
pub fn summarize(members: &[(Vec<u8>, f64)], now_ms: u64) -> Window {
    let mut window = Window {
        acquires: 0,
        permits: 0,
        oldest_ms: None,
        oldest_age_ms: None,
        newest_ms: None,
        newest_age_ms: None,
        unreadable: 0,
        reservations: HeldTotal::default(),
        settled: HeldTotal::default(),
    };
    for (member, score) in members {
        let score = score_ms(*score);
        match decode_member(member) {
            Some(decoded) => {
                window.acquires += 1;
                window.permits += u64::from(decoded.permits);
                let held = Held {
                    permits: u64::from(decoded.permits),
                    acquired_ms: score,
                    age_ms: now_ms.saturating_sub(score),
                };
                match decoded.kind {
                    MemberKind::Reservation => window.reservations.add(held),
                    MemberKind::Settled => window.settled.add(held),
                    MemberKind::Plain => {}
                }
            }
            None => window.unreadable += 1,
        }
        window.oldest_ms = Some(window.oldest_ms.map_or(score, |oldest| oldest.min(score)));
        window.newest_ms = Some(window.newest_ms.map_or(score, |newest| newest.max(score)));
    }
    window.oldest_age_ms = window.oldest_ms.map(|ms| now_ms.saturating_sub(ms));
    window.newest_age_ms = window.newest_ms.map(|ms| now_ms.saturating_sub(ms));
    for held in [&mut window.reservations, &mut window.settled] {
        held.members.sort_by_key(|member| member.acquired_ms);
    }
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

/// A permit member as the scripts count it: its score (acquire time, or a lease's end, ms since the epoch)
/// and the permits it took.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Permit {
    /// Score, ms since the epoch.
    pub score_ms: u64,
    /// Permits (0 for a member the tool cannot decode).
    pub permits: u64,
}

/// A value key as the scripts read it (`tonumber`), permits: below zero after a settled cost above its
/// reservation (GIVE_BACK charges the excess without a floor); an unreadable one counts 0.
pub fn parse_value(bytes: &[u8]) -> i64 {
    let text = String::from_utf8_lossy(bytes);
    text.trim().parse::<i64>().unwrap_or(0)
}

/// Permits as a signed amount (a value key may be below zero); beyond `i64::MAX` (never written), the most.
fn signed(permits: u64) -> i64 {
    i64::try_from(permits).unwrap_or(i64::MAX)
}

/// The permits of `(member, score)` pairs, oldest first.
pub fn permits_of(members: &[(Vec<u8>, f64)]) -> Vec<Permit> {
    let mut permits: Vec<Permit> = members
        .iter()
        .map(|(member, score)| Permit {
            score_ms: score_ms(*score),
            permits: decode_member(member).map_or(0, |m| u64::from(m.permits)),
        })
        .collect();
    permits.sort_by_key(|permit| permit.score_ms);
    permits
}

/// One window of a limiter as Redis holds it: the value key (available permits as last written, below
/// zero after a settled cost above its reservation; `None`: no such key) and every permit member, oldest
/// first.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Stored {
    /// The value key, permits.
    pub value: Option<i64>,
    /// The permit members, oldest first.
    pub permits: Vec<Permit>,
}

/// The gateway's clock guard for a window of `interval_ms`: it releases a permit `min(20, interval / 50)` ms
/// after the window passed it (the ACQUIRE and ACQUIRE_ALL scripts; docs/redisson.md, "Clocks").
pub fn clock_guard(interval_ms: u64) -> u64 {
    20.min(interval_ms / 50)
}

/// What the next acquire of a request would meet in one window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outlook {
    /// Admitted now; `remaining` such requests are admitted after it.
    Allowed {
        /// Requests asking as many permits admitted after this one (no other traffic).
        remaining: u64,
    },
    /// Rejected now.
    Rejected {
        /// Ms until enough permits left the window for it; `None` when the permits in the window never
        /// free enough (the value key counts fewer than the rate minus them).
        wait_ms: Option<u64>,
        /// Redisson's delay, the one the filter's `Retry-After` rounds up: 3 ms past the oldest permit's
        /// departure.
        delay_ms: u64,
    },
    /// It asks for more permits than the rate: no wait admits it.
    Never,
}

impl Stored {
    /// Permits free for an acquire at `at_ms`, as the acquire script counts them: a window without a value
    /// key is full; otherwise the value key plus the permits that left the window by then (scored at or
    /// before `at_ms - interval`), and when that passes the rate, the rate minus the permits still in it.
    /// Below zero while settled costs above their reservations are in the window.
    pub fn available_at(&self, rate: u64, interval_ms: u64, at_ms: u64) -> i64 {
        let rate = signed(rate);
        let Some(value) = self.value else { return rate };
        let cutoff = at_ms.saturating_sub(interval_ms);
        let (gone, kept): (Vec<&Permit>, Vec<&Permit>) = self.permits.iter().partition(|p| p.score_ms <= cutoff);
        let released: i64 = gone.iter().map(|p| signed(p.permits)).sum();
        if released == 0 {
            return value;
        }
        let value = value.saturating_add(released);
        if value > rate {
            rate.saturating_sub(kept.iter().map(|p| signed(p.permits)).sum())
        } else {
            value
        }
    }

    /// What the gateway's acquire of `permits` at `now_ms` meets: admitted (and how many more after it), or
    /// rejected and when enough permits will have left the window, or never (more than the rate). The
    /// gateway's window keeps a permit its clock guard longer than Redisson's ([`clock_guard`]).
    pub fn outlook(&self, rate: u64, interval_ms: u64, permits: u64, now_ms: u64) -> Outlook {
        if permits > rate {
            return Outlook::Never;
        }
        let guard_ms = clock_guard(interval_ms);
        let wanted = signed(permits);
        let available = self.available_at(rate, interval_ms, now_ms.saturating_sub(guard_ms));
        if available >= wanted {
            let left = u64::try_from(available - wanted).unwrap_or(0);
            return Outlook::Allowed { remaining: left / permits.max(1) };
        }
        let cutoff = now_ms.saturating_sub(interval_ms).saturating_sub(guard_ms);
        let in_window = self.permits.iter().filter(|p| p.score_ms > cutoff);
        // Redisson's delay counts from the oldest permit still in the window (none: a whole interval), and
        // the gateway's adds its guard.
        let oldest = in_window.clone().map(|p| p.score_ms).min().unwrap_or(now_ms);
        let delay_ms = oldest.saturating_add(interval_ms + guard_ms).saturating_add(3).saturating_sub(now_ms);
        let wait_ms = in_window
            .map(|p| p.score_ms.saturating_add(interval_ms))
            .find(|&leaves| self.available_at(rate, interval_ms, leaves) >= wanted)
            .map(|leaves| leaves.saturating_add(guard_ms).saturating_sub(now_ms));
        Outlook::Rejected { wait_ms, delay_ms }
    }

    /// The window after `updateRate` to `rate` per `interval_ms` at `now_ms` (same type): the permits that
    /// left the new window dropped, the value key the rate minus the permits still in it, at least 0.
    pub fn updated(&self, rate: u64, interval_ms: u64, now_ms: u64) -> Stored {
        let cutoff = now_ms.saturating_sub(interval_ms);
        let permits: Vec<Permit> = self.permits.iter().copied().filter(|p| p.score_ms > cutoff).collect();
        let used: u64 = permits.iter().map(|p| p.permits).sum();
        Stored { value: Some(signed(rate.saturating_sub(used))), permits }
    }
}

/// What the next acquire of a rule does to its limiter's config before acquiring (the acquire script).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum ConfigStep {
    /// No limiter (or one not initialized): created with the rule's config, starting full.
    Create,
    /// The limiter's config is obeyed as Redis holds it (the rule's, or `rate_source: "redis"`).
    Obey,
    /// `rate_source: "config"`: updated to the rule's config keeping consumed permits.
    Update,
    /// `rate_source: "config"`, but another writer changed the config after the rule: it stands.
    Stand,
}

/// A config as the `erlRuleConfig` field records it: `rate:interval:type:keepAliveTime`.
pub fn config_record(config: &Config) -> String {
    config.script_args().join(":")
}

/// The config the next acquire of a rule obeys, and how it gets there: `rule` is the rule's config,
/// `apply` whether it has `rate_source: "config"`, `held` the config in Redis (`None`: no limiter, or not
/// initialized) and `record` its `erlRuleConfig` field.
pub fn next_config(rule: &Config, apply: bool, held: Option<&Config>, record: Option<&str>) -> (ConfigStep, Config) {
    let Some(held) = held else { return (ConfigStep::Create, *rule) };
    if !apply || held == rule {
        return (ConfigStep::Obey, *held);
    }
    if record.is_none_or(|record| record == config_record(held)) {
        (ConfigStep::Update, *rule)
    } else {
        (ConfigStep::Stand, *held)
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
        assert_eq!(decode_member(&member), Some(Member { random_len: 16, permits: 3, kind: MemberKind::Plain }));
        let mut old = vec![8u8];
        old.extend([1u8; 8]);
        old.extend(258u32.to_le_bytes());
        assert_eq!(decode_member(&old), Some(Member { random_len: 8, permits: 258, kind: MemberKind::Plain }));
        let marked = |random: &[u8]| [&[16u8][..], random, &9u32.to_le_bytes()].concat();
        assert_eq!(decode_member(&marked(b"-rA1b2C3d4E5f6G7")).map(|m| m.kind), Some(MemberKind::Reservation));
        assert_eq!(decode_member(&marked(b"-sA1b2C3d4E5f6G7")).map(|m| m.kind), Some(MemberKind::Settled));
        assert_eq!(decode_member(&marked(b"r-A1b2C3d4E5f6G7")).map(|m| m.kind), Some(MemberKind::Plain));
        assert_eq!(decode_member(&[1, b'-', 1, 0, 0, 0]).map(|m| m.kind), Some(MemberKind::Plain), "1 byte: no mark");
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
        assert_eq!((window.reservations.count, window.settled.count), (0, 0), "no marked member");
    }

    #[test]
    fn reservations_and_settled_costs_are_listed_apart_oldest_first_with_totals() {
        let member =
            |random: &[u8; 16], permits: u32| [vec![16u8], random.to_vec(), permits.to_le_bytes().to_vec()].concat();
        let members = vec![
            (member(b"-rBBBBBBBBBBBBBB", 500), 1_700.0),
            (member(b"-sCCCCCCCCCCCCCC", 123), 1_100.0),
            (member(b"0123456789abcdef", 1), 1_200.0),
            (member(b"-rAAAAAAAAAAAAAA", 400), 1_300.0),
            (member(b"-sDDDDDDDDDDDDDD", 40), 1_600.0),
        ];
        let window = summarize(&members, 2_000);
        assert_eq!((window.acquires, window.permits), (5, 1_064), "marked members count as acquires too");
        let held = |permits, acquired_ms| Held { permits, acquired_ms, age_ms: 2_000 - acquired_ms };
        assert_eq!(
            window.reservations,
            HeldTotal { count: 2, permits: 900, members: vec![held(400, 1_300), held(500, 1_700)] }
        );
        assert_eq!(
            window.settled,
            HeldTotal { count: 2, permits: 163, members: vec![held(123, 1_100), held(40, 1_600)] }
        );
        let json = serde_json::to_value(&window.reservations).unwrap();
        assert_eq!(
            json,
            serde_json::json!({"count": 2, "permits": 900, "members": [
                {"permits": 400, "acquired_ms": 1300, "age_ms": 700},
                {"permits": 500, "acquired_ms": 1700, "age_ms": 300}]})
        );
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

    fn permit(score_ms: u64, permits: u64) -> Permit {
        Permit { score_ms, permits }
    }

    #[test]
    fn counts_and_permits_read_as_the_scripts_read_them() {
        assert_eq!((parse_value(b"7"), parse_value(b"-3"), parse_value(b"x")), (7, -3, 0));
        let member = |permits: u32| [vec![16u8], vec![1u8; 16], permits.to_le_bytes().to_vec()].concat();
        let members = vec![(member(2), 2_000.0), (member(1), 1_000.0), (b"junk".to_vec(), 1_500.0)];
        assert_eq!(permits_of(&members), vec![permit(1_000, 1), permit(1_500, 0), permit(2_000, 2)]);
    }

    #[test]
    fn available_permits_count_what_left_the_window_as_the_acquire_does() {
        // 5 per 1 s; three permits taken at 1000, 1200 and 1900 ms.
        let stored = Stored { value: Some(2), permits: vec![permit(1_000, 1), permit(1_200, 1), permit(1_900, 1)] };
        assert_eq!(stored.available_at(5, 1_000, 1_999), 2, "none left yet");
        assert_eq!(stored.available_at(5, 1_000, 2_000), 3, "a permit leaves at its score + interval");
        assert_eq!(stored.available_at(5, 1_000, 2_900), 5);
        assert_eq!(Stored::default().available_at(5, 1_000, 0), 5, "no value key: full");
        // A value key above the rate minus the permits in the window is capped once something is released.
        let skewed = Stored { value: Some(5), permits: vec![permit(1_000, 1), permit(1_900, 2)] };
        assert_eq!(skewed.available_at(5, 1_000, 1_500), 5, "nothing released: the value key as it is");
        assert_eq!(skewed.available_at(5, 1_000, 2_000), 3, "released: the rate minus the 2 still in the window");
    }

    #[test]
    fn outlooks_say_how_many_more_or_how_long_to_wait() {
        let full = Stored { value: Some(0), permits: vec![permit(1_000, 1), permit(1_200, 1), permit(1_900, 1)] };
        assert_eq!(
            full.outlook(3, 1_000, 1, 1_500),
            Outlook::Rejected { wait_ms: Some(520), delay_ms: 523 },
            "the oldest leaves at 2000 and the gateway's guard (20 ms); Redisson's delay adds 3 ms"
        );
        assert_eq!(
            full.outlook(3, 1_000, 2, 1_500),
            Outlook::Rejected { wait_ms: Some(720), delay_ms: 523 },
            "two permits: until the second oldest leaves too (Retry-After counts only the oldest)"
        );
        assert_eq!(full.outlook(3, 1_000, 4, 1_500), Outlook::Never);
        let room = Stored { value: Some(7), permits: vec![permit(1_000, 3)] };
        assert_eq!(room.outlook(10, 1_000, 2, 1_500), Outlook::Allowed { remaining: 2 });
        assert_eq!(room.outlook(10, 1_000, 1, 1_500), Outlook::Allowed { remaining: 6 });
        let stuck = Stored { value: Some(0), permits: Vec::new() };
        assert_eq!(stuck.outlook(3, 1_000, 1, 1_500), Outlook::Rejected { wait_ms: None, delay_ms: 1_023 });
    }

    #[test]
    fn a_value_below_zero_waits_until_enough_settled_permits_leave() {
        // 10 per 1 s: a cost settled at 15 (reserved 4) at 1100 and one at 2 at 1000 left the value at -7.
        let charged = Stored { value: Some(-7), permits: vec![permit(1_000, 2), permit(1_100, 15)] };
        assert_eq!(charged.available_at(10, 1_000, 1_500), -7);
        assert_eq!(charged.available_at(10, 1_000, 2_000), -5, "the 2 left, still below zero");
        assert_eq!(charged.available_at(10, 1_000, 2_100), 10);
        assert_eq!(
            charged.outlook(10, 1_000, 1, 1_500),
            Outlook::Rejected { wait_ms: Some(620), delay_ms: 523 },
            "Retry-After counts to the oldest, the wait to the 15"
        );
        assert_eq!(charged.outlook(10, 1_000, 1, 2_100), Outlook::Rejected { wait_ms: Some(20), delay_ms: 23 });
        assert_eq!(charged.outlook(10, 1_000, 1, 2_120), Outlook::Allowed { remaining: 9 });
        assert_eq!(charged.updated(10, 1_000, 1_500).value, Some(0), "updateRate: never below 0");
    }

    #[test]
    fn an_update_keeps_the_permits_of_the_new_window() {
        let stored = Stored { value: Some(0), permits: vec![permit(1_000, 1), permit(1_900, 2)] };
        assert_eq!(stored.updated(10, 500, 2_000), Stored { value: Some(8), permits: vec![permit(1_900, 2)] });
        assert_eq!(stored.updated(2, 5_000, 2_000).value, Some(0), "never below 0");
    }

    #[test]
    fn the_next_acquire_creates_obeys_updates_or_leaves_a_config() {
        let rule = Config { rate: 5, interval_ms: 1_000, limiter_type: LimiterType::Overall, keep_alive_ms: 0 };
        let other = Config { rate: 9, ..rule };
        assert_eq!(next_config(&rule, false, None, None), (ConfigStep::Create, rule));
        assert_eq!(next_config(&rule, false, Some(&other), None), (ConfigStep::Obey, other), "rate_source redis");
        assert_eq!(next_config(&rule, true, Some(&rule), None), (ConfigStep::Obey, rule));
        assert_eq!(next_config(&rule, true, Some(&other), None), (ConfigStep::Update, rule), "no record");
        assert_eq!(config_record(&other), "9:1000:0:0");
        assert_eq!(next_config(&rule, true, Some(&other), Some("9:1000:0:0")), (ConfigStep::Update, rule));
        assert_eq!(next_config(&rule, true, Some(&other), Some("5:1000:0:0")), (ConfigStep::Stand, other));
    }
}
