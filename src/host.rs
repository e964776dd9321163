//! The host seam: everything the filter needs from a proxy-wasm host, as one trait.
//!
//! [`crate::filter`] (configuration, the per-request flows, metrics, failure logs, the deadline guard)
//! and the transports ([`crate::http_bridge`], [`crate::host_redis`]) talk to the host only through
//! [`Host`]. The module `abi` (feature `filter`) implements it with the proxy-wasm ABI 0.2.1 hostcalls
//! (plus Higress's Redis calls in the `host-redis` build); the unit tests implement it with a fake host
//! (`crate::testing::FakeHost`), so every path of the filter, failure paths included, runs natively.
//!
//! Request-scoped calls (headers, properties, resume, local reply, response headers) act on the host's
//! *effective context*: the HTTP context whose callback is running, or the one named by
//! [`Host::set_effective_context`] from a callback delivered to the root context.

use crate::prelude::*;

use core::fmt;

/// A proxy-wasm status other than `Ok`, as a hostcall returned it (proxy-wasm ABI 0.2.1 `WasmResult`
/// numbering, as in proxy-wasm-cpp-host `include/proxy-wasm/wasm_api_impl.h`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HostError {
    /// 1: no such key, header, property or context.
    NotFound,
    /// 2: an argument the host refused (unknown cluster, unknown context, a call out of place).
    BadArgument,
    /// 3: the host could not serialize the value.
    SerializationFailure,
    /// 4: the host could not parse what it was given.
    ParseFailure,
    /// 6: a pointer or length outside the module's memory.
    InvalidMemoryAccess,
    /// 7: nothing there (an empty buffer).
    Empty,
    /// 8: shared data changed since it was read (compare-and-swap lost).
    CasMismatch,
    /// 10: the host failed (no healthy upstream host, ...).
    InternalFailure,
    /// 12: the host does not implement the call (e.g. the Higress Redis calls in the stock build).
    Unimplemented,
    /// Any other status code.
    Other(u32),
}

impl HostError {
    /// The error for a non-zero proxy-wasm status code.
    pub fn from_status(status: u32) -> Self {
        match status {
            1 => HostError::NotFound,
            2 => HostError::BadArgument,
            3 => HostError::SerializationFailure,
            4 => HostError::ParseFailure,
            6 => HostError::InvalidMemoryAccess,
            7 => HostError::Empty,
            8 => HostError::CasMismatch,
            10 => HostError::InternalFailure,
            12 => HostError::Unimplemented,
            other => HostError::Other(other),
        }
    }

    /// `Ok(())` for status 0, else the error.
    ///
    /// # Errors
    /// The [`HostError`] of a non-zero status.
    pub fn check(status: u32) -> Result<(), HostError> {
        if status == 0 {
            Ok(())
        } else {
            Err(HostError::from_status(status))
        }
    }
}

impl fmt::Display for HostError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HostError::Other(code) => write!(f, "status {code}"),
            HostError::NotFound => f.write_str("NotFound"),
            HostError::BadArgument => f.write_str("BadArgument"),
            HostError::SerializationFailure => f.write_str("SerializationFailure"),
            HostError::ParseFailure => f.write_str("ParseFailure"),
            HostError::InvalidMemoryAccess => f.write_str("InvalidMemoryAccess"),
            HostError::Empty => f.write_str("Empty"),
            HostError::CasMismatch => f.write_str("CasMismatch"),
            HostError::InternalFailure => f.write_str("InternalFailure"),
            HostError::Unimplemented => f.write_str("Unimplemented"),
        }
    }
}

/// Log levels, numbered as proxy-wasm numbers them (0 trace ... 5 critical).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum LogLevel {
    /// 0.
    Trace = 0,
    /// 1.
    Debug = 1,
    /// 2: Envoy's default.
    Info = 2,
    /// 3.
    Warn = 3,
    /// 4.
    Error = 4,
    /// 5.
    Critical = 5,
}

/// What the filter needs from a proxy-wasm host. Every method maps the host's status to [`HostError`]
/// and never panics, whatever the host answers.
pub trait Host {
    /// Wall-clock time, ms since the Unix epoch (`proxy_get_current_time_nanoseconds`).
    fn now_ms(&self) -> u64;

    /// Wall-clock time, microseconds since the Unix epoch (`proxy_get_current_time_nanoseconds`): what the
    /// histograms of durations are measured with.
    fn now_us(&self) -> u64;

