//! Give-back calls ([`crate::script::GIVE_BACK`]): the members a request that did not go on added in
//! Redis, what the leases owe Redis on their own (settlements, permits put back after a lease stopped
//! serving), and settles of reservations. Nobody waits for them; each ends by its reply or by its deadline
//! (the tick).

use alloc::rc::Rc;

use crate::prelude::*;

use crate::host::Host;
use crate::script::{Invocation, Settlement};
use crate::transport::Failure;

use super::route::Route;
use super::{Filter, DEADLINE_GRACE_MS};

/// A give-back call on its way (sent again by source after `NOSCRIPT`).
#[derive(Debug)]
pub(super) struct GiveBackCall {
    pub(super) route: Rc<Route>,
    pub(super) name: String,
    pub(super) settlement: Settlement,
    retried: bool,
    pub(super) kind: GiveBackKind,
    /// When the tick gives up on its reply, ms since the epoch (`redis.timeout` + the grace after sending).
    deadline_ms: u64,
    /// When it was sent ([`super::metrics::Metrics::clock`]).
    pub(super) sent_us: u64,
    /// When it was put in the outbox, ms since the epoch (0: to send at the next tick).
    pub(super) queued_ms: u64,
}

/// What a give-back call returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum GiveBackKind {
    /// A member a request that did not go on added ([`crate::limiter::GiveBack`]): counted in
    /// `compensations`.
    Request,
    /// A lease's settlement, or permits put back after it stopped serving
    /// ([`crate::lease::LeaseTable::take_outbox`]): its end is reported to the lease table; counted in
    /// `lease_settlements`.
    Lease,
    /// A lease of a filter that went away ([`Filter::adopt`]): counted in `lease_settlements`.
    Handed,
    /// A reservation set to its response's real cost ([`super::settle`]): counted in `settlements`.
    Settle,
}

impl GiveBackCall {
    /// A give-back of limiter `name`'s member through `route`'s transport.
    pub(super) fn new(route: &Rc<Route>, name: String, settlement: Settlement, kind: GiveBackKind) -> Self {
        GiveBackCall {
            route: Rc::clone(route),
            name,
            settlement,
            retried: false,
            kind,
            deadline_ms: 0,
            sent_us: 0,
            queued_ms: 0,
        }
    }
}

/// Sends what the leases owe Redis on their own (settlements, permits put back after a lease stopped
/// serving) through `route`'s transport.
pub(super) fn send_lease_settlements<H: Host>(filter: &mut Filter<H>, route: &Rc<Route>) {
    for (name, settlement) in filter.leases.take_outbox() {
        send_give_back(filter, GiveBackCall::new(route, name, settlement, GiveBackKind::Lease));
    }
}

/// Sends a give-back call (by sha, or by source after `NOSCRIPT`); counted once, not again when sent by
/// source. Nobody waits for it: a failure is counted in `redis_errors` and logged once as other
/// failures are.
pub(super) fn send_give_back<H: Host>(filter: &mut Filter<H>, mut call: GiveBackCall) {
    let route = Rc::clone(&call.route);
    let invocation = if call.retried { Invocation::BySource } else { Invocation::BySha };
    let Some(template) = route.plan.rules.first().map(|rule| &rule.template) else { return };
    let bytes = call.settlement.encode(&call.name, template, invocation, route.transport.encoding());
    match route.transport.send(&filter.host, &bytes) {
        Ok(id) => {
            filter.metrics.redis_call(&filter.host);
            if !call.retried {
                count_sent(filter, call.kind);
            }
            let timeout_ms = route.config.redis.timeout_ms;
            call.deadline_ms = filter.host.now_ms().saturating_add(timeout_ms).saturating_add(DEADLINE_GRACE_MS);
            call.sent_us = filter.metrics.clock(&filter.host);
            filter.give_backs.insert(id.key(), call);
            super::tick::start(filter);
        }
        Err(failure) => give_back_failed(filter, call, &failure),
    }
}

/// Counts a give-back call sent the first time, by its kind.
pub(super) fn count_sent<H: Host>(filter: &Filter<H>, kind: GiveBackKind) {
    match kind {
        GiveBackKind::Request => filter.metrics.compensation(&filter.host),
        GiveBackKind::Lease | GiveBackKind::Handed => filter.metrics.lease_settlement(&filter.host),
        GiveBackKind::Settle => filter.metrics.settlement(&filter.host),
    }
}

/// The reply (or failure) of a give-back call: a lease's settlement is reported to its lease, a settle
/// raises its limiter's local block by what it gave back; `NOSCRIPT` sends it again by source, once.
pub(super) fn on_give_back_reply<H: Host>(
    filter: &mut Filter<H>,
    mut call: GiveBackCall,
    reply: Result<Vec<u8>, Failure>,
) {
    let failure = match reply {
        Err(failure) => failure,
        Ok(bytes) if bytes.first() == Some(&b':') => {
            match call.kind {
                GiveBackKind::Lease => {
                    filter.leases.settled(&call.name, &call.settlement.random, true);
                    send_lease_settlements(filter, &call.route);
                }
                GiveBackKind::Settle => {
                    // The window in Redis holds the unused permits again: a local block of the limiter
                    // (computed before) must not reject what Redis now admits.
                    let returned = call.settlement.granted.saturating_sub(call.settlement.used);
                    if returned > 0 {
                        call.route.blocks.raise(&filter.host, &call.name, returned, filter.host.now_ms());
                    }
                }
                GiveBackKind::Request | GiveBackKind::Handed => {}
            }
            return;
        }
        Ok(bytes) if bytes.starts_with(b"-NOSCRIPT") && !call.retried => {
            call.retried = true;
            send_give_back(filter, call);
            return;
        }
        Ok(_) => Failure::BadReply("the give-back script answered an error".into()),
    };
    give_back_failed(filter, call, &failure);
}

/// Give-backs never answered by `now_ms` fail (their permits stay taken until they leave the window).
pub(super) fn expire_give_backs<H: Host>(filter: &mut Filter<H>, now_ms: u64) {
    let late: Vec<u64> =
        filter.give_backs.iter().filter(|(_, call)| call.deadline_ms <= now_ms).map(|(&key, _)| key).collect();
    for key in late {
        if let Some(call) = filter.give_backs.remove(&key) {
            give_back_failed(filter, call, &Failure::TimedOut);
        }
    }
}

/// A give-back call that failed (or never answered): counted in `redis_errors`, logged once per cause; a
/// lease's settlement waits for the next acquire of its limiter.
pub(super) fn give_back_failed<H: Host>(filter: &mut Filter<H>, call: GiveBackCall, failure: &Failure) {
    filter.metrics.redis_errors(&filter.host, 1);
    filter.failure_log.failed(&filter.host, failure, call.route.config.failure_mode);
    if call.kind == GiveBackKind::Lease {
        filter.leases.settled(&call.name, &call.settlement.random, false);
    }
}
