//! The final decision on a request, made once from its rules' results: any rejection rejects; rules Redis
//! could not decide go to the degraded mode's local windows (`failure_mode: "local"`, lent by the caller as
//! [`LocalWindows`]), all or nothing; other failures follow the failure mode; otherwise the request is
//! allowed. What a request that does not go on took is given back.

use alloc::rc::Rc;

use smallvec::SmallVec;

use crate::prelude::*;

use crate::block::Block;
use crate::config::{FailureMode, Mode, PluginConfig};
use crate::fallback::Local;
use crate::key::RequestView;
use crate::response::{Report, RuleQuota, Verdict};
use crate::script::{MemberAt, Settlement};

use super::pending::{lease_tickets, CallState, PendingRequest, RuleCall, RuleResult};
use super::reservation::{reservations, Reservation};
use super::resolve::{group_end, resolve, Resolved};
use super::{Context, Decision, GiveBack, LocalWindows, Outcome, RuleOutcome};

/// The rejection of a limiter's local block: what `decide` makes of this one result, without the generic
/// path: the request costs no Redis call, and should cost little else (docs/deploying.md, "Lean guest").
/// Not inlined: one copy for its two callers.
#[inline(never)]
pub(super) fn blocked(ctx: &Context<'_>, rule: usize, block: &Block) -> Decision {
    let (quota, delay_ms) = block_quota(ctx.now_ms, rule, block);
    let mut report = Report { retry_ms: Some(delay_ms), rejected_by: Some(rule), ..Report::default() };
    report.quotas.push(quota);
    let mut rules = SmallVec::new();
    rules.push((rule, RuleOutcome::LocallyRejected));
    let verdict = rejection(ctx, report);
    Decision {
        verdict,
        outcome: Outcome::LocallyRejected,
        redis_failed: false,
        rules,
        leases: Vec::new(),
        give_back: Vec::new(),
        reservations: Vec::new(),
    }
}

/// The rejection of a request by the live local block of one of its enforced rules, found without Redis
/// and before anything is taken for it: what [`super::start`] decides for that request, since it looks at
/// blocks before any Redis call (`None`: no rule's block rejects it, or the rate stage must decide). The
/// rules are walked in [`super::start`]'s order, and the walk stops where that could decide otherwise: at
/// an enforced rule with a lease (this VM's lease may serve it) and at an enforced rule's denial. Shadow
/// rules and a request the configuration's `exempt` matches reject nothing. The request view must hold
/// what the rules' keys and reservations read (the request body, when a rule reads it). For a stage that
/// takes something before the rate rules (in-flight permits): a request its rate rules reject at once
/// takes nothing.
pub fn rejected_by_a_block(ctx: &Context<'_>, request: &impl RequestView) -> Option<Decision> {
    if ctx.config.exempt.as_ref().is_some_and(|exempt| exempt.matches(request)) {
        return None;
    }
    let enforced = |entry: usize| ctx.config.rules.get(entry).is_some_and(|rule| rule.mode == Mode::Enforce);
    let mut name = String::new();
    let mut first = 0;
    while let Some(end) = group_end(ctx.config, first) {
        match resolve(ctx.config, first, end, request, &mut name) {
            Resolved::Limiter(entry) if enforced(entry) => {
                let rule = ctx.config.rules.get(entry)?;
                // A lease rule comes first in [`super::start`]'s order: its lease may serve the request, or
                // its own block reject it (the rate stage decides).
                if rule.lease.is_some() {
                    return None;
                }
                if rule.local_block_max_ms > 0 {
                    let permits = super::reservation::permits_of(rule, request);
                    if let Some(block) = ctx.blocks.rejecting(&name, ctx.now_ms, permits, rule.cost.is_some()) {
                        return Some(blocked(ctx, entry, &block));
                    }
                }
            }
            // An enforced rule's denial (its key missing, `on_missing: deny`) decides first: the rate stage
            // answers it.
            Resolved::Denied if enforced(end - 1) => return None,
            _ => {}
        }
        first = end;
    }
    None
}

/// The quota a local block reports, and its delay: Redisson's, 3 ms past the oldest permit's departure.
pub(super) fn block_quota(now_ms: u64, rule: usize, block: &Block) -> (RuleQuota, u64) {
    let delay_ms = block.release_ms.saturating_sub(now_ms).saturating_add(3);
    (RuleQuota { rule, limit: block.rate, window_ms: block.interval_ms, remaining: 0, reset_ms: delay_ms }, delay_ms)
}

/// The decision on a request the configuration's `exempt` matches: it goes on, without headers.
pub(super) fn exempt() -> Decision {
    Decision {
        verdict: Verdict::Continue { report: Report::default() },
        outcome: Outcome::Exempt,
        redis_failed: false,
        rules: SmallVec::new(),
        leases: Vec::new(),
        give_back: Vec::new(),
        reservations: Vec::new(),
    }
}

