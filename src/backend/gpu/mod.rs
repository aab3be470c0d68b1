//! The GPU backend: every op of the [`Backend`] trait as WGSL kernels through wgpu.
//!
//! Weights are uploaded once; activations, KDA state, conv history and the MLA cache stay
//! on the device. Ops are recorded into one pending command encoder that is submitted
//! only when the host must read: a download (logits, traces) or the router's choices.

pub mod device;
pub mod experts;
pub mod kernels;

pub use device::buffers::{GpuAct, GpuKdaState, GpuMlaCache};
pub use device::context::{
    EffectiveLimits, GpuContext, GpuOptions, Int4Decode, LimitsProfile, MatvecShape, ReadStaging,
};
pub use device::pipeline::AdapterShape;
pub use kernels::matmul::{GpuFormat, GpuMat, DIGITS_FROM_ROWS};

use super::{
    Backend, ExpertAssignment, Glu, KdaDims, KdaStepInputs, KdaStepWeights, MlaAttnWeights,
    MlaDims, RouterParams,
};

use crate::quant::DenseMatrix;
use crate::routed_expert::Route;
use anyhow::{ensure, Result};
use device::buffer_pool::{BufferPool, Lease};
use device::pipeline::{PipelineKind, PipelineVariant, VariantList};
use experts::GpuExperts;
use std::collections::HashSet;
use std::sync::Arc;

/// The wgpu backend: the device, the expert tier on it, and the activation buffers kept for
/// reuse.
pub struct GpuBackend {
    /// Device, pipelines, pending encoder.
    pub ctx: GpuContext,
    /// The routed experts on the device: the VRAM tier, transient arenas, the chunk carry,
    /// the exchange with the host cache and the staging lent to reads.
    experts: GpuExperts,
    /// Activation buffers for reuse.
    pool: Arc<BufferPool>,
    /// [`GpuOptions::poison_reused`].
    poison_reused: bool,
}

impl GpuBackend {
    /// Opens the adapter `opts` selects.
    pub fn new(opts: &GpuOptions) -> Result<Self> {
        let ctx = GpuContext::new(opts)?;
        let experts = GpuExperts::new(&ctx, opts);
        Ok(Self {
            ctx,
            experts,
            pool: Arc::new(BufferPool::default()),
            poison_reused: opts.poison_reused,
        })
    }

    /// Upload buffers alive for lending to expert reads (0 when reads are not lent).
    pub fn lent_buffers(&self) -> usize {
        self.experts.lent_buffers()
    }

    /// Bytes of activation buffers waiting for reuse.
    pub fn pooled_bytes(&self) -> u64 {
        self.pool.pooled_bytes()
    }

    /// Experts the VRAM tier holds now.
    pub fn resident_experts(&self) -> Result<usize> {
        self.experts.resident_experts()
    }

    /// The `[n, rows]` output of `n` inputs through a `rows × cols` matrix, and whether
    /// kernels must fill it: not for rows of no columns (zeros: no kernel runs with a row
    /// of no units) nor for an empty result.
    pub(crate) fn matmul_output(
        &self,
        n: usize,
        rows: usize,
        cols: usize,
    ) -> Result<(GpuAct, bool)> {
        if cols == 0 {
            return Ok((Backend::zeros(self, n, rows)?, false));
        }
        Ok((self.alloc(n, rows), n > 0 && rows > 0))
    }

    /// A `[rows, cols]` activation for a kernel to write every element of: a buffer handed
    /// back by an earlier activation of the same size when there is one (its old values
    /// still in it), else a new one.
    pub fn alloc(&self, rows: usize, cols: usize) -> GpuAct {
        let size = (rows * cols * 4) as u64;
        let pool = &self.pool;
        let buf = match pool.take(device::context::storage_size(size)) {
            Some(b) => {
                if self.poison_reused {
                    let nan = f32::NAN.to_le_bytes();
                    let bytes: Vec<u8> = nan
                        .iter()
                        .copied()
                        .cycle()
                        .take(b.size() as usize)
                        .collect();
                    self.ctx.write(&b, 0, &bytes);
                }
                b
            }
            None => self.ctx.buffer(size, "activation"),
        };
        GpuAct {
            lease: Some(Lease::new(buf.clone(), pool)),
            buf,
            rows,
            cols,
        }
    }

    fn check_same(a: &GpuAct, b: &GpuAct, op: &str) -> Result<()> {
        super::shape_checks::same_shape(op, (a.rows, a.cols), (b.rows, b.cols))
    }

    /// Waits for all recorded work (benchmarks time with it).
    pub fn sync(&self) -> Result<()> {
        self.ctx.finish()
    }
}

impl Backend for GpuBackend {
    type Act = GpuAct;
    type Mat = GpuMat;
    type KdaState = GpuKdaState;
    type MlaCache = GpuMlaCache;

