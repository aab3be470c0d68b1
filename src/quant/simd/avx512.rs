//! AVX-512 fused row kernels: each 64-column block is summed in two 16-lane accumulators
//! per token, added into the row's accumulator, and the lanes are reduced at the end.
//!
//! The nibble formats widen 16 packed bytes to sixteen i32 lanes and look both nibbles up
//! in a 16-entry f32 table (`vpermps` reads only an index's low four bits), which gives
//! the sixteen even and the sixteen odd columns of a 32-column block as f32 directly: x is
//! read in the [`pair_split`](super::layout::pair_split) order.

use super::layout::SPLIT;
use super::{
    int4_nibble, mxfp4_half_scale, Encoded, EncodedRows, BLOCK_COLS, E2M1_TWICE, MAX_TOKENS,
};
use crate::quant::{int4, mxfp4};
use std::arch::x86_64::*;

const _: () = assert!(int4::GROUP == 2 * SPLIT && mxfp4::BLOCK == SPLIT && BLOCK_COLS == 64);

super::isa_dot_tokens!("avx512f,avx2,fma", SPLIT);

/// Fused `w[r + i] · x_t` for `R` consecutive rows and every token, where the format packs
/// nibbles (`None` for the others): see [`super::dot_rows_tokens`].
///
/// # Safety
/// The CPU must have AVX-512F, AVX2 and FMA.
#[target_feature(enable = "avx512f,avx2,fma")]
pub(super) unsafe fn dot_rows_tokens<const R: usize, const T: usize>(
    w: &EncodedRows<'_>,
    r: usize,
    xs: &[&[f32]; T],
    xp: &[&[f32]; T],
) -> Option<[[f32; T]; R]> {
    if !w.packs_nibbles() {
        return None;
    }
    let c = w.cols;
    assert!(r + R <= w.rows, "fused dot: rows {r}+{R} of {}", w.rows);
    for t in 0..T {
        assert!(
            xs[t].len() == c && xp[t].len() >= c / SPLIT * SPLIT,
            "fused dot: x row of {} for {c} columns",
            xs[t].len()
        );
    }
    match w.data {
        Encoded::Int4 { packed, scale } => {
            let (rb, rg) = (int4::row_bytes(c), int4::row_groups(c));
            let rows = std::array::from_fn(|i| &packed[(r + i) * rb..(r + i + 1) * rb]);
            let scales = std::array::from_fn(|i| &scale[(r + i) * rg..(r + i + 1) * rg]);
            Some(int4_rows(rows, scales, c, xs, xp))
        }
        Encoded::Mxfp4 { packed, scales } => {
            let (rb, rs) = (c / 2, c / mxfp4::BLOCK);
            let rows = std::array::from_fn(|i| &packed[(r + i) * rb..(r + i + 1) * rb]);
            let scales = std::array::from_fn(|i| &scales[(r + i) * rs..(r + i + 1) * rs]);
            Some(mxfp4_rows(rows, scales, xp))
        }
        Encoded::F32(_) | Encoded::Bf16(_) | Encoded::Int8 { .. } => None,
    }
}

/// Bytes ahead of the weight stream to prefetch (as in the AVX2 kernels: one core's
/// streaming bandwidth is bound by the misses it has in flight).
const PREFETCH_AHEAD: usize = 2048;

/// Asks for the cache line `PREFETCH_AHEAD` bytes past `p` (a hint: an address past the
/// weights' end is never dereferenced).
#[inline]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn prefetch_ahead<E>(p: *const E) {
    _mm_prefetch::<_MM_HINT_T0>(p.cast::<i8>().wrapping_add(PREFETCH_AHEAD));
}

/// The row loop of the formats stored one value per column (`$ptr` the row's first
/// weight): `$load(c)` gives the sixteen weights of columns `c..c+16` as f32, `$scalar(c)`
/// one tail weight.
macro_rules! dense_row {
    ($ptr:expr, $len:expr, $xs:expr, $T:ident, |$c:ident| $load:expr, |$k:ident| $scalar:expr) => {{
        let cols = $len;
        let full = cols / BLOCK_COLS * BLOCK_COLS;
        let mut row = [_mm512_setzero_ps(); $T];
        for base in (0..full).step_by(BLOCK_COLS) {
            prefetch_ahead($ptr.wrapping_add(base));
            let mut acc = [[_mm512_setzero_ps(); 2]; $T];
            for k in [0, 32] {
                let $c = base + k;
                let w0 = $load;
                let $c = base + k + 16;
                let w1 = $load;
                for t in 0..$T {
                    let x = $xs[t].as_ptr().add(base + k);
                    acc[t][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x), acc[t][0]);
                    acc[t][1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x.add(16)), acc[t][1]);
                }
            }
            for t in 0..$T {
                row[t] = _mm512_add_ps(row[t], _mm512_add_ps(acc[t][0], acc[t][1]));
            }
        }
        let mut out = [0f32; $T];
        for t in 0..$T {
            let mut tail = 0f32;
            for $k in full..cols {
                tail += $scalar * $xs[t][$k];
            }
            out[t] = _mm512_reduce_add_ps(row[t]) + tail;
        }
        out
    }};
}

