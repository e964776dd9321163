//! The acquire commands (Redisson `tryAcquire` with trySetRate and, if asked, updateRate: see
//! [`super::ACQUIRE`]; several limiters at once: [`super::ACQUIRE_ALL`]; a give-back: [`super::GIVE_BACK`]):
//! their bytes. Their replies: `reply`.
//!
//! Everything of a rule's command that does not change per request is encoded once, when the filter is
//! configured ([`AcquireTemplate`]): the script's SHA, the argument tail (permits, rate, interval, type,
//! keep-alive, apply flag) in both wire forms, the client id. A request adds its limiter name, time and
//! member bytes into one buffer ([`AcquireTemplate::encode`]).

use core::ops::Range;

use crate::prelude::*;

use crate::config::{LimiterType, WindowLayout};
use crate::key::LimiterKeys;
use crate::resp::Command;

use super::batch::{Layout, SegmentScript};
use super::settlement::Settlement;
use super::wire::{push_arg, push_bulk, push_encoded, push_length, ArgWriter};
use super::{Invocation, ACQUIRE, ACQUIRE_ALL};

/// The hash field where [`super::ACQUIRE`] records the config a rule wrote (`rate_source: config`):
/// `rate:interval:type:keepAliveTime`, next to Redisson's four fields.
pub const RULE_CONFIG_FIELD: &str = "erlRuleConfig";

/// ARGV 6 (the limiter type) of a sliding window counter: the scripts keep it in one hash, `{name}:value`
/// (docs/configuration.md, "Which window to choose").
pub const COUNTER_TYPE: &[u8] = b"2";

/// ARGV 6 (the limiter type) of a calendar quota: one counter per period in the hash `{name}:counter`.
pub const CALENDAR_TYPE: &[u8] = b"3";

/// Length of the random part of a permit member, bytes (Redisson 4.x; 3.17-3.20 wrote 8).
pub const MEMBER_RANDOM_LEN: usize = 16;

/// Where the acquire time comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Clock {
    /// The gateway's clock, ms since the epoch (Redisson uses the client's clock the same way).
    Gateway(u64),
    /// Redis's `TIME`: one clock for every gateway, no skew.
    Redis,
}

/// The wire form of a command.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Encoding {
    /// A RESP array of bulk strings, as Redis reads it (the host's Redis client).
    Resp,
    /// webdis's path form with the `.raw` suffix (the HTTP bridge), see [`Command::to_webdis_path`].
    WebdisPath,
}

/// The config an acquire creates a limiter with (or applies, with `apply_config`), and its permits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AcquireConfig {
    /// Permits one acquire takes.
    pub permits: u64,
    /// Permits per interval.
    pub rate: u64,
    /// Interval, ms.
    pub interval_ms: u64,
    /// Overall or per client.
    pub limiter_type: LimiterType,
    /// keepAliveTime, ms (0 = none).
    pub keep_alive_ms: u64,
    /// Whether Redis should apply this config over one the rule wrote (`rate_source: config`).
    pub apply_config: bool,
    /// How the limiter is kept in Redis: a sliding window counter is asked with type `2` (ARGV 6 of
    /// [`super::ACQUIRE`], and of each limiter in [`super::ACQUIRE_ALL`]).
    pub layout: WindowLayout,
}

/// One rule's acquire command with everything but the limiter name, the time and the member bytes
/// encoded in advance.
///
/// `ARGV` of [`super::ACQUIRE`]: 1 now (ms since the epoch; empty = Redis `TIME`), 2 the member's random
/// bytes, 3 permits, 4 rate, 5 interval (ms), 6 type (`0`/`1`), 7 keepAliveTime (ms), 8 `1` = apply 3-7
/// (`rate_source: config`).
#[derive(Debug, Clone)]
pub struct AcquireTemplate {
    config: AcquireConfig,
    /// `:<client id>`, raw and percent-encoded: the suffix of the per-client keys.
    pub(super) client_suffix: (Vec<u8>, Vec<u8>),
    /// ARGV 3-8 as they are.
    pub(super) tail: [Vec<u8>; 6],
    /// ARGV 3-8 as RESP bulk strings.
    resp_tail: Vec<u8>,
    /// ARGV 3-8 in webdis's path form (each with its leading `/`).
    webdis_tail: Vec<u8>,
}

