//! Late replies of rate acquires: a request that stops waiting while its calls are on their way (its
//! deadline passed, its client left, another rule decided it) leaves them here ([`keep`]). A reply that
//! still comes gives back at once every member it took (GIVE_BACK to 0), counted in `late_given_back`; a call
//! never answered is given up with its batch ([`expire`]), counted in `late_unanswered` (what it may have
//! taken leaves with the window). In-flight permits answered late are the orphans of [`super::inflight`].

use alloc::rc::Rc;

use crate::prelude::*;

use crate::host::Host;
use crate::limiter::{GiveBack, PendingRequest};
use crate::transport::Failure;

use super::flow::{Call, Flow, Stage};
use super::give_back::{send_give_back, GiveBackCall, GiveBackKind};
use super::route::Route;
use super::{with_context, Filter};

/// A request that stopped waiting for calls on their way.
#[derive(Debug)]
pub(super) struct LateFlow {
    /// The request's HTTP context id.
    context_id: u32,
    route: Rc<Route>,
    /// Its limiter's state when it stopped waiting: what decodes a late reply.
    pending: PendingRequest,
    /// Its calls still on their way ([`crate::transport::CallId::key`]: single calls, or batches carrying
    /// its acquires).
    tokens: Vec<u64>,
    /// When its calls are given up, ms since the epoch: its deadline and one timeout more, when a call sent
    /// at its arrival is given up.
    until_ms: u64,
}

/// Request `context_id` stops waiting for `flow`'s calls: those on their way are kept for their replies
/// (true), or there are none (false: nothing to keep). Kept once: a request forgotten again is kept still.
pub(super) fn keep<H: Host>(filter: &mut Filter<H>, context_id: u32, flow: &Flow) -> bool {
    if filter.late.iter().any(|late| late.context_id == context_id) {
        return true;
    }
    let Stage::Waiting(pending) = &flow.stage else { return false };
    if flow.tokens.is_empty() || pending.unanswered() == 0 {
        return false;
    }
    let until_ms = flow.deadline_ms.saturating_add(flow.route.config.redis.timeout_ms);
    let (route, pending, tokens) = (Rc::clone(&flow.route), pending.clone(), flow.tokens.clone());
    filter.late.push(LateFlow { context_id, route, pending, tokens, until_ms });
    super::tick::start(filter);
    true
}

/// Whether calls of request `context_id` that it stopped waiting for are still on their way.
pub(super) fn waits_for<H: Host>(filter: &Filter<H>, context_id: u32) -> bool {
    filter.late.iter().any(|late| late.context_id == context_id)
}

/// The reply of `call` (of call or batch `key`) for a request that no longer waits for it: the members it
/// took go back at once.
pub(super) fn on_reply<H: Host>(filter: &mut Filter<H>, key: Option<u64>, call: Call, reply: Result<&[u8], Failure>) {
    let Some(at) = filter.late.iter().position(|late| late.context_id == call.context_id) else { return };
    let mut late = filter.late.swap_remove(at);
    let now_ms = filter.host.now_ms();
    let route = Rc::clone(&late.route);
    let give_backs = with_context!(filter, route, now_ms, false, |ctx| {
        late.pending.late_give_back(call.call, reply, &ctx, &mut filter.cache.borrow_mut())
    });
    filter.metrics.late_given_back(&filter.host, give_backs.len());
    for GiveBack { name, settlement } in give_backs {
        send_give_back(filter, GiveBackCall::new(&route, name, settlement, GiveBackKind::Request));
    }
    // One of the call's copies (a batch carrying two of its sends holds its key twice).
    if let Some(at) = late.tokens.iter().position(|&token| Some(token) == key) {
        late.tokens.swap_remove(at);
    }
    if late.pending.unanswered() > 0 && !late.tokens.is_empty() {
        filter.late.push(late);
    } else {
        forget_calls(filter, &late.tokens);
    }
}

/// The tick: gives up the calls past their batches' latest end, counted in `late_unanswered`.
pub(super) fn expire<H: Host>(filter: &mut Filter<H>, now_ms: u64) {
    if filter.late.is_empty() {
        return;
    }
    let (due, kept): (Vec<LateFlow>, Vec<LateFlow>) =
        core::mem::take(&mut filter.late).into_iter().partition(|late| late.until_ms <= now_ms);
    filter.late = kept;
    for late in due {
        filter.metrics.late_unanswered(&filter.host, late.tokens.len());
        forget_calls(filter, &late.tokens);
    }
}

/// Forgets single calls on their way no request waits for any more (a batch is forgotten with its members).
fn forget_calls<H: Host>(filter: &mut Filter<H>, tokens: &[u64]) {
    for token in tokens {
        filter.calls.remove(token);
    }
}
