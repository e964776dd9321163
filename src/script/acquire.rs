//! The acquire command (Redisson `tryAcquire` with trySetRate and, if asked, updateRate: see
//! [`super::ACQUIRE`]): its bytes and its reply.
//!
//! Everything of a rule's command that does not change per request is encoded once, when the filter is
//! configured ([`AcquireTemplate`]): the script's SHA, the argument tail (permits, rate, interval, type,
//! keep-alive, apply flag) in both wire forms, the client id. A request adds its limiter name, time and
//! member bytes into one buffer ([`AcquireTemplate::encode`]); the reply is read without building a
//! generic value in the common cases ([`decode_acquire_reply`]).

use crate::prelude::*;

use crate::config::LimiterType;
use crate::key::LimiterKeys;
use crate::quote::{hex_digit, quoted};
use crate::resp::{decode_integers, decode_reply, Command, Integers, Reply};

use super::{Invocation, Script, ACQUIRE, ACQUIRE_ALL, GIVE_BACK};

/// The hash field where [`super::ACQUIRE`] records the config a rule wrote (`rate_source: config`):
/// `rate:interval:type:keepAliveTime`, next to Redisson's four fields.
pub const RULE_CONFIG_FIELD: &str = "erlRuleConfig";

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
    client_suffix: (Vec<u8>, Vec<u8>),
    /// ARGV 3-8 as they are.
    tail: [Vec<u8>; 6],
    /// ARGV 3-8 as RESP bulk strings.
    resp_tail: Vec<u8>,
    /// ARGV 3-8 in webdis's path form (each with its leading `/`).
    webdis_tail: Vec<u8>,
}

