//! The filter driven callback by callback through the fake host ([`crate::testing::FakeHost`]): every
//! outcome, both transports' reply shapes, and the paths where a host misbehaves (a refused context
//! switch, a reply for a token nobody waits for, a call never answered).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing, clippy::panic)]

use super::*;
use crate::host::HostError;
use crate::limiter::RuleOutcome;
use crate::testing::{acquired, rejected, End, FakeHost, ROOT};

const BRIDGE: &str = r#""redis":{"cluster":"webdis","timeout":200}"#;
/// The bridge to a Redis Cluster: the limiters of one request are acquired in one call per hash slot.
const BRIDGE_TO_CLUSTER: &str = r#""redis":{"cluster":"webdis","timeout":200,"redis_cluster":true}"#;
const HOST_REDIS: &str = r#""redis":{"transport":"host","cluster":"redis","timeout":200,"password":"s3cret"}"#;
const PER_USER: &str = r#"{"name":"per-user","limit_by":{"header":"x-user"},"rate":2,"interval":"1s"}"#;

fn configure(redis: &str, rules: &str, extra: &str) -> (FakeHost, Filter<FakeHost>) {
    let host = FakeHost::new();
    let json = format!(r#"{{{redis},"rules":[{rules}]{extra}}}"#);
    let filter = Filter::configure(host.clone(), json.as_bytes(), true).unwrap();
    (host, filter)
}

fn start(host: &FakeHost, filter: &mut Filter<FakeHost>, context_id: u32, user: &str) -> Action {
    host.request(context_id, &[(":path", "/"), ("x-user", user), (":authority", "api.example")]);
    filter.on_request_headers(context_id)
}

fn answer_http(host: &FakeHost, filter: &mut Filter<FakeHost>, token: u32, status: u16, body: &[u8]) {
    host.http_reply(status, body);
    filter.on_http_call_response(token, 1, body.len());
}

fn answer_redis(host: &FakeHost, filter: &mut Filter<FakeHost>, token: u32, reply: &[u8]) {
    host.redis_reply(reply);
    filter.on_redis_call_response(token, host_redis::STATUS_OK, reply.len());
}

fn last_token(host: &FakeHost) -> u32 {
    host.last_token().unwrap()
}

fn header<'a>(headers: &'a [(String, String)], name: &str) -> Option<&'a str> {
    headers.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
}

fn local_reply(host: &FakeHost, context_id: u32) -> (u16, Vec<(String, String)>, String) {
    match host.end(context_id) {
        Some(End::LocalReply { status, headers, body, .. }) => (status, headers, body),
        other => panic!("expected a local reply, got {other:?}"),
    }
}

/// The request and call counters of a filter, by name.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Counts {
    allowed: u64,
    rejected: u64,
    failure_allowed: u64,
    failure_denied: u64,
    redis_calls: u64,
    redis_errors: u64,
    host_errors: u64,
    local_rejected: u64,
}

/// No counter moved.
const NONE: Counts = Counts {
    allowed: 0,
    rejected: 0,
    failure_allowed: 0,
    failure_denied: 0,
    redis_calls: 0,
    redis_errors: 0,
    host_errors: 0,
    local_rejected: 0,
};

fn counters(host: &FakeHost) -> Counts {
    let counter = |name: &str| host.counter(&format!("{NAME}.{name}"));
    Counts {
        allowed: counter("allowed"),
        rejected: counter("rejected"),
        failure_allowed: counter("failure_allowed"),
        failure_denied: counter("failure_denied"),
        redis_calls: counter("redis_calls"),
        redis_errors: counter("redis_errors"),
        host_errors: counter("host_errors"),
        local_rejected: counter("local_rejected"),
    }
}

/// Ticks as the host does, on the root context, after moving the clock.
fn tick_after(host: &FakeHost, filter: &mut Filter<FakeHost>, ms: u64) {
    host.advance(ms);
    host.enter(ROOT);
    filter.on_tick();
}

#[test]
fn a_request_no_rule_applies_to_goes_on_without_a_call() {
    let (host, mut filter) = configure(BRIDGE, PER_USER, "");
    host.request(2, &[(":path", "/")]);
    assert_eq!(filter.on_request_headers(2), Action::Continue);
    assert!(host.http_calls().is_empty());
    assert_eq!(counters(&host), NONE, "Outcome::Unlimited counts nothing");
    assert_eq!(filter.on_response_headers(2), Action::Continue);
    assert!(host.response_headers(2).is_empty());
}

#[test]
fn an_allowed_request_is_paused_then_resumed_with_rate_limit_headers_on_its_response() {
    let (host, mut filter) = configure(BRIDGE, PER_USER, "");
    assert_eq!(start(&host, &mut filter, 2, "alice"), Action::Pause);
    let call = host.http_calls().pop().unwrap();
    assert_eq!(call.cluster, "webdis");
    assert_eq!(call.timeout_ms, 200);
    assert!(call.headers.contains(&(":method".into(), "POST".into())));
    assert!(String::from_utf8(call.body).unwrap().starts_with("EVALSHA/"));
    assert_eq!(host.tick_period(), TICK_MS, "the deadline guard runs while a request is paused");
    answer_http(&host, &mut filter, call.token, 200, &acquired(1));
    assert_eq!(host.end(2), Some(End::Resumed));
    host.enter(2);
    filter.on_response_headers(2);
    let headers = host.response_headers(2);
    assert_eq!(header(&headers, "ratelimit"), Some("\"per-user\";r=1;t=1"));
    assert_eq!(counters(&host), Counts { allowed: 1, redis_calls: 1, ..NONE });
    tick_after(&host, &mut filter, TICK_MS.into());
    assert_eq!(host.tick_period(), 0, "the tick stops when nothing is paused");
}

#[test]
fn a_rejected_request_is_answered_with_the_rejection() {
    let (host, mut filter) = configure(BRIDGE, PER_USER, "");
    start(&host, &mut filter, 2, "alice");
    answer_http(&host, &mut filter, last_token(&host), 200, &rejected(1503));
    let (status, headers, body) = local_reply(&host, 2);
    assert_eq!((status, body.as_str()), (429, "rate limit exceeded\n"));
    assert_eq!(header(&headers, "retry-after"), Some("2"));
    assert_eq!(header(&headers, "x-envoy-ratelimited"), Some("true"));
    assert_eq!(header(&headers, "content-type"), Some("text/plain"));
    assert_eq!(counters(&host), Counts { rejected: 1, redis_calls: 1, ..NONE });
}

