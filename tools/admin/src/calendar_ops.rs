//! `show` of a hash `{name}:counter`: a sliding window counter's (`counter`) or a calendar quota's
//! (`calendar`), which share the key. With a configuration the limiter's rule says which; without one, the
//! fields do (a calendar quota's are period starts in ms since the epoch: [`looks_like_periods`]).

use edge_rate_limiter::config::Plugin;
use serde::Serialize;

use crate::calendar::{self, looks_like_periods, CalendarShowReport, ZoneNames};
use crate::counter::{self, CounterShowReport};
use crate::counter_ops::read;
use crate::error::{AdminError, Result};
use crate::redis_io::Redis;

/// What `show` reports of a hash `{name}:counter`.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(untagged)]
pub enum HashShowReport {
    /// A sliding window counter's.
    Counter(Box<CounterShowReport>),
    /// A calendar quota's.
    Calendar(Box<CalendarShowReport>),
}

/// `show` of limiter `name` kept in a hash `{name}:counter` at `now_ms`, with its configuration (and the
/// zone names its document writes) if given, and the rule `--rule` names.
///
/// # Errors
/// [`AdminError::NoLimiter`] when there is no such hash, [`AdminError::Usage`] when no rule or several fit,
/// those of [`read`].
pub fn show(
    redis: &mut Redis,
    name: &str,
    config: Option<(&Plugin, &ZoneNames)>,
    rule: Option<&str>,
    now_ms: u64,
) -> Result<HashShowReport> {
    let hash = read(redis, name)?;
    if hash.ttl_ms == -2 {
        return Err(AdminError::NoLimiter(name.to_string()));
    }
    Ok(match config {
        Some((plugin, zones)) => match calendar::rule_for(plugin, zones, name, rule)? {
            Some(found) => HashShowReport::Calendar(Box::new(calendar::report(name, &hash, Some(found), now_ms))),
            None => {
                let found = counter::rule_for(plugin, name, rule)?;
                HashShowReport::Counter(Box::new(counter::report(name, &hash, Some(found), now_ms)))
            }
        },
        None if looks_like_periods(&hash) => {
            HashShowReport::Calendar(Box::new(calendar::report(name, &hash, None, now_ms)))
        }
        None => HashShowReport::Counter(Box::new(counter::report(name, &hash, None, now_ms))),
    })
}
