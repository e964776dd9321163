//! A request waiting for Redis: its rules' acquires ([`RuleCall`]), the Redis calls that carry them
//! ([`Send`]: one for all the request's limiters, all or nothing, or with Redis Cluster one per hash slot;
//! shadow rules in calls of their own), leases taken and asked for, and the steps: [`start`], the replies
//! ([`PendingRequest::on_reply`], in `reply`), [`PendingRequest::unpark`], [`PendingRequest::expire`]; the
//! calls' bytes are in `encode`.

use smallvec::SmallVec;

use crate::prelude::*;

use crate::block::Block;
use crate::config::{ClockSource, LimiterType, Mode, PluginConfig};
use crate::key::{hash_slot, RequestView};
use crate::response::RuleQuota;
use crate::script::{Clock, LeaseRequest, MemberAt, MEMBER_RANDOM_LEN};

use super::decision::{block_quota, blocked, decide, exempt};
use super::resolve::{group_end, resolve, Resolved};
use super::sends::group;
use super::Decision;
use super::{Context, LeaseAsk, LeaseTicket, Leases};

/// How one rule ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum RuleResult {
    /// Permits taken, from where ([`Taken`]).
    Acquired(RuleQuota, Taken),
    /// [`crate::script::ACQUIRE_ALL`]: the limiter had the permits, another rule rejected: none taken.
    Untaken(RuleQuota),
    /// Rejected by the limiter in Redis or by its local block; `delay_ms` is `None` when no wait can help
    /// (more permits than the rate).
    Rejected { quota: RuleQuota, delay_ms: Option<u64>, local: bool },
    /// Rejected without asking Redis (no key value and `on_missing: deny`).
    Denied,
    /// Its call failed, or its limiter's keys raised a Redis error.
    Failed,
    /// Not asked: the circuit is open (`failure_mode: "local"`, Redis failing); decided locally.
    Skipped,
}

/// Where an acquired rule's permits came from: what giving them back takes when the request does not go on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Taken {
    /// From this VM's lease with these member random bytes (held before, or granted by this call): given
    /// back to that lease.
    Lease { random: [u8; MEMBER_RANDOM_LEN] },
    /// A member of their own in Redis (`granted` permits, in the permits key of `limiter_type`, as the
    /// reply said it), or permits in a counter's slice (`counter_slice_ms`: a sliding window counter's
    /// slice width, the acquire's time its slice; a calendar quota's `Some(1)` with its period's start):
    /// given back or settled with [`crate::script::GIVE_BACK`].
    Member { granted: u64, limiter_type: LimiterType, counter_slice_ms: Option<u64>, period_start_ms: Option<u64> },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum CallState {
    /// Waiting for the reply of its send.
    Waiting,
    /// Waiting for this VM's lease acquire of its limiter, sent by another request
    /// ([`PendingRequest::unpark`]).
    Parked,
    Done(RuleResult),
}

/// One rule's acquire within a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct RuleCall {
    pub(super) rule: usize,
    /// The limiter name.
    pub(super) name: String,
    /// Where the acquire time comes from (a gateway time is restamped when the call waits for a batch).
    pub(super) clock: Clock,
    /// Gateway time the acquire was started, ms (the base of a local block and of a lease's age).
    pub(super) sent_ms: u64,
    pub(super) member_random: [u8; MEMBER_RANDOM_LEN],
    /// Permits it asks for: the rule's, or a reservation's size read from the request (`cost.reserve`
    /// from a header).
    pub(super) permits: u64,
    /// The lease it asks for, if any.
    pub(super) lease: Option<LeaseRequest>,
    pub(super) state: CallState,
}

/// One Redis call of a request: the rule calls it carries (one: [`crate::script::ACQUIRE`]; several:
/// [`crate::script::ACQUIRE_ALL`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Send {
    pub(super) calls: SmallVec<[usize; 2]>,
    /// Whether it was sent again by source (after `NOSCRIPT`).
    pub(super) retried: bool,
    pub(super) done: bool,
}

