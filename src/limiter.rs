//! One request's way through the limiters: which rules apply, the acquire command of each, what every
//! reply means, and the final [`Decision`]. Pure: time, randomness and the client id are passed in, the
//! transport is the caller's, so every path (acquired, rejected, NOSCRIPT retry, failures) is unit-tested.
//!
//! Flow: [`start`] reads the key values and returns either a decision at once (no rule applies, a missing
//! key is denied, a request exceeds a cached rate) or a [`PendingRequest`] with one command per rule. The
//! caller sends them, feeds each outcome to [`PendingRequest::on_reply`] and acts on the [`Progress`]:
//! send again (after `NOSCRIPT`), keep waiting, or apply the decision.

use std::fmt;

use crate::cache::{LimiterCache, Observation};
use crate::config::{ClockSource, FailureMode, OnMissing, PluginConfig, RateSource, Rule};
use crate::key::{extract, limiter_name, KeyValue, LimiterKeys, RequestView};
use crate::resp::{decode_reply, Command};
use crate::response::{rate_limit_headers, retry_after, Quota};
use crate::script::{
    decode_acquire_reply, Acquire, AcquireOutcome, Clock, ConfigChange, EffectiveConfig, Invocation, ReplyError,
    MEMBER_RANDOM_LEN,
};
use crate::transport::Failure;

/// How a request leaves the filter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Continue upstream, adding these headers to the upstream's response.
    Continue {
        /// Headers for the response (rate limit headers).
        response_headers: Vec<(String, String)>,
    },
    /// Answer locally.
    Respond {
        /// HTTP status.
        status: u16,
        /// Response headers.
        headers: Vec<(String, String)>,
        /// Response body.
        body: String,
    },
}

/// What happened, for metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// No rule applied to the request.
    Unlimited,
    /// Every rule that applied allowed it.
    Allowed,
    /// A limiter rejected it (or a missing key was denied, or it asked for more than a rate).
    Rejected,
    /// A rule could not be decided and the failure mode let the request through.
    FailedOpen,
    /// A rule could not be decided and the failure mode answered it.
    FailedClosed,
}

/// The final decision on a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    /// What to do with the request.
    pub verdict: Verdict,
    /// What happened, for metrics.
    pub outcome: Outcome,
    /// Every Redis call of the request that failed, whatever the decision (a request rejected by one rule
    /// can still carry another rule's failure), for `redis_errors` and the failure log.
    pub failures: Vec<Failure>,
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
                "rule {rule}: limiter {limiter} exists in Redis with rate {} per {} ms ({:?}), which differs from the configuration; obeying Redis",
                effective.rate, effective.interval_ms, effective.limiter_type
            ),
            Notice::ConfigApplied { rule, limiter, effective } => write!(
                f,
                "rule {rule}: limiter {limiter} held another config in Redis; applied rate {} per {} ms ({:?}) keeping consumed permits (rate_source: config)",
                effective.rate, effective.interval_ms, effective.limiter_type
            ),
            Notice::ConfigKept { rule, limiter, effective } => write!(
                f,
                "rule {rule}: limiter {limiter} holds rate {} per {} ms ({:?}), set by someone else after the rule wrote its own; keeping it (rate_source: config changes only a config the rule wrote)",
                effective.rate, effective.interval_ms, effective.limiter_type
            ),
            Notice::ExceedsRate { rule, limiter } => write!(
                f,
                "rule {rule}: requests take more permits than limiter {limiter} allows per interval in Redis; they are rejected"
            ),
        }
    }
}

/// The inputs of a decision that are not the request: time, randomness, identity, configuration.
pub struct Context<'a> {
    /// The validated plugin configuration.
    pub config: &'a PluginConfig,
    /// Now, ms since the Unix epoch.
    pub now_ms: u64,
    /// This gateway process's Redisson client id (a UUID string), for per_client limiters.
    pub client_id: &'a str,
}

