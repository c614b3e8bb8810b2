//! Which endpoints the scraper asks for `/metrics` on each tick: a
//! freshness budget across the pool instead of every endpoint every tick.
//!
//! Why: a scrape costs Envoy about 0.08 ms of CPU all told (the HTTP call,
//! copying and reading the body, publishing the result), so scraping each of
//! 1024 endpoints every 50 ms (20 480 scrapes/s) would need 1.6 cores in the
//! one VM that scrapes: its thread saturates (it did from 256 endpoints on)
//! and nobody's snapshot stays fresh (`kvroute-bench scrape-scale`,
//! bench/README.md "Fleet scale").
//!
//! The pool shares a budget of `metrics.max_scrapes_per_s` scrapes per
//! second. With `n` endpoints, each endpoint is scraped every
//!
//! ```text
//! period(n) = max(scrape_interval_ms, ceil(n × 1000 / max_scrapes_per_s)) ms
//! ```
//!
//! so a pool small enough for the budget keeps the configured interval
//! (defaults: 50 ms up to 225 endpoints) and a larger one stretches it evenly
//! (1024 endpoints: 228 ms). While `period == scrape_interval_ms` every
//! endpoint whose previous scrape has answered is scraped on every tick,
//! exactly as before the budget existed. Past it, the scraper takes on each
//! tick as many endpoints as the elapsed time pays for (`elapsed × n /
//! period`, fractions carried over), those served longest ago first, so
//! scrapes are spread evenly over the ticks rather than sent in bursts.
//!
//! Everything that judges a snapshot's age scales with the period
//! ([`stale_after_ms`], [`silence_after_ms`]): a longer period must never make
//! a healthy endpoint look stale or stalled.
//!
//! When a `models` entry leaves its endpoints to `/v1/models`, the scraper
//! also reads each endpoint's list ([`ListingSchedule`]): at once for an
//! endpoint never listed (it serves no listed model until then; retried
//! every scrape period while it does not answer, every
//! `metrics.models_refresh_ms` once it answers without a readable list),
//! then every `metrics.models_refresh_ms` (and at once again when it answers
//! after leaving the candidate set: [`ListingSchedule::relist`]), spread over the ticks like the
//! scrapes (at most `n × elapsed / models_refresh_ms` refreshes a tick,
//! oldest first). Listing calls are paid from the same budget: over it,
//! each one takes a `/metrics` scrape's place ([`ScrapeSchedule::spend`]).
//! Within it they ride on top: one call per endpoint per 5 s by default,
//! 1 % of the scrapes at the default 50 ms interval.

use crate::config::MetricsConfig;
use crate::endpoint::Endpoint;
use crate::shared::endpoint_state::FLAP_WINDOW_MS;
use hashbrown::HashMap;

/// Milliseconds between two scrapes of one endpoint in a pool of
/// `pool_len` (see the module comment).
pub fn period_ms(cfg: &MetricsConfig, pool_len: usize) -> u64 {
    let rate = cfg.max_scrapes_per_s.max(1);
    let budgeted = (pool_len as u64 * 1000).div_ceil(rate);
    cfg.scrape_interval_ms.max(budgeted)
}

/// Age past which a snapshot is not trusted: `metrics.stale_after_ms`, or
/// two scrape periods if that is longer (one missed scrape never makes a
/// healthy endpoint's load unknown).
pub fn stale_after_ms(cfg: &MetricsConfig, pool_len: usize) -> u64 {
    cfg.stale_after_ms.max(2 * period_ms(cfg, pool_len))
}

/// How soon after its last drop a prompt-token counter that goes down again
/// is not an engine restarting but an endpoint in front of several
/// (`shared::endpoint_state::FLAP_WINDOW_MS`, or 40 scrape periods if that is
/// longer: the drops of such an endpoint come a few scrapes apart, however
/// seldom it is scraped).
pub fn flap_window_ms(cfg: &MetricsConfig, pool_len: usize) -> u64 {
    FLAP_WINDOW_MS.max(40 * period_ms(cfg, pool_len))
}

/// How long an endpoint's `/metrics` must have been silent before stall
/// detection may blame it: the configured window `stall_after_ms`, or two
/// scrape periods if that is longer (an endpoint scraped every 228 ms is
/// silent for up to ~250 ms between answers while perfectly healthy).
/// `0` stays `0` (stall detection off).
pub fn silence_after_ms(stall_after_ms: u64, cfg: &MetricsConfig, pool_len: usize) -> u64 {
    if stall_after_ms == 0 {
        return 0;
    }
    stall_after_ms.max(2 * period_ms(cfg, pool_len))
}

