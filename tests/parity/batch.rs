//! Request coalescing on a real `redis-server`: a sequence of acquire calls (ACQUIRE, with and without a
//! lease, ACQUIRE_ALL over limiters shared between calls, one of them broken, and in-flight permits'
//! SEMAPHORE_ACQUIRE, whose leases end as the clock moves) sent one by one to one
//! server and in random batches (ACQUIRE_BATCH, built from the very same commands) to another gives every
//! call the very same reply bytes and leaves both servers with the very same keys. So a request decided in
//! a batch is decided as it would have been alone, in that order, with the same effects in Redis.
#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]

use proptest::prelude::*;

use crate::redis_server::{RedisServer, ScriptClient};
use edge_rate_limiter::config::LimiterType;
use edge_rate_limiter::script::{
    encode_acquire_all, encode_batch, encode_semaphore_acquires, split_batch_reply, AcquireConfig, AcquirePart,
    AcquireTemplate, Clock, Encoding, Invocation, LeaseRequest, Publish, Segment, SemaphoreAcquire, MEMBER_RANDOM_LEN,
    PERMIT_ID_LEN,
};

const CLIENT: &str = "6d1f3b9a-2c4e-4a8b-b5d7-9e0f1a2b3c4d";
const T0: u64 = 1_700_000_000_000;
/// The limiters the calls draw from; the last one's config key is a string (every call on it fails with
/// WRONGTYPE, the others of its call still decide).
const NAMES: [&str; 4] = ["erl:batch:a", "erl:batch:b", "erl:batch:c", "erl:batch:broken"];
/// The semaphores of in-flight permits (3 permits each); the last one is limiter `a`'s name (a hash once
/// `a` exists: its acquires then fail with WRONGTYPE; a string before: `a`'s acquires fail).
const SEMAPHORES: [&str; 3] = ["erl:batch:sem", "erl:batch:{sem}:b", "erl:batch:a"];

/// One call of the sequence: its limiters (one: ACQUIRE; more: ACQUIRE_ALL), a lease wanted on the first,
/// and how far the virtual clock moves before it (ms); or, with `semaphore`, an in-flight permit of that
/// semaphore whose lease lasts `permit_lease_ms`.
#[derive(Debug, Clone, Default)]
struct CallSpec {
    limiters: Vec<usize>,
    lease: Option<u64>,
    advance_ms: u64,
    redis_clock: bool,
    semaphore: Option<usize>,
    permit_lease_ms: u64,
}

fn call_strategy() -> impl Strategy<Value = CallSpec> {
    (
        prop::collection::vec(prop_oneof![8 => 0usize..3, 1 => Just(3usize)], 1..=3),
        prop_oneof![3 => Just(None), 1 => (2u64..6).prop_map(Some)],
        prop_oneof![3 => Just(0u64), 2 => 1u64..400, 1 => 900u64..1500],
        prop::bool::weighted(0.1),
        prop_oneof![3 => Just(None), 1 => prop_oneof![4 => 0usize..2, 1 => Just(2usize)].prop_map(Some)],
        200u64..2_000,
    )
        .prop_map(|(limiters, lease, advance_ms, redis_clock, semaphore, permit_lease_ms)| CallSpec {
            limiters,
            lease,
            advance_ms,
            redis_clock,
            semaphore,
            permit_lease_ms,
        })
}

/// The calls and the sizes of the batches they are cut into.
fn case_strategy() -> impl Strategy<Value = (Vec<CallSpec>, Vec<usize>)> {
    (prop::collection::vec(call_strategy(), 1..60), prop::collection::vec(1usize..12, 60))
}

fn template() -> AcquireTemplate {
    AcquireTemplate::new(
        AcquireConfig {
            permits: 1,
            rate: 7,
            interval_ms: 1_000,
            limiter_type: LimiterType::Overall,
            keep_alive_ms: 0,
            apply_config: false,
            layout: edge_rate_limiter::config::WindowLayout::SlidingLog,
        },
        CLIENT,
    )
}

