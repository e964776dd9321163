//! How a decided request ends: [`finish`] counts it, moves the degraded mode's circuit, commits or
//! puts back what it took from leases and gives back what it took in Redis; [`end`] resumes it
//! (its rate limit headers kept for its response) or answers it locally, naming the rule in its filter
//! state, from the request's own callback or from the root context's.

use alloc::rc::Rc;

use crate::prelude::*;

use arrayvec::ArrayVec;

use crate::host::{HeaderMap, Host};
use crate::limiter::{Decision, GiveBack, LeaseTicket, Leases, Outcome, Verdict};
use crate::response::{grpc, rate_limit_headers, Headers, Quota, Report, RuleQuota, MAX_HEADERS};

use super::flow::{Flow, Origin, Stage};
use super::give_back::{GiveBackCall, GiveBackKind};
use super::metrics::{InflightCounter, InflightCounters, Metrics};
use super::route::Route;
use super::{Action, Filter, REJECTED_BY_PROPERTY, SHADOW_REJECTED_BY_PROPERTY};
use crate::config::Mode;

/// Counts a decision (and records its pause since `since_us`, [`Metrics::clock`]), moves the circuit,
/// settles what the request took (leases committed or put back, Redis members given back if it does not go
/// on, reservations kept for its response if it does), and says how request `context_id` ends.
pub(super) fn finish<H: Host>(
    filter: &mut Filter<H>,
    context_id: u32,
    route: &Rc<Route>,
    decision: Decision,
    since_us: u64,
) -> Verdict {
    let now_ms = filter.host.now_ms();
    let decided_by_redis = matches!(decision.outcome, Outcome::Allowed | Outcome::Rejected);
    route.circuit_learns(now_ms, decision.redis_failed, decided_by_redis);
    let outcome = admitted_by_inflight(filter, context_id, decision.outcome);
    filter.metrics.decided(&filter.host, outcome);
    filter.metrics.paused(&filter.host, outcome, since_us);
    for &(rule, outcome) in &decision.rules {
        if let Some(ids) = route.rule_metrics.get(rule) {
            Metrics::rule(&filter.host, &ids.counters, outcome);
        }
    }
    let goes_on = matches!(decision.verdict, Verdict::Continue { .. });
    super::wait::decided(filter, context_id, goes_on);
    for ticket in &decision.leases {
        if goes_on {
            filter.leases.commit(ticket);
        } else {
            put_back(filter, ticket);
        }
    }
    if goes_on && !decision.reservations.is_empty() {
        super::settle::reserve(filter, context_id, route, decision.reservations);
    }
    if !goes_on {
        for GiveBack { name, settlement } in decision.give_back {
            super::give_back::send_give_back(filter, GiveBackCall::new(route, name, settlement, GiveBackKind::Request));
        }
    }
    super::give_back::send_lease_settlements(filter, route);
    if !decision.redis_failed && decided_by_redis {
        filter.failure_log.recovered(&filter.host);
    }
    decision.verdict
}

/// `proxy_on_done` of request `context_id`, if it was paused: its calls forgotten (their late replies give
/// back what they took), what it took from leases put back.
pub(super) fn on_done<H: Host>(filter: &mut Filter<H>, context_id: u32) {
    if filter.flows.is_empty() {
        return;
    }
    if let Some(flow) = filter.flows.remove(&context_id) {
        super::flow::forget(filter, context_id, &flow);
        for ticket in flow.lease_tickets() {
            put_back(filter, &ticket);
        }
        super::give_back::send_lease_settlements(filter, &flow.route);
        super::flow::wake_parked(filter);
    }
}

/// Puts a lease ticket back into its own lease; one whose lease is forgotten is counted as lost.
pub(super) fn put_back<H: Host>(filter: &mut Filter<H>, ticket: &LeaseTicket) {
    if !filter.leases.put_back(ticket) {
        filter.metrics.lease_permits_lost(&filter.host, ticket.permits);
    }
}

