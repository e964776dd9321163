//! Request coalescing (docs/configuration.md, "Request coalescing"): while this VM has
//! `redis.max_in_flight` acquire calls on their way to one destination (a route's Redis, or one hash slot
//! of it with Redis Cluster), the calls of further requests wait in arrival order; when a call ends, the
//! waiting ones go out together in one [`crate::script::ACQUIRE_BATCH`] call ([`flush`]). Each call in a
//! batch is the very command it would have been alone, and its part of the batch's reply is the very reply
//! it would have had ([`crate::script::split_batch_reply`]), so each request is decided as it is alone,
//! in that order. No timer: on an idle VM a call goes out at once.
//!
//! The acquires of in-flight permits (`super::inflight`) share the lanes: while a destination is busy,
//! a permit's [`crate::script::SEMAPHORE_ACQUIRE`] waits in the same queue and goes in the same batches
//! ([`Member::Permit`]); its part of a batch's reply is left in [`Coalescer::permit_replies`] for the
//! in-flight stage to read.

use alloc::collections::VecDeque;
use alloc::rc::Rc;

use crate::prelude::*;

use crate::host::Host;
use crate::script::{Invocation, Layout};
use crate::transport::Failure;

use super::flow::{advance, feed, Call, Origin};
use super::give_back::GiveBackCall;
use super::outbox::{settles_failed, take_settles};
use super::route::{Route, Transport};
use super::{Filter, DEADLINE_GRACE_MS};

mod batch;
pub(super) use batch::{on_batch_reply, send_carrying};
use batch::{send_alone, send_batch, take_batch, Commands};

/// Where calls are coalesced: a route's index and the hash slot of the call's limiters (0 without Redis
/// Cluster).
pub(super) type Destination = (usize, u16);

/// A call waiting for a batch, or in one.
#[derive(Debug, Clone)]
pub(super) enum Member {
    /// An acquire of a request's rate rules ([`super::flow`]).
    Rate(Call),
    /// An in-flight permit's acquire.
    Permit(PermitCall),
}

impl Member {
    fn context_id(&self) -> u32 {
        match self {
            Member::Rate(call) => call.context_id,
            Member::Permit(permit) => permit.context_id,
        }
    }
}

/// An in-flight permit's acquire in the coalescer: the request (HTTP context id), the permit's index in it,
/// its own [`crate::script::SEMAPHORE_ACQUIRE`] command of one permit (by sha, in the route's encoding,
/// stamped when it was queued) and where its keys are, its route, and when its request's wait ends (ms
/// since the epoch). `gone`: its request no longer waits for it (a batch sent again after `NOSCRIPT`
/// leaves it out; a reply that took it still reaches the in-flight stage, which gives it back). `joined`:
/// it rides with its request's rate acquire, right before it in the batch (its reply answered before the
/// acquire's), and `gates`: that acquire runs only if it was taken ([`crate::script::Gate`]; an
/// `Enforce` rule's permit).
#[derive(Debug, Clone)]
pub(super) struct PermitCall {
    pub(super) context_id: u32,
    pub(super) index: usize,
    pub(super) command: (Vec<u8>, Layout),
    pub(super) route: Rc<Route>,
    pub(super) deadline_ms: u64,
    pub(super) gone: bool,
    pub(super) joined: bool,
    pub(super) gates: bool,
}

/// A permit's reply from a batch, for the in-flight stage: request, permit index, its part of the reply
/// (or the batch's failure), and whether that failure is the first of its call (counted once).
pub(super) type PermitReply = (u32, usize, Result<Vec<u8>, Failure>, bool);

/// The calls of one batch on their way: in segment order; a request that ended meanwhile (its client
/// left, its deadline passed) leaves a hole, and its part of the reply is dropped (a permit's is kept: a
/// permit taken for a request that ended is given back).
#[derive(Debug)]
pub(super) struct Batch {
    route: Rc<Route>,
    destination: Destination,
    /// Settles taken from the outbox for this destination ([`take_settles`]): the batch's first segments.
    settles: Vec<GiveBackCall>,
    /// In-flight permits given back, taken from the permit outbox for this destination
    /// ([`super::permit_outbox::take_releases`]): one SEMAPHORE_RELEASE segment after the settles.
    released: Vec<super::permit_outbox::Held>,
    members: Vec<Option<Member>>,
    /// Members whose requests stopped waiting (their place in `members`, now `None`): their replies go to
    /// [`super::late`], which gives back what they took.
    late: Vec<(usize, Call)>,
    /// Whether it was sent by source (after `NOSCRIPT`): a second `NOSCRIPT` is every member's reply.
    by_source: bool,
    /// Whether a member's request counted the call's failure already (its deadline ended it unanswered).
    counted: bool,
    /// When it was sent ([`super::metrics::Metrics::clock`]).
    pub(super) sent_us: u64,
}

