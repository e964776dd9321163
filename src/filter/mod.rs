//! The filter of one root context (one plugin configuration in one VM): its routes (one per configuration,
//! [`route`]), its metrics and logs, and every request's way through the limiters: start, pause, the
//! replies, the deadline guard, and the end (resume with rate limit headers, or a local reply).
//!
//! It sees the host only through [`Host`], so all of it runs natively against the fake host in the unit
//! tests. Every decision is made by [`crate::limiter`]; this module keeps the per-request state and moves
//! bytes between the limiter, the transports and the host.
//!
//! - this file: the filter, its configuration and the host's callbacks, each "match, then one step";
//!
//! Its submodules sit on floors and import their siblings only downwards (`scripts/check_imports.py`,
//! `SUBFLOORS`), so the tick and what leaves from it never depend on the request driver:
//!
//! 0. `ids` (this process's Redisson client id, the permit members' random bytes), `metrics` (the counters,
//!    the once-per-cause logs, a refused hostcall), `route` (a configuration compiled once at configure
//!    into a [`route::Route`]; the adapters through which a request sees its route's blocks and local
//!    windows);
//! 1. `tick`: the root context's tick, on while anything waits for it;
//! 2. `give_back`: give-back calls one at a time (a request's members, lease settlements, settles) and
//!    their replies;
//! 3. `outbox` (what leaves from the tick: the settles of a tick batched per destination) and `settle`
//!    (reservations kept until their response ends, and the usage read from it);
//! 4. the request driver: `flow` (a request's start, a paused request ([`flow::Flow`]) and its one step,
//!    `advance`; the deadline guard; requests parked on a lease acquire), `end` (how a decided request
//!    ends: counted, leases committed or put back, resumed or answered), `coalesce` (batches of acquires),
//!    `body` (requests decided from their JSON body), `late`, `inflight` (permits before the rate rules);
//! 5. `handover`: a configuration that goes away ([`Filter::retire`]) and the one that takes its place
//!    ([`Filter::adopt`]).
//!
//! Replies flow one way: the host delivers a reply to the root context (`proxy_on_http_call_response`,
//! `proxy_on_redis_call_response`); the `abi` module hands it to [`Filter::on_http_call_response`] or
//! [`Filter::on_redis_call_response`]; the transport module reads its bytes; the filter finds the request
//! by the call's kind and token (its own call map), feeds the limiter and acts. The transports know
//! nothing of requests.
//!
//! Every request the filter pauses ends within `redis.timeout` (+ [`DEADLINE_GRACE_MS`] + one tick):
//! by its replies, or by the deadline guard, which runs on the root context's tick while any request is
//! paused and ends the calls still waiting as [`Failure::TimedOut`] (the failure mode then applies). A
//! decision the host refused to take (the switch to the request's context failed) is delivered again on
//! the next tick; the request is forgotten when the host deletes its context.

use alloc::rc::Rc;
use core::cell::RefCell;

use crate::prelude::*;

use crate::block::{generation_of, RecentBlocks};
use crate::cache::LimiterCache;
use crate::config::{ConfigError, Plugin, TransportKind};
use crate::host::{Host, LogLevel};
use crate::host_redis;
use crate::http_bridge;
use crate::id_map::{CallMap, IdMap};
use crate::lease::LeaseTable;
use crate::limiter::Report;
use crate::quote::quoted;
use crate::response::cache::ReplyCache;
use crate::response::Headers;
use crate::transport::{CallId, CallKind, Failure};

use coalesce::Coalescer;

mod body;
#[cfg(test)]
mod body_tests;
mod coalesce;
#[cfg(test)]
mod coalesce_tests;
mod end;
mod flow;
mod give_back;
mod handover;
mod hold;
mod ids;
mod inflight;
#[cfg(all(test, not(target_arch = "wasm32")))]
mod interleavings;
mod late;
mod metrics;
#[cfg(test)]
mod metrics_tests;
mod outbox;
mod permit_outbox;
mod route;
mod settle;
#[cfg(test)]
mod settle_tests;
#[cfg(test)]
mod tests;
mod tick;
mod wait;

