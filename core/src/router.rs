//! The per-VM router: the pool, the prefix index and the scheduler in one
//! place, so the Envoy shell makes a decision with one call and learns from
//! it with another. Pure: the shell passes in the shared state it read
//! (scrape states, in-flight counts), the clock and the RNG.
//!
//! Picking has no side effects; [`Router::learn`] is the explicit step after
//! the pick that teaches the prefix index (and is replayed on other workers
//! from the shared decision log).

use crate::config::{Config, Profile};
use crate::decode_speed::DecodeSpeed;
use crate::endpoint::Endpoint;
use crate::float::{max_num, non_negative};
use crate::inflight::InFlight;
use crate::metrics::{schedule, MetricsSnapshot};
use crate::models::{ModelNotFound, ModelPools, Scope};
use crate::objectives::Objective;
use crate::outlier::OutlierTable;
use crate::prefix::{PrefixIndex, PrefixMatch, Prompt};
use crate::scheduler::{
    Candidate, CostCheck, Decision, Overruled, Reason, RequestFacts, Scheduler,
};
use crate::shared::endpoint_state::{EndpointStates, ScrapeState};
use crate::stall::{self, StallCheck};
use crate::ttft::{Prediction, TtftModel};
use hashbrown::HashMap;

/// Pool, prefix index and scheduler of one VM.
#[derive(Debug)]
pub struct Router {
    config: Config,
    scheduler: Scheduler,
    index: PrefixIndex,
    pool: Vec<Endpoint>,
    /// When each pool member (same index as `pool`) was last picked: a
    /// decision reads every one, and a hash lookup per candidate was a
    /// fifth of the decision time at 1024 endpoints.
    last_picked: Vec<Option<u64>>,
    capacity: HashMap<Endpoint, usize>,
    ttft: TtftModel,
    decode: DecodeSpeed,
    models: ModelPools,
}

impl Router {
    /// A router over `config.endpoints`.
    pub fn new(config: Config) -> Router {
        let mut router = Router {
            scheduler: Scheduler::new(&config.scheduling),
            index: PrefixIndex::new(config.prefix.capacity_blocks),
            pool: Vec::new(),
            last_picked: Vec::new(),
            capacity: HashMap::new(),
            ttft: TtftModel::new(&config.scheduling.ttft),
            decode: DecodeSpeed::new(config.scheduling.ttft.learning_rate),
            models: ModelPools::new(&config.models),
            config,
        };
        router.set_pool(router.config.endpoints.clone());
        router
    }

    /// The validated configuration.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The `models` table (empty without a `models` section).
    pub fn models(&self) -> &ModelPools {
        &self.models
    }

    /// Where a request for `model` may go (`None`: its model could not be
    /// read); [`ModelNotFound`] when `models` is set and serves no such model.
    pub fn scope(&self, model: Option<&str>) -> Result<Scope, ModelNotFound> {
        self.models.scope(model)
    }

    /// Whether a request of `objective` and `scope` is shed (429) at
    /// `now_ms`: its priority is negative and every endpoint that could
    /// serve it is saturated. Checks saturation only for sheddable requests.
    pub fn shed(
        &self,
        objective: Objective,
        scope: Scope,
        states: &EndpointStates,
        outliers: &OutlierTable,
        now_ms: u64,
    ) -> bool {
        objective.sheddable() && self.saturated(scope, states, outliers, now_ms)
    }

    /// Whether every endpoint that could serve a request of `scope` is
    /// saturated at `now_ms` (`saturation.rs`): out of the candidate set
    /// (failed scrapes, passive-health ejection), its load unknown or over
    /// a threshold.
    pub fn saturated(
        &self,
        scope: Scope,
        states: &EndpointStates,
        outliers: &OutlierTable,
        now_ms: u64,
    ) -> bool {
        let threshold = self.config.metrics.unhealthy_after_failures;
        let saturation = &self.config.saturation;
        let stale_after = saturation.stale_after(self.config.metrics.scrape_interval_ms);
        let unknown = ScrapeState::default();
        let serves = self.models.serves_in_order(scope);
        let outlier = outliers.lookup();
        !self
            .pool
            .iter()
            .zip(states.aligned(&self.pool))
            .map(|(e, s)| (e, s.unwrap_or(&unknown)))
            .filter(|(e, s)| serves(e, s))
            .any(|(e, s)| {
                let healthy = s.healthy(threshold) && !outlier(e).ejected(now_ms);
                !saturation.saturated(s, healthy, now_ms, stale_after)
            })
    }

    /// Current pool members.
    pub fn pool(&self) -> &[Endpoint] {
        &self.pool
    }

    /// Whether `endpoint` is a pool member.
    pub fn contains(&self, endpoint: Endpoint) -> bool {
        self.pool.binary_search(&endpoint).is_ok()
    }

    /// Replaces the pool (live discovery); forgets removed endpoints.
    pub fn set_pool(&mut self, mut pool: Vec<Endpoint>) {
        pool.sort();
        pool.dedup();
        if pool == self.pool {
            return;
        }
        self.index.retain(&pool);
        self.last_picked = pool
            .iter()
            .map(|e| {
                self.pool
                    .binary_search(e)
                    .ok()
                    .and_then(|i| self.last_picked[i])
            })
            .collect();
        self.capacity.retain(|e, _| pool.binary_search(e).is_ok());
        self.ttft.retain(&pool);
        self.decode.retain(&pool);
        self.pool = pool;
    }

