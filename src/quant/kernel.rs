//! The matmul drivers every weight format shares: rayon over blocks of output rows, either
//! portable (each block decoded once to f32, then dotted with all `n` tokens) or fused
//! (the SIMD kernels of [`super::simd`] read the stored encoding directly).

use super::partner;
use super::pool::{min_len, partner_pays, POOL_WORK_FROM};
use super::simd::{self, EncodedRows, SimdLevel, MAX_TOKENS, ROW_BLOCK};
use rayon::prelude::*;

/// Rows decoded together per task. Eight rows of the widest dense matrix (7168 columns)
/// take 229 KiB of f32, which stays in L2 while every token of the chunk streams past it.
const BLOCK_ROWS: usize = 8;

/// Output rows a task of a many-token matmul owns. Every row of the task meets a token
/// tile while that tile sits in L2, so x streams from memory once per task rather than
/// once per row: 32 rows cut that traffic 32-fold and still leave 64 tasks for a
/// 2048-row expert matrix.
pub(crate) const TILE_ROWS: usize = 32;

/// Tokens in the tile a task's rows pass over together: 16 rows of the widest input (7168
/// columns) take 0.9 MiB with their prepared copy, which fits in L2 beside the task's
/// weight rows. See docs/perf.md, "CPU".
pub(crate) const TILE_TOKENS: usize = 16;

/// Visits a task's `count` rows and `n` tokens as `(first row, rows, first token, tokens)`
/// with at most `rows_per_visit` rows and `per_visit` tokens a visit (a kernel call's):
/// tile by tile of [`TILE_TOKENS`], every row over the tile. Each output is still computed
/// by one kernel call, so the order only moves cache traffic, never a result bit.
pub(crate) fn for_each_tile(
    count: usize,
    n: usize,
    rows_per_visit: usize,
    per_visit: usize,
    mut visit: impl FnMut(usize, usize, usize, usize),
) {
    for tile in (0..n).step_by(TILE_TOKENS) {
        let end = (tile + TILE_TOKENS).min(n);
        for i in (0..count).step_by(rows_per_visit) {
            let rows = (count - i).min(rows_per_visit);
            for t0 in (tile..end).step_by(per_visit) {
                visit(i, rows, t0, (end - t0).min(per_visit));
            }
        }
    }
}

/// Lanes of the dot product's accumulator array: wide enough for two 8-lane vectors, so
/// the compiler can keep independent add chains in flight without reassociating.
const LANES: usize = 16;

/// The whole matrix of a row source as row-major f32.
pub(crate) fn dequantize(src: &impl RowSource) -> Vec<f32> {
    let cols = src.cols();
    let mut out = vec![0f32; src.rows() * cols];
    if cols > 0 {
        for (r, row) in out.chunks_exact_mut(cols).enumerate() {
            src.decode(r, row);
        }
    }
    out
}

/// A matrix whose rows can be produced as f32, one at a time.
pub(crate) trait RowSource: Sync {
    /// Output dimension.
    fn rows(&self) -> usize;
    /// Input dimension.
    fn cols(&self) -> usize;
    /// Decode row `r` into `out` (`out.len() == cols`).
    fn decode(&self, r: usize, out: &mut [f32]);
    /// Row `r` without decoding, for formats stored as f32.
    fn borrowed(&self, _r: usize) -> Option<&[f32]> {
        None
    }
    /// The rows in their stored encoding, for the fused SIMD kernels.
    fn encoded(&self) -> EncodedRows<'_>;
}

/// Dot product with f32 accumulation in [`LANES`] independent lanes (auto-vectorized).
#[inline]
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let mut acc = [0f32; LANES];
    let ca = a.chunks_exact(LANES);
    let cb = b.chunks_exact(LANES);
    let (ta, tb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..LANES {
            acc[i] += x[i] * y[i];
        }
    }
    let mut tail = 0f32;
    for (x, y) in ta.iter().zip(tb) {
        tail += x * y;
    }
    fold_lanes(acc) + tail
}

