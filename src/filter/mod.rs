//! The filter of one root context (one plugin configuration in one VM): configuration, transports,
//! metrics and logs, and every request's way through the limiters: start, pause, the replies, the
//! deadline guard, and the end (resume with rate limit headers, or a local reply).
//!
//! It sees the host only through [`Host`], so all of it runs natively against the fake host in the unit
//! tests. Every decision is made by [`crate::limiter`]; this module keeps the per-request state and moves
//! bytes between the limiter, the transports and the host.
//!
//! Replies flow one way: the host delivers a reply to the root context (`proxy_on_http_call_response`,
//! `proxy_on_redis_call_response`); the `abi` module hands it to [`Filter::on_http_call_response`] or
//! [`Filter::on_redis_call_response`]; the transport module reads its bytes; the filter finds the request
//! by the call's kind and token (its own call map), feeds the limiter and acts. The transports know nothing of
//! requests.
//!
//! Every request the filter pauses ends within `redis.timeout` (+ [`DEADLINE_GRACE_MS`] + one tick):
//! by its replies, or by the deadline guard, which runs on the root context's tick while any request is
//! paused and ends the calls still waiting as [`Failure::TimedOut`] (the failure mode then applies). A
//! decision the host refused to take (the switch to the request's context failed) is delivered again on
//! the next tick; the request is forgotten when the host deletes its context.

use crate::prelude::*;

use core::cell::{Cell, RefCell};

use arrayvec::ArrayVec;

use crate::block::{fnv1a, generation_of, same_bytes, Block, BlockTable};
use crate::cache::LimiterCache;
use crate::config::{FailureMode, HeaderStyle, Plugin, PluginConfig, TransportKind};
use crate::fallback::{Circuit, Local, LocalWindows};
use crate::host::{HeaderMap, Host, HostError, LogLevel};
use crate::host_redis::{self, HostRedis};
use crate::http_bridge::{self, HttpBridge};
use crate::id_map::{CallMap, IdMap};
use crate::key::RequestView;
use crate::lease::LeaseTable;
use crate::limiter::{
    self, Blocks, Decision, Effects, GiveBack, LeaseEnd, Leases, Outcome, PendingRequest, Plan, Progress, ReplyContext,
    Report, RuleOutcome, Start, Verdict,
};
use crate::quote::quoted;
use crate::response::{seconds_ceil, HeaderValue, Headers, MAX_HEADERS};
use crate::script::{Encoding, Invocation, Settlement, MEMBER_RANDOM_LEN};
use crate::transport::{CallId, CallKind, Failure};

#[cfg(all(test, not(target_arch = "wasm32")))]
mod interleavings;
mod metrics;
#[cfg(test)]
mod tests;

use metrics::{FailureLog, LimiterErrorLog, Metrics};

/// Prefix of every metric name; log lines start with `edge-rate-limiter: `.
pub const NAME: &str = "edge_rate_limiter";
/// Shared-data key of this gateway process's Redisson client id (shared by all VMs of the process).
pub const CLIENT_ID_KEY: &str = "edge_rate_limiter.client_id";
/// Period of the root context's tick while requests are paused, ms: the deadline guard's resolution.
pub const TICK_MS: u32 = 10;
/// What the filter logs (at error level) before the reason when it refuses a configuration.
pub const REFUSAL_PREFIX: &str = "edge-rate-limiter: invalid configuration: ";

/// Loads a plugin configuration as a build does in `proxy_on_configure`, without a host: parsed and
/// validated ([`Plugin::from_json`]), and refused when it needs what this build lacks (`transport: "host"`
/// without `host_redis_build`). Tools (`erl-admin validate`) refuse exactly what a gateway refuses.
///
/// # Errors
/// The reason, naming the field (`rules[0].rate: must be at least 1`): what the filter logs after
/// [`REFUSAL_PREFIX`].
pub fn load(configuration: &[u8], host_redis_build: bool) -> Result<Plugin, String> {
    let plugin = Plugin::from_json(configuration).map_err(|e| e.to_string())?;
    for (index, config) in plugin.configs() {
        if config.redis.transport == TransportKind::Host && !host_redis_build {
            let at = if index == 0 { String::new() } else { format!("_rules_[{}].", index - 1) };
            return Err(format!("{at}redis.transport: \"host\" needs the host-redis build (edge-rate-limiter-higress.wasm); this is the stock Envoy build, which supports \"http\""));
        }
    }
    Ok(plugin)
}

/// The request property naming the rule that rejected it: Envoy's access logs read it as
/// `%FILTER_STATE(wasm.edge_rate_limiter.rejected_by:PLAIN)%` (the host prefixes `wasm.`).
pub const REJECTED_BY_PROPERTY: &str = "edge_rate_limiter.rejected_by";
/// The request property naming the first shadow rule that would have rejected it (the request went on):
/// `%FILTER_STATE(wasm.edge_rate_limiter.shadow_rejected_by:PLAIN)%`.
pub const SHADOW_REJECTED_BY_PROPERTY: &str = "edge_rate_limiter.shadow_rejected_by";
/// How long after `redis.timeout` the guard ends a call still waiting, ms: the host's own timeout
/// (Envoy's 504, Higress's status 1) comes first and names the failure better.
pub const DEADLINE_GRACE_MS: u64 = 10;

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

/// The transport of one configuration (`redis.transport`).
#[derive(Debug)]
enum Transport {
    Http(HttpBridge),
    Host(HostRedis),
}

impl Transport {
    fn send(&self, host: &impl Host, command: &[u8]) -> Result<CallId, Failure> {
        match self {
            Transport::Http(bridge) => bridge.send(host, command),
            Transport::Host(client) => client.send(host, command),
        }
    }

    /// The wire form of the commands this transport carries.
    fn encoding(&self) -> Encoding {
        match self {
            Transport::Http(_) => Encoding::WebdisPath,
            Transport::Host(_) => Encoding::Resp,
        }
    }
}

/// What one configuration needs per request, prepared at configure: its transport, its plan (the
/// acquire command and headers of each rule, with this process's client id) and where its local blocks
/// live.
#[derive(Debug)]
struct Prepared {
    transport: Transport,
    plan: Plan,
    blocks: BlockTable,
    /// `failure_mode: "local"`: the local windows, and this VM's circuit breaker.
    fallback: Option<Fallback>,
}