/// How one rule ended.
#[derive(Debug, Clone, PartialEq, Eq)]
enum RuleResult {
    Acquired(Quota),
    /// Rejected by the limiter; `delay_ms` is `None` when no wait can help (more permits than the rate).
    Rejected {
        quota: Quota,
        delay_ms: Option<u64>,
    },
    /// Rejected without asking Redis (no key value and `on_missing: deny`).
    Denied,
    Failed(Failure),
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum CallState {
    /// Waiting for the reply to the command sent by sha (`retried` = false) or by source (true).
    Waiting {
        retried: bool,
    },
    Done(RuleResult),
}

/// One rule's acquire within a request.
#[derive(Debug, Clone, PartialEq, Eq)]
struct RuleCall {
    rule: usize,
    acquire: Acquire,
    state: CallState,
}

/// A request waiting for its acquire replies.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PendingRequest {
    calls: Vec<RuleCall>,
    /// Results decided without Redis (missing keys denied).
    settled: Vec<RuleResult>,
}

/// The first step of a request.
#[derive(Debug)]
pub enum Start {
    /// Decided without Redis.
    Decided(Decision),
    /// Send each command (by call index) and report its reply to the pending request.
    Send(PendingRequest, Vec<(usize, Command)>),
}

/// The step after a reply.
#[derive(Debug)]
pub enum Progress {
    /// Send this command for this call index (the script by source after `NOSCRIPT`).
    Resend(usize, Command),
    /// Other calls are still outstanding.
    Waiting,
    /// Every call is done.
    Done(Decision),
}

/// Starts deciding a request: reads each rule's key value and prepares its acquire.
///
/// `random` gives the random bytes of each new permit member (they must differ between acquires: two
/// equal members in one window would count as one).
pub fn start(
    ctx: &Context<'_>,
    request: &impl RequestView,
    random: &mut dyn FnMut() -> [u8; MEMBER_RANDOM_LEN],
) -> Start {
    let mut calls = Vec::new();
    let mut settled = Vec::new();
    for (index, rule) in ctx.config.rules.iter().enumerate() {
        let value = match (extract(&rule.source, request), rule.on_missing) {
            (KeyValue::Missing, OnMissing::Skip) => continue,
            (KeyValue::Missing, OnMissing::Deny) => {
                settled.push(RuleResult::Denied);
                continue;
            }
            (KeyValue::Missing, OnMissing::Share) => KeyValue::Value(Vec::new()),
            (value, _) => value,
        };
        let Some(name) = limiter_name(&rule.limiter, &value) else {
            continue;
        };
        calls.push(RuleCall {
            rule: index,
            acquire: acquire_for(rule, &name, ctx, random()),
            state: CallState::Waiting { retried: false },
        });
    }
    let pending = PendingRequest { calls, settled };
    if pending.calls.is_empty() || pending.settled.contains(&RuleResult::Denied) {
        // Nothing to ask Redis, or the answer is already no: deny before spending a round trip.
        return Start::Decided(pending.decide(ctx.config));
    }
    let commands =
        pending.calls.iter().enumerate().map(|(i, call)| (i, call.acquire.command(Invocation::BySha))).collect();
    Start::Send(pending, commands)
}

fn acquire_for(rule: &Rule, name: &str, ctx: &Context<'_>, member_random: [u8; MEMBER_RANDOM_LEN]) -> Acquire {
    Acquire {
        keys: LimiterKeys::new(name, ctx.client_id),
        permits: rule.permits,
        clock: match ctx.config.clock {
            ClockSource::Gateway => Clock::Gateway(ctx.now_ms),
            ClockSource::Redis => Clock::Redis,
        },
        member_random,
        rate: rule.rate,
        interval_ms: rule.interval_ms,
        limiter_type: rule.limiter_type,
        keep_alive_ms: rule.keep_alive_ms,
        apply_config: rule.rate_source == RateSource::Config,
    }
}

