//! The predicted time to first token (TTFT) of a request on each endpoint,
//! with rates learnt online from what the filter sees (`scheduling.profile:
//! predicted_ttft`, and the cost checks `scheduling.keep_cheaper_holder`
//! and `scheduling.leave_costlier_holder` of the other profiles).
//!
//! ## The model
//!
//! An engine prefills the uncached prompt tokens it was sent, roughly in
//! arrival order, in steps that also carry one token of every running
//! (decoding) request. For request `r` on endpoint `e`:
//!
//! ```text
//! ahead(e)    = kvroute's in-flight uncached tokens on e (all workers, all replicas)
//!               less what e has prefilled of them since it last answered one
//!             + max(0, engine waiting - kvroute's waiting on e) x mean uncached tokens
//! uncached(e) = prompt tokens - tokens of r's prefix e holds
//! running(e)  = max(engine running, kvroute's requests past their first byte)
//! present(e)  = max(engine running + engine waiting, kvroute's requests on e)
//! TTFT(e)     = f(e) x (overhead + ms_per_token x (ahead(e) + uncached(e))
//!                              + ms_per_running x running(e))
//!             + max(0, slot wait(e) - f(e) x ms_per_token x ahead(e))
//! ```
//!
//! What `e` has prefilled of kvroute's in-flight tokens: since its last
//! first byte (or since it was first waited on, `InFlight::progress_ms`) it
//! has drained them in order at its rates, after the fixed part and the
//! decode load; at least one mean request stays ahead while one waits
//! ([`TtftModel::unprefilled_tokens`]).
//!
//! `slot wait(e)` is what the request waits for one of the engine's slots
//! to free up (`slots.rs`, `scheduling.slot_wait`; 0 without a limit,
//! learnt or `scheduling.engine_slots`): it starts after the longer of
//! that wait and its prefill queue.
//!
//! The engine's counts are its last fresh scrape's, less kvroute's requests
//! that scrape counted and kvroute has seen finish since
//! (`ScrapeState::current`): a request that ended after the scrape no
//! longer holds a slot nor waits.
//!
//! The second `ahead` term counts requests the engine queues that kvroute
//! did not send (other gateways, other clients), at the mean size kvroute
//! sees; it is used only while the endpoint's snapshot is fresh.
//!
//! ## The decision
//!
//! ```text
//! cost(e) = TTFT(e) + f(e) x ms_per_token x uncached(e) x present(e)
//! ```
//!
//! With `scheduling.decode_speed` (a mixed fleet), `cost(e)` also holds how
//! much longer a mean answer streams from `e` than from the fleet's fastest
//! endpoint (`decode_speed.rs`; the router adds it, `slow_decode_ms`).
//!
//! An endpoint holding less of the prompt than the cheapest healthy holder
//! `h` of its longest prefix is ranked by its cost plus a charge for
//! leaving `h`, the rule of the two cost checks (`router/cost.rs`,
//! `charge_moves`):
//!
//! ```text
//! repeat(e) = f(e) x ms_per_token x (uncached(e) - uncached(h))
//! rank(e)   = cost(e) + repeat(e) x min(1, arrivals per ms x repeat(e)) + overhead(h)
//! ```
//!
//! (arrivals per ms: the requests the fleet sends an endpoint, by Little's
//! law). Uncharged, a holder that had just started prefilling a document
//! counted it as ahead, as much as a question's own prefill of it
//! elsewhere, and a near tie split the document.
//!
//! The endpoint with the lowest rank wins. The second term of `cost` is
//! what this request's prefill costs the others: every request `e` holds
//! waits for it, step after step. That is the ones decoding there, and the
//! ones waiting for their own prefill too: they are ahead of this one, so
//! they decode while its prefill runs. (Counting only the decoding ones undercounts a
//! pod busy prefilling: few of its requests decode yet, and a saturated
//! fleet then moved prompts onto it, each a re-prefill on a full engine:
//! `bench/README.md`, saturation, TTFT p50 about 2x worse than with
//! `present`.) On an idle fleet it is zero and the rule is
//! plain lowest-TTFT: a long prefix stays on its holder until the holder's
//! queue and decode load cost more than prefilling the prompt elsewhere
//! (and one step);
//! then the prefix gains a second holder and later requests balance over
//! both. Under saturation every pod is decoding, a miss delays all of them,
//! and hits weigh more: a cache hit is the only way to add capacity. Cold
//! requests (no holder anywhere): every endpoint within
//! `scheduling.cold_margin` of the best cost is acceptable and the picker
//! rotates among them (`scheduler/picker.rs`).
//!
//! ## Learning
//!
//! Each streaming request that gets a first byte from its chosen endpoint,
//! with a 2xx status (an error answer comes at once, with no prefill: a pod
//! that fails fast must not be learnt fast and draw every request), is one
//! observation `(1, ahead + uncached, running) -> routing to first
//! byte`, less the slot wait predicted for it (`Router::first_byte`). The fleet's `(overhead, ms_per_token, ms_per_running)` is a
//! least-squares fit of them, decayed (a window of about 200 observations)
//! and ridged toward the configured priors (`scheduling.ttft`), so it holds
//! with few or degenerate observations; an observation counts at most 4x
//! what the fit expected (a wait behind a stall cannot ruin it). The fixed
//! part is at most the fastest first byte seen lately (the least
//! observation, rising 0.5 % an observation): an engine that batches
//! prefills returns a burst's first tokens together, whatever was queued
//! ahead of each, and fitted freely that made the fixed part the mean
//! first token and the work free. Each endpoint's factor `f(e)` is the
//! mean, in log space, of its observed over expected times, relative to the
//! endpoints observed lately: an endpoint not observed yet is 1 (average:
//! neither shunned nor flooded), a factor within x1.5 of 1 is 1 (equal pods
//! are not ranked by noise), and one not observed for 256 fleet
//! observations (or 32 rounds of the fleet, if more) drifts back to 1, from
//! a quarter of that on (an endpoint learnt slow and since avoided is tried
//! again). Memory: a 3x3 fit, the fastest first byte, and two numbers per
//! endpoint (removed with it). No clock is read here: the shell
//! passes the times. A restarted VM starts from the priors and relearns
//! within a few requests.

