//! The proxy-wasm ABI 0.2.1 (as Envoy, istio-proxy and Higress implement it with proxy-wasm-cpp-host):
//! the hostcalls the filter uses, declared as imports and wrapped as [`AbiHost`], the one real [`Host`];
//! and the exports the host calls, each routed to the [`Filter`] of its root context.
//!
//! This replaces the `proxy-wasm` crate's dispatcher and hostcall wrappers, which panic (and so kill the
//! VM: `panic = "abort"`) on a status they do not expect: an unknown callout token, a refused
//! `proxy_set_effective_context`, request headers read after the request went on. Here every status is
//! a [`HostError`] at this boundary and nothing panics. Signatures and numbering follow proxy-wasm-cpp-host
//! (`include/proxy-wasm/exports.h`, `wasm_api_impl.h`) and the proxy-wasm Rust SDK 0.2.5 that the
//! previous glue used; the Higress Redis calls are declared only in the `host-redis` build (stock Envoy
//! refuses a module that imports them).
//!
//! Contexts: `proxy_on_context_create(id, 0)` creates a root context (one [`Filter`] once configured),
//! `proxy_on_context_create(id, root)` an HTTP context of that root. Callbacks a host delivers to the
//! root context (`proxy_on_tick`, call responses) are routed by the id they carry, which may also be an
//! HTTP context's (then its root's filter takes it).

use crate::prelude::*;

use core::ptr::{null, null_mut};

use crate::host::{HeaderMap, Host, HostError, LogLevel};

/// Buffer types of `proxy_get_buffer_bytes` (ABI 0.2.1; 9 is Higress's Redis call response).
const HTTP_CALL_RESPONSE_BODY: u32 = 4;
/// proxy-wasm buffer type of the request body (ABI 0.2.1 `BufferType::HttpRequestBody`).
const REQUEST_BODY: u32 = 0;
/// proxy-wasm buffer type of the response body (ABI 0.2.1 `BufferType::HttpResponseBody`).
const RESPONSE_BODY: u32 = 1;
const PLUGIN_CONFIGURATION: u32 = 7;
#[cfg(feature = "host-redis")]
const REDIS_CALL_RESPONSE: u32 = 9;
/// Header map types of `proxy_get_header_map_value` / `proxy_add_header_map_value`.
const REQUEST_HEADERS: u32 = 0;
const RESPONSE_HEADERS: u32 = 2;
const HTTP_CALL_RESPONSE_HEADERS: u32 = 6;
/// `proxy_continue_stream` stream type of the HTTP request.
const STREAM_REQUEST: u32 = 0;
/// `proxy_define_metric` type of a counter.
const METRIC_COUNTER: u32 = 0;
/// `proxy_define_metric` type of a histogram.
const METRIC_HISTOGRAM: u32 = 2;

