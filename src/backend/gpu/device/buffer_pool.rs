//! Activation buffers handed back when their last handle drops, and handed out again to
//! the next activation of the same size. wgpu zero-fills every new buffer before the first
//! pass that binds it (its lazy initialization: a fill command and a barrier), and a
//! decode step makes a few hundred activations; a reused buffer is already initialized,
//! so the pass that overwrites it runs without that fill. Every kernel writes each element
//! of the activations it makes, so what a reused buffer held is never read; `zeros` clears
//! its buffer explicitly.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};

/// Bytes the pool keeps at most; buffers beyond it are freed.
const MAX_POOLED_BYTES: u64 = 1 << 30;

/// Free buffers by size.
#[derive(Default)]
pub struct BufferPool {
    free: Mutex<Free>,
}

#[derive(Default)]
struct Free {
    by_size: HashMap<u64, Vec<wgpu::Buffer>>,
    bytes: u64,
}

impl BufferPool {
    /// A free buffer of exactly `size` bytes, if one was handed back.
    pub fn take(&self, size: u64) -> Option<wgpu::Buffer> {
        let mut f = self.free.lock().unwrap_or_else(|e| e.into_inner());
        let b = f.by_size.get_mut(&size)?.pop()?;
        f.bytes -= size;
        Some(b)
    }

    /// Takes `buf` back for reuse (or lets it go when the pool is full).
    fn put(&self, buf: wgpu::Buffer) {
        let mut f = self.free.lock().unwrap_or_else(|e| e.into_inner());
        let size = buf.size();
        if f.bytes + size <= MAX_POOLED_BYTES {
            f.bytes += size;
            f.by_size.entry(size).or_default().push(buf);
        }
    }

    /// Bytes held for reuse now.
    pub fn pooled_bytes(&self) -> u64 {
        self.free.lock().unwrap_or_else(|e| e.into_inner()).bytes
    }
}

/// A pooled buffer's claim: shared by every clone of the activation that holds it, it
/// gives the buffer back when the last one drops.
#[derive(Debug)]
pub struct Lease {
    buf: wgpu::Buffer,
    pool: Weak<BufferPool>,
}

impl Lease {
    /// A claim on `buf` that returns it to `pool`.
    pub fn new(buf: wgpu::Buffer, pool: &Arc<BufferPool>) -> Arc<Self> {
        Arc::new(Self {
            buf,
            pool: Arc::downgrade(pool),
        })
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if let Some(p) = self.pool.upgrade() {
            p.put(self.buf.clone());
        }
    }
}

impl std::fmt::Debug for BufferPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "BufferPool({} B)", self.pooled_bytes())
    }
}
