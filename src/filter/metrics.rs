//! The filter's counters and histograms (docs/operating.md, "Metrics"), its once-per-cause failure log and its
//! once-per-limiter log of errors on a limiter's keys.

use crate::prelude::*;

use crate::block::fnv1a;
use crate::config::{FailureMode, PluginConfig};
use crate::host::{Host, LogLevel};
use crate::limiter::{LimiterError, Outcome, RuleOutcome};
use crate::transport::Failure;

use super::{log, Filter, NAME};

/// The counters of in-flight rules, `edge_rate_limiter.inflight_<name>` (docs/operating.md, "Metrics"),
/// defined only when a configuration has such a rule; in [`InflightCounter`] order.
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct InflightCounters([Option<u32>; 5]);

/// One of [`InflightCounters`].
#[derive(Debug, Clone, Copy)]
pub(super) enum InflightCounter {
    /// Permits taken by requests that went on.
    Admitted,
    /// Requests refused.
    Rejected,
    /// Requests a shadow rule would have refused.
    ShadowRejected,
    /// Permits given back.
    Released,
    /// Permits whose lease was extended.
    Extended,
}

impl InflightCounters {
    const NAMES: [&'static str; 5] = ["admitted", "rejected", "shadow_rejected", "released", "extended"];

    /// Defined if `any` configuration has in-flight rules, else none.
    pub(super) fn define(host: &impl Host, any: bool) -> Self {
        let counter =
            |name: &str| if any { host.define_counter(&format!("{NAME}.inflight_{name}")).ok() } else { None };
        InflightCounters(Self::NAMES.map(counter))
    }

    /// Adds `amount` to one counter.
    pub(super) fn count(&self, host: &impl Host, which: InflightCounter, amount: u64) {
        if let Some(Some(id)) = self.0.get(which as usize) {
            if amount > 0 {
                let _ = host.increment_counter(*id, amount);
            }
        }
    }
}

/// Counter ids, by the names in docs/operating.md, "Metrics". A counter the host refused to define is skipped.
#[derive(Debug, Default)]
pub(super) struct Metrics {
    allowed: Option<u32>,
    rejected: Option<u32>,
    local_rejected: Option<u32>,
    failure_allowed: Option<u32>,
    failure_denied: Option<u32>,
    redis_calls: Option<u32>,
    redis_errors: Option<u32>,
    host_errors: Option<u32>,
    leases: Option<u32>,
    lease_settlements: Option<u32>,
    lease_permits_lost: Option<u32>,
    compensations: Option<u32>,
    fallback_allowed: Option<u32>,
    fallback_rejected: Option<u32>,
    exempt: Option<u32>,
    batches: Option<u32>,
    batched_calls: Option<u32>,
    settlements: Option<u32>,
    settled_without_usage: Option<u32>,
    settled_unanswered: Option<u32>,
    settlements_lost: Option<u32>,
    late_given_back: Option<u32>,
    late_unanswered: Option<u32>,
    waited_admitted: Option<u32>,
    waited_rejected: Option<u32>,
    wait_queue_full: Option<u32>,
    /// The histograms, when on (`histograms`).
    histograms: Option<Histograms>,
}

/// The outcomes whose pause is recorded, in [`Metrics::paused`]'s order: a histogram each,
/// `edge_rate_limiter.outcome.<outcome>.paused_us` (the names of the global counters of the same requests).
const PAUSED_OUTCOMES: [&str; 6] =
    ["allowed", "rejected", "failure_allowed", "failure_denied", "fallback_allowed", "fallback_rejected"];

/// What a wait for permits ended in ([`super::wait`]), counted by [`Metrics::waited`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Waited {
    /// Admitted after waiting (`waited_admitted`).
    Admitted,
    /// Refused after waiting (`waited_rejected`).
    Rejected,
    /// Refused at once: its rule's `max_waiting` were waiting (`wait_queue_full`).
    QueueFull,
}

