//! The sliding window counter layout (a rule's `layout: "sliding_window_counter"`, docs/configuration.md,
//! "Which window to choose"): one hash per limiter, `{name}:counter` (`name:counter` for a name holding a
//! `{`), one field per slice of the interval (the slice's index since the epoch, `floor(ms / width)`, width
//! `max(1, floor(interval / 20))`) whose value is the permits taken in it. There is no config in Redis: the
//! rate and the interval are the rule's.
//!
//! Without I/O (`counter_ops` reads the hash without writing): the hash counted as the acquire script counts
//! it (src/script/lua/prelude.lua, `counterWindow` and `counterDelay`): the slices from
//! `floor((now - interval) / width)` on are in the window, older ones are deleted by the next acquire; a
//! request is admitted when they and its permits fit the rate, else it waits until enough of the oldest
//! counted slices left (a slice leaves `(slice + 1) * width + interval`). Text output: `counter_text`.

use std::collections::BTreeMap;

use edge_rate_limiter::config::{Plugin, WindowLayout, COUNTER_SLICES};
use edge_rate_limiter::key::redisson_suffix;
use serde::Serialize;

use crate::error::{AdminError, Result};
use crate::model::Outlook;
use crate::units::human_ms;

/// The layout's name, as the configuration's `layout` writes it.
pub const LAYOUT: &str = "sliding_window_counter";

/// The Redis key of counter limiter `name`: `{name}:counter` (or `name:counter` when the name holds a `{`).
pub fn counter_key(name: &str) -> String {
    redisson_suffix(name, "counter")
}

/// The width of a slice of an `interval_ms` window, ms: `max(1, floor(interval / 20))`.
pub fn slice_width(interval_ms: u64) -> u64 {
    (interval_ms / COUNTER_SLICES).max(1)
}

/// A counter hash as Redis holds it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Hash {
    /// `(slice index, permits)` of each field whose name and value are whole numbers.
    pub fields: Vec<(u64, i64)>,
    /// Fields that are not (never written by the filter; the acquire script would fail on them).
    pub unreadable: u64,
    /// `PTTL` of the hash, ms (`-1` no expiry).
    pub ttl_ms: i64,
}

/// Where the interval the slices are counted with comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum IntervalFrom {
    /// The rule of the plugin configuration given.
    Rule,
    /// No configuration: the slice width from the slice indices (`now / newest index`), the interval 20
    /// times it (exact for an interval that is a multiple of 20 ms; widths of hours and more are rough).
    Inferred,
    /// No configuration and no readable field: nothing is counted.
    Unknown,
}

/// One slice in the window.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Slice {
    /// Its index since the epoch (the hash field).
    pub index: u64,
    /// When it starts, ms since the epoch (`index * width`).
    pub start_ms: u64,
    /// Permits taken in it.
    pub permits: i64,
    /// Ms until it leaves the window (`(index + 1) * width + interval - now`).
    pub leaves_in_ms: u64,
}

/// A counter limiter's window at `now`, as the acquire script counts it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CounterWindow {
    /// Always [`LAYOUT`].
    pub layout: &'static str,
    /// The hash.
    pub key: String,
    /// Slices of an interval (the filter's `COUNTER_SLICES`).
    pub slices: u64,
    /// The interval the slices are counted with, ms (0 when unknown).
    pub interval_ms: u64,
    /// The width of a slice, ms (0 when unknown).
    pub width_ms: u64,
    /// Where the interval comes from.
    pub interval_from: IntervalFrom,
    /// The first slice counted: `floor((now - interval) / width)`.
    pub first_slice: u64,
    /// The slice of now: `floor(now / width)`.
    pub current_slice: u64,
    /// The slices counted (index at least `first_slice`), oldest first; a slice without permits is no field.
    pub counted: Vec<Slice>,
    /// The permits of the counted slices.
    pub permits: i64,
    /// Fields of slices before `first_slice`: no longer counted, deleted by the next acquire.
    pub stale: u64,
    /// Fields that are not whole numbers.
    pub unreadable: u64,
    /// `PTTL` of the hash, ms (`-1` no expiry, `-2` no such key: the window is empty).
    pub ttl_ms: i64,
}

