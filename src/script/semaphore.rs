//! In-flight permits (rules with `max_in_flight`, docs/configuration.md, "In-flight limits"): semaphores shared with
//! Redisson's `RPermitExpirableSemaphore`, in its layout (Redisson 4.7.0 and 3.52.0
//! `RedissonPermitExpirableSemaphore`, which keep the same keys and scripts; docs/redisson.md,
//! "Semaphores"):
//!
//! - the semaphore's name holds the permits free (a decimal string; no key: a semaphore of 0 permits to
//!   Redisson, created with the configured permits by [`SEMAPHORE_ACQUIRE`]);
//! - `{name}:timeout` holds the permits taken: a sorted set, one member per permit (its id, 16 random
//!   bytes, raw), scored by the end of its lease in ms since the epoch (Redisson's `922337203685477` for a
//!   permit without a lease: Java's `tryAcquire()` without a lease time);
//! - `redisson_sc:{name}` is the channel where Redisson's waiters learn of permits freed (the new count).
//!
//! Free permits plus members is the semaphore's size, whoever takes and gives back. A permit whose lease
//! ended is reclaimed lazily, by the next acquire or extension (as Redisson's own scripts do): a gateway
//! that dies frees its permits within one lease. Every time is the caller's clock, as Redisson's client
//! passes `System.currentTimeMillis()`.

use crate::prelude::*;

use crate::resp::{decode_integers, decode_reply, Integers, Reply};

use core::ops::Range;

use super::acquire::Encoding;
use super::batch::{Layout, SegmentScript};
use super::reply::ReplyError;
use super::wire::ArgWriter;
use super::{Invocation, Script};

/// Bytes of a permit's id: Redisson's `generateIdArray(16)`, shown by Java as 32 hex digits, stored raw.
pub const PERMIT_ID_LEN: usize = 16;

/// The score of a permit without a lease, as Redisson writes it (`Long.MAX_VALUE / 10000`, in ms).
pub const NO_LEASE_SCORE: u64 = 922_337_203_685_477;

/// Takes one permit for a request, with a lease (`lua/semaphore_acquire.lua`): see [`SemaphoreAcquire`].
pub static SEMAPHORE_ACQUIRE: Script =
    Script::new("semaphoreAcquire", super::SEMAPHORE_ACQUIRE_SOURCE, super::SEMAPHORE_ACQUIRE_SHA);

/// Gives back permits of ended requests (`lua/semaphore_release.lua`): see [`encode_semaphore_release`].
pub static SEMAPHORE_RELEASE: Script =
    Script::new("semaphoreRelease", super::SEMAPHORE_RELEASE_SOURCE, super::SEMAPHORE_RELEASE_SHA);

/// Moves the lease's end of permits still in use (`lua/semaphore_extend.lua`): see
/// [`encode_semaphore_extend`].
pub static SEMAPHORE_EXTEND: Script =
    Script::new("semaphoreExtend", super::SEMAPHORE_EXTEND_SOURCE, super::SEMAPHORE_EXTEND_SHA);

/// The three keys of semaphore `name`, named as Redisson names them (`RedissonObject.suffixName` and
/// `prefixName`: a name with a `{` anywhere is taken as it is, otherwise it becomes the hash tag), all in
/// the hash slot of the name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SemaphoreKeys {
    /// The permits free: the name itself.
    pub free: String,
    /// The permits taken, scored by the end of their lease: `{name}:timeout`.
    pub taken: String,
    /// Where Redisson's waiters listen: `redisson_sc:{name}`.
    pub channel: String,
}

impl SemaphoreKeys {
    /// The keys of semaphore `name`.
    pub fn of(name: &str) -> Self {
        let tagged = if name.contains('{') { name.to_string() } else { format!("{{{name}}}") };
        SemaphoreKeys {
            free: name.to_string(),
            taken: format!("{tagged}:timeout"),
            channel: format!("redisson_sc:{tagged}"),
        }
    }
}

