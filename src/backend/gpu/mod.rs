//! The GPU backend: every op of the [`Backend`] trait as WGSL kernels through wgpu.
//!
//! Weights are uploaded once; activations, KDA state, conv history and the MLA cache stay
//! on the device. Ops are recorded into one pending command encoder that is submitted
//! only when the host must read: a download (logits, traces) or the router's choices.

mod act_buffers;
pub mod device;
pub mod experts;
pub mod kernels;
mod row_parts;

pub use device::buffers::{GpuAct, GpuKdaState, GpuMlaCache, GpuRows};
pub use device::context::{
    EffectiveLimits, GpuContext, GpuOptions, Int4Decode, LimitsProfile, MatvecShape, ReadStaging,
};
pub use device::pipeline::AdapterShape;
pub use kernels::device_matrix::{GpuFormat, GpuMat};
pub use kernels::matmul::DIGITS_FROM_ROWS;

use super::{
    Backend, ExpertAssignment, Glu, KdaDims, KdaStepInputs, KdaStepWeights, MlaAttnWeights,
    MlaDims, RouterParams,
};

use crate::quant::DenseMatrix;
use crate::routed_expert::Route;
use anyhow::{ensure, Result};
use device::buffer_pool::BufferPool;
use device::pipeline::{PipelineKind, PipelineVariant, VariantList};
use experts::GpuExperts;
use row_parts::{rows_of, whole};
use std::collections::{HashMap, HashSet};
use std::ops::Range;
use std::sync::{Arc, Mutex};

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
    /// Rows of one activation part at most ([`GpuBackend::part_rows`]).
    part_rows: usize,
    /// [`GpuOptions::part_rows`].
    asked_part_rows: Option<usize>,
    /// Each KDA layer's step weights packed into one buffer, by the six weight buffers.
    kda_weights: Mutex<HashMap<[wgpu::Buffer; 6], wgpu::Buffer>>,
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
            part_rows: usize::MAX,
            asked_part_rows: opts.part_rows,
            kda_weights: Mutex::new(HashMap::new()),
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

    fn check_same(a: &GpuAct, b: &GpuAct, op: &str) -> Result<()> {
        super::shape_checks::same_shape(op, (a.rows, a.cols), (b.rows, b.cols))
    }

    /// `f` over each part of `x`, the outputs in the same parts.
    fn map_parts(
        &self,
        x: &GpuRows,
        cols: usize,
        f: impl FnMut(&GpuAct) -> Result<GpuAct>,
    ) -> Result<GpuRows> {
        let parts = x.parts.iter().map(f).collect::<Result<Vec<_>>>()?;
        Ok(rows_of(parts, cols))
    }

    /// `f` over the matching parts of `a` and `b` (one shape, cut alike), for an
    /// element-wise op named `op`.
    fn zip_parts(
        &self,
        a: &GpuRows,
        b: &GpuRows,
        op: &str,
        mut f: impl FnMut(&GpuAct, &GpuAct) -> Result<GpuAct>,
    ) -> Result<GpuRows> {
        super::shape_checks::same_shape(op, (a.rows, a.cols), (b.rows, b.cols))?;
        let (a, b) = (self.uniform(a)?, self.uniform(b)?);
        let parts = a
            .parts
            .iter()
            .zip(&b.parts)
            .map(|(x, y)| f(x, y))
            .collect::<Result<Vec<_>>>()?;
        Ok(rows_of(parts, a.cols))
    }

    /// Waits for all recorded work (benchmarks time with it).
    pub fn sync(&self) -> Result<()> {
        self.ctx.finish()
    }
}

impl Backend for GpuBackend {
    type Act = GpuRows;
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

