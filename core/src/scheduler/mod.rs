//! The routing decision: filters, then weighted scorers, then a picker, in
//! the Filter -> Score -> Pick shape of llm-d's Endpoint Picker.
//!
//! ```text
//! candidates --filters--> kept --scorers (clamp 0..1, x weight, sum)--> score per kept
//!            --picker (max; ties and cold: rendezvous hash with peers, else random / least prefill, requests in flight, recency)--> Decision
//! ```
//!
//! Layout: contracts in [`plugin`], one file per filter in [`filter`] and
//! per scorer in [`scorer`], the picker in [`picker`], the two profiles in
//! [`profile`]. Each file's `//!` comment has its formula. What the plugins
//! read of each candidate is measured once per decision, a column per
//! figure ([`figures`]); a scorer that only rates a column is scored
//! straight from it.
//!
//! ## Weights (defaults) and why
//!
//! `prefix 3, queue 2, kv_cache 2` are llm-d's defaults. kvroute adds
//! `inflight_requests 2` and `inflight_tokens 1`, and floors the min-max
//! range of the count scorers (`min_range_requests = 4` waiting requests,
//! `min_range_inflight = 8` in-flight requests, `min_range_tokens = 4096`),
//! so that:
//!
//! - **A prefix match survives small load differences**: `d` more waiting
//!   requests cost `2 * min(d / 4, 1)`, `d` more in flight `2 * min(d / 8,
//!   1)`. A 100% match (3 points) never leaves an endpoint only because
//!   kvroute has more requests running there while the engine is not
//!   queueing (in-flight alone costs at most 2 < 3); a 50% match stays
//!   until about 6 more in flight. Checked by `conversation_tests`: 20
//!   conversations x 4 turns, all in flight together between two scrapes,
//!   keep >= 95% of later turns on their first endpoint when a turn matches
//!   at least half of the next one.
//! - **A 100%-matched endpoint with a long queue loses**: queue (2) +
//!   in-flight requests (2) alone outweigh the prefix (3), before KV usage
//!   (an engine that queues is usually out of KV: up to 2 more) and tokens.
//! - **A fresh conversation never picks a loaded endpoint**: with no match
//!   anywhere only load is scored, and every load scorer is immediate
//!   (in-flight is updated by the filter at routing time, not at the next
//!   scrape), so even a burst between two scrapes spreads; the cold rule of
//!   the picker then rotates among equally loaded endpoints.
//!
//! ## Rules of the engine
//!
//! - Scores are clamped to [0, 1] (`NaN` -> 0) before weighting; a weight
//!   of 0 skips the scorer.
//! - A candidate without a fresh snapshot gets the neutral 0.5 from the
//!   snapshot-based scorers (queue, kv_cache); the in-flight scorers and
//!   the prefix still apply, since kvroute knows those itself.
//! - [`Reason`]: `Fallback` if the health filter kept unhealthy endpoints;
//!   else `Cold` if no kept candidate holds any block (or the request has
//!   none) and, for a LoRA adapter request, none runs the adapter; else `Prefix` if the chosen endpoint holds blocks and that
//!   decided the pick (the affinity filter narrowed the set, or, rescored
//!   as if it held no block, it would no longer be strictly best; a lone
//!   candidate counts as decided by its prefix); else `Load`.
//! - Pure: same inputs and RNG seed, same decision. The RNG is only drawn
//!   from to break ties.

pub mod figures;
pub mod filter;
pub mod picker;
pub mod plugin;
pub mod profile;
pub mod scorer;

use crate::config::SchedulingConfig;
use crate::endpoint::Endpoint;
use crate::float::{min_num, non_negative};
use crate::inflight::InFlight;
use crate::metrics::lora::AdapterFit;
use crate::metrics::MetricsSnapshot;
use crate::ttft::Prediction;
use figures::Figures;
use plugin::{Context, Note};

/// One endpoint as the scheduler sees it for one request.
#[derive(Clone, Debug, PartialEq)]
pub struct Candidate {
    /// The endpoint.
    pub endpoint: Endpoint,
    /// Latest snapshot, if it is fresh (younger than `stale_after_ms`).
    pub snapshot: Option<MetricsSnapshot>,
    /// False when scrapes keep failing: the endpoint is believed down.
    pub healthy: bool,
    /// Leading blocks of the request this endpoint holds.
    pub matched_blocks: usize,
    /// Fraction (0 to 15/16, in sixteenths) of the block after
    /// `matched_blocks` it also holds: a leaf left by an earlier request
    /// that ended inside that block (`prefix::PrefixMatch`). Always less
    /// than a block; 0 for every full-block-only match.
    pub partial_block: f64,
    /// kvroute's own outstanding work on the endpoint.
    pub inflight: InFlight,
    /// When kvroute last picked this endpoint (ms), if ever.
    pub last_picked_ms: Option<u64>,
    /// How it suits the request's LoRA adapter, by its fresh scrape
    /// (`Unknown` for a base-model request).
    pub adapter_fit: AdapterFit,
}

impl Candidate {
    /// Matched blocks, the partial block included.
    pub fn matched(&self) -> f64 {
        self.matched_blocks as f64 + self.partial_block
    }
}

/// What the scheduler needs to know of the request itself.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct RequestFacts {
    /// Number of hashed blocks of the prompt (0 when not understood).
    pub total_blocks: usize,
    /// Approximate prompt tokens.
    pub prompt_tokens: u64,
    /// Decides ties and cold picks by rendezvous hashing (`picker`): the
    /// first block's hash, so requests sharing a leading block agree on
    /// every replica; `None` when the prompt was not read or the gateway
    /// has no peers.
    pub affinity_key: Option<u64>,
    /// The prompt's first block hash (`None` when it has none): breaks the
    /// ties a cold pick leaves by rendezvous hashing (`picker`), so that
    /// workers deciding copies of one new prompt on the same view agree.
    pub first_block: Option<u64>,
    /// The LoRA adapter the request names (`metrics::lora::adapter_id`),
    /// for the lora-affinity scorer; `None` for a base-model request.
    pub adapter: Option<crate::metrics::lora::AdapterId>,
}

