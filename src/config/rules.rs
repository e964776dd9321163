//! The rules of a configuration: `rules[n]` read field by field into [`Rule`]s (one per
//! `rates_by_value` entry, the rule's own rate last), with their keys (`limit_by`) and leases.

use alloc::boxed::Box;

use serde_json::Value;

use crate::prelude::*;

use crate::key::{IpPrefix, KeySource};
use crate::matching::{Pattern, ValueMatch};
use crate::quote::quoted;

use super::reader::{DurationMs, Object};
use super::validate::{non_empty, read_exemption, MAX_MATCHES};
use super::{ConfigError, Lease, LimiterType, Mode, OnMissing, RateSource, Rule, WindowLayout};

const RATE_BY_VALUE_FIELDS: &[&str] = &["values", "regex", "rate", "interval", "permits"];

const RULE_FIELDS: &[&str] = &[
    "name",
    "limit_by",
    "rate",
    "interval",
    "type",
    "permits",
    "keep_alive",
    "on_missing",
    "limiter",
    "rate_source",
    "local_block_max",
    "lease",
    "mode",
    "exempt",
    "rates_by_value",
    "rates_by",
    "cost",
    "layout",
    "calendar",
    "max_wait",
    "max_waiting",
];

const LEASE_FIELDS: &[&str] = &["max_permits", "max_age"];

/// Largest `lease.max_permits`: one lease is one permit member, and a VM serves it alone.
const MAX_LEASE_PERMITS: u64 = 65_536;

/// Default `local_block_max`: long enough to shed an attack on a key, short enough to bound what a rate an
/// operator raises meanwhile costs (docs/configuration.md, "Local block").
const DEFAULT_LOCAL_BLOCK_MAX_MS: u64 = 5_000;

/// Default keep-alive of a keyed limiter (per user, per IP...): one hour, so the keys of one-off clients vanish.
const DEFAULT_KEEP_ALIVE_MS: u64 = 3_600_000;

/// Largest rate accepted: Redisson's members carry permits as a 4-byte unsigned integer.
const MAX_RATE: u64 = u32::MAX as u64;

/// Largest interval accepted (about 31 years): keeps `now - interval` and TTL arithmetic far from overflow.
pub(super) const MAX_INTERVAL_MS: u64 = 1 << 40;

