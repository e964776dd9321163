//! This VM's permit leases (docs/configuration.md, "Leases"): per limiter name, the lease Redis granted, whether a
//! lease acquire is on its way, how many permits the next lease asks for (what the last one served in its
//! age, twice that when it was used up, up to `max_permits`, so a VM with little traffic on a limiter holds
//! few of its permits), and the leases that no longer serve but are not settled yet.
//!
//! A lease serves the limiter's requests from its permits until `expires_ms` (its acquire's send time plus
//! the rule's `max_age`: never after its member's score in Redis, so every use falls inside the window
//! that member covers). Each request it serves holds a [`LeaseTicket`] naming the lease (its member's
//! random bytes) until the request is decided: the permit is then committed (the request went upstream)
//! or put back **into that same lease**, never into another one: Redis counts a lease's permits in its own
//! member only, so a permit put back into a newer lease would serve a request Redis never counted.
//!
//! When a lease is used up or expired, the next acquire of the limiter asks for a new one and settles the
//! old one in the same call: the member keeps the permits used, scored at the last use, and the rest
//! return to the limiter. The old lease's permits still held by undecided requests are counted as used
//! then; the lease stays here as [`Retired`] until they are decided, and the ones put back go to Redis
//! in a give-back of that member once its settlement landed (one change of a member on its way at a time,
//! so they never cross). A settlement whose call failed is sent again (with the next acquire of the
//! limiter), without moving the member's score a second time, so it is safe to repeat.
//!
//! Permits are lost (held in Redis until their member leaves the window, `max_age` + `interval` after
//! the acquire at most) only where a lease is forgotten: a put-back whose lease was pushed out of its slot
//! ([`LeaseTable::SLOTS`]) or out of the retired list ([`LeaseTable::RETIRED`]), or a lease acquire whose
//! reply never came; [`LeaseTable::put_back`] says so and the filter counts them (`leases_lost_permits`).
//!
//! Per VM, not shared between the VMs of a process: a shared lease would cost two shared-data hostcalls and
//! a compare-and-swap per request, and saves round trips only where one VM's traffic cannot use a lease
//! within `max_age` (docs/configuration.md, "Leases", measured in `make bench`).

use crate::prelude::*;

use core::cell::{RefCell, RefMut};

use arrayvec::ArrayVec;

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
    /// Of `used`, the permits of requests not decided yet (they may still be put back).
    pub outstanding: u64,
    /// Until when it serves requests, ms since the epoch (gateway clock): its acquire's send time plus the
    /// rule's `max_age`, never after its member's score.
    pub expires_ms: u64,
    /// When it was last used, ms since the epoch (gateway clock).
    pub last_use_ms: u64,
    /// Permits Redis had left after granting it (for the headers).
    pub redis_remaining: u64,
}

/// Permits a request took from a lease, until it is decided ([`LeaseTable::commit`] when it went
/// upstream, [`LeaseTable::put_back`] when it did not).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseTicket {
    /// The limiter name.
    pub name: String,
    /// The lease's member random bytes: the lease the permits came from.
    pub random: [u8; MEMBER_RANDOM_LEN],
    /// Permits.
    pub permits: u64,
}

/// Where a request finds this VM's permit leases (docs/configuration.md, "Leases").
pub trait Leases {
    /// Takes `permits` from the live lease of limiter `name` at `now_ms` (before its expiry): the permits
    /// left (the lease's and Redis's at its grant) and the lease's member random bytes, if taken. The
    /// permits count as outstanding until the request's ticket is committed or put back.
    fn take(&self, name: &str, now_ms: u64, permits: u64) -> Option<(u64, [u8; MEMBER_RANDOM_LEN])>;
    /// Puts back a ticket of a request that does not go on, into the lease it came from; `false` when that
    /// lease is forgotten (the permits stay taken in Redis until its member leaves the window).
    fn put_back(&self, ticket: &LeaseTicket) -> bool;
    /// Starts a lease acquire of `name` at `now_ms` whose reply is due by `due_ms`, for a rule leasing up to
    /// `max_permits` and taking `permits` per request: `None` if one is on its way already (the request
    /// waits for it), else how many permits to ask for and the settlement to send in the same call: the
    /// previous lease's (it serves no request any more), or one a failed call left to send again.
    fn begin(&self, name: &str, now_ms: u64, due_ms: u64, max_permits: u64, permits: u64) -> Option<LeaseAsk>;
}

