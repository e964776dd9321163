//! Reserve, then settle (docs/configuration.md, "Costs known after the response"): an allowed request of a
//! rule with `cost` holds a reservation in Redis; when its response ends, the real cost (a response header,
//! or the usage an LLM API reports in the body, read chunk by chunk by [`UsageMeter`]) replaces it. The
//! settle call is a [`crate::script::GIVE_BACK`] of the reservation's member with `used` = the cost: unused
//! permits go back to the window, an excess is charged.
//!
//! Settle calls wait in the outbox: an acquire call that leaves for their destination carries them
//! ([`super::outbox::take_settles`]), else they leave from the root context's tick (at most
//! [`super::TICK_MS`] later). None is sent from its own request's last callback.

use alloc::rc::Rc;

use crate::prelude::*;

use crate::config::Settle;
use crate::host::Host;
use crate::limiter::Reservation;
use crate::script::Settlement;
use crate::usage::UsageMeter;

use super::give_back::{GiveBackCall, GiveBackKind};
use super::metrics::Metrics;
use super::route::Route;
use super::{Action, Filter};

/// A request's reservations, waiting for its response.
#[derive(Debug)]
pub(super) struct Settling {
    route: Rc<Route>,
    items: Vec<Item>,
}

#[derive(Debug)]
struct Item {
    reservation: Reservation,
    /// The real cost, once read.
    cost: Option<u64>,
    /// Reading the usage in the body (`settle.usage`), from the response headers on.
    meter: Option<UsageMeter>,
}

impl Settling {
    /// How many reservations it holds.
    pub(super) fn reservations(&self) -> usize {
        self.items.len()
    }
}

/// Keeps an allowed request's reservations until its response ends.
pub(super) fn reserve<H: Host>(
    filter: &mut Filter<H>,
    context_id: u32,
    route: &Rc<Route>,
    reservations: Vec<Reservation>,
) {
    let items = reservations.into_iter().map(|reservation| Item { reservation, cost: None, meter: None }).collect();
    filter.settling.insert(context_id, Settling { route: Rc::clone(route), items });
}

/// The response headers arrived: a cost in a header is read now; a usage in the body is read from the
/// body on (a server-sent event stream if the `content-type` says `text/event-stream`).
pub(super) fn on_response_headers<H: Host>(filter: &mut Filter<H>, context_id: u32) {
    let Some(settling) = filter.settling.get_mut(&context_id) else { return };
    if never_answered(&filter.host) {
        // The upstream never answered (Envoy's own reply): the request cost nothing, its reservations
        // settle to 0, counted in `settled_unanswered`.
        for item in &mut settling.items {
            item.cost = Some(0);
            filter.metrics.settled_unanswered(&filter.host);
        }
        if let Some(settling) = filter.settling.remove(&context_id) {
            settle(filter, settling);
        }
        return;
    }
    let mut event_stream = None;
    let mut encoded = None;
    for item in &mut settling.items {
        let Some(cost) = settling.route.config.rules.get(item.reservation.rule).and_then(|rule| rule.cost.as_ref())
        else {
            continue;
        };
        match &cost.settle {
            Settle::ResponseHeader(name) => item.cost = header_number(&filter.host, name),
            Settle::Usage(spec, weights) => {
                // A body the upstream compressed although asked not to cannot be read: the reservation
                // stays (settled_without_usage).
                let encoded = *encoded.get_or_insert_with(|| {
                    matches!(filter.host.response_header("content-encoding"),
                        Ok(Some(value)) if !value.is_empty() && !value.eq_ignore_ascii_case(b"identity"))
                });
                if encoded {
                    continue;
                }
                let event_stream = *event_stream.get_or_insert_with(|| {
                    matches!(filter.host.response_header("content-type"),
                        Ok(Some(value)) if value.starts_with(b"text/event-stream"))
                });
                item.meter = Some(UsageMeter::new(spec, event_stream).weighted(*weights));
            }
        }
    }
    if settling.items.iter().all(|item| item.meter.is_none()) {
        if let Some(settling) = filter.settling.remove(&context_id) {
            settle(filter, settling);
        }
    }
}

/// A response body chunk (`size` bytes; `end`: the last): fed to the meters; at the end, the request settles.
pub(super) fn on_response_body<H: Host>(filter: &mut Filter<H>, context_id: u32, size: usize, end: bool) {
    let Some(settling) = filter.settling.get_mut(&context_id) else { return };
    if size > 0 && settling.items.iter().any(|item| item.meter.is_some()) {
        let chunk = filter.host.response_body(size).unwrap_or_default();
        for meter in settling.items.iter_mut().filter_map(|item| item.meter.as_mut()) {
            meter.feed(&chunk);
        }
    }
    if end {
        on_response_end(filter, context_id);
    }
}

