//! Validation: the configuration's JSON, read field by field ([`super::reader`]), becomes a
//! [`PluginConfig`], or a [`ConfigError`] that names the offending field. Defaults are written here, next
//! to the field they belong to; nothing is defaulted silently over a wrong value.

use crate::prelude::*;

use serde_json::Value;

use super::reader::{DurationMs, Object};
use super::{
    ClockSource, ConfigError, FailureMode, HeaderStyle, Lease, LimiterType, LocalFallback, Mode, OnMissing,
    PluginConfig, RateSource, RedisConfig, Rejection, Rule, Secret, TransportKind,
};
use alloc::boxed::Box;

use crate::key::{IpPrefix, KeySource};
use crate::matching::{parse_network, Exemption, Pattern, ValueMatch};
use crate::quote::quoted;

/// Default keep-alive of a keyed limiter (per user, per IP...): one hour, so the keys of one-off clients vanish.
const DEFAULT_KEEP_ALIVE_MS: u64 = 3_600_000;
/// Largest rate accepted: Redisson's members carry permits as a 4-byte unsigned integer.
const MAX_RATE: u64 = u32::MAX as u64;
/// Largest interval accepted (about 31 years): keeps `now - interval` and TTL arithmetic far from overflow.
const MAX_INTERVAL_MS: u64 = 1 << 40;

const TOP_FIELDS: &[&str] = &[
    "redis",
    "rules",
    "failure_mode",
    "failure_status",
    "rejected_status",
    "rejected_body",
    "rate_limit_headers",
    "cache_size",
    "clock",
    "local_block_slots",
    "local_fallback",
    "mode",
    "shadow_headers",
    "exempt",
];
const EXEMPT_FIELDS: &[&str] = &["client_ips", "headers"];
const RATE_BY_VALUE_FIELDS: &[&str] = &["values", "regex", "rate", "interval", "permits"];
/// Most entries of one `rates_by_value`, values of one entry, and networks or header values of an `exempt`.
const MAX_MATCHES: usize = 1024;
const LOCAL_FALLBACK_FIELDS: &[&str] = &["gateways", "probe_interval"];
/// Default `local_fallback.probe_interval`: a dead Redis gets one request per VM per second.
const DEFAULT_PROBE_INTERVAL_MS: u64 = 1_000;
const REDIS_FIELDS: &[&str] = &[
    "transport",
    "cluster",
    "service_name",
    "service_port",
    "username",
    "password",
    "timeout",
    "database",
    "authority",
    "redis_cluster",
];
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
];
const LEASE_FIELDS: &[&str] = &["max_permits", "max_age"];
/// Largest `lease.max_permits`: one lease is one permit member, and a VM serves it alone.
const MAX_LEASE_PERMITS: u64 = 65_536;
/// Default `local_block_max`: long enough to shed an attack on a key, short enough to bound what a rate an
/// operator raises meanwhile costs (README.md, "Local block").
const DEFAULT_LOCAL_BLOCK_MAX_MS: u64 = 5_000;
/// Default and largest `local_block_slots`.
const DEFAULT_LOCAL_BLOCK_SLOTS: u32 = 4096;
const MAX_LOCAL_BLOCK_SLOTS: u32 = 65_536;

impl PluginConfig {
    /// Reads and validates a configuration already parsed as JSON.
    ///
    /// # Errors
    /// A [`ConfigError`] naming the first offending field: unknown fields, wrong types and out-of-range
    /// values are all refused.
    pub fn from_value(value: &Value) -> Result<Self, ConfigError> {
        Self::read(Object::new(value, "")?)
    }

