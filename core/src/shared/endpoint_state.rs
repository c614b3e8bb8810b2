//! What the scraper learned about every endpoint, as one shared-data value
//! all workers read on their tick: the latest snapshot, when it was taken,
//! and how many scrapes in a row have failed (the health signal).

use crate::endpoint::Endpoint;
use crate::metrics::scrape::ScrapeOutcome;
use crate::metrics::MetricsSnapshot;
use serde::{Deserialize, Serialize};

/// Scrape state of one endpoint.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ScrapeState {
    /// Latest successfully read snapshot.
    pub snapshot: Option<MetricsSnapshot>,
    /// When `snapshot` was taken (wall-clock ms).
    pub scraped_at_ms: u64,
    /// Failed scrapes since the last success.
    pub failures: u32,
    /// When a scrape was last answered at all (readable or not, wall-clock
    /// ms): the endpoint's process is alive (stall detection reads it).
    #[serde(default)]
    pub answered_at_ms: u64,
}

impl ScrapeState {
    /// The snapshot if it is younger than `stale_after_ms` at `now_ms`.
    pub fn fresh(&self, now_ms: u64, stale_after_ms: u64) -> Option<MetricsSnapshot> {
        let age = now_ms.saturating_sub(self.scraped_at_ms);
        self.snapshot.filter(|_| age < stale_after_ms)
    }

    /// Healthy unless `threshold` or more scrapes in a row failed.
    pub fn healthy(&self, threshold: u32) -> bool {
        self.failures < threshold
    }
}

/// Scrape state of the whole pool, keyed by endpoint.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct EndpointStates {
    /// One entry per endpoint ever scraped and still in the pool, sorted by
    /// endpoint (lookups are binary searches: a decision reads every
    /// endpoint's state, so a linear search made it quadratic in the pool).
    pub entries: Vec<(Endpoint, ScrapeState)>,
}

impl EndpointStates {
    /// The state of `endpoint` (default when never scraped).
    pub fn get(&self, endpoint: Endpoint) -> ScrapeState {
        match self.entries.binary_search_by(|(e, _)| e.cmp(&endpoint)) {
            Ok(i) => self.entries[i].1.clone(),
            Err(_) => ScrapeState::default(),
        }
    }

    /// The state of each endpoint of `pool` (sorted, as `Router::pool`), in
    /// its order: one merge pass over both sorted lists.
    pub fn aligned(&self, pool: &[Endpoint]) -> Vec<ScrapeState> {
        let mut entries = self.entries.iter().peekable();
        pool.iter()
            .map(|e| {
                while entries.next_if(|(x, _)| x < e).is_some() {}
                match entries.peek() {
                    Some((x, s)) if x == e => s.clone(),
                    _ => ScrapeState::default(),
                }
            })
            .collect()
    }

    /// Records a successful scrape.
    pub fn succeed(&mut self, endpoint: Endpoint, snapshot: MetricsSnapshot, now_ms: u64) {
        let s = self.entry(endpoint);
        s.snapshot = Some(snapshot);
        s.scraped_at_ms = now_ms;
        s.answered_at_ms = now_ms;
        s.failures = 0;
    }

    /// Records a scrape the endpoint answered without readable metrics: it
    /// is reachable (the failure streak ends) but its snapshot is not renewed.
    pub fn reachable(&mut self, endpoint: Endpoint, now_ms: u64) {
        let s = self.entry(endpoint);
        s.failures = 0;
        s.answered_at_ms = now_ms;
    }

    /// Envoy could not get an answer from the endpoint for a request (connect
    /// failure, reset or timeout before any response byte): it counts as
    /// `threshold` failed scrapes, so it leaves the candidate set at once and
    /// comes back with the next scrape it answers. Returns whether it was a
    /// candidate before (a change).
    pub fn unreachable(&mut self, endpoint: Endpoint, threshold: u32) -> bool {
        let s = self.entry(endpoint);
        let was = s.failures < threshold;
        s.failures = s.failures.max(threshold);
        was
    }

    /// Records one scrape's outcome.
    pub fn record(&mut self, endpoint: Endpoint, outcome: ScrapeOutcome, now_ms: u64) {
        match outcome {
            ScrapeOutcome::Snapshot(s) => self.succeed(endpoint, s, now_ms),
            ScrapeOutcome::Unreadable => self.reachable(endpoint, now_ms),
            ScrapeOutcome::Unreachable => {
                self.fail(endpoint);
            }
        }
    }

    /// Records a failed scrape; returns the failure streak.
    pub fn fail(&mut self, endpoint: Endpoint) -> u32 {
        let s = self.entry(endpoint);
        s.failures = s.failures.saturating_add(1);
        s.failures
    }

    /// Drops endpoints that left the pool (keeps the value bounded).
    pub fn retain(&mut self, pool: &[Endpoint]) {
        let members: hashbrown::HashSet<&Endpoint> = pool.iter().collect();
        self.entries.retain(|(e, _)| members.contains(e));
    }

    fn entry(&mut self, endpoint: Endpoint) -> &mut ScrapeState {
        let i = match self.entries.binary_search_by(|(e, _)| e.cmp(&endpoint)) {
            Ok(i) => i,
            Err(i) => {
                self.entries.insert(i, (endpoint, ScrapeState::default()));
                i
            }
        };
        &mut self.entries[i].1
    }

