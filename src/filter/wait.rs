//! Waiting for permits (a rule's `max_wait`; docs/configuration.md, "Waiting for permits"), as Redisson's
//! `RRateLimiter.tryAcquire(permits, timeout)` does: a request that a rule with `max_wait` rejects is held
//! instead of answered, and asks Redis again once the delay its rejection answered has passed (never
//! sooner), until it is admitted or its next try would come later than `max_wait` after its first
//! rejection: then it gets the usual refusal, `Retry-After` and all.
//!
//! - **It holds nothing while it waits.** The rejection took no permit (all or nothing), and what another
//!   hash slot took is given back as for any rejection ([`park`]).
//! - **Bounded.** At most `max_waiting` requests wait per rule and VM; the next one is refused at once
//!   (`wait_queue_full`). A gRPC call never waits past its `grpc-timeout`.
//! - **In order.** Requests due at the same tick ask again in the order they first waited.
//! - **Ends.** A client that leaves stops waiting ([`on_done`]); a configuration push ends the waits in the
//!   failure mode ([`end_all`]); a retry whose call fails follows the failure mode as any request does.
//! - **Counted.** `waited_admitted`, `waited_rejected`, `wait_queue_full`; the time waited in `waited_us`.

use alloc::rc::Rc;

use crate::prelude::*;

use crate::config::FailureMode;
use crate::host::Host;
use crate::limiter::{Decision, GiveBack, Outcome, PendingRequest, RuleOutcome};
use crate::response::Verdict;

use super::give_back::{send_give_back, GiveBackCall, GiveBackKind};
use super::metrics::Waited;
use super::route::Route;
use super::{Action, Filter};

/// A request waiting for its permits.
#[derive(Debug)]
struct Parked {
    context_id: u32,
    route: Rc<Route>,
    /// The rule whose rejection it waits on (its `max_waiting` counts it).
    rule: usize,
    /// The limiter that rule rejected it on: newer requests of this VM on it wait behind ([`queue_behind`]).
    limiter: String,
    /// When its headers arrived ([`super::metrics::Metrics::clock`]).
    since_us: u64,
    /// When it asks again, ms since the epoch.
    retry_ms: u64,
}

/// A request that waits, parked or asking again, until it is decided.
#[derive(Debug)]
struct Started {
    context_id: u32,
    route: Rc<Route>,
    /// The rule it waits on: its `max_waiting` counts the request until it is decided.
    rule: usize,
    /// When its wait ends, ms since the epoch.
    end_ms: u64,
    /// When it began to wait ([`super::metrics::Metrics::clock`]: 0 without histograms).
    since_us: u64,
}

/// This filter's waiting requests.
#[derive(Debug, Default)]
pub(super) struct Waits {
    /// In the order they first waited.
    parked: Vec<Parked>,
    /// Every request that waits, parked or asking again, in the order it first waited.
    started: Vec<Started>,
}

impl Waits {
    /// Whether no request waits (the tick need not run for them).
    pub(super) fn is_idle(&self) -> bool {
        self.parked.is_empty()
    }
}