/// What a lease acquire asks for ([`Leases::begin`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseAsk {
    /// Permits to ask for (more than the rule's permits, at most its `max_permits`).
    pub want: u64,
    /// The settlement to send in the same call, if any.
    pub settle: Option<Settlement>,
}

/// A lease that no longer serves requests, until Redis holds exactly what it served.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Retired {
    random: [u8; MEMBER_RANDOM_LEN],
    /// Permits its member holds in Redis as far as this VM knows (the grant, until a settlement landed).
    held: u64,
    /// Permits used: its uses, less what requests put back.
    used: u64,
    /// How long before the member's score the last use came, ms; sent with the first settlement only (0
    /// once one was sent: a settlement sent again must not move the member twice).
    early_ms: u64,
    /// Of `used`, the permits of requests not decided yet.
    outstanding: u64,
    /// A change of the member on its way (the permits it will hold), at most one at a time.
    sending: Option<u64>,
    /// A change failed: the next one goes with the next acquire of the limiter (Redis was failing).
    wait_for_acquire: bool,
}

impl Retired {
    fn of(grant: &LeaseGrant) -> Self {
        Retired {
            random: grant.random,
            held: grant.granted,
            used: grant.used,
            early_ms: grant.expires_ms.saturating_sub(grant.last_use_ms),
            outstanding: grant.outstanding,
            sending: None,
            wait_for_acquire: false,
        }
    }

    /// Whether Redis must hear of it: permits to return, or a score to move.
    fn due(&self) -> bool {
        self.sending.is_none() && (self.used < self.held || self.early_ms > 0)
    }

    /// Its settlement, now marked as sent.
    fn send(&mut self) -> Settlement {
        let settlement = Settlement {
            random: self.random,
            granted: self.held,
            used: self.used,
            early_ms: self.early_ms,
            renamed: None,
            at: None,
        };
        self.sending = Some(self.used);
        self.early_ms = 0;
        settlement
    }

    /// Nothing left to tell Redis, and no request can put a permit back.
    fn done(&self) -> bool {
        self.outstanding == 0 && self.sending.is_none() && !self.due()
    }
}

/// One limiter's lease state.
#[derive(Debug, Clone, Default)]
struct Entry {
    /// The lease that serves requests, if any.
    grant: Option<LeaseGrant>,
    /// Leases that serve no more and are not settled yet, oldest first.
    retired: ArrayVec<Retired, { LeaseTable::RETIRED }>,
    /// Until when a lease acquire counts as on its way, ms (its reply's deadline).
    in_flight_until_ms: u64,
    /// Permits the next lease asks for (0: not asked yet, `max_permits`).
    want: u64,
}

impl Entry {
    /// Retires the live lease (if any) and makes room for it.
    fn retire_grant(&mut self, name: &str, outbox: &mut Vec<(String, Settlement)>) {
        let Some(grant) = self.grant.take() else { return };
        if self.retired.is_full() {
            // The oldest goes as it stands: its permits still outstanding stay counted as used.
            let mut oldest = self.retired.remove(0);
            if oldest.sending.is_none() && oldest.due() {
                outbox.push((name.into(), oldest.send()));
            }
        }
        self.retired.push(Retired::of(&grant));
    }

    /// Sends what its retired leases owe Redis, on their own (not with an acquire), and forgets the settled
    /// ones.
    fn flush(&mut self, name: &str, outbox: &mut Vec<(String, Settlement)>) {
        for retired in self.retired.iter_mut().filter(|r| r.due() && !r.wait_for_acquire) {
            outbox.push((name.into(), retired.send()));
        }
        self.retired.retain(|r| !r.done());
    }

    fn find(&mut self, random: &[u8; MEMBER_RANDOM_LEN]) -> Option<Ticketed<'_>> {
        if let Some(grant) = self.grant.as_mut().filter(|g| g.random == *random) {
            return Some(Ticketed::Live(grant));
        }
        self.retired.iter_mut().find(|r| r.random == *random).map(Ticketed::Retired)
    }
}

