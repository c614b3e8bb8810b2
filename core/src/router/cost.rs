//! The TTFT model's side of routing: each candidate's prediction
//! (`ttft.rs`, plus `decode_speed.rs` on a mixed fleet) and the cost checks
//! that let it overrule the scores of `weighted` and `affinity_gate`
//! (`keep_cheaper_holder`, `leave_costlier_holder`, `decode_speed`), all
//! by one rule ([`move_pays`]).

use super::Router;
use crate::endpoint::Endpoint;
use crate::float::{max_num, min_num, non_negative};
use crate::scheduler::figures::Figures;
use crate::scheduler::{Candidate, CostCheck, Decision, Overruled, Reason, RequestFacts};
use crate::ttft::Prediction;

impl Router {
    /// The two cost checks of `weighted` and `affinity_gate`, on by
    /// default. Their load scores and filters work on a scale of their own:
    /// each score saturates at its weight, so they cannot say whether a
    /// holder's queue or decode load now costs more than prefilling the
    /// prompt elsewhere. The TTFT model (`ttft.rs`: the prefill queued
    /// ahead, the decode load, the uncached tokens, and what the prefill
    /// delays the requests there) prices the pick and its rivals:
    ///
    /// - a `load` pick that left a holder: [`Router::keep_cheaper_holder`];
    /// - a `prefix` pick: [`Router::cheaper_rival`]
    ///   (`scheduling.leave_costlier_holder`);
    /// - a `cold` or `load` pick (one the check above left alone) on an
    ///   endpoint that streams answers slower than the fleet's fastest
    ///   (`scheduling.decode_speed`): the same, keeping its reason;
    /// - a `cold` pick on an endpoint whose slots are all taken
    ///   (`scheduling.slot_wait`: the prediction holds a wait for a whole
    ///   answer to end): the same, keeping its reason.
    ///
    /// All leave a pick only by one rule ([`move_pays`]).
    ///
    /// Either way the chosen endpoint's prediction is recorded; the model
    /// learns from it (`Decision::prediction`).
    pub(super) fn check_by_cost(
        &self,
        decision: &mut Decision,
        candidates: &[Candidate],
        figures: &Figures,
        req: &RequestFacts,
        now_ms: u64,
    ) {
        let scheduling = &self.config.scheduling;
        // The slot check prices cold picks only: with the other checks off,
        // the rest are not predicted (nor learnt from) as before.
        let slot_check = scheduling.slot_wait && decision.reason == Reason::Cold;
        if !(scheduling.keep_cheaper_holder
            || scheduling.leave_costlier_holder
            || scheduling.decode_speed
            || slot_check)
        {
            return;
        }
        // Candidates follow the sorted pool.
        let at = |e: Endpoint| {
            candidates
                .binary_search_by(|c| c.endpoint.cmp(&e))
                .ok()
                .map(|i| &candidates[i])
        };
        let Some(chosen) = at(decision.endpoint) else {
            return;
        };
        let prediction = self.prediction(chosen, req.prompt_tokens, now_ms);
        // A pass over two columns: only when a check prices a move.
        let arrivals_per_ms = || self.arrivals_per_ms(figures);
        // The best scored others, priced against the pick.
        let cheaper_rival = || {
            let rivals = decision.scores.iter().filter_map(|&(e, _)| at(e));
            self.cheaper_rival(
                chosen,
                &prediction,
                rivals,
                req.prompt_tokens,
                now_ms,
                arrivals_per_ms(),
            )
        };
        let better = match decision.reason {
            Reason::Load if scheduling.keep_cheaper_holder => self.keep_cheaper_holder(
                chosen,
                &prediction,
                candidates,
                req.prompt_tokens,
                now_ms,
                arrivals_at(chosen, arrivals_per_ms(), now_ms),
            ),
            // An adapter request stays where the scores put it: the model
            // does not price loading an adapter.
            Reason::Prefix if scheduling.leave_costlier_holder && req.adapter.is_none() => {
                cheaper_rival().map(|(c, p)| (CostCheck::LeftHolder, c, p))
            }
            _ => None,
        }
        .or_else(|| {
            // A cold pick is the rotation's and a load pick the load
            // scores': both count requests and tokens, not capacity. A
            // cold one on an engine whose slots are all taken is priced
            // (the rotation takes the least prefill waiting, and a pod
            // whose slots all decode has none waiting), and on a mixed
            // fleet either one on an endpoint that streams slower.
            let check = if req.adapter.is_some() {
                None
            } else if decision.reason == Reason::Cold && prediction.slot_wait_ms > 0.0 {
                Some(CostCheck::LeftTakenSlots)
            } else if matches!(decision.reason, Reason::Cold | Reason::Load)
                && prediction.slow_decode_ms > 0.0
            {
                Some(CostCheck::LeftSlowerDecoder)
            } else {
                None
            };
            check.and_then(|check| cheaper_rival().map(|(c, p)| (check, c, p)))
        });
        decision.prediction = Some(prediction);
        if let Some((check, c, p)) = better {
            decision.overruled = Some(Overruled {
                check,
                endpoint: decision.endpoint,
                cost_ms: prediction.cost_ms,
            });
            decision.endpoint = c.endpoint;
            decision.reason = match check {
                CostCheck::KeptHolder => Reason::Prefix,
                CostCheck::LeftHolder => Reason::Load,
                CostCheck::LeftSlowerDecoder | CostCheck::LeftTakenSlots => decision.reason,
            };
            decision.matched_blocks = c.matched_blocks;
            decision.held_blocks = c.matched_blocks;
            decision.prediction = Some(p);
        }
    }

