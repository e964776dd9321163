//! What leaves from the tick for in-flight rules ([`super::inflight`]): the permits of requests that ended,
//! given back, and the leases of the permits held, extended; every semaphore of one destination (a route,
//! and on a Redis Cluster a hash slot) in one call ([`crate::script::SEMAPHORE_RELEASE`],
//! [`crate::script::SEMAPHORE_EXTEND`]), at most [`MAX_IDS`] permits per call. Nobody waits for these calls:
//! a reply is only counted (a failure in `redis_errors`), and one that never comes is forgotten after
//! `redis.timeout`. In the degraded mode a permit may come from the gateway process's own count instead
//! ([`take_local`]): it goes back there at once, never to Redis.

use alloc::rc::Rc;

use crate::prelude::*;

use crate::host::Host;
use crate::id_map::CallMap;
use crate::script::{
    encode_semaphore_extend, encode_semaphore_release, encode_semaphore_release_laid_out, Encoding, Invocation, Layout,
    Publish, SemaphorePermits, PERMIT_ID_LEN,
};
use crate::transport::Failure;

use super::route::Route;
use super::{Filter, DEADLINE_GRACE_MS, TICK_MS};

/// A permit's id: 16 random bytes, as Redisson's `generateId`.
pub(super) type PermitId = [u8; PERMIT_ID_LEN];

/// Most permits in one release or extension call (its body stays under about 16 KB in webdis's form).
const MAX_IDS: usize = 256;

/// Where a call goes: the route (by its index) and, on a Redis Cluster, the semaphore's hash slot (a call's
/// keys must share one), else 0.
pub(super) type Destination = (usize, u16);

/// The destination of semaphore `name`'s calls through `route`.
pub(super) fn destination(route: &Route, name: &str) -> Destination {
    (route.index, if route.config.redis.redis_cluster { crate::key::hash_slot(name) } else { 0 })
}

/// A permit held by a request: given back, or its lease extended.
#[derive(Debug, Clone)]
pub(super) struct Held {
    pub(super) route: Rc<Route>,
    /// The semaphore's name.
    pub(super) name: String,
    pub(super) id: PermitId,
    /// The rule's lease, ms.
    pub(super) lease_ms: u64,
    /// The rule's index in the configuration's `inflight`.
    pub(super) rule: usize,
    /// Permits of the semaphore free after this one was taken (the rate limit headers' remaining).
    pub(super) free: u64,
    /// Taken from the process's own count at this time (ms since the epoch; the degraded mode,
    /// [`take_local`]), not from Redis: given back there, its lease never extended.
    pub(super) local_ms: Option<u64>,
}

/// The degraded mode's count of a semaphore's permits in flight: a local window (the rate rules' degraded
/// mode, [`crate::fallback`]) of 30 days, whose count drops only when a request gives its permit back (the
/// bucket that counted it still in the window: no request runs that long).
const LOCAL_WINDOW_MS: u64 = 30 * 86_400_000;

/// Takes a permit of semaphore `name` (a rule of `max_in_flight`) from the gateway process's own count, at
/// most `floor(max_in_flight / gateways)` in flight at once in the process (shared by its workers); `false`:
/// refused (the count is full, the route has no degraded mode, or the host refused its shared data).
pub(super) fn take_local(host: &impl Host, route: &Route, name: &str, max_in_flight: u64, now_ms: u64) -> bool {
    let Some(fallback) = &route.fallback else { return false };
    let local = fallback.windows.acquire(host, name, max_in_flight, LOCAL_WINDOW_MS, 1, now_ms);
    local == crate::fallback::Local::Admitted
}

/// Gives permit `held` back: to the process's count at once if it was taken there (`true`), else to the
/// releases the tick sends to Redis.
pub(super) fn give_back<H: Host>(filter: &mut Filter<H>, held: Held) -> bool {
    match (held.local_ms, &held.route.fallback) {
        (Some(taken_ms), Some(fallback)) => {
            fallback.windows.release(&filter.host, &held.name, LOCAL_WINDOW_MS, 1, taken_ms);
            true
        }
        (Some(_), None) => true,
        (None, _) => {
            outbox(filter).releases.push(held);
            false
        }
    }
}

/// Releases waiting for the tick, and the calls on their way.
#[derive(Debug, Default)]
pub(super) struct PermitOutbox {
    pub(super) releases: Vec<Held>,
    /// The first tick that saw the releases waiting now (ms since the epoch; 0: none waits): a release
    /// waits from then up to [`CARRY_WAIT_MS`] for an acquire call of its destination to carry it.
    since_ms: u64,
    /// By [`crate::transport::CallId::key`]: when each was sent (us) and when the tick forgets it (ms).
    calls: CallMap<(u64, u64)>,
}

