//! The proxy-wasm hostcalls (module `env`), implemented as Envoy implements them.
//!
//! Import names and signatures: the Rust SDK 0.2.5 `src/hostcalls.rs` (every pointer and size an i32 on
//! wasm32; `proxy_increment_metric`/`proxy_record_metric` take an i64). Behaviour: proxy-wasm-cpp-host
//! `src/exports.cc` and Envoy `source/extensions/common/wasm/context.cc`, checked with `probe/` in Envoy
//! 1.40. A pointer outside guest memory answers `InvalidMemoryAccess`; a trap in the guest's allocator
//! fails the VM. The Higress Redis calls are in [`crate::redis`], WASI in [`crate::wasi`].

use std::time::{SystemTime, UNIX_EPOCH};

use wasmtime::{Caller, Linker};

use crate::abi::{
    decode_pairs, encode_pairs, status_of, AbiVersion, BufferType, LogLevel, MapType, Status, StreamType,
};
use crate::http_call;
use crate::memory::{copy_out, read, write_u32, write_u64};
use crate::properties;
use crate::shared::{lock, LogSource, MetricKind};
use crate::vm::{Action, BodyView, LocalReplySpec, VmState};

type Call<'a> = Caller<'a, VmState>;
type Answer = wasmtime::Result<u32>;

/// Hostcalls allowed while the VM starts (`_initialize`/`main`): cpp-host `WasmBase::startVm`.
const ALLOWED_WHILE_STARTING: &[&str] = &["proxy_log"];

/// Traps like Envoy's V8 integration (`restricted_callback`) when a hostcall runs during VM start.
pub fn check_allowed(caller: &Call<'_>, name: &str) -> wasmtime::Result<()> {
    if caller.data().starting && !ALLOWED_WHILE_STARTING.contains(&name) {
        return Err(wasmtime::Error::msg(format!(
            "restricted_callback: {name} cannot be called while the VM starts (_initialize/main)"
        )));
    }
    Ok(())
}

fn ok(status: Status) -> Answer {
    Ok(status.code())
}

/// Runs a hostcall body that may trap (allocation) and answers with its status.
fn answer(result: Result<Result<(), Status>, wasmtime::Error>) -> Answer {
    result.map(status_of)
}

/// Adds every `env` hostcall of proxy-wasm ABI 0.2.x (those Envoy registers for the module's ABI).
pub fn link(linker: &mut Linker<VmState>, abi: AbiVersion) -> wasmtime::Result<()> {
    linker.func_wrap("env", "proxy_log", |mut c: Call<'_>, level: u32, ptr: u32, size: u32| {
        check_allowed(&c, "proxy_log")?;
        let Some(level) = LogLevel::from_u32(level) else { return ok(Status::BadArgument) };
        match read(&mut c, ptr, size) {
            Ok(message) => {
                c.data().log(level, LogSource::ProxyLog, String::from_utf8_lossy(&message).into_owned());
                ok(Status::Ok)
            }
            Err(status) => ok(status),
        }
    })?;
    if abi != AbiVersion::V0_2_0 {
        linker.func_wrap("env", "proxy_get_log_level", |mut c: Call<'_>, ptr: u32| {
            check_allowed(&c, "proxy_get_log_level")?;
            let level = c.data().shared.log_level.code();
            Ok(status_of(write_u32(&mut c, ptr, level)))
        })?;
    }
    linker.func_wrap("env", "proxy_get_current_time_nanoseconds", |mut c: Call<'_>, ptr: u32| {
        check_allowed(&c, "proxy_get_current_time_nanoseconds")?;
        Ok(status_of(write_u64(&mut c, ptr, now_ns())))
    })?;
    linker.func_wrap("env", "proxy_set_tick_period_milliseconds", |mut c: Call<'_>, period: u32| {
        check_allowed(&c, "proxy_set_tick_period_milliseconds")?;
        let state = c.data_mut();
        state.tick_period = (period > 0).then(|| std::time::Duration::from_millis(u64::from(period)));
        state.tick_changed = true;
        ok(Status::Ok)
    })?;
    link_buffers(linker)?;
    link_maps(linker)?;
    link_stream(linker)?;
    link_shared(linker)?;
    link_metrics(linker)?;
    link_calls(linker)?;
    Ok(())
}