/// A rule, as its entries: one, or with `rates_by_value` one per value match and the default last.
pub(super) fn read_rule(mut rule: Object<'_>, default_mode: Mode) -> Result<Vec<Rule>, ConfigError> {
    let name = rule.required("name", Object::string)?;
    if name.is_empty() || !name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-') {
        return Err(rule.error("name", format!("{} must be non-empty and use only A-Z a-z 0-9 _ -", quoted(&name))));
    }
    let limit_by = rule.required("limit_by", |rule, name| Ok(rule.get(name)))?;
    let source = read_key_source(limit_by).map_err(|why| rule.error("limit_by", why))?;
    let calendar = super::layout::read_calendar(&mut rule)?;
    let (rate, interval_ms) = read_rate(&mut rule, calendar.as_ref())?;
    let limiter_type = rule
        .choice("type", &[("overall", LimiterType::Overall), ("per_client", LimiterType::PerClient)])?
        .unwrap_or_default();
    let cost = rule.object("cost")?.map(|cost| super::cost::read_cost(cost, rate)).transpose()?;
    let permits = match (rule.u64("permits")?, &cost) {
        (Some(_), Some(_)) => return Err(rule.error("permits", "a rule with `cost` reserves `cost.reserve` instead")),
        (None, Some(cost)) => cost.reserve.default_permits(),
        (permits, None) => permits.unwrap_or(1),
    };
    if permits == 0 || permits > rate {
        return Err(rule.error("permits", format!("{permits} must be between 1 and the rate ({rate})")));
    }
    let keep_alive_ms = read_keep_alive(&mut rule, &source, interval_ms)?;
    let on_missing = rule
        .choice("on_missing", &[("skip", OnMissing::Skip), ("deny", OnMissing::Deny), ("share", OnMissing::Share)])?
        .unwrap_or_default();
    let limiter = read_limiter(&mut rule, &name)?;
    let rate_source = rule
        .choice("rate_source", &[("redis", RateSource::Redis), ("config", RateSource::Config)])?
        .unwrap_or_default();
    let lease = rule.object("lease")?.map(|lease| read_lease(lease, rate, interval_ms, permits)).transpose()?;
    let (local_block_max_ms, max_wait_ms, max_waiting) = read_block_and_wait(&mut rule, lease.is_some())?;
    let mode = rule.choice("mode", &[("enforce", Mode::Enforce), ("shadow", Mode::Shadow)])?.unwrap_or(default_mode);
    let exempt = rule.object("exempt")?.map(read_exemption).transpose()?;
    let by_value = rule.array("rates_by_value")?;
    let rates_by = match rule.get("rates_by") {
        None => None,
        Some(_) if by_value.is_none() => {
            return Err(rule.error("rates_by", "needs `rates_by_value` (the rates it picks)"))
        }
        Some(value) => Some(read_key_source(value).map_err(|why| rule.error("rates_by", why))?),
    };
    if cost.is_some() && lease.is_some() {
        return Err(rule.error("cost", "cannot be combined with `lease` (a lease's permits are not one request's)"));
    }
    let keep_alive = rule.get("keep_alive").is_some();
    let layout =
        super::layout::read_layout(&mut rule, calendar, limiter_type, rate_source, lease.is_some(), keep_alive)?;
    rule.finish(RULE_FIELDS)?;
    let base = Rule {
        name,
        source,
        limiter,
        rate,
        interval_ms,
        limiter_type,
        permits,
        keep_alive_ms,
        on_missing,
        rate_source,
        local_block_max_ms,
        lease,
        mode,
        exempt,
        value_match: None,
        rates_by,
        cost,
        layout,
        max_wait_ms,
        max_waiting,
    };
    match by_value {
        None => Ok(vec![base]),
        Some((items, at)) => rates_by_value(base, items, &at, keep_alive),
    }
}

/// A rule's `local_block_max`, ms (default [`DEFAULT_LOCAL_BLOCK_MAX_MS`], at most [`MAX_INTERVAL_MS`]).
/// Longest `max_wait`: a request held that long still ends well within Envoy's default stream timeouts.
const MAX_WAIT_MS: u64 = 60_000;

/// Default `max_waiting`: requests one rule keeps waiting at once in one VM.
const DEFAULT_MAX_WAITING: u32 = 1_000;

/// Most `max_waiting`.
const MAX_WAITING: u32 = 1_000_000;

/// A rule's `local_block_max`, `max_wait` (0 to [`MAX_WAIT_MS`], default 0: no wait) and `max_waiting` (1 to
/// [`MAX_WAITING`], default [`DEFAULT_MAX_WAITING`]). A rule with `max_wait` keeps no local block: its
/// rejected requests wait and ask again, where a block would answer them 429 (setting both is refused); a
/// rule with a `lease` does not wait (its permits come from the lease).
fn read_block_and_wait(rule: &mut Object<'_>, lease: bool) -> Result<(u64, u64, u32), ConfigError> {
    let explicit_local_block = rule.get("local_block_max").is_some();
    let local_block_max_ms = read_local_block_max(rule)?;
    let max_wait_ms = rule.duration("max_wait")?.map_or(0, |DurationMs(ms)| ms);
    if max_wait_ms > MAX_WAIT_MS {
        return Err(rule.error("max_wait", format!("must be at most {MAX_WAIT_MS} ms")));
    }
    if max_wait_ms > 0 && lease {
        return Err(rule.error("max_wait", "cannot be combined with `lease` (a lease's permits are not one request's)"));
    }
    let max_waiting = rule.number::<u32>("max_waiting")?.unwrap_or(DEFAULT_MAX_WAITING);
    if max_waiting == 0 || max_waiting > MAX_WAITING {
        return Err(rule.error("max_waiting", format!("must be between 1 and {MAX_WAITING}")));
    }
    match (max_wait_ms, explicit_local_block && local_block_max_ms > 0) {
        (0, _) => Ok((local_block_max_ms, 0, max_waiting)),
        (_, false) => Ok((0, max_wait_ms, max_waiting)),
        (_, true) => {
            Err(rule.error("local_block_max", "a rule with `max_wait` keeps no local block (its requests wait)"))
        }
    }
}

