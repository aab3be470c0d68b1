//! The SIMD forms of the vector kernels, one module per level, each written once over the
//! level's vector type by `vector_kernels`; `vector.rs` dispatches to them.

/// The lanes of the portable dot product's accumulator (`kernel::dot`).
const DOT_LANES: usize = 16;

/// The SIMD forms, written once over a vector type `V` of `W` lanes and the level's
/// `load`, `store`, `mul`, `add`, `splat`, `zero` and `fold16` (the pairwise fold of
/// sixteen lanes held in `16 / W` vectors, in the portable dot product's order), with
/// `ROWS` the rows `dot_rows` sums together (sixteen lanes each; together they keep
/// enough independent add chains in flight).
macro_rules! vector_kernels {
    ($feat:literal) => {
        /// Vectors holding one row's sixteen dot-product lanes.
        const LV: usize = super::DOT_LANES / W;

        /// `ROWS` rows at a time, then one.
        #[target_feature(enable = $feat)]
        pub(in crate::quant::simd::vector) unsafe fn dot_rows(
            m: &[f32],
            x: &[f32],
            out: &mut [f32],
        ) {
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
        pub(in crate::quant::simd::vector) unsafe fn axpy_rows(
            m: &[f32],
            coef: &[f32],
            out: &mut [f32],
        ) {
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
        pub(in crate::quant::simd::vector) unsafe fn decay_project(
            s: &mut [f32],
            alpha: &[f32],
            k: &[f32],
            u: &mut [f32],
        ) {
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
        pub(in crate::quant::simd::vector) unsafe fn update_project(
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
pub(super) mod avx2 {
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
pub(super) mod avx512 {
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
pub(super) mod neon {
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
