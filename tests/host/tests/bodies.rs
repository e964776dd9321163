//! Request bodies and response trailers as Envoy 1.40 hands them to a filter, with a WAT module that logs
//! every callback: a request body in chunks (`RequestSpec::body_chunks`), buffered (StopIterationAndBuffer)
//! or let through, rewritten with `proxy_set_buffer_bytes` (what goes upstream, and Envoy's untouched
//! `content-length`); request header edits during `proxy_on_request_body` (refused, as Envoy) and from a
//! root context callback through `proxy_set_effective_context` while the headers are held (they reach the
//! upstream); response trailers (`ResponseSpec::trailers`) ending the stream with
//! `proxy_on_response_trailers`.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use crate::common;

use common::WAT_HEAD;
use proxy_wasm_host::exchange::ResponseSpec;
use proxy_wasm_host::{header, Host, HostBuilder, LogLevel, LogSource, Outcome, RequestSpec};

/// What the module does in its callbacks: WAT instructions ending in the callback's i32 answer (the body
/// ones see `$len` and `$eos`); `trailers: None` leaves `proxy_on_response_trailers` unexported.
#[derive(Clone, Copy)]
struct Behaviour {
    request_headers: &'static str,
    request_body: &'static str,
    response_body: &'static str,
    trailers: Option<&'static str>,
    tick: &'static str,
}

const CONTINUE: &str = "(i32.const 0)";
/// StopIterationAndBuffer (1) until the end of stream, then Continue.
const BUFFER: &str = "(select (i32.const 0) (i32.const 1) (local.get $eos))";
/// Pauses the request headers until the tick (5 ms), which continues the request.
const HOLD_HEADERS: &str = "(drop (call $tick (i32.const 5))) (i32.const 1)";
/// The tick: makes the stream the effective context (logged `K<status>`), edits its request headers
/// (`$edit`), stops the tick and continues the request.
const TICK_EDITS_REQUEST: &str = "(call $effective) (call $edit) (drop (call $continue (i32.const 0)))";

impl Default for Behaviour {
    fn default() -> Self {
        Behaviour {
            request_headers: CONTINUE,
            request_body: CONTINUE,
            response_body: CONTINUE,
            trailers: None,
            tick: TICK_EDITS_REQUEST,
        }
    }
}

