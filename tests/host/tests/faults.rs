//! Faults injected on purpose (`Faults`, `HostBuilder::faults`, `Host::set_faults`) and the guest's clock
//! (`HostBuilder::clock_offset`, `Host::advance_clock`), with WAT modules that report what they saw in
//! the status of a local reply, against a real redis-server and a real HTTP server.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use crate::common;

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use common::{addr, effective_context_module, wat_bytes, PyLikeUpstream, RedisServer, WAT_HEAD};
use proxy_wasm_host::abi::encode_pairs;
use proxy_wasm_host::{CallTokens, Faults, Host, HostBuilder, LogLevel, LogSource, Outcome, RequestSpec};

/// Which call the call module makes per request.
enum Via {
    /// `proxy_redis_call("redis", query)` (after `proxy_redis_init("redis")`).
    Redis(Vec<u8>),
    /// `proxy_http_call("up", GET /)`, timeout 1 s.
    Http,
}

/// A module that makes one call per request and answers in the call's callback with a local reply on the
/// request's stream: 200 if the callback got the token the call returned, 299 if it got that token plus
/// 1 000 000, 298 for any other token; 700 + status if the call itself failed.
fn call_module(via: &Via) -> Vec<u8> {
    let (cluster, payload, call) = match via {
        Via::Redis(query) => (
            "redis",
            query.clone(),
            format!(
                "(call $redis_call (i32.const 1024) (i32.const 5) (i32.const 2048) (i32.const {}) (i32.const 24))",
                query.len()
            ),
        ),
        Via::Http => {
            let pairs: Vec<(Vec<u8>, Vec<u8>)> =
                [(":method", "GET"), (":path", "/"), (":authority", "up")].map(|(k, v)| (k.into(), v.into())).into();
            let headers = encode_pairs(&pairs);
            let call = format!(
                "(call $http_call (i32.const 1024) (i32.const 2) (i32.const 2048) (i32.const {}) (i32.const 0) (i32.const 0) \
                 (i32.const 0) (i32.const 0) (i32.const 1000) (i32.const 24))",
                headers.len()
            );
            ("up", headers, call)
        }
    };
    wat::parse_str(format!(
        r#"(module
  (import "env" "proxy_redis_init" (func $redis_init (param i32 i32 i32 i32 i32 i32 i32) (result i32)))
  (import "env" "proxy_redis_call" (func $redis_call (param i32 i32 i32 i32 i32) (result i32)))
  (import "env" "proxy_http_call" (func $http_call (param i32 i32 i32 i32 i32 i32 i32 i32 i32 i32) (result i32)))
  (import "env" "proxy_set_effective_context" (func $set_effective (param i32) (result i32)))
  (import "env" "proxy_send_local_response" (func $local_response (param i32 i32 i32 i32 i32 i32 i32 i32) (result i32)))
  {WAT_HEAD}
  (global $ctx (mut i32) (i32.const 0))
  (data (i32.const 1024) "{cluster}")
  (data (i32.const 2048) "{payload}")
  (func $reply (param $status i32)
    (drop (call $local_response (local.get $status) (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 0)
      (i32.const 0) (i32.const 0) (i32.const -1))))
  (func (export "proxy_on_configure") (param i32 i32) (result i32)
    (drop (call $redis_init (i32.const 1024) (i32.const {cluster_len}) (i32.const 0) (i32.const 0) (i32.const 0)
      (i32.const 0) (i32.const 1000)))
    (i32.const 1))
  (func (export "proxy_on_request_headers") (param $ctx i32) (param i32 i32) (result i32)
    (local $r i32)
    (global.set $ctx (local.get $ctx))
    (local.set $r {call})
    (if (i32.ne (local.get $r) (i32.const 0)) (then (call $reply (i32.add (i32.const 700) (local.get $r)))))
    (i32.const 1))
  (func $answer (param $token i32)
    (local $code i32)
    (local.set $code (i32.const 298))
    (if (i32.eq (local.get $token) (i32.load (i32.const 24))) (then (local.set $code (i32.const 200))))
    (if (i32.eq (local.get $token) (i32.add (i32.load (i32.const 24)) (i32.const 1000000)))
      (then (local.set $code (i32.const 299))))
    (drop (call $set_effective (global.get $ctx)))
    (call $reply (local.get $code)))
  (func (export "proxy_on_redis_call_response") (param i32) (param $token i32) (param i32 i32)
    (call $answer (local.get $token)))
  (func (export "proxy_on_http_call_response") (param i32) (param $token i32) (param i32 i32 i32)
    (call $answer (local.get $token))))"#,
        cluster = wat_bytes(cluster.as_bytes()),
        cluster_len = cluster.len(),
        payload = wat_bytes(&payload),
    ))
    .unwrap()
}

