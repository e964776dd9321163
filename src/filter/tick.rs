//! The root context's tick (`proxy_set_tick_period_milliseconds`): on while anything waits for it (paused
//! requests' deadlines, batches and calls waiting to be sent, give-backs waiting for their replies, the
//! outbox), off otherwise. A host sets the tick of the *effective* context's root, so a filter sets its
//! own only from its own contexts ([`super::Filter::adopt`] makes its root effective first).
//!
//! Below the request driver (`flow`, `end`, `coalesce`) and the outboxes (`give_back`, `outbox`, `settle`):
//! they start the tick; what it runs is dispatched by [`super::Filter::on_tick`].

use crate::host::Host;

use super::{Filter, TICK_MS};

/// Turns the tick on, if it is off; a refusal is counted in `host_errors` (the tick starts with the
/// next request that needs it).
pub(super) fn start<H: Host>(filter: &mut Filter<H>) {
    if !filter.ticking {
        match filter.host.set_tick_period_ms(TICK_MS) {
            Ok(()) => filter.ticking = true,
            Err(_) => super::metrics::host_refused(filter, "proxy_set_tick_period_milliseconds"),
        }
    }
}

/// Turns the tick off when nothing waits for it any more.
pub(super) fn stop_when_idle<H: Host>(filter: &mut Filter<H>) {
    if !has_work(filter) && filter.ticking && filter.host.set_tick_period_ms(0).is_ok() {
        filter.ticking = false;
    }
}

/// Whether anything waits for the tick: paused requests (the deadline guard), requests waiting for late
/// replies, batches and calls waiting to be sent, give-backs and batches of settles waiting for their
/// replies, the outbox.
pub(super) fn has_work<H: Host>(filter: &Filter<H>) -> bool {
    !(filter.flows.is_empty()
        && filter.late.is_empty()
        && filter.waits.is_idle()
        && filter.coalescer.is_idle()
        && filter.give_backs.is_empty()
        && filter.give_back_batches.is_empty()
        && filter.outbox.is_empty()
        && filter.inflight.is_idle()
        && filter.permit_outbox.is_idle()
        && !filter.waits_for_a_first_body())
}