fn now_ns() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)).unwrap_or(0)
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

fn link_buffers(linker: &mut Linker<VmState>) -> wasmtime::Result<()> {
    linker.func_wrap(
        "env",
        "proxy_get_buffer_bytes",
        |mut c: Call<'_>, kind: u32, start: u32, length: u32, ptr_ptr: u32, size_ptr: u32| {
            check_allowed(&c, "proxy_get_buffer_bytes")?;
            let Some(kind) = BufferType::from_u32(kind) else { return ok(Status::BadArgument) };
            let bytes = match buffer(c.data(), kind) {
                Ok(bytes) => bytes,
                Err(status) => return ok(status),
            };
            // Envoy: clip to the buffer; nothing to copy stores 0/0 and answers Ok.
            let start = usize::try_from(start).unwrap_or(usize::MAX);
            let length = usize::try_from(length).unwrap_or(usize::MAX);
            let slice = if start > bytes.len() {
                &[][..]
            } else {
                let end = start.saturating_add(length).min(bytes.len());
                bytes.get(start..end).unwrap_or_default()
            };
            answer(copy_out(&mut c, slice, ptr_ptr, size_ptr))
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_get_buffer_status",
        |mut c: Call<'_>, kind: u32, length_ptr: u32, flags_ptr: u32| {
            check_allowed(&c, "proxy_get_buffer_status")?;
            let Some(kind) = BufferType::from_u32(kind) else { return ok(Status::BadArgument) };
            let length = match buffer(c.data(), kind) {
                Ok(bytes) => u32::try_from(bytes.len()).unwrap_or(u32::MAX),
                Err(status) => return ok(status),
            };
            if let Err(status) = write_u32(&mut c, length_ptr, length) {
                return ok(status);
            }
            Ok(status_of(write_u32(&mut c, flags_ptr, 0)))
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_set_buffer_bytes",
        |mut c: Call<'_>, kind: u32, start: u32, length: u32, data_ptr: u32, data_size: u32| {
            check_allowed(&c, "proxy_set_buffer_bytes")?;
            let Some(kind) = BufferType::from_u32(kind) else { return ok(Status::BadArgument) };
            if let Err(status) = buffer(c.data(), kind) {
                return ok(status);
            }
            let data = match read(&mut c, data_ptr, data_size) {
                Ok(data) => data,
                Err(status) => return ok(status),
            };
            let Some(stream) = c.data_mut().stream_mut() else { return ok(Status::BadArgument) };
            let body = match (kind, stream.body_view) {
                (BufferType::HttpRequestBody, Some(BodyView::Request)) => &mut stream.request_body,
                (BufferType::HttpResponseBody, Some(BodyView::Response)) => &mut stream.response_body,
                _ => return ok(Status::BadArgument),
            };
            ok(replace_range(body, start, length, &data))
        },
    )?;
    Ok(())
}

/// Envoy `Buffer::copyFrom`: prepend (start 0, length 0), replace all (start 0, length >= size), append
/// (start >= size); anything else is BadArgument.
fn replace_range(body: &mut Vec<u8>, start: u32, length: u32, data: &[u8]) -> Status {
    let start = usize::try_from(start).unwrap_or(usize::MAX);
    let length = usize::try_from(length).unwrap_or(usize::MAX);
    if start == 0 {
        if length == 0 {
            let mut joined = data.to_vec();
            joined.extend_from_slice(body);
            *body = joined;
            Status::Ok
        } else if length >= body.len() {
            *body = data.to_vec();
            Status::Ok
        } else {
            Status::BadArgument
        }
    } else if start >= body.len() {
        body.extend_from_slice(data);
        Status::Ok
    } else {
        Status::BadArgument
    }
}

fn lowercase(key: &[u8]) -> Vec<u8> {
    key.to_ascii_lowercase()
}

