//! hostcall-probe: a proxy-wasm module that logs, one `probe:` line per fact, what its host does: context
//! ids, the order of callbacks, raw hostcall statuses, header maps, properties, HTTP call responses, local
//! replies. Run the same module in real Envoy and in the emulator and compare the lines (the emulator's
//! tests do; `probe/README.md` says how to run it in Envoy).
//!
//! What a request does is chosen by its `:path`:
//! - `/local` and `/local-pause`: a local reply (418) from `on_request_headers`, returning Continue / Pause;
//! - `/callout/<cluster>/<timeout_ms>[/reply]`: pause, call the cluster, then resume (or answer 418);
//! - `/callout-bad/<what>`: an HTTP call that Envoy refuses (`no-authority`, `unknown-cluster`);
//! - anything else: continue.
//!
//! The plugin configuration `"refuse"` makes `on_configure` return false.

use std::ptr::{null, null_mut};

use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, BufferType, ContextType, LogLevel, MapType};

// The raw imports, so the probe sees every status (the SDK's wrappers panic on unexpected ones).
#[link(wasm_import_module = "env")]
extern "C" {
    fn proxy_get_buffer_bytes(
        buffer_type: u32,
        start: usize,
        max_size: usize,
        return_buffer_data: *mut *mut u8,
        return_buffer_size: *mut usize,
    ) -> u32;
    fn proxy_get_header_map_value(
        map_type: u32,
        key_data: *const u8,
        key_size: usize,
        return_value_data: *mut *mut u8,
        return_value_size: *mut usize,
    ) -> u32;
    fn proxy_get_shared_data(
        key_data: *const u8,
        key_size: usize,
        return_value_data: *mut *mut u8,
        return_value_size: *mut usize,
        return_cas: *mut u32,
    ) -> u32;
    fn proxy_set_shared_data(
        key_data: *const u8,
        key_size: usize,
        value_data: *const u8,
        value_size: usize,
        cas: u32,
    ) -> u32;
    fn proxy_define_metric(metric_type: u32, name_data: *const u8, name_size: usize, return_id: *mut u32) -> u32;
    fn proxy_increment_metric(metric_id: u32, offset: i64) -> u32;
    fn proxy_record_metric(metric_id: u32, value: u64) -> u32;
    fn proxy_get_metric(metric_id: u32, return_value: *mut u64) -> u32;
    fn proxy_get_property(
        path_data: *const u8,
        path_size: usize,
        return_value_data: *mut *mut u8,
        return_value_size: *mut usize,
    ) -> u32;
    fn proxy_http_call(
        upstream_data: *const u8,
        upstream_size: usize,
        headers_data: *const u8,
        headers_size: usize,
        body_data: *const u8,
        body_size: usize,
        trailers_data: *const u8,
        trailers_size: usize,
        timeout: u32,
        return_token: *mut u32,
    ) -> u32;
    fn proxy_get_log_level(return_level: *mut u32) -> u32;
    fn proxy_set_effective_context(context_id: u32) -> u32;
}

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Trace);
    proxy_wasm::set_root_context(|context_id| -> Box<dyn RootContext> {
        say(&format!("new_root ctx={context_id}"));
        Box::new(Root { id: context_id, ticks: 0 })
    });
}}

fn say(message: &str) {
    let _ = hostcalls::log(LogLevel::Info, &format!("probe: {message}"));
}

/// Bytes as text: printable ASCII kept, everything else `\xNN`.
fn show(bytes: &[u8]) -> String {
    let mut out = String::new();
    for &b in bytes {
        if (0x20..0x7f).contains(&b) && b != b'\\' {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("\\x{b:02x}"));
        }
    }
    out
}

/// Takes ownership of a host allocation (the SDK's allocator is the global one).
unsafe fn take(data: *mut u8, size: usize) -> Option<Vec<u8>> {
    if data.is_null() {
        None
    } else {
        Some(Vec::from_raw_parts(data, size, size))
    }
}

fn raw_buffer(buffer_type: u32) -> String {
    let mut data = null_mut();
    let mut size = 0;
    let status = unsafe { proxy_get_buffer_bytes(buffer_type, 0, usize::MAX, &mut data, &mut size) };
    let bytes = unsafe { take(data, size) };
    match bytes {
        Some(b) => format!("status={status} bytes={}", show(&b)),
        None => format!("status={status} none size={size}"),
    }
}

fn raw_header(map_type: u32, key: &str) -> String {
    let mut data = null_mut();
    let mut size = 0;
    let status = unsafe { proxy_get_header_map_value(map_type, key.as_ptr(), key.len(), &mut data, &mut size) };
    match unsafe { take(data, size) } {
        Some(b) => format!("status={status} value={}", show(&b)),
        None => format!("status={status} none"),
    }
}

