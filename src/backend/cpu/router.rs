//! Sigmoid router with biased top-k selection and unbiased, renormalized weights.

use super::elementwise::sigmoid;
use super::CpuAct;
use crate::backend::RouterParams;
use crate::routed_expert::Route;
use anyhow::{ensure, Result};
use rayon::prelude::*;

/// Keeps the renormalization finite when every chosen score underflows.
pub(crate) const RENORM_EPS: f32 = 1e-20;

/// Rows from which [`router_topk`] spreads over the pool.
const ROUTER_PARALLEL_FROM: usize = 16;

/// Routes every row: top-k of `σ(logit) + bias`, ties to the lower expert id.
pub(crate) fn router_topk(logits: &CpuAct, bias: &[f32], p: RouterParams) -> Result<Vec<Route>> {
    let e = logits.cols;
    ensure!(
        bias.len() == e && p.top_k >= 1 && p.top_k <= e,
        "router: {e} experts, {} bias values, top-k {}",
        bias.len(),
        p.top_k
    );
    let route = |r: usize| -> Route {
        let s: Vec<f32> = logits.row(r).iter().map(|&x| sigmoid(x)).collect();
        let mut ids: Vec<usize> = (0..e).collect();
        // A stable sort on the biased score keeps equal scores in id order.
        ids.sort_by(|&a, &b| (s[b] + bias[b]).total_cmp(&(s[a] + bias[a])));
        ids.truncate(p.top_k);
        let sum: f32 = ids.iter().map(|&i| s[i]).sum();
        let norm = if p.renormalize {
            1.0 / (sum + RENORM_EPS)
        } else {
            1.0
        };
        ids.iter()
            .map(|&i| (i as u32, s[i] * norm * p.scaling))
            .collect()
    };
    // Rows route independently: a prefill window's rows go across the pool, a decode
    // step's single row stays on the calling thread.
    Ok(if logits.rows < ROUTER_PARALLEL_FROM {
        (0..logits.rows).map(route).collect()
    } else {
        (0..logits.rows).into_par_iter().map(route).collect()
    })
}
