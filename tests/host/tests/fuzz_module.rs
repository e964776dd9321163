//! Fuzzing the whole filter module in the emulator, both builds: random configurations, random request
//! header maps, random Redis replies (truncated, wrong types, huge arrays and strings, error strings,
//! garbage), random delays, closed connections, dropped and misrouted replies, and concurrent requests
//! whose replies complete in random order. The stock build's HTTP calls go to a tiny HTTP server thread
//! on 127.0.0.1 answering random bodies and statuses (as webdis would, and worse); the Higress build's
//! `proxy_redis_call` goes to a tiny TCP server answering random RESP bytes.
//!
//! Every request must end answered: never a trap (`VmFailed`), never left paused, never reset; a request
//! is let through (the emulated upstream's 200) or answered by the filter with the rejection status or,
//! failing closed, the failure status. When no reply of an iteration can be a decision, every request is
//! answered exactly per the failure mode.
//!
//! Seeded: `ERL_FUZZ_SEED=<n>` replays a run (the seed is printed; a failure prints the seed, iteration,
//! configuration, requests and the replies served). `ERL_FUZZ_ITERATIONS=<n>` sets the iterations per
//! build (default: a smoke run of a few seconds). Servers answer in the order calls arrive, so a replay
//! with concurrent requests is close to, not always exactly, the failing run.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use crate::common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{host_redis_filter, stock_filter};
use proxy_wasm_host::{Faults, Host, HostBuilder, Outcome, RequestSpec};
use serde_json::{json, Value};

// ---------------------------------------------------------------------------------------------------------
// A seeded random number generator (SplitMix64): the same seed, the same run.

#[derive(Clone)]
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    fn index(&mut self, n: usize) -> usize {
        self.below(n as u64) as usize
    }
    fn chance(&mut self, one_in: u64) -> bool {
        self.below(one_in) == 0
    }
    fn pick<T: Clone>(&mut self, items: &[T]) -> T {
        items[self.index(items.len())].clone()
    }
    fn bytes(&mut self, max: usize) -> Vec<u8> {
        (0..self.index(max + 1)).map(|_| self.next() as u8).collect()
    }
    fn fork(&mut self) -> Rng {
        Rng(self.next())
    }
}

fn seed() -> u64 {
    std::env::var("ERL_FUZZ_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| {
        let mut bytes = [0u8; 8];
        getrandom::fill(&mut bytes).unwrap();
        u64::from_le_bytes(bytes)
    })
}

fn iterations(smoke: usize) -> usize {
    std::env::var("ERL_FUZZ_ITERATIONS").ok().and_then(|s| s.parse().ok()).unwrap_or(smoke)
}

// ---------------------------------------------------------------------------------------------------------
// Replies: what a Redis (or a bridge in front of it) might answer.

/// Whether a reply could be read as an acquire decision (then outcomes depend on it).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Kind {
    Decision,
    Failure,
}

fn integers(rng: &mut Rng, numbers: &[i64]) -> Vec<u8> {
    // webdis writes the integers inside arrays as bulk strings of digits; Redis as integers.
    let bulk = rng.chance(2);
    let mut out = format!("*{}\r\n", numbers.len()).into_bytes();
    for n in numbers {
        let text = n.to_string();
        if bulk {
            out.extend(format!("${}\r\n{text}\r\n", text.len()).bytes());
        } else {
            out.extend(format!(":{text}\r\n").bytes());
        }
    }
    out
}

/// A reply the acquire script could give (or nearly: random fields), for `limiters` limiters.
fn decision(rng: &mut Rng, limiters: usize) -> Vec<u8> {
    let full = |rng: &mut Rng| -> Vec<i64> {
        let code = if rng.chance(8) { rng.below(6) as i64 - 1 } else { rng.below(4) as i64 };
        vec![
            code,
            rng.pick(&[0, 1, 5, 1503, 60_000, i64::MAX, -3]),
            rng.pick(&[0, 1, 4, -1, 100]),
            rng.pick(&[1, 3, 10, 100, 0, -1, u32::MAX as i64]),
            rng.pick(&[1, 1000, 60_000, 0, -5, 1 << 40]),
            rng.pick(&[0, 1, 0, 1, 2]),
            rng.pick(&[0, 1, 2, 3, 4]),
            rng.pick(&[0, 1, 2, 64, -1]),
        ]
    };
    match rng.below(5) {
        0 => format!(":{}\r\n", rng.pick(&[0i64, 1, 4, 99, -1, -1503, -60_000, i64::MIN, i64::MAX])).into_bytes(),
        1 => integers(rng, &[rng.clone().pick(&[0, 3, 9]), rng.clone().pick(&[1, 2, 64, 0])]),
        2 => {
            let numbers = full(rng);
            integers(rng, &numbers)
        }
        _ => {
            let count = if rng.chance(6) { limiters + 1 } else { limiters.max(1) };
            let numbers: Vec<i64> = (0..count).flat_map(|_| full(rng)).collect();
            integers(rng, &numbers)
        }
    }
}

