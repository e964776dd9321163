//! The proxy-wasm ABI as numbers and bytes: status codes, buffer/map/stream types, log levels, the ABI
//! version a module declares, and the two wire formats the hostcalls use (header pairs, property paths).
//!
//! Values as in the proxy-wasm spec (ABI 0.2.1), the Rust SDK 0.2.5 (`src/types.rs`) and Envoy's
//! proxy-wasm-cpp-host (`include/proxy-wasm/wasm_api_impl.h`); buffer type 9 is Higress's Redis reply.

use std::fmt;

/// A hostcall's return value (`WasmResult` in proxy-wasm-cpp-host).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum Status {
    /// Success.
    Ok = 0,
    /// No such key, header, property, buffer, metric or queue.
    NotFound = 1,
    /// An argument is invalid, or the map/buffer is not available now.
    BadArgument = 2,
    /// The value could not be serialized.
    SerializationFailure = 3,
    /// The value could not be parsed.
    ParseFailure = 4,
    /// A pointer or size points outside the guest's memory, or the guest could not allocate.
    InvalidMemoryAccess = 6,
    /// The queue is empty.
    Empty = 7,
    /// Shared data was changed since the caller read it.
    CasMismatch = 8,
    /// The host failed (Higress: no Redis host available).
    InternalFailure = 10,
    /// Envoy: the stream type is not supported for this operation.
    Unimplemented = 12,
}

impl Status {
    /// The number the guest sees.
    pub fn code(self) -> u32 {
        self as u32
    }
}

/// The result of a hostcall that writes its answers into guest memory: an error is the status to return.
pub type HostcallResult = Result<(), Status>;

/// Why a hostcall body ended before its end: a status for the guest (not Ok), or a trap (e.g. inside the
/// guest's allocator) that fails the VM. `?` turns a [`Status`] or a wasmtime error into one.
#[derive(Debug)]
pub enum Stop {
    /// Answer this status.
    Status(Status),
    /// Trap: the hostcall returns the error to wasmtime, which fails the guest call.
    Trap(crate::engine::Error),
}

impl From<Status> for Stop {
    fn from(status: Status) -> Self {
        Stop::Status(status)
    }
}

impl From<crate::engine::Error> for Stop {
    fn from(error: crate::engine::Error) -> Self {
        Stop::Trap(error)
    }
}

/// Collapses a hostcall result into the status the guest sees.
pub fn status_of(result: HostcallResult) -> u32 {
    match result {
        Ok(()) => Status::Ok.code(),
        Err(status) => status.code(),
    }
}

/// `proxy_get_buffer_bytes` / `proxy_set_buffer_bytes` buffer types.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BufferType {
    /// 0: the request body seen in `proxy_on_request_body`.
    HttpRequestBody,
    /// 1: the response body seen in `proxy_on_response_body`.
    HttpResponseBody,
    /// 2: network filters only.
    DownstreamData,
    /// 3: network filters only.
    UpstreamData,
    /// 4: the body of an HTTP call's response, during `proxy_on_http_call_response` only.
    HttpCallResponseBody,
    /// 5: gRPC only.
    GrpcReceiveBuffer,
    /// 6: the VM configuration (`vm_config.configuration`), always.
    VmConfiguration,
    /// 7: the plugin configuration, during `proxy_on_configure` only (Envoy: NotFound elsewhere).
    PluginConfiguration,
    /// 8: foreign function arguments.
    CallData,
    /// 9: Higress: the raw RESP reply, during `proxy_on_redis_call_response` only.
    RedisCallResponse,
}

impl BufferType {
    /// The buffer type for a number, `None` above 9 (the host answers BadArgument).
    pub fn from_u32(value: u32) -> Option<Self> {
        Some(match value {
            0 => Self::HttpRequestBody,
            1 => Self::HttpResponseBody,
            2 => Self::DownstreamData,
            3 => Self::UpstreamData,
            4 => Self::HttpCallResponseBody,
            5 => Self::GrpcReceiveBuffer,
            6 => Self::VmConfiguration,
            7 => Self::PluginConfiguration,
            8 => Self::CallData,
            9 => Self::RedisCallResponse,
            _ => return None,
        })
    }
}

/// Header map types of `proxy_*_header_map_*`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MapType {
    /// 0
    RequestHeaders,
    /// 1
    RequestTrailers,
    /// 2
    ResponseHeaders,
    /// 3
    ResponseTrailers,
    /// 4
    GrpcReceiveInitialMetadata,
    /// 5
    GrpcReceiveTrailingMetadata,
    /// 6: during `proxy_on_http_call_response` only.
    HttpCallResponseHeaders,
    /// 7: during `proxy_on_http_call_response` only.
    HttpCallResponseTrailers,
}

