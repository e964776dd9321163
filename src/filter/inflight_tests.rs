//! In-flight rules through the fake host: a permit taken before the rate rules, a refusal answered at once,
//! the permit given back from the tick when the request ends, leases extended while it runs, a failed call
//! by the failure mode, and the permits of a request that ended before its reply.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing, clippy::panic)]

use crate::filter::{Action, Filter, DEADLINE_GRACE_MS, REJECTED_BY_PROPERTY, TICK_MS};
use crate::testing::{acquired, batch_reply, rejected, End, FakeHost, SKIPPED};

const CONFIG: &str = r#"{"redis":{"cluster":"webdis","timeout":200},"rules":[
    {"name":"per-user","limit_by":{"header":"x-user"},"rate":5,"interval":"1s"},
    {"name":"inflight","limit_by":{"header":"x-user"},"max_in_flight":1,"lease":"3s","retry_after":"2s"}]"#;

/// The replies of an ACQUIRE_BATCH carrying one permit's SEMAPHORE_ACQUIRE (a segment `2, 3` and its three
/// elements): taken (`free` left), refused (the earliest lease's end, a string).
const TAKEN: &[u8] = b"*5\r\n:2\r\n:3\r\n:1\r\n:0\r\n:-1\r\n";
const REFUSED: &[u8] = b"*5\r\n:2\r\n:3\r\n:0\r\n:0\r\n$13\r\n1764300000000\r\n";

/// A permit's own SEMAPHORE_ACQUIRE reply: taken (0 free after it), refused.
const PERMIT_TAKEN: &[u8] = b"*3\r\n:1\r\n:0\r\n:-1\r\n";
const PERMIT_REFUSED: &[u8] = b"*3\r\n:0\r\n:0\r\n$13\r\n1764300000000\r\n";

/// The reply of the one call carrying a request's permit and the rate acquire that rides with it.
fn joined(permit: &[u8], rate: &[u8]) -> Vec<u8> {
    batch_reply(&[permit, rate])
}

fn configure(extra: &str) -> (FakeHost, Filter<FakeHost>) {
    let host = FakeHost::new();
    let json = format!("{CONFIG}{extra}}}");
    let filter = Filter::configure(host.clone(), json.as_bytes(), false).unwrap();
    (host, filter)
}

fn start(host: &FakeHost, filter: &mut Filter<FakeHost>, context_id: u32) -> Action {
    host.request(context_id, &[(":path", "/"), ("x-user", "alice"), (":authority", "api.example")]);
    filter.on_request_headers(context_id)
}

/// Answers the last call with `body` and returns that call's body as text.
fn answer(host: &FakeHost, filter: &mut Filter<FakeHost>, body: &[u8]) -> String {
    let call = host.http_calls().pop().unwrap();
    host.http_reply(200, body);
    filter.on_http_call_response(call.token, 1, body.len());
    String::from_utf8_lossy(&call.body).into_owned()
}

fn calls_of(host: &FakeHost, script: &str) -> usize {
    host.http_calls().iter().filter(|call| String::from_utf8_lossy(&call.body).contains(script)).count()
}

