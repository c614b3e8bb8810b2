//! How much longer an answer takes to stream from each endpoint than from
//! the fleet's fastest, learnt online (`scheduling.decode_speed`; the cost
//! checks and `predicted_ttft` add it to an endpoint's predicted cost).
//!
//! After its first byte an engine streams the answer at its decode speed.
//! On a fleet of like endpoints that speed differs with load only, which
//! the load scores and the TTFT model (`ttft.rs`) already price. On a mixed
//! fleet (GPU generations, tensor-parallel sizes) it differs by hardware:
//! an answer takes twice as long on a pod half as fast, and neither the
//! load scores (which count requests) nor the TTFT model (which stops at
//! the first byte) see it. So a conversation placed there by a cold pick
//! stays there, and every one of its answers is slow (`bench/README.md`,
//! "A mixed fleet").
//!
//! ## The model
//!
//! ```text
//! rate(e)  = ms per KiB of answer streamed after the first byte
//!            (a mean in log space over e's answers)
//! fastest  = min rate over the endpoints observed lately
//! extra(e) = mean answer KiB x (rate(e) - fastest)   if rate(e) > 1.5 x fastest
//!          = 0                                        otherwise
//! ```
//!
//! Bytes, not tokens: the filter counts the bytes it passes and parses none
//! of the stream. Endpoints serving the same model write about as many
//! bytes per token, so rates compare across them, and the mean answer size
//! turns the difference back into milliseconds.
//!
//! A rate within x1.5 of the fastest counts as the fastest: endpoints of
//! one kind differ by load and noise, and on such a fleet every `extra` is
//! 0, so nothing changes. An endpoint observed fewer than
//! [`MIN_OBSERVATIONS`] times has no extra (a new pod is tried, not
//! shunned), and one not observed for [`STALE_ROUNDS`] rounds of the fleet
//! drifts back to the fastest: a pod learnt slow and since avoided is tried
//! again.
//!
//! ## Learning
//!
//! One observation per streaming answer with a 2xx status from the chosen
//! endpoint, of at least [`MIN_BYTES`] after its first chunk: `(bytes,
//! first chunk to end of stream, ms)`. One observation moves a rate by at
//! most 4x (`log_mean`), and counts at most 4x the mean answer size once
//! the first 8 are in. No clock is read here; the shell passes the times.
//! Memory: one rate per endpoint (removed with it) and two numbers.

use crate::endpoint::Endpoint;
use crate::float::non_negative;
use crate::log_mean::{staleness, LogMean, MAX_STEP, WARM_UP};
use hashbrown::HashMap;

/// Answers shorter than this after their first chunk teach nothing: their
/// time is mostly the network's and the scheduler's, not decoding.
pub const MIN_BYTES: u64 = 1024;
/// Observations of an endpoint before its rate counts.
pub const MIN_OBSERVATIONS: u32 = 3;
/// Rounds of the fleet (one observation per endpoint it has rates for)
/// after which an endpoint not observed since counts as the fastest again;
/// it starts drifting after a quarter of them. In rounds, not observations:
/// on a large pool each endpoint is observed once in many.
pub const STALE_ROUNDS: u64 = 32;
/// Rates within this factor of the fastest count as the fastest.
pub const NOISE: f64 = 1.5;
/// Fleet observations between full scans for the fastest rate (a faster
/// one is taken at once; a fastest that slows down is seen at the next
/// scan).
const RESCAN_EVERY: u64 = 16;

/// One endpoint's rate.
#[derive(Clone, Copy, Debug)]
struct Rate {
    ms_per_kib: LogMean,
    /// The fleet's observation count when it was last observed.
    seen_at: u64,
}

/// Each endpoint's decode rate, the fastest, and the mean answer size.
#[derive(Clone, Debug)]
pub struct DecodeSpeed {
    rates: HashMap<Endpoint, Rate>,
    /// Observations taken (all endpoints).
    observations: u64,
    /// ln of the fastest counted rate (`None` until one counts).
    fastest_ln: Option<f64>,
    /// Mean answer size after the first chunk, KiB (arithmetic: the extra
    /// time of an answer is linear in its size).
    mean_kib: f64,
    learning_rate: f64,
}

impl DecodeSpeed {
    /// Nothing learnt; rates move by `learning_rate` per observation after
    /// a warm-up (`scheduling.ttft.learning_rate`).
    pub fn new(learning_rate: f64) -> Self {
        DecodeSpeed {
            rates: HashMap::new(),
            observations: 0,
            fastest_ln: None,
            mean_kib: 0.0,
            learning_rate,
        }
    }

