//! # max-score picker
//!
//! **What**: picks the candidate with the highest weighted score (llm-d's
//! `max-score-picker`).
//!
//! **With peers (several gateway replicas), ties and cold requests are
//! decided by rendezvous hashing** of the request's affinity key (its first
//! block hash) over the tied candidates: each gets `xxh3(endpoint, seed =
//! key)` and the highest wins. The choice depends only on the request and
//! the candidate set, never on which replica or worker makes it, so
//! replicas that have not yet heard of each other's decisions (`peer/`)
//! still send a burst of new conversations sharing a first block to one
//! endpoint, and distinct ones spread as a hash spreads. A lone gateway has
//! no key (a rotation spreads a handful of new conversations more evenly
//! than a hash): ties go to the seeded RNG, cold requests to the least
//! recently picked candidate, and the ties left among those (an idle pool
//! none was picked from yet, or picks in one millisecond) by the same
//! hash of the prompt's first block. Envoy workers that route copies of
//! one new prompt at once decide on the same shared view; with the RNG
//! deciding those ties, two of them put it on two pods, and each copy
//! after followed one of them (`tests/routing.rs`, copies of a new prompt
//! routed by four workers).
//!
//! **Cold requests** (no candidate holds any block of the prompt): every
//! candidate scoring within `margin` of the best is acceptable. The margin
//! is the load bound: `scheduling.cold_margin` x the sum of the weights
//! (default 5%, half a point at the default weights), so an endpoint that
//! already has about two more requests in flight than the least loaded one
//! (each costs `inflight_requests / min_range_inflight` = 0.25) drops out
//! of the set, and a burst of new conversations between two scrapes spreads
//! over the pool instead of piling on one endpoint. Among the acceptable
//! ones: the rendezvous choice (with a key), else the one with the
//! fewest prompt tokens of kvroute's still to prefill (sent, no first
//! token back yet; every Envoy worker's, the freshest load there is), then
//! the fewest of its requests in flight, then the least recently picked,
//! which rotates new conversations over equally loaded endpoints; ties by
//! the rendezvous hash of the prompt's first block (at random for a prompt
//! shorter than a block).
//!
//! Why tokens first: a cold request is prefilled after what is queued
//! ahead of it, so its first token waits on those tokens, not on how many
//! requests carry them. By count, a pod prefilling three new 3000-token
//! conversations looks emptier than one serving nine cached turns of 200
//! uncached tokens each, and a burst of new conversations piled on it
//! (hotspot, seed 7: six of the burst's eight cold picks on one pod of
//! four, first tokens after up to 940 ms where the others waited 220 ms).
//! A pod whose every slot is answering has no prefill waiting either: on
//! an engine of few slots the router prices such a pick and moves it when
//! another is cheaper (`router/cost.rs`, `scheduling.slot_wait`).
//!
//! Requests came first from 6 Dec 2026, recency before that: recency is
//! kept in milliseconds and per worker, so a burst's picks mostly tie on
//! it, and a burst that crossed a millisecond could give an endpoint a
//! second new conversation, even a third, while another had one
//! (`tests/routing.rs`). Tokens keep that: each pick adds its prompt to
//! the shared in-flight table at once.
//!
//! ```text
//! best  = max score
//! near  = { i | score_i >= best - eps }                 (warm)
//!         { i | score_i >= best - margin }              (cold)
//! key:    argmax_{i in near} xxh3(endpoint_i, seed = key)
//! no key: cold: near = argmin_{i in near} (prefill_i, inflight_i, last_picked_ms_i)
//!               (lexicographic; never picked first),
//!               then argmax_{i in near} xxh3(endpoint_i, seed = first block);
//!         uniformly at random in near
//! ```

use crate::endpoint::Endpoint;
use std::net::SocketAddr;
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Scores within this of each other are equal (floating-point noise).
pub const EPS: f64 = 1e-9;