fn fault_lines(host: &Host) -> Vec<String> {
    host.logs()
        .into_iter()
        .filter(|l| l.source == LogSource::Host && l.level == LogLevel::Debug && l.message.starts_with("fault: "))
        .map(|l| l.message)
        .collect()
}

fn status(host: &mut Host) -> Option<u16> {
    host.send_request(0, RequestSpec::default()).unwrap().status()
}

#[test]
fn refused_effective_contexts_count_down_then_work_again() {
    let mut plain = HostBuilder::from_bytes(effective_context_module()).build().unwrap();
    assert_eq!(status(&mut plain), Some(200), "no fault by default");
    assert_eq!(plain.faults(), Faults::default());

    let faults = Faults { refuse_effective_context: 2, ..Faults::NONE };
    let mut host = HostBuilder::from_bytes(effective_context_module()).faults(faults).build().unwrap();
    assert_eq!(status(&mut host), Some(202), "BadArgument");
    assert_eq!(host.faults().refuse_effective_context, 1);
    assert_eq!(status(&mut host), Some(202));
    assert_eq!(status(&mut host), Some(200), "works again after 2 refusals");
    assert_eq!(host.faults(), Faults::NONE);
    let lines = fault_lines(&host);
    assert_eq!(lines.len(), 2, "{lines:?}");
    assert!(lines[0].contains("proxy_set_effective_context") && lines[0].contains("(1 more)"), "{lines:?}");

    host.set_faults(Faults { refuse_effective_context: u32::MAX, ..Faults::NONE });
    for _ in 0..3 {
        assert_eq!(status(&mut host), Some(202), "always");
    }
    assert_eq!(host.faults().refuse_effective_context, u32::MAX);
    host.set_faults(Faults::NONE);
    assert_eq!(status(&mut host), Some(200));
}

fn redis_host(redis: &RedisServer, query: &[&[u8]], faults: Faults) -> Host {
    HostBuilder::from_bytes(call_module(&Via::Redis(common::resp(query))))
        .cluster("redis", addr(redis.port()))
        .pause_deadline(Duration::from_millis(300))
        .faults(faults)
        .build()
        .unwrap()
}

#[test]
fn dropped_redis_replies_leave_the_request_paused_though_the_query_ran() {
    let redis = RedisServer::start().unwrap();
    let mut host = redis_host(&redis, &[b"INCR", b"n"], Faults { drop_redis_replies: true, ..Faults::NONE });
    let outcome = host.send_request(0, RequestSpec::default()).unwrap();
    assert!(matches!(outcome, Outcome::Paused { .. }), "{outcome:?}");
    assert_eq!(outcome.cost().unwrap().redis_calls, 1, "the call was accepted");
    assert_eq!(redis.command(&[b"GET", b"n"]).unwrap(), b"$1\r\n1\r\n", "the query reached Redis");
    assert_eq!(fault_lines(&host), vec!["fault: the Redis reply to call 1 is dropped"]);

    host.set_faults(Faults::NONE);
    assert_eq!(status(&mut host), Some(200), "delivered again");
    assert_eq!(redis.command(&[b"GET", b"n"]).unwrap(), b"$1\r\n2\r\n");
}

#[test]
fn dropped_http_call_responses_leave_the_request_paused_though_the_call_ran() {
    let upstream = PyLikeUpstream::start();
    let mut host = HostBuilder::from_bytes(call_module(&Via::Http))
        .cluster("up", addr(upstream.port))
        .pause_deadline(Duration::from_millis(300))
        .faults(Faults { drop_http_call_responses: true, drop_redis_replies: false, ..Faults::NONE })
        .build()
        .unwrap();
    let outcome = host.send_request(0, RequestSpec::default()).unwrap();
    assert!(matches!(outcome, Outcome::Paused { .. }), "{outcome:?}");
    assert_eq!(outcome.cost().unwrap().http_calls, 1);
    assert_eq!(upstream.hits(), 1, "the request went out");
    assert_eq!(fault_lines(&host), vec!["fault: the HTTP call response to call 1 is dropped"]);

    host.set_faults(Faults::NONE);
    assert_eq!(status(&mut host), Some(200));
    assert_eq!(upstream.hits(), 2);
}

