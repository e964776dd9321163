//! A fake proxy-wasm host for the unit tests: it implements [`Host`] in memory, with the semantics of
//! Envoy 1.40 where the filter depends on them (effective context, request headers readable until the
//! request goes on, a local reply or a resume only for a paused stream context, shared data with CAS,
//! counters that refuse offsets <= 0), a clock the test moves, and faults the test switches on (refused
//! context switches, refused calls). Several fakes can share one process's shared data (VMs).
//!
//! Tests drive a [`crate::filter::Filter`] callback by callback: [`FakeHost::enter`] a context, call the
//! filter, then deliver replies with [`FakeHost::http_reply`] / [`FakeHost::redis_reply`] before calling
//! the filter's reply callbacks, as the host does.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing, clippy::panic)]

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::rc::Rc;

use crate::host::{HeaderMap, Host, HostError, LogLevel};

/// The acquire script's reply when Redis holds the rule's config: the permits left.
pub fn acquired(remaining: i64) -> Vec<u8> {
    format!(":{remaining}\r\n").into_bytes()
}

/// The acquire script's reply to a rejection when Redis holds the rule's config: minus Redisson's delay.
pub fn rejected(delay_ms: i64) -> Vec<u8> {
    format!(":-{delay_ms}\r\n").into_bytes()
}

/// The reply of an ACQUIRE_BATCH call whose segments answered `replies`, each as its call alone would
/// have (RESP: `:n`, an array `*k` of integers and bulk strings, or an error `-TEXT`).
pub fn batch_reply(replies: &[&[u8]]) -> Vec<u8> {
    let mut elements = 0;
    let mut body = Vec::new();
    for reply in replies {
        match reply.first() {
            Some(b':') => {
                body.extend_from_slice(b":1\r\n");
                body.extend_from_slice(reply);
                elements += 2;
            }
            Some(b'*') => {
                let end = reply.iter().position(|&b| b == b'\r').unwrap();
                let count: usize = std::str::from_utf8(&reply[1..end]).unwrap().parse().unwrap();
                body.extend_from_slice(format!(":2\r\n:{count}\r\n").as_bytes());
                body.extend_from_slice(&reply[end + 2..]);
                elements += 2 + count;
            }
            _ => {
                let text = reply[1..].strip_suffix(b"\r\n").unwrap();
                body.extend_from_slice(format!(":3\r\n${}\r\n", text.len()).as_bytes());
                body.extend_from_slice(text);
                body.extend_from_slice(b"\r\n");
                elements += 2;
            }
        }
    }
    let mut reply = format!("*{elements}\r\n").into_bytes();
    reply.extend_from_slice(&body);
    reply
}

/// A gated segment's reply when a permit before it was not taken ([`crate::script::Gate`]).
pub const SKIPPED: &[u8] = b"-SKIPPED a permit of the request was not taken\r\n";

/// The root context's id, as Envoy numbers it.
pub const ROOT: u32 = 1;

/// How a request ended, as the client would see it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum End {
    /// Resumed by the filter (after a pause).
    Resumed,
    /// Answered locally.
    LocalReply {
        /// HTTP status.
        status: u16,
        /// Headers as the filter gave them.
        headers: Vec<(String, String)>,
        /// Body.
        body: String,
        /// The gRPC status given with it (`None`: an HTTP reply).
        grpc_status: Option<u8>,
    },
}

/// An HTTP call the filter made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpCall {
    /// The call's token.
    pub token: u32,
    /// Envoy cluster.
    pub cluster: String,
    /// Request headers.
    pub headers: Vec<(String, String)>,
    /// Request body.
    pub body: Vec<u8>,
    /// Timeout, ms.
    pub timeout_ms: u32,
}

/// A Redis call the filter made through the host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RedisCall {
    /// The call's token.
    pub token: u32,
    /// Service (cluster and `?db=N`).
    pub service: String,
    /// The RESP command.
    pub query: Vec<u8>,
}

/// The HTTP call response being delivered: headers and body.
type HttpResponse = (Vec<(String, Vec<u8>)>, Vec<u8>);

