//! In-flight rules (`max_in_flight`; docs/configuration.md, "In-flight limits"): before its rate rules, a
//! request takes one permit of each in-flight rule's semaphore ([`crate::script::SEMAPHORE_ACQUIRE`], layout
//! as Redisson's `RPermitExpirableSemaphore`), and holds it until its stream ends ([`on_done`]: the response
//! ended, the client left, the upstream reset it, or a rate rule rejected it). Permits are given back from the
//! tick, one [`crate::script::SEMAPHORE_RELEASE`] per semaphore; while a request runs, the tick moves its
//! lease's end every third of the lease ([`crate::script::SEMAPHORE_EXTEND`], one call per semaphore), so a
//! gateway that dies leaves its permits for at most one lease.
//!
//! A request refused by an enforced rule is answered at once (`rejected_status`, `x-ratelimited-by`, the
//! rule's `retry_after`), and gives back what its other in-flight rules took. A call that fails follows
//! `failure_mode` (`allow`: the request goes on without that permit; `deny`: `failure_status`).

use alloc::rc::Rc;

use crate::prelude::*;

use crate::config::{FailureMode, Mode, OnMissing};
use crate::host::{HeaderMap, Host};
use crate::id_map::{CallMap, IdMap};
use crate::key::{extract, write_limiter_name, KeyValue};
use crate::response::grpc;
use crate::script::{
    decode_semaphore_acquire_reply, encode_semaphore_extend, encode_semaphore_release, Invocation, Publish, ReplyError,
    SemaphoreAcquire, SemaphoreOutcome, PERMIT_ID_LEN,
};
use crate::transport::Failure;

use super::flow::HostRequest;
use super::route::Route;
use super::{Action, Filter, DEADLINE_GRACE_MS, NAME, REJECTED_BY_PROPERTY, SHADOW_REJECTED_BY_PROPERTY};

/// A permit's id: 16 random bytes, as Redisson's `generateId`.
type PermitId = [u8; PERMIT_ID_LEN];

/// One permit a request asked for.
#[derive(Debug, Clone)]
struct Asked {
    /// The rule's index in the configuration's `inflight`.
    rule: usize,
    /// The semaphore's name.
    name: String,
    id: PermitId,
    /// `Some(true)` taken, `Some(false)` refused, `None` waiting (or failed: `failed` says).
    taken: Option<bool>,
    failed: bool,
    retried: bool,
}

/// A request waiting for its in-flight permits.
#[derive(Debug)]
struct Waiting {
    route: Rc<Route>,
    asked: Vec<Asked>,
    /// A body follows the headers (the rate stage may wait for it).
    body_follows: bool,
    /// When its headers arrived ([`super::metrics::Metrics::clock`]).
    since_us: u64,
    /// When the tick ends its calls still waiting, ms since the epoch.
    deadline_ms: u64,
}

/// A permit held by a request, given back or extended by route and semaphore name.
#[derive(Debug, Clone)]
struct Held {
    route: Rc<Route>,
    name: String,
    id: PermitId,
    lease_ms: u64,
}

/// What a call on its way is for.
#[derive(Debug, Clone, Copy)]
enum CallFor {
    /// Request `context_id`'s permit `asked`.
    Acquire { context_id: u32, asked: usize },
    /// A release or an extension: nobody waits for it.
    Outbox,
}

/// The in-flight state of one filter: requests waiting for permits, permits held by running requests,
/// permits to give back on the next tick, and the calls on their way.
#[derive(Debug, Default)]
pub(super) struct Inflight {
    waiting: IdMap<Waiting>,
    held: IdMap<Vec<Held>>,
    releases: Vec<Held>,
    /// By [`crate::transport::CallId::key`]: what it is for, when it was sent (us,
    /// [`super::metrics::Metrics::clock`]) and when the tick forgets it (ms: `redis.timeout` and the grace
    /// after sending; a reply after that is dropped).
    calls: CallMap<(CallFor, u64, u64)>,
    /// Permits of requests that ended before their acquire's reply: (request, permit index, the permit,
    /// when the wait ends, ms). A reply that took it releases it again (the release may have run first).
    orphans: Vec<(u32, usize, Held, u64)>,
    /// When the tick next extends the leases of held permits, ms since the epoch.
    next_extend_ms: u64,
    counters: Counters,
}

