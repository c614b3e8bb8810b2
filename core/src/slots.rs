//! Engines that run at most so many requests at once, and what a request
//! beyond them waits for (`scheduling.slot_wait`).
//!
//! A llama.cpp server runs one request per slot (`--parallel`); vLLM at
//! most `max_num_seqs`, SGLang `max_running_requests`, and any engine only
//! as many as its KV cache holds. A request that arrives when they are all
//! taken waits in the engine's queue until one **finishes**: a whole
//! request, its prefill and its answer, not the prefill tokens the TTFT
//! model prices its queue in (`ttft.rs`). A queue of cache hits looks
//! cheap in tokens and costs seconds in slots: on llama.cpp pods with 2
//! slots, conversations that followed their shared system prompt to one
//! pod waited 9-16 s while the other pods answered in 1 s
//! (bench/README.md, "Real engines").
//!
//! ## What is learnt
//!
//! - **An endpoint's limit**, from its scrapes: the most requests it has
//!   been seen running at once, `L`, once its queue (`waiting > 0`) has
//!   shown at that count in at least [`MIN_QUEUED`] scrapes and below it
//!   in at most a quarter as many. An engine out of slots queues at its
//!   limit, scrape after scrape (llama.cpp's deferred requests, vLLM at
//!   `max_num_seqs`). An engine that queues for other reasons queues at
//!   any count: vLLM's waiting requests also wait for the step's token
//!   budget (a long document being prefilled) or for KV blocks, and there
//!   a queue drains as its prefill does (the TTFT model's queue), not
//!   request by request. A count above `L` shows `L` was not the limit:
//!   the counts start again at the new high. Unknown: no wait.
//!
//!   A queue behind prefills alone is not counted, at any count: when
//!   every request the scrape shows there (running and waiting) is
//!   one of kvroute's that has not had its first byte yet, the running
//!   ones are prefilling, and on an engine that prefills in steps of a
//!   token budget one long prompt holds the step scrape after scrape,
//!   with the next requests queued behind it at one running request
//!   (kvroute-sim, as vLLM, on long-qa: a document prefilled for 2 s with
//!   its questions queued taught a limit of 1, and the questions that
//!   followed left its holder to prefill the document again,
//!   bench/README.md). An engine out of slots runs requests past their
//!   first byte while others queue. (A client that does not stream gets
//!   its first byte at the end: such traffic alone teaches no limit; set
//!   `scheduling.engine_slots`.)
//! - **Or the number the engine reports**: llama.cpp's `GET /props`
//!   (`total_slots`, its `--parallel`), read by the scraper
//!   (`engine_slots.rs`) and passed in by the router with
//!   [`SlotLimits::report`]. It is the limit itself, so it takes the place
//!   of a learnt or configured one from the first request on; only a
//!   scrape showing more requests running than it sets it aside (the
//!   number was not that endpoint's), as for a configured one.
//! - **Or the limit the operator configured** (`scheduling.engine_slots`),
//!   from the first request on, before any scrape could show a queue: a
//!   gateway that starts in front of busy engines, or a burst of new
//!   conversations, is priced at once. A learnt limit takes its place,
//!   and so does a count above it (the configured number was not the
//!   endpoint's: from then on its limit is learnt as above).
//! - **How long a request holds its slot**: the fleet's log mean, over
//!   the 2xx answers streamed in full, of their own prefill (as the TTFT
//!   model predicted it, at most the observed first-token time: the wait
//!   before it held no slot) plus the time from their first chunk to
//!   their end. Answers in one chunk teach nothing (their wait and their
//!   work cannot be told apart); until streams are seen a request is taken
//!   to hold its slot 1 s.
//!
//! ## The wait
//!
//! ```text
//! wait(e) = (present(e) - limit(e) + 1) / limit(e) x held_ms    when present(e) >= limit(e), else 0
//! ```
//!
//! `present(e)` is what the TTFT model counts there (the engine's running
//! and waiting requests, or kvroute's own if more): the request is number
//! `present + 1`, and the `limit` slots free up one every `held_ms /
//! limit` on average. The TTFT model takes the larger of this wait and its
//! prefill queue (`ttft.rs`).
//!
//! Memory: a few numbers per endpoint that ever reported a running count
//! (removed with it). No clock is read here.

use crate::endpoint::Endpoint;
use crate::float::non_negative;
use crate::log_mean::LogMean;
use crate::metrics::MetricsSnapshot;
use hashbrown::HashMap;