#[derive(Debug, Default)]
struct Request {
    /// The root context whose request this is.
    root: u32,
    headers: Vec<(String, Vec<u8>)>,
    headers_open: bool,
    end: Option<End>,
    response_headers: Vec<(String, String)>,
    /// Properties the filter set on the request (`proxy_set_property`), as Envoy's filter state.
    filter_state: Vec<(String, Vec<u8>)>,
    /// The upstream's response headers ([`FakeHost::upstream_response`]).
    upstream_headers: Vec<(String, Vec<u8>)>,
    /// The response body chunk being delivered ([`FakeHost::body_chunk`]).
    body_chunk: Vec<u8>,
    /// The request body buffered so far ([`FakeHost::request_body_chunk`]), as the filter may have changed it.
    body: Vec<u8>,
}

#[derive(Debug, Default)]
struct State {
    now_ms: u64,
    effective: u32,
    properties: BTreeMap<String, Vec<u8>>,
    requests: HashMap<u32, Request>,
    logs: Vec<(LogLevel, String)>,
    counters: Vec<(String, u64)>,
    /// Histograms by name, with every value recorded.
    histograms: Vec<(String, Vec<u64>)>,
    /// Microseconds past `now_ms` (so that durations below a millisecond can be told).
    extra_us: u64,
    /// Tick period per root context (0: off); [`ROOT`] and the roots of [`FakeHost::add_root`].
    ticks: BTreeMap<u32, u32>,
    /// The root context that new requests belong to ([`FakeHost::add_root`] changes it).
    current_root: u32,
    next_token: u32,
    http_calls: Vec<HttpCall>,
    redis_calls: Vec<RedisCall>,
    redis_inits: Vec<(String, String, u32)>,
    http_response: Option<HttpResponse>,
    redis_response: Option<Vec<u8>>,
    refuse_effective_context: u32,
    refuse_calls: Option<HostError>,
    refuse_redis_init: Option<HostError>,
    refuse_tick: bool,
    /// What the next `random_seed` answers (as `random_get` does, a new value every time).
    next_seed: u64,
    /// HTTP and Redis calls numbered on counters of their own from the same start (the next Redis token).
    per_kind: Option<u32>,
}

/// Shared data of one gateway process: key -> (value, CAS version).
#[derive(Default)]
pub struct SharedData {
    entries: HashMap<String, (Vec<u8>, u32)>,
    next_cas: u32,
    /// Runs before the next write lands (another VM's turn between a read and a write).
    before_next_set: Option<Box<dyn FnOnce()>>,
}

impl std::fmt::Debug for SharedData {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedData").field("entries", &self.entries).field("next_cas", &self.next_cas).finish()
    }
}

/// The fake host of one VM. Cloning gives another handle on the same VM.
#[derive(Debug, Clone)]
pub struct FakeHost {
    state: Rc<RefCell<State>>,
    shared: Rc<RefCell<SharedData>>,
}

impl Default for FakeHost {
    fn default() -> Self {
        Self::new()
    }
}

impl FakeHost {
    /// A VM of a new gateway process, at 2023-11-14T22:13:20Z (1_700_000_000_000 ms).
    pub fn new() -> Self {
        let host = FakeHost { state: Rc::default(), shared: Rc::default() };
        host.state.borrow_mut().now_ms = 1_700_000_000_000;
        host.state.borrow_mut().effective = ROOT;
        host.state.borrow_mut().current_root = ROOT;
        host.state.borrow_mut().ticks.insert(ROOT, 0);
        host.state.borrow_mut().next_token = 100;
        host.state.borrow_mut().next_seed = 42;
        host
    }

    /// Another VM of the same gateway process (same shared data, same clock now; its own contexts).
    pub fn sibling(&self) -> Self {
        let host = FakeHost { state: Rc::default(), shared: Rc::clone(&self.shared) };
        host.state.borrow_mut().now_ms = self.now();
        host.state.borrow_mut().effective = ROOT;
        host.state.borrow_mut().current_root = ROOT;
        host.state.borrow_mut().ticks.insert(ROOT, 0);
        host.state.borrow_mut().next_token = 100_000;
        host.state.borrow_mut().next_seed = self.state.borrow().next_seed.wrapping_add(0x5851_f42d_4c95_7f2d);
        host
    }