use crate::config::TtftConfig;
use crate::endpoint::Endpoint;
use crate::float::{max_num, min_num, non_negative};
use crate::inflight::InFlight;
use crate::log_mean::{staleness, LogMean, MAX_STEP, WARM_UP};
use hashbrown::HashMap;

/// Fleet observations after which an endpoint not observed since counts
/// as average again (so one learnt slow, and since avoided, is tried again
/// rather than shunned forever on stale data); it starts drifting after a
/// quarter of them. At least this many...
const STALE_AFTER: u64 = 256;
/// ... and at least this many rounds of the fleet (one observation per
/// endpoint learnt): in a large pool each endpoint is observed once in
/// many, and a factor that drifted between two of its own observations
/// was never learnt (64 endpoints hid one three times slower).
const STALE_ROUNDS: u64 = 32;
/// Endpoint factors within this of 1 count as 1 (noise).
const NOISE: f64 = 1.5;
/// Weight the fleet fit keeps of its past at each observation (a window of
/// about 200 observations).
const FIT_DECAY: f64 = 0.995;
/// Weight of the priors in the fit, in observations.
const PRIOR_WEIGHT: f64 = 2.0;
/// Typical scale of each regressor (1, work tokens, running requests), so
/// the priors weigh alike on each coefficient.
const SCALE: [f64; 3] = [1.0, 1000.0, 4.0];

/// The fleet's first-byte time as a linear function of
/// `(1, work tokens, running requests)`: decayed least squares, ridged
/// toward the configured priors.
#[derive(Clone, Copy, Debug)]
struct Fit {
    xtx: [[f64; 3]; 3],
    xty: [f64; 3],
    /// Observations taken (undecayed).
    n: u64,
    /// (overhead ms, ms per work token, ms per running request).
    theta: [f64; 3],
    prior: [f64; 3],
    /// The fastest first byte lately, at the fleet's scale (the least
    /// observation, rising by the decay per observation): what the fixed
    /// part may not exceed.
    fastest: f64,
}

impl Fit {
    fn new(prior: [f64; 3]) -> Self {
        Fit {
            xtx: [[0.0; 3]; 3],
            xty: [0.0; 3],
            n: 0,
            theta: prior,
            prior,
            fastest: f64::INFINITY,
        }
    }

    fn at(&self, x: [f64; 3]) -> f64 {
        (0..3).map(|j| self.theta[j] * x[j]).sum()
    }

    fn add(&mut self, x: [f64; 3], y: f64) {
        if !(y.is_finite() && x.iter().all(|v| v.is_finite())) {
            return;
        }
        for i in 0..3 {
            for j in 0..3 {
                self.xtx[i][j] = self.xtx[i][j] * FIT_DECAY + x[i] * x[j];
            }
            self.xty[i] = self.xty[i] * FIT_DECAY + x[i] * y;
        }
        self.n += 1;
        // Ridge toward the priors, each at the typical scale of its regressor.
        let mut a = self.xtx;
        let mut b = self.xty;
        for j in 0..3 {
            let l = PRIOR_WEIGHT * SCALE[j] * SCALE[j];
            a[j][j] += l;
            b[j] += l * self.prior[j];
        }
        // The fixed part of a first token is at most the fastest one seen:
        // fitted above it, it was absorbing the work's cost. First tokens
        // that a batching engine returns together, whatever was queued
        // ahead of each (kvroute-sim prefills several prompts in one step,
        // as vLLM does), fitted an overhead of the mean first token and
        // nothing per token: queued work then cost nothing, and one worker
        // sent a burst of 16 new prompts to one pod (no-reuse, TTFT p99
        // 1.1 s against 0.53 s).
        self.fastest = min_num(y, self.fastest / FIT_DECAY);
        let t = solve3(a, b).map(|t| match t[0] > self.fastest {
            true => with_overhead(a, b, self.fastest.max(0.1)).unwrap_or(t),
            false => t,
        });
        if let Some(t) = t {
            self.theta = [t[0].max(0.1), t[1].max(1e-7), t[2].max(0.0)];
        }
    }
}

