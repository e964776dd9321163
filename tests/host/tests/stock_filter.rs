//! The real filter (the stock build: Redis through webdis with `proxy_http_call`) in the emulator, against
//! real webdis and redis-server: the emulator must let it do exactly what it does in Envoy.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use crate::common;

use std::time::Duration;

use common::{addr, free_port, stock_filter, RedisServer, Webdis};
use proxy_wasm_host::{Host, HostBuilder, Outcome, RequestSpec};
use serde_json::json;

fn config(rate: u64, failure_mode: &str) -> String {
    json!({
        "redis": {"cluster": "webdis", "timeout": "500ms"},
        "rules": [{"name": "per-user", "limit_by": {"header": "x-user-id"}, "rate": rate, "interval": "1m"}],
        "failure_mode": failure_mode,
    })
    .to_string()
}

fn host(webdis_port: u16, config: String, vms: usize) -> Host {
    HostBuilder::new(stock_filter())
        .plugin_config(config)
        .vms(vms)
        .cluster("webdis", addr(webdis_port))
        .pause_deadline(Duration::from_secs(5))
        .build()
        .unwrap()
}

fn alice() -> RequestSpec {
    RequestSpec::with_headers(&[("x-user-id", "alice")])
}

#[test]
fn three_pass_then_429_with_retry_after_across_vms_and_metrics_add_up() {
    let redis = RedisServer::start().unwrap();
    let webdis = Webdis::start(&redis).unwrap();
    let mut host = host(webdis.port(), config(3, "allow"), 2);
    assert!(host.refusal().is_none(), "{:?}", host.refusal());

    for vm in [0, 1, 0] {
        let outcome = host.send_request(vm, alice()).unwrap();
        assert!(matches!(outcome, Outcome::Continued { .. }), "vm {vm}: {outcome:?}\n{:#?}", host.logs());
        assert_eq!(outcome.status(), Some(200));
        assert_eq!(outcome.body(), b"upstream ok\n");
        let cost = outcome.cost().unwrap();
        assert!(cost.http_calls >= 1 && cost.fuel > 0, "{cost:?}");
    }
    let rejected = host.send_request(1, alice()).unwrap();
    match &rejected {
        Outcome::LocalReply { status, body, .. } => {
            assert_eq!(*status, 429);
            assert_eq!(body, b"rate limit exceeded\n");
        }
        other => panic!("expected 429, got {other:?}"),
    }
    let retry_after: u64 = rejected.header("retry-after").expect("retry-after").parse().unwrap();
    // A 1-minute window, and the clock guard's 20 ms on a refusal's delay (docs/redisson.md, "Clocks").
    assert!((1..=61).contains(&retry_after), "{retry_after}");
    assert_eq!(rejected.header("x-envoy-ratelimited").as_deref(), Some("true"));

    // Another user is not limited by alice's window.
    assert_eq!(host.send_request(0, RequestSpec::with_headers(&[("x-user-id", "bob")])).unwrap().status(), Some(200));

    assert_eq!(host.metric("edge_rate_limiter.allowed"), 4);
    assert_eq!(host.metric("edge_rate_limiter.rejected"), 1);
    assert!(host.metric("edge_rate_limiter.redis_calls") >= 5);
    // The filter publishes this process's Redisson client id in shared data, for every VM.
    let (id, _) = host.shared_data("edge_rate_limiter.client_id").expect("client id in shared data");
    assert_eq!(id.len(), 36, "a UUID: {}", String::from_utf8_lossy(&id));
    // Redisson's layout in Redis.
    assert_eq!(redis.command(&[b"HGET", b"erl:per-user:alice", b"rate"]).unwrap(), b"$1\r\n3\r\n");
}

#[test]
fn a_refused_configuration_is_reported_with_the_module_log() {
    let mut host = HostBuilder::new(stock_filter()).plugin_config(config(0, "allow")).build().unwrap();
    let refusal = host.refusal().expect("rate 0 is refused").to_string();
    assert!(refusal.contains("rules[0].rate"), "{refusal}");
    assert!(matches!(host.send_request(0, alice()).unwrap(), Outcome::Refused { .. }));
}

#[test]
fn a_bridge_that_refuses_connections_gets_envoys_503_and_the_filter_fails_open_or_closed() {
    let closed = free_port().unwrap();
    let mut open = host(closed, config(3, "allow"), 1);
    let outcome = open.send_request(0, alice()).unwrap();
    assert_eq!(outcome.status(), Some(200), "{outcome:?}");
    assert_eq!(open.metric("edge_rate_limiter.failure_allowed"), 1);
    assert!(open.logs().iter().any(|l| l.message.contains("HTTP 503")), "{:#?}", open.logs());

    let mut closed_host = host(closed, config(3, "deny"), 1);
    assert_eq!(closed_host.send_request(0, alice()).unwrap().status(), Some(503));
    assert_eq!(closed_host.metric("edge_rate_limiter.failure_denied"), 1);
}

#[test]
fn a_hung_bridge_times_out_with_envoys_504() {
    let hang = common::Hang::start();
    let mut host = host(hang.port, config(3, "deny"), 1);
    let started = std::time::Instant::now();
    let outcome = host.send_request(0, alice()).unwrap();
    assert_eq!(outcome.status(), Some(503), "{outcome:?}");
    let waited = started.elapsed();
    assert!(waited >= Duration::from_millis(490) && waited < Duration::from_millis(1500), "{waited:?}");
    // The filter says why it failed: the host's 504 after the call's timeout ("timed out"), or, when its own
    // timer for redis.timeout fires first (the same 500 ms), that no answer came.
    let why = |l: &proxy_wasm_host::LogLine| l.message.contains("timed out") || l.message.contains("no answer");
    assert!(host.logs().iter().any(why), "{:#?}", host.logs());
}
