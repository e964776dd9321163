//! "Reserve, then settle" (issue 24) on a real redis-server: a request reserves R permits (an ordinary
//! member, its random bytes `-r` + 14 base-62 characters), and when its real cost C is known the member is
//! settled with GIVE_BACK ([`Settlement`], `renamed` = the same bytes with `-s`): it becomes (random', C) at
//! the same score and the value changes by R - C. Each scenario runs twice: as a gateway on Redis's clock
//! settles (GIVE_BACK reads the config hash and the member's score) and as one on its own clock (the score,
//! rate and type the acquire used are sent: [`MemberAt`]); both must leave the same keys. Each scenario states its expected numbers, checks
//! value + permits in the window = rate after every step where it must hold, and, for the dearer
//! settlement, runs the same steps through the Redisson model ([`crate::model`]) and compares the keys.
//! Virtual times from [`T0`] on: nothing sleeps.
#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]

use edge_rate_limiter::config::LimiterType;
use edge_rate_limiter::key::LimiterKeys;
use edge_rate_limiter::resp::{decode_reply, Reply};
use edge_rate_limiter::script::{
    decode_acquire_reply, AcquireConfig, AcquireOutcome, AcquireReply, AcquireTemplate, Clock, Encoding, Invocation,
    LeaseRequest, MemberAt, Settlement, AVAILABLE_PERMITS, MEMBER_RANDOM_LEN,
};
use redis::Connection;
use std::collections::HashMap;

use crate::model::{self, Member, RateConfig, RateType, Scope};
use crate::redis_server::{RedisServer, ScriptClient};

const CLIENT: &str = "5b0e7c3a-9d2f-4e61-8a4b-3c7d1e9f0a26";
/// Where the virtual gateway clock starts, ms since the epoch (2023-11-14).
const T0: u64 = 1_700_000_000_000;
/// Each scenario as settled without and with [`MemberAt`].
const KNOWN: [bool; 2] = [false, true];

/// A reservation's random bytes: `-r` and 14 base-62 characters (`tag` repeated).
fn reservation(tag: u8) -> [u8; MEMBER_RANDOM_LEN] {
    let mut random = [tag; MEMBER_RANDOM_LEN];
    random[..2].copy_from_slice(b"-r");
    random
}

/// The random bytes of the member `reservation` becomes when settled: `-s` and the same 14 characters.
fn settled(reservation: &[u8; MEMBER_RANDOM_LEN]) -> [u8; MEMBER_RANDOM_LEN] {
    let mut random = *reservation;
    random[1] = b's';
    random
}

/// Member bytes: `struct.pack('Bc0I', #random, random, permits)`.
fn member(random: &[u8], permits: u32) -> Vec<u8> {
    Member { score: 0, random: random.to_vec(), permits }.bytes()
}

/// One overall limiter of the filter's, and connections to its Redis.
struct Limiter {
    scripts: ScriptClient,
    inspector: Connection,
    keys: LimiterKeys,
    template: AcquireTemplate,
    rate: u64,
    interval_ms: u64,
    /// Whether settlements carry [`MemberAt`] (the score each acquire wrote, from `scores`).
    known: bool,
    scores: HashMap<[u8; MEMBER_RANDOM_LEN], u64>,
}

impl Limiter {
    /// Limiter `name` (with ` known` appended when `known`, so both runs of a scenario have keys of their
    /// own).
    fn new(server: &RedisServer, name: &str, rate: u64, interval_ms: u64, keep_alive_ms: u64, known: bool) -> Self {
        let name = if known { format!("{name} known") } else { name.to_string() };
        let config = AcquireConfig {
            permits: 1,
            rate,
            interval_ms,
            limiter_type: LimiterType::Overall,
            keep_alive_ms,
            apply_config: false,
            layout: edge_rate_limiter::config::WindowLayout::SlidingLog,
        };
        Limiter {
            scripts: server.script_client(),
            inspector: server.inspector(),
            keys: LimiterKeys::new(&name, CLIENT),
            template: AcquireTemplate::new(config, CLIENT),
            rate,
            interval_ms,
            known,
            scores: HashMap::new(),
        }
    }