    /// `endpoint` streamed `bytes` after its first chunk in `ms`.
    pub fn observe(&mut self, endpoint: Endpoint, bytes: u64, ms: u64) {
        if bytes < MIN_BYTES {
            return;
        }
        let kib = bytes as f64 / 1024.0;
        // A millisecond clock: an answer streamed within one tick took up
        // to one.
        let rate = (ms as f64).max(0.5) / kib;
        self.observations += 1;
        let n = self.observations;
        let lr = self.learning_rate;
        // The plain mean at first, then exponential; past the warm-up one
        // answer counts at most 4x the mean (a client asking for a huge
        // answer cannot inflate every endpoint's extra time at once).
        let sized = if n > u64::from(WARM_UP) {
            kib.min(MAX_STEP * self.mean_kib)
        } else {
            kib
        };
        self.mean_kib += (sized - self.mean_kib) * (1.0 / n as f64).max(lr);
        let at = self.effective_ln(&endpoint);
        let r = self.rates.entry(endpoint).or_insert(Rate {
            ms_per_kib: LogMean::at(rate),
            seen_at: n,
        });
        // A stale endpoint resumes from where it drifted.
        if let Some(ln) = at {
            r.ms_per_kib.ln = ln;
        }
        r.ms_per_kib.observe(rate, lr);
        r.seen_at = n;
        let counts = r.ms_per_kib.n >= MIN_OBSERVATIONS;
        let ln = r.ms_per_kib.ln;
        if n % RESCAN_EVERY == 0 {
            self.rescan();
        } else if counts && self.fastest_ln.is_none_or(|f| ln < f) {
            self.fastest_ln = Some(ln);
        }
    }

    /// How much longer than on the fastest endpoint a mean answer takes to
    /// stream from `endpoint`, ms (0 within [`NOISE`], for an endpoint not
    /// yet counted, and as a stale one drifts back).
    pub fn extra_ms(&self, endpoint: &Endpoint) -> f64 {
        let (Some(fastest), Some(ln)) = (self.fastest_ln, self.effective_ln(endpoint)) else {
            return 0.0;
        };
        if ln - fastest < NOISE.ln() {
            return 0.0;
        }
        non_negative(self.mean_kib * (ln.exp() - fastest.exp()))
    }

    /// Forgets endpoints that left the pool (`pool` sorted).
    pub fn retain(&mut self, pool: &[Endpoint]) {
        self.rates.retain(|e, _| pool.binary_search(e).is_ok());
        self.rescan();
    }

    /// ln of `endpoint`'s rate as it counts now: `None` before
    /// [`MIN_OBSERVATIONS`]; drifting to the fastest while not observed.
    fn effective_ln(&self, endpoint: &Endpoint) -> Option<f64> {
        let r = self.rates.get(endpoint)?;
        if r.ms_per_kib.n < MIN_OBSERVATIONS {
            return None;
        }
        let Some(fastest) = self.fastest_ln else {
            return Some(r.ms_per_kib.ln);
        };
        let gap = r.ms_per_kib.ln - fastest;
        Some(fastest + gap * (1.0 - self.staleness(r)))
    }

    /// 0 while `r` was observed within a quarter of [`STALE_ROUNDS`], then
    /// rising to 1 at [`STALE_ROUNDS`].
    fn staleness(&self, r: &Rate) -> f64 {
        let age = self.observations.saturating_sub(r.seen_at);
        staleness(age, self.stale_after())
    }

    /// [`STALE_ROUNDS`] in fleet observations.
    fn stale_after(&self) -> u64 {
        STALE_ROUNDS * self.rates.len().max(1) as u64
    }

