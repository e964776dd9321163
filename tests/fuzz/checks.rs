//! The properties checked on arbitrary inputs, shared by the stable property tests (`tests/fuzz/main.rs`,
//! proptest) and the coverage-guided libFuzzer targets (`fuzz/fuzz_targets/`, nightly): each entry point
//! takes raw bytes and panics when a property fails, so both engines drive the same checks.
//!
//! - [`resp`]: the RESP reply decoder (and the acquire-reply decoders over it) on any bytes;
//! - [`config_raw`] and [`config_mutated`]: the configuration parser on any bytes and on valid
//!   configurations mutated field by field;
//! - [`keys`]: key extraction and limiter naming on request values of any bytes.
//!
//! Structured inputs are read from the bytes with [`Input`] (a few bytes choose a shape, the rest fill it),
//! so random bytes from proptest and mutated bytes from libFuzzer both reach deep into the parsers.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing, dead_code)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::collections::BTreeSet;
use std::net::{IpAddr, SocketAddr};

use base64::Engine as _;
use edge_rate_limiter::config::{ConfigError, Plugin, PluginConfig};
use edge_rate_limiter::key::{
    extract, hash_slot, limiter_name, write_limiter_name, IpPrefix, KeySource, KeyValue, LimiterKeys, RequestView,
    MAX_ENCODED_LEN, MAX_VERBATIM_LEN,
};
use edge_rate_limiter::resp::{
    decode_integers, decode_reply, Command, Integers, Reply, MAX_BULK_BYTES, MAX_DEPTH, MAX_ELEMENTS,
};
use edge_rate_limiter::script::{decode_acquire_all_reply, decode_acquire_reply, AcquireOutcome};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

// ---------------------------------------------------------------------------------------------------------
// Input: structure from bytes.

/// A cursor over fuzzer bytes: every read succeeds (zeros once the bytes run out).
pub struct Input<'a> {
    data: &'a [u8],
}

impl<'a> Input<'a> {
    pub fn new(data: &'a [u8]) -> Self {
        Input { data }
    }

    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    pub fn byte(&mut self) -> u8 {
        match self.data.split_first() {
            Some((&b, rest)) => {
                self.data = rest;
                b
            }
            None => 0,
        }
    }

    pub fn u32(&mut self) -> u32 {
        u32::from_le_bytes([self.byte(), self.byte(), self.byte(), self.byte()])
    }

    /// A number in `0..n` (`n` > 0), from one byte when `n` <= 256.
    pub fn below(&mut self, n: usize) -> usize {
        if n <= 256 {
            usize::from(self.byte()) % n
        } else {
            self.u32() as usize % n
        }
    }

    pub fn chance(&mut self, one_in: u8) -> bool {
        self.byte() % one_in.max(1) == 0
    }

    /// Up to `max` bytes, the length from one byte.
    pub fn bytes(&mut self, max: usize) -> &'a [u8] {
        let len = self.below(max.min(255) + 1).min(self.data.len());
        let (head, rest) = self.data.split_at(len);
        self.data = rest;
        head
    }

    /// A string from up to `max` bytes (lossy UTF-8).
    pub fn text(&mut self, max: usize) -> String {
        String::from_utf8_lossy(self.bytes(max)).into_owned()
    }

    pub fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.below(items.len())]
    }

    pub fn rest(&mut self) -> &'a [u8] {
        std::mem::take(&mut self.data)
    }
}

// ---------------------------------------------------------------------------------------------------------
// Allocation probe: the largest live heap growth of the current thread during a call.

thread_local! {
    static LIVE: Cell<isize> = const { Cell::new(0) };
    static PEAK: Cell<isize> = const { Cell::new(0) };
}

/// A global allocator that counts the bytes live per thread; register it with `#[global_allocator]` in the
/// binary that includes this module, then [`peak_growth`] measures a call.
pub struct CountingAlloc;

fn count(delta: isize) {
    let _ = LIVE.try_with(|live| {
        let now = live.get() + delta;
        live.set(now);
        let _ = PEAK.try_with(|peak| peak.set(peak.get().max(now)));
    });
}

// SAFETY: forwards to the system allocator; the counters are plain thread-local cells.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count(layout.size() as isize);
        System.alloc(layout)
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        count(-(layout.size() as isize));
        System.dealloc(ptr, layout)
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        count(layout.size() as isize);
        System.alloc_zeroed(layout)
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count(new_size as isize - layout.size() as isize);
        System.realloc(ptr, layout, new_size)
    }
}

/// Runs `f` and returns its result and the most heap bytes it had live at once (0 when the counting
/// allocator is not the global one).
pub fn peak_growth<T>(f: impl FnOnce() -> T) -> (T, usize) {
    let start = LIVE.with(Cell::get);
    PEAK.with(|peak| peak.set(start));
    let out = f();
    let peak = PEAK.with(Cell::get);
    (out, usize::try_from(peak - start).unwrap_or(0))
}

/// Whether a message fits on one log line: no control characters at all.
pub fn one_line(text: &str) -> bool {
    !text.chars().any(char::is_control)
}

// ---------------------------------------------------------------------------------------------------------
// (a) RESP.

/// Pieces RESP replies are made of, for inputs that look like replies (see [`resp_from_tokens`]).
pub const RESP_TOKENS: &[&[u8]] = &[
    b"*",
    b"$",
    b":",
    b"+",
    b"-",
    b"\r\n",
    b"\r",
    b"\n",
    b"0",
    b"1",
    b"2",
    b"7",
    b"8",
    b"-1",
    b"-2",
    b"3",
    b"1024",
    b"1025",
    b"65536",
    b"65537",
    b"4294967295",
    b"2147483647",
    b"9223372036854775807",
    b"-9223372036854775808",
    b"18446744073709551616",
    b"+1",
    b"OK",
    b"NOSCRIPT No matching script",
    b"ERR x",
    b"abc",
    b"\xff\xfe",
    b"\0",
    b"1503",
    b" ",
    b"*1\r\n",
    b"*2\r\n",
    b"*8\r\n",
    b"$-1\r\n",
    b"*-1\r\n",
    b":1\r\n",
    b":-1\r\n",
    b"$1\r\n7\r\n",
    b"$4\r\n1503\r\n",
    b"-NOSCRIPT x\r\n",
    b"-ERR a\nb\r\n",
];

/// Bytes made of RESP pieces: each input byte picks a token.
pub fn resp_from_tokens(data: &[u8]) -> Vec<u8> {
    data.iter().flat_map(|&b| RESP_TOKENS[usize::from(b) % RESP_TOKENS.len()].iter().copied()).collect()
}

