//! Scorers: each rates kept candidates 0..1 (1 = best), one per file. The
//! engine clamps, weights (`scheduling.weights`) and sums them.

pub mod inflight_requests;
pub mod inflight_tokens;
pub mod kv_cache;
pub mod lora_affinity;
pub mod prefix;
pub mod queue;

pub use inflight_requests::InFlightRequestsScorer;
pub use inflight_tokens::InFlightTokensScorer;
pub use kv_cache::KvCacheScorer;
pub use lora_affinity::LoraAffinityScorer;
pub use prefix::PrefixScorer;
pub use queue::QueueScorer;

#[cfg(test)]
pub(crate) mod test_util {
    use crate::config::SchedulingConfig;
    use crate::scheduler::figures::Figures;
    use crate::scheduler::plugin::{Context, Scorer};
    use crate::scheduler::{Candidate, RequestFacts};

    /// Scores every candidate with `s` and rounds to 1e-9.
    pub fn run(
        s: &dyn Scorer,
        req: &RequestFacts,
        cands: &[Candidate],
        cfg: &SchedulingConfig,
    ) -> Vec<f64> {
        let ctx = Context {
            req,
            candidates: cands,
            config: cfg,
            figures: &Figures::measure(req, cands),
        };
        let kept: Vec<usize> = (0..cands.len()).collect();
        let mut out = vec![];
        s.score(&ctx, &kept, &mut out);
        out.iter().map(|x| (x * 1e9).round() / 1e9).collect()
    }
}
