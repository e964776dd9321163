//! Redisson parity tests: the project's Lua scripts on a real `redis-server` against an independent model
//! of Redisson 4.x `RRateLimiter` (DESIGN.md, "Facts: Redisson's RRateLimiter layout").
//!
//! - [`model`]: the oracle, a pure model of one limiter and its Redis keys, written from DESIGN.md, the
//!   seed articles and Redisson's `RedissonRateLimiter.java`, not from `src/script.rs`.
//! - [`redis_server`]: one real `redis-server` per test on a free loopback port, stopped by PID on drop.
//! - [`properties`]: random operation sequences on a virtual clock, model and scripts compared after every
//!   step (replies, hash, values, members, TTLs).
//! - [`scenarios`]: Redisson's documented behaviour, scenario by scenario (sliding window, trySetRate,
//!   permits above the rate, availablePermits, keepAlive, Redis `TIME` and skewed clocks), on virtual
//!   times but for keepAlive, which waits for Redis's real TTLs.
//! - [`settle`]: "reserve, then settle" (GIVE_BACK with a cost below, at or above the reservation, a
//!   renamed member, a member already gone, a lease settled inside ACQUIRE), with the sum invariant.
//!
//! Run: `cargo test --no-default-features --test parity` (needs `redis-server` on the `PATH`).

mod batch;
mod counter;
mod model;
mod properties;
mod redis_server;
mod scenarios;
mod settle;