    /// `scheduling.keep_cheaper_holder`: the pick left a holder of the
    /// longest live prefix for load (long-qa: a 60k-token document
    /// re-prefilled for 2.6 s, the questions queued behind it waiting as
    /// long). When it would prefill again at least
    /// `keep_cheaper_holder_min_saved` of the prompt that the holder has
    /// cached, the cheapest such holder is kept unless leaving it pays by
    /// the rule `leave_costlier_holder` applies ([`move_pays`]: the pick's
    /// cost, charged for the prefill it repeats, below the holder's by more
    /// than the margin of noise, [`noise_ms`]); a holder whose queue costs
    /// more than that still loses. (Uncharged, a near tie went to the
    /// re-prefill: a holder that has just started prefilling the very
    /// document a question needs counts that document's in-flight tokens
    /// as ahead, as much as the pick's own prefill of it.) Smaller
    /// differences stay with the load scores and
    /// [`Router::cheaper_rival`]: vetoing every move of a
    /// conversation whose shared prompt is cached everywhere kept hot
    /// groups on one pod (bench/README.md).
    fn keep_cheaper_holder<'c>(
        &self,
        chosen: &Candidate,
        prediction: &Prediction,
        candidates: &'c [Candidate],
        prompt_tokens: u64,
        now_ms: u64,
        arrivals_per_ms: f64,
    ) -> Option<(CostCheck, &'c Candidate, Prediction)> {
        let longest = longest_live_match(candidates);
        // Holders saving at least this many cached tokens over the pick.
        let min_saved = self.config.scheduling.keep_cheaper_holder_min_saved * prompt_tokens as f64;
        let block_tokens = self.config.prefix.block_tokens as f64;
        candidates
            .iter()
            .filter(|c| {
                c.healthy
                    && c.matched() >= longest
                    && c.matched() > chosen.matched()
                    && (c.matched() - chosen.matched()) * block_tokens >= min_saved
            })
            .map(|c| (c, self.prediction(c, prompt_tokens, now_ms)))
            .min_by(|a, b| a.1.cost_ms.total_cmp(&b.1.cost_ms))
            .filter(|(_, holder)| !move_pays(holder, prediction, arrivals_per_ms))
            .map(|(c, p)| (CostCheck::KeptHolder, c, p))
    }

    /// `scheduling.leave_costlier_holder`: the pick holds the longest
    /// prefix, but its decode load or queue may cost more than prefilling
    /// the prompt elsewhere (agentic: 24 agents' first requests share a
    /// tool prompt within 3 ms and 23 piled onto its first holder, whose
    /// prefix score outweighs every load score at its cap, leaving a pod
    /// idle for the whole run). A rival among the best scored others (at
    /// most [`crate::scheduler::SCORES_KEPT`], all past the filters) wins
    /// if its cost, charged for the prefill it repeats ([`charged`]: the
    /// holder would not have prefilled those tokens at all; weighed by the
    /// requests expected at the rival while it does, [`arrivals_at`]), is
    /// still below the holder's by more than the margin of noise
    /// ([`noise_ms`]: closer predictions are a tie). The prefix then gains a
    /// holder, and later requests balance over both.
    ///
    /// `scheduling.decode_speed` applies the same rule to a cold or load
    /// pick on an endpoint that streams answers slower than the fleet's
    /// fastest (`decode_speed.rs`): a rival is charged only for the prefix
    /// the pick holds beyond it (nothing for a cold pick).
    fn cheaper_rival<'c>(
        &self,
        chosen: &Candidate,
        prediction: &Prediction,
        rivals: impl Iterator<Item = &'c Candidate>,
        prompt_tokens: u64,
        now_ms: u64,
        arrivals_per_ms: f64,
    ) -> Option<(&'c Candidate, Prediction)> {
        rivals
            .filter(|c| c.healthy && c.endpoint != chosen.endpoint)
            .map(|c| {
                let p = self.prediction(c, prompt_tokens, now_ms);
                let arrivals = arrivals_at(c, arrivals_per_ms, now_ms);
                (charged(prediction, &p, arrivals), arrivals, c, p)
            })
            .min_by(|a, b| a.0.total_cmp(&b.0))
            .filter(|(_, arrivals, _, p)| move_pays(prediction, p, *arrivals))
            .map(|(_, _, c, p)| (c, p))
    }

    /// `predicted_ttft`: each candidate holding less of the prompt than
    /// the cheapest healthy holder of its longest prefix is charged what
    /// leaving that holder for it costs by the rule of the two cost checks
    /// ([`move_pays`]): the prefill it repeats, weighed by the arrivals
    /// expected while it runs ([`charged`]), plus the margin of noise
    /// ([`noise_ms`]).
    /// So the pick leaves the holder exactly when a cost check would, and
    /// a near tie stays (long-qa: a question on a document whose holder has
    /// just started prefilling it counts the document as ahead there, as
    /// much as its own prefill of it elsewhere; uncharged, 2 or 3
    /// questions a run took their document to a second pod on each of
    /// three trace seeds). Holders of the same prefix are not charged:
    /// later requests balance over them.
    pub(super) fn charge_moves(
        &self,
        candidates: &[Candidate],
        figures: &Figures,
        predictions: &mut [Prediction],
        now_ms: u64,
    ) {
        let longest = longest_live_match(candidates);
        if longest <= 0.0 {
            return;
        }
        let Some(holder) = candidates
            .iter()
            .zip(predictions.iter())
            .filter(|(c, _)| c.healthy && c.matched() >= longest)
            .map(|(_, p)| *p)
            .min_by(|a, b| a.cost_ms.total_cmp(&b.cost_ms))
        else {
            return;
        };
        let arrivals_per_ms = self.arrivals_per_ms(figures);
        for (c, p) in candidates.iter().zip(predictions.iter_mut()) {
            if p.uncached_tokens > holder.uncached_tokens {
                let arrivals = arrivals_at(c, arrivals_per_ms, now_ms);
                p.move_charge_ms = charged(&holder, p, arrivals) - p.cost_ms + noise_ms(&holder);
            }
        }
    }

    /// Requests the fleet sends each endpoint per ms, by Little's law: the
    /// requests present on the healthy candidates (each one's engine count
    /// or kvroute's, the larger) over the time a request holds an engine
    /// (`slots.rs`: its prefill and answer, learnt with
    /// `scheduling.slot_wait`, 1 s until then), per candidate. What
    /// [`charged`] weighs a repeated prefill by.
    fn arrivals_per_ms(&self, figures: &Figures) -> f64 {
        // From the candidates' `present` and `healthy` columns, summed in
        // four independent chains (one chain of additions through a pool
        // of 1024 was most of this pass's time).
        let (mut present, mut n) = ([0.0; 4], 0usize);
        let columns = figures.present().iter().zip(figures.healthy());
        for (i, (&here, &healthy)) in columns.enumerate() {
            present[i & 3] += if healthy { here } else { 0.0 };
            n += usize::from(healthy);
        }
        let (present, n) = (present.iter().sum::<f64>(), n as f64);
        let held = self.slots.held_ms();
        if n > 0.0 && held > 0.0 {
            present / held / n
        } else {
            0.0
        }
    }

    /// Each candidate's predicted TTFT (`ttft.rs`), in candidate order.
    pub(super) fn predict(
        &self,
        candidates: &[Candidate],
        prompt_tokens: u64,
        now_ms: u64,
    ) -> Vec<Prediction> {
        candidates
            .iter()
            .map(|c| self.prediction(c, prompt_tokens, now_ms))
            .collect()
    }

    /// One candidate's predicted TTFT (`ttft.rs`) at `now_ms`.
    fn prediction(&self, c: &Candidate, prompt_tokens: u64, now_ms: u64) -> Prediction {
        let block_tokens = self.config.prefix.block_tokens as u64;
        // A leaf match (part of a block) counts for its part.
        let cached = c.matched() * block_tokens as f64;
        let uncached = non_negative(prompt_tokens as f64 - cached);
        // Decoding there: the engine's count, or kvroute's requests past
        // their first byte if more.
        let own = c.inflight.requests.saturating_sub(c.inflight.waiting);
        let running = max_num(c.snapshot.map_or(0.0, |s| s.running), f64::from(own));
        let ahead = self.ahead_tokens(c, running, now_ms);
        // Held there (decoding or waiting): the engine's count, or
        // kvroute's if more (sent since the scrape).
        let present = max_num(
            c.snapshot.map_or(0.0, |s| s.running + s.waiting),
            f64::from(c.inflight.requests),
        );
        let slot_wait_ms = if self.config.scheduling.slot_wait {
            self.slots.wait_ms(&c.endpoint, present)
        } else {
            0.0
        };
        let mut p = self
            .ttft
            .predict(&c.endpoint, ahead, uncached, running, present, slot_wait_ms);
        // 0 unless the model is on and the endpoint streams slower.
        if self.config.scheduling.decode_speed {
            p.slow_decode_ms = self.decode.extra_ms(&c.endpoint);
        }
        p.cost_ms += p.slow_decode_ms;
        p
    }

    /// Prefill work ahead of a new request on an endpoint (`ttft.rs`):
    /// kvroute's in-flight uncached tokens there the engine has not
    /// prefilled yet by `now_ms` (`TtftModel::unprefilled_tokens`), plus
    /// requests its fresh snapshot shows queued beyond kvroute's own, at
    /// the mean request size.
    fn ahead_tokens(&self, c: &Candidate, running: f64, now_ms: u64) -> f64 {
        let foreign = c.snapshot.map_or(0.0, |s| {
            non_negative(s.waiting - f64::from(c.inflight.waiting))
        });
        self.ttft
            .unprefilled_tokens(&c.endpoint, c.inflight, running, now_ms)
            + foreign * self.ttft.mean_uncached_tokens()
    }
}

/// The most of the prompt (in blocks, a partial block included) any
/// healthy candidate holds.
fn longest_live_match(candidates: &[Candidate]) -> f64 {
    candidates
        .iter()
        .filter(|c| c.healthy)
        .fold(0.0, |m, c| max_num(m, c.matched()))
}

/// Mean gaps between two requests at an endpoint of the fleet after which
/// an endpoint that has had none, and shows none at its engine, is taken
/// to draw fewer than the fleet's ([`arrivals_at`]). An endpoint drawing
/// the fleet's rate goes this long without a request about once in 20.
const QUIET_GAPS: f64 = 3.0;

/// Requests expected per ms at `mover`, the endpoint a move would send a
/// request to, while the prefill the move repeats runs there ([`charged`]).
/// The fleet's rate per endpoint (`fleet`, Little's law), unless nothing
/// is there (no request of kvroute's, none at its engine) and kvroute has
/// sent it nothing for longer than [`QUIET_GAPS`] of the fleet's mean gaps
/// between two requests at one endpoint: then the rate that silence
/// implies, `QUIET_GAPS / age`, and none at all where kvroute has never
/// sent a request. Prefix affinity keeps sending each endpoint its own
/// conversations, so an endpoint that gets none has no one there for a
/// repeated prefill to delay: agentic's 24 agents, each staying with the
/// pod of its first request, left a pod of 4 without a request on about
/// half of its runs, and 3 of 8 at 8 pods, because a move to it was
/// charged as if the fleet's arrivals went there too. A pod that joins the
/// pool likewise gets a hot prefix as soon as its holders queue.
fn arrivals_at(mover: &Candidate, fleet: f64, now_ms: u64) -> f64 {
    let engine = mover.snapshot.map_or(0.0, |s| s.running + s.waiting);
    if fleet.is_nan() || fleet <= 0.0 || mover.inflight.requests > 0 || engine > 0.0 {
        return fleet;
    }
    match mover.last_picked_ms {
        None => 0.0,
        Some(at) => min_num(fleet, QUIET_GAPS / now_ms.saturating_sub(at) as f64),
    }
}