/// `edge_rate_limiter.inflight_*` counters (docs/operating.md, "Metrics").
#[derive(Debug, Default, Clone, Copy)]
struct Counters {
    admitted: Option<u32>,
    rejected: Option<u32>,
    shadow_rejected: Option<u32>,
    released: Option<u32>,
    extended: Option<u32>,
}

impl Inflight {
    /// The state of a filter whose configurations have in-flight rules (`any`): its counters defined.
    pub(super) fn new(host: &impl Host, any: bool) -> Self {
        let counter =
            |name: &str| if any { host.define_counter(&format!("{NAME}.inflight_{name}")).ok() } else { None };
        let counters = Counters {
            admitted: counter("admitted"),
            rejected: counter("rejected"),
            shadow_rejected: counter("shadow_rejected"),
            released: counter("released"),
            extended: counter("extended"),
        };
        Inflight { counters, ..Inflight::default() }
    }

    /// Whether nothing waits for the tick: no request waits, no permit is held or to give back, no call
    /// is on its way.
    pub(super) fn is_idle(&self) -> bool {
        self.waiting.is_empty()
            && self.held.is_empty()
            && self.releases.is_empty()
            && self.calls.is_empty()
            && self.orphans.is_empty()
    }
}

fn count(host: &impl Host, id: Option<u32>, amount: u64) {
    if let Some(id) = id.filter(|_| amount > 0) {
        let _ = host.increment_counter(id, amount);
    }
}

/// Request `context_id` of `route`, with in-flight rules: asks each rule that applies for a permit and
/// pauses (`Some(Pause)`), answers it at once (a missing key denied: `Some(Pause)` after the local reply),
/// or `None` when no in-flight rule applies or the request matches the configuration's `exempt` (the rate
/// stage decides).
pub(super) fn start<H: Host>(
    filter: &mut Filter<H>,
    context_id: u32,
    route: &Rc<Route>,
    body_follows: bool,
    since_us: u64,
) -> Option<Action> {
    let request = HostRequest { host: &filter.host, body: None, headers: None };
    if route.config.exempt.as_ref().is_some_and(|exempt| exempt.matches(&request)) {
        return None;
    }
    let mut asked = Vec::new();
    let mut name = String::new();
    for (index, rule) in route.config.inflight.iter().enumerate() {
        if rule.exempt.as_ref().is_some_and(|exempt| exempt.matches(&request)) {
            continue;
        }
        let value = match (extract(&rule.source, &request), rule.on_missing) {
            (KeyValue::Missing, OnMissing::Skip) => continue,
            (KeyValue::Missing, OnMissing::Deny) if rule.mode == Mode::Enforce => {
                reject(filter, route, index, Mode::Enforce);
                return Some(Action::Pause);
            }
            (KeyValue::Missing, OnMissing::Deny) => continue,
            (KeyValue::Missing, OnMissing::Share) => KeyValue::Value(Vec::new()),
            (value, _) => value,
        };
        if write_limiter_name(&rule.limiter, &value, &mut name) {
            let mut id = [0u8; PERMIT_ID_LEN];
            filter.random.fill(&mut id);
            asked.push(Asked { rule: index, name: name.clone(), id, taken: None, failed: false, retried: false });
        }
    }
    if asked.is_empty() {
        return None;
    }
    let now_ms = filter.host.now_ms();
    let deadline_ms = now_ms.saturating_add(route.config.redis.timeout_ms).saturating_add(DEADLINE_GRACE_MS);
    let count = asked.len();
    let waiting = Waiting { route: Rc::clone(route), asked, body_follows, since_us, deadline_ms };
    filter.inflight.waiting.insert(context_id, waiting);
    for index in 0..count {
        send_acquire(filter, context_id, index, Invocation::BySha);
    }
    super::tick::start(filter);
    match conclude_if_answered(filter, context_id, true) {
        Some(action) => Some(action),
        None => Some(Action::Pause),
    }
}

