//! Shared fixtures for the emulator's tests: the modules under test (the real filter and the probe, built
//! by cargo through the support crate's [`WasmBuild`]; WAT modules), servers that misbehave on purpose, and
//! a bounded command runner. Real redis-server and webdis come from the support crate (`erl-test-support`),
//! re-exported here. Every wait is bounded.

#![allow(dead_code, unused_imports, clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use std::io::{Read, Write};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

pub use erl_test_support::{free_port, loopback as addr, repo_root, resp, RedisServer, TempDir, WasmBuild, Webdis};

/// The filter, release-built for wasm32-wasip1 with exactly `features` into `target/<dir>` (its own
/// directory, so a concurrent build of the other flavour cannot overwrite it), or the prebuilt module
/// named by the environment variable `prebuilt`.
fn filter(label: &str, prebuilt: &str, dir: &str, features: &str) -> PathBuf {
    let root = repo_root();
    WasmBuild::new(label, root.join("Cargo.toml"), "edge_rate_limiter.wasm", root.join("target").join(dir))
        .package("edge-rate-limiter")
        .only_features(features)
        .prebuilt_from_env(prebuilt)
        .locate()
        .unwrap()
}

/// The stock filter (webdis HTTP bridge): `$ERL_WASM`, or built into `target/emulator-stock/`.
pub fn stock_filter() -> PathBuf {
    filter("the stock filter", "ERL_WASM", "emulator-stock", "http-bridge")
}

/// The filter with the Higress Redis transport: `$ERL_WASM_HOST_REDIS`, or built into
/// `target/emulator-host-redis/`.
pub fn host_redis_filter() -> PathBuf {
    filter("the host-redis filter", "ERL_WASM_HOST_REDIS", "emulator-host-redis", "host-redis")
}

/// The hostcall probe (`probe/`, its own workspace), built for wasm32-wasip1 into `probe/target/`.
pub fn probe_module() -> PathBuf {
    let probe = Path::new(env!("CARGO_MANIFEST_DIR")).join("probe");
    WasmBuild::new("the probe", probe.join("Cargo.toml"), "hostcall_probe.wasm", probe.join("target")).locate().unwrap()
}

/// A tiny HTTP/1.1 server answering like the probe's upstream in `probe/run_in_envoy.py` (Python's
/// `BaseHTTPRequestHandler`): 200, `server`, `date`, `content-type: text/plain`, `x-upstream: yes`,
/// `content-length: 12`, `upstream ok\n`. Counts the requests it answered. Stops when dropped.
pub struct PyLikeUpstream {
    pub port: u16,
    stop: Arc<AtomicBool>,
    hits: Arc<AtomicUsize>,
}

impl PyLikeUpstream {
    pub fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let port = listener.local_addr().unwrap().port();
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let hits = Arc::new(AtomicUsize::new(0));
        let counter = hits.clone();
        std::thread::spawn(move || {
            while !flag.load(Ordering::SeqCst) {
                match listener.accept() {
                    Ok((mut s, _)) => {
                        let _ = s.set_nonblocking(false);
                        let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
                        let mut buf = [0u8; 8192];
                        let mut got = Vec::new();
                        while !got.windows(4).any(|w| w == b"\r\n\r\n") {
                            match s.read(&mut buf) {
                                Ok(0) | Err(_) => break,
                                Ok(n) => got.extend_from_slice(&buf[..n]),
                            }
                        }
                        // Counted before answering: whoever got the answer sees the hit.
                        counter.fetch_add(1, Ordering::SeqCst);
                        let _ = s.write_all(
                            b"HTTP/1.0 200 OK\r\nServer: BaseHTTP/0.6 Python/3.11.7\r\nDate: Sun, 22 Nov 2026 00:00:00 GMT\r\n\
                              content-type: text/plain\r\nx-upstream: yes\r\ncontent-length: 12\r\n\r\nupstream ok\n",
                        );
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(5)),
                }
            }
        });
        PyLikeUpstream { port, stop, hits }
    }

    /// How many requests it answered so far.
    pub fn hits(&self) -> usize {
        self.hits.load(Ordering::SeqCst)
    }
}

