//! What a reply means: the Redis reply (or failure) of one of a request's calls, decoded, turned into each
//! rule's result ([`call_result`]), and what it teaches besides ([`Effects`]: notices worth a log line,
//! local blocks, leases, failures).

use core::fmt;

use crate::prelude::*;

use crate::block::Block;
use crate::cache::{LimiterCache, Observation};
use crate::config::{Rule, WindowLayout};
use crate::response::RuleQuota;
use crate::script::{
    decode_acquire_all_reply, decode_acquire_reply, AcquireOutcome, AcquireReply, ConfigChange, EffectiveConfig,
    LimiterReply, ReplyError, MEMBER_RANDOM_LEN,
};
use crate::transport::Failure;

use super::decision::member_give_back;
use super::pending::{own_member, CallState, PendingRequest, Progress, RuleCall, RuleResult, Taken};
use super::{Context, GiveBack, LeaseGrant};

/// What a reply teaches besides the decision.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Effects {
    /// Log lines, once per limiter.
    pub notices: Vec<Notice>,
    /// Local blocks to record (Redis rejected these limiters).
    pub blocks: Vec<(String, Block)>,
    /// Lease acquires that ended.
    pub leases: Vec<LeaseEnd>,
    /// The call failed as a whole: one failed call (`redis_errors`), logged once per cause.
    pub call_failure: Option<Failure>,
    /// Limiters whose keys raised a Redis error in a call that decided the others: their rules fail
    /// alone (one failed call however many).
    pub limiter_errors: Vec<LimiterError>,
}

impl Effects {
    /// Whether the call failed, as a whole or for one of its limiters (one count in `redis_errors`).
    pub fn failed(&self) -> bool {
        self.call_failure.is_some() || !self.limiter_errors.is_empty()
    }
}

/// A lease acquire that ended ([`crate::lease::LeaseTable::end`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseEnd {
    /// The limiter name.
    pub name: String,
    /// The lease Redis granted (`None`: none; the call failed, rejected, or took only the request's own).
    pub grant: Option<LeaseGrant>,
    /// The settlement the call carried: its member's random bytes, and whether Redis ran it.
    pub settled: Option<([u8; MEMBER_RANDOM_LEN], bool)>,
}

/// A Redis error on one limiter's keys in a combined call (e.g. `WRONGTYPE`: its config key is not a hash).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LimiterError {
    /// The rule's index in the configuration.
    pub rule: usize,
    /// The limiter name.
    pub limiter: String,
    /// Redis's error text.
    pub error: String,
}