/// How a cold pick orders the acceptable candidates, lowest first (the
/// fields in order): the fewest prompt tokens waiting for their prefill,
/// then the fewest requests in flight, then the least recently picked
/// (never picked first). Recency is in milliseconds, and each worker
/// knows the others' picks only once it has replayed them: the picks of a
/// burst, made in one or two of them by several workers, do not tell
/// apart on it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
pub struct ColdRank {
    /// Uncached prompt tokens kvroute has sent it whose first token has
    /// not come back (every worker's: `InFlight::tokens`).
    pub prefill: u64,
    /// kvroute's requests in flight on it (every worker's).
    pub inflight: u32,
    /// When the endpoint was last picked (ms; this worker's picks and the
    /// others' it has replayed), if ever.
    pub last_picked_ms: Option<u64>,
}

/// Index (into `scores`) of the picked candidate; `None` when empty.
/// `cold_margin` is `Some(margin)` for a cold request; `cold_rank` orders
/// its acceptable candidates (a missing rank is the lowest), and `tie`
/// (the rendezvous weight of the candidate at an index, for the prompt's
/// first block) decides between those left equal, else the RNG does.
pub fn pick(
    scores: &[f64],
    cold_rank: &[ColdRank],
    rendezvous: Option<&[u64]>,
    cold_margin: Option<f64>,
    tie: Option<&dyn Fn(usize) -> u64>,
    rng: &mut fastrand::Rng,
) -> Option<usize> {
    let best = max_ignoring_nan(scores);
    if scores.is_empty() {
        return None;
    }
    let tolerance = cold_margin.map_or(EPS, |m| m.max(EPS));
    let mut near: Vec<usize> = (0..scores.len())
        .filter(|&i| scores[i] >= best - tolerance || !best.is_finite())
        .collect();
    if let Some(rank) = rendezvous {
        if let Some(&i) = near
            .iter()
            .max_by_key(|&&i| (rank.get(i).copied(), std::cmp::Reverse(i)))
        {
            return Some(i);
        }
    }
    if cold_margin.is_some() {
        let rank = |i: usize| cold_rank.get(i).copied().unwrap_or_default();
        if let Some(first) = near.iter().map(|&i| rank(i)).min() {
            near.retain(|&i| rank(i) == first);
        }
        // Hashed only for the few left equal.
        if near.len() > 1 {
            if let Some(tie) = tie {
                return near
                    .iter()
                    .max_by_key(|&&i| (tie(i), std::cmp::Reverse(i)))
                    .copied();
            }
        }
    }
    if near.is_empty() {
        return Some(rng.usize(..scores.len()));
    }
    Some(near[rng.usize(..near.len())])
}

/// The largest non-NaN value of `xs` (-inf if none): what
/// `filter(!NaN).fold(-inf, f64::max)` gives, in four independent chains of
/// plain comparisons instead of one chain of NaN-aware maxima (a decision
/// at 1024 endpoints waited on that chain).
pub fn max_ignoring_nan(xs: &[f64]) -> f64 {
    let mut best = [f64::NEG_INFINITY; 4];
    let mut chunks = xs.chunks_exact(4);
    for c in &mut chunks {
        for (b, &x) in best.iter_mut().zip(c) {
            // A NaN compares false: skipped.
            if x > *b {
                *b = x;
            }
        }
    }
    for &x in chunks.remainder() {
        if x > best[0] {
            best[0] = x;
        }
    }
    best.into_iter().fold(f64::NEG_INFINITY, f64::max)
}