impl PendingRequest {
    /// Records the transport's outcome for call `call`: the raw RESP reply bytes, or a failure.
    ///
    /// Updates the cache with the limiter config in the reply and returns anything worth logging about it.
    /// A reply for an unknown or finished call is ignored ([`Progress::Waiting`] or the decision again).
    pub fn on_reply(
        &mut self,
        call: usize,
        reply: Result<&[u8], Failure>,
        config: &PluginConfig,
        cache: &mut LimiterCache,
    ) -> (Progress, Option<Notice>) {
        let Some(entry) = self.calls.get_mut(call) else {
            return (self.progress(config), None);
        };
        let CallState::Waiting { retried } = entry.state else {
            return (self.progress(config), None);
        };
        let Some(rule) = config.rules.get(entry.rule) else {
            return (self.progress(config), None);
        };
        let decoded = reply.and_then(|bytes| decode_reply(bytes).map_err(|e| Failure::BadReply(e.to_string())));
        let mut notice = None;
        let result = match decoded.map(|reply| decode_acquire_reply(&reply)) {
            Err(failure) => RuleResult::Failed(failure),
            Ok(Err(ReplyError::NoScript)) if !retried => {
                entry.state = CallState::Waiting { retried: true };
                return (Progress::Resend(call, entry.acquire.command(Invocation::BySource)), None);
            }
            Ok(Err(ReplyError::NoScript)) => RuleResult::Failed(Failure::RedisError("NOSCRIPT after EVAL".into())),
            Ok(Err(ReplyError::Redis(text))) => RuleResult::Failed(Failure::RedisError(text)),
            Ok(Err(ReplyError::Unexpected(what))) => RuleResult::Failed(Failure::BadReply(what)),
            Ok(Ok(reply)) => {
                let limiter = entry.acquire.keys.config.clone();
                let observation = cache.observe(&limiter, reply.effective);
                let configured = (rule.rate, rule.interval_ms, rule.limiter_type);
                let held = (reply.effective.rate, reply.effective.interval_ms, reply.effective.limiter_type);
                let noticed = matches!(observation, Observation::New | Observation::Changed(_));
                if reply.change == ConfigChange::Updated {
                    notice = Some(Notice::ConfigApplied {
                        rule: rule.name.clone(),
                        limiter: limiter.clone(),
                        effective: reply.effective,
                    });
                } else if noticed && configured != held && reply.change == ConfigChange::Kept {
                    notice = Some(Notice::ConfigKept {
                        rule: rule.name.clone(),
                        limiter: limiter.clone(),
                        effective: reply.effective,
                    });
                } else if noticed && configured != held {
                    notice = Some(Notice::ConfigDiffers {
                        rule: rule.name.clone(),
                        limiter: limiter.clone(),
                        effective: reply.effective,
                    });
                }
                let quota = |remaining, reset_ms| Quota {
                    policy: rule.name.clone(),
                    limit: reply.effective.rate,
                    window_ms: reply.effective.interval_ms,
                    remaining,
                    reset_ms,
                };
                match reply.outcome {
                    AcquireOutcome::Acquired { remaining } => RuleResult::Acquired(quota(remaining, reply.reset_ms)),
                    AcquireOutcome::Rejected { delay_ms } => {
                        RuleResult::Rejected { quota: quota(0, delay_ms), delay_ms: Some(delay_ms) }
                    }
                    AcquireOutcome::ExceedsRate => {
                        if noticed {
                            notice = Some(Notice::ExceedsRate { rule: rule.name.clone(), limiter });
                        }
                        // No wait grants it: report a whole window rather than "retry now" (t=0).
                        RuleResult::Rejected { quota: quota(0, reply.effective.interval_ms), delay_ms: None }
                    }
                }
            }
        };
        entry.state = CallState::Done(result);
        (self.progress(config), notice)
    }

    /// Ends every call still waiting with `failure` (the request's deadline passed, see
    /// [`Failure::TimedOut`]) and decides the request.
    pub fn expire(&mut self, failure: &Failure, config: &PluginConfig) -> Decision {
        for call in &mut self.calls {
            if matches!(call.state, CallState::Waiting { .. }) {
                call.state = CallState::Done(RuleResult::Failed(failure.clone()));
            }
        }
        self.decide(config)
    }

