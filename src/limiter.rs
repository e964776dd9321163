//! One request's way through the limiters: which rules apply, the acquire of each, what every reply means,
//! and the final [`Decision`]. Pure: time, randomness, the local blocks and the templates of the commands
//! are passed in, the transport is the caller's, so every path (acquired, rejected, blocked locally,
//! NOSCRIPT retry, failures) is unit-tested.
//!
//! Flow: [`start`] reads the key values and returns either a decision at once (no rule applies, a missing
//! key is denied, a limiter is blocked locally) or a [`PendingRequest`] with one acquire per rule. The
//! caller encodes and sends each ([`PendingRequest::encode`]), feeds each outcome to
//! [`PendingRequest::on_reply`] and acts on the [`Progress`]: send again (after `NOSCRIPT`), keep waiting,
//! or apply the decision; and records the [`crate::block::Block`] a rejection reports.

use alloc::rc::Rc;
use core::fmt;

use smallvec::SmallVec;

use crate::prelude::*;

use crate::block::Block;
use crate::cache::{LimiterCache, Observation};
use crate::config::{ClockSource, FailureMode, Mode, OnMissing, PluginConfig, RateSource, Rule};
use crate::key::{extract, hash_slot, match_text, write_limiter_name, KeyValue, RequestView};
pub use crate::lease::{LeaseAsk, LeaseGrant, LeaseTicket, Leases};
use crate::response::{policy_value, rate_limit_headers, retry_after, HeaderValue, Headers, Quota};
use crate::script::{
    decode_acquire_all_reply, decode_acquire_reply, encode_acquire_all, AcquireConfig, AcquireOutcome, AcquirePart,
    AcquireReply, AcquireTemplate, Clock, ConfigChange, EffectiveConfig, Encoding, Invocation, LeaseRequest,
    LimiterReply, ReplyError, Settlement, MEMBER_RANDOM_LEN,
};
use crate::transport::Failure;

/// How a request leaves the filter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Continue upstream, adding the report's headers to the upstream's response.
    Continue {
        /// What the rate limit headers of the response say.
        report: Report,
    },
    /// Answer locally.
    Respond {
        /// HTTP status.
        status: u16,
        /// What the response headers say (empty when failing closed).
        report: Report,
        /// Whether a limiter rejected the request (`x-envoy-ratelimited: true`).
        rate_limited: bool,
        /// Response body (`text/plain`).
        body: Rc<str>,
    },
}

impl Verdict {
    /// The response headers of this verdict (`Retry-After`, the rate limit headers in the configured style,
    /// `x-envoy-ratelimited`), rendered for `config` and its `plan`: the filter renders them only when it
    /// hands them to the host, so a decision stays small as it moves (README.md, "Lean guest").
    pub fn headers(&self, config: &PluginConfig, plan: &Plan) -> Headers {
        let mut headers = Headers::new();
        let (report, rate_limited) = match self {
            Verdict::Continue { report } => (report, false),
            Verdict::Respond { report, rate_limited, .. } => (report, *rate_limited),
        };
        report.write_headers(config, plan, &mut headers);
        if rate_limited {
            headers.push(("x-envoy-ratelimited", HeaderValue::Static("true")));
        }
        headers
    }
}

/// What the headers of a decided request report: the quota of each rule that has one, in rule order, and
/// the delay of a rejection.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Report {
    /// The rules' quotas.
    pub quotas: SmallVec<[RuleQuota; 2]>,
    /// The longest delay of a rejecting rule, ms (`Retry-After`); `None` when no wait helps or nothing
    /// rejected.
    pub retry_ms: Option<u64>,
    /// The first rule (in configuration order) that rejected: named in `x-ratelimited-by`.
    pub rejected_by: Option<usize>,
    /// The first shadow rule that would have rejected: in the request's filter state, and with
    /// `shadow_headers` named in `x-shadow-ratelimited-by`.
    pub shadow_rejected_by: Option<usize>,
}

impl Report {
    /// Appends `Retry-After`, `x-ratelimited-by` (the rule that rejected) and the rate limit headers in
    /// `config`'s style.
    pub fn write_headers(&self, config: &PluginConfig, plan: &Plan, headers: &mut Headers) {
        if let Some(delay_ms) = self.retry_ms {
            headers.push(retry_after(delay_ms));
        }
        if let Some(rule) = self.rejected_by.and_then(|index| plan.rules.get(index)) {
            headers.push((REJECTED_BY_HEADER, HeaderValue::Shared(Rc::clone(&rule.name))));
        }
        if let Some(rule) = self.shadow_rejected_by.and_then(|index| plan.rules.get(index)) {
            if config.shadow_headers {
                headers.push((SHADOW_REJECTED_BY_HEADER, HeaderValue::Shared(Rc::clone(&rule.name))));
            }
        }
        let quotas: SmallVec<[Quota<'_>; 2]> = self
            .quotas
            .iter()
            .filter_map(|quota| {
                let rule = config.rules.get(quota.rule)?;
                let configured = quota.limit == rule.rate && quota.window_ms == rule.interval_ms;
                Some(Quota {
                    policy: &rule.name,
                    prepared_policy: plan.rules.get(quota.rule).filter(|_| configured).map(|p| &p.policy),
                    limit: quota.limit,
                    window_ms: quota.window_ms,
                    remaining: quota.remaining,
                    reset_ms: quota.reset_ms,
                })
            })
            .collect();
        rate_limit_headers(config.headers, &quotas, headers);
    }
}

/// The response header naming the rule that rejected a request (the first in configuration order).
pub const REJECTED_BY_HEADER: &str = "x-ratelimited-by";
/// With `shadow_headers`: the response header naming the first shadow rule that would have rejected the
/// request.
pub const SHADOW_REJECTED_BY_HEADER: &str = "x-shadow-ratelimited-by";

/// What happened, for metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// No rule applied to the request.
    Unlimited,
    /// The request matched the configuration's `exempt`: no rule was looked at.
    Exempt,
    /// Every rule that applied allowed it.
    Allowed,
    /// A limiter in Redis rejected it (or a missing key was denied, or it asked for more than a rate).
    Rejected,
    /// A limiter's local block rejected it, without a Redis call.
    LocallyRejected,
    /// A rule could not be decided and the failure mode let the request through.
    FailedOpen,
    /// A rule could not be decided and the failure mode answered it.
    FailedClosed,
    /// `failure_mode: "local"`: rules that Redis could not decide (`Decision::local`) are to be decided by
    /// the gateway's local windows (`crate::fallback`); the filter turns this into one of the two below.
    Local,
    /// Decided locally (Redis failing) and admitted.
    LocallyAllowed,
    /// Decided locally (Redis failing) and refused.
    LocallyRefused,
}

/// The final decision on a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    /// What to do with the request.
    pub verdict: Verdict,
    /// What happened, for metrics.
    pub outcome: Outcome,
    /// Whether a Redis call of the request failed as a whole (no reply, a bridge or Redis error, no answer
    /// in time), whatever the decision: what opens the degraded mode's circuit. An error on one limiter's
    /// keys is not one (Redis answered). The calls are counted and logged when they fail.
    pub redis_failed: bool,
    /// How each rule that applied ended (configuration indexes), for the per-rule counters.
    pub rules: SmallVec<[(usize, RuleOutcome); 2]>,
    /// The permits its rules took from this VM's leases: committed if the request goes upstream, put back
    /// into their own leases if not.
    pub leases: Vec<LeaseTicket>,
    /// The members it added in Redis, to give back as it does not go upstream.
    pub give_back: Vec<GiveBack>,
    /// [`Outcome::Local`]: the rules to decide locally, with their limiter names.
    pub local: Vec<(usize, String)>,
}

/// How one rule ended for a request, for its counters (`rule.<name>.<outcome>`); `outcome as usize` is
/// its position in [`RuleOutcome::ALL`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RuleOutcome {
    /// It admitted the request (its permits were taken, or would have been had no other rule rejected).
    Allowed,
    /// It rejected the request (Redis, a missing key denied, or the degraded mode's local window).
    Rejected,
    /// Its limiter's local block rejected the request, without a Redis call.
    LocallyRejected,
    /// A shadow rule that would have rejected the request: the request went on.
    ShadowRejected,
    /// Its Redis call failed.
    Failed,
}

impl RuleOutcome {
    /// Every outcome, in counter order.
    pub const ALL: [RuleOutcome; 5] = [
        RuleOutcome::Allowed,
        RuleOutcome::Rejected,
        RuleOutcome::LocallyRejected,
        RuleOutcome::ShadowRejected,
        RuleOutcome::Failed,
    ];

    /// Its counter's last name part: `rule.<name>.<this>`.
    pub fn counter(self) -> &'static str {
        match self {
            RuleOutcome::Allowed => "allowed",
            RuleOutcome::Rejected => "rejected",
            RuleOutcome::LocallyRejected => "local_rejected",
            RuleOutcome::ShadowRejected => "shadow_rejected",
            RuleOutcome::Failed => "failures",
        }
    }
}

/// How one rule treats a request, before any Redis call ([`applications`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Applies {
    /// The request matches the rule's `exempt`: the rule does not apply.
    Exempt,
    /// The request has no key value for the rule and `on_missing` is `skip`: the rule does not apply.
    NoKey,
    /// The request has no key value and `on_missing` is `deny`: rejected without Redis.
    Denied,
    /// The rule applies with this limiter (its Redis name).
    Limiter {
        /// The limiter name.
        name: String,
    },
}

/// One rule's [`Applies`] for a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuleApplication {
    /// The rule's name.
    pub rule: String,
    /// The index in `config.rules` of the entry that applies (a rule with `rates_by_value` has several:
    /// this one's `rate`, `interval_ms`, `permits` and `mode` are the rule's for this request).
    pub entry: usize,
    /// How it applies.
    pub applies: Applies,
}

/// Which rules apply to `request` and with which limiters: what [`start`] acts on, without Redis, for
/// tools that explain a decision (`erl-admin explain`). `None`: the request matches the configuration's
/// `exempt`, and no rule is looked at.
pub fn applications(config: &PluginConfig, request: &impl RequestView) -> Option<Vec<RuleApplication>> {
    if config.exempt.as_ref().is_some_and(|exempt| exempt.matches(request)) {
        return None;
    }
    let mut applications = Vec::new();
    let mut name = String::new();
    let mut first = 0;
    while let Some(end) = group_end(config, first) {
        let (entry, applies) = match resolve(config, first, end, request, &mut name) {
            Resolved::Limiter(entry) => (entry, Applies::Limiter { name: name.clone() }),
            Resolved::Exempt => (end - 1, Applies::Exempt),
            Resolved::NoKey => (end - 1, Applies::NoKey),
            Resolved::Denied => (end - 1, Applies::Denied),
        };
        let rule = config.rules.get(entry).map(|r| r.name.clone()).unwrap_or_default();
        applications.push(RuleApplication { rule, entry, applies });
        first = end;
    }
    Some(applications)
}

