//! Redisson's documented behaviour, scenario by scenario. The scripts take `now` as an argument (the
//! gateway clock, `Clock::Gateway(ms)`), so a scenario about windows passes virtual times from [`T0`] on and
//! nothing sleeps: the outcome does not depend on how fast the machine is. Only Redis's own TTLs run in real
//! time; the keepAlive scenarios wait for them (polling, bounded) and state their margins. Each test has its
//! own redis-server.
//!
//! Sources: Redisson's `RRateLimiter` javadoc and `RedissonRateLimiterTest` (sliding window, trySetRate
//! never overwrites, rate 10 per second in rounds, permits above the rate refused, availablePermits,
//! keepAliveTime), DESIGN.md ("Facts: Redisson's RRateLimiter layout") and the seed articles.
#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]

use std::sync::atomic::{AtomicU64, Ordering};
use std::thread::sleep;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::model::clock_guard;
use crate::redis_server::{RedisServer, ScriptClient};
use edge_rate_limiter::config::LimiterType;
use edge_rate_limiter::key::LimiterKeys;
use edge_rate_limiter::resp::Reply;
use edge_rate_limiter::script::{
    decode_acquire_all_reply, decode_acquire_reply, encode_acquire_all, AcquireConfig, AcquireOutcome, AcquirePart,
    AcquireReply, AcquireTemplate, Clock, ConfigChange, Encoding, Invocation, LeaseRequest, LimiterReply,
    AVAILABLE_PERMITS, MEMBER_RANDOM_LEN, TRY_SET_RATE, UPDATE_RATE,
};
use redis::Connection;

const CLIENT: &str = "6d1f3b9a-2c4e-4a8b-b5d7-9e0f1a2b3c4d";
const OTHER_CLIENT: &str = "c0ffee00-1234-4abc-8def-0123456789ab";

/// Where the virtual gateway clock of the window scenarios starts, ms since the epoch (2023-11-14).
const T0: u64 = 1_700_000_000_000;

/// How long a keepAlive scenario waits at most for Redis to expire keys beyond their TTL: Redis expires a
/// key on access once its TTL has passed, so this only bounds a wait that normally ends on time.
const EXPIRY_GRACE: Duration = Duration::from_secs(5);

/// Wall-clock ms since the epoch: the gateway's clock, for scenarios where the time does not matter.
fn wall_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// Waits, polling `EXISTS`, until none of `names` exists; panics after `bound`. Returns how long it took.
fn wait_until_expired(inspector: &mut Connection, names: &[&str], bound: Duration) -> Duration {
    let started = Instant::now();
    loop {
        let exists: i64 = redis::cmd("EXISTS").arg(names).query(inspector).unwrap();
        if exists == 0 {
            return started.elapsed();
        }
        assert!(started.elapsed() < bound, "{exists} of {names:?} still exist after {bound:?}");
        sleep(Duration::from_millis(20));
    }
}

/// A fresh 16-byte member id per acquire (Redisson 4.x: `generateIdArray()`).
fn fresh_random() -> [u8; MEMBER_RANDOM_LEN] {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    let mut random = [0xA5; MEMBER_RANDOM_LEN];
    random[..8].copy_from_slice(&NEXT.fetch_add(1, Ordering::Relaxed).to_be_bytes());
    random
}

/// A gateway rule: one limiter, its configured rate, and a connection to Redis.
struct Gateway {
    scripts: ScriptClient,
    keys: LimiterKeys,
    rate: u64,
    interval_ms: u64,
    limiter_type: LimiterType,
    keep_alive_ms: u64,
}

impl Gateway {
    fn new(server: &RedisServer, name: &str, rate: u64, interval_ms: u64, keep_alive_ms: u64) -> Self {
        Gateway {
            scripts: server.script_client(),
            keys: LimiterKeys::new(name, CLIENT),
            rate,
            interval_ms,
            limiter_type: LimiterType::Overall,
            keep_alive_ms,
        }
    }

