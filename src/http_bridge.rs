//! The HTTP-to-Redis bridge transport (webdis), for stock Envoy and Istio: `proxy_http_call` of
//! `POST /` with the command in webdis's path form as the body ([`crate::resp::Command::to_webdis_path`], `.raw`
//! suffix), answered by the raw RESP reply with HTTP 200 (DESIGN.md, "Facts: webdis").

use crate::prelude::*;

use crate::config::RedisConfig;
use crate::host::{HeaderMap, Host};
use crate::transport::{refused, CallId, CallKind, Failure};

/// Requests to webdis on one Envoy cluster: its authority, optional Basic credentials and timeout.
#[derive(Debug)]
pub struct HttpBridge {
    cluster: String,
    /// `POST /` to the bridge's authority, `text/plain`, with Basic credentials when configured: the same
    /// for every call, serialized once.
    headers: HeaderMap,
    timeout_ms: u32,
}

impl HttpBridge {
    /// A bridge on the Envoy cluster of `redis`, with its authority, credentials and timeout.
    pub fn new(redis: &RedisConfig) -> Self {
        let mut headers = vec![
            (":method", "POST"),
            (":path", "/"),
            (":authority", redis.authority.as_str()),
            ("content-type", "text/plain"),
        ];
        if let Some(authorization) = &redis.basic_auth {
            headers.push(("authorization", authorization.expose()));
        }
        HttpBridge {
            cluster: redis.cluster.clone(),
            headers: HeaderMap::new(&headers),
            timeout_ms: u32::try_from(redis.timeout_ms).unwrap_or(u32::MAX),
        }
    }

    /// Sends a command in webdis's path form ([`crate::script::Encoding::WebdisPath`]) as the body of
    /// `POST /` to the bridge; returns the call (an HTTP call and the host's token).
    ///
    /// # Errors
    /// [`Failure::SendRefused`] when the host refuses the call (unknown cluster).
    pub fn send(&self, host: &impl Host, body: &[u8]) -> Result<CallId, Failure> {
        host.http_call(&self.cluster, &self.headers, body, self.timeout_ms)
            .map(|token| CallId { kind: CallKind::Http, token })
            .map_err(|error| refused("proxy_http_call", error, &self.cluster))
    }
}

/// Reads the reply of the HTTP call whose `proxy_on_http_call_response` is running: the raw RESP bytes.
///
/// # Errors
/// [`Failure::NoReply`] for a failed call (no headers), [`Failure::BridgeStatus`] for an HTTP status other
/// than 200 (Envoy 1.40 synthesizes 503 on a failed connection and 504 on timeout; webdis answers 503
/// without Redis), [`Failure::BadReply`] for an empty or unreadable body.
pub fn read_reply(host: &impl Host, num_headers: usize, body_size: usize) -> Result<Vec<u8>, Failure> {
    // A response without headers is what a host without Envoy's synthesized 503/504 delivers on failure.
    if num_headers == 0 {
        return Err(Failure::NoReply);
    }
    let status = host
        .http_call_response_header(":status")
        .ok()
        .flatten()
        .and_then(|s| core::str::from_utf8(&s).ok().and_then(|s| s.parse::<u16>().ok()))
        .ok_or(Failure::NoReply)?;
    if status != 200 {
        return Err(Failure::BridgeStatus(status));
    }
    match host.http_call_response_body(body_size) {
        Ok(body) if !body.is_empty() => Ok(body),
        Ok(_) => Err(Failure::BadReply("the bridge answered 200 with an empty body".into())),
        Err(error) => Err(Failure::BadReply(format!("cannot read the bridge's answer: {error}"))),
    }
}
