//! Validation: the configuration's JSON, read field by field ([`super::reader`]), becomes a
//! [`PluginConfig`], or a [`ConfigError`] that names the offending field. Defaults are written here, next
//! to the field they belong to; nothing is defaulted silently over a wrong value.

use crate::prelude::*;

use serde_json::Value;

use super::reader::{DurationMs, Object};
use super::{
    ClockSource, Coalescing, ConfigError, FailureMode, GrpcAnswers, HeaderStyle, LocalFallback, Mode, PluginConfig,
    RedisConfig, Rejection, Rule, Secret, TransportKind, MAX_BATCH,
};

use crate::matching::{parse_network, Exemption};
use crate::quote::quoted;

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
    "histograms",
    "exempt",
    "grpc",
    "hold_headers_for_body",
];
const GRPC_FIELDS: &[&str] = &["rejected_status", "failure_status"];
/// gRPC's status names by code, as gRPC's `doc/statuscodes.md` lists them.
const GRPC_STATUS_NAMES: [&str; 17] = [
    "OK",
    "CANCELLED",
    "UNKNOWN",
    "INVALID_ARGUMENT",
    "DEADLINE_EXCEEDED",
    "NOT_FOUND",
    "ALREADY_EXISTS",
    "PERMISSION_DENIED",
    "RESOURCE_EXHAUSTED",
    "FAILED_PRECONDITION",
    "ABORTED",
    "OUT_OF_RANGE",
    "UNIMPLEMENTED",
    "INTERNAL",
    "UNAVAILABLE",
    "DATA_LOSS",
    "UNAUTHENTICATED",
];
const EXEMPT_FIELDS: &[&str] = &["client_ips", "headers"];
/// Most entries of one `rates_by_value`, values of one entry, and networks or header values of an `exempt`.
pub(super) const MAX_MATCHES: usize = 1024;
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
    "max_batch",
    "max_in_flight",
    "max_batch_bytes",
];
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
        let (rules, inflight) = read_rules(items, &at, mode, redis.timeout_ms)?;
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
        if clock == Some(ClockSource::Redis)
            && rules.iter().any(|r| r.cost.is_some() && r.layout != super::WindowLayout::SlidingLog)
        {
            // A settle goes into the slice of its acquire time, which the gateway knows only on its own clock.
            return Err(top.error(
                "clock",
                "\"redis\" cannot settle a counter's `cost` (a sliding window counter or a calendar quota: its slice is the gateway's time)",
            ));
        }
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
        let histograms = top.boolean("histograms")?.unwrap_or(true);
        let exempt = top.object("exempt")?.map(read_exemption).transpose()?;
        let grpc = top.object("grpc")?.map(read_grpc).transpose()?.unwrap_or_default();
        let hold_headers_for_body = top.boolean("hold_headers_for_body")?.unwrap_or(false);
        top.finish(TOP_FIELDS)?;
        Ok(PluginConfig {
            redis,
            rules,
            inflight,
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
            histograms,
            grpc,
            hold_headers_for_body,
        })
    }
}

/// The `rules` array at `at`: the rate rules (a rule's `rates_by_value` entries one each) and the in-flight
/// rules (`max_in_flight`, their lease checked against `redis.timeout`, `timeout_ms`), each in configuration
/// order; every rule name unique across both.
fn read_rules(
    items: &[Value],
    at: &str,
    mode: Mode,
    timeout_ms: u64,
) -> Result<(Vec<Rule>, Vec<super::InflightRule>), ConfigError> {
    let mut rules: Vec<Rule> = Vec::with_capacity(items.len());
    let mut inflight: Vec<super::InflightRule> = Vec::new();
    for (index, item) in items.iter().enumerate() {
        let path = format!("{at}[{index}]");
        let (inflight_rule, entries) = if super::inflight::is_inflight(item) {
            (Some(super::inflight::read_inflight_rule(Object::new(item, &path)?, mode, timeout_ms)?), Vec::new())
        } else {
            (None, super::rules::read_rule(Object::new(item, &path)?, mode)?)
        };
        let name = inflight_rule.as_ref().map(|r| &r.name).or_else(|| entries.first().map(|r| &r.name));
        let mut taken = rules.iter().map(|r| &r.name).chain(inflight.iter().map(|r| &r.name));
        if let Some(name) = name.filter(|name| taken.any(|taken| taken == *name)) {
            return Err(ConfigError::new(format!("{path}.name"), format!("duplicate rule name {}", quoted(name))));
        }
        inflight.extend(inflight_rule);
        rules.extend(entries);
    }
    // Waiting is built for rate rules whose requests are decided from their headers (issue 43's first part).
    if let Some(first) = rules.iter().position(|rule| rule.max_wait_ms > 0) {
        let why = if !inflight.is_empty() {
            Some("cannot be used yet in a configuration with in-flight rules (`max_in_flight`)")
        } else if rules.iter().any(|rule| rule.lease.is_some()) {
            Some("cannot be used yet in a configuration with a `lease` rule")
        } else if rules.iter().any(super::Rule::reads_body) {
            Some("cannot be used yet in a configuration whose rules read the request body")
        } else {
            None
        };
        if let Some(why) = why {
            let name = rules.get(first).map(|rule| rule.name.as_str());
            let index = items.iter().position(|item| item.get("name").and_then(Value::as_str) == name);
            return Err(ConfigError::new(format!("{at}[{}].max_wait", index.unwrap_or(first)), why));
        }
    }
    Ok((rules, inflight))
}

