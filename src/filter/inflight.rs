//! In-flight rules (`max_in_flight`; docs/configuration.md, "In-flight limits"): before its rate rules, a
//! request takes one permit of each in-flight rule's semaphore ([`crate::script::SEMAPHORE_ACQUIRE`]; acquires
//! coalesced per destination) and holds it until its stream ends ([`on_done`]); [`super::permit_outbox`]
//! gives permits back and extends leases from the tick. A refusal is answered at once; a failed call follows
//! `failure_mode`.

use alloc::rc::Rc;

use crate::prelude::*;

use crate::config::{FailureMode, Mode, OnMissing};
use crate::host::Host;
use crate::id_map::{CallMap, IdMap};
use crate::key::{extract, write_limiter_name, KeyValue};
use crate::limiter::RuleOutcome;
use crate::script::{
    decode_semaphore_acquire_replies, encode_semaphore_acquires, Invocation, Publish, ReplyError, SemaphoreAcquire,
    SemaphoreOutcome, MAX_SEMAPHORE_ACQUIRES, PERMIT_ID_LEN,
};
use crate::transport::Failure;

use super::flow::HostRequest;
use super::metrics::{InflightCounter, InflightCounters, Metrics};
use super::permit_outbox::{destination, forget_at, Destination, Held, PermitId};
use super::route::Route;
use super::{Action, Filter, DEADLINE_GRACE_MS};

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

/// An acquire call on its way: the acquires it carries, (request, permit index) each in the call's order, to
/// `destination`; `retried`: sent again by source after `NOSCRIPT`.
#[derive(Debug, Clone)]
struct AcquireCall {
    destination: Destination,
    items: Vec<(u32, usize)>,
    retried: bool,
}

/// The in-flight state of one filter: requests waiting for permits, permits held by running requests,
/// permits to give back on the next tick, and the calls on their way.
#[derive(Debug, Default)]
pub(super) struct Inflight {
    waiting: IdMap<Waiting>,
    pub(super) held: IdMap<Vec<Held>>,
    /// By [`crate::transport::CallId::key`]: the acquires it carries, when it was sent (us,
    /// [`super::metrics::Metrics::clock`]) and when the tick forgets it (ms: `redis.timeout` and the grace
    /// after sending; a reply after that is dropped).
    calls: CallMap<(AcquireCall, u64, u64)>,
    /// Acquires waiting for their destination's call on its way to be answered (coalesced into the next).
    queues: Vec<(Destination, Vec<(u32, usize)>)>,
    /// Destinations with an acquire call on its way.
    busy: Vec<Destination>,
    /// Permits of requests that ended before their acquire's reply: (request, permit index, the permit,
    /// when the wait ends, ms). A reply that took it releases it again (the release may have run first).
    pub(super) orphans: Vec<(u32, usize, Held, u64)>,
    /// When the tick next extends the leases of held permits, ms since the epoch.
    next_extend_ms: u64,
    counters: InflightCounters,
}

impl Inflight {
    /// The state of a filter whose configurations have in-flight rules (`any`): its counters defined.
    pub(super) fn new(host: &impl Host, any: bool) -> Self {
        Inflight { counters: InflightCounters::define(host, any), ..Inflight::default() }
    }

    /// Request `context_id` holds these permits (none: nothing): their leases are extended within a third of
    /// the shortest, whatever the permits held before wait for.
    pub(super) fn hold(&mut self, context_id: u32, held: Vec<Held>, now_ms: u64) {
        let Some(lease_ms) = held.iter().map(|h| h.lease_ms).min() else { return };
        let due_ms = now_ms.saturating_add(lease_ms / 3);
        self.next_extend_ms = if self.held.is_empty() { due_ms } else { self.next_extend_ms.min(due_ms) };
        self.held.insert(context_id, held);
    }

