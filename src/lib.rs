//! edge-rate-limiter: a proxy-wasm HTTP filter that rate-limits requests at the gateway with a
//! sliding-window acquire in Redis, byte-compatible with Redisson's `RRateLimiter` (4.x layout), so Java
//! services and the gateway can share one limiter.
//!
//! # Layout
//!
//! The pure core (no hostcalls; unit-tested natively and on wasm32 under wasm-bindgen-test):
//! - [`config`]: the plugin configuration, parsed and validated once into an immutable value.
//! - [`key`]: key values of a request (header, query, cookie, client IP, path, global), limiter names,
//!   Redisson's key layout.
//! - [`resp`]: the transport seam: one RESP [`resp::Command`] out, one [`resp::Reply`] back.
//! - [`script`]: the acquire Lua script (Redisson tryAcquire + trySetRate), its command and reply.
//! - [`limiter`]: one request's acquires across rules and the final decision.
//! - [`cache`]: per-VM limiter configs as Redis holds them, bounded.
//! - [`response`]: `Retry-After` and rate limit headers.
//!
//! The proxy-wasm glue (feature `filter`, on in the default `http-bridge` build):
//! - `transport`: the HTTP bridge (webdis) behind a small trait.
//! - `host_redis` (feature `host-redis`): the Higress host Redis interface, the same trait.
//! - `filter`: root and HTTP contexts: configuration, metrics, once-per-cause logging, pausing and
//!   resuming requests.

pub mod cache;
pub mod config;
pub mod key;
pub mod limiter;
pub mod resp;
pub mod response;
pub mod script;

#[cfg(feature = "filter")]
mod filter;
#[cfg(feature = "host-redis")]
mod host_redis;
#[cfg(feature = "filter")]
mod transport;
