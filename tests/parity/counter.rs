//! The sliding window counter (rule `layout: "sliding_window_counter"`) on a real `redis-server`: ACQUIRE
//! and ACQUIRE_ALL with type `2`, alone, beside a sliding log limiter in one all-or-nothing call, and in
//! ACQUIRE_BATCH. What a user would notice if it broke:
//!
//! - a sliding window (by the admissions' own times) holding more than the rate;
//! - a saturated limiter using less than k/(k+1) of its rate in a whole window;
//! - a `Retry-After` that admits nothing when it ends, or waits longer than one interval and a slice;
//! - Redis memory growing with the admissions (the hash must stay under 1 KB at any count);
//! - a batch deciding otherwise than the same calls alone.
#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]

use proptest::prelude::*;

use crate::redis_server::{RedisServer, ScriptClient};
use edge_rate_limiter::config::{LimiterType, WindowLayout, COUNTER_SLICES};
use edge_rate_limiter::script::{
    encode_acquire_all, encode_batch, split_batch_reply, AcquireConfig, AcquirePart, AcquireTemplate, Clock, Encoding,
    Invocation, Segment, MEMBER_RANDOM_LEN,
};

const CLIENT: &str = "6d1f3b9a-2c4e-4a8b-b5d7-9e0f1a2b3c4d";
const T0: u64 = 1_700_000_000_000;
const RATE: u64 = 40;
const INTERVAL_MS: u64 = 1_000;
/// Two counters and one sliding log (the last), drawn on by the calls.
const NAMES: [&str; 3] = ["erl:swc:a", "erl:swc:b", "erl:swc:log"];

fn template(permits: u64, layout: WindowLayout) -> AcquireTemplate {
    let config = AcquireConfig {
        permits,
        rate: RATE,
        interval_ms: INTERVAL_MS,
        limiter_type: LimiterType::Overall,
        keep_alive_ms: 0,
        apply_config: false,
        layout,
    };
    AcquireTemplate::new(config, CLIENT)
}

/// One call: its limiters (one: ACQUIRE; more: ACQUIRE_ALL), its permits, how far the clock moves first.
#[derive(Debug, Clone)]
struct CallSpec {
    limiters: Vec<usize>,
    permits: u64,
    advance_ms: u64,
}

fn call_strategy() -> impl Strategy<Value = CallSpec> {
    (
        prop_oneof![4 => Just(vec![0usize]), 2 => Just(vec![0usize, 1]), 2 => Just(vec![1usize, 2]), 1 => Just(vec![1usize])],
        1u64..=3,
        prop_oneof![4 => 0u64..15, 1 => 15u64..200, 1 => Just(0u64)],
    )
        .prop_map(|(limiters, permits, advance_ms)| CallSpec { limiters, permits, advance_ms })
}

/// The command of `spec` at `now_ms`, by sha or by source.
fn command(spec: &CallSpec, index: usize, now_ms: u64, invocation: Invocation) -> Vec<u8> {
    let mut random = [0x5A; MEMBER_RANDOM_LEN];
    random[..8].copy_from_slice(&(index as u64 + 1).to_be_bytes());
    let templates: Vec<AcquireTemplate> = spec
        .limiters
        .iter()
        .map(|&l| {
            template(spec.permits, if l == 2 { WindowLayout::SlidingLog } else { WindowLayout::SlidingWindowCounter })
        })
        .collect();
    let clock = Clock::Gateway(now_ms);
    if let ([only], [template]) = (spec.limiters.as_slice(), templates.as_slice()) {
        return template.encode(NAMES[*only], clock, &random, None, invocation, Encoding::Resp);
    }
    let parts: Vec<AcquirePart<'_>> = spec
        .limiters
        .iter()
        .zip(&templates)
        .map(|(&limiter, template)| AcquirePart { template, name: NAMES[limiter], random: &random, lease: None })
        .collect();
    encode_acquire_all(&parts, clock, false, invocation, Encoding::Resp)
}

/// The integers of a RESP reply (a bare integer, or an array of integers).
fn integers(reply: &[u8]) -> Vec<i64> {
    let text = String::from_utf8_lossy(reply);
    text.split("\r\n").filter_map(|line| line.strip_prefix(':')).map(|n| n.parse().unwrap()).collect()
}