    fn upload(&self, data: &[f32], rows: usize, cols: usize) -> Result<GpuRows> {
        ensure!(
            data.len() == rows * cols,
            "activation of {rows}x{cols} needs {} values, got {}",
            rows * cols,
            data.len()
        );
        let mut at = 0;
        let parts = self
            .part_sizes(rows)
            .into_iter()
            .map(|n| {
                let part = &data[at * cols..(at + n) * cols];
                at += n;
                GpuAct {
                    buf: self
                        .ctx
                        .buffer_init(bytemuck::cast_slice(part), "activation"),
                    rows: n,
                    cols,
                    lease: None,
                }
            })
            .collect();
        Ok(rows_of(parts, cols))
    }

    fn upload_weight(&self, data: &[f32], rows: usize, cols: usize) -> Result<GpuRows> {
        ensure!(
            data.len() == rows * cols,
            "weight of {rows}x{cols} needs {} values, got {}",
            rows * cols,
            data.len()
        );
        Ok(GpuRows::one(GpuAct {
            buf: self.ctx.buffer_init(bytemuck::cast_slice(data), "weight"),
            rows,
            cols,
            lease: None,
        }))
    }

    fn download(&self, x: &GpuRows) -> Result<Vec<f32>> {
        if let [one] = x.parts.as_slice() {
            return self.ctx.read_f32(&one.buf, 0, one.len());
        }
        let mut out = Vec::with_capacity(x.rows * x.cols);
        for p in &x.parts {
            out.extend(self.ctx.read_f32(&p.buf, 0, p.len())?);
        }
        Ok(out)
    }

    fn download_pieces(&self, x: &GpuRows, lens: &[usize]) -> Result<Vec<Vec<f32>>> {
        match x.parts.as_slice() {
            [one] => self.ctx.read_f32_pieces(&one.buf, one.len(), lens),
            _ => crate::backend::split_pieces(&self.download(x)?, lens),
        }
    }

    fn shape(&self, x: &GpuRows) -> (usize, usize) {
        (x.rows, x.cols)
    }

    fn slice_rows(&self, x: &GpuRows, start: usize, count: usize) -> Result<GpuRows> {
        ensure!(
            start + count <= x.rows,
            "slice_rows: rows {start}..{} of a {}-row activation",
            start + count,
            x.rows
        );
        let out = self.alloc_rows(count, x.cols);
        self.copy_rows(x, start, &out, 0, count)?;
        Ok(out)
    }

    fn concat_rows(&self, parts: &[&GpuRows]) -> Result<GpuRows> {
        let cols =
            crate::backend::shape_checks::concat_rows(parts.iter().map(|a| (a.rows, a.cols)))?;
        let rows: usize = parts.iter().map(|a| a.rows).sum();
        let out = self.alloc_rows(rows, cols);
        let widest = out.parts.first().map_or(0, |p| p.bytes());
        ensure!(
            widest <= self.ctx.max_binding,
            "concat_rows: {rows} rows of {cols} values exceed the adapter's binding limit of {} B",
            self.ctx.max_binding
        );
        let mut at = 0;
        for a in parts {
            self.copy_rows(a, 0, &out, at, a.rows)?;
            at += a.rows;
        }
        Ok(out)
    }

    fn max_rows(&self, row_bytes: usize) -> usize {
        let by_binding = (self.ctx.max_binding / (row_bytes.max(1) as u64)) as usize;
        by_binding
            .min(self.ctx.limits.max_compute_workgroups_per_dimension as usize)
            .max(1)
    }

