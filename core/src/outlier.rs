//! Passive health: endpoints that keep answering inference requests with
//! 5xx leave the candidate set for a while, even though their `/metrics`
//! still answers.
//!
//! Why it exists: scrapes only prove that a server is reachable. A model
//! server whose engine died (CUDA error, OOM, a wedged worker) often still
//! serves `/metrics` and answers every request with a fast 500. To a
//! load-aware router such a pod looks *idle* (its requests finish at once),
//! so without this it would attract ever more traffic: a black hole. The
//! ORIGINAL_DST handoff has no Envoy outlier detection to fall back on, so
//! kvroute does it itself, with Envoy's `consecutive_5xx` semantics:
//!
//! ```text
//! response 5xx:  streak += 1; streak >= consecutive_errors and at most
//!                max_ejection_percent of the pool out  =>  ejected for
//!                min(base_ejection_ms x ejections, max_ejection_ms)
//! other status:  streak = 0, ejections = 0
//! ejection over: the endpoint is a candidate again (streak starts at 0)
//! ```
//!
//! An ejected endpoint is treated like one whose scrapes fail: the health
//! filter drops it, unless no healthy candidate is left (then all are kept).
//! The table lives in one shared-data key every worker updates with CAS,
//! so the streak counts failures seen by all workers.

use crate::config::OutlierConfig;
use crate::endpoint::Endpoint;
use crate::sorted_lookup::SortedLookup;
use serde::{Deserialize, Serialize};

/// Passive-health state of one endpoint.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct OutlierState {
    /// 5xx responses in a row (across all workers).
    pub streak: u32,
    /// Ejections in a row without a success in between.
    pub ejections: u32,
    /// Ejected until this wall-clock time (ms); 0 when never ejected.
    pub ejected_until_ms: u64,
}

impl OutlierState {
    /// True while ejected at `now_ms`.
    pub fn ejected(&self, now_ms: u64) -> bool {
        now_ms < self.ejected_until_ms
    }
}

/// What a response says about its endpoint's health.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Answered (any status below 500: the server works).
    Success,
    /// A 5xx: from the server, or Envoy's own 503 when it could not connect.
    Failure,
}

impl Outcome {
    /// Classifies an HTTP status code.
    pub fn from_status(status: u16) -> Outcome {
        if (500..600).contains(&status) {
            Outcome::Failure
        } else {
            Outcome::Success
        }
    }
}

/// Passive-health state of the pool (only endpoints with a streak or an
/// ejection are stored; sorted by endpoint).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct OutlierTable {
    entries: Vec<(Endpoint, OutlierState)>,
}

impl OutlierTable {
    /// State of `endpoint` (default when unknown).
    pub fn get(&self, endpoint: Endpoint) -> OutlierState {
        match self.entries.binary_search_by(|(e, _)| e.cmp(&endpoint)) {
            Ok(i) => self.entries[i].1,
            Err(_) => OutlierState::default(),
        }
    }

    /// True when `endpoint` is ejected at `now_ms`.
    pub fn ejected(&self, endpoint: Endpoint, now_ms: u64) -> bool {
        self.get(endpoint).ejected(now_ms)
    }