impl AcquireTemplate {
    /// The template of a rule's acquire for this gateway's Redisson client id. (A calendar quota's acquire
    /// needs its period: [`AcquireTemplate::in_period`].)
    pub fn new(config: AcquireConfig, client_id: &str) -> Self {
        Self::build(config, client_id, (0, 0))
    }

    /// A calendar quota's acquire in the period from `start_ms` to `end_ms` (ms since the epoch): type `3`,
    /// ARGV 5 the period's end, ARGV 7 its start (the counter's field).
    pub fn in_period(config: AcquireConfig, client_id: &str, start_ms: u64, end_ms: u64) -> Self {
        Self::build(config, client_id, (start_ms, end_ms))
    }

    fn build(config: AcquireConfig, client_id: &str, (start_ms, end_ms): (u64, u64)) -> Self {
        let (interval, kind, keep_alive) = match config.layout {
            WindowLayout::SlidingLog => (
                config.interval_ms,
                config.limiter_type.redisson_ordinal().to_string().into_bytes(),
                config.keep_alive_ms,
            ),
            WindowLayout::SlidingWindowCounter => {
                (config.interval_ms, COUNTER_TYPE.to_vec(), crate::config::COUNTER_SLICES)
            }
            WindowLayout::Calendar { .. } => (end_ms, CALENDAR_TYPE.to_vec(), start_ms),
        };
        let tail = [
            config.permits.to_string().into_bytes(),
            config.rate.to_string().into_bytes(),
            interval.to_string().into_bytes(),
            kind,
            keep_alive.to_string().into_bytes(),
            if config.apply_config { b"1".to_vec() } else { b"0".to_vec() },
        ];
        let mut resp_tail = Vec::new();
        let mut webdis_tail = Vec::new();
        for arg in &tail {
            push_bulk(&mut resp_tail, arg);
            webdis_tail.push(b'/');
            push_encoded(&mut webdis_tail, arg);
        }
        let raw = format!(":{client_id}").into_bytes();
        let mut encoded = Vec::new();
        push_encoded(&mut encoded, &raw);
        AcquireTemplate { config, client_suffix: (raw, encoded), tail, resp_tail, webdis_tail }
    }