    /// Now, ms since the epoch.
    pub fn now(&self) -> u64 {
        self.state.borrow().now_ms
    }

    /// Moves the clock forward.
    pub fn advance(&self, ms: u64) {
        self.state.borrow_mut().now_ms += ms;
    }

    /// Moves the clock forward by `us` microseconds (the ms clock moves with them).
    pub fn advance_us(&self, us: u64) {
        let mut state = self.state.borrow_mut();
        let total = state.extra_us + us;
        state.now_ms += total / 1000;
        state.extra_us = total % 1000;
    }

    /// A property (dotted path as Envoy writes it, e.g. `xds.route_name`).
    pub fn set_property(&self, path: &str, value: &str) {
        self.state.borrow_mut().properties.insert(path.to_string(), value.as_bytes().to_vec());
    }

    /// A new request on `context_id` with these headers; the context becomes effective.
    pub fn request(&self, context_id: u32, headers: &[(&str, &str)]) {
        let mut state = self.state.borrow_mut();
        let headers = headers.iter().map(|(k, v)| (k.to_ascii_lowercase(), v.as_bytes().to_vec())).collect();
        let root = state.current_root;
        state.requests.insert(context_id, Request { root, headers, headers_open: true, ..Request::default() });
        state.effective = context_id;
    }

    /// The upstream answers request `context_id` with these headers (readable by the filter from its
    /// `proxy_on_response_headers` on); the context becomes effective.
    pub fn upstream_response(&self, context_id: u32, headers: &[(&str, &str)]) {
        let mut state = self.state.borrow_mut();
        if let Some(request) = state.requests.get_mut(&context_id) {
            request.upstream_headers =
                headers.iter().map(|(k, v)| (k.to_ascii_lowercase(), v.as_bytes().to_vec())).collect();
        }
        state.effective = context_id;
    }

    /// The response body chunk of request `context_id` that `proxy_on_response_body` is about to see; the
    /// context becomes effective.
    pub fn body_chunk(&self, context_id: u32, chunk: &[u8]) {
        let mut state = self.state.borrow_mut();
        if let Some(request) = state.requests.get_mut(&context_id) {
            request.body_chunk = chunk.to_vec();
        }
        state.effective = context_id;
    }

    /// Another chunk of request `context_id`'s body arrives (appended to what Envoy buffered); the context
    /// becomes effective. Returns the size buffered so far (what `proxy_on_request_body` reports).
    pub fn request_body_chunk(&self, context_id: u32, chunk: &[u8]) -> usize {
        let mut state = self.state.borrow_mut();
        state.effective = context_id;
        let Some(request) = state.requests.get_mut(&context_id) else { return 0 };
        request.body.extend_from_slice(chunk);
        request.body.len()
    }

    /// Request `context_id`'s headers went on (the filter answered Continue to them): as in Envoy, the
    /// filter can no longer read or change them.
    pub fn headers_went_on(&self, context_id: u32) {
        if let Some(request) = self.state.borrow_mut().requests.get_mut(&context_id) {
            request.headers_open = false;
        }
    }

    /// Request `context_id`'s headers and body as they would go upstream now.
    pub fn upstream_request(&self, context_id: u32) -> (Vec<(String, String)>, Vec<u8>) {
        let state = self.state.borrow();
        let Some(request) = state.requests.get(&context_id) else { return (Vec::new(), Vec::new()) };
        let headers =
            request.headers.iter().map(|(k, v)| (k.clone(), String::from_utf8_lossy(v).into_owned())).collect();
        (headers, request.body.clone())
    }

    /// Makes a context effective, as the host does before a callback of it (the root for replies/ticks).
    pub fn enter(&self, context_id: u32) {
        self.state.borrow_mut().effective = context_id;
    }

    /// How the request ended, if it did.
    pub fn end(&self, context_id: u32) -> Option<End> {
        self.state.borrow().requests.get(&context_id).and_then(|r| r.end.clone())
    }