impl AcquireTemplate {
    /// The template of a rule's acquire for this gateway's Redisson client id.
    pub fn new(config: AcquireConfig, client_id: &str) -> Self {
        let tail = [
            config.permits.to_string().into_bytes(),
            config.rate.to_string().into_bytes(),
            config.interval_ms.to_string().into_bytes(),
            config.limiter_type.redisson_ordinal().to_string().into_bytes(),
            config.keep_alive_ms.to_string().into_bytes(),
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
        let mut now_digits = itoa::Buffer::new();
        let now = match clock {
            Clock::Gateway(ms) => now_digits.format(ms).as_bytes(),
            Clock::Redis => b"",
        };
        let (open, close) = if name.contains('{') { ("", "") } else { ("{", "}") };
        match encoding {
            Encoding::Resp => {
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
                push_bulk(&mut out, name.as_bytes());
                let client = &self.client_suffix.0;
                for (suffix, per_client) in
                    [(":value", false), (":value", true), (":permits", false), (":permits", true)]
                {
                    let len = name.len()
                        + open.len()
                        + close.len()
                        + suffix.len()
                        + if per_client { client.len() } else { 0 };
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
                push_bulk(&mut out, now);
                push_bulk(&mut out, random);
                out.extend_from_slice(&self.resp_tail);
                if let Some(lease) = lease {
                    lease.push_args(&mut out, encoding);
                }
                out
            }
            Encoding::WebdisPath => {
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
                // The name, encoded once; the four other keys copy it.
                let start = out.len();
                push_encoded(&mut out, name.as_bytes());
                let name_encoded = start..out.len();
                let (open, close) = if open.is_empty() { ("", "") } else { ("%7B", "%7D") };
                let client = &self.client_suffix.1;
                for (suffix, per_client) in
                    [("%3Avalue", false), ("%3Avalue", true), ("%3Apermits", false), ("%3Apermits", true)]
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
                out.push(b'/');
                out.extend_from_slice(now);
                out.push(b'/');
                push_encoded(&mut out, random);
                out.extend_from_slice(&self.webdis_tail);
                if let Some(lease) = lease {
                    lease.push_args(&mut out, encoding);
                }
                out.extend_from_slice(b".raw");
                out
            }
        }
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
fn clock_arg(clock: Clock) -> Vec<u8> {
    match clock {
        Clock::Gateway(ms) => ms.to_string().into_bytes(),
        Clock::Redis => Vec::new(),
    }
}

/// A lease an acquire asks for (README.md, "Leases"): ARGV 9-14 of [`super::ACQUIRE`], 8-13 of a limiter
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

/// What a lease (or a rejected request's permits) leaves in Redis: the member `(random, granted)` becomes
/// `(random, used)` scored `early_ms` earlier, and the `granted - used` permits go back to the value
/// (prelude `giveBack`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Settlement {
    /// The member's random bytes.
    pub random: [u8; MEMBER_RANDOM_LEN],
    /// Permits the member holds.
    pub granted: u64,
    /// Permits really used (0: the member goes).
    pub used: u64,
    /// How long before the member's score the last use was, ms.
    pub early_ms: u64,
}

impl Settlement {
    /// The four arguments: random, granted, used, early (ms).
    fn args(&self) -> [Vec<u8>; 4] {
        [
            self.random.to_vec(),
            self.granted.to_string().into_bytes(),
            self.used.to_string().into_bytes(),
            self.early_ms.to_string().into_bytes(),
        ]
    }

    /// The bytes of the [`super::GIVE_BACK`] command for limiter `name` (with this gateway's Redisson
    /// client id, as `template` has it).
    pub fn encode(
        &self,
        name: &str,
        template: &AcquireTemplate,
        invocation: Invocation,
        encoding: Encoding,
    ) -> Vec<u8> {
        let args = self.args();
        let mut out = Vec::with_capacity(256);
        let mut writer = ArgWriter::new(&mut out, encoding, 2 + 1 + 5 + args.len());
        writer.script(&GIVE_BACK, invocation, 1);
        writer.keys(name, template);
        for arg in &args {
            writer.arg(arg);
        }
        writer.finish();
        out
    }
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
    let mut out = Vec::with_capacity(512 * parts.len());
    let mut writer = ArgWriter::new(&mut out, encoding, 3 + parts.len() * (5 + 13) + 2);
    writer.script(&ACQUIRE_ALL, invocation, parts.len());
    for part in parts {
        writer.keys(part.name, part.template);
    }
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
    out
}

/// Writes a script call argument by argument in either wire form.
struct ArgWriter<'a> {
    out: &'a mut Vec<u8>,
    encoding: Encoding,
    first: bool,
}

impl<'a> ArgWriter<'a> {
    /// A call of `count` words (the RESP array header is written now).
    fn new(out: &'a mut Vec<u8>, encoding: Encoding, count: usize) -> Self {
        if encoding == Encoding::Resp {
            push_length(out, b'*', count);
        }
        ArgWriter { out, encoding, first: true }
    }

    fn arg(&mut self, bytes: &[u8]) {
        if self.encoding == Encoding::WebdisPath && self.first {
            // webdis's path starts with the command, without a `/`.
            self.out.extend_from_slice(bytes);
        } else {
            push_arg(self.out, self.encoding, bytes);
        }
        self.first = false;
    }

    /// `EVALSHA <sha>` or `EVAL <source>`, and the number of keys of `limiters` limiters.
    fn script(&mut self, script: &Script, invocation: Invocation, limiters: usize) {
        match invocation {
            Invocation::BySha => {
                self.arg(b"EVALSHA");
                self.arg(script.sha().as_bytes());
            }
            Invocation::BySource => {
                self.arg(b"EVAL");
                self.arg(script.source.as_bytes());
            }
        }
        self.arg(itoa::Buffer::new().format(5 * limiters).as_bytes());
    }

    /// The five keys of limiter `name` ([`LimiterKeys`]) with `template`'s client id.
    fn keys(&mut self, name: &str, template: &AcquireTemplate) {
        let (open, close) = if name.contains('{') { ("", "") } else { ("{", "}") };
        self.arg(name.as_bytes());
        let mut key = Vec::with_capacity(name.len() + 64);
        for (suffix, per_client) in [(":value", false), (":value", true), (":permits", false), (":permits", true)] {
            key.clear();
            for part in [open, name, close, suffix] {
                key.extend_from_slice(part.as_bytes());
            }
            if per_client {
                key.extend_from_slice(&template.client_suffix.0);
            }
            self.arg(&key);
        }
    }

    fn finish(self) {
        if self.encoding == Encoding::WebdisPath {
            self.out.extend_from_slice(b".raw");
        }
    }
}

/// One argument in the wire form: a RESP bulk string, or `/` and the percent-encoded bytes.
fn push_arg(out: &mut Vec<u8>, encoding: Encoding, bytes: &[u8]) {
    match encoding {
        Encoding::Resp => push_bulk(out, bytes),
        Encoding::WebdisPath => {
            out.push(b'/');
            push_encoded(out, bytes);
        }
    }
}

/// `<kind><n>\r\n`.
fn push_length(out: &mut Vec<u8>, kind: u8, n: usize) {
    out.push(kind);
    out.extend_from_slice(itoa::Buffer::new().format(n).as_bytes());
    out.extend_from_slice(b"\r\n");
}

/// One RESP bulk string.
fn push_bulk(out: &mut Vec<u8>, bytes: &[u8]) {
    push_length(out, b'$', bytes.len());
    out.extend_from_slice(bytes);
    out.extend_from_slice(b"\r\n");
}

/// Percent-encoded as webdis's path arguments need: everything but ASCII letters and digits, as
/// `percent_encode(bytes, NON_ALPHANUMERIC)` does (the unit tests compare the two), one byte at a time.
fn push_encoded(out: &mut Vec<u8>, bytes: &[u8]) {
    // Room for the worst case, then each byte written in place and the rest cut off: no capacity check
    // per byte (README.md, "Lean guest").
    let start = out.len();
    out.resize(start + 3 * bytes.len(), 0);
    let mut at = start;
    for &byte in bytes {
        if byte.is_ascii_alphanumeric() {
            if let Some(slot) = out.get_mut(at) {
                *slot = byte;
            }
            at += 1;
        } else {
            if let Some(slot) = out.get_mut(at..at + 3) {
                slot.copy_from_slice(&[b'%', hex_digit(byte >> 4, b'A'), hex_digit(byte, b'A')]);
            }
            at += 3;
        }
    }
    out.truncate(at);
}

/// A limiter's config as Redis holds it (which may differ from the plugin configuration: Redis wins).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EffectiveConfig {
    /// Permits per interval.
    pub rate: u64,
    /// Interval, ms.
    pub interval_ms: u64,
    /// Overall or per client.
    pub limiter_type: LimiterType,
}

/// What the acquire decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AcquireOutcome {
    /// The permits were taken; `remaining` permits are left in the window.
    Acquired {
        /// Permits left.
        remaining: u64,
    },
    /// Not enough permits; Redisson's delay until the oldest permit is released, ms.
    Rejected {
        /// Delay, ms (Redisson: `3 + interval - (now - oldest acquire time)`).
        delay_ms: u64,
    },
    /// More permits requested than the limiter's rate: no wait will ever grant them.
    ExceedsRate,
    /// [`super::ACQUIRE_ALL`] only: this limiter had the permits, but another limiter of the call rejected,
    /// so none were taken.
    Untaken {
        /// Permits free.
        available: u64,
    },
}

