//! A model-based property test of the whole request path: random interleavings of request arrivals,
//! Redis replies (admitted, rejected, failed, late, never), clients that leave, lease expiries and
//! configuration pushes, over two VMs of one gateway process and two or three rules (shared limiters,
//! leases, shadow rules), driven callback by callback through the fake host ([`crate::testing`]) against a
//! real `redis-server` that runs the project's own scripts.
//!
//! The model is the test's own bookkeeping of what a client and an operator see, not a second limiter:
//!
//! - **Exact windows.** Redis executes the calls in the order they were sent (it serialises what reaches
//!   it; the gateway's clock stamps each call when it is sent), whenever the test lets it; the replies reach
//!   the filter in any order, late, or never. Every sliding window of one interval then holds at most the
//!   rate of admitted permits per limiter, counting a request in a window only if its whole span (arrival
//!   to the moment it went upstream) lies inside it, so no request is counted where it might not belong.
//!   Checked for configurations that fail closed: a request let through by `failure_mode: "allow"` is
//!   meant to pass uncounted.
//! - **Every paused request ends**, by a reply or by the deadline guard, or is forgotten when its client
//!   leaves.
//! - **Batches change nothing.** The VMs coalesce (`redis.max_in_flight: 1`): a request that needs Redis
//!   while its VM has a call out waits and goes out in the next batch; every promise above holds for them.
//! - **Counters add up.** The request counters sum to the requests decided; each rule's counters sum to
//!   the requests it decided; `redis_calls` equals the calls the host saw.
//!
//! A bounded run is part of `make test` (`INTERLEAVING_CASES`, default [`DEFAULT_CASES`]); `make fuzz`
//! runs it long. A failing case is shrunk by proptest to a short sequence of steps.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing, clippy::panic)]

use std::collections::HashMap;

use erl_test_support::{Connection, RedisServer};
use proptest::prelude::*;
use proptest::test_runner::{Config as ProptestConfig, TestCaseError, TestRunner};

use super::{Action, Filter, NAME};
use crate::host_redis::STATUS_OK;
use crate::testing::{End, FakeHost, ROOT};

/// Cases per configuration unless `INTERLEAVING_CASES` says otherwise: 100 in `make test` (160 took the
/// longest 25 s of the unit tests' run, 2026-11-28; `make fuzz` runs 5,000).
const DEFAULT_CASES: u32 = 100;

/// One rule of a configuration as the model sees it: which requests it applies to and which limiter it
/// charges, and its configuration's JSON.
#[derive(Debug, Clone, Copy)]
struct ModelRule {
    name: &'static str,
    /// The rule applies to every request (`global`), or to requests with a user, or with the shadow flag.
    applies: Applies,
    /// The limiter name's base (global rules: the name itself).
    limiter: &'static str,
    rate: u64,
    shadow: bool,
    /// Its `limit_by` and any further fields, as JSON members.
    json: &'static str,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Applies {
    Always,
    User,
    ShadowFlag,
}

/// A configuration under test.
#[derive(Debug, Clone, Copy)]
struct Variant {
    name: &'static str,
    /// Top-level members of the configuration besides `redis` and `rules` (may be empty).
    top: &'static str,
    rules: &'static [ModelRule],
    /// Rule a's `lease`.
    lease: &'static str,
    /// Every rule's window, ms.
    interval_ms: u64,
    /// Whether the rules keep local blocks (a local block ends a request at the rule that blocks).
    local_blocks: bool,
    /// Whether every admitted request was charged in Redis (fail closed), so windows are checked.
    exact: bool,
}

