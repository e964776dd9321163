//! One HTTP stream through the filter, as Envoy drives it.
//!
//! Order of callbacks (observed in Envoy 1.40, `probe/envoy-1.40-observed.txt`):
//! - `proxy_on_context_create(ctx, root)`, `proxy_on_request_headers(ctx, n, end_of_stream)` (end of
//!   stream when there is no body); with a body `proxy_on_request_body(ctx, len, false)` then
//!   `proxy_on_request_body(ctx, 0, true)` (or the whole buffered body again if the first call stopped);
//! - a request body in chunks ([`RequestSpec::body_chunks`]; `body` is one chunk) as the response's below:
//!   one `proxy_on_request_body(ctx, len, false)` per chunk, a chunk answered StopIterationAndBuffer (1)
//!   shown again, followed by the next one, with their length (Envoy's `Context::decodeData` adds the chunk
//!   to the decoding buffer first when it is buffering), then `proxy_on_request_body(ctx, held, true)`;
//!   `proxy_get_buffer_bytes(0)` reads, and `proxy_set_buffer_bytes(0)` replaces, the data of the call, and
//!   what the filter lets through (Continue) is what goes upstream ([`Outcome::Continued`]'s
//!   `request_body`). Envoy does not touch `content-length` when a filter changes the body (the filter must
//!   remove or replace it; the host logs a warning when they disagree). Request headers are not writable
//!   during body callbacks (Envoy drops them when the headers callback continues, `Context::decodeHeaders`);
//! - a request whose headers the filter held (paused in `proxy_on_request_headers`): the client's whole body
//!   arrived meanwhile, and Envoy (which turns a wasm StopIteration into StopAllIterationAndWatermark)
//!   buffered it and gives it in one `proxy_on_request_body(ctx, total, true)` once the stream continues
//!   (`FilterManager` `commonContinue`: `doData(complete())`);
//! - upstream: `proxy_on_response_headers(ctx, n, false)`, `proxy_on_response_body(ctx, len, false)`,
//!   `proxy_on_response_body(ctx, 0, true)`;
//! - an upstream answer given per request ([`ResponseSpec`]): one `proxy_on_response_body(ctx, len, false)`
//!   per body chunk, then `proxy_on_response_body(ctx, 0, true)`. A chunk the guest answered
//!   StopIterationAndBuffer (1) stays in the buffer: the next call shows the buffered data followed by the new
//!   chunk and passes their length (Envoy's `Context::encodeData` adds the chunk to the encoding buffer
//!   first when it is buffering), the end call shows what is still buffered; Continue (0) lets the buffer
//!   through to the client. A non-zero answer to the end call pauses the stream until
//!   `proxy_continue_stream`;
//! - an upstream answer with trailers ([`ResponseSpec::trailers`]): the headers and every chunk come with
//!   `end_of_stream = false`, no end-of-stream body call, then `proxy_on_response_trailers(ctx, n)` if
//!   exported (trailers map 3 readable and writable; the body buffer shows the data the filter holds). Its
//!   non-zero answer pauses the response until `proxy_continue_stream(Response)`; then the held data and the
//!   trailers go to the client (`FilterManager` `commonHandleAfterTrailersCallback`);
//! - an upstream that resets the stream after the response headers (`reset_after`): no more body
//!   callbacks, no end of stream; the stream ends as Envoy ends a reset stream (the connection manager
//!   writes the access log, then destroys the filters): `proxy_on_log` (the response code received),
//!   `proxy_on_done`, `proxy_on_delete`. A client that closes its connection mid-response gives the filter
//!   the same calls;
//! - end: `proxy_on_log`, `proxy_on_done`, `proxy_on_delete`;
//! - a local reply (`proxy_send_local_response`, sent after the guest call returns) goes through the
//!   sending filter's encoder path too: `proxy_on_response_headers(ctx, n, body_empty)` with `:status`,
//!   the guest's headers, then `content-length` and `content-type: text/plain` (unless given) for a
//!   non-empty body; then `proxy_on_response_body(ctx, len, true)`; the request headers stay readable;
//! - a client that gives up on a paused stream: `proxy_on_log` (no response code), `proxy_on_done`,
//!   `proxy_on_delete`; the pending call's reply is still delivered to the root context later;
//! - a non-zero return from a headers/body callback pauses the stream until `proxy_continue_stream`;
//! - a trap fails the VM: that stream gets a 503 with an empty body (no more guest calls), and every
//!   later request of the VM too (Envoy `CHECK_FAIL`, observed); with `fail_open` requests pass instead.

use std::collections::VecDeque;
use std::time::Instant;

use crate::abi::LogLevel;
use crate::abi::StreamType;
use crate::error::HostError;
use crate::exchange::{Cost, Headers, Outcome, RequestSpec, ResponseSpec};
use crate::host::Host;
use crate::shared::LogSource;
use crate::vm::{Action, BodyView, Context, LocalReplySpec, Pairs, StreamData, StreamInfo};

/// A change to a stream's flags.
type Apply = Box<dyn FnOnce(&mut StreamRun)>;

/// Where a paused stream resumes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Resume {
    /// Paused in `proxy_on_request_headers`: next, the request body or the upstream.
    RequestHeaders,
    /// Paused in `proxy_on_request_body`: next, the upstream.
    RequestBody,
    /// Paused in `proxy_on_response_headers`: next, the response body.
    ResponseHeaders,
    /// Paused in `proxy_on_response_body`: next, the end.
    ResponseBody,
    /// Paused in `proxy_on_response_trailers`: next, the held body and the trailers go to the client.
    ResponseTrailers,
}

/// The host's record of a stream.
pub(crate) struct StreamRun {
    pub started: Instant,
    pub deadline: Instant,
    pub cost: Cost,
    pub waiting: Option<Resume>,
    pub has_body: bool,
    pub local_reply: Option<LocalReplySpec>,
    pub in_local_reply: bool,
    pub local_reply_status: Option<(u16, String)>,
    pub reset: bool,
    pub continue_request: bool,
    pub continue_response: bool,
    pub request_headers_after: Headers,
    /// The chunks of the request body still to come (`RequestSpec::body` or `body_chunks`).
    pub request_chunks: VecDeque<Vec<u8>>,
    /// Request data the filter holds (it answered StopIterationAndBuffer).
    pub request_buffered: Vec<u8>,
    /// The request body that went through the filter (upstream) so far.
    pub request_sent: Vec<u8>,
    pub outcome: Option<Outcome>,
    /// The upstream's answer given with the request (`RequestSpec::response`), body chunk by chunk.
    pub response: Option<ResponseSpec>,
    /// The chunks of `response` still to come.
    pub chunks: VecDeque<Vec<u8>>,
    /// Chunks still to come before the upstream resets the stream (`ResponseSpec::reset_after`).
    pub reset_in: Option<usize>,
    /// The response body that went through the filter to the client so far (chunked answers).
    pub delivered: Vec<u8>,
    /// Response data the filter holds (it answered StopIterationAndBuffer).
    pub buffered: Vec<u8>,
    /// The trailers of `response` still to come (they end the stream instead of the last body call).
    pub trailers: Pairs,
}

