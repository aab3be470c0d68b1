//! Weight formats: native MXFP4 experts and the load-time formats of dense matrices,
//! each with the CPU kernels that make it the oracle.

pub(crate) mod bf16;
mod dense;
pub mod idot;
pub(crate) mod int4;
pub(crate) mod int8;
mod kernel;
pub mod mxfp4;
pub(crate) mod partner;
pub(crate) mod pool;
mod row_quantize;
pub mod simd;
pub(crate) mod vec_math;

pub use mxfp4::Mxfp4View;

/// `x.round()` (half away from zero) for |x| < 2^23 without the libm call: the truncation
/// is an instruction and `x - trunc(x)` is exact, so the result is the same value (a zero
/// result is always +0).
#[inline]
pub(crate) fn round_half_away(x: f32) -> f32 {
    let t = x as i32;
    let frac = x - t as f32;
    (t + i32::from(frac >= 0.5) - i32::from(frac <= -0.5)) as f32
}

/// Load-time format of a dense matrix (`K3_BITS`, `K3_MLA_BITS`, `K3_HEAD_BITS`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DenseFormat {
    /// 32: plain f32.
    F32,
    /// 16: bf16, exactly as stored.
    Bf16,
    /// 8: int8 per row, symmetric, one f32 scale per row.
    Int8,
    /// 4: int4 in groups of 64 along a row, symmetric, one f32 scale per group.
    Int4,
}

/// A dense `[rows, cols]` matrix in one of the [`DenseFormat`]s, host resident.
#[derive(Clone, Debug)]
pub struct DenseMatrix {
    /// Output dimension.
    pub rows: usize,
    /// Input dimension.
    pub cols: usize,
    /// The encoded values.
    pub data: DenseData,
}

/// The encoded payload of a [`DenseMatrix`].
#[derive(Clone, Debug)]
pub enum DenseData {
    /// Row-major f32.
    F32(Vec<f32>),
    /// Row-major bf16 bit patterns.
    Bf16(Vec<u16>),
    /// Row-major int8 values and one scale per row.
    Int8 {
        /// `rows · cols` values.
        q: Vec<i8>,
        /// `rows` scales.
        scale: Vec<f32>,
    },
    /// Int4 two's-complement nibbles (values -7..=7), two per byte (low nibble = even
    /// column), rows padded to whole bytes (the pad nibble is 0), one scale per 64 columns
    /// of each row (the last group may be shorter).
    Int4 {
        /// `rows · ceil(cols/2)` bytes.
        q: Vec<u8>,
        /// `rows · ceil(cols/64)` scales.
        scale: Vec<f32>,
    },
}

#[cfg(test)]
mod tests {
    use super::round_half_away;

    /// Half away from zero in f64, where `x ± 0.5` is exact for every f32 `x`, and the
    /// cast truncates: no libm call. `f32::round` is no reference on every target: the
    /// mingw-w64 C runtime that the x86_64-pc-windows-gnu build links rounds 0.49999997 to 1.
    fn exact_round(x: f32) -> f32 {
        (f64::from(x) + 0.5f64.copysign(f64::from(x))) as i64 as f32
    }

    #[test]
    fn round_half_away_is_round() {
        let mut cases = vec![0.5f32, -0.5, 1.5, -2.5, 0.49999997, -0.49999997, 6.5, 127.5];
        cases.extend([2.4999998, -2.4999998, 8388607.5, -8388607.5, 1e-40, -0.0]);
        cases.extend((0..20_000).map(|i| (i as f32 - 10_000.0) * 0.013_7));
        cases.extend((0..2_000).map(|i| i as f32 * 0.25 - 250.0));
        for x in cases {
            // Bits: both give +0 for a zero result.
            assert_eq!(
                round_half_away(x).to_bits(),
                exact_round(x).to_bits(),
                "{x}"
            );
        }
    }
}
