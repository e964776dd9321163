//! The proxy-wasm glue: the root context (configuration, per-VM state, metrics) and the HTTP context
//! (pause the request, send one acquire per rule, resume or answer). Every decision is made by
//! [`crate::limiter`]; this module only moves bytes between it and the host.

use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::time::UNIX_EPOCH;

use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, BufferType, ContextType, LogLevel, MetricType};

use crate::cache::LimiterCache;
use crate::config::{FailureMode, Plugin, PluginConfig, TransportKind};
use crate::key::RequestView;
use crate::limiter::{self, Decision, Failure, Outcome, PendingRequest, Progress, Start, Verdict};
use crate::resp::Command;
use crate::script::MEMBER_RANDOM_LEN;
use crate::transport::{HttpBridge, RedisTransport};

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(Root::default()) });
}}

/// Prefix of every log line and metric name.
const NAME: &str = "edge_rate_limiter";
/// Shared-data key of this gateway process's Redisson client id (shared by all VMs of the process).
const CLIENT_ID_KEY: &str = "edge_rate_limiter.client_id";

fn log(level: LogLevel, message: &str) {
    let _ = hostcalls::log(level, &format!("edge-rate-limiter: {message}"));
}

/// Counters, by the names in README.md ("Metrics"). A counter the host refused to define is skipped.
#[derive(Default)]
struct Metrics {
    allowed: Option<u32>,
    rejected: Option<u32>,
    failure_allowed: Option<u32>,
    failure_denied: Option<u32>,
    redis_calls: Option<u32>,
    redis_errors: Option<u32>,
}

impl Metrics {
    fn define() -> Self {
        let counter = |name: &str| hostcalls::define_metric(MetricType::Counter, &format!("{NAME}.{name}")).ok();
        Metrics {
            allowed: counter("allowed"),
            rejected: counter("rejected"),
            failure_allowed: counter("failure_allowed"),
            failure_denied: counter("failure_denied"),
            redis_calls: counter("redis_calls"),
            redis_errors: counter("redis_errors"),
        }
    }

    fn add(id: Option<u32>, amount: usize) {
        if let (Some(id), Ok(amount)) = (id, i64::try_from(amount)) {
            if amount > 0 {
                let _ = hostcalls::increment_metric(id, amount);
            }
        }
    }
}

/// Logs each cause of failure once, until Redis answers again (then says so, once).
#[derive(Default)]
struct FailureLog {
    logged: [bool; Failure::CAUSES],
}

impl FailureLog {
    fn failed(&mut self, failure: &Failure, mode: FailureMode) {
        if let Some(logged) = self.logged.get_mut(failure.cause_index()) {
            if !*logged {
                *logged = true;
                let action = match mode {
                    FailureMode::Allow => "failing open",
                    FailureMode::Deny => "failing closed",
                };
                log(
                    LogLevel::Warn,
                    &format!("{failure}; {action}; further failures of this kind are counted in {NAME}.redis_errors until Redis answers again"),
                );
            }
        }
    }

    fn recovered(&mut self) {
        if self.logged.iter().any(|&l| l) {
            self.logged = Default::default();
            log(LogLevel::Info, "Redis answers again");
        }
    }
}

/// State of one VM, shared by its root context and every HTTP context it creates.
struct Vm {
    plugin: Plugin,
    /// One transport per configuration, by the index of `Plugin::configs`.
    transports: Vec<(usize, Box<dyn RedisTransport>)>,
    cache: RefCell<LimiterCache>,
    failure_log: RefCell<FailureLog>,
    metrics: Metrics,
    random: RefCell<fastrand::Rng>,
    client_id: RefCell<String>,
    client_id_confirmed: Cell<bool>,
}

impl Vm {
    fn new(plugin: Plugin) -> Self {
        let mut seed = [0u8; 8];
        let seed = match getrandom::fill(&mut seed) {
            Ok(()) => u64::from_le_bytes(seed),
            Err(_) => now_ms() ^ 0x9e37_79b9_7f4a_7c15,
        };
        let mut random = fastrand::Rng::with_seed(seed);
        let client_id = client_id(&mut random);
        Vm {
            transports: plugin.configs().map(|(index, config)| (index, transport_for(config))).collect(),
            cache: RefCell::new(LimiterCache::new(plugin.configs().map(|(_, c)| c.cache_size).max().unwrap_or(1))),
            plugin,
            failure_log: RefCell::new(FailureLog::default()),
            metrics: Metrics::define(),
            random: RefCell::new(random),
            client_id: RefCell::new(client_id),
            client_id_confirmed: Cell::new(false),
        }
    }

