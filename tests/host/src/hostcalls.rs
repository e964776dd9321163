//! The proxy-wasm hostcalls (module `env`), implemented as Envoy implements them.
//!
//! Import names and signatures: the Rust SDK 0.2.5 `src/hostcalls.rs` (every pointer and size an i32 on
//! wasm32; `proxy_increment_metric`/`proxy_record_metric` take an i64). Behaviour: proxy-wasm-cpp-host
//! `src/exports.cc` and Envoy `source/extensions/common/wasm/context.cc`, checked with `probe/` in Envoy
//! 1.40. A pointer outside guest memory answers `InvalidMemoryAccess`; a trap in the guest's allocator
//! fails the VM. The Higress Redis calls are in [`crate::redis`], WASI in [`crate::wasi`], what else the
//! Higress flavour adds (three hostcalls, a foreign function, a property) in [`crate::higress`].
//!
//! Every hostcall body runs in [`hostcall`]: the VM-start restriction first, then the body, whose `?`
//! answers the first failing status (or traps); a body that ends answers Ok.

use crate::engine::Caller;

use crate::engine::Imports;

use crate::abi::{
    decode_pairs, encode_pairs, split_property_path, AbiVersion, BufferType, LogLevel, MapType, Status, Stop,
    StreamType,
};
use crate::flavour::HostFlavour;
use crate::higress;
use crate::http_call;
use crate::memory::{copy_out, read, write_u32, write_u64};
use crate::properties;
use crate::shared::{lock, LogSource, MetricKind};
use crate::vm::{Action, BodyView, LocalReplySpec, Pairs, VmState};

type Call<'a> = Caller<'a, VmState>;
type Answer = Result<u32, crate::engine::Error>;
/// What a hostcall body returns: `Ok` answers Ok, [`Stop`] another status or a trap.
pub(crate) type Body = Result<(), Stop>;

/// Hostcalls allowed while the VM starts (`_initialize`/`main`): cpp-host `WasmBase::startVm`.
const ALLOWED_WHILE_STARTING: &[&str] = &["proxy_log"];

/// Traps like Envoy's V8 integration (`restricted_callback`) when a function not in `allowed` runs during
/// VM start.
///
/// # Errors
/// The `restricted_callback` trap.
pub fn check_restricted(caller: &Call<'_>, name: &str, allowed: &[&str]) -> Result<(), crate::engine::Error> {
    if caller.data().starting && !allowed.contains(&name) {
        return Err(crate::engine::host_error(format!(
            "restricted_callback: {name} cannot be called while the VM starts (_initialize/main)"
        )));
    }
    Ok(())
}

/// Runs a hostcall: traps if it is restricted now, else runs `body` and answers its status (Ok when the
/// body ends, the status it stopped with, or the trap it raised).
pub(crate) fn hostcall(c: &mut Call<'_>, name: &str, body: impl FnOnce(&mut Call<'_>) -> Body) -> Answer {
    check_restricted(c, name, ALLOWED_WHILE_STARTING)?;
    let entry = profile_segment(c, name);
    let answer = match body(c) {
        Ok(()) => Ok(Status::Ok.code()),
        Err(Stop::Status(status)) => Ok(status.code()),
        Err(Stop::Trap(trap)) => Err(trap),
    };
    if let Some(entry) = entry {
        let left = c.get_fuel().unwrap_or(0);
        if let Some(profile) = &c.data().shared.fuel_profile {
            lock(profile).add(format!("(in {name})"), entry.saturating_sub(left));
        }
        c.data_mut().profile_mark = Some((name.to_string(), left));
    }
    answer
}

/// With a fuel profile: ends the current segment at hostcall `name` (recording `mark -> name`) and returns
/// the fuel left at the call.
pub(crate) fn profile_segment(c: &mut Call<'_>, name: &str) -> Option<u64> {
    c.data().shared.fuel_profile.as_ref()?;
    let left = c.get_fuel().unwrap_or(0);
    if let (Some((label, before)), Some(profile)) = (c.data_mut().profile_mark.take(), &c.data().shared.fuel_profile) {
        lock(profile).add(format!("{label} -> {name}"), before.saturating_sub(left));
    }
    Some(left)
}

