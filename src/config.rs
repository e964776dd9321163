//! Plugin configuration: the JSON a gateway hands to the filter, parsed and validated once (in
//! `on_configure`) into an immutable [`PluginConfig`] shared by every request of the VM.
//!
//! Every error names the field it is about (`rules[0].rate: must be at least 1`), so an operator can fix
//! the configuration from the gateway's log line alone. The field reference is in README.md.

use std::fmt;

use base64::Engine as _;
use serde::{Deserialize, Deserializer};

use crate::key::KeySource;

/// A configuration the filter refuses to load.
///
/// `field` is the path of the offending field in the JSON (`redis.timeout`, `rules[2].limit_by`), or
/// empty when the document as a whole is wrong (not JSON, not an object).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    /// Path of the field, as `a.b[3].c`.
    pub field: String,
    /// Why the value was refused.
    pub reason: String,
}

impl ConfigError {
    fn new(field: impl Into<String>, reason: impl Into<String>) -> Self {
        Self { field: field.into(), reason: reason.into() }
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.field.is_empty() {
            write!(f, "{}", self.reason)
        } else {
            write!(f, "{}: {}", self.field, self.reason)
        }
    }
}

impl std::error::Error for ConfigError {}

/// How the filter reaches Redis.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TransportKind {
    /// An HTTP-to-Redis bridge (webdis) reached with `dispatch_http_call`: the stock Envoy / Istio build.
    Http,
    /// The host's outbound Redis interface (`proxy_redis_call`, Higress): the host-redis build.
    Host,
}

/// What happens to a request the filter cannot decide because Redis or the bridge failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum FailureMode {
    /// Fail open: the request continues upstream (Envoy's global rate limit filter does the same by default).
    #[default]
    Allow,
    /// Fail closed: the request is answered with `failure_status`.
    Deny,
}

/// Redisson's `RateType`: whose window a limiter counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum LimiterType {
    /// `RateType.OVERALL` (stored as `"0"`): one window shared by every gateway and Redisson client.
    #[default]
    Overall,
    /// `RateType.PER_CLIENT` (stored as `"1"`): one window per client instance, here per gateway process.
    PerClient,
}

impl LimiterType {
    /// The value Redisson stores in the limiter hash's `type` field (`RateType.ordinal()`).
    pub fn redisson_ordinal(self) -> u8 {
        match self {
            LimiterType::Overall => 0,
            LimiterType::PerClient => 1,
        }
    }

    /// The type for a Redisson `type` field value, if it is one Redisson writes.
    pub fn from_redisson_ordinal(ordinal: i64) -> Option<Self> {
        match ordinal {
            0 => Some(LimiterType::Overall),
            1 => Some(LimiterType::PerClient),
            _ => None,
        }
    }
}

/// What a rule does with a request that carries no key value (no such header, query parameter, cookie...).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum OnMissing {
    /// The rule does not apply to the request.
    #[default]
    Skip,
    /// The request is rejected with the rejection status.
    Deny,
    /// All requests without a key value share one limiter (key value: the empty string).
    Share,
}

/// Who wins when Redis holds another rate, interval or type for a limiter than the rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum RateSource {
    /// Redis wins (trySetRate semantics): an operator or a Java service controls the limit.
    #[default]
    Redis,
    /// The configuration wins: applied once per limiter and configuration with updateRate, keeping
    /// consumed permits (no burst at the change).
    Config,
}

/// Where the acquire time comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum ClockSource {
    /// The gateway's clock, as Redisson uses its client's clock.
    #[default]
    Gateway,
    /// Redis's `TIME`: removes clock skew between gateways (and Redisson clients using it).
    Redis,
}

/// Which rate limit headers responses carry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum HeaderStyle {
    /// `RateLimit-Policy` and `RateLimit`, as draft-ietf-httpapi-ratelimit-headers-11.
    #[default]
    Draft,
    /// `X-RateLimit-Limit`, `X-RateLimit-Remaining`, `X-RateLimit-Reset`.
    Legacy,
    /// Both of the above.
    Both,
    /// No rate limit headers (rejections still carry `Retry-After`).
    None,
}

/// A length of time in milliseconds, written in the configuration either as a number of milliseconds
/// (`1500`) or as a duration string in humantime syntax (`"1.5s"`, `"1m"`, `"1h 30m"`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DurationMs(pub u64);