/// The command of call `index` by sha, as the filter encodes it.
fn command(spec: &CallSpec, index: usize, now_ms: u64, template: &AcquireTemplate) -> Vec<u8> {
    if let Some(semaphore) = spec.semaphore {
        let mut id = [0xA5; PERMIT_ID_LEN];
        id[..8].copy_from_slice(&(index as u64 + 1).to_be_bytes());
        let permit = SemaphoreAcquire {
            name: SEMAPHORES[semaphore],
            permits: 3,
            lease_end_ms: now_ms + spec.permit_lease_ms,
            id: &id,
        };
        return encode_semaphore_acquires(&[permit], now_ms, Publish::Plain, Invocation::BySha, Encoding::Resp);
    }
    let mut random = [0x5A; MEMBER_RANDOM_LEN];
    random[..8].copy_from_slice(&(index as u64 + 1).to_be_bytes());
    let clock = if spec.redis_clock { Clock::Redis } else { Clock::Gateway(now_ms) };
    let lease = spec.lease.map(|max_permits| LeaseRequest { max_permits, max_age_ms: 50, settle: None });
    if let [only] = spec.limiters.as_slice() {
        return template.encode(NAMES[*only], clock, &random, lease.as_ref(), Invocation::BySha, Encoding::Resp);
    }
    let randoms: Vec<[u8; MEMBER_RANDOM_LEN]> = (0..spec.limiters.len())
        .map(|part| {
            let mut r = random;
            r[8] = part as u8;
            r
        })
        .collect();
    let parts: Vec<AcquirePart<'_>> = spec
        .limiters
        .iter()
        .zip(&randoms)
        .enumerate()
        .map(|(part, (&limiter, random))| AcquirePart {
            template,
            name: NAMES[limiter],
            random,
            lease: if part == 0 { lease.as_ref() } else { None },
        })
        .collect();
    encode_acquire_all(&parts, clock, false, Invocation::BySha, Encoding::Resp)
}

/// Every key of the server with its content, sorted (TYPE and the value, hash fields, zset members and
/// scores), and the scripts' effects on TTLs (PTTL > 0 as one flag).
fn keys_of(server: &RedisServer) -> Vec<String> {
    let mut inspector = server.inspector();
    let mut keys: Vec<String> = redis::cmd("KEYS").arg("*").query(&mut inspector).unwrap();
    keys.sort();
    keys.into_iter()
        .map(|key| {
            let kind: String = redis::cmd("TYPE").arg(&key).query(&mut inspector).unwrap();
            let content: Vec<Vec<u8>> = match kind.as_str() {
                "string" => vec![redis::cmd("GET").arg(&key).query(&mut inspector).unwrap()],
                "hash" => redis::cmd("HGETALL").arg(&key).query(&mut inspector).unwrap(),
                "zset" => {
                    redis::cmd("ZRANGE").arg(&key).arg(0).arg(-1).arg("WITHSCORES").query(&mut inspector).unwrap()
                }
                other => panic!("unexpected key type {other}"),
            };
            let ttl: i64 = redis::cmd("PTTL").arg(&key).query(&mut inspector).unwrap();
            format!("{key} {kind} {:?} ttl:{}", content, ttl > 0)
        })
        .collect()
}

fn break_limiter(server: &RedisServer) {
    let _: () = redis::cmd("SET").arg(NAMES[3]).arg("not a hash").query(&mut server.inspector()).unwrap();
}

/// Sends `batch` (commands by sha) as one ACQUIRE_BATCH call, by source after NOSCRIPT, and splits the reply.
fn run_batch(client: &mut ScriptClient, commands: &[Vec<u8>]) -> Vec<Vec<u8>> {
    let segments: Vec<Segment<'_>> = commands.iter().map(|c| Segment::of(c, Encoding::Resp).unwrap()).collect();
    let reply = client.run_raw(&encode_batch(&segments, Invocation::BySha, Encoding::Resp), || {
        encode_batch(&segments, Invocation::BySource, Encoding::Resp)
    });
    split_batch_reply(&reply, commands.len()).unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&reply)))
}

