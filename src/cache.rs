//! The per-VM cache of limiter configs as Redis holds them, keyed by limiter name and bounded in size.
//!
//! Every acquire reply carries the limiter's config, so the cache costs no round trip. It lets the filter
//! notice (and log once) when Redis holds another rate than the configuration, and remember which limiters
//! already had the configured rate applied (`rate_source: config`), so it is applied once per limiter.

use std::collections::HashMap;

use crate::script::EffectiveConfig;

/// What the cache learned from one reply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Observation {
    /// The limiter was not in the cache.
    New,
    /// Redis holds the config the cache already had.
    Unchanged,
    /// Redis now holds another config than the cache had (changed by an operator or a Java service).
    Changed(EffectiveConfig),
}

#[derive(Debug)]
struct Entry {
    config: EffectiveConfig,
    /// The rule's config was applied to this limiter (`rate_source: config`) under the current plugin
    /// configuration (the cache is made anew with each configuration).
    applied: bool,
}

/// Limiter name -> config in Redis, at most `capacity` entries.
#[derive(Debug)]
pub struct LimiterCache {
    capacity: usize,
    entries: HashMap<String, Entry>,
}

impl LimiterCache {
    /// An empty cache of at most `capacity` limiter names (at least 1).
    pub fn new(capacity: usize) -> Self {
        LimiterCache { capacity: capacity.max(1), entries: HashMap::new() }
    }

    /// The config last seen in Redis for `name`.
    pub fn get(&self, name: &str) -> Option<EffectiveConfig> {
        self.entries.get(name).map(|entry| entry.config)
    }

    /// Whether the rule's config was applied to limiter `name` under this plugin configuration.
    pub fn is_applied(&self, name: &str) -> bool {
        self.entries.get(name).is_some_and(|entry| entry.applied)
    }

    /// Records that the rule's config was applied to (or found in) limiter `name`: it is not applied
    /// again under this plugin configuration, so a later change by an operator stands.
    pub fn mark_applied(&mut self, name: &str) {
        if let Some(entry) = self.entries.get_mut(name) {
            entry.applied = true;
        }
    }

    /// Records the config Redis returned for `name`. When the cache is full, an arbitrary entry makes room:
    /// an evicted limiter only loses the local shortcut until its next reply.
    pub fn observe(&mut self, name: &str, config: EffectiveConfig) -> Observation {
        if let Some(known) = self.entries.get_mut(name) {
            if known.config == config {
                return Observation::Unchanged;
            }
            let old = std::mem::replace(&mut known.config, config);
            return Observation::Changed(old);
        }
        if self.entries.len() >= self.capacity {
            if let Some(victim) = self.entries.keys().next().cloned() {
                self.entries.remove(&victim);
            }
        }
        self.entries.insert(name.to_string(), Entry { config, applied: false });
        Observation::New
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]
    use super::*;
    use crate::config::LimiterType;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn config(rate: u64) -> EffectiveConfig {
        EffectiveConfig { rate, interval_ms: 1000, limiter_type: LimiterType::Overall }
    }

    #[test]
    fn observations_report_new_unchanged_and_changed_configs() {
        let mut cache = LimiterCache::new(10);
        assert_eq!(cache.observe("a", config(5)), Observation::New);
        assert_eq!(cache.observe("a", config(5)), Observation::Unchanged);
        assert_eq!(cache.observe("a", config(3)), Observation::Changed(config(5)));
        assert_eq!(cache.get("a"), Some(config(3)));
        assert_eq!(cache.get("b"), None);
    }

    #[test]
    fn applied_marks_stick_to_their_limiter() {
        let mut cache = LimiterCache::new(10);
        cache.mark_applied("a");
        assert!(!cache.is_applied("a"), "an unknown limiter cannot be marked");
        cache.observe("a", config(5));
        cache.mark_applied("a");
        cache.observe("a", config(3));
        assert!(cache.is_applied("a"), "a later change in Redis does not undo the mark");
        assert!(!cache.is_applied("b"));
    }

    #[test]
    fn the_cache_never_grows_past_its_capacity() {
        let mut cache = LimiterCache::new(3);
        for i in 0..100 {
            cache.observe(&format!("limiter-{i}"), config(1));
            let remembered = (0..=i).filter(|j| cache.get(&format!("limiter-{j}")).is_some()).count();
            assert!(remembered <= 3, "{remembered} entries");
        }
        assert_eq!(cache.get("limiter-99"), Some(config(1)), "the newest entry is kept");
    }
}
