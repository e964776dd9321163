//! The emulator's integration tests, one test binary: each file below was a binary of its own, and each
//! linked wasmtime again (make test's test-host phase spent most of its time building and linking them).

mod common;

mod bodies;
mod cli;
mod envoy_parity;
mod faults;
mod fuzz_module;
mod guest_errors;
mod host_redis_filter;
mod redis_extension;
mod stock_filter;
mod ticks;
