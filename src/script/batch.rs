//! Request coalescing on the wire: several acquire calls, each encoded as it would be sent alone, carried
//! by one [`super::ACQUIRE_BATCH`] call ([`encode_batch`]), and its reply split back into the reply each
//! call would have had alone ([`split_batch_reply`]), so every request reads its own reply with the
//! decoders it always used.

use core::ops::Range;

use crate::prelude::*;

use crate::resp::array_elements;

use super::acquire::{AcquireTemplate, Encoding};
use super::settlement::Settlement;
use super::wire::{push_arg, push_arg_parts, push_keys, push_length};
use super::{Invocation, ACQUIRE, ACQUIRE_ALL, ACQUIRE_BATCH, GIVE_BACK, SEMAPHORE_ACQUIRE, SEMAPHORE_RELEASE};

/// Which script a batched call runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SegmentScript {
    /// [`super::ACQUIRE`], `1` in the batch's arguments.
    Acquire,
    /// [`super::ACQUIRE_ALL`], `2`.
    AcquireAll,
    /// [`super::GIVE_BACK`], `3` (the settle calls of one tick, batched).
    GiveBack,
    /// [`super::SEMAPHORE_ACQUIRE`] of one permit, `4` (an in-flight permit, coalesced with the acquires).
    SemaphoreAcquire,
    /// [`super::SEMAPHORE_RELEASE`], `8` (permits given back, riding with the acquires of their destination).
    SemaphoreRelease,
}

/// Where an acquire command's keys and arguments are, as its encoder wrote them
/// ([`super::AcquireTemplate::encode_laid_out`], [`super::encode_acquire_all_laid_out`]): what a batch
/// needs of it without reading it again.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    /// Its script.
    pub script: SegmentScript,
    /// The bytes of its keys in the command, each in the wire form (with its `/` before it in webdis's).
    pub keys: Range<usize>,
    /// How many keys.
    pub key_count: usize,
    /// How many arguments follow them.
    pub arg_count: usize,
}

/// How a segment takes part in a gate (`lua/acquire_batch.lua`): a request's in-flight permits and its
/// rate acquire joined in one batch, the acquire run only if every permit before it was taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gate {
    /// Not gated: run whatever came before (and opens a gate that was closed).
    Plain,
    /// A [`super::SEMAPHORE_ACQUIRE`] (`5`) that closes the gate when its permit is refused (an error leaves
    /// it as it was); skipped itself while the gate is closed.
    Opens,
    /// An [`super::ACQUIRE`] (`6`) or [`super::ACQUIRE_ALL`] (`7`) run only if the gate is open: else its
    /// reply is the error `SKIPPED`.
    Gated,
}

/// One call's part of a batch: its script, and its keys and arguments, either as they are in the wire
/// form of its own command (RESP bulk strings, or webdis's `/`-separated percent-encoded words), or a
/// settlement written straight into the batch ([`Segment::give_back`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment<'a> {
    pub script: SegmentScript,
    /// Its part in a gate ([`Gate::Plain`] unless set).
    pub gate: Gate,
    words: Words<'a>,
    key_count: usize,
    arg_count: usize,
}

/// Where a segment's keys and arguments come from.
#[derive(Debug, Clone, Copy)]
enum Words<'a> {
    /// Already in the wire form: copied.
    Encoded { keys: &'a [u8], args: &'a [u8] },
    /// A [`super::GIVE_BACK`] of `settlement` on limiter `name` (with `template`'s client id): written
    /// in place, with no command of its own encoded first.
    GiveBack { name: &'a str, template: &'a AcquireTemplate, settlement: &'a Settlement },
}

/// The same words: equal bytes, or the same settlement of the same limiter with the same template.
impl PartialEq for Words<'_> {
    fn eq(&self, other: &Self) -> bool {
        match (self, other) {
            (Words::Encoded { keys, args }, Words::Encoded { keys: k, args: a }) => keys == k && args == a,
            (
                Words::GiveBack { name, template, settlement },
                Words::GiveBack { name: n, template: t, settlement: s },
            ) => name == n && core::ptr::eq(*template, *t) && settlement == s,
            _ => false,
        }
    }
}