/// A module that logs each callback as one line: `R<eos>` request headers, `Q<len><eos>:<body buffer>`
/// request body, `H<eos>` response headers, `B<len><eos>:<body buffer>` response body, `T<n>:<x-t trailer>`
/// response trailers, `L<status>:<x-t trailer>` `proxy_on_log` (lengths and counts as two digits; the
/// status of `proxy_get_header_map_value`); `E<replace><remove>` the statuses of `$edit`
/// (replace `x-edited: yes`, remove `x-drop` on the request headers), `K<status>` the tick's
/// `proxy_set_effective_context(stream)`.
fn module(behaviour: Behaviour) -> Vec<u8> {
    let Behaviour { request_headers, request_body, response_body, trailers, tick } = behaviour;
    let trailers = match trailers {
        None => String::new(),
        Some(answer) => format!(
            r#"(func (export "proxy_on_response_trailers") (param $ctx i32) (param $n i32) (result i32)
    (i32.store (i32.const 1008) (i32.const 0))
    (i32.store (i32.const 1012) (i32.const 0))
    (drop (call $get_header (i32.const 3) (i32.const 1240) (i32.const 3) (i32.const 1008) (i32.const 1012)))
    (call $note (i32.const 84) (local.get $n) (i32.const -1) (i32.load (i32.const 1008)) (i32.load (i32.const 1012)))
    {answer})"#
        ),
    };
    wat::parse_str(format!(
        r#"(module
  (import "env" "proxy_log" (func $log (param i32 i32 i32) (result i32)))
  (import "env" "proxy_get_buffer_bytes" (func $get_buffer (param i32 i32 i32 i32 i32) (result i32)))
  (import "env" "proxy_set_buffer_bytes" (func $set_buffer (param i32 i32 i32 i32 i32) (result i32)))
  (import "env" "proxy_get_header_map_value" (func $get_header (param i32 i32 i32 i32 i32) (result i32)))
  (import "env" "proxy_replace_header_map_value" (func $replace_header (param i32 i32 i32 i32 i32) (result i32)))
  (import "env" "proxy_remove_header_map_value" (func $remove_header (param i32 i32 i32) (result i32)))
  (import "env" "proxy_set_tick_period_milliseconds" (func $tick (param i32) (result i32)))
  (import "env" "proxy_set_effective_context" (func $set_effective (param i32) (result i32)))
  (import "env" "proxy_continue_stream" (func $continue (param i32) (result i32)))
  {WAT_HEAD}
  (global $ctx (mut i32) (i32.const 0))
  (data (i32.const 1100) "x-edited")
  (data (i32.const 1120) "yes")
  (data (i32.const 1140) "x-drop")
  (data (i32.const 1160) "REWRITTEN")
  (data (i32.const 1180) "content-length")
  (data (i32.const 1200) "grpc-status")
  (data (i32.const 1220) "7")
  (data (i32.const 1240) "x-t")
  (func (export "proxy_on_configure") (param i32 i32) (result i32) (i32.const 1))
  ;; Logs the tag, `n` as two digits (n >= 0), `flag` as a digit (flag >= 0), then a colon and `size`
  ;; bytes at `from` (from >= 0).
  (func $note (param $tag i32) (param $n i32) (param $flag i32) (param $from i32) (param $size i32)
    (local $at i32)
    (i32.store8 (i32.const 2000) (local.get $tag))
    (local.set $at (i32.const 2001))
    (if (i32.ge_s (local.get $n) (i32.const 0)) (then
      (i32.store8 (local.get $at) (i32.add (i32.const 48) (i32.div_u (local.get $n) (i32.const 10))))
      (i32.store8 (i32.add (local.get $at) (i32.const 1))
        (i32.add (i32.const 48) (i32.rem_u (local.get $n) (i32.const 10))))
      (local.set $at (i32.add (local.get $at) (i32.const 2)))))
    (if (i32.ge_s (local.get $flag) (i32.const 0)) (then
      (i32.store8 (local.get $at) (i32.add (i32.const 48) (local.get $flag)))
      (local.set $at (i32.add (local.get $at) (i32.const 1)))))
    (if (i32.ge_s (local.get $from) (i32.const 0)) (then
      (i32.store8 (local.get $at) (i32.const 58))
      (local.set $at (i32.add (local.get $at) (i32.const 1)))
      (memory.copy (local.get $at) (local.get $from) (local.get $size))
      (local.set $at (i32.add (local.get $at) (local.get $size)))))
    (drop (call $log (i32.const 2) (i32.const 2000) (i32.sub (local.get $at) (i32.const 2000)))))
  ;; Logs the tag, `len`, `eos` and the bytes of body buffer `kind` (0 request, 1 response).
  (func $body (param $tag i32) (param $kind i32) (param $len i32) (param $eos i32)
    (i32.store (i32.const 1000) (i32.const 0))
    (i32.store (i32.const 1004) (i32.const 0))
    (drop (call $get_buffer (local.get $kind) (i32.const 0) (i32.const 1000) (i32.const 1000) (i32.const 1004)))
    (call $note (local.get $tag) (local.get $len) (local.get $eos) (i32.load (i32.const 1000))
      (i32.load (i32.const 1004))))
  ;; Replaces x-edited: yes and removes x-drop on the request headers; logs E<replace status><remove status>.
  (func $edit
    (local $replaced i32)
    (local.set $replaced
      (call $replace_header (i32.const 0) (i32.const 1100) (i32.const 8) (i32.const 1120) (i32.const 3)))
    (call $note (i32.const 69)
      (i32.add (i32.mul (local.get $replaced) (i32.const 10))
        (call $remove_header (i32.const 0) (i32.const 1140) (i32.const 6)))
      (i32.const -1) (i32.const -1) (i32.const 0)))
  ;; Makes the stream the effective context (logs K<status>) and stops the tick.
  (func $effective
    (call $note (i32.const 75) (i32.const -1) (call $set_effective (global.get $ctx)) (i32.const -1) (i32.const 0))
    (drop (call $tick (i32.const 0))))
  (func (export "proxy_on_request_headers") (param $ctx i32) (param $n i32) (param $eos i32) (result i32)
    (global.set $ctx (local.get $ctx))
    (call $note (i32.const 82) (i32.const -1) (local.get $eos) (i32.const -1) (i32.const 0))
    {request_headers})
  (func (export "proxy_on_request_body") (param $ctx i32) (param $len i32) (param $eos i32) (result i32)
    (call $body (i32.const 81) (i32.const 0) (local.get $len) (local.get $eos))
    {request_body})
  (func (export "proxy_on_tick") (param $root i32)
    {tick})
  (func (export "proxy_on_response_headers") (param $ctx i32) (param $n i32) (param $eos i32) (result i32)
    (call $note (i32.const 72) (i32.const -1) (local.get $eos) (i32.const -1) (i32.const 0))
    (i32.const 0))
  (func (export "proxy_on_response_body") (param $ctx i32) (param $len i32) (param $eos i32) (result i32)
    (call $body (i32.const 66) (i32.const 1) (local.get $len) (local.get $eos))
    {response_body})
  (func (export "proxy_on_log") (param $ctx i32)
    (i32.store (i32.const 1008) (i32.const 0))
    (i32.store (i32.const 1012) (i32.const 0))
    (call $note (i32.const 76) (i32.const -1)
      (call $get_header (i32.const 3) (i32.const 1240) (i32.const 3) (i32.const 1008) (i32.const 1012))
      (i32.load (i32.const 1008)) (i32.load (i32.const 1012))))
  {trailers})"#
    ))
    .unwrap()
}

