//! The state of one VM as its hostcalls see it (wasmtime's store data): the contexts (the root and one
//! per HTTP stream) with their header maps and bodies, which context the current guest call is for, the
//! actions Envoy defers until the call returns, and the buffers valid only during a callback.
//!
//! Envoy facts used here (proxy-wasm-cpp-host `src/exports.cc`, `src/context.cc`; Envoy
//! `source/extensions/common/wasm/context.cc`; observed with `probe/` in Envoy 1.40):
//! - hostcalls act on the *effective* context if the guest set one with `proxy_set_effective_context`
//!   during this call, else on the context the host called (`contextOrEffectiveContext`); the effective
//!   context is reset at every guest call from the host (`SaveRestoreContext`);
//! - `proxy_continue_stream`, `proxy_send_local_response` and `proxy_close_stream` are deferred until the
//!   guest call returns (`addAfterVmCallAction`); `proxy_continue_stream(Request)` drops access to the
//!   request headers at once (observed: reading them afterwards answers BadArgument);
//! - HTTP calls belong to the root context (`http_call` uses `root_context()`), so their callback gets the
//!   root context id, and the call response headers/body are readable only during that callback.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::SocketAddr;
use std::sync::mpsc::Sender;
use std::sync::Arc;
use std::time::Duration;

use crate::engine::{Memory, TypedFunc};

use crate::abi::{AbiVersion, LogLevel, MapType, Status, StreamType};
use crate::exchange::Headers;
use crate::faults::{CallKind, PendingCall};
use crate::flavour::HostFlavour;
use crate::profile::FunctionProfiler;
use crate::redis::RedisClients;
use crate::shared::{lock, LogSource, Shared};
use crate::tokens::{CallTokens, TokenCounters};

/// Header pairs as bytes (names lowercase).
pub type Pairs = Vec<(Vec<u8>, Vec<u8>)>;

/// The host-wide, immutable setup every VM reads.
#[derive(Clone, Debug)]
pub struct Setup {
    /// The plugin configuration (buffer type 7, during `proxy_on_configure` only).
    pub plugin_config: Vec<u8>,
    /// The VM configuration (buffer type 6).
    pub vm_config: Vec<u8>,
    /// `plugin_name` property.
    pub plugin_name: String,
    /// `plugin_root_id` property.
    pub root_id: String,
    /// `plugin_vm_id` property.
    pub vm_id: String,
    /// Cluster name -> address, for HTTP calls and Redis.
    pub clusters: BTreeMap<String, SocketAddr>,
    /// Clusters of type `envoy.clusters.redis` (Redis Cluster, slot-routed) by name -> seed nodes; only the
    /// Redis extension knows them (see `redis.rs`: Higress's client cannot route on them).
    pub redis_clusters: BTreeMap<String, Vec<SocketAddr>>,
    /// Extra or overriding properties: dotted path (`a.b.c`) -> raw bytes.
    pub properties: BTreeMap<String, Vec<u8>>,
    /// The emulated upstream's answer.
    pub upstream: UpstreamSpec,
    /// The `destination.address` property (the listener), `ip:port`.
    pub destination_address: String,
    /// The longest an HTTP call may take when the guest gives no timeout (Envoy: no limit).
    pub http_call_max: Duration,
    /// Connect timeout of Redis connections (Envoy: the cluster's `connect_timeout`).
    pub redis_connect_timeout: Duration,
    /// Envoy's `fail_open` plugin option: when the VM has failed, let requests through.
    pub fail_open: bool,
    /// Serve Higress's top-level `route_name` and `cluster_name` properties (stock Envoy 1.40 answers
    /// NotFound for them; it has `xds.route_name` and `xds.cluster_name`).
    pub higress_properties: bool,
    /// The host played ([`crate::flavour`]): which imports, properties and foreign functions exist.
    pub flavour: HostFlavour,
    /// How call tokens are numbered ([`crate::tokens`]; default one counter for HTTP and Redis calls).
    pub call_tokens: CallTokens,
}

