//! A positive quantity learnt online as a mean in log space: a ratio that
//! doubles and one that halves move it alike, and one wild observation
//! moves it by a bounded factor; and how stale such a mean is once its
//! endpoint is no longer observed. The TTFT model's per-endpoint factors and
//! mean request size (`ttft.rs`) and the decode-speed rates
//! (`decode_speed.rs`) are such means.

/// Observations after which a mean moves by its learning rate, not `1/n`.
pub(crate) const WARM_UP: u32 = 8;
/// Largest factor one observation can move a mean by.
pub(crate) const MAX_STEP: f64 = 4.0;

/// A mean in log space: `ln` of the value, and the observations taken.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct LogMean {
    pub ln: f64,
    pub n: u32,
}

impl LogMean {
    /// A mean at `value` that has seen nothing yet.
    pub fn at(value: f64) -> Self {
        LogMean {
            ln: value.ln(),
            n: 0,
        }
    }

    /// The mean.
    pub fn value(&self) -> f64 {
        self.ln.exp()
    }

    /// Takes `x` (ignored unless finite and positive): the plain mean of
    /// the first [`WARM_UP`] observations, then an exponential one at
    /// `learning_rate`; one step moves the mean by at most [`MAX_STEP`]x.
    pub fn observe(&mut self, x: f64, learning_rate: f64) {
        if !x.is_finite() || x <= 0.0 {
            return;
        }
        let step = (x.ln() - self.ln).clamp(-MAX_STEP.ln(), MAX_STEP.ln());
        self.n = self.n.saturating_add(1);
        let w = if self.n <= WARM_UP {
            1.0 / f64::from(self.n)
        } else {
            learning_rate
        };
        self.ln += w * step;
    }
}

/// How stale a mean last observed `age` observations ago is, when it
/// counts as wholly stale after `after`: 0 for the first quarter of that
/// (an endpoint waits its turn among the others without drifting), then
/// rising linearly to 1.
pub(crate) fn staleness(age: u64, after: u64) -> f64 {
    let after = after.max(1) as f64;
    ((age as f64 - after / 4.0) / (after * 0.75)).clamp(0.0, 1.0)
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn the_first_observations_are_averaged_then_the_rate_applies() {
        let mut m = LogMean::at(1.0);
        m.observe(2.0, 0.1);
        assert!(
            (m.value() - 2.0).abs() < 1e-9,
            "the first replaces the seed"
        );
        m.observe(8.0, 0.1);
        assert!((m.value() - 4.0).abs() < 1e-9, "geometric mean of 2 and 8");
        for _ in 0..WARM_UP {
            m.observe(4.0, 0.1);
        }
        let before = m.ln;
        m.observe(16.0, 0.1);
        assert!((m.ln - before - 0.1 * (16f64.ln() - before)).abs() < 1e-9);
    }

    #[test]
    fn staleness_waits_a_quarter_then_rises_to_one() {
        assert_eq!(staleness(0, 256), 0.0);
        assert_eq!(staleness(64, 256), 0.0);
        assert!((staleness(160, 256) - 0.5).abs() < 1e-9);
        assert_eq!(staleness(256, 256), 1.0);
        assert_eq!(staleness(u64::MAX, 256), 1.0);
        assert_eq!(staleness(5, 0), 1.0);
    }

    #[test]
    fn one_observation_moves_it_by_a_bounded_factor_and_junk_not_at_all() {
        let mut m = LogMean::at(1.0);
        m.observe(1e9, 0.1);
        assert!((m.value() - MAX_STEP).abs() < 1e-9);
        for x in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            m.observe(x, 0.1);
        }
        assert!((m.value() - MAX_STEP).abs() < 1e-9);
        assert_eq!(m.n, 1);
    }
}
