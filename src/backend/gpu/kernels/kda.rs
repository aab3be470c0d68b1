//! The KDA step on the device, the state updated in place: a token or a few in one fused
//! dispatch (a workgroup per head), chunks in three (conv and decays, the state columns of
//! each head over several workgroups, the gated norm).

use crate::backend::gpu::device::buffers::{GpuAct, GpuKdaState};
use crate::backend::gpu::device::context::Dispatch;
use crate::backend::gpu::device::pipeline::{AdapterShape, VariantList};
use crate::backend::gpu::device::shaders::Shader;
use crate::backend::gpu::GpuBackend;
use crate::backend::{KdaDims, KdaStepInputs, KdaStepWeights};
use anyhow::{ensure, Result};

/// Epsilon of the per-head l2 normalization of q and k (docs/model.md, "KDA layer"); the same
/// value as the CPU oracle's `KDA_L2_EPS`.
const KDA_L2_EPS: f32 = 1e-6;

/// Tokens from which a call runs the three passes rather than the fused kernel: one token is
/// cheaper fused, while a chunk's tokens each cost about the one-token time there and far
/// less in passes (docs/perf.md#kernels).
const PASSES_FROM_TOKENS: usize = 4;

/// Widest head the kernel's workgroup arrays hold.
pub(crate) const MAX_HEAD_DIM: usize = 256;

impl GpuBackend {
    pub(in crate::backend::gpu) fn kda_state_op(&self, d: &KdaDims) -> Result<GpuKdaState> {
        ensure!(d.conv_k >= 1, "kda: conv kernel width must be at least 1");
        ensure!(
            d.head_dim <= MAX_HEAD_DIM,
            "kda: head_dim {} exceeds the GPU kernel's {MAX_HEAD_DIM}",
            d.head_dim
        );
        let bytes = (GpuKdaState::values(d) * 4) as u64;
        let buf = self.ctx.buffer(bytes, "kda state");
        // Fresh buffers are zeroed by wgpu, which is exactly the initial state.
        Ok(GpuKdaState { buf, dims: *d })
    }

    pub(in crate::backend::gpu) fn kda_step_op(
        &self,
        d: &KdaDims,
        w: &KdaStepWeights<GpuAct>,
        st: &mut GpuKdaState,
        inp: KdaStepInputs<'_, GpuAct>,
    ) -> Result<GpuAct> {
        ensure!(
            st.dims == *d,
            "kda_step: state was made for {:?}, called with {:?}",
            st.dims,
            d
        );
        let (p, k, h) = (d.width(), d.conv_k, d.heads);
        let n = inp.q.rows;
        crate::backend::shape_checks::kda_inputs(
            d,
            [inp.q, inp.k, inp.v, inp.f, inp.beta, inp.gate].map(|a| (a.rows, a.cols)),
        )?;
        ensure!(
            w.conv_q.len() == p * k
                && w.conv_k.len() == p * k
                && w.conv_v.len() == p * k
                && w.a_log.len() >= h
                && w.dt_bias.len() == p
                && w.o_norm.len() == d.head_dim,
            "kda_step: conv/A_log/dt_bias/o_norm sizes do not match {h} heads x {}",
            d.head_dim
        );
        ensure!(
            n <= self.ctx.limits.max_compute_workgroups_per_dimension as usize,
            "kda_step: a chunk of {n} tokens exceeds the adapter's {} workgroups per dimension; use a smaller --chunk",
            self.ctx.limits.max_compute_workgroups_per_dimension
        );
        let out = self.alloc(n, p);
        if n == 0 {
            return Ok(out);
        }
        // Pack inputs and weights into one binding each (a kernel may have only a few).
        let np = (n * p * 4) as u64;
        let inbuf = self.ctx.buffer(5 * np + (n * h * 4) as u64, "kda inputs");
        for (i, a) in [inp.q, inp.k, inp.v, inp.f, inp.gate]
            .into_iter()
            .enumerate()
        {
            self.ctx.copy(&a.buf, 0, &inbuf, np * i as u64, np);
        }
        self.ctx
            .copy(&inp.beta.buf, 0, &inbuf, 5 * np, (n * h * 4) as u64);
        let pk = (p * k * 4) as u64;
        let (hb, pb, db) = ((h * 4) as u64, (p * 4) as u64, (d.head_dim * 4) as u64);
        let wbuf = self.ctx.buffer(3 * pk + hb + pb + db, "kda weights");
        self.ctx.copy(&w.conv_q.buf, 0, &wbuf, 0, pk);
        self.ctx.copy(&w.conv_k.buf, 0, &wbuf, pk, pk);
        self.ctx.copy(&w.conv_v.buf, 0, &wbuf, 2 * pk, pk);
        self.ctx.copy(&w.a_log.buf, 0, &wbuf, 3 * pk, hb);
        self.ctx.copy(&w.dt_bias.buf, 0, &wbuf, 3 * pk + hb, pb);
        self.ctx.copy(&w.o_norm.buf, 0, &wbuf, 3 * pk + hb + pb, db);
        let params = [
            n as u32,
            h as u32,
            d.head_dim as u32,
            k as u32,
            u32::from(d.lower_bound.is_some()),
            d.lower_bound.unwrap_or(0.0).to_bits(),
            d.norm_eps.to_bits(),
            KDA_L2_EPS.to_bits(),
        ];
        let wg = self.ctx.wg;
        if n < PASSES_FROM_TOKENS {
            let fused_wg = head_lanes(wg, d.head_dim);
            self.ctx.dispatch(&Dispatch {
                shader: Shader::KdaStep,
                entry: "kda_fused",
                consts: &[("WG", fused_wg)],
                params: &params,
                buffers: &[&inbuf, &wbuf, &st.buf, &out.buf],
                groups: (h as u32, 1, 1),
            });
            return Ok(out);
        }
        let mid = self.ctx.buffer(4 * np, "kda conv outputs and decays");
        // Each pass binds what its entry point uses (bindings as in kda_step.wgsl).
        self.ctx.dispatch_at(
            &Dispatch {
                shader: Shader::KdaStep,
                entry: "kda_conv",
                consts: &[],
                params: &params,
                buffers: &[&inbuf, &wbuf, &st.buf, &mid],
                groups: self.ctx.grid((4 * p as u32).div_ceil(wg)),
            },
            [1, 2, 3, 5],
        );
        let cg = state_columns_per_group(d.head_dim, wg);
        self.ctx.dispatch_at(
            &Dispatch {
                shader: Shader::KdaStep,
                entry: "kda_state",
                consts: &[("CG", cg)],
                params: &params,
                buffers: &[&inbuf, &st.buf, &out.buf, &mid],
                groups: (h as u32, (d.head_dim as u32).div_ceil(cg), 1),
            },
            [1, 3, 4, 5],
        );
        let norm_wg = head_lanes(wg, d.head_dim);
        self.ctx.dispatch_at(
            &Dispatch {
                shader: Shader::KdaStep,
                entry: "kda_norm",
                consts: &[("WG", norm_wg)],
                params: &params,
                buffers: &[&inbuf, &wbuf, &out.buf],
                groups: (n as u32, h as u32, 1),
            },
            [1, 2, 4],
        );
        Ok(out)
    }
}