fn check(calls: &[CallSpec], cuts: &[usize], alone: &RedisServer, batched: &RedisServer) -> Result<(), TestCaseError> {
    let template = template();
    let mut now_ms = T0;
    let commands: Vec<Vec<u8>> = calls
        .iter()
        .enumerate()
        .map(|(index, spec)| {
            now_ms += spec.advance_ms;
            command(spec, index, now_ms, &template)
        })
        .collect();
    let mut one = alone.script_client();
    // The scripts are loaded (load_scripts): by sha, as the filter sends them.
    let replies_alone: Vec<Vec<u8>> = commands.iter().map(|command| one.call_raw(command)).collect();
    let mut other = batched.script_client();
    let mut replies_batched = Vec::new();
    let mut at = 0;
    for &cut in cuts.iter().cycle() {
        if at >= commands.len() {
            break;
        }
        let end = (at + cut).min(commands.len());
        replies_batched.extend(run_batch(&mut other, &commands[at..end]));
        at = end;
    }
    // Calls on Redis's clock run at other instants on the two servers: compared by their kind only.
    let uses_redis_clock = calls.iter().any(|c| c.redis_clock);
    if !uses_redis_clock {
        // An error reply alone ends with the script's name and line (`script: <sha>, on @user_script:2.`),
        // which a segment's has not: errors are compared by their code and message up to there.
        let comparable = |reply: &Vec<u8>| -> Vec<u8> {
            let text = String::from_utf8_lossy(reply);
            match text.find(" script: ") {
                Some(at) if reply.first() == Some(&b'-') => text[..at].as_bytes().to_vec(),
                _ => reply.trim_ascii_end().to_vec(),
            }
        };
        let replies_one: Vec<Vec<u8>> = replies_alone.iter().map(comparable).collect();
        let replies_together: Vec<Vec<u8>> = replies_batched.iter().map(comparable).collect();
        prop_assert_eq!(replies_one, replies_together);
        prop_assert_eq!(keys_of(alone), keys_of(batched));
    } else {
        for (a, b) in replies_alone.iter().zip(&replies_batched) {
            prop_assert_eq!(a.first(), b.first(), "{:?} {:?}", String::from_utf8_lossy(a), String::from_utf8_lossy(b));
        }
    }
    Ok(())
}

/// Loads ACQUIRE, ACQUIRE_ALL and SEMAPHORE_ACQUIRE by source once (the single calls are sent by sha).
fn load_scripts(server: &RedisServer) {
    use edge_rate_limiter::script::{ACQUIRE, ACQUIRE_ALL, SEMAPHORE_ACQUIRE};
    let mut inspector = server.inspector();
    for script in [&ACQUIRE, &ACQUIRE_ALL, &SEMAPHORE_ACQUIRE] {
        let _: String = redis::cmd("SCRIPT").arg("LOAD").arg(script.source).query(&mut inspector).unwrap();
    }
}

#[test]
fn calls_in_a_batch_are_decided_as_they_are_alone_in_that_order() {
    let alone = RedisServer::start();
    let batched = RedisServer::start();
    load_scripts(&alone);
    let cases = std::env::var("PROPTEST_CASES").ok().and_then(|n| n.parse().ok()).unwrap_or(64);
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig { cases, ..ProptestConfig::default() });
    runner
        .run(&case_strategy(), |(calls, cuts)| {
            for server in [&alone, &batched] {
                let _: () = redis::cmd("FLUSHDB").query(&mut server.inspector()).unwrap();
                break_limiter(server);
            }
            check(&calls, &cuts, &alone, &batched)
        })
        .unwrap();
}

/// A batch whose script Redis does not know yet (`NOSCRIPT`, as after a restart or `SCRIPT FLUSH`) is
/// sent again by source and answers every call.
#[test]
fn a_batch_after_script_flush_is_sent_again_by_source() {
    let server = RedisServer::start();
    let template = template();
    let spec = CallSpec { limiters: vec![0], ..Default::default() };
    let commands: Vec<Vec<u8>> = (0..9).map(|i| command(&spec, i, T0, &template)).collect();
    let _: () = redis::cmd("SCRIPT").arg("FLUSH").query(&mut server.inspector()).unwrap();
    let replies = run_batch(&mut server.script_client(), &commands);
    assert!(replies[0].starts_with(b"*8\r\n"), "the first creates the limiter: the full reply");
    let expected: Vec<Vec<u8>> =
        [":5", ":4", ":3", ":2", ":1", ":0"].iter().map(|r| format!("{r}\r\n").into_bytes()).collect();
    assert_eq!(&replies[1..7], &expected[..], "7 permits per second: 5 left ... 0 left");
    for reply in &replies[7..] {
        assert!(reply.starts_with(b":-"), "rejected with a delay: {}", String::from_utf8_lossy(reply));
    }
}

