//! The fused KDA token step: short conv, l2 norms, decay gate, delta rule, gated norm.

use super::elementwise::{sigmoid, silu, softplus};
use super::norm::inv_rms;
use super::CpuAct;
use crate::backend::{KdaDims, KdaStepInputs, KdaStepWeights};
use crate::quant::pool;
use crate::quant::simd::{self, vector, SimdLevel};
use anyhow::{ensure, Result};
use rayon::prelude::*;

/// Multiply-adds a head's delta rule takes per state value, counted against
/// [`pool::POOL_WORK_FROM`]: the decay, the key's read-out, the update and the query's
/// read-out each pass over the state once.
const KDA_HEAD_WORK: usize = 4;

/// Epsilon of the per-head l2 normalization of q and k (docs/model.md#kda-layer, step 3).
pub(crate) const KDA_L2_EPS: f32 = 1e-6;

/// Recurrent state of one KDA layer.
#[derive(Clone, Debug)]
pub struct KdaState {
    /// Last `K-1` conv inputs of q, k, v, oldest first: each `[(K-1) · P]`.
    pub conv: [Vec<f32>; 3],
    /// Delta-rule state, `[heads][head_dim (k)][head_dim (v)]`.
    pub s: Vec<f32>,
}

impl KdaState {
    /// Zero history and zero state.
    pub fn new(d: &KdaDims) -> Self {
        let hist = vec![0.0; (d.conv_k - 1) * d.width()];
        Self {
            conv: [hist.clone(), hist.clone(), hist],
            s: vec![0.0; d.heads * d.head_dim * d.head_dim],
        }
    }
}

/// Causal depthwise conv + SiLU of one row, advancing the history.
pub fn conv_silu_step(taps: &[f32], hist: &mut [f32], input: &[f32], k: usize) -> Vec<f32> {
    let p = input.len();
    let out = (0..p)
        .map(|c| {
            let w = &taps[c * k..(c + 1) * k];
            let mut acc = w[k - 1] * input[c];
            for (j, &wj) in w[..k - 1].iter().enumerate() {
                acc += wj * hist[j * p + c];
            }
            silu(acc)
        })
        .collect();
    if k > 1 {
        hist.copy_within(p.., 0);
        hist[(k - 2) * p..].copy_from_slice(input);
    }
    out
}

fn l2_normalize(x: &mut [f32], scale: f32) {
    let ss: f64 = x.iter().map(|&v| f64::from(v) * f64::from(v)).sum();
    let s = (1.0 / (ss + f64::from(KDA_L2_EPS)).sqrt()) as f32 * scale;
    x.iter_mut().for_each(|v| *v *= s);
}

/// Per-channel decay `g` of one head (log of α).
fn decay(d: &KdaDims, a_log: f32, z: &[f32], dt_bias: &[f32]) -> Vec<f32> {
    let a = a_log.exp();
    z.iter()
        .zip(dt_bias)
        .map(|(&z, &b)| match d.lower_bound {
            Some(lb) => lb * sigmoid(a * (z + b)),
            None => -a * softplus(z + b),
        })
        .collect()
}

/// Advances the state by the window's rows in order and returns the gated head outputs, on
/// the process's SIMD level.
pub(crate) fn kda_step(
    d: &KdaDims,
    w: &KdaStepWeights<CpuAct>,
    st: &mut KdaState,
    inp: KdaStepInputs<'_, CpuAct>,
) -> Result<CpuAct> {
    kda_step_at(simd::level(), d, w, st, inp)
}

/// [`kda_step`] with the delta rule on `level`'s vector kernels (panics if this CPU cannot
/// run `level`).
pub(crate) fn kda_step_at(
    level: SimdLevel,
    d: &KdaDims,
    w: &KdaStepWeights<CpuAct>,
    st: &mut KdaState,
    inp: KdaStepInputs<'_, CpuAct>,
) -> Result<CpuAct> {
    let (p, dk, k) = (d.width(), d.head_dim, d.conv_k);
    let n = inp.q.rows;
    crate::backend::shape_checks::kda_inputs(
        d,
        [inp.q, inp.k, inp.v, inp.f, inp.beta, inp.gate].map(|a| (a.rows, a.cols)),
    )?;
    ensure!(
        w.conv_q.data.len() == p * k && w.a_log.data.len() >= d.heads && w.dt_bias.data.len() == p,
        "kda_step: conv/A_log/dt_bias sizes do not match {} heads x {dk}",
        d.heads
    );
    let mut out = vec![0.0f32; n * p];
    for t in 0..n {
        let [hq, hk, hv] = &mut st.conv;
        let q = conv_silu_step(&w.conv_q.data, hq, inp.q.row(t), k);
        let kk = conv_silu_step(&w.conv_k.data, hk, inp.k.row(t), k);
        let v = conv_silu_step(&w.conv_v.data, hv, inp.v.row(t), k);
        let (f, beta, gate) = (inp.f.row(t), inp.beta.row(t), inp.gate.row(t));
        let q_scale = 1.0 / (dk as f32).sqrt();
        st.s.par_chunks_mut(dk * dk)
            .zip(out[t * p..(t + 1) * p].par_chunks_mut(dk))
            .with_min_len(pool::min_len(d.heads, d.heads * dk * dk * KDA_HEAD_WORK))
            .enumerate()
            .for_each(|(h, (s, o))| {
                let hs = h * dk..(h + 1) * dk;
                let mut qh = q[hs.clone()].to_vec();
                let mut kh = kk[hs.clone()].to_vec();
                l2_normalize(&mut qh, q_scale);
                l2_normalize(&mut kh, 1.0);
                let vh = &v[hs.clone()];
                let g = decay(
                    d,
                    w.a_log.data[h],
                    &f[hs.clone()],
                    &w.dt_bias.data[hs.clone()],
                );
                let alpha: Vec<f32> = g.iter().map(|gi| gi.exp()).collect();
                vector::kda_delta_step(level, s, &alpha, &kh, &qh, vh, sigmoid(beta[h]), o);
                let r = inv_rms(o, d.norm_eps);
                for ((oj, &wn), &gj) in o.iter_mut().zip(&w.o_norm.data).zip(&gate[hs]) {
                    *oj = *oj * r * wn * sigmoid(gj);
                }
            });
    }
    CpuAct::new(out, n, p)
}