impl CounterWindow {
    /// The window of `hash` at `now_ms` counted with `interval_ms` (`None`: inferred from the slice
    /// indices).
    pub fn count(name: &str, hash: &Hash, interval_ms: Option<u64>, now_ms: u64) -> Self {
        let (interval_ms, width_ms, interval_from) = match interval_ms {
            Some(interval) => (interval, slice_width(interval), IntervalFrom::Rule),
            None => match infer_width(&hash.fields, now_ms) {
                Some(width) => (width * COUNTER_SLICES, width, IntervalFrom::Inferred),
                None => (0, 0, IntervalFrom::Unknown),
            },
        };
        let width = width_ms.max(1);
        let first_slice = now_ms.saturating_sub(interval_ms) / width;
        let mut counts: BTreeMap<u64, i64> = BTreeMap::new();
        let mut stale = 0;
        for &(slice, permits) in &hash.fields {
            if interval_from == IntervalFrom::Unknown || slice < first_slice {
                stale += 1;
            } else {
                *counts.entry(slice).or_default() += permits;
            }
        }
        let leaves_in = |index: u64| ((index + 1) * width + interval_ms).saturating_sub(now_ms);
        let counted: Vec<Slice> = counts
            .into_iter()
            .map(|(index, permits)| Slice { index, start_ms: index * width, permits, leaves_in_ms: leaves_in(index) })
            .collect();
        CounterWindow {
            layout: LAYOUT,
            key: counter_key(name),
            slices: COUNTER_SLICES,
            interval_ms,
            width_ms,
            interval_from,
            first_slice,
            current_slice: now_ms / width,
            permits: counted.iter().map(|slice| slice.permits).sum(),
            counted,
            stale,
            unreadable: hash.unreadable,
            ttl_ms: hash.ttl_ms,
        }
    }

    /// Ms until `need` permits of the counted slices left the window (the script's `counterDelay`): the
    /// oldest slices leave first. When they never hold that many (the script's last resort, which a request
    /// within the rate never meets): the newest slice's departure.
    pub fn delay_ms(&self, need: i64) -> u64 {
        let mut freed = 0;
        for slice in &self.counted {
            freed += slice.permits;
            if freed >= need {
                return slice.leaves_in_ms;
            }
        }
        self.counted.last().map_or(0, |slice| slice.leaves_in_ms)
    }

    /// What an acquire of `permits` at a limit of `rate` meets (the acquire script): admitted when the
    /// counted permits and its own fit the rate, else rejected until enough of the oldest slices left.
    pub fn outlook(&self, rate: u64, permits: u64) -> Outlook {
        if permits > rate {
            return Outlook::Never;
        }
        let (rate, wanted) = (signed(rate), signed(permits));
        let left = rate - self.permits - wanted;
        if left >= 0 {
            return Outlook::Allowed { remaining: u64::try_from(left).unwrap_or(0) / permits.max(1) };
        }
        let delay_ms = self.delay_ms(-left);
        Outlook::Rejected { wait_ms: Some(delay_ms), delay_ms }
    }
}

fn signed(permits: u64) -> i64 {
    i64::try_from(permits).unwrap_or(i64::MAX)
}

/// The most a slice width is inferred to be: a day (an interval of 20 days); beyond, the fields are not a
/// counter's of now.
const MOST_INFERRED_WIDTH_MS: u64 = 86_400_000;