/// What moving a request off `holder` to `mover` costs, by the TTFT model:
/// the mover's cost, plus a charge for the prefill the move repeats (the
/// mover's ms per token x the tokens it prefills beyond the holder's; the
/// holder would not prefill them at all). The charge is what that prefill
/// costs the requests that arrive at the mover while it runs (the ones
/// already there are in the mover's cost, `others_delay_ms`), so it is
/// weighed by how many are expected: `arrivals_per_ms` (at the mover,
/// [`arrivals_at`]) x the prefill's time, at most 1. A long document
/// prefilled again is charged in full, as is any repeat on a saturated
/// fleet; a short shared prompt on a quiet fleet is charged little, so a
/// hot prefix can gain a holder on an idle pod before its first holder
/// queues long (agentic on three trace seeds: a pod idle for the whole run
/// on two charged in full, on one weighed; bench/README.md, 6 Dec 2026).
fn charged(holder: &Prediction, mover: &Prediction, arrivals_per_ms: f64) -> f64 {
    let repeat_ms =
        mover.ms_per_token * non_negative(mover.uncached_tokens - holder.uncached_tokens);
    mover.cost_ms + repeat_ms * min_num(arrivals_per_ms * repeat_ms, 1.0)
}

/// The rule both cost checks share: a request leaves the holder of its
/// prefix only when the move is cheaper even after its charge
/// ([`charged`]), by more than the holder's prediction can be trusted to
/// tell apart ([`noise_ms`]). `leave_costlier_holder` moves a prefix pick
/// by it; `keep_cheaper_holder` keeps the holder a load pick left unless
/// it holds, so the two checks cannot disagree on a pair.
fn move_pays(holder: &Prediction, mover: &Prediction, arrivals_per_ms: f64) -> bool {
    charged(holder, mover, arrivals_per_ms) + noise_ms(holder) < holder.cost_ms
}

/// Share of a predicted cost within which two predictions are a tie
/// ([`noise_ms`]).
const PREDICTION_NOISE: f64 = 0.05;

/// How far apart two predictions must be to tell them apart: the holder's
/// fixed part (one step), or [`PREDICTION_NOISE`] of its cost if more. The
/// model's error grows with what it predicts (observed / predicted TTFT
/// spans tens of percent, bench/README.md): a question on a 60 000-token
/// document predicted 6 047 ms at a holder that has just started
/// prefilling it and 6 027 ms on a pod with nothing to do is a tie, and
/// moving it prefills the document a second time. One step alone let such
/// a move through whenever the charge was small.
fn noise_ms(holder: &Prediction) -> f64 {
    max_num(holder.overhead_ms, PREDICTION_NOISE * holder.cost_ms)
}

#[cfg(test)]
mod tests {
    use super::super::tests::{ep, idle_states, router, two_models};
    use super::*;
    use crate::config::{Config, Profile};
    use crate::inflight::InFlight;
    use crate::metrics::MetricsSnapshot;
    use crate::outlier::OutlierTable;
    use crate::shared::endpoint_state::EndpointStates;
    use hashbrown::HashMap;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn ttft_router(n: u8) -> Router {
        let mut c = Config {
            endpoints: (1..=n).map(ep).collect(),
            ..Config::default()
        };
        c.scheduling.profile = Profile::PredictedTtft;
        c.scheduling.seed = Some(1);
        Router::new(c)
    }

    /// `requests` in flight, all waiting for their first byte, with
    /// `tokens` of prefill between them.
    fn waiting(requests: u32, tokens: u64) -> InFlight {
        InFlight {
            requests,
            tokens,
            waiting: requests,
            progress_ms: 0,
        }
    }

    /// `tokens` of prefill in flight, as one waiting request (none for 0).
    fn work(tokens: u64) -> InFlight {
        waiting(u32::from(tokens > 0), tokens)
    }

    /// The decision for `doc` (600 blocks, 38 400 tokens) with `holder` in
    /// flight on endpoint 1 and nothing elsewhere.
    fn decide_doc(
        r: &Router,
        doc: &[u64],
        states: &EndpointStates,
        holder: InFlight,
        rng: &mut fastrand::Rng,
    ) -> Decision {
        let load = |e: &Endpoint| {
            if *e == ep(1) {
                holder
            } else {
                InFlight::default()
            }
        };
        r.decide(doc, 38_400, states, &OutlierTable::default(), load, 1, rng)
            .unwrap()
    }

    /// Every endpoint of `r` was sent a request at 0: each serves traffic
    /// of its own, so a move to it is charged by the fleet's arrivals
    /// ([`arrivals_at`]; one never sent a request is charged nothing).
    fn in_rotation(r: &mut Router) {
        for e in r.pool().to_vec() {
            r.learn(e, &[] as &[u64], 0);
        }
    }

    /// Two `weighted` endpoints: endpoint 1, whose engine queues 6 and runs
    /// 4, holds 590 of the 600 blocks of a document (38 400 tokens); the
    /// other is idle.
    fn busy_holder_of_a_doc() -> (Router, EndpointStates, Vec<u64>) {
        let mut r = router(2);
        in_rotation(&mut r);
        let mut states = idle_states(&r, 0);
        let busy = MetricsSnapshot {
            waiting: 6.0,
            running: 4.0,
            ..MetricsSnapshot::default()
        };
        states.succeed(ep(1), busy, 0);
        let doc: Vec<u64> = (1..=600).collect();
        r.learn(ep(1), &doc[..590], 0);
        (r, states, doc)
    }

    #[test]
    fn weighted_keeps_a_long_prefix_on_a_busy_holder_until_leaving_it_pays() {
        let (mut r, states, doc) = busy_holder_of_a_doc();
        let mut rng = fastrand::Rng::with_seed(1);
        // Twelve of kvroute's requests wait there with `ahead` tokens of
        // prefill between them.
        let decide = |r: &Router, ahead: u64, rng: &mut fastrand::Rng| {
            decide_doc(r, &doc, &states, waiting(12, ahead), rng)
        };
        // Without the checks the load scores leave the holder for the idle
        // pod: the whole document would be prefilled again.
        r.config.scheduling.keep_cheaper_holder = false;
        r.config.scheduling.leave_costlier_holder = false;
        let d = decide(&r, 10_000, &mut rng);
        assert_eq!((d.endpoint, d.reason), (ep(2), Reason::Load));
        assert_eq!((d.prediction, d.overruled), (None, None));
        // With it (the default), priced by the TTFT model, 10 640 tokens
        // behind the queue there cost less than 38 400 on the idle pod: the
        // holder keeps it.
        r.config.scheduling.keep_cheaper_holder = true;
        let d = decide(&r, 10_000, &mut rng);
        assert_eq!((d.endpoint, d.reason), (ep(1), Reason::Prefix));
        assert_eq!(d.matched_blocks, 590);
        let p = d.prediction.unwrap();
        assert_eq!((p.ahead_tokens, p.uncached_tokens), (10_000.0, 640.0));
        // The pick it replaced stays a fallback, and the decision says so.
        assert_eq!(Router::fallbacks(&d, 1), vec![ep(2)]);
        let o = d.overruled.unwrap();
        assert_eq!((o.check, o.endpoint), (CostCheck::KeptHolder, ep(2)));
        assert!(o.cost_ms > p.cost_ms, "{o:?} vs {p:?}");
        // A queue worth a little more than the whole prefill: leaving would
        // save a little of this request's wait, but prefill again the
        // 37 760 tokens the holder has. The move does not pay once charged
        // for them (the rule `leave_costlier_holder` applies): kept.
        let d = decide(&r, 40_000, &mut rng);
        assert_eq!((d.endpoint, d.reason), (ep(1), Reason::Prefix));
        let (p, o) = (d.prediction.unwrap(), d.overruled.unwrap());
        assert!(o.cost_ms < p.cost_ms, "uncharged, the pick was cheaper");
        // A queue worth more than the prefill and its charge: the idle pod,
        // by load.
        let d = decide(&r, 100_000, &mut rng);
        assert_eq!((d.endpoint, d.reason), (ep(2), Reason::Load));
        assert_eq!(d.prediction.unwrap().uncached_tokens, 38_400.0);
        assert_eq!(d.overruled, None);
    }