pub use handover::Retirement;
pub use ids::CLIENT_ID_KEY;

use flow::{Call, Flow};
use give_back::GiveBackCall;
use metrics::{FailureLog, LimiterErrorLog, Metrics};
use route::Route;

/// Prefix of every metric name; log lines start with `edge-rate-limiter: `.
pub const NAME: &str = "edge_rate_limiter";

/// The module's version: `[package] version` of Cargo.toml, logged when a configuration loads and the tag
/// of its OCI image (`make oci`), so a gateway's log says which release runs.
pub const PLUGIN_VERSION: &str = env!("CARGO_PKG_VERSION");
/// Period of the root context's tick while requests are paused, ms: the deadline guard's resolution.
pub const TICK_MS: u32 = 10;
/// What the filter logs (at error level) before the reason when it refuses a configuration.
pub const REFUSAL_PREFIX: &str = "edge-rate-limiter: invalid configuration: ";
/// The request property naming the rule that rejected it: Envoy's access logs read it as
/// `%FILTER_STATE(wasm.edge_rate_limiter.rejected_by:PLAIN)%` (the host prefixes `wasm.`).
pub const REJECTED_BY_PROPERTY: &str = "edge_rate_limiter.rejected_by";
/// The request property naming the first shadow rule that would have rejected it (the request went on):
/// `%FILTER_STATE(wasm.edge_rate_limiter.shadow_rejected_by:PLAIN)%`.
pub const SHADOW_REJECTED_BY_PROPERTY: &str = "edge_rate_limiter.shadow_rejected_by";
/// How long after `redis.timeout` the guard ends a call still waiting, ms: the host's own timeout
/// (Envoy's 504, Higress's status 1) comes first and names the failure better.
pub const DEADLINE_GRACE_MS: u64 = 10;

/// Loads a plugin configuration as a build does in `proxy_on_configure`, without a host: parsed and
/// validated ([`Plugin::from_json`]), and refused when it needs what this build lacks (`transport: "host"`
/// without `host_redis_build`). Tools (`erl-admin validate`) refuse exactly what a gateway refuses.
///
/// # Errors
/// A [`ConfigError`] naming the field (`rules[0].rate: must be at least 1`): what the filter logs after
/// [`REFUSAL_PREFIX`].
pub fn load(configuration: &[u8], host_redis_build: bool) -> Result<Plugin, ConfigError> {
    let plugin = Plugin::from_json(configuration)?;
    for (index, config) in plugin.configs() {
        if config.redis.transport == TransportKind::Host && !host_redis_build {
            let at = if index == 0 { String::new() } else { format!("_rules_[{}].", index - 1) };
            return Err(ConfigError::new(
                format!("{at}redis.transport"),
                "\"host\" needs the host-redis build (edge-rate-limiter-higress.wasm); this is the stock Envoy build, which supports \"http\"",
            ));
        }
    }
    Ok(plugin)
}

/// What a callback tells the host about the request: go on, or wait (the filter resumes or answers it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Continue the request (proxy-wasm `Action::Continue`, 0).
    Continue = 0,
    /// Pause the request (proxy-wasm `Action::Pause`, 1).
    Pause = 1,
}

/// Writes `edge-rate-limiter: <message>` to the host's log.
pub(crate) fn log(host: &impl Host, level: LogLevel, message: &str) {
    host.log(level, &format!("edge-rate-limiter: {message}"));
}