    /// The filter's acquire of `permits` at `now_ms` with member bytes `random` (and a lease, if any).
    fn acquire(
        &mut self,
        permits: u64,
        now_ms: u64,
        random: &[u8; MEMBER_RANDOM_LEN],
        lease: Option<&LeaseRequest>,
    ) -> AcquireReply {
        let template = AcquireTemplate::new(AcquireConfig { permits, ..*self.template.config() }, CLIENT);
        let encode = |invocation| {
            template.encode(&self.keys.config, Clock::Gateway(now_ms), random, lease, invocation, Encoding::Resp)
        };
        let reply = self.scripts.run_raw(&encode(Invocation::BySha), || encode(Invocation::BySource));
        let reply = decode_acquire_reply(&reply).unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&reply)));
        if matches!(reply.outcome, AcquireOutcome::Acquired { .. }) {
            self.scores.insert(*random, now_ms);
        }
        reply
    }

    /// A reservation of `permits` at `now_ms`: the permits left.
    fn reserve(&mut self, permits: u64, now_ms: u64, random: &[u8; MEMBER_RANDOM_LEN]) -> u64 {
        match self.acquire(permits, now_ms, random, None).outcome {
            AcquireOutcome::Acquired { remaining } => remaining,
            other => panic!("reserving {permits} at {now_ms}: {other:?}"),
        }
    }

    /// GIVE_BACK as the filter encodes it ([`Settlement::encode`]): 1 if the member was found, 0 if not.
    fn settle(&mut self, settlement: Settlement) -> i64 {
        let name = self.keys.config.clone();
        self.settle_on(&name, settlement)
    }

    /// GIVE_BACK on limiter `name` (this limiter's client id).
    fn settle_on(&mut self, name: &str, mut settlement: Settlement) -> i64 {
        if self.known {
            // A member never acquired here (unknown to Redis too) is settled at a score the gateway made up.
            let score_ms = self.scores.get(&settlement.random).copied().unwrap_or(T0);
            settlement.at = Some(MemberAt {
                score_ms,
                rate: self.rate,
                limiter_type: LimiterType::Overall,
                counter_slice_ms: None,
            });
        }
        let encode = |invocation| settlement.encode(name, &self.template, invocation, Encoding::Resp);
        let raw = self.scripts.run_raw(&encode(Invocation::BySha), || encode(Invocation::BySource));
        match decode_reply(&raw).unwrap() {
            Reply::Integer(found) => found,
            other => panic!("GIVE_BACK answered {other:?}"),
        }
    }

    /// The value key (`None`: no such key).
    fn value(&mut self) -> Option<i64> {
        let value: Option<String> = redis::cmd("GET").arg(&self.keys.value).query(&mut self.inspector).unwrap();
        value.map(|v| v.parse().unwrap())
    }

    /// Every member as (bytes, score ms), in Redis order.
    fn members(&mut self) -> Vec<(Vec<u8>, u64)> {
        let scored: Vec<(Vec<u8>, f64)> = redis::cmd("ZRANGE")
            .arg(&self.keys.permits)
            .arg(0)
            .arg(-1)
            .arg("WITHSCORES")
            .query(&mut self.inspector)
            .unwrap();
        scored.into_iter().map(|(member, score)| (member, score as u64)).collect()
    }

    /// `PTTL` of the value and permits keys.
    fn ttls(&mut self) -> (i64, i64) {
        let ttl =
            |key: &str, inspector: &mut Connection| -> i64 { redis::cmd("PTTL").arg(key).query(inspector).unwrap() };
        (ttl(&self.keys.value, &mut self.inspector), ttl(&self.keys.permits, &mut self.inspector))
    }

    /// Checks value + the permits of the members in the window at `now_ms` (score > now - interval) =
    /// rate: what every settlement keeps.
    fn assert_sum_is_the_rate(&mut self, now_ms: u64, step: &str) {
        let value = self.value().expect("a value key");
        let cutoff = now_ms - self.interval_ms - model::clock_guard(self.interval_ms as i64) as u64;
        let in_window: i64 = self
            .members()
            .iter()
            .filter(|(_, score)| *score > cutoff)
            .map(|(member, _)| i64::from(u32::from_le_bytes(member[member.len() - 4..].try_into().unwrap())))
            .sum();
        assert_eq!(value + in_window, self.rate as i64, "{step}: value {value} + {in_window} in the window");
    }
}

