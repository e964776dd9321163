//! Calendar quotas (a rule's `calendar`: docs/configuration.md, "Calendar quotas"): one hash per limiter,
//! `{name}:counter` (`name:counter` for a name holding a `{`, the sliding window counter's key), one field
//! per period of the zone's local time: the field is the period's start (ms since the epoch), its value the
//! permits taken in it; the hash expires at the period's end and 1 s (`PEXPIREAT`). There is no config in
//! Redis: the rate, the period and the zone are the rule's.
//!
//! Without I/O (`calendar_ops` reads the hash without writing): the hash counted as the acquire script counts
//! it (src/script/lua/acquire.lua, type `'3'`): a request is admitted while the field of the current period
//! and its permits fit the rate; a rejection waits until the period's end. Text output: `calendar_text`.

use std::time::{Duration, UNIX_EPOCH};

use edge_rate_limiter::calendar::{Period, Zone};
use edge_rate_limiter::config::{Plugin, WindowLayout};
use serde::Serialize;

use crate::counter::{counter_key, names_limiter, Hash};
use crate::error::{AdminError, Result};
use crate::model::Outlook;
use crate::units::timestamp;

/// The layout's name, as `validate` and `explain` report it (the configuration's field `calendar`).
pub const LAYOUT: &str = "calendar";

/// A period as the configuration writes it: `minute`, `hour`, `day`, `week`, `month`, `year`.
pub fn period_name(period: Period) -> &'static str {
    match period {
        Period::Minute => "minute",
        Period::Hour => "hour",
        Period::Day => "day",
        Period::Week => "week",
        Period::Month => "month",
        Period::Year => "year",
    }
}

/// The `calendar.time_zone` each calendar rule of a plugin configuration is written with (the filter's
/// [`Zone`] keeps no name), by configuration (the index of [`Plugin::configs`]) and rule name.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ZoneNames(Vec<(usize, String, String)>);

impl ZoneNames {
    /// The zones of the configuration document `bytes` (one the filter loads: nothing when it is not JSON).
    /// A `_rules_` entry without `rules` has the global ones; a `calendar` without `time_zone` is in `UTC`.
    pub fn read(bytes: &[u8]) -> Self {
        let Ok(document) = serde_json::from_slice::<serde_json::Value>(bytes) else { return ZoneNames::default() };
        let global = document.get("rules");
        let overrides = document.get("_rules_").and_then(serde_json::Value::as_array).cloned().unwrap_or_default();
        let mut names = Vec::new();
        let rule_sets = std::iter::once((0, global))
            .chain(overrides.iter().enumerate().map(|(i, entry)| (i + 1, entry.get("rules").or(global))));
        for (index, rules) in rule_sets {
            for rule in rules.and_then(serde_json::Value::as_array).into_iter().flatten() {
                let (Some(name), Some(calendar)) = (rule.get("name").and_then(|n| n.as_str()), rule.get("calendar"))
                else {
                    continue;
                };
                let zone = calendar.get("time_zone").and_then(serde_json::Value::as_str).unwrap_or("UTC");
                names.push((index, name.to_string(), zone.to_string()));
            }
        }
        ZoneNames(names)
    }

    /// The zone of rule `rule` of configuration `index`, as written.
    pub fn get(&self, index: usize, rule: &str) -> Option<&str> {
        self.0.iter().find(|(i, name, _)| *i == index && name == rule).map(|(_, _, zone)| zone.as_str())
    }
}

/// A calendar rule, as `show` and `explain` count its limiters with.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CalendarRule {
    /// The rule's name.
    pub name: String,
    /// Permits per period.
    pub rate: u64,
    /// The period, as the configuration writes it.
    pub period: &'static str,
    /// The zone, as the configuration writes it (`None`: not found in the document).
    pub time_zone: Option<String>,
    /// The period.
    #[serde(skip)]
    pub kind: Period,
    /// The zone.
    #[serde(skip)]
    pub zone: Zone,
}

impl CalendarRule {
    /// Entry `rule` of configuration `index` when it is a calendar quota.
    pub fn of(rule: &edge_rate_limiter::config::Rule, index: usize, zones: &ZoneNames) -> Option<Self> {
        let WindowLayout::Calendar { period, zone } = rule.layout else { return None };
        Some(CalendarRule {
            name: rule.name.clone(),
            rate: rule.rate,
            period: period_name(period),
            time_zone: zones.get(index, &rule.name).map(str::to_string),
            kind: period,
            zone,
        })
    }

