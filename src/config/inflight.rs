//! In-flight rules: `rules[n]` with `max_in_flight` (docs/configuration.md, "In-flight limits"): at most N
//! requests of a key running at once across every gateway, each holding a permit of a semaphore in
//! Redisson's `RPermitExpirableSemaphore` layout (docs/redisson.md, "Semaphores") until its response ends.

use crate::prelude::*;

use crate::key::{extract, write_limiter_name, KeySource, KeyValue, RequestView};
use crate::matching::Exemption;
use crate::quote::quoted;

use super::reader::{DurationMs, Object};
use super::validate::read_exemption;
use super::{ConfigError, Mode, OnMissing};

const INFLIGHT_FIELDS: &[&str] =
    &["name", "limit_by", "max_in_flight", "lease", "retry_after", "limiter", "on_missing", "mode", "exempt"];

/// Largest `max_in_flight`: a semaphore's free permits are a Redis integer, but a gateway holding a
/// million requests at once of one key is a configuration error.
const MAX_IN_FLIGHT: u64 = 1_000_000;

/// Default `lease`: how long a dead gateway's permits stay taken (30 s); the gateway extends the leases of
/// its running requests from its tick.
const DEFAULT_LEASE_MS: u64 = 30_000;

/// Shortest and longest `lease`: the tick extends each lease every third of it, so a lease much shorter
/// than a second would cost a Redis call every few ticks; a day bounds what a dead gateway holds.
const MIN_LEASE_MS: u64 = 300;
const MAX_LEASE_MS: u64 = 86_400_000;

/// Default `retry_after`: an in-flight limit knows no reset time, so a rejection says this (1 s).
const DEFAULT_RETRY_AFTER_MS: u64 = 1_000;

/// An in-flight rule: at most `max_in_flight` requests of one key value at once, across every gateway.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InflightRule {
    /// The rule's name, `[A-Za-z0-9_-]+`, unique among all rules: in logs and `x-ratelimited-by`.
    pub name: String,
    /// Where the key value comes from (not the request body: the permit is taken with the headers).
    pub source: KeySource,
    /// Base of the semaphore names in Redis (default `erl:<name>`; the key value appended as for rates).
    pub limiter: String,
    /// Permits of each semaphore: requests of one key in flight at once.
    pub max_in_flight: u64,
    /// How long a permit stays taken without an extension, ms: what a dead gateway's permits cost.
    pub lease_ms: u64,
    /// `Retry-After` of a rejection, ms (rounded up to whole seconds in the header).
    pub retry_after_ms: u64,
    /// A request without a key value.
    pub on_missing: OnMissing,
    /// Enforce, or shadow (count and log, never reject).
    pub mode: Mode,
    /// Requests this rule does not apply to.
    pub exempt: Option<Exemption>,
}

/// How an in-flight rule meets a request ([`InflightRule::applies`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum InflightApplies {
    /// The rule's `exempt` matches: it does not apply.
    Exempt,
    /// No key value, `on_missing: "skip"` (or `"deny"` in shadow mode): it does not apply.
    NoKey,
    /// No key value, `on_missing: "deny"` in enforce mode: the request is refused.
    Denied,
    /// The request takes a permit of this semaphore.
    Semaphore {
        /// The semaphore's name (the limiter base with the key value, as a rate rule names its limiter).
        name: String,
    },
}

impl InflightRule {
    /// How this rule meets `request` (the configuration's own `exempt` aside): what the filter asks Redis
    /// for, and `erl-admin explain` reads.
    pub fn applies(&self, request: &impl RequestView) -> InflightApplies {
        if self.exempt.as_ref().is_some_and(|exempt| exempt.matches(request)) {
            return InflightApplies::Exempt;
        }
        let value = match (extract(&self.source, request), self.on_missing) {
            (KeyValue::Missing, OnMissing::Skip) => return InflightApplies::NoKey,
            (KeyValue::Missing, OnMissing::Deny) if self.mode == Mode::Enforce => return InflightApplies::Denied,
            (KeyValue::Missing, OnMissing::Deny) => return InflightApplies::NoKey,
            (KeyValue::Missing, OnMissing::Share) => KeyValue::Value(Vec::new()),
            (value, _) => value,
        };
        let mut name = String::new();
        if write_limiter_name(&self.limiter, &value, &mut name) {
            InflightApplies::Semaphore { name }
        } else {
            InflightApplies::NoKey
        }
    }
}

