//! AVX2+FMA fused row kernels: each 64-column block is summed in two 8-lane accumulators
//! per token, added into the row's accumulator, and the lanes are reduced pairwise.

use super::layout::SPLIT;
use super::{
    int4_nibble, mxfp4_half_scale, Encoded, EncodedRows, BLOCK_COLS, E2M1_TWICE, MAX_TOKENS,
};
use crate::quant::{int4, mxfp4};
use std::arch::x86_64::*;

/// Where each of the eight 8-byte pieces of a decoded 64-column block (the low nibbles of
/// its two 32-byte lanes' halves, then their high nibbles) meets the pair-split x: piece
/// `i` covers x's columns `PIECE_TO_X[i]..+8` of the block.
const PIECE_TO_X: [usize; 8] = [0, 8, 32, 40, 16, 24, 48, 56];

const _: () = assert!(int4::GROUP == BLOCK_COLS && mxfp4::BLOCK == SPLIT);

/// One 64-column block of decoded weights as bytes, aligned for whole-vector stores.
#[repr(align(32))]
struct Block([i8; 64]);

/// Fused `w[r] · x_t` for every token (see [`super::dot_tokens`]).
///
/// # Safety
/// The CPU must have AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn dot_tokens<const T: usize>(
    w: &EncodedRows<'_>,
    r: usize,
    xs: &[&[f32]; T],
    xp: &[&[f32]; T],
) -> [f32; T] {
    const { assert!(T <= MAX_TOKENS) };
    let c = w.cols;
    for t in 0..T {
        assert!(
            xs[t].len() == c,
            "fused dot: x row of {} for {c} columns",
            xs[t].len()
        );
        if w.wants_pair_split() {
            assert!(
                xp[t].len() >= c / SPLIT * SPLIT,
                "fused dot: short pair-split x"
            );
        }
    }
    match w.data {
        Encoded::F32(v) => f32_row(&v[r * c..(r + 1) * c], xs),
        Encoded::Bf16(b) => bf16_row(&b[r * c..(r + 1) * c], xs),
        Encoded::Int8 { q, scale } => {
            let s = scale[r];
            int8_row(&q[r * c..(r + 1) * c], xs).map(|v| v * s)
        }
        Encoded::Int4 { packed, scale } => {
            let (rb, rg) = (int4::row_bytes(c), int4::row_groups(c));
            int4_row(
                &packed[r * rb..(r + 1) * rb],
                &scale[r * rg..(r + 1) * rg],
                c,
                xs,
                xp,
            )
        }
        Encoded::Mxfp4 { packed, scales } => {
            let (rb, rs) = (c / 2, c / mxfp4::BLOCK);
            mxfp4_row(
                &packed[r * rb..(r + 1) * rb],
                &scales[r * rs..(r + 1) * rs],
                xp,
            )
        }
    }
}

/// Pairwise sum of the eight lanes.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_shuffle_ps::<0b01>(s, s));
    _mm_cvtss_f32(s)
}

/// Eight signed bytes at `p` as f32.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn widen_i8(p: *const i8) -> __m256 {
    _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(p.cast())))
}

