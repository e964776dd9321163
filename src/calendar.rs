//! Calendar periods in a time zone (a rule's `calendar`: docs/configuration.md, "Calendar quotas"): which
//! minute, hour, day, ISO week, month or year of a zone's local time an instant falls in, as UTC instants.
//!
//! A zone is a POSIX TZ rule (POSIX.1-2017 section 8.3 `TZ`, with RFC 8536 section 3.3's extensions: hours
//! up to 167 and negative in a transition's time), given in the configuration or found by its IANA name in
//! [`ZONES`]: the rule each zone's tzdata file ends with (its footer, RFC 8536 section 3.3), which gives the
//! zone's offsets from its last listed transition on. Local times are converted as Python's `zoneinfo` does
//! (PEP 495, `fold=0`): a local time that occurs twice is its first occurrence, one that a DST change skips
//! is read with the offset before the change. tests/calendar_zoneinfo.rs checks every boundary against
//! `zoneinfo` for 10 years.

use crate::prelude::*;
use crate::quote::quoted;

/// IANA zone names by their POSIX TZ rule, one rule a line, `rule<TAB>Area/City,City;Area/City` (`/UTC`):
/// the canonical zones of tzdata's `zone1970.tab` (and `UTC`), each rule the footer of
/// `/usr/share/zoneinfo/<name>` (Debian tzdata), written by scripts/zones.py ([`zone_names`] lists them). Zones whose future the footer does not give (Morocco's, whose DST
/// follows Ramadan and is listed transition by transition) are left out.
pub const ZONES: &str = include_str!("calendar_zones.tsv");

/// The POSIX TZ rule of IANA zone `name` in [`ZONES`].
fn rule_of(name: &str) -> Option<&'static str> {
    let (area, city) = name.rsplit_once('/').unwrap_or(("", name));
    ZONES.lines().find_map(|line| {
        let (rule, groups) = line.split_once('\t')?;
        let listed = groups.split(';').filter_map(|group| group.rsplit_once('/'));
        listed.into_iter().any(|(a, cities)| a == area && cities.split(',').any(|c| c == city)).then_some(rule)
    })
}

/// Every IANA name of [`ZONES`] (`Area/City`, or `UTC`).
pub fn zone_names() -> impl Iterator<Item = String> {
    ZONES.lines().filter_map(|line| line.split_once('\t')).flat_map(|(_, groups)| {
        groups.split(';').filter_map(|group| group.rsplit_once('/')).flat_map(|(area, cities)| {
            cities.split(',').map(move |city| if area.is_empty() { city.to_string() } else { format!("{area}/{city}") })
        })
    })
}

/// A calendar period of local time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Period {
    /// A minute of local time.
    Minute,
    /// An hour of local time.
    Hour,
    /// A day, from local midnight.
    Day,
    /// An ISO 8601 week, from Monday's local midnight.
    Week,
    /// A month, from its first day's local midnight.
    Month,
    /// A year, from January 1st's local midnight.
    Year,
}

/// A time zone as a POSIX TZ rule: its standard offset and, if it has one, its daylight saving time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Zone {
    /// Standard time's offset from UTC, seconds east.
    std_offset_s: i64,
    /// Daylight saving time, when the zone has it.
    dst: Option<Dst>,
}

/// A zone's daylight saving time: its offset and when it starts and ends each year.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Dst {
    /// Offset from UTC during DST, seconds east.
    offset_s: i64,
    /// When it starts, in standard local time.
    start: Transition,
    /// When it ends, in DST local time.
    end: Transition,
}

/// A day of the year and a local time of it (seconds, -167 h to 167 h).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Transition {
    day: TransitionDay,
    time_s: i64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TransitionDay {
    /// `Jn`: day 1..=365, February 29th never counted.
    Julian(i64),
    /// `n`: day 0..=365, February 29th counted.
    ZeroBased(i64),
    /// `Mm.w.d`: weekday `d` (0 Sunday) of week `w` (1..=5, 5 the last) of month `m`.
    Weekday { month: i64, week: i64, weekday: i64 },
}

