//! Measurement math: latency percentiles (HdrHistogram), load imbalance, and reading
//! the pods' Prometheus counters.

use hdrhistogram::Histogram;
use serde::Serialize;

/// Percentiles of one latency distribution, in (simulated) milliseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Percentiles {
    /// Median.
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 99th percentile.
    pub p99: f64,
    /// Mean.
    pub mean: f64,
    /// Samples.
    pub count: u64,
}

/// Recorder of latencies with 3 significant digits, microsecond resolution.
#[derive(Debug, Clone)]
pub struct LatencyRecorder {
    hist: Histogram<u64>,
}

impl Default for LatencyRecorder {
    fn default() -> Self {
        Self::new()
    }
}

impl LatencyRecorder {
    /// An empty recorder (1 us .. 1 hour).
    pub fn new() -> Self {
        LatencyRecorder {
            hist: Histogram::new_with_bounds(1, 3_600_000_000, 3).expect("valid bounds"),
        }
    }

    /// Records one sample in milliseconds (clamped to the bounds).
    pub fn record_ms(&mut self, ms: f64) {
        let us = (ms * 1000.0).round().clamp(1.0, 3_600_000_000.0) as u64;
        self.hist.saturating_record(us);
    }

    /// The percentiles, in milliseconds.
    pub fn percentiles(&self) -> Percentiles {
        if self.hist.is_empty() {
            return Percentiles::default();
        }
        let q = |p: f64| self.hist.value_at_quantile(p) as f64 / 1000.0;
        Percentiles {
            p50: q(0.50),
            p90: q(0.90),
            p99: q(0.99),
            mean: self.hist.mean() / 1000.0,
            count: self.hist.len(),
        }
    }
}

/// Load imbalance: the busiest pod's count over the mean (1.0 = perfectly even).
pub fn imbalance(per_pod: &[u64]) -> f64 {
    if per_pod.is_empty() {
        return 1.0;
    }
    let total: u64 = per_pod.iter().sum();
    if total == 0 {
        return 1.0;
    }
    let mean = total as f64 / per_pod.len() as f64;
    *per_pod.iter().max().expect("non-empty") as f64 / mean
}

/// Sum of every sample of the Prometheus `family` (any labels) in `text`.
pub fn prom_sum(text: &str, family: &str) -> Option<f64> {
    let mut found = None;
    for line in text.lines() {
        if line.starts_with('#') {
            continue;
        }
        let Some(rest) = line.strip_prefix(family) else {
            continue;
        };
        if !(rest.starts_with('{') || rest.starts_with(' ')) {
            continue;
        }
        let value = rest.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok());
        if let Some(v) = value {
            *found.get_or_insert(0.0) += v;
        }
    }
    found
}

/// Up to `n` points of the empirical CDF of `samples` (value, fraction <= value).
pub fn cdf(samples: &[f64], n: usize) -> Vec<(f64, f64)> {
    let mut v: Vec<f64> = samples.iter().copied().filter(|x| x.is_finite()).collect();
    v.sort_by(|a, b| a.total_cmp(b));
    if v.is_empty() || n == 0 {
        return Vec::new();
    }
    let step = (v.len() as f64 / n as f64).max(1.0);
    let mut out = Vec::new();
    let mut i = 0.0;
    while (i as usize) < v.len() {
        let idx = i as usize;
        out.push((v[idx], (idx + 1) as f64 / v.len() as f64));
        i += step;
    }
    out.push((v[v.len() - 1], 1.0));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_of_uniform_samples() {
        let mut r = LatencyRecorder::new();
        for i in 1..=1000 {
            r.record_ms(i as f64);
        }
        let p = r.percentiles();
        assert_eq!(p.count, 1000);
        assert!((p.p50 - 500.0).abs() <= 1.0, "{p:?}");
        assert!((p.p90 - 900.0).abs() <= 1.0, "{p:?}");
        assert!((p.p99 - 990.0).abs() <= 1.0, "{p:?}");
        assert!((p.mean - 500.5).abs() < 1.0);
        assert_eq!(LatencyRecorder::new().percentiles(), Percentiles::default());
    }

    #[test]
    fn imbalance_is_max_over_mean() {
        assert_eq!(imbalance(&[10, 10, 10, 10]), 1.0);
        assert_eq!(imbalance(&[20, 10, 5, 5]), 2.0);
        assert_eq!(imbalance(&[]), 1.0);
        assert_eq!(imbalance(&[0, 0]), 1.0);
    }

    #[test]
    fn reads_prometheus_families() {
        let text = "# HELP vllm:prefix_cache_hits_total x\nvllm:prefix_cache_hits_total{engine=\"0\",model_name=\"m\"} 48.0\n\
                    vllm:prefix_cache_hits_created{engine=\"0\"} 1.7e9\nvllm:prefix_cache_hits_total{engine=\"1\"} 2.0\n";
        assert_eq!(prom_sum(text, "vllm:prefix_cache_hits_total"), Some(50.0));
        assert_eq!(prom_sum(text, "vllm:prefix_cache_hits"), None);
        assert_eq!(prom_sum(text, "vllm:num_requests_waiting"), None);
    }

    #[test]
    fn cdf_is_monotone_and_ends_at_one() {
        let c = cdf(&[3.0, 1.0, 2.0, 4.0], 10);
        assert_eq!(c.first(), Some(&(1.0, 0.25)));
        assert_eq!(c.last(), Some(&(4.0, 1.0)));
        assert!(c.windows(2).all(|w| w[0].0 <= w[1].0 && w[0].1 <= w[1].1));
    }
}