impl PendingRequest {
    /// Records the transport's outcome for send `send`: the raw RESP reply bytes, or a failure. `now_ms`:
    /// the gateway time the reply arrived (a lease's first use).
    ///
    /// Updates the cache with the limiter config a reply reports and returns what is worth logging or
    /// recording. A reply for an unknown or finished send is ignored ([`Progress::Waiting`] or the
    /// decision again).
    pub fn on_reply(
        &mut self,
        send: usize,
        reply: Result<&[u8], Failure>,
        ctx: &Context<'_>,
        cache: &mut LimiterCache,
    ) -> (Progress, Effects) {
        let mut effects = Effects::default();
        let Some(entry) = self.sends.get_mut(send).filter(|s| !s.done) else {
            return (self.progress(ctx), effects);
        };
        let decoded = reply.map(|bytes| match entry.calls.len() {
            1 => decode_acquire_reply(bytes).map(|reply| vec![Ok(reply)]),
            n => decode_acquire_all_reply(bytes, n),
        });
        let results: Result<Vec<LimiterReply>, Failure> = match decoded {
            Err(failure) => Err(failure),
            Ok(Err(ReplyError::NoScript)) if !entry.retried => {
                entry.retried = true;
                return (Progress::Resend(send), effects);
            }
            Ok(Err(ReplyError::NoScript)) => Err(Failure::RedisError("NOSCRIPT after EVAL".into())),
            Ok(Err(ReplyError::Redis(text))) => Err(Failure::RedisError(text)),
            Ok(Err(ReplyError::Unexpected(what))) => Err(Failure::BadReply(what)),
            Ok(Ok(replies)) => Ok(replies),
        };
        entry.done = true;
        let covered = entry.calls.clone();
        if let Err(failure) = &results {
            self.redis_failed = true;
            effects.call_failure = Some(failure.clone());
        }
        for (position, index) in covered.into_iter().enumerate() {
            let Some(call) = self.calls.get_mut(index) else { continue };
            let Some(rule) = ctx.config.rules.get(call.rule) else { continue };
            let reply = match &results {
                Err(_) => None,
                Ok(replies) => match replies.get(position) {
                    Some(Ok(reply)) => Some(reply),
                    Some(Err(error)) => {
                        let limiter = call.name.clone();
                        effects.limiter_errors.push(LimiterError { rule: call.rule, limiter, error: error.clone() });
                        None
                    }
                    None => {
                        let what = Failure::BadReply("fewer replies than limiters".into());
                        effects.call_failure.get_or_insert(what);
                        None
                    }
                },
            };
            let (result, grant) = match reply {
                Some(reply) => call_result(call, rule, reply, ctx.now_ms, cache, &mut effects),
                None => (RuleResult::Failed, None),
            };
            if let Some(lease) = &call.lease {
                let settled = lease.settle.map(|s| (s.random, reply.is_some()));
                effects.leases.push(LeaseEnd { name: call.name.clone(), grant, settled });
            }
            call.state = CallState::Done(result);
        }
        (self.progress(ctx), effects)
    }
}

impl PendingRequest {
    /// Its sends still unanswered: calls on their way when the request stops waiting (late replies).
    pub fn unanswered(&self) -> usize {
        self.sends.iter().filter(|send| !send.done).count()
    }

    /// A reply for send `send` that came after the request stopped waiting for it (its deadline passed,
    /// its client left, or another rule decided it): the members its limiters took, to give back at once
    /// (all of each, [`crate::script::GIVE_BACK`]); none when the call failed, took nothing, was not run
    /// (`NOSCRIPT`) or was answered already. What it teaches the cache (a config, a block) stands: it is
    /// Redis's. A lease it granted is not served: the lease's member leaves with the window.
    pub fn late_give_back(
        &mut self,
        send: usize,
        reply: Result<&[u8], Failure>,
        ctx: &Context<'_>,
        cache: &mut LimiterCache,
    ) -> Vec<GiveBack> {
        let Some(covered) = self.sends.get(send).filter(|s| !s.done).map(|s| s.calls.clone()) else {
            return Vec::new();
        };
        let _ = self.on_reply(send, reply, ctx, cache);
        if let Some(entry) = self.sends.get_mut(send) {
            entry.done = true;
        }
        covered
            .iter()
            .filter_map(|&index| self.calls.get(index))
            .filter_map(|call| own_member(call).map(|(granted, at)| member_give_back(call, granted, at)))
            .collect()
    }
}

/// Something worth one log line, found while deciding (not per request: the caller logs each once).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Notice {
    /// Redis holds another config for this limiter than the rule (Redis wins).
    ConfigDiffers {
        /// The rule.
        rule: String,
        /// The limiter name.
        limiter: String,
        /// What Redis holds.
        effective: EffectiveConfig,
    },
    /// The rule's config replaced another one in Redis (`rate_source: config`), keeping consumed permits.
    ConfigApplied {
        /// The rule.
        rule: String,
        /// The limiter name.
        limiter: String,
        /// What Redis holds now.
        effective: EffectiveConfig,
    },
    /// `rate_source: config`, but someone else (an operator, a Java service) changed the limiter's config
    /// after the rule wrote it: their config stands.
    ConfigKept {
        /// The rule.
        rule: String,
        /// The limiter name.
        limiter: String,
        /// What Redis holds.
        effective: EffectiveConfig,
    },
    /// The rule's permits per request exceed the limiter's rate in Redis: such requests are always rejected.
    ExceedsRate {
        /// The rule.
        rule: String,
        /// The limiter name.
        limiter: String,
    },
}