impl Zone {
    /// A zone by its IANA name ([`ZONES`]), or a POSIX TZ rule itself (`"CET-1CEST,M3.5.0,M10.5.0/3"`).
    ///
    /// # Errors
    /// A sentence saying why: an unknown name, or a rule that does not parse.
    pub fn named(name: &str) -> Result<Zone, String> {
        match rule_of(name) {
            Some(rule) => Zone::parse(rule),
            None if name.contains('/') || !name.bytes().any(|b| b.is_ascii_digit()) => Err(format!(
                "unknown time zone {}: an IANA name of tzdata's zone1970.tab, or a POSIX TZ rule",
                quoted(name)
            )),
            None => Zone::parse(name),
        }
    }

    /// Parses a POSIX TZ rule: `std offset [dst [offset] ,start[/time],end[/time]]`.
    ///
    /// # Errors
    /// A sentence saying what does not parse.
    pub fn parse(rule: &str) -> Result<Zone, String> {
        let bad = |why: &str| format!("POSIX TZ rule {}: {why}", quoted(rule));
        let mut rest = rule.as_bytes();
        designation(&mut rest).ok_or_else(|| bad("no standard time name"))?;
        let std_offset_s = -clock(&mut rest, 24, true).ok_or_else(|| bad("no standard offset"))?;
        if rest.is_empty() {
            return Ok(Zone { std_offset_s, dst: None });
        }
        designation(&mut rest).ok_or_else(|| bad("no daylight saving time name"))?;
        let offset_s = match rest.first() {
            Some(b',') => std_offset_s + 3600,
            _ => -clock(&mut rest, 24, true).ok_or_else(|| bad("a bad daylight saving offset"))?,
        };
        let start = transition(&mut rest).ok_or_else(|| bad("a bad start of daylight saving time"))?;
        let end = transition(&mut rest).ok_or_else(|| bad("a bad end of daylight saving time"))?;
        if !rest.is_empty() {
            return Err(bad("unexpected text at its end"));
        }
        Ok(Zone { std_offset_s, dst: Some(Dst { offset_s, start, end }) })
    }

    /// The offset from UTC at `utc_s` (seconds since the epoch), seconds east.
    pub fn offset_at(&self, utc_s: i64) -> i64 {
        let Some(dst) = &self.dst else { return self.std_offset_s };
        let (year, _, _) = civil_from_days((utc_s + self.std_offset_s).div_euclid(86_400));
        let start = dst.start.local_s(year) - self.std_offset_s;
        let end = dst.end.local_s(year) - dst.offset_s;
        let in_dst = if start < end { utc_s >= start && utc_s < end } else { utc_s < end || utc_s >= start };
        if in_dst {
            dst.offset_s
        } else {
            self.std_offset_s
        }
    }

    /// The UTC instant of local time `local_s` (seconds since the epoch of local time), as `zoneinfo` with
    /// `fold=0`: the first of two, or, in a gap, read with the offset before it.
    fn utc_of(&self, local_s: i64) -> i64 {
        let Some(dst) = &self.dst else { return local_s - self.std_offset_s };
        let valid = |offset: i64| self.offset_at(local_s - offset) == offset;
        let (a, b) = (local_s - self.std_offset_s, local_s - dst.offset_s);
        match (valid(self.std_offset_s), valid(dst.offset_s)) {
            (true, true) => a.min(b),
            (true, false) => a,
            (false, true) => b,
            (false, false) => a.max(b),
        }
    }

    /// The period of local time that instant `now_ms` (ms since the epoch) falls in: its start and its end
    /// (the next period's start), ms since the epoch. A period whose local start a DST change skips starts
    /// when the change happens (as `zoneinfo` reads the skipped time); an instant past such a change but
    /// before its period's start so read belongs to the period before.
    pub fn period(&self, period: Period, now_ms: u64) -> (u64, u64) {
        let utc_s = i64::try_from(now_ms / 1000).unwrap_or(i64::MAX / 2);
        let (start, next) = bounds(period, utc_s + self.offset_at(utc_s));
        let ms = |local: i64| u64::try_from(self.utc_of(local)).unwrap_or(0).saturating_mul(1000);
        let start_ms = ms(start);
        if start_ms > now_ms {
            return (ms(bounds(period, start - 1).0), start_ms);
        }
        (start_ms, ms(next))
    }
}

