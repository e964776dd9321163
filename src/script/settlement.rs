//! How one permit member is settled ([`Settlement`], prelude `giveBack`): a lease's settlement, a rejected
//! request's permits given back, a reservation settled at its real cost; and where the member is
//! ([`MemberAt`]), which spares Redis reading it back.

use crate::prelude::*;

use crate::config::LimiterType;

use super::acquire::{AcquireTemplate, Clock, Encoding, MEMBER_RANDOM_LEN};
use super::batch::{Layout, SegmentScript};
use super::wire::{push_arg, ArgWriter};
use super::{Invocation, GIVE_BACK};

/// How one permit member is settled (prelude `giveBack`): the member `(random, granted)` becomes
/// `(renamed or random, used)` scored `early_ms` earlier (removed when `used` is 0), and the value changes
/// by `granted - used` permits: unused ones go back (never above the rate), an excess (`used > granted`)
/// is charged, even below zero (then every acquire is rejected until enough permits left the window). So
/// the value plus the permits of the members in the window stays the rate. A member that already left the
/// window, or is unknown, is not found: nothing changes.
///
/// Uses: a lease's settlement (inside [`super::ACQUIRE`] / [`super::ACQUIRE_ALL`] as [`LeaseRequest::settle`],
/// or alone as [`super::GIVE_BACK`]), a rejected request's permits given back (`used` 0), and a
/// reservation settled at its real cost ("reserve, then settle": `granted` reserved at the request,
/// `used` the cost known when the response ends, `early_ms` 0, `renamed` the settled member's random).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Settlement {
    /// The member's random bytes.
    pub random: [u8; MEMBER_RANDOM_LEN],
    /// Permits the member holds.
    pub granted: u64,
    /// Permits really used (0: the member goes; more than `granted`: the excess is charged). At most
    /// `u32::MAX`: a member carries its permits in 4 bytes (Redisson's `Bc0I`).
    pub used: u64,
    /// How long before the member's score the last use was, ms (0: the member keeps its score).
    pub early_ms: u64,
    /// The random bytes of the member that stays, when they change (`None`: `random`): so a settled
    /// member can be told from a reservation in Redis. Sent as [`super::GIVE_BACK`]'s `ARGV[5]` only;
    /// a settlement inside [`super::ACQUIRE`] / [`super::ACQUIRE_ALL`] (a lease's) has no place for it
    /// and keeps `random`.
    pub renamed: Option<[u8; MEMBER_RANDOM_LEN]>,
    /// Where the acquire wrote the member, when the gateway knows it (`None`: GIVE_BACK reads the config
    /// hash and the member's score). Sent as [`super::GIVE_BACK`]'s `ARGV[6..=8]` only.
    pub at: Option<MemberAt>,
}

/// Where an acquire wrote a permit member, as the gateway knows it from the call and its reply: what lets
/// [`super::GIVE_BACK`] settle it without reading the limiter's config hash or the member's score.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemberAt {
    /// The member's score, ms since the epoch: the acquire's `now` on the gateway's clock ([`Clock::Gateway`];
    /// with [`Clock::Redis`] the gateway does not know it).
    pub score_ms: u64,
    /// The limiter's rate when it was acquired (permits per interval): the cap on permits given back.
    pub rate: u64,
    /// The limiter's type when it was acquired: which value and permits keys hold the member.
    pub limiter_type: LimiterType,
    /// A sliding window counter's slice width, ms (its interval / [`crate::config::COUNTER_SLICES`], at
    /// least 1): the permits are in the slice of `score_ms` (no member), sent as type `2` and `ARGV[9]`.
    /// `None`: a sliding log's member.
    pub counter_slice_ms: Option<u64>,
}

impl MemberAt {
    /// Where a member acquired with `clock` went in a limiter of `rate` and `limiter_type`: known only on
    /// the gateway's clock.
    pub fn of(clock: Clock, rate: u64, limiter_type: LimiterType) -> Option<MemberAt> {
        match clock {
            Clock::Gateway(score_ms) => Some(MemberAt { score_ms, rate, limiter_type, counter_slice_ms: None }),
            Clock::Redis => None,
        }
    }
}