/// The end (exclusive) of the rule whose entries start at `first`: its `rates_by_value` entries and its
/// default entry, the first with no value match. `None` past the last rule.
fn group_end(config: &PluginConfig, first: usize) -> Option<usize> {
    let rest = config.rules.get(first..).filter(|rest| !rest.is_empty())?;
    Some(first + rest.iter().position(|rule| rule.value_match.is_none()).map_or(rest.len(), |at| at + 1))
}

/// How the rule with entries `first..end` treats a request.
enum Resolved {
    Exempt,
    NoKey,
    Denied,
    /// This entry applies; its limiter name is in the caller's buffer.
    Limiter(usize),
}

/// Reads the key value of the rule with entries `first..end` (all share the source, `on_missing`, `exempt`
/// and limiter base), picks the entry whose value match accepts it (else the default, last), and writes the
/// limiter name into `name`.
fn resolve(config: &PluginConfig, first: usize, end: usize, request: &impl RequestView, name: &mut String) -> Resolved {
    let Some(rule) = config.rules.get(first) else { return Resolved::NoKey };
    if rule.exempt.as_ref().is_some_and(|exempt| exempt.matches(request)) {
        return Resolved::Exempt;
    }
    let value = match (extract(&rule.source, request), rule.on_missing) {
        (KeyValue::Missing, OnMissing::Skip) => return Resolved::NoKey,
        (KeyValue::Missing, OnMissing::Deny) => return Resolved::Denied,
        (KeyValue::Missing, OnMissing::Share) => KeyValue::Value(Vec::new()),
        (value, _) => value,
    };
    let mut entry = end - 1;
    if end - first > 1 {
        if let Some(text) = match_text(&value) {
            let matched = config.rules.get(first..end - 1).and_then(|entries| {
                entries.iter().position(|e| e.value_match.as_ref().is_some_and(|m| m.matches(&text)))
            });
            entry = matched.map_or(entry, |at| first + at);
        }
    }
    if write_limiter_name(&rule.limiter, &value, name) {
        Resolved::Limiter(entry)
    } else {
        Resolved::NoKey
    }
}

/// Something worth one log line, found while deciding (not per request: the caller logs each once).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Notice {
    /// Redis holds another config for this limiter than the rule (Redis wins).
    ConfigDiffers {
        /// The rule.
        rule: String,
        /// The limiter name.
        limiter: String,
        /// What Redis holds.
        effective: EffectiveConfig,
    },
    /// The rule's config replaced another one in Redis (`rate_source: config`), keeping consumed permits.
    ConfigApplied {
        /// The rule.
        rule: String,
        /// The limiter name.
        limiter: String,
        /// What Redis holds now.
        effective: EffectiveConfig,
    },
    /// `rate_source: config`, but someone else (an operator, a Java service) changed the limiter's config
    /// after the rule wrote it: their config stands.
    ConfigKept {
        /// The rule.
        rule: String,
        /// The limiter name.
        limiter: String,
        /// What Redis holds.
        effective: EffectiveConfig,
    },
    /// The rule's permits per request exceed the limiter's rate in Redis: such requests are always rejected.
    ExceedsRate {
        /// The rule.
        rule: String,
        /// The limiter name.
        limiter: String,
    },
}

impl fmt::Display for Notice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Notice::ConfigDiffers { rule, limiter, effective } => write!(
                f,
                "rule {rule}: limiter {limiter} exists in Redis with rate {} per {} ms ({}), which differs from the configuration; obeying Redis",
                effective.rate,
                effective.interval_ms,
                effective.limiter_type.name()
            ),
            Notice::ConfigApplied { rule, limiter, effective } => write!(
                f,
                "rule {rule}: limiter {limiter} held another config in Redis; applied rate {} per {} ms ({}) keeping consumed permits (rate_source: config)",
                effective.rate,
                effective.interval_ms,
                effective.limiter_type.name()
            ),
            Notice::ConfigKept { rule, limiter, effective } => write!(
                f,
                "rule {rule}: limiter {limiter} holds rate {} per {} ms ({}), set by someone else after the rule wrote its own; keeping it (rate_source: config changes only a config the rule wrote)",
                effective.rate,
                effective.interval_ms,
                effective.limiter_type.name()
            ),
            Notice::ExceedsRate { rule, limiter } => write!(
                f,
                "rule {rule}: requests take more permits than limiter {limiter} allows per interval in Redis; they are rejected"
            ),
        }
    }
}

/// Where a request finds the local blocks of its limiters ([`crate::block`]).
pub trait Blocks {
    /// The live block of limiter `name` at `now_ms` that rejects a request for `permits` (fewer than
    /// `permits` free), if any.
    fn rejecting(&self, name: &str, now_ms: u64, permits: u64) -> Option<Block>;
}

/// What one rule needs on every request, prepared once per configuration and client id.
#[derive(Debug, Clone)]
pub struct RulePlan {
    /// Its acquire command.
    pub template: AcquireTemplate,
    /// Its `RateLimit-Policy` member for the configured limit and window.
    pub policy: Rc<str>,
    /// Its name (the `x-ratelimited-by` value).
    pub name: Rc<str>,
}

/// What a configuration needs on every request: its rules' plans and its response bodies.
#[derive(Debug, Clone)]
pub struct Plan {
    /// By rule index.
    pub rules: Vec<RulePlan>,
    /// The body of a rejection.
    pub rejection_body: Rc<str>,
    /// The body of a failure answered locally (`failure_mode: "deny"`).
    pub failure_body: Rc<str>,
    /// `failure_mode: "deny"`: a Redis error on one limiter of a combined call leaves the others uncharged
    /// (the request will not go on).
    pub errors_stop_charge: bool,
}

impl Plan {
    /// The plan of `config` for this gateway's Redisson client id.
    pub fn new(config: &PluginConfig, client_id: &str) -> Self {
        let rules = config
            .rules
            .iter()
            .map(|rule| {
                let acquire = AcquireConfig {
                    permits: rule.permits,
                    rate: rule.rate,
                    interval_ms: rule.interval_ms,
                    limiter_type: rule.limiter_type,
                    keep_alive_ms: rule.keep_alive_ms,
                    apply_config: rule.rate_source == RateSource::Config,
                };
                RulePlan {
                    template: AcquireTemplate::new(acquire, client_id),
                    policy: policy_value(&rule.name, rule.rate, rule.interval_ms).into(),
                    name: rule.name.as_str().into(),
                }
            })
            .collect();
        Plan {
            rules,
            rejection_body: config.rejection.body.as_str().into(),
            failure_body: "rate limiter unavailable\n".into(),
            errors_stop_charge: config.failure_mode == FailureMode::Deny,
        }
    }
}

/// The inputs of a decision that are not the request: time, configuration, its plan, blocks.
pub struct Context<'a> {
    /// The validated plugin configuration.
    pub config: &'a PluginConfig,
    /// The configuration's plan (commands built with this process's Redisson client id).
    pub plan: &'a Plan,
    /// Now, ms since the epoch.
    pub now_ms: u64,
    /// The local blocks.
    pub blocks: &'a dyn Blocks,
    /// This VM's leases.
    pub leases: &'a dyn Leases,
    /// Redis is failing and no probe is due (`failure_mode: "local"`): rules that would ask Redis are
    /// decided locally instead.
    pub skip_redis: bool,
}

/// A rule's state in the headers: its rule index and quota numbers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RuleQuota {
    /// The rule's index in the configuration.
    pub rule: usize,
    /// Permits per window, as Redis holds it.
    pub limit: u64,
    /// Window length, ms, as Redis holds it.
    pub window_ms: u64,
    /// Permits left.
    pub remaining: u64,
    /// Until the quota is whole again (allowed) or the next permit is released (rejected), ms.
    pub reset_ms: u64,
}

/// How one rule ended.
#[derive(Debug, Clone, PartialEq, Eq)]
enum RuleResult {
    /// Permits taken, from where ([`Taken`]).
    Acquired(RuleQuota, Taken),
    /// [`crate::script::ACQUIRE_ALL`]: the limiter had the permits, another rule rejected: none taken.
    Untaken(RuleQuota),
    /// Rejected by the limiter in Redis or by its local block; `delay_ms` is `None` when no wait can help
    /// (more permits than the rate).
    Rejected { quota: RuleQuota, delay_ms: Option<u64>, local: bool },
    /// Rejected without asking Redis (no key value and `on_missing: deny`).
    Denied,
    /// Its call failed, or its limiter's keys raised a Redis error.
    Failed,
    /// Not asked: the circuit is open (`failure_mode: "local"`, Redis failing); decided locally.
    Skipped,
}

/// Where an acquired rule's permits came from: what giving them back takes when the request does not go on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Taken {
    /// From this VM's lease with these member random bytes (held before, or granted by this call): given
    /// back to that lease.
    Lease { random: [u8; MEMBER_RANDOM_LEN] },
    /// A member of their own in Redis (`granted` permits): given back with [`crate::script::GIVE_BACK`].
    Member { granted: u64 },
}

/// A member a request added in Redis and gives back as it does not go upstream (its call was separate
/// from the rule that rejected: Redis Cluster, another hash slot; or it fails closed): remove it and
/// restore the value ([`crate::script::GIVE_BACK`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GiveBack {
    /// The limiter name.
    pub name: String,
    /// The member and what to do with it (`used` 0: remove).
    pub settlement: Settlement,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum CallState {
    /// Waiting for the reply of its send.
    Waiting,
    /// Waiting for this VM's lease acquire of its limiter, sent by another request
    /// ([`PendingRequest::unpark`]).
    Parked,
    Done(RuleResult),
}

/// One rule's acquire within a request.
#[derive(Debug, Clone, PartialEq, Eq)]
struct RuleCall {
    rule: usize,
    /// The limiter name.
    name: String,
    clock: Clock,
    /// Gateway time the acquire was started, ms (the base of a local block and of a lease's age).
    sent_ms: u64,
    member_random: [u8; MEMBER_RANDOM_LEN],
    /// The lease it asks for, if any.
    lease: Option<LeaseRequest>,
    state: CallState,
}

/// One Redis call of a request: the rule calls it carries (one: [`crate::script::ACQUIRE`]; several:
/// [`crate::script::ACQUIRE_ALL`]).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Send {
    calls: SmallVec<[usize; 2]>,
    /// Whether it was sent again by source (after `NOSCRIPT`).
    retried: bool,
    done: bool,
}

/// A request waiting for its acquire replies.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PendingRequest {
    /// Every rule that applies, in rule order (those served from a lease are done already).
    calls: Vec<RuleCall>,
    sends: SmallVec<[Send; 1]>,
    /// A result decided without Redis (a missing key denied): it decides the request, so nothing is sent.
    settled: Option<(usize, RuleResult)>,
    /// Whether one of its calls failed as a whole ([`Decision::redis_failed`]).
    redis_failed: bool,
}

