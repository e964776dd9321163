//! edge-rate-limiter: a proxy-wasm HTTP filter that rate-limits requests at the gateway with a
//! sliding-window acquire in Redis, byte-compatible with Redisson's `RRateLimiter` (4.x layout), so Java
//! services and the gateway can share one limiter.
//!
//! # Layout
//!
//! Modules sit on floors and import only from their own floor or below (`scripts/check_imports.py`
//! checks it in `make lint`; docs/architecture.md walks a request through them):
//!
//! 0. Base: `prelude`, [`quote`] (quoting untrusted text in logs), [`encoding`] (base64url), [`id_map`]
//!    (maps keyed by host ids).
//! 1. Protocol and the host seam: [`resp`] (one [`resp::Command`] out, one bounded [`resp::Reply`] back),
//!    [`host`] (the [`host::Host`] trait: everything the filter needs from a proxy-wasm host), [`key`] (a
//!    request's key values, limiter names, Redisson's key layout), [`matching`] (exemptions, value
//!    matches), [`usage`] (the tokens an LLM API's response reports, read from its body as it streams),
//!    [`calendar`] (calendar periods in a time zone).
//! 2. [`config`]: the plugin configuration, parsed and validated once into an immutable value, and its
//!    route and domain overrides.
//! 3. Redis and what a VM or process keeps: [`script`] (the Redisson operations as Lua scripts, their
//!    commands and replies), [`cache`] (limiter configs as Redis holds them), [`block`] (the exact local
//!    block), [`fallback`] (the degraded mode's local windows and circuit), [`lease`] (permit leases),
//!    [`transport`] (how a call fails, and which call a reply answers), [`response`] (the verdict and every
//!    header it carries).
//! 4. [`limiter`]: one request's way through the rules, and its decision, made once.
//! 5. The transports: [`http_bridge`] (webdis through `proxy_http_call`), [`host_redis`] (Higress's
//!    `proxy_redis_call`).
//! 6. [`filter`]: one root context's filter: its routes, paused requests, replies by call, the deadline
//!    guard, resume or local reply, counters and logs.
//! 7. `abi` (feature `filter`, in both builds): the proxy-wasm hostcalls (and the Higress Redis calls in
//!    the `host-redis` build) as the one real [`host::Host`], and the callbacks the host calls, each
//!    routed to the [`filter::Filter`] of its root context.
//!
//! Floors 0-6 make no hostcall: they run natively against a fake host (`testing`) and on wasm32-wasip1
//! under Node's WASI (scripts/wasi-run.mjs).
//!
//! On wasm32 the crate is `no_std` (with `alloc`): the module carries no std runtime (panic printing, I/O
//! errors, environment access), only its own panic handler (a trap) and allocator (`dlmalloc`), below.
//! Native builds (tests, `erl-admin`) and every test build use std.

#![cfg_attr(all(target_arch = "wasm32", not(test)), no_std)]

extern crate alloc;

pub mod block;
pub mod cache;
pub mod calendar;
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
pub mod usage;

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