#[test]
fn a_permit_and_the_rate_acquire_go_in_one_call_and_the_permit_is_given_back_from_the_tick_when_the_request_ends() {
    let (host, mut filter) = configure("");
    assert_eq!(start(&host, &mut filter, 2), Action::Pause);
    assert_eq!(host.http_calls().len(), 1);
    // One batch: the permit (`5`: it gates what follows; 3 keys, 5 arguments), then the rate acquire (`6`:
    // gated), whose reply resumes the request.
    let sent = answer(&host, &mut filter, &joined(PERMIT_TAKEN, &acquired(4)));
    assert!(sent.starts_with(&format!("EVALSHA/{}/8/", crate::script::ACQUIRE_BATCH.sha())), "{sent}");
    assert!(sent.contains("/2/5/3/5/") && sent.contains("/6/5/"), "{sent}");
    assert!(sent.contains("erl%3Ainflight%3Aalice") || sent.contains("erl:inflight:alice"), "{sent}");
    assert_eq!(host.end(2), Some(End::Resumed));
    // Its response shows both rules: the in-flight one without a window (draft-11's `w` and `t` are optional).
    filter.on_response_headers(2);
    let headers = host.response_headers(2);
    let value = |name: &str| headers.iter().find(|(key, _)| key == name).map(|(_, value)| value.clone());
    assert_eq!(value("ratelimit-policy").as_deref(), Some("\"per-user\";q=5;w=1, \"inflight\";q=1"));
    assert_eq!(value("ratelimit").as_deref(), Some("\"per-user\";r=4;t=1, \"inflight\";r=0"));
    assert_eq!(host.counter("edge_rate_limiter.inflight_admitted"), 1);
    assert_eq!(host.counter("edge_rate_limiter.allowed"), 1);
    assert_eq!(host.counter("edge_rate_limiter.rule.inflight.allowed"), 1);
    assert_eq!(host.counter("edge_rate_limiter.rule.per-user.allowed"), 1);
    // Running: the tick extends the lease every third of it (1 s), one call for the semaphore.
    host.clear_calls();
    host.advance(1_001);
    filter.on_tick();
    assert_eq!(calls_of(&host, "EVAL"), 1, "{:?}", host.http_calls());
    assert_eq!(host.counter("edge_rate_limiter.inflight_extended"), 1);
    answer(&host, &mut filter, b":1\r\n");
    // The request ends: its permit goes back from the next tick.
    host.clear_calls();
    filter.on_done(2);
    assert!(host.http_calls().is_empty(), "not before the tick");
    filter.on_tick();
    assert_eq!(host.http_calls().len(), 1);
    assert_eq!(host.counter("edge_rate_limiter.inflight_released"), 1);
    answer(&host, &mut filter, b":1\r\n");
    filter.on_tick();
    assert_eq!(host.tick_period(), 0, "nothing left: the tick stops");
}

#[test]
fn a_refusal_is_answered_at_once_with_the_rule_and_retry_after_and_asks_no_rate_rule() {
    let (host, mut filter) = configure("");
    assert_eq!(start(&host, &mut filter, 2), Action::Pause);
    // The permit refused: Redis skipped the rate acquire that rode with it.
    answer(&host, &mut filter, &joined(PERMIT_REFUSED, SKIPPED));
    match host.end(2) {
        Some(End::LocalReply { status, headers, .. }) => {
            assert_eq!(status, 429);
            assert!(headers.contains(&("x-ratelimited-by".into(), "inflight".into())), "{headers:?}");
            assert!(headers.contains(&("retry-after".into(), "2".into())), "{headers:?}");
            assert!(headers.contains(&("ratelimit-policy".into(), "\"inflight\";q=1".into())), "{headers:?}");
            assert!(headers.contains(&("ratelimit".into(), "\"inflight\";r=0".into())), "{headers:?}");
        }
        other => panic!("expected a 429, got {other:?}"),
    }
    assert_eq!(host.http_calls().len(), 1, "one call");
    assert_eq!(host.counter("edge_rate_limiter.redis_errors"), 0, "a skipped acquire is no error");
    assert_eq!(host.counter("edge_rate_limiter.late_given_back"), 0);
    assert_eq!(host.counter("edge_rate_limiter.inflight_rejected"), 1);
    assert_eq!(host.counter("edge_rate_limiter.rejected"), 1);
    assert_eq!(host.counter("edge_rate_limiter.rule.inflight.rejected"), 1, "the rule's own counter");
    assert_eq!(host.counter("edge_rate_limiter.rule.per-user.allowed"), 0, "the rate rule was not asked");
    assert!(host.filter_state(2).contains(&(REJECTED_BY_PROPERTY.into(), "inflight".into())));
}