    /// [`Self::get`] for a walk over endpoints in ascending order (a
    /// decision's walk over the pool): each lookup resumes where the last
    /// one stopped (`sorted_lookup`) instead of a binary search per
    /// endpoint; any order is still answered right.
    pub fn lookup(&self) -> impl Fn(&Endpoint) -> OutlierState + '_ {
        let cursor = SortedLookup::new(&self.entries, |(e, _)| e);
        move |e| {
            cursor
                .get(e)
                .map_or_else(OutlierState::default, |(_, s)| *s)
        }
    }

    /// [`Self::ejected`] at `now_ms` for the same walk as [`Self::lookup`]:
    /// with no endpoint tracked (the usual case), no lookup at all.
    pub fn ejections(&self, now_ms: u64) -> impl Fn(&Endpoint) -> bool + '_ {
        let lookup = self.lookup();
        let none = self.entries.is_empty();
        move |e| !none && lookup(e).ejected(now_ms)
    }

    /// Endpoints ejected at `now_ms`.
    pub fn ejected_count(&self, now_ms: u64) -> usize {
        self.entries
            .iter()
            .filter(|(_, s)| s.ejected(now_ms))
            .count()
    }

    /// Whether recording `outcome` for `endpoint` could change the table:
    /// never when passive health is off, and a success on an endpoint with
    /// no streak and no ejection history is a no-op. Lets the shell skip the
    /// shared-data write on the hot path.
    pub fn changes(&self, endpoint: Endpoint, outcome: Outcome, config: &OutlierConfig) -> bool {
        config.consecutive_errors > 0
            && (outcome == Outcome::Failure || self.get(endpoint) != OutlierState::default())
    }

    /// Records one response of `endpoint` at `now_ms` in a pool of
    /// `pool_size`; returns the end of the ejection it started, if any.
    pub fn record(
        &mut self,
        endpoint: Endpoint,
        outcome: Outcome,
        now_ms: u64,
        pool_size: usize,
        config: &OutlierConfig,
    ) -> Option<u64> {
        if config.consecutive_errors == 0 {
            return None;
        }
        let ejected_now = self.ejected_count(now_ms);
        let i = match self.entries.binary_search_by(|(e, _)| e.cmp(&endpoint)) {
            Ok(i) => i,
            Err(i) => {
                self.entries.insert(i, (endpoint, OutlierState::default()));
                i
            }
        };
        let s = &mut self.entries[i].1;
        let mut started = None;
        match outcome {
            Outcome::Success => {
                s.streak = 0;
                s.ejections = 0;
            }
            Outcome::Failure if s.ejected(now_ms) => {} // in-flight stragglers
            Outcome::Failure => {
                s.streak = s.streak.saturating_add(1);
                let room =
                    (ejected_now + 1) * 100 <= config.max_ejection_percent as usize * pool_size;
                if s.streak >= config.consecutive_errors && room {
                    s.ejections = s.ejections.saturating_add(1);
                    let ms = config
                        .base_ejection_ms
                        .saturating_mul(u64::from(s.ejections))
                        .min(config.max_ejection_ms);
                    s.ejected_until_ms = now_ms.saturating_add(ms);
                    s.streak = 0;
                    started = Some(s.ejected_until_ms);
                }
            }
        }
        if self.entries[i].1 == OutlierState::default() {
            self.entries.remove(i);
        }
        started
    }

    /// Drops endpoints that left the pool (keeps the value bounded).
    pub fn retain(&mut self, pool: &[Endpoint]) {
        self.entries.retain(|(e, _)| pool.contains(e));
    }

    /// JSON encoding (small: only endpoints with a streak or an ejection).
    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// Decodes [`OutlierTable::encode`]'s output; garbage gives `None`, and
    /// an unsorted table is sorted (lookups binary-search).
    pub fn decode(bytes: &[u8]) -> Option<OutlierTable> {
        let mut t: OutlierTable = serde_json::from_slice(bytes).ok()?;
        t.entries.sort_by_key(|a| a.0);
        t.entries.dedup_by(|a, b| a.0 == b.0);
        Some(t)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn ep(i: u8) -> Endpoint {
        format!("10.0.0.{i}:8000").parse().unwrap()
    }

    fn cfg() -> OutlierConfig {
        OutlierConfig {
            consecutive_errors: 3,
            base_ejection_ms: 1_000,
            max_ejection_ms: 2_500,
            max_ejection_percent: 50,
        }
    }

    #[test]
    fn a_lookup_answers_what_get_answers_in_any_order() {
        let mut rng = fastrand::Rng::with_seed(6);
        for round in 0..300 {
            let mut t = OutlierTable::default();
            for _ in 0..rng.usize(0..30) {
                let outcome = if rng.u8(0..4) == 0 {
                    Outcome::Success
                } else {
                    Outcome::Failure
                };
                t.record(ep(rng.u8(1..40)), outcome, rng.u64(0..5_000), 40, &cfg());
            }
            let mut walk: Vec<Endpoint> =
                (0..rng.usize(0..50)).map(|_| ep(rng.u8(1..40))).collect();
            // Mostly ascending walks (a decision's), sometimes any order.
            if rng.u8(0..4) != 0 {
                walk.sort_unstable();
            }
            let lookup = t.lookup();
            let now = rng.u64(0..5_000);
            let ejected = t.ejections(now);
            for e in &walk {
                assert_eq!(lookup(e), t.get(*e), "round {round}: {e} in {t:?}");
                assert_eq!(ejected(e), t.ejected(*e, now), "round {round}: {e}");
            }
        }
    }

    #[test]
    fn status_classes() {
        assert_eq!(Outcome::from_status(200), Outcome::Success);
        assert_eq!(Outcome::from_status(429), Outcome::Success);
        assert_eq!(Outcome::from_status(499), Outcome::Success);
        assert_eq!(Outcome::from_status(500), Outcome::Failure);
        assert_eq!(Outcome::from_status(503), Outcome::Failure);
        assert_eq!(Outcome::from_status(599), Outcome::Failure);
    }

    #[test]
    fn consecutive_failures_eject_and_the_ejection_expires() {
        let (mut t, c) = (OutlierTable::default(), cfg());
        assert_eq!(t.record(ep(1), Outcome::Failure, 0, 4, &c), None);
        assert_eq!(t.record(ep(1), Outcome::Failure, 1, 4, &c), None);
        assert!(!t.ejected(ep(1), 2));
        assert_eq!(t.record(ep(1), Outcome::Failure, 2, 4, &c), Some(1_002));
        assert!(t.ejected(ep(1), 1_001));
        assert!(!t.ejected(ep(1), 1_002));
        assert!(!t.ejected(ep(2), 500));
    }

    #[test]
    fn a_success_breaks_the_streak_and_resets_the_backoff() {
        let (mut t, c) = (OutlierTable::default(), cfg());
        for now in 0..2 {
            t.record(ep(1), Outcome::Failure, now, 4, &c);
        }
        t.record(ep(1), Outcome::Success, 2, 4, &c);
        assert_eq!(t.record(ep(1), Outcome::Failure, 3, 4, &c), None);
        assert_eq!(t.get(ep(1)).streak, 1);
        // back to nothing stored after a success
        t.record(ep(1), Outcome::Success, 4, 4, &c);
        assert_eq!(t, OutlierTable::default());
        assert!(!t.changes(ep(1), Outcome::Success, &c));
        assert!(t.changes(ep(1), Outcome::Failure, &c));
    }

    #[test]
    fn repeated_ejections_back_off_up_to_the_cap() {
        let (mut t, c) = (OutlierTable::default(), cfg());
        let mut now = 0;
        let mut lengths = Vec::new();
        for _ in 0..4 {
            let until = (0..3)
                .filter_map(|_| t.record(ep(1), Outcome::Failure, now, 4, &c))
                .last()
                .unwrap();
            lengths.push(until - now);
            // failures while ejected (stragglers) change nothing
            assert_eq!(t.record(ep(1), Outcome::Failure, now + 1, 4, &c), None);
            now = until;
        }
        assert_eq!(lengths, vec![1_000, 2_000, 2_500, 2_500]);
        assert!(t.changes(ep(1), Outcome::Success, &c));
    }

    #[test]
    fn never_ejects_more_than_the_allowed_share_of_the_pool() {
        let (mut t, c) = (OutlierTable::default(), cfg());
        for i in 1..=4 {
            for _ in 0..3 {
                t.record(ep(i), Outcome::Failure, 10, 4, &c);
            }
        }
        assert_eq!(t.ejected_count(10), 2, "50% of 4");
        // a pool of one is never emptied
        let mut one = OutlierTable::default();
        for _ in 0..5 {
            one.record(ep(1), Outcome::Failure, 0, 1, &c);
        }
        assert!(!one.ejected(ep(1), 0));
    }

    #[test]
    fn disabled_records_nothing() {
        let mut c = cfg();
        c.consecutive_errors = 0;
        let mut t = OutlierTable::default();
        assert!(!t.changes(ep(1), Outcome::Failure, &c), "no shared write");
        for _ in 0..10 {
            assert_eq!(t.record(ep(1), Outcome::Failure, 0, 4, &c), None);
        }
        assert_eq!(t, OutlierTable::default());
    }

    #[test]
    fn encoding_round_trips_and_garbage_is_refused() {
        let (mut t, c) = (OutlierTable::default(), cfg());
        for i in [3, 1, 2] {
            t.record(ep(i), Outcome::Failure, 0, 4, &c);
        }
        t.retain(&[ep(1), ep(3)]);
        let back = OutlierTable::decode(&t.encode()).unwrap();
        assert_eq!(back, t);
        assert_eq!(back.get(ep(3)).streak, 1);
        assert_eq!(back.get(ep(2)).streak, 0);
        assert_eq!(OutlierTable::decode(b"\xff{"), None);
        assert_eq!(OutlierTable::decode(b"{\"entries\":7}"), None);
    }
}