impl<'de> Deserialize<'de> for DurationMs {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Written {
            Millis(u64),
            Text(String),
        }
        match Written::deserialize(deserializer).map_err(|_| {
            serde::de::Error::custom("expected milliseconds (a non-negative integer) or a duration such as \"1s\"")
        })? {
            Written::Millis(ms) => Ok(DurationMs(ms)),
            Written::Text(text) => {
                let duration = humantime::parse_duration(text.trim())
                    .map_err(|e| serde::de::Error::custom(format!("invalid duration {text:?}: {e}")))?;
                let ms = u64::try_from(duration.as_millis())
                    .map_err(|_| serde::de::Error::custom(format!("duration {text:?} is too long")))?;
                if duration.as_nanos() % 1_000_000 != 0 {
                    return Err(serde::de::Error::custom(format!(
                        "duration {text:?} is not a whole number of milliseconds"
                    )));
                }
                Ok(DurationMs(ms))
            }
        }
    }
}

/// The configuration as written, before validation. Field meanings: README.md, "Configuration".
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    redis: RawRedis,
    rules: Vec<RawRule>,
    #[serde(default)]
    failure_mode: FailureMode,
    #[serde(default = "default_failure_status")]
    failure_status: u16,
    #[serde(default = "default_rejected_status")]
    rejected_status: u16,
    #[serde(default = "default_rejected_body")]
    rejected_body: String,
    #[serde(default)]
    rate_limit_headers: HeaderStyle,
    #[serde(default = "default_cache_size")]
    cache_size: usize,
    #[serde(default)]
    clock: ClockSource,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRedis {
    #[serde(default = "default_transport")]
    transport: TransportKind,
    cluster: Option<String>,
    service_name: Option<String>,
    service_port: Option<u16>,
    username: Option<String>,
    password: Option<String>,
    #[serde(default = "default_timeout")]
    timeout: DurationMs,
    #[serde(default)]
    database: u32,
    authority: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRule {
    name: String,
    limit_by: KeySource,
    rate: u64,
    interval: DurationMs,
    #[serde(default, rename = "type")]
    limiter_type: LimiterType,
    #[serde(default = "default_permits")]
    permits: u64,
    keep_alive: Option<DurationMs>,
    #[serde(default)]
    on_missing: OnMissing,
    limiter: Option<String>,
    #[serde(default)]
    rate_source: RateSource,
}

fn default_transport() -> TransportKind {
    TransportKind::Http
}
fn default_timeout() -> DurationMs {
    DurationMs(1000)
}
fn default_failure_status() -> u16 {
    503
}
fn default_rejected_status() -> u16 {
    429
}
fn default_rejected_body() -> String {
    "rate limit exceeded\n".to_string()
}
fn default_cache_size() -> usize {
    10_000
}
fn default_permits() -> u64 {
    1
}

/// Default keep-alive of a keyed limiter (per user, per IP...): one hour, so the keys of one-off clients vanish.
const DEFAULT_KEEP_ALIVE_MS: u64 = 3_600_000;
/// Largest rate accepted: Redisson's members carry permits as a 4-byte unsigned integer.
const MAX_RATE: u64 = u32::MAX as u64;
/// Largest interval accepted (about 31 years): keeps `now - interval` and TTL arithmetic far from overflow.
const MAX_INTERVAL_MS: u64 = 1 << 40;

/// How to reach Redis, validated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RedisConfig {
    /// Which transport carries the commands.
    pub transport: TransportKind,
    /// The Envoy cluster: `cluster` as given, or Higress's `outbound|<port>||<service_name>`.
    pub cluster: String,
    /// `:authority` of bridge requests (default: the cluster name).
    pub authority: String,
    /// Redis ACL user name (host transport), or HTTP Basic user (http transport).
    pub username: Option<String>,
    /// Redis password (host transport), or HTTP Basic password (http transport).
    pub password: Option<String>,
    /// `Authorization` header value for the bridge, precomputed when a password or user is set.
    pub basic_auth: Option<String>,
    /// Per-call timeout, milliseconds.
    pub timeout_ms: u64,
    /// Redis logical database (host transport only; the bridge selects its database itself).
    pub database: u32,
}

