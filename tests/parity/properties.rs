//! Property tests: random sequences of limiter operations and time steps, run through the model
//! ([`crate::model`], the oracle) and through the project's scripts on a real Redis, with identical results
//! and identical keys required after every step.
//!
//! Time is virtual: every script gets `now` from the test's clock (never Redis `TIME`), so nothing sleeps.
//! Redis TTLs run in real time, though, so after each time step the harness ages the real keys by the same
//! virtual amount: a key the model says expired is deleted, every other TTL is set to the model's
//! remaining TTL with `PEXPIRE` (the TTLs were compared, within [`TTL_TOLERANCE_MS`], just before, so this
//! only removes the few real milliseconds that passed). Two harness rules keep real time out of the
//! picture: keepAlive is 0 or at least [`KEEP_ALIVE_FLOOR_MS`] (Redisson requires >= interval anyway), and a
//! key with less than [`EXPIRY_MARGIN_MS`] to live is expired on both sides at the time step, so no key can
//! run out in real time between two steps.
//!
//! Two clients (gateways, or Redisson client instances) share each limiter; the second may have a skewed
//! clock. Members are written with 16-byte ids (Redisson 4.x, via the filter's own `Acquire::command`) and
//! 8-byte ids (Redisson 3.17-3.20: through the acquire script, and directly with `ZADD`), and limiters are
//! also created the Redisson 3.x way (no `keepAliveTime` field).
//!
//! Members are also settled (GIVE_BACK, [`Limiter::give_back`]): a member of the window in force, or an
//! unknown one, becomes its real cost: fewer permits (the rest back to the value), as many (maybe
//! renamed, `-s` + 14 base-62 characters, as "reserve, then settle" renames a reservation), or more (the
//! excess charged, the value maybe below zero; the acquires after it meet that value). Besides the
//! comparison, each settlement that found its member must keep value + the permits of the members as
//! they were (but for the cap at the rate), and one that did not must change nothing.
//!
//! Run size: [`DEFAULT_CASES`] cases of 1-60 steps (about 15,000 steps) per limiter type; `PROPTEST_CASES`
//! overrides.
#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]

use std::cell::RefCell;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use edge_rate_limiter::config::LimiterType;
use edge_rate_limiter::key::LimiterKeys;
use edge_rate_limiter::resp::{decode_reply, Reply};
use edge_rate_limiter::script::{
    decode_acquire_reply, AcquireConfig, AcquireTemplate, Clock, Encoding, Invocation, MemberAt, Settlement, ACQUIRE,
    AVAILABLE_PERMITS, DELETE, GIVE_BACK, MEMBER_RANDOM_LEN, SET_RATE, TRY_SET_RATE, UPDATE_RATE,
};
use proptest::prelude::*;
use proptest::test_runner::{Config as ProptestConfig, TestCaseError, TestCaseResult, TestError, TestRunner};
use redis::Value;

use crate::model::{GatewayReply, Key, Limiter, Member, Ms, RateConfig, RateType, Scope};
use crate::redis_server::{RedisServer, ScriptClient};

/// Client instance ids (Redisson: the `RedissonClient`'s UUID; the gateway: its client id).
const CLIENT_IDS: [&str; 2] = ["3f2b8c1e-7d4a-4e3b-9a61-0c5d2e8f4b17", "a9e4d6c2-15b8-4f7e-8d3c-6b2a9f0e7c54"];
/// Where the virtual clock starts, ms since the epoch (2023-11-14).
const EPOCH_MS: Ms = 1_700_000_000_000;
/// How far a real `PTTL` may be from the model's TTL, ms (real time passes between writing and reading).
const TTL_TOLERANCE_MS: Ms = 250;
/// Keys with less than this to live are expired at a time step, on both sides, ms.
const EXPIRY_MARGIN_MS: Ms = 500;
/// Smallest non-zero keepAlive the tests configure, ms.
const KEEP_ALIVE_FLOOR_MS: Ms = 1000;
/// Cases per limiter type unless `PROPTEST_CASES` says otherwise.
const DEFAULT_CASES: u32 = 500;

/// Every key of a limiter shared by the two clients, in the order states are compared.
const KEYS: [Key; 7] = [
    Key::Config,
    Key::Value(Scope::Overall),
    Key::Permits(Scope::Overall),
    Key::Value(Scope::Client(0)),
    Key::Permits(Scope::Client(0)),
    Key::Value(Scope::Client(1)),
    Key::Permits(Scope::Client(1)),
];

// ---- The generated input ------------------------------------------------------------------------------

/// One generated run: three configs (`configs[0]` is the gateway's configured limiter, of the type under
/// test; the others are what operators or other services may set), the limiter name style, client 1's clock
/// skew and the steps.
#[derive(Clone)]
struct Case {
    configs: [RateConfig; 3],
    tagged_name: bool,
    skew_ms: Ms,
    steps: Vec<Step>,
}

/// Wait, then one operation by one client.
#[derive(Clone)]
struct Step {
    wait: Wait,
    client: usize,
    op: Op,
}

/// A time step, resolved against the limiter's interval (and keepAlive) when it runs.
#[derive(Clone, Copy, Debug)]
enum Wait {
    /// No time passes.
    None,
    /// `2 * interval * per_mille / 1000` ms.
    Fraction(u16),
    /// Exactly one interval: the oldest permits are released at exactly `score == now - interval`.
    Interval,
    /// One ms short of an interval.
    IntervalMinus1,
    /// Longer than every keepAlive of the case: every key with a TTL expires.
    PastKeepAlive,
}