/// The row loop of the formats stored one value per column: `$load(c)` gives the eight
/// weights of columns `c..c+8` as f32, `$scalar(c)` one tail weight.
macro_rules! dense_row {
    ($len:expr, $xs:expr, $T:ident, |$c:ident| $load:expr, |$k:ident| $scalar:expr) => {{
        let cols = $len;
        let full = cols / BLOCK_COLS * BLOCK_COLS;
        let mut row = [_mm256_setzero_ps(); $T];
        for base in (0..full).step_by(BLOCK_COLS) {
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
    dense_row!(w.len(), xs, T, |c| _mm256_loadu_ps(p.add(c)), |k| w[k])
}

#[target_feature(enable = "avx2,fma")]
unsafe fn bf16_row<const T: usize>(w: &[u16], xs: &[&[f32]; T]) -> [f32; T] {
    let p = w.as_ptr();
    dense_row!(
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
    dense_row!(q.len(), xs, T, |c| widen_i8(p.add(c)), |k| f32::from(q[k]))
}

/// Splits 32 packed bytes into their sign-extended low nibbles (`block[0..32]`) and high
/// nibbles (`block[32..64]`), each mapped through `lookup` when given (a 16-entry byte
/// table) or else read as two's-complement int4.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn split_nibbles(src: *const u8, lookup: Option<__m256i>, block: &mut Block) {
    let v = _mm256_loadu_si256(src.cast());
    let mask = _mm256_set1_epi8(0x0F);
    let lo = _mm256_and_si256(v, mask);
    let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(v), mask);
    let (lo, hi) = match lookup {
        Some(t) => (_mm256_shuffle_epi8(t, lo), _mm256_shuffle_epi8(t, hi)),
        None => {
            // (n ^ 8) - 8 sign-extends a 4-bit two's-complement value.
            let eight = _mm256_set1_epi8(8);
            (
                _mm256_sub_epi8(_mm256_xor_si256(lo, eight), eight),
                _mm256_sub_epi8(_mm256_xor_si256(hi, eight), eight),
            )
        }
    };
    let dst = block.0.as_mut_ptr();
    _mm256_store_si256(dst.cast(), lo);
    _mm256_store_si256(dst.add(32).cast(), hi);
}

#[target_feature(enable = "avx2,fma")]
unsafe fn int4_row<const T: usize>(
    packed: &[u8],
    scale: &[f32],
    cols: usize,
    xs: &[&[f32]; T],
    xp: &[&[f32]; T],
) -> [f32; T] {
    let groups = cols / BLOCK_COLS;
    let mut block = Block([0; 64]);
    let mut row = [_mm256_setzero_ps(); T];
    for (g, &s) in scale.iter().enumerate().take(groups) {
        split_nibbles(packed.as_ptr().add(g * 32), None, &mut block);
        let mut acc = [[_mm256_setzero_ps(); 2]; T];
        for (i, &xo) in PIECE_TO_X.iter().enumerate() {
            let w = widen_i8(block.0.as_ptr().add(8 * i));
            for t in 0..T {
                let x = _mm256_loadu_ps(xp[t].as_ptr().add(g * BLOCK_COLS + xo));
                acc[t][i % 2] = _mm256_fmadd_ps(w, x, acc[t][i % 2]);
            }
        }
        let s = _mm256_set1_ps(s);
        for t in 0..T {
            row[t] = _mm256_fmadd_ps(_mm256_add_ps(acc[t][0], acc[t][1]), s, row[t]);
        }
    }
    let mut out = [0f32; T];
    for t in 0..T {
        let mut tail = 0f32;
        for (c, &x) in xs[t].iter().enumerate().skip(groups * BLOCK_COLS) {
            tail += f32::from(int4_nibble(packed, c)) * x;
        }
        let tail_scale = scale.get(groups).copied().unwrap_or(0.0);
        out[t] = hsum(row[t]) + tail * tail_scale;
    }
    out
}

#[target_feature(enable = "avx2,fma")]
unsafe fn mxfp4_row<const T: usize>(packed: &[u8], scales: &[u8], xp: &[&[f32]; T]) -> [f32; T] {
    let blocks = scales.len();
    let table = _mm256_broadcastsi128_si256(_mm_loadu_si128(E2M1_TWICE.as_ptr().cast()));
    let mut block = Block([0; 64]);
    let mut row = [_mm256_setzero_ps(); T];
    // Two 32-column blocks per 32 packed bytes; pieces 0,1,4,5 are the first block's.
    for pair in 0..blocks / 2 {
        split_nibbles(packed.as_ptr().add(pair * 32), Some(table), &mut block);
        let mut acc = [[[_mm256_setzero_ps(); 2]; 2]; T];
        for (i, &xo) in PIECE_TO_X.iter().enumerate() {
            let w = widen_i8(block.0.as_ptr().add(8 * i));
            let b = (i / 2) % 2;
            for t in 0..T {
                let x = _mm256_loadu_ps(xp[t].as_ptr().add(pair * BLOCK_COLS + xo));
                acc[t][b][i % 2] = _mm256_fmadd_ps(w, x, acc[t][b][i % 2]);
            }
        }
        let s0 = _mm256_set1_ps(mxfp4_half_scale(scales[2 * pair]));
        let s1 = _mm256_set1_ps(mxfp4_half_scale(scales[2 * pair + 1]));
        for t in 0..T {
            let [b0, b1] = acc[t];
            row[t] = _mm256_fmadd_ps(_mm256_add_ps(b0[0], b0[1]), s0, row[t]);
            row[t] = _mm256_fmadd_ps(_mm256_add_ps(b1[0], b1[1]), s1, row[t]);
        }
    }
    if blocks % 2 == 1 {
        // The last block alone: its 16 bytes through the 128-bit forms.
        let b = blocks - 1;
        let v = _mm_loadu_si128(packed.as_ptr().add(b * 16).cast());
        let mask = _mm_set1_epi8(0x0F);
        let table = _mm_loadu_si128(E2M1_TWICE.as_ptr().cast());
        let lo = _mm_shuffle_epi8(table, _mm_and_si128(v, mask));
        let hi = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16::<4>(v), mask));
        let dst = block.0.as_mut_ptr();
        _mm_storeu_si128(dst.cast(), lo);
        _mm_storeu_si128(dst.add(16).cast(), hi);
        let mut acc = [[_mm256_setzero_ps(); 2]; T];
        for i in 0..4 {
            let w = widen_i8(block.0.as_ptr().add(8 * i));
            for t in 0..T {
                let x = _mm256_loadu_ps(xp[t].as_ptr().add(b * SPLIT + 8 * i));
                acc[t][i % 2] = _mm256_fmadd_ps(w, x, acc[t][i % 2]);
            }
        }
        let s = _mm256_set1_ps(mxfp4_half_scale(scales[b]));
        for t in 0..T {
            row[t] = _mm256_fmadd_ps(_mm256_add_ps(acc[t][0], acc[t][1]), s, row[t]);
        }
    }
    let mut out = [0f32; T];
    for t in 0..T {
        out[t] = hsum(row[t]);
    }
    out
}
