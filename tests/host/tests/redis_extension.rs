//! The Higress Redis extension against a real redis-server, with a WAT module that calls
//! `proxy_redis_init`/`proxy_redis_call` and answers with what its `proxy_on_redis_call_response` saw
//! (see `common::redis_module`: status 200 + callback status, body = the raw RESP reply).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use crate::common;

use std::time::{Duration, Instant};

use common::{addr, free_port, redis_module, resp, RedisServer};
use proxy_wasm_host::{Host, HostBuilder, Outcome, RequestSpec};

fn host(redis_port: u16, service: &str, user: &str, password: &str, timeout_ms: u32, query: &[u8]) -> Host {
    HostBuilder::from_bytes(redis_module(service, user, password, timeout_ms, query))
        .cluster("redis", addr(redis_port))
        .pause_deadline(Duration::from_secs(5))
        .build()
        .unwrap()
}

fn reply(outcome: &Outcome) -> (u16, String) {
    match outcome {
        Outcome::LocalReply { status, body, .. } => (*status, String::from_utf8_lossy(body).into_owned()),
        other => panic!("expected the module's local reply, got {other:?}"),
    }
}

#[test]
fn a_call_reaches_redis_and_the_reply_comes_back_raw_on_the_root_context() {
    let redis = RedisServer::start().unwrap();
    let mut host = host(redis.port(), "redis", "", "", 1000, &resp(&[b"SET", b"k", b"v\r\n1"]));
    let outcome = host.send_request(0, RequestSpec::default()).unwrap();
    // 200: status 0, callback on the root context, buffer 9 readable during the callback (and, checked by
    // the module, not before it).
    assert_eq!(reply(&outcome), (200, "+OK\r\n".into()));
    assert_eq!(outcome.cost().unwrap().redis_calls, 1);
    assert_eq!(redis.command(&[b"GET", b"k"]).unwrap(), b"$4\r\nv\r\n1\r\n");

    let mut get = self::host(redis.port(), "redis", "", "", 1000, &resp(&[b"GET", b"missing"]));
    assert_eq!(reply(&get.send_request(0, RequestSpec::default()).unwrap()), (200, "$-1\r\n".into()));
}

#[test]
fn error_replies_arrive_with_status_0_and_the_raw_resp() {
    let redis = RedisServer::start().unwrap();
    let mut host = host(
        redis.port(),
        "redis",
        "",
        "",
        1000,
        &resp(&[b"EVALSHA", b"0000000000000000000000000000000000000000", b"0"]),
    );
    let (status, body) = reply(&host.send_request(0, RequestSpec::default()).unwrap());
    assert_eq!(status, 200);
    assert!(body.starts_with("-NOSCRIPT"), "{body}");
}

#[test]
fn auth_is_sent_on_connect_and_a_wrong_password_shows_on_the_command() {
    let redis = RedisServer::start_with_password(Some("s3cret")).unwrap();
    let query = resp(&[b"PING"]);

    let mut right = host(redis.port(), "redis", "", "s3cret", 1000, &query);
    assert_eq!(reply(&right.send_request(0, RequestSpec::default()).unwrap()), (200, "+PONG\r\n".into()));

    let mut acl_user = host(redis.port(), "redis", "default", "s3cret", 1000, &query);
    assert_eq!(reply(&acl_user.send_request(0, RequestSpec::default()).unwrap()), (200, "+PONG\r\n".into()));

    // The AUTH reply (-WRONGPASS) is dropped by the client, as Envoy's; the command then gets -NOAUTH.
    let mut wrong = host(redis.port(), "redis", "", "nope", 1000, &query);
    let (status, body) = reply(&wrong.send_request(0, RequestSpec::default()).unwrap());
    assert_eq!(status, 200);
    assert!(body.starts_with("-NOAUTH") || body.starts_with("-WRONGPASS"), "{body}");

    let mut none = host(redis.port(), "redis", "", "", 1000, &query);
    let (_, body) = reply(&none.send_request(0, RequestSpec::default()).unwrap());
    assert!(body.starts_with("-NOAUTH"), "{body}");
}

#[test]
fn db_in_the_service_selects_the_database() {
    let redis = RedisServer::start().unwrap();
    let mut host = host(redis.port(), "redis?db=2", "", "", 1000, &resp(&[b"SET", b"in-db-2", b"yes"]));
    assert_eq!(reply(&host.send_request(0, RequestSpec::default()).unwrap()), (200, "+OK\r\n".into()));
    assert_eq!(redis.command_in_db(2, &[b"GET", b"in-db-2"]).unwrap(), b"$3\r\nyes\r\n");
    assert_eq!(redis.command_in_db(0, &[b"GET", b"in-db-2"]).unwrap(), b"$-1\r\n");
}

