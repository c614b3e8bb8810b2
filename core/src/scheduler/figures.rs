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
//! | `pending_tokens` | kvroute's in-flight prefill tokens there plus this request's uncached ones, `prompt_tokens x (1 - prefix)` | inflight_tokens scorer |
//! | `prefix` | [`prefix_fraction`] | prefix scorer |
//! | `present` | requests there: the engine's count (running and waiting) or kvroute's in flight, the larger | the cost checks' arrival rate (`router/cost.rs`) |

use super::plugin::{effective_queue, prefix_fraction};
use super::scorer::kv_cache::free_share;
use super::{Candidate, RequestFacts};
use crate::float::max_num;

/// Per-candidate figures, one column each (same index as the candidates).
/// The number columns lie one after another in one allocation (a decision
/// over a few endpoints paid more for eight allocations than for the
/// figures).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Figures {
    healthy: Vec<bool>,
    /// `COLUMNS` columns of `healthy.len()` each, in the accessors' order.
    values: Vec<f64>,
}

/// Number columns.
const COLUMNS: usize = 7;

impl Figures {
    /// Measures every candidate for `req`.
    pub fn measure(req: &RequestFacts, candidates: &[Candidate]) -> Figures {
        let n = candidates.len();
        let mut f = Figures {
            healthy: vec![false; n],
            values: vec![0.0; COLUMNS * n],
        };
        let (matched, rest) = f.values.split_at_mut(n);
        let (queue, rest) = rest.split_at_mut(n);
        let (kv_free, rest) = rest.split_at_mut(n);
        let (inflight_requests, rest) = rest.split_at_mut(n);
        let (pending_tokens, rest) = rest.split_at_mut(n);
        let (prefix, present) = rest.split_at_mut(n);
        // Zipped slices: no bounds check per entry.
        let rows = f.healthy.iter_mut().zip(matched).zip(queue);
        let rows = rows.zip(kv_free.iter_mut().zip(inflight_requests));
        let rows = rows.zip(pending_tokens.iter_mut().zip(prefix));
        let rows = rows.zip(present);
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
            // This request's uncached tokens: the unmatched share of them.
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

    /// Not believed down.
    pub fn healthy(&self) -> &[bool] {
        &self.healthy
    }

    /// Matched blocks, the partial block included.
    pub fn matched(&self) -> &[f64] {
        self.column(0)
    }

    /// Effective queue (waiting plus kvroute's excess), NaN when unknown.
    pub fn queue(&self) -> &[f64] {
        self.column(1)
    }

    /// Free share of the KV cache, 0..1 (neutral when unknown).
    pub fn kv_free(&self) -> &[f64] {
        self.column(2)
    }

    /// kvroute's requests in flight.
    pub fn inflight_requests(&self) -> &[f64] {
        self.column(3)
    }

    /// kvroute's in-flight prefill tokens plus this request's uncached ones.
    pub fn pending_tokens(&self) -> &[f64] {
        self.column(4)
    }

    /// Share of the request the candidate holds, 0..1.
    pub fn prefix(&self) -> &[f64] {
        self.column(5)
    }

    /// Requests there: the engine's count or kvroute's, the larger.
    pub fn present(&self) -> &[f64] {
        self.column(6)
    }

    fn column(&self, k: usize) -> &[f64] {
        let n = self.healthy.len();
        self.values.get(k * n..(k + 1) * n).unwrap_or_default()
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
    use crate::scheduler::plugin::NEUTRAL;
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
        let f = Figures::measure(&req, &[a, b]);
        assert_eq!(f.len(), 2);
        assert_eq!(f.healthy(), [true, false]);
        assert_eq!(f.matched(), [4.5, 0.0]);
        // a: 2 waiting + (5 - 3) sent since the scrape.
        assert_eq!(f.queue()[0], 4.0);
        assert!(f.queue()[1].is_nan());
        assert_eq!(f.kv_free(), [0.75, NEUTRAL]);
        assert_eq!(f.inflight_requests(), [5.0, 0.0]);
        assert_eq!(f.pending_tokens(), [300.0 + 550.0, 1000.0]);
        assert_eq!(f.prefix(), [0.45, 0.0]);
        // a: the engine counted 3, kvroute has 5 there; b: no snapshot.
        assert_eq!(f.present(), [5.0, 0.0]);
    }

    #[test]
    fn kept_entries_are_the_kept_ones_in_order() {
        let column = [1.0, 2.0, 3.0, 4.0];
        let mut scratch = vec![9.0];
        assert_eq!(kept_entries(&column, &[0, 1, 2, 3], &mut scratch), column);
        assert_eq!(kept_entries(&column, &[1, 3], &mut scratch), [2.0, 4.0]);
    }
}
