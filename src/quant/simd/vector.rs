//! The f32 vector kernels of the KDA state update and the MLA attention, on every
//! [`SimdLevel`].
//!
//! Each kernel has a portable form (the reference) and one per SIMD level that performs
//! the same f32 operations in the same order, several lanes at a time: separate multiply
//! and add (no fused multiply-add), the row sums of [`dot_rows`] in the sixteen lanes and
//! pairwise fold of the portable dot product. So every level gives the portable bits
//! (tested on awkward shapes), and the model's CPU output does not depend on the CPU.

use super::SimdLevel;
use crate::quant::vec_math;

mod lanes;

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
        SimdLevel::Avx2Fma => unsafe { lanes::avx2::dot_rows(m, x, out) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the level's CPU features confirmed by `check`, the shapes the kernel
        // stays within by the assert above.
        SimdLevel::Avx512 => unsafe { lanes::avx512::dot_rows(m, x, out) },
        #[cfg(target_arch = "aarch64")]
        // SAFETY: the level's CPU features confirmed by `check`, the shapes the kernel
        // stays within by the assert above.
        SimdLevel::Neon => unsafe { lanes::neon::dot_rows(m, x, out) },
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
        SimdLevel::Avx2Fma => unsafe { lanes::avx2::axpy_rows(m, coef, out) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the level's CPU features confirmed by `check`, the shapes the kernel
        // stays within by the assert above.
        SimdLevel::Avx512 => unsafe { lanes::avx512::axpy_rows(m, coef, out) },
        #[cfg(target_arch = "aarch64")]
        // SAFETY: the level's CPU features confirmed by `check`, the shapes the kernel
        // stays within by the assert above.
        SimdLevel::Neon => unsafe { lanes::neon::axpy_rows(m, coef, out) },
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
        SimdLevel::Avx2Fma => unsafe { lanes::avx2::decay_project(s, alpha, k, u) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the level's CPU features confirmed by `check`, the shapes the kernel
        // stays within by the assert above.
        SimdLevel::Avx512 => unsafe { lanes::avx512::decay_project(s, alpha, k, u) },
        #[cfg(target_arch = "aarch64")]
        // SAFETY: the level's CPU features confirmed by `check`, the shapes the kernel
        // stays within by the assert above.
        SimdLevel::Neon => unsafe { lanes::neon::decay_project(s, alpha, k, u) },
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
        SimdLevel::Avx2Fma => unsafe { lanes::avx2::update_project(s, k, delta, q, o) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the level's CPU features confirmed by `check`, the shapes the kernel
        // stays within by the assert above.
        SimdLevel::Avx512 => unsafe { lanes::avx512::update_project(s, k, delta, q, o) },
        #[cfg(target_arch = "aarch64")]
        // SAFETY: the level's CPU features confirmed by `check`, the shapes the kernel
        // stays within by the assert above.
        SimdLevel::Neon => unsafe { lanes::neon::update_project(s, k, delta, q, o) },
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
/// with `q_abs = wkᵀ q_nope`: the head's attention output, `[v]` (the softmax's sum in f64).
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
    let scores: Vec<f32> = by_latent
        .iter()
        .zip(&by_rope)
        .map(|(&a, &b)| (a + b) * h.scale)
        .collect();
    let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    // The exponentials in f32 arithmetic (vectorized: one a cached position and head), their
    // sum and the division in f64.
    let exps: Vec<f32> = scores.iter().map(|&s| vec_math::exp(s - max)).collect();
    let total: f64 = exps.iter().map(|&e| f64::from(e)).sum();
    let probs: Vec<f32> = exps
        .iter()
        .map(|&e| (f64::from(e) / total) as f32)
        .collect();
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