/// The canonical RESP2 bytes of a reply (as Redis writes it; `Null` as `$-1`).
pub fn encode_reply(reply: &Reply, out: &mut Vec<u8>) {
    match reply {
        Reply::Simple(text) => out.extend([&b"+"[..], text, b"\r\n"].concat()),
        Reply::Error(text) => out.extend([b"-", text.as_bytes(), b"\r\n"].concat()),
        Reply::Integer(value) => out.extend(format!(":{value}\r\n").bytes()),
        Reply::Bulk(bytes) => {
            out.extend(format!("${}\r\n", bytes.len()).bytes());
            out.extend(bytes);
            out.extend(b"\r\n");
        }
        Reply::Array(items) => {
            out.extend(format!("*{}\r\n", items.len()).bytes());
            items.iter().for_each(|item| encode_reply(item, out));
        }
        Reply::Null => out.extend(b"$-1\r\n"),
    }
}

fn depth(reply: &Reply) -> usize {
    match reply {
        Reply::Array(items) => 1 + items.iter().map(depth).max().unwrap_or(0),
        _ => 0,
    }
}

fn within_bounds(reply: &Reply) -> bool {
    match reply {
        Reply::Simple(text) | Reply::Bulk(text) => text.len() <= MAX_BULK_BYTES,
        Reply::Error(text) => text.len() <= MAX_BULK_BYTES,
        Reply::Array(items) => items.len() <= MAX_ELEMENTS && items.iter().all(within_bounds),
        Reply::Integer(_) | Reply::Null => true,
    }
}

/// The integer an array element of an integer reply is, as `decode_integers` reads it: an integer, or a
/// bulk string of a decimal `i64` without a `+`.
fn integer_element(reply: &Reply) -> Option<i64> {
    match reply {
        Reply::Integer(n) => Some(*n),
        Reply::Bulk(text) if text.first() != Some(&b'+') => std::str::from_utf8(text).ok()?.parse().ok(),
        _ => None,
    }
}

/// Heap a decode may use at most: a constant for the bounded arrays under construction (one of
/// [`MAX_ELEMENTS`] per level) plus a multiple of the input, never anything proportional to a declared length.
pub fn resp_memory_bound(input_len: usize) -> usize {
    (MAX_DEPTH + 1) * MAX_ELEMENTS * std::mem::size_of::<Reply>() + 64 * input_len + 4096
}

/// The RESP decoder on any bytes: no panic; an accepted reply is one within the bounds that re-encodes
/// to a reply decoding the same; the heap used is bounded by the input, not by declared lengths; the
/// integer fast path agrees with the generic decoder; the acquire decoders never panic and agree with it.
pub fn resp(data: &[u8]) {
    let mut input = Input::new(data);
    let bytes: Vec<u8> = match input.byte() % 4 {
        0 => resp_from_tokens(input.rest()),
        _ => input.rest().to_vec(),
    };
    resp_bytes(&bytes);
}

/// [`resp`] on exactly these bytes.
pub fn resp_bytes(bytes: &[u8]) {
    let (decoded, peak) = peak_growth(|| decode_reply(bytes));
    assert!(
        peak <= resp_memory_bound(bytes.len()),
        "decoding {} bytes used {peak} bytes of heap: {:?}",
        bytes.len(),
        String::from_utf8_lossy(&bytes[..bytes.len().min(200)])
    );
    match &decoded {
        Ok(reply) => {
            assert!(depth(reply) <= MAX_DEPTH, "depth {} accepted", depth(reply));
            assert!(within_bounds(reply), "a reply beyond the bounds accepted");
            let mut again = Vec::new();
            encode_reply(reply, &mut again);
            assert_eq!(decode_reply(&again).as_ref(), Ok(reply), "re-encoded reply decodes the same");
            // The reply is exactly the bytes: a prefix is truncated, one byte more is trailing.
            assert!(decode_reply(&bytes[..bytes.len() - 1]).is_err(), "a proper prefix decoded");
            let mut longer = bytes.to_vec();
            longer.push(b':');
            assert!(decode_reply(&longer).is_err(), "trailing bytes accepted");
        }
        Err(error) => assert!(one_line(&error.to_string()), "multi-line error: {error:?}"),
    }

    // The allocation-free integer reader agrees with the generic decoder.
    for slots in [1usize, 8, 16] {
        let mut out = vec![0i64; slots];
        let shape = decode_integers(bytes, &mut out);
        let expected = match &decoded {
            Ok(Reply::Integer(n)) => Some((Integers::Bare, vec![*n])),
            Ok(Reply::Array(items)) if items.len() <= slots => {
                items.iter().map(integer_element).collect::<Option<Vec<_>>>().map(|n| (Integers::Array(n.len()), n))
            }
            _ => None,
        };
        match (shape, expected) {
            (None, None) => {}
            (Some(shape), Some((want, numbers))) => {
                assert_eq!(shape, want);
                assert_eq!(&out[..numbers.len()], &numbers[..]);
            }
            (got, want) => panic!("decode_integers gave {got:?}, the generic decoder {want:?} (slots {slots})"),
        }
    }

    // The acquire decoders: never a panic, and a decision only from integers.
    let acquire = decode_acquire_reply(bytes);
    if let Ok(reply) = &acquire {
        assert!(matches!(decoded, Ok(Reply::Integer(_) | Reply::Array(_))), "{reply:?} from {decoded:?}");
        if let Ok(Reply::Integer(n)) = decoded {
            match reply.outcome {
                AcquireOutcome::Acquired { remaining } => assert_eq!(remaining as i128, n as i128),
                AcquireOutcome::Rejected { delay_ms } => assert_eq!(-(delay_ms as i128), n as i128),
                other => panic!("{other:?} from a bare integer"),
            }
        }
    }
    if let Err(error) = &acquire {
        assert!(!error.to_string().is_empty());
    }
    for limiters in [1usize, 2] {
        if let Ok(replies) = decode_acquire_all_reply(bytes, limiters) {
            assert_eq!(replies.len(), limiters);
        }
    }
}

/// Commands of any arguments encode as RESP that decodes to their arguments (within the bounds).
pub fn resp_command(data: &[u8]) {
    let mut input = Input::new(data);
    let mut command = Command::new("EVALSHA");
    let mut args = vec![b"EVALSHA".to_vec()];
    while !input.is_empty() && args.len() < 64 {
        let arg = input.bytes(80).to_vec();
        command = command.arg(&arg);
        args.push(arg);
    }
    let decoded = decode_reply(&command.to_resp()).expect("a command is one RESP array");
    assert_eq!(decoded, Reply::Array(args.into_iter().map(Reply::Bulk).collect()));
    let path = command.to_webdis_path();
    assert!(path.iter().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'%' | b'/' | b'.')), "webdis path");
}