/// Why an endpoint was chosen.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reason {
    /// The chosen endpoint holds the longest prefix any live endpoint holds.
    Prefix,
    /// A prefix existed, but load sent the request elsewhere (or to a
    /// shorter match).
    Load,
    /// No endpoint held any prefix: spread by load and recency.
    Cold,
    /// No healthy candidate: picked among all for lack of better.
    Fallback,
}

impl Reason {
    /// Lowercase name, for stats and the debug header.
    pub fn as_str(&self) -> &'static str {
        match self {
            Reason::Prefix => "prefix",
            Reason::Load => "load",
            Reason::Cold => "cold",
            Reason::Fallback => "fallback",
        }
    }
}

/// Scores a [`Decision`] keeps: the chosen candidate's and the best
/// others' (all of them in a pool this small). Enough for the fallbacks
/// and the debug header; a decision over 1024 endpoints would otherwise
/// copy 1024 scores (and predictions) that nothing reads.
pub const SCORES_KEPT: usize = 8;

/// The outcome of scheduling one request.
#[derive(Clone, Debug, PartialEq)]
pub struct Decision {
    /// Chosen endpoint.
    pub endpoint: Endpoint,
    /// Why.
    pub reason: Reason,
    /// Leading blocks the chosen endpoint holds, as far as they were worth
    /// anything to this decision (0 for an engine that keeps no prompts:
    /// `cache_trust`).
    pub matched_blocks: usize,
    /// Leading blocks the chosen endpoint holds by kvroute's index, whether
    /// or not its engine is trusted to keep them.
    pub held_blocks: usize,
    /// Final weighted score of the chosen candidate and of the best others
    /// that passed the filters, at most [`SCORES_KEPT`], in candidate order;
    /// with `predicted_ttft`, minus the predicted TTFT in ms.
    pub scores: Vec<(Endpoint, f64)>,
    /// Each scored candidate's predicted TTFT, in the order of `scores`
    /// (`predicted_ttft` profile only; empty otherwise).
    pub predictions: Vec<Prediction>,
    /// The chosen endpoint's predicted TTFT, when the router made one
    /// (`predicted_ttft`, or a cost check of the other profiles): what the
    /// TTFT model learns from.
    pub prediction: Option<Prediction>,
    /// The scores' pick, when a cost check replaced it; `None` when it
    /// stood.
    pub overruled: Option<Overruled>,
}

/// Which cost check of `weighted` and `affinity_gate` replaced the scores'
/// pick (`Router::keep_cheaper_holder`, `Router::leave_costlier_holder`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CostCheck {
    /// `scheduling.keep_cheaper_holder`: a holder of the prefix instead of
    /// a load pick that would prefill most of it again.
    KeptHolder,
    /// `scheduling.leave_costlier_holder`: another endpoint instead of the
    /// holder, cheaper even after prefilling again what the holder had.
    LeftHolder,
    /// `scheduling.decode_speed`: another endpoint instead of a cold or
    /// load pick that streams answers slower than the fleet's fastest (the
    /// decision keeps its reason).
    LeftSlowerDecoder,
    /// `scheduling.slot_wait`: another endpoint instead of a cold pick
    /// whose every slot is taken, where the request would wait for a
    /// whole answer to end (the decision keeps its reason).
    LeftTakenSlots,
}

/// A pick a cost check replaced.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Overruled {
    /// The check.
    pub check: CostCheck,
    /// The scores' pick.
    pub endpoint: Endpoint,
    /// Its predicted cost, ms.
    pub cost_ms: f64,
}

/// Runs a scheduling profile.
#[derive(Clone, Debug)]
pub struct Scheduler {
    config: SchedulingConfig,
}

impl Scheduler {
    /// A scheduler for the given (validated) config.
    pub fn new(config: &SchedulingConfig) -> Self {
        Scheduler {
            config: config.clone(),
        }
    }

    /// The configuration in use.
    pub fn config(&self) -> &SchedulingConfig {
        &self.config
    }

    /// Picks an endpoint; `None` only when `candidates` is empty.
    pub fn pick(
        &self,
        req: &RequestFacts,
        candidates: &[Candidate],
        rng: &mut fastrand::Rng,
    ) -> Option<Decision> {
        self.pick_predicted(req, candidates, &[], rng)
    }

    /// [`Scheduler::pick`] with each candidate's predicted TTFT, in
    /// candidate order (`predicted_ttft` profile; other profiles ignore
    /// them). Kept apart from [`Candidate`] so that the other profiles do
    /// not copy and read past them: a candidate without one (the slice is
    /// shorter) comes last.
    pub fn pick_predicted(
        &self,
        req: &RequestFacts,
        candidates: &[Candidate],
        predictions: &[Prediction],
        rng: &mut fastrand::Rng,
    ) -> Option<Decision> {
        let figures = Figures::measure(req, candidates);
        self.pick_measured(req, candidates, &figures, predictions, rng)
    }

