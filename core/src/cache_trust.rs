//! Whether each engine keeps the prompts kvroute sends it
//! (`prefix.verify_engine_cache`).
//!
//! kvroute's prefix index says an endpoint holds a prompt's blocks because
//! kvroute sent them there. The engine may not have kept them: prefix
//! caching off (vLLM's `--no-enable-prefix-caching`, or a model it does not
//! support it for), a cache too small for the prompts, other tenants
//! evicting them at once. Affinity to such an endpoint saves nothing and
//! piles load on it. vLLM, SGLang and llama.cpp count the prompt tokens
//! they served from their cache (`prefix_hits_total`, `metrics::profile`;
//! llama.cpp's `llama-server --no-cache-prompt` keeps its count at 0, as
//! vLLM's `--no-enable-prefix-caching` does); each worker
//! compares that counter's growth with what its own requests to the
//! endpoint believed cached:
//!
//! ```text
//! believed = index blocks the chosen endpoint held x prefix.block_tokens,
//!            summed over this worker's requests it answered in full (2xx)
//! hits     = growth of the engine's counter over the same window
//! window   = closes once believed >= MIN_BELIEVED_TOKENS and its requests
//!            span MIN_WINDOW_MS (by routing time); judged at the second
//!            scrape this worker sees after that (the first may have been
//!            taken just before). An engine counts a hit when it schedules
//!            the prompt (vLLM), when it has read it (llama.cpp, before the
//!            first token) or when the request finishes (SGLang): either
//!            way before the answer ends, so that scrape holds the hits of
//!            every request of the window
//! missed   = hits < MISSING x believed
//! distrust = MISSES windows in a row missed
//! trust    = a window not missed; the engine restarted (it may run with
//!            another configuration); or RETRY_MS without a judged window
//!            (tried again: affinity comes back and is judged anew)
//! ```
//!
//! The counter counts whatever the engine serves: other workers' requests,
//! other replicas', other clients'. They can only add hits, so a missed
//! window means the engine did not keep what this worker sent, whoever else
//! uses it. The bar is low (a twentieth) because the two sides count tokens
//! differently: kvroute by its estimate, the engine by its tokenizer; a
//! cache that keeps some of the prompts clears it, and only one that keeps
//! (almost) none is distrusted. A distrusted endpoint's matches are worth
//! nothing to the scheduler (`Router::decide_in`): its requests are placed
//! by load, like a prompt nobody holds. Its index is kept: the evidence for
//! trusting it again. An engine without the counter (TensorRT-LLM,
//! llama.cpp servers older than it) is always trusted. Memory: one small
//! ledger per endpoint whose engine reports the counter; no clock is read
//! here.

use crate::endpoint::Endpoint;
use hashbrown::HashMap;

/// Believed-cached tokens a window needs before it is judged.
pub const MIN_BELIEVED_TOKENS: f64 = 8192.0;
/// Shortest window, ms (by the routing times of its requests): one burst
/// of requests is not judged on its own.
pub const MIN_WINDOW_MS: u64 = 500;
/// A window is missed when the engine's hits are below this share of
/// what was believed cached.
pub const MISSING: f64 = 0.05;
/// Missed windows in a row that distrust an endpoint.
pub const MISSES: u32 = 2;
/// A distrusted endpoint with no window judged for this long is trusted
/// again (tried anew), ms.
pub const RETRY_MS: u64 = 60_000;

/// A change of an endpoint's trust, for the shell to count and log.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum TrustChange {
    /// Its engine kept (almost) none of what this worker's requests
    /// believed cached, `MISSES` windows in a row: the last one's figures.
    Distrusted {
        /// Tokens this worker's requests believed cached.
        believed: f64,
        /// Tokens the engine reported served from its cache meanwhile.
        hits: f64,
    },
    /// A window was not missed, the engine restarted or stopped reporting
    /// the counter, or it was distrusted for `RETRY_MS` without a judged
    /// window.
    Trusted,
}

/// One endpoint's evidence.
#[derive(Clone, Debug, Default)]
struct Ledger {
    /// The engine's counter as last seen.
    counter: f64,
    /// `scraped_at_ms` of the state it was seen in.
    scraped_at_ms: u64,
    /// The engine's restarts as counted in that state.
    restarts: u32,
    /// Counter growth since the window started.
    hits: f64,
    /// Tokens this worker's answered requests believed cached since then.
    believed: f64,
    started_ms: u64,
    /// Scrapes seen since the window closed (`None`: open); judged at the
    /// second.
    closed: Option<u8>,
    /// Missed windows in a row.
    misses: u32,
    /// When the last window was judged (or the ledger started).
    judged_ms: u64,
}