    /// VMs may have raced to publish their client id while starting; by the first request the stored one
    /// is final, so each VM adopts it once.
    fn confirm_client_id(&self) {
        if !self.client_id_confirmed.replace(true) {
            if let Ok((Some(stored), _)) = hostcalls::get_shared_data(CLIENT_ID_KEY) {
                if let Ok(stored) = String::from_utf8(stored) {
                    *self.client_id.borrow_mut() = stored;
                }
            }
        }
    }

    fn transport(&self, index: usize) -> Option<&dyn RedisTransport> {
        self.transports.iter().find(|(i, _)| *i == index).map(|(_, t)| t.as_ref())
    }

    /// The configuration for the current request: by route and domain when there are overrides.
    fn select(&self) -> Option<(usize, &PluginConfig)> {
        if self.plugin.overrides.is_empty() {
            return self.plugin.global.as_ref().map(|config| (0, config));
        }
        let property = |path: Vec<&str>| {
            hostcalls::get_property(path).ok().flatten().and_then(|bytes| String::from_utf8(bytes).ok())
        };
        // Higress sets `route_name`; stock Envoy has `xds.route_name`.
        let route = property(vec!["route_name"]).or_else(|| property(vec!["xds", "route_name"]));
        let authority =
            hostcalls::get_map_value(proxy_wasm::types::MapType::HttpRequestHeaders, ":authority").ok().flatten();
        self.plugin.select(route.as_deref(), authority.as_deref())
    }

    fn member_random(&self) -> [u8; MEMBER_RANDOM_LEN] {
        let mut bytes = [0u8; MEMBER_RANDOM_LEN];
        self.random.borrow_mut().fill(&mut bytes);
        bytes
    }
}

/// The transport the configuration asks for (`Root::load` refused the ones this build lacks).
fn transport_for(config: &PluginConfig) -> Box<dyn RedisTransport> {
    match config.redis.transport {
        #[cfg(feature = "host-redis")]
        TransportKind::Host => {
            let redis = crate::host_redis::HostRedis::new(&config.redis);
            if let Err(why) = redis.init() {
                log(LogLevel::Warn, &format!("proxy_redis_init: {why}; retrying on the next request"));
            }
            Box::new(redis)
        }
        _ => Box::new(HttpBridge::new(&config.redis)),
    }
}

/// This process's Redisson client id: the one in shared data, or a new random UUID published there.
fn client_id(random: &mut fastrand::Rng) -> String {
    if let Ok((Some(stored), _)) = hostcalls::get_shared_data(CLIENT_ID_KEY) {
        if let Ok(stored) = String::from_utf8(stored) {
            return stored;
        }
    }
    let mut bytes = [0u8; 16];
    random.fill(&mut bytes);
    let id = uuid::Builder::from_random_bytes(bytes).into_uuid().hyphenated().to_string();
    let _ = hostcalls::set_shared_data(CLIENT_ID_KEY, Some(id.as_bytes()), None);
    id
}

fn now_ms() -> u64 {
    hostcalls::get_current_time()
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .and_then(|d| u64::try_from(d.as_millis()).ok())
        .unwrap_or(0)
}

/// The root context: owns the configuration of the VM.
#[derive(Default)]
struct Root {
    vm: Option<Rc<Vm>>,
}

impl Root {
    fn load(&self) -> Result<Plugin, String> {
        let bytes = match hostcalls::get_buffer(BufferType::PluginConfiguration, 0, usize::MAX) {
            Ok(Some(bytes)) => bytes,
            Ok(None) => Vec::new(),
            Err(status) => return Err(format!("cannot read the plugin configuration: {status:?}")),
        };
        let plugin = Plugin::from_json(&bytes).map_err(|e| e.to_string())?;
        for (index, config) in plugin.configs() {
            if config.redis.transport == TransportKind::Host && !cfg!(feature = "host-redis") {
                let at = if index == 0 { String::new() } else { format!("_rules_[{}].", index - 1) };
                return Err(format!("{at}redis.transport: \"host\" needs the host-redis build (edge-rate-limiter-higress.wasm); this is the stock Envoy build, which supports \"http\""));
            }
        }
        Ok(plugin)
    }
}

impl Context for Root {}