/// Sends `request` to a host running `module(behaviour)`: the outcome, the module's lines and the host's
/// warnings.
fn exchange(behaviour: Behaviour, request: RequestSpec) -> (Outcome, Vec<String>, Vec<String>) {
    let mut host = HostBuilder::from_bytes(module(behaviour)).build().unwrap();
    assert!(host.refusal().is_none(), "{:?}", host.refusal());
    host.take_logs();
    let outcome = host.send_request(0, request).unwrap();
    let (lines, warnings) = logs(&host);
    (outcome, lines, warnings)
}

fn logs(host: &Host) -> (Vec<String>, Vec<String>) {
    let logs = host.take_logs();
    let lines = logs.iter().filter(|l| l.source == LogSource::ProxyLog).map(|l| l.message.clone()).collect();
    let warnings = logs
        .iter()
        .filter(|l| l.source == LogSource::Host && l.level == LogLevel::Warn)
        .map(|l| l.message.clone())
        .collect();
    (lines, warnings)
}

/// The lines of the request's side (request headers and body, header edits, the tick).
fn request_side(lines: &[String]) -> Vec<&str> {
    lines.iter().map(String::as_str).filter(|l| l.starts_with(['R', 'Q', 'E', 'K'])).collect()
}

/// The lines of the response's side (response headers, body, trailers).
fn response_side(lines: &[String]) -> Vec<&str> {
    lines.iter().map(String::as_str).filter(|l| l.starts_with(['H', 'B', 'T'])).collect()
}