impl Settlement {
    /// The four arguments every settlement has: random, granted, used (permits), early (ms).
    pub(super) fn args(&self) -> [Vec<u8>; 4] {
        [
            self.random.to_vec(),
            self.granted.to_string().into_bytes(),
            self.used.to_string().into_bytes(),
            self.early_ms.to_string().into_bytes(),
        ]
    }

    /// The suffix of its limiter's second key: a sliding window counter's `:counter` (the permits are in
    /// its hash), else `:value`.
    pub(super) fn value_suffix(&self) -> &'static str {
        match self.at {
            Some(MemberAt { counter_slice_ms: Some(_), .. }) => ":counter",
            _ => ":value",
        }
    }

    /// How many arguments [`super::GIVE_BACK`] takes for it: [`Settlement::args`], `renamed` if any (empty
    /// when `at` follows without it), and `at`'s three.
    pub(super) fn give_back_arg_count(&self) -> usize {
        match self.at {
            Some(MemberAt { counter_slice_ms: Some(_), .. }) => 9,
            Some(_) => 8,
            None => 4 + usize::from(self.renamed.is_some()),
        }
    }

    /// [`super::GIVE_BACK`]'s arguments in the wire form, written in place: random, granted, used,
    /// early (ms), then `renamed` if any (`ARGV[5]`), then `at`'s score, rate and type (`ARGV[6..=8]`).
    pub(super) fn push_give_back_args(&self, out: &mut Vec<u8>, encoding: Encoding) {
        let mut digits = itoa::Buffer::new();
        push_arg(out, encoding, &self.random);
        push_arg(out, encoding, digits.format(self.granted).as_bytes());
        push_arg(out, encoding, digits.format(self.used).as_bytes());
        push_arg(out, encoding, digits.format(self.early_ms).as_bytes());
        match (&self.renamed, self.at) {
            (Some(renamed), _) => push_arg(out, encoding, renamed),
            (None, Some(_)) => push_arg(out, encoding, b""),
            (None, None) => {}
        }
        if let Some(at) = self.at {
            push_arg(out, encoding, digits.format(at.score_ms).as_bytes());
            push_arg(out, encoding, digits.format(at.rate).as_bytes());
            match at.counter_slice_ms {
                Some(slice_ms) => {
                    push_arg(out, encoding, super::acquire::COUNTER_TYPE);
                    push_arg(out, encoding, digits.format(slice_ms).as_bytes());
                }
                None => push_arg(out, encoding, digits.format(at.limiter_type.redisson_ordinal()).as_bytes()),
            }
        }
    }

    /// The bytes of the [`super::GIVE_BACK`] command for limiter `name` (with this gateway's Redisson
    /// client id, as `template` has it): `ARGV` random, granted, used, early (ms), and `renamed` when
    /// `Some`.
    pub fn encode(
        &self,
        name: &str,
        template: &AcquireTemplate,
        invocation: Invocation,
        encoding: Encoding,
    ) -> Vec<u8> {
        self.encode_laid_out(name, template, invocation, encoding).0
    }

    /// [`Settlement::encode`], with where its keys and arguments are: what a batch of settles
    /// ([`super::ACQUIRE_BATCH`], segment script 3) needs of it without reading it again.
    pub fn encode_laid_out(
        &self,
        name: &str,
        template: &AcquireTemplate,
        invocation: Invocation,
        encoding: Encoding,
    ) -> (Vec<u8>, Layout) {
        let arg_count = self.give_back_arg_count();
        let mut out = Vec::with_capacity(256);
        let mut writer = ArgWriter::new(&mut out, encoding, 2 + 1 + 5 + arg_count);
        writer.script(&GIVE_BACK, invocation, 1);
        let keys_start = writer.position();
        super::wire::push_keys(writer.out(), encoding, name, template, self.value_suffix());
        let keys_end = writer.position();
        self.push_give_back_args(writer.out(), encoding);
        writer.finish();
        let layout = Layout { script: SegmentScript::GiveBack, keys: keys_start..keys_end, key_count: 5, arg_count };
        (out, layout)
    }
}