    /// The fastest rate among the endpoints counted and observed lately.
    fn rescan(&mut self) {
        let (n, after) = (self.observations, self.stale_after());
        self.fastest_ln = self
            .rates
            .values()
            .filter(|r| r.ms_per_kib.n >= MIN_OBSERVATIONS && n.saturating_sub(r.seen_at) < after)
            .map(|r| r.ms_per_kib.ln)
            .reduce(f64::min);
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

    /// 8 KiB answers: endpoint i streams them at `ms_per_kib[i]` (none
    /// for 0).
    fn learn(d: &mut DecodeSpeed, ms_per_kib: &[f64], rounds: usize) {
        for _ in 0..rounds {
            for (i, &r) in ms_per_kib.iter().enumerate().filter(|(_, &r)| r > 0.0) {
                d.observe(ep(i as u8), 8192, (8.0 * r) as u64);
            }
        }
    }

    #[test]
    fn a_slower_endpoint_costs_the_mean_answer_s_extra_time() {
        let mut d = DecodeSpeed::new(0.1);
        learn(&mut d, &[50.0, 50.0, 100.0, 100.0], 10);
        assert_eq!(d.extra_ms(&ep(0)), 0.0);
        assert_eq!(d.extra_ms(&ep(1)), 0.0);
        // 8 KiB x (100 - 50) ms/KiB.
        for i in [2, 3] {
            let x = d.extra_ms(&ep(i));
            assert!((x - 400.0).abs() < 1.0, "{x}");
        }
        assert_eq!(d.extra_ms(&ep(9)), 0.0, "never observed");
    }

    #[test]
    fn like_endpoints_differing_by_noise_cost_nothing_extra() {
        let mut d = DecodeSpeed::new(0.1);
        let mut rng = fastrand::Rng::with_seed(3);
        for _ in 0..400 {
            let i = rng.u8(0..4);
            // Up to +-20 % per answer, and a load spread of 1.3x.
            let base = [50.0, 55.0, 60.0, 65.0][i as usize];
            let ms = 8.0 * base * (0.8 + 0.4 * rng.f64());
            d.observe(ep(i), 8192, ms as u64);
        }
        for i in 0..4 {
            assert_eq!(d.extra_ms(&ep(i)), 0.0, "endpoint {i}");
        }
    }

    #[test]
    fn short_answers_and_too_few_observations_teach_nothing() {
        let mut d = DecodeSpeed::new(0.1);
        learn(&mut d, &[50.0], 10);
        for _ in 0..10 {
            d.observe(ep(1), MIN_BYTES - 1, 10_000);
        }
        assert_eq!(d.extra_ms(&ep(1)), 0.0);
        for _ in 0..MIN_OBSERVATIONS - 1 {
            d.observe(ep(1), 8192, 8000);
        }
        assert_eq!(d.extra_ms(&ep(1)), 0.0, "not counted yet");
        d.observe(ep(1), 8192, 8000);
        assert!(d.extra_ms(&ep(1)) > 0.0);
    }

    #[test]
    fn one_wild_answer_moves_a_rate_by_a_bounded_factor() {
        let mut d = DecodeSpeed::new(0.1);
        learn(&mut d, &[50.0, 50.0], 20);
        // A stream stalled for ten minutes.
        d.observe(ep(1), 8192, 600_000);
        let x = d.extra_ms(&ep(1));
        // 0.1 of ln(4x) at most: 50 x 4^0.1 = 57 ms/KiB, within noise.
        assert_eq!(x, 0.0);
    }

    #[test]
    fn one_huge_answer_moves_the_mean_size_by_a_bounded_step() {
        let mut d = DecodeSpeed::new(0.1);
        learn(&mut d, &[50.0, 100.0], 10);
        let before = d.extra_ms(&ep(1));
        // 100 MiB streamed at the fast endpoint's usual rate.
        d.observe(ep(0), 100 << 20, 50 * 102_400);
        let after = d.extra_ms(&ep(1));
        // The mean size moves by a tenth of 4x the mean at most: +30 %.
        assert!(after <= before * 1.31, "{before} -> {after}");
        assert!(after > before, "{before} -> {after}");
    }

    #[test]
    fn an_endpoint_learnt_slow_and_since_avoided_drifts_back() {
        let mut d = DecodeSpeed::new(0.1);
        learn(&mut d, &[50.0, 200.0], 10);
        let slow = d.extra_ms(&ep(1));
        assert!(slow > 1000.0, "{slow}");
        // Only endpoint 0 is observed from now on: 2 endpoints, so
        // STALE_ROUNDS x 2 observations.
        let after = STALE_ROUNDS * 2;
        for k in 1..=after {
            d.observe(ep(0), 8192, 400);
            if k == after / 4 {
                assert_eq!(d.extra_ms(&ep(1)), slow, "not drifting yet");
            }
            if k == after / 2 {
                let x = d.extra_ms(&ep(1));
                assert!(x > 0.0 && x < slow, "{x} drifting from {slow}");
            }
        }
        assert_eq!(d.extra_ms(&ep(1)), 0.0);
        // Observed again, it resumes from where it drifted.
        d.observe(ep(1), 8192, 1600);
        assert!(d.extra_ms(&ep(1)) < slow);
    }

    #[test]
    fn a_fastest_endpoint_that_slows_down_or_leaves_stops_being_the_reference() {
        let mut d = DecodeSpeed::new(0.5);
        learn(&mut d, &[25.0, 100.0, 100.0], 10);
        assert!(d.extra_ms(&ep(1)) > 0.0);
        // Endpoint 0 leaves the pool: the others are alike.
        let pool = [ep(1), ep(2)];
        d.retain(&pool);
        assert_eq!(d.extra_ms(&ep(1)), 0.0);
        assert_eq!(d.extra_ms(&ep(2)), 0.0);
        // Endpoint 1 speeds up; then it slows down again.
        learn(&mut d, &[0.0, 25.0, 100.0], 20);
        assert!(d.extra_ms(&ep(2)) > 0.0);
        learn(&mut d, &[0.0, 100.0, 100.0], 40);
        assert_eq!(d.extra_ms(&ep(2)), 0.0, "rescanned within 16 observations");
    }

    #[test]
    fn a_restarted_model_starts_from_nothing() {
        let d = DecodeSpeed::new(0.1);
        assert_eq!(d.extra_ms(&ep(0)), 0.0);
    }
}
