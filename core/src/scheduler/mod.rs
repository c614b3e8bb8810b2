//! The decision: filters, then weighted scorers, then a picker. STUB: contract only.

use crate::config::SchedulingConfig;
use crate::endpoint::Endpoint;
use crate::inflight::InFlight;
use crate::metrics::MetricsSnapshot;

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
    /// kvroute's own outstanding work on the endpoint.
    pub inflight: InFlight,
    /// When kvroute last picked this endpoint (ms), if ever.
    pub last_picked_ms: Option<u64>,
}

/// What the scheduler needs to know of the request itself.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct RequestFacts {
    /// Number of hashed blocks of the prompt (0 when not understood).
    pub total_blocks: usize,
    /// Approximate prompt tokens.
    pub prompt_tokens: u64,
}

/// Why an endpoint was chosen.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reason {
    /// A cached prefix decided it.
    Prefix,
    /// Load decided it (the request had a prefix match elsewhere, or none mattered).
    Load,
    /// No endpoint held any prefix: spread by load and recency.
    Cold,
    /// No healthy candidate: picked among all for lack of better.
    Fallback,
}

/// The outcome of scheduling one request.
#[derive(Clone, Debug, PartialEq)]
pub struct Decision {
    /// Chosen endpoint.
    pub endpoint: Endpoint,
    /// Why.
    pub reason: Reason,
    /// Leading blocks the chosen endpoint holds.
    pub matched_blocks: usize,
    /// Final weighted score of each scored candidate.
    pub scores: Vec<(Endpoint, f64)>,
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

    /// Picks an endpoint; `None` only when `candidates` is empty.
    pub fn pick(
        &self,
        _req: &RequestFacts,
        candidates: &[Candidate],
        rng: &mut fastrand::Rng,
    ) -> Option<Decision> {
        let _ = &self.config;
        if candidates.is_empty() {
            return None;
        }
        let c = &candidates[rng.usize(..candidates.len())];
        Some(Decision {
            endpoint: c.endpoint,
            reason: Reason::Load,
            matched_blocks: c.matched_blocks,
            scores: vec![],
        })
    }
}
