//! Elementwise kernels: add, sigmoid gate, the GLUs, zero-padded row copies.

use crate::backend::gpu::device::buffers::GpuAct;
use crate::backend::gpu::device::context::Dispatch;
use crate::backend::gpu::device::pipeline::{AdapterShape, VariantList};
use crate::backend::gpu::device::shaders::Shader;
use crate::backend::gpu::GpuBackend;
use crate::backend::Glu;
use anyhow::Result;

impl GpuBackend {
    fn flat_groups(&self, n: usize) -> (u32, u32, u32) {
        self.ctx.grid((n as u32).div_ceil(self.ctx.wg))
    }

    fn zip(&self, entry: &'static str, a: &GpuAct, b: &GpuAct) -> Result<GpuAct> {
        Self::check_same(a, b, entry)?;
        let out = self.alloc(a.rows, a.cols);
        if !a.is_empty() {
            self.ctx.dispatch(&Dispatch {
                shader: Shader::Elementwise,
                entry,
                consts: &[],
                params: &[a.len() as u32],
                buffers: &[&a.buf, &b.buf, &out.buf],
                groups: self.flat_groups(a.len()),
            });
        }
        Ok(out)
    }

    pub(in crate::backend::gpu) fn add_op(&self, a: &GpuAct, b: &GpuAct) -> Result<GpuAct> {
        self.zip("add", a, b)
    }

    pub(in crate::backend::gpu) fn sigmoid_gate_op(
        &self,
        x: &GpuAct,
        g: &GpuAct,
    ) -> Result<GpuAct> {
        self.zip("sigmoid_gate", x, g)
    }

    pub(in crate::backend::gpu) fn glu_op(
        &self,
        g: &GpuAct,
        u: &GpuAct,
        glu: Glu,
    ) -> Result<GpuAct> {
        Self::check_same(g, u, "glu")?;
        let out = self.alloc(g.rows, g.cols);
        let c = g.cols as u32;
        self.glu_strided(&g.buf, &u.buf, &out, glu, (c, c, 0));
        Ok(out)
    }

    /// `out[r, c] = glu(g[r·gs + c], u[r·us + uo + c])` for `(gs, us, uo) = strides`.
    pub(in crate::backend::gpu) fn glu_strided(
        &self,
        g: &wgpu::Buffer,
        u: &wgpu::Buffer,
        out: &GpuAct,
        glu: Glu,
        strides: (u32, u32, u32),
    ) {
        if out.is_empty() {
            return;
        }
        let (entry, beta, lbeta) = match glu {
            Glu::Situ { beta, linear_beta } => ("situ", beta, linear_beta),
            Glu::Silu => ("silu", 1.0, 1.0),
        };
        self.ctx.dispatch(&Dispatch {
            shader: Shader::Glu,
            entry,
            consts: &[],
            params: &[
                out.len() as u32,
                out.cols as u32,
                beta.to_bits(),
                lbeta.to_bits(),
                strides.0,
                strides.1,
                strides.2,
            ],
            buffers: &[g, u, &out.buf],
            groups: self.flat_groups(out.len()),
        });
    }

    /// `x` with each row widened to `cols_out` by zero columns (returned as is if equal).
    pub(in crate::backend::gpu) fn padded(&self, x: &GpuAct, cols_out: usize) -> GpuAct {
        if cols_out == x.cols {
            return x.clone();
        }
        let out = self.alloc(x.rows, cols_out);
        if !out.is_empty() {
            self.ctx.dispatch(&Dispatch {
                shader: Shader::PadRows,
                entry: "pad",
                consts: &[],
                params: &[out.len() as u32, x.cols as u32, cols_out as u32],
                buffers: &[&x.buf, &out.buf],
                groups: self.flat_groups(out.len()),
            });
        }
        out
    }
}

/// The pipelines of the elementwise, row-padding and GLU kernels.
pub(crate) fn pipeline_variants(_a: AdapterShape, list: &mut VariantList) {
    for entry in ["add", "sigmoid_gate"] {
        list.push(Shader::Elementwise, entry, Vec::new());
    }
    list.push(Shader::PadRows, "pad", Vec::new());
    for entry in ["situ", "silu"] {
        list.push(Shader::Glu, entry, Vec::new());
    }
}