/// The decoded reply of the acquire script.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AcquireReply {
    /// The decision.
    pub outcome: AcquireOutcome,
    /// Permits available in the window after the call, when the reply says (the remaining permits when
    /// acquired; for a rejection only the full reply carries it: the short one says only the delay).
    pub available: Option<u64>,
    /// The limiter's config in Redis, when it is not the one the command carried (`None`: the same).
    pub effective: Option<EffectiveConfig>,
    /// Whether this call wrote the limiter's config.
    pub change: ConfigChange,
    /// Permits the acquire took, when the reply says (a lease's size; `None`: the permits asked).
    pub granted: Option<u64>,
}

/// What an acquire did to the limiter's config.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConfigChange {
    /// Nothing: the limiter existed and was used as it is.
    None,
    /// The limiter did not exist and was created (trySetRate).
    Created,
    /// Redis held another config the rule had written, replaced keeping state (updateRate), as asked.
    Updated,
    /// Redis holds a config someone else wrote over the rule's (an operator, a Java service): it stands.
    Kept,
}

/// Why a reply is not an acquire decision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReplyError {
    /// `-NOSCRIPT`: Redis does not have the script cached; send it again by source.
    NoScript,
    /// Any other Redis error reply, e.g. `NOAUTH Authentication required.` or a Lua error.
    Redis(String),
    /// A reply the script cannot produce (wrong shape or values).
    Unexpected(String),
}

