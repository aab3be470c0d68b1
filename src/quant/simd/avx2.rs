//! AVX2+FMA fused row kernels: each 64-column block is summed in two 8-lane accumulators
//! per token, added into the row's accumulator, and the lanes are reduced pairwise.

use super::layout::{lane_byte, LANE_CHUNK};
use super::{
    int4_nibble, mxfp4_half_scale, Encoded, EncodedRows, BLOCK_COLS, E2M1_TWICE, MAX_TOKENS,
};
use crate::quant::{int4, mxfp4};
use std::arch::x86_64::*;

const _: () = assert!(int4::GROUP == LANE_CHUNK && 2 * mxfp4::BLOCK == LANE_CHUNK);

super::isa_dot_tokens!("avx2,fma", LANE_CHUNK);

/// Pairwise sum of the eight lanes.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_shuffle_ps::<0b01>(s, s));
    _mm_cvtss_f32(s)
}

/// Bytes ahead of the weight stream to prefetch: a single core's streaming bandwidth is
/// bound by the misses it has in flight, and the kernels' arithmetic between loads leaves
/// the hardware prefetcher too few of them.
const PREFETCH_AHEAD: usize = 2048;

/// Asks for the cache line `PREFETCH_AHEAD` bytes past `p` (a hint: an address past the
/// weights' end is never dereferenced).
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn prefetch_ahead<E>(p: *const E) {
    _mm_prefetch::<_MM_HINT_T0>(p.cast::<i8>().wrapping_add(PREFETCH_AHEAD));
}

/// Eight signed bytes at `p` as f32.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn widen_i8(p: *const i8) -> __m256 {
    _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(p.cast())))
}

/// The row loop of the formats stored one value per column (`$ptr` the row's first
/// weight): `$load(c)` gives the eight weights of columns `c..c+8` as f32, `$scalar(c)` one
/// tail weight.
macro_rules! dense_row {
    ($ptr:expr, $len:expr, $xs:expr, $T:ident, |$c:ident| $load:expr, |$k:ident| $scalar:expr) => {{
        let cols = $len;
        let full = cols / BLOCK_COLS * BLOCK_COLS;
        let mut row = [_mm256_setzero_ps(); $T];
        for base in (0..full).step_by(BLOCK_COLS) {
            prefetch_ahead($ptr.wrapping_add(base));
            let mut acc = [[_mm256_setzero_ps(); 2]; $T];
            for k in [0, 16, 32, 48] {
                let $c = base + k;
                let w0 = $load;
                let $c = base + k + 8;
                let w1 = $load;
                for t in 0..$T {
                    let x = $xs[t].as_ptr().add(base + k);
                    acc[t][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x), acc[t][0]);
                    acc[t][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x.add(8)), acc[t][1]);
                }
            }
            for t in 0..$T {
                row[t] = _mm256_add_ps(row[t], _mm256_add_ps(acc[t][0], acc[t][1]));
            }
        }
        let mut out = [0f32; $T];
        for t in 0..$T {
            let mut tail = 0f32;
            for $k in full..cols {
                tail += $scalar * $xs[t][$k];
            }
            out[t] = hsum(row[t]) + tail;
        }
        out
    }};
}

#[target_feature(enable = "avx2,fma")]
unsafe fn f32_row<const T: usize>(w: &[f32], xs: &[&[f32]; T]) -> [f32; T] {
    let p = w.as_ptr();
    dense_row!(p, w.len(), xs, T, |c| _mm256_loadu_ps(p.add(c)), |k| w[k])
}

#[target_feature(enable = "avx2,fma")]
unsafe fn bf16_row<const T: usize>(w: &[u16], xs: &[&[f32]; T]) -> [f32; T] {
    let p = w.as_ptr();
    dense_row!(
        p,
        w.len(),
        xs,
        T,
        |c| _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(
            _mm_loadu_si128(p.add(c).cast())
        ))),
        |k| crate::quant::bf16::widen(w[k])
    )
}

/// The unscaled sums `Σ q · x` of one int8 row.
#[target_feature(enable = "avx2,fma")]
unsafe fn int8_row<const T: usize>(q: &[i8], xs: &[&[f32]; T]) -> [f32; T] {
    let p = q.as_ptr();
    dense_row!(p, q.len(), xs, T, |c| widen_i8(p.add(c)), |k| f32::from(
        q[k]
    ))
}

/// The sign extension of a 4-bit two's-complement code, as a 16-entry byte table.
const INT4_VALUES: [i8; 16] = [0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2, -1];

/// The byte shuffles of placement `m`: lane `i` of the result holds byte
/// [`lane_byte`]`(m, i)` in its top byte and zeros below (index 0x80 writes a zero).
const PLACE: [[u8; 32]; 4] = {
    let mut t = [[0x80u8; 32]; 4];
    let mut m = 0;
    while m < 4 {
        let mut i = 0;
        while i < 8 {
            // Byte shuffles index within each 16-byte half.
            t[m][4 * i + 3] = (lane_byte(m, i) % 16) as u8;
            i += 1;
        }
        m += 1;
    }
    t
};

