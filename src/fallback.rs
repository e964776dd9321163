//! The degraded mode (`failure_mode: "local"`): while Redis fails, each gateway process enforces every rule
//! itself, at `rate / gateways` per window, with a sliding window in the process's shared data, and a
//! circuit breaker keeps a dead Redis from being asked on every request.
//!
//! **The window** counts permits in `BUCKETS` buckets of `ceil(interval / (BUCKETS - 2))` ms each (a ring:
//! bucket `n` holds the permits admitted between `n × width` and `(n + 1) × width`). A request for `p`
//! permits at time `s` is admitted when the buckets that overlap `(s - interval, s]` hold at most
//! `budget - p`. Whole buckets count, also the part of the oldest one that left the window, so every
//! permit admitted in the last `interval` is counted: no sliding window ever holds more than `budget`
//! admitted permits (at most one bucket's width of permits are refused that an exact log would admit).
//! With `gateways` processes each at `floor(rate / gateways)`, the fleet stays within `rate`.
//!
//! **Memory**: shared data has no delete, so windows live in a fixed number of slots (`local_block_slots`,
//! default 4096): key `edge_rate_limiter.fallback.<n>`, an entry of `HEADER + BUCKETS × 4` bytes plus the
//! limiter name. A limiter takes the slot of its name's FNV-1a or the next one; a slot is free when its
//! entry is of another configuration or counts nothing in its window. When both slots hold live windows of
//! other limiters, the request is refused (never admitted uncounted). Updates are compare-and-swap.
//! A host's compare-and-swap has no "create if absent": a write to a missing key (CAS version 0) always
//! lands, so two VMs creating one slot at once would lose one's count. Each VM therefore creates every
//! slot, empty, when it is configured ([`WindowTable::create_slots`]), before it serves a request (Envoy
//! configures the main thread's VM before any worker starts), and an admission is only ever written over an
//! existing entry, by version. The slots cost about 100 bytes each of the process's memory (400 KB at the
//! default), for the process's lifetime, once `failure_mode: "local"` is configured.
//!
//! **The circuit** (per VM, [`Circuit`]): a failed Redis call opens it; while open, requests are decided here
//! without a Redis call, except one probe per `probe_interval`, which asks Redis; the first decision Redis
//! makes again closes it.

use crate::prelude::*;

use arrayvec::ArrayString;

use crate::block::{fnv1a, same_bytes};
use crate::host::{Host, HostError};

/// Buckets per window.
pub const BUCKETS: usize = 32;
/// Prefix of the slot keys in shared data.
pub const KEY_PREFIX: &str = "edge_rate_limiter.fallback.";
/// The layout version of an entry (its first byte).
const VERSION: u8 = 1;
/// Bytes before the counts: version, generation (u32), interval ms (u64), newest bucket (u64).
const HEADER: usize = 21;
/// Bytes before the limiter name.
const NAME_AT: usize = HEADER + BUCKETS * 4;
/// A slot created empty: no window of any generation (it decodes as none).
const EMPTY_SLOT: &[u8] = &[0];

/// Where a configuration keeps its local windows: slot count, generation, and the gateway count that
/// divides each rate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WindowTable {
    /// Number of slots.
    pub slots: u32,
    /// The configuration's generation (as [`crate::block::BlockTable`]): a new configuration starts afresh.
    pub generation: u32,
    /// The expected number of gateway processes sharing each limiter.
    pub gateways: u32,
}

/// One limiter's window as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Window {
    interval_ms: u64,
    newest: u64,
    counts: [u32; BUCKETS],
}

impl Window {
    fn width_ms(interval_ms: u64) -> u64 {
        interval_ms.div_ceil(BUCKETS as u64 - 2).max(1)
    }

