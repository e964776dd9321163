//! The filter's host-redis build (Redis through Higress's `proxy_redis_call`) against a real Redis (the
//! extension itself is covered by `redis_extension.rs`).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use crate::common;

use std::time::Duration;

use common::{addr, host_redis_filter, RedisServer};
use proxy_wasm_host::{HostBuilder, Outcome, RequestSpec};
use serde_json::json;

#[test]
fn rate_limiting_through_the_host_redis_interface() {
    let module = host_redis_filter();
    let redis = RedisServer::start().unwrap();
    let config = json!({
        "redis": {"transport": "host", "service_name": "redis.static", "service_port": 6379, "timeout": "500ms", "database": 2},
        "rules": [{"name": "per-user", "limit_by": {"header": "x-user-id"}, "rate": 3, "interval": "1m"}],
    });
    let mut host = HostBuilder::new(module)
        .plugin_config(config.to_string())
        .vms(2)
        .cluster("outbound|6379||redis.static", addr(redis.port()))
        .pause_deadline(Duration::from_secs(5))
        .build()
        .unwrap();
    assert!(host.refusal().is_none(), "{:?}", host.refusal());
    let alice = || RequestSpec::with_headers(&[("x-user-id", "alice")]);
    for vm in [0, 1, 0] {
        let outcome = host.send_request(vm, alice()).unwrap();
        assert_eq!(outcome.status(), Some(200), "{outcome:?}\n{:#?}", host.logs());
        let cost = outcome.cost().unwrap();
        assert_eq!(cost.http_calls, 0);
        assert!(cost.redis_calls >= 1, "{cost:?}");
    }
    let rejected = host.send_request(1, alice()).unwrap();
    assert!(matches!(rejected, Outcome::LocalReply { status: 429, .. }), "{rejected:?}");
    assert!(rejected.header("retry-after").is_some());
    assert_eq!(rejected.cost().unwrap().redis_calls, 1, "one round trip once the script is loaded");
    assert_eq!(redis.command_in_db(2, &[b"HGET", b"erl:per-user:alice", b"rate"]).unwrap(), b"$1\r\n3\r\n");
}
