//! # lora_affinity scorer
//!
//! **What**: for a request naming a LoRA adapter (a `models[].adapters`
//! entry), prefers endpoints where the adapter is already running, then
//! those with a free adapter slot, then those where it waits (llm-d's
//! LoRA-affinity scorer). Loading an adapter costs time on the engine, and
//! an engine with every slot taken queues the request until one frees.
//!
//! **Formula** (`metrics::lora::LoraSnapshot::fit`, computed by the router
//! into `Candidate::adapter_fit`): running 1.0; else a free slot (adapters
//! running + waiting < `max_lora`) 0.8; else waiting 0.6; else 0. No fresh
//! snapshot, or an engine that does not report its adapters: 0.5 (neutral).
//!
//! **Only adapter requests**: for every other request the scorer does not
//! run and its weight does not count, so a base-model request is scored
//! exactly as without LoRA.
//!
//! **Affinity, not a cold pick**: when a live endpoint runs the adapter,
//! the request is not "cold" (`scheduler/mod.rs`): the picker takes the
//! best score instead of rotating among those within the cold margin, as
//! it does for a cached prefix.
//!
//! **Config**: `scheduling.weights.lora_affinity` (6). Running over a free
//! slot is worth 0.2 x 6 = 1.2 points: about two more waiting requests
//! (0.5 each at the default weights) or four more in flight (0.25 each)
//! send the request to the free slot instead; a full prefix match (3)
//! outweighs it. A pod whose slots are all busy with other adapters (0)
//! is 4.8 points behind one with a free slot: it gets the request only
//! when every other candidate is far more loaded.

use super::super::plugin::{Context, Scorer, NEUTRAL};
use crate::config::Weights;
use crate::scheduler::RequestFacts;

/// Adapter already running here.
#[derive(Clone, Copy, Debug, Default)]
pub struct LoraAffinityScorer;

impl Scorer for LoraAffinityScorer {
    fn name(&self) -> &'static str {
        "lora-affinity"
    }

    fn weight(&self, w: &Weights) -> f64 {
        w.lora_affinity
    }

    fn applies(&self, req: &RequestFacts) -> bool {
        req.adapter.is_some()
    }

    fn score(&self, ctx: &Context, kept: &[usize], out: &mut Vec<f64>) {
        out.clear();
        if ctx.req.adapter.is_none() {
            out.resize(kept.len(), NEUTRAL);
            return;
        }
        out.extend(
            kept.iter()
                .map(|&i| ctx.candidates[i].adapter_fit.score().unwrap_or(NEUTRAL)),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_util::run;
    use super::*;
    use crate::config::SchedulingConfig;
    use crate::metrics::lora::{adapter_id, AdapterFit, LoraSnapshot};
    use crate::scheduler::test_support::cand;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn running_then_free_slot_then_waiting() {
        let mut cands: Vec<_> = (0..5).map(cand).collect();
        let lora = [
            Some(("sql", "", "1")),
            Some(("other", "", "2")),
            Some(("other", "sql", "2")),
            Some(("other", "x", "2")),
            None,
        ];
        for (c, l) in cands.iter_mut().zip(lora) {
            c.adapter_fit = l.map_or(AdapterFit::Unknown, |(r, w, m)| {
                LoraSnapshot::from_labels(r, w, m).fit(adapter_id("sql"))
            });
        }
        let req = RequestFacts {
            adapter: Some(adapter_id("sql")),
            ..RequestFacts::default()
        };
        let cfg = SchedulingConfig::default();
        assert_eq!(
            run(&LoraAffinityScorer, &req, &cands, &cfg),
            [1.0, 0.8, 0.6, 0.0, 0.5]
        );
        assert!(LoraAffinityScorer.applies(&req));
        assert!(!LoraAffinityScorer.applies(&RequestFacts::default()));
    }
}