/// The filter of one root context.
pub struct Filter<H: Host> {
    host: H,
    /// One route per configuration, matched as the plugin's route and domain rules say.
    routes: Plugin<Rc<Route>>,
    metrics: Metrics,
    cache: RefCell<LimiterCache>,
    failure_log: FailureLog,
    /// Limiters whose keys raised a Redis error, logged once each.
    limiter_errors: LimiterErrorLog,
    random: fastrand::Rng,
    client_id: String,
    client_id_confirmed: bool,
    permit_prefix: [u8; crate::script::PERMIT_ID_LEN / 2], // ids::permit_prefix of client_id
    /// Paused requests, by HTTP context id.
    flows: IdMap<Flow>,
    /// Requests that stopped waiting while calls were on their way: those calls' late replies (a few at
    /// most, and rare: a list).
    late: Vec<late::LateFlow>,
    /// Requests waiting for their permits (a rule's `max_wait`).
    waits: wait::Waits,
    /// Outstanding calls, by [`CallId::key`]: the kind and the token (each kind has its own numbering); with
    /// when each was sent ([`Metrics::clock`]).
    calls: CallMap<(Call, u64)>,
    /// Request coalescing: calls in flight per destination, batches on their way, calls waiting.
    coalescer: Coalescer,
    /// Outstanding give-back calls, by [`CallId::key`].
    give_backs: CallMap<GiveBackCall>,
    /// Outstanding batches of settle calls ([`outbox`]), by [`CallId::key`].
    give_back_batches: CallMap<outbox::GiveBackBatch>,
    /// What the rate limit headers of resumed requests report (with their route), added when their
    /// response headers arrive.
    response_headers: IdMap<(Rc<Route>, Report)>,
    /// Whether the tick is on (it runs only while requests or give-backs are waiting).
    ticking: bool,
    /// The root context this filter belongs to ([`Filter::own_root_context`]): made effective before the
    /// filter sets its tick or calls out from another root's callback ([`Filter::adopt`]).
    root_context: Option<u32>,
    /// Whether a refused hostcall was logged (once per configuration).
    host_error_logged: bool,
    /// The headers of the last local reply, serialized.
    replies: ReplyCache,
    /// The blocks this VM saw last (read from shared data or recorded).
    recent_blocks: RefCell<RecentBlocks>,
    /// This VM's permit leases.
    leases: LeaseTable,
    /// Limiters whose lease acquire just ended: requests parked on them go on (`flow::wake_parked`).
    ended_leases: Vec<String>,
    /// Where a request's limiter names are written (one allocation, reused).
    name_buffer: String,
    /// Reservations of allowed requests (rules with `cost`), by HTTP context id, until their response ends.
    settling: IdMap<settle::Settling>,
    /// Requests waiting for their body before they are decided (a rule reads it).
    awaiting_body: IdMap<body::Awaiting>,
    /// Requests held at their headers by their in-flight permits whose body came meanwhile (the host gives
    /// it: `allow_on_headers_stop_iteration`): `Some(size)` once it ended, for the rate stage to read.
    early_bodies: IdMap<Option<usize>>,
    /// Whether the host gives the body while the filter holds the headers (`hold_headers_for_body`).
    body_while_held: hold::BodyWhileHeld,
    /// Give-back calls for the next tick, sent from this root context: settles, and the lease settlements a
    /// configuration that went away left ([`Filter::adopt`]).
    outbox: Vec<GiveBackCall>,
    /// In-flight rules: requests waiting for permits, permits held.
    inflight: inflight::Inflight,
    /// In-flight rules: permits to give back, and the release and extension calls on their way.
    permit_outbox: permit_outbox::PermitOutbox,
}