    /// The filter's acquire at `clock`, decoded as the filter decodes it; returns the member id too.
    fn acquire_with(&mut self, permits: u64, clock: Clock) -> (AcquireReply, [u8; MEMBER_RANDOM_LEN]) {
        let acquire = AcquireTemplate::new(
            AcquireConfig {
                permits,
                rate: self.rate,
                interval_ms: self.interval_ms,
                limiter_type: self.limiter_type,
                keep_alive_ms: self.keep_alive_ms,
                apply_config: false,
                layout: edge_rate_limiter::config::WindowLayout::SlidingLog,
            },
            // The client id the keys were made for (`{name}:value:<id>`).
            self.keys.client_value.strip_prefix(&format!("{}:", self.keys.value)).unwrap(),
        );
        let random = fresh_random();
        let by_sha = acquire.encode(&self.keys.config, clock, &random, None, Invocation::BySha, Encoding::Resp);
        let reply = self.scripts.run_raw(&by_sha, || {
            acquire.encode(&self.keys.config, clock, &random, None, Invocation::BySource, Encoding::Resp)
        });
        (decode_acquire_reply(&reply).unwrap_or_else(|e| panic!("{e}")), random)
    }

    /// The filter's acquire now, by the gateway's clock.
    fn acquire(&mut self, permits: u64) -> AcquireReply {
        self.acquire_at(permits, wall_ms())
    }

    /// The filter's acquire with the gateway's clock reading `now_ms`.
    fn acquire_at(&mut self, permits: u64, now_ms: u64) -> AcquireReply {
        self.acquire_with(permits, Clock::Gateway(now_ms)).0
    }

    fn config_args(&self, rate: u64) -> [String; 4] {
        [
            rate.to_string(),
            self.interval_ms.to_string(),
            self.limiter_type.redisson_ordinal().to_string(),
            self.keep_alive_ms.to_string(),
        ]
    }

    /// Redisson's trySetRate with this gateway's interval, type and keepAlive, and `rate`.
    fn try_set_rate(&mut self, rate: u64) -> Reply {
        let args = self.config_args(rate);
        let argv: Vec<&[u8]> = args.iter().map(|a| a.as_bytes()).collect();
        self.scripts.run(&TRY_SET_RATE, &self.keys, &argv)
    }

    /// Redisson's availablePermits with the clock reading `now_ms`.
    fn available_permits_at(&mut self, now_ms: u64) -> Reply {
        let now = now_ms.to_string();
        self.scripts.run(&AVAILABLE_PERMITS, &self.keys, &[now.as_bytes()])
    }

    /// Every key of the limiter for this client: hash, value, client value, permits, client permits.
    fn key_names(&self) -> [&str; 5] {
        [&self.keys.config, &self.keys.value, &self.keys.client_value, &self.keys.permits, &self.keys.client_permits]
    }
}

fn remaining(reply: &AcquireReply) -> u64 {
    match reply.outcome {
        AcquireOutcome::Acquired { remaining } => remaining,
        other => panic!("expected an acquire, got {other:?} ({reply:?})"),
    }
}

fn delay(reply: &AcquireReply) -> u64 {
    match reply.outcome {
        AcquireOutcome::Rejected { delay_ms } => delay_ms,
        other => panic!("expected a rejection, got {other:?} ({reply:?})"),
    }
}

fn pttl(inspector: &mut redis::Connection, key: &str) -> i64 {
    redis::cmd("PTTL").arg(key).query(inspector).unwrap()
}

/// `ZRANGE key 0 -1 WITHSCORES`: (member bytes, score ms).
fn members(inspector: &mut redis::Connection, key: &str) -> Vec<(Vec<u8>, u64)> {
    let scored: Vec<(Vec<u8>, f64)> =
        redis::cmd("ZRANGE").arg(key).arg(0).arg(-1).arg("WITHSCORES").query(inspector).unwrap();
    scored.into_iter().map(|(member, score)| (member, score as u64)).collect()
}

