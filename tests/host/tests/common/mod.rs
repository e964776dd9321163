//! Shared fixtures for the emulator's tests: real redis-server and webdis on free loopback ports (stopped
//! by PID when dropped), the modules under test (the real filter, built by cargo; the probe; WAT modules),
//! and a raw RESP client for checking Redis directly. Every wait is bounded.

#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

/// The repository root (/work/main).
pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").canonicalize().unwrap()
}

/// A free loopback port (bind port 0, read it, release it).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

pub fn addr(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

/// Waits until `check` holds, at most `timeout`.
pub fn wait_until(timeout: Duration, what: &str, mut check: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if check() {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!("timed out after {timeout:?} waiting for {what}");
}

/// A temporary directory, removed when dropped.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> Self {
        static N: AtomicUsize = AtomicUsize::new(0);
        let path = std::env::temp_dir().join(format!(
            "wasm-host-{tag}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::SeqCst)
        ));
        std::fs::create_dir_all(&path).unwrap();
        TempDir(path)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A child process killed (by its PID) and reaped when dropped.
pub struct ProcessGuard {
    pub name: String,
    child: Child,
}

impl ProcessGuard {
    pub fn spawn(name: &str, command: &mut Command) -> Self {
        let child = command
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {name}: {e}"));
        ProcessGuard { name: name.into(), child }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for ProcessGuard {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

/// A real redis-server on a free port, without persistence.
pub struct Redis {
    pub port: u16,
    pub password: Option<String>,
    _process: ProcessGuard,
    _dir: TempDir,
}

impl Redis {
    pub fn start() -> Self {
        Self::start_with_password(None)
    }

    pub fn start_with_password(password: Option<&str>) -> Self {
        let dir = TempDir::new("redis");
        let port = free_port();
        let mut command = Command::new("redis-server");
        command
            .arg("--port")
            .arg(port.to_string())
            .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--daemonize", "no"])
            .arg("--dir")
            .arg(&dir.0);
        if let Some(pw) = password {
            command.args(["--requirepass", pw]);
        }
        let process = ProcessGuard::spawn("redis-server", &mut command);
        let redis = Redis { port, password: password.map(str::to_string), _process: process, _dir: dir };
        wait_until(Duration::from_secs(10), "redis-server to answer PING", || {
            redis.try_command(&[b"PING"]).is_ok_and(|r| r.starts_with(b"+PONG"))
        });
        redis
    }

    /// One command on a fresh connection (AUTH first if there is a password); the raw RESP reply.
    pub fn command(&self, args: &[&[u8]]) -> Vec<u8> {
        self.try_command(args).unwrap()
    }

    pub fn try_command(&self, args: &[&[u8]]) -> std::io::Result<Vec<u8>> {
        let mut stream = TcpStream::connect_timeout(&addr(self.port), Duration::from_secs(1))?;
        stream.set_read_timeout(Some(Duration::from_secs(5)))?;
        if let Some(pw) = &self.password {
            stream.write_all(&resp(&[b"AUTH", pw.as_bytes()]))?;
            read_reply(&mut stream)?;
        }
        stream.write_all(&resp(args))?;
        read_reply(&mut stream)
    }

    /// One command in a given database.
    pub fn command_in_db(&self, db: u32, args: &[&[u8]]) -> Vec<u8> {
        let mut stream = TcpStream::connect_timeout(&addr(self.port), Duration::from_secs(1)).unwrap();
        stream.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        if let Some(pw) = &self.password {
            stream.write_all(&resp(&[b"AUTH", pw.as_bytes()])).unwrap();
            read_reply(&mut stream).unwrap();
        }
        stream.write_all(&resp(&[b"SELECT", db.to_string().as_bytes()])).unwrap();
        read_reply(&mut stream).unwrap();
        stream.write_all(&resp(args)).unwrap();
        read_reply(&mut stream).unwrap()
    }
}

/// One RESP array of bulk strings.
pub fn resp(args: &[&[u8]]) -> Vec<u8> {
    let mut out = format!("*{}\r\n", args.len()).into_bytes();
    for a in args {
        out.extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
        out.extend_from_slice(a);
        out.extend_from_slice(b"\r\n");
    }
    out
}

fn read_reply(stream: &mut TcpStream) -> std::io::Result<Vec<u8>> {
    let mut buffer = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        if let Ok(Some((_, used))) = redis_protocol::resp2::decode::decode_range(&buffer) {
            buffer.truncate(used);
            return Ok(buffer);
        }
        let n = stream.read(&mut chunk)?;
        if n == 0 {
            return Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "closed"));
        }
        buffer.extend_from_slice(&chunk[..n]);
    }
}

/// webdis (the HTTP-to-Redis bridge) on a free port, in front of `redis`.
pub struct Webdis {
    pub port: u16,
    _process: ProcessGuard,
    _dir: TempDir,
}

impl Webdis {
    pub fn start(redis: &Redis) -> Self {
        let dir = TempDir::new("webdis");
        let port = free_port();
        let config = serde_json::json!({
            "redis_host": "127.0.0.1",
            "redis_port": redis.port,
            "redis_auth": redis.password,
            "http_host": "127.0.0.1",
            "http_port": port,
            "threads": 2,
            "pool_size": 4,
            "daemonize": false,
            "websockets": false,
            "database": 0,
            "verbosity": 1,
            "logfile": dir.0.join("webdis.log"),
        });
        let path = dir.0.join("webdis.json");
        std::fs::write(&path, config.to_string()).unwrap();
        let process = ProcessGuard::spawn("webdis", Command::new("webdis").arg(&path));
        let webdis = Webdis { port, _process: process, _dir: dir };
        wait_until(Duration::from_secs(10), "webdis to answer GET /PING", || {
            http_get(port, "/PING").is_some_and(|body| body.contains("PONG"))
        });
        webdis
    }
}

/// A minimal HTTP GET on the loopback (readiness checks); the body, if the server answered.
pub fn http_get(port: u16, path: &str) -> Option<String> {
    let mut stream = TcpStream::connect_timeout(&addr(port), Duration::from_millis(500)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    write!(stream, "GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n").ok()?;
    let mut text = String::new();
    stream.read_to_string(&mut text).ok()?;
    text.split_once("\r\n\r\n").map(|(_, body)| body.to_string())
}

/// Builds with cargo, once per test binary and key; returns the path of the artifact.
fn cargo_build(key: &str, args: &[&str], artifact: &Path) -> PathBuf {
    static LOCK: Mutex<()> = Mutex::new(());
    let _guard = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let started = Instant::now();
    let output = Command::new(env!("CARGO"))
        .args(args)
        .current_dir(repo())
        .output()
        .unwrap_or_else(|e| panic!("cannot run cargo for {key}: {e}"));
    assert!(output.status.success(), "cargo build of {key} failed:\n{}", String::from_utf8_lossy(&output.stderr));
    eprintln!("built {key} in {:.1} s", started.elapsed().as_secs_f64());
    artifact.to_path_buf()
}

/// The stock filter (webdis HTTP bridge): `$ERL_WASM`, or built with
/// `cargo build --release --target wasm32-wasip1` into its own target directory (so a concurrent build of
/// the other flavour cannot overwrite it).
pub fn stock_filter() -> PathBuf {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| {
        if let Ok(path) = std::env::var("ERL_WASM") {
            return PathBuf::from(path);
        }
        let dir = repo().join("target/emulator-stock");
        cargo_build(
            "the stock filter",
            &[
                "build",
                "--release",
                "--target",
                "wasm32-wasip1",
                "-p",
                "edge-rate-limiter",
                "--target-dir",
                dir.to_str().unwrap(),
            ],
            &dir.join("wasm32-wasip1/release/edge_rate_limiter.wasm"),
        )
    })
    .clone()
}

/// The filter built with the Higress Redis transport (`--no-default-features --features host-redis`), if
/// the filter has that feature yet: `$ERL_WASM_HOST_REDIS`, or built into its own target directory.
pub fn host_redis_filter() -> Option<PathBuf> {
    static PATH: OnceLock<Option<PathBuf>> = OnceLock::new();
    PATH.get_or_init(|| {
        if let Ok(path) = std::env::var("ERL_WASM_HOST_REDIS") {
            return Some(PathBuf::from(path));
        }
        let manifest = std::fs::read_to_string(repo().join("Cargo.toml")).ok()?;
        let has_feature = manifest.lines().any(|l| l.trim_start().starts_with("host-redis"));
        if !has_feature {
            return None;
        }
        let dir = repo().join("target/emulator-host-redis");
        Some(cargo_build(
            "the host-redis filter",
            &[
                "build",
                "--release",
                "--target",
                "wasm32-wasip1",
                "-p",
                "edge-rate-limiter",
                "--no-default-features",
                "--features",
                "host-redis",
                "--target-dir",
                dir.to_str().unwrap(),
            ],
            &dir.join("wasm32-wasip1/release/edge_rate_limiter.wasm"),
        ))
    })
    .clone()
}

/// The hostcall probe (`probe/`), built for wasm32-wasip1.
pub fn probe_module() -> PathBuf {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| {
        let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join("probe/Cargo.toml");
        cargo_build(
            "the probe",
            &["build", "--release", "--target", "wasm32-wasip1", "--manifest-path", manifest.to_str().unwrap()],
            &Path::new(env!("CARGO_MANIFEST_DIR")).join("probe/target/wasm32-wasip1/release/hostcall_probe.wasm"),
        )
    })
    .clone()
}

/// A tiny HTTP/1.1 server answering like the probe's upstream in `probe/run_in_envoy.py` (Python's
/// `BaseHTTPRequestHandler`): 200, `server`, `date`, `content-type: text/plain`, `x-upstream: yes`,
/// `content-length: 12`, `upstream ok\n`. Stops when dropped.
pub struct PyLikeUpstream {
    pub port: u16,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl PyLikeUpstream {
    pub fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let port = listener.local_addr().unwrap().port();
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = stop.clone();
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
                        let _ = s.write_all(
                            b"HTTP/1.0 200 OK\r\nServer: BaseHTTP/0.6 Python/3.11.7\r\nDate: Sun, 22 Nov 2026 00:00:00 GMT\r\n\
                              content-type: text/plain\r\nx-upstream: yes\r\ncontent-length: 12\r\n\r\nupstream ok\n",
                        );
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(5)),
                }
            }
        });
        PyLikeUpstream { port, stop }
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