    fn name(&self) -> String {
        let profile = match self.ctx.profile {
            LimitsProfile::Native => String::new(),
            p => format!(" under the {p} limits profile"),
        };
        format!(
            "gpu: {} ({:?}){profile}",
            self.ctx.info.name, self.ctx.info.backend
        )
    }

    fn upload(&self, data: &[f32], rows: usize, cols: usize) -> Result<GpuAct> {
        ensure!(
            data.len() == rows * cols,
            "activation of {rows}x{cols} needs {} values, got {}",
            rows * cols,
            data.len()
        );
        Ok(GpuAct {
            buf: self
                .ctx
                .buffer_init(bytemuck::cast_slice(data), "activation"),
            rows,
            cols,
            lease: None,
        })
    }

    fn download(&self, x: &GpuAct) -> Result<Vec<f32>> {
        let bytes = self.ctx.read(&x.buf, 0, x.bytes())?;
        Ok(bytemuck::pod_collect_to_vec(&bytes))
    }

    fn shape(&self, x: &GpuAct) -> (usize, usize) {
        (x.rows, x.cols)
    }

    fn slice_rows(&self, x: &GpuAct, start: usize, count: usize) -> Result<GpuAct> {
        ensure!(
            start + count <= x.rows,
            "slice_rows: rows {start}..{} of a {}-row activation",
            start + count,
            x.rows
        );
        let out = self.alloc(count, x.cols);
        let row = (x.cols * 4) as u64;
        self.ctx
            .copy(&x.buf, start as u64 * row, &out.buf, 0, count as u64 * row);
        Ok(out)
    }

    fn concat_rows(&self, parts: &[&GpuAct]) -> Result<GpuAct> {
        let cols =
            crate::backend::shape_checks::concat_rows(parts.iter().map(|a| (a.rows, a.cols)))?;
        let rows: usize = parts.iter().map(|a| a.rows).sum();
        let row = (cols * 4) as u64;
        ensure!(
            rows as u64 * row <= self.ctx.max_binding,
            "concat_rows: {rows} rows of {cols} values exceed the adapter's binding limit of {} B",
            self.ctx.max_binding
        );
        let out = self.alloc(rows, cols);
        let mut at = 0u64;
        for a in parts.iter().filter(|a| a.rows > 0) {
            self.ctx.copy(&a.buf, 0, &out.buf, at, a.bytes());
            at += a.bytes();
        }
        Ok(out)
    }

    fn max_rows(&self, row_bytes: usize) -> usize {
        let by_binding = (self.ctx.max_binding / (row_bytes.max(1) as u64)) as usize;
        by_binding
            .min(self.ctx.limits.max_compute_workgroups_per_dimension as usize)
            .max(1)
    }

    fn load_matrix(&self, m: DenseMatrix) -> Result<GpuMat> {
        self.load_matrix_op(m)
    }

    fn kda_state(&self, dims: &KdaDims) -> Result<GpuKdaState> {
        self.kda_state_op(dims)
    }

    fn mla_cache(&self, dims: &MlaDims) -> Result<GpuMlaCache> {
        self.mla_cache_op(dims)
    }

    fn kda_state_copy(&self, state: &GpuKdaState) -> Result<GpuKdaState> {
        self.kda_state_copy_op(state)
    }

    fn mla_cache_max_positions(&self, dims: &MlaDims) -> Option<usize> {
        Some(self.mla_cache_max_positions_op(dims))
    }

    fn state_in_host_ram(&self) -> bool {
        super::ExpertResidency::unified_pool(self)
    }

    fn mla_truncate(&self, cache: &mut GpuMlaCache, len: usize) -> Result<()> {
        self.mla_truncate_op(cache, len)
    }

    fn kda_state_read(&self, state: &GpuKdaState) -> Result<Vec<f32>> {
        self.kda_state_read_op(state)
    }

    fn kda_state_write(&self, dims: &KdaDims, values: &[f32]) -> Result<GpuKdaState> {
        self.kda_state_write_op(dims, values)
    }

    fn mla_cache_read(&self, cache: &GpuMlaCache) -> Result<Vec<f32>> {
        self.mla_cache_read_op(cache)
    }

    fn mla_cache_write(&self, dims: &MlaDims, values: &[f32]) -> Result<GpuMlaCache> {
        self.mla_cache_write_op(dims, values)
    }

    fn matmul(&self, w: &GpuMat, x: &GpuAct) -> Result<GpuAct> {
        self.matmul_op(w, x)
    }

    fn matmul_many(&self, ws: &[&GpuMat], x: &GpuAct) -> Result<Vec<GpuAct>> {
        self.matmul_many_op(ws, x)
    }

    fn rmsnorm(&self, x: &GpuAct, w: &GpuAct, group: usize, eps: f32) -> Result<GpuAct> {
        self.rmsnorm_op(x, w, group, eps)
    }

