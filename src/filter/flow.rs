//! A paused request ([`Flow`]) and its one step: [`advance`] sends what the request's limiter asks
//! for, follows the replies, and ends the request once it is decided, or pauses it. Every callback that
//! moves a request (its headers, a reply, a lease acquire it was parked on, its deadline) ends in that
//! step. Also a request's start ([`Filter::decide`]: decided at once, or its calls sent), the deadline
//! guard's end of a request ([`end_flows`]) and the requests parked on a lease acquire ([`wake_parked`]).

use alloc::rc::Rc;

use crate::prelude::*;

use crate::block::fnv1a;
use crate::host::{Host, LogLevel};
use crate::key::RequestView;
use crate::limiter::{self, Decision, Effects, LeaseEnd, LeaseTicket, PendingRequest, Progress, Start, Verdict};
use crate::script::Invocation;
use crate::transport::Failure;

use super::route::Route;
use super::{log, with_context, Action, Filter, DEADLINE_GRACE_MS};

/// Where a paused request stands.
#[derive(Debug)]
pub(super) enum Stage {
    /// Waiting for the replies of its calls.
    Waiting(PendingRequest),
    /// Decided, but the host refused to switch to its context: delivered again on the next tick.
    Undelivered(Verdict),
}

/// A request the filter paused.
#[derive(Debug)]
pub(super) struct Flow {
    /// Its configuration.
    pub(super) route: Rc<Route>,
    pub(super) stage: Stage,
    /// Its outstanding calls ([`crate::transport::CallId::key`]).
    pub(super) tokens: Vec<u64>,
    /// When the guard ends the calls still waiting, ms since the epoch.
    pub(super) deadline_ms: u64,
    /// When its headers arrived, us since the epoch ([`super::metrics::Metrics::clock`]: 0 without histograms).
    pub(super) since_us: u64,
}

impl Flow {
    /// A request of `route` (its headers seen at `since_us`) waiting for Redis until `deadline_ms`.
    pub(super) fn waiting(route: Rc<Route>, pending: PendingRequest, deadline_ms: u64, since_us: u64) -> Self {
        Flow { route, stage: Stage::Waiting(pending), tokens: Vec::new(), deadline_ms, since_us }
    }

    /// Whether the tick ends it now: its deadline passed, or its decision waits to be delivered.
    pub(super) fn due(&self, now_ms: u64) -> bool {
        matches!(self.stage, Stage::Undelivered(_)) || self.deadline_ms <= now_ms
    }

    /// The permits its rules took from this VM's leases so far.
    pub(super) fn lease_tickets(&self) -> Vec<LeaseTicket> {
        match &self.stage {
            Stage::Waiting(pending) => pending.lease_tickets(&self.route.config),
            Stage::Undelivered(_) => Vec::new(),
        }
    }
}

/// An outstanding call: the request (HTTP context id) and the call index in its [`PendingRequest`].
#[derive(Debug, Clone, Copy)]
pub(super) struct Call {
    pub(super) context_id: u32,
    pub(super) call: usize,
}

/// Which callback moves a request: its own (the request's context is effective) or the root context's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Origin {
    /// `proxy_on_request_headers`.
    Callback,
    /// A reply or the tick, on the root context.
    Reply,
    /// Woken from a lease acquire it was parked on: it keeps the deadline it had when it arrived.
    Woken,
}

/// The request's one step: sends `sends` (by sha), follows `progress` and the sends' own, then ends the
/// request if it is decided, else pauses it until its replies or its deadline.
pub(super) fn advance<H: Host>(
    filter: &mut Filter<H>,
    context_id: u32,
    mut flow: Flow,
    sends: impl IntoIterator<Item = usize>,
    progress: Progress,
    origin: Origin,
) -> Action {
    let deadline_ms = flow.deadline_ms;
    let mut decided = drive(filter, &mut flow, progress, context_id);
    for index in sends {
        let progress = send(filter, context_id, &mut flow, index, Invocation::BySha);
        decided = drive(filter, &mut flow, progress, context_id).or(decided);
    }
    if origin == Origin::Woken {
        flow.deadline_ms = deadline_ms;
    }
    match decided {
        None => {
            pause(filter, context_id, flow);
            Action::Pause
        }
        Some(decision) => {
            forget(filter, context_id, &flow);
            let pending = match &flow.stage {
                Stage::Waiting(pending) => Some(pending),
                Stage::Undelivered(_) => None,
            };
            conclude(filter, context_id, &flow.route, decision, flow.since_us, pending, origin)
        }
    }
}

