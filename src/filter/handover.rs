//! A filter that goes away (its root context is deleted, or a new configuration replaces it):
//! [`Filter::retire`] ends its paused requests and settles its leases as they stand, [`Filter::adopt`]
//! queues what it left in the outbox of the filter that takes its place, to leave from that filter's own
//! tick.

use alloc::rc::Rc;

use crate::prelude::*;

use crate::config::RedisConfig;
use crate::host::Host;
use crate::script::Settlement;

use super::body::Awaiting;
use super::give_back::{GiveBackCall, GiveBackKind};
use super::permit_outbox::Held;
use super::settle::Settling;
use super::Filter;

/// What a filter that goes away leaves to the one that replaces it in the VM ([`Filter::retire`],
/// [`Filter::adopt`]): the settlements its leases still owe Redis, and where they go.
#[derive(Debug, Default)]
pub struct Retirement {
    /// The Redis its configurations reached (one entry per distinct `redis` section).
    redis: Vec<RedisConfig>,
    /// Per limiter name, the settlement to send.
    settlements: Vec<(String, Settlement)>,
    /// Reservations of requests whose responses still run (rules with `cost`), by HTTP context id: their
    /// callbacks reach the filter that takes this one's place.
    settling: Vec<(u32, Settling)>,
    /// Its outbox: give-back calls waiting for the tick (settles, handed lease settlements).
    settle_calls: Vec<GiveBackCall>,
    /// Requests waiting for their body before they are decided: their body callbacks reach the filter that
    /// takes this one's place, which decides them with the route (and headers) they started with.
    awaiting_body: Vec<(u32, Awaiting)>,
    /// What it had seen of the host's giving the body while headers are held (the same host).
    body_while_held: super::hold::BodyWhileHeld,
    /// In-flight permits of running requests and permits to give back: extended and released by the filter
    /// that takes this one's place.
    inflight: InflightRetirement,
}

impl Retirement {
    /// Permits the settlements would return (lost if nobody sends them).
    pub fn unsettled_permits(&self) -> u64 {
        self.settlements.iter().map(|(_, s)| s.granted.saturating_sub(s.used)).sum()
    }
}

impl<H: Host> Filter<H> {
    /// This filter goes away (its root context is deleted, or a new configuration replaces it): its paused
    /// requests end now (as at their deadline: the failure mode), and its leases are settled as they stand,
    /// to be sent by the filter that takes its place ([`Filter::adopt`]).
    pub fn retire(&mut self) -> Retirement {
        // Before any call leaves from here: a call would carry the outbox's settles and die with this filter.
        let settle_calls = core::mem::take(&mut self.outbox);
        // A request waiting for its permits may go on to its rate rules, and pause there.
        let inflight = retire_inflight(self);
        super::wait::end_all(self);
        let paused: Vec<u32> = self.flows.keys().copied().collect();
        super::flow::end_flows(self, paused);
        let mut redis: Vec<RedisConfig> = Vec::new();
        for (_, route) in self.routes.configs() {
            if !redis.contains(&route.config.redis) {
                redis.push(route.config.redis.clone());
            }
        }
        Retirement {
            redis,
            settlements: self.leases.retire_all(),
            settling: self.settling.drain().collect(),
            settle_calls,
            awaiting_body: self.awaiting_body.drain().collect(),
            body_while_held: self.body_while_held,
            inflight,
        }
    }