#[test]
fn misrouted_replies_carry_a_token_the_guest_never_got() {
    let redis = RedisServer::start().unwrap();
    let misroute = Faults { misroute_tokens: true, ..Faults::NONE };
    let mut host = redis_host(&redis, &[b"PING"], misroute);
    assert_eq!(status(&mut host), Some(299), "Redis: token + 1 000 000");
    assert_eq!(fault_lines(&host), vec!["fault: the Redis reply to call 1 is delivered with token 1000001"]);
    host.set_faults(Faults::NONE);
    assert_eq!(status(&mut host), Some(200));

    let upstream = PyLikeUpstream::start();
    let mut http = HostBuilder::from_bytes(call_module(&Via::Http))
        .cluster("up", addr(upstream.port))
        .faults(misroute)
        .build()
        .unwrap();
    assert_eq!(status(&mut http), Some(299), "HTTP: token + 1 000 000");
    http.set_faults(Faults::NONE);
    assert_eq!(status(&mut http), Some(200));
}

/// The fate of a reply is decided when the call is made: Redis holds the reply (`CLIENT PAUSE`) past the
/// request's pause deadline, and the fault changes before the reply comes.
#[test]
fn what_happens_to_a_reply_is_decided_when_the_call_is_made() {
    let redis = RedisServer::start().unwrap();
    let mut host = redis_host(&redis, &[b"PING"], Faults { drop_redis_replies: true, ..Faults::NONE });
    redis.command(&[b"CLIENT", b"PAUSE", b"700", b"ALL"]).unwrap();
    let outcome = host.send_request(0, RequestSpec::default()).unwrap();
    assert!(matches!(outcome, Outcome::Paused { .. }), "{outcome:?}");
    host.set_faults(Faults::NONE);
    host.run_for(Duration::from_millis(1500));
    assert_eq!(fault_lines(&host), vec!["fault: the Redis reply to call 1 is dropped"], "made under the fault");

    redis.command(&[b"CLIENT", b"PAUSE", b"700", b"ALL"]).unwrap();
    let outcome = host.send_request(0, RequestSpec::default()).unwrap();
    assert!(matches!(outcome, Outcome::Paused { .. }), "{outcome:?}");
    host.set_faults(Faults { drop_redis_replies: true, misroute_tokens: true, ..Faults::NONE });
    host.run_for(Duration::from_millis(1500));
    assert_eq!(fault_lines(&host).len(), 1, "made without a fault: delivered as it was");
}

