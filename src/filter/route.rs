//! What one configuration of the plugin (the global one, or a route or domain override) becomes at
//! configure: a [`Route`] with everything its requests need (the configuration, its plan, its transport,
//! its local blocks, its degraded mode, its rule metrics), chosen once per request and held by the
//! request's flow. And the adapters through which a request sees its route's blocks and windows in the
//! host's shared data ([`SharedBlocks`], [`SharedWindows`]).

use core::cell::{Cell, RefCell};

use crate::prelude::*;

use crate::block::{fnv1a, Block, BlockTable, RecentBlocks};
use crate::config::{PluginConfig, Settle, TransportKind};
use crate::fallback::{Circuit, Local, WindowTable};
use crate::host::{Host, LogLevel};
use crate::host_redis::HostRedis;
use crate::http_bridge::HttpBridge;
use crate::limiter::{Blocks, LocalWindows, Plan};
use crate::script::Encoding;
use crate::transport::{CallId, Failure};

use super::log;
use super::metrics::RuleMetrics;

/// One configuration, ready for its requests.
#[derive(Debug)]
pub(super) struct Route {
    /// Its index among the plugin's configurations (0: the global one, then the overrides in order).
    pub(super) index: usize,
    /// The validated configuration.
    pub(super) config: PluginConfig,
    /// Its rules' commands and headers, with this process's Redisson client id.
    pub(super) plan: Plan,
    pub(super) transport: Transport,
    /// Where its local blocks live in shared data.
    pub(super) blocks: BlockTable,
    /// `failure_mode: "local"`: its local windows, and this VM's circuit breaker.
    pub(super) fallback: Option<Fallback>,
    /// A rule reads the request body (`{"body": ...}` in `limit_by`, `rates_by` or `cost.reserve`, or
    /// `settle.include_usage`, which may rewrite it): its requests are decided once the body has arrived.
    pub(super) reads_body: bool,
    /// A rule settles to the usage in the response body: its requests ask the upstream for identity.
    pub(super) settles_from_body: bool,
    /// A rule asks for `settle.include_usage`: a streamed OpenAI chat request's body may be rewritten.
    pub(super) asks_usage: bool,
    /// The counters (`rule.<name>.<outcome>`) and the settled histogram of each rule entry.
    pub(super) rule_metrics: Vec<RuleMetrics>,
    /// Its requests' in-flight permits ride with their rate acquire, in one call (docs/configuration.md,
    /// "In-flight limits"): it has in-flight rules, and no rule reads the body or takes a lease.
    pub(super) joins_permits: bool,
}

impl Route {
    /// The route of configuration `index`: its transport (a host Redis client is initialised at once) and
    /// its tables of configuration `generation` (the degraded mode's slots are created at once).
    pub(super) fn new(
        host: &impl Host,
        index: usize,
        config: PluginConfig,
        client_id: &str,
        generation: u32,
        rule_metrics: Vec<RuleMetrics>,
    ) -> Self {
        let transport = match config.redis.transport {
            TransportKind::Http => Transport::Http(HttpBridge::new(&config.redis)),
            TransportKind::Host => {
                let client = HostRedis::new(&config.redis);
                if let Err(why) = client.init(host) {
                    log(host, LogLevel::Warn, &format!("{why}; retrying on the next request"));
                }
                Transport::Host(client)
            }
        };
        let blocks = BlockTable { slots: config.local_block_slots, generation };
        let fallback = config.local_fallback.map(|settings| {
            let windows = WindowTable { slots: settings.slots, generation, gateways: settings.gateways };
            windows.create_slots(host);
            Fallback { windows, probe_interval_ms: settings.probe_interval_ms, circuit: Cell::default() }
        });
        let asks_usage = config.rules.iter().any(crate::config::Rule::asks_usage);
        let reads_body = config.rules.iter().any(crate::config::Rule::reads_body);
        let settles_from_body = config
            .rules
            .iter()
            .any(|rule| rule.cost.as_ref().is_some_and(|cost| matches!(cost.settle, Settle::Usage(..))));
        let plan = Plan::new(&config, client_id);
        let joins_permits =
            !config.inflight.is_empty() && !reads_body && config.rules.iter().all(|rule| rule.lease.is_none());
        Route {
            joins_permits,
            index,
            plan,
            config,
            transport,
            blocks,
            fallback,
            rule_metrics,
            reads_body,
            settles_from_body,
            asks_usage,
        }
    }

