//! In-flight rules (`max_in_flight`; docs/configuration.md, "In-flight limits"): before its rate rules, a
//! request takes one permit of each in-flight rule's semaphore ([`crate::script::SEMAPHORE_ACQUIRE`]; acquires
//! coalesced with the rate acquires, [`calls`]) and holds it until its stream ends ([`on_done`]); [`super::permit_outbox`]
//! gives permits back and extends leases from the tick. A refusal is answered at once; a failed call follows
//! `failure_mode` (`local`: the process's own count, [`super::permit_outbox::take_local`]).

use alloc::rc::Rc;

use crate::prelude::*;

use crate::config::{FailureMode, InflightApplies, Mode};
use crate::host::Host;
use crate::id_map::IdMap;
use crate::limiter::RuleOutcome;
use crate::script::SemaphoreOutcome;

use super::flow::{HostRequest, Origin};
use super::metrics::{InflightCounter, InflightCounters, Metrics};
use super::permit_outbox::{destination, give_back, take_local, Destination, Held, PermitId};
use super::route::Route;
use super::with_context;
use super::{Action, Filter, DEADLINE_GRACE_MS};

mod calls;
mod joined;
pub(super) use calls::{answer_coalesced, answer_permit, joined_permits};
use joined::{drop_joined_flow, gates, start_joined};
pub(super) use joined::{end_joined, rides, sends_failed};

/// One permit a request asked for.
#[derive(Debug, Clone)]
struct Asked {
    /// The rule's index in the configuration's `inflight`.
    rule: usize,
    /// The semaphore's name.
    name: String,
    id: PermitId,
    /// `Some(true)` taken, `Some(false)` refused, `None` waiting (or failed: `failed` says; or not asked:
    /// `skipped` says).
    taken: Option<bool>,
    failed: bool,
    /// Not asked: it rode with a permit of the same request that Redis refused (the gate closed).
    skipped: bool,
    /// Permits free after the acquire (0 when it failed or none was left).
    free: u64,
    /// Decided by the process's own count (the degraded mode) at this time, ms.
    local_ms: Option<u64>,
}

/// How a request's permits go to Redis.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Joined {
    /// In calls of their own, before the rate stage starts.
    Alone,
    /// With the request's rate acquire, in its batch: not sent yet (its acquire waits for a batch).
    Riding,
    /// With the request's rate acquire, sent: the acquire runs only if the permits that gate it were taken.
    Sent,
}

/// A request waiting for its in-flight permits.
#[derive(Debug)]
struct Waiting {
    route: Rc<Route>,
    asked: Vec<Asked>,
    joined: Joined,
    /// A body follows the headers (the rate stage may wait for it).
    body_follows: bool,
    /// When its headers arrived ([`super::metrics::Metrics::clock`]).
    since_us: u64,
    /// When the tick ends its calls still waiting, ms since the epoch.
    deadline_ms: u64,
}

/// The in-flight state of one filter: requests waiting for permits (their acquires in the coalescer's
/// queues and batches), permits held by running requests, and permits to give back on the next tick.
#[derive(Debug, Default)]
pub(super) struct Inflight {
    waiting: IdMap<Waiting>,
    pub(super) held: IdMap<Vec<Held>>,
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

    /// Request `context_id` holds these permits (none: nothing): the leases of those taken in Redis are
    /// extended within a third of the shortest, whatever the permits held before wait for (the degraded
    /// mode's local permits have none).
    pub(super) fn hold(&mut self, context_id: u32, held: Vec<Held>, now_ms: u64) {
        if held.is_empty() {
            return;
        }
        if let Some(lease_ms) = held.iter().filter(|h| h.local_ms.is_none()).map(|h| h.lease_ms).min() {
            let due_ms = now_ms.saturating_add(lease_ms / 3);
            self.next_extend_ms = if self.held.is_empty() { due_ms } else { self.next_extend_ms.min(due_ms) };
        }
        self.held.insert(context_id, held);
    }

    /// Counts `count` permits given back by a call that carried them ([`super::permit_outbox::take_releases`]).
    pub(super) fn released(&self, host: &impl Host, count: usize) {
        self.counters.count(host, InflightCounter::Released, count as u64);
    }

    /// Whether request `context_id` waits for its permits (its headers held).
    pub(super) fn waits(&self, context_id: u32) -> bool {
        self.waiting.contains_key(&context_id)
    }

    /// Request `context_id`'s permits that ride with its rate acquire went out with it.
    pub(super) fn permits_sent(&mut self, context_id: u32) {
        if let Some(waiting) = self.waiting.get_mut(&context_id).filter(|w| w.joined == Joined::Riding) {
            waiting.joined = Joined::Sent;
        }
    }

