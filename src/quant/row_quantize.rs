//! Row-parallel quantization of a dense matrix, shared by the int8 and int4 formats: a
//! format says how one row of f32 becomes its stored values and scales; the shape check,
//! the parallel loop over rows and the AVX2 build of the row are written here once.

use anyhow::{bail, Result};
use rayon::prelude::*;

/// How one row of f32 becomes a format's stored values and scales.
pub(crate) trait RowFormat {
    /// The format's name, for errors.
    const NAME: &'static str;
    /// One stored element (a byte of packed nibbles, an i8).
    type Stored: Copy + Default + Send + Sync;
    /// Stored elements and scales of one row of `cols` values.
    fn row_lens(cols: usize) -> (usize, usize);
    /// Quantizes row `r` (`src`, `cols` values) into `out` and `scales`; `scratch` holds
    /// `cols` i8 the format may use. Refuses a value that is not finite. Marked
    /// `#[inline(always)]` by each format so that the AVX2 build compiles its body.
    fn quantize_row(
        r: usize,
        src: &[f32],
        scratch: &mut [i8],
        out: &mut [Self::Stored],
        scales: &mut [f32],
    ) -> Result<()>;
}

/// Quantizes row-major `[rows, cols]` values in format `F`: `(stored, scales)`.
pub(crate) fn quantize<F: RowFormat>(
    rows: usize,
    cols: usize,
    w: &[f32],
) -> Result<(Vec<F::Stored>, Vec<f32>)> {
    if rows.checked_mul(cols) != Some(w.len()) {
        bail!(
            "{} quantization: {} values given for a [{rows}, {cols}] matrix",
            F::NAME,
            w.len()
        );
    }
    quantize_rows::<F>(rows, cols, |r, out| {
        out.copy_from_slice(&w[r * cols..(r + 1) * cols])
    })
}

/// [`quantize`] of the rows `row(r, out)` writes as f32, rows in parallel: a source in
/// another encoding (bf16) never needs a whole f32 copy.
pub(crate) fn quantize_rows<F: RowFormat>(
    rows: usize,
    cols: usize,
    row: impl Fn(usize, &mut [f32]) + Sync,
) -> Result<(Vec<F::Stored>, Vec<f32>)> {
    let (row_out, row_scales) = F::row_lens(cols);
    let mut out = vec![F::Stored::default(); rows * row_out];
    let mut scales = vec![0f32; rows * row_scales];
    if cols == 0 {
        return Ok((out, scales));
    }
    out.par_chunks_mut(row_out)
        .zip(scales.par_chunks_mut(row_scales))
        .enumerate()
        .try_for_each_init(
            || (vec![0f32; cols], vec![0i8; cols]),
            |(src, scratch), (r, (dst, s))| {
                row(r, src);
                quantize_row::<F>(r, src, scratch, dst, s)
            },
        )?;
    Ok((out, scales))
}

/// One row in format `F`, through the AVX2 build where the CPU has AVX2.
pub(super) fn quantize_row<F: RowFormat>(
    r: usize,
    src: &[f32],
    scratch: &mut [i8],
    out: &mut [F::Stored],
    scales: &mut [f32],
) -> Result<()> {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2, checked on the line above.
        return unsafe { quantize_row_avx2::<F>(r, src, scratch, out, scales) };
    }
    F::quantize_row(r, src, scratch, out, scales)
}

/// [`RowFormat::quantize_row`] compiled for AVX2: the same operations (true division, the
/// same rounding), so the same bytes, eight lanes at a time.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn quantize_row_avx2<F: RowFormat>(
    r: usize,
    src: &[f32],
    scratch: &mut [i8],
    out: &mut [F::Stored],
    scales: &mut [f32],
) -> Result<()> {
    F::quantize_row(r, src, scratch, out, scales)
}
