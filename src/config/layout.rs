//! A rule's `layout` and `calendar`: how its limiters live in Redis (docs/configuration.md, "Which window to
//! choose", "Calendar quotas"), and what each layout refuses at load.

use crate::calendar::{Period, Zone};
use crate::prelude::*;

use super::reader::Object;
use super::{ConfigError, LimiterType, RateSource, WindowLayout};

const CALENDAR_FIELDS: &[&str] = &["period", "time_zone"];

/// `calendar`: `{"period": "minute" | "hour" | "day" | "week" | "month" | "year", "time_zone": "Europe/Berlin"}`
/// (an IANA name of [`crate::calendar::ZONES`], or a POSIX TZ rule; default `UTC`).
///
/// # Errors
/// A [`ConfigError`] naming the field: an unknown period or time zone, a rule that does not parse.
pub(super) fn read_calendar(rule: &mut Object<'_>) -> Result<Option<WindowLayout>, ConfigError> {
    let Some(mut calendar) = rule.object("calendar")? else { return Ok(None) };
    let period = calendar
        .choice(
            "period",
            &[
                ("minute", Period::Minute),
                ("hour", Period::Hour),
                ("day", Period::Day),
                ("week", Period::Week),
                ("month", Period::Month),
                ("year", Period::Year),
            ],
        )?
        .ok_or_else(|| calendar.error("period", "required: minute, hour, day, week, month or year"))?;
    let name = calendar.string("time_zone")?.unwrap_or_else(|| "UTC".to_string());
    let zone = Zone::named(&name).map_err(|why| calendar.error("time_zone", why))?;
    calendar.finish(CALENDAR_FIELDS)?;
    Ok(Some(WindowLayout::Calendar { period, zone }))
}

/// `layout` (or the `calendar` already read): how the rule keeps its limiters in Redis. A sliding window
/// counter or a calendar quota is refused with what it does not do, naming the field: `type: "per_client"`,
/// `rate_source: "redis"` (no config in Redis: the rate is the rule's), `lease`, `keep_alive` (the hash
/// expires by itself).
///
/// # Errors
/// A [`ConfigError`] naming the field.
pub(super) fn read_layout(
    rule: &mut Object<'_>,
    calendar: Option<WindowLayout>,
    limiter_type: LimiterType,
    rate_source: RateSource,
    lease: bool,
    keep_alive: bool,
) -> Result<WindowLayout, ConfigError> {
    let chosen = rule.choice(
        "layout",
        &[("sliding_log", WindowLayout::SlidingLog), ("sliding_window_counter", WindowLayout::SlidingWindowCounter)],
    )?;
    let layout = match (calendar, chosen) {
        (Some(_), Some(_)) => {
            return Err(rule.error("layout", "a rule with `calendar` keeps a counter per period: no `layout`"))
        }
        (Some(calendar), None) => calendar,
        (None, chosen) => chosen.unwrap_or_default(),
    };
    if layout == WindowLayout::SlidingLog {
        return Ok(layout);
    }
    let what = if calendar.is_some() { "a calendar quota" } else { "a sliding window counter" };
    let refused = [
        (limiter_type == LimiterType::PerClient, "type", "is overall only"),
        (
            rate_source == RateSource::Redis && rule.get("rate_source").is_some(),
            "rate_source",
            "keeps no config in Redis: its rate is the rule's",
        ),
        (lease, "lease", "takes no lease (yet)"),
        (keep_alive, "keep_alive", "expires by itself"),
    ];
    if let Some((_, field, why)) = refused.into_iter().find(|(refused, _, _)| *refused) {
        return Err(rule.error(field, format!("{what} {why}")));
    }
    Ok(layout)
}