/// One rate limit rule, validated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rule {
    /// The rule's name, `[A-Za-z0-9_-]+`: in logs and `RateLimit` headers.
    pub name: String,
    /// Where the key value comes from.
    pub source: KeySource,
    /// Base of the limiter names in Redis (default `erl:<name>`).
    pub limiter: String,
    /// Permits per interval (Redisson `rate`).
    pub rate: u64,
    /// Window length in milliseconds (Redisson `interval`).
    pub interval_ms: u64,
    /// Overall or per client (Redisson `type`).
    pub limiter_type: LimiterType,
    /// Permits one request takes.
    pub permits: u64,
    /// Redisson `keepAliveTime` in milliseconds; 0 = the keys never expire.
    pub keep_alive_ms: u64,
    /// What to do when the request has no key value.
    pub on_missing: OnMissing,
    /// Who wins when Redis holds another config.
    pub rate_source: RateSource,
}

/// The response sent for a rejected request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejection {
    /// HTTP status (default 429).
    pub status: u16,
    /// Body, sent as `text/plain`.
    pub body: String,
}

/// The whole validated plugin configuration, immutable after `on_configure`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PluginConfig {
    /// How to reach Redis.
    pub redis: RedisConfig,
    /// The rules, in configuration order.
    pub rules: Vec<Rule>,
    /// Fail open or closed.
    pub failure_mode: FailureMode,
    /// Status of a fail-closed answer.
    pub failure_status: u16,
    /// The answer to a rejected request.
    pub rejection: Rejection,
    /// Which rate limit headers responses carry.
    pub headers: HeaderStyle,
    /// How many limiter names the per-VM cache remembers.
    pub cache_size: usize,
    /// Where acquire times come from.
    pub clock: ClockSource,
}

impl PluginConfig {
    /// Parses and validates a plugin configuration (JSON bytes).
    ///
    /// # Errors
    /// A [`ConfigError`] naming the first offending field: JSON syntax, unknown fields, wrong types and
    /// out-of-range values are all refused; nothing is defaulted silently over a wrong value.
    pub fn from_json(bytes: &[u8]) -> Result<Self, ConfigError> {
        let value = serde_json::from_slice(bytes).map_err(|e| ConfigError::new("", e.to_string()))?;
        Self::from_value(value)
    }

    /// Parses and validates a configuration already read as a JSON value.
    ///
    /// # Errors
    /// As [`PluginConfig::from_json`].
    pub fn from_value(value: serde_json::Value) -> Result<Self, ConfigError> {
        let raw: RawConfig = serde_path_to_error::deserialize(value).map_err(|e| {
            let field = e.path().to_string();
            let field = if field == "." { String::new() } else { field };
            ConfigError::new(field, e.inner().to_string())
        })?;
        raw.validate()
    }
}

/// A configuration that applies to some routes or domains only (Higress `matchRules`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Override {
    /// Route names (the `route_name` property; Higress: the Ingress `namespace/name`) it applies to.
    pub routes: Vec<String>,
    /// Domains (`:authority` without the port, case-insensitive; `*.example.com` matches subdomains).
    pub domains: Vec<String>,
    /// The configuration: the global fields overlaid with the rule's own.
    pub config: PluginConfig,
}

/// The whole plugin configuration: a global configuration and Higress's per-route / per-domain overrides.
///
/// Higress passes `matchRules` inside the plugin configuration as
/// `_rules_: [{"_match_route_": [...], "_match_domain_": [...], <fields>}]` next to the global fields
/// (DESIGN.md, "the Higress host Redis interface"); a rule's fields replace the global fields of the same
/// name (a shallow overlay), and a route match beats a domain match beats the global configuration. With
/// `_rules_` and no global fields, requests that match no rule are not limited.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plugin {
    /// The configuration of requests no override matches (`None`: they are not limited).
    pub global: Option<PluginConfig>,
    /// The overrides, in configuration order.
    pub overrides: Vec<Override>,
}

