//! The predicted time to first token (TTFT) of a request on each endpoint,
//! with rates learnt online from what the filter sees (`scheduling.profile:
//! predicted_ttft`).
//!
//! ## The model
//!
//! An engine prefills the uncached prompt tokens it was sent, roughly in
//! arrival order and at a rate that its decode load slows down. For request
//! `r` on endpoint `e`:
//!
//! ```text
//! ahead(e)    = kvroute's in-flight uncached tokens on e (all workers, all replicas)
//!             + max(0, engine waiting - kvroute's waiting on e) x mean uncached tokens
//! uncached(e) = prompt tokens - tokens of r's prefix e holds
//! TTFT(e)     = overhead(e) + (ahead(e) + uncached(e)) x ms_per_token(e)
//! ```
//!
//! The second `ahead` term counts requests the engine queues that kvroute
//! did not send (other gateways, other clients), at the mean size kvroute
//! sees; it is used only while the endpoint's snapshot is fresh.
//!
//! ## The decision
//!
//! The endpoint with the lowest cost wins, where
//!
//! ```text
//! queued   = mean over the pool of max(engine waiting, kvroute's waiting)
//! cost(e)  = TTFT(e) + uncached(e) x ms_per_token(e) x queued
//! ```
//!
//! The second term is what this request's own prefill costs the requests
//! that wait behind it. On an idle fleet it is zero and the rule is plain
//! lowest-TTFT (a long prefix stays on its holder until the holder's queue
//! costs more than prefilling the prompt elsewhere, then the prefix gains a
//! second holder and later requests balance over both). Under saturation
//! a cache miss delays everyone queued, so hits weigh more: a cache hit is
//! the only way to add capacity. Cold requests (no holder anywhere): every
//! endpoint within `scheduling.cold_margin` of the best cost is acceptable
//! and the picker rotates among them (`scheduler/picker.rs`).
//!
//! ## Learning
//!
//! Each streaming request that gets a first byte from its chosen endpoint
//! is one observation: `work` = its `ahead + uncached` at routing time,
//! `ttft` = routing to first response byte. Observations with little work
//! (`<= scheduling.ttft.overhead_work_tokens`) teach `overhead`; the others
//! teach `ms_per_token = (ttft - overhead) / work`. Each rate is a mean in
//! log space (robust to the heavy right tail of queueing) whose weight is
//! `1/n` for the first observations and then `scheduling.ttft.learning_rate`;
//! the first observation replaces the prior, and each later one moves it at
//! most ×4 or ÷4 (an outlier such as a request that waited behind a stall
//! cannot ruin it). Decode load enters through the rates: an endpoint busy
//! decoding answers later and is learnt slower.
//!
//! An endpoint not observed yet is assumed to be the fleet's mean (the
//! configured priors only until some endpoint is observed), so a new pod is
//! neither shunned nor flooded; an endpoint's rate within ×1.5 of the
//! fleet's counts as the fleet's (equal pods are not ranked by noise); an
//! endpoint not observed for 256 fleet observations drifts back to the
//! fleet's rates (one learnt slow and since avoided is tried again).
//! Memory: a few numbers per endpoint (removed with it). No clock is read
//! here: the shell passes the times. A restarted VM starts from the
//! configured priors and relearns within a few requests.

use crate::config::TtftConfig;
use crate::endpoint::Endpoint;
use hashbrown::HashMap;

/// Observations after which a rate moves by `learning_rate`, not `1/n`.
const WARM_UP: u32 = 8;
/// Largest factor one observation can move a rate by.
const MAX_STEP: f64 = 4.0;
/// Fleet observations after which an endpoint not observed since counts
/// as the fleet average again (so one learnt slow, and since avoided, is
/// tried again rather than shunned forever on stale data).
const STALE_AFTER: u64 = 256;
/// Rates within this factor of the fleet's count as the fleet's.
const NOISE: f64 = 1.5;

/// A rate learnt in log space.
#[derive(Clone, Copy, Debug, PartialEq)]
struct LogMean {
    ln: f64,
    n: u32,
}

impl LogMean {
    fn new(prior: f64) -> Self {
        LogMean {
            ln: prior.max(1e-9).ln(),
            n: 0,
        }
    }

    fn value(&self) -> f64 {
        self.ln.exp()
    }