/// The least-squares solution of `a x = b` (the normal equations) with
/// `x[0]` fixed at `overhead`: the other two solved for what it leaves;
/// `None` when singular.
fn with_overhead(a: [[f64; 3]; 3], b: [f64; 3], overhead: f64) -> Option<[f64; 3]> {
    let r1 = b[1] - a[1][0] * overhead;
    let r2 = b[2] - a[2][0] * overhead;
    let det = a[1][1] * a[2][2] - a[1][2] * a[2][1];
    if det.abs() < 1e-12 {
        return None;
    }
    let x1 = (r1 * a[2][2] - a[1][2] * r2) / det;
    let x2 = (a[1][1] * r2 - a[2][1] * r1) / det;
    [x1, x2]
        .iter()
        .all(|v| v.is_finite())
        .then_some([overhead, x1, x2])
}

/// Solves `a x = b` (Gaussian elimination with partial pivoting); `None`
/// when singular.
fn solve3(mut a: [[f64; 3]; 3], mut b: [f64; 3]) -> Option<[f64; 3]> {
    for col in 0..3 {
        let pivot = (col..3).max_by(|&i, &j| a[i][col].abs().total_cmp(&a[j][col].abs()))?;
        if a[pivot][col].abs() < 1e-12 {
            return None;
        }
        a.swap(col, pivot);
        b.swap(col, pivot);
        for row in col + 1..3 {
            let f = a[row][col] / a[col][col];
            let pivot_row = a[col];
            for (x, p) in a[row].iter_mut().zip(pivot_row).skip(col) {
                *x -= f * p;
            }
            b[row] -= f * b[col];
        }
    }
    let mut x = [0.0; 3];
    for row in (0..3).rev() {
        let rest: f64 = (row + 1..3).map(|k| a[row][k] * x[k]).sum();
        x[row] = (b[row] - rest) / a[row][row];
    }
    x.iter().all(|v| v.is_finite()).then_some(x)
}

/// What an endpoint has been learnt to be.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Rates {
    /// Fixed part of a first token, ms.
    pub overhead_ms: f64,
    /// Prefill time per token of work, ms.
    pub ms_per_token: f64,
    /// What one request decoding alongside adds to a first token, ms.
    pub ms_per_running: f64,
    /// Observations of this endpoint.
    pub observations: u32,
}

/// One endpoint's factor over the fleet's rates.
#[derive(Clone, Copy, Debug)]
struct Learnt {
    factor: LogMean,
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
    /// The endpoint's prefill time per token, ms.
    pub ms_per_token: f64,
    /// The endpoint's fixed part, ms.
    pub overhead_ms: f64,
    /// Requests running (decoding) there.
    pub running: f64,
    /// What they add to the first token, ms.
    pub decode_ms: f64,
    /// Requests there (running and waiting): each waits for this
    /// request's prefill.
    pub present: f64,
    /// What this request's prefill delays the requests there, in total, ms
    /// (`uncached x ms_per_token x present`).
    pub others_delay_ms: f64,
    /// How much longer than its prefill queue the request waits here for
    /// one of the engine's slots to free up, ms (`slots.rs`; 0 below the
    /// endpoint's limit, without one, and with `scheduling.slot_wait`
    /// off). Part of `ttft_ms`.
    pub slot_wait_ms: f64,
    /// How much longer a mean answer streams here than from the fleet's
    /// fastest endpoint, ms (`decode_speed.rs`; 0 on a fleet of like
    /// endpoints, and with `scheduling.decode_speed` off).
    pub slow_decode_ms: f64,
    /// What the decision minimises: `ttft_ms + others_delay_ms +
    /// slow_decode_ms`.
    pub cost_ms: f64,
    /// With `predicted_ttft`, what leaving the holder of the request's
    /// longest prefix for this endpoint is charged on top of `cost_ms`, ms:
    /// the prefill it repeats, weighed by the arrivals expected while it
    /// runs, plus the holder's fixed part (`router/cost.rs`,
    /// `charge_moves`, the rule of the two cost checks). 0 on a holder, on
    /// a cold request and in the other profiles.
    pub move_charge_ms: f64,
}