/// The rendezvous weight of `endpoint` for affinity key `key`: the same on
/// every replica and every platform (the address's bytes, IPv4 as
/// IPv4-mapped IPv6, hashed with the key as seed).
pub fn rendezvous(key: u64, endpoint: &Endpoint) -> u64 {
    let mut bytes = [0u8; 22];
    let addr = endpoint.addr();
    let ip = match addr {
        SocketAddr::V4(a) => a.ip().to_ipv6_mapped().octets(),
        SocketAddr::V6(a) => a.ip().octets(),
    };
    let scope = match addr {
        SocketAddr::V4(_) => 0,
        SocketAddr::V6(a) => a.scope_id(),
    };
    bytes[..16].copy_from_slice(&ip);
    bytes[16..18].copy_from_slice(&addr.port().to_le_bytes());
    bytes[18..].copy_from_slice(&scope.to_le_bytes());
    xxh3_64_with_seed(&bytes, key)
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn max_ignoring_nan_is_the_nan_skipping_fold() {
        let mut rng = fastrand::Rng::with_seed(9);
        let odd = [f64::NAN, f64::INFINITY, f64::NEG_INFINITY, 0.0, -0.0];
        for _ in 0..5000 {
            let xs: Vec<f64> = (0..rng.usize(0..23))
                .map(|_| match rng.u8(0..6) {
                    0 => odd[rng.usize(..odd.len())],
                    _ => (rng.f64() - 0.5) * 20.0,
                })
                .collect();
            let want = xs
                .iter()
                .copied()
                .filter(|s| !s.is_nan())
                .fold(f64::NEG_INFINITY, f64::max);
            let got = max_ignoring_nan(&xs);
            // Equal as numbers (a zero's sign is not a score difference).
            assert!(got == want || (got.is_nan() && want.is_nan()), "{xs:?}");
        }
    }

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
                assert_eq!(
                    pick(scores, &[], None, None, None, &mut rng),
                    Some(*want),
                    "{scores:?}"
                );
            }
        }
        assert_eq!(
            pick(&[], &[], None, None, None, &mut fastrand::Rng::with_seed(1)),
            None
        );
    }

    #[test]
    fn ties_are_random_under_the_seed_and_deterministic_for_one_seed() {
        let scores = [2.0, 1.0, 2.0, 2.0 + 1e-12];
        let mut seen = [0usize; 4];
        for seed in 0..200 {
            let a = pick(
                &scores,
                &[],
                None,
                None,
                None,
                &mut fastrand::Rng::with_seed(seed),
            )
            .unwrap();
            let b = pick(
                &scores,
                &[],
                None,
                None,
                None,
                &mut fastrand::Rng::with_seed(seed),
            )
            .unwrap();
            assert_eq!(a, b, "seed {seed} not deterministic");
            seen[a] += 1;
        }
        assert_eq!(seen[1], 0);
        assert!(seen[0] > 30 && seen[2] > 30 && seen[3] > 30, "{seen:?}");
    }

    type Case = (
        &'static [f64],
        &'static [(Option<u64>, u32)],
        f64,
        &'static [usize],
    );

    #[test]
    fn cold_prefers_fewest_in_flight_then_least_recently_picked_within_margin() {
        // (scores, (last picked, in flight), margin, allowed picks)
        let cases: &[Case] = &[
            (
                &[5.0, 4.9, 4.0],
                &[(Some(10), 0), (Some(5), 0), (None, 0)],
                0.5,
                &[1],
            ),
            (
                &[5.0, 4.9, 4.8],
                &[(Some(10), 0), (Some(5), 0), (None, 0)],
                0.5,
                &[2],
            ),
            (
                &[5.0, 4.9, 4.8],
                &[(Some(10), 0), (None, 0), (None, 0)],
                0.5,
                &[1, 2],
            ),
            (&[5.0, 4.0], &[(Some(10), 0), (None, 0)], 0.5, &[0]),
            (&[5.0, 4.9], &[(Some(1), 0), (None, 0)], 0.0, &[0]),
            // In flight first: an endpoint picked longer ago loses with
            // more requests in flight ...
            (&[5.0, 4.8], &[(Some(10), 0), (Some(3), 1)], 0.5, &[0]),
            // ... and a burst that crossed a millisecond does not give the
            // endpoint picked in the earlier one a third request.
            (
                &[4.6, 4.8, 4.8],
                &[(Some(7), 2), (Some(8), 1), (Some(8), 1)],
                0.5,
                &[1, 2],
            ),
            // Picks in the same millisecond: the fewest in flight, not a
            // coin flip.
            (
                &[4.8, 5.0, 4.9],
                &[(Some(7), 1), (Some(7), 2), (Some(7), 1)],
                0.5,
                &[0, 2],
            ),
            (
                &[5.0, 4.8, 4.9],
                &[(Some(7), 2), (Some(7), 2), (Some(7), 1)],
                0.5,
                &[2],
            ),
            (&[5.0, 4.8], &[(None, 1), (None, 0)], 0.5, &[1]),
            // Out of the margin, fewer in flight does not count.
            (&[5.0, 4.0], &[(Some(7), 3), (Some(7), 0)], 0.5, &[0]),
        ];
        for (scores, ranks, margin, allowed) in cases {
            let ranks: Vec<ColdRank> = ranks
                .iter()
                .map(|&(last_picked_ms, inflight)| ColdRank {
                    prefill: 0,
                    inflight,
                    last_picked_ms,
                })
                .collect();
            for seed in 0..20 {
                let got = pick(
                    scores,
                    &ranks,
                    None,
                    Some(*margin),
                    None,
                    &mut fastrand::Rng::with_seed(seed),
                )
                .unwrap();
                assert!(allowed.contains(&got), "{scores:?} {ranks:?}: {got}");
            }
        }
    }

    #[test]
    fn cold_prefers_the_least_prefill_waiting_over_fewer_requests() {
        // Hotspot's first burst: one endpoint prefills three new 3000-token
        // conversations, the others serve cached turns (a few hundred
        // uncached tokens each, more of them).
        let rank = |prefill, inflight, last| ColdRank {
            prefill,
            inflight,
            last_picked_ms: Some(last),
        };
        let ranks = [
            rank(9_639, 3, 1),
            rank(1_800, 9, 9),
            rank(1_400, 7, 8),
            rank(1_600, 8, 7),
        ];
        let scores = [4.8, 5.0, 5.0, 5.0];
        for seed in 0..20 {
            let got = pick(
                &scores,
                &ranks,
                None,
                Some(0.5),
                None,
                &mut fastrand::Rng::with_seed(seed),
            );
            assert_eq!(got, Some(2), "{ranks:?}");
        }
        // Nothing waiting anywhere: the requests in flight, then recency.
        let idle = [rank(0, 2, 1), rank(0, 1, 9), rank(0, 1, 3)];
        let got = pick(
            &[5.0; 3],
            &idle,
            None,
            Some(0.5),
            None,
            &mut fastrand::Rng::with_seed(1),
        );
        assert_eq!(got, Some(2));
    }

    #[test]
    fn rendezvous_decides_ties_and_cold_picks_the_same_everywhere() {
        let eps: Vec<Endpoint> = (1..=4)
            .map(|i| format!("10.0.0.{i}:8000").parse().unwrap())
            .collect();
        let mut winners = [0usize; 4];
        for key in 0..400u64 {
            let rank: Vec<u64> = eps.iter().map(|e| rendezvous(key, e)).collect();
            let scores = [1.0, 1.0, 1.0, 1.0];
            // Whatever the RNG seed (the worker, the replica): one answer.
            let picks: Vec<_> = (0..5)
                .map(|seed| {
                    let mut rng = fastrand::Rng::with_seed(seed);
                    pick(
                        &scores,
                        &[
                            ColdRank {
                                last_picked_ms: Some(seed),
                                ..ColdRank::default()
                            },
                            ColdRank::default(),
                        ],
                        Some(&rank),
                        Some(0.5),
                        None,
                        &mut rng,
                    )
                })
                .collect();
            assert!(
                picks.windows(2).all(|w| w[0] == w[1]),
                "key {key}: {picks:?}"
            );
            winners[picks[0].unwrap()] += 1;
            // A candidate out of the margin is never picked, whatever its hash.
            let w = picks[0].unwrap();
            let mut loaded = scores;
            loaded[w] = 0.2;
            let mut rng = fastrand::Rng::with_seed(1);
            let p = pick(&loaded, &[], Some(&rank), Some(0.5), None, &mut rng).unwrap();
            assert_ne!(p, w, "key {key}");
            // Warm: the best score wins; a tie among the best is the hash's.
            let mut warm = [0.0; 4];
            warm[(w + 1) % 4] = 2.0;
            assert_eq!(
                pick(&warm, &[], Some(&rank), None, None, &mut rng),
                Some((w + 1) % 4)
            );
        }
        // Distinct keys spread over the pool like a hash.
        assert!(winners.iter().all(|&n| n > 60), "{winners:?}");
        // Pinned values: the weight must not change across platforms or releases
        // (replicas running different builds must agree).
        assert_eq!(
            rendezvous(0, &eps[0]),
            rendezvous(0, &"10.0.0.1:8000".parse().unwrap())
        );
        assert_ne!(rendezvous(0, &eps[0]), rendezvous(1, &eps[0]));
        assert_ne!(
            rendezvous(7, &"10.0.0.1:8000".parse().unwrap()),
            rendezvous(7, &"10.0.0.1:8001".parse().unwrap())
        );
    }
}