impl fmt::Display for Notice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Notice::ConfigDiffers { rule, limiter, effective } => write!(
                f,
                "rule {rule}: limiter {limiter} exists in Redis with rate {} per {} ms ({}), which differs from the configuration; obeying Redis",
                effective.rate,
                effective.interval_ms,
                effective.limiter_type.name()
            ),
            Notice::ConfigApplied { rule, limiter, effective } => write!(
                f,
                "rule {rule}: limiter {limiter} held another config in Redis; applied rate {} per {} ms ({}) keeping consumed permits (rate_source: config)",
                effective.rate,
                effective.interval_ms,
                effective.limiter_type.name()
            ),
            Notice::ConfigKept { rule, limiter, effective } => write!(
                f,
                "rule {rule}: limiter {limiter} holds rate {} per {} ms ({}), set by someone else after the rule wrote its own; keeping it (rate_source: config changes only a config the rule wrote)",
                effective.rate,
                effective.interval_ms,
                effective.limiter_type.name()
            ),
            Notice::ExceedsRate { rule, limiter } => write!(
                f,
                "rule {rule}: requests take more permits than limiter {limiter} allows per interval in Redis; they are rejected"
            ),
        }
    }
}

/// What a reply whose limiter config is `held` in Redis (not the rule's `configured` one, or just written)
/// is worth logging: news to this VM's cache, or a change this acquire made.
fn notice(
    call: &RuleCall,
    rule: &Rule,
    reply: &AcquireReply,
    held: EffectiveConfig,
    configured: EffectiveConfig,
    cache: &mut LimiterCache,
) -> Option<Notice> {
    // Only replies whose config is not the rule's carry one: the cache says whether it is news.
    let noticed = matches!(cache.observe(&call.name, held), Observation::New | Observation::Changed(_));
    let (rule, limiter, effective) = (rule.name.clone(), call.name.clone(), held);
    match reply.change {
        ConfigChange::Updated => Some(Notice::ConfigApplied { rule, limiter, effective }),
        _ if !noticed || held == configured => None,
        ConfigChange::Kept => Some(Notice::ConfigKept { rule, limiter, effective }),
        _ if reply.outcome == AcquireOutcome::ExceedsRate => Some(Notice::ExceedsRate { rule, limiter }),
        _ => Some(Notice::ConfigDiffers { rule, limiter, effective }),
    }
}

/// A calendar quota's period of a call made at `sent_ms` (its window, whole again at its end) and the ms
/// until its quota is whole again; any other rule's window: `effective`'s interval.
fn calendar_window(
    rule: &Rule,
    sent_ms: u64,
    now_ms: u64,
    effective: &mut EffectiveConfig,
) -> (Option<(u64, u64)>, u64) {
    let WindowLayout::Calendar { period, zone } = rule.layout else { return (None, effective.interval_ms) };
    let (start_ms, end_ms) = zone.period(period, sent_ms);
    effective.interval_ms = end_ms.saturating_sub(start_ms);
    (Some((start_ms, end_ms)), end_ms.saturating_sub(now_ms))
}

/// Where a counter's permits are ([`Taken::Member`]): a sliding window counter's slice width (the acquire's
/// time is its slice), or a calendar period's field (width 1, its start); `(None, None)` for a sliding log.
fn counter_slot(rule: &Rule, period: Option<(u64, u64)>) -> (Option<u64>, Option<u64>) {
    match (rule.layout, period) {
        (WindowLayout::SlidingWindowCounter, _) => {
            (Some((rule.interval_ms / crate::config::COUNTER_SLICES).max(1)), None)
        }
        (WindowLayout::Calendar { .. }, Some((start_ms, _))) => (Some(1), Some(start_ms)),
        _ => (None, None),
    }
}