/// What one call took of each of its limiters (`None`: rejected), and the delay of a rejected ACQUIRE.
fn taken(spec: &CallSpec, reply: &[u8]) -> (Vec<Option<u64>>, Option<i64>) {
    let numbers = integers(reply);
    if spec.limiters.len() == 1 {
        return match numbers.as_slice() {
            [n] if *n >= 0 => (vec![Some(spec.permits)], None),
            [n] => (vec![None], Some(-n)),
            _ => (vec![None], None),
        };
    }
    let taken = numbers.chunks(8).map(|l| (l[0] == 1).then(|| u64::try_from(l[7]).unwrap())).collect();
    (taken, None)
}

fn run(client: &mut ScriptClient, spec: &CallSpec, index: usize, now_ms: u64) -> Vec<u8> {
    client.run_raw(&command(spec, index, now_ms, Invocation::BySha), || {
        command(spec, index, now_ms, Invocation::BySource)
    })
}

/// Every window of `INTERVAL_MS` ending at an admission holds at most the rate.
fn fullest_window(admitted: &[(u64, u64)]) -> u64 {
    admitted
        .iter()
        .map(|&(end, _)| admitted.iter().filter(|&&(t, _)| t + INTERVAL_MS > end && t <= end).map(|&(_, p)| p).sum())
        .max()
        .unwrap_or(0)
}

/// The most permits the slices overlapping one window ever held together: at each admission at `t`, the
/// admissions whose slice (`t / width`) overlaps `(t - interval, t]`. Every sliding window lies within
/// the slices that overlap it, so this bounds every window; the script admits against exactly this sum.
fn fullest_slices(admitted: &[(u64, u64)]) -> u64 {
    let width = INTERVAL_MS / COUNTER_SLICES;
    admitted
        .iter()
        .map(|&(end, _)| {
            let (first, current) = ((end - INTERVAL_MS) / width, end / width);
            admitted.iter().filter(|&&(t, _)| t / width >= first && t / width <= current).map(|&(_, p)| p).sum()
        })
        .max()
        .unwrap_or(0)
}

/// The permits a counter's hash holds in the slices that overlap the interval before `now_ms`.
fn counted(server: &RedisServer, hash: &str, now_ms: u64) -> u64 {
    let width = INTERVAL_MS / COUNTER_SLICES;
    let fields: Vec<(u64, u64)> = redis::cmd("HGETALL").arg(hash).query(&mut server.inspector()).unwrap();
    fields.iter().filter(|&&(slice, _)| slice >= (now_ms - INTERVAL_MS) / width).map(|&(_, permits)| permits).sum()
}

fn check(calls: &[CallSpec], cut: usize, alone: &RedisServer, batched: &RedisServer) -> Result<(), TestCaseError> {
    let mut one = alone.script_client();
    let mut now_ms = T0;
    let mut admitted: [Vec<(u64, u64)>; 3] = Default::default();
    let mut commands = Vec::new();
    let mut replies = Vec::new();
    for (index, spec) in calls.iter().enumerate() {
        now_ms += spec.advance_ms;
        let reply = run(&mut one, spec, index, now_ms);
        let (took, delay) = taken(spec, &reply);
        prop_assert!(
            took.iter().all(Option::is_some) || took.iter().all(Option::is_none),
            "all or nothing: {:?}",
            reply
        );
        for (&limiter, took) in spec.limiters.iter().zip(&took) {
            if let Some(permits) = took {
                admitted[limiter].push((now_ms, *permits));
            }
        }
        if let Some(delay) = delay {
            let width = INTERVAL_MS / COUNTER_SLICES;
            // Redisson's delay: until enough slices leave, and 3 ms (the local block ends 3 ms before it).
            prop_assert!(delay >= 4 && delay <= (INTERVAL_MS + width + 3) as i64, "delay {delay}");
        }
        // What Redis holds: the slices overlapping the last interval never hold more than the rate.
        for name in ["{erl:swc:a}:counter", "{erl:swc:b}:counter"] {
            prop_assert!(counted(alone, name, now_ms) <= RATE, "{name}: {} counted", counted(alone, name, now_ms));
        }
        commands.push(command(spec, index, now_ms, Invocation::BySha));
        replies.push(reply);
    }
    for (limiter, admissions) in admitted.iter().enumerate() {
        prop_assert!(
            fullest_window(admissions) <= RATE,
            "{}: {} in a window",
            NAMES[limiter],
            fullest_window(admissions)
        );
        if limiter < 2 {
            prop_assert!(
                fullest_slices(admissions) <= RATE,
                "{}: {} in a window's slices",
                NAMES[limiter],
                fullest_slices(admissions)
            );
        }
    }
    // The same calls in batches of `cut`: the same replies, the same keys.
    let mut other = batched.script_client();
    let mut together = Vec::new();
    for chunk in commands.chunks(cut) {
        let segments: Vec<Segment<'_>> = chunk.iter().map(|c| Segment::of(c, Encoding::Resp).unwrap()).collect();
        let reply = other.run_raw(&encode_batch(&segments, Invocation::BySha, Encoding::Resp), || {
            encode_batch(&segments, Invocation::BySource, Encoding::Resp)
        });
        together.extend(split_batch_reply(&reply, chunk.len()).unwrap());
    }
    let trimmed = |replies: &[Vec<u8>]| -> Vec<Vec<i64>> { replies.iter().map(|r| integers(r)).collect() };
    prop_assert_eq!(trimmed(&replies), trimmed(&together));
    let hash = |server: &RedisServer| -> Vec<(String, String)> {
        let mut fields: Vec<(String, String)> =
            redis::cmd("HGETALL").arg("{erl:swc:a}:counter").query(&mut server.inspector()).unwrap();
        fields.sort();
        fields
    };
    prop_assert_eq!(hash(alone), hash(batched));
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 12, ..ProptestConfig::default() })]

    /// Random calls (one limiter, two counters together, a counter with a sliding log) never put more than
    /// the rate in a sliding window of any limiter, and decide in a batch as alone.
    #[test]
    fn no_sliding_window_holds_more_than_the_rate_alone_or_batched(
        calls in prop::collection::vec(call_strategy(), 50..400),
        cut in 1usize..8,
    ) {
        let alone = RedisServer::start();
        let batched = RedisServer::start();
        check(&calls, cut, &alone, &batched)?;
    }
}

