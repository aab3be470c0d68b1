//! bf16 dense matrices: the checkpoint's own bits, widened exactly to f32 on use.

use super::kernel::RowSource;
use super::simd::{Encoded, EncodedRows};

/// Exact widening of a bf16 bit pattern (a bf16 is the top half of an f32).
#[inline]
pub(crate) fn widen(bits: u16) -> f32 {
    f32::from_bits(u32::from(bits) << 16)
}

/// Rounds f32 values to bf16 bit patterns, round-to-nearest-even (NaN stays NaN).
pub(crate) fn round(values: &[f32]) -> Vec<u16> {
    values
        .iter()
        .map(|&v| half::bf16::from_f32(v).to_bits())
        .collect()
}

/// Decodes `bits` (one row) into `out`.
#[inline]
pub(crate) fn decode_row(bits: &[u16], out: &mut [f32]) {
    for (o, &b) in out.iter_mut().zip(bits) {
        *o = widen(b);
    }
}

/// Row-major bf16 `[rows, cols]` as a [`RowSource`].
pub(crate) struct Bf16Rows<'a> {
    pub(crate) bits: &'a [u16],
    pub(crate) rows: usize,
    pub(crate) cols: usize,
}

impl RowSource for Bf16Rows<'_> {
    fn rows(&self) -> usize {
        self.rows
    }
    fn cols(&self) -> usize {
        self.cols
    }
    fn decode(&self, r: usize, out: &mut [f32]) {
        decode_row(&self.bits[r * self.cols..(r + 1) * self.cols], out);
    }
    fn encoded(&self) -> EncodedRows<'_> {
        EncodedRows {
            data: Encoded::Bf16(self.bits),
            rows: self.rows,
            cols: self.cols,
        }
    }
}