/// Out of memory (maxmemory, noeviction): Redis refuses a script's first write that may grow memory but
/// none after a write went through, so a batch asks first and is refused whole, as each call alone would
/// be: nothing is written.
#[test]
fn a_batch_out_of_memory_is_refused_whole_and_writes_nothing() {
    let server = RedisServer::start();
    let template = template();
    let mut client = server.script_client();
    let spec = |limiter| CallSpec { limiters: vec![limiter], ..Default::default() };
    // The limiters exist, with a member each (a release will find something to remove a second later).
    let warm: Vec<Vec<u8>> = (0..3).map(|i| command(&spec(i), i, T0, &template)).collect();
    run_batch(&mut client, &warm);
    let before = keys_of(&server);
    let mut inspector = server.inspector();
    let _: () =
        redis::cmd("CONFIG").arg("SET").arg("maxmemory-policy").arg("noeviction").query(&mut inspector).unwrap();
    let _: () = redis::cmd("CONFIG").arg("SET").arg("maxmemory").arg("1").query(&mut inspector).unwrap();
    let commands: Vec<Vec<u8>> = (0..3).map(|i| command(&spec(i), 10 + i, T0 + 1_500, &template)).collect();
    let segments: Vec<Segment<'_>> = commands.iter().map(|c| Segment::of(c, Encoding::Resp).unwrap()).collect();
    let reply = client.call_raw(&encode_batch(&segments, Invocation::BySha, Encoding::Resp));
    let _: () = redis::cmd("CONFIG").arg("SET").arg("maxmemory").arg("0").query(&mut inspector).unwrap();
    assert!(reply.starts_with(b"-OOM"), "{}", String::from_utf8_lossy(&reply));
    assert_eq!(keys_of(&server), before, "nothing written");
}

/// A batch of one segment asks nothing first (no probe): out of memory, it is answered as the call alone is
/// (Redis refuses a script's first write that may grow memory, and lets the rest of the script write once
/// one write went through): two limiters in the same state, one call alone, one in a batch of one, give the
/// same answer.
#[test]
fn a_batch_of_one_out_of_memory_is_answered_as_the_call_alone() {
    let server = RedisServer::start();
    let template = template();
    let mut client = server.script_client();
    let spec = |limiter| CallSpec { limiters: vec![limiter], ..Default::default() };
    run_batch(&mut client, &[command(&spec(0), 0, T0, &template), command(&spec(1), 1, T0, &template)]);
    let mut inspector = server.inspector();
    let _: String =
        redis::cmd("SCRIPT").arg("LOAD").arg(edge_rate_limiter::script::ACQUIRE.source).query(&mut inspector).unwrap();
    let _: () =
        redis::cmd("CONFIG").arg("SET").arg("maxmemory-policy").arg("noeviction").query(&mut inspector).unwrap();
    let _: () = redis::cmd("CONFIG").arg("SET").arg("maxmemory").arg("1").query(&mut inspector).unwrap();
    let in_batch = run_batch(&mut client, &[command(&spec(0), 2, T0 + 1_500, &template)]);
    let alone = client.call_raw(&command(&spec(1), 3, T0 + 1_500, &template));
    let _: () = redis::cmd("CONFIG").arg("SET").arg("maxmemory").arg("0").query(&mut inspector).unwrap();
    let text = |reply: &[u8]| String::from_utf8_lossy(reply).trim_end().to_string();
    assert_eq!(text(&in_batch[0]), text(&alone), "the same answer alone and in a batch of one");
}

/// The settle calls of one tick (GIVE_BACK of reservations, reserve-then-settle) in one ACQUIRE_BATCH call
/// answer every call as it would be answered alone and leave Redis as the same calls one by one do: fewer
/// permits back, an excess charged, a member already gone not found.
#[test]
fn settles_in_a_batch_answer_and_write_as_they_do_alone() {
    use edge_rate_limiter::script::Settlement;
    let alone = RedisServer::start();
    let batched = RedisServer::start();
    load_scripts(&alone);
    load_scripts(&batched);
    let _: String = redis::cmd("SCRIPT")
        .arg("LOAD")
        .arg(edge_rate_limiter::script::GIVE_BACK.source)
        .query(&mut alone.inspector())
        .unwrap();
    let template = template();
    let spec = CallSpec { limiters: vec![0], ..Default::default() };
    let acquires: Vec<Vec<u8>> = (0..4).map(|i| command(&spec, i, T0 + i as u64, &template)).collect();
    for server in [&alone, &batched] {
        let mut client = server.script_client();
        for acquire in &acquires {
            client.run_raw(acquire, || panic!("ACQUIRE is loaded"));
        }
    }
    // Members 1..=4 of one permit each (rate 7): settle 1 to 0 (given back), 2 to 3 (an excess of 2), 3 to 1
    // (renamed), and a member that was never acquired.
    let random = |index: u64| {
        let mut random = [0x5A; MEMBER_RANDOM_LEN];
        random[..8].copy_from_slice(&index.to_be_bytes());
        random
    };
    let settlements =
        [(1, 0, None), (2, 3, None), (3, 1, Some(random(33))), (9, 0, None)].map(|(index, used, renamed)| Settlement {
            random: random(index),
            granted: 1,
            used,
            early_ms: 0,
            renamed,
            at: None,
        });
    let commands: Vec<Vec<u8>> =
        settlements.iter().map(|s| s.encode(NAMES[0], &template, Invocation::BySha, Encoding::Resp)).collect();
    let mut client = alone.script_client();
    let one_by_one: Vec<Vec<u8>> =
        commands.iter().map(|command| client.run_raw(command, || panic!("GIVE_BACK is loaded"))).collect();
    assert_eq!(one_by_one, [":1\r\n", ":1\r\n", ":1\r\n", ":0\r\n"].map(|r| r.as_bytes().to_vec()));
    assert_eq!(run_batch(&mut batched.script_client(), &commands), one_by_one);
    assert_eq!(keys_of(&alone), keys_of(&batched));
}