// ---------------------------------------------------------------------------------------------------------
// (b) Configuration.

/// Every path of a JSON document as the configuration errors write them (`redis.timeout`,
/// `_rules_[0].rules[1].rate`); the root is `""`.
pub fn json_paths(value: &Value) -> BTreeSet<String> {
    fn walk(value: &Value, path: String, out: &mut BTreeSet<String>) {
        match value {
            Value::Object(map) => {
                for (key, item) in map {
                    let at = if path.is_empty() { key.clone() } else { format!("{path}.{key}") };
                    walk(item, at, out);
                }
            }
            Value::Array(items) => {
                for (index, item) in items.iter().enumerate() {
                    walk(item, format!("{path}[{index}]"), out);
                }
            }
            _ => {}
        }
        out.insert(path);
    }
    let mut out = BTreeSet::new();
    walk(value, String::new(), &mut out);
    out
}

/// Whether `field` is one of [`json_paths`] of `value` (without listing them: only matching prefixes are
/// followed).
pub fn path_exists(value: &Value, field: &str) -> bool {
    fn walk(value: &Value, path: &str, field: &str) -> bool {
        if path == field {
            return true;
        }
        match value {
            Value::Object(map) => map.iter().any(|(key, item)| {
                // Refusals show a key escaped (src/quote.rs): match either form.
                [key.clone(), edge_rate_limiter::quote::escaped(key)].iter().any(|key| {
                    let at = if path.is_empty() { key.clone() } else { format!("{path}.{key}") };
                    field.starts_with(at.as_str()) && walk(item, &at, field)
                })
            }),
            Value::Array(items) => items.iter().enumerate().any(|(index, item)| {
                let at = format!("{path}[{index}]");
                field.starts_with(at.as_str()) && walk(item, &at, field)
            }),
            _ => false,
        }
    }
    walk(value, "", field)
}

/// A refusal of `json` names its field: the field is where the refused value is written in the document
/// (or, for a missing required field, a field under an object that is there), and the message is one line
/// `field: reason`. Only a document that is not a JSON object is refused without a field.
pub fn check_refusal(document: Option<&Value>, error: &ConfigError) {
    let shown = error.to_string();
    assert!(!error.reason.is_empty(), "a refusal without a reason: {error:?}");
    assert!(one_line(&shown) || echoes_verbatim(error), "a refusal spanning lines (control characters): {shown:?}");
    let Some(document @ Value::Object(_)) = document else {
        assert!(error.field.is_empty() || document.is_some(), "a field named for a document that is not JSON: {shown}");
        return;
    };
    // A top-level field named "" is named by its reason (`unknown field ``, ...`).
    if error.field.is_empty() && error.reason.starts_with("unknown field ``") {
        return;
    }
    assert!(!error.field.is_empty(), "a JSON object refused without naming a field: {shown}");
    assert_eq!(shown, format!("{}: {}", error.field, error.reason));
    if path_exists(document, &error.field) || names_override_field_from_the_top(document, error) {
        return;
    }
    // A missing required field: its parent is in the document.
    let parent = error.field.rsplit_once('.').map_or("", |(parent, _)| parent);
    assert!(
        error.reason.contains("required") && path_exists(document, parent),
        "the refusal names a field that is not in the document: {shown}\n  document: {document}"
    );
}

/// Known finding (see `refusals_quote_what_they_echo` in `tests/fuzz/main.rs`, ignored): `unknown field`
/// and `unknown variant` refusals echo the document's text verbatim, control characters included, in the
/// field and the reason. Tolerated here so that the fuzzers look for other failures; `STRICT` refuses it.
pub fn echoes_verbatim(error: &ConfigError) -> bool {
    !STRICT.load(std::sync::atomic::Ordering::Relaxed)
        && (error.reason.starts_with("unknown field `") || error.reason.starts_with("unknown variant `"))
}

/// Known finding (see `override_refusals_name_the_override` in `tests/fuzz/main.rs`, ignored): four
/// checks of `PluginConfig::read` build their error with a fixed top-level field (`rules`, `redis`,
/// `cache_size`, `local_block_slots`), so in a `_rules_` override they name the top-level field, which may
/// not be in the document, instead of `_rules_[i].<field>`. Tolerated unless `STRICT`.
pub fn names_override_field_from_the_top(document: &Value, error: &ConfigError) -> bool {
    !STRICT.load(std::sync::atomic::Ordering::Relaxed)
        && document.get("_rules_").is_some()
        && ["rules", "redis", "cache_size", "local_block_slots"].contains(&error.field.as_str())
}

/// Whether known findings fail the checks too (the regression tests set it).
pub static STRICT: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// What an accepted configuration guarantees (docs/configuration.md).
pub fn check_accepted(config: &PluginConfig) {
    assert!(!config.rules.is_empty());
    assert!(!config.redis.cluster.trim().is_empty() && !config.redis.authority.trim().is_empty());
    assert!(config.redis.timeout_ms >= 1 && config.redis.timeout_ms <= u64::from(u32::MAX));
    assert!((200..=599).contains(&config.failure_status) && (200..=599).contains(&config.rejection.status));
    assert!(config.cache_size >= 1);
    assert!((1..=65_536).contains(&config.local_block_slots));
    let mut names = BTreeSet::new();
    for rule in &config.rules {
        // A rule with `rates_by_value` is several entries of one name; its default entry (no value match) is last.
        if rule.value_match.is_none() {
            assert!(names.insert(rule.name.clone()), "duplicate rule {}", rule.name);
        }
        assert!(
            !rule.name.is_empty() && rule.name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
        );
        assert!(rule.source.validate().is_ok());
        assert!(rule.rate >= 1 && rule.rate <= u64::from(u32::MAX));
        assert!(rule.interval_ms >= 1 && rule.interval_ms <= 1 << 40);
        assert!(rule.permits >= 1 && rule.permits <= rule.rate);
        assert!(rule.keep_alive_ms == 0 || (rule.keep_alive_ms >= rule.interval_ms && rule.keep_alive_ms <= 1 << 40));
        assert!(!rule.limiter.trim().is_empty());
        if let Some(lease) = rule.lease {
            assert!(lease.max_permits > rule.permits && lease.max_permits <= rule.rate.min(65_536));
            assert!(lease.max_age_ms >= 1 && lease.max_age_ms < rule.interval_ms);
        }
    }
}

/// Both entry points on one document: no panic, refusals name their field, accepted configurations hold
/// their guarantees, and without `_rules_` both parsers agree.
pub fn config_document(json: &[u8]) {
    config_parsed(json, serde_json::from_slice(json).ok());
}

