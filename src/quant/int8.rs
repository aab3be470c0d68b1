//! int8 dense matrices: per row symmetric, `w ≈ q · scale`, `scale = max|w| / 127`.

use super::kernel::RowSource;
use super::row_quantize::{self, RowFormat};
use super::simd::{Encoded, EncodedRows};
use anyhow::Result;

/// Largest magnitude of a quantized value.
pub(crate) const QMAX: f32 = 127.0;

/// Quantizes row-major `[rows, cols]` values; returns `(q, scale)` with one scale per row.
/// An all-zero row gets scale 0. Non-finite values are refused (they would poison the row).
pub(crate) fn quantize(rows: usize, cols: usize, w: &[f32]) -> Result<(Vec<i8>, Vec<f32>)> {
    row_quantize::quantize::<Int8Format>(rows, cols, w)
}

/// [`quantize`] of the rows `row(r, out)` writes as f32, rows in parallel.
pub(crate) fn quantize_rows(
    rows: usize,
    cols: usize,
    row: impl Fn(usize, &mut [f32]) + Sync,
) -> Result<(Vec<i8>, Vec<f32>)> {
    row_quantize::quantize_rows::<Int8Format>(rows, cols, row)
}

/// int8 as a [`RowFormat`]: one scale per row.
struct Int8Format;

impl RowFormat for Int8Format {
    const NAME: &'static str = "int8";
    type Stored = i8;

    fn row_lens(cols: usize) -> (usize, usize) {
        (cols, 1)
    }

    #[inline(always)]
    fn quantize_row(
        r: usize,
        src: &[f32],
        _scratch: &mut [i8],
        out: &mut [i8],
        scales: &mut [f32],
    ) -> Result<()> {
        quantize_row_body(r, src, out, &mut scales[0])
    }
}

/// One row: `scale = max|w| / 127`, `q = round_half_away(w / scale)` clamped to ±127.
#[inline(always)]
fn quantize_row_body(r: usize, src: &[f32], dst: &mut [i8], s: &mut f32) -> Result<()> {
    let max = max_abs_bits(src);
    if max >= INFINITY_BITS {
        return Err(not_finite("int8", r, src));
    }
    *s = f32::from_bits(max) / QMAX;
    // A zero row (or one so tiny that its scale underflows) stays all zero.
    if *s == 0.0 {
        dst.fill(0);
        return Ok(());
    }
    let s = *s;
    for (d, &v) in dst.iter_mut().zip(src) {
        *d = round_half_away_i32(v / s).clamp(-(QMAX as i32), QMAX as i32) as i8;
    }
    Ok(())
}

/// Bit pattern of +infinity: an absolute value's bits at or above it are not finite.
pub(crate) const INFINITY_BITS: u32 = 0x7F80_0000;

/// The largest `|v|` of `values` as f32 bits (0 when empty). For finite values the bits of
/// non-negative floats order as the floats do, so this is `max|v|` exactly, in integer
/// lanes that vectorize; a result at or above [`INFINITY_BITS`] means a value is not finite.
#[inline(always)]
pub(crate) fn max_abs_bits(values: &[f32]) -> u32 {
    values
        .iter()
        .fold(0u32, |m, v| m.max(v.to_bits() & 0x7FFF_FFFF))
}

/// [`super::round_half_away`] as an integer, for |x| < 2^23.
#[inline(always)]
pub(crate) fn round_half_away_i32(x: f32) -> i32 {
    let t = x as i32;
    let frac = x - t as f32;
    t + i32::from(frac >= 0.5) - i32::from(frac <= -0.5)
}

/// The error for a row holding a value that is not finite, naming row and column.
#[cold]
pub(crate) fn not_finite(format: &str, r: usize, src: &[f32]) -> anyhow::Error {
    let c = src.iter().position(|v| !v.is_finite()).unwrap_or(0);
    anyhow::anyhow!(
        "{format} quantization: value {} at row {r}, column {c} is not finite; \
         load this matrix as bf16 or f32 (--bits 16/32) or fix the checkpoint",
        src[c]
    )
}

/// Decodes one row of quantized values with its scale into `out`.
#[inline]
pub(crate) fn decode_row(q: &[i8], scale: f32, out: &mut [f32]) {
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

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    /// Values that stress the quantizers: random magnitudes over many binades, exact ties
    /// of the rounding (`k + 0.5` times a scale), zeros of both signs, subnormals, runs of
    /// zeros long enough to fill a group, and one huge value.
    pub(crate) fn awkward_values(rng: &mut StdRng, n: usize) -> Vec<f32> {
        let mut v: Vec<f32> = (0..n)
            .map(|i| match rng.random_range(0..10) {
                0 => 0.0,
                1 => -0.0,
                2 => f32::from_bits(rng.random_range(1..0x0080_0000)) * [1.0, -1.0][i % 2],
                3 => (rng.random_range(-7..7) as f32 + 0.5) * 0.25,
                4 => (rng.random_range(-127..127) as f32 + 0.5) / 127.0,
                5 => rng.random_range(-1e30f32..1e30),
                _ => rng.random_range(-1.0f32..1.0) * 2f32.powi(rng.random_range(-40..10)),
            })
            .collect();
        if n > 200 {
            v[64..192].fill(0.0);
            v[130] = 1e-44;
        }
        v
    }

    /// The int8 quantizer as first written (scalar max, `f32::round`): the bytes every
    /// faster form must reproduce.
    fn reference(src: &[f32]) -> (Vec<i8>, f32) {
        let max = src.iter().fold(0f32, |m, v| m.max(v.abs()));
        let s = max / QMAX;
        let q = src
            .iter()
            .map(|&v| {
                if s == 0.0 {
                    0
                } else {
                    (v / s).round().clamp(-QMAX, QMAX) as i8
                }
            })
            .collect();
        (q, s)
    }

    #[test]
    fn quantizer_bytes_match_the_reference() {
        let mut rng = StdRng::seed_from_u64(8);
        for cols in [1usize, 7, 63, 64, 65, 257, 1000, 7168] {
            for _ in 0..20 {
                let src = awkward_values(&mut rng, cols);
                let (want_q, want_s) = reference(&src);
                for dispatched in [true, false] {
                    let (mut q, mut s) = (vec![0i8; cols], 0f32);
                    if dispatched {
                        crate::quant::row_quantize::quantize_row::<Int8Format>(
                            0,
                            &src,
                            &mut [],
                            &mut q,
                            std::slice::from_mut(&mut s),
                        )
                        .unwrap();
                    } else {
                        quantize_row_body(0, &src, &mut q, &mut s).unwrap();
                    }
                    assert_eq!(q, want_q, "cols {cols}");
                    assert_eq!(s.to_bits(), want_s.to_bits(), "cols {cols}");
                }
            }
        }
    }

    #[test]
    fn non_finite_value_is_named() {
        let mut src = vec![0.5f32; 70];
        src[67] = f32::NAN;
        let e = quantize(1, 70, &src).unwrap_err().to_string();
        assert!(e.contains("row 0, column 67 is not finite"), "{e}");
        src[67] = f32::NEG_INFINITY;
        let e = quantize(1, 70, &src).unwrap_err().to_string();
        assert!(e.contains("value -inf at row 0, column 67"), "{e}");
    }
}
