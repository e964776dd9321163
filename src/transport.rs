//! The transport seam: how carrying one RESP command to Redis and its reply back can fail. Two
//! transports, one shape: [`crate::http_bridge`] (webdis through `proxy_http_call`, the stock Envoy /
//! Istio build) and [`crate::host_redis`] (Higress's `proxy_redis_call`). Both send through the
//! [`crate::host::Host`] and return the host's token; the reply (or failure) arrives later, in a
//! callback of the root context, and the filter matches it to its request by the call's kind and that
//! token ([`CallId`]). Host statuses and bridge HTTP statuses become [`Failure`]s.

use crate::prelude::*;

use core::fmt;

use crate::host::HostError;
use crate::quote::quoted;

/// Which callback a call's reply comes through (`proxy_on_http_call_response` or
/// `proxy_on_redis_call_response`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallKind {
    /// `proxy_http_call` (the HTTP bridge).
    Http,
    /// `proxy_redis_call` (Higress's Redis interface).
    Redis,
}

/// A call the host accepted: its kind and the host's token. Hosts number each kind of call on a counter
/// of its own (Envoy's proxy-wasm-cpp-host `nextHttpCallId`, Higress's `nextRedisCallId`; their tokens
/// differ in the low two bits today, but nothing in the ABI promises it), so a reply is matched by both.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CallId {
    /// Its kind.
    pub kind: CallKind,
    /// The host's token.
    pub token: u32,
}

impl CallId {
    /// One integer naming the call among both kinds ([`crate::id_map::CallMap`]).
    pub fn key(self) -> u64 {
        let kind: u64 = match self.kind {
            CallKind::Http => 0,
            CallKind::Redis => 1,
        };
        (kind << 32) | u64::from(self.token)
    }
}

/// Why a Redis call gave no usable reply. Each variant is one cause for once-per-cause logging.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Failure {
    /// The host refused to send the call (unknown cluster, no healthy host, client not initialised).
    SendRefused(String),
    /// The host reported no reply: the call timed out or the connection failed (it does not say which).
    NoReply,
    /// The bridge answered with an HTTP status other than 200 (webdis: 503 when Redis is down; Envoy
    /// synthesizes 504 when the call exceeds `redis.timeout`).
    BridgeStatus(u16),
    /// Redis answered with an error (`NOAUTH ...`, a Lua error...).
    RedisError(String),
    /// The reply is not what the script answers (not RESP, or another shape).
    BadReply(String),
    /// Nothing came back at all within `redis.timeout`: the filter's own deadline ended the wait (a host
    /// that accepted the call and never answered, or a reply the filter could not match).
    TimedOut,
}

impl Failure {
    /// A small number per kind of failure, for "log once per cause" bookkeeping.
    pub fn cause_index(&self) -> usize {
        match self {
            Failure::SendRefused(_) => 0,
            Failure::NoReply => 1,
            Failure::BridgeStatus(_) => 2,
            Failure::RedisError(_) => 3,
            Failure::BadReply(_) => 4,
            Failure::TimedOut => 5,
        }
    }

    /// Number of distinct [`Failure::cause_index`] values.
    pub const CAUSES: usize = 6;
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Failure::SendRefused(status) => write!(f, "the host refused the Redis call ({status})"),
            Failure::NoReply => write!(f, "no reply from Redis (timeout or connection failure)"),
            // Envoy answers a callout that exceeds its timeout with a local 504.
            Failure::BridgeStatus(504) => write!(f, "the Redis bridge timed out (HTTP 504 after redis.timeout)"),
            Failure::BridgeStatus(status) => write!(f, "the Redis bridge answered HTTP {status}"),
            // Escaped: the reply's text comes from Redis or the bridge and must not forge a log line.
            Failure::RedisError(text) => {
                write!(f, "Redis error: {}{}", crate::quote::escaped(text), cluster_hint(text))
            }
            Failure::BadReply(what) => write!(f, "{what}"),
            Failure::TimedOut => write!(f, "the host gave no answer to a Redis call within redis.timeout"),
        }
    }
}

/// What to do about a Redis Cluster error reply, or "" for other errors. `MOVED`/`ASK`: the filter reached
/// a node that does not own the limiter's slot (neither the host's Redis client nor webdis follows
/// redirections); `CROSSSLOT`: one call carried limiters of different slots.
fn cluster_hint(error: &str) -> &'static str {
    match error.split(' ').next() {
        Some("MOVED" | "ASK") => " (a Redis Cluster node not holding this limiter: use a proxy)",
        Some("CROSSSLOT") => " (set redis.redis_cluster to true)",
        _ => "",
    }
}

/// A host status as the reason of a [`Failure::SendRefused`], naming the call and the cluster.
pub(crate) fn refused(call: &str, error: HostError, cluster: &str) -> Failure {
    let why = match error {
        HostError::BadArgument => format!("BadArgument: the host knows no cluster {}", quoted(cluster)),
        HostError::InternalFailure => {
            format!("InternalFailure: no healthy host in {} (or an envoy.clusters.redis: use a proxy)", quoted(cluster))
        }
        HostError::Unimplemented => "Unimplemented: this host has no such call".to_string(),
        other => format!("{other} for {}", quoted(cluster)),
    };
    Failure::SendRefused(format!("{call}: {why}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redis_cluster_errors_say_what_to_do() {
        let moved = Failure::RedisError("MOVED 3999 127.0.0.1:7001".into()).to_string();
        assert!(moved.starts_with("Redis error: MOVED 3999 127.0.0.1:7001 (a Redis Cluster node not"), "{moved}");
        let crossslot = Failure::RedisError("CROSSSLOT Keys in request don't hash to the same slot".into());
        assert!(crossslot.to_string().ends_with("set redis.redis_cluster to true)"));
        assert_eq!(Failure::RedisError("ERR x".into()).to_string(), "Redis error: ERR x");
        let refused = refused("proxy_redis_call", HostError::InternalFailure, "redis").to_string();
        assert!(refused.contains("envoy.clusters.redis"), "{refused}");
    }
}