#[test]
fn a_failed_call_follows_the_failure_mode() {
    let (host, mut filter) = configure(r#","failure_mode":"deny""#);
    start(&host, &mut filter, 2);
    answer(&host, &mut filter, b"-ERR boom\r\n");
    assert!(matches!(host.end(2), Some(End::LocalReply { status: 503, .. })), "{:?}", host.end(2));
    assert_eq!(host.counter("edge_rate_limiter.redis_errors"), 1);
    let (host, mut filter) = configure("");
    start(&host, &mut filter, 2);
    answer(&host, &mut filter, b"-ERR boom\r\n");
    answer(&host, &mut filter, &acquired(4));
    assert_eq!(host.end(2), Some(End::Resumed), "fail open: on without the permit");
    assert_eq!(host.counter("edge_rate_limiter.inflight_admitted"), 0);
}

#[test]
fn in_the_degraded_mode_each_gateway_admits_its_share_of_the_limit_and_counts_ends() {
    // 5 in flight over 2 gateways: 2 in this one. The first call fails: its permit and everything after it
    // are decided by the process's own count while the circuit is open (no call at all).
    let host = FakeHost::new();
    let json = r#"{"redis":{"cluster":"webdis","timeout":200},"rules":[
        {"name":"inflight","limit_by":{"header":"x-user"},"max_in_flight":5,"lease":"3s"}],
        "failure_mode":"local","local_fallback":{"gateways":2,"probe_interval":"1h"}}"#;
    let mut filter = Filter::configure(host.clone(), json.as_bytes(), false).unwrap();
    assert_eq!(start(&host, &mut filter, 2), Action::Pause);
    answer(&host, &mut filter, b"-ERR boom\r\n");
    assert_eq!(host.end(2), Some(End::Resumed), "decided by the local count");
    host.clear_calls();
    assert_eq!(start(&host, &mut filter, 3), Action::Continue, "the circuit is open: decided at once");
    assert_eq!(start(&host, &mut filter, 4), Action::Pause);
    assert!(matches!(host.end(4), Some(End::LocalReply { status: 429, .. })), "{:?}", host.end(4));
    assert!(host.http_calls().is_empty(), "no call while the circuit is open: {:?}", host.http_calls());
    // A request that ends gives its permit back to the count at once, never to Redis.
    filter.on_done(2);
    filter.on_tick();
    assert!(host.http_calls().is_empty(), "{:?}", host.http_calls());
    assert_eq!(host.counter("edge_rate_limiter.inflight_released"), 1);
    assert_eq!(start(&host, &mut filter, 5), Action::Continue);
    assert_eq!(host.counter("edge_rate_limiter.inflight_admitted"), 3);
    assert_eq!(host.counter("edge_rate_limiter.inflight_rejected"), 1);
    // Each request decided once, as the degraded mode's local decisions.
    assert_eq!(host.counter("edge_rate_limiter.fallback_allowed"), 3);
    assert_eq!(host.counter("edge_rate_limiter.fallback_rejected"), 1);
    assert_eq!(host.counter("edge_rate_limiter.allowed") + host.counter("edge_rate_limiter.rejected"), 0);
}

#[test]
fn a_request_only_in_flight_rules_apply_to_counts_as_allowed_or_rejected_once() {
    let host = FakeHost::new();
    let json = r#"{"redis":{"cluster":"webdis","timeout":200},"rules":[
        {"name":"inflight","limit_by":{"header":"x-user"},"max_in_flight":1,"lease":"3s"}]}"#;
    let mut filter = Filter::configure(host.clone(), json.as_bytes(), false).unwrap();
    start(&host, &mut filter, 2);
    answer(&host, &mut filter, TAKEN);
    assert_eq!(host.end(2), Some(End::Resumed));
    start(&host, &mut filter, 3);
    answer(&host, &mut filter, REFUSED);
    assert_eq!(host.counter("edge_rate_limiter.allowed"), 1, "admitted by its in-flight rule");
    assert_eq!(host.counter("edge_rate_limiter.rejected"), 1);
}

