//! A batch on the wire: the [`crate::script::ACQUIRE_BATCH`] call of a destination's waiting calls (rate
//! acquires and in-flight permits) and the settles that ride with them, its reply split back into each
//! member's own, and its resending by source after `NOSCRIPT`.

use alloc::rc::Rc;

use crate::prelude::*;

use crate::host::Host;
use crate::script::{encode_batch, split_batch_reply, Gate, Invocation, Layout, Segment};
use crate::transport::Failure;

use super::super::flow::{Call, Stage};
use super::super::give_back::GiveBackCall;
use super::super::outbox::{on_carried_replies, settles_failed};
use super::super::permit_outbox::release_command;
use super::super::route::Route;
use super::super::Filter;
use super::{deliver, expiry, Batch, Destination, Member};

/// The commands of a batch's calls, each with where its keys and arguments are.
pub(super) type Commands = Vec<(Vec<u8>, Layout)>;

/// Sends a batch of `commands` (its members' own, by sha) by `invocation`; a refused send is every
/// member's failure (counted as one failed call).
pub(super) fn send_batch<H: Host>(filter: &mut Filter<H>, batch: Batch, commands: &Commands, invocation: Invocation) {
    if let Err((batch, failure)) = transmit(filter, batch, commands, invocation) {
        fail_all(filter, None, batch, &failure);
    }
}

/// Sends request `call`'s lone acquire (`command`, by sha) with the `settles` waiting for its
/// destination and the in-flight permits that ride with it, as one batch (the settles first, then the
/// permits): the call's key, for the request to wait on. A refused send fails the settles (counted as the
/// call's one failure: the request follows its failure mode without counting it again) and the permits
/// (left failed for the in-flight stage to conclude), and is returned to the caller, whose request is out
/// of the flows.
pub(in crate::filter) fn send_carrying<H: Host>(
    filter: &mut Filter<H>,
    route: &Rc<Route>,
    destination: Destination,
    call: Call,
    command: (Vec<u8>, Layout),
    settles: Vec<GiveBackCall>,
) -> Result<u64, Failure> {
    let released = super::super::permit_outbox::take_releases(filter, route, destination);
    let now_ms = filter.host.now_ms();
    let joined = super::super::inflight::joined_permits(&filter.inflight, call.context_id, now_ms);
    filter.inflight.permits_sent(call.context_id);
    let mut commands: Commands = joined.iter().map(|permit| permit.command.clone()).collect();
    commands.push(command);
    let mut members: Vec<Option<Member>> = joined.into_iter().map(|permit| Some(Member::Permit(permit))).collect();
    members.push(Some(Member::Rate(call)));
    let late = Vec::new();
    let batch = Batch {
        route: Rc::clone(route),
        destination,
        settles,
        released,
        members,
        late,
        by_source: false,
        counted: false,
        sent_us: 0,
    };
    transmit(filter, batch, &commands, Invocation::BySha).map_err(|(batch, failure)| {
        let permits = batch.members.into_iter().flatten().filter_map(|member| match member {
            Member::Permit(permit) => Some(permit.index),
            Member::Rate(_) => None,
        });
        super::super::inflight::sends_failed(filter, call.context_id, permits, batch.settles.is_empty());
        filter.permit_outbox.releases.extend(batch.released);
        settles_failed(filter, batch.settles, &failure, true);
        failure
    })
}

