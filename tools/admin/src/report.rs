//! What each operation of `ops` returns: plain data, serialized as is for `--json` (field names and order
//! are the JSON's) and written as text by `output`. Times are ms since the epoch, durations and TTLs ms.

use serde::Serialize;

use crate::model::{Config, Window};

/// One key's TTL.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct KeyTtl {
    /// The key.
    pub key: String,
    /// `PTTL`: ms left, `-1` no expiry, `-2` no such key.
    pub ttl_ms: i64,
}

/// The state of one window (the overall one, or one client's).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct State {
    /// The client id (per-client limiters), `None` for the overall window.
    pub client_id: Option<String>,
    /// Permits available now (Redisson `availablePermits`): below zero while settled costs above their
    /// reservations are in the window (every acquire waits until enough of them leave).
    pub available: i64,
    /// The permits in the window, with the filter's reservations in flight and settled costs.
    pub window: Window,
    /// Members older than the window still in the sorted set (released by the next acquire).
    pub expired: u64,
    /// TTLs of the value and permits keys.
    pub ttl: Vec<KeyTtl>,
}

/// What `show` reports.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ShowReport {
    /// The limiter name (its config hash).
    pub name: String,
    /// The config.
    pub config: Config,
    /// "now" of the report, ms since the epoch.
    pub now_ms: u64,
    /// TTL of the config hash, ms (`PTTL`: `-1` no expiry).
    pub config_ttl_ms: i64,
    /// The overall window, or the selected client's (`--client-id`) of a per-client limiter.
    pub state: Option<State>,
    /// Per-client limiters: every client id with state in Redis, and each one's state.
    pub clients: Vec<State>,
}

/// What a changing command did.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChangeReport {
    /// The limiter name.
    pub name: String,
    /// The command: `set-rate`, `try-set-rate`, `update-rate`.
    pub action: &'static str,
    /// `try-set-rate`: whether the limiter was created (false: it existed and was left as it is).
    pub changed: bool,
    /// The config in Redis afterwards.
    pub config: Config,
    /// Keys of per-client state removed (other clients than the one the script was given).
    pub client_keys_removed: u64,
    /// `update-rate` of a per-client limiter: clients whose available permits were recomputed.
    pub clients_updated: u64,
}

/// What `delete` did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DeleteReport {
    /// The limiter name.
    pub name: String,
    /// Keys removed (config, value and permits, and every client's).
    pub keys_removed: u64,
}

/// One line of `list`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ListEntry {
    /// The limiter name.
    pub name: String,
    /// How it is kept in Redis: `sliding_log` (Redisson's layout: a config hash), `sliding_window_counter` or
    /// `calendar` (one hash `{name}:counter`, no config: `config`, `problem` and `available` are `None`, see
    /// `show`).
    pub layout: &'static str,
    /// Its config, if valid.
    pub config: Option<Config>,
    /// Why the config is not valid.
    pub problem: Option<String>,
    /// Overall limiters: permits available now (maybe below zero, as in [`State`]); per-client ones: `None`
    /// (see `show`).
    pub available: Option<i64>,
}

/// What `validate` reports.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ValidateReport {
    /// Whether the filter loads the configuration.
    pub valid: bool,
    /// The build it was loaded as: `envoy` or `higress`.
    pub build: &'static str,
    /// The refusal, as the filter logs it (`edge-rate-limiter: invalid configuration: <field>: <reason>`).
    pub error: Option<String>,
    /// Each configuration: the global one, then each `_rules_` entry (none when invalid).
    pub configurations: Vec<ConfigSummary>,
}

/// One configuration of a plugin, as `validate` summarizes it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ConfigSummary {
    /// `global`, or `_rules_[i]`.
    pub name: String,
    /// The route names it applies to (`_rules_` only).
    pub routes: Vec<String>,
    /// The domains it applies to (`_rules_` only).
    pub domains: Vec<String>,
    /// The Envoy cluster Redis is reached through, and how (`http`, `host`).
    pub redis: String,
    /// `allow`, `deny` or `local`.
    pub failure_mode: &'static str,
    /// Its `exempt` section, in words (none: `None`).
    pub exempt: Option<String>,
    /// Its rules' entries in order (a rule with `rates_by_value`: one per value match, then its default).
    pub rules: Vec<RuleSummary>,
}