/// The degraded mode of one configuration in this VM.
#[derive(Debug)]
struct Fallback {
    windows: LocalWindows,
    probe_interval_ms: u64,
    circuit: Cell<Circuit>,
}

/// The local blocks of one configuration, as a request sees them through the host's shared data.
struct SharedBlocks<'a, H: Host> {
    host: &'a H,
    table: BlockTable,
    /// The blocks this VM saw last ([`RecentBlocks`]).
    recent: &'a RefCell<RecentBlocks>,
}

impl<H: Host> Blocks for SharedBlocks<'_, H> {
    fn rejecting(&self, name: &str, now_ms: u64, permits: u64) -> Option<Block> {
        let hash = fnv1a(name.as_bytes());
        // A kept block that still rejects answers; one that would let the request through may be older than
        // the entry in shared data (another VM's later rejection saw fewer permits free): read that.
        if let Some(block) = self.recent.borrow().find(name, hash, now_ms).filter(|b| permits > b.available) {
            return Some(block);
        }
        let block = self.table.find_hashed(self.host, name, hash, now_ms)?;
        self.recent.borrow_mut().keep(name, hash, block);
        Some(block).filter(|b| permits > b.available)
    }
}

/// The live blocks this VM read or recorded last, kept in the VM ([`RecentBlocks::SLOTS`] entries, one per
/// value of the name's hash modulo that, the newest wins): under an attack on a few keys their requests are
/// rejected without a shared data read (a hostcall, and a call back into the module to allocate the value).
/// As exact as the entry it copies: what a block states (no permit leaves before its end, no more than
/// `available` free) stays true until its end whatever other VMs record meanwhile. A kept block that would
/// let a request through is not the last word: another VM may have recorded a newer one (fewer permits
/// free), so shared data is read then, as it is once the kept one has ended.
#[derive(Debug, Default)]
struct RecentBlocks {
    slots: [Option<(String, Block)>; RecentBlocks::SLOTS],
}

impl RecentBlocks {
    const SLOTS: usize = 8;

    fn slot(hash: u64) -> usize {
        (hash % RecentBlocks::SLOTS as u64) as usize
    }

    /// The live block of limiter `name` (whose [`fnv1a`] is `hash`) at `now_ms`, if kept.
    fn find(&self, name: &str, hash: u64, now_ms: u64) -> Option<Block> {
        match self.slots.get(Self::slot(hash)) {
            Some(Some((kept, block))) if now_ms < block.until_ms && same_bytes(kept.as_bytes(), name.as_bytes()) => {
                Some(*block)
            }
            _ => None,
        }
    }

    /// Keeps `block` of limiter `name` in its slot (reusing the slot's name buffer).
    fn keep(&mut self, name: &str, hash: u64, block: Block) {
        let Some(slot) = self.slots.get_mut(Self::slot(hash)) else { return };
        match slot {
            Some((kept, kept_block)) => {
                kept.clear();
                kept.push_str(name);
                *kept_block = block;
            }
            None => *slot = Some((name.into(), block)),
        }
    }
}

/// A give-back call on its way (sent again by source after `NOSCRIPT`).
#[derive(Debug)]
struct GiveBackCall {
    entry: usize,
    name: String,
    settlement: Settlement,
    retried: bool,
    kind: GiveBackKind,
    /// When the tick gives up on its reply, ms since the epoch (`redis.timeout` + the grace after sending).
    deadline_ms: u64,
}

/// What a give-back call returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum GiveBackKind {
    /// A member a request that did not go on added ([`GiveBack`]): counted in `compensations`.
    Request,
    /// A lease's settlement, or permits put back after it stopped serving ([`LeaseTable::take_outbox`]): its
    /// end is reported to the lease table; counted in `lease_settlements`.
    Lease,
    /// A lease of a filter that went away ([`Filter::adopt`]): counted in `lease_settlements`.
    Handed,
}

impl GiveBackCall {
    fn new(entry: usize, name: String, settlement: Settlement, kind: GiveBackKind) -> Self {
        GiveBackCall { entry, name, settlement, retried: false, kind, deadline_ms: 0 }
    }
}

/// What a filter that goes away leaves to the one that replaces it in the VM ([`Filter::retire`],
/// [`Filter::adopt`]): the settlements its leases still owe Redis, and where they go.
#[derive(Debug, Default)]
pub struct Retirement {
    /// The Redis its configurations reached (one entry per distinct `redis` section).
    redis: Vec<crate::config::RedisConfig>,
    /// Per limiter name, the settlement to send.
    settlements: Vec<(String, Settlement)>,
}

impl Retirement {
    /// Permits the settlements would return (lost if nobody sends them).
    pub fn unsettled_permits(&self) -> u64 {
        self.settlements.iter().map(|(_, s)| s.granted.saturating_sub(s.used)).sum()
    }
}

/// How a decided request ends: its verdict (headers are rendered when handed to the host).
type Next = Verdict;

/// Where a paused request stands.
#[derive(Debug)]
enum Stage {
    /// Waiting for the replies of its calls.
    Waiting(PendingRequest),
    /// Decided, but the host refused to switch to its context: delivered again on the next tick.
    Undelivered(Next),
}

/// A request the filter paused.
#[derive(Debug)]
struct Flow {
    /// Index of its configuration in [`Plugin::configs`].
    entry: usize,
    stage: Stage,
    /// Its outstanding calls ([`CallId::key`]).
    tokens: Vec<u64>,
    /// When the guard ends the calls still waiting, ms since the epoch.
    deadline_ms: u64,
}

/// An outstanding call: the request (HTTP context id) and the call index in its [`PendingRequest`].
#[derive(Debug, Clone, Copy)]
struct Call {
    context_id: u32,
    call: usize,
}

/// The serialized headers of a local reply and what they were rendered from.
struct LastReply {
    key: ReplyKey,
    headers: HeaderMap,
}

/// Everything a local reply's headers are rendered from, in the units they show (whole seconds): two
/// replies with equal keys have equal headers. Replies of more than [`ReplyKey::QUOTAS`] quotas are not
/// kept.
#[derive(Debug)]
struct ReplyKey {
    entry: usize,
    rate_limited: bool,
    retry_s: Option<u64>,
    rejected_by: Option<usize>,
    shadow_rejected_by: Option<usize>,
    count: usize,
    /// Rule, limit, window (ms: whether it is the configured one decides the policy's form), remaining,
    /// reset (s).
    quotas: [(usize, u64, u64, u64, u64); ReplyKey::QUOTAS],
}