/// Sends a batch: its settles' segments, then its members' `commands`; on its way, the batch is kept by
/// its call's key (returned). A batch that cannot be sent comes back with why (rare: the host refused the
/// call; the batch is moved back, not copied, so its size costs nothing on the common path).
#[allow(clippy::result_large_err)]
fn transmit<H: Host>(
    filter: &mut Filter<H>,
    mut batch: Batch,
    commands: &[(Vec<u8>, Layout)],
    invocation: Invocation,
) -> Result<u64, (Batch, Failure)> {
    let encoding = batch.route.transport.encoding();
    let release = (!batch.released.is_empty()).then(|| release_command(&batch.released, encoding));
    let command = {
        let count = batch.settles.len() + usize::from(release.is_some()) + commands.len();
        let mut segments: Vec<Segment<'_>> = Vec::with_capacity(count);
        if let Some(template) = batch.route.plan.rules.first().map(|rule| &rule.template) {
            let carried = batch.settles.iter().map(|call| Segment::give_back(&call.name, template, &call.settlement));
            segments.extend(carried);
        }
        segments.extend(release.as_ref().and_then(|(release, layout)| Segment::laid_out(release, layout, encoding)));
        let laid_out = commands.iter().map_while(|(command, layout)| Segment::laid_out(command, layout, encoding));
        segments.extend(laid_out.zip(gates(&batch.members)).map(|(segment, gate)| segment.gated(gate)));
        (segments.len() == count).then(|| encode_batch(&segments, invocation, encoding))
    };
    // Not acquire calls by sha (cannot happen: the limiter and the in-flight stage encode them): each
    // fails as a refused send would.
    let Some(command) = command else { return Err((batch, Failure::BadReply("a call that cannot be batched".into()))) };
    batch.by_source = invocation == Invocation::BySource;
    let id = match batch.route.transport.send(&filter.host, &command) {
        Ok(id) => id,
        Err(failure) => return Err((batch, failure)),
    };
    let key = id.key();
    filter.metrics.redis_call(&filter.host);
    batch.sent_us = filter.metrics.clock(&filter.host);
    if !batch.by_source {
        // A batch sent again by source after NOSCRIPT is the same batch: counted once.
        let members = batch.members.iter().flatten().count();
        filter.metrics.batch(&filter.host, members + batch.settles.len());
        if !batch.settles.is_empty() {
            filter.metrics.settlements(&filter.host, batch.settles.len());
        }
    }
    let expires_ms = expiry(&filter.host, &batch.route);
    filter.coalescer.sent(key, batch.destination, filter.host.now_ms(), expires_ms);
    for member in batch.members.iter().flatten() {
        if let Some(flow) = filter.flows.get_mut(&member.context_id()).filter(|_| matches!(member, Member::Rate(_))) {
            flow.tokens.push(key);
        }
    }
    filter.coalescer.batches.push((key, batch));
    Ok(key)
}

/// The gate of each member present in `members`, in order: a request's rate acquire right after permits
/// of its own that ride with it is gated by those of them that gate ([`PermitCall::gates`]); anything
/// else is plain.
fn gates(members: &[Option<Member>]) -> Vec<Gate> {
    let present: Vec<&Member> = members.iter().flatten().collect();
    let mut gates = vec![Gate::Plain; present.len()];
    for (at, member) in present.iter().enumerate() {
        let Member::Rate(call) = member else { continue };
        let riding = present.get(..at).unwrap_or_default().iter().rev().take_while(
            |before| matches!(before, Member::Permit(permit) if permit.joined && permit.context_id == call.context_id),
        );
        let mut gated = false;
        for (back, before) in riding.enumerate() {
            if matches!(before, Member::Permit(permit) if permit.gates) {
                if let Some(gate) = gates.get_mut(at - 1 - back) {
                    *gate = Gate::Opens;
                    gated = true;
                }
            }
        }
        if let Some(gate) = gates.get_mut(at).filter(|_| gated) {
            *gate = Gate::Gated;
        }
    }
    gates
}

/// A batch whose call failed as a whole (`key`: its call, if it was sent): its settles' reservations stay,
/// and every member has the failure; counted as one failed call (not again if a member's request counted
/// it at its deadline).
fn fail_all<H: Host>(filter: &mut Filter<H>, key: Option<u64>, batch: Batch, failure: &Failure) {
    // Given back again from the tick (a release that ran already changes nothing).
    filter.permit_outbox.releases.extend(batch.released);
    let count_members = batch.settles.is_empty() && !batch.counted;
    settles_failed(filter, batch.settles, failure, !batch.counted);
    for (index, member) in batch.members.iter().flatten().enumerate() {
        deliver_member(filter, key, member, Err(failure.clone()), count_members && index == 0);
    }
    answer_late(filter, key, &batch.late, Err(failure.clone()));
}