impl Prediction {
    /// What a `predicted_ttft` pick ranks by: the cost, charged for leaving
    /// the prefix's holder.
    pub fn rank_ms(&self) -> f64 {
        self.cost_ms + self.move_charge_ms
    }
}

/// An observed time to first token as a percentage of its prediction, for
/// the `kvroute.ttft_vs_predicted_percent` histogram: 100 is exact, 200 took
/// twice as long as predicted. Bounded to 1..=10 000 (100x either way); a
/// prediction that is not a positive number counts as 1 ms.
pub fn observed_percent(observed_ms: u64, predicted_ms: f64) -> u64 {
    let predicted = if predicted_ms >= 1.0 {
        predicted_ms
    } else {
        1.0
    };
    // `as` saturates (NaN is ruled out above: it fails the comparison).
    ((observed_ms as f64 / predicted * 100.0).round() as u64).clamp(1, 10_000)
}

/// The fleet's learnt rates, each endpoint's factor, and the mean request
/// size.
#[derive(Clone, Debug)]
pub struct TtftModel {
    config: TtftConfig,
    fit: Fit,
    learnt: HashMap<Endpoint, Learnt>,
    /// Mean log factor of the observed endpoints: factors are relative to
    /// it (the fleet fit and the factors would otherwise drift together).
    mean_ln: f64,
    /// Mean uncached tokens of a routed request (for queued requests
    /// kvroute did not send).
    mean_uncached: LogMean,
    /// The longest first byte observed lately (each as the fit took it,
    /// outliers cut), decayed as the fit is: how long a queue may go
    /// unanswered and still be draining ([`TtftModel::unprefilled_tokens`]).
    longest_ms: f64,
}

impl TtftModel {
    /// A model at the configured priors.
    pub fn new(config: &TtftConfig) -> Self {
        TtftModel {
            fit: Fit::new([
                config.prior_overhead_ms.max(0.1),
                config.prior_ms_per_token,
                0.0,
            ]),
            config: config.clone(),
            learnt: HashMap::new(),
            mean_ln: 0.0,
            mean_uncached: LogMean::at(512.0),
            longest_ms: 0.0,
        }
    }

    /// `endpoint`'s factor over the fleet: 1 when not observed, within
    /// noise of 1, or as it drifts back to 1 while not observed.
    fn factor(&self, endpoint: &Endpoint) -> (f64, u32) {
        let Some(l) = self.learnt.get(endpoint) else {
            return (1.0, 0);
        };
        let ln = self.drifted_ln(l);
        let f = if ln.abs() < NOISE.ln() { 1.0 } else { ln.exp() };
        (f, l.factor.n)
    }

    /// `l`'s log factor relative to the fleet, drifted toward 0 as it goes
    /// stale (the noise band not applied).
    fn drifted_ln(&self, l: &Learnt) -> f64 {
        let stale = staleness(self.fit.n.saturating_sub(l.seen_at), self.stale_after());
        (l.factor.ln - self.mean_ln) * (1.0 - stale)
    }

    /// The rates of `endpoint`: the fleet's, times its factor.
    pub fn rates(&self, endpoint: &Endpoint) -> Rates {
        let (f, observations) = self.factor(endpoint);
        Rates {
            overhead_ms: f * self.fit.theta[0],
            ms_per_token: f * self.fit.theta[1],
            ms_per_running: f * self.fit.theta[2],
            observations,
        }
    }

    /// Mean uncached tokens of the requests routed so far.
    pub fn mean_uncached_tokens(&self) -> f64 {
        self.mean_uncached.value()
    }