impl PermitOutbox {
    /// Whether nothing waits: no release queued, no call on its way.
    pub(super) fn is_idle(&self) -> bool {
        self.releases.is_empty() && self.calls.is_empty()
    }
}

fn outbox<H: Host>(filter: &mut Filter<H>) -> &mut PermitOutbox {
    &mut filter.permit_outbox
}

/// A reply for call `key`, if it is a release's or an extension's (`false`: not one of these).
pub(super) fn on_reply<H: Host>(filter: &mut Filter<H>, key: u64, reply: &Result<Vec<u8>, Failure>) -> bool {
    let Some((sent_us, _)) = outbox(filter).calls.remove(&key) else { return false };
    filter.metrics.round_trip(&filter.host, sent_us);
    let failed = match reply {
        Ok(bytes) => bytes.first() == Some(&b'-'),
        Err(_) => true,
    };
    if failed {
        filter.metrics.redis_errors(&filter.host, 1);
    }
    true
}

/// How long a release waits for an acquire call of its destination to carry it ([`take_releases`]) while
/// that destination has a call on its way (one lands, and what waits for it leaves): two ticks.
const CARRY_WAIT_MS: u64 = 2 * TICK_MS as u64;

/// The tick: forgets the calls never answered, gives back the queued releases (those whose destination
/// has a call on its way, among `busy`, wait up to [`CARRY_WAIT_MS`] to ride with an acquire); returns how
/// many permits it gave back.
pub(super) fn release<H: Host>(filter: &mut Filter<H>, now_ms: u64, busy: &[Destination]) -> usize {
    let before = outbox(filter).calls.len();
    outbox(filter).calls.retain(|_, (_, forget_ms)| *forget_ms > now_ms);
    let forgotten = before - outbox(filter).calls.len();
    filter.metrics.redis_errors(&filter.host, forgotten);
    let outbox = outbox(filter);
    if outbox.releases.is_empty() {
        outbox.since_ms = 0;
        return 0;
    }
    if outbox.since_ms == 0 {
        outbox.since_ms = now_ms;
    }
    let waits = now_ms < outbox.since_ms.saturating_add(CARRY_WAIT_MS);
    let (kept, releases): (Vec<Held>, Vec<Held>) = core::mem::take(&mut outbox.releases)
        .into_iter()
        .partition(|held| waits && carried_by(&held.route) && busy.contains(&destination(&held.route, &held.name)));
    outbox.since_ms = if kept.is_empty() { 0 } else { outbox.since_ms };
    outbox.releases = kept;
    send(filter, &releases, now_ms, |semaphores, _, encoding| {
        encode_semaphore_release(semaphores, Publish::Plain, Invocation::BySource, encoding)
    });
    releases.len()
}

/// Takes the releases waiting for `destination` of `route` (at most [`MAX_IDS`]), for an acquire call that
/// leaves for it now and carries them ([`release_command`]); none if no release waits.
pub(super) fn take_releases<H: Host>(filter: &mut Filter<H>, route: &Rc<Route>, destination: Destination) -> Vec<Held> {
    let outbox = outbox(filter);
    if outbox.releases.is_empty() || !carried_by(route) {
        return Vec::new();
    }
    let mut taken = Vec::new();
    outbox.releases.retain(|held| {
        let fits = taken.len() < MAX_IDS && goes_to(held, route, destination);
        if fits {
            taken.push(held.clone());
        }
        !fits
    });
    taken
}

/// Whether a release waits for `destination` of `route`, for an acquire call leaving for it to carry.
pub(super) fn waits_for<H: Host>(filter: &Filter<H>, route: &Rc<Route>, destination: Destination) -> bool {
    let releases = &filter.permit_outbox.releases;
    !releases.is_empty() && releases.iter().any(|held| goes_to(held, route, destination))
}

/// Whether `held` goes back through `route` to `destination`.
fn goes_to(held: &Held, route: &Rc<Route>, destination: Destination) -> bool {
    Rc::ptr_eq(&held.route, route) && self::destination(route, &held.name) == destination
}

/// Whether `route`'s acquire calls carry releases: it coalesces.
fn carried_by(route: &Route) -> bool {
    route.config.redis.coalescing.max_batch > 1
}