#[test]
fn failures_follow_the_failure_mode_and_are_logged_once_until_redis_answers() {
    let (host, mut filter) = configure(BRIDGE, PER_USER, "");
    for context_id in [2, 3] {
        start(&host, &mut filter, context_id, "alice");
        answer_http(&host, &mut filter, last_token(&host), 503, b"");
        assert_eq!(host.end(context_id), Some(End::Resumed), "fail open");
    }
    assert_eq!(counters(&host), Counts { failure_allowed: 2, redis_calls: 2, redis_errors: 2, ..NONE });
    let warnings = |host: &FakeHost| host.logs().iter().filter(|(l, _)| *l == LogLevel::Warn).count();
    assert_eq!(warnings(&host), 1, "{:?}", host.logs());
    start(&host, &mut filter, 4, "alice");
    answer_http(&host, &mut filter, last_token(&host), 200, &acquired(1));
    assert!(host.logs().iter().any(|(_, m)| m.contains("Redis answers again")));

    let (host, mut filter) = configure(BRIDGE, PER_USER, r#","failure_mode":"deny","failure_status":500"#);
    start(&host, &mut filter, 2, "alice");
    answer_http(&host, &mut filter, last_token(&host), 200, b"-ERR boom\r\n");
    let (status, _, body) = local_reply(&host, 2);
    assert_eq!((status, body.as_str()), (500, "rate limiter unavailable\n"));
    assert_eq!(counters(&host), Counts { failure_denied: 1, redis_calls: 1, redis_errors: 1, ..NONE });
}

#[test]
fn a_refused_call_is_decided_at_once_by_the_failure_mode() {
    let (host, mut filter) = configure(BRIDGE, PER_USER, r#","failure_mode":"deny""#);
    host.refuse_calls(Some(HostError::BadArgument));
    assert_eq!(start(&host, &mut filter, 2, "alice"), Action::Pause);
    assert_eq!(local_reply(&host, 2).0, 503);
    assert_eq!(counters(&host), Counts { failure_denied: 1, redis_errors: 1, ..NONE });
    assert!(host.logs().iter().any(|(_, m)| m.contains("knows no cluster \"webdis\"")), "{:?}", host.logs());
}

#[test]
fn noscript_is_sent_again_by_source_in_the_same_request() {
    let (host, mut filter) = configure(BRIDGE, PER_USER, "");
    start(&host, &mut filter, 2, "alice");
    answer_http(&host, &mut filter, last_token(&host), 200, b"-NOSCRIPT No matching script.\r\n");
    assert_eq!(host.end(2), None, "still paused");
    let again = host.http_calls().pop().unwrap();
    assert!(String::from_utf8(again.body).unwrap().starts_with("EVAL/"));
    answer_http(&host, &mut filter, again.token, 200, &acquired(1));
    assert_eq!(host.end(2), Some(End::Resumed));
    assert_eq!(counters(&host), Counts { allowed: 1, redis_calls: 2, ..NONE });
}

#[test]
fn a_rejection_still_counts_and_logs_the_other_rules_failures() {
    let rules = format!(r#"{PER_USER},{{"name":"per-ip","limit_by":"client_ip","rate":5,"interval":1000}}"#);
    let (host, mut filter) = configure(BRIDGE_TO_CLUSTER, &rules, "");
    start(&host, &mut filter, 2, "alice");
    let calls = host.http_calls();
    assert_eq!(calls.len(), 2);
    answer_http(&host, &mut filter, calls[0].token, 200, &rejected(800));
    answer_http(&host, &mut filter, calls[1].token, 503, b"");
    assert_eq!(local_reply(&host, 2).0, 429);
    assert_eq!(
        counters(&host),
        Counts { rejected: 1, redis_calls: 2, redis_errors: 1, ..NONE },
        "redis_errors counts the failed call of per-ip"
    );
    assert!(host.logs().iter().any(|(_, m)| m.contains("HTTP 503")), "{:?}", host.logs());
}

#[test]
fn the_host_redis_transport_sends_resp_and_reads_buffer_nine_replies() {
    let (host, mut filter) = configure(HOST_REDIS, PER_USER, "");
    assert_eq!(host.redis_inits(), vec![("redis".to_string(), String::new(), 200)], "init at configure");
    start(&host, &mut filter, 2, "alice");
    let call = host.redis_calls().pop().unwrap();
    assert_eq!(call.service, "redis");
    assert!(call.query.starts_with(b"*16\r\n$7\r\nEVALSHA\r\n"), "{:?}", String::from_utf8_lossy(&call.query));
    answer_redis(&host, &mut filter, call.token, &acquired(1));
    assert_eq!(host.end(2), Some(End::Resumed));
    // Status 1: a network error or timeout.
    start(&host, &mut filter, 3, "alice");
    host.enter(ROOT);
    filter.on_redis_call_response(last_token(&host), 1, 0);
    assert_eq!(host.end(3), Some(End::Resumed), "fail open");
    assert_eq!(counters(&host), Counts { allowed: 1, failure_allowed: 1, redis_calls: 2, redis_errors: 1, ..NONE });
}

#[test]
fn noauth_makes_the_host_client_initialise_again_before_the_next_call() {
    let (host, mut filter) = configure(HOST_REDIS, PER_USER, "");
    start(&host, &mut filter, 2, "alice");
    answer_redis(&host, &mut filter, last_token(&host), b"-NOAUTH Authentication required.\r\n");
    assert_eq!(host.redis_inits().len(), 1);
    start(&host, &mut filter, 3, "alice");
    assert_eq!(host.redis_inits().len(), 2);
}

#[test]
fn an_unknown_cluster_at_configure_is_retried_on_the_next_request() {
    let host = FakeHost::new();
    host.refuse_redis_init(Some(HostError::BadArgument));
    let json = format!(r#"{{{HOST_REDIS},"rules":[{PER_USER}]}}"#);
    let mut filter = Filter::configure(host.clone(), json.as_bytes(), true).unwrap();
    assert!(host.logs().iter().any(|(_, m)| m.contains("retrying on the next request")));
    host.refuse_redis_init(None);
    start(&host, &mut filter, 2, "alice");
    assert_eq!(host.redis_inits().len(), 2);
    assert_eq!(host.redis_calls().len(), 1);
}

#[test]
fn the_stock_build_refuses_the_host_transport_naming_the_field() {
    let json = format!(r#"{{{HOST_REDIS},"rules":[{PER_USER}]}}"#);
    let error = Filter::configure(FakeHost::new(), json.as_bytes(), false).err().unwrap();
    assert_eq!(error.field, "redis.transport", "the field is named");
    let error = error.to_string();
    assert!(error.starts_with("redis.transport: \"host\" needs the host-redis build"), "{error}");
    let json = format!(r#"{{"redis":{{}},"rules":[{PER_USER}]}}"#);
    let error = Filter::configure(FakeHost::new(), json.as_bytes(), true).err().unwrap().to_string();
    assert_eq!(error, "redis: `cluster` or `service_name` is required");
}

#[test]
fn a_refused_context_switch_is_counted_and_the_decision_delivered_on_the_next_tick() {
    let (host, mut filter) = configure(BRIDGE, PER_USER, "");
    start(&host, &mut filter, 2, "alice");
    host.refuse_effective_context(1);
    answer_http(&host, &mut filter, last_token(&host), 200, &rejected(900));
    assert_eq!(host.end(2), None, "the host refused the switch: nothing could be sent yet");
    assert_eq!(counters(&host).host_errors, 1, "host_errors");
    assert!(host.logs().iter().any(|(_, m)| m.contains("refused proxy_set_effective_context")));
    tick_after(&host, &mut filter, TICK_MS.into());
    assert_eq!(local_reply(&host, 2).0, 429, "the real decision, one tick later");
    assert_eq!(counters(&host), Counts { rejected: 1, redis_calls: 1, host_errors: 1, ..NONE });
    tick_after(&host, &mut filter, TICK_MS.into());
    assert_eq!(host.tick_period(), 0);
}

#[test]
fn a_reply_for_a_token_nobody_waits_for_is_dropped_and_the_request_ends_at_its_deadline() {
    let (host, mut filter) = configure(BRIDGE, PER_USER, "");
    start(&host, &mut filter, 2, "alice");
    let token = last_token(&host);
    answer_http(&host, &mut filter, token + 1_000_000, 200, &rejected(900));
    assert_eq!(host.end(2), None);
    tick_after(&host, &mut filter, 200);
    assert_eq!(host.end(2), None, "redis.timeout (200 ms) not yet over by the grace");
    tick_after(&host, &mut filter, DEADLINE_GRACE_MS);
    assert_eq!(host.end(2), Some(End::Resumed), "failing open at the deadline");
    assert_eq!(counters(&host), Counts { failure_allowed: 1, redis_calls: 1, redis_errors: 1, ..NONE });
    assert!(host.logs().iter().any(|(_, m)| m.contains("no answer to a Redis call within redis.timeout")));
    // The real reply, if it ever comes, decides nothing; the permit it took goes back at once.
    answer_http(&host, &mut filter, token, 200, &acquired(1));
    assert_eq!(counters(&host), Counts { failure_allowed: 1, redis_calls: 2, redis_errors: 1, ..NONE });
    assert_eq!(give_backs_sent(&host), 1, "the late member given back");
    assert_eq!(host.counter(&format!("{NAME}.late_given_back")), 1);
}

/// The GIVE_BACK calls sent so far (through the HTTP bridge).
fn give_backs_sent(host: &FakeHost) -> usize {
    let sha = crate::script::GIVE_BACK.sha();
    host.http_calls()
        .iter()
        .filter(|call| String::from_utf8_lossy(&call.body).starts_with(&format!("EVALSHA/{sha}/")))
        .count()
}

#[test]
fn a_late_reply_that_took_nothing_gives_nothing_back_and_a_call_never_answered_is_counted() {
    let (host, mut filter) = configure(BRIDGE, PER_USER, "");
    start(&host, &mut filter, 2, "alice");
    let rejected_late = last_token(&host);
    filter.on_done(2);
    answer_http(&host, &mut filter, rejected_late, 200, &rejected(900));
    assert_eq!(give_backs_sent(&host), 0, "a refusal took nothing");
    // Bob's call never answers: given up with the request's deadline and a timeout more.
    start(&host, &mut filter, 4, "bob");
    filter.on_done(4);
    tick_after(&host, &mut filter, 200 + DEADLINE_GRACE_MS + 200);
    assert_eq!(host.counter(&format!("{NAME}.late_unanswered")), 1);
    assert_eq!(host.counter(&format!("{NAME}.late_given_back")), 0);
    tick_after(&host, &mut filter, 1_000);
    assert_eq!(host.tick_period(), 0, "nothing waits any more");
}

#[test]
fn a_call_the_host_never_answers_ends_in_the_failure_mode_within_the_timeout() {
    for (mode, end) in [("allow", None), ("deny", Some(503))] {
        let (host, mut filter) = configure(HOST_REDIS, PER_USER, &format!(r#","failure_mode":"{mode}""#));
        start(&host, &mut filter, 2, "alice");
        let mut waited = 0;
        while host.end(2).is_none() {
            tick_after(&host, &mut filter, TICK_MS.into());
            waited += u64::from(TICK_MS);
            assert!(waited <= 200 + DEADLINE_GRACE_MS + u64::from(TICK_MS), "still paused after {waited} ms");
        }
        match end {
            None => assert_eq!(host.end(2), Some(End::Resumed)),
            Some(status) => assert_eq!(local_reply(&host, 2).0, status),
        }
        assert_eq!(counters(&host).redis_errors, 1, "redis_errors");
    }
}

#[test]
fn a_request_that_went_away_is_forgotten_and_its_late_reply_gives_back_what_it_took() {
    let (host, mut filter) = configure(BRIDGE, PER_USER, "");
    start(&host, &mut filter, 2, "alice");
    let token = last_token(&host);
    filter.on_done(2);
    answer_http(&host, &mut filter, token, 200, &acquired(1));
    assert_eq!(host.end(2), None);
    assert_eq!(counters(&host), Counts { redis_calls: 2, ..NONE }, "no decision is counted for it");
    assert_eq!(give_backs_sent(&host), 1, "the member it took, given back");
    assert_eq!(host.counter(&format!("{NAME}.late_given_back")), 1);
    tick_after(&host, &mut filter, 1_000);
    assert_eq!(host.tick_period(), 0);
}

#[test]
fn a_missing_key_denied_by_the_rule_is_answered_without_a_call() {
    let rules = r#"{"name":"per-user","limit_by":{"header":"x-user"},"rate":2,"interval":"1s","on_missing":"deny"}"#;
    let (host, mut filter) = configure(BRIDGE, rules, "");
    host.request(2, &[(":path", "/")]);
    assert_eq!(filter.on_request_headers(2), Action::Pause);
    assert_eq!(local_reply(&host, 2).0, 429);
    assert!(host.http_calls().is_empty());
    assert_eq!(counters(&host), Counts { rejected: 1, ..NONE });
}

#[test]
fn vms_that_raced_to_publish_their_client_id_adopt_the_stored_one() {
    let first = FakeHost::new();
    let second = first.sibling();
    let json = format!(r#"{{{BRIDGE},"rules":[{}]}}"#, PER_USER.replace("\"1s\"", "\"1s\",\"type\":\"per_client\""));
    let mut a = Filter::configure(first.clone(), json.as_bytes(), true).unwrap();
    let stored = first.shared_data(CLIENT_ID_KEY).unwrap().0;
    let mut b = Filter::configure(second.clone(), json.as_bytes(), true).unwrap();
    assert_eq!(second.shared_data(CLIENT_ID_KEY).unwrap().0, stored, "the second VM found the first one's id");
    // A VM that published its own id in the race (it read before the other wrote) adopts the stored one.
    a.client_id = "lost-the-race".into();
    for (host, filter) in [(&first, &mut a), (&second, &mut b)] {
        start(host, filter, 2, "alice");
        let body = String::from_utf8(host.http_calls().pop().unwrap().body).unwrap();
        let id = String::from_utf8(stored.clone()).unwrap();
        assert!(body.contains(&id.replace('-', "%2D")), "{body}");
    }
    let id = String::from_utf8(stored).unwrap();
    assert_eq!(id.len(), 36);
    assert_eq!(&id[14..15], "4", "a version 4 UUID: {id}");
}

#[test]
fn shared_data_refuses_a_stale_compare_and_swap() {
    let host = FakeHost::new();
    let other_vm = host.sibling();
    host.set_shared_data("k", b"1", 0).unwrap();
    let (_, cas) = host.get_shared_data("k").unwrap();
    other_vm.set_shared_data("k", b"2", cas).unwrap();
    assert_eq!(host.set_shared_data("k", b"3", cas), Err(HostError::CasMismatch));
    assert_eq!(host.get_shared_data("k").unwrap().0.as_deref(), Some(&b"2"[..]));
}

#[test]
fn match_rules_choose_the_route_configuration() {
    let json = format!(
        r#"{{{BRIDGE},"rules":[{PER_USER}],"_rules_":[{{"_match_route_":["login"],"rules":[{{"name":"login","limit_by":"global","rate":1,"interval":1000}}]}}]}}"#
    );
    let host = FakeHost::new();
    let mut filter = Filter::configure(host.clone(), json.as_bytes(), true).unwrap();
    host.set_property("xds.route_name", "login");
    start(&host, &mut filter, 2, "alice");
    let body = String::from_utf8(host.http_calls().pop().unwrap().body).unwrap();
    assert!(body.contains("erl%3Alogin/"), "{body}");
}

#[test]
fn a_decision_made_while_starting_ends_the_request_at_once_even_with_several_rules() {
    let rules = format!(r#"{PER_USER},{{"name":"per-ip","limit_by":"client_ip","rate":5,"interval":1000}}"#);
    let (host, mut filter) = configure(BRIDGE_TO_CLUSTER, &rules, "");
    host.refuse_calls(Some(HostError::InternalFailure));
    assert_eq!(start(&host, &mut filter, 2, "alice"), Action::Continue, "both calls refused: fail open now");
    assert_eq!(counters(&host), Counts { failure_allowed: 1, redis_errors: 2, ..NONE });
    assert_eq!(host.tick_period(), 0, "nothing paused");
}

#[test]
fn without_a_tick_the_replies_still_end_requests_and_the_refusal_is_counted() {
    let (host, mut filter) = configure(BRIDGE, PER_USER, "");
    host.refuse_tick(true);
    start(&host, &mut filter, 2, "alice");
    assert_eq!(counters(&host).host_errors, 1, "host_errors");
    answer_http(&host, &mut filter, last_token(&host), 200, &acquired(1));
    assert_eq!(host.end(2), Some(End::Resumed));
}

/// Not tests: loops over one request path each, for profiling natively (`valgrind --tool=callgrind` on the
/// test binary with `--ignored profile_`).
fn profile(reply: &[u8], requests: u32) {
    let (host, mut filter) = configure(BRIDGE, &PER_USER.replace("\"rate\":2", "\"rate\":1000000"), "");
    for i in 0..requests {
        let context_id = 2 + i;
        start(&host, &mut filter, context_id, "alice");
        if let Some(token) = host.last_token() {
            answer_http(&host, &mut filter, token, 200, reply);
        }
        host.enter(context_id);
        filter.on_response_headers(context_id);
        filter.on_done(context_id);
        host.clear_calls();
    }
}

#[test]
#[ignore]
fn profile_allowed() {
    profile(&acquired(5), 2_000);
}

#[test]
#[ignore]
fn profile_rejected_by_redis() {
    profile(&rejected(900), 1); // leaves a block
    profile(&rejected(1), 2_000); // 1 ms: too short for a block
}

#[test]
#[ignore]
fn profile_rejected_locally() {
    profile(&rejected(3_600_000), 2_000);
}

#[test]
fn local_rejections_reuse_a_reply_only_while_its_headers_would_be_the_same() {
    let (host, mut filter) = configure(BRIDGE, PER_USER, "");
    for (context_id, user, delay_ms) in [(2, "alice", 60_000), (3, "bob", 30_000)] {
        start(&host, &mut filter, context_id, user);
        answer_http(&host, &mut filter, last_token(&host), 200, &rejected(delay_ms));
        assert_eq!(local_reply(&host, context_id).0, 429);
    }
    let calls = host.http_calls().len();
    let mut reply = |context_id: u32, user: &str, advance_ms: u64| {
        host.advance(advance_ms);
        start(&host, &mut filter, context_id, user);
        let (_, headers, _) = local_reply(&host, context_id);
        [header(&headers, "retry-after").map(str::to_owned), header(&headers, "ratelimit").map(str::to_owned)]
    };
    let first = reply(10, "alice", 0);
    assert_eq!(first, [Some("60".into()), Some("\"per-user\";r=0;t=60".into())]);
    assert_eq!(reply(11, "alice", 100), first, "the same second: the same headers");
    assert_eq!(reply(12, "bob", 0)[0].as_deref(), Some("30"), "another limiter's block: its own headers");
    assert_eq!(reply(13, "alice", 0), first, "back to alice");
    assert_eq!(reply(14, "alice", 1_000)[0].as_deref(), Some("59"), "a second later: Retry-After counts down");
    assert_eq!(host.http_calls().len(), calls, "every one answered by the local block");
    assert_eq!(counters(&host).local_rejected, 5);
}

#[test]
fn a_vm_whose_kept_block_would_let_a_request_through_reads_the_newer_one_another_vm_recorded() {
    let rules = r#"{"name":"heavy","limit_by":{"header":"x-heavy"},"limiter":"erl:acct","rate":4,"interval":"1m","permits":3},
                   {"name":"light","limit_by":{"header":"x-light"},"limiter":"erl:acct","rate":4,"interval":"1m"}"#;
    let json = format!(r#"{{{BRIDGE},"rules":[{rules}]}}"#);
    let first = FakeHost::new();
    let second = first.sibling();
    let mut a = Filter::configure(first.clone(), json.as_bytes(), true).unwrap();
    let mut b = Filter::configure(second.clone(), json.as_bytes(), true).unwrap();
    let request = |host: &FakeHost, filter: &mut Filter<FakeHost>, context_id: u32, kind: &str| {
        host.request(context_id, &[(":path", "/"), (kind, "acme")]);
        filter.on_request_headers(context_id)
    };
    // VM a: Redis rejects a heavy request (3 permits): its block says fewer than 3 are free.
    request(&first, &mut a, 2, "x-heavy");
    answer_http(&first, &mut a, last_token(&first), 200, &rejected(60_000));
    // VM b: a light request (1 permit) still goes to Redis, which rejects it: fewer than 1 free.
    request(&second, &mut b, 2, "x-light");
    answer_http(&second, &mut b, last_token(&second), 200, &rejected(59_000));
    // VM a keeps its own block, which would let a light request through; it reads b's newer one instead.
    let calls = first.http_calls().len();
    assert_eq!(request(&first, &mut a, 3, "x-light"), Action::Pause);
    assert_eq!(local_reply(&first, 3).0, 429);
    assert_eq!(first.http_calls().len(), calls, "rejected by the block b recorded, without a call");
    assert_eq!(counters(&first).local_rejected, 1);
}

/// A global rule leasing up to 4 permits for 1 s.
const HOT: &str =
    r#"{"name":"hot","limit_by":"global","rate":100,"interval":"1m","lease":{"max_permits":4,"max_age":"1s"}}"#;

#[test]
fn requests_arriving_while_their_vms_lease_acquire_is_on_its_way_wait_for_it_and_are_served_from_it() {
    let (host, mut filter) = configure(BRIDGE, HOT, "");
    assert_eq!(start(&host, &mut filter, 2, "a"), Action::Pause);
    assert_eq!(start(&host, &mut filter, 3, "b"), Action::Pause, "parked on the lease acquire");
    assert_eq!(start(&host, &mut filter, 4, "c"), Action::Pause);
    assert_eq!(host.http_calls().len(), 1, "one Redis call for the three");
    // The lease: 4 permits taken, 96 left in Redis.
    answer_http(&host, &mut filter, last_token(&host), 200, b"*2\r\n:96\r\n:4\r\n");
    for id in [2, 3, 4] {
        assert_eq!(host.end(id), Some(End::Resumed), "request {id}");
    }
    assert_eq!(start(&host, &mut filter, 5, "d"), Action::Continue, "the lease's last permit, at once");
    assert_eq!(host.http_calls().len(), 1);
    // Used up: the next request asks for a new lease (twice as many) and settles the old one.
    assert_eq!(start(&host, &mut filter, 6, "e"), Action::Pause);
    let call = host.http_calls().pop().unwrap();
    let body = String::from_utf8(call.body).unwrap();
    // The last six arguments, last first: early, used, granted, random, age, permits asked for.
    let lease: Vec<&str> = body.trim_end_matches(".raw").rsplit('/').take(6).collect();
    assert_eq!((lease[5], lease[4]), ("4", "1000"), "asks for 4 (the most: used up), age 1000 ms");
    assert_eq!((lease[2], lease[1]), ("4", "4"), "and settles the lease: 4 granted, 4 used");
}

#[test]
fn a_request_parked_on_a_lease_acquire_that_fails_asks_redis_itself() {
    let (host, mut filter) = configure(BRIDGE, HOT, "");
    start(&host, &mut filter, 2, "a");
    start(&host, &mut filter, 3, "b");
    assert_eq!(host.http_calls().len(), 1);
    answer_http(&host, &mut filter, last_token(&host), 503, b"");
    assert_eq!(host.end(2), Some(End::Resumed), "failed open");
    assert_eq!(host.end(3), None, "still paused: its own acquire is on its way");
    assert_eq!(host.http_calls().len(), 2);
    answer_http(&host, &mut filter, last_token(&host), 200, b"*2\r\n:97\r\n:3\r\n");
    assert_eq!(host.end(3), Some(End::Resumed));
}

#[test]
fn a_request_parked_on_a_lease_acquire_that_times_out_still_ends_within_its_own_timeout() {
    // BRIDGE: timeout 200 ms. The lease acquire sent at 0 is never answered.
    let (host, mut filter) = configure(BRIDGE, HOT, "");
    start(&host, &mut filter, 2, "a");
    host.advance(150);
    start(&host, &mut filter, 3, "b");
    assert_eq!(host.http_calls().len(), 1, "b waits for a's lease acquire");
    tick_after(&host, &mut filter, 61);
    assert_eq!(host.end(2), Some(End::Resumed), "a's deadline: failed open");
    assert_eq!(host.end(3), None, "b, woken, asks Redis itself");
    assert_eq!(host.http_calls().len(), 2);
    tick_after(&host, &mut filter, 150);
    assert_eq!(host.end(3), Some(End::Resumed), "at b's own deadline (150 + 200 + 10 ms), not 200 ms later");
}

#[test]
fn failing_locally_each_gateway_admits_its_share_and_a_probe_closes_the_circuit() {
    // rate 2 per 1 s over 2 gateways: each process admits 1 per window while Redis fails.
    let (host, mut filter) = configure(
        BRIDGE,
        PER_USER,
        r#","failure_mode":"local","local_fallback":{"gateways":2,"probe_interval":"500ms"}"#,
    );
    let fallback =
        |host: &FakeHost| ["fallback_allowed", "fallback_rejected"].map(|n| host.counter(&format!("{NAME}.{n}")));
    start(&host, &mut filter, 2, "alice");
    answer_http(&host, &mut filter, last_token(&host), 503, b"");
    assert!(matches!(host.end(2), Some(End::Resumed)), "the failed request is admitted locally");
    assert_eq!(fallback(&host), [1, 0]);
    // The circuit is open: no Redis call until the probe; the window is full.
    let calls = host.http_calls().len();
    start(&host, &mut filter, 3, "alice");
    let (status, headers, _) = local_reply(&host, 3);
    assert_eq!((status, header(&headers, "retry-after").is_some()), (429, true));
    assert_eq!(start(&host, &mut filter, 4, "bob"), Action::Continue, "bob has a window of his own");
    assert_eq!((host.http_calls().len(), fallback(&host)), (calls, [2, 1]));
    // After the probe interval one request asks Redis; Redis answers: the circuit closes.
    host.advance(500);
    assert_eq!(start(&host, &mut filter, 5, "carol"), Action::Pause);
    assert_eq!(start(&host, &mut filter, 6, "dave"), Action::Continue, "decided locally while the probe is out");
    answer_http(&host, &mut filter, last_token(&host), 200, &acquired(1));
    assert_eq!(start(&host, &mut filter, 7, "erin"), Action::Pause, "Redis is asked again");
    assert_eq!(counters(&host).allowed, 1, "the probe was allowed by Redis");
}

#[test]
fn local_fallback_is_refused_without_gateways_or_with_another_failure_mode() {
    for (extra, field) in [
        (r#","failure_mode":"local""#, "local_fallback: required"),
        (r#","failure_mode":"local","local_fallback":{}"#, "local_fallback.gateways: is required"),
        (r#","failure_mode":"local","local_fallback":{"gateways":0}"#, "local_fallback.gateways: must be at least 1"),
        (r#","local_fallback":{"gateways":2}"#, "local_fallback: only with failure_mode"),
    ] {
        let json = format!(r#"{{{BRIDGE},"rules":[{PER_USER}]{extra}}}"#);
        let error = Filter::configure(FakeHost::new(), json.as_bytes(), true).err().unwrap().to_string();
        assert!(error.starts_with(field), "{error}");
    }
}

#[test]
fn each_rule_counts_its_outcomes_and_the_rejecting_rule_is_in_the_filter_state() {
    let trial = r#"{"name":"trial","limit_by":"global","rate":1,"interval":"1s","mode":"shadow"}"#;
    let (host, mut filter) = configure(BRIDGE, &format!("{PER_USER},{trial}"), "");
    let rule = |name: &str, outcome: &str| host.counter(&format!("{NAME}.rule.{name}.{outcome}"));
    // Rejected by per-user; trial (shadow, its own call) admits.
    start(&host, &mut filter, 2, "alice");
    let calls = host.http_calls();
    assert_eq!(calls.len(), 2, "a shadow rule is asked in a call of its own");
    answer_http(&host, &mut filter, calls[0].token, 200, &rejected(700));
    answer_http(&host, &mut filter, calls[1].token, 200, &acquired(0));
    let (status, headers, _) = local_reply(&host, 2);
    assert_eq!((status, header(&headers, "x-ratelimited-by")), (429, Some("per-user")));
    assert_eq!(host.filter_state(2), vec![(REJECTED_BY_PROPERTY.to_string(), "per-user".to_string())]);
    assert_eq!((rule("per-user", "rejected"), rule("trial", "allowed")), (1, 1));
    // Allowed by per-user; trial would reject: the request goes on, named in the filter state.
    start(&host, &mut filter, 3, "bob");
    let calls = host.http_calls();
    let (first, second) = (calls[calls.len() - 2].token, calls[calls.len() - 1].token);
    answer_http(&host, &mut filter, first, 200, &acquired(1));
    answer_http(&host, &mut filter, second, 200, &rejected(500));
    assert_eq!(host.end(3), Some(End::Resumed));
    assert_eq!(host.filter_state(3), vec![(SHADOW_REJECTED_BY_PROPERTY.to_string(), "trial".to_string())]);
    assert_eq!((rule("per-user", "allowed"), rule("trial", "shadow_rejected")), (1, 1));
    assert_eq!((counters(&host).allowed, counters(&host).rejected), (1, 1), "the shadow rejection counts as allowed");
    // Trial's limiter is blocked locally now: another request spares its call and counts it again.
    start(&host, &mut filter, 4, "carol");
    answer_http(&host, &mut filter, last_token(&host), 200, &acquired(1));
    assert_eq!(host.end(4), Some(End::Resumed));
    assert_eq!(rule("trial", "shadow_rejected"), 2);
    // A failure of per-user is counted as the rule's failure.
    start(&host, &mut filter, 5, "dave");
    answer_http(&host, &mut filter, last_token(&host), 503, b"");
    assert_eq!(rule("per-user", "failures"), 1);
    assert_eq!(rule("per-user", "local_rejected"), 0);
}

#[test]
fn an_exempt_request_is_counted_and_not_limited() {
    let (host, mut filter) = configure(BRIDGE, PER_USER, r#","exempt":{"client_ips":["10.0.0.0/8"]}"#);
    assert_eq!(start(&host, &mut filter, 2, "alice"), Action::Continue, "the fake host's client is 10.0.0.7");
    assert!(host.http_calls().is_empty());
    assert_eq!(host.counter(&format!("{NAME}.exempt")), 1);
    assert_eq!(counters(&host), NONE);
}

#[test]
fn a_local_block_rejection_counts_in_the_rules_rejected_and_local_rejected() {
    let (host, mut filter) = configure(BRIDGE, PER_USER, "");
    start(&host, &mut filter, 2, "alice");
    answer_http(&host, &mut filter, last_token(&host), 200, &rejected(700));
    start(&host, &mut filter, 3, "alice");
    let (status, _, _) = local_reply(&host, 3);
    assert_eq!(status, 429);
    let rule = |outcome: &str| host.counter(&format!("{NAME}.rule.per-user.{outcome}"));
    assert_eq!((rule("rejected"), rule("local_rejected")), (2, 1));
}

/// Every counter that moved since `before` (a [`snapshot`]), by name, in name order.
fn deltas(host: &FakeHost, before: &[(String, u64)]) -> Vec<(String, u64)> {
    let mut moved: Vec<(String, u64)> = snapshot(host)
        .into_iter()
        .map(|(name, value)| {
            let was = before.iter().find(|(n, _)| *n == name).map_or(0, |(_, v)| *v);
            (name, value - was)
        })
        .filter(|(_, delta)| *delta > 0)
        .collect();
    moved.sort();
    moved
}

/// Every counter of the filter, by its name without the `edge_rate_limiter.` prefix.
fn snapshot(host: &FakeHost) -> Vec<(String, u64)> {
    let names = [
        "allowed",
        "rejected",
        "local_rejected",
        "failure_allowed",
        "failure_denied",
        "redis_calls",
        "redis_errors",
        "host_errors",
        "leases",
        "lease_settlements",
        "lease_permits_lost",
        "compensations",
        "fallback_allowed",
        "fallback_rejected",
        "exempt",
    ];
    let rules = ["a", "b", "trial"]
        .into_iter()
        .flat_map(|rule| RuleOutcome::ALL.into_iter().map(move |outcome| format!("rule.{rule}.{}", outcome.counter())));
    names
        .into_iter()
        .map(String::from)
        .chain(rules)
        .map(|name| (name.clone(), host.counter(&format!("{NAME}.{name}"))))
        .collect()
}

/// The counters a test expects to move, in name order (as [`deltas`] lists them).
fn expect(pairs: &[(&str, u64)]) -> Vec<(String, u64)> {
    let mut expected: Vec<(String, u64)> = pairs.iter().map(|(name, value)| ((*name).to_string(), *value)).collect();
    expected.sort();
    expected
}

/// Rules `a` (per user) and `b` (global), one combined call per request.
const A_AND_B: &str = r#"{"name":"a","limit_by":{"header":"x-user"},"rate":5,"interval":"1s","local_block_max":0},
    {"name":"b","limit_by":"global","rate":9,"interval":"1s","local_block_max":0}"#;

/// ACQUIRE_ALL's reply for two limiters: each `(code, amount)` with the rest of the full reply.
fn both(first: (i64, i64), second: (i64, i64)) -> Vec<u8> {
    let mut items = Vec::new();
    for ((code, amount), rate) in [(first, 5), (second, 9)] {
        items.extend([code, amount, amount.max(0), rate, 1_000, 0, 0, i64::from(code == 1)]);
    }
    let mut out = format!("*{}\r\n", items.len()).into_bytes();
    for item in items {
        out.extend(format!(":{item}\r\n").bytes());
    }
    out
}

#[test]
fn every_counter_moves_once_per_event_for_each_outcome() {
    let trial = r#"{"name":"trial","limit_by":"global","rate":1,"interval":"1s","mode":"shadow","local_block_max":0}"#;
    let two = |redis: &str| configure(redis, A_AND_B, "");
    // A combined call: both admit.
    let (host, mut filter) = two(BRIDGE);
    start(&host, &mut filter, 2, "alice");
    answer_http(&host, &mut filter, last_token(&host), 200, &both((1, 4), (1, 8)));
    let allowed = [("allowed", 1), ("redis_calls", 1), ("rule.a.allowed", 1), ("rule.b.allowed", 1)];
    assert_eq!(deltas(&host, &[]), expect(&allowed));
    // The combined call fails: one failed call, one failure per rule.
    let before = snapshot(&host);
    start(&host, &mut filter, 3, "alice");
    answer_http(&host, &mut filter, last_token(&host), 503, b"");
    let failed = [
        ("failure_allowed", 1),
        ("redis_calls", 1),
        ("redis_errors", 1),
        ("rule.a.failures", 1),
        ("rule.b.failures", 1),
    ];
    assert_eq!(deltas(&host, &before), expect(&failed));
    // The review's count: 3 combined calls, 2 failed, counted 2 (not one per rule: 4).
    let (host, mut filter) = two(BRIDGE);
    for (context_id, status) in [(2, 503), (3, 503), (4, 200)] {
        start(&host, &mut filter, context_id, "alice");
        answer_http(&host, &mut filter, last_token(&host), status, &both((1, 4), (1, 8)));
    }
    assert_eq!(host.counter(&format!("{NAME}.redis_errors")), 2);
    assert_eq!(host.counter(&format!("{NAME}.redis_calls")), 3);
    // NOSCRIPT: the call is sent again by source; no error.
    let (host, mut filter) = two(BRIDGE);
    start(&host, &mut filter, 2, "alice");
    answer_http(&host, &mut filter, last_token(&host), 200, b"-NOSCRIPT No matching script.\r\n");
    answer_http(&host, &mut filter, last_token(&host), 200, &both((1, 4), (1, 8)));
    assert_eq!(
        deltas(&host, &[]),
        expect(&[("allowed", 1), ("redis_calls", 2), ("rule.a.allowed", 1), ("rule.b.allowed", 1)])
    );
    // A shadow rule's call: it would reject; then it fails. Each is counted for the shadow rule only.
    let (host, mut filter) = configure(BRIDGE, &format!("{A_AND_B},{trial}"), "");
    start(&host, &mut filter, 2, "alice");
    let calls = host.http_calls();
    answer_http(&host, &mut filter, calls[0].token, 200, &both((1, 4), (1, 8)));
    answer_http(&host, &mut filter, calls[1].token, 200, &rejected(500));
    let shadowed = [
        ("allowed", 1),
        ("redis_calls", 2),
        ("rule.a.allowed", 1),
        ("rule.b.allowed", 1),
        ("rule.trial.shadow_rejected", 1),
    ];
    assert_eq!(deltas(&host, &[]), expect(&shadowed));
    let before = snapshot(&host);
    start(&host, &mut filter, 3, "alice");
    let calls = host.http_calls();
    answer_http(&host, &mut filter, calls[2].token, 200, &both((1, 3), (1, 7)));
    answer_http(&host, &mut filter, calls[3].token, 503, b"");
    let shadow_failed = [
        ("allowed", 1),
        ("redis_calls", 2),
        ("redis_errors", 1),
        ("rule.a.allowed", 1),
        ("rule.b.allowed", 1),
        ("rule.trial.failures", 1),
    ];
    assert_eq!(deltas(&host, &before), expect(&shadow_failed));
    // Redis Cluster, two slots: a admits, b rejects: a's member is given back (one more call); a give-back
    // answered NOSCRIPT is sent again (not counted again), one never answered fails at its deadline.
    let (host, mut filter) = two(BRIDGE_TO_CLUSTER);
    start(&host, &mut filter, 2, "alice");
    let calls = host.http_calls();
    answer_http(&host, &mut filter, calls[0].token, 200, &acquired(4));
    answer_http(&host, &mut filter, calls[1].token, 200, &rejected(600));
    let mixed =
        [("rejected", 1), ("redis_calls", 3), ("compensations", 1), ("rule.a.allowed", 1), ("rule.b.rejected", 1)];
    assert_eq!(deltas(&host, &[]), expect(&mixed));
    let before = snapshot(&host);
    answer_http(&host, &mut filter, last_token(&host), 200, b"-NOSCRIPT No matching script.\r\n");
    assert_eq!(deltas(&host, &before), expect(&[("redis_calls", 1)]));
    tick_after(&host, &mut filter, 200 + DEADLINE_GRACE_MS);
    assert_eq!(deltas(&host, &before), expect(&[("redis_calls", 1), ("redis_errors", 1)]), "the unanswered give-back");
    assert!(filter.give_backs.is_empty(), "and its entry is gone");
    tick_after(&host, &mut filter, TICK_MS.into());
    assert_eq!(host.tick_period(), 0, "nothing left to wait for: the tick stops");
    // A call never answered ends at its deadline: one failed call.
    let (host, mut filter) = two(BRIDGE);
    start(&host, &mut filter, 2, "alice");
    tick_after(&host, &mut filter, 200 + DEADLINE_GRACE_MS);
    assert_eq!(deltas(&host, &[]), expect(&failed));
}

#[test]
fn an_error_on_one_limiters_keys_leaves_the_other_rules_to_decide_and_is_logged_once() {
    let broken = "WRONGTYPE Operation against a key holding the wrong kind of value";
    let reply = |second: i64| {
        let mut out = b"*17\r\n".to_vec();
        for item in [4, 0, 0, 0, 0, 0, 0, 0, second, 0, 0, 9, 1_000, 0, 0, i64::from(second == 1)] {
            out.extend(format!(":{item}\r\n").bytes());
        }
        out.extend(format!("${}\r\n{broken}\r\n", broken.len()).bytes());
        out
    };
    // Rule a's limiter is broken, b decides: it admits (a fails open), then it rejects (429 by b).
    let (host, mut filter) = configure(BRIDGE, A_AND_B, "");
    start(&host, &mut filter, 2, "alice");
    answer_http(&host, &mut filter, last_token(&host), 200, &reply(1));
    assert_eq!(host.end(2), Some(End::Resumed));
    start(&host, &mut filter, 3, "alice");
    answer_http(&host, &mut filter, last_token(&host), 200, &reply(0));
    let (status, headers, _) = local_reply(&host, 3);
    assert_eq!((status, header(&headers, "x-ratelimited-by")), (429, Some("b")), "the healthy rule rejects");
    start(&host, &mut filter, 4, "alice");
    answer_http(&host, &mut filter, last_token(&host), 200, &reply(1));
    let counted = [
        ("allowed", 0),
        ("rejected", 1),
        ("failure_allowed", 2),
        ("redis_calls", 3),
        ("redis_errors", 3),
        ("rule.a.failures", 3),
        ("rule.b.allowed", 2),
        ("rule.b.rejected", 1),
    ];
    let counted: Vec<(&str, u64)> = counted.into_iter().filter(|(_, v)| *v > 0).collect();
    assert_eq!(deltas(&host, &[]), expect(&counted));
    let lines: Vec<String> =
        host.logs().into_iter().map(|(_, line)| line).filter(|l| l.contains("WRONGTYPE")).collect();
    assert_eq!(lines.len(), 1, "logged once, naming the rule and the limiter: {lines:?}");
    assert!(lines[0].contains("rule a: Redis error on limiter erl:a:alice: WRONGTYPE"), "{}", lines[0]);
    // Failing closed, the call says so: an error stops the other limiters' charge.
    let (host, mut filter) = configure(BRIDGE, A_AND_B, r#","failure_mode":"deny""#);
    start(&host, &mut filter, 2, "alice");
    let body = String::from_utf8(host.http_calls().pop().unwrap().body).unwrap();
    let words: Vec<&str> = body.split('/').collect();
    assert_eq!((words[13], words[14]), ("1700000000000", "1"), "ARGV 2: an error stops the charge");
    answer_http(&host, &mut filter, last_token(&host), 200, &reply(3));
    assert_eq!(local_reply(&host, 2).0, 503, "a's failure fails the request closed");
}

#[test]
fn replies_find_their_own_request_when_http_and_redis_calls_share_a_token() {
    // Global: the host's Redis client; route "bridge": the HTTP bridge. Each kind numbered on its own.
    let json = format!(
        r#"{{{HOST_REDIS},"rules":[{{"name":"a","limit_by":{{"header":"x-user"}},"rate":5,"interval":"1s"}}],
        "_rules_":[{{"_match_route_":["bridge"],{BRIDGE},"rules":[{{"name":"b","limit_by":"global","rate":1,"interval":"1s"}}]}}]}}"#
    );
    let host = FakeHost::new();
    let mut filter = Filter::configure(host.clone(), json.as_bytes(), true).unwrap();
    host.number_calls_per_kind();
    host.set_property("xds.route_name", "bridge");
    start(&host, &mut filter, 2, "alice");
    host.set_property("xds.route_name", "other");
    start(&host, &mut filter, 3, "alice");
    let (http, redis) = (host.http_calls().pop().unwrap(), host.redis_calls().pop().unwrap());
    assert_eq!(http.token, redis.token, "both calls carry the same token");
    // The bridge route's rule rejects; the global rule admits.
    answer_redis(&host, &mut filter, redis.token, &acquired(4));
    answer_http(&host, &mut filter, http.token, 200, &rejected(700));
    assert_eq!(host.end(3), Some(End::Resumed), "the Redis reply went to the Redis call's request");
    let (status, headers, _) = local_reply(&host, 2);
    assert_eq!((status, header(&headers, "x-ratelimited-by")), (429, Some("b")));
}

#[test]
fn a_lease_of_a_configuration_that_goes_away_is_settled_through_the_new_one() {
    let (host, mut old) = configure(BRIDGE, HOT, "");
    start(&host, &mut old, 2, "a");
    answer_http(&host, &mut old, last_token(&host), 200, b"*2\r\n:96\r\n:4\r\n");
    assert_eq!(start(&host, &mut old, 3, "b"), Action::Continue, "served from the lease: 2 of 4 used");
    let random = {
        let lease_call = host.http_calls()[0].body.clone();
        let body = String::from_utf8(lease_call).unwrap();
        body.split('/').nth(9).unwrap().to_string()
    };
    // A new configuration: a new root context (5), then the old one goes; the filter adopts what the old
    // one left during the old root's proxy_on_delete, where the old root is the effective context.
    host.add_root(5);
    let mut new = Filter::configure(host.clone(), format!(r#"{{{BRIDGE},"rules":[{HOT}]}}"#).as_bytes(), true).unwrap();
    new.own_root_context(5);
    let before = snapshot(&host);
    host.enter(ROOT);
    new.adopt(old.retire());
    host.delete_root(ROOT);
    assert_eq!(host.tick_period_of(5), TICK_MS, "the new root's own tick is set, not the old root's");
    assert!(host.http_calls().len() == 1, "nothing is sent from the old root's callback");
    host.advance(u64::from(TICK_MS));
    host.enter(5);
    new.on_tick();
    let call = host.http_calls().pop().unwrap();
    let body = String::from_utf8(call.body).unwrap();
    assert!(body.starts_with(&format!("EVALSHA/{}/", crate::script::GIVE_BACK.sha())), "{body}");
    let args: Vec<&str> = body.trim_end_matches(".raw").rsplit('/').take(4).collect();
    assert_eq!((args[3], args[2], args[1]), (random.as_str(), "4", "2"), "the member keeps the 2 permits used");
    assert_eq!(deltas(&host, &before), expect(&[("redis_calls", 1), ("lease_settlements", 1)]));
    answer_http(&host, &mut new, call.token, 200, b":1\r\n");
    assert!(new.give_backs.is_empty());
}

#[test]
fn in_the_degraded_mode_each_rule_counts_as_its_window_decides_and_a_refusal_returns_the_others_permits() {
    // a: 5 per user; b: 9 overall; one gateway. Redis fails: the local windows decide.
    let (host, mut filter) =
        configure(BRIDGE, A_AND_B, r#","failure_mode":"local","local_fallback":{"gateways":1,"probe_interval":"10s"}"#);
    start(&host, &mut filter, 2, "alice");
    answer_http(&host, &mut filter, last_token(&host), 503, b"");
    assert_eq!(host.end(2), Some(End::Resumed));
    let locally = [
        ("fallback_allowed", 1),
        ("redis_calls", 1),
        ("redis_errors", 1),
        ("rule.a.allowed", 1),
        ("rule.b.allowed", 1),
    ];
    assert_eq!(deltas(&host, &[]), expect(&locally), "admitted locally: allowed by each rule, not failed");
    // alice uses up her 5; b has 4 left.
    for context_id in 3..7 {
        assert_eq!(start(&host, &mut filter, context_id, "alice"), Action::Continue);
    }
    let before = snapshot(&host);
    assert_eq!(start(&host, &mut filter, 7, "alice"), Action::Pause);
    let (status, headers, _) = local_reply(&host, 7);
    assert_eq!((status, header(&headers, "x-ratelimited-by")), (429, Some("a")));
    assert_eq!(
        deltas(&host, &before),
        expect(&[("fallback_rejected", 1), ("rule.a.rejected", 1), ("rule.b.allowed", 1)]),
        "refused by a only: b counts as allowed, once"
    );
    // b's permit was returned: 4 more requests of other users fit in b's window of 9.
    for (context_id, user) in [(8, "bob"), (9, "carol"), (10, "dave"), (11, "erin")] {
        assert_eq!(start(&host, &mut filter, context_id, user), Action::Continue, "{user}");
    }
    start(&host, &mut filter, 12, "frank");
    assert_eq!(header(&local_reply(&host, 12).1, "x-ratelimited-by"), Some("b"), "b's window is full at 9");
}

/// A gRPC request of `user` (`content-type` as given) on `context_id`.
fn start_grpc(host: &FakeHost, filter: &mut Filter<FakeHost>, context_id: u32, user: &str, content_type: &str) {
    host.request(context_id, &[(":path", "/pkg.Svc/Call"), ("x-user", user), ("content-type", content_type)]);
    filter.on_request_headers(context_id);
}

/// The gRPC status, headers and body (grpc-message) of a local reply.
fn grpc_reply(host: &FakeHost, context_id: u32) -> (Option<u8>, Vec<(String, String)>, String) {
    match host.end(context_id) {
        Some(End::LocalReply { grpc_status, headers, body, .. }) => (grpc_status, headers, body),
        other => panic!("expected a local reply, got {other:?}"),
    }
}

#[test]
fn a_rejected_grpc_request_gets_resource_exhausted_with_the_wait_as_pushback() {
    let (host, mut filter) = configure(BRIDGE, PER_USER, "");
    start_grpc(&host, &mut filter, 2, "alice", "application/grpc+proto");
    answer_http(&host, &mut filter, last_token(&host), 200, &rejected(1503));
    let (grpc_status, headers, message) = grpc_reply(&host, 2);
    assert_eq!((grpc_status, message.as_str()), (Some(8), "rate limit exceeded"));
    assert_eq!(header(&headers, "grpc-retry-pushback-ms"), Some("1503"));
    assert_eq!(header(&headers, "retry-after"), Some("2"), "the rate limit headers travel as metadata");
    assert_eq!(header(&headers, "x-ratelimited-by"), Some("per-user"));
    assert_eq!(header(&headers, "content-type"), None, "Envoy sets application/grpc itself");

    // An HTTP request and a gRPC-Web one (Envoy's grpc_web filter translates those) keep the HTTP answer.
    for (context_id, content_type) in [(4, "application/json"), (6, "application/grpc-web+proto")] {
        start_grpc(&host, &mut filter, context_id, "alice", content_type);
        answer_http(&host, &mut filter, last_token(&host), 200, &rejected(1503));
        assert_eq!(grpc_reply(&host, context_id).0, None, "{content_type}");
        assert_eq!(local_reply(&host, context_id).0, 429);
        assert_eq!(header(&local_reply(&host, context_id).1, "grpc-retry-pushback-ms"), None);
    }
}

#[test]
fn grpc_statuses_are_configurable_and_failing_closed_answers_unavailable_without_pushback() {
    let (host, mut filter) =
        configure(BRIDGE, PER_USER, r#","failure_mode":"deny","grpc":{"rejected_status":"UNAVAILABLE"}"#);
    start_grpc(&host, &mut filter, 2, "alice", "application/grpc");
    answer_http(&host, &mut filter, last_token(&host), 200, &rejected(40));
    assert_eq!(grpc_reply(&host, 2).0, Some(14), "rejected_status: UNAVAILABLE");

    start_grpc(&host, &mut filter, 4, "bob", "application/grpc");
    answer_http(&host, &mut filter, last_token(&host), 200, b"-ERR boom\r\n");
    let (grpc_status, headers, message) = grpc_reply(&host, 4);
    assert_eq!((grpc_status, message.as_str()), (Some(14), "rate limiter unavailable"));
    assert_eq!(header(&headers, "grpc-retry-pushback-ms"), None, "no circuit decides when to come back");

    let (host, mut filter) =
        configure(BRIDGE, PER_USER, r#","grpc":{"rejected_status":13,"failure_status":"INTERNAL"}"#);
    start_grpc(&host, &mut filter, 2, "alice", "application/grpc");
    answer_http(&host, &mut filter, last_token(&host), 200, &rejected(40));
    assert_eq!(grpc_reply(&host, 2).0, Some(13));
}