fn link_maps(linker: &mut Linker<VmState>) -> wasmtime::Result<()> {
    linker.func_wrap(
        "env",
        "proxy_get_header_map_pairs",
        |mut c: Call<'_>, kind: u32, ptr_ptr: u32, size_ptr: u32| {
            check_allowed(&c, "proxy_get_header_map_pairs")?;
            let Some(kind) = MapType::from_u32(kind) else { return ok(Status::BadArgument) };
            // Envoy answers Ok with no pairs for a map it does not have now.
            let pairs = c.data().readable_map(kind).cloned().unwrap_or_default();
            let bytes = if pairs.is_empty() { Vec::new() } else { encode_pairs(&pairs) };
            answer(copy_out(&mut c, &bytes, ptr_ptr, size_ptr))
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_get_header_map_value",
        |mut c: Call<'_>, kind: u32, key_ptr: u32, key_size: u32, ptr_ptr: u32, size_ptr: u32| {
            check_allowed(&c, "proxy_get_header_map_value")?;
            let Some(kind) = MapType::from_u32(kind) else { return ok(Status::BadArgument) };
            let key = match read(&mut c, key_ptr, key_size) {
                Ok(key) => lowercase(&key),
                Err(status) => return ok(status),
            };
            let value = match c.data().readable_map(kind) {
                Ok(map) => match map.iter().find(|(k, _)| *k == key) {
                    Some((_, v)) => v.clone(),
                    None => return ok(Status::NotFound),
                },
                Err(true) => return ok(Status::BadArgument),
                Err(false) => return ok(Status::NotFound),
            };
            answer(copy_out(&mut c, &value, ptr_ptr, size_ptr))
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_add_header_map_value",
        |mut c: Call<'_>, kind: u32, key_ptr: u32, key_size: u32, value_ptr: u32, value_size: u32| {
            check_allowed(&c, "proxy_add_header_map_value")?;
            edit_map(&mut c, kind, key_ptr, key_size, Some((value_ptr, value_size)), |map, key, value| {
                map.push((key, value));
            })
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_replace_header_map_value",
        |mut c: Call<'_>, kind: u32, key_ptr: u32, key_size: u32, value_ptr: u32, value_size: u32| {
            check_allowed(&c, "proxy_replace_header_map_value")?;
            // Envoy `HeaderMap::setCopy`: every entry of the name is removed and one is appended.
            edit_map(&mut c, kind, key_ptr, key_size, Some((value_ptr, value_size)), |map, key, value| {
                map.retain(|(k, _)| *k != key);
                map.push((key, value));
            })
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_remove_header_map_value",
        |mut c: Call<'_>, kind: u32, key_ptr: u32, key_size: u32| {
            check_allowed(&c, "proxy_remove_header_map_value")?;
            edit_map(&mut c, kind, key_ptr, key_size, None, |map, key, _| map.retain(|(k, _)| *k != key))
        },
    )?;
    linker.func_wrap("env", "proxy_set_header_map_pairs", |mut c: Call<'_>, kind: u32, ptr: u32, size: u32| {
        check_allowed(&c, "proxy_set_header_map_pairs")?;
        let Some(kind) = MapType::from_u32(kind) else { return ok(Status::BadArgument) };
        let data = match read(&mut c, ptr, size) {
            Ok(data) => data,
            Err(status) => return ok(status),
        };
        let Some(map) = c.data_mut().writable_map(kind) else { return ok(Status::BadArgument) };
        *map = decode_pairs(&data).into_iter().map(|(k, v)| (lowercase(&k), v)).collect();
        ok(Status::Ok)
    })?;
    linker.func_wrap("env", "proxy_get_header_map_size", |mut c: Call<'_>, kind: u32, result_ptr: u32| {
        check_allowed(&c, "proxy_get_header_map_size")?;
        let Some(kind) = MapType::from_u32(kind) else { return ok(Status::BadArgument) };
        let Some(map) = c.data_mut().writable_map(kind) else { return ok(Status::BadArgument) };
        let size: usize = map.iter().map(|(k, v)| k.len() + v.len()).sum();
        Ok(status_of(write_u32(&mut c, result_ptr, u32::try_from(size).unwrap_or(u32::MAX))))
    })?;
    linker.func_wrap(
        "env",
        "proxy_get_property",
        |mut c: Call<'_>, path_ptr: u32, path_size: u32, ptr_ptr: u32, size_ptr: u32| {
            check_allowed(&c, "proxy_get_property")?;
            let path = match read(&mut c, path_ptr, path_size) {
                Ok(path) => path,
                Err(status) => return ok(status),
            };
            match properties::lookup(c.data(), &path) {
                Ok(value) => answer(copy_out(&mut c, &value, ptr_ptr, size_ptr)),
                Err(status) => ok(status),
            }
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_set_property",
        |mut c: Call<'_>, path_ptr: u32, path_size: u32, value_ptr: u32, value_size: u32| {
            check_allowed(&c, "proxy_set_property")?;
            let (path, value) = match (read(&mut c, path_ptr, path_size), read(&mut c, value_ptr, value_size)) {
                (Ok(path), Ok(value)) => (path, value),
                _ => return ok(Status::InvalidMemoryAccess),
            };
            // Envoy: filter state `wasm.<path>` of the stream; no stream, no state.
            let Some(stream) = c.data_mut().stream_mut() else { return ok(Status::NotFound) };
            let key = path.strip_suffix(b"\0").unwrap_or(&path).to_vec();
            stream.info.filter_state.insert(key, value);
            ok(Status::Ok)
        },
    )?;
    Ok(())
}

