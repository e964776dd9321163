//! Reservations of rules with `cost` (docs/configuration.md, "Costs known after the response"): the permit
//! member an allowed request took for its reservation, to settle when its response ends.
//!
//! A reservation's member is an ordinary Redisson permit member; only its random bytes say what it is:
//! they start with [`RESERVED_MARK`] while the response runs and with [`SETTLED_MARK`] once settled
//! (`erl-admin show` lists both). Redisson reads only the permits.

use crate::prelude::*;

use crate::config::{PluginConfig, Reserve, Rule};
use crate::key::{extract, KeyValue, RequestView};
use crate::script::{MemberAt, MEMBER_RANDOM_LEN};

use super::pending::PendingRequest;

/// The first bytes of a reservation's member random (the rest stays random: 14 base-62 characters).
pub const RESERVED_MARK: [u8; 2] = *b"-r";
/// The first bytes of a settled member's random (the reservation's, its mark replaced).
pub const SETTLED_MARK: [u8; 2] = *b"-s";

/// The member an allowed request's rule with `cost` took: what its settlement replaces.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reservation {
    /// The rule entry (configuration index).
    pub rule: usize,
    /// The limiter name.
    pub name: String,
    /// The member's random bytes (starting with [`RESERVED_MARK`]).
    pub random: [u8; MEMBER_RANDOM_LEN],
    /// Permits the member holds.
    pub granted: u64,
    /// Where the acquire wrote the member, when the gateway knows it (settled without reading it back).
    pub at: Option<MemberAt>,
    /// `Some(ms)`: taken from the degraded mode's local window at that time (ms since the epoch), not
    /// from Redis: it settles there ([`crate::fallback`]), by returning what the response did not use.
    pub local_since_ms: Option<u64>,
}

impl Reservation {
    /// A reservation of `granted` permits that the degraded mode's local window of limiter `name` admitted
    /// at `now_ms` for rule `rule` (no member in Redis).
    pub(super) fn local(rule: usize, name: String, granted: u64, now_ms: u64) -> Self {
        Reservation { rule, name, random: [0; MEMBER_RANDOM_LEN], granted, at: None, local_since_ms: Some(now_ms) }
    }

    /// The random bytes of the member once settled: the same, [`SETTLED_MARK`] first.
    pub fn settled_random(&self) -> [u8; MEMBER_RANDOM_LEN] {
        let mut random = self.random;
        if let Some(mark) = random.get_mut(..SETTLED_MARK.len()) {
            mark.copy_from_slice(&SETTLED_MARK);
        }
        random
    }
}

/// Marks new member random bytes as a reservation's.
pub(super) fn mark_reserved(random: &mut [u8; MEMBER_RANDOM_LEN]) {
    if let Some(mark) = random.get_mut(..RESERVED_MARK.len()) {
        mark.copy_from_slice(&RESERVED_MARK);
    }
}

/// The reservations an allowed request holds: its rules with `cost` that took a member of their own.
pub(super) fn reservations(pending: &PendingRequest, config: &PluginConfig) -> Vec<Reservation> {
    pending
        .own_members()
        .filter(|(call, _, _)| config.rules.get(call.rule).is_some_and(|rule| rule.cost.is_some()))
        .map(|(call, granted, at)| Reservation {
            rule: call.rule,
            name: call.name.clone(),
            random: call.member_random,
            granted,
            at,
            local_since_ms: None,
        })
        .collect()
}

/// The permits a request of `rule` asks for: its `permits`, or with `cost.reserve` from a header or a
/// property, its whole number clamped to 1..=rate (its `default` when missing or not a number).
pub(super) fn permits_of(rule: &Rule, request: &impl RequestView) -> u64 {
    let Some(Reserve::From { source, default }) = rule.cost.as_ref().map(|cost| &cost.reserve) else {
        return rule.permits;
    };
    let KeyValue::Value(value) = extract(source, request) else { return *default };
    let asked = core::str::from_utf8(&value).ok().and_then(|text| text.trim().parse::<u64>().ok());
    asked.map_or(*default, |permits| permits.clamp(1, rule.rate))
}