fn settlement(random: [u8; MEMBER_RANDOM_LEN], granted: u64, used: u64, renamed: bool) -> Settlement {
    Settlement { random, granted, used, early_ms: 0, renamed: renamed.then(|| settled(&random)), at: None }
}

fn delay(reply: &AcquireReply) -> u64 {
    match reply.outcome {
        AcquireOutcome::Rejected { delay_ms } => delay_ms,
        other => panic!("expected a rejection, got {other:?}"),
    }
}

/// C < R: the R - C permits not used go back to the value, never above the rate; the member keeps its
/// score with C permits and its `-s` bytes; the keys keep their TTLs.
#[test]
fn a_cheaper_settlement_returns_the_rest_capped_at_the_rate() {
    for known in KNOWN {
        let server = RedisServer::start();
        let mut limiter = Limiter::new(&server, "settle:cheaper", 10, 60_000, 120_000, known);
        let a = reservation(b'a');
        assert_eq!(limiter.reserve(6, T0, &a), 4);
        limiter.assert_sum_is_the_rate(T0, "reserved 6");
        assert_eq!(limiter.settle(settlement(a, 6, 2, true)), 1);
        assert_eq!(limiter.value(), Some(8), "4 unused permits back");
        assert_eq!(limiter.members(), vec![(member(&settled(&a), 2), T0)], "same score, 2 permits, -s bytes");
        limiter.assert_sum_is_the_rate(T0, "settled at 2");
        let (value_ttl, permits_ttl) = limiter.ttls();
        assert!(value_ttl > 0 && permits_ttl > 0, "TTLs kept: {value_ttl}, {permits_ttl}");
        // The value can exceed rate - permits in the window only through another writer (here a SET, as
        // Redisson's own release writes rate - member count): the permits given back stop at the rate.
        let b = reservation(b'b');
        assert_eq!(limiter.reserve(5, T0 + 1, &b), 3);
        let () =
            redis::cmd("SET").arg(&limiter.keys.value).arg(9).arg("KEEPTTL").query(&mut limiter.inspector).unwrap();
        assert_eq!(limiter.settle(settlement(b, 5, 1, true)), 1);
        assert_eq!(limiter.value(), Some(10), "9 + 4 capped at the rate");
        assert_eq!(limiter.members(), vec![(member(&settled(&a), 2), T0), (member(&settled(&b), 1), T0 + 1)]);
    }
}