/// The 8-byte (Redisson 3.17-3.20) or 16-byte (Redisson 4.x) random part of a new member.
#[derive(Clone, Debug)]
enum Random {
    Modern([u8; 16]),
    Legacy([u8; 8]),
}

impl Random {
    fn bytes(&self) -> &[u8] {
        match self {
            Random::Modern(bytes) => bytes,
            Random::Legacy(bytes) => bytes,
        }
    }
}

/// An operation. A `permits_pick` is mapped onto 1..=rate+1 permits (1..=rate for `ZaddLegacy`) of the rate
/// in force when the step runs; `config` indexes [`Case::configs`].
#[derive(Clone, Debug)]
enum Op {
    /// The gateway's acquire (ACQUIRE): trySetRate if missing, updateRate if `apply` and different,
    /// tryAcquire.
    Acquire { permits_pick: u8, config: usize, apply: bool, random: Random },
    /// Redisson 4.x trySetRate (TRY_SET_RATE).
    TrySetRate { config: usize },
    /// Redisson 3.x trySetRate: three `HSETNX`, written directly.
    TrySetRateV3 { config: usize },
    /// setRate, a reset (SET_RATE).
    SetRate { config: usize },
    /// updateRate keeping state (UPDATE_RATE).
    UpdateRate { config: usize },
    /// availablePermits (AVAILABLE_PERMITS).
    AvailablePermits,
    /// delete (DELETE).
    Delete,
    /// A Redisson 3.17-3.20 member (8-byte id) written directly with `ZADD` into the window in force.
    ZaddLegacy { permits_pick: u8, random: [u8; 8] },
    /// A member settled (GIVE_BACK): `member_pick` picks one of the members of the client's window in force
    /// (below 32, or no member: an unknown member, `random` with 1..=rate permits); `used` the permits it really
    /// used; `early_pick` moves it 2 * interval * per_mille / 1000 ms earlier (none: it keeps its score);
    /// `renamed` the 14 base-62 characters after `-s` of its new random bytes (none: it keeps them).
    Settle { member_pick: u8, used: Used, early_pick: Option<u16>, renamed: Option<[u8; 14]>, random: [u8; 16] },
}

/// The permits a settled member really used.
#[derive(Clone, Copy, Debug)]
enum Used {
    /// As many as it holds.
    Same,
    /// Mapped onto 0..=granted+rate+1 of the member's permits and the rate in force: fewer, as many, more.
    Pick(u8),
}

/// The random bytes of a settled member: `-s` and 14 base-62 characters picked by `chars`.
fn settled_random(chars: &[u8; 14]) -> [u8; MEMBER_RANDOM_LEN] {
    const BASE62: &[u8; 62] = b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz";
    let mut random = [b'-'; MEMBER_RANDOM_LEN];
    random[1] = b's';
    for (byte, pick) in random[2..].iter_mut().zip(chars) {
        *byte = BASE62[usize::from(*pick) % BASE62.len()];
    }
    random
}

impl fmt::Debug for Step {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "wait {:?}, client {}: {:?}", self.wait, self.client, self.op)
    }
}

impl fmt::Debug for Case {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "Case {{ tagged_name: {}, client 1 skew: {} ms", self.tagged_name, self.skew_ms)?;
        for (index, config) in self.configs.iter().enumerate() {
            writeln!(f, "  config {index}: {config:?}")?;
        }
        for (index, step) in self.steps.iter().enumerate() {
            writeln!(f, "  step {index}: {step:?}")?;
        }
        write!(f, "}}")
    }
}

fn config_strategy(rate_type: impl Strategy<Value = RateType>) -> impl Strategy<Value = RateConfig> {
    let interval = prop_oneof![10i64..=200, 200i64..=5000];
    let keep_alive_extra = prop::option::weighted(0.5, 0i64..=4000);
    (1i64..=10, interval, rate_type, keep_alive_extra).prop_map(|(rate, interval_ms, rate_type, extra)| RateConfig {
        rate,
        interval_ms,
        rate_type,
        keep_alive_ms: Some(extra.map_or(0, |extra| interval_ms.max(KEEP_ALIVE_FLOOR_MS) + extra)),
    })
}

fn any_rate_type() -> impl Strategy<Value = RateType> {
    prop_oneof![Just(RateType::Overall), Just(RateType::PerClient)]
}

fn step_strategy() -> impl Strategy<Value = Step> {
    let wait = prop_oneof![
        3 => Just(Wait::None),
        3 => (0u16..=100).prop_map(Wait::Fraction),
        2 => (0u16..=1000).prop_map(Wait::Fraction),
        1 => Just(Wait::Interval),
        1 => Just(Wait::IntervalMinus1),
        1 => Just(Wait::PastKeepAlive),
    ];
    let config = || prop_oneof![2 => Just(0usize), 1 => 0usize..3];
    let random = prop_oneof![
        3 => any::<[u8; 16]>().prop_map(Random::Modern),
        1 => any::<[u8; 8]>().prop_map(Random::Legacy),
    ];
    let op = prop_oneof![
        10 => (1u8..=11, config(), prop::bool::weighted(0.3), random)
            .prop_map(|(permits_pick, config, apply, random)| Op::Acquire { permits_pick, config, apply, random }),
        2 => Just(Op::AvailablePermits),
        1 => config().prop_map(|config| Op::TrySetRate { config }),
        1 => config().prop_map(|config| Op::TrySetRateV3 { config }),
        1 => config().prop_map(|config| Op::SetRate { config }),
        2 => config().prop_map(|config| Op::UpdateRate { config }),
        1 => Just(Op::Delete),
        1 => (1u8..=11, any::<[u8; 8]>()).prop_map(|(permits_pick, random)| Op::ZaddLegacy { permits_pick, random }),
        4 => (
            any::<u8>(),
            prop_oneof![1 => Just(Used::Same), 3 => any::<u8>().prop_map(Used::Pick)],
            prop::option::weighted(0.25, 0u16..=1000),
            prop::option::weighted(0.5, any::<[u8; 14]>()),
            any::<[u8; 16]>(),
        )
            .prop_map(|(member_pick, used, early_pick, renamed, random)| Op::Settle {
                member_pick,
                used,
                early_pick,
                renamed,
                random,
            }),
    ];
    (wait, prop_oneof![2 => Just(0usize), 1 => Just(1usize)], op).prop_map(|(wait, client, op)| Step {
        wait,
        client,
        op,
    })
}