/// A reply that is no decision: errors, wrong types, oversized, malformed, truncated. `whole`: only
/// complete RESP values (on a connection that carries the next replies too, a cut reply and the next one
/// could read as a decision together).
fn failure(rng: &mut Rng, whole: bool) -> Vec<u8> {
    match rng.below(if whole { 13 } else { 16 }) {
        0 => b"-NOSCRIPT No matching script. Please use EVAL.\r\n".to_vec(),
        1 => b"-NOAUTH Authentication required.\r\n".to_vec(),
        2 => b"-MOVED 3999 127.0.0.1:7001\r\n".to_vec(),
        3 => [
            &b"-ERR "[..],
            &rng.bytes(40)
                .iter()
                .map(|b| b.clamp(&1, &0x7f))
                .filter(|b| **b != b'\r' && **b != b'\n')
                .copied()
                .collect::<Vec<u8>>(),
            b"\r\n",
        ]
        .concat(),
        4 => b"+OK\r\n".to_vec(),
        5 => b"$-1\r\n".to_vec(),
        6 => b"*-1\r\n".to_vec(),
        7 => b"$5\r\nhello\r\n".to_vec(),
        8 => {
            // More elements than the decoder accepts.
            let n = rng.pick(&[1025usize, 2000]);
            let mut out = format!("*{n}\r\n").into_bytes();
            (0..n).for_each(|_| out.extend(b":1\r\n"));
            out
        }
        9 => {
            let mut out = b"$70000\r\n".to_vec();
            out.extend(std::iter::repeat_n(b'a', 70_000));
            out.extend(b"\r\n");
            out
        }
        10 => [&b"*1\r\n"[..]].repeat(6 + rng.index(4)).concat().into_iter().chain(b":1\r\n".iter().copied()).collect(),
        11 => b"*2147483647\r\n:1\r\n".to_vec(),
        12 => b":12x\r\n".to_vec(),
        13 => {
            // A decision cut short.
            let mut whole = decision(rng, 1);
            whole.truncate(rng.index(whole.len()));
            whole
        }
        14 => Vec::new(),
        _ => rng.bytes(64),
    }
}

fn reply(rng: &mut Rng, decisions: bool, limiters: usize, whole: bool) -> (Vec<u8>, Kind) {
    if decisions && rng.chance(2) {
        (decision(rng, limiters), Kind::Decision)
    } else {
        (failure(rng, whole && !decisions), Kind::Failure)
    }
}

// ---------------------------------------------------------------------------------------------------------
// Servers: answer in arrival order from a seeded plan; keep what they served for failure reports.

/// What the servers of an iteration do, shared with their threads.
struct Plan {
    rng: Rng,
    /// Whether replies may be decisions.
    decisions: bool,
    limiters: usize,
    /// The longest delay before an answer, ms.
    max_delay_ms: u64,
    served: Vec<String>,
    /// Answer every call with these bytes (a regression test's fixed reply).
    fixed: Option<Vec<u8>>,
}

type SharedPlan = Arc<Mutex<Plan>>;

fn new_plan(rng: Rng) -> SharedPlan {
    Arc::new(Mutex::new(Plan { rng, decisions: true, limiters: 1, max_delay_ms: 0, served: Vec::new(), fixed: None }))
}

/// A listener thread handing each connection to `serve`; stops when dropped.
struct Server {
    address: SocketAddr,
    stop: Arc<AtomicBool>,
}

