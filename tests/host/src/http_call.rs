//! `proxy_http_call`: a real HTTP/1.1 request to the cluster's address on its own thread, delivered back
//! to the VM as the response Envoy would hand the guest.
//!
//! Envoy facts (Envoy `Context::httpCall`; observed with `probe/` in Envoy 1.40):
//! - BadArgument for an unknown cluster, a negative timeout, or headers without `:method`, `:path` and
//!   `:authority`; a body gets a `content-length`; timeout 0 means none;
//! - the upstream receives `host` (from `:authority`), the guest's headers, `x-envoy-internal: true` and
//!   `x-envoy-expected-rq-timeout-ms` (when there is a timeout);
//! - the guest sees `:status`, the upstream's headers and `x-envoy-upstream-service-time`;
//! - a refused connection is a synthesized 503 (`content-length: 98`, `content-type: text/plain`, body
//!   `upstream connect error or disconnect/reset before headers. reset reason: remote connection failure`);
//! - a timeout is a synthesized 504 (`content-length: 24`, `content-type: text/plain`, body
//!   `upstream request timeout`);
//! - the callback is `proxy_on_http_call_response(root_context_id, token, headers, body_size, trailers)`.
//!
//! Not emulated: connection reuse (each call opens a connection), a reset after the response started
//! (delivered here as a response with no headers, as Envoy's `onHttpCallFailure` does).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use crate::abi::Status;
use crate::faults::CallKind;
use crate::vm::{CallResponse, Event, Pairs, VmState};

const CONNECT_FAILURE: &str =
    "upstream connect error or disconnect/reset before headers. reset reason: remote connection failure";
const CONNECTION_TERMINATION: &str =
    "upstream connect error or disconnect/reset before headers. reset reason: connection termination";
const TIMEOUT: &str = "upstream request timeout";

/// Starts an HTTP call for the VM; answers its token.
pub fn start(
    state: &mut VmState,
    cluster: &[u8],
    headers: Pairs,
    body: Vec<u8>,
    timeout_ms: u32,
) -> Result<u32, Status> {
    // Envoy reads the timeout as a signed int: "negative" is BadArgument.
    if i32::try_from(timeout_ms).is_err() {
        return Err(Status::BadArgument);
    }
    let cluster = String::from_utf8_lossy(cluster).into_owned();
    let address = *state.setup.clusters.get(&cluster).ok_or(Status::BadArgument)?;
    let headers: Pairs = headers.into_iter().map(|(k, v)| (k.to_ascii_lowercase(), v)).collect();
    let has = |name: &[u8]| headers.iter().any(|(k, _)| k == name);
    if !has(b":path") || !has(b":method") || !has(b":authority") {
        return Err(Status::BadArgument);
    }
    let timeout = if timeout_ms > 0 { Some(Duration::from_millis(u64::from(timeout_ms))) } else { None };
    let limit = timeout.unwrap_or(state.setup.http_call_max);
    let owner = state.owner_stream();
    let token = state.allocate_token(owner, CallKind::Http);
    if let Some(stream) = owner.and_then(|id| state.stream_by_id(id)) {
        stream.http_calls += 1;
    }
    let events = state.events.clone();
    let vm = state.vm;
    let spawned = std::thread::Builder::new().name(format!("http-call-{vm}-{token}")).spawn(move || {
        let response = perform(address, &headers, &body, timeout, limit);
        let _ = events.send(Event::HttpCall { vm, token, response });
    });
    if spawned.is_err() {
        state.calls.remove(&(CallKind::Http, token));
        return Err(Status::InternalFailure);
    }
    Ok(token)
}

/// A response Envoy makes up itself.
fn synthesized(status: u16, body: &str) -> CallResponse {
    CallResponse {
        headers: vec![
            (b":status".to_vec(), status.to_string().into_bytes()),
            (b"content-length".to_vec(), body.len().to_string().into_bytes()),
            (b"content-type".to_vec(), b"text/plain".to_vec()),
        ],
        body: body.as_bytes().to_vec(),
        trailers: Vec::new(),
    }
}

enum Failure {
    Connect,
    Timeout,
    ClosedBeforeHeaders,
    ResetAfterHeaders,
}