    /// Moves the ring to bucket `now` (emptying the buckets it passes) and returns the permits counted in
    /// the buckets overlapping `(now_ms - interval, now_ms]`.
    fn advance(&mut self, now_ms: u64) -> u64 {
        let width = Self::width_ms(self.interval_ms);
        let now = now_ms / width;
        if now > self.newest {
            let passed = (now - self.newest).min(BUCKETS as u64);
            for step in 1..=passed {
                let index = ((self.newest + step) % BUCKETS as u64) as usize;
                if let Some(count) = self.counts.get_mut(index) {
                    *count = 0;
                }
            }
            self.newest = now;
        }
        self.counted(now_ms)
    }

    /// The permits in the buckets overlapping `(now_ms - interval, now_ms]` (a clock behind the newest
    /// bucket counts up to the newest: more, never less).
    fn counted(&self, now_ms: u64) -> u64 {
        (self.first_counted(now_ms)..=self.newest)
            .map(|bucket| u64::from(self.counts.get((bucket % BUCKETS as u64) as usize).copied().unwrap_or(0)))
            .sum()
    }

    /// The oldest bucket that overlaps `(now_ms - interval, now_ms]`, and never more than the ring back from
    /// the newest: a clock far behind the newest bucket (or a window written with a clock far ahead) costs
    /// at most `BUCKETS` steps, not one per bucket of the gap.
    fn first_counted(&self, now_ms: u64) -> u64 {
        let oldest = now_ms.saturating_sub(self.interval_ms) / Self::width_ms(self.interval_ms);
        oldest.max(self.newest.saturating_sub(BUCKETS as u64 - 1))
    }

    /// When the oldest counted permit leaves the window, ms from `now_ms` (for `Retry-After`).
    fn next_release_ms(&self, now_ms: u64) -> u64 {
        let width = Self::width_ms(self.interval_ms);
        let oldest = self.first_counted(now_ms);
        let first = (oldest..=self.newest)
            .find(|bucket| self.counts.get((bucket % BUCKETS as u64) as usize).is_some_and(|c| *c > 0))
            .unwrap_or(oldest);
        // At most the interval and two buckets, whatever the clocks say.
        let bound = self.interval_ms.saturating_add(width.saturating_mul(2));
        (first + 1).saturating_mul(width).saturating_add(self.interval_ms).saturating_sub(now_ms).min(bound)
    }
}

/// A local decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Local {
    /// Admitted and counted.
    Admitted,
    /// Refused: the window is full (or no slot was free); `retry_ms` until a permit leaves it.
    Refused {
        /// Until the oldest counted permit leaves the window, ms.
        retry_ms: u64,
    },
}

impl WindowTable {
    /// The permits each gateway process may admit per window: `floor(rate / gateways)`.
    pub fn budget(&self, rate: u64) -> u64 {
        rate / u64::from(self.gateways.max(1))
    }

    fn key(&self, slot: u64) -> ArrayString<40> {
        let mut key = ArrayString::new();
        let _ = key.try_push_str(KEY_PREFIX);
        let _ = key.try_push_str(itoa::Buffer::new().format(slot % u64::from(self.slots.max(1))));
        key
    }

    /// Creates every slot that does not exist yet, empty, so that admissions are only ever written by
    /// compare-and-swap over an existing entry (see the module's documentation). Run at configure, before
    /// the VM serves a request. A slot still missing at [`Self::acquire`] (the host refused shared data at
    /// configure) is created by its first admission's write.
    pub fn create_slots(&self, host: &impl Host) {
        for slot in 0..u64::from(self.slots.max(1)) {
            let key = self.key(slot);
            if let Ok((None, _)) = host.get_shared_data(key.as_str()) {
                let _ = host.set_shared_data(key.as_str(), EMPTY_SLOT, 0);
            }
        }
    }