/// Sends request `context_id`'s acquire of permit `index`; a refused send is that permit's failure.
fn send_acquire<H: Host>(filter: &mut Filter<H>, context_id: u32, index: usize, invocation: Invocation) {
    let Some(waiting) = filter.inflight.waiting.get(&context_id) else { return };
    let Some(asked) = waiting.asked.get(index) else { return };
    let Some(rule) = waiting.route.config.inflight.get(asked.rule) else { return };
    let now_ms = filter.host.now_ms();
    let acquire = SemaphoreAcquire {
        name: &asked.name,
        permits: rule.max_in_flight,
        lease_end_ms: now_ms.saturating_add(rule.lease_ms),
        now_ms,
        id: &asked.id,
        publish: Publish::Plain,
    };
    let command = acquire.encode(invocation, waiting.route.transport.encoding());
    let forget_ms = forget_at(&filter.host, &waiting.route);
    let sent = waiting.route.transport.send(&filter.host, &command);
    filter.metrics.redis_call(&filter.host);
    match sent {
        Ok(id) => {
            let sent_us = filter.metrics.clock(&filter.host);
            let call = (CallFor::Acquire { context_id, asked: index }, sent_us, forget_ms);
            filter.inflight.calls.insert(id.key(), call);
        }
        Err(_) => fail(filter, context_id, index),
    }
}

/// Marks request `context_id`'s permit `index` failed (counted in `redis_errors`).
fn fail<H: Host>(filter: &mut Filter<H>, context_id: u32, index: usize) {
    filter.metrics.redis_errors(&filter.host, 1);
    if let Some(asked) = filter.inflight.waiting.get_mut(&context_id).and_then(|w| w.asked.get_mut(index)) {
        asked.failed = true;
    }
}

/// A reply for call `key`, if it is an in-flight call (`false`: not one of these).
pub(super) fn on_reply<H: Host>(filter: &mut Filter<H>, key: u64, reply: &Result<Vec<u8>, Failure>) -> bool {
    let Some((call, sent_us, _)) = filter.inflight.calls.remove(&key) else { return false };
    filter.metrics.round_trip(&filter.host, sent_us);
    let CallFor::Acquire { context_id, asked: index } = call else {
        if reply.is_err() {
            filter.metrics.redis_errors(&filter.host, 1);
        }
        return true;
    };
    let outcome = match reply {
        Ok(bytes) => decode_semaphore_acquire_reply(bytes),
        Err(failure) => Err(ReplyError::Redis(failure.to_string())),
    };
    let Some(waiting) = filter.inflight.waiting.get_mut(&context_id) else {
        // The request ended first: a permit its acquire took goes back (again: its release may have run
        // before the acquire).
        let orphans = &mut filter.inflight.orphans;
        if let Some(at) = orphans.iter().position(|(c, i, _, _)| *c == context_id && *i == index) {
            let (_, _, held, _) = orphans.swap_remove(at);
            if matches!(outcome, Ok(SemaphoreOutcome::Taken { .. })) {
                filter.inflight.releases.push(held);
            }
        }
        return true;
    };
    let Some(asked) = waiting.asked.get_mut(index) else { return true };
    match outcome {
        Ok(SemaphoreOutcome::Taken { .. }) => asked.taken = Some(true),
        Ok(SemaphoreOutcome::Refused { .. }) => asked.taken = Some(false),
        Err(ReplyError::NoScript) if !asked.retried => {
            asked.retried = true;
            send_acquire(filter, context_id, index, Invocation::BySource);
            return true;
        }
        Err(_) => fail(filter, context_id, index),
    }
    if let Some(action) = conclude_if_answered(filter, context_id, false) {
        if action == Action::Continue && filter.host.resume_request().is_err() {
            super::metrics::host_refused(filter, "proxy_continue_stream");
        }
    }
    true
}