/// Redis's `TIME`, ms.
fn redis_time_ms(inspector: &mut redis::Connection) -> u64 {
    let (seconds, micros): (u64, u64) = redis::cmd("TIME").query(inspector).unwrap();
    seconds * 1000 + micros / 1000
}

/// Redisson's member bytes for this gateway's acquire: `struct.pack('Bc0I', 16, random, permits)`.
fn member_bytes(random: &[u8; MEMBER_RANDOM_LEN], permits: u32) -> Vec<u8> {
    [&[16u8][..], random, &permits.to_le_bytes()].concat()
}

/// (a) The window slides: rate 2 per 5 s, acquires at 0 s and 4 s succeed; 1 ms before 5 s and the clock
/// guard (20 ms: docs/redisson.md, "Clocks") the permit of 0 s still counts, then it has left the window
/// (score <= now - interval - guard), so one more succeeds, and one right after fails because the permit of
/// 4 s is still in it (a fixed window restarting at 5 s would allow two). The delay is Redisson's and the
/// guard, to the ms, from the acquire times the gateway sent.
#[test]
fn a_window_slides_rather_than_resetting() {
    let server = RedisServer::start();
    let mut gateway = Gateway::new(&server, "scenario:sliding", 2, 5000, 0);
    let guard = clock_guard(5000) as u64;
    assert_eq!(guard, 20);
    let at_0s = T0;
    let first = gateway.acquire_at(1, at_0s);
    assert_eq!((first.change, remaining(&first)), (ConfigChange::Created, 1));
    let at_4s = T0 + 4000;
    assert_eq!(remaining(&gateway.acquire_at(1, at_4s)), 0);
    let leaves = at_0s + 5000 + guard;
    assert_eq!(delay(&gateway.acquire_at(1, leaves - 1)), 3 + 1, "the permit of 0 s leaves at 5 s + guard, not before");
    assert_eq!(remaining(&gateway.acquire_at(1, leaves)), 0, "the permit taken at 0 s was released at 5 s + guard");
    let now = leaves + 1;
    let rejected = gateway.acquire_at(1, now);
    assert_eq!(delay(&rejected), 3 + 5000 + guard - (now - at_4s), "Redisson's 3 + interval - (now - oldest), + guard");
    assert_eq!(rejected.available, None, "the short reply: the delay only");
}

/// (b) trySetRate never overwrites; then rate 10 per second, in three rounds 1.05 s apart: 10 acquire, the
/// next 10 are refused with Redisson's delay (and the clock guard), and between rounds the window is full again.
#[test]
fn try_set_rate_keeps_the_first_config_and_rounds_of_ten_per_second() {
    let server = RedisServer::start();
    let mut inspector = server.inspector();
    let mut gateway = Gateway::new(&server, "scenario:rounds", 10, 1000, 0);
    assert_eq!(gateway.try_set_rate(10), Reply::Integer(1));
    assert_eq!(gateway.try_set_rate(10), Reply::Integer(0), "second trySetRate");
    assert_eq!(gateway.try_set_rate(5), Reply::Integer(0), "trySetRate cannot change a rate");
    let rate: String = redis::cmd("HGET").arg(&gateway.keys.config).arg("rate").query(&mut inspector).unwrap();
    assert_eq!(rate, "10");
    for round in 0..3 {
        let round_start = T0 + round * 1050;
        // One acquire a ms: the round spreads over 20 ms of its window.
        let mut now = round_start;
        for taken in 1..=10 {
            let reply = gateway.acquire_at(1, now);
            assert_eq!(reply.change, ConfigChange::None);
            assert_eq!(remaining(&reply), 10 - taken, "round {round}");
            now += 1;
        }
        for _ in 0..10 {
            assert_eq!(
                delay(&gateway.acquire_at(1, now)),
                3 + 1000 + clock_guard(1000) as u64 - (now - round_start),
                "round {round}"
            );
            now += 1;
        }
    }
}

