//! The limiter's paths, request by request: rules, replies, blocks, leases, shadow rules, failures.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing, clippy::panic)]
use super::*;
use crate::block::Block;
use crate::cache::LimiterCache;
use crate::config::{Mode, PluginConfig};
use crate::key::tests::FakeRequest;
use crate::lease::LeaseTable;
use crate::response::Headers;
use crate::script::{Encoding, Invocation, MEMBER_RANDOM_LEN};
use crate::testing::{acquired, rejected};
use crate::transport::Failure;

const NOW: u64 = 1_000_000;

fn config(extra_rule: &str, top: &str) -> PluginConfig {
    let json = format!(
        r#"{{"redis":{{"cluster":"webdis"}},"rules":[{{"name":"per-user","limit_by":{{"header":"x-user"}},"rate":5,"interval":"2s"{extra_rule}}}]{top}}}"#
    );
    PluginConfig::from_json(json.as_bytes()).unwrap()
}

/// Blocks kept in a list, as the shared data slots would hold them.
#[derive(Default)]
struct ListedBlocks(Vec<(String, Block)>);

impl Blocks for ListedBlocks {
    fn rejecting(&self, name: &str, now_ms: u64, permits: u64, _settles: bool) -> Option<Block> {
        self.0.iter().find(|(n, b)| n == name && now_ms < b.until_ms).map(|(_, b)| *b).filter(|b| permits > b.available)
    }
}

struct Harness {
    config: PluginConfig,
    plan: Plan,
    cache: core::cell::RefCell<LimiterCache>,
    blocks: ListedBlocks,
    leases: LeaseTable,
    counter: u8,
    now_ms: u64,
}

impl Harness {
    fn new(config: PluginConfig) -> Self {
        Harness {
            cache: core::cell::RefCell::new(LimiterCache::new(config.cache_size, [3, 4])),
            plan: Plan::new(&config, "cid"),
            config,
            blocks: ListedBlocks::default(),
            leases: LeaseTable::default(),
            counter: 0,
            now_ms: NOW,
        }
    }

    fn start(&mut self, headers: &[(&str, &str)]) -> Start {
        let ctx = Context {
            config: &self.config,
            plan: &self.plan,
            now_ms: self.now_ms,
            blocks: &self.blocks,
            leases: &self.leases,
            local: None,
            skip_redis: false,
        };
        let counter = &mut self.counter;
        let mut name = String::new();
        start(
            &ctx,
            &FakeRequest::with(headers),
            &mut || {
                *counter += 1;
                [*counter; MEMBER_RANDOM_LEN]
            },
            &mut name,
        )
    }

    /// The context of a decision now (no local windows).
    fn context(&self) -> Context<'_> {
        Context {
            config: &self.config,
            plan: &self.plan,
            now_ms: self.now_ms,
            blocks: &self.blocks,
            leases: &self.leases,
            local: None,
            skip_redis: false,
        }
    }

    /// The response headers of a decision, rendered.
    fn headers(&self, decision: &Decision) -> Headers {
        decision.verdict.headers(&self.plan.headers)
    }

    /// The command of a call as its arguments (webdis form decoded back into words).
    fn words(&self, pending: &PendingRequest, call: usize, invocation: Invocation) -> Vec<String> {
        let body = pending.encode(call, invocation, Encoding::WebdisPath, &self.plan).unwrap();
        let text = String::from_utf8(body).unwrap();
        text.trim_end_matches(".raw")
            .split('/')
            .map(|word| percent_encoding::percent_decode_str(word).decode_utf8_lossy().into_owned())
            .collect()
    }

    /// A reply as it comes, and what it teaches (nothing recorded).
    fn raw(&mut self, pending: &mut PendingRequest, call: usize, reply: Result<&[u8], Failure>) -> (Progress, Effects) {
        let ctx = self.context();
        pending.on_reply(call, reply, &ctx, &mut self.cache.borrow_mut())
    }

    fn reply(&mut self, pending: &mut PendingRequest, call: usize, reply: Result<&[u8], Failure>) -> Progress {
        self.reply_with_effects(pending, call, reply).0
    }

    /// A reply, with its blocks and leases recorded; also what it teaches.
    fn reply_with_effects(
        &mut self,
        pending: &mut PendingRequest,
        call: usize,
        reply: Result<&[u8], Failure>,
    ) -> (Progress, Effects) {
        let ctx = self.context();
        let (progress, effects) = pending.on_reply(call, reply, &ctx, &mut self.cache.borrow_mut());
        self.blocks.0.extend(effects.blocks.iter().cloned());
        for LeaseEnd { name, grant, settled } in &effects.leases {
            self.leases.end(name, *grant, *settled);
        }
        (progress, effects)
    }
}

