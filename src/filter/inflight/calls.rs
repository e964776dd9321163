//! The acquire calls of in-flight permits. Each permit's [`crate::script::SEMAPHORE_ACQUIRE`] (of one permit)
//! goes out in an [`crate::script::ACQUIRE_BATCH`] call ([`super::super::coalesce`]): a request's permits of
//! one destination together at once while the destination has room (or its deadline cannot wait, or
//! coalescing is off), else each into the destination's queue, for its next batch with the rate acquires of
//! other requests. A permit goes in a batch even alone (a batch of one): one script on every path, loaded
//! once after `NOSCRIPT`.

use alloc::rc::Rc;

use crate::prelude::*;

use crate::host::Host;
use crate::script::{
    decode_semaphore_acquire_replies, encode_semaphore_acquires_laid_out, Invocation, Layout, Publish, ReplyError,
    SemaphoreAcquire,
};

use super::super::coalesce::{self, Member, PermitCall};
use super::super::permit_outbox::Destination;
use super::super::Filter;
use super::{answered, conclude_from_reply, Inflight, Joined};
use crate::transport::Failure;

/// Asks for request `context_id`'s permits `indexes`, all of `destination`, from the request's own callback:
/// sent at once, or queued for the destination's next batch. A send the host refuses fails them (the
/// request's start then concludes it: nothing else is moved from another request's callback).
pub(super) fn acquire<H: Host>(filter: &mut Filter<H>, context_id: u32, destination: Destination, indexes: &[usize]) {
    let Some(waiting) = filter.inflight.waiting.get(&context_id) else { return };
    let (route, deadline_ms) = (Rc::clone(&waiting.route), waiting.deadline_ms);
    let now_ms = filter.host.now_ms();
    let permits: Vec<PermitCall> = indexes
        .iter()
        .filter_map(|&index| {
            let command = command(&filter.inflight, context_id, index, now_ms)?;
            let route = Rc::clone(&route);
            Some(PermitCall {
                context_id,
                index,
                command,
                route,
                deadline_ms,
                gone: false,
                joined: false,
                gates: false,
            })
        })
        .collect();
    let coalescing = route.config.redis.coalescing;
    if coalescing.max_batch > 1 && filter.coalescer.waits(destination, coalescing.max_in_flight, now_ms, deadline_ms) {
        permits.into_iter().for_each(|permit| filter.coalescer.wait(destination, Member::Permit(permit)));
        return;
    }
    coalesce::send_permits(filter, &route, destination, permits);
    let replies = &mut filter.coalescer.permit_replies;
    let refused: Vec<(usize, bool)> = replies.iter().filter(|r| r.0 == context_id).map(|r| (r.1, r.3)).collect();
    replies.retain(|reply| reply.0 != context_id);
    for (index, count_failure) in refused {
        if count_failure {
            filter.metrics.redis_errors(&filter.host, 1);
        }
        fail(filter, context_id, index);
    }
}

/// The permits of request `context_id` that ride with its rate acquire and have not gone out yet, their
/// commands stamped `now_ms`, in the order they go before it: those of shadow rules first, then those that
/// gate it ([`crate::script::Gate`]). None when its permits do not ride with it, or went out already.
pub(in crate::filter) fn joined_permits(inflight: &Inflight, context_id: u32, now_ms: u64) -> Vec<PermitCall> {
    let Some(waiting) = inflight.waiting.get(&context_id).filter(|waiting| waiting.joined == Joined::Riding) else {
        return Vec::new();
    };
    // Two passes (no sort: its code weighs kilobytes in the module).
    let gating = |index: &usize| waiting.asked.get(*index).is_some_and(|asked| super::gates(&waiting.route, asked));
    let indexes =
        (0..waiting.asked.len()).filter(|index| !gating(index)).chain((0..waiting.asked.len()).filter(gating));
    indexes
        .filter_map(|index| {
            let command = command(inflight, context_id, index, now_ms)?;
            let (route, deadline_ms, gates) = (Rc::clone(&waiting.route), waiting.deadline_ms, gating(&index));
            Some(PermitCall { context_id, index, command, route, deadline_ms, gone: false, joined: true, gates })
        })
        .collect()
}

/// Marks request `context_id`'s permit `index` failed (unless it was not asked).
pub(super) fn fail<H: Host>(filter: &mut Filter<H>, context_id: u32, index: usize) {
    if let Some(asked) = filter.inflight.waiting.get_mut(&context_id).and_then(|w| w.asked.get_mut(index)) {
        asked.failed = !asked.skipped;
    }
}

/// The [`crate::script::SEMAPHORE_ACQUIRE`] of request `context_id`'s permit `index` at `now_ms` (by sha),
/// and where its keys are; `None` when the permit is not known.
fn command(inflight: &Inflight, context_id: u32, index: usize, now_ms: u64) -> Option<(Vec<u8>, Layout)> {
    let waiting = inflight.waiting.get(&context_id)?;
    let asked = waiting.asked.get(index)?;
    let rule = waiting.route.config.inflight.get(asked.rule)?;
    let lease_end_ms = now_ms.saturating_add(rule.lease_ms);
    let permit = SemaphoreAcquire { name: &asked.name, permits: rule.max_in_flight, lease_end_ms, id: &asked.id };
    let encoding = waiting.route.transport.encoding();
    Some(encode_semaphore_acquires_laid_out(&[permit], now_ms, Publish::Plain, Invocation::BySha, encoding))
}

/// Answers the permits whose batches landed or failed ([`coalesce::Coalescer::permit_replies`]): each
/// reply is that of a [`crate::script::SEMAPHORE_ACQUIRE`] of one permit; a failure fails the permit (one
/// error counted per failed call), its request concluded once all its permits are answered.
pub(in crate::filter) fn answer_coalesced<H: Host>(filter: &mut Filter<H>) {
    for (context_id, index, reply, count_failure) in core::mem::take(&mut filter.coalescer.permit_replies) {
        answer_permit(filter, context_id, index, reply, count_failure);
    }
}

/// Request `context_id`'s permit `index` has its reply (`count_failure`: a failure counts in
/// `redis_errors`): taken or refused, or failed, or not asked (the error `SKIPPED`: a permit of the same
/// request before it was refused); its request concluded once all its permits are answered. A permit
/// answered with an error took nothing: no longer an orphan.
pub(in crate::filter) fn answer_permit<H: Host>(
    filter: &mut Filter<H>,
    context_id: u32,
    index: usize,
    reply: Result<Vec<u8>, Failure>,
    count_failure: bool,
) {
    let outcome = match &reply {
        Ok(bytes) => decode_semaphore_acquire_replies(bytes, 1).map(|outcomes| outcomes.into_iter().next()),
        Err(failure) => Err(ReplyError::Redis(failure.to_string())),
    };
    if let Ok(Some(outcome)) = outcome {
        answered(filter, context_id, index, outcome);
        return;
    }
    if reply.is_ok() {
        filter.inflight.orphans.retain(|(c, i, _, _)| (*c, *i) != (context_id, index));
    }
    let asked = filter.inflight.waiting.get_mut(&context_id).and_then(|waiting| waiting.asked.get_mut(index));
    match (asked, reply) {
        (Some(asked), Ok(bytes)) if bytes.starts_with(b"-SKIPPED") => asked.skipped = true,
        _ if count_failure => filter.metrics.redis_errors(&filter.host, 1),
        _ => {}
    }
    fail(filter, context_id, index);
    conclude_from_reply(filter, context_id);
}