    /// 8 random bytes as a seed for the filter's own generator (WASI `random_get`); the host's clock
    /// when the host has no randomness.
    fn random_seed(&self) -> u64;

    /// Writes one log line (`proxy_log`); a refused line is dropped.
    fn log(&self, level: LogLevel, message: &str);

    /// The plugin configuration bytes (`proxy_get_buffer_bytes` of buffer type 7); `None` when empty.
    ///
    /// # Errors
    /// The host's status (Envoy answers NotFound outside `proxy_on_configure`).
    fn plugin_configuration(&self) -> Result<Option<Vec<u8>>, HostError>;

    /// Defines a counter by name (`proxy_define_metric`, type 0), returning its id.
    ///
    /// # Errors
    /// The host's status.
    fn define_counter(&self, name: &str) -> Result<u32, HostError>;

    /// Adds `delta` (> 0) to a counter (`proxy_increment_metric`).
    ///
    /// # Errors
    /// The host's status (BadArgument for an offset <= 0 or an unknown id).
    fn increment_counter(&self, id: u32, delta: u64) -> Result<(), HostError>;

    /// Defines a histogram by name (`proxy_define_metric`, type 2), returning its id. Envoy exposes it as a
    /// histogram stat `wasmcustom.<name>` whose buckets `stats_config.histogram_bucket_settings` sets.
    ///
    /// # Errors
    /// The host's status.
    fn define_histogram(&self, name: &str) -> Result<u32, HostError>;

    /// Records one value in a histogram (`proxy_record_metric`).
    ///
    /// # Errors
    /// The host's status (NotFound for an unknown id).
    fn record_histogram(&self, id: u32, value: u64) -> Result<(), HostError>;

    /// Makes `context_id` the effective context for the calls that follow (`proxy_set_effective_context`).
    ///
    /// # Errors
    /// The host's status (BadArgument: no such context, e.g. the stream is gone).
    fn set_effective_context(&self, context_id: u32) -> Result<(), HostError>;

    /// A request header of the effective context (lowercase name; `:path`, `:authority` included);
    /// `Ok(None)` when absent.
    ///
    /// # Errors
    /// The host's status (BadArgument once the request headers are no longer readable).
    fn request_header(&self, name: &str) -> Result<Option<Vec<u8>>, HostError>;

    /// Every request header of the effective context (`proxy_get_header_map_pairs` of the request headers):
    /// lowercase names and their values, in order. Envoy lets a filter read the request headers only until
    /// they go on, so a request decided later (from its body) keeps this copy.
    ///
    /// # Errors
    /// The host's status (BadArgument once the request headers are no longer readable).
    fn request_headers(&self) -> Result<Vec<(String, Vec<u8>)>, HostError>;

    /// Sets (replaces) a request header of the effective context (`proxy_replace_header_map_value` of the
    /// request headers; lowercase name), or removes it (`value: None`, `proxy_remove_header_map_value`).
    /// Changes what goes upstream while the request is paused, before it goes on.
    ///
    /// # Errors
    /// The host's status.
    fn set_request_header(&self, name: &str, value: Option<&str>) -> Result<(), HostError>;

    /// The request body buffered so far, its first `size` bytes (`proxy_get_buffer_bytes` of the request
    /// body, buffer type 0), from `proxy_on_request_body`: Envoy buffers the body while the filter answers
    /// `StopIterationAndBuffer`, so `size` is everything received so far.
    ///
    /// # Errors
    /// The host's status.
    fn request_body(&self, size: usize) -> Result<Vec<u8>, HostError>;

    /// Replaces the first `size` bytes of the buffered request body (all of it: what `proxy_on_request_body`
    /// reported) with `body` (`proxy_set_buffer_bytes(0, 0, size, ...)`, proxy-wasm-cpp-host's
    /// `copyFrom`: start 0 and a length of the whole buffer replaces it). The caller fixes `content-length`.
    ///
    /// # Errors
    /// The host's status.
    fn set_request_body(&self, size: usize, body: &[u8]) -> Result<(), HostError>;

    /// A property (`proxy_get_property`), by path segments such as `["source", "address"]`; `Ok(None)`
    /// when the host has no such property.
    ///
    /// # Errors
    /// The host's status.
    fn property(&self, path: &[&str]) -> Result<Option<Vec<u8>>, HostError>;