/// When every permit of request `context_id` is answered: refused, answered locally, or its permits held
/// and the rate stage started. `Some(action)` once concluded (`Continue`: the request goes on; from a
/// reply, the caller resumes it), `None` while permits are still waiting. `callback`: called from the
/// request's own callback (no context switch).
fn conclude_if_answered<H: Host>(filter: &mut Filter<H>, context_id: u32, callback: bool) -> Option<Action> {
    let waiting = filter.inflight.waiting.get(&context_id)?;
    if waiting.asked.iter().any(|asked| asked.taken.is_none() && !asked.failed) {
        return None;
    }
    let waiting = filter.inflight.waiting.remove(&context_id)?;
    if !callback && filter.host.set_effective_context(context_id).is_err() {
        super::metrics::host_refused(filter, "proxy_set_effective_context");
        release_taken(filter, &waiting);
        return Some(Action::Pause);
    }
    let route = Rc::clone(&waiting.route);
    let refused = |mode: Mode| {
        waiting.asked.iter().find(|asked| {
            asked.taken == Some(false) && route.config.inflight.get(asked.rule).is_some_and(|rule| rule.mode == mode)
        })
    };
    if let Some(asked) = refused(Mode::Enforce) {
        let rule = asked.rule;
        release_taken(filter, &waiting);
        reject(filter, &route, rule, Mode::Enforce);
        return Some(Action::Pause);
    }
    let failed = waiting.asked.iter().any(|asked| asked.failed);
    if failed && route.config.failure_mode == FailureMode::Deny {
        release_taken(filter, &waiting);
        filter.metrics.decided(&filter.host, crate::limiter::Outcome::FailedClosed);
        let headers = HeaderMap::new(&[]);
        let body = b"rate limiter unavailable\n";
        if filter.host.send_local_reply(route.config.failure_status, &headers, body, None).is_err() {
            super::metrics::host_refused(filter, "proxy_send_local_response");
        }
        return Some(Action::Pause);
    }
    if let Some(asked) = refused(Mode::Shadow) {
        reject(filter, &route, asked.rule, Mode::Shadow);
    }
    let held: Vec<Held> = waiting
        .asked
        .iter()
        .filter(|asked| asked.taken == Some(true))
        .map(|asked| Held {
            route: Rc::clone(&route),
            name: asked.name.clone(),
            id: asked.id,
            lease_ms: route.config.inflight.get(asked.rule).map_or(0, |rule| rule.lease_ms),
        })
        .collect();
    count(&filter.host, filter.inflight.counters.admitted, held.len() as u64);
    if !held.is_empty() {
        if filter.inflight.held.is_empty() {
            let lease_ms = held.iter().map(|h| h.lease_ms).min().unwrap_or(0);
            filter.inflight.next_extend_ms = filter.host.now_ms().saturating_add(lease_ms / 3);
        }
        filter.inflight.held.insert(context_id, held);
    }
    Some(filter.start_rates(context_id, route, waiting.body_follows, waiting.since_us))
}

/// Moves the permits request `waiting` took to the releases.
fn release_taken<H: Host>(filter: &mut Filter<H>, waiting: &Waiting) {
    for asked in waiting.asked.iter().filter(|asked| asked.taken == Some(true)) {
        let lease_ms = waiting.route.config.inflight.get(asked.rule).map_or(0, |rule| rule.lease_ms);
        let held = Held { route: Rc::clone(&waiting.route), name: asked.name.clone(), id: asked.id, lease_ms };
        filter.inflight.releases.push(held);
    }
}