    /// Whether nothing waits for the tick: no request waits, no permit is held or to give back, no call
    /// is on its way.
    pub(super) fn is_idle(&self) -> bool {
        self.waiting.is_empty()
            && self.held.is_empty()
            && self.calls.is_empty()
            && self.orphans.is_empty()
            && self.queues.is_empty()
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
    if route.config.inflight.is_empty() {
        return None;
    }
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
                let counters = filter.inflight.counters;
                super::end::reject_inflight(filter, route, index, Mode::Enforce, counters);
                return Some(Action::Pause);
            }
            (KeyValue::Missing, OnMissing::Deny) => continue,
            (KeyValue::Missing, OnMissing::Share) => KeyValue::Value(Vec::new()),
            (value, _) => value,
        };
        if write_limiter_name(&rule.limiter, &value, &mut name) {
            let mut id = [0u8; PERMIT_ID_LEN];
            filter.random.fill(&mut id);
            asked.push(Asked { rule: index, name: name.clone(), id, taken: None, failed: false });
        }
    }
    if asked.is_empty() {
        return None;
    }
    let now_ms = filter.host.now_ms();
    let deadline_ms = now_ms.saturating_add(route.config.redis.timeout_ms).saturating_add(DEADLINE_GRACE_MS);
    let destinations_of: Vec<Destination> = asked.iter().map(|asked| destination(route, &asked.name)).collect();
    let waiting = Waiting { route: Rc::clone(route), asked, body_follows, since_us, deadline_ms };
    filter.inflight.waiting.insert(context_id, waiting);
    let mut destinations = Vec::new();
    for (index, &destination) in destinations_of.iter().enumerate() {
        queue(filter, destination, (context_id, index));
        if !destinations.contains(&destination) {
            destinations.push(destination);
        }
    }
    for destination in destinations {
        if !filter.inflight.busy.contains(&destination) {
            flush(filter, destination, Invocation::BySha, None);
        }
    }
    super::tick::start(filter);
    Some(conclude_if_answered(filter, context_id, true).unwrap_or(Action::Pause))
}

fn queue<H: Host>(filter: &mut Filter<H>, destination: Destination, item: (u32, usize)) {
    match filter.inflight.queues.iter_mut().find(|(d, _)| *d == destination) {
        Some((_, items)) => items.push(item),
        None => filter.inflight.queues.push((destination, vec![item])),
    }
}

/// Sends `destination`'s queued acquires (at most [`MAX_SEMAPHORE_ACQUIRES`]; with `retry`, those of a call
/// answered `NOSCRIPT`, by source) in one call, those of requests still waiting; a refused send fails them.
fn flush<H: Host>(
    filter: &mut Filter<H>,
    destination: Destination,
    invocation: Invocation,
    retry: Option<Vec<(u32, usize)>>,
) {
    let retrying = retry.is_some();
    let items: Vec<(u32, usize)> = match retry {
        Some(items) => items,
        None => {
            let queues = &mut filter.inflight.queues;
            let Some(at) = queues.iter().position(|(d, _)| *d == destination) else { return };
            let Some((_, queued)) = queues.get_mut(at) else { return };
            let items: Vec<(u32, usize)> = queued.drain(..queued.len().min(MAX_SEMAPHORE_ACQUIRES)).collect();
            if queued.is_empty() {
                queues.swap_remove(at);
            }
            items
        }
    };
    let waiting = &filter.inflight.waiting;
    let live: Vec<(u32, usize)> = items
        .into_iter()
        .filter(|(context_id, index)| {
            waiting.get(context_id).and_then(|w| w.asked.get(*index)).is_some_and(|a| a.taken.is_none() && !a.failed)
        })
        .collect();
    let Some(route) = live.first().and_then(|(c, _)| waiting.get(c)).map(|w| Rc::clone(&w.route)) else {
        // Every request of this part ended: the next part of the queue, if any, goes now.
        if !retrying && filter.inflight.queues.iter().any(|(d, _)| *d == destination) {
            flush(filter, destination, invocation, None);
        }
        return;
    };
    let now_ms = filter.host.now_ms();
    let permits: Vec<SemaphoreAcquire<'_>> = live
        .iter()
        .filter_map(|(context_id, index)| {
            let waiting = waiting.get(context_id)?;
            let asked = waiting.asked.get(*index)?;
            let rule = waiting.route.config.inflight.get(asked.rule)?;
            let lease_end_ms = now_ms.saturating_add(rule.lease_ms);
            Some(SemaphoreAcquire { name: &asked.name, permits: rule.max_in_flight, lease_end_ms, id: &asked.id })
        })
        .collect();
    let command = encode_semaphore_acquires(&permits, now_ms, Publish::Plain, invocation, route.transport.encoding());
    let forget_ms = forget_at(&filter.host, &route);
    let sent = route.transport.send(&filter.host, &command);
    filter.metrics.redis_call(&filter.host);
    match sent {
        Ok(id) => {
            let sent_us = filter.metrics.clock(&filter.host);
            let retried = invocation == Invocation::BySource;
            let deadline_ms = forget_ms.saturating_sub(u64::from(super::TICK_MS));
            for (context_id, _) in &live {
                if let Some(waiting) = filter.inflight.waiting.get_mut(context_id) {
                    waiting.deadline_ms = waiting.deadline_ms.max(deadline_ms);
                }
            }
            let call = AcquireCall { destination, items: live, retried };
            filter.inflight.calls.insert(id.key(), (call, sent_us, forget_ms));
            filter.inflight.busy.retain(|d| *d != destination);
            filter.inflight.busy.push(destination);
        }
        // One error for the call; its requests are decided by their own start, or by the tick.
        Err(_) => {
            filter.metrics.redis_errors(&filter.host, 1);
            live.into_iter().for_each(|(context_id, index)| fail(filter, context_id, index));
        }
    }
}