/// A request's in-flight permits and its rate acquire joined in one batch (`Gate`): the acquire runs only if
/// every permit that gates it was taken. A refused permit skips the request's later permits and its acquire
/// (each answers `SKIPPED`; Redis keeps nothing of theirs), and the next request's segments run as usual.
#[test]
fn a_rate_acquire_gated_by_permits_runs_only_when_they_were_taken() {
    use edge_rate_limiter::script::Gate;
    let server = RedisServer::start();
    let template = template();
    let mut client = server.script_client();
    let mut inspector = server.inspector();
    // `erl:batch:sem` has no permit free (3 taken, leases of 10 s); `erl:batch:{sem}:b` has 3.
    let full = CallSpec { semaphore: Some(0), permit_lease_ms: 10_000, ..Default::default() };
    let taken: Vec<Vec<u8>> = (0..3).map(|i| command(&full, 100 + i, T0, &template)).collect();
    run_batch(&mut client, &taken);
    let free = CallSpec { semaphore: Some(1), permit_lease_ms: 10_000, ..Default::default() };
    let rate = |limiter| CallSpec { limiters: vec![limiter], ..Default::default() };
    // Request 1: a free permit, then the full semaphore's, then its acquire on limiter a. Request 2: a free
    // permit, then its acquire on limiter b. Then request 3's plain acquire on limiter c.
    let commands = [
        command(&free, 1, T0, &template),
        command(&full, 2, T0, &template),
        command(&rate(0), 3, T0, &template),
        command(&free, 4, T0, &template),
        command(&rate(1), 5, T0, &template),
        command(&rate(2), 6, T0, &template),
    ];
    let gates = [Gate::Opens, Gate::Opens, Gate::Gated, Gate::Opens, Gate::Gated, Gate::Plain];
    let segments: Vec<Segment<'_>> =
        commands.iter().zip(gates).map(|(c, gate)| Segment::of(c, Encoding::Resp).unwrap().gated(gate)).collect();
    let reply = client.call_raw(&encode_batch(&segments, Invocation::BySha, Encoding::Resp));
    let replies = split_batch_reply(&reply, segments.len()).unwrap();
    let text = |at: usize| String::from_utf8_lossy(&replies[at]).into_owned();
    assert!(text(0).starts_with("*3\r\n:1\r\n"), "request 1's first permit taken: {}", text(0));
    assert!(text(1).starts_with("*3\r\n:0\r\n"), "its second refused: {}", text(1));
    assert!(text(2).starts_with("-SKIPPED"), "so its acquire skipped: {}", text(2));
    assert!(text(3).starts_with("*3\r\n:1\r\n"), "request 2's permit taken: {}", text(3));
    assert!(replies[4].starts_with(b"*8\r\n"), "its acquire ran (a new limiter): {}", text(4));
    assert!(replies[5].starts_with(b"*8\r\n"), "request 3's plain acquire ran: {}", text(5));
    let exists = |key: &str, inspector: &mut redis::Connection| -> bool {
        redis::cmd("EXISTS").arg(key).query::<i64>(inspector).unwrap() == 1
    };
    assert!(!exists(NAMES[0], &mut inspector), "nothing of request 1's acquire in Redis");
    assert!(exists(NAMES[1], &mut inspector) && exists(NAMES[2], &mut inspector));
    // Skipped: a permit after a refused one takes nothing (request 1 holds only its first permit).
    let held: i64 = redis::cmd("ZCARD").arg("erl:batch:{sem}:b:timeout").query(&mut inspector).unwrap();
    assert_eq!(held, 2, "request 1's and request 2's permits of the free semaphore");
    let gated_again =
        [command(&full, 7, T0, &template), command(&free, 8, T0, &template), command(&rate(0), 9, T0, &template)];
    let gates = [Gate::Opens, Gate::Opens, Gate::Gated];
    let segments: Vec<Segment<'_>> =
        gated_again.iter().zip(gates).map(|(c, gate)| Segment::of(c, Encoding::Resp).unwrap().gated(gate)).collect();
    let reply = client.call_raw(&encode_batch(&segments, Invocation::BySha, Encoding::Resp));
    let replies = split_batch_reply(&reply, segments.len()).unwrap();
    assert!(replies[1].starts_with(b"-SKIPPED") && replies[2].starts_with(b"-SKIPPED"), "{replies:?}");
    let held: i64 = redis::cmd("ZCARD").arg("erl:batch:{sem}:b:timeout").query(&mut inspector).unwrap();
    assert_eq!(held, 2, "the permit after a refused one was not taken");
    // A permit that fails (WRONGTYPE: `erl:batch:a` becomes limiter a's hash) leaves the gate open: its
    // request's acquire runs, the request following its failure mode with it.
    run_batch(&mut client, &[command(&rate(0), 10, T0, &template)]);
    let broken = CallSpec { semaphore: Some(2), permit_lease_ms: 10_000, ..Default::default() };
    let failing = [command(&broken, 11, T0, &template), command(&rate(1), 12, T0, &template)];
    let segments: Vec<Segment<'_>> = failing
        .iter()
        .zip([Gate::Opens, Gate::Gated])
        .map(|(c, gate)| Segment::of(c, Encoding::Resp).unwrap().gated(gate))
        .collect();
    let reply = client.call_raw(&encode_batch(&segments, Invocation::BySha, Encoding::Resp));
    let replies = split_batch_reply(&reply, segments.len()).unwrap();
    assert!(replies[0].starts_with(b"-WRONGTYPE"), "{}", String::from_utf8_lossy(&replies[0]));
    assert!(replies[1].starts_with(b":"), "the acquire ran: {}", String::from_utf8_lossy(&replies[1]));
}