/// Scrapes that must show a queue at the most requests running before
/// that count is taken as the limit.
pub const MIN_QUEUED: u32 = 3;

/// What one endpoint's scrapes showed of its limit.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Seen {
    /// Most requests seen running at once.
    most_running: u32,
    /// Scrapes since that showed a queue while `most_running` ran ...
    queued_at_most: u32,
    /// ... and while fewer ran.
    queued_below: u32,
    /// When the last scrape counted was taken (ms): each counts once.
    scraped_at_ms: u64,
}

impl Seen {
    fn limit(&self) -> Option<u32> {
        let slot_bound = self.queued_at_most >= MIN_QUEUED
            && self.queued_below.saturating_mul(4) <= self.queued_at_most;
        (slot_bound && self.most_running > 0).then_some(self.most_running)
    }
}

/// Each endpoint's limit and the fleet's mean time in a slot.
#[derive(Clone, Debug)]
pub struct SlotLimits {
    seen: HashMap<Endpoint, Seen>,
    /// The slot counts engines report ([`SlotLimits::report`]).
    reported: HashMap<Endpoint, u32>,
    /// The limits that differ from `configured`, apart: a decision asks
    /// for every candidate's wait, and most fleets have none to find. 0:
    /// none (the endpoint ran more than the configured limit).
    limits: HashMap<Endpoint, u32>,
    /// `scheduling.engine_slots`: every endpoint's limit until its scrapes
    /// tell another.
    configured: Option<u32>,
    held_ms: LogMean,
    learning_rate: f64,
}

impl SlotLimits {
    /// Nothing learnt; `learning_rate` for the mean time in a slot (once
    /// warmed up), a request held 1 s until then; `configured`, the
    /// operator's limit for every endpoint (`scheduling.engine_slots`).
    pub fn new(learning_rate: f64, configured: Option<u32>) -> Self {
        SlotLimits {
            seen: HashMap::new(),
            reported: HashMap::new(),
            limits: HashMap::new(),
            configured: configured.filter(|&c| c > 0),
            held_ms: LogMean::at(1000.0),
            learning_rate,
        }
    }

    /// A scrape of `endpoint` taken at `scraped_at_ms` (each counts once,
    /// however often it is seen), while `awaiting_first_byte` of kvroute's
    /// requests there had not had their first byte: a queue behind only
    /// such requests is no sign of a limit (see the module comment). The
    /// router reads that count from this gateway's in-flight table when it
    /// first reads the scrape (within a tick of it); other replicas'
    /// requests count as another client's.
    pub fn observe(
        &mut self,
        endpoint: Endpoint,
        snapshot: &MetricsSnapshot,
        scraped_at_ms: u64,
        awaiting_first_byte: u32,
    ) {
        // `as` saturates; a negative or NaN gauge reads 0.
        let running = snapshot.running.round() as u32;
        if running == 0 && !self.seen.contains_key(&endpoint) {
            return;
        }
        let seen = self.seen.entry(endpoint).or_default();
        if scraped_at_ms <= seen.scraped_at_ms && seen.most_running > 0 {
            return;
        }
        seen.scraped_at_ms = scraped_at_ms;
        // A queue behind requests that all await their first byte says
        // nothing of slots, at any count.
        let prefilling = f64::from(awaiting_first_byte) >= snapshot.running + snapshot.waiting;
        let queued = u32::from(snapshot.waiting >= 0.5 && !prefilling);
        if running > seen.most_running {
            seen.most_running = running;
            seen.queued_at_most = queued;
            seen.queued_below = 0;
        } else if running == seen.most_running {
            seen.queued_at_most = seen.queued_at_most.saturating_add(queued);
        } else {
            seen.queued_below = seen.queued_below.saturating_add(queued);
        }
        self.settle(endpoint);
    }

    /// The slot count the engine at `endpoint` reports (`None`: it
    /// reports none, or no longer: its engine restarted and has not been
    /// asked again). Cheap when nothing changed: the router passes every
    /// endpoint's on every tick.
    pub fn report(&mut self, endpoint: Endpoint, slots: Option<u32>) {
        let slots = slots.filter(|&n| n > 0);
        if self.reported.get(&endpoint).copied() == slots {
            return;
        }
        match slots {
            Some(n) => self.reported.insert(endpoint, n),
            None => self.reported.remove(&endpoint),
        };
        self.settle(endpoint);
    }

