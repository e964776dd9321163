//! The callbacks the host calls (the module's exports), each routed to the [`Filter`] of its root context.

use crate::prelude::*;

use core::cell::RefCell;

use crate::filter::{Action, Filter};
use crate::host::{Host, LogLevel};
use crate::id_map::IdMap;

use super::AbiHost;

/// The root contexts of this VM and the HTTP contexts they created.
struct Vm {
    /// Root context id -> its filter (`None` until configured, or when the configuration was refused).
    roots: Vec<(u32, Option<Filter<AbiHost>>)>,
    /// HTTP context id -> its root context id.
    contexts: IdMap<u32>,
}

impl Vm {
    /// The filter of a root context, or of the root of an HTTP context.
    fn filter(&mut self, context_id: u32) -> Option<&mut Filter<AbiHost>> {
        let root = if self.roots.iter().any(|(id, _)| *id == context_id) {
            context_id
        } else {
            *self.contexts.get(&context_id)?
        };
        self.roots.iter_mut().find(|(id, _)| *id == root).and_then(|(_, filter)| filter.as_mut())
    }
}

/// The VM's state. A proxy-wasm VM runs on one thread (one per Envoy worker), and this `no_std` module has
/// no threads of its own, so a plain cell is enough.
struct VmCell(RefCell<Option<Vm>>);

// SAFETY: a wasm32 proxy-wasm VM is single-threaded: the cell is never reached from two threads.
unsafe impl Sync for VmCell {}

static VM: VmCell = VmCell(RefCell::new(None));

/// Runs `f` on the VM state; `None` if a callback re-entered while another holds it (the host called
/// back during a hostcall: the inner callback then does nothing).
fn with_vm<T>(f: impl FnOnce(&mut Vm) -> T) -> Option<T> {
    let mut vm = VM.0.try_borrow_mut().ok()?;
    Some(f(vm.get_or_insert_with(|| Vm { roots: Vec::new(), contexts: IdMap::default() })))
}

#[cfg(target_os = "wasi")]
extern "C" {
    fn __wasm_call_ctors();
}

/// WASI reactor initialisation: the host calls it once before anything else.
#[cfg(target_os = "wasi")]
#[no_mangle]
pub extern "C" fn _initialize() {
    // SAFETY: called once by the host, before any other export, as the WASI reactor ABI requires.
    unsafe { __wasm_call_ctors() }
}

/// The ABI version this module speaks (what proxy-wasm 0.2.5 modules export; Envoy and Higress accept it).
#[no_mangle]
pub extern "C" fn proxy_abi_version_0_2_1() {}

/// Allocates `size` bytes for the host to write into (header values, buffers); ownership passes to the
/// module through the hostcall that returns the pointer.
#[no_mangle]
pub extern "C" fn proxy_on_memory_allocate(size: usize) -> *mut u8 {
    let mut buffer: Vec<u8> = Vec::with_capacity(size);
    let pointer = buffer.as_mut_ptr();
    core::mem::forget(buffer);
    pointer
}

/// `proxy_on_context_create(id, 0)`: a root context; otherwise an HTTP context of root `parent`.
#[no_mangle]
pub extern "C" fn proxy_on_context_create(context_id: u32, parent_context_id: u32) {
    with_vm(|vm| {
        if parent_context_id == 0 {
            vm.roots.push((context_id, None));
        } else {
            vm.contexts.insert(context_id, parent_context_id);
        }
    });
}

/// The VM starts: nothing to do (the configuration comes with `proxy_on_configure`).
#[no_mangle]
pub extern "C" fn proxy_on_vm_start(_context_id: u32, _vm_configuration_size: usize) -> bool {
    true
}

/// Reads, validates and applies the plugin configuration; `false` refuses it (Envoy then does not load
/// the plugin), after a log line naming the field.
#[no_mangle]
pub extern "C" fn proxy_on_configure(context_id: u32, _plugin_configuration_size: usize) -> bool {
    let host = AbiHost;
    let configured = match host.plugin_configuration() {
        Ok(bytes) => Filter::configure(host, &bytes.unwrap_or_default(), cfg!(feature = "host-redis")),
        Err(error) => {
            Err(crate::config::ConfigError::new("", format!("cannot read the plugin configuration: {error}")))
        }
    };
    let mut filter = match configured {
        Ok(filter) => filter,
        Err(reason) => {
            AbiHost.log(LogLevel::Error, &format!("{}{reason}", crate::filter::REFUSAL_PREFIX));
            return false;
        }
    };
    filter.own_root_context(context_id);
    with_vm(|vm| match vm.roots.iter_mut().find(|(id, _)| *id == context_id) {
        Some((_, slot)) => {
            // A new configuration for the same root context: the old filter's paused requests end now and
            // its leases are settled through the new one.
            if let Some(mut old) = slot.take() {
                filter.adopt(old.retire());
            }
            *slot = Some(filter);
        }
        None => vm.roots.push((context_id, Some(filter))),
    })
    .is_some()
}