impl Eq for Words<'_> {}

impl<'a> Segment<'a> {
    /// The [`super::GIVE_BACK`] of `settlement` on limiter `name` (with `template`'s client id): the same
    /// segment as [`Segment::laid_out`] of [`Settlement::encode_laid_out`]'s command, without encoding that
    /// command (a batch of a tick's settles is written in one pass).
    pub fn give_back(name: &'a str, template: &'a AcquireTemplate, settlement: &'a Settlement) -> Self {
        Segment {
            script: SegmentScript::GiveBack,
            gate: Gate::Plain,
            words: Words::GiveBack { name, template, settlement },
            key_count: 5,
            arg_count: settlement.give_back_arg_count(),
        }
    }

    /// The same segment with its part in a gate.
    pub fn gated(self, gate: Gate) -> Self {
        Segment { gate, ..self }
    }

    /// About how many bytes its keys and arguments take in the wire form.
    fn size_hint(&self) -> usize {
        match self.words {
            Words::Encoded { keys, args } => keys.len() + args.len(),
            // Five keys of the name (percent-encoded at worst three bytes a byte), five arguments.
            Words::GiveBack { name, .. } => 15 * name.len() + 256,
        }
    }

    fn write_keys(&self, out: &mut Vec<u8>, encoding: Encoding) {
        match self.words {
            Words::Encoded { keys, .. } => out.extend_from_slice(keys),
            Words::GiveBack { name, template, settlement } => {
                push_keys(out, encoding, name, template, settlement.value_suffix());
            }
        }
    }

    fn write_args(&self, out: &mut Vec<u8>, encoding: Encoding) {
        match self.words {
            Words::Encoded { args, .. } => out.extend_from_slice(args),
            Words::GiveBack { settlement, .. } => settlement.push_give_back_args(out, encoding),
        }
    }

    /// The segment of `command` (an acquire by sha in `encoding`) laid out as `layout` says; `None` if the
    /// layout does not fit the command.
    pub fn laid_out(command: &'a [u8], layout: &Layout, encoding: Encoding) -> Option<Self> {
        let body = match encoding {
            Encoding::Resp => command,
            Encoding::WebdisPath => command.strip_suffix(b".raw")?,
        };
        Some(Segment {
            script: layout.script,
            gate: Gate::Plain,
            words: Words::Encoded { keys: body.get(layout.keys.clone())?, args: body.get(layout.keys.end..)? },
            key_count: layout.key_count,
            arg_count: layout.arg_count,
        })
    }

    /// The segment of `command`: an [`ACQUIRE`], [`ACQUIRE_ALL`], [`GIVE_BACK`] or [`SEMAPHORE_ACQUIRE`] call
    /// by sha (`EVALSHA <sha> <numkeys> <keys>... <args>...`) in `encoding`, as `PendingRequest::encode` and
    /// [`super::encode_semaphore_acquires`] write it. `None` for any other command (another script, or `EVAL`
    /// by source): such a call is sent alone.
    pub fn of(command: &'a [u8], encoding: Encoding) -> Option<Self> {
        match encoding {
            Encoding::Resp => Self::of_resp(command),
            Encoding::WebdisPath => Self::of_webdis(command),
        }
    }

