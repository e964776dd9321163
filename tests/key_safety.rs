//! Key safety (issue 12, security review): whatever bytes a client puts in a key value, the limiter it
//! gets keeps all its keys in one Redis Cluster hash slot and shares no key with another value's or another
//! rule's limiter. Property tests against the crate's public naming API (`key::limiter_name`,
//! `key::LimiterKeys`, `key::hash_slot`), checked with an independent CRC16 and an independent decoding of
//! the name back to the value (docs/configuration.md, "Limiter names in Redis").
//!
//! Run: `cargo test --no-default-features --test key_safety` (`PROPTEST_CASES` scales the runs).
#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]

use std::collections::{HashMap, HashSet};

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine as _;
use edge_rate_limiter::key::{hash_slot, limiter_name, KeyValue, LimiterKeys, MAX_ENCODED_LEN, MAX_VERBATIM_LEN};
use proptest::prelude::*;
use proptest::strategy::ValueTree;
use sha2::{Digest, Sha256};

/// A client id as the filter makes them (a UUID string), for the per-client keys.
const CLIENT_ID: &str = "3f2b8c1e-7d4a-4e3b-9a61-0c5d2e8f4b17";
const CASES: u32 = 2000;

/// CRC-16/XMODEM as the Redis Cluster specification gives it (poly 0x1021, init 0), bit by bit: written
/// here from the specification, not taken from the crate.
fn crc16(bytes: &[u8]) -> u16 {
    let mut crc: u16 = 0;
    for &byte in bytes {
        crc ^= u16::from(byte) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 { (crc << 1) ^ 0x1021 } else { crc << 1 };
        }
    }
    crc
}

/// The slot Redis Cluster gives a key: the CRC16 of its hash tag (between the first `{` and the first `}`
/// after it, when not empty), else of the whole key, modulo 16384.
fn key_slot(key: &str) -> u16 {
    let bytes = key.as_bytes();
    let tag = bytes
        .iter()
        .position(|&b| b == b'{')
        .and_then(|open| {
            let close = bytes[open + 1..].iter().position(|&b| b == b'}')?;
            let tag = &bytes[open + 1..open + 1 + close];
            (!tag.is_empty()).then_some(tag)
        })
        .unwrap_or(bytes);
    crc16(tag) % 16_384
}

fn keys_of(name: &str) -> [String; 5] {
    let keys = LimiterKeys::new(name, CLIENT_ID);
    [keys.config, keys.value, keys.client_value, keys.permits, keys.client_permits]
}

fn name_of(base: &str, value: &[u8]) -> String {
    limiter_name(base, &KeyValue::Value(value.to_vec())).expect("a value always has a name")
}

fn is_verbatim(value: &[u8]) -> bool {
    (1..=MAX_VERBATIM_LEN).contains(&value.len())
        && value.iter().all(|&b| b.is_ascii_alphanumeric() || b"._@/:+=-".contains(&b))
}

/// Reads the value back from its limiter name (docs/configuration.md: verbatim, `~` + base64url, `#` + base64url of
/// the SHA-256), failing when the name is not the one form the value must take.
fn check_decodes(base: &str, value: &[u8], name: &str) -> Result<(), TestCaseError> {
    let encoded = name.strip_prefix(base).and_then(|rest| rest.strip_prefix(':'));
    let encoded = encoded.ok_or_else(|| TestCaseError::fail(format!("{name:?} does not start with {base:?}:")))?;
    if let Some(b64) = encoded.strip_prefix('~') {
        prop_assert!(!is_verbatim(value) && value.len() <= MAX_ENCODED_LEN, "{name:?}: wrong form");
        prop_assert_eq!(URL_SAFE_NO_PAD.decode(b64).map_err(|e| TestCaseError::fail(e.to_string()))?, value);
    } else if let Some(b64) = encoded.strip_prefix('#') {
        prop_assert!(value.len() > MAX_ENCODED_LEN, "{name:?}: hashed though short");
        prop_assert_eq!(b64, URL_SAFE_NO_PAD.encode(Sha256::digest(value)));
    } else {
        prop_assert!(is_verbatim(value), "{name:?}: verbatim though not safe");
        prop_assert_eq!(encoded.as_bytes(), value);
    }
    Ok(())
}

/// Key values as an attacker would pick them: any bytes, the characters that mean something in a Redis
/// key or a limiter name (`{`, `}`, `:`, `~`, `#`, the base64url alphabet), lengths at the encoding
/// boundaries (128/129, 256/257) and long ones.
fn hostile_value() -> impl Strategy<Value = Vec<u8>> {
    let special = prop::sample::select(b"{}:~#-_=+/.@aZ09 \r\n\0\xff%".to_vec());
    prop_oneof![
        prop::collection::vec(any::<u8>(), 0..64),
        prop::collection::vec(special, 0..40),
        prop::collection::vec(prop::sample::select(b"abc:~#{}".to_vec()), 120..140),
        prop::collection::vec(prop::sample::select(b"ab:{}~".to_vec()), 250..262),
        prop::collection::vec(any::<u8>(), 257..2000),
        "[a-z0-9:]{1,20}(:value|:permits|\\}:value|\\{x\\})?".prop_map(String::into_bytes),
    ]
}