/// A module whose request callback makes one HTTP call (`up`, GET /) and one Redis call (`redis`, PING) and,
/// once both callbacks came, answers with a local reply whose body is four little-endian u32: the tokens
/// `proxy_http_call` and `proxy_redis_call` gave, then the tokens `proxy_on_http_call_response` and
/// `proxy_on_redis_call_response` got. 700 + s: a call answered s.
fn both_calls_module() -> Vec<u8> {
    let pairs: Vec<(Vec<u8>, Vec<u8>)> =
        [(":method", "GET"), (":path", "/"), (":authority", "up")].map(|(k, v)| (k.into(), v.into())).into();
    let headers = encode_pairs(&pairs);
    let query = common::resp(&[b"PING"]);
    wat::parse_str(format!(
        r#"(module
  (import "env" "proxy_redis_init" (func $redis_init (param i32 i32 i32 i32 i32 i32 i32) (result i32)))
  (import "env" "proxy_redis_call" (func $redis_call (param i32 i32 i32 i32 i32) (result i32)))
  (import "env" "proxy_http_call" (func $http_call (param i32 i32 i32 i32 i32 i32 i32 i32 i32 i32) (result i32)))
  (import "env" "proxy_set_effective_context" (func $set_effective (param i32) (result i32)))
  (import "env" "proxy_send_local_response" (func $local_response (param i32 i32 i32 i32 i32 i32 i32 i32) (result i32)))
  {WAT_HEAD}
  (global $ctx (mut i32) (i32.const 0))
  (global $seen (mut i32) (i32.const 0))
  (data (i32.const 1024) "up")
  (data (i32.const 1040) "redis")
  (data (i32.const 2048) "{headers}")
  (data (i32.const 2560) "{query}")
  (func $reply (param $status i32) (param $body i32) (param $size i32)
    (drop (call $local_response (local.get $status) (i32.const 0) (i32.const 0) (local.get $body) (local.get $size)
      (i32.const 0) (i32.const 0) (i32.const -1))))
  (func (export "proxy_on_configure") (param i32 i32) (result i32)
    (drop (call $redis_init (i32.const 1040) (i32.const 5) (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 0)
      (i32.const 1000)))
    (i32.const 1))
  (func (export "proxy_on_request_headers") (param $ctx i32) (param i32 i32) (result i32)
    (local $r i32)
    (global.set $ctx (local.get $ctx))
    (global.set $seen (i32.const 0))
    (local.set $r (call $http_call (i32.const 1024) (i32.const 2) (i32.const 2048) (i32.const {headers_len})
      (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 1000) (i32.const 32)))
    (if (i32.eqz (local.get $r))
      (then (local.set $r (call $redis_call (i32.const 1040) (i32.const 5) (i32.const 2560) (i32.const {query_len})
        (i32.const 36)))))
    (if (local.get $r) (then (call $reply (i32.add (i32.const 700) (local.get $r)) (i32.const 0) (i32.const 0))))
    (i32.const 1))
  (func $got (param $at i32) (param $token i32)
    (i32.store (local.get $at) (local.get $token))
    (global.set $seen (i32.add (global.get $seen) (i32.const 1)))
    (if (i32.eq (global.get $seen) (i32.const 2))
      (then
        (drop (call $set_effective (global.get $ctx)))
        (call $reply (i32.const 200) (i32.const 32) (i32.const 16)))))
  (func (export "proxy_on_http_call_response") (param i32) (param $token i32) (param i32 i32 i32)
    (call $got (i32.const 40) (local.get $token)))
  (func (export "proxy_on_redis_call_response") (param i32) (param $token i32) (param i32 i32)
    (call $got (i32.const 44) (local.get $token))))"#,
        headers = wat_bytes(&headers),
        headers_len = headers.len(),
        query = wat_bytes(&query),
        query_len = query.len(),
    ))
    .unwrap()
}

/// [HTTP token given, Redis token given, token the HTTP callback got, token the Redis callback got] of one
/// request of [`both_calls_module`].
fn tokens(host: &mut Host) -> [u32; 4] {
    let outcome = host.send_request(0, RequestSpec::default()).unwrap();
    let body = outcome.body();
    assert_eq!((outcome.status(), body.len()), (Some(200), 16), "{outcome:?}");
    std::array::from_fn(|i| u32::from_le_bytes(body[i * 4..i * 4 + 4].try_into().unwrap()))
}

/// `HostBuilder::call_tokens`: under `PerKind` the first HTTP call and the first Redis call of a VM get the
/// same token, and each reply still reaches its own callback with it (faults too); `Shared` (the default)
/// numbers both kinds from one counter; `Envoy` as Envoy and Higress (HTTP 4, 8...; Redis 7, 11...).
#[test]
fn call_tokens_per_kind_give_an_http_and_a_redis_call_the_same_token() {
    let (redis, upstream) = (RedisServer::start().unwrap(), PyLikeUpstream::start());
    let host = |numbering: CallTokens, faults: Faults| {
        HostBuilder::from_bytes(both_calls_module())
            .cluster("redis", addr(redis.port()))
            .cluster("up", addr(upstream.port))
            .pause_deadline(Duration::from_millis(300))
            .call_tokens(numbering)
            .faults(faults)
            .build()
            .unwrap()
    };
    let mut shared = HostBuilder::from_bytes(both_calls_module())
        .cluster("redis", addr(redis.port()))
        .cluster("up", addr(upstream.port))
        .build()
        .unwrap();
    assert_eq!(tokens(&mut shared), [1, 2, 1, 2], "one counter by default");
    assert_eq!(tokens(&mut host(CallTokens::Shared, Faults::NONE)), [1, 2, 1, 2]);
    assert_eq!(tokens(&mut host(CallTokens::Envoy, Faults::NONE)), [4, 7, 4, 7]);

    let mut per_kind = host(CallTokens::PerKind, Faults::NONE);
    assert_eq!(tokens(&mut per_kind), [1, 1, 1, 1]);
    assert_eq!(tokens(&mut per_kind), [2, 2, 2, 2]);

    let mut misrouted = host(CallTokens::PerKind, Faults { misroute_tokens: true, ..Faults::NONE });
    assert_eq!(tokens(&mut misrouted), [1, 1, 1_000_001, 1_000_001]);
    // Redis holds its reply until the HTTP response came: the doomed Redis call 1 must not doom HTTP call 1.
    let mut dropped = host(CallTokens::PerKind, Faults { drop_redis_replies: true, ..Faults::NONE });
    redis.command(&[b"CLIENT", b"PAUSE", b"150", b"ALL"]).unwrap();
    let outcome = dropped.send_request(0, RequestSpec::default()).unwrap();
    assert!(matches!(outcome, Outcome::Paused { .. }), "only the HTTP callback came: {outcome:?}");
    assert_eq!(fault_lines(&dropped), vec!["fault: the Redis reply to call 1 is dropped"]);
    dropped.set_faults(Faults::NONE);
    assert_eq!(tokens(&mut dropped), [2, 2, 2, 2]);
}

