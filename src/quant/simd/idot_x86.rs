//! x86-64 integer-dot group sums of [`crate::quant::idot`]: AVX2 `maddubs` / `madd` and
//! AVX-512 VNNI `vpdpbusd`. Weights decode to doubled E2M1 plus
//! [`WEIGHT_BIAS`] (unsigned bytes 0..=24, as both instructions want one unsigned operand);
//! the bias's contribution, precomputed per activation group, is subtracted at the end.

use super::E2M1_TWICE;
use crate::quant::idot::{Token, CHUNK, GROUP, WEIGHT_BIAS};
use std::arch::x86_64::*;

/// Doubled E2M1 plus the bias, for every nibble.
const BIASED: [u8; 16] = {
    let mut t = [0u8; 16];
    let mut i = 0;
    while i < 16 {
        t[i] = (E2M1_TWICE[i] as i32 + WEIGHT_BIAS) as u8;
        i += 1;
    }
    t
};

/// Groups one block of the main loop covers: four chunks, whose eight i32 sums fill one
/// vector after three horizontal adds.
const BLOCK_GROUPS: usize = 8;

/// Bytes ahead of the weight stream to prefetch (as in the float kernels: one core's
/// bandwidth is bound by the misses it has in flight).
const PREFETCH_AHEAD: usize = 2048;

/// The group sums of every full block; `$dot(lo, hi, xe, xo)` gives the eight i32 partial
/// sums of one chunk (lanes 0-3 its first group, 4-7 its second) from its biased even- and
/// odd-column weights and activations. Lone tail groups are summed in plain Rust.
macro_rules! group_sums_body {
    ($packed:expr, $toks:expr, $out:expr, $T:ident, |$lo:ident, $hi:ident, $xe:ident, $xo:ident| $dot:expr) => {{
        let packed: &[u8] = $packed;
        let groups = packed.len() * 2 / GROUP;
        let blocks = groups / BLOCK_GROUPS;
        for t in 0..$T {
            assert!(
                $toks[t].q.len() == groups * GROUP
                    && $toks[t].chunked.len() >= blocks * BLOCK_GROUPS * GROUP
                    && $toks[t].bias.len() == groups
                    && $out[t].len() >= groups,
                "idot: token {t} does not match a row of {groups} groups"
            );
        }
        let table = _mm256_broadcastsi128_si256(_mm_loadu_si128(BIASED.as_ptr().cast()));
        let mask = _mm256_set1_epi8(0x0F);
        let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
        let block_bytes = BLOCK_GROUPS * GROUP / 2;
        for b in 0..blocks {
            let src = packed.as_ptr().add(b * block_bytes);
            _mm_prefetch::<_MM_HINT_T0>(src.cast::<i8>().wrapping_add(PREFETCH_AHEAD));
            _mm_prefetch::<_MM_HINT_T0>(src.cast::<i8>().wrapping_add(PREFETCH_AHEAD + 64));
            let mut w = [[_mm256_setzero_si256(); 2]; 4];
            for (k, wk) in w.iter_mut().enumerate() {
                let v = _mm256_loadu_si256(src.add(32 * k).cast());
                wk[0] = _mm256_shuffle_epi8(table, _mm256_and_si256(v, mask));
                wk[1] =
                    _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16::<4>(v), mask));
            }
            for t in 0..$T {
                let x = $toks[t].chunked.as_ptr().add(b * 4 * CHUNK);
                let mut a = [_mm256_setzero_si256(); 4];
                for (k, ak) in a.iter_mut().enumerate() {
                    let ($lo, $hi) = (w[k][0], w[k][1]);
                    let $xe = _mm256_loadu_si256(x.add(k * CHUNK).cast());
                    let $xo = _mm256_loadu_si256(x.add(k * CHUNK + 32).cast());
                    *ak = $dot;
                }
                // [g0 g2 g4 g6 g1 g3 g5 g7] after three horizontal adds, then in order.
                let h01 = _mm256_hadd_epi32(a[0], a[1]);
                let h23 = _mm256_hadd_epi32(a[2], a[3]);
                let s = _mm256_permutevar8x32_epi32(_mm256_hadd_epi32(h01, h23), order);
                let g0 = b * BLOCK_GROUPS;
                let bias = _mm256_loadu_si256($toks[t].bias.as_ptr().add(g0).cast());
                _mm256_storeu_si256(
                    $out[t].as_mut_ptr().add(g0).cast(),
                    _mm256_sub_epi32(s, bias),
                );
            }
        }
        for g in blocks * BLOCK_GROUPS..groups {
            let bytes = &packed[g * GROUP / 2..(g + 1) * GROUP / 2];
            for t in 0..$T {
                let q = &$toks[t].q[g * GROUP..(g + 1) * GROUP];
                let mut sum = 0i32;
                for (pair, &byte) in q.chunks_exact(2).zip(bytes) {
                    sum += i32::from(E2M1_TWICE[usize::from(byte & 0x0F)]) * i32::from(pair[0]);
                    sum += i32::from(E2M1_TWICE[usize::from(byte >> 4)]) * i32::from(pair[1]);
                }
                $out[t][g] = sum;
            }
        }
    }};
}

/// AVX2 group sums (see [`crate::quant::idot`]): `maddubs` pairs (at most 2·24·127, no
/// saturation), two of them added (at most 12192), then `madd` into i32.
///
/// # Safety
/// The CPU must have AVX2.
#[target_feature(enable = "avx2")]
pub(crate) unsafe fn group_sums_avx2<const T: usize>(
    packed: &[u8],
    toks: &[Token<'_>; T],
    out: &mut [&mut [i32]; T],
) {
    let ones = _mm256_set1_epi16(1);
    group_sums_body!(packed, toks, out, T, |lo, hi, xe, xo| {
        let p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xe), _mm256_maddubs_epi16(hi, xo));
        _mm256_madd_epi16(p, ones)
    })
}

/// AVX-512 VNNI group sums on 256-bit vectors: two `vpdpbusd` a chunk.
///
/// # Safety
/// The CPU must have AVX2, AVX-512F, AVX-512VL and AVX-512 VNNI.
#[target_feature(enable = "avx2,avx512f,avx512vl,avx512vnni")]
pub(crate) unsafe fn group_sums_vnni<const T: usize>(
    packed: &[u8],
    toks: &[Token<'_>; T],
    out: &mut [&mut [i32]; T],
) {
    let zero = _mm256_setzero_si256();
    group_sums_body!(packed, toks, out, T, |lo, hi, xe, xo| {
        _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(zero, lo, xe), hi, xo)
    })
}