/// The decision context of `route` at `now_ms` for the body `$body`, with `$ctx` bound to it: the
/// route's blocks and local windows seen through the host's shared data, and this VM's leases. (A macro:
/// the body may use the filter's other fields mutably.)
macro_rules! with_context {
    ($filter:expr, $route:expr, $now_ms:expr, $skip_redis:expr, |$ctx:ident| $body:expr) => {{
        let blocks = $crate::filter::route::SharedBlocks {
            host: &$filter.host,
            table: $route.blocks,
            recent: &$filter.recent_blocks,
        };
        let windows = $route
            .fallback
            .as_ref()
            .map(|f| $crate::filter::route::SharedWindows { host: &$filter.host, table: f.windows });
        let $ctx = $crate::limiter::Context {
            config: &$route.config,
            plan: &$route.plan,
            now_ms: $now_ms,
            blocks: &blocks,
            leases: &$filter.leases,
            local: windows.as_ref().map(|w| w as &dyn $crate::limiter::LocalWindows),
            skip_redis: $skip_redis,
        };
        $body
    }};
}
pub(crate) use with_context;

impl<H: Host> Filter<H> {
    /// Parses and validates the plugin configuration and sets the filter up: one route per configuration
    /// (transports: a host Redis client is set up at once), counters, this process's Redisson client id.
    ///
    /// `host_redis_build`: whether this build has the Higress Redis calls (`transport: "host"` is refused
    /// otherwise).
    ///
    /// # Errors
    /// The reason the configuration is refused, naming the field (`rules[0].rate: must be at least 1`).
    pub fn configure(host: H, configuration: &[u8], host_redis_build: bool) -> Result<Self, ConfigError> {
        let plugin = load(configuration, host_redis_build)?;
        let mut random = fastrand::Rng::with_seed(host.random_seed());
        let client_id = ids::client_id(&host, &mut random);
        let generation = generation_of(configuration);
        let cache_size = plugin.configs().map(|(_, c)| c.cache_size).max().unwrap_or(1);
        let global = match &plugin.global {
            Some(c) => {
                format!("{} rule(s), Redis via cluster {}", c.rules.len() + c.inflight.len(), quoted(&c.redis.cluster))
            }
            None => "no global rules".to_string(),
        };
        let overrides = plugin.overrides.len();
        let histograms = plugin.configs().any(|(_, config)| config.histograms);
        let inflight = plugin.configs().any(|(_, config)| !config.inflight.is_empty());
        let mut defined = Vec::new();
        let routes = plugin.map(|index, config| {
            let rule_metrics = Metrics::rules(&host, &config, &mut defined);
            Rc::new(Route::new(&host, index, config, &client_id, generation, rule_metrics))
        });
        log(
            &host,
            LogLevel::Info,
            &format!("plugin_version {PLUGIN_VERSION}: configured {global}, {overrides} route/domain override(s)"),
        );
        Ok(Filter {
            metrics: Metrics::define(&host, histograms),
            cache: RefCell::new(LimiterCache::new(cache_size, [random.u64(..), random.u64(..)])),
            failure_log: FailureLog::default(),
            limiter_errors: LimiterErrorLog::default(),
            random,
            permit_prefix: ids::permit_prefix(&client_id),
            client_id,
            client_id_confirmed: false,
            flows: IdMap::default(),
            late: Vec::new(),
            waits: wait::Waits::default(),
            calls: CallMap::default(),
            coalescer: Coalescer::default(),
            give_backs: CallMap::default(),
            give_back_batches: CallMap::default(),
            response_headers: IdMap::default(),
            ticking: false,
            root_context: None,
            host_error_logged: false,
            replies: ReplyCache::default(),
            recent_blocks: RefCell::default(),
            leases: LeaseTable::default(),
            ended_leases: Vec::new(),
            name_buffer: String::new(),
            settling: IdMap::default(),
            outbox: Vec::new(),
            awaiting_body: IdMap::default(),
            early_bodies: IdMap::default(),
            body_while_held: hold::BodyWhileHeld::default(),
            inflight: inflight::Inflight::new(&host, inflight),
            permit_outbox: permit_outbox::PermitOutbox::default(),
            routes,
            host,
        })
    }

