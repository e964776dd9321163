//! What a test sends ([`RequestSpec`]) and what comes back ([`Outcome`] with its [`Cost`]).

use std::time::Duration;

use serde::Deserialize;
use serde_json::{json, Value};

/// Headers as `(name, value)` pairs in order; names lowercase (Envoy's codec lowercases them).
pub type Headers = Vec<(String, String)>;

/// One downstream request.
///
/// Missing pseudo-headers get defaults (`:authority` `localhost`, `:path` `/`, `:method` `GET`, or `POST`
/// with a body, `:scheme` `http`), and the host adds what Envoy's connection manager adds before the
/// filters run: `content-length` for a body (its whole length, unless `content-length` or
/// `transfer-encoding` is given), `x-forwarded-proto: http` and a random `x-request-id`
/// (observed in Envoy 1.40, `probe/envoy-1.40-observed.txt`). Order as Envoy shows them: `:authority`,
/// `:path`, `:method`, `:scheme`, the given headers, `x-forwarded-proto`, `x-request-id`.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RequestSpec {
    /// Request headers, pseudo-headers included.
    #[serde(default)]
    pub headers: Headers,
    /// The `source.address` property, `ip:port` (default `127.0.0.1:40000`).
    #[serde(default)]
    pub source_address: Option<String>,
    /// The route name (`xds.route_name`, and Higress's `route_name`); default `route`.
    #[serde(default)]
    pub route_name: Option<String>,
    /// A request body (then `proxy_on_request_body` runs), in one piece: `proxy_on_request_body(ctx, len,
    /// false)`, then the end of stream.
    #[serde(default)]
    pub body: Option<String>,
    /// A request body in pieces, as Envoy's codec hands a large body to the filters as it reads it: one
    /// `proxy_on_request_body(ctx, len, false)` per chunk, then `proxy_on_request_body(ctx, buffered, true)`
    /// (see `stream.rs` for buffering and pauses). Empty: none; not together with `body` (a bad request).
    #[serde(default)]
    pub body_chunks: Vec<String>,
    /// The upstream's answer to this request; `None`: the host's (`HostBuilder::upstream`, by default 200
    /// `upstream ok\n`).
    #[serde(default)]
    pub response: Option<ResponseSpec>,
}

/// The upstream's answer to one request, body chunk by body chunk, as Envoy's HTTP/1 codec hands a
/// response to the filters (`stream.rs`): `proxy_on_response_headers(ctx, n, end_of_stream)` (end of stream
/// when there is no chunk and no reset), one `proxy_on_response_body(ctx, len, false)` per chunk, then the end
/// `proxy_on_response_body(ctx, buffered, true)`.
///
/// With `reset_after: N` the upstream resets the stream after its first N chunks (a connection closed
/// mid-body; N = 0: right after the headers): no more body callbacks and no end of stream; the stream ends
/// as Envoy ends a reset stream (`proxy_on_log`, `proxy_on_done`, `proxy_on_delete`) and the request's
/// outcome is [`Outcome::UpstreamReset`]. A client that goes away mid-body looks the same to the filter.
///
/// With `trailers` (HTTP/2, gRPC, HTTP/1.1 chunked trailers) the trailers end the stream, as in Envoy: the
/// headers and every chunk come with `end_of_stream = false`, there is no end-of-stream body call, and
/// `proxy_on_response_trailers(ctx, number of trailers)` comes last (only if the module exports it).
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ResponseSpec {
    /// The status (default 200).
    #[serde(default = "ResponseSpec::ok")]
    pub status: u16,
    /// Headers after `:status`, in order. The host adds `content-length` (the chunks' total) unless
    /// `content-length` or `transfer-encoding` is given, then Envoy's `x-envoy-upstream-service-time`.
    #[serde(default)]
    pub headers: Headers,
    /// The body, as the chunks the filter sees one by one (none: an empty body).
    #[serde(default)]
    pub body_chunks: Vec<String>,
    /// Reset the upstream stream after this many chunks instead of ending it (the trailers never come).
    #[serde(default)]
    pub reset_after: Option<usize>,
    /// Response trailers, in order (names lowercased): they end the stream (none: the last body call does).
    #[serde(default)]
    pub trailers: Headers,
}

impl ResponseSpec {
    fn ok() -> u16 {
        200
    }

    /// A 200 with these headers and body chunks, ending normally.
    pub fn chunks(headers: &[(&str, &str)], chunks: &[&str]) -> Self {
        ResponseSpec {
            status: 200,
            headers: headers.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
            body_chunks: chunks.iter().map(|c| c.to_string()).collect(),
            reset_after: None,
            trailers: Vec::new(),
        }
    }

    /// The same response, reset by the upstream after `n` chunks.
    pub fn reset_after(mut self, n: usize) -> Self {
        self.reset_after = Some(n);
        self
    }

    /// The same response, ended by these trailers (`proxy_on_response_trailers`) instead of its last body
    /// call.
    pub fn with_trailers(mut self, trailers: &[(&str, &str)]) -> Self {
        self.trailers = trailers.iter().map(|(k, v)| (k.to_ascii_lowercase(), v.to_string())).collect();
        self
    }
}