/// The request headers arrived: decide, or pause until Redis answers (or until the body has arrived, for
/// a rule that reads it).
#[no_mangle]
pub extern "C" fn proxy_on_request_headers(context_id: u32, _num_headers: usize, end_of_stream: bool) -> u32 {
    with_vm(|vm| vm.filter(context_id).map(|filter| filter.on_request_start(context_id, !end_of_stream)))
        .flatten()
        .unwrap_or(Action::Continue) as u32
}

/// A request body chunk (`body_size`: all buffered so far): a request waiting for its body is decided at
/// its end; others go on. (A host skips the callback when the module does not export it; this one returns
/// at once for a request that waits for nothing.)
#[no_mangle]
pub extern "C" fn proxy_on_request_body(context_id: u32, body_size: usize, end_of_stream: bool) -> u32 {
    with_vm(|vm| vm.filter(context_id).map(|filter| filter.on_request_body(context_id, body_size, end_of_stream)))
        .flatten()
        .unwrap_or(Action::Continue) as u32
}

/// The request trailers arrived: the request body ended, a request waiting for it is decided.
#[no_mangle]
pub extern "C" fn proxy_on_request_trailers(context_id: u32, _num_trailers: usize) -> u32 {
    with_vm(|vm| vm.filter(context_id).map(|filter| filter.on_request_trailers(context_id)))
        .flatten()
        .unwrap_or(Action::Continue) as u32
}

/// The response headers arrived: add the rate limit headers of an allowed request.
#[no_mangle]
pub extern "C" fn proxy_on_response_headers(context_id: u32, _num_headers: usize, _end_of_stream: bool) -> u32 {
    with_vm(|vm| vm.filter(context_id).map(|filter| filter.on_response_headers(context_id)))
        .flatten()
        .unwrap_or(Action::Continue) as u32
}

/// A response body chunk: read for a request whose reservation settles to the usage in the body (rules
/// with `cost`), and let through. (Exported for them: Envoy calls it for every chunk of every response,
/// and the filter returns at once for a request with nothing to settle.)
#[no_mangle]
pub extern "C" fn proxy_on_response_body(context_id: u32, body_size: usize, end_of_stream: bool) -> u32 {
    with_vm(|vm| vm.filter(context_id).map(|filter| filter.on_response_body(context_id, body_size, end_of_stream)))
        .flatten()
        .unwrap_or(Action::Continue) as u32
}

/// The response trailers arrived: the response ends here (when trailers follow, the last body chunk came
/// with `end_of_stream = false`), so a reservation reading its usage from the body settles now.
#[no_mangle]
pub extern "C" fn proxy_on_response_trailers(context_id: u32, _num_trailers: usize) -> u32 {
    with_vm(|vm| vm.filter(context_id).map(|filter| filter.on_response_trailers(context_id)))
        .flatten()
        .unwrap_or(Action::Continue) as u32
}

/// The context is deleted: forget it (a reply still on its way is dropped when it arrives); a deleted root
/// context takes its filter along. (No `proxy_on_done`: the host calls `proxy_on_delete` right after it
/// for every context, and a host skips the callbacks a module does not export, so not exporting it saves
/// one call into the VM per request; a root context without it is done at once, as this one is.)
#[no_mangle]
pub extern "C" fn proxy_on_delete(context_id: u32) {
    with_vm(|vm| {
        if let Some(filter) = vm.filter(context_id) {
            filter.on_done(context_id);
        }
        vm.contexts.remove(&context_id);
        let Some(at) = vm.roots.iter().position(|(id, _)| *id == context_id) else { return };
        let (_, retired) = vm.roots.remove(at);
        // A root context goes (Envoy replaced its configuration and its streams are done): what its leases
        // owe Redis is sent by the root that took its place.
        if let Some(mut old) = retired {
            let retirement = old.retire();
            match vm.roots.iter_mut().rev().find_map(|(_, filter)| filter.as_mut()) {
                Some(new) => new.adopt(retirement),
                None => old.drop_retirement(&retirement),
            }
        }
    });
}

/// The root context's tick: the deadline guard.
#[no_mangle]
pub extern "C" fn proxy_on_tick(context_id: u32) {
    with_vm(|vm| {
        if let Some(filter) = vm.filter(context_id) {
            filter.on_tick();
        }
    });
}

/// An HTTP call's response (the bridge), delivered to the root context.
#[no_mangle]
pub extern "C" fn proxy_on_http_call_response(
    context_id: u32,
    token: u32,
    num_headers: usize,
    body_size: usize,
    _num_trailers: usize,
) {
    with_vm(|vm| {
        if let Some(filter) = vm.filter(context_id) {
            filter.on_http_call_response(token, num_headers, body_size);
        }
    });
}

/// A Redis reply from the host's client (Higress ABI), delivered to the root context: `status` 0 = a reply
/// of `response_size` bytes in buffer type 9, 1 = network error or timeout.
#[cfg(feature = "host-redis")]
#[no_mangle]
pub extern "C" fn proxy_on_redis_call_response(context_id: u32, token: u32, status: u32, response_size: usize) {
    with_vm(|vm| {
        if let Some(filter) = vm.filter(context_id) {
            filter.on_redis_call_response(token, status, response_size);
        }
    });
}