impl ReplyKey {
    const QUOTAS: usize = 2;

    /// The key of a verdict's headers; `None` when it has too many quotas to keep.
    fn of(entry: usize, verdict: &Verdict) -> Option<Self> {
        let (report, rate_limited) = match verdict {
            Verdict::Continue { report } => (report, false),
            Verdict::Respond { report, rate_limited, .. } => (report, *rate_limited),
        };
        let mut key = ReplyKey {
            entry,
            rate_limited,
            retry_s: report.retry_ms.map(seconds_ceil),
            rejected_by: report.rejected_by,
            shadow_rejected_by: report.shadow_rejected_by,
            count: report.quotas.len(),
            quotas: [(0, 0, 0, 0, 0); ReplyKey::QUOTAS],
        };
        if key.count > ReplyKey::QUOTAS {
            return None;
        }
        for (slot, q) in key.quotas.iter_mut().zip(&report.quotas) {
            *slot = (q.rule, q.limit, q.window_ms, q.remaining, seconds_ceil(q.reset_ms));
        }
        Some(key)
    }

    /// Field by field (a derived comparison of the arrays calls `memcmp`, a byte loop in wasi-libc).
    fn same(&self, other: &ReplyKey) -> bool {
        self.entry == other.entry
            && self.rate_limited == other.rate_limited
            && self.retry_s == other.retry_s
            && self.rejected_by == other.rejected_by
            && self.shadow_rejected_by == other.shadow_rejected_by
            && self.count == other.count
            && self
                .quotas
                .iter()
                .zip(&other.quotas)
                .all(|(a, b)| a.0 == b.0 && a.1 == b.1 && a.2 == b.2 && a.3 == b.3 && a.4 == b.4)
    }
}

/// The filter of one root context.
pub struct Filter<H: Host> {
    host: H,
    plugin: Plugin,
    /// What each configuration needs per request, by the index of [`Plugin::configs`].
    prepared: Vec<(usize, Prepared)>,
    metrics: Metrics,
    cache: LimiterCache,
    failure_log: FailureLog,
    random: fastrand::Rng,
    client_id: String,
    client_id_confirmed: bool,
    /// Paused requests, by HTTP context id.
    flows: IdMap<Flow>,
    /// Outstanding calls, by [`CallId::key`]: the kind and the token (each kind has its own numbering).
    calls: CallMap<Call>,
    /// What the rate limit headers of resumed requests report (with their configuration's index), added
    /// when their response headers arrive.
    response_headers: IdMap<(usize, Report)>,
    /// Whether the tick is on (it runs only while requests are paused).
    ticking: bool,
    /// Whether a refused hostcall was logged (once per configuration).
    host_error_logged: bool,
    /// The headers of the last local reply, serialized.
    last_reply: Option<LastReply>,
    /// The blocks this VM saw last (read from shared data or recorded).
    recent_blocks: RefCell<RecentBlocks>,
    /// This VM's permit leases.
    leases: LeaseTable,
    /// Limiters whose lease acquire just ended: requests parked on them go on ([`Filter::wake_parked`]).
    ended_leases: Vec<String>,
    /// Outstanding give-back calls, by [`CallId::key`]: the configuration, limiter and member (sent again by
    /// source after `NOSCRIPT`).
    give_backs: CallMap<GiveBackCall>,
    /// Limiters whose keys raised a Redis error, logged once each.
    limiter_errors: LimiterErrorLog,
    /// Where a request's limiter names are written (one allocation, reused).
    name_buffer: String,
}

impl<H: Host> Filter<H> {
    /// Parses and validates the plugin configuration and sets the filter up: transports (a host Redis
    /// client is initialised at once), counters, this process's Redisson client id.
    ///
    /// `host_redis_build`: whether this build has the Higress Redis calls (`transport: "host"` is refused
    /// otherwise).
    ///
    /// # Errors
    /// The reason the configuration is refused, naming the field (`rules[0].rate: must be at least 1`).
    pub fn configure(host: H, configuration: &[u8], host_redis_build: bool) -> Result<Self, String> {
        let plugin = load(configuration, host_redis_build)?;
        let mut random = fastrand::Rng::with_seed(host.random_seed());
        let client_id = client_id(&host, &mut random);
        let generation = generation_of(configuration);
        let prepared = plugin
            .configs()
            .map(|(index, config)| {
                let transport = match config.redis.transport {
                    TransportKind::Http => Transport::Http(HttpBridge::new(&config.redis)),
                    TransportKind::Host => {
                        let client = HostRedis::new(&config.redis);
                        if let Err(why) = client.init(&host) {
                            log(&host, LogLevel::Warn, &format!("{why}; retrying on the next request"));
                        }
                        Transport::Host(client)
                    }
                };
                let blocks = BlockTable { slots: config.local_block_slots, generation };
                let fallback = config.local_fallback.map(|settings| Fallback {
                    windows: LocalWindows { slots: settings.slots, generation, gateways: settings.gateways },
                    probe_interval_ms: settings.probe_interval_ms,
                    circuit: Cell::default(),
                });
                (index, Prepared { transport, plan: Plan::new(config, &client_id), blocks, fallback })
            })
            .collect();
        let global = match &plugin.global {
            Some(config) => {
                format!("{} rule(s), Redis via cluster {}", config.rules.len(), quoted(&config.redis.cluster))
            }
            None => "no global rules".to_string(),
        };
        log(
            &host,
            LogLevel::Info,
            &format!("configured {global}, {} route/domain override(s)", plugin.overrides.len()),
        );
        Ok(Filter {
            metrics: Metrics::define(&host, &plugin),
            cache: LimiterCache::new(
                plugin.configs().map(|(_, c)| c.cache_size).max().unwrap_or(1),
                [random.u64(..), random.u64(..)],
            ),
            failure_log: FailureLog::default(),
            limiter_errors: LimiterErrorLog::default(),
            random,
            client_id,
            client_id_confirmed: false,
            flows: IdMap::default(),
            calls: CallMap::default(),
            response_headers: IdMap::default(),
            ticking: false,
            host_error_logged: false,
            last_reply: None,
            recent_blocks: RefCell::default(),
            leases: LeaseTable::default(),
            give_backs: CallMap::default(),
            ended_leases: Vec::new(),
            name_buffer: String::new(),
            prepared,
            plugin,
            host,
        })
    }