/// The emulated upstream's response.
#[derive(Clone, Debug)]
pub struct UpstreamSpec {
    /// The status.
    pub status: u16,
    /// Headers after `:status` (the host adds `content-length` and Envoy's
    /// `x-envoy-upstream-service-time`).
    pub headers: Headers,
    /// The body.
    pub body: Vec<u8>,
}

impl Default for UpstreamSpec {
    fn default() -> Self {
        UpstreamSpec {
            status: 200,
            headers: vec![("content-type".into(), "text/plain".into())],
            body: b"upstream ok\n".to_vec(),
        }
    }
}

/// Something that happened outside the guest and must be delivered to it.
#[derive(Debug)]
pub enum Event {
    /// An HTTP call finished (a real response, or the one Envoy synthesizes on failure).
    HttpCall {
        /// The VM that made the call.
        vm: usize,
        /// The call's token.
        token: u32,
        /// The response.
        response: CallResponse,
    },
    /// A Redis call finished.
    Redis {
        /// The VM that made the call.
        vm: usize,
        /// The call's token.
        token: u32,
        /// 0 Ok, 1 network error (timeout, connection failure).
        status: u32,
        /// The raw RESP reply (empty on failure).
        reply: Vec<u8>,
    },
    /// An item was enqueued on a shared queue.
    QueueReady {
        /// The VM that registered the queue.
        vm: usize,
        /// Its root context.
        root: u32,
        /// The queue's token.
        token: u32,
    },
}

/// An HTTP call's response as the guest reads it.
#[derive(Clone, Debug, Default)]
pub struct CallResponse {
    /// `:status` first, then the response headers.
    pub headers: Pairs,
    /// The body.
    pub body: Vec<u8>,
    /// Trailers (none over HTTP/1.1).
    pub trailers: Pairs,
}

/// A local reply asked for with `proxy_send_local_response`.
#[derive(Clone, Debug)]
pub struct LocalReplySpec {
    /// The status.
    pub status: u32,
    /// The details string.
    pub details: String,
    /// The body.
    pub body: Vec<u8>,
    /// Headers to add.
    pub headers: Pairs,
    /// The gRPC status given (`grpc_status` of `proxy_send_local_response`; `None` for -1).
    pub grpc_status: Option<u32>,
}

/// What a hostcall asked for that Envoy does after the guest call returns.
#[derive(Clone, Debug)]
pub enum Action {
    /// `proxy_continue_stream`.
    Continue {
        /// The stream context.
        context: u32,
        /// Request or response.
        stream: StreamType,
    },
    /// `proxy_send_local_response`.
    LocalReply {
        /// The stream context.
        context: u32,
        /// The reply.
        reply: LocalReplySpec,
    },
    /// `proxy_close_stream`.
    Close {
        /// The stream context.
        context: u32,
    },
}

/// Per-stream facts shown as properties.
#[derive(Clone, Debug, Default)]
pub struct StreamInfo {
    /// `source.address`, `ip:port`.
    pub source_address: String,
    /// `xds.route_name` / Higress's `route_name`.
    pub route_name: String,
    /// `connection_id`.
    pub connection_id: u64,
    /// `response.code`, once a response started.
    pub response_code: Option<u16>,
    /// Upstream address, once the request went upstream.
    pub upstream_address: Option<String>,
    /// `proxy_set_property` values (Envoy: filter state `wasm.<path>`).
    pub filter_state: HashMap<Vec<u8>, Vec<u8>>,
}

