//! Fuzzing on stable: property tests (proptest) over arbitrary bytes for the pure parsers, driving the
//! same checks as the coverage-guided libFuzzer targets in `fuzz/` (nightly, `scripts/fuzz.sh`):
//!
//! - the RESP reply decoder: no panic, bounds held, heap bounded by the input not by declared lengths;
//! - the configuration parser: no panic, every refusal names a field of the document, on one line;
//! - key extraction and limiter naming: no panic, the documented forms, one hash slot per limiter.
//!
//! Run: `cargo test -q --no-default-features --test fuzz` (a smoke run: a few seconds). More cases:
//! `ERL_FUZZ_CASES=200000` (each property gets that many). A failure prints the bytes; keep them below as a
//! regression test. proptest keeps failing seeds in `tests/fuzz/main.proptest-regressions` when it can.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

mod checks;

use proptest::prelude::*;

/// The heap probe for the RESP decoder's memory bound (see `checks::peak_growth`).
#[global_allocator]
static ALLOC: checks::CountingAlloc = checks::CountingAlloc;

/// Cases per property: `ERL_FUZZ_CASES`, else a smoke run.
fn cases(smoke: u32) -> u32 {
    std::env::var("ERL_FUZZ_CASES").ok().and_then(|n| n.parse().ok()).unwrap_or(smoke)
}

fn config(smoke: u32) -> ProptestConfig {
    ProptestConfig { cases: cases(smoke), failure_persistence: None, ..ProptestConfig::default() }
}

fn bytes(max: usize) -> impl Strategy<Value = Vec<u8>> {
    proptest::collection::vec(any::<u8>(), 0..max)
}

proptest! {
    #![proptest_config(config(3000))]

    #[test]
    fn resp_decoding_any_bytes(data in bytes(256)) {
        checks::resp(&data);
    }

    #[test]
    fn resp_decoding_reply_shaped_bytes(tokens in bytes(64)) {
        checks::resp_bytes(&checks::resp_from_tokens(&tokens));
    }

    #[test]
    fn resp_commands_of_any_arguments(data in bytes(512)) {
        checks::resp_command(&data);
    }

    #[test]
    fn configuration_of_any_bytes(data in bytes(256)) {
        checks::config_raw(&data);
    }

    #[test]
    fn configuration_mutated_field_by_field(data in bytes(128)) {
        checks::config_mutated(&data);
    }

    #[test]
    fn keys_and_limiter_names_of_any_request(data in bytes(1024)) {
        checks::keys(&data);
    }

    #[test]
    fn hash_slots_of_any_key(data in bytes(64)) {
        checks::slot(&data);
    }
}

/// Any JSON-looking text as a configuration: JSON tokens and field names in random order.
#[test]
fn configuration_of_json_shaped_text() {
    const TOKENS: &[&str] = &[
        "{",
        "}",
        "[",
        "]",
        ",",
        ":",
        "\"redis\"",
        "\"rules\"",
        "\"cluster\"",
        "\"c\"",
        "\"name\"",
        "\"r\"",
        "\"limit_by\"",
        "\"global\"",
        "\"rate\"",
        "\"interval\"",
        "1",
        "0",
        "-1",
        "null",
        "true",
        "\"1s\"",
        "\"_rules_\"",
        "\"_match_route_\"",
        "1e400",
        "\"\\u0000\"",
        "\"\\ud800\"",
    ];
    let mut runner = proptest::test_runner::TestRunner::new(config(3000));
    runner
        .run(&proptest::collection::vec(0..TOKENS.len(), 0..48), |picks| {
            let text: String = picks.iter().map(|&i| TOKENS[i]).collect();
            checks::config_raw(text.as_bytes());
            Ok(())
        })
        .unwrap();
}

/// Every seed configuration is accepted (the mutations start from valid documents).
#[test]
fn the_seed_configurations_are_valid() {
    for seed in checks::config_seeds() {
        let text = seed.to_string();
        assert!(edge_rate_limiter::config::Plugin::from_json(text.as_bytes()).is_ok(), "{text}");
    }
}

/// Declared lengths allocate nothing: huge arrays and strings are refused before any buffer is made.
#[test]
fn declared_lengths_do_not_allocate() {
    for bytes in [
        &b"*2147483647\r\n"[..],
        b"*1024\r\n",
        b"*1024\r\n*1024\r\n*1024\r\n*1024\r\n*1024\r\n",
        b"$4294967295\r\n",
        b"$65536\r\n",
        b"$9223372036854775807\r\n",
        b"*-2\r\n",
    ] {
        checks::resp_bytes(bytes);
        let (_, peak) = checks::peak_growth(|| edge_rate_limiter::resp::decode_reply(bytes));
        assert!(
            peak <= checks::resp_memory_bound(bytes.len()),
            "{peak} bytes for {:?}",
            String::from_utf8_lossy(bytes)
        );
    }
    // The probe sees allocations at all (the counting allocator is the global one).
    let (_, peak) = checks::peak_growth(|| vec![0u8; 1 << 20]);
    assert!(peak >= 1 << 20);
}