/// Lanes kept while idle (their round trip remembered); past that, idle lanes are dropped.
const MAX_LANES: usize = 64;

/// One destination's calls on their way.
#[derive(Debug, Clone, Copy)]
struct Lane {
    destination: Destination,
    /// Acquire calls on their way.
    in_flight: u32,
    /// How long its calls took lately, ms: rises at once to a slower call, falls by an eighth of the gap
    /// per faster one (a guess that errs long, for the deadlines).
    round_trip_ms: u64,
}

/// A counted call on its way.
#[derive(Debug, Clone, Copy)]
struct Counted {
    /// [`crate::transport::CallId::key`].
    key: u64,
    destination: Destination,
    sent_ms: u64,
    /// When it is given up if no reply comes (ms since the epoch).
    expires_ms: u64,
}

/// This VM's coalescing state, for every destination. A few calls per destination are out at a time
/// (`max_in_flight`): lists, not maps.
#[derive(Debug, Default)]
pub(super) struct Coalescer {
    lanes: Vec<Lane>,
    counted: Vec<Counted>,
    /// Batches on their way, by [`crate::transport::CallId::key`].
    batches: Vec<(u64, Batch)>,
    /// Calls waiting for a batch, in arrival order.
    waiting: VecDeque<(Destination, Member)>,
    /// The replies of permits in batches that landed, not yet read by the in-flight stage.
    pub(super) permit_replies: Vec<PermitReply>,
}

impl Coalescer {
    /// Whether a call for `destination` at `now_ms` of a request that must be decided by `deadline_ms` waits
    /// for the next batch: `max_in_flight` calls are out, and waiting for one to end and then for the batch
    /// (twice the longer of the destination's recent round trip and the age of its oldest call out) still
    /// ends before the deadline. Otherwise it goes out at once: when Redis is slow against `redis.timeout`,
    /// coalescing steps aside rather than fail requests.
    pub(super) fn waits(&self, destination: Destination, max_in_flight: u32, now_ms: u64, deadline_ms: u64) -> bool {
        let Some(lane) = self.lanes.iter().find(|l| l.destination == destination) else { return false };
        lane.in_flight >= max_in_flight && now_ms.saturating_add(2 * self.expected_ms(lane, now_ms)) < deadline_ms
    }

    /// How long the next call of `lane` may take: its recent round trip, or longer if a call has been out
    /// longer than that.
    fn expected_ms(&self, lane: &Lane, now_ms: u64) -> u64 {
        let oldest = self.counted.iter().filter(|c| c.destination == lane.destination).map(|c| c.sent_ms).min();
        lane.round_trip_ms.max(oldest.map_or(0, |sent_ms| now_ms.saturating_sub(sent_ms)))
    }

    /// Whether a call of request `context_id` waits for a batch of `destination` (a lane that has a call
    /// out: the batch goes when it lands).
    pub(super) fn is_waiting(&self, context_id: u32, destination: Destination) -> bool {
        !self.waiting.is_empty()
            && self.waiting.iter().any(|(d, member)| *d == destination && member.context_id() == context_id)
    }

    /// A call waits for the next batch of `destination`.
    pub(super) fn wait(&mut self, destination: Destination, member: Member) {
        self.waiting.push_back((destination, member));
    }

    /// Request `context_id`'s permits no longer wait (it ended, or its wait did): out of the queue, and
    /// marked gone in the batches on their way (their replies still come: what they took is given back).
    pub(super) fn forget_permits(&mut self, context_id: u32) {
        if !self.waiting.is_empty() {
            self.waiting.retain(|(_, member)| !matches!(member, Member::Permit(p) if p.context_id == context_id));
        }
        for (_, batch) in &mut self.batches {
            for member in batch.members.iter_mut().flatten() {
                if let Member::Permit(permit) = member {
                    permit.gone |= permit.context_id == context_id;
                }
            }
        }
    }