/// Reads key (and value) and edits a writable map; BadArgument if the map is not writable now.
fn edit_map(
    c: &mut Call<'_>,
    kind: u32,
    key_ptr: u32,
    key_size: u32,
    value: Option<(u32, u32)>,
    edit: impl FnOnce(&mut Vec<(Vec<u8>, Vec<u8>)>, Vec<u8>, Vec<u8>),
) -> Answer {
    let Some(kind) = MapType::from_u32(kind) else { return ok(Status::BadArgument) };
    let key = match read(c, key_ptr, key_size) {
        Ok(key) => lowercase(&key),
        Err(status) => return ok(status),
    };
    let value = match value {
        Some((ptr, size)) => match read(c, ptr, size) {
            Ok(value) => value,
            Err(status) => return ok(status),
        },
        None => Vec::new(),
    };
    let Some(map) = c.data_mut().writable_map(kind) else { return ok(Status::BadArgument) };
    edit(map, key, value);
    ok(Status::Ok)
}

fn link_stream(linker: &mut Linker<VmState>) -> wasmtime::Result<()> {
    linker.func_wrap("env", "proxy_continue_stream", |mut c: Call<'_>, kind: u32| {
        check_allowed(&c, "proxy_continue_stream")?;
        let Some(kind) = StreamType::from_u32(kind) else { return ok(Status::BadArgument) };
        match kind {
            StreamType::Request | StreamType::Response => {
                let state = c.data_mut();
                let context = state.context_id();
                if let Some(stream) = state.stream_mut() {
                    // Envoy `Context::continueStream`: the request headers are dropped at once.
                    stream.request_headers_open = false;
                    state.actions.push(Action::Continue { context, stream: kind });
                }
                ok(Status::Ok)
            }
            StreamType::Downstream => ok(Status::Ok),
            StreamType::Upstream => ok(Status::Unimplemented),
        }
    })?;
    linker.func_wrap("env", "proxy_close_stream", |mut c: Call<'_>, kind: u32| {
        check_allowed(&c, "proxy_close_stream")?;
        let Some(kind) = StreamType::from_u32(kind) else { return ok(Status::BadArgument) };
        let state = c.data_mut();
        let context = state.context_id();
        if matches!(kind, StreamType::Request | StreamType::Response) && state.stream().is_some() {
            state.actions.push(Action::Close { context });
        }
        ok(Status::Ok)
    })?;
    linker.func_wrap(
        "env",
        "proxy_send_local_response",
        |mut c: Call<'_>,
         status: u32,
         details_ptr: u32,
         details_size: u32,
         body_ptr: u32,
         body_size: u32,
         headers_ptr: u32,
         headers_size: u32,
         _grpc_status: i32| {
            check_allowed(&c, "proxy_send_local_response")?;
            let (details, body, headers) = match (
                read(&mut c, details_ptr, details_size),
                read(&mut c, body_ptr, body_size),
                read(&mut c, headers_ptr, headers_size),
            ) {
                (Ok(d), Ok(b), Ok(h)) => (d, b, h),
                _ => return ok(Status::InvalidMemoryAccess),
            };
            let state = c.data_mut();
            let context = state.context_id();
            if state.stream().is_some() {
                let reply = LocalReplySpec {
                    status,
                    details: String::from_utf8_lossy(&details).into_owned(),
                    body,
                    headers: decode_pairs(&headers).into_iter().map(|(k, v)| (lowercase(&k), v)).collect(),
                };
                state.actions.push(Action::LocalReply { context, reply });
            }
            // cpp-host: the filter stops, whatever the callback returns.
            state.stop_iteration = true;
            ok(Status::Ok)
        },
    )?;
    linker.func_wrap("env", "proxy_set_effective_context", |mut c: Call<'_>, context: u32| {
        check_allowed(&c, "proxy_set_effective_context")?;
        let state = c.data_mut();
        if state.contexts.contains_key(&context) {
            state.effective = context;
            ok(Status::Ok)
        } else {
            ok(Status::BadArgument)
        }
    })?;
    // cpp-host `WasmBase::done`: only a root context whose `proxy_on_done` answered false may call it; this
    // host never shuts a plugin down, so there is none.
    linker.func_wrap("env", "proxy_done", |c: Call<'_>| {
        check_allowed(&c, "proxy_done")?;
        ok(Status::NotFound)
    })?;
    Ok(())
}

