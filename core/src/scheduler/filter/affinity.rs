//! # affinity gate filter
//!
//! **What**: prefix affinity with a load gate, the shape of llm-d's
//! "optimized baseline" profile (a prefix-affinity filter in front of load
//! scorers, in the spirit of SGLang's `cache_aware` policy which follows the
//! cache only while the load is balanced): send a request to the endpoints
//! that hold most of its prefix, unless those are overloaded.
//!
//! **Formula**:
//!
//! ```text
//! prefix(c)  = matched_blocks(c) / total_blocks
//! sticky     = { c in kept | matched_blocks(c) > 0 and prefix(c) >= affinity_threshold }
//! queue(c)   = effective_queue(c)   (scraped waiting + in-flight excess, see plugin.rs)
//! tokens(c)  = inflight.tokens       (uncached prompt tokens kvroute sent, not yet prefilled)
//! gate open  = min_{c in sticky} queue(c)  - min_{c in kept} queue(c)  > gate_max_queue_excess
//!           or min_{c in sticky} tokens(c) - min_{c in kept} tokens(c) > gate_max_tokens_excess
//! result     = sticky if gate closed, else kept unchanged
//! ```
//!
//! No sticky candidate (a cold or low-match request), or every kept
//! candidate sticky: no-op. Candidates without a fresh snapshot take no part
//! in the load comparison; if no sticky candidate has one, the gate stays
//! closed (no evidence of overload).
//!
//! **Inputs**: `matched_blocks`, `total_blocks`, snapshot `waiting`/
//! `running`, `inflight.requests`, `inflight.tokens`. **Config**:
//! `scheduling.affinity_threshold` (default 0.8, llm-d's: prefix scores are
//! bimodal in production, a conversation's endpoint either holds its
//! history or it does not), `scheduling.gate_max_queue_excess` (default 8
//! requests), `scheduling.gate_max_tokens_excess` (default 286720 tokens,
//! the value of llm-d's optimized-baseline guide for its
//! `maxTokensInFlightPenalty`: about 18 s of prefill backlog at 16k
//! tokens/s; `null` disables). The token gate needs no scrape: it reacts to
//! long-context pile-ups within the same scrape interval.
//!
//! **Operational notes**: the gate compares queues, not running requests: an
//! engine that is not queueing has room, so leaving its cache would only
//! lose a hit. Because the queue includes kvroute's own in-flight excess on
//! a saturated endpoint, a burst that piles onto a sticky endpoint opens the
//! gate within the burst, not one scrape later (issue (c): affinity piling
//! onto a saturated endpoint). When the gate opens, the sticky endpoints
//! stay candidates and the load scorers decide.

use super::super::plugin::{effective_queue, prefix_fraction, Context, Filter, Note};

/// Keeps the endpoints holding the request's prefix unless they are overloaded.
#[derive(Clone, Copy, Debug, Default)]
pub struct AffinityGateFilter;

