//! aarch64 NEON fused row kernels: each 64-column block is summed in four 4-lane
//! accumulators per token, added into the row's accumulator, and the lanes are reduced
//! pairwise. The exact path multiplies f32 by f32, so the dot-product extension (integer
//! dots) has no use here.

use super::layout::SPLIT;
use super::{
    int4_nibble, mxfp4_half_scale, Encoded, EncodedRows, BLOCK_COLS, E2M1_TWICE, MAX_TOKENS,
};
use crate::quant::{int4, mxfp4};
use std::arch::aarch64::*;

const _: () = assert!(int4::GROUP == BLOCK_COLS && mxfp4::BLOCK == SPLIT);

super::isa_dot_tokens!("neon", SPLIT);

/// Sixteen signed bytes as four f32 vectors, in order.
#[inline]
#[target_feature(enable = "neon")]
unsafe fn widen_i8(b: int8x16_t) -> [float32x4_t; 4] {
    let lo = vmovl_s8(vget_low_s8(b));
    let hi = vmovl_high_s8(b);
    [
        vcvtq_f32_s32(vmovl_s16(vget_low_s16(lo))),
        vcvtq_f32_s32(vmovl_high_s16(lo)),
        vcvtq_f32_s32(vmovl_s16(vget_low_s16(hi))),
        vcvtq_f32_s32(vmovl_high_s16(hi)),
    ]
}

/// Four bf16 values at `p` as f32 (a bf16 is the top half of an f32).
#[inline]
#[target_feature(enable = "neon")]
unsafe fn widen_bf16(p: *const u16) -> float32x4_t {
    vreinterpretq_f32_u32(vshll_n_u16::<16>(vld1_u16(p)))
}

/// Adds the sixteen weights `w` times `x[0..16]` into one token's four accumulators.
#[inline]
#[target_feature(enable = "neon")]
unsafe fn fma16(acc: &mut [float32x4_t; 4], w: [float32x4_t; 4], x: *const f32) {
    for j in 0..4 {
        acc[j] = vfmaq_f32(acc[j], w[j], vld1q_f32(x.add(4 * j)));
    }
}

/// The sum of four accumulators, pairwise.
#[inline]
#[target_feature(enable = "neon")]
unsafe fn sum4(a: [float32x4_t; 4]) -> float32x4_t {
    vaddq_f32(vaddq_f32(a[0], a[1]), vaddq_f32(a[2], a[3]))
}

/// The row loop of the formats stored one value per column: `$load(c)` gives the sixteen
/// weights of columns `c..c+16` as f32, `$scalar(c)` one tail weight.
macro_rules! dense_row {
    ($len:expr, $xs:expr, $T:ident, |$c:ident| $load:expr, |$k:ident| $scalar:expr) => {{
        let cols = $len;
        let full = cols / BLOCK_COLS * BLOCK_COLS;
        let mut row = [vdupq_n_f32(0.0); $T];
        for base in (0..full).step_by(BLOCK_COLS) {
            let mut acc = [[vdupq_n_f32(0.0); 4]; $T];
            for k in [0, 16, 32, 48] {
                let $c = base + k;
                let w = $load;
                for t in 0..$T {
                    fma16(&mut acc[t], w, $xs[t].as_ptr().add(base + k));
                }
            }
            for t in 0..$T {
                row[t] = vaddq_f32(row[t], sum4(acc[t]));
            }
        }
        let mut out = [0f32; $T];
        for t in 0..$T {
            let mut tail = 0f32;
            for $k in full..cols {
                tail += $scalar * $xs[t][$k];
            }
            out[t] = vaddvq_f32(row[t]) + tail;
        }
        out
    }};
}

#[target_feature(enable = "neon")]
unsafe fn f32_row<const T: usize>(w: &[f32], xs: &[&[f32]; T]) -> [f32; T] {
    let p = w.as_ptr();
    dense_row!(
        w.len(),
        xs,
        T,
        |c| [
            vld1q_f32(p.add(c)),
            vld1q_f32(p.add(c + 4)),
            vld1q_f32(p.add(c + 8)),
            vld1q_f32(p.add(c + 12)),
        ],
        |k| w[k]
    )
}