#[test]
fn a_stalled_redis_fails_every_pending_call_with_status_1_after_the_timeout() {
    let redis = RedisServer::start().unwrap();
    let mut host = host(redis.port(), "redis", "", "", 200, &resp(&[b"PING"]));
    // Warm the connection, then stall Redis for longer than the timeout.
    assert_eq!(reply(&host.send_request(0, RequestSpec::default()).unwrap()), (200, "+PONG\r\n".into()));
    redis.command(&[b"CLIENT", b"PAUSE", b"1500", b"ALL"]).unwrap();
    let started = Instant::now();
    let outcomes = host.send_batch((0..3).map(|_| (0, RequestSpec::default())).collect()).unwrap();
    let waited = started.elapsed();
    for outcome in &outcomes {
        assert_eq!(reply(outcome), (201, String::new()), "status 1, no bytes");
    }
    assert!(waited >= Duration::from_millis(190) && waited < Duration::from_millis(900), "waited {waited:?}");

    // After the pause a new connection serves again.
    std::thread::sleep(Duration::from_millis(1500).saturating_sub(started.elapsed()) + Duration::from_millis(100));
    assert_eq!(reply(&host.send_request(0, RequestSpec::default()).unwrap()), (200, "+PONG\r\n".into()));
}

#[test]
fn a_refused_connection_is_status_1_and_an_unknown_cluster_is_bad_argument() {
    let closed = free_port().unwrap();
    let mut refused = HostBuilder::from_bytes(redis_module("redis", "", "", 1000, &resp(&[b"PING"])))
        .cluster("redis", addr(closed))
        .build()
        .unwrap();
    assert_eq!(reply(&refused.send_request(0, RequestSpec::default()).unwrap()), (201, String::new()));

    // proxy_redis_init answers BadArgument (2) for a cluster the host does not know.
    let mut unknown = HostBuilder::from_bytes(redis_module("nowhere", "", "", 1000, &resp(&[b"PING"])))
        .cluster("redis", addr(closed))
        .build()
        .unwrap();
    assert_eq!(reply(&unknown.send_request(0, RequestSpec::default()).unwrap()).0, 602);
}

#[test]
fn a_redis_cluster_cluster_is_initialised_but_every_call_is_internal_failure() {
    // Higress's client picks a host without a hash key; envoy.clusters.redis gives none (src/redis.rs).
    let redis = RedisServer::start().unwrap();
    let mut host = HostBuilder::from_bytes(redis_module("redis", "", "", 1000, &resp(&[b"GET", b"{a}b"])))
        .redis_cluster("redis", vec![addr(redis.port())])
        .build()
        .unwrap();
    assert_eq!(reply(&host.send_request(0, RequestSpec::default()).unwrap()), (710, String::new()));
    let bad = HostBuilder::from_bytes(redis_module("redis", "", "", 1000, &resp(&[b"PING"])))
        .redis_cluster_spec("redis=127.0.0.1:1,10.0.0.1:2");
    assert!(bad.is_err(), "only loopback seeds");
}

#[test]
fn each_vm_has_its_own_client_and_replies_go_to_the_right_vm() {
    let redis = RedisServer::start().unwrap();
    let mut host = HostBuilder::from_bytes(redis_module("redis", "", "", 1000, &resp(&[b"INCR", b"n"])))
        .cluster("redis", addr(redis.port()))
        .vms(3)
        .build()
        .unwrap();
    let requests = (0..9).map(|i| (i % 3, RequestSpec::default())).collect();
    let outcomes = host.send_batch(requests).unwrap();
    let mut seen: Vec<i64> = outcomes
        .iter()
        .map(|o| {
            let (status, body) = reply(o);
            assert_eq!(status, 200);
            body.trim_start_matches(':').trim().parse().unwrap()
        })
        .collect();
    seen.sort();
    assert_eq!(seen, (1..=9).collect::<Vec<_>>());
    // One connection per VM (plus the one counting).
    let clients = String::from_utf8(redis.command(&[b"CLIENT", b"LIST"]).unwrap()).unwrap();
    assert_eq!(clients.matches("cmd=incr").count(), 3, "{clients}");
}
