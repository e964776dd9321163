//! `hold_headers_for_body` through the fake host: a request whose rules read its body is held whole until
//! it is decided, so a rejected one never reaches the upstream; held headers that get no body (a host
//! without Envoy's `allow_on_headers_stop_iteration`) go on after a while, and the filter holds no more;
//! a body that came while the in-flight stage held the headers is read by the rate stage.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing, clippy::panic)]

use super::hold::HOLD_WITHOUT_BODY_MS;
use super::*;
use crate::testing::{acquired, rejected, End, FakeHost, ROOT};

const BRIDGE: &str = r#""redis":{"cluster":"webdis","timeout":200}"#;
const TOKENS: &str = r#"{"name":"tokens","limit_by":[{"header":"x-key"},{"body":"model"}],"rate":10000,"interval":"1m","cost":{"reserve":{"body":"openai","default":500},"settle":{"usage":"openai"}}}"#;
const INFLIGHT: &str = r#"{"name":"inflight","limit_by":{"header":"x-key"},"max_in_flight":4,"lease":"3s"}"#;
/// An ACQUIRE_BATCH's reply for one permit taken (segment `2, 3` and its three elements).
const TAKEN: &[u8] = b"*5\r\n:2\r\n:3\r\n:1\r\n:0\r\n:-1\r\n";