fn case_strategy(rate_type: RateType) -> impl Strategy<Value = Case> {
    (
        config_strategy(Just(rate_type)),
        config_strategy(any_rate_type()),
        config_strategy(any_rate_type()),
        any::<bool>(),
        prop_oneof![Just(0i64), -2000i64..=2000],
        prop::collection::vec(step_strategy(), 1..=60),
    )
        .prop_map(|(c0, c1, c2, tagged_name, skew_ms, steps)| Case {
            configs: [c0, c1, c2],
            tagged_name,
            skew_ms,
            steps,
        })
}

// ---- What a step answered ------------------------------------------------------------------------------

/// A step's answer, in a form both the model and the scripts' replies map onto.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Answer {
    /// ACQUIRE's reply: the permits left, or an array of integers.
    Acquire(GatewayReply),
    /// A boolean reply (trySetRate, updateRate).
    Flag(bool),
    /// availablePermits: permits, or the error text.
    Permits(Result<i64, String>),
    /// delete: keys removed.
    Deleted(i64),
    /// A reply that only says "done".
    Done,
    /// A reply of the wrong shape.
    Unexpected(String),
}

const NOT_INITIALIZED: &str = "RateLimiter is not initialized";

/// A decoded reply as RESP bytes again (what the filter's acquire decoder reads).
fn resp_bytes(reply: &Reply, out: &mut Vec<u8>) {
    match reply {
        Reply::Integer(value) => out.extend(format!(":{value}\r\n").bytes()),
        Reply::Simple(text) => out.extend([&b"+"[..], text, b"\r\n"].concat()),
        Reply::Error(text) => out.extend(format!("-{text}\r\n").bytes()),
        Reply::Bulk(bytes) => out.extend([format!("${}\r\n", bytes.len()).as_bytes(), bytes, b"\r\n"].concat()),
        Reply::Array(items) => {
            out.extend(format!("*{}\r\n", items.len()).bytes());
            items.iter().for_each(|item| resp_bytes(item, out));
        }
        Reply::Null => out.extend(b"$-1\r\n"),
    }
}

fn acquire_answer(reply: &Reply) -> Answer {
    let mut raw = Vec::new();
    resp_bytes(reply, &mut raw);
    let answer = match reply {
        Reply::Integer(n) => Some(GatewayReply::Integer(*n)),
        Reply::Array(items) => {
            items.iter().map(Reply::as_integer).collect::<Option<Vec<i64>>>().map(GatewayReply::Array)
        }
        _ => None,
    };
    match (answer, decode_acquire_reply(&raw)) {
        (Some(answer), Ok(_)) => Answer::Acquire(answer),
        (_, Err(e)) => Answer::Unexpected(format!("{reply:?}: {e}")),
        (None, Ok(_)) => Answer::Unexpected(format!("{reply:?}")),
    }
}

fn integer_answer(reply: &Reply, wrap: impl FnOnce(i64) -> Answer) -> Answer {
    reply.as_integer().map_or_else(|| Answer::Unexpected(format!("{reply:?}")), wrap)
}

// ---- Key states ----------------------------------------------------------------------------------------

/// What a key holds: `HGETALL` fields sorted, `GET`, or `ZRANGE ... WITHSCORES` (member bytes, score ms).
#[derive(Clone, PartialEq, Eq)]
enum Content {
    Absent,
    Hash(Vec<(String, String)>),
    Value(String),
    Permits(Vec<(Vec<u8>, Ms)>),
}

impl fmt::Debug for Content {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Content::Absent => write!(f, "(none)"),
            Content::Hash(fields) => write!(f, "{fields:?}"),
            Content::Value(value) => write!(f, "{value:?}"),
            Content::Permits(members) => {
                let shown: Vec<String> = members
                    .iter()
                    .map(|(bytes, score)| {
                        let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
                        format!("{hex}@t{:+}", score - EPOCH_MS)
                    })
                    .collect();
                write!(f, "[{}]", shown.join(", "))
            }
        }
    }
}

/// Every key's content and `PTTL` (-2 none, -1 no TTL, else ms).
type Snapshot = Vec<(Content, Ms)>;

fn model_snapshot(model: &Limiter) -> Snapshot {
    KEYS.iter()
        .map(|&key| {
            let content = match key {
                Key::Config => model.hash().map_or(Content::Absent, |h| Content::Hash(h.fields())),
                Key::Value(scope) => model.value(scope).map_or(Content::Absent, |v| Content::Value(v.to_string())),
                Key::Permits(scope) => match model.members(scope) {
                    [] => Content::Absent,
                    members => Content::Permits(members.iter().map(|m| (m.bytes(), m.score)).collect()),
                },
            };
            (content, model.pttl(key))
        })
        .collect()
}

fn text(value: &Value) -> String {
    match value {
        Value::BulkString(bytes) => String::from_utf8_lossy(bytes).into_owned(),
        Value::SimpleString(text) => text.clone(),
        Value::Int(n) => n.to_string(),
        Value::Double(x) => x.to_string(),
        other => format!("{other:?}"),
    }
}

