//! Copying and rewinding a conversation's state on the device: a KDA state is copied whole
//! into a new buffer (in the same submission order as the steps around it), an MLA cache
//! is cut back by its length alone (later appends overwrite the rows past it).

use super::buffers::{GpuKdaState, GpuMlaCache};
use super::GpuBackend;
use anyhow::{ensure, Result};

impl GpuBackend {
    pub(super) fn kda_state_copy_op(&self, s: &GpuKdaState) -> Result<GpuKdaState> {
        let bytes = (GpuKdaState::values(&s.dims) * 4) as u64;
        let buf = self.ctx.buffer(bytes, "kda state");
        self.ctx.copy(&s.buf, 0, &buf, 0, bytes);
        Ok(GpuKdaState { buf, dims: s.dims })
    }

    pub(super) fn mla_truncate_op(&self, c: &mut GpuMlaCache, len: usize) -> Result<()> {
        ensure!(
            len <= c.len,
            "mla_truncate: cannot keep {len} positions of a cache that holds {}",
            c.len
        );
        c.len = len;
        Ok(())
    }
}