/// Ends decided request `context_id` of `route` (its headers seen at `since_us`), or holds it to ask again
/// after its rejection's delay (a rule's `max_wait`, [`super::wait`]).
fn conclude<H: Host>(
    filter: &mut Filter<H>,
    context_id: u32,
    route: &Rc<Route>,
    decision: Decision,
    since_us: u64,
    pending: Option<&PendingRequest>,
    origin: Origin,
) -> Action {
    let Some(decision) = super::wait::park(filter, context_id, route, since_us, decision, pending) else {
        return Action::Pause;
    };
    let next = super::end::finish(filter, context_id, route, decision, since_us);
    super::end::end(filter, context_id, route, next, origin)
}

/// Follows the progress until the request waits for Redis or is decided.
fn drive<H: Host>(
    filter: &mut Filter<H>,
    flow: &mut Flow,
    mut progress: Progress,
    context_id: u32,
) -> Option<Decision> {
    loop {
        progress = match progress {
            Progress::Resend(call) => send(filter, context_id, flow, call, Invocation::BySource),
            Progress::Waiting => return None,
            Progress::Done(decision) => return Some(decision),
        };
    }
}

/// Sends a call's acquire, or, while its destination has `redis.max_in_flight` calls on their way, puts
/// it in the queue of the next batch ([`super::coalesce`]); a refused send is that call's failure.
fn send<H: Host>(
    filter: &mut Filter<H>,
    context_id: u32,
    flow: &mut Flow,
    call: usize,
    invocation: Invocation,
) -> Progress {
    let route = Rc::clone(&flow.route);
    let Stage::Waiting(pending) = &flow.stage else { return Progress::Waiting };
    let coalescing = route.config.redis.coalescing;
    let destination = (route.index, pending.slot(call, &route.config));
    let now_ms = filter.host.now_ms();
    let timeout_deadline = now_ms.saturating_add(route.config.redis.timeout_ms).saturating_add(DEADLINE_GRACE_MS);
    // A request's own calls (its shadow rules', its hash slots') never wait for one another: its later
    // calls go with its first, out at once or in the same batch.
    let coalesced = coalescing.max_batch > 1 && invocation == Invocation::BySha && flow.tokens.is_empty();
    if coalesced
        && (filter.coalescer.is_waiting(context_id, destination)
            || filter.coalescer.waits(destination, coalescing.max_in_flight, now_ms, flow.deadline_ms))
    {
        filter.coalescer.wait(destination, super::coalesce::Member::Rate(Call { context_id, call }));
        flow.deadline_ms = flow.deadline_ms.max(timeout_deadline);
        return Progress::Waiting;
    }
    // The in-flight permits that ride with the request's rate acquire go in its batch.
    let joined = super::inflight::rides(filter, context_id);
    // Permits given back for this destination ride with the call too.
    let releases = coalesced && super::permit_outbox::waits_for(filter, &route, destination);
    if joined || releases || (coalesced && !filter.outbox.is_empty()) {
        // Settles waiting for this destination ride with the call instead of leaving from the tick.
        let settles = match coalesced && !filter.outbox.is_empty() {
            true => super::outbox::take_settles(filter, &route, destination.1, coalescing.max_batch as usize),
            false => Vec::new(),
        };
        if joined || releases || !settles.is_empty() {
            return send_carrying(filter, context_id, flow, call, destination, settles, joined);
        }
    }
    let Some(command) = pending.encode(call, invocation, route.transport.encoding(), &route.plan) else {
        return Progress::Waiting;
    };
    match route.transport.send(&filter.host, &command) {
        Ok(id) => {
            filter.metrics.redis_call(&filter.host);
            filter.calls.insert(id.key(), (Call { context_id, call }, filter.metrics.clock(&filter.host)));
            flow.tokens.push(id.key());
            if coalescing.max_batch > 1 {
                let expires_ms = super::coalesce::expiry(&filter.host, &route);
                filter.coalescer.sent(id.key(), destination, now_ms, expires_ms);
            }
            flow.deadline_ms = flow.deadline_ms.max(timeout_deadline);
            Progress::Waiting
        }
        Err(failure) => feed(filter, flow, call, Err(failure), true),
    }
}