fn redis_snapshot(inspector: &mut redis::Connection, names: &[String; 7]) -> Snapshot {
    let mut pipe = redis::pipe();
    for (key, name) in KEYS.iter().zip(names) {
        match key {
            Key::Config => pipe.cmd("HGETALL").arg(name),
            Key::Value(_) => pipe.cmd("GET").arg(name),
            Key::Permits(_) => pipe.cmd("ZRANGE").arg(name).arg(0).arg(-1).arg("WITHSCORES"),
        };
    }
    for name in names {
        pipe.cmd("PTTL").arg(name);
    }
    let replies: Vec<Value> = pipe.query(inspector).expect("read the limiter's keys");
    let (contents, ttls) = replies.split_at(KEYS.len());
    KEYS.iter()
        .zip(contents)
        .zip(ttls)
        .map(|((key, content), ttl)| {
            let content = match (key, content) {
                (_, Value::Nil) => Content::Absent,
                (Key::Config, Value::Array(items)) | (Key::Permits(_), Value::Array(items)) if items.is_empty() => {
                    Content::Absent
                }
                (Key::Config, Value::Array(items)) => {
                    let mut fields: Vec<(String, String)> =
                        items.chunks(2).map(|pair| (text(&pair[0]), text(&pair[1]))).collect();
                    fields.sort();
                    Content::Hash(fields)
                }
                (Key::Config, Value::Map(pairs)) if pairs.is_empty() => Content::Absent,
                (Key::Config, Value::Map(pairs)) => {
                    let mut fields: Vec<(String, String)> = pairs.iter().map(|(k, v)| (text(k), text(v))).collect();
                    fields.sort();
                    Content::Hash(fields)
                }
                (Key::Value(_), value) => Content::Value(text(value)),
                (Key::Permits(_), Value::Array(items)) => Content::Permits(
                    items
                        .chunks(2)
                        .map(|pair| {
                            let Value::BulkString(bytes) = &pair[0] else { panic!("member {:?}", pair[0]) };
                            let score: f64 = text(&pair[1]).parse().expect("a score");
                            (bytes.clone(), score as Ms)
                        })
                        .collect(),
                ),
                (key, other) => panic!("{key:?}: unexpected {other:?}"),
            };
            let Value::Int(ttl) = ttl else { panic!("PTTL answered {ttl:?}") };
            (content, *ttl)
        })
        .collect()
}

fn ttls_agree(model: Ms, redis: Ms) -> bool {
    match (model, redis) {
        (-2, -2) | (-1, -1) => true,
        (m, r) if m >= 0 && r >= 0 => (m - r).abs() <= TTL_TOLERANCE_MS,
        _ => false,
    }
}

// ---- Running a case ------------------------------------------------------------------------------------

/// What the generated runs exercised, to check that the generator reaches every path.
#[derive(Default)]
struct Coverage {
    steps: AtomicU64,
    acquired: AtomicU64,
    rejected: AtomicU64,
    exceeds_rate: AtomicU64,
    created: AtomicU64,
    updated: AtomicU64,
    kept: AtomicU64,
    type_changed: AtomicU64,
    keys_expired: AtomicU64,
    legacy_members_released: AtomicU64,
    settled_cheaper: AtomicU64,
    settled_same_renamed: AtomicU64,
    settled_dearer: AtomicU64,
    settle_missed: AtomicU64,
    negative_value_met: AtomicU64,
}

impl Coverage {
    fn count(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }

    fn report(&self) -> Vec<(&'static str, u64)> {
        let read = |c: &AtomicU64| c.load(Ordering::Relaxed);
        vec![
            ("steps", read(&self.steps)),
            ("acquired", read(&self.acquired)),
            ("rejected", read(&self.rejected)),
            ("more permits than the rate (code 2)", read(&self.exceeds_rate)),
            ("created by the acquire", read(&self.created)),
            ("updated by the acquire", read(&self.updated)),
            ("another writer's config kept by the acquire", read(&self.kept)),
            ("type changed by an update", read(&self.type_changed)),
            ("keys expired by time", read(&self.keys_expired)),
            ("8-byte members released", read(&self.legacy_members_released)),
            ("members settled below their permits", read(&self.settled_cheaper)),
            ("members settled at their permits, renamed", read(&self.settled_same_renamed)),
            ("members settled above their permits", read(&self.settled_dearer)),
            ("settlements of members not there", read(&self.settle_missed)),
            ("acquires meeting a value below zero", read(&self.negative_value_met)),
        ]
    }
}

static NEXT_LIMITER: AtomicU64 = AtomicU64::new(0);

/// One case's run: both connections, the key names and the model.
struct Run<'a> {
    case: &'a Case,
    scripts: &'a mut ScriptClient,
    inspector: &'a mut redis::Connection,
    coverage: &'a Coverage,
    keys: [LimiterKeys; 2],
    names: [String; 7],
    model: Limiter,
    trace: Vec<String>,
    /// What the last step broke besides the comparison (a settlement's invariant), if anything.
    broken: Option<String>,
}