fn headers_to_pairs(headers: &Headers) -> Pairs {
    headers.iter().map(|(k, v)| (k.to_ascii_lowercase().into_bytes(), v.clone().into_bytes())).collect()
}

fn pairs_to_headers(pairs: &Pairs) -> Headers {
    pairs
        .iter()
        .map(|(k, v)| (String::from_utf8_lossy(k).into_owned(), String::from_utf8_lossy(v).into_owned()))
        .collect()
}

fn count(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

/// The request headers Envoy's connection manager hands the filters (see [`RequestSpec`]).
fn request_headers(spec: &RequestSpec) -> Pairs {
    let given = &spec.headers;
    let get = |name: &str| given.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.clone());
    let method = if spec.has_body() { "POST" } else { "GET" };
    let mut headers: Headers = vec![
        (":authority".into(), get(":authority").or_else(|| get("host")).unwrap_or_else(|| "localhost".into())),
        (":path".into(), get(":path").unwrap_or_else(|| "/".into())),
        (":method".into(), get(":method").unwrap_or_else(|| method.into())),
        (":scheme".into(), get(":scheme").unwrap_or_else(|| "http".into())),
    ];
    for (k, v) in given {
        let k = k.to_ascii_lowercase();
        if k.starts_with(':') || k == "host" {
            continue;
        }
        headers.push((k, v.clone()));
    }
    if spec.has_body() && get("content-length").is_none() && get("transfer-encoding").is_none() {
        let length =
            spec.body.as_ref().map_or(0, String::len) + spec.body_chunks.iter().map(String::len).sum::<usize>();
        headers.push(("content-length".into(), length.to_string()));
    }
    if get("x-forwarded-proto").is_none() {
        headers.push(("x-forwarded-proto".into(), "http".into()));
    }
    if get("x-request-id").is_none() {
        headers.push(("x-request-id".into(), request_id()));
    }
    headers_to_pairs(&headers)
}

