//! The per-VM router: the pool, the prefix index and the scheduler in one
//! place, so the Envoy shell makes a decision with one call and learns from
//! it with another. Pure: the shell passes in the shared state it read
//! (scrape states, in-flight counts), the clock and the RNG.
//!
//! Picking has no side effects; [`Router::learn`] is the explicit step after
//! the pick that teaches the prefix index (and is replayed on other workers
//! from the shared decision log).

use crate::config::Config;
use crate::endpoint::Endpoint;
use crate::inflight::InFlight;
use crate::prefix::PrefixIndex;
use crate::scheduler::{Candidate, Decision, RequestFacts, Scheduler};
use crate::shared::endpoint_state::EndpointStates;
use hashbrown::HashMap;

/// Pool, prefix index and scheduler of one VM.
#[derive(Debug)]
pub struct Router {
    config: Config,
    scheduler: Scheduler,
    index: PrefixIndex,
    pool: Vec<Endpoint>,
    last_picked: HashMap<Endpoint, u64>,
    capacity: HashMap<Endpoint, usize>,
}

impl Router {
    /// A router over `config.endpoints`.
    pub fn new(config: Config) -> Router {
        let mut router = Router {
            scheduler: Scheduler::new(&config.scheduling),
            index: PrefixIndex::new(config.prefix.capacity_blocks),
            pool: Vec::new(),
            last_picked: HashMap::new(),
            capacity: HashMap::new(),
            config,
        };
        router.set_pool(router.config.endpoints.clone());
        router
    }

    /// The validated configuration.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// Current pool members.
    pub fn pool(&self) -> &[Endpoint] {
        &self.pool
    }

    /// Whether `endpoint` is a pool member.
    pub fn contains(&self, endpoint: Endpoint) -> bool {
        self.pool.contains(&endpoint)
    }

    /// Replaces the pool (live discovery); forgets removed endpoints.
    pub fn set_pool(&mut self, mut pool: Vec<Endpoint>) {
        pool.sort();
        pool.dedup();
        if pool == self.pool {
            return;
        }
        self.index.retain(&pool);
        self.last_picked.retain(|e, _| pool.contains(e));
        self.capacity.retain(|e, _| pool.contains(e));
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
            if self.pool.contains(endpoint) && self.capacity.get(endpoint) != Some(&blocks) {
                self.capacity.insert(*endpoint, blocks);
                self.index.set_capacity(*endpoint, blocks);
            }
        }
    }

    /// Picks an endpoint for a request whose prompt hashed into `blocks`
    /// (empty when the body was not understood). `None` only for an empty pool.
    pub fn decide(
        &self,
        blocks: &[u64],
        prompt_tokens: u64,
        states: &EndpointStates,
        inflight: impl Fn(Endpoint) -> InFlight,
        now_ms: u64,
        rng: &mut fastrand::Rng,
    ) -> Option<Decision> {
        let matches = if blocks.is_empty() {
            Vec::new()
        } else {
            self.index.longest_prefix(blocks)
        };
        let metrics = &self.config.metrics;
        let candidates: Vec<Candidate> = self
            .pool
            .iter()
            .map(|&endpoint| {
                let state = states.get(endpoint);
                Candidate {
                    endpoint,
                    snapshot: state.fresh(now_ms, metrics.stale_after_ms),
                    healthy: state.healthy(metrics.unhealthy_after_failures),
                    matched_blocks: matches
                        .iter()
                        .find(|(e, _)| *e == endpoint)
                        .map_or(0, |(_, n)| *n),
                    inflight: inflight(endpoint),
                    last_picked_ms: self.last_picked.get(&endpoint).copied(),
                }
            })
            .collect();
        let facts = RequestFacts {
            total_blocks: blocks.len(),
            prompt_tokens,
        };
        self.scheduler.pick(&facts, &candidates, rng)
    }

    /// Prompt tokens the chosen endpoint is expected to prefill (not cached).
    pub fn uncached_tokens(&self, decision: &Decision, prompt_tokens: u64) -> u64 {
        let cached = (decision.matched_blocks * self.config.prefix.block_tokens) as u64;
        prompt_tokens.saturating_sub(cached)
    }

    /// Learns that `endpoint` was sent `blocks` at `now_ms`. Ignores
    /// endpoints outside the pool (a stale log entry after a pool change).
    pub fn learn(&mut self, endpoint: Endpoint, blocks: &[u64], now_ms: u64) {
        if !self.pool.contains(&endpoint) {
            return;
        }
        let last = self.last_picked.entry(endpoint).or_insert(0);
        *last = (*last).max(now_ms);
        if !blocks.is_empty() {
            self.index.record(endpoint, blocks);
        }
    }

    /// Blocks the index holds for `endpoint`.
    pub fn indexed_blocks(&self, endpoint: Endpoint) -> usize {
        self.index.len(endpoint)
    }
}
