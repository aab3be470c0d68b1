//! Integer-dot MXFP4 matmuls for the routed experts (`K3_IDOT=1`, opt-in; not exact).
//!
//! Each activation row is quantized to int8 in groups of [`GROUP`] columns (one f32 scale
//! a group, `max|x| / 127`), aligned with the weights' E8M0 blocks. E2M1 doubled is an exact
//! small integer, so a group's dot product is an exact i32 sum of byte products, computed
//! by the best integer-dot instructions the CPU has (AVX2 `maddubs`, AVX-512 VNNI
//! `vpdpbusd`, NEON `sdot`) or plain Rust. The f32 result folds the group sums with both
//! scales in one fixed order that every kernel shares, so all kernels give the same bits;
//! the only error against the exact path is the activations' rounding to int8.

use super::kernel;
use super::mxfp4::{self, Mxfp4View};
use super::round_half_away;
use super::simd::{self, E2M1_TWICE};
use rayon::prelude::*;

/// Columns sharing one activation scale: one MXFP4 block.
pub const GROUP: usize = mxfp4::BLOCK;

/// Columns of one [`QuantizedActs::chunked`] chunk: two groups.
pub(crate) const CHUNK: usize = 2 * GROUP;

/// Largest magnitude of a quantized activation.
const QMAX: f32 = 127.0;

/// The added bias that makes every doubled E2M1 weight non-negative, for the kernels whose
/// byte products take one unsigned operand (`maddubs`, `vpdpbusd`).
pub(crate) const WEIGHT_BIAS: i32 = 12;

/// Output rows per task of a one-token matmul (a many-token one takes
/// [`kernel::TILE_ROWS`]).
const BLOCK_ROWS: usize = 8;

/// Tokens one kernel call serves (the weights are decoded once for all of them).
pub(crate) const MAX_TOKENS: usize = 4;

/// The integer-dot instruction family, chosen once from the CPU's features.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum IdotKernel {
    /// Plain Rust: the reference every other kernel equals exactly.
    Portable,
    /// x86-64 AVX2: `vpmaddubsw` + `vpmaddwd`.
    Avx2,
    /// x86-64 AVX-512 VNNI (256-bit, with AVX-512VL): `vpdpbusd`.
    Avx512Vnni,
    /// aarch64 NEON without the dot-product extension: widening multiplies.
    Neon,
    /// aarch64 NEON with the dot-product extension: `sdot`.
    NeonDot,
}

impl IdotKernel {
    /// The name printed on the backend line.
    pub fn name(self) -> &'static str {
        match self {
            Self::Portable => "portable",
            Self::Avx2 => "avx2",
            Self::Avx512Vnni => "avx512-vnni",
            Self::Neon => "neon",
            Self::NeonDot => "neon-dotprod",
        }
    }

    /// Whether this CPU can run the kernel.
    pub fn is_supported(self) -> bool {
        match self {
            Self::Portable => true,
            #[cfg(target_arch = "x86_64")]
            Self::Avx2 => std::arch::is_x86_feature_detected!("avx2"),
            #[cfg(target_arch = "x86_64")]
            Self::Avx512Vnni => {
                std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("avx512f")
                    && std::arch::is_x86_feature_detected!("avx512vl")
                    && std::arch::is_x86_feature_detected!("avx512vnni")
            }
            #[cfg(target_arch = "aarch64")]
            Self::Neon => std::arch::is_aarch64_feature_detected!("neon"),
            #[cfg(target_arch = "aarch64")]
            Self::NeonDot => {
                std::arch::is_aarch64_feature_detected!("neon")
                    && std::arch::is_aarch64_feature_detected!("dotprod")
            }
            _ => false,
        }
    }

    /// Every kernel this CPU can run, portable first, the fastest last.
    pub fn available() -> Vec<IdotKernel> {
        [
            Self::Portable,
            Self::Avx2,
            Self::Avx512Vnni,
            Self::Neon,
            Self::NeonDot,
        ]
        .into_iter()
        .filter(|k| k.is_supported())
        .collect()
    }

    /// The kernel that goes with a SIMD level: the fastest of its family this CPU has
    /// (`K3_SIMD=portable` keeps the integer dots portable too).
    pub fn for_level(level: simd::SimdLevel) -> IdotKernel {
        let family: &[IdotKernel] = match level {
            simd::SimdLevel::Portable => &[],
            simd::SimdLevel::Avx2Fma | simd::SimdLevel::Avx512 => &[Self::Avx512Vnni, Self::Avx2],
            simd::SimdLevel::Neon => &[Self::NeonDot, Self::Neon],
        };
        family
            .iter()
            .copied()
            .find(|k| k.is_supported())
            .unwrap_or(Self::Portable)
    }
}