fn read_local_block_max(rule: &mut Object<'_>) -> Result<u64, ConfigError> {
    let local_block_max_ms = rule.duration("local_block_max")?.map_or(DEFAULT_LOCAL_BLOCK_MAX_MS, |DurationMs(ms)| ms);
    if local_block_max_ms > MAX_INTERVAL_MS {
        return Err(rule.error("local_block_max", format!("must be at most {MAX_INTERVAL_MS} ms")));
    }
    Ok(local_block_max_ms)
}

/// A rule's `rate` (1 to [`MAX_RATE`]) and `interval` (1 ms to [`MAX_INTERVAL_MS`]; with `calendar`, none:
/// its period's nominal length).
#[inline]
fn read_rate(rule: &mut Object<'_>, calendar: Option<&WindowLayout>) -> Result<(u64, u64), ConfigError> {
    let rate = rule.required("rate", Object::u64)?;
    if rate == 0 {
        return Err(rule.error("rate", "must be at least 1"));
    }
    if rate > MAX_RATE {
        return Err(rule.error("rate", format!("must be at most {MAX_RATE}")));
    }
    if let Some(WindowLayout::Calendar { period, .. }) = calendar {
        if rule.get("interval").is_some() {
            return Err(rule.error("interval", "a rule with `calendar` has its period instead"));
        }
        return Ok((rate, period.nominal_ms()));
    }
    let DurationMs(interval_ms) = rule.required("interval", Object::duration)?;
    if interval_ms == 0 {
        return Err(rule.error("interval", "must be at least 1 ms"));
    }
    if interval_ms > MAX_INTERVAL_MS {
        return Err(rule.error("interval", format!("must be at most {MAX_INTERVAL_MS} ms")));
    }
    Ok((rate, interval_ms))
}

/// A rule's `keep_alive`, ms: 0 (never) or at least the interval; by default 0 for a global rule, else
/// an hour or the interval if longer.
#[inline]
fn read_keep_alive(rule: &mut Object<'_>, source: &KeySource, interval_ms: u64) -> Result<u64, ConfigError> {
    Ok(match rule.duration("keep_alive")? {
        Some(DurationMs(ms)) => {
            if ms != 0 && ms < interval_ms {
                return Err(rule.error(
                    "keep_alive",
                    format!(
                        "{ms} ms is shorter than the interval ({interval_ms} ms): keys would expire with permits still in the window; use 0 (never) or at least the interval"
                    ),
                ));
            }
            if ms > MAX_INTERVAL_MS {
                return Err(rule.error("keep_alive", format!("must be at most {MAX_INTERVAL_MS} ms")));
            }
            ms
        }
        None if *source == KeySource::Global => 0,
        None => interval_ms.max(DEFAULT_KEEP_ALIVE_MS),
    })
}

