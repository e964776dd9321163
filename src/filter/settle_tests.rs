//! Reserve, then settle, through the fake host: the reservation's member, the settle call each way of
//! reading the cost sends (and when), and the reservations kept as they are.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing, clippy::panic)]

use super::*;
use crate::testing::{acquired, rejected, FakeHost, ROOT};

const BRIDGE: &str = r#""redis":{"cluster":"webdis","timeout":200}"#;
/// The rule's rate (tokens per minute), and when [`allowed`]'s requests are acquired (the fake host's
/// start, ms since the epoch).
const RATE: u64 = 10_000;
const ALLOWED_AT: u64 = 1_700_000_000_000;

fn configure(cost: &str) -> (FakeHost, Filter<FakeHost>) {
    let host = FakeHost::new();
    let rule =
        format!(r#"{{"name":"tokens","limit_by":{{"header":"x-key"}},"rate":10000,"interval":"1m","cost":{cost}}}"#);
    let json = format!(r#"{{{BRIDGE},"rules":[{rule}]}}"#);
    let filter = Filter::configure(host.clone(), json.as_bytes(), true).unwrap();
    (host, filter)
}

/// Request `context_id` of key `key`, allowed by Redis: the random bytes of the member it acquired.
fn allowed(host: &FakeHost, filter: &mut Filter<FakeHost>, context_id: u32, key: &str) -> String {
    host.request(context_id, &[(":path", "/v1/chat/completions"), ("x-key", key)]);
    assert_eq!(filter.on_request_headers(context_id), Action::Pause);
    let call = host.http_calls().pop().unwrap();
    answer(host, filter, call.token, &acquired(9_000));
    let body = String::from_utf8(call.body).unwrap();
    body.split('/').nth(9).unwrap().replace("%2D", "-")
}

fn answer(host: &FakeHost, filter: &mut Filter<FakeHost>, token: u32, reply: &[u8]) {
    host.http_reply(200, reply);
    filter.on_http_call_response(token, 1, reply.len());
}

/// The arguments of each GIVE_BACK sent so far: random, granted, used, early, renamed, then the score,
/// rate and type of the member as the acquire wrote it (`EVALSHA/sha/5/` and the five keys before them).
fn give_back_args(host: &FakeHost) -> Vec<Vec<String>> {
    host.http_calls()
        .into_iter()
        .map(|call| String::from_utf8(call.body).unwrap())
        .filter(|body| body.starts_with(&format!("EVALSHA/{}/", crate::script::GIVE_BACK.sha())))
        .map(|body| body.trim_end_matches(".raw").split('/').skip(8).map(|arg| arg.replace("%2D", "-")).collect())
        .collect()
}

/// The settle calls sent so far: (random, granted, used, renamed) of each GIVE_BACK.
fn settle_calls(host: &FakeHost) -> Vec<[String; 4]> {
    give_back_args(host)
        .into_iter()
        .map(|args| [args[0].clone(), args[1].clone(), args[2].clone(), args[4].clone()])
        .collect()
}

fn tick(host: &FakeHost, filter: &mut Filter<FakeHost>) {
    host.advance(u64::from(TICK_MS));
    host.enter(ROOT);
    filter.on_tick();
}

fn respond(host: &FakeHost, filter: &mut Filter<FakeHost>, context_id: u32, headers: &[(&str, &str)], chunks: &[&str]) {
    host.upstream_response(context_id, headers);
    filter.on_response_headers(context_id);
    for (index, chunk) in chunks.iter().enumerate() {
        host.body_chunk(context_id, chunk.as_bytes());
        filter.on_response_body(context_id, chunk.len(), index + 1 == chunks.len());
    }
}

#[test]
fn a_reservation_settles_to_the_cost_in_a_response_header_from_the_root_context_tick() {
    let (host, mut filter) = configure(r#"{"reserve":400,"settle":{"response_header":"x-cost"}}"#);
    let random = allowed(&host, &mut filter, 2, "alice");
    assert!(random.starts_with("-r") && random.len() == 16, "a reservation's member: {random}");
    respond(&host, &mut filter, 2, &[(":status", "200"), ("x-cost", " 123 ")], &[]);
    assert!(settle_calls(&host).is_empty(), "sent from the tick, not from the request's context");
    tick(&host, &mut filter);
    let renamed = format!("-s{}", &random[2..]);
    assert_eq!(settle_calls(&host), [[random, "400".into(), "123".into(), renamed]]);
    // On the gateway's clock the member's score, rate and type go with it: Redis reads neither back.
    assert_eq!(give_back_args(&host)[0][5..], [ALLOWED_AT.to_string(), RATE.to_string(), "0".into()]);
    assert_eq!(host.counter(&format!("{NAME}.settlements")), 1);
}

#[test]
fn a_reservation_settles_to_the_usage_of_a_json_body_read_chunk_by_chunk() {
    let (host, mut filter) = configure(r#"{"reserve":4000,"settle":{"usage":"openai"}}"#);
    let random = allowed(&host, &mut filter, 2, "alice");
    let body = r#"{"id":"c1","choices":[{"message":{"content":"hi"}}],"usage":{"prompt_tokens":12,"completion_tokens":30,"total_tokens":42}}"#;
    let (a, b) = body.split_at(50);
    respond(&host, &mut filter, 2, &[(":status", "200"), ("content-type", "application/json")], &[a, b]);
    tick(&host, &mut filter);
    let calls = settle_calls(&host);
    assert_eq!((calls.len(), calls[0][0].as_str(), calls[0][2].as_str()), (1, random.as_str(), "42"));
}

#[test]
fn a_stream_cut_short_settles_to_what_it_reported_and_one_without_usage_keeps_its_reservation() {
    let (host, mut filter) = configure(r#"{"reserve":4000,"settle":{"usage":"anthropic"}}"#);
    allowed(&host, &mut filter, 2, "alice");
    let start = "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":25,\"output_tokens\":1}}}\n\n";
    host.upstream_response(2, &[(":status", "200"), ("content-type", "text/event-stream")]);
    filter.on_response_headers(2);
    host.body_chunk(2, start.as_bytes());
    filter.on_response_body(2, start.len(), false);
    filter.on_done(2); // the client left, or the upstream reset the stream
    tick(&host, &mut filter);
    assert_eq!(settle_calls(&host)[0][2], "26", "input 25 + output 1 so far");

    allowed(&host, &mut filter, 4, "bob");
    respond(&host, &mut filter, 4, &[(":status", "200"), ("content-type", "application/json")], &["{\"error\":1}"]);
    tick(&host, &mut filter);
    assert_eq!(settle_calls(&host).len(), 1, "no usage: no call");
    assert_eq!(host.counter(&format!("{NAME}.settled_without_usage")), 1);
}

#[test]
fn a_request_the_upstream_never_answered_settles_to_zero_and_a_timeout_keeps_its_reservation() {
    let (host, mut filter) = configure(r#"{"reserve":4000,"settle":{"usage":"openai"}}"#);
    let random = allowed(&host, &mut filter, 2, "alice");
    // Envoy's own 503: the connection to the upstream failed.
    host.set_property("response.code_details", "upstream_reset_before_response_started{connection_failure}");
    respond(&host, &mut filter, 2, &[(":status", "503"), ("content-type", "text/plain")], &["upstream connect error"]);
    tick(&host, &mut filter);
    let calls = settle_calls(&host);
    assert_eq!((calls.len(), calls[0][0].as_str(), calls[0][2].as_str()), (1, random.as_str(), "0"), "all of it back");
    assert_eq!(host.counter(&format!("{NAME}.settled_unanswered")), 1);
    // The upstream timed out: it had the request and may have done the work.
    allowed(&host, &mut filter, 4, "bob");
    host.set_property("response.code_details", "upstream_response_timeout");
    respond(
        &host,
        &mut filter,
        4,
        &[(":status", "504"), ("content-type", "text/plain")],
        &["upstream request timeout"],
    );
    tick(&host, &mut filter);
    assert_eq!(settle_calls(&host).len(), 1, "kept as reserved");
    assert_eq!(host.counter(&format!("{NAME}.settled_without_usage")), 1);
    // The upstream's own answer (an error without usage too) keeps its reservation.
    allowed(&host, &mut filter, 6, "carol");
    host.set_property("response.code_details", "via_upstream");
    respond(&host, &mut filter, 6, &[(":status", "503"), ("content-type", "application/json")], &["{\"error\":1}"]);
    tick(&host, &mut filter);
    assert_eq!(host.counter(&format!("{NAME}.settled_without_usage")), 2);
    assert_eq!(host.counter(&format!("{NAME}.settled_unanswered")), 1);
}

#[test]
fn a_rejected_request_or_a_rule_without_cost_settles_nothing() {
    let (host, mut filter) = configure(r#"{"reserve":400,"settle":{"response_header":"x-cost"}}"#);
    host.request(2, &[(":path", "/"), ("x-key", "alice")]);
    filter.on_request_headers(2);
    answer(&host, &mut filter, host.last_token().unwrap(), &rejected(500));
    filter.on_done(2);
    tick(&host, &mut filter);
    assert!(settle_calls(&host).is_empty());
    assert!(filter.settling.is_empty());
}

/// The permits argument (ARGV 3) of the last acquire call.
fn acquired_permits(host: &FakeHost) -> String {
    let body = String::from_utf8(host.http_calls().pop().unwrap().body).unwrap();
    body.split('/').nth(10).unwrap().to_string()
}

#[test]
fn a_reservation_sized_by_a_request_header_is_clamped_to_the_rate() {
    let (host, mut filter) =
        configure(r#"{"reserve":{"header":"x-max-tokens","default":500},"settle":{"usage":"openai"}}"#);
    for (context_id, asked, expected) in
        [(2, Some("1200"), "1200"), (4, None, "500"), (6, Some("999999"), "10000"), (8, Some("lots"), "500")]
    {
        let mut headers = vec![(":path", "/"), ("x-key", "alice")];
        headers.extend(asked.map(|value| ("x-max-tokens", value)));
        host.request(context_id, &headers);
        filter.on_request_headers(context_id);
        assert_eq!(acquired_permits(&host), expected, "{asked:?}");
        answer(&host, &mut filter, host.last_token().unwrap(), &acquired(100));
    }
}

#[test]
fn rates_by_picks_the_rate_from_another_header_than_the_key() {
    let host = FakeHost::new();
    let rule = r#"{"name":"plan","limit_by":{"header":"x-key"},"rate":10,"interval":"1m","rates_by":{"header":"x-plan"},"rates_by_value":[{"values":["gold"],"rate":1000}]}"#;
    let mut filter =
        Filter::configure(host.clone(), format!(r#"{{{BRIDGE},"rules":[{rule}]}}"#).as_bytes(), true).unwrap();
    for (context_id, plan, rate) in [(2, "gold", "1000"), (4, "free", "10")] {
        host.request(context_id, &[(":path", "/"), ("x-key", "alice"), ("x-plan", plan)]);
        filter.on_request_headers(context_id);
        let body = String::from_utf8(host.http_calls().pop().unwrap().body).unwrap();
        assert_eq!(body.split('/').nth(11), Some(rate), "{plan}: {body}");
        assert!(body.contains("/erl%3Aplan%3Aalice/"), "one limiter per key, whatever the plan: {body}");
        answer(&host, &mut filter, host.last_token().unwrap(), &acquired(5));
    }
}

#[test]
fn a_property_sizes_the_reservation_and_picks_the_rate() {
    let host = FakeHost::new();
    // What an authentication filter set: the caller's plan, and the max_tokens its request asked for.
    host.set_property("metadata.filter_metadata.envoy.filters.http.jwt_authn.plan", "gold");
    host.set_property("filter_state.max_tokens", "2500");
    let rule = r#"{"name":"tokens","limit_by":{"header":"x-key"},"rate":10000,"interval":"1m",
        "rates_by":{"property":["metadata","filter_metadata","envoy.filters.http.jwt_authn","plan"]},
        "rates_by_value":[{"values":["gold"],"rate":50000}],
        "cost":{"reserve":{"property":"filter_state.max_tokens","default":100},"settle":{"usage":"openai"}}}"#;
    let mut filter =
        Filter::configure(host.clone(), format!(r#"{{{BRIDGE},"rules":[{rule}]}}"#).as_bytes(), true).unwrap();
    host.request(2, &[(":path", "/"), ("x-key", "alice")]);
    filter.on_request_headers(2);
    let body = String::from_utf8(host.http_calls().pop().unwrap().body).unwrap();
    let args: Vec<&str> = body.split('/').collect();
    assert_eq!((args[10], args[11]), ("2500", "50000"), "permits from the property, the gold plan's rate: {body}");
}

#[test]
fn a_reservation_whose_configuration_is_replaced_mid_response_settles_through_the_new_filter() {
    let (host, mut old) = configure(r#"{"reserve":400,"settle":{"response_header":"x-cost"}}"#);
    let random = allowed(&host, &mut old, 2, "alice");
    // A configuration push: a new filter for the root context; the response's callbacks now reach it.
    let rule = r#"{"name":"tokens","limit_by":{"header":"x-key"},"rate":10000,"interval":"1m","cost":{"reserve":400,"settle":{"response_header":"x-cost"}}}"#;
    let json = format!(r#"{{{BRIDGE},"rules":[{rule}]}}"#);
    let mut new = Filter::configure(host.clone(), json.as_bytes(), true).unwrap();
    new.adopt(old.retire());
    respond(&host, &mut new, 2, &[(":status", "200"), ("x-cost", "90")], &[]);
    tick(&host, &mut new);
    let calls = settle_calls(&host);
    assert_eq!((calls.len(), calls[0][0].as_str(), calls[0][2].as_str()), (1, random.as_str(), "90"));
}

#[test]
fn a_response_that_ends_with_trailers_settles_when_they_arrive() {
    let (host, mut filter) = configure(r#"{"reserve":1000,"settle":{"usage":"openai"}}"#);
    let random = allowed(&host, &mut filter, 2, "alice");
    let body = r#"{"choices":[],"usage":{"prompt_tokens":10,"completion_tokens":20,"total_tokens":30}}"#;
    host.upstream_response(2, &[(":status", "200"), ("content-type", "application/json")]);
    filter.on_response_headers(2);
    host.body_chunk(2, body.as_bytes());
    // Trailers follow (HTTP/2, gRPC, chunked trailers): the last data chunk is not the end of the stream.
    filter.on_response_body(2, body.len(), false);
    tick(&host, &mut filter);
    assert!(settle_calls(&host).is_empty(), "the response has not ended yet");
    filter.on_response_trailers(2);
    tick(&host, &mut filter);
    let calls = settle_calls(&host);
    assert_eq!((calls.len(), calls[0][0].as_str(), calls[0][2].as_str()), (1, random.as_str(), "30"));
}

/// The filter of `configure`, with the degraded mode (`failure_mode: "local"`, one gateway).
fn configure_degraded(cost: &str) -> (FakeHost, Filter<FakeHost>) {
    let host = FakeHost::new();
    let rule =
        format!(r#"{{"name":"tokens","limit_by":{{"header":"x-key"}},"rate":10000,"interval":"1m","cost":{cost}}}"#);
    let degraded = r#""failure_mode":"local","local_fallback":{"gateways":1,"probe_interval":"10s"}"#;
    let json = format!(r#"{{{BRIDGE},"rules":[{rule}],{degraded}}}"#);
    let filter = Filter::configure(host.clone(), json.as_bytes(), true).unwrap();
    (host, filter)
}

/// Request `context_id` asking `max_tokens` while Redis fails: whether the local window admitted it.
fn degraded_request(host: &FakeHost, filter: &mut Filter<FakeHost>, context_id: u32, max_tokens: &str) -> bool {
    host.request(context_id, &[(":path", "/v1/chat/completions"), ("x-key", "alice"), ("x-max-tokens", max_tokens)]);
    if filter.on_request_headers(context_id) == Action::Continue {
        return true;
    }
    if host.end(context_id).is_none() {
        // Waiting for Redis (the first request, before the circuit opens): the bridge answers 503.
        host.http_reply(503, b"");
        filter.on_http_call_response(host.last_token().unwrap(), 1, 0);
    }
    host.end(context_id) == Some(crate::testing::End::Resumed)
}

#[test]
fn the_degraded_mode_charges_each_request_its_own_reservation_and_settles_it_locally() {
    let (host, mut filter) =
        configure_degraded(r#"{"reserve":{"header":"x-max-tokens","default":1},"settle":{"usage":"openai"}}"#);
    // A budget of 10,000 per minute: reservations of 6,000 fit once, not twice (with the default of 1, 100
    // such requests were admitted).
    assert!(degraded_request(&host, &mut filter, 2, "6000"));
    assert!(!degraded_request(&host, &mut filter, 4, "6000"), "6,000 + 6,000 is over the budget");
    assert!(!degraded_request(&host, &mut filter, 6, "4001"));
    // Request 2's response reports 1,000 tokens: the local window keeps 1,000 of its 6,000.
    let body = r#"{"usage":{"prompt_tokens":400,"completion_tokens":600,"total_tokens":1000}}"#;
    respond(&host, &mut filter, 2, &[(":status", "200"), ("content-type", "application/json")], &[body]);
    assert_eq!(host.counter(&format!("{NAME}.settlements")), 1, "settled in the local window");
    assert!(degraded_request(&host, &mut filter, 8, "9000"), "1,000 + 9,000 fits");
    assert!(!degraded_request(&host, &mut filter, 10, "1"));
}

#[test]
fn a_request_whose_usage_is_read_from_the_body_asks_the_upstream_for_identity() {
    let (host, mut filter) = configure(r#"{"reserve":1000,"settle":{"usage":"openai"}}"#);
    host.request(2, &[(":path", "/v1/chat/completions"), ("x-key", "alice"), ("accept-encoding", "gzip, deflate")]);
    assert_eq!(filter.on_request_headers(2), Action::Pause);
    answer(&host, &mut filter, host.last_token().unwrap(), &acquired(9_000));
    let (headers, _) = host.upstream_request(2);
    let accept: Vec<&str> = headers.iter().filter(|(k, _)| k == "accept-encoding").map(|(_, v)| v.as_str()).collect();
    assert_eq!(accept, ["identity"], "the SDKs' gzip would hide the usage");
    // An upstream that compresses anyway: the body cannot be read, the reservation stays.
    let gzip = [0x1f_u8, 0x8b, 8, 0, 0, 0, 0, 0];
    host.upstream_response(
        2,
        &[(":status", "200"), ("content-type", "application/json"), ("content-encoding", "gzip")],
    );
    filter.on_response_headers(2);
    host.body_chunk(2, &gzip);
    filter.on_response_body(2, gzip.len(), true);
    tick(&host, &mut filter);
    assert!(settle_calls(&host).is_empty());
    assert_eq!(host.counter(&format!("{NAME}.settled_without_usage")), 1);
}

#[test]
fn a_cost_read_from_a_response_header_leaves_the_accepted_codings_alone() {
    let (host, mut filter) = configure(r#"{"reserve":400,"settle":{"response_header":"x-cost"}}"#);
    host.request(2, &[(":path", "/"), ("x-key", "alice"), ("accept-encoding", "gzip")]);
    filter.on_request_headers(2);
    answer(&host, &mut filter, host.last_token().unwrap(), &acquired(9_000));
    let (headers, _) = host.upstream_request(2);
    assert!(headers.contains(&("accept-encoding".into(), "gzip".into())));
}

/// Request `context_id` of key `key` whose JSON body arrives in `chunks` after its headers: what the
/// filter answered to the headers and to each chunk.
fn with_body(
    host: &FakeHost,
    filter: &mut Filter<FakeHost>,
    context_id: u32,
    key: &str,
    chunks: &[&str],
) -> Vec<Action> {
    host.request(
        context_id,
        &[(":path", "/v1/chat/completions"), ("x-key", key), ("content-length", "0"), ("accept-encoding", "gzip")],
    );
    let mut actions = vec![filter.on_request_start(context_id, !chunks.is_empty())];
    if actions[0] == Action::Continue {
        host.headers_went_on(context_id);
    }
    for (index, chunk) in chunks.iter().enumerate() {
        let size = host.request_body_chunk(context_id, chunk.as_bytes());
        actions.push(filter.on_request_body(context_id, size, index + 1 == chunks.len()));
    }
    actions
}

#[test]
fn the_reservation_comes_from_the_json_request_body_once_it_has_arrived() {
    let (host, mut filter) = configure(r#"{"reserve":{"body":"openai","default":500},"settle":{"usage":"openai"}}"#);
    let body =
        r#"{"model":"gpt-5","messages":[{"role":"user","content":"hi"}],"max_completion_tokens":1200,"max_tokens":9}"#;
    let (a, b) = body.split_at(40);
    let actions = with_body(&host, &mut filter, 2, "alice", &[a, b]);
    // The headers go on (a pause there would keep the body from the filter), the body is held until whole.
    assert_eq!(actions, [Action::Continue, Action::Pause, Action::Pause], "held until the body is whole, then sent");
    assert_eq!(acquired_permits(&host), "1200", "max_completion_tokens first");
    answer(&host, &mut filter, host.last_token().unwrap(), &acquired(100));
    assert_eq!(host.end(2), Some(crate::testing::End::Resumed));
    let cases: [(u32, &[&str], &str); 4] = [
        (4, &[r#"{"max_tokens":77}"#], "77"),
        (6, &["not json"], "500"),
        (8, &[r#"{"max_tokens":"lots"}"#], "500"),
        (10, &[], "500"), // no body follows the headers: decided at once
    ];
    for (context_id, chunks, expected) in cases {
        with_body(&host, &mut filter, context_id, "alice", chunks);
        assert_eq!(acquired_permits(&host), expected, "{chunks:?}");
        answer(&host, &mut filter, host.last_token().unwrap(), &acquired(100));
    }
}

#[test]
fn a_body_larger_than_the_limit_is_decided_with_the_default_without_waiting_for_its_end() {
    let (host, mut filter) =
        configure(r#"{"reserve":{"body":"anthropic","default":500},"settle":{"usage":"anthropic"}}"#);
    let big =
        format!(r#"{{"max_tokens":3000,"messages":[{{"content":"{}"}}"#, "x".repeat(crate::key::MAX_REQUEST_BODY));
    let actions = with_body(&host, &mut filter, 2, "alice", &[&big, "]"]);
    // The rest of the body stays held while the decision waits (it went upstream undecided before).
    assert_eq!(actions, [Action::Continue, Action::Pause, Action::Pause], "decided (and waiting for Redis) at 64 KiB");
    assert_eq!(acquired_permits(&host), "500", "past 64 KiB the body is not read");
    assert_eq!(host.end(2), None, "undecided");
    answer(&host, &mut filter, host.last_token().unwrap(), &acquired(100));
    assert_eq!(host.end(2), Some(crate::testing::End::Resumed));
    let size = host.request_body_chunk(2, b"}");
    assert_eq!(filter.on_request_body(2, size, true), Action::Continue, "decided: the rest goes on");
    // Ending with trailers while the decision waits: held as well.
    with_body(&host, &mut filter, 4, "alice", &[&big]);
    assert_eq!(filter.on_request_trailers(4), Action::Pause);
}

#[test]
fn limit_by_a_body_field_keeps_models_apart() {
    let host = FakeHost::new();
    let rule = r#"{"name":"tokens","limit_by":{"body":"model"},"rate":10000,"interval":"1m","cost":{"reserve":{"body":"openai","default":500},"settle":{"usage":"openai"}}}"#;
    let mut filter =
        Filter::configure(host.clone(), format!(r#"{{{BRIDGE},"rules":[{rule}]}}"#).as_bytes(), true).unwrap();
    with_body(&host, &mut filter, 2, "alice", &[r#"{"model":"gpt-5","max_tokens":10}"#]);
    let call = String::from_utf8(host.http_calls().pop().unwrap().body).unwrap();
    assert!(call.contains("/erl%3Atokens%3Agpt%2D5/"), "{call}");
    answer(&host, &mut filter, host.last_token().unwrap(), &acquired(100));
    // No model, not JSON, or too large: never skipped; charged to the limiter of unread bodies, with the
    // reservation's default.
    let big =
        format!(r#"{{"messages":[{{"content":"{}"}}],"model":"gpt-5"}}"#, "x".repeat(crate::key::MAX_REQUEST_BODY));
    for (context_id, body) in [(4, r#"{"max_tokens":10}"#), (6, "not json"), (8, r#"{"model":["gpt-5"]}"#), (10, &big)]
    {
        let calls = host.http_calls().len();
        with_body(&host, &mut filter, context_id, "alice", &[body]);
        assert_eq!(host.http_calls().len(), calls + 1, "{body:.40}: a call of its own");
        let call = String::from_utf8(host.http_calls().pop().unwrap().body).unwrap();
        assert!(call.contains("/erl%3Atokens%3A%21missing/"), "{call}");
        assert_eq!(acquired_permits(&host), if context_id == 4 { "10" } else { "500" });
        answer(&host, &mut filter, host.last_token().unwrap(), &acquired(100));
        assert_eq!(host.end(context_id), Some(crate::testing::End::Resumed));
    }
}

#[test]
fn include_usage_adds_the_stream_option_to_a_streamed_request_that_lacks_it() {
    let (host, mut filter) =
        configure(r#"{"reserve":{"body":"openai","default":500},"settle":{"usage":"openai","include_usage":true}}"#);
    let streamed = r#"{"model":"m","stream":true,"messages":[],"max_tokens":10}"#;
    with_body(&host, &mut filter, 2, "alice", &[streamed]);
    answer(&host, &mut filter, host.last_token().unwrap(), &acquired(100));
    let (headers, body) = host.upstream_request(2);
    let body = String::from_utf8(body).unwrap();
    assert_eq!(
        body,
        r#"{"stream_options":{"include_usage":true},"model":"m","stream":true,"messages":[],"max_tokens":10}"#
    );
    assert!(!headers.iter().any(|(k, _)| k == "content-length"), "the held body may grow: sent chunked {headers:?}");
    assert!(headers.contains(&("accept-encoding".into(), "identity".into())));
    for (context_id, sent) in [
        (4, r#"{"model":"m","stream":true,"stream_options":{"include_usage":false}}"#),
        (6, r#"{"model":"m","max_tokens":10}"#),
        (8, r#"{"model":"m","stream":true,"input":"responses API"}"#),
    ] {
        with_body(&host, &mut filter, context_id, "alice", &[sent]);
        answer(&host, &mut filter, host.last_token().unwrap(), &acquired(100));
        assert_eq!(String::from_utf8(host.upstream_request(context_id).1).unwrap(), sent, "left as the client sent it");
    }
}

#[test]
fn a_settle_that_gives_permits_back_raises_the_local_block_of_its_limiter() {
    let (host, mut filter) =
        configure(r#"{"reserve":{"header":"x-max-tokens","default":500},"settle":{"response_header":"x-cost"}}"#);
    let ask = |host: &FakeHost, filter: &mut Filter<FakeHost>, context_id: u32, tokens: &str| {
        let calls = host.http_calls().len();
        host.request(context_id, &[(":path", "/"), ("x-key", "alice"), ("x-max-tokens", tokens)]);
        filter.on_request_headers(context_id);
        host.http_calls().len() > calls
    };
    assert!(ask(&host, &mut filter, 2, "5000"));
    answer(&host, &mut filter, host.last_token().unwrap(), &acquired(5_000));
    assert!(ask(&host, &mut filter, 4, "6000"), "Redis decides");
    answer(&host, &mut filter, host.last_token().unwrap(), &rejected(30_000));
    assert!(!ask(&host, &mut filter, 6, "8000"), "blocked locally: at most 5,999 free until the oldest leaves");
    // Request 2 cost 1,000 of its 5,000: once the settle lands, Redis has 4,000 more free.
    respond(&host, &mut filter, 2, &[(":status", "200"), ("x-cost", "1000")], &[]);
    tick(&host, &mut filter);
    answer(&host, &mut filter, host.last_token().unwrap(), b":1\r\n");
    assert!(ask(&host, &mut filter, 8, "8000"), "Redis would admit it now: it decides");
    assert!(!ask(&host, &mut filter, 10, "10000"), "more than 9,999 is still rejected locally");
}

#[test]
fn the_settles_of_a_tick_go_out_in_one_batch_call_and_each_reads_its_own_reply() {
    let (host, mut filter) =
        configure(r#"{"reserve":{"header":"x-max-tokens","default":500},"settle":{"response_header":"x-cost"}}"#);
    let mut randoms = Vec::new();
    for (context_id, key) in [(2, "alice"), (4, "bob"), (6, "carol")] {
        randoms.push(allowed(&host, &mut filter, context_id, key));
    }
    for (context_id, cost) in [(2, "100"), (4, "200"), (6, "300")] {
        respond(&host, &mut filter, context_id, &[(":status", "200"), ("x-cost", cost)], &[]);
    }
    let before = host.counter(&format!("{NAME}.redis_calls"));
    let sent = host.http_calls().len();
    tick(&host, &mut filter);
    let calls = host.http_calls().split_off(sent);
    assert_eq!(calls.len(), 1, "three settles, one call");
    let body = String::from_utf8(calls[0].body.clone()).unwrap();
    assert!(body.starts_with(&format!("EVALSHA/{}/15/", crate::script::ACQUIRE_BATCH.sha())), "{body}");
    assert!(randoms.iter().all(|random| body.contains(&random.replace('-', "%2D"))), "{body}");
    assert_eq!(
        [host.counter(&format!("{NAME}.redis_calls")) - before, host.counter(&format!("{NAME}.settlements"))],
        [1, 3]
    );
    // Each segment's reply as GIVE_BACK alone would give it (1: the member was found).
    answer(&host, &mut filter, calls[0].token, b"*6\r\n:1\r\n:1\r\n:1\r\n:1\r\n:1\r\n:0\r\n");
    assert!(filter.give_back_batches.is_empty() && filter.give_backs.is_empty());
    assert_eq!(host.counter(&format!("{NAME}.redis_errors")), 0);
}

#[test]
fn a_batch_of_settles_answered_noscript_is_sent_again_by_source_once() {
    let (host, mut filter) = configure(r#"{"reserve":400,"settle":{"response_header":"x-cost"}}"#);
    allowed(&host, &mut filter, 2, "alice");
    allowed(&host, &mut filter, 4, "bob");
    respond(&host, &mut filter, 2, &[(":status", "200"), ("x-cost", "1")], &[]);
    respond(&host, &mut filter, 4, &[(":status", "200"), ("x-cost", "2")], &[]);
    let sent = host.http_calls().len();
    tick(&host, &mut filter);
    answer(&host, &mut filter, host.last_token().unwrap(), b"-NOSCRIPT No matching script.\r\n");
    let calls = host.http_calls().split_off(sent);
    assert_eq!(calls.len(), 2);
    assert!(String::from_utf8(calls[1].body.clone()).unwrap().starts_with("EVAL/"), "by source");
    answer(&host, &mut filter, calls[1].token, b"*4\r\n:1\r\n:1\r\n:1\r\n:1\r\n");
    assert_eq!([host.counter(&format!("{NAME}.settlements")), host.counter(&format!("{NAME}.batches"))], [2, 1]);
    assert!(filter.give_back_batches.is_empty());
}

#[test]
fn settle_calls_a_configuration_leaves_with_no_one_to_send_them_count_as_lost_not_as_without_usage() {
    let (host, mut filter) = configure(r#"{"reserve":400,"settle":{"response_header":"x-cost"}}"#);
    allowed(&host, &mut filter, 2, "alice");
    allowed(&host, &mut filter, 4, "bob");
    // Request 2's response ended (its settle call waits for the tick); request 4's still runs.
    respond(&host, &mut filter, 2, &[(":status", "200"), ("x-cost", "90")], &[]);
    let retirement = filter.retire();
    filter.drop_retirement(&retirement);
    assert_eq!(host.counter(&format!("{NAME}.settlements_lost")), 1, "a settle that knew its cost");
    assert_eq!(host.counter(&format!("{NAME}.settled_without_usage")), 1, "a response still running");
}

#[test]
fn a_body_that_ends_with_trailers_is_read_and_decided_at_the_trailers() {
    let (host, mut filter) = configure(r#"{"reserve":{"body":"openai","default":500},"settle":{"usage":"openai"}}"#);
    host.request(2, &[(":path", "/v1/chat/completions"), ("x-key", "alice")]);
    assert_eq!(filter.on_request_start(2, true), Action::Continue);
    host.headers_went_on(2);
    for chunk in [r#"{"max_tokens":"#, "321}"] {
        let size = host.request_body_chunk(2, chunk.as_bytes());
        assert_eq!(filter.on_request_body(2, size, false), Action::Pause, "held: the stream has not ended");
    }
    assert!(host.http_calls().is_empty());
    // Trailers follow the body (a gRPC client stream): its end.
    assert_eq!(filter.on_request_trailers(2), Action::Pause, "sent to Redis");
    assert_eq!(acquired_permits(&host), "321");
}

#[test]
fn a_request_waiting_for_its_body_when_its_configuration_is_replaced_is_decided_by_the_new_filter() {
    let cost = r#"{"reserve":{"body":"openai","default":500},"settle":{"usage":"openai"}}"#;
    let (host, mut old) = configure(cost);
    host.request(2, &[(":path", "/v1/chat/completions"), ("x-key", "alice")]);
    assert_eq!(old.on_request_start(2, true), Action::Continue);
    host.headers_went_on(2);
    // A configuration push for the same root context: the body's callbacks now reach the new filter.
    let rule =
        format!(r#"{{"name":"tokens","limit_by":{{"header":"x-key"}},"rate":10000,"interval":"1m","cost":{cost}}}"#);
    let mut new =
        Filter::configure(host.clone(), format!(r#"{{{BRIDGE},"rules":[{rule}]}}"#).as_bytes(), true).unwrap();
    new.adopt(old.retire());
    let size = host.request_body_chunk(2, br#"{"max_tokens":321}"#);
    assert_eq!(new.on_request_body(2, size, true), Action::Pause, "decided, not let through unlimited");
    assert_eq!(acquired_permits(&host), "321");
    assert!(String::from_utf8(host.http_calls().pop().unwrap().body).unwrap().contains("alice"), "its own key");
}

#[test]
fn a_batch_of_settles_never_answered_fails_once_at_its_deadline_and_its_reservations_stay() {
    let (host, mut filter) = configure(r#"{"reserve":400,"settle":{"response_header":"x-cost"}}"#);
    allowed(&host, &mut filter, 2, "alice");
    allowed(&host, &mut filter, 4, "bob");
    respond(&host, &mut filter, 2, &[(":status", "200"), ("x-cost", "1")], &[]);
    respond(&host, &mut filter, 4, &[(":status", "200"), ("x-cost", "2")], &[]);
    tick(&host, &mut filter);
    assert_eq!(filter.give_back_batches.len(), 1);
    // Redis never answers: past redis.timeout (200 ms) and the grace, the tick gives up on the batch.
    host.advance(200 + DEADLINE_GRACE_MS);
    tick(&host, &mut filter);
    assert!(filter.give_back_batches.is_empty());
    assert_eq!(host.counter(&format!("{NAME}.redis_errors")), 1, "one call failed, counted once");
    assert_eq!(host.tick_period(), 0, "nothing waits any more: the tick stops");
}

/// [`configure`] with these `redis` settings (the bridge's, plus `extra`) and a cost read from `x-cost`.
fn configure_redis(extra: &str) -> (FakeHost, Filter<FakeHost>) {
    let host = FakeHost::new();
    let cost = r#"{"reserve":400,"settle":{"response_header":"x-cost"}}"#;
    let rule =
        format!(r#"{{"name":"tokens","limit_by":{{"header":"x-key"}},"rate":10000,"interval":"1m","cost":{cost}}}"#);
    let json = format!(r#"{{"redis":{{"cluster":"webdis","timeout":200{extra}}},"rules":[{rule}]}}"#);
    let filter = Filter::configure(host.clone(), json.as_bytes(), true).unwrap();
    (host, filter)
}

/// Alice's request allowed and its response ended with a cost of 100 (its settle waits in the outbox),
/// then bob's request arrives: the calls bob's request sent, and alice's reservation's random bytes.
fn settle_then_acquire(host: &FakeHost, filter: &mut Filter<FakeHost>) -> (Vec<crate::testing::HttpCall>, String) {
    let random = allowed(host, filter, 2, "alice");
    respond(host, filter, 2, &[(":status", "200"), ("x-cost", "100")], &[]);
    let sent = host.http_calls().len();
    host.request(4, &[(":path", "/"), ("x-key", "bob")]);
    assert_eq!(filter.on_request_headers(4), Action::Pause);
    (host.http_calls().split_off(sent), random)
}

fn resumed(host: &FakeHost, context_id: u32) -> bool {
    matches!(host.end(context_id), Some(crate::testing::End::Resumed))
}

#[test]
fn a_settle_rides_before_the_next_acquire_to_its_redis_and_each_reads_its_own_part() {
    let (host, mut filter) = configure_redis("");
    let (calls, random) = settle_then_acquire(&host, &mut filter);
    assert_eq!(calls.len(), 1, "one call: the settle rides with bob's acquire");
    let body = String::from_utf8(calls[0].body.clone()).unwrap();
    assert!(body.starts_with(&format!("EVALSHA/{}/", crate::script::ACQUIRE_BATCH.sha())), "{body}");
    assert!(body.contains(&random.replace('-', "%2D")), "{body}");
    assert!(body.find("alice") < body.find("bob"), "the settle's segment first: {body}");
    tick(&host, &mut filter);
    assert_eq!(host.http_calls().len(), 2, "nothing left for the tick to send");
    // The settle's part as GIVE_BACK alone answers it (1: found), then the acquire's (9,000 left).
    answer(&host, &mut filter, calls[0].token, b"*4\r\n:1\r\n:1\r\n:1\r\n:9000\r\n");
    assert!(resumed(&host, 4), "bob allowed by his part of the reply");
    let counters = ["settlements", "batches", "batched_calls", "redis_calls", "redis_errors"]
        .map(|name| host.counter(&format!("{NAME}.{name}")));
    assert_eq!(counters, [1, 1, 2, 2, 0]);
    assert!(filter.outbox.is_empty() && filter.give_backs.is_empty() && filter.coalescer.is_idle());
}

#[test]
fn a_call_carrying_settles_that_fails_counts_one_error_and_its_request_follows_the_failure_mode() {
    let (host, mut filter) = configure_redis("");
    let (calls, _) = settle_then_acquire(&host, &mut filter);
    host.http_reply(503, b"");
    filter.on_http_call_response(calls[0].token, 0, 0);
    assert!(resumed(&host, 4), "fail open");
    let counters = ["redis_errors", "failure_allowed"].map(|name| host.counter(&format!("{NAME}.{name}")));
    assert_eq!(counters, [1, 1], "one failed call");
    tick(&host, &mut filter);
    assert_eq!(host.http_calls().len(), 2, "the settle is not sent again: its reservation stays");
}

#[test]
fn a_call_carrying_settles_answered_noscript_carries_them_again_by_source() {
    let (host, mut filter) = configure_redis("");
    let (calls, random) = settle_then_acquire(&host, &mut filter);
    answer(&host, &mut filter, calls[0].token, b"-NOSCRIPT No matching script.\r\n");
    let again = host.http_calls().pop().unwrap();
    let body = String::from_utf8(again.body).unwrap();
    assert!(body.starts_with("EVAL/") && body.contains(&random.replace('-', "%2D")), "{body}");
    answer(&host, &mut filter, again.token, b"*4\r\n:1\r\n:1\r\n:1\r\n:9000\r\n");
    assert!(resumed(&host, 4));
    let counters = ["settlements", "batches", "redis_errors"].map(|name| host.counter(&format!("{NAME}.{name}")));
    assert_eq!(counters, [1, 1, 0], "the batch counted once");
}

#[test]
fn without_coalescing_a_settle_waits_for_the_tick() {
    let (host, mut filter) = configure_redis(r#","max_batch":1"#);
    let (calls, random) = settle_then_acquire(&host, &mut filter);
    assert_eq!(calls.len(), 1);
    assert!(!String::from_utf8(calls[0].body.clone()).unwrap().contains(&random.replace('-', "%2D")));
    tick(&host, &mut filter);
    assert_eq!(settle_calls(&host).len(), 1, "the settle alone, from the tick");
}

#[test]
fn a_call_carrying_settles_never_answered_ends_its_request_and_counts_one_error() {
    let (host, mut filter) = configure_redis("");
    settle_then_acquire(&host, &mut filter);
    host.advance(200 + DEADLINE_GRACE_MS);
    tick(&host, &mut filter);
    assert!(resumed(&host, 4), "bob's deadline: fail open");
    host.advance(200);
    tick(&host, &mut filter);
    assert!(filter.coalescer.is_idle(), "the call given up");
    let errors = host.counter(&format!("{NAME}.redis_errors"));
    assert_eq!(errors, 1, "one call: counted once, by the request's deadline");
    assert_eq!(host.tick_period(), 0, "nothing waits any more: the tick stops");
}

/// Alice's request allowed, then bob's call out (no answer yet), then alice's response ended with a cost:
/// her settle waits in the outbox while bob's call is on its way.
fn settle_behind_a_call_out(host: &FakeHost, filter: &mut Filter<FakeHost>) -> (u32, String) {
    let random = allowed(host, filter, 2, "alice");
    host.request(4, &[(":path", "/"), ("x-key", "bob")]);
    assert_eq!(filter.on_request_headers(4), Action::Pause);
    let bob = host.last_token().unwrap();
    respond(host, filter, 2, &[(":status", "200"), ("x-cost", "100")], &[]);
    (bob, random)
}

#[test]
fn while_a_call_is_out_a_settle_waits_for_the_batch_its_landing_sends() {
    let (host, mut filter) = configure_redis("");
    let (bob, random) = settle_behind_a_call_out(&host, &mut filter);
    let sent = host.http_calls().len();
    tick(&host, &mut filter);
    assert_eq!(host.http_calls().len(), sent, "the tick leaves it: bob's call will land");
    host.request(6, &[(":path", "/"), ("x-key", "carol")]);
    assert_eq!(filter.on_request_headers(6), Action::Pause, "carol waits for bob's call to land");
    answer(&host, &mut filter, bob, &acquired(9_000));
    let calls = host.http_calls().split_off(sent);
    assert_eq!(calls.len(), 1, "carol's call, carrying the settle");
    let body = String::from_utf8(calls[0].body.clone()).unwrap();
    assert!(body.contains(&random.replace('-', "%2D")) && body.contains("carol"), "{body}");
}

#[test]
fn a_settle_waits_for_an_acquire_call_at_most_two_ticks() {
    let (host, mut filter) = configure_redis("");
    let (_, random) = settle_behind_a_call_out(&host, &mut filter);
    tick(&host, &mut filter);
    assert!(settle_calls(&host).is_empty(), "one tick: it waits");
    tick(&host, &mut filter);
    assert_eq!(settle_calls(&host).len(), 1, "two ticks, no acquire call left meanwhile: the tick sends it");
    assert_eq!(settle_calls(&host)[0][0], random);
}

/// A cost rule and an in-flight rule on `x-key` (with these `redis` settings after the bridge's), and
/// alice's request allowed: her permit (a batch of one: taken, 4 free), then her rate acquire.
fn cost_and_inflight_with_alice_allowed(redis_extra: &str) -> (FakeHost, Filter<FakeHost>) {
    let host = FakeHost::new();
    let rules = r#"[{"name":"tokens","limit_by":{"header":"x-key"},"rate":10000,"interval":"1m",
        "cost":{"reserve":400,"settle":{"response_header":"x-cost"}}},
        {"name":"running","limit_by":{"header":"x-key"},"max_in_flight":5,"lease":"3s"}]"#;
    let json = format!(r#"{{"redis":{{"cluster":"webdis","timeout":200{redis_extra}}},"rules":{rules}}}"#);
    let mut filter = Filter::configure(host.clone(), json.as_bytes(), true).unwrap();
    host.request(2, &[(":path", "/"), ("x-key", "alice")]);
    assert_eq!(filter.on_request_headers(2), Action::Pause);
    // One call: her permit (4 free after it), then the rate acquire that rode with it.
    let reply = crate::testing::batch_reply(&[b"*3\r\n:1\r\n:4\r\n:-1\r\n", &acquired(9_000)]);
    answer(&host, &mut filter, host.last_token().unwrap(), &reply);
    assert!(resumed(&host, 2));
    assert_eq!(host.counter(&format!("{NAME}.inflight_admitted")), 1);
    (host, filter)
}

#[test]
fn without_coalescing_an_in_flight_permits_call_carries_no_settle() {
    let (host, mut filter) = cost_and_inflight_with_alice_allowed(r#","max_batch":1"#);
    respond(&host, &mut filter, 2, &[(":status", "200"), ("x-cost", "100")], &[]);
    let sent = host.http_calls().len();
    host.request(4, &[(":path", "/"), ("x-key", "bob")]);
    assert_eq!(filter.on_request_headers(4), Action::Pause);
    let calls = host.http_calls().split_off(sent);
    assert_eq!(calls.len(), 1, "bob's permit");
    assert!(!String::from_utf8(calls[0].body.clone()).unwrap().contains("alice"), "alone: no settle rides");
    tick(&host, &mut filter);
    assert_eq!(settle_calls(&host).len(), 1, "the settle from the tick, at once");
}

#[test]
fn a_call_carrying_settles_never_answered_after_its_client_left_counts_the_settles_failure() {
    let (host, mut filter) = configure_redis("");
    settle_then_acquire(&host, &mut filter);
    // Bob leaves before the reply: his part of the call is a hole, and nothing counted it.
    filter.on_done(4);
    for _ in 0..3 {
        host.advance(200);
        tick(&host, &mut filter);
    }
    assert!(filter.coalescer.is_idle(), "the call given up");
    assert_eq!(host.counter(&format!("{NAME}.redis_errors")), 1, "the settle's failure, counted once");
}

#[test]
fn a_settle_waiting_when_the_configuration_goes_away_is_handed_over_not_carried_by_a_dying_call() {
    // Two calls out at a time: bob's rate call can leave while his permit's is on its way.
    let (host, mut filter) = cost_and_inflight_with_alice_allowed(r#","max_in_flight":2"#);
    // Bob waits for his permit when the configuration goes away, with alice's settle in the outbox: his
    // wait ends in the failure mode (open), and his rate rules are asked from the retiring filter.
    host.request(4, &[(":path", "/"), ("x-key", "bob")]);
    assert_eq!(filter.on_request_headers(4), Action::Pause);
    respond(&host, &mut filter, 2, &[(":status", "200"), ("x-cost", "100")], &[]);
    let retirement = filter.retire();
    filter.drop_retirement(&retirement);
    assert_eq!(host.counter(&format!("{NAME}.settlements_lost")), 1, "handed over (here: nobody to send it)");
    assert_eq!(host.counter(&format!("{NAME}.settlements")), 0, "not sent with a call that dies");
}

#[test]
fn a_call_carrying_settles_that_fails_after_its_requests_deadline_counts_one_error() {
    let (host, mut filter) = configure_redis("");
    let (calls, _) = settle_then_acquire(&host, &mut filter);
    host.advance(200 + DEADLINE_GRACE_MS);
    tick(&host, &mut filter);
    assert!(resumed(&host, 4), "bob's deadline: fail open, his call's failure counted");
    host.http_reply(503, b"");
    filter.on_http_call_response(calls[0].token, 0, 0);
    assert_eq!(host.counter(&format!("{NAME}.redis_errors")), 1, "the late failure is the same call's");
    assert!(filter.coalescer.is_idle());
}