    /// `month in Europe/Berlin` (`month` when the zone's name is unknown).
    pub fn per_text(&self) -> String {
        match &self.time_zone {
            Some(zone) => format!("{} in {zone}", self.period),
            None => self.period.to_string(),
        }
    }
}

/// The calendar rule whose limiters limiter `name` is one of: a rule with `calendar` whose `limiter` is the
/// name or its start before a `:`, named `rule` if given; `None` when no calendar rule fits.
///
/// # Errors
/// [`AdminError::Usage`] when rules of different rates, periods or zones fit.
pub fn rule_for(plugin: &Plugin, zones: &ZoneNames, name: &str, rule: Option<&str>) -> Result<Option<CalendarRule>> {
    let mut found: Vec<CalendarRule> = Vec::new();
    for (index, config) in plugin.configs() {
        for candidate in &config.rules {
            if !names_limiter(&candidate.limiter, name) || rule.is_some_and(|wanted| wanted != candidate.name) {
                continue;
            }
            if let Some(entry) = CalendarRule::of(candidate, index, zones).filter(|entry| !found.contains(entry)) {
                found.push(entry);
            }
        }
    }
    match found.as_slice() {
        [] => Ok(None),
        [one] => Ok(Some(one.clone())),
        several => {
            let listed: Vec<String> =
                several.iter().map(|r| format!("{} ({} per {})", r.name, r.rate, r.per_text())).collect();
            Err(AdminError::Usage(format!(
                "several rules fit {name}: {}; choose one with --rule (rates_by_value entries: use explain with \
                 the request)",
                listed.join(", ")
            )))
        }
    }
}

/// Whether a counter hash read without a rule holds a calendar quota's fields: every readable field a time
/// since 2001 in ms (a sliding window counter's slice indices are ms divided by the slice width: that large
/// only for windows under 40 ms, whose hash lives 40 ms at most).
pub fn looks_like_periods(hash: &Hash) -> bool {
    const SINCE_2001_MS: u64 = 1_000_000_000_000;
    !hash.fields.is_empty() && hash.fields.iter().all(|&(start, _)| start >= SINCE_2001_MS)
}

/// Where a field stands to the current period.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum FieldRole {
    /// The current period's: what the acquire counts.
    Current,
    /// A period before it: no longer counted (it goes when the hash expires).
    Earlier,
    /// A period after it (a gateway whose clock is ahead): not counted now.
    Later,
    /// No rule: the current period is unknown.
    Unknown,
}

/// One field of the hash: a period and the permits taken in it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PeriodField {
    /// The period's start, ms since the epoch (the field's name).
    pub start_ms: u64,
    /// The same as RFC 3339 UTC.
    pub start: String,
    /// Permits taken in it.
    pub permits: i64,
    /// Where it stands to the current period.
    pub role: FieldRole,
}

/// The current period of a calendar rule's limiter.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CurrentPeriod {
    /// In words: `month of 2026-11 in Europe/Berlin`.
    pub label: String,
    /// Its start, ms since the epoch (the field the acquire counts).
    pub start_ms: u64,
    /// Its end (the next period's start), ms since the epoch: the quota is whole again then.
    pub end_ms: u64,
    /// The start as RFC 3339 UTC.
    pub start: String,
    /// The end as RFC 3339 UTC.
    pub end: String,
    /// Permits taken in it (its field; none: 0).
    pub used: i64,
    /// Ms until it ends.
    pub ends_in_ms: u64,
}

/// A calendar quota's hash at `now`, as the acquire script counts it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CalendarWindow {
    /// Always [`LAYOUT`].
    pub layout: &'static str,
    /// The hash.
    pub key: String,
    /// The period, as the configuration writes it (none without a rule).
    pub period: Option<&'static str>,
    /// The zone, as the configuration writes it (none without a rule, or not found in the document).
    pub time_zone: Option<String>,
    /// The current period (none without a rule: the fields cannot say which kind of period they start).
    pub current: Option<CurrentPeriod>,
    /// Every readable field, oldest first.
    pub fields: Vec<PeriodField>,
    /// Fields that are not whole numbers.
    pub unreadable: u64,
    /// `PTTL` of the hash, ms (`-1` no expiry, `-2` no such key: nothing taken yet).
    pub ttl_ms: i64,
}

