//! The outbox: give-back calls that leave from the root context's tick ([`Filter::on_tick`]): settles of
//! reservations ([`super::settle`]) and the lease settlements a configuration that went away left
//! ([`Filter::adopt`]). The settles of one tick go out as one [`crate::script::ACQUIRE_BATCH`] call per
//! destination (a route's Redis, or one hash slot of a Redis Cluster), each segment a
//! [`crate::script::GIVE_BACK`] exactly as it would be sent alone, as coalesced acquires are; the reply is
//! split back into each call's own reply ([`split_batch_reply`]). A destination with one settle sends it
//! alone.
//!
//! A settle need not wait for the tick: an acquire call that leaves for its destination before the tick
//! carries it ([`take_settles`], `super::coalesce`), as segments of the acquire's batch before the
//! acquires', so a busy gateway sends no call of its own for its settles, and the permits they give back
//! are in the window before those acquires run.

use alloc::rc::Rc;

use crate::prelude::*;

use crate::host::Host;
use crate::key::hash_slot;
use crate::script::{encode_batch, split_batch_reply, Invocation, Segment};
use crate::transport::Failure;

use super::give_back::{give_back_failed, on_give_back_reply, send_give_back, GiveBackCall, GiveBackKind};
use super::route::Route;
use super::{Filter, DEADLINE_GRACE_MS, TICK_MS};

/// Settle calls sent together in one batch call, waiting for its reply.
#[derive(Debug)]
pub(super) struct GiveBackBatch {
    calls: Vec<GiveBackCall>,
    /// Whether it was sent by source (after `NOSCRIPT`).
    by_source: bool,
    /// When the tick gives up on its reply, ms since the epoch.
    deadline_ms: u64,
    /// When it was sent ([`super::metrics::Metrics::clock`]).
    pub(super) sent_us: u64,
}

/// How long a settle may wait in the outbox for an acquire call to carry it while its destination has
/// a call out (whose landing sends the calls waiting for it), ms: two ticks.
const CARRY_WAIT_MS: u64 = 2 * TICK_MS as u64;

/// Sends what the outbox holds (from the root context's tick): the settles batched per destination, the
/// rest alone. A settle younger than [`CARRY_WAIT_MS`] whose destination is among `busy` (route index,
/// slot: destinations with an acquire call out), on one of this filter's routes with coalescing on, stays
/// for an acquire call to carry it.
pub(super) fn send_queued<H: Host>(filter: &mut Filter<H>, busy: &[(usize, u16)]) {
    let now_ms = filter.host.now_ms();
    let mut groups: Vec<(*const Route, u16, Vec<GiveBackCall>)> = Vec::new();
    for call in core::mem::take(&mut filter.outbox) {
        if call.kind != GiveBackKind::Settle {
            send_give_back(filter, call);
            continue;
        }
        let slot = if call.route.config.redis.redis_cluster { hash_slot(&call.name) } else { 0 };
        if now_ms < call.queued_ms.saturating_add(CARRY_WAIT_MS)
            && call.route.config.redis.coalescing.max_batch > 1
            && busy.contains(&(call.route.index, slot))
            && filter.routes.configs().any(|(_, route)| Rc::ptr_eq(route, &call.route))
        {
            // An acquire call of this filter can carry it (a route of a configuration that went away:
            // none can).
            filter.outbox.push(call);
            continue;
        }
        let route = Rc::as_ptr(&call.route);
        match groups.iter_mut().find(|(r, s, _)| *r == route && *s == slot) {
            Some((_, _, calls)) => calls.push(call),
            None => groups.push((route, slot, vec![call])),
        }
    }
    for (_, _, mut calls) in groups {
        match calls.len() {
            1 => {
                if let Some(call) = calls.pop() {
                    send_give_back(filter, call);
                }
            }
            _ => send_batch(filter, GiveBackBatch { calls, by_source: false, deadline_ms: 0, sent_us: 0 }),
        }
    }
}

/// Takes at most `max` settles waiting in the outbox for `route`'s destination `slot` (a hash slot with
/// Redis Cluster, else 0), for an acquire call that leaves for it now; none if the outbox is empty.
pub(super) fn take_settles<H: Host>(
    filter: &mut Filter<H>,
    route: &Rc<Route>,
    slot: u16,
    max: usize,
) -> Vec<GiveBackCall> {
    let mut taken = Vec::new();
    if filter.outbox.is_empty() {
        return taken;
    }
    let cluster = route.config.redis.redis_cluster;
    let mut index = 0;
    while taken.len() < max {
        let Some(call) = filter.outbox.get(index) else { break };
        let fits = call.kind == GiveBackKind::Settle
            && Rc::ptr_eq(&call.route, route)
            && (!cluster || hash_slot(&call.name) == slot);
        if fits {
            taken.push(filter.outbox.remove(index));
        } else {
            index += 1;
        }
    }
    taken
}