    /// Whether nothing waits for the tick: no request waits, no permit is held or to give back, no call
    /// is on its way.
    pub(super) fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.held.is_empty() && self.orphans.is_empty()
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
    for (index, rule) in route.config.inflight.iter().enumerate() {
        let name = match rule.applies(&request) {
            InflightApplies::Exempt | InflightApplies::NoKey => continue,
            InflightApplies::Denied => {
                let counters = filter.inflight.counters;
                super::end::reject_inflight(filter, route, index, Mode::Enforce, false, counters);
                return Some(Action::Pause);
            }
            InflightApplies::Semaphore { name } => name,
        };
        let id = super::ids::permit_id(&filter.permit_prefix, &mut filter.random);
        asked.push(Asked {
            rule: index,
            name,
            id,
            taken: None,
            failed: false,
            skipped: false,
            free: 0,
            local_ms: None,
        });
    }
    if asked.is_empty() {
        return None;
    }
    let now_ms = filter.host.now_ms();
    // A request a rate rule's local block rejects takes no permit: rejected now, as its rate rules would
    // (their keys and reservations known from the headers alone). A joined start finds it itself.
    if !route.reads_body && !route.joins_permits {
        let request = HostRequest { host: &filter.host, body: None, headers: None };
        let blocked =
            with_context!(filter, route, now_ms, false, |ctx| crate::limiter::rejected_by_a_block(&ctx, &request));
        if let Some(decision) = blocked {
            let next = super::end::finish(filter, context_id, route, decision, since_us);
            return Some(super::end::end(filter, context_id, route, next, Origin::Callback));
        }
    }
    let deadline_ms = now_ms.saturating_add(route.config.redis.timeout_ms).saturating_add(DEADLINE_GRACE_MS);
    // The degraded mode's circuit is open: decided by the process's own count, without a call.
    let local = route.skips_redis(now_ms);
    if local {
        asked.iter_mut().for_each(|asked| take_locally(&filter.host, route, asked, now_ms));
    }
    // The permits of each destination, in one call or into its next batch.
    let destinations = if local { Vec::new() } else { by_destination(route, &asked) };
    let joined = match destinations.as_slice() {
        [(destination, _)] if route.joins_permits => Some(destination.1),
        _ => None,
    };
    let waiting =
        Waiting { route: Rc::clone(route), asked, joined: Joined::Alone, body_follows, since_us, deadline_ms };
    filter.inflight.waiting.insert(context_id, waiting);
    if let Some(slot) = joined {
        if let Some(action) = start_joined(filter, context_id, route, since_us, slot) {
            return Some(action);
        }
    }
    for (destination, indexes) in destinations {
        calls::acquire(filter, context_id, destination, &indexes);
    }
    super::tick::start(filter);
    Some(conclude_if_answered(filter, context_id, true).unwrap_or(Action::Pause))
}

/// The indexes of permits `asked` of a request of `route` by destination, in first-seen order.
fn by_destination(route: &Route, asked: &[Asked]) -> Vec<(Destination, Vec<usize>)> {
    let mut destinations: Vec<(Destination, Vec<usize>)> = Vec::new();
    for (index, asked) in asked.iter().enumerate() {
        let destination = destination(route, &asked.name);
        match destinations.iter_mut().find(|(d, _)| *d == destination) {
            Some((_, indexes)) => indexes.push(index),
            None => destinations.push((destination, vec![index])),
        }
    }
    destinations
}

