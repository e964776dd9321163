//! Plugin configuration: the JSON a gateway hands to the filter, parsed and validated once (in
//! `on_configure`) into an immutable [`PluginConfig`] shared by every request of the VM.
//!
//! Every error names the field it is about (`rules[0].rate: must be at least 1`), so an operator can fix
//! the configuration from the gateway's log line alone. The field reference is docs/configuration.md.
//!
//! - this module: the validated types ([`PluginConfig`], [`Rule`], [`RedisConfig`]...) and [`ConfigError`];
//! - `reader`: the JSON read field by field, errors naming the field, unknown fields refused;
//! - `validate`: every field read, defaulted and validated;
//! - `match_rules`: Higress `_rules_` overlays ([`Plugin`], [`Override`]) and their selection per request.

use crate::prelude::*;

use core::fmt;

use crate::key::KeySource;
use crate::matching::{Exemption, ValueMatch};

mod cost;
mod duration;
mod inflight;
mod layout;
mod match_rules;
mod reader;
mod rules;
mod validate;

pub use cost::{Cost, Reserve, Settle};
pub use inflight::{InflightApplies, InflightRule};
pub use match_rules::{Override, Plugin};
pub use reader::DurationMs;

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
    pub(crate) fn new(field: impl Into<String>, reason: impl Into<String>) -> Self {
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

impl core::error::Error for ConfigError {}

/// How the filter reaches Redis.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransportKind {
    /// An HTTP-to-Redis bridge (webdis) reached with `dispatch_http_call`: the stock Envoy / Istio build.
    Http,
    /// The host's outbound Redis interface (`proxy_redis_call`, Higress): the host-redis build.
    Host,
}

/// What happens to a request the filter cannot decide because Redis or the bridge failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FailureMode {
    /// Fail open: the request continues upstream (Envoy's global rate limit filter does the same by default).
    #[default]
    Allow,
    /// Fail closed: the request is answered with `failure_status`.
    Deny,
    /// Degraded mode: each gateway process enforces the rules itself at `rate / gateways` until Redis
    /// answers again ([`LocalFallback`], `crate::fallback`).
    Local,
}

/// `local_fallback`: the degraded mode's settings (`failure_mode: "local"`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LocalFallback {
    /// The expected number of gateway processes (Envoy processes, not workers): each admits
    /// `floor(rate / gateways)` per window while Redis fails.
    pub gateways: u32,
    /// How often a VM asks Redis whether it is back while it fails (one request per interval), ms.
    pub probe_interval_ms: u64,
    /// Shared-data slots for the local windows (bounds their memory): `local_block_slots`.
    pub slots: u32,
}

/// Redisson's `RateType`: whose window a limiter counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LimiterType {
    /// `RateType.OVERALL` (stored as `"0"`): one window shared by every gateway and Redisson client.
    #[default]
    Overall,
    /// `RateType.PER_CLIENT` (stored as `"1"`): one window per client instance, here per gateway process.
    PerClient,
}

impl LimiterType {
    /// The name the configuration uses for it (`overall`, `per_client`).
    pub fn name(self) -> &'static str {
        match self {
            LimiterType::Overall => "overall",
            LimiterType::PerClient => "per_client",
        }
    }

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
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
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
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RateSource {
    /// Redis wins (trySetRate semantics): an operator or a Java service controls the limit.
    #[default]
    Redis,
    /// The configuration wins: applied once per limiter and configuration with updateRate, keeping
    /// consumed permits (no burst at the change).
    Config,
}

/// Whether a rule's rejections reject (`mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Mode {
    /// A request the rule rejects is rejected.
    #[default]
    Enforce,
    /// The rule decides and counts (its limiter takes permits as if enforced) but never rejects: a request it
    /// would reject goes on, counted in `rule.<name>.shadow_rejected` (docs/configuration.md, "Shadow mode").
    Shadow,
}

impl Mode {
    /// The name the configuration uses for it.
    pub fn name(self) -> &'static str {
        match self {
            Mode::Enforce => "enforce",
            Mode::Shadow => "shadow",
        }
    }
}

/// Where the acquire time comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ClockSource {
    /// The gateway's clock, as Redisson uses its client's clock.
    #[default]
    Gateway,
    /// Redis's `TIME`: removes clock skew between gateways (and Redisson clients using it).
    Redis,
}

/// Which rate limit headers responses carry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
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

/// A credential from the configuration (a Redis password, a bridge's `Authorization` value). Its `Debug`
/// never shows it, so a logged or formatted configuration carries no secret; [`Secret::expose`] is the
/// one way to read it, at the transport that sends it.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    /// Wraps a secret value.
    pub fn new(value: impl Into<String>) -> Self {
        Secret(value.into())
    }

    /// The secret itself, for the transport that sends it.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("<redacted>")
    }
}

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
    /// Redis password (host transport), or HTTP Basic password (http transport); redacted in `Debug`.
    pub password: Option<Secret>,
    /// `Authorization` header value for the bridge, precomputed when a password or user is set; redacted.
    pub basic_auth: Option<Secret>,
    /// Per-call timeout, milliseconds.
    pub timeout_ms: u64,
    /// Redis logical database (host transport only; the bridge selects its database itself).
    pub database: u32,
    /// Whether the Redis behind the transport is a Redis Cluster: the limiters of one request share one
    /// script call only when their keys are in one hash slot (otherwise one call each, and permits taken
    /// by a request another rule rejected are given back).
    pub redis_cluster: bool,
    /// Request coalescing: how the calls of concurrent requests share script calls.
    pub coalescing: Coalescing,
}