/// A lease a ticket names.
enum Ticketed<'a> {
    Live(&'a mut LeaseGrant),
    Retired(&'a mut Retired),
}

/// The leases of one VM, by limiter name.
#[derive(Debug)]
pub struct LeaseTable {
    slots: RefCell<Vec<Option<(String, Entry)>>>,
    /// Settlements to send on their own ([`LeaseTable::take_outbox`]).
    outbox: RefCell<Vec<(String, Settlement)>>,
}

impl Default for LeaseTable {
    fn default() -> Self {
        LeaseTable { slots: RefCell::new(vec![None; Self::SLOTS]), outbox: RefCell::default() }
    }
}

impl LeaseTable {
    /// Slots: how many limiters' leases a VM keeps at most.
    pub const SLOTS: usize = 64;
    /// Leases per limiter kept after they stop serving, until they are settled.
    pub const RETIRED: usize = 4;

    fn slot(name: &str) -> usize {
        (fnv1a(name.as_bytes()) % Self::SLOTS as u64) as usize
    }

    /// The entry of `name`: the one its slot holds, or with `claim` a new one taking the slot from another
    /// limiter (whose leases are settled as they stand, on their own).
    fn entry(&self, name: &str, claim: bool) -> Option<RefMut<'_, Entry>> {
        let slot = Self::slot(name);
        RefMut::filter_map(self.slots.borrow_mut(), |slots| {
            let held = slots.get_mut(slot)?;
            if !matches!(held, Some((n, _)) if same_bytes(n.as_bytes(), name.as_bytes())) {
                if !claim {
                    return None;
                }
                if let Some((other, mut entry)) = held.take() {
                    let mut outbox = self.outbox.borrow_mut();
                    entry.retire_grant(&other, &mut outbox);
                    for retired in entry.retired.iter_mut().filter(|r| r.due()) {
                        outbox.push((other.clone(), retired.send()));
                    }
                }
                *held = Some((name.into(), Entry::default()));
            }
            held.as_mut().map(|(_, entry)| entry)
        })
        .ok()
    }

    /// A lease acquire of `name` ended: records the lease Redis granted, if any, and what became of the
    /// settlement it carried (`settled`: the random bytes of its member, and whether Redis ran it).
    pub fn end(&self, name: &str, grant: Option<LeaseGrant>, settled: Option<([u8; MEMBER_RANDOM_LEN], bool)>) {
        if let Some((random, ok)) = settled {
            self.settled(name, &random, ok);
        }
        let Some(mut entry) = self.entry(name, grant.is_some()) else { return };
        entry.in_flight_until_ms = 0;
        if grant.is_some() {
            // Another lease still serving (an acquire that outlived its deadline came back late) retires.
            let mut outbox = self.outbox.borrow_mut();
            entry.retire_grant(name, &mut outbox);
            entry.flush(name, &mut outbox);
            entry.grant = grant;
        }
    }

    /// A settlement (or a give-back of returned permits) of the member `random` of `name` ended: `ok` if
    /// Redis ran it.
    pub fn settled(&self, name: &str, random: &[u8; MEMBER_RANDOM_LEN], ok: bool) {
        let Some(mut entry) = self.entry(name, false) else { return };
        if let Some(retired) = entry.retired.iter_mut().find(|r| r.random == *random) {
            match (retired.sending.take(), ok) {
                (Some(sent), true) => retired.held = sent,
                (_, _) => retired.wait_for_acquire = !ok,
            }
        }
        entry.flush(name, &mut self.outbox.borrow_mut());
    }

    /// The request holding `ticket` went upstream: its permits are used for good.
    pub fn commit(&self, ticket: &LeaseTicket) {
        let Some(mut entry) = self.entry(&ticket.name, false) else { return };
        match entry.find(&ticket.random) {
            Some(Ticketed::Live(grant)) => grant.outstanding = grant.outstanding.saturating_sub(ticket.permits),
            Some(Ticketed::Retired(retired)) => {
                retired.outstanding = retired.outstanding.saturating_sub(ticket.permits);
            }
            None => return,
        }
        entry.flush(&ticket.name, &mut self.outbox.borrow_mut());
    }

    /// Settlements to send now, each as a give-back of its member, with the limiter name; report each one's
    /// end with [`LeaseTable::settled`].
    pub fn take_outbox(&self) -> Vec<(String, Settlement)> {
        core::mem::take(&mut *self.outbox.borrow_mut())
    }

    /// Everything this VM's leases still owe Redis, for a filter that goes away (a new configuration): every
    /// lease settled as it stands (permits of undecided requests count as used). The table is empty after.
    pub fn retire_all(&self) -> Vec<(String, Settlement)> {
        let mut outbox = self.outbox.borrow_mut();
        for (name, mut entry) in self.slots.borrow_mut().iter_mut().filter_map(Option::take) {
            entry.retire_grant(&name, &mut outbox);
            for retired in entry.retired.iter_mut().filter(|r| r.due() || r.sending.is_some()) {
                // One on its way may have failed: sending it again is safe (no second move of the score).
                retired.sending = None;
                outbox.push((name.clone(), retired.send()));
            }
        }
        core::mem::take(&mut *outbox)
    }
}

