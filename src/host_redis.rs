//! The Higress host Redis interface (the host-redis build): commands go to the host's outbound Redis
//! client for an Envoy cluster with `proxy_redis_call`, replies come back through the exported
//! `proxy_on_redis_call_response`. ABI as Higress's Envoy fork and SDKs define it (DESIGN.md, "Facts: the
//! Higress host Redis interface"); no crates.io crate carries these calls, so they are declared here.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;

use proxy_wasm::hostcalls;
use proxy_wasm::types::LogLevel;

use crate::config::RedisConfig;
use crate::filter::{flows, resume_or_respond};
use crate::limiter::Failure;
use crate::resp::Command;
use crate::transport::RedisTransport;

/// Buffer type of the Redis call response (Higress ABI; the `proxy-wasm` crate's `BufferType` stops at 8).
const REDIS_CALL_RESPONSE_BUFFER: u32 = 9;

#[link(wasm_import_module = "env")]
extern "C" {
    fn proxy_redis_init(
        service_ptr: *const u8,
        service_size: usize,
        username_ptr: *const u8,
        username_size: usize,
        password_ptr: *const u8,
        password_size: usize,
        timeout_milliseconds: u32,
    ) -> u32;

    fn proxy_redis_call(
        service_ptr: *const u8,
        service_size: usize,
        query_ptr: *const u8,
        query_size: usize,
        token_ptr: *mut u32,
    ) -> u32;

    // Declared by the `proxy-wasm` crate too, with its `BufferType` enum (repr u32) as first argument:
    // the same wasm import, typed here with a plain u32 so that buffer type 9 can be asked for.
    #[allow(clashing_extern_declarations)]
    fn proxy_get_buffer_bytes(
        buffer_type: u32,
        start: usize,
        max_size: usize,
        return_buffer_data: *mut *mut u8,
        return_buffer_size: *mut usize,
    ) -> u32;
}

thread_local! {
    /// Outstanding Redis calls of this VM: token -> HTTP context id. The host answers on the root context,
    /// so the filter keeps this map itself.
    static CALLS: RefCell<HashMap<u32, u32>> = RefCell::new(HashMap::new());
}

/// A host status code as a sentence (0 Ok, 2 BadArgument: no such cluster, 10 InternalFailure: no host).
fn describe(status: u32, service: &str) -> String {
    match status {
        2 => format!("BadArgument: the host knows no Redis cluster {service:?}"),
        10 => format!("InternalFailure: no Redis host available in {service:?}"),
        other => format!("status {other} for {service:?}"),
    }
}

/// Redis through the host: `proxy_redis_init` once per VM (retried on use while it fails, and again
/// after `NOAUTH`), then one `proxy_redis_call` per command.
pub struct HostRedis {
    /// Cluster name, plus `?db=N` when a database other than 0 is selected.
    service: String,
    username: String,
    password: String,
    timeout_ms: u32,
    initialized: Cell<bool>,
}

impl HostRedis {
    /// The client for `redis.cluster` with its credentials, timeout and database. Call [`HostRedis::init`].
    pub fn new(redis: &RedisConfig) -> Self {
        let service = if redis.database == 0 {
            redis.cluster.clone()
        } else {
            format!("{}?db={}", redis.cluster, redis.database)
        };
        HostRedis {
            service,
            username: redis.username.clone().unwrap_or_default(),
            password: redis.password.clone().unwrap_or_default(),
            timeout_ms: u32::try_from(redis.timeout_ms).unwrap_or(u32::MAX),
            initialized: Cell::new(false),
        }
    }

    /// Asks the host to create its client for the cluster.
    ///
    /// # Errors
    /// The host's refusal as a sentence (the cluster may not be known yet: it is retried on the next call).
    pub fn init(&self) -> Result<(), String> {
        // SAFETY: every pointer/length pair describes a live byte slice for the duration of the call.
        let status = unsafe {
            proxy_redis_init(
                self.service.as_ptr(),
                self.service.len(),
                self.username.as_ptr(),
                self.username.len(),
                self.password.as_ptr(),
                self.password.len(),
                self.timeout_ms,
            )
        };
        self.initialized.set(status == 0);
        if status == 0 {
            Ok(())
        } else {
            Err(describe(status, &self.service))
        }
    }
}

impl RedisTransport for HostRedis {
    fn send(&self, context_id: u32, command: &Command) -> Result<u32, Failure> {
        if !self.initialized.get() {
            self.init().map_err(|why| Failure::SendRefused(format!("proxy_redis_init: {why}")))?;
        }
        let query = command.to_resp();
        let mut token = 0u32;
        // SAFETY: the slices live for the call; `token` is a valid u32 the host writes once.
        let status = unsafe {
            proxy_redis_call(self.service.as_ptr(), self.service.len(), query.as_ptr(), query.len(), &mut token)
        };
        if status != 0 {
            return Err(Failure::SendRefused(format!("proxy_redis_call: {}", describe(status, &self.service))));
        }
        CALLS.with(|calls| calls.borrow_mut().insert(token, context_id));
        Ok(token)
    }

    fn reconnect(&self) {
        self.initialized.set(false);
    }
}

/// Reads the reply of the Redis call whose callback is running (buffer type 9, valid only now).
fn read_reply(response_size: usize) -> Result<Vec<u8>, Failure> {
    let mut data: *mut u8 = std::ptr::null_mut();
    let mut size: usize = 0;
    // SAFETY: the host writes a pointer it allocated with proxy_on_memory_allocate (the guest's allocator)
    // and its length; ownership passes to the guest, as for every proxy_get_buffer_bytes.
    let status = unsafe { proxy_get_buffer_bytes(REDIS_CALL_RESPONSE_BUFFER, 0, response_size, &mut data, &mut size) };
    if status != 0 || data.is_null() || size == 0 {
        return Err(Failure::BadReply(format!("cannot read the Redis reply (status {status}, {size} bytes)")));
    }
    // SAFETY: as above: `data` is a `size`-byte allocation of the guest allocator, owned by us now.
    Ok(unsafe { Vec::from_raw_parts(data, size, size) })
}

/// Called by the host when a Redis reply (or failure) arrives, on the ROOT context: routes it by token
/// to the HTTP context that sent the call, makes that context effective, then resumes or answers it.
/// `status`: 0 = a reply (possibly a Redis error reply), 1 = network error or timeout (size 0).
#[no_mangle]
pub extern "C" fn proxy_on_redis_call_response(_root_context_id: u32, token: u32, status: u32, response_size: usize) {
    let Some(context_id) = CALLS.with(|calls| calls.borrow_mut().remove(&token)) else { return };
    let reply = match status {
        0 => read_reply(response_size),
        _ => Err(Failure::NoReply),
    };
    // The HTTP context may be gone (client disconnected): nothing to resume then.
    let Some(flow) = flows::find(context_id) else { return };
    if reply.as_deref().is_ok_and(|bytes| bytes.starts_with(b"-NOAUTH")) {
        flow.borrow().reconnect();
    }
    if hostcalls::set_effective_context(context_id).is_err() {
        let _ = hostcalls::log(LogLevel::Warn, "edge-rate-limiter: the host refused to switch to a paused request");
        return;
    }
    let next = flow.borrow_mut().on_reply(token, reply);
    resume_or_respond(next);
}