/// Marks request `context_id`'s permit `index` failed.
fn fail<H: Host>(filter: &mut Filter<H>, context_id: u32, index: usize) {
    if let Some(asked) = filter.inflight.waiting.get_mut(&context_id).and_then(|w| w.asked.get_mut(index)) {
        asked.failed = true;
    }
}

/// A reply for call `key`, if it is an in-flight call (`false`: not one of these).
pub(super) fn on_reply<H: Host>(filter: &mut Filter<H>, key: u64, reply: &Result<Vec<u8>, Failure>) -> bool {
    let Some((call, sent_us, _)) = filter.inflight.calls.remove(&key) else {
        return super::permit_outbox::on_reply(filter, key, reply);
    };
    filter.metrics.round_trip(&filter.host, sent_us);
    let AcquireCall { destination, items, retried } = call;
    let outcomes = match reply {
        Ok(bytes) => decode_semaphore_acquire_replies(bytes, items.len()),
        Err(failure) => Err(ReplyError::Redis(failure.to_string())),
    };
    match outcomes {
        Err(ReplyError::NoScript) if !retried => {
            flush(filter, destination, Invocation::BySource, Some(items));
            return true;
        }
        Ok(outcomes) => {
            for ((context_id, index), outcome) in items.into_iter().zip(outcomes) {
                answered(filter, context_id, index, outcome);
            }
        }
        Err(_) => {
            filter.metrics.redis_errors(&filter.host, 1);
            for (context_id, index) in items {
                if let Some(asked) = filter.inflight.waiting.get_mut(&context_id).and_then(|w| w.asked.get_mut(index)) {
                    asked.failed = true;
                }
                conclude_from_reply(filter, context_id);
            }
        }
    }
    filter.inflight.busy.retain(|d| *d != destination);
    if filter.inflight.queues.iter().any(|(d, _)| *d == destination) {
        flush(filter, destination, Invocation::BySha, None);
    }
    true
}

/// Request `context_id`'s permit `index` was answered: taken or refused (a request gone releases a permit
/// taken for it).
fn answered<H: Host>(filter: &mut Filter<H>, context_id: u32, index: usize, outcome: SemaphoreOutcome) {
    let taken = matches!(outcome, SemaphoreOutcome::Taken { .. });
    let Some(asked) = filter.inflight.waiting.get_mut(&context_id).and_then(|w| w.asked.get_mut(index)) else {
        // The request ended first: a permit its acquire took goes back (again: its release may have run
        // before the acquire).
        let orphans = &mut filter.inflight.orphans;
        if let Some(at) = orphans.iter().position(|(c, i, _, _)| *c == context_id && *i == index) {
            let (_, _, held, _) = orphans.swap_remove(at);
            filter.permit_outbox.releases.extend(taken.then_some(held));
        }
        return;
    };
    asked.taken = Some(taken);
    conclude_from_reply(filter, context_id);
}