impl Plugin {
    /// Parses and validates the plugin configuration (JSON bytes), overrides included.
    ///
    /// # Errors
    /// A [`ConfigError`] naming the first offending field; fields of an override are named from the top,
    /// e.g. `_rules_[1].rules[0].rate`.
    pub fn from_json(bytes: &[u8]) -> Result<Self, ConfigError> {
        let value: serde_json::Value =
            serde_json::from_slice(bytes).map_err(|e| ConfigError::new("", e.to_string()))?;
        let serde_json::Value::Object(mut global) = value else {
            return Err(ConfigError::new("", "the configuration must be a JSON object"));
        };
        let rules = match global.remove("_rules_") {
            None => {
                return Ok(Plugin { global: Some(PluginConfig::from_value(global.into())?), overrides: Vec::new() })
            }
            Some(serde_json::Value::Array(rules)) => rules,
            Some(_) => return Err(ConfigError::new("_rules_", "must be an array of match rules")),
        };
        let mut overrides = Vec::with_capacity(rules.len());
        for (index, rule) in rules.into_iter().enumerate() {
            let at = format!("_rules_[{index}]");
            let serde_json::Value::Object(mut fields) = rule else {
                return Err(ConfigError::new(at, "must be an object"));
            };
            let routes = match_list(&mut fields, "_match_route_", &at)?;
            let domains = match_list(&mut fields, "_match_domain_", &at)?;
            if routes.is_empty() && domains.is_empty() {
                return Err(ConfigError::new(at, "needs `_match_route_` or `_match_domain_`"));
            }
            let mut merged = global.clone();
            merged.extend(fields);
            let config = PluginConfig::from_value(merged.into()).map_err(|e| ConfigError {
                field: if e.field.is_empty() { at.clone() } else { format!("{at}.{}", e.field) },
                reason: e.reason,
            })?;
            overrides.push(Override { routes, domains, config });
        }
        let global = if global.is_empty() { None } else { Some(PluginConfig::from_value(global.into())?) };
        Ok(Plugin { global, overrides })
    }

    /// The configuration for a request on route `route` (the `route_name` property) to `authority`, and
    /// its index in [`Plugin::configs`]; `None` when no configuration applies.
    pub fn select(&self, route: Option<&str>, authority: Option<&str>) -> Option<(usize, &PluginConfig)> {
        let host = authority.map(|a| strip_port(a).to_ascii_lowercase());
        let by_route = route.and_then(|route| self.overrides.iter().position(|o| o.routes.iter().any(|r| r == route)));
        let by_domain = || {
            let host = host.as_deref()?;
            self.overrides.iter().position(|o| o.domains.iter().any(|d| domain_matches(d, host)))
        };
        match by_route.or_else(by_domain) {
            Some(index) => self.overrides.get(index).map(|o| (index + 1, &o.config)),
            None => self.global.as_ref().map(|config| (0, config)),
        }
    }

    /// The configuration with this index (see [`Plugin::configs`]).
    pub fn config(&self, index: usize) -> Option<&PluginConfig> {
        match index {
            0 => self.global.as_ref(),
            i => self.overrides.get(i - 1).map(|o| &o.config),
        }
    }

    /// Every configuration by index: 0 the global one (if any), then the overrides in order.
    pub fn configs(&self) -> impl Iterator<Item = (usize, &PluginConfig)> {
        self.global.iter().map(|c| (0, c)).chain(self.overrides.iter().enumerate().map(|(i, o)| (i + 1, &o.config)))
    }
}

fn match_list(
    fields: &mut serde_json::Map<String, serde_json::Value>,
    name: &str,
    at: &str,
) -> Result<Vec<String>, ConfigError> {
    match fields.remove(name) {
        None => Ok(Vec::new()),
        Some(serde_json::Value::Array(items)) => items
            .into_iter()
            .map(|item| match item {
                serde_json::Value::String(text) if !text.is_empty() => Ok(text),
                _ => Err(ConfigError::new(format!("{at}.{name}"), "must be an array of non-empty strings")),
            })
            .collect(),
        Some(_) => Err(ConfigError::new(format!("{at}.{name}"), "must be an array of non-empty strings")),
    }
}

/// `host:port` or `[v6]:port` without the port.
fn strip_port(authority: &str) -> &str {
    if authority.starts_with('[') {
        return authority.split_inclusive(']').next().unwrap_or(authority);
    }
    match authority.rsplit_once(':') {
        Some((host, port)) if port.bytes().all(|b| b.is_ascii_digit()) => host,
        _ => authority,
    }
}