impl Drop for PyLikeUpstream {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

/// A listener that accepts connections and never answers (a hung server). Stops when dropped.
pub struct Hang {
    pub port: u16,
    _listener: TcpListener,
}

impl Hang {
    pub fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        Hang { port: listener.local_addr().unwrap().port(), _listener: listener }
    }
}

/// Bytes as a WAT string literal body (every byte escaped).
pub fn wat_bytes(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("\\{b:02x}")).collect()
}

/// The common head of the WAT test modules: ABI marker, memory, a bump allocator, trivial lifecycle exports.
pub const WAT_HEAD: &str = r#"
  (memory (export "memory") 4)
  (global $heap (mut i32) (i32.const 131072))
  (func (export "proxy_abi_version_0_2_1"))
  (func (export "proxy_on_memory_allocate") (param $size i32) (result i32)
    (local $p i32)
    (local.set $p (global.get $heap))
    (global.set $heap (i32.and (i32.add (i32.add (global.get $heap) (local.get $size)) (i32.const 7)) (i32.const -8)))
    (local.get $p))
  (func (export "proxy_on_context_create") (param i32 i32))
  (func (export "proxy_on_vm_start") (param i32 i32) (result i32) (i32.const 1))
  (func (export "proxy_on_done") (param i32) (result i32) (i32.const 1))
"#;

/// A module that calls `proxy_set_effective_context(its own stream context)` in `proxy_on_request_headers`
/// and answers with a local reply of status 200 + the hostcall's status.
pub fn effective_context_module() -> Vec<u8> {
    wat::parse_str(format!(
        r#"(module
  (import "env" "proxy_set_effective_context" (func $set_effective (param i32) (result i32)))
  (import "env" "proxy_send_local_response" (func $reply (param i32 i32 i32 i32 i32 i32 i32 i32) (result i32)))
  {WAT_HEAD}
  (func (export "proxy_on_configure") (param i32 i32) (result i32) (i32.const 1))
  (func (export "proxy_on_request_headers") (param $ctx i32) (param i32 i32) (result i32)
    (drop (call $reply (i32.add (i32.const 200) (call $set_effective (local.get $ctx)))
      (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 0) (i32.const -1)))
    (i32.const 1)))"#
    ))
    .unwrap()
}