fn perform(
    address: SocketAddr,
    headers: &Pairs,
    body: &[u8],
    timeout: Option<Duration>,
    limit: Duration,
) -> CallResponse {
    let started = Instant::now();
    let deadline = started + limit;
    match exchange(address, headers, body, timeout, deadline) {
        Ok((status, mut response_headers, response_body)) => {
            let mut all = vec![(b":status".to_vec(), status.to_string().into_bytes())];
            all.append(&mut response_headers);
            let took = started.elapsed().as_millis().to_string();
            all.push((b"x-envoy-upstream-service-time".to_vec(), took.into_bytes()));
            CallResponse { headers: all, body: response_body, trailers: Vec::new() }
        }
        Err(Failure::Connect) => synthesized(503, CONNECT_FAILURE),
        Err(Failure::ClosedBeforeHeaders) => synthesized(503, CONNECTION_TERMINATION),
        Err(Failure::Timeout) => synthesized(504, TIMEOUT),
        Err(Failure::ResetAfterHeaders) => CallResponse::default(),
    }
}

fn remaining(deadline: Instant) -> Result<Duration, Failure> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        Err(Failure::Timeout)
    } else {
        Ok(left)
    }
}

fn io_failure(error: &std::io::Error, before_headers: bool) -> Failure {
    match error.kind() {
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => Failure::Timeout,
        _ if before_headers => Failure::ClosedBeforeHeaders,
        _ => Failure::ResetAfterHeaders,
    }
}

type Response = (u16, Pairs, Vec<u8>);

fn exchange(
    address: SocketAddr,
    headers: &Pairs,
    body: &[u8],
    timeout: Option<Duration>,
    deadline: Instant,
) -> Result<Response, Failure> {
    let mut stream = TcpStream::connect_timeout(&address, remaining(deadline)?).map_err(|e| match e.kind() {
        std::io::ErrorKind::TimedOut => Failure::Timeout,
        _ => Failure::Connect,
    })?;
    let _ = stream.set_nodelay(true);
    let request = render_request(headers, body, timeout);
    stream.set_write_timeout(Some(remaining(deadline)?)).map_err(|_| Failure::Connect)?;
    stream.write_all(&request).map_err(|e| io_failure(&e, true))?;

    let mut buffer = Vec::new();
    let (status, response_headers, head_len) =
        read_until(&mut stream, &mut buffer, deadline, true, |b, _| parse_head(b))?;
    let mut rest = buffer.split_off(head_len);
    let find = |name: &[u8]| response_headers.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone());
    let no_body = status < 200 || status == 204 || status == 304;
    let body = if no_body {
        Vec::new()
    } else if find(b"transfer-encoding").is_some_and(|v| v.eq_ignore_ascii_case(b"chunked")) {
        read_until(&mut stream, &mut rest, deadline, false, |b, _| dechunk(b))?
    } else if let Some(length) = find(b"content-length") {
        let length: usize = String::from_utf8_lossy(&length).trim().parse().map_err(|_| Failure::ResetAfterHeaders)?;
        read_until(&mut stream, &mut rest, deadline, false, |b, _| Ok(b.get(..length).map(<[u8]>::to_vec)))?
    } else {
        read_until(&mut stream, &mut rest, deadline, false, |b, closed| Ok(closed.then(|| b.to_vec())))?
    };
    // Connection-specific headers are not forwarded by Envoy's codec.
    let response_headers = response_headers
        .into_iter()
        .filter(|(k, _)| !matches!(k.as_slice(), b"connection" | b"keep-alive" | b"transfer-encoding"))
        .collect();
    Ok((status, response_headers, body))
}

/// Reads into `buffer` until `ready` (shown the bytes so far and whether the peer closed) answers; a
/// close it does not accept fails before or after the headers.
fn read_until<T>(
    stream: &mut TcpStream,
    buffer: &mut Vec<u8>,
    deadline: Instant,
    before_headers: bool,
    mut ready: impl FnMut(&[u8], bool) -> Result<Option<T>, Failure>,
) -> Result<T, Failure> {
    let mut chunk = [0u8; 16 * 1024];
    let mut closed = false;
    loop {
        if let Some(done) = ready(buffer, closed)? {
            return Ok(done);
        }
        if closed {
            return Err(if before_headers { Failure::ClosedBeforeHeaders } else { Failure::ResetAfterHeaders });
        }
        let n = read_some(stream, &mut chunk, deadline, before_headers)?;
        closed = n == 0;
        buffer.extend_from_slice(chunk.get(..n).unwrap_or_default());
    }
}

