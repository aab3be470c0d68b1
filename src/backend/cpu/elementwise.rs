//! Elementwise activations shared by the CPU ops.

use super::CpuAct;
use crate::backend::Glu;
use crate::quant::vec_math;
use crate::quant::{partner, pool};
use anyhow::Result;
use rayon::prelude::*;

/// Logistic sigmoid.
#[inline(always)]
pub(crate) fn sigmoid(x: f32) -> f32 {
    vec_math::sigmoid(x)
}

/// SiLU, `x·σ(x)`.
#[inline(always)]
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
#[inline(always)]
pub(crate) fn glu(g: f32, u: f32, glu: Glu) -> f32 {
    match glu {
        Glu::Situ { beta, linear_beta } => {
            beta * vec_math::tanh(g / beta)
                * sigmoid(g)
                * (linear_beta * vec_math::tanh(u / linear_beta))
        }
        Glu::Silu => silu(g) * u,
    }
}

/// Element steps one value of [`zip`] counts as against [`pool::POOL_WORK_FROM`]: the
/// gated units take a few transcendental calls a value.
const ZIP_WORK: usize = 16;

/// Values of one piece of a [`zip`] across the pool.
const ZIP_CHUNK: usize = 4096;

/// What one value of `add` costs, in the multiply-adds of [`pool::partner_pays`].
pub(crate) const ADD_COST: usize = 1;
/// What one value of `sigmoid_gate` costs (an `exp`), as [`ADD_COST`].
pub(crate) const SIGMOID_COST: usize = 64;
/// What one value of a gated unit costs (SiTU: two `tanh` and an `exp`), as [`ADD_COST`].
pub(crate) const GLU_COST: usize = 192;

/// Applies `f` elementwise to two same-shaped activations; `cost` is what one value takes
/// ([`GLU_COST`] …), which decides whether the partner thread takes half of the rows.
pub(crate) fn zip(
    a: &CpuAct,
    b: &CpuAct,
    cost: usize,
    f: impl Fn(f32, f32) -> f32 + Sync,
) -> Result<CpuAct> {
    let n = a.data.len();
    let mut data = vec![0.0f32; n];
    // A plain loop over slices, so that `f` (pure f32 arithmetic, see `vec_math`) runs on
    // vectors of values.
    let apply = |first: usize, out: &mut [f32]| {
        let end = first + out.len();
        for ((o, &x), &y) in out
            .iter_mut()
            .zip(&a.data[first..end])
            .zip(&b.data[first..end])
        {
            *o = f(x, y);
        }
    };
    if n * ZIP_WORK < pool::POOL_WORK_FROM && pool::partner_pays(a.rows, n * cost) {
        partner::halves(&mut data, a.rows / 2 * a.cols, apply);
    } else {
        let chunks = n.div_ceil(ZIP_CHUNK);
        data.par_chunks_mut(ZIP_CHUNK)
            .with_min_len(pool::min_len(chunks, n * ZIP_WORK))
            .enumerate()
            .for_each(|(i, out)| apply(i * ZIP_CHUNK, out));
    }
    CpuAct::new(data, a.rows, a.cols)
}