    /// Whether some engine reported its slot count.
    pub fn any_reported(&self) -> bool {
        !self.reported.is_empty()
    }

    /// Sets `endpoint`'s limit from what is known of it: the number its
    /// engine reports, else the one its scrapes taught, else the
    /// configured one; a reported or configured number holds only until a
    /// scrape shows more running than it.
    fn settle(&mut self, endpoint: Endpoint) {
        let seen = self.seen.get(&endpoint);
        let most_running = seen.map_or(0, |s| s.most_running);
        let within = |n: &u32| most_running <= *n;
        let limit = self
            .reported
            .get(&endpoint)
            .copied()
            .filter(within)
            .or(seen.and_then(Seen::limit))
            .or(self.configured.filter(within));
        if limit == self.configured {
            self.limits.remove(&endpoint);
        } else {
            self.limits.insert(endpoint, limit.unwrap_or(0));
        }
    }

    /// The endpoint's limit: learnt from its scrapes, else the configured
    /// one unless its scrapes showed more running.
    pub fn limit(&self, endpoint: &Endpoint) -> Option<u32> {
        if self.limits.is_empty() {
            return self.configured;
        }
        match self.limits.get(endpoint) {
            Some(&l) => (l > 0).then_some(l),
            None => self.configured,
        }
    }

    /// A request held its slot `ms` (its prefill and its answer).
    pub fn held(&mut self, ms: u64) {
        self.held_ms.observe(ms.max(1) as f64, self.learning_rate);
    }

    /// The mean time a request holds its slot, ms.
    pub fn held_ms(&self) -> f64 {
        self.held_ms.value()
    }

    /// What a request waits on `endpoint` for a slot while `present`
    /// requests are there, ms (0 below the limit or without one).
    pub fn wait_ms(&self, endpoint: &Endpoint, present: f64) -> f64 {
        let Some(limit) = self.limit(endpoint) else {
            return 0.0;
        };
        let limit = f64::from(limit);
        non_negative(present - limit + 1.0) / limit * self.held_ms()
    }

    /// Forgets what `endpoint` showed and reported (its engine restarted:
    /// it may run with another limit; the configured one applies again
    /// until its engine reports one).
    pub fn forget(&mut self, endpoint: &Endpoint) {
        self.seen.remove(endpoint);
        self.reported.remove(endpoint);
        self.limits.remove(endpoint);
    }

