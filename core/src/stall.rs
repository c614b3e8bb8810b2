//! Stall detection: a frozen or hung endpoint (SIGSTOPped process, wedged
//! event loop, a node that stopped scheduling it) accepts connections and
//! then answers nothing. Scrapes notice only after `scrape_timeout_ms` x
//! `unhealthy_after_failures` (3 s by default) and Envoy sees nothing at all;
//! meanwhile every request sent there hangs. kvroute sees it sooner in its
//! own in-flight view (requests sent, no response byte) and avoids it.
//!
//! An endpoint `e` is *stalled* at `now` (window `w = failover.stall_after_ms`)
//! when all three hold:
//!
//! ```text
//! 1. no request progress:  inflight(e).waiting > 0
//!                          and now - inflight(e).progress_ms >= w
//!    (requests have waited w for a first byte and none came in that time)
//! 2. no sign of life:      now - states(e).answered_at_ms >= w
//!    (its /metrics has not answered anything for w either)
//! 3. others are fine:      some other pool endpoint o answered a scrape
//!                          within w (now - states(o).answered_at_ms < w)
//! ```
//!
//! Why all three: (1) alone would flag a healthy engine busy with a long
//! prefill, or a long non-streaming generation (its headers come with the
//! last token); such an engine still answers `/metrics`, so (2) keeps it.
//! (3) keeps everything when kvroute itself is the one stuck (its scraper
//! stopped, the host paused): then no endpoint looks alive and none is
//! blamed. A stalled endpoint is treated like an unhealthy one (the health
//! filter drops it unless no healthy endpoint is left); it is a candidate
//! again as soon as it answers a scrape or a request.
//!
//! False positives need a healthy engine whose `/metrics` stays silent for
//! `w` while it holds requests without a first byte for `w`: e.g. a
//! `/metrics` slower than `w` under load. Raise `stall_after_ms` above the
//! slowest `/metrics` answer seen in production (it must stay below
//! `scrape_timeout_ms` x `unhealthy_after_failures` to be worth anything).

use crate::endpoint::Endpoint;
use crate::inflight::InFlight;
use crate::shared::endpoint_state::EndpointStates;

/// Endpoints of `pool` stalled at `now_ms` for window `stall_after_ms`
/// (0 disables: none). `inflight` is kvroute's view of each endpoint.
/// `silence_ms` is the window of conditions 2 and 3: `stall_after_ms`, or
/// more when endpoints are scraped less often than that
/// (`metrics::schedule::silence_after_ms`: a large pool's scrape period).
pub fn stalled(
    pool: &[Endpoint],
    states: &EndpointStates,
    inflight: impl Fn(&Endpoint) -> InFlight,
    now_ms: u64,
    stall_after_ms: u64,
    silence_ms: u64,
) -> Vec<Endpoint> {
    let Some(check) = StallCheck::new(pool.len(), now_ms, stall_after_ms, silence_ms) else {
        return Vec::new();
    };
    let answered = |e: Endpoint| states.get(e).answered_at_ms;
    let suspects: Vec<Endpoint> = pool
        .iter()
        .copied()
        .filter(|&e| check.suspect(&inflight(&e), answered(e)))
        .collect();
    if suspects.is_empty() {
        return suspects;
    }
    let others_alive = pool
        .iter()
        .any(|&o| !suspects.contains(&o) && !check.silent(answered(o)));
    if others_alive {
        suspects
    } else {
        Vec::new()
    }
}

/// The conditions of [`stalled`] one endpoint at a time, for a caller that
/// walks the pool holding each endpoint's in-flight work and scrape state
/// (a decision reads both anyway): an endpoint is stalled when it is a
/// [`StallCheck::suspect`] (conditions 1 and 2) and some endpoint of the
/// pool that is not one is not [`StallCheck::silent`] either (condition 3).
#[derive(Clone, Copy, Debug)]
pub struct StallCheck {
    now_ms: u64,
    stall_after_ms: u64,
    silence_ms: u64,
}

impl StallCheck {
    /// The check at `now_ms` (arguments as for [`stalled`]); `None` when
    /// detection is off (`stall_after_ms` 0) or the pool has fewer than two
    /// endpoints, so that none is ever stalled.
    pub fn new(pool_len: usize, now_ms: u64, stall_after_ms: u64, silence_ms: u64) -> Option<Self> {
        (stall_after_ms > 0 && pool_len >= 2).then_some(StallCheck {
            now_ms,
            stall_after_ms,
            silence_ms: silence_ms.max(stall_after_ms),
        })
    }

    /// Conditions 1 and 2: requests wait for a first byte with no progress
    /// for the window, and the scrapes were silent as long.
    pub fn suspect(&self, inflight: &InFlight, answered_at_ms: u64) -> bool {
        inflight.waiting > 0
            && self.now_ms.saturating_sub(inflight.progress_ms) >= self.stall_after_ms
            && self.silent(answered_at_ms)
    }