    fn fit_rows(&mut self, row_bytes: usize) {
        let fit = self.max_rows(row_bytes);
        self.part_rows = self.asked_part_rows.map_or(fit, |r| r.clamp(1, fit));
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

    fn matmul(&self, w: &GpuMat, x: &GpuRows) -> Result<GpuRows> {
        self.map_parts(x, w.rows, |p| self.matmul_op(w, p))
    }

    fn matmul_many(&self, ws: &[&GpuMat], x: &GpuRows) -> Result<Vec<GpuRows>> {
        // by_w[m]: matrix m's output parts, in row order.
        let mut by_w: Vec<Vec<GpuAct>> = ws.iter().map(|_| Vec::new()).collect();
        for p in &x.parts {
            for (outs, y) in by_w.iter_mut().zip(self.matmul_many_op(ws, p)?) {
                outs.push(y);
            }
        }
        Ok(by_w
            .into_iter()
            .zip(ws)
            .map(|(parts, w)| rows_of(parts, w.rows))
            .collect())
    }

    fn rmsnorm(&self, x: &GpuRows, w: &GpuRows, group: usize, eps: f32) -> Result<GpuRows> {
        let w = whole(w, "rmsnorm", "the weight")?;
        self.map_parts(x, x.cols, |p| self.rmsnorm_op(p, w, group, eps))
    }

    fn add(&self, a: &GpuRows, b: &GpuRows) -> Result<GpuRows> {
        self.zip_parts(a, b, "add", |x, y| self.add_op(x, y))
    }

    fn sigmoid_gate(&self, x: &GpuRows, gate: &GpuRows) -> Result<GpuRows> {
        self.zip_parts(x, gate, "sigmoid_gate", |x, g| self.sigmoid_gate_op(x, g))
    }

    fn glu(&self, g: &GpuRows, u: &GpuRows, glu: Glu) -> Result<GpuRows> {
        self.zip_parts(g, u, "glu", |g, u| self.glu_op(g, u, glu))
    }

    fn attn_res_mix(
        &self,
        bank: &[&GpuRows],
        cur: &GpuRows,
        w: &GpuRows,
        eps: f32,
    ) -> Result<GpuRows> {
        let w = whole(w, "attn_res_mix", "the weight")?;
        for e in bank {
            super::shape_checks::same_shape(
                "attn_res_mix",
                (e.rows, e.cols),
                (cur.rows, cur.cols),
            )?;
        }
        let cur = self.uniform(cur)?;
        let bank = bank
            .iter()
            .map(|e| self.uniform(e))
            .collect::<Result<Vec<_>>>()?;
        let parts = (0..cur.parts.len())
            .map(|k| {
                let entries: Vec<&GpuAct> = bank.iter().map(|e| &e.parts[k]).collect();
                self.attn_res_mix_op(&entries, &cur.parts[k], w, eps)
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(rows_of(parts, cur.cols))
    }

    fn kda_step(
        &self,
        dims: &KdaDims,
        w: &KdaStepWeights<GpuRows>,
        state: &mut GpuKdaState,
        inp: KdaStepInputs<'_, GpuRows>,
    ) -> Result<GpuRows> {
        self.kda_step_rows(dims, w, state, inp)
    }

    fn kda_step_pieces(
        &self,
        dims: &KdaDims,
        w: &KdaStepWeights<GpuRows>,
        pieces: &mut [(&mut GpuKdaState, Range<usize>)],
        inp: KdaStepInputs<'_, GpuRows>,
    ) -> Result<Option<GpuRows>> {
        self.kda_step_pieces_rows(dims, w, pieces, inp)
    }

    fn mla_attend(
        &self,
        dims: &MlaDims,
        w: &MlaAttnWeights<GpuRows>,
        cache: &mut GpuMlaCache,
        q: &GpuRows,
        c: &GpuRows,
    ) -> Result<GpuRows> {
        let w = kernels::mla::weights_whole(w)?;
        super::shape_checks::mla_inputs(dims, (q.rows, q.cols), (c.rows, c.cols))?;
        let (q, c) = (self.uniform(q)?, self.uniform(c)?);
        // The parts in row order: each appends its latents to the cache before it attends.
        let parts = q
            .parts
            .iter()
            .zip(&c.parts)
            .map(|(q, c)| self.mla_attend_op(dims, &w, cache, q, c))
            .collect::<Result<Vec<_>>>()?;
        Ok(rows_of(parts, dims.heads * dims.v))
    }

    fn mla_attend_pieces(
        &self,
        dims: &MlaDims,
        w: &MlaAttnWeights<GpuRows>,
        pieces: &mut [(&mut GpuMlaCache, Range<usize>)],
        q: &GpuRows,
        c: &GpuRows,
    ) -> Result<Option<GpuRows>> {
        let w = kernels::mla::weights_whole(w)?;
        let ([q], [c]) = (q.parts.as_slice(), c.parts.as_slice()) else {
            return Ok(None);
        };
        Ok(self
            .mla_attend_pieces_op(dims, &w, pieces, q, c)?
            .map(GpuRows::one))
    }

    fn router_topk(
        &self,
        logits: &GpuRows,
        bias: &[f32],
        params: RouterParams,
    ) -> Result<Vec<Route>> {
        let mut routes = Vec::with_capacity(logits.rows);
        for p in &logits.parts {
            routes.extend(self.router_topk_op(p, bias, params)?);
        }
        // Checked over the whole chunk, so an error names the row among all its rows.
        kernels::router::finite_routes(routes)
    }

    fn router_topk_then(
        &self,
        logits: &GpuRows,
        bias: &[f32],
        params: RouterParams,
        meanwhile: &mut dyn FnMut() -> Result<()>,
    ) -> Result<Vec<Route>> {
        let [part] = logits.parts.as_slice() else {
            return self.router_topk(logits, bias, params);
        };
        let pending = self.router_topk_begin(part, bias, params)?;
        meanwhile()?;
        self.ctx.flush();
        let routes = self.router_topk_finish(pending)?;
        kernels::router::finite_routes(routes)
    }

    fn moe_accumulate(
        &self,
        acc: &mut GpuRows,
        z: &GpuRows,
        experts: &[ExpertAssignment<'_>],
        glu: Glu,
    ) -> Result<()> {
        let op = "moe_accumulate";
        super::shape_checks::moe_accumulator((acc.rows, acc.cols), (z.rows, z.cols))?;
        // The experts' (token, expert) pairs index the whole window: it runs in one buffer.
        // An accumulator in parts becomes one part on the first call and stays so for the
        // layer's later calls (the next op that meets an activation in parts cuts it again),
        // so a window in parts copies `acc` once a layer, not once a batch of experts.
        if !experts.is_empty() {
            let z = self.joined(z, op)?;
            if acc.parts.len() > 1 {
                *acc = GpuRows::one(self.joined(acc, op)?.into_owned());
            }
            if let [one] = acc.parts.as_mut_slice() {
                self.moe_accumulate_op(one, &z, experts, glu)?;
            }
        }
        // Streaming hands experts over in batches and then waits for the next read: start
        // the GPU on this batch now rather than at the layer's end.
        self.ctx.flush();
        Ok(())
    }

    fn zeros(&self, rows: usize, cols: usize) -> Result<GpuRows> {
        let parts = self
            .part_sizes(rows)
            .into_iter()
            .map(|n| self.zeros_one(n, cols))
            .collect();
        Ok(rows_of(parts, cols))
    }

    fn busy_seconds(&self) -> Option<f64> {
        let by_entry = self.ctx.profile_by_entry()?;
        Some(by_entry.values().map(|&(_, secs)| secs).sum())
    }

    fn take_profile(&self) -> Option<String> {
        self.ctx.profile_take()
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
    kernels::matvec_variants::pipeline_variants(a, &mut list);
    list.into_vec()
}

/// The kinds of every pipeline [`pipeline_variants`] lists for an adapter of shape `a`.
pub fn pipeline_kinds(a: AdapterShape, subgroups: bool) -> HashSet<PipelineKind> {
    pipeline_variants(a, subgroups)
        .iter()
        .map(PipelineVariant::kind)
        .collect()
}

/// The kinds of the matrix-unit pipelines (`kernels/matrix_units.rs`) at `sgs` subgroups a
/// workgroup: a device opened with the matrix units adds them to [`pipeline_kinds`]'.
pub fn matrix_unit_kinds(sgs: u32) -> Vec<PipelineKind> {
    kernels::matrix_units::pipeline_variants(sgs)
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