fn request_id() -> String {
    let mut b = [0u8; 16];
    let _ = getrandom::fill(&mut b);
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    let hex: String = b.iter().map(|x| format!("{x:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        hex.get(0..8).unwrap_or_default(),
        hex.get(8..12).unwrap_or_default(),
        hex.get(12..16).unwrap_or_default(),
        hex.get(16..20).unwrap_or_default(),
        hex.get(20..32).unwrap_or_default()
    )
}

impl Host {
    /// Creates the stream's context and runs it as far as it goes without waiting.
    pub(crate) fn start_stream(&mut self, vm: usize, spec: RequestSpec) -> Result<(usize, u32), HostError> {
        let source = spec.source_address.clone().unwrap_or_else(|| "127.0.0.1:40000".into());
        if !source.contains(':') {
            return Err(HostError::BadRequest(format!("source_address {source:?} is not ip:port")));
        }
        let connection_id = self.connection_id();
        let now = Instant::now();
        let deadline = now + self.pause_deadline;
        if spec.body.is_some() && !spec.body_chunks.is_empty() {
            return Err(HostError::BadRequest("a request has a body or body chunks, not both".into()));
        }
        let request_chunks: VecDeque<Vec<u8>> = match &spec.body {
            Some(body) => VecDeque::from([body.clone().into_bytes()]),
            None => spec.body_chunks.iter().map(|chunk| chunk.clone().into_bytes()).collect(),
        };
        let mut data = StreamData {
            request_headers: request_headers(&spec),
            info: StreamInfo {
                source_address: source,
                route_name: spec.route_name.clone().unwrap_or_else(|| "route".into()),
                connection_id,
                ..Default::default()
            },
            ..Default::default()
        };
        let context = self
            .with_state(vm, |s| {
                let id = s.allocate_context();
                data.root = s.root_id;
                s.contexts.insert(id, Context::Stream(Box::new(data)));
                id
            })
            .ok_or(HostError::NoSuchVm { index: vm, count: self.vm_count() })?;
        let key = (vm, context);
        self.streams.insert(
            key,
            StreamRun {
                started: now,
                deadline,
                cost: Cost::default(),
                waiting: None,
                has_body: spec.has_body(),
                local_reply: None,
                in_local_reply: false,
                local_reply_status: None,
                reset: false,
                continue_request: false,
                continue_response: false,
                request_headers_after: Vec::new(),
                request_chunks,
                request_buffered: Vec::new(),
                request_sent: Vec::new(),
                outcome: None,
                response: spec.response.clone(),
                chunks: VecDeque::new(),
                reset_in: None,
                delivered: Vec::new(),
                buffered: Vec::new(),
                trailers: Vec::new(),
            },
        );
        // A VM that already failed: Envoy answers without calling it.
        if self.vms.get(vm).is_some_and(|v| v.failed.is_some()) {
            self.fail_stream(key);
            return Ok(key);
        }
        let root = self.with_state(vm, |s| s.root_id).unwrap_or(0);
        if let Some(f) = self.vms.get(vm).and_then(|v| v.exports.on_context_create.clone()) {
            let called =
                self.call(vm, "proxy_on_context_create", context, Some(context), |s| f.call(s, (context, root)));
            if self.settle(key, called.trapped) {
                return Ok(key);
            }
        }
        self.request_headers(key);
        Ok(key)
    }

    /// After a guest call: applies the deferred actions of the VM; for the stream `key`, handles a trap,
    /// a reset or a local reply. True if the stream is over (or took another path).
    fn settle(&mut self, key: (usize, u32), trapped: bool) -> bool {
        self.after_call(key.0);
        if trapped || self.vms.get(key.0).is_some_and(|v| v.failed.is_some()) {
            if self.is_open(key) && self.streams.get(&key).is_some_and(|s| s.waiting.is_none()) {
                self.fail_stream(key);
            }
            return true;
        }
        let Some(run) = self.streams.get_mut(&key) else { return true };
        if run.outcome.is_some() {
            return true;
        }
        if run.reset {
            self.finish(key, |cost| Outcome::Reset { cost });
            return true;
        }
        if let Some(reply) = run.local_reply.take() {
            self.local_reply(key, reply);
            return true;
        }
        false
    }

    fn is_open(&self, key: (usize, u32)) -> bool {
        self.streams.get(&key).is_some_and(|s| s.outcome.is_none())
    }

    /// Takes the VM's deferred actions and applies them to their streams; wakes streams waiting elsewhere.
    pub(crate) fn after_call(&mut self, vm: usize) {
        self.reschedule_tick(vm, Instant::now());
        let actions = self.with_state(vm, |s| std::mem::take(&mut s.actions)).unwrap_or_default();
        let mut touched = Vec::new();
        for action in actions {
            let (context, apply): (u32, Apply) = match action {
                Action::Continue { context, stream: StreamType::Request } => {
                    (context, Box::new(|r: &mut StreamRun| r.continue_request = true))
                }
                Action::Continue { context, .. } => (context, Box::new(|r: &mut StreamRun| r.continue_response = true)),
                Action::LocalReply { context, reply } => (
                    context,
                    Box::new(move |r: &mut StreamRun| {
                        // Envoy sends one local reply; a second one during the first one's encoding is
                        // not emulated (it is dropped).
                        if !r.in_local_reply && r.local_reply.is_none() {
                            r.local_reply = Some(reply);
                        }
                    }),
                ),
                Action::Close { context } => (context, Box::new(|r: &mut StreamRun| r.reset = true)),
            };
            if let Some(run) = self.streams.get_mut(&(vm, context)) {
                if run.outcome.is_none() {
                    apply(run);
                    touched.push((vm, context));
                }
            }
        }
        touched.dedup();
        for key in touched {
            self.wake(key);
        }
    }

    /// Resumes a waiting stream whose flags say so.
    fn wake(&mut self, key: (usize, u32)) {
        let Some(run) = self.streams.get_mut(&key) else { return };
        let Some(waiting) = run.waiting else { return };
        if run.reset {
            run.waiting = None;
            self.finish(key, |cost| Outcome::Reset { cost });
        } else if let Some(reply) = run.local_reply.take() {
            run.waiting = None;
            self.local_reply(key, reply);
        } else if matches!(waiting, Resume::RequestHeaders | Resume::RequestBody) && run.continue_request {
            run.continue_request = false;
            run.waiting = None;
            self.resume(key, waiting);
        } else if matches!(waiting, Resume::ResponseHeaders | Resume::ResponseBody | Resume::ResponseTrailers)
            && run.continue_response
        {
            run.continue_response = false;
            run.waiting = None;
            self.resume(key, waiting);
        }
    }

    fn resume(&mut self, key: (usize, u32), from: Resume) {
        match from {
            Resume::RequestHeaders => {
                let has_body = self.streams.get(&key).is_some_and(|s| s.has_body);
                if has_body {
                    self.request_body(key, true);
                } else {
                    self.upstream(key);
                }
            }
            Resume::RequestBody => self.upstream(key),
            Resume::ResponseHeaders => self.response_body(key),
            Resume::ResponseBody => self.finish_continued(key),
            Resume::ResponseTrailers => self.end_with_trailers(key),
        }
    }

    /// Decides after a headers/body callback: stop (wait for `proxy_continue_stream`) or go on.
    fn stopped(&mut self, key: (usize, u32), result: Option<u32>, at: Resume) -> bool {
        let stop_iteration = self.with_state(key.0, |s| s.stop_iteration).unwrap_or(false);
        let Some(run) = self.streams.get_mut(&key) else { return true };
        let continued = match at {
            Resume::RequestHeaders | Resume::RequestBody => std::mem::take(&mut run.continue_request),
            Resume::ResponseHeaders | Resume::ResponseBody | Resume::ResponseTrailers => {
                std::mem::take(&mut run.continue_response)
            }
        };
        if result.unwrap_or(0) == 0 && !stop_iteration {
            return false;
        }
        if continued {
            // The guest continued the stream during the very callback that stops it. Envoy asserts
            // against this in debug builds; release builds go on.
            self.shared.log(
                Some(key.0),
                LogLevel::Warn,
                key.1,
                LogSource::Host,
                "proxy_continue_stream was called during the callback that then paused the stream; the stream goes on (Envoy asserts against this in debug builds)".into(),
            );
            return false;
        }
        run.waiting = Some(at);
        true
    }

    fn request_headers(&mut self, key: (usize, u32)) {
        let (vm, ctx) = key;
        let has_body = self.streams.get(&key).is_some_and(|s| s.has_body);
        let n = self
            .with_state(vm, |s| {
                s.stream_by_id(ctx).map(|d| {
                    d.request_headers_open = true;
                    count(d.request_headers.len())
                })
            })
            .flatten()
            .unwrap_or(0);
        let Some(f) = self.vms.get(vm).and_then(|v| v.exports.on_request_headers.clone()) else {
            self.set_request_headers_open(key, false);
            return self.after_request_headers(key);
        };
        let called =
            self.call(vm, "proxy_on_request_headers", ctx, Some(ctx), |s| f.call(s, (ctx, n, u32::from(!has_body))));
        if self.settle(key, called.trapped) {
            return;
        }
        if self.stopped(key, called.value, Resume::RequestHeaders) {
            return;
        }
        self.set_request_headers_open(key, false);
        self.after_request_headers(key);
    }

    fn after_request_headers(&mut self, key: (usize, u32)) {
        if self.streams.get(&key).is_some_and(|s| s.has_body) {
            self.request_body(key, false);
        } else {
            self.upstream(key);
        }
    }

    fn set_request_headers_open(&mut self, (vm, ctx): (usize, u32), open: bool) {
        self.with_state(vm, |s| {
            if let Some(d) = s.stream_by_id(ctx) {
                d.request_headers_open = open;
            }
        });
    }

    fn set_body_view(&mut self, (vm, ctx): (usize, u32), view: Option<BodyView>) {
        self.with_state(vm, |s| {
            if let Some(d) = s.stream_by_id(ctx) {
                d.body_view = view;
            }
        });
    }

    /// Two body callbacks, as Envoy's HTTP/1 codec delivers a body and then its end (the host-wide
    /// upstream's answer, [`crate::HostBuilder::upstream`]).
    fn body_calls(&mut self, key: (usize, u32), view: BodyView, at: Resume) -> Option<bool> {
        let (vm, ctx) = key;
        let export = self.vms.get(vm).and_then(|v| match view {
            BodyView::Request => v.exports.on_request_body.clone(),
            BodyView::Response => v.exports.on_response_body.clone(),
        });
        let name = match view {
            BodyView::Request => "proxy_on_request_body",
            BodyView::Response => "proxy_on_response_body",
        };
        let len = self
            .with_state(vm, |s| {
                s.stream_by_id(ctx).map(|d| match view {
                    BodyView::Request => count(d.request_body.len()),
                    BodyView::Response => count(d.response_body.len()),
                })
            })
            .flatten()
            .unwrap_or(0);
        let Some(f) = export else { return Some(false) };
        self.set_body_view(key, Some(view));
        let first = self.call(vm, name, ctx, Some(ctx), |s| f.call(s, (ctx, len, 0)));
        if self.settle(key, first.trapped) {
            return None;
        }
        // StopIterationAndBuffer: the next call sees the whole buffered body; Continue: the empty end.
        let buffered = first.value.unwrap_or(0) != 0;
        let second_len = if buffered { len } else { 0 };
        if !buffered {
            self.set_body_view(key, None);
        }
        let second = self.call(vm, name, ctx, Some(ctx), |s| f.call(s, (ctx, second_len, 1)));
        self.set_body_view(key, None);
        if self.settle(key, second.trapped) {
            return None;
        }
        Some(self.stopped(key, second.value, at))
    }

    /// The request body, chunk by chunk (see the module docs): one `proxy_on_request_body(ctx, len, false)`
    /// per chunk, the data the guest holds (StopIterationAndBuffer) shown again before each new chunk, then
    /// the end `proxy_on_request_body(ctx, held, true)`. After the filter held the headers (`held`), the
    /// whole body arrived meanwhile and comes in that one end call: Envoy buffered it while the filter
    /// stopped all iteration and hands it over when it continues (`FilterManager` `commonContinue`,
    /// `doData(complete())`).
    fn request_body(&mut self, key: (usize, u32), held: bool) {
        let (vm, ctx) = key;
        if self.vms.get(vm).is_none_or(|v| v.exports.on_request_body.is_none()) {
            // No body callback: the body goes upstream as it comes.
            let Some(run) = self.streams.get_mut(&key) else { return };
            let chunks: Vec<Vec<u8>> = run.request_chunks.drain(..).collect();
            run.request_sent.extend(chunks.concat());
            return self.upstream(key);
        }
        if held {
            let Some(run) = self.streams.get_mut(&key) else { return };
            let chunks: Vec<Vec<u8>> = run.request_chunks.drain(..).collect();
            run.request_buffered.extend(chunks.concat());
        }
        loop {
            let Some(run) = self.streams.get_mut(&key) else { return };
            let Some(chunk) = run.request_chunks.pop_front() else { break };
            let mut data = std::mem::take(&mut run.request_buffered);
            data.extend_from_slice(&chunk);
            let Some(result) = self.body_call(key, BodyView::Request, data, false) else { return };
            let data = self
                .with_state(vm, |s| s.stream_by_id(ctx).map(|d| std::mem::take(&mut d.request_body)))
                .flatten()
                .unwrap_or_default();
            let Some(run) = self.streams.get_mut(&key) else { return };
            if result == 0 {
                run.request_sent.extend(data);
            } else {
                run.request_buffered = data;
            }
        }
        // The end: what the filter leaves in the buffer goes upstream when the request goes on.
        let held = self.streams.get_mut(&key).map(|r| std::mem::take(&mut r.request_buffered)).unwrap_or_default();
        let Some(result) = self.body_call(key, BodyView::Request, held, true) else { return };
        if !self.stopped(key, Some(result), Resume::RequestBody) {
            self.upstream(key);
        }
    }

    /// The router: the emulated upstream answers (the request's own answer, else the host's).
    fn upstream(&mut self, key: (usize, u32)) {
        let (vm, ctx) = key;
        let given = self.streams.get(&key).and_then(|r| r.response.clone());
        let (status, body, headers) = match given {
            Some(response) => {
                let chunks: VecDeque<Vec<u8>> = response.body_chunks.iter().map(|c| c.clone().into_bytes()).collect();
                let total: usize = chunks.iter().map(Vec::len).sum();
                let mut headers: Headers = vec![(":status".into(), response.status.to_string())];
                headers.extend(response.headers.iter().map(|(k, v)| (k.to_ascii_lowercase(), v.clone())));
                if !headers.iter().any(|(k, _)| k == "content-length" || k == "transfer-encoding") {
                    headers.push(("content-length".into(), total.to_string()));
                }
                if let Some(run) = self.streams.get_mut(&key) {
                    run.chunks = chunks;
                    run.reset_in = response.reset_after;
                    run.trailers = headers_to_pairs(&response.trailers);
                }
                (response.status, Vec::new(), headers)
            }
            None => {
                let upstream = self.setup.upstream.clone();
                let mut headers: Headers = vec![(":status".into(), upstream.status.to_string())];
                headers.extend(upstream.headers.iter().cloned());
                if !upstream.headers.iter().any(|(k, _)| k == "content-length") {
                    headers.push(("content-length".into(), upstream.body.len().to_string()));
                }
                (upstream.status, upstream.body, headers)
            }
        };
        let mut headers = headers;
        headers.push(("x-envoy-upstream-service-time".into(), "0".into()));
        let (after, last) = self
            .with_state(vm, |s| {
                s.stream_by_id(ctx).map(|d| {
                    d.request_headers_open = false;
                    d.response_headers = headers_to_pairs(&headers);
                    d.response_body = body;
                    d.info.response_code = Some(status);
                    d.info.upstream_address = Some("127.0.0.1:80".into());
                    (pairs_to_headers(&d.request_headers), std::mem::take(&mut d.request_body))
                })
            })
            .flatten()
            .unwrap_or_default();
        let Some(run) = self.streams.get_mut(&key) else { return };
        // The last piece of the request body: what the end call left in the buffer.
        run.request_sent.extend(last);
        let sent = run.request_sent.len();
        let given = crate::exchange::header(&after, "content-length").map(str::to_string);
        run.request_headers_after = after;
        if let Some(given) = given.filter(|given| given.trim().parse::<usize>().ok() != Some(sent)) {
            // Envoy forwards both as they are: a filter that changes the body fixes the header itself.
            let note = format!(
                "the request goes upstream with content-length {given} and a body of {sent} bytes: Envoy does not \
                 correct content-length after a filter changed the body (the filter must remove or replace it)"
            );
            self.shared.log(Some(vm), LogLevel::Warn, ctx, LogSource::Host, note);
        }
        self.response_headers(key);
    }

    fn response_headers(&mut self, key: (usize, u32)) {
        let (vm, ctx) = key;
        // A chunked answer ends with its headers only if it has no chunk, no reset and no trailers.
        let chunked = self
            .streams
            .get(&key)
            .filter(|r| r.response.is_some() && !r.in_local_reply)
            .map(|r| r.chunks.is_empty() && r.reset_in.is_none() && r.trailers.is_empty());
        let (n, body_empty) = self
            .with_state(vm, |s| {
                s.stream_by_id(ctx).map(|d| {
                    d.response_headers_open = true;
                    (count(d.response_headers.len()), d.response_body.is_empty())
                })
            })
            .flatten()
            .unwrap_or((0, true));
        let body_empty = chunked.unwrap_or(body_empty);
        if let Some(f) = self.vms.get(vm).and_then(|v| v.exports.on_response_headers.clone()) {
            let called = self
                .call(vm, "proxy_on_response_headers", ctx, Some(ctx), |s| f.call(s, (ctx, n, u32::from(body_empty))));
            if self.settle(key, called.trapped) {
                return;
            }
            if self.stopped(key, called.value, Resume::ResponseHeaders) {
                return;
            }
        }
        self.with_state(vm, |s| {
            if let Some(d) = s.stream_by_id(ctx) {
                d.response_headers_open = false;
            }
        });
        self.response_body(key);
    }

    fn response_body(&mut self, key: (usize, u32)) {
        let (vm, ctx) = key;
        let in_local_reply = self.streams.get(&key).is_some_and(|s| s.in_local_reply);
        if !in_local_reply && self.streams.get(&key).is_some_and(|s| s.response.is_some()) {
            return self.response_chunks(key);
        }
        let empty =
            self.with_state(vm, |s| s.stream_by_id(ctx).map(|d| d.response_body.is_empty())).flatten().unwrap_or(true);
        if empty {
            return self.finish_continued(key);
        }
        if in_local_reply {
            // A local reply's body comes in one piece, with the end of stream.
            if let Some(f) = self.vms.get(vm).and_then(|v| v.exports.on_response_body.clone()) {
                let len = self
                    .with_state(vm, |s| s.stream_by_id(ctx).map(|d| count(d.response_body.len())))
                    .flatten()
                    .unwrap_or(0);
                self.set_body_view(key, Some(BodyView::Response));
                let called = self.call(vm, "proxy_on_response_body", ctx, Some(ctx), |s| f.call(s, (ctx, len, 1)));
                self.set_body_view(key, None);
                if self.settle(key, called.trapped) {
                    return;
                }
                if self.stopped(key, called.value, Resume::ResponseBody) {
                    return;
                }
            }
            return self.finish_continued(key);
        }
        if let Some(false) = self.body_calls(key, BodyView::Response, Resume::ResponseBody) {
            self.finish_continued(key);
        }
    }

    /// A per-request answer ([`ResponseSpec`]): each chunk in its own `proxy_on_response_body(ctx, len,
    /// false)`, then the end of stream, or the upstream's reset after `reset_after` chunks.
    fn response_chunks(&mut self, key: (usize, u32)) {
        let (vm, ctx) = key;
        if self.vms.get(vm).is_none_or(|v| v.exports.on_response_body.is_none()) {
            // No body callback: every chunk goes through as it comes.
            let Some(run) = self.streams.get_mut(&key) else { return };
            let take = run.reset_in.unwrap_or(usize::MAX).min(run.chunks.len());
            let passed: Vec<Vec<u8>> = run.chunks.drain(..take).collect();
            run.delivered.extend(passed.concat());
            let reset = run.reset_in.is_some();
            let trailers = !run.trailers.is_empty();
            self.with_state(vm, |s| s.stream_by_id(ctx).map(|d| d.response_body.clear()));
            return match (reset, trailers) {
                (true, _) => self.upstream_reset(key),
                (false, true) => self.response_trailers(key),
                (false, false) => self.finish_continued(key),
            };
        }
        if self.streams.get(&key).is_some_and(|r| r.chunks.is_empty() && r.reset_in.is_none() && r.trailers.is_empty())
        {
            // The headers ended the stream (`proxy_on_response_headers(ctx, n, true)`): no body call.
            return self.finish_continued(key);
        }
        loop {
            let Some(run) = self.streams.get_mut(&key) else { return };
            if run.reset_in == Some(0) {
                return self.upstream_reset(key);
            }
            let Some(chunk) = run.chunks.pop_front() else { break };
            if let Some(left) = run.reset_in.as_mut() {
                *left -= 1;
            }
            let mut data = std::mem::take(&mut run.buffered);
            data.extend_from_slice(&chunk);
            let Some(result) = self.body_call(key, BodyView::Response, data, false) else { return };
            let data = self
                .with_state(vm, |s| s.stream_by_id(ctx).map(|d| std::mem::take(&mut d.response_body)))
                .flatten()
                .unwrap_or_default();
            let Some(run) = self.streams.get_mut(&key) else { return };
            if result == 0 {
                run.delivered.extend(data);
            } else {
                run.buffered = data;
            }
        }
        if self.streams.get(&key).is_some_and(|r| r.reset_in.is_some()) {
            // The upstream reset after its last chunk: still no end of stream.
            return self.upstream_reset(key);
        }
        if self.streams.get(&key).is_some_and(|r| !r.trailers.is_empty()) {
            // The trailers end the stream: no end-of-stream body call; what the filter holds stays held.
            return self.response_trailers(key);
        }
        let buffered = self.streams.get_mut(&key).map(|r| std::mem::take(&mut r.buffered)).unwrap_or_default();
        let Some(result) = self.body_call(key, BodyView::Response, buffered, true) else { return };
        if !self.stopped(key, Some(result), Resume::ResponseBody) {
            self.finish_continued(key);
        }
    }

    /// The response trailers (Envoy `Context::encodeTrailers`): `proxy_on_response_trailers(ctx, number)` if
    /// the module exports it, with the trailers readable and writable (map 3) and the response data the
    /// filter holds, if any, as the body buffer (Envoy's encoding buffer while the filter buffers). A
    /// non-zero answer pauses the stream until `proxy_continue_stream(Response)`; then the held data and
    /// the trailers go to the client.
    fn response_trailers(&mut self, key: (usize, u32)) {
        let (vm, ctx) = key;
        let Some(run) = self.streams.get_mut(&key) else { return };
        let trailers = std::mem::take(&mut run.trailers);
        let held = std::mem::take(&mut run.buffered);
        let n = count(trailers.len());
        self.with_state(vm, |s| {
            if let Some(d) = s.stream_by_id(ctx) {
                d.response_trailers = trailers;
                d.response_trailers_open = true;
                d.response_body = held;
            }
        });
        if let Some(f) = self.vms.get(vm).and_then(|v| v.exports.on_response_trailers.clone()) {
            self.set_body_view(key, Some(BodyView::Response));
            let called = self.call(vm, "proxy_on_response_trailers", ctx, Some(ctx), |s| f.call(s, (ctx, n)));
            self.set_body_view(key, None);
            if self.settle(key, called.trapped) {
                return;
            }
            if self.stopped(key, called.value, Resume::ResponseTrailers) {
                return;
            }
        }
        self.end_with_trailers(key);
    }

    /// The response goes on past its trailers: the data the filter held, then the trailers, reach the client
    /// (Envoy's `commonContinue`: `doData`, then `doTrailers`).
    fn end_with_trailers(&mut self, key: (usize, u32)) {
        let (vm, ctx) = key;
        self.with_state(vm, |s| {
            if let Some(d) = s.stream_by_id(ctx) {
                d.response_trailers_open = false;
            }
        });
        self.finish_continued(key);
    }

    /// One body callback (`proxy_on_request_body` or `proxy_on_response_body`, `view`) `(ctx, len,
    /// end_of_stream)` showing `data` (the buffer the guest may read and change; it stays in the stream's
    /// request or response body): the guest's answer, or `None` if the stream took another path (a trap, a
    /// reset, a local reply).
    fn body_call(&mut self, key: (usize, u32), view: BodyView, data: Vec<u8>, end_of_stream: bool) -> Option<u32> {
        let (vm, ctx) = key;
        let (f, name) = self.vms.get(vm).and_then(|v| match view {
            BodyView::Request => v.exports.on_request_body.clone().map(|f| (f, "proxy_on_request_body")),
            BodyView::Response => v.exports.on_response_body.clone().map(|f| (f, "proxy_on_response_body")),
        })?;
        let len = count(data.len());
        self.with_state(vm, |s| {
            s.stream_by_id(ctx).map(|d| match view {
                BodyView::Request => d.request_body = data,
                BodyView::Response => d.response_body = data,
            })
        });
        self.set_body_view(key, Some(view));
        let called = self.call(vm, name, ctx, Some(ctx), |s| f.call(s, (ctx, len, u32::from(end_of_stream))));
        self.set_body_view(key, None);
        if self.settle(key, called.trapped) {
            return None;
        }
        Some(called.value.unwrap_or(0))
    }

    /// The upstream reset the stream mid-response: the client has the headers and the body delivered so far;
    /// the filter gets no more body calls, then `proxy_on_log`, `proxy_on_done`, `proxy_on_delete`.
    fn upstream_reset(&mut self, key: (usize, u32)) {
        let (vm, ctx) = key;
        let headers = self
            .with_state(vm, |s| s.stream_by_id(ctx).map(|d| pairs_to_headers(&d.response_headers)))
            .flatten()
            .unwrap_or_default();
        let body = self.streams.get_mut(&key).map(|r| std::mem::take(&mut r.delivered)).unwrap_or_default();
        self.finish(key, move |cost| Outcome::UpstreamReset { response_headers: headers, response_body: body, cost });
    }

    /// The end of a response that went through: upstream or local reply.
    fn finish_continued(&mut self, key: (usize, u32)) {
        let (vm, ctx) = key;
        let (headers, mut body, trailers) = self
            .with_state(vm, |s| {
                s.stream_by_id(ctx).map(|d| {
                    let trailers = pairs_to_headers(&d.response_trailers);
                    (pairs_to_headers(&d.response_headers), d.response_body.clone(), trailers)
                })
            })
            .flatten()
            .unwrap_or_default();
        let Some(run) = self.streams.get_mut(&key) else { return };
        if run.response.is_some() && !run.in_local_reply {
            // A chunked answer: what went through before the end, then what the end call let through.
            let mut delivered = std::mem::take(&mut run.delivered);
            delivered.extend(body);
            body = delivered;
        }
        let request_headers = std::mem::take(&mut run.request_headers_after);
        let request_body = std::mem::take(&mut run.request_sent);
        match run.local_reply_done() {
            Some((status, details)) => {
                self.finish(key, move |cost| Outcome::LocalReply { status, headers, body, details, cost })
            }
            None => self.finish(key, move |cost| Outcome::Continued {
                request_headers,
                request_body,
                response_headers: headers,
                response_body: body,
                response_trailers: trailers,
                cost,
            }),
        }
    }

    /// Sends a local reply through the encoder path (the sending filter included); to a gRPC request, as
    /// Envoy does, a trailers-only gRPC response ([`grpc_local_reply`]).
    fn local_reply(&mut self, key: (usize, u32), mut reply: LocalReplySpec) {
        let (vm, ctx) = key;
        let grpc = self
            .with_state(vm, |s| s.stream_by_id(ctx).is_some_and(|d| is_grpc_request(&d.request_headers)))
            .unwrap_or(false);
        let mut headers: Pairs = if grpc {
            grpc_local_reply(&mut reply)
        } else {
            vec![(b":status".to_vec(), reply.status.to_string().into_bytes())]
        };
        let status = u16::try_from(reply.status).unwrap_or(500);
        headers.extend(reply.headers.iter().cloned());
        if !reply.body.is_empty() {
            headers.push((b"content-length".to_vec(), reply.body.len().to_string().into_bytes()));
            if !reply.headers.iter().any(|(k, _)| k == b"content-type") {
                headers.push((b"content-type".to_vec(), b"text/plain".to_vec()));
            }
        }
        if let Some(run) = self.streams.get_mut(&key) {
            run.in_local_reply = true;
            run.waiting = None;
            run.local_reply_status = Some((status, reply.details.clone()));
        }
        self.with_state(vm, |s| {
            if let Some(d) = s.stream_by_id(ctx) {
                d.response_headers = headers;
                d.response_body = reply.body.clone();
                d.info.response_code = Some(status);
            }
        });
        self.response_headers(key);
    }

    /// Ends a stream on a failed VM: 503 with no body and no more guest calls, or through if fail open.
    pub(crate) fn fail_stream(&mut self, key: (usize, u32)) {
        let message = self.vms.get(key.0).and_then(|v| v.failed.clone()).unwrap_or_default();
        let fail_open = self.setup.fail_open;
        let Some(run) = self.streams.get_mut(&key) else { return };
        run.cost.elapsed = run.started.elapsed();
        let cost = run.cost.clone();
        if fail_open {
            let upstream = self.setup.upstream.clone();
            let (status, given, body, response_trailers) = match &run.response {
                Some(r) => (r.status, r.headers.clone(), r.body_chunks.concat().into_bytes(), r.trailers.clone()),
                None => (upstream.status, upstream.headers, upstream.body, Vec::new()),
            };
            let mut response_headers: Headers = vec![(":status".into(), status.to_string())];
            response_headers.extend(given);
            run.outcome = Some(Outcome::Continued {
                request_headers: Vec::new(),
                request_body: Vec::new(),
                response_headers,
                response_body: body,
                response_trailers,
                cost,
            });
        } else {
            run.outcome = Some(Outcome::VmFailed { message, status: Some(503), cost });
        }
        let ctx = key.1;
        self.with_state(key.0, |s| s.remove_context(ctx));
    }

    /// A stream still paused at its deadline: the client gives up (`proxy_on_log`, `proxy_on_done`,
    /// `proxy_on_delete`, as observed when a client closes its connection in Envoy 1.40).
    pub(crate) fn expire(&mut self, key: (usize, u32)) {
        if let Some(run) = self.streams.get_mut(&key) {
            run.waiting = None;
        }
        let failure = self.vms.get(key.0).and_then(|v| v.failed.clone());
        match failure {
            Some(message) => self.finish(key, move |cost| Outcome::VmFailed { message, status: None, cost }),
            None => self.finish(key, |cost| Outcome::Paused { cost }),
        }
    }

    /// `proxy_on_log`, `proxy_on_done`, `proxy_on_delete`, then the outcome.
    fn finish(&mut self, key: (usize, u32), outcome: impl FnOnce(Cost) -> Outcome) {
        let (vm, ctx) = key;
        if let Some(run) = self.streams.get_mut(&key) {
            if run.outcome.is_some() {
                return;
            }
            run.waiting = None;
            // Mark the stream as ending so that callbacks below do not re-enter the lifecycle.
            run.outcome = Some(Outcome::Paused { cost: Cost::default() });
        }
        let exports = self
            .vms
            .get(vm)
            .map(|v| (v.exports.on_log.clone(), v.exports.on_done.clone(), v.exports.on_delete.clone()));
        if let Some((on_log, on_done, on_delete)) = exports {
            self.with_state(vm, |s| {
                if let Some(d) = s.stream_by_id(ctx) {
                    d.access_log_phase = true;
                    d.body_view = None;
                }
            });
            if let Some(f) = on_log {
                self.call(vm, "proxy_on_log", ctx, Some(ctx), |s| f.call(s, ctx));
            }
            self.with_state(vm, |s| {
                if let Some(d) = s.stream_by_id(ctx) {
                    d.access_log_phase = false;
                }
            });
            if let Some(f) = on_done {
                self.call(vm, "proxy_on_done", ctx, Some(ctx), |s| f.call(s, ctx));
            }
            if let Some(f) = on_delete {
                self.call(vm, "proxy_on_delete", ctx, Some(ctx), |s| f.call(s, ctx));
            }
            self.after_call(vm);
        }
        let counts = self.with_state(vm, |s| {
            let counts = s.stream_by_id(ctx).map(|d| (d.redis_calls, d.http_calls));
            s.remove_context(ctx);
            counts
        });
        if let Some(run) = self.streams.get_mut(&key) {
            if let Some(Some((redis, http))) = counts {
                run.cost.redis_calls = redis;
                run.cost.http_calls = http;
            }
            run.cost.elapsed = run.started.elapsed();
            run.outcome = Some(outcome(run.cost.clone()));
        }
    }
}

impl StreamRun {
    fn local_reply_done(&self) -> Option<(u16, String)> {
        if self.in_local_reply {
            self.local_reply_status.clone()
        } else {
            None
        }
    }
}

/// Whether request headers make a gRPC request as Envoy 1.40 decides it (`Grpc::Common::isGrpcRequestHeaders`):
/// `content-type` `application/grpc`, or followed by `+` (a subtype) or `;`.
fn is_grpc_request(headers: &Pairs) -> bool {
    headers.iter().any(|(name, value)| {
        name == b"content-type"
            && value
                .strip_prefix(b"application/grpc".as_slice())
                .is_some_and(|rest| matches!(rest.first(), None | Some(b'+' | b';')))
    })
}

/// Envoy's local reply to a gRPC request (`Http::Utility::sendLocalReply` with `is_grpc`): trailers-only,
/// HTTP 200, `content-type: application/grpc`, `grpc-status` (the status given, else mapped from the HTTP
/// status by `Grpc::Utility::httpToGrpcStatus`) and the body as `grpc-message`, percent-encoded (gRPC's
/// PROTOCOL-HTTP2.md: bytes outside 0x20-0x7E and `%`); no body. `reply` becomes that answer's status and
/// body; returns its first headers.
fn grpc_local_reply(reply: &mut LocalReplySpec) -> Pairs {
    let grpc_status = reply.grpc_status.unwrap_or(match reply.status {
        400 => 13,
        401 => 16,
        403 => 7,
        404 => 12,
        429 | 502 | 503 | 504 => 14,
        _ => 2,
    });
    let mut headers: Pairs = vec![
        (b":status".to_vec(), b"200".to_vec()),
        (b"content-type".to_vec(), b"application/grpc".to_vec()),
        (b"grpc-status".to_vec(), grpc_status.to_string().into_bytes()),
    ];
    if !reply.body.is_empty() {
        let mut message = Vec::with_capacity(reply.body.len());
        for &byte in &reply.body {
            if (0x20..=0x7e).contains(&byte) && byte != b'%' {
                message.push(byte);
            } else {
                message.extend_from_slice(format!("%{byte:02X}").as_bytes());
            }
        }
        headers.push((b"grpc-message".to_vec(), message));
    }
    reply.status = 200;
    reply.body.clear();
    headers
}

#[cfg(test)]
mod tests {
    //! Per-request upstream answers ([`ResponseSpec`]): which response callbacks a filter gets, with what,
    //! and what the client receives, for chunked bodies, buffering filters and upstream resets.

    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

    use crate::exchange::ResponseSpec;
    use crate::{HostBuilder, LogSource, Outcome, RequestSpec};

    /// A filter that logs every response callback as one line: `H<eos>` for the response headers,
    /// `B<len><eos>:<the body buffer's bytes>` for each body call (lengths below 10), `L`, `D`, `X` for
    /// `proxy_on_log`, `proxy_on_done`, `proxy_on_delete`. Its body calls answer `body_result` (a WAT i32
    /// expression of `$eos`).
    fn module(body_result: &str) -> Vec<u8> {
        wat::parse_str(format!(
            r#"(module
  (import "env" "proxy_log" (func $log (param i32 i32 i32) (result i32)))
  (import "env" "proxy_get_buffer_bytes" (func $bytes (param i32 i32 i32 i32 i32) (result i32)))
  (memory (export "memory") 4)
  (global $heap (mut i32) (i32.const 131072))
  (func (export "proxy_abi_version_0_2_1"))
  (func (export "_initialize"))
  (func (export "proxy_on_memory_allocate") (param $size i32) (result i32)
    (global.get $heap) (global.set $heap (i32.add (global.get $heap) (local.get $size))))
  (func (export "proxy_on_context_create") (param i32 i32))
  (func (export "proxy_on_vm_start") (param i32 i32) (result i32) (i32.const 1))
  (func (export "proxy_on_configure") (param i32 i32) (result i32) (i32.const 1))
  (func (export "proxy_on_request_headers") (param i32 i32 i32) (result i32) (i32.const 0))
  ;; Logs the tag, then `a` and `b` as digits (b < 0: not written), then `n` bytes at `from` after a colon.
  (func $note (param $tag i32) (param $a i32) (param $b i32) (param $from i32) (param $n i32)
    (local $at i32)
    (i32.store8 (i32.const 2000) (local.get $tag))
    (local.set $at (i32.const 2001))
    (if (i32.ge_s (local.get $a) (i32.const 0)) (then
      (i32.store8 (local.get $at) (i32.add (i32.const 48) (local.get $a)))
      (local.set $at (i32.add (local.get $at) (i32.const 1)))))
    (if (i32.ge_s (local.get $b) (i32.const 0)) (then
      (i32.store8 (local.get $at) (i32.add (i32.const 48) (local.get $b)))
      (local.set $at (i32.add (local.get $at) (i32.const 1)))
      (i32.store8 (local.get $at) (i32.const 58))
      (local.set $at (i32.add (local.get $at) (i32.const 1)))
      (memory.copy (local.get $at) (local.get $from) (local.get $n))
      (local.set $at (i32.add (local.get $at) (local.get $n)))))
    (drop (call $log (i32.const 2) (i32.const 2000) (i32.sub (local.get $at) (i32.const 2000)))))
  (func (export "proxy_on_response_headers") (param $ctx i32) (param $n i32) (param $eos i32) (result i32)
    (call $note (i32.const 72) (local.get $eos) (i32.const -1) (i32.const 0) (i32.const 0))
    (i32.const 0))
  (func (export "proxy_on_response_body") (param $ctx i32) (param $len i32) (param $eos i32) (result i32)
    (i32.store (i32.const 1000) (i32.const 0))
    (i32.store (i32.const 1004) (i32.const 0))
    (drop (call $bytes (i32.const 1) (i32.const 0) (i32.const 100) (i32.const 1000) (i32.const 1004)))
    (call $note (i32.const 66) (local.get $len) (local.get $eos) (i32.load (i32.const 1000))
      (i32.load (i32.const 1004)))
    {body_result})
  (func (export "proxy_on_log") (param i32)
    (call $note (i32.const 76) (i32.const -1) (i32.const -1) (i32.const 0) (i32.const 0)))
  (func (export "proxy_on_done") (param i32) (result i32)
    (call $note (i32.const 68) (i32.const -1) (i32.const -1) (i32.const 0) (i32.const 0))
    (i32.const 1))
  (func (export "proxy_on_delete") (param i32)
    (call $note (i32.const 88) (i32.const -1) (i32.const -1) (i32.const 0) (i32.const 0))))"#
        ))
        .unwrap()
    }

    /// Sends one request answered with `response` to a host running `module(body_result)`: the outcome and
    /// the filter's log lines for that stream.
    fn exchange(body_result: &str, response: ResponseSpec) -> (Outcome, Vec<String>) {
        let mut host = HostBuilder::from_bytes(module(body_result)).build().unwrap();
        assert!(host.refusal().is_none(), "{:?}", host.refusal());
        host.take_logs();
        let outcome = host.send_request(0, RequestSpec::default().answered_with(response)).unwrap();
        let lines = host
            .take_logs()
            .into_iter()
            .filter(|l| l.source == LogSource::ProxyLog && l.context_id != 0)
            .map(|l| l.message)
            .collect();
        (outcome, lines)
    }

    const CONTINUE: &str = "(i32.const 0)";
    /// StopIterationAndBuffer (1) until the end of stream, then Continue.
    const BUFFER: &str = "(select (i32.const 0) (i32.const 1) (local.get $eos))";
    const SSE: &[(&str, &str)] = &[("content-type", "text/event-stream")];

    #[test]
    fn each_chunk_is_one_body_call_then_the_end_of_stream() {
        let (outcome, lines) = exchange(CONTINUE, ResponseSpec::chunks(SSE, &["a", "bc", "def"]));
        assert_eq!(lines, ["H0", "B10:a", "B20:bc", "B30:def", "B01:", "L", "D", "X"]);
        assert_eq!(outcome.kind(), "continued");
        assert_eq!(outcome.status(), Some(200));
        assert_eq!(outcome.body(), b"abcdef");
        assert_eq!(outcome.header("content-type").as_deref(), Some("text/event-stream"));
        assert_eq!(outcome.header("content-length").as_deref(), Some("6"));
    }

    #[test]
    fn a_buffering_filter_sees_the_buffered_data_followed_by_each_new_chunk() {
        let (outcome, lines) = exchange(BUFFER, ResponseSpec::chunks(SSE, &["a", "bc", "def"]));
        assert_eq!(lines, ["H0", "B10:a", "B30:abc", "B60:abcdef", "B61:abcdef", "L", "D", "X"]);
        assert_eq!(outcome.body(), b"abcdef");
    }

    #[test]
    fn a_response_without_chunks_ends_with_its_headers() {
        let response = ResponseSpec { status: 204, ..ResponseSpec::default() };
        let (outcome, lines) = exchange(CONTINUE, response);
        assert_eq!(lines, ["H1", "L", "D", "X"]);
        assert_eq!((outcome.kind(), outcome.status()), ("continued", Some(204)));
        assert_eq!(outcome.header("content-length").as_deref(), Some("0"));
    }

    #[test]
    fn an_upstream_reset_ends_the_stream_without_an_end_of_stream() {
        let (outcome, lines) = exchange(CONTINUE, ResponseSpec::chunks(SSE, &["a", "bc", "def"]).reset_after(2));
        assert_eq!(lines, ["H0", "B10:a", "B20:bc", "L", "D", "X"]);
        assert_eq!((outcome.kind(), outcome.status()), ("upstream_reset", Some(200)));
        assert_eq!(outcome.body(), b"abc");

        // Reset right after the headers: they do not end the stream, and no body call comes.
        let (outcome, lines) = exchange(CONTINUE, ResponseSpec::chunks(SSE, &["a"]).reset_after(0));
        assert_eq!(lines, ["H0", "L", "D", "X"]);
        assert_eq!((outcome.kind(), outcome.body()), ("upstream_reset", &b""[..]));

        // After its last chunk: still no end of stream; what the filter held never reaches the client.
        let (outcome, lines) = exchange(BUFFER, ResponseSpec::chunks(SSE, &["a", "bc"]).reset_after(5));
        assert_eq!(lines, ["H0", "B10:a", "B30:abc", "L", "D", "X"]);
        assert_eq!((outcome.kind(), outcome.body()), ("upstream_reset", &b""[..]));
    }

    #[test]
    fn a_response_line_of_serve_parses_into_the_spec() {
        let line = r#"{"headers": [["x-user-id", "alice"]], "response": {"status": 201,
            "headers": [["X-Cost", "7"]], "body_chunks": ["x", "y"], "reset_after": 1}}"#;
        let spec: RequestSpec = serde_json::from_str(line).unwrap();
        let response = spec.response.unwrap();
        assert_eq!((response.status, response.reset_after), (201, Some(1)));
        assert_eq!(response.body_chunks, ["x", "y"]);
        let (outcome, lines) = exchange(CONTINUE, response);
        assert_eq!(lines, ["H0", "B10:x", "L", "D", "X"]);
        assert_eq!(outcome.header("x-cost").as_deref(), Some("7"));
        assert!(serde_json::from_str::<RequestSpec>(r#"{"response": {"bogus": 1}}"#).is_err());
    }
}