    /// The properties the filter set on request `context_id` (Envoy: filter state `wasm.<path>`).
    pub fn filter_state(&self, context_id: u32) -> Vec<(String, String)> {
        let state = self.state.borrow();
        let set = state.requests.get(&context_id).map(|r| r.filter_state.clone()).unwrap_or_default();
        set.into_iter().map(|(k, v)| (k, String::from_utf8_lossy(&v).into_owned())).collect()
    }

    /// The headers the filter added to the request's response.
    pub fn response_headers(&self, context_id: u32) -> Vec<(String, String)> {
        self.state.borrow().requests.get(&context_id).map(|r| r.response_headers.clone()).unwrap_or_default()
    }

    /// The HTTP calls made so far.
    pub fn http_calls(&self) -> Vec<HttpCall> {
        self.state.borrow().http_calls.clone()
    }

    /// The token of the last HTTP or Redis call (without copying the call log).
    pub fn last_token(&self) -> Option<u32> {
        let state = self.state.borrow();
        let http = state.http_calls.last().map(|c| c.token);
        let redis = state.redis_calls.last().map(|c| c.token);
        http.max(redis)
    }

    /// Forgets the calls made so far (long loops).
    pub fn clear_calls(&self) {
        let mut state = self.state.borrow_mut();
        state.http_calls.clear();
        state.redis_calls.clear();
        state.requests.clear();
    }

    /// The Redis calls made so far.
    pub fn redis_calls(&self) -> Vec<RedisCall> {
        self.state.borrow().redis_calls.clone()
    }

    /// `proxy_redis_init` calls so far: (service, username, timeout ms).
    pub fn redis_inits(&self) -> Vec<(String, String, u32)> {
        self.state.borrow().redis_inits.clone()
    }

    /// Sets the HTTP call response the next `proxy_on_http_call_response` reads (status and body); the
    /// root context becomes effective.
    pub fn http_reply(&self, status: u16, body: &[u8]) {
        let mut state = self.state.borrow_mut();
        let headers = vec![(":status".to_string(), status.to_string().into_bytes())];
        state.http_response = Some((headers, body.to_vec()));
        state.effective = ROOT;
    }

    /// Sets the Redis reply the next `proxy_on_redis_call_response` reads; the root context becomes
    /// effective.
    pub fn redis_reply(&self, reply: &[u8]) {
        let mut state = self.state.borrow_mut();
        state.redis_response = Some(reply.to_vec());
        state.effective = ROOT;
    }

    /// A counter's value by full name (`edge_rate_limiter.allowed`), 0 if never incremented.
    pub fn counter(&self, name: &str) -> u64 {
        self.state.borrow().counters.iter().find(|(n, _)| n == name).map_or(0, |(_, v)| *v)
    }

    /// The values recorded in histogram `name` so far (none if it was never defined).
    pub fn histogram(&self, name: &str) -> Vec<u64> {
        self.state.borrow().histograms.iter().find(|(n, _)| n == name).map(|(_, v)| v.clone()).unwrap_or_default()
    }

    /// Whether histogram `name` was defined.
    pub fn has_histogram(&self, name: &str) -> bool {
        self.state.borrow().histograms.iter().any(|(n, _)| n == name)
    }

    /// Every log line so far.
    pub fn logs(&self) -> Vec<(LogLevel, String)> {
        self.state.borrow().logs.clone()
    }

    /// The tick period the filter asked for on [`ROOT`] (0: off).
    pub fn tick_period(&self) -> u32 {
        self.tick_period_of(ROOT)
    }

    /// The tick period of root context `root` (0: off, or no such root).
    pub fn tick_period_of(&self, root: u32) -> u32 {
        self.state.borrow().ticks.get(&root).copied().unwrap_or(0)
    }

    /// Another root context `root` in this VM (a configuration pushed after the first, as Envoy creates
    /// one): it can be made effective, has its own tick, and the requests created from now on are its.
    pub fn add_root(&self, root: u32) {
        let mut state = self.state.borrow_mut();
        state.ticks.insert(root, 0);
        state.current_root = root;
    }

    /// Deletes root context `root`: its tick stops (as Envoy's timer goes with the root context).
    pub fn delete_root(&self, root: u32) {
        self.state.borrow_mut().ticks.remove(&root);
    }

