//! libFuzzer target: the configuration parser: any bytes, or a valid configuration mutated field by field (tests/fuzz/checks.rs).

#![no_main]

#[path = "../../tests/fuzz/checks.rs"]
mod checks;

#[global_allocator]
static ALLOC: checks::CountingAlloc = checks::CountingAlloc;

libfuzzer_sys::fuzz_target!(|data: &[u8]| checks::config(data));