/// C > R: the excess is charged, the value goes below zero, every acquire is rejected (with Redisson's
/// delay) until enough permits left the window, and value + permits in the window stay the rate at every
/// step. The same steps through the Redisson model (its tryAcquire, the gateway's acquire and settlement)
/// leave the same keys.
#[test]
fn a_dearer_settlement_charges_the_excess_below_zero_until_permits_leave() {
    for known in KNOWN {
        let server = RedisServer::start();
        let mut limiter = Limiter::new(&server, "settle:dearer", 10, 1000, 0, known);
        let config = RateConfig { rate: 10, interval_ms: 1000, rate_type: RateType::Overall, keep_alive_ms: Some(0) };
        let mut model = model::Limiter::new(T0 as i64);
        let (a, b) = (reservation(b'a'), reservation(b'b'));
        let compare = |limiter: &mut Limiter, model: &model::Limiter, step: &str| {
            let members: Vec<(Vec<u8>, u64)> =
                model.members(Scope::Overall).iter().map(|m| (m.bytes(), m.score as u64)).collect();
            assert_eq!((limiter.value(), limiter.members()), (model.value(Scope::Overall), members), "{step}");
        };
        assert_eq!(limiter.reserve(3, T0, &a), 7);
        model.gateway_acquire(3, T0 as i64, &a, config, false, 0);
        assert_eq!(limiter.reserve(4, T0 + 100, &b), 3);
        model.gateway_acquire(4, T0 as i64 + 100, &b, config, false, 0);
        limiter.assert_sum_is_the_rate(T0 + 100, "two reservations");
        assert_eq!(limiter.settle(settlement(a, 3, 2, true)), 1);
        assert!(model.give_back(&a, 3, 2, 0, Some(&settled(&a)), 0, None));
        assert_eq!(limiter.value(), Some(4));
        limiter.assert_sum_is_the_rate(T0 + 100, "a settled at 2 of 3");
        assert_eq!(limiter.settle(settlement(b, 4, 15, true)), 1);
        assert!(model.give_back(&b, 4, 15, 0, Some(&settled(&b)), 0, None));
        assert_eq!(limiter.value(), Some(-7), "11 more than reserved: 4 - 11");
        limiter.assert_sum_is_the_rate(T0 + 100, "b settled at 15 of 4");
        compare(&mut limiter, &model, "after the settlements");
        let available =
            limiter.scripts.run(&AVAILABLE_PERMITS, &limiter.keys.clone(), &[(T0 + 200).to_string().as_bytes()]);
        assert_eq!(available, Reply::Integer(-7), "availablePermits says it as it is");
        // Rejected while the value stays below the permits asked; the delay is Redisson's, from the oldest.
        // (Each permit leaves the clock guard after its window passed it: docs/redisson.md, "Clocks".)
        let guard = model::clock_guard(1000) as u64;
        for (now, oldest) in
            [(T0 + 200, T0), (T0 + 999 + guard, T0), (T0 + 1000 + guard, T0 + 100), (T0 + 1099 + guard, T0 + 100)]
        {
            let random = reservation(b'x');
            let rejected = limiter.acquire(1, now, &random, None);
            assert_eq!(delay(&rejected), 3 + 1000 + guard - (now - oldest), "at T0 + {}", now - T0);
            let expected = model.gateway_try_acquire(1, now as i64, &random, 0);
            assert_eq!(
                expected,
                model::AcquireResult::Rejected { delay_ms: (3 + 1000 + guard - (now - oldest)) as i64 }
            );
            limiter.assert_sum_is_the_rate(now, "rejected");
            compare(&mut limiter, &model, "rejected");
        }
        assert_eq!(limiter.value(), Some(-5), "a's 2 permits left the window at T0 + 1000 + guard: -7 + 2");
        // At T0 + 1100 + guard b's 15 leave too: -5 + 15 = the rate, and acquires succeed again.
        let c = reservation(b'c');
        assert_eq!(limiter.reserve(1, T0 + 1100 + guard, &c), 9);
        let again = model.gateway_try_acquire(1, (T0 + 1100 + guard) as i64, &c, 0);
        assert_eq!(again, model::AcquireResult::Acquired { remaining: 9 });
        limiter.assert_sum_is_the_rate(T0 + 1100 + guard, "acquired again");
        compare(&mut limiter, &model, "acquired again");
    }
}