/// Demand far beyond the rate (3 permits every ms for 20 intervals): every whole window after the first
/// admits at least k/(k+1) of the rate, a rejected call's delay admits the next call when it ends, and the
/// limiter's hash stays under 1 KB (`MEMORY USAGE`) and expires an interval and a slice after its last write.
#[test]
fn a_saturated_counter_uses_k_over_k_plus_1_of_its_rate_in_constant_memory() {
    let server = RedisServer::start();
    let mut client = server.script_client();
    let spec = CallSpec { limiters: vec![0], permits: 1, advance_ms: 0 };
    let mut admitted = Vec::new();
    let mut next_allowed_ms = 0;
    for ms in 0..20 * INTERVAL_MS {
        let now_ms = T0 + ms;
        for attempt in 0..3 {
            let reply = run(&mut client, &spec, (ms * 3 + attempt) as usize, now_ms);
            match integers(&reply).as_slice() {
                [n] if *n >= 0 => {
                    assert!(now_ms >= next_allowed_ms || next_allowed_ms == 0, "admitted before its delay ended");
                    admitted.push((now_ms, 1));
                }
                [n] => next_allowed_ms = now_ms + u64::try_from(-n).unwrap() - 3 - 1,
                other => panic!("{other:?}"),
            }
        }
    }
    assert!(fullest_window(&admitted) <= RATE);
    assert!(fullest_slices(&admitted) <= RATE, "{} in a window's slices", fullest_slices(&admitted));
    let floor = RATE * COUNTER_SLICES / (COUNTER_SLICES + 1);
    for window in 1..20 {
        let start = T0 + window * INTERVAL_MS;
        let used: u64 = admitted.iter().filter(|&&(t, _)| t >= start && t < start + INTERVAL_MS).map(|&(_, p)| p).sum();
        assert!(used >= floor, "window {window}: {used} of {RATE} (at least {floor})");
    }
    let mut inspector = server.inspector();
    let bytes: u64 = redis::cmd("MEMORY").arg("USAGE").arg("{erl:swc:a}:counter").query(&mut inspector).unwrap();
    assert!(bytes <= 1024, "{bytes} bytes");
    let fields: u64 = redis::cmd("HLEN").arg("{erl:swc:a}:counter").query(&mut inspector).unwrap();
    assert!(fields <= COUNTER_SLICES + 2, "{fields} slices kept");
    let ttl: i64 = redis::cmd("PTTL").arg("{erl:swc:a}:counter").query(&mut inspector).unwrap();
    assert!(ttl > 0 && ttl <= (INTERVAL_MS + INTERVAL_MS / COUNTER_SLICES) as i64, "ttl {ttl}");
    let keys: Vec<String> = redis::cmd("KEYS").arg("*").query(&mut inspector).unwrap();
    assert_eq!(keys, ["{erl:swc:a}:counter"], "one key per limiter, nothing else");
}

