//! Waiting for permits (`max_wait`) through the fake host: a rejected request asks again after its delay
//! and is admitted, one whose next try would come past `max_wait` is refused (at once, or after waiting),
//! `max_waiting` bounds the waiters, a client that leaves stops waiting, a gRPC call's `grpc-timeout`
//! bounds its wait, and a configuration push ends the waits in the failure mode.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing, clippy::panic)]

use crate::filter::{Action, Filter, TICK_MS};
use crate::testing::{acquired, rejected, End, FakeHost};

fn configure(rule_extra: &str, extra: &str) -> (FakeHost, Filter<FakeHost>) {
    let host = FakeHost::new();
    let json = format!(
        r#"{{"redis":{{"cluster":"webdis","timeout":200}},"rules":[
        {{"name":"per-user","limit_by":{{"header":"x-user"}},"rate":5,"interval":"1s","local_block_max":0{rule_extra}}}]{extra}}}"#
    );
    let filter = Filter::configure(host.clone(), json.as_bytes(), false).unwrap();
    (host, filter)
}

fn start(host: &FakeHost, filter: &mut Filter<FakeHost>, context_id: u32, headers: &[(&str, &str)]) -> Action {
    let mut all = vec![(":path", "/"), ("x-user", "alice"), (":authority", "api.example")];
    all.extend_from_slice(headers);
    host.request(context_id, &all);
    filter.on_request_headers(context_id)
}

/// Answers the last call with `body`.
fn answer(host: &FakeHost, filter: &mut Filter<FakeHost>, body: &[u8]) {
    let call = host.http_calls().pop().unwrap();
    host.http_reply(200, body);
    filter.on_http_call_response(call.token, 1, body.len());
}

/// Moves the clock `ms` forward, a tick at a time.
fn run_for(host: &FakeHost, filter: &mut Filter<FakeHost>, ms: u64) {
    for _ in 0..ms.div_ceil(u64::from(TICK_MS)) {
        host.advance(u64::from(TICK_MS));
        filter.on_tick();
    }
}

fn counter(host: &FakeHost, name: &str) -> u64 {
    host.counter(&format!("edge_rate_limiter.{name}"))
}