/// (c) More permits than the rate: Redisson raises "Requested permits amount cannot exceed defined rate";
/// the gateway answers code 2 at once (no wait would ever grant them), consumes nothing, and the rate that
/// counts is the one in Redis.
#[test]
fn more_permits_than_the_rate_are_refused_at_once() {
    let server = RedisServer::start();
    let mut inspector = server.inspector();
    let mut gateway = Gateway::new(&server, "scenario:too-many", 3, 1000, 0);
    let asked = Instant::now();
    let refused = gateway.acquire(4);
    // One Redis round trip (milliseconds): 3 s is room for a loaded machine, and still far from waiting for
    // permits (which can never come: a blocking acquire would wait forever).
    assert!(asked.elapsed() < Duration::from_secs(3), "answered in {:?}", asked.elapsed());
    assert_eq!(refused.outcome, AcquireOutcome::ExceedsRate);
    assert_eq!(refused.effective.map(|e| e.rate), Some(3));
    let exists: i64 =
        redis::cmd("EXISTS").arg(&gateway.keys.value).arg(&gateway.keys.permits).query(&mut inspector).unwrap();
    assert_eq!(exists, 0, "nothing consumed");
    assert_eq!(remaining(&gateway.acquire(3)), 0, "the whole rate at once is fine");
    // A Java service created the limiter first with rate 2: Redis wins over the gateway's 3.
    let mut other = Gateway::new(&server, "scenario:too-many-java", 3, 1000, 0);
    assert_eq!(other.try_set_rate(2), Reply::Integer(1));
    let refused = other.acquire(3);
    assert_eq!((refused.outcome, refused.effective.map(|e| e.rate)), (AcquireOutcome::ExceedsRate, Some(2)));
}

/// (d) availablePermits: the full rate on a new limiter, less after acquires, the full rate again once the
/// window has passed (1 ms before, not yet).
#[test]
fn available_permits_come_back_after_a_window() {
    let server = RedisServer::start();
    let mut gateway = Gateway::new(&server, "scenario:available", 3, 1000, 0);
    assert!(gateway.available_permits_at(T0).error_code().is_some(), "not initialized yet");
    assert_eq!(gateway.try_set_rate(3), Reply::Integer(1));
    assert_eq!(gateway.available_permits_at(T0), Reply::Integer(3));
    assert_eq!(remaining(&gateway.acquire_at(2, T0)), 1);
    assert_eq!(gateway.available_permits_at(T0), Reply::Integer(1));
    assert_eq!(gateway.available_permits_at(T0 + 999), Reply::Integer(1));
    assert_eq!(gateway.available_permits_at(T0 + 1000), Reply::Integer(3));
}

/// (e) keepAliveTime 2000 ms, interval 1000 ms: after an acquire every key carries a TTL in (0, 2000]; once
/// the TTLs have run out unused (Redis, real time) every key is gone, and the next gateway acquire re-creates
/// the limiter. Margin: the TTLs are read within milliseconds of the acquire, 2 s before they run out.
#[test]
fn keep_alive_expires_an_idle_limiter_and_the_gateway_recreates_it() {
    const KEEP_ALIVE_MS: u64 = 2000;
    let server = RedisServer::start();
    let mut inspector = server.inspector();
    let mut gateway = Gateway::new(&server, "scenario:keep-alive", 5, 1000, KEEP_ALIVE_MS);
    let acquired = Instant::now();
    let first = gateway.acquire(1);
    assert_eq!((first.change, remaining(&first)), (ConfigChange::Created, 4));
    for key in [&gateway.keys.config, &gateway.keys.value, &gateway.keys.permits] {
        let ttl = pttl(&mut inspector, key);
        assert!(ttl > 0 && ttl <= KEEP_ALIVE_MS as i64, "{key}: PTTL {ttl}");
    }
    let names = gateway.key_names();
    wait_until_expired(&mut inspector, &names, Duration::from_millis(KEEP_ALIVE_MS) + EXPIRY_GRACE);
    assert!(acquired.elapsed() >= Duration::from_millis(KEEP_ALIVE_MS - 100), "expired before keepAliveTime");
    let again = gateway.acquire(1);
    assert_eq!((again.change, remaining(&again)), (ConfigChange::Created, 4));
}

