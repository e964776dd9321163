//! This VM's permit leases (README.md, "Leases"): per limiter name, the lease Redis granted, whether a
//! lease acquire is on its way, and how many permits the next lease asks for: what the last one served in
//! its age (twice that when it was used up, up to `max_permits`), so a VM with little traffic on a limiter
//! holds few of its permits.
//!
//! A lease serves the limiter's requests from its permits until `expires_ms` (its acquire's send time plus
//! the rule's `max_age`: never after its member's score in Redis, so every use falls inside the window
//! that member covers). When it is used up or expired, the next request's acquire asks for a new lease and
//! settles the old one in the same call: the member keeps the permits used, scored at the last use, and
//! the rest return to the limiter.
//!
//! Per VM, not shared between the VMs of a process: a shared lease would cost two shared-data hostcalls and
//! a compare-and-swap per request, and saves round trips only where one VM's traffic cannot use a lease
//! within `max_age` (README.md, "Leases", measured in `make bench`).
//!
//! Memory: [`LeaseTable::SLOTS`] slots, one per value of the name's FNV-1a hash modulo that; a limiter
//! takes its slot from another (leases are for a few hot limiters): a lease dropped unsettled keeps its
//! unused permits from others until its member leaves the window.

use crate::prelude::*;

use core::cell::{RefCell, RefMut};

use crate::block::{fnv1a, same_bytes};
use crate::script::{Settlement, MEMBER_RANDOM_LEN};

/// A lease Redis granted this VM ([`Leases`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseGrant {
    /// Its member's random bytes.
    pub random: [u8; MEMBER_RANDOM_LEN],
    /// Permits it holds in Redis.
    pub granted: u64,
    /// Permits used so far (the request that asked for it took its own).
    pub used: u64,
    /// Until when it serves requests, ms since the epoch (gateway clock): its acquire's send time plus the
    /// rule's `max_age`, never after its member's score.
    pub expires_ms: u64,
    /// When it was last used, ms since the epoch (gateway clock).
    pub last_use_ms: u64,
    /// Permits Redis had left after granting it (for the headers).
    pub redis_remaining: u64,
}

impl LeaseGrant {
    /// What settling it tells Redis: the permits used, and how early the last use came.
    pub fn settlement(&self) -> Settlement {
        Settlement {
            random: self.random,
            granted: self.granted,
            used: self.used,
            early_ms: self.expires_ms.saturating_sub(self.last_use_ms),
        }
    }
}

/// Where a request finds this VM's permit leases (README.md, "Leases").
pub trait Leases {
    /// Takes `permits` from the live lease of limiter `name` at `now_ms` (before its expiry): the permits
    /// left (the lease's and Redis's at its grant), if taken.
    fn take(&self, name: &str, now_ms: u64, permits: u64) -> Option<u64>;
    /// Puts back `permits` taken from the lease of `name` by a request that does not go on.
    fn put_back(&self, name: &str, permits: u64);
    /// Starts a lease acquire of `name` at `now_ms` whose reply is due by `due_ms`, for a rule leasing up to
    /// `max_permits` and taking `permits` per request: `None` if one is on its way already (the request
    /// waits for it), else how many permits to ask for and the previous lease to settle in the same call (it
    /// serves no request any more), if any.
    fn begin(&self, name: &str, now_ms: u64, due_ms: u64, max_permits: u64, permits: u64) -> Option<LeaseAsk>;
}

/// What a lease acquire asks for ([`Leases::begin`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseAsk {
    /// Permits to ask for (more than the rule's permits, at most its `max_permits`).
    pub want: u64,
    /// The previous lease to settle, if any.
    pub settle: Option<Settlement>,
}

/// One limiter's lease state.
#[derive(Debug, Clone, Copy, Default)]
struct Entry {
    /// The lease held, if any (live or waiting to be settled).
    grant: Option<LeaseGrant>,
    /// Until when a lease acquire counts as on its way, ms (its reply's deadline).
    in_flight_until_ms: u64,
    /// Permits the next lease asks for (0: not asked yet, `max_permits`).
    want: u64,
}

/// The leases of one VM, by limiter name.
#[derive(Debug)]
pub struct LeaseTable {
    slots: RefCell<Vec<Option<(String, Entry)>>>,
}

impl Default for LeaseTable {
    fn default() -> Self {
        LeaseTable { slots: RefCell::new(vec![None; Self::SLOTS]) }
    }
}

impl LeaseTable {
    /// Slots: how many limiters' leases a VM keeps at most.
    pub const SLOTS: usize = 64;

    fn slot(name: &str) -> usize {
        (fnv1a(name.as_bytes()) % Self::SLOTS as u64) as usize
    }