/// A rule that changes its layout on the same limiter name: the sliding log's keys and the counter's hash
/// (`{name}:counter`) stand apart, so neither meets the other's key (WRONGTYPE) and each decides from its own.
#[test]
fn a_limiter_that_changes_layout_meets_none_of_the_other_layouts_keys() {
    let server = RedisServer::start();
    let mut client = server.script_client();
    let random = [7; MEMBER_RANDOM_LEN];
    let run_with = |client: &mut ScriptClient, layout: WindowLayout, now_ms: u64| -> Vec<i64> {
        let template = template(1, layout);
        let command =
            |invocation| template.encode(NAMES[0], Clock::Gateway(now_ms), &random, None, invocation, Encoding::Resp);
        integers(&client.run_raw(&command(Invocation::BySha), || command(Invocation::BySource)))
    };
    let created = run_with(&mut client, WindowLayout::SlidingLog, T0);
    assert_eq!(created[..3], [1, RATE as i64 - 1, RATE as i64 - 1], "created by the log: {created:?}");
    assert_eq!(run_with(&mut client, WindowLayout::SlidingWindowCounter, T0 + 1), [RATE as i64 - 1], "a fresh counter");
    assert_eq!(run_with(&mut client, WindowLayout::SlidingLog, T0 + 2), [RATE as i64 - 2], "the log kept its own");
    let mut keys: Vec<String> = redis::cmd("KEYS").arg("*").query(&mut server.inspector()).unwrap();
    keys.sort();
    assert_eq!(keys, ["erl:swc:a", "{erl:swc:a}:counter", "{erl:swc:a}:permits", "{erl:swc:a}:value"]);
}

/// Reserve, then settle (a rule with `cost`): the reservation is permits in the slice of its acquire time,
/// and GIVE_BACK with type `2` moves that slice by used - granted: unused permits go back, an excess is
/// charged, never below zero; a slice that left the window (deleted) settles nothing.
#[test]
fn a_reservation_settles_into_the_slice_it_was_made_in() {
    use edge_rate_limiter::script::{MemberAt, Settlement};
    let server = RedisServer::start();
    let mut client = server.script_client();
    let width = INTERVAL_MS / COUNTER_SLICES;
    let acquire = |client: &mut ScriptClient, permits: u64, now_ms: u64| -> Vec<i64> {
        let template = template(permits, WindowLayout::SlidingWindowCounter);
        let random = [1; MEMBER_RANDOM_LEN];
        let command =
            |invocation| template.encode(NAMES[0], Clock::Gateway(now_ms), &random, None, invocation, Encoding::Resp);
        integers(&client.run_raw(&command(Invocation::BySha), || command(Invocation::BySource)))
    };
    let settle = |client: &mut ScriptClient, granted: u64, used: u64, at_ms: u64| -> Vec<i64> {
        let at =
            MemberAt { score_ms: at_ms, rate: RATE, limiter_type: LimiterType::Overall, counter_slice_ms: Some(width) };
        let settlement =
            Settlement { random: [1; MEMBER_RANDOM_LEN], granted, used, early_ms: 0, renamed: None, at: Some(at) };
        let template = template(1, WindowLayout::SlidingWindowCounter);
        let command = |invocation| settlement.encode(NAMES[0], &template, invocation, Encoding::Resp);
        integers(&client.run_raw(&command(Invocation::BySha), || command(Invocation::BySource)))
    };
    let slice = |at_ms: u64| -> Option<u64> {
        redis::cmd("HGET")
            .arg("{erl:swc:a}:counter")
            .arg((at_ms / width).to_string())
            .query(&mut server.inspector())
            .unwrap()
    };
    assert_eq!(acquire(&mut client, 30, T0), [10], "30 reserved of 40");
    assert_eq!(acquire(&mut client, 20, T0 + 1), [-(INTERVAL_MS as i64 + width as i64 - 1 + 3)], "not 20 more");
    assert_eq!(settle(&mut client, 30, 12, T0), [1]);
    assert_eq!(slice(T0), Some(12), "18 unused permits back");
    assert_eq!(acquire(&mut client, 20, T0 + 2 * width), [8], "they admit the next request");
    assert_eq!(settle(&mut client, 20, 25, T0 + 2 * width), [1]);
    assert_eq!(slice(T0 + 2 * width), Some(25), "an excess is charged in its own slice");
    assert_eq!(settle(&mut client, 12, 0, T0), [1]);
    assert_eq!(slice(T0), Some(0), "used 0: everything back");
    assert_eq!(settle(&mut client, 5, 0, T0 + 5 * width), [0], "no such slice: nothing to settle");
    assert_eq!(slice(T0 + 5 * width), None, "and none made");
}

