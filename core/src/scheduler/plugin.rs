//! The plugin contracts of the scheduler, in llm-d's Filter -> Score -> Pick
//! shape, plus the small helpers the plugins share.
//!
//! - A [`Filter`] narrows the candidate set (indices into the request's
//!   candidates) and may leave a [`Note`] for the decision's reason.
//! - A [`Scorer`] gives each kept candidate a raw score, meant to be in
//!   0..1 with 1 = best. Scorers are stateless and know nothing of weights:
//!   the engine in `scheduler/mod.rs` clamps every score to [0, 1] (`NaN`
//!   becomes 0), multiplies by the scorer's weight and sums; a weight of 0
//!   skips the scorer entirely. Most scorers only name a column of the
//!   candidates' [`Figures`] and its [`Scale`] (`Scorer::figure`): the
//!   engine then scales, weights and sums straight from the column.
//! - The picker (`scheduler/picker.rs`) takes the summed scores.
//!
//! Plugins are zero-sized and read their parameters from
//! [`Context::config`], so a profile is a static list of plugin references.

use super::figures::{kept_entries, Figures};
use super::{Candidate, RequestFacts};
use crate::config::{SchedulingConfig, Weights};
use crate::float::{min_num, non_negative};
use std::fmt;

/// Everything a plugin may read for one scheduling decision.
#[derive(Clone, Copy, Debug)]
pub struct Context<'a> {
    /// The request.
    pub req: &'a RequestFacts,
    /// All candidates of the request (plugins see indices into this).
    pub candidates: &'a [Candidate],
    /// The scheduling configuration.
    pub config: &'a SchedulingConfig,
    /// What the plugins read of each candidate, measured once
    /// (`figures.rs`).
    pub figures: &'a Figures,
}

/// What a filter observed, for the decision's [`Reason`](super::Reason).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Note {
    /// No candidate passed, so all were kept.
    Fallback,
    /// Prefix affinity removed candidates (the gate was closed).
    AffinityKept,
    /// Sticky candidates existed but the load gate opened.
    GateOpen,
}

/// Narrows the candidate set.
pub trait Filter: fmt::Debug + Sync {
    /// Short stable name (for logs and docs).
    fn name(&self) -> &'static str;
    /// Removes indices from `kept` (which is non-empty on entry and must be
    /// non-empty on return).
    fn filter(&self, ctx: &Context, kept: &mut Vec<usize>) -> Option<Note>;
}

/// Scores kept candidates, 0..1, 1 = most desirable.
pub trait Scorer: fmt::Debug + Sync {
    /// Short stable name (for logs and docs).
    fn name(&self) -> &'static str;
    /// This scorer's weight in `weights`.
    fn weight(&self, weights: &Weights) -> f64;
    /// Whether it scores this request at all (when not, its weight does not
    /// count either); every request by default.
    fn applies(&self, _req: &RequestFacts) -> bool {
        true
    }
    /// The column of the candidates' figures this scorer rates and how
    /// its values become scores, if that is all it does (the engine then
    /// scores from the column: [`Scale::add_weighted`]); `None` for a
    /// scorer that implements [`Scorer::score`] instead.
    fn figure<'a>(&self, _ctx: &Context<'a>) -> Option<(&'a [f64], Scale)> {
        None
    }
    /// Writes one score per entry of `kept` into `out` (cleared first). By
    /// default the scaled figure of each (neutral without one).
    fn score(&self, ctx: &Context, kept: &[usize], out: &mut Vec<f64>) {
        let Some((column, scale)) = self.figure(ctx) else {
            out.clear();
            out.resize(kept.len(), NEUTRAL);
            return;
        };
        let mut scratch = Vec::new();
        out.clear();
        out.extend_from_slice(kept_entries(column, kept, &mut scratch));
        scale.apply(out);
    }
}

/// How a scorer's figures become its scores.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Scale {
    /// The figure is the score (meant to be in 0..1).
    AsIs,
    /// Lower is better, spread over the kept candidates with a floor on
    /// the range: [`spread_scores`].
    Spread {
        /// The least range (`max - min`) the values are spread over.
        floor: f64,
    },
}

impl Scale {
    /// Turns the figures `xs` of the kept candidates into scores, in place.
    pub fn apply(self, xs: &mut [f64]) {
        match self {
            Scale::AsIs => {}
            Scale::Spread { floor } => spread_scores(xs, floor),
        }
    }

    /// Adds `weight` x each kept candidate's score, clamped to 0..1 (`NaN`
    /// as 0), to its entry of `total`: [`Scale::apply`] then the engine's
    /// sum, in one loop over the column and no score vector.
    pub fn add_weighted(self, column: &[f64], kept: &[usize], weight: f64, total: &mut [f64]) {
        let mut scratch = Vec::new();
        let xs = kept_entries(column, kept, &mut scratch);
        let add = |t: &mut f64, score: f64| *t += min_num(non_negative(score), 1.0) * weight;
        match self {
            Scale::AsIs => {
                for (t, &x) in total.iter_mut().zip(xs) {
                    add(t, x);
                }
            }
            Scale::Spread { floor } => {
                let (lo, inv) = spread_range(xs, floor);
                for (t, &x) in total.iter_mut().zip(xs) {
                    add(t, spread_one(x, lo, inv));
                }
            }
        }
    }
}

