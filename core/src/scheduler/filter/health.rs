//! # health filter
//!
//! **What**: drops candidates believed down (`Candidate::healthy == false`:
//! their scrapes keep failing, see `metrics.unhealthy_after_failures`).
//!
//! **Formula**: keep `{ c | c.healthy }`; if that is empty, keep all
//! candidates and note [`Note::Fallback`] (the decision's reason becomes
//! `Fallback`): routing somewhere beats failing the request, and a scrape
//! outage (e.g. a wrong `metrics.path`) must not take the pool down.
//!
//! **Inputs**: `healthy` (its column in `figures.rs`). **Config**: none (the threshold lives in
//! `metrics`). **Operational notes**: a stale-but-answering endpoint stays a
//! candidate; it only loses its snapshot-based scores (see the scorers'
//! neutral value). Count `Fallback` decisions: a non-zero rate means
//! kvroute is routing blind.

use super::super::plugin::{Context, Filter, Note};

/// Keeps healthy candidates (all of them if none is healthy).
#[derive(Clone, Copy, Debug, Default)]
pub struct HealthFilter;

impl Filter for HealthFilter {
    fn name(&self) -> &'static str {
        "health"
    }

    fn filter(&self, ctx: &Context, kept: &mut Vec<usize>) -> Option<Note> {
        // Counted first: in the usual case every candidate is healthy and
        // there is nothing to retain.
        let healthy = ctx.figures.healthy();
        let count = match kept.len() == healthy.len() {
            true => healthy.iter().filter(|&&h| h).count(),
            false => kept.iter().filter(|&&i| healthy[i]).count(),
        };
        if count == 0 {
            return Some(Note::Fallback);
        }
        if count < kept.len() {
            kept.retain(|&i| healthy[i]);
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::SchedulingConfig;
    use crate::scheduler::figures::Figures;
    use crate::scheduler::test_support::cand;
    use crate::scheduler::RequestFacts;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn health_table() {
        let cases: &[(&[bool], &[usize], Option<Note>)] = &[
            (&[true, false, true], &[0, 2], None),
            (&[false, true], &[1], None),
            (&[false, false], &[0, 1], Some(Note::Fallback)),
            (&[true], &[0], None),
        ];
        let cfg = SchedulingConfig::default();
        let req = RequestFacts::default();
        for (health, want, note) in cases {
            let cands: Vec<_> = health
                .iter()
                .enumerate()
                .map(|(i, &h)| {
                    let mut c = cand(i);
                    c.healthy = h;
                    c
                })
                .collect();
            let ctx = Context {
                req: &req,
                candidates: &cands,
                config: &cfg,
                figures: &Figures::measure(&req, &cands),
            };
            let mut kept: Vec<usize> = (0..cands.len()).collect();
            assert_eq!(HealthFilter.filter(&ctx, &mut kept), *note, "{health:?}");
            assert_eq!(&kept[..], *want, "{health:?}");
        }
    }
}
