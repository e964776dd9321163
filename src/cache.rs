//! The per-VM cache of limiter configs as Redis holds them, keyed by limiter name, bounded in size.
//!
//! Every acquire reply carries the limiter's config, so the cache costs no round trip. It lets the filter
//! notice (and log once) when Redis holds another rate than the configuration. Nothing the filter must
//! remember for correctness lives here: which limiters took a rule's config (`rate_source: config`) is
//! recorded in Redis itself (see [`crate::script::ACQUIRE`]), so evicting an entry costs at most one more
//! log line.
//!
//! Eviction is least-recently-used (the `lru` crate): a limiter seen on every request stays, while the
//! one-off keys of a scan of per-user or per-IP limiters are the ones that leave.

use crate::prelude::*;

use core::num::NonZeroUsize;

use lru::LruCache;

use crate::script::EffectiveConfig;

/// What the cache learned from one reply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Observation {
    /// The limiter was not in the cache (never seen, or evicted since).
    New,
    /// Redis holds the config the cache already had.
    Unchanged,
    /// Redis now holds another config than the cache had (changed by an operator or a Java service).
    Changed(EffectiveConfig),
}

/// Limiter name -> config in Redis, at most `capacity` entries, least recently used evicted first.
#[derive(Debug)]
pub struct LimiterCache {
    entries: LruCache<String, EffectiveConfig, KeyedSip>,
}

/// SipHash-2-4 keyed with random keys (names come from requests: a keyed hash keeps a client from
/// choosing names that collide). core's `SipHasher`, deprecated only in favour of std's `DefaultHasher`
/// (the same hash, which a `no_std` module cannot use); ~3 KB less code than hashbrown's foldhash.
#[derive(Debug, Clone, Copy)]
struct KeyedSip(u64, u64);

impl core::hash::BuildHasher for KeyedSip {
    #[allow(deprecated)]
    type Hasher = core::hash::SipHasher;

    #[allow(deprecated)]
    fn build_hasher(&self) -> Self::Hasher {
        core::hash::SipHasher::new_with_keys(self.0, self.1)
    }
}

impl LimiterCache {
    /// An empty cache of at most `capacity` limiter names (at least 1), hashed with keys from `seed`.
    pub fn new(capacity: usize, seed: [u64; 2]) -> Self {
        let capacity = NonZeroUsize::new(capacity).unwrap_or(NonZeroUsize::MIN);
        LimiterCache { entries: LruCache::with_hasher(capacity, KeyedSip(seed[0], seed[1])) }
    }

    /// The config last seen in Redis for `name` (without counting as a use).
    pub fn get(&self, name: &str) -> Option<EffectiveConfig> {
        self.entries.peek(name).copied()
    }

    /// Records the config Redis returned for `name` (a use: it becomes the most recent entry). When the
    /// cache is full, the least recently used entry makes room.
    pub fn observe(&mut self, name: &str, config: EffectiveConfig) -> Observation {
        if let Some(known) = self.entries.get_mut(name) {
            if *known == config {
                return Observation::Unchanged;
            }
            let old = core::mem::replace(known, config);
            return Observation::Changed(old);
        }
        self.entries.push(name.to_string(), config);
        Observation::New
    }

    /// How many limiter names the cache holds.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether the cache holds no limiter.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]
    use super::*;
    use crate::config::LimiterType;

    fn config(rate: u64) -> EffectiveConfig {
        EffectiveConfig { rate, interval_ms: 1000, limiter_type: LimiterType::Overall }
    }

    #[test]
    fn observations_report_new_unchanged_and_changed_configs() {
        let mut cache = LimiterCache::new(10, [1, 2]);
        assert_eq!(cache.observe("a", config(5)), Observation::New);
        assert_eq!(cache.observe("a", config(5)), Observation::Unchanged);
        assert_eq!(cache.observe("a", config(3)), Observation::Changed(config(5)));
        assert_eq!(cache.get("a"), Some(config(3)));
        assert_eq!(cache.get("b"), None);
    }

    #[test]
    fn the_least_recently_used_limiter_leaves_first() {
        let mut cache = LimiterCache::new(3, [1, 2]);
        for name in ["hot", "a", "b"] {
            cache.observe(name, config(1));
        }
        for i in 0..100 {
            cache.observe("hot", config(1));
            cache.observe(&format!("one-off-{i}"), config(1));
            assert!(cache.len() <= 3, "{} entries", cache.len());
            assert_eq!(cache.get("hot"), Some(config(1)), "a limiter used on every request stays (step {i})");
        }
        assert_eq!(cache.get("a"), None);
        assert_eq!(cache.get("one-off-99"), Some(config(1)), "the newest entry is kept");
        assert_eq!(cache.get("one-off-97"), None);
    }
}