fn read_some(
    stream: &mut TcpStream,
    chunk: &mut [u8],
    deadline: Instant,
    before_headers: bool,
) -> Result<usize, Failure> {
    stream.set_read_timeout(Some(remaining(deadline)?)).map_err(|_| Failure::Timeout)?;
    stream.read(chunk).map_err(|e| io_failure(&e, before_headers))
}

fn render_request(headers: &Pairs, body: &[u8], timeout: Option<Duration>) -> Vec<u8> {
    let get = |name: &[u8]| headers.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone()).unwrap_or_default();
    let mut out = Vec::new();
    out.extend_from_slice(&get(b":method"));
    out.push(b' ');
    out.extend_from_slice(&get(b":path"));
    out.extend_from_slice(b" HTTP/1.1\r\nhost: ");
    out.extend_from_slice(&get(b":authority"));
    out.extend_from_slice(b"\r\n");
    let mut has_length = false;
    for (k, v) in headers {
        if k.first() == Some(&b':') || k == b"host" {
            continue;
        }
        has_length |= k == b"content-length";
        out.extend_from_slice(k);
        out.extend_from_slice(b": ");
        out.extend_from_slice(v);
        out.extend_from_slice(b"\r\n");
    }
    if !body.is_empty() && !has_length {
        out.extend_from_slice(format!("content-length: {}\r\n", body.len()).as_bytes());
    }
    out.extend_from_slice(b"x-envoy-internal: true\r\n");
    if let Some(timeout) = timeout {
        out.extend_from_slice(format!("x-envoy-expected-rq-timeout-ms: {}\r\n", timeout.as_millis()).as_bytes());
    }
    out.extend_from_slice(b"\r\n");
    out.extend_from_slice(body);
    out
}

/// The status line and headers, once complete: (status, lowercase headers, length of the head).
fn parse_head(buffer: &[u8]) -> Result<Option<(u16, Pairs, usize)>, Failure> {
    let mut slots = [httparse::EMPTY_HEADER; 128];
    let mut response = httparse::Response::new(&mut slots);
    match response.parse(buffer) {
        Ok(httparse::Status::Complete(len)) => {
            let status = response.code.ok_or(Failure::ClosedBeforeHeaders)?;
            let headers =
                response.headers.iter().map(|h| (h.name.to_ascii_lowercase().into_bytes(), h.value.to_vec())).collect();
            Ok(Some((status, headers, len)))
        }
        Ok(httparse::Status::Partial) => Ok(None),
        Err(_) => Err(Failure::ClosedBeforeHeaders),
    }
}

/// A complete chunked body, decoded; `None` while incomplete.
fn dechunk(mut data: &[u8]) -> Result<Option<Vec<u8>>, Failure> {
    let mut out = Vec::new();
    loop {
        let Some(line_end) = data.windows(2).position(|w| w == b"\r\n") else { return Ok(None) };
        let line = String::from_utf8_lossy(data.get(..line_end).unwrap_or_default()).into_owned();
        let size_text = line.split(';').next().unwrap_or("").trim().to_string();
        let size = usize::from_str_radix(&size_text, 16).map_err(|_| Failure::ResetAfterHeaders)?;
        data = data.get(line_end + 2..).unwrap_or_default();
        if size == 0 {
            // Trailers (ignored) end with an empty line.
            return Ok(data.windows(2).any(|w| w == b"\r\n").then_some(out));
        }
        if data.len() < size + 2 {
            return Ok(None);
        }
        out.extend_from_slice(data.get(..size).unwrap_or_default());
        data = data.get(size + 2..).unwrap_or_default();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunked_bodies_decode() {
        assert_eq!(dechunk(b"3\r\nabc\r\n0\r\n\r\n").ok().flatten(), Some(b"abc".to_vec()));
        assert_eq!(dechunk(b"3\r\nab").ok().flatten(), None);
    }

    #[test]
    fn requests_render_like_envoy() {
        let headers = vec![
            (b":method".to_vec(), b"POST".to_vec()),
            (b":path".to_vec(), b"/".to_vec()),
            (b":authority".to_vec(), b"webdis".to_vec()),
            (b"x-a".to_vec(), b"1".to_vec()),
        ];
        let text = String::from_utf8(render_request(&headers, b"GET/k.raw", Some(Duration::from_millis(200)))).unwrap();
        assert_eq!(
            text,
            "POST / HTTP/1.1\r\nhost: webdis\r\nx-a: 1\r\ncontent-length: 9\r\nx-envoy-internal: true\r\n\
             x-envoy-expected-rq-timeout-ms: 200\r\n\r\nGET/k.raw"
        );
    }
}