/// A rejection's local reply, with `report`'s headers.
fn rejection(ctx: &Context<'_>, report: Report) -> Verdict {
    Verdict::Respond {
        status: ctx.config.rejection.status,
        report,
        rate_limited: true,
        body: Rc::clone(&ctx.plan.rejection_body),
    }
}

/// What the rule results of a request say ([`PendingRequest::decide`]).
#[derive(Default)]
struct Tally {
    report: Report,
    rules: SmallVec<[(usize, RuleOutcome); 2]>,
    /// Rules Redis could not decide and that the local windows decide, with their limiter names and the
    /// permits the request asks of each (a reservation's own size for a rule with `cost`).
    local: Vec<(usize, String, u64)>,
    /// A local block rejected.
    blocked: bool,
    /// An enforced rule could not be decided: the failure mode applies.
    failed: bool,
}

/// The decision on `pending`, from every rule's result.
pub(super) fn decide(pending: &PendingRequest, ctx: &Context<'_>) -> Decision {
    let mut tally = tally(pending, ctx.config);
    let leases = lease_tickets(&pending.calls, ctx.config);
    let any = pending.settled.is_some() || pending.calls.iter().any(|c| matches!(c.state, CallState::Done(_)));
    let decision = |verdict: Verdict, outcome, rules, give_back| Decision {
        reservations: match verdict {
            Verdict::Continue { .. } => reservations(pending, ctx.config),
            Verdict::Respond { .. } => Vec::new(),
        },
        verdict,
        outcome,
        redis_failed: pending.redis_failed,
        rules,
        leases,
        give_back,
    };
    if tally.report.rejected_by.is_some() {
        tally.rules.extend(tally.local.iter().map(|(rule, _, _)| (*rule, RuleOutcome::Failed)));
        let outcome = if tally.blocked { Outcome::LocallyRejected } else { Outcome::Rejected };
        return decision(rejection(ctx, tally.report), outcome, tally.rules, give_back(pending, ctx.config));
    }
    if !tally.local.is_empty() {
        match ctx.local {
            Some(windows) => return decide_locally(pending, ctx, windows, tally, decision),
            // No windows to ask: the rules fail as any failed rule does.
            None => {
                tally.rules.extend(tally.local.iter().map(|(rule, _, _)| (*rule, RuleOutcome::Failed)));
                tally.failed = true;
            }
        }
    }
    if !tally.failed {
        let outcome = if any { Outcome::Allowed } else { Outcome::Unlimited };
        return decision(Verdict::Continue { report: tally.report }, outcome, tally.rules, Vec::new());
    }
    match ctx.config.failure_mode {
        // Local: a failed rule without a limiter name (none is made for it) fails open.
        FailureMode::Allow | FailureMode::Local => {
            decision(Verdict::Continue { report: tally.report }, Outcome::FailedOpen, tally.rules, Vec::new())
        }
        FailureMode::Deny => {
            let verdict = Verdict::Respond {
                status: ctx.config.failure_status,
                report: Report::default(),
                rate_limited: false,
                body: Rc::clone(&ctx.plan.failure_body),
            };
            decision(verdict, Outcome::FailedClosed, tally.rules, give_back(pending, ctx.config))
        }
    }
}

/// The local windows decide the rules Redis could not: every one is asked (each counts as its window
/// decides), the request is admitted if every one admits; else it is refused as a rejection, and what
/// the others took (windows and Redis) is given back.
fn decide_locally(
    pending: &PendingRequest,
    ctx: &Context<'_>,
    windows: &dyn LocalWindows,
    mut tally: Tally,
    decision: impl FnOnce(Verdict, Outcome, SmallVec<[(usize, RuleOutcome); 2]>, Vec<GiveBack>) -> Decision,
) -> Decision {
    let mut admitted = SmallVec::<[(&str, u64, u64); 2]>::new();
    let mut refused: Option<(usize, u64)> = None;
    let mut local_reservations = Vec::new();
    for (index, name, permits) in &tally.local {
        let Some(rule) = ctx.config.rules.get(*index) else { continue };
        match windows.acquire(name, rule.rate, rule.interval_ms, *permits, ctx.now_ms) {
            Local::Admitted => {
                admitted.push((name, rule.interval_ms, *permits));
                tally.rules.push((*index, RuleOutcome::Allowed));
                if rule.cost.is_some() {
                    local_reservations.push(Reservation::local(*index, name.clone(), *permits, ctx.now_ms));
                }
            }
            Local::Refused { retry_ms } => {
                tally.rules.push((*index, RuleOutcome::Rejected));
                refused = Some(refused.map_or((*index, retry_ms), |(first, ms)| (first, ms.max(retry_ms))));
            }
        }
    }
    let Some((rule, retry_ms)) = refused else {
        let verdict = Verdict::Continue { report: tally.report };
        let mut decision = decision(verdict, Outcome::LocallyAllowed, tally.rules, Vec::new());
        // What the local windows took for rules with `cost` settles there when the response ends.
        decision.reservations.append(&mut local_reservations);
        return decision;
    };
    for (name, interval_ms, permits) in admitted {
        windows.release(name, interval_ms, permits, ctx.now_ms);
    }
    let report = Report { retry_ms: Some(retry_ms), rejected_by: Some(rule), ..Report::default() };
    decision(rejection(ctx, report), Outcome::LocallyRefused, tally.rules, give_back(pending, ctx.config))
}