    /// Call `key` to `destination` went out at `sent_ms`; given up at `expires_ms` if no reply comes.
    pub(super) fn sent(&mut self, key: u64, destination: Destination, sent_ms: u64, expires_ms: u64) {
        self.counted.push(Counted { key, destination, sent_ms, expires_ms });
        match self.lanes.iter_mut().find(|l| l.destination == destination) {
            Some(lane) => lane.in_flight += 1,
            None => self.lanes.push(Lane { destination, in_flight: 1, round_trip_ms: 0 }),
        }
    }

    /// Call `key` ended at `now_ms` (its reply came, or it was given up): its destination, if it was counted.
    pub(super) fn landed(&mut self, key: u64, now_ms: u64) -> Option<Destination> {
        let at = self.counted.iter().position(|c| c.key == key)?;
        let call = self.counted.swap_remove(at);
        if let Some(lane) = self.lanes.iter_mut().find(|l| l.destination == call.destination) {
            lane.in_flight = lane.in_flight.saturating_sub(1);
            let took = now_ms.saturating_sub(call.sent_ms);
            lane.round_trip_ms =
                if took >= lane.round_trip_ms { took } else { lane.round_trip_ms - (lane.round_trip_ms - took) / 8 };
        }
        if self.lanes.len() > MAX_LANES {
            // With Redis Cluster a lane per hash slot seen: the idle ones go (a lane with calls waiting has
            // one out), so that finding a lane stays cheap.
            self.lanes.retain(|lane| lane.in_flight > 0);
        }
        Some(call.destination)
    }

    /// The batch of call `key`, if it is one.
    pub(super) fn take_batch(&mut self, key: u64) -> Option<Batch> {
        let at = self.batches.iter().position(|(k, _)| *k == key)?;
        Some(self.batches.swap_remove(at).1)
    }

    /// The batches of calls `tokens` (a request's, ended at its deadline, which counted their failure):
    /// their failure is counted already.
    pub(super) fn counted(&mut self, tokens: &[u64]) {
        for (_, batch) in self.batches.iter_mut().filter(|(key, _)| tokens.contains(key)) {
            batch.counted = true;
        }
    }

    /// Forgets request `context_id` (it ended): out of the waiting calls, and a hole in its batches
    /// (`tokens`: its outstanding calls).
    pub(super) fn forget(&mut self, context_id: u32, tokens: &[u64]) {
        if !self.waiting.is_empty() {
            self.waiting.retain(|(_, member)| !matches!(member, Member::Rate(c) if c.context_id == context_id));
        }
        for token in tokens {
            if let Some((_, batch)) = self.batches.iter_mut().find(|(k, _)| k == token) {
                for (position, member) in batch.members.iter_mut().enumerate() {
                    if let Some(Member::Rate(call)) = member {
                        if call.context_id == context_id {
                            batch.late.push((position, *call));
                            *member = None;
                        }
                    }
                }
            }
        }
    }

    /// The counted calls past their expiry (a host that never answered): no longer counted; their
    /// destinations, to send what waits for them, each with the settles its batch carried and whether
    /// their failure is the call's one error.
    fn expire(
        &mut self,
        now_ms: u64,
        released: &mut Vec<super::permit_outbox::Held>,
    ) -> Vec<(Destination, Vec<GiveBackCall>, bool)> {
        if self.counted.is_empty() {
            return Vec::new();
        }
        let expired: Vec<u64> = self.counted.iter().filter(|c| c.expires_ms <= now_ms).map(|c| c.key).collect();
        expired
            .into_iter()
            .filter_map(|key| {
                // Its permits fail (their requests' waits ended already). One error for the call: its rate
                // calls' requests counted theirs when their deadline ended them. The releases it carried are
                // given back again (one that ran changes nothing).
                let batch = self.take_batch(key);
                let (members, settles, counted) = batch
                    .map(|batch| {
                        released.extend(batch.released);
                        (batch.members, batch.settles, batch.counted)
                    })
                    .unwrap_or_default();
                let counted = counted || members.iter().flatten().any(|member| matches!(member, Member::Rate(_)));
                let mut permits = 0;
                for member in members.into_iter().flatten() {
                    if let Member::Permit(permit) = member {
                        let count = permits == 0 && !counted;
                        self.permit_replies.push((permit.context_id, permit.index, Err(Failure::TimedOut), count));
                        permits += 1;
                    }
                }
                let settles_count = !counted && permits == 0;
                self.landed(key, now_ms).map(|destination| (destination, settles, settles_count))
            })
            .collect()
    }