    /// A shared data entry and its CAS version.
    pub fn shared_data(&self, key: &str) -> Option<(Vec<u8>, u32)> {
        self.shared.borrow().entries.get(key).cloned()
    }

    /// Runs `turn` (e.g. another VM's update) just before the next `set_shared_data` of this process lands:
    /// the interleaving of two VMs between one's read and its write.
    pub fn before_next_set_shared_data(&self, turn: impl FnOnce() + 'static) {
        self.shared.borrow_mut().before_next_set = Some(Box::new(turn));
    }

    /// How many shared data keys exist.
    pub fn shared_data_len(&self) -> usize {
        self.shared.borrow().entries.len()
    }

    /// From now on HTTP calls and Redis calls are numbered on counters of their own, both continuing from
    /// the next token: an HTTP call and a Redis call can then carry the same token, as hosts may number them
    /// (the emulator's `--call-tokens per-kind`).
    pub fn number_calls_per_kind(&self) {
        let mut state = self.state.borrow_mut();
        state.per_kind = Some(state.next_token);
    }

    /// The next `times` context switches fail with BadArgument.
    pub fn refuse_effective_context(&self, times: u32) {
        self.state.borrow_mut().refuse_effective_context = times;
    }

    /// HTTP and Redis calls fail with this status (None: they work).
    pub fn refuse_calls(&self, error: Option<HostError>) {
        self.state.borrow_mut().refuse_calls = error;
    }

    /// `proxy_redis_init` fails with this status (None: it works).
    pub fn refuse_redis_init(&self, error: Option<HostError>) {
        self.state.borrow_mut().refuse_redis_init = error;
    }

    /// `proxy_set_tick_period_milliseconds` fails.
    pub fn refuse_tick(&self, refuse: bool) {
        self.state.borrow_mut().refuse_tick = refuse;
    }

    fn token(&self) -> u32 {
        let mut state = self.state.borrow_mut();
        state.next_token += 1;
        state.next_token
    }

    fn redis_token(&self) -> u32 {
        let mut state = self.state.borrow_mut();
        match state.per_kind.as_mut() {
            Some(next) => {
                *next += 1;
                *next
            }
            None => {
                state.next_token += 1;
                state.next_token
            }
        }
    }

    /// The effective stream context's request, if the effective context is a stream.
    fn with_request<T>(&self, f: impl FnOnce(&mut Request) -> Result<T, HostError>) -> Result<T, HostError> {
        let mut state = self.state.borrow_mut();
        let effective = state.effective;
        match state.requests.get_mut(&effective) {
            Some(request) => f(request),
            None => Err(HostError::BadArgument),
        }
    }
}

impl Host for FakeHost {
    fn now_ms(&self) -> u64 {
        self.now()
    }

    fn now_us(&self) -> u64 {
        let state = self.state.borrow();
        state.now_ms.saturating_mul(1000).saturating_add(state.extra_us)
    }

    fn random_seed(&self) -> u64 {
        let mut state = self.state.borrow_mut();
        let seed = state.next_seed;
        state.next_seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
        seed
    }

    fn log(&self, level: LogLevel, message: &str) {
        self.state.borrow_mut().logs.push((level, message.to_string()));
    }

    fn plugin_configuration(&self) -> Result<Option<Vec<u8>>, HostError> {
        Err(HostError::NotFound)
    }

    fn define_counter(&self, name: &str) -> Result<u32, HostError> {
        let mut state = self.state.borrow_mut();
        if let Some(index) = state.counters.iter().position(|(n, _)| n == name) {
            return Ok(u32::try_from(index).unwrap());
        }
        state.counters.push((name.to_string(), 0));
        Ok(u32::try_from(state.counters.len() - 1).unwrap())
    }

    fn increment_counter(&self, id: u32, delta: u64) -> Result<(), HostError> {
        let mut state = self.state.borrow_mut();
        match state.counters.get_mut(id as usize) {
            Some((_, value)) if delta > 0 => {
                *value += delta;
                Ok(())
            }
            _ => Err(HostError::BadArgument),
        }
    }