impl Ledger {
    /// A new window from `now_ms`.
    fn restart(&mut self, now_ms: u64) {
        self.hits = 0.0;
        self.believed = 0.0;
        self.started_ms = now_ms;
        self.closed = None;
    }

    /// A new window, and no misses behind it: judged anew.
    fn start_over(&mut self, now_ms: u64) {
        self.misses = 0;
        self.judged_ms = now_ms;
        self.restart(now_ms);
    }
}

/// Every endpoint's ledger (see the module comment).
#[derive(Clone, Debug, Default)]
pub struct CacheTrust {
    ledgers: HashMap<Endpoint, Ledger>,
    /// The distrusted endpoints, sorted (empty almost always).
    distrusted: Vec<Endpoint>,
}

impl CacheTrust {
    /// Whether `endpoint`'s engine is believed to keep what it is sent.
    pub fn trusts(&self, endpoint: &Endpoint) -> bool {
        self.distrusted.is_empty() || self.distrusted.binary_search(endpoint).is_err()
    }

    /// The distrusted endpoints, sorted.
    pub fn distrusted(&self) -> &[Endpoint] {
        &self.distrusted
    }

    /// The engine's counter as of a scrape taken at `scraped_at_ms` (the
    /// endpoint's shared state, seen at `now_ms`; `None`: not reported),
    /// and its restarts as counted there (`ScrapeState::restarts`).
    pub fn observe(
        &mut self,
        endpoint: Endpoint,
        counter: Option<f64>,
        restarts: u32,
        scraped_at_ms: u64,
        now_ms: u64,
    ) -> Option<TrustChange> {
        let Some(counter) = counter.filter(|c| c.is_finite()) else {
            self.ledgers.remove(&endpoint)?;
            return self.set(endpoint, false).then_some(TrustChange::Trusted);
        };
        let Some(l) = self.ledgers.get_mut(&endpoint) else {
            let l = Ledger {
                counter,
                scraped_at_ms,
                restarts,
                started_ms: now_ms,
                judged_ms: now_ms,
                ..Ledger::default()
            };
            self.ledgers.insert(endpoint, l);
            return None;
        };
        if scraped_at_ms == l.scraped_at_ms {
            return None;
        }
        l.scraped_at_ms = scraped_at_ms;
        if restarts != l.restarts || counter < l.counter {
            // A new engine: nothing counted before is comparable, and it
            // may keep prompts where the old one did not.
            l.counter = counter;
            l.restarts = restarts;
            l.start_over(now_ms);
            return self.set(endpoint, false).then_some(TrustChange::Trusted);
        }
        l.hits += counter - l.counter;
        l.counter = counter;
        let seen = l.closed.as_mut()?;
        *seen += 1;
        if *seen < 2 {
            return None;
        }
        let (believed, hits) = (l.believed, l.hits);
        l.misses = if hits < MISSING * believed {
            l.misses + 1
        } else {
            0
        };
        l.judged_ms = now_ms;
        l.restart(now_ms);
        let distrust = l.misses >= MISSES;
        self.set(endpoint, distrust).then_some(match distrust {
            true => TrustChange::Distrusted { believed, hits },
            false => TrustChange::Trusted,
        })
    }

    /// A request to `endpoint`, routed at `routed_ms`, was answered in full
    /// (2xx) by an engine that was believed to hold `believed_tokens` of its
    /// prompt.
    pub fn credit(&mut self, endpoint: Endpoint, believed_tokens: u64, routed_ms: u64) {
        let Some(l) = self.ledgers.get_mut(&endpoint) else {
            return;
        };
        l.believed += believed_tokens as f64;
        if l.closed.is_none()
            && l.believed >= MIN_BELIEVED_TOKENS
            && routed_ms.saturating_sub(l.started_ms) >= MIN_WINDOW_MS
        {
            l.closed = Some(0);
        }
    }

    /// Drops the ledgers of endpoints no longer in `pool` (sorted).
    pub fn retain(&mut self, pool: &[Endpoint]) {
        self.ledgers.retain(|e, _| pool.binary_search(e).is_ok());
        self.distrusted.retain(|e| pool.binary_search(e).is_ok());
    }