/// One entry of a configuration's rules.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RuleSummary {
    /// The rule's name.
    pub name: String,
    /// Where its key value comes from, as the configuration writes it (`{"header":"x-user-id"}`).
    pub limit_by: serde_json::Value,
    /// The same, part by part: where each is read from, and what stands for a body part the body does not
    /// give.
    pub key: Vec<KeyPart>,
    /// What the rule does with a request missing a key part read from a header, query, cookie, address or
    /// property: `skip`, `deny` or `share` (a body part is never missing: [`KeyPart::unread`]).
    pub on_missing: &'static str,
    /// `rates_by`: where the value its `rates_by_value` entries match is read from, when not the key.
    pub rates_by: Option<Vec<KeyPart>>,
    /// `rates_by_value` entries: the values it applies to (`values [...]`, `regex ...`).
    pub value_match: Option<String>,
    /// Permits per interval.
    pub rate: u64,
    /// The window, ms.
    pub interval_ms: u64,
    /// Permits a request takes (with `cost`: the reservation's fixed number or `default`).
    pub permits: u64,
    /// `cost`: where the reservation is read from, and where the settlement reads the real cost.
    pub cost: Option<CostSummary>,
    /// `overall` or `per-client`.
    #[serde(rename = "type")]
    pub limiter_type: &'static str,
    /// How its limiters are kept in Redis (`layout`): `sliding_log`, `sliding_window_counter` or `calendar`
    /// (none for an in-flight rule).
    pub layout: Option<&'static str>,
    /// A sliding window counter's slices of an interval (20).
    pub slices: Option<u64>,
    /// A calendar quota's period (`minute`, `hour`, `day`, `week`, `month`, `year`; `interval_ms` is its
    /// nominal length, a month 30 days).
    pub period: Option<&'static str>,
    /// A calendar quota's zone, as the configuration writes it (`calendar.time_zone`, default `UTC`).
    pub time_zone: Option<String>,
    /// `enforce` or `shadow`.
    pub mode: &'static str,
    /// The base of its limiter names.
    pub limiter: String,
    /// Its own `exempt` section, in words.
    pub exempt: Option<String>,
    /// An in-flight rule: requests of one key in flight at once (`rate` and `interval_ms` are then 0).
    pub max_in_flight: Option<u64>,
    /// An in-flight rule's lease, ms.
    pub lease_ms: Option<u64>,
}

/// One part of a key (`limit_by`, `rates_by`; a composite key has several): where it is read from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct KeyPart {
    /// `header`, `query`, `cookie`, `client_ip`, `x_forwarded_for`, `path`, `property`, `body` or `global`.
    pub source: &'static str,
    /// The part in words, as the text output writes it: `header authorization`, `body model`,
    /// `client_ip /24 (IPv6 /64)`, `body a.b|c` (dotted paths tried in order, the first present wins).
    pub text: String,
    /// A part read from the JSON request body: what stands for it when the body does not give it (larger
    /// than 64 KiB, not JSON, no such field, not a string or whole number): `!missing`, written so in the
    /// limiter name (and in the value `rates_by_value` matches). Such a part never makes the key missing:
    /// the request is still charged, to the limiter of the key's other parts (`on_missing` applies only to
    /// the parts read from headers, query, cookies, the address or properties). `None` for those parts.
    pub unread: Option<&'static str>,
}

/// A rule's `cost`, as `validate` and `explain` describe it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CostSummary {
    /// `cost.reserve`: the permits taken at the request.
    pub reserve: ReserveSummary,
    /// `cost.settle`: where the real cost is read when the response ends.
    pub settle: SettleSummary,
}

/// Where a reservation (`cost.reserve`) comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ReserveSource {
    /// A fixed number of permits.
    Fixed,
    /// A request header's whole number.
    Header,
    /// A request property's whole number.
    Property,
    /// A field of the JSON request body (the first present of its paths).
    Body,
}

/// A rule's `cost.reserve`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ReserveSummary {
    /// Where the permits come from.
    pub source: ReserveSource,
    /// The header's name, the property's path, or the body's dotted paths in the order tried (none for a
    /// fixed reservation).
    pub from: Vec<String>,
    /// A body reservation by API name (`{"body": "openai"}`): `openai`, `anthropic` or `gemini`.
    pub api: Option<&'static str>,
    /// The fixed number; else the permits of a request that gives no whole number (`default`). A number
    /// read from the request is clamped to 1..=rate.
    pub default: u64,
}

/// Where a settlement (`cost.settle`) reads the real cost.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SettleSource {
    /// The usage an LLM API reports in the response body (JSON or server-sent events).
    Usage,
    /// A response header's whole number.
    ResponseHeader,
}