    fn observe(&mut self, x: f64, learning_rate: f64) {
        if !x.is_finite() {
            return;
        }
        let step = x.max(1e-9).ln() - self.ln;
        // The first observation replaces the prior (a guess); later ones
        // move the mean at most MAX_STEP-fold.
        let step = if self.n == 0 {
            step
        } else {
            step.clamp(-MAX_STEP.ln(), MAX_STEP.ln())
        };
        self.n = self.n.saturating_add(1);
        let w = if self.n <= WARM_UP {
            1.0 / f64::from(self.n)
        } else {
            learning_rate
        };
        self.ln += w * step;
    }
}

/// Decayed least squares of first-byte time against requests running on
/// the endpoint, over the fleet's small-work observations: the slope is
/// what one more running (decoding) request adds to a first token.
#[derive(Clone, Copy, Debug, Default)]
struct DecodeFit {
    w: f64,
    x: f64,
    y: f64,
    xx: f64,
    xy: f64,
}

/// Weight kept by the fit's past at each new observation.
const FIT_DECAY: f64 = 0.995;

impl DecodeFit {
    fn add(&mut self, x: f64, y: f64) {
        if !(x.is_finite() && y.is_finite()) {
            return;
        }
        // An outlier (a wait behind a stall) counts as at most 4x the mean.
        let y = if self.w >= 1.0 {
            y.min(4.0 * self.y / self.w + 1.0)
        } else {
            y
        };
        self.w = self.w * FIT_DECAY + 1.0;
        self.x = self.x * FIT_DECAY + x;
        self.y = self.y * FIT_DECAY + y;
        self.xx = self.xx * FIT_DECAY + x * x;
        self.xy = self.xy * FIT_DECAY + x * y;
    }

    /// ms per running request (0 until the running counts seen vary).
    fn slope(&self) -> f64 {
        if self.w < f64::from(WARM_UP) {
            return 0.0;
        }
        let (mx, my) = (self.x / self.w, self.y / self.w);
        let var = self.xx / self.w - mx * mx;
        if var < 0.25 {
            return 0.0;
        }
        ((self.xy / self.w - mx * my) / var).max(0.0)
    }
}

/// What an endpoint has been learnt to be.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Rates {
    /// Fixed part of a first token, ms.
    pub overhead_ms: f64,
    /// Prefill time per token of work, ms.
    pub ms_per_token: f64,
    /// Observations taken.
    pub observations: u32,
}

#[derive(Clone, Copy, Debug)]
struct Learnt {
    overhead: LogMean,
    per_token: LogMean,
    /// The fleet's observation count when this endpoint was last observed.
    seen_at: u64,
}

/// One endpoint's predicted TTFT for one request, with its parts.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Prediction {
    /// The prediction, ms.
    pub ttft_ms: f64,
    /// Tokens of prefill ahead of the request.
    pub ahead_tokens: f64,
    /// The request's own uncached tokens there.
    pub uncached_tokens: f64,
    /// The endpoint's learnt prefill time per token, ms.
    pub ms_per_token: f64,
    /// The endpoint's learnt fixed part, ms.
    pub overhead_ms: f64,
    /// Requests running (decoding) there.
    pub running: f64,
    /// What they add to a first token there, ms (`running` x the learnt
    /// ms per running request).
    pub decode_ms: f64,
    /// What the request's own prefill costs the requests queued behind it
    /// there, ms (see the module doc).
    pub queue_cost_ms: f64,
    /// What the decision minimises: `ttft_ms + queue_cost_ms`.
    pub cost_ms: f64,
}

/// Learnt rates of every endpoint, and the mean request size.
#[derive(Clone, Debug)]
pub struct TtftModel {
    config: TtftConfig,
    learnt: HashMap<Endpoint, Learnt>,
    /// Mean (log space) of the observed endpoints' rates: what an endpoint
    /// not observed yet is assumed to be (the priors while none is).
    fleet: Learnt,
    /// Observations taken, all endpoints together.
    observations: u64,
    /// First-byte time against running requests (fleet-wide).
    decode: DecodeFit,
    /// Mean uncached tokens of a routed request (for queued requests
    /// kvroute did not send).
    mean_uncached: LogMean,
}

impl TtftModel {
    /// A model at the configured priors.
    pub fn new(config: &TtftConfig) -> Self {
        TtftModel {
            fleet: Self::prior(config),
            config: config.clone(),
            learnt: HashMap::new(),
            observations: 0,
            decode: DecodeFit::default(),
            mean_uncached: LogMean::new(512.0),
        }
    }

