//! The exact local block: after Redis rejected a limiter's acquire, every VM of the gateway process
//! rejects, without a Redis call, the requests that Redis would reject too, until the limiter's oldest
//! permit leaves the window.
//!
//! Why it is exact (Redisson's semantics, DESIGN.md): a rejection says the window holds `available` free
//! permits and that its oldest permit leaves in `delay - 3` ms. Until then no permit is released, so a
//! request that needs more than `available` cannot be granted; `available` can only shrink meanwhile (other
//! acquires). A request asking for `available` or fewer still goes to Redis. Only an operator raising the
//! rate (`setRate`, `updateRate`), deleting the limiter, or Redisson 4.x `release()` can free permits
//! earlier: a block lasts at most the rule's `local_block_max`, which bounds what that costs.
//!
//! Time base: the block ends at `sent + delay - 3`, where `sent` is the gateway time the acquire was sent
//! at. With `clock: "gateway"` that is the time Redis decided with, so the block ends exactly when Redis
//! would release the permit for this gateway's requests. With `clock: "redis"` Redis decided a little
//! later than `sent`, so the block ends up to one round trip early (a request may still go to Redis; none is
//! rejected that Redis would admit), whatever the offset between the gateway's and Redis's clocks.
//!
//! Memory: shared data has no expiry and no delete, so entries live in a fixed number of slots
//! (`local_block_slots`, default 4096): key `edge_rate_limiter.block.<n>`, `n` = FNV-1a of the limiter
//! name modulo the slot count. An entry names its limiter, so a slot shared by two limiters never blocks
//! the wrong one; a VM treats an entry of another limiter, of another configuration (`generation`: a hash
//! of the plugin configuration, so a configuration change forgets every block) or past its end as empty,
//! and overwrites it with compare-and-swap. At most `slots × (37 + name length)` bytes of values.

use crate::prelude::*;

use arrayvec::ArrayString;

use crate::host::{Host, HostError};

/// The layout version of an entry (its first byte).
const VERSION: u8 = 1;
/// Bytes before the limiter name.
const HEADER: usize = 37;
/// Prefix of the slot keys in shared data.
pub const KEY_PREFIX: &str = "edge_rate_limiter.block.";

/// A limiter's block, as a request checks it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Block {
    /// When the block ends, ms since the epoch (gateway clock): when the oldest permit leaves the window, or
    /// earlier, at the rule's `local_block_max` after the rejection.
    pub until_ms: u64,
    /// When the oldest permit leaves the window, ms since the epoch (gateway clock): what `Retry-After`
    /// counts down to, even past the block's end.
    pub release_ms: u64,
    /// Permits free in the window when Redis rejected: a request for more is rejected locally.
    pub available: u64,
    /// The limiter's rate in Redis (for the `RateLimit-Policy` header).
    pub rate: u64,
    /// The limiter's interval in Redis, ms.
    pub interval_ms: u64,
}

/// Where a configuration keeps its blocks: the slot count and its generation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockTable {
    /// Number of slots.
    pub slots: u32,
    /// The configuration's generation (a hash of the plugin configuration bytes).
    pub generation: u32,
}

/// FNV-1a, 64 bits, of a limiter name: what picks its slot (a hash for slots, not for security: the entry
/// names its limiter).
pub fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |hash, &b| (hash ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3))
}

/// The generation of a plugin configuration: its bytes' FNV-1a, folded to 32 bits.
pub fn generation_of(configuration: &[u8]) -> u32 {
    let hash = fnv1a(configuration);
    (hash ^ (hash >> 32)) as u32
}

impl BlockTable {
    /// The shared-data key of a limiter's slot (built on the stack: the prefix and at most 5 digits).
    pub fn key(&self, name: &str) -> ArrayString<32> {
        self.key_of_hash(fnv1a(name.as_bytes()))
    }