#[test]
fn a_request_that_ends_before_its_reply_gives_the_permit_back() {
    let (host, mut filter) = configure("");
    start(&host, &mut filter, 2);
    let acquire = host.http_calls().pop().unwrap();
    filter.on_done(2);
    host.clear_calls();
    filter.on_tick();
    assert!(host.http_calls().is_empty(), "the release waits for an acquire to ride with while the call is out");
    let both = joined(PERMIT_TAKEN, &acquired(4));
    host.http_reply(200, &both);
    filter.on_http_call_response(acquire.token, 1, both.len());
    assert_eq!(host.http_calls().len(), 1, "the rate acquire's member given back at once: {:?}", host.http_calls());
    assert_eq!(host.counter("edge_rate_limiter.late_given_back"), 2, "the member and the permit");
    host.advance(2 * u64::from(TICK_MS));
    filter.on_tick();
    assert_eq!(host.http_calls().len(), 2, "no acquire came: the permit released from the tick");
    assert!(String::from_utf8_lossy(&host.http_calls()[1].body).contains("alice"));
    assert_eq!(host.end(2), None, "the request is gone: nothing resumed or answered");
}

#[test]
fn a_call_never_answered_is_forgotten_and_the_tick_stops() {
    let (host, mut filter) = configure("");
    start(&host, &mut filter, 2);
    answer(&host, &mut filter, &joined(PERMIT_TAKEN, &acquired(4)));
    filter.on_done(2);
    filter.on_tick();
    assert_eq!(host.counter("edge_rate_limiter.inflight_released"), 1);
    host.advance(200 + DEADLINE_GRACE_MS + u64::from(TICK_MS) + 1);
    filter.on_tick();
    assert_eq!(host.counter("edge_rate_limiter.redis_errors"), 1, "the release's reply never came");
    assert_eq!(host.tick_period(), 0);
}

/// The call carrying a request's permit and rate acquire never answered: the request ends at its deadline
/// in the failure mode (open: on, without a permit), no call more; the call counts one error.
#[test]
fn an_acquire_never_answered_ends_the_wait_in_the_failure_mode_and_counts_one_error() {
    let (host, mut filter) = configure("");
    start(&host, &mut filter, 2);
    assert_eq!(host.http_calls().len(), 1);
    host.advance(200 + DEADLINE_GRACE_MS + 1);
    filter.on_tick();
    assert_eq!(host.end(2), Some(End::Resumed), "failed open");
    assert_eq!(host.http_calls().len(), 1, "no call more");
    assert_eq!(host.counter("edge_rate_limiter.inflight_admitted"), 0);
    host.advance(200 + DEADLINE_GRACE_MS);
    filter.on_tick();
    assert_eq!(host.counter("edge_rate_limiter.redis_errors"), 1, "the acquire's reply never came");
}

/// A request that ends while its permit's batch is on its way, whose reply "taken" comes after the
/// request's own wait would have ended: the permit is still given back (the orphan outlives the batch).
#[test]
fn a_permit_taken_by_a_late_reply_after_its_request_ended_is_given_back() {
    let (host, mut filter) = configure("");
    start(&host, &mut filter, 2);
    let acquire = host.http_calls().pop().unwrap();
    filter.on_done(2);
    host.advance(200 + DEADLINE_GRACE_MS + u64::from(TICK_MS) + 1);
    filter.on_tick();
    host.clear_calls();
    let both = joined(PERMIT_TAKEN, &acquired(4));
    host.http_reply(200, &both);
    filter.on_http_call_response(acquire.token, 1, both.len());
    filter.on_tick();
    assert_eq!(host.counter("edge_rate_limiter.late_given_back"), 2, "the permit and the rate acquire's member");
    assert_eq!(calls_of(&host, "alice"), 2, "given back and released once the late reply says they were taken");
}