    /// Follows the KV-cache capacity endpoints report (`block_size x
    /// num_gpu_blocks`) when `prefix.follow_engine_capacity` is on.
    pub fn observe(&mut self, states: &EndpointStates) {
        if !self.config.prefix.follow_engine_capacity {
            return;
        }
        for (endpoint, state) in &states.entries {
            let Some(tokens) = state.snapshot.and_then(|s| s.kv_capacity_tokens) else {
                continue;
            };
            let blocks = (tokens as usize / self.config.prefix.block_tokens).max(1);
            // The pool is sorted: a linear `contains` made every tick
            // quadratic in the pool.
            if self.pool.binary_search(endpoint).is_ok()
                && self.capacity.get(endpoint) != Some(&blocks)
            {
                self.capacity.insert(*endpoint, blocks);
                self.index.set_capacity(*endpoint, blocks);
            }
        }
    }

    /// Pool endpoints stalled at `now_ms` (see [`crate::stall`]).
    pub fn stalled(
        &self,
        states: &EndpointStates,
        inflight: impl Fn(&Endpoint) -> InFlight,
        now_ms: u64,
    ) -> Vec<Endpoint> {
        let stall_after = self.config.failover.stall_after_ms;
        stall::stalled(
            &self.pool,
            states,
            inflight,
            now_ms,
            stall_after,
            schedule::silence_after_ms(stall_after, &self.config.metrics, self.pool.len()),
        )
    }