    /// kvroute's in-flight uncached tokens on `endpoint` its engine has not
    /// prefilled yet at `now_ms`, by the model: since `inflight.progress_ms`
    /// (its last first byte, or when it started being waited on) it has
    /// drained its queue at its rates, after the fixed part of a first
    /// token and the decode load of its `running` requests. A document
    /// 2 s into a 2.2 s prefill is mostly done: counting all of it as
    /// ahead priced the holder like an idle pod that would prefill it all
    /// again. At least one mean request stays ahead while one is waited
    /// on (all of them if they are fewer): a first byte overdue is not a
    /// queue drained.
    ///
    /// The credit is for time no longer than the longest first byte seen
    /// lately (none before the first), and shrinks back to nothing over as
    /// long again: an engine silent for that long is not draining (a
    /// frozen engine whose `/metrics` still answers must not look idle and
    /// draw every request). It never depends on the tokens in flight, so
    /// more of them never look like less work.
    pub fn unprefilled_tokens(
        &self,
        endpoint: &Endpoint,
        inflight: InFlight,
        running: f64,
        now_ms: u64,
    ) -> f64 {
        let tokens = inflight.tokens as f64;
        if inflight.waiting == 0 || tokens <= 0.0 {
            return tokens;
        }
        let r = self.rates(endpoint);
        let elapsed = now_ms.saturating_sub(inflight.progress_ms) as f64;
        let busy = non_negative(elapsed - r.overhead_ms - r.ms_per_running * non_negative(running));
        let credited_ms = min_num(busy, non_negative(2.0 * self.longest_ms - busy));
        let prefilled = if r.ms_per_token > 0.0 {
            credited_ms / r.ms_per_token
        } else {
            0.0
        };
        let floor = min_num(tokens, self.mean_uncached_tokens());
        max_num(tokens - prefilled, floor)
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
        let x = [1.0, work_tokens as f64, running.max(0.0)];
        let expected = self.fit.at(x).max(0.1);
        // An outlier (a wait behind a stall) counts as at most 4x the
        // expectation once the fit has data.
        let mut y = ttft_ms as f64;
        if self.fit.n >= u64::from(WARM_UP) {
            y = y.min(MAX_STEP * expected + 50.0);
        }
        self.longest_ms = max_num(y, self.longest_ms * FIT_DECAY);
        // The endpoint's factor first, then the fleet fit with the
        // observation brought to the fleet's scale.
        let (current, _) = self.factor(&endpoint);
        let seen_at = self.fit.n + 1;
        let mean_ln = self.mean_ln;
        // A stale endpoint resumes from where it drifted; one within the
        // noise band from where it was learnt, not from 1 (else a factor
        // inside the band could never leave it: a pod turning three times
        // slower by degrees was never learnt slow).
        let resume = self
            .learnt
            .get(&endpoint)
            .map(|l| mean_ln + self.drifted_ln(l));
        let lr = self.config.learning_rate;
        let l = self.learnt.entry(endpoint).or_insert(Learnt {
            factor: LogMean { ln: mean_ln, n: 0 },
            seen_at,
        });
        if let Some(ln) = resume {
            l.factor.ln = ln;
        }
        l.factor.observe(y.max(0.1) / expected, lr);
        l.seen_at = seen_at;
        let f = current.max(1e-3);
        self.fit.add(x, y / f);
        // A scan of every endpoint learnt: each time on a small pool, every
        // 16th observation on a large one (the mean moves slowly).
        if self.learnt.len() <= 64 || self.fit.n % 16 == 0 {
            self.recentre();
        }
    }

    /// Factors are relative to the mean of the endpoints observed lately
    /// (a stale one no longer counts).
    fn recentre(&mut self) {
        let after = self.stale_after();
        let (mut sum, mut weight) = (0.0, 0.0);
        for l in self.learnt.values() {
            let w = 1.0 - staleness(self.fit.n.saturating_sub(l.seen_at), after);
            sum += w * l.factor.ln;
            weight += w;
        }
        if weight > 0.0 {
            self.mean_ln = sum / weight;
        }
    }

    /// Fleet observations after which an endpoint not observed since is
    /// wholly stale: [`STALE_AFTER`], or [`STALE_ROUNDS`] rounds of the
    /// endpoints learnt if more.
    fn stale_after(&self) -> u64 {
        STALE_AFTER.max(STALE_ROUNDS * self.learnt.len() as u64)
    }

    /// Forgets endpoints that left the pool (`pool` sorted, as the
    /// router keeps it: a binary search each, not a scan of 1024).
    pub fn retain(&mut self, pool: &[Endpoint]) {
        self.learnt.retain(|e, _| pool.binary_search(e).is_ok());
        self.recentre();
    }