/// Whether `rule` (a `rules` entry) is an in-flight rule: it has `max_in_flight`.
pub(super) fn is_inflight(rule: &serde_json::Value) -> bool {
    rule.get("max_in_flight").is_some()
}

/// Reads an in-flight rule of a configuration whose `redis.timeout` is `timeout_ms`: its `lease` must be at
/// least 4 timeouts, so that an acquire answered within the timeout, and then an extension sent within a
/// third of the lease and answered within the timeout, land before the lease ends (else the permit would be
/// reclaimed while its request runs).
pub(super) fn read_inflight_rule(
    mut rule: Object<'_>,
    default_mode: Mode,
    timeout_ms: u64,
) -> Result<InflightRule, ConfigError> {
    let name = rule.required("name", Object::string)?;
    if name.is_empty() || !name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-') {
        return Err(rule.error("name", format!("{} must be non-empty and use only A-Z a-z 0-9 _ -", quoted(&name))));
    }
    let limit_by = rule.required("limit_by", |rule, name| Ok(rule.get(name)))?;
    let source = super::rules::read_key_source(limit_by).map_err(|why| rule.error("limit_by", why))?;
    if source.reads_body() {
        return Err(rule.error("limit_by", "an in-flight rule takes its permit with the headers: not from the body"));
    }
    let max_in_flight = rule.required("max_in_flight", Object::u64)?;
    if max_in_flight == 0 || max_in_flight > MAX_IN_FLIGHT {
        return Err(rule.error("max_in_flight", format!("must be between 1 and {MAX_IN_FLIGHT}")));
    }
    let lease_ms = rule.duration("lease")?.map_or(DEFAULT_LEASE_MS, |DurationMs(ms)| ms);
    if !(MIN_LEASE_MS..=MAX_LEASE_MS).contains(&lease_ms) {
        return Err(rule.error("lease", format!("must be between {MIN_LEASE_MS} ms and {MAX_LEASE_MS} ms (a day)")));
    }
    if lease_ms < timeout_ms.saturating_mul(4) {
        return Err(rule.error(
            "lease",
            format!("{lease_ms} ms must be at least 4 x redis.timeout ({timeout_ms} ms): an answer or an extension that takes the timeout must land before the lease ends"),
        ));
    }
    let retry_after_ms = rule.duration("retry_after")?.map_or(DEFAULT_RETRY_AFTER_MS, |DurationMs(ms)| ms);
    if retry_after_ms > MAX_LEASE_MS {
        return Err(rule.error("retry_after", format!("must be at most {MAX_LEASE_MS} ms (a day)")));
    }
    let limiter = match rule.string("limiter")? {
        Some(limiter) => super::validate::non_empty(&rule.path_of("limiter"), limiter)?,
        None => format!("erl:{name}"),
    };
    let on_missing = rule
        .choice("on_missing", &[("skip", OnMissing::Skip), ("deny", OnMissing::Deny), ("share", OnMissing::Share)])?
        .unwrap_or_default();
    let mode = rule.choice("mode", &[("enforce", Mode::Enforce), ("shadow", Mode::Shadow)])?.unwrap_or(default_mode);
    let exempt = rule.object("exempt")?.map(read_exemption).transpose()?;
    rule.finish(INFLIGHT_FIELDS)?;
    Ok(InflightRule { name, source, limiter, max_in_flight, lease_ms, retry_after_ms, on_missing, mode, exempt })
}