    /// The suffix of the limiter's second key: `:value` (the sliding log's available permits), or
    /// `:counter` (a sliding window counter's hash of slices: its only key, kept apart from a sliding log's
    /// keys of the same name).
    pub fn value_suffix(&self) -> &'static str {
        match self.config.layout {
            WindowLayout::SlidingLog => ":value",
            WindowLayout::SlidingWindowCounter | WindowLayout::Calendar { .. } => ":counter",
        }
    }

    /// The config this template acquires with.
    pub fn config(&self) -> &AcquireConfig {
        &self.config
    }

    /// The command's bytes for limiter `name` at `clock` with the member's `random` bytes, and the lease
    /// it asks for (ARGV 9-14; `None`: an acquire of the rule's permits).
    pub fn encode(
        &self,
        name: &str,
        clock: Clock,
        random: &[u8; MEMBER_RANDOM_LEN],
        lease: Option<&LeaseRequest>,
        invocation: Invocation,
        encoding: Encoding,
    ) -> Vec<u8> {
        self.encode_laid_out(name, clock, random, lease, invocation, encoding).0
    }

    /// [`AcquireTemplate::encode`], and where its keys and arguments are ([`Layout`], for a batch).
    pub fn encode_laid_out(
        &self,
        name: &str,
        clock: Clock,
        random: &[u8; MEMBER_RANDOM_LEN],
        lease: Option<&LeaseRequest>,
        invocation: Invocation,
        encoding: Encoding,
    ) -> (Vec<u8>, Layout) {
        let mut now_digits = itoa::Buffer::new();
        let now = match clock {
            Clock::Gateway(ms) => now_digits.format(ms).as_bytes(),
            Clock::Redis => b"",
        };
        let hash_tag = !name.contains('{');
        let (out, keys) = match encoding {
            Encoding::Resp => self.encode_resp(name, hash_tag, now, random, lease, invocation),
            Encoding::WebdisPath => self.encode_webdis(name, hash_tag, now, random, lease, invocation),
        };
        let arg_count = if lease.is_some() { 14 } else { 8 };
        (out, Layout { script: SegmentScript::Acquire, keys, key_count: 5, arg_count })
    }

    /// [`AcquireTemplate::encode`] as RESP: one array of bulk strings.
    #[inline]
    fn encode_resp(
        &self,
        name: &str,
        hash_tag: bool,
        now: &[u8],
        random: &[u8; MEMBER_RANDOM_LEN],
        lease: Option<&LeaseRequest>,
        invocation: Invocation,
    ) -> (Vec<u8>, Range<usize>) {
        let (open, close) = if hash_tag { ("{", "}") } else { ("", "") };
        let mut out = Vec::with_capacity(5 * name.len() + self.resp_tail.len() + 256);
        out.extend_from_slice(if lease.is_some() { b"*22\r\n" } else { b"*16\r\n" });
        match invocation {
            Invocation::BySha => {
                push_bulk(&mut out, b"EVALSHA");
                push_bulk(&mut out, ACQUIRE.sha().as_bytes());
            }
            Invocation::BySource => {
                push_bulk(&mut out, b"EVAL");
                push_bulk(&mut out, ACQUIRE.source.as_bytes());
            }
        }
        push_bulk(&mut out, b"5");
        let keys_start = out.len();
        push_bulk(&mut out, name.as_bytes());
        let client = &self.client_suffix.0;
        for (suffix, per_client) in
            [(self.value_suffix(), false), (":value", true), (":permits", false), (":permits", true)]
        {
            let len = name.len() + open.len() + close.len() + suffix.len() + if per_client { client.len() } else { 0 };
            push_length(&mut out, b'$', len);
            out.extend_from_slice(open.as_bytes());
            out.extend_from_slice(name.as_bytes());
            out.extend_from_slice(close.as_bytes());
            out.extend_from_slice(suffix.as_bytes());
            if per_client {
                out.extend_from_slice(client);
            }
            out.extend_from_slice(b"\r\n");
        }
        let keys = keys_start..out.len();
        push_bulk(&mut out, now);
        push_bulk(&mut out, random);
        out.extend_from_slice(&self.resp_tail);
        if let Some(lease) = lease {
            lease.push_args(&mut out, Encoding::Resp);
        }
        (out, keys)
    }

    /// [`AcquireTemplate::encode`] in webdis's path form, with the `.raw` suffix.
    #[inline]
    fn encode_webdis(
        &self,
        name: &str,
        hash_tag: bool,
        now: &[u8],
        random: &[u8; MEMBER_RANDOM_LEN],
        lease: Option<&LeaseRequest>,
        invocation: Invocation,
    ) -> (Vec<u8>, Range<usize>) {
        let mut out = Vec::with_capacity(15 * name.len() + self.webdis_tail.len() + 256);
        match invocation {
            Invocation::BySha => {
                out.extend_from_slice(b"EVALSHA/");
                out.extend_from_slice(ACQUIRE.sha().as_bytes());
            }
            Invocation::BySource => {
                out.extend_from_slice(b"EVAL/");
                push_encoded(&mut out, ACQUIRE.source.as_bytes());
            }
        }
        out.extend_from_slice(b"/5/");
        let keys_start = out.len() - 1;
        // The name, encoded once; the four other keys copy it.
        let start = out.len();
        push_encoded(&mut out, name.as_bytes());
        let name_encoded = start..out.len();
        let (open, close) = if hash_tag { ("%7B", "%7D") } else { ("", "") };
        let client = &self.client_suffix.1;
        let encoded_value = match self.config.layout {
            WindowLayout::SlidingLog => "%3Avalue",
            WindowLayout::SlidingWindowCounter | WindowLayout::Calendar { .. } => "%3Acounter",
        };
        for (suffix, per_client) in
            [(encoded_value, false), ("%3Avalue", true), ("%3Apermits", false), ("%3Apermits", true)]
        {
            out.push(b'/');
            out.extend_from_slice(open.as_bytes());
            out.extend_from_within(name_encoded.clone());
            out.extend_from_slice(close.as_bytes());
            out.extend_from_slice(suffix.as_bytes());
            if per_client {
                out.extend_from_slice(client);
            }
        }
        let keys = keys_start..out.len();
        out.push(b'/');
        out.extend_from_slice(now);
        out.push(b'/');
        push_encoded(&mut out, random);
        out.extend_from_slice(&self.webdis_tail);
        if let Some(lease) = lease {
            lease.push_args(&mut out, Encoding::WebdisPath);
        }
        out.extend_from_slice(b".raw");
        (out, keys)
    }

    /// The same command as a generic [`Command`] (for tools and tests; the filter uses
    /// [`AcquireTemplate::encode`]).
    pub fn command(
        &self,
        name: &str,
        clock: Clock,
        random: &[u8],
        lease: Option<&LeaseRequest>,
        invocation: Invocation,
    ) -> Command {
        let keys = LimiterKeys::new(name, &self.client_id());
        let now = clock_arg(clock);
        let lease_args = lease.map(LeaseRequest::args);
        let mut args: Vec<&[u8]> = vec![&now, random];
        args.extend(self.tail.iter().map(Vec::as_slice));
        args.extend(lease_args.iter().flatten().map(Vec::as_slice));
        ACQUIRE.command(invocation, &keys, &args)
    }

    /// This template's Redisson client id.
    fn client_id(&self) -> String {
        String::from_utf8_lossy(self.client_suffix.0.get(1..).unwrap_or_default()).into_owned()
    }
}