/// A request waiting for its acquire replies.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PendingRequest {
    /// Every rule that applies, in rule order (those served from a lease are done already).
    pub(super) calls: Vec<RuleCall>,
    pub(super) sends: SmallVec<[Send; 1]>,
    /// A result decided without Redis (a missing key denied): it decides the request, so nothing is sent.
    pub(super) settled: Option<(usize, RuleResult)>,
    /// Whether one of its calls failed as a whole ([`Decision::redis_failed`]).
    pub(super) redis_failed: bool,
}

/// The first step of a request.
#[derive(Debug)]
pub enum Start {
    /// Decided without Redis.
    Decided(Decision),
    /// Send each send index (encode it with [`PendingRequest::encode`]) and report its reply.
    Send(PendingRequest, usize),
}

/// The step after a reply.
// One per reply, moved once: boxing the decision would cost an allocation per request instead.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub enum Progress {
    /// Send this send index again, by source (after `NOSCRIPT`).
    Resend(usize),
    /// Other sends are still outstanding.
    Waiting,
    /// Every send is done.
    Done(Decision),
}

/// Starts deciding a request: reads each rule's key value, serves it from a lease or checks its limiter's
/// local block, and prepares the Redis calls: one for all the request's limiters (all or nothing), or with
/// `redis.redis_cluster` one per hash slot.
///
/// `random` gives the random bytes of each new permit member (they must differ between acquires: two
/// equal members in one window would count as one).
///
/// `name` is a buffer for the limiter names (its allocation is reused: a request rejected by a local block
/// allocates none).
pub fn start(
    ctx: &Context<'_>,
    request: &impl RequestView,
    random: &mut dyn FnMut() -> [u8; MEMBER_RANDOM_LEN],
    name: &mut String,
) -> Start {
    if ctx.config.exempt.as_ref().is_some_and(|exempt| exempt.matches(request)) {
        return Start::Decided(exempt());
    }
    let mut calls = Vec::new();
    let mut settled = None;
    let mut first = 0;
    while let Some(end) = group_end(ctx.config, first) {
        let opened = open_rule(ctx, request, first, end, random, name);
        first = end;
        match opened {
            Opened::Nothing => {}
            Opened::Call(call) => calls.push(call),
            Opened::Denied(entry) => {
                settled = Some((entry, RuleResult::Denied));
                break;
            }
            Opened::Blocked(rule, block) => {
                give_back_leases(&calls, ctx);
                return Start::Decided(blocked(ctx, rule, &block));
            }
        }
    }
    let mut pending = PendingRequest { calls, sends: SmallVec::new(), settled, redis_failed: false };
    if pending.settled.is_some() {
        give_back_leases(&pending.calls, ctx);
        // The answer is already no: decide before spending a round trip.
        return Start::Decided(decide(&pending, ctx));
    }
    if ctx.skip_redis {
        for call in pending.calls.iter_mut().filter(|c| c.state == CallState::Waiting) {
            call.state = CallState::Done(RuleResult::Skipped);
        }
        return Start::Decided(decide(&pending, ctx));
    }
    for call in pending.calls.iter_mut().filter(|c| c.state == CallState::Waiting) {
        call.ask_for_lease(ctx.config, ctx.leases, ctx.now_ms);
    }
    pending.sends = group(&pending.calls, ctx.config);
    if pending.sends.is_empty() && !pending.calls.iter().any(|c| c.state == CallState::Parked) {
        // Nothing to ask Redis (no rule applies, or leases served them all).
        return Start::Decided(decide(&pending, ctx));
    }
    let count = pending.sends.len();
    Start::Send(pending, count)
}

/// What one rule makes of a request at its start ([`open_rule`]). A return value, moved at once into the
/// request's calls: boxing its call would cost an allocation per rule and request for nothing.
#[allow(clippy::large_enum_variant)]
enum Opened {
    /// The rule does not apply.
    Nothing,
    /// Its call: waiting for Redis, or decided already (a lease served it, a shadow rule's denial or block).
    Call(RuleCall),
    /// A missing key denied by this rule entry: the request is rejected without Redis.
    Denied(usize),
    /// This rule's limiter is blocked locally: the request is rejected without Redis.
    Blocked(usize, Block),
}