    /// Picks an endpoint for a request whose prompt hashed into `blocks`
    /// (empty when the body was not understood; with its checkpoints, from
    /// `InferenceRequest::prompt`, leaves match too). An endpoint is healthy when
    /// its scrapes answer, passive health has not ejected it and it is not
    /// stalled. `None` only for an empty pool. Every endpoint serves the
    /// request: [`Router::decide_in`] with [`Scope::All`].
    #[allow(clippy::too_many_arguments)]
    pub fn decide<'a>(
        &self,
        blocks: impl Into<Prompt<'a>>,
        prompt_tokens: u64,
        states: &EndpointStates,
        outliers: &OutlierTable,
        inflight: impl Fn(&Endpoint) -> InFlight,
        now_ms: u64,
        rng: &mut fastrand::Rng,
    ) -> Option<Decision> {
        self.decide_in(
            Scope::All,
            blocks,
            prompt_tokens,
            states,
            outliers,
            inflight,
            now_ms,
            rng,
        )
    }

    /// [`Router::decide`] among the endpoints serving `scope` only (the
    /// request's model): the others are not candidates at all, not even
    /// as the health filter's fallback or as retry fallbacks.
    #[allow(clippy::too_many_arguments)]
    pub fn decide_in<'a>(
        &self,
        scope: Scope,
        blocks: impl Into<Prompt<'a>>,
        prompt_tokens: u64,
        states: &EndpointStates,
        outliers: &OutlierTable,
        inflight: impl Fn(&Endpoint) -> InFlight,
        now_ms: u64,
        rng: &mut fastrand::Rng,
    ) -> Option<Decision> {
        let prompt = blocks.into();
        let blocks = prompt.blocks;
        let matches = self.index.longest_prefix_with_leaves(prompt);
        let metrics = &self.config.metrics;
        // A large pool is scraped less often: staleness follows its period.
        let stale_after = schedule::stale_after_ms(metrics, self.pool.len());
        let stall_after = self.config.failover.stall_after_ms;
        let stall = StallCheck::new(
            self.pool.len(),
            now_ms,
            stall_after,
            schedule::silence_after_ms(stall_after, metrics, self.pool.len()),
        );
        // Stall detection in the same walk (`stall.rs`): candidates that
        // are suspects, and whether any pool endpoint is alive otherwise.
        let mut suspects: Vec<usize> = Vec::new();
        let mut others_alive = false;
        let adapter = match scope {
            Scope::Model { adapter, .. } => adapter,
            Scope::All => None,
        };
        // One merge pass over the sorted pool and the sorted scrape states,
        // the matches placed by their index in the pool: no lookup, no clone
        // of a state, and mostly equality tests (an ordering of two socket
        // addresses costs more).
        let mut by_index: Vec<(usize, &PrefixMatch)> = matches
            .iter()
            .filter_map(|m| Some((self.pool.binary_search(&m.endpoint).ok()?, m)))
            .collect();
        by_index.sort_unstable_by_key(|(i, _)| *i);
        let mut matched = by_index.into_iter().peekable();
        let entries = &states.entries;
        let mut next_entry = 0;
        let unknown = ScrapeState::default();
        let serves = self.models.serves_in_order(scope);
        let everyone = scope == Scope::All;
        let outlier = outliers.lookup();
        let mut candidates: Vec<Candidate> = Vec::with_capacity(self.pool.len());
        // The pool's endpoints are compared where they lie, by reference: a
        // copy on the stack read back in parts stalled store forwarding
        // (33.0 -> 28.5 us for a decision over 1024 endpoints).
        for (i, (endpoint, &last_picked_ms)) in self.pool.iter().zip(&self.last_picked).enumerate()
        {
            let state = loop {
                match entries.get(next_entry) {
                    Some((x, s)) if x == endpoint => {
                        next_entry += 1;
                        break s;
                    }
                    Some((x, _)) if x < endpoint => next_entry += 1,
                    _ => break &unknown,
                }
            };
            let m = matched.next_if(|(k, _)| *k == i).map(|(_, m)| m);
            let load = inflight(endpoint);
            let suspect = stall.is_some_and(|s| s.suspect(&load, state.answered_at_ms));
            others_alive |= stall.is_some_and(|s| !suspect && !s.silent(state.answered_at_ms));
            if !everyone && !serves(endpoint, state) {
                continue;
            }
            if suspect {
                suspects.push(candidates.len());
            }
            candidates.push(Candidate {
                endpoint: *endpoint,
                snapshot: state.fresh(now_ms, stale_after),
                adapter_fit: state.adapter_fit(adapter, now_ms, stale_after),
                healthy: state.healthy(metrics.unhealthy_after_failures)
                    && !outlier(endpoint).ejected(now_ms),
                matched_blocks: m.map_or(0, |m| m.blocks),
                partial_block: m.map_or(0.0, |m| m.partial()),
                inflight: load,
                last_picked_ms,
            });
        }
        if others_alive {
            for i in suspects {
                candidates[i].healthy = false;
            }
        }
        let facts = RequestFacts {
            total_blocks: blocks.len(),
            prompt_tokens,
            // Replicas must agree on requests none of them knows yet; a lone
            // gateway rotates them instead (a hash spreads a few new
            // conversations less evenly than a rotation does).
            affinity_key: self.config.peers.as_ref().and(blocks.first().copied()),
            adapter,
        };
        if self.config.scheduling.profile == Profile::PredictedTtft {
            let predictions = self.predict(&candidates, prompt_tokens);
            return self
                .scheduler
                .pick_predicted(&facts, &candidates, &predictions, rng);
        }
        let mut decision = self.scheduler.pick(&facts, &candidates, rng)?;
        self.check_by_cost(&mut decision, &candidates, &facts);
        Some(decision)
    }

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
    ///   (`scheduling.decode_speed`): the same, keeping its reason.
    ///
    /// All leave a pick only by one rule ([`move_pays`]).
    ///
    /// Either way the chosen endpoint's prediction is recorded; the model
    /// learns from it (`Decision::prediction`).
    fn check_by_cost(&self, decision: &mut Decision, candidates: &[Candidate], req: &RequestFacts) {
        let scheduling = &self.config.scheduling;
        if !(scheduling.keep_cheaper_holder
            || scheduling.leave_costlier_holder
            || scheduling.decode_speed)
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
        let prediction = self.prediction(chosen, req.prompt_tokens);
        let better = match decision.reason {
            Reason::Load if scheduling.keep_cheaper_holder => {
                self.keep_cheaper_holder(chosen, &prediction, candidates, req.prompt_tokens)
            }
            // An adapter request stays where the scores put it: the model
            // does not price loading an adapter.
            Reason::Prefix if scheduling.leave_costlier_holder && req.adapter.is_none() => {
                let rivals = decision.scores.iter().filter_map(|&(e, _)| at(e));
                self.cheaper_rival(chosen, &prediction, rivals, req.prompt_tokens)
                    .map(|(c, p)| (CostCheck::LeftHolder, c, p))
            }
            _ => None,
        }
        .or_else(|| {
            // A cold pick is the rotation's and a load pick the load
            // scores': both count requests, not capacity. On a mixed fleet
            // one on an endpoint that streams slower is priced.
            let slower = matches!(decision.reason, Reason::Cold | Reason::Load)
                && prediction.slow_decode_ms > 0.0
                && req.adapter.is_none();
            let rivals = decision.scores.iter().filter_map(|&(e, _)| at(e));
            slower
                .then(|| self.cheaper_rival(chosen, &prediction, rivals, req.prompt_tokens))
                .flatten()
                .map(|(c, p)| (CostCheck::LeftSlowerDecoder, c, p))
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
                CostCheck::LeftSlowerDecoder => decision.reason,
            };
            decision.matched_blocks = c.matched_blocks;
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
    /// than one step); a holder whose queue costs more than that still
    /// loses. (Uncharged, a near tie went to the re-prefill: a holder
    /// still prefilling the very document a question needs counts that
    /// document's in-flight tokens as ahead in full, as much as the pick's
    /// own prefill of it.) Smaller differences stay with the load scores and
    /// [`Router::cheaper_rival`]: vetoing every move of a
    /// conversation whose shared prompt is cached everywhere kept hot
    /// groups on one pod (bench/README.md).
    fn keep_cheaper_holder<'c>(
        &self,
        chosen: &Candidate,
        prediction: &Prediction,
        candidates: &'c [Candidate],
        prompt_tokens: u64,
    ) -> Option<(CostCheck, &'c Candidate, Prediction)> {
        let longest = candidates
            .iter()
            .filter(|c| c.healthy)
            .fold(0.0, |m, c| max_num(m, c.matched()));
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
            .map(|c| (c, self.prediction(c, prompt_tokens)))
            .min_by(|a, b| a.1.cost_ms.total_cmp(&b.1.cost_ms))
            .filter(|(_, holder)| !move_pays(holder, prediction))
            .map(|(c, p)| (CostCheck::KeptHolder, c, p))
    }

    /// `scheduling.leave_costlier_holder`: the pick holds the longest
    /// prefix, but its decode load or queue may cost more than prefilling
    /// the prompt elsewhere (agentic: 24 agents' first requests share a
    /// tool prompt within 3 ms and 23 piled onto its first holder, whose
    /// prefix score outweighs every load score at its cap, leaving a pod
    /// idle for the whole run). A rival among the best scored others (at
    /// most [`crate::scheduler::SCORES_KEPT`], all past the filters) wins
    /// if its cost, charged once more for the prefill it repeats
    /// (`ms_per_token` x the tokens it would prefill beyond the holder's),
    /// is still below the holder's by more than the holder's fixed part
    /// (`overhead_ms`, one step: closer predictions are noise). The charge
    /// is what the move costs the fleet: the holder would not have
    /// prefilled those tokens at all. The prefix then gains a holder, and
    /// later requests balance over both.
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
    ) -> Option<(&'c Candidate, Prediction)> {
        rivals
            .filter(|c| c.healthy && c.endpoint != chosen.endpoint)
            .map(|c| {
                let p = self.prediction(c, prompt_tokens);
                (charged(prediction, &p), c, p)
            })
            .min_by(|a, b| a.0.total_cmp(&b.0))
            .filter(|(_, _, p)| move_pays(prediction, p))
            .map(|(_, c, p)| (c, p))
    }

    /// Up to `n` other scored candidates, best first: where Envoy's retries
    /// go when the chosen endpoint refuses (override_host handoff).
    pub fn fallbacks(decision: &Decision, n: usize) -> Vec<Endpoint> {
        let mut others: Vec<(Endpoint, f64)> = decision
            .scores
            .iter()
            .copied()
            .filter(|(e, _)| *e != decision.endpoint)
            .collect();
        others.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        others.into_iter().take(n).map(|(e, _)| e).collect()
    }

    /// Each candidate's predicted TTFT (`ttft.rs`), in candidate order.
    fn predict(&self, candidates: &[Candidate], prompt_tokens: u64) -> Vec<Prediction> {
        candidates
            .iter()
            .map(|c| self.prediction(c, prompt_tokens))
            .collect()
    }

    /// One candidate's predicted TTFT (`ttft.rs`).
    fn prediction(&self, c: &Candidate, prompt_tokens: u64) -> Prediction {
        let block_tokens = self.config.prefix.block_tokens as u64;
        // A leaf match (part of a block) counts for its part.
        let cached = c.matched() * block_tokens as f64;
        let uncached = non_negative(prompt_tokens as f64 - cached);
        let ahead = self.ahead_tokens(c.snapshot, c.inflight);
        // Decoding there: the engine's count, or kvroute's requests past
        // their first byte if more.
        let own = c.inflight.requests.saturating_sub(c.inflight.waiting);
        let running = max_num(c.snapshot.map_or(0.0, |s| s.running), f64::from(own));
        // Held there (decoding or waiting): the engine's count, or
        // kvroute's if more (sent since the scrape).
        let present = max_num(
            c.snapshot.map_or(0.0, |s| s.running + s.waiting),
            f64::from(c.inflight.requests),
        );
        let mut p = self
            .ttft
            .predict(&c.endpoint, ahead, uncached, running, present);
        // 0 unless the model is on and the endpoint streams slower.
        if self.config.scheduling.decode_speed {
            p.slow_decode_ms = self.decode.extra_ms(&c.endpoint);
        }
        p.cost_ms += p.slow_decode_ms;
        p
    }

    /// Prefill work ahead of a new request on an endpoint (`ttft.rs`):
    /// kvroute's in-flight uncached tokens there, plus requests its fresh
    /// snapshot shows queued beyond kvroute's own, at the mean request size.
    fn ahead_tokens(&self, snapshot: Option<MetricsSnapshot>, inflight: InFlight) -> f64 {
        let foreign = snapshot.map_or(0.0, |s| {
            non_negative(s.waiting - f64::from(inflight.waiting))
        });
        inflight.tokens as f64 + foreign * self.ttft.mean_uncached_tokens()
    }

    /// A request was routed with `uncached` tokens to prefill (the mean
    /// request size of the TTFT model).
    pub fn routed(&mut self, uncached: u64) {
        let scheduling = &self.config.scheduling;
        if scheduling.profile == Profile::PredictedTtft
            || scheduling.keep_cheaper_holder
            || scheduling.leave_costlier_holder
            || scheduling.decode_speed
        {
            self.ttft.routed(uncached);
        }
    }

    /// `endpoint` sent the first byte of a streaming response `ttft_ms`
    /// after routing; the request had `work_tokens` of prefill to wait for
    /// (the prediction's ahead + uncached) while `running` requests decoded
    /// there. Teaches the TTFT model.
    pub fn first_byte(&mut self, endpoint: Endpoint, work_tokens: u64, running: f64, ttft_ms: u64) {
        if self.contains(endpoint) {
            self.ttft.observe(endpoint, work_tokens, running, ttft_ms);
        }
    }

    /// `endpoint` streamed `bytes` of a 2xx answer after its first chunk,
    /// in `ms`. Teaches the decode-speed model (`scheduling.decode_speed`).
    pub fn streamed(&mut self, endpoint: Endpoint, bytes: u64, ms: u64) {
        if self.config.scheduling.decode_speed && self.contains(endpoint) {
            self.decode.observe(endpoint, bytes, ms);
        }
    }

    /// Prompt tokens the chosen endpoint is expected to prefill (not cached).
    pub fn uncached_tokens(&self, decision: &Decision, prompt_tokens: u64) -> u64 {
        let cached = (decision.matched_blocks * self.config.prefix.block_tokens) as u64;
        prompt_tokens.saturating_sub(cached)
    }

    /// Learns that `endpoint` was sent `blocks` (and the prompt's leaf, if
    /// given one from `InferenceRequest::prompt`; a decision-log entry's
    /// list already ends with it) at `now_ms`. Ignores endpoints outside
    /// the pool (a stale log entry after a pool change).
    pub fn learn<'a>(&mut self, endpoint: Endpoint, blocks: impl Into<Prompt<'a>>, now_ms: u64) {
        let Ok(i) = self.pool.binary_search(&endpoint) else {
            return;
        };
        let last = &mut self.last_picked[i];
        *last = Some(last.unwrap_or(0).max(now_ms));
        let prompt = blocks.into();
        if !prompt.blocks.is_empty() || prompt.leaf().is_some() {
            self.index
                .record_with_leaf(endpoint, prompt.blocks, prompt.leaf());
        }
    }

    /// Unlearns `hashes` (blocks, or a leaf) for `endpoint`: it refused the
    /// request that taught them (see `PrefixIndex::forget`).
    pub fn forget(&mut self, endpoint: Endpoint, hashes: &[u64]) {
        self.index.forget(endpoint, hashes);
    }

    /// Blocks the index holds for `endpoint`.
    pub fn indexed_blocks(&self, endpoint: Endpoint) -> usize {
        self.index.len(endpoint)
    }
}