/// Answers the effective request as refused by in-flight rule `rule` (`Enforce`), or records the shadow
/// rule that would have refused it (`Shadow`).
fn reject<H: Host>(filter: &mut Filter<H>, route: &Route, rule: usize, mode: Mode) {
    let Some(rule) = route.config.inflight.get(rule) else { return };
    if mode == Mode::Shadow {
        count(&filter.host, filter.inflight.counters.shadow_rejected, 1);
        if filter.host.set_property(SHADOW_REJECTED_BY_PROPERTY, rule.name.as_bytes()).is_err() {
            super::metrics::host_refused(filter, "proxy_set_property");
        }
        return;
    }
    count(&filter.host, filter.inflight.counters.rejected, 1);
    filter.metrics.decided(&filter.host, crate::limiter::Outcome::Rejected);
    if filter.host.set_property(REJECTED_BY_PROPERTY, rule.name.as_bytes()).is_err() {
        super::metrics::host_refused(filter, "proxy_set_property");
    }
    let seconds = rule.retry_after_ms.div_ceil(1000).to_string();
    let pairs = [("retry-after", seconds.as_str()), ("x-ratelimited-by", rule.name.as_str())];
    let headers = HeaderMap::new(&pairs);
    let rejection = &route.config.rejection;
    let is_grpc = matches!(filter.host.request_header("content-type"), Ok(Some(value)) if grpc::is_grpc(&value));
    let code = is_grpc.then_some(route.config.grpc.rejected_status);
    if filter.host.send_local_reply(rejection.status, &headers, rejection.body.as_bytes(), code).is_err() {
        super::metrics::host_refused(filter, "proxy_send_local_response");
    }
}

/// `proxy_on_done` of request `context_id`: its permits go back on the next tick (those still waiting for
/// their reply too: taken, they are released; refused, the release changes nothing).
pub(super) fn on_done<H: Host>(filter: &mut Filter<H>, context_id: u32) {
    if let Some(waiting) = filter.inflight.waiting.remove(&context_id) {
        for (index, asked) in waiting.asked.iter().enumerate().filter(|(_, asked)| asked.taken != Some(false)) {
            let lease_ms = waiting.route.config.inflight.get(asked.rule).map_or(0, |rule| rule.lease_ms);
            let held = Held { route: Rc::clone(&waiting.route), name: asked.name.clone(), id: asked.id, lease_ms };
            if asked.taken.is_none() && !asked.failed {
                filter.inflight.orphans.push((context_id, index, held.clone(), waiting.deadline_ms));
            }
            filter.inflight.releases.push(held);
        }
    }
    if let Some(held) = filter.inflight.held.remove(&context_id) {
        filter.inflight.releases.extend(held);
    }
    if !filter.inflight.releases.is_empty() {
        super::tick::start(filter);
    }
}