/// [`config_document`] of a document already parsed (`None`: not JSON).
fn config_parsed(json: &[u8], document: Option<Value>) {
    let has_overrides = matches!(&document, Some(Value::Object(map)) if map.contains_key("_rules_"));
    let plugin = Plugin::from_json(json);
    // With `_rules_` only `Plugin` reads the document (`PluginConfig` refuses the field).
    match &plugin {
        Ok(plugin) => {
            plugin.configs().for_each(|(_, config)| check_accepted(config));
        }
        Err(error) => check_refusal(document.as_ref(), error),
    }
    // With `_rules_` only `Plugin` reads the document (`PluginConfig` refuses the field).
    if has_overrides {
        return;
    }
    let single = PluginConfig::from_json(json);
    match &single {
        Ok(config) => check_accepted(config),
        Err(error) => check_refusal(document.as_ref(), error),
    }
    match (&plugin, &single) {
        (Ok(plugin), Ok(config)) => assert_eq!(plugin.global.as_ref(), Some(config)),
        (Err(a), Err(b)) => assert!(a == b || a.field.is_empty(), "{a} vs {b}"),
        (a, b) => panic!("Plugin and PluginConfig disagree: {a:?} vs {b:?}"),
    }
}

/// Any bytes as a configuration.
pub fn config_raw(data: &[u8]) {
    config_document(data);
}

/// Valid configurations the mutations start from.
pub fn config_seeds() -> Vec<Value> {
    static SEEDS: std::sync::OnceLock<Vec<Value>> = std::sync::OnceLock::new();
    SEEDS.get_or_init(seed_documents).clone()
}

/// One of [`config_seeds`], by index (modulo their number).
fn config_seed(index: usize) -> Value {
    static SEEDS: std::sync::OnceLock<Vec<Value>> = std::sync::OnceLock::new();
    let seeds = SEEDS.get_or_init(seed_documents);
    seeds[index % seeds.len()].clone()
}

fn seed_documents() -> Vec<Value> {
    vec![
        json!({"redis": {"cluster": "webdis"}, "rules": [{"name": "r", "limit_by": "global", "rate": 5, "interval": "1s"}]}),
        json!({
            "redis": {"transport": "http", "cluster": "webdis", "timeout": "200ms", "username": "u", "password": "p",
                      "authority": "webdis.local", "redis_cluster": true, "max_batch": 8, "max_in_flight": 2,
                      "max_batch_bytes": 4096},
            "rules": [
                {"name": "per-user", "limit_by": {"header": "x-user-id"}, "rate": 100, "interval": "1m", "type": "per_client",
                 "permits": 2, "keep_alive": "2h", "on_missing": "deny", "limiter": "erl:u", "rate_source": "config",
                 "local_block_max": 0, "lease": {"max_permits": 64, "max_age": "50ms"}},
                {"name": "per-ip", "limit_by": "client_ip", "rate": 20, "interval": 1000},
                {"name": "q", "limit_by": {"query": "api_key"}, "rate": 3, "interval": "1h 30m", "on_missing": "share"},
                {"name": "c", "limit_by": {"cookie": "session"}, "rate": 3, "interval": "1.5s"},
                {"name": "x", "limit_by": {"x_forwarded_for": 2}, "rate": 3, "interval": "10s"},
                {"name": "p", "limit_by": "path", "rate": 3, "interval": "10s", "local_block_max": "1s"}
            ],
            "failure_mode": "deny", "failure_status": 503, "rejected_status": 429, "rejected_body": "no\n",
            "rate_limit_headers": "both", "cache_size": 10, "clock": "redis", "local_block_slots": 16
        }),
        json!({
            "redis": {"cluster": "webdis"},
            "rules": [
                {"name": "tokens", "limit_by": {"header": "x-api-key"}, "rate": 1000, "interval": "1m",
                 "rates_by": {"header": "x-plan"}, "rates_by_value": [{"values": ["gold"], "rate": 5000}],
                 "cost": {"reserve": {"header": "x-max-tokens", "default": 100}, "settle": {"usage": "openai"}}},
                {"name": "units", "limit_by": "client_ip", "rate": 50, "interval": "10s",
                 "cost": {"reserve": 5, "settle": {"usage": {"paths": ["usage.total_tokens"]}}}},
                {"name": "header", "limit_by": "path", "rate": 50, "interval": "10s",
                 "cost": {"reserve": 5, "settle": {"response_header": "x-cost"}}}
            ],
            "grpc": {"rejected_status": "RESOURCE_EXHAUSTED", "failure_status": 14}
        }),
        json!({
            "redis": {"transport": "host", "service_name": "redis.static", "service_port": 6379, "database": 2},
            "rules": [{"name": "r", "limit_by": "global", "rate": 5, "interval": "1s"}],
            "_rules_": [
                {"_match_route_": ["default/login"], "failure_mode": "deny",
                 "rules": [{"name": "login", "limit_by": "client_ip", "rate": 2, "interval": 1000}]},
                {"_match_domain_": ["*.example.com", "api.example"], "redis": {"cluster": "c", "timeout": 50},
                 "cache_size": 5, "rules": [{"name": "d", "limit_by": {"header": "x-k"}, "rate": 7, "interval": 1000}]}
            ]
        }),
        json!({"_rules_": [{"_match_route_": ["a"], "redis": {"cluster": "c"},
                             "rules": [{"name": "r", "limit_by": "path", "rate": 1, "interval": 1}]}]}),
    ]
}

/// Values a mutation writes: wrong types, boundaries, near-miss spellings.
fn interesting_value(input: &mut Input<'_>) -> Value {
    match input.below(40) {
        0 => Value::Null,
        1 => json!(true),
        2 => json!(false),
        3 => json!(0),
        4 => json!(1),
        5 => json!(-1),
        6 => json!(u64::MAX),
        7 => json!(u64::from(u32::MAX) + 1),
        8 => json!(1u64 << 40),
        9 => json!((1u64 << 40) + 1),
        10 => json!(1.5),
        11 => json!(""),
        12 => json!(" "),
        13 => json!("0ms"),
        14 => json!("1500us"),
        15 => json!("1.0000001s"),
        16 => json!("99999999999y"),
        17 => json!("1h 30m"),
        18 => json!("global"),
        19 => json!({"header": "x-a"}),
        20 => json!({"x_forwarded_for": 0}),
        21 => json!({"header": "a", "query": "b"}),
        22 => json!({}),
        23 => json!([]),
        24 => json!([1, "a", null]),
        25 => json!("a\nb\u{1b}[31m"),
        26 => json!("é\u{0}"),
        27 => json!(65_536),
        28 => json!(65_537),
        29 => json!(599),
        30 => json!(600),
        31 => json!({"max_permits": 2, "max_age": 1}),
        32 => json!("deny"),
        33 => json!("host"),
        34 => json!("a{b}"),
        35 => json!(i64::MIN),
        _ => Value::String(input.text(24)),
    }
}