    /// Sets a property of the effective context's request (`proxy_set_property`) under `path`, one
    /// segment. Envoy keeps it in the request's filter state as `wasm.<path>` (a bytes value), which access
    /// logs read with `%FILTER_STATE(wasm.<path>:PLAIN)%`.
    ///
    /// # Errors
    /// The host's status.
    fn set_property(&self, path: &str, value: &[u8]) -> Result<(), HostError>;

    /// Resumes the effective context's paused request (`proxy_continue_stream(HttpRequest)`).
    ///
    /// # Errors
    /// The host's status.
    fn resume_request(&self) -> Result<(), HostError>;

    /// Answers the effective context's request locally (`proxy_send_local_response`): status, headers
    /// (names lowercase), body and, for a gRPC request, the gRPC status (1..=16; Envoy then answers
    /// trailers-only with HTTP 200, that `grpc-status` and the body as `grpc-message`; `None`: Envoy maps
    /// `status`).
    ///
    /// # Errors
    /// The host's status.
    fn send_local_reply(
        &self,
        status: u16,
        headers: &HeaderMap,
        body: &[u8],
        grpc_status: Option<u8>,
    ) -> Result<(), HostError>;

    /// A response header of the effective context (`proxy_get_header_map_value` of the response headers),
    /// lowercase name; `Ok(None)` when absent. Readable from `proxy_on_response_headers` on.
    ///
    /// # Errors
    /// The host's status.
    fn response_header(&self, name: &str) -> Result<Option<Vec<u8>>, HostError>;

    /// The response body chunk `proxy_on_response_body` was called with: its first `size` bytes
    /// (`proxy_get_buffer_bytes` of the response body). Envoy hands a filter that lets each chunk through
    /// that chunk alone.
    ///
    /// # Errors
    /// The host's status.
    fn response_body(&self, size: usize) -> Result<Vec<u8>, HostError>;

    /// Adds a header to the effective context's response headers (`proxy_add_header_map_value`).
    ///
    /// # Errors
    /// The host's status.
    fn add_response_header(&self, name: &str, value: &str) -> Result<(), HostError>;

    /// Calls the root context's `proxy_on_tick` every `period_ms` ms; 0 stops the ticks.
    ///
    /// # Errors
    /// The host's status.
    fn set_tick_period_ms(&self, period_ms: u32) -> Result<(), HostError>;

    /// Shared data of every VM of the gateway process (`proxy_get_shared_data`): the value and its CAS
    /// version; `Ok((None, 0))` for a key never set.
    ///
    /// # Errors
    /// The host's status other than NotFound.
    fn get_shared_data(&self, key: &str) -> Result<(Option<Vec<u8>>, u32), HostError>;

    /// Sets shared data (`proxy_set_shared_data`); with `cas` non-zero only if the value is still at that
    /// version.
    ///
    /// # Errors
    /// [`HostError::CasMismatch`] when another VM changed it since; other host statuses.
    fn set_shared_data(&self, key: &str, value: &[u8], cas: u32) -> Result<(), HostError>;

    /// Sends an HTTP request to an Envoy cluster (`proxy_http_call`), returning the call's token; the
    /// response reaches `proxy_on_http_call_response` of the root context with that token.
    ///
    /// # Errors
    /// The host's status (BadArgument: unknown cluster or missing pseudo-headers).
    fn http_call(&self, cluster: &str, headers: &HeaderMap, body: &[u8], timeout_ms: u32) -> Result<u32, HostError>;

    /// A header of the HTTP call response being delivered (only during `proxy_on_http_call_response`).
    ///
    /// # Errors
    /// The host's status.
    fn http_call_response_header(&self, name: &str) -> Result<Option<Vec<u8>>, HostError>;

    /// Up to `size` bytes of the HTTP call response body being delivered (buffer type 4).
    ///
    /// # Errors
    /// The host's status.
    fn http_call_response_body(&self, size: usize) -> Result<Vec<u8>, HostError>;

    /// Higress `proxy_redis_init`: creates the host's Redis client for `service` (a cluster name, with
    /// `?db=N`), with credentials and a per-operation timeout in ms.
    ///
    /// # Errors
    /// The host's status (BadArgument: no such cluster); [`HostError::Unimplemented`] in a build or on a
    /// host without the Higress Redis calls.
    fn redis_init(&self, service: &str, username: &str, password: &str, timeout_ms: u32) -> Result<(), HostError>;

