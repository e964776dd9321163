//! Hash maps keyed by the ids a proxy-wasm host hands out (context ids, call tokens): small sequential
//! integers the host chooses, never a client, so a multiplicative hash is enough and costs a handful of wasm
//! instructions where hashbrown's default hasher costs ~100 per lookup (docs/deploying.md, "Lean guest").

use core::hash::{BuildHasherDefault, Hasher};

/// A map from a host id to `V`.
pub type IdMap<V> = hashbrown::HashMap<u32, V, BuildHasherDefault<IdHasher>>;

/// A map from a call's [`crate::transport::CallId::key`] (its kind and the host's token) to `V`.
pub type CallMap<V> = hashbrown::HashMap<u64, V, BuildHasherDefault<IdHasher>>;

/// Fibonacci hashing of one integer: the id times 2^64 / φ, which spreads sequential ids over the high bits
/// hashbrown uses for its control bytes and the low bits it uses for buckets.
#[derive(Debug, Default, Clone, Copy)]
pub struct IdHasher(u64);

const GOLDEN: u64 = 0x9e37_79b9_7f4a_7c15;

impl Hasher for IdHasher {
    fn write(&mut self, bytes: &[u8]) {
        for &byte in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(byte)).wrapping_mul(GOLDEN);
        }
    }

    fn write_u32(&mut self, n: u32) {
        self.0 = (self.0 ^ u64::from(n)).wrapping_mul(GOLDEN);
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0 ^ n).wrapping_mul(GOLDEN);
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn sequential_ids_find_their_values() {
        let mut map = IdMap::default();
        for id in 0..5_000u32 {
            map.insert(id * 3, id);
        }
        assert!((0..5_000u32).all(|id| map.get(&(id * 3)) == Some(&id)));
        assert_eq!(map.get(&1), None);
        assert_eq!(map.remove(&300), Some(100));
        assert_eq!(map.len(), 4_999);
    }
}