/// The slice width of fields written at most an interval and a slice ago: `now / newest index` (the newest
/// slice started at most 21 widths before now, so this is the width for widths under about 4 minutes).
fn infer_width(fields: &[(u64, i64)], now_ms: u64) -> Option<u64> {
    let newest = fields.iter().map(|(slice, _)| *slice).max().filter(|&slice| slice > 0)?;
    Some((now_ms / newest).max(1)).filter(|&width| width <= MOST_INFERRED_WIDTH_MS)
}

/// A rule of the configuration that keeps its limiters as a counter, as `show` uses it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CounterRule {
    /// The rule's name.
    pub name: String,
    /// Permits per interval.
    pub rate: u64,
    /// The window, ms.
    pub interval_ms: u64,
}

/// Whether limiter `name` is one of a rule whose `limiter` is `base`: the name itself (a global rule) or its
/// start before a `:`.
pub fn names_limiter(base: &str, name: &str) -> bool {
    name == base || name.strip_prefix(base).is_some_and(|rest| rest.starts_with(':'))
}

/// The counter rule whose limiters limiter `name` is one of: a rule with `layout: "sliding_window_counter"`
/// whose `limiter` is the name (a global rule) or its start before a `:`, named `rule` if given.
///
/// # Errors
/// [`AdminError::Usage`] when no rule, or rules of different rates or intervals, fit.
pub fn rule_for(plugin: &Plugin, name: &str, rule: Option<&str>) -> Result<CounterRule> {
    let mut found: Vec<CounterRule> = Vec::new();
    for (_, config) in plugin.configs() {
        for candidate in &config.rules {
            if candidate.layout != WindowLayout::SlidingWindowCounter
                || !names_limiter(&candidate.limiter, name)
                || rule.is_some_and(|wanted| wanted != candidate.name)
            {
                continue;
            }
            let entry =
                CounterRule { name: candidate.name.clone(), rate: candidate.rate, interval_ms: candidate.interval_ms };
            if !found.contains(&entry) {
                found.push(entry);
            }
        }
    }
    match found.as_slice() {
        [one] => Ok(one.clone()),
        [] => Err(AdminError::Usage(format!(
            "no rule of the configuration with layout \"{LAYOUT}\" or a calendar{} has limiters named like {name}",
            rule.map(|rule| format!(" named {rule}")).unwrap_or_default()
        ))),
        several => {
            let listed: Vec<String> =
                several.iter().map(|r| format!("{} ({} per {})", r.name, r.rate, human_ms(r.interval_ms))).collect();
            Err(AdminError::Usage(format!(
                "several rules fit {name}: {}; choose one with --rule (rates_by_value entries: use explain with \
                 the request)",
                listed.join(", ")
            )))
        }
    }
}

/// What `show` reports of a counter limiter.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CounterShowReport {
    /// The limiter name.
    pub name: String,
    /// "now" of the report, ms since the epoch.
    pub now_ms: u64,
    /// The window.
    pub window: CounterWindow,
    /// The rule it was counted with (`--config`), if any.
    pub rule: Option<CounterRule>,
    /// With a rule: its rate minus the permits in the window (below zero after settled costs above their
    /// reservations).
    pub left: Option<i64>,
    /// With a rule: ms until a request of one permit is admitted (0: now).
    pub next_permit_ms: Option<u64>,
}