/// Ends a decided request: from its own callback (its context is effective: the action says go on or
/// wait for the local reply), or from the root context's (switched to the request's context first; if
/// the host refuses the switch, the decision waits for the next tick).
pub(super) fn end<H: Host>(
    filter: &mut Filter<H>,
    context_id: u32,
    route: &Rc<Route>,
    next: Verdict,
    origin: Origin,
) -> Action {
    if origin != Origin::Callback && filter.host.set_effective_context(context_id).is_err() {
        super::metrics::host_refused(filter, "proxy_set_effective_context");
        let flow = Flow {
            route: Rc::clone(route),
            stage: Stage::Undelivered(next),
            tokens: Vec::new(),
            deadline_ms: 0,
            since_us: 0,
        };
        super::flow::pause(filter, context_id, flow);
        return Action::Pause;
    }
    record_rule(filter, route, &next);
    match next {
        Verdict::Continue { mut report } => {
            add_inflight_quotas(filter, context_id, &mut report);
            if report.shows(&route.plan.headers) {
                filter.response_headers.insert(context_id, (Rc::clone(route), report));
            }
            if origin == Origin::Callback {
                return Action::Continue;
            }
            if filter.host.resume_request().is_err() {
                super::metrics::host_refused(filter, "proxy_continue_stream");
            }
        }
        Verdict::Respond { status, ref body, rate_limited, .. } => {
            let sent = if is_grpc_request(filter) {
                let grpc = &route.config.grpc;
                let code = if rate_limited { grpc.rejected_status } else { grpc.failure_status };
                let headers = grpc::headers(&next, next.headers(&route.plan.headers));
                let pairs: ArrayVec<(&str, &str), MAX_HEADERS> = headers.iter().map(|(k, v)| (*k, &**v)).collect();
                let message = grpc::message(body).as_bytes();
                filter.host.send_local_reply(status, &HeaderMap::new(&pairs), message, Some(code))
            } else {
                let headers = filter.replies.headers(route.index, &next, &route.plan.headers);
                filter.host.send_local_reply(status, headers, body.as_bytes(), None)
            };
            if sent.is_err() {
                super::metrics::host_refused(filter, "proxy_send_local_response");
            }
        }
    }
    Action::Pause
}

/// Whether the effective request is a gRPC request ([`grpc::is_grpc`] of its `content-type`), read only
/// when the filter answers it: Envoy keeps a paused request's headers readable.
fn is_grpc_request<H: Host>(filter: &Filter<H>) -> bool {
    matches!(filter.host.request_header("content-type"), Ok(Some(value)) if grpc::is_grpc(&value))
}

/// Names the rule that rejected the effective request, or the shadow rule that would have, in its
/// filter state for access logs ([`REJECTED_BY_PROPERTY`], [`SHADOW_REJECTED_BY_PROPERTY`]).
fn record_rule<H: Host>(filter: &mut Filter<H>, route: &Route, verdict: &Verdict) {
    let (path, rule) = match verdict {
        Verdict::Respond { report, .. } => (REJECTED_BY_PROPERTY, report.rejected_by),
        Verdict::Continue { report } => (SHADOW_REJECTED_BY_PROPERTY, report.shadow_rejected_by),
    };
    let Some(name) = rule.and_then(|rule| route.plan.rule_name(rule)) else { return };
    if filter.host.set_property(path, name.as_bytes()).is_err() {
        super::metrics::host_refused(filter, "proxy_set_property");
    }
}

/// Answers the effective request locally with `status`, `headers` and `body` (a gRPC request with `grpc`'s
/// status in trailers-only form), naming `rejected_by` in its filter state ([`REJECTED_BY_PROPERTY`]) if
/// given: the in-flight stage's refusals and failures ([`super::inflight`]).
pub(super) fn answer<H: Host>(
    filter: &mut Filter<H>,
    status: u16,
    pairs: &[(&str, &str)],
    body: &[u8],
    grpc: Option<u8>,
    rejected_by: Option<&str>,
) {
    if let Some(rule) = rejected_by {
        if filter.host.set_property(REJECTED_BY_PROPERTY, rule.as_bytes()).is_err() {
            super::metrics::host_refused(filter, "proxy_set_property");
        }
    }
    let code = grpc.filter(|_| is_grpc_request(filter));
    if filter.host.send_local_reply(status, &HeaderMap::new(pairs), body, code).is_err() {
        super::metrics::host_refused(filter, "proxy_send_local_response");
    }
}