/// Registers a hostcall in module `env`: `link_hostcall!(linker, fn proxy_x(c, a: u32, ...) { body })`, or
/// `link_hostcall!(linker, name => fn(c, a: u32, ...) { body })` for a name in a variable, becomes a
/// wasmtime function of the hostcall's arguments whose body runs in [`hostcall`] with `c` the caller
/// (`&mut Caller`; `_` if unused). Expands to an expression ending in `?` (for a function returning
/// `wasmi::Result`). Written in this form, which rustfmt leaves alone, to keep each signature compact.
macro_rules! link_hostcall {
    ($linker:expr, fn $name:ident($c:tt $(, $arg:ident: $ty:ty)* $(,)?) $body:block) => {
        $crate::hostcalls::link_hostcall!($linker, stringify!($name) => fn($c $(, $arg: $ty)*) $body)
    };
    ($linker:expr, $name:expr => fn($c:tt $(, $arg:ident: $ty:ty)* $(,)?) $body:block) => {
        $linker.func_wrap("env", $name, move |mut caller: crate::engine::Caller<'_, VmState> $(, $arg: $ty)*| {
            $crate::hostcalls::hostcall(&mut caller, $name, |$c| $body)
        })?
    };
}
pub(crate) use link_hostcall;

/// A body that ends at once with `status`.
fn refuse(status: Status) -> Body {
    Err(status.into())
}

/// Writes a call's token where the guest asked, around `start`: cpp-host writes 0 first, so a bad pointer
/// answers before anything starts.
pub(crate) fn start_call(
    c: &mut Call<'_>,
    token_ptr: u32,
    start: impl FnOnce(&mut VmState) -> Result<u32, Status>,
) -> Body {
    write_u32(c, token_ptr, 0)?;
    let token = start(c.data_mut())?;
    Ok(write_u32(c, token_ptr, token)?)
}

/// Adds every `env` hostcall of proxy-wasm ABI 0.2.x (those Envoy registers for the module's ABI), and
/// Higress's extra ones for [`HostFlavour::Higress`] (the Redis calls are [`crate::redis::link`]).
pub fn link(linker: &mut Imports, abi: AbiVersion, flavour: HostFlavour) -> Result<(), crate::engine::Error> {
    link_hostcall!(linker, fn proxy_log(c, level: u32, ptr: u32, size: u32) {
        let level = LogLevel::from_u32(level).ok_or(Status::BadArgument)?;
        let message = read(c, ptr, size)?;
        c.data().log(level, LogSource::ProxyLog, String::from_utf8_lossy(&message).into_owned());
        Ok(())
    });
    if abi != AbiVersion::V0_2_0 {
        link_hostcall!(linker, fn proxy_get_log_level(c, ptr: u32) {
            let level = c.data().shared.log_level.code();
            Ok(write_u32(c, ptr, level)?)
        });
    }
    // The guest's wall clock: real time plus the host's clock offset (`HostBuilder::clock_offset`).
    link_hostcall!(linker, fn proxy_get_current_time_nanoseconds(c, ptr: u32) {
        let now = c.data().shared.guest_time_ns();
        Ok(write_u64(c, ptr, now)?)
    });
    // The tick of the effective context's root context (see `VmState::set_tick_period`).
    link_hostcall!(linker, fn proxy_set_tick_period_milliseconds(c, period: u32) {
        c.data_mut().set_tick_period(std::time::Duration::from_millis(u64::from(period)));
        Ok(())
    });
    link_buffers(linker)?;
    link_maps(linker)?;
    link_stream(linker)?;
    link_shared(linker)?;
    link_metrics(linker)?;
    link_calls(linker)?;
    if flavour.higress_host() {
        higress::link_hostcalls(linker)?;
    }
    Ok(())
}