/// Whether `host` (lowercase, no port) matches a `_match_domain_` entry: exact, or `*.suffix` for subdomains.
fn domain_matches(pattern: &str, host: &str) -> bool {
    let pattern = pattern.to_ascii_lowercase();
    match pattern.strip_prefix('*') {
        Some(suffix) => host.ends_with(suffix) && host.len() > suffix.len(),
        None => pattern == host,
    }
}

impl RawConfig {
    fn validate(self) -> Result<PluginConfig, ConfigError> {
        let redis = self.redis.validate()?;
        if self.rules.is_empty() {
            return Err(ConfigError::new("rules", "at least one rule is required"));
        }
        let mut rules: Vec<Rule> = Vec::with_capacity(self.rules.len());
        for (index, raw) in self.rules.into_iter().enumerate() {
            let rule = raw.validate(&format!("rules[{index}]"))?;
            if rules.iter().any(|r| r.name == rule.name) {
                return Err(ConfigError::new(
                    format!("rules[{index}].name"),
                    format!("duplicate rule name {:?}", rule.name),
                ));
            }
            rules.push(rule);
        }
        check_status("failure_status", self.failure_status)?;
        check_status("rejected_status", self.rejected_status)?;
        if self.cache_size == 0 {
            return Err(ConfigError::new("cache_size", "must be at least 1"));
        }
        Ok(PluginConfig {
            redis,
            rules,
            failure_mode: self.failure_mode,
            failure_status: self.failure_status,
            rejection: Rejection { status: self.rejected_status, body: self.rejected_body },
            headers: self.rate_limit_headers,
            cache_size: self.cache_size,
            clock: self.clock,
        })
    }
}

fn check_status(field: &str, status: u16) -> Result<(), ConfigError> {
    if (200..=599).contains(&status) {
        Ok(())
    } else {
        Err(ConfigError::new(field, format!("{status} is not an HTTP status between 200 and 599")))
    }
}

impl RawRedis {
    fn validate(self) -> Result<RedisConfig, ConfigError> {
        let cluster = match (self.cluster, self.service_name) {
            (Some(_), Some(_)) => {
                return Err(ConfigError::new("redis.cluster", "set either `cluster` or `service_name`, not both"))
            }
            (None, None) => return Err(ConfigError::new("redis", "`cluster` or `service_name` is required")),
            (Some(cluster), None) => {
                if self.service_port.is_some() {
                    return Err(ConfigError::new("redis.service_port", "only valid with `service_name`"));
                }
                non_empty("redis.cluster", cluster)?
            }
            (None, Some(name)) => {
                let name = non_empty("redis.service_name", name)?;
                let default_port = if name.ends_with(".static") { 80 } else { 6379 };
                // Higress builds cluster names this way (DESIGN.md, "the Higress host Redis interface").
                format!("outbound|{}||{}", self.service_port.unwrap_or(default_port), name)
            }
        };
        if self.timeout.0 == 0 {
            return Err(ConfigError::new("redis.timeout", "must be at least 1 ms"));
        }
        if self.transport == TransportKind::Http && self.database != 0 {
            return Err(ConfigError::new(
                "redis.database",
                "the http transport cannot select a database: set `database` in the bridge's (webdis) configuration",
            ));
        }
        let basic_auth = match (&self.username, &self.password) {
            (None, None) => None,
            (user, password) => {
                let credentials = format!("{}:{}", user.as_deref().unwrap_or(""), password.as_deref().unwrap_or(""));
                Some(format!("Basic {}", base64::engine::general_purpose::STANDARD.encode(credentials)))
            }
        };
        let authority = match self.authority {
            Some(authority) => non_empty("redis.authority", authority)?,
            None => cluster.clone(),
        };
        Ok(RedisConfig {
            transport: self.transport,
            cluster,
            authority,
            username: self.username,
            password: self.password,
            basic_auth,
            timeout_ms: self.timeout.0,
            database: self.database,
        })
    }
}

fn non_empty(field: &str, value: String) -> Result<String, ConfigError> {
    if value.trim().is_empty() {
        Err(ConfigError::new(field, "must not be empty"))
    } else {
        Ok(value)
    }
}

