//! A dense matrix on the device: its weight format (the unit of columns its kernels decode
//! at a time) and its row chunks, each bound on its own, under the adapter's binding limit.

use crate::backend::gpu::device::shaders::Shader;

/// Format of a device matrix.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GpuFormat {
    /// f32.
    F32,
    /// bf16.
    Bf16,
    /// int8 per row.
    Int8,
    /// int4 groups of 64.
    Int4,
}

impl GpuFormat {
    /// Columns in one 16-byte unit.
    pub fn unit_cols(self) -> usize {
        match self {
            GpuFormat::F32 => 4,
            GpuFormat::Bf16 => 8,
            GpuFormat::Int8 => 16,
            GpuFormat::Int4 => 32,
        }
    }

    pub(crate) fn shader(self) -> Shader {
        match self {
            GpuFormat::F32 => Shader::MatvecF32,
            GpuFormat::Bf16 => Shader::MatvecBf16,
            GpuFormat::Int8 => Shader::MatvecInt8,
            GpuFormat::Int4 => Shader::MatvecInt4,
        }
    }
}

/// One row chunk of a device matrix.
#[derive(Debug)]
pub struct MatChunk {
    /// First row.
    pub row0: usize,
    /// Rows in the chunk.
    pub rows: usize,
    /// Weight units.
    pub w: wgpu::Buffer,
    /// Per-row (int8) or per-group (int4) scales.
    pub scale: Option<wgpu::Buffer>,
}

/// A dense matrix resident on the device.
#[derive(Debug)]
pub struct GpuMat {
    /// Output dimension.
    pub rows: usize,
    /// Input dimension.
    pub cols: usize,
    /// Row width after padding to whole units.
    pub cols_padded: usize,
    /// Encoding.
    pub format: GpuFormat,
    /// Row chunks, in order.
    pub chunks: Vec<MatChunk>,
}

impl GpuMat {
    /// The matvec parameter block (`MvParams` in matvec_common.wgsl, whose first seven
    /// words matmul_coop.wgsl reads too) of chunk `c` against `n` rows of x: the chunk's
    /// rows, units a row, n, its first row, y's row stride, x's in vec4s, 64-column groups.
    pub fn chunk_params(&self, c: &MatChunk, n: usize) -> [u32; 11] {
        [
            c.rows as u32,
            (self.cols_padded / self.format.unit_cols()) as u32,
            n as u32,
            c.row0 as u32,
            self.rows as u32,
            (self.cols_padded / 4) as u32,
            self.cols.div_ceil(64) as u32,
            0,
            0,
            0,
            0,
        ]
    }

    /// Weight bytes on the device (units and scales).
    pub fn byte_size(&self) -> u64 {
        self.chunks
            .iter()
            .map(|c| c.w.size() + c.scale.as_ref().map_or(0, |s| s.size()))
            .sum()
    }
}
