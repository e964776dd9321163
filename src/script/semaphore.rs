//! In-flight permits (issue 31's `concurrency` rules, not yet wired to a rule): a semaphore shared with
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

use super::acquire::Encoding;
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

/// One permit taken for a request ([`SEMAPHORE_ACQUIRE`]): `ARGV` the semaphore's permits (set if it does
/// not exist yet, as Redisson's `trySetPermits`), the lease's end and now (ms since the epoch), the permit's
/// id, the publish command. Permits whose lease ended are reclaimed first. Reply: [`SemaphoreOutcome`].
#[derive(Debug, Clone, Copy)]
pub struct SemaphoreAcquire<'a> {
    /// The semaphore's name.
    pub name: &'a str,
    /// Its size: the permits it is created with when it does not exist.
    pub permits: u64,
    /// When the permit's lease ends, ms since the epoch (now + the rule's `lease`).
    pub lease_end_ms: u64,
    /// Now, ms since the epoch, by the gateway's clock (leases that ended by then are reclaimed).
    pub now_ms: u64,
    /// The permit's id.
    pub id: &'a [u8; PERMIT_ID_LEN],
    /// How freed permits are announced.
    pub publish: Publish,
}

impl SemaphoreAcquire<'_> {
    /// The command, by sha or by source, in the transport's wire form.
    pub fn encode(&self, invocation: Invocation, encoding: Encoding) -> Vec<u8> {
        let mut out = Vec::with_capacity(256);
        let mut writer = script_call(&mut out, encoding, &SEMAPHORE_ACQUIRE, invocation, self.name, 5);
        writer.arg(itoa::Buffer::new().format(self.permits).as_bytes());
        writer.arg(itoa::Buffer::new().format(self.lease_end_ms).as_bytes());
        writer.arg(itoa::Buffer::new().format(self.now_ms).as_bytes());
        writer.arg(self.id);
        writer.arg(self.publish.command());
        writer.finish();
        out
    }
}

/// The [`SEMAPHORE_RELEASE`] of permits `ids` of semaphore `name`: each still held is removed and counted
/// back to the free permits, the new count published; one reclaimed already (its lease ended) or released
/// changes nothing. Reply: the permits given back.
pub fn encode_semaphore_release(
    name: &str,
    ids: &[[u8; PERMIT_ID_LEN]],
    publish: Publish,
    invocation: Invocation,
    encoding: Encoding,
) -> Vec<u8> {
    let mut out = Vec::with_capacity(128 + ids.len() * 3 * PERMIT_ID_LEN);
    let mut writer = script_call(&mut out, encoding, &SEMAPHORE_RELEASE, invocation, name, 1 + ids.len());
    writer.arg(publish.command());
    for id in ids {
        writer.arg(id);
    }
    writer.finish();
    out
}

/// The [`SEMAPHORE_EXTEND`] of permits `ids` of semaphore `name`: permits whose lease ended by `now_ms` are
/// reclaimed first (so a lease that ended is not revived, as Redisson's `updateLeaseTime`), then each of
/// `ids` still held gets `lease_end_ms` (ms since the epoch). Reply: the permits whose lease moved.
pub fn encode_semaphore_extend(
    name: &str,
    lease_end_ms: u64,
    now_ms: u64,
    ids: &[[u8; PERMIT_ID_LEN]],
    publish: Publish,
    invocation: Invocation,
    encoding: Encoding,
) -> Vec<u8> {
    let mut out = Vec::with_capacity(160 + ids.len() * 3 * PERMIT_ID_LEN);
    let mut writer = script_call(&mut out, encoding, &SEMAPHORE_EXTEND, invocation, name, 3 + ids.len());
    writer.arg(itoa::Buffer::new().format(lease_end_ms).as_bytes());
    writer.arg(itoa::Buffer::new().format(now_ms).as_bytes());
    writer.arg(publish.command());
    for id in ids {
        writer.arg(id);
    }
    writer.finish();
    out
}