/// Concludes request `context_id` if every permit is answered, from a reply or the tick (the request is
/// resumed when it goes on).
fn conclude_from_reply<H: Host>(filter: &mut Filter<H>, context_id: u32) {
    if let Some(action) = conclude_if_answered(filter, context_id, false) {
        if action == Action::Continue && filter.host.resume_request().is_err() {
            super::metrics::host_refused(filter, "proxy_continue_stream");
        }
    }
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
    if !callback && filter.host.set_effective_context(context_id).is_err() {
        // Decided, but not delivered: the next tick tries again (the request's end gives its permits back).
        super::metrics::host_refused(filter, "proxy_set_effective_context");
        if let Some(waiting) = filter.inflight.waiting.get_mut(&context_id) {
            waiting.deadline_ms = 0;
        }
        super::tick::start(filter);
        return Some(Action::Pause);
    }
    let waiting = filter.inflight.waiting.remove(&context_id)?;
    let route = Rc::clone(&waiting.route);
    let refused = |mode: Mode| {
        waiting.asked.iter().find(|asked| {
            asked.taken == Some(false) && route.config.inflight.get(asked.rule).is_some_and(|rule| rule.mode == mode)
        })
    };
    let outcomes = waiting.asked.iter().map(|asked| {
        let shadow = route.config.inflight.get(asked.rule).is_some_and(|rule| rule.mode == Mode::Shadow);
        (route.config.rules.len() + asked.rule, RuleOutcome::of_permit(asked.taken, shadow))
    });
    Metrics::rules_counted(&filter.host, &route.rule_metrics, outcomes);
    if let Some(asked) = refused(Mode::Enforce) {
        let rule = asked.rule;
        release_taken(filter, &waiting);
        super::end::reject_inflight(filter, &route, rule, Mode::Enforce, filter.inflight.counters);
        return Some(Action::Pause);
    }
    let failed = waiting.asked.iter().any(|asked| asked.failed);
    if failed && route.config.failure_mode == FailureMode::Deny {
        release_taken(filter, &waiting);
        filter.metrics.decided(&filter.host, crate::limiter::Outcome::FailedClosed);
        let (status, grpc) = (route.config.failure_status, Some(route.config.grpc.failure_status));
        super::end::answer(filter, status, &[], route.plan.failure_body.as_bytes(), grpc, None);
        return Some(Action::Pause);
    }
    if let Some(asked) = refused(Mode::Shadow) {
        super::end::reject_inflight(filter, &route, asked.rule, Mode::Shadow, filter.inflight.counters);
    }
    let held: Vec<Held> =
        waiting.asked.iter().filter(|asked| asked.taken == Some(true)).map(|asked| held_of(&route, asked)).collect();
    filter.inflight.counters.count(&filter.host, InflightCounter::Admitted, held.len() as u64);
    let now_ms = filter.host.now_ms();
    filter.inflight.hold(context_id, held, now_ms);
    Some(filter.start_rates(context_id, route, waiting.body_follows, waiting.since_us))
}

/// The permit `asked` of a request of `route`, as held.
fn held_of(route: &Rc<Route>, asked: &Asked) -> Held {
    let lease_ms = route.config.inflight.get(asked.rule).map_or(0, |rule| rule.lease_ms);
    Held { route: Rc::clone(route), name: asked.name.clone(), id: asked.id, lease_ms }
}

/// Moves the permits request `waiting` took to the releases.
fn release_taken<H: Host>(filter: &mut Filter<H>, waiting: &Waiting) {
    for asked in waiting.asked.iter().filter(|asked| asked.taken == Some(true)) {
        let held = held_of(&waiting.route, asked);
        filter.permit_outbox.releases.push(held);
    }
}