    fn of_resp(command: &'a [u8]) -> Option<Self> {
        let mut at = 0;
        let words = resp_length(command, &mut at, b'*')?;
        let word = |at: &mut usize| -> Option<&'a [u8]> {
            let len = resp_length(command, at, b'$')?;
            let end = at.checked_add(len)?;
            let bytes = command.get(*at..end)?;
            (command.get(end..end + 2)? == b"\r\n").then_some(())?;
            *at = end + 2;
            Some(bytes)
        };
        (word(&mut at)? == b"EVALSHA").then_some(())?;
        let script = script_of(word(&mut at)?)?;
        let key_count = count(word(&mut at)?)?;
        let keys_start = at;
        for _ in 0..key_count {
            word(&mut at)?;
        }
        let arg_count = words.checked_sub(3 + key_count)?;
        let keys = command.get(keys_start..at)?;
        let args = command.get(at..)?;
        Some(Segment { script, gate: Gate::Plain, words: Words::Encoded { keys, args }, key_count, arg_count })
    }

    fn of_webdis(command: &'a [u8]) -> Option<Self> {
        let body = command.strip_suffix(b".raw")?;
        // Where each word ends: at a `/` (arguments are percent-encoded, so every `/` separates two), or
        // at the end.
        let mut ends: Vec<usize> = body.iter().enumerate().filter(|(_, &b)| b == b'/').map(|(at, _)| at).collect();
        let words = ends.len() + 1;
        ends.push(body.len());
        let (&first, &second, &third) = (ends.first()?, ends.get(1)?, ends.get(2)?);
        (body.get(..first)? == b"EVALSHA").then_some(())?;
        let script = script_of(body.get(first + 1..second)?)?;
        let key_count = count(body.get(second + 1..third)?)?;
        let arg_count = words.checked_sub(3 + key_count)?;
        // The keys run from the `/` before the first key to the `/` before the first argument.
        let keys_end = *ends.get(2 + key_count)?;
        let keys = body.get(third..keys_end)?;
        let args = body.get(keys_end..)?;
        Some(Segment { script, gate: Gate::Plain, words: Words::Encoded { keys, args }, key_count, arg_count })
    }
}

/// A decimal count, the whole of `text`.
fn count(text: &[u8]) -> Option<usize> {
    leading_number(text).filter(|&(_, digits)| digits == text.len()).map(|(n, _)| n)
}

/// The script whose sha this is, among those a batch runs.
fn script_of(sha: &[u8]) -> Option<SegmentScript> {
    if sha == ACQUIRE.sha().as_bytes() {
        Some(SegmentScript::Acquire)
    } else if sha == ACQUIRE_ALL.sha().as_bytes() {
        Some(SegmentScript::AcquireAll)
    } else if sha == GIVE_BACK.sha().as_bytes() {
        Some(SegmentScript::GiveBack)
    } else if sha == SEMAPHORE_ACQUIRE.sha().as_bytes() {
        Some(SegmentScript::SemaphoreAcquire)
    } else if sha == SEMAPHORE_RELEASE.sha().as_bytes() {
        Some(SegmentScript::SemaphoreRelease)
    } else {
        None
    }
}

/// Reads `<kind><n>\r\n` at `at` (moved past it): a length the filter itself wrote.
fn resp_length(bytes: &[u8], at: &mut usize, kind: u8) -> Option<usize> {
    (*bytes.get(*at)? == kind).then_some(())?;
    let (n, digits) = leading_number(bytes.get(*at + 1..)?)?;
    let end = *at + 1 + digits;
    (bytes.get(end..end + 2)? == b"\r\n").then_some(())?;
    *at = end + 2;
    Some(n)
}

/// The decimal number at the start of `bytes` and how many digits it has (`None` without a digit, or
/// with more than 9: no length or count the filter writes has as many). Written out as a plain loop: a
/// batch reads about ten of these per call on every request's path, and `str::parse` (UTF-8 validation,
/// checked arithmetic through an iterator) cost ten times as much guest fuel.
fn leading_number(bytes: &[u8]) -> Option<(usize, usize)> {
    let mut n = 0usize;
    let mut digits = 0usize;
    while let Some(&byte) = bytes.get(digits) {
        if !byte.is_ascii_digit() || digits == 9 {
            break;
        }
        n = n * 10 + usize::from(byte - b'0');
        digits += 1;
    }
    (digits > 0 && bytes.get(digits).is_none_or(|b| !b.is_ascii_digit())).then_some((n, digits))
}