    /// Whether a request at `now_ms` skips Redis (the degraded mode's circuit is open and no probe is due).
    pub(super) fn skips_redis(&self, now_ms: u64) -> bool {
        self.fallback.as_ref().is_some_and(|fallback| {
            let mut circuit = fallback.circuit.get();
            let skip = circuit.skip_redis(now_ms, fallback.probe_interval_ms);
            fallback.circuit.set(circuit);
            skip
        })
    }

    /// The degraded mode's circuit learns how a request's Redis calls went: a failed call opens it, a
    /// decision of Redis closes it.
    pub(super) fn circuit_learns(&self, now_ms: u64, failed: bool, decided_by_redis: bool) {
        let Some(fallback) = &self.fallback else { return };
        let mut circuit = fallback.circuit.get();
        if failed {
            circuit.failed(now_ms, fallback.probe_interval_ms);
        } else if decided_by_redis {
            circuit.succeeded();
        }
        fallback.circuit.set(circuit);
    }
}

/// The transport of one configuration (`redis.transport`).
#[derive(Debug)]
pub(super) enum Transport {
    Http(HttpBridge),
    Host(HostRedis),
}

impl Transport {
    pub(super) fn send(&self, host: &impl Host, command: &[u8]) -> Result<CallId, Failure> {
        match self {
            Transport::Http(bridge) => bridge.send(host, command),
            Transport::Host(client) => client.send(host, command),
        }
    }

    /// The wire form of the commands this transport carries.
    pub(super) fn encoding(&self) -> Encoding {
        match self {
            Transport::Http(_) => Encoding::WebdisPath,
            Transport::Host(_) => Encoding::Resp,
        }
    }
}

/// The degraded mode of one configuration in this VM.
#[derive(Debug)]
pub(super) struct Fallback {
    pub(super) windows: WindowTable,
    probe_interval_ms: u64,
    circuit: Cell<Circuit>,
}

/// The local blocks of one route, as a request sees them through the host's shared data.
pub(super) struct SharedBlocks<'a, H: Host> {
    pub(super) host: &'a H,
    pub(super) table: BlockTable,
    /// The blocks this VM saw last ([`RecentBlocks`]).
    pub(super) recent: &'a RefCell<RecentBlocks>,
}

impl<H: Host> Blocks for SharedBlocks<'_, H> {
    fn rejecting(&self, name: &str, now_ms: u64, permits: u64, settles: bool) -> Option<Block> {
        let hash = fnv1a(name.as_bytes());
        // A kept block that still rejects answers (unless settles may have raised it since); one that would
        // let the request through may be older than the entry in shared data (another VM's later rejection
        // saw fewer permits free): read that.
        if !settles {
            if let Some(block) = self.recent.borrow().find(name, hash, now_ms).filter(|b| permits > b.available) {
                return Some(block);
            }
        }
        let block = self.table.find_hashed(self.host, name, hash, now_ms)?;
        self.recent.borrow_mut().keep(name, hash, block);
        Some(block).filter(|b| permits > b.available)
    }
}

/// The degraded mode's local windows of one route, as a request sees them through the host's shared data.
pub(super) struct SharedWindows<'a, H: Host> {
    pub(super) host: &'a H,
    pub(super) table: WindowTable,
}

impl<H: Host> LocalWindows for SharedWindows<'_, H> {
    fn acquire(&self, name: &str, rate: u64, interval_ms: u64, permits: u64, now_ms: u64) -> Local {
        self.table.acquire(self.host, name, rate, interval_ms, permits, now_ms)
    }

    fn release(&self, name: &str, interval_ms: u64, permits: u64, taken_ms: u64) {
        self.table.release(self.host, name, interval_ms, permits, taken_ms);
    }
}