/// What the upstream received: the request headers and body.
fn upstream(outcome: &Outcome) -> (Vec<(String, String)>, String) {
    match outcome {
        Outcome::Continued { request_headers, request_body, .. } => {
            (request_headers.clone(), String::from_utf8_lossy(request_body).into_owned())
        }
        other => panic!("not continued: {}", other.to_json()),
    }
}

fn trailers(outcome: &Outcome) -> Vec<(String, String)> {
    match outcome {
        Outcome::Continued { response_trailers, .. } => response_trailers.clone(),
        other => panic!("not continued: {}", other.to_json()),
    }
}

fn chunks(parts: &[&str]) -> RequestSpec {
    RequestSpec::with_headers(&[("x-drop", "1")]).with_body_chunks(parts)
}

#[test]
fn a_request_body_in_chunks_is_one_body_call_each_then_the_end_of_stream() {
    let (outcome, lines, warnings) = exchange(Behaviour::default(), chunks(&["ab", "cde", "f"]));
    assert_eq!(request_side(&lines), ["R0", "Q020:ab", "Q030:cde", "Q010:f", "Q001:"]);
    assert!(lines.contains(&"L1:".to_string()), "no trailers in the access log (NotFound): {lines:?}");
    let (headers, body) = upstream(&outcome);
    assert_eq!(body, "abcdef");
    assert_eq!(header(&headers, ":method"), Some("POST"));
    assert_eq!(header(&headers, "content-length"), Some("6"), "the chunks' total");
    assert!(warnings.is_empty(), "{warnings:?}");
}

#[test]
fn a_buffering_filter_sees_the_buffered_body_grow_then_the_whole_body_at_the_end() {
    let behaviour = Behaviour { request_body: BUFFER, ..Behaviour::default() };
    let (outcome, lines, _) = exchange(behaviour, chunks(&["ab", "cde", "f"]));
    assert_eq!(request_side(&lines), ["R0", "Q020:ab", "Q050:abcde", "Q060:abcdef", "Q061:abcdef"]);
    assert_eq!(upstream(&outcome).1, "abcdef");

    // `body` is one chunk: the probe's observation in Envoy 1.40 (`len, false` then `0, true`), and the
    // whole buffered body again at the end when the first call buffered.
    let (_, lines, _) =
        exchange(Behaviour::default(), RequestSpec { body: Some("hello".into()), ..Default::default() });
    assert_eq!(request_side(&lines), ["R0", "Q050:hello", "Q001:"]);
    let (_, lines, _) = exchange(behaviour, RequestSpec { body: Some("hello".into()), ..Default::default() });
    assert_eq!(request_side(&lines), ["R0", "Q050:hello", "Q051:hello"]);
}

/// Replaces the whole buffered body with `REWRITTEN` at the end of stream, buffering until then.
const REWRITE_AT_END: &str = "(if (local.get $eos) (then (drop (call $set_buffer (i32.const 0) (i32.const 0) \
    (local.get $len) (i32.const 1160) (i32.const 9))))) (select (i32.const 0) (i32.const 1) (local.get $eos))";

#[test]
fn a_rewritten_body_goes_upstream_and_envoy_leaves_content_length_alone() {
    let behaviour = Behaviour { request_body: REWRITE_AT_END, ..Behaviour::default() };
    let (outcome, lines, warnings) = exchange(behaviour, chunks(&["hello ", "body"]));
    assert_eq!(request_side(&lines), ["R0", "Q060:hello ", "Q100:hello body", "Q101:hello body"]);
    let (headers, body) = upstream(&outcome);
    assert_eq!(body, "REWRITTEN");
    assert_eq!(header(&headers, "content-length"), Some("10"), "Envoy does not recompute it");
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(warnings[0].contains("content-length 10 and a body of 9 bytes"), "{warnings:?}");

    // The filter's part: remove content-length in proxy_on_request_headers (the only time it may), and the
    // upstream gets the new body without a stale length.
    let behaviour = Behaviour {
        request_headers: "(drop (call $remove_header (i32.const 0) (i32.const 1180) (i32.const 14))) (i32.const 0)",
        request_body: REWRITE_AT_END,
        ..Behaviour::default()
    };
    let (outcome, _, warnings) = exchange(behaviour, chunks(&["hello ", "body"]));
    let (headers, body) = upstream(&outcome);
    assert_eq!((header(&headers, "content-length"), body.as_str()), (None, "REWRITTEN"));
    assert!(warnings.is_empty(), "{warnings:?}");
}