/// A module whose request callback answers with a local reply whose body is three little-endian u64: what
/// `proxy_get_current_time_nanoseconds`, WASI `clock_time_get(realtime)` and `clock_time_get(monotonic)`
/// answered.
fn clock_module() -> Vec<u8> {
    wat::parse_str(format!(
        r#"(module
  (import "env" "proxy_get_current_time_nanoseconds" (func $now (param i32) (result i32)))
  (import "wasi_snapshot_preview1" "clock_time_get" (func $clock (param i32 i64 i32) (result i32)))
  (import "env" "proxy_send_local_response" (func $reply (param i32 i32 i32 i32 i32 i32 i32 i32) (result i32)))
  {WAT_HEAD}
  (func (export "proxy_on_configure") (param i32 i32) (result i32) (i32.const 1))
  (func (export "proxy_on_request_headers") (param i32 i32 i32) (result i32)
    (drop (call $now (i32.const 32)))
    (drop (call $clock (i32.const 0) (i64.const 1) (i32.const 40)))
    (drop (call $clock (i32.const 1) (i64.const 1) (i32.const 48)))
    (drop (call $reply (i32.const 200) (i32.const 0) (i32.const 0) (i32.const 32) (i32.const 24)
      (i32.const 0) (i32.const 0) (i32.const -1)))
    (i32.const 1)))"#
    ))
    .unwrap()
}

/// (proxy time, WASI realtime, WASI monotonic) in ns, and real time around the request.
fn clocks(host: &mut Host) -> ([u64; 3], u64, u64) {
    let real = || u64::try_from(SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_nanos()).unwrap();
    let before = real();
    let outcome = host.send_request(0, RequestSpec::default()).unwrap();
    let after = real();
    let body = outcome.body();
    assert_eq!(body.len(), 24, "{outcome:?}");
    let word = |i: usize| u64::from_le_bytes(body[i * 8..i * 8 + 8].try_into().unwrap());
    ([word(0), word(1), word(2)], before, after)
}

#[test]
fn the_guest_wall_clock_runs_ahead_by_the_offset_and_the_monotonic_clock_does_not() {
    let hour = Duration::from_secs(3600);
    let ns = |d: Duration| u64::try_from(d.as_nanos()).unwrap();
    let mut plain = HostBuilder::from_bytes(clock_module()).build().unwrap();
    let ([proxy, wasi, _], before, after) = clocks(&mut plain);
    assert!((before..=after).contains(&proxy) && (before..=after).contains(&wasi), "real time by default");

    let mut host = HostBuilder::from_bytes(clock_module()).clock_offset(hour).build().unwrap();
    assert_eq!(host.clock_offset(), hour);
    let ([proxy, wasi, mono1], before, after) = clocks(&mut host);
    let ahead = before + ns(hour)..=after + ns(hour);
    assert!(ahead.contains(&proxy), "proxy_get_current_time_nanoseconds: {proxy} not in {ahead:?}");
    assert!(ahead.contains(&wasi), "clock_time_get(realtime): {wasi} not in {ahead:?}");

    assert_eq!(host.advance_clock(Duration::from_millis(90 * 60_000)), hour + Duration::from_secs(90 * 60));
    let ([proxy, wasi, mono2], before, after) = clocks(&mut host);
    let total = ns(host.clock_offset());
    assert_eq!(total, ns(Duration::from_secs(150 * 60)));
    assert!((before + total..=after + total).contains(&proxy), "{proxy}");
    assert!((before + total..=after + total).contains(&wasi), "{wasi}");
    assert!(mono2 >= mono1 && mono2 - mono1 < ns(Duration::from_secs(60)), "monotonic stays real: {mono1} {mono2}");
}