/// How freed permits are announced to Redisson's waiters: `PUBLISH`, or `SPUBLISH` where Redisson listens on
/// sharded channels (a Redis Cluster of 7.0 or later, Redisson's `ShardedSubscriptionMode.AUTO`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Publish {
    /// `PUBLISH`.
    Plain,
    /// `SPUBLISH`.
    Sharded,
}

impl Publish {
    fn command(self) -> &'static [u8] {
        match self {
            Publish::Plain => b"publish",
            Publish::Sharded => b"spublish",
        }
    }
}

/// One permit to take for a request, in a [`SEMAPHORE_ACQUIRE`] call ([`encode_semaphore_acquires`]).
#[derive(Debug, Clone, Copy)]
pub struct SemaphoreAcquire<'a> {
    /// The semaphore's name.
    pub name: &'a str,
    /// Its size: the permits it is created with when it does not exist (Redisson's `trySetPermits`).
    pub permits: u64,
    /// When the permit's lease ends, ms since the epoch (now + the rule's `lease`).
    pub lease_end_ms: u64,
    /// The permit's id.
    pub id: &'a [u8; PERMIT_ID_LEN],
}

/// The [`SEMAPHORE_ACQUIRE`] of `permits` (one per request; several coalesced in one call), at `now_ms` (ms
/// since the epoch, the gateway's clock: leases that ended by then are reclaimed). Each is taken as if
/// alone, in order. Reply: [`decode_semaphore_acquire_replies`].
pub fn encode_semaphore_acquires(
    permits: &[SemaphoreAcquire<'_>],
    now_ms: u64,
    publish: Publish,
    invocation: Invocation,
    encoding: Encoding,
) -> Vec<u8> {
    encode_semaphore_acquires_laid_out(permits, now_ms, publish, invocation, encoding).0
}

/// [`encode_semaphore_acquires`], and where its keys and arguments are ([`Layout`]: the call of one permit
/// is a segment of an [`super::ACQUIRE_BATCH`], coalesced with rate acquires).
pub fn encode_semaphore_acquires_laid_out(
    permits: &[SemaphoreAcquire<'_>],
    now_ms: u64,
    publish: Publish,
    invocation: Invocation,
    encoding: Encoding,
) -> (Vec<u8>, Layout) {
    let mut out = Vec::with_capacity(128 + permits.len() * 160);
    let mut writer = ArgWriter::new(&mut out, encoding, 3 + permits.len() * 6 + 2);
    let keys = push_head(&mut writer, &SEMAPHORE_ACQUIRE, invocation, permits.iter().map(|permit| permit.name));
    writer.arg(itoa::Buffer::new().format(now_ms).as_bytes());
    writer.arg(publish.command());
    for permit in permits {
        writer.arg(itoa::Buffer::new().format(permit.permits).as_bytes());
        writer.arg(itoa::Buffer::new().format(permit.lease_end_ms).as_bytes());
        writer.arg(permit.id);
    }
    writer.finish();
    let (key_count, arg_count) = (3 * permits.len(), 2 + 3 * permits.len());
    (out, Layout { script: SegmentScript::SemaphoreAcquire, keys, key_count, arg_count })
}

/// Permits of one semaphore, for [`encode_semaphore_release`] and [`encode_semaphore_extend`].
#[derive(Debug, Clone, Copy)]
pub struct SemaphorePermits<'a> {
    /// The semaphore's name.
    pub name: &'a str,
    /// Its permits' ids.
    pub ids: &'a [[u8; PERMIT_ID_LEN]],
    /// The leases' new end, ms since the epoch ([`encode_semaphore_extend`]; unused by a release).
    pub lease_end_ms: u64,
}

/// The [`SEMAPHORE_RELEASE`] of the permits of `semaphores` (every semaphore of one destination in one call):
/// each still held is removed and counted back to its semaphore's free permits, the new count published; one
/// reclaimed already (its lease ended) or released changes nothing. Reply: the permits given back.
pub fn encode_semaphore_release(
    semaphores: &[SemaphorePermits<'_>],
    publish: Publish,
    invocation: Invocation,
    encoding: Encoding,
) -> Vec<u8> {
    encode_semaphore_release_laid_out(semaphores, publish, invocation, encoding).0
}

/// [`encode_semaphore_release`], and where its keys and arguments are: a segment of an
/// [`super::ACQUIRE_BATCH`] (permits given back, riding with the acquires of their destination).
pub fn encode_semaphore_release_laid_out(
    semaphores: &[SemaphorePermits<'_>],
    publish: Publish,
    invocation: Invocation,
    encoding: Encoding,
) -> (Vec<u8>, Layout) {
    let ids: usize = semaphores.iter().map(|s| s.ids.len()).sum();
    let mut out = Vec::with_capacity(128 + semaphores.len() * 96 + ids * 3 * PERMIT_ID_LEN);
    let mut writer = ArgWriter::new(&mut out, encoding, 3 + semaphores.len() * 4 + 1 + ids);
    let keys =
        push_head(&mut writer, &SEMAPHORE_RELEASE, invocation, semaphores.iter().map(|semaphore| semaphore.name));
    writer.arg(publish.command());
    for semaphore in semaphores {
        writer.arg(itoa::Buffer::new().format(semaphore.ids.len()).as_bytes());
        for id in semaphore.ids {
            writer.arg(id);
        }
    }
    writer.finish();
    let (key_count, arg_count) = (3 * semaphores.len(), 1 + semaphores.len() + ids);
    (out, Layout { script: SegmentScript::SemaphoreRelease, keys, key_count, arg_count })
}

/// The [`SEMAPHORE_EXTEND`] of the permits of `semaphores` (every semaphore of one destination in one call):
/// permits whose lease ended by `now_ms` are reclaimed first (so a lease that ended is not revived, as
/// Redisson's `updateLeaseTime`), then each permit still held gets its semaphore's `lease_end_ms` (ms since
/// the epoch). Reply: the permits whose lease moved.
pub fn encode_semaphore_extend(
    semaphores: &[SemaphorePermits<'_>],
    now_ms: u64,
    publish: Publish,
    invocation: Invocation,
    encoding: Encoding,
) -> Vec<u8> {
    let ids: usize = semaphores.iter().map(|s| s.ids.len()).sum();
    let mut out = Vec::with_capacity(160 + semaphores.len() * 112 + ids * 3 * PERMIT_ID_LEN);
    let mut writer = ArgWriter::new(&mut out, encoding, 3 + semaphores.len() * 5 + 2 + ids);
    push_head(&mut writer, &SEMAPHORE_EXTEND, invocation, semaphores.iter().map(|semaphore| semaphore.name));
    writer.arg(itoa::Buffer::new().format(now_ms).as_bytes());
    writer.arg(publish.command());
    for semaphore in semaphores {
        writer.arg(itoa::Buffer::new().format(semaphore.lease_end_ms).as_bytes());
        writer.arg(itoa::Buffer::new().format(semaphore.ids.len()).as_bytes());
        for id in semaphore.ids {
            writer.arg(id);
        }
    }
    writer.finish();
    out
}

/// The head every semaphore call shares: `script`'s invocation, the number of keys, and the three keys
/// ([`SemaphoreKeys`]) of each semaphore of `names`, each an argument. Returns where the keys are.
fn push_head<'n>(
    writer: &mut ArgWriter<'_>,
    script: &Script,
    invocation: Invocation,
    names: impl ExactSizeIterator<Item = &'n str>,
) -> Range<usize> {
    writer.invoke(script, invocation);
    writer.arg(itoa::Buffer::new().format(names.len() * 3).as_bytes());
    let start = writer.position();
    for name in names {
        let keys = SemaphoreKeys::of(name);
        writer.arg(keys.free.as_bytes());
        writer.arg(keys.taken.as_bytes());
        writer.arg(keys.channel.as_bytes());
    }
    start..writer.position()
}

/// What [`SEMAPHORE_ACQUIRE`] answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SemaphoreOutcome {
    /// The permit is taken; `free` permits are left (below zero after Redisson's `addPermits` of a
    /// negative number).
    Taken {
        /// Permits free after this one.
        free: i64,
    },
    /// No permit was free.
    Refused {
        /// Permits free (0, or below zero).
        free: i64,
        /// When the earliest lease ends, ms since the epoch (`None`: no permit held has a lease).
        earliest_end_ms: Option<u64>,
    },
}

/// Most permits in one [`SEMAPHORE_ACQUIRE`] call (a batch's requests).
pub const MAX_SEMAPHORE_ACQUIRES: usize = 64;

/// Decodes [`SEMAPHORE_ACQUIRE`]'s reply for `count` permits (three elements each: `1, free, -1` or
/// `0, free, earliest end or -1`; webdis's bulk strings of digits read as integers), in order.
///
/// # Errors
/// [`ReplyError::NoScript`] when Redis lacks the script, [`ReplyError::Redis`] for another error reply,
/// [`ReplyError::Unexpected`] for a reply of another shape.
pub fn decode_semaphore_acquire_replies(bytes: &[u8], count: usize) -> Result<Vec<SemaphoreOutcome>, ReplyError> {
    let mut numbers = [0i64; 3 * MAX_SEMAPHORE_ACQUIRES];
    let wanted = count.saturating_mul(3).min(numbers.len());
    match decode_integers(bytes, numbers.get_mut(..wanted).unwrap_or_default()) {
        Some(Integers::Array(found)) if found == wanted && count <= MAX_SEMAPHORE_ACQUIRES => Ok(numbers
            .chunks_exact(3)
            .take(count)
            .map(|item| match *item {
                [1, free, _] => SemaphoreOutcome::Taken { free },
                [_, free, earliest] => {
                    SemaphoreOutcome::Refused { free, earliest_end_ms: u64::try_from(earliest).ok() }
                }
                _ => SemaphoreOutcome::Refused { free: 0, earliest_end_ms: None },
            })
            .collect()),
        Some(_) => Err(ReplyError::Unexpected("a semaphore reply of another shape".into())),
        None => match decode_reply(bytes) {
            Ok(Reply::Error(text)) if text.starts_with("NOSCRIPT") => Err(ReplyError::NoScript),
            Ok(Reply::Error(text)) => Err(ReplyError::Redis(text)),
            _ => Err(ReplyError::Unexpected("not an array of integers".into())),
        },
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing, clippy::panic)]
    use super::*;

    const ID: [u8; PERMIT_ID_LEN] = *b"0123456789abcdef";

    /// The words of a RESP command.
    fn words(command: &[u8]) -> Vec<Vec<u8>> {
        match decode_reply(command) {
            Ok(Reply::Array(items)) => items
                .into_iter()
                .map(|item| match item {
                    Reply::Bulk(bytes) => bytes,
                    other => panic!("not a bulk string: {other:?}"),
                })
                .collect(),
            other => panic!("not a command: {other:?}"),
        }
    }

    #[test]
    fn keys_are_named_as_redisson_names_them() {
        assert_eq!(
            SemaphoreKeys::of("erl:inflight:alice"),
            SemaphoreKeys {
                free: "erl:inflight:alice".into(),
                taken: "{erl:inflight:alice}:timeout".into(),
                channel: "redisson_sc:{erl:inflight:alice}".into(),
            }
        );
        let tagged = SemaphoreKeys::of("a{b}c");
        assert_eq!((tagged.taken.as_str(), tagged.channel.as_str()), ("a{b}c:timeout", "redisson_sc:a{b}c"));
    }

    #[test]
    fn the_commands_carry_the_keys_and_arguments_in_order() {
        let permits = [
            SemaphoreAcquire { name: "s", permits: 8, lease_end_ms: 1_700_000_030_000, id: &ID },
            SemaphoreAcquire { name: "t", permits: 2, lease_end_ms: 1_700_000_040_000, id: &ID },
        ];
        let acquire =
            encode_semaphore_acquires(&permits, 1_700_000_000_000, Publish::Plain, Invocation::BySha, Encoding::Resp);
        let expected: Vec<&[u8]> = vec![
            b"EVALSHA",
            SEMAPHORE_ACQUIRE.sha().as_bytes(),
            b"6",
            b"s",
            b"{s}:timeout",
            b"redisson_sc:{s}",
            b"t",
            b"{t}:timeout",
            b"redisson_sc:{t}",
            b"1700000000000",
            b"publish",
            b"8",
            b"1700000030000",
            &ID,
            b"2",
            b"1700000040000",
            &ID,
        ];
        assert_eq!(words(&acquire), expected);
        let semaphores = [
            SemaphorePermits { name: "s", ids: &[ID, ID], lease_end_ms: 9 },
            SemaphorePermits { name: "t", ids: &[ID], lease_end_ms: 7 },
        ];
        let release = encode_semaphore_release(&semaphores, Publish::Sharded, Invocation::BySha, Encoding::Resp);
        assert_eq!(words(&release)[2], b"6");
        assert_eq!(words(&release)[9..], [&b"spublish"[..], b"2", &ID, &ID, b"1", &ID]);
        let extend = encode_semaphore_extend(&semaphores, 5, Publish::Plain, Invocation::BySource, Encoding::Resp);
        let extend = words(&extend);
        assert_eq!(extend[0], b"EVAL");
        assert_eq!(extend[1], SEMAPHORE_EXTEND.source.as_bytes());
        assert_eq!(extend[9..], [&b"5"[..], b"publish", b"9", b"2", &ID, &ID, b"7", b"1", &ID]);
        // The bridge's path form: the same words, percent-encoded, `/` between them.
        let path = encode_semaphore_acquires(&permits[..1], 1, Publish::Plain, Invocation::BySha, Encoding::WebdisPath);
        assert!(path.starts_with(format!("EVALSHA/{}/3/s/%7Bs%7D%3Atimeout/", SEMAPHORE_ACQUIRE.sha()).as_bytes()));
        assert!(path.ends_with(b".raw"));
    }

    #[test]
    fn replies_decode_to_taken_or_refused_in_order() {
        assert_eq!(
            decode_semaphore_acquire_replies(b"*3\r\n:1\r\n:7\r\n:-1\r\n", 1),
            Ok(vec![SemaphoreOutcome::Taken { free: 7 }])
        );
        assert_eq!(
            decode_semaphore_acquire_replies(b"*6\r\n:1\r\n:0\r\n:-1\r\n:0\r\n:0\r\n$13\r\n1700000030000\r\n", 2),
            Ok(vec![
                SemaphoreOutcome::Taken { free: 0 },
                SemaphoreOutcome::Refused { free: 0, earliest_end_ms: Some(1_700_000_030_000) }
            ])
        );
        assert_eq!(
            decode_semaphore_acquire_replies(b"*3\r\n$1\r\n0\r\n$2\r\n-2\r\n$2\r\n-1\r\n", 1),
            Ok(vec![SemaphoreOutcome::Refused { free: -2, earliest_end_ms: None }]),
            "webdis's bulk strings"
        );
        assert_eq!(decode_semaphore_acquire_replies(b"-NOSCRIPT No matching script\r\n", 1), Err(ReplyError::NoScript));
        assert!(matches!(decode_semaphore_acquire_replies(b":1\r\n", 1), Err(ReplyError::Unexpected(_))));
        assert!(
            matches!(decode_semaphore_acquire_replies(b"*3\r\n:1\r\n:7\r\n:-1\r\n", 2), Err(ReplyError::Unexpected(_))),
            "fewer permits than asked"
        );
    }

    #[test]
    fn the_scripts_carry_no_prelude_and_no_comments() {
        for script in [&SEMAPHORE_ACQUIRE, &SEMAPHORE_RELEASE, &SEMAPHORE_EXTEND] {
            assert!(!script.source.contains("local function"), "{}", script.name);
            assert!(script.source.starts_with(&format!("-- edge-rate-limiter {}\n", script.name)));
            assert_eq!(script.source.lines().filter(|l| l.starts_with("--")).count(), 1);
        }
    }
}
