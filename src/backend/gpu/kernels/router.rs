//! The router on the device: only the chosen ids and weights come back to the host.

use crate::backend::gpu::device::buffers::GpuAct;
use crate::backend::gpu::device::context::Dispatch;
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
        if logits.rows == 0 {
            return Ok(Vec::new());
        }
        let bias_buf = self
            .ctx
            .buffer_init(bytemuck::cast_slice(bias), "router bias");
        let k = p.top_k;
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
        let bytes = self.ctx.read(out, 0, (logits.rows * k * 8) as u64)?;
        let words: &[u32] = bytemuck::cast_slice(&bytes);
        let routes: Vec<Route> = words
            .chunks_exact(2 * k)
            .map(|row| {
                row.chunks_exact(2)
                    .map(|pw| (pw[0], f32::from_bits(pw[1])))
                    .collect()
            })
            .collect();
        Ok(routes)
    }
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