/// `proxy_on_done` of request `context_id`: its permits go back on the next tick (those still waiting for
/// their reply too: taken, they are released; refused, the release changes nothing).
pub(super) fn on_done<H: Host>(filter: &mut Filter<H>, context_id: u32) {
    if filter.inflight.is_idle() {
        return;
    }
    if let Some(waiting) = filter.inflight.waiting.remove(&context_id) {
        for (index, asked) in waiting.asked.iter().enumerate().filter(|(_, asked)| asked.taken != Some(false)) {
            let held = held_of(&waiting.route, asked);
            if asked.taken.is_none() && !asked.failed {
                filter.inflight.orphans.push((context_id, index, held.clone(), waiting.deadline_ms));
            }
            filter.permit_outbox.releases.push(held);
        }
    }
    if let Some(held) = filter.inflight.held.remove(&context_id) {
        filter.permit_outbox.releases.extend(held);
    }
    if !filter.permit_outbox.releases.is_empty() {
        super::tick::start(filter);
    }
}

/// Ends the waits past their deadline (`all`: every wait, the filter going away) in the failure mode, their
/// unanswered permits failed ([`give_up`]).
pub(super) fn end_waits<H: Host>(filter: &mut Filter<H>, now_ms: u64, all: bool) {
    let waits = filter.inflight.waiting.iter();
    let due: Vec<u32> = waits.filter(|(_, w)| all || w.deadline_ms <= now_ms).map(|(&c, _)| c).collect();
    for context_id in due {
        give_up(filter, context_id, now_ms);
        conclude_from_reply(filter, context_id);
        if all {
            filter.inflight.waiting.remove(&context_id);
        }
    }
}

/// Request `context_id`'s permits still unanswered fail (its wait ended, or its filter goes away): each is
/// kept as an orphan until `until_ms` past now, so that a reply that took it after all gives it back.
fn give_up<H: Host>(filter: &mut Filter<H>, context_id: u32, now_ms: u64) {
    let Some(waiting) = filter.inflight.waiting.get_mut(&context_id) else { return };
    let until_ms = forget_at(&filter.host, &waiting.route).max(now_ms);
    for (index, asked) in waiting.asked.iter_mut().enumerate() {
        if asked.taken.is_none() && !asked.failed {
            asked.failed = true;
            let held = held_of(&waiting.route, asked);
            filter.inflight.orphans.push((context_id, index, held, until_ms));
        }
    }
}

/// The tick: ends the waits past their deadline (their calls failed), gives the released permits back
/// (one call per semaphore) and, every third of the shortest lease, extends the leases of the permits
/// held (one call per semaphore).
pub(super) fn on_tick<H: Host>(filter: &mut Filter<H>, now_ms: u64) {
    if filter.inflight.is_idle() && filter.permit_outbox.is_idle() {
        return;
    }
    end_waits(filter, now_ms, false);
    filter.inflight.orphans.retain(|(_, _, _, deadline_ms)| *deadline_ms > now_ms);
    // A call whose reply never came (its wait ended above; a release or an extension nobody waits for).
    let forgotten: Vec<u64> = filter
        .inflight
        .calls
        .iter()
        .filter(|(_, (_, _, forget_ms))| *forget_ms <= now_ms)
        .map(|(key, _)| *key)
        .collect();
    // One error per call (its requests' waits ended above, in the failure mode).
    filter.metrics.redis_errors(&filter.host, forgotten.len());
    for key in forgotten {
        if let Some((AcquireCall { destination, .. }, _, _)) = filter.inflight.calls.remove(&key) {
            // Its requests' waits ended above; the destination takes the next acquires.
            filter.inflight.busy.retain(|d| *d != destination);
            if filter.inflight.queues.iter().any(|(d, _)| *d == destination) {
                flush(filter, destination, Invocation::BySha, None);
            }
        }
    }
    let released = super::permit_outbox::release(filter, now_ms);
    filter.inflight.counters.count(&filter.host, InflightCounter::Released, released as u64);
    if !filter.inflight.held.is_empty() && now_ms >= filter.inflight.next_extend_ms {
        let held: Vec<Held> = filter.inflight.held.values().flatten().cloned().collect();
        let shortest_ms = held.iter().map(|h| h.lease_ms).min().unwrap_or(0);
        let extended = super::permit_outbox::extend(filter, &held, now_ms);
        filter.inflight.counters.count(&filter.host, InflightCounter::Extended, extended as u64);
        filter.inflight.next_extend_ms = now_ms.saturating_add(shortest_ms / 3);
    }
}

#[cfg(test)]
#[path = "inflight_tests.rs"]
mod tests;