/// Histogram ids (docs/operating.md, "Histograms"). A histogram the host refused to define is skipped.
#[derive(Debug)]
struct Histograms {
    /// Microseconds from a request's headers to its decision, by outcome ([`PAUSED_OUTCOMES`]).
    paused_us: [Option<u32>; PAUSED_OUTCOMES.len()],
    /// Microseconds from sending a Redis call (or batch) to its reply: `redis_round_trip_us`.
    round_trip_us: Option<u32>,
    /// Calls per batch call sent: `batch_calls`.
    batch_calls: Option<u32>,
    /// Microseconds a request waited for its permits, from its first rejection to its decision: `waited_us`.
    waited_us: Option<u32>,
}

/// One rule's metrics: its counters, and for a rule with `cost` (histograms on) the histogram of its
/// settled cost in percent of the reservation, `edge_rate_limiter.rule.<rule>.settled_percent`.
#[derive(Debug, Clone, Copy)]
pub(super) struct RuleMetrics {
    pub(super) counters: RuleCounters,
    settled_percent: Option<u32>,
}

/// One rule's counters `edge_rate_limiter.rule.<rule>.<outcome>`, in [`RuleOutcome::ALL`] order.
pub(super) type RuleCounters = [Option<u32>; RuleOutcome::ALL.len()];

/// The rules given counters so far (a rule name shared by several configurations, or by the entries of
/// one rule's `rates_by_value`, shares its counters).
pub(super) type DefinedRules = Vec<(String, RuleMetrics)>;

impl Metrics {
    /// Defines every counter as `edge_rate_limiter.<name>`, and the histograms if `histograms`.
    pub(super) fn define(host: &impl Host, histograms: bool) -> Self {
        let counter = |name: &str| host.define_counter(&format!("{NAME}.{name}")).ok();
        let histogram = |name: &str| host.define_histogram(&format!("{NAME}.{name}")).ok();
        let histograms = histograms.then(|| Histograms {
            paused_us: PAUSED_OUTCOMES.map(|outcome| histogram(&format!("outcome.{outcome}.paused_us"))),
            round_trip_us: histogram("redis_round_trip_us"),
            batch_calls: histogram("batch_calls"),
            waited_us: histogram("waited_us"),
        });
        Metrics {
            allowed: counter("allowed"),
            rejected: counter("rejected"),
            local_rejected: counter("local_rejected"),
            failure_allowed: counter("failure_allowed"),
            failure_denied: counter("failure_denied"),
            redis_calls: counter("redis_calls"),
            redis_errors: counter("redis_errors"),
            host_errors: counter("host_errors"),
            leases: counter("leases"),
            lease_settlements: counter("lease_settlements"),
            lease_permits_lost: counter("lease_permits_lost"),
            compensations: counter("compensations"),
            fallback_allowed: counter("fallback_allowed"),
            fallback_rejected: counter("fallback_rejected"),
            exempt: counter("exempt"),
            batches: counter("batches"),
            batched_calls: counter("batched_calls"),
            settlements: counter("settlements"),
            settled_without_usage: counter("settled_without_usage"),
            settled_unanswered: counter("settled_unanswered"),
            settlements_lost: counter("settlements_lost"),
            late_given_back: counter("late_given_back"),
            late_unanswered: counter("late_unanswered"),
            waited_admitted: counter("waited_admitted"),
            waited_rejected: counter("waited_rejected"),
            wait_queue_full: counter("wait_queue_full"),
            histograms,
        }
    }

    /// The metrics of each rule entry of `config`, then of each of its in-flight rules (index
    /// `config.rules.len() + i`: counters alone), defined unless `defined` has them already (a rule with
    /// `cost` defined before without its histogram gets it now).
    pub(super) fn rules(host: &impl Host, config: &PluginConfig, defined: &mut DefinedRules) -> Vec<RuleMetrics> {
        let counter = |name: &str| host.define_counter(&format!("{NAME}.{name}")).ok();
        let settled = |rule: &str| host.define_histogram(&format!("{NAME}.rule.{rule}.settled_percent")).ok();
        let rate_rules = config.rules.iter().map(|rule| (&rule.name, config.histograms && rule.cost.is_some()));
        let inflight_rules = config.inflight.iter().map(|rule| (&rule.name, false));
        rate_rules
            .chain(inflight_rules)
            .map(|(rule_name, wants_settled)| match defined.iter_mut().find(|(name, _)| name == rule_name) {
                Some((_, ids)) => {
                    if wants_settled && ids.settled_percent.is_none() {
                        ids.settled_percent = settled(rule_name);
                    }
                    *ids
                }
                None => {
                    let ids = RuleMetrics {
                        counters: RuleOutcome::ALL.map(|o| counter(&format!("rule.{}.{}", rule_name, o.counter()))),
                        settled_percent: if wants_settled { settled(rule_name) } else { None },
                    };
                    defined.push((rule_name.clone(), ids));
                    ids
                }
            })
            .collect()
    }

