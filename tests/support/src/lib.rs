//! Fixtures shared by the project's Rust tests (`tests/parity` of the filter, the host emulator's tests in
//! `tests/host`): one way to start a test Redis, and the rest every such test needs.
//!
//! - [`process`]: a free loopback port, a bounded [`wait_until`], a child process stopped by its PID when
//!   dropped ([`ProcessGuard`]), a temporary directory removed when dropped ([`TempDir`]).
//! - [`redis`]: [`RedisServer`], a throw-away `redis-server` (no persistence, optional `requirepass`) on a
//!   free loopback port, with a blocking raw RESP command helper; stoppable and restartable on its port.
//! - [`webdis`]: [`Webdis`], the HTTP-to-Redis bridge of the stock build, in front of a [`RedisServer`].
//! - [`cargo`]: [`WasmBuild`], a wasm32-wasip1 module built by cargo once per test binary (or taken
//!   prebuilt from an environment variable).
//!
//! Nothing here panics: every fixture answers an [`std::io::Result`] whose error says what did not come
//! up (tests unwrap it). Every wait is bounded. The binaries are Debian's `redis-server` (7.0) and `webdis`
//! on the `PATH` (the Makefile installs them).

pub mod cargo;
pub mod process;
pub mod redis;
pub mod webdis;

pub use cargo::{repo_root, WasmBuild};
pub use process::{free_port, loopback, wait_until, ProcessGuard, TempDir};
pub use redis::{resp, Connection, RedisServer};
pub use webdis::{http_get, Webdis};