/// An HTTP stream's maps and buffers, and whether the guest may touch them now.
#[derive(Clone, Debug, Default)]
pub struct StreamData {
    /// The root context the stream was created for (`proxy_on_context_create(ctx, root)`): its tick is the
    /// one this stream's `proxy_set_tick_period_milliseconds` sets.
    pub root: u32,
    /// Request headers.
    pub request_headers: Pairs,
    /// Request headers are readable and writable (from `proxy_on_request_headers` until the request
    /// continues; Envoy `decodeHeaders`/`continueStream`).
    pub request_headers_open: bool,
    /// The request body.
    pub request_body: Vec<u8>,
    /// Response headers.
    pub response_headers: Pairs,
    /// Response headers are readable and writable (from `proxy_on_response_headers` until the response
    /// continues).
    pub response_headers_open: bool,
    /// The response body.
    pub response_body: Vec<u8>,
    /// Response trailers (map type 3), once the upstream sent them.
    pub response_trailers: Pairs,
    /// Response trailers are readable and writable (from `proxy_on_response_trailers` until the response
    /// continues; Envoy `encodeTrailers`).
    pub response_trailers_open: bool,
    /// During `proxy_on_log`: both header maps readable (Envoy's access-log phase).
    pub access_log_phase: bool,
    /// The body chunk a body callback is looking at.
    pub body_view: Option<BodyView>,
    /// Property values.
    pub info: StreamInfo,
    /// `proxy_redis_call`s made for this stream.
    pub redis_calls: u32,
    /// `proxy_http_call`s made for this stream.
    pub http_calls: u32,
}

/// Which body a body callback shows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BodyView {
    /// The request body.
    Request,
    /// The response body.
    Response,
}

/// A context of the VM.
#[derive(Clone, Debug)]
pub enum Context {
    /// The root context (one per VM here: one plugin).
    Root,
    /// An HTTP stream.
    Stream(Box<StreamData>),
}

/// The store data of one VM.
pub struct VmState {
    /// Index of this VM.
    pub vm: usize,
    /// The ABI the module declared.
    pub abi: AbiVersion,
    /// State shared with the other VMs.
    pub shared: Arc<Shared>,
    /// The host's setup.
    pub setup: Arc<Setup>,
    /// Where I/O threads deliver results.
    pub events: Sender<Event>,
    /// The guest's memory.
    pub memory: Option<Memory>,
    /// The guest's allocator (`proxy_on_memory_allocate` or `malloc`).
    pub alloc: Option<TypedFunc<u32, u32>>,
    /// The root context's id.
    pub root_id: u32,
    /// Live contexts by id.
    pub contexts: BTreeMap<u32, Context>,
    next_context_id: u32,
    /// The context the host called into (0: the VM context, during `_initialize`).
    pub current: u32,
    /// The context set with `proxy_set_effective_context` during this call (0: none).
    pub effective: u32,
    /// The stream the current call works for, if any (for root callbacks: the stream that made the call).
    pub call_stream: Option<u32>,
    /// During `_initialize`/`main`: only logging, clock, random, args and environment are allowed
    /// (cpp-host `startVm` restricts the rest; a restricted call traps with `restricted_callback`).
    pub starting: bool,
    /// During `proxy_on_configure`: the plugin configuration is readable.
    pub configuring: bool,
    /// Deferred actions of the current call.
    pub actions: Vec<Action>,
    /// Set by `proxy_send_local_response`: the filter stops whatever it returns.
    pub stop_iteration: bool,
    /// With a fuel profile: where the current segment started (its label, the fuel left then).
    pub profile_mark: Option<(String, u64)>,
    /// With a function profile: this VM's recorder ([`crate::profile`]).
    pub function_profiler: Option<FunctionProfiler>,
    /// The HTTP call response of the callback running now.
    pub call_response: Option<CallResponse>,
    /// The Redis reply of the callback running now (buffer type 9).
    pub redis_reply: Option<Vec<u8>>,
    tokens: TokenCounters,
    /// The pending HTTP and Redis calls by kind and token (under [`CallTokens::PerKind`] an HTTP call and a
    /// Redis call may share a token): which stream made each (fuel and call counts are charged to it) and
    /// what happens to its reply ([`crate::faults`]).
    pub calls: HashMap<(CallKind, u32), PendingCall>,
    /// The tick period of each root context that has one, by root context id (Envoy: one timer per root
    /// context, `Wasm::setTickPeriod(root_context_id, period)`); a root context without an entry has no tick.
    pub ticks: BTreeMap<u32, Duration>,
    /// The root contexts whose tick was set (or went with them) since the host last looked: the host
    /// restarts their timers ([`VmState::take_tick_changes`]).
    tick_changes: BTreeSet<u32>,
    /// Metric id -> name.
    pub metric_ids: HashMap<u32, String>,
    next_metric_index: u32,
    /// Higress Redis clients of this VM, by cluster.
    pub redis: RedisClients,
}

