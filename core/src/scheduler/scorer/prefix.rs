//! # prefix scorer
//!
//! **What**: rewards the endpoint that already holds the longest leading
//! part of the request's prompt in its KV cache (llm-d's
//! `prefix-cache-scorer`, default weight 3).
//!
//! **Formula**: `score = (matched_blocks + partial_block) / max(total_blocks,
//! 1)`, capped at 1 (`matched_blocks` is capped at `total_blocks`;
//! `partial_block`, a leaf in the next block, is below 1; 0 when nothing
//! matches).
//!
//! **Inputs**: `Candidate::matched_blocks` (from kvroute's prefix index,
//! which learns from each decision immediately), `RequestFacts::
//! total_blocks`. **Config**: `scheduling.weights.prefix` (default 3).
//!
//! **Operational notes**: with weight 3 against queue 2 + in-flight
//! requests 2 (+ KV 2, tokens 1), a 100% match survives moderate load
//! differences but loses once the endpoint is clearly overloaded; see the
//! weight rationale in `scheduler/mod.rs`.

use super::super::plugin::{Context, Scale, Scorer};
use crate::config::Weights;

/// Fraction of the request's blocks the endpoint holds.
#[derive(Clone, Copy, Debug, Default)]
pub struct PrefixScorer;

impl Scorer for PrefixScorer {
    fn name(&self) -> &'static str {
        "prefix"
    }

    fn weight(&self, w: &Weights) -> f64 {
        w.prefix
    }

    fn figure<'a>(&self, ctx: &Context<'a>) -> Option<(&'a [f64], Scale)> {
        Some((ctx.figures.prefix(), Scale::AsIs))
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
    fn prefix_table() {
        let cases: &[(usize, &[usize], &[f64])] = &[
            (10, &[0, 5, 10], &[0.0, 0.5, 1.0]),
            (4, &[1, 3], &[0.25, 0.75]),
            (4, &[9], &[1.0]),
            (0, &[0, 3], &[0.0, 0.0]),
        ];
        for (total, matched, want) in cases {
            let req = RequestFacts {
                total_blocks: *total,
                prompt_tokens: 100,
                affinity_key: None,
                first_block: None,
                adapter: None,
            };
            let cands: Vec<_> = matched
                .iter()
                .enumerate()
                .map(|(i, &m)| {
                    let mut c = cand(i);
                    c.matched_blocks = m;
                    c
                })
                .collect();
            let got = run(&PrefixScorer, &req, &cands, &SchedulingConfig::default());
            assert_eq!(&got[..], *want, "{total} {matched:?}");
        }
    }
}