/// Request `context_id`'s permit `index` was answered: taken or refused (a request gone releases a permit
/// taken for it).
fn answered<H: Host>(filter: &mut Filter<H>, context_id: u32, index: usize, outcome: SemaphoreOutcome) {
    let (taken, free) = match outcome {
        SemaphoreOutcome::Taken { free } => (true, free),
        SemaphoreOutcome::Refused { free, .. } => (false, free),
    };
    let Some(asked) = filter.inflight.waiting.get_mut(&context_id).and_then(|w| w.asked.get_mut(index)) else {
        // The request ended first: a permit its acquire took goes back (again: its release may have run
        // before the acquire).
        let orphans = &mut filter.inflight.orphans;
        if let Some(at) = orphans.iter().position(|(c, i, _, _)| *c == context_id && *i == index) {
            let (_, _, held, _) = orphans.swap_remove(at);
            filter.metrics.late_given_back(&filter.host, usize::from(taken));
            filter.permit_outbox.releases.extend(taken.then_some(held));
        }
        return;
    };
    asked.taken = Some(taken);
    asked.free = u64::try_from(free).unwrap_or(0);
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
    if waiting.asked.iter().any(|asked| asked.taken.is_none() && !asked.failed && !asked.skipped) {
        return None;
    }
    let joined = waiting.joined;
    if !callback && filter.host.set_effective_context(context_id).is_err() {
        // Decided, but not delivered: the next tick tries again (the request's end gives its permits back),
        // its rate stage anew (a rate acquire that rode with its permits is given back when it answers).
        super::metrics::host_refused(filter, "proxy_set_effective_context");
        drop_joined_flow(filter, context_id, joined);
        if let Some(waiting) = filter.inflight.waiting.get_mut(&context_id) {
            (waiting.deadline_ms, waiting.joined) = (0, Joined::Alone);
        }
        super::tick::start(filter);
        return Some(Action::Pause);
    }
    let mut waiting = filter.inflight.waiting.remove(&context_id)?;
    let route = Rc::clone(&waiting.route);
    let now_ms = filter.host.now_ms();
    let failed = waiting.asked.iter().any(|asked| asked.failed);
    let by_redis = waiting.asked.iter().any(|asked| asked.taken.is_some() && asked.local_ms.is_none());
    route.circuit_learns(now_ms, failed, by_redis);
    if failed && route.config.failure_mode == FailureMode::Local {
        let unanswered = waiting.asked.iter_mut().filter(|asked| asked.failed && asked.taken.is_none());
        unanswered.for_each(|asked| take_locally(&filter.host, &route, asked, now_ms));
    }
    let refused = |mode: Mode| {
        waiting.asked.iter().find(|asked| {
            asked.taken == Some(false) && route.config.inflight.get(asked.rule).is_some_and(|rule| rule.mode == mode)
        })
    };
    let outcomes = waiting.asked.iter().filter(|asked| !asked.skipped).map(|asked| {
        let shadow = route.config.inflight.get(asked.rule).is_some_and(|rule| rule.mode == Mode::Shadow);
        (route.config.rules.len() + asked.rule, RuleOutcome::of_permit(asked.taken, shadow))
    });
    Metrics::rules_counted(&filter.host, &route.rule_metrics, outcomes);
    if let Some(asked) = refused(Mode::Enforce) {
        let (rule, local) = (asked.rule, asked.local_ms.is_some());
        release_taken(filter, &waiting);
        drop_joined_flow(filter, context_id, waiting.joined);
        super::end::reject_inflight(filter, &route, rule, Mode::Enforce, local, filter.inflight.counters);
        return Some(Action::Pause);
    }
    if failed && route.config.failure_mode == FailureMode::Deny {
        release_taken(filter, &waiting);
        drop_joined_flow(filter, context_id, waiting.joined);
        filter.metrics.decided(&filter.host, crate::limiter::Outcome::FailedClosed);
        let (status, grpc) = (route.config.failure_status, Some(route.config.grpc.failure_status));
        super::end::answer(filter, status, &[], route.plan.failure_body.as_bytes(), grpc, None);
        return Some(Action::Pause);
    }
    if let Some(asked) = refused(Mode::Shadow) {
        super::end::reject_inflight(filter, &route, asked.rule, Mode::Shadow, false, filter.inflight.counters);
    }
    let held: Vec<Held> =
        waiting.asked.iter().filter(|asked| asked.taken == Some(true)).map(|asked| held_of(&route, asked)).collect();
    filter.inflight.counters.count(&filter.host, InflightCounter::Admitted, held.len() as u64);
    filter.inflight.hold(context_id, held, now_ms);
    match waiting.joined {
        Joined::Alone => {}
        // The call that carried its permits and its rate acquire was refused by the host, from the request's
        // own start: its rate stage asks again on its own.
        Joined::Sent | Joined::Riding if callback => drop_joined_flow(filter, context_id, waiting.joined),
        // Its rate acquire ran in the same call (its reply follows), failed with it, or still waits for a
        // batch: its flow decides, by its reply or its deadline.
        Joined::Sent | Joined::Riding => return Some(Action::Pause),
    }
    Some(filter.start_rates(context_id, route, waiting.body_follows, waiting.since_us))
}

/// The permit `asked` of a request of `route`, as held.
fn held_of(route: &Rc<Route>, asked: &Asked) -> Held {
    let lease_ms = route.config.inflight.get(asked.rule).map_or(0, |rule| rule.lease_ms);
    let (name, id, rule, free, local_ms) = (asked.name.clone(), asked.id, asked.rule, asked.free, asked.local_ms);
    Held { route: Rc::clone(route), name, id, lease_ms, rule, free, local_ms }
}

/// Decides permit `asked` by the process's own count (the degraded mode).
fn take_locally(host: &impl Host, route: &Route, asked: &mut Asked, now_ms: u64) {
    let max_in_flight = route.config.inflight.get(asked.rule).map_or(0, |rule| rule.max_in_flight);
    let taken = take_local(host, route, &asked.name, max_in_flight, now_ms);
    (asked.taken, asked.local_ms) = (Some(taken), Some(now_ms));
}