/// The sum of `N` (a power of two) partial sums, folded pairwise (lanes `i` and `i + N/2`,
/// then halves again): a fixed, short reduction order that the SIMD kernels reproduce.
#[inline]
pub(crate) fn fold_lanes<const N: usize>(mut acc: [f32; N]) -> f32 {
    let mut width = N / 2;
    while width > 0 {
        for i in 0..width {
            acc[i] += acc[i + width];
        }
        width /= 2;
    }
    acc[0]
}

/// `y[t, r] = Σ_c w[r, c] · x[t, c]` for `x: [n, cols]`, `y: [n, rows]`, both row-major.
///
/// Runs on `level`'s kernels.
///
/// Panics if the slice lengths do not match the shapes, or if this CPU cannot run `level`:
/// those are caller bugs, never data.
pub(crate) fn matmul<S: RowSource>(w: &S, x: &[f32], n: usize, y: &mut [f32], level: SimdLevel) {
    let (rows, cols) = (w.rows(), w.cols());
    assert_eq!(x.len(), n * cols, "matmul: x must be [n={n}, cols={cols}]");
    assert_eq!(y.len(), n * rows, "matmul: y must be [n={n}, rows={rows}]");
    assert!(
        level.is_supported(),
        "matmul: this CPU cannot run {} kernels",
        level.name()
    );
    if n == 0 || rows == 0 {
        return;
    }
    if cols == 0 {
        y.fill(0.0);
        return;
    }
    if level == SimdLevel::Portable {
        portable_matmul(w, x, n, y);
    } else {
        fused_matmul(&w.encoded(), x, n, y, level);
    }
}

/// The portable driver: each row decoded to f32, then [`dot`] with every token.
fn portable_matmul<S: RowSource>(w: &S, x: &[f32], n: usize, y: &mut [f32]) {
    let (rows, cols) = (w.rows(), w.cols());
    let work = rows * cols * n;
    if n == 1 {
        // y is one contiguous row: write it in place.
        let tasks = rows.div_ceil(BLOCK_ROWS);
        y.par_chunks_mut(BLOCK_ROWS)
            .with_min_len(min_len(tasks, work))
            .enumerate()
            .for_each_init(
                || vec![0f32; cols],
                |buf, (b, ys)| {
                    for (i, out) in ys.iter_mut().enumerate() {
                        let r = b * BLOCK_ROWS + i;
                        *out = match w.borrowed(r) {
                            Some(row) => dot(row, x),
                            None => {
                                w.decode(r, buf);
                                dot(buf, x)
                            }
                        };
                    }
                },
            );
        return;
    }
    // Row-major [rows, n] so that each task owns a contiguous slice; transposed at the end.
    let mut yt = vec![0f32; rows * n];
    let tasks = rows.div_ceil(BLOCK_ROWS);
    yt.par_chunks_mut(BLOCK_ROWS * n)
        .with_min_len(min_len(tasks, work))
        .enumerate()
        .for_each_init(
            || vec![0f32; BLOCK_ROWS * cols],
            |buf, (b, out)| {
                let first = b * BLOCK_ROWS;
                let count = out.len() / n;
                for (i, dst) in buf.chunks_exact_mut(cols).take(count).enumerate() {
                    w.decode(first + i, dst);
                }
                for (t, xt) in x.chunks_exact(cols).enumerate() {
                    for i in 0..count {
                        out[i * n + t] = dot(&buf[i * cols..(i + 1) * cols], xt);
                    }
                }
            },
        );
    transpose(&yt, rows, n, y);
}

/// `y: [n, rows]` from `yt: [rows, n]`, tokens across the pool when it pays.
fn transpose(yt: &[f32], rows: usize, n: usize, y: &mut [f32]) {
    y.par_chunks_mut(rows)
        .with_min_len(min_len(n, rows * n))
        .enumerate()
        .for_each(|(t, yrow)| {
            for (r, v) in yrow.iter_mut().enumerate() {
                *v = yt[r * n + t];
            }
        });
}

