//! A request's in-flight permits riding with its rate acquire, in one call (docs/configuration.md, "One call
//! with the rate rules"): the rate stage started with the permits ([`start_joined`]), the permits' segments
//! gating the acquire in the batch ([`crate::script::Gate`]), and what ends such a request when its permits
//! fail, its deadline passes or its send is refused.

use alloc::rc::Rc;

use crate::config::Mode;
use crate::host::Host;

use super::super::route::Route;
use super::super::{Action, Filter};
use super::{calls, conclude_from_reply, conclude_if_answered, give_up, Asked, Joined};

/// Starts request `context_id`'s rate stage at once, its permits (all of hash slot `slot`) to ride with its
/// rate acquire in one call ([`Filter::start_joined`]): `Some(action)` once started, or answered without
/// Redis (its permits never asked), `None` when they go alone (their request waits as `Alone`).
pub(super) fn start_joined<H: Host>(
    filter: &mut Filter<H>,
    context_id: u32,
    route: &Rc<Route>,
    since_us: u64,
    slot: u16,
) -> Option<Action> {
    if let Some(waiting) = filter.inflight.waiting.get_mut(&context_id) {
        waiting.joined = Joined::Riding;
    }
    let Some(action) = filter.start_joined(context_id, route, since_us, slot) else {
        if let Some(waiting) = filter.inflight.waiting.get_mut(&context_id) {
            waiting.joined = Joined::Alone;
        }
        return None;
    };
    if !filter.flows.contains_key(&context_id) {
        // Rejected by its rate rules without Redis: its permits were never asked.
        filter.inflight.waiting.remove(&context_id);
        return Some(action);
    }
    super::super::tick::start(filter);
    // A send the host refused failed its permits: concluded now.
    Some(conclude_if_answered(filter, context_id, true).unwrap_or(action))
}

/// Whether request `context_id`'s permits ride with its rate acquire and have not gone out yet.
pub(in crate::filter) fn rides<H: Host>(filter: &Filter<H>, context_id: u32) -> bool {
    !filter.inflight.waiting.is_empty()
        && filter.inflight.waiting.get(&context_id).is_some_and(|waiting| waiting.joined == Joined::Riding)
}

/// Whether permit `asked` of a request of `route` gates the rate acquire it rides with: its rule enforces.
pub(super) fn gates(route: &Route, asked: &Asked) -> bool {
    route.config.inflight.get(asked.rule).is_some_and(|rule| rule.mode == Mode::Enforce)
}

/// Request `context_id`'s rate flow, if its permits rode with it, is dropped: the in-flight stage answered
/// the request, or (its send refused) starts its rate stage on its own; a reply still on its way gives back
/// what it took.
pub(super) fn drop_joined_flow<H: Host>(filter: &mut Filter<H>, context_id: u32, joined: Joined) {
    if joined == Joined::Alone {
        return;
    }
    if let Some(flow) = filter.flows.remove(&context_id) {
        super::super::flow::forget(filter, context_id, &flow);
    }
}

/// The deadline guard of request `context_id`'s rate flow ([`super::super::flow::end_flows`]): if its
/// permits ride with it, its in-flight stage concludes first, its unanswered permits failed (refused or
/// failing closed, the request is answered and its flow dropped; else the flow then ends in the failure
/// mode).
pub(in crate::filter) fn end_joined<H: Host>(filter: &mut Filter<H>, context_id: u32, now_ms: u64) {
    let joined = filter.inflight.waiting.get(&context_id).map(|waiting| waiting.joined);
    if joined.is_none_or(|joined| joined == Joined::Alone) {
        return;
    }
    give_up(filter, context_id, now_ms);
    conclude_from_reply(filter, context_id);
}

/// A refused send of the batch carrying request `context_id`'s permits `indexes` (riding with its rate
/// acquire): they failed (`count_failure`: counted as the call's one failure), concluded by the request's
/// start.
pub(in crate::filter) fn sends_failed<H: Host>(
    filter: &mut Filter<H>,
    context_id: u32,
    indexes: impl Iterator<Item = usize>,
    count_failure: bool,
) {
    if count_failure {
        filter.metrics.redis_errors(&filter.host, 1);
    }
    for index in indexes {
        calls::fail(filter, context_id, index);
    }
}