    /// Distrusted endpoints not judged for `RETRY_MS` at `now_ms` are
    /// trusted again (tried anew); returns them.
    pub fn retry_due(&mut self, now_ms: u64) -> Vec<Endpoint> {
        let mut due = Vec::new();
        for e in &self.distrusted {
            let Some(l) = self.ledgers.get_mut(e) else {
                continue;
            };
            if now_ms.saturating_sub(l.judged_ms) >= RETRY_MS {
                l.start_over(now_ms);
                due.push(*e);
            }
        }
        self.distrusted.retain(|e| !due.contains(e));
        due
    }

    /// Records whether `endpoint` is distrusted; whether that changed.
    fn set(&mut self, endpoint: Endpoint, distrust: bool) -> bool {
        match (self.distrusted.binary_search(&endpoint), distrust) {
            (Err(i), true) => self.distrusted.insert(i, endpoint),
            (Ok(i), false) => {
                self.distrusted.remove(i);
            }
            _ => return false,
        }
        true
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

    /// Drives one endpoint: every 100 ms a scrape (the counter grows by
    /// `kept` of what was believed since the last one) and a request that
    /// believed 1000 tokens cached. Returns the changes with their times.
    fn run(
        t: &mut CacheTrust,
        e: Endpoint,
        counter: &mut f64,
        from_ms: u64,
        to_ms: u64,
        kept: f64,
    ) -> Vec<(u64, TrustChange)> {
        let mut changes = Vec::new();
        let mut now = from_ms;
        while now < to_ms {
            t.credit(e, 1000, now);
            *counter += 1000.0 * kept;
            now += 100;
            if let Some(c) = t.observe(e, Some(*counter), 0, now, now) {
                changes.push((now, c));
            }
        }
        changes
    }

    #[test]
    fn an_engine_that_keeps_nothing_is_distrusted_and_one_that_keeps_some_is_not() {
        for kept in [1.0, 0.5, 0.1, MISSING * 1.2] {
            let mut t = CacheTrust::default();
            let mut counter = 0.0;
            t.observe(ep(1), Some(counter), 0, 0, 0);
            assert_eq!(run(&mut t, ep(1), &mut counter, 0, 120_000, kept), vec![]);
            assert!(t.trusts(&ep(1)), "kept {kept}");
        }
        let mut t = CacheTrust::default();
        let mut counter = 0.0;
        t.observe(ep(1), Some(counter), 0, 0, 0);
        let changes = run(&mut t, ep(1), &mut counter, 0, 10_000, 0.0);
        // Two windows of MIN_WINDOW_MS, each judged two scrapes after it.
        assert_eq!(changes.len(), 1, "{changes:?}");
        let (at, change) = changes[0];
        assert!((1_500..=2_500).contains(&at), "{at}");
        assert!(
            matches!(change, TrustChange::Distrusted { believed, hits } if believed >= MIN_BELIEVED_TOKENS && hits == 0.0),
            "{change:?}"
        );
        assert!(!t.trusts(&ep(1)));
        assert_eq!(t.distrusted(), &[ep(1)]);
        assert!(t.trusts(&ep(2)), "another endpoint");
    }

    /// [`run`] until one window is judged; that window's change.
    fn one_window(
        t: &mut CacheTrust,
        e: Endpoint,
        counter: &mut f64,
        now: &mut u64,
        kept: f64,
    ) -> Option<TrustChange> {
        let judged = t.ledgers[&e].judged_ms;
        let mut changes = Vec::new();
        while t.ledgers[&e].judged_ms == judged {
            changes.extend(run(t, e, counter, *now, *now + 100, kept));
            *now += 100;
        }
        assert!(changes.len() <= 1, "{changes:?}");
        changes.pop().map(|(_, c)| c)
    }

    #[test]
    fn one_missed_window_is_not_enough_and_a_kept_window_restores_trust() {
        let mut t = CacheTrust::default();
        let (e, mut counter, mut now) = (ep(1), 0.0, 0);
        t.observe(e, Some(counter), 0, 0, 0);
        // Missed, kept, missed, kept...: never two in a row.
        for k in 0..10 {
            let kept = if k % 2 == 0 { 0.0 } else { 1.0 };
            assert_eq!(one_window(&mut t, e, &mut counter, &mut now, kept), None);
        }
        // Two missed in a row distrust it; one kept window trusts it again.
        assert_eq!(one_window(&mut t, e, &mut counter, &mut now, 0.0), None);
        let change = one_window(&mut t, e, &mut counter, &mut now, 0.0);
        assert!(matches!(change, Some(TrustChange::Distrusted { .. })));
        assert!(!t.trusts(&e));
        assert_eq!(one_window(&mut t, e, &mut counter, &mut now, 0.0), None);
        let change = one_window(&mut t, e, &mut counter, &mut now, 1.0);
        assert_eq!(change, Some(TrustChange::Trusted));
        assert!(t.trusts(&e));
    }

    #[test]
    fn hits_counted_late_are_waited_for() {
        // The engine's counter shows a window's hits one scrape late: the
        // window is judged two scrapes after it closed, when it has them.
        let mut t = CacheTrust::default();
        let e = ep(1);
        t.observe(e, Some(0.0), 0, 0, 0);
        let mut counter = 0.0;
        let mut pending = 0.0;
        for k in 1..=600u64 {
            let now = k * 100;
            t.credit(e, 1000, now);
            counter += pending;
            pending = 1000.0;
            assert_eq!(
                t.observe(e, Some(counter), 0, now + 1, now + 1),
                None,
                "{k}"
            );
        }
    }

    /// Endpoint 1 distrusted after 5 s of requests its engine kept nothing
    /// of; the engine's counter.
    fn distrusted_one() -> (CacheTrust, f64) {
        let mut t = CacheTrust::default();
        let mut counter = 0.0;
        t.observe(ep(1), Some(counter), 0, 0, 0);
        run(&mut t, ep(1), &mut counter, 0, 5_000, 0.0);
        assert!(!t.trusts(&ep(1)));
        (t, counter)
    }

    #[test]
    fn a_distrusted_endpoint_is_tried_again_without_evidence() {
        let (mut t, counter) = distrusted_one();
        // No request believes anything cached there any more (placed by
        // load, none holds a prefix): scrapes only.
        let mut now = 5_000;
        let mut back = Vec::new();
        while now < 5_000 + 2 * RETRY_MS && back.is_empty() {
            now += 100;
            assert_eq!(t.observe(ep(1), Some(counter), 0, now, now), None);
            back = t.retry_due(now);
        }
        assert_eq!(back, vec![ep(1)]);
        assert!(t.trusts(&ep(1)));
        // (Judged last just before 5 000: the requests kept coming.)
        assert!(
            (RETRY_MS - 500..=RETRY_MS + 600).contains(&(now - 5_000)),
            "{now}"
        );
    }

    #[test]
    fn restarts_silence_and_unknown_engines() {
        let mut t = CacheTrust::default();
        let e = ep(1);
        // No counter: no ledger, no judgement, trusted.
        assert_eq!(t.observe(e, None, 0, 1, 1), None);
        t.credit(e, 1_000_000, 5_000);
        assert!(t.trusts(&e));
        // The counter going down starts the window again: the drop is not a
        // "negative hit", and the old belief is dropped.
        t.observe(e, Some(1e6), 0, 1, 1);
        t.credit(e, 9_000, 2_500);
        t.observe(e, Some(10.0), 0, 2, 2_600);
        t.credit(e, 1_000, 2_700);
        t.observe(e, Some(10.0), 0, 3, 2_800);
        assert!(t.trusts(&e));
        // Distrusted; a restart of the engine (counted by the scraper, the
        // hit counter still 0) trusts it again.
        let mut counter = 10.0;
        run(&mut t, e, &mut counter, 3_000, 9_000, 0.0);
        assert!(!t.trusts(&e));
        assert_eq!(
            t.observe(e, Some(counter), 1, 9_100, 9_100),
            Some(TrustChange::Trusted)
        );
        assert!(t.trusts(&e));
        // Distrusted again, then the engine stops reporting the counter.
        let run1 = |t: &mut CacheTrust, counter: &mut f64, from: u64| {
            let mut now = from;
            while t.trusts(&e) && now < from + 10_000 {
                t.credit(e, 1000, now);
                now += 100;
                t.observe(e, Some(*counter), 1, now, now);
            }
        };
        run1(&mut t, &mut counter, 9_200);
        assert!(!t.trusts(&e));
        assert_eq!(
            t.observe(e, None, 1, 20_000, 20_000),
            Some(TrustChange::Trusted)
        );
        assert!(t.trusts(&e));
        // NaN counts as not reported.
        assert_eq!(t.observe(e, Some(f64::NAN), 1, 20_100, 20_100), None);
        // The same scrape seen again adds nothing.
        t.observe(e, Some(0.0), 1, 21_000, 21_000);
        assert_eq!(t.observe(e, Some(0.0), 1, 21_000, 21_100), None);
    }

    #[test]
    fn retain_drops_endpoints_that_left_the_pool() {
        let (mut t, _) = distrusted_one();
        t.retain(&[ep(2)]);
        assert!(t.trusts(&ep(1)));
        assert!(t.ledgers.is_empty());
    }
}