/// The fused driver: every output through [`simd::dot_tokens`], tokens taken up to
/// [`MAX_TOKENS`] at a time while the row is hot in L1, over token tiles that stay in L2
/// ([`for_each_tile`]). Shapes are checked and non-empty.
fn fused_matmul(w: &EncodedRows<'_>, x: &[f32], n: usize, y: &mut [f32], level: SimdLevel) {
    let (rows, cols) = (w.rows, w.cols);
    let work = rows * cols * n;
    let xs: Vec<&[f32]> = x.chunks_exact(cols).collect();
    let prepared: Vec<Vec<f32>> = if w.packs_nibbles() {
        xs.iter().map(|xt| simd::prepare(level, xt)).collect()
    } else {
        Vec::new()
    };
    let xp: Vec<&[f32]> = if w.packs_nibbles() {
        prepared.iter().map(Vec::as_slice).collect()
    } else {
        xs.clone()
    };
    if n == 1 {
        let (x1, p1) = ([xs[0]], [xp[0]]);
        y.par_chunks_mut(BLOCK_ROWS)
            .with_min_len(min_len(rows.div_ceil(BLOCK_ROWS), work))
            .enumerate()
            .for_each(|(b, ys)| {
                for (i, out) in ys.iter_mut().enumerate() {
                    [*out] = simd::dot_tokens(level, w, b * BLOCK_ROWS + i, &x1, &p1);
                }
            });
        return;
    }
    // Rows `r0..` of every token into `out` ([count, n], row-major).
    let rows_from = |r0: usize, out: &mut [f32]| {
        for_each_tile(
            out.len() / n,
            n,
            ROW_BLOCK,
            MAX_TOKENS,
            |i, count, t0, take| {
                let r = r0 + i;
                let (xs, xp) = (&xs[t0..], &xp[t0..]);
                let put = |k: usize, y: &[f32]| {
                    let at = (i + k) * n + t0;
                    out[at..at + y.len()].copy_from_slice(y);
                };
                match take {
                    1 => tokens::<1>(level, w, r, count, xs, xp, put),
                    2 => tokens::<2>(level, w, r, count, xs, xp, put),
                    3 => tokens::<3>(level, w, r, count, xs, xp, put),
                    _ => tokens::<4>(level, w, r, count, xs, xp, put),
                }
            },
        );
    };
    // Row-major [rows, n] so that each task owns a contiguous slice; transposed at the end.
    let mut yt = vec![0f32; rows * n];
    if work < POOL_WORK_FROM && partner_pays(n, work) {
        // Half the rows, in whole row blocks, on the partner thread.
        let half = (rows / 2).next_multiple_of(ROW_BLOCK).min(rows);
        partner::halves(&mut yt, half * n, |first, out| rows_from(first / n, out));
    } else {
        yt.par_chunks_mut(TILE_ROWS * n)
            .with_min_len(min_len(rows.div_ceil(TILE_ROWS), work))
            .enumerate()
            .for_each(|(b, out)| rows_from(b * TILE_ROWS, out));
    }
    transpose(&yt, rows, n, y);
}

/// The first `T` tokens of `xs` / `xp` through rows `r..r + count` (`count` ≤
/// [`ROW_BLOCK`]), each row's `T` results handed to `put(row offset, results)`.
fn tokens<const T: usize>(
    level: SimdLevel,
    w: &EncodedRows<'_>,
    r: usize,
    count: usize,
    xs: &[&[f32]],
    xp: &[&[f32]],
    mut put: impl FnMut(usize, &[f32]),
) {
    let xs: [&[f32]; T] = std::array::from_fn(|t| xs[t]);
    let xp: [&[f32]; T] = std::array::from_fn(|t| xp[t]);
    if count == ROW_BLOCK {
        let ys = simd::dot_rows_tokens(level, w, r, &xs, &xp);
        for (i, y) in ys.iter().enumerate() {
            put(i, y);
        }
    } else {
        for i in 0..count {
            put(i, &simd::dot_tokens(level, w, r + i, &xs, &xp));
        }
    }
}