/// Every rule's result of `pending`, gathered: its outcome, its quota in the report, and what decides the
/// request.
fn tally(pending: &PendingRequest, config: &PluginConfig) -> Tally {
    let shadow = |rule: usize| config.rules.get(rule).is_some_and(|r| r.mode == Mode::Shadow);
    // A rejected request gives back what the others took: their quotas report it as free already.
    let rejected = pending.settled.is_some()
        || pending.calls.iter().any(|c| {
            matches!(c.state, CallState::Done(RuleResult::Rejected { .. }) | CallState::Done(RuleResult::Denied))
                && !shadow(c.rule)
        });
    let done = pending.calls.iter().filter_map(|c| match &c.state {
        CallState::Done(result) => Some((c.rule, result, Some((&c.name, c.permits)))),
        CallState::Waiting | CallState::Parked => None,
    });
    let mut tally = Tally::default();
    for (rule, result, name) in pending.settled.iter().map(|(rule, result)| (*rule, result, None)).chain(done) {
        tally.add(config, rule, result, name, shadow(rule), rejected);
    }
    tally
}

impl Tally {
    /// Rule `rule`'s `result` (`call`: its limiter name and the permits it asked for); `rejected`: another
    /// rule rejects the request.
    fn add(
        &mut self,
        config: &PluginConfig,
        rule: usize,
        result: &RuleResult,
        call: Option<(&String, u64)>,
        shadow: bool,
        rejected: bool,
    ) {
        // A shadow rule's quota shows only with `shadow_headers`.
        let reported = !shadow || config.shadow_headers;
        let (outcome, quota) = match result {
            RuleResult::Acquired(quota, _) if rejected => {
                let permits = call.map_or_else(|| config.rules.get(rule).map_or(0, |r| r.permits), |(_, p)| p);
                (RuleOutcome::Allowed, Some(RuleQuota { remaining: quota.remaining.saturating_add(permits), ..*quota }))
            }
            RuleResult::Acquired(quota, _) | RuleResult::Untaken(quota) => (RuleOutcome::Allowed, Some(*quota)),
            RuleResult::Rejected { quota, .. } if shadow => {
                self.report.shadow_rejected_by = self.report.shadow_rejected_by.or(Some(rule));
                (RuleOutcome::ShadowRejected, Some(*quota))
            }
            RuleResult::Rejected { quota, delay_ms, local: by_block } => {
                self.report.rejected_by = self.report.rejected_by.or(Some(rule));
                self.blocked |= *by_block;
                if let Some(ms) = *delay_ms {
                    self.report.retry_ms = Some(self.report.retry_ms.map_or(ms, |d| d.max(ms)));
                }
                (if *by_block { RuleOutcome::LocallyRejected } else { RuleOutcome::Rejected }, Some(*quota))
            }
            RuleResult::Denied if shadow => {
                self.report.shadow_rejected_by = self.report.shadow_rejected_by.or(Some(rule));
                (RuleOutcome::ShadowRejected, None)
            }
            RuleResult::Denied => {
                self.report.rejected_by = self.report.rejected_by.or(Some(rule));
                (RuleOutcome::Rejected, None)
            }
            // A rule the local windows decide counts as they decide; one they do not (a shadow rule, or the
            // request is rejected anyway) counts as failed. A shadow rule's failure never decides the request.
            RuleResult::Failed | RuleResult::Skipped => {
                let skipped = matches!(result, RuleResult::Skipped);
                let decides_locally = config.failure_mode == FailureMode::Local;
                if let Some((name, permits)) = call.filter(|_| !shadow && (decides_locally || skipped)) {
                    self.local.push((rule, name.clone(), permits));
                    return;
                }
                self.failed |= !shadow && !skipped;
                (RuleOutcome::Failed, None)
            }
        };
        self.rules.push((rule, outcome));
        if let Some(quota) = quota.filter(|_| reported) {
            self.report.quotas.push(quota);
        }
    }
}

/// The members the rules of `pending` that acquired added in Redis, to give back.
fn give_back(pending: &PendingRequest, config: &PluginConfig) -> Vec<GiveBack> {
    pending
        .own_members()
        .filter(|(call, _, _)| config.rules.get(call.rule).is_some())
        .map(|(call, granted, at)| member_give_back(call, granted, at))
        .collect()
}

/// The give-back of the member `call` acquired (`granted` permits, written `at`): all of it (used 0).
pub(super) fn member_give_back(call: &RuleCall, granted: u64, at: Option<MemberAt>) -> GiveBack {
    let settlement = Settlement { random: call.member_random, granted, used: 0, early_ms: 0, renamed: None, at };
    GiveBack { name: call.name.clone(), settlement }
}