impl Variant {
    /// The plugin configuration: the host's Redis client, `redis.timeout` 200 ms.
    fn json(&self) -> String {
        let rules: Vec<String> = self
            .rules
            .iter()
            .map(|rule| {
                let lease = if rule.name == "a" { format!(r#","lease":{}"#, self.lease) } else { String::new() };
                let block = if self.local_blocks { "" } else { r#","local_block_max":0"# };
                format!(
                    r#"{{"name":"{}",{},"rate":{},"interval":{}{lease}{block}}}"#,
                    rule.name, rule.json, rule.rate, self.interval_ms
                )
            })
            .collect();
        format!(
            r#"{{"redis":{{"transport":"host","cluster":"redis","timeout":200,"max_in_flight":1}},{}"rules":[{}]}}"#,
            self.top,
            rules.join(",")
        )
    }
}

const A: ModelRule = ModelRule {
    name: "a",
    applies: Applies::Always,
    limiter: "erl:a",
    rate: 6,
    shadow: false,
    json: r#""limit_by":"global""#,
};
const B: ModelRule = ModelRule {
    name: "b",
    applies: Applies::User,
    limiter: "erl:b",
    rate: 1,
    shadow: false,
    json: r#""limit_by":{"header":"x-user"}"#,
};
const S: ModelRule = ModelRule {
    name: "s",
    applies: Applies::ShadowFlag,
    limiter: "erl:s",
    rate: 1,
    shadow: true,
    json: r#""limit_by":{"header":"x-shadow"},"mode":"shadow""#,
};
/// A second rule on rule a's limiter (no lease of its own).
const A2: ModelRule = ModelRule {
    name: "a2",
    applies: Applies::Always,
    limiter: "erl:a",
    rate: 6,
    shadow: false,
    json: r#""limit_by":"global","limiter":"erl:a""#,
};

const VARIANTS: [Variant; 4] = [
    // A hot limiter with a lease, a per-user rule that rejects often, a shadow rule; fail closed.
    Variant {
        name: "lease, per-user rule, shadow rule",
        top: r#""failure_mode":"deny","#,
        rules: &[A, B, S],
        lease: r#"{"max_permits":3,"max_age":"100ms"}"#,
        interval_ms: 300,
        local_blocks: false,
        exact: true,
    },
    // Two rules on one limiter, one of them leasing, and local blocks; fail closed.
    Variant {
        name: "two rules on one leased limiter, local blocks",
        top: r#""failure_mode":"deny","#,
        rules: &[A, A2, B],
        lease: r#"{"max_permits":3,"max_age":"150ms"}"#,
        interval_ms: 400,
        local_blocks: true,
        exact: true,
    },
    // Failing open: only liveness and counters are checked.
    Variant {
        name: "lease, per-user rule, fail open",
        top: "",
        rules: &[A, B, S],
        lease: r#"{"max_permits":4,"max_age":"100ms"}"#,
        interval_ms: 400,
        local_blocks: false,
        exact: false,
    },
    // The degraded mode: rules Redis cannot decide go to the gateway's local windows.
    Variant {
        name: "lease, per-user rule, shadow rule, degraded mode",
        top: r#""failure_mode":"local","local_fallback":{"gateways":1,"probe_interval":"50ms"},"#,
        rules: &[A, B, S],
        lease: r#"{"max_permits":4,"max_age":"100ms"}"#,
        interval_ms: 400,
        local_blocks: false,
        exact: false,
    },
];

/// One step of a case.
#[derive(Debug, Clone)]
enum Step {
    /// A request arrives at VM `vm`, with user `user` (rule b) and the shadow flag.
    Arrive { vm: usize, user: Option<u8>, shadow: bool },
    /// `count` requests without a user or shadow flag arrive at VM `vm` at once (load on the hot limiter).
    Burst { vm: usize, count: u8 },
    /// A later request's call overtakes an earlier one: a request with user `user` arrives at VM `vm`,
    /// `gap_ms` pass, a request without a user arrives there, and the newest reply comes first.
    Overtake { vm: usize, user: u8, gap_ms: u64 },
    /// Redis executes the oldest call it has not executed yet (calls run in the order they were sent).
    Execute,
    /// The reply of an outstanding call reaches the filter (Redis executes calls up to it first).
    Deliver(usize),
    /// The reply of the newest outstanding call reaches the filter (older calls are slow).
    DeliverNewest,
    /// Every outstanding call is answered, in the order they were sent (a quick network).
    DeliverAll,
    /// An outstanding call fails (status 1: timeout or connection failure), after Redis executed it or not.
    Fail { call: usize, executed: bool },
    /// Time passes, then every filter ticks.
    Advance(u64),
    /// The client of a paused request leaves.
    Leave(usize),
    /// Redis forgets its scripts (a restart, `SCRIPT FLUSH`): the next calls answer `NOSCRIPT`.
    FlushScripts,
    /// A new configuration (the same text) for VM `vm`: a new root context takes new requests; the old
    /// one keeps its paused requests until they end, then goes.
    Reconfigure(usize),
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        8 => (0..2usize, prop::option::weighted(0.5, 0..2u8), prop::bool::weighted(0.15))
            .prop_map(|(vm, user, shadow)| Step::Arrive { vm, user, shadow }),
        3 => (0..2usize, 2..6u8).prop_map(|(vm, count)| Step::Burst { vm, count }),
        4 => (0..2usize, 0..2u8, 1..200u64).prop_map(|(vm, user, gap_ms)| Step::Overtake { vm, user, gap_ms }),
        2 => Just(Step::Execute),
        3 => any::<usize>().prop_map(Step::Deliver),
        3 => Just(Step::DeliverNewest),
        2 => Just(Step::DeliverAll),
        1 => (any::<usize>(), any::<bool>()).prop_map(|(call, executed)| Step::Fail { call, executed }),
        4 => prop_oneof![3 => 1..10u64, 3 => 10..120u64, 1 => 120..300u64].prop_map(Step::Advance),
        1 => any::<usize>().prop_map(Step::Leave),
        1 => (0..2usize).prop_map(Step::Reconfigure),
        1 => Just(Step::FlushScripts),
    ]
}

/// A call the filter made, as the host holds it.
#[derive(Debug)]
struct Call {
    vm: usize,
    /// The filter (root context) that sent it: its reply goes there.
    filter: usize,
    token: u32,
    query: Vec<u8>,
    /// Its reply once Redis executed it.
    reply: Option<Vec<u8>>,
    /// Its reply reached the filter (or its failure did).
    delivered: bool,
    /// It failed before reaching Redis: Redis never executes it.
    lost: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum State {
    Paused,
    /// Ended at `at_ms`: admitted (went upstream) or answered locally.
    Ended {
        admitted: bool,
        at_ms: u64,
    },
    Left,
}

#[derive(Debug)]
struct Request {
    vm: usize,
    context_id: u32,
    filter: usize,
    arrival_ms: u64,
    user: Option<u8>,
    shadow: bool,
    state: State,
}

/// A root context of a VM: its filter, or `None` once it was deleted.
struct Root {
    vm: usize,
    filter: Option<Filter<FakeHost>>,
}

struct World<'a> {
    variant: Variant,
    redis: &'a mut Connection,
    hosts: Vec<FakeHost>,
    roots: Vec<Root>,
    /// The current root of each VM (new requests go there).
    current: Vec<usize>,
    calls: Vec<Call>,
    /// Calls seen per VM (an index into the host's call log).
    seen: Vec<usize>,
    requests: Vec<Request>,
    next_context: u32,
    log: Vec<String>,
}

impl<'a> World<'a> {
    fn new(variant: Variant, redis: &'a mut Connection) -> Self {
        let first = FakeHost::new();
        let hosts = vec![first.clone(), first.sibling()];
        let mut world = World {
            variant,
            redis,
            hosts,
            roots: Vec::new(),
            current: Vec::new(),
            calls: Vec::new(),
            seen: vec![0, 0],
            requests: Vec::new(),
            next_context: 2,
            log: Vec::new(),
        };
        for vm in 0..2 {
            let root = world.configure(vm);
            world.current.push(root);
        }
        world
    }

    fn now(&self) -> u64 {
        self.hosts[0].now()
    }

    fn configure(&mut self, vm: usize) -> usize {
        let filter = Filter::configure(self.hosts[vm].clone(), self.variant.json().as_bytes(), true).unwrap();
        self.roots.push(Root { vm, filter: Some(filter) });
        self.roots.len() - 1
    }

    /// Runs `f` on a root's filter, then records the calls it made and the requests that ended.
    fn act(&mut self, root: usize, f: impl FnOnce(&mut Filter<FakeHost>)) {
        let vm = self.roots[root].vm;
        if let Some(filter) = self.roots[root].filter.as_mut() {
            f(filter);
        }
        let calls = self.hosts[vm].redis_calls();
        for call in calls.into_iter().skip(self.seen[vm]) {
            self.seen[vm] += 1;
            self.calls.push(Call {
                vm,
                filter: root,
                token: call.token,
                query: call.query,
                reply: None,
                delivered: false,
                lost: false,
            });
        }
        self.collect_ends();
    }

    /// Requests whose end the host saw since the last look.
    fn collect_ends(&mut self) {
        let now = self.now();
        let mut ended = Vec::new();
        for (index, request) in self.requests.iter_mut().enumerate() {
            if request.state != State::Paused {
                continue;
            }
            match self.hosts[request.vm].end(request.context_id) {
                Some(End::Resumed) => request.state = State::Ended { admitted: true, at_ms: now },
                Some(End::LocalReply { .. }) => request.state = State::Ended { admitted: false, at_ms: now },
                None => continue,
            }
            ended.push(index);
        }
        // The host deletes a stream's context when it ends.
        for index in ended {
            let (root, context_id) = (self.requests[index].filter, self.requests[index].context_id);
            if let Some(filter) = self.roots[root].filter.as_mut() {
                filter.on_done(context_id);
            }
        }
        self.retire_drained();
    }

    /// An old root whose requests all ended is deleted, as Envoy deletes it once its streams are done.
    fn retire_drained(&mut self) {
        for root in 0..self.roots.len() {
            if self.current.contains(&root) || self.roots[root].filter.is_none() {
                continue;
            }
            let open = self.requests.iter().any(|r| r.filter == root && r.state == State::Paused);
            if !open {
                let old = self.roots[root].filter.take();
                let vm = self.roots[root].vm;
                if let Some(mut old) = old {
                    let retirement = old.retire();
                    if let Some(new) = self.roots[self.current[vm]].filter.as_mut() {
                        new.adopt(retirement);
                    }
                }
            }
        }
    }

    fn apply(&mut self, step: &Step) {
        self.log.push(format!("t={} {step:?}", self.now() - 1_700_000_000_000));
        match *step {
            Step::Arrive { vm, user, shadow } => self.arrive(vm, user, shadow),
            Step::Overtake { vm, user, gap_ms } => {
                self.arrive(vm, Some(user), false);
                self.advance(gap_ms);
                self.arrive(vm, None, false);
                self.apply(&Step::DeliverNewest);
            }
            Step::Burst { vm, count } => {
                for _ in 0..count {
                    self.arrive(vm, None, false);
                }
            }
            Step::Execute => {
                if let Some(next) = self.calls.iter().position(|c| c.reply.is_none() && !c.lost) {
                    self.execute(next);
                }
            }
            Step::Deliver(pick) => {
                if let Some(call) = self.pick_outstanding(pick) {
                    self.execute_through(call);
                    self.deliver(call, true);
                }
            }
            Step::DeliverNewest => {
                if let Some(call) = (0..self.calls.len())
                    .rev()
                    .find(|&i| !self.calls[i].delivered && self.roots[self.calls[i].filter].filter.is_some())
                {
                    self.execute_through(call);
                    self.deliver(call, true);
                }
            }
            Step::DeliverAll => {
                let open: Vec<usize> = (0..self.calls.len())
                    .filter(|&i| !self.calls[i].delivered && self.roots[self.calls[i].filter].filter.is_some())
                    .collect();
                for call in open {
                    if !self.calls[call].delivered && self.roots[self.calls[call].filter].filter.is_some() {
                        self.execute_through(call);
                        self.deliver(call, true);
                    }
                }
            }
            Step::Fail { call, executed } => {
                if let Some(call) = self.pick_outstanding(call) {
                    if executed {
                        self.execute_through(call);
                    }
                    self.deliver(call, false);
                }
            }
            Step::Advance(ms) => self.advance(ms),
            Step::Leave(pick) => {
                let paused: Vec<usize> =
                    (0..self.requests.len()).filter(|&i| self.requests[i].state == State::Paused).collect();
                if paused.is_empty() {
                    return;
                }
                let index = paused[pick % paused.len()];
                self.requests[index].state = State::Left;
                let (root, context_id) = (self.requests[index].filter, self.requests[index].context_id);
                self.act(root, |filter| filter.on_done(context_id));
            }
            Step::FlushScripts => {
                self.redis.command(&[b"SCRIPT", b"FLUSH"]).unwrap();
            }
            Step::Reconfigure(vm) => {
                let root = self.configure(vm);
                self.current[vm] = root;
                self.retire_drained();
            }
        }
    }

    fn arrive(&mut self, vm: usize, user: Option<u8>, shadow: bool) {
        let context_id = self.next_context;
        self.next_context += 1;
        let user_name = user.map(|u| format!("u{u}"));
        let mut headers = vec![(":path", "/"), (":authority", "api.example")];
        if let Some(name) = &user_name {
            headers.push(("x-user", name.as_str()));
        }
        if shadow {
            headers.push(("x-shadow", "on"));
        }
        self.hosts[vm].request(context_id, &headers);
        let root = self.current[vm];
        let arrival_ms = self.now();
        self.requests.push(Request { vm, context_id, filter: root, arrival_ms, user, shadow, state: State::Paused });
        let index = self.requests.len() - 1;
        let mut action = Action::Pause;
        self.act(root, |filter| action = filter.on_request_headers(context_id));
        if action == Action::Continue && self.requests[index].state == State::Paused {
            self.requests[index].state = State::Ended { admitted: true, at_ms: arrival_ms };
            if let Some(filter) = self.roots[root].filter.as_mut() {
                filter.on_done(context_id);
            }
        }
    }

    /// Outstanding calls: not delivered yet, of a root that still exists.
    fn pick_outstanding(&self, pick: usize) -> Option<usize> {
        let open: Vec<usize> = (0..self.calls.len())
            .filter(|&i| !self.calls[i].delivered && self.roots[self.calls[i].filter].filter.is_some())
            .collect();
        (!open.is_empty()).then(|| open[pick % open.len()])
    }

    fn execute(&mut self, call: usize) {
        let reply = self.redis.raw(&self.calls[call].query).unwrap();
        self.calls[call].reply = Some(reply);
    }

    /// Redis executes every call sent before `call` that reached it, then `call`.
    fn execute_through(&mut self, call: usize) {
        for earlier in 0..=call {
            if self.calls[earlier].reply.is_none() && !self.calls[earlier].lost {
                self.execute(earlier);
            }
        }
    }

    /// Hands the call's reply (or a failure) to its filter.
    fn deliver(&mut self, index: usize, ok: bool) {
        let call = &mut self.calls[index];
        call.delivered = true;
        call.lost |= call.reply.is_none();
        let (vm, filter, token, reply) = (call.vm, call.filter, call.token, call.reply.clone());
        let host = self.hosts[vm].clone();
        let call = Call { vm, filter, token, query: Vec::new(), reply, delivered: true, lost: false };
        match (ok, call.reply) {
            (true, Some(reply)) => {
                host.redis_reply(&reply);
                self.act(call.filter, |filter| filter.on_redis_call_response(token, STATUS_OK, reply.len()));
            }
            _ => {
                host.enter(ROOT);
                self.act(call.filter, |filter| filter.on_redis_call_response(token, 1, 0));
            }
        }
    }

    fn advance(&mut self, ms: u64) {
        for host in &self.hosts {
            host.advance(ms);
        }
        for root in 0..self.roots.len() {
            let vm = self.roots[root].vm;
            self.hosts[vm].enter(ROOT);
            self.act(root, Filter::on_tick);
        }
    }

    /// Ends the case: time runs on (ticks) until every deadline passed.
    fn finish(&mut self) {
        for _ in 0..30 {
            self.advance(100);
        }
    }

    fn rules_applying(&self, request: &Request) -> Vec<ModelRule> {
        self.variant
            .rules
            .iter()
            .copied()
            .filter(|rule| match rule.applies {
                Applies::Always => true,
                Applies::User => request.user.is_some(),
                Applies::ShadowFlag => request.shadow,
            })
            .collect()
    }

    fn check(&self) -> Result<(), TestCaseError> {
        let history = || self.log.join("\n");
        // Every paused request ended (or its client left).
        for request in &self.requests {
            prop_assert!(
                request.state != State::Paused,
                "request {} on VM {} never ended\n{}",
                request.context_id,
                request.vm,
                history()
            );
        }
        if self.variant.exact {
            self.check_windows()?;
        }
        // Counters add up to the requests decided, and every call is counted.
        let decided: Vec<&Request> = self.requests.iter().filter(|r| matches!(r.state, State::Ended { .. })).collect();
        let counter = |name: &str| self.hosts.iter().map(|h| h.counter(&format!("{NAME}.{name}"))).sum::<u64>();
        let outcomes = [
            "allowed",
            "rejected",
            "failure_allowed",
            "failure_denied",
            "fallback_allowed",
            "fallback_rejected",
            "exempt",
        ]
        .map(counter);
        prop_assert_eq!(outcomes.iter().sum::<u64>(), decided.len() as u64, "{:?}\n{}", outcomes, history());
        let admitted = decided.iter().filter(|r| matches!(r.state, State::Ended { admitted: true, .. })).count();
        prop_assert_eq!(
            counter("allowed") + counter("failure_allowed") + counter("fallback_allowed"),
            admitted as u64,
            "admitted requests\n{}",
            history()
        );
        let calls_seen: usize = self.hosts.iter().map(|h| h.redis_calls().len()).sum();
        prop_assert_eq!(counter("redis_calls"), calls_seen as u64);
        for rule in self.variant.rules {
            let counted = ["allowed", "rejected", "shadow_rejected", "failures"]
                .map(|outcome| counter(&format!("rule.{}.{outcome}", rule.name)));
            let applied = decided.iter().filter(|r| self.rules_applying(r).iter().any(|m| m.name == rule.name)).count();
            if !self.variant.local_blocks {
                prop_assert_eq!(
                    counted.iter().sum::<u64>(),
                    applied as u64,
                    "rule {}: {:?}\n{}",
                    rule.name,
                    counted,
                    history()
                );
            } else {
                prop_assert!(
                    counted.iter().sum::<u64>() <= applied as u64,
                    "rule {}: {:?}\n{}",
                    rule.name,
                    counted,
                    history()
                );
            }
        }
        Ok(())
    }

    /// The steps, the requests and the calls of the case, for a failure's message.
    fn trace(&self) -> String {
        let t0 = 1_700_000_000_000;
        let mut out = self.log.join("\n");
        for r in &self.requests {
            out += &format!(
                "\nrequest {} vm{} root{} user {:?} arrived t={} {:?}",
                r.context_id,
                r.vm,
                r.filter,
                r.user,
                r.arrival_ms - t0,
                r.state
            );
        }
        for c in &self.calls {
            let query: String = String::from_utf8_lossy(&c.query)
                .split("\r\n")
                .filter(|l| !l.starts_with('$') && !l.starts_with('*') && l.len() < 60)
                .collect::<Vec<_>>()
                .join(" ");
            out += &format!(
                "\ncall vm{} root{} token {} [{}] -> {:?}",
                c.vm,
                c.filter,
                c.token,
                query,
                c.reply.as_ref().map(|r| String::from_utf8_lossy(r).replace("\r\n", " "))
            );
        }
        out
    }

    /// Every sliding window of admitted permits, per limiter, holds at most the rate.
    fn check_windows(&self) -> Result<(), TestCaseError> {
        let mut spans: HashMap<String, Vec<(u64, u64, u64)>> = HashMap::new();
        for request in &self.requests {
            let State::Ended { admitted: true, at_ms } = request.state else { continue };
            for rule in self.rules_applying(request).into_iter().filter(|r| !r.shadow) {
                let limiter = match rule.applies {
                    Applies::Always => rule.limiter.to_string(),
                    _ if rule.limiter == "erl:a" => rule.limiter.to_string(),
                    _ => format!("{}:u{}", rule.limiter, request.user.unwrap_or(0)),
                };
                spans.entry(limiter).or_default().push((request.arrival_ms, at_ms, 1));
            }
        }
        for (limiter, spans) in &spans {
            let rate = self.variant.rules.iter().find(|r| limiter.starts_with(r.limiter)).map_or(0, |r| r.rate);
            for &(start, _, _) in spans {
                let inside: u64 = spans
                    .iter()
                    .filter(|&&(s, e, _)| s >= start && e < start + self.variant.interval_ms)
                    .map(|&(_, _, permits)| permits)
                    .sum();
                prop_assert!(
                    inside <= rate,
                    "{} permits of {} admitted in the window from t={} (rate {})\n{}",
                    inside,
                    limiter,
                    start - 1_700_000_000_000,
                    rate,
                    self.trace()
                );
            }
        }
        Ok(())
    }
}

/// Redis knows the filter's scripts, as it does once any gateway ran them.
fn load_scripts(redis: &mut Connection) {
    for script in [&crate::script::ACQUIRE, &crate::script::ACQUIRE_ALL, &crate::script::GIVE_BACK] {
        redis.command(&[b"SCRIPT", b"LOAD", script.source.as_bytes()]).unwrap();
    }
}

fn run_variant(variant: Variant) {
    let server = RedisServer::start().unwrap();
    let redis = std::cell::RefCell::new(server.connect().unwrap());
    let cases = std::env::var("INTERLEAVING_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(DEFAULT_CASES);
    let mut runner = TestRunner::new(ProptestConfig { cases, failure_persistence: None, ..ProptestConfig::default() });
    // Requests decided in batches over all cases (request coalescing, `max_in_flight: 1`): the model must
    // see them, or it checks nothing of them.
    let batched = std::cell::Cell::new(0u64);
    let result = runner.run(&prop::collection::vec(step(), 1..300), |steps| {
        let mut redis = redis.borrow_mut();
        redis.command(&[b"FLUSHALL"]).unwrap();
        load_scripts(&mut redis);
        let mut world = World::new(variant, &mut redis);
        for step in &steps {
            world.apply(step);
        }
        world.finish();
        let counted = world.hosts.iter().map(|h| h.counter(&format!("{NAME}.batched_calls"))).sum::<u64>();
        batched.set(batched.get() + counted);
        world.check()
    });
    if let Err(error) = result {
        panic!("{}: {error}", variant.name);
    }
    assert!(batched.get() > 0, "{}: no request was decided in a batch", variant.name);
}

/// Defect 1 of the exactness review, step by step: a permit put back after another rule rejected must go
/// back to the lease it came from, not to a newer one that Redis never counted it in.
#[test]
fn a_permit_put_back_after_its_lease_was_settled_does_not_serve_from_the_next_lease() {
    let server = RedisServer::start().unwrap();
    let mut redis = server.connect().unwrap();
    load_scripts(&mut redis);
    let variant = Variant {
        name: "rate 4, lease 4 / 100 ms, per-user rate 1",
        top: r#""failure_mode":"deny","#,
        rules: &[ModelRule { rate: 4, ..A }, B],
        lease: r#"{"max_permits":4,"max_age":"100ms"}"#,
        interval_ms: 1_000,
        local_blocks: false,
        exact: true,
    };
    let arrive = |user| Step::Arrive { vm: 0, user, shadow: false };
    let steps = [
        arrive(Some(0)), // R: a lease of 4 (R uses 1) and b's only permit for u0, in one call
        Step::Deliver(0),
        Step::Advance(5),
        arrive(Some(0)),    // X: a from the lease, b asks Redis (and will reject)
        Step::Advance(105), // the lease expired
        arrive(None),       // Y: a new lease, settling the first (counting X's permit as used)
        Step::Execute,      // X's b call: rejected
        Step::Deliver(1),   // Y's call: the new lease (Y uses 1 of 2)
        Step::Deliver(0),   // X's rejection: X's permit is put back
        arrive(None),
        arrive(None),       // served from the new lease
        Step::Advance(900), // the first lease's permits leave the window
        arrive(None),
        Step::Deliver(0),
        arrive(None),
        arrive(None),
    ];
    let mut world = World::new(variant, &mut redis);
    for step in &steps {
        world.apply(step);
    }
    world.finish();
    world.check().unwrap();
}

#[test]
fn interleavings_with_a_lease_a_per_user_rule_and_a_shadow_rule_keep_every_promise() {
    run_variant(VARIANTS[0]);
}

#[test]
fn interleavings_with_two_rules_on_one_leased_limiter_keep_every_promise() {
    run_variant(VARIANTS[1]);
}

#[test]
fn interleavings_failing_open_end_every_request_and_count_each_once() {
    run_variant(VARIANTS[2]);
}

#[test]
fn interleavings_in_the_degraded_mode_end_every_request_and_count_each_once() {
    run_variant(VARIANTS[3]);
}