    fn add(host: &impl Host, id: Option<u32>, amount: usize) {
        if let (Some(id), Ok(amount)) = (id, u64::try_from(amount)) {
            if amount > 0 {
                let _ = host.increment_counter(id, amount);
            }
        }
    }

    /// Counts rule entries' outcomes (index into `ids`, outcome) in their own counters.
    pub(super) fn rules_counted(
        host: &impl Host,
        ids: &[RuleMetrics],
        outcomes: impl Iterator<Item = (usize, RuleOutcome)>,
    ) {
        for (index, outcome) in outcomes {
            if let Some(ids) = ids.get(index) {
                Self::rule(host, &ids.counters, outcome);
            }
        }
    }

    /// One decided request, by its outcome.
    pub(super) fn decided(&self, host: &impl Host, outcome: Outcome) {
        let id = match outcome {
            Outcome::Unlimited => None,
            Outcome::Exempt => self.exempt,
            Outcome::Allowed => self.allowed,
            Outcome::Rejected => self.rejected,
            Outcome::LocallyRejected => {
                Self::add(host, self.local_rejected, 1);
                self.rejected
            }
            Outcome::FailedOpen => self.failure_allowed,
            Outcome::FailedClosed => self.failure_denied,
            Outcome::LocallyAllowed => self.fallback_allowed,
            Outcome::LocallyRefused => self.fallback_rejected,
        };
        Self::add(host, id, 1);
    }

    /// Redis calls that failed: as a whole (no reply, a bridge or Redis error, no answer in time), or for one
    /// of the limiters they carried; once per call.
    pub(super) fn redis_errors(&self, host: &impl Host, calls: usize) {
        Self::add(host, self.redis_errors, calls);
    }

    /// One Redis call sent.
    pub(super) fn redis_call(&self, host: &impl Host) {
        Self::add(host, self.redis_calls, 1);
    }

    /// One batch call sent, carrying `calls` requests' calls (request coalescing), or settles.
    pub(super) fn batch(&self, host: &impl Host, calls: usize) {
        Self::add(host, self.batches, 1);
        Self::add(host, self.batched_calls, calls);
        if let Some(id) = self.histograms.as_ref().and_then(|h| h.batch_calls) {
            let _ = host.record_histogram(id, calls as u64);
        }
    }

    /// The clock the histograms of durations read (us since the epoch), or 0 when they are off (nothing is
    /// read, and a duration from 0 is not recorded).
    pub(super) fn clock(&self, host: &impl Host) -> u64 {
        if self.histograms.is_some() {
            host.now_us()
        } else {
            0
        }
    }

    /// A request decided with `outcome`, its headers seen at `since_us` ([`Metrics::clock`]): its pause
    /// recorded by outcome. Requests no rule applies to, and exempt ones, are not paused: not recorded.
    pub(super) fn paused(&self, host: &impl Host, outcome: Outcome, since_us: u64) {
        let Some(histograms) = self.histograms.as_ref().filter(|_| since_us > 0) else { return };
        let index = match outcome {
            Outcome::Unlimited | Outcome::Exempt => return,
            Outcome::Allowed => 0,
            Outcome::Rejected | Outcome::LocallyRejected => 1,
            Outcome::FailedOpen => 2,
            Outcome::FailedClosed => 3,
            Outcome::LocallyAllowed => 4,
            Outcome::LocallyRefused => 5,
        };
        if let Some(id) = histograms.paused_us.get(index).copied().flatten() {
            let _ = host.record_histogram(id, host.now_us().saturating_sub(since_us));
        }
    }

