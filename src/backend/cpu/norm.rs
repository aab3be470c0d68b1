//! RMSNorm and the block attention-residual mix.

use super::CpuAct;
use crate::quant::pool;
use anyhow::{ensure, Result};
use rayon::prelude::*;

/// Element steps a value of a norm counts as against [`pool::POOL_WORK_FROM`]: a widened
/// square and sum, then a scale (and for the mix, a weighted score and sum).
const NORM_WORK: usize = 4;

/// `1 / sqrt(mean(x²) + eps)`, the sum widened to f64.
pub(crate) fn inv_rms(x: &[f32], eps: f32) -> f32 {
    let ss: f64 = x.iter().map(|&v| f64::from(v) * f64::from(v)).sum();
    (1.0 / (ss / x.len() as f64 + f64::from(eps)).sqrt()) as f32
}

/// RMSNorm of every `group`-wide slice of every row.
pub(crate) fn rmsnorm(x: &CpuAct, w: &CpuAct, group: usize, eps: f32) -> Result<CpuAct> {
    ensure!(
        group > 0 && x.cols % group == 0 && w.data.len() == group,
        "rmsnorm: row width {} is not a multiple of group {group}, or weight has {} values",
        x.cols,
        w.data.len()
    );
    let mut out = x.data.clone();
    let len = out.len();
    out.par_chunks_mut(group)
        .with_min_len(pool::min_len(len / group, len * NORM_WORK))
        .for_each(|g| {
            let s = inv_rms(g, eps);
            for (v, &wv) in g.iter_mut().zip(&w.data) {
                *v = *v * s * wv;
            }
        });
    CpuAct::new(out, x.rows, x.cols)
}

/// Softmax over the scores `Σ_d (E_j[d]·inv_rms(E_j))·w[d]` of the entries `bank ++ [cur]`,
/// returning the softmax-weighted sum of the raw entries, row by row.
pub(crate) fn attn_res_mix(bank: &[&CpuAct], cur: &CpuAct, w: &CpuAct, eps: f32) -> Result<CpuAct> {
    ensure!(
        w.data.len() == cur.cols,
        "attn_res_mix: weight has {} values for rows of {}",
        w.data.len(),
        cur.cols
    );
    let cols = cur.cols;
    let mut out = vec![0.0f32; cur.data.len()];
    let work = cur.data.len() * (bank.len() + 1) * NORM_WORK;
    out.par_chunks_mut(cols)
        .with_min_len(pool::min_len(cur.rows, work))
        .enumerate()
        .for_each(|(r, o)| {
            let entries: Vec<&[f32]> = bank.iter().map(|b| b.row(r)).chain([cur.row(r)]).collect();
            let scores: Vec<f64> = entries
                .iter()
                .map(|e| {
                    let s = inv_rms(e, eps);
                    e.iter()
                        .zip(&w.data)
                        .map(|(&v, &wv)| f64::from(v * s) * f64::from(wv))
                        .sum()
                })
                .collect();
            let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let exps: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
            let total: f64 = exps.iter().sum();
            for (e, p) in entries.iter().zip(&exps) {
                let p = (p / total) as f32;
                for (ov, &ev) in o.iter_mut().zip(e.iter()) {
                    *ov += p * ev;
                }
            }
        });
    CpuAct::new(out, cur.rows, cols)
}