/// A field name a mutation adds or renames to.
fn field_name(input: &mut Input<'_>) -> String {
    const NAMES: &[&str] = &[
        "redis",
        "rules",
        "failure_mode",
        "failure_status",
        "rejected_status",
        "rejected_body",
        "rate_limit_headers",
        "cache_size",
        "clock",
        "local_block_slots",
        "transport",
        "cluster",
        "service_name",
        "service_port",
        "username",
        "password",
        "timeout",
        "database",
        "authority",
        "redis_cluster",
        "max_batch",
        "max_in_flight",
        "max_batch_bytes",
        "name",
        "limit_by",
        "rate",
        "interval",
        "type",
        "permits",
        "keep_alive",
        "on_missing",
        "limiter",
        "rate_source",
        "local_block_max",
        "lease",
        "max_permits",
        "max_age",
        "local_fallback",
        "gateways",
        "probe_interval",
        "mode",
        "shadow_headers",
        "exempt",
        "client_ips",
        "headers",
        "rates_by_value",
        "rates_by",
        "cost",
        "reserve",
        "settle",
        "usage",
        "paths",
        "response_header",
        "default",
        "grpc",
        "values",
        "regex",
        "ipv4_prefix",
        "ipv6_prefix",
        "hops",
        "client_ip",
        "_rules_",
        "_match_route_",
        "_match_domain_",
        "header",
        "query",
        "cookie",
        "x_forwarded_for",
        "colour",
        "a.b",
        "c[0]",
        "x\ny",
        "",
    ];
    if input.chance(8) {
        input.text(12)
    } else {
        input.pick(NAMES).to_string()
    }
}

/// The value at a path of containers (object keys or array indexes), mutable.
fn containers(value: &Value) -> Vec<Vec<PathStep>> {
    fn walk(value: &Value, at: &mut Vec<PathStep>, out: &mut Vec<Vec<PathStep>>) {
        match value {
            Value::Object(map) => {
                out.push(at.clone());
                for (key, item) in map {
                    at.push(PathStep::Key(key.clone()));
                    walk(item, at, out);
                    at.pop();
                }
            }
            Value::Array(items) => {
                out.push(at.clone());
                for (index, item) in items.iter().enumerate() {
                    at.push(PathStep::Index(index));
                    walk(item, at, out);
                    at.pop();
                }
            }
            _ => {}
        }
    }
    let mut out = Vec::new();
    walk(value, &mut Vec::new(), &mut out);
    out
}

#[derive(Clone, Debug)]
enum PathStep {
    Key(String),
    Index(usize),
}

fn at_path<'v>(value: &'v mut Value, path: &[PathStep]) -> &'v mut Value {
    path.iter().fold(value, |value, step| match step {
        PathStep::Key(key) => &mut value[key.as_str()],
        PathStep::Index(index) => &mut value[*index],
    })
}

/// One mutation of a container somewhere in the document.
fn mutate(document: &mut Value, input: &mut Input<'_>) {
    let places = containers(document);
    let place = places[input.below(places.len())].clone();
    let target = at_path(document, &place);
    match target {
        Value::Object(map) => {
            let keys: Vec<String> = map.keys().cloned().collect();
            let key = if keys.is_empty() || input.chance(5) { field_name(input) } else { input.pick_owned(&keys) };
            match input.below(6) {
                0 => {
                    map.remove(&key);
                }
                1 => {
                    // Rename: same value under another name.
                    if let Some(value) = map.remove(&key) {
                        map.insert(field_name(input), value);
                    }
                }
                2 => {
                    // Swap in a value from elsewhere in the seeds (a valid value in the wrong place).
                    let donor = config_seed(input.byte().into());
                    let donors = containers(&donor);
                    let mut donor = donor;
                    let from = donors[input.below(donors.len())].clone();
                    map.insert(key, at_path(&mut donor, &from).clone());
                }
                _ => {
                    map.insert(key, interesting_value(input));
                }
            }
        }
        Value::Array(items) => match input.below(4) {
            0 if !items.is_empty() => {
                let at = input.below(items.len());
                items.remove(at);
            }
            1 if !items.is_empty() => {
                let at = input.below(items.len());
                let copy = items[at].clone();
                items.push(copy);
            }
            _ => {
                let value = interesting_value(input);
                if items.is_empty() {
                    items.push(value);
                } else {
                    let at = input.below(items.len());
                    items[at] = value;
                }
            }
        },
        _ => {}
    }
}

impl Input<'_> {
    fn pick_owned(&mut self, items: &[String]) -> String {
        items[self.below(items.len())].clone()
    }
}

/// A valid configuration mutated field by field (1 to 4 mutations), then both parsers.
pub fn config_mutated(data: &[u8]) {
    let mut input = Input::new(data);
    let mut document = config_seed(input.byte().into());
    for _ in 0..1 + input.below(4) {
        mutate(&mut document, &mut input);
    }
    config_parsed(document.to_string().as_bytes(), Some(document));
}

/// The configuration target: a first byte chooses raw bytes or a mutated valid configuration.
pub fn config(data: &[u8]) {
    match data.split_first() {
        Some((b, rest)) if b % 4 == 0 => config_raw(rest),
        Some((_, rest)) => config_mutated(rest),
        None => config_raw(data),
    }
}

// ---------------------------------------------------------------------------------------------------------
// (c) Keys and limiter names.

/// A request: headers in order (lowercase names), and a source address.
#[derive(Debug, Default, Clone)]
pub struct Request {
    pub headers: Vec<(String, Vec<u8>)>,
    pub source: Option<String>,
}

impl RequestView for Request {
    fn header(&self, name: &str) -> Option<Vec<u8>> {
        self.headers.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone())
    }
    fn source_address(&self) -> Option<String> {
        self.source.clone()
    }
}

fn ip_text(input: &mut Input<'_>) -> String {
    match input.below(8) {
        0 => format!("{}.{}.{}.{}", input.byte(), input.byte(), input.byte(), input.byte()),
        1 => {
            let groups: Vec<String> = (0..8).map(|_| format!("{:x}", input.u32() & 0xffff)).collect();
            groups.join(":")
        }
        2 => format!("{:x}::{:x}", input.u32() & 0xffff, input.byte()),
        3 => "::ffff:10.0.0.1".to_string(),
        4 => format!("{}.{}.{}.{}", input.byte(), input.u32() % 1000, input.byte(), input.byte()),
        5 => "::".to_string(),
        _ => input.text(40),
    }
}

