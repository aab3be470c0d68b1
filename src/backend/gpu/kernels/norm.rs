//! RMSNorm (grouped) and the block attention-residual mix.

use crate::backend::gpu::device::buffers::GpuAct;
use crate::backend::gpu::device::context::Dispatch;
use crate::backend::gpu::device::pipeline::{AdapterShape, VariantList};
use crate::backend::gpu::device::shaders::Shader;
use crate::backend::gpu::GpuBackend;
use anyhow::{ensure, Result};

/// Entries (bank + current) the mix kernel's workgroup array holds.
pub(crate) const MAX_MIX_ENTRIES: usize = 64;

impl GpuBackend {
    pub(in crate::backend::gpu) fn rmsnorm_op(
        &self,
        x: &GpuAct,
        w: &GpuAct,
        group: usize,
        eps: f32,
    ) -> Result<GpuAct> {
        ensure!(
            group > 0 && x.cols % group == 0 && w.len() == group,
            "rmsnorm: row width {} is not a multiple of group {group}, or weight has {} values",
            x.cols,
            w.len()
        );
        let out = self.alloc(x.rows, x.cols);
        let groups = x.len() / group;
        if groups > 0 {
            self.ctx.dispatch(&Dispatch {
                shader: Shader::RmsNorm,
                entry: "rmsnorm",
                consts: &[],
                params: &[groups as u32, group as u32, eps.to_bits()],
                buffers: &[&x.buf, &w.buf, &out.buf],
                groups: self.ctx.grid(groups as u32),
            });
        }
        Ok(out)
    }

    pub(in crate::backend::gpu) fn attn_res_mix_op(
        &self,
        bank: &[&GpuAct],
        cur: &GpuAct,
        w: &GpuAct,
        eps: f32,
    ) -> Result<GpuAct> {
        ensure!(
            w.len() == cur.cols,
            "attn_res_mix: weight has {} values for rows of {}",
            w.len(),
            cur.cols
        );
        for b in bank {
            Self::check_same(b, cur, "attn_res_mix")?;
        }
        let entries = bank.len() + 1;
        ensure!(
            entries <= MAX_MIX_ENTRIES,
            "attn_res_mix: {entries} entries, the GPU kernel holds at most {MAX_MIX_ENTRIES}"
        );
        let rows = cur.rows as u32;
        ensure!(
            rows <= self.ctx.limits.max_compute_workgroups_per_dimension,
            "attn_res_mix: {rows} rows in one call; the adapter runs at most {} (a smaller prefill chunk, K3_CHUNK, fits)",
            self.ctx.limits.max_compute_workgroups_per_dimension
        );
        let out = self.alloc(cur.rows, cur.cols);
        if cur.is_empty() {
            return Ok(out);
        }
        // The entries are packed [entries, rows, cols] with device copies: one binding.
        let packed = self.scratch(cur.bytes() * entries as u64, "attn_res entries");
        let packed = &packed.buf;
        for (i, e) in bank.iter().copied().chain([cur]).enumerate() {
            self.ctx
                .copy(&e.buf, 0, packed, cur.bytes() * i as u64, cur.bytes());
        }
        let scores = self.alloc(cur.rows, entries);
        let params = [entries as u32, rows, cur.cols as u32, eps.to_bits()];
        // One workgroup per (entry, row) for the scores, then the columns over workgroups:
        // one workgroup for a decode row's whole mix took 20 times an element-wise pass.
        self.ctx.dispatch_at(
            &Dispatch {
                shader: Shader::AttnResMix,
                entry: "scores",
                consts: &[],
                params: &params,
                buffers: &[packed, &w.buf, &scores.buf],
                groups: (entries as u32, rows, 1),
            },
            [1, 2, 4],
        );
        self.ctx.dispatch_at(
            &Dispatch {
                shader: Shader::AttnResMix,
                entry: "mix",
                consts: &[],
                params: &params,
                buffers: &[packed, &out.buf, &scores.buf],
                groups: ((cur.cols as u32).div_ceil(self.ctx.wg), rows, 1),
            },
            [1, 3, 4],
        );
        Ok(out)
    }
}

/// The pipelines of the RMSNorm and attention-residual kernels.
pub(crate) fn pipeline_variants(_a: AdapterShape, list: &mut VariantList) {
    list.push(Shader::RmsNorm, "rmsnorm", Vec::new());
    for entry in ["scores", "mix"] {
        list.push(Shader::AttnResMix, entry, Vec::new());
    }
}