/// `EVALSHA <sha> 3` (or `EVAL <source> 3`) and semaphore `name`'s keys, for a call of `args` arguments.
fn script_call<'a>(
    out: &'a mut Vec<u8>,
    encoding: Encoding,
    script: &Script,
    invocation: Invocation,
    name: &str,
    args: usize,
) -> ArgWriter<'a> {
    let keys = SemaphoreKeys::of(name);
    let mut writer = ArgWriter::new(out, encoding, 3 + 3 + args);
    writer.invoke(script, invocation);
    writer.arg(b"3");
    writer.arg(keys.free.as_bytes());
    writer.arg(keys.taken.as_bytes());
    writer.arg(keys.channel.as_bytes());
    writer
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

/// Decodes [`SEMAPHORE_ACQUIRE`]'s reply (`{1, free}` or `{0, free, earliest end or -1}`; webdis's bulk
/// strings of digits read as integers).
///
/// # Errors
/// [`ReplyError::NoScript`] when Redis lacks the script, [`ReplyError::Redis`] for another error reply,
/// [`ReplyError::Unexpected`] for a reply of another shape.
pub fn decode_semaphore_acquire_reply(bytes: &[u8]) -> Result<SemaphoreOutcome, ReplyError> {
    let mut numbers = [0i64; 3];
    match decode_integers(bytes, &mut numbers) {
        Some(Integers::Array(2)) if numbers[0] == 1 => Ok(SemaphoreOutcome::Taken { free: numbers[1] }),
        Some(Integers::Array(3)) if numbers[0] == 0 => {
            Ok(SemaphoreOutcome::Refused { free: numbers[1], earliest_end_ms: u64::try_from(numbers[2]).ok() })
        }
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
        let acquire = SemaphoreAcquire {
            name: "s",
            permits: 8,
            lease_end_ms: 1_700_000_030_000,
            now_ms: 1_700_000_000_000,
            id: &ID,
            publish: Publish::Plain,
        };
        let expected: Vec<&[u8]> = vec![
            b"EVALSHA",
            SEMAPHORE_ACQUIRE.sha().as_bytes(),
            b"3",
            b"s",
            b"{s}:timeout",
            b"redisson_sc:{s}",
            b"8",
            b"1700000030000",
            b"1700000000000",
            &ID,
            b"publish",
        ];
        assert_eq!(words(&acquire.encode(Invocation::BySha, Encoding::Resp)), expected);
        let release = encode_semaphore_release("s", &[ID, ID], Publish::Sharded, Invocation::BySha, Encoding::Resp);
        assert_eq!(words(&release)[2..], [&b"3"[..], b"s", b"{s}:timeout", b"redisson_sc:{s}", b"spublish", &ID, &ID]);
        let extend = encode_semaphore_extend("s", 9, 5, &[ID], Publish::Plain, Invocation::BySource, Encoding::Resp);
        let extend = words(&extend);
        assert_eq!(extend[0], b"EVAL");
        assert_eq!(extend[1], SEMAPHORE_EXTEND.source.as_bytes());
        assert_eq!(extend[6..], [&b"9"[..], b"5", b"publish", &ID]);
        // The bridge's path form: the same words, percent-encoded, `/` between them.
        let path = acquire.encode(Invocation::BySha, Encoding::WebdisPath);
        assert!(path.starts_with(format!("EVALSHA/{}/3/s/%7Bs%7D%3Atimeout/", SEMAPHORE_ACQUIRE.sha()).as_bytes()));
        assert!(path.ends_with(b"/publish.raw"));
    }

    #[test]
    fn replies_decode_to_taken_or_refused() {
        assert_eq!(decode_semaphore_acquire_reply(b"*2\r\n:1\r\n:7\r\n"), Ok(SemaphoreOutcome::Taken { free: 7 }));
        assert_eq!(
            decode_semaphore_acquire_reply(b"*3\r\n:0\r\n:0\r\n:1700000030000\r\n"),
            Ok(SemaphoreOutcome::Refused { free: 0, earliest_end_ms: Some(1_700_000_030_000) })
        );
        assert_eq!(
            decode_semaphore_acquire_reply(b"*3\r\n$1\r\n0\r\n$2\r\n-2\r\n$2\r\n-1\r\n"),
            Ok(SemaphoreOutcome::Refused { free: -2, earliest_end_ms: None }),
            "webdis's bulk strings"
        );
        assert_eq!(decode_semaphore_acquire_reply(b"-NOSCRIPT No matching script\r\n"), Err(ReplyError::NoScript));
        assert!(matches!(decode_semaphore_acquire_reply(b":1\r\n"), Err(ReplyError::Unexpected(_))));
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