    #[test]
    fn a_queue_drained_for_most_of_its_prefill_keeps_the_holder() {
        // The busy holder above, 100 000 tokens of kvroute's waited on
        // there: counted in full, leaving for the idle pod pays (the test
        // above). The same queue first waited on 9 s ago is mostly
        // prefilled (at the priors' 0.1 ms a token, about 90 000 tokens):
        // what is left costs less than the document again elsewhere. (A
        // first byte of 10 s, as the priors expect for 100 000 tokens, was
        // seen: no queue is credited for longer than those seen lately.)
        let (mut r, _, doc) = busy_holder_of_a_doc();
        r.ttft.observe(ep(2), 100_000, 0.0, 10_020);
        let decide = |waited_ms: u64| {
            let now = 50_000;
            let mut states = idle_states(&r, now);
            let busy = MetricsSnapshot {
                waiting: 6.0,
                running: 4.0,
                ..MetricsSnapshot::default()
            };
            states.succeed(ep(1), busy, now);
            let queue = InFlight {
                progress_ms: now - waited_ms,
                ..waiting(12, 100_000)
            };
            let load = |e: &Endpoint| {
                if *e == ep(1) {
                    queue
                } else {
                    InFlight::default()
                }
            };
            let mut rng = fastrand::Rng::with_seed(1);
            r.decide(
                &doc,
                38_400,
                &states,
                &OutlierTable::default(),
                load,
                now,
                &mut rng,
            )
            .unwrap()
        };
        let d = decide(0);
        assert_eq!((d.endpoint, d.reason), (ep(2), Reason::Load), "{d:?}");
        let d = decide(9_000);
        assert_eq!((d.endpoint, d.reason), (ep(1), Reason::Prefix), "{d:?}");
        let ahead = d.prediction.unwrap().ahead_tokens;
        assert!((9_000.0..12_000.0).contains(&ahead), "{ahead}");
        // Silent for twice the longest first byte seen: a frozen engine
        // whose scrapes still answer. Nothing is credited, and it moves.
        let d = decide(25_000);
        assert_eq!((d.endpoint, d.reason), (ep(2), Reason::Load), "{d:?}");
    }

    #[test]
    fn a_document_queued_behind_its_own_prefill_teaches_no_slot_limit() {
        // Endpoint 1 prefills a document of 600 blocks (38 400 tokens) for
        // its first question, 7 more queued behind it: scrape after scrape
        // it runs 1 and queues 7, all of them kvroute's requests and none
        // with its first byte yet (vLLM, kvroute-sim: the document holds
        // the step's token budget). Endpoint 2 is idle. Requests have held
        // an engine 4 s.
        let ahead = waiting(8, 38_400 + 7 * 64);
        let holder_load = move |e: &Endpoint| {
            if *e == ep(1) {
                ahead
            } else {
                InFlight::default()
            }
        };
        let queued = MetricsSnapshot {
            waiting: 7.0,
            running: 1.0,
            ..MetricsSnapshot::default()
        };
        let doc: Vec<u64> = (1..=600).collect();
        let mut question = doc.clone();
        question.push(601);
        // Observed with kvroute's requests as they were, and as if they
        // had all had their first byte (the test's control).
        for (observed, stays) in [(holder_load(&ep(1)), true), (InFlight::default(), false)] {
            let mut r = router(2);
            in_rotation(&mut r);
            let mut states = idle_states(&r, 0);
            for t in 1..=8 {
                states.succeed(ep(1), queued, t);
                states.succeed(ep(2), MetricsSnapshot::default(), t);
                r.observe(&states, |e| {
                    if *e == ep(1) {
                        observed
                    } else {
                        InFlight::default()
                    }
                });
            }
            for _ in 0..8 {
                r.streamed_in_full(None, 300, 4_000);
            }
            r.learn(ep(1), &doc, 0);
            let d = r
                .decide(
                    &question,
                    601 * 64,
                    &states,
                    &OutlierTable::default(),
                    holder_load,
                    10,
                    &mut fastrand::Rng::with_seed(1),
                )
                .unwrap();
            // Taken for a limit of 1, the next question would wait for 8
            // whole requests (32 s) and prefill the document again.
            assert_eq!(d.endpoint == ep(1), stays, "{observed:?}: {d:?}");
            if stays {
                assert_eq!(d.prediction.unwrap().slot_wait_ms, 0.0, "{d:?}");
            }
        }
    }

    #[test]
    fn weighted_leaves_a_holder_whose_slots_are_taken_for_a_free_one() {
        // Two engines of 2 slots (llama.cpp `-np 2`); endpoint 1 holds a
        // conversation of 40 blocks (2 560 tokens) and runs 2 requests with
        // 1 queued, scrape after scrape; endpoint 2 is idle.
        let mut r = router(2);
        let mut rng = fastrand::Rng::with_seed(1);
        let full = MetricsSnapshot {
            waiting: 1.0,
            running: 2.0,
            ..MetricsSnapshot::default()
        };
        let mut states = idle_states(&r, 0);
        for t in 1..=crate::slots::MIN_QUEUED as u64 {
            states.succeed(ep(1), full, t);
            states.succeed(ep(2), MetricsSnapshot::default(), t);
            r.observe(&states, |_| InFlight::default());
        }
        states.succeed(
            ep(2),
            MetricsSnapshot {
                running: 2.0,
                ..full
            },
            4,
        );
        states.succeed(ep(2), MetricsSnapshot::default(), 5);
        r.observe(&states, |_| InFlight::default());
        // Its requests hold a slot 4 s (streamed answers seen so far).
        for _ in 0..8 {
            r.streamed_in_full(None, 300, 4_000);
        }
        let conversation: Vec<u64> = (1..=40).collect();
        r.learn(ep(1), &conversation, 0);
        // Four of kvroute's requests there (two answering, two waiting
        // with 100 tokens to prefill between them: cache hits).
        let load = |e: &Endpoint| {
            if *e == ep(1) {
                InFlight {
                    requests: 4,
                    tokens: 100,
                    waiting: 2,
                    progress_ms: 0,
                }
            } else {
                InFlight::default()
            }
        };
        let decide = |r: &Router, rng: &mut fastrand::Rng| {
            r.decide(
                &conversation,
                2_560,
                &states,
                &OutlierTable::default(),
                load,
                10,
                rng,
            )
            .unwrap()
        };
        // By its prefill queue alone the holder is cheap: it keeps it.
        r.config.scheduling.slot_wait = false;
        let d = decide(&r, &mut rng);
        assert_eq!((d.endpoint, d.reason), (ep(1), Reason::Prefix));
        assert_eq!(d.prediction.unwrap().slot_wait_ms, 0.0);
        // Its slots are taken: the request would wait for 3 of the 4 to
        // finish, 2 at a time (6 s), more than prefilling 2 560 tokens on
        // the free engine, charged twice. It moves, and says so.
        r.config.scheduling.slot_wait = true;
        let d = decide(&r, &mut rng);
        assert_eq!((d.endpoint, d.reason), (ep(2), Reason::Load));
        let o = d.overruled.unwrap();
        assert_eq!((o.check, o.endpoint), (CostCheck::LeftHolder, ep(1)));
        assert!(o.cost_ms > 5_000.0, "{o:?}");
        assert_eq!(d.prediction.unwrap().slot_wait_ms, 0.0);
        // The free engine has no limit learnt (it queued at 2 running in
        // one scrape, fewer than `MIN_QUEUED`): no wait there however
        // loaded, so a limit is only ever one an engine showed repeatedly.
        assert_eq!(r.slots.limit(&ep(2)), None);
        assert_eq!(r.slots.limit(&ep(1)), Some(2));
    }