    /// A Redis call (or batch) sent at `sent_us` ([`Metrics::clock`]) answered now (or failed): its round trip.
    pub(super) fn round_trip(&self, host: &impl Host, sent_us: u64) {
        if let Some(id) = self.histograms.as_ref().filter(|_| sent_us > 0).and_then(|h| h.round_trip_us) {
            let _ = host.record_histogram(id, host.now_us().saturating_sub(sent_us));
        }
    }

    /// A reservation of `granted` permits of the rule `ids` settled to `used`: the percent used recorded
    /// (above 100 for an excess).
    pub(super) fn settled(host: &impl Host, ids: &RuleMetrics, granted: u64, used: u64) {
        if let (Some(id), true) = (ids.settled_percent, granted > 0) {
            let _ = host.record_histogram(id, used.saturating_mul(100) / granted);
        }
    }

    /// One lease granted by Redis.
    pub(super) fn lease(&self, host: &impl Host) {
        Self::add(host, self.leases, 1);
    }

    /// One settle call sent: a reservation set to its response's real cost.
    pub(super) fn settlement(&self, host: &impl Host) {
        Self::add(host, self.settlements, 1);
    }

    /// `calls` settle calls sent together in one batch.
    pub(super) fn settlements(&self, host: &impl Host, calls: usize) {
        Self::add(host, self.settlements, calls);
    }

    /// One reservation kept as it was: its response ended (or stopped) without a cost to read.
    pub(super) fn settled_without_usage(&self, host: &impl Host) {
        Self::add(host, self.settled_without_usage, 1);
    }

    /// One reservation settled to 0 because the upstream never answered its request (Envoy answered it: a
    /// connect failure, no healthy upstream, a reset before any response byte).
    pub(super) fn settled_unanswered(&self, host: &impl Host) {
        Self::add(host, self.settled_unanswered, 1);
    }

    /// Settle calls that knew their cost but were never sent: their configuration went away with no other
    /// in the VM to send them (the reservations stay as reserved until they leave the window).
    pub(super) fn settlements_lost(&self, host: &impl Host, calls: usize) {
        Self::add(host, self.settlements_lost, calls);
    }

    /// Permits a reply took after its request had stopped waiting for it (its deadline passed, its client
    /// left, another rule decided it), given back at once: rate members (one each) and in-flight permits.
    pub(super) fn late_given_back(&self, host: &impl Host, permits: usize) {
        Self::add(host, self.late_given_back, permits);
    }

    /// Calls of requests that had stopped waiting for them, never answered: what they took, if anything,
    /// leaves with the window (rate members) or the lease (in-flight permits).
    pub(super) fn late_unanswered(&self, host: &impl Host, calls: usize) {
        Self::add(host, self.late_unanswered, calls);
    }

    /// A request that waited since `since_us` ([`Metrics::clock`]) for its permits is decided: its wait
    /// recorded in `waited_us`.
    pub(super) fn waited_for(&self, host: &impl Host, since_us: u64) {
        if let Some(id) = self.histograms.as_ref().and_then(|h| h.waited_us).filter(|_| since_us > 0) {
            let _ = host.record_histogram(id, self.clock(host).saturating_sub(since_us));
        }
    }

    /// How a request's wait for its permits ended ([`super::wait`]).
    pub(super) fn waited(&self, host: &impl Host, waited: Waited) {
        let id = match waited {
            Waited::Admitted => self.waited_admitted,
            Waited::Rejected => self.waited_rejected,
            Waited::QueueFull => self.wait_queue_full,
        };
        Self::add(host, id, 1);
    }

    /// One give-back call sent (a request rejected after a limiter in another hash slot admitted it).
    pub(super) fn compensation(&self, host: &impl Host) {
        Self::add(host, self.compensations, 1);
    }

    /// One give-back call a lease sent on its own (a settlement no acquire carried, or permits put back
    /// after the lease stopped serving).
    pub(super) fn lease_settlement(&self, host: &impl Host) {
        Self::add(host, self.lease_settlements, 1);
    }