/// Request `context_id` of `route` (its headers seen at `since_us`) was decided `decision`: held to ask
/// again after its rejection's delay (`None`), or the decision to finish now (not a rejection by a rule with
/// `max_wait`, its wait would end first, or the rule's `max_waiting` are waiting already).
pub(super) fn park<H: Host>(
    filter: &mut Filter<H>,
    context_id: u32,
    route: &Rc<Route>,
    since_us: u64,
    decision: Decision,
    pending: Option<&PendingRequest>,
) -> Option<Decision> {
    let Verdict::Respond { rate_limited: true, report, .. } = &decision.verdict else { return Some(decision) };
    let (Some(rule), Some(delay_ms)) = (report.rejected_by, report.retry_ms) else { return Some(decision) };
    let Some(limiter) = pending.and_then(|pending| pending.limiter_of(rule)) else { return Some(decision) };
    let Some(config) = route.config.rules.get(rule).filter(|rule| rule.max_wait_ms > 0) else {
        return Some(decision);
    };
    // Every rule that rejected it waits (one that refuses at once decides), and no call of its last try is
    // still on its way (its late reply must not meet the next try).
    let waits = |&&(index, outcome): &&(usize, RuleOutcome)| {
        outcome != RuleOutcome::Rejected || route.config.rules.get(index).is_some_and(|rule| rule.max_wait_ms > 0)
    };
    if !decision.rules.iter().all(|outcome| waits(&outcome)) || super::late::waits_for(filter, context_id) {
        return Some(decision);
    }
    let now_ms = filter.host.now_ms();
    let started = filter.waits.started.iter().find(|s| s.context_id == context_id).map(|s| s.end_ms);
    if started.is_none() && waiting_on(&filter.waits, route, rule) >= config.max_waiting as usize {
        filter.metrics.waited(&filter.host, Waited::QueueFull);
        return Some(decision);
    }
    let end_ms = match started {
        Some(end_ms) => end_ms,
        None => now_ms.saturating_add(config.max_wait_ms.min(grpc_timeout_ms(filter, context_id))),
    };
    if now_ms.saturating_add(delay_ms) > end_ms {
        return Some(decision);
    }
    // It holds nothing while it waits: what it took elsewhere goes back, as for a rejection.
    route.circuit_learns(now_ms, decision.redis_failed, !decision.redis_failed);
    for ticket in &decision.leases {
        super::end::put_back(filter, ticket);
    }
    for GiveBack { name, settlement } in decision.give_back {
        send_give_back(filter, GiveBackCall::new(route, name, settlement, GiveBackKind::Request));
    }
    if started.is_none() {
        let since_us = filter.metrics.clock(&filter.host);
        filter.waits.started.push(Started { context_id, route: Rc::clone(route), rule, end_ms, since_us });
    }
    let retry_ms = now_ms.saturating_add(delay_ms);
    let (route, limiter) = (Rc::clone(route), limiter.to_string());
    filter.waits.parked.push(Parked { context_id, route, rule, limiter, since_us, retry_ms });
    super::tick::start(filter);
    None
}

/// New request `context_id` of `route` (its headers seen at `since_us`) is about to ask Redis (`pending`):
/// if an older request of this VM waits on one of its limiters, it waits behind it instead (`true`), asking
/// again at the same tick, right after it, so that a newer request is not admitted before an older one that
/// fits. Not a request that waits already (its turn came), nor when it would wait past its own end or the
/// rule's `max_waiting` wait already: then it asks at once.
pub(super) fn queue_behind<H: Host>(
    filter: &mut Filter<H>,
    context_id: u32,
    route: &Rc<Route>,
    since_us: u64,
    pending: &PendingRequest,
) -> bool {
    let waits = &filter.waits;
    if waits.parked.is_empty() || waits.started.iter().any(|s| s.context_id == context_id) {
        return false;
    }
    let Some(ahead) = waits.parked.iter().rev().find(|p| Rc::ptr_eq(&p.route, route) && pending.asks(&p.limiter))
    else {
        return false;
    };
    let (rule, limiter, retry_ms) = (ahead.rule, ahead.limiter.clone(), ahead.retry_ms);
    let Some(config) = route.config.rules.get(rule) else { return false };
    if waiting_on(waits, route, rule) >= config.max_waiting as usize {
        return false;
    }
    let end_ms = filter.host.now_ms().saturating_add(config.max_wait_ms.min(grpc_timeout_ms(filter, context_id)));
    if retry_ms > end_ms {
        return false;
    }
    let waited_since_us = filter.metrics.clock(&filter.host);
    filter.waits.started.push(Started { context_id, route: Rc::clone(route), rule, end_ms, since_us: waited_since_us });
    let route = Rc::clone(route);
    filter.waits.parked.push(Parked { context_id, route, rule, limiter, since_us, retry_ms });
    true
}

/// How many requests wait on rule `rule` of `route` in this VM, parked or asking again.
fn waiting_on(waits: &Waits, route: &Rc<Route>, rule: usize) -> usize {
    waits.started.iter().filter(|started| started.rule == rule && Rc::ptr_eq(&started.route, route)).count()
}