/// Sends a call's acquire in one batch with `settles` (of its destination, taken from the outbox) and, if
/// `joined`, the in-flight permits that ride with it. A refused send of a joined call waits: its permits
/// failed, and the in-flight stage concludes the request ([`super::inflight`]).
fn send_carrying<H: Host>(
    filter: &mut Filter<H>,
    context_id: u32,
    flow: &mut Flow,
    call: usize,
    destination: super::coalesce::Destination,
    settles: Vec<super::give_back::GiveBackCall>,
    joined: bool,
) -> Progress {
    let route = Rc::clone(&flow.route);
    let command = match &flow.stage {
        Stage::Waiting(pending) => {
            pending.encode_laid_out(call, Invocation::BySha, route.transport.encoding(), &route.plan)
        }
        Stage::Undelivered(_) => None,
    };
    let Some(command) = command else {
        filter.outbox.extend(settles);
        return Progress::Waiting;
    };
    let now_ms = filter.host.now_ms();
    match super::coalesce::send_carrying(filter, &route, destination, Call { context_id, call }, command, settles) {
        Ok(key) => {
            flow.tokens.push(key);
            let timeout_deadline =
                now_ms.saturating_add(route.config.redis.timeout_ms).saturating_add(DEADLINE_GRACE_MS);
            flow.deadline_ms = flow.deadline_ms.max(timeout_deadline);
            Progress::Waiting
        }
        Err(_) if joined => Progress::Waiting,
        // Counted with the settles that failed with it.
        Err(failure) => feed(filter, flow, call, Err(failure), false),
    }
}

/// Hands one call's reply (or failure) to the request's pending acquires; counts and logs what it
/// teaches, records its blocks and leases. `count_failure`: whether a failed call counts in
/// `redis_errors` (a batch's failure is one failed call, fed to each of its requests).
pub(super) fn feed<H: Host>(
    filter: &mut Filter<H>,
    flow: &mut Flow,
    call: usize,
    reply: Result<&[u8], Failure>,
    count_failure: bool,
) -> Progress {
    let route = Rc::clone(&flow.route);
    let Stage::Waiting(pending) = &mut flow.stage else { return Progress::Waiting };
    let now_ms = filter.host.now_ms();
    let (progress, effects) = with_context!(filter, route, now_ms, false, |ctx| {
        pending.on_reply(call, reply, &ctx, &mut filter.cache.borrow_mut())
    });
    learn(filter, &route, effects, now_ms, count_failure);
    progress
}

/// What a reply taught: failures counted and logged, notices logged, blocks recorded, leases ended.
fn learn<H: Host>(filter: &mut Filter<H>, route: &Route, effects: Effects, now_ms: u64, count_failure: bool) {
    if effects.failed() && (count_failure || effects.call_failure.is_none()) {
        filter.metrics.redis_errors(&filter.host, 1);
    }
    let Effects { notices, blocks, leases, call_failure, limiter_errors } = effects;
    let mode = route.config.failure_mode;
    if let Some(failure) = &call_failure {
        filter.failure_log.failed(&filter.host, failure, mode);
    }
    for error in &limiter_errors {
        let rule = route.config.rules.get(error.rule).map_or("", |r| r.name.as_str());
        filter.limiter_errors.failed(&filter.host, rule, error, mode);
    }
    for notice in notices {
        log(&filter.host, LogLevel::Warn, &notice.to_string());
    }
    for (name, block) in blocks {
        route.blocks.record(&filter.host, &name, block, now_ms);
        filter.recent_blocks.borrow_mut().keep(&name, fnv1a(name.as_bytes()), block);
    }
    for LeaseEnd { name, grant, settled } in leases {
        if grant.is_some() {
            filter.metrics.lease(&filter.host);
        }
        filter.leases.end(&name, grant, settled);
        filter.ended_leases.push(name);
    }
}

/// Keeps a request paused until its replies or its deadline; the tick runs while any is paused.
pub(super) fn pause<H: Host>(filter: &mut Filter<H>, context_id: u32, flow: Flow) {
    filter.flows.insert(context_id, flow);
    super::tick::start(filter);
}