/// What the scraper remembers between ticks.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ScrapeSchedule {
    /// When this scraper last sent each endpoint a scrape (bounded by the
    /// pool: pruned when it outgrows it).
    dispatched: HashMap<Endpoint, u64>,
    /// Scrapes paid for but not yet dispatched (fraction carried over).
    credit: f64,
    /// When [`ScrapeSchedule::due`] last ran.
    last_tick_ms: Option<u64>,
    /// The last tick was over budget (scrapes paid from `credit`).
    over_budget: bool,
}

impl ScrapeSchedule {
    /// The endpoints to scrape at `now_ms`, from `pool` (sorted, as
    /// `Router::pool`), skipping those `outstanding` says are still waiting
    /// for their previous answer. `answered_at` is when each endpoint's
    /// `/metrics` last answered (the shared scrape state).
    ///
    /// Over budget, the endpoints taken are the ones served longest ago: the
    /// later of this scraper's last dispatch and the endpoint's last answer.
    /// So a scraper that just took the lease over starts with the stalest
    /// snapshots instead of the start of the pool, an endpoint whose previous
    /// scrape was still in flight on its turn goes first once it answers,
    /// and an endpoint refusing every scrape at once waits its turn like the
    /// others (its dispatch counts) instead of taking the live ones' budget.
    pub fn due(
        &mut self,
        pool: &[Endpoint],
        cfg: &MetricsConfig,
        now_ms: u64,
        outstanding: impl Fn(Endpoint) -> bool,
        answered_at: impl Fn(Endpoint) -> u64,
    ) -> Vec<Endpoint> {
        let n = pool.len();
        let period = period_ms(cfg, n);
        let elapsed = match self.last_tick_ms {
            // A clock that went back counts as one tick.
            Some(t) if now_ms > t => now_ms - t,
            _ => cfg.scrape_interval_ms,
        };
        self.last_tick_ms = Some(now_ms);
        self.over_budget = period > cfg.scrape_interval_ms;
        if !self.over_budget {
            // Within budget (or an empty pool): the whole pool, every tick.
            self.credit = 0.0;
            self.dispatched.clear();
            return pool.iter().copied().filter(|&e| !outstanding(e)).collect();
        }
        // Never more than one round at once (after a long pause, say).
        self.credit = (self.credit + elapsed as f64 * n as f64 / period as f64).min(n as f64);
        if self.dispatched.len() > n {
            self.dispatched.retain(|e, _| pool.binary_search(e).is_ok());
        }
        let mut ready: Vec<(u64, Endpoint)> = pool
            .iter()
            .filter(|&&e| !outstanding(e))
            .map(|&e| {
                let sent = self.dispatched.get(&e).copied().unwrap_or(0);
                (sent.max(answered_at(e)), e)
            })
            .collect();
        let k = (self.credit as usize).min(ready.len());
        if k < ready.len() {
            ready.select_nth_unstable(k);
            ready.truncate(k);
        }
        ready.sort_unstable();
        self.credit -= k as f64;
        // What the outstanding ones did not use is not saved up.
        self.credit = self.credit.min(1.0);
        ready
            .into_iter()
            .map(|(_, e)| {
                self.dispatched.insert(e, now_ms);
                e
            })
            .collect()
    }

    /// `calls` other calls (listings) were sent from the budget: over
    /// budget, as many fewer scrapes follow (the debt is carried to the
    /// next ticks, at most one round's worth).
    pub fn spend(&mut self, calls: usize, pool_len: usize) {
        if self.over_budget {
            self.credit = (self.credit - calls as f64).max(-(pool_len as f64));
        }
    }
}

/// When each endpoint's `/v1/models` is read (see the module comment).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ListingSchedule {
    /// This scraper's last listing call to each endpoint, and whether it
    /// was answered at all (bounded by the pool: pruned when it outgrows it).
    attempts: HashMap<Endpoint, (u64, bool)>,
    /// Refreshes paid for but not yet dispatched.
    credit: f64,
    last_tick_ms: Option<u64>,
    /// Endpoints to list on the next tick whatever their age ([`ListingSchedule::relist`]).
    forced: hashbrown::HashSet<Endpoint>,
}