impl MapType {
    /// The map type for a number, `None` above 7 (the host answers BadArgument).
    pub fn from_u32(value: u32) -> Option<Self> {
        Some(match value {
            0 => Self::RequestHeaders,
            1 => Self::RequestTrailers,
            2 => Self::ResponseHeaders,
            3 => Self::ResponseTrailers,
            4 => Self::GrpcReceiveInitialMetadata,
            5 => Self::GrpcReceiveTrailingMetadata,
            6 => Self::HttpCallResponseHeaders,
            7 => Self::HttpCallResponseTrailers,
            _ => return None,
        })
    }
}

/// `proxy_continue_stream` / `proxy_close_stream` stream types.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StreamType {
    /// 0: the HTTP request (decoding).
    Request,
    /// 1: the HTTP response (encoding).
    Response,
    /// 2: network filters only.
    Downstream,
    /// 3: network filters only.
    Upstream,
}

impl StreamType {
    /// The stream type for a number, `None` above 3 (the host answers BadArgument).
    pub fn from_u32(value: u32) -> Option<Self> {
        Some(match value {
            0 => Self::Request,
            1 => Self::Response,
            2 => Self::Downstream,
            3 => Self::Upstream,
            _ => return None,
        })
    }
}

/// Log levels of `proxy_log` (Envoy maps them onto spdlog's levels, same numbers).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogLevel {
    /// 0
    Trace,
    /// 1
    Debug,
    /// 2 (Envoy's default: `proxy_get_log_level` answers 2)
    Info,
    /// 3
    Warn,
    /// 4 (also: `fd_write` to stderr)
    Error,
    /// 5
    Critical,
}

impl LogLevel {
    /// The level for a number, `None` above 5 (Envoy answers BadArgument).
    pub fn from_u32(value: u32) -> Option<Self> {
        Some(match value {
            0 => Self::Trace,
            1 => Self::Debug,
            2 => Self::Info,
            3 => Self::Warn,
            4 => Self::Error,
            5 => Self::Critical,
            _ => return None,
        })
    }

    /// The number the guest sees.
    pub fn code(self) -> u32 {
        self as u32
    }
}

impl fmt::Display for LogLevel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = match self {
            Self::Trace => "trace",
            Self::Debug => "debug",
            Self::Info => "info",
            Self::Warn => "warn",
            Self::Error => "error",
            Self::Critical => "critical",
        };
        f.write_str(name)
    }
}

/// The proxy-wasm ABI a module declares by exporting `proxy_abi_version_*`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AbiVersion {
    /// `proxy_abi_version_0_2_0`
    V0_2_0,
    /// `proxy_abi_version_0_2_1` (what the Rust SDK 0.2.5 exports)
    V0_2_1,
    /// `proxy_abi_version_0_2_100` (what Higress's own SDKs export; treated as 0.2.1 plus Higress's calls)
    V0_2_100,
}

impl AbiVersion {
    /// The ABI of a module from its export names; `None` if it declares none this host supports (Envoy
    /// refuses such a module: "Missing or unknown Proxy-Wasm ABI version"; 0.1.0 is not supported here).
    pub fn detect<'a>(exports: impl IntoIterator<Item = &'a str>) -> Option<Self> {
        let mut found = None;
        for name in exports {
            let version = match name {
                "proxy_abi_version_0_2_100" => Self::V0_2_100,
                "proxy_abi_version_0_2_1" => Self::V0_2_1,
                "proxy_abi_version_0_2_0" => Self::V0_2_0,
                _ => continue,
            };
            // Prefer the newest one a module declares.
            found = Some(match (found, version) {
                (Some(Self::V0_2_100), _) | (_, Self::V0_2_100) => Self::V0_2_100,
                (Some(Self::V0_2_1), _) | (_, Self::V0_2_1) => Self::V0_2_1,
                _ => Self::V0_2_0,
            });
        }
        found
    }
}

/// Header pairs as the hostcalls carry them: a little-endian u32 count, then a (key size, value size) u32
/// pair for each header, then each key and value followed by a NUL byte.
pub fn encode_pairs(pairs: &[(Vec<u8>, Vec<u8>)]) -> Vec<u8> {
    let mut size = 4;
    for (k, v) in pairs {
        size += 8 + k.len() + 1 + v.len() + 1;
    }
    let mut out = Vec::with_capacity(size);
    out.extend_from_slice(&u32_len(pairs.len()).to_le_bytes());
    for (k, v) in pairs {
        out.extend_from_slice(&u32_len(k.len()).to_le_bytes());
        out.extend_from_slice(&u32_len(v.len()).to_le_bytes());
    }
    for (k, v) in pairs {
        out.extend_from_slice(k);
        out.push(0);
        out.extend_from_slice(v);
        out.push(0);
    }
    out
}