/// The local start of the period that local time `local_s` falls in, and the next period's.
fn bounds(period: Period, local_s: i64) -> (i64, i64) {
    let days = local_s.div_euclid(86_400);
    match period {
        Period::Minute => (local_s - local_s.rem_euclid(60), local_s - local_s.rem_euclid(60) + 60),
        Period::Hour => (local_s - local_s.rem_euclid(3600), local_s - local_s.rem_euclid(3600) + 3600),
        Period::Day => (days * 86_400, (days + 1) * 86_400),
        Period::Week => {
            let monday = days - (days + 3).rem_euclid(7);
            (monday * 86_400, (monday + 7) * 86_400)
        }
        Period::Month | Period::Year => {
            let (year, month, _) = civil_from_days(days);
            let (first, after) = match period {
                Period::Month if month == 12 => ((year, 12), (year + 1, 1)),
                Period::Month => ((year, month), (year, month + 1)),
                _ => ((year, 1), (year + 1, 1)),
            };
            (days_from_civil(first.0, first.1, 1) * 86_400, days_from_civil(after.0, after.1, 1) * 86_400)
        }
    }
}

impl Period {
    /// Its nominal length, ms (a month 30 days, a year 365): what stands for it where a rule needs one
    /// interval (the degraded mode's local windows, `RateLimit-Policy`'s `w`).
    pub fn nominal_ms(self) -> u64 {
        match self {
            Period::Minute => 60_000,
            Period::Hour => 3_600_000,
            Period::Day => 86_400_000,
            Period::Week => 7 * 86_400_000,
            Period::Month => 30 * 86_400_000,
            Period::Year => 365 * 86_400_000,
        }
    }
}

impl Transition {
    /// Its local time in `year`, seconds since the epoch of local time.
    fn local_s(&self, year: i64) -> i64 {
        let leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
        let jan1 = days_from_civil(year, 1, 1);
        let day = match self.day {
            TransitionDay::Julian(n) => jan1 + n - 1 + i64::from(leap && n >= 60),
            TransitionDay::ZeroBased(n) => jan1 + n,
            TransitionDay::Weekday { month, week, weekday } => {
                let first = days_from_civil(year, month, 1);
                let first_weekday = (first + 4).rem_euclid(7); // 1970-01-01 was a Thursday (4).
                let mut day = first + (weekday - first_weekday).rem_euclid(7) + (week - 1) * 7;
                let next_month =
                    if month == 12 { days_from_civil(year + 1, 1, 1) } else { days_from_civil(year, month + 1, 1) };
                while day >= next_month {
                    day -= 7;
                }
                day
            }
        };
        day * 86_400 + self.time_s
    }
}

/// A zone designation: 3 or more letters, or `<` signs, digits and letters `>`.
fn designation(rest: &mut &[u8]) -> Option<()> {
    let length = match rest.first()? {
        b'<' => rest.iter().position(|&b| b == b'>')? + 1,
        _ => rest.iter().position(|b| !b.is_ascii_alphabetic()).unwrap_or(rest.len()),
    };
    (length >= 3).then(|| *rest = rest.get(length..).unwrap_or_default())
}

/// `[+-]hh[:mm[:ss]]` as seconds (hours up to `max_hours`; a sign only when `signed`).
fn clock(rest: &mut &[u8], max_hours: i64, signed: bool) -> Option<i64> {
    let sign = match rest.first() {
        Some(b'-') if signed => -1,
        _ => 1,
    };
    if matches!(rest.first(), Some(b'-' | b'+')) && signed {
        *rest = rest.get(1..)?;
    }
    let mut seconds = 0;
    for (part, limit) in [(3600, max_hours), (60, 59), (1, 59)] {
        let digits = rest.iter().take_while(|b| b.is_ascii_digit()).count();
        if digits == 0 || digits > 3 {
            return (part != 3600).then_some(sign * seconds);
        }
        let value: i64 = core::str::from_utf8(rest.get(..digits)?).ok()?.parse().ok()?;
        if value > limit {
            return None;
        }
        seconds += value * part;
        *rest = rest.get(digits..)?;
        if part == 1 || rest.first() != Some(&b':') {
            return Some(sign * seconds);
        }
        *rest = rest.get(1..)?;
    }
    Some(sign * seconds)
}