    /// The destinations whose waiting calls must go out now, whatever is in flight: a request among them
    /// would otherwise miss its deadline (`deadline_of` a rate call's request, ms; a permit's its own)
    /// waiting for the calls out, which take longer than expected (Redis became slow).
    pub(super) fn overdue(&self, now_ms: u64, deadline_of: impl Fn(u32) -> Option<u64>) -> Vec<Destination> {
        let mut due: Vec<Destination> = Vec::new();
        for (destination, member) in &self.waiting {
            if due.contains(destination) {
                continue;
            }
            let Some(lane) = self.lanes.iter().find(|l| l.destination == *destination) else { continue };
            let deadline_ms = match member {
                Member::Rate(call) => deadline_of(call.context_id).unwrap_or(0),
                Member::Permit(permit) => permit.deadline_ms,
            };
            if now_ms.saturating_add(2 * self.expected_ms(lane, now_ms)) >= deadline_ms {
                due.push(*destination);
            }
        }
        due
    }

    /// The destinations with a call on its way (its landing sends what waits for them).
    pub(super) fn busy(&self) -> Vec<Destination> {
        self.lanes.iter().filter(|lane| lane.in_flight > 0).map(|lane| lane.destination).collect()
    }

    /// Whether calls wait or are counted (the tick must go on).
    pub(super) fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.counted.is_empty() && self.permit_replies.is_empty()
    }
}

/// Gives up the calls never answered by `now_ms` (on the tick): the settles they carried fail (their
/// reservations stay), and what waits for their destinations goes out.
pub(super) fn expire<H: Host>(filter: &mut Filter<H>, now_ms: u64) {
    let mut released = Vec::new();
    for (destination, settles, count) in filter.coalescer.expire(now_ms, &mut released) {
        settles_failed(filter, settles, &Failure::TimedOut, count);
        flush(filter, destination, false);
    }
    filter.permit_outbox.releases.extend(released);
}

/// Sends at once what waits for destinations where a request would otherwise miss its deadline
/// ([`Coalescer::overdue`]); on the tick.
pub(super) fn send_overdue<H: Host>(filter: &mut Filter<H>) {
    if filter.coalescer.waiting.is_empty() {
        return;
    }
    let now_ms = filter.host.now_ms();
    let flows = &filter.flows;
    let overdue = filter.coalescer.overdue(now_ms, |context_id| flows.get(&context_id).map(|f| f.deadline_ms));
    for destination in overdue {
        flush(filter, destination, true);
    }
}

/// When a call sent now is given up if no reply comes: twice the route's timeout (the host's own timeout
/// answers first).
pub(super) fn expiry(host: &impl Host, route: &Route) -> u64 {
    let timeout_ms = route.config.redis.timeout_ms;
    host.now_ms().saturating_add(timeout_ms.saturating_mul(2)).saturating_add(DEADLINE_GRACE_MS)
}

/// Sends what waits for `destination` while it has room (`now`: all of it, room or not): batches of at
/// most `max_batch` calls and about `max_batch_bytes` bytes, in arrival order (a lone call goes as itself).
pub(super) fn flush<H: Host>(filter: &mut Filter<H>, destination: Destination, now: bool) {
    loop {
        let Some(route) = next_route(filter, destination) else { return };
        let coalescing = route.config.redis.coalescing;
        let room = filter
            .coalescer
            .lanes
            .iter()
            .find(|l| l.destination == destination)
            .is_none_or(|lane| lane.in_flight < coalescing.max_in_flight);
        if !room && !now {
            return;
        }
        let (members, commands) = take_batch(filter, &route, destination);
        if members.is_empty() {
            return;
        }
        let max = coalescing.max_batch as usize;
        let settles = if max > 1 { take_settles(filter, &route, destination.1, max) } else { Vec::new() };
        let released = super::permit_outbox::take_releases(filter, &route, destination);
        match (members.as_slice(), commands.as_slice()) {
            // A lone permit goes in a batch of one: its reply reaches the in-flight stage the same way.
            ([Member::Rate(only)], [(command, _)]) if settles.is_empty() && released.is_empty() => {
                send_alone(filter, &route, destination, *only, command)
            }
            _ => {
                let batch = Batch {
                    route,
                    destination,
                    settles,
                    released,
                    members: members.into_iter().map(Some).collect(),
                    late: Vec::new(),
                    by_source: false,
                    counted: false,
                    sent_us: 0,
                };
                send_batch(filter, batch, &commands, Invocation::BySha);
            }
        }
    }
}

