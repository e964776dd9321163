//! The filter's histograms through the fake host ([`crate::testing::FakeHost`]): what each records, in which
//! unit, under which name, and nothing at all with `histograms: false`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing, clippy::panic)]

use super::*;
use crate::testing::{acquired, rejected, FakeHost, ROOT};

const PER_USER: &str = r#"{"name":"per-user","limit_by":{"header":"x-user"},"rate":2,"interval":"1s"}"#;
const TOKENS: &str = r#"{"name":"tokens","limit_by":{"header":"x-user"},"rate":10000,"interval":"1m","cost":{"reserve":400,"settle":{"response_header":"x-cost"}}}"#;
/// One call in flight per destination: the second request's call waits for a batch.
const ONE_IN_FLIGHT: &str = r#""redis":{"cluster":"webdis","timeout":200,"max_in_flight":1}"#;

fn configure(rules: &str, extra: &str) -> (FakeHost, Filter<FakeHost>) {
    let host = FakeHost::new();
    let json = format!(r#"{{{ONE_IN_FLIGHT},"rules":[{rules}]{extra}}}"#);
    let filter = Filter::configure(host.clone(), json.as_bytes(), true).unwrap();
    (host, filter)
}

fn start(host: &FakeHost, filter: &mut Filter<FakeHost>, context_id: u32, user: &str) -> Action {
    host.request(context_id, &[(":path", "/"), ("x-user", user)]);
    filter.on_request_headers(context_id)
}

fn answer(host: &FakeHost, filter: &mut Filter<FakeHost>, token: u32, reply: &[u8]) {
    host.http_reply(200, reply);
    filter.on_http_call_response(token, 1, reply.len());
}

fn histogram(host: &FakeHost, name: &str) -> Vec<u64> {
    host.histogram(&format!("{NAME}.{name}"))
}

#[test]
fn a_request_s_pause_is_recorded_in_microseconds_by_its_outcome() {
    let (host, mut filter) = configure(PER_USER, "");
    assert_eq!(start(&host, &mut filter, 2, "alice"), Action::Pause);
    host.advance_us(1_250);
    answer(&host, &mut filter, host.last_token().unwrap(), &acquired(1));
    assert_eq!(start(&host, &mut filter, 3, "bob"), Action::Pause);
    host.advance_us(700);
    answer(&host, &mut filter, host.last_token().unwrap(), &rejected(500));
    assert_eq!(histogram(&host, "outcome.allowed.paused_us"), [1_250]);
    assert_eq!(histogram(&host, "outcome.rejected.paused_us"), [700]);
    assert_eq!(histogram(&host, "redis_round_trip_us"), [1_250, 700], "each call's round trip");
    // Redis does not answer: the deadline guard fails the request open after `timeout` + the grace.
    assert_eq!(start(&host, &mut filter, 4, "carol"), Action::Pause);
    host.advance(200 + DEADLINE_GRACE_MS + u64::from(TICK_MS));
    host.enter(ROOT);
    filter.on_tick();
    let failed = histogram(&host, "outcome.failure_allowed.paused_us");
    assert_eq!(failed.len(), 1);
    assert!(failed[0] >= 200_000, "failed open after the timeout: {failed:?}");
    assert!(host.has_histogram(&format!("{NAME}.outcome.fallback_rejected.paused_us")), "every outcome's is defined");
}

#[test]
fn requests_that_wait_for_a_batch_are_paused_until_its_reply_and_the_batch_size_is_recorded() {
    let (host, mut filter) = configure(PER_USER, "");
    start(&host, &mut filter, 2, "alice");
    let first = host.last_token().unwrap();
    host.advance_us(100);
    start(&host, &mut filter, 3, "bob");
    host.advance_us(100);
    start(&host, &mut filter, 4, "carol");
    assert_eq!(host.http_calls().len(), 1, "bob's and carol's calls wait for the first to land");
    host.advance_us(300);
    answer(&host, &mut filter, first, &acquired(1));
    let batch = host.last_token().unwrap();
    assert_ne!(batch, first, "the batch went when the first call landed");
    assert_eq!(histogram(&host, "batch_calls"), [2]);
    host.advance_us(400);
    // Per segment: 1 (a bare integer reply) and the permits left.
    answer(&host, &mut filter, batch, b"*4\r\n:1\r\n:1\r\n:1\r\n:1\r\n");
    let paused = histogram(&host, "outcome.allowed.paused_us");
    assert_eq!(paused.len(), 3, "{paused:?}");
    assert_eq!(paused[0], 500, "alice: from her headers to her call's reply");
    assert_eq!(paused[1..], [800, 700], "bob and carol: from their headers to the batch's reply");
    assert_eq!(histogram(&host, "redis_round_trip_us"), [500, 400], "the call, then the batch");
}

#[test]
fn a_settled_reservation_records_the_percent_of_it_used_under_its_rule() {
    let (host, mut filter) = configure(TOKENS, "");
    for (context_id, cost) in [(2, "100"), (3, "400"), (4, "600")] {
        start(&host, &mut filter, context_id, "alice");
        answer(&host, &mut filter, host.last_token().unwrap(), &acquired(9_000));
        host.upstream_response(context_id, &[(":status", "200"), ("x-cost", cost)]);
        filter.on_response_headers(context_id);
        // The settle leaves from the tick, before the next request's acquire could carry it.
        host.advance(u64::from(crate::filter::TICK_MS));
        host.enter(crate::testing::ROOT);
        filter.on_tick();
    }
    assert_eq!(histogram(&host, "rule.tokens.settled_percent"), [25, 100, 150], "an excess is above 100");
}

#[test]
fn histograms_off_defines_none_and_records_nothing() {
    let (host, mut filter) = configure(TOKENS, r#","histograms":false"#);
    start(&host, &mut filter, 2, "alice");
    host.advance_us(900);
    answer(&host, &mut filter, host.last_token().unwrap(), &acquired(9_000));
    host.upstream_response(2, &[(":status", "200"), ("x-cost", "100")]);
    filter.on_response_headers(2);
    for name in
        ["outcome.allowed.paused_us", "redis_round_trip_us", "batch_calls", "waited_us", "rule.tokens.settled_percent"]
    {
        assert!(!host.has_histogram(&format!("{NAME}.{name}")), "{name} is not defined");
    }
    assert_eq!(host.counter(&format!("{NAME}.allowed")), 1, "the counters stay");
}