/// The first step of a request.
#[derive(Debug)]
pub enum Start {
    /// Decided without Redis.
    Decided(Decision),
    /// Send each send index (encode it with [`PendingRequest::encode`]) and report its reply.
    Send(PendingRequest, usize),
}

/// The step after a reply.
// One per reply, moved once: boxing the decision would cost an allocation per request instead.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub enum Progress {
    /// Send this send index again, by source (after `NOSCRIPT`).
    Resend(usize),
    /// Other sends are still outstanding.
    Waiting,
    /// Every send is done.
    Done(Decision),
}

/// What a reply teaches besides the decision.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Effects {
    /// Log lines, once per limiter.
    pub notices: Vec<Notice>,
    /// Local blocks to record (Redis rejected these limiters).
    pub blocks: Vec<(String, Block)>,
    /// Lease acquires that ended.
    pub leases: Vec<LeaseEnd>,
    /// The call failed as a whole: one failed call (`redis_errors`), logged once per cause.
    pub call_failure: Option<Failure>,
    /// Limiters whose keys raised a Redis error in a call that decided the others: their rules fail
    /// alone (one failed call however many).
    pub limiter_errors: Vec<LimiterError>,
}

impl Effects {
    /// Whether the call failed, as a whole or for one of its limiters (one count in `redis_errors`).
    pub fn failed(&self) -> bool {
        self.call_failure.is_some() || !self.limiter_errors.is_empty()
    }
}

/// A lease acquire that ended ([`crate::lease::LeaseTable::end`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseEnd {
    /// The limiter name.
    pub name: String,
    /// The lease Redis granted (`None`: none; the call failed, rejected, or took only the request's own).
    pub grant: Option<LeaseGrant>,
    /// The settlement the call carried: its member's random bytes, and whether Redis ran it.
    pub settled: Option<([u8; MEMBER_RANDOM_LEN], bool)>,
}

/// A Redis error on one limiter's keys in a combined call (e.g. `WRONGTYPE`: its config key is not a hash).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LimiterError {
    /// The rule's index in the configuration.
    pub rule: usize,
    /// The limiter name.
    pub limiter: String,
    /// Redis's error text.
    pub error: String,
}

/// Starts deciding a request: reads each rule's key value, serves it from a lease or checks its limiter's
/// local block, and prepares the Redis calls: one for all the request's limiters (all or nothing), or with
/// `redis.redis_cluster` one per hash slot.
///
/// `random` gives the random bytes of each new permit member (they must differ between acquires: two
/// equal members in one window would count as one).
///
/// `name` is a buffer for the limiter names (its allocation is reused: a request rejected by a local block
/// allocates none).
pub fn start(
    ctx: &Context<'_>,
    request: &impl RequestView,
    random: &mut dyn FnMut() -> [u8; MEMBER_RANDOM_LEN],
    name: &mut String,
) -> Start {
    let mut calls = Vec::new();
    let mut settled = None;
    if ctx.config.exempt.as_ref().is_some_and(|exempt| exempt.matches(request)) {
        return Start::Decided(exempt());
    }
    let mut first = 0;
    while let Some(end) = group_end(ctx.config, first) {
        let resolved = resolve(ctx.config, first, end, request, name);
        let default_entry = end - 1;
        first = end;
        let index = match resolved {
            Resolved::Exempt | Resolved::NoKey => continue,
            Resolved::Denied if ctx.config.rules.get(default_entry).is_some_and(|r| r.mode == Mode::Shadow) => {
                let state = CallState::Done(RuleResult::Denied);
                calls.push(RuleCall::settled(default_entry, ctx.now_ms, state));
                continue;
            }
            Resolved::Denied => {
                settled = Some((default_entry, RuleResult::Denied));
                break;
            }
            Resolved::Limiter(entry) => entry,
        };
        let Some(rule) = ctx.config.rules.get(index) else { continue };
        let clock = match ctx.config.clock {
            ClockSource::Gateway => Clock::Gateway(ctx.now_ms),
            ClockSource::Redis => Clock::Redis,
        };
        if rule.lease.is_some() {
            if let Some((remaining, random)) = ctx.leases.take(name, ctx.now_ms, rule.permits) {
                let quota = RuleQuota {
                    rule: index,
                    limit: rule.rate,
                    window_ms: rule.interval_ms,
                    remaining,
                    reset_ms: rule.interval_ms,
                };
                calls.push(RuleCall {
                    rule: index,
                    name: name.clone(),
                    clock,
                    sent_ms: ctx.now_ms,
                    member_random: [0; MEMBER_RANDOM_LEN],
                    lease: None,
                    state: CallState::Done(RuleResult::Acquired(quota, Taken::Lease { random })),
                });
                continue;
            }
        }
        if rule.local_block_max_ms > 0 {
            if let Some(block) = ctx.blocks.rejecting(name, ctx.now_ms, rule.permits) {
                if rule.mode == Mode::Shadow {
                    // A shadow rule blocked locally would have rejected: no Redis call to learn it again.
                    let (quota, delay_ms) = block_quota(ctx, index, &block);
                    let state = CallState::Done(RuleResult::Rejected { quota, delay_ms: Some(delay_ms), local: true });
                    calls.push(RuleCall { name: name.clone(), ..RuleCall::settled(index, ctx.now_ms, state) });
                    continue;
                }
                give_back_leases(&calls, ctx);
                return Start::Decided(blocked(ctx, index, &block));
            }
        }
        calls.push(RuleCall {
            rule: index,
            name: name.clone(),
            clock,
            sent_ms: ctx.now_ms,
            member_random: random(),
            lease: None,
            state: CallState::Waiting,
        });
    }
    let mut pending = PendingRequest { calls, sends: SmallVec::new(), settled, redis_failed: false };
    if pending.settled.is_some() {
        give_back_leases(&pending.calls, ctx);
        // The answer is already no: decide before spending a round trip.
        return Start::Decided(pending.decide(ctx.config, ctx.plan));
    }
    if ctx.skip_redis {
        for call in pending.calls.iter_mut().filter(|c| c.state == CallState::Waiting) {
            call.state = CallState::Done(RuleResult::Skipped);
        }
        return Start::Decided(pending.decide(ctx.config, ctx.plan));
    }
    for call in pending.calls.iter_mut().filter(|c| c.state == CallState::Waiting) {
        call.ask_for_lease(ctx.config, ctx.leases, ctx.now_ms);
    }
    pending.sends = group(&pending.calls, ctx.config);
    if pending.sends.is_empty() && !pending.calls.iter().any(|c| c.state == CallState::Parked) {
        // Nothing to ask Redis (no rule applies, or leases served them all).
        return Start::Decided(pending.decide(ctx.config, ctx.plan));
    }
    let count = pending.sends.len();
    Start::Send(pending, count)
}

impl RuleCall {
    /// A call decided without Redis (a shadow rule's denial or local block), for rule entry `rule`.
    fn settled(rule: usize, now_ms: u64, state: CallState) -> Self {
        RuleCall {
            rule,
            name: String::new(),
            clock: Clock::Gateway(now_ms),
            sent_ms: now_ms,
            member_random: [0; MEMBER_RANDOM_LEN],
            lease: None,
            state,
        }
    }

    /// For a rule with a lease: asks for one in this call, with the previous lease to settle, or parks the
    /// call when this VM's lease acquire of the limiter is on its way already (it waits for that lease
    /// rather than spending a round trip of its own).
    fn ask_for_lease(&mut self, config: &PluginConfig, leases: &dyn Leases, now_ms: u64) {
        let Some(rule) = config.rules.get(self.rule) else { return };
        let Some(lease) = rule.lease else { return };
        let due_ms = now_ms.saturating_add(config.redis.timeout_ms);
        match leases.begin(&self.name, now_ms, due_ms, lease.max_permits, rule.permits) {
            Some(LeaseAsk { want, settle }) => {
                self.lease = Some(LeaseRequest { max_permits: want, max_age_ms: lease.max_age_ms, settle });
            }
            None => self.state = CallState::Parked,
        }
    }
}

/// The rejection of a limiter's local block: what `decide` makes of this one result, without the generic
/// path: the request costs no Redis call, and should cost little else (README.md, "Lean guest").
fn blocked(ctx: &Context<'_>, rule: usize, block: &Block) -> Decision {
    let (quota, delay_ms) = block_quota(ctx, rule, block);
    let mut report = Report { retry_ms: Some(delay_ms), rejected_by: Some(rule), ..Report::default() };
    report.quotas.push(quota);
    let mut rules = SmallVec::new();
    rules.push((rule, RuleOutcome::LocallyRejected));
    Decision {
        verdict: Verdict::Respond {
            status: ctx.config.rejection.status,
            report,
            rate_limited: true,
            body: Rc::clone(&ctx.plan.rejection_body),
        },
        outcome: Outcome::LocallyRejected,
        redis_failed: false,
        rules,
        leases: Vec::new(),
        give_back: Vec::new(),
        local: Vec::new(),
    }
}

/// The quota a local block reports, and its delay: Redisson's, 3 ms past the oldest permit's departure.
fn block_quota(ctx: &Context<'_>, rule: usize, block: &Block) -> (RuleQuota, u64) {
    let delay_ms = block.release_ms.saturating_sub(ctx.now_ms).saturating_add(3);
    (RuleQuota { rule, limit: block.rate, window_ms: block.interval_ms, remaining: 0, reset_ms: delay_ms }, delay_ms)
}

/// The decision on a request the configuration's `exempt` matches: it goes on, without headers.
fn exempt() -> Decision {
    Decision {
        verdict: Verdict::Continue { report: Report::default() },
        outcome: Outcome::Exempt,
        redis_failed: false,
        rules: SmallVec::new(),
        leases: Vec::new(),
        give_back: Vec::new(),
        local: Vec::new(),
    }
}

/// Puts back what the rules served so far took from leases (the request was decided against at start).
fn give_back_leases(calls: &[RuleCall], ctx: &Context<'_>) {
    for ticket in lease_tickets(calls, ctx.config) {
        ctx.leases.put_back(&ticket);
    }
}

/// The permits `calls` took from this VM's leases.
fn lease_tickets(calls: &[RuleCall], config: &PluginConfig) -> Vec<LeaseTicket> {
    calls
        .iter()
        .filter_map(|call| match (&call.state, config.rules.get(call.rule)) {
            (CallState::Done(RuleResult::Acquired(_, Taken::Lease { random })), Some(rule)) => {
                Some(LeaseTicket { name: call.name.clone(), random: *random, permits: rule.permits })
            }
            _ => None,
        })
        .collect()
}