#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn f32_row<const T: usize>(w: &[f32], xs: &[&[f32]; T]) -> [f32; T] {
    let p = w.as_ptr();
    dense_row!(p, w.len(), xs, T, |c| _mm512_loadu_ps(p.add(c)), |k| w[k])
}

#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn bf16_row<const T: usize>(w: &[u16], xs: &[&[f32]; T]) -> [f32; T] {
    let p = w.as_ptr();
    dense_row!(
        p,
        w.len(),
        xs,
        T,
        |c| _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(
            _mm256_loadu_si256(p.add(c).cast())
        ))),
        |k| crate::quant::bf16::widen(w[k])
    )
}

/// The unscaled sums `Σ q · x` of one int8 row.
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn int8_row<const T: usize>(q: &[i8], xs: &[&[f32]; T]) -> [f32; T] {
    let p = q.as_ptr();
    dense_row!(
        p,
        q.len(),
        xs,
        T,
        |c| _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p.add(c).cast()))),
        |k| f32::from(q[k])
    )
}

/// The sign extension of a 4-bit two's-complement code, for every code.
const INT4_TABLE: [f32; 16] = [
    0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, -8.0, -7.0, -6.0, -5.0, -4.0, -3.0, -2.0, -1.0,
];

/// [`E2M1_TWICE`] as f32.
const E2M1_TWICE_TABLE: [f32; 16] = {
    let mut t = [0f32; 16];
    let mut i = 0;
    while i < 16 {
        t[i] = E2M1_TWICE[i] as f32;
        i += 1;
    }
    t
};

/// The 32 columns packed in the 16 bytes at `src`, looked up in `table`: the even
/// columns (low nibbles), then the odd ones (high nibbles).
#[inline]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn nibble_block(src: *const u8, table: __m512) -> [__m512; 2] {
    let d = _mm512_cvtepu8_epi32(_mm_loadu_si128(src.cast()));
    [
        _mm512_permutexvar_ps(d, table),
        _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(d), table),
    ]
}

#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn int4_row<const T: usize>(
    packed: &[u8],
    scale: &[f32],
    cols: usize,
    xs: &[&[f32]; T],
    xp: &[&[f32]; T],
) -> [f32; T] {
    let [out] = int4_rows::<1, T>([packed], [scale], cols, xs, xp);
    out
}

/// `R` int4 rows over the same `T` tokens: each x vector loaded feeds every row's
/// multiply-adds. Every output's operations are the same, in the same order, whatever `R`.
// `g` indexes the packed bytes, x and every row's scales alike.
#[allow(clippy::needless_range_loop)]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn int4_rows<const R: usize, const T: usize>(
    packed: [&[u8]; R],
    scale: [&[f32]; R],
    cols: usize,
    xs: &[&[f32]; T],
    xp: &[&[f32]; T],
) -> [[f32; T]; R] {
    let groups = cols / int4::GROUP;
    for i in 0..R {
        assert!(packed[i].len() >= groups * 32 && scale[i].len() >= groups);
    }
    let table = _mm512_loadu_ps(INT4_TABLE.as_ptr());
    let mut acc = [[_mm512_setzero_ps(); T]; R];
    for g in 0..groups {
        let mut w = [[_mm512_setzero_ps(); 4]; R];
        let mut s = [_mm512_setzero_ps(); R];
        for i in 0..R {
            let src = packed[i].as_ptr().add(g * 32);
            prefetch_ahead(src);
            let [a0, a1] = nibble_block(src, table);
            let [b0, b1] = nibble_block(src.add(16), table);
            w[i] = [a0, a1, b0, b1];
            s[i] = _mm512_set1_ps(scale[i][g]);
        }
        for t in 0..T {
            let x = xp[t].as_ptr().add(g * 64);
            let xv = [
                _mm512_loadu_ps(x),
                _mm512_loadu_ps(x.add(16)),
                _mm512_loadu_ps(x.add(32)),
                _mm512_loadu_ps(x.add(48)),
            ];
            for i in 0..R {
                let [a0, a1, b0, b1] = w[i];
                let a = _mm512_fmadd_ps(a1, xv[1], _mm512_mul_ps(a0, xv[0]));
                let b = _mm512_fmadd_ps(b1, xv[3], _mm512_mul_ps(b0, xv[2]));
                acc[i][t] = _mm512_fmadd_ps(_mm512_add_ps(a, b), s[i], acc[i][t]);
            }
        }
    }
    let mut out = [[0f32; T]; R];
    for i in 0..R {
        let tail_scale = scale[i].get(groups).copied().unwrap_or(0.0);
        for t in 0..T {
            let mut tail = 0f32;
            for (c, &x) in xs[t].iter().enumerate().skip(groups * int4::GROUP) {
                tail += f32::from(int4_nibble(packed[i], c)) * x;
            }
            out[i][t] = _mm512_reduce_add_ps(acc[i][t]) + tail * tail_scale;
        }
    }
    out
}

