//! Elementwise activations shared by the CPU ops.

use super::CpuAct;
use crate::backend::Glu;
use crate::quant::pool;
use anyhow::Result;
use rayon::prelude::*;

/// Logistic sigmoid.
pub(crate) fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// SiLU, `x·σ(x)`.
pub(crate) fn silu(x: f32) -> f32 {
    x * sigmoid(x)
}

/// `softplus(x) = ln(1 + e^x)`, written to stay finite for large |x|.
pub(crate) fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// One element of a gated linear unit.
pub(crate) fn glu(g: f32, u: f32, glu: Glu) -> f32 {
    match glu {
        Glu::Situ { beta, linear_beta } => {
            beta * (g / beta).tanh() * sigmoid(g) * (linear_beta * (u / linear_beta).tanh())
        }
        Glu::Silu => silu(g) * u,
    }
}

/// Element steps one value of [`zip`] counts as against [`pool::POOL_WORK_FROM`]: the
/// gated units take a few transcendental calls a value.
const ZIP_WORK: usize = 16;

/// Applies `f` elementwise to two same-shaped activations.
pub(crate) fn zip(a: &CpuAct, b: &CpuAct, f: impl Fn(f32, f32) -> f32 + Sync) -> Result<CpuAct> {
    let n = a.data.len();
    let data = a
        .data
        .par_iter()
        .with_min_len(pool::min_len(n, n * ZIP_WORK))
        .zip(&b.data)
        .map(|(&x, &y)| f(x, y))
        .collect();
    CpuAct::new(data, a.rows, a.cols)
}