/// The Redis calls of a request's waiting rule calls: all in one (all or nothing), or with Redis Cluster one
/// per hash slot of their limiters (a script's keys must share a slot). Shadow rules are checked in calls
/// of their own: a shadow rule that would reject must not keep the enforced rules from taking their permits.
fn group(calls: &[RuleCall], config: &PluginConfig) -> SmallVec<[Send; 1]> {
    let mut sends: SmallVec<[Send; 1]> = SmallVec::new();
    let mut slots: SmallVec<[(u16, bool); 2]> = SmallVec::new();
    for (index, call) in calls.iter().enumerate().filter(|(_, c)| c.state == CallState::Waiting) {
        let shadow = config.rules.get(call.rule).is_some_and(|r| r.mode == Mode::Shadow);
        let slot = (if config.redis.redis_cluster { hash_slot(&call.name) } else { 0 }, shadow);
        match slots.iter().position(|&s| s == slot) {
            Some(at) => {
                if let Some(send) = sends.get_mut(at) {
                    send.calls.push(index);
                }
            }
            None => {
                slots.push(slot);
                let mut covered = SmallVec::new();
                covered.push(index);
                sends.push(Send { calls: covered, retried: false, done: false });
            }
        }
    }
    sends
}

impl PendingRequest {
    /// The bytes of send `send`, by sha or by source, in the transport's wire form; `None` for an unknown
    /// send.
    pub fn encode(&self, send: usize, invocation: Invocation, encoding: Encoding, plan: &Plan) -> Option<Vec<u8>> {
        let send = self.sends.get(send)?;
        if let [only] = send.calls.as_slice() {
            let call = self.calls.get(*only)?;
            let template = &plan.rules.get(call.rule)?.template;
            return Some(template.encode(
                &call.name,
                call.clock,
                &call.member_random,
                call.lease.as_ref(),
                invocation,
                encoding,
            ));
        }
        let mut parts: SmallVec<[AcquirePart<'_>; 2]> = SmallVec::new();
        let mut clock = Clock::Redis;
        for &index in &send.calls {
            let call = self.calls.get(index)?;
            clock = call.clock;
            parts.push(AcquirePart {
                template: &plan.rules.get(call.rule)?.template,
                name: &call.name,
                random: &call.member_random,
                lease: call.lease.as_ref(),
            });
        }
        Some(encode_acquire_all(&parts, clock, plan.errors_stop_charge, invocation, encoding))
    }

    /// Records the transport's outcome for send `send`: the raw RESP reply bytes, or a failure. `now_ms`:
    /// the gateway time the reply arrived (a lease's first use).
    ///
    /// Updates the cache with the limiter config a reply reports and returns what is worth logging or
    /// recording. A reply for an unknown or finished send is ignored ([`Progress::Waiting`] or the
    /// decision again).
    pub fn on_reply(
        &mut self,
        send: usize,
        reply: Result<&[u8], Failure>,
        ctx: &ReplyContext<'_>,
        cache: &mut LimiterCache,
    ) -> (Progress, Effects) {
        let mut effects = Effects::default();
        let Some(entry) = self.sends.get_mut(send).filter(|s| !s.done) else {
            return (self.progress(ctx.config, ctx.plan), effects);
        };
        let decoded = reply.map(|bytes| match entry.calls.len() {
            1 => decode_acquire_reply(bytes).map(|reply| vec![Ok(reply)]),
            n => decode_acquire_all_reply(bytes, n),
        });
        let results: Result<Vec<LimiterReply>, Failure> = match decoded {
            Err(failure) => Err(failure),
            Ok(Err(ReplyError::NoScript)) if !entry.retried => {
                entry.retried = true;
                return (Progress::Resend(send), effects);
            }
            Ok(Err(ReplyError::NoScript)) => Err(Failure::RedisError("NOSCRIPT after EVAL".into())),
            Ok(Err(ReplyError::Redis(text))) => Err(Failure::RedisError(text)),
            Ok(Err(ReplyError::Unexpected(what))) => Err(Failure::BadReply(what)),
            Ok(Ok(replies)) => Ok(replies),
        };
        entry.done = true;
        let covered = entry.calls.clone();
        if let Err(failure) = &results {
            self.redis_failed = true;
            effects.call_failure = Some(failure.clone());
        }
        for (position, index) in covered.into_iter().enumerate() {
            let Some(call) = self.calls.get_mut(index) else { continue };
            let Some(rule) = ctx.config.rules.get(call.rule) else { continue };
            let reply = match &results {
                Err(_) => None,
                Ok(replies) => match replies.get(position) {
                    Some(Ok(reply)) => Some(reply),
                    Some(Err(error)) => {
                        let limiter = call.name.clone();
                        effects.limiter_errors.push(LimiterError { rule: call.rule, limiter, error: error.clone() });
                        None
                    }
                    None => {
                        let what = Failure::BadReply("fewer replies than limiters".into());
                        effects.call_failure.get_or_insert(what);
                        None
                    }
                },
            };
            let (result, grant) = match reply {
                Some(reply) => call_result(call, rule, reply, ctx.now_ms, cache, &mut effects),
                None => (RuleResult::Failed, None),
            };
            if let Some(lease) = &call.lease {
                let settled = lease.settle.map(|s| (s.random, reply.is_some()));
                effects.leases.push(LeaseEnd { name: call.name.clone(), grant, settled });
            }
            call.state = CallState::Done(result);
        }
        (self.progress(ctx.config, ctx.plan), effects)
    }

    /// Whether a call waits for this VM's lease acquire of limiter `name`.
    pub fn parked_on(&self, name: &str) -> bool {
        self.calls.iter().any(|c| c.state == CallState::Parked && c.name == name)
    }

    /// The limiters of the lease acquires this request sent and still waits for, with the member random bytes
    /// of the settlement each carried.
    pub fn leases_waiting(&self) -> Vec<(String, Option<[u8; MEMBER_RANDOM_LEN]>)> {
        let waiting = |c: &&RuleCall| c.state == CallState::Waiting && c.lease.is_some();
        let settled = |c: &RuleCall| c.lease.and_then(|l| l.settle).map(|s| s.random);
        self.calls.iter().filter(waiting).map(|c| (c.name.clone(), settled(c))).collect()
    }

    /// This VM's lease acquire of limiter `name` ended: each call parked on it takes its permits from the
    /// lease if it can, else asks Redis itself (for a lease of its own, or, when another lease acquire is
    /// on its way again, stays parked). Returns the new sends to make, and the progress.
    pub fn unpark(
        &mut self,
        name: &str,
        config: &PluginConfig,
        plan: &Plan,
        leases: &dyn Leases,
        now_ms: u64,
    ) -> (SmallVec<[usize; 1]>, Progress) {
        let mut new_sends = SmallVec::new();
        for index in 0..self.calls.len() {
            let Some(call) = self.calls.get_mut(index) else { continue };
            if call.state != CallState::Parked || call.name != name {
                continue;
            }
            let Some(rule) = config.rules.get(call.rule) else { continue };
            if let Some((remaining, random)) = leases.take(name, now_ms, rule.permits) {
                let quota = RuleQuota {
                    rule: call.rule,
                    limit: rule.rate,
                    window_ms: rule.interval_ms,
                    remaining,
                    reset_ms: rule.interval_ms,
                };
                call.state = CallState::Done(RuleResult::Acquired(quota, Taken::Lease { random }));
                continue;
            }
            call.state = CallState::Waiting;
            call.sent_ms = now_ms;
            if let Clock::Gateway(_) = call.clock {
                call.clock = Clock::Gateway(now_ms);
            }
            call.ask_for_lease(config, leases, now_ms);
            if call.state == CallState::Waiting {
                let mut covered = SmallVec::new();
                covered.push(index);
                new_sends.push(self.sends.len());
                self.sends.push(Send { calls: covered, retried: false, done: false });
            }
        }
        (new_sends, self.progress(config, plan))
    }

    /// Ends every call still waiting (the request's deadline passed, see [`Failure::TimedOut`]) and decides
    /// the request; also answers how many of its Redis calls were still unanswered (each a failed call).
    pub fn expire(&mut self, config: &PluginConfig, plan: &Plan) -> (Decision, usize) {
        for call in &mut self.calls {
            if matches!(call.state, CallState::Waiting | CallState::Parked) {
                call.state = CallState::Done(RuleResult::Failed);
            }
        }
        let mut unanswered = 0;
        for send in self.sends.iter_mut().filter(|s| !s.done) {
            send.done = true;
            unanswered += 1;
        }
        self.redis_failed |= unanswered > 0;
        (self.decide(config, plan), unanswered)
    }

    /// The permits its rules took from this VM's leases so far (to put back when its client leaves).
    pub fn lease_tickets(&self, config: &PluginConfig) -> Vec<LeaseTicket> {
        lease_tickets(&self.calls, config)
    }

    fn progress(&self, config: &PluginConfig, plan: &Plan) -> Progress {
        if self.sends.iter().any(|s| !s.done) || self.calls.iter().any(|c| c.state == CallState::Parked) {
            Progress::Waiting
        } else {
            Progress::Done(self.decide(config, plan))
        }
    }

    /// Combines the rule results: any rejection rejects; otherwise rules Redis could not decide go to the
    /// local windows (`failure_mode: "local"`, [`Outcome::Local`]) or follow the failure mode; otherwise
    /// the request is allowed. A request that does not go on gives back what it took.
    fn decide(&self, config: &PluginConfig, plan: &Plan) -> Decision {
        let done = self.calls.iter().filter_map(|c| match &c.state {
            CallState::Done(result) => Some((c.rule, result, Some(&c.name))),
            CallState::Waiting | CallState::Parked => None,
        });
        let decides_locally = config.failure_mode == FailureMode::Local;
        let shadow = |rule: usize| config.rules.get(rule).is_some_and(|r| r.mode == Mode::Shadow);
        let mut local_rules = Vec::new();
        let mut report = Report::default();
        let mut rules = SmallVec::new();
        let (mut local, mut failed) = (false, false);
        let any = self.settled.is_some() || self.calls.iter().any(|c| matches!(c.state, CallState::Done(_)));
        // A rejected request gives back what the others took: their quotas report it as free already.
        let rejected = self.settled.is_some()
            || self.calls.iter().any(|c| {
                matches!(c.state, CallState::Done(RuleResult::Rejected { .. }) | CallState::Done(RuleResult::Denied))
                    && !shadow(c.rule)
            });
        for (rule, result, name) in self.settled.iter().map(|(rule, result)| (*rule, result, None)).chain(done) {
            let shadow = shadow(rule);
            // A shadow rule's quota shows only with `shadow_headers`.
            let reported = !shadow || config.shadow_headers;
            let quota = match result {
                RuleResult::Acquired(quota, _) if rejected => {
                    rules.push((rule, RuleOutcome::Allowed));
                    let permits = config.rules.get(rule).map_or(0, |r| r.permits);
                    if reported {
                        report.quotas.push(RuleQuota { remaining: quota.remaining.saturating_add(permits), ..*quota });
                    }
                    continue;
                }
                RuleResult::Acquired(quota, _) | RuleResult::Untaken(quota) => {
                    rules.push((rule, RuleOutcome::Allowed));
                    quota
                }
                RuleResult::Rejected { quota, .. } if shadow => {
                    rules.push((rule, RuleOutcome::ShadowRejected));
                    report.shadow_rejected_by = report.shadow_rejected_by.or(Some(rule));
                    quota
                }
                RuleResult::Rejected { quota, delay_ms, local: by_block } => {
                    report.rejected_by = report.rejected_by.or(Some(rule));
                    rules.push((rule, if *by_block { RuleOutcome::LocallyRejected } else { RuleOutcome::Rejected }));
                    local |= *by_block;
                    if let Some(ms) = *delay_ms {
                        report.retry_ms = Some(report.retry_ms.map_or(ms, |d| d.max(ms)));
                    }
                    quota
                }
                RuleResult::Denied if shadow => {
                    rules.push((rule, RuleOutcome::ShadowRejected));
                    report.shadow_rejected_by = report.shadow_rejected_by.or(Some(rule));
                    continue;
                }
                RuleResult::Denied => {
                    report.rejected_by = report.rejected_by.or(Some(rule));
                    rules.push((rule, RuleOutcome::Rejected));
                    continue;
                }
                // A rule the local windows decide counts as they decide (the filter adds its outcome); one
                // they do not (a shadow rule, or the request is rejected anyway) counts as failed.
                RuleResult::Failed | RuleResult::Skipped => {
                    let skipped = matches!(result, RuleResult::Skipped);
                    match name.filter(|_| !shadow && (decides_locally || skipped)) {
                        Some(name) => local_rules.push((rule, name.clone())),
                        None => rules.push((rule, RuleOutcome::Failed)),
                    }
                    // A shadow rule's failure is counted, and never decides the request.
                    failed |= !shadow && !skipped;
                    continue;
                }
            };
            if reported {
                report.quotas.push(*quota);
            }
        }
        let leases = lease_tickets(&self.calls, config);
        let decision = |verdict, outcome, rules, give_back, local| Decision {
            verdict,
            outcome,
            redis_failed: self.redis_failed,
            rules,
            leases,
            give_back,
            local,
        };
        if report.rejected_by.is_some() {
            rules.extend(local_rules.iter().map(|(rule, _)| (*rule, RuleOutcome::Failed)));
            let verdict = Verdict::Respond {
                status: config.rejection.status,
                report,
                rate_limited: true,
                body: Rc::clone(&plan.rejection_body),
            };
            let outcome = if local { Outcome::LocallyRejected } else { Outcome::Rejected };
            return decision(verdict, outcome, rules, self.give_back(config), Vec::new());
        }
        if !local_rules.is_empty() {
            // What the rules Redis decided took is given back if a local window refuses.
            let verdict = Verdict::Continue { report };
            return decision(verdict, Outcome::Local, rules, self.give_back(config), local_rules);
        }
        if !failed {
            let outcome = if any { Outcome::Allowed } else { Outcome::Unlimited };
            return decision(Verdict::Continue { report }, outcome, rules, Vec::new(), Vec::new());
        }
        match config.failure_mode {
            // Local: a failed rule without a limiter name (none is made for it) fails open.
            FailureMode::Allow | FailureMode::Local => {
                decision(Verdict::Continue { report }, Outcome::FailedOpen, rules, Vec::new(), Vec::new())
            }
            FailureMode::Deny => {
                let verdict = Verdict::Respond {
                    status: config.failure_status,
                    report: Report::default(),
                    rate_limited: false,
                    body: Rc::clone(&plan.failure_body),
                };
                decision(verdict, Outcome::FailedClosed, rules, self.give_back(config), Vec::new())
            }
        }
    }

    /// The members the rules that acquired added in Redis, to give back.
    fn give_back(&self, config: &PluginConfig) -> Vec<GiveBack> {
        self.calls
            .iter()
            .filter_map(|call| {
                let CallState::Done(RuleResult::Acquired(_, Taken::Member { granted })) = &call.state else {
                    return None;
                };
                config.rules.get(call.rule)?;
                let settlement = Settlement { random: call.member_random, granted: *granted, used: 0, early_ms: 0 };
                Some(GiveBack { name: call.name.clone(), settlement })
            })
            .collect()
    }
}

/// What a reply arrives with besides its bytes: the configuration, its plan, and the time.
pub struct ReplyContext<'a> {
    /// The validated plugin configuration.
    pub config: &'a PluginConfig,
    /// The configuration's plan.
    pub plan: &'a Plan,
    /// Now, ms since the epoch (gateway clock).
    pub now_ms: u64,
}

