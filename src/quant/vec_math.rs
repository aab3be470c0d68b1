//! `exp`, `tanh` and the sigmoid in plain f32 arithmetic, without calls into the C library,
//! so that a loop over a slice of them compiles to vector instructions.
//!
//! The gated units (SiTU: two `tanh` and a sigmoid a value) and the gates take a
//! transcendental call or three per value. As libm calls they were the largest cost of a
//! small model's decode step after the matmuls; each call is opaque to the compiler, so the
//! loops around them ran one value at a time. Here each function is a short polynomial with
//! branch-free selects. Accuracy: `exp` and the sigmoid within a few ulp of the exact value,
//! `tanh` within a few ulp (near 0 by its odd series, elsewhere through `exp`); NaN stays
//! NaN, so the passes' non-finite checks still see it.

/// log2(e).
const LOG2_E: f32 = std::f32::consts::LOG2_E;
/// ln 2 in two parts (Cody–Waite): a high part with few significant bits, so `n · LN2_HI`
/// is exact for the exponents in range, and the rest.
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
/// 1.5 · 2^23: adding and subtracting it rounds an f32 of magnitude below 2^22 to the
/// nearest integer (ties to even) in two vectorizable adds.
const ROUND_MAGIC: f32 = 12_582_912.0;
/// Arguments of `exp` are clamped to this range: below it the result would be subnormal
/// (treated as the smallest normal, which every caller here uses as "about zero"), above it
/// the scale 2^n would overflow the exponent.
const EXP_MIN: f32 = -87.0;
const EXP_MAX: f32 = 88.0;
/// Below this |x| `tanh` takes its odd Taylor series (the first dropped term is under
/// 1e-10 of the value there); above it `1 - 2 / (e^{2|x|} + 1)` loses at most two bits.
const TANH_SERIES_BELOW: f32 = 0.25;

/// e^x. Exact-enough for activations: the reduced argument |r| ≤ ln2 / 2 takes the Taylor
/// series to degree 7, whose remainder is below 1e-8 of the value.
#[inline(always)]
pub(crate) fn exp(x: f32) -> f32 {
    let x = x.clamp(EXP_MIN, EXP_MAX);
    let n = (x * LOG2_E + ROUND_MAGIC) - ROUND_MAGIC;
    let r = (x - n * LN2_HI) - n * LN2_LO;
    let p = 1.0
        + r * (1.0
            + r * (1.0 / 2.0
                + r * (1.0 / 6.0
                    + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0 + r / 5040.0))))));
    // n is an integer in -126..=127 here, so 2^n is a normal f32 built from its exponent.
    let scale = f32::from_bits(((n as i32 + 127) as u32) << 23);
    p * scale
}

/// tanh(x).
#[inline(always)]
pub(crate) fn tanh(x: f32) -> f32 {
    let ax = x.abs();
    let z = x * x;
    let series = x + x
        * z
        * (-1.0 / 3.0
            + z * (2.0 / 15.0
                + z * (-17.0 / 315.0 + z * (62.0 / 2835.0 + z * (-1382.0 / 155_925.0)))));
    let e = exp(2.0 * ax);
    let far = (1.0 - 2.0 / (e + 1.0)).copysign(x);
    if ax < TANH_SERIES_BELOW {
        series
    } else {
        far
    }
}

/// The logistic sigmoid, `1 / (1 + e^{-x})`.
#[inline(always)]
pub(crate) fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + exp(-x))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Evenly spaced points of [lo, hi].
    fn grid(lo: f64, hi: f64, n: usize) -> impl Iterator<Item = f32> {
        (0..=n).map(move |i| (lo + (hi - lo) * i as f64 / n as f64) as f32)
    }

    fn rel(got: f32, want: f64) -> f64 {
        ((got as f64 - want) / want.abs().max(f64::MIN_POSITIVE)).abs()
    }

    #[test]
    fn exp_is_within_a_few_ulp_over_its_range() {
        let mut worst = 0.0f64;
        for x in grid(-87.0, 88.0, 200_000) {
            worst = worst.max(rel(exp(x), (x as f64).exp()));
        }
        assert!(
            worst < 4.0 * f32::EPSILON as f64,
            "worst relative error {worst:e}"
        );
        assert_eq!(exp(0.0), 1.0);
    }

    #[test]
    fn tanh_is_within_a_few_ulp_and_odd() {
        let mut worst = 0.0f64;
        for x in grid(-12.0, 12.0, 240_001).chain(grid(-0.3, 0.3, 60_001)) {
            if x != 0.0 {
                worst = worst.max(rel(tanh(x), (x as f64).tanh()));
            }
            assert_eq!(tanh(-x), -tanh(x), "{x}");
        }
        assert!(
            worst < 8.0 * f32::EPSILON as f64,
            "worst relative error {worst:e}"
        );
        assert_eq!(tanh(0.0), 0.0);
        assert_eq!(tanh(50.0), 1.0);
        assert_eq!(tanh(f32::INFINITY), 1.0);
    }

    #[test]
    fn sigmoid_is_within_a_few_ulp_and_saturates() {
        let mut worst = 0.0f64;
        for x in grid(-80.0, 80.0, 160_000) {
            let want = 1.0 / (1.0 + (-(x as f64)).exp());
            worst = worst.max(rel(sigmoid(x), want));
        }
        assert!(
            worst < 8.0 * f32::EPSILON as f64,
            "worst relative error {worst:e}"
        );
        assert_eq!(sigmoid(200.0), 1.0);
        assert!(sigmoid(-200.0) < 1e-37);
    }

    #[test]
    fn nan_stays_nan() {
        assert!(exp(f32::NAN).is_nan());
        assert!(tanh(f32::NAN).is_nan());
        assert!(sigmoid(f32::NAN).is_nan());
    }
}