/// `{code, amount, available, rate, interval, type, change, taken}` (the full reply).
fn full_reply(code: i64, amount: i64, available: i64, rate: i64, change: i64) -> Vec<u8> {
    let items = [code, amount, available, rate, 2000, 0, change, i64::from(code == 1)];
    let mut out = format!("*{}\r\n", items.len()).into_bytes();
    for item in items {
        out.extend(format!(":{item}\r\n").bytes());
    }
    out
}

fn sent(start: Start) -> PendingRequest {
    match start {
        Start::Send(pending, _) => pending,
        Start::Decided(decision) => panic!("expected commands, got {decision:?}"),
    }
}

fn decided(start: Start) -> Decision {
    match start {
        Start::Decided(decision) => decision,
        Start::Send(..) => panic!("expected a decision without Redis"),
    }
}

fn done(progress: Progress) -> Decision {
    match progress {
        Progress::Done(decision) => decision,
        other => panic!("expected a decision, got {other:?}"),
    }
}

fn header<'a>(headers: &'a Headers, name: &str) -> Option<&'a str> {
    headers.iter().find(|(k, _)| *k == name).map(|(_, v)| &**v)
}

#[test]
fn an_acquired_permit_continues_with_rate_limit_headers() {
    let mut h = Harness::new(config("", ""));
    let mut pending = sent(h.start(&[("x-user", "alice")]));
    let words = h.words(&pending, 0, Invocation::BySha);
    assert_eq!(words[0], "EVALSHA");
    assert_eq!(words[3], "erl:per-user:alice");
    let decision = done(h.reply(&mut pending, 0, Ok(&acquired(4))));
    assert_eq!(decision.outcome, Outcome::Allowed);
    let response_headers = h.headers(&decision);
    assert!(matches!(decision.verdict, Verdict::Continue { .. }));
    assert_eq!(header(&response_headers, "ratelimit"), Some("\"per-user\";r=4;t=2"), "t: the window length");
    assert_eq!(header(&response_headers, "ratelimit-policy"), Some("\"per-user\";q=5;w=2"));
}