#[test]
fn request_headers_cannot_be_changed_during_the_request_body() {
    // Envoy drops the request headers when proxy_on_request_headers continues (`Context::decodeHeaders`):
    // both edits answer BadArgument (2), in every body call, and the upstream gets the headers unchanged.
    let behaviour = Behaviour { request_body: "(call $edit) (i32.const 0)", ..Behaviour::default() };
    let (outcome, lines, _) = exchange(behaviour, chunks(&["ab", "c"]));
    assert_eq!(request_side(&lines), ["R0", "Q020:ab", "E22", "Q010:c", "E22", "Q001:", "E22"]);
    let (headers, body) = upstream(&outcome);
    assert_eq!((header(&headers, "x-drop"), header(&headers, "x-edited")), (Some("1"), None));
    assert_eq!(body, "abc");
}

#[test]
fn a_root_callback_changes_held_request_headers_through_the_effective_context() {
    // The headers are held (paused); the tick, a root context callback, makes the stream effective, edits
    // its request headers (Ok, Ok) and continues: the upstream gets the edited headers. The body, which
    // arrived while the headers were held, comes in one call with the end of stream (Envoy buffered it).
    let behaviour = Behaviour { request_headers: HOLD_HEADERS, ..Behaviour::default() };
    let (outcome, lines, _) = exchange(behaviour, chunks(&["ab", "cde"]));
    assert_eq!(request_side(&lines), ["R0", "K0", "E00", "Q051:abcde"]);
    let (headers, body) = upstream(&outcome);
    assert_eq!((header(&headers, "x-edited"), header(&headers, "x-drop")), (Some("yes"), None));
    assert_eq!(body, "abcde");

    // The same without a body.
    let (outcome, lines, _) = exchange(behaviour, RequestSpec::with_headers(&[("x-drop", "1")]));
    assert_eq!(request_side(&lines), ["R1", "K0", "E00"]);
    let (headers, _) = upstream(&outcome);
    assert_eq!((header(&headers, "x-edited"), header(&headers, "x-drop")), (Some("yes"), None));
}

/// Logs the trailers callback (see [`module`]), then the body buffer (`b:<held data>`), replaces the
/// `grpc-status` trailer with 7 (logs `G<status>`) and answers Continue.
const TRAILERS_EDIT: &str = "(call $body (i32.const 98) (i32.const 1) (i32.const -1) (i32.const -1)) \
    (call $note (i32.const 71) (i32.const -1) (call $replace_header (i32.const 3) (i32.const 1200) (i32.const 11) \
    (i32.const 1220) (i32.const 1)) (i32.const -1) (i32.const 0)) (i32.const 0)";

const GRPC: &[(&str, &str)] = &[("content-type", "application/grpc")];

fn with_trailers(parts: &[&str]) -> RequestSpec {
    RequestSpec::default()
        .answered_with(ResponseSpec::chunks(GRPC, parts).with_trailers(&[("grpc-status", "0"), ("x-t", "tv")]))
}