fn address_text(input: &mut Input<'_>) -> String {
    let ip = ip_text(input);
    match input.below(6) {
        0 => ip,
        1 => format!("{ip}:{}", input.u32() % 70_000),
        2 => format!("[{ip}]:{}", input.u32() % 70_000),
        3 => format!("[{ip}]"),
        4 => format!(" {ip} "),
        _ => format!("{ip}:{}", input.text(6)),
    }
}

fn value_bytes(input: &mut Input<'_>) -> Vec<u8> {
    match input.below(8) {
        0 => b"alice".to_vec(),
        1 => vec![b'a'; MAX_VERBATIM_LEN - 1 + input.below(3)],
        2 => vec![input.byte(); MAX_ENCODED_LEN - 1 + input.below(3)],
        3 => vec![b'~'; 1 + input.below(4)],
        4 => b"a{b}".to_vec(),
        _ => input.bytes(300).to_vec(),
    }
}

fn path_header(input: &mut Input<'_>, names: &[String]) -> Vec<u8> {
    let mut path = b"/".to_vec();
    path.extend_from_slice(input.bytes(20));
    if input.chance(4) {
        return path;
    }
    path.push(b'?');
    for _ in 0..input.below(5) {
        let name = if input.chance(2) && !names.is_empty() {
            input.pick_owned(names).into_bytes()
        } else {
            input.bytes(8).to_vec()
        };
        path.extend_from_slice(&name);
        if !input.chance(5) {
            path.push(b'=');
            path.extend_from_slice(input.bytes(30));
        }
        path.push(input.pick(b"&&#;+%"));
    }
    path
}

fn cookie_header(input: &mut Input<'_>, names: &[String]) -> Vec<u8> {
    let mut cookie = Vec::new();
    for _ in 0..input.below(5) {
        if input.chance(3) {
            cookie.push(b' ');
        }
        let name = if input.chance(2) && !names.is_empty() {
            input.pick_owned(names).into_bytes()
        } else {
            input.bytes(8).to_vec()
        };
        cookie.extend_from_slice(&name);
        if !input.chance(6) {
            cookie.extend_from_slice(input.pick(&[&b"="[..], b" = ", b"=\""]));
            cookie.extend_from_slice(input.bytes(30));
            if input.chance(3) {
                cookie.push(b'"');
            }
        }
        cookie.extend_from_slice(input.pick(&[&b"; "[..], b";", b" ;"]));
    }
    cookie
}

fn xff_header(input: &mut Input<'_>) -> Vec<u8> {
    let mut entries = Vec::new();
    for _ in 0..input.below(6) {
        entries.push(if input.chance(5) { input.text(10) } else { address_text(input) });
    }
    entries.join(input.pick(&[",", ", ", " , ", ",,"])).into_bytes()
}

/// A key source and a request that may or may not carry its value.
fn source_and_request(input: &mut Input<'_>) -> (KeySource, Request) {
    let name = if input.chance(3) {
        input.text(12)
    } else {
        input.pick(&["x-user-id", " X-User-Id ", "api_key", "session", "a b"]).to_string()
    };
    let single = |input: &mut Input<'_>| match input.below(7) {
        0 => KeySource::header(&name),
        1 => KeySource::Query(name.clone()),
        2 => KeySource::Cookie(name.clone()),
        3 => KeySource::XForwardedFor(match input.below(4) {
            0 => input.u32(),
            n => n as u32,
        }),
        4 => KeySource::Path,
        5 => KeySource::ClientIp,
        _ => KeySource::Global,
    };
    let network = |input: &mut Input<'_>| {
        let of =
            if input.chance(2) { KeySource::ClientIp } else { KeySource::XForwardedFor(1 + input.below(3) as u32) };
        let prefix = IpPrefix { ipv4: input.below(33) as u8, ipv6: input.below(129) as u8 };
        KeySource::Network { of: Box::new(of), prefix }
    };
    let source = match input.below(10) {
        0 => network(input),
        1 => {
            let parts: Vec<KeySource> = (0..2 + input.below(3))
                .map(|_| if input.chance(4) { network(input) } else { single(input) })
                .filter(|s| *s != KeySource::Global)
                .collect();
            // A composite key has 2 parts or more (`KeySource::validate`): one left with fewer after the
            // global parts went is no source a configuration can hold (with none it named the limiter as a
            // global rule does, a false finding).
            if parts.len() >= 2 {
                KeySource::Composite(parts)
            } else {
                single(input)
            }
        }
        _ => single(input),
    };
    let names = vec![name.clone(), name.trim().to_string()];
    let mut request = Request { headers: Vec::new(), source: None };
    for _ in 0..input.below(6) {
        let (header, value) = match input.below(6) {
            0 => (name.trim().to_ascii_lowercase(), value_bytes(input)),
            1 => (":path".to_string(), path_header(input, &names)),
            2 => ("cookie".to_string(), cookie_header(input, &names)),
            3 => ("x-forwarded-for".to_string(), xff_header(input)),
            4 => (input.text(10).to_ascii_lowercase(), input.bytes(40).to_vec()),
            _ => (name.clone(), value_bytes(input)),
        };
        request.headers.push((header, value));
    }
    if !input.chance(4) {
        request.source = Some(address_text(input));
    }
    (source, request)
}

/// The reference of `parse_ip`: `ip`, `ip:port`, `[v6]`, `[v6]:port`, trimmed.
fn reference_ip(text: &str) -> Option<IpAddr> {
    let text = text.trim();
    if let Ok(socket) = text.parse::<SocketAddr>() {
        return Some(socket.ip());
    }
    text.trim_start_matches('[').trim_end_matches(']').parse().ok()
}

fn percent_decode(bytes: &[u8]) -> Vec<u8> {
    let hex = |b: u8| (b as char).to_digit(16);
    let mut out = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        let b = if bytes[i] == b'+' { b' ' } else { bytes[i] };
        if b == b'%' && i + 2 < bytes.len() {
            if let (Some(h), Some(l)) = (hex(bytes[i + 1]), hex(bytes[i + 2])) {
                out.push((h * 16 + l) as u8);
                i += 3;
                continue;
            }
        }
        out.push(b);
        i += 1;
    }
    out
}