impl RawRule {
    fn validate(self, at: &str) -> Result<Rule, ConfigError> {
        let field = |name: &str| format!("{at}.{name}");
        if self.name.is_empty() || !self.name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-') {
            return Err(ConfigError::new(
                field("name"),
                format!("{:?} must be non-empty and use only A-Z a-z 0-9 _ -", self.name),
            ));
        }
        self.limit_by.validate().map_err(|reason| ConfigError::new(field("limit_by"), reason))?;
        if self.rate == 0 {
            return Err(ConfigError::new(field("rate"), "must be at least 1"));
        }
        if self.rate > MAX_RATE {
            return Err(ConfigError::new(field("rate"), format!("must be at most {MAX_RATE}")));
        }
        let interval_ms = self.interval.0;
        if interval_ms == 0 {
            return Err(ConfigError::new(field("interval"), "must be at least 1 ms"));
        }
        if interval_ms > MAX_INTERVAL_MS {
            return Err(ConfigError::new(field("interval"), format!("must be at most {MAX_INTERVAL_MS} ms")));
        }
        if self.permits == 0 || self.permits > self.rate {
            return Err(ConfigError::new(
                field("permits"),
                format!("{} must be between 1 and the rate ({})", self.permits, self.rate),
            ));
        }
        let keep_alive_ms = match self.keep_alive {
            Some(DurationMs(ms)) => {
                if ms != 0 && ms < interval_ms {
                    return Err(ConfigError::new(
                        field("keep_alive"),
                        format!(
                            "{ms} ms is shorter than the interval ({interval_ms} ms): keys would expire with permits still in the window; use 0 (never) or at least the interval"
                        ),
                    ));
                }
                if ms > MAX_INTERVAL_MS {
                    return Err(ConfigError::new(field("keep_alive"), format!("must be at most {MAX_INTERVAL_MS} ms")));
                }
                ms
            }
            None if self.limit_by == KeySource::Global => 0,
            None => interval_ms.max(DEFAULT_KEEP_ALIVE_MS),
        };
        let limiter = match self.limiter {
            Some(limiter) => non_empty(&field("limiter"), limiter)?,
            None => format!("erl:{}", self.name),
        };
        Ok(Rule {
            name: self.name,
            source: self.limit_by,
            limiter,
            rate: self.rate,
            interval_ms,
            limiter_type: self.limiter_type,
            permits: self.permits,
            keep_alive_ms,
            on_missing: self.on_missing,
            rate_source: self.rate_source,
        })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn parse(json: &str) -> Result<PluginConfig, ConfigError> {
        PluginConfig::from_json(json.as_bytes())
    }

    fn error_of(json: &str) -> String {
        parse(json).expect_err("configuration should be refused").to_string()
    }

    const MINIMAL: &str =
        r#"{"redis":{"cluster":"webdis"},"rules":[{"name":"r","limit_by":"global","rate":5,"interval":"1s"}]}"#;

    #[test]
    fn minimal_configuration_gets_documented_defaults() {
        let config = parse(MINIMAL).unwrap();
        assert_eq!(config.redis.cluster, "webdis");
        assert_eq!(config.redis.authority, "webdis");
        assert_eq!(config.redis.timeout_ms, 1000);
        assert_eq!(config.redis.transport, TransportKind::Http);
        assert_eq!(config.failure_mode, FailureMode::Allow);
        assert_eq!(config.failure_status, 503);
        assert_eq!(config.rejection, Rejection { status: 429, body: "rate limit exceeded\n".into() });
        let rule = &config.rules[0];
        assert_eq!((rule.rate, rule.interval_ms, rule.permits), (5, 1000, 1));
        assert_eq!(rule.limiter, "erl:r");
        assert_eq!(rule.limiter_type, LimiterType::Overall);
        assert_eq!(rule.keep_alive_ms, 0, "a global limiter never expires by default");
    }

