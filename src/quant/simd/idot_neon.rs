//! aarch64 integer-dot group sums of [`crate::quant::idot`]: `sdot` where the CPU has the
//! dot-product extension, widening multiplies (`smull` / `smlal`, `sadalp`) where not.
//! Doubled E2M1 weights are signed bytes (at most 12), activations at most 127: four
//! products per i16 lane stay below 6096.

use super::E2M1_TWICE;
use crate::quant::idot::{Token, CHUNK, GROUP};
use std::arch::aarch64::*;

/// Checks that every token matches a row of `groups` groups.
fn check<const T: usize>(groups: usize, toks: &[Token<'_>; T], out: &[&mut [i32]; T]) {
    for t in 0..T {
        assert!(
            toks[t].q.len() == groups * GROUP
                && toks[t].chunked.len() >= groups / 2 * CHUNK
                && out[t].len() >= groups,
            "idot: token {t} does not match a row of {groups} groups"
        );
    }
}

/// The sums of a lone last group, in plain Rust.
fn tail_group<const T: usize>(
    packed: &[u8],
    g: usize,
    toks: &[Token<'_>; T],
    out: &mut [&mut [i32]; T],
) {
    let bytes = &packed[g * GROUP / 2..(g + 1) * GROUP / 2];
    for t in 0..T {
        let q = &toks[t].q[g * GROUP..(g + 1) * GROUP];
        let mut sum = 0i32;
        for (pair, &byte) in q.chunks_exact(2).zip(bytes) {
            sum += i32::from(E2M1_TWICE[usize::from(byte & 0x0F)]) * i32::from(pair[0]);
            sum += i32::from(E2M1_TWICE[usize::from(byte >> 4)]) * i32::from(pair[1]);
        }
        out[t][g] = sum;
    }
}

/// The chunk loop: `$dot(lo, hi, xe, xo)` is one group's i32 sum from its even- and
/// odd-column weights and activations (sixteen bytes each).
macro_rules! group_sums_body {
    ($packed:expr, $toks:expr, $out:expr, $T:ident, |$lo:ident, $hi:ident, $xe:ident, $xo:ident| $dot:expr) => {{
        let packed: &[u8] = $packed;
        let groups = packed.len() * 2 / GROUP;
        check(groups, $toks, $out);
        let table = vld1q_s8(E2M1_TWICE.as_ptr());
        let mask = vdupq_n_u8(0x0F);
        for c in 0..groups / 2 {
            let src = packed.as_ptr().add(c * CHUNK / 2);
            let mut w = [[vdupq_n_s8(0); 2]; 2];
            for (g, wg) in w.iter_mut().enumerate() {
                let v = vld1q_u8(src.add(16 * g));
                wg[0] = vqtbl1q_s8(table, vandq_u8(v, mask));
                wg[1] = vqtbl1q_s8(table, vshrq_n_u8::<4>(v));
            }
            for t in 0..$T {
                let x = $toks[t].chunked.as_ptr().add(c * CHUNK);
                for (g, wg) in w.iter().enumerate() {
                    let ($lo, $hi) = (wg[0], wg[1]);
                    let $xe = vld1q_s8(x.add(16 * g));
                    let $xo = vld1q_s8(x.add(32 + 16 * g));
                    $out[t][2 * c + g] = $dot;
                }
            }
        }
        if groups % 2 == 1 {
            tail_group(packed, groups - 1, $toks, $out);
        }
    }};
}

/// NEON group sums with widening multiplies.
///
/// # Safety
/// The CPU must have NEON.
#[target_feature(enable = "neon")]
pub(crate) unsafe fn group_sums_neon<const T: usize>(
    packed: &[u8],
    toks: &[Token<'_>; T],
    out: &mut [&mut [i32]; T],
) {
    group_sums_body!(packed, toks, out, T, |lo, hi, xe, xo| {
        let p = vmull_s8(vget_low_s8(lo), vget_low_s8(xe));
        let p = vmlal_high_s8(p, lo, xe);
        let p = vmlal_s8(p, vget_low_s8(hi), vget_low_s8(xo));
        let p = vmlal_high_s8(p, hi, xo);
        vaddvq_s32(vpaddlq_s16(p))
    })
}

/// NEON group sums with `sdot`.
///
/// # Safety
/// The CPU must have NEON and the dot-product extension.
#[target_feature(enable = "neon,dotprod")]
pub(crate) unsafe fn group_sums_dot<const T: usize>(
    packed: &[u8],
    toks: &[Token<'_>; T],
    out: &mut [&mut [i32]; T],
) {
    let zero = vdupq_n_s32(0);
    group_sums_body!(packed, toks, out, T, |lo, hi, xe, xo| {
        vaddvq_s32(sdot(sdot(zero, lo, xe), hi, xo))
    })
}

/// `acc + Σ` of each four byte products, per i32 lane (the `sdot` instruction: its
/// intrinsic `vdotq_s32` is not stable Rust yet).
#[inline]
#[target_feature(enable = "neon,dotprod")]
unsafe fn sdot(acc: int32x4_t, a: int8x16_t, b: int8x16_t) -> int32x4_t {
    let mut acc = acc;
    // SAFETY: one register-only instruction of the dot-product extension, which this
    // function's target features require of the CPU.
    unsafe {
        std::arch::asm!(
            "sdot {acc:v}.4s, {a:v}.16b, {b:v}.16b",
            acc = inout(vreg) acc,
            a = in(vreg) a,
            b = in(vreg) b,
            options(pure, nomem, nostack, preserves_flags),
        );
    }
    acc
}