/// The value a key source should read, written from docs/configuration.md's description, not from `src/key.rs`.
pub fn reference_value(source: &KeySource, request: &Request) -> KeyValue {
    let header = |name: &str| request.header(name);
    let value = match source {
        KeySource::Global => return KeyValue::Global,
        KeySource::Header(name) => header(name),
        // This request answers no property (no host): such a key is missing.
        KeySource::Property(_) => None,
        // Nor has it a body: a body field is never missing, it is the part `!missing`.
        KeySource::Body(_) => return KeyValue::Parts(vec![None]),
        KeySource::Path => header(":path").map(|p| p.split(|&b| b == b'?').next().unwrap_or_default().to_vec()),
        KeySource::Query(name) => header(":path").and_then(|path| {
            // Form decoding to bytes (no UTF-8 assumed), the first pair whose decoded name matches. Every
            // query has at least one (possibly empty) pair; only the name "" (refused by the configuration)
            // matches an empty one.
            let query = path.iter().position(|&b| b == b'?').map_or(&b""[..], |at| &path[at + 1..]);
            let query = query.split(|&b| b == b'#').next().unwrap_or_default();
            query.split(|&b| b == b'&').find_map(|pair| {
                let (key, value) = match pair.iter().position(|&b| b == b'=') {
                    Some(at) => (&pair[..at], &pair[at + 1..]),
                    None => (pair, &b""[..]),
                };
                (percent_decode(key) == name.as_bytes()).then(|| percent_decode(value))
            })
        }),
        KeySource::Cookie(name) => header("cookie").and_then(|cookies| {
            cookies.split(|&b| b == b';').find_map(|pair| {
                let pair = pair.trim_ascii();
                let at = pair.iter().position(|&b| b == b'=')?;
                if pair[..at].trim_ascii() != name.as_bytes() {
                    return None;
                }
                let value = pair[at + 1..].trim_ascii();
                Some(if value.len() >= 2 && value[0] == b'"' && value[value.len() - 1] == b'"' {
                    value[1..value.len() - 1].to_vec()
                } else {
                    value.to_vec()
                })
            })
        }),
        KeySource::ClientIp => request.source.as_deref().and_then(reference_ip).map(|ip| ip.to_string().into_bytes()),
        KeySource::XForwardedFor(hops) => header("x-forwarded-for").and_then(|xff| {
            // Entries split as bytes: only the trusted one must be text.
            let entries: Vec<&[u8]> =
                xff.split(|&b| b == b',').map(<[u8]>::trim_ascii).filter(|e| !e.is_empty()).collect();
            let index = entries.len().checked_sub(*hops as usize)?;
            reference_ip(std::str::from_utf8(entries.get(index)?).ok()?).map(|ip| ip.to_string().into_bytes())
        }),
        KeySource::Network { of, prefix } => {
            // The address the inner source reads, host bits cleared by masking its integer form.
            let KeyValue::Value(address) = reference_value(of, request) else { return KeyValue::Missing };
            let Some(ip) = std::str::from_utf8(&address).ok().and_then(|a| a.parse::<IpAddr>().ok()) else {
                return KeyValue::Missing;
            };
            Some(match ip.to_canonical() {
                IpAddr::V4(v4) => {
                    let mask = if prefix.ipv4 == 0 { 0 } else { u32::MAX << (32 - u32::from(prefix.ipv4)) };
                    format!("{}/{}", std::net::Ipv4Addr::from(u32::from(v4) & mask), prefix.ipv4).into_bytes()
                }
                IpAddr::V6(v6) => {
                    let mask = if prefix.ipv6 == 0 { 0 } else { u128::MAX << (128 - u32::from(prefix.ipv6)) };
                    format!("{}/{}", std::net::Ipv6Addr::from(u128::from(v6) & mask), prefix.ipv6).into_bytes()
                }
            })
        }
        KeySource::Composite(parts) => {
            let mut values = Vec::new();
            for part in parts {
                match reference_value(part, request) {
                    KeyValue::Value(value) => values.push(Some(value)),
                    KeyValue::Parts(unread) if matches!(part, KeySource::Body(_)) => values.extend(unread),
                    _ => return KeyValue::Missing,
                }
            }
            return KeyValue::Parts(values);
        }
    };
    value.map_or(KeyValue::Missing, KeyValue::Value)
}

fn verbatim(bytes: &[u8]) -> bool {
    !bytes.is_empty()
        && bytes.len() <= MAX_VERBATIM_LEN
        && bytes.iter().all(|&b| b.is_ascii_alphanumeric() || b".-_@/:+=".contains(&b))
}

/// The longest value part of a limiter name: `~` and the base64url of [`MAX_ENCODED_LEN`] bytes.
pub const MAX_VALUE_PART: usize = 1 + (MAX_ENCODED_LEN * 4).div_ceil(3);

/// The limiter name of a value under `base` holds the documented form: `base:` then the value verbatim,
/// `~` + base64url, or `#` + base64url(SHA-256), which decodes back to the value (so two values never
/// share a name), no brace, within the length bound; writing it into a used buffer gives the same name.
pub fn check_name(base: &str, value: &KeyValue) -> Option<String> {
    let name = limiter_name(base, value);
    let mut reused = String::from("{stale}");
    let written = write_limiter_name(base, value, &mut reused);
    assert_eq!(written, name.is_some());
    assert_eq!(name.as_deref().unwrap_or(""), reused, "write_limiter_name reuses its buffer cleanly");
    assert_eq!(name, limiter_name(base, value), "names are deterministic");
    let bytes = match value {
        KeyValue::Missing => {
            assert_eq!(name, None);
            return None;
        }
        KeyValue::Global => {
            assert_eq!(name.as_deref(), Some(base));
            return name;
        }
        KeyValue::Parts(parts) => {
            // `base` then `:` and each part: verbatim without `:`, or `~`/`#` encoded as a single value is.
            let name = name.expect("parts have a name");
            let mut rest = name.strip_prefix(base).expect("name = base:parts");
            for part in parts {
                rest = rest.strip_prefix(':').expect("`:` before each part");
                let end = rest.find(':').unwrap_or(rest.len());
                let written = &rest[..end];
                let Some(part) = part else {
                    assert_eq!(written, "!missing", "an unread body part");
                    rest = &rest[end..];
                    continue;
                };
                if verbatim(part) && !part.contains(&b':') {
                    assert_eq!(written.as_bytes(), &part[..]);
                } else {
                    check_part(written, part);
                }
                rest = &rest[end..];
            }
            assert_eq!(rest, "", "nothing after the last part");
            assert!(!name[base.len()..].contains(['{', '}']), "a brace in the parts: {name}");
            return Some(name);
        }
        KeyValue::Value(bytes) => bytes,
    };
    let name = name.expect("a value has a name");
    let part = name.strip_prefix(base).and_then(|rest| rest.strip_prefix(':')).expect("name = base:part");
    assert!(part.len() <= MAX_VALUE_PART, "value part of {} bytes", part.len());
    assert!(!part.contains(['{', '}']), "a brace in the value part: {part}");
    if verbatim(bytes) {
        assert_eq!(part.as_bytes(), &bytes[..]);
    } else {
        check_part(part, bytes);
    }
    Some(name)
}

