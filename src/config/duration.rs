//! Duration strings of the configuration: humantime's syntax (`"1.5s"`, `"200ms"`, `"1h 30m"`), as whole
//! milliseconds.
//!
//! Our own, because `humantime` needs `std` and the module is `no_std` (docs/deploying.md, "Module size"): one or
//! more `<number><unit>` parts, optionally separated by spaces; a number is digits with an optional decimal
//! fraction; units as humantime spells them. The sum must be a whole number of milliseconds. Arithmetic is
//! exact (integers in nanoseconds) and checked.

use alloc::format;
use alloc::string::String;

use crate::quote::quoted;

/// Units and their length in nanoseconds (humantime 2.x spellings; a month is 30.44 days, a year 365.25).
const UNITS: &[(&[&str], u64)] = &[
    (&["nsec", "ns"], 1),
    (&["usec", "us", "µs"], 1_000),
    (&["msec", "ms"], 1_000_000),
    (&["seconds", "second", "secs", "sec", "s"], 1_000_000_000),
    (&["minutes", "minute", "mins", "min", "m"], 60_000_000_000),
    (&["hours", "hour", "hrs", "hr", "h"], 3_600_000_000_000),
    (&["days", "day", "d"], 86_400_000_000_000),
    (&["weeks", "week", "w"], 604_800_000_000_000),
    (&["months", "month", "M"], 2_630_016_000_000_000),
    (&["years", "year", "y"], 31_557_600_000_000_000),
];

/// Parses a duration string into whole milliseconds.
///
/// # Errors
/// A sentence saying what is wrong (no number, unknown unit, not a whole number of milliseconds, too long).
pub(super) fn parse_ms(text: &str) -> Result<u64, String> {
    let input = text.trim();
    if input.is_empty() {
        return Err(format!("invalid duration {}: value was empty", quoted(input)));
    }
    let mut rest = input;
    let mut total_ns: u64 = 0;
    while !rest.is_empty() {
        let digits = rest.find(|c: char| !c.is_ascii_digit() && c != '.').unwrap_or(rest.len());
        // `find` returns char boundaries: the checked split never fails (and links no panic path).
        let (number, after) = rest.split_at_checked(digits).unwrap_or((rest, ""));
        let after = after.trim_start();
        let letters = after.find(|c: char| c.is_ascii_digit() || c == ' ').unwrap_or(after.len());
        let (unit, after) = after.split_at_checked(letters).unwrap_or((after, ""));
        if number.is_empty() {
            return Err(format!("invalid duration {}: expected a number at {}", quoted(input), quoted(rest)));
        }
        let unit_ns = UNITS.iter().find(|(names, _)| names.contains(&unit)).map(|(_, ns)| *ns).ok_or_else(|| {
            format!("invalid duration {}: unknown unit {} (use ms, s, m, h, d...)", quoted(input), quoted(unit))
        })?;
        let part = match part_ns(number, unit_ns) {
            Part::Nanoseconds(ns) => ns,
            Part::Fraction => return Err(format!("duration {} is not a whole number of milliseconds", quoted(input))),
            Part::TooLong => return Err(format!("duration {} is too long", quoted(input))),
            Part::NotANumber => return Err(format!("invalid duration {}: bad number", quoted(input))),
        };
        total_ns = total_ns.checked_add(part).ok_or_else(|| format!("duration {} is too long", quoted(input)))?;
        rest = after.trim_start();
    }
    if total_ns % 1_000_000 != 0 {
        return Err(format!("duration {} is not a whole number of milliseconds", quoted(input)));
    }
    Ok(total_ns / 1_000_000)
}

/// What one `<number><unit>` part is worth.
enum Part {
    Nanoseconds(u64),
    /// Less than a nanosecond is left over.
    Fraction,
    TooLong,
    NotANumber,
}

/// `number` (digits, optionally `.` and more digits) units of `unit_ns`, in nanoseconds.
fn part_ns(number: &str, unit_ns: u64) -> Part {
    let (whole, fraction) = number.split_once('.').unwrap_or((number, ""));
    if whole.is_empty() && fraction.is_empty() || fraction.contains('.') {
        return Part::NotANumber;
    }
    let fraction = fraction.trim_end_matches('0');
    let Some(scale) = u32::try_from(fraction.len()).ok().and_then(|n| 10u64.checked_pow(n)) else {
        return Part::Fraction;
    };
    let parse = |digits: &str| if digits.is_empty() { Some(0) } else { digits.parse::<u64>().ok() };
    let (Some(whole), Some(fraction)) = (parse(whole), parse(fraction)) else { return Part::TooLong };
    let whole_ns = whole.checked_mul(unit_ns);
    let fraction_scaled = fraction.checked_mul(unit_ns);
    match (whole_ns, fraction_scaled) {
        (Some(whole_ns), Some(scaled)) if scaled % scale == 0 => {
            whole_ns.checked_add(scaled / scale).map_or(Part::TooLong, Part::Nanoseconds)
        }
        (Some(_), Some(_)) => Part::Fraction,
        _ => Part::TooLong,
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]
    use super::*;

    #[test]
    fn humantime_spellings_become_milliseconds() {
        for (text, ms) in [
            ("1ms", 1),
            ("1.5s", 1_500),
            ("1m", 60_000),
            ("1h 30m", 5_400_000),
            ("1h30m", 5_400_000),
            ("2 hours", 7_200_000),
            (" 200ms ", 200),
            ("1d", 86_400_000),
            ("2000us", 2),
            (".5s", 500),
            ("0ms", 0),
            ("1w", 604_800_000),
        ] {
            assert_eq!(parse_ms(text), Ok(ms), "{text}");
        }
    }

    #[test]
    fn anything_else_is_refused_with_a_reason() {
        for (text, reason) in [
            ("soon", "expected a number"),
            ("", "value was empty"),
            ("5", "unknown unit \"\""),
            ("5 parsecs", "unknown unit \"parsecs\""),
            ("1..5s", "bad number"),
            ("0.0000001ms", "not a whole number of milliseconds"),
            ("1500us", "not a whole number of milliseconds"),
            ("99999999999999999999999999y", "too long"),
            ("600y", "too long"),
        ] {
            let error = parse_ms(text).unwrap_err();
            assert!(error.contains(reason), "{text}: {error}");
        }
    }
}