/// A module that answers every request with a local reply whose status says what happened: it calls
/// `proxy_redis_init(service, username, password, timeout_ms)` in `proxy_on_configure` and
/// `proxy_redis_call(service, query)` per request, then in `proxy_on_redis_call_response` replies with
/// status `200 + callback status` (+50 if the callback's context is not the root context, +10 if buffer 9
/// cannot be read) and the reply bytes as body. 600 + s: init answered s; 700 + s: call answered s; 666:
/// buffer 9 was readable outside the callback.
pub fn redis_module(service: &str, username: &str, password: &str, timeout_ms: u32, query: &[u8]) -> Vec<u8> {
    let text = format!(
        r#"(module
  (import "env" "proxy_redis_init" (func $redis_init (param i32 i32 i32 i32 i32 i32 i32) (result i32)))
  (import "env" "proxy_redis_call" (func $redis_call (param i32 i32 i32 i32 i32) (result i32)))
  (import "env" "proxy_get_buffer_bytes" (func $get_buffer (param i32 i32 i32 i32 i32) (result i32)))
  (import "env" "proxy_set_effective_context" (func $set_effective (param i32) (result i32)))
  (import "env" "proxy_send_local_response" (func $local_response (param i32 i32 i32 i32 i32 i32 i32 i32) (result i32)))
  {head}
  (global $root (mut i32) (i32.const 0))
  (global $init (mut i32) (i32.const 0))
  (data (i32.const 1024) "{service}")
  (data (i32.const 2048) "{user}")
  (data (i32.const 3072) "{pass}")
  (data (i32.const 8192) "{query}")
  (func $reply (param $status i32) (param $body i32) (param $len i32)
    (drop (call $local_response (local.get $status) (i32.const 0) (i32.const 0) (local.get $body) (local.get $len)
      (i32.const 0) (i32.const 0) (i32.const -1))))
  (func (export "proxy_on_configure") (param $root i32) (param i32) (result i32)
    (global.set $root (local.get $root))
    (global.set $init (call $redis_init (i32.const 1024) (i32.const {service_len}) (i32.const 2048) (i32.const {user_len})
      (i32.const 3072) (i32.const {pass_len}) (i32.const {timeout})))
    (i32.const 1))
  (func (export "proxy_on_request_headers") (param $ctx i32) (param i32 i32) (result i32)
    (local $r i32)
    (if (i32.ne (call $get_buffer (i32.const 9) (i32.const 0) (i32.const 1000) (i32.const 16) (i32.const 20)) (i32.const 1))
      (then (call $reply (i32.const 666) (i32.const 0) (i32.const 0)) (return (i32.const 1))))
    (if (i32.ne (global.get $init) (i32.const 0))
      (then (call $reply (i32.add (i32.const 600) (global.get $init)) (i32.const 0) (i32.const 0)) (return (i32.const 1))))
    (local.set $r (call $redis_call (i32.const 1024) (i32.const {service_len}) (i32.const 8192) (i32.const {query_len}) (i32.const 24)))
    (if (i32.ne (local.get $r) (i32.const 0))
      (then (call $reply (i32.add (i32.const 700) (local.get $r)) (i32.const 0) (i32.const 0)) (return (i32.const 1))))
    ;; token -> stream context, for the callback
    (i32.store (i32.add (i32.const 4096) (i32.shl (i32.and (i32.load (i32.const 24)) (i32.const 255)) (i32.const 2))) (local.get $ctx))
    (i32.const 1))
  (func (export "proxy_on_redis_call_response") (param $ctx i32) (param $token i32) (param $status i32) (param $size i32)
    (local $code i32)
    (local.set $code (i32.add (i32.const 200) (local.get $status)))
    (if (i32.ne (local.get $ctx) (global.get $root)) (then (local.set $code (i32.add (local.get $code) (i32.const 50)))))
    (i32.store (i32.const 16) (i32.const 0))
    (i32.store (i32.const 20) (i32.const 0))
    (if (i32.ne (call $get_buffer (i32.const 9) (i32.const 0) (local.get $size) (i32.const 16) (i32.const 20)) (i32.const 0))
      (then (local.set $code (i32.add (local.get $code) (i32.const 10)))))
    (drop (call $set_effective (i32.load (i32.add (i32.const 4096) (i32.shl (i32.and (local.get $token) (i32.const 255)) (i32.const 2))))))
    (call $reply (local.get $code) (i32.load (i32.const 16)) (i32.load (i32.const 20))))
)"#,
        head = WAT_HEAD,
        service = wat_bytes(service.as_bytes()),
        user = wat_bytes(username.as_bytes()),
        pass = wat_bytes(password.as_bytes()),
        query = wat_bytes(query),
        service_len = service.len(),
        user_len = username.len(),
        pass_len = password.len(),
        query_len = query.len(),
        timeout = timeout_ms,
    );
    wat::parse_str(text).unwrap()
}

/// Runs a command with `stdin`, at most `timeout`; (exit code, stdout, stderr). Killed by PID on timeout.
pub fn run_with_input(command: &mut Command, stdin: &[u8], timeout: Duration) -> (Option<i32>, String, String) {
    let mut child = command.stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    let mut input = child.stdin.take().unwrap();
    input.write_all(stdin).unwrap();
    drop(input);
    let mut out = child.stdout.take().unwrap();
    let mut err = child.stderr.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = out.read_to_string(&mut s);
        s
    });
    let err_reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    let deadline = Instant::now() + timeout;
    let code = loop {
        if let Ok(Some(status)) = child.try_wait() {
            break status.code();
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{command:?} did not finish within {timeout:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    (code, reader.join().unwrap(), err_reader.join().unwrap())
}