/// The response ended (its last body chunk, or its trailers): each meter gives the usage it read, and the
/// request settles.
pub(super) fn on_response_end<H: Host>(filter: &mut Filter<H>, context_id: u32) {
    if let Some(mut settling) = filter.settling.remove(&context_id) {
        for item in &mut settling.items {
            if let Some(meter) = item.meter.as_mut() {
                item.cost = meter.finish();
            }
        }
        settle(filter, settling);
    }
}

/// The request is done without its response's end (the client left, the upstream reset the stream, no
/// body): a meter settles to what the stream reported so far; a reservation without any cost stays.
pub(super) fn on_done<H: Host>(filter: &mut Filter<H>, context_id: u32) {
    let Some(mut settling) = filter.settling.remove(&context_id) else { return };
    for item in &mut settling.items {
        if item.cost.is_none() {
            item.cost = item.meter.as_ref().and_then(UsageMeter::so_far);
        }
    }
    settle(filter, settling);
}

/// Queues each reservation's settle call for the tick (its real cost, at most what a member holds; the
/// share of the reservation used recorded in the rule's `settled_percent`); one without a cost stays as
/// reserved, counted in `settled_without_usage`.
fn settle<H: Host>(filter: &mut Filter<H>, settling: Settling) {
    let now_ms = filter.host.now_ms();
    for item in settling.items {
        let Some(cost) = item.cost else {
            filter.metrics.settled_without_usage(&filter.host);
            continue;
        };
        if let Some(ids) = settling.route.rule_metrics.get(item.reservation.rule) {
            Metrics::settled(&filter.host, ids, item.reservation.granted, cost);
        }
        if let Some(taken_ms) = item.reservation.local_since_ms {
            // Admitted by the degraded mode's local window: settled there, at once.
            settle_locally(filter, &settling.route, &item.reservation, cost, taken_ms);
            continue;
        }
        let settlement = Settlement {
            random: item.reservation.random,
            granted: item.reservation.granted,
            used: cost.min(u64::from(u32::MAX)),
            early_ms: 0,
            renamed: Some(item.reservation.settled_random()),
            at: item.reservation.at,
        };
        let mut call = GiveBackCall::new(&settling.route, item.reservation.name, settlement, GiveBackKind::Settle);
        call.queued_ms = now_ms;
        filter.outbox.push(call);
    }
    if !filter.outbox.is_empty() {
        super::tick::start(filter);
    }
}

/// Settles a reservation the degraded mode's local window admitted: its bucket counts the real cost
/// instead (unused permits back, an excess charged); counted in `settlements`.
fn settle_locally<H: Host>(filter: &Filter<H>, route: &Route, reservation: &Reservation, cost: u64, taken_ms: u64) {
    let (Some(fallback), Some(rule)) = (route.fallback.as_ref(), route.config.rules.get(reservation.rule)) else {
        return;
    };
    fallback.windows.settle(&filter.host, &reservation.name, rule.interval_ms, reservation.granted, cost, taken_ms);
    filter.metrics.settlement(&filter.host);
}

/// Whether the response is Envoy's own, not the upstream's, for a request the upstream never answered: a
/// connection that failed, no healthy or no such upstream, a reset before any response byte (Envoy's
/// `response.code_details` property is other than `via_upstream`: envoy `StreamInfo::ResponseCodeDetails`).
/// A timeout is not: the upstream had the request and may have done its work.
fn never_answered(host: &impl Host) -> bool {
    match host.property(&["response", "code_details"]) {
        Ok(Some(details)) => details != b"via_upstream" && !details.windows(7).any(|w| w == b"timeout"),
        _ => false,
    }
}

/// A response header's whole number (surrounding spaces allowed); `None` when absent or not a number.
fn header_number(host: &impl Host, name: &str) -> Option<u64> {
    let value = host.response_header(name).ok().flatten()?;
    core::str::from_utf8(&value).ok()?.trim().parse().ok()
}

impl<H: Host> Filter<H> {
    /// `proxy_on_response_body`: a chunk of `size` bytes of the response (`end`: its last), read only for a
    /// request whose reservation settles to the usage in the body; always let through.
    pub fn on_response_body(&mut self, context_id: u32, size: usize, end: bool) -> Action {
        if !self.settling.is_empty() {
            on_response_body(self, context_id, size, end);
        }
        Action::Continue
    }

    /// `proxy_on_response_trailers`: the response ends with trailers (its last body chunk came with
    /// `end = false`): a request whose reservation settles to the usage in the body settles now.
    pub fn on_response_trailers(&mut self, context_id: u32) -> Action {
        if !self.settling.is_empty() {
            on_response_end(self, context_id);
        }
        Action::Continue
    }
}
