//! Dense matmuls of a few rows on the GPU's matrix units (matmul_coop.wgsl): int4 and int8
//! matrices against 2 to 8 rows of x, each weight decoded once for every row and the rows'
//! multiply-adds on the matrix units. They run where the device was opened with them
//! ([`GpuContext::matrix_units`]): an adapter whose matrix units take 16x16x16 f16 products
//! into f32 in 32-lane subgroups (docs/perf.md#what-3x-and-5x-ask-of-the-gpu).

use crate::backend::gpu::device::buffers::GpuAct;
use crate::backend::gpu::device::context::{Dispatch, GpuContext};
use crate::backend::gpu::device::pipeline::PipelineVariant;
use crate::backend::gpu::device::shaders::Shader;
use crate::backend::gpu::kernels::device_matrix::{GpuFormat, GpuMat};
use crate::backend::gpu::GpuBackend;
use anyhow::{bail, Result};

/// The most rows of x the kernels take: B's 16 columns hold each row's two f16 parts.
pub(crate) const MATRIX_UNIT_ROWS_MAX: usize = 8;

/// Subgroups a workgroup the kernels may be built with (16 weight rows each; the decoded
/// tile of 64 rows fills the module's workgroup array).
pub const SUBGROUP_COUNTS: [u32; 3] = [1, 2, 4];

/// The subgroups a workgroup where no setting picks them.
#[cfg(feature = "lab")]
pub(crate) const DEFAULT_SUBGROUPS: u32 = 4;

/// Columns a step of the kernels walks (and B's rows come in).
const STEP_COLS: usize = 64;

/// The kernel entry of `format` on the matrix units, if it has one.
fn entry_of(format: GpuFormat) -> Option<&'static str> {
    match format {
        GpuFormat::Int4 => Some("coop_int4"),
        GpuFormat::Int8 => Some("coop_int8"),
        GpuFormat::F32 | GpuFormat::Bf16 => None,
    }
}

/// Every pipeline of the matrix-unit kernels, at `sgs` subgroups a workgroup.
pub fn pipeline_variants(sgs: u32) -> Vec<PipelineVariant> {
    let variant = |entry: &'static str, consts: Vec<(&'static str, u32)>| PipelineVariant {
        shader: Shader::MatmulCoop,
        entry,
        consts,
        subgroups: false,
    };
    vec![
        variant("coop_int4", vec![("SGS", sgs)]),
        variant("coop_int8", vec![("SGS", sgs)]),
        variant("x_halves", Vec::new()),
    ]
}

/// Whether a matmul of `rows` rows of x against `w` takes the matrix units on `ctx`.
pub(crate) fn takes_matrix_units(ctx: &GpuContext, w: &GpuMat, rows: usize) -> bool {
    ctx.matrix_units.is_some()
        && entry_of(w.format).is_some()
        && (2..=MATRIX_UNIT_ROWS_MAX).contains(&rows)
}

/// B and the rows' powers of two, as `x_halves` makes them.
#[derive(Clone)]
pub(crate) struct XHalves {
    /// 64 · steps rows of 16 f16.
    b: GpuAct,
    /// 2^-s_t for each row of x.
    down: GpuAct,
}

impl GpuBackend {
    /// x (`rows` rows of `cols_padded` f32, padded) as the matrix units take it: B's high
    /// and low f16 parts of every row over `steps` steps of 64 columns, and 2^-s_t.
    pub(crate) fn x_halves(&self, x: &wgpu::Buffer, rows: usize, cols_padded: usize) -> XHalves {
        let steps = cols_padded.div_ceil(STEP_COLS);
        // 16 f16 a column of B: 8 f32 words.
        let b = self.alloc(1, steps * STEP_COLS * 8);
        let down = self.alloc(1, MATRIX_UNIT_ROWS_MAX);
        let mut params = [0u32; 7];
        params[2] = rows as u32;
        params[5] = (cols_padded / 4) as u32;
        params[6] = steps as u32;
        self.ctx.dispatch_at(
            &Dispatch {
                shader: Shader::MatmulCoop,
                entry: "x_halves",
                consts: &[],
                params: &params,
                buffers: &[x, &b.buf, &down.buf],
                groups: (MATRIX_UNIT_ROWS_MAX as u32, 1, 1),
            },
            [6, 7, 8],
        );
        XHalves { b, down }
    }

    /// y (already allocated, `rows` rows of w's rows) = x · wᵀ on the matrix units, for
    /// each of w's row chunks; an error where w's format has no matrix-unit kernel or the
    /// device was opened without them (the caller asks [`takes_matrix_units`] first).
    pub(crate) fn matmul_matrix_units(
        &self,
        w: &GpuMat,
        xh: &XHalves,
        y: &wgpu::Buffer,
        rows: usize,
    ) -> Result<()> {
        let (Some(entry), Some(sgs)) = (entry_of(w.format), self.ctx.matrix_units) else {
            bail!(
                "a {:?} matmul on the matrix units, which this device lacks or that format has no kernel for",
                w.format
            );
        };
        let consts = [("SGS", sgs)];
        for c in &w.chunks {
            let params = w.chunk_params(c, rows);
            let Some(scale) = &c.scale else {
                bail!(
                    "the {:?} matrix's chunk at row {} has no scales",
                    w.format,
                    c.row0
                );
            };
            self.ctx.dispatch(&Dispatch {
                shader: Shader::MatmulCoop,
                entry,
                consts: &consts,
                params: &params,
                buffers: &[&xh.b.buf, y, &c.w, scale, &xh.down.buf],
                groups: ((c.rows as u32).div_ceil(16 * sgs), 1, 1),
            });
        }
        Ok(())
    }
}