    /// The host this filter runs on.
    pub fn host(&self) -> &H {
        &self.host
    }

    /// `proxy_on_request_headers`: decides at once, or sends one acquire per rule and pauses.
    pub fn on_request_headers(&mut self, context_id: u32) -> Action {
        self.confirm_client_id();
        let Some((entry, config)) = select(&self.host, &self.plugin) else { return Action::Continue };
        let Some(prepared) = self.prepared.iter().find(|(index, _)| *index == entry).map(|(_, p)| p) else {
            return Action::Continue;
        };
        let now_ms = self.host.now_ms();
        let skip_redis = prepared.fallback.as_ref().is_some_and(|fallback| {
            let mut circuit = fallback.circuit.get();
            let skip = circuit.skip_redis(now_ms, fallback.probe_interval_ms);
            fallback.circuit.set(circuit);
            skip
        });
        let start = {
            let random = &mut self.random;
            let blocks = SharedBlocks { host: &self.host, table: prepared.blocks, recent: &self.recent_blocks };
            let leases = &self.leases;
            let ctx = limiter::Context { config, plan: &prepared.plan, now_ms, blocks: &blocks, leases, skip_redis };
            limiter::start(&ctx, &HostRequest(&self.host), &mut || member_random(random), &mut self.name_buffer)
        };
        let (pending, sends) = match start {
            Start::Decided(decision) => {
                let next = self.finish(entry, decision);
                return self.end_in_callback(context_id, entry, next);
            }
            Start::Send(pending, sends) => (pending, sends),
        };
        // A request parked on a lease acquire waits as long as a call of its own would.
        let timeout_ms = self.plugin.config(entry).map_or(0, |c| c.redis.timeout_ms);
        let deadline_ms = now_ms.saturating_add(timeout_ms).saturating_add(DEADLINE_GRACE_MS);
        let mut flow = Flow { entry, stage: Stage::Waiting(pending), tokens: Vec::new(), deadline_ms };
        let mut decided = None;
        for call in 0..sends {
            let progress = self.send(context_id, &mut flow, call, Invocation::BySha);
            if let Some(decision) = self.drive(context_id, &mut flow, progress) {
                decided = Some(decision);
            }
        }
        let action = match decided {
            Some(decision) => {
                self.forget_calls(&flow);
                let next = self.finish(entry, decision);
                self.end_in_callback(context_id, entry, next)
            }
            None => {
                self.pause(context_id, flow);
                Action::Pause
            }
        };
        self.wake_parked();
        self.send_lease_settlements(entry);
        action
    }

    /// `proxy_on_response_headers`: adds the rate limit headers of a request that was allowed.
    pub fn on_response_headers(&mut self, context_id: u32) -> Action {
        if self.response_headers.is_empty() {
            return Action::Continue;
        }
        let Some((entry, report)) = self.response_headers.remove(&context_id) else { return Action::Continue };
        let (Some(config), Some(prepared)) = (self.plugin.config(entry), self.prepared(entry)) else {
            return Action::Continue;
        };
        let mut headers = Headers::new();
        report.write_headers(config, &prepared.plan, &mut headers);
        for (name, value) in headers {
            if self.host.add_response_header(name, &value).is_err() {
                self.host_refused("proxy_add_header_map_value");
            }
        }
        Action::Continue
    }