    fn prior(config: &TtftConfig) -> Learnt {
        Learnt {
            overhead: LogMean::new(config.prior_overhead_ms.max(0.01)),
            per_token: LogMean::new(config.prior_ms_per_token),
            seen_at: 0,
        }
    }

    /// The rates of `endpoint`. A rate not observed there yet is the
    /// fleet's (the mean of the endpoints observed), so a new endpoint is
    /// assumed average, neither shunned nor flooded; the configured priors
    /// hold until some endpoint is observed. An endpoint not observed for a
    /// while (others were, [`STALE_AFTER`] times) drifts back to the fleet's
    /// rates: one learnt slow and since avoided gets tried again.
    ///
    /// A rate within [`NOISE`] of the fleet's is the fleet's: equal pods
    /// learn slightly different rates from the load they happened to see,
    /// and ranking by that noise would keep sending the "fastest" one more.
    pub fn rates(&self, endpoint: &Endpoint) -> Rates {
        let (overhead, per_token, observations) = self.own(endpoint);
        let snap = |own: f64, fleet: LogMean| {
            if (own.ln() - fleet.ln).abs() < NOISE.ln() {
                fleet.value()
            } else {
                own
            }
        };
        Rates {
            overhead_ms: snap(overhead, self.fleet.overhead),
            ms_per_token: snap(per_token, self.fleet.per_token),
            observations,
        }
    }

    /// `endpoint`'s own (overhead, per-token, observations), drifted toward
    /// the fleet's with staleness; the fleet's where not observed.
    fn own(&self, endpoint: &Endpoint) -> (f64, f64, u32) {
        let Some(l) = self.learnt.get(endpoint) else {
            return (self.fleet.overhead.value(), self.fleet.per_token.value(), 0);
        };
        let stale = self.observations.saturating_sub(l.seen_at) as f64 / STALE_AFTER as f64;
        let w = stale.min(1.0);
        let blend = |own: LogMean, fleet: LogMean| {
            if own.n == 0 {
                fleet.value()
            } else {
                (own.ln * (1.0 - w) + fleet.ln * w).exp()
            }
        };
        (
            blend(l.overhead, self.fleet.overhead),
            blend(l.per_token, self.fleet.per_token),
            l.overhead.n.saturating_add(l.per_token.n),
        )
    }

    /// Recomputes the fleet's rates from the observed endpoints.
    fn refresh_fleet(&mut self) {
        let prior = Self::prior(&self.config);
        let mean = |f: fn(&Learnt) -> LogMean, prior: LogMean| {
            let (sum, n) = self
                .learnt
                .values()
                .map(f)
                .filter(|m| m.n > 0)
                .fold((0.0, 0u32), |(s, n), m| (s + m.ln, n + 1));
            if n == 0 {
                prior
            } else {
                LogMean {
                    ln: sum / f64::from(n),
                    n,
                }
            }
        };
        self.fleet = Learnt {
            overhead: mean(|l| l.overhead, prior.overhead),
            per_token: mean(|l| l.per_token, prior.per_token),
            seen_at: 0,
        };
    }

    /// Mean uncached tokens of the requests routed so far.
    pub fn mean_uncached_tokens(&self) -> f64 {
        self.mean_uncached.value()
    }

    /// A request with `uncached` tokens was routed (feeds the mean size).
    pub fn routed(&mut self, uncached: u64) {
        self.mean_uncached
            .observe(uncached.max(1) as f64, self.config.learning_rate);
    }

    /// `endpoint` answered its first byte `ttft_ms` after routing, for a
    /// request that had `work_tokens` (ahead + uncached) to wait for while
    /// `running` requests were decoding there.
    pub fn observe(&mut self, endpoint: Endpoint, work_tokens: u64, running: f64, ttft_ms: u64) {
        let lr = self.config.learning_rate;
        let small = self.config.overhead_work_tokens;
        self.observations += 1;
        // A stale endpoint resumes from what it is assumed to be now.
        let (overhead, per_token, _) = self.own(&endpoint);
        let l = self.learnt.entry(endpoint).or_insert(Learnt {
            overhead: LogMean::new(overhead),
            per_token: LogMean::new(per_token),
            seen_at: 0,
        });
        l.overhead.ln = overhead.max(1e-9).ln();
        l.per_token.ln = per_token.max(1e-9).ln();
        l.seen_at = self.observations;
        let ttft = ttft_ms as f64;
        let running = running.max(0.0);
        let decode_ms = self.decode.slope() * running;
        if work_tokens <= small {
            // The fixed part: what is left once the decode load is taken out.
            l.overhead
                .observe((ttft - decode_ms).max(ttft * 0.1).max(0.01), lr);
            self.decode.add(running, ttft);
        } else {
            // The part past the fixed overhead and the decode load, never
            // below a tenth of the observation (a part learnt too high must
            // not zero it).
            let prefill = (ttft - l.overhead.value() - decode_ms).max(ttft * 0.1);
            l.per_token.observe(prefill / work_tokens as f64, lr);
        }
        self.refresh_fleet();
    }

