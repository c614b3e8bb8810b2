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

use super::super::figures::kept_entries;
use super::super::plugin::{Context, Filter, Note};

/// Drops candidates queueing far more than the least loaded one.
#[derive(Clone, Copy, Debug, Default)]
pub struct OverloadFilter;

impl Filter for OverloadFilter {
    fn name(&self) -> &'static str {
        "overload"
    }

    fn filter(&self, ctx: &Context, kept: &mut Vec<usize>) -> Option<Note> {
        // Each candidate read once (at 1024 endpoints a second strided pass
        // over the candidates cost more than the arithmetic).
        // Unknown (no fresh snapshot) is NaN: a queue is never NaN itself.
        let mut scratch = Vec::new();
        let queues = kept_entries(ctx.figures.queue(), kept, &mut scratch);
        let (min, max) = extremes_ignoring_nan(queues)?;
        let limit = min + ctx.config.gate_max_queue_excess;
        if max <= limit {
            return None; // nobody is over (the usual case): nothing to drop
        }
        let queue = ctx.figures.queue();
        kept.retain(|&i| queue[i].is_nan() || queue[i] <= limit);
        None
    }
}

/// The least and the greatest non-NaN value of `xs` (`None` if every
/// value is NaN): `xs.iter().filter(|x| !x.is_nan())` reduced with
/// `f64::min` and `f64::max`, in four independent chains of plain
/// comparisons instead of one chain of NaN-aware extremes.
fn extremes_ignoring_nan(xs: &[f64]) -> Option<(f64, f64)> {
    let mut lo = [f64::INFINITY; 4];
    let mut hi = [f64::NEG_INFINITY; 4];
    let mut number = false;
    for (i, &x) in xs.iter().enumerate() {
        number |= !x.is_nan();
        // A NaN compares false: skipped.
        let lane = i & 3;
        if x < lo[lane] {
            lo[lane] = x;
        }
        if x > hi[lane] {
            hi[lane] = x;
        }
    }
    number.then(|| {
        (
            lo.into_iter().fold(f64::INFINITY, f64::min),
            hi.into_iter().fold(f64::NEG_INFINITY, f64::max),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::SchedulingConfig;
    use crate::scheduler::figures::Figures;
    use crate::scheduler::test_support::cand;
    use crate::scheduler::RequestFacts;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn extremes_ignoring_nan_are_the_reduces_they_replaced() {
        let mut rng = fastrand::Rng::with_seed(5);
        let odd = [f64::NAN, f64::INFINITY, f64::NEG_INFINITY];
        for _ in 0..5000 {
            let xs: Vec<f64> = (0..rng.usize(0..11))
                .map(|_| match rng.u8(0..6) {
                    0 | 1 => odd[rng.usize(..odd.len())],
                    _ => f64::from(rng.u8(0..9)),
                })
                .collect();
            let numbers = || xs.iter().copied().filter(|x| !x.is_nan());
            let want = numbers().reduce(f64::min).zip(numbers().reduce(f64::max));
            let got = extremes_ignoring_nan(&xs);
            assert_eq!(got, want, "{xs:?}");
        }
    }

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
                figures: &Figures::measure(&req, &cands),
            };
            let mut kept: Vec<usize> = (0..cands.len()).collect();
            assert_eq!(OverloadFilter.filter(&ctx, &mut kept), None);
            assert_eq!(&kept[..], *want, "{waits:?}");
        }
    }
}
