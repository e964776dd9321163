//! Every calendar period boundary of [`edge_rate_limiter::calendar`] against Python's `zoneinfo` (PEP 615,
//! the machine's tzdata), 2026 to 2035: the days, ISO weeks, months and years of every zone a configuration
//! may name, and the hours and minutes of zones with odd offsets and daylight saving changes (30 and 45
//! minutes, negative DST, changes at midnight).
//!
//! `zoneinfo` gives each period's start as the local midnight (or hour, minute) of its first day with
//! `fold=0`; the module must give the very same instants, walking from period to period. Needs `python3`
//! (3.9 or later) on the `PATH`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing, clippy::panic)]

use std::process::Command;

use edge_rate_limiter::calendar::{zone_names, Period, Zone};

/// Prints `zone period start start ...` (seconds since the epoch) for each zone and period asked on stdin
/// (`zone period first last`, years).
const PYTHON: &str = r#"
import sys
from datetime import datetime, timedelta
from zoneinfo import ZoneInfo

def starts(zone, period, first, last):
    z = ZoneInfo(zone)
    if period in ("day", "week", "hour", "minute"):
        t = datetime(first, 1, 1)
        if period == "week":
            t -= timedelta(days=t.weekday())
        step = {"day": timedelta(days=1), "week": timedelta(days=7), "hour": timedelta(hours=1),
                "minute": timedelta(minutes=1)}[period]
        while t.year <= last:
            yield t
            t += step
    elif period == "month":
        for year in range(first, last + 1):
            for month in range(1, 13):
                yield datetime(year, month, 1)
    else:
        for year in range(first, last + 1):
            yield datetime(year, 1, 1)

for line in sys.stdin:
    zone, period, first, last = line.split()
    seen = []
    for local in starts(zone, period, int(first), int(last)):
        utc = int(local.replace(tzinfo=ZoneInfo(zone)).timestamp())
        # A local start that a DST change skipped reads as the time after the change (fold=0): the same
        # instants as the periods after it. Periods start at the distinct instants, in order.
        if not seen or utc > seen[-1]:
            seen.append(utc)
    print(zone, period, *seen)
"#;

/// Zones checked more closely. Lord Howe: +10:30 with a 30-minute DST; Chatham: +12:45 and its changes at
/// 02:45; Kolkata: +05:30; Dublin: negative DST; Santiago and Havana: changes at midnight; New York, Berlin:
/// the common rules.
const ODD: [&str; 8] = [
    "Australia/Lord_Howe",
    "Pacific/Chatham",
    "Asia/Kolkata",
    "Europe/Dublin",
    "America/Santiago",
    "America/Havana",
    "America/New_York",
    "Europe/Berlin",
];

fn period_named(name: &str) -> Period {
    match name {
        "minute" => Period::Minute,
        "hour" => Period::Hour,
        "day" => Period::Day,
        "week" => Period::Week,
        "month" => Period::Month,
        _ => Period::Year,
    }
}

/// Runs [`PYTHON`] on `asked` (`zone period first last` lines) and checks every line of its answer.
fn check_against_zoneinfo(asked: &[String]) {
    let mut child = Command::new("python3")
        .args(["-c", PYTHON])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("python3 on the PATH");
    let mut stdin = child.stdin.take().unwrap();
    let input = asked.join("\n") + "\n";
    let writer = std::thread::spawn(move || std::io::Write::write_all(&mut stdin, input.as_bytes()).unwrap());
    let output = child.wait_with_output().unwrap();
    writer.join().unwrap();
    assert!(output.status.success(), "python3 failed");
    let text = String::from_utf8(output.stdout).unwrap();
    let mut mismatches = Vec::new();
    let mut checked = 0;
    for line in text.lines() {
        let mut words = line.split(' ');
        let (zone_name, period_name) = (words.next().unwrap(), words.next().unwrap());
        let expected: Vec<u64> = words.map(|w| w.parse::<u64>().unwrap() * 1000).collect();
        let zone = Zone::named(zone_name).unwrap();
        let period = period_named(period_name);
        let mut at = expected[0];
        for (index, &start) in expected.iter().enumerate() {
            let (from, to) = zone.period(period, at);
            checked += 1;
            if from != start || expected.get(index + 1).is_some_and(|&next| next != to) {
                mismatches.push(format!("{zone_name} {period_name}: at {at} got [{from}, {to}), zoneinfo {start}"));
                break;
            }
            // A moment inside the period and its last millisecond belong to it too.
            assert_eq!(zone.period(period, to - 1), (from, to), "{zone_name} {period_name} at {}", to - 1);
            at = to;
        }
    }
    assert!(
        mismatches.is_empty(),
        "{} mismatches (of {checked} boundaries):\n{}",
        mismatches.len(),
        mismatches.join("\n")
    );
    assert!(checked > 0);
}

#[test]
fn days_weeks_months_and_years_of_every_zone_match_zoneinfo() {
    // Days over two years for every zone (each zone's DST changes twice a year), ten for a few.
    let asked: Vec<String> = zone_names()
        .flat_map(|zone| {
            let days = if ODD.contains(&zone.as_str()) { "2035" } else { "2027" };
            [("day", days), ("week", "2035"), ("month", "2035"), ("year", "2035")]
                .map(|(period, last)| format!("{zone} {period} 2026 {last}"))
        })
        .collect();
    check_against_zoneinfo(&asked);
}

#[test]
fn hours_and_minutes_of_odd_zones_match_zoneinfo() {
    let mut asked: Vec<String> = ODD.iter().map(|zone| format!("{zone} hour 2026 2030")).collect();
    asked.extend(["Australia/Lord_Howe minute 2026 2026".to_string(), "Europe/Berlin minute 2026 2026".to_string()]);
    check_against_zoneinfo(&asked);
}
