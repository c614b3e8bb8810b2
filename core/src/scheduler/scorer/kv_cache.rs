//! # kv_cache scorer
//!
//! **What**: prefers endpoints with free KV-cache memory (llm-d's
//! `kv-cache-utilization-scorer`, default weight 2). An engine whose KV
//! cache is full queues new requests or preempts running ones, and evicts
//! cached prefixes.
//!
//! **Formula**: `score = 1 - kv_usage` (usage 0..1 from the snapshot);
//! no fresh snapshot, or an engine that does not report usage: 0.5
//! (neutral). Absolute, not min-max: 30% vs 31% usage is no reason to move.
//!
//! **Config**: `scheduling.weights.kv_cache` (2).

use super::super::plugin::{Context, Scale, Scorer, NEUTRAL};
use crate::config::Weights;

/// Free KV-cache fraction.
#[derive(Clone, Copy, Debug, Default)]
pub struct KvCacheScorer;

impl Scorer for KvCacheScorer {
    fn name(&self) -> &'static str {
        "kv-cache"
    }

    fn weight(&self, w: &Weights) -> f64 {
        w.kv_cache
    }

    fn figure<'a>(&self, ctx: &Context<'a>) -> Option<(&'a [f64], Scale)> {
        Some((ctx.figures.kv_free(), Scale::AsIs))
    }
}

/// The score of an engine at `usage` (its KV-cache utilization, if known):
/// the free share, or neutral when unknown or not a number.
pub fn free_share(usage: Option<f64>) -> f64 {
    match usage {
        Some(u) if u.is_finite() => 1.0 - u.clamp(0.0, 1.0),
        _ => NEUTRAL,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::SchedulingConfig;
    use crate::metrics::MetricsSnapshot;
    use crate::scheduler::scorer::test_util::run;
    use crate::scheduler::test_support::cand;
    use crate::scheduler::RequestFacts;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn kv_table() {
        let cases: &[(Option<Option<f64>>, f64)] = &[
            (Some(Some(0.0)), 1.0),
            (Some(Some(0.25)), 0.75),
            (Some(Some(1.0)), 0.0),
            (Some(Some(1.5)), 0.0),
            (Some(Some(f64::NAN)), NEUTRAL),
            (Some(None), NEUTRAL),
            (None, NEUTRAL),
        ];
        let cands: Vec<_> = cases
            .iter()
            .enumerate()
            .map(|(i, (s, _))| {
                let mut c = cand(i);
                c.snapshot = s.map(|kv| MetricsSnapshot {
                    kv_usage: kv,
                    ..MetricsSnapshot::default()
                });
                c
            })
            .collect();
        let got = run(
            &KvCacheScorer,
            &RequestFacts::default(),
            &cands,
            &SchedulingConfig::default(),
        );
        let want: Vec<f64> = cases.iter().map(|c| c.1).collect();
        assert_eq!(got, want);
    }
}
