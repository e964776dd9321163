//! A calendar quota's hash (`calendar`) as text: `show`'s report, the lines `explain` writes for a rule with
//! `calendar`, and a rule's rate per period (`validate`, `explain`).

use std::fmt::Write as _;

use crate::calendar::{CalendarShowReport, CalendarWindow, FieldRole};
use crate::calendar_ops::HashShowReport;
use crate::units::{human_ms, timestamp, ttl_text};

/// `show` of a hash `{name}:counter`, a sliding window counter's or a calendar quota's, as text.
pub fn show_hash(report: &HashShowReport) -> String {
    match report {
        HashShowReport::Counter(report) => crate::counter_text::show(report),
        HashShowReport::Calendar(report) => show(report),
    }
}

/// A rate in words: `3 per 1m`, or for a calendar quota `50000000 per month (Europe/Berlin)` (`calendar`
/// when the zone's name is unknown).
pub fn rate_text(rate: u64, interval_ms: u64, period: Option<&str>, time_zone: Option<&str>) -> String {
    match period {
        Some(period) => format!("{rate} per {period} ({})", time_zone.unwrap_or("calendar")),
        None => format!("{rate} per {}", human_ms(interval_ms)),
    }
}

/// The layout in words: `calendar quota, per month in Europe/Berlin`.
pub fn layout_text(window: &CalendarWindow) -> String {
    match (window.period, &window.time_zone) {
        (Some(period), Some(zone)) => format!("calendar quota, per {period} in {zone}"),
        (Some(period), None) => format!("calendar quota, per {period}"),
        _ => "calendar quota (the period and zone are the rule's, not in Redis: --config plugin.json)".to_string(),
    }
}

/// The hash's lines after `indent`: the current period (with a rule) and the permits taken in it, the other
/// fields, and the hash's TTL.
pub fn window_lines(out: &mut String, indent: &str, window: &CalendarWindow) {
    if let Some(period) = &window.current {
        let _ = writeln!(out, "{indent}period       {}: {} to {}", period.label, period.start, period.end);
        let _ =
            writeln!(out, "{indent}used         {} permits in this period (field {})", period.used, period.start_ms);
        let _ = writeln!(
            out,
            "{indent}period ends  in {} ({}): the quota is whole again",
            human_ms(period.ends_in_ms),
            period.end
        );
    }
    let others: Vec<_> = window.fields.iter().filter(|field| field.role != FieldRole::Current).collect();
    let title = if window.current.is_some() { "other fields" } else { "fields      " };
    let count = others.len();
    let _ = writeln!(out, "{indent}{title} {count} {}", if count == 1 { "period" } else { "periods" });
    let width = others.iter().map(|field| field.permits.to_string().len()).max().unwrap_or(1);
    for field in others {
        let role = match field.role {
            FieldRole::Earlier => ", an earlier period: no longer counted (goes when the hash expires)",
            FieldRole::Later => ", a later period (a clock ahead of this one): not counted now",
            FieldRole::Current | FieldRole::Unknown => "",
        };
        let permits = if field.permits == 1 { "permit" } else { "permits" };
        let _ = writeln!(
            out,
            "{indent}  period from {} ({})  {:>width$} {permits}{role}",
            field.start, field.start_ms, field.permits
        );
    }
    if window.unreadable > 0 {
        let _ = writeln!(out, "{indent}  unreadable {} fields that are not whole numbers", window.unreadable);
    }
    let _ = writeln!(out, "{indent}ttl  {}  {}", window.key, ttl_text(window.ttl_ms));
}

/// `show` of a calendar quota as text.
pub fn show(report: &CalendarShowReport) -> String {
    let mut out = String::new();
    let window = &report.window;
    let _ = writeln!(out, "limiter      {}", report.name);
    let _ = writeln!(out, "layout       {}", layout_text(window));
    let _ = writeln!(out, "now          {}", timestamp(report.now_ms));
    match &report.rule {
        Some(rule) => {
            let rule_text = (rule.rate, rule.period, rule.name.as_str());
            crate::counter_text::rule_lines(
                &mut out,
                rule_text,
                report.left,
                report.next_permit_ms,
                "at the period's end",
            );
        }
        None => {
            let _ = writeln!(
                out,
                "rate         the rule's, not in Redis (--config plugin.json: the rate, the period, what is left)"
            );
            let _ = writeln!(
                out,
                "note         each field is the start of a period (ms since the epoch) of a kind only the rule says"
            );
        }
    }
    window_lines(&mut out, "", window);
    if let (None, Some(ttl)) = (&report.rule, u64::try_from(window.ttl_ms).ok()) {
        let end = (report.now_ms + ttl).saturating_sub(1_000);
        let _ = writeln!(out, "newest end   about {} (the hash expires 1 s after its period's end)", timestamp(end));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::calendar::{report, CalendarRule, ZoneNames};
    use crate::counter::Hash;

    /// 2026-11-22T02:40:01Z; November in Berlin from 2026-10-31T23:00:00Z, October from 2026-09-30T22:00:00Z.
    const NOW: u64 = 1_795_315_201_000;

    fn hash() -> Hash {
        Hash { fields: vec![(1_793_487_600_000, 60), (1_790_805_600_000, 99)], unreadable: 0, ttl_ms: 764_400_000 }
    }

    fn rule() -> CalendarRule {
        let json = r#"{"redis":{"cluster":"c"},"rules":[{"name":"monthly","limit_by":{"header":"x-user-id"},
            "rate":100,"calendar":{"period":"month","time_zone":"Europe/Berlin"}}]}"#;
        let plugin = edge_rate_limiter::filter::load(json.as_bytes(), false).unwrap();
        CalendarRule::of(&plugin.global.unwrap().rules[0], 0, &ZoneNames::read(json.as_bytes())).unwrap()
    }

    #[test]
    fn show_says_the_period_what_is_used_and_left_and_when_it_ends() {
        assert_eq!(
            show(&report("erl:monthly:alice", &hash(), Some(rule()), NOW)),
            "limiter      erl:monthly:alice
layout       calendar quota, per month in Europe/Berlin
now          2026-11-22T02:40:01.000Z
rate         100 per month (rule monthly)
left         40 of 100
next permit  now
period       month of 2026-11 in Europe/Berlin: 2026-10-31T23:00:00.000Z to 2026-11-30T23:00:00.000Z
used         60 permits in this period (field 1793487600000)
period ends  in 8days 20h 19m 59s (2026-11-30T23:00:00.000Z): the quota is whole again
other fields 1 period
  period from 2026-09-30T22:00:00.000Z (1790805600000)  99 permits, an earlier period: no longer counted (goes when the hash expires)
ttl  {erl:monthly:alice}:counter  8days 20h 20m (764400000 ms)
"
        );
    }

    #[test]
    fn without_a_rule_show_lists_the_fields_as_period_starts() {
        let text = show(&report("erl:monthly:alice", &hash(), None, NOW));
        assert!(text.contains("layout       calendar quota (the period and zone are the rule's"), "{text}");
        assert!(text
            .contains("fields       2 periods\n  period from 2026-09-30T22:00:00.000Z (1790805600000)  99 permits\n"));
        assert!(text.contains("newest end   about 2026-11-30T23:00:00.000Z"), "{text}");
        assert_eq!(rate_text(3, 60_000, None, None), "3 per 1m");
        assert_eq!(rate_text(5, 0, Some("month"), Some("Europe/Berlin")), "5 per month (Europe/Berlin)");
    }
}