/// The host refuses to send a request's permit: the request follows the failure mode from its own
/// callback's return (open: its rate rule is asked, and refused too, it goes on), never resumed from
/// within that callback.
#[test]
fn a_permit_the_host_refuses_to_send_is_decided_by_the_requests_own_callback() {
    let (host, mut filter) = configure("");
    host.refuse_calls(Some(crate::host::HostError::BadArgument));
    assert_eq!(start(&host, &mut filter, 2), Action::Continue);
    assert_eq!(host.end(2), None, "not resumed from within its own callback");
    assert_eq!(host.counter("edge_rate_limiter.inflight_admitted"), 0);
    assert_eq!(host.counter("edge_rate_limiter.redis_errors"), 2, "the permit's call and the rate rule's");
}

#[test]
fn acquires_wait_for_the_call_on_its_way_and_go_out_together() {
    let (host, mut filter) = configure("");
    start(&host, &mut filter, 2);
    assert_eq!(host.http_calls().len(), 1);
    for context_id in [3, 4] {
        host.request(context_id, &[(":path", "/"), ("x-user", "bob"), (":authority", "api.example")]);
        assert_eq!(filter.on_request_headers(context_id), Action::Pause);
    }
    assert_eq!(host.http_calls().len(), 1, "queued behind the call on its way");
    let first = host.http_calls().pop().unwrap();
    let reply = joined(PERMIT_TAKEN, &acquired(4));
    host.http_reply(200, &reply);
    filter.on_http_call_response(first.token, 1, reply.len());
    assert_eq!(host.end(2), Some(End::Resumed));
    // 3 and 4's permits and rate acquires leave together, in one batch: each request's permit (`5`) right
    // before its rate acquire (`6`), which runs only if that permit was taken.
    let calls: Vec<_> = host.http_calls().into_iter().skip(1).collect();
    assert_eq!(calls.len(), 1, "{calls:?}");
    let body = String::from_utf8_lossy(&calls[0].body).into_owned();
    assert!(body.starts_with(&format!("EVALSHA/{}/16/", crate::script::ACQUIRE_BATCH.sha())), "{body}");
    assert!(body.contains("/4/5/3/5/") && body.matches("/5/3/5/").count() == 2, "{body}");
    assert_eq!(body.matches("/6/5/8/").count(), 2, "{body}");
    // Bob's one permit: taken by 3, refused to 4 (whose rate acquire Redis skipped).
    let replies = batch_reply(&[PERMIT_TAKEN, &acquired(3), PERMIT_REFUSED, SKIPPED]);
    host.http_reply(200, &replies);
    filter.on_http_call_response(calls[0].token, 1, replies.len());
    assert_eq!(host.end(3), Some(End::Resumed));
    assert!(matches!(host.end(4), Some(End::LocalReply { status: 429, .. })), "{:?}", host.end(4));
    assert_eq!(host.counter("edge_rate_limiter.inflight_admitted"), 2);
    assert_eq!(host.counter("edge_rate_limiter.inflight_rejected"), 1);
    assert_eq!(host.counter("edge_rate_limiter.rule.per-user.allowed"), 2, "4's rate rule was not asked");
}