/// One rule's result from its part of a reply, and the lease Redis granted it; the notice and block it
/// teaches go to `effects`.
fn call_result(
    call: &RuleCall,
    rule: &Rule,
    reply: &AcquireReply,
    now_ms: u64,
    cache: &mut LimiterCache,
    effects: &mut Effects,
) -> (RuleResult, Option<LeaseGrant>) {
    let configured =
        EffectiveConfig { rate: rule.rate, interval_ms: rule.interval_ms, limiter_type: rule.limiter_type };
    let effective = reply.effective.unwrap_or(configured);
    if let Some(held) = reply.effective {
        // Only replies whose config is not the rule's carry one: the cache says whether it is news.
        let noticed = matches!(cache.observe(&call.name, held), Observation::New | Observation::Changed(_));
        let limiter = || call.name.clone();
        let notice = match reply.change {
            ConfigChange::Updated => {
                Some(Notice::ConfigApplied { rule: rule.name.clone(), limiter: limiter(), effective })
            }
            _ if !noticed || held == configured => None,
            ConfigChange::Kept => Some(Notice::ConfigKept { rule: rule.name.clone(), limiter: limiter(), effective }),
            _ if reply.outcome == AcquireOutcome::ExceedsRate => {
                Some(Notice::ExceedsRate { rule: rule.name.clone(), limiter: limiter() })
            }
            _ => Some(Notice::ConfigDiffers { rule: rule.name.clone(), limiter: limiter(), effective }),
        };
        effects.notices.extend(notice);
    }
    let quota = |remaining, reset_ms| RuleQuota {
        rule: call.rule,
        limit: effective.rate,
        window_ms: effective.interval_ms,
        remaining,
        reset_ms,
    };
    let result = match reply.outcome {
        // The quota is whole again when every permit now in the window has left it.
        AcquireOutcome::Acquired { remaining } => {
            let granted = reply.granted.unwrap_or(rule.permits);
            match call.lease {
                Some(lease) if granted > rule.permits => {
                    let expires_ms = call.sent_ms.saturating_add(lease.max_age_ms);
                    let grant = LeaseGrant {
                        random: call.member_random,
                        granted,
                        used: rule.permits,
                        outstanding: rule.permits,
                        expires_ms,
                        last_use_ms: now_ms.min(expires_ms),
                        redis_remaining: remaining,
                    };
                    let left = remaining.saturating_add(granted - rule.permits);
                    let taken = Taken::Lease { random: call.member_random };
                    return (RuleResult::Acquired(quota(left, effective.interval_ms), taken), Some(grant));
                }
                _ => RuleResult::Acquired(quota(remaining, effective.interval_ms), Taken::Member { granted }),
            }
        }
        AcquireOutcome::Untaken { available } => RuleResult::Untaken(quota(available, effective.interval_ms)),
        AcquireOutcome::Rejected { delay_ms } => {
            // The oldest permit leaves 3 ms before Redisson's delay ends (DESIGN.md, tryAcquire).
            let leaves = call.sent_ms.saturating_add(delay_ms).saturating_sub(3);
            let until_ms = leaves.min(call.sent_ms.saturating_add(rule.local_block_max_ms));
            if rule.local_block_max_ms > 0 && until_ms > call.sent_ms {
                // Without the count, the rejected request's own need bounds it: fewer than `permits` are
                // free, so a request for `permits` or more is what Redis would reject.
                let block = Block {
                    until_ms,
                    release_ms: leaves,
                    available: reply.available.unwrap_or(rule.permits.saturating_sub(1)),
                    rate: effective.rate,
                    interval_ms: effective.interval_ms,
                };
                effects.blocks.push((call.name.clone(), block));
            }
            RuleResult::Rejected { quota: quota(0, delay_ms), delay_ms: Some(delay_ms), local: false }
        }
        // No wait grants it: report a whole window rather than "retry now" (t=0).
        AcquireOutcome::ExceedsRate => {
            RuleResult::Rejected { quota: quota(0, effective.interval_ms), delay_ms: None, local: false }
        }
    };
    (result, None)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing, clippy::panic)]
    use super::*;
    use crate::key::tests::FakeRequest;
    use crate::lease::LeaseTable;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    const NOW: u64 = 1_000_000;

    #[test]
    fn the_fullest_reply_leaves_room_for_its_content_type() {
        // Every header a reply can carry: Retry-After, both styles of rate limit headers for two rules, and
        // x-envoy-ratelimited, x-ratelimited-by, x-shadow-ratelimited-by; the filter adds content-type.
        // `Headers` holds MAX_HEADERS and would panic past it.
        let json = r#"{"redis":{"cluster":"webdis"},"rate_limit_headers":"both","shadow_headers":true,"rules":[
            {"name":"a","limit_by":{"header":"x-a"},"rate":5,"interval":"2s"},
            {"name":"b","limit_by":{"header":"x-b"},"rate":9,"interval":"1m"}]}"#;
        let config = PluginConfig::from_json(json.as_bytes()).unwrap();
        let plan = Plan::new(&config, "client");
        let quota = |rule, limit, window_ms| RuleQuota { rule, limit, window_ms, remaining: 0, reset_ms: 900 };
        let report = Report {
            quotas: [quota(0, 5, 2_000), quota(1, 7, 60_000)].into_iter().collect(),
            retry_ms: Some(900),
            rejected_by: Some(0),
            shadow_rejected_by: Some(1),
        };
        let verdict = Verdict::Respond { status: 429, report, rate_limited: true, body: "no".into() };
        assert_eq!(verdict.headers(&config, &plan).len(), crate::response::MAX_HEADERS - 1);
    }

    fn config(extra_rule: &str, top: &str) -> PluginConfig {
        let json = format!(
            r#"{{"redis":{{"cluster":"webdis"}},"rules":[{{"name":"per-user","limit_by":{{"header":"x-user"}},"rate":5,"interval":"2s"{extra_rule}}}]{top}}}"#
        );
        PluginConfig::from_json(json.as_bytes()).unwrap()
    }

    /// Blocks kept in a list, as the shared data slots would hold them.
    #[derive(Default)]
    struct ListedBlocks(Vec<(String, Block)>);

    impl Blocks for ListedBlocks {
        fn rejecting(&self, name: &str, now_ms: u64, permits: u64) -> Option<Block> {
            self.0
                .iter()
                .find(|(n, b)| n == name && now_ms < b.until_ms)
                .map(|(_, b)| *b)
                .filter(|b| permits > b.available)
        }
    }

    struct Harness {
        config: PluginConfig,
        plan: Plan,
        cache: LimiterCache,
        blocks: ListedBlocks,
        leases: LeaseTable,
        counter: u8,
        now_ms: u64,
    }

    impl Harness {
        fn new(config: PluginConfig) -> Self {
            Harness {
                cache: LimiterCache::new(config.cache_size, [3, 4]),
                plan: Plan::new(&config, "cid"),
                config,
                blocks: ListedBlocks::default(),
                leases: LeaseTable::default(),
                counter: 0,
                now_ms: NOW,
            }
        }

        fn start(&mut self, headers: &[(&str, &str)]) -> Start {
            let ctx = Context {
                config: &self.config,
                plan: &self.plan,
                now_ms: self.now_ms,
                blocks: &self.blocks,
                leases: &self.leases,
                skip_redis: false,
            };
            let counter = &mut self.counter;
            let mut name = String::new();
            start(
                &ctx,
                &FakeRequest::with(headers),
                &mut || {
                    *counter += 1;
                    [*counter; MEMBER_RANDOM_LEN]
                },
                &mut name,
            )
        }

        /// The response headers of a decision, rendered.
        fn headers(&self, decision: &Decision) -> Headers {
            decision.verdict.headers(&self.config, &self.plan)
        }

        /// The command of a call as its arguments (webdis form decoded back into words).
        fn words(&self, pending: &PendingRequest, call: usize, invocation: Invocation) -> Vec<String> {
            let body = pending.encode(call, invocation, Encoding::WebdisPath, &self.plan).unwrap();
            let text = String::from_utf8(body).unwrap();
            text.trim_end_matches(".raw")
                .split('/')
                .map(|word| percent_encoding::percent_decode_str(word).decode_utf8_lossy().into_owned())
                .collect()
        }

        /// A reply as it comes, and what it teaches (nothing recorded).
        fn raw(
            &mut self,
            pending: &mut PendingRequest,
            call: usize,
            reply: Result<&[u8], Failure>,
        ) -> (Progress, Effects) {
            let ctx = ReplyContext { config: &self.config, plan: &self.plan, now_ms: self.now_ms };
            pending.on_reply(call, reply, &ctx, &mut self.cache)
        }

        fn reply(&mut self, pending: &mut PendingRequest, call: usize, reply: Result<&[u8], Failure>) -> Progress {
            self.reply_with_effects(pending, call, reply).0
        }

        /// A reply, with its blocks and leases recorded; also what it teaches.
        fn reply_with_effects(
            &mut self,
            pending: &mut PendingRequest,
            call: usize,
            reply: Result<&[u8], Failure>,
        ) -> (Progress, Effects) {
            let ctx = ReplyContext { config: &self.config, plan: &self.plan, now_ms: self.now_ms };
            let (progress, effects) = pending.on_reply(call, reply, &ctx, &mut self.cache);
            self.blocks.0.extend(effects.blocks.iter().cloned());
            for LeaseEnd { name, grant, settled } in &effects.leases {
                self.leases.end(name, *grant, *settled);
            }
            (progress, effects)
        }
    }

    /// `{code, amount, available, rate, interval, type, change, taken}` (the full reply).
    fn full_reply(code: i64, amount: i64, available: i64, rate: i64, change: i64) -> Vec<u8> {
        let items = [code, amount, available, rate, 2000, 0, change, i64::from(code == 1)];
        let mut out = format!("*{}\r\n", items.len()).into_bytes();
        for item in items {
            out.extend(format!(":{item}\r\n").bytes());
        }
        out
    }

    fn acquired(remaining: i64) -> Vec<u8> {
        format!(":{remaining}\r\n").into_bytes()
    }

    /// A rejection with the config as sent: minus Redisson's delay.
    fn rejected(delay: i64) -> Vec<u8> {
        format!(":-{delay}\r\n").into_bytes()
    }

    fn sent(start: Start) -> PendingRequest {
        match start {
            Start::Send(pending, _) => pending,
            Start::Decided(decision) => panic!("expected commands, got {decision:?}"),
        }
    }

    fn decided(start: Start) -> Decision {
        match start {
            Start::Decided(decision) => decision,
            Start::Send(..) => panic!("expected a decision without Redis"),
        }
    }

    fn done(progress: Progress) -> Decision {
        match progress {
            Progress::Done(decision) => decision,
            other => panic!("expected a decision, got {other:?}"),
        }
    }

    fn header<'a>(headers: &'a Headers, name: &str) -> Option<&'a str> {
        headers.iter().find(|(k, _)| *k == name).map(|(_, v)| &**v)
    }

    #[test]
    fn an_acquired_permit_continues_with_rate_limit_headers() {
        let mut h = Harness::new(config("", ""));
        let mut pending = sent(h.start(&[("x-user", "alice")]));
        let words = h.words(&pending, 0, Invocation::BySha);
        assert_eq!(words[0], "EVALSHA");
        assert_eq!(words[3], "erl:per-user:alice");
        let decision = done(h.reply(&mut pending, 0, Ok(&acquired(4))));
        assert_eq!(decision.outcome, Outcome::Allowed);
        let response_headers = h.headers(&decision);
        assert!(matches!(decision.verdict, Verdict::Continue { .. }));
        assert_eq!(header(&response_headers, "ratelimit"), Some("\"per-user\";r=4;t=2"), "t: the window length");
        assert_eq!(header(&response_headers, "ratelimit-policy"), Some("\"per-user\";q=5;w=2"));
    }

    #[test]
    fn a_rejection_answers_with_status_retry_after_and_body_and_leaves_a_block() {
        let mut h = Harness::new(config("", ""));
        let mut pending = sent(h.start(&[("x-user", "alice")]));
        let decision = done(h.reply(&mut pending, 0, Ok(&rejected(1503))));
        assert_eq!(decision.outcome, Outcome::Rejected);
        let headers = h.headers(&decision);
        let Verdict::Respond { status, body, .. } = decision.verdict else { panic!() };
        assert_eq!(status, 429);
        assert_eq!(&*body, "rate limit exceeded\n");
        assert_eq!(header(&headers, "retry-after"), Some("2"));
        assert_eq!(header(&headers, "x-envoy-ratelimited"), Some("true"));
        assert_eq!(header(&headers, "ratelimit"), Some("\"per-user\";r=0;t=2"));
        let block = Block { until_ms: NOW + 1500, release_ms: NOW + 1500, available: 0, rate: 5, interval_ms: 2000 };
        assert_eq!(h.blocks.0, vec![("erl:per-user:alice".to_string(), block)], "until the oldest permit leaves");
        let mut h = Harness::new(config(r#","permits":3"#, ""));
        let mut pending = sent(h.start(&[("x-user", "alice")]));
        done(h.reply(&mut pending, 0, Ok(&full_reply(0, 1503, 1, 5, 0))));
        assert_eq!(h.blocks.0[0].1.available, 1, "the full reply says how many are free");
    }

    #[test]
    fn a_blocked_limiter_rejects_what_redis_would_reject_and_nothing_else() {
        let mut h = Harness::new(config(r#","permits":2"#, ""));
        let mut pending = sent(h.start(&[("x-user", "alice")]));
        done(h.reply(&mut pending, 0, Ok(&rejected(1503))));
        h.now_ms = NOW + 1000;
        let decision = decided(h.start(&[("x-user", "alice")]));
        assert_eq!(decision.outcome, Outcome::LocallyRejected, "2 permits needed, 1 available: no Redis call");
        let headers = h.headers(&decision);
        let Verdict::Respond { status, .. } = decision.verdict else { panic!() };
        assert_eq!(status, 429);
        assert_eq!(header(&headers, "retry-after"), Some("1"), "503 ms: from the remaining time");
        assert_eq!(header(&headers, "ratelimit"), Some("\"per-user\";r=0;t=1"));
        assert_eq!(header(&headers, "ratelimit-policy"), Some("\"per-user\";q=5;w=2"));
        assert!(matches!(h.start(&[("x-user", "bob")]), Start::Send(..)), "another limiter goes to Redis");
        h.now_ms = NOW + 1500;
        assert!(matches!(h.start(&[("x-user", "alice")]), Start::Send(..)), "the oldest permit left: Redis again");

        let mut smaller = Harness::new(config(r#","permits":1"#, ""));
        smaller.blocks.0.push((
            "erl:per-user:alice".into(),
            Block { until_ms: NOW + 900, release_ms: NOW + 900, available: 1, rate: 5, interval_ms: 2000 },
        ));
        assert!(matches!(smaller.start(&[("x-user", "alice")]), Start::Send(..)), "1 permit wanted, 1 available");
    }

    #[test]
    fn a_block_lasts_at_most_local_block_max_and_zero_turns_it_off() {
        let mut h = Harness::new(config(r#","local_block_max":"1s""#, ""));
        let mut pending = sent(h.start(&[("x-user", "alice")]));
        done(h.reply(&mut pending, 0, Ok(&rejected(1503))));
        assert_eq!(h.blocks.0[0].1.until_ms, NOW + 1000);
        h.now_ms = NOW + 400;
        let decision = decided(h.start(&[("x-user", "alice")]));
        assert!(matches!(decision.verdict, Verdict::Respond { .. }));
        let headers = h.headers(&decision);
        assert_eq!(header(&headers, "retry-after"), Some("2"), "Redis's delay (1103 ms), not the block's end");
        let mut off = Harness::new(config(r#","local_block_max":0"#, ""));
        let mut pending = sent(off.start(&[("x-user", "alice")]));
        done(off.reply(&mut pending, 0, Ok(&rejected(1503))));
        assert!(off.blocks.0.is_empty());
        off.blocks.0.push((
            "erl:per-user:alice".into(),
            Block { until_ms: NOW + 900, release_ms: NOW + 900, available: 0, rate: 5, interval_ms: 2000 },
        ));
        assert!(matches!(off.start(&[("x-user", "alice")]), Start::Send(..)), "no lookup either");
    }

    #[test]
    fn noscript_is_retried_once_by_source_then_fails() {
        let mut h = Harness::new(config("", ""));
        let mut pending = sent(h.start(&[("x-user", "alice")]));
        let noscript = b"-NOSCRIPT No matching script. Please use EVAL.\r\n";
        let Progress::Resend(0) = h.reply(&mut pending, 0, Ok(noscript)) else { panic!() };
        assert_eq!(h.words(&pending, 0, Invocation::BySource)[0], "EVAL");
        let decision = done(h.reply(&mut pending, 0, Ok(noscript)));
        assert_eq!(decision.outcome, Outcome::FailedOpen);
    }

    #[test]
    fn failures_follow_the_failure_mode() {
        for (top, outcome, status) in [
            ("", Outcome::FailedOpen, None),
            (r#","failure_mode":"deny","failure_status":500"#, Outcome::FailedClosed, Some(500)),
        ] {
            let mut h = Harness::new(config("", top));
            for failure in [Failure::NoReply, Failure::BridgeStatus(503), Failure::SendRefused("BadArgument".into())] {
                let mut pending = sent(h.start(&[("x-user", "alice")]));
                let (progress, effects) = h.reply_with_effects(&mut pending, 0, Err(failure.clone()));
                let decision = done(progress);
                assert_eq!(decision.outcome, outcome);
                assert!(decision.redis_failed);
                assert_eq!(effects.call_failure, Some(failure));
                match (decision.verdict, status) {
                    (Verdict::Continue { .. }, None) => {}
                    (Verdict::Respond { status: got, .. }, Some(want)) => assert_eq!(got, want),
                    (verdict, _) => panic!("{verdict:?}"),
                }
            }
            let mut pending = sent(h.start(&[("x-user", "alice")]));
            let (_, effects) = h.reply_with_effects(&mut pending, 0, Ok(b"-NOAUTH Authentication required.\r\n"));
            assert_eq!(effects.call_failure, Some(Failure::RedisError("NOAUTH Authentication required.".into())));
            let mut pending = sent(h.start(&[("x-user", "alice")]));
            let (_, effects) = h.reply_with_effects(&mut pending, 0, Ok(b"<html>"));
            assert!(matches!(effects.call_failure, Some(Failure::BadReply(_))));
        }
    }

    #[test]
    fn missing_keys_skip_deny_or_share() {
        let mut skip = Harness::new(config("", ""));
        assert_eq!(decided(skip.start(&[])).outcome, Outcome::Unlimited);
        let mut deny = Harness::new(config(r#","on_missing":"deny""#, ""));
        let decision = decided(deny.start(&[]));
        assert_eq!(decision.outcome, Outcome::Rejected);
        assert!(matches!(decision.verdict, Verdict::Respond { status: 429, .. }));
        let mut share = Harness::new(config(r#","on_missing":"share""#, ""));
        let pending = sent(share.start(&[]));
        assert_eq!(share.words(&pending, 0, Invocation::BySha)[3], "erl:per-user:~");
    }

    #[test]
    fn more_permits_than_the_rate_are_rejected_without_retry_after_and_asked_again_next_time() {
        let mut h = Harness::new(config(r#","permits":3"#, ""));
        let mut pending = sent(h.start(&[("x-user", "alice")]));
        let (progress, effects) = h.raw(&mut pending, 0, Ok(&full_reply(2, 0, 0, 2, 0)));
        let decision = done(progress);
        assert_eq!(decision.outcome, Outcome::Rejected);
        assert!(matches!(decision.verdict, Verdict::Respond { .. }));
        let headers = h.headers(&decision);
        assert_eq!(header(&headers, "retry-after"), None, "no wait can grant more permits than the rate");
        assert_eq!(header(&headers, "ratelimit-policy"), Some("\"per-user\";q=2;w=2"));
        assert_eq!(header(&headers, "ratelimit"), Some("\"per-user\";r=0;t=2"), "not t=0: retrying now is futile");
        assert!(matches!(effects.notices.first(), Some(Notice::ExceedsRate { .. })));
        assert_eq!(effects.blocks.first(), None, "no block: a rate raised in Redis must be seen at once");
        assert!(matches!(h.start(&[("x-user", "alice")]), Start::Send(..)));
    }

    #[test]
    fn a_different_rate_in_redis_is_noticed_once_per_limiter() {
        let mut h = Harness::new(config("", ""));
        let mut notices = Vec::new();
        for _ in 0..3 {
            let mut pending = sent(h.start(&[("x-user", "alice")]));
            notices.push(h.raw(&mut pending, 0, Ok(&full_reply(1, 0, 0, 1, 0))).1.notices.first().cloned());
        }
        assert!(matches!(notices[0], Some(Notice::ConfigDiffers { .. })));
        assert_eq!(notices[1..], [None, None]);
        let mut pending = sent(h.start(&[("x-user", "bob")]));
        assert_eq!(h.raw(&mut pending, 0, Ok(&acquired(4))).1.notices.first().cloned(), None);
    }

    #[test]
    fn with_the_config_winning_every_acquire_lets_redis_decide_and_changes_are_noticed() {
        let mut h = Harness::new(config(r#","rate_source":"config""#, ""));
        let mut pending = sent(h.start(&[("x-user", "alice")]));
        assert_eq!(
            h.words(&pending, 0, Invocation::BySha)[15],
            "1",
            "the acquire asks Redis to apply the rule's config"
        );
        let (_, effects) = h.raw(&mut pending, 0, Ok(&full_reply(1, 4, 4, 5, 2)));
        assert!(matches!(effects.notices.first(), Some(Notice::ConfigApplied { .. })), "{effects:?}");
        let mut pending = sent(h.start(&[("x-user", "alice")]));
        assert_eq!(h.words(&pending, 0, Invocation::BySha)[15], "1", "again: whether to apply is Redis's record");
        let (_, effects) = h.raw(&mut pending, 0, Ok(&full_reply(1, 4, 4, 9, 3)));
        assert!(matches!(effects.notices.first(), Some(Notice::ConfigKept { .. })), "{effects:?}");
        let mut redis_wins = Harness::new(config("", ""));
        let pending = sent(redis_wins.start(&[("x-user", "alice")]));
        assert_eq!(redis_wins.words(&pending, 0, Invocation::BySha)[15], "0");
    }

    /// Two rules whose limiters are in different hash slots of a Redis Cluster: one call each.
    fn two_rules(top: &str) -> PluginConfig {
        let json = format!(
            r#"{{"redis":{{"cluster":"w","redis_cluster":true}},"rules":[
            {{"name":"a","limit_by":"global","rate":5,"interval":1000}},
            {{"name":"b","limit_by":"client_ip","rate":5,"interval":1000}}]{top}}}"#
        );
        PluginConfig::from_json(json.as_bytes()).unwrap()
    }

    #[test]
    fn several_rules_wait_for_every_reply_and_any_rejection_wins() {
        let mut h = Harness::new(two_rules(""));
        let mut pending = sent(h.start(&[]));
        assert_ne!(
            h.words(&pending, 0, Invocation::BySha)[9],
            h.words(&pending, 1, Invocation::BySha)[9],
            "members differ"
        );
        assert!(matches!(h.reply(&mut pending, 1, Ok(&rejected(900))), Progress::Waiting));
        assert!(matches!(h.reply(&mut pending, 1, Ok(&acquired(1))), Progress::Waiting), "a second reply is ignored");
        let decision = done(h.reply(&mut pending, 0, Err(Failure::NoReply)));
        assert_eq!(decision.outcome, Outcome::Rejected);
        assert!(matches!(decision.verdict, Verdict::Respond { .. }));
        let headers = h.headers(&decision);
        assert_eq!(header(&headers, "retry-after"), Some("1"));
    }

    #[test]
    fn a_rejection_still_reports_the_failures_of_other_rules() {
        let mut h = Harness::new(two_rules(""));
        let mut pending = sent(h.start(&[]));
        assert!(matches!(h.reply(&mut pending, 0, Ok(&rejected(900))), Progress::Waiting));
        let (progress, effects) = h.reply_with_effects(&mut pending, 1, Err(Failure::NoReply));
        let decision = done(progress);
        assert_eq!(decision.outcome, Outcome::Rejected);
        assert!(decision.redis_failed && effects.failed(), "the failure is counted and logged too");
    }

    #[test]
    fn an_expired_request_fails_its_waiting_calls_and_keeps_what_arrived() {
        let mut h = Harness::new(two_rules(r#","failure_mode":"deny""#));
        let mut pending = sent(h.start(&[]));
        assert!(matches!(h.reply(&mut pending, 0, Ok(&acquired(4))), Progress::Waiting));
        let (decision, unanswered) = pending.expire(&h.config, &h.plan);
        assert_eq!(decision.outcome, Outcome::FailedClosed);
        assert!(decision.redis_failed);
        assert_eq!(unanswered, 1, "the one call still waiting failed");
    }

    #[test]
    fn a_blocked_rule_rejects_the_request_before_any_other_rule_spends_a_permit() {
        let mut h = Harness::new(two_rules(""));
        h.blocks.0.push((
            "erl:a".into(),
            Block { until_ms: NOW + 400, release_ms: NOW + 400, available: 0, rate: 5, interval_ms: 1000 },
        ));
        let decision = decided(h.start(&[]));
        assert_eq!(decision.outcome, Outcome::LocallyRejected);
        assert!(matches!(decision.verdict, Verdict::Respond { .. }));
        let headers = h.headers(&decision);
        assert_eq!(header(&headers, "ratelimit"), Some("\"a\";r=0;t=1"), "only the blocked rule is known");
    }

    /// A global rule with a lease of up to 8 permits for 1 s, and a per-user rule of rate 1.
    fn leased_and_per_user(redis: &str) -> PluginConfig {
        let json = format!(
            r#"{{"redis":{{"cluster":"w"{redis}}},"rules":[
            {{"name":"hot","limit_by":"global","rate":100,"interval":60000,"lease":{{"max_permits":8,"max_age":"1s"}}}},
            {{"name":"per-user","limit_by":{{"header":"x-user"}},"rate":1,"interval":60000}}]}}"#
        );
        PluginConfig::from_json(json.as_bytes()).unwrap()
    }

    /// ACQUIRE_ALL's reply: 8 integers per limiter.
    fn all_reply(limiters: &[[i64; 8]]) -> Vec<u8> {
        let mut out = format!("*{}\r\n", 8 * limiters.len()).into_bytes();
        for number in limiters.iter().flatten() {
            out.extend(format!(":{number}\r\n").bytes());
        }
        out
    }

    #[test]
    fn one_call_for_every_rule_and_a_lease_serves_the_next_requests_until_another_rule_rejects() {
        let mut h = Harness::new(leased_and_per_user(""));
        let mut pending = sent(h.start(&[("x-user", "alice")]));
        let words = h.words(&pending, 0, Invocation::BySha);
        assert_eq!(words[0], "EVALSHA");
        assert_eq!(words[1], crate::script::ACQUIRE_ALL.sha(), "both rules in one call");
        assert_eq!(words[2], "10");
        assert_eq!(words[14], "0", "fail open: an error on one limiter's keys does not stop the other's charge");
        assert_eq!(words[16..18], ["1".to_string(), "100".to_string()], "the lease rule's permits and rate");
        assert_eq!(words[22], "8", "asks for a lease of up to 8");
        // Both admit: the lease took 8 (7 left for this VM), per-user 1.
        let reply = all_reply(&[[1, 92, 92, 100, 60_000, 0, 1, 8], [1, 0, 0, 1, 60_000, 0, 1, 1]]);
        let decision = done(h.reply(&mut pending, 0, Ok(&reply)));
        assert_eq!(decision.outcome, Outcome::Allowed);
        assert!(decision.give_back.is_empty());
        // Bob: the lease serves the hot rule, per-user alone goes to Redis (ACQUIRE), and rejects.
        let mut pending = sent(h.start(&[("x-user", "bob")]));
        assert_eq!(h.words(&pending, 0, Invocation::BySha)[1], crate::script::ACQUIRE.sha(), "only per-user");
        let decision = done(h.reply(&mut pending, 0, Ok(&rejected(900))));
        assert_eq!(decision.outcome, Outcome::Rejected);
        assert_eq!(decision.rules.as_slice(), &[(0, RuleOutcome::Allowed), (1, RuleOutcome::Rejected)]);
        assert!(decision.give_back.is_empty(), "nothing taken in Redis");
        let lease_member = decision.leases[0].random;
        assert_eq!(decision.leases, vec![LeaseTicket { name: "erl:hot".into(), random: lease_member, permits: 1 }]);
        let headers = h.headers(&decision);
        assert_eq!(header(&headers, "x-ratelimited-by"), Some("per-user"));
    }

    #[test]
    fn in_a_redis_cluster_a_mixed_outcome_gives_back_the_member_the_request_added() {
        let mut h = Harness::new(two_rules(""));
        let mut pending = sent(h.start(&[]));
        let member_of_a = h.words(&pending, 0, Invocation::BySha)[9].clone();
        assert!(matches!(h.reply(&mut pending, 0, Ok(&acquired(4))), Progress::Waiting));
        let decision = done(h.reply(&mut pending, 1, Ok(&rejected(900))));
        assert_eq!(decision.outcome, Outcome::Rejected);
        match decision.give_back.as_slice() {
            [GiveBack { name, settlement }] => {
                assert_eq!(name, "erl:a");
                assert_eq!(settlement.random.to_vec(), member_of_a.into_bytes());
                assert_eq!((settlement.granted, settlement.used), (1, 0), "remove the whole member");
            }
            other => panic!("{other:?}"),
        }
        let headers = h.headers(&decision);
        assert_eq!(header(&headers, "x-ratelimited-by"), Some("b"));
        assert_eq!(header(&headers, "ratelimit"), Some("\"a\";r=5;t=1, \"b\";r=0;t=1"), "a's permit is given back");
    }

    #[test]
    fn each_rule_outcome_indexes_its_counter() {
        for (position, outcome) in RuleOutcome::ALL.iter().enumerate() {
            assert_eq!(*outcome as usize, position, "{outcome:?}");
        }
    }

    fn shadow_and_enforced(top: &str) -> PluginConfig {
        let json = format!(
            r#"{{"redis":{{"cluster":"w"}},"rules":[
            {{"name":"enforced","limit_by":"global","rate":5,"interval":1000}},
            {{"name":"trial","limit_by":{{"header":"x-user"}},"rate":5,"interval":1000,"mode":"shadow"}}]{top}}}"#
        );
        PluginConfig::from_json(json.as_bytes()).unwrap()
    }

    #[test]
    fn a_shadow_rule_is_asked_in_its_own_call_and_never_rejects() {
        let mut h = Harness::new(shadow_and_enforced(""));
        let Start::Send(mut pending, 2) = h.start(&[("x-user", "alice")]) else { panic!("two calls expected") };
        assert!(h.words(&pending, 0, Invocation::BySha).contains(&"erl:enforced".to_string()));
        assert!(h.words(&pending, 1, Invocation::BySha).contains(&"erl:trial:alice".to_string()));
        assert!(matches!(h.reply(&mut pending, 0, Ok(&acquired(4))), Progress::Waiting));
        let decision = done(h.reply(&mut pending, 1, Ok(&rejected(900))));
        assert_eq!(decision.outcome, Outcome::Allowed, "the shadow rule's rejection lets the request go on");
        assert!(decision.give_back.is_empty(), "the enforced rule keeps its permit");
        assert_eq!(decision.rules.as_slice(), &[(0, RuleOutcome::Allowed), (1, RuleOutcome::ShadowRejected)]);
        let Verdict::Continue { report } = &decision.verdict else { panic!("continues") };
        assert_eq!(report.shadow_rejected_by, Some(1));
        let headers = h.headers(&decision);
        assert_eq!(
            header(&headers, "ratelimit"),
            Some("\"enforced\";r=4;t=1"),
            "no shadow quota without shadow_headers"
        );
        assert_eq!(header(&headers, "x-shadow-ratelimited-by"), None);
        assert!(h.blocks.0.is_empty() || h.blocks.0.iter().all(|(n, _)| n == "erl:trial:alice"));
    }

    #[test]
    fn shadow_headers_show_the_shadow_quota_and_rule_and_a_local_block_spares_redis() {
        let mut h = Harness::new(shadow_and_enforced(r#","shadow_headers":true"#));
        let mut pending = sent(h.start(&[("x-user", "bob")]));
        assert!(matches!(h.reply(&mut pending, 0, Ok(&acquired(4))), Progress::Waiting));
        let decision = done(h.reply(&mut pending, 1, Ok(&rejected(900))));
        let headers = h.headers(&decision);
        assert_eq!(header(&headers, "x-shadow-ratelimited-by"), Some("trial"));
        assert_eq!(header(&headers, "ratelimit"), Some("\"enforced\";r=4;t=1, \"trial\";r=0;t=1"));
        // The shadow limiter is blocked now: the next request asks Redis for the enforced rule only.
        let Start::Send(pending, 1) = h.start(&[("x-user", "bob")]) else { panic!("one call expected") };
        assert!(!h.words(&pending, 0, Invocation::BySha).contains(&"erl:trial:bob".to_string()));
    }

    #[test]
    fn an_enforced_rejection_gives_back_what_a_shadow_rule_took_and_shadow_failures_never_decide() {
        let mut h = Harness::new(shadow_and_enforced(r#","failure_mode":"deny""#));
        let mut pending = sent(h.start(&[("x-user", "carol")]));
        assert!(matches!(h.reply(&mut pending, 1, Ok(&acquired(4))), Progress::Waiting));
        let decision = done(h.reply(&mut pending, 0, Ok(&rejected(500))));
        assert_eq!(decision.outcome, Outcome::Rejected);
        assert!(
            matches!(decision.give_back.as_slice(), [GiveBack { name, .. }] if name == "erl:trial:carol"),
            "as if enforced, the shadow limiter is charged only for requests that go on: {:?}",
            decision.give_back
        );
        let mut h = Harness::new(shadow_and_enforced(r#","failure_mode":"deny""#));
        let mut pending = sent(h.start(&[("x-user", "dave")]));
        assert!(matches!(h.reply(&mut pending, 0, Ok(&acquired(3))), Progress::Waiting));
        let (progress, effects) = h.reply_with_effects(&mut pending, 1, Err(Failure::NoReply));
        let decision = done(progress);
        assert_eq!(decision.outcome, Outcome::Allowed, "a shadow rule's failure does not fail the request closed");
        assert_eq!(effects.call_failure, Some(Failure::NoReply), "but it is counted");
        assert_eq!(decision.rules.as_slice(), &[(0, RuleOutcome::Allowed), (1, RuleOutcome::Failed)]);
    }

    #[test]
    fn global_shadow_mode_and_a_denied_missing_key_in_shadow() {
        let json = r#"{"redis":{"cluster":"w"},"mode":"shadow","rules":[
            {"name":"u","limit_by":{"header":"x-user"},"rate":5,"interval":1000,"on_missing":"deny"},
            {"name":"e","limit_by":"global","rate":5,"interval":1000,"mode":"enforce"}]}"#;
        let mut h = Harness::new(PluginConfig::from_json(json.as_bytes()).unwrap());
        assert_eq!(h.config.rules[0].mode, Mode::Shadow);
        assert_eq!(h.config.rules[1].mode, Mode::Enforce, "a rule's own mode wins");
        let mut pending = sent(h.start(&[]));
        let decision = done(h.reply(&mut pending, 0, Ok(&acquired(4))));
        assert_eq!(decision.outcome, Outcome::Allowed);
        assert_eq!(decision.rules.as_slice(), &[(0, RuleOutcome::ShadowRejected), (1, RuleOutcome::Allowed)]);
    }

    #[test]
    fn exemptions_skip_the_request_or_one_rule() {
        let json = r#"{"redis":{"cluster":"w"},"exempt":{"headers":{"x-internal":["yes"]}},"rules":[
            {"name":"u","limit_by":{"header":"x-user"},"rate":5,"interval":1000,"exempt":{"client_ips":["10.0.0.0/8"]}},
            {"name":"g","limit_by":"global","rate":5,"interval":1000}]}"#;
        let mut h = Harness::new(PluginConfig::from_json(json.as_bytes()).unwrap());
        let decision = decided(h.start(&[("x-internal", "yes"), ("x-user", "a")]));
        assert_eq!(decision.outcome, Outcome::Exempt);
        assert!(h.headers(&decision).is_empty());
        // FakeRequest comes from 10.0.0.7: rule u is exempt, rule g applies.
        let Start::Send(pending, 1) = h.start(&[("x-user", "a")]) else { panic!("one call expected") };
        assert!(h.words(&pending, 0, Invocation::BySha).contains(&"erl:g".to_string()));
        let request = FakeRequest::with(&[("x-user", "a")]);
        let applied = applications(&h.config, &request).unwrap();
        assert_eq!(applied[0].applies, Applies::Exempt);
        assert_eq!(applied[1].applies, Applies::Limiter { name: "erl:g".into() });
        assert!(applications(&h.config, &FakeRequest::with(&[("x-internal", "yes")])).is_none());
    }

    #[test]
    fn rates_by_value_pick_the_first_matching_entry_and_its_rate() {
        let json = r#"{"redis":{"cluster":"w"},"rules":[
            {"name":"tenant","limit_by":[{"header":"x-tenant"},"path"],"rate":5,"interval":1000,
             "rates_by_value":[{"values":["gold:/api"],"rate":100},{"values":["silver:/api","gold:/api"],"rate":20,"interval":"2s"}]},
            {"name":"net","limit_by":{"client_ip":{"ipv4_prefix":24}},"rate":7,"interval":1000}]}"#;
        let config = PluginConfig::from_json(json.as_bytes()).unwrap();
        assert_eq!(config.rules.len(), 4, "two value entries, the default, and the second rule");
        let look = |tenant: &str, path: &str| {
            let request = FakeRequest::with(&[("x-tenant", tenant), (":path", path)]);
            let applied = applications(&config, &request).unwrap();
            let first = &applied[0];
            let rule = &config.rules[first.entry];
            (first.applies.clone(), rule.rate, rule.interval_ms, applied[1].applies.clone())
        };
        let limiter = |name: &str| Applies::Limiter { name: name.into() };
        assert_eq!(look("gold", "/api"), (limiter("erl:tenant:gold:/api"), 100, 1000, limiter("erl:net:10.0.0.0/24")));
        assert_eq!(look("silver", "/api?x=1").1, 20);
        assert_eq!(look("silver", "/api").2, 2000);
        assert_eq!(look("bronze", "/api").1, 5, "no match: the rule's own rate");
        assert_eq!(look("a:b", "/c").0, limiter("erl:tenant:~YTpi:/c"), "a part with `:` is encoded");
        let mut h = Harness::new(config.clone());
        let pending = sent(h.start(&[("x-tenant", "gold"), (":path", "/api")]));
        let words = h.words(&pending, 0, Invocation::BySha);
        assert!(words.contains(&"100".to_string()), "the entry's rate is sent: {words:?}");
    }
}