    /// `proxy_on_done` / `proxy_on_delete` of an HTTP context: forgets the request (a reply still on its
    /// way is dropped when it arrives).
    pub fn on_done(&mut self, context_id: u32) {
        if !self.flows.is_empty() {
            if let Some(flow) = self.flows.remove(&context_id) {
                self.forget_calls(&flow);
                self.abandon_leases(&flow);
                // The request never went upstream: what it took from leases goes back to them.
                if let (Stage::Waiting(pending), Some(config)) = (&flow.stage, self.plugin.config(flow.entry)) {
                    for ticket in pending.lease_tickets(config) {
                        self.put_back(&ticket);
                    }
                }
                self.send_lease_settlements(flow.entry);
                self.wake_parked();
            }
        }
        if !self.response_headers.is_empty() {
            self.response_headers.remove(&context_id);
        }
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
    /// mode), delivers decisions the host refused before, and stops the tick when nothing is paused.
    pub fn on_tick(&mut self) {
        let now_ms = self.host.now_ms();
        let due: Vec<u32> = self
            .flows
            .iter()
            .filter(|(_, flow)| matches!(flow.stage, Stage::Undelivered(_)) || flow.deadline_ms <= now_ms)
            .map(|(&context_id, _)| context_id)
            .collect();
        self.end_flows(due);
        // A give-back never answered: its permits stay taken until they leave the window.
        let late: Vec<u64> =
            self.give_backs.iter().filter(|(_, call)| call.deadline_ms <= now_ms).map(|(&key, _)| key).collect();
        for key in late {
            if let Some(call) = self.give_backs.remove(&key) {
                self.give_back_failed(call, &Failure::TimedOut);
            }
        }
        if self.flows.is_empty()
            && self.give_backs.is_empty()
            && self.ticking
            && self.host.set_tick_period_ms(0).is_ok()
        {
            self.ticking = false;
        }
    }

    /// Ends these paused requests now: a decision the host refused before is delivered, a request still
    /// waiting ends its calls as timed out (each a failed call) and follows the failure mode.
    fn end_flows(&mut self, context_ids: Vec<u32>) {
        for context_id in context_ids {
            let Some(flow) = self.flows.remove(&context_id) else { continue };
            self.forget_calls(&flow);
            self.abandon_leases(&flow);
            let next = match flow.stage {
                Stage::Undelivered(next) => next,
                Stage::Waiting(mut pending) => {
                    let (Some(config), Some(prepared)) = (self.plugin.config(flow.entry), self.prepared(flow.entry))
                    else {
                        continue;
                    };
                    let (decision, unanswered) = pending.expire(config, &prepared.plan);
                    if unanswered > 0 {
                        let mode = config.failure_mode;
                        self.metrics.redis_errors(&self.host, unanswered);
                        self.failure_log.failed(&self.host, &Failure::TimedOut, mode);
                    }
                    self.finish(flow.entry, decision)
                }
            };
            self.end_from_root(context_id, flow.entry, next);
        }
        self.wake_parked();
    }

    /// A reply (or failure) for this call.
    fn on_reply(&mut self, id: CallId, reply: Result<Vec<u8>, Failure>) {
        let key = id.key();
        if !self.give_backs.is_empty() {
            if let Some(call) = self.give_backs.remove(&key) {
                self.on_give_back_reply(call, reply);
                return;
            }
        }
        let Some(Call { context_id, call }) = self.calls.remove(&key) else {
            log(&self.host, LogLevel::Debug, &format!("a reply for unknown call {} was dropped", id.token));
            return;
        };
        // The request may be gone (the client left): nothing to resume then.
        let Some(mut flow) = self.flows.remove(&context_id) else { return };
        flow.tokens.retain(|&t| t != key);
        if reply.as_deref().is_ok_and(|bytes| bytes.starts_with(b"-NOAUTH")) {
            if let Some(Transport::Host(client)) = self.prepared(flow.entry).map(|p| &p.transport) {
                client.reconnect();
            }
        }
        let progress = self.feed(&mut flow, call, reply.as_deref().map_err(Clone::clone));
        let entry = flow.entry;
        match self.drive(context_id, &mut flow, progress) {
            None => self.pause(context_id, flow),
            Some(decision) => {
                self.forget_calls(&flow);
                let next = self.finish(flow.entry, decision);
                self.end_from_root(context_id, flow.entry, next);
            }
        }
        self.wake_parked();
        self.send_lease_settlements(entry);
    }

    /// A request that goes away (answered at its deadline, or its client left) with lease acquires on their
    /// way: nobody will hear of them, so the requests parked on them are woken to ask Redis themselves.
    fn abandon_leases(&mut self, flow: &Flow) {
        if let Stage::Waiting(pending) = &flow.stage {
            for (name, settled) in pending.leases_waiting() {
                // Whether Redis ran the settlement it carried is unknown: it is sent again (safely).
                self.leases.end(&name, None, settled.map(|random| (random, false)));
                self.ended_leases.push(name);
            }
        }
    }

    /// Requests parked on a lease acquire that ended go on: served from the new lease, or each asking Redis
    /// (README.md, "Leases"). A woken request keeps the deadline it had when it arrived, so it still ends
    /// within `redis.timeout` of its start (+ the grace and a tick), in the failure mode if need be.
    fn wake_parked(&mut self) {
        while let Some(name) = self.ended_leases.pop() {
            let parked: Vec<u32> = self
                .flows
                .iter()
                .filter(|(_, flow)| matches!(&flow.stage, Stage::Waiting(pending) if pending.parked_on(&name)))
                .map(|(&context_id, _)| context_id)
                .collect();
            for context_id in parked {
                let Some(mut flow) = self.flows.remove(&context_id) else { continue };
                let now_ms = self.host.now_ms();
                let (Stage::Waiting(pending), Some(config), Some(prepared)) =
                    (&mut flow.stage, self.plugin.config(flow.entry), self.prepared(flow.entry))
                else {
                    continue;
                };
                let (sends, progress) = pending.unpark(&name, config, &prepared.plan, &self.leases, now_ms);
                let mut decided = match progress {
                    Progress::Done(decision) => Some(decision),
                    _ => None,
                };
                let deadline_ms = flow.deadline_ms;
                for send in sends {
                    let progress = self.send(context_id, &mut flow, send, Invocation::BySha);
                    if let Some(decision) = self.drive(context_id, &mut flow, progress) {
                        decided = Some(decision);
                    }
                }
                flow.deadline_ms = deadline_ms;
                match decided {
                    None => self.pause(context_id, flow),
                    Some(decision) => {
                        self.forget_calls(&flow);
                        let next = self.finish(flow.entry, decision);
                        self.end_from_root(context_id, flow.entry, next);
                    }
                }
            }
        }
    }

    fn prepared(&self, entry: usize) -> Option<&Prepared> {
        self.prepared.iter().find(|(index, _)| *index == entry).map(|(_, prepared)| prepared)
    }

    /// VMs may have raced to publish their client id while starting; by the first request the stored one
    /// is final, so each VM adopts it once.
    fn confirm_client_id(&mut self) {
        if !self.client_id_confirmed {
            self.client_id_confirmed = true;
            if let Ok((Some(stored), _)) = self.host.get_shared_data(CLIENT_ID_KEY) {
                if let Ok(stored) = String::from_utf8(stored) {
                    if stored != self.client_id {
                        for (index, prepared) in &mut self.prepared {
                            if let Some(config) = self.plugin.config(*index) {
                                prepared.plan = Plan::new(config, &stored);
                            }
                        }
                        self.client_id = stored;
                    }
                }
            }
        }
    }

    /// Sends a call's acquire; a refused send is that call's failure.
    fn send(&mut self, context_id: u32, flow: &mut Flow, call: usize, invocation: Invocation) -> Progress {
        let sent = match (self.prepared(flow.entry), &flow.stage) {
            (Some(prepared), Stage::Waiting(pending)) => {
                match pending.encode(call, invocation, prepared.transport.encoding(), &prepared.plan) {
                    Some(command) => prepared.transport.send(&self.host, &command),
                    None => return Progress::Waiting,
                }
            }
            _ => Err(Failure::SendRefused("no transport for this configuration".into())),
        };
        match sent {
            Ok(id) => {
                self.metrics.redis_call(&self.host);
                self.calls.insert(id.key(), Call { context_id, call });
                flow.tokens.push(id.key());
                let timeout_ms = self.plugin.config(flow.entry).map_or(0, |c| c.redis.timeout_ms);
                let deadline = self.host.now_ms().saturating_add(timeout_ms).saturating_add(DEADLINE_GRACE_MS);
                flow.deadline_ms = flow.deadline_ms.max(deadline);
                Progress::Waiting
            }
            Err(failure) => self.feed(flow, call, Err(failure)),
        }
    }

    /// Hands one call's reply (or failure) to the request's pending acquires; logs what is worth it.
    fn feed(&mut self, flow: &mut Flow, call: usize, reply: Result<&[u8], Failure>) -> Progress {
        let prepared = self.prepared.iter().find(|(index, _)| *index == flow.entry).map(|(_, p)| p);
        let (Stage::Waiting(pending), Some(config), Some(prepared)) =
            (&mut flow.stage, self.plugin.config(flow.entry), prepared)
        else {
            return Progress::Waiting;
        };
        let now_ms = self.host.now_ms();
        let ctx = ReplyContext { config, plan: &prepared.plan, now_ms };
        let (progress, effects) = pending.on_reply(call, reply, &ctx, &mut self.cache);
        if effects.failed() {
            self.metrics.redis_errors(&self.host, 1);
        }
        let Effects { notices, blocks, leases, call_failure, limiter_errors } = effects;
        if let Some(failure) = &call_failure {
            self.failure_log.failed(&self.host, failure, config.failure_mode);
        }
        for error in &limiter_errors {
            let rule = config.rules.get(error.rule).map_or("", |r| r.name.as_str());
            self.limiter_errors.failed(&self.host, rule, error, config.failure_mode);
        }
        for notice in notices {
            log(&self.host, LogLevel::Warn, &notice.to_string());
        }
        for (name, block) in blocks {
            prepared.blocks.record(&self.host, &name, block, now_ms);
            self.recent_blocks.borrow_mut().keep(&name, fnv1a(name.as_bytes()), block);
        }
        for LeaseEnd { name, grant, settled } in leases {
            if grant.is_some() {
                self.metrics.lease(&self.host);
            }
            self.leases.end(&name, grant, settled);
            self.ended_leases.push(name);
        }
        progress
    }

    /// Follows the progress until the request waits for Redis or is decided.
    fn drive(&mut self, context_id: u32, flow: &mut Flow, mut progress: Progress) -> Option<Decision> {
        loop {
            progress = match progress {
                Progress::Resend(call) => self.send(context_id, flow, call, Invocation::BySource),
                Progress::Waiting => return None,
                Progress::Done(decision) => return Some(decision),
            };
        }
    }

    /// Counts and logs a decision, gives back what a request that does not go on took, and says how the
    /// request ends.
    fn finish(&mut self, entry: usize, mut decision: Decision) -> Next {
        self.decide_locally(entry, &mut decision);
        self.metrics.decided(&self.host, decision.outcome);
        for &(rule, outcome) in &decision.rules {
            self.metrics.rule(&self.host, entry, rule, outcome);
        }
        let goes_on = matches!(decision.verdict, Verdict::Continue { .. });
        for ticket in &decision.leases {
            if goes_on {
                self.leases.commit(ticket);
            } else {
                self.put_back(ticket);
            }
        }
        if !goes_on {
            for GiveBack { name, settlement } in decision.give_back {
                self.send_give_back(GiveBackCall::new(entry, name, settlement, GiveBackKind::Request));
            }
        }
        self.send_lease_settlements(entry);
        if !decision.redis_failed && matches!(decision.outcome, Outcome::Allowed | Outcome::Rejected) {
            self.failure_log.recovered(&self.host);
        }
        decision.verdict
    }

    /// Puts a lease ticket back into its own lease; one whose lease is forgotten is counted as lost.
    fn put_back(&mut self, ticket: &crate::lease::LeaseTicket) {
        if !self.leases.put_back(ticket) {
            self.metrics.lease_permits_lost(&self.host, ticket.permits);
        }
    }

    /// Sends what the leases owe Redis on their own (settlements, permits put back after a lease stopped
    /// serving) through configuration `entry`'s transport.
    fn send_lease_settlements(&mut self, entry: usize) {
        for (name, settlement) in self.leases.take_outbox() {
            self.send_give_back(GiveBackCall::new(entry, name, settlement, GiveBackKind::Lease));
        }
    }

    /// This filter goes away (its root context is deleted, or a new configuration replaces it): its paused
    /// requests end now (as at their deadline: the failure mode), and its leases are settled as they stand,
    /// to be sent by the filter that takes its place ([`Filter::adopt`]).
    pub fn retire(&mut self) -> Retirement {
        let paused: Vec<u32> = self.flows.keys().copied().collect();
        self.end_flows(paused);
        let mut redis: Vec<crate::config::RedisConfig> = Vec::new();
        for (_, config) in self.plugin.configs() {
            if !redis.contains(&config.redis) {
                redis.push(config.redis.clone());
            }
        }
        Retirement { redis, settlements: self.leases.retire_all() }
    }

    /// Sends the settlements a filter that went away left ([`Filter::retire`]) through a configuration of
    /// this filter that reaches the same Redis (the same `redis` section); when none does, or the old
    /// filter reached several, their permits are counted as lost (`lease_permits_lost`): they return when
    /// their members leave the window.
    pub fn adopt(&mut self, retirement: Retirement) {
        let entry = match retirement.redis.as_slice() {
            [only] => self.plugin.configs().find(|(_, config)| config.redis == *only).map(|(index, _)| index),
            _ => None,
        };
        match entry {
            Some(entry) => {
                for (name, settlement) in retirement.settlements {
                    self.send_give_back(GiveBackCall::new(entry, name, settlement, GiveBackKind::Handed));
                }
            }
            None => self.metrics.lease_permits_lost(&self.host, retirement.unsettled_permits()),
        }
    }

    /// Counts a retirement nobody adopts (no other configuration in the VM) as lost permits.
    pub fn drop_retirement(&self, retirement: &Retirement) {
        self.metrics.lease_permits_lost(&self.host, retirement.unsettled_permits());
    }

    /// `failure_mode: "local"`: moves the circuit (a failed call opens it, a decision of Redis closes it) and
    /// decides the rules Redis could not ([`Outcome::Local`]) with the local windows: every one is asked
    /// (each counts as its window decides), and the request is admitted if every one admits; else it is
    /// refused as a rejection, and what the other rules took (windows and Redis) is given back.
    fn decide_locally(&mut self, entry: usize, decision: &mut Decision) {
        let (Some(fallback), Some(config)) =
            (self.prepared(entry).and_then(|p| p.fallback.as_ref()), self.plugin.config(entry))
        else {
            return;
        };
        let now_ms = self.host.now_ms();
        let mut circuit = fallback.circuit.get();
        if decision.redis_failed {
            circuit.failed(now_ms, fallback.probe_interval_ms);
        } else if matches!(decision.outcome, Outcome::Allowed | Outcome::Rejected) {
            circuit.succeeded();
        }
        fallback.circuit.set(circuit);
        if decision.outcome != Outcome::Local {
            return;
        }
        let mut admitted = Vec::new();
        let mut refused: Option<(usize, u64)> = None;
        for (index, name) in &decision.local {
            let Some(rule) = config.rules.get(*index) else { continue };
            match fallback.windows.acquire(&self.host, name, rule.rate, rule.interval_ms, rule.permits, now_ms) {
                Local::Admitted => {
                    admitted.push((name, rule));
                    decision.rules.push((*index, RuleOutcome::Allowed));
                }
                Local::Refused { retry_ms } => {
                    decision.rules.push((*index, RuleOutcome::Rejected));
                    refused = Some(refused.map_or((*index, retry_ms), |(first, ms)| (first, ms.max(retry_ms))));
                }
            }
        }
        let Some((rule, retry_ms)) = refused else {
            decision.outcome = Outcome::LocallyAllowed;
            decision.give_back.clear();
            return;
        };
        for (name, admitted_rule) in admitted {
            fallback.windows.release(&self.host, name, admitted_rule.interval_ms, admitted_rule.permits, now_ms);
        }
        let Some(prepared) = self.prepared(entry) else { return };
        let report = Report { retry_ms: Some(retry_ms), rejected_by: Some(rule), ..Report::default() };
        decision.verdict = Verdict::Respond {
            status: config.rejection.status,
            report,
            rate_limited: true,
            body: alloc::rc::Rc::clone(&prepared.plan.rejection_body),
        };
        decision.outcome = Outcome::LocallyRefused;
    }

    /// Keeps a request paused until its replies or its deadline; the tick runs while any is paused.
    fn pause(&mut self, context_id: u32, flow: Flow) {
        self.flows.insert(context_id, flow);
        self.start_tick();
    }

    /// Turns the tick on (the deadline guard of paused requests and give-backs), if it is off.
    fn start_tick(&mut self) {
        if !self.ticking {
            match self.host.set_tick_period_ms(TICK_MS) {
                Ok(()) => self.ticking = true,
                Err(_) => self.host_refused("proxy_set_tick_period_milliseconds"),
            }
        }
    }

    /// Ends a request from its own callback (`proxy_on_request_headers`): the context is effective.
    fn end_in_callback(&mut self, context_id: u32, entry: usize, next: Next) -> Action {
        self.record_rule(entry, &next);
        match next {
            Verdict::Continue { report } => {
                self.remember_headers(context_id, entry, report);
                Action::Continue
            }
            respond => {
                self.respond(entry, &respond);
                Action::Pause
            }
        }
    }

    /// Ends a paused request from a callback of the root context: switches to the request's context,
    /// then resumes or answers it. If the host refuses the switch, the decision waits for the next tick.
    fn end_from_root(&mut self, context_id: u32, entry: usize, next: Next) {
        if self.host.set_effective_context(context_id).is_err() {
            self.host_refused("proxy_set_effective_context");
            let flow = Flow { entry, stage: Stage::Undelivered(next), tokens: Vec::new(), deadline_ms: 0 };
            self.pause(context_id, flow);
            return;
        }
        self.record_rule(entry, &next);
        match next {
            Verdict::Continue { report } => {
                self.remember_headers(context_id, entry, report);
                if self.host.resume_request().is_err() {
                    self.host_refused("proxy_continue_stream");
                }
            }
            respond => self.respond(entry, &respond),
        }
    }

    /// Names the rule that rejected the effective request, or the shadow rule that would have, in its
    /// filter state for access logs ([`REJECTED_BY_PROPERTY`], [`SHADOW_REJECTED_BY_PROPERTY`]).
    fn record_rule(&mut self, entry: usize, verdict: &Verdict) {
        let (path, rule) = match verdict {
            Verdict::Respond { report, .. } => (REJECTED_BY_PROPERTY, report.rejected_by),
            Verdict::Continue { report } => (SHADOW_REJECTED_BY_PROPERTY, report.shadow_rejected_by),
        };
        let Some(name) =
            rule.and_then(|rule| self.prepared(entry)?.plan.rules.get(rule).map(|r| alloc::rc::Rc::clone(&r.name)))
        else {
            return;
        };
        if self.host.set_property(path, name.as_bytes()).is_err() {
            self.host_refused("proxy_set_property");
        }
    }

    fn remember_headers(&mut self, context_id: u32, entry: usize, report: Report) {
        let style = self.plugin.config(entry).map_or(HeaderStyle::None, |c| c.headers);
        let shadow = report.shadow_rejected_by.is_some() && self.plugin.config(entry).is_some_and(|c| c.shadow_headers);
        if (!report.quotas.is_empty() && style != HeaderStyle::None) || shadow {
            self.response_headers.insert(context_id, (entry, report));
        }
    }

    /// Answers the effective context's request locally, as `text/plain`, with the verdict's headers. The
    /// headers are rendered and serialized once per distinct reply: under an attack on one key, the
    /// rejections of one second are alike and reuse the last one's ([`LastReply`]).
    fn respond(&mut self, entry: usize, verdict: &Verdict) {
        let Verdict::Respond { status, body, .. } = verdict else { return };
        let key = ReplyKey::of(entry, verdict);
        let kept = match (&self.last_reply, &key) {
            (Some(last), Some(key)) => last.key.same(key),
            _ => false,
        };
        if !kept {
            let mut headers = match (self.plugin.config(entry), self.prepared(entry)) {
                (Some(config), Some(prepared)) => verdict.headers(config, &prepared.plan),
                _ => Headers::new(),
            };
            headers.push(CONTENT_TYPE);
            let pairs: ArrayVec<(&str, &str), MAX_HEADERS> = headers.iter().map(|(k, v)| (*k, &**v)).collect();
            let headers = HeaderMap::new(&pairs);
            let Some(key) = key else {
                if self.host.send_local_reply(*status, &headers, body.as_bytes()).is_err() {
                    self.host_refused("proxy_send_local_response");
                }
                return;
            };
            self.last_reply = Some(LastReply { key, headers });
        }
        let Some(last) = &self.last_reply else { return };
        if self.host.send_local_reply(*status, &last.headers, body.as_bytes()).is_err() {
            self.host_refused("proxy_send_local_response");
        }
    }

    /// Sends a give-back call (by sha, or by source after `NOSCRIPT`); counted once in `compensations`, not
    /// again when sent by source. Nobody waits for it: a failure is counted in `redis_errors` and logged
    /// once as other failures are.
    fn send_give_back(&mut self, mut call: GiveBackCall) {
        let Some(prepared) = self.prepared(call.entry) else { return };
        let invocation = if call.retried { Invocation::BySource } else { Invocation::BySha };
        let Some(template) = prepared.plan.rules.first().map(|rule| &rule.template) else { return };
        let bytes = call.settlement.encode(&call.name, template, invocation, prepared.transport.encoding());
        match prepared.transport.send(&self.host, &bytes) {
            Ok(id) => {
                self.metrics.redis_call(&self.host);
                if !call.retried {
                    match call.kind {
                        GiveBackKind::Request => self.metrics.compensation(&self.host),
                        GiveBackKind::Lease | GiveBackKind::Handed => self.metrics.lease_settlement(&self.host),
                    }
                }
                let timeout_ms = self.plugin.config(call.entry).map_or(0, |c| c.redis.timeout_ms);
                call.deadline_ms = self.host.now_ms().saturating_add(timeout_ms).saturating_add(DEADLINE_GRACE_MS);
                self.give_backs.insert(id.key(), call);
                self.start_tick();
            }
            Err(failure) => self.give_back_failed(call, &failure),
        }
    }

    fn on_give_back_reply(&mut self, mut call: GiveBackCall, reply: Result<Vec<u8>, Failure>) {
        let failure = match reply {
            Err(failure) => failure,
            Ok(bytes) if bytes.first() == Some(&b':') => {
                if call.kind == GiveBackKind::Lease {
                    self.leases.settled(&call.name, &call.settlement.random, true);
                    self.send_lease_settlements(call.entry);
                }
                return;
            }
            Ok(bytes) if bytes.starts_with(b"-NOSCRIPT") && !call.retried => {
                call.retried = true;
                self.send_give_back(call);
                return;
            }
            Ok(_) => Failure::BadReply("the give-back script answered an error".into()),
        };
        self.give_back_failed(call, &failure);
    }

    /// A give-back call that failed (or never answered): counted in `redis_errors`, logged once per cause; a
    /// lease's settlement waits for the next acquire of its limiter.
    fn give_back_failed(&mut self, call: GiveBackCall, failure: &Failure) {
        self.metrics.redis_errors(&self.host, 1);
        let mode = self.plugin.config(call.entry).map_or(FailureMode::Allow, |c| c.failure_mode);
        self.failure_log.failed(&self.host, failure, mode);
        if call.kind == GiveBackKind::Lease {
            self.leases.settled(&call.name, &call.settlement.random, false);
        }
    }

    fn forget_calls(&mut self, flow: &Flow) {
        for token in &flow.tokens {
            self.calls.remove(token);
        }
    }

    /// Counts a hostcall the host refused on a request's path; the first one is logged.
    fn host_refused(&mut self, call: &str) {
        self.metrics.host_error(&self.host);
        if !self.host_error_logged {
            self.host_error_logged = true;
            log(
                &self.host,
                LogLevel::Warn,
                &format!("the host refused {call} for a request; such refusals are counted in {NAME}.host_errors"),
            );
        }
    }
}

/// The configuration for the current request: by route and domain when there are overrides.
fn select<'p>(host: &impl Host, plugin: &'p Plugin) -> Option<(usize, &'p PluginConfig)> {
    if !plugin.has_overrides() {
        return plugin.global.as_ref().map(|config| (0, config));
    }
    let property = |path: &[&str]| host.property(path).ok().flatten().and_then(|bytes| String::from_utf8(bytes).ok());
    // Higress sets `route_name`; stock Envoy has `xds.route_name`.
    let route = property(&["route_name"]).or_else(|| property(&["xds", "route_name"]));
    let authority = host.request_header(":authority").ok().flatten().and_then(|bytes| String::from_utf8(bytes).ok());
    plugin.select(route.as_deref(), authority.as_deref())
}