/// A rule's `limiter` (default `erl:<name>`), whose keys fall in one Redis Cluster hash slot.
#[inline]
fn read_limiter(rule: &mut Object<'_>, name: &str) -> Result<String, ConfigError> {
    let limiter = match rule.string("limiter")? {
        Some(limiter) => non_empty(&rule.path_of("limiter"), limiter)?,
        None => format!("erl:{name}"),
    };
    // Redis Cluster hashes `{tag}` when the first `{` is closed by a `}` with something between; otherwise
    // the whole key, and the limiter's keys (`N`, `N:value`...: Redisson's names once N has a `{`) would
    // fall in different slots.
    // Without a `{`, Redisson tags the other keys `{N}:value`, whose slot is of the text before the first `}`
    // of N: so N must hold no `}` at all.
    let tagged = match limiter.find('{') {
        Some(open) => limiter.get(open + 1..).and_then(|rest| rest.find('}')).is_some_and(|close| close > 0),
        None => !limiter.contains('}'),
    };
    if !tagged {
        return Err(rule.error(
            "limiter",
            "a `{` must open a non-empty hash tag closed by `}`, and a `}` needs one (Redis Cluster)",
        ));
    }
    Ok(limiter)
}

/// The entries of a rule with `rates_by_value` (`items`, at path `at`): one per value match, then `base`.
#[inline]
fn rates_by_value(base: Rule, items: &[Value], at: &str, explicit_keep_alive: bool) -> Result<Vec<Rule>, ConfigError> {
    if base.source == KeySource::Global {
        return Err(ConfigError::new(at, "a global rule has no key value to match"));
    }
    if base.lease.is_some() {
        return Err(ConfigError::new(at, "cannot be combined with `lease`"));
    }
    if items.is_empty() || items.len() > MAX_MATCHES {
        return Err(ConfigError::new(at, format!("must hold 1 to {MAX_MATCHES} entries")));
    }
    let mut entries = Vec::with_capacity(items.len() + 1);
    for (index, item) in items.iter().enumerate() {
        let path = format!("{at}[{index}]");
        entries.push(read_rate_by_value(Object::new(item, &path)?, &base, explicit_keep_alive)?);
    }
    entries.push(base);
    Ok(entries)
}

/// One entry of `rates_by_value`: `values` (exact) or `regex`, its `rate`, and optionally its own
/// `interval` and `permits` (default: the rule's). The entry is the rule with those replaced.
fn read_rate_by_value(mut entry: Object<'_>, rule: &Rule, explicit_keep_alive: bool) -> Result<Rule, ConfigError> {
    let value_match = match (entry.array("values")?, entry.string("regex")?) {
        (Some((values, at)), None) => {
            if values.is_empty() || values.len() > MAX_MATCHES {
                return Err(ConfigError::new(at, format!("must hold 1 to {MAX_MATCHES} strings")));
            }
            let values = values
                .iter()
                .map(|v| v.as_str().map(|v| v.as_bytes().to_vec()))
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| ConfigError::new(at, "values must be strings"))?;
            ValueMatch::Values(values)
        }
        (None, Some(regex)) => ValueMatch::Regex(Pattern::new(&regex).map_err(|why| entry.error("regex", why))?),
        _ => return Err(ConfigError::new(entry.path(), "needs either `values` or `regex`")),
    };
    let rate = entry.required("rate", Object::u64)?;
    if rate == 0 || rate > MAX_RATE {
        return Err(entry.error("rate", format!("must be between 1 and {MAX_RATE}")));
    }
    let interval_ms = entry.duration("interval")?.map_or(rule.interval_ms, |DurationMs(ms)| ms);
    if interval_ms == 0 || interval_ms > MAX_INTERVAL_MS {
        return Err(entry.error("interval", format!("must be between 1 ms and {MAX_INTERVAL_MS} ms")));
    }
    let permits = match (entry.u64("permits")?, &rule.cost) {
        (Some(_), Some(_)) => return Err(entry.error("permits", "a rule with `cost` reserves `cost.reserve` instead")),
        (None, Some(_)) if rule.permits > rate => {
            return Err(
                entry.error("rate", format!("{rate} is below the rule's reservation ({} permits)", rule.permits))
            )
        }
        (permits, _) => permits.unwrap_or(rule.permits),
    };
    if permits == 0 || permits > rate {
        return Err(entry.error("permits", format!("{permits} must be between 1 and the rate ({rate})")));
    }
    let keep_alive_ms = if explicit_keep_alive { rule.keep_alive_ms } else { interval_ms.max(DEFAULT_KEEP_ALIVE_MS) };
    if keep_alive_ms != 0 && keep_alive_ms < interval_ms {
        return Err(entry
            .error("interval", format!("{interval_ms} ms is longer than the rule's keep_alive ({keep_alive_ms} ms)")));
    }
    entry.finish(RATE_BY_VALUE_FIELDS)?;
    Ok(Rule { rate, interval_ms, permits, keep_alive_ms, value_match: Some(value_match), ..rule.clone() })
}