impl CalendarWindow {
    /// The hash of limiter `name` at `now_ms`, counted with `rule` (`None`: the fields only).
    pub fn count(name: &str, hash: &Hash, rule: Option<&CalendarRule>, now_ms: u64) -> Self {
        let current = rule.map(|rule| {
            let (start_ms, end_ms) = rule.zone.period(rule.kind, now_ms);
            let used = hash.fields.iter().filter(|(start, _)| *start == start_ms).map(|(_, permits)| permits).sum();
            CurrentPeriod {
                label: period_label(rule, start_ms),
                start_ms,
                end_ms,
                start: timestamp(start_ms),
                end: timestamp(end_ms),
                used,
                ends_in_ms: end_ms.saturating_sub(now_ms),
            }
        });
        let role = |start: u64| match &current {
            None => FieldRole::Unknown,
            Some(period) if start == period.start_ms => FieldRole::Current,
            Some(period) if start < period.start_ms => FieldRole::Earlier,
            Some(_) => FieldRole::Later,
        };
        let mut fields: Vec<PeriodField> = hash
            .fields
            .iter()
            .map(|&(start_ms, permits)| PeriodField {
                start_ms,
                start: timestamp(start_ms),
                permits,
                role: role(start_ms),
            })
            .collect();
        fields.sort_by_key(|field| field.start_ms);
        CalendarWindow {
            layout: LAYOUT,
            key: counter_key(name),
            period: rule.map(|rule| rule.period),
            time_zone: rule.and_then(|rule| rule.time_zone.clone()),
            current,
            fields,
            unreadable: hash.unreadable,
            ttl_ms: hash.ttl_ms,
        }
    }

    /// What an acquire of `permits` at a limit of `rate` meets (the acquire script): admitted while the
    /// current period's permits and its own fit the rate, else rejected until the period's end (the delay at
    /// least 1 ms). Without a current period (no rule): as an empty one.
    pub fn outlook(&self, rate: u64, permits: u64) -> Outlook {
        if permits > rate {
            return Outlook::Never;
        }
        let used = self.current.as_ref().map_or(0, |period| period.used);
        let left = i128::from(rate) - i128::from(used) - i128::from(permits);
        if left >= 0 {
            return Outlook::Allowed { remaining: u64::try_from(left).unwrap_or(u64::MAX) / permits.max(1) };
        }
        let ends_in = self.current.as_ref().map_or(0, |period| period.ends_in_ms);
        Outlook::Rejected { wait_ms: Some(ends_in), delay_ms: ends_in.max(1) }
    }
}

/// The period that starts at `start_ms` in words, in the zone's local time: `minute 2026-11-22 14:05`,
/// `hour 2026-11-22 14:00`, `day 2026-11-22`, `week from Monday 2026-11-16`, `month of 2026-11`,
/// `year 2026`, then ` in <zone>` (` (UTC+01:00)` when the zone's name is unknown).
pub fn period_label(rule: &CalendarRule, start_ms: u64) -> String {
    let offset_s = rule.zone.offset_at(i64::try_from(start_ms / 1000).unwrap_or(i64::MAX / 2));
    let local_ms = i128::from(start_ms) + i128::from(offset_s) * 1000;
    let local = u64::try_from(local_ms).unwrap_or(0);
    let text = humantime::format_rfc3339_seconds(UNIX_EPOCH + Duration::from_millis(local)).to_string();
    let part = |range: std::ops::Range<usize>| text.get(range).unwrap_or_default().replace('T', " ");
    let what = match rule.kind {
        Period::Minute => format!("minute {}", part(0..16)),
        Period::Hour => format!("hour {}", part(0..16)),
        Period::Day => format!("day {}", part(0..10)),
        Period::Week => format!("week from Monday {}", part(0..10)),
        Period::Month => format!("month of {}", part(0..7)),
        Period::Year => format!("year {}", part(0..4)),
    };
    match &rule.time_zone {
        Some(zone) => format!("{what} in {zone}"),
        None => {
            let (sign, minutes) = (if offset_s < 0 { '-' } else { '+' }, offset_s.abs() / 60);
            format!("{what} (UTC{sign}{:02}:{:02})", minutes / 60, minutes % 60)
        }
    }
}

