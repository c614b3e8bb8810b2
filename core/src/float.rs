//! `f64` maximum and minimum written as comparisons, for the loops that run
//! once per candidate of every decision.
//!
//! On wasm32, where the filter runs, `f64::max` and `f64::min` are calls to
//! libm's `fmax` and `fmin`: their rule (a NaN operand is ignored) is not
//! the one of wasm's own `f64.max` (a NaN wins), so LLVM cannot use the
//! instruction. In V8 those calls were a tenth of a decision over 1024
//! endpoints. These give the same values (a signed zero aside, which no
//! score can tell) with compares and selects.

/// `x.max(0.0)`: `x` if positive, else 0 (a NaN gives 0).
#[inline]
pub fn non_negative(x: f64) -> f64 {
    if x > 0.0 {
        x
    } else {
        0.0
    }
}

/// `a.max(b)`: the larger, ignoring a NaN operand (NaN only if both are).
#[inline]
pub fn max_num(a: f64, b: f64) -> f64 {
    if a > b || b.is_nan() {
        a
    } else {
        b
    }
}

/// `a.min(b)`: the smaller, ignoring a NaN operand (NaN only if both are).
#[inline]
pub fn min_num(a: f64, b: f64) -> f64 {
    if a < b || b.is_nan() {
        a
    } else {
        b
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    /// Equal values, or both NaN (`0.0 == -0.0`: the sign of a zero is the
    /// one thing `f64::max` leaves unspecified).
    fn same(a: f64, b: f64) -> bool {
        a == b || (a.is_nan() && b.is_nan())
    }

    #[test]
    fn they_are_what_f64_max_and_min_give() {
        let odd = [
            f64::NAN,
            f64::INFINITY,
            f64::NEG_INFINITY,
            0.0,
            -0.0,
            f64::MIN_POSITIVE,
            -f64::MIN_POSITIVE,
            f64::MAX,
            f64::MIN,
        ];
        let mut rng = fastrand::Rng::with_seed(9);
        let mut value = || match rng.u8(0..3) {
            0 => odd[rng.usize(..odd.len())],
            1 => f64::from(rng.i8(..)),
            _ => (rng.f64() - 0.5) * 1e6,
        };
        for _ in 0..20_000 {
            let (a, b) = (value(), value());
            assert!(same(non_negative(a), a.max(0.0)), "non_negative({a})");
            assert!(same(max_num(a, b), a.max(b)), "max_num({a}, {b})");
            assert!(same(min_num(a, b), a.min(b)), "min_num({a}, {b})");
        }
    }
}