impl Run<'_> {
    fn fail(&self, what: String) -> TestCaseError {
        TestCaseError::fail(format!("{what}\nsteps run (t = virtual ms since start):\n{}", self.trace.join("\n")))
    }

    /// The config in force, or the gateway's when the limiter does not exist.
    fn config_in_force(&self) -> RateConfig {
        self.model.config().unwrap_or(self.case.configs[0])
    }

    fn resolve_wait(&self, wait: Wait) -> Ms {
        let interval = self.config_in_force().interval_ms;
        match wait {
            Wait::None => 0,
            Wait::Fraction(per_mille) => 2 * interval * Ms::from(per_mille) / 1000,
            Wait::Interval => interval,
            Wait::IntervalMinus1 => interval - 1,
            Wait::PastKeepAlive => {
                let longest = self.case.configs.iter().map(RateConfig::keep_alive).max().unwrap_or(0);
                longest.max(2 * interval) + 1
            }
        }
    }

    /// Lets `elapsed` virtual ms pass on both sides (see the module docs).
    fn age(&mut self, elapsed: Ms) {
        let before = KEYS.iter().filter(|&&key| self.model.pttl(key) != -2).count();
        self.model.advance(elapsed);
        self.model.expire_keys_expiring_within(EXPIRY_MARGIN_MS);
        let after = KEYS.iter().filter(|&&key| self.model.pttl(key) != -2).count();
        self.coverage.keys_expired.fetch_add((before - after) as u64, Ordering::Relaxed);
        let mut pipe = redis::pipe();
        for (&key, name) in KEYS.iter().zip(&self.names) {
            match self.model.pttl(key) {
                -2 => pipe.cmd("DEL").arg(name).ignore(),
                -1 => continue, // no TTL: nothing to age
                ttl => pipe.cmd("PEXPIRE").arg(name).arg(ttl).ignore(),
            };
        }
        if !pipe.is_empty() {
            let () = pipe.query(self.inspector).expect("age the limiter's keys");
        }
    }

    fn step(&mut self, index: usize, step: &Step) -> Result<(), TestCaseError> {
        let elapsed = self.resolve_wait(step.wait);
        self.age(elapsed);
        let client = step.client;
        let now = self.model.clock_ms() + if client == 1 { self.case.skew_ms } else { 0 };
        let (what, expected, actual) = self.apply(&step.op, client, now);
        self.trace.push(format!(
            "  step {index:>2}: t={:>6} (+{elapsed}) client {client} now=t{:+}: {what} -> model {expected:?}, redis {actual:?}",
            self.model.clock_ms() - EPOCH_MS,
            now - self.model.clock_ms(),
        ));
        if expected != actual {
            return Err(
                self.fail(format!("step {index}: {what}: the model answers {expected:?}, the scripts {actual:?}"))
            );
        }
        self.compare_keys(index)?;
        match self.broken.take() {
            Some(broken) => Err(self.fail(format!("step {index}: {what}: {broken}"))),
            None => Ok(()),
        }
    }

    fn compare_keys(&mut self, index: usize) -> Result<(), TestCaseError> {
        let expected = model_snapshot(&self.model);
        let actual = redis_snapshot(self.inspector, &self.names);
        let mut differences = Vec::new();
        for ((name, (want, want_ttl)), (got, got_ttl)) in self.names.iter().zip(&expected).zip(&actual) {
            if want != got {
                differences.push(format!("  {name}: model {want:?}, redis {got:?}"));
            }
            if !ttls_agree(*want_ttl, *got_ttl) {
                differences.push(format!("  {name}: PTTL model {want_ttl}, redis {got_ttl}"));
            }
        }
        if differences.is_empty() {
            Ok(())
        } else {
            Err(self.fail(format!("after step {index}, the keys differ:\n{}", differences.join("\n"))))
        }
    }

    /// Maps a permits pick onto 1..=rate+1.
    fn permits(pick: u8, rate: i64) -> i64 {
        1 + (i64::from(pick) - 1) % (rate + 1)
    }

    fn apply(&mut self, op: &Op, client: usize, now: Ms) -> (String, Answer, Answer) {
        let keys = self.keys[client].clone();
        let now_arg = now.to_string();
        match op {
            Op::Acquire { permits_pick, config, apply, random } => {
                let wanted = self.case.configs[*config];
                let rate = match self.model.config() {
                    Some(held) if !*apply => held.rate,
                    _ => wanted.rate,
                };
                let permits = Self::permits(*permits_pick, rate);
                self.count_released_legacy_members(client, now);
                let held = self.model.config().map(|held| Self::scope_of(held.rate_type, client));
                if held.and_then(|scope| self.model.value(scope)).is_some_and(|value| value < 0) {
                    Coverage::count(&self.coverage.negative_value_met);
                }
                if *apply && self.model.config().is_some_and(|held| held.rate_type != wanted.rate_type) {
                    Coverage::count(&self.coverage.type_changed);
                }
                let expected =
                    Answer::Acquire(self.model.gateway_acquire(permits, now, random.bytes(), wanted, *apply, client));
                let reply = match random {
                    Random::Modern(bytes) => {
                        let acquire = AcquireTemplate::new(
                            AcquireConfig {
                                permits: permits as u64,
                                rate: wanted.rate as u64,
                                interval_ms: wanted.interval_ms as u64,
                                limiter_type: limiter_type(wanted.rate_type),
                                keep_alive_ms: wanted.keep_alive() as u64,
                                apply_config: *apply,
                                layout: edge_rate_limiter::config::WindowLayout::SlidingLog,
                            },
                            CLIENT_IDS[client],
                        );
                        let command = |invocation| {
                            acquire.command(&keys.config, Clock::Gateway(now as u64), bytes, None, invocation)
                        };
                        self.scripts.run_command(&command(Invocation::BySha), || command(Invocation::BySource))
                    }
                    Random::Legacy(bytes) => {
                        let args = config_args(wanted);
                        let permits_arg = permits.to_string();
                        let apply_arg = if *apply { "1" } else { "0" };
                        let argv: [&[u8]; 8] = [
                            now_arg.as_bytes(),
                            bytes,
                            permits_arg.as_bytes(),
                            args[0].as_bytes(),
                            args[1].as_bytes(),
                            args[2].as_bytes(),
                            args[3].as_bytes(),
                            apply_arg.as_bytes(),
                        ];
                        self.scripts.run(&ACQUIRE, &keys, &argv)
                    }
                };
                let actual = acquire_answer(&reply);
                self.count_acquire(&expected);
                let id = if matches!(random, Random::Legacy(_)) { "8-byte id" } else { "16-byte id" };
                let apply = if *apply { ", apply config" } else { "" };
                (format!("acquire {permits} (config {config}{apply}, {id})"), expected, actual)
            }
            Op::TrySetRate { config } => {
                let wanted = self.case.configs[*config];
                let expected = Answer::Flag(self.model.try_set_rate(wanted, client));
                let args = config_args(wanted);
                let reply = self.scripts.run(&TRY_SET_RATE, &keys, &as_bytes(&args));
                (format!("trySetRate(config {config})"), expected, integer_answer(&reply, |n| Answer::Flag(n == 1)))
            }
            Op::TrySetRateV3 { config } => {
                let wanted = self.case.configs[*config];
                let expected = Answer::Flag(self.model.try_set_rate_v3(wanted));
                let name = &self.names[0];
                let (_, _, created): (i64, i64, i64) = redis::pipe()
                    .cmd("HSETNX")
                    .arg(name)
                    .arg("rate")
                    .arg(wanted.rate)
                    .cmd("HSETNX")
                    .arg(name)
                    .arg("interval")
                    .arg(wanted.interval_ms)
                    .cmd("HSETNX")
                    .arg(name)
                    .arg("type")
                    .arg(wanted.rate_type.ordinal())
                    .query(self.inspector)
                    .expect("HSETNX");
                (format!("Redisson 3.x trySetRate(config {config})"), expected, Answer::Flag(created == 1))
            }
            Op::SetRate { config } => {
                let wanted = self.case.configs[*config];
                self.model.set_rate(wanted, client);
                let args = config_args(wanted);
                let reply = self.scripts.run(&SET_RATE, &keys, &as_bytes(&args));
                let actual =
                    if reply == Reply::Integer(1) { Answer::Done } else { Answer::Unexpected(format!("{reply:?}")) };
                (format!("setRate(config {config})"), Answer::Done, actual)
            }
            Op::UpdateRate { config } => {
                let wanted = self.case.configs[*config];
                if self.model.config().is_some_and(|held| held.rate_type != wanted.rate_type) {
                    Coverage::count(&self.coverage.type_changed);
                }
                let expected = Answer::Flag(self.model.update_rate(wanted, now, client));
                let mut args = config_args(wanted).to_vec();
                args.push(now_arg);
                let reply = self.scripts.run(&UPDATE_RATE, &keys, &as_bytes(&args));
                (format!("updateRate(config {config})"), expected, integer_answer(&reply, |n| Answer::Flag(n == 1)))
            }
            Op::AvailablePermits => {
                let expected =
                    Answer::Permits(self.model.available_permits(now, client).map_err(|_| NOT_INITIALIZED.to_string()));
                let reply = self.scripts.run(&AVAILABLE_PERMITS, &keys, &[now_arg.as_bytes()]);
                let actual = match &reply {
                    Reply::Error(text) if text.contains(NOT_INITIALIZED) => {
                        Answer::Permits(Err(NOT_INITIALIZED.into()))
                    }
                    other => integer_answer(other, |n| Answer::Permits(Ok(n))),
                };
                ("availablePermits".to_string(), expected, actual)
            }
            Op::Delete => {
                let expected = Answer::Deleted(self.model.delete(client));
                let reply = self.scripts.run(&DELETE, &keys, &[]);
                ("delete".to_string(), expected, integer_answer(&reply, Answer::Deleted))
            }
            Op::ZaddLegacy { permits_pick, random } => {
                let config = self.config_in_force();
                let permits = Self::permits(*permits_pick, config.rate - 1);
                let scope = match config.rate_type {
                    RateType::Overall => Scope::Overall,
                    RateType::PerClient => Scope::Client(client),
                };
                let member = Member { score: now, random: random.to_vec(), permits: permits as u32 };
                let name = self.names[KEYS.iter().position(|&k| k == Key::Permits(scope)).unwrap_or(0)].clone();
                let added: i64 =
                    redis::cmd("ZADD").arg(&name).arg(now).arg(member.bytes()).query(self.inspector).expect("ZADD");
                self.model.zadd(scope, member);
                (
                    format!("ZADD {name} of an 8-byte member, {permits} permits (added {added})"),
                    Answer::Done,
                    Answer::Done,
                )
            }
            Op::Settle { member_pick, used, early_pick, renamed, random } => {
                self.settle(client, *member_pick, *used, *early_pick, renamed.as_ref(), random)
            }
        }
    }

    /// The value and permits scope of `rate_type` for `client`.
    fn scope_of(rate_type: RateType, client: usize) -> Scope {
        match rate_type {
            RateType::Overall => Scope::Overall,
            RateType::PerClient => Scope::Client(client),
        }
    }

    /// [`Op::Settle`]: GIVE_BACK on the model and on Redis (a 16-byte member through the filter's own
    /// [`Settlement::encode`], an 8-byte one with `ARGV[5]` empty or the new random); records in `broken`
    /// a settlement that did not keep value + the permits of the members (found: as they were but for
    /// the cap at the rate; not found: everything as it was).
    fn settle(
        &mut self,
        client: usize,
        member_pick: u8,
        used: Used,
        early_pick: Option<u16>,
        renamed: Option<&[u8; 14]>,
        unknown: &[u8; 16],
    ) -> (String, Answer, Answer) {
        let config = self.config_in_force();
        let scope = Self::scope_of(config.rate_type, client);
        let members = self.model.members(scope).to_vec();
        // One pick in eight, or an empty window: a member not there.
        let index = if member_pick < 32 { members.len() } else { usize::from(member_pick) % members.len().max(1) };
        let (random, granted, score) = match members.get(index) {
            Some(member) => (member.random.clone(), i64::from(member.permits), member.score),
            None => (unknown.to_vec(), 1 + i64::from(member_pick) % config.rate, EPOCH_MS),
        };
        // Half the settlements of 16-byte members as a gateway on its own clock sends them: with the member's score and the
        // limiter's rate and type (GIVE_BACK then reads neither the config hash nor the score).
        let at = (unknown[0] % 2 == 1 && random.len() == MEMBER_RANDOM_LEN).then(|| MemberAt {
            score_ms: score as u64,
            rate: config.rate as u64,
            limiter_type: limiter_type(config.rate_type),
            counter_slice_ms: None,
        });
        let used = match used {
            Used::Same => granted,
            Used::Pick(pick) => i64::from(pick) % (granted + config.rate + 2),
        };
        let early = early_pick.map_or(0, |per_mille| 2 * config.interval_ms * Ms::from(per_mille) / 1000);
        let renamed = renamed.map(settled_random);
        let sum = |members: &[Member]| members.iter().map(|m| i64::from(m.permits)).sum::<i64>();
        let before = (self.model.value(scope), members.clone());
        let collides = renamed.is_some_and(|r| members.iter().any(|m| m.random == r));
        let known = at.map(|_| (config.rate, config.rate_type, score));
        let found =
            self.model.give_back(&random, granted, used, early, renamed.as_ref().map(|r| &r[..]), client, known);
        let reply = match <[u8; MEMBER_RANDOM_LEN]>::try_from(random.as_slice()) {
            Ok(random) => {
                let settlement = Settlement {
                    random,
                    granted: granted as u64,
                    used: used as u64,
                    early_ms: early as u64,
                    renamed,
                    at,
                };
                let template = AcquireTemplate::new(
                    AcquireConfig {
                        permits: 1,
                        rate: config.rate as u64,
                        interval_ms: config.interval_ms as u64,
                        limiter_type: limiter_type(config.rate_type),
                        keep_alive_ms: config.keep_alive() as u64,
                        apply_config: false,
                        layout: edge_rate_limiter::config::WindowLayout::SlidingLog,
                    },
                    CLIENT_IDS[client],
                );
                let name = self.keys[client].config.clone();
                let encode = |invocation| settlement.encode(&name, &template, invocation, Encoding::Resp);
                let raw = self.scripts.run_raw(&encode(Invocation::BySha), || encode(Invocation::BySource));
                decode_reply(&raw).unwrap_or_else(|e| Reply::Error(format!("not one reply: {e}")))
            }
            Err(_) => {
                let (granted_arg, used_arg, early_arg) = (granted.to_string(), used.to_string(), early.to_string());
                let renamed_arg = renamed.map_or_else(Vec::new, |r| r.to_vec());
                let argv: [&[u8]; 5] =
                    [&random, granted_arg.as_bytes(), used_arg.as_bytes(), early_arg.as_bytes(), &renamed_arg];
                let keys = self.keys[client].clone();
                self.scripts.run(&GIVE_BACK, &keys, &argv)
            }
        };
        let after = (self.model.value(scope), self.model.members(scope).to_vec());
        let counter = match (found, used.cmp(&granted)) {
            (false, _) => Some(&self.coverage.settle_missed),
            (true, std::cmp::Ordering::Less) => Some(&self.coverage.settled_cheaper),
            (true, std::cmp::Ordering::Greater) => Some(&self.coverage.settled_dearer),
            (true, std::cmp::Ordering::Equal) => renamed.map(|_| &self.coverage.settled_same_renamed),
        };
        counter.into_iter().for_each(Coverage::count);
        let kept = match (found, before.0, after.0) {
            (false, ..) => before == after,
            (true, Some(value), Some(now)) if !collides => {
                let capped = used < granted && value + granted - used > config.rate;
                now + sum(&after.1) == value + sum(&before.1) || (capped && now == config.rate)
            }
            _ => true,
        };
        if !kept {
            self.broken = Some(format!(
                "value + permits not kept: before {:?} + {}, after {:?} + {}",
                before.0,
                sum(&before.1),
                after.0,
                sum(&after.1)
            ));
        }
        let id = if random.len() == 8 { "8-byte" } else { "16-byte" };
        let renamed = renamed.map(|r| format!(" as {}", String::from_utf8_lossy(&r))).unwrap_or_default();
        let what = format!(
            "settle {id} member {index} of {}: {granted} -> {used}, {early} ms earlier{renamed}",
            members.len()
        );
        (what, Answer::Flag(found), integer_answer(&reply, |n| Answer::Flag(n == 1)))
    }

    fn count_acquire(&self, answer: &Answer) {
        let Answer::Acquire(reply) = answer else { return };
        let (code, change) = match reply {
            GatewayReply::Integer(n) => (i64::from(*n >= 0), 0),
            GatewayReply::Array(items) => (items.first().copied().unwrap_or(-1), items.get(6).copied().unwrap_or(0)),
        };
        match code {
            1 => Coverage::count(&self.coverage.acquired),
            0 => Coverage::count(&self.coverage.rejected),
            _ => Coverage::count(&self.coverage.exceeds_rate),
        }
        match change {
            1 => Coverage::count(&self.coverage.created),
            2 => Coverage::count(&self.coverage.updated),
            3 => Coverage::count(&self.coverage.kept),
            _ => {}
        }
    }

    fn count_released_legacy_members(&self, client: usize, now: Ms) {
        let Some(config) = self.model.config() else { return };
        let scope = match config.rate_type {
            RateType::Overall => Scope::Overall,
            RateType::PerClient => Scope::Client(client),
        };
        let released = self.model.members(scope).iter().filter(|m| m.random.len() == 8);
        if released.filter(|m| m.score <= now - config.interval_ms).count() > 0 && self.model.value(scope).is_some() {
            Coverage::count(&self.coverage.legacy_members_released);
        }
    }
}