impl Leases for LeaseTable {
    fn take(&self, name: &str, now_ms: u64, permits: u64) -> Option<(u64, [u8; MEMBER_RANDOM_LEN])> {
        let mut entry = self.entry(name, false)?;
        let grant = entry.grant.as_mut()?;
        let left = grant.granted.checked_sub(grant.used)?;
        if now_ms >= grant.expires_ms || left < permits {
            return None;
        }
        grant.used += permits;
        grant.outstanding += permits;
        grant.last_use_ms = grant.last_use_ms.max(now_ms);
        Some((grant.redis_remaining.saturating_add(left - permits), grant.random))
    }

    fn put_back(&self, ticket: &LeaseTicket) -> bool {
        let Some(mut entry) = self.entry(&ticket.name, false) else { return false };
        match entry.find(&ticket.random) {
            Some(Ticketed::Live(grant)) => {
                grant.used = grant.used.saturating_sub(ticket.permits);
                grant.outstanding = grant.outstanding.saturating_sub(ticket.permits);
            }
            Some(Ticketed::Retired(retired)) => {
                retired.used = retired.used.saturating_sub(ticket.permits);
                retired.outstanding = retired.outstanding.saturating_sub(ticket.permits);
            }
            None => return false,
        }
        entry.flush(&ticket.name, &mut self.outbox.borrow_mut());
        true
    }

    fn begin(&self, name: &str, now_ms: u64, due_ms: u64, max_permits: u64, permits: u64) -> Option<LeaseAsk> {
        let mut entry = self.entry(name, true)?;
        if entry.in_flight_until_ms > now_ms {
            return None;
        }
        entry.in_flight_until_ms = due_ms;
        // What the last lease served in its age: twice as much if it was used up, else what was used.
        let want = match entry.grant {
            None if entry.want == 0 => max_permits,
            None => entry.want,
            Some(g) if g.used >= g.granted => g.granted.saturating_mul(2),
            Some(g) => g.used,
        };
        entry.want = want.clamp(permits.saturating_add(1), max_permits.max(permits.saturating_add(1)));
        let mut outbox = self.outbox.borrow_mut();
        entry.retire_grant(name, &mut outbox);
        // The newest lease's settlement goes with this call (the last one retired, or one a failed call left).
        let settle = entry.retired.iter_mut().rev().find(|r| r.due()).map(|r| {
            r.wait_for_acquire = false;
            r.send()
        });
        for retired in entry.retired.iter_mut() {
            retired.wait_for_acquire = false;
        }
        entry.flush(name, &mut outbox);
        Some(LeaseAsk { want: entry.want, settle })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]
    use super::*;

    fn grant(random: u8, granted: u64, expires_ms: u64) -> LeaseGrant {
        LeaseGrant {
            random: [random; 16],
            granted,
            used: 1,
            outstanding: 0,
            expires_ms,
            last_use_ms: 1_000,
            redis_remaining: 10,
        }
    }

    fn ticket(random: u8) -> LeaseTicket {
        LeaseTicket { name: "hot".into(), random: [random; 16], permits: 1 }
    }