/// Score a candidate gets when the figure a scorer needs is unknown (no
/// fresh snapshot): the middle of the range, so an endpoint kvroute cannot
/// see is neither preferred nor shunned for it.
pub const NEUTRAL: f64 = 0.5;

/// Min-max normalization with a floor on the range, in place: each value
/// `x` of `xs` (lower is better) becomes `1 - (x - min) / max(max - min,
/// floor)`. A NaN entry is unknown: it gets [`NEUTRAL`]; an infinite one
/// is known but unusable: it gets 0. Neither takes part in min/max. Equal
/// values all score 1. In place: a scorer writes its raw values into its
/// output and normalizes them there, without a second buffer.
///
/// Unknown is NaN rather than `None`: half the bytes to write and read for
/// each of a large pool's candidates, and no scorer has a NaN to report
/// (their inputs are counts and finite sums).
pub fn spread_scores(xs: &mut [f64], floor: f64) {
    let (lo, inv) = spread_range(xs, floor);
    for x in xs.iter_mut() {
        *x = spread_one(*x, lo, inv);
    }
}

/// The least finite value of `xs` and the inverse of the range it is
/// spread over (0 without a positive range): [`spread_scores`]' first pass.
fn spread_range(xs: &[f64], floor: f64) -> (f64, f64) {
    // Min and max of the finite values in four independent chains: on
    // finite values a comparison finds the same extremes as `f64::min`/`max`
    // (up to the sign of a zero, which no score below can tell), without
    // their NaN handling making one long dependency chain through the pool.
    let mut lo = [f64::INFINITY; 4];
    let mut hi = [f64::NEG_INFINITY; 4];
    // A NaN takes no comparison, and an infinity changes neither extreme
    // (the lanes start at the infinities): selects instead of branches.
    let mut extend = |k: usize, x: f64| {
        let x = if x.is_finite() { x } else { f64::NAN };
        lo[k] = if x < lo[k] { x } else { lo[k] };
        hi[k] = if x > hi[k] { x } else { hi[k] };
    };
    let mut chunks = xs.chunks_exact(4);
    for c in &mut chunks {
        for (k, &x) in c.iter().enumerate() {
            extend(k, x);
        }
    }
    for &x in chunks.remainder() {
        extend(0, x);
    }
    let lo = lo.into_iter().fold(f64::INFINITY, f64::min);
    let hi = hi.into_iter().fold(f64::NEG_INFINITY, f64::max);
    let range = (hi - lo).max(floor);
    // One division, then a multiplication per entry (a division each took
    // most of this function at 1024 endpoints); within an ulp of dividing.
    // Without a positive range every known value scores 1.
    let inv = if range > 0.0 { 1.0 / range } else { 0.0 };
    (lo, inv)
}

/// One value's score by [`spread_range`]'s `lo` and `inv`. Every outcome
/// computed and one selected, without a branch: the values of a pool
/// repeat in no pattern a branch predictor learns. `1 - (x - lo) * inv` is
/// exactly 1 at `x == lo`.
#[inline]
fn spread_one(x: f64, lo: f64, inv: f64) -> f64 {
    let spread = 1.0 - (x - lo) * inv;
    let known = if x.is_finite() { spread } else { 0.0 };
    if x.is_nan() {
        NEUTRAL
    } else {
        known
    }
}

/// The queue an endpoint has now, as best kvroute knows: the scraped
/// `waiting`, plus, when the engine was already queueing at scrape time
/// (`waiting > 0`), the requests kvroute has in flight beyond what the
/// engine reported (`inflight.requests - (waiting + running)`): those were
/// sent after the scrape and a saturated engine can only queue them. When
/// the engine was not queueing they are most likely running, and the
/// in-flight scorers account for them. `None` without a fresh snapshot.
pub fn effective_queue(c: &Candidate) -> Option<f64> {
    let s = c.snapshot.as_ref()?;
    let waiting = non_negative(s.waiting);
    let excess = if waiting > 0.0 {
        non_negative(f64::from(c.inflight.requests) - (waiting + non_negative(s.running)))
    } else {
        0.0
    };
    Some(waiting + excess)
}