/// Inputs the fuzzers found that once failed a check (the check's oracle, not the filter): replayed on
/// every run.
#[test]
fn regressions() {
    // keys: `Query("")` on a `:path` without `?` (libFuzzer, crash-98f41c1f): every query, even none,
    // has one empty pair, which only the name "" (refused by the configuration) matches.
    checks::keys(&[0x72, 0x75, 0x01, 0x3b, 0x00, 0xfb, 0x73, 0x01, 0x6c, 0x09, 0xe6]);
    // keys: `x_forwarded_for` with 0 hops (refused by the configuration) reads no entry (libFuzzer,
    // crash-ecac593d: the oracle indexed past the entries).
    use edge_rate_limiter::key::{extract, KeySource, KeyValue};
    let request = checks::Request { headers: vec![("x-forwarded-for".into(), b"10.0.0.1".to_vec())], source: None };
    assert_eq!(extract(&KeySource::XForwardedFor(0), &request), KeyValue::Missing);
    assert_eq!(checks::reference_value(&KeySource::XForwardedFor(0), &request), KeyValue::Missing);
    // config: a top-level field named "" is named by its reason.
    checks::config_raw(
        br#"{"":1,"redis":{"cluster":"c"},"rules":[{"name":"r","limit_by":"global","rate":1,"interval":1}]}"#,
    );
}

/// Runs a configuration check with the known findings not tolerated.
fn strictly(json: &str) {
    checks::STRICT.store(true, std::sync::atomic::Ordering::Relaxed);
    let result = std::panic::catch_unwind(|| checks::config_raw(json.as_bytes()));
    checks::STRICT.store(false, std::sync::atomic::Ordering::Relaxed);
    if let Err(panic) = result {
        std::panic::resume_unwind(panic);
    }
}

/// FINDING (src/config/reader.rs, `Object::finish` and `Object::choice`): `unknown field` and `unknown
/// variant` refusals echo the document's text verbatim, control characters included, so a configuration
/// forges lines in the gateway's log (src/quote.rs promises none reach it). Found by the
/// `configuration_mutated_field_by_field` property. Fix: `quoted(key)` / `quoted(text)` there (and in the
/// field path of an unknown key).
#[test]
fn refusals_quote_what_they_echo() {
    let valid = r#""redis":{"cluster":"c"},"rules":[{"name":"r","limit_by":"global","rate":1,"interval":1}]"#;
    strictly(&format!(r#"{{{valid},"a\nedge-rate-limiter: forged":1}}"#));
    strictly(&format!(r#"{{{valid},"failure_mode":"x\ny"}}"#));
}

/// FINDING (src/config/validate.rs, `PluginConfig::read`): four refusals are built with a fixed top-level
/// field (`ConfigError::new("rules" | "redis" | "cache_size" | "local_block_slots", ...)`), so inside a
/// `_rules_` override they name the top-level field, which may not even be in the document, instead of
/// `_rules_[i].<field>`: `{"_rules_":[{..., "local_block_slots": 65537}]}` is refused with
/// `local_block_slots: must be between 1 and 65536`. Found by `configuration_mutated_field_by_field`. Fix:
/// `top.error(name, ...)` (the layer the field came from).
#[test]
fn override_refusals_name_the_override() {
    let rule = r#"{"name":"r","limit_by":"path","rate":1,"interval":1}"#;
    for fields in [
        format!(r#""redis":{{"cluster":"c"}},"rules":[{rule}],"local_block_slots":65537"#),
        format!(r#""redis":{{"cluster":"c"}},"rules":[{rule}],"cache_size":0"#),
        r#""redis":{"cluster":"c"},"rules":[]"#.to_string(),
        format!(r#""redis":{{}},"rules":[{rule}]"#),
    ] {
        let json = format!(r#"{{"_rules_":[{{"_match_route_":["a"],{fields}}}]}}"#);
        let error = edge_rate_limiter::config::Plugin::from_json(json.as_bytes()).unwrap_err();
        assert!(error.field.starts_with("_rules_[0]"), "{json}\n  refused as {error}");
        strictly(&json);
    }
}

/// FINDING (src/config/validate.rs, the `limiter` check added in a774fd3): a `limiter` with a `}` but no
/// `{` is accepted, e.g. `"erl}x"`. Its name has no `{`, so Redisson's layout writes `{erl}x:alice}:value`,
/// whose hash tag is `erl` (up to the first `}`), while the config hash `erl}x:alice` hashes whole: two
/// slots (CROSSSLOT in the script on a Redis Cluster). Found by `keys_and_limiter_names_of_any_request`.
/// Fix: refuse a `}` outside a hash tag (or any `}` when there is no `{`).
#[test]
fn limiters_with_a_closing_brace_keep_one_slot() {
    use edge_rate_limiter::key::{limiter_name, KeyValue};
    for base in ["erl}x", "}", "a}b}c"] {
        if checks::limiter_accepted(base) {
            let name = limiter_name(base, &KeyValue::Value(b"alice".to_vec())).unwrap();
            checks::check_one_slot(&name, "0b6e2d1c-5b4f-4e1a-9c1d-3f2e1d0c9b8a");
        }
    }
}