/// ARGV 1 of the scripts that take a time: ms since the epoch, or empty for Redis's `TIME`.
pub(super) fn clock_arg(clock: Clock) -> Vec<u8> {
    match clock {
        Clock::Gateway(ms) => ms.to_string().into_bytes(),
        Clock::Redis => Vec::new(),
    }
}

/// A lease an acquire asks for (docs/configuration.md, "Leases"): ARGV 9-14 of [`super::ACQUIRE`], 8-13 of a limiter
/// in [`super::ACQUIRE_ALL`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseRequest {
    /// Most permits to take (Redis takes at most those free, and at least the rule's permits).
    pub max_permits: u64,
    /// The lease's age, ms: its member is scored at the acquire's time plus this.
    pub max_age_ms: u64,
    /// The previous lease of this VM on the limiter, settled in the same call.
    pub settle: Option<Settlement>,
}

impl LeaseRequest {
    /// The six arguments: most permits, age (ms), and the settlement's four (empty random: none).
    fn args(&self) -> [Vec<u8>; 6] {
        let [random, granted, used, early] = match &self.settle {
            Some(settle) => settle.args(),
            None => [Vec::new(), b"0".to_vec(), b"0".to_vec(), b"0".to_vec()],
        };
        [
            self.max_permits.to_string().into_bytes(),
            self.max_age_ms.to_string().into_bytes(),
            random,
            granted,
            used,
            early,
        ]
    }

    fn push_args(&self, out: &mut Vec<u8>, encoding: Encoding) {
        for arg in self.args() {
            push_arg(out, encoding, &arg);
        }
    }
}

/// No lease: the six lease arguments of a limiter in [`super::ACQUIRE_ALL`] that asks for none.
const NO_LEASE: LeaseRequest = LeaseRequest { max_permits: 0, max_age_ms: 0, settle: None };

/// One limiter's part of an [`super::ACQUIRE_ALL`] call.
#[derive(Debug, Clone, Copy)]
pub struct AcquirePart<'a> {
    /// Its rule's template.
    pub template: &'a AcquireTemplate,
    /// The limiter name.
    pub name: &'a str,
    /// The new member's random bytes.
    pub random: &'a [u8; MEMBER_RANDOM_LEN],
    /// The lease it asks for, if any.
    pub lease: Option<&'a LeaseRequest>,
}