/// Permits given back ride in an acquire batch (`SEMAPHORE_RELEASE`, segment `8`): they answer and write
/// as the release alone does (the permits it still finds given back, one released twice not again).
#[test]
fn a_release_in_a_batch_answers_and_writes_as_it_does_alone() {
    use edge_rate_limiter::script::{encode_semaphore_release, SemaphorePermits};
    let alone = RedisServer::start();
    let batched = RedisServer::start();
    let template = template();
    let permit = CallSpec { semaphore: Some(1), permit_lease_ms: 10_000, ..Default::default() };
    let taken: Vec<Vec<u8>> = (0..2).map(|i| command(&permit, i, T0, &template)).collect();
    let id = |index: u64| {
        let mut id = [0xA5; PERMIT_ID_LEN];
        id[..8].copy_from_slice(&(index + 1).to_be_bytes());
        id
    };
    let ids = [id(0), id(0), id(7)];
    let semaphores = [SemaphorePermits { name: SEMAPHORES[1], ids: &ids, lease_end_ms: 0 }];
    let release = |invocation| encode_semaphore_release(&semaphores, Publish::Plain, invocation, Encoding::Resp);
    let rate = CallSpec { limiters: vec![0], ..Default::default() };
    let acquire = command(&rate, 9, T0, &template);
    run_batch(&mut alone.script_client(), &taken);
    run_batch(&mut batched.script_client(), &taken);
    let mut client = alone.script_client();
    let reply_alone = client.run_raw(&release(Invocation::BySha), || release(Invocation::BySource));
    run_batch(&mut client, std::slice::from_ref(&acquire));
    let replies = run_batch(&mut batched.script_client(), &[release(Invocation::BySha), acquire]);
    assert_eq!(reply_alone, b":1\r\n", "one permit given back (the unknown id and the repeat change nothing)");
    assert_eq!(replies[0], reply_alone);
    assert_eq!(keys_of(&alone), keys_of(&batched));
}