/// C = R with `renamed`: only the member's random bytes change (same score, same permits, the value and
/// both TTLs untouched, also when it is the only member); C = R without it changes nothing at all.
#[test]
fn a_settlement_at_the_reserved_cost_only_renames_the_member() {
    for known in KNOWN {
        let server = RedisServer::start();
        let mut limiter = Limiter::new(&server, "settle:same", 5, 60_000, 120_000, known);
        let r = reservation(b'r');
        assert_eq!(limiter.reserve(5, T0, &r), 0);
        let (value_ttl, permits_ttl) = limiter.ttls();
        assert_eq!(limiter.settle(settlement(r, 5, 5, true)), 1);
        assert_eq!(limiter.value(), Some(0));
        assert_eq!(limiter.members(), vec![(member(&settled(&r), 5), T0)]);
        let (value_ttl_after, permits_ttl_after) = limiter.ttls();
        // The TTLs run in real time: a few ms may pass, never the loss of one (-1).
        assert!((value_ttl - value_ttl_after).abs() < 1000, "value PTTL {value_ttl} then {value_ttl_after}");
        assert!((permits_ttl - permits_ttl_after).abs() < 1000, "permits PTTL {permits_ttl} then {permits_ttl_after}");
        limiter.assert_sum_is_the_rate(T0, "renamed");
        let before = (limiter.value(), limiter.members());
        assert_eq!(limiter.settle(settlement(settled(&r), 5, 5, false)), 1);
        assert_eq!((limiter.value(), limiter.members()), before, "nothing changes");
    }
}

/// A member that already left the window (an acquire released it: its permits are back in the value),
/// an unknown member, a limiter that does not exist: GIVE_BACK answers 0 and changes nothing.
#[test]
fn a_member_that_left_the_window_or_is_unknown_changes_nothing() {
    for known in KNOWN {
        let server = RedisServer::start();
        let mut limiter = Limiter::new(&server, "settle:gone", 3, 1000, 0, known);
        let r = reservation(b'r');
        assert_eq!(limiter.reserve(2, T0, &r), 1);
        let later = reservation(b'l');
        let gone = T0 + 1000 + model::clock_guard(1000) as u64;
        assert_eq!(limiter.reserve(1, gone, &later), 2, "r left the window and was released: 1 + 2 - 1");
        let before = (limiter.value(), limiter.members(), limiter.ttls());
        for (random, granted) in [(r, 2), (reservation(b'u'), 1)] {
            for used in [0, 1, 2, 7] {
                assert_eq!(limiter.settle(settlement(random, granted, used, true)), 0);
                assert_eq!((limiter.value(), limiter.members(), limiter.ttls()), before);
            }
        }
        limiter.assert_sum_is_the_rate(gone, "after the settlements that found nothing");
        assert_eq!(limiter.settle_on("settle:none", settlement(r, 2, 5, true)), 0);
        let keys: Vec<String> = redis::cmd("KEYS").arg("*settle:none*").query(&mut limiter.inspector).unwrap();
        assert!(keys.is_empty(), "{keys:?}");
    }
}

/// A lease settled inside ACQUIRE (7 arguments to giveBack, as before): the unused permits come back and
/// the member keeps its random bytes, a `renamed` in the [`Settlement`] notwithstanding (ACQUIRE has no
/// argument for it).
#[test]
fn a_lease_settled_inside_acquire_keeps_its_random() {
    let server = RedisServer::start();
    let mut limiter = Limiter::new(&server, "settle:lease", 10, 60_000, 0, false);
    let l = reservation(b'l');
    let lease = LeaseRequest { max_permits: 8, max_age_ms: 50, settle: None };
    let leased = limiter.acquire(1, T0, &l, Some(&lease));
    assert_eq!((leased.outcome, leased.granted), (AcquireOutcome::Acquired { remaining: 2 }, Some(8)));
    assert_eq!(limiter.members(), vec![(member(&l, 8), T0 + 50)]);
    let settle = Settlement { random: l, granted: 8, used: 3, early_ms: 20, renamed: Some(settled(&l)), at: None };
    let next = LeaseRequest { max_permits: 1, max_age_ms: 50, settle: Some(settle) };
    let n = reservation(b'n');
    let reply = limiter.acquire(1, T0 + 10, &n, Some(&next));
    assert_eq!(reply.outcome, AcquireOutcome::Acquired { remaining: 6 }, "5 back, then 1 taken");
    assert_eq!(limiter.members(), vec![(member(&n, 1), T0 + 10), (member(&l, 3), T0 + 30)]);
    limiter.assert_sum_is_the_rate(T0 + 10, "lease settled");
}