/// The replies of settles that rode in an acquire batch, one each, in order.
pub(super) fn on_carried_replies<H: Host>(
    filter: &mut Filter<H>,
    settles: Vec<GiveBackCall>,
    replies: impl Iterator<Item = Vec<u8>>,
) {
    for (call, reply) in settles.into_iter().zip(replies) {
        on_give_back_reply(filter, call, Ok(reply));
    }
}

/// Settles whose call failed as a whole: their reservations stay; `count`: the call's failure is counted
/// (`redis_errors` once) and logged here.
pub(super) fn settles_failed<H: Host>(
    filter: &mut Filter<H>,
    settles: Vec<GiveBackCall>,
    failure: &Failure,
    count: bool,
) {
    if let Some(first) = settles.into_iter().next().filter(|_| count) {
        give_back_failed(filter, first, failure);
    }
}

/// Sends a batch of settle calls (by sha, or by source after `NOSCRIPT`); each call is counted once.
fn send_batch<H: Host>(filter: &mut Filter<H>, mut batch: GiveBackBatch) {
    let Some(route) = batch.calls.first().map(|call| Rc::clone(&call.route)) else { return };
    let Some(template) = route.plan.rules.first().map(|rule| &rule.template) else { return };
    let encoding = route.transport.encoding();
    let segments: Vec<Segment<'_>> =
        batch.calls.iter().map(|call| Segment::give_back(&call.name, template, &call.settlement)).collect();
    let invocation = if batch.by_source { Invocation::BySource } else { Invocation::BySha };
    let bytes = encode_batch(&segments, invocation, encoding);
    match route.transport.send(&filter.host, &bytes) {
        Ok(id) => {
            filter.metrics.redis_call(&filter.host);
            if !batch.by_source {
                // Every call of a batch is a settle: counted together, one hostcall.
                filter.metrics.batch(&filter.host, batch.calls.len());
                filter.metrics.settlements(&filter.host, batch.calls.len());
            }
            let timeout_ms = route.config.redis.timeout_ms;
            batch.deadline_ms = filter.host.now_ms().saturating_add(timeout_ms).saturating_add(DEADLINE_GRACE_MS);
            batch.sent_us = filter.metrics.clock(&filter.host);
            filter.give_back_batches.insert(id.key(), batch);
            super::tick::start(filter);
        }
        Err(failure) => batch_failed(filter, batch, &failure),
    }
}

/// The reply of a batch of settle calls: each call's own part, as if it had been sent alone; `NOSCRIPT`
/// sends the batch again by source, once; a failure of the whole call is every call's (counted once).
pub(super) fn on_batch_reply<H: Host>(
    filter: &mut Filter<H>,
    mut batch: GiveBackBatch,
    reply: Result<Vec<u8>, Failure>,
) {
    let bytes = match reply {
        Ok(bytes) => bytes,
        Err(failure) => return batch_failed(filter, batch, &failure),
    };
    if bytes.starts_with(b"-NOSCRIPT") && !batch.by_source {
        batch.by_source = true;
        return send_batch(filter, batch);
    }
    match split_batch_reply(&bytes, batch.calls.len()) {
        Ok(replies) => {
            for (call, reply) in batch.calls.into_iter().zip(replies) {
                on_give_back_reply(filter, call, Ok(reply));
            }
        }
        Err(why) => {
            let failure = if bytes.first() == Some(&b'-') {
                Failure::BadReply("the batch of settle calls answered an error".into())
            } else {
                Failure::BadReply(why.into())
            };
            batch_failed(filter, batch, &failure);
        }
    }
}

/// Batches never answered by `now_ms` fail.
pub(super) fn expire_batches<H: Host>(filter: &mut Filter<H>, now_ms: u64) {
    let late: Vec<u64> =
        filter.give_back_batches.iter().filter(|(_, b)| b.deadline_ms <= now_ms).map(|(&key, _)| key).collect();
    for key in late {
        if let Some(batch) = filter.give_back_batches.remove(&key) {
            batch_failed(filter, batch, &Failure::TimedOut);
        }
    }
}

/// A batch that failed as a whole: one failed call (`redis_errors` once), every settle's reservation stays.
fn batch_failed<H: Host>(filter: &mut Filter<H>, batch: GiveBackBatch, failure: &Failure) {
    settles_failed(filter, batch.calls, failure, true);
}