    /// Tells the filter its root context's id. A host sets a tick for the effective context's root, so a
    /// filter that works during another root's callback (adopting what a deleted configuration left,
    /// from its `proxy_on_delete`) makes its own root effective first, and owns its tick.
    pub fn own_root_context(&mut self, context_id: u32) {
        self.root_context = Some(context_id);
    }

    /// The host this filter runs on.
    pub fn host(&self) -> &H {
        &self.host
    }

    /// `proxy_on_request_headers`: decides at once, or sends the request's calls and pauses.
    pub fn on_request_headers(&mut self, context_id: u32) -> Action {
        self.on_request_start(context_id, false)
    }

    /// `proxy_on_request_headers` with `body_follows` = not the end of the stream: decides (or sends the
    /// request's calls and pauses) now, or, when a rule of the request's route reads the request body and
    /// a body follows, lets the headers go on and holds the body until it has arrived
    /// ([`Filter::on_request_body`]; a host turns a pause in the headers into "stop all", which would hold
    /// the body from the filter too: proxy-wasm-cpp-host `convertVmCallResultToFilterHeadersStatus`).
    pub fn on_request_start(&mut self, context_id: u32, body_follows: bool) -> Action {
        self.confirm_client_id();
        if !self.ticking && tick::has_work(self) {
            // Work handed over while this root's tick could not be set (tick::start): set it now, from
            // one of this root's own requests.
            tick::start(self);
        }
        let Some(route) = self.select() else { return Action::Continue };
        let since_us = self.metrics.clock(&self.host);
        if let Some(action) = inflight::start(self, context_id, &route, body_follows, since_us) {
            return action;
        }
        self.start_rates(context_id, route, body_follows, since_us)
    }

    /// The rate rules' part of a request's start (after its in-flight permits, if any): decides now, or
    /// sends its calls and pauses, or, when a rule reads the request body and a body follows, lets the
    /// headers go on and holds the body until it has arrived.
    fn start_rates(&mut self, context_id: u32, route: Rc<Route>, body_follows: bool, since_us: u64) -> Action {
        if route.settles_from_body || route.reads_body {
            body::before_headers_go(self, &route, body_follows);
        }
        if route.reads_body && body_follows {
            return body::await_body(self, context_id, route, since_us);
        }
        self.decide(context_id, route, None, None, since_us)
    }

    /// `proxy_on_response_headers`: adds the rate limit headers of a request that was allowed.
    pub fn on_response_headers(&mut self, context_id: u32) -> Action {
        if !self.settling.is_empty() {
            settle::on_response_headers(self, context_id);
        }
        if self.response_headers.is_empty() {
            return Action::Continue;
        }
        let Some((route, report)) = self.response_headers.remove(&context_id) else { return Action::Continue };
        let mut headers = Headers::new();
        report.write_headers(&route.plan.headers, &mut headers);
        for (name, value) in headers {
            if self.host.add_response_header(name, &value).is_err() {
                metrics::host_refused(self, "proxy_add_header_map_value");
            }
        }
        Action::Continue
    }

    /// `proxy_on_done` / `proxy_on_delete` of an HTTP context: forgets the request (a reply still on its
    /// way is dropped when it arrives); what it took from leases goes back to them.
    pub fn on_done(&mut self, context_id: u32) {
        end::on_done(self, context_id);
        if !self.response_headers.is_empty() {
            self.response_headers.remove(&context_id);
        }
        if !self.settling.is_empty() {
            settle::on_done(self, context_id);
        }
        if !self.awaiting_body.is_empty() {
            self.awaiting_body.remove(&context_id);
        }
        if !self.early_bodies.is_empty() {
            self.early_bodies.remove(&context_id);
        }
        inflight::on_done(self, context_id);
        wait::on_done(self, context_id);
    }

    /// `proxy_on_http_call_response` (delivered to the root context): a reply of the HTTP bridge.
    pub fn on_http_call_response(&mut self, token: u32, num_headers: usize, body_size: usize) {
        let reply = http_bridge::read_reply(&self.host, num_headers, body_size);
        self.on_reply(CallId { kind: CallKind::Http, token }, reply);
    }