/// Adds one 64-column chunk of a nibble format into each token's two accumulators:
/// 32 packed bytes at `src`, each nibble mapped through the 16-entry byte `table`, each
/// value placed in the top byte of an i32 lane (so it converts exactly to `value · 2^24`)
/// and multiplied by the `top_byte_lanes` x at `chunk_x`.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn nibble_chunk<const T: usize>(
    src: *const u8,
    table: __m256i,
    place: &[__m256i; 4],
    xp: &[&[f32]; T],
    chunk_x: usize,
    acc: &mut [[__m256; 2]; T],
) {
    prefetch_ahead(src);
    let v = _mm256_loadu_si256(src.cast());
    let mask = _mm256_set1_epi8(0x0F);
    let lo = _mm256_shuffle_epi8(table, _mm256_and_si256(v, mask));
    let hi = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16::<4>(v), mask));
    for (m, &p) in place.iter().enumerate() {
        let wl = _mm256_cvtepi32_ps(_mm256_shuffle_epi8(lo, p));
        let wh = _mm256_cvtepi32_ps(_mm256_shuffle_epi8(hi, p));
        for t in 0..T {
            let x = xp[t].as_ptr().add(chunk_x + 16 * m);
            acc[t][0] = _mm256_fmadd_ps(wl, _mm256_loadu_ps(x), acc[t][0]);
            acc[t][1] = _mm256_fmadd_ps(wh, _mm256_loadu_ps(x.add(8)), acc[t][1]);
        }
    }
}

/// The placements as vectors.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn placements() -> [__m256i; 4] {
    let load = |m: usize| _mm256_loadu_si256(PLACE[m].as_ptr().cast());
    [load(0), load(1), load(2), load(3)]
}

/// A 16-entry byte table in both 16-byte halves of a vector.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn byte_table(t: &[i8; 16]) -> __m256i {
    _mm256_broadcastsi128_si256(_mm_loadu_si128(t.as_ptr().cast()))
}

#[target_feature(enable = "avx2,fma")]
unsafe fn int4_row<const T: usize>(
    packed: &[u8],
    scale: &[f32],
    cols: usize,
    xs: &[&[f32]; T],
    xp: &[&[f32]; T],
) -> [f32; T] {
    let chunks = cols / LANE_CHUNK;
    let (table, place) = (byte_table(&INT4_VALUES), placements());
    let mut row = [_mm256_setzero_ps(); T];
    for (g, &s) in scale.iter().enumerate().take(chunks) {
        let mut acc = [[_mm256_setzero_ps(); 2]; T];
        let src = packed.as_ptr().add(g * 32);
        nibble_chunk(src, table, &place, xp, g * LANE_CHUNK, &mut acc);
        let s = _mm256_set1_ps(s);
        for t in 0..T {
            row[t] = _mm256_fmadd_ps(_mm256_add_ps(acc[t][0], acc[t][1]), s, row[t]);
        }
    }
    let mut out = [0f32; T];
    for t in 0..T {
        let mut tail = 0f32;
        for (c, &x) in xs[t].iter().enumerate().skip(chunks * LANE_CHUNK) {
            tail += f32::from(int4_nibble(packed, c)) * x;
        }
        let tail_scale = scale.get(chunks).copied().unwrap_or(0.0);
        out[t] = hsum(row[t]) + tail * tail_scale;
    }
    out
}

#[target_feature(enable = "avx2,fma")]
unsafe fn mxfp4_row<const T: usize>(
    packed: &[u8],
    scales: &[u8],
    xs: &[&[f32]; T],
    xp: &[&[f32]; T],
) -> [f32; T] {
    let chunks = scales.len() / 2;
    let (table, place) = (byte_table(&E2M1_TWICE), placements());
    let mut row = [_mm256_setzero_ps(); T];
    for c in 0..chunks {
        let mut acc = [[_mm256_setzero_ps(); 2]; T];
        nibble_chunk(
            packed.as_ptr().add(c * 32),
            table,
            &place,
            xp,
            c * LANE_CHUNK,
            &mut acc,
        );
        // Lanes 0-3 hold the first 32-column block's values, lanes 4-7 the second's.
        let s = _mm256_setr_m128(
            _mm_set1_ps(mxfp4_half_scale(scales[2 * c])),
            _mm_set1_ps(mxfp4_half_scale(scales[2 * c + 1])),
        );
        for t in 0..T {
            row[t] = _mm256_fmadd_ps(_mm256_add_ps(acc[t][0], acc[t][1]), s, row[t]);
        }
    }
    let mut out = [0f32; T];
    for t in 0..T {
        out[t] = hsum(row[t]);
        if let Some(&s) = scales.get(2 * chunks) {
            // A last lone 32-column block.
            let mut tail = 0f32;
            for (c, &x) in xs[t].iter().enumerate().skip(chunks * LANE_CHUNK) {
                let nibble = (packed[c / 2] >> (4 * (c % 2))) & 0x0F;
                tail += f32::from(E2M1_TWICE[usize::from(nibble)]) * x;
            }
            out[t] += tail * mxfp4_half_scale(s);
        }
    }
    out
}
