//! int4 dense matrices: symmetric groups of [`GROUP`] columns along a row,
//! `w ≈ q · scale`, `scale = max|w| / 7`, `q ∈ -7..=7` stored as two's-complement nibbles,
//! two per byte (low nibble = even column), each row padded to a whole byte.

use super::kernel::RowSource;
use super::round_half_away;
use super::simd::{Encoded, EncodedRows};
use anyhow::{bail, Result};
use rayon::prelude::*;

/// Columns sharing one scale.
pub const GROUP: usize = 64;

/// Largest magnitude of a quantized value (the code -8 is never produced).
pub const QMAX: f32 = 7.0;

/// Bytes of one packed row.
pub fn row_bytes(cols: usize) -> usize {
    cols.div_ceil(2)
}

/// Scales of one row.
pub fn row_groups(cols: usize) -> usize {
    cols.div_ceil(GROUP)
}

/// Sign-extends a 4-bit two's-complement value held in the low nibble.
#[inline]
fn low(b: u8) -> i8 {
    ((b << 4) as i8) >> 4
}

/// Sign-extends the high nibble.
#[inline]
fn high(b: u8) -> i8 {
    (b as i8) >> 4
}

/// Quantizes row-major `[rows, cols]` values; returns `(packed, scale)` in the layout of
/// [`super::DenseData::Int4`]. Non-finite values are refused (they would poison a group).
pub fn quantize(rows: usize, cols: usize, w: &[f32]) -> Result<(Vec<u8>, Vec<f32>)> {
    if rows.checked_mul(cols) != Some(w.len()) {
        bail!(
            "int4 quantization: {} values given for a [{rows}, {cols}] matrix",
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
) -> Result<(Vec<u8>, Vec<f32>)> {
    let (rb, rg) = (row_bytes(cols), row_groups(cols));
    let mut packed = vec![0u8; rows * rb];
    let mut scale = vec![0f32; rows * rg];
    if cols == 0 {
        return Ok((packed, scale));
    }
    packed
        .par_chunks_mut(rb)
        .zip(scale.par_chunks_mut(rg))
        .enumerate()
        .try_for_each_init(
            || (vec![0f32; cols], vec![0i8; cols]),
            |(src, q), (r, (bytes, scales))| {
                row(r, src);
                quantize_row(r, src, q, bytes, scales)
            },
        )?;
    Ok((packed, scale))
}

fn quantize_row(
    r: usize,
    src: &[f32],
    q: &mut [i8],
    bytes: &mut [u8],
    scales: &mut [f32],
) -> Result<()> {
    if let Some(c) = src.iter().position(|v| !v.is_finite()) {
        bail!(
            "int4 quantization: value {} at row {r}, column {c} is not finite; \
             load this matrix as bf16 or f32 (--bits 16/32) or fix the checkpoint",
            src[c]
        );
    }
    for ((grp, qg), s) in src.chunks(GROUP).zip(q.chunks_mut(GROUP)).zip(scales) {
        let max = grp.iter().fold(0f32, |m, v| m.max(v.abs()));
        *s = max / QMAX;
        for (d, &v) in qg.iter_mut().zip(grp) {
            // A zero group (or one whose scale underflows) stays all zero.
            *d = if *s == 0.0 {
                0
            } else {
                round_half_away(v / *s).clamp(-QMAX, QMAX) as i8
            };
        }
    }
    for (byte, pair) in bytes.iter_mut().zip(q.chunks(2)) {
        let lo = (pair[0] as u8) & 0x0F;
        let hi = pair.get(1).map_or(0, |&v| (v as u8) & 0x0F);
        *byte = lo | (hi << 4);
    }
    Ok(())
}

/// Decodes one packed row (`row_bytes(cols)` bytes, `row_groups(cols)` scales) into `out`
/// (`cols` values).
#[inline]
pub fn decode_row(packed: &[u8], scale: &[f32], out: &mut [f32]) {
    for ((dst, src), &s) in out
        .chunks_mut(GROUP)
        .zip(packed.chunks(GROUP / 2))
        .zip(scale)
    {
        let pairs = dst.chunks_exact_mut(2);
        for (o, &b) in pairs.zip(src) {
            o[0] = f32::from(low(b)) * s;
            o[1] = f32::from(high(b)) * s;
        }
        // Only the last group of a row with an odd width ends in a lone even column.
        if dst.len() % 2 == 1 {
            let last = dst.len() - 1;
            dst[last] = f32::from(low(src[last / 2])) * s;
        }
    }
}

/// Packed int4 `[rows, cols]` with group scales as a [`RowSource`].
pub(crate) struct Int4Rows<'a> {
    pub(crate) packed: &'a [u8],
    pub(crate) scale: &'a [f32],
    pub(crate) rows: usize,
    pub(crate) cols: usize,
}

impl RowSource for Int4Rows<'_> {
    fn rows(&self) -> usize {
        self.rows
    }
    fn cols(&self) -> usize {
        self.cols
    }
    fn decode(&self, r: usize, out: &mut [f32]) {
        let (rb, rg) = (row_bytes(self.cols), row_groups(self.cols));
        decode_row(
            &self.packed[r * rb..(r + 1) * rb],
            &self.scale[r * rg..(r + 1) * rg],
            out,
        );
    }
    fn encoded(&self) -> EncodedRows<'_> {
        EncodedRows {
            data: Encoded::Int4 {
                packed: self.packed,
                scale: self.scale,
            },
            rows: self.rows,
            cols: self.cols,
        }
    }
}