/// The bytes of a buffer now, `Err(NotFound)` if Envoy has none (`Context::getBuffer` returning null).
fn buffer(state: &VmState, buffer_type: BufferType) -> Result<Vec<u8>, Status> {
    let view = state.stream().and_then(|s| s.body_view.map(|v| (v, s)));
    Ok(match buffer_type {
        BufferType::HttpRequestBody => match view {
            Some((BodyView::Request, s)) => s.request_body.clone(),
            _ => Vec::new(),
        },
        BufferType::HttpResponseBody => match view {
            Some((BodyView::Response, s)) => s.response_body.clone(),
            _ => Vec::new(),
        },
        BufferType::HttpCallResponseBody => {
            state.call_response.as_ref().map(|r| r.body.clone()).ok_or(Status::NotFound)?
        }
        BufferType::VmConfiguration => state.setup.vm_config.clone(),
        BufferType::PluginConfiguration if state.configuring => state.setup.plugin_config.clone(),
        BufferType::PluginConfiguration => return Err(Status::NotFound),
        BufferType::RedisCallResponse => state.redis_reply.clone().ok_or(Status::NotFound)?,
        BufferType::DownstreamData
        | BufferType::UpstreamData
        | BufferType::GrpcReceiveBuffer
        | BufferType::CallData => Vec::new(),
    })
}

/// The buffer type of a number; BadArgument for an unknown one, and for 9 (Higress's Redis reply) in a host
/// without the Redis extension.
fn buffer_type(state: &VmState, kind: u32) -> Result<BufferType, Status> {
    match BufferType::from_u32(kind) {
        Some(BufferType::RedisCallResponse) if !state.setup.flavour.redis_extension() => Err(Status::BadArgument),
        Some(buffer) => Ok(buffer),
        None => Err(Status::BadArgument),
    }
}

fn link_buffers(linker: &mut Imports) -> Result<(), crate::engine::Error> {
    link_hostcall!(linker, fn proxy_get_buffer_bytes(c, kind: u32, start: u32, length: u32, ptr_ptr: u32,
            size_ptr: u32) {
        let bytes = buffer(c.data(), buffer_type(c.data(), kind)?)?;
        // Envoy: clip to the buffer; nothing to copy stores 0/0 and answers Ok.
        let start = usize::try_from(start).unwrap_or(usize::MAX);
        let length = usize::try_from(length).unwrap_or(usize::MAX);
        let end = start.saturating_add(length).min(bytes.len());
        copy_out(c, bytes.get(start..end).unwrap_or_default(), ptr_ptr, size_ptr)
    });
    link_hostcall!(linker, fn proxy_get_buffer_status(c, kind: u32, length_ptr: u32, flags_ptr: u32) {
        let length = buffer(c.data(), buffer_type(c.data(), kind)?)?.len();
        write_u32(c, length_ptr, u32::try_from(length).unwrap_or(u32::MAX))?;
        Ok(write_u32(c, flags_ptr, 0)?)
    });
    link_hostcall!(linker, fn proxy_set_buffer_bytes(c, kind: u32, start: u32, length: u32, data_ptr: u32,
            data_size: u32) {
        let kind = buffer_type(c.data(), kind)?;
        buffer(c.data(), kind)?;
        let data = read(c, data_ptr, data_size)?;
        let stream = c.data_mut().stream_mut().ok_or(Status::BadArgument)?;
        let body = match (kind, stream.body_view) {
            (BufferType::HttpRequestBody, Some(BodyView::Request)) => &mut stream.request_body,
            (BufferType::HttpResponseBody, Some(BodyView::Response)) => &mut stream.response_body,
            _ => return refuse(Status::BadArgument),
        };
        Ok(replace_range(body, start, length, &data)?)
    });
    Ok(())
}

