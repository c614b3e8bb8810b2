//! # inflight_requests scorer
//!
//! **What**: prefers endpoints with fewer requests kvroute has sent and not
//! yet seen finish. This is kvroute's answer to herding between metric
//! polls (a burst that arrives within one 50 ms scrape interval): the
//! filter updates `Candidate::inflight` at the moment it routes, so the
//! next request already sees the previous one, on every worker (the table
//! is in shared data).
//!
//! **Formula**: `score = 1 - (r - min r) / max(max r - min r,
//! min_range_inflight)` with `r = inflight.requests`, min/max over the kept
//! candidates (every candidate has this figure, snapshot or not).
//!
//! **Config**: `scheduling.weights.inflight_requests` (2),
//! `scheduling.min_range_inflight` (8).
//!
//! **Why the floor is 8, twice the queue's**: requests in flight on an
//! engine that is not queueing mostly share its batch, so a few more of
//! them cost little, while leaving the endpoint that holds a conversation
//! costs its cache. With 8, a difference of `d` in-flight requests costs
//! `2 * min(d / 8, 1)`: a 50%-matched turn (1.5 points) stays until its
//! endpoint has 6 more requests than the emptiest one. Cold bursts are
//! still spread (by the picker's recency rule, and by this score once the
//! difference exceeds the picker's margin).
//!
//! **Operational notes**: counts only kvroute's traffic; other clients of
//! the same endpoint show up through the queue and KV scorers.

use super::super::plugin::{Context, Scale, Scorer};
use crate::config::Weights;

/// Fewer of kvroute's requests outstanding is better.
#[derive(Clone, Copy, Debug, Default)]
pub struct InFlightRequestsScorer;

impl Scorer for InFlightRequestsScorer {
    fn name(&self) -> &'static str {
        "inflight-requests"
    }

    fn weight(&self, w: &Weights) -> f64 {
        w.inflight_requests
    }

    fn figure<'a>(&self, ctx: &Context<'a>) -> Option<(&'a [f64], Scale)> {
        let floor = ctx.config.min_range_inflight;
        Some((ctx.figures.inflight_requests(), Scale::Spread { floor }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::SchedulingConfig;
    use crate::scheduler::scorer::test_util::run;
    use crate::scheduler::test_support::cand;
    use crate::scheduler::RequestFacts;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn inflight_requests_table() {
        let cases: &[(f64, &[u32], &[f64])] = &[
            (8.0, &[0, 2, 4], &[1.0, 0.75, 0.5]),
            (4.0, &[0, 1, 2], &[1.0, 0.75, 0.5]),
            (4.0, &[3, 3], &[1.0, 1.0]),
            (4.0, &[0, 10, 5], &[1.0, 0.0, 0.5]),
            (0.0, &[0, 1], &[1.0, 0.0]),
            (0.0, &[7, 7, 7], &[1.0, 1.0, 1.0]),
        ];
        for (floor, rs, want) in cases {
            let cfg = SchedulingConfig {
                min_range_inflight: *floor,
                ..SchedulingConfig::default()
            };
            let cands: Vec<_> = rs
                .iter()
                .enumerate()
                .map(|(i, &r)| {
                    let mut c = cand(i);
                    c.inflight.requests = r;
                    c
                })
                .collect();
            let got = run(
                &InFlightRequestsScorer,
                &RequestFacts::default(),
                &cands,
                &cfg,
            );
            assert_eq!(&got[..], *want, "{floor} {rs:?}");
        }
    }
}
