//! The f32 vector kernels of the KDA state update and the MLA attention, on every
//! [`SimdLevel`].
//!
//! Each kernel has a portable form (the reference) and one per SIMD level that performs
//! the same f32 operations in the same order, several lanes at a time: separate multiply
//! and add (no fused multiply-add), the row sums of [`dot_rows`] in the sixteen lanes and
//! pairwise fold of the portable dot product. So every level gives the portable bits
//! (tested on awkward shapes), and the model's CPU output does not depend on the CPU.

use super::SimdLevel;

/// `out[i] = Σ_j m[i·n + j] · x[j]` with `n = x.len()` and `m: [out.len(), n]`.
///
/// Panics if `m` is not `[out.len(), x.len()]` or if this CPU cannot run `level` (caller
/// bugs, never data).
pub fn dot_rows(level: SimdLevel, m: &[f32], x: &[f32], out: &mut [f32]) {
    assert_eq!(
        Some(m.len()),
        out.len().checked_mul(x.len()),
        "dot_rows: m must be [rows={}, n={}]",
        out.len(),
        x.len()
    );
    check(level);
    match level {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the level's CPU features confirmed by `check`, the shapes the kernel
        // stays within by the assert above.
        SimdLevel::Avx2Fma => unsafe { avx2::dot_rows(m, x, out) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the level's CPU features confirmed by `check`, the shapes the kernel
        // stays within by the assert above.
        SimdLevel::Avx512 => unsafe { avx512::dot_rows(m, x, out) },
        #[cfg(target_arch = "aarch64")]
        // SAFETY: the level's CPU features confirmed by `check`, the shapes the kernel
        // stays within by the assert above.
        SimdLevel::Neon => unsafe { neon::dot_rows(m, x, out) },
        _ => portable::dot_rows(m, x, out),
    }
}

/// `out[j] += Σ_i coef[i] · m[i·n + j]` with `n = out.len()` and `m: [coef.len(), n]`,
/// the rows added in order.
///
/// Panics if `m` is not `[coef.len(), out.len()]` or if this CPU cannot run `level`.
pub fn axpy_rows(level: SimdLevel, m: &[f32], coef: &[f32], out: &mut [f32]) {
    assert_eq!(
        Some(m.len()),
        coef.len().checked_mul(out.len()),
        "axpy_rows: m must be [rows={}, n={}]",
        coef.len(),
        out.len()
    );
    check(level);
    match level {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the level's CPU features confirmed by `check`, the shapes the kernel
        // stays within by the assert above.
        SimdLevel::Avx2Fma => unsafe { avx2::axpy_rows(m, coef, out) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the level's CPU features confirmed by `check`, the shapes the kernel
        // stays within by the assert above.
        SimdLevel::Avx512 => unsafe { avx512::axpy_rows(m, coef, out) },
        #[cfg(target_arch = "aarch64")]
        // SAFETY: the level's CPU features confirmed by `check`, the shapes the kernel
        // stays within by the assert above.
        SimdLevel::Neon => unsafe { neon::axpy_rows(m, coef, out) },
        _ => portable::axpy_rows(m, coef, out),
    }
}

/// The decay and read of the delta rule, one pass over `s: [rows, n]`: row `i` is
/// multiplied by `alpha[i]`, then `u += k[i] · row` (`n = u.len()`, rows in order).
///
/// Panics on mismatched lengths or if this CPU cannot run `level`.
pub fn decay_project(level: SimdLevel, s: &mut [f32], alpha: &[f32], k: &[f32], u: &mut [f32]) {
    assert!(
        alpha.len() == k.len() && Some(s.len()) == k.len().checked_mul(u.len()),
        "decay_project: s must be [rows={}, n={}] with one alpha and one k per row",
        k.len(),
        u.len()
    );
    check(level);
    match level {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the level's CPU features confirmed by `check`, the shapes the kernel
        // stays within by the assert above.
        SimdLevel::Avx2Fma => unsafe { avx2::decay_project(s, alpha, k, u) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the level's CPU features confirmed by `check`, the shapes the kernel
        // stays within by the assert above.
        SimdLevel::Avx512 => unsafe { avx512::decay_project(s, alpha, k, u) },
        #[cfg(target_arch = "aarch64")]
        // SAFETY: the level's CPU features confirmed by `check`, the shapes the kernel
        // stays within by the assert above.
        SimdLevel::Neon => unsafe { neon::decay_project(s, alpha, k, u) },
        _ => portable::decay_project(s, alpha, k, u),
    }
}

/// The rank-one update and read-out of the delta rule, one pass over `s: [rows, n]`:
/// `row_i += k[i] · delta`, then `o += q[i] · row_i` (`n = delta.len() = o.len()`).
///
/// Panics on mismatched lengths or if this CPU cannot run `level`.
pub fn update_project(
    level: SimdLevel,
    s: &mut [f32],
    k: &[f32],
    delta: &[f32],
    q: &[f32],
    o: &mut [f32],
) {
    assert!(
        q.len() == k.len()
            && delta.len() == o.len()
            && Some(s.len()) == k.len().checked_mul(o.len()),
        "update_project: s must be [rows={}, n={}] with one k and one q per row",
        k.len(),
        o.len()
    );
    check(level);
    match level {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the level's CPU features confirmed by `check`, the shapes the kernel
        // stays within by the assert above.
        SimdLevel::Avx2Fma => unsafe { avx2::update_project(s, k, delta, q, o) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the level's CPU features confirmed by `check`, the shapes the kernel
        // stays within by the assert above.
        SimdLevel::Avx512 => unsafe { avx512::update_project(s, k, delta, q, o) },
        #[cfg(target_arch = "aarch64")]
        // SAFETY: the level's CPU features confirmed by `check`, the shapes the kernel
        // stays within by the assert above.
        SimdLevel::Neon => unsafe { neon::update_project(s, k, delta, q, o) },
        _ => portable::update_project(s, k, delta, q, o),
    }
}

/// One KDA head's delta-rule step on its state `s: [dk, dk]` (row `i` = key channel `i`):
/// each row decays by `alpha[i]`, `u = Sᵀk` is read, `S += k ⊗ β(v − u)` is written and
/// `o = Sᵀq` (the new state) is returned in `o`. `k` and `q` are already normalized.
///
/// Panics on lengths other than `dk` for `alpha`, `k`, `q`, `v`, `o`.
#[allow(clippy::too_many_arguments)]
pub fn kda_delta_step(
    level: SimdLevel,
    s: &mut [f32],
    alpha: &[f32],
    k: &[f32],
    q: &[f32],
    v: &[f32],
    beta: f32,
    o: &mut [f32],
) {
    let mut u = vec![0.0f32; v.len()];
    decay_project(level, s, alpha, k, &mut u);
    let delta: Vec<f32> = v
        .iter()
        .zip(&u)
        .map(|(&vj, &uj)| beta * (vj - uj))
        .collect();
    o.fill(0.0);
    update_project(level, s, k, &delta, q, o);
}

/// One head of the absorbed MLA attention over the cached positions.
#[derive(Clone, Copy, Debug)]
pub struct MlaHead<'a> {
    /// The head's no-rope query part, `[nope]`.
    pub q_nope: &'a [f32],
    /// The head's rope query part, `[rope]`.
    pub q_rope: &'a [f32],
    /// The head's K block of `kv_b_proj`, `[nope, kv_lora]`.
    pub wk: &'a [f32],
    /// The head's V block of `kv_b_proj`, `[v, kv_lora]`.
    pub wv: &'a [f32],
    /// The cached normalized latents, `[positions, kv_lora]`.
    pub latent: &'a [f32],
    /// The cached rope parts, `[positions, rope]`.
    pub rope: &'a [f32],
    /// Cached positions.
    pub positions: usize,
    /// Width of a cached latent (`kv_lora_rank`).
    pub kv_lora: usize,
    /// The softmax scale, `1/√(nope + rope)`.
    pub scale: f32,
}

/// `out = wv · Σ_p softmax_p(scale · (q_abs · latent_p + q_rope · rope_p)) · latent_p`
/// with `q_abs = wkᵀ q_nope`: the head's attention output, `[v]` (softmax in f64).
///
/// Panics if the slices do not match the shapes [`MlaHead`] names.
pub fn mla_head(level: SimdLevel, h: &MlaHead<'_>, out: &mut [f32]) {
    let (len, kv) = (h.positions, h.kv_lora);
    let mut q_abs = vec![0.0f32; kv];
    axpy_rows(level, h.wk, h.q_nope, &mut q_abs);
    let mut by_latent = vec![0.0f32; len];
    dot_rows(level, h.latent, &q_abs, &mut by_latent);
    let mut by_rope = vec![0.0f32; len];
    dot_rows(level, h.rope, h.q_rope, &mut by_rope);
    let scores: Vec<f64> = by_latent
        .iter()
        .zip(&by_rope)
        .map(|(&a, &b)| f64::from((a + b) * h.scale))
        .collect();
    let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let exps: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
    let total: f64 = exps.iter().sum();
    let probs: Vec<f32> = exps.iter().map(|e| (e / total) as f32).collect();
    let mut ctx = vec![0.0f32; kv];
    axpy_rows(level, h.latent, &probs, &mut ctx);
    dot_rows(level, h.wv, &ctx, out);
}

/// Panics unless this CPU can run `level` (what makes the SIMD arms sound).
#[inline]
fn check(level: SimdLevel) {
    assert!(
        level.is_supported(),
        "vector kernels: this CPU cannot run {} kernels",
        level.name()
    );
}

/// The reference loops.
mod portable {
    pub(super) fn dot_rows(m: &[f32], x: &[f32], out: &mut [f32]) {
        let n = x.len();
        for (i, o) in out.iter_mut().enumerate() {
            *o = crate::quant::kernel::dot(&m[i * n..(i + 1) * n], x);
        }
    }

    pub(super) fn axpy_rows(m: &[f32], coef: &[f32], out: &mut [f32]) {
        let n = out.len();
        if n == 0 {
            return;
        }
        for (row, &c) in m.chunks_exact(n).zip(coef) {
            for (o, &w) in out.iter_mut().zip(row) {
                *o += c * w;
            }
        }
    }

    pub(super) fn decay_project(s: &mut [f32], alpha: &[f32], k: &[f32], u: &mut [f32]) {
        let n = u.len();
        if n == 0 {
            return;
        }
        for ((row, &a), &ki) in s.chunks_exact_mut(n).zip(alpha).zip(k) {
            row.iter_mut().for_each(|x| *x *= a);
            for (uj, &sj) in u.iter_mut().zip(row.iter()) {
                *uj += sj * ki;
            }
        }
    }

    pub(super) fn update_project(
        s: &mut [f32],
        k: &[f32],
        delta: &[f32],
        q: &[f32],
        o: &mut [f32],
    ) {
        let n = o.len();
        if n == 0 {
            return;
        }
        for ((row, &ki), &qi) in s.chunks_exact_mut(n).zip(k).zip(q) {
            for (sj, &dj) in row.iter_mut().zip(delta) {
                *sj += ki * dj;
            }
            for (oj, &sj) in o.iter_mut().zip(row.iter()) {
                *oj += sj * qi;
            }
        }
    }
}

/// The lanes of the portable dot product's accumulator (`kernel::dot`).
const DOT_LANES: usize = 16;

/// The SIMD forms, written once over a vector type `V` of `W` lanes and the level's
/// `load`, `store`, `mul`, `add`, `splat`, `zero` and `fold16` (the pairwise fold of
/// sixteen lanes held in `16 / W` vectors, in the portable dot product's order), with
/// `ROWS` the rows [`dot_rows`] sums together (sixteen lanes each; together they keep
/// enough independent add chains in flight).
macro_rules! vector_kernels {
    ($feat:literal) => {
        /// Vectors holding one row's sixteen dot-product lanes.
        const LV: usize = super::DOT_LANES / W;

        /// `ROWS` rows at a time, then one.
        #[target_feature(enable = $feat)]
        pub(super) unsafe fn dot_rows(m: &[f32], x: &[f32], out: &mut [f32]) {
            let n = x.len();
            let mut i = 0;
            while i + ROWS <= out.len() {
                let sums = dot_group::<ROWS>(m, x, i);
                out[i..i + ROWS].copy_from_slice(&sums);
                i += ROWS;
            }
            while i < out.len() {
                out[i] = dot_group::<1>(m, x, i)[0];
                i += 1;
            }
            debug_assert_eq!(m.len(), out.len() * n);
        }

        /// The dot products of rows `first..first + R` of `m` (in bounds) with `x`.
        #[inline]
        #[target_feature(enable = $feat)]
        unsafe fn dot_group<const R: usize>(m: &[f32], x: &[f32], first: usize) -> [f32; R] {
            let n = x.len();
            let full = n / super::DOT_LANES * super::DOT_LANES;
            let (xp, mp) = (x.as_ptr(), m.as_ptr().add(first * n));
            let mut acc = [[zero(); LV]; R];
            let mut j = 0;
            while j < full {
                for v in 0..LV {
                    let xv = load(xp.add(j + v * W));
                    for (r, acc) in acc.iter_mut().enumerate() {
                        let w = load(mp.add(r * n + j + v * W));
                        acc[v] = add(acc[v], mul(w, xv));
                    }
                }
                j += super::DOT_LANES;
            }
            let mut out = [0f32; R];
            for (r, o) in out.iter_mut().enumerate() {
                let row = &m[(first + r) * n..(first + r + 1) * n];
                let mut tail = 0f32;
                for (a, b) in row[full..].iter().zip(&x[full..]) {
                    tail += a * b;
                }
                *o = fold16(acc[r]) + tail;
            }
            out
        }

        /// Rows four at a time, each group streamed once across the whole width (the
        /// matrix is read once, `out` stays in L1); a column still adds its rows in order.
        #[target_feature(enable = $feat)]
        pub(super) unsafe fn axpy_rows(m: &[f32], coef: &[f32], out: &mut [f32]) {
            let n = out.len();
            let mut i = 0;
            while i + 4 <= coef.len() {
                axpy_group::<4>(m, coef, out, i);
                i += 4;
            }
            while i < coef.len() {
                axpy_group::<1>(m, coef, out, i);
                i += 1;
            }
            debug_assert_eq!(m.len(), coef.len() * n);
        }

        /// `out += Σ coef[i] · m[i]` for the rows `first..first + R` (in bounds), in order.
        #[inline]
        #[target_feature(enable = $feat)]
        unsafe fn axpy_group<const R: usize>(
            m: &[f32],
            coef: &[f32],
            out: &mut [f32],
            first: usize,
        ) {
            let n = out.len();
            let (op, mp) = (out.as_mut_ptr(), m.as_ptr().add(first * n));
            let mut cv = [zero(); R];
            for (r, cv) in cv.iter_mut().enumerate() {
                *cv = splat(coef[first + r]);
            }
            let mut j = 0;
            while j + W <= n {
                let mut acc = load(op.add(j));
                for (r, &cv) in cv.iter().enumerate() {
                    acc = add(acc, mul(cv, load(mp.add(r * n + j))));
                }
                store(op.add(j), acc);
                j += W;
            }
            for col in j..n {
                for r in 0..R {
                    out[col] += coef[first + r] * m[(first + r) * n + col];
                }
            }
        }

        /// Column blocks of `4·W` (then `W`) of `u` in registers; each state value loaded
        /// and stored once.
        #[target_feature(enable = $feat)]
        pub(super) unsafe fn decay_project(s: &mut [f32], alpha: &[f32], k: &[f32], u: &mut [f32]) {
            let n = u.len();
            let mut j = 0;
            while j + 4 * W <= n {
                decay_block::<4>(s, alpha, k, u, j);
                j += 4 * W;
            }
            while j + W <= n {
                decay_block::<1>(s, alpha, k, u, j);
                j += W;
            }
            for col in j..n {
                for (i, (&al, &ki)) in alpha.iter().zip(k).enumerate() {
                    let sv = &mut s[i * n + col];
                    *sv *= al;
                    u[col] += *sv * ki;
                }
            }
        }

        /// [`decay_project`] on the `L·W` columns from `j` (in bounds).
        #[inline]
        #[target_feature(enable = $feat)]
        unsafe fn decay_block<const L: usize>(
            s: &mut [f32],
            alpha: &[f32],
            k: &[f32],
            u: &mut [f32],
            j: usize,
        ) {
            let n = u.len();
            let (up, sp) = (u.as_mut_ptr().add(j), s.as_mut_ptr().add(j));
            let mut acc = [zero(); L];
            for (a, acc) in acc.iter_mut().enumerate() {
                *acc = load(up.add(a * W));
            }
            for (i, (&al, &ki)) in alpha.iter().zip(k).enumerate() {
                let (av, kv, rp) = (splat(al), splat(ki), sp.add(i * n));
                for (a, acc) in acc.iter_mut().enumerate() {
                    let v = mul(load(rp.add(a * W)), av);
                    store(rp.add(a * W), v);
                    *acc = add(*acc, mul(v, kv));
                }
            }
            for (a, acc) in acc.iter().enumerate() {
                store(up.add(a * W), *acc);
            }
        }

        /// Column blocks of `4·W` (then `W`) of `delta` and `o` in registers; each state
        /// value loaded and stored once.
        #[target_feature(enable = $feat)]
        pub(super) unsafe fn update_project(
            s: &mut [f32],
            k: &[f32],
            delta: &[f32],
            q: &[f32],
            o: &mut [f32],
        ) {
            let n = o.len();
            let mut j = 0;
            while j + 4 * W <= n {
                update_block::<4>(s, k, delta, q, o, j);
                j += 4 * W;
            }
            while j + W <= n {
                update_block::<1>(s, k, delta, q, o, j);
                j += W;
            }
            for col in j..n {
                for (i, (&ki, &qi)) in k.iter().zip(q).enumerate() {
                    let sv = &mut s[i * n + col];
                    *sv += ki * delta[col];
                    o[col] += *sv * qi;
                }
            }
        }

        /// [`update_project`] on the `L·W` columns from `j` (in bounds).
        #[inline]
        #[target_feature(enable = $feat)]
        unsafe fn update_block<const L: usize>(
            s: &mut [f32],
            k: &[f32],
            delta: &[f32],
            q: &[f32],
            o: &mut [f32],
            j: usize,
        ) {
            let n = o.len();
            let (op, sp) = (o.as_mut_ptr().add(j), s.as_mut_ptr().add(j));
            let dp = delta.as_ptr().add(j);
            let (mut acc, mut d) = ([zero(); L], [zero(); L]);
            for a in 0..L {
                acc[a] = load(op.add(a * W));
                d[a] = load(dp.add(a * W));
            }
            for (i, (&ki, &qi)) in k.iter().zip(q).enumerate() {
                let (kv, qv, rp) = (splat(ki), splat(qi), sp.add(i * n));
                for a in 0..L {
                    let v = add(load(rp.add(a * W)), mul(kv, d[a]));
                    store(rp.add(a * W), v);
                    acc[a] = add(acc[a], mul(v, qv));
                }
            }
            for (a, acc) in acc.iter().enumerate() {
                store(op.add(a * W), *acc);
            }
        }
    };
}

/// AVX2: eight lanes.
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    const W: usize = 8;
    const ROWS: usize = 2;

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn load(p: *const f32) -> __m256 {
        _mm256_loadu_ps(p)
    }
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn store(p: *mut f32, v: __m256) {
        _mm256_storeu_ps(p, v)
    }
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn mul(a: __m256, b: __m256) -> __m256 {
        _mm256_mul_ps(a, b)
    }
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn add(a: __m256, b: __m256) -> __m256 {
        _mm256_add_ps(a, b)
    }
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn splat(v: f32) -> __m256 {
        _mm256_set1_ps(v)
    }
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn zero() -> __m256 {
        _mm256_setzero_ps()
    }
    /// Lanes `i` and `i + 8`, then `i + 4`, `i + 2`, `i + 1`, as the portable fold.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn fold16(v: [__m256; 2]) -> f32 {
        fold8(_mm256_add_ps(v[0], v[1]))
    }
    /// The pairwise fold of eight lanes (widths 4, 2, 1).
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(super) fn fold8(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps::<0b01>(s, s));
        _mm_cvtss_f32(s)
    }

    vector_kernels!("avx2,fma");
}