fn raw_property(path: &[&str]) -> String {
    let mut serialized = Vec::new();
    for part in path {
        serialized.extend_from_slice(part.as_bytes());
        serialized.push(0);
    }
    let mut data = null_mut();
    let mut size = 0;
    let status = unsafe { proxy_get_property(serialized.as_ptr(), serialized.len(), &mut data, &mut size) };
    match unsafe { take(data, size) } {
        Some(b) => format!("status={status} value={}", show(&b)),
        None => format!("status={status} none"),
    }
}

fn raw_get_shared(key: &str) -> (u32, Option<Vec<u8>>, u32) {
    let mut data = null_mut();
    let mut size = 0;
    let mut cas = 0;
    let status = unsafe { proxy_get_shared_data(key.as_ptr(), key.len(), &mut data, &mut size, &mut cas) };
    (status, unsafe { take(data, size) }, cas)
}

fn raw_set_shared(key: &str, value: &str, cas: u32) -> u32 {
    unsafe { proxy_set_shared_data(key.as_ptr(), key.len(), value.as_ptr(), value.len(), cas) }
}

fn serialize_pairs(pairs: &[(&str, &str)]) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(&(pairs.len() as u32).to_le_bytes());
    for (k, v) in pairs {
        out.extend_from_slice(&(k.len() as u32).to_le_bytes());
        out.extend_from_slice(&(v.len() as u32).to_le_bytes());
    }
    for (k, v) in pairs {
        out.extend_from_slice(k.as_bytes());
        out.push(0);
        out.extend_from_slice(v.as_bytes());
        out.push(0);
    }
    out
}

fn raw_http_call(cluster: &str, headers: &[(&str, &str)], timeout_ms: u32) -> (u32, u32) {
    let headers = serialize_pairs(headers);
    let mut token = 0;
    let status = unsafe {
        proxy_http_call(
            cluster.as_ptr(),
            cluster.len(),
            headers.as_ptr(),
            headers.len(),
            null(),
            0,
            null(),
            0,
            timeout_ms,
            &mut token,
        )
    };
    (status, token)
}

fn log_pairs(what: &str, map: MapType) {
    match hostcalls::get_map_bytes(map) {
        Ok(pairs) => {
            let shown: Vec<String> = pairs.iter().map(|(k, v)| format!("{}={}", k, show(v))).collect();
            say(&format!("{what} n={} [{}]", pairs.len(), shown.join(" | ")));
        }
        Err(status) => say(&format!("{what} error={status:?}")),
    }
}

struct Root {
    id: u32,
    ticks: u32,
}

impl Context for Root {}

impl RootContext for Root {
    fn on_vm_start(&mut self, vm_configuration_size: usize) -> bool {
        say(&format!("vm_start ctx={} vm_configuration_size={vm_configuration_size}", self.id));
        say(&format!("vm_start vm_configuration {}", raw_buffer(6)));
        say(&format!("vm_start plugin_configuration {}", raw_buffer(7)));
        true
    }