/// The bytes of one [`super::ACQUIRE_ALL`] call over `parts` (all with one client id) at `clock`;
/// `errors_stop_charge`: a Redis error on one limiter's keys leaves the others uncharged (the request fails
/// closed, so it will not go on).
pub fn encode_acquire_all(
    parts: &[AcquirePart<'_>],
    clock: Clock,
    errors_stop_charge: bool,
    invocation: Invocation,
    encoding: Encoding,
) -> Vec<u8> {
    encode_acquire_all_laid_out(parts, clock, errors_stop_charge, invocation, encoding).0
}

/// [`encode_acquire_all`], and where its keys and arguments are ([`Layout`], for a batch).
pub fn encode_acquire_all_laid_out(
    parts: &[AcquirePart<'_>],
    clock: Clock,
    errors_stop_charge: bool,
    invocation: Invocation,
    encoding: Encoding,
) -> (Vec<u8>, Layout) {
    let mut out = Vec::with_capacity(512 * parts.len());
    let mut writer = ArgWriter::new(&mut out, encoding, 3 + parts.len() * (5 + 13) + 2);
    writer.script(&ACQUIRE_ALL, invocation, parts.len());
    let keys_start = writer.position();
    for part in parts {
        writer.keys(part.name, part.template);
    }
    let keys = keys_start..writer.position();
    writer.arg(&clock_arg(clock));
    writer.arg(if errors_stop_charge { b"1" } else { b"0" });
    for part in parts {
        writer.arg(part.random);
        for tail in &part.template.tail {
            writer.arg(tail);
        }
        for lease in part.lease.unwrap_or(&NO_LEASE).args() {
            writer.arg(&lease);
        }
    }
    writer.finish();
    let layout =
        Layout { script: SegmentScript::AcquireAll, keys, key_count: 5 * parts.len(), arg_count: 2 + 13 * parts.len() };
    (out, layout)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing, clippy::panic)]
    use super::*;
    use crate::resp::Reply;
    use crate::script::GIVE_BACK;

    fn template() -> AcquireTemplate {
        let config = AcquireConfig {
            permits: 2,
            rate: 10,
            interval_ms: 60_000,
            limiter_type: LimiterType::PerClient,
            keep_alive_ms: 3_600_000,
            apply_config: false,
            layout: crate::config::WindowLayout::SlidingLog,
        };
        AcquireTemplate::new(config, "client-1")
    }

    const NOW: Clock = Clock::Gateway(1_700_000_000_123);
    const RANDOM: [u8; MEMBER_RANDOM_LEN] = [7, 0, 255, b'/', 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12];

    #[test]
    fn the_command_carries_keys_then_arguments_in_script_order() {
        let command = template().command("erl:r:alice", NOW, &RANDOM, None, Invocation::BySha);
        let args: Vec<&[u8]> = command.args().iter().map(Vec::as_slice).collect();
        assert_eq!(args[0], b"EVALSHA");
        assert_eq!(args[1], ACQUIRE.sha().as_bytes());
        assert_eq!(
            &args[2..8],
            &[
                &b"5"[..],
                b"erl:r:alice",
                b"{erl:r:alice}:value",
                b"{erl:r:alice}:value:client-1",
                b"{erl:r:alice}:permits",
                b"{erl:r:alice}:permits:client-1"
            ]
        );
        assert_eq!(&args[8..], &[&b"1700000000123"[..], &RANDOM, b"2", b"10", b"60000", b"1", b"3600000", b"0"]);
    }

    #[test]
    fn the_template_encodes_exactly_what_the_generic_command_does() {
        let template = template();
        let settle = Settlement {
            random: [b'z'; MEMBER_RANDOM_LEN],
            granted: 64,
            used: 9,
            early_ms: 31,
            renamed: None,
            at: None,
        };
        let leases = [
            None,
            Some(LeaseRequest { max_permits: 64, max_age_ms: 50, settle: None }),
            Some(LeaseRequest { max_permits: 64, max_age_ms: 50, settle: Some(settle) }),
        ];
        for name in ["erl:r:alice", "{tagged}:r:~AP8", "erl:g"] {
            for clock in [NOW, Clock::Redis] {
                for invocation in [Invocation::BySha, Invocation::BySource] {
                    for lease in &leases {
                        let command = template.command(name, clock, &RANDOM, lease.as_ref(), invocation);
                        let resp = template.encode(name, clock, &RANDOM, lease.as_ref(), invocation, Encoding::Resp);
                        assert_eq!(resp, command.to_resp());
                        assert_eq!(
                            template.encode(name, clock, &RANDOM, lease.as_ref(), invocation, Encoding::WebdisPath),
                            command.to_webdis_path()
                        );
                    }
                }
            }
        }
        let leased = template.command("n", NOW, &RANDOM, leases[2].as_ref(), Invocation::BySha);
        let tail: Vec<&[u8]> = leased.args()[16..].iter().map(Vec::as_slice).collect();
        assert_eq!(tail, [&b"64"[..], b"50", b"zzzzzzzzzzzzzzzz", b"64", b"9", b"31"]);
        let redis_clock = template.command("n", Clock::Redis, &RANDOM, None, Invocation::BySha);
        assert_eq!(redis_clock.args()[8], b"", "an empty time makes the script read Redis TIME");
    }

    #[test]
    fn give_back_and_acquire_all_encode_as_the_generic_command_does() {
        let template = template();
        let settle =
            Settlement { random: [b'q'; MEMBER_RANDOM_LEN], granted: 7, used: 0, early_ms: 0, renamed: None, at: None };
        for name in ["erl:r:alice", "{tagged}:r:~AP8"] {
            let keys = LimiterKeys::new(name, "client-1");
            for invocation in [Invocation::BySha, Invocation::BySource] {
                let args = settle.args();
                let args: Vec<&[u8]> = args.iter().map(Vec::as_slice).collect();
                let command = GIVE_BACK.command(invocation, &keys, &args);
                assert_eq!(settle.encode(name, &template, invocation, Encoding::Resp), command.to_resp());
                assert_eq!(settle.encode(name, &template, invocation, Encoding::WebdisPath), command.to_webdis_path());
            }
        }
        // Settled at a cost with the member renamed: ARGV[5] is the new random; without `renamed`, 4 arguments.
        let renamed = Settlement { granted: 5, used: 12, renamed: Some(*b"-sABCDEFGHIJKLMN"), ..settle };
        for (settlement, argv) in [
            (renamed, vec![&[b'q'; 16][..], b"5", b"12", b"0", b"-sABCDEFGHIJKLMN"]),
            (settle, vec![&[b'q'; 16][..], b"7", b"0", b"0"]),
        ] {
            let keys = LimiterKeys::new("erl:r:alice", "client-1");
            let command = GIVE_BACK.command(Invocation::BySha, &keys, &argv);
            let encoded = settlement.encode("erl:r:alice", &template, Invocation::BySha, Encoding::Resp);
            assert_eq!(encoded, command.to_resp());
            assert_eq!(
                settlement.encode("erl:r:alice", &template, Invocation::BySha, Encoding::WebdisPath),
                command.to_webdis_path()
            );
            assert!(encoded.starts_with(format!("*{}\r\n", 8 + argv.len()).as_bytes()));
        }
        // A lease's settlement inside ACQUIRE has four arguments, renamed or not (ACQUIRE keeps `random`).
        let lease = LeaseRequest { max_permits: 64, max_age_ms: 50, settle: Some(renamed) };
        assert_eq!(lease.args()[2..], [vec![b'q'; 16], b"5".to_vec(), b"12".to_vec(), b"0".to_vec()]);
        // Two limiters: 5 keys each, now, then 13 arguments each (the rule's 7 and the lease's 6).
        let lease = LeaseRequest { max_permits: 64, max_age_ms: 50, settle: Some(settle) };
        let parts = [
            AcquirePart { template: &template, name: "erl:a", random: &RANDOM, lease: None },
            AcquirePart { template: &template, name: "erl:b", random: &[b'r'; MEMBER_RANDOM_LEN], lease: Some(&lease) },
        ];
        let resp = encode_acquire_all(&parts, NOW, false, Invocation::BySha, Encoding::Resp);
        let words = match crate::resp::decode_reply(&resp).unwrap() {
            Reply::Array(items) => items,
            other => panic!("{other:?}"),
        };
        let words: Vec<Vec<u8>> = words
            .into_iter()
            .map(|w| match w {
                Reply::Bulk(bytes) => bytes,
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(words.len(), 3 + 10 + 2 + 26);
        assert_eq!(
            (&words[0][..], &words[1][..], &words[2][..]),
            (&b"EVALSHA"[..], ACQUIRE_ALL.sha().as_bytes(), &b"10"[..])
        );
        assert_eq!(words[9], b"{erl:b}:value".to_vec());
        assert_eq!(words[13], b"1700000000123".to_vec());
        assert_eq!(words[14], b"0".to_vec(), "a limiter's error does not stop the others' charge");
        assert_eq!(words[15], RANDOM.to_vec());
        assert_eq!(words[22..28], [b"0".to_vec(), b"0".to_vec(), vec![], b"0".to_vec(), b"0".to_vec(), b"0".to_vec()]);
        assert_eq!(
            words[35..41],
            [b"64".to_vec(), b"50".to_vec(), vec![b'q'; 16], b"7".to_vec(), b"0".to_vec(), b"0".to_vec()]
        );
        let path =
            String::from_utf8(encode_acquire_all(&parts, NOW, false, Invocation::BySha, Encoding::WebdisPath)).unwrap();
        assert!(
            path.starts_with(&format!("EVALSHA/{}/10/erl%3Aa/", ACQUIRE_ALL.sha())) && path.ends_with("/0/0.raw"),
            "{path}"
        );
    }
}