/// Activation rows quantized to int8 in groups of [`GROUP`] columns.
#[derive(Clone, Debug)]
pub struct QuantizedActs {
    /// Rows (tokens).
    pub rows: usize,
    /// Columns (a multiple of [`GROUP`]).
    pub cols: usize,
    /// `rows · cols` values in natural column order.
    pub q: Vec<i8>,
    /// `rows · cols / GROUP` scales: `x ≈ q · scale`.
    pub scale: Vec<f32>,
    /// The same values with every whole [`CHUNK`] of a row reordered for the SIMD kernels:
    /// the even columns of its first group, those of its second, then the odd columns of
    /// each (a packed byte's low nibble is an even column). A last lone group is left out.
    pub(crate) chunked: Vec<i8>,
    /// `WEIGHT_BIAS · Σ q` of every group: what the bias adds to a group's sum.
    pub(crate) bias: Vec<i32>,
}

impl QuantizedActs {
    /// Quantizes row-major `x: [rows, cols]`. A group's scale is `max|x| / 127` (0 for an
    /// all-zero group) and NaN when the group holds a NaN, so a non-finite activation stays
    /// non-finite in the result.
    ///
    /// Panics if `cols` is not a multiple of [`GROUP`] or `x` is not `rows · cols` long:
    /// callers pass MXFP4 shapes, which are checked when the view is made.
    pub fn new(x: &[f32], rows: usize, cols: usize) -> Self {
        assert!(
            cols % GROUP == 0,
            "idot: {cols} columns, not groups of {GROUP}"
        );
        assert_eq!(
            x.len(),
            rows * cols,
            "idot: x must be [rows={rows}, cols={cols}]"
        );
        let groups = rows * cols / GROUP;
        let mut q = vec![0i8; rows * cols];
        let mut scale = vec![0f32; groups];
        let mut bias = vec![0i32; groups];
        for (((src, dst), s), b) in x
            .chunks_exact(GROUP)
            .zip(q.chunks_exact_mut(GROUP))
            .zip(&mut scale)
            .zip(&mut bias)
        {
            let max = src.iter().fold(0f32, |m, v| m.max(v.abs()));
            *s = if src.iter().any(|v| v.is_nan()) {
                f32::NAN
            } else {
                max / QMAX
            };
            if *s != 0.0 && s.is_finite() {
                for (d, &v) in dst.iter_mut().zip(src) {
                    *d = round_half_away(v / *s).clamp(-QMAX, QMAX) as i8;
                }
            }
            *b = WEIGHT_BIAS * dst.iter().map(|&v| i32::from(v)).sum::<i32>();
        }
        let full = cols / CHUNK * CHUNK;
        let mut chunked = Vec::with_capacity(rows * full);
        for row in q.chunks_exact(cols.max(1)).take(rows) {
            for chunk in row[..full].chunks_exact(CHUNK) {
                for parity in 0..2 {
                    for g in 0..2 {
                        let grp = &chunk[g * GROUP..(g + 1) * GROUP];
                        chunked.extend(grp.iter().skip(parity).step_by(2));
                    }
                }
            }
        }
        Self {
            rows,
            cols,
            q,
            scale,
            chunked,
            bias,
        }
    }

    /// The groups of one row.
    fn groups(&self) -> usize {
        self.cols / GROUP
    }