impl Default for ResponseSpec {
    fn default() -> Self {
        ResponseSpec {
            status: 200,
            headers: Vec::new(),
            body_chunks: Vec::new(),
            reset_after: None,
            trailers: Vec::new(),
        }
    }
}

impl RequestSpec {
    /// A GET of `/` with these headers.
    pub fn with_headers(headers: &[(&str, &str)]) -> Self {
        RequestSpec {
            headers: headers.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
            ..Default::default()
        }
    }

    /// The same request from this `ip:port`.
    pub fn from_address(mut self, address: &str) -> Self {
        self.source_address = Some(address.to_string());
        self
    }

    /// The same request, answered by the upstream with `response`.
    pub fn answered_with(mut self, response: ResponseSpec) -> Self {
        self.response = Some(response);
        self
    }

    /// The same request with a body sent in these chunks ([`RequestSpec::body_chunks`]; a POST unless
    /// `:method` is given).
    pub fn with_body_chunks(mut self, chunks: &[&str]) -> Self {
        self.body = None;
        self.body_chunks = chunks.iter().map(|c| c.to_string()).collect();
        self
    }

    /// Whether the request has a body (`body` or `body_chunks`).
    pub fn has_body(&self) -> bool {
        self.body.is_some() || !self.body_chunks.is_empty()
    }
}

/// What one request cost the guest.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Cost {
    /// wasmtime fuel consumed by every guest call made for this stream (its callbacks included: HTTP call
    /// and Redis replies delivered to the root context on its behalf, `proxy_on_log`, `proxy_on_done`...).
    pub fuel: u64,
    /// `proxy_redis_call`s made for this stream.
    pub redis_calls: u32,
    /// `proxy_http_call`s made for this stream.
    pub http_calls: u32,
    /// Guest calls made for this stream.
    pub guest_calls: u32,
    /// Wall time from the request's arrival to its end.
    pub elapsed: Duration,
}

/// How a request ended.
#[derive(Clone, Debug, PartialEq)]
pub enum Outcome {
    /// The filter let the request through; the emulated upstream answered.
    Continued {
        /// The request headers as the filter left them (what the router would forward, before the
        /// router's own additions such as `x-envoy-expected-rq-timeout-ms`). Envoy does not make their
        /// `content-length` agree with a body the filter changed (see `request_body`).
        request_headers: Headers,
        /// The request body as it went upstream: every chunk the filter let through, as the filter left it
        /// (`proxy_set_buffer_bytes`); empty for a request without a body, and when failing open.
        request_body: Vec<u8>,
        /// The response headers after the filter's `proxy_on_response_headers`.
        response_headers: Headers,
        /// The response body after the filter.
        response_body: Vec<u8>,
        /// The response trailers after the filter's `proxy_on_response_trailers` (none: the response had
        /// none, see [`ResponseSpec::trailers`]).
        response_trailers: Headers,
        /// What it cost.
        cost: Cost,
    },
    /// The upstream reset the stream after the response headers ([`ResponseSpec::reset_after`]): the client
    /// got the headers and part of the body, then its connection closed.
    UpstreamReset {
        /// The response headers after the filter's `proxy_on_response_headers`.
        response_headers: Headers,
        /// The part of the body that went through the filter before the reset.
        response_body: Vec<u8>,
        /// What it cost.
        cost: Cost,
    },
    /// The filter answered with `proxy_send_local_response`.
    LocalReply {
        /// The status.
        status: u16,
        /// The headers after the filter's own `proxy_on_response_headers` (Envoy runs the encoder path,
        /// the sending filter included, for a local reply).
        headers: Headers,
        /// The body.
        body: Vec<u8>,
        /// The `details` argument (Envoy's response code details).
        details: String,
        /// What it cost.
        cost: Cost,
    },
    /// The filter paused the request and nothing resumed or answered it before the deadline: a bug. The
    /// host then ends the stream as a client that gives up does (`proxy_on_log`, `proxy_on_done`,
    /// `proxy_on_delete`; observed in Envoy 1.40).
    Paused {
        /// What it cost.
        cost: Cost,
    },
    /// The filter reset the stream (`proxy_close_stream`).
    Reset {
        /// What it cost.
        cost: Cost,
    },
    /// The VM trapped (now or earlier). Envoy marks the VM failed; with `fail_open: false` (the default)
    /// every request of that VM gets a 503 with an empty body (details `wasm_fail_stream`), with
    /// `fail_open: true` requests pass without the filter.
    VmFailed {
        /// The trap, as Envoy logs it: `Function: proxy_on_request_headers failed: ...`.
        message: String,
        /// 503 when failing closed, `None` when the request went through (fail open).
        status: Option<u16>,
        /// What it cost.
        cost: Cost,
    },
    /// The plugin did not load: `proxy_on_configure` (or `proxy_on_vm_start`) returned false, or the VM
    /// failed while starting. Envoy refuses the configuration (exits at startup).
    Refused {
        /// Why, with the module's log lines.
        reason: String,
    },
}

