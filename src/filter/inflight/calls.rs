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
use super::{answered, conclude_from_reply};

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
            let command = command(filter, context_id, index, now_ms)?;
            Some(PermitCall { context_id, index, command, route: Rc::clone(&route), deadline_ms, gone: false })
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

/// Marks request `context_id`'s permit `index` failed.
fn fail<H: Host>(filter: &mut Filter<H>, context_id: u32, index: usize) {
    if let Some(asked) = filter.inflight.waiting.get_mut(&context_id).and_then(|w| w.asked.get_mut(index)) {
        asked.failed = true;
    }
}

/// The [`crate::script::SEMAPHORE_ACQUIRE`] of request `context_id`'s permit `index` at `now_ms` (by sha),
/// and where its keys are; `None` when the permit is not known.
fn command<H: Host>(filter: &Filter<H>, context_id: u32, index: usize, now_ms: u64) -> Option<(Vec<u8>, Layout)> {
    let waiting = filter.inflight.waiting.get(&context_id)?;
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
    if filter.coalescer.permit_replies.is_empty() {
        return;
    }
    for (context_id, index, reply, count_failure) in core::mem::take(&mut filter.coalescer.permit_replies) {
        let outcome = match reply {
            Ok(bytes) => decode_semaphore_acquire_replies(&bytes, 1).map(|outcomes| outcomes.into_iter().next()),
            Err(failure) => Err(ReplyError::Redis(failure.to_string())),
        };
        match outcome {
            Ok(Some(outcome)) => answered(filter, context_id, index, outcome),
            _ => {
                if count_failure {
                    filter.metrics.redis_errors(&filter.host, 1);
                }
                fail(filter, context_id, index);
                conclude_from_reply(filter, context_id);
            }
        }
    }
}