fn link_shared(linker: &mut Linker<VmState>) -> wasmtime::Result<()> {
    linker.func_wrap(
        "env",
        "proxy_get_shared_data",
        |mut c: Call<'_>, key_ptr: u32, key_size: u32, ptr_ptr: u32, size_ptr: u32, cas_ptr: u32| {
            check_allowed(&c, "proxy_get_shared_data")?;
            let key = match read(&mut c, key_ptr, key_size) {
                Ok(key) => key,
                Err(status) => return ok(status),
            };
            let found = lock(&c.data().shared.data).get(&key);
            let (value, cas) = match found {
                Ok(found) => found,
                Err(status) => return ok(status),
            };
            match copy_out(&mut c, &value, ptr_ptr, size_ptr)? {
                Ok(()) => Ok(status_of(write_u32(&mut c, cas_ptr, cas))),
                Err(status) => ok(status),
            }
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_set_shared_data",
        |mut c: Call<'_>, key_ptr: u32, key_size: u32, value_ptr: u32, value_size: u32, cas: u32| {
            check_allowed(&c, "proxy_set_shared_data")?;
            let (key, value) = match (read(&mut c, key_ptr, key_size), read(&mut c, value_ptr, value_size)) {
                (Ok(k), Ok(v)) => (k, v),
                _ => return ok(Status::InvalidMemoryAccess),
            };
            let result = lock(&c.data().shared.data).set(&key, &value, cas);
            Ok(status_of(result))
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_register_shared_queue",
        |mut c: Call<'_>, name_ptr: u32, name_size: u32, token_ptr: u32| {
            check_allowed(&c, "proxy_register_shared_queue")?;
            let name = match read(&mut c, name_ptr, name_size) {
                Ok(name) => name,
                Err(status) => return ok(status),
            };
            let (vm, root) = (c.data().vm, c.data().root_id);
            let token = lock(&c.data().shared.queues).register(&name, vm, root);
            Ok(status_of(write_u32(&mut c, token_ptr, token)))
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_resolve_shared_queue",
        |mut c: Call<'_>, _vm_id_ptr: u32, _vm_id_size: u32, name_ptr: u32, name_size: u32, token_ptr: u32| {
            check_allowed(&c, "proxy_resolve_shared_queue")?;
            let name = match read(&mut c, name_ptr, name_size) {
                Ok(name) => name,
                Err(status) => return ok(status),
            };
            // One vm_id per host: every VM resolves the same queues.
            let found = lock(&c.data().shared.queues).resolve(&name);
            match found {
                Some(token) => Ok(status_of(write_u32(&mut c, token_ptr, token))),
                None => ok(Status::NotFound),
            }
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_dequeue_shared_queue",
        |mut c: Call<'_>, token: u32, ptr_ptr: u32, size_ptr: u32| {
            check_allowed(&c, "proxy_dequeue_shared_queue")?;
            let item = lock(&c.data().shared.queues).dequeue(token);
            match item {
                Ok(item) => answer(copy_out(&mut c, &item, ptr_ptr, size_ptr)),
                Err(status) => ok(status),
            }
        },
    )?;
    linker.func_wrap("env", "proxy_enqueue_shared_queue", |mut c: Call<'_>, token: u32, ptr: u32, size: u32| {
        check_allowed(&c, "proxy_enqueue_shared_queue")?;
        let item = match read(&mut c, ptr, size) {
            Ok(item) => item,
            Err(status) => return ok(status),
        };
        let owner = lock(&c.data().shared.queues).enqueue(token, &item);
        match owner {
            Ok((vm, root)) => {
                let _ = c.data().events.send(crate::vm::Event::QueueReady { vm, root, token });
                ok(Status::Ok)
            }
            Err(status) => ok(status),
        }
    })?;
    Ok(())
}

