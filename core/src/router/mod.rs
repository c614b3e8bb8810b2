//! The per-VM router: the pool, the prefix index and the scheduler in one
//! place, so the Envoy shell makes a decision with one call and learns from
//! it with another. Pure: the shell passes in the shared state it read
//! (scrape states, in-flight counts), the clock and the RNG.
//!
//! Picking has no side effects; [`Router::learn`] is the explicit step after
//! the pick that teaches the prefix index (and is replayed on other workers
//! from the shared decision log).
//!
//! Here: the candidates (one merge pass over the pool, the scrape states and
//! the prefix matches), the scheduler's pick, learning. In `cost.rs`: each
//! candidate's predicted TTFT and the cost checks that may overrule the pick.

use crate::cache_trust::{CacheTrust, TrustChange};
use crate::config::{Config, Profile};
use crate::decode_speed::DecodeSpeed;
use crate::endpoint::Endpoint;
use crate::inflight::InFlight;
use crate::metrics::lora::AdapterFit;
use crate::metrics::schedule;
use crate::models::{ModelNotFound, ModelPools, Scope};
use crate::objectives::Objective;
use crate::outlier::OutlierTable;
use crate::prefix::{PrefixIndex, PrefixMatch, Prompt};
use crate::scheduler::figures::Figures;
use crate::scheduler::{Candidate, Decision, RequestFacts, Scheduler};
use crate::shared::endpoint_state::{EndpointStates, ScrapeState};
use crate::slots::SlotLimits;
use crate::stall::{self, StallCheck};
use crate::ttft::{Prediction, TtftModel};
use hashbrown::HashMap;

