//! Request coalescing driven callback by callback through the fake host: who waits, what a batch carries,
//! each request's own decision from its part of the reply, and every way a batch ends (a reply with mixed
//! outcomes, a failed or timed-out call, `NOSCRIPT`, a client that leaves, a configuration push).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing, clippy::panic)]

use super::*;
use crate::script::{ACQUIRE, ACQUIRE_BATCH, GIVE_BACK};
use crate::testing::{acquired, batch_reply, End, FakeHost, ROOT};

/// The bridge with at most one acquire call in flight: the second request on waits.
const BRIDGE_ONE_IN_FLIGHT: &str = r#""redis":{"cluster":"webdis","timeout":200,"max_in_flight":1}"#;
const HOST_ONE_IN_FLIGHT: &str = r#""redis":{"transport":"host","cluster":"redis","timeout":200,"max_in_flight":1}"#;
const PER_USER: &str = r#"{"name":"per-user","limit_by":{"header":"x-user"},"rate":2,"interval":"1s"}"#;

fn configure(redis: &str, extra: &str) -> (FakeHost, Filter<FakeHost>) {
    let host = FakeHost::new();
    let json = format!(r#"{{{redis},"rules":[{PER_USER}]{extra}}}"#);
    let filter = Filter::configure(host.clone(), json.as_bytes(), true).unwrap();
    (host, filter)
}

fn start(host: &FakeHost, filter: &mut Filter<FakeHost>, context_id: u32, user: &str) -> Action {
    host.request(context_id, &[(":path", "/"), ("x-user", user)]);
    filter.on_request_headers(context_id)
}

fn counter(host: &FakeHost, name: &str) -> u64 {
    host.counter(&format!("{NAME}.{name}"))
}

/// The bodies of the HTTP calls made so far, as text.
fn bodies(host: &FakeHost) -> Vec<String> {
    host.http_calls().iter().map(|c| String::from_utf8_lossy(&c.body).into_owned()).collect()
}

fn answer_http(host: &FakeHost, filter: &mut Filter<FakeHost>, token: u32, status: u16, body: &[u8]) {
    host.http_reply(status, body);
    filter.on_http_call_response(token, 1, body.len());
}

fn status(host: &FakeHost, context_id: u32) -> Option<u16> {
    match host.end(context_id)? {
        End::Resumed => Some(200),
        End::LocalReply { status, .. } => Some(status),
    }
}

/// One request in flight, two waiting: the two go out in one batch when the first reply comes.
fn two_waiting(redis: &str, extra: &str) -> (FakeHost, Filter<FakeHost>) {
    let (host, mut filter) = configure(redis, extra);
    for (context_id, user) in [(2, "alice"), (3, "bob"), (4, "carol")] {
        assert_eq!(start(&host, &mut filter, context_id, user), Action::Pause);
    }
    (host, filter)
}

#[test]
fn on_an_idle_vm_a_request_goes_out_at_once_and_later_ones_wait_for_one_batch() {
    let (host, mut filter) = two_waiting(BRIDGE_ONE_IN_FLIGHT, "");
    let first = host.http_calls();
    assert_eq!(first.len(), 1, "bob and carol wait while alice's call is out");
    assert!(bodies(&host)[0].starts_with(&format!("EVALSHA/{}/", ACQUIRE.sha())));
    answer_http(&host, &mut filter, first[0].token, 200, &acquired(1));
    assert_eq!(status(&host, 2), Some(200));
    let calls = host.http_calls();
    assert_eq!(calls.len(), 2, "one batch for the two waiting requests");
    assert!(bodies(&host)[1].starts_with(&format!("EVALSHA/{}/10/", ACQUIRE_BATCH.sha())), "{}", bodies(&host)[1]);
    assert!(bodies(&host)[1].contains("bob") && bodies(&host)[1].contains("carol"));
    // bob allowed with 1 left, carol rejected with a 700 ms wait: each reads its own part.
    answer_http(&host, &mut filter, calls[1].token, 200, b"*4\r\n:1\r\n:1\r\n:1\r\n:-700\r\n");
    assert_eq!(status(&host, 3), Some(200));
    assert_eq!(status(&host, 4), Some(429));
    let Some(End::LocalReply { headers, .. }) = host.end(4) else { panic!() };
    assert!(headers.contains(&("retry-after".into(), "1".into())), "{headers:?}");
    assert_eq!(
        [counter(&host, "allowed"), counter(&host, "rejected"), counter(&host, "redis_calls")],
        [2, 1, 2],
        "three requests, two calls"
    );
    assert_eq!([counter(&host, "batches"), counter(&host, "batched_calls")], [1, 2]);
}

#[test]
fn max_batch_one_sends_every_call_alone() {
    let (host, mut filter) =
        configure(r#""redis":{"cluster":"webdis","timeout":200,"max_in_flight":1,"max_batch":1}"#, "");
    for (context_id, user) in [(2, "alice"), (3, "bob"), (4, "carol")] {
        assert_eq!(start(&host, &mut filter, context_id, user), Action::Pause);
    }
    assert_eq!(host.http_calls().len(), 3, "coalescing off: nothing waits");
    assert!(bodies(&host).iter().all(|b| b.starts_with(&format!("EVALSHA/{}/", ACQUIRE.sha()))));
}

#[test]
fn a_batch_with_an_error_on_one_requests_limiter_decides_the_others() {
    let (host, mut filter) = two_waiting(BRIDGE_ONE_IN_FLIGHT, r#","failure_mode":"deny""#);
    answer_http(&host, &mut filter, host.http_calls()[0].token, 200, &acquired(1));
    let batch = host.http_calls()[1].token;
    // webdis's form: integers as bulk strings; bob's limiter raised WRONGTYPE.
    answer_http(&host, &mut filter, batch, 200, b"*4\r\n$1\r\n3\r\n$9\r\nWRONGTYPE\r\n$1\r\n1\r\n$1\r\n0\r\n");
    assert_eq!(status(&host, 3), Some(503), "bob's rule failed: fail closed");
    assert_eq!(status(&host, 4), Some(200), "carol's part decided her request");
    assert_eq!(counter(&host, "redis_errors"), 1);
}

#[test]
fn a_failed_batch_call_sends_each_request_to_its_failure_mode_and_counts_one_failed_call() {
    let (host, mut filter) = two_waiting(BRIDGE_ONE_IN_FLIGHT, "");
    answer_http(&host, &mut filter, host.http_calls()[0].token, 200, &acquired(1));
    answer_http(&host, &mut filter, host.http_calls()[1].token, 503, b"");
    assert_eq!([status(&host, 3), status(&host, 4)], [Some(200), Some(200)], "fail open");
    assert_eq!([counter(&host, "failure_allowed"), counter(&host, "redis_errors")], [2, 1]);
}

#[test]
fn a_batch_never_answered_ends_each_request_within_its_own_timeout_from_arrival() {
    let (host, mut filter) = configure(BRIDGE_ONE_IN_FLIGHT, r#","failure_mode":"deny""#);
    assert_eq!(start(&host, &mut filter, 2, "alice"), Action::Pause);
    host.advance(150);
    assert_eq!(start(&host, &mut filter, 3, "bob"), Action::Pause);
    // Alice's call is answered late; bob's waits in the queue, then in a batch never answered.
    host.advance(40);
    answer_http(&host, &mut filter, host.http_calls()[0].token, 200, &acquired(1));
    assert_eq!(host.http_calls().len(), 2, "bob's call went out alone");
    host.advance(165);
    host.enter(ROOT);
    filter.on_tick();
    assert_eq!(status(&host, 3), None, "bob arrived 205 ms ago: within 200 ms + the grace");
    for _ in 0..10 {
        host.advance(u64::from(TICK_MS));
        host.enter(ROOT);
        filter.on_tick();
    }
    assert_eq!(status(&host, 3), Some(503), "ended by the deadline guard: fail closed");
    assert_eq!(filter.flows.len(), 0);
}

#[test]
fn a_client_that_leaves_is_dropped_from_the_queue_and_from_its_batch() {
    let (host, mut filter) = two_waiting(BRIDGE_ONE_IN_FLIGHT, "");
    assert_eq!(start(&host, &mut filter, 5, "dave"), Action::Pause);
    // Bob leaves while waiting: the batch carries carol and dave only.
    filter.on_done(3);
    answer_http(&host, &mut filter, host.http_calls()[0].token, 200, &acquired(1));
    let batch = bodies(&host)[1].clone();
    assert!(!batch.contains("bob") && batch.contains("carol") && batch.contains("dave"), "{batch}");
    // Carol leaves while her batch is out: dave still reads his part.
    filter.on_done(4);
    answer_http(&host, &mut filter, host.http_calls()[1].token, 200, b"*4\r\n:1\r\n:1\r\n:1\r\n:0\r\n");
    assert_eq!([status(&host, 3), status(&host, 4), status(&host, 5)], [None, None, Some(200)]);
    assert!(filter.flows.is_empty());
}

#[test]
fn noscript_for_a_batch_sends_it_again_by_source_once() {
    let (host, mut filter) = two_waiting(BRIDGE_ONE_IN_FLIGHT, "");
    answer_http(&host, &mut filter, host.http_calls()[0].token, 200, &acquired(1));
    answer_http(&host, &mut filter, host.http_calls()[1].token, 200, b"-NOSCRIPT No matching script.\r\n");
    let calls = host.http_calls();
    assert_eq!(calls.len(), 3);
    assert!(bodies(&host)[2].starts_with("EVAL/"), "the batch by source");
    answer_http(&host, &mut filter, calls[2].token, 200, b"*4\r\n:1\r\n:0\r\n:1\r\n:1\r\n");
    assert_eq!([status(&host, 3), status(&host, 4)], [Some(200), Some(200)]);
    assert_eq!([counter(&host, "redis_calls"), counter(&host, "redis_errors")], [3, 0]);
    assert_eq!(
        [counter(&host, "batches"), counter(&host, "batched_calls")],
        [1, 2],
        "the batch resent is counted once"
    );
}

#[test]
fn the_host_redis_build_batches_in_resp() {
    let (host, mut filter) = two_waiting(HOST_ONE_IN_FLIGHT, "");
    let calls = host.redis_calls();
    assert_eq!(calls.len(), 1);
    host.redis_reply(&acquired(1));
    filter.on_redis_call_response(calls[0].token, host_redis::STATUS_OK, 4);
    let calls = host.redis_calls();
    assert_eq!(calls.len(), 2);
    let query = String::from_utf8_lossy(&calls[1].query).into_owned();
    assert!(
        query.starts_with(&format!("*36\r\n$7\r\nEVALSHA\r\n$40\r\n{}\r\n$2\r\n10\r\n", ACQUIRE_BATCH.sha())),
        "{query}"
    );
    let reply = b"*4\r\n:1\r\n:1\r\n:1\r\n:-300\r\n";
    host.redis_reply(reply);
    filter.on_redis_call_response(calls[1].token, host_redis::STATUS_OK, reply.len());
    assert_eq!([status(&host, 3), status(&host, 4)], [Some(200), Some(429)]);
}

#[test]
fn a_configuration_push_with_a_batch_in_flight_ends_its_requests_and_drops_the_late_reply() {
    let (host, mut filter) = two_waiting(BRIDGE_ONE_IN_FLIGHT, "");
    answer_http(&host, &mut filter, host.http_calls()[0].token, 200, &acquired(1));
    let batch = host.http_calls()[1].token;
    let _retirement = filter.retire();
    assert_eq!([status(&host, 3), status(&host, 4)], [Some(200), Some(200)], "failure mode: allow");
    answer_http(&host, &mut filter, batch, 200, b"*4\r\n:1\r\n:1\r\n:1\r\n:1\r\n");
    assert!(filter.flows.is_empty());
    assert_eq!(counter(&host, "allowed"), 1, "the late reply decides nothing");
}

#[test]
fn a_batch_answered_after_one_of_its_requests_left_gives_back_what_that_request_took() {
    let (host, mut filter) = two_waiting(BRIDGE_ONE_IN_FLIGHT, "");
    answer_http(&host, &mut filter, host.http_calls()[0].token, 200, &acquired(1));
    let batch = host.http_calls()[1].token;
    filter.on_done(3);
    // Both admitted in Redis: carol goes on, bob's member (he left) goes back at once.
    answer_http(&host, &mut filter, batch, 200, b"*4\r\n:1\r\n:1\r\n:1\r\n:0\r\n");
    assert_eq!(status(&host, 4), Some(200));
    let give_backs: Vec<String> =
        bodies(&host).into_iter().filter(|b| b.starts_with(&format!("EVALSHA/{}/", GIVE_BACK.sha()))).collect();
    assert_eq!(give_backs.len(), 1, "{give_backs:?}");
    assert!(give_backs[0].contains("bob") && !give_backs[0].contains("carol"), "{}", give_backs[0]);
    assert_eq!(counter(&host, "late_given_back"), 1);
}

#[test]
fn a_batch_carrying_two_calls_of_a_request_that_left_gives_back_what_both_took() {
    // An enforced rule and a shadow rule: two calls of one request (shadow rules are checked apart); bob's
    // two go out in one batch once alice's calls landed.
    let shadow = r#"{"name":"shadow","limit_by":{"header":"x-user"},"rate":5,"interval":"1s","mode":"shadow"}"#;
    let host = FakeHost::new();
    let json = format!(r#"{{{BRIDGE_ONE_IN_FLIGHT},"rules":[{PER_USER},{shadow}]}}"#);
    let mut filter = Filter::configure(host.clone(), json.as_bytes(), true).unwrap();
    start(&host, &mut filter, 2, "alice");
    start(&host, &mut filter, 3, "bob");
    let first = host.http_calls()[0].token;
    answer_http(&host, &mut filter, first, 200, b"*4\r\n:1\r\n:1\r\n:1\r\n:4\r\n");
    answer_http(&host, &mut filter, host.http_calls()[1].token, 200, b"*4\r\n:1\r\n:1\r\n:1\r\n:4\r\n");
    let calls = host.http_calls();
    let batch = bodies(&host).pop().unwrap();
    assert!(batch.starts_with(&format!("EVALSHA/{}/", ACQUIRE_BATCH.sha())) && batch.contains("bob"), "{batch}");
    filter.on_done(3);
    answer_http(&host, &mut filter, calls[calls.len() - 1].token, 200, b"*4\r\n:1\r\n:1\r\n:1\r\n:4\r\n");
    let give_backs =
        bodies(&host).into_iter().filter(|b| b.starts_with(&format!("EVALSHA/{}/", GIVE_BACK.sha()))).count();
    assert_eq!(give_backs, 2, "bob's member of each limiter");
    assert_eq!(counter(&host, "late_given_back"), 2);
}

#[test]
fn noscript_for_a_batch_whose_request_left_resends_the_others_and_leaves_its_late_call_answered() {
    let (host, mut filter) = two_waiting(BRIDGE_ONE_IN_FLIGHT, "");
    answer_http(&host, &mut filter, host.http_calls()[0].token, 200, &acquired(1));
    filter.on_done(3);
    answer_http(&host, &mut filter, host.http_calls()[1].token, 200, b"-NOSCRIPT No matching script.\r\n");
    let resent = bodies(&host).pop().unwrap();
    assert!(resent.starts_with("EVAL/") && resent.contains("carol") && !resent.contains("bob"), "{resent}");
    // Carol's reply alone (the batch of one by source), taken: nothing of bob's to give back, nothing unanswered.
    answer_http(&host, &mut filter, host.http_calls().last().unwrap().token, 200, b"*2\r\n:1\r\n:1\r\n");
    assert_eq!(status(&host, 4), Some(200));
    assert!(!bodies(&host).iter().any(|b| b.starts_with(&format!("EVALSHA/{}/", GIVE_BACK.sha()))));
    host.advance(1_000);
    host.enter(ROOT);
    filter.on_tick();
    assert_eq!([counter(&host, "late_given_back"), counter(&host, "late_unanswered")], [0, 0]);
}

#[test]
fn a_waiting_call_goes_out_at_once_when_the_call_out_is_too_slow_for_its_deadline() {
    let (host, mut filter) = configure(BRIDGE_ONE_IN_FLIGHT, "");
    assert_eq!(start(&host, &mut filter, 2, "alice"), Action::Pause);
    host.advance(50);
    assert_eq!(start(&host, &mut filter, 3, "bob"), Action::Pause);
    assert_eq!(host.http_calls().len(), 1, "bob waits: alice's call is young");
    // Alice's call is still out 80 ms later: waiting for it and then a batch would take bob past
    // 50 + 200 + 10 ms, so his call goes out alone on the tick.
    for _ in 0..8 {
        host.advance(u64::from(TICK_MS));
        host.enter(ROOT);
        filter.on_tick();
    }
    assert_eq!(host.http_calls().len(), 2, "bob's call went out while alice's was still out");
    assert!(bodies(&host)[1].starts_with(&format!("EVALSHA/{}/", ACQUIRE.sha())));
    let calls = host.http_calls();
    answer_http(&host, &mut filter, calls[1].token, 200, &acquired(1));
    answer_http(&host, &mut filter, calls[0].token, 200, &acquired(1));
    assert_eq!([status(&host, 2), status(&host, 3)], [Some(200), Some(200)]);
}

#[test]
fn after_a_slow_round_trip_a_call_does_not_wait_for_a_batch_it_could_not_make_in_time() {
    let (host, mut filter) = configure(BRIDGE_ONE_IN_FLIGHT, "");
    assert_eq!(start(&host, &mut filter, 2, "alice"), Action::Pause);
    host.advance(120);
    answer_http(&host, &mut filter, host.http_calls()[0].token, 200, &acquired(1));
    // Redis took 120 ms: one call and a batch (240 ms) would not end within 210 ms.
    assert_eq!(start(&host, &mut filter, 3, "carol"), Action::Pause);
    assert_eq!(start(&host, &mut filter, 4, "dave"), Action::Pause);
    assert_eq!(host.http_calls().len(), 3, "dave went out at once, beside carol's call");
}

#[test]
fn a_requests_own_calls_do_not_wait_for_one_another() {
    // An enforced rule and a shadow rule: two calls of one request, out together on an idle VM.
    let shadow = r#"{"name":"trial","limit_by":{"header":"x-user"},"rate":1,"interval":"1s","mode":"shadow"}"#;
    let host = FakeHost::new();
    let json = format!(r#"{{{BRIDGE_ONE_IN_FLIGHT},"rules":[{PER_USER},{shadow}]}}"#);
    let mut filter = Filter::configure(host.clone(), json.as_bytes(), true).unwrap();
    assert_eq!(start(&host, &mut filter, 2, "alice"), Action::Pause);
    assert_eq!(host.http_calls().len(), 2, "the shadow rule's call went out with the enforced one");
    // A second request waits for a batch, both of its calls in the same one.
    assert_eq!(start(&host, &mut filter, 3, "bob"), Action::Pause);
    assert_eq!(host.http_calls().len(), 2);
    let calls = host.http_calls();
    answer_http(&host, &mut filter, calls[0].token, 200, &acquired(1));
    assert_eq!(host.http_calls().len(), 2, "alice's shadow call is still out (max_in_flight 1)");
    answer_http(&host, &mut filter, calls[1].token, 200, &acquired(0));
    assert_eq!(status(&host, 2), Some(200));
    let batch = bodies(&host);
    assert_eq!(batch.len(), 3, "bob's two calls in one batch");
    assert!(batch[2].starts_with(&format!("EVALSHA/{}/10/", ACQUIRE_BATCH.sha())), "{}", batch[2]);
}

/// The rate rule, and an in-flight rule on another key (`x-app`; a request without it takes no permit).
fn with_permits() -> (FakeHost, Filter<FakeHost>) {
    let host = FakeHost::new();
    let inflight = r#"{"name":"per-app","limit_by":{"header":"x-app"},"max_in_flight":2,"lease":"3s"}"#;
    let json = format!(r#"{{{BRIDGE_ONE_IN_FLIGHT},"rules":[{PER_USER},{inflight}]}}"#);
    let filter = Filter::configure(host.clone(), json.as_bytes(), true).unwrap();
    (host, filter)
}

/// Alice's acquire out while bob (with a permit to take) and carol (none) start; alice answered: the batch
/// of bob's permit, bob's rate acquire (riding with it) and carol's acquire is on its way.
fn permit_and_acquire_batched() -> (FakeHost, Filter<FakeHost>) {
    let (host, mut filter) = with_permits();
    assert_eq!(start(&host, &mut filter, 2, "alice"), Action::Pause);
    host.request(3, &[(":path", "/"), ("x-user", "bob"), ("x-app", "app1")]);
    assert_eq!(filter.on_request_headers(3), Action::Pause);
    assert_eq!(start(&host, &mut filter, 4, "carol"), Action::Pause);
    let first = host.http_calls();
    assert_eq!(first.len(), 1, "bob's permit and carol's acquire wait while alice's call is out");
    answer_http(&host, &mut filter, first[0].token, 200, &acquired(1));
    assert_eq!(status(&host, 2), Some(200));
    assert_eq!(host.http_calls().len(), 2, "one batch for the permit and the acquires");
    (host, filter)
}

/// In-flight permits share the lanes: while a call is out, a request's rate acquire waits with the permit
/// that rides with it, and both go out in one batch with another request's rate acquire (segments `5`, a
/// SEMAPHORE_ACQUIRE that gates, `6`, the rate acquire it gates, and `1`); each is answered from its own
/// part, the permit first.
#[test]
fn a_permit_waits_for_a_busy_destination_and_goes_in_one_batch_with_rate_acquires() {
    let (host, mut filter) = permit_and_acquire_batched();
    let calls = host.http_calls();
    let batch = &bodies(&host)[1];
    assert!(batch.starts_with(&format!("EVALSHA/{}/", ACQUIRE_BATCH.sha())), "{batch}");
    assert!(batch.contains("app1") && batch.contains("carol"), "{batch}");
    assert!(batch.contains("/3/5/3/5/"), "three segments, the first SEMAPHORE_ACQUIRE (3 keys, 5 args): {batch}");
    assert!(batch.contains("/6/5/") && batch.contains("/1/5/"), "bob's acquire gated, carol's not: {batch}");
    // The permit taken (1 free after it), bob's acquire admitted, carol rejected with a 700 ms wait.
    let permit: &[u8] = b"*3\r\n:1\r\n:1\r\n:-1\r\n";
    answer_http(&host, &mut filter, calls[1].token, 200, &batch_reply(&[permit, &acquired(0), b":-700\r\n"]));
    assert_eq!(status(&host, 4), Some(429));
    assert_eq!(status(&host, 3), Some(200), "bob holds his permit, his rate rule decided in the same call");
    assert_eq!(host.http_calls().len(), 2);
    assert_eq!(counter(&host, "inflight_admitted"), 1);
    assert_eq!([counter(&host, "batches"), counter(&host, "batched_calls"), counter(&host, "redis_calls")], [1, 3, 2]);
}

/// A permit's segment that fails in a batch (WRONGTYPE on its semaphore) is that permit's failure alone:
/// the gate stays open, so the rate acquire that rode with it runs; its request follows the failure mode
/// (open: on without the permit, decided by its rate acquire's part), the other member by its own part.
#[test]
fn a_permit_that_fails_in_a_batch_follows_the_failure_mode_and_the_other_member_is_decided() {
    let (host, mut filter) = permit_and_acquire_batched();
    let batch = host.http_calls()[1].token;
    let wrongtype: &[u8] = b"-WRONGTYPE Operation a key\r\n";
    answer_http(&host, &mut filter, batch, 200, &batch_reply(&[wrongtype, &acquired(0), b":-700\r\n"]));
    assert_eq!(status(&host, 4), Some(429), "carol: her own part");
    assert_eq!(status(&host, 3), Some(200), "bob: failed open, admitted by his rate acquire in the same call");
    assert_eq!(host.http_calls().len(), 2, "no call more");
    assert_eq!(counter(&host, "redis_errors"), 1);
    assert_eq!(counter(&host, "inflight_admitted"), 0);
}

/// `NOSCRIPT` for a batch with the permit of a request that has ended since: the batch goes again by
/// source without that permit (nothing was taken: no one would give it back), with the other's acquire.
#[test]
fn a_batch_sent_again_after_noscript_leaves_out_the_permit_of_a_request_gone() {
    let (host, mut filter) = permit_and_acquire_batched();
    filter.on_done(3);
    let batch = host.http_calls()[1].token;
    answer_http(&host, &mut filter, batch, 200, b"-NOSCRIPT No matching script.\r\n");
    let again = &bodies(&host)[2];
    assert!(again.starts_with("EVAL/"), "{again}");
    assert!(again.contains("carol") && !again.contains("app1"), "{again}");
}