/// Gives `held` back (to the process's count at once, or to Redis from the tick), counted when local.
fn give_back_held<H: Host>(filter: &mut Filter<H>, held: Held) {
    if give_back(filter, held) {
        filter.inflight.counters.count(&filter.host, InflightCounter::Released, 1);
    }
}

/// Until when the permit of a request that no longer waits for it is remembered (an orphan), ms since the
/// epoch: past the latest end of the batch carrying it (sent at the latest now: the coalescer gives it up
/// after twice `redis.timeout` and the grace), so that a reply that took it gives it back.
fn orphan_until(host: &impl Host, route: &Route) -> u64 {
    super::coalesce::expiry(host, route).saturating_add(u64::from(super::TICK_MS))
}

/// Moves the permits request `waiting` took to the releases.
fn release_taken<H: Host>(filter: &mut Filter<H>, waiting: &Waiting) {
    for asked in waiting.asked.iter().filter(|asked| asked.taken == Some(true)) {
        give_back_held(filter, held_of(&waiting.route, asked));
    }
}

/// `proxy_on_done` of request `context_id`: its permits go back on the next tick (those still waiting for
/// their reply too: taken, they are released; refused, the release changes nothing).
pub(super) fn on_done<H: Host>(filter: &mut Filter<H>, context_id: u32) {
    if filter.inflight.is_idle() {
        return;
    }
    if let Some(waiting) = filter.inflight.waiting.remove(&context_id) {
        filter.coalescer.forget_permits(context_id);
        // Permits that rode with a rate acquire still waiting for its batch were never sent.
        let sent = waiting.joined != Joined::Riding;
        let holds = |asked: &Asked| sent && asked.taken != Some(false) && !asked.skipped;
        for (index, asked) in waiting.asked.iter().enumerate().filter(|(_, asked)| holds(asked)) {
            let held = held_of(&waiting.route, asked);
            if asked.taken.is_none() && !asked.failed {
                let until_ms = orphan_until(&filter.host, &waiting.route).max(waiting.deadline_ms);
                filter.inflight.orphans.push((context_id, index, held.clone(), until_ms));
            }
            give_back_held(filter, held);
        }
    }
    for held in filter.inflight.held.remove(&context_id).unwrap_or_default() {
        give_back_held(filter, held);
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
    filter.coalescer.forget_permits(context_id);
    let until_ms = orphan_until(&filter.host, &waiting.route).max(now_ms);
    // Permits that rode with a rate acquire still waiting for its batch were never sent: no orphans.
    let sent = waiting.joined != Joined::Riding;
    for (index, asked) in waiting.asked.iter_mut().enumerate() {
        if asked.taken.is_none() && !asked.failed && !asked.skipped {
            asked.failed = true;
            let held = held_of(&waiting.route, asked);
            filter.inflight.orphans.extend(sent.then_some((context_id, index, held, until_ms)));
        }
    }
}

/// The tick: ends the waits past their deadline (their calls failed), gives the released permits back
/// (one call per semaphore) and, every third of the shortest lease, extends the leases of the permits
/// held (one call per semaphore).
pub(super) fn on_tick<H: Host>(filter: &mut Filter<H>, now_ms: u64) {
    answer_coalesced(filter);
    if filter.inflight.is_idle() && filter.permit_outbox.is_idle() {
        return;
    }
    end_waits(filter, now_ms, false);
    let orphans = filter.inflight.orphans.len();
    filter.inflight.orphans.retain(|(_, _, _, deadline_ms)| *deadline_ms > now_ms);
    filter.metrics.late_unanswered(&filter.host, orphans - filter.inflight.orphans.len());
    let busy = filter.coalescer.busy();
    let released = super::permit_outbox::release(filter, now_ms, &busy);
    filter.inflight.counters.count(&filter.host, InflightCounter::Released, released as u64);
    if !filter.inflight.held.is_empty() && now_ms >= filter.inflight.next_extend_ms {
        let held: Vec<Held> =
            filter.inflight.held.values().flatten().filter(|held| held.local_ms.is_none()).cloned().collect();
        let shortest_ms = held.iter().map(|h| h.lease_ms).min();
        let extended = super::permit_outbox::extend(filter, &held, now_ms);
        filter.inflight.counters.count(&filter.host, InflightCounter::Extended, extended as u64);
        // Only local permits held: nothing to extend until a request takes one in Redis (`hold`).
        filter.inflight.next_extend_ms = shortest_ms.map_or(u64::MAX, |ms| now_ms.saturating_add(ms / 3));
    }
}

#[cfg(test)]
#[path = "inflight_tests.rs"]
mod tests;