fn u32_len(len: usize) -> u32 {
    u32::try_from(len).unwrap_or(u32::MAX)
}

/// Decodes header pairs (see [`encode_pairs`]). Like Envoy's `PairsUtil::toPairs`, malformed input yields
/// no pairs rather than an error.
pub fn decode_pairs(bytes: &[u8]) -> Vec<(Vec<u8>, Vec<u8>)> {
    decode_pairs_checked(bytes).unwrap_or_default()
}

fn decode_pairs_checked(bytes: &[u8]) -> Option<Vec<(Vec<u8>, Vec<u8>)>> {
    let read_u32 = |at: usize| -> Option<usize> {
        let raw: [u8; 4] = bytes.get(at..at.checked_add(4)?)?.try_into().ok()?;
        usize::try_from(u32::from_le_bytes(raw)).ok()
    };
    let count = read_u32(0)?;
    let mut sizes = Vec::with_capacity(count.min(1024));
    let mut at = 4usize;
    for _ in 0..count {
        let k = read_u32(at)?;
        let v = read_u32(at.checked_add(4)?)?;
        sizes.push((k, v));
        at = at.checked_add(8)?;
    }
    let mut pairs = Vec::with_capacity(sizes.len());
    for (k, v) in sizes {
        let key = bytes.get(at..at.checked_add(k)?)?.to_vec();
        at = at.checked_add(k)?.checked_add(1)?;
        let value = bytes.get(at..at.checked_add(v)?)?.to_vec();
        at = at.checked_add(v)?.checked_add(1)?;
        pairs.push((key, value));
    }
    Some(pairs)
}

/// Splits a property path as Envoy's `Context::getProperty` does: segments separated by NUL bytes (the
/// Rust SDK ends every segment with one, so a trailing NUL adds no empty segment).
pub fn split_property_path(path: &[u8]) -> Vec<&[u8]> {
    let mut parts: Vec<&[u8]> = path.split(|&b| b == 0).collect();
    if parts.last().is_some_and(|p| p.is_empty()) {
        parts.pop();
    }
    parts
}

/// WASI errno values used by the WASI functions Envoy implements.
pub mod errno {
    /// Success.
    pub const SUCCESS: u32 = 0;
    /// Bad file descriptor.
    pub const BADF: u32 = 8;
    /// Bad address (a pointer outside the guest's memory).
    pub const FAULT: u32 = 21;
    /// Invalid argument.
    pub const INVAL: u32 = 28;
    /// No such file or directory.
    pub const NOENT: u32 = 44;
    /// Function not implemented.
    pub const NOSYS: u32 = 52;
    /// Not supported.
    pub const NOTSUP: u32 = 58;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pairs_round_trip_and_match_the_sdk_layout() {
        let pairs = vec![(b":status".to_vec(), b"200".to_vec()), (b"a".to_vec(), Vec::new())];
        let bytes = encode_pairs(&pairs);
        assert_eq!(&bytes[..4], &2u32.to_le_bytes());
        assert_eq!(&bytes[4..8], &7u32.to_le_bytes());
        assert_eq!(&bytes[20..28], b":status\0");
        assert_eq!(decode_pairs(&bytes), pairs);
        assert!(decode_pairs(&bytes[..10]).is_empty());
        assert!(decode_pairs(&[]).is_empty());
    }

    #[test]
    fn property_paths_split_on_nul() {
        assert_eq!(split_property_path(b"source\0address\0"), vec![&b"source"[..], b"address"]);
        assert_eq!(split_property_path(b"plugin_name"), vec![&b"plugin_name"[..]]);
        assert!(split_property_path(b"").is_empty());
    }

    #[test]
    fn abi_detection_prefers_the_newest() {
        assert_eq!(AbiVersion::detect(["x", "proxy_abi_version_0_2_1"]), Some(AbiVersion::V0_2_1));
        assert_eq!(
            AbiVersion::detect(["proxy_abi_version_0_2_100", "proxy_abi_version_0_2_1"]),
            Some(AbiVersion::V0_2_100)
        );
        assert_eq!(AbiVersion::detect(["proxy_abi_version_0_1_0"]), None);
    }
}