#[link(wasm_import_module = "env")]
extern "C" {
    fn proxy_log(level: u32, message: *const u8, size: usize) -> u32;
    fn proxy_get_current_time_nanoseconds(time: *mut u64) -> u32;
    fn proxy_set_tick_period_milliseconds(period: u32) -> u32;
    fn proxy_get_buffer_bytes(kind: u32, start: usize, max: usize, data: *mut *mut u8, size: *mut usize) -> u32;
    fn proxy_get_header_map_value(
        map: u32,
        key: *const u8,
        key_size: usize,
        value: *mut *mut u8,
        value_size: *mut usize,
    ) -> u32;
    fn proxy_add_header_map_value(
        map: u32,
        key: *const u8,
        key_size: usize,
        value: *const u8,
        value_size: usize,
    ) -> u32;
    fn proxy_get_header_map_pairs(map: u32, data: *mut *mut u8, size: *mut usize) -> u32;
    fn proxy_replace_header_map_value(
        map: u32,
        key: *const u8,
        key_size: usize,
        value: *const u8,
        value_size: usize,
    ) -> u32;
    fn proxy_remove_header_map_value(map: u32, key: *const u8, key_size: usize) -> u32;
    fn proxy_set_buffer_bytes(kind: u32, start: usize, length: usize, data: *const u8, size: usize) -> u32;
    fn proxy_get_property(path: *const u8, path_size: usize, value: *mut *mut u8, value_size: *mut usize) -> u32;
    fn proxy_set_property(path: *const u8, path_size: usize, value: *const u8, value_size: usize) -> u32;
    fn proxy_get_shared_data(
        key: *const u8,
        key_size: usize,
        value: *mut *mut u8,
        value_size: *mut usize,
        cas: *mut u32,
    ) -> u32;
    fn proxy_set_shared_data(key: *const u8, key_size: usize, value: *const u8, value_size: usize, cas: u32) -> u32;
    fn proxy_continue_stream(stream: u32) -> u32;
    fn proxy_send_local_response(
        status: u32,
        details: *const u8,
        details_size: usize,
        body: *const u8,
        body_size: usize,
        headers: *const u8,
        headers_size: usize,
        grpc_status: i32,
    ) -> u32;
    fn proxy_http_call(
        upstream: *const u8,
        upstream_size: usize,
        headers: *const u8,
        headers_size: usize,
        body: *const u8,
        body_size: usize,
        trailers: *const u8,
        trailers_size: usize,
        timeout_ms: u32,
        token: *mut u32,
    ) -> u32;
    fn proxy_set_effective_context(context_id: u32) -> u32;
    fn proxy_define_metric(kind: u32, name: *const u8, name_size: usize, id: *mut u32) -> u32;
    fn proxy_increment_metric(id: u32, offset: i64) -> u32;
    fn proxy_record_metric(id: u32, value: u64) -> u32;
}

#[cfg(feature = "host-redis")]
#[link(wasm_import_module = "env")]
extern "C" {
    fn proxy_redis_init(
        service: *const u8,
        service_size: usize,
        username: *const u8,
        username_size: usize,
        password: *const u8,
        password_size: usize,
        timeout_ms: u32,
    ) -> u32;
    fn proxy_redis_call(
        service: *const u8,
        service_size: usize,
        query: *const u8,
        query_size: usize,
        token: *mut u32,
    ) -> u32;
}

#[link(wasm_import_module = "wasi_snapshot_preview1")]
extern "C" {
    fn random_get(buf: *mut u8, buf_len: usize) -> u16;
}

/// Takes ownership of bytes the host wrote into memory it allocated with [`proxy_on_memory_allocate`].
///
/// # Safety
/// `data` must be null or a `size`-byte allocation made by `proxy_on_memory_allocate` and not yet owned.
unsafe fn owned(data: *mut u8, size: usize) -> Vec<u8> {
    if data.is_null() {
        Vec::new()
    } else {
        // SAFETY: per the contract above, an allocation of exactly `size` bytes (Vec::with_capacity(size)).
        unsafe { Vec::from_raw_parts(data, size, size) }
    }
}

/// A hostcall that returns bytes: `Ok(None)` for NotFound.
fn bytes_of(call: impl FnOnce(*mut *mut u8, *mut usize) -> u32) -> Result<Option<Vec<u8>>, HostError> {
    let mut data = null_mut();
    let mut size = 0usize;
    let status = call(&mut data, &mut size);
    // SAFETY: on status 0 the host allocated `size` bytes with proxy_on_memory_allocate (or left null).
    let bytes = unsafe { owned(data, size) };
    match HostError::check(status) {
        Ok(()) => Ok(Some(bytes)),
        Err(HostError::NotFound) => Ok(None),
        Err(error) => Err(error),
    }
}

/// The host, through the proxy-wasm ABI.
#[derive(Debug, Default)]
pub(crate) struct AbiHost;