mod cost;

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
    /// Each pool member's engine restarts as last observed, where not 0.
    /// (A VM's first look finds its index empty: the shell observes before
    /// it replays the decision log.)
    restarts: HashMap<Endpoint, u32>,
    /// Whether each engine keeps what the index says it holds.
    cache_trust: CacheTrust,
    /// The newest scrape `check_engine_caches` has seen: older states were
    /// read at an earlier check.
    caches_checked_ms: u64,
    ttft: TtftModel,
    decode: DecodeSpeed,
    slots: SlotLimits,
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
            restarts: HashMap::new(),
            cache_trust: CacheTrust::default(),
            caches_checked_ms: 0,
            ttft: TtftModel::new(&config.scheduling.ttft),
            decode: DecodeSpeed::new(config.scheduling.ttft.learning_rate),
            slots: SlotLimits::new(
                config.scheduling.ttft.learning_rate,
                config.scheduling.engine_slots,
            ),
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
        let ejected = outliers.ejections(now_ms);
        !self
            .pool
            .iter()
            .zip(states.aligned(&self.pool))
            .map(|(e, s)| (e, s.unwrap_or(&unknown)))
            .filter(|(e, s)| serves(e, s))
            .any(|(e, s)| {
                let healthy = s.healthy(threshold) && !ejected(e);
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
        self.restarts.retain(|e, _| pool.binary_search(e).is_ok());
        self.cache_trust.retain(&pool);
        self.ttft.retain(&pool);
        self.decode.retain(&pool);
        self.slots.retain(&pool);
        self.pool = pool;
    }

    /// Follows what the scrape states say of each endpoint's prefix cache:
    /// its restarts (an engine that restarted holds no prefix, so the index
    /// forgets what it held there: its conversations go where their
    /// prefixes still are, or are placed by load, instead of all following
    /// the index back to an empty cache), and, when
    /// `prefix.follow_engine_capacity` is on, the capacity it reports
    /// (`block_size x num_gpu_blocks`), and, with `scheduling.slot_wait`,
    /// the slot count its engine reports and the requests it runs and
    /// queues (`slots.rs`; `inflight`: kvroute's
    /// requests on each endpoint now, looked up in endpoint order). Returns
    /// the endpoints forgotten.
    pub fn observe(
        &mut self,
        states: &EndpointStates,
        inflight: impl Fn(&Endpoint) -> InFlight,
    ) -> Vec<Endpoint> {
        let follow = self.config.prefix.follow_engine_capacity;
        let mut forgotten = Vec::new();
        for (endpoint, state) in &states.entries {
            // Restart counts kept only where not 0 (a map lookup per
            // endpoint and tick only once some engine restarted). The pool
            // is sorted: a linear `contains` made every tick quadratic in
            // the pool.
            let seen = match self.restarts.is_empty() {
                true => 0,
                false => self.restarts.get(endpoint).copied().unwrap_or(0),
            };
            if state.restarts != seen && self.pool.binary_search(endpoint).is_ok() {
                self.restarts.insert(*endpoint, state.restarts);
                self.index.clear(*endpoint);
                self.slots.forget(endpoint);
                forgotten.push(*endpoint);
            }
            // The slot count its engine reports (a lookup per endpoint and
            // tick only once some engine reported one).
            if self.config.scheduling.slot_wait
                && (state.engine_slots.is_some() || self.slots.any_reported())
                && self.pool.binary_search(endpoint).is_ok()
            {
                self.slots.report(*endpoint, state.engine_slots);
            }
            if let Some(snapshot) = &state.snapshot {
                if self.config.scheduling.slot_wait && self.pool.binary_search(endpoint).is_ok() {
                    let awaiting = inflight(endpoint).waiting;
                    self.slots
                        .observe(*endpoint, snapshot, state.scraped_at_ms, awaiting);
                }
            }
            let Some(tokens) = state.snapshot.and_then(|s| s.kv_capacity_tokens) else {
                continue;
            };
            let blocks = (tokens as usize / self.config.prefix.block_tokens).max(1);
            if follow
                && self.capacity.get(endpoint) != Some(&blocks)
                && self.pool.binary_search(endpoint).is_ok()
            {
                self.capacity.insert(*endpoint, blocks);
                self.index.set_capacity(*endpoint, blocks);
            }
        }
        forgotten
    }

    /// With `prefix.verify_engine_cache`, follows each pool endpoint's
    /// prefix-cache hit counter in the scrape states, seen at `now_ms`
    /// (`cache_trust`); returns the endpoints whose trust changed. Only
    /// states scraped since the last call are read (scrapes are written in
    /// the order they answer): at 1024 endpoints a tick brings about a
    /// fifth of them.
    pub fn check_engine_caches(
        &mut self,
        states: &EndpointStates,
        now_ms: u64,
    ) -> Vec<(Endpoint, TrustChange)> {
        if !self.config.prefix.verify_engine_cache {
            return Vec::new();
        }
        let since = self.caches_checked_ms;
        let mut changes = Vec::new();
        for (endpoint, s) in &states.entries {
            // `>=`: another answer of the same millisecond may be new.
            if s.scraped_at_ms < since || self.pool.binary_search(endpoint).is_err() {
                continue;
            }
            self.caches_checked_ms = self.caches_checked_ms.max(s.scraped_at_ms);
            let counter = s.prefix_hits_total;
            if let Some(c) =
                self.cache_trust
                    .observe(*endpoint, counter, s.restarts, s.scraped_at_ms, now_ms)
            {
                changes.push((*endpoint, c));
            }
        }
        let retried = self.cache_trust.retry_due(now_ms);
        changes.extend(retried.into_iter().map(|e| (e, TrustChange::Trusted)));
        changes
    }

    /// `endpoint` answered in full (2xx) a request routed at `routed_ms`
    /// whose decision found `held_blocks` of its prompt there in the index
    /// (`Decision::held_blocks`): evidence for `cache_trust`.
    pub fn completed_with_prefix(
        &mut self,
        endpoint: Endpoint,
        held_blocks: usize,
        routed_ms: u64,
    ) {
        if held_blocks > 0 && self.config.prefix.verify_engine_cache {
            let tokens = held_blocks.saturating_mul(self.config.prefix.block_tokens);
            self.cache_trust.credit(endpoint, tokens as u64, routed_ms);
        }
    }

    /// The endpoints whose engines keep (almost) none of the prompts
    /// kvroute sends them: their prefixes count for nothing.
    pub fn distrusted_caches(&self) -> &[Endpoint] {
        self.cache_trust.distrusted()
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
        // addresses costs more). An engine that keeps no prompts
        // (`cache_trust`) holds nothing worth a match.
        let mut by_index: Vec<(usize, &PrefixMatch)> = matches
            .iter()
            .filter(|m| self.cache_trust.trusts(&m.endpoint))
            .filter_map(|m| Some((self.pool.binary_search(&m.endpoint).ok()?, m)))
            .collect();
        by_index.sort_unstable_by_key(|(i, _)| *i);
        let mut next_match = 0;
        let entries = &states.entries;
        let mut next_entry = 0;
        let unknown = ScrapeState::default();
        let serves = self.models.serves_in_order(scope);
        let everyone = scope == Scope::All;
        let ejected = outliers.ejections(now_ms);
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
            let m = match by_index.get(next_match) {
                Some(&(k, m)) if k == i => {
                    next_match += 1;
                    Some(m)
                }
                _ => None,
            };
            let load = inflight(endpoint);
            let suspect = stall.is_some_and(|s| s.suspect(&load, state.answered_at_ms));
            // Once one is found, no other needs the look.
            others_alive =
                others_alive || stall.is_some_and(|s| !suspect && !s.silent(state.answered_at_ms));
            if !everyone && !serves(endpoint, state) {
                continue;
            }
            if suspect {
                suspects.push(candidates.len());
            }
            candidates.push(Candidate {
                endpoint: *endpoint,
                snapshot: state.current(now_ms, stale_after, load.requests),
                // A base-model request does not read the adapters.
                adapter_fit: match adapter {
                    Some(_) => state.adapter_fit(adapter, now_ms, stale_after),
                    None => AdapterFit::Unknown,
                },
                healthy: state.healthy(metrics.unhealthy_after_failures) && !ejected(endpoint),
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
            first_block: blocks.first().copied(),
            adapter,
        };
        let figures = Figures::measure(&facts, &candidates);
        let mut decision = if self.config.scheduling.profile == Profile::PredictedTtft {
            let mut predictions = self.predict(&candidates, prompt_tokens, now_ms);
            self.charge_moves(&candidates, &figures, &mut predictions, now_ms);
            self.scheduler
                .pick_measured(&facts, &candidates, &figures, &predictions, rng)?
        } else {
            let mut decision =
                self.scheduler
                    .pick_measured(&facts, &candidates, &figures, &[], rng)?;
            self.check_by_cost(&mut decision, &candidates, &figures, &facts, now_ms);
            decision
        };
        if !self.cache_trust.distrusted().is_empty() {
            decision.held_blocks = matches
                .iter()
                .find(|m| m.endpoint == decision.endpoint)
                .map_or(0, |m| m.blocks);
        }
        Some(decision)
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
    /// after routing, a request routed with `prediction`: it had the
    /// prediction's ahead and uncached tokens of prefill to wait for while
    /// its `running` requests decoded there. Teaches the TTFT model, less
    /// the wait for a slot the prediction held (`slots.rs`: whole requests
    /// finishing, which the model's rates do not describe).
    pub fn first_byte(&mut self, endpoint: Endpoint, prediction: &Prediction, ttft_ms: u64) {
        if self.contains(endpoint) {
            let work = (prediction.ahead_tokens + prediction.uncached_tokens) as u64;
            let waited = ttft_ms.saturating_sub(prediction.slot_wait_ms as u64);
            self.ttft
                .observe(endpoint, work, prediction.running, waited);
        }
    }

    /// A 2xx answer routed with `prediction` streamed its first chunk
    /// `ttft_ms` after routing and its last `decode_ms` after that: it held
    /// an engine's slot for its own prefill (the part of its first token
    /// the prediction puts on its fixed part and uncached tokens, at most
    /// `ttft_ms`; the wait before it held nothing) and its answer
    /// (`scheduling.slot_wait`, `slots.rs`).
    pub fn streamed_in_full(
        &mut self,
        prediction: Option<&Prediction>,
        ttft_ms: u64,
        decode_ms: u64,
    ) {
        if !self.config.scheduling.slot_wait {
            return;
        }
        let own = prediction.map_or(0.0, |p| p.overhead_ms + p.uncached_tokens * p.ms_per_token);
        let prefill_ms = (own.max(0.0) as u64).min(ttft_ms);
        self.slots.held(prefill_ms.saturating_add(decode_ms));
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

    /// Leading `blocks` the index holds for `endpoint` (what a decision
    /// for it would have counted as held).
    pub fn held_blocks(&self, endpoint: Endpoint, blocks: &[u64]) -> usize {
        blocks
            .iter()
            .take_while(|&&b| self.index.contains(endpoint, b))
            .count()
    }

    /// Blocks the index holds for `endpoint`.
    pub fn indexed_blocks(&self, endpoint: Endpoint) -> usize {
        self.index.len(endpoint)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::lora::AdapterFit;
    use crate::metrics::MetricsSnapshot;
    use crate::scheduler::Reason;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    pub(super) fn ep(i: u8) -> Endpoint {
        format!("10.0.0.{i}:8000").parse().unwrap()
    }

    pub(super) fn router(n: u8) -> Router {
        let mut c = Config {
            endpoints: (1..=n).map(ep).collect(),
            ..Config::default()
        };
        c.scheduling.seed = Some(1);
        Router::new(c)
    }

    pub(super) fn idle_states(r: &Router, now: u64) -> EndpointStates {
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
                    snapshot: state.current(now_ms, stale_after, inflight(&endpoint).requests),
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
                first_block: request.first().copied(),
                adapter: None,
            };
            let mut want =
                r.scheduler
                    .pick(&facts, &candidates, &mut fastrand::Rng::with_seed(seed));
            if let Some(d) = &mut want {
                let figures = Figures::measure(&facts, &candidates);
                r.check_by_cost(d, &candidates, &figures, &facts, now);
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

    pub(super) fn two_models() -> Router {
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
    fn an_engine_that_restarted_is_forgotten_and_its_prompts_go_where_their_prefix_is() {
        use crate::metrics::scrape::ScrapeOutcome;
        use crate::metrics::Reading;
        use crate::shared::endpoint_state::{CounterNews, FLAP_WINDOW_MS};
        let mut r = router(2);
        let mut states = idle_states(&r, 0);
        let scrape = |states: &mut EndpointStates, e: Endpoint, tokens: f64| {
            let reading = Reading {
                prompt_tokens_total: Some(tokens),
                ..Reading::default()
            };
            states.record(e, ScrapeOutcome::Snapshot(reading), 1, FLAP_WINDOW_MS)
                == CounterNews::Restarted
        };
        let doc: Vec<u64> = (1..=8).collect();
        r.learn(ep(1), &doc, 0);
        r.learn(ep(2), &doc[..4], 0);
        let decide = |r: &Router, states: &EndpointStates| {
            let mut rng = fastrand::Rng::with_seed(1);
            let load = |_: &Endpoint| InFlight::default();
            let d = r.decide(
                &doc,
                512,
                states,
                &OutlierTable::default(),
                load,
                1,
                &mut rng,
            );
            d.map(|d| (d.endpoint, d.reason)).unwrap()
        };
        assert_eq!(decide(&r, &states), (ep(1), Reason::Prefix));
        // The counters grow: nothing to forget.
        for tokens in [100.0, 900.0] {
            assert!(!scrape(&mut states, ep(1), tokens));
            scrape(&mut states, ep(2), tokens);
            assert_eq!(
                r.observe(&states, |_| InFlight::default()),
                Vec::<Endpoint>::new()
            );
        }
        assert_eq!(r.indexed_blocks(ep(1)), 8);
        // Endpoint 1's counter starts over: it restarted.
        assert!(scrape(&mut states, ep(1), 12.0));
        assert_eq!(r.observe(&states, |_| InFlight::default()), vec![ep(1)]);
        assert_eq!((r.indexed_blocks(ep(1)), r.indexed_blocks(ep(2))), (0, 4));
        assert_eq!(
            r.observe(&states, |_| InFlight::default()),
            Vec::<Endpoint>::new(),
            "once"
        );
        // The prompt goes to the endpoint still holding half of it.
        assert_eq!(decide(&r, &states), (ep(2), Reason::Prefix));
    }

    #[test]
    fn the_prefixes_of_an_engine_that_keeps_none_count_for_nothing() {
        use crate::cache_trust::TrustChange;
        let doc: Vec<u64> = (1..=8).collect();
        for verify in [true, false] {
            let mut c = router(2).config().clone();
            c.prefix.verify_engine_cache = verify;
            let mut r = Router::new(c);
            r.learn(ep(1), &doc, 0);
            let mut states = idle_states(&r, 0);
            let decide = |r: &Router, states: &EndpointStates| {
                let mut rng = fastrand::Rng::with_seed(1);
                let load = |_: &Endpoint| InFlight::default();
                let none = OutlierTable::default();
                r.decide(&doc, 512, states, &none, load, 1, &mut rng)
                    .unwrap()
            };
            let d = decide(&r, &states);
            assert_eq!(
                (d.endpoint, d.reason, d.held_blocks),
                (ep(1), Reason::Prefix, 8)
            );
            // Endpoint 1 answers requests believed to find 8 blocks cached;
            // its engine's hit counter never moves (endpoint 2's does).
            let mut changes = Vec::new();
            for k in 1..=100u64 {
                let now = k * 100;
                r.completed_with_prefix(ep(1), 8, now);
                r.completed_with_prefix(ep(2), 8, now);
                states.entry(ep(1)).prefix_hits_total = Some(0.0);
                states.entry(ep(2)).prefix_hits_total = Some((k * 512) as f64);
                for e in [ep(1), ep(2)] {
                    states.entry(e).scraped_at_ms = now;
                }
                changes.extend(r.check_engine_caches(&states, now));
            }
            let d = decide(&r, &states);
            if !verify {
                assert_eq!(changes, vec![]);
                assert_eq!((d.endpoint, d.reason), (ep(1), Reason::Prefix));
                continue;
            }
            assert!(
                matches!(changes[..], [(e, TrustChange::Distrusted { hits, .. })] if e == ep(1) && hits == 0.0),
                "{changes:?}"
            );
            assert_eq!(r.distrusted_caches(), &[ep(1)]);
            // Nobody holds anything worth a match: a cold pick. The index
            // still says what endpoint 1 holds.
            assert_eq!((d.reason, d.matched_blocks), (Reason::Cold, 0));
            let held = if d.endpoint == ep(1) { 8 } else { 0 };
            assert_eq!(d.held_blocks, held);
            assert_eq!(r.indexed_blocks(ep(1)), 8);
        }
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
            held_blocks: 0,
            scores: vec![(ep(1), 1.0), (ep(2), 5.0), (ep(3), 3.0), (ep(4), 2.0)],
            predictions: Vec::new(),
            prediction: None,
            overruled: None,
        };
        assert_eq!(Router::fallbacks(&d, 2), vec![ep(3), ep(4)]);
        assert_eq!(Router::fallbacks(&d, 9).len(), 3);
    }

    /// Envoy workers (each a router with its own RNG) that decide copies of
    /// one new prompt at once, on the same view of the pool, send them to
    /// one endpoint: the ties a cold pick leaves (an idle pool, none
    /// picked yet or all in the same millisecond) go by a hash of the
    /// prompt's first block, not by each worker's RNG. They went by the
    /// RNG, and two workers routing copies of a new prompt at once put it
    /// on two pods (`tests/routing.rs`, copies of a new prompt routed by
    /// four workers). Distinct prompts still spread over the pool.
    #[test]
    fn workers_deciding_copies_of_a_new_prompt_agree() {
        let now = 1_000;
        let workers: Vec<Router> = (0..4).map(|_| router(4)).collect();
        let states = idle_states(&workers[0], now);
        let mut used = HashMap::new();
        for prompt in 0..40u64 {
            let blocks = [prompt << 8 | 1, prompt << 8 | 2];
            let picks: Vec<Endpoint> = workers
                .iter()
                .enumerate()
                .map(|(seed, r)| {
                    let mut rng = fastrand::Rng::with_seed(seed as u64);
                    let d = r
                        .decide(
                            &blocks,
                            128,
                            &states,
                            &OutlierTable::default(),
                            |_| InFlight::default(),
                            now,
                            &mut rng,
                        )
                        .unwrap();
                    assert_eq!(d.reason, Reason::Cold);
                    d.endpoint
                })
                .collect();
            assert!(picks.iter().all(|e| *e == picks[0]), "{prompt}: {picks:?}");
            *used.entry(picks[0]).or_insert(0) += 1;
        }
        assert_eq!(used.len(), 4, "{used:?}");
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

    #[test]
    fn held_blocks_counts_the_leading_blocks_an_endpoint_holds() {
        let mut r = router(2);
        r.learn(ep(1), &[1, 2, 3][..], 10);
        assert_eq!(r.held_blocks(ep(1), &[1, 2, 3, 4]), 3);
        // Leading only: a gap ends the match (real hashes are chained, so
        // a block held elsewhere in a prompt never reappears first).
        assert_eq!(r.held_blocks(ep(1), &[1, 9, 3]), 1);
        assert_eq!(r.held_blocks(ep(2), &[1, 2, 3]), 0);
        assert_eq!(r.held_blocks(ep(1), &[]), 0);
    }
}