#[test]
fn a_configuration_push_ends_a_waiting_request_and_hands_running_ones_permits_over() {
    let (host, mut old) = configure(r#","failure_mode":"deny""#);
    // Request 2 runs with its permit; request 3 (another user) waits for its acquire's reply.
    start(&host, &mut old, 2);
    answer(&host, &mut old, &joined(PERMIT_TAKEN, &acquired(4)));
    host.request(3, &[(":path", "/"), ("x-user", "bob"), (":authority", "api.example")]);
    assert_eq!(old.on_request_headers(3), Action::Pause);
    let mut new = Filter::configure(host.clone(), format!("{CONFIG}}}").as_bytes(), false).unwrap();
    new.adopt(old.retire());
    assert!(matches!(host.end(3), Some(End::LocalReply { status: 503, .. })), "ended in the failure mode");
    // The new filter's tick gives back bob's unanswered permit at once, and alice's when her request ends.
    let before = host.http_calls().len();
    new.on_tick();
    assert_eq!(host.http_calls().len(), before + 1, "bob's permit released");
    host.advance(1_001);
    new.on_tick();
    assert_eq!(calls_of(&host, "EVAL/"), 2, "alice's lease extended by the new filter");
    new.on_done(2);
    new.on_tick();
    assert_eq!(host.counter("edge_rate_limiter.inflight_released"), 2);
}

#[test]
fn a_request_a_rate_rules_local_block_rejects_takes_no_permit() {
    let (host, mut filter) = configure("");
    assert_eq!(start(&host, &mut filter, 2), Action::Pause);
    // Redis rejects the rate rule: the oldest permit leaves in 500 ms; the limiter is blocked until then.
    answer(&host, &mut filter, &joined(PERMIT_TAKEN, &rejected(503)));
    assert!(matches!(host.end(2), Some(End::LocalReply { status: 429, .. })));
    let sent = host.http_calls().len();
    assert_eq!(start(&host, &mut filter, 3), Action::Pause);
    match host.end(3) {
        Some(End::LocalReply { status, headers, .. }) => {
            assert_eq!(status, 429);
            let by = headers.iter().find(|(name, _)| name == "x-ratelimited-by").map(|(_, value)| value.as_str());
            assert_eq!(by, Some("per-user"), "{headers:?}");
        }
        other => panic!("rejected at once, got {other:?}"),
    }
    assert_eq!(host.http_calls().len(), sent, "no call: no permit asked for");
    assert_eq!(host.counter("edge_rate_limiter.inflight_admitted"), 1, "only the first request's");
    assert_eq!(host.counter("edge_rate_limiter.rule.per-user.rejected"), 2);
    assert_eq!(host.counter("edge_rate_limiter.rejected"), 2);
}

/// A configuration push while a request's permit and rate acquire are on their way in one call, failing
/// open: the request is not left hanging. Its in-flight wait ends failed, then its rate flow is ended with
/// the other paused requests, in the failure mode (open: it goes on).
#[test]
fn a_configuration_push_ends_a_request_whose_permit_rode_with_its_rate_acquire() {
    let (host, mut old) = configure("");
    assert_eq!(start(&host, &mut old, 3), Action::Pause);
    let mut new = Filter::configure(host.clone(), format!("{CONFIG}}}").as_bytes(), false).unwrap();
    new.adopt(old.retire());
    assert_eq!(host.end(3), Some(End::Resumed), "failed open");
    assert_eq!(host.counter("edge_rate_limiter.inflight_admitted"), 0);
}

/// A permit given back while its destination has a call on its way rides with the next acquire call that
/// leaves for it (a `SEMAPHORE_RELEASE` segment, `8`, in that batch): no call of its own, counted released
/// once that call answered.
#[test]
fn a_permit_given_back_rides_with_the_next_acquire_of_its_destination() {
    let (host, mut filter) = configure("");
    start(&host, &mut filter, 2);
    answer(&host, &mut filter, &joined(PERMIT_TAKEN, &acquired(4)));
    assert_eq!(host.end(2), Some(End::Resumed));
    // Bob's call goes out; alice's request ends meanwhile; carol's waits for bob's call to land.
    host.request(3, &[(":path", "/"), ("x-user", "bob"), (":authority", "api.example")]);
    assert_eq!(filter.on_request_headers(3), Action::Pause);
    filter.on_done(2);
    filter.on_tick();
    host.request(4, &[(":path", "/"), ("x-user", "carol"), (":authority", "api.example")]);
    assert_eq!(filter.on_request_headers(4), Action::Pause);
    assert_eq!(host.http_calls().len(), 2, "alice's call and bob's: the release waits");
    assert_eq!(host.counter("edge_rate_limiter.inflight_released"), 0);
    answer(&host, &mut filter, &joined(PERMIT_TAKEN, &acquired(4)));
    let calls = host.http_calls();
    assert_eq!(calls.len(), 3, "carol's batch carries alice's release: {calls:?}");
    let body = String::from_utf8_lossy(&calls[2].body).into_owned();
    assert!(body.contains("alice") && body.contains("carol") && body.contains("/3/8/3/3/"), "{body}");
    let replies = batch_reply(&[b":1\r\n", PERMIT_TAKEN, &acquired(4)]);
    host.http_reply(200, &replies);
    filter.on_http_call_response(calls[2].token, 1, replies.len());
    assert_eq!(host.end(4), Some(End::Resumed));
    assert_eq!(host.counter("edge_rate_limiter.inflight_released"), 1);
    host.advance(2 * u64::from(TICK_MS));
    filter.on_tick();
    assert_eq!(host.http_calls().len(), 3, "no release call of its own");
}

/// Two in-flight rules ride with the rate acquire; the first refuses: Redis skips the second permit and the
/// acquire. The skipped permit was not asked: no failure (no error, no `failures` of its rule), the refusal
/// is the first rule's.
#[test]
fn a_permit_skipped_after_a_refusal_is_no_failure() {
    let host = FakeHost::new();
    let json = r#"{"redis":{"cluster":"webdis","timeout":200},"rules":[
        {"name":"per-user","limit_by":{"header":"x-user"},"rate":5,"interval":"1s"},
        {"name":"inflight","limit_by":{"header":"x-user"},"max_in_flight":1,"lease":"3s"},
        {"name":"total","limit_by":"global","max_in_flight":10,"lease":"3s"}]}"#;
    let mut filter = Filter::configure(host.clone(), json.as_bytes(), false).unwrap();
    assert_eq!(start(&host, &mut filter, 2), Action::Pause);
    let sent = answer(&host, &mut filter, &batch_reply(&[PERMIT_REFUSED, SKIPPED, SKIPPED]));
    assert_eq!(sent.matches("/5/3/5/").count(), 2, "both permits gate: {sent}");
    match host.end(2) {
        Some(End::LocalReply { status: 429, headers, .. }) => {
            assert!(headers.contains(&("x-ratelimited-by".into(), "inflight".into())), "{headers:?}");
        }
        other => panic!("expected a 429, got {other:?}"),
    }
    assert_eq!(host.counter("edge_rate_limiter.redis_errors"), 0);
    assert_eq!(host.counter("edge_rate_limiter.rule.total.failures"), 0);
    assert_eq!(host.counter("edge_rate_limiter.rule.inflight.rejected"), 1);
    filter.on_done(2);
    filter.on_tick();
    assert!(host.http_calls().len() == 1, "nothing to give back: {:?}", host.http_calls());
}

/// The host refuses the call carrying a shadow rule's permit and the rate acquire: the request is decided
/// from its own callback in the failure mode (open), not left waiting for a call that never left.
#[test]
fn a_refused_send_with_only_a_shadow_permit_is_decided_at_once() {
    let host = FakeHost::new();
    let json = r#"{"redis":{"cluster":"webdis","timeout":200},"rules":[
        {"name":"per-user","limit_by":{"header":"x-user"},"rate":5,"interval":"1s"},
        {"name":"inflight","limit_by":{"header":"x-user"},"max_in_flight":1,"lease":"3s","mode":"shadow"}]}"#;
    let mut filter = Filter::configure(host.clone(), json.as_bytes(), false).unwrap();
    host.refuse_calls(Some(crate::host::HostError::BadArgument));
    assert_eq!(start(&host, &mut filter, 2), Action::Continue, "failed open at once");
    assert_eq!(host.end(2), None, "not resumed from within its own callback");
}