    /// Forgets endpoints that left the pool.
    pub fn retain(&mut self, pool: &[Endpoint]) {
        self.learnt.retain(|e, _| pool.contains(e));
        self.refresh_fleet();
    }

    /// The prediction for `endpoint` with `ahead` tokens of prefill before
    /// this request's `uncached` ones.
    /// `running` requests decode there; `queued` is the number of requests
    /// each endpoint has waiting, on average over the pool: that many wait
    /// behind this request's prefill.
    pub fn predict(
        &self,
        endpoint: &Endpoint,
        ahead: f64,
        uncached: f64,
        running: f64,
        queued: f64,
    ) -> Prediction {
        let r = self.rates(endpoint);
        let ahead = ahead.max(0.0);
        let uncached = uncached.max(0.0);
        let running = running.max(0.0);
        let decode_ms = self.decode.slope() * running;
        let ttft_ms = r.overhead_ms + decode_ms + (ahead + uncached) * r.ms_per_token;
        let queue_cost_ms = uncached * r.ms_per_token * queued.max(0.0);
        Prediction {
            ttft_ms,
            ahead_tokens: ahead,
            uncached_tokens: uncached,
            ms_per_token: r.ms_per_token,
            overhead_ms: r.overhead_ms,
            running,
            decode_ms,
            queue_cost_ms,
            cost_ms: ttft_ms + queue_cost_ms,
        }
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

    fn model() -> TtftModel {
        TtftModel::new(&TtftConfig::default())
    }

    #[test]
    fn unobserved_endpoints_use_the_priors() {
        let m = model();
        let p = m.predict(&ep(1), 1000.0, 500.0, 0.0, 0.0);
        assert!((p.ttft_ms - (20.0 + 1500.0 * 0.1)).abs() < 1e-6, "{p:?}");
        assert_eq!(m.rates(&ep(1)).observations, 0);
    }

    #[test]
    fn learns_an_endpoints_rates_and_keeps_them_apart() {
        let mut m = model();
        // Endpoint 1: 5 ms overhead, 0.02 ms/token; endpoint 2 five times slower.
        for i in 0..50u64 {
            let work = 1_000 + 100 * (i % 7);
            m.observe(ep(1), 10, 0.0, 5);
            m.observe(ep(1), work, 0.0, 5 + work / 50);
            m.observe(ep(2), 10, 0.0, 5);
            m.observe(ep(2), work, 0.0, 5 + work / 10);
        }
        let (a, b) = (m.rates(&ep(1)), m.rates(&ep(2)));
        assert!((a.overhead_ms - 5.0).abs() < 0.5, "{a:?}");
        assert!((a.ms_per_token - 0.02).abs() < 0.004, "{a:?}");
        assert!((b.ms_per_token - 0.1).abs() < 0.02, "{b:?}");
        let (p1, p2) = (
            m.predict(&ep(1), 0.0, 4000.0, 0.0, 0.0),
            m.predict(&ep(2), 0.0, 4000.0, 0.0, 0.0),
        );
        assert!(p2.ttft_ms > 3.5 * p1.ttft_ms, "{p1:?} {p2:?}");
    }

    #[test]
    fn one_outlier_moves_a_rate_at_most_fourfold_and_is_forgotten() {
        let mut m = model();
        for _ in 0..40 {
            m.observe(ep(1), 2_000, 0.0, 20 + 40);
        }
        let before = m.rates(&ep(1)).ms_per_token;
        m.observe(ep(1), 2_000, 0.0, 600_000); // ten minutes behind a stall
        let hit = m.rates(&ep(1)).ms_per_token;
        assert!(
            hit <= before * MAX_STEP.powf(0.1) + 1e-12,
            "{before} -> {hit}"
        );
        for _ in 0..40 {
            m.observe(ep(1), 2_000, 0.0, 20 + 40);
        }
        let after = m.rates(&ep(1)).ms_per_token;
        assert!((after / before - 1.0).abs() < 0.05, "{before} -> {after}");
    }

    #[test]
    fn adapts_when_an_endpoint_slows_down() {
        let mut m = model();
        for _ in 0..40 {
            m.observe(ep(1), 2_000, 0.0, 20 + 40);
        }
        for _ in 0..40 {
            m.observe(ep(1), 2_000, 0.0, 20 + 400);
        }
        let r = m.rates(&ep(1)).ms_per_token;
        assert!((r - 0.2).abs() < 0.03, "{r}");
    }

    #[test]
    fn an_endpoint_avoided_since_it_was_slow_is_tried_again() {
        let mut m = model();
        for _ in 0..20 {
            m.observe(ep(1), 3_000, 0.0, 20 + 3_000); // slow (1 ms/token)
            m.observe(ep(2), 3_000, 0.0, 20 + 30);
        }
        assert!(m.rates(&ep(1)).ms_per_token > 0.5);
        // Endpoint 1 gets nothing for a while; the others keep answering.
        for _ in 0..STALE_AFTER {
            m.observe(ep(2), 3_000, 0.0, 20 + 30);
            m.observe(ep(3), 3_000, 0.0, 20 + 30);
        }
        let stale = m.rates(&ep(1)).ms_per_token;
        assert!(stale < 0.05, "still shunned: {stale}");
        // Its next observation counts from there.
        m.observe(ep(1), 3_000, 0.0, 20 + 3_000);
        assert!(m.rates(&ep(1)).ms_per_token > stale);
    }

    #[test]
    fn unobserved_endpoints_are_assumed_average_not_the_prior() {
        let mut m = model();
        // The real fleet is 30 times faster than the prior: an endpoint not
        // tried yet must not look 30 times slower than the one that was.
        for _ in 0..10 {
            m.observe(ep(1), 3_000, 0.0, 20 + 10);
            m.observe(ep(2), 3_000, 0.0, 20 + 30);
        }
        let (a, b, new) = (m.rates(&ep(1)), m.rates(&ep(2)), m.rates(&ep(3)));
        assert!(
            new.ms_per_token > a.ms_per_token && new.ms_per_token < b.ms_per_token,
            "{a:?} {b:?} {new:?}"
        );
        assert_eq!(new.observations, 0);
    }

    #[test]
    fn a_restart_and_removed_endpoints_go_back_to_the_priors() {
        let mut m = model();
        for _ in 0..20 {
            m.observe(ep(1), 2_000, 0.0, 1_000);
        }
        assert!(m.rates(&ep(1)).ms_per_token > 0.3);
        m.retain(&[ep(2)]);
        assert_eq!(m.rates(&ep(1)), model().rates(&ep(1)));
        let fresh = model();
        assert!((fresh.rates(&ep(1)).ms_per_token - 0.1).abs() < 1e-12);
    }

    #[test]
    fn garbage_observations_do_not_poison() {
        let mut m = model();
        m.observe(ep(1), u64::MAX, 0.0, u64::MAX);
        m.observe(ep(1), 0, 0.0, 0);
        m.observe(ep(1), 1_000, 0.0, 0);
        let r = m.rates(&ep(1));
        assert!(r.ms_per_token.is_finite() && r.ms_per_token > 0.0, "{r:?}");
        assert!(r.overhead_ms.is_finite() && r.overhead_ms > 0.0, "{r:?}");
        m.routed(0);
        m.routed(u64::MAX);
        assert!(m.mean_uncached_tokens().is_finite());
    }

    #[test]
    fn learns_what_decoding_requests_add_to_a_first_token() {
        let mut m = model();
        // Short requests: 10 ms plus 3 ms per request decoding alongside.
        for i in 0..200u64 {
            let running = (i % 9) as f64;
            m.observe(ep(1), 10, running, 10 + 3 * (i % 9));
        }
        let idle = m.predict(&ep(1), 0.0, 10.0, 0.0, 0.0);
        let busy = m.predict(&ep(1), 0.0, 10.0, 8.0, 0.0);
        assert!((busy.decode_ms - 24.0).abs() < 2.0, "{busy:?}");
        assert!((idle.ttft_ms - 10.0).abs() < 2.0, "{idle:?}");
        // An idle pod of the same fleet is predicted faster than a busy one.
        let other = m.predict(&ep(2), 0.0, 10.0, 0.0, 0.0);
        assert!(other.ttft_ms + 20.0 < busy.ttft_ms, "{other:?} {busy:?}");
    }
}