    #[test]
    fn a_configured_or_reported_slot_limit_prices_a_burst_before_scrapes_show_it() {
        // A gateway just started in front of engines of 2 slots: their
        // scrapes (taken before the burst) show them idle, and kvroute has
        // sent 4 requests of a conversation to its holder, endpoint 1
        // (two answering, two waiting with 100 tokens between them). The
        // limit is unknown, configured (`scheduling.engine_slots`), or
        // reported by the engines (llama.cpp's `/props`, in the scrape
        // states).
        let conversation: Vec<u64> = (1..=40).collect();
        let load = |e: &Endpoint| {
            let busy = InFlight {
                requests: 4,
                tokens: 100,
                waiting: 2,
                progress_ms: 0,
            };
            if *e == ep(1) {
                busy
            } else {
                InFlight::default()
            }
        };
        let mut rng = fastrand::Rng::with_seed(1);
        for (engine_slots, reported) in [(None, None), (Some(2), None), (None, Some(2))] {
            let mut c = Config {
                endpoints: vec![ep(1), ep(2)],
                ..Config::default()
            };
            c.scheduling.seed = Some(1);
            c.scheduling.engine_slots = engine_slots;
            let mut r = Router::new(c);
            r.learn(ep(1), &conversation, 0);
            let mut states = idle_states(&r, 0);
            for e in [ep(1), ep(2)] {
                if let Some(n) = reported {
                    states.engine_slots_read(e, n);
                }
            }
            r.observe(&states, |_| InFlight::default());
            let outliers = OutlierTable::default();
            let d = r
                .decide(&conversation, 2_560, &states, &outliers, load, 10, &mut rng)
                .unwrap();
            let wait = d.prediction.map(|p| p.slot_wait_ms);
            match engine_slots.or(reported) {
                // Nothing learnt yet: the holder's queue of cache hits
                // looks cheap, and it keeps the request.
                None => {
                    assert_eq!((d.endpoint, d.reason), (ep(1), Reason::Prefix));
                    assert_eq!(wait, Some(0.0));
                }
                // The request is the fifth on 2 slots: it waits for 3 to
                // finish, 2 at a time, at the 1 s prior each (1.5 s),
                // more than prefilling 2 560 tokens on the idle engine,
                // charged twice. It moves.
                Some(_) => {
                    assert_eq!((d.endpoint, d.reason), (ep(2), Reason::Load));
                    let o = d.overruled.unwrap();
                    assert_eq!((o.check, o.endpoint), (CostCheck::LeftHolder, ep(1)));
                    assert!(o.cost_ms > 1_400.0, "{o:?}");
                    assert_eq!(wait, Some(0.0));
                }
            }
        }
    }

    #[test]
    fn a_cold_pick_leaves_an_engine_whose_slots_are_all_taken() {
        // Engines of 2 slots. Endpoint 1 runs two of kvroute's requests,
        // both past their first token (answering: no prefill waiting);
        // endpoint 2 one that is still prefilling 150 tokens. The rotation
        // takes the least prefill waiting, endpoint 1, where a new prompt
        // would wait for one of the two answers to end.
        let load = |e: &Endpoint| {
            if *e == ep(1) {
                InFlight {
                    requests: 2,
                    ..InFlight::default()
                }
            } else {
                InFlight {
                    requests: 1,
                    tokens: 150,
                    waiting: 1,
                    progress_ms: 0,
                }
            }
        };
        let prompt = [7_001, 7_002, 7_003];
        let mut rng = fastrand::Rng::with_seed(1);
        for engine_slots in [None, Some(2)] {
            let mut c = Config {
                endpoints: vec![ep(1), ep(2)],
                ..Config::default()
            };
            c.scheduling.seed = Some(1);
            c.scheduling.engine_slots = engine_slots;
            let r = Router::new(c);
            let states = idle_states(&r, 0);
            let outliers = OutlierTable::default();
            let d = r
                .decide(&prompt, 200, &states, &outliers, load, 10, &mut rng)
                .unwrap();
            assert_eq!(d.reason, Reason::Cold);
            match engine_slots {
                // No limit known: nothing to wait for, the rotation stands.
                None => assert_eq!((d.endpoint, d.overruled), (ep(1), None)),
                // A wait for an answer (1 s prior) against 150 tokens of
                // prefill ahead: it moves, and says so.
                Some(_) => {
                    assert_eq!(d.endpoint, ep(2));
                    let o = d.overruled.unwrap();
                    assert_eq!((o.check, o.endpoint), (CostCheck::LeftTakenSlots, ep(1)));
                    assert!(o.cost_ms > 400.0, "{o:?}");
                    assert_eq!(d.prediction.unwrap().slot_wait_ms, 0.0);
                }
            }
        }
    }

    #[test]
    fn weighted_leaves_small_savings_to_the_load_scores() {
        let (mut r, states, doc) = busy_holder_of_a_doc();
        let mut rng = fastrand::Rng::with_seed(1);
        // The idle pod holds two thirds of it: moving there prefills 190
        // more blocks (32 % of the prompt), not the whole document.
        r.learn(ep(2), &doc[..400], 0);
        let decide = |r: &Router, rng: &mut fastrand::Rng| {
            decide_doc(r, &doc, &states, waiting(12, 2_000), rng)
        };
        // Below the default share (half the prompt) the check stays out
        // although the model prices the holder cheaper: the load scores
        // decide.
        let d = decide(&r, &mut rng);
        assert_eq!(
            (d.endpoint, d.reason, d.overruled),
            (ep(2), Reason::Load, None)
        );
        assert_eq!(d.prediction.unwrap().uncached_tokens, 12_800.0);
        // With a share of 10 % the saving counts: the holder is kept.
        r.config.scheduling.keep_cheaper_holder_min_saved = 0.1;
        let d = decide(&r, &mut rng);
        assert_eq!((d.endpoint, d.reason), (ep(1), Reason::Prefix));
        let o = d.overruled.unwrap();
        assert_eq!((o.check, o.endpoint), (CostCheck::KeptHolder, ep(2)));
        assert!(d.prediction.unwrap().cost_ms < o.cost_ms);
    }

    #[test]
    fn a_repeated_prefill_is_charged_by_the_arrivals_expected_while_it_runs() {
        let at = |uncached_tokens: f64, cost_ms: f64| Prediction {
            uncached_tokens,
            ms_per_token: 0.1,
            cost_ms,
            ..Prediction::default()
        };
        let holder = at(100.0, 500.0);
        // A tool prompt of 2 000 tokens prefilled again: 200 ms.
        let tool = at(2_100.0, 300.0);
        assert_eq!(charged(&holder, &tool, 0.0), 300.0, "nobody comes");
        assert_eq!(
            charged(&holder, &tool, 1.0 / 400.0),
            400.0,
            "half a request"
        );
        assert_eq!(charged(&holder, &tool, 1.0 / 100.0), 500.0, "two: in full");
        assert_eq!(charged(&holder, &tool, f64::NAN), 500.0, "unknown: in full");
        // A 60 000-token document at the same rate: 6 s, in full.
        let doc = at(60_100.0, 6_300.0);
        assert_eq!(charged(&holder, &doc, 1.0 / 400.0), 12_300.0);
        // Nothing repeated, nothing charged.
        assert_eq!(charged(&doc, &holder, 1.0), 500.0);
    }

    #[test]
    fn a_quiet_fleet_gives_a_hot_prompt_a_holder_but_keeps_a_document_on_its_own() {
        // Three `weighted` endpoints whose requests hold an engine 10 s
        // each (long answers): with 20 requests in flight, about one
        // arrives per 1.5 s at each endpoint.
        let mut r = router(3);
        in_rotation(&mut r);
        for _ in 0..64 {
            r.streamed_in_full(None, 0, 10_000);
        }
        assert!(r.slots.held_ms() > 9_000.0, "{}", r.slots.held_ms());
        let states = idle_states(&r, 0);
        let mut rng = fastrand::Rng::with_seed(1);
        let on_holder = |requests: u32, tokens: u64| {
            move |e: &Endpoint| {
                if *e == ep(1) {
                    waiting(requests, tokens)
                } else {
                    InFlight::default()
                }
            }
        };
        // A tool prompt (31 blocks) on endpoint 1, 20 requests waiting there
        // for 64 tokens each. Prefilling the prompt elsewhere takes 200 ms,
        // in which 0.13 requests arrive: the move pays (charged in full, it
        // took 33 waiting).
        let tool: Vec<u64> = (1..=31).collect();
        r.learn(ep(1), &tool, 0);
        let request = [tool.as_slice(), &[1_000]].concat();
        let load = on_holder(20, 20 * 64);
        let d = r
            .decide(
                &request,
                2_048,
                &states,
                &OutlierTable::default(),
                load,
                1,
                &mut rng,
            )
            .unwrap();
        assert_eq!(d.reason, Reason::Load, "{d:?}");
        assert_eq!(d.overruled.map(|o| o.check), Some(CostCheck::LeftHolder));
        // A document of 38 400 tokens on endpoint 1, still being prefilled
        // for the first of 5 questions waiting there: a near tie with
        // prefilling it again elsewhere (3.8 s, in which 0.64 requests
        // arrive). Uncharged, the move would pay; charged, it stays.
        let doc: Vec<u64> = (10_001..=10_600).collect();
        r.learn(ep(1), &doc, 0);
        let d = decide_doc(&r, &doc, &states, waiting(5, 38_400 + 4 * 64), &mut rng);
        assert_eq!(
            (d.endpoint, d.reason, d.overruled),
            (ep(1), Reason::Prefix, None),
            "{d:?}"
        );
        let p = d.prediction.unwrap();
        let mut idle = crate::scheduler::test_support::cand(0);
        idle.endpoint = ep(2);
        let other = r.prediction(&idle, 38_400, 1);
        assert!(
            charged(&p, &other, 0.0) + p.overhead_ms < p.cost_ms,
            "uncharged it would move: {p:?} vs {other:?}"
        );
    }