    fn progress(&self, config: &PluginConfig) -> Progress {
        if self.calls.iter().any(|c| matches!(c.state, CallState::Waiting { .. })) {
            Progress::Waiting
        } else {
            Progress::Done(self.decide(config))
        }
    }

    /// Combines the rule results: any rejection rejects; otherwise any failure follows the failure mode;
    /// otherwise the request is allowed.
    fn decide(&self, config: &PluginConfig) -> Decision {
        let results: Vec<&RuleResult> = self
            .settled
            .iter()
            .chain(self.calls.iter().filter_map(|c| match &c.state {
                CallState::Done(result) => Some(result),
                CallState::Waiting { .. } => None,
            }))
            .collect();
        let quotas: Vec<Quota> = results
            .iter()
            .filter_map(|r| match r {
                RuleResult::Acquired(quota) | RuleResult::Rejected { quota, .. } => Some(quota.clone()),
                _ => None,
            })
            .collect();
        let mut headers = rate_limit_headers(config.headers, &quotas);
        let delay = results.iter().filter_map(|r| match r {
            RuleResult::Rejected { delay_ms, .. } => *delay_ms,
            _ => None,
        });
        let denied = results.iter().any(|r| matches!(r, RuleResult::Denied));
        if let Some(delay_ms) = delay.max() {
            headers.insert(0, retry_after(delay_ms));
        }
        let failures: Vec<Failure> = results
            .iter()
            .filter_map(|r| match r {
                RuleResult::Failed(failure) => Some(failure.clone()),
                _ => None,
            })
            .collect();
        if denied || results.iter().any(|r| matches!(r, RuleResult::Rejected { .. })) {
            headers.push(("x-envoy-ratelimited".into(), "true".into()));
            return Decision {
                verdict: Verdict::Respond {
                    status: config.rejection.status,
                    headers,
                    body: config.rejection.body.clone(),
                },
                outcome: Outcome::Rejected,
                failures,
            };
        }
        if failures.is_empty() {
            let outcome = if results.is_empty() { Outcome::Unlimited } else { Outcome::Allowed };
            return Decision { verdict: Verdict::Continue { response_headers: headers }, outcome, failures };
        }
        match config.failure_mode {
            FailureMode::Allow => Decision {
                verdict: Verdict::Continue { response_headers: headers },
                outcome: Outcome::FailedOpen,
                failures,
            },
            FailureMode::Deny => Decision {
                verdict: Verdict::Respond {
                    status: config.failure_status,
                    headers: Vec::new(),
                    body: "rate limiter unavailable\n".into(),
                },
                outcome: Outcome::FailedClosed,
                failures,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing, clippy::panic)]
    use super::*;
    use crate::key::tests::FakeRequest;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn config(extra_rule: &str, top: &str) -> PluginConfig {
        let json = format!(
            r#"{{"redis":{{"cluster":"webdis"}},"rules":[{{"name":"per-user","limit_by":{{"header":"x-user"}},"rate":5,"interval":"2s"{extra_rule}}}]{top}}}"#
        );
        PluginConfig::from_json(json.as_bytes()).unwrap()
    }

    struct Harness {
        config: PluginConfig,
        cache: LimiterCache,
        counter: u8,
    }

    impl Harness {
        fn new(config: PluginConfig) -> Self {
            Harness { cache: LimiterCache::new(config.cache_size), config, counter: 0 }
        }

        fn start(&mut self, headers: &[(&str, &str)]) -> Start {
            let ctx = Context { config: &self.config, now_ms: 1_000_000, client_id: "cid" };
            let counter = &mut self.counter;
            start(&ctx, &FakeRequest::with(headers), &mut || {
                *counter += 1;
                [*counter; MEMBER_RANDOM_LEN]
            })
        }

        fn reply(&mut self, pending: &mut PendingRequest, call: usize, reply: Result<&[u8], Failure>) -> Progress {
            pending.on_reply(call, reply, &self.config, &mut self.cache).0
        }
    }

    fn script_reply(code: i64, amount: i64, reset: i64, rate: i64) -> Vec<u8> {
        let items = [code, amount, reset, rate, 2000, 0, 0];
        let mut out = format!("*{}\r\n", items.len()).into_bytes();
        for item in items {
            out.extend(format!(":{item}\r\n").bytes());
        }
        out
    }

    fn sent(start: Start) -> (PendingRequest, Vec<(usize, Command)>) {
        match start {
            Start::Send(pending, commands) => (pending, commands),
            Start::Decided(decision) => panic!("expected commands, got {decision:?}"),
        }
    }

    fn done(progress: Progress) -> Decision {
        match progress {
            Progress::Done(decision) => decision,
            other => panic!("expected a decision, got {other:?}"),
        }
    }

    fn header<'a>(headers: &'a [(String, String)], name: &str) -> Option<&'a str> {
        headers.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
    }

    #[test]
    fn an_acquired_permit_continues_with_rate_limit_headers() {
        let mut h = Harness::new(config("", ""));
        let (mut pending, commands) = sent(h.start(&[("x-user", "alice")]));
        assert_eq!(commands.len(), 1);
        assert_eq!(commands[0].1.args()[0], b"EVALSHA");
        assert_eq!(commands[0].1.args()[3], b"erl:per-user:alice");
        let decision = done(h.reply(&mut pending, 0, Ok(&script_reply(1, 4, 2000, 5))));
        assert_eq!(decision.outcome, Outcome::Allowed);
        let Verdict::Continue { response_headers } = decision.verdict else { panic!() };
        assert_eq!(header(&response_headers, "ratelimit"), Some("\"per-user\";r=4;t=2"));
        assert_eq!(header(&response_headers, "ratelimit-policy"), Some("\"per-user\";q=5;w=2"));
    }

    #[test]
    fn a_rejection_answers_with_status_retry_after_and_body() {
        let mut h = Harness::new(config("", ""));
        let (mut pending, _) = sent(h.start(&[("x-user", "alice")]));
        let decision = done(h.reply(&mut pending, 0, Ok(&script_reply(0, 1503, 1500, 5))));
        assert_eq!(decision.outcome, Outcome::Rejected);
        let Verdict::Respond { status, headers, body } = decision.verdict else { panic!() };
        assert_eq!(status, 429);
        assert_eq!(body, "rate limit exceeded\n");
        assert_eq!(header(&headers, "retry-after"), Some("2"));
        assert_eq!(header(&headers, "x-envoy-ratelimited"), Some("true"));
        assert_eq!(header(&headers, "ratelimit"), Some("\"per-user\";r=0;t=2"));
    }

    #[test]
    fn noscript_is_retried_once_by_source_then_fails() {
        let mut h = Harness::new(config("", ""));
        let (mut pending, _) = sent(h.start(&[("x-user", "alice")]));
        let noscript = b"-NOSCRIPT No matching script. Please use EVAL.\r\n";
        let Progress::Resend(0, command) = h.reply(&mut pending, 0, Ok(noscript)) else { panic!() };
        assert_eq!(command.args()[0], b"EVAL");
        let decision = done(h.reply(&mut pending, 0, Ok(noscript)));
        assert_eq!(decision.outcome, Outcome::FailedOpen);
    }

    #[test]
    fn failures_follow_the_failure_mode() {
        for (top, outcome, status) in [
            ("", Outcome::FailedOpen, None),
            (r#","failure_mode":"deny","failure_status":500"#, Outcome::FailedClosed, Some(500)),
        ] {
            let mut h = Harness::new(config("", top));
            for failure in [Failure::NoReply, Failure::BridgeStatus(503), Failure::SendRefused("BadArgument".into())] {
                let (mut pending, _) = sent(h.start(&[("x-user", "alice")]));
                let decision = done(h.reply(&mut pending, 0, Err(failure.clone())));
                assert_eq!(decision.outcome, outcome);
                assert_eq!(decision.failures, vec![failure]);
                match (decision.verdict, status) {
                    (Verdict::Continue { .. }, None) => {}
                    (Verdict::Respond { status: got, .. }, Some(want)) => assert_eq!(got, want),
                    (verdict, _) => panic!("{verdict:?}"),
                }
            }
            let (mut pending, _) = sent(h.start(&[("x-user", "alice")]));
            let decision = done(h.reply(&mut pending, 0, Ok(b"-NOAUTH Authentication required.\r\n")));
            assert_eq!(decision.failures, vec![Failure::RedisError("NOAUTH Authentication required.".into())]);
            let (mut pending, _) = sent(h.start(&[("x-user", "alice")]));
            let decision = done(h.reply(&mut pending, 0, Ok(b"<html>")));
            assert!(matches!(decision.failures[..], [Failure::BadReply(_)]));
        }
    }

    #[test]
    fn missing_keys_skip_deny_or_share() {
        let mut skip = Harness::new(config("", ""));
        let Start::Decided(decision) = skip.start(&[]) else { panic!() };
        assert_eq!(decision.outcome, Outcome::Unlimited);
        let mut deny = Harness::new(config(r#","on_missing":"deny""#, ""));
        let Start::Decided(decision) = deny.start(&[]) else { panic!() };
        assert_eq!(decision.outcome, Outcome::Rejected);
        assert!(matches!(decision.verdict, Verdict::Respond { status: 429, .. }));
        let mut share = Harness::new(config(r#","on_missing":"share""#, ""));
        let (_, commands) = sent(share.start(&[]));
        assert_eq!(commands[0].1.args()[3], b"erl:per-user:~");
    }

    #[test]
    fn more_permits_than_the_rate_are_rejected_without_retry_after_and_asked_again_next_time() {
        let mut h = Harness::new(config(r#","permits":3"#, ""));
        let (mut pending, _) = sent(h.start(&[("x-user", "alice")]));
        let (progress, notice) = pending.on_reply(0, Ok(&script_reply(2, 0, 700, 2)), &h.config, &mut h.cache);
        let decision = done(progress);
        assert_eq!(decision.outcome, Outcome::Rejected);
        let Verdict::Respond { headers, .. } = decision.verdict else { panic!() };
        assert_eq!(header(&headers, "retry-after"), None, "no wait can grant more permits than the rate");
        assert_eq!(header(&headers, "ratelimit-policy"), Some("\"per-user\";q=2;w=2"));
        assert_eq!(header(&headers, "ratelimit"), Some("\"per-user\";r=0;t=2"), "not t=0: retrying now is futile");
        assert!(matches!(notice, Some(Notice::ExceedsRate { .. })));
        // The rate may be raised in Redis at any moment: the next request asks Redis again.
        assert!(matches!(h.start(&[("x-user", "alice")]), Start::Send(..)));
    }

    #[test]
    fn a_different_rate_in_redis_is_noticed_once_per_limiter() {
        let mut h = Harness::new(config("", ""));
        let mut notices = Vec::new();
        for _ in 0..3 {
            let (mut pending, _) = sent(h.start(&[("x-user", "alice")]));
            notices.push(pending.on_reply(0, Ok(&script_reply(1, 0, 0, 1)), &h.config, &mut h.cache).1);
        }
        assert!(matches!(notices[0], Some(Notice::ConfigDiffers { .. })));
        assert_eq!(notices[1..], [None, None]);
        let (mut pending, _) = sent(h.start(&[("x-user", "bob")]));
        assert_eq!(pending.on_reply(0, Ok(&script_reply(1, 4, 0, 5)), &h.config, &mut h.cache).1, None);
    }

    #[test]
    fn with_the_config_winning_every_acquire_lets_redis_decide_and_changes_are_noticed() {
        let mut h = Harness::new(config(r#","rate_source":"config""#, ""));
        let (mut pending, commands) = sent(h.start(&[("x-user", "alice")]));
        assert_eq!(commands[0].1.args()[15], b"1", "the acquire asks Redis to apply the rule's config");
        let updated = b"*7\r\n:1\r\n:4\r\n:0\r\n:5\r\n:2000\r\n:0\r\n:2\r\n";
        let (_, notice) = pending.on_reply(0, Ok(updated), &h.config, &mut h.cache);
        assert!(matches!(notice, Some(Notice::ConfigApplied { .. })), "{notice:?}");
        let (mut pending, commands) = sent(h.start(&[("x-user", "alice")]));
        assert_eq!(commands[0].1.args()[15], b"1", "again: whether to apply is Redis's record, not a cache's");
        let kept = b"*7\r\n:1\r\n:4\r\n:0\r\n:9\r\n:2000\r\n:0\r\n:3\r\n";
        let (_, notice) = pending.on_reply(0, Ok(kept), &h.config, &mut h.cache);
        assert!(matches!(notice, Some(Notice::ConfigKept { .. })), "{notice:?}");
        let mut redis_wins = Harness::new(config("", ""));
        let (_, commands) = sent(redis_wins.start(&[("x-user", "alice")]));
        assert_eq!(commands[0].1.args()[15], b"0");
    }

    #[test]
    fn a_rejection_still_reports_the_failures_of_other_rules() {
        let json = r#"{"redis":{"cluster":"w"},"rules":[
            {"name":"a","limit_by":"global","rate":5,"interval":1000},
            {"name":"b","limit_by":"client_ip","rate":5,"interval":1000}]}"#;
        let mut h = Harness::new(PluginConfig::from_json(json.as_bytes()).unwrap());
        let (mut pending, _) = sent(h.start(&[]));
        assert!(matches!(h.reply(&mut pending, 0, Ok(&script_reply(0, 900, 900, 5))), Progress::Waiting));
        let decision = done(h.reply(&mut pending, 1, Err(Failure::NoReply)));
        assert_eq!(decision.outcome, Outcome::Rejected);
        assert_eq!(decision.failures, vec![Failure::NoReply], "the failure is counted and logged too");
    }

    #[test]
    fn an_expired_request_fails_its_waiting_calls_and_keeps_what_arrived() {
        let json = r#"{"redis":{"cluster":"w"},"failure_mode":"deny","rules":[
            {"name":"a","limit_by":"global","rate":5,"interval":1000},
            {"name":"b","limit_by":"client_ip","rate":5,"interval":1000}]}"#;
        let mut h = Harness::new(PluginConfig::from_json(json.as_bytes()).unwrap());
        let (mut pending, _) = sent(h.start(&[]));
        assert!(matches!(h.reply(&mut pending, 0, Ok(&script_reply(1, 4, 900, 5))), Progress::Waiting));
        let decision = pending.expire(&Failure::TimedOut, &h.config);
        assert_eq!(decision.outcome, Outcome::FailedClosed);
        assert_eq!(decision.failures, vec![Failure::TimedOut]);
    }

    #[test]
    fn several_rules_wait_for_every_reply_and_any_rejection_wins() {
        let json = r#"{"redis":{"cluster":"w"},"rules":[
            {"name":"a","limit_by":"global","rate":5,"interval":1000},
            {"name":"b","limit_by":"client_ip","rate":5,"interval":1000}]}"#;
        let mut h = Harness::new(PluginConfig::from_json(json.as_bytes()).unwrap());
        let (mut pending, commands) = sent(h.start(&[]));
        assert_eq!(commands.len(), 2);
        assert_ne!(commands[0].1.args()[10], commands[1].1.args()[10], "members get different random bytes");
        assert!(matches!(h.reply(&mut pending, 1, Ok(&script_reply(0, 900, 900, 5))), Progress::Waiting));
        assert!(
            matches!(h.reply(&mut pending, 1, Ok(&script_reply(1, 1, 1, 5))), Progress::Waiting),
            "a second reply for a call is ignored"
        );
        let decision = done(h.reply(&mut pending, 0, Err(Failure::NoReply)));
        assert_eq!(decision.outcome, Outcome::Rejected);
        let Verdict::Respond { headers, .. } = decision.verdict else { panic!() };
        assert_eq!(header(&headers, "retry-after"), Some("1"));
    }
}