/// Ends these paused requests now: a decision the host refused before is delivered, a request still
/// waiting ends its calls as timed out (each a failed call) and follows the failure mode.
pub(super) fn end_flows<H: Host>(filter: &mut Filter<H>, context_ids: Vec<u32>) {
    for context_id in context_ids {
        // Its permits rode with it: the in-flight stage concludes first (and may answer the request).
        super::inflight::end_joined(filter, context_id, filter.host.now_ms());
        let Some(mut flow) = filter.flows.remove(&context_id) else { continue };
        // Its calls' failure is counted below: their batches count it no more when they expire.
        filter.coalescer.counted(&flow.tokens);
        forget(filter, context_id, &flow);
        let route = Rc::clone(&flow.route);
        let progress = match &mut flow.stage {
            Stage::Undelivered(next) => {
                let next = next.clone();
                super::end::end(filter, context_id, &route, next, Origin::Reply);
                continue;
            }
            Stage::Waiting(pending) => {
                let now_ms = filter.host.now_ms();
                let (decision, unanswered) = with_context!(filter, route, now_ms, false, |ctx| pending.expire(&ctx));
                if unanswered > 0 {
                    filter.metrics.redis_errors(&filter.host, unanswered);
                    filter.failure_log.failed(&filter.host, &Failure::TimedOut, route.config.failure_mode);
                }
                Progress::Done(decision)
            }
        };
        advance(filter, context_id, flow, 0..0, progress, Origin::Reply);
    }
    wake_parked(filter);
}

/// Requests parked on a lease acquire that ended go on: served from the new lease, or each asking Redis
/// (docs/configuration.md, "Leases"). A woken request keeps the deadline it had when it arrived, so it still ends
/// within `redis.timeout` of its start (+ the grace and a tick), in the failure mode if need be.
pub(super) fn wake_parked<H: Host>(filter: &mut Filter<H>) {
    while let Some(name) = filter.ended_leases.pop() {
        let parked: Vec<u32> = filter
            .flows
            .iter()
            .filter(|(_, flow)| matches!(&flow.stage, Stage::Waiting(pending) if pending.parked_on(&name)))
            .map(|(&context_id, _)| context_id)
            .collect();
        for context_id in parked {
            let Some(mut flow) = filter.flows.remove(&context_id) else { continue };
            let route = Rc::clone(&flow.route);
            let Stage::Waiting(pending) = &mut flow.stage else { continue };
            let now_ms = filter.host.now_ms();
            let (sends, progress) = with_context!(filter, route, now_ms, false, |ctx| pending.unpark(&name, &ctx));
            advance(filter, context_id, flow, sends, progress, Origin::Woken);
        }
    }
}

/// Forgets a request's outstanding calls (those on their way answer [`super::late`]); its lease acquires on
/// their way are given up: nobody will hear of them, so the requests parked on them are woken to ask Redis
/// themselves.
pub(super) fn forget<H: Host>(filter: &mut Filter<H>, context_id: u32, flow: &Flow) {
    // Calls on their way are kept for their replies ([`super::late`]): what they take goes back.
    if !super::late::keep(filter, context_id, flow) {
        for token in &flow.tokens {
            filter.calls.remove(token);
        }
    }
    filter.coalescer.forget(context_id, &flow.tokens);
    if let Stage::Waiting(pending) = &flow.stage {
        for (name, settled) in pending.leases_waiting() {
            // Whether Redis ran the settlement it carried is unknown: it is sent again (safely).
            filter.leases.end(&name, None, settled.map(|random| (random, false)));
            filter.ended_leases.push(name);
        }
    }
}

impl<H: Host> Filter<H> {
    /// Decides request `context_id` of `route` (with its JSON request body, if one was read, and the copy
    /// of its headers taken before they went on; its headers seen at `since_us`, [`super::metrics::Metrics::clock`]),
    /// or sends its calls and pauses.
    pub(super) fn decide(
        &mut self,
        context_id: u32,
        route: Rc<Route>,
        body: Option<&serde_json::Value>,
        headers: Option<&[(String, Vec<u8>)]>,
        since_us: u64,
    ) -> Action {
        let now_ms = self.host.now_ms();
        let skip_redis = route.skips_redis(now_ms);
        let action = match self.start_limiter(&route, body, headers, now_ms, skip_redis) {
            Start::Decided(decision) => conclude(self, context_id, &route, decision, since_us, None, Origin::Callback),
            // An older request of this VM waits on its limiter: it waits behind it.
            Start::Send(pending, _) if super::wait::queue_behind(self, context_id, &route, since_us, &pending) => {
                Action::Pause
            }
            Start::Send(pending, sends) => {
                // A request parked on a lease acquire waits as long as a call of its own would.
                let deadline_ms =
                    now_ms.saturating_add(route.config.redis.timeout_ms).saturating_add(DEADLINE_GRACE_MS);
                let flow = Flow::waiting(route, pending, deadline_ms, since_us);
                advance(self, context_id, flow, 0..sends, Progress::Waiting, Origin::Callback)
            }
        };
        wake_parked(self);
        action
    }
}