    fn settlement(random: u8, granted: u64, used: u64, early_ms: u64) -> Settlement {
        Settlement { random: [random; 16], granted, used, early_ms, renamed: None, at: None }
    }

    #[test]
    fn a_lease_serves_until_it_is_used_up_or_expires_then_is_settled_by_the_next_acquire() {
        let table = LeaseTable::default();
        let first = Some(LeaseAsk { want: 8, settle: None });
        assert_eq!(table.begin("hot", 1_000, 1_500, 8, 1), first, "no lease yet: ask for the most, nothing to settle");
        assert_eq!(table.begin("hot", 1_001, 1_500, 8, 1), None, "one lease acquire at a time");
        table.end("hot", Some(grant(b'a', 4, 1_050)), None);
        assert_eq!(table.take("hot", 1_010, 1), Some((12, [b'a'; 16])), "2 left in the lease + 10 in Redis");
        assert_eq!(table.take("hot", 1_020, 2), Some((10, [b'a'; 16])));
        assert_eq!(table.take("hot", 1_030, 1), None, "used up");
        assert!(table.put_back(&ticket(b'a')));
        assert_eq!(table.take("hot", 1_030, 1), Some((10, [b'a'; 16])), "a permit put back serves again");
        assert_eq!(table.take("hot", 1_050, 1), None);
        for _ in 0..4 {
            table.commit(&ticket(b'a'));
        }
        assert_eq!(
            table.begin("hot", 1_060, 1_600, 8, 1),
            Some(LeaseAsk { want: 8, settle: Some(settlement(b'a', 4, 4, 20)) }),
            "all used, the last 20 ms before the expiry: the member moves 20 ms earlier; used up: ask for twice as many"
        );
        table.end("hot", Some(grant(b'b', 8, 2_000)), Some(([b'a'; 16], true)));
        assert_eq!(table.take("hot", 2_000, 1), None, "expired");
        let ask = table.begin("hot", 2_001, 2_500, 8, 1).unwrap();
        assert_eq!(ask.settle, Some(settlement(b'b', 8, 1, 1_000)), "7 permits go back");
        assert_eq!(ask.want, 2, "1 used in its age: the next lease asks for 2 (more than a request's 1)");
        assert!(table.take_outbox().is_empty());
    }

    #[test]
    fn a_permit_put_back_after_its_lease_stopped_serving_goes_to_that_lease_not_the_next() {
        let table = LeaseTable::default();
        table.begin("hot", 1_000, 1_500, 4, 1);
        table.end("hot", Some(LeaseGrant { outstanding: 1, ..grant(b'a', 4, 1_100) }), None);
        let (_, random) = table.take("hot", 1_005, 1).unwrap();
        assert_eq!(random, [b'a'; 16]);
        // The lease expires while that request waits for another rule; the next acquire settles it with
        // the waiting request's permit counted as used.
        let ask = table.begin("hot", 1_110, 1_600, 4, 1).unwrap();
        assert_eq!(ask.settle, Some(settlement(b'a', 4, 2, 95)));
        table.commit(&ticket(b'a'));
        table.end("hot", Some(LeaseGrant { outstanding: 1, ..grant(b'b', 2, 1_210) }), Some(([b'a'; 16], true)));
        // The waiting request is rejected: its permit goes back to its own lease, in Redis.
        assert!(table.put_back(&ticket(b'a')));
        assert_eq!(table.outbox.borrow().as_slice(), &[("hot".to_string(), settlement(b'a', 2, 1, 0))]);
        assert_eq!(table.take("hot", 1_120, 1).map(|(_, r)| r), Some([b'b'; 16]));
        assert_eq!(table.take("hot", 1_120, 1), None, "the new lease serves only its own 2 permits");
        table.take_outbox();
        table.settled("hot", &[b'a'; 16], true);
        assert!(table.entry("hot", false).unwrap().retired.is_empty(), "settled and nothing outstanding: gone");
        assert!(!table.put_back(&LeaseTicket { random: [b'z'; 16], ..ticket(b'z') }), "a lease never known");
    }