impl Outcome {
    /// `continued`, `upstream_reset`, `local_reply`, `paused`, `reset`, `vm_failed` or `refused`.
    pub fn kind(&self) -> &'static str {
        match self {
            Outcome::Continued { .. } => "continued",
            Outcome::UpstreamReset { .. } => "upstream_reset",
            Outcome::LocalReply { .. } => "local_reply",
            Outcome::Paused { .. } => "paused",
            Outcome::Reset { .. } => "reset",
            Outcome::VmFailed { .. } => "vm_failed",
            Outcome::Refused { .. } => "refused",
        }
    }

    /// The HTTP status the client sees, if any.
    pub fn status(&self) -> Option<u16> {
        match self {
            Outcome::Continued { response_headers, .. } | Outcome::UpstreamReset { response_headers, .. } => {
                header(response_headers, ":status")?.parse().ok()
            }
            Outcome::LocalReply { status, .. } => Some(*status),
            Outcome::VmFailed { status, .. } => *status,
            Outcome::Paused { .. } | Outcome::Reset { .. } | Outcome::Refused { .. } => None,
        }
    }

    /// The response headers the client sees (none for paused, reset, refused).
    pub fn response_headers(&self) -> Headers {
        match self {
            Outcome::Continued { response_headers, .. } | Outcome::UpstreamReset { response_headers, .. } => {
                response_headers.clone()
            }
            Outcome::LocalReply { headers, .. } => headers.clone(),
            Outcome::VmFailed { status: Some(status), .. } => {
                vec![(":status".into(), status.to_string()), ("content-length".into(), "0".into())]
            }
            _ => Vec::new(),
        }
    }

    /// The response body the client sees.
    pub fn body(&self) -> &[u8] {
        match self {
            Outcome::Continued { response_body, .. } | Outcome::UpstreamReset { response_body, .. } => response_body,
            Outcome::LocalReply { body, .. } => body,
            _ => &[],
        }
    }

    /// The first value of a response header.
    pub fn header(&self, name: &str) -> Option<String> {
        header(&self.response_headers(), name).map(str::to_string)
    }

    /// What the request cost (`None` for a refused plugin).
    pub fn cost(&self) -> Option<&Cost> {
        match self {
            Outcome::Continued { cost, .. }
            | Outcome::UpstreamReset { cost, .. }
            | Outcome::LocalReply { cost, .. }
            | Outcome::Paused { cost }
            | Outcome::Reset { cost }
            | Outcome::VmFailed { cost, .. } => Some(cost),
            Outcome::Refused { .. } => None,
        }
    }

    /// One JSON object: `kind`, `status`, `headers`, `body`, `fuel`, `redis_calls`, `http_calls`,
    /// `guest_calls`, `elapsed_ms`, plus `request_headers` (continued; with `request_body` when the request
    /// had a body and `trailers` when the response had trailers), `details` (local reply), `message` (VM
    /// failed) or `reason` (refused).
    pub fn to_json(&self) -> Value {
        let headers: Vec<[String; 2]> = self.response_headers().into_iter().map(|(k, v)| [k, v]).collect();
        let mut out = json!({
            "kind": self.kind(),
            "status": self.status(),
            "headers": headers,
            "body": String::from_utf8_lossy(self.body()),
        });
        if let (Some(cost), Some(map)) = (self.cost(), out.as_object_mut()) {
            map.insert("fuel".into(), json!(cost.fuel));
            map.insert("redis_calls".into(), json!(cost.redis_calls));
            map.insert("http_calls".into(), json!(cost.http_calls));
            map.insert("guest_calls".into(), json!(cost.guest_calls));
            map.insert("elapsed_ms".into(), json!(cost.elapsed.as_secs_f64() * 1000.0));
        }
        if let Some(map) = out.as_object_mut() {
            match self {
                Outcome::Continued { request_headers, request_body, response_trailers, .. } => {
                    let pairs: Vec<[String; 2]> = request_headers.iter().map(|(k, v)| [k.clone(), v.clone()]).collect();
                    map.insert("request_headers".into(), json!(pairs));
                    if !request_body.is_empty() {
                        map.insert("request_body".into(), json!(String::from_utf8_lossy(request_body)));
                    }
                    if !response_trailers.is_empty() {
                        let pairs: Vec<[String; 2]> =
                            response_trailers.iter().map(|(k, v)| [k.clone(), v.clone()]).collect();
                        map.insert("trailers".into(), json!(pairs));
                    }
                }
                Outcome::LocalReply { details, .. } => {
                    map.insert("details".into(), json!(details));
                }
                Outcome::VmFailed { message, .. } => {
                    map.insert("message".into(), json!(message));
                }
                Outcome::Refused { reason } => {
                    map.insert("reason".into(), json!(reason));
                }
                Outcome::Paused { .. } | Outcome::Reset { .. } | Outcome::UpstreamReset { .. } => {}
            }
        }
        out
    }
}

/// The first value of a header (names compared case-insensitively).
pub fn header<'a>(headers: &'a [(String, String)], name: &str) -> Option<&'a str> {
    headers.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
}