/// Opens the rule whose entries are `first..end` for a request: resolves its key and entry, then serves it
/// from this VM's lease, or finds its limiter blocked locally, or prepares its acquire.
fn open_rule(
    ctx: &Context<'_>,
    request: &impl RequestView,
    first: usize,
    end: usize,
    random: &mut dyn FnMut() -> [u8; MEMBER_RANDOM_LEN],
    name: &mut String,
) -> Opened {
    let default_entry = end - 1;
    let shadow = |entry: usize| ctx.config.rules.get(entry).is_some_and(|r| r.mode == Mode::Shadow);
    let index = match resolve(ctx.config, first, end, request, name) {
        Resolved::Exempt | Resolved::NoKey => return Opened::Nothing,
        Resolved::Denied if shadow(default_entry) => {
            return Opened::Call(RuleCall::settled(default_entry, ctx.now_ms, CallState::Done(RuleResult::Denied)));
        }
        Resolved::Denied => return Opened::Denied(default_entry),
        Resolved::Limiter(entry) => entry,
    };
    let Some(rule) = ctx.config.rules.get(index) else { return Opened::Nothing };
    let clock = match ctx.config.clock {
        ClockSource::Gateway => Clock::Gateway(ctx.now_ms),
        ClockSource::Redis => Clock::Redis,
    };
    let permits = super::reservation::permits_of(rule, request);
    let call = |state, member_random| RuleCall {
        rule: index,
        name: name.clone(),
        clock,
        sent_ms: ctx.now_ms,
        member_random,
        permits,
        lease: None,
        state,
    };
    if rule.lease.is_some() {
        if let Some((remaining, random)) = ctx.leases.take(name, ctx.now_ms, rule.permits) {
            let quota = RuleQuota {
                rule: index,
                limit: rule.rate,
                window_ms: rule.interval_ms,
                remaining,
                reset_ms: rule.interval_ms,
            };
            let state = CallState::Done(RuleResult::Acquired(quota, Taken::Lease { random }));
            return Opened::Call(call(state, [0; MEMBER_RANDOM_LEN]));
        }
    }
    if rule.local_block_max_ms > 0 {
        if let Some(block) = ctx.blocks.rejecting(name, ctx.now_ms, permits, rule.cost.is_some()) {
            if !shadow(index) {
                return Opened::Blocked(index, block);
            }
            // A shadow rule blocked locally would have rejected: no Redis call to learn it again.
            let (quota, delay_ms) = block_quota(ctx.now_ms, index, &block);
            let state = CallState::Done(RuleResult::Rejected { quota, delay_ms: Some(delay_ms), local: true });
            return Opened::Call(RuleCall { name: name.clone(), ..RuleCall::settled(index, ctx.now_ms, state) });
        }
    }
    let mut member_random = random();
    if rule.cost.is_some() {
        super::reservation::mark_reserved(&mut member_random);
    }
    Opened::Call(call(CallState::Waiting, member_random))
}

impl RuleCall {
    /// A call decided without Redis (a shadow rule's denial or local block), for rule entry `rule`.
    fn settled(rule: usize, now_ms: u64, state: CallState) -> Self {
        RuleCall {
            rule,
            name: String::new(),
            clock: Clock::Gateway(now_ms),
            sent_ms: now_ms,
            member_random: [0; MEMBER_RANDOM_LEN],
            permits: 0,
            lease: None,
            state,
        }
    }