/// Request coalescing (docs/configuration.md, "Request coalescing"): while a VM has `max_in_flight`
/// acquire calls on their way to one Redis (one hash slot with Redis Cluster), the calls of further
/// requests wait, and go out together, in arrival order, in one script call of at most `max_batch` calls
/// and about `max_batch_bytes` bytes when one of those ends. `max_batch: 1` turns coalescing off.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Coalescing {
    /// Most calls in one script call (1 = no coalescing).
    pub max_batch: u32,
    /// Most acquire calls in flight per VM and destination before calls wait to be batched.
    pub max_in_flight: u32,
    /// Most bytes of the calls' commands in one batch (a batch holds at least one call).
    pub max_batch_bytes: u32,
}

/// Largest `redis.max_batch`.
pub const MAX_BATCH: u32 = 256;

impl Default for Coalescing {
    /// The defaults measured by `make bench` (docs/benchmarks.md, "10. Request coalescing").
    fn default() -> Self {
        Coalescing { max_batch: 32, max_in_flight: 1, max_batch_bytes: 64 * 1024 }
    }
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
    /// Longest local block after a rejection, ms (0: no local block; every request goes to Redis).
    pub local_block_max_ms: u64,
    /// Permit leases for a hot limiter (docs/configuration.md, "Leases"); `None`: one acquire per request.
    pub lease: Option<Lease>,
    /// Enforce or shadow (the configuration's `mode` unless the rule sets its own).
    pub mode: Mode,
    /// Requests the rule leaves alone (`exempt`).
    pub exempt: Option<Exemption>,
    /// `rates_by_value`: a rule with per-value rates becomes one entry per value match, in order, followed by
    /// its default entry (`None`), all with the same name; the first entry whose match accepts the key value
    /// applies. `Some` only on those generated entries.
    pub value_match: Option<ValueMatch>,
    /// `rates_by`: where the value `rates_by_value` matches comes from, when not the key (a plan header set
    /// by an authentication filter: per-request limits for one key).
    pub rates_by: Option<KeySource>,
    /// `cost`: a reservation at the request (`permits` is its default size), settled to the real cost when
    /// the response ends.
    pub cost: Option<Cost>,
    /// `layout`: how its limiters are kept in Redis.
    pub layout: WindowLayout,
    /// `max_wait`: how long a request this rule rejects may wait for its permits, ms, retrying after the
    /// delay each rejection answers, as Redisson's `tryAcquire(permits, timeout)` does (0: refused at once;
    /// docs/configuration.md, "Waiting for permits").
    pub max_wait_ms: u64,
    /// `max_waiting`: most requests this rule keeps waiting at once in one VM (the next one is refused at
    /// once).
    pub max_waiting: u32,
}

impl Rule {
    /// Whether the rule reads the request body: a key part, `rates_by` or `cost.reserve` from it, or
    /// `settle.include_usage` (which may rewrite it).
    pub fn reads_body(&self) -> bool {
        let reserve = self.cost.as_ref().and_then(|cost| match &cost.reserve {
            Reserve::From { source, .. } => Some(source),
            Reserve::Fixed(_) => None,
        });
        let sources = [Some(&self.source), self.rates_by.as_ref(), reserve];
        sources.into_iter().flatten().any(KeySource::reads_body) || self.asks_usage()
    }

    /// Whether the rule asks for `settle.include_usage`.
    pub fn asks_usage(&self) -> bool {
        self.cost.as_ref().is_some_and(|cost| cost.include_usage)
    }
}

/// How a rule keeps its limiters in Redis (`layout`; docs/configuration.md, "Which window to choose").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WindowLayout {
    /// A sliding log, Redisson 4.x `RRateLimiter`'s layout (a config hash, a value, a sorted set of one
    /// member per acquire in the window, about 120 B each): exact to the millisecond, shared with Java.
    #[default]
    SlidingLog,
    /// A sliding window counter: one hash per limiter (`{name}:counter`), one field per slice of the
    /// interval ([`COUNTER_SLICES`] slices, field = the slice's index since the epoch, value = permits taken
    /// in it). A request is admitted when every slice that overlaps the last interval, plus its permits,
    /// fits the rate: no sliding window ever holds more than the rate, and under saturation at least
    /// k/(k+1) of it is used. O(1) memory per limiter; not shared with Java.
    SlidingWindowCounter,
    /// A calendar quota (`calendar`: docs/configuration.md, "Calendar quotas"): the rate per period of the
    /// zone's local time, one counter per limiter and period in the hash `{name}:counter` (field: the
    /// period's start, ms), expiring at the period's end.
    Calendar {
        /// The period.
        period: crate::calendar::Period,
        /// The zone whose local time the periods follow.
        zone: crate::calendar::Zone,
    },
}