/// A calendar quota (type `3`): one field per period (its start) in `{name}:counter`, expiring at the
/// period's end (and 1 s more); a request that does not fit waits until the period ends; the next period
/// starts from zero; in ACQUIRE_ALL beside a sliding window counter, all or nothing; a reservation settles
/// into its period's field. On Redis's real clock: the key expires at an absolute time.
#[test]
fn a_calendar_quota_counts_each_period_apart_and_expires_at_its_end() {
    use edge_rate_limiter::calendar::{Period, Zone};
    use edge_rate_limiter::script::{MemberAt, Settlement};
    let server = RedisServer::start();
    let mut client = server.script_client();
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as u64;
    let zone = Zone::named("Europe/Berlin").unwrap();
    let layout = WindowLayout::Calendar { period: Period::Day, zone };
    let (start, end) = zone.period(Period::Day, now);
    let config = |permits| AcquireConfig {
        permits,
        rate: 5,
        interval_ms: Period::Day.nominal_ms(),
        limiter_type: LimiterType::Overall,
        keep_alive_ms: 0,
        apply_config: false,
        layout,
    };
    let random = [3; MEMBER_RANDOM_LEN];
    let acquire = |client: &mut ScriptClient, permits: u64, at: u64, (start, end): (u64, u64)| -> Vec<i64> {
        let template = AcquireTemplate::in_period(config(permits), CLIENT, start, end);
        let command =
            |invocation| template.encode(NAMES[0], Clock::Gateway(at), &random, None, invocation, Encoding::Resp);
        integers(&client.run_raw(&command(Invocation::BySha), || command(Invocation::BySource)))
    };
    assert_eq!(acquire(&mut client, 2, now, (start, end)), [3]);
    assert_eq!(acquire(&mut client, 2, now, (start, end)), [1]);
    assert_eq!(acquire(&mut client, 2, now, (start, end)), [-((end - now + 3) as i64)], "until the day ends");
    let mut inspector = server.inspector();
    let field: u64 =
        redis::cmd("HGET").arg("{erl:swc:a}:counter").arg(start.to_string()).query(&mut inspector).unwrap();
    assert_eq!(field, 4);
    let expires: i64 = redis::cmd("PEXPIRETIME").arg("{erl:swc:a}:counter").query(&mut inspector).unwrap();
    assert_eq!(expires, (end + 1000) as i64, "at the period's end, and 1 s more");
    // The next day counts from zero (its own field).
    let next = zone.period(Period::Day, end);
    assert_eq!(acquire(&mut client, 2, end, next), [3]);
    // Settled: a reservation of 2 in today's field that cost 1.
    let at = MemberAt { score_ms: start, rate: 5, limiter_type: LimiterType::Overall, counter_slice_ms: Some(1) };
    let settlement = Settlement { random, granted: 2, used: 1, early_ms: 0, renamed: None, at: Some(at) };
    let quota = AcquireTemplate::in_period(config(1), CLIENT, start, end);
    let command = |invocation| settlement.encode(NAMES[0], &quota, invocation, Encoding::Resp);
    assert_eq!(integers(&client.run_raw(&command(Invocation::BySha), || command(Invocation::BySource))), [1]);
    let field: u64 =
        redis::cmd("HGET").arg("{erl:swc:a}:counter").arg(start.to_string()).query(&mut inspector).unwrap();
    assert_eq!(field, 3, "one permit back");
    // All or nothing beside a sliding window counter: the quota's 2 left admit 2, not 3.
    let counter = template(3, WindowLayout::SlidingWindowCounter);
    let calendar = AcquireTemplate::in_period(config(3), CLIENT, start, end);
    let parts = [
        AcquirePart { template: &counter, name: NAMES[1], random: &random, lease: None },
        AcquirePart { template: &calendar, name: NAMES[0], random: &random, lease: None },
    ];
    let command = |invocation| encode_acquire_all(&parts, Clock::Gateway(now), false, invocation, Encoding::Resp);
    let reply = integers(&client.run_raw(&command(Invocation::BySha), || command(Invocation::BySource)));
    assert_eq!((reply[0], reply[8]), (3, 0), "the counter admitted, the quota rejected: nothing taken {reply:?}");
    let counted: Option<u64> = redis::cmd("HLEN").arg("{erl:swc:b}:counter").query(&mut inspector).unwrap();
    assert_eq!(counted, Some(0), "the counter took nothing");
}