/// (f) The clock: an empty `now` makes the script use Redis's `TIME` (the member's score lies between two
/// `TIME` reads around the call); a gateway clock 10 s ahead is used as given (Redisson trusts the
/// client's clock the same way).
#[test]
fn redis_time_or_the_given_clock_scores_the_member() {
    let server = RedisServer::start();
    let mut inspector = server.inspector();
    let mut gateway = Gateway::new(&server, "scenario:clock", 5, 60_000, 0);
    let before = redis_time_ms(&mut inspector);
    let (reply, random) = gateway.acquire_with(1, Clock::Redis);
    let after = redis_time_ms(&mut inspector);
    assert_eq!(remaining(&reply), 4);
    let scored = members(&mut inspector, &gateway.keys.permits);
    assert_eq!(scored.len(), 1);
    assert_eq!(scored[0].0, member_bytes(&random, 1));
    assert!((before..=after).contains(&scored[0].1), "score {} not in Redis TIME [{before}, {after}]", scored[0].1);
    let skewed = wall_ms() + 10_000;
    let (_, random) = gateway.acquire_with(2, Clock::Gateway(skewed));
    let scored = members(&mut inspector, &gateway.keys.permits);
    assert!(scored.contains(&(member_bytes(&random, 2), skewed)), "{scored:?} lacks score {skewed}");
}

/// Calls that reach Redis out of the order of their stamps (two gateways: the later stamp's call runs first),
/// rate 2 per second. Permits at 350 and 400 ms; a call stamped 1,450 releases both and is admitted; then
/// a call stamped 1,300 (sent earlier, run later) is admitted to the permit left, but scored 1,450, not
/// 1,300: the window (300, 1,300] held 350 and 400 already, and a member at 1,300 would put 3 permits in
/// it. Redisson's own script scores it 1,300 (the model's `try_acquire`).
#[test]
fn a_call_stamped_before_the_newest_permit_takes_its_score() {
    let server = RedisServer::start();
    let mut inspector = server.inspector();
    let mut gateway = Gateway::new(&server, "scenario:order", 2, 1000, 0);
    assert_eq!(remaining(&gateway.acquire_at(1, T0 + 350)), 1);
    assert_eq!(remaining(&gateway.acquire_at(1, T0 + 400)), 0);
    let (reply, first) = gateway.acquire_with(1, Clock::Gateway(T0 + 1450));
    assert_eq!(remaining(&reply), 1, "stamped 1,450: the permits of 350 and 400 ms left the window");
    let (reply, late) = gateway.acquire_with(1, Clock::Gateway(T0 + 1300));
    assert_eq!(remaining(&reply), 0, "stamped 1,300: admitted to the permit left");
    let scored = members(&mut inspector, &gateway.keys.permits);
    let mut expected = vec![(member_bytes(&first, 1), T0 + 1450), (member_bytes(&late, 1), T0 + 1450)];
    expected.sort();
    let mut scored = scored;
    scored.sort();
    assert_eq!(scored, expected, "both scored 1,450");
}

/// PER_CLIENT: each client instance has its own window (its own value and permits keys).
#[test]
fn per_client_limiters_give_each_client_its_own_window() {
    let server = RedisServer::start();
    let mut a = Gateway::new(&server, "scenario:per-client", 2, 60_000, 0);
    a.limiter_type = LimiterType::PerClient;
    let mut b = Gateway {
        keys: LimiterKeys::new("scenario:per-client", OTHER_CLIENT),
        ..Gateway::new(&server, "", 2, 60_000, 0)
    };
    b.limiter_type = LimiterType::PerClient;
    assert_eq!(remaining(&a.acquire(2)), 0);
    assert!(delay(&a.acquire(1)) > 0);
    assert_eq!(remaining(&b.acquire(1)), 1, "client b's window is untouched by a");
    let mut inspector = server.inspector();
    let exists: i64 = redis::cmd("EXISTS").arg(&a.keys.value).arg(&a.keys.permits).query(&mut inspector).unwrap();
    assert_eq!(exists, 0, "no overall keys for a PER_CLIENT limiter");
}

