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
//! - [`resp`]: RESP: one [`resp::Command`] out, one bounded [`resp::Reply`] back.
//! - [`script`]: the Redisson operations as Lua scripts (SHA-1 computed by `build.rs`), the acquire
//!   command and its reply.
//! - [`limiter`]: one request's acquires across rules and the final decision.
//! - [`block`]: the exact local block after a rejection, in shared data, bounded slots.
//! - [`cache`]: per-VM limiter configs as Redis holds them, LRU-bounded.
//! - [`response`]: `Retry-After` and rate limit headers.
//!
//! The glue, behind the host seam (also hostcall-free: it runs natively against a fake host in tests):
//! - [`host`]: the [`host::Host`] trait, everything the filter needs from a proxy-wasm host.
//! - [`transport`]: how a Redis call fails ([`transport::Failure`]); [`http_bridge`] (webdis through
//!   `proxy_http_call`) and [`host_redis`] (Higress's `proxy_redis_call`) carry the calls.
//! - [`filter`]: one root context's filter: configuration, metrics, paused requests, replies by token,
//!   the deadline guard, resume or local reply.
//!
//! The module's ABI (feature `filter`, in both builds): `abi` declares the proxy-wasm hostcalls (and the
//! Higress Redis calls in the `host-redis` build), implements [`host::Host`] with them, and exports the
//! callbacks, each routed to the [`filter::Filter`] of its root context. Imports run one way:
//! `abi` → `filter` → `host_redis` / `http_bridge` → `transport`, `host`.
//!
//! On wasm32 the crate is `no_std` (with `alloc`): the module carries no std runtime (panic printing, I/O
//! errors, environment access), only its own panic handler (a trap) and allocator (`dlmalloc`), below.
//! Native builds (tests, `erl-admin`) and every test build use std.

#![cfg_attr(all(target_arch = "wasm32", not(test)), no_std)]

extern crate alloc;

pub mod block;
pub mod cache;
pub mod config;
pub mod encoding;
pub mod fallback;
pub mod filter;
pub mod host;
pub mod host_redis;
pub mod http_bridge;
pub mod id_map;
pub mod key;
pub mod lease;
pub mod limiter;
pub mod matching;
pub mod quote;
pub mod resp;
pub mod response;
pub mod script;
pub mod transport;

#[cfg(feature = "filter")]
mod abi;
mod prelude;
#[cfg(test)]
pub(crate) mod testing;

/// A panic traps the VM at once: nothing in the module panics by design (clippy denies panics, unwraps
/// and indexing), and a host logs a trap with its backtrace; printing a message would only add the std
/// runtime to the module.
#[cfg(all(target_arch = "wasm32", not(test)))]
#[panic_handler]
fn panic(_: &core::panic::PanicInfo<'_>) -> ! {
    core::arch::wasm32::unreachable()
}

// wasi-libc, from the toolchain's wasm32-wasip1 sysroot, for the C memory functions the compiler calls
// (`memcmp`; std links it on its own): otherwise the module would import `env.memcmp`, which no host has.
#[cfg(all(target_os = "wasi", not(test)))]
#[link(name = "c")]
extern "C" {}

/// The module's allocator: `dlmalloc`, as Rust's std uses on wasm32-unknown-unknown.
#[cfg(all(target_arch = "wasm32", not(test)))]
#[global_allocator]
static ALLOCATOR: dlmalloc::GlobalDlmalloc = dlmalloc::GlobalDlmalloc;