#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn mxfp4_row<const T: usize>(
    packed: &[u8],
    scales: &[u8],
    _xs: &[&[f32]; T],
    xp: &[&[f32]; T],
) -> [f32; T] {
    let [out] = mxfp4_rows::<1, T>([packed], [scales], xp);
    out
}

/// The half scales of row `scales`' 16 blocks from `first`, decoded in one vector (a load
/// per block where a scalar decode would take two shuffle-port moves).
#[inline]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn half_scales(scales: &[u8], first: usize, half: &mut [f32; 16]) {
    if first + 16 <= scales.len() {
        let e = _mm512_cvtepu8_epi32(_mm_loadu_si128(scales.as_ptr().add(first).cast()));
        let v = _mm512_castsi512_ps(_mm512_slli_epi32::<23>(e));
        _mm512_storeu_ps(half.as_mut_ptr(), _mm512_mul_ps(v, _mm512_set1_ps(0.5)));
    } else {
        for (h, &e) in half.iter_mut().zip(&scales[first..]) {
            *h = mxfp4_half_scale(e);
        }
    }
}

/// `R` MXFP4 rows (the same column count) over the same `T` tokens: each x vector loaded
/// feeds every row's multiply-adds. The two blocks of a 64-column chunk accumulate apart
/// (two independent add chains per row and token); every output's operations are the
/// same, in the same order, whatever `R`.
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn mxfp4_rows<const R: usize, const T: usize>(
    packed: [&[u8]; R],
    scales: [&[u8]; R],
    xp: &[&[f32]; T],
) -> [[f32; T]; R] {
    let blocks = scales[0].len();
    for i in 0..R {
        assert!(scales[i].len() == blocks && packed[i].len() >= blocks * 16);
    }
    let table = _mm512_loadu_ps(E2M1_TWICE_TABLE.as_ptr());
    let mut acc = [[[_mm512_setzero_ps(); 2]; T]; R];
    let chunks = blocks / 2;
    let mut half = [[0f32; 16]; R];
    for c in 0..chunks {
        if c % 8 == 0 {
            for i in 0..R {
                half_scales(scales[i], 2 * c, &mut half[i]);
            }
        }
        for k in 0..2 {
            let at = c * 64 + k * SPLIT;
            let mut w = [[_mm512_setzero_ps(); 2]; R];
            let mut s = [_mm512_setzero_ps(); R];
            for i in 0..R {
                let src = packed[i].as_ptr().add(c * 32 + k * 16);
                if k == 0 {
                    prefetch_ahead(src);
                }
                w[i] = nibble_block(src, table);
                s[i] = _mm512_set1_ps(half[i][2 * (c % 8) + k]);
            }
            for t in 0..T {
                let x = xp[t].as_ptr().add(at);
                let (x0, x1) = (_mm512_loadu_ps(x), _mm512_loadu_ps(x.add(16)));
                for i in 0..R {
                    let v = _mm512_fmadd_ps(w[i][1], x1, _mm512_mul_ps(w[i][0], x0));
                    acc[i][t][k] = _mm512_fmadd_ps(v, s[i], acc[i][t][k]);
                }
            }
        }
    }
    if blocks % 2 == 1 {
        // A last lone 32-column block.
        for i in 0..R {
            let w = nibble_block(packed[i].as_ptr().add(chunks * 32), table);
            let s = _mm512_set1_ps(mxfp4_half_scale(scales[i][2 * chunks]));
            for t in 0..T {
                let x = xp[t].as_ptr().add(chunks * 64);
                let v = _mm512_fmadd_ps(
                    w[1],
                    _mm512_loadu_ps(x.add(16)),
                    _mm512_mul_ps(w[0], _mm512_loadu_ps(x)),
                );
                acc[i][t][0] = _mm512_fmadd_ps(v, s, acc[i][t][0]);
            }
        }
    }
    let mut out = [[0f32; T]; R];
    for i in 0..R {
        for t in 0..T {
            out[i][t] = _mm512_reduce_add_ps(_mm512_add_ps(acc[i][t][0], acc[i][t][1]));
        }
    }
    out
}
