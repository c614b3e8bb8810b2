//! # overload filter
//!
//! **What**: in the `weighted` profile, an endpoint whose queue is far
//! longer than the least loaded endpoint's is not a candidate at all, however
//! much of the prompt it holds. Weighted scores saturate (a queue 64 deep
//! scores the same 0 as one 9 deep), so without this a fully matched
//! endpoint keeps winning on its prefix weight while its queue grows: the
//! hot spot llm-d's default weighted profile is known for. Waiting behind
//! many requests costs far more than recomputing a prefix elsewhere.
//!
//! **Formula**:
//!
//! ```text
//! queue(c) = effective_queue(c)   (scraped waiting + in-flight excess, see plugin.rs)
//! keep     = { c in kept | queue(c) unknown or queue(c) - min_{kept} queue <= gate_max_queue_excess }
//! ```
//!
//! Candidates without a fresh snapshot are kept (no evidence of overload).
//! Never empties the set: the least loaded candidate always passes.
//!
//! **Inputs**: snapshot `waiting`/`running`, `inflight.requests`.
//! **Config**: `scheduling.gate_max_queue_excess` (default 8 requests), the
//! same threshold at which the `affinity_gate` profile opens its gate.
//! **Operational notes**: the in-flight excess makes this react within a
//! scrape interval when kvroute itself piles requests onto a queueing
//! endpoint.

use super::super::plugin::{effective_queue, Context, Filter, Note};

/// Drops candidates queueing far more than the least loaded one.
#[derive(Clone, Copy, Debug, Default)]
pub struct OverloadFilter;

impl Filter for OverloadFilter {
    fn name(&self) -> &'static str {
        "overload"
    }

    fn filter(&self, ctx: &Context, kept: &mut Vec<usize>) -> Option<Note> {
        let queue = |i: usize| effective_queue(&ctx.candidates[i]);
        let min = kept.iter().filter_map(|&i| queue(i)).reduce(f64::min)?;
        let limit = min + ctx.config.gate_max_queue_excess;
        kept.retain(|&i| queue(i).is_none_or(|q| q <= limit));
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::SchedulingConfig;
    use crate::scheduler::test_support::cand;
    use crate::scheduler::RequestFacts;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn overload_table() {
        // waiting per candidate (None = no fresh snapshot), expected kept.
        let cases: &[(&[Option<f64>], &[usize])] = &[
            (&[Some(0.0), Some(64.0), Some(2.0)], &[0, 2]),
            (&[Some(0.0), Some(8.0)], &[0, 1]),
            (&[Some(0.0), Some(8.5)], &[0]),
            (&[Some(30.0), Some(40.0)], &[0]),
            (&[None, Some(64.0), Some(1.0)], &[0, 2]),
            (&[None, None], &[0, 1]),
            (&[Some(5.0)], &[0]),
        ];
        let cfg = SchedulingConfig::default();
        let req = RequestFacts::default();
        for (waits, want) in cases {
            let cands: Vec<_> = waits
                .iter()
                .enumerate()
                .map(|(i, w)| {
                    let mut c = cand(i);
                    match w {
                        Some(w) => c.snapshot.as_mut().unwrap().waiting = *w,
                        None => c.snapshot = None,
                    }
                    c
                })
                .collect();
            let ctx = Context {
                req: &req,
                candidates: &cands,
                config: &cfg,
            };
            let mut kept: Vec<usize> = (0..cands.len()).collect();
            assert_eq!(OverloadFilter.filter(&ctx, &mut kept), None);
            assert_eq!(&kept[..], *want, "{waits:?}");
        }
    }
}