/// Bases of limiter names: the default `erl:<rule name>` (rule names are `[A-Za-z0-9_-]+`) and custom
/// `limiter` values as operators write them, with or without their own hash tag.
fn base() -> impl Strategy<Value = String> {
    prop_oneof![
        "[A-Za-z0-9_-]{1,12}".prop_map(|rule| format!("erl:{rule}")),
        Just("svc:orders".to_string()),
        Just("{tenant-7}:api".to_string()),
        Just("erl:{per-user}".to_string()),
    ]
}

#[test]
fn the_reference_crc16_is_redis_clusters() {
    // The specification's check value, and CLUSTER KEYSLOT of a real Redis.
    assert_eq!(crc16(b"123456789"), 0x31C3);
    assert_eq!(key_slot("foo"), 12_182);
    assert_eq!(key_slot("bar"), 5_061);
    assert_eq!(key_slot("{user1000}.following"), key_slot("user1000"));
    assert_eq!(key_slot("foo{}{bar}"), crc16(b"foo{}{bar}") % 16_384);
    assert_eq!(key_slot("foo{{bar}}zap"), crc16(b"{bar") % 16_384);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(CASES))]

    /// A name is the one documented form of its value and decodes back to it: no two values of one base share
    /// a name (up to SHA-256 collisions above 256 bytes), and the value part never holds `{` or `}`.
    #[test]
    fn a_name_decodes_back_to_its_value(base in base(), value in hostile_value()) {
        let name = name_of(&base, &value);
        check_decodes(&base, &value, &name)?;
        let part = &name[base.len()..];
        prop_assert!(!part.contains('{') && !part.contains('}'), "{name:?}");
    }

    /// Every key of a limiter (config hash, value, permits and the per-client ones) is in one slot, the
    /// slot `hash_slot` gives the filter's all-or-nothing grouping.
    #[test]
    fn every_key_of_a_limiter_is_in_one_slot(base in base(), value in hostile_value()) {
        let name = name_of(&base, &value);
        let slots: HashSet<u16> = keys_of(&name).iter().map(|key| key_slot(key)).collect();
        prop_assert_eq!(slots.len(), 1, "{:?} spans slots {:?}", keys_of(&name), slots);
        prop_assert!(slots.contains(&hash_slot(&name)));
    }

    /// Two different (rule, value) pairs never share a key: not the same name, and no key of one is a key
    /// of the other (a value like `x:value` or `~YQ` cannot name another limiter's keys). Global rules
    /// (the base alone) included.
    #[test]
    fn different_rules_or_values_share_no_key(
        rule_a in "[A-Za-z0-9_-]{1,6}",
        rule_b in prop_oneof!["[A-Za-z0-9_-]{1,6}", Just("a".to_string())],
        value_a in prop::option::of(hostile_value()),
        value_b in prop::option::of(hostile_value()),
    ) {
        let (base_a, base_b) = (format!("erl:{rule_a}"), format!("erl:{rule_b}"));
        prop_assume!((&rule_a, &value_a) != (&rule_b, &value_b));
        let named = |base: &str, value: &Option<Vec<u8>>| match value {
            Some(value) => limiter_name(base, &KeyValue::Value(value.clone())).unwrap(),
            None => limiter_name(base, &KeyValue::Global).unwrap(),
        };
        let keys_a: HashSet<String> = keys_of(&named(&base_a, &value_a)).into_iter().collect();
        let keys_b: HashSet<String> = keys_of(&named(&base_b, &value_b)).into_iter().collect();
        prop_assert!(keys_a.is_disjoint(&keys_b), "{:?} and {:?} share {:?}", keys_a, keys_b,
            keys_a.intersection(&keys_b).collect::<Vec<_>>());
    }
}

/// Many values at once, crafted to look like each other's encodings and keys: every key of every limiter
/// is distinct across all of them, and each limiter stays in one slot.
#[test]
fn thousands_of_values_over_rules_never_share_a_key() {
    let mut rng = proptest::test_runner::TestRunner::deterministic();
    let strategy = hostile_value();
    let mut values: Vec<Vec<u8>> = (0..4000).map(|_| strategy.new_tree(&mut rng).unwrap().current()).collect();
    // Values shaped like another value's name or key, for each form.
    for seed in [&b"a"[..], b"", b"a{b} c", &[0xff, 0], &[b'a'; 129], &[b'z'; 300]] {
        let name = name_of("erl:r", seed);
        let encoded = name.as_bytes()["erl:r:".len()..].to_vec();
        values.extend([seed.to_vec(), encoded.clone(), [&encoded[..], b":value"].concat()]);
        values.extend([format!("{{{name}}}:value").into_bytes(), format!("r:{name}").into_bytes()]);
    }
    values.sort();
    values.dedup();
    let mut owner: HashMap<String, (String, Vec<u8>)> = HashMap::new();
    for rule in ["r", "r-2", "per-user", "a"] {
        let base = format!("erl:{rule}");
        let global = limiter_name(&base, &KeyValue::Global).unwrap();
        for (value, name) in values.iter().map(|v| (Some(v), name_of(&base, v))).chain([(None, global)]) {
            let keys = keys_of(&name);
            assert_eq!(keys.iter().map(|k| key_slot(k)).collect::<HashSet<_>>().len(), 1, "{keys:?}");
            let this = (rule.to_string(), value.cloned().unwrap_or_else(|| b"<global>".to_vec()));
            for key in keys {
                if let Some(other) = owner.insert(key.clone(), this.clone()) {
                    panic!("{key:?} belongs to both {other:?} and {this:?}");
                }
            }
        }
    }
}
