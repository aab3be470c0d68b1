//! Routed experts over a window: each expert runs once for all the rows that chose it.

use super::elementwise::{glu, GLU_COST};
use super::CpuAct;
use crate::backend::{ExpertAssignment, ExpertPayload, Glu};
use crate::quant::idot::{self, IdotKernel, QuantizedActs};
use crate::quant::{partner, pool};
use crate::routed_expert::ExpertWeights;
use anyhow::{bail, ensure, Result};
use rayon::prelude::*;

/// Gated values from which [`gated`] spreads over the pool: a decode step's expert (one
/// token, a few thousand values) stays on the calling thread, where handing it to the pool
/// would cost more than it computes.
const GATED_PARALLEL_FROM: usize = 1 << 15;

/// `glu(gate, up)` elementwise, across the pool for a busy expert of a prefill window
/// (hundreds of thousands of values, each a few transcendental calls, which on one thread
/// would leave the other cores idle between the expert's matmuls).
fn gated(gate: &[f32], up: &[f32], g: Glu) -> Vec<f32> {
    if gate.len() < GATED_PARALLEL_FROM {
        return gate.iter().zip(up).map(|(&a, &b)| glu(a, b, g)).collect();
    }
    gate.par_iter()
        .zip(up)
        .map(|(&a, &b)| glu(a, b, g))
        .collect()
}

/// `acc[t] += w · W2_e · glu(W1_e·z[t], W3_e·z[t])`, experts accumulated in list order;
/// with `idot`, each matmul's input is quantized to int8 groups and dotted in integers.
/// A window of several rows too small for the pool splits its experts with the partner
/// thread: each expert's output is computed whole on one thread, and the sum still adds
/// them in list order.
pub(crate) fn moe_accumulate(
    acc: &mut CpuAct,
    z: &CpuAct,
    experts: &[ExpertAssignment<'_>],
    g: Glu,
    idot: Option<IdotKernel>,
) -> Result<()> {
    let d = z.cols;
    crate::backend::shape_checks::moe_accumulator((acc.rows, acc.cols), (z.rows, z.cols))?;
    let mut jobs = Vec::with_capacity(experts.len());
    for ex in experts {
        let ExpertPayload::Host(w) = &ex.payload else {
            let name = ex.key.map_or("an expert".to_string(), |k| {
                format!("expert {} of layer {}", k.id, k.layer)
            });
            bail!(
                "moe: {name} came without host weights; the CPU backend keeps no experts resident"
            )
        };
        let i = crate::backend::shape_checks::expert_shapes(w, d)?;
        for &(t, _) in &ex.tokens {
            ensure!(
                t < z.rows,
                "moe: token row {t} out of range ({} rows)",
                z.rows
            );
        }
        jobs.push(Job {
            w,
            i,
            tokens: &ex.tokens,
        });
    }
    let run = |job: &Job<'_>| job.output(z, g, idot);
    let costs: Vec<usize> = jobs
        .iter()
        .map(|job| job.tokens.len() * job.i * (3 * d + GLU_COST))
        .collect();
    let work: usize = costs.iter().sum();
    let out = &mut acc.data;
    if jobs.len() >= 2 && work < pool::POOL_WORK_FROM && pool::partner_pays(acc.rows, work) {
        // Two runs of whole experts of about equal work; the sum waits for both.
        let (lo, hi) = jobs.split_at(partner::even_cut(&costs));
        let all = |part: &[Job<'_>]| part.iter().map(run).collect::<Vec<_>>();
        let (mut ys, rest) = partner::join(|| all(lo), || all(hi));
        ys.extend(rest);
        for (job, y) in jobs.iter().zip(&ys) {
            job.add_into(out, y, d);
        }
    } else {
        for job in &jobs {
            job.add_into(out, &run(job), d);
        }
    }
    Ok(())
}

/// One expert of a window: its weights, intermediate width and the rows that chose it.
struct Job<'a> {
    w: &'a ExpertWeights<'a>,
    i: usize,
    tokens: &'a [(usize, f32)],
}

impl Job<'_> {
    /// `W2 · glu(W1·z[t], W3·z[t])` for each of the expert's rows, `[rows, d]`.
    fn output(&self, z: &CpuAct, g: Glu, idot: Option<IdotKernel>) -> Vec<f32> {
        let (w, i, d) = (self.w, self.i, z.cols);
        let m = self.tokens.len();
        let mut x = Vec::with_capacity(m * d);
        for &(t, _) in self.tokens {
            x.extend_from_slice(z.row(t));
        }
        let (mut gate, mut up) = (vec![0.0f32; m * i], vec![0.0f32; m * i]);
        let mut y = vec![0.0f32; m * d];
        if let Some(kernel) = idot {
            // One quantization of the input serves both gate and up.
            let xq = QuantizedActs::new(&x, m, d);
            idot::matmul(kernel, &w.w1, &xq, &mut gate);
            idot::matmul(kernel, &w.w3, &xq, &mut up);
            let act = gated(&gate, &up, g);
            idot::matmul(kernel, &w.w2, &QuantizedActs::new(&act, m, i), &mut y);
        } else {
            w.w1.matmul(&x, m, &mut gate);
            w.w3.matmul(&x, m, &mut up);
            let act = gated(&gate, &up, g);
            w.w2.matmul(&act, m, &mut y);
        }
        y
    }

    /// `out[t] += weight · y[j]` for the expert's `j`-th row `t`.
    fn add_into(&self, out: &mut [f32], y: &[f32], d: usize) {
        for (j, &(t, wt)) in self.tokens.iter().enumerate() {
            for (o, &v) in out[t * d..(t + 1) * d]
                .iter_mut()
                .zip(&y[j * d..(j + 1) * d])
            {
                *o += wt * v;
            }
        }
    }
}