    /// For a rule with a lease: asks for one in this call, with the previous lease to settle, or parks the
    /// call when this VM's lease acquire of the limiter is on its way already (it waits for that lease
    /// rather than spending a round trip of its own).
    fn ask_for_lease(&mut self, config: &PluginConfig, leases: &dyn Leases, now_ms: u64) {
        let Some(rule) = config.rules.get(self.rule) else { return };
        let Some(lease) = rule.lease else { return };
        let due_ms = now_ms.saturating_add(config.redis.timeout_ms);
        match leases.begin(&self.name, now_ms, due_ms, lease.max_permits, rule.permits) {
            Some(LeaseAsk { want, settle }) => {
                self.lease = Some(LeaseRequest { max_permits: want, max_age_ms: lease.max_age_ms, settle });
            }
            None => self.state = CallState::Parked,
        }
    }
}

/// Puts back what the rules served so far took from leases (the request was decided against at start).
fn give_back_leases(calls: &[RuleCall], ctx: &Context<'_>) {
    for ticket in lease_tickets(calls, ctx.config) {
        ctx.leases.put_back(&ticket);
    }
}

/// The permits `calls` took from this VM's leases.
/// The member `call` acquired of its own in Redis, if it did: its permits and where it was written.
pub(super) fn own_member(call: &RuleCall) -> Option<(u64, Option<MemberAt>)> {
    match call.state {
        CallState::Done(RuleResult::Acquired(
            quota,
            Taken::Member { granted, limiter_type, counter_slice_ms, period_start_ms },
        )) => {
            let at = MemberAt::of(call.clock, quota.limit, limiter_type);
            let at = at.map(|at| MemberAt { counter_slice_ms, score_ms: period_start_ms.unwrap_or(at.score_ms), ..at });
            Some((granted, at))
        }
        _ => None,
    }
}

pub(super) fn lease_tickets(calls: &[RuleCall], config: &PluginConfig) -> Vec<LeaseTicket> {
    calls
        .iter()
        .filter_map(|call| match (&call.state, config.rules.get(call.rule)) {
            (CallState::Done(RuleResult::Acquired(_, Taken::Lease { random })), Some(rule)) => {
                Some(LeaseTicket { name: call.name.clone(), random: *random, permits: rule.permits })
            }
            _ => None,
        })
        .collect()
}

impl PendingRequest {
    /// Stamps send `send`'s acquires at `now_ms`, as a call sent now is stamped (it waited for a batch): the
    /// gateway clock its script reads, and the base of its lease's age and its local block. A call that
    /// waited keeping its arrival time could reach Redis after calls stamped later by other VMs, and the
    /// window (released by the stamps) would hold more than the rate by the wait.
    pub fn restamp(&mut self, send: usize, now_ms: u64) {
        let Some(send) = self.sends.get(send) else { return };
        for &index in &send.calls {
            if let Some(call) = self.calls.get_mut(index) {
                call.sent_ms = now_ms;
                if let Clock::Gateway(_) = call.clock {
                    call.clock = Clock::Gateway(now_ms);
                }
            }
        }
    }

    /// The hash slot of send `send`'s limiters with `redis.redis_cluster` (a send's limiters share one),
    /// else 0: where its call may be batched with others ([`crate::script::ACQUIRE_BATCH`]).
    pub fn slot(&self, send: usize, config: &PluginConfig) -> u16 {
        let first = self.sends.get(send).and_then(|s| s.calls.first()).and_then(|&c| self.calls.get(c));
        match first {
            Some(call) if config.redis.redis_cluster => hash_slot(&call.name),
            _ => 0,
        }
    }

    /// The rule calls that acquired a member of their own in Redis, with its permits and where it was
    /// written (known on the gateway's clock): what a rejected request gives back, and an allowed request's
    /// reservations.
    pub(super) fn own_members(&self) -> impl Iterator<Item = (&RuleCall, u64, Option<MemberAt>)> {
        self.calls.iter().filter_map(|call| own_member(call).map(|(granted, at)| (call, granted, at)))
    }

    /// Whether any of its rule calls is on limiter `name`.
    pub fn asks(&self, name: &str) -> bool {
        self.calls.iter().any(|c| c.name == name)
    }