    /// Reads and validates a configuration from its top-level object (possibly layered: Higress
    /// `_rules_` overlays).
    pub(super) fn read(mut top: Object<'_>) -> Result<Self, ConfigError> {
        let redis = read_redis(top.required("redis", Object::object)?)?;
        let (items, at) = top.required("rules", Object::array)?;
        if items.is_empty() {
            return Err(top.error("rules", "at least one rule is required"));
        }
        let mode = top.choice("mode", &[("enforce", Mode::Enforce), ("shadow", Mode::Shadow)])?.unwrap_or_default();
        let mut rules: Vec<Rule> = Vec::with_capacity(items.len());
        for (index, item) in items.iter().enumerate() {
            let path = format!("{at}[{index}]");
            let entries = read_rule(Object::new(item, &path)?, mode)?;
            if let Some(rule) = entries.first().filter(|rule| rules.iter().any(|r| r.name == rule.name)) {
                return Err(ConfigError::new(
                    format!("{path}.name"),
                    format!("duplicate rule name {}", quoted(&rule.name)),
                ));
            }
            rules.extend(entries);
        }
        let failure_mode = top.choice(
            "failure_mode",
            &[("allow", FailureMode::Allow), ("deny", FailureMode::Deny), ("local", FailureMode::Local)],
        )?;
        let failure_status = status(&mut top, "failure_status", 503)?;
        let rejected_status = status(&mut top, "rejected_status", 429)?;
        let rejected_body = top.string("rejected_body")?.unwrap_or_else(|| "rate limit exceeded\n".to_string());
        let headers = top.choice(
            "rate_limit_headers",
            &[
                ("draft", HeaderStyle::Draft),
                ("legacy", HeaderStyle::Legacy),
                ("both", HeaderStyle::Both),
                ("none", HeaderStyle::None),
            ],
        )?;
        let cache_size = top.number::<usize>("cache_size")?.unwrap_or(10_000);
        if cache_size == 0 {
            return Err(top.error("cache_size", "must be at least 1"));
        }
        let clock = top.choice("clock", &[("gateway", ClockSource::Gateway), ("redis", ClockSource::Redis)])?;
        let local_block_slots = top.number::<u32>("local_block_slots")?.unwrap_or(DEFAULT_LOCAL_BLOCK_SLOTS);
        if local_block_slots == 0 || local_block_slots > MAX_LOCAL_BLOCK_SLOTS {
            return Err(top.error("local_block_slots", format!("must be between 1 and {MAX_LOCAL_BLOCK_SLOTS}")));
        }
        let local_fallback = match (failure_mode, top.object("local_fallback")?) {
            (Some(FailureMode::Local), Some(section)) => Some(read_local_fallback(section, local_block_slots)?),
            (Some(FailureMode::Local), None) => {
                return Err(top.error("local_fallback", "required with failure_mode \"local\" (gateways)"))
            }
            (_, Some(_)) => return Err(top.error("local_fallback", "only with failure_mode \"local\"")),
            (_, None) => None,
        };
        let shadow_headers = top.boolean("shadow_headers")?.unwrap_or(false);
        let exempt = top.object("exempt")?.map(read_exemption).transpose()?;
        top.finish(TOP_FIELDS)?;
        Ok(PluginConfig {
            redis,
            rules,
            failure_mode: failure_mode.unwrap_or_default(),
            failure_status,
            rejection: Rejection { status: rejected_status, body: rejected_body },
            headers: headers.unwrap_or_default(),
            cache_size,
            clock: clock.unwrap_or_default(),
            local_block_slots,
            local_fallback,
            exempt,
            shadow_headers,
        })
    }
}

/// `exempt`: `client_ips` (networks or addresses) and `headers` (`{"name": ["value", ...]}`); at least one.
fn read_exemption(mut section: Object<'_>) -> Result<Exemption, ConfigError> {
    let mut exemption = Exemption::default();
    if let Some((items, at)) = section.array("client_ips")? {
        if items.len() > MAX_MATCHES {
            return Err(section.error("client_ips", format!("at most {MAX_MATCHES} networks")));
        }
        for (index, item) in items.iter().enumerate() {
            let text = item.as_str().ok_or_else(|| ConfigError::new(format!("{at}[{index}]"), "must be a string"))?;
            exemption
                .client_ips
                .push(parse_network(text).map_err(|why| ConfigError::new(format!("{at}[{index}]"), why))?);
        }
    }
    if let Some(headers) = section.get("headers") {
        let at = section.path_of("headers");
        let Value::Object(headers) = headers else {
            return Err(ConfigError::new(at, "must be an object of header names to arrays of values"));
        };
        for (name, values) in headers {
            let field = format!("{at}.{}", crate::quote::escaped(name));
            let values = match values {
                Value::Array(values) if !values.is_empty() && values.len() <= MAX_MATCHES => values,
                _ => return Err(ConfigError::new(field, format!("must be an array of 1 to {MAX_MATCHES} strings"))),
            };
            let values = values
                .iter()
                .map(|v| v.as_str().map(|v| v.as_bytes().to_vec()))
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| ConfigError::new(field.clone(), "values must be strings"))?;
            if name.trim().is_empty() {
                return Err(ConfigError::new(field, "the header name must not be empty"));
            }
            exemption.headers.push((name.trim().to_ascii_lowercase(), values));
        }
    }
    if exemption.client_ips.is_empty() && exemption.headers.is_empty() {
        return Err(ConfigError::new(section.path(), "needs `client_ips` or `headers`"));
    }
    section.finish(EXEMPT_FIELDS)?;
    Ok(exemption)
}