    /// Takes `permits` from limiter `name`'s local window (rule `rate` per `interval_ms`) at `now_ms`, or
    /// refuses. A host that refuses shared data refuses the request too (nothing admitted uncounted).
    pub fn acquire(
        &self,
        host: &impl Host,
        name: &str,
        rate: u64,
        interval_ms: u64,
        permits: u64,
        now_ms: u64,
    ) -> Local {
        let budget = self.budget(rate);
        let refused = Local::Refused { retry_ms: interval_ms };
        let first = fnv1a(name.as_bytes());
        for slot in [first, first.wrapping_add(1)] {
            let key = self.key(slot);
            // Compare-and-swap: a few rounds against the other VMs, then refuse.
            for _ in 0..4 {
                let Ok((current, cas)) = host.get_shared_data(key.as_str()) else { return refused };
                let stored = current.as_deref().and_then(|bytes| decode(bytes, self.generation));
                let fresh = Window { interval_ms, newest: 0, counts: [0; BUCKETS] };
                let mut window = match stored {
                    Some((window, stored_name)) if same_bytes(stored_name, name.as_bytes()) => {
                        Window { interval_ms, ..window }
                    }
                    // Another limiter's live window: try the next slot.
                    Some((other, _)) if other.counted(now_ms) > 0 => break,
                    _ => fresh,
                };
                let counted = window.advance(now_ms);
                if counted.saturating_add(permits) > budget {
                    return Local::Refused { retry_ms: window.next_release_ms(now_ms) };
                }
                let index = (window.newest % BUCKETS as u64) as usize;
                if let Some(count) = window.counts.get_mut(index) {
                    *count = count.saturating_add(u32::try_from(permits).unwrap_or(u32::MAX));
                }
                match host.set_shared_data(key.as_str(), &encode(self.generation, &window, name), cas) {
                    Ok(()) => return Local::Admitted,
                    Err(HostError::CasMismatch) => continue,
                    Err(_) => return refused,
                }
            }
        }
        refused
    }
}

impl WindowTable {
    /// Returns `permits` taken at `taken_ms` from limiter `name`'s window (rule window `interval_ms`) by a
    /// request another rule refused after all: the bucket that counted them gives them back, while the
    /// window still holds it. A host that refuses shared data keeps them counted (never more admitted).
    pub fn release(&self, host: &impl Host, name: &str, interval_ms: u64, permits: u64, taken_ms: u64) {
        self.settle(host, name, interval_ms, permits, 0, taken_ms);
    }

    /// Settles a reservation of `granted` permits taken at `taken_ms` from limiter `name`'s window to the
    /// `used` permits its response cost: the bucket that counted it then counts `used` instead (fewer gives
    /// permits back, more charges the excess), while the window still holds that bucket. A host that
    /// refuses shared data leaves the count as it was.
    pub fn settle(&self, host: &impl Host, name: &str, interval_ms: u64, granted: u64, used: u64, taken_ms: u64) {
        let bucket = taken_ms / Window::width_ms(interval_ms);
        let first = fnv1a(name.as_bytes());
        let granted = u32::try_from(granted).unwrap_or(u32::MAX);
        let used = u32::try_from(used).unwrap_or(u32::MAX);
        for slot in [first, first.wrapping_add(1)] {
            let key = self.key(slot);
            for _ in 0..4 {
                let Ok((current, cas)) = host.get_shared_data(key.as_str()) else { return };
                let Some((mut window, stored_name)) = current.as_deref().and_then(|b| decode(b, self.generation))
                else {
                    break;
                };
                if !same_bytes(stored_name, name.as_bytes()) {
                    break;
                }
                if bucket > window.newest || bucket.saturating_add(BUCKETS as u64) <= window.newest {
                    return;
                }
                if let Some(count) = window.counts.get_mut((bucket % BUCKETS as u64) as usize) {
                    *count = count.saturating_sub(granted).saturating_add(used);
                }
                match host.set_shared_data(key.as_str(), &encode(self.generation, &window, name), cas) {
                    Err(HostError::CasMismatch) => continue,
                    _ => return,
                }
            }
        }
    }
}