/// Redisson 4.4+ updateRate (keepState) ends like every write script: with keepAliveTime > 0 the hash,
/// value and permits keys all get it, so an idle limiter still expires as a whole and comes back fresh.
/// (A value key left without a TTL outlives its permits: once the hash and permits expired, the gateway
/// re-creates the hash, finds value 0 and no permit to release, and rejects that limiter forever.)
/// keepAlive 2000 ms: the TTLs are read within milliseconds of updateRate, 2 s before they run out.
#[test]
fn update_rate_leaves_every_key_on_the_keep_alive() {
    const KEEP_ALIVE_MS: u64 = 2000;
    let server = RedisServer::start();
    let mut inspector = server.inspector();
    let mut gateway = Gateway::new(&server, "scenario:update-keep-alive", 1, 200, KEEP_ALIVE_MS);
    assert_eq!(remaining(&gateway.acquire(1)), 0);
    let args = gateway.config_args(1);
    let now = wall_ms().to_string();
    let argv: Vec<&[u8]> = args.iter().map(|a| a.as_bytes()).chain([now.as_bytes()]).collect();
    assert_eq!(gateway.scripts.run(&UPDATE_RATE, &gateway.keys, &argv), Reply::Integer(1));
    for key in [&gateway.keys.config, &gateway.keys.value, &gateway.keys.permits] {
        let ttl = pttl(&mut inspector, key);
        assert!(ttl > 0 && ttl <= KEEP_ALIVE_MS as i64, "after updateRate, {key}: PTTL {ttl}");
    }
    let names = gateway.key_names();
    wait_until_expired(&mut inspector, &names, Duration::from_millis(KEEP_ALIVE_MS) + EXPIRY_GRACE);
    let again = gateway.acquire(1);
    assert_eq!((again.change, again.outcome), (ConfigChange::Created, AcquireOutcome::Acquired { remaining: 0 }));
}

/// The member layout in Redis is Redisson's: 21 bytes, `Bc0I`, read back exactly.
#[test]
fn members_are_written_in_redisson_layout() {
    let server = RedisServer::start();
    let mut inspector = server.inspector();
    let mut gateway = Gateway::new(&server, "{scenario}:layout", 300, 60_000, 0);
    let now = wall_ms();
    let (_, random) = gateway.acquire_with(258, Clock::Gateway(now));
    assert_eq!(gateway.keys.permits, "{scenario}:layout:permits", "a hash-tagged name keeps its tag");
    let scored = members(&mut inspector, &gateway.keys.permits);
    let expected = member_bytes(&random, 258);
    assert_eq!(expected.len(), 21);
    assert_eq!(scored, vec![(expected, now)]);
    let value: Option<String> = redis::cmd("GET").arg(&gateway.keys.value).query(&mut inspector).unwrap();
    assert_eq!(value.as_deref(), Some("42"));
}