    /// Higress `proxy_redis_call`: writes `query` (one RESP command) to the host's client for `service`,
    /// returning the call's token; the reply reaches `proxy_on_redis_call_response` with it.
    ///
    /// # Errors
    /// The host's status (BadArgument, InternalFailure: no host available); [`HostError::Unimplemented`]
    /// without the Higress Redis calls.
    fn redis_call(&self, service: &str, query: &[u8]) -> Result<u32, HostError>;

    /// The raw RESP reply being delivered to `proxy_on_redis_call_response`: up to `size` bytes of buffer
    /// type 9 (Higress ABI; readable only during that callback).
    ///
    /// # Errors
    /// The host's status.
    fn redis_call_response(&self, size: usize) -> Result<Vec<u8>, HostError>;
}

/// A header map in proxy-wasm's serialized form (ABI 0.2.1 `proxy_send_local_response`,
/// `proxy_http_call`): the pair count, then each pair's name and value sizes, then each name and value
/// NUL-terminated; counts and sizes little-endian u32. Built once (the bridge's request headers at
/// configure, a local reply's headers once per distinct reply) and handed to the host as is.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HeaderMap {
    bytes: Vec<u8>,
}

impl HeaderMap {
    /// The serialized form of `pairs` (names lowercase).
    pub fn new(pairs: &[(&str, &str)]) -> Self {
        let size = 4 + pairs.iter().map(|(name, value)| 10 + name.len() + value.len()).sum::<usize>();
        let mut bytes = Vec::with_capacity(size);
        let len = |n: usize| u32::try_from(n).unwrap_or(u32::MAX).to_le_bytes();
        bytes.extend_from_slice(&len(pairs.len()));
        for (name, value) in pairs {
            bytes.extend_from_slice(&len(name.len()));
            bytes.extend_from_slice(&len(value.len()));
        }
        for (name, value) in pairs {
            bytes.extend_from_slice(name.as_bytes());
            bytes.push(0);
            bytes.extend_from_slice(value.as_bytes());
            bytes.push(0);
        }
        HeaderMap { bytes }
    }

    /// The serialized bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// The pairs back (lossy UTF-8); empty if the bytes are not a well-formed map. For hosts that look
    /// inside (the fake host) and tests.
    pub fn pairs(&self) -> Vec<(String, String)> {
        decode_pairs(&self.bytes)
            .into_iter()
            .map(|(name, value)| (name, String::from_utf8_lossy(&value).into_owned()))
            .collect()
    }
}

/// The pairs of a header map in proxy-wasm's serialized form ([`HeaderMap`]; what
/// `proxy_get_header_map_pairs` returns): names (lossy UTF-8) and values as bytes; empty if the bytes are
/// not a well-formed map.
pub fn decode_pairs(bytes: &[u8]) -> Vec<(String, Vec<u8>)> {
    let u32_at =
        |at: usize| bytes.get(at..at + 4).and_then(|b| b.try_into().ok()).map(|b| u32::from_le_bytes(b) as usize);
    let Some(count) = u32_at(0) else { return Vec::new() };
    let mut pairs = Vec::with_capacity(count.min(256));
    let mut at = 4usize.saturating_add(count.saturating_mul(8));
    for index in 0..count {
        let (Some(name_len), Some(value_len)) = (u32_at(4 + 8 * index), u32_at(8 + 8 * index)) else {
            return Vec::new();
        };
        let name = bytes.get(at..at.saturating_add(name_len));
        at = at.saturating_add(name_len).saturating_add(1);
        let value = bytes.get(at..at.saturating_add(value_len));
        at = at.saturating_add(value_len).saturating_add(1);
        let (Some(name), Some(value)) = (name, value) else { return Vec::new() };
        pairs.push((String::from_utf8_lossy(name).into_owned(), value.to_vec()));
    }
    pairs
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn a_header_map_reads_back_its_pairs() {
        let pairs = [(":method", "POST"), ("retry-after", "60"), ("empty", "")];
        let map = HeaderMap::new(&pairs);
        let expected: Vec<(String, String)> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        assert_eq!(map.pairs(), expected);
        assert_eq!(map.as_bytes().get(..12), Some(&[3, 0, 0, 0, 7, 0, 0, 0, 4, 0, 0, 0][..]));
        assert_eq!(HeaderMap::new(&[]).as_bytes(), &[0, 0, 0, 0]);
    }
}