/// Every local reply is `text/plain`.
const CONTENT_TYPE: (&str, HeaderValue) = ("content-type", HeaderValue::Static("text/plain"));

/// The request as the host shows it (the effective context's headers and properties).
struct HostRequest<'a, H: Host>(&'a H);

impl<H: Host> RequestView for HostRequest<'_, H> {
    fn header(&self, name: &str) -> Option<Vec<u8>> {
        self.0.request_header(name).ok().flatten()
    }

    fn source_address(&self) -> Option<String> {
        let bytes = self.0.property(&["source", "address"]).ok().flatten()?;
        String::from_utf8(bytes).ok()
    }
}

/// The random part of a permit member: 16 letters and digits (webdis's path form carries them as they
/// are), 8 base-62 digits from each of two random u64 (95 bits of randomness; Redisson uses 16 random bytes:
/// members only need to differ between the acquires of one window).
fn member_random(random: &mut fastrand::Rng) -> [u8; MEMBER_RANDOM_LEN] {
    const DIGITS: &[u8; 62] = b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz";
    let mut bytes = [0u8; MEMBER_RANDOM_LEN];
    for half in bytes.chunks_mut(8) {
        let mut word = random.u64(..);
        for byte in half {
            *byte = DIGITS.get((word % 62) as usize).copied().unwrap_or(b'0');
            word /= 62;
        }
    }
    bytes
}