impl core::fmt::Display for ReplyError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            ReplyError::NoScript => write!(f, "Redis does not have the acquire script (NOSCRIPT)"),
            ReplyError::Redis(text) => write!(f, "Redis error: {text}"),
            ReplyError::Unexpected(what) => {
                write!(f, "unexpected reply to the acquire script: {what}")
            }
        }
    }
}

/// A reply in a few words for an error message (its content quoted, never raw).
fn describe(reply: &Reply) -> String {
    match reply {
        Reply::Simple(text) => format!("simple string {}", quoted(text)),
        Reply::Error(text) => format!("error {}", quoted(text)),
        Reply::Integer(value) => format!("integer {value}"),
        Reply::Bulk(bytes) => format!("bulk string {}", quoted(bytes)),
        Reply::Array(items) => format!("array of {} elements", items.len()),
        Reply::Null => "null".to_string(),
    }
}

/// Decodes the acquire script's reply (raw RESP bytes; webdis re-encodes integers inside arrays as bulk
/// strings of digits, which read the same):
///
/// ```text
/// :4                                          acquired, 4 permits left (config as sent)
/// :-1503                                      rejected: Redisson's delay 1503 ms (config as sent)
/// *2 remaining taken                          a lease call acquired `taken` permits (config as sent)
/// *8 code amount available rate interval type change taken
///                                             the config in Redis differs from the one sent, or was written
/// ```
///
/// `code` 1 = acquired (`amount` = permits left), 0 = rejected (`amount` = Redisson's delay in ms), 2 =
/// more permits than the rate. `change`: 0 none, 1 created, 2 updated, 3 kept. `taken`: permits taken.
///
/// # Errors
/// [`ReplyError::NoScript`] for `-NOSCRIPT`, [`ReplyError::Redis`] for other error replies,
/// [`ReplyError::Unexpected`] for anything else (not RESP, another shape or values).
pub fn decode_acquire_reply(bytes: &[u8]) -> Result<AcquireReply, ReplyError> {
    let mut numbers = [0i64; FULL_REPLY];
    match decode_integers(bytes, &mut numbers) {
        // A bare integer, the config as sent: the permits left, or minus the delay.
        Some(Integers::Bare) => {
            let [value, ..] = numbers;
            let (outcome, available) = if value >= 0 {
                (AcquireOutcome::Acquired { remaining: value.unsigned_abs() }, Some(value.unsigned_abs()))
            } else {
                (AcquireOutcome::Rejected { delay_ms: value.unsigned_abs() }, None)
            };
            Ok(AcquireReply { outcome, available, effective: None, change: ConfigChange::None, granted: None })
        }
        // A lease call, the config as sent: the permits left and those taken.
        Some(Integers::Array(2)) => {
            let [remaining, taken, ..] = numbers;
            let remaining = non_negative(remaining, "remaining permits")?;
            Ok(AcquireReply {
                outcome: AcquireOutcome::Acquired { remaining },
                available: Some(remaining),
                effective: None,
                change: ConfigChange::None,
                granted: Some(non_negative(taken, "permits taken")?),
            })
        }
        Some(Integers::Array(FULL_REPLY)) => decode_full(&numbers),
        Some(Integers::Array(other)) => Err(ReplyError::Unexpected(format!("an array of {other} elements"))),
        None => Err(error_of(bytes)),
    }
}

/// One limiter's part of an [`super::ACQUIRE_ALL`] reply: its decision, or the Redis error its keys raised
/// (e.g. `WRONGTYPE ...`: the limiter's config key is not a hash).
pub type LimiterReply = Result<AcquireReply, String>;