    /// [`Scheduler::pick_predicted`] with the candidates' figures for this
    /// request already measured (`Figures::measure(req, candidates)`; the
    /// router reads them again after the pick).
    pub fn pick_measured(
        &self,
        req: &RequestFacts,
        candidates: &[Candidate],
        figures: &Figures,
        predictions: &[Prediction],
        rng: &mut fastrand::Rng,
    ) -> Option<Decision> {
        debug_assert_eq!(figures.len(), candidates.len());
        if candidates.is_empty() {
            return None;
        }
        let spec = profile::spec(self.config.profile);
        let ctx = Context {
            req,
            candidates,
            config: &self.config,
            figures,
        };
        let mut kept: Vec<usize> = (0..candidates.len()).collect();
        let mut fallback = false;
        for f in spec.filters {
            // Affinity notes are for tests and logs; only a fallback changes
            // the decision's reason.
            fallback |= f.filter(&ctx, &mut kept) == Some(Note::Fallback);
            if kept.is_empty() {
                // A filter broke its contract: ignore it rather than fail.
                kept = (0..candidates.len()).collect();
            }
        }

        let predicted = self.config.profile == crate::config::Profile::PredictedTtft;
        let total = if predicted {
            // Lower predicted cost (TTFT plus what its prefill delays the
            // requests on the endpoint, charged for leaving the prefix's
            // holder) is better; no prediction comes last.
            kept.iter()
                .map(|&i| predictions.get(i).map_or(f64::MIN, |p| -p.rank_ms()))
                .collect()
        } else {
            self.score(&ctx, &kept)
        };
        // Cold: no live endpoint holds a prefix (not merely none that passed
        // the load filters: a hot sticky endpoint dropped by a filter makes
        // a load decision, not a cold one).
        //
        // A request for a LoRA adapter that a live endpoint runs is not cold
        // either: the running adapter is an affinity like a cached prefix,
        // and the cold margin would otherwise rotate it away.
        //
        // The longest match of a live candidate (for the reason below), in
        // one pass of four independent chains.
        let live = |c: &Candidate| c.healthy || fallback;
        let mut longest = [0.0; 4];
        let columns = figures.matched().iter().zip(figures.healthy());
        for (i, (&matched, &healthy)) in columns.enumerate() {
            // A comparison, not `f64::max`: the same for these (never NaN
            // in a comparison that wins), without its NaN handling.
            let matched = if healthy || fallback { matched } else { 0.0 };
            let lane = &mut longest[i & 3];
            if matched > *lane {
                *lane = matched;
            }
        }
        let longest = longest.into_iter().fold(0.0, f64::max);
        // A live candidate holds a prefix: one with a leading block or part
        // of one (both count from 0 up, so their sum is above 0); of a
        // request of no blocks, only a part counts.
        let holds_prefix = match req.total_blocks {
            0 => candidates.iter().any(|c| live(c) && c.partial_block > 0.0),
            _ => longest > 0.0,
        };
        let adapter_runs = req.adapter.is_some()
            && candidates
                .iter()
                .any(|c| live(c) && c.adapter_fit == AdapterFit::Running);
        let cold = !adapter_runs && !holds_prefix;
        let w = &self.config.weights;
        let weight_sum = spec
            .scorers
            .iter()
            .filter(|s| s.applies(req))
            .map(|s| s.weight(w))
            .filter(|x| x.is_finite() && *x > 0.0)
            .sum::<f64>();
        // Prefill waiting, requests in flight and recency (only a cold pick
        // reads them) and, with an affinity key, rendezvous rank of each
        // kept candidate.
        let cold_rank: Vec<picker::ColdRank> = if cold {
            kept.iter()
                .map(|&i| picker::ColdRank {
                    prefill: candidates[i].inflight.tokens,
                    inflight: candidates[i].inflight.requests,
                    last_picked_ms: candidates[i].last_picked_ms,
                })
                .collect()
        } else {
            Vec::new()
        };
        let rank: Option<Vec<u64>> = req.affinity_key.map(|key| {
            kept.iter()
                .map(|&i| picker::rendezvous(key, &candidates[i].endpoint))
                .collect()
        });
        // The cold margin is a share of the total weight, or with predicted
        // TTFT a share of the best prediction.
        let unit = if predicted {
            total.iter().copied().fold(f64::MIN, f64::max).abs()
        } else {
            weight_sum
        };
        let margin = cold.then_some(self.config.cold_margin * unit);
        let kept_ref = &kept;
        let tie = req
            .first_block
            .map(|key| move |p: usize| picker::rendezvous(key, &candidates[kept_ref[p]].endpoint));
        let tie = tie.as_ref().map(|f| f as &dyn Fn(usize) -> u64);
        let k = picker::pick(&total, &cold_rank, rank.as_deref(), margin, tie, rng)?;
        let chosen = &candidates[kept[k]];

        // Prefix: the chosen endpoint holds the longest prefix any live
        // endpoint holds. Load: a prefix existed, but load sent the request
        // elsewhere (or to a shorter match).
        let reason = if fallback {
            Reason::Fallback
        } else if cold {
            Reason::Cold
        } else if chosen.matched() > 0.0 && chosen.matched() >= longest {
            Reason::Prefix
        } else {
            Reason::Load
        };
        let shown = best_scored(&total, k);
        let mut scores = Vec::with_capacity(shown.len());
        let mut chosen_predictions = Vec::new();
        for p in shown {
            let i = kept[p];
            scores.push((candidates[i].endpoint, total[p]));
            if predicted {
                chosen_predictions.extend(predictions.get(i).copied());
            }
        }
        Some(Decision {
            endpoint: chosen.endpoint,
            reason,
            matched_blocks: chosen.matched_blocks,
            held_blocks: chosen.matched_blocks,
            scores,
            // Empty unless `predicted_ttft` (`pick` passes none).
            prediction: predictions.get(kept[k]).copied(),
            predictions: chosen_predictions,
            overruled: None,
        })
    }
}