#[test]
fn response_trailers_end_the_stream_after_the_last_chunk() {
    let behaviour = Behaviour { trailers: Some(TRAILERS_EDIT), ..Behaviour::default() };
    let (outcome, lines, _) = exchange(behaviour, with_trailers(&["ab", "c"]));
    assert_eq!(response_side(&lines), ["H0", "B020:ab", "B010:c", "T02:tv"], "no end-of-stream body call");
    assert!(lines.contains(&"b:".to_string()) && lines.contains(&"G0".to_string()), "{lines:?}");
    assert_eq!(outcome.body(), b"abc");
    let trailers = trailers(&outcome);
    assert_eq!((header(&trailers, "grpc-status"), header(&trailers, "x-t")), (Some("7"), Some("tv")));
    assert_eq!(outcome.to_json()["trailers"].as_array().map(Vec::len), Some(2));
    assert!(lines.contains(&"L0:tv".to_string()), "the access log reads the trailers: {lines:?}");

    // No body at all: the headers do not end the stream, the trailers do.
    let (_, lines, _) = exchange(behaviour, with_trailers(&[]));
    assert_eq!(response_side(&lines), ["H0", "T02:tv"]);
}

#[test]
fn data_held_by_the_filter_is_readable_in_the_trailers_callback_and_goes_out_before_them() {
    let behaviour = Behaviour { response_body: BUFFER, trailers: Some(TRAILERS_EDIT), ..Behaviour::default() };
    let (outcome, lines, _) = exchange(behaviour, with_trailers(&["ab", "c"]));
    // Never an end-of-stream body call: BUFFER holds every chunk, the trailers callback sees them.
    assert_eq!(response_side(&lines), ["H0", "B020:ab", "B030:abc", "T02:tv"]);
    assert!(lines.contains(&"b:abc".to_string()), "{lines:?}");
    assert_eq!(outcome.body(), b"abc");
}

#[test]
fn a_module_without_the_trailers_callback_lets_them_through() {
    let (outcome, lines, _) = exchange(Behaviour::default(), with_trailers(&["ab"]));
    assert_eq!(response_side(&lines), ["H0", "B020:ab"]);
    assert!(lines.contains(&"L0:tv".to_string()), "{lines:?}");
    assert_eq!(outcome.body(), b"ab");
    assert_eq!(trailers(&outcome), [("grpc-status".to_string(), "0".to_string()), ("x-t".into(), "tv".into())]);
}

#[test]
fn a_paused_trailers_callback_waits_for_proxy_continue_stream() {
    // The trailers callback answers StopIteration and starts the tick; the tick continues the response.
    let behaviour = Behaviour {
        trailers: Some("(drop (call $tick (i32.const 5))) (i32.const 1)"),
        tick: "(call $effective) (drop (call $continue (i32.const 1)))",
        ..Behaviour::default()
    };
    let (outcome, lines, _) = exchange(behaviour, with_trailers(&["ab"]));
    assert_eq!(response_side(&lines), ["H0", "B020:ab", "T02:tv"]);
    assert!(lines.contains(&"K0".to_string()), "{lines:?}");
    assert_eq!(outcome.kind(), "continued");
    assert_eq!(header(&trailers(&outcome), "grpc-status"), Some("0"));
}

#[test]
fn serve_lines_carry_body_chunks_and_trailers() {
    let line = r#"{"body_chunks": ["a", "b"], "response": {"body_chunks": ["x"], "trailers": [["grpc-status", "0"]]}}"#;
    let spec: RequestSpec = serde_json::from_str(line).unwrap();
    assert_eq!(spec.body_chunks, ["a", "b"]);
    let (outcome, lines, _) = exchange(Behaviour::default(), spec);
    assert_eq!(request_side(&lines), ["R0", "Q010:a", "Q010:b", "Q001:"]);
    assert_eq!(upstream(&outcome).1, "ab");
    assert_eq!(outcome.to_json()["request_body"], "ab");
    assert_eq!(outcome.to_json()["trailers"][0][1], "0");

    // A body and body chunks together are refused.
    let mut host = HostBuilder::from_bytes(module(Behaviour::default())).build().unwrap();
    let both = RequestSpec { body: Some("x".into()), body_chunks: vec!["y".into()], ..Default::default() };
    assert!(host.send_request(0, both).is_err());
}