/// This process's Redisson client id: the one in shared data, or a new random UUID (version 4) published
/// there. Redisson uses its client instance's UUID string the same way (PER_CLIENT keys).
fn client_id(host: &impl Host, random: &mut fastrand::Rng) -> String {
    if let Ok((Some(stored), _)) = host.get_shared_data(CLIENT_ID_KEY) {
        if let Ok(stored) = String::from_utf8(stored) {
            return stored;
        }
    }
    let mut bytes = [0u8; 16];
    random.fill(&mut bytes);
    let id = uuid_v4(bytes);
    if let Err(error) = host.set_shared_data(CLIENT_ID_KEY, id.as_bytes(), 0) {
        if error != HostError::CasMismatch {
            log(host, LogLevel::Warn, &format!("cannot publish the client id in shared data: {error}"));
        }
    }
    id
}

/// A random UUID (RFC 9562 version 4) from 16 random bytes, in the hyphenated lowercase form.
fn uuid_v4(mut bytes: [u8; 16]) -> String {
    bytes[6] = (bytes[6] & 0x0f) | 0x40;
    bytes[8] = (bytes[8] & 0x3f) | 0x80;
    let mut out = String::with_capacity(36);
    for (index, &byte) in bytes.iter().enumerate() {
        if matches!(index, 4 | 6 | 8 | 10) {
            out.push('-');
        }
        out.push(char::from(crate::quote::hex_digit(byte >> 4, b'a')));
        out.push(char::from(crate::quote::hex_digit(byte, b'a')));
    }
    out
}