fn link_metrics(linker: &mut Linker<VmState>) -> wasmtime::Result<()> {
    linker.func_wrap(
        "env",
        "proxy_define_metric",
        |mut c: Call<'_>, kind: u32, name_ptr: u32, name_size: u32, id_ptr: u32| {
            check_allowed(&c, "proxy_define_metric")?;
            let Some(metric_kind) = MetricKind::from_u32(kind) else { return ok(Status::BadArgument) };
            let name = match read(&mut c, name_ptr, name_size) {
                Ok(name) => String::from_utf8_lossy(&name).into_owned(),
                Err(status) => return ok(status),
            };
            lock(&c.data().shared.metrics).define(&name, metric_kind);
            let id = c.data_mut().allocate_metric(kind, name);
            Ok(status_of(write_u32(&mut c, id_ptr, id)))
        },
    )?;
    linker.func_wrap("env", "proxy_increment_metric", |c: Call<'_>, id: u32, offset: i64| {
        check_allowed(&c, "proxy_increment_metric")?;
        // Envoy: the type comes from the id; a histogram id answers BadArgument before any lookup.
        match MetricKind::of_id(id) {
            Some(MetricKind::Counter | MetricKind::Gauge) => {}
            _ => return ok(Status::BadArgument),
        }
        let Some(name) = c.data().metric_ids.get(&id) else { return ok(Status::NotFound) };
        Ok(status_of(lock(&c.data().shared.metrics).increment(name, offset)))
    })?;
    linker.func_wrap("env", "proxy_record_metric", |c: Call<'_>, id: u32, value: u64| {
        check_allowed(&c, "proxy_record_metric")?;
        let Some(name) = c.data().metric_ids.get(&id) else { return ok(Status::NotFound) };
        Ok(status_of(lock(&c.data().shared.metrics).record(name, value)))
    })?;
    linker.func_wrap("env", "proxy_get_metric", |mut c: Call<'_>, id: u32, result_ptr: u32| {
        check_allowed(&c, "proxy_get_metric")?;
        match MetricKind::of_id(id) {
            Some(MetricKind::Counter | MetricKind::Gauge) => {}
            _ => return ok(Status::BadArgument),
        }
        let Some(name) = c.data().metric_ids.get(&id).cloned() else { return ok(Status::NotFound) };
        let value = lock(&c.data().shared.metrics).get(&name);
        match value {
            Ok(value) => Ok(status_of(write_u64(&mut c, result_ptr, value))),
            Err(status) => ok(status),
        }
    })?;
    Ok(())
}