    #[test]
    fn weighted_gives_a_hot_prefix_a_second_holder_once_the_first_costs_more() {
        // A tool prompt of 31 blocks, and each request's own last block
        // (2 048 tokens): endpoint 1 got the first request and holds it.
        let mut r = router(3);
        let mut rng = fastrand::Rng::with_seed(1);
        let states = idle_states(&r, 0);
        let tool: Vec<u64> = (1..=31).collect();
        r.learn(ep(1), &tool, 0);
        let request = |i: u64| [tool.as_slice(), &[1_000 + i]].concat();
        let decide =
            |r: &Router, i: u64, load: &dyn Fn(&Endpoint) -> InFlight, rng: &mut fastrand::Rng| {
                let d = r.decide(
                    &request(i),
                    2_048,
                    &states,
                    &OutlierTable::default(),
                    load,
                    1,
                    rng,
                );
                d.unwrap()
            };
        // `n` requests wait on the holder, 64 uncached tokens each.
        let on_holder = |n: u32| {
            move |e: &Endpoint| {
                if *e == ep(1) {
                    waiting(n, 64 * u64::from(n))
                } else {
                    InFlight::default()
                }
            }
        };
        // A few: the holder is cheaper than prefilling 2 048 tokens again.
        let d = decide(&r, 0, &on_holder(4), &mut rng);
        assert_eq!(
            (d.endpoint, d.reason, d.overruled),
            (ep(1), Reason::Prefix, None)
        );
        // Forty: the scores still pick the holder (its prefix outweighs
        // every load score at its cap), and without the check it piles up.
        r.config.scheduling.leave_costlier_holder = false;
        let d = decide(&r, 1, &on_holder(40), &mut rng);
        assert_eq!((d.endpoint, d.reason), (ep(1), Reason::Prefix));
        // With it (the default), the holder's queue costs more than the
        // other endpoint's prefill, charged twice: the prefix moves.
        r.config.scheduling.leave_costlier_holder = true;
        let d = decide(&r, 2, &on_holder(40), &mut rng);
        assert_eq!(d.reason, Reason::Load);
        assert_ne!(d.endpoint, ep(1));
        let o = d.overruled.unwrap();
        assert_eq!((o.check, o.endpoint), (CostCheck::LeftHolder, ep(1)));
        let p = d.prediction.unwrap();
        assert_eq!(p.uncached_tokens, 2_048.0);
        assert!(
            p.cost_ms + p.ms_per_token * 1_984.0 < o.cost_ms,
            "{p:?} vs {o:?}"
        );
        // The prefix now has two holders: the next requests balance over
        // them, by the scores, and the third endpoint stays out.
        let second = d.endpoint;
        r.learn(second, &request(2), 2);
        let both = |n1: u32, n2: u32| {
            move |e: &Endpoint| match e {
                e if *e == ep(1) => waiting(n1, 64 * u64::from(n1)),
                e if *e == second => waiting(n2, 64 * u64::from(n2)),
                _ => InFlight::default(),
            }
        };
        let d = decide(&r, 3, &both(40, 1), &mut rng);
        assert_eq!(
            (d.endpoint, d.reason, d.overruled),
            (second, Reason::Prefix, None)
        );
        let d = decide(&r, 4, &both(8, 16), &mut rng);
        assert_eq!(
            (d.endpoint, d.reason, d.overruled),
            (ep(1), Reason::Prefix, None)
        );
    }

    #[test]
    fn a_hot_prefix_gains_a_holder_uncharged_on_an_endpoint_sent_nothing() {
        // Agentic's first burst: a tool prompt (31 blocks) on endpoint 1,
        // 20 of the agents' first requests waiting there for 64 tokens
        // each; endpoint 2 serves its own traffic. Prefilling the prompt
        // again elsewhere is charged in full (20 requests present, held 1 s
        // each: 0.13 arrive per 20 ms at an endpoint of the fleet), and
        // the agents, which stay where their first request goes, would
        // leave endpoint 3 without a request for the whole run.
        let tool: Vec<u64> = (1..=31).collect();
        let request = [tool.as_slice(), &[1_000]].concat();
        let on_holder = |e: &Endpoint| {
            if *e == ep(1) {
                waiting(20, 20 * 64)
            } else {
                InFlight::default()
            }
        };
        let decide = |r: &Router| {
            let states = idle_states(r, 0);
            let mut rng = fastrand::Rng::with_seed(1);
            r.decide(
                &request,
                2_048,
                &states,
                &OutlierTable::default(),
                on_holder,
                1,
                &mut rng,
            )
            .unwrap()
        };
        let mut r = router(3);
        r.learn(ep(1), &tool, 0);
        r.learn(ep(2), &[] as &[u64], 0);
        // Endpoint 3 has been sent nothing: no one there for the repeated
        // prefill to delay, and the move pays on the first token alone.
        let d = decide(&r);
        assert_eq!((d.endpoint, d.reason), (ep(3), Reason::Load), "{d:?}");
        let o = d.overruled.unwrap();
        assert_eq!((o.check, o.endpoint), (CostCheck::LeftHolder, ep(1)));
        // Once it has been sent a request it is charged like endpoint 2,
        // and the agents' next requests stay with the holder.
        r.learn(ep(3), &[] as &[u64], 0);
        let d = decide(&r);
        assert_eq!(
            (d.endpoint, d.reason, d.overruled),
            (ep(1), Reason::Prefix, None),
            "{d:?}"
        );
    }

    #[test]
    fn a_near_tie_of_two_long_prefills_stays_on_the_holder_even_uncharged() {
        // Long-qa's first burst: endpoint 1 has just been sent a document
        // of 38 400 tokens for its first question, and the next question
        // comes before kvroute has sent endpoint 2 anything, so a move
        // there is charged nothing (`arrivals_at`). The document ahead on
        // the holder costs about as much as prefilling it again there
        // (3 988 vs 3 860 ms): within the margin of noise (5 %, 199 ms),
        // not the holder's step (20 ms). Moving would prefill it twice.
        let mut r = router(2);
        let mut rng = fastrand::Rng::with_seed(1);
        let states = idle_states(&r, 0);
        let doc: Vec<u64> = (1..=600).collect();
        r.learn(ep(1), &doc[..590], 0);
        let d = decide_doc(&r, &doc, &states, work(38_400), &mut rng);
        assert_eq!((d.endpoint, d.overruled), (ep(1), None), "{d:?}");
        let p = d.prediction.unwrap();
        assert!(p.cost_ms - p.overhead_ms > 3_880.0, "{p:?}");
    }

    #[test]
    fn arrivals_at_an_endpoint_fall_with_the_time_it_has_been_sent_nothing() {
        use crate::scheduler::test_support::cand;
        // The fleet: one request per 100 ms at each endpoint.
        let fleet = 0.01;
        let mut c = cand(0);
        assert_eq!(arrivals_at(&c, fleet, 10_000), 0.0, "never sent one");
        c.last_picked_ms = Some(9_800);
        assert_eq!(arrivals_at(&c, fleet, 10_000), fleet, "2 gaps: the fleet's");
        c.last_picked_ms = Some(4_000);
        assert_eq!(arrivals_at(&c, fleet, 10_000), 0.0005, "60 gaps: 3 in 6 s");
        c.last_picked_ms = Some(10_005);
        assert_eq!(arrivals_at(&c, fleet, 10_000), fleet, "a clock behind");
        // Anything there, kvroute's or another client's: the fleet's.
        c.last_picked_ms = None;
        c.inflight = waiting(1, 64);
        assert_eq!(arrivals_at(&c, fleet, 10_000), fleet);
        c.inflight = InFlight::default();
        c.snapshot.as_mut().unwrap().running = 1.0;
        assert_eq!(arrivals_at(&c, fleet, 10_000), fleet);
        // A fleet with nothing in flight, or unknown, is left as it is.
        c.snapshot = None;
        assert_eq!(arrivals_at(&c, 0.0, 10_000), 0.0);
        assert!(arrivals_at(&c, f64::NAN, 10_000).is_nan());
    }