    /// The limiter of its call of rule entry `rule`, if it has one.
    pub fn limiter_of(&self, rule: usize) -> Option<&str> {
        self.calls.iter().find(|c| c.rule == rule).map(|c| c.name.as_str())
    }

    /// Whether a call waits for this VM's lease acquire of limiter `name`.
    pub fn parked_on(&self, name: &str) -> bool {
        self.calls.iter().any(|c| c.state == CallState::Parked && c.name == name)
    }

    /// The limiters of the lease acquires this request sent and still waits for, with the member random bytes
    /// of the settlement each carried.
    pub fn leases_waiting(&self) -> Vec<(String, Option<[u8; MEMBER_RANDOM_LEN]>)> {
        let waiting = |c: &&RuleCall| c.state == CallState::Waiting && c.lease.is_some();
        let settled = |c: &RuleCall| c.lease.and_then(|l| l.settle).map(|s| s.random);
        self.calls.iter().filter(waiting).map(|c| (c.name.clone(), settled(c))).collect()
    }

    /// This VM's lease acquire of limiter `name` ended: each call parked on it takes its permits from the
    /// lease if it can, else asks Redis itself (for a lease of its own, or, when another lease acquire is
    /// on its way again, stays parked). Returns the new sends to make, and the progress.
    pub fn unpark(&mut self, name: &str, ctx: &Context<'_>) -> (SmallVec<[usize; 1]>, Progress) {
        let (config, leases, now_ms) = (ctx.config, ctx.leases, ctx.now_ms);
        let mut new_sends = SmallVec::new();
        for index in 0..self.calls.len() {
            let Some(call) = self.calls.get_mut(index) else { continue };
            if call.state != CallState::Parked || call.name != name {
                continue;
            }
            let Some(rule) = config.rules.get(call.rule) else { continue };
            if let Some((remaining, random)) = leases.take(name, now_ms, rule.permits) {
                let quota = RuleQuota {
                    rule: call.rule,
                    limit: rule.rate,
                    window_ms: rule.interval_ms,
                    remaining,
                    reset_ms: rule.interval_ms,
                };
                call.state = CallState::Done(RuleResult::Acquired(quota, Taken::Lease { random }));
                continue;
            }
            call.state = CallState::Waiting;
            call.sent_ms = now_ms;
            if let Clock::Gateway(_) = call.clock {
                call.clock = Clock::Gateway(now_ms);
            }
            call.ask_for_lease(config, leases, now_ms);
            if call.state == CallState::Waiting {
                let mut covered = SmallVec::new();
                covered.push(index);
                new_sends.push(self.sends.len());
                self.sends.push(Send { calls: covered, retried: false, done: false });
            }
        }
        (new_sends, self.progress(ctx))
    }

    /// Ends every call still waiting (the request's deadline passed, see [`Failure::TimedOut`]) and decides
    /// the request; also answers how many of its Redis calls were still unanswered (each a failed call).
    pub fn expire(&mut self, ctx: &Context<'_>) -> (Decision, usize) {
        for call in &mut self.calls {
            if matches!(call.state, CallState::Waiting | CallState::Parked) {
                call.state = CallState::Done(RuleResult::Failed);
            }
        }
        let mut unanswered = 0;
        for send in self.sends.iter_mut().filter(|s| !s.done) {
            send.done = true;
            unanswered += 1;
        }
        self.redis_failed |= unanswered > 0;
        (decide(self, ctx), unanswered)
    }

    /// The permits its rules took from this VM's leases so far (to put back when its client leaves).
    pub fn lease_tickets(&self, config: &PluginConfig) -> Vec<LeaseTicket> {
        lease_tickets(&self.calls, config)
    }

    /// Waiting while a send or a parked call is outstanding, else the decision.
    pub(super) fn progress(&self, ctx: &Context<'_>) -> Progress {
        if self.sends.iter().any(|s| !s.done) || self.calls.iter().any(|c| c.state == CallState::Parked) {
            Progress::Waiting
        } else {
            Progress::Done(decide(self, ctx))
        }
    }
}
