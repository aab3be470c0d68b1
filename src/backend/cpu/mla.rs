//! Absorbed gated-MLA attention over the latent cache.

use super::norm::inv_rms;
use super::CpuAct;
use crate::backend::{MlaAttnWeights, MlaDims};
use crate::quant::pool;
use crate::quant::simd::{self, vector, SimdLevel};
use anyhow::{ensure, Result};
use rayon::prelude::*;

/// The latent cache of one MLA layer: per position the normalized latent and the rope part.
#[derive(Clone, Debug, Default)]
pub struct MlaCache {
    /// `[positions, kv_lora]`.
    pub latent: Vec<f32>,
    /// `[positions, rope]`.
    pub rope: Vec<f32>,
    /// Cached positions.
    pub len: usize,
}

impl MlaCache {
    /// An empty cache.
    pub fn new(_d: &MlaDims) -> Self {
        Self::default()
    }
}

/// Appends each row's latent to the cache and attends causally, head by head, on the
/// process's SIMD level.
pub(crate) fn mla_attend(
    d: &MlaDims,
    w: &MlaAttnWeights<CpuAct>,
    cache: &mut MlaCache,
    q: &CpuAct,
    c: &CpuAct,
) -> Result<CpuAct> {
    mla_attend_at(simd::level(), d, w, cache, q, c)
}

/// [`mla_attend`] on `level`'s vector kernels (panics if this CPU cannot run `level`).
pub(crate) fn mla_attend_at(
    level: SimdLevel,
    d: &MlaDims,
    w: &MlaAttnWeights<CpuAct>,
    cache: &mut MlaCache,
    q: &CpuAct,
    c: &CpuAct,
) -> Result<CpuAct> {
    let (h, r, nope, kv) = (d.heads, d.rope, d.nope, d.kv_lora);
    let qw = nope + r;
    crate::backend::shape_checks::mla_inputs(d, (q.rows, q.cols), (c.rows, c.cols))?;
    ensure!(
        w.wk.data.len() == h * nope * kv && w.wv.data.len() == h * d.v * kv,
        "mla_attend: kv_b_proj blocks do not match {h} heads"
    );
    let scale = 1.0 / (qw as f32).sqrt();
    let mut out = vec![0.0f32; q.rows * h * d.v];
    for t in 0..q.rows {
        let ct = c.row(t);
        let s = inv_rms(&ct[..kv], d.norm_eps);
        cache.latent.extend(
            ct[..kv]
                .iter()
                .zip(&w.kv_norm.data)
                .map(|(&x, &g)| x * s * g),
        );
        cache.rope.extend_from_slice(&ct[kv..]);
        cache.len += 1;
        let qt = q.row(t);
        let cache_ref = &*cache;
        // Per head: the query's and output's absorption through kv_b_proj, and a score
        // and a weighted sum over every cached position's latent and rope.
        let head_work = (nope + d.v) * kv + 2 * cache_ref.len * (kv + r);
        out[t * h * d.v..(t + 1) * h * d.v]
            .par_chunks_mut(d.v)
            .with_min_len(pool::min_len(h, h * head_work))
            .enumerate()
            .for_each(|(hh, o)| {
                let head = vector::MlaHead {
                    q_nope: &qt[hh * qw..hh * qw + nope],
                    q_rope: &qt[hh * qw + nope..(hh + 1) * qw],
                    wk: &w.wk.data[hh * nope * kv..(hh + 1) * nope * kv],
                    wv: &w.wv.data[hh * d.v * kv..(hh + 1) * d.v * kv],
                    latent: &cache_ref.latent,
                    rope: &cache_ref.rope,
                    positions: cache_ref.len,
                    kv_lora: kv,
                    scale,
                };
                vector::mla_head(level, &head, o);
            });
    }
    CpuAct::new(out, q.rows, h * d.v)
}