impl VmState {
    /// The state of a VM before instantiation.
    pub fn new(vm: usize, abi: AbiVersion, shared: Arc<Shared>, setup: Arc<Setup>, events: Sender<Event>) -> Self {
        let tokens = TokenCounters::new(setup.call_tokens);
        VmState {
            vm,
            abi,
            shared,
            setup,
            events,
            memory: None,
            alloc: None,
            root_id: 0,
            contexts: BTreeMap::new(),
            // The VM context is 0; the root context is the first allocated one (Envoy: 1, observed).
            next_context_id: 1,
            current: 0,
            effective: 0,
            call_stream: None,
            starting: false,
            configuring: false,
            actions: Vec::new(),
            stop_iteration: false,
            profile_mark: None,
            function_profiler: None,
            call_response: None,
            redis_reply: None,
            tokens,
            calls: HashMap::new(),
            ticks: BTreeMap::new(),
            tick_changes: BTreeSet::new(),
            metric_ids: HashMap::new(),
            next_metric_index: 0,
            redis: RedisClients::default(),
        }
    }

    /// Allocates a context id (never reused).
    pub fn allocate_context(&mut self) -> u32 {
        let id = self.next_context_id;
        self.next_context_id = self.next_context_id.wrapping_add(1).max(1);
        id
    }

    /// Allocates a call token, numbered as [`Setup::call_tokens`] says ([`crate::tokens`]), for a call of
    /// this kind made now for `owner`, and records the call as pending under (kind, token); the faults in
    /// force decide what happens to its reply.
    pub fn allocate_token(&mut self, owner: Option<u32>, kind: CallKind) -> u32 {
        let token = self.tokens.next(kind);
        let fate = lock(&self.shared.faults).fate(kind);
        self.calls.insert((kind, token), PendingCall { owner, kind, fate });
        token
    }

    /// Allocates a metric id: Envoy keeps the type in the low two bits.
    pub fn allocate_metric(&mut self, kind: u32, name: String) -> u32 {
        let id = (self.next_metric_index << 2) | (kind & 3);
        self.next_metric_index = self.next_metric_index.wrapping_add(1);
        self.metric_ids.insert(id, name);
        id
    }

    /// The context hostcalls act on: the effective one if set and alive, else the called one.
    pub fn context_id(&self) -> u32 {
        if self.effective != 0 && self.contexts.contains_key(&self.effective) {
            self.effective
        } else {
            self.current
        }
    }

    /// The stream the hostcall acts for: the context if it is a stream, else the stream the current call
    /// works for.
    pub fn owner_stream(&self) -> Option<u32> {
        let id = self.context_id();
        match self.contexts.get(&id) {
            Some(Context::Stream(_)) => Some(id),
            _ => self.call_stream,
        }
    }

    /// The stream data of the context hostcalls act on, if it is a stream.
    pub fn stream(&self) -> Option<&StreamData> {
        match self.contexts.get(&self.context_id()) {
            Some(Context::Stream(data)) => Some(data),
            _ => None,
        }
    }

    /// Mutable [`VmState::stream`].
    pub fn stream_mut(&mut self) -> Option<&mut StreamData> {
        let id = self.context_id();
        match self.contexts.get_mut(&id) {
            Some(Context::Stream(data)) => Some(data),
            _ => None,
        }
    }

    /// The stream data of a context.
    pub fn stream_by_id(&mut self, id: u32) -> Option<&mut StreamData> {
        match self.contexts.get_mut(&id) {
            Some(Context::Stream(data)) => Some(data),
            _ => None,
        }
    }