    /// The entry of `name`: the one its slot holds, or with `claim` a new one taking the slot from another
    /// limiter.
    fn entry(&self, name: &str, claim: bool) -> Option<RefMut<'_, Entry>> {
        let slot = Self::slot(name);
        RefMut::filter_map(self.slots.borrow_mut(), |slots| {
            let held = slots.get_mut(slot)?;
            if !matches!(held, Some((n, _)) if same_bytes(n.as_bytes(), name.as_bytes())) {
                if !claim {
                    return None;
                }
                *held = Some((name.into(), Entry::default()));
            }
            held.as_mut().map(|(_, entry)| entry)
        })
        .ok()
    }

    /// A lease acquire of `name` ended: records the lease Redis granted, if any.
    pub fn end(&self, name: &str, grant: Option<LeaseGrant>) {
        if let Some(mut entry) = self.entry(name, grant.is_some()) {
            entry.in_flight_until_ms = 0;
            if grant.is_some() {
                entry.grant = grant;
            }
        }
    }
}

impl Leases for LeaseTable {
    fn take(&self, name: &str, now_ms: u64, permits: u64) -> Option<u64> {
        let mut entry = self.entry(name, false)?;
        let grant = entry.grant.as_mut()?;
        let left = grant.granted.checked_sub(grant.used)?;
        if now_ms >= grant.expires_ms || left < permits {
            return None;
        }
        grant.used += permits;
        grant.last_use_ms = grant.last_use_ms.max(now_ms);
        Some(grant.redis_remaining.saturating_add(left - permits))
    }

    fn put_back(&self, name: &str, permits: u64) {
        if let Some(grant) = self.entry(name, false).as_mut().and_then(|entry| entry.grant.as_mut()) {
            grant.used = grant.used.saturating_sub(permits);
        }
    }

    fn begin(&self, name: &str, now_ms: u64, due_ms: u64, max_permits: u64, permits: u64) -> Option<LeaseAsk> {
        let mut entry = self.entry(name, true)?;
        if entry.in_flight_until_ms > now_ms {
            return None;
        }
        entry.in_flight_until_ms = due_ms;
        let last = entry.grant.take();
        // What the last lease served in its age: twice as much if it was used up, else what was used.
        let want = match last {
            None if entry.want == 0 => max_permits,
            None => entry.want,
            Some(g) if g.used >= g.granted => g.granted.saturating_mul(2),
            Some(g) => g.used,
        };
        entry.want = want.clamp(permits.saturating_add(1), max_permits.max(permits.saturating_add(1)));
        // A lease used whole up to its expiry leaves Redis as it is: nothing to settle.
        let settle = last.map(|g| g.settlement()).filter(|s| s.used < s.granted || s.early_ms > 0);
        Some(LeaseAsk { want: entry.want, settle })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn grant(granted: u64, expires_ms: u64) -> LeaseGrant {
        LeaseGrant { random: [b'a'; 16], granted, used: 1, expires_ms, last_use_ms: 1_000, redis_remaining: 10 }
    }

    #[test]
    fn a_lease_serves_until_it_is_used_up_or_expires_then_is_settled_by_the_next_acquire() {
        let table = LeaseTable::default();
        let first = Some(LeaseAsk { want: 8, settle: None });
        assert_eq!(table.begin("hot", 1_000, 1_500, 8, 1), first, "no lease yet: ask for the most, nothing to settle");
        assert_eq!(table.begin("hot", 1_001, 1_500, 8, 1), None, "one lease acquire at a time");
        table.end("hot", Some(grant(4, 1_050)));
        assert_eq!(table.take("hot", 1_010, 1), Some(12), "2 left in the lease + 10 in Redis");
        assert_eq!(table.take("hot", 1_020, 2), Some(10));
        assert_eq!(table.take("hot", 1_030, 1), None, "used up");
        table.put_back("hot", 1);
        assert_eq!(table.take("hot", 1_030, 1), Some(10), "a permit put back serves again");
        assert_eq!(table.take("hot", 1_050, 1), None);
        assert_eq!(
            table.begin("hot", 1_060, 1_600, 8, 1),
            Some(LeaseAsk { want: 8, settle: Some(Settlement { random: [b'a'; 16], granted: 4, used: 4, early_ms: 20 }) }),
            "all used, the last 20 ms before the expiry: the member moves 20 ms earlier; used up: ask for twice as many"
        );
        table.end("hot", Some(grant(8, 2_000)));
        assert_eq!(table.take("hot", 2_000, 1), None, "expired");
        let ask = table.begin("hot", 2_001, 2_500, 8, 1).unwrap();
        let settled = ask.settle.unwrap();
        assert_eq!((settled.granted, settled.used, settled.early_ms), (8, 1, 1_000), "7 permits go back");
        assert_eq!(ask.want, 2, "1 used in its age: the next lease asks for 2 (more than a request's 1)");
    }

    #[test]
    fn a_lease_acquire_that_never_ended_stops_counting_at_its_deadline() {
        let table = LeaseTable::default();
        assert!(table.begin("hot", 1_000, 1_500, 8, 1).is_some());
        assert!(table.begin("hot", 1_499, 2_000, 8, 1).is_none());
        assert!(table.begin("hot", 1_500, 2_000, 8, 1).is_some());
    }
}