    fn on_configure(&mut self, plugin_configuration_size: usize) -> bool {
        say(&format!("configure ctx={} size={plugin_configuration_size}", self.id));
        say(&format!("configure plugin_configuration {}", raw_buffer(7)));
        let mut level = 99;
        let status = unsafe { proxy_get_log_level(&mut level) };
        say(&format!("log_level status={status} level={level}"));
        for path in [
            &["plugin_name"][..],
            &["plugin_root_id"],
            &["plugin_vm_id"],
            &["source", "address"],
            &["route_name"],
            &["request", "path"],
            &["no_such_property"],
        ] {
            say(&format!("root property {} {}", path.join("."), raw_property(path)));
        }

        // Shared data: a key of this configure call only (several VMs configure).
        let now = hostcalls::get_current_time()
            .ok()
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        let key = format!("probe.{now}");
        let (status, value, cas) = raw_get_shared(&key);
        say(&format!("shared get_missing status={status} value={:?} cas={cas}", value.map(|v| show(&v))));
        say(&format!("shared set_new_with_cas_7 status={}", raw_set_shared(&key, "a", 7)));
        let (status, value, cas1) = raw_get_shared(&key);
        say(&format!("shared get status={status} value={:?} cas_nonzero={}", value.map(|v| show(&v)), cas1 != 0));
        say(&format!("shared set_cas_0 status={}", raw_set_shared(&key, "b", 0)));
        let (_, _, cas2) = raw_get_shared(&key);
        say(&format!("shared cas_changed_after_set={}", cas2 != cas1));
        say(&format!("shared set_stale_cas status={}", raw_set_shared(&key, "c", cas1)));
        say(&format!("shared set_current_cas status={}", raw_set_shared(&key, "d", cas2)));
        let (_, value, _) = raw_get_shared(&key);
        say(&format!("shared final value={:?}", value.map(|v| show(&v))));

        // Metrics.
        let mut ids = [0u32; 3];
        for (i, (kind, name)) in
            [(0u32, "probe.counter"), (1, "probe.gauge"), (2, "probe.histogram")].iter().enumerate()
        {
            let mut id = 0;
            let status = unsafe { proxy_define_metric(*kind, name.as_ptr(), name.len(), &mut id) };
            say(&format!("metric define type={kind} status={status} id_low_bits={}", id & 3));
            if let Some(slot) = ids.get_mut(i) {
                *slot = id;
            }
        }
        let mut bad = 0;
        let status = unsafe { proxy_define_metric(3, "x".as_ptr(), 1, &mut bad) };
        say(&format!("metric define type=3 status={status}"));
        let [counter, gauge, histogram] = ids;
        unsafe {
            say(&format!("metric counter +0 status={}", proxy_increment_metric(counter, 0)));
            say(&format!("metric counter -1 status={}", proxy_increment_metric(counter, -1)));
            say(&format!("metric counter +2 status={}", proxy_increment_metric(counter, 2)));
            say(&format!("metric counter record 5 status={}", proxy_record_metric(counter, 5)));
            say(&format!("metric gauge record 10 status={}", proxy_record_metric(gauge, 10)));
            say(&format!("metric gauge -3 status={}", proxy_increment_metric(gauge, -3)));
            say(&format!("metric histogram record 7 status={}", proxy_record_metric(histogram, 7)));
            say(&format!("metric histogram +1 status={}", proxy_increment_metric(histogram, 1)));
            let mut v = 0u64;
            let s = proxy_get_metric(gauge, &mut v);
            say(&format!("metric gauge get status={s} value={v}"));
            let s = proxy_get_metric(histogram, &mut v);
            say(&format!("metric histogram get status={s}"));
            let s = proxy_get_metric(counter + 400, &mut v);
            say(&format!("metric unknown_counter get status={s}"));
            say(&format!("effective_context unknown status={}", proxy_set_effective_context(9999)));
        }
        let _ = hostcalls::set_tick_period(std::time::Duration::from_millis(100));
        let refuse = matches!(hostcalls::get_buffer(BufferType::PluginConfiguration, 0, usize::MAX), Ok(Some(b)) if b == b"refuse");
        !refuse
    }