/// An encoded value part: `~` + base64url of the bytes (at most [`MAX_ENCODED_LEN`]), else `#` + base64url
/// of their SHA-256.
fn check_part(part: &str, bytes: &[u8]) {
    let engine = base64::engine::general_purpose::URL_SAFE_NO_PAD;
    if bytes.len() <= MAX_ENCODED_LEN {
        let encoded = part.strip_prefix('~').expect("~ form");
        assert_eq!(engine.decode(encoded).expect("base64url"), *bytes);
    } else {
        let hashed = part.strip_prefix('#').expect("# form");
        assert_eq!(hashed, engine.encode(Sha256::digest(bytes)));
    }
}

/// CRC-16/XMODEM and the hash tag, written from the Redis Cluster specification.
pub fn reference_slot(key: &[u8]) -> u16 {
    let tag = key
        .iter()
        .position(|&b| b == b'{')
        .and_then(|open| {
            let close = key[open + 1..].iter().position(|&b| b == b'}')?;
            (close > 0).then(|| &key[open + 1..open + 1 + close])
        })
        .unwrap_or(key);
    let mut crc: u16 = 0;
    for &byte in tag {
        crc ^= u16::from(byte) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 { (crc << 1) ^ 0x1021 } else { crc << 1 };
        }
    }
    crc % 16_384
}

/// Every key of the limiter `name` for `client`.
pub fn keys_of(name: &str, client: &str) -> [String; 5] {
    let keys = LimiterKeys::new(name, client);
    [keys.config, keys.value, keys.client_value, keys.permits, keys.client_permits]
}

/// The keys of a limiter share its hash slot (the project's and the reference hash agree).
pub fn check_one_slot(name: &str, client: &str) {
    let keys = keys_of(name, client);
    let slot = hash_slot(name);
    assert!(slot < 16_384);
    for key in &keys {
        assert_eq!(hash_slot(key), reference_slot(key.as_bytes()), "hash_slot({key:?})");
        assert_eq!(hash_slot(key), slot, "{key:?} is not in the slot of limiter {name:?}: {keys:?}");
    }
}

/// Known finding (see `limiters_with_a_closing_brace_keep_one_slot` in `tests/fuzz/main.rs`, ignored): the
/// configuration accepts a `limiter` with a `}` and no `{` (`"erl}x"`), whose keys `{erl}x:v}:value`...
/// hash the tag before that `}`, not the name: two slots. Tolerated unless `STRICT`.
pub fn closing_brace_only(base: &str) -> bool {
    !STRICT.load(std::sync::atomic::Ordering::Relaxed) && base.contains('}') && !base.contains('{')
}

/// Whether the configuration accepts `base` as a rule's `limiter`.
pub fn limiter_accepted(base: &str) -> bool {
    let config = json!({"redis": {"cluster": "c"},
                        "rules": [{"name": "r", "limit_by": "path", "rate": 1, "interval": 1, "limiter": base}]});
    PluginConfig::from_json(config.to_string().as_bytes()).is_ok()
}

/// A base the default configuration writes: `erl:` and a rule name.
fn rule_base(input: &mut Input<'_>) -> String {
    const RULE_CHARS: &[u8] = b"abcXYZ019_-";
    let len = 1 + input.below(6);
    let name: String = (0..len).map(|_| char::from(input.pick(RULE_CHARS))).collect();
    format!("erl:{name}")
}

/// Key extraction and limiter naming on one request.
pub fn keys(data: &[u8]) {
    let mut input = Input::new(data);
    let (source, request) = source_and_request(&mut input);
    let value = extract(&source, &request);
    assert_eq!(value, extract(&source, &request), "extraction is deterministic");
    assert_eq!(value, reference_value(&source, &request), "{source:?} on {request:?}");
    if let (KeySource::ClientIp | KeySource::XForwardedFor(_), KeyValue::Value(ip)) = (&source, &value) {
        let text = std::str::from_utf8(ip).expect("an address is text");
        assert_eq!(text.parse::<IpAddr>().expect("an address").to_string(), text, "normalized");
    }
    if let (KeySource::Path, KeyValue::Value(path)) = (&source, &value) {
        assert!(!path.contains(&b'?'));
    }

    // Names under a default base and under any brace-free base; the keys share one slot.
    let client = if input.chance(2) {
        "0b6e2d1c-5b4f-4e1a-9c1d-3f2e1d0c9b8a".to_string()
    } else {
        input.text(40).replace(['{', '}'], "")
    };
    let base = rule_base(&mut input);
    let free_base = match input.text(40).replace(['{', '}'], "") {
        text if text.is_empty() => "b".to_string(),
        text => text,
    };
    for base in [&base, &free_base] {
        if let Some(name) = check_name(base, &value) {
            check_one_slot(&name, &client);
        }
    }

    // A base with braces, as an operator may write it (`limiter`): if the configuration accepts it, the
    // limiter's keys still share one slot.
    if input.chance(4) {
        let braced = String::from_utf8_lossy(input.bytes(16)).replace(['"', '\\'], "")
            + input.pick(&["{", "}", "{t}", "}{", "{}"]);
        let braced = if input.chance(2) { braced.chars().rev().collect() } else { braced };
        if limiter_accepted(&braced) && !closing_brace_only(&braced) {
            if let Some(name) = check_name(&braced, &value) {
                check_one_slot(&name, &client);
            }
        }
    }

    // Another value (or the same) under another default base: a name is one (base, value), and no limiter
    // ever uses another's keys.
    let (other_source, other_request) = source_and_request(&mut input);
    let other_value = extract(&other_source, &other_request);
    let other_base = if input.chance(2) { base.clone() } else { rule_base(&mut input) };
    let (Some(a), Some(b)) = (limiter_name(&base, &value), limiter_name(&other_base, &other_value)) else { return };
    if base == other_base && value == other_value {
        assert_eq!(a, b);
        return;
    }
    assert_ne!(a, b, "two limiters share a name: {base:?} {value:?} and {other_base:?} {other_value:?}");
    let ours: BTreeSet<String> = keys_of(&a, &client).into_iter().collect();
    let theirs: BTreeSet<String> = keys_of(&b, &client).into_iter().collect();
    assert!(ours.is_disjoint(&theirs), "limiters {a:?} and {b:?} share keys");
}

/// The hash slot of any key matches the reference.
pub fn slot(data: &[u8]) {
    let key = String::from_utf8_lossy(data);
    assert_eq!(hash_slot(&key), reference_slot(key.as_bytes()), "{key:?}");
}