/// AVX-512F: sixteen lanes.
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    const W: usize = 16;
    const ROWS: usize = 4;

    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma")]
    unsafe fn load(p: *const f32) -> __m512 {
        _mm512_loadu_ps(p)
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma")]
    unsafe fn store(p: *mut f32, v: __m512) {
        _mm512_storeu_ps(p, v)
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma")]
    fn mul(a: __m512, b: __m512) -> __m512 {
        _mm512_mul_ps(a, b)
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma")]
    fn add(a: __m512, b: __m512) -> __m512 {
        _mm512_add_ps(a, b)
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma")]
    fn splat(v: f32) -> __m512 {
        _mm512_set1_ps(v)
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma")]
    fn zero() -> __m512 {
        _mm512_setzero_ps()
    }
    /// Lanes `i` and `i + 8` (the two 256-bit halves), then the eight-lane fold.
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma")]
    fn fold16(v: [__m512; 1]) -> f32 {
        let lo = _mm512_castps512_ps256(v[0]);
        let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v[0])));
        super::avx2::fold8(_mm256_add_ps(lo, hi))
    }

    vector_kernels!("avx512f,avx2,fma");
}

/// NEON: four lanes.
#[cfg(target_arch = "aarch64")]
mod neon {
    use std::arch::aarch64::*;

    const W: usize = 4;
    const ROWS: usize = 1;

    #[inline]
    #[target_feature(enable = "neon")]
    unsafe fn load(p: *const f32) -> float32x4_t {
        vld1q_f32(p)
    }
    #[inline]
    #[target_feature(enable = "neon")]
    unsafe fn store(p: *mut f32, v: float32x4_t) {
        vst1q_f32(p, v)
    }
    #[inline]
    #[target_feature(enable = "neon")]
    fn mul(a: float32x4_t, b: float32x4_t) -> float32x4_t {
        vmulq_f32(a, b)
    }
    #[inline]
    #[target_feature(enable = "neon")]
    fn add(a: float32x4_t, b: float32x4_t) -> float32x4_t {
        vaddq_f32(a, b)
    }
    #[inline]
    #[target_feature(enable = "neon")]
    fn splat(v: f32) -> float32x4_t {
        vdupq_n_f32(v)
    }
    #[inline]
    #[target_feature(enable = "neon")]
    fn zero() -> float32x4_t {
        vdupq_n_f32(0.0)
    }
    /// Lanes `i` and `i + 8`, then `i + 4`, `i + 2`, `i + 1`, as the portable fold.
    #[inline]
    #[target_feature(enable = "neon")]
    fn fold16(v: [float32x4_t; 4]) -> f32 {
        let s = vaddq_f32(vaddq_f32(v[0], v[2]), vaddq_f32(v[1], v[3]));
        let s = vadd_f32(vget_low_f32(s), vget_high_f32(s));
        vget_lane_f32::<0>(s) + vget_lane_f32::<1>(s)
    }

    vector_kernels!("neon");
}