/// The host's wall clock, ns since the Unix epoch (0 if the host refuses).
fn now_ns() -> u64 {
    let mut nanos = 0u64;
    // SAFETY: the host writes one u64.
    let _ = unsafe { proxy_get_current_time_nanoseconds(&mut nanos) };
    nanos
}

impl Host for AbiHost {
    fn now_ms(&self) -> u64 {
        now_ns() / 1_000_000
    }

    fn now_us(&self) -> u64 {
        now_ns() / 1_000
    }

    fn random_seed(&self) -> u64 {
        let mut seed = [0u8; 8];
        // SAFETY: the host fills the 8-byte buffer.
        match unsafe { random_get(seed.as_mut_ptr(), seed.len()) } {
            0 => u64::from_le_bytes(seed),
            _ => self.now_ms() ^ 0x9e37_79b9_7f4a_7c15,
        }
    }

    fn log(&self, level: LogLevel, message: &str) {
        // SAFETY: the message slice lives for the call.
        let _ = unsafe { proxy_log(level as u32, message.as_ptr(), message.len()) };
    }

    fn plugin_configuration(&self) -> Result<Option<Vec<u8>>, HostError> {
        // SAFETY: the host writes a pointer it allocated and its size.
        let bytes =
            bytes_of(|data, size| unsafe { proxy_get_buffer_bytes(PLUGIN_CONFIGURATION, 0, usize::MAX, data, size) })?;
        Ok(bytes.filter(|b| !b.is_empty()))
    }

    fn define_counter(&self, name: &str) -> Result<u32, HostError> {
        let mut id = 0u32;
        // SAFETY: the name lives for the call; the host writes one u32.
        HostError::check(unsafe { proxy_define_metric(METRIC_COUNTER, name.as_ptr(), name.len(), &mut id) })?;
        Ok(id)
    }

    fn increment_counter(&self, id: u32, delta: u64) -> Result<(), HostError> {
        let delta = i64::try_from(delta).map_err(|_| HostError::BadArgument)?;
        // SAFETY: plain values.
        HostError::check(unsafe { proxy_increment_metric(id, delta) })
    }

    fn define_histogram(&self, name: &str) -> Result<u32, HostError> {
        let mut id = 0u32;
        // SAFETY: the name lives for the call; the host writes one u32.
        HostError::check(unsafe { proxy_define_metric(METRIC_HISTOGRAM, name.as_ptr(), name.len(), &mut id) })?;
        Ok(id)
    }

    fn record_histogram(&self, id: u32, value: u64) -> Result<(), HostError> {
        // SAFETY: plain values.
        HostError::check(unsafe { proxy_record_metric(id, value) })
    }

    fn set_effective_context(&self, context_id: u32) -> Result<(), HostError> {
        // SAFETY: a plain value.
        HostError::check(unsafe { proxy_set_effective_context(context_id) })
    }

    fn request_header(&self, name: &str) -> Result<Option<Vec<u8>>, HostError> {
        // SAFETY: the key lives for the call; the host writes a pointer it allocated and its size.
        bytes_of(|data, size| unsafe {
            proxy_get_header_map_value(REQUEST_HEADERS, name.as_ptr(), name.len(), data, size)
        })
    }

    fn response_header(&self, name: &str) -> Result<Option<Vec<u8>>, HostError> {
        // SAFETY: as request_header.
        bytes_of(|data, size| unsafe {
            proxy_get_header_map_value(RESPONSE_HEADERS, name.as_ptr(), name.len(), data, size)
        })
    }

    fn response_body(&self, size: usize) -> Result<Vec<u8>, HostError> {
        // SAFETY: the host writes a pointer it allocated and its size.
        let bytes = bytes_of(|data, written| unsafe { proxy_get_buffer_bytes(RESPONSE_BODY, 0, size, data, written) })?;
        Ok(bytes.unwrap_or_default())
    }