    /// `proxy_on_redis_call_response` (delivered to the root context): a reply of the host's Redis client.
    pub fn on_redis_call_response(&mut self, token: u32, status: u32, response_size: usize) {
        let reply = host_redis::read_reply(&self.host, status, response_size);
        self.on_reply(CallId { kind: CallKind::Redis, token }, reply);
    }

    /// `proxy_on_tick`: the deadline guard. Ends the calls of requests past their deadline (failure
    /// mode), delivers decisions the host refused before, gives up on give-backs never answered, and
    /// stops the tick when nothing waits.
    pub fn on_tick(&mut self) {
        let now_ms = self.host.now_ms();
        let due: Vec<u32> =
            self.flows.iter().filter(|(_, flow)| flow.due(now_ms)).map(|(&context_id, _)| context_id).collect();
        flow::end_flows(self, due);
        coalesce::expire(self, now_ms);
        late::expire(self, now_ms);
        wait::on_tick(self, now_ms);
        coalesce::send_overdue(self);
        outbox::send_queued(self, &self.coalescer.busy());
        give_back::expire_give_backs(self, now_ms);
        outbox::expire_batches(self, now_ms);
        inflight::on_tick(self, now_ms);
        if !self.awaiting_body.is_empty() {
            body::release_unfed(self, now_ms);
        }
        tick::stop_when_idle(self);
    }

    /// A reply (or failure) for this call: a give-back's, or a request's (fed to its flow, one step).
    fn on_reply(&mut self, id: CallId, reply: Result<Vec<u8>, Failure>) {
        let key = id.key();
        if !self.permit_outbox.is_idle() && permit_outbox::on_reply(self, key, &reply) {
            return;
        }
        if !self.give_backs.is_empty() {
            if let Some(call) = self.give_backs.remove(&key) {
                self.metrics.round_trip(&self.host, call.sent_us);
                give_back::on_give_back_reply(self, call, reply);
                return;
            }
        }
        if !self.give_back_batches.is_empty() {
            if let Some(batch) = self.give_back_batches.remove(&key) {
                self.metrics.round_trip(&self.host, batch.sent_us);
                outbox::on_batch_reply(self, batch, reply);
                return;
            }
        }
        let landed = self.coalescer.landed(key, self.host.now_ms());
        if let Some(batch) = self.coalescer.take_batch(key) {
            self.metrics.round_trip(&self.host, batch.sent_us);
            coalesce::on_batch_reply(self, key, batch, reply);
        } else if let Some((call, sent_us)) = self.calls.remove(&key) {
            self.metrics.round_trip(&self.host, sent_us);
            coalesce::deliver(self, Some(key), call, reply.as_deref().map_err(Clone::clone), true);
        } else {
            log(&self.host, LogLevel::Debug, &format!("a reply for unknown call {} was dropped", id.token));
        }
        if let Some(destination) = landed {
            coalesce::flush(self, destination, false);
        }
        inflight::answer_coalesced(self);
        flow::wake_parked(self);
    }

    /// The route of the current request: by route and domain when there are overrides.
    fn select(&self) -> Option<Rc<Route>> {
        if !self.routes.has_overrides() {
            return self.routes.global.clone();
        }
        let property =
            |path: &[&str]| self.host.property(path).ok().flatten().and_then(|bytes| String::from_utf8(bytes).ok());
        // Higress sets `route_name`; stock Envoy has `xds.route_name`.
        let route = property(&["route_name"]).or_else(|| property(&["xds", "route_name"]));
        let authority =
            self.host.request_header(":authority").ok().flatten().and_then(|bytes| String::from_utf8(bytes).ok());
        self.routes.select(route.as_deref(), authority.as_deref()).map(|(_, route)| Rc::clone(route))
    }
}