impl Server {
    fn start(plan: SharedPlan, serve: fn(TcpStream, SharedPlan)) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let address = listener.local_addr().unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        std::thread::spawn(move || {
            while !flag.load(Ordering::SeqCst) {
                match listener.accept() {
                    Ok((stream, _)) => {
                        let plan = plan.clone();
                        std::thread::spawn(move || serve(stream, plan));
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(1)),
                }
            }
        });
        Server { address, stop }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

fn shown(bytes: &[u8]) -> String {
    let text = String::from_utf8_lossy(&bytes[..bytes.len().min(120)]).into_owned();
    format!("{text:?}{}", if bytes.len() > 120 { format!("... ({} bytes)", bytes.len()) } else { String::new() })
}

/// The stock build's bridge: one HTTP/1.1 exchange per connection, a random status, body and framing.
fn serve_http(mut stream: TcpStream, plan: SharedPlan) {
    let _ = stream.set_read_timeout(Some(Duration::from_secs(2)));
    let mut got = Vec::new();
    let mut buf = [0u8; 8192];
    // The head, then the body by content-length.
    loop {
        if let Some(end) = got.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&got[..end]).to_ascii_lowercase();
            let length = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:").map(|v| v.trim().parse::<usize>().unwrap_or(0)))
                .unwrap_or(0);
            if got.len() >= end + 4 + length {
                break;
            }
        }
        match stream.read(&mut buf) {
            Ok(0) | Err(_) => return,
            Ok(n) => got.extend_from_slice(&buf[..n]),
        }
    }
    let (response, delay, note) = {
        let mut plan = plan.lock().unwrap();
        let Plan { rng, decisions, limiters, max_delay_ms, fixed, .. } = &mut *plan;
        let (body, kind) = match fixed {
            Some(bytes) => (bytes.clone(), Kind::Failure),
            None => reply(rng, *decisions, *limiters, false),
        };
        let status = if fixed.is_some() {
            200
        } else if rng.chance(6) {
            rng.pick(&[503u16, 500, 404, 204, 302, 201])
        } else {
            200
        };
        let delay = if *max_delay_ms > 0 && fixed.is_none() && rng.chance(4) { rng.below(*max_delay_ms) } else { 0 };
        let framing = if fixed.is_some() { 7 } else { rng.below(8) };
        let mut response = format!("HTTP/1.1 {status} X\r\ncontent-type: text/plain\r\n").into_bytes();
        match framing {
            0 => {
                response.extend(b"transfer-encoding: chunked\r\n\r\n");
                for chunk in body.chunks(7) {
                    response.extend(format!("{:x}\r\n", chunk.len()).bytes());
                    response.extend(chunk);
                    response.extend(b"\r\n");
                }
                response.extend(b"0\r\n\r\n");
            }
            1 => {
                response.extend(b"connection: close\r\n\r\n");
                response.extend(&body);
            }
            2 => {
                // A body shorter than announced, then the connection closes.
                response.extend(format!("content-length: {}\r\n\r\n", body.len() + 5).bytes());
                response.extend(&body);
            }
            3 if rng.chance(3) => response = rng.bytes(30),
            4 if rng.chance(3) => response.clear(),
            _ => {
                response.extend(format!("content-length: {}\r\n\r\n", body.len()).bytes());
                response.extend(&body);
            }
        }
        let note = format!("http {status} framing {framing} delay {delay}ms {kind:?} {}", shown(&body));
        plan.served.push(note.clone());
        (response, delay, note)
    };
    let _ = note;
    if delay > 0 {
        std::thread::sleep(Duration::from_millis(delay));
    }
    let _ = stream.write_all(&response);
}

