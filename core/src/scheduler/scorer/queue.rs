//! # queue scorer
//!
//! **What**: prefers endpoints with fewer requests waiting in the engine's
//! queue (llm-d's `queue-scorer`, default weight 2), corrected for the
//! requests kvroute itself sent since the last scrape.
//!
//! **Formula**:
//!
//! ```text
//! q(c)   = waiting + (waiting > 0 ? max(0, inflight.requests - (waiting + running)) : 0)
//! score  = 1 - (q(c) - min q) / max(max q - min q, min_range_requests)
//! ```
//!
//! (min/max over the kept candidates that have a fresh snapshot; all equal
//! -> every one scores 1; no fresh snapshot -> 0.5, neutral).
//!
//! **Why the correction**: the scrape is up to 50 ms old, and a burst sent
//! in between is invisible to it. kvroute's in-flight count beyond what the
//! engine reported (`waiting + running`) was sent after the scrape. On an
//! engine that was already queueing, those requests can only queue, so
//! they are added; on one that was not, they most likely run, and the
//! in-flight scorers count them instead (adding them here would push
//! sticky conversations off an endpoint that has room). If kvroute is not
//! the endpoint's only client the engine's figures exceed the in-flight
//! count, the correction is 0 and this is exactly llm-d's scorer.
//!
//! **Why the range floor**: pure min-max (llm-d) turns a 1-request
//! difference into the scorer's whole weight, which at low load makes
//! prefix affinity flap. With `min_range_requests = 4` (default) a queue
//! difference of d requests costs `weight * min(d / 4, 1)`; 0 restores
//! pure min-max.
//!
//! **Config**: `scheduling.weights.queue` (2), `scheduling.
//! min_range_requests` (4).

use super::super::plugin::{Context, Scale, Scorer};
use crate::config::Weights;

/// Fewer waiting requests is better.
#[derive(Clone, Copy, Debug, Default)]
pub struct QueueScorer;

impl Scorer for QueueScorer {
    fn name(&self) -> &'static str {
        "queue"
    }

    fn weight(&self, w: &Weights) -> f64 {
        w.queue
    }

    fn figure<'a>(&self, ctx: &Context<'a>) -> Option<(&'a [f64], Scale)> {
        // Unknown (no fresh snapshot) is NaN for `spread_scores`; a queue
        // is never NaN itself.
        let floor = ctx.config.min_range_requests;
        Some((ctx.figures.queue(), Scale::Spread { floor }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::SchedulingConfig;
    use crate::metrics::MetricsSnapshot;
    use crate::scheduler::plugin::NEUTRAL;
    use crate::scheduler::scorer::test_util::run;
    use crate::scheduler::test_support::cand;
    use crate::scheduler::RequestFacts;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    type Row = (Option<(f64, f64)>, u32);

    #[test]
    fn queue_table() {
        // (what, floor, [(snapshot (waiting, running), inflight)], scores)
        let cases: &[(&str, f64, &[Row], &[f64])] = &[
            (
                "pure min-max",
                0.0,
                &[
                    (Some((0.0, 0.0)), 0),
                    (Some((10.0, 0.0)), 0),
                    (Some((5.0, 0.0)), 0),
                ],
                &[1.0, 0.0, 0.5],
            ),
            (
                "equal values all 1",
                0.0,
                &[(Some((3.0, 1.0)), 0), (Some((3.0, 9.0)), 0)],
                &[1.0, 1.0],
            ),
            (
                "floor damps small differences",
                4.0,
                &[(Some((0.0, 0.0)), 0), (Some((1.0, 0.0)), 0)],
                &[1.0, 0.75],
            ),
            (
                "floor does not damp large ones",
                4.0,
                &[
                    (Some((0.0, 0.0)), 0),
                    (Some((20.0, 0.0)), 0),
                    (Some((10.0, 0.0)), 0),
                ],
                &[1.0, 0.0, 0.5],
            ),
            (
                "in-flight excess counts on a queueing endpoint",
                0.0,
                // q = 1 + (7 - (1 + 2)) = 5 vs 3
                &[
                    (Some((1.0, 2.0)), 7),
                    (Some((3.0, 0.0)), 0),
                    (Some((0.0, 0.0)), 0),
                ],
                &[0.0, 0.4, 1.0],
            ),
            (
                "not on an idle one",
                0.0,
                &[(Some((0.0, 0.0)), 7), (Some((2.0, 0.0)), 0)],
                &[1.0, 0.0],
            ),
            (
                "no snapshot is neutral",
                0.0,
                &[(None, 9), (Some((2.0, 0.0)), 0), (Some((4.0, 0.0)), 0)],
                &[NEUTRAL, 1.0, 0.0],
            ),
        ];
        let req = RequestFacts::default();
        for (what, floor, rows, want) in cases {
            let cfg = SchedulingConfig {
                min_range_requests: *floor,
                ..SchedulingConfig::default()
            };
            let cands: Vec<_> = rows
                .iter()
                .enumerate()
                .map(|(i, (s, inflight))| {
                    let mut c = cand(i);
                    c.snapshot = s.map(|(w, r)| MetricsSnapshot {
                        waiting: w,
                        running: r,
                        ..MetricsSnapshot::default()
                    });
                    c.inflight.requests = *inflight;
                    c
                })
                .collect();
            assert_eq!(&run(&QueueScorer, &req, &cands, &cfg)[..], *want, "{what}");
        }
    }
}
