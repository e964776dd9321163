//! libFuzzer target: the RESP reply decoder and the acquire-reply decoders: any bytes (tests/fuzz/checks.rs).

#![no_main]

#[path = "../../tests/fuzz/checks.rs"]
mod checks;

#[global_allocator]
static ALLOC: checks::CountingAlloc = checks::CountingAlloc;

libfuzzer_sys::fuzz_target!(|data: &[u8]| checks::resp(data));
