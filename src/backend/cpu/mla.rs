//! Absorbed gated-MLA attention over the latent cache.

use super::norm::inv_rms;
use super::CpuAct;
use crate::backend::{MlaAttnWeights, MlaDims};
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

/// Appends each row's latent to the cache and attends causally, head by head.
pub fn mla_attend(
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
        out[t * h * d.v..(t + 1) * h * d.v]
            .par_chunks_mut(d.v)
            .enumerate()
            .for_each(|(hh, o)| {
                let q_nope = &qt[hh * qw..hh * qw + nope];
                let q_rope = &qt[hh * qw + nope..(hh + 1) * qw];
                let wk = &w.wk.data[hh * nope * kv..(hh + 1) * nope * kv];
                let mut q_abs = vec![0.0f32; kv];
                for (row, &qi) in wk.chunks(kv).zip(q_nope) {
                    for (a, &wv) in q_abs.iter_mut().zip(row) {
                        *a += qi * wv;
                    }
                }
                let scores: Vec<f64> = (0..cache_ref.len)
                    .map(|p| {
                        let l = &cache_ref.latent[p * kv..(p + 1) * kv];
                        let rr = &cache_ref.rope[p * r..(p + 1) * r];
                        let dot: f32 = q_abs.iter().zip(l).map(|(a, b)| a * b).sum::<f32>()
                            + q_rope.iter().zip(rr).map(|(a, b)| a * b).sum::<f32>();
                        f64::from(dot * scale)
                    })
                    .collect();
                let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let exps: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                let total: f64 = exps.iter().sum();
                let mut ctx = vec![0.0f32; kv];
                for (p, e) in exps.iter().enumerate() {
                    let pr = (e / total) as f32;
                    let l = &cache_ref.latent[p * kv..(p + 1) * kv];
                    for (cv, &lv) in ctx.iter_mut().zip(l) {
                        *cv += pr * lv;
                    }
                }
                let wv = &w.wv.data[hh * d.v * kv..(hh + 1) * d.v * kv];
                for (ov, row) in o.iter_mut().zip(wv.chunks(kv)) {
                    *ov = row.iter().zip(&ctx).map(|(a, b)| a * b).sum();
                }
            });
    }
    CpuAct::new(out, q.rows, h * d.v)
}
