//! The Higress host Redis transport: commands go to the host's outbound Redis client for an Envoy
//! cluster with `proxy_redis_call`, replies come back in `proxy_on_redis_call_response` (ABI as
//! Higress's Envoy fork and SDKs define it: DESIGN.md, "Facts: the Higress host Redis interface"). The
//! hostcalls themselves are behind [`Host::redis_init`] / [`Host::redis_call`]; this module knows the
//! convention around them (service naming, init once and again after `NOAUTH`, status 1 = no reply).

use crate::prelude::*;

use core::cell::Cell;

use crate::config::RedisConfig;
use crate::host::Host;
use crate::transport::{refused, CallId, CallKind, Failure};

/// Reply status of `proxy_on_redis_call_response` for a reply (possibly a Redis error reply).
pub const STATUS_OK: u32 = 0;

/// Redis through the host: `proxy_redis_init` once per VM (retried on use while it fails, and again
/// after `NOAUTH`), then one `proxy_redis_call` per command.
pub struct HostRedis {
    /// Cluster name, plus `?db=N` when a database other than 0 is selected (Higress convention).
    service: String,
    username: String,
    password: String,
    timeout_ms: u32,
    initialized: Cell<bool>,
}

impl core::fmt::Debug for HostRedis {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("HostRedis")
            .field("service", &self.service)
            .field("username", &self.username)
            .field("password", &"<redacted>")
            .field("timeout_ms", &self.timeout_ms)
            .field("initialized", &self.initialized.get())
            .finish()
    }
}

impl HostRedis {
    /// The client for `redis.cluster` with its credentials, timeout and database; call [`HostRedis::init`].
    pub fn new(redis: &RedisConfig) -> Self {
        let service = if redis.database == 0 {
            redis.cluster.clone()
        } else {
            format!("{}?db={}", redis.cluster, redis.database)
        };
        HostRedis {
            service,
            username: redis.username.clone().unwrap_or_default(),
            password: redis.password.as_ref().map(|p| p.expose().to_string()).unwrap_or_default(),
            timeout_ms: u32::try_from(redis.timeout_ms).unwrap_or(u32::MAX),
            initialized: Cell::new(false),
        }
    }

    /// Asks the host to create its client for the cluster (`proxy_redis_init`).
    ///
    /// # Errors
    /// The host's refusal as a sentence (the cluster may not be known yet: it is retried on the next call).
    pub fn init(&self, host: &impl Host) -> Result<(), String> {
        let result = host.redis_init(&self.service, &self.username, &self.password, self.timeout_ms);
        self.initialized.set(result.is_ok());
        result.map_err(|error| refused("proxy_redis_init", error, &self.service).to_string())
    }

    /// Sends one command's RESP bytes ([`crate::script::Encoding::Resp`]); returns the call (a Redis call and
    /// the host's token).
    ///
    /// # Errors
    /// [`Failure::SendRefused`] when the client cannot be initialised or the host refuses the call.
    pub fn send(&self, host: &impl Host, query: &[u8]) -> Result<CallId, Failure> {
        if !self.initialized.get() {
            self.init(host).map_err(Failure::SendRefused)?;
        }
        host.redis_call(&self.service, query)
            .map(|token| CallId { kind: CallKind::Redis, token })
            .map_err(|error| refused("proxy_redis_call", error, &self.service))
    }

    /// Initialise the client again before the next call (Redis answered `NOAUTH`).
    pub fn reconnect(&self) {
        self.initialized.set(false);
    }
}

/// Reads the reply whose `proxy_on_redis_call_response` is running: `status` 0 = a reply of
/// `response_size` bytes (possibly a Redis error reply), anything else = a network error or timeout.
///
/// # Errors
/// [`Failure::NoReply`] for a non-zero status, [`Failure::BadReply`] when the bytes cannot be read.
pub fn read_reply(host: &impl Host, status: u32, response_size: usize) -> Result<Vec<u8>, Failure> {
    if status != STATUS_OK {
        return Err(Failure::NoReply);
    }
    match host.redis_call_response(response_size) {
        Ok(bytes) if !bytes.is_empty() => Ok(bytes),
        Ok(_) => Err(Failure::BadReply("the host delivered an empty Redis reply".into())),
        Err(error) => Err(Failure::BadReply(format!("cannot read the Redis reply: {error}"))),
    }
}