/// The [`crate::script::SEMAPHORE_RELEASE`] of `releases` (of one destination), by sha in `encoding`: a
/// segment of the acquire batch that carries them.
pub(super) fn release_command(releases: &[Held], encoding: Encoding) -> (Vec<u8>, Layout) {
    let groups: Vec<(String, Vec<PermitId>, u64)> =
        by_destination(releases).into_iter().flat_map(|(_, groups)| groups).collect();
    let semaphores: Vec<SemaphorePermits<'_>> =
        groups.iter().map(|(name, ids, _)| SemaphorePermits { name, ids, lease_end_ms: 0 }).collect();
    encode_semaphore_release_laid_out(&semaphores, Publish::Plain, Invocation::BySha, encoding)
}

/// Extends the leases of `held` to now + each one's lease; returns how many.
pub(super) fn extend<H: Host>(filter: &mut Filter<H>, held: &[Held], now_ms: u64) -> usize {
    send(filter, held, now_ms, |semaphores, now_ms, encoding| {
        encode_semaphore_extend(semaphores, now_ms, Publish::Plain, Invocation::BySource, encoding)
    });
    held.len()
}

/// Sends `permits` grouped by destination and semaphore, at most [`MAX_IDS`] per call, each call encoded by
/// `encode` (its semaphores, now, the route's encoding). By source: these calls are rare next to the
/// acquires, and nobody waits for a `NOSCRIPT` resend.
fn send<H: Host>(
    filter: &mut Filter<H>,
    permits: &[Held],
    now_ms: u64,
    encode: impl Fn(&[SemaphorePermits<'_>], u64, Encoding) -> Vec<u8>,
) {
    for (route, groups) in by_destination(permits) {
        let mut call: Vec<SemaphorePermits<'_>> = Vec::new();
        let mut ids = 0;
        for (name, group, lease_ms) in &groups {
            // A semaphore's permits in chunks of at most MAX_IDS; calls of at most MAX_IDS permits.
            for chunk in group.chunks(MAX_IDS) {
                if ids + chunk.len() > MAX_IDS && !call.is_empty() {
                    send_call(filter, &route, &encode(&call, now_ms, route.transport.encoding()));
                    call.clear();
                    ids = 0;
                }
                ids += chunk.len();
                call.push(SemaphorePermits { name, ids: chunk, lease_end_ms: now_ms.saturating_add(*lease_ms) });
            }
        }
        if !call.is_empty() {
            send_call(filter, &route, &encode(&call, now_ms, route.transport.encoding()));
        }
    }
}

/// Permits grouped by destination (route and, on a Redis Cluster, hash slot), then by semaphore (its name,
/// ids and lease), in first-seen order.
#[allow(clippy::type_complexity)]
fn by_destination(permits: &[Held]) -> Vec<(Rc<Route>, Vec<(String, Vec<PermitId>, u64)>)> {
    let mut destinations: Vec<(Destination, Rc<Route>, Vec<(String, Vec<PermitId>, u64)>)> = Vec::new();
    for permit in permits {
        let key = destination(&permit.route, &permit.name);
        let at = match destinations.iter().position(|(k, route, _)| *k == key && Rc::ptr_eq(route, &permit.route)) {
            Some(at) => at,
            None => {
                destinations.push((key, Rc::clone(&permit.route), Vec::new()));
                destinations.len() - 1
            }
        };
        let Some((_, _, groups)) = destinations.get_mut(at) else { continue };
        match groups.iter_mut().find(|(name, _, _)| *name == permit.name) {
            Some((_, ids, _)) => ids.push(permit.id),
            None => groups.push((permit.name.clone(), vec![permit.id], permit.lease_ms)),
        }
    }
    destinations.into_iter().map(|(_, route, groups)| (route, groups)).collect()
}

/// Sends one release or extension; a refused send is counted in `redis_errors`.
fn send_call<H: Host>(filter: &mut Filter<H>, route: &Route, command: &[u8]) {
    filter.metrics.redis_call(&filter.host);
    match route.transport.send(&filter.host, command) {
        Ok(id) => {
            let sent_us = filter.metrics.clock(&filter.host);
            let forget_ms = forget_at(&filter.host, route);
            outbox(filter).calls.insert(id.key(), (sent_us, forget_ms));
        }
        Err(_) => filter.metrics.redis_errors(&filter.host, 1),
    }
}

/// When the tick forgets a call sent now through `route`: `redis.timeout`, the grace and a tick later.
pub(super) fn forget_at(host: &impl Host, route: &Route) -> u64 {
    host.now_ms()
        .saturating_add(route.config.redis.timeout_ms)
        .saturating_add(DEADLINE_GRACE_MS)
        .saturating_add(u64::from(TICK_MS))
}