/// Envoy `Buffer::copyFrom`: prepend (start 0, length 0), replace all (start 0, length >= size), append
/// (start >= size); anything else is BadArgument.
fn replace_range(body: &mut Vec<u8>, start: u32, length: u32, data: &[u8]) -> Result<(), Status> {
    let start = usize::try_from(start).unwrap_or(usize::MAX);
    let length = usize::try_from(length).unwrap_or(usize::MAX);
    if start == 0 && length == 0 {
        let mut joined = data.to_vec();
        joined.extend_from_slice(body);
        *body = joined;
    } else if start == 0 && length >= body.len() {
        *body = data.to_vec();
    } else if start != 0 && start >= body.len() {
        body.extend_from_slice(data);
    } else {
        return Err(Status::BadArgument);
    }
    Ok(())
}

fn lowercase(key: &[u8]) -> Vec<u8> {
    key.to_ascii_lowercase()
}

fn map_type(kind: u32) -> Result<MapType, Status> {
    MapType::from_u32(kind).ok_or(Status::BadArgument)
}

/// Header pairs from the wire format, names lowercased (as Envoy's header maps keep them).
fn lowercase_pairs(bytes: &[u8]) -> Pairs {
    decode_pairs(bytes).into_iter().map(|(k, v)| (lowercase(&k), v)).collect()
}

/// A header map edit: the map the guest may write now, the lowercased key, the value (empty if the
/// hostcall has none).
type Edit = fn(&mut Pairs, Vec<u8>, Vec<u8>);

/// The body of the three single-header edits (add, replace, remove): reads the key (and value) and edits
/// the map if it is writable now, else BadArgument.
fn edit_map(c: &mut Call<'_>, kind: u32, key: (u32, u32), value: Option<(u32, u32)>, edit: Edit) -> Body {
    let kind = map_type(kind)?;
    let key = lowercase(&read(c, key.0, key.1)?);
    let value = match value {
        Some((ptr, size)) => read(c, ptr, size)?,
        None => Vec::new(),
    };
    let map = c.data_mut().writable_map(kind).ok_or(Status::BadArgument)?;
    edit(map, key, value);
    Ok(())
}