    #[test]
    fn put_backs_while_the_settlement_is_on_its_way_follow_it_one_change_at_a_time() {
        let table = LeaseTable::default();
        table.begin("hot", 1_000, 1_500, 8, 1);
        table.end("hot", Some(LeaseGrant { outstanding: 1, ..grant(b'a', 8, 1_100) }), None);
        table.take("hot", 1_001, 1);
        table.take("hot", 1_002, 1);
        let ask = table.begin("hot", 1_100, 1_600, 8, 1).unwrap();
        assert_eq!(ask.settle, Some(settlement(b'a', 8, 3, 98)), "three used (two still undecided)");
        assert!(table.put_back(&ticket(b'a')));
        assert!(table.take_outbox().is_empty(), "the settlement has not landed: the put-back waits");
        table.end("hot", None, Some(([b'a'; 16], true)));
        assert_eq!(table.take_outbox(), vec![("hot".to_string(), settlement(b'a', 3, 2, 0))]);
        assert!(table.put_back(&ticket(b'a')));
        assert!(table.take_outbox().is_empty(), "one change of a member at a time");
        table.settled("hot", &[b'a'; 16], true);
        assert_eq!(table.take_outbox(), vec![("hot".to_string(), settlement(b'a', 2, 1, 0))]);
        table.settled("hot", &[b'a'; 16], true);
        table.commit(&ticket(b'a'));
        assert!(table.entry("hot", false).unwrap().retired.is_empty());
    }

    #[test]
    fn a_settlement_whose_call_failed_goes_again_with_the_next_acquire_without_moving_the_score_twice() {
        let table = LeaseTable::default();
        table.begin("hot", 1_000, 1_500, 8, 1);
        table.end("hot", Some(grant(b'a', 8, 1_100)), None);
        let ask = table.begin("hot", 1_100, 1_600, 8, 1).unwrap();
        assert_eq!(ask.settle, Some(settlement(b'a', 8, 1, 100)));
        table.end("hot", None, Some(([b'a'; 16], false)));
        assert!(table.take_outbox().is_empty(), "Redis is failing: it waits for the next acquire");
        let ask = table.begin("hot", 1_700, 2_200, 8, 1).unwrap();
        assert_eq!(ask.settle, Some(settlement(b'a', 8, 1, 0)), "the same settlement, the score left as it is");
        table.end("hot", None, Some(([b'a'; 16], true)));
        assert!(table.entry("hot", false).unwrap().retired.is_empty());
    }

    #[test]
    fn a_limiter_pushed_out_of_its_slot_is_settled_as_it_stands() {
        let table = LeaseTable::default();
        let other = (0..1_000).map(|i| format!("other-{i}")).find(|n| LeaseTable::slot(n) == LeaseTable::slot("hot"));
        let other = other.unwrap();
        table.begin("hot", 1_000, 1_500, 8, 1);
        table.end("hot", Some(LeaseGrant { outstanding: 1, ..grant(b'a', 8, 1_100) }), None);
        table.begin(&other, 1_010, 1_500, 8, 1);
        assert_eq!(table.take_outbox(), vec![("hot".to_string(), settlement(b'a', 8, 1, 100))]);
        assert!(!table.put_back(&ticket(b'a')), "its lease is forgotten: the permit is lost, and the caller says so");
    }

    #[test]
    fn retire_all_settles_every_lease_as_it_stands() {
        let table = LeaseTable::default();
        table.begin("hot", 1_000, 1_500, 8, 1);
        table.end("hot", Some(grant(b'a', 8, 1_100)), None);
        table.take("hot", 1_050, 1);
        assert_eq!(table.retire_all(), vec![("hot".to_string(), settlement(b'a', 8, 2, 50))]);
        assert_eq!(table.take("hot", 1_060, 1), None);
    }

    #[test]
    fn a_lease_acquire_that_never_ended_stops_counting_at_its_deadline() {
        let table = LeaseTable::default();
        assert!(table.begin("hot", 1_000, 1_500, 8, 1).is_some());
        assert!(table.begin("hot", 1_499, 2_000, 8, 1).is_none());
        assert!(table.begin("hot", 1_500, 2_000, 8, 1).is_some());
    }
}
