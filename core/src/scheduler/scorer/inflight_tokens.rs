//! # inflight_tokens scorer
//!
//! **What**: token-load awareness. Prefers the endpoint that would finish
//! the prefill of *this* request soonest: the prompt tokens kvroute has
//! sent it that are not yet prefilled (released at the first response
//! chunk), plus the part of this request's prompt the endpoint does not
//! already hold.
//!
//! **Formula**:
//!
//! ```text
//! t(c)   = inflight.tokens + prompt_tokens * (1 - matched_blocks / total_blocks)
//! score  = 1 - (t(c) - min t) / max(max t - min t, min_range_tokens)
//! ```
//!
//! **Why**: request counts treat a 100-token chat turn and a 100k-token
//! document alike; prefill time grows with uncached tokens. The second term
//! makes the cost of abandoning a cached prefix grow with the prompt
//! length (long-context requests stick harder to their cache), and a
//! long cold prompt avoids an endpoint that is still prefilling others.
//! The floor (default 4096 tokens, a fraction of a second of prefill on one
//! GPU) keeps short-prompt noise from swinging the weight.
//!
//! **Config**: `scheduling.weights.inflight_tokens` (1),
//! `scheduling.min_range_tokens` (4096).

use super::super::plugin::{Context, Scale, Scorer};
use crate::config::Weights;

/// Less prefill work pending (including this request's) is better.
#[derive(Clone, Copy, Debug, Default)]
pub struct InFlightTokensScorer;

impl Scorer for InFlightTokensScorer {
    fn name(&self) -> &'static str {
        "inflight-tokens"
    }

    fn weight(&self, w: &Weights) -> f64 {
        w.inflight_tokens
    }

    fn figure<'a>(&self, ctx: &Context<'a>) -> Option<(&'a [f64], Scale)> {
        let floor = ctx.config.min_range_tokens;
        Some((ctx.figures.pending_tokens(), Scale::Spread { floor }))
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

    type Case = (
        &'static str,
        f64,
        (usize, u64),
        &'static [(u64, usize)],
        &'static [f64],
    );

    #[test]
    fn inflight_tokens_table() {
        // (what, floor, request (blocks, tokens), [(inflight tokens, matched)], scores)
        let cases: &[Case] = &[
            (
                "pending tokens",
                1000.0,
                (0, 0),
                &[(0, 0), (500, 0), (2000, 0)],
                &[1.0, 0.75, 0.0],
            ),
            ("floor", 4096.0, (0, 0), &[(0, 0), (1024, 0)], &[1.0, 0.75]),
            (
                "this request's uncached part counts",
                0.0,
                (10, 8000),
                // t = 0 + 8000*(1-1) = 0 ; 0 + 8000 = 8000 ; 2000 + 4000 = 6000
                &[(0, 10), (0, 0), (2000, 5)],
                &[1.0, 0.0, 0.25],
            ),
            ("all equal", 0.0, (4, 100), &[(5, 0), (5, 0)], &[1.0, 1.0]),
        ];
        for (what, floor, (blocks, tokens), rows, want) in cases {
            let cfg = SchedulingConfig {
                min_range_tokens: *floor,
                ..SchedulingConfig::default()
            };
            let req = RequestFacts {
                total_blocks: *blocks,
                prompt_tokens: *tokens,
                affinity_key: None,
                first_block: None,
                adapter: None,
            };
            let cands: Vec<_> = rows
                .iter()
                .enumerate()
                .map(|(i, &(t, m))| {
                    let mut c = cand(i);
                    c.inflight.tokens = t;
                    c.matched_blocks = m;
                    c
                })
                .collect();
            let got = run(&InFlightTokensScorer, &req, &cands, &cfg);
            assert_eq!(&got[..], *want, "{what}");
        }
    }
}
