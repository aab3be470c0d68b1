//! int8 dense matrices: per row symmetric, `w ≈ q · scale`, `scale = max|w| / 127`.

use super::kernel::RowSource;
use super::round_half_away;
use super::simd::{Encoded, EncodedRows};
use anyhow::{bail, Result};
use rayon::prelude::*;

/// Largest magnitude of a quantized value.
pub const QMAX: f32 = 127.0;

/// Quantizes row-major `[rows, cols]` values; returns `(q, scale)` with one scale per row.
/// An all-zero row gets scale 0. Non-finite values are refused (they would poison the row).
pub fn quantize(rows: usize, cols: usize, w: &[f32]) -> Result<(Vec<i8>, Vec<f32>)> {
    if rows.checked_mul(cols) != Some(w.len()) {
        bail!(
            "int8 quantization: {} values given for a [{rows}, {cols}] matrix",
            w.len()
        );
    }
    quantize_rows(rows, cols, |r, out| {
        out.copy_from_slice(&w[r * cols..(r + 1) * cols])
    })
}

/// [`quantize`] of the rows `row(r, out)` writes as f32, rows in parallel: a source in
/// another encoding (bf16) never needs a whole f32 copy.
pub(crate) fn quantize_rows(
    rows: usize,
    cols: usize,
    row: impl Fn(usize, &mut [f32]) + Sync,
) -> Result<(Vec<i8>, Vec<f32>)> {
    let mut q = vec![0i8; rows * cols];
    let mut scale = vec![0f32; rows];
    if cols == 0 {
        return Ok((q, scale));
    }
    q.par_chunks_mut(cols)
        .zip(scale.par_iter_mut())
        .enumerate()
        .try_for_each_init(
            || vec![0f32; cols],
            |src, (r, (dst, s))| {
                row(r, src);
                quantize_row(r, src, dst, s)
            },
        )?;
    Ok((q, scale))
}

fn quantize_row(r: usize, src: &[f32], dst: &mut [i8], s: &mut f32) -> Result<()> {
    if let Some(c) = src.iter().position(|v| !v.is_finite()) {
        bail!(
            "int8 quantization: value {} at row {r}, column {c} is not finite; \
             load this matrix as bf16 or f32 (--bits 16/32) or fix the checkpoint",
            src[c]
        );
    }
    let max = src.iter().fold(0f32, |m, v| m.max(v.abs()));
    *s = max / QMAX;
    // A zero row (or one so tiny that its scale underflows) stays all zero.
    if *s == 0.0 {
        return Ok(());
    }
    for (d, &v) in dst.iter_mut().zip(src) {
        *d = round_half_away(v / *s).clamp(-QMAX, QMAX) as i8;
    }
    Ok(())
}

/// Decodes one row of quantized values with its scale into `out`.
#[inline]
pub fn decode_row(q: &[i8], scale: f32, out: &mut [f32]) {
    for (o, &v) in out.iter_mut().zip(q) {
        *o = f32::from(v) * scale;
    }
}

/// Row-major int8 `[rows, cols]` with per-row scales as a [`RowSource`].
pub(crate) struct Int8Rows<'a> {
    pub(crate) q: &'a [i8],
    pub(crate) scale: &'a [f32],
    pub(crate) rows: usize,
    pub(crate) cols: usize,
}

impl RowSource for Int8Rows<'_> {
    fn rows(&self) -> usize {
        self.rows
    }
    fn cols(&self) -> usize {
        self.cols
    }
    fn decode(&self, r: usize, out: &mut [f32]) {
        decode_row(
            &self.q[r * self.cols..(r + 1) * self.cols],
            self.scale[r],
            out,
        );
    }
    fn encoded(&self) -> EncodedRows<'_> {
        EncodedRows {
            data: Encoded::Int8 {
                q: self.q,
                scale: self.scale,
            },
            rows: self.rows,
            cols: self.cols,
        }
    }
}