    /// The header map a hostcall may read now (Envoy `getConstMap`).
    ///
    /// # Errors
    /// BadArgument if the map is not available now, NotFound if it is absent in the access-log phase.
    pub fn readable_map(&self, map: MapType) -> Result<&Pairs, Status> {
        let call_response = self.call_response.as_ref().ok_or(Status::BadArgument);
        match map {
            MapType::HttpCallResponseHeaders => return call_response.map(|r| &r.headers),
            MapType::HttpCallResponseTrailers => return call_response.map(|r| &r.trailers),
            _ => {}
        }
        let stream = self.stream().ok_or(Status::BadArgument)?;
        let log = stream.access_log_phase;
        match map {
            MapType::RequestHeaders if stream.request_headers_open || log => Ok(&stream.request_headers),
            MapType::ResponseHeaders if stream.response_headers_open || log => Ok(&stream.response_headers),
            MapType::ResponseTrailers if stream.response_trailers_open => Ok(&stream.response_trailers),
            // Envoy's access-log phase shows the trailers the response had (none: no map, NotFound).
            MapType::ResponseTrailers if log && !stream.response_trailers.is_empty() => Ok(&stream.response_trailers),
            _ if log => Err(Status::NotFound),
            _ => Err(Status::BadArgument),
        }
    }

    /// The header map a hostcall may change now (Envoy `getMap`: request/response headers and response
    /// trailers while open).
    pub fn writable_map(&mut self, map: MapType) -> Option<&mut Pairs> {
        let stream = self.stream_mut()?;
        match map {
            MapType::RequestHeaders if stream.request_headers_open => Some(&mut stream.request_headers),
            MapType::ResponseHeaders if stream.response_headers_open => Some(&mut stream.response_headers),
            MapType::ResponseTrailers if stream.response_trailers_open => Some(&mut stream.response_trailers),
            _ => None,
        }
    }

    /// Logs a line for this VM.
    pub fn log(&self, level: LogLevel, source: LogSource, message: String) {
        self.shared.log(Some(self.vm), level, self.context_id(), source, message);
    }

    /// Removes a context (after `proxy_on_delete`). A root context's tick goes with it (Envoy's timer of a
    /// deleted root context finds no context and calls nothing).
    pub fn remove_context(&mut self, id: u32) {
        self.contexts.remove(&id);
        if self.effective == id {
            self.effective = 0;
        }
        if self.ticks.remove(&id).is_some() {
            self.tick_changes.insert(id);
        }
    }

    /// The root context of a live context: itself for a root context, the one it was created for for an
    /// HTTP context (cpp-host `ContextBase::root_context`).
    pub fn root_of(&self, id: u32) -> Option<u32> {
        match self.contexts.get(&id)? {
            Context::Root => Some(id),
            Context::Stream(data) => Some(data.root),
        }
    }

    /// `proxy_set_tick_period_milliseconds`: sets (0: stops) the tick of the root context of the context
    /// hostcalls act on now, the effective one included (cpp-host `ContextBase::setTimerPeriod` calls
    /// `wasm()->setTimerPeriod(root_context()->id(), period)` on `contextOrEffectiveContext()`). The host
    /// (re)starts that root's timer when the guest call returns, as Envoy's `Wasm::setTickPeriod` creates a
    /// new timer whenever a period is set. Without a live context, nothing happens.
    pub fn set_tick_period(&mut self, period: Duration) {
        let Some(root) = self.root_of(self.context_id()) else { return };
        if period.is_zero() {
            self.ticks.remove(&root);
        } else {
            self.ticks.insert(root, period);
        }
        self.tick_changes.insert(root);
    }

    /// The root contexts whose tick changed since the last look, with their period now (`None`: no tick).
    pub fn take_tick_changes(&mut self) -> Vec<(u32, Option<Duration>)> {
        let changed = std::mem::take(&mut self.tick_changes);
        changed.into_iter().map(|root| (root, self.ticks.get(&root).copied())).collect()
    }
}