impl Filter for AffinityGateFilter {
    fn name(&self) -> &'static str {
        "affinity-gate"
    }

    fn filter(&self, ctx: &Context, kept: &mut Vec<usize>) -> Option<Note> {
        let threshold = ctx.config.affinity_threshold;
        let is_sticky = |i: usize| {
            let c = &ctx.candidates[i];
            c.matched_blocks > 0 && prefix_fraction(ctx.req, c) >= threshold
        };
        let sticky: Vec<usize> = kept.iter().copied().filter(|&i| is_sticky(i)).collect();
        if sticky.is_empty() || sticky.len() == kept.len() {
            return None;
        }
        let min_queue = |set: &[usize]| {
            set.iter()
                .filter_map(|&i| effective_queue(&ctx.candidates[i]))
                .fold(None, |m: Option<f64>, q| Some(m.map_or(q, |m| m.min(q))))
        };
        if let (Some(sticky_q), Some(all_q)) = (min_queue(&sticky), min_queue(kept)) {
            if sticky_q - all_q > ctx.config.gate_max_queue_excess {
                return Some(Note::GateOpen);
            }
        }
        if let Some(max_excess) = ctx.config.gate_max_tokens_excess {
            let min_tokens = |set: &[usize]| {
                set.iter()
                    .map(|&i| ctx.candidates[i].inflight.tokens)
                    .min()
                    .unwrap_or(0)
            };
            if min_tokens(&sticky).saturating_sub(min_tokens(kept)) as f64 > max_excess {
                return Some(Note::GateOpen);
            }
        }
        *kept = sticky;
        Some(Note::AffinityKept)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::SchedulingConfig;
    use crate::metrics::MetricsSnapshot;
    use crate::scheduler::figures::Figures;
    use crate::scheduler::test_support::cand;
    use crate::scheduler::{Candidate, RequestFacts};
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn with_tokens(mut c: Candidate, tokens: u64) -> Candidate {
        c.inflight.tokens = tokens;
        c
    }

    fn c(i: usize, matched: usize, waiting: Option<f64>, inflight: u32) -> Candidate {
        let mut c = cand(i);
        c.matched_blocks = matched;
        c.snapshot = waiting.map(|w| MetricsSnapshot {
            waiting: w,
            running: 4.0,
            ..MetricsSnapshot::default()
        });
        c.inflight.requests = inflight;
        c
    }

    type Case = (&'static str, Vec<Candidate>, Vec<usize>, Option<Note>);

    #[test]
    fn gate_table() {
        // (what, candidates, kept after, note); request has 10 blocks,
        // threshold 0.8, max excess 8.
        let cases: Vec<Case> = vec![
            (
                "sticky kept at equal load",
                vec![c(0, 10, Some(0.0), 0), c(1, 0, Some(0.0), 0)],
                vec![0],
                Some(Note::AffinityKept),
            ),
            (
                "below threshold is not sticky",
                vec![c(0, 7, Some(0.0), 0), c(1, 0, Some(0.0), 0)],
                vec![0, 1],
                None,
            ),
            (
                "cold request: no-op",
                vec![c(0, 0, Some(0.0), 0), c(1, 0, Some(5.0), 0)],
                vec![0, 1],
                None,
            ),
            (
                "all sticky: no-op",
                vec![c(0, 9, Some(50.0), 0), c(1, 10, Some(0.0), 0)],
                vec![0, 1],
                None,
            ),
            (
                "queue excess 8 is not more than 8: closed",
                vec![c(0, 10, Some(8.0), 0), c(1, 0, Some(0.0), 0)],
                vec![0],
                Some(Note::AffinityKept),
            ),
            (
                "queue excess 9: open",
                vec![c(0, 10, Some(9.0), 0), c(1, 0, Some(0.0), 0)],
                vec![0, 1],
                Some(Note::GateOpen),
            ),
            (
                "in-flight excess on a queueing endpoint opens it",
                // waiting 2 + running 4 scraped, 16 in flight: 10 more queued.
                vec![c(0, 10, Some(2.0), 16), c(1, 0, Some(0.0), 0)],
                vec![0, 1],
                Some(Note::GateOpen),
            ),
            (
                "in-flight on a non-queueing endpoint does not",
                vec![c(0, 10, Some(0.0), 16), c(1, 0, Some(0.0), 0)],
                vec![0],
                Some(Note::AffinityKept),
            ),
            (
                "best sticky counts",
                vec![
                    c(0, 10, Some(30.0), 0),
                    c(1, 9, Some(1.0), 0),
                    c(2, 0, Some(0.0), 0),
                ],
                vec![0, 1],
                Some(Note::AffinityKept),
            ),
            (
                "token backlog over 286720 more: open",
                vec![
                    with_tokens(c(0, 10, Some(0.0), 3), 300_000),
                    with_tokens(c(1, 0, Some(0.0), 0), 10_000),
                ],
                vec![0, 1],
                Some(Note::GateOpen),
            ),
            (
                "token backlog at 286720 more: closed",
                vec![
                    with_tokens(c(0, 10, None, 3), 296_720),
                    with_tokens(c(1, 0, Some(0.0), 0), 10_000),
                ],
                vec![0],
                Some(Note::AffinityKept),
            ),
            (
                "no snapshot on sticky: closed",
                vec![c(0, 10, None, 0), c(1, 0, Some(0.0), 0)],
                vec![0],
                Some(Note::AffinityKept),
            ),
        ];
        let cfg = SchedulingConfig::default();
        let req = RequestFacts {
            total_blocks: 10,
            prompt_tokens: 640,
            affinity_key: None,
            first_block: None,
            adapter: None,
        };
        let mut no_token_gate = cfg.clone();
        no_token_gate.gate_max_tokens_excess = None;
        let big = vec![
            with_tokens(c(0, 10, Some(0.0), 3), 10_000_000),
            with_tokens(c(1, 0, Some(0.0), 0), 0),
        ];
        let ctx = Context {
            req: &req,
            candidates: &big,
            config: &no_token_gate,
            figures: &Figures::measure(&req, &big),
        };
        let mut kept = vec![0, 1];
        assert_eq!(
            AffinityGateFilter.filter(&ctx, &mut kept),
            Some(Note::AffinityKept)
        );
        for (what, cands, want, note) in cases {
            let ctx = Context {
                req: &req,
                candidates: &cands,
                config: &cfg,
                figures: &Figures::measure(&req, &cands),
            };
            let mut kept: Vec<usize> = (0..cands.len()).collect();
            assert_eq!(AffinityGateFilter.filter(&ctx, &mut kept), note, "{what}");
            assert_eq!(kept, want, "{what}");
        }
    }
}
