//! int4 dense matrices: symmetric groups of [`GROUP`] columns along a row,
//! `w ≈ q · scale`, `scale = max|w| / 7`, `q ∈ -7..=7` stored as two's-complement nibbles,
//! two per byte (low nibble = even column), each row padded to a whole byte.

use super::int8::{max_abs_bits, not_finite, round_half_away_i32, INFINITY_BITS};
use super::kernel::RowSource;
use super::row_quantize::{self, RowFormat};
use super::simd::{Encoded, EncodedRows};
use anyhow::Result;

/// Columns sharing one scale.
pub(crate) const GROUP: usize = 64;

/// Largest magnitude of a quantized value (the code -8 is never produced).
pub(crate) const QMAX: f32 = 7.0;

/// Bytes of one packed row.
pub(crate) fn row_bytes(cols: usize) -> usize {
    cols.div_ceil(2)
}

/// Scales of one row.
pub(crate) fn row_groups(cols: usize) -> usize {
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
pub(crate) fn quantize(rows: usize, cols: usize, w: &[f32]) -> Result<(Vec<u8>, Vec<f32>)> {
    row_quantize::quantize::<Int4Format>(rows, cols, w)
}

/// [`quantize`] of the rows `row(r, out)` writes as f32, rows in parallel.
pub(crate) fn quantize_rows(
    rows: usize,
    cols: usize,
    row: impl Fn(usize, &mut [f32]) + Sync,
) -> Result<(Vec<u8>, Vec<f32>)> {
    row_quantize::quantize_rows::<Int4Format>(rows, cols, row)
}

/// int4 as a [`RowFormat`]: a scale per group, the codes packed two a byte.
struct Int4Format;

impl RowFormat for Int4Format {
    const NAME: &'static str = "int4";
    type Stored = u8;

    fn row_lens(cols: usize) -> (usize, usize) {
        (row_bytes(cols), row_groups(cols))
    }

    #[inline(always)]
    fn quantize_row(
        r: usize,
        src: &[f32],
        scratch: &mut [i8],
        out: &mut [u8],
        scales: &mut [f32],
    ) -> Result<()> {
        quantize_row_body(r, src, scratch, out, scales)
    }
}

/// One row: per group `scale = max|w| / 7`, `q = round_half_away(w / scale)` clamped to ±7,
/// then two nibbles a byte. Written branch-free inside a group so that it vectorizes.
#[inline(always)]
fn quantize_row_body(
    r: usize,
    src: &[f32],
    q: &mut [i8],
    bytes: &mut [u8],
    scales: &mut [f32],
) -> Result<()> {
    for ((grp, qg), s) in src.chunks(GROUP).zip(q.chunks_mut(GROUP)).zip(scales) {
        let max = max_abs_bits(grp);
        if max >= INFINITY_BITS {
            return Err(not_finite("int4", r, src));
        }
        *s = f32::from_bits(max) / QMAX;
        // A zero group (or one whose scale underflows) stays all zero.
        if *s == 0.0 {
            qg.fill(0);
            continue;
        }
        let s = *s;
        for (d, &v) in qg.iter_mut().zip(grp) {
            *d = round_half_away_i32(v / s).clamp(-(QMAX as i32), QMAX as i32) as i8;
        }
    }
    let (pairs, rest) = q.split_at(q.len() & !1);
    for (byte, pair) in bytes.iter_mut().zip(pairs.chunks_exact(2)) {
        *byte = ((pair[0] as u8) & 0x0F) | ((pair[1] as u8) << 4);
    }
    if let (Some(&lone), Some(last)) = (rest.first(), bytes.last_mut()) {
        *last = (lone as u8) & 0x0F;
    }
    Ok(())
}

/// Decodes one packed row (`row_bytes(cols)` bytes, `row_groups(cols)` scales) into `out`
/// (`cols` values).
#[inline]
pub(crate) fn decode_row(packed: &[u8], scale: &[f32], out: &mut [f32]) {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::int8::tests::awkward_values;
    use rand::rngs::StdRng;
    use rand::SeedableRng;

    /// The int4 quantizer as first written (scalar max, `f32::round`, nibble pairs): the
    /// bytes every faster form must reproduce.
    fn reference(src: &[f32]) -> (Vec<u8>, Vec<f32>) {
        let mut q = vec![0i8; src.len()];
        let mut scales = Vec::new();
        for (grp, qg) in src.chunks(GROUP).zip(q.chunks_mut(GROUP)) {
            let max = grp.iter().fold(0f32, |m, v| m.max(v.abs()));
            let s = max / QMAX;
            scales.push(s);
            for (d, &v) in qg.iter_mut().zip(grp) {
                *d = if s == 0.0 {
                    0
                } else {
                    (v / s).round().clamp(-QMAX, QMAX) as i8
                };
            }
        }
        let bytes = q
            .chunks(2)
            .map(|p| ((p[0] as u8) & 0x0F) | (p.get(1).map_or(0, |&v| (v as u8) & 0x0F) << 4))
            .collect();
        (bytes, scales)
    }

    #[test]
    fn quantizer_bytes_match_the_reference() {
        let mut rng = StdRng::seed_from_u64(4);
        for cols in [1usize, 2, 7, 63, 64, 65, 129, 257, 1000, 7168] {
            for _ in 0..20 {
                let src = awkward_values(&mut rng, cols);
                let (want_b, want_s) = reference(&src);
                for dispatched in [true, false] {
                    let mut q = vec![0i8; cols];
                    let mut b = vec![0xAAu8; row_bytes(cols)];
                    let mut s = vec![0f32; row_groups(cols)];
                    if dispatched {
                        crate::quant::row_quantize::quantize_row::<Int4Format>(
                            0, &src, &mut q, &mut b, &mut s,
                        )
                        .unwrap();
                    } else {
                        quantize_row_body(0, &src, &mut q, &mut b, &mut s).unwrap();
                    }
                    assert_eq!(b, want_b, "cols {cols}");
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&s), bits(&want_s), "cols {cols}");
                }
            }
        }
    }

    #[test]
    fn non_finite_value_is_named() {
        let mut src = vec![0.5f32; 2 * 130];
        src[130 + 100] = f32::INFINITY;
        let e = quantize(2, 130, &src).unwrap_err().to_string();
        assert!(
            e.contains("value inf at row 1, column 100 is not finite"),
            "{e}"
        );
    }
}