    fn add(&self, a: &GpuAct, b: &GpuAct) -> Result<GpuAct> {
        self.add_op(a, b)
    }

    fn sigmoid_gate(&self, x: &GpuAct, gate: &GpuAct) -> Result<GpuAct> {
        self.sigmoid_gate_op(x, gate)
    }

    fn glu(&self, g: &GpuAct, u: &GpuAct, glu: Glu) -> Result<GpuAct> {
        self.glu_op(g, u, glu)
    }

    fn attn_res_mix(&self, bank: &[&GpuAct], cur: &GpuAct, w: &GpuAct, eps: f32) -> Result<GpuAct> {
        self.attn_res_mix_op(bank, cur, w, eps)
    }

    fn kda_step(
        &self,
        dims: &KdaDims,
        w: &KdaStepWeights<GpuAct>,
        state: &mut GpuKdaState,
        inp: KdaStepInputs<'_, GpuAct>,
    ) -> Result<GpuAct> {
        self.kda_step_op(dims, w, state, inp)
    }

    fn mla_attend(
        &self,
        dims: &MlaDims,
        w: &MlaAttnWeights<GpuAct>,
        cache: &mut GpuMlaCache,
        q: &GpuAct,
        c: &GpuAct,
    ) -> Result<GpuAct> {
        self.mla_attend_op(dims, w, cache, q, c)
    }

    fn router_topk(
        &self,
        logits: &GpuAct,
        bias: &[f32],
        params: RouterParams,
    ) -> Result<Vec<Route>> {
        self.router_topk_op(logits, bias, params)
    }

    fn moe_accumulate(
        &self,
        acc: &mut GpuAct,
        z: &GpuAct,
        experts: &[ExpertAssignment<'_>],
        glu: Glu,
    ) -> Result<()> {
        self.moe_accumulate_op(acc, z, experts, glu)?;
        // Streaming hands experts over in batches and then waits for the next read: start
        // the GPU on this batch now rather than at the layer's end.
        self.ctx.flush();
        Ok(())
    }

    fn zeros(&self, rows: usize, cols: usize) -> Result<GpuAct> {
        let a = self.alloc(rows, cols);
        // A reused buffer holds old values (a new one wgpu would zero-fill anyway).
        self.ctx.record(|enc| enc.clear_buffer(&a.buf, 0, None));
        Ok(a)
    }
}

/// Every pipeline the engine creates on an adapter of shape `a`, its modules composed with
/// the subgroup reductions (`subgroups`) or the workgroup-memory ones: each kernel module's
/// own list.
pub fn pipeline_variants(a: AdapterShape, subgroups: bool) -> Vec<PipelineVariant> {
    let mut list = VariantList::new(subgroups);
    kernels::elementwise::pipeline_variants(a, &mut list);
    kernels::norm::pipeline_variants(a, &mut list);
    experts::pipeline_variants(a, &mut list);
    kernels::router::pipeline_variants(a, &mut list);
    kernels::mla::pipeline_variants(a, &mut list);
    kernels::kda::pipeline_variants(a, &mut list);
    kernels::matmul::pipeline_variants(a, &mut list);
    list.into_vec()
}

/// The kinds of every pipeline [`pipeline_variants`] lists for an adapter of shape `a`.
pub fn pipeline_kinds(a: AdapterShape, subgroups: bool) -> HashSet<PipelineKind> {
    pipeline_variants(a, subgroups)
        .iter()
        .map(PipelineVariant::kind)
        .collect()
}

#[cfg(test)]
mod pipeline_tests {
    use super::*;
    use device::shaders::Shader;

    #[test]
    fn every_module_and_both_reductions_are_listed() {
        for a in AdapterShape::TYPICAL {
            for subgroups in [false, true] {
                let vs = pipeline_variants(a, subgroups);
                for sh in Shader::ALL {
                    assert!(vs.iter().any(|v| v.shader == sh), "{sh:?} in {a:?}");
                }
                assert!(vs.iter().all(|v| v.subgroups == subgroups));
                // The int4 digits in both kernels, x staged and not, SPECIAL both ways.
                for (sh, entry, name) in [
                    (Shader::MatvecInt4, "dense", "DIGITS"),
                    (Shader::MatvecInt4, "dense_cs", "DIGITS"),
                    (Shader::MatvecInt4, "dense_xs", "XT"),
                    (Shader::MatvecMxfp4, "moe_xs", "XT"),
                    (Shader::MatvecMxfp4, "moe_cs", "SPECIAL"),
                ] {
                    assert!(
                        vs.iter().any(|v| v.shader == sh
                            && v.entry == entry
                            && v.consts.iter().any(|&(k, _)| k == name)),
                        "{sh:?} {entry} {name} in {a:?}"
                    );
                }
                assert!(vs
                    .iter()
                    .any(|v| v.entry == "moe" && v.consts.contains(&("SPECIAL", 0))));
            }
        }
    }
}