    /// Sends the settlements a filter that went away left ([`Filter::retire`]) through a configuration of
    /// this filter that reaches the same Redis (the same `redis` section); when none does, or the old
    /// filter reached several, their permits are counted as lost (`lease_permits_lost`): they return when
    /// their members leave the window.
    ///
    /// Nothing is sent from here: it may run during the old root context's `proxy_on_delete`, where the old
    /// root is the effective context, and a host sets the tick of the effective context's root (the old
    /// root's, which goes away with it) and sends calls from it. The work is queued in the outbox, this
    /// filter's own root context ([`Filter::own_root_context`]) is made effective, and its own tick sends
    /// it; if the host refuses that switch, the tick starts with this root's next request.
    pub fn adopt(&mut self, mut retirement: Retirement) {
        // Reservations settle through the filter their responses' callbacks now reach, each call through the
        // route (and transport) of the configuration that made it.
        self.settling.extend(retirement.settling.drain(..));
        self.outbox.append(&mut retirement.settle_calls);
        self.awaiting_body.extend(retirement.awaiting_body.drain(..));
        if self.body_while_held == super::hold::BodyWhileHeld::Unknown {
            self.body_while_held = retirement.body_while_held;
        }
        adopt_inflight(self, core::mem::take(&mut retirement.inflight));
        let route = match retirement.redis.as_slice() {
            [only] => self.routes.configs().find(|(_, route)| route.config.redis == *only).map(|(_, r)| Rc::clone(r)),
            _ => None,
        };
        match route {
            Some(route) => {
                for (name, settlement) in retirement.settlements {
                    self.outbox.push(GiveBackCall::new(&route, name, settlement, GiveBackKind::Handed));
                }
            }
            None => self.metrics.lease_permits_lost(&self.host, retirement.unsettled_permits()),
        }
        // Held headers handed over wait for their first body with this filter's tick (`body::release_unfed`).
        let idle = self.outbox.is_empty() && self.inflight.is_idle() && self.permit_outbox.is_idle();
        if (idle && !self.waits_for_a_first_body()) || self.ticking {
            return;
        }
        let own_root = match self.root_context {
            Some(root) => self.host.set_effective_context(root).is_ok(),
            None => true,
        };
        if own_root {
            super::tick::start(self);
        }
    }

    /// Counts a retirement nobody adopts (no other configuration in the VM): its leases' permits as lost
    /// (`lease_permits_lost`), its queued settle calls, which knew their cost, in `settlements_lost`, and
    /// the reservations of responses still running, which stay as reserved, in `settled_without_usage`.
    pub fn drop_retirement(&self, retirement: &Retirement) {
        self.metrics.lease_permits_lost(&self.host, retirement.unsettled_permits());
        let (settles, handed): (Vec<&GiveBackCall>, Vec<&GiveBackCall>) =
            retirement.settle_calls.iter().partition(|call| call.kind == GiveBackKind::Settle);
        self.metrics.settlements_lost(&self.host, settles.len());
        let handed: u64 = handed.iter().map(|call| call.settlement.granted.saturating_sub(call.settlement.used)).sum();
        self.metrics.lease_permits_lost(&self.host, handed);
        let reservations = retirement.settling.iter().map(|(_, settling)| settling.reservations()).sum::<usize>();
        for _ in 0..reservations {
            self.metrics.settled_without_usage(&self.host);
        }
    }
}

/// What a filter that goes away leaves of its in-flight state ([`Filter::retire`]): the permits of
/// its running requests (whose callbacks now reach the filter that takes its place, which releases and
/// extends them) and those waiting to be given back.
#[derive(Debug, Default)]
struct InflightRetirement {
    held: Vec<(u32, Vec<Held>)>,
    releases: Vec<Held>,
}

/// The filter goes away: requests waiting for permits end now in the failure mode (their unanswered permits
/// given back), and its permits are handed over.
fn retire_inflight<H: Host>(filter: &mut Filter<H>) -> InflightRetirement {
    super::inflight::end_waits(filter, filter.host.now_ms(), true);
    for (_, _, held, _) in core::mem::take(&mut filter.inflight.orphans) {
        filter.permit_outbox.releases.push(held);
    }
    InflightRetirement {
        held: filter.inflight.held.drain().collect(),
        releases: core::mem::take(&mut filter.permit_outbox.releases),
    }
}

/// Takes over what a filter that went away left ([`retire_inflight`]): its running requests' permits are extended
/// and given back from this filter's tick.
fn adopt_inflight<H: Host>(filter: &mut Filter<H>, retirement: InflightRetirement) {
    let now_ms = filter.host.now_ms();
    for (context_id, held) in retirement.held {
        filter.inflight.hold(context_id, held, now_ms);
    }
    filter.permit_outbox.releases.extend(retirement.releases);
}
