//! Transports: what carries one RESP command to Redis and its reply back. The filter sees only
//! [`RedisTransport`]; host status codes and bridge HTTP statuses become [`Failure`]s here.

use std::time::Duration;

use proxy_wasm::hostcalls;
use proxy_wasm::types::{BufferType, MapType};

use crate::config::RedisConfig;
use crate::limiter::Failure;
use crate::resp::Command;

/// Sends commands; the reply of each arrives later, with the returned token, to the flow of the HTTP
/// context that sent it.
pub trait RedisTransport {
    /// Sends `command` for the HTTP context `context_id`, returning the host's token for the call.
    ///
    /// # Errors
    /// [`Failure::SendRefused`] when the host refuses the call (unknown cluster, no healthy host).
    fn send(&self, context_id: u32, command: &Command) -> Result<u32, Failure>;

    /// Drops the connection state so the next call sets it up again (after Redis answered `NOAUTH`).
    fn reconnect(&self) {}
}

/// The HTTP-to-Redis bridge (webdis): `POST /` with the command in webdis's path form (see
/// [`Command::to_webdis_path`]) as the body; webdis answers the raw RESP reply (`.raw` suffix) with
/// HTTP 200, or 503 when it cannot reach Redis.
pub struct HttpBridge {
    cluster: String,
    headers: Vec<(String, String)>,
    timeout: Duration,
}

impl HttpBridge {
    /// A bridge on the Envoy cluster of `redis`, with its authority, credentials and timeout.
    pub fn new(redis: &RedisConfig) -> Self {
        let mut headers = vec![
            (":method".to_string(), "POST".to_string()),
            (":path".to_string(), "/".to_string()),
            (":authority".to_string(), redis.authority.clone()),
            ("content-type".to_string(), "text/plain".to_string()),
        ];
        if let Some(auth) = &redis.basic_auth {
            headers.push(("authorization".to_string(), auth.clone()));
        }
        HttpBridge { cluster: redis.cluster.clone(), headers, timeout: Duration::from_millis(redis.timeout_ms) }
    }
}

impl RedisTransport for HttpBridge {
    /// `dispatch_http_call`; the SDK routes the response to the HTTP context that is active now.
    fn send(&self, _context_id: u32, command: &Command) -> Result<u32, Failure> {
        let headers: Vec<(&str, &str)> = self.headers.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        let body = command.to_webdis_path();
        hostcalls::dispatch_http_call(&self.cluster, headers, Some(&body), vec![], self.timeout)
            .map_err(|status| Failure::SendRefused(format!("{status:?} for cluster {:?}", self.cluster)))
    }
}

impl HttpBridge {
    /// Reads the reply of the call whose callback is running: the raw RESP bytes.
    ///
    /// # Errors
    /// [`Failure::NoReply`] for a failed call, [`Failure::BridgeStatus`] for an HTTP answer other than
    /// 200 (Envoy synthesizes 504 on timeout; webdis answers 503 without Redis), [`Failure::BadReply`]
    /// for an empty body.
    pub fn reply(num_headers: usize, body_size: usize) -> Result<Vec<u8>, Failure> {
        // Envoy 1.40 answers a failed connection with a synthesized 503 and a timeout with a 504 (observed with
        // the emulator's probe, tests/host); a response without headers is still possible from other hosts.
        if num_headers == 0 {
            return Err(Failure::NoReply);
        }
        let status = hostcalls::get_map_value(MapType::HttpCallResponseHeaders, ":status")
            .ok()
            .flatten()
            .and_then(|s| s.parse::<u16>().ok())
            .ok_or(Failure::NoReply)?;
        if status != 200 {
            return Err(Failure::BridgeStatus(status));
        }
        match hostcalls::get_buffer(BufferType::HttpCallResponseBody, 0, body_size) {
            Ok(Some(body)) if !body.is_empty() => Ok(body),
            _ => Err(Failure::BadReply("the bridge answered 200 with an empty body".into())),
        }
    }
}
