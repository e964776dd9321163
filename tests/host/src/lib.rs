//! A proxy-wasm host emulator, faithful to Envoy (1.40) and to Higress's Redis extension, for testing and
//! measuring proxy-wasm filters without a gateway. It plays one of three hosts ([`HostFlavour`]): stock
//! Envoy 1.40, its original mix of Envoy and Higress's Redis extension (the default), or Higress, whose
//! ABI 0.2.100, extra hostcalls, foreign function and properties run real Higress (wasm-go) plugins.
//!
//! It loads a module (ABI `proxy_abi_version_0_2_1` or `_0_2_100`) into K VMs on wasmtime, starts them as
//! Envoy does, and plays HTTP streams through them: the filter's HTTP calls go to real HTTP/1.1 servers,
//! its Redis calls to a real Redis, and every request reports how it ended ([`Outcome`]) and what it cost
//! the guest ([`Cost`]: wasmtime fuel, Redis and HTTP round trips).
//!
//! ```no_run
//! use proxy_wasm_host::{HostBuilder, RequestSpec};
//! # fn main() -> Result<(), proxy_wasm_host::HostError> {
//! let mut host = HostBuilder::new("filter.wasm")
//!     .plugin_config(r#"{"redis": {"cluster": "webdis"}, "rules": []}"#)
//!     .vms(2)
//!     .cluster_spec("webdis=127.0.0.1:7379")?
//!     .build()?;
//! let outcome = host.send_request(0, RequestSpec::with_headers(&[("x-user-id", "alice")]))?;
//! println!("{} {:?} fuel {:?}", outcome.kind(), outcome.status(), outcome.cost().map(|c| c.fuel));
//! # Ok(()) }
//! ```
//!
//! # Layout
//!
//! - [`host`]: [`HostBuilder`], [`Host`]: loading, VM start, the event loop (replies, ticks, deadlines).
//! - `stream`: one HTTP stream through the filter, callback by callback, as Envoy drives it.
//! - [`exchange`]: [`RequestSpec`] in, [`Outcome`] and [`Cost`] out.
//! - [`vm`]: a VM's state as hostcalls see it: contexts, maps, deferred actions, callback-only buffers.
//! - [`flavour`]: [`HostFlavour`], which host is played (Envoy 1.40, the original mix, Higress); [`higress`]:
//!   what Higress adds (hostcalls, a foreign function, a property).
//! - [`hostcalls`]: the `env.proxy_*` functions; [`wasi`]: the WASI functions Envoy (or Higress) provides.
//! - [`http_call`]: `proxy_http_call` over real HTTP/1.1, with Envoy's synthesized 503/504.
//! - [`redis`]: Higress's `proxy_redis_init`/`proxy_redis_call` over real Redis connections.
//! - [`properties`]: `proxy_get_property` attributes, encoded as Envoy encodes them.
//! - [`shared`]: what VMs share: shared data (CAS), queues, metrics, the log, the faults in force and the
//!   guest's clock offset.
//! - [`faults`]: [`Faults`], misbehaviour injected on purpose (refused `proxy_set_effective_context`,
//!   dropped or misrouted replies), off by default.
//! - [`tokens`]: [`CallTokens`], how call tokens are numbered (one counter, one per kind, or Envoy's and
//!   Higress's typed counters).
//! - [`memory`]: bounds-checked guest memory and guest allocation.
//! - [`abi`]: status codes, enums and wire formats of the ABI.
//! - [`summary`]: distributions for reports (mean, p50, p99).
//! - [`profile`]: the per-function fuel profile: instruments the module, records fuel by function.
//!
//! # Sources of facts
//!
//! Every behaviour follows proxy-wasm-cpp-host and Envoy's `source/extensions/common/wasm`, and was
//! checked where possible in Envoy 1.40 with the probe module in `probe/` (its observations are in
//! `probe/envoy-1.40-observed.txt`; `tests/envoy_parity.rs` replays them against this host). The Redis
//! extension follows DESIGN.md and Higress's Envoy fork; the Higress flavour follows Higress's forks of
//! proxy-wasm-cpp-host and Envoy and its Go SDK ([`flavour`], [`wasi`]). Each module says which facts it
//! relies on.

// wasmi's function and memory handles are Copy, wasmtime's are not: the emulator clones them, for both
// engines (src/engine.rs).
#![cfg_attr(not(feature = "wasmtime"), allow(clippy::clone_on_copy))]

pub mod abi;
pub mod engine;
pub mod error;
pub mod exchange;
pub mod faults;
pub mod flavour;
pub mod higress;
pub mod host;
pub mod hostcalls;
pub mod http_call;
pub mod memory;
pub mod profile;
pub mod properties;
pub mod redis;
pub mod shared;
mod stream;
pub mod summary;
pub mod tokens;
pub mod vm;
pub mod wasi;

pub use abi::LogLevel;
pub use error::HostError;
pub use exchange::{header, Cost, Headers, Outcome, RequestSpec};
pub use faults::Faults;
pub use flavour::HostFlavour;
pub use host::{Host, HostBuilder};
pub use profile::{FunctionProfile, FunctionStats};
pub use shared::{LogLine, LogSource, MetricKind, MetricValue, SharedDataUsage};
pub use tokens::CallTokens;