    /// Forgets endpoints that left the pool (`pool` sorted).
    pub fn retain(&mut self, pool: &[Endpoint]) {
        self.seen.retain(|e, _| pool.binary_search(e).is_ok());
        self.reported.retain(|e, _| pool.binary_search(e).is_ok());
        self.limits.retain(|e, _| pool.binary_search(e).is_ok());
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

    fn scrape(running: f64, waiting: f64) -> MetricsSnapshot {
        MetricsSnapshot {
            waiting,
            running,
            kv_usage: None,
            kv_capacity_tokens: None,
        }
    }

    /// Feeds `scrapes` of `(running, waiting)` to `e`, one ms apart.
    fn feed(s: &mut SlotLimits, e: Endpoint, scrapes: &[(f64, f64)]) {
        for &(r, w) in scrapes {
            let at = s.seen.get(&e).map_or(1, |x| x.scraped_at_ms + 1);
            s.observe(e, &scrape(r, w), at, 0);
        }
    }

    #[test]
    fn a_queue_that_keeps_showing_at_the_most_running_marks_the_limit() {
        let mut s = SlotLimits::new(0.1, None);
        let e = ep(1);
        // Running without a queue says nothing of a limit.
        feed(&mut s, e, &[(1.0, 0.0), (2.0, 0.0), (1.0, 0.0), (0.0, 0.0)]);
        assert_eq!(s.limit(&e), None);
        assert_eq!(s.wait_ms(&e, 10.0), 0.0);
        // Queued at the most seen (llama.cpp: both slots busy, a third
        // request deferred), but once or twice is not enough ...
        feed(&mut s, e, &[(2.0, 1.0), (2.0, 2.0)]);
        assert_eq!(s.limit(&e), None);
        // ... and the same scrape seen again counts once.
        s.observe(e, &scrape(2.0, 2.0), s.seen[&e].scraped_at_ms, 0);
        assert_eq!(s.limit(&e), None);
        feed(&mut s, e, &[(2.0, 1.0)]);
        assert_eq!(s.limit(&e), Some(2));
        // It stays while the engine runs at or below it.
        feed(&mut s, e, &[(1.0, 0.0), (2.0, 0.0)]);
        assert_eq!(s.limit(&e), Some(2));
        // More running than the limit: it was not one. Unknown until a
        // queue shows at the new high again and again.
        feed(&mut s, e, &[(5.0, 0.0)]);
        assert_eq!(s.limit(&e), None);
        feed(&mut s, e, &[(5.0, 3.0), (5.0, 3.0), (5.0, 1.0)]);
        assert_eq!(s.limit(&e), Some(5));
        // Other endpoints are their own; garbage gauges read 0.
        assert_eq!(s.limit(&ep(2)), None);
        feed(&mut s, ep(3), &[(f64::NAN, 4.0), (-3.0, 4.0)]);
        assert_eq!(s.limit(&ep(3)), None);
        assert!(
            !s.seen.contains_key(&ep(3)),
            "nothing kept for an idle endpoint"
        );
    }

    #[test]
    fn a_queue_behind_prefills_alone_marks_no_limit() {
        // A long document held the step's token budget: one request ran
        // and the next queued behind it, scrape after scrape, every one of
        // them kvroute's and none with its first byte yet.
        let mut s = SlotLimits::new(0.1, None);
        let e = ep(1);
        for at in 1..=8 {
            s.observe(e, &scrape(1.0, 7.0), at, 8);
        }
        assert_eq!(s.limit(&e), None, "{:?}", s.seen[&e]);
        assert_eq!(s.wait_ms(&e, 9.0), 0.0);
        // A request of another client there (the engine counts more than
        // kvroute sent), or one of kvroute's past its first byte: its slot
        // was taken while others queued.
        for (i, awaiting) in [(2, 7), (3, 6)] {
            let mut s = SlotLimits::new(0.1, None);
            for at in 1..=3 {
                s.observe(ep(i), &scrape(1.0, 7.0), at, awaiting);
            }
            assert_eq!(s.limit(&ep(i)), Some(1), "{awaiting} awaiting");
        }
    }

    #[test]
    fn an_engine_that_queues_at_any_count_has_no_limit() {
        // vLLM prefilling a long document: requests wait for the step's
        // token budget while 1 to 6 run.
        let mut s = SlotLimits::new(0.1, None);
        let e = ep(1);
        let mut scrapes = vec![(6.0, 1.0); 4];
        for r in [1.0, 3.0, 2.0, 4.0, 5.0, 1.0] {
            scrapes.push((r, 2.0));
        }
        feed(&mut s, e, &scrapes);
        assert_eq!(s.limit(&e), None, "{:?}", s.seen[&e]);
        // A rare queue below the limit (a slot refilled between two steps)
        // does not hide it.
        let mut s = SlotLimits::new(0.1, None);
        let mut scrapes = vec![(4.0, 3.0); 8];
        scrapes.push((3.0, 2.0));
        feed(&mut s, e, &scrapes);
        assert_eq!(s.limit(&e), Some(4));
    }

    #[test]
    fn a_configured_limit_holds_from_the_start_until_scrapes_tell_another() {
        let mut s = SlotLimits::new(0.1, Some(4));
        let (a, b, c) = (ep(1), ep(2), ep(3));
        // Before any scrape: every endpoint has it, and a request beyond
        // it waits.
        assert_eq!((s.limit(&a), s.limit(&b)), (Some(4), Some(4)));
        assert!(s.wait_ms(&a, 4.0) > 0.0);
        // Scrapes at or below it change nothing ...
        feed(&mut s, a, &[(2.0, 0.0), (4.0, 0.0), (4.0, 3.0)]);
        assert_eq!(s.limit(&a), Some(4));
        assert!(s.limits.is_empty(), "nothing kept for the configured limit");
        // ... a smaller limit learnt from them replaces it ...
        feed(&mut s, b, &[(2.0, 1.0); MIN_QUEUED as usize]);
        assert_eq!(s.limit(&b), Some(2));
        // ... and a count above it shows it is not this endpoint's: none
        // until one is learnt at the new high.
        feed(&mut s, c, &[(6.0, 0.0)]);
        assert_eq!(s.limit(&c), None);
        assert_eq!(s.wait_ms(&c, 10.0), 0.0);
        feed(&mut s, c, &[(6.0, 2.0); MIN_QUEUED as usize]);
        assert_eq!(s.limit(&c), Some(6));
        // A restart forgets what was learnt: the configured limit again.
        s.forget(&b);
        s.forget(&c);
        assert_eq!((s.limit(&b), s.limit(&c)), (Some(4), Some(4)));
        // 0 is not a limit.
        assert_eq!(SlotLimits::new(0.1, Some(0)).limit(&a), None);
    }

    #[test]
    fn the_wait_counts_whole_requests_ahead_per_slot() {
        let mut s = SlotLimits::new(0.1, None);
        let e = ep(1);
        feed(&mut s, e, &[(2.0, 1.0); MIN_QUEUED as usize]);
        for _ in 0..8 {
            s.held(4000);
        }
        assert!((s.held_ms() - 4000.0).abs() < 1e-6);
        // Below the limit a slot is free.
        assert_eq!(s.wait_ms(&e, 0.0), 0.0);
        assert_eq!(s.wait_ms(&e, 1.0), 0.0);
        // Both slots busy: the first of them to finish, half a request on
        // average; one more queued ahead: a whole one.
        assert!((s.wait_ms(&e, 2.0) - 2000.0).abs() < 1e-6);
        assert!((s.wait_ms(&e, 3.0) - 4000.0).abs() < 1e-6);
        assert!((s.wait_ms(&e, 5.0) - 8000.0).abs() < 1e-6);
        // No limit learnt: no wait, however many are there.
        assert_eq!(s.wait_ms(&ep(2), 50.0), 0.0);
    }

    #[test]
    fn the_time_in_a_slot_is_a_robust_mean_and_limits_are_forgotten() {
        let mut s = SlotLimits::new(0.1, None);
        for _ in 0..20 {
            s.held(2000);
        }
        // One stalled answer moves the mean by a bounded step.
        s.held(600_000);
        assert!(s.held_ms() < 2000.0 * 1.2, "{}", s.held_ms());
        // An instant one is taken as 1 ms, not as 0.
        s.held(0);
        assert!(s.held_ms() > 1000.0);
        let (a, b) = (ep(1), ep(2));
        feed(&mut s, a, &[(4.0, 1.0); MIN_QUEUED as usize]);
        feed(&mut s, b, &[(4.0, 1.0); MIN_QUEUED as usize]);
        assert_eq!((s.limit(&a), s.limit(&b)), (Some(4), Some(4)));
        // A restarted engine may run with another limit.
        s.forget(&a);
        assert_eq!(s.limit(&a), None);
        // An endpoint that left the pool is dropped.
        s.retain(&[a]);
        assert_eq!(s.limit(&b), None);
        assert!(s.seen.is_empty() && s.limits.is_empty());
    }
    #[test]
    fn a_reported_slot_count_is_the_limit_until_a_scrape_shows_more_running() {
        let mut s = SlotLimits::new(0.1, Some(8));
        let (a, b) = (ep(1), ep(2));
        // Reported before any scrape: the limit from the first request on,
        // in the place of the configured one.
        s.report(a, Some(2));
        assert_eq!((s.limit(&a), s.limit(&b)), (Some(2), Some(8)));
        assert!(s.any_reported());
        assert!((s.wait_ms(&a, 2.0) - 500.0).abs() < 1e-6);
        // It holds over a limit the scrapes would teach...
        feed(&mut s, a, &[(1.0, 1.0); 2 * MIN_QUEUED as usize]);
        assert_eq!(s.limit(&a), Some(2));
        // ... and passing the same number again changes nothing.
        s.report(a, Some(2));
        assert_eq!(s.limit(&a), Some(2));
        // A scrape with more running shows it was not this engine's: the
        // configured one applies again, and what the scrapes teach.
        feed(&mut s, a, &[(3.0, 0.0)]);
        assert_eq!(s.limit(&a), Some(8));
        feed(&mut s, a, &[(3.0, 1.0); MIN_QUEUED as usize]);
        assert_eq!(s.limit(&a), Some(3));
        // A count of 0 is no count; a report withdrawn leaves the rest.
        s.report(b, Some(0));
        assert_eq!(s.limit(&b), Some(8));
        s.report(a, None);
        assert_eq!(s.limit(&a), Some(3));
        // A restart forgets the report too; so does leaving the pool.
        s.report(a, Some(4));
        s.forget(&a);
        assert_eq!(s.limit(&a), Some(8));
        s.report(b, Some(4));
        s.retain(&[a]);
        assert!(!s.any_reported());
        assert_eq!(s.limit(&b), Some(8));
    }
}
