//! # max-score picker
//!
//! **What**: picks the candidate with the highest weighted score (llm-d's
//! `max-score-picker`), ties broken at random with the passed, seeded RNG
//! (so a decision is deterministic for a seed, and equal endpoints share
//! traffic instead of the first one taking all).
//!
//! **Cold requests** (no candidate holds any block of the prompt): every
//! candidate scoring within `margin` of the best counts as equally good,
//! and among those the **least recently picked** (`last_picked_ms`; never
//! picked = oldest) wins, ties again at random. This is kvroute's answer to
//! cold-prefix hot spots: a burst of new conversations between two scrapes
//! has near-identical load scores everywhere, and without this rule tiny
//! score differences (one KV-usage digit) would send the whole burst to
//! one endpoint, which then also becomes the only holder of all those new
//! prefixes. Rotating by recency spreads both the load and the future
//! cache. The margin is `scheduling.cold_margin` x the sum of the weights
//! (default 5%): large enough to absorb noise, small enough that a clearly
//! less loaded endpoint still wins.
//!
//! ```text
//! best  = max score
//! near  = { i | score_i >= best - eps }                 (warm)
//!         { i | score_i >= best - margin }              (cold)
//! cold:  near = argmin_{i in near} last_picked_ms (None first)
//! pick   uniformly at random in near
//! ```

/// Scores within this of each other are equal (floating-point noise).
pub const EPS: f64 = 1e-9;

/// Index (into `scores`) of the picked candidate; `None` when empty.
/// `cold_margin` is `Some(margin)` for a cold request.
pub fn pick(
    scores: &[f64],
    last_picked_ms: &[Option<u64>],
    cold_margin: Option<f64>,
    rng: &mut fastrand::Rng,
) -> Option<usize> {
    let best = scores
        .iter()
        .copied()
        .filter(|s| !s.is_nan())
        .fold(f64::NEG_INFINITY, f64::max);
    if scores.is_empty() {
        return None;
    }
    let tolerance = cold_margin.map_or(EPS, |m| m.max(EPS));
    let mut near: Vec<usize> = (0..scores.len())
        .filter(|&i| scores[i] >= best - tolerance || !best.is_finite())
        .collect();
    if cold_margin.is_some() {
        let oldest = near
            .iter()
            .map(|&i| last_picked_ms.get(i).copied().flatten())
            .min()
            .flatten();
        near.retain(|&i| last_picked_ms.get(i).copied().flatten() == oldest);
    }
    if near.is_empty() {
        return Some(rng.usize(..scores.len()));
    }
    Some(near[rng.usize(..near.len())])
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn warm_picks_the_max() {
        let cases: &[(&[f64], usize)] = &[
            (&[1.0, 3.0, 2.0], 1),
            (&[5.0], 0),
            (&[0.0, 0.0, 0.1], 2),
            (&[f64::NAN, 1.0], 1),
        ];
        for (scores, want) in cases {
            for seed in 0..20 {
                let mut rng = fastrand::Rng::with_seed(seed);
                assert_eq!(pick(scores, &[], None, &mut rng), Some(*want), "{scores:?}");
            }
        }
        assert_eq!(pick(&[], &[], None, &mut fastrand::Rng::with_seed(1)), None);
    }

    #[test]
    fn ties_are_random_under_the_seed_and_deterministic_for_one_seed() {
        let scores = [2.0, 1.0, 2.0, 2.0 + 1e-12];
        let mut seen = [0usize; 4];
        for seed in 0..200 {
            let a = pick(&scores, &[], None, &mut fastrand::Rng::with_seed(seed)).unwrap();
            let b = pick(&scores, &[], None, &mut fastrand::Rng::with_seed(seed)).unwrap();
            assert_eq!(a, b, "seed {seed} not deterministic");
            seen[a] += 1;
        }
        assert_eq!(seen[1], 0);
        assert!(seen[0] > 30 && seen[2] > 30 && seen[3] > 30, "{seen:?}");
    }

    type Case = (
        &'static [f64],
        &'static [Option<u64>],
        f64,
        &'static [usize],
    );

    #[test]
    fn cold_prefers_least_recently_picked_within_margin() {
        // (scores, last picked, margin, allowed picks)
        let cases: &[Case] = &[
            (&[5.0, 4.9, 4.0], &[Some(10), Some(5), None], 0.5, &[1]),
            (&[5.0, 4.9, 4.8], &[Some(10), Some(5), None], 0.5, &[2]),
            (&[5.0, 4.9, 4.8], &[Some(10), None, None], 0.5, &[1, 2]),
            (&[5.0, 4.0], &[Some(10), None], 0.5, &[0]),
            (&[5.0, 4.9], &[Some(1), None], 0.0, &[0]),
        ];
        for (scores, last, margin, allowed) in cases {
            for seed in 0..20 {
                let got = pick(
                    scores,
                    last,
                    Some(*margin),
                    &mut fastrand::Rng::with_seed(seed),
                )
                .unwrap();
                assert!(allowed.contains(&got), "{scores:?} {last:?}: {got}");
            }
        }
    }
}