fn link_calls(linker: &mut Linker<VmState>) -> wasmtime::Result<()> {
    linker.func_wrap(
        "env",
        "proxy_http_call",
        |mut c: Call<'_>,
         cluster_ptr: u32,
         cluster_size: u32,
         headers_ptr: u32,
         headers_size: u32,
         body_ptr: u32,
         body_size: u32,
         trailers_ptr: u32,
         trailers_size: u32,
         timeout_ms: u32,
         token_ptr: u32| {
            check_allowed(&c, "proxy_http_call")?;
            let read_all = (
                read(&mut c, cluster_ptr, cluster_size),
                read(&mut c, headers_ptr, headers_size),
                read(&mut c, body_ptr, body_size),
                read(&mut c, trailers_ptr, trailers_size),
            );
            let (Ok(cluster), Ok(headers), Ok(body), Ok(_trailers)) = read_all else {
                return ok(Status::InvalidMemoryAccess);
            };
            // cpp-host writes a 0 token first, to check the pointer before starting anything.
            if let Err(status) = write_u32(&mut c, token_ptr, 0) {
                return ok(status);
            }
            let token = match http_call::start(c.data_mut(), &cluster, decode_pairs(&headers), body, timeout_ms) {
                Ok(token) => token,
                Err(status) => return ok(status),
            };
            Ok(status_of(write_u32(&mut c, token_ptr, token)))
        },
    )?;
    // gRPC: this host has no gRPC services. Envoy answers ParseFailure for a service that is neither a
    // GrpcService proto nor a known cluster; a known cluster is reported and refused here.
    linker.func_wrap(
        "env",
        "proxy_grpc_call",
        |mut c: Call<'_>,
         service_ptr: u32,
         service_size: u32,
         _service_name_ptr: u32,
         _service_name_size: u32,
         _method_ptr: u32,
         _method_size: u32,
         _metadata_ptr: u32,
         _metadata_size: u32,
         _request_ptr: u32,
         _request_size: u32,
         _timeout: u32,
         _token_ptr: u32| {
            check_allowed(&c, "proxy_grpc_call")?;
            Ok(grpc_refused(&mut c, service_ptr, service_size))
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_grpc_stream",
        |mut c: Call<'_>,
         service_ptr: u32,
         service_size: u32,
         _service_name_ptr: u32,
         _service_name_size: u32,
         _method_ptr: u32,
         _method_size: u32,
         _metadata_ptr: u32,
         _metadata_size: u32,
         _token_ptr: u32| {
            check_allowed(&c, "proxy_grpc_stream")?;
            Ok(grpc_refused(&mut c, service_ptr, service_size))
        },
    )?;
    linker.func_wrap("env", "proxy_grpc_cancel", |c: Call<'_>, _token: u32| {
        check_allowed(&c, "proxy_grpc_cancel")?;
        ok(Status::BadArgument)
    })?;
    linker.func_wrap("env", "proxy_grpc_close", |c: Call<'_>, _token: u32| {
        check_allowed(&c, "proxy_grpc_close")?;
        ok(Status::BadArgument)
    })?;
    linker.func_wrap("env", "proxy_grpc_send", |c: Call<'_>, _token: u32, _ptr: u32, _size: u32, _end: u32| {
        check_allowed(&c, "proxy_grpc_send")?;
        ok(Status::BadArgument)
    })?;
    // The status of the last gRPC/HTTP failure on the root context: this host reports HTTP call failures as
    // synthesized responses (as Envoy does for timeouts and connect failures), so it is always 0 / "".
    linker.func_wrap("env", "proxy_get_status", |mut c: Call<'_>, code_ptr: u32, ptr_ptr: u32, size_ptr: u32| {
        check_allowed(&c, "proxy_get_status")?;
        if let Err(status) = write_u32(&mut c, code_ptr, 0) {
            return ok(status);
        }
        answer(copy_out(&mut c, &[], ptr_ptr, size_ptr))
    })?;
    // Envoy registers a few foreign functions (compression, signatures, filter state); none is emulated.
    linker.func_wrap(
        "env",
        "proxy_call_foreign_function",
        |mut c: Call<'_>,
         name_ptr: u32,
         name_size: u32,
         _args_ptr: u32,
         _args_size: u32,
         _results_ptr: u32,
         _results_size: u32| {
            check_allowed(&c, "proxy_call_foreign_function")?;
            if let Ok(name) = read(&mut c, name_ptr, name_size) {
                c.data().log(
                    LogLevel::Warn,
                    LogSource::Host,
                    format!(
                        "proxy_call_foreign_function({:?}): no foreign functions in this host",
                        String::from_utf8_lossy(&name)
                    ),
                );
            }
            ok(Status::NotFound)
        },
    )?;
    // Emscripten and pthread helpers Envoy registers in `env`.
    linker
        .func_wrap("env", "pthread_equal", |_c: Call<'_>, left: u32, right: u32| -> u32 { u32::from(left == right) })?;
    linker.func_wrap("env", "emscripten_notify_memory_growth", |_c: Call<'_>, _index: u32| {})?;
    Ok(())
}

fn grpc_refused(c: &mut Call<'_>, service_ptr: u32, service_size: u32) -> u32 {
    let service = match read(c, service_ptr, service_size) {
        Ok(service) => String::from_utf8_lossy(&service).into_owned(),
        Err(status) => return status.code(),
    };
    if c.data().setup.clusters.contains_key(&service) {
        c.data().log(
            LogLevel::Warn,
            LogSource::Host,
            format!("gRPC call to cluster {service:?}: gRPC is not emulated; answered InternalFailure"),
        );
        Status::InternalFailure.code()
    } else {
        Status::ParseFailure.code()
    }
}