    #[test]
    fn keyed_rules_expire_after_an_hour_or_the_interval_by_default() {
        let config = parse(
            r#"{"redis":{"cluster":"c"},"rules":[
                {"name":"a","limit_by":{"header":"x-user"},"rate":5,"interval":"1s"},
                {"name":"b","limit_by":"client_ip","rate":5,"interval":"2h"}]}"#,
        )
        .unwrap();
        assert_eq!(config.rules[0].keep_alive_ms, 3_600_000);
        assert_eq!(config.rules[1].keep_alive_ms, 7_200_000);
    }

    #[test]
    fn durations_accept_milliseconds_and_human_strings() {
        for (written, ms) in [("1500", 1500), ("\"1.5s\"", 1500), ("\"1m\"", 60_000), ("\"1h 30m\"", 5_400_000)] {
            let json = MINIMAL.replace("\"1s\"", written);
            assert_eq!(parse(&json).unwrap().rules[0].interval_ms, ms, "{written}");
        }
        assert!(error_of(&MINIMAL.replace("\"1s\"", "\"soon\"")).starts_with("rules[0].interval: invalid duration"));
        assert!(error_of(&MINIMAL.replace("\"1s\"", "-5")).starts_with("rules[0].interval: expected milliseconds"));
        assert!(error_of(&MINIMAL.replace("\"1s\"", "\"1500us\"")).contains("whole number of milliseconds"));
    }

    #[test]
    fn higress_service_names_become_outbound_clusters() {
        let config = parse(
            r#"{"redis":{"service_name":"redis.static","transport":"host","database":2,"password":"pw"},
                "rules":[{"name":"r","limit_by":"global","rate":1,"interval":1}]}"#,
        )
        .unwrap();
        assert_eq!(config.redis.cluster, "outbound|80||redis.static");
        assert_eq!(config.redis.database, 2);
        let config = parse(
            r#"{"redis":{"service_name":"redis.default.svc.cluster.local","service_port":6380},
                "rules":[{"name":"r","limit_by":"global","rate":1,"interval":1}]}"#,
        )
        .unwrap();
        assert_eq!(config.redis.cluster, "outbound|6380||redis.default.svc.cluster.local");
    }

    #[test]
    fn bridge_credentials_become_a_basic_authorization_header() {
        let config =
            parse(&MINIMAL.replace(r#""cluster":"webdis""#, r#""cluster":"webdis","username":"u","password":"p""#))
                .unwrap();
        assert_eq!(config.redis.basic_auth.as_deref(), Some("Basic dTpw"));
    }

    #[test]
    fn higress_match_rules_override_by_route_then_domain_then_global() {
        let json = r#"{"redis":{"cluster":"webdis"},"rules":[{"name":"r","limit_by":"global","rate":5,"interval":"1s"}],
                "_rules_":[
                  {"_match_domain_":["*.partner.example","api.example"],"rules":[{"name":"d","limit_by":"global","rate":7,"interval":1000}]},
                  {"_match_route_":["default/login"],"failure_mode":"deny","rules":[{"name":"login","limit_by":"client_ip","rate":2,"interval":1000}]}]}"#;
        let plugin = Plugin::from_json(json.as_bytes()).unwrap();
        let name = |route, authority| plugin.select(route, authority).map(|(i, c)| (i, c.rules[0].name.clone()));
        assert_eq!(name(Some("default/login"), Some("api.example")), Some((2, "login".into())), "route beats domain");
        assert_eq!(name(None, Some("API.example:8443")), Some((1, "d".into())));
        assert_eq!(name(None, Some("eu.partner.example")), Some((1, "d".into())));
        assert_eq!(name(None, Some("partner.example")), Some((0, "r".into())), "*. matches subdomains only");
        assert_eq!(name(Some("other"), None), Some((0, "r".into())));
        let login = &plugin.overrides[1].config;
        assert_eq!(
            (login.failure_mode, login.redis.cluster.as_str()),
            (FailureMode::Deny, "webdis"),
            "global fields carry over"
        );
        assert_eq!(plugin.configs().count(), 3);
    }

    #[test]
    fn match_rules_alone_leave_other_requests_unlimited_and_errors_name_the_rule() {
        let only = r#"{"_rules_":[{"_match_route_":["a"],"redis":{"cluster":"c"},"rules":[{"name":"r","limit_by":"global","rate":1,"interval":1}]}]}"#;
        let plugin = Plugin::from_json(only.as_bytes()).unwrap();
        assert!(plugin.global.is_none());
        assert!(plugin.select(Some("b"), Some("x")).is_none());
        assert!(plugin.select(Some("a"), None).is_some());
        let bad = only.replace("\"rate\":1", "\"rate\":0");
        assert_eq!(
            Plugin::from_json(bad.as_bytes()).unwrap_err().to_string(),
            "_rules_[0].rules[0].rate: must be at least 1"
        );
        let unmatched = only.replace("\"_match_route_\":[\"a\"],", "");
        assert_eq!(
            Plugin::from_json(unmatched.as_bytes()).unwrap_err().to_string(),
            "_rules_[0]: needs `_match_route_` or `_match_domain_`"
        );
        let plain = Plugin::from_json(MINIMAL.as_bytes()).unwrap();
        assert_eq!(plain.global, Some(parse(MINIMAL).unwrap()));
        assert_eq!(Plugin::from_json(b"[1]").unwrap_err().to_string(), "the configuration must be a JSON object");
    }

    #[test]
    fn every_refusal_names_its_field() {
        let cases = [
            (MINIMAL.replace("\"rate\":5", "\"rate\":0"), "rules[0].rate: must be at least 1"),
            (MINIMAL.replace("\"rate\":5", "\"rate\":\"5\""), "rules[0].rate: invalid type"),
            (
                MINIMAL.replace("\"rate\":5", "\"rate\":5,\"permits\":6"),
                "rules[0].permits: 6 must be between 1 and the rate (5)",
            ),
            (MINIMAL.replace("\"rate\":5", "\"rate\":5,\"colour\":1"), "rules[0].colour: unknown field `colour`"),
            (MINIMAL.replace("\"name\":\"r\"", "\"name\":\"a:b\""), "rules[0].name:"),
            (
                MINIMAL.replace("\"global\"", "{\"header\":\"\"}"),
                "rules[0].limit_by: the header name must not be empty",
            ),
            (
                MINIMAL.replace("\"global\"", "{\"x_forwarded_for\":0}"),
                "rules[0].limit_by: trusted hops must be at least 1",
            ),
            (MINIMAL.replace("\"global\"", "\"everything\""), "rules[0].limit_by: unknown variant `everything`"),
            (
                MINIMAL.replace("\"1s\"", "\"1s\",\"keep_alive\":\"500ms\""),
                "rules[0].keep_alive: 500 ms is shorter than the interval",
            ),
            (MINIMAL.replace("\"1s\"", "\"1s\",\"type\":\"per_user\""), "rules[0].type: unknown variant `per_user`"),
            (
                MINIMAL.replace("\"cluster\":\"webdis\"", "\"cluster\":\"webdis\",\"timeout\":0"),
                "redis.timeout: must be at least 1 ms",
            ),
            (
                MINIMAL.replace("\"cluster\":\"webdis\"", "\"cluster\":\"webdis\",\"database\":3"),
                "redis.database: the http transport cannot select a database",
            ),
            (MINIMAL.replace("\"cluster\":\"webdis\"", ""), "redis: `cluster` or `service_name` is required"),
            (
                MINIMAL.replace("\"cluster\":\"webdis\"", "\"cluster\":\"webdis\",\"transport\":\"tcp\""),
                "redis.transport: unknown variant `tcp`",
            ),
            (MINIMAL.replace("}]}", "}],\"rejected_status\":99}"), "rejected_status: 99 is not an HTTP status"),
            (MINIMAL.replace("}]}", "}],\"failure_mode\":\"maybe\"}"), "failure_mode: unknown variant `maybe`"),
            (
                MINIMAL.replace("}]}", "},{\"name\":\"r\",\"limit_by\":\"path\",\"rate\":1,\"interval\":1}]}"),
                "rules[1].name: duplicate rule name",
            ),
            (r#"{"redis":{"cluster":"c"},"rules":[]}"#.to_string(), "rules: at least one rule is required"),
            (r#"{"redis":{"cluster":"c"}}"#.to_string(), "missing field `rules`"),
            ("not json".to_string(), "expected ident"),
            (format!("{MINIMAL} trailing"), "trailing characters"),
        ];
        for (json, expected) in cases {
            let error = error_of(&json);
            assert!(
                error.starts_with(expected) || error.contains(expected),
                "{json}\n  gave: {error}\n  expected: {expected}"
            );
        }
    }
}