/// The workgroup of the fused kernel and of the gated norm over heads of `head_dim`: one
/// lane per state or output column (at least a 32-lane block), as a wider one would idle.
pub(in crate::backend::gpu) fn head_lanes(wg: u32, head_dim: usize) -> u32 {
    wg.min((head_dim as u32).next_power_of_two().max(32))
}

/// State columns one `kda_state` workgroup of `wg` lanes updates: an eighth of the head (16
/// of K3's 128, so 8 workgroups a head), a power of two within the workgroup.
pub(in crate::backend::gpu) fn state_columns_per_group(head_dim: usize, wg: u32) -> u32 {
    ((head_dim as u32 / 8).max(1).next_power_of_two()).min(wg)
}

/// Head widths of the KDA kernels: the smallest, K3's and the widest the kernel holds.
const KDA_HEAD_DIMS: [usize; 3] = [4, 128, MAX_HEAD_DIM];

/// The KDA kernels' pipelines at every head width whose overrides differ.
pub(crate) fn pipeline_variants(a: AdapterShape, list: &mut VariantList) {
    for hd in KDA_HEAD_DIMS {
        let lanes = head_lanes(a.wg, hd);
        list.push(Shader::KdaStep, "kda_fused", vec![("WG", lanes)]);
        list.push(Shader::KdaStep, "kda_conv", Vec::new());
        let cg = state_columns_per_group(hd, a.wg);
        list.push(Shader::KdaStep, "kda_state", vec![("CG", cg)]);
        list.push(Shader::KdaStep, "kda_norm", vec![("WG", lanes)]);
    }
}

#[cfg(test)]
mod tests {
    use super::state_columns_per_group;

    #[test]
    fn a_head_spreads_over_eight_workgroups() {
        assert_eq!(state_columns_per_group(128, 256), 16);
        assert_eq!(state_columns_per_group(16, 256), 2);
        assert_eq!(state_columns_per_group(100, 256), 16);
        assert_eq!(state_columns_per_group(4, 64), 1);
        assert_eq!(state_columns_per_group(4096, 64), 64);
    }
}