/// What `show` reports of a calendar quota.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CalendarShowReport {
    /// The limiter name.
    pub name: String,
    /// "now" of the report, ms since the epoch.
    pub now_ms: u64,
    /// The hash, counted with the rule if any.
    pub window: CalendarWindow,
    /// The rule it was counted with (`--config`), if any.
    pub rule: Option<CalendarRule>,
    /// With a rule: its rate minus the permits of the current period (below zero after settled costs above
    /// their reservations).
    pub left: Option<i64>,
    /// With a rule: ms until a request of one permit is admitted (0: now; else the period's end).
    pub next_permit_ms: Option<u64>,
}

/// The report of `hash` at `now_ms`.
pub fn report(name: &str, hash: &Hash, rule: Option<CalendarRule>, now_ms: u64) -> CalendarShowReport {
    let window = CalendarWindow::count(name, hash, rule.as_ref(), now_ms);
    let used = window.current.as_ref().map_or(0, |period| period.used);
    let left = rule.as_ref().map(|rule| i64::try_from(rule.rate).unwrap_or(i64::MAX) - used);
    let next_permit_ms = rule.as_ref().map(|rule| match window.outlook(rule.rate, 1) {
        Outlook::Allowed { .. } | Outlook::Never => 0,
        Outlook::Rejected { wait_ms, .. } => wait_ms.unwrap_or(0),
    });
    CalendarShowReport { name: name.to_string(), now_ms, window, rule, left, next_permit_ms }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 2026-11-22T02:40:01Z, a Sunday.
    const NOW: u64 = 1_795_315_201_000;
    /// 2026-10-31T23:00:00Z: November 1st's midnight in Berlin (CET, UTC+1).
    const NOVEMBER: u64 = 1_793_487_600_000;
    /// 2026-09-30T22:00:00Z: October 1st's midnight in Berlin (CEST, UTC+2).
    const OCTOBER: u64 = 1_790_805_600_000;

    const PLUGIN: &str = r#"{"redis":{"cluster":"c"},"rules":[
        {"name":"monthly","limit_by":{"header":"x-user-id"},"rate":100,
         "calendar":{"period":"month","time_zone":"Europe/Berlin"}},
        {"name":"daily","limit_by":"global","rate":3,"calendar":{"period":"day"}},
        {"name":"log","limit_by":{"header":"x-user-id"},"rate":5,"interval":"2s"}],
        "_rules_":[{"_match_route_":["r"]},{"_match_route_":["s"],"rules":[
        {"name":"monthly","limit_by":{"header":"x-user-id"},"rate":7,
         "calendar":{"period":"week","time_zone":"America/New_York"}}]}]}"#;

    fn plugin() -> Plugin {
        edge_rate_limiter::filter::load(PLUGIN.as_bytes(), false).unwrap()
    }

    fn monthly() -> CalendarRule {
        let zones = ZoneNames::read(PLUGIN.as_bytes());
        CalendarRule::of(&plugin().global.unwrap().rules[0], 0, &zones).unwrap()
    }

    fn hash() -> Hash {
        Hash { fields: vec![(NOVEMBER, 60), (OCTOBER, 99)], unreadable: 0, ttl_ms: 724_799_000 }
    }

    #[test]
    fn zones_are_read_as_written_per_configuration() {
        let zones = ZoneNames::read(PLUGIN.as_bytes());
        assert_eq!(
            (zones.get(0, "monthly"), zones.get(0, "daily"), zones.get(0, "log")),
            (Some("Europe/Berlin"), Some("UTC"), None)
        );
        assert_eq!((zones.get(1, "daily"), zones.get(2, "monthly")), (Some("UTC"), Some("America/New_York")));
        assert_eq!(ZoneNames::read(b"not json"), ZoneNames::default());
    }

    #[test]
    fn the_rule_of_a_calendar_limiter_is_the_one_whose_limiter_starts_its_name() {
        let (plugin, zones) = (plugin(), ZoneNames::read(PLUGIN.as_bytes()));
        let daily = rule_for(&plugin, &zones, "erl:daily", None).unwrap().unwrap();
        assert_eq!((daily.rate, daily.period, daily.time_zone.as_deref()), (3, "day", Some("UTC")));
        assert_eq!(rule_for(&plugin, &zones, "erl:log:bob", None), Ok(None));
        let Err(AdminError::Usage(several)) = rule_for(&plugin, &zones, "erl:monthly:bob", None) else { panic!() };
        assert!(several.contains("monthly (100 per month in Europe/Berlin), monthly (7 per week in America/New_York)"));
    }

    #[test]
    fn the_current_period_is_the_zones_and_earlier_fields_are_not_counted() {
        let window = CalendarWindow::count("erl:monthly:alice", &hash(), Some(&monthly()), NOW);
        let current = window.current.clone().unwrap();
        assert_eq!(current.label, "month of 2026-11 in Europe/Berlin");
        assert_eq!(
            (current.start.as_str(), current.end.as_str()),
            ("2026-10-31T23:00:00.000Z", "2026-11-30T23:00:00.000Z")
        );
        assert_eq!((current.used, current.ends_in_ms), (60, 1_796_079_600_000 - NOW));
        let roles: Vec<_> = window.fields.iter().map(|field| (field.start_ms, field.role)).collect();
        assert_eq!(roles, [(OCTOBER, FieldRole::Earlier), (NOVEMBER, FieldRole::Current)]);
        assert_eq!(window.key, "{erl:monthly:alice}:counter");
    }

    #[test]
    fn outlooks_admit_within_the_periods_quota_or_wait_for_its_end() {
        let window = CalendarWindow::count("n", &hash(), Some(&monthly()), NOW);
        let ends_in = 1_796_079_600_000 - NOW;
        assert_eq!(window.outlook(100, 10), Outlook::Allowed { remaining: 3 }, "100 - 60 - 10 = 30: 3 more");
        assert_eq!(window.outlook(60, 1), Outlook::Rejected { wait_ms: Some(ends_in), delay_ms: ends_in });
        assert_eq!(window.outlook(50, 51), Outlook::Never);
        let fresh = CalendarWindow::count("n", &Hash { ttl_ms: -2, ..Hash::default() }, Some(&monthly()), NOW);
        assert_eq!(fresh.outlook(3, 3), Outlook::Allowed { remaining: 0 });
    }

    #[test]
    fn labels_follow_the_local_time_of_the_period() {
        let rule = |kind, time_zone: Option<&str>| CalendarRule {
            kind,
            period: period_name(kind),
            time_zone: time_zone.map(str::to_string),
            ..monthly()
        };
        let label = |kind, zone: Option<&str>| {
            let rule = rule(kind, zone);
            period_label(&rule, rule.zone.period(kind, NOW).0)
        };
        assert_eq!(label(Period::Minute, Some("Europe/Berlin")), "minute 2026-11-22 03:40 in Europe/Berlin");
        assert_eq!(label(Period::Hour, None), "hour 2026-11-22 03:00 (UTC+01:00)");
        assert_eq!(label(Period::Day, None), "day 2026-11-22 (UTC+01:00)");
        assert_eq!(label(Period::Week, None), "week from Monday 2026-11-16 (UTC+01:00)");
        assert_eq!(label(Period::Year, Some("Europe/Berlin")), "year 2026 in Europe/Berlin");
    }

    #[test]
    fn without_a_rule_the_fields_are_periods_of_an_unknown_kind() {
        let bare = report("n", &hash(), None, NOW);
        assert_eq!((bare.left, bare.next_permit_ms, bare.window.current.is_none()), (None, None, true));
        assert!(bare.window.fields.iter().all(|field| field.role == FieldRole::Unknown));
        assert!(looks_like_periods(&hash()));
        assert!(!looks_like_periods(&Hash { fields: vec![(199_980, 2)], ..Hash::default() }));
        let full = report("n", &hash(), Some(CalendarRule { rate: 60, ..monthly() }), NOW);
        assert_eq!((full.left, full.next_permit_ms), (Some(0), Some(1_796_079_600_000 - NOW)));
        let json = serde_json::to_value(&full).unwrap();
        assert_eq!(
            json["rule"],
            serde_json::json!({"name": "monthly", "rate": 60, "period": "month", "time_zone": "Europe/Berlin"})
        );
        assert_eq!(json["window"]["current"]["used"], 60);
        assert_eq!(json["window"]["fields"][0]["role"], "earlier");
    }
}