/// What moving a request off `holder` to `mover` costs, by the TTFT model:
/// the mover's cost, charged once more for the prefill the move repeats
/// (its ms per token x the tokens it prefills beyond the holder's). The
/// holder would not prefill those tokens at all; the charge is what the
/// fleet loses by the move.
fn charged(holder: &Prediction, mover: &Prediction) -> f64 {
    mover.cost_ms
        + mover.ms_per_token * non_negative(mover.uncached_tokens - holder.uncached_tokens)
}

/// The rule both cost checks share: a request leaves the holder of its
/// prefix only when the move is cheaper even after its charge
/// ([`charged`]), by more than the holder's fixed part (`overhead_ms`, one
/// step: closer predictions are noise). `leave_costlier_holder` moves a
/// prefix pick by it; `keep_cheaper_holder` keeps the holder a load pick
/// left unless it holds, so the two checks cannot disagree on a pair.
fn move_pays(holder: &Prediction, mover: &Prediction) -> bool {
    charged(holder, mover) + holder.overhead_ms < holder.cost_ms
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::lora::AdapterFit;
    use crate::metrics::MetricsSnapshot;
    use crate::scheduler::Reason;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn ep(i: u8) -> Endpoint {
        format!("10.0.0.{i}:8000").parse().unwrap()
    }

    fn router(n: u8) -> Router {
        let mut c = Config {
            endpoints: (1..=n).map(ep).collect(),
            ..Config::default()
        };
        c.scheduling.seed = Some(1);
        Router::new(c)
    }

    fn idle_states(r: &Router, now: u64) -> EndpointStates {
        let mut s = EndpointStates::default();
        for e in r.pool() {
            s.succeed(*e, MetricsSnapshot::default(), now);
        }
        s
    }

    /// The candidates as `decide_in` built them before issue 14: a lookup
    /// per endpoint (a cloned state, a search of the matches, the time it
    /// was last picked from the learn calls the test made), the plain way.
    #[allow(clippy::too_many_arguments)]
    fn candidates_reference(
        r: &Router,
        blocks: &[u64],
        states: &EndpointStates,
        outliers: &OutlierTable,
        inflight: impl Fn(&Endpoint) -> InFlight,
        last_picked: &HashMap<Endpoint, u64>,
        now_ms: u64,
    ) -> Vec<Candidate> {
        let matches = r.index.longest_prefix_with_leaves(Prompt::from(blocks));
        let metrics = &r.config.metrics;
        let stale_after = schedule::stale_after_ms(metrics, r.pool.len());
        let stalled = r.stalled(states, &inflight, now_ms);
        r.pool
            .iter()
            .map(|&endpoint| {
                let state = states.get(endpoint);
                let matched = matches.iter().find(|m| m.endpoint == endpoint);
                Candidate {
                    endpoint,
                    snapshot: state.fresh(now_ms, stale_after),
                    healthy: state.healthy(metrics.unhealthy_after_failures)
                        && !outliers.ejected(endpoint, now_ms)
                        && !stalled.contains(&endpoint),
                    matched_blocks: matched.map_or(0, |m| m.blocks),
                    partial_block: matched.map_or(0.0, |m| m.partial()),
                    inflight: inflight(&endpoint),
                    last_picked_ms: last_picked.get(&endpoint).copied(),
                    // `decide` serves every model: no adapter.
                    adapter_fit: AdapterFit::Unknown,
                }
            })
            .collect()
    }

    #[test]
    fn decide_picks_what_the_plain_lookups_picked_on_random_pools() {
        let mut rng = fastrand::Rng::with_seed(1401);
        for round in 0..300 {
            let n = rng.usize(1..48);
            // Endpoints drawn from a wider range, so pools have gaps and
            // states may name endpoints outside the pool.
            let all: Vec<Endpoint> = (0..n).map(|_| ep(rng.u8(1..120))).collect();
            let mut c = Config {
                endpoints: all.clone(),
                ..Config::default()
            };
            c.scheduling.seed = Some(1);
            if rng.bool() {
                c.scheduling.profile = Profile::AffinityGate;
            }
            let mut r = Router::new(c);
            let now = 100_000;
            let mut last_picked = HashMap::new();
            let convs: Vec<Vec<u64>> = (0..6)
                .map(|_| (0..rng.usize(1..12)).map(|_| rng.u64(..)).collect())
                .collect();
            for _ in 0..rng.usize(0..20) {
                let e = ep(rng.u8(1..120));
                let conv = &convs[rng.usize(..convs.len())];
                let at = now - rng.u64(0..5000);
                let n = rng.usize(0..=conv.len());
                r.learn(e, &conv[..n], at);
                if r.contains(e) {
                    let last = last_picked.entry(e).or_insert(0);
                    *last = u64::max(*last, at);
                }
            }
            if rng.u8(0..4) == 0 {
                // A pool change keeps what the survivors were picked at.
                let keep: Vec<Endpoint> = r.pool().iter().copied().filter(|_| rng.bool()).collect();
                let mut next = keep.clone();
                next.push(ep(rng.u8(1..120)));
                r.set_pool(next);
                last_picked.retain(|e, _| r.contains(*e));
            }
            let mut states = EndpointStates::default();
            for _ in 0..rng.usize(0..60) {
                let e = ep(rng.u8(1..120));
                match rng.u8(0..5) {
                    0 => {
                        states.fail(e);
                    }
                    _ => states.succeed(
                        e,
                        MetricsSnapshot {
                            waiting: f64::from(rng.u8(0..5)),
                            running: f64::from(rng.u8(0..9)),
                            kv_usage: rng.bool().then(|| rng.f64()),
                            kv_capacity_tokens: None,
                        },
                        now - rng.u64(0..3000),
                    ),
                }
            }
            let loads: HashMap<Endpoint, InFlight> = r
                .pool()
                .iter()
                .map(|&e| {
                    let f = InFlight {
                        requests: rng.u32(0..6),
                        tokens: rng.u64(0..9000),
                        waiting: rng.u32(0..2),
                        progress_ms: now - rng.u64(0..40_000),
                    };
                    (e, f)
                })
                .collect();
            let inflight = |e: &Endpoint| loads.get(e).copied().unwrap_or_default();
            let conv = &convs[rng.usize(..convs.len())];
            let mut request = conv[..rng.usize(0..=conv.len())].to_vec();
            request.extend((0..rng.usize(0..4)).map(|_| rng.u64(..)));
            let outliers = OutlierTable::default();
            let seed = rng.u64(..);
            let got = r.decide(
                &request,
                request.len() as u64 * 64,
                &states,
                &outliers,
                inflight,
                now,
                &mut fastrand::Rng::with_seed(seed),
            );
            let candidates = candidates_reference(
                &r,
                &request,
                &states,
                &outliers,
                inflight,
                &last_picked,
                now,
            );
            let facts = RequestFacts {
                total_blocks: request.len(),
                prompt_tokens: request.len() as u64 * 64,
                affinity_key: None,
                adapter: None,
            };
            let mut want =
                r.scheduler
                    .pick(&facts, &candidates, &mut fastrand::Rng::with_seed(seed));
            if let Some(d) = &mut want {
                r.check_by_cost(d, &candidates, &facts);
            }
            assert_eq!(got, want, "round {round}");
        }
    }

    #[test]
    fn learns_then_prefers_the_endpoint_holding_the_prefix() {
        let mut r = router(4);
        let mut rng = fastrand::Rng::with_seed(3);
        let blocks: Vec<u64> = (1..=20).collect();
        let states = idle_states(&r, 1_000);
        let first = r
            .decide(
                &blocks,
                1280,
                &states,
                &OutlierTable::default(),
                |_| InFlight::default(),
                1_000,
                &mut rng,
            )
            .unwrap();
        assert_eq!(first.matched_blocks, 0);
        r.learn(first.endpoint, &blocks, 1_000);
        let mut longer = blocks.clone();
        longer.extend(100..110);
        let second = r
            .decide(
                &longer,
                1920,
                &states,
                &OutlierTable::default(),
                |_| InFlight::default(),
                1_001,
                &mut rng,
            )
            .unwrap();
        assert_eq!(second.endpoint, first.endpoint);
        assert_eq!(second.matched_blocks, 20);
        assert_eq!(second.reason, Reason::Prefix);
        assert_eq!(r.uncached_tokens(&second, 1920), 1920 - 20 * 64);
    }

    #[test]
    fn an_ejected_endpoint_loses_even_its_sticky_traffic_until_it_returns() {
        use crate::outlier::Outcome;
        let mut r = router(3);
        let mut rng = fastrand::Rng::with_seed(5);
        let blocks: Vec<u64> = (1..=20).collect();
        let states = idle_states(&r, 0);
        let none = OutlierTable::default();
        let d = |r: &Router, o: &OutlierTable, now, rng: &mut fastrand::Rng| {
            r.decide(&blocks, 1280, &states, o, |_| InFlight::default(), now, rng)
                .unwrap()
        };
        let sticky = d(&r, &none, 0, &mut rng).endpoint;
        r.learn(sticky, &blocks, 0);
        assert_eq!(d(&r, &none, 1, &mut rng).endpoint, sticky);
        let mut outliers = OutlierTable::default();
        let c = &r.config().outlier_detection;
        let until = (0..c.consecutive_errors)
            .filter_map(|_| outliers.record(sticky, Outcome::Failure, 10, 3, c))
            .last()
            .expect("ejected");
        for now in [10, until - 1] {
            let other = d(&r, &outliers, now, &mut rng);
            assert_ne!(other.endpoint, sticky);
            assert_eq!(
                other.reason,
                Reason::Cold,
                "no healthy holder of the prefix"
            );
        }
        assert_eq!(d(&r, &outliers, until, &mut rng).endpoint, sticky);
    }

    #[test]
    fn a_stalled_endpoint_loses_its_sticky_traffic_until_it_answers() {
        let mut r = router(3);
        let mut rng = fastrand::Rng::with_seed(5);
        let blocks: Vec<u64> = (1..=20).collect();
        let none = OutlierTable::default();
        let mut states = idle_states(&r, 0);
        let sticky = r
            .decide(
                &blocks,
                1280,
                &states,
                &none,
                |_| InFlight::default(),
                0,
                &mut rng,
            )
            .unwrap()
            .endpoint;
        r.learn(sticky, &blocks, 0);
        // At 1000 ms: one request has waited on `sticky` since 400 ms, its
        // scrapes stopped answering at 0; the others answered at 990.
        for e in r.pool().to_vec() {
            if e != sticky {
                states.succeed(e, MetricsSnapshot::default(), 990);
            }
        }
        let waiting = move |e: &Endpoint| {
            if *e == sticky {
                InFlight {
                    requests: 1,
                    tokens: 0,
                    waiting: 1,
                    progress_ms: 400,
                }
            } else {
                InFlight::default()
            }
        };
        assert_eq!(r.stalled(&states, waiting, 1_000), vec![sticky]);
        let d = r
            .decide(&blocks, 1280, &states, &none, waiting, 1_000, &mut rng)
            .unwrap();
        assert_ne!(d.endpoint, sticky, "stalled endpoint chosen");
        // Not yet stalled at 899 ms (waited 499 ms): affinity holds.
        let d = r
            .decide(&blocks, 1280, &states, &none, waiting, 899, &mut rng)
            .unwrap();
        assert_eq!(d.endpoint, sticky);
        // It answers a scrape: a candidate again.
        states.succeed(sticky, MetricsSnapshot::default(), 1_000);
        let d = r
            .decide(&blocks, 1280, &states, &none, waiting, 1_001, &mut rng)
            .unwrap();
        assert_eq!(d.endpoint, sticky);
    }

    fn two_models() -> Router {
        let c = Config::from_json(
            br#"{"endpoints":["10.0.0.1:8000","10.0.0.2:8000","10.0.0.3:8000","10.0.0.4:8000"],
                "models":[{"name":"a","endpoints":["10.0.0.1:8000","10.0.0.2:8000"],"adapters":["a-lora"]},
                          {"name":"b-*","endpoints":["10.0.0.3:8000","10.0.0.4:8000"]}],
                "scheduling":{"seed":1}}"#,
        )
        .unwrap();
        Router::new(c)
    }

    #[test]
    fn a_model_is_scheduled_only_on_its_endpoints_even_when_they_are_down() {
        let r = two_models();
        let mut rng = fastrand::Rng::with_seed(1);
        let a = r.scope(Some("a")).unwrap();
        let b = r.scope(Some("b-7b")).unwrap();
        assert_eq!(
            r.scope(Some("a-lora")),
            Ok(Scope::Model {
                pool: 0,
                adapter: Some(crate::metrics::lora::adapter_id("a-lora")),
                listed: None,
            })
        );
        assert!(r.scope(Some("c")).is_err());
        assert_eq!(r.scope(None), Ok(Scope::All));
        let mut states = idle_states(&r, 0);
        // Model a's endpoints fail their scrapes: the health filter falls
        // back among a's endpoints, never b's.
        for e in [ep(1), ep(2)] {
            for _ in 0..5 {
                states.fail(e);
            }
        }
        let none = OutlierTable::default();
        for i in 0..50u64 {
            let blocks = [i + 1];
            for (scope, allowed) in [(a, [ep(1), ep(2)]), (b, [ep(3), ep(4)])] {
                let d = r
                    .decide_in(
                        scope,
                        &blocks[..],
                        64,
                        &states,
                        &none,
                        |_| InFlight::default(),
                        0,
                        &mut rng,
                    )
                    .unwrap();
                assert!(allowed.contains(&d.endpoint), "{scope:?} -> {}", d.endpoint);
                assert!(Router::fallbacks(&d, 3).iter().all(|f| allowed.contains(f)));
                assert!(d.scores.iter().all(|(e, _)| allowed.contains(e)));
            }
        }
    }

    #[test]
    fn saturated_only_when_every_endpoint_of_the_model_is() {
        let r = two_models();
        let a = r.scope(Some("a")).unwrap();
        let b = r.scope(Some("b-1")).unwrap();
        let none = OutlierTable::default();
        let busy = MetricsSnapshot {
            waiting: 5.0,
            ..MetricsSnapshot::default()
        };
        let mut states = idle_states(&r, 1_000);
        assert!(!r.saturated(a, &states, &none, 1_000));
        states.succeed(ep(1), busy, 1_000);
        assert!(!r.saturated(a, &states, &none, 1_000), "ep 2 is idle");
        states.succeed(ep(2), busy, 1_000);
        assert!(r.saturated(a, &states, &none, 1_000));
        assert!(
            !r.saturated(b, &states, &none, 1_000),
            "b's endpoints are idle"
        );
        assert!(!r.saturated(Scope::All, &states, &none, 1_000));
        // Stale figures count as saturated (200 ms by default).
        assert!(r.saturated(b, &states, &none, 1_200));
        // Only a negative priority is shed.
        let batch = Objective {
            index: Some(0),
            priority: -1,
        };
        assert!(r.shed(batch, a, &states, &none, 1_000));
        assert!(!r.shed(Objective::DEFAULT, a, &states, &none, 1_000));
        assert!(!r.shed(batch, b, &states, &none, 1_000));
    }

    #[test]
    fn learning_ignores_endpoints_outside_the_pool_and_pool_changes_forget() {
        let mut r = router(2);
        let outsider: Endpoint = "192.0.2.1:80".parse().unwrap();
        r.learn(outsider, &[1, 2, 3], 5);
        assert_eq!(r.indexed_blocks(outsider), 0);
        r.learn(ep(1), &[1, 2, 3], 5);
        assert_eq!(r.indexed_blocks(ep(1)), 3);
        r.set_pool(vec![ep(2), ep(3)]);
        assert_eq!(r.indexed_blocks(ep(1)), 0);
        assert!(!r.contains(ep(1)) && r.contains(ep(3)));
        let states = idle_states(&r, 0);
        let mut rng = fastrand::Rng::with_seed(1);
        for _ in 0..20 {
            let d = r
                .decide(
                    &[],
                    0,
                    &states,
                    &OutlierTable::default(),
                    |_| InFlight::default(),
                    0,
                    &mut rng,
                )
                .unwrap();
            assert!(r.contains(d.endpoint));
        }
    }

    #[test]
    fn fallbacks_are_the_next_best_others() {
        let d = Decision {
            endpoint: ep(2),
            reason: Reason::Load,
            matched_blocks: 0,
            scores: vec![(ep(1), 1.0), (ep(2), 5.0), (ep(3), 3.0), (ep(4), 2.0)],
            predictions: Vec::new(),
            prediction: None,
            overruled: None,
        };
        assert_eq!(Router::fallbacks(&d, 2), vec![ep(3), ep(4)]);
        assert_eq!(Router::fallbacks(&d, 9).len(), 3);
    }

    #[test]
    fn empty_pool_decides_nothing() {
        let r = Router::new(Config {
            handoff: crate::config::Handoff::OverrideHost,
            discovery: Some(Default::default()),
            ..Config::default()
        });
        let mut rng = fastrand::Rng::with_seed(1);
        assert!(r
            .decide(
                &[],
                0,
                &EndpointStates::default(),
                &OutlierTable::default(),
                |_| InFlight::default(),
                0,
                &mut rng
            )
            .is_none());
    }

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

    /// Two `weighted` endpoints: endpoint 1, whose engine queues 6 and runs
    /// 4, holds 590 of the 600 blocks of a document (38 400 tokens); the
    /// other is idle.
    fn busy_holder_of_a_doc() -> (Router, EndpointStates, Vec<u64>) {
        let mut r = router(2);
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
        // Once its queue is worth more than prefilling the whole document
        // elsewhere, the request goes elsewhere (affinity broken by cost).
        let d = decide(&r, 40_000, &mut rng);
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
                    let mut f = work(if *e == ep(1) { 40_000 } else { 0 });
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
    fn ttft_learns_a_slow_endpoint_and_sends_it_less() {
        let mut r = ttft_router(2);
        let mut rng = fastrand::Rng::with_seed(4);
        let states = idle_states(&r, 0);
        // Endpoint 1 answers ten times slower per token.
        for _ in 0..20 {
            r.first_byte(ep(1), 4_000, 0.0, 20 + 4_000);
            r.first_byte(ep(2), 4_000, 0.0, 20 + 400);
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
