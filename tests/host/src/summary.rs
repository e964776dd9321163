//! Distributions for reports: count, mean, p50, p99 (nearest rank), min, max.

/// A summary of samples.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct Distribution {
    /// How many samples.
    pub count: usize,
    /// Their mean.
    pub mean: f64,
    /// The median (nearest rank).
    pub p50: f64,
    /// The 99th percentile (nearest rank).
    pub p99: f64,
    /// The smallest.
    pub min: f64,
    /// The largest.
    pub max: f64,
}

impl Distribution {
    /// Summarizes samples (an empty set gives zeros).
    pub fn of(samples: &[f64]) -> Self {
        if samples.is_empty() {
            return Distribution::default();
        }
        let mut sorted = samples.to_vec();
        sorted.sort_by(f64::total_cmp);
        let rank = |p: f64| -> f64 {
            let n = sorted.len();
            // Nearest rank: the smallest value with at least p% of the samples at or below it.
            let index = ((p / 100.0) * n as f64).ceil() as usize;
            sorted.get(index.clamp(1, n) - 1).copied().unwrap_or(0.0)
        };
        Distribution {
            count: sorted.len(),
            mean: sorted.iter().sum::<f64>() / sorted.len() as f64,
            p50: rank(50.0),
            p99: rank(99.0),
            min: sorted.first().copied().unwrap_or(0.0),
            max: sorted.last().copied().unwrap_or(0.0),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let samples: Vec<f64> = (1..=100).map(f64::from).collect();
        let d = Distribution::of(&samples);
        assert_eq!((d.count, d.p50, d.p99, d.min, d.max), (100, 50.0, 99.0, 1.0, 100.0));
        assert_eq!(d.mean, 50.5);
        assert_eq!(Distribution::of(&[]).count, 0);
    }
}