impl ListingSchedule {
    /// The endpoints of `pool` (sorted) whose list to read at `now_ms`:
    /// `listed_at` is when each one's list was last read (the shared scrape
    /// state; `None`: never), `outstanding` whether a listing call to it is
    /// in flight, `retry_ms` the scrape period (how soon an endpoint never
    /// listed that did not answer is asked again).
    pub fn due(
        &mut self,
        pool: &[Endpoint],
        refresh_ms: u64,
        retry_ms: u64,
        now_ms: u64,
        outstanding: impl Fn(Endpoint) -> bool,
        listed_at: impl Fn(Endpoint) -> Option<u64>,
    ) -> Vec<Endpoint> {
        let n = pool.len();
        let refresh_ms = refresh_ms.max(1);
        let elapsed = match self.last_tick_ms {
            Some(t) if now_ms > t => now_ms - t,
            _ => retry_ms,
        };
        self.last_tick_ms = Some(now_ms);
        self.credit = (self.credit + elapsed as f64 * n as f64 / refresh_ms as f64).min(n as f64);
        if self.attempts.len() > n {
            self.attempts.retain(|e, _| pool.binary_search(e).is_ok());
        }
        self.forced.retain(|e| pool.binary_search(e).is_ok());
        let mut first = Vec::new();
        let mut refresh: Vec<(u64, Endpoint)> = Vec::new();
        for &e in pool {
            if outstanding(e) {
                continue;
            }
            let tried = self.attempts.get(&e).copied();
            if self.forced.remove(&e) {
                first.push(e);
                continue;
            }
            match (listed_at(e), tried) {
                (None, None) => first.push(e),
                (None, Some((at, answered))) => {
                    let wait = if answered { refresh_ms } else { retry_ms };
                    if now_ms.saturating_sub(at) >= wait {
                        first.push(e);
                    }
                }
                (Some(listed), tried) => {
                    let last = listed.max(tried.map_or(0, |(at, _)| at));
                    if now_ms.saturating_sub(last) >= refresh_ms {
                        refresh.push((last, e));
                    }
                }
            }
        }
        let k = (self.credit.max(0.0) as usize).min(refresh.len());
        if k < refresh.len() {
            refresh.select_nth_unstable(k);
            refresh.truncate(k);
        }
        refresh.sort_unstable();
        self.credit -= k as f64;
        self.credit = self.credit.min(1.0);
        let due: Vec<Endpoint> = first
            .into_iter()
            .chain(refresh.into_iter().map(|(_, e)| e))
            .collect();
        for &e in &due {
            self.attempts.insert(e, (now_ms, false));
        }
        due
    }

    /// `endpoint` answers again after it left the candidate set (failed
    /// scrapes, or a request it did not answer): it may have restarted with
    /// other models or without the adapters loaded at run time, so its list
    /// is read again on the next tick instead of at the next refresh.
    pub fn relist(&mut self, endpoint: Endpoint) {
        self.forced.insert(endpoint);
    }