#[target_feature(enable = "neon")]
unsafe fn bf16_row<const T: usize>(w: &[u16], xs: &[&[f32]; T]) -> [f32; T] {
    let p = w.as_ptr();
    dense_row!(
        w.len(),
        xs,
        T,
        |c| [
            widen_bf16(p.add(c)),
            widen_bf16(p.add(c + 4)),
            widen_bf16(p.add(c + 8)),
            widen_bf16(p.add(c + 12)),
        ],
        |k| crate::quant::bf16::widen(w[k])
    )
}

/// The unscaled sums `Σ q · x` of one int8 row.
#[target_feature(enable = "neon")]
unsafe fn int8_row<const T: usize>(q: &[i8], xs: &[&[f32]; T]) -> [f32; T] {
    let p = q.as_ptr();
    dense_row!(q.len(), xs, T, |c| widen_i8(vld1q_s8(p.add(c))), |k| {
        f32::from(q[k])
    })
}

#[target_feature(enable = "neon")]
unsafe fn int4_row<const T: usize>(
    packed: &[u8],
    scale: &[f32],
    cols: usize,
    xs: &[&[f32]; T],
    xp: &[&[f32]; T],
) -> [f32; T] {
    let groups = cols / BLOCK_COLS;
    let mut row = [vdupq_n_f32(0.0); T];
    for (g, &s) in scale.iter().enumerate().take(groups) {
        let mut acc = [[vdupq_n_f32(0.0); 4]; T];
        for half in 0..2 {
            let v = vreinterpretq_s8_u8(vld1q_u8(packed.as_ptr().add(g * 32 + half * 16)));
            // Shifts on signed bytes sign-extend each nibble.
            let lo = widen_i8(vshrq_n_s8::<4>(vshlq_n_s8::<4>(v)));
            let hi = widen_i8(vshrq_n_s8::<4>(v));
            let base = g * BLOCK_COLS + half * SPLIT;
            for t in 0..T {
                fma16(&mut acc[t], lo, xp[t].as_ptr().add(base));
                fma16(&mut acc[t], hi, xp[t].as_ptr().add(base + 16));
            }
        }
        for t in 0..T {
            row[t] = vfmaq_f32(row[t], sum4(acc[t]), vdupq_n_f32(s));
        }
    }
    let mut out = [0f32; T];
    for t in 0..T {
        let mut tail = 0f32;
        for (c, &x) in xs[t].iter().enumerate().skip(groups * BLOCK_COLS) {
            tail += f32::from(int4_nibble(packed, c)) * x;
        }
        let tail_scale = scale.get(groups).copied().unwrap_or(0.0);
        out[t] = vaddvq_f32(row[t]) + tail * tail_scale;
    }
    out
}

#[target_feature(enable = "neon")]
unsafe fn mxfp4_row<const T: usize>(
    packed: &[u8],
    scales: &[u8],
    _xs: &[&[f32]; T],
    xp: &[&[f32]; T],
) -> [f32; T] {
    let table = vld1q_s8(E2M1_TWICE.as_ptr());
    let mask = vdupq_n_u8(0x0F);
    let mut row = [vdupq_n_f32(0.0); T];
    for (b, &s) in scales.iter().enumerate() {
        let v = vld1q_u8(packed.as_ptr().add(b * 16));
        let lo = widen_i8(vqtbl1q_s8(table, vandq_u8(v, mask)));
        let hi = widen_i8(vqtbl1q_s8(table, vshrq_n_u8::<4>(v)));
        let s = vdupq_n_f32(mxfp4_half_scale(s));
        for t in 0..T {
            let mut acc = [vdupq_n_f32(0.0); 4];
            fma16(&mut acc, lo, xp[t].as_ptr().add(b * SPLIT));
            fma16(&mut acc, hi, xp[t].as_ptr().add(b * SPLIT + 16));
            row[t] = vfmaq_f32(row[t], sum4(acc), s);
        }
    }
    let mut out = [0f32; T];
    for t in 0..T {
        out[t] = vaddvq_f32(row[t]);
    }
    out
}