fn limiter_type(rate_type: RateType) -> LimiterType {
    match rate_type {
        RateType::Overall => LimiterType::Overall,
        RateType::PerClient => LimiterType::PerClient,
    }
}

/// `ARGV` rate, interval, type, keepAliveTime as the scripts take them.
fn config_args(config: RateConfig) -> [String; 4] {
    [
        config.rate.to_string(),
        config.interval_ms.to_string(),
        config.rate_type.ordinal().to_string(),
        config.keep_alive().to_string(),
    ]
}

fn as_bytes(args: &[String]) -> Vec<&[u8]> {
    args.iter().map(|a| a.as_bytes()).collect()
}

fn run_case(
    case: &Case,
    scripts: &mut ScriptClient,
    inspector: &mut redis::Connection,
    coverage: &Coverage,
) -> TestCaseResult {
    let number = NEXT_LIMITER.fetch_add(1, Ordering::Relaxed);
    let base = match case.configs[0].rate_type {
        RateType::Overall => "overall",
        RateType::PerClient => "per-client",
    };
    // A tagged name (`{...}`) keeps its own hash tag; a plain one gets `{name}` (DESIGN.md).
    let name = if case.tagged_name { format!("{{parity-{number}}}:{base}") } else { format!("parity:{base}:{number}") };
    let keys = [LimiterKeys::new(&name, CLIENT_IDS[0]), LimiterKeys::new(&name, CLIENT_IDS[1])];
    let names = KEYS.map(|key| crate::model::redisson_key_name(&name, key, &CLIENT_IDS));
    for (client, keys) in keys.iter().enumerate() {
        let independent = [
            &names[0],
            &names[1],
            &names[if client == 0 { 3 } else { 5 }],
            &names[2],
            &names[if client == 0 { 4 } else { 6 }],
        ];
        let crate_names = [&keys.config, &keys.value, &keys.client_value, &keys.permits, &keys.client_permits];
        prop_assert_eq!(crate_names, independent, "LimiterKeys::new must name keys as Redisson does");
    }
    let mut run = Run {
        case,
        scripts,
        inspector,
        coverage,
        keys,
        names,
        model: Limiter::new(EPOCH_MS),
        trace: vec![format!("  limiter {name:?}")],
        broken: None,
    };
    for (index, step) in case.steps.iter().enumerate() {
        Coverage::count(&coverage.steps);
        run.step(index, step)?;
    }
    Ok(())
}