/// The [`super::ACQUIRE_BATCH`] call carrying `segments` in order, by sha or by source, in `encoding`
/// (the encoding the segments were read in).
pub fn encode_batch(segments: &[Segment<'_>], invocation: Invocation, encoding: Encoding) -> Vec<u8> {
    let key_count: usize = segments.iter().map(|s| s.key_count).sum();
    let size: usize = segments.iter().map(|s| s.size_hint() + 24).sum();
    let mut out = Vec::with_capacity(size + 96);
    let mut number = itoa::Buffer::new();
    if encoding == Encoding::Resp {
        let words = 3 + key_count + 1 + segments.iter().map(|s| 3 + s.arg_count).sum::<usize>();
        push_length(&mut out, b'*', words);
    }
    let command: &[u8] = match invocation {
        Invocation::BySha => b"EVALSHA",
        Invocation::BySource => b"EVAL",
    };
    match encoding {
        // webdis's path starts with the command, without a `/`.
        Encoding::WebdisPath => out.extend_from_slice(command),
        Encoding::Resp => push_arg(&mut out, encoding, command),
    }
    match invocation {
        Invocation::BySha => push_arg(&mut out, encoding, ACQUIRE_BATCH.sha().as_bytes()),
        Invocation::BySource => push_arg_parts(&mut out, encoding, ACQUIRE_BATCH.parts()),
    }
    push_arg(&mut out, encoding, number.format(key_count).as_bytes());
    for segment in segments {
        segment.write_keys(&mut out, encoding);
    }
    push_arg(&mut out, encoding, number.format(segments.len()).as_bytes());
    for segment in segments {
        let script: &[u8] = match (segment.script, segment.gate) {
            (SegmentScript::Acquire, Gate::Gated) => b"6",
            (SegmentScript::AcquireAll, Gate::Gated) => b"7",
            (SegmentScript::SemaphoreAcquire, Gate::Opens) => b"5",
            (SegmentScript::Acquire, _) => b"1",
            (SegmentScript::AcquireAll, _) => b"2",
            (SegmentScript::GiveBack, _) => b"3",
            (SegmentScript::SemaphoreAcquire, _) => b"4",
            (SegmentScript::SemaphoreRelease, _) => b"8",
        };
        push_arg(&mut out, encoding, script);
        push_arg(&mut out, encoding, number.format(segment.key_count).as_bytes());
        push_arg(&mut out, encoding, number.format(segment.arg_count).as_bytes());
        segment.write_args(&mut out, encoding);
    }
    if encoding == Encoding::WebdisPath {
        out.extend_from_slice(b".raw");
    }
    out
}

/// Splits the reply of an [`super::ACQUIRE_BATCH`] call of `count` segments into each segment's own
/// reply, in RESP as Redis would have answered the call alone: a bare integer (`:n`), an array of the
/// elements as they came (integers, or webdis's bulk strings of digits), or an error (`-CODE text`).
///
/// # Errors
/// What is wrong when the reply is not `count` segments: an error reply for the whole call (`-NOSCRIPT
/// ...`, `-OOM ...`: the caller reads it), or not the batch script's reply.
pub fn split_batch_reply(bytes: &[u8], count: usize) -> Result<Vec<Vec<u8>>, &'static str> {
    if bytes.first() == Some(&b'-') {
        return Err("an error reply for the whole batch");
    }
    let elements = array_elements(bytes).map_err(|_| "a batch reply that is not a flat array")?;
    let mut replies = Vec::with_capacity(count);
    let mut at = 0;
    while let Some(&tag) = elements.get(at) {
        let next = elements.get(at + 1).copied();
        let reply = match (integer(tag), next) {
            (Some(1), Some(value)) => {
                at += 2;
                let mut reply = Vec::with_capacity(24);
                reply.push(b':');
                reply.extend_from_slice(body(value).ok_or("a batch reply with a bad value")?);
                reply.extend_from_slice(b"\r\n");
                reply
            }
            (Some(2), Some(n)) => {
                let n = integer(n).ok_or("a batch reply with a bad length")?;
                let items = elements.get(at + 2..at + 2 + n).ok_or("a batch reply cut short")?;
                let mut reply = Vec::with_capacity(8 + items.iter().map(|i| i.len()).sum::<usize>());
                push_length(&mut reply, b'*', n);
                for item in items {
                    reply.extend_from_slice(item);
                }
                at += 2 + n;
                reply
            }
            (Some(3), Some(text)) => {
                at += 2;
                let text = body(text).ok_or("a batch reply with a bad error")?;
                let mut reply = Vec::with_capacity(text.len() + 3);
                reply.push(b'-');
                reply.extend(text.iter().map(|&b| if b == b'\r' || b == b'\n' { b' ' } else { b }));
                reply.extend_from_slice(b"\r\n");
                reply
            }
            _ => return Err("a batch reply with an unknown segment"),
        };
        replies.push(reply);
    }
    if replies.len() == count {
        Ok(replies)
    } else {
        Err("a batch reply with another number of segments")
    }
}