/// A rule's `cost.settle`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SettleSummary {
    /// Where the cost is read.
    pub source: SettleSource,
    /// `usage`: `openai`, `anthropic`, `gemini`, or `paths` (the sum of the numbers at `from`).
    pub usage: Option<&'static str>,
    /// `usage` `paths`: the dotted paths summed; `response_header`: the header's name.
    pub from: Vec<String>,
    /// `include_usage`: a streamed OpenAI chat request is asked to report its usage.
    pub include_usage: bool,
    /// `weights`: permits per token of each kind.
    pub weights: Option<WeightsSummary>,
}

/// `cost.settle.weights`: permits per token, by kind.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct WeightsSummary {
    /// Prompt tokens not read from a cache.
    pub input: f64,
    /// Prompt tokens read from a cache.
    pub cached_input: f64,
    /// Prompt tokens written to a cache.
    pub cache_write: f64,
    /// Generated tokens.
    pub output: f64,
}

/// Where the permits `explain` counts for a request come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum PermitsFrom {
    /// The rule's `permits`, or a fixed `cost.reserve`.
    Rule,
    /// `cost.reserve`'s header, read from the request (clamped to 1..=rate).
    Request,
    /// `cost.reserve`'s `default`: the request gives no whole number (`explain` reads no body and no
    /// property, so a reservation read from them is always its default).
    Default,
}

/// `explain`'s overall answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Verdict {
    /// Every enforced rule that applies admits the request.
    Allowed,
    /// An enforced rule rejects it.
    Rejected,
    /// The configuration's `exempt` matches: no rule applies.
    Exempt,
    /// No configuration applies to the request (only `_rules_`, none of them matching).
    Unlimited,
}

/// What `explain` reports.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ExplainReport {
    /// The request, as the filter would see it.
    pub request: crate::request::Request,
    /// The configuration that applies: `global`, `_rules_[i]` (none: unlimited).
    pub configuration: Option<String>,
    /// "now" of the report, ms since the epoch.
    pub now_ms: u64,
    /// The answer.
    pub verdict: Verdict,
    /// The status of a rejection.
    pub status: Option<u16>,
    /// The first enforced rule, in configuration order, that rejects (`x-ratelimited-by`).
    pub rejected_by: Option<String>,
    /// Allowed: requests like this one admitted after it (the fewest left of its limiters; none when no
    /// limiter applies).
    pub remaining: Option<u64>,
    /// Rejected: ms until it would be allowed (every rejecting limiter freed enough); `None` when no wait
    /// helps (a missing key denied, more permits than a rate, a value key counting short).
    pub wait_ms: Option<u64>,
    /// Rejected: the `Retry-After` the filter sends, seconds (the longest rejecting limiter's delay).
    pub retry_after_s: Option<u64>,
    /// Shadow rules that would reject it (they never do).
    pub shadow_rejected_by: Vec<String>,
    /// Each rate rule of the configuration.
    pub rules: Vec<RuleExplain>,
    /// Each in-flight rule of the configuration (asked before the rate rules: one that refuses decides).
    pub inflight: Vec<InflightExplain>,
}

impl ExplainReport {
    /// The report of a request no configuration applies to, before anything is known.
    pub fn unlimited(request: crate::request::Request, now_ms: u64) -> Self {
        ExplainReport {
            request,
            configuration: None,
            now_ms,
            verdict: Verdict::Unlimited,
            status: None,
            rejected_by: None,
            remaining: None,
            wait_ms: None,
            retry_after_s: None,
            shadow_rejected_by: Vec::new(),
            rules: Vec::new(),
            inflight: Vec::new(),
        }
    }
}

/// One in-flight rule of `explain`: whether the request would take a permit of its semaphore now.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct InflightExplain {
    /// The rule's name.
    pub rule: String,
    /// `enforce` or `shadow`.
    pub mode: &'static str,
    /// Requests of one key in flight at once.
    pub max_in_flight: u64,
    /// Where its key is read from, part by part (never the body: a permit is taken with the headers).
    pub key: Vec<KeyPart>,
    /// How the rule meets the request.
    pub applies: Applies,
    /// The semaphore the request would take a permit of.
    pub semaphore: Option<String>,
    /// Permits free for it now: the free count and the permits whose lease ended (the acquire reclaims them
    /// first); `max_in_flight` for a semaphore not created yet (the acquire creates it).
    pub free: Option<i64>,
    /// Permits held, their lease running.
    pub in_flight: usize,
    /// The answer.
    pub verdict: RuleVerdict,
    /// Rejected: ms until the earliest running lease ends (a permit may come back sooner: when its request
    /// ends).
    pub wait_ms: Option<u64>,
    /// Rejected: the `Retry-After` the filter sends, seconds (the rule's `retry_after`).
    pub retry_after_s: Option<u64>,
}