/// After proptest's shrinking (which stops removing steps once it shrinks their contents), removes every
/// step whose removal keeps the case failing, and the steps after the failing one, so the reported case
/// is the shortest sequence this greedy pass finds.
fn drop_needless_steps(mut case: Case, mut reason: String, run: impl Fn(&Case) -> TestCaseResult) -> (Case, String) {
    let mut index = 0;
    while index < case.steps.len() {
        let mut shorter = case.clone();
        shorter.steps.remove(index);
        match run(&shorter) {
            Err(TestCaseError::Fail(why)) => (case, reason) = (shorter, why.to_string()),
            _ => index += 1,
        }
    }
    (case, reason)
}

/// Runs [`DEFAULT_CASES`] generated cases for one limiter type against a fresh redis-server.
fn check_parity(rate_type: RateType) {
    let server = RedisServer::start();
    let scripts = RefCell::new(server.script_client());
    let inspector = RefCell::new(server.inspector());
    let coverage = Coverage::default();
    let mut config =
        ProptestConfig { failure_persistence: None, max_shrink_time: 120_000, ..ProptestConfig::default() };
    if std::env::var_os("PROPTEST_CASES").is_none() {
        config.cases = DEFAULT_CASES;
    }
    let cases = config.cases;
    let started = Instant::now();
    let mut runner = TestRunner::new(config);
    let result = runner.run(&case_strategy(rate_type), |case| {
        run_case(&case, &mut scripts.borrow_mut(), &mut inspector.borrow_mut(), &coverage)
    });
    match result {
        Ok(()) => {}
        Err(TestError::Fail(reason, case)) => {
            let run = |case: &Case| run_case(case, &mut scripts.borrow_mut(), &mut inspector.borrow_mut(), &coverage);
            let (case, reason) = drop_needless_steps(case, reason.to_string(), run);
            panic!("{reason}\nminimal failing case: {case:?}")
        }
        Err(TestError::Abort(reason)) => panic!("aborted: {reason}"),
    }
    let report = coverage.report();
    eprintln!("{rate_type:?}: {cases} cases in {:?}: {report:?}", started.elapsed());
    if cases >= DEFAULT_CASES {
        for (what, count) in &report {
            assert!(*count > 0, "the generator never reached: {what} ({report:?})");
        }
    }
}

#[test]
fn overall_limiter_scripts_match_the_redisson_model() {
    check_parity(RateType::Overall);
}

#[test]
fn per_client_limiter_scripts_match_the_redisson_model() {
    check_parity(RateType::PerClient);
}
