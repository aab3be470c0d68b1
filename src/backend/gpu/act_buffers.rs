//! Where an op's output and intermediate buffers come from: activation buffers handed back
//! to the pool are handed out again (by exact size for activations, by size class for an
//! op's scratch), so a decode step allocates nothing and wgpu zero-fills nothing.

use super::device::context::storage_size;
use super::GpuBackend;
use crate::backend::gpu::GpuAct;
use anyhow::Result;

impl GpuBackend {
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
            return Ok((self.zeros_one(n, rows), false));
        }
        Ok((self.alloc(n, rows), n > 0 && rows > 0))
    }

    /// A `[rows, cols]` activation for a kernel to write every element of: a buffer handed
    /// back by an earlier activation of the same size when there is one (its old values
    /// still in it), else a new one.
    pub fn alloc(&self, rows: usize, cols: usize) -> GpuAct {
        let size = storage_size((rows * cols * 4) as u64);
        GpuAct {
            lease: None,
            buf: self.pooled(size, "activation"),
            rows,
            cols,
        }
        .leased(&self.pool)
    }

    /// A buffer of at least `bytes` for one op's intermediate values, which its kernels
    /// write before they read them: from the pool by size class, so one whose size grows a
    /// little every step (the MLA scores over the context) still finds a buffer to reuse.
    /// A new buffer costs the host an allocation and the GPU wgpu's zero fill.
    pub(crate) fn scratch(&self, bytes: u64, label: &str) -> GpuAct {
        let words = bytes.div_ceil(4) as usize;
        GpuAct {
            lease: None,
            buf: self.pooled(scratch_class(bytes), label),
            rows: 1,
            cols: words,
        }
        .leased(&self.pool)
    }

    /// A free pooled buffer of exactly `size` bytes (NaN-filled under `poison_reused`), else
    /// a new one.
    fn pooled(&self, size: u64, label: &str) -> wgpu::Buffer {
        let Some(b) = self.pool.take(size) else {
            return self.ctx.buffer(size, label);
        };
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

    /// A `[rows, cols]` activation of zeros in one buffer.
    pub(crate) fn zeros_one(&self, rows: usize, cols: usize) -> GpuAct {
        let a = self.alloc(rows, cols);
        // A reused buffer holds old values (a new one wgpu would zero-fill anyway).
        self.ctx.record(|enc| enc.clear_buffer(&a.buf, 0, None));
        a
    }
}

/// The pooled size a scratch request of `bytes` takes: powers of two up to 4 KiB, then
/// sixteenths of the next power of two (less than an eighth more than asked).
fn scratch_class(bytes: u64) -> u64 {
    let b = storage_size(bytes);
    if b <= 4096 {
        return b.next_power_of_two();
    }
    let step = b.next_power_of_two() / 16;
    b.div_ceil(step) * step
}

#[cfg(test)]
mod tests {
    use super::scratch_class;

    #[test]
    fn scratch_classes_round_up_by_at_most_an_eighth() {
        assert_eq!(scratch_class(1), 16);
        assert_eq!(scratch_class(100), 128);
        assert_eq!(scratch_class(4096), 4096);
        assert_eq!(scratch_class(4100), 4608);
        assert_eq!(scratch_class(8000), 8192);
        for bytes in [5000u64, 65_537, 1 << 20, 3_000_001] {
            let c = scratch_class(bytes);
            assert!(c >= bytes && c - bytes < bytes / 8 + 16, "{bytes} -> {c}");
            assert_eq!(scratch_class(c), c, "a class is its own class");
        }
    }
}
