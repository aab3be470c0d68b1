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

/// `Σ w · x` of one 32-column block for each token, `x` the block's pair-split columns
/// from `xp[t][at..]`.
#[inline]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn block_sums<const T: usize>(w: [__m512; 2], xp: &[&[f32]; T], at: usize) -> [__m512; T] {
    let mut out = [_mm512_setzero_ps(); T];
    for t in 0..T {
        let x = xp[t].as_ptr().add(at);
        out[t] = _mm512_fmadd_ps(
            w[1],
            _mm512_loadu_ps(x.add(16)),
            _mm512_mul_ps(w[0], _mm512_loadu_ps(x)),
        );
    }
    out
}

#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn int4_row<const T: usize>(
    packed: &[u8],
    scale: &[f32],
    cols: usize,
    xs: &[&[f32]; T],
    xp: &[&[f32]; T],
) -> [f32; T] {
    let groups = cols / int4::GROUP;
    let table = _mm512_loadu_ps(INT4_TABLE.as_ptr());
    let mut row = [_mm512_setzero_ps(); T];
    for (g, &s) in scale.iter().enumerate().take(groups) {
        let src = packed.as_ptr().add(g * 32);
        prefetch_ahead(src);
        let a = block_sums(nibble_block(src, table), xp, g * 64);
        let b = block_sums(nibble_block(src.add(16), table), xp, g * 64 + 32);
        let s = _mm512_set1_ps(s);
        for t in 0..T {
            row[t] = _mm512_fmadd_ps(_mm512_add_ps(a[t], b[t]), s, row[t]);
        }
    }
    let mut out = [0f32; T];
    for t in 0..T {
        let mut tail = 0f32;
        for (c, &x) in xs[t].iter().enumerate().skip(groups * int4::GROUP) {
            tail += f32::from(int4_nibble(packed, c)) * x;
        }
        let tail_scale = scale.get(groups).copied().unwrap_or(0.0);
        out[t] = _mm512_reduce_add_ps(row[t]) + tail * tail_scale;
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
    let table = _mm512_loadu_ps(E2M1_TWICE_TABLE.as_ptr());
    // The two blocks of a 64-column chunk accumulate apart: two independent add chains
    // per token.
    let mut row = [[_mm512_setzero_ps(); 2]; T];
    let chunks = scales.len() / 2;
    // The half scales of 16 blocks at a time, decoded in one vector and broadcast from
    // memory (a load, where a scalar decode would take two shuffle-port moves per block).
    let mut half = [0f32; 16];
    for c in 0..chunks {
        if c % 8 == 0 {
            let first = 2 * c;
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
        let src = packed.as_ptr().add(c * 32);
        prefetch_ahead(src);
        let a = block_sums(nibble_block(src, table), xp, c * 64);
        let b = block_sums(nibble_block(src.add(16), table), xp, c * 64 + SPLIT);
        let sa = _mm512_set1_ps(half[2 * (c % 8)]);
        let sb = _mm512_set1_ps(half[2 * (c % 8) + 1]);
        for t in 0..T {
            row[t][0] = _mm512_fmadd_ps(a[t], sa, row[t][0]);
            row[t][1] = _mm512_fmadd_ps(b[t], sb, row[t][1]);
        }
    }
    if let Some(&s) = scales.get(2 * chunks) {
        // A last lone 32-column block.
        let a = block_sums(
            nibble_block(packed.as_ptr().add(chunks * 32), table),
            xp,
            chunks * 64,
        );
        let s = _mm512_set1_ps(mxfp4_half_scale(s));
        for t in 0..T {
            row[t][0] = _mm512_fmadd_ps(a[t], s, row[t][0]);
        }
    }
    let mut out = [0f32; T];
    for t in 0..T {
        out[t] = _mm512_reduce_add_ps(_mm512_add_ps(row[t][0], row[t][1]));
    }
    out
}
