//! The figures the plugins read of each candidate, measured once per
//! decision in one pass over the candidates: one column per figure, in
//! candidate order.
//!
//! A filter or scorer that read its figure from the candidates itself made
//! a pass of its own over them, each a strided walk over every
//! candidate's 144 bytes that re-derived the same queue and prefix share;
//! at 1024 endpoints the candidates do not fit in a core's L1 cache. A
//! column is 8 bytes a candidate (1 for `healthy`), read in order, and a
//! scorer that names its column (`Scorer::figure`) is scaled, weighted and
//! summed from it in one loop (`Scale::add_weighted`).
//!
//! | column | figure | read by |
//! |---|---|---|
//! | `healthy` | [`Candidate::healthy`] | health filter, the picker's reason |
//! | `matched` | [`Candidate::matched`] | the picker's reason |
//! | `queue` | [`effective_queue`], NaN without a fresh snapshot | overload filter, queue scorer |
//! | `kv_free` | [`free_share`] of the snapshot's KV-cache usage | kv_cache scorer |
//! | `inflight_requests` | kvroute's requests in flight there | inflight_requests scorer |
//! | `pending_tokens` | kvroute's in-flight prefill tokens there plus this request's [`uncached_tokens`](super::plugin::uncached_tokens) | inflight_tokens scorer |
//! | `prefix` | [`prefix_fraction`] | prefix scorer |
//! | `present` | requests there: the engine's count (running and waiting) or kvroute's in flight, the larger | the cost checks' arrival rate (`router/cost.rs`) |

use super::plugin::{effective_queue, prefix_fraction};
use super::scorer::kv_cache::free_share;
use super::{Candidate, RequestFacts};
use crate::float::max_num;

/// Per-candidate figures, one column each (same index as the candidates).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Figures {
    /// Not believed down.
    pub healthy: Vec<bool>,
    /// Matched blocks, the partial block included.
    pub matched: Vec<f64>,
    /// Effective queue (waiting plus kvroute's excess), NaN when unknown.
    pub queue: Vec<f64>,
    /// Free share of the KV cache, 0..1 (neutral when unknown).
    pub kv_free: Vec<f64>,
    /// kvroute's requests in flight.
    pub inflight_requests: Vec<f64>,
    /// kvroute's in-flight prefill tokens plus this request's uncached ones.
    pub pending_tokens: Vec<f64>,
    /// Share of the request the candidate holds, 0..1.
    pub prefix: Vec<f64>,
    /// Requests there: the engine's count or kvroute's, the larger.
    pub present: Vec<f64>,
}

impl Figures {
    /// Measures every candidate for `req`.
    pub fn measure(req: &RequestFacts, candidates: &[Candidate]) -> Figures {
        let n = candidates.len();
        let mut f = Figures {
            healthy: vec![false; n],
            matched: vec![0.0; n],
            queue: vec![0.0; n],
            kv_free: vec![0.0; n],
            inflight_requests: vec![0.0; n],
            pending_tokens: vec![0.0; n],
            prefix: vec![0.0; n],
            present: vec![0.0; n],
        };
        // Zipped slices: no capacity or bounds check per entry (a push to
        // each of seven columns cost more than the figures).
        let rows = f.healthy.iter_mut().zip(&mut f.matched).zip(&mut f.queue);
        let rows = rows.zip(f.kv_free.iter_mut().zip(&mut f.inflight_requests));
        let rows = rows.zip(f.pending_tokens.iter_mut().zip(&mut f.prefix));
        let rows = rows.zip(&mut f.present);
        let prompt_tokens = req.prompt_tokens as f64;
        for (c, row) in candidates.iter().zip(rows) {
            let (((((healthy, matched), queue), (kv_free, requests)), (pending, prefix)), present) =
                row;
            let share = prefix_fraction(req, c);
            *healthy = c.healthy;
            *matched = c.matched();
            *queue = effective_queue(c).unwrap_or(f64::NAN);
            *kv_free = free_share(c.snapshot.as_ref().and_then(|s| s.kv_usage));
            *requests = f64::from(c.inflight.requests);
            // `uncached_tokens`, the share computed once.
            *pending = c.inflight.tokens as f64 + prompt_tokens * (1.0 - share);
            *prefix = share;
            let engine = c.snapshot.map_or(0.0, |s| s.running + s.waiting);
            *present = max_num(engine, f64::from(c.inflight.requests));
        }
        f
    }

    /// Candidates measured.
    pub fn len(&self) -> usize {
        self.healthy.len()
    }

    /// True when no candidate was measured.
    pub fn is_empty(&self) -> bool {
        self.healthy.is_empty()
    }
}

/// `column`'s entries for `kept`, in order: the column itself when every
/// candidate is kept (`kept` only ever loses entries, so it is then
/// `0..n`), else gathered into `scratch`.
#[inline]
pub fn kept_entries<'a>(column: &'a [f64], kept: &[usize], scratch: &'a mut Vec<f64>) -> &'a [f64] {
    if kept.len() == column.len() {
        debug_assert!(kept.iter().enumerate().all(|(k, &i)| k == i));
        return column;
    }
    scratch.clear();
    scratch.extend(kept.iter().map(|&i| column[i]));
    scratch
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::MetricsSnapshot;
    use crate::scheduler::plugin::{uncached_tokens, NEUTRAL};
    use crate::scheduler::test_support::cand;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn each_column_is_its_figure_of_each_candidate() {
        let req = RequestFacts {
            total_blocks: 10,
            prompt_tokens: 1000,
            ..RequestFacts::default()
        };
        let mut a = cand(0);
        a.snapshot = Some(MetricsSnapshot {
            waiting: 2.0,
            running: 1.0,
            kv_usage: Some(0.25),
            kv_capacity_tokens: None,
        });
        a.inflight.requests = 5;
        a.inflight.tokens = 300;
        a.matched_blocks = 4;
        a.partial_block = 0.5;
        let mut b = cand(1);
        b.snapshot = None;
        b.healthy = false;
        let f = Figures::measure(&req, &[a.clone(), b.clone()]);
        assert_eq!(f.len(), 2);
        assert_eq!(f.healthy, [true, false]);
        assert_eq!(f.matched, [4.5, 0.0]);
        // a: 2 waiting + (5 - 3) sent since the scrape.
        assert_eq!(f.queue[0], 4.0);
        assert!(f.queue[1].is_nan());
        assert_eq!(f.kv_free, [0.75, NEUTRAL]);
        assert_eq!(f.inflight_requests, [5.0, 0.0]);
        let pending = |c: &Candidate| c.inflight.tokens as f64 + uncached_tokens(&req, c);
        assert_eq!(f.pending_tokens, [pending(&a), pending(&b)]);
        assert_eq!(f.pending_tokens, [300.0 + 550.0, 1000.0]);
        assert_eq!(f.prefix, [0.45, 0.0]);
        // a: the engine counted 3, kvroute has 5 there; b: no snapshot.
        assert_eq!(f.present, [5.0, 0.0]);
    }

    #[test]
    fn kept_entries_are_the_kept_ones_in_order() {
        let column = [1.0, 2.0, 3.0, 4.0];
        let mut scratch = vec![9.0];
        assert_eq!(kept_entries(&column, &[0, 1, 2, 3], &mut scratch), column);
        assert_eq!(kept_entries(&column, &[1, 3], &mut scratch), [2.0, 4.0]);
    }
}