/// The text of a RESP integer (`:n`) or bulk string (`$len`, then the bytes) element.
fn body(element: &[u8]) -> Option<&[u8]> {
    let inner = element.strip_suffix(b"\r\n")?;
    match inner.first()? {
        b':' => inner.get(1..),
        b'$' => inner.iter().position(|&b| b == b'\n').and_then(|at| inner.get(at + 1..)),
        _ => None,
    }
}

/// A small RESP integer or bulk string of decimal digits (webdis's form of an integer in an array): the
/// segment tags and lengths of a batch reply.
fn integer(element: &[u8]) -> Option<usize> {
    count(body(element)?)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing, clippy::panic)]
    use super::*;
    use crate::config::LimiterType;
    use crate::resp::{decode_reply, Reply};
    use crate::script::{encode_acquire_all, AcquireConfig, AcquirePart, AcquireTemplate, Clock, MEMBER_RANDOM_LEN};

    fn template() -> AcquireTemplate {
        let config = AcquireConfig {
            permits: 1,
            rate: 10,
            interval_ms: 1000,
            limiter_type: LimiterType::Overall,
            keep_alive_ms: 0,
            apply_config: false,
            layout: crate::config::WindowLayout::SlidingLog,
        };
        AcquireTemplate::new(config, "6d1f3b9a-2c4e-4a8b-b5d7-9e0f1a2b3c4d")
    }

    /// The words of a command in either wire form.
    fn words(command: &[u8], encoding: Encoding) -> Vec<Vec<u8>> {
        match encoding {
            Encoding::Resp => match decode_reply(command).unwrap() {
                Reply::Array(items) => items
                    .into_iter()
                    .map(|item| match item {
                        Reply::Bulk(bytes) => bytes,
                        other => panic!("{other:?}"),
                    })
                    .collect(),
                other => panic!("{other:?}"),
            },
            Encoding::WebdisPath => command
                .strip_suffix(b".raw")
                .unwrap()
                .split(|&b| b == b'/')
                .map(|word| percent_encoding::percent_decode(word).collect())
                .collect(),
        }
    }

    /// Three calls (ACQUIRE with an empty argument, ACQUIRE_ALL of two limiters, ACQUIRE on Redis's clock)
    /// batched in each wire form: the same words, which are the batch script's documented layout.
    #[test]
    fn a_batch_carries_each_call_as_it_was_in_both_wire_forms() {
        let template = template();
        let random = [7u8; MEMBER_RANDOM_LEN];
        let commands = |encoding| {
            let parts = [
                AcquirePart { template: &template, name: "erl:a", random: &random, lease: None },
                AcquirePart { template: &template, name: "erl:b", random: &random, lease: None },
            ];
            vec![
                template.encode("erl:a/x y", Clock::Gateway(5), &random, None, Invocation::BySha, encoding),
                encode_acquire_all(&parts, Clock::Gateway(6), true, Invocation::BySha, encoding),
                template.encode("erl:c", Clock::Redis, &random, None, Invocation::BySha, encoding),
            ]
        };
        let batch_words = |encoding| {
            let commands = commands(encoding);
            let segments: Vec<Segment<'_>> = commands.iter().map(|c| Segment::of(c, encoding).unwrap()).collect();
            assert_eq!(
                segments.iter().map(|s| s.script).collect::<Vec<_>>(),
                [SegmentScript::Acquire, SegmentScript::AcquireAll, SegmentScript::Acquire]
            );
            words(&encode_batch(&segments, Invocation::BySha, encoding), encoding)
        };
        let resp = batch_words(Encoding::Resp);
        assert_eq!(resp, batch_words(Encoding::WebdisPath));
        let alone: Vec<Vec<Vec<u8>>> = commands(Encoding::Resp).iter().map(|c| words(c, Encoding::Resp)).collect();
        // EVALSHA sha 20 (5 + 10 + 5 keys), then each call's keys, the count, and each call's header and args.
        assert_eq!(resp[0], b"EVALSHA");
        assert_eq!(resp[1], ACQUIRE_BATCH.sha().as_bytes());
        assert_eq!(resp[2], b"20");
        let mut expected: Vec<Vec<u8>> = Vec::new();
        for call in &alone {
            let keys: usize = core::str::from_utf8(&call[2]).unwrap().parse().unwrap();
            expected.extend(call[3..3 + keys].iter().cloned());
        }
        expected.push(b"3".to_vec());
        for (call, script) in alone.iter().zip(["1", "2", "1"]) {
            let keys: usize = core::str::from_utf8(&call[2]).unwrap().parse().unwrap();
            let args = &call[3 + keys..];
            expected.push(script.into());
            expected.push(keys.to_string().into_bytes());
            expected.push(args.len().to_string().into_bytes());
            expected.extend(args.iter().cloned());
        }
        assert_eq!(&resp[3..], &expected[..]);
    }

    /// A settlement written straight into a batch ([`Segment::give_back`]) makes the same batch, byte for
    /// byte, as its own GIVE_BACK command encoded and then read back, in both wire forms: with and without
    /// renamed bytes, on names with and without a hash tag and with bytes webdis must percent-encode.
    #[test]
    fn a_give_back_written_in_place_is_the_batch_of_its_own_command() {
        let template = template();
        let settlement = |random: u8, renamed, at| crate::script::Settlement {
            random: [random; MEMBER_RANDOM_LEN],
            granted: 1000,
            used: 42,
            early_ms: 17,
            renamed,
            at,
        };
        let at = Some(crate::script::MemberAt {
            score_ms: 1_700_000_000_123,
            rate: 5000,
            limiter_type: crate::config::LimiterType::PerClient,
            counter_slice_ms: None,
        });
        let settlements = [
            ("erl:a", settlement(1, Some([b'-'; MEMBER_RANDOM_LEN]), None)),
            ("{t}b%/ x", settlement(b'/', None, None)),
            ("erl:c", settlement(3, Some([b'+'; MEMBER_RANDOM_LEN]), at)),
            ("erl:d", settlement(4, None, at)),
        ];
        for encoding in [Encoding::Resp, Encoding::WebdisPath] {
            for invocation in [Invocation::BySha, Invocation::BySource] {
                let commands: Vec<Vec<u8>> = settlements
                    .iter()
                    .map(|(name, s)| s.encode(name, &template, Invocation::BySha, encoding))
                    .collect();
                let read_back: Vec<Segment<'_>> = commands.iter().map(|c| Segment::of(c, encoding).unwrap()).collect();
                let in_place: Vec<Segment<'_>> =
                    settlements.iter().map(|(name, s)| Segment::give_back(name, &template, s)).collect();
                assert_eq!(
                    encode_batch(&in_place, invocation, encoding),
                    encode_batch(&read_back, invocation, encoding),
                    "{encoding:?} {invocation:?}"
                );
            }
        }
    }

    /// The layout an encoder records is the one read back from its bytes, for every kind of acquire.
    #[test]
    fn the_encoders_layouts_are_the_segments_read_from_their_commands() {
        use crate::script::{encode_acquire_all_laid_out, LeaseRequest};
        let template = template();
        let random = [9u8; MEMBER_RANDOM_LEN];
        let lease = LeaseRequest { max_permits: 8, max_age_ms: 50, settle: None };
        for encoding in [Encoding::Resp, Encoding::WebdisPath] {
            let parts = [
                AcquirePart { template: &template, name: "erl:a", random: &random, lease: Some(&lease) },
                AcquirePart { template: &template, name: "{t}b%/", random: &random, lease: None },
            ];
            let settlement = crate::script::Settlement {
                random,
                granted: 1000,
                used: 42,
                early_ms: 0,
                renamed: Some([b'-'; MEMBER_RANDOM_LEN]),
                at: None,
            };
            let commands = [
                template.encode_laid_out("erl:a", Clock::Gateway(7), &random, None, Invocation::BySha, encoding),
                template.encode_laid_out("{x}y", Clock::Redis, &random, Some(&lease), Invocation::BySha, encoding),
                encode_acquire_all_laid_out(&parts, Clock::Gateway(8), false, Invocation::BySha, encoding),
                settlement.encode_laid_out("erl:a%/", &template, Invocation::BySha, encoding),
            ];
            for (command, layout) in &commands {
                assert_eq!(
                    Segment::laid_out(command, layout, encoding),
                    Segment::of(command, encoding),
                    "{encoding:?}"
                );
                assert!(Segment::of(command, encoding).is_some());
            }
        }
    }

    #[test]
    fn other_commands_are_not_segments() {
        let template = template();
        let random = [7u8; MEMBER_RANDOM_LEN];
        for encoding in [Encoding::Resp, Encoding::WebdisPath] {
            let by_source = template.encode("erl:a", Clock::Redis, &random, None, Invocation::BySource, encoding);
            assert_eq!(Segment::of(&by_source, encoding), None, "EVAL by source goes alone");
        }
        assert_eq!(Segment::of(b"*1\r\n$4\r\nPING\r\n", Encoding::Resp), None);
        assert_eq!(Segment::of(b"EVALSHA/0000/1/k.raw", Encoding::WebdisPath), None, "an unknown sha");
        assert_eq!(Segment::of(b"*3\r\n$7\r\nEVALSHA\r\n", Encoding::Resp), None, "cut short");
    }

    /// A batch reply as Redis sends it (integers) and as webdis re-encodes it (bulk strings) splits into the
    /// replies each call would have had alone.
    #[test]
    fn a_batch_reply_splits_into_each_calls_own_reply() {
        let redis =
            b"*10\r\n:1\r\n:4\r\n:2\r\n:2\r\n:3\r\n:7\r\n:3\r\n$27\r\nWRONGTYPE Operation against\r\n:1\r\n:-12\r\n";
        let webdis = b"*10\r\n$1\r\n1\r\n$1\r\n4\r\n$1\r\n2\r\n$1\r\n2\r\n$1\r\n3\r\n$1\r\n7\r\n$1\r\n3\r\n$27\r\nWRONGTYPE Operation against\r\n$1\r\n1\r\n$3\r\n-12\r\n";
        let from_redis = split_batch_reply(redis, 4).unwrap();
        assert_eq!(
            from_redis,
            [
                b":4\r\n".to_vec(),
                b"*2\r\n:3\r\n:7\r\n".to_vec(),
                b"-WRONGTYPE Operation against\r\n".to_vec(),
                b":-12\r\n".to_vec()
            ]
        );
        let from_webdis = split_batch_reply(webdis, 4).unwrap();
        assert_eq!(from_webdis[0], b":4\r\n");
        assert_eq!(from_webdis[1], b"*2\r\n$1\r\n3\r\n$1\r\n7\r\n", "the array's elements as webdis sent them");
        assert_eq!(from_webdis[2..], from_redis[2..]);
        assert!(split_batch_reply(redis, 5).is_err(), "a segment missing");
        assert!(split_batch_reply(b"*2\r\n:9\r\n:1\r\n", 1).is_err(), "an unknown tag");
        assert!(split_batch_reply(b"*3\r\n:2\r\n:5\r\n:1\r\n", 1).is_err(), "an array cut short");
        assert!(split_batch_reply(b"-NOSCRIPT No matching script\r\n", 2).is_err());
    }
}