/// Positions (into `total`, ascending) of `chosen` and of the best others
/// by score, ties to the earlier, at most [`SCORES_KEPT`] in all. The
/// router's candidates follow the sorted pool, so that is the order
/// `Router::fallbacks` ranks them in (score, then address). One pass: an
/// entry not better than the worst of the best so far (a tie included)
/// costs one comparison.
fn best_scored(total: &[f64], chosen: usize) -> Vec<usize> {
    if total.len() <= SCORES_KEPT {
        return (0..total.len()).collect();
    }
    // Positions are visited in order: a later one beats an earlier one only
    // with a strictly higher score.
    let better = |a: usize, b: usize| total[a].total_cmp(&total[b]).is_gt();
    let mut best: Vec<usize> = Vec::with_capacity(SCORES_KEPT);
    for p in (0..total.len()).filter(|&p| p != chosen) {
        if best.len() == SCORES_KEPT - 1 {
            if !better(p, best[SCORES_KEPT - 2]) {
                continue;
            }
            best.pop();
        }
        let at = best
            .iter()
            .position(|&b| better(p, b))
            .unwrap_or(best.len());
        best.insert(at, p);
    }
    best.push(chosen);
    best.sort_unstable();
    best
}

impl Scheduler {
    /// Weighted score of each kept candidate (clamped, weighted, summed).
    fn score(&self, ctx: &Context, kept: &[usize]) -> Vec<f64> {
        let spec = profile::spec(self.config.profile);
        let mut total = vec![0.0; kept.len()];
        let mut raw = Vec::new();
        for s in spec.scorers {
            let weight = s.weight(&self.config.weights);
            if weight <= 0.0 || !weight.is_finite() || !s.applies(ctx.req) {
                continue;
            }
            // Straight from its column, without a score vector.
            if let Some((column, scale)) = s.figure(ctx) {
                scale.add_weighted(column, kept, weight, &mut total);
                continue;
            }
            s.score(ctx, kept, &mut raw);
            raw.resize(kept.len(), 0.0);
            for (t, &r) in total.iter_mut().zip(&raw) {
                // Clamped to 0..1, NaN as 0: two selects.
                *t += min_num(non_negative(r), 1.0) * weight;
            }
        }
        total
    }
}

#[cfg(test)]
pub(crate) mod test_support {
    use super::*;