/// `lease`: `max_permits` between `permits` + 1 and the rate, `max_age` from 1 ms to below the interval.
fn read_lease(mut lease: Object<'_>, rate: u64, interval_ms: u64, permits: u64) -> Result<Lease, ConfigError> {
    let max_permits = lease.required("max_permits", Object::u64)?;
    let most = rate.min(MAX_LEASE_PERMITS);
    if max_permits <= permits || max_permits > most {
        return Err(lease.error(
            "max_permits",
            format!("{max_permits} must be more than the rule's permits ({permits}) and at most {most} (the rate, at most {MAX_LEASE_PERMITS})"),
        ));
    }
    let DurationMs(max_age_ms) = lease.required("max_age", Object::duration)?;
    if max_age_ms == 0 || max_age_ms >= interval_ms {
        return Err(lease.error(
            "max_age",
            format!("{max_age_ms} ms must be at least 1 ms and shorter than the interval ({interval_ms} ms)"),
        ));
    }
    lease.finish(LEASE_FIELDS)?;
    Ok(Lease { max_permits, max_age_ms })
}

/// `limit_by`: `"client_ip"`, `"path"`, `"global"`, or one of `{"header": name}`, `{"query": name}`,
/// `{"cookie": name}`, `{"x_forwarded_for": hops}`, `{"client_ip": {"ipv4_prefix": 24, "ipv6_prefix": 64}}`,
/// `{"x_forwarded_for": {"hops": 1, "ipv4_prefix": 24, "ipv6_prefix": 64}}`; or an array of those (a
/// composite key).
pub(super) fn read_key_source(value: &Value) -> Result<KeySource, String> {
    const UNITS: &str = "`client_ip`, `path`, `global`";
    const KEYED: &str = "`header`, `query`, `cookie`, `x_forwarded_for`, `client_ip`, `property`, `body`";
    let source = match value {
        Value::Array(parts) => KeySource::Composite(
            parts
                .iter()
                .enumerate()
                .map(|(index, part)| read_key_source(part).map_err(|why| format!("part {index}: {why}")))
                .collect::<Result<_, _>>()?,
        ),
        Value::String(text) => match text.as_str() {
            "client_ip" => KeySource::ClientIp,
            "path" => KeySource::Path,
            "global" => KeySource::Global,
            other => {
                let other = crate::quote::escaped(other);
                return Err(format!("unknown variant `{other}`, expected one of {UNITS} or an object with {KEYED}"));
            }
        },
        Value::Object(map) if map.len() == 1 => {
            let Some((kind, argument)) = map.iter().next() else { return Err("must not be empty".into()) };
            let name = || argument.as_str().map(str::to_string).ok_or_else(|| format!("`{kind}` must be a string"));
            match kind.as_str() {
                "header" => KeySource::header(&name()?),
                "query" => KeySource::Query(name()?),
                "cookie" => KeySource::Cookie(name()?),
                "client_ip" => read_network(argument, KeySource::ClientIp, kind)?,
                "property" => KeySource::Property(read_property_path(argument)?),
                "body" => KeySource::Body(vec![read_body_path(argument)?]),
                "x_forwarded_for" if argument.is_object() => {
                    let hops = argument.get("hops").and_then(Value::as_u64).and_then(|n| u32::try_from(n).ok());
                    let hops = hops.ok_or("`x_forwarded_for.hops` must be a whole number of trusted hops")?;
                    read_network(argument, KeySource::XForwardedFor(hops), kind)?
                }
                "x_forwarded_for" => {
                    let hops = argument.as_u64().and_then(|n| u32::try_from(n).ok());
                    KeySource::XForwardedFor(hops.ok_or("`x_forwarded_for` must be a whole number of trusted hops")?)
                }
                other => {
                    let other = crate::quote::escaped(other);
                    return Err(format!("unknown variant `{other}`, expected one of {KEYED}"));
                }
            }
        }
        _ => return Err(format!("must be one of {UNITS}, an object with one of {KEYED}, or an array of them")),
    };
    source.validate()?;
    Ok(source)
}