/// The Higress build's Redis: RESP commands in, one random reply per command out (or worse).
fn serve_resp(mut stream: TcpStream, plan: SharedPlan) {
    let _ = stream.set_read_timeout(Some(Duration::from_millis(50)));
    let mut got: Vec<u8> = Vec::new();
    let mut buf = [0u8; 16 * 1024];
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(30) {
        match stream.read(&mut buf) {
            Ok(0) => return,
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                if Arc::strong_count(&plan) == 1 {
                    return;
                }
                continue;
            }
            Err(_) => return,
        }
        // Every complete command gets its answer.
        while let Ok(Some((_, used))) = redis_protocol::resp2::decode::decode(&got) {
            let command = got.drain(..used).collect::<Vec<u8>>();
            let (bytes, delay, close) = {
                let mut plan = plan.lock().unwrap();
                let Plan { rng, decisions, limiters, max_delay_ms, fixed, .. } = &mut *plan;
                if let Some(bytes) = fixed {
                    (bytes.clone(), 0, false)
                } else {
                    let (mut bytes, kind) = reply(rng, *decisions, *limiters, true);
                    let delay = if *max_delay_ms > 0 && rng.chance(4) { rng.below(*max_delay_ms) } else { 0 };
                    let close = rng.chance(12);
                    if rng.chance(12) {
                        // Two replies for one command: the next command gets this one's second reply.
                        bytes.extend(reply(rng, *decisions, *limiters, true).0);
                    }
                    let name =
                        command.split(|&b| b == b'\n').nth(2).map(|l| String::from_utf8_lossy(l).trim().to_string());
                    let note = format!("resp {name:?} delay {delay}ms close {close} {kind:?} {}", shown(&bytes));
                    plan.served.push(note);
                    (bytes, delay, close)
                }
            };
            if delay > 0 {
                std::thread::sleep(Duration::from_millis(delay));
            }
            if stream.write_all(&bytes).is_err() || close {
                return;
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------------------
// Configurations and requests.

const KEY_SOURCES: &[&str] = &["header", "query", "cookie", "xff", "path", "client_ip", "global"];

fn limit_by(rng: &mut Rng, kind: &str) -> Value {
    match kind {
        "header" => json!({"header": "x-user-id"}),
        "query" => json!({"query": "api_key"}),
        "cookie" => json!({"cookie": "session"}),
        "xff" => json!({"x_forwarded_for": 1 + rng.below(2)}),
        "path" => json!("path"),
        "client_ip" => json!("client_ip"),
        _ => json!("global"),
    }
}

/// A random valid configuration: its rules, and whether some rule applies to every request.
fn configuration(rng: &mut Rng, host_transport: bool, failures_only: bool) -> Value {
    let mut rules = Vec::new();
    let count = 1 + rng.index(3);
    for index in 0..count {
        // With failures only, a global rule makes every request go to Redis.
        let kind = if failures_only && index == 0 { "global" } else { rng.pick(KEY_SOURCES) };
        let rate = rng.pick(&[1u64, 2, 5, 100, 1000]);
        let interval = rng.pick(&[1u64, 50, 1000, 60_000]);
        let mut rule = json!({
            "name": format!("r{index}"),
            "limit_by": limit_by(rng, kind),
            "rate": rate,
            "interval": interval,
        });
        let fields = rule.as_object_mut().unwrap();
        if rng.chance(3) {
            fields.insert("type".into(), json!(rng.pick(&["overall", "per_client"])));
        }
        if rng.chance(3) && rate > 1 {
            fields.insert("permits".into(), json!(1 + rng.below(rate.min(3))));
        }
        if rng.chance(3) {
            let choices: &[&str] = if failures_only { &["skip", "share"] } else { &["skip", "deny", "share"] };
            fields.insert("on_missing".into(), json!(rng.pick(choices)));
        }
        if rng.chance(3) {
            fields.insert("local_block_max".into(), json!(rng.pick(&[0u64, 100, 5000])));
        }
        if rng.chance(4) {
            fields.insert("rate_source".into(), json!("config"));
        }
        if rng.chance(4) {
            fields.insert("limiter".into(), json!(rng.pick(&["erl:shared", "erl:shared", "erl:{tag}"])));
        }
        let permits = fields.get("permits").and_then(Value::as_u64).unwrap_or(1);
        if rng.chance(3) && rate > permits + 1 && interval > 2 {
            fields.insert("lease".into(), json!({"max_permits": rate.min(64), "max_age": (interval - 1).min(40)}));
        } else if rng.chance(4) {
            // Reserve, then settle: the reservation replaces `permits`; the emulator's upstream answers
            // without a usage, so each reservation stays (settled_without_usage) or settles by header.
            fields.remove("permits");
            let settle = rng.pick(&[json!({"usage": "openai"}), json!({"response_header": "x-cost"})]);
            fields.insert("cost".into(), json!({"reserve": {"header": "x-max", "default": 1}, "settle": settle}));
        }
        rules.push(rule);
    }
    let timeout = rng.pick(&[60u64, 100, 150]);
    let mut redis = if host_transport {
        json!({"transport": "host", "cluster": "redis", "timeout": timeout})
    } else {
        json!({"cluster": "webdis", "timeout": timeout})
    };
    if rng.chance(3) {
        redis["redis_cluster"] = json!(true);
    }
    // Request coalescing: off, or batches of a few calls behind one or two calls out.
    redis["max_batch"] = json!(rng.pick(&[1u64, 2, 32]));
    redis["max_in_flight"] = json!(rng.pick(&[1u64, 2]));
    if host_transport && rng.chance(4) {
        redis["password"] = json!("pw");
        redis["database"] = json!(2);
    }
    let mut config = json!({
        "redis": redis,
        "rules": rules,
        "failure_mode": rng.pick(&["allow", "deny"]),
        "rejected_status": rng.pick(&[429u16, 403]),
        "failure_status": rng.pick(&[503u16, 500]),
    });
    let top = config.as_object_mut().unwrap();
    if rng.chance(3) {
        top.insert("rate_limit_headers".into(), json!(rng.pick(&["draft", "legacy", "both", "none"])));
    }
    if rng.chance(4) {
        top.insert("clock".into(), json!("redis"));
    }
    if rng.chance(4) {
        top.insert("local_block_slots".into(), json!(rng.pick(&[1u32, 16])));
    }
    if rng.chance(5) {
        // A route override with its own rule (and the same failure mode, so expectations hold).
        let failure_mode = top["failure_mode"].clone();
        top.insert(
            "_rules_".into(),
            json!([{"_match_route_": ["r1"], "failure_mode": failure_mode,
                    "rules": [{"name": "o", "limit_by": "global", "rate": 3, "interval": 1000}]}]),
        );
    }
    config
}

fn header_value(rng: &mut Rng) -> String {
    match rng.below(6) {
        0 => rng.pick(&["alice", "bob", "", " ", "a{b}", "~x", "#y"]).to_string(),
        1 => "x".repeat(rng.pick(&[128usize, 129, 256, 257, 4000])),
        2 => String::from_utf8_lossy(&rng.bytes(40)).into_owned(),
        _ => format!("u{}", rng.below(4)),
    }
}

fn request(rng: &mut Rng) -> RequestSpec {
    let mut headers: Vec<(String, String)> = Vec::new();
    for _ in 0..rng.index(7) {
        let (name, value) = match rng.below(8) {
            0 => ("x-user-id".to_string(), header_value(rng)),
            1 => {
                let path = format!(
                    "/p{}?api_key={}&x=1{}",
                    rng.below(3),
                    header_value(rng),
                    rng.pick(&["", "#f", "&api_key=2"])
                );
                (":path".to_string(), path)
            }
            2 => ("cookie".to_string(), format!("a=b; session={}; c", header_value(rng))),
            3 => {
                let entries = ["10.0.0.1", "2001:db8::1", "junk", "", " 192.168.0.9 ", "[::1]:80", "300.1.1.1"];
                let xff: Vec<&str> = (0..rng.index(4)).map(|_| rng.pick(&entries)).collect();
                ("x-forwarded-for".to_string(), xff.join(","))
            }
            4 => (":authority".to_string(), rng.pick(&["api.example", "a.example.com:8443", "[::1]:80"]).to_string()),
            _ => {
                let name: String = String::from_utf8_lossy(&rng.bytes(10))
                    .chars()
                    .filter(|c| c.is_ascii_graphic() && *c != ':')
                    .collect();
                (if name.is_empty() { "x-e".to_string() } else { name.to_ascii_lowercase() }, header_value(rng))
            }
        };
        headers.push((name, value));
    }
    let mut spec = RequestSpec { headers, ..Default::default() };
    if rng.chance(3) {
        spec.source_address = Some(rng.pick(&["10.1.2.3:5000", "[2001:db8::7]:443", "127.0.0.1:1"]).to_string());
    }
    if rng.chance(4) {
        spec.route_name = Some(rng.pick(&["r1", "r2"]).to_string());
    }
    spec
}

// ---------------------------------------------------------------------------------------------------------
// The run.

#[derive(Clone, Copy)]
enum Build {
    Stock,
    Higress,
}

fn module(build: Build) -> PathBuf {
    match build {
        Build::Stock => stock_filter(),
        Build::Higress => host_redis_filter(),
    }
}

/// Checks one outcome against the configuration; `None` if it is as expected.
fn unexpected(outcome: &Outcome, config: &Value, failures_only: bool) -> Option<String> {
    let deny = config["failure_mode"] == "deny";
    let rejected = config["rejected_status"].as_u64().unwrap() as u16;
    let failed = config["failure_status"].as_u64().unwrap() as u16;
    match outcome {
        Outcome::Continued { .. } if outcome.status() == Some(200) => (failures_only && deny)
            .then(|| "let through, but every Redis call failed and the filter fails closed".into()),
        Outcome::LocalReply { status, .. } if *status == failed && deny => None,
        Outcome::LocalReply { status, .. } if *status == rejected && !failures_only => None,
        other => Some(format!("unexpected outcome {}", other.kind())),
    }
}

/// VMs of the host (Envoy workers): requests go to either.
const VMS: usize = 2;

fn run(build: Build, smoke_iterations: usize) {
    let seed = seed();
    let iterations = iterations(smoke_iterations);
    eprintln!(
        "fuzz_module {}: ERL_FUZZ_SEED={seed} ERL_FUZZ_ITERATIONS={iterations}",
        match build {
            Build::Stock => "stock",
            Build::Higress => "higress",
        }
    );
    let path = module(build);
    let mut rng = Rng(seed);
    let plan = new_plan(rng.fork());
    let server = Server::start(
        plan.clone(),
        match build {
            Build::Stock => serve_http,
            Build::Higress => serve_resp,
        },
    );
    let started = Instant::now();
    let mut requests_sent = 0usize;
    let mut host: Option<Host> = None;
    // The filter's log lines with control characters (a Redis reply or request value forging log lines).
    let mut multi_line_logs: Vec<String> = Vec::new();
    let cluster = match build {
        Build::Stock => "webdis",
        Build::Higress => "redis",
    };
    for iteration in 0..iterations {
        let failures_only = rng.chance(3);
        let config = configuration(&mut rng, matches!(build, Build::Higress), failures_only);
        let timeout = config["redis"]["timeout"].as_u64().unwrap();
        {
            let mut plan = plan.lock().unwrap();
            plan.decisions = !failures_only;
            plan.limiters = config["rules"].as_array().unwrap().len();
            plan.max_delay_ms = if rng.chance(3) { timeout + timeout / 2 } else { timeout / 4 };
            plan.served.clear();
        }
        // One host for the whole run (compiling the module is the slow part): a new configuration per
        // iteration, as a control plane's update (late replies of the previous one reach the new root
        // context, and must be dropped there).
        let host = match &mut host {
            Some(host) => {
                if let Err(why) = host.reconfigure(config.to_string()) {
                    panic!(
                        "ERL_FUZZ_SEED={seed}, iteration {iteration}: the configuration was refused: {why}\n{config}"
                    );
                }
                host
            }
            None => {
                let built = HostBuilder::new(&path)
                    .plugin_config(config.to_string())
                    .vms(VMS)
                    .cluster(cluster, server.address)
                    .pause_deadline(Duration::from_millis(2000))
                    .build()
                    .unwrap();
                eprintln!("fuzz_module: the host started in {:.1} s", started.elapsed().as_secs_f64());
                host.insert(built)
            }
        };
        assert!(host.refusal().is_none(), "seed {seed}: the configuration was refused: {:?}\n{config}", host.refusal());
        let mut log = Vec::new();
        for _ in 0..1 + rng.index(4) {
            let faults = match rng.below(10) {
                0 => Faults { drop_http_call_responses: true, drop_redis_replies: true, ..Faults::NONE },
                1 => Faults { misroute_tokens: true, ..Faults::NONE },
                _ => Faults::NONE,
            };
            host.set_faults(faults);
            let batch: Vec<(usize, RequestSpec)> =
                (0..1 + rng.index(5)).map(|_| (rng.index(VMS), request(&mut rng))).collect();
            log.push(format!("faults {faults:?}; batch {batch:?}"));
            requests_sent += batch.len();
            let outcomes = host.send_batch(batch.clone()).unwrap();
            for ((vm, spec), outcome) in batch.iter().zip(&outcomes) {
                if let Some(why) = unexpected(outcome, &config, failures_only) {
                    let served = plan.lock().unwrap().served.join("\n    ");
                    let logs: Vec<String> = host.logs().iter().map(|l| format!("{:?} {}", l.vm, l.message)).collect();
                    panic!(
                        "ERL_FUZZ_SEED={seed}, iteration {iteration}: {why}\n  request on vm {vm}: {spec:?}\n  outcome: {}\n  \
                         configuration: {config}\n  batches:\n    {}\n  served:\n    {served}\n  log:\n    {}",
                        outcome.to_json(),
                        log.join("\n    "),
                        logs.join("\n    ")
                    );
                }
            }
            match rng.below(6) {
                0 => host.run_for(Duration::from_millis(rng.below(timeout))),
                1 => {
                    host.advance_clock(Duration::from_millis(rng.pick(&[10u64, 1000, 3_600_000])));
                }
                _ => {}
            }
        }
        for line in host.take_logs() {
            if line.message.starts_with("edge-rate-limiter:") && line.message.chars().any(char::is_control) {
                multi_line_logs.push(line.message);
            }
        }
        for vm in 0..VMS {
            assert!(
                host.vm_failure(vm).is_none(),
                "seed {seed}, iteration {iteration}: vm {vm} failed: {:?}",
                host.vm_failure(vm)
            );
        }
    }
    drop(host);
    drop(server);
    if !multi_line_logs.is_empty() {
        eprintln!(
            "fuzz_module: {} log line(s) with control characters, e.g. {:?}",
            multi_line_logs.len(),
            multi_line_logs[0]
        );
    }
    eprintln!(
        "fuzz_module: {iterations} iterations, {requests_sent} requests in {:.1} s",
        started.elapsed().as_secs_f64()
    );
}

#[test]
fn the_stock_module_answers_every_request_whatever_the_bridge_answers() {
    run(Build::Stock, 6);
}

#[test]
fn the_higress_module_answers_every_request_whatever_redis_answers() {
    run(Build::Higress, 6);
}

/// FINDING (src/limiter.rs `Failure::RedisError(text)`, logged by src/filter/mod.rs through
/// src/transport.rs `Display`): the text of a Redis error reply is logged verbatim, so a Redis (or a
/// bridge, or anything on the path) that answers `-ERR a\nforged\r\n` writes a forged line in the
/// gateway's log; src/quote.rs promises that no value from a Redis reply reaches the log unquoted. Found by
/// the module fuzz above (`Redis error: ERR \u{7f}...` lines, counted at the end of each run). Fix: quote the
/// text in `Failure`'s `Display` (or where the reply is read).
#[test]
fn redis_error_replies_cannot_forge_log_lines() {
    for build in [Build::Stock, Build::Higress] {
        let plan = new_plan(Rng(1));
        plan.lock().unwrap().fixed = Some(b"-ERR a\nedge-rate-limiter: forged\r\n".to_vec());
        let server = Server::start(
            plan.clone(),
            match build {
                Build::Stock => serve_http,
                Build::Higress => serve_resp,
            },
        );
        let (cluster, transport) = match build {
            Build::Stock => ("webdis", "http"),
            Build::Higress => ("redis", "host"),
        };
        let config = json!({
            "redis": {"cluster": cluster, "transport": transport, "timeout": 200},
            "rules": [{"name": "r", "limit_by": "global", "rate": 5, "interval": 1000}],
        });
        let mut host = HostBuilder::new(module(build))
            .plugin_config(config.to_string())
            .cluster(cluster, server.address)
            .build()
            .unwrap();
        let outcome = host.send_request(0, RequestSpec::default()).unwrap();
        assert_eq!(outcome.status(), Some(200), "fails open: {outcome:?}");
        let forged: Vec<String> = host
            .logs()
            .into_iter()
            .filter(|l| l.message.starts_with("edge-rate-limiter:") && l.message.chars().any(char::is_control))
            .map(|l| l.message)
            .collect();
        assert!(forged.is_empty(), "log lines with control characters: {forged:?}");
    }
}