    /// Row `t` as the kernels read it.
    fn token(&self, t: usize) -> Token<'_> {
        let (c, g) = (self.cols, self.groups());
        let full = c / CHUNK * CHUNK;
        Token {
            q: &self.q[t * c..(t + 1) * c],
            chunked: &self.chunked[t * full..(t + 1) * full],
            scale: &self.scale[t * g..(t + 1) * g],
            bias: &self.bias[t * g..(t + 1) * g],
        }
    }
}

/// One quantized activation row, borrowed.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Token<'a> {
    /// Natural order.
    pub(crate) q: &'a [i8],
    /// Chunk order (see [`QuantizedActs::chunked`]).
    pub(crate) chunked: &'a [i8],
    /// Group scales.
    pub(crate) scale: &'a [f32],
    /// Group biases (read by the x86 kernels, whose byte products need unsigned weights).
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub(crate) bias: &'a [i32],
}

/// Exact group sums `Σ_i e2m1x2(w[32g+i]) · q[32g+i]` of one packed MXFP4 row against each
/// token, into `out[t][g]`: the reference every kernel equals.
pub(crate) fn portable_group_sums<const T: usize>(
    packed: &[u8],
    toks: &[Token<'_>; T],
    out: &mut [&mut [i32]; T],
) {
    for (g, bytes) in packed.chunks_exact(GROUP / 2).enumerate() {
        for t in 0..T {
            let q = &toks[t].q[g * GROUP..(g + 1) * GROUP];
            let mut sum = 0i32;
            for (pair, &b) in q.chunks_exact(2).zip(bytes) {
                sum += i32::from(E2M1_TWICE[usize::from(b & 0x0F)]) * i32::from(pair[0]);
                sum += i32::from(E2M1_TWICE[usize::from(b >> 4)]) * i32::from(pair[1]);
            }
            out[t][g] = sum;
        }
    }
}

/// Group sums on `kernel` (see [`portable_group_sums`]).
fn group_sums<const T: usize>(
    kernel: IdotKernel,
    packed: &[u8],
    toks: &[Token<'_>; T],
    out: &mut [&mut [i32]; T],
) {
    match kernel {
        #[cfg(target_arch = "x86_64")]
        IdotKernel::Avx2 => {
            // SAFETY: `matmul` checked `kernel.is_supported()` (AVX2) before any call.
            unsafe { simd::idot_x86::group_sums_avx2(packed, toks, out) }
        }
        #[cfg(target_arch = "x86_64")]
        IdotKernel::Avx512Vnni => {
            // SAFETY: `matmul` checked `kernel.is_supported()` (AVX2, AVX-512F/VL/VNNI).
            unsafe { simd::idot_x86::group_sums_vnni(packed, toks, out) }
        }
        #[cfg(target_arch = "aarch64")]
        IdotKernel::Neon => {
            // SAFETY: `matmul` checked `kernel.is_supported()` (NEON).
            unsafe { simd::idot_neon::group_sums_neon(packed, toks, out) }
        }
        #[cfg(target_arch = "aarch64")]
        IdotKernel::NeonDot => {
            // SAFETY: `matmul` checked `kernel.is_supported()` (NEON and dotprod).
            unsafe { simd::idot_neon::group_sums_dot(packed, toks, out) }
        }
        _ => portable_group_sums(packed, toks, out),
    }
}

/// `Σ_g (sum_g · wscale_g) · xscale_g`, in eight lanes folded pairwise: one order for
/// every kernel. `sum_g · wscale_g` is exact (a power of two times an integer below 2^16).
fn fold(sums: &[i32], wscales: &[u8], xscales: &[f32]) -> f32 {
    const LANES: usize = 8;
    let mut acc = [0f32; LANES];
    let n = sums.len() / LANES * LANES;
    for ((s, w), x) in sums[..n]
        .chunks_exact(LANES)
        .zip(wscales[..n].chunks_exact(LANES))
        .zip(xscales[..n].chunks_exact(LANES))
    {
        for i in 0..LANES {
            acc[i] += (s[i] as f32 * simd::mxfp4_half_scale(w[i])) * x[i];
        }
    }
    let mut tail = 0f32;
    for g in n..sums.len() {
        tail += (sums[g] as f32 * simd::mxfp4_half_scale(wscales[g])) * xscales[g];
    }
    kernel::fold_lanes(acc) + tail
}

/// `y[t, r] = Σ_c w[r, c] · x[t, c]` with x quantized (`y: [x.rows, w.rows]`), on `kernel`.
///
/// Panics if the shapes do not match or this CPU cannot run `kernel`: caller bugs.
pub fn matmul(kernel: IdotKernel, w: &Mxfp4View<'_>, x: &QuantizedActs, y: &mut [f32]) {
    let (rows, cols, n) = (w.rows, w.cols, x.rows);
    assert_eq!(x.cols, cols, "idot: x has {} columns for {cols}", x.cols);
    assert_eq!(y.len(), n * rows, "idot: y must be [n={n}, rows={rows}]");
    assert!(
        kernel.is_supported(),
        "idot: this CPU cannot run {} kernels",
        kernel.name()
    );
    if n == 0 || rows == 0 {
        return;
    }
    let groups = cols / GROUP;
    let (rb, toks) = (cols / 2, (0..n).map(|t| x.token(t)).collect::<Vec<_>>());
    // Row-major [rows, n] so that each task owns a contiguous slice; transposed at the end
    // (for one token the two layouts are the same).
    let mut yt = vec![0f32; rows * n];
    let block = if n == 1 {
        BLOCK_ROWS
    } else {
        kernel::TILE_ROWS
    };
    yt.par_chunks_mut(block * n)
        .with_min_len(super::pool::min_len(rows.div_ceil(block), rows * cols * n))
        .enumerate()
        .for_each_init(
            || vec![0i32; MAX_TOKENS * groups],
            |sums, (b, out)| {
                kernel::for_each_tile(out.len() / n, n, 1, MAX_TOKENS, |i, _, t0, take| {
                    let r = b * block + i;
                    let packed = &w.packed[r * rb..(r + 1) * rb];
                    let wscales = &w.scales[r * groups..(r + 1) * groups];
                    let tk = &toks[t0..t0 + take];
                    let s = &mut sums[..take * groups];
                    match take {
                        1 => tokens::<1>(kernel, packed, tk, s, groups),
                        2 => tokens::<2>(kernel, packed, tk, s, groups),
                        3 => tokens::<3>(kernel, packed, tk, s, groups),
                        _ => tokens::<4>(kernel, packed, tk, s, groups),
                    }
                    for (j, d) in out[i * n + t0..i * n + t0 + take].iter_mut().enumerate() {
                        let gs = &s[j * groups..(j + 1) * groups];
                        *d = fold(gs, wscales, tk[j].scale);
                    }
                });
            },
        );
    if n == 1 {
        y.copy_from_slice(&yt);
        return;
    }
    y.par_chunks_mut(rows)
        .with_min_len(super::pool::min_len(n, rows * n))
        .enumerate()
        .for_each(|(t, yrow)| {
            for (r, v) in yrow.iter_mut().enumerate() {
                *v = yt[r * n + t];
            }
        });
}

/// [`group_sums`] of the first `T` tokens of `tk` into consecutive `groups`-long slices.
fn tokens<const T: usize>(
    kernel: IdotKernel,
    packed: &[u8],
    tk: &[Token<'_>],
    sums: &mut [i32],
    groups: usize,
) {
    let toks: [Token<'_>; T] = std::array::from_fn(|t| tk[t]);
    let mut parts = sums.chunks_exact_mut(groups);
    let mut out: [&mut [i32]; T] = std::array::from_fn(|_| parts.next().unwrap_or_default());
    group_sums(kernel, packed, &toks, &mut out);
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    fn random_view_bytes(rng: &mut StdRng, rows: usize, cols: usize) -> (Vec<u8>, Vec<u8>) {
        let packed = (0..rows * cols / 2).map(|_| rng.random::<u8>()).collect();
        let scales = (0..rows * cols / GROUP)
            .map(|_| rng.random_range(115..=130))
            .collect();
        (packed, scales)
    }

    /// Straight from the definition: decode, multiply, sum in f64; with each output's sum
    /// of magnitudes (what f32 rounding error scales with).
    fn naive(w: &Mxfp4View<'_>, x: &QuantizedActs) -> Vec<(f64, f64)> {
        let mut y = vec![(0f64, 0f64); x.rows * w.rows];
        for t in 0..x.rows {
            for r in 0..w.rows {
                let (mut acc, mut mag) = (0f64, 0f64);
                for c in 0..w.cols {
                    let b = w.packed[r * w.cols / 2 + c / 2];
                    let wv = mxfp4::e2m1(if c % 2 == 0 { b & 15 } else { b >> 4 });
                    let ws = mxfp4::e8m0(w.scales[r * w.cols / GROUP + c / GROUP]);
                    let xv =
                        f32::from(x.q[t * w.cols + c]) * x.scale[t * w.cols / GROUP + c / GROUP];
                    let term = f64::from(wv) * f64::from(ws) * f64::from(xv);
                    acc += term;
                    mag += term.abs();
                }
                y[t * w.rows + r] = (acc, mag);
            }
        }
        y
    }

    #[test]
    fn quantization_rounds_each_group_to_its_scale() {
        let mut x: Vec<f32> = (0..96).map(|i| (i as f32 - 40.0) * 0.37).collect();
        x[64..96].fill(0.0);
        let q = QuantizedActs::new(&x, 1, 96);
        assert_eq!(q.scale[2], 0.0);
        assert!(q.q[64..].iter().all(|&v| v == 0));
        for g in 0..2 {
            let max = x[g * 32..(g + 1) * 32]
                .iter()
                .fold(0f32, |m, v| m.max(v.abs()));
            assert_eq!(q.scale[g], max / 127.0);
            for (c, (&qc, &xc)) in q.q.iter().zip(&x).enumerate().skip(g * 32).take(32) {
                let err = (f32::from(qc) * q.scale[g] - xc).abs();
                assert!(err <= 0.5 * q.scale[g] * 1.0001, "column {c}: error {err}");
            }
            assert!(q.q[g * 32..(g + 1) * 32].iter().any(|v| v.abs() == 127));
        }
        // Chunk order: evens of group 0, evens of group 1, odds of group 0, odds of group 1.
        assert_eq!(q.chunked.len(), 64);
        assert_eq!(q.chunked[1], q.q[2]);
        assert_eq!(q.chunked[16], q.q[32]);
        assert_eq!(q.chunked[32], q.q[1]);
        assert_eq!(q.chunked[63], q.q[63]);
        let sum0: i32 = q.q[..32].iter().map(|&v| i32::from(v)).sum();
        assert_eq!(q.bias[0], WEIGHT_BIAS * sum0);
    }

    #[test]
    fn a_nan_activation_stays_non_finite() {
        let mut x = vec![0.5f32; 64];
        x[40] = f32::NAN;
        let q = QuantizedActs::new(&x, 1, 64);
        assert!(q.scale[1].is_nan() && q.scale[0] == 0.5 / 127.0);
        let (packed, scales) = (vec![0x11u8; 32], vec![127u8; 2]);
        let w = Mxfp4View::new(1, 64, &packed, &scales).unwrap();
        let mut y = [0f32];
        matmul(IdotKernel::Portable, &w, &q, &mut y);
        assert!(y[0].is_nan());
    }

    #[test]
    fn every_kernel_equals_the_portable_integer_reference_exactly() {
        let mut rng = StdRng::seed_from_u64(22);
        // Awkward shapes: one group, a lone last group, group counts off the 8-group block;
        // the last one spans three row tasks and three token tiles, each cut short.
        for &(rows, cols, n) in &[
            (3, 32, 1),
            (5, 96, 2),
            (9, 288, 3),
            (17, 544, 5),
            (8, 2048, 4),
            (33, 7168, 7),
            (70, 2048, 37),
        ] {
            let (packed, scales) = random_view_bytes(&mut rng, rows, cols);
            let w = Mxfp4View::new(rows, cols, &packed, &scales).unwrap();
            let x: Vec<f32> = (0..n * cols)
                .map(|_| rng.random_range(-3.0f32..3.0))
                .collect();
            let q = QuantizedActs::new(&x, n, cols);
            let mut want = vec![0f32; n * rows];
            matmul(IdotKernel::Portable, &w, &q, &mut want);
            let exact = naive(&w, &q);
            for (i, (&a, &(b, mag))) in want.iter().zip(&exact).enumerate() {
                let tol = 1e-6 * mag;
                assert!(
                    (f64::from(a) - b).abs() <= tol,
                    "{rows}x{cols} n={n} [{i}]: {a} vs {b}"
                );
            }
            for kernel in IdotKernel::available() {
                let mut got = vec![0f32; n * rows];
                matmul(kernel, &w, &q, &mut got);
                let same = got
                    .iter()
                    .zip(&want)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "{} on {rows}x{cols} n={n} differs", kernel.name());
            }
        }
    }

    #[test]
    fn idot_is_within_int8_rounding_of_the_exact_matmul() {
        let mut rng = StdRng::seed_from_u64(7);
        let (rows, cols, n) = (64, 2048, 3);
        let (packed, scales) = random_view_bytes(&mut rng, rows, cols);
        let w = Mxfp4View::new(rows, cols, &packed, &scales).unwrap();
        let x: Vec<f32> = (0..n * cols)
            .map(|_| rng.random_range(-1.0f32..1.0))
            .collect();
        let mut exact = vec![0f32; n * rows];
        w.matmul_with(simd::SimdLevel::Portable, &x, n, &mut exact);
        let mut got = vec![0f32; n * rows];
        matmul(
            IdotKernel::Portable,
            &w,
            &QuantizedActs::new(&x, n, cols),
            &mut got,
        );
        let (mut num, mut den) = (0f64, 0f64);
        for (&a, &b) in got.iter().zip(&exact) {
            num += (f64::from(a) - f64::from(b)).powi(2);
            den += f64::from(b).powi(2);
        }
        // Uniform x rounded to 1/127 of its group's largest value: an RMS error of
        // 1/(127·√12) of that value, 0.4 % of the values' RMS.
        let rel = (num / den).sqrt();
        assert!(rel > 1e-4 && rel < 0.008, "relative L2 {rel}");
    }

    #[test]
    fn group_sums_match_on_extreme_values() {
        // Largest weights and activations: the integer paths must not saturate.
        let cols = 256;
        let packed = vec![0x77u8; cols / 2]; // every weight +6 (doubled: 12)
        let neg = vec![0xFFu8; cols / 2]; // every weight -6
        let q = QuantizedActs::new(&vec![-1.0f32; cols], 1, cols);
        assert!(q.q.iter().all(|&v| v == -127));
        for bytes in [&packed, &neg] {
            let mut want = vec![0i32; cols / GROUP];
            portable_group_sums(bytes, &[q.token(0)], &mut [&mut want[..]]);
            let expect = if bytes[0] == 0x77 {
                -12 * 127 * 32
            } else {
                12 * 127 * 32
            };
            assert!(want.iter().all(|&s| s == expect), "{want:?}");
            for kernel in IdotKernel::available() {
                let mut got = vec![0i32; cols / GROUP];
                group_sums(kernel, bytes, &[q.token(0)], &mut [&mut got[..]]);
                assert_eq!(got, want, "{}", kernel.name());
            }
        }
    }

    #[test]
    fn level_families() {
        assert_eq!(
            IdotKernel::for_level(simd::SimdLevel::Portable),
            IdotKernel::Portable
        );
        for level in simd::SimdLevel::available() {
            assert!(IdotKernel::for_level(level).is_supported());
        }
        let available = IdotKernel::available();
        eprintln!("idot kernels here: {available:?}");
        assert_eq!(available[0], IdotKernel::Portable);
        // NEON is part of every aarch64 CPU: its kernel must be among those tested.
        #[cfg(target_arch = "aarch64")]
        assert!(available.contains(&IdotKernel::Neon));
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") {
            assert!(available.contains(&IdotKernel::Avx2));
        }
    }
}