/// A property path: `"a.b.c"` (split at dots) or `["a", "b.with.dots", "c"]` (segments as they are, for a
/// metadata namespace such as `envoy.filters.http.jwt_authn`).
pub(super) fn read_property_path(argument: &Value) -> Result<Vec<String>, String> {
    let path: Option<Vec<String>> = match argument {
        Value::String(text) => Some(text.split('.').map(str::to_string).collect()),
        Value::Array(items) => items.iter().map(|item| item.as_str().map(str::to_string)).collect(),
        _ => None,
    };
    path.filter(|path| !path.is_empty() && path.iter().all(|segment| !segment.is_empty()))
        .ok_or_else(|| "`property` must be a dotted path such as \"filter_state.plan\" or a list of segments".into())
}

/// The prefixes of `{"client_ip": {...}}` / `{"x_forwarded_for": {"hops": N, ...}}`: `ipv4_prefix` (0..=32,
/// default 32) and `ipv6_prefix` (0..=128, default 128), at least one given.
fn read_network(argument: &Value, of: KeySource, kind: &str) -> Result<KeySource, String> {
    let Value::Object(fields) = argument else {
        return Err(format!("`{kind}` must be an object with `ipv4_prefix` and/or `ipv6_prefix`"));
    };
    if let Some(unknown) = fields.keys().find(|k| !matches!(k.as_str(), "hops" | "ipv4_prefix" | "ipv6_prefix")) {
        let unknown = crate::quote::escaped(unknown);
        return Err(format!("`{kind}`: unknown field `{unknown}`, expected `ipv4_prefix`, `ipv6_prefix`"));
    }
    let prefix = |name: &str, most: u8| match fields.get(name) {
        None => Ok(most),
        Some(value) => value
            .as_u64()
            .and_then(|n| u8::try_from(n).ok())
            .filter(|&n| n <= most)
            .ok_or_else(|| format!("`{kind}.{name}` must be a whole number from 0 to {most}")),
    };
    if !fields.contains_key("ipv4_prefix") && !fields.contains_key("ipv6_prefix") {
        return Err(format!("`{kind}` needs `ipv4_prefix` and/or `ipv6_prefix`"));
    }
    let prefix = IpPrefix { ipv4: prefix("ipv4_prefix", 32)?, ipv6: prefix("ipv6_prefix", 128)? };
    Ok(KeySource::Network { of: Box::new(of), prefix })
}

/// A dotted path into the JSON request body (`"model"`, `"generationConfig.maxOutputTokens"`), as its
/// member names.
///
/// # Errors
/// A sentence when it is not a string of non-empty dot-separated names.
pub(super) fn read_body_path(value: &Value) -> Result<Vec<String>, String> {
    let text = value.as_str().ok_or("`body` must be a dotted path such as \"model\"")?;
    if text.is_empty() || text.split('.').any(str::is_empty) {
        return Err("`body` must be a dotted path of non-empty names, such as \"model\"".into());
    }
    Ok(text.split('.').map(str::to_string).collect())
}