    #[test]
    fn leave_costlier_holder_leaves_adapter_requests_to_the_scores() {
        // The model does not price loading an adapter on the other pod.
        let mut r = two_models();
        let mut rng = fastrand::Rng::with_seed(1);
        let states = idle_states(&r, 0);
        let tool: Vec<u64> = (1..=31).collect();
        r.learn(ep(1), &tool, 0);
        let request = [tool.as_slice(), &[1_000]].concat();
        let piled = |e: &Endpoint| {
            if *e == ep(1) {
                waiting(40, 64 * 40)
            } else {
                InFlight::default()
            }
        };
        let none = OutlierTable::default();
        let mut decide = |model: &str| {
            let scope = r.scope(Some(model)).unwrap();
            r.decide_in(
                scope,
                &request[..],
                2_048,
                &states,
                &none,
                piled,
                1,
                &mut rng,
            )
            .unwrap()
        };
        let base = decide("a");
        assert_eq!((base.endpoint, base.reason), (ep(2), Reason::Load));
        assert_eq!(base.overruled.map(|o| o.check), Some(CostCheck::LeftHolder));
        let lora = decide("a-lora");
        assert_eq!(
            (lora.endpoint, lora.reason, lora.overruled),
            (ep(1), Reason::Prefix, None)
        );
    }

    #[test]
    fn ttft_keeps_a_long_prefix_on_a_busy_holder_until_its_queue_costs_more() {
        let mut r = ttft_router(2);
        in_rotation(&mut r);
        let mut rng = fastrand::Rng::with_seed(1);
        let states = idle_states(&r, 0);
        let doc: Vec<u64> = (1..=600).collect(); // 38 400 tokens
        r.learn(ep(1), &doc[..590], 0);
        let decide = |r: &Router, ahead: u64, rng: &mut fastrand::Rng| {
            decide_doc(r, &doc, &states, work(ahead), rng)
        };
        // 640 uncached tokens there vs 38 400 on the idle pod: a busy holder
        // (10k tokens queued) still wins, and says why.
        let d = decide(&r, 10_000, &mut rng);
        assert_eq!((d.endpoint, d.reason), (ep(1), Reason::Prefix));
        let p = d.prediction.unwrap();
        assert_eq!((p.ahead_tokens, p.uncached_tokens), (10_000.0, 640.0));
        assert_eq!(d.predictions.len(), 2);
        // A queue worth a little more than prefilling the whole document
        // elsewhere: the move would repeat the 37 760 tokens the holder
        // has, and does not pay once charged for them (the rule of the
        // cost checks): kept.
        let d = decide(&r, 40_000, &mut rng);
        assert_eq!((d.endpoint, d.reason), (ep(1), Reason::Prefix));
        let other = d.predictions[1];
        assert!(
            other.cost_ms < d.predictions[0].cost_ms,
            "uncharged, it moved"
        );
        // Worth more than the prefill and its charge: the request goes
        // elsewhere (affinity broken by cost).
        let d = decide(&r, 100_000, &mut rng);
        assert_eq!((d.endpoint, d.reason), (ep(2), Reason::Load));
        // Unless requests decode on the idle pod: its prefill there would
        // delay each of them by as much (the holder's are not delayed: its
        // part is short).
        let d = r
            .decide(
                &doc,
                38_400,
                &states,
                &OutlierTable::default(),
                |e| {
                    let mut f = work(if *e == ep(1) { 100_000 } else { 0 });
                    f.requests += 4;
                    f
                },
                1,
                &mut rng,
            )
            .unwrap();
        assert_eq!((d.endpoint, d.reason), (ep(1), Reason::Prefix));
        let other = d.predictions[1];
        assert!(other.others_delay_ms > other.ttft_ms, "{other:?}");
    }

    #[test]
    fn ttft_keeps_a_document_on_a_holder_that_has_just_started_prefilling_it() {
        // Endpoint 1 holds 590 of the document's 600 blocks by the index,
        // and its engine has just been sent them: 38 400 tokens of
        // kvroute's are ahead there, as many as the whole document on the
        // idle pod. Uncharged, the idle pod's first token came 640 tokens
        // sooner and a question took the document there: a second 38 400
        // token prefill, with every question behind it.
        let mut r = ttft_router(2);
        in_rotation(&mut r);
        let mut rng = fastrand::Rng::with_seed(1);
        let states = idle_states(&r, 0);
        let doc: Vec<u64> = (1..=600).collect();
        r.learn(ep(1), &doc[..590], 0);
        let d = decide_doc(&r, &doc, &states, work(38_400), &mut rng);
        assert_eq!((d.endpoint, d.reason), (ep(1), Reason::Prefix), "{d:?}");
        let (holder, other) = (d.predictions[0], d.predictions[1]);
        assert!(other.cost_ms < holder.cost_ms, "{d:?}");
        assert_eq!(holder.move_charge_ms, 0.0);
        // Charged in full: the repeated prefill, plus the holder's margin
        // of noise (5 % of its 4 s, more than its step).
        let repeat = (38_400.0 - 640.0) * other.ms_per_token;
        let charge = repeat + noise_ms(&holder);
        assert!(noise_ms(&holder) > holder.overhead_ms);
        assert!((other.move_charge_ms - charge).abs() < 1e-6, "{other:?}");
        // With twice the document ahead there and then some (beyond the
        // margin of noise), the move pays after all.
        let d = decide_doc(&r, &doc, &states, work(2 * 38_400 + 3_000), &mut rng);
        assert_eq!((d.endpoint, d.reason), (ep(2), Reason::Load), "{d:?}");
    }

    #[test]
    fn ttft_charges_a_prefill_to_the_requests_waiting_there_too() {
        // A pod busy prefilling: its requests wait, none decodes yet. They
        // will decode while this request's prefill runs, so moving a prompt
        // there delays them all; counting only decoding requests made such a
        // pod look free and a saturated fleet re-prefilled prompts on it.
        let mut r = ttft_router(2);
        let mut rng = fastrand::Rng::with_seed(5);
        let states = idle_states(&r, 0);
        let prompt: Vec<u64> = (1..=64).collect(); // 4096 tokens
        r.learn(ep(1), &prompt[..62], 0);
        let decide = |r: &Router, other: InFlight, rng: &mut fastrand::Rng| {
            r.decide(
                &prompt,
                4_096,
                &states,
                &OutlierTable::default(),
                |e| {
                    if *e == ep(1) {
                        waiting(3, 12_000)
                    } else {
                        other
                    }
                },
                1,
                rng,
            )
            .unwrap()
        };
        // The holder has 12k tokens queued, the other pod 2k from four
        // requests: the first token would come sooner there (2000 + 4096
        // tokens vs 12 000 + 128), but 4096 tokens of prefill delay its four.
        let d = decide(&r, waiting(4, 2_000), &mut rng);
        assert_eq!((d.endpoint, d.reason), (ep(1), Reason::Prefix));
        let other = d.predictions[1];
        assert_eq!(other.present, 4.0);
        assert!(other.others_delay_ms > 1_000.0, "{other:?}");
        // An idle pod still takes it: nothing there to delay.
        let d = decide(&r, InFlight::default(), &mut rng);
        assert_eq!((d.endpoint, d.reason), (ep(2), Reason::Load));
    }

    #[test]
    fn ttft_gives_a_hot_prefix_more_holders_then_balances_them() {
        let mut r = ttft_router(4);
        let mut rng = fastrand::Rng::with_seed(2);
        let states = idle_states(&r, 0);
        let system: Vec<u64> = (1..=64).collect(); // a 4096-token shared prompt
        let mut load: HashMap<Endpoint, u64> = HashMap::new();
        let mut holders: Vec<Endpoint> = Vec::new();
        let mut per_holder: HashMap<Endpoint, usize> = HashMap::new();
        // 40 requests of a hot group arrive faster than they are served:
        // every routed request stays in flight (its uncached tokens ahead).
        for i in 0..40u64 {
            let mut blocks = system.clone();
            blocks.push(10_000 + i);
            let d = r
                .decide(
                    &blocks,
                    4_160,
                    &states,
                    &OutlierTable::default(),
                    |e| work(load.get(e).copied().unwrap_or(0)),
                    i,
                    &mut rng,
                )
                .unwrap();
            let uncached = r.uncached_tokens(&d, 4_160);
            *load.entry(d.endpoint).or_default() += uncached;
            r.learn(d.endpoint, &blocks, i);
            if !holders.contains(&d.endpoint) {
                holders.push(d.endpoint);
            }
            *per_holder.entry(d.endpoint).or_default() += 1;
        }
        // The first holder's queue grew past the cost of prefilling the
        // prompt elsewhere: the prefix gained holders, and the load spread.
        assert!(holders.len() >= 2, "{holders:?}");
        let max = per_holder.values().max().unwrap();
        assert!(*max <= 40 * 3 / 4, "{per_holder:?}");
        // Most requests still hit a holder (only the first per holder missed).
        assert!(load.values().sum::<u64>() < 40 * 4_160 / 4, "{load:?}");
    }

