//! One request's way through the limiters, and its decision, made once. Pure: time, randomness, the local
//! blocks, leases and windows (the traits below, which the filter implements over the host's shared data
//! and its VM) and the commands ([`Plan`]) are passed in ([`Context`]), the transport is the caller's, so
//! every path (acquired, rejected, blocked locally, leased, NOSCRIPT retry, failures, decided locally) is
//! unit-tested.
//!
//! - `resolve`: which rules apply and with which limiters ([`applications`], shared with `erl-admin`);
//! - `plan`: what a configuration needs on every request ([`Plan`]);
//! - `pending`: the request waiting for Redis ([`start`], [`PendingRequest`]);
//! - `reply`: what each reply means ([`Effects`], [`Notice`]);
//! - `decision`: the final [`Decision`]: a rejection, the degraded mode's local windows, the failure mode;
//! - `reservation`: what an allowed request of a rule with `cost` settles when its response ends.
//!
//! Flow: [`start`] reads the key values and returns either a decision at once (no rule applies, a missing
//! key is denied, a limiter is blocked locally, leases serve every rule) or a [`PendingRequest`] with its
//! Redis calls. The caller encodes and sends each ([`PendingRequest::encode`]), feeds each outcome to
//! [`PendingRequest::on_reply`] and acts on the [`Progress`]: send again (after `NOSCRIPT`), keep waiting,
//! or apply the decision; and records what the [`Effects`] teach.

use smallvec::SmallVec;

use crate::prelude::*;

use crate::block::Block;
use crate::config::PluginConfig;
use crate::fallback::Local;
use crate::script::Settlement;

mod decision;
mod encode;
mod pending;
mod plan;
mod reply;
mod reservation;
mod resolve;
mod sends;
#[cfg(test)]
mod tests;

pub use crate::lease::{LeaseAsk, LeaseGrant, LeaseTicket, Leases};
pub use crate::response::{Report, RuleQuota, Verdict};
pub use decision::rejected_by_a_block;
pub use pending::{start, PendingRequest, Progress, Start};
pub use plan::{Plan, RulePlan};
pub use reply::{Effects, LeaseEnd, LimiterError, Notice};
pub use reservation::{Reservation, RESERVED_MARK, SETTLED_MARK};
pub use resolve::{applications, Applies, RuleApplication};

/// Where a request finds the local blocks of its limiters ([`crate::block`]).
pub trait Blocks {
    /// The live block of limiter `name` at `now_ms` that rejects a request for `permits` (fewer than
    /// `permits` free), if any. `settles`: the limiter's rule has `cost`, whose settles give permits back
    /// before the block ends (they raise the block's free permits in shared data), so no copy kept in the
    /// VM answers for it.
    fn rejecting(&self, name: &str, now_ms: u64, permits: u64, settles: bool) -> Option<Block>;
}

/// Where a request finds the degraded mode's local windows (`failure_mode: "local"`, [`crate::fallback`]):
/// they decide the rules Redis could not.
pub trait LocalWindows {
    /// Takes `permits` from limiter `name`'s window (`rate` per `interval_ms`) at `now_ms`, or refuses.
    fn acquire(&self, name: &str, rate: u64, interval_ms: u64, permits: u64, now_ms: u64) -> Local;
    /// Returns `permits` taken at `taken_ms` (the request was refused by another rule after all).
    fn release(&self, name: &str, interval_ms: u64, permits: u64, taken_ms: u64);
}

/// The inputs of a decision that are not the request: time, configuration, its plan, and what the VM and
/// its process keep (blocks, leases, local windows).
pub struct Context<'a> {
    /// The validated plugin configuration.
    pub config: &'a PluginConfig,
    /// The configuration's plan (commands built with this process's Redisson client id).
    pub plan: &'a Plan,
    /// Now, ms since the epoch (gateway clock).
    pub now_ms: u64,
    /// The local blocks.
    pub blocks: &'a dyn Blocks,
    /// This VM's leases.
    pub leases: &'a dyn Leases,
    /// `failure_mode: "local"`: the local windows that decide the rules Redis could not.
    pub local: Option<&'a dyn LocalWindows>,
    /// Redis is failing and no probe is due (`failure_mode: "local"`): rules that would ask Redis are
    /// decided locally instead.
    pub skip_redis: bool,
}

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
    /// Decided by the degraded mode's local windows (Redis failing) and admitted.
    LocallyAllowed,
    /// Decided by the degraded mode's local windows (Redis failing) and refused.
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
    /// The reservations of its rules with `cost`, to settle when its response ends (it goes upstream).
    pub reservations: Vec<Reservation>,
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
    /// It could not be decided (its call failed, or its limiter's keys raised an error) and the failure
    /// mode decided for it.
    Failed,
}

impl RuleOutcome {
    /// An in-flight rule's permit (docs/operating.md, "Metrics"): taken `Allowed`; refused `Rejected`, or
    /// `ShadowRejected` for a shadow rule; unanswered (`None`) `Failed`.
    pub fn of_permit(taken: Option<bool>, shadow: bool) -> Self {
        match (taken, shadow) {
            (Some(true), _) => RuleOutcome::Allowed,
            (Some(false), false) => RuleOutcome::Rejected,
            (Some(false), true) => RuleOutcome::ShadowRejected,
            (None, _) => RuleOutcome::Failed,
        }
    }

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