    fn on_tick(&mut self) {
        self.ticks += 1;
        if self.ticks == 1 {
            say(&format!("tick ctx={}", self.id));
            say(&format!("tick plugin_configuration {}", raw_buffer(7)));
            let _ = hostcalls::set_tick_period(std::time::Duration::from_millis(0));
        }
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        say(&format!("create_http ctx={context_id} root={}", self.id));
        Some(Box::new(Stream { id: context_id, path: String::new() }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

struct Stream {
    id: u32,
    path: String,
}

impl Stream {
    fn local_reply(&self, status: u32) {
        let result = hostcalls::send_http_response(
            status,
            vec![("x-probe", "local"), ("content-type", "text/plain")],
            Some(b"nope\n"),
        );
        say(&format!("local_reply ctx={} status={status} result={result:?}", self.id));
        say(&format!("after local_reply request :path {}", raw_header(0, ":path")));
    }
}

impl Context for Stream {
    fn on_done(&mut self) -> bool {
        say(&format!("done ctx={}", self.id));
        true
    }

    fn on_http_call_response(&mut self, token: u32, num_headers: usize, body_size: usize, num_trailers: usize) {
        say(&format!(
            "call_response ctx={} token_nonzero={} headers={num_headers} body={body_size} trailers={num_trailers}",
            self.id,
            token != 0
        ));
        log_pairs("call_response headers", MapType::HttpCallResponseHeaders);
        say(&format!("call_response body {}", raw_buffer(4)));
        say(&format!("call_response request :path {}", raw_header(0, ":path")));
        if self.path.ends_with("/reply") {
            self.local_reply(418);
        } else {
            let result = hostcalls::resume_http_request();
            say(&format!("resume ctx={} result={result:?}", self.id));
            say(&format!("after resume request :path {}", raw_header(0, ":path")));
        }
    }
}

impl HttpContext for Stream {
    fn on_http_request_headers(&mut self, num_headers: usize, end_of_stream: bool) -> Action {
        say(&format!("request_headers ctx={} num={num_headers} eos={end_of_stream}", self.id));
        log_pairs("request headers", MapType::HttpRequestHeaders);
        for path in [
            &["source", "address"][..],
            &["source", "port"],
            &["destination", "address"],
            &["route_name"],
            &["plugin_name"],
            &["plugin_root_id"],
            &["request", "path"],
            &["request", "url_path"],
            &["request", "host"],
            &["request", "method"],
            &["request", "scheme"],
            &["request", "protocol"],
            &["request", "id"],
            &["request", "headers", "x-user-id"],
            &["response", "code"],
            &["connection_id"],
            &["upstream", "address"],
            &["xds", "route_name"],
            &["xds", "cluster_name"],
        ] {
            say(&format!("property {} {}", path.join("."), raw_property(path)));
        }
        say(&format!("request missing header {}", raw_header(0, "x-missing")));
        say(&format!("request response-map header {}", raw_header(2, ":status")));
        say(&format!("request call-response-map header {}", raw_header(6, ":status")));
        say(&format!("request plugin_configuration {}", raw_buffer(7)));
        say(&format!("request call body {}", raw_buffer(4)));
        say(&format!("request body buffer {}", raw_buffer(0)));

        self.path = hostcalls::get_map_value(MapType::HttpRequestHeaders, ":path").ok().flatten().unwrap_or_default();
        let parts: Vec<&str> = self.path.split('/').collect();
        match parts.as_slice() {
            ["", "local"] => {
                self.local_reply(418);
                Action::Continue
            }
            ["", "local-bare"] => {
                let result = hostcalls::send_http_response(403, vec![], Some(b"denied"));
                say(&format!("local_reply ctx={} status=403 result={result:?}", self.id));
                Action::Pause
            }
            ["", "local-empty"] => {
                let result = hostcalls::send_http_response(204, vec![], None);
                say(&format!("local_reply ctx={} status=204 result={result:?}", self.id));
                Action::Pause
            }
            ["", "trap"] => {
                say(&format!("trapping ctx={}", self.id));
                core::arch::wasm32::unreachable()
            }
            ["", "local-pause"] => {
                self.local_reply(418);
                Action::Pause
            }
            ["", "callout", cluster, timeout, ..] => {
                let timeout = timeout.parse().unwrap_or(1000);
                // Through the SDK: its dispatcher routes the callback by token.
                let result = self.dispatch_http_call(
                    cluster,
                    vec![(":method", "GET"), (":path", "/probe-callout"), (":authority", "probe"), ("x-probe", "1")],
                    None,
                    vec![],
                    std::time::Duration::from_millis(timeout),
                );
                say(&format!("http_call cluster={cluster} ok={}", result.is_ok()));
                if result.is_err() {
                    return Action::Continue;
                }
                Action::Pause
            }
            ["", "callout-bad", what] => {
                let (cluster, headers): (&str, &[(&str, &str)]) = match *what {
                    "no-authority" => ("upstream", &[(":method", "GET"), (":path", "/")]),
                    _ => ("no-such-cluster", &[(":method", "GET"), (":path", "/"), (":authority", "x")]),
                };
                let (status, _) = raw_http_call(cluster, headers, 1000);
                say(&format!("http_call bad={what} status={status}"));
                Action::Continue
            }
            _ => Action::Continue,
        }
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        say(&format!("request_body ctx={} size={body_size} eos={end_of_stream} {}", self.id, raw_buffer(0)));
        Action::Continue
    }

    fn on_http_response_headers(&mut self, num_headers: usize, end_of_stream: bool) -> Action {
        say(&format!("response_headers ctx={} num={num_headers} eos={end_of_stream}", self.id));
        log_pairs("response headers", MapType::HttpResponseHeaders);
        say(&format!("response request :path {}", raw_header(0, ":path")));
        let _ = hostcalls::add_map_value(MapType::HttpResponseHeaders, "x-probe-response", "1");
        Action::Continue
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        say(&format!("response_body ctx={} size={body_size} eos={end_of_stream} {}", self.id, raw_buffer(1)));
        Action::Continue
    }

    fn on_log(&mut self) {
        say(&format!("log ctx={}", self.id));
        say(&format!("log request :path {}", raw_header(0, ":path")));
        say(&format!("log response :status {}", raw_header(2, ":status")));
        say(&format!("log property response.code {}", raw_property(&["response", "code"])));
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        // The SDK drops the context in proxy_on_delete.
        say(&format!("delete ctx={}", self.id));
    }
}