fn configure(rules: &[&str], hold: bool) -> (FakeHost, Filter<FakeHost>) {
    let host = FakeHost::new();
    let json = format!(r#"{{{BRIDGE},"rules":[{}],"hold_headers_for_body":{hold}}}"#, rules.join(","));
    let filter = Filter::configure(host.clone(), json.as_bytes(), true).unwrap();
    (host, filter)
}

/// Request `context_id`'s headers arrive, a body follows: what the filter answered.
fn headers(host: &FakeHost, filter: &mut Filter<FakeHost>, context_id: u32) -> Action {
    host.request(context_id, &[(":path", "/v1/chat/completions"), ("x-key", "alice")]);
    filter.on_request_start(context_id, true)
}

/// A chunk of request `context_id`'s body (`end`: its last): what the filter answered.
fn body(host: &FakeHost, filter: &mut Filter<FakeHost>, context_id: u32, chunk: &str, end: bool) -> Action {
    let size = host.request_body_chunk(context_id, chunk.as_bytes());
    filter.on_request_body(context_id, size, end)
}

fn answer(host: &FakeHost, filter: &mut Filter<FakeHost>, reply: &[u8]) -> String {
    let call = host.http_calls().pop().unwrap();
    host.http_reply(200, reply);
    filter.on_http_call_response(call.token, 1, reply.len());
    String::from_utf8_lossy(&call.body).into_owned()
}

fn tick_after(host: &FakeHost, filter: &mut Filter<FakeHost>, ms: u64) {
    host.advance(ms);
    host.enter(ROOT);
    filter.on_tick();
}

#[test]
fn a_held_request_is_decided_whole_and_a_rejected_one_never_goes_upstream() {
    let (host, mut filter) = configure(&[TOKENS], true);
    assert_eq!(headers(&host, &mut filter, 2), Action::Pause, "the headers are held with the body");
    assert_eq!(body(&host, &mut filter, 2, r#"{"model":"gpt-5","#, false), Action::Pause);
    assert_eq!(body(&host, &mut filter, 2, r#""max_tokens":300}"#, true), Action::Pause, "asking Redis");
    let call = answer(&host, &mut filter, &rejected(5_000));
    assert!(call.contains("erl%3Atokens%3Aalice%3Agpt%2D5"), "{call}");
    assert!(matches!(host.end(2), Some(End::LocalReply { status: 429, .. })), "{:?}", host.end(2));
    // Admitted: the headers and the body go on together, once decided (another model: gpt-5 is blocked
    // locally now).
    headers(&host, &mut filter, 4);
    body(&host, &mut filter, 4, r#"{"model":"gpt-4o","max_tokens":300}"#, true);
    answer(&host, &mut filter, &acquired(9_000));
    assert_eq!(host.end(4), Some(End::Resumed));
    // Without the option the headers go on at once (the upstream request starts before the decision).
    let (host, mut filter) = configure(&[TOKENS], false);
    assert_eq!(headers(&host, &mut filter, 2), Action::Continue);
}

#[test]
fn held_headers_without_a_body_go_on_and_the_filter_holds_no_more() {
    let (host, mut filter) = configure(&[TOKENS], true);
    assert_eq!(headers(&host, &mut filter, 2), Action::Pause);
    tick_after(&host, &mut filter, HOLD_WITHOUT_BODY_MS - 10);
    assert_eq!(host.end(2), None, "still held");
    tick_after(&host, &mut filter, 10);
    assert_eq!(host.end(2), Some(End::Resumed), "let go: the host holds the body with the headers");
    assert!(host.logs().iter().any(|(_, m)| m.contains("allow_on_headers_stop_iteration")), "{:?}", host.logs());
    // The body then comes as without the option, and is decided.
    host.headers_went_on(2);
    assert_eq!(body(&host, &mut filter, 2, r#"{"model":"gpt-5","max_tokens":300}"#, true), Action::Pause);
    assert!(answer(&host, &mut filter, &acquired(9_000)).contains("erl%3Atokens%3Aalice%3Agpt%2D5"));
    // Later requests are not held.
    assert_eq!(headers(&host, &mut filter, 4), Action::Continue);
}

#[test]
fn once_a_body_came_while_the_headers_were_held_a_slow_body_is_waited_for() {
    let (host, mut filter) = configure(&[TOKENS], true);
    headers(&host, &mut filter, 2);
    body(&host, &mut filter, 2, r#"{"model":"gpt-5","max_tokens":300}"#, true);
    answer(&host, &mut filter, &acquired(9_000));
    assert_eq!(headers(&host, &mut filter, 4), Action::Pause);
    tick_after(&host, &mut filter, 3 * HOLD_WITHOUT_BODY_MS);
    assert_eq!(host.end(4), None, "the host gives bodies to held headers: this one is only slow");
    assert_eq!(body(&host, &mut filter, 4, r#"{"model":"gpt-5"}"#, true), Action::Pause);
}

#[test]
fn a_body_that_came_while_the_permits_were_asked_is_read_by_the_rate_stage() {
    let (host, mut filter) = configure(&[INFLIGHT, TOKENS], true);
    assert_eq!(headers(&host, &mut filter, 2), Action::Pause, "asking for its permit");
    assert_eq!(body(&host, &mut filter, 2, r#"{"model":"gpt-5","max_tokens":300}"#, true), Action::Pause);
    answer(&host, &mut filter, TAKEN);
    let call = answer(&host, &mut filter, &acquired(9_000));
    assert!(call.contains("erl%3Atokens%3Aalice%3Agpt%2D5"), "the body was read: {call}");
    assert_eq!(host.end(2), Some(End::Resumed));
}

#[test]
fn held_headers_handed_to_a_new_configuration_still_go_on_without_a_body() {
    let (host, mut old) = configure(&[TOKENS], true);
    assert_eq!(headers(&host, &mut old, 2), Action::Pause);
    // A configuration push before any body came: the new filter's own tick lets the headers go.
    // A new root context (5), then the old one goes (its tick with it), as Envoy does.
    host.add_root(5);
    let json = format!(r#"{{{BRIDGE},"rules":[{TOKENS}],"hold_headers_for_body":true}}"#);
    let mut new = Filter::configure(host.clone(), json.as_bytes(), true).unwrap();
    new.own_root_context(5);
    host.enter(ROOT);
    new.adopt(old.retire());
    host.delete_root(ROOT);
    assert_ne!(host.tick_period_of(5), 0, "a tick for the held request, with no other request to start it");
    host.advance(HOLD_WITHOUT_BODY_MS);
    host.enter(5);
    new.on_tick();
    assert_eq!(host.end(2), Some(End::Resumed));
}