/// One rule's result from its part of a reply, and the lease Redis granted it; the notice and block it
/// teaches go to `effects`.
fn call_result(
    call: &RuleCall,
    rule: &Rule,
    reply: &AcquireReply,
    now_ms: u64,
    cache: &mut LimiterCache,
    effects: &mut Effects,
) -> (RuleResult, Option<LeaseGrant>) {
    let configured =
        EffectiveConfig { rate: rule.rate, interval_ms: rule.interval_ms, limiter_type: rule.limiter_type };
    let mut effective = reply.effective.unwrap_or(configured);
    let (period, whole_again_ms) = calendar_window(rule, call.sent_ms, now_ms, &mut effective);
    // A calendar quota's reply carries its period's length, not a config Redis holds: nothing to notice.
    if let Some(held) = reply.effective.filter(|_| period.is_none()) {
        effects.notices.extend(notice(call, rule, reply, held, configured, cache));
    }
    let quota = |remaining, reset_ms| RuleQuota {
        rule: call.rule,
        limit: effective.rate,
        window_ms: effective.interval_ms,
        remaining,
        reset_ms,
    };
    let result = match reply.outcome {
        // The quota is whole again when every permit now in the window has left it.
        AcquireOutcome::Acquired { remaining } => {
            let granted = reply.granted.unwrap_or(call.permits);
            match call.lease {
                Some(lease) if granted > rule.permits => {
                    let expires_ms = call.sent_ms.saturating_add(lease.max_age_ms);
                    let grant = LeaseGrant {
                        random: call.member_random,
                        granted,
                        used: rule.permits,
                        outstanding: rule.permits,
                        expires_ms,
                        last_use_ms: now_ms.min(expires_ms),
                        redis_remaining: remaining,
                    };
                    let left = remaining.saturating_add(granted - rule.permits);
                    let taken = Taken::Lease { random: call.member_random };
                    return (RuleResult::Acquired(quota(left, whole_again_ms), taken), Some(grant));
                }
                _ => {
                    let (counter_slice_ms, period_start_ms) = counter_slot(rule, period);
                    let limiter_type = effective.limiter_type;
                    let taken = Taken::Member { granted, limiter_type, counter_slice_ms, period_start_ms };
                    RuleResult::Acquired(quota(remaining, whole_again_ms), taken)
                }
            }
        }
        AcquireOutcome::Untaken { available } => RuleResult::Untaken(quota(available, whole_again_ms)),
        AcquireOutcome::Rejected { delay_ms } => {
            // The oldest permit leaves 3 ms before Redisson's delay ends (DESIGN.md, tryAcquire).
            let leaves = call.sent_ms.saturating_add(delay_ms).saturating_sub(3);
            let until_ms = leaves.min(call.sent_ms.saturating_add(rule.local_block_max_ms));
            if rule.local_block_max_ms > 0 && until_ms > call.sent_ms {
                // Without the count, the rejected request's own need bounds it: fewer than `permits` are
                // free, so a request for `permits` or more is what Redis would reject.
                let block = Block {
                    until_ms,
                    release_ms: leaves,
                    available: reply.available.unwrap_or(call.permits.saturating_sub(1)),
                    rate: effective.rate,
                    interval_ms: effective.interval_ms,
                };
                effects.blocks.push((call.name.clone(), block));
            }
            RuleResult::Rejected { quota: quota(0, delay_ms), delay_ms: Some(delay_ms), local: false }
        }
        // No wait grants it: report a whole window rather than "retry now" (t=0).
        AcquireOutcome::ExceedsRate => {
            RuleResult::Rejected { quota: quota(0, effective.interval_ms), delay_ms: None, local: false }
        }
    };
    (result, None)
}