/// `local_fallback`: `gateways` (required, at least 1), `probe_interval` (1 ms to 1 h, default 1 s); the
/// windows take as many slots as the local blocks (`local_block_slots`).
fn read_local_fallback(mut section: Object<'_>, slots: u32) -> Result<LocalFallback, ConfigError> {
    let gateways = section.required("gateways", Object::number::<u32>)?;
    if gateways == 0 {
        return Err(section.error("gateways", "must be at least 1"));
    }
    let probe_interval_ms = section.duration("probe_interval")?.map_or(DEFAULT_PROBE_INTERVAL_MS, |d| d.0);
    if probe_interval_ms == 0 || probe_interval_ms > 3_600_000 {
        return Err(section.error("probe_interval", "must be between 1 ms and 1 h"));
    }
    section.finish(LOCAL_FALLBACK_FIELDS)?;
    Ok(LocalFallback { gateways, probe_interval_ms, slots })
}

/// An HTTP status field between 200 and 599.
fn status(top: &mut Object<'_>, name: &'static str, default: u16) -> Result<u16, ConfigError> {
    let status = top.number::<u16>(name)?.unwrap_or(default);
    if (200..=599).contains(&status) {
        Ok(status)
    } else {
        Err(top.error(name, format!("{status} is not an HTTP status between 200 and 599")))
    }
}

fn read_redis(mut redis: Object<'_>) -> Result<RedisConfig, ConfigError> {
    let transport = redis
        .choice("transport", &[("http", TransportKind::Http), ("host", TransportKind::Host)])?
        .unwrap_or(TransportKind::Http);
    let cluster = match (redis.string("cluster")?, redis.string("service_name")?) {
        (Some(_), Some(_)) => return Err(redis.error("cluster", "set either `cluster` or `service_name`, not both")),
        (None, None) => return Err(ConfigError::new(redis.path(), "`cluster` or `service_name` is required")),
        (Some(cluster), None) => {
            if redis.get("service_port").is_some() {
                return Err(redis.error("service_port", "only valid with `service_name`"));
            }
            non_empty(&redis.path_of("cluster"), cluster)?
        }
        (None, Some(name)) => {
            let name = non_empty(&redis.path_of("service_name"), name)?;
            let default_port = if name.ends_with(".static") { 80 } else { 6379 };
            let port = redis.number::<u16>("service_port")?.unwrap_or(default_port);
            // Higress builds cluster names this way (DESIGN.md, "the Higress host Redis interface").
            format!("outbound|{port}||{name}")
        }
    };
    let username = redis.string("username")?;
    let password = redis.secret("password")?;
    let timeout_ms = redis.duration("timeout")?.map_or(1000, |DurationMs(ms)| ms);
    if timeout_ms == 0 {
        return Err(redis.error("timeout", "must be at least 1 ms"));
    }
    if timeout_ms > u64::from(u32::MAX) {
        return Err(redis.error("timeout", format!("must be at most {} ms", u32::MAX)));
    }
    let database = redis.number::<u32>("database")?.unwrap_or(0);
    if transport == TransportKind::Http && database != 0 {
        return Err(redis.error(
            "database",
            "the http transport cannot select a database: set `database` in the bridge's (webdis) configuration",
        ));
    }
    let basic_auth = match (&username, &password) {
        (None, None) => None,
        (user, password) => {
            let credentials =
                format!("{}:{}", user.as_deref().unwrap_or(""), password.as_ref().map_or("", Secret::expose));
            let mut value = String::from("Basic ");
            crate::encoding::base64_into(credentials.as_bytes(), crate::encoding::STANDARD, true, &mut value);
            Some(Secret::new(value))
        }
    };
    let authority = match redis.string("authority")? {
        Some(authority) => non_empty(&redis.path_of("authority"), authority)?,
        None => cluster.clone(),
    };
    let redis_cluster = redis.boolean("redis_cluster")?.unwrap_or(false);
    redis.finish(REDIS_FIELDS)?;
    Ok(RedisConfig {
        transport,
        cluster,
        authority,
        username,
        password,
        basic_auth,
        timeout_ms,
        database,
        redis_cluster,
    })
}

fn non_empty(field: &str, value: String) -> Result<String, ConfigError> {
    if value.trim().is_empty() {
        Err(ConfigError::new(field, "must not be empty"))
    } else {
        Ok(value)
    }
}