    /// The shared-data key of the slot of a limiter name whose [`fnv1a`] is `hash`.
    pub fn key_of_hash(&self, hash: u64) -> ArrayString<32> {
        let slot = hash % u64::from(self.slots.max(1));
        let mut key = ArrayString::new();
        // Both fit: 24 bytes of prefix and a slot below 65536.
        let _ = key.try_push_str(KEY_PREFIX);
        let _ = key.try_push_str(itoa::Buffer::new().format(slot));
        key
    }

    /// The live block of limiter `name` at `now_ms`, if its slot holds one of this configuration.
    pub fn find(&self, host: &impl Host, name: &str, now_ms: u64) -> Option<Block> {
        self.find_hashed(host, name, fnv1a(name.as_bytes()), now_ms)
    }

    /// [`BlockTable::find`] with the name's [`fnv1a`] already computed.
    pub fn find_hashed(&self, host: &impl Host, name: &str, hash: u64, now_ms: u64) -> Option<Block> {
        let (value, _) = host.get_shared_data(self.key_of_hash(hash).as_str()).ok()?;
        let (generation, block, stored) = decode(value.as_deref()?)?;
        (generation == self.generation && now_ms < block.until_ms && same_bytes(stored, name.as_bytes()))
            .then_some(block)
    }

    /// Records a block of limiter `name`, unless its slot holds a live block of another limiter of this
    /// configuration that ends later. Compare-and-swap, one retry: a lost race costs one Redis call, never
    /// a wrong decision.
    pub fn record(&self, host: &impl Host, name: &str, block: Block, now_ms: u64) {
        let key = self.key(name);
        let key = key.as_str();
        let value = encode(self.generation, &block, name);
        for _ in 0..2 {
            let Ok((current, cas)) = host.get_shared_data(key) else { return };
            let keep = current.as_deref().and_then(decode).is_some_and(|(generation, other, stored)| {
                generation == self.generation
                    && !same_bytes(stored, name.as_bytes())
                    && now_ms < other.until_ms
                    && other.until_ms > block.until_ms
            });
            if keep {
                return;
            }
            match host.set_shared_data(key, &value, cas) {
                Err(HostError::CasMismatch) => continue,
                _ => return,
            }
        }
    }
}

impl BlockTable {
    /// Adds `permits` to the free permits of limiter `name`'s live block: a settle gave them back to the
    /// window in Redis (a reservation settled below its size), so requests for up to that many more would
    /// be admitted before the block ends. Compare-and-swap with a few retries; a lost race or a refused
    /// hostcall leaves the block as it was (stricter than Redis until it ends, never looser).
    pub fn raise(&self, host: &impl Host, name: &str, permits: u64, now_ms: u64) {
        let key = self.key(name);
        let key = key.as_str();
        for _ in 0..4 {
            let Ok((current, cas)) = host.get_shared_data(key) else { return };
            let Some((generation, mut block, stored)) = current.as_deref().and_then(decode) else { return };
            if generation != self.generation || now_ms >= block.until_ms || !same_bytes(stored, name.as_bytes()) {
                return;
            }
            block.available = block.available.saturating_add(permits);
            match host.set_shared_data(key, &encode(self.generation, &block, name), cas) {
                Err(HostError::CasMismatch) => continue,
                _ => return,
            }
        }
    }
}

/// Whether two byte strings are equal, compared 8 bytes at a time (wasi-libc's `memcmp`, which `==` calls,
/// goes byte by byte: ~15 wasm instructions per byte of a limiter name on every blocked request).
pub fn same_bytes(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let (a_words, b_words) = (a.chunks_exact(8), b.chunks_exact(8));
    let tails_equal = a_words.remainder().iter().zip(b_words.remainder()).all(|(x, y)| x == y);
    tails_equal
        && a_words.zip(b_words).all(|(x, y)| {
            let word = |bytes: &[u8]| bytes.try_into().map_or(0, u64::from_ne_bytes);
            word(x) == word(y)
        })
}