#[test]
fn a_rejection_answers_with_status_retry_after_and_body_and_leaves_a_block() {
    let mut h = Harness::new(config("", ""));
    let mut pending = sent(h.start(&[("x-user", "alice")]));
    let decision = done(h.reply(&mut pending, 0, Ok(&rejected(1503))));
    assert_eq!(decision.outcome, Outcome::Rejected);
    let headers = h.headers(&decision);
    let Verdict::Respond { status, body, .. } = decision.verdict else { panic!() };
    assert_eq!(status, 429);
    assert_eq!(&*body, "rate limit exceeded\n");
    assert_eq!(header(&headers, "retry-after"), Some("2"));
    assert_eq!(header(&headers, "x-envoy-ratelimited"), Some("true"));
    assert_eq!(header(&headers, "ratelimit"), Some("\"per-user\";r=0;t=2"));
    let block = Block { until_ms: NOW + 1500, release_ms: NOW + 1500, available: 0, rate: 5, interval_ms: 2000 };
    assert_eq!(h.blocks.0, vec![("erl:per-user:alice".to_string(), block)], "until the oldest permit leaves");
    let mut h = Harness::new(config(r#","permits":3"#, ""));
    let mut pending = sent(h.start(&[("x-user", "alice")]));
    done(h.reply(&mut pending, 0, Ok(&full_reply(0, 1503, 1, 5, 0))));
    assert_eq!(h.blocks.0[0].1.available, 1, "the full reply says how many are free");
}

#[test]
fn a_blocked_limiter_rejects_what_redis_would_reject_and_nothing_else() {
    let mut h = Harness::new(config(r#","permits":2"#, ""));
    let mut pending = sent(h.start(&[("x-user", "alice")]));
    done(h.reply(&mut pending, 0, Ok(&rejected(1503))));
    h.now_ms = NOW + 1000;
    let decision = decided(h.start(&[("x-user", "alice")]));
    assert_eq!(decision.outcome, Outcome::LocallyRejected, "2 permits needed, 1 available: no Redis call");
    let headers = h.headers(&decision);
    let Verdict::Respond { status, .. } = decision.verdict else { panic!() };
    assert_eq!(status, 429);
    assert_eq!(header(&headers, "retry-after"), Some("1"), "503 ms: from the remaining time");
    assert_eq!(header(&headers, "ratelimit"), Some("\"per-user\";r=0;t=1"));
    assert_eq!(header(&headers, "ratelimit-policy"), Some("\"per-user\";q=5;w=2"));
    assert!(matches!(h.start(&[("x-user", "bob")]), Start::Send(..)), "another limiter goes to Redis");
    h.now_ms = NOW + 1500;
    assert!(matches!(h.start(&[("x-user", "alice")]), Start::Send(..)), "the oldest permit left: Redis again");

    let mut smaller = Harness::new(config(r#","permits":1"#, ""));
    smaller.blocks.0.push((
        "erl:per-user:alice".into(),
        Block { until_ms: NOW + 900, release_ms: NOW + 900, available: 1, rate: 5, interval_ms: 2000 },
    ));
    assert!(matches!(smaller.start(&[("x-user", "alice")]), Start::Send(..)), "1 permit wanted, 1 available");
}

#[test]
fn a_block_lasts_at_most_local_block_max_and_zero_turns_it_off() {
    let mut h = Harness::new(config(r#","local_block_max":"1s""#, ""));
    let mut pending = sent(h.start(&[("x-user", "alice")]));
    done(h.reply(&mut pending, 0, Ok(&rejected(1503))));
    assert_eq!(h.blocks.0[0].1.until_ms, NOW + 1000);
    h.now_ms = NOW + 400;
    let decision = decided(h.start(&[("x-user", "alice")]));
    assert!(matches!(decision.verdict, Verdict::Respond { .. }));
    let headers = h.headers(&decision);
    assert_eq!(header(&headers, "retry-after"), Some("2"), "Redis's delay (1103 ms), not the block's end");
    let mut off = Harness::new(config(r#","local_block_max":0"#, ""));
    let mut pending = sent(off.start(&[("x-user", "alice")]));
    done(off.reply(&mut pending, 0, Ok(&rejected(1503))));
    assert!(off.blocks.0.is_empty());
    off.blocks.0.push((
        "erl:per-user:alice".into(),
        Block { until_ms: NOW + 900, release_ms: NOW + 900, available: 0, rate: 5, interval_ms: 2000 },
    ));
    assert!(matches!(off.start(&[("x-user", "alice")]), Start::Send(..)), "no lookup either");
}

#[test]
fn noscript_is_retried_once_by_source_then_fails() {
    let mut h = Harness::new(config("", ""));
    let mut pending = sent(h.start(&[("x-user", "alice")]));
    let noscript = b"-NOSCRIPT No matching script. Please use EVAL.\r\n";
    let Progress::Resend(0) = h.reply(&mut pending, 0, Ok(noscript)) else { panic!() };
    assert_eq!(h.words(&pending, 0, Invocation::BySource)[0], "EVAL");
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
            let mut pending = sent(h.start(&[("x-user", "alice")]));
            let (progress, effects) = h.reply_with_effects(&mut pending, 0, Err(failure.clone()));
            let decision = done(progress);
            assert_eq!(decision.outcome, outcome);
            assert!(decision.redis_failed);
            assert_eq!(effects.call_failure, Some(failure));
            match (decision.verdict, status) {
                (Verdict::Continue { .. }, None) => {}
                (Verdict::Respond { status: got, .. }, Some(want)) => assert_eq!(got, want),
                (verdict, _) => panic!("{verdict:?}"),
            }
        }
        let mut pending = sent(h.start(&[("x-user", "alice")]));
        let (_, effects) = h.reply_with_effects(&mut pending, 0, Ok(b"-NOAUTH Authentication required.\r\n"));
        assert_eq!(effects.call_failure, Some(Failure::RedisError("NOAUTH Authentication required.".into())));
        let mut pending = sent(h.start(&[("x-user", "alice")]));
        let (_, effects) = h.reply_with_effects(&mut pending, 0, Ok(b"<html>"));
        assert!(matches!(effects.call_failure, Some(Failure::BadReply(_))));
    }
}

#[test]
fn missing_keys_skip_deny_or_share() {
    let mut skip = Harness::new(config("", ""));
    assert_eq!(decided(skip.start(&[])).outcome, Outcome::Unlimited);
    let mut deny = Harness::new(config(r#","on_missing":"deny""#, ""));
    let decision = decided(deny.start(&[]));
    assert_eq!(decision.outcome, Outcome::Rejected);
    assert!(matches!(decision.verdict, Verdict::Respond { status: 429, .. }));
    let mut share = Harness::new(config(r#","on_missing":"share""#, ""));
    let pending = sent(share.start(&[]));
    assert_eq!(share.words(&pending, 0, Invocation::BySha)[3], "erl:per-user:~");
}

#[test]
fn more_permits_than_the_rate_are_rejected_without_retry_after_and_asked_again_next_time() {
    let mut h = Harness::new(config(r#","permits":3"#, ""));
    let mut pending = sent(h.start(&[("x-user", "alice")]));
    let (progress, effects) = h.raw(&mut pending, 0, Ok(&full_reply(2, 0, 0, 2, 0)));
    let decision = done(progress);
    assert_eq!(decision.outcome, Outcome::Rejected);
    assert!(matches!(decision.verdict, Verdict::Respond { .. }));
    let headers = h.headers(&decision);
    assert_eq!(header(&headers, "retry-after"), None, "no wait can grant more permits than the rate");
    assert_eq!(header(&headers, "ratelimit-policy"), Some("\"per-user\";q=2;w=2"));
    assert_eq!(header(&headers, "ratelimit"), Some("\"per-user\";r=0;t=2"), "not t=0: retrying now is futile");
    assert!(matches!(effects.notices.first(), Some(Notice::ExceedsRate { .. })));
    assert_eq!(effects.blocks.first(), None, "no block: a rate raised in Redis must be seen at once");
    assert!(matches!(h.start(&[("x-user", "alice")]), Start::Send(..)));
}

#[test]
fn a_different_rate_in_redis_is_noticed_once_per_limiter() {
    let mut h = Harness::new(config("", ""));
    let mut notices = Vec::new();
    for _ in 0..3 {
        let mut pending = sent(h.start(&[("x-user", "alice")]));
        notices.push(h.raw(&mut pending, 0, Ok(&full_reply(1, 0, 0, 1, 0))).1.notices.first().cloned());
    }
    assert!(matches!(notices[0], Some(Notice::ConfigDiffers { .. })));
    assert_eq!(notices[1..], [None, None]);
    let mut pending = sent(h.start(&[("x-user", "bob")]));
    assert_eq!(h.raw(&mut pending, 0, Ok(&acquired(4))).1.notices.first().cloned(), None);
}

#[test]
fn with_the_config_winning_every_acquire_lets_redis_decide_and_changes_are_noticed() {
    let mut h = Harness::new(config(r#","rate_source":"config""#, ""));
    let mut pending = sent(h.start(&[("x-user", "alice")]));
    assert_eq!(h.words(&pending, 0, Invocation::BySha)[15], "1", "the acquire asks Redis to apply the rule's config");
    let (_, effects) = h.raw(&mut pending, 0, Ok(&full_reply(1, 4, 4, 5, 2)));
    assert!(matches!(effects.notices.first(), Some(Notice::ConfigApplied { .. })), "{effects:?}");
    let mut pending = sent(h.start(&[("x-user", "alice")]));
    assert_eq!(h.words(&pending, 0, Invocation::BySha)[15], "1", "again: whether to apply is Redis's record");
    let (_, effects) = h.raw(&mut pending, 0, Ok(&full_reply(1, 4, 4, 9, 3)));
    assert!(matches!(effects.notices.first(), Some(Notice::ConfigKept { .. })), "{effects:?}");
    let mut redis_wins = Harness::new(config("", ""));
    let pending = sent(redis_wins.start(&[("x-user", "alice")]));
    assert_eq!(redis_wins.words(&pending, 0, Invocation::BySha)[15], "0");
}

/// Two rules whose limiters are in different hash slots of a Redis Cluster: one call each.
fn two_rules(top: &str) -> PluginConfig {
    let json = format!(
        r#"{{"redis":{{"cluster":"w","redis_cluster":true}},"rules":[
        {{"name":"a","limit_by":"global","rate":5,"interval":1000}},
        {{"name":"b","limit_by":"client_ip","rate":5,"interval":1000}}]{top}}}"#
    );
    PluginConfig::from_json(json.as_bytes()).unwrap()
}

#[test]
fn several_rules_wait_for_every_reply_and_any_rejection_wins() {
    let mut h = Harness::new(two_rules(""));
    let mut pending = sent(h.start(&[]));
    assert_ne!(
        h.words(&pending, 0, Invocation::BySha)[9],
        h.words(&pending, 1, Invocation::BySha)[9],
        "members differ"
    );
    assert!(matches!(h.reply(&mut pending, 1, Ok(&rejected(900))), Progress::Waiting));
    assert!(matches!(h.reply(&mut pending, 1, Ok(&acquired(1))), Progress::Waiting), "a second reply is ignored");
    let decision = done(h.reply(&mut pending, 0, Err(Failure::NoReply)));
    assert_eq!(decision.outcome, Outcome::Rejected);
    assert!(matches!(decision.verdict, Verdict::Respond { .. }));
    let headers = h.headers(&decision);
    assert_eq!(header(&headers, "retry-after"), Some("1"));
}

#[test]
fn a_rejection_still_reports_the_failures_of_other_rules() {
    let mut h = Harness::new(two_rules(""));
    let mut pending = sent(h.start(&[]));
    assert!(matches!(h.reply(&mut pending, 0, Ok(&rejected(900))), Progress::Waiting));
    let (progress, effects) = h.reply_with_effects(&mut pending, 1, Err(Failure::NoReply));
    let decision = done(progress);
    assert_eq!(decision.outcome, Outcome::Rejected);
    assert!(decision.redis_failed && effects.failed(), "the failure is counted and logged too");
}

#[test]
fn an_expired_request_fails_its_waiting_calls_and_keeps_what_arrived() {
    let mut h = Harness::new(two_rules(r#","failure_mode":"deny""#));
    let mut pending = sent(h.start(&[]));
    assert!(matches!(h.reply(&mut pending, 0, Ok(&acquired(4))), Progress::Waiting));
    let (decision, unanswered) = pending.expire(&h.context());
    assert_eq!(decision.outcome, Outcome::FailedClosed);
    assert!(decision.redis_failed);
    assert_eq!(unanswered, 1, "the one call still waiting failed");
}

#[test]
fn a_blocked_rule_rejects_the_request_before_any_other_rule_spends_a_permit() {
    let mut h = Harness::new(two_rules(""));
    h.blocks.0.push((
        "erl:a".into(),
        Block { until_ms: NOW + 400, release_ms: NOW + 400, available: 0, rate: 5, interval_ms: 1000 },
    ));
    let decision = decided(h.start(&[]));
    assert_eq!(decision.outcome, Outcome::LocallyRejected);
    assert!(matches!(decision.verdict, Verdict::Respond { .. }));
    let headers = h.headers(&decision);
    assert_eq!(header(&headers, "ratelimit"), Some("\"a\";r=0;t=1"), "only the blocked rule is known");
}

/// A global rule with a lease of up to 8 permits for 1 s, and a per-user rule of rate 1.
fn leased_and_per_user(redis: &str) -> PluginConfig {
    let json = format!(
        r#"{{"redis":{{"cluster":"w"{redis}}},"rules":[
        {{"name":"hot","limit_by":"global","rate":100,"interval":60000,"lease":{{"max_permits":8,"max_age":"1s"}}}},
        {{"name":"per-user","limit_by":{{"header":"x-user"}},"rate":1,"interval":60000}}]}}"#
    );
    PluginConfig::from_json(json.as_bytes()).unwrap()
}

/// ACQUIRE_ALL's reply: 8 integers per limiter.
fn all_reply(limiters: &[[i64; 8]]) -> Vec<u8> {
    let mut out = format!("*{}\r\n", 8 * limiters.len()).into_bytes();
    for number in limiters.iter().flatten() {
        out.extend(format!(":{number}\r\n").bytes());
    }
    out
}

#[test]
fn one_call_for_every_rule_and_a_lease_serves_the_next_requests_until_another_rule_rejects() {
    let mut h = Harness::new(leased_and_per_user(""));
    let mut pending = sent(h.start(&[("x-user", "alice")]));
    let words = h.words(&pending, 0, Invocation::BySha);
    assert_eq!(words[0], "EVALSHA");
    assert_eq!(words[1], crate::script::ACQUIRE_ALL.sha(), "both rules in one call");
    assert_eq!(words[2], "10");
    assert_eq!(words[14], "0", "fail open: an error on one limiter's keys does not stop the other's charge");
    assert_eq!(words[16..18], ["1".to_string(), "100".to_string()], "the lease rule's permits and rate");
    assert_eq!(words[22], "8", "asks for a lease of up to 8");
    // Both admit: the lease took 8 (7 left for this VM), per-user 1.
    let reply = all_reply(&[[1, 92, 92, 100, 60_000, 0, 1, 8], [1, 0, 0, 1, 60_000, 0, 1, 1]]);
    let decision = done(h.reply(&mut pending, 0, Ok(&reply)));
    assert_eq!(decision.outcome, Outcome::Allowed);
    assert!(decision.give_back.is_empty());
    // Bob: the lease serves the hot rule, per-user alone goes to Redis (ACQUIRE), and rejects.
    let mut pending = sent(h.start(&[("x-user", "bob")]));
    assert_eq!(h.words(&pending, 0, Invocation::BySha)[1], crate::script::ACQUIRE.sha(), "only per-user");
    let decision = done(h.reply(&mut pending, 0, Ok(&rejected(900))));
    assert_eq!(decision.outcome, Outcome::Rejected);
    assert_eq!(decision.rules.as_slice(), &[(0, RuleOutcome::Allowed), (1, RuleOutcome::Rejected)]);
    assert!(decision.give_back.is_empty(), "nothing taken in Redis");
    let lease_member = decision.leases[0].random;
    assert_eq!(decision.leases, vec![LeaseTicket { name: "erl:hot".into(), random: lease_member, permits: 1 }]);
    let headers = h.headers(&decision);
    assert_eq!(header(&headers, "x-ratelimited-by"), Some("per-user"));
}

#[test]
fn in_a_redis_cluster_a_mixed_outcome_gives_back_the_member_the_request_added() {
    let mut h = Harness::new(two_rules(""));
    let mut pending = sent(h.start(&[]));
    let member_of_a = h.words(&pending, 0, Invocation::BySha)[9].clone();
    assert!(matches!(h.reply(&mut pending, 0, Ok(&acquired(4))), Progress::Waiting));
    let decision = done(h.reply(&mut pending, 1, Ok(&rejected(900))));
    assert_eq!(decision.outcome, Outcome::Rejected);
    match decision.give_back.as_slice() {
        [GiveBack { name, settlement }] => {
            assert_eq!(name, "erl:a");
            assert_eq!(settlement.random.to_vec(), member_of_a.into_bytes());
            assert_eq!((settlement.granted, settlement.used), (1, 0), "remove the whole member");
        }
        other => panic!("{other:?}"),
    }
    let headers = h.headers(&decision);
    assert_eq!(header(&headers, "x-ratelimited-by"), Some("b"));
    assert_eq!(header(&headers, "ratelimit"), Some("\"a\";r=5;t=1, \"b\";r=0;t=1"), "a's permit is given back");
}

#[test]
fn each_rule_outcome_indexes_its_counter() {
    for (position, outcome) in RuleOutcome::ALL.iter().enumerate() {
        assert_eq!(*outcome as usize, position, "{outcome:?}");
    }
}

fn shadow_and_enforced(top: &str) -> PluginConfig {
    let json = format!(
        r#"{{"redis":{{"cluster":"w"}},"rules":[
        {{"name":"enforced","limit_by":"global","rate":5,"interval":1000}},
        {{"name":"trial","limit_by":{{"header":"x-user"}},"rate":5,"interval":1000,"mode":"shadow"}}]{top}}}"#
    );
    PluginConfig::from_json(json.as_bytes()).unwrap()
}

#[test]
fn a_shadow_rule_is_asked_in_its_own_call_and_never_rejects() {
    let mut h = Harness::new(shadow_and_enforced(""));
    let Start::Send(mut pending, 2) = h.start(&[("x-user", "alice")]) else { panic!("two calls expected") };
    assert!(h.words(&pending, 0, Invocation::BySha).contains(&"erl:enforced".to_string()));
    assert!(h.words(&pending, 1, Invocation::BySha).contains(&"erl:trial:alice".to_string()));
    assert!(matches!(h.reply(&mut pending, 0, Ok(&acquired(4))), Progress::Waiting));
    let decision = done(h.reply(&mut pending, 1, Ok(&rejected(900))));
    assert_eq!(decision.outcome, Outcome::Allowed, "the shadow rule's rejection lets the request go on");
    assert!(decision.give_back.is_empty(), "the enforced rule keeps its permit");
    assert_eq!(decision.rules.as_slice(), &[(0, RuleOutcome::Allowed), (1, RuleOutcome::ShadowRejected)]);
    let Verdict::Continue { report } = &decision.verdict else { panic!("continues") };
    assert_eq!(report.shadow_rejected_by, Some(1));
    let headers = h.headers(&decision);
    assert_eq!(header(&headers, "ratelimit"), Some("\"enforced\";r=4;t=1"), "no shadow quota without shadow_headers");
    assert_eq!(header(&headers, "x-shadow-ratelimited-by"), None);
    assert!(h.blocks.0.is_empty() || h.blocks.0.iter().all(|(n, _)| n == "erl:trial:alice"));
}

#[test]
fn shadow_headers_show_the_shadow_quota_and_rule_and_a_local_block_spares_redis() {
    let mut h = Harness::new(shadow_and_enforced(r#","shadow_headers":true"#));
    let mut pending = sent(h.start(&[("x-user", "bob")]));
    assert!(matches!(h.reply(&mut pending, 0, Ok(&acquired(4))), Progress::Waiting));
    let decision = done(h.reply(&mut pending, 1, Ok(&rejected(900))));
    let headers = h.headers(&decision);
    assert_eq!(header(&headers, "x-shadow-ratelimited-by"), Some("trial"));
    assert_eq!(header(&headers, "ratelimit"), Some("\"enforced\";r=4;t=1, \"trial\";r=0;t=1"));
    // The shadow limiter is blocked now: the next request asks Redis for the enforced rule only.
    let Start::Send(pending, 1) = h.start(&[("x-user", "bob")]) else { panic!("one call expected") };
    assert!(!h.words(&pending, 0, Invocation::BySha).contains(&"erl:trial:bob".to_string()));
}

#[test]
fn an_enforced_rejection_gives_back_what_a_shadow_rule_took_and_shadow_failures_never_decide() {
    let mut h = Harness::new(shadow_and_enforced(r#","failure_mode":"deny""#));
    let mut pending = sent(h.start(&[("x-user", "carol")]));
    assert!(matches!(h.reply(&mut pending, 1, Ok(&acquired(4))), Progress::Waiting));
    let decision = done(h.reply(&mut pending, 0, Ok(&rejected(500))));
    assert_eq!(decision.outcome, Outcome::Rejected);
    assert!(
        matches!(decision.give_back.as_slice(), [GiveBack { name, .. }] if name == "erl:trial:carol"),
        "as if enforced, the shadow limiter is charged only for requests that go on: {:?}",
        decision.give_back
    );
    let mut h = Harness::new(shadow_and_enforced(r#","failure_mode":"deny""#));
    let mut pending = sent(h.start(&[("x-user", "dave")]));
    assert!(matches!(h.reply(&mut pending, 0, Ok(&acquired(3))), Progress::Waiting));
    let (progress, effects) = h.reply_with_effects(&mut pending, 1, Err(Failure::NoReply));
    let decision = done(progress);
    assert_eq!(decision.outcome, Outcome::Allowed, "a shadow rule's failure does not fail the request closed");
    assert_eq!(effects.call_failure, Some(Failure::NoReply), "but it is counted");
    assert_eq!(decision.rules.as_slice(), &[(0, RuleOutcome::Allowed), (1, RuleOutcome::Failed)]);
}

#[test]
fn global_shadow_mode_and_a_denied_missing_key_in_shadow() {
    let json = r#"{"redis":{"cluster":"w"},"mode":"shadow","rules":[
        {"name":"u","limit_by":{"header":"x-user"},"rate":5,"interval":1000,"on_missing":"deny"},
        {"name":"e","limit_by":"global","rate":5,"interval":1000,"mode":"enforce"}]}"#;
    let mut h = Harness::new(PluginConfig::from_json(json.as_bytes()).unwrap());
    assert_eq!(h.config.rules[0].mode, Mode::Shadow);
    assert_eq!(h.config.rules[1].mode, Mode::Enforce, "a rule's own mode wins");
    let mut pending = sent(h.start(&[]));
    let decision = done(h.reply(&mut pending, 0, Ok(&acquired(4))));
    assert_eq!(decision.outcome, Outcome::Allowed);
    assert_eq!(decision.rules.as_slice(), &[(0, RuleOutcome::ShadowRejected), (1, RuleOutcome::Allowed)]);
}

#[test]
fn exemptions_skip_the_request_or_one_rule() {
    let json = r#"{"redis":{"cluster":"w"},"exempt":{"headers":{"x-internal":["yes"]}},"rules":[
        {"name":"u","limit_by":{"header":"x-user"},"rate":5,"interval":1000,"exempt":{"client_ips":["10.0.0.0/8"]}},
        {"name":"g","limit_by":"global","rate":5,"interval":1000}]}"#;
    let mut h = Harness::new(PluginConfig::from_json(json.as_bytes()).unwrap());
    let decision = decided(h.start(&[("x-internal", "yes"), ("x-user", "a")]));
    assert_eq!(decision.outcome, Outcome::Exempt);
    assert!(h.headers(&decision).is_empty());
    // FakeRequest comes from 10.0.0.7: rule u is exempt, rule g applies.
    let Start::Send(pending, 1) = h.start(&[("x-user", "a")]) else { panic!("one call expected") };
    assert!(h.words(&pending, 0, Invocation::BySha).contains(&"erl:g".to_string()));
    let request = FakeRequest::with(&[("x-user", "a")]);
    let applied = applications(&h.config, &request).unwrap();
    assert_eq!(applied[0].applies, Applies::Exempt);
    assert_eq!(applied[1].applies, Applies::Limiter { name: "erl:g".into() });
    assert!(applications(&h.config, &FakeRequest::with(&[("x-internal", "yes")])).is_none());
}

#[test]
fn rates_by_value_pick_the_first_matching_entry_and_its_rate() {
    let json = r#"{"redis":{"cluster":"w"},"rules":[
        {"name":"tenant","limit_by":[{"header":"x-tenant"},"path"],"rate":5,"interval":1000,
         "rates_by_value":[{"values":["gold:/api"],"rate":100},{"values":["silver:/api","gold:/api"],"rate":20,"interval":"2s"}]},
        {"name":"net","limit_by":{"client_ip":{"ipv4_prefix":24}},"rate":7,"interval":1000}]}"#;
    let config = PluginConfig::from_json(json.as_bytes()).unwrap();
    assert_eq!(config.rules.len(), 4, "two value entries, the default, and the second rule");
    let look = |tenant: &str, path: &str| {
        let request = FakeRequest::with(&[("x-tenant", tenant), (":path", path)]);
        let applied = applications(&config, &request).unwrap();
        let first = &applied[0];
        let rule = &config.rules[first.entry];
        (first.applies.clone(), rule.rate, rule.interval_ms, applied[1].applies.clone())
    };
    let limiter = |name: &str| Applies::Limiter { name: name.into() };
    assert_eq!(look("gold", "/api"), (limiter("erl:tenant:gold:/api"), 100, 1000, limiter("erl:net:10.0.0.0/24")));
    assert_eq!(look("silver", "/api?x=1").1, 20);
    assert_eq!(look("silver", "/api").2, 2000);
    assert_eq!(look("bronze", "/api").1, 5, "no match: the rule's own rate");
    assert_eq!(look("a:b", "/c").0, limiter("erl:tenant:~YTpi:/c"), "a part with `:` is encoded");
    let mut h = Harness::new(config.clone());
    let pending = sent(h.start(&[("x-tenant", "gold"), (":path", "/api")]));
    let words = h.words(&pending, 0, Invocation::BySha);
    assert!(words.contains(&"100".to_string()), "the entry's rate is sent: {words:?}");
}

/// Rule `first` (keyed by `x-key`, `on_missing: deny`, with `first_extra`), then `per-user`, whose limiter
/// of alice is blocked with no permit free.
fn blocked_second_rule(first_extra: &str) -> Harness {
    let json = format!(
        r#"{{"redis":{{"cluster":"w"}},"rules":[
        {{"name":"first","limit_by":{{"header":"x-key"}},"rate":100,"interval":60000,"on_missing":"deny"{first_extra}}},
        {{"name":"per-user","limit_by":{{"header":"x-user"}},"rate":5,"interval":1000}}]}}"#
    );
    let mut h = Harness::new(PluginConfig::from_json(json.as_bytes()).unwrap());
    let request = FakeRequest::with(&[("x-key", "k"), ("x-user", "alice")]);
    let Applies::Limiter { name } = applications(&h.config, &request).unwrap()[1].applies.clone() else { panic!() };
    let block = Block { until_ms: NOW + 400, release_ms: NOW + 400, available: 0, rate: 5, interval_ms: 1000 };
    h.blocks.0.push((name, block));
    h
}

#[test]
fn a_block_found_before_anything_is_taken_is_the_one_the_rate_stage_rejects_with() {
    let mut h = blocked_second_rule("");
    let headers = [("x-key", "k"), ("x-user", "alice")];
    let early = rejected_by_a_block(&h.context(), &FakeRequest::with(&headers)).expect("per-user's block rejects");
    let decision = decided(h.start(&headers));
    let (early_headers, headers_now) = (h.headers(&early), h.headers(&decision));
    assert_eq!((early.outcome, decision.outcome), (Outcome::LocallyRejected, Outcome::LocallyRejected));
    assert_eq!(early_headers, headers_now, "the same answer");
    assert_eq!(early.rules.as_slice(), decision.rules.as_slice());
    // Where the rate stage decides otherwise first, the walk stops: an enforced rule's denial...
    let no_key = [("x-user", "alice")];
    assert!(rejected_by_a_block(&h.context(), &FakeRequest::with(&no_key)).is_none());
    let denial = decided(h.start(&no_key));
    let denied = h.headers(&denial);
    assert_eq!(header(&denied, "x-ratelimited-by"), Some("first"), "denied by `first`");
    // ...and an enforced rule with a lease (its lease may serve the request, its own block reject it).
    let leased = blocked_second_rule(r#","lease":{"max_permits":8,"max_age":"1s"}"#);
    assert!(rejected_by_a_block(&leased.context(), &FakeRequest::with(&headers)).is_none());
    // A shadow rule's denial does not decide: the walk goes on to the block.
    let shadow = blocked_second_rule(r#","mode":"shadow""#);
    assert!(rejected_by_a_block(&shadow.context(), &FakeRequest::with(&no_key)).is_some());
}

/// A calendar quota beside another rule: one ACQUIRE_ALL whose reply carries the period's length (not the
/// nominal interval): no notice that Redis holds another config, and the quota is whole again at the
/// period's end (`RateLimit` `t=`).
#[test]
fn a_calendar_quota_in_one_call_with_another_rule_reports_its_period_and_no_config_notice() {
    let json = r#"{"redis":{"cluster":"w"},"rules":[
        {"name":"monthly","limit_by":"global","rate":100,"calendar":{"period":"month","time_zone":"America/New_York"}},
        {"name":"per-user","limit_by":{"header":"x-user"},"rate":5,"interval":60000}]}"#;
    let mut h = Harness::new(PluginConfig::from_json(json.as_bytes()).unwrap());
    let mut pending = sent(h.start(&[("x-user", "alice")]));
    let words = h.words(&pending, 0, Invocation::BySha);
    assert_eq!(words[1], crate::script::ACQUIRE_ALL.sha());
    // (The harness's clock is 1970's: the month began before the epoch, and reads from 0.)
    let zone = crate::calendar::Zone::named("America/New_York").unwrap();
    let (start, end) = zone.period(crate::calendar::Period::Month, NOW);
    assert_ne!(end - start, 30 * 86_400_000, "not the nominal month: what a notice would compare");
    assert_eq!(words[16..21], ["1", "100", &end.to_string(), "3", &start.to_string()].map(String::from), "{words:?}");
    let reply =
        all_reply(&[[1, 99, 99, 100, i64::try_from(end - start).unwrap(), 0, 0, 1], [1, 4, 4, 5, 60_000, 0, 0, 1]]);
    let (progress, effects) = h.raw(&mut pending, 0, Ok(&reply));
    assert!(effects.notices.is_empty(), "{:?}", effects.notices);
    let Progress::Done(decision) = progress else { panic!("not decided") };
    assert_eq!(decision.outcome, Outcome::Allowed);
    let headers = h.headers(&decision);
    let t = (end - NOW).div_ceil(1000);
    assert_eq!(header(&headers, "ratelimit"), Some(format!("\"monthly\";r=99;t={t}, \"per-user\";r=4;t=60").as_str()));
}