/// The report of `hash` at `now_ms`.
pub fn report(name: &str, hash: &Hash, rule: Option<CounterRule>, now_ms: u64) -> CounterShowReport {
    let window = CounterWindow::count(name, hash, rule.as_ref().map(|rule| rule.interval_ms), now_ms);
    let left = rule.as_ref().map(|rule| signed(rule.rate) - window.permits);
    let next_permit_ms = rule.as_ref().map(|rule| match window.outlook(rule.rate, 1) {
        Outlook::Allowed { .. } | Outlook::Never => 0,
        Outlook::Rejected { delay_ms, .. } => delay_ms,
    });
    CounterShowReport { name: name.to_string(), now_ms, window, rule, left, next_permit_ms }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 1 s in slices of 50 ms, at 10,000,025 ms: the window counts the slices from 199,980 on.
    const NOW: u64 = 10_000_025;

    fn hash() -> Hash {
        Hash { fields: vec![(200_000, 3), (199_979, 4), (199_990, 1), (199_980, 2)], unreadable: 0, ttl_ms: 1_040 }
    }

    #[test]
    fn slices_are_the_filters_and_keys_follow_the_name() {
        assert_eq!((slice_width(1_000), slice_width(2_010), slice_width(19), slice_width(60_000)), (50, 100, 1, 3_000));
        assert_eq!(counter_key("erl:per-user:alice"), "{erl:per-user:alice}:counter");
        assert_eq!(counter_key("{tag}name"), "{tag}name:counter");
    }

    #[test]
    fn the_window_counts_the_slices_that_overlap_the_last_interval_as_the_script_does() {
        let window = CounterWindow::count("erl:all", &hash(), Some(1_000), NOW);
        assert_eq!((window.first_slice, window.current_slice, window.width_ms), (199_980, 200_000, 50));
        assert_eq!((window.permits, window.stale, window.interval_from), (6, 1, IntervalFrom::Rule));
        let slice = |index: u64, permits, leaves_in_ms| Slice { index, start_ms: index * 50, permits, leaves_in_ms };
        assert_eq!(
            window.counted,
            [slice(199_980, 2, 25), slice(199_990, 1, 525), slice(200_000, 3, 1_025)],
            "each leaves (index + 1) * width + interval - now ms from now"
        );
        assert_eq!(window.key, "{erl:all}:counter");
    }

    #[test]
    fn outlooks_admit_within_the_rate_or_wait_for_the_oldest_slices() {
        let window = CounterWindow::count("erl:all", &hash(), Some(1_000), NOW);
        assert_eq!(window.outlook(10, 2), Outlook::Allowed { remaining: 1 }, "10 - 6 - 2 = 2 permits: 1 more request");
        assert_eq!(window.outlook(7, 1), Outlook::Allowed { remaining: 0 });
        assert_eq!(window.outlook(6, 1), Outlook::Rejected { wait_ms: Some(25), delay_ms: 25 }, "the oldest slice");
        assert_eq!(window.outlook(6, 3), Outlook::Rejected { wait_ms: Some(525), delay_ms: 525 }, "2 + 1 freed");
        assert_eq!(window.outlook(6, 6), Outlook::Rejected { wait_ms: Some(1_025), delay_ms: 1_025 });
        assert_eq!(window.outlook(5, 6), Outlook::Never);
        let empty = CounterWindow::count("erl:all", &Hash { ttl_ms: -2, ..Hash::default() }, Some(1_000), NOW);
        assert_eq!((empty.permits, empty.outlook(5, 5)), (0, Outlook::Allowed { remaining: 0 }));
    }

    #[test]
    fn without_a_rule_the_width_is_inferred_from_the_newest_slice() {
        let window = CounterWindow::count("erl:all", &hash(), None, NOW);
        assert_eq!((window.width_ms, window.interval_ms, window.interval_from), (50, 1_000, IntervalFrom::Inferred));
        assert_eq!(window.permits, 6);
        let minute = Hash { fields: vec![(1_732_000_000_000 / 3_000, 1)], ..Hash::default() };
        let inferred = CounterWindow::count("n", &minute, None, 1_732_000_000_000 + 2_999);
        assert_eq!((inferred.width_ms, inferred.interval_ms), (3_000, 60_000));
        let unknown = CounterWindow::count("n", &Hash { unreadable: 1, ..Hash::default() }, None, NOW);
        assert_eq!((unknown.interval_from, unknown.counted.len()), (IntervalFrom::Unknown, 0));
        let ancient = CounterWindow::count("n", &Hash { fields: vec![(1, 5)], ..Hash::default() }, None, NOW * 10_000);
        assert_eq!((ancient.interval_from, ancient.stale, ancient.permits), (IntervalFrom::Unknown, 1, 0));
    }

    const PLUGIN: &str = r#"{"redis":{"cluster":"c"},"rules":[
        {"name":"per-user","limit_by":{"header":"x-user-id"},"rate":5,"interval":"2s","layout":"sliding_window_counter"},
        {"name":"all","limit_by":"global","rate":100,"interval":"1s","layout":"sliding_window_counter"},
        {"name":"log","limit_by":{"header":"x-user-id"},"rate":5,"interval":"2s"},
        {"name":"plan","limit_by":{"header":"x-user-id"},"rate":5,"interval":"2s","layout":"sliding_window_counter",
         "rates_by_value":[{"values":["gold"],"rate":50}]}],
        "_rules_":[{"_match_route_":["login"],"rules":[
        {"name":"login","limit_by":"client_ip","rate":2,"interval":"1m","layout":"sliding_window_counter",
         "limiter":"erl:per-user"}]}]}"#;

    #[test]
    fn the_rule_of_a_counter_is_the_one_whose_limiter_starts_its_name() {
        let plugin = edge_rate_limiter::filter::load(PLUGIN.as_bytes(), false).unwrap();
        let rule = |name: &str, rule: Option<&str>| rule_for(&plugin, name, rule);
        let all = CounterRule { name: "all".into(), rate: 100, interval_ms: 1_000 };
        assert_eq!(rule("erl:all", None), Ok(all));
        assert_eq!(rule("erl:all:x", None).unwrap().name, "all");
        let per_user = CounterRule { name: "per-user".into(), rate: 5, interval_ms: 2_000 };
        assert_eq!(rule("erl:per-user:alice", Some("per-user")), Ok(per_user));
        let Err(AdminError::Usage(several)) = rule("erl:per-user:alice", None) else { panic!("two rules") };
        assert!(several.contains("per-user (5 per 2s), login (2 per 1m); choose one with --rule"), "{several}");
        let Err(AdminError::Usage(entries)) = rule("erl:plan:bob", None) else { panic!("two entries") };
        assert!(entries.contains("plan (50 per 2s), plan (5 per 2s)"), "{entries}");
        let Err(AdminError::Usage(none)) = rule("erl:log:bob", None) else { panic!("a sliding log") };
        assert_eq!(
            none,
            "no rule of the configuration with layout \"sliding_window_counter\" or a calendar has limiters named like \
             erl:log:bob"
        );
        assert!(matches!(rule("erl:allx", None), Err(AdminError::Usage(_))), "a base ends at a `:`");
    }

    #[test]
    fn show_says_what_is_left_and_when_the_next_permit_frees_with_a_rule() {
        let rule = CounterRule { name: "all".into(), rate: 6, interval_ms: 1_000 };
        let full = report("erl:all", &hash(), Some(rule.clone()), NOW);
        assert_eq!((full.left, full.next_permit_ms), (Some(0), Some(25)));
        let room = report("erl:all", &hash(), Some(CounterRule { rate: 9, ..rule }), NOW);
        assert_eq!((room.left, room.next_permit_ms), (Some(3), Some(0)));
        let bare = report("erl:all", &hash(), None, NOW);
        assert_eq!((bare.left, bare.next_permit_ms, bare.window.permits), (None, None, 6));
        let json = serde_json::to_value(&full).unwrap();
        assert_eq!(json["window"]["layout"], "sliding_window_counter");
        assert_eq!(json["window"]["interval_from"], "rule");
        assert_eq!(
            json["window"]["counted"][0],
            serde_json::json!({"index": 199_980, "start_ms": 9_999_000_u64,
            "permits": 2, "leaves_in_ms": 25})
        );
        assert_eq!(json["rule"], serde_json::json!({"name": "all", "rate": 6, "interval_ms": 1000}));
    }
}