/// An entry: version, generation (u32), until (u64), available (u32), rate (u32), interval (u64), release
/// (u64), all little-endian, then the limiter name.
fn encode(generation: u32, block: &Block, name: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER + name.len());
    out.push(VERSION);
    out.extend_from_slice(&generation.to_le_bytes());
    out.extend_from_slice(&block.until_ms.to_le_bytes());
    out.extend_from_slice(&u32::try_from(block.available).unwrap_or(u32::MAX).to_le_bytes());
    out.extend_from_slice(&u32::try_from(block.rate).unwrap_or(u32::MAX).to_le_bytes());
    out.extend_from_slice(&block.interval_ms.to_le_bytes());
    out.extend_from_slice(&block.release_ms.to_le_bytes());
    out.extend_from_slice(name.as_bytes());
    out
}

/// An entry's generation, block and limiter name; `None` for anything else (another version, too short).
fn decode(bytes: &[u8]) -> Option<(u32, Block, &[u8])> {
    let u32_at = |at: usize| bytes.get(at..at + 4).and_then(|b| b.try_into().ok()).map(u32::from_le_bytes);
    let u64_at = |at: usize| bytes.get(at..at + 8).and_then(|b| b.try_into().ok()).map(u64::from_le_bytes);
    if *bytes.first()? != VERSION {
        return None;
    }
    let block = Block {
        until_ms: u64_at(5)?,
        available: u64::from(u32_at(13)?),
        rate: u64::from(u32_at(17)?),
        interval_ms: u64_at(21)?,
        release_ms: u64_at(29)?,
    };
    Some((u32_at(1)?, block, bytes.get(HEADER..)?))
}

/// The live blocks this VM read or recorded last, kept in the VM ([`RecentBlocks::SLOTS`] entries, one per
/// value of the name's hash modulo that, the newest wins): under an attack on a few keys their requests are
/// rejected without a shared data read (a hostcall, and a call back into the module to allocate the value).
/// As exact as the entry it copies: what a block states (no permit leaves before its end, no more than
/// `available` free) stays true until its end whatever other VMs record meanwhile. A kept block that would
/// let a request through is not the last word: another VM may have recorded a newer one (fewer permits
/// free), so shared data is read then, as it is once the kept one has ended.
#[derive(Debug, Default)]
pub struct RecentBlocks {
    slots: [Option<(String, Block)>; RecentBlocks::SLOTS],
}

impl RecentBlocks {
    /// Blocks kept.
    pub const SLOTS: usize = 8;

    fn slot(hash: u64) -> usize {
        (hash % RecentBlocks::SLOTS as u64) as usize
    }

    /// The live block of limiter `name` (whose [`fnv1a`] is `hash`) at `now_ms`, if kept.
    pub fn find(&self, name: &str, hash: u64, now_ms: u64) -> Option<Block> {
        match self.slots.get(Self::slot(hash)) {
            Some(Some((kept, block))) if now_ms < block.until_ms && same_bytes(kept.as_bytes(), name.as_bytes()) => {
                Some(*block)
            }
            _ => None,
        }
    }