/// The reply of batch call `key`: each member's part fed to its request; `NOSCRIPT` sends the batch again
/// by source, once; a failed call is every member's failure (counted once).
pub(in crate::filter) fn on_batch_reply<H: Host>(
    filter: &mut Filter<H>,
    key: u64,
    batch: Batch,
    reply: Result<Vec<u8>, Failure>,
) {
    let bytes = match reply {
        Err(failure) => return fail_all(filter, Some(key), batch, &failure),
        Ok(bytes) => bytes,
    };
    if bytes.starts_with(b"-NOSCRIPT") && !batch.by_source {
        resend_by_source(filter, key, batch);
        return;
    }
    let carried = batch.settles.len();
    let released = usize::from(!batch.released.is_empty());
    match split_batch_reply(&bytes, carried + released + batch.members.len()) {
        Ok(replies) => {
            let mut replies = replies.into_iter();
            on_carried_replies(filter, batch.settles, replies.by_ref().take(carried));
            match replies.by_ref().take(released).next() {
                Some(reply) if reply.first() == Some(&b'-') => filter.metrics.redis_errors(&filter.host, 1),
                Some(_) => filter.inflight.released(&filter.host, batch.released.len()),
                None => {}
            }
            for (position, (member, reply)) in batch.members.iter().zip(replies).enumerate() {
                if let Some(member) = member {
                    deliver_member(filter, Some(key), member, Ok(&reply), true);
                } else if let Some(&(_, call)) = batch.late.iter().find(|(at, _)| *at == position) {
                    super::super::late::on_reply(filter, Some(key), call, Ok(&reply));
                }
            }
        }
        // An error reply for the whole call (Redis out of memory, busy...): every member's own reply, the
        // settles' failure (one failed call).
        Err(_) if bytes.first() == Some(&b'-') => {
            filter.permit_outbox.releases.extend(batch.released);
            let count_members = batch.settles.is_empty() && !batch.counted;
            let failure = Failure::BadReply("the batch answered an error".into());
            settles_failed(filter, batch.settles, &failure, !batch.counted);
            for (index, member) in batch.members.iter().flatten().enumerate() {
                deliver_member(filter, Some(key), member, Ok(&bytes), count_members && index == 0);
            }
            answer_late(filter, Some(key), &batch.late, Ok(&bytes));
        }
        Err(why) => fail_all(filter, Some(key), batch, &Failure::BadReply(why.into())),
    }
}

/// After `NOSCRIPT`: the batch again by source (which loads the script), its rate calls' commands encoded
/// anew from their requests, its permits' as they were queued (those of requests gone left out).
fn resend_by_source<H: Host>(filter: &mut Filter<H>, key: u64, mut batch: Batch) {
    // Members whose requests stopped waiting are left out: Redis ran nothing of theirs.
    let late = core::mem::take(&mut batch.late);
    answer_late(filter, Some(key), &late, Err(Failure::RedisError("NOSCRIPT".into())));
    let encoding = batch.route.transport.encoding();
    let mut commands = Vec::with_capacity(batch.members.len());
    batch.members.retain(|member| member.is_some());
    for slot in batch.members.iter_mut() {
        let command = match slot {
            None => continue,
            Some(Member::Permit(permit)) if permit.gone => None,
            Some(Member::Permit(permit)) => Some(permit.command.clone()),
            Some(Member::Rate(call)) => filter.flows.get_mut(&call.context_id).and_then(|flow| {
                flow.tokens.retain(|&t| t != key);
                match &flow.stage {
                    Stage::Waiting(pending) => {
                        pending.encode_laid_out(call.call, Invocation::BySha, encoding, &flow.route.plan)
                    }
                    Stage::Undelivered(_) => None,
                }
            }),
        };
        match command {
            Some(command) => commands.push(command),
            None => *slot = None,
        }
    }
    batch.members.retain(|member| member.is_some());
    if !batch.members.is_empty() || !batch.settles.is_empty() || !batch.released.is_empty() {
        send_batch(filter, batch, &commands, Invocation::BySource);
    }
}

/// Gives the members of requests that stopped waiting ([`super::super::late`]) this reply of call `key`,
/// the whole call's (an error, a failure).
fn answer_late<H: Host>(
    filter: &mut Filter<H>,
    key: Option<u64>,
    late: &[(usize, Call)],
    reply: Result<&[u8], Failure>,
) {
    for &(_, call) in late {
        super::super::late::on_reply(filter, key, call, reply.clone());
    }
}