    /// JSON encoding (small: one entry per endpoint).
    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// Decodes [`EndpointStates::encode`]'s output; garbage gives `None`.
    pub fn decode(bytes: &[u8]) -> Option<EndpointStates> {
        let mut states: EndpointStates = serde_json::from_slice(bytes).ok()?;
        // Written sorted; a value from an older build may not be.
        states.entries.sort_by_key(|e| e.0);
        states.entries.dedup_by(|a, b| a.0 == b.0);
        Some(states)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn ep(s: &str) -> Endpoint {
        s.parse().unwrap()
    }

    #[test]
    fn aligned_matches_get_for_every_pool_member() {
        let mut t = EndpointStates::default();
        for (i, e) in ["10.0.0.9:80", "10.0.0.1:80", "[::1]:80", "10.0.0.5:80"]
            .iter()
            .enumerate()
        {
            t.succeed(ep(e), MetricsSnapshot::default(), i as u64 + 1);
        }
        let mut pool: Vec<Endpoint> = [
            "10.0.0.1:80",
            "10.0.0.2:80",
            "10.0.0.9:80",
            "[::1]:80",
            "[::2]:80",
        ]
        .iter()
        .map(|e| ep(e))
        .collect();
        pool.sort();
        let want: Vec<ScrapeState> = pool.iter().map(|e| t.get(*e)).collect();
        assert_eq!(t.aligned(&pool), want);
        assert_eq!(t.aligned(&[]), vec![]);
    }

    #[test]
    fn success_failure_freshness_and_health() {
        let mut t = EndpointStates::default();
        let a = ep("10.0.0.1:8000");
        let snap = MetricsSnapshot {
            waiting: 3.0,
            ..Default::default()
        };
        t.succeed(a, snap, 1_000);
        assert_eq!(t.get(a).fresh(2_999, 2_000), Some(snap));
        assert_eq!(t.get(a).fresh(3_000, 2_000), None);
        assert!(t.get(a).healthy(3));
        assert_eq!(t.fail(a), 1);
        assert_eq!(t.fail(a), 2);
        assert!(t.get(a).healthy(3));
        assert_eq!(t.fail(a), 3);
        assert!(!t.get(a).healthy(3));
        t.succeed(a, snap, 5_000);
        assert!(t.get(a).healthy(3));
        // never scraped: healthy, no snapshot
        assert!(t.get(ep("10.0.0.2:8000")).healthy(3));
        assert_eq!(t.get(ep("10.0.0.2:8000")).snapshot, None);
    }

    #[test]
    fn unreadable_scrapes_keep_an_endpoint_healthy_but_stale() {
        let mut t = EndpointStates::default();
        let a = ep("10.0.0.1:8000");
        t.record(
            a,
            ScrapeOutcome::Snapshot(MetricsSnapshot::default()),
            1_000,
        );
        for _ in 0..5 {
            t.record(a, ScrapeOutcome::Unreachable, 1_050);
        }
        assert!(!t.get(a).healthy(3));
        t.record(a, ScrapeOutcome::Unreadable, 1_100);
        assert!(t.get(a).healthy(3));
        assert_eq!(t.get(a).scraped_at_ms, 1_000);
        assert_eq!(t.get(a).fresh(3_500, 2_000), None);
    }

    #[test]
    fn an_unanswered_request_makes_an_endpoint_unhealthy_until_a_scrape_answers() {
        let mut t = EndpointStates::default();
        let a = ep("10.0.0.1:8000");
        t.record(
            a,
            ScrapeOutcome::Snapshot(MetricsSnapshot::default()),
            1_000,
        );
        assert_eq!(t.get(a).answered_at_ms, 1_000);
        assert!(t.unreachable(a, 3), "was a candidate");
        assert!(!t.get(a).healthy(3));
        assert!(!t.unreachable(a, 3), "no change the second time");
        t.record(a, ScrapeOutcome::Unreachable, 1_050);
        assert_eq!(t.get(a).failures, 4);
        t.record(a, ScrapeOutcome::Unreadable, 1_100);
        assert!(t.get(a).healthy(3));
        assert_eq!(t.get(a).answered_at_ms, 1_100);
        // an old encoding without answered_at_ms still decodes
        let old =
            br#"{"entries":[["10.0.0.1:8000",{"snapshot":null,"scraped_at_ms":5,"failures":1}]]}"#;
        assert_eq!(
            EndpointStates::decode(old).unwrap().get(a).answered_at_ms,
            0
        );
    }

    #[test]
    fn codec_and_retain() {
        let mut t = EndpointStates::default();
        t.fail(ep("10.0.0.1:8000"));
        t.succeed(ep("[::1]:9000"), MetricsSnapshot::default(), 7);
        let back = EndpointStates::decode(&t.encode()).unwrap();
        assert_eq!(back, t);
        assert_eq!(EndpointStates::decode(b"\xff garbage"), None);
        t.retain(&[ep("[::1]:9000")]);
        assert_eq!(t.entries.len(), 1);
    }
}