/// `,Jn[/time]`, `,n[/time]` or `,Mm.w.d[/time]` (time default 02:00:00).
fn transition(rest: &mut &[u8]) -> Option<Transition> {
    *rest = rest.strip_prefix(b",")?;
    let number = |rest: &mut &[u8], max: i64| -> Option<i64> {
        let digits = rest.iter().take_while(|b| b.is_ascii_digit()).count();
        let value: i64 = core::str::from_utf8(rest.get(..digits)?).ok()?.parse().ok()?;
        *rest = rest.get(digits..)?;
        (digits > 0 && value <= max).then_some(value)
    };
    let day = match rest.first()? {
        b'J' => {
            *rest = rest.get(1..)?;
            TransitionDay::Julian(number(rest, 365).filter(|&n| n >= 1)?)
        }
        b'M' => {
            *rest = rest.get(1..)?;
            let month = number(rest, 12).filter(|&m| m >= 1)?;
            *rest = rest.strip_prefix(b".")?;
            let week = number(rest, 5).filter(|&w| w >= 1)?;
            *rest = rest.strip_prefix(b".")?;
            TransitionDay::Weekday { month, week, weekday: number(rest, 6)? }
        }
        _ => TransitionDay::ZeroBased(number(rest, 365)?),
    };
    let time_s = match rest.strip_prefix(b"/") {
        Some(after) => {
            *rest = after;
            clock(rest, 167, true)?
        }
        None => 7200,
    };
    Some(Transition { day, time_s })
}

/// Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's `days_from_civil`).
fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let year = if month <= 2 { year - 1 } else { year };
    let era = year.div_euclid(400);
    let year_of_era = year - era * 400;
    let day_of_year = (153 * (month + if month > 2 { -3 } else { 9 }) + 2) / 5 + day - 1;
    let day_of_era = year_of_era * 365 + year_of_era / 4 - year_of_era / 100 + day_of_year;
    era * 146_097 + day_of_era - 719_468
}

/// The proleptic Gregorian date of a day since 1970-01-01 (Howard Hinnant's `civil_from_days`).
fn civil_from_days(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let day_of_era = z - era * 146_097;
    let year_of_era = (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let mp = (5 * day_of_year + 2) / 153;
    let day = day_of_year - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    (year_of_era + era * 400 + i64::from(month <= 2), month, day)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]
    use super::*;

    /// 2026-03-29 01:00 UTC: Europe's clocks go forward (02:00 CET becomes 03:00 CEST).
    const EU_SPRING_2026_MS: u64 = 1_774_746_000_000;

    #[test]
    fn civil_dates_round_trip() {
        assert_eq!(days_from_civil(1970, 1, 1), 0);
        assert_eq!(civil_from_days(days_from_civil(2024, 2, 29)), (2024, 2, 29));
        assert_eq!(civil_from_days(-1), (1969, 12, 31));
    }

    #[test]
    fn berlin_days_and_months_follow_its_clocks() {
        let berlin = Zone::named("Europe/Berlin").unwrap();
        assert_eq!(berlin, Zone::parse("CET-1CEST,M3.5.0,M10.5.0/3").unwrap());
        assert_eq!(berlin.offset_at(1_774_745_999), 3600);
        assert_eq!(berlin.offset_at(1_774_746_000), 7200);
        // The day of the change is 23 hours long: local midnight to local midnight.
        let (start, end) = berlin.period(Period::Day, EU_SPRING_2026_MS);
        assert_eq!((start, end), (1_774_738_800_000, 1_774_821_600_000));
        assert_eq!(end - start, 23 * 3_600_000);
        let (month_start, month_end) = berlin.period(Period::Month, EU_SPRING_2026_MS);
        assert_eq!((month_start, month_end), (1_772_319_600_000, 1_774_994_400_000), "March 1st CET to April 1st CEST");
        let (week_start, _) = berlin.period(Period::Week, EU_SPRING_2026_MS);
        assert_eq!(week_start, 1_774_220_400_000, "Monday March 23rd, 00:00 CET");
    }

    #[test]
    fn rules_that_do_not_parse_are_refused_with_a_reason() {
        for bad in ["", "CET", "CET-1CEST", "CET-1CEST,M13.5.0,M10.5.0/3", "CET-1CEST,M3.5.0", "Mars/Olympus", "X1"] {
            assert!(Zone::named(bad).is_err(), "{bad:?}");
        }
        assert_eq!(Zone::named("<+0545>-5:45").unwrap().offset_at(0), 5 * 3600 + 45 * 60);
        assert_eq!(Zone::named("UTC").unwrap().period(Period::Hour, 7_199_999), (3_600_000, 7_200_000));
    }
}