/// How a rule meets the request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Applies {
    /// The rule's `exempt` matches.
    Exempt,
    /// The request has no key value and the rule skips such requests.
    NoKey,
    /// The request has no key value and the rule denies such requests, without asking Redis.
    Denied,
    /// The rule acquires from a limiter.
    Limiter,
}

/// A rule's answer, or a window's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum RuleVerdict {
    /// The rule does not apply (exempt, no key value).
    Skipped,
    /// A missing key value: denied.
    Denied,
    /// Its limiter admits the request.
    Allowed,
    /// Its limiter rejects the request now.
    Rejected,
    /// More permits than the limiter's rate: rejected, and no wait admits it.
    Never,
    /// Its limiter could not be read (see `problem`).
    Unknown,
}

/// One rule of `explain`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RuleExplain {
    /// The rule's name.
    pub rule: String,
    /// The index of its effective entry in the configuration's rules.
    pub entry: usize,
    /// `enforce` or `shadow`.
    pub mode: &'static str,
    /// A `rates_by_value` entry: the values it applies to (`values [...]`, `regex ...`).
    pub value_match: Option<String>,
    /// The effective entry's rate, permits per interval.
    pub rate: u64,
    /// Its interval, ms (a calendar quota: its period's nominal length, a month 30 days).
    pub interval_ms: u64,
    /// A calendar quota: its period (`minute` ... `year`).
    pub period: Option<&'static str>,
    /// A calendar quota: its zone, as the configuration writes it.
    pub time_zone: Option<String>,
    /// Permits the request takes.
    pub permits: u64,
    /// Where `permits` comes from.
    pub permits_from: PermitsFrom,
    /// Where its key is read from, part by part.
    pub key: Vec<KeyPart>,
    /// `rates_by`: where the value its `rates_by_value` entries match is read from, when not the key.
    pub rates_by: Option<Vec<KeyPart>>,
    /// `cost`: where the reservation is read from, and where the settlement reads the real cost.
    pub cost: Option<CostSummary>,
    /// Whether and how it applies.
    pub applies: Applies,
    /// Its limiter name.
    pub limiter: Option<String>,
    /// The limiter's config in Redis, when it differs from the entry's.
    pub redis_config: Option<Config>,
    /// What the next acquire does to the config first.
    pub config_step: Option<crate::model::ConfigStep>,
    /// The config the next acquire obeys.
    pub effective: Option<Config>,
    /// TTL of the limiter's config hash, ms (`PTTL`: `-1` no expiry, `-2` no such key).
    pub config_ttl_ms: Option<i64>,
    /// The limiter's window (per-client limiters: each client's, or the one `--client-id` selects), as
    /// `show` reports it, with its answer (none for a sliding window counter: see `counter`).
    pub windows: Vec<WindowExplain>,
    /// A rule with `layout: "sliding_window_counter"`: its limiter's hash counted with the rule's interval, as
    /// the acquire script counts it (there is no config in Redis: `redis_config`, `config_step`,
    /// `effective` and `config_ttl_ms` are `None`).
    pub counter: Option<crate::counter::CounterWindow>,
    /// A rule with `calendar`: its limiter's hash counted with the rule's period and zone, as the acquire
    /// script counts it (no config in Redis either).
    pub calendar: Option<crate::calendar::CalendarWindow>,
    /// The rule's answer (per-client limiters: the worst of its windows).
    pub verdict: RuleVerdict,
    /// Allowed: requests like this one admitted after it.
    pub remaining: Option<u64>,
    /// Rejected: ms until it would admit the request.
    pub wait_ms: Option<u64>,
    /// Rejected: Redisson's delay, ms (what `Retry-After` rounds up).
    pub delay_ms: Option<u64>,
    /// Why the limiter could not be read.
    pub problem: Option<String>,
}

/// One window of a rule's limiter, with its answer.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct WindowExplain {
    /// Its state, as `show` reports it (available permits read without writing: what an acquire counts).
    #[serde(flatten)]
    pub state: State,
    /// Its answer.
    pub verdict: RuleVerdict,
    /// Allowed: requests like this one admitted after it.
    pub remaining: Option<u64>,
    /// Rejected: ms until it would admit the request.
    pub wait_ms: Option<u64>,
    /// Rejected: Redisson's delay, ms.
    pub delay_ms: Option<u64>,
}
