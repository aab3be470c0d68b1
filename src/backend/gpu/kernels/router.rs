//! The router on the device: only the chosen ids and weights come back to the host.

use crate::backend::gpu::device::buffers::GpuAct;
use crate::backend::gpu::device::context::{Dispatch, PendingRead};
use crate::backend::gpu::device::pipeline::{AdapterShape, VariantList};
use crate::backend::gpu::device::shaders::Shader;
use crate::backend::gpu::GpuBackend;
use crate::backend::RouterParams;
use crate::routed_expert::Route;
use anyhow::{bail, ensure, Result};

/// Most experts per token the kernel's selection list holds.
pub(crate) const MAX_TOP_K: usize = 64;

impl GpuBackend {
    pub(in crate::backend::gpu) fn router_topk_op(
        &self,
        logits: &GpuAct,
        bias: &[f32],
        p: RouterParams,
    ) -> Result<Vec<Route>> {
        let pending = self.router_topk_begin(logits, bias, p)?;
        self.router_topk_finish(pending)
    }

    /// The router's top-k over `logits` recorded and its readback begun: what is
    /// recorded before [`Self::router_topk_finish`] (work that needs no route) runs on the
    /// device while the host waits for the routes.
    pub(in crate::backend::gpu) fn router_topk_begin(
        &self,
        logits: &GpuAct,
        bias: &[f32],
        p: RouterParams,
    ) -> Result<PendingRoutes> {
        let e = logits.cols;
        ensure!(
            bias.len() == e && p.top_k >= 1 && p.top_k <= e,
            "router: {e} experts, {} bias values, top-k {}",
            bias.len(),
            p.top_k
        );
        ensure!(
            p.top_k <= MAX_TOP_K,
            "router: top-k {} exceeds the GPU kernel's {MAX_TOP_K}",
            p.top_k
        );
        let k = p.top_k;
        if logits.rows == 0 {
            return Ok(PendingRoutes { read: None, k });
        }
        let bias_buf = self
            .ctx
            .buffer_init(bytemuck::cast_slice(bias), "router bias");
        let routes = self.scratch((logits.rows * k * 8) as u64, "routes");
        let out = &routes.buf;
        self.ctx.dispatch(&Dispatch {
            shader: Shader::Router,
            entry: "topk",
            consts: &[],
            params: &[
                logits.rows as u32,
                e as u32,
                k as u32,
                u32::from(p.renormalize),
                p.scaling.to_bits(),
            ],
            buffers: &[&logits.buf, &bias_buf, out],
            groups: self.ctx.grid(logits.rows as u32),
        });
        let read = self.ctx.begin_read(out, 0, (logits.rows * k * 8) as u64);
        Ok(PendingRoutes {
            read: Some(read),
            k,
        })
    }

    /// The routes of a begun top-k, one a row.
    pub(in crate::backend::gpu) fn router_topk_finish(
        &self,
        pending: PendingRoutes,
    ) -> Result<Vec<Route>> {
        let PendingRoutes { read, k } = pending;
        let Some(read) = read else {
            return Ok(Vec::new());
        };
        self.ctx.finish_read(read, |bytes| {
            let words: &[u32] = bytemuck::cast_slice(bytes);
            words
                .chunks_exact(2 * k)
                .map(|row| {
                    row.chunks_exact(2)
                        .map(|pw| (pw[0], f32::from_bits(pw[1])))
                        .collect()
                })
                .collect()
        })
    }
}

/// A router top-k whose routes are on their way back ([`GpuBackend::router_topk_begin`]).
pub(in crate::backend::gpu) struct PendingRoutes {
    /// The readback of the routes (none for no rows).
    read: Option<PendingRead>,
    /// Experts a row.
    k: usize,
}

/// `routes`, one a row of the chunk, or an error naming the first row whose weights are
/// not finite. The GPU checks no hidden state per layer (that would cost a readback each);
/// a non-finite router input makes its weights non-finite, and the router's readback is
/// already here, so the MoE layer that first sees one is named (by its caller).
pub(in crate::backend::gpu) fn finite_routes(routes: Vec<Route>) -> Result<Vec<Route>> {
    if let Some(row) = routes
        .iter()
        .position(|r| r.iter().any(|(_, w)| !w.is_finite()))
    {
        bail!(
            "the router's input holds a non-finite value (NaN or Inf) in row {row} of the \
             chunk: this layer's attention or an earlier layer produced it (the weights or \
             the input are broken); nothing after it is computed"
        );
    }
    Ok(routes)
}

/// The router kernel's pipeline.
pub(crate) fn pipeline_variants(_a: AdapterShape, list: &mut VariantList) {
    list.push(Shader::Router, "topk", Vec::new());
}