impl WindowLayout {
    /// Whether it is a calendar quota (its acquires carry their period: built per call).
    pub fn is_calendar(&self) -> bool {
        matches!(self, WindowLayout::Calendar { .. })
    }
}

/// The slices of an interval in a sliding window counter (k): at most k + 1 fields stay in its hash, well
/// within Redis's listpack encoding (128 fields by default, `hash-max-listpack-entries`).
pub const COUNTER_SLICES: u64 = 20;

/// A rule's permit lease: a VM takes up to `max_permits` in one acquire and serves the limiter's requests
/// from them for at most `max_age_ms`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lease {
    /// Most permits one lease takes (more than the rule's `permits`, at most the rate).
    pub max_permits: u64,
    /// How long a lease serves requests, ms (from the gateway time its acquire was sent; below the
    /// interval): the lease's member in Redis is scored at its acquire time plus this.
    pub max_age_ms: u64,
}

/// The response sent for a rejected request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejection {
    /// HTTP status (default 429).
    pub status: u16,
    /// Body, sent as `text/plain`.
    pub body: String,
}

/// How a gRPC request the filter answers itself is answered (`grpc`): gRPC status codes as gRPC's
/// `doc/statuscodes.md` numbers them (1..=16). Envoy turns a local reply to a gRPC request into a
/// trailers-only gRPC response; without a code of ours it maps HTTP 429 and 503 to UNAVAILABLE (14), which
/// gRPC retry policies retry at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GrpcAnswers {
    /// Status of a rejected gRPC request (`rejected_status`, default 8, RESOURCE_EXHAUSTED).
    pub rejected_status: u8,
    /// Status of a gRPC request failed closed (`failure_status`, default 14, UNAVAILABLE).
    pub failure_status: u8,
}

impl Default for GrpcAnswers {
    fn default() -> Self {
        GrpcAnswers { rejected_status: 8, failure_status: 14 }
    }
}

/// The whole validated plugin configuration, immutable after `on_configure`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PluginConfig {
    /// How to reach Redis.
    pub redis: RedisConfig,
    /// The rate rules (and cost rules), in configuration order.
    pub rules: Vec<Rule>,
    /// The in-flight rules (`max_in_flight`), in configuration order.
    pub inflight: Vec<InflightRule>,
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
    /// Shared-data slots for local blocks (bounds their memory).
    pub local_block_slots: u32,
    /// The degraded mode's settings, with `failure_mode: "local"` only.
    pub local_fallback: Option<LocalFallback>,
    /// Requests no rule applies to (`exempt`).
    pub exempt: Option<Exemption>,
    /// Whether shadow rules show in the response: their quotas in the rate limit headers, and
    /// `x-shadow-ratelimited-by` naming the first that would have rejected (`shadow_headers`).
    pub shadow_headers: bool,
    /// Whether the filter records its histograms (`histograms`, default true; docs/operating.md,
    /// "Histograms"): off, none is defined and no clock is read for them.
    pub histograms: bool,
    /// The statuses of gRPC requests answered by the filter (`grpc`).
    pub grpc: GrpcAnswers,
    /// `hold_headers_for_body` (default false): a request whose rules read its body is held whole, headers
    /// included, until it is decided, so a rejected one never starts an upstream request. Needs a host
    /// that delivers the body to a filter holding the headers: Envoy 1.35 or later with the Wasm
    /// `PluginConfig` option `allow_on_headers_stop_iteration: true` (proxy-wasm-cpp-host
    /// `allow_on_headers_stop_iteration_`; without it a pause in the headers holds the body too:
    /// `convertVmCallResultToFilterHeadersStatus`). docs/deploying.md, "What a rejection costs the upstream".
    pub hold_headers_for_body: bool,
}

impl PluginConfig {
    /// Parses and validates a plugin configuration (JSON bytes).
    ///
    /// # Errors
    /// A [`ConfigError`] naming the first offending field: JSON syntax, unknown fields, wrong types and
    /// out-of-range values are all refused; nothing is defaulted silently over a wrong value.
    pub fn from_json(bytes: &[u8]) -> Result<Self, ConfigError> {
        let value: serde_json::Value =
            serde_json::from_slice(bytes).map_err(|e| ConfigError::new("", e.to_string()))?;
        Self::from_value(&value)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]
    use super::*;

    fn parse(json: &str) -> Result<PluginConfig, ConfigError> {
        PluginConfig::from_json(json.as_bytes())
    }

    fn error_of(json: &str) -> String {
        parse(json).expect_err("configuration should be refused").to_string()
    }

    const MINIMAL: &str =
        r#"{"redis":{"cluster":"webdis"},"rules":[{"name":"r","limit_by":"global","rate":5,"interval":"1s"}]}"#;

