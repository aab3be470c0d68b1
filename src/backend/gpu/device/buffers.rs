//! Device-resident tensors: activations, and the recurrent state of KDA and MLA layers.

use crate::backend::gpu::device::buffer_pool::{BufferPool, Lease};
use crate::backend::{KdaDims, MlaDims};
use std::sync::Arc;

/// A `[rows, cols]` row-major f32 activation in a device buffer.
#[derive(Clone, Debug)]
pub struct GpuAct {
    /// The buffer (at least `rows · cols · 4` bytes).
    pub buf: wgpu::Buffer,
    /// Rows (tokens).
    pub rows: usize,
    /// Row width.
    pub cols: usize,
    /// Where the buffer goes back to for reuse once every clone has dropped (`None`: it is
    /// simply freed).
    pub lease: Option<Arc<Lease>>,
}

impl GpuAct {
    /// This activation with its buffer going back to `pool` once every clone has dropped.
    pub fn leased(self, pool: &Arc<BufferPool>) -> Self {
        Self {
            lease: Some(Lease::new(self.buf.clone(), pool)),
            ..self
        }
    }

    /// Number of values.
    pub fn len(&self) -> usize {
        self.rows * self.cols
    }

    /// Whether it holds no values.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Size of the values in bytes.
    pub fn bytes(&self) -> u64 {
        (self.len() * 4) as u64
    }
}

/// KDA state on the device: `hist_q | hist_k | hist_v` (each `[K-1, P]`) then
/// `S [heads, dk, dk]`, all f32, in one buffer the fused step updates in place.
#[derive(Debug)]
pub struct GpuKdaState {
    /// The state buffer.
    pub buf: wgpu::Buffer,
    /// Shapes it was made for.
    pub dims: KdaDims,
}

impl GpuKdaState {
    /// f32 values in the buffer.
    pub fn values(d: &KdaDims) -> usize {
        3 * (d.conv_k.max(1) - 1) * d.width() + d.heads * d.head_dim * d.head_dim
    }
}

/// MLA latent cache on the device: `[capacity, stride]` rows of normalized latent, rope
/// part and zero padding; it grows (doubling) as positions are appended.
#[derive(Debug)]
pub struct GpuMlaCache {
    /// The cache buffer.
    pub buf: wgpu::Buffer,
    /// Rows the buffer holds.
    pub capacity: usize,
    /// Cached positions.
    pub len: usize,
    /// Row stride in f32 (`kv_lora + rope` rounded up to 4).
    pub stride: usize,
    /// Shapes it was made for.
    pub dims: MlaDims,
}

/// Little-endian bytes of f32 values.
pub(crate) fn f32_bytes(v: &[f32]) -> &[u8] {
    bytemuck::cast_slice(v)
}

/// A `[rows, cols]` activation of the GPU backend: its rows in consecutive parts, each a
/// [`GpuAct`] of one buffer, so a window may hold more rows than one binding of the widest
/// op takes. Every part but the last holds the backend's part rows; rows that fit are one
/// part. The routed experts' accumulator is the exception: it runs as one part of the whole
/// window, and an op that meets it beside an activation in parts cuts it again.
/// Row-independent ops map over the parts, the recurrent ones run them in order.
#[derive(Clone, Debug)]
pub struct GpuRows {
    /// The parts, in row order.
    pub parts: Vec<GpuAct>,
    /// Rows of all the parts together.
    pub rows: usize,
    /// Row width.
    pub cols: usize,
}

impl GpuRows {
    /// One part holding every row.
    pub fn one(act: GpuAct) -> Self {
        Self {
            rows: act.rows,
            cols: act.cols,
            parts: vec![act],
        }
    }

    /// Rows of each part, in order.
    pub fn part_sizes(&self) -> Vec<usize> {
        self.parts.iter().map(|p| p.rows).collect()
    }
}
