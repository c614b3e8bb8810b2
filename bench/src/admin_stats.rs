//! Reading an Envoy's admin `/stats`: counters and gauges (live values), and
//! histograms as detailed buckets, which merge across Envoys (several replicas)
//! before a quantile is taken.
//!
//! Envoy merges histograms only at its stats flush (every 5 s by default), so a
//! histogram read right after traffic can miss the last few seconds' samples:
//! callers that need them all wait for a flush (see `crate::gateway_cost`).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use serde::Deserialize;

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .no_proxy()
        .build()
        .expect("a plain HTTP client builds")
}

/// Counters and gauges whose name matches `filter` (Envoy's regex filter), by full
/// name (`wasmcustom.kvroute.peer.bytes`). Empty if the admin does not answer.
pub async fn counters(admin: &str, filter: &str) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    let Ok(resp) = client()
        .get(format!("{admin}/stats"))
        .query(&[("filter", filter)])
        .send()
        .await
    else {
        return out;
    };
    let Ok(text) = resp.text().await else {
        return out;
    };
    for line in text.lines() {
        // Histograms print quantiles here, not an integer: skipped.
        if let Some((k, v)) = line.split_once(": ") {
            if let Ok(v) = v.trim().parse() {
                out.insert(k.to_string(), v);
            }
        }
    }
    out
}

/// One bucket of a detailed Envoy histogram: `count` samples in
/// `[lower_bound, lower_bound + width)`.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
pub struct Bucket {
    /// Lower bound of the bucket.
    pub lower_bound: f64,
    /// Width of the bucket.
    pub width: f64,
    /// Samples in it.
    pub count: u64,
}

#[derive(Deserialize)]
struct StatsJson {
    stats: Vec<StatsEntry>,
}

#[derive(Deserialize)]
struct StatsEntry {
    histograms: Option<HistogramsJson>,
}

#[derive(Deserialize)]
struct HistogramsJson {
    #[serde(default)]
    details: Vec<Detail>,
}

#[derive(Deserialize)]
struct Detail {
    name: String,
    #[serde(default)]
    totals: Vec<Bucket>,
}

/// The cumulative buckets (as of Envoy's last stats flush) of the histogram whose
/// name ends with `suffix`, from `/stats?format=json&histogram_buckets=detailed`.
/// Empty if there is none (yet) or the admin does not answer.
pub async fn histogram(admin: &str, filter: &str, suffix: &str) -> Vec<Bucket> {
    let Ok(resp) = client()
        .get(format!("{admin}/stats"))
        .query(&[
            ("format", "json"),
            ("histogram_buckets", "detailed"),
            ("filter", filter),
        ])
        .send()
        .await
    else {
        return Vec::new();
    };
    let Ok(text) = resp.text().await else {
        return Vec::new();
    };
    parse_histogram(&text, suffix)
}

/// The histograms named `*suffix` of every Envoy in `admins`, merged.
pub async fn merged_histogram(admins: &[&str], filter: &str, suffix: &str) -> Vec<Bucket> {
    let mut buckets = Vec::new();
    for admin in admins {
        buckets.extend(histogram(admin, filter, suffix).await);
    }
    buckets
}

/// [`merged_histogram`] once Envoy's stats flush (every 5 s) has caught up
/// with `samples` samples, or after `within`.
pub async fn flushed_histogram(
    admins: &[&str],
    filter: &str,
    suffix: &str,
    samples: u64,
    within: Duration,
) -> Vec<Bucket> {
    let deadline = Instant::now() + within;
    loop {
        let buckets = merged_histogram(admins, filter, suffix).await;
        if total(&buckets) >= samples || Instant::now() >= deadline {
            return buckets;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// The buckets of the histogram named `*suffix` in an admin JSON answer.
pub fn parse_histogram(json: &str, suffix: &str) -> Vec<Bucket> {
    let Ok(s) = serde_json::from_str::<StatsJson>(json) else {
        return Vec::new();
    };
    s.stats
        .into_iter()
        .filter_map(|e| e.histograms)
        .flat_map(|h| h.details)
        .filter(|d| d.name.ends_with(suffix))
        .flat_map(|d| d.totals)
        .collect()
}

/// Samples in `buckets`.
pub fn total(buckets: &[Bucket]) -> u64 {
    buckets.iter().map(|b| b.count).sum()
}

/// Quantile `q` (0..=1) of `buckets` (from one or several histograms, in any order),
/// interpolated linearly within the bucket it falls in; `None` without samples.
pub fn quantile(buckets: &[Bucket], q: f64) -> Option<f64> {
    let n = total(buckets);
    if n == 0 {
        return None;
    }
    let mut sorted = buckets.to_vec();
    sorted.sort_by(|a, b| a.lower_bound.total_cmp(&b.lower_bound));
    // The same bucket from several histograms counts once, with their samples summed.
    sorted.dedup_by(|next, kept| {
        let same = next.lower_bound == kept.lower_bound && next.width == kept.width;
        if same {
            kept.count += next.count;
        }
        same
    });
    let target = q.clamp(0.0, 1.0) * n as f64;
    let mut seen = 0.0;
    for b in sorted.iter().filter(|b| b.count > 0) {
        let c = b.count as f64;
        if seen + c >= target {
            return Some(b.lower_bound + b.width * ((target - seen) / c).clamp(0.0, 1.0));
        }
        seen += c;
    }
    sorted.last().map(|b| b.lower_bound + b.width)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_envoy_detailed_histograms() {
        // Envoy 1.40's answer (abridged) to /stats?format=json&histogram_buckets=detailed.
        let json = r#"{"stats":[{"name":"x","value":1},{"histograms":{"supported_percentiles":[0,50],
            "details":[{"name":"wasmcustom.kvroute.peer.lag_ms","totals":[{"lower_bound":10,"width":1,"count":3},
            {"lower_bound":40,"width":2,"count":1}],"intervals":[],"percentiles":[]},
            {"name":"other","totals":[{"lower_bound":1,"width":1,"count":9}]}]}}]}"#;
        let b = parse_histogram(json, "kvroute.peer.lag_ms");
        assert_eq!(b.len(), 2);
        assert_eq!(total(&b), 4);
        assert!(parse_histogram("not json", "x").is_empty());
    }

    #[test]
    fn quantiles_of_merged_buckets() {
        let b = |lower_bound, width, count| Bucket {
            lower_bound,
            width,
            count,
        };
        assert_eq!(quantile(&[], 0.5), None);
        // Two replicas' buckets, unsorted: 10 samples in [0, 10), 10 in [100, 110).
        let merged = [b(100.0, 10.0, 6), b(0.0, 10.0, 10), b(100.0, 10.0, 4)];
        assert_eq!(quantile(&merged, 0.25), Some(5.0));
        assert_eq!(quantile(&merged, 0.5), Some(10.0));
        let p99 = quantile(&merged, 0.99).unwrap();
        assert!((p99 - 109.8).abs() < 1e-9, "{p99}");
        assert_eq!(quantile(&merged, 1.0), Some(110.0));
    }
}