/// Prefix score of one candidate: matched blocks (a partial block
/// included) / request blocks, 0..1 (0 when nothing matches; a request
/// shorter than one block counts as one block for its partial match).
pub fn prefix_fraction(req: &RequestFacts, c: &Candidate) -> f64 {
    let matched = c.matched_blocks.min(req.total_blocks) as f64 + c.partial_block;
    if matched.is_nan() || matched <= 0.0 {
        return 0.0;
    }
    let fraction = matched / req.total_blocks.max(1) as f64;
    min_num(fraction, 1.0)
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    type Case = (&'static [f64], f64, &'static [f64]);

    /// `spread_scores` written plainly, with `f64::min`/`max` and branches:
    /// the reference the property test holds it to.
    fn spread_reference(xs: &[f64], floor: f64) -> Vec<f64> {
        let known = xs.iter().copied().filter(|x| x.is_finite());
        let (mut lo, mut hi) = (f64::INFINITY, f64::NEG_INFINITY);
        for x in known {
            lo = lo.min(x);
            hi = hi.max(x);
        }
        let range = (hi - lo).max(floor);
        xs.iter()
            .map(|&x| {
                if x.is_nan() {
                    NEUTRAL
                } else if !x.is_finite() {
                    0.0
                } else if range > 0.0 {
                    1.0 - (x - lo) / range
                } else {
                    1.0
                }
            })
            .collect()
    }

    #[test]
    fn spread_matches_the_reference_on_random_inputs() {
        let mut rng = fastrand::Rng::with_seed(14);
        let specials = [
            0.0,
            -0.0,
            f64::NAN,
            f64::INFINITY,
            f64::NEG_INFINITY,
            1e300,
            -1e300,
        ];
        let mut out = Vec::new();
        for round in 0..5000 {
            let n = rng.usize(0..40);
            let xs: Vec<f64> = (0..n)
                .map(|_| match rng.u8(0..10) {
                    0 => f64::NAN,
                    1 => specials[rng.usize(..specials.len())],
                    2..=5 => f64::from(rng.u8(0..6)),
                    _ => (rng.f64() - 0.3) * 1e4,
                })
                .collect();
            let floor = [0.0, 1.0, 4.0, 4096.0][round % 4];
            out.clone_from(&xs);
            spread_scores(&mut out, floor);
            let want = spread_reference(&xs, floor);
            // Within an ulp or two of dividing (scores are 0..1).
            assert_eq!(out.len(), want.len());
            for (got, want) in out.iter().zip(&want) {
                assert!(
                    (got - want).abs() < 1e-12,
                    "{xs:?} floor {floor}: {got} vs {want}"
                );
            }
        }
    }

    #[test]
    fn scores_added_from_a_column_are_the_scores_applied_then_summed() {
        let mut rng = fastrand::Rng::with_seed(21);
        let odd = [f64::NAN, f64::INFINITY, f64::NEG_INFINITY, -1.0, 2.5];
        for round in 0..3000 {
            let n = rng.usize(1..40);
            let column: Vec<f64> = (0..n)
                .map(|_| match rng.u8(0..8) {
                    0 => odd[rng.usize(..odd.len())],
                    1..=3 => f64::from(rng.u8(0..5)),
                    _ => rng.f64() * 100.0,
                })
                .collect();
            // Every candidate kept, or some (in order, at least one).
            let mut kept: Vec<usize> = (0..n).filter(|_| rng.u8(0..3) != 0).collect();
            if rng.bool() || kept.is_empty() {
                kept = (0..n).collect();
            }
            let scale = match rng.u8(0..3) {
                0 => Scale::AsIs,
                1 => Scale::Spread { floor: 0.0 },
                _ => Scale::Spread { floor: 4.0 },
            };
            let weight = [1.0, 2.0, 0.5][round % 3];
            let start: Vec<f64> = kept.iter().map(|_| rng.f64()).collect();
            let mut want = start.clone();
            let mut scores: Vec<f64> = kept.iter().map(|&i| column[i]).collect();
            scale.apply(&mut scores);
            for (t, s) in want.iter_mut().zip(scores) {
                *t += min_num(non_negative(s), 1.0) * weight;
            }
            let mut got = start;
            scale.add_weighted(&column, &kept, weight, &mut got);
            // Bit for bit: the same operations in the same order.
            let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(
                bits(&got),
                bits(&want),
                "round {round}: {column:?} {kept:?} {scale:?}"
            );
        }
    }

    #[test]
    fn spread_table() {
        let cases: &[Case] = &[
            (&[0.0, 10.0, 5.0], 0.0, &[1.0, 0.0, 0.5]),
            (&[3.0, 3.0], 0.0, &[1.0, 1.0]),
            (&[3.0, 3.0], 4.0, &[1.0, 1.0]),
            (&[0.0, 1.0], 4.0, &[1.0, 0.75]),
            (&[0.0, 1.0], 0.0, &[1.0, 0.0]),
            (&[0.0, f64::NAN, 8.0], 4.0, &[1.0, NEUTRAL, 0.0]),
            (&[f64::NAN, f64::NAN], 4.0, &[NEUTRAL, NEUTRAL]),
            (&[f64::INFINITY, 1.0], 0.0, &[0.0, 1.0]),
            (&[], 1.0, &[]),
        ];
        let mut out = Vec::new();
        for (xs, floor, want) in cases {
            out.clear();
            out.extend_from_slice(xs);
            spread_scores(&mut out, *floor);
            assert_eq!(&out[..], *want, "{xs:?} floor {floor}");
        }
    }
}
