//! The two scheduling profiles (`scheduling.profile`), as static lists of
//! plugins; the engine in `scheduler/mod.rs` runs them.
//!
//! | profile | filters | scorers (weight) | picker |
//! |---|---|---|---|
//! | `weighted` (default) | health, overload | prefix (3), queue (2), kv_cache (2), inflight_requests (2), inflight_tokens (1); lora_affinity (4) for adapter requests only | max score; cold: within `cold_margin`, the least prefill waiting, then fewest in flight, then least recently picked, then a hash of the first block (`picker.rs`) |
//! | `affinity_gate` | health, affinity gate | queue, kv_cache, inflight_requests, inflight_tokens; lora_affinity for adapter requests | same |
//! | `predicted_ttft` | health | none: lowest predicted TTFT (`ttft.rs`) | min TTFT; cold: within `cold_margin` of the best, the same order |
//!
//! `weighted` is llm-d's default scorer profile (prefix 3 / queue 2 /
//! kv-cache 2) plus kvroute's in-flight scorers, behind an overload filter
//! that takes an endpoint queueing `gate_max_queue_excess` more than the
//! least loaded one out of the running (weighted scores saturate, so a full
//! prefix match would otherwise keep winning on a hot spot). `affinity_gate` is the
//! shape of llm-d's "optimized baseline" (`prefix-cache-affinity-filter`
//! then `token-load-scorer`): affinity is a hard filter with a load gate
//! (`affinity_threshold`, `gate_max_queue_excess`, `gate_max_tokens_excess`)
//! and only load is scored after it, token load (`inflight_tokens`)
//! included. It deliberately has no prefix scorer: after the gate opens, a
//! prefix weight at least the sum of the load weights would keep a fully
//! matched endpoint winning and make the gate inert. Weights of 0 skip a
//! scorer in either profile. Two cost checks, on by default, price a pick
//! of either profile with the TTFT model (`router/cost.rs`, `check_by_cost`):
//! `scheduling.keep_cheaper_holder` keeps the prefix's holder when a load
//! pick would prefill most of the prompt again, and
//! `scheduling.leave_costlier_holder` leaves a holder whose queue or decode
//! load costs more than prefilling the prompt elsewhere; both by one rule:
//! a request leaves a holder only when the move pays after a charge for
//! the prefill it repeats, weighed by the requests expected to arrive
//! while it runs.

use super::filter::{AffinityGateFilter, HealthFilter, OverloadFilter};
use super::plugin::{Filter, Scorer};
use super::scorer::{
    InFlightRequestsScorer, InFlightTokensScorer, KvCacheScorer, LoraAffinityScorer, PrefixScorer,
    QueueScorer,
};
use crate::config::Profile;

/// One profile's plugins, in order.
#[derive(Debug)]
pub struct ProfileSpec {
    /// Profile name as in the config.
    pub name: &'static str,
    /// Filters, applied in order.
    pub filters: &'static [&'static dyn Filter],
    /// Scorers, summed with their weights.
    pub scorers: &'static [&'static dyn Scorer],
}

static WEIGHTED: ProfileSpec = ProfileSpec {
    name: "weighted",
    filters: &[&HealthFilter, &OverloadFilter],
    scorers: &[
        &PrefixScorer,
        &QueueScorer,
        &KvCacheScorer,
        &InFlightRequestsScorer,
        &InFlightTokensScorer,
        &LoraAffinityScorer,
    ],
};

static AFFINITY_GATE: ProfileSpec = ProfileSpec {
    name: "affinity_gate",
    filters: &[&HealthFilter, &AffinityGateFilter],
    scorers: &[
        &QueueScorer,
        &KvCacheScorer,
        &InFlightRequestsScorer,
        &InFlightTokensScorer,
        &LoraAffinityScorer,
    ],
};

/// Only the health filter: the predicted TTFT itself trades cache against
/// load (`ttft.rs`; the scheduler ranks by it, no scorer runs).
static PREDICTED_TTFT: ProfileSpec = ProfileSpec {
    name: "predicted_ttft",
    filters: &[&HealthFilter],
    scorers: &[],
};

/// The plugins of a profile.
pub fn spec(profile: Profile) -> &'static ProfileSpec {
    match profile {
        Profile::Weighted => &WEIGHTED,
        Profile::AffinityGate => &AFFINITY_GATE,
        Profile::PredictedTtft => &PREDICTED_TTFT,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn profiles_have_the_documented_plugins() {
        let names = |s: &ProfileSpec| {
            (
                s.filters.iter().map(|f| f.name()).collect::<Vec<_>>(),
                s.scorers.iter().map(|f| f.name()).collect::<Vec<_>>(),
            )
        };
        let (f, s) = names(spec(Profile::Weighted));
        assert_eq!(f, ["health", "overload"]);
        assert_eq!(
            s,
            [
                "prefix",
                "queue",
                "kv-cache",
                "inflight-requests",
                "inflight-tokens",
                "lora-affinity"
            ]
        );
        let (f, s) = names(spec(Profile::AffinityGate));
        assert_eq!(f, ["health", "affinity-gate"]);
        assert!(!s.contains(&"prefix"));
        assert!(s.contains(&"lora-affinity"));
        assert_eq!(spec(Profile::AffinityGate).name, "affinity_gate");
    }
}