    /// Keeps `block` of limiter `name` in its slot (reusing the slot's name buffer).
    pub fn keep(&mut self, name: &str, hash: u64, block: Block) {
        let Some(slot) = self.slots.get_mut(Self::slot(hash)) else { return };
        match slot {
            Some((kept, kept_block)) => {
                kept.clear();
                kept.push_str(name);
                *kept_block = block;
            }
            None => *slot = Some((name.into(), block)),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]
    use super::*;
    use crate::testing::FakeHost;

    const TABLE: BlockTable = BlockTable { slots: 4096, generation: 7 };

    fn block(until_ms: u64, available: u64) -> Block {
        Block { until_ms, release_ms: until_ms + 50_000, available, rate: 10, interval_ms: 60_000 }
    }

    #[test]
    fn a_block_is_found_by_every_vm_until_it_ends() {
        let host = FakeHost::new();
        let other_vm = host.sibling();
        TABLE.record(&host, "erl:u:alice", block(2_000, 1), 1_000);
        assert_eq!(TABLE.find(&other_vm, "erl:u:alice", 1_999), Some(block(2_000, 1)));
        assert_eq!(TABLE.find(&other_vm, "erl:u:alice", 2_000), None, "ended");
        assert_eq!(TABLE.find(&other_vm, "erl:u:bob", 1_000), None);
        let next_config = BlockTable { generation: 8, ..TABLE };
        assert_eq!(next_config.find(&other_vm, "erl:u:alice", 1_000), None, "a configuration change forgets it");
    }

    #[test]
    fn a_shared_slot_never_blocks_another_limiter_and_the_longer_block_stays() {
        let host = FakeHost::new();
        let one_slot = BlockTable { slots: 1, ..TABLE };
        one_slot.record(&host, "a", block(5_000, 0), 1_000);
        one_slot.record(&host, "b", block(3_000, 0), 1_000);
        assert_eq!(one_slot.find(&host, "b", 1_000), None, "a's block ends later: it stays");
        assert_eq!(one_slot.find(&host, "a", 1_000), Some(block(5_000, 0)));
        one_slot.record(&host, "b", block(9_000, 0), 1_000);
        assert_eq!(one_slot.find(&host, "a", 1_000), None);
        assert_eq!(one_slot.find(&host, "b", 1_000), Some(block(9_000, 0)));
        one_slot.record(&host, "a", block(2_000, 0), 9_500);
        assert_eq!(one_slot.find(&host, "a", 9_500), None, "b's ended block makes room, but a's new one ended too");
        one_slot.record(&host, "a", block(12_000, 0), 9_500);
        assert_eq!(one_slot.find(&host, "a", 9_500), Some(block(12_000, 0)));
    }

    #[test]
    fn memory_is_bounded_by_the_slots_whatever_the_number_of_limiters() {
        let host = FakeHost::new();
        let table = BlockTable { slots: 64, ..TABLE };
        for i in 0..10_000 {
            table.record(&host, &format!("erl:u:user-{i}"), block(1_000_000 + i, 0), 1_000);
        }
        let keys: Vec<String> = (0..64).map(|slot| format!("{KEY_PREFIX}{slot}")).collect();
        let used = keys.iter().filter(|key| host.shared_data(key).is_some()).count();
        assert!(used <= 64 && used > 50, "{used} slots used");
        assert_eq!(host.shared_data_len(), used, "no other key is written");
    }

    #[test]
    fn names_compare_as_bytes() {
        for (a, b) in [("", ""), ("erl:u:alice", "erl:u:alice"), ("erl:u:alice", "erl:u:alicf"), ("a", "ab")] {
            assert_eq!(same_bytes(a.as_bytes(), b.as_bytes()), a == b, "{a} {b}");
        }
        let long = "erl:per-user:0123456789abcdef0123456789";
        assert!(same_bytes(long.as_bytes(), long.as_bytes()));
        assert!(!same_bytes(long.as_bytes(), long.replace('0', "x").as_bytes()));
    }

    #[test]
    fn entries_of_another_layout_or_truncated_are_ignored() {
        assert_eq!(decode(&[]), None);
        assert_eq!(decode(&[2; 40]), None);
        assert_eq!(decode(&encode(1, &block(5, 1), "n")[..20]), None);
        let entry = encode(9, &block(5, 1), "erl:n");
        let (generation, decoded, name) = decode(&entry).unwrap();
        assert_eq!((generation, decoded, name), (9, block(5, 1), &b"erl:n"[..]));
        assert_ne!(generation_of(b"{\"a\":1}"), generation_of(b"{\"a\":2}"));
    }
}