impl<H: Host> Filter<H> {
    /// [`limiter::start`] of the effective request of `route` at `now_ms` (its JSON body and the copy of its
    /// headers, if any; `skip_redis`: the degraded mode's circuit is open). One copy in the module for
    /// both of its callers.
    #[inline(never)]
    fn start_limiter(
        &mut self,
        route: &Route,
        body: Option<&serde_json::Value>,
        headers: Option<&[(String, Vec<u8>)]>,
        now_ms: u64,
        skip_redis: bool,
    ) -> Start {
        with_context!(self, route, now_ms, skip_redis, |ctx| {
            let random = &mut self.random;
            let request = HostRequest { host: &self.host, body, headers };
            limiter::start(&ctx, &request, &mut || super::ids::member_random(random), &mut self.name_buffer)
        })
    }

    /// Starts request `context_id`'s rate stage (of `route`, its headers seen at `since_us`) together with
    /// its in-flight permits, which ride with its rate acquire when it has exactly one, to the permits' hash
    /// slot (`slot`): its flow paused (`Some(Pause)`). A request its rate rules reject without Redis (a
    /// local block, a missing key denied) is answered at once, taking no permit (`Some`, after the local
    /// reply). `None`: the rate stage cannot carry the permits (it asks nothing of Redis, or more than one
    /// call, or another hash slot); nothing was taken or sent.
    pub(super) fn start_joined(
        &mut self,
        context_id: u32,
        route: &Rc<Route>,
        since_us: u64,
        slot: u16,
    ) -> Option<Action> {
        let now_ms = self.host.now_ms();
        match self.start_limiter(route, None, None, now_ms, false) {
            Start::Decided(decision) if matches!(decision.verdict, Verdict::Respond { .. }) => {
                let next = super::end::finish(self, context_id, route, decision, since_us);
                Some(super::end::end(self, context_id, route, next, Origin::Callback))
            }
            Start::Send(pending, 1) if pending.slot(0, &route.config) == slot => {
                if route.settles_from_body {
                    super::body::before_headers_go(self, route, false);
                }
                let deadline_ms =
                    now_ms.saturating_add(route.config.redis.timeout_ms).saturating_add(DEADLINE_GRACE_MS);
                let flow = Flow::waiting(Rc::clone(route), pending, deadline_ms, since_us);
                Some(advance(self, context_id, flow, 0..1, Progress::Waiting, Origin::Callback))
            }
            // Nothing taken: a rule served by a lease is never joined (`Route::joins_permits`).
            Start::Decided(_) | Start::Send(..) => None,
        }
    }
}

/// The request as the host shows it (the effective context's headers and properties), its JSON body when
/// it was read, and the copy of its headers when it is decided after they went on.
pub(super) struct HostRequest<'a, H: Host> {
    pub(super) host: &'a H,
    pub(super) body: Option<&'a serde_json::Value>,
    pub(super) headers: Option<&'a [(String, Vec<u8>)]>,
}

impl<H: Host> RequestView for HostRequest<'_, H> {
    fn header(&self, name: &str) -> Option<Vec<u8>> {
        match self.headers {
            Some(headers) => headers.iter().find(|(key, _)| key == name).map(|(_, value)| value.clone()),
            None => self.host.request_header(name).ok().flatten(),
        }
    }

    fn source_address(&self) -> Option<String> {
        let bytes = self.host.property(&["source", "address"]).ok().flatten()?;
        String::from_utf8(bytes).ok()
    }

    fn property(&self, path: &[&str]) -> Option<Vec<u8>> {
        self.host.property(path).ok().flatten()
    }

    fn body_field(&self, path: &[String]) -> Option<Vec<u8>> {
        super::body::field(self.body?, path)
    }
}