/// The tick: ends the waits past their deadline (their calls failed), gives the released permits back
/// (one call per semaphore) and, every third of the shortest lease, extends the leases of the permits
/// held (one call per semaphore).
pub(super) fn on_tick<H: Host>(filter: &mut Filter<H>, now_ms: u64) {
    let due: Vec<u32> = filter
        .inflight
        .waiting
        .iter()
        .filter(|(_, waiting)| waiting.deadline_ms <= now_ms)
        .map(|(&context_id, _)| context_id)
        .collect();
    for context_id in due {
        if let Some(waiting) = filter.inflight.waiting.get_mut(&context_id) {
            let unanswered = waiting.asked.iter_mut().filter(|asked| asked.taken.is_none() && !asked.failed);
            let mut failed = 0;
            for asked in unanswered {
                asked.failed = true;
                failed += 1;
            }
            filter.metrics.redis_errors(&filter.host, failed);
        }
        if let Some(action) = conclude_if_answered(filter, context_id, false) {
            if action == Action::Continue && filter.host.resume_request().is_err() {
                super::metrics::host_refused(filter, "proxy_continue_stream");
            }
        }
    }
    filter.inflight.orphans.retain(|(_, _, _, deadline_ms)| *deadline_ms > now_ms);
    // A call whose reply never came (its wait ended above; a release or an extension nobody waits for).
    let before = filter.inflight.calls.len();
    filter.inflight.calls.retain(|_, (_, _, forget_ms)| *forget_ms > now_ms);
    filter.metrics.redis_errors(&filter.host, before - filter.inflight.calls.len());
    let releases = core::mem::take(&mut filter.inflight.releases);
    let released = releases.len() as u64;
    for (route, name, _, ids) in by_semaphore(releases.iter()) {
        let encoding = route.transport.encoding();
        let command = encode_semaphore_release(&name, &ids, Publish::Plain, Invocation::BySource, encoding);
        send_outbox(filter, &route, &command);
    }
    count(&filter.host, filter.inflight.counters.released, released);
    if !filter.inflight.held.is_empty() && now_ms >= filter.inflight.next_extend_ms {
        let held: Vec<&Held> = filter.inflight.held.values().flatten().collect();
        let shortest_ms = held.iter().map(|h| h.lease_ms).min().unwrap_or(0);
        let extended = held.len() as u64;
        for (route, name, lease_ms, ids) in by_semaphore(held.into_iter()) {
            let end_ms = now_ms.saturating_add(lease_ms);
            let encoding = route.transport.encoding();
            let publish = Publish::Plain;
            let command = encode_semaphore_extend(&name, end_ms, now_ms, &ids, publish, Invocation::BySource, encoding);
            send_outbox(filter, &route, &command);
        }
        count(&filter.host, filter.inflight.counters.extended, extended);
        filter.inflight.next_extend_ms = now_ms.saturating_add(shortest_ms / 3);
    }
}

/// Permits grouped by route and semaphore name (with their lease, ms), in first-seen order.
fn by_semaphore<'a>(held: impl Iterator<Item = &'a Held>) -> Vec<(Rc<Route>, String, u64, Vec<PermitId>)> {
    let mut groups: Vec<(Rc<Route>, String, u64, Vec<PermitId>)> = Vec::new();
    for permit in held {
        let same = |(route, name, _, _): &&mut (Rc<Route>, String, u64, Vec<PermitId>)| {
            Rc::ptr_eq(route, &permit.route) && *name == permit.name
        };
        match groups.iter_mut().find(same) {
            Some((_, _, _, ids)) => ids.push(permit.id),
            None => groups.push((Rc::clone(&permit.route), permit.name.clone(), permit.lease_ms, vec![permit.id])),
        }
    }
    groups
}

/// Sends a release or an extension; nobody waits for its reply (a failure is counted in `redis_errors`).
fn send_outbox<H: Host>(filter: &mut Filter<H>, route: &Route, command: &[u8]) {
    filter.metrics.redis_call(&filter.host);
    match route.transport.send(&filter.host, command) {
        Ok(id) => {
            let sent_us = filter.metrics.clock(&filter.host);
            let forget_ms = forget_at(&filter.host, route);
            filter.inflight.calls.insert(id.key(), (CallFor::Outbox, sent_us, forget_ms));
        }
        Err(_) => filter.metrics.redis_errors(&filter.host, 1),
    }
}

/// When the tick forgets a call sent now through `route`: `redis.timeout` and the grace later, and a tick.
fn forget_at(host: &impl Host, route: &Route) -> u64 {
    host.now_ms()
        .saturating_add(route.config.redis.timeout_ms)
        .saturating_add(DEADLINE_GRACE_MS)
        .saturating_add(u64::from(super::TICK_MS))
}

#[cfg(test)]
#[path = "inflight_tests.rs"]
mod tests;