    #[test]
    fn ttft_spreads_a_no_reuse_stream_like_least_loaded() {
        let r = ttft_router(4);
        let mut rng = fastrand::Rng::with_seed(3);
        let states = idle_states(&r, 0);
        let mut load: HashMap<Endpoint, u64> = HashMap::new();
        for i in 0..40u64 {
            let blocks: Vec<u64> = (0..16).map(|b| i * 1_000 + b).collect();
            let least = r
                .pool()
                .iter()
                .map(|e| load.get(e).copied().unwrap_or(0))
                .min()
                .unwrap();
            let d = r
                .decide(
                    &blocks,
                    1_024,
                    &states,
                    &OutlierTable::default(),
                    |e| work(load.get(e).copied().unwrap_or(0)),
                    i,
                    &mut rng,
                )
                .unwrap();
            assert_eq!(d.reason, Reason::Cold);
            assert_eq!(
                load.get(&d.endpoint).copied().unwrap_or(0),
                least,
                "request {i}"
            );
            *load.entry(d.endpoint).or_default() += 1_024;
        }
        assert!(load.values().all(|&t| t == 10 * 1_024), "{load:?}");
    }

    #[test]
    fn a_first_byte_after_a_predicted_slot_wait_teaches_the_rest() {
        // The same 4 000-token prefill, answered in 420 ms, once at once and
        // once after a predicted 4 s wait for a slot: the model learns the
        // same rates from both (the wait is whole requests finishing, which
        // its rates do not describe).
        let (mut plain, mut waited) = (ttft_router(1), ttft_router(1));
        let p = Prediction {
            uncached_tokens: 4_000.0,
            ..Prediction::default()
        };
        let slot = Prediction {
            slot_wait_ms: 4_000.0,
            ..p
        };
        for _ in 0..20 {
            plain.first_byte(ep(1), &p, 420);
            waited.first_byte(ep(1), &slot, 4_420);
        }
        assert_eq!(plain.ttft.rates(&ep(1)), waited.ttft.rates(&ep(1)));
        assert!((plain.ttft.rates(&ep(1)).ms_per_token - 0.1).abs() < 0.03);
    }

    #[test]
    fn ttft_learns_a_slow_endpoint_and_sends_it_less() {
        let mut r = ttft_router(2);
        let mut rng = fastrand::Rng::with_seed(4);
        let states = idle_states(&r, 0);
        // Endpoint 1 answers ten times slower per token.
        let routed = Prediction {
            uncached_tokens: 4_000.0,
            ..Prediction::default()
        };
        for _ in 0..20 {
            r.first_byte(ep(1), &routed, 20 + 4_000);
            r.first_byte(ep(2), &routed, 20 + 400);
        }
        // A request with equal work ahead everywhere goes to the fast one,
        // and keeps going there until its queue is over ten times longer
        // (the slow one's prefill also delays its waiting request ten times
        // as much).
        let decide = |ahead1: u64, ahead2: u64, rng: &mut fastrand::Rng| {
            r.decide(
                &[1, 2, 3],
                192,
                &states,
                &OutlierTable::default(),
                |e| work(if *e == ep(1) { ahead1 } else { ahead2 }),
                1,
                rng,
            )
            .unwrap()
            .endpoint
        };
        assert_eq!(decide(1_000, 1_000, &mut rng), ep(2));
        assert_eq!(decide(1_000, 8_000, &mut rng), ep(2));
        assert_eq!(decide(1_000, 12_000, &mut rng), ep(2));
        assert_eq!(decide(1_000, 16_000, &mut rng), ep(1));
    }

    /// Two `weighted` endpoints whose answers stream at `ms_per_kib` each
    /// (8 KiB answers, five of each learnt).
    fn mixed_fleet(ms_per_kib: [u64; 2]) -> Router {
        let mut r = router(2);
        r.config.scheduling.decode_speed = true;
        for _ in 0..5 {
            r.streamed(ep(1), 8192, 8 * ms_per_kib[0]);
            r.streamed(ep(2), 8192, 8 * ms_per_kib[1]);
        }
        r
    }

    /// Where eight new prompts go, one after another on an idle fleet (each
    /// learnt, so the rotation alternates), and how often a cost check
    /// moved one off the rotation's pick.
    fn cold_picks(r: &mut Router) -> (Vec<Endpoint>, usize) {
        let mut rng = fastrand::Rng::with_seed(1);
        let states = idle_states(r, 0);
        let mut moved = 0;
        let picks = (0..8u64)
            .map(|i| {
                let prompt = [1_000 * (i + 1), 1_000 * (i + 1) + 1];
                let d = r
                    .decide(
                        &prompt,
                        128,
                        &states,
                        &OutlierTable::default(),
                        |_| InFlight::default(),
                        i,
                        &mut rng,
                    )
                    .unwrap();
                assert_eq!(d.reason, Reason::Cold);
                if let Some(o) = d.overruled {
                    assert_eq!(o.check, CostCheck::LeftSlowerDecoder);
                    assert_eq!(d.prediction.unwrap().slow_decode_ms, 0.0);
                    assert!(o.cost_ms > 1000.0, "{o:?}");
                    moved += 1;
                }
                r.learn(d.endpoint, &prompt, i);
                d.endpoint
            })
            .collect();
        (picks, moved)
    }

    #[test]
    fn decode_speed_moves_new_prompts_off_an_endpoint_streaming_slower() {
        // Endpoint 2 streams four times slower: a mean answer (8 KiB) takes
        // 8 x (200 - 50) = 1200 ms longer there. Every cold pick goes to
        // endpoint 1; half of them are moved off the rotation's.
        let (picks, moved) = cold_picks(&mut mixed_fleet([50, 200]));
        assert_eq!(picks, vec![ep(1); 8]);
        assert!(moved >= 3, "{moved}");
        // Off (the default): the rotation alternates.
        let mut r = mixed_fleet([50, 200]);
        r.config.scheduling.decode_speed = false;
        let (picks, moved) = cold_picks(&mut r);
        assert_eq!(picks.iter().filter(|e| **e == ep(2)).count(), 4);
        assert_eq!(moved, 0);
    }

    #[test]
    fn decode_speed_changes_nothing_on_a_fleet_of_like_endpoints() {
        // 1.4x apart: load and noise, not hardware.
        let (picks, moved) = cold_picks(&mut mixed_fleet([50, 70]));
        assert_eq!(picks.iter().filter(|e| **e == ep(2)).count(), 4);
        assert_eq!(moved, 0);
    }

    #[test]
    fn decode_speed_moves_a_conversation_off_a_slower_holder_until_the_fast_one_is_busier() {
        let mut r = mixed_fleet([50, 200]);
        let mut rng = fastrand::Rng::with_seed(1);
        let states = idle_states(&r, 0);
        // The slow endpoint holds a 20-block conversation (1280 tokens).
        let conversation: Vec<u64> = (1..=20).collect();
        r.learn(ep(2), &conversation[..19], 0);
        let decide = |queue: u64, rng: &mut fastrand::Rng| {
            let load = |e: &Endpoint| {
                if *e == ep(1) {
                    work(queue)
                } else {
                    InFlight::default()
                }
            };
            r.decide(
                &conversation,
                1280,
                &states,
                &OutlierTable::default(),
                load,
                1,
                rng,
            )
            .unwrap()
        };
        // Idle elsewhere: prefilling it again costs less than 1200 ms of
        // slower streaming.
        let d = decide(0, &mut rng);
        assert_eq!((d.endpoint, d.reason), (ep(1), Reason::Load));
        let o = d.overruled.unwrap();
        assert_eq!((o.check, o.endpoint), (CostCheck::LeftHolder, ep(2)));
        // Behind a long queue on the fast endpoint the slow one keeps it.
        let d = decide(100_000, &mut rng);
        assert_eq!(
            (d.endpoint, d.reason, d.overruled),
            (ep(2), Reason::Prefix, None)
        );
        assert!(d.prediction.unwrap().slow_decode_ms > 1000.0);
    }
}