    fn request_headers(&self) -> Result<Vec<(String, Vec<u8>)>, HostError> {
        // SAFETY: the host writes a pointer it allocated and its size.
        let bytes = bytes_of(|data, size| unsafe { proxy_get_header_map_pairs(REQUEST_HEADERS, data, size) })?;
        Ok(crate::host::decode_pairs(&bytes.unwrap_or_default()))
    }

    fn set_request_header(&self, name: &str, value: Option<&str>) -> Result<(), HostError> {
        // SAFETY: the slices live for the call.
        HostError::check(unsafe {
            match value {
                Some(value) => proxy_replace_header_map_value(
                    REQUEST_HEADERS,
                    name.as_ptr(),
                    name.len(),
                    value.as_ptr(),
                    value.len(),
                ),
                None => proxy_remove_header_map_value(REQUEST_HEADERS, name.as_ptr(), name.len()),
            }
        })
    }

    fn request_body(&self, size: usize) -> Result<Vec<u8>, HostError> {
        // SAFETY: the host writes a pointer it allocated and its size.
        let bytes = bytes_of(|data, written| unsafe { proxy_get_buffer_bytes(REQUEST_BODY, 0, size, data, written) })?;
        Ok(bytes.unwrap_or_default())
    }

    fn set_request_body(&self, size: usize, body: &[u8]) -> Result<(), HostError> {
        // SAFETY: the slice lives for the call.
        HostError::check(unsafe { proxy_set_buffer_bytes(REQUEST_BODY, 0, size, body.as_ptr(), body.len()) })
    }

    fn property(&self, path: &[&str]) -> Result<Option<Vec<u8>>, HostError> {
        // Segments joined by NUL (proxy-wasm's property path encoding).
        let path = path.join("\0");
        // SAFETY: as above.
        bytes_of(|data, size| unsafe { proxy_get_property(path.as_ptr(), path.len(), data, size) })
    }

    fn set_property(&self, path: &str, value: &[u8]) -> Result<(), HostError> {
        // SAFETY: both slices live for the call.
        HostError::check(unsafe { proxy_set_property(path.as_ptr(), path.len(), value.as_ptr(), value.len()) })
    }

    fn resume_request(&self) -> Result<(), HostError> {
        // SAFETY: a plain value.
        HostError::check(unsafe { proxy_continue_stream(STREAM_REQUEST) })
    }

    fn send_local_reply(
        &self,
        status: u16,
        headers: &HeaderMap,
        body: &[u8],
        grpc_status: Option<u8>,
    ) -> Result<(), HostError> {
        let headers = headers.as_bytes();
        // -1 (as u32: 0xFFFFFFFF): no gRPC status, Envoy maps the HTTP one (ABI 0.2.1).
        let grpc_status = grpc_status.map_or(-1, i32::from);
        // SAFETY: every slice lives for the call.
        HostError::check(unsafe {
            proxy_send_local_response(
                u32::from(status),
                null(),
                0,
                body.as_ptr(),
                body.len(),
                headers.as_ptr(),
                headers.len(),
                grpc_status,
            )
        })
    }

    fn add_response_header(&self, name: &str, value: &str) -> Result<(), HostError> {
        // SAFETY: the slices live for the call.
        HostError::check(unsafe {
            proxy_add_header_map_value(RESPONSE_HEADERS, name.as_ptr(), name.len(), value.as_ptr(), value.len())
        })
    }

    fn set_tick_period_ms(&self, period_ms: u32) -> Result<(), HostError> {
        // SAFETY: a plain value.
        HostError::check(unsafe { proxy_set_tick_period_milliseconds(period_ms) })
    }

    fn get_shared_data(&self, key: &str) -> Result<(Option<Vec<u8>>, u32), HostError> {
        let mut cas = 0u32;
        // SAFETY: the key lives for the call; the host writes a pointer it allocated, its size and a u32.
        let value =
            bytes_of(|data, size| unsafe { proxy_get_shared_data(key.as_ptr(), key.len(), data, size, &mut cas) })?;
        Ok((value, cas))
    }

