//! Copying and rewinding a conversation's state on the device: a KDA state is copied whole
//! into a new buffer (in the same submission order as the steps around it), an MLA cache
//! is cut back by its length alone (later appends overwrite the rows past it). For the
//! prompt cache both are read back to host values and written from them, the MLA rows
//! without their padding.

use crate::backend::gpu::device::buffers::{f32_bytes, GpuKdaState, GpuMlaCache};
use crate::backend::gpu::GpuBackend;
use crate::backend::{KdaDims, MlaDims};
use anyhow::{ensure, Result};

impl GpuBackend {
    pub(in crate::backend::gpu) fn kda_state_copy_op(
        &self,
        s: &GpuKdaState,
    ) -> Result<GpuKdaState> {
        let bytes = (GpuKdaState::values(&s.dims) * 4) as u64;
        let buf = self.ctx.buffer(bytes, "kda state");
        self.ctx.copy(&s.buf, 0, &buf, 0, bytes);
        Ok(GpuKdaState { buf, dims: s.dims })
    }

    pub(in crate::backend::gpu) fn mla_truncate_op(
        &self,
        c: &mut GpuMlaCache,
        len: usize,
    ) -> Result<()> {
        ensure!(
            len <= c.len,
            "mla_truncate: cannot keep {len} positions of a cache that holds {}",
            c.len
        );
        c.len = len;
        Ok(())
    }

    pub(in crate::backend::gpu) fn kda_state_read_op(&self, s: &GpuKdaState) -> Result<Vec<f32>> {
        let bytes = (GpuKdaState::values(&s.dims) * 4) as u64;
        let raw = self.ctx.read(&s.buf, 0, bytes)?;
        Ok(bytemuck::pod_collect_to_vec(&raw))
    }

    pub(in crate::backend::gpu) fn kda_state_write_op(
        &self,
        d: &KdaDims,
        values: &[f32],
    ) -> Result<GpuKdaState> {
        let n = GpuKdaState::values(d);
        ensure!(
            values.len() == n,
            "kda_state_write: {} values for a state of {n}",
            values.len()
        );
        let s = self.kda_state_op(d)?;
        self.ctx.write(&s.buf, 0, f32_bytes(values));
        Ok(s)
    }

    pub(in crate::backend::gpu) fn mla_cache_read_op(&self, c: &GpuMlaCache) -> Result<Vec<f32>> {
        let row = c.dims.cache_row();
        let raw = self.ctx.read(&c.buf, 0, (c.len * c.stride * 4) as u64)?;
        let padded: Vec<f32> = bytemuck::pod_collect_to_vec(&raw);
        let mut v = Vec::with_capacity(c.len * row);
        for p in padded.chunks_exact(c.stride).take(c.len) {
            v.extend_from_slice(&p[..row]);
        }
        Ok(v)
    }

    pub(in crate::backend::gpu) fn mla_cache_write_op(
        &self,
        d: &MlaDims,
        values: &[f32],
    ) -> Result<GpuMlaCache> {
        let (row, len) = (d.cache_row(), d.cache_positions(values)?);
        let mut c = self.mla_cache_op(d)?;
        self.grow(&mut c, len)?;
        let mut padded = vec![0.0f32; len * c.stride];
        for (dst, src) in padded
            .chunks_exact_mut(c.stride)
            .zip(values.chunks_exact(row))
        {
            dst[..row].copy_from_slice(src);
        }
        self.ctx.write(&c.buf, 0, f32_bytes(&padded));
        c.len = len;
        Ok(c)
    }
}