    /// No scrape answered within the silence window.
    pub fn silent(&self, answered_at_ms: u64) -> bool {
        self.now_ms.saturating_sub(answered_at_ms) >= self.silence_ms
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::scrape::ScrapeOutcome;
    use crate::metrics::MetricsSnapshot;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    const W: u64 = 500;

    /// (what, scrape answered at per endpoint, (waiting, progress_ms) per
    /// endpoint, endpoints stalled)
    type Case = (&'static str, [u64; 3], [(u32, u64); 3], &'static [u8]);

    fn ep(i: u8) -> Endpoint {
        format!("10.0.0.{i}:8000").parse().unwrap()
    }

    /// A pool of 3 whose scrapes last answered at `answered[i]`, and whose
    /// in-flight view is `(waiting, progress_ms)` per endpoint.
    fn run(answered: [u64; 3], inflight: [(u32, u64); 3], now: u64) -> Vec<u8> {
        let pool: Vec<Endpoint> = (1..=3).map(ep).collect();
        let mut states = EndpointStates::default();
        for (i, at) in answered.iter().enumerate() {
            states.record(
                pool[i],
                ScrapeOutcome::Snapshot(MetricsSnapshot::default().into()),
                *at,
                crate::shared::endpoint_state::FLAP_WINDOW_MS,
            );
        }
        let view = |e: &Endpoint| {
            let i = pool.iter().position(|p| p == e).unwrap();
            InFlight {
                requests: inflight[i].0,
                tokens: 0,
                waiting: inflight[i].0,
                progress_ms: inflight[i].1,
            }
        };
        stalled(&pool, &states, view, now, W, W)
            .into_iter()
            .map(|e| pool.iter().position(|p| *p == e).unwrap() as u8 + 1)
            .collect()
    }

    #[test]
    fn stall_table() {
        let now = 100_000;
        let fresh = now - 40;
        let silent = now - W;
        let cases: &[Case] = &[
            ("all fine", [fresh; 3], [(2, now - 100); 3], &[]),
            (
                "frozen: waited w, no scrape for w",
                [silent, fresh, fresh],
                [(3, now - W), (1, now), (0, 0)],
                &[1],
            ),
            (
                "long prefill: waited long, but /metrics answers",
                [fresh, fresh, fresh],
                [(1, now - 60_000), (0, 0), (0, 0)],
                &[],
            ),
            (
                "silent but nothing waited on (idle or streaming)",
                [silent, fresh, fresh],
                [(0, now - 60_000), (0, 0), (0, 0)],
                &[],
            ),
            (
                "silent, waited on only briefly",
                [silent, fresh, fresh],
                [(2, now - W + 1), (0, 0), (0, 0)],
                &[],
            ),
            (
                "answered a request within w",
                [silent, fresh, fresh],
                [(2, now - 10), (0, 0), (0, 0)],
                &[],
            ),
            (
                "everything silent: kvroute is the one stuck",
                [silent, silent, silent],
                [(2, now - W), (2, now - W), (0, 0)],
                &[],
            ),
            (
                "two frozen, one alive",
                [silent, silent, fresh],
                [(2, now - W), (2, now - W), (0, 0)],
                &[1, 2],
            ),
            (
                "never scraped, waited on",
                [0, fresh, fresh],
                [(1, now - W), (0, 0), (0, 0)],
                &[1],
            ),
        ];
        for (what, answered, inflight, want) in cases {
            assert_eq!(run(*answered, *inflight, now), *want, "{what}");
        }
    }

    #[test]
    fn disabled_or_alone_never_stalls() {
        let pool = [ep(1)];
        let view = |_: &Endpoint| InFlight {
            requests: 5,
            tokens: 0,
            waiting: 5,
            progress_ms: 0,
        };
        let states = EndpointStates::default();
        assert!(stalled(&pool, &states, view, 100_000, W, W).is_empty());
        let pool = [ep(1), ep(2)];
        assert!(stalled(&pool, &states, view, 100_000, 0, W).is_empty());
    }

    #[test]
    fn a_longer_scrape_period_widens_the_silence_window() {
        // A large pool scraped every 400 ms: a healthy endpoint's last answer
        // can be 450 ms old while a long prefill has waited W = 500 ms.
        let pool: Vec<Endpoint> = (1..=3).map(ep).collect();
        let now = 100_000;
        let mut states = EndpointStates::default();
        for (e, at) in pool.iter().zip([now - 520, now - 30, now - 200]) {
            states.record(
                *e,
                ScrapeOutcome::Snapshot(MetricsSnapshot::default().into()),
                at,
                crate::shared::endpoint_state::FLAP_WINDOW_MS,
            );
        }
        let view = |e: &Endpoint| InFlight {
            requests: u32::from(*e == pool[0]),
            tokens: 0,
            waiting: u32::from(*e == pool[0]),
            progress_ms: now - W,
        };
        assert_eq!(
            stalled(&pool, &states, view, now, W, W),
            vec![pool[0]],
            "window w: blamed"
        );
        assert!(
            stalled(&pool, &states, view, now, W, 800).is_empty(),
            "two periods of 400 ms: not yet"
        );
        assert_eq!(
            stalled(&pool, &states, view, now + 300, W, 800),
            vec![pool[0]],
            "silent past it: blamed"
        );
    }
}