/// A rule, as its entries: one, or with `rates_by_value` one per value match and the default last.
fn read_rule(mut rule: Object<'_>, default_mode: Mode) -> Result<Vec<Rule>, ConfigError> {
    let name = rule.required("name", Object::string)?;
    if name.is_empty() || !name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-') {
        return Err(rule.error("name", format!("{} must be non-empty and use only A-Z a-z 0-9 _ -", quoted(&name))));
    }
    let limit_by = rule.required("limit_by", |rule, name| Ok(rule.get(name)))?;
    let source = read_key_source(limit_by).map_err(|why| rule.error("limit_by", why))?;
    let rate = rule.required("rate", Object::u64)?;
    if rate == 0 {
        return Err(rule.error("rate", "must be at least 1"));
    }
    if rate > MAX_RATE {
        return Err(rule.error("rate", format!("must be at most {MAX_RATE}")));
    }
    let DurationMs(interval_ms) = rule.required("interval", Object::duration)?;
    if interval_ms == 0 {
        return Err(rule.error("interval", "must be at least 1 ms"));
    }
    if interval_ms > MAX_INTERVAL_MS {
        return Err(rule.error("interval", format!("must be at most {MAX_INTERVAL_MS} ms")));
    }
    let limiter_type = rule
        .choice("type", &[("overall", LimiterType::Overall), ("per_client", LimiterType::PerClient)])?
        .unwrap_or_default();
    let permits = rule.u64("permits")?.unwrap_or(1);
    if permits == 0 || permits > rate {
        return Err(rule.error("permits", format!("{permits} must be between 1 and the rate ({rate})")));
    }
    let keep_alive_ms = match rule.duration("keep_alive")? {
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
        None if source == KeySource::Global => 0,
        None => interval_ms.max(DEFAULT_KEEP_ALIVE_MS),
    };
    let on_missing = rule
        .choice("on_missing", &[("skip", OnMissing::Skip), ("deny", OnMissing::Deny), ("share", OnMissing::Share)])?
        .unwrap_or_default();
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
    let rate_source = rule
        .choice("rate_source", &[("redis", RateSource::Redis), ("config", RateSource::Config)])?
        .unwrap_or_default();
    let local_block_max_ms = rule.duration("local_block_max")?.map_or(DEFAULT_LOCAL_BLOCK_MAX_MS, |DurationMs(ms)| ms);
    if local_block_max_ms > MAX_INTERVAL_MS {
        return Err(rule.error("local_block_max", format!("must be at most {MAX_INTERVAL_MS} ms")));
    }
    let lease = match rule.object("lease")? {
        Some(lease) => Some(read_lease(lease, rate, interval_ms, permits)?),
        None => None,
    };
    let mode = rule.choice("mode", &[("enforce", Mode::Enforce), ("shadow", Mode::Shadow)])?.unwrap_or(default_mode);
    let exempt = rule.object("exempt")?.map(read_exemption).transpose()?;
    let by_value = rule.array("rates_by_value")?;
    let explicit_keep_alive = rule.get("keep_alive").is_some();
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
    };
    let Some((items, at)) = by_value else { return Ok(vec![base]) };
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
    let permits = entry.u64("permits")?.unwrap_or(rule.permits);
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
fn read_key_source(value: &Value) -> Result<KeySource, String> {
    const UNITS: &str = "`client_ip`, `path`, `global`";
    const KEYED: &str = "`header`, `query`, `cookie`, `x_forwarded_for`, `client_ip`";
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
                return Err(format!("unknown variant `{other}`, expected one of {UNITS} or an object with {KEYED}"))
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
                "x_forwarded_for" if argument.is_object() => {
                    let hops = argument.get("hops").and_then(Value::as_u64).and_then(|n| u32::try_from(n).ok());
                    let hops = hops.ok_or("`x_forwarded_for.hops` must be a whole number of trusted hops")?;
                    read_network(argument, KeySource::XForwardedFor(hops), kind)?
                }
                "x_forwarded_for" => {
                    let hops = argument.as_u64().and_then(|n| u32::try_from(n).ok());
                    KeySource::XForwardedFor(hops.ok_or("`x_forwarded_for` must be a whole number of trusted hops")?)
                }
                other => return Err(format!("unknown variant `{other}`, expected one of {KEYED}")),
            }
        }
        _ => return Err(format!("must be one of {UNITS}, an object with one of {KEYED}, or an array of them")),
    };
    source.validate()?;
    Ok(source)
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