    fn define_histogram(&self, name: &str) -> Result<u32, HostError> {
        let mut state = self.state.borrow_mut();
        if let Some(index) = state.histograms.iter().position(|(n, _)| n == name) {
            return Ok(u32::try_from(index).unwrap());
        }
        state.histograms.push((name.to_string(), Vec::new()));
        Ok(u32::try_from(state.histograms.len() - 1).unwrap())
    }

    fn record_histogram(&self, id: u32, value: u64) -> Result<(), HostError> {
        match self.state.borrow_mut().histograms.get_mut(id as usize) {
            Some((_, values)) => {
                values.push(value);
                Ok(())
            }
            None => Err(HostError::NotFound),
        }
    }

    fn set_effective_context(&self, context_id: u32) -> Result<(), HostError> {
        let mut state = self.state.borrow_mut();
        if state.refuse_effective_context > 0 {
            state.refuse_effective_context -= 1;
            return Err(HostError::BadArgument);
        }
        if !state.ticks.contains_key(&context_id) && !state.requests.contains_key(&context_id) {
            return Err(HostError::BadArgument);
        }
        state.effective = context_id;
        Ok(())
    }

    fn request_header(&self, name: &str) -> Result<Option<Vec<u8>>, HostError> {
        self.with_request(|request| {
            if !request.headers_open {
                return Err(HostError::BadArgument);
            }
            Ok(request.headers.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone()))
        })
    }

    fn request_headers(&self) -> Result<Vec<(String, Vec<u8>)>, HostError> {
        self.with_request(|request| {
            if !request.headers_open {
                return Err(HostError::BadArgument);
            }
            Ok(request.headers.clone())
        })
    }

    fn set_request_header(&self, name: &str, value: Option<&str>) -> Result<(), HostError> {
        self.with_request(|request| {
            if !request.headers_open {
                return Err(HostError::BadArgument);
            }
            request.headers.retain(|(k, _)| k != name);
            if let Some(value) = value {
                request.headers.push((name.to_string(), value.as_bytes().to_vec()));
            }
            Ok(())
        })
    }

    fn request_body(&self, size: usize) -> Result<Vec<u8>, HostError> {
        self.with_request(|request| Ok(request.body.get(..size).unwrap_or(&request.body).to_vec()))
    }

    fn set_request_body(&self, size: usize, body: &[u8]) -> Result<(), HostError> {
        self.with_request(|request| {
            let rest = request.body.get(size..).unwrap_or_default().to_vec();
            request.body = [body, &rest].concat();
            Ok(())
        })
    }

    fn property(&self, path: &[&str]) -> Result<Option<Vec<u8>>, HostError> {
        let key = path.join(".");
        if key == "source.address" {
            return Ok(Some(b"10.0.0.7:51234".to_vec()));
        }
        Ok(self.state.borrow().properties.get(&key).cloned())
    }

    fn set_property(&self, path: &str, value: &[u8]) -> Result<(), HostError> {
        self.with_request(|request| {
            request.filter_state.retain(|(k, _)| k != path);
            request.filter_state.push((path.to_string(), value.to_vec()));
            Ok(())
        })
    }

    fn resume_request(&self) -> Result<(), HostError> {
        self.with_request(|request| {
            if request.end.is_some() {
                return Err(HostError::BadArgument);
            }
            request.end = Some(End::Resumed);
            request.headers_open = false;
            Ok(())
        })
    }

    fn send_local_reply(
        &self,
        status: u16,
        headers: &HeaderMap,
        body: &[u8],
        grpc_status: Option<u8>,
    ) -> Result<(), HostError> {
        self.with_request(|request| {
            if request.end.is_some() {
                return Err(HostError::BadArgument);
            }
            let headers = headers.pairs();
            let body = String::from_utf8_lossy(body).into_owned();
            request.end = Some(End::LocalReply { status, headers, body, grpc_status });
            Ok(())
        })
    }

    fn response_header(&self, name: &str) -> Result<Option<Vec<u8>>, HostError> {
        self.with_request(|request| {
            Ok(request.upstream_headers.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone()))
        })
    }

    fn response_body(&self, size: usize) -> Result<Vec<u8>, HostError> {
        self.with_request(|request| Ok(request.body_chunk.get(..size).unwrap_or(&request.body_chunk).to_vec()))
    }

    fn add_response_header(&self, name: &str, value: &str) -> Result<(), HostError> {
        self.with_request(|request| {
            request.response_headers.push((name.to_string(), value.to_string()));
            Ok(())
        })
    }

    fn set_tick_period_ms(&self, period_ms: u32) -> Result<(), HostError> {
        let mut state = self.state.borrow_mut();
        if state.refuse_tick {
            return Err(HostError::InternalFailure);
        }
        // As Envoy: the tick of the effective context's root context (a root context's own, or the root of
        // the request whose context is effective).
        let effective = state.effective;
        let root = match state.requests.get(&effective) {
            Some(request) => request.root,
            None => effective,
        };
        match state.ticks.get_mut(&root) {
            Some(tick) => *tick = period_ms,
            None => return Err(HostError::NotFound),
        }
        Ok(())
    }

    fn get_shared_data(&self, key: &str) -> Result<(Option<Vec<u8>>, u32), HostError> {
        Ok(match self.shared.borrow().entries.get(key) {
            Some((value, cas)) => (Some(value.clone()), *cas),
            None => (None, 0),
        })
    }

    fn set_shared_data(&self, key: &str, value: &[u8], cas: u32) -> Result<(), HostError> {
        let turn = self.shared.borrow_mut().before_next_set.take();
        if let Some(turn) = turn {
            turn();
        }
        let mut shared = self.shared.borrow_mut();
        shared.next_cas += 1;
        let next = shared.next_cas;
        match shared.entries.get_mut(key) {
            Some((_, current)) if cas != 0 && cas != *current => Err(HostError::CasMismatch),
            Some(entry) => {
                *entry = (value.to_vec(), next);
                Ok(())
            }
            None => {
                shared.entries.insert(key.to_string(), (value.to_vec(), next));
                Ok(())
            }
        }
    }

    fn http_call(&self, cluster: &str, headers: &HeaderMap, body: &[u8], timeout_ms: u32) -> Result<u32, HostError> {
        if let Some(error) = self.state.borrow().refuse_calls {
            return Err(error);
        }
        let token = self.token();
        self.state.borrow_mut().http_calls.push(HttpCall {
            token,
            cluster: cluster.to_string(),
            headers: headers.pairs(),
            body: body.to_vec(),
            timeout_ms,
        });
        Ok(token)
    }

    fn http_call_response_header(&self, name: &str) -> Result<Option<Vec<u8>>, HostError> {
        let state = self.state.borrow();
        let (headers, _) = state.http_response.as_ref().ok_or(HostError::NotFound)?;
        Ok(headers.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone()))
    }

    fn http_call_response_body(&self, size: usize) -> Result<Vec<u8>, HostError> {
        let state = self.state.borrow();
        let (_, body) = state.http_response.as_ref().ok_or(HostError::NotFound)?;
        Ok(body.iter().take(size).copied().collect())
    }

    fn redis_init(&self, service: &str, username: &str, _password: &str, timeout_ms: u32) -> Result<(), HostError> {
        let mut state = self.state.borrow_mut();
        state.redis_inits.push((service.to_string(), username.to_string(), timeout_ms));
        match state.refuse_redis_init {
            Some(error) => Err(error),
            None => Ok(()),
        }
    }

    fn redis_call(&self, service: &str, query: &[u8]) -> Result<u32, HostError> {
        if let Some(error) = self.state.borrow().refuse_calls {
            return Err(error);
        }
        let token = self.redis_token();
        self.state.borrow_mut().redis_calls.push(RedisCall {
            token,
            service: service.to_string(),
            query: query.to_vec(),
        });
        Ok(token)
    }

    fn redis_call_response(&self, size: usize) -> Result<Vec<u8>, HostError> {
        let state = self.state.borrow();
        let reply = state.redis_response.as_ref().ok_or(HostError::NotFound)?;
        Ok(reply.iter().take(size).copied().collect())
    }
}