/// Answers the effective request as refused by in-flight rule `rule` (`Enforce`; `local`: by the degraded
/// mode's count, counted in `fallback_rejected`), or records the shadow rule that would have refused it
/// (`Shadow`).
pub(super) fn reject_inflight<H: Host>(
    filter: &mut Filter<H>,
    route: &Route,
    rule: usize,
    mode: Mode,
    local: bool,
    counters: InflightCounters,
) {
    let index = rule;
    let Some(rule) = route.config.inflight.get(index) else { return };
    if mode == Mode::Shadow {
        counters.count(&filter.host, InflightCounter::ShadowRejected, 1);
        if filter.host.set_property(SHADOW_REJECTED_BY_PROPERTY, rule.name.as_bytes()).is_err() {
            super::metrics::host_refused(filter, "proxy_set_property");
        }
        return;
    }
    counters.count(&filter.host, InflightCounter::Rejected, 1);
    filter.metrics.decided(&filter.host, if local { Outcome::LocallyRefused } else { Outcome::Rejected });
    let seconds = rule.retry_after_ms.div_ceil(1000).to_string();
    let headers_rules = &route.plan.headers;
    let quota = Quota {
        policy: &rule.name,
        prepared_policy: headers_rules.rules.get(route.config.rules.len() + index).map(|policy| &policy.policy),
        limit: rule.max_in_flight,
        window_ms: 0,
        remaining: 0,
        reset_ms: 0,
    };
    let mut headers = Headers::new();
    rate_limit_headers(headers_rules.style, &[quota], &mut headers);
    let mut pairs: ArrayVec<(&str, &str), MAX_HEADERS> =
        [("retry-after", seconds.as_str()), ("x-ratelimited-by", rule.name.as_str())].into_iter().collect();
    pairs.extend(headers.iter().map(|(name, value)| (*name, &**value)));
    let (rejection, grpc) = (&route.config.rejection, Some(route.config.grpc.rejected_status));
    answer(filter, rejection.status, &pairs, rejection.body.as_bytes(), grpc, Some(&rule.name));
}

/// A request no rate rule applied to (`Unlimited`) that holds in-flight permits was decided by its in-flight
/// rules: allowed (by Redis, or by the degraded mode's count: `LocallyAllowed`).
fn admitted_by_inflight<H: Host>(filter: &Filter<H>, context_id: u32, outcome: Outcome) -> Outcome {
    if outcome != Outcome::Unlimited {
        return outcome;
    }
    match filter.inflight.held.get(&context_id) {
        Some(held) if held.iter().any(|permit| permit.local_ms.is_some()) => Outcome::LocallyAllowed,
        Some(held) if !held.is_empty() => Outcome::Allowed,
        _ => outcome,
    }
}

/// Adds to `report` the quotas of the in-flight permits request `context_id` holds (rules in `Enforce`
/// mode): the rate limit headers of its response show them beside its rate rules'.
fn add_inflight_quotas<H: Host>(filter: &Filter<H>, context_id: u32, report: &mut Report) {
    let Some(held) = filter.inflight.held.get(&context_id) else { return };
    for permit in held {
        let config = &permit.route.config;
        let Some(rule) = config.inflight.get(permit.rule).filter(|rule| rule.mode == Mode::Enforce) else { continue };
        let rule_index = config.rules.len() + permit.rule;
        report.quotas.push(RuleQuota {
            rule: rule_index,
            limit: rule.max_in_flight,
            window_ms: 0,
            remaining: permit.free,
            reset_ms: 0,
        });
    }
}