/// Decodes the reply of [`super::ACQUIRE_ALL`] over `limiters` limiters: the full form of
/// [`decode_acquire_reply`] for each (8 integers), in order, `code` 3 = had the permits but took none
/// ([`AcquireOutcome::Untaken`]), `code` 4 = a Redis error on this limiter's keys (its other integers 0),
/// then one bulk string per limiter of code 4, in order: its error.
///
/// ```text
/// *16 :1 :4 :4 :5 :2000 :0 :0 :1  :1 :8 :8 :9 :60000 :0 :0 :1        both acquired
/// *17 :4 :0 :0 :0 :0 :0 :0 :0  :1 :8 ...  $73 WRONGTYPE Operation...  the first limiter's keys failed
/// ```
///
/// # Errors
/// As [`decode_acquire_reply`] (an error reply is the whole call's); another shape, or an error count
/// that does not match the codes 4, is [`ReplyError::Unexpected`].
pub fn decode_acquire_all_reply(bytes: &[u8], limiters: usize) -> Result<Vec<LimiterReply>, ReplyError> {
    let mut numbers = vec![0i64; FULL_REPLY * limiters];
    let errors: Vec<String> = match decode_integers(bytes, &mut numbers) {
        Some(Integers::Array(count)) if count == numbers.len() => Vec::new(),
        Some(_) => return Err(ReplyError::Unexpected(format!("not {} integers", numbers.len()))),
        None => match decode_reply(bytes) {
            Ok(Reply::Array(items)) if items.len() > numbers.len() => {
                let (head, tail) = items.split_at(numbers.len());
                for (slot, item) in numbers.iter_mut().zip(head) {
                    *slot = integer_of(item).ok_or_else(|| ReplyError::Unexpected(describe(item)))?;
                }
                tail.iter()
                    .map(|item| match item {
                        Reply::Bulk(text) => Ok(core::str::from_utf8(text).unwrap_or("(not UTF-8)").into()),
                        other => Err(ReplyError::Unexpected(describe(other))),
                    })
                    .collect::<Result<_, _>>()?
            }
            Ok(Reply::Array(_)) => return Err(ReplyError::Unexpected(format!("not {} integers", numbers.len()))),
            _ => return Err(error_of(bytes)),
        },
    };
    let failed = numbers.chunks_exact(FULL_REPLY).filter(|n| n.first() == Some(&LIMITER_ERROR)).count();
    if failed != errors.len() {
        return Err(ReplyError::Unexpected(format!("{failed} limiter error(s) and {} error text(s)", errors.len())));
    }
    let mut errors = errors.into_iter();
    numbers
        .chunks_exact(FULL_REPLY)
        .map(|numbers| match numbers.first() {
            Some(&LIMITER_ERROR) => Ok(Err(errors.next().unwrap_or_default())),
            _ => decode_full(numbers).map(Ok),
        })
        .collect()
}

/// The code of a limiter whose keys raised a Redis error in [`super::ACQUIRE_ALL`].
const LIMITER_ERROR: i64 = 4;

/// An integer reply, or a bulk string of decimal digits (webdis's form of an integer inside an array).
fn integer_of(item: &Reply) -> Option<i64> {
    match item {
        Reply::Integer(value) => Some(*value),
        Reply::Bulk(bytes) => core::str::from_utf8(bytes).ok().filter(|t| !t.starts_with('+'))?.parse().ok(),
        _ => None,
    }
}

/// Integers in a full reply: code, amount, available, rate, interval, type, change, taken.
const FULL_REPLY: usize = 8;

/// Why a reply that is not made of integers is no decision.
fn error_of(bytes: &[u8]) -> ReplyError {
    match decode_reply(bytes) {
        Ok(reply @ Reply::Error(_)) if reply.error_code() == Some("NOSCRIPT") => ReplyError::NoScript,
        Ok(Reply::Error(text)) => ReplyError::Redis(text),
        Ok(other) => ReplyError::Unexpected(describe(&other)),
        Err(error) => ReplyError::Unexpected(error.to_string()),
    }
}

fn non_negative(value: i64, what: &str) -> Result<u64, ReplyError> {
    u64::try_from(value).map_err(|_| ReplyError::Unexpected(format!("negative {what}: {value}")))
}