/// Sends one request's `permits` of `destination` at once, in one batch, whatever is in flight (the caller
/// asked [`Coalescer::waits`]); a refused send leaves their failures in [`Coalescer::permit_replies`].
pub(super) fn send_permits<H: Host>(
    filter: &mut Filter<H>,
    route: &Rc<Route>,
    destination: Destination,
    permits: Vec<PermitCall>,
) {
    if permits.is_empty() {
        return;
    }
    let commands: Commands = permits.iter().map(|permit| permit.command.clone()).collect();
    let members = permits.into_iter().map(|permit| Some(Member::Permit(permit))).collect();
    let max = route.config.redis.coalescing.max_batch as usize;
    // With coalescing off (`max_batch: 1`) settles and releases leave from the tick only.
    let settles = if max > 1 { take_settles(filter, route, destination.1, max) } else { Vec::new() };
    let released = super::permit_outbox::take_releases(filter, route, destination);
    let batch = Batch {
        route: Rc::clone(route),
        destination,
        settles,
        released,
        members,
        late: Vec::new(),
        by_source: false,
        counted: false,
        sent_us: 0,
    };
    send_batch(filter, batch, &commands, Invocation::BySha);
}

/// The route of the first call waiting for `destination` whose request is still there (calls of requests
/// that are gone, which ending a request removes already, are dropped here too: nothing waits forever).
fn next_route<H: Host>(filter: &mut Filter<H>, destination: Destination) -> Option<Rc<Route>> {
    let Filter { coalescer, flows, .. } = filter;
    let live = |member: &Member| match member {
        Member::Rate(call) => flows.get(&call.context_id).map(|flow| Rc::clone(&flow.route)),
        Member::Permit(permit) => Some(Rc::clone(&permit.route)),
    };
    let mut waiting = coalescer.waiting.iter().filter(|(d, _)| *d == destination);
    let route = waiting.find_map(|(_, member)| live(member));
    if route.is_none() {
        coalescer.waiting.retain(|(d, member)| *d != destination || live(member).is_some());
    }
    route
}

/// Feeds one request its reply of call `key` (none: the call was never sent) and moves it one step;
/// `count_failure`: whether a failed call counts in `redis_errors` (once per call, not per request).
pub(super) fn deliver<H: Host>(
    filter: &mut Filter<H>,
    key: Option<u64>,
    call: Call,
    reply: Result<&[u8], Failure>,
    count_failure: bool,
) {
    let Some(mut flow) = filter.flows.remove(&call.context_id) else {
        super::late::on_reply(filter, key, call, reply);
        return;
    };
    if let Some(key) = key {
        flow.tokens.retain(|&t| t != key);
    }
    if reply.as_ref().is_ok_and(|bytes| bytes.starts_with(b"-NOAUTH")) {
        if let Transport::Host(client) = &flow.route.transport {
            client.reconnect();
        }
    }
    let progress = feed(filter, &mut flow, call.call, reply, count_failure);
    advance(filter, call.context_id, flow, 0..0, progress, Origin::Reply);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// With Redis Cluster a lane per hash slot: idle lanes are dropped past [`MAX_LANES`], busy ones kept.
    #[test]
    fn idle_lanes_are_dropped_past_the_bound_and_busy_ones_kept() {
        let mut coalescer = Coalescer::default();
        coalescer.sent(1, (0, 7), 0, 1_000);
        for slot in 100..1_100u16 {
            let key = u64::from(slot);
            coalescer.sent(key, (0, slot), 0, 1_000);
            assert_eq!(coalescer.landed(key, 3), Some((0, slot)));
            assert!(coalescer.lanes.len() <= MAX_LANES + 1, "{} lanes", coalescer.lanes.len());
        }
        assert!(coalescer.waits((0, 7), 1, 10, 1_000), "the busy lane is kept: a call for it waits");
        assert!(!coalescer.waits((0, 100), 1, 10, 1_000), "an idle slot's call goes out at once");
    }
}