/// The `grpc-timeout` of request `context_id` (gRFC over HTTP/2, "Timeout": digits and a unit, `H` `M` `S`
/// `m` `u` `n`), ms; `u64::MAX` without one (or unreadable).
fn grpc_timeout_ms<H: Host>(filter: &mut Filter<H>, context_id: u32) -> u64 {
    if filter.host.set_effective_context(context_id).is_err() {
        return u64::MAX;
    }
    let Ok(Some(value)) = filter.host.request_header("grpc-timeout") else { return u64::MAX };
    let Some((&unit, digits)) = value.split_last() else { return u64::MAX };
    let Some(amount) = core::str::from_utf8(digits).ok().and_then(|text| text.parse::<u64>().ok()) else {
        return u64::MAX;
    };
    match unit {
        b'H' => amount.saturating_mul(3_600_000),
        b'M' => amount.saturating_mul(60_000),
        b'S' => amount.saturating_mul(1_000),
        b'm' => amount,
        b'u' => amount / 1_000,
        b'n' => amount / 1_000_000,
        _ => u64::MAX,
    }
}

/// Request `context_id` is decided (`goes_on`: it goes upstream): counted if it had waited.
pub(super) fn decided<H: Host>(filter: &mut Filter<H>, context_id: u32, goes_on: bool) {
    if filter.waits.started.is_empty() {
        return;
    }
    let Some(at) = filter.waits.started.iter().position(|started| started.context_id == context_id) else { return };
    let started = filter.waits.started.swap_remove(at);
    filter.metrics.waited(&filter.host, if goes_on { Waited::Admitted } else { Waited::Rejected });
    filter.metrics.waited_for(&filter.host, started.since_us);
}

/// The tick: the requests whose delay has passed ask again, in the order they first waited.
pub(super) fn on_tick<H: Host>(filter: &mut Filter<H>, now_ms: u64) {
    if filter.waits.parked.iter().all(|parked| parked.retry_ms > now_ms) {
        return;
    }
    let (mut due, kept): (Vec<Parked>, Vec<Parked>) =
        core::mem::take(&mut filter.waits.parked).into_iter().partition(|parked| parked.retry_ms <= now_ms);
    filter.waits.parked = kept;
    // In the order they first waited (a request that asked again and waits anew is parked after newer ones).
    let mut ordered = Vec::with_capacity(due.len());
    for started in &filter.waits.started {
        if let Some(at) = due.iter().position(|parked| parked.context_id == started.context_id) {
            ordered.push(due.swap_remove(at));
        }
    }
    ordered.append(&mut due);
    for Parked { context_id, route, since_us, .. } in ordered {
        if filter.host.set_effective_context(context_id).is_err() {
            // Gone: its end forgets it.
            super::metrics::host_refused(filter, "proxy_set_effective_context");
            continue;
        }
        // Its decision may have woken other requests (their contexts made effective): its own again first.
        if filter.decide(context_id, route, None, None, since_us) == Action::Continue
            && (filter.host.set_effective_context(context_id).is_err() || filter.host.resume_request().is_err())
        {
            super::metrics::host_refused(filter, "proxy_continue_stream");
        }
    }
}

/// `proxy_on_done` of request `context_id`: it stops waiting.
pub(super) fn on_done<H: Host>(filter: &mut Filter<H>, context_id: u32) {
    if filter.waits.started.is_empty() {
        return;
    }
    filter.waits.parked.retain(|parked| parked.context_id != context_id);
    filter.waits.started.retain(|started| started.context_id != context_id);
}

/// The filter goes away (a configuration push): every waiting request ends in its failure mode (`deny`:
/// answered with `failure_status`; otherwise it goes on).
pub(super) fn end_all<H: Host>(filter: &mut Filter<H>) {
    filter.waits.started.clear();
    for Parked { context_id, route, .. } in core::mem::take(&mut filter.waits.parked) {
        if filter.host.set_effective_context(context_id).is_err() {
            super::metrics::host_refused(filter, "proxy_set_effective_context");
            continue;
        }
        if route.config.failure_mode == FailureMode::Deny {
            filter.metrics.decided(&filter.host, Outcome::FailedClosed);
            let (status, grpc) = (route.config.failure_status, Some(route.config.grpc.failure_status));
            super::end::answer(filter, status, &[], route.plan.failure_body.as_bytes(), grpc, None);
        } else {
            filter.metrics.decided(&filter.host, Outcome::FailedOpen);
            if filter.host.resume_request().is_err() {
                super::metrics::host_refused(filter, "proxy_continue_stream");
            }
        }
    }
}

#[cfg(test)]
#[path = "wait_tests.rs"]
mod tests;