fn encode(generation: u32, window: &Window, name: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(NAME_AT + name.len());
    out.push(VERSION);
    out.extend_from_slice(&generation.to_le_bytes());
    out.extend_from_slice(&window.interval_ms.to_le_bytes());
    out.extend_from_slice(&window.newest.to_le_bytes());
    for count in window.counts {
        out.extend_from_slice(&count.to_le_bytes());
    }
    out.extend_from_slice(name.as_bytes());
    out
}

/// An entry of this generation: its window and limiter name; `None` for anything else.
fn decode(bytes: &[u8], generation: u32) -> Option<(Window, &[u8])> {
    let u32_at = |at: usize| bytes.get(at..at + 4).and_then(|b| b.try_into().ok()).map(u32::from_le_bytes);
    let u64_at = |at: usize| bytes.get(at..at + 8).and_then(|b| b.try_into().ok()).map(u64::from_le_bytes);
    if *bytes.first()? != VERSION || u32_at(1)? != generation {
        return None;
    }
    let mut counts = [0u32; BUCKETS];
    for (index, count) in counts.iter_mut().enumerate() {
        *count = u32_at(HEADER + index * 4)?;
    }
    Some((Window { interval_ms: u64_at(5)?, newest: u64_at(13)?, counts }, bytes.get(NAME_AT..)?))
}

/// A VM's circuit breaker for one configuration: closed (Redis is asked) or open until the next probe.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Circuit {
    /// When the next probe may ask Redis, ms since the epoch; 0 when closed.
    next_probe_ms: u64,
}

impl Circuit {
    /// Whether a request at `now_ms` should skip Redis. When a probe is due, this request is the probe: it
    /// asks Redis, and the requests after it stay local for another `probe_interval_ms`.
    pub fn skip_redis(&mut self, now_ms: u64, probe_interval_ms: u64) -> bool {
        if self.next_probe_ms == 0 {
            return false;
        }
        if now_ms >= self.next_probe_ms {
            self.next_probe_ms = now_ms.saturating_add(probe_interval_ms);
            return false;
        }
        true
    }

    /// A Redis call failed: open (the next probe after `probe_interval_ms`), unless open already.
    pub fn failed(&mut self, now_ms: u64, probe_interval_ms: u64) {
        if self.next_probe_ms == 0 {
            self.next_probe_ms = now_ms.saturating_add(probe_interval_ms).max(1);
        }
    }

    /// Redis decided a request: close.
    pub fn succeeded(&mut self) {
        self.next_probe_ms = 0;
    }

    /// Whether the circuit is open.
    pub fn is_open(&self) -> bool {
        self.next_probe_ms != 0
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]
    use super::*;
    use crate::testing::FakeHost;

    const WINDOWS: WindowTable = WindowTable { slots: 64, generation: 3, gateways: 2 };

    fn admitted(host: &FakeHost, name: &str, permits: u64, now_ms: u64) -> bool {
        WINDOWS.create_slots(host);
        WINDOWS.acquire(host, name, 10, 1_000, permits, now_ms) == Local::Admitted
    }

    #[test]
    fn each_process_admits_rate_over_gateways_per_window_across_its_vms() {
        let host = FakeHost::new();
        let other_vm = host.sibling();
        let start = 1_700_000_000_000;
        assert!((0..3).all(|i| admitted(&host, "erl:a", 1, start + i)));
        assert!(admitted(&other_vm, "erl:a", 2, start + 10), "5 = 10 / 2 gateways");
        assert!(!admitted(&other_vm, "erl:a", 1, start + 20));
        assert!(admitted(&host, "erl:b", 5, start + 20), "another limiter has its own window");
        // The oldest permits leave after the interval (plus at most a bucket).
        assert!(!admitted(&host, "erl:a", 1, start + 999));
        assert!(admitted(&host, "erl:a", 1, start + 1_000 + Window::width_ms(1_000)));
    }