    /// Permits taken from a lease that could not be returned: their lease was forgotten (docs/configuration.md,
    /// "Leases": when leased permits are lost).
    pub(super) fn lease_permits_lost(&self, host: &impl Host, permits: u64) {
        Self::add(host, self.lease_permits_lost, usize::try_from(permits).unwrap_or(usize::MAX));
    }

    /// A rule whose counters are `ids` ended a request with `outcome` (a rejection by the local block
    /// counts in `rejected` too: `local_rejected` is a part of it, as for the global counters).
    pub(super) fn rule(host: &impl Host, ids: &RuleCounters, outcome: RuleOutcome) {
        let count = |outcome: RuleOutcome| Self::add(host, ids.get(outcome as usize).copied().flatten(), 1);
        count(outcome);
        if outcome == RuleOutcome::LocallyRejected {
            count(RuleOutcome::Rejected);
        }
    }

    /// One hostcall on a request's path that the host refused (a context switch, a resume, a local reply).
    pub(super) fn host_error(&self, host: &impl Host) {
        Self::add(host, self.host_errors, 1);
    }
}

/// Logs each cause of failure once, until Redis answers again (then says so, once).
#[derive(Debug, Default)]
pub(super) struct FailureLog {
    logged: [bool; Failure::CAUSES],
}

impl FailureLog {
    /// A failed call: logged if its cause was not logged since Redis last answered.
    pub(super) fn failed(&mut self, host: &impl Host, failure: &Failure, mode: FailureMode) {
        if let Some(logged) = self.logged.get_mut(failure.cause_index()) {
            if !*logged {
                *logged = true;
                let action = match mode {
                    FailureMode::Allow => "failing open",
                    FailureMode::Deny => "failing closed",
                    FailureMode::Local => "deciding locally at rate / gateways",
                };
                log(
                    host,
                    LogLevel::Warn,
                    &format!("{failure}; {action}; further failures of this kind are counted in {NAME}.redis_errors until Redis answers again"),
                );
            }
        }
    }

    /// A request decided by Redis without failures: logs the recovery once if failures were logged.
    pub(super) fn recovered(&mut self, host: &impl Host) {
        if self.logged.iter().any(|&l| l) {
            self.logged = Default::default();
            log(host, LogLevel::Info, "Redis answers again");
        }
    }
}

/// Logs a Redis error on a limiter's keys once per limiter (the last [`LimiterErrorLog::KEPT`] limiters
/// logged are remembered by hash): a broken key fails on every request while Redis answers the other
/// limiters, so [`FailureLog`], which Redis's answers reset, would log it again and again.
#[derive(Debug, Default)]
pub(super) struct LimiterErrorLog {
    logged: [u64; LimiterErrorLog::KEPT],
    next: usize,
}

impl LimiterErrorLog {
    const KEPT: usize = 16;

    /// Rule `rule`'s limiter failed with `error` (failure mode `mode`): logged if not logged before.
    pub(super) fn failed(&mut self, host: &impl Host, rule: &str, error: &LimiterError, mode: FailureMode) {
        let hash = fnv1a(error.limiter.as_bytes()) | 1;
        if self.logged.contains(&hash) {
            return;
        }
        if let Some(slot) = self.logged.get_mut(self.next % Self::KEPT) {
            *slot = hash;
        }
        self.next = self.next.wrapping_add(1);
        let action = match mode {
            FailureMode::Allow => "the rule fails open",
            FailureMode::Deny => "its requests are answered with failure_status",
            FailureMode::Local => "the rule is decided by the local window",
        };
        log(
            host,
            LogLevel::Warn,
            &format!(
                "rule {rule}: Redis error on limiter {}: {}; {action}, the request's other rules still decide; further errors are counted in {NAME}.redis_errors",
                error.limiter,
                crate::quote::escaped(&error.error)
            ),
        );
    }
}

/// Counts a hostcall the host refused on a request's path; the first one is logged.
pub(super) fn host_refused<H: Host>(filter: &mut Filter<H>, call: &str) {
    filter.metrics.host_error(&filter.host);
    if !filter.host_error_logged {
        filter.host_error_logged = true;
        super::log(
            &filter.host,
            LogLevel::Warn,
            &format!("the host refused {call} for a request; such refusals are counted in {NAME}.host_errors"),
        );
    }
}