/// The combined acquire of several rules (ACQUIRE_ALL) as the filter sends it: one part per limiter, all
/// rules of rate 5 per minute and one permit per request; `lease` asks for up to that many permits.
fn acquire_all(
    scripts: &mut ScriptClient,
    parts: &[(&str, Option<u64>)],
    errors_stop_charge: bool,
    now_ms: u64,
) -> Vec<LimiterReply> {
    let template = AcquireTemplate::new(
        AcquireConfig {
            permits: 1,
            rate: 5,
            interval_ms: 60_000,
            limiter_type: LimiterType::Overall,
            keep_alive_ms: 0,
            apply_config: false,
            layout: edge_rate_limiter::config::WindowLayout::SlidingLog,
        },
        CLIENT,
    );
    let randoms: Vec<[u8; MEMBER_RANDOM_LEN]> = parts.iter().map(|_| fresh_random()).collect();
    let leases: Vec<Option<LeaseRequest>> = parts
        .iter()
        .map(|(_, lease)| lease.map(|max_permits| LeaseRequest { max_permits, max_age_ms: 50, settle: None }))
        .collect();
    let encoded = |invocation| {
        let parts: Vec<AcquirePart<'_>> = parts
            .iter()
            .zip(&randoms)
            .zip(&leases)
            .map(|(((name, _), random), lease)| AcquirePart {
                template: &template,
                name,
                random,
                lease: lease.as_ref(),
            })
            .collect();
        encode_acquire_all(&parts, Clock::Gateway(now_ms), errors_stop_charge, invocation, Encoding::Resp)
    };
    let reply = scripts.run_raw(&encoded(Invocation::BySha), || encoded(Invocation::BySource));
    decode_acquire_all_reply(&reply, parts.len()).unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&reply)))
}

/// A lease rule and another rule of the same request on one limiter: the lease takes only what the other
/// leaves, so the value never goes below zero and both acquire (the review found the lease taking every
/// free permit first, the other rule's DECRBY then driving the value to -1 and the reply being refused).
#[test]
fn a_lease_sharing_a_limiter_with_another_rule_of_the_request_takes_only_what_that_rule_leaves() {
    let server = RedisServer::start();
    let mut inspector = server.inspector();
    let mut scripts = server.script_client();
    let replies = acquire_all(&mut scripts, &[("erl:shared", Some(8)), ("erl:shared", None)], false, T0);
    let granted: Vec<(AcquireOutcome, Option<u64>)> =
        replies.iter().map(|r| r.as_ref().map(|r| (r.outcome, r.granted)).unwrap()).collect();
    assert_eq!(
        granted,
        vec![
            (AcquireOutcome::Acquired { remaining: 1 }, Some(4)),
            (AcquireOutcome::Acquired { remaining: 0 }, Some(1))
        ],
        "the lease takes 4 of the 5 free, the other rule the last one"
    );
    let value: String = redis::cmd("GET").arg("{erl:shared}:value").query(&mut inspector).unwrap();
    assert_eq!(value, "0");
    let held: u64 = members(&mut inspector, "{erl:shared}:permits")
        .iter()
        .map(|(member, _)| u64::from(u32::from_le_bytes(member[17..21].try_into().unwrap())))
        .sum();
    assert_eq!(held, 5, "the members hold exactly the permits taken");
}

/// A Redis error on one limiter's keys (its config key holds a string: WRONGTYPE) is that limiter's alone:
/// the others still decide and are charged, unless the request fails closed (then none is charged).
#[test]
fn an_error_on_one_limiters_keys_is_that_limiters_alone() {
    let server = RedisServer::start();
    let mut inspector = server.inspector();
    let mut scripts = server.script_client();
    let _: () = redis::cmd("SET").arg("erl:broken").arg("not a hash").query(&mut inspector).unwrap();
    for (errors_stop_charge, charged) in [(false, true), (true, false)] {
        let _: () = redis::cmd("DEL").arg("erl:healthy").arg("{erl:healthy}:value").query(&mut inspector).unwrap();
        let replies = acquire_all(&mut scripts, &[("erl:broken", None), ("erl:healthy", None)], errors_stop_charge, T0);
        assert!(replies[0].as_ref().is_err_and(|e| e.starts_with("WRONGTYPE")), "{:?}", replies[0]);
        let healthy = replies[1].as_ref().unwrap();
        let value: String = redis::cmd("GET").arg("{erl:healthy}:value").query(&mut inspector).unwrap();
        if charged {
            assert_eq!(healthy.outcome, AcquireOutcome::Acquired { remaining: 4 });
            assert_eq!(value, "4");
        } else {
            assert_eq!(healthy.outcome, AcquireOutcome::Untaken { available: 5 }, "failing closed: nothing taken");
            assert_eq!(value, "5");
        }
    }
}
