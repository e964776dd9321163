//! libFuzzer target: key extraction and limiter naming: requests of any bytes (tests/fuzz/checks.rs).

#![no_main]

#[path = "../../tests/fuzz/checks.rs"]
mod checks;

#[global_allocator]
static ALLOC: checks::CountingAlloc = checks::CountingAlloc;

libfuzzer_sys::fuzz_target!(|data: &[u8]| checks::keys(data));