    /// An in-flight rule, added after MINIMAL's rate rule.
    const INF: &str = r#"{"name":"f","limit_by":"global","max_in_flight":4}"#;

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
    fn weights_are_read_in_thousandths_and_a_kind_not_named_weighs_one() {
        let settle = r#""cost":{"reserve":5,"settle":{"usage":"anthropic","weights":{"cached_input":0.1,"cache_write":1.25,"output":4}}}"#;
        let config = parse(&MINIMAL.replace("\"1s\"", &format!("\"1s\",{settle}"))).unwrap();
        let cost = config.rules[0].cost.as_ref().unwrap();
        let weights = crate::usage::Weights { input: 1000, cached_input: 100, cache_write: 1250, output: 4000 };
        assert_eq!(cost.settle, Settle::Usage(crate::usage::UsageFormat::Anthropic, Some(weights)));
        let unweighted =
            parse(&MINIMAL.replace("\"1s\"", "\"1s\",\"cost\":{\"reserve\":1,\"settle\":{\"usage\":\"gemini\"}}"))
                .unwrap();
        let cost = unweighted.rules[0].cost.as_ref().unwrap();
        assert_eq!(cost.settle, Settle::Usage(crate::usage::UsageFormat::Gemini, None));
    }

    #[test]
    fn an_in_flight_rule_has_its_defaults_and_its_own_list() {
        let config = parse(&MINIMAL.replace("}]}", &format!("}},{INF}]}}"))).unwrap();
        assert_eq!(config.rules.len(), 1, "the rate rule alone");
        assert_eq!(config.inflight.len(), 1, "one in-flight rule");
        let rule = &config.inflight[0];
        assert_eq!((rule.name.as_str(), rule.limiter.as_str(), rule.max_in_flight), ("f", "erl:f", 4));
        assert_eq!((rule.lease_ms, rule.retry_after_ms, rule.mode), (30_000, 1_000, Mode::Enforce));
        let only = r#"{"redis":{"cluster":"c"},"rules":[{"name":"f","limit_by":{"header":"x-key"},"max_in_flight":2,"lease":"4s","retry_after":"3s"}]}"#;
        let config = parse(only).unwrap();
        assert!(config.rules.is_empty());
        assert_eq!((config.inflight[0].lease_ms, config.inflight[0].retry_after_ms), (4_000, 3_000));
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
        assert_eq!(config.redis.basic_auth.as_ref().map(Secret::expose), Some("Basic dTpw"));
    }