    fn set_shared_data(&self, key: &str, value: &[u8], cas: u32) -> Result<(), HostError> {
        // SAFETY: the slices live for the call.
        HostError::check(unsafe { proxy_set_shared_data(key.as_ptr(), key.len(), value.as_ptr(), value.len(), cas) })
    }

    fn http_call(&self, cluster: &str, headers: &HeaderMap, body: &[u8], timeout_ms: u32) -> Result<u32, HostError> {
        // An empty map: a zero count.
        const NO_TRAILERS: [u8; 4] = [0; 4];
        let headers = headers.as_bytes();
        let mut token = 0u32;
        // SAFETY: every slice lives for the call; the host writes one u32.
        HostError::check(unsafe {
            proxy_http_call(
                cluster.as_ptr(),
                cluster.len(),
                headers.as_ptr(),
                headers.len(),
                body.as_ptr(),
                body.len(),
                NO_TRAILERS.as_ptr(),
                NO_TRAILERS.len(),
                timeout_ms,
                &mut token,
            )
        })?;
        Ok(token)
    }

    fn http_call_response_header(&self, name: &str) -> Result<Option<Vec<u8>>, HostError> {
        // SAFETY: as for request headers.
        bytes_of(|data, size| unsafe {
            proxy_get_header_map_value(HTTP_CALL_RESPONSE_HEADERS, name.as_ptr(), name.len(), data, size)
        })
    }

    fn http_call_response_body(&self, size: usize) -> Result<Vec<u8>, HostError> {
        // SAFETY: the host writes a pointer it allocated and its size.
        let bytes = bytes_of(|data, written| unsafe {
            proxy_get_buffer_bytes(HTTP_CALL_RESPONSE_BODY, 0, size, data, written)
        })?;
        Ok(bytes.unwrap_or_default())
    }

    #[cfg(feature = "host-redis")]
    fn redis_init(&self, service: &str, username: &str, password: &str, timeout_ms: u32) -> Result<(), HostError> {
        // SAFETY: every slice lives for the call.
        HostError::check(unsafe {
            proxy_redis_init(
                service.as_ptr(),
                service.len(),
                username.as_ptr(),
                username.len(),
                password.as_ptr(),
                password.len(),
                timeout_ms,
            )
        })
    }

    #[cfg(not(feature = "host-redis"))]
    fn redis_init(&self, _service: &str, _username: &str, _password: &str, _timeout_ms: u32) -> Result<(), HostError> {
        Err(HostError::Unimplemented)
    }

    #[cfg(feature = "host-redis")]
    fn redis_call(&self, service: &str, query: &[u8]) -> Result<u32, HostError> {
        let mut token = 0u32;
        // SAFETY: the slices live for the call; the host writes one u32.
        HostError::check(unsafe {
            proxy_redis_call(service.as_ptr(), service.len(), query.as_ptr(), query.len(), &mut token)
        })?;
        Ok(token)
    }

    #[cfg(not(feature = "host-redis"))]
    fn redis_call(&self, _service: &str, _query: &[u8]) -> Result<u32, HostError> {
        Err(HostError::Unimplemented)
    }

    #[cfg(feature = "host-redis")]
    fn redis_call_response(&self, size: usize) -> Result<Vec<u8>, HostError> {
        // SAFETY: the host writes a pointer it allocated and its size (buffer type 9, Higress ABI).
        let bytes =
            bytes_of(|data, written| unsafe { proxy_get_buffer_bytes(REDIS_CALL_RESPONSE, 0, size, data, written) })?;
        Ok(bytes.unwrap_or_default())
    }

    #[cfg(not(feature = "host-redis"))]
    fn redis_call_response(&self, _size: usize) -> Result<Vec<u8>, HostError> {
        Err(HostError::Unimplemented)
    }
}

mod exports;
