//! Bodies and trailers as Envoy 1.40 hands them to a filter, with a WAT module that logs every callback:
//! response trailers (`ResponseSpec::trailers`) ending the stream with `proxy_on_response_trailers`.

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

/// The lines of the response's side (response headers, body, trailers).
fn response_side(lines: &[String]) -> Vec<&str> {
    lines.iter().map(String::as_str).filter(|l| l.starts_with(['H', 'B', 'T'])).collect()
}

fn trailers(outcome: &Outcome) -> Vec<(String, String)> {
    match outcome {
        Outcome::Continued { response_trailers, .. } => response_trailers.clone(),
        other => panic!("not continued: {}", other.to_json()),
    }
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