    #[test]
    fn a_rule_chooses_its_layout_and_a_counter_refuses_what_it_does_not_do() {
        let counter = |extra: &str| {
            MINIMAL
                .replace(r#""interval":"1s""#, &format!(r#""interval":"1s","layout":"sliding_window_counter"{extra}"#))
        };
        assert_eq!(parse(MINIMAL).unwrap().rules[0].layout, WindowLayout::SlidingLog, "the Redisson layout by default");
        assert_eq!(parse(&counter("")).unwrap().rules[0].layout, WindowLayout::SlidingWindowCounter);
        let refusals = [
            (r#","type":"per_client""#, "rules[0].type: a sliding window counter is overall only"),
            (r#","rate_source":"redis""#, "rules[0].rate_source: a sliding window counter keeps no config in Redis"),
            (
                r#","lease":{"max_permits":2,"max_age":"100ms"}"#,
                "rules[0].lease: a sliding window counter takes no lease",
            ),
            (r#","keep_alive":"1h""#, "rules[0].keep_alive: a sliding window counter expires by itself"),
        ];
        for (extra, expected) in refusals {
            let error = error_of(&counter(extra));
            assert!(error.starts_with(expected), "{extra}: {error}");
        }
        let cost = counter(r#","cost":{"reserve":2,"settle":{"usage":"openai"}}"#);
        assert!(parse(&cost).unwrap().rules[0].cost.is_some(), "reserve, then settle into the slice");
        let error = error_of(&cost.replace("}]}", r#"}],"clock":"redis"}"#));
        assert!(error.starts_with("clock: \"redis\" cannot settle a counter's `cost`"), "{error}");
        assert!(error_of(&MINIMAL.replace(r#""interval":"1s""#, r#""interval":"1s","layout":"fixed""#))
            .starts_with("rules[0].layout: unknown variant `fixed`"));
    }

    #[test]
    fn a_calendar_quota_names_its_period_and_zone_instead_of_an_interval() {
        let calendar = |json: &str| MINIMAL.replace(r#""interval":"1s""#, json);
        let rule = &parse(&calendar(r#""calendar":{"period":"month","time_zone":"Europe/Berlin"}"#)).unwrap().rules[0];
        let berlin = crate::calendar::Zone::named("Europe/Berlin").unwrap();
        assert_eq!(rule.layout, WindowLayout::Calendar { period: crate::calendar::Period::Month, zone: berlin });
        assert_eq!(
            rule.interval_ms,
            30 * 86_400_000,
            "nominal: a month stands for 30 days where one interval is needed"
        );
        let utc = &parse(&calendar(r#""calendar":{"period":"day"}"#)).unwrap().rules[0];
        assert!(
            matches!(utc.layout, WindowLayout::Calendar { zone, .. } if zone == crate::calendar::Zone::named("UTC").unwrap())
        );
        let refusals = [
            (r#""calendar":{"period":"fortnight"}"#, "rules[0].calendar.period: unknown variant `fortnight`"),
            (r#""calendar":{"time_zone":"UTC"}"#, "rules[0].calendar.period: required"),
            (
                r#""calendar":{"period":"day","time_zone":"Mars/Olympus"}"#,
                "rules[0].calendar.time_zone: unknown time zone",
            ),
            (r#""calendar":{"period":"day","time_zone":"CET-1CEST,M3"}"#, "rules[0].calendar.time_zone: POSIX TZ rule"),
            (
                r#""calendar":{"period":"day"},"interval":"1s""#,
                "rules[0].interval: a rule with `calendar` has its period",
            ),
            (r#""calendar":{"period":"day"},"layout":"sliding_log""#, "rules[0].layout: a rule with `calendar`"),
            (
                r#""calendar":{"period":"day"},"lease":{"max_permits":2,"max_age":"1s"}"#,
                "rules[0].lease: a calendar quota takes no lease",
            ),
            (r#""calendar":{"period":"day"},"type":"per_client""#, "rules[0].type: a calendar quota is overall only"),
        ];
        for (json, expected) in refusals {
            let error = error_of(&calendar(json));
            assert!(error.starts_with(expected), "{json}: {error}");
        }
    }

    #[test]
    fn a_limiter_name_whose_keys_would_fall_in_different_cluster_slots_is_refused() {
        let with = |limiter: &str| MINIMAL.replace(r#""name":"r","#, &format!(r#""name":"r","limiter":"{limiter}","#));
        for broken in ["erl:{x", "erl:{}x", "erl:}{", "erl}x"] {
            assert!(error_of(&with(broken)).starts_with("rules[0].limiter: a `{` must open"), "{broken}");
        }
        assert!(parse(&with("erl:{tenant}:x")).is_ok());
    }

    #[test]
    fn leases_and_redis_cluster_are_read_and_checked_with_the_field_named() {
        let lease = |lease: &str| MINIMAL.replace(r#""interval":"1s""#, &format!(r#""interval":"1s","lease":{lease}"#));
        let config = parse(&lease(r#"{"max_permits":4,"max_age":"50ms"}"#)).unwrap();
        assert_eq!(config.rules[0].lease, Some(Lease { max_permits: 4, max_age_ms: 50 }));
        assert!(!config.redis.redis_cluster);
        assert_eq!(parse(MINIMAL).unwrap().rules[0].lease, None);
        for (bad, error) in [
            (
                r#"{"max_permits":1,"max_age":"50ms"}"#,
                "rules[0].lease.max_permits: 1 must be more than the rule's permits (1)",
            ),
            (r#"{"max_permits":6,"max_age":"50ms"}"#, "rules[0].lease.max_permits: 6 must be more than"),
            (
                r#"{"max_permits":4,"max_age":"1s"}"#,
                "rules[0].lease.max_age: 1000 ms must be at least 1 ms and shorter",
            ),
            (r#"{"max_permits":4,"max_age":0}"#, "rules[0].lease.max_age: 0 ms"),
            (r#"{"max_permits":4}"#, "rules[0].lease.max_age"),
            (r#"{"max_permits":4,"max_age":"5ms","size":1}"#, "rules[0].lease"),
            (r#"64"#, "rules[0].lease"),
        ] {
            assert!(error_of(&lease(bad)).starts_with(error), "{bad}: {}", error_of(&lease(bad)));
        }
        let cluster = MINIMAL.replace(r#""cluster":"webdis""#, r#""cluster":"webdis","redis_cluster":true"#);
        assert!(parse(&cluster).unwrap().redis.redis_cluster);
        let wrong = MINIMAL.replace(r#""cluster":"webdis""#, r#""cluster":"webdis","redis_cluster":"yes""#);
        assert_eq!(error_of(&wrong), "redis.redis_cluster: must be true or false");
    }

    #[test]
    fn formatting_a_configuration_shows_no_secret() {
        let json = r#"{"redis":{"cluster":"webdis","username":"ops","password":"hunter2-pw"},
            "rules":[{"name":"r","limit_by":"global","rate":5,"interval":"1s"}],
            "_rules_":[{"_match_route_":["a"],"redis":{"transport":"host","cluster":"r","password":"other-pw"}}]}"#;
        let plugin = Plugin::from_json(json.as_bytes()).unwrap();
        let shown = format!("{plugin:?} {plugin:#?}");
        for secret in ["hunter2-pw", "other-pw", "b3BzOmh1bnRlcjItcHc" /* base64 of ops:hunter2-pw */] {
            assert!(!shown.contains(secret), "{secret} in {shown}");
        }
        assert!(shown.contains("ops"), "the user name may show");
        assert!(shown.contains("<redacted>"));
        let mistyped = r#"{"redis":{"cluster":"w","password":123456},"rules":[]}"#;
        let error = PluginConfig::from_json(mistyped.as_bytes()).unwrap_err().to_string();
        assert!(error.starts_with("redis.password: must be a string"), "{error}");
        assert!(!error.contains("123456"), "{error}");
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
    fn operator_options_are_read_and_refused_with_the_field_named() {
        let json = r#"{"redis":{"cluster":"c"},"mode":"shadow","shadow_headers":true,
            "exempt":{"client_ips":["10.0.0.0/8","::1"],"headers":{"X-Internal":["yes"]}},
            "rules":[{"name":"a","limit_by":[{"header":"x-user"},{"client_ip":{"ipv4_prefix":24,"ipv6_prefix":64}}],
                      "rate":5,"interval":"1s","mode":"enforce","exempt":{"headers":{"x-bot":["1"]}},
                      "rates_by_value":[{"values":["vip:10.0.0.0/24"],"rate":50,"interval":"2s","permits":2}]},
                     {"name":"b","limit_by":{"x_forwarded_for":{"hops":2,"ipv6_prefix":48}},"rate":1,"interval":1}]}"#;
        let config = parse(json).unwrap();
        assert!(config.shadow_headers);
        let exempt = config.exempt.as_ref().unwrap();
        assert_eq!(exempt.client_ips.len(), 2);
        assert_eq!(exempt.headers, vec![("x-internal".to_string(), vec![b"yes".to_vec()])]);
        assert_eq!(config.rules.len(), 3);
        let (vip, a, b) = (&config.rules[0], &config.rules[1], &config.rules[2]);
        assert_eq!(
            (vip.name.as_str(), vip.rate, vip.interval_ms, vip.permits, vip.mode),
            ("a", 50, 2000, 2, Mode::Enforce)
        );
        assert!(vip.value_match.is_some() && a.value_match.is_none());
        assert_eq!((a.rate, a.interval_ms, a.permits), (5, 1000, 1));
        assert_eq!(b.mode, Mode::Shadow, "the global mode is every rule's default");
        assert!(
            matches!(&b.source, KeySource::Network { of, prefix } if **of == KeySource::XForwardedFor(2) && prefix.ipv6 == 48 && prefix.ipv4 == 32)
        );
        let rule = |extra: &str| MINIMAL.replace(r#""limit_by":"global""#, extra);
        for (json, expected) in [
            (rule(r#""limit_by":[{"header":"a"}]"#), "rules[0].limit_by: a composite key has 2 to 8 parts"),
            (rule(r#""limit_by":[{"header":"a"},"global"]"#), "rules[0].limit_by: part 1: `global`"),
            (rule(r#""limit_by":[{"header":"a"},{"header":""}]"#), "rules[0].limit_by: part 1: the header name"),
            (
                rule(r#""limit_by":{"client_ip":{"ipv4_prefix":33}}"#),
                "rules[0].limit_by: `client_ip.ipv4_prefix` must be",
            ),
            (rule(r#""limit_by":{"client_ip":{}}"#), "rules[0].limit_by: `client_ip` needs `ipv4_prefix`"),
            (rule(r#""limit_by":{"client_ip":{"ipv4":8}}"#), "rules[0].limit_by: `client_ip`: unknown field `ipv4`"),
            (rule(r#""limit_by":{"x_forwarded_for":{"ipv4_prefix":8}}"#), "rules[0].limit_by: `x_forwarded_for.hops`"),
            (
                rule(r#""limit_by":"path","rates_by_value":[{"values":["/a"]}]"#),
                "rules[0].rates_by_value[0].rate: is required",
            ),
            (
                rule(r#""limit_by":"path","rates_by_value":[{"values":["/a"],"regex":"x","rate":1}]"#),
                "rules[0].rates_by_value[0]: needs either `values` or `regex`",
            ),
            (rule(r#""limit_by":"path","rates_by_value":[]"#), "rules[0].rates_by_value: must hold 1 to"),
            (
                rule(r#""limit_by":"path","rates_by_value":[{"values":["/a"],"rate":1,"permits":2}]"#),
                "rules[0].rates_by_value[0].permits: 2 must be between 1 and the rate (1)",
            ),
            (
                rule(
                    r#""limit_by":"path","keep_alive":"1s","rates_by_value":[{"values":["/a"],"rate":1,"interval":"1m"}]"#,
                ),
                "rules[0].rates_by_value[0].interval: 60000 ms is longer than the rule's keep_alive",
            ),
            (
                rule(r#""limit_by":"global","rates_by_value":[{"values":["x"],"rate":1}]"#),
                "rules[0].rates_by_value: a global rule",
            ),
            (
                rule(r#""limit_by":"path","rates_by_value":[{"values":[1],"rate":1}]"#),
                "rules[0].rates_by_value[0].values: values must be strings",
            ),
            (
                rule(r#""limit_by":"path","rates_by_value":[{"values":["/a"],"rate":1,"colour":1}]"#),
                "rules[0].rates_by_value[0].colour: unknown field",
            ),
            (rule(r#""limit_by":"path","mode":"dry""#), "rules[0].mode: unknown variant `dry`"),
            (rule(r#""limit_by":"path","exempt":{}"#), "rules[0].exempt: needs `client_ips` or `headers`"),
            (
                rule(r#""limit_by":"path","exempt":{"client_ips":["10.0.0.0/33"]}"#),
                "rules[0].exempt.client_ips[0]: \"10.0.0.0/33\" is not",
            ),
            (
                rule(r#""limit_by":"path","exempt":{"headers":{"x":[]}}"#),
                "rules[0].exempt.headers.x: must be an array of 1 to",
            ),
            (MINIMAL.replace("}]}", "}],\"shadow_headers\":1}"), "shadow_headers: must be true or false"),
            (MINIMAL.replace("}]}", "}],\"exempt\":[]}"), "exempt: must be a JSON object"),
        ] {
            let error = error_of(&json);
            assert!(error.starts_with(expected), "{json}\n  gave: {error}\n  expected: {expected}");
        }
        #[cfg(not(feature = "regex"))]
        assert!(error_of(&rule(r#""limit_by":"path","rates_by_value":[{"regex":"^/a","rate":1}]"#))
            .starts_with("rules[0].rates_by_value[0].regex: this build has no regular expressions"));
        #[cfg(feature = "regex")]
        assert!(error_of(&rule(r#""limit_by":"path","rates_by_value":[{"regex":"(","rate":1}]"#))
            .starts_with("rules[0].rates_by_value[0].regex: invalid regular expression"));
    }

    #[test]
    fn every_refusal_names_its_field() {
        let cases = [
            (MINIMAL.replace("\"rate\":5", "\"rate\":0"), "rules[0].rate: must be at least 1"),
            (MINIMAL.replace("\"rate\":5", "\"rate\":\"5\""), "rules[0].rate: must be a whole number"),
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
                MINIMAL.replace("}]}", "}],\"grpc\":{\"rejected_status\":\"SLOW_DOWN\"}}"),
                "grpc.rejected_status: must be a gRPC status other than OK",
            ),
            (
                MINIMAL.replace("}]}", "}],\"grpc\":{\"failure_status\":0}}"),
                "grpc.failure_status: must be a gRPC status",
            ),
            (MINIMAL.replace("}]}", "}],\"grpc\":{\"rejected_status\":17}}"), "grpc.rejected_status: must be a gRPC"),
            (MINIMAL.replace("}]}", "}],\"grpc\":{\"status\":8}}"), "grpc.status: unknown field `status`"),
            (
                MINIMAL.replace("\"1s\"", "\"1s\",\"cost\":{\"reserve\":0,\"settle\":{\"usage\":\"openai\"}}"),
                "rules[0].cost.reserve: must be 1 to the rate",
            ),
            (MINIMAL.replace("\"1s\"", "\"1s\",\"cost\":{\"reserve\":1}"), "rules[0].cost.settle: is required"),
            (
                MINIMAL.replace("\"1s\"", "\"1s\",\"cost\":{\"reserve\":1,\"settle\":{\"usage\":\"mistral\"}}"),
                "rules[0].cost.settle.usage: unknown variant `mistral`",
            ),
            (
                MINIMAL.replace("\"1s\"", "\"1s\",\"cost\":{\"reserve\":1,\"settle\":{}}"),
                "rules[0].cost.settle: needs either `usage`",
            ),
            (
                MINIMAL.replace(
                    "\"1s\"",
                    "\"1s\",\"permits\":1,\"cost\":{\"reserve\":1,\"settle\":{\"response_header\":\"x-cost\"}}",
                ),
                "rules[0].permits: a rule with `cost`",
            ),
            (
                MINIMAL.replace(
                    "\"1s\"",
                    "\"1s\",\"cost\":{\"reserve\":{\"header\":\"x-max\"},\"settle\":{\"response_header\":\"x-cost\"}}",
                ),
                "rules[0].cost.reserve.default: is required",
            ),
            (
                MINIMAL.replace("\"1s\"", "\"1s\",\"rates_by\":{\"header\":\"x-plan\"}"),
                "rules[0].rates_by: needs `rates_by_value`",
            ),
            (
                MINIMAL.replace("\"global\"", "{\"property\":\"a..b\"}"),
                "rules[0].limit_by: `property` must be a dotted path",
            ),
            (
                MINIMAL.replace(
                    "\"1s\"",
                    "\"1s\",\"cost\":{\"reserve\":{\"default\":1},\"settle\":{\"usage\":\"openai\"}}",
                ),
                "rules[0].cost.reserve: needs exactly one of a non-empty `header`, a `property` or a `body`",
            ),
            (
                MINIMAL.replace(
                    "\"1s\"",
                    "\"1s\",\"cost\":{\"reserve\":{\"body\":\"cohere\",\"default\":1},\"settle\":{\"usage\":\"openai\"}}",
                ),
                "rules[0].cost.reserve.body: unknown variant `cohere`",
            ),
            (
                MINIMAL.replace(
                    "\"1s\"",
                    "\"1s\",\"cost\":{\"reserve\":1,\"settle\":{\"usage\":\"anthropic\",\"include_usage\":true}}",
                ),
                "rules[0].cost.settle.include_usage: applies to",
            ),
            (
                MINIMAL.replace("\"1s\"", &format!("\"1s\",\"cost\":{{\"reserve\":1,\"settle\":{}}}", r#"{"usage":"openai","weights":{"output":-1}}"#)),
                "rules[0].cost.settle.weights.output: must be a number from 0 to 1000",
            ),
            (
                MINIMAL.replace("\"1s\"", &format!("\"1s\",\"cost\":{{\"reserve\":1,\"settle\":{}}}", r#"{"usage":"openai","weights":{"output":"4"}}"#)),
                "rules[0].cost.settle.weights.output: must be a number",
            ),
            (
                MINIMAL.replace("\"1s\"", &format!("\"1s\",\"cost\":{{\"reserve\":1,\"settle\":{}}}", r#"{"usage":"openai","weights":{}}"#)),
                "rules[0].cost.settle.weights: needs at least one of input, cached_input, cache_write, output",
            ),
            (
                MINIMAL.replace("\"1s\"", &format!("\"1s\",\"cost\":{{\"reserve\":1,\"settle\":{}}}", r#"{"usage":"openai","weights":{"input":0,"cached_input":0,"cache_write":0,"output":0}}"#)),
                "rules[0].cost.settle.weights: cannot all be 0",
            ),
            (
                MINIMAL.replace("\"1s\"", &format!("\"1s\",\"cost\":{{\"reserve\":1,\"settle\":{}}}", r#"{"usage":"openai","weights":{"outputs":4}}"#)),
                "rules[0].cost.settle.weights.outputs: unknown field `outputs`",
            ),
            (
                MINIMAL.replace("\"1s\"", &format!("\"1s\",\"cost\":{{\"reserve\":1,\"settle\":{}}}", r#"{"usage":{"paths":["usage.total_tokens"]},"weights":{"output":4}}"#)),
                "rules[0].cost.settle.weights: apply to `openai`, `anthropic` or `gemini` usage only",
            ),
            (
                MINIMAL.replace("\"1s\"", &format!("\"1s\",\"cost\":{{\"reserve\":1,\"settle\":{}}}", r#"{"response_header":"x-cost","weights":{"output":4}}"#)),
                "rules[0].cost.settle.weights: apply to `usage` only",
            ),
            (
                MINIMAL.replace("}]}", &format!("}},{}]}}", INF.replace("4}", "0}"))),
                "rules[1].max_in_flight: must be between 1 and 1000000",
            ),
            (
                MINIMAL.replace("}]}", &format!("}},{}]}}", INF.replace("4}", "4,\"lease\":\"100ms\"}"))),
                "rules[1].lease: must be between 300 ms and 86400000 ms",
            ),
            (
                MINIMAL.replace("}]}", &format!("}},{}]}}", INF.replace("4}", "4,\"lease\":\"3s\"}")))
                    .replace("\"webdis\"", "\"webdis\",\"timeout\":\"1s\""),
                "rules[1].lease: 3000 ms must be at least 4 x redis.timeout (1000 ms)",
            ),
            (
                MINIMAL.replace("}]}", &format!("}},{}]}}", INF.replace("4}", "4,\"rate\":5}"))),
                "rules[1].rate: unknown field `rate`",
            ),
            (
                MINIMAL.replace("}]}", &format!("}},{}]}}", INF.replace("\"global\"", "{\"body\":\"model\"}"))),
                "rules[1].limit_by: an in-flight rule takes its permit with the headers",
            ),
            (
                MINIMAL.replace("}]}", &format!("}},{}]}}", INF.replace("\"f\"", "\"r\""))),
                "rules[1].name: duplicate rule name",
            ),
            (MINIMAL.replace("\"global\"", "{\"body\":\"a..b\"}"), "rules[0].limit_by: `body` must be a dotted path"),
            (
                MINIMAL.replace("}]}", "},{\"name\":\"r\",\"limit_by\":\"path\",\"rate\":1,\"interval\":1}]}"),
                "rules[1].name: duplicate rule name",
            ),
            (r#"{"redis":{"cluster":"c"},"rules":[]}"#.to_string(), "rules: at least one rule is required"),
            (r#"{"redis":{"cluster":"c"}}"#.to_string(), "rules: is required"),
            (MINIMAL.replace("\"name\":\"r\",", ""), "rules[0].name: is required"),
            (MINIMAL.replace("\"global\"", "{\"header\":\"a\",\"query\":\"b\"}"), "rules[0].limit_by: must be one of"),
            (
                MINIMAL.replace("\"global\"", "{\"x_forwarded_for\":\"2\"}"),
                "rules[0].limit_by: `x_forwarded_for` must be",
            ),
            (
                MINIMAL.replace("{\"cluster", "{\"port\":1,\"cluster"),
                "redis.port: unknown field `port`, expected one of",
            ),
            (format!("[{MINIMAL}]"), "must be a JSON object"),
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