    /// The prediction for `endpoint` with `ahead` tokens of prefill before
    /// this request's `uncached` ones, while `running` requests decode there
    /// out of `present` it holds (running and waiting), and a wait of
    /// `slot_wait_ms` for a free slot (`slots.rs`): the request starts
    /// after the longer of that wait and its prefill queue.
    pub fn predict(
        &self,
        endpoint: &Endpoint,
        ahead: f64,
        uncached: f64,
        running: f64,
        present: f64,
        slot_wait_ms: f64,
    ) -> Prediction {
        let r = self.rates(endpoint);
        let ahead = non_negative(ahead);
        let uncached = non_negative(uncached);
        let running = non_negative(running);
        let present = max_num(present, running);
        let decode_ms = r.ms_per_running * running;
        let slot_wait_ms = non_negative(slot_wait_ms - ahead * r.ms_per_token);
        let ttft_ms =
            r.overhead_ms + decode_ms + (ahead + uncached) * r.ms_per_token + slot_wait_ms;
        let others_delay_ms = uncached * r.ms_per_token * present;
        Prediction {
            ttft_ms,
            ahead_tokens: ahead,
            uncached_tokens: uncached,
            ms_per_token: r.ms_per_token,
            overhead_ms: r.overhead_ms,
            running,
            decode_ms,
            present,
            others_delay_ms,
            slot_wait_ms,
            slow_decode_ms: 0.0,
            cost_ms: ttft_ms + others_delay_ms,
            move_charge_ms: 0.0,
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

    #[test]
    fn an_observation_is_a_bounded_percentage_of_its_prediction() {
        assert_eq!(observed_percent(100, 100.0), 100);
        assert_eq!(observed_percent(300, 100.0), 300);
        assert_eq!(observed_percent(50, 200.0), 25);
        // Bounded both ways: a stall, an instant answer.
        assert_eq!(observed_percent(600_000, 10.0), 10_000);
        assert_eq!(observed_percent(0, 500.0), 1);
        // A degenerate prediction counts as 1 ms.
        for p in [0.0, -5.0, f64::NAN, 0.2] {
            assert_eq!(observed_percent(30, p), 3_000, "{p}");
        }
        assert_eq!(observed_percent(30, f64::INFINITY), 1);
    }

    fn model() -> TtftModel {
        TtftModel::new(&TtftConfig::default())
    }

    /// A fleet whose first byte takes 10 ms + 0.02 ms per work token +
    /// 3 ms per running request, times `slow` on endpoint 2.
    fn teach(m: &mut TtftModel, n: u64, slow: f64) {
        for i in 0..n {
            let work = 200 + 700 * (i % 11);
            let running = (i % 7) as f64;
            let y = |f: f64| (f * (10.0 + 0.02 * work as f64 + 3.0 * running)) as u64;
            m.observe(ep(1), work, running, y(1.0));
            m.observe(ep(2), work, running, y(slow));
        }
    }

    #[test]
    fn unobserved_fleets_use_the_priors() {
        let m = model();
        let p = m.predict(&ep(1), 1000.0, 500.0, 0.0, 0.0, 0.0);
        assert!((p.ttft_ms - (20.0 + 1500.0 * 0.1)).abs() < 1e-6, "{p:?}");
        assert_eq!(m.rates(&ep(1)).observations, 0);
    }

    #[test]
    fn a_slot_wait_counts_beyond_the_prefill_queue_only() {
        let m = model();
        // At the priors: 20 ms + 0.1 ms per token, 1000 tokens ahead.
        let queued = m.predict(&ep(1), 1000.0, 500.0, 0.0, 0.0, 0.0);
        // A slot frees up before the queue ahead is prefilled: no more.
        let soon = m.predict(&ep(1), 1000.0, 500.0, 0.0, 0.0, 60.0);
        assert_eq!(soon.ttft_ms, queued.ttft_ms);
        assert_eq!(soon.slot_wait_ms, 0.0);
        // A longer wait counts beyond the queue, in the TTFT and the cost.
        let late = m.predict(&ep(1), 1000.0, 500.0, 0.0, 0.0, 2100.0);
        assert!((late.slot_wait_ms - 2000.0).abs() < 1e-6, "{late:?}");
        assert!((late.ttft_ms - queued.ttft_ms - 2000.0).abs() < 1e-6);
        assert!((late.cost_ms - queued.cost_ms - 2000.0).abs() < 1e-6);
    }

    #[test]
    fn learns_overhead_per_token_and_decode_load() {
        let mut m = model();
        teach(&mut m, 150, 1.0);
        let r = m.rates(&ep(1));
        assert!((r.overhead_ms - 10.0).abs() < 2.0, "{r:?}");
        assert!((r.ms_per_token - 0.02).abs() < 0.003, "{r:?}");
        assert!((r.ms_per_running - 3.0).abs() < 0.5, "{r:?}");
        // An endpoint never observed is taken at the fleet's rates: an idle
        // one beats a busy one for a short request.
        let busy = m.predict(&ep(1), 0.0, 300.0, 20.0, 20.0, 0.0);
        let idle = m.predict(&ep(3), 0.0, 300.0, 0.0, 0.0, 0.0);
        assert!(idle.ttft_ms + 50.0 < busy.ttft_ms, "{idle:?} {busy:?}");
        assert!((busy.decode_ms - 60.0).abs() < 10.0, "{busy:?}");
    }

    #[test]
    fn first_tokens_returned_together_still_price_the_work_ahead() {
        // A batching engine (vLLM, kvroute-sim) prefills a burst of prompts
        // in one step and returns their first tokens together, whatever
        // was queued ahead of each: 1500-token prompts with 0 to 6000
        // tokens ahead, answered in 230 ms in a shared step or 70 ms
        // alone, which is not the one with the least ahead. Fitted freely,
        // that is an overhead of about the mean first token and nothing
        // per token.
        let mut m = model();
        for i in 0..200u64 {
            let work = 1_500 * (1 + i % 5);
            let y = if (i / 5) % 4 == 0 { 70 } else { 230 };
            m.observe(ep(1), work, 0.0, y);
        }
        let r = m.rates(&ep(1));
        // The fixed part is no longer than the fastest first token lately
        // (70 ms, 15 observations ago at most: the bound rises 0.5 % an
        // observation)...
        assert!(r.overhead_ms <= 70.0 / FIT_DECAY.powi(15) + 1e-6, "{r:?}");
        // ... so the work pays for the rest, and 25 000 tokens queued cost
        // more than an idle pod's 1500.
        assert!(r.ms_per_token > 0.01, "{r:?}");
        let piled = m.predict(&ep(1), 25_000.0, 1_500.0, 0.0, 16.0, 0.0);
        let idle = m.predict(&ep(1), 0.0, 1_500.0, 0.0, 0.0, 0.0);
        assert!(piled.ttft_ms > 3.0 * idle.ttft_ms, "{piled:?} {idle:?}");
    }

    #[test]
    fn a_slower_endpoint_gets_its_own_factor_equal_ones_do_not() {
        let mut m = model();
        teach(&mut m, 150, 3.0);
        let (a, b) = (m.rates(&ep(1)), m.rates(&ep(2)));
        assert!(b.ms_per_token > 2.0 * a.ms_per_token, "{a:?} {b:?}");
        let mut m = model();
        teach(&mut m, 150, 1.2); // within noise: the same
        assert_eq!(
            m.rates(&ep(1)),
            Rates {
                observations: 150,
                ..m.rates(&ep(2))
            }
        );
    }

    #[test]
    fn a_slower_endpoint_in_a_large_fleet_keeps_its_factor() {
        // 64 endpoints answering in turn, endpoint 0 three times slower:
        // each is observed once every 64 fleet observations. Its factor must
        // not drift back toward the fleet's between two of its own.
        let ep =
            |i: u16| -> Endpoint { format!("10.0.{}.{}:8000", i >> 8, i & 255).parse().unwrap() };
        let mut m = model();
        for i in 0..64 * 20u64 {
            let e = (i % 64) as u16;
            let work = 200 + 700 * (i % 11);
            let f = if e == 0 { 3.0 } else { 1.0 };
            m.observe(ep(e), work, 0.0, (f * (10.0 + 0.02 * work as f64)) as u64);
        }
        let (slow, fast) = (m.rates(&ep(0)), m.rates(&ep(1)));
        assert!(
            slow.ms_per_token > 2.0 * fast.ms_per_token,
            "{slow:?} vs {fast:?}"
        );
    }

    #[test]
    fn an_endpoint_that_becomes_slower_is_learnt_slower() {
        // Equal at first; then endpoint 2 turns three times slower (a
        // throttled GPU, a noisy neighbour).
        let mut m = model();
        teach(&mut m, 60, 1.0);
        assert_eq!(m.rates(&ep(2)).ms_per_token, m.rates(&ep(1)).ms_per_token);
        teach(&mut m, 60, 3.0);
        let (a, b) = (m.rates(&ep(1)), m.rates(&ep(2)));
        assert!(b.ms_per_token > 2.0 * a.ms_per_token, "{a:?} {b:?}");
    }

    #[test]
    fn an_outlier_barely_moves_the_fit() {
        let mut m = model();
        teach(&mut m, 100, 1.0);
        let before = m.predict(&ep(1), 0.0, 4000.0, 2.0, 2.0, 0.0).ttft_ms;
        m.observe(ep(1), 4000, 2.0, 600_000); // ten minutes behind a stall
        let after = m.predict(&ep(1), 0.0, 4000.0, 2.0, 2.0, 0.0).ttft_ms;
        assert!(after < before * 1.5, "{before} -> {after}");
    }

    #[test]
    fn adapts_when_the_fleet_slows_down() {
        let mut m = model();
        teach(&mut m, 100, 1.0);
        let before = m.rates(&ep(1)).ms_per_token;
        for i in 0..400u64 {
            let work = 200 + 700 * (i % 11);
            m.observe(ep(1), work, 0.0, (10.0 + 0.08 * work as f64) as u64);
        }
        let after = m.rates(&ep(1)).ms_per_token;
        assert!(after > 3.0 * before, "{before} -> {after}");
    }

    #[test]
    fn an_endpoint_avoided_since_it_was_slow_is_tried_again() {
        let mut m = model();
        teach(&mut m, 60, 4.0);
        assert!(m.rates(&ep(2)).ms_per_token > 2.0 * m.rates(&ep(1)).ms_per_token);
        // Endpoint 2 gets nothing for a while; endpoint 1 keeps answering.
        for i in 0..STALE_AFTER {
            let work = 200 + 700 * (i % 11);
            m.observe(ep(1), work, 0.0, (10.0 + 0.02 * work as f64) as u64);
        }
        assert_eq!(m.rates(&ep(2)).ms_per_token, m.rates(&ep(1)).ms_per_token);
    }

    #[test]
    fn removed_endpoints_and_a_restart_start_over() {
        let mut m = model();
        teach(&mut m, 60, 4.0);
        m.retain(&[ep(0), ep(1), ep(3)]);
        assert_eq!(m.rates(&ep(2)).observations, 0);
        assert!(m.rates(&ep(1)).observations > 0);
        assert_eq!(model().rates(&ep(1)).ms_per_token, 0.1);
    }

    #[test]
    fn a_queue_waited_on_for_a_while_is_partly_prefilled() {
        // The priors: 20 ms fixed, 0.1 ms a token, 0 per running request.
        let mut m = model();
        let r = m.rates(&ep(1));
        assert_eq!((r.overhead_ms, r.ms_per_token), (20.0, 0.1));
        // 3 requests, 30 000 tokens between them, first waited on at 1000.
        let queue = InFlight {
            requests: 3,
            tokens: 30_000,
            waiting: 3,
            progress_ms: 1_000,
        };
        // Nothing is credited before a first byte has been seen.
        assert_eq!(m.unprefilled_tokens(&ep(1), queue, 0.0, 1_520), 30_000.0);
        // First bytes have taken up to 6 s lately.
        m.longest_ms = 6_000.0;
        let at = |now: u64| m.unprefilled_tokens(&ep(1), queue, 0.0, now);
        assert_eq!(at(1_000), 30_000.0, "just sent");
        assert_eq!(at(1_020), 30_000.0, "the fixed part first");
        assert_eq!(at(1_520), 25_000.0, "500 ms at 0.1 ms a token");
        assert_eq!(at(0), 30_000.0, "a clock behind the table credits nothing");
        // Never below one mean request (512 tokens before any is routed):
        // its first byte is overdue, not its queue gone.
        let mean = m.mean_uncached_tokens();
        assert!((mean - 512.0).abs() < 1e-9, "{mean}");
        assert_eq!(at(4_000), mean);
        assert_eq!(at(7_020), mean, "6 s credited");
        // Silent longer than any first byte lately: the credit shrinks
        // back, and an engine silent for twice that gets none (frozen).
        assert_eq!(at(9_020), mean, "8 s silent: 4 s credited");
        assert_eq!(at(11_020), 10_000.0, "10 s silent: 2 s credited");
        assert_eq!(at(13_020), 30_000.0);
        assert_eq!(at(u64::MAX), 30_000.0);
        // More tokens in flight never look like less work.
        for now in [1_520, 4_000, 9_020, 11_020, 13_020] {
            let more = InFlight {
                tokens: 40_000,
                ..queue
            };
            assert!(
                m.unprefilled_tokens(&ep(1), more, 0.0, now) >= at(now),
                "{now}"
            );
        }
        // Requests decoding there slow the queue down.
        let mut busy = model();
        busy.longest_ms = 6_000.0;
        busy.fit.theta[2] = 10.0;
        assert_eq!(busy.unprefilled_tokens(&ep(1), queue, 5.0, 1_520), 25_500.0);
        // Less than a mean request in flight: all of it stays ahead.
        let small = InFlight {
            tokens: 300,
            ..queue
        };
        assert_eq!(m.unprefilled_tokens(&ep(1), small, 0.0, 9_000), 300.0);
        // Nothing waited on (tokens are only in flight while a request
        // waits; a lost event may leave some): nothing to credit.
        let answered = InFlight {
            waiting: 0,
            ..queue
        };
        assert_eq!(m.unprefilled_tokens(&ep(1), answered, 0.0, 9_000), 30_000.0);
        // A degenerate rate credits nothing.
        let mut flat = model();
        flat.longest_ms = 6_000.0;
        flat.fit.theta[1] = 0.0;
        assert_eq!(flat.unprefilled_tokens(&ep(1), queue, 0.0, 9_000), 30_000.0);
    }

    #[test]
    fn garbage_observations_do_not_poison() {
        let mut m = model();
        m.observe(ep(1), u64::MAX, f64::NAN, u64::MAX);
        m.observe(ep(1), 0, -5.0, 0);
        m.observe(ep(1), 1_000, f64::INFINITY, 0);
        let r = m.rates(&ep(1));
        for v in [r.overhead_ms, r.ms_per_token, r.ms_per_running] {
            assert!(v.is_finite() && v >= 0.0, "{r:?}");
        }
        let p = m.predict(&ep(1), f64::NAN, 1e12, 1e9, f64::NAN, f64::NAN);
        assert!(!p.cost_ms.is_nan(), "{p:?}");
        m.routed(0);
        m.routed(u64::MAX);
        assert!(m.mean_uncached_tokens().is_finite());
    }
}