    /// The listing call to `endpoint` was answered (readable or not), or
    /// not at all.
    pub fn answered(&mut self, endpoint: Endpoint, answered: bool) {
        if let Some(a) = self.attempts.get_mut(&endpoint) {
            a.1 = answered;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn pool(n: u16) -> Vec<Endpoint> {
        let mut p: Vec<Endpoint> = (0..n)
            .map(|i| {
                format!("10.0.{}.{}:8000", i / 256, i % 256)
                    .parse()
                    .unwrap()
            })
            .collect();
        p.sort();
        p
    }

    fn cfg(interval: u64, rate: u64) -> MetricsConfig {
        MetricsConfig {
            scrape_interval_ms: interval,
            max_scrapes_per_s: rate,
            ..MetricsConfig::default()
        }
    }

    #[test]
    fn period_table() {
        let d = MetricsConfig::default();
        // (pool, interval, budget, period)
        let cases = [
            (0, 50, 4000, 50),
            (1, 50, 4000, 50),
            (64, 50, 4000, 50),
            (200, 50, 4000, 50),
            (201, 50, 4000, 51),
            (256, 50, 4000, 64),
            (1024, 50, 4000, 256),
            (1024, 1000, 4000, 1000),
            (1024, 50, 1, 1_024_000),
            (10, 50, 0, 10_000), // a zero budget is treated as 1/s, never a division by zero
        ];
        for (n, interval, rate, want) in cases {
            assert_eq!(
                period_ms(&cfg(interval, rate), n),
                want,
                "{n} at {interval} ms / {rate}/s"
            );
        }
        assert_eq!(
            period_ms(&d, 64),
            d.scrape_interval_ms,
            "defaults unchanged"
        );
    }

    #[test]
    fn thresholds_scale_with_the_period() {
        let c = cfg(50, 4000);
        assert_eq!(stale_after_ms(&c, 64), 2000);
        assert_eq!(stale_after_ms(&c, 1024), 2000, "2 x 256 < 2000");
        assert_eq!(stale_after_ms(&cfg(50, 500), 1024), 2 * 2048);
        assert_eq!(silence_after_ms(500, &c, 64), 500);
        assert_eq!(silence_after_ms(500, &c, 1024), 512);
        assert_eq!(silence_after_ms(0, &c, 1024), 0, "off stays off");
        assert_eq!(flap_window_ms(&c, 64), FLAP_WINDOW_MS);
        assert_eq!(flap_window_ms(&c, 1024), 40 * 256);
        assert_eq!(flap_window_ms(&cfg(50, 500), 1024), 40 * 2048);
    }

    #[test]
    fn within_budget_every_endpoint_every_tick() {
        let p = pool(64);
        let c = MetricsConfig::default();
        let mut s = ScrapeSchedule::default();
        for tick in 0..5u64 {
            // jittered ticks change nothing
            let got = s.due(&p, &c, 1_000 + tick * 47, |_| false, |_| 0);
            assert_eq!(got, p);
        }
        let busy = p[3];
        let got = s.due(&p, &c, 2_000, |e| e == busy, |_| 0);
        assert_eq!(got.len(), 63);
        assert!(!got.contains(&busy));
    }

    /// Runs `ticks` ticks of `tick_ms` (every scrape answers before the
    /// next tick) and returns each endpoint's scrape times.
    fn simulate(
        s: &mut ScrapeSchedule,
        p: &[Endpoint],
        c: &MetricsConfig,
        ticks: u64,
        tick_ms: u64,
    ) -> HashMap<Endpoint, Vec<u64>> {
        let mut at: HashMap<Endpoint, Vec<u64>> = HashMap::new();
        for t in 0..ticks {
            let now = 10_000 + t * tick_ms;
            for e in s.due(p, c, now, |_| false, |_| 0) {
                at.entry(e).or_default().push(now);
            }
        }
        at
    }

    #[test]
    fn over_budget_the_pool_is_spread_evenly_at_the_budgeted_rate() {
        let p = pool(1024);
        let c = cfg(50, 4000); // period 256 ms
        let mut s = ScrapeSchedule::default();
        let mut per_tick = Vec::new();
        let mut seen: HashMap<Endpoint, Vec<u64>> = HashMap::new();
        for t in 0..200u64 {
            let now = 10_000 + t * 50;
            let due = s.due(&p, &c, now, |_| false, |_| 0);
            per_tick.push(due.len());
            for e in due {
                seen.entry(e).or_default().push(now);
            }
        }
        // 1024 x 50 / 256 = 200 per tick, never a burst
        assert!(
            per_tick.iter().all(|&k| (199..=201).contains(&k)),
            "{per_tick:?}"
        );
        let total: usize = per_tick.iter().sum();
        assert_eq!(total, 200 * 200);
        // every endpoint scraped, and never more than period + one tick apart
        assert_eq!(seen.len(), 1024);
        for times in seen.values() {
            for w in times.windows(2) {
                assert!(w[1] - w[0] <= 256 + 50, "{times:?}");
            }
        }
    }

    #[test]
    fn jittered_and_late_ticks_keep_the_rate_and_never_burst_past_one_round() {
        let p = pool(1024);
        let c = cfg(50, 4000);
        let mut s = ScrapeSchedule::default();
        let mut now = 10_000;
        let mut total = 0;
        for t in 0..100u64 {
            now += if t % 10 == 9 { 120 } else { 43 };
            total += s.due(&p, &c, now, |_| false, |_| 0).len();
        }
        let paid = (now - 10_000) as f64 * 1024.0 / 256.0;
        assert!(
            (total as f64 - paid).abs() <= 200.0 + 1.0,
            "{total} vs {paid}"
        );
        // a 10 s pause pays for one round at most
        assert_eq!(s.due(&p, &c, now + 10_000, |_| false, |_| 0).len(), 1024);
    }

    #[test]
    fn outstanding_endpoints_are_skipped_without_stalling_the_walk() {
        let p = pool(1024);
        let c = cfg(50, 4000);
        let mut s = ScrapeSchedule::default();
        // a third of the pool never answers
        let dead = |e: Endpoint| p.binary_search(&e).unwrap() % 3 == 0;
        let mut live_seen = std::collections::HashSet::new();
        for t in 0..30u64 {
            for e in s.due(&p, &c, 10_000 + t * 50, dead, |_| 0) {
                assert!(!dead(e));
                live_seen.insert(e);
            }
        }
        assert_eq!(live_seen.len(), p.iter().filter(|e| !dead(**e)).count());
    }

    #[test]
    fn a_pool_that_changes_keeps_the_walk_going() {
        let c = cfg(50, 4000);
        let mut s = ScrapeSchedule::default();
        let full = pool(1024);
        let mut seen = std::collections::HashSet::new();
        for t in 0..12u64 {
            // every other tick one endpoint fewer (discovery removing pods)
            let p: Vec<Endpoint> = full[..1024 - t as usize].to_vec();
            for e in s.due(&p, &c, 10_000 + t * 50, |_| false, |_| 0) {
                seen.insert(e);
            }
        }
        assert!(seen.len() >= 1024 - 12, "{}", seen.len());
        assert!(s.due(&[], &c, 20_000, |_| false, |_| 0).is_empty());
        // and back to a small pool: the whole pool again
        let small = pool(8);
        assert_eq!(s.due(&small, &c, 20_050, |_| false, |_| 0), small);
    }

    #[test]
    fn simulated_max_gap_holds_at_every_pool_size() {
        for n in [1u16, 8, 64, 200, 256, 512, 1024] {
            let p = pool(n);
            let c = cfg(50, 4000);
            let period = period_ms(&c, p.len());
            let mut s = ScrapeSchedule::default();
            let at = simulate(&mut s, &p, &c, 400, 50);
            assert_eq!(at.len(), p.len(), "n={n}");
            for times in at.values() {
                let gap = times.windows(2).map(|w| w[1] - w[0]).max().unwrap_or(0);
                assert!(gap <= period + 50, "n={n}: gap {gap} > {period} + 50");
            }
        }
    }

    #[test]
    fn a_scraper_taking_the_lease_over_starts_with_the_stalest_snapshots() {
        let p = pool(1024);
        let c = cfg(50, 4000);
        // The previous holder served the first 700 endpoints recently, the
        // rest long ago.
        let answered = |e: Endpoint| {
            if p.binary_search(&e).unwrap() < 700 {
                9_900
            } else {
                9_700
            }
        };
        let mut s = ScrapeSchedule::default();
        let first = s.due(&p, &c, 10_000, |_| false, answered);
        assert_eq!(first.len(), 200);
        assert!(
            first.iter().all(|e| p.binary_search(e).unwrap() >= 700),
            "stalest first"
        );
        let second = s.due(&p, &c, 10_050, |_| false, answered);
        assert!(second.iter().all(|e| !first.contains(e)));
    }

    #[test]
    fn endpoints_refusing_at_once_do_not_take_the_live_ones_budget() {
        let p = pool(1024);
        let c = cfg(50, 4000);
        // Half the pool refuses every scrape at once: never outstanding,
        // never answered. The other half answers at once.
        let dead = |e: Endpoint| p.binary_search(&e).unwrap() % 2 == 0;
        let mut answered: HashMap<Endpoint, u64> = HashMap::new();
        let mut s = ScrapeSchedule::default();
        let mut gaps: HashMap<Endpoint, Vec<u64>> = HashMap::new();
        for t in 0..100u64 {
            let now = 10_000 + t * 50;
            let due = s.due(
                &p,
                &c,
                now,
                |_| false,
                |e| answered.get(&e).copied().unwrap_or(0),
            );
            for e in due {
                if !dead(e) {
                    answered.insert(e, now);
                    gaps.entry(e).or_default().push(now);
                }
            }
        }
        assert_eq!(gaps.len(), 512);
        for times in gaps.values() {
            let gap = times.windows(2).map(|w| w[1] - w[0]).max().unwrap();
            assert!(gap <= 256 + 50, "a live endpoint waited {gap} ms");
        }
    }

    #[test]
    fn what_the_scraper_remembers_stays_bounded_by_the_pool() {
        let c = cfg(50, 4000);
        let mut s = ScrapeSchedule::default();
        for round in 0..20u16 {
            // a pool whose members all change every round (discovery churn)
            let p: Vec<Endpoint> = {
                let mut v: Vec<Endpoint> = (0..1024u16)
                    .map(|i| {
                        format!("10.{}.{}.{}:8000", round, i / 256, i % 256)
                            .parse()
                            .unwrap()
                    })
                    .collect();
                v.sort();
                v
            };
            for t in 0..6u64 {
                s.due(
                    &p,
                    &c,
                    10_000 + u64::from(round) * 300 + t * 50,
                    |_| false,
                    |_| 0,
                );
            }
            assert!(s.dispatched.len() <= 2 * 1024, "{}", s.dispatched.len());
        }
    }

    #[test]
    fn listings_first_at_once_then_every_refresh_spread_over_the_ticks() {
        let p = pool(1000);
        let mut s = ListingSchedule::default();
        let mut listed: HashMap<Endpoint, u64> = HashMap::new();
        let mut per_tick = Vec::new();
        for t in 0..400u64 {
            let now = 10_000 + t * 50;
            let due = s.due(&p, 5_000, 50, now, |_| false, |e| listed.get(&e).copied());
            per_tick.push(due.len());
            for e in due {
                s.answered(e, true);
                listed.insert(e, now);
            }
        }
        // Every endpoint never listed goes on the first tick.
        assert_eq!(per_tick[0], 1000);
        // Then each is refreshed every 5 s, 1000 x 50 / 5000 = 10 a tick
        // at most, never a burst.
        assert!(per_tick[1..].iter().all(|&k| k <= 11), "{per_tick:?}");
        let total: usize = per_tick[1..].iter().sum();
        let paid = 399.0 * 50.0 * 1000.0 / 5000.0;
        assert!(
            (total as f64) <= paid + 1.0 && (total as f64) >= paid - 1000.0,
            "{total}"
        );
        assert!(listed
            .values()
            .all(|&at| 10_000 + 399 * 50 - at <= 2 * 5_000 + 50));
    }

    #[test]
    fn an_endpoint_never_listed_is_retried_each_period_unless_it_answers_garbage() {
        let p = pool(3);
        let mut s = ListingSchedule::default();
        let never = |_| None;
        assert_eq!(s.due(&p, 5_000, 50, 1_000, |_| false, never).len(), 3);
        // In flight: not asked again.
        assert!(s.due(&p, 5_000, 50, 1_050, |_| true, never).is_empty());
        s.answered(p[0], false); // refused: retried next period
        s.answered(p[1], true); // answered garbage: retried after the refresh
        let due = s.due(&p, 5_000, 50, 1_100, |e| e == p[2], never);
        assert_eq!(due, [p[0]]);
        s.answered(p[0], false);
        assert_eq!(
            s.due(&p, 5_000, 50, 6_000, |e| e == p[2], never),
            [p[0], p[1]]
        );
    }

    #[test]
    fn an_endpoint_back_in_the_candidate_set_is_listed_again_at_once() {
        let p = pool(2);
        let mut s = ListingSchedule::default();
        let listed = |_| Some(1_000);
        assert!(s.due(&p, 5_000, 50, 1_050, |_| false, listed).is_empty());
        s.relist(p[1]);
        // In flight: it waits for its answer, then goes.
        assert!(s.due(&p, 5_000, 50, 1_100, |_| true, listed).is_empty());
        assert_eq!(s.due(&p, 5_000, 50, 1_150, |_| false, listed), [p[1]]);
        assert!(s.due(&p, 5_000, 50, 1_200, |_| false, listed).is_empty());
        // One that left the pool is forgotten.
        s.relist(p[0]);
        assert!(s
            .due(&p[1..], 5_000, 50, 1_250, |_| false, listed)
            .is_empty());
        assert!(s.due(&p, 5_000, 50, 1_300, |_| false, listed).is_empty());
    }

    #[test]
    fn listings_over_budget_take_scrapes_places() {
        let p = pool(1024);
        let c = cfg(50, 4000); // period 256 ms: 200 scrapes a tick
        let mut s = ScrapeSchedule::default();
        assert_eq!(s.due(&p, &c, 10_000, |_| false, |_| 0).len(), 200);
        s.spend(50, p.len());
        assert_eq!(s.due(&p, &c, 10_050, |_| false, |_| 0).len(), 150);
        // Within budget nothing is owed.
        let small = pool(8);
        let mut s = ScrapeSchedule::default();
        s.due(&small, &c, 10_000, |_| false, |_| 0);
        s.spend(8, small.len());
        assert_eq!(s.due(&small, &c, 10_050, |_| false, |_| 0), small);
    }
}