impl RootContext for Root {
    fn on_configure(&mut self, _plugin_configuration_size: usize) -> bool {
        match self.load() {
            Ok(plugin) => {
                let global = match &plugin.global {
                    Some(config) => {
                        format!("{} rule(s), Redis via cluster {:?}", config.rules.len(), config.redis.cluster)
                    }
                    None => "no global rules".to_string(),
                };
                log(
                    LogLevel::Info,
                    &format!("configured {global}, {} route/domain override(s)", plugin.overrides.len()),
                );
                self.vm = Some(Rc::new(Vm::new(plugin)));
                true
            }
            Err(reason) => {
                log(LogLevel::Error, &format!("invalid configuration: {reason}"));
                false
            }
        }
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        let flow = self.vm.clone().map(|vm| {
            let flow = Rc::new(RefCell::new(Flow {
                vm,
                context_id,
                entry: 0,
                pending: None,
                tokens: Vec::new(),
                response_headers: Vec::new(),
            }));
            flows::register(context_id, &flow);
            flow
        });
        Some(Box::new(Request { flow, context_id }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

/// The request as the host shows it.
struct HostRequest;

impl RequestView for HostRequest {
    fn header(&self, name: &str) -> Option<Vec<u8>> {
        hostcalls::get_map_value_bytes(proxy_wasm::types::MapType::HttpRequestHeaders, name).ok().flatten()
    }

    fn source_address(&self) -> Option<String> {
        let bytes = hostcalls::get_property(vec!["source", "address"]).ok().flatten()?;
        String::from_utf8(bytes).ok()
    }
}

/// What the host must do with a request once the filter has acted on it.
pub(crate) enum Next {
    /// The request continues (in `on_http_request_headers`: return `Continue`; later: resume it).
    Continue,
    /// The request waits for Redis.
    Wait,
    /// The request is answered locally.
    Respond { status: u16, headers: Vec<(String, String)>, body: String },
}

/// One HTTP request's way through the limiters: its pending acquires, their tokens, and the headers for
/// the upstream's response. Both reply paths (the SDK's HTTP callout callback, the Higress Redis export)
/// drive the same `Flow`; hostcalls that end the request are made by the caller after the flow is released.
pub(crate) struct Flow {
    vm: Rc<Vm>,
    context_id: u32,
    /// Index of the configuration that applies to the request (`Plugin::configs`), chosen at the start.
    entry: usize,
    pending: Option<PendingRequest>,
    /// Outstanding calls: host token -> call index in `pending`.
    tokens: Vec<(u32, usize)>,
    response_headers: Vec<(String, String)>,
}

impl Flow {
    /// Starts deciding the request: decided at once, or waiting for the replies of the sent commands.
    fn start(&mut self) -> Next {
        let vm = Rc::clone(&self.vm);
        vm.confirm_client_id();
        let Some((entry, config)) = vm.select() else { return Next::Continue };
        self.entry = entry;
        let client_id = vm.client_id.borrow();
        let start = {
            let cache = vm.cache.borrow();
            let ctx = limiter::Context { config, now_ms: now_ms(), client_id: &client_id, cache: &cache };
            limiter::start(&ctx, &HostRequest, &mut || vm.member_random())
        };
        match start {
            Start::Decided(decision) => self.finish(decision),
            Start::Send(pending, commands) => {
                self.pending = Some(pending);
                let mut next = Next::Wait;
                for (call, command) in commands {
                    let progress = self.send(call, &command);
                    if let Some(decision) = self.drive(progress) {
                        next = self.finish(decision);
                    }
                }
                next
            }
        }
    }

    /// Handles the reply (raw RESP bytes) or failure of the call with this host token.
    pub(crate) fn on_reply(&mut self, token: u32, reply: Result<Vec<u8>, Failure>) -> Next {
        let Some(at) = self.tokens.iter().position(|(t, _)| *t == token) else { return Next::Wait };
        let (_, call) = self.tokens.swap_remove(at);
        let progress = self.feed(call, reply.as_deref().map_err(Clone::clone));
        match self.drive(progress) {
            Some(decision) => self.finish(decision),
            None => Next::Wait,
        }
    }

    /// Tells the transport to set its connection up again before the next call.
    #[cfg_attr(not(feature = "host-redis"), allow(dead_code))]
    pub(crate) fn reconnect(&self) {
        if let Some(transport) = self.vm.transport(self.entry) {
            transport.reconnect();
        }
    }

    /// Hands one call's reply (or failure) to the pending request.
    fn feed(&mut self, call: usize, reply: Result<&[u8], Failure>) -> Progress {
        let vm = &self.vm;
        let (Some(pending), Some(config)) = (self.pending.as_mut(), vm.plugin.config(self.entry)) else {
            return Progress::Waiting;
        };
        let (progress, notice) = pending.on_reply(call, reply, config, &mut vm.cache.borrow_mut());
        if let Some(notice) = notice {
            log(LogLevel::Warn, &notice.to_string());
        }
        progress
    }

    /// Sends a command for a call; a refused send is that call's failure.
    fn send(&mut self, call: usize, command: &Command) -> Progress {
        let sent = match self.vm.transport(self.entry) {
            Some(transport) => transport.send(self.context_id, command),
            None => Err(Failure::SendRefused("no transport for this configuration".into())),
        };
        match sent {
            Ok(token) => {
                Metrics::add(self.vm.metrics.redis_calls, 1);
                self.tokens.push((token, call));
                Progress::Waiting
            }
            Err(failure) => self.feed(call, Err(failure)),
        }
    }

    /// Follows the progress until the request waits for Redis or is decided.
    fn drive(&mut self, mut progress: Progress) -> Option<Decision> {
        loop {
            progress = match progress {
                Progress::Resend(call, command) => self.send(call, &command),
                Progress::Waiting => return None,
                Progress::Done(decision) => return Some(decision),
            };
        }
    }

    /// Counts and logs the decision and says what the host must do.
    fn finish(&mut self, decision: Decision) -> Next {
        self.pending = None;
        let vm = &self.vm;
        let metric = match decision.outcome {
            Outcome::Unlimited => None,
            Outcome::Allowed => vm.metrics.allowed,
            Outcome::Rejected => vm.metrics.rejected,
            Outcome::FailedOpen => vm.metrics.failure_allowed,
            Outcome::FailedClosed => vm.metrics.failure_denied,
        };
        Metrics::add(metric, 1);
        Metrics::add(vm.metrics.redis_errors, decision.failures.len());
        {
            let mut failure_log = vm.failure_log.borrow_mut();
            for failure in &decision.failures {
                let mode = vm.plugin.config(self.entry).map_or(FailureMode::Allow, |c| c.failure_mode);
                failure_log.failed(failure, mode);
            }
            if decision.failures.is_empty() && matches!(decision.outcome, Outcome::Allowed | Outcome::Rejected) {
                failure_log.recovered();
            }
        }
        match decision.verdict {
            Verdict::Continue { response_headers } => {
                self.response_headers = response_headers;
                Next::Continue
            }
            Verdict::Respond { status, headers, body } => Next::Respond { status, headers, body },
        }
    }
}

/// Carries out `next` for a request that was paused (from a reply callback).
pub(crate) fn resume_or_respond(next: Next) {
    match next {
        Next::Continue => {
            let _ = hostcalls::resume_http_request();
        }
        Next::Wait => {}
        respond @ Next::Respond { .. } => respond_locally(respond),
    }
}

fn respond_locally(next: Next) {
    if let Next::Respond { status, mut headers, body } = next {
        headers.push(("content-type".into(), "text/plain".into()));
        let headers: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        if let Err(status) = hostcalls::send_http_response(u32::from(status), headers, Some(body.as_bytes())) {
            log(LogLevel::Error, &format!("cannot send the local reply: {status:?}"));
        }
    }
}

/// The HTTP context the SDK owns: a handle on the request's [`Flow`], registered by context id so the
/// Higress Redis callback (which the host delivers to the root context) can find it.
struct Request {
    /// `None` only if the VM has no valid configuration (the host does not run the filter then).
    flow: Option<Rc<RefCell<Flow>>>,
    context_id: u32,
}

impl Drop for Request {
    fn drop(&mut self) {
        flows::forget(self.context_id);
    }
}

impl Context for Request {
    fn on_http_call_response(&mut self, token_id: u32, num_headers: usize, body_size: usize, _num_trailers: usize) {
        let Some(flow) = &self.flow else { return };
        let reply = HttpBridge::reply(num_headers, body_size);
        let next = flow.borrow_mut().on_reply(token_id, reply);
        resume_or_respond(next);
    }
}

impl HttpContext for Request {
    fn on_http_request_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        let Some(flow) = &self.flow else { return Action::Continue };
        let next = flow.borrow_mut().start();
        match next {
            Next::Continue => Action::Continue,
            Next::Wait => Action::Pause,
            respond @ Next::Respond { .. } => {
                respond_locally(respond);
                Action::Pause
            }
        }
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        let Some(flow) = &self.flow else { return Action::Continue };
        let headers = std::mem::take(&mut flow.borrow_mut().response_headers);
        for (name, value) in headers {
            let _ = hostcalls::add_map_value(proxy_wasm::types::MapType::HttpResponseHeaders, &name, &value);
        }
        Action::Continue
    }
}

/// The flows of the VM's live HTTP contexts, by context id.
pub(crate) mod flows {
    use std::cell::RefCell;
    use std::collections::HashMap;
    use std::rc::{Rc, Weak};

    use super::Flow;

    thread_local! {
        static FLOWS: RefCell<HashMap<u32, Weak<RefCell<Flow>>>> = RefCell::new(HashMap::new());
    }

    pub(super) fn register(context_id: u32, flow: &Rc<RefCell<Flow>>) {
        FLOWS.with(|flows| flows.borrow_mut().insert(context_id, Rc::downgrade(flow)));
    }

    pub(super) fn forget(context_id: u32) {
        FLOWS.with(|flows| flows.borrow_mut().remove(&context_id));
    }

    /// The flow of a live HTTP context.
    #[cfg_attr(not(feature = "host-redis"), allow(dead_code))]
    pub(crate) fn find(context_id: u32) -> Option<Rc<RefCell<Flow>>> {
        FLOWS.with(|flows| flows.borrow().get(&context_id).and_then(Weak::upgrade))
    }
}
