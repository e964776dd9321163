//! A sliding window counter's window (`counter`) as text: `show`'s report, and the lines `explain` writes
//! for a rule with `layout: "sliding_window_counter"`.

use std::fmt::Write as _;

use crate::counter::{CounterShowReport, CounterWindow, IntervalFrom};
use crate::units::{human_ms, timestamp, ttl_text};

/// The layout in words: `sliding window counter, 20 slices of 100ms`, and where its interval comes from
/// when not from a rule.
pub fn layout_text(window: &CounterWindow) -> String {
    let slices = format!("sliding window counter, {} slices", window.slices);
    match window.interval_from {
        IntervalFrom::Rule => format!("{slices} of {}", human_ms(window.width_ms)),
        IntervalFrom::Inferred => format!(
            "{slices} of {} (interval {} inferred from the slice indices; --config gives the rule's)",
            human_ms(window.width_ms),
            human_ms(window.interval_ms)
        ),
        IntervalFrom::Unknown => format!("{slices} (interval unknown: no readable slice; --config gives the rule's)"),
    }
}

/// The window's lines after `indent`: the permits in it, each counted slice (index, start, permits, when
/// it leaves), the fields no longer counted, and the hash's TTL.
pub fn window_lines(out: &mut String, indent: &str, window: &CounterWindow) {
    let count = window.counted.len();
    let slices = plural(count, "slice", "slices");
    let since = if window.interval_from == IntervalFrom::Unknown {
        String::new()
    } else {
        let start = window.first_slice * window.width_ms.max(1);
        format!(" (last {}: slices from {} on, {})", human_ms(window.interval_ms), window.first_slice, timestamp(start))
    };
    let _ = writeln!(out, "{indent}in window    {} permits in {count} {slices}{since}", window.permits);
    let width = window.counted.iter().map(|s| s.permits.to_string().len()).max().unwrap_or(1);
    let digits = window.counted.iter().map(|s| s.index.to_string().len()).max().unwrap_or(1);
    for slice in &window.counted {
        let _ = writeln!(
            out,
            "{indent}  slice {:<digits$}  {}  {:>width$} {}, leaves in {}",
            slice.index,
            timestamp(slice.start_ms),
            slice.permits,
            plural(slice.permits, "permit", "permits"),
            human_ms(slice.leaves_in_ms)
        );
    }
    if window.stale > 0 {
        let _ = writeln!(
            out,
            "{indent}  stale      {} {} before the window (deleted by the next acquire)",
            window.stale,
            plural(window.stale, "slice", "slices")
        );
    }
    if window.unreadable > 0 {
        let _ = writeln!(out, "{indent}  unreadable {} fields that are not whole numbers", window.unreadable);
    }
    let _ = writeln!(out, "{indent}ttl  {}  {}", window.key, ttl_text(window.ttl_ms));
}

/// `one` for 1, else `several`.
fn plural<N: TryInto<i64>>(count: N, one: &'static str, several: &'static str) -> &'static str {
    if count.try_into().ok() == Some(1) {
        one
    } else {
        several
    }
}

/// `show`'s lines of a window its rule describes (the counter's and a calendar quota's): `rate` per `per`
/// (rule `name`), what is `left` of it (below zero: settled costs above their reservations), and when the
/// next permit comes (`next_permit_ms` from now; `when`: what it waits for).
pub fn rule_lines(
    out: &mut String,
    (rate, per, name): (u64, &str, &str),
    left: Option<i64>,
    next_permit_ms: Option<u64>,
    when: &str,
) {
    let _ = writeln!(out, "rate         {rate} per {per} (rule {name})");
    let left = left.unwrap_or(0);
    let below = if left < 0 { " (below zero: settled costs above their reservations)" } else { "" };
    let _ = writeln!(out, "left         {left} of {rate}{below}");
    let next = match next_permit_ms {
        Some(0) | None => "now".to_string(),
        Some(ms) => format!("in {} ({when})", human_ms(ms)),
    };
    let _ = writeln!(out, "next permit  {next}");
}

/// `show` of a counter limiter as text.
pub fn show(report: &CounterShowReport) -> String {
    let mut out = String::new();
    let window = &report.window;
    let _ = writeln!(out, "limiter      {}", report.name);
    let _ = writeln!(out, "layout       {}", layout_text(window));
    let _ = writeln!(out, "now          {}", timestamp(report.now_ms));
    match &report.rule {
        Some(rule) => {
            let per = human_ms(rule.interval_ms);
            let when = "when enough of the oldest slices left";
            rule_lines(&mut out, (rule.rate, &per, &rule.name), report.left, report.next_permit_ms, when);
        }
        None => {
            let _ =
                writeln!(out, "rate         the rule's, not in Redis (--config plugin.json: the rate, what is left)");
        }
    }
    window_lines(&mut out, "", window);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::counter::{report, CounterRule, Hash};

    /// 2 s in slices of 100 ms at 100,050 ms: slices 979 (stale: the window counts from 980 on), 981, 990, 1000.
    fn hash() -> Hash {
        Hash { fields: vec![(979, 4), (981, 2), (990, 1), (1_000, 2)], unreadable: 0, ttl_ms: 2_090 }
    }

    #[test]
    fn show_lists_the_counted_slices_and_with_a_rule_what_is_left() {
        let rule = CounterRule { name: "per-user".into(), rate: 5, interval_ms: 2_000 };
        assert_eq!(
            show(&report("erl:per-user:alice", &hash(), Some(rule), 100_050)),
            "limiter      erl:per-user:alice
layout       sliding window counter, 20 slices of 100ms
now          1970-01-01T00:01:40.050Z
rate         5 per 2s (rule per-user)
left         0 of 5
next permit  in 150ms (when enough of the oldest slices left)
in window    5 permits in 3 slices (last 2s: slices from 980 on, 1970-01-01T00:01:38.000Z)
  slice 981   1970-01-01T00:01:38.100Z  2 permits, leaves in 150ms
  slice 990   1970-01-01T00:01:39.000Z  1 permit, leaves in 1s 50ms
  slice 1000  1970-01-01T00:01:40.000Z  2 permits, leaves in 2s 50ms
  stale      1 slice before the window (deleted by the next acquire)
ttl  {erl:per-user:alice}:counter  2s 90ms (2090 ms)
"
        );
    }
}