/// Hands a batch member its reply of call `key` (none: the call was never sent): a rate call's request is
/// moved one step ([`deliver`]); a permit's reply waits in [`Coalescer::permit_replies`] for the in-flight
/// stage. `count_failure`: whether a failed call counts in `redis_errors`.
fn deliver_member<H: Host>(
    filter: &mut Filter<H>,
    key: Option<u64>,
    member: &Member,
    reply: Result<&[u8], Failure>,
    count_failure: bool,
) {
    match member {
        Member::Rate(call) => deliver(filter, key, *call, reply, count_failure),
        Member::Permit(permit) => {
            let reply = reply.map(<[u8]>::to_vec);
            if permit.joined {
                // Answered before the rate acquire that rides with it: its request is concluded first.
                super::super::inflight::answer_permit(filter, permit.context_id, permit.index, reply, count_failure);
            } else {
                filter.coalescer.permit_replies.push((permit.context_id, permit.index, reply, count_failure));
            }
        }
    }
}

/// Takes the calls of the next batch of `destination` off the queue, with their commands (by sha), each
/// stamped now; drops the calls of requests that ended.
pub(super) fn take_batch<H: Host>(
    filter: &mut Filter<H>,
    route: &Route,
    destination: Destination,
) -> (Vec<Member>, Commands) {
    let coalescing = route.config.redis.coalescing;
    let (max_batch, max_bytes) = (coalescing.max_batch as usize, coalescing.max_batch_bytes as usize);
    let encoding = route.transport.encoding();
    let now_ms = filter.host.now_ms();
    let capacity = max_batch.min(filter.coalescer.waiting.len());
    let (mut members, mut commands, mut bytes) = (Vec::with_capacity(capacity), Vec::with_capacity(capacity), 0);
    let Filter { coalescer, flows, inflight, .. } = filter;
    let mut full = false;
    coalescer.waiting.retain(|(d, member)| {
        if *d != destination || full {
            return true;
        }
        let command = match member {
            Member::Rate(call) => flows.get_mut(&call.context_id).and_then(|flow| match &mut flow.stage {
                Stage::Waiting(pending) => {
                    pending.restamp(call.call, now_ms);
                    pending.encode_laid_out(call.call, Invocation::BySha, encoding, &flow.route.plan)
                }
                Stage::Undelivered(_) => None,
            }),
            Member::Permit(permit) => Some(permit.command.clone()),
        };
        let Some(command) = command else { return false };
        // The permits that ride with a request's rate acquire go right before it, in the same batch.
        let joined = match member {
            Member::Rate(call) => super::super::inflight::joined_permits(inflight, call.context_id, now_ms),
            Member::Permit(_) => Vec::new(),
        };
        let size = command.0.len() + joined.iter().map(|permit| permit.command.0.len()).sum::<usize>();
        if !members.is_empty() && bytes + size > max_bytes {
            full = true;
            return true;
        }
        bytes += size;
        if let Some(first) = joined.first() {
            inflight.permits_sent(first.context_id);
        }
        for permit in joined {
            commands.push(permit.command.clone());
            members.push(Member::Permit(permit));
        }
        members.push(member.clone());
        commands.push(command);
        full = members.len() >= max_batch;
        false
    });
    (members, commands)
}

/// Sends one waiting call as itself.
pub(super) fn send_alone<H: Host>(
    filter: &mut Filter<H>,
    route: &Route,
    destination: Destination,
    call: Call,
    command: &[u8],
) {
    match route.transport.send(&filter.host, command) {
        Ok(id) => {
            let key = id.key();
            filter.metrics.redis_call(&filter.host);
            filter.calls.insert(key, (call, filter.metrics.clock(&filter.host)));
            let expires_ms = expiry(&filter.host, route);
            filter.coalescer.sent(key, destination, filter.host.now_ms(), expires_ms);
            if let Some(flow) = filter.flows.get_mut(&call.context_id) {
                flow.tokens.push(key);
            }
        }
        Err(failure) => deliver(filter, None, call, Err(failure), true),
    }
}
