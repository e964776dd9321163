//! Durations and times, in ms throughout: the operator's duration options parsed (`--interval`,
//! `--keep-alive`, `--timeout`), and durations and epoch-ms times written for humans. No I/O, no crate
//! imports: every other module may use it.

use std::time::{Duration, UNIX_EPOCH};

/// A duration as the options take it: humantime (`500ms`, `1s`, `1m`, `1h 30m`) or a plain number of ms.
///
/// # Errors
/// The parser's complaint with examples (`clap` prints it as the option's error).
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    if let Ok(ms) = text.parse::<u64>() {
        return Ok(Duration::from_millis(ms));
    }
    humantime::parse_duration(text).map_err(|error| format!("{error} (examples: 500ms, 1s, 1m, 1h 30m)"))
}

/// A duration as [`parse_duration`] takes it, in whole ms.
fn duration_ms(text: &str) -> Result<u64, String> {
    let duration = parse_duration(text)?;
    if duration.subsec_nanos() % 1_000_000 != 0 {
        return Err("must be whole milliseconds".to_string());
    }
    u64::try_from(duration.as_millis()).map_err(|_| "too long".to_string())
}

/// `--interval`: a window length in ms, at least 1.
///
/// # Errors
/// As [`parse_duration`]; also a duration of 0, not whole ms, or beyond `u64` ms.
pub fn parse_interval(text: &str) -> Result<u64, String> {
    match duration_ms(text)? {
        0 => Err("must be at least 1ms".to_string()),
        ms => Ok(ms),
    }
}

/// `--keep-alive`: a keepAliveTime in ms; 0 (never expire) allowed.
///
/// # Errors
/// As [`parse_duration`]; also a duration not whole ms, or beyond `u64` ms.
pub fn parse_keep_alive(text: &str) -> Result<u64, String> {
    duration_ms(text)
}

/// A duration in ms as humantime writes it: `1m`, `2s 500ms`, `0s`.
pub fn human_ms(ms: u64) -> String {
    if ms == 0 {
        return "0s".to_string();
    }
    humantime::format_duration(Duration::from_millis(ms)).to_string()
}

/// An epoch-ms time as RFC 3339 UTC with ms: `2026-11-22T02:40:01.123Z`.
pub fn timestamp(ms: u64) -> String {
    humantime::format_rfc3339_millis(UNIX_EPOCH + Duration::from_millis(ms)).to_string()
}

/// A `PTTL` for humans: `no such key` (-2), `no expiry` (-1), else `2s 100ms (2100 ms)`.
pub fn ttl_text(ttl_ms: i64) -> String {
    match ttl_ms {
        -2 => "no such key".to_string(),
        -1 => "no expiry".to_string(),
        ms => format!("{} ({ms} ms)", human_ms(u64::try_from(ms).unwrap_or(0))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_accept_humantime_and_ms() {
        assert_eq!(parse_interval("1m"), Ok(60_000));
        assert_eq!(parse_interval("1h 30m"), Ok(5_400_000));
        assert_eq!(parse_interval("250"), Ok(250));
        assert!(parse_interval("0s").is_err());
        assert!(parse_interval("soon").is_err());
        assert_eq!(parse_keep_alive("0"), Ok(0));
    }
}