/// One full reply: `code amount available rate interval type change taken`.
fn decode_full(numbers: &[i64]) -> Result<AcquireReply, ReplyError> {
    let &[code, amount, available, rate, interval, limiter_type, change, taken] = numbers else {
        return Err(ReplyError::Unexpected(format!("{} integers", numbers.len())));
    };
    // A value below zero (a rate lowered under the permits in the window) is no permit available.
    let available = u64::try_from(available).unwrap_or(0);
    let outcome = match code {
        1 => AcquireOutcome::Acquired { remaining: non_negative(amount, "remaining permits")? },
        0 => AcquireOutcome::Rejected { delay_ms: non_negative(amount, "delay")? },
        2 => AcquireOutcome::ExceedsRate,
        3 => AcquireOutcome::Untaken { available },
        other => return Err(ReplyError::Unexpected(format!("outcome code {other}"))),
    };
    let limiter_type = LimiterType::from_redisson_ordinal(limiter_type)
        .ok_or_else(|| ReplyError::Unexpected(format!("limiter type {limiter_type}")))?;
    Ok(AcquireReply {
        outcome,
        available: Some(available),
        effective: Some(EffectiveConfig {
            rate: non_negative(rate, "rate")?,
            interval_ms: non_negative(interval, "interval")?,
            limiter_type,
        }),
        change: match change {
            0 => ConfigChange::None,
            1 => ConfigChange::Created,
            2 => ConfigChange::Updated,
            3 => ConfigChange::Kept,
            other => return Err(ReplyError::Unexpected(format!("config change code {other}"))),
        },
        granted: (code == 1).then(|| non_negative(taken, "permits taken")).transpose()?,
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing, clippy::panic)]
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn template() -> AcquireTemplate {
        let config = AcquireConfig {
            permits: 2,
            rate: 10,
            interval_ms: 60_000,
            limiter_type: LimiterType::PerClient,
            keep_alive_ms: 3_600_000,
            apply_config: false,
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
        let settle = Settlement { random: [b'z'; MEMBER_RANDOM_LEN], granted: 64, used: 9, early_ms: 31 };
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
        let settle = Settlement { random: [b'q'; MEMBER_RANDOM_LEN], granted: 7, used: 0, early_ms: 0 };
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

    #[test]
    fn every_byte_is_percent_encoded_as_the_percent_encoding_crate_does() {
        let all: Vec<u8> = (0..=255).collect();
        let mut ours = Vec::new();
        push_encoded(&mut ours, &all);
        let theirs: String = percent_encoding::percent_encode(&all, percent_encoding::NON_ALPHANUMERIC).collect();
        assert_eq!(String::from_utf8(ours).unwrap(), theirs);
    }

    #[test]
    fn replies_decode_from_integers_or_webdis_bulk_strings() {
        let acquired = decode_acquire_reply(b":8\r\n").unwrap();
        assert_eq!(acquired.outcome, AcquireOutcome::Acquired { remaining: 8 });
        assert_eq!((acquired.available, acquired.effective, acquired.change), (Some(8), None, ConfigChange::None));
        let rejected = decode_acquire_reply(b":-1503\r\n").unwrap();
        assert_eq!((rejected.outcome, rejected.available), (AcquireOutcome::Rejected { delay_ms: 1503 }, None));
        let webdis = decode_acquire_reply(
            b"*8\r\n$1\r\n0\r\n$4\r\n1503\r\n$2\r\n-1\r\n$1\r\n3\r\n$4\r\n2000\r\n$1\r\n0\r\n$1\r\n3\r\n$1\r\n0\r\n",
        )
        .unwrap();
        assert_eq!((webdis.outcome, webdis.available), (AcquireOutcome::Rejected { delay_ms: 1503 }, Some(0)));
        assert_eq!(webdis.change, ConfigChange::Kept);
        let full = decode_acquire_reply(b"*8\r\n:1\r\n:8\r\n:8\r\n:10\r\n:60000\r\n:1\r\n:1\r\n:1\r\n").unwrap();
        assert_eq!(
            full,
            AcquireReply {
                outcome: AcquireOutcome::Acquired { remaining: 8 },
                available: Some(8),
                effective: Some(EffectiveConfig {
                    rate: 10,
                    interval_ms: 60_000,
                    limiter_type: LimiterType::PerClient
                }),
                change: ConfigChange::Created,
                granted: Some(1),
            }
        );
        let exceeds = decode_acquire_reply(b"*8\r\n:2\r\n:0\r\n:0\r\n:1\r\n:60000\r\n:0\r\n:0\r\n:0\r\n").unwrap();
        assert_eq!(exceeds.outcome, AcquireOutcome::ExceedsRate);
    }

    #[test]
    fn a_combined_reply_carries_each_limiters_error_after_the_integers() {
        let both = b"*16\r\n:1\r\n:4\r\n:4\r\n:5\r\n:2000\r\n:0\r\n:0\r\n:1\r\n:3\r\n:8\r\n:8\r\n:9\r\n:60000\r\n:0\r\n:0\r\n:0\r\n";
        let replies = decode_acquire_all_reply(both, 2).unwrap();
        assert_eq!(replies[0].as_ref().unwrap().outcome, AcquireOutcome::Acquired { remaining: 4 });
        assert_eq!(replies[1].as_ref().unwrap().outcome, AcquireOutcome::Untaken { available: 8 });
        // webdis re-encodes the integers as bulk strings and keeps the error text as it is.
        let error = "WRONGTYPE Operation against a key holding the wrong kind of value";
        let mut broken = b"*17\r\n".to_vec();
        for number in ["4", "0", "0", "0", "0", "0", "0", "0", "1", "8", "8", "9", "60000", "0", "0", "1"] {
            broken.extend_from_slice(format!("${}\r\n{number}\r\n", number.len()).as_bytes());
        }
        broken.extend_from_slice(format!("${}\r\n{error}\r\n", error.len()).as_bytes());
        let replies = decode_acquire_all_reply(&broken, 2).unwrap();
        assert_eq!(replies[0], Err(error.to_string()), "the first limiter's keys failed");
        assert_eq!(
            replies[1].as_ref().unwrap().outcome,
            AcquireOutcome::Acquired { remaining: 8 },
            "the other decided"
        );
        // A code 4 without its text, or a text without a code 4, is no reply the script gives.
        let mut missing = broken.clone();
        missing.truncate(broken.len() - error.len() - 6);
        missing[1..3].copy_from_slice(b"16");
        assert!(matches!(decode_acquire_all_reply(&missing, 2), Err(ReplyError::Unexpected(_))));
        let mut extra = both.to_vec();
        extra[1..3].copy_from_slice(b"17");
        extra.extend_from_slice(b"$3\r\nERR\r\n");
        assert!(matches!(decode_acquire_all_reply(&extra, 2), Err(ReplyError::Unexpected(_))));
        assert_eq!(
            decode_acquire_all_reply(b"-ERR whole call\r\n", 2),
            Err(ReplyError::Redis("ERR whole call".into())),
            "an error reply is the whole call's"
        );
    }

    #[test]
    fn error_and_malformed_replies_are_typed() {
        assert_eq!(
            decode_acquire_reply(b"-NOSCRIPT No matching script. Please use EVAL.\r\n"),
            Err(ReplyError::NoScript)
        );
        assert_eq!(
            decode_acquire_reply(b"-NOAUTH Authentication required.\r\n"),
            Err(ReplyError::Redis("NOAUTH Authentication required.".into()))
        );
        for bad in [
            &b"$-1\r\n"[..],
            b"*6\r\n:1\r\n:1\r\n:1\r\n:1\r\n:1\r\n:1\r\n",
            b"*3\r\n:0\r\n:1\r\n:1\r\n",
            b"*7\r\n:1\r\n:1\r\n:1\r\n:1\r\n:1\r\n:0\r\n:0\r\n",
            b"*8\r\n:5\r\n:1\r\n:1\r\n:1\r\n:1\r\n:0\r\n:0\r\n:0\r\n",
            b"*8\r\n:1\r\n:-1\r\n:1\r\n:1\r\n:1\r\n:0\r\n:0\r\n:1\r\n",
            b"*8\r\n:1\r\n:1\r\n:1\r\n:1\r\n:1\r\n:7\r\n:0\r\n:1\r\n",
            b"*2\r\n:4\r\n:-1\r\n",
            b"<html>",
            b"*3\r\n$1\r\nx\r\n:1\r\n:1\r\n",
        ] {
            assert!(
                matches!(decode_acquire_reply(bad), Err(ReplyError::Unexpected(_))),
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
    }
}