    /// A healthy candidate `10.0.0.<i+1>:8000` with an idle fresh snapshot.
    pub fn cand(i: usize) -> Candidate {
        Candidate {
            endpoint: format!("10.0.0.{}:8000", i + 1).parse().unwrap(),
            snapshot: Some(MetricsSnapshot {
                waiting: 0.0,
                running: 0.0,
                kv_usage: Some(0.1),
                kv_capacity_tokens: None,
            }),
            healthy: true,
            matched_blocks: 0,
            partial_block: 0.0,
            inflight: InFlight::default(),
            last_picked_ms: None,
            adapter_fit: AdapterFit::Unknown,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::test_support::cand;
    use super::*;
    use crate::config::{Profile, Weights};
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn a_large_pool_keeps_the_chosen_and_the_best_scores_in_candidate_order() {
        let mut rng = fastrand::Rng::with_seed(11);
        // Candidates in address order, as the router builds them.
        let ep = |p: usize| cand(p).endpoint;
        for round in 0..500 {
            let n = rng.usize(1..60);
            // Few distinct values (ties), some NaN of either sign, both
            // zeros and infinities (`total_cmp` orders them all).
            let total: Vec<f64> = (0..n)
                .map(|_| match rng.u8(0..14) {
                    0 => f64::NAN,
                    1 => -f64::NAN,
                    2 => -0.0,
                    3 => f64::INFINITY,
                    4 => f64::NEG_INFINITY,
                    v => f64::from(v % 4),
                })
                .collect();
            let chosen = rng.usize(..n);
            let got = best_scored(&total, chosen);
            assert!(got.contains(&chosen), "round {round}");
            assert!(got.windows(2).all(|w| w[0] < w[1]), "{got:?}");
            assert_eq!(got.len(), n.min(SCORES_KEPT), "round {round}");
            // The others are the best by score then address, as the
            // fallbacks rank them over every score.
            let rank = |v: &mut Vec<usize>| {
                v.sort_by(|&a, &b| total[b].total_cmp(&total[a]).then(ep(a).cmp(&ep(b))))
            };
            let mut all: Vec<usize> = (0..n).filter(|&p| p != chosen).collect();
            rank(&mut all);
            let mut others: Vec<usize> = got.iter().copied().filter(|&p| p != chosen).collect();
            rank(&mut others);
            assert_eq!(others, all[..others.len()], "round {round}: {total:?}");
        }
    }

    #[test]
    fn a_decision_over_a_large_pool_names_at_most_the_kept_scores() {
        let cands: Vec<Candidate> = (0..40)
            .map(|i| {
                let mut c = cand(i);
                c.inflight.requests = (i % 4) as u32;
                c
            })
            .collect();
        let mut rng = fastrand::Rng::with_seed(3);
        let d = sched(Profile::Weighted)
            .pick(&req(4), &cands, &mut rng)
            .unwrap();
        assert_eq!(d.scores.len(), SCORES_KEPT);
        assert!(d.scores.iter().any(|(e, _)| *e == d.endpoint));
        let best = d.scores.iter().map(|s| s.1).fold(f64::MIN, f64::max);
        // Idle candidates (0, 4, 8, ...: ten of them) score best: seven
        // are kept beside the chosen one (a cold pick: any within the
        // margin).
        for (e, s) in d.scores.iter().filter(|(e, _)| *e != d.endpoint) {
            let i = cands.iter().position(|c| c.endpoint == *e).unwrap();
            assert_eq!(i % 4, 0, "{e}: {s} (best {best})");
        }
    }

    fn sched(profile: Profile) -> Scheduler {
        Scheduler::new(&SchedulingConfig {
            profile,
            ..SchedulingConfig::default()
        })
    }

    fn req(blocks: usize) -> RequestFacts {
        RequestFacts {
            total_blocks: blocks,
            prompt_tokens: blocks as u64 * 64,
            affinity_key: None,
            first_block: None,
            adapter: None,
        }
    }

    fn loaded(i: usize, waiting: f64, running: f64, kv: f64, inflight: u32) -> Candidate {
        let mut c = cand(i);
        c.snapshot = Some(MetricsSnapshot {
            waiting,
            running,
            kv_usage: Some(kv),
            kv_capacity_tokens: None,
        });
        c.inflight.requests = inflight;
        c
    }

    #[test]
    fn empty_pool_is_none() {
        let s = sched(Profile::Weighted);
        assert_eq!(s.pick(&req(4), &[], &mut fastrand::Rng::with_seed(1)), None);
    }

    type Case = (
        &'static str,
        &'static [Profile],
        usize,
        Vec<Candidate>,
        usize,
        Reason,
    );

    #[test]
    fn reasons_table() {
        const BOTH: &[Profile] = &[Profile::Weighted, Profile::AffinityGate];
        let mut unhealthy = vec![cand(0), cand(1)];
        unhealthy.iter_mut().for_each(|c| c.healthy = false);
        let mut sticky = vec![cand(0), cand(1), cand(2)];
        sticky[1].matched_blocks = 10;
        let mut low_match_on_loaded = vec![loaded(0, 6.0, 10.0, 0.9, 16), cand(1)];
        low_match_on_loaded[0].matched_blocks = 2;
        let mut match_on_idle = vec![cand(0), loaded(1, 4.0, 8.0, 0.8, 12)];
        match_on_idle[0].matched_blocks = 2;
        // (what, profiles, request blocks, candidates, endpoint index, reason)
        let cases: Vec<Case> = vec![
            ("all unhealthy", BOTH, 10, unhealthy, 9, Reason::Fallback),
            (
                "cold",
                BOTH,
                10,
                vec![cand(0), loaded(1, 3.0, 0.0, 0.5, 3)],
                0,
                Reason::Cold,
            ),
            ("no blocks is cold", BOTH, 0, vec![cand(0)], 0, Reason::Cold),
            ("sticky", BOTH, 10, sticky, 1, Reason::Prefix),
            (
                "match elsewhere, load wins",
                BOTH,
                10,
                low_match_on_loaded,
                1,
                Reason::Load,
            ),
            (
                "match on least loaded: the prefix holder",
                BOTH,
                10,
                match_on_idle,
                0,
                Reason::Prefix,
            ),
        ];
        for (what, profiles, blocks, cands, want, reason) in cases {
            for &p in profiles {
                let d = sched(p)
                    .pick(&req(blocks), &cands, &mut fastrand::Rng::with_seed(3))
                    .unwrap();
                assert_eq!(d.reason, reason, "{what} {p:?}");
                if want != 9 {
                    assert_eq!(d.endpoint, cands[want].endpoint, "{what} {p:?}");
                }
                assert_eq!(
                    d.matched_blocks,
                    cands
                        .iter()
                        .find(|c| c.endpoint == d.endpoint)
                        .unwrap()
                        .matched_blocks
                );
            }
        }
    }

    #[test]
    fn unhealthy_endpoints_are_not_scored() {
        let mut cands = vec![cand(0), cand(1), cand(2)];
        cands[1].healthy = false;
        cands[1].matched_blocks = 10;
        let d = sched(Profile::Weighted)
            .pick(&req(10), &cands, &mut fastrand::Rng::with_seed(1))
            .unwrap();
        assert_ne!(d.endpoint, cands[1].endpoint);
        assert_eq!(d.reason, Reason::Cold);
        let scored: Vec<_> = d.scores.iter().map(|(e, _)| *e).collect();
        assert_eq!(scored, vec![cands[0].endpoint, cands[2].endpoint]);
    }

    #[test]
    fn scores_are_the_weighted_sums() {
        let mut a = loaded(0, 0.0, 0.0, 0.5, 0);
        a.matched_blocks = 5;
        let b = loaded(1, 8.0, 0.0, 0.0, 4);
        let d = sched(Profile::Weighted)
            .pick(
                &req(10),
                &[a.clone(), b.clone()],
                &mut fastrand::Rng::with_seed(1),
            )
            .unwrap();
        // Uncached tokens: a = 320, b = 640; 320 apart < 4096 floor.
        let t = 320.0 / 4096.0;
        // a: prefix 3*0.5 + queue 2*1 + kv 2*0.5 + in-flight 2*1 + tokens 1*1
        let want_a = 1.5 + 2.0 + 1.0 + 2.0 + 1.0;
        // b: prefix 0 + queue 2*0 (8 waiting, floor 4) + kv 2*1
        //    + in-flight 2*(1 - 4/8) + tokens 1*(1 - t)
        let want_b = 0.0 + 0.0 + 2.0 + 1.0 + (1.0 - t);
        assert_eq!(d.scores.len(), 2);
        assert!((d.scores[0].1 - want_a).abs() < 1e-9, "{:?}", d.scores);
        assert!((d.scores[1].1 - want_b).abs() < 1e-9, "{:?}", d.scores);
        assert_eq!(d.endpoint, a.endpoint);
    }

    #[test]
    fn a_running_adapter_is_an_affinity_not_a_cold_pick() {
        use crate::metrics::lora::{adapter_id, LoraSnapshot};
        // The fit the router gives each candidate for the request's adapter.
        let fit = |cands: &mut [Candidate], lora: &[LoraSnapshot], adapter: &str| {
            for (c, l) in cands.iter_mut().zip(lora) {
                c.adapter_fit = l.fit(adapter_id(adapter));
            }
        };
        let lora = ["", "sql", ""].map(|running| LoraSnapshot::from_labels(running, "", "1"));
        let with_lora = |i, waiting: f64| loaded(i, waiting, 0.0, 0.1, 0);
        // sql runs on 1, which also has one more request waiting; 0 and 2
        // have a free slot and were picked less recently.
        let mut cands = vec![with_lora(0, 0.0), with_lora(1, 1.0), with_lora(2, 0.0)];
        cands[1].last_picked_ms = Some(100);
        fit(&mut cands, &lora, "sql");
        let req = RequestFacts {
            adapter: Some(adapter_id("sql")),
            ..RequestFacts::default()
        };
        let s = Scheduler::new(&SchedulingConfig::default());
        let mut rng = fastrand::Rng::with_seed(1);
        for _ in 0..20 {
            let d = s.pick(&req, &cands, &mut rng).unwrap();
            assert_eq!(d.endpoint, cands[1].endpoint);
            assert_eq!(d.reason, Reason::Load);
        }
        // Three more waiting: the free slots win.
        cands[1].snapshot.as_mut().unwrap().waiting = 3.0;
        let d = s.pick(&req, &cands, &mut rng).unwrap();
        assert_ne!(d.endpoint, cands[1].endpoint);
        // An adapter nobody runs: a cold pick among the free slots.
        let other = RequestFacts {
            adapter: Some(adapter_id("fin")),
            ..RequestFacts::default()
        };
        fit(&mut cands, &lora, "fin");
        let d = s.pick(&other, &cands, &mut rng).unwrap();
        assert_eq!(d.reason, Reason::Cold);
        assert_ne!(d.endpoint, cands[1].endpoint, "its only slot runs sql");
    }

    #[test]
    fn zero_weight_skips_a_scorer() {
        let cfg = SchedulingConfig {
            weights: Weights {
                prefix: 0.0,
                queue: 1.0,
                kv_cache: 0.0,
                inflight_requests: 0.0,
                inflight_tokens: 0.0,
                lora_affinity: 0.0,
            },
            ..SchedulingConfig::default()
        };
        let mut a = loaded(0, 5.0, 0.0, 0.0, 0);
        a.matched_blocks = 10;
        let b = loaded(1, 0.0, 0.0, 1.0, 0);
        let d = Scheduler::new(&cfg)
            .pick(&req(10), &[a, b.clone()], &mut fastrand::Rng::with_seed(1))
            .unwrap();
        assert_eq!(d.endpoint, b.endpoint);
        assert_eq!(d.scores[0].1, 0.0);
        assert_eq!(d.scores[1].1, 1.0);
        assert_eq!(d.reason, Reason::Load);
    }

    #[test]
    fn deterministic_for_a_seed_and_random_across_seeds() {
        let cands: Vec<_> = (0..4).map(cand).collect();
        let s = sched(Profile::Weighted);
        let mut seen = std::collections::BTreeSet::new();
        for seed in 0..64 {
            let a = s
                .pick(&req(4), &cands, &mut fastrand::Rng::with_seed(seed))
                .unwrap();
            let b = s
                .pick(&req(4), &cands, &mut fastrand::Rng::with_seed(seed))
                .unwrap();
            assert_eq!(a, b);
            seen.insert(a.endpoint);
        }
        assert_eq!(seen.len(), 4, "ties must be broken at random");
    }

    /// Simulates `n` requests within one scrape interval (snapshots frozen),
    /// updating in-flight and last-picked between picks like the filter.
    fn burst(
        s: &Scheduler,
        cands: &mut [Candidate],
        n: usize,
        blocks: usize,
        seed: u64,
    ) -> Vec<usize> {
        let mut rng = fastrand::Rng::with_seed(seed);
        let mut counts = vec![0; cands.len()];
        for t in 0..n {
            // Distinct new conversations: distinct first blocks (keyed
            // with peers: odd seeds here).
            let facts = RequestFacts {
                affinity_key: (seed % 2 == 1).then_some(seed << 32 | t as u64),
                adapter: None,
                ..req(blocks)
            };
            let d = s.pick(&facts, cands, &mut rng).unwrap();
            assert_eq!(d.reason, Reason::Cold);
            let i = cands.iter().position(|c| c.endpoint == d.endpoint).unwrap();
            counts[i] += 1;
            cands[i].inflight.requests += 1;
            cands[i].inflight.tokens += blocks as u64 * 64;
            cands[i].last_picked_ms = Some(1_000 + t as u64);
        }
        counts
    }

    #[test]
    fn cold_burst_spreads_over_all_endpoints() {
        for profile in [Profile::Weighted, Profile::AffinityGate] {
            for seed in 0..10 {
                // Equal endpoints, and endpoints with slightly different KV
                // usage (the classic hot spot: the lowest would take all).
                for kv in [[0.1, 0.1, 0.1, 0.1], [0.10, 0.12, 0.14, 0.16]] {
                    let mut cands: Vec<_> = (0..4).map(|i| loaded(i, 0.0, 0.0, kv[i], 0)).collect();
                    let counts = burst(&sched(profile), &mut cands, 32, 8, seed);
                    assert!(
                        counts.iter().all(|&c| (6..=10).contains(&c)),
                        "{profile:?} {kv:?} {counts:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn a_new_conversation_waits_behind_the_fewest_tokens_not_requests() {
        // Hotspot's first burst (seed 7, 4 pods): endpoint 0 prefills three
        // new 3000-token conversations, the others serve more requests, a
        // few hundred uncached tokens each. Within the cold margin on
        // scores, by count endpoint 0 looked emptiest and got a fourth and
        // fifth (first token after 940 ms; 220 ms elsewhere).
        for profile in [Profile::Weighted, Profile::AffinityGate] {
            let mut cands: Vec<_> = (0..4).map(|i| loaded(i, 0.0, 0.0, 0.1, 0)).collect();
            for (c, (requests, tokens)) in
                cands
                    .iter_mut()
                    .zip([(3, 9_639), (9, 1_800), (7, 1_400), (8, 1_600)])
            {
                c.inflight.requests = requests;
                c.inflight.tokens = tokens;
                c.inflight.waiting = requests;
            }
            let s = sched(profile);
            let d = s
                .pick(&req(50), &cands, &mut fastrand::Rng::with_seed(1))
                .unwrap();
            assert_eq!(d.reason, Reason::Cold);
            let best = d.scores.iter().map(|&(_, x)| x).fold(f64::MIN, f64::max);
            let first = d.scores.iter().find(|&&(e, _)| e == cands[0].endpoint);
            assert!(
                first.is_some_and(|&(_, x)| x >= best - 0.5),
                "{profile:?}: endpoint 0 within the margin: {:?}",
                d.scores
            );
            assert_eq!(d.endpoint, cands[2].endpoint, "{profile:?}: {:?}", d.scores);
        }
    }

    #[test]
    fn cold_requests_sharing_a_first_block_agree_within_the_load_bound() {
        // Three replicas that have not heard of each other (different RNG
        // seeds, different pick histories) route the same cold request.
        let s = sched(Profile::Weighted);
        let facts = RequestFacts {
            affinity_key: Some(0xabc),
            adapter: None,
            ..req(8)
        };
        let picks: Vec<Endpoint> = (0..3)
            .map(|replica| {
                let mut cands: Vec<_> = (0..4).map(|i| loaded(i, 0.0, 0.0, 0.1, 0)).collect();
                cands[replica].last_picked_ms = Some(5);
                let mut rng = fastrand::Rng::with_seed(replica as u64);
                s.pick(&facts, &cands, &mut rng).unwrap().endpoint
            })
            .collect();
        assert!(picks.iter().all(|e| *e == picks[0]), "{picks:?}");
        // The same request, repeated as in-flight work piles on the choice:
        // it stays until about two more requests than elsewhere, then moves.
        let mut cands: Vec<_> = (0..4).map(|i| loaded(i, 0.0, 0.0, 0.1, 0)).collect();
        let mut rng = fastrand::Rng::with_seed(1);
        let first = s.pick(&facts, &cands, &mut rng).unwrap().endpoint;
        let i = cands.iter().position(|c| c.endpoint == first).unwrap();
        for extra in 1..=4 {
            cands[i].inflight.requests = extra;
            let d = s.pick(&facts, &cands, &mut rng).unwrap();
            assert_eq!(d.endpoint == first, extra <= 2, "{extra} more in flight");
        }
    }

    #[test]
    fn cold_burst_avoids_a_loaded_endpoint() {
        let s = sched(Profile::Weighted);
        let mut cands: Vec<_> = (0..4).map(|i| loaded(i, 0.0, 2.0, 0.2, 2)).collect();
        cands[3] = loaded(3, 12.0, 40.0, 0.95, 40);
        let counts = burst(&s, &mut cands, 32, 8, 5);
        assert_eq!(counts[3], 0, "{counts:?}");
        assert!(counts[..3].iter().all(|&c| c >= 8), "{counts:?}");
    }

    #[test]
    fn sticky_endpoint_with_a_huge_queue_loses() {
        for profile in [Profile::Weighted, Profile::AffinityGate] {
            // Even with equal KV usage and no in-flight difference, the queue
            // alone must eventually win over a 100% match... with help from
            // in-flight (kvroute's own burst) in the weighted profile.
            let mut a = loaded(0, 40.0, 60.0, 0.5, 100);
            a.matched_blocks = 10;
            let b = loaded(1, 0.0, 10.0, 0.5, 10);
            let d = sched(profile)
                .pick(
                    &req(10),
                    &[a.clone(), b.clone()],
                    &mut fastrand::Rng::with_seed(1),
                )
                .unwrap();
            assert_eq!(d.endpoint, b.endpoint, "{profile:?} {:?}", d.scores);
            assert_eq!(d.reason, Reason::Load, "{profile:?}");
            // A realistic saturated endpoint (KV nearly full) loses even when
            // kvroute is not the one that loaded it.
            let mut a = loaded(0, 40.0, 60.0, 0.97, 0);
            a.matched_blocks = 10;
            let b = loaded(1, 0.0, 10.0, 0.3, 0);
            let d = sched(profile)
                .pick(&req(10), &[a, b.clone()], &mut fastrand::Rng::with_seed(1))
                .unwrap();
            assert_eq!(d.endpoint, b.endpoint, "{profile:?} {:?}", d.scores);
        }
    }

    #[test]
    fn sticky_endpoint_survives_small_load_differences() {
        // (what, sticky candidate, match fraction of 10 blocks)
        let cases = [
            ("1 more waiting", loaded(0, 1.0, 4.0, 0.3, 5), 10),
            (
                "3 more in flight, not queueing",
                loaded(0, 0.0, 7.0, 0.35, 7),
                10,
            ),
            (
                "8 more in flight, not queueing",
                loaded(0, 0.0, 12.0, 0.4, 12),
                10,
            ),
            ("2 more waiting, 80% match", loaded(0, 2.0, 4.0, 0.3, 6), 8),
        ];
        for profile in [Profile::Weighted, Profile::AffinityGate] {
            for (what, mut a, m) in cases.clone() {
                a.matched_blocks = m;
                let others: Vec<_> = (1..4).map(|i| loaded(i, 0.0, 4.0, 0.3, 4)).collect();
                let mut cands = vec![a.clone()];
                cands.extend(others);
                let d = sched(profile)
                    .pick(&req(10), &cands, &mut fastrand::Rng::with_seed(9))
                    .unwrap();
                assert_eq!(d.endpoint, a.endpoint, "{what} {profile:?} {:?}", d.scores);
                assert_eq!(d.reason, Reason::Prefix, "{what} {profile:?}");
            }
        }
    }

    #[test]
    fn fresh_conversation_avoids_a_loaded_endpoint_that_holds_a_shared_prefix() {
        // Endpoint 0 holds the 20% system-prompt prefix but is busy.
        let mut a = loaded(0, 3.0, 20.0, 0.8, 23);
        a.matched_blocks = 2;
        let cands = vec![a, loaded(1, 0.0, 3.0, 0.2, 3), loaded(2, 0.0, 2.0, 0.2, 2)];
        let d = sched(Profile::Weighted)
            .pick(&req(10), &cands, &mut fastrand::Rng::with_seed(2))
            .unwrap();
        assert_eq!(d.endpoint, cands[2].endpoint);
        assert_eq!(d.reason, Reason::Load);
    }

    #[test]
    fn stale_snapshot_gets_neutral_load_scores() {
        let mut stale = cand(0);
        stale.snapshot = None;
        let fresh_busy = loaded(1, 10.0, 10.0, 0.9, 0);
        let fresh_idle = loaded(2, 0.0, 0.0, 0.1, 0);
        let d = sched(Profile::Weighted)
            .pick(
                &req(4),
                &[stale, fresh_busy, fresh_idle],
                &mut fastrand::Rng::with_seed(1),
            )
            .unwrap();
        // stale: queue 0.5*2 + kv 0.5*2 + 2 + 1 = 5; idle: 2 + 1.8 + 3;
        // busy (10 waiting, > gate_max_queue_excess over idle) is filtered out.
        let s: Vec<f64> = d.scores.iter().map(|x| (x.1 * 1e6).round() / 1e6).collect();
        assert_eq!(s, vec![5.0, 6.8]);
    }

    #[test]
    fn affinity_gate_keeps_then_opens_as_a_sticky_endpoint_fills() {
        let s = sched(Profile::AffinityGate);
        let others: Vec<_> = (1..3).map(|i| loaded(i, 0.0, 8.0, 0.5, 0)).collect();
        let mut picks = vec![];
        for waiting in [0.0, 4.0, 8.0, 9.0, 30.0] {
            let mut a = loaded(0, waiting, 8.0, 0.5, 0);
            a.matched_blocks = 9;
            let mut cands = vec![a];
            cands.extend(others.clone());
            let d = s
                .pick(&req(10), &cands, &mut fastrand::Rng::with_seed(1))
                .unwrap();
            picks.push((d.endpoint == cands[0].endpoint, d.reason));
        }
        assert_eq!(
            picks,
            vec![
                (true, Reason::Prefix),
                (true, Reason::Prefix),
                (true, Reason::Prefix),
                (false, Reason::Load),
                (false, Reason::Load),
            ]
        );
    }
}

#[cfg(test)]
mod conversation_tests {
    use super::test_support::cand;
    use super::*;
    use crate::config::Profile;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    /// 20 conversations x 4 turns on 4 equal endpoints. Each round sends one
    /// turn of every conversation in random order (all in flight together,
    /// snapshots frozen at idle: the worst case between scrapes), then all
    /// finish. Turn 1 is `first` blocks, each turn adds `grow`. Returns the
    /// fraction of later turns that landed on the conversation's first
    /// endpoint, and the turn-1 spread.
    fn run(profile: Profile, first: usize, grow: usize, seed: u64) -> (f64, Vec<usize>) {
        let s = Scheduler::new(&SchedulingConfig {
            profile,
            ..SchedulingConfig::default()
        });
        let mut rng = fastrand::Rng::with_seed(seed);
        let mut cands: Vec<_> = (0..4).map(cand).collect();
        // holds[e][conv] = blocks of conv's prefix endpoint e holds.
        let mut holds = vec![vec![0usize; 20]; 4];
        let mut home = [usize::MAX; 20];
        let (mut stuck, mut later) = (0, 0);
        let mut spread = vec![0; 4];
        let mut now = 0;
        for turn in 0..4 {
            let blocks = first + turn * grow;
            let mut order: Vec<usize> = (0..20).collect();
            rng.shuffle(&mut order);
            for conv in order {
                for (e, c) in cands.iter_mut().enumerate() {
                    c.matched_blocks = holds[e][conv];
                }
                let req = RequestFacts {
                    total_blocks: blocks,
                    prompt_tokens: blocks as u64 * 64,
                    affinity_key: None,
                    first_block: None,
                    adapter: None,
                };
                let d = s.pick(&req, &cands, &mut rng).unwrap();
                let e = cands.iter().position(|c| c.endpoint == d.endpoint).unwrap();
                now += 1;
                cands[e].last_picked_ms = Some(now);
                cands[e].inflight.requests += 1;
                cands[e].inflight.tokens += ((blocks - d.matched_blocks) * 64) as u64;
                holds[e][conv] = blocks;
                if turn == 0 {
                    home[conv] = e;
                    spread[e] += 1;
                } else {
                    later += 1;
                    stuck += usize::from(e == home[conv]);
                }
            }
            for c in cands.iter_mut() {
                c.inflight = InFlight::default();
            }
        }
        (stuck as f64 / later as f64, spread)
    }

    #[test]
    fn conversations_stick_to_their_first_endpoint() {
        // The affinity gate keeps only endpoints matching at least 80%
        // (`affinity_threshold`), so it is checked on turns that do.
        let cases = [
            (Profile::Weighted, [(8, 4), (4, 4), (16, 2), (8, 8)]),
            (Profile::AffinityGate, [(16, 2), (8, 2), (32, 8), (40, 2)]),
        ];
        for (profile, shapes) in cases {
            for (first, grow) in shapes {
                for seed in 0..20 {
                    let (frac, spread) = run(profile, first, grow, seed);
                    assert!(
                        frac >= 0.95,
                        "{profile:?} first {first} grow {grow} seed {seed}: {frac}"
                    );
                    assert!(spread.iter().all(|&n| n == 5), "{spread:?}");
                }
            }
        }
    }
}