/// `exempt`: `client_ips` (networks or addresses) and `headers` (`{"name": ["value", ...]}`); at least one.
pub(super) fn read_exemption(mut section: Object<'_>) -> Result<Exemption, ConfigError> {
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

/// `grpc`: the gRPC statuses of the filter's own answers, each a name of gRPC's `doc/statuscodes.md`
/// (`"RESOURCE_EXHAUSTED"`) or its number, 1..=16 (OK is not an answer to a refused request).
fn read_grpc(mut grpc: Object<'_>) -> Result<GrpcAnswers, ConfigError> {
    let defaults = GrpcAnswers::default();
    let rejected_status = grpc_status(&mut grpc, "rejected_status")?.unwrap_or(defaults.rejected_status);
    let failure_status = grpc_status(&mut grpc, "failure_status")?.unwrap_or(defaults.failure_status);
    grpc.finish(GRPC_FIELDS)?;
    Ok(GrpcAnswers { rejected_status, failure_status })
}

fn grpc_status(grpc: &mut Object<'_>, name: &'static str) -> Result<Option<u8>, ConfigError> {
    let code = match grpc.get(name) {
        None => return Ok(None),
        Some(Value::String(text)) => {
            GRPC_STATUS_NAMES.iter().position(|written| *written == text).and_then(|code| u8::try_from(code).ok())
        }
        Some(value) => value.as_u64().and_then(|code| u8::try_from(code).ok()),
    };
    match code {
        Some(code @ 1..=16) => Ok(Some(code)),
        _ => Err(grpc.error(
            name,
            "must be a gRPC status other than OK: a name such as \"RESOURCE_EXHAUSTED\" or \"UNAVAILABLE\", or its number, 1 to 16",
        )),
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
    let coalescing = read_coalescing(&mut redis)?;
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
        coalescing,
    })
}

/// `max_batch`, `max_in_flight`, `max_batch_bytes` of `redis` (docs/configuration.md, "Request coalescing").
fn read_coalescing(redis: &mut Object<'_>) -> Result<Coalescing, ConfigError> {
    let defaults = Coalescing::default();
    let mut bounded = |name: &'static str, default: u32, range: core::ops::RangeInclusive<u32>| {
        let value = redis.number::<u32>(name)?.unwrap_or(default);
        if range.contains(&value) {
            Ok(value)
        } else {
            Err(redis.error(name, format!("must be between {} and {}", range.start(), range.end())))
        }
    };
    Ok(Coalescing {
        max_batch: bounded("max_batch", defaults.max_batch, 1..=MAX_BATCH)?,
        max_in_flight: bounded("max_in_flight", defaults.max_in_flight, 1..=64)?,
        max_batch_bytes: bounded("max_batch_bytes", defaults.max_batch_bytes, 1024..=1 << 20)?,
    })
}

pub(super) fn non_empty(field: &str, value: String) -> Result<String, ConfigError> {
    if value.trim().is_empty() {
        Err(ConfigError::new(field, "must not be empty"))
    } else {
        Ok(value)
    }
}