#[test]
fn a_rejected_request_asks_again_after_its_delay_and_is_admitted() {
    let (host, mut filter) = configure(r#","max_wait":"2s""#, "");
    assert_eq!(start(&host, &mut filter, 2, &[]), Action::Pause);
    answer(&host, &mut filter, &rejected(300));
    assert_eq!(host.end(2), None, "held, not answered");
    assert_eq!(host.http_calls().len(), 1);
    run_for(&host, &mut filter, 290);
    assert_eq!(host.http_calls().len(), 1, "never sooner than the delay");
    run_for(&host, &mut filter, 20);
    assert_eq!(host.http_calls().len(), 2, "asked again once the delay passed");
    answer(&host, &mut filter, &acquired(0));
    assert_eq!(host.end(2), Some(End::Resumed));
    assert_eq!((counter(&host, "waited_admitted"), counter(&host, "allowed"), counter(&host, "rejected")), (1, 1, 0));
    let waited = host.histogram("edge_rate_limiter.waited_us");
    assert!(matches!(waited.as_slice(), [us] if (300_000..=320_000).contains(us)), "{waited:?}");
    run_for(&host, &mut filter, 50);
    assert_eq!(host.tick_period(), 0, "nothing left: the tick stops");
}

#[test]
fn a_request_whose_next_try_would_come_past_max_wait_gets_the_usual_refusal() {
    let (host, mut filter) = configure(r#","max_wait":"500ms""#, "");
    start(&host, &mut filter, 2, &[]);
    answer(&host, &mut filter, &rejected(800));
    assert!(matches!(host.end(2), Some(End::LocalReply { status: 429, .. })), "refused at once: {:?}", host.end(2));
    assert_eq!(counter(&host, "waited_rejected"), 0, "it never waited");
    // Waits 300 ms, then would need 300 more: 600 > 500, refused with Retry-After.
    start(&host, &mut filter, 3, &[]);
    answer(&host, &mut filter, &rejected(300));
    run_for(&host, &mut filter, 310);
    answer(&host, &mut filter, &rejected(300));
    match host.end(3) {
        Some(End::LocalReply { status: 429, headers, .. }) => {
            assert!(headers.contains(&("retry-after".into(), "1".into())), "{headers:?}");
        }
        other => panic!("expected a 429, got {other:?}"),
    }
    assert_eq!((counter(&host, "waited_rejected"), counter(&host, "rejected")), (1, 2));
}

#[test]
fn at_most_max_waiting_requests_wait_and_the_next_is_refused_at_once() {
    let (host, mut filter) = configure(r#","max_wait":"2s","max_waiting":2"#, "");
    for context_id in [2, 3, 4] {
        start(&host, &mut filter, context_id, &[]);
        answer(&host, &mut filter, &rejected(300));
    }
    assert_eq!(host.end(2), None);
    assert_eq!(host.end(3), None);
    assert!(matches!(host.end(4), Some(End::LocalReply { status: 429, .. })), "{:?}", host.end(4));
    assert_eq!(counter(&host, "wait_queue_full"), 1);
}

#[test]
fn a_client_that_leaves_stops_waiting() {
    let (host, mut filter) = configure(r#","max_wait":"2s""#, "");
    start(&host, &mut filter, 2, &[]);
    answer(&host, &mut filter, &rejected(300));
    filter.on_done(2);
    run_for(&host, &mut filter, 400);
    assert_eq!(host.http_calls().len(), 1, "no try for a request gone");
    assert_eq!(host.tick_period(), 0);
}

#[test]
fn a_grpc_call_never_waits_past_its_grpc_timeout() {
    let (host, mut filter) = configure(r#","max_wait":"2s""#, "");
    let grpc = [("content-type", "application/grpc"), ("grpc-timeout", "200m")];
    start(&host, &mut filter, 2, &grpc);
    answer(&host, &mut filter, &rejected(300));
    assert!(matches!(host.end(2), Some(End::LocalReply { .. })), "300 ms > its 200 ms: refused at once");
    start(&host, &mut filter, 3, &[("content-type", "application/grpc"), ("grpc-timeout", "1S")]);
    answer(&host, &mut filter, &rejected(300));
    assert_eq!(host.end(3), None, "within its second: waits");
}

#[test]
fn a_configuration_push_ends_the_waits_in_the_failure_mode() {
    let (host, mut old) = configure(r#","max_wait":"2s""#, r#","failure_mode":"deny""#);
    start(&host, &mut old, 2, &[]);
    answer(&host, &mut old, &rejected(300));
    let (_, new_filter) = configure("", "");
    let mut new = new_filter;
    new.adopt(old.retire());
    assert!(matches!(host.end(2), Some(End::LocalReply { status: 503, .. })), "{:?}", host.end(2));
    assert_eq!(counter(&host, "failure_denied"), 1);
}

#[test]
fn a_configuration_with_max_wait_and_in_flight_rules_is_refused_naming_the_field() {
    let host = FakeHost::new();
    let json = r#"{"redis":{"cluster":"webdis"},"rules":[
        {"name":"per-user","limit_by":{"header":"x-user"},"rate":5,"interval":"1s","max_wait":"1s"},
        {"name":"inflight","limit_by":{"header":"x-user"},"max_in_flight":1}]}"#;
    let Err(error) = Filter::configure(host, json.as_bytes(), false) else { panic!("accepted") };
    let error = error.to_string();
    assert!(error.contains("rules[0].max_wait"), "{error}");
}

/// Requests of one key wait in arrival order within a VM: a newer request on a limiter an older one waits
/// on does not ask Redis before it, but waits behind it and asks right after it.
#[test]
fn a_newer_request_on_the_limiter_an_older_one_waits_on_asks_after_it() {
    let (host, mut filter) = configure(r#","max_wait":"2s""#, "");
    start(&host, &mut filter, 2, &[]);
    answer(&host, &mut filter, &rejected(300));
    assert_eq!(start(&host, &mut filter, 3, &[]), Action::Pause);
    assert_eq!(host.http_calls().len(), 1, "the newer one waits behind, without a call");
    run_for(&host, &mut filter, 310);
    let calls = host.http_calls();
    assert_eq!(calls.len(), 2, "one call: the older first, the newer queued behind it for the next batch");
    // The older one's call lands: admitted; the newer's goes out after it.
    answer(&host, &mut filter, &acquired(0));
    assert_eq!(host.end(2), Some(End::Resumed));
    assert_eq!(host.end(3), None);
    assert_eq!(host.http_calls().len(), 3);
    answer(&host, &mut filter, &acquired(0));
    assert_eq!(host.end(3), Some(End::Resumed));
    assert_eq!(counter(&host, "waited_admitted"), 2);
}

/// A rule with `max_wait` keeps no local block: its rejected requests wait instead of being answered 429 by
/// the block; one that sets `local_block_max` too is refused, naming the field.
#[test]
fn a_rule_with_max_wait_keeps_no_local_block() {
    let host = FakeHost::new();
    let json = r#"{"redis":{"cluster":"webdis"},"rules":[
        {"name":"per-user","limit_by":{"header":"x-user"},"rate":5,"interval":"1s","max_wait":"1s","local_block_max":"2s"}]}"#;
    let Err(error) = Filter::configure(host, json.as_bytes(), false) else { panic!("accepted") };
    assert!(error.to_string().contains("rules[0].local_block_max"), "{error}");
    let host = FakeHost::new();
    let json = r#"{"redis":{"cluster":"webdis"},"rules":[
        {"name":"per-user","limit_by":{"header":"x-user"},"rate":5,"interval":"1s","max_wait":"2s"}]}"#;
    let mut filter = Filter::configure(host.clone(), json.as_bytes(), false).unwrap();
    start(&host, &mut filter, 2, &[]);
    answer(&host, &mut filter, &rejected(300));
    start(&host, &mut filter, 3, &[("x-user", "alice")]);
    assert_eq!(host.end(3), None, "not answered by a local block: it waits");
}

/// A request that another rule rejects too, one without `max_wait`, is refused at once: that rule does
/// not wait.
#[test]
fn a_request_another_rule_rejects_at_once_does_not_wait() {
    let host = FakeHost::new();
    let json = r#"{"redis":{"cluster":"webdis","timeout":200},"rules":[
        {"name":"per-user","limit_by":{"header":"x-user"},"rate":5,"interval":"1s","max_wait":"2s"},
        {"name":"per-app","limit_by":{"header":"x-user"},"rate":5,"interval":"1s","local_block_max":0}]}"#;
    let mut filter = Filter::configure(host.clone(), json.as_bytes(), false).unwrap();
    start(&host, &mut filter, 2, &[]);
    // ACQUIRE_ALL's reply: both limiters rejected (code 0 and the delay, per limiter: 8 integers each).
    let both = b"*16\r\n:0\r\n:300\r\n:0\r\n:5\r\n:1000\r\n:0\r\n:0\r\n:0\r\n:0\r\n:300\r\n:0\r\n:5\r\n:1000\r\n:0\r\n:0\r\n:0\r\n";
    answer(&host, &mut filter, both);
    assert!(matches!(host.end(2), Some(End::LocalReply { status: 429, .. })), "{:?}", host.end(2));
    assert_eq!(counter(&host, "waited_rejected") + counter(&host, "waited_admitted"), 0);
}

#[test]
fn a_configuration_with_max_wait_and_a_lease_rule_is_refused_naming_the_field() {
    let host = FakeHost::new();
    let json = r#"{"redis":{"cluster":"webdis"},"rules":[
        {"name":"global","limit_by":"global","rate":1000,"interval":"1s","lease":{"max_permits":10,"max_age":"50ms"}},
        {"name":"per-user","limit_by":{"header":"x-user"},"rate":5,"interval":"1s","max_wait":"1s"}]}"#;
    let Err(error) = Filter::configure(host, json.as_bytes(), false) else { panic!("accepted") };
    assert!(error.to_string().contains("rules[1].max_wait"), "{error}");
}