    #[test]
    fn no_sliding_window_holds_more_than_the_budget() {
        let host = FakeHost::new();
        let mut rng = fastrand::Rng::with_seed(7);
        let mut admitted_at = Vec::new();
        let mut now = 1_700_000_000_000u64;
        for _ in 0..5_000 {
            now += rng.u64(0..40);
            if admitted(&host, "erl:hot", 1, now) {
                admitted_at.push(now);
            }
        }
        assert!(admitted_at.len() > 100);
        for (i, &start) in admitted_at.iter().enumerate() {
            let inside = admitted_at[i..].iter().take_while(|&&t| t < start + 1_000).count();
            assert!(inside <= 5, "{inside} admitted in the window from {start}");
        }
    }

    #[test]
    fn two_vms_taking_a_new_window_at_once_both_count() {
        let host = FakeHost::new();
        let other_vm = host.sibling();
        let now = 1_700_000_000_000;
        WINDOWS.create_slots(&host);
        WINDOWS.create_slots(&other_vm);
        // The other VM admits between this VM's read of the slot and its write.
        let racer = other_vm.clone();
        host.before_next_set_shared_data(move || {
            assert_eq!(WINDOWS.acquire(&racer, "erl:new", 10, 1_000, 1, now), Local::Admitted);
        });
        assert_eq!(WINDOWS.acquire(&host, "erl:new", 10, 1_000, 1, now), Local::Admitted);
        // Both counted: 3 more fill the budget of 5, the 4th is refused.
        assert!((0..3).all(|_| admitted(&other_vm, "erl:new", 1, now + 1)));
        assert!(!admitted(&host, "erl:new", 1, now + 2), "a lost count would admit a 6th");
    }

    #[test]
    fn permits_released_by_a_refused_request_serve_again() {
        let host = FakeHost::new();
        let start = 1_700_000_000_000;
        assert!(admitted(&host, "erl:a", 4, start));
        assert!(admitted(&host, "erl:a", 1, start + 10));
        assert!(!admitted(&host, "erl:a", 1, start + 20), "5 = 10 / 2 gateways");
        WINDOWS.release(&host, "erl:a", 1_000, 1, start + 10);
        assert!(admitted(&host, "erl:a", 1, start + 30), "the permit given back serves again");
        WINDOWS.release(&host, "erl:b", 1_000, 1, start + 10);
        assert!(!admitted(&host, "erl:a", 1, start + 40), "another limiter's release gives nothing");
    }

    #[test]
    fn a_clock_far_behind_the_window_counts_the_whole_ring_at_once() {
        let host = FakeHost::new();
        let far_ahead = 1_700_000_000_000;
        assert!(admitted(&host, "erl:a", 5, far_ahead));
        // A clock near zero would walk ~5e10 buckets one by one; it counts the ring (full) and refuses.
        assert!(!admitted(&host, "erl:a", 1, 1_000));
    }

    #[test]
    fn a_slot_held_by_another_live_limiter_is_not_taken_over() {
        let host = FakeHost::new();
        let one = WindowTable { slots: 1, ..WINDOWS };
        let now = 1_700_000_000_000;
        assert_eq!(one.acquire(&host, "erl:a", 10, 1_000, 1, now), Local::Admitted);
        assert!(matches!(one.acquire(&host, "erl:b", 10, 1_000, 1, now), Local::Refused { .. }));
        // Once a's window is empty, b may take the slot.
        assert_eq!(one.acquire(&host, "erl:b", 10, 1_000, 1, now + 2_100), Local::Admitted);
    }

    #[test]
    fn the_circuit_lets_one_probe_through_per_interval_and_closes_on_success() {
        let mut circuit = Circuit::default();
        assert!(!circuit.skip_redis(1_000, 500));
        circuit.failed(1_000, 500);
        assert!(circuit.skip_redis(1_200, 500));
        assert!(!circuit.skip_redis(1_500, 500), "the probe");
        assert!(circuit.skip_redis(1_501, 500));
        circuit.failed(1_600, 500);
        assert!(!circuit.skip_redis(2_000, 500), "still one probe per interval");
        circuit.succeeded();
        assert!(!circuit.is_open() && !circuit.skip_redis(2_001, 500));
    }
}