fn link_maps(linker: &mut Imports) -> Result<(), crate::engine::Error> {
    link_hostcall!(linker, fn proxy_get_header_map_pairs(c, kind: u32, ptr_ptr: u32, size_ptr: u32) {
        // Envoy answers Ok with no pairs for a map it does not have now.
        let pairs = c.data().readable_map(map_type(kind)?).cloned().unwrap_or_default();
        let bytes = if pairs.is_empty() { Vec::new() } else { encode_pairs(&pairs) };
        copy_out(c, &bytes, ptr_ptr, size_ptr)
    });
    link_hostcall!(linker, fn proxy_get_header_map_value(c, kind: u32, key_ptr: u32, key_size: u32, ptr_ptr: u32,
            size_ptr: u32) {
        let kind = map_type(kind)?;
        let key = lowercase(&read(c, key_ptr, key_size)?);
        let map = c.data().readable_map(kind)?;
        let value = map.iter().find(|(k, _)| *k == key).map(|(_, v)| v.clone()).ok_or(Status::NotFound)?;
        copy_out(c, &value, ptr_ptr, size_ptr)
    });
    let edits: [(&'static str, Edit); 2] = [
        ("proxy_add_header_map_value", |map, key, value| map.push((key, value))),
        // Envoy `HeaderMap::setCopy`: every entry of the name is removed and one is appended.
        ("proxy_replace_header_map_value", |map, key, value| {
            map.retain(|(k, _)| *k != key);
            map.push((key, value));
        }),
    ];
    for (name, edit) in edits {
        link_hostcall!(linker, name => fn(c, kind: u32, key_ptr: u32, key_size: u32, value_ptr: u32, value_size: u32) {
            edit_map(c, kind, (key_ptr, key_size), Some((value_ptr, value_size)), edit)
        });
    }
    link_hostcall!(linker, fn proxy_remove_header_map_value(c, kind: u32, key_ptr: u32, key_size: u32) {
        edit_map(c, kind, (key_ptr, key_size), None, |map, key, _| map.retain(|(k, _)| *k != key))
    });
    link_hostcall!(linker, fn proxy_set_header_map_pairs(c, kind: u32, ptr: u32, size: u32) {
        let kind = map_type(kind)?;
        let pairs = lowercase_pairs(&read(c, ptr, size)?);
        *c.data_mut().writable_map(kind).ok_or(Status::BadArgument)? = pairs;
        Ok(())
    });
    link_hostcall!(linker, fn proxy_get_header_map_size(c, kind: u32, result_ptr: u32) {
        let kind = map_type(kind)?;
        let map = c.data_mut().writable_map(kind).ok_or(Status::BadArgument)?;
        let size: usize = map.iter().map(|(k, v)| k.len() + v.len()).sum();
        Ok(write_u32(c, result_ptr, u32::try_from(size).unwrap_or(u32::MAX))?)
    });
    link_hostcall!(linker, fn proxy_get_property(c, path_ptr: u32, path_size: u32, ptr_ptr: u32, size_ptr: u32) {
        let path = read(c, path_ptr, path_size)?;
        let value = match properties::lookup(c.data(), &path) {
            Err(Status::NotFound) if is_vm_memory(c.data(), &path) => {
                higress::vm_memory_property(c).ok_or(Status::NotFound)?
            }
            other => other?,
        };
        copy_out(c, &value, ptr_ptr, size_ptr)
    });
    link_hostcall!(linker, fn proxy_set_property(c, path_ptr: u32, path_size: u32, value_ptr: u32, value_size: u32) {
        let path = read(c, path_ptr, path_size)?;
        let value = read(c, value_ptr, value_size)?;
        // Envoy: filter state `wasm.<path>` of the stream; no stream, no state.
        let stream = c.data_mut().stream_mut().ok_or(Status::NotFound)?;
        let key = path.strip_suffix(b"\0").unwrap_or(&path).to_vec();
        stream.info.filter_state.insert(key, value);
        Ok(())
    });
    Ok(())
}

/// Higress's `plugin_vm_memory` property, served by [`higress::vm_memory_property`].
fn is_vm_memory(state: &VmState, path: &[u8]) -> bool {
    state.setup.flavour.higress_host() && split_property_path(path) == [b"plugin_vm_memory".as_slice()]
}

fn stream_type(kind: u32) -> Result<StreamType, Status> {
    StreamType::from_u32(kind).ok_or(Status::BadArgument)
}

fn link_stream(linker: &mut Imports) -> Result<(), crate::engine::Error> {
    link_hostcall!(linker, fn proxy_continue_stream(c, kind: u32) {
        match stream_type(kind)? {
            kind @ (StreamType::Request | StreamType::Response) => {
                let state = c.data_mut();
                let context = state.context_id();
                if let Some(stream) = state.stream_mut() {
                    // Envoy `Context::continueStream`: the request headers are dropped at once.
                    stream.request_headers_open = false;
                    state.actions.push(Action::Continue { context, stream: kind });
                }
                Ok(())
            }
            StreamType::Downstream => Ok(()),
            StreamType::Upstream => refuse(Status::Unimplemented),
        }
    });
    link_hostcall!(linker, fn proxy_close_stream(c, kind: u32) {
        let kind = stream_type(kind)?;
        let state = c.data_mut();
        let context = state.context_id();
        if matches!(kind, StreamType::Request | StreamType::Response) && state.stream().is_some() {
            state.actions.push(Action::Close { context });
        }
        Ok(())
    });
    link_hostcall!(linker, fn proxy_send_local_response(c, status: u32, details_ptr: u32, details_size: u32,
            body_ptr: u32, body_size: u32, headers_ptr: u32, headers_size: u32, grpc_status: i32) {
        let details = read(c, details_ptr, details_size)?;
        let body = read(c, body_ptr, body_size)?;
        let headers = read(c, headers_ptr, headers_size)?;
        let state = c.data_mut();
        let context = state.context_id();
        if state.stream().is_some() {
            let details = String::from_utf8_lossy(&details).into_owned();
            // cpp-host: 0xFFFFFFFF (-1) is no gRPC status.
            let grpc_status = u32::try_from(grpc_status).ok();
            let reply = LocalReplySpec { status, details, body, headers: lowercase_pairs(&headers), grpc_status };
            state.actions.push(Action::LocalReply { context, reply });
        }
        // cpp-host: the filter stops, whatever the callback returns.
        state.stop_iteration = true;
        Ok(())
    });
    link_hostcall!(linker, fn proxy_set_effective_context(c, context: u32) {
        let refused = lock(&c.data().shared.faults).take_refusal();
        if let Some(left) = refused {
            let left = if left == u32::MAX { "always".to_string() } else { format!("{left} more") };
            let note = format!("fault: proxy_set_effective_context({context}) refused with BadArgument ({left})");
            c.data().log(LogLevel::Debug, LogSource::Host, note);
            return refuse(Status::BadArgument);
        }
        let state = c.data_mut();
        if !state.contexts.contains_key(&context) {
            return refuse(Status::BadArgument);
        }
        state.effective = context;
        Ok(())
    });
    // cpp-host `WasmBase::done`: only a root context whose `proxy_on_done` answered false may call it; this
    // host never shuts a plugin down, so there is none.
    link_hostcall!(linker, fn proxy_done(_) {
        refuse(Status::NotFound)
    });
    Ok(())
}

fn link_shared(linker: &mut Imports) -> Result<(), crate::engine::Error> {
    link_hostcall!(linker, fn proxy_get_shared_data(c, key_ptr: u32, key_size: u32, ptr_ptr: u32, size_ptr: u32,
            cas_ptr: u32) {
        let key = read(c, key_ptr, key_size)?;
        let (value, cas) = lock(&c.data().shared.data).get(&key)?;
        copy_out(c, &value, ptr_ptr, size_ptr)?;
        Ok(write_u32(c, cas_ptr, cas)?)
    });
    link_hostcall!(linker, fn proxy_set_shared_data(c, key_ptr: u32, key_size: u32, value_ptr: u32, value_size: u32,
            cas: u32) {
        let key = read(c, key_ptr, key_size)?;
        let value = read(c, value_ptr, value_size)?;
        Ok(lock(&c.data().shared.data).set(&key, &value, cas)?)
    });
    link_hostcall!(linker, fn proxy_register_shared_queue(c, name_ptr: u32, name_size: u32, token_ptr: u32) {
        let name = read(c, name_ptr, name_size)?;
        let (vm, root) = (c.data().vm, c.data().root_id);
        let token = lock(&c.data().shared.queues).register(&name, vm, root);
        Ok(write_u32(c, token_ptr, token)?)
    });
    link_hostcall!(linker, fn proxy_resolve_shared_queue(c, _vm_id_ptr: u32, _vm_id_size: u32, name_ptr: u32,
            name_size: u32, token_ptr: u32) {
        let name = read(c, name_ptr, name_size)?;
        // One vm_id per host: every VM resolves the same queues.
        let token = lock(&c.data().shared.queues).resolve(&name).ok_or(Status::NotFound)?;
        Ok(write_u32(c, token_ptr, token)?)
    });
    link_hostcall!(linker, fn proxy_dequeue_shared_queue(c, token: u32, ptr_ptr: u32, size_ptr: u32) {
        let item = lock(&c.data().shared.queues).dequeue(token)?;
        copy_out(c, &item, ptr_ptr, size_ptr)
    });
    link_hostcall!(linker, fn proxy_enqueue_shared_queue(c, token: u32, ptr: u32, size: u32) {
        let item = read(c, ptr, size)?;
        let (vm, root) = lock(&c.data().shared.queues).enqueue(token, &item)?;
        let _ = c.data().events.send(crate::vm::Event::QueueReady { vm, root, token });
        Ok(())
    });
    Ok(())
}

/// Envoy takes a metric's type from its id; `proxy_increment_metric` and `proxy_get_metric` answer
/// BadArgument for a histogram id before any lookup.
fn counter_or_gauge(id: u32) -> Result<(), Status> {
    match MetricKind::of_id(id) {
        Some(MetricKind::Counter | MetricKind::Gauge) => Ok(()),
        _ => Err(Status::BadArgument),
    }
}

/// The name of a metric id this VM defined.
fn metric_name(c: &Call<'_>, id: u32) -> Result<String, Status> {
    c.data().metric_ids.get(&id).cloned().ok_or(Status::NotFound)
}

fn link_metrics(linker: &mut Imports) -> Result<(), crate::engine::Error> {
    link_hostcall!(linker, fn proxy_define_metric(c, kind: u32, name_ptr: u32, name_size: u32, id_ptr: u32) {
        let metric_kind = MetricKind::from_u32(kind).ok_or(Status::BadArgument)?;
        let name = String::from_utf8_lossy(&read(c, name_ptr, name_size)?).into_owned();
        lock(&c.data().shared.metrics).define(&name, metric_kind);
        let id = c.data_mut().allocate_metric(kind, name);
        Ok(write_u32(c, id_ptr, id)?)
    });
    link_hostcall!(linker, fn proxy_increment_metric(c, id: u32, offset: i64) {
        counter_or_gauge(id)?;
        let name = metric_name(c, id)?;
        Ok(lock(&c.data().shared.metrics).increment(&name, offset)?)
    });
    link_hostcall!(linker, fn proxy_record_metric(c, id: u32, value: u64) {
        let name = metric_name(c, id)?;
        Ok(lock(&c.data().shared.metrics).record(&name, value)?)
    });
    link_hostcall!(linker, fn proxy_get_metric(c, id: u32, result_ptr: u32) {
        counter_or_gauge(id)?;
        let name = metric_name(c, id)?;
        let value = lock(&c.data().shared.metrics).get(&name)?;
        Ok(write_u64(c, result_ptr, value)?)
    });
    Ok(())
}

fn link_calls(linker: &mut Imports) -> Result<(), crate::engine::Error> {
    link_hostcall!(linker, fn proxy_http_call(c, cluster_ptr: u32, cluster_size: u32, headers_ptr: u32,
            headers_size: u32, body_ptr: u32, body_size: u32, trailers_ptr: u32, trailers_size: u32, timeout_ms: u32,
            token_ptr: u32) {
        let cluster = read(c, cluster_ptr, cluster_size)?;
        let headers = decode_pairs(&read(c, headers_ptr, headers_size)?);
        let body = read(c, body_ptr, body_size)?;
        read(c, trailers_ptr, trailers_size)?;
        start_call(c, token_ptr, |state| http_call::start(state, &cluster, headers, body, timeout_ms))
    });
    // gRPC: this host has no gRPC services. Envoy answers ParseFailure for a service that is neither a
    // GrpcService proto nor a known cluster; a known cluster is reported and refused here.
    link_hostcall!(linker, fn proxy_grpc_call(c, service_ptr: u32, service_size: u32, _service_name: u32,
            _service_name_size: u32, _method: u32, _method_size: u32, _metadata: u32, _metadata_size: u32,
            _request: u32, _request_size: u32, _timeout: u32, _token: u32) {
        grpc_refused(c, service_ptr, service_size)
    });
    link_hostcall!(linker, fn proxy_grpc_stream(c, service: u32, service_size: u32, _name: u32, _name_size: u32,
            _method: u32, _method_size: u32, _metadata: u32, _metadata_size: u32, _token: u32) {
        grpc_refused(c, service, service_size)
    });
    link_hostcall!(linker, fn proxy_grpc_cancel(_, _token: u32) {
        refuse(Status::BadArgument)
    });
    link_hostcall!(linker, fn proxy_grpc_close(_, _token: u32) {
        refuse(Status::BadArgument)
    });
    link_hostcall!(linker, fn proxy_grpc_send(_, _token: u32, _ptr: u32, _size: u32, _end: u32) {
        refuse(Status::BadArgument)
    });
    // The status of the last gRPC/HTTP failure on the root context: this host reports HTTP call failures as
    // synthesized responses (as Envoy does for timeouts and connect failures), so it is always 0 / "".
    link_hostcall!(linker, fn proxy_get_status(c, code_ptr: u32, ptr_ptr: u32, size_ptr: u32) {
        write_u32(c, code_ptr, 0)?;
        copy_out(c, &[], ptr_ptr, size_ptr)
    });
    // Envoy registers a few foreign functions (compression, signatures, filter state); none is emulated
    // (stock Envoy 1.40 answers NotFound for `get_log_level`). Higress's host adds `get_log_level`, answered
    // as cpp-host's `call_foreign_function` answers ([`higress`]).
    link_hostcall!(linker, fn proxy_call_foreign_function(c, name_ptr: u32, name_size: u32, args: u32,
            args_size: u32, results: u32, results_size: u32) {
        if !c.data().setup.flavour.higress_host() {
            if let Ok(name) = read(c, name_ptr, name_size) {
                foreign_function_missing(c, &name);
            }
            return refuse(Status::NotFound);
        }
        let name = read(c, name_ptr, name_size)?;
        read(c, args, args_size)?;
        let Some(result) = higress::foreign_function(c.data(), &name) else {
            foreign_function_missing(c, &name);
            return refuse(Status::NotFound);
        };
        higress::deliver_foreign_result(c, &result, results, results_size)
    });
    // Emscripten and pthread helpers Envoy registers in `env`.
    linker
        .func_wrap("env", "pthread_equal", |_c: Call<'_>, left: u32, right: u32| -> u32 { u32::from(left == right) })?;
    linker.func_wrap("env", "emscripten_notify_memory_growth", |_c: Call<'_>, _index: u32| {})?;
    Ok(())
}

/// Logs a call of a foreign function this host does not have (the call answers NotFound).
fn foreign_function_missing(c: &Call<'_>, name: &[u8]) {
    let name = String::from_utf8_lossy(name);
    let host = c.data().setup.flavour;
    let note = format!("proxy_call_foreign_function({name:?}): no such foreign function in the {host} host");
    c.data().log(LogLevel::Warn, LogSource::Host, note);
}

fn grpc_refused(c: &mut Call<'_>, service_ptr: u32, service_size: u32) -> Body {
    let service = String::from_utf8_lossy(&read(c, service_ptr, service_size)?).into_owned();
    if !c.data().setup.clusters.contains_key(&service) {
        return refuse(Status::ParseFailure);
    }
    let note = format!("gRPC call to cluster {service:?}: gRPC is not emulated; answered InternalFailure");
    c.data().log(LogLevel::Warn, LogSource::Host, note);
    refuse(Status::InternalFailure)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffer_edits_follow_envoys_copy_from() {
        let mut body = b"bc".to_vec();
        assert_eq!(replace_range(&mut body, 0, 0, b"a"), Ok(()));
        assert_eq!(body, b"abc");
        assert_eq!(replace_range(&mut body, 3, 0, b"d"), Ok(()));
        assert_eq!(body, b"abcd");
        assert_eq!(replace_range(&mut body, 0, 4, b"x"), Ok(()));
        assert_eq!(body, b"x");
        assert_eq!(replace_range(&mut b"abc".to_vec(), 1, 1, b"x"), Err(Status::BadArgument));
        assert_eq!(replace_range(&mut b"abc".to_vec(), 0, 1, b"x"), Err(Status::BadArgument));
    }
}
