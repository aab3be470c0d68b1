//! Upload staging lent to the expert readers ([`ReadLender`]). Where a GPU's upload staging
//! is host memory (a discrete GPU without resizable BAR; integrated and CPU-type adapters
//! share memory), copying an expert from its read buffer into wgpu's staging is a second
//! host copy; reading the expert straight into a mapped staging buffer and copying to the
//! device from there removes it.
//!
//! A lent buffer stays mapped while the read fills it. The MoE unmaps it when it records the
//! expert's copies ([`LentStaging::for_device`]), and `moe_accumulate` submits them before it
//! returns. When the expert is dropped the buffer is mapped again; it goes back to the free
//! list once that map completes (the GPU has finished reading it by then).

use crate::platform::aligned_buf::IO_ALIGN;
use crate::routed_expert::{LentRegion, ReadLender};
use std::any::Any;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};

/// Buffers on their way back (unmapped, their map requested) past which `lend` makes no
/// new one: the read goes to host memory instead, so a GPU slower than the disk cannot make
/// the lender grow without bound.
const MAX_REMAPPING: usize = 8;
/// Free buffers kept for the next reads; more are dropped (a smaller host cache, a new
/// source, would otherwise leave their memory held here).
const MAX_FREE: usize = 16;

/// Lends mapped upload buffers to the expert readers.
pub(crate) struct StagingLender {
    device: wgpu::Device,
    pool: Arc<Mutex<Pool>>,
    refused: AtomicBool,
    /// The adapter shares memory with the CPU: the mapped memory is ordinary host RAM, as
    /// fast to read as the engine's own buffers (on a discrete GPU it may be
    /// write-combined), and a loader thread does not poll the device for buffers coming
    /// back.
    unified: bool,
}

/// Buffers not lent out now.
#[derive(Default)]
struct Pool {
    /// Mapped and ready to lend.
    free: Vec<(wgpu::Buffer, wgpu::BufferViewMut)>,
    /// Given back and waiting for their map to complete.
    remapping: usize,
    /// Buffers alive (lent, free or remapping).
    made: usize,
}

fn lock(pool: &Mutex<Pool>) -> MutexGuard<'_, Pool> {
    pool.lock().unwrap_or_else(|e| e.into_inner())
}

impl StagingLender {
    /// A lender of buffers made on `device`; `unified` when the adapter shares memory with
    /// the CPU, so the MoE may scan a lent expert's scale bytes in the mapping as it scans
    /// host bytes.
    pub(crate) fn new(device: wgpu::Device, unified: bool) -> Self {
        Self {
            device,
            pool: Arc::default(),
            refused: AtomicBool::new(false),
            unified,
        }
    }

    /// Buffers alive now (lent, free, or on their way back).
    pub(crate) fn buffers_alive(&self) -> usize {
        lock(&self.pool).made
    }

    fn take_free(&self, size: u64) -> Option<(wgpu::Buffer, wgpu::BufferViewMut)> {
        let mut p = lock(&self.pool);
        let k = p.free.iter().position(|(b, _)| b.size() >= size)?;
        Some(p.free.swap_remove(k))
    }

    fn make(&self, size: u64) -> Option<(wgpu::Buffer, wgpu::BufferViewMut)> {
        let buf = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("expert read staging"),
            size,
            usage: wgpu::BufferUsages::MAP_WRITE | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: true,
        });
        let view = buf.get_mapped_range_mut(..).ok()?;
        lock(&self.pool).made += 1;
        Some((buf, view))
    }
}

impl ReadLender for StagingLender {
    fn lend(&self, len: usize) -> Option<Box<dyn LentRegion>> {
        if self.refused.load(Ordering::Relaxed) {
            return None;
        }
        // Room to start the region on a block boundary wherever the mapping starts; a
        // multiple of 4 bytes, as buffer sizes must be.
        let size = (len + IO_ALIGN).div_ceil(4) as u64 * 4;
        let mut got = self.take_free(size);
        if got.is_none() && lock(&self.pool).remapping > 0 {
            // Let finished maps come back before making another buffer. Not on unified
            // memory: there the poll, inside the loader's read, waits on the device the
            // engine thread submits to and keeps the loader off the disk (docs/tuning.md,
            // the unified pool); the engine's own polls, every MoE layer, bring them back.
            if !self.unified {
                let _ = self.device.poll(wgpu::PollType::Poll);
            }
            got = self.take_free(size);
            if got.is_none() && lock(&self.pool).remapping >= MAX_REMAPPING {
                return None;
            }
        }
        let (buf, mut view) = got.or_else(|| self.make(size))?;
        let lead = view
            .slice(..)
            .as_raw_element_ptr()
            .as_ptr()
            .align_offset(IO_ALIGN);
        // Device copies start on 4-byte offsets; a mapping that is not 4-byte aligned
        // cannot give one (no driver we know maps so).
        if lead % 4 != 0 || lead + len > buf.size() as usize {
            return None;
        }
        Some(Box::new(LentStaging {
            buf,
            view: Mutex::new(Some(view)),
            lead,
            len,
            pool: Arc::downgrade(&self.pool),
            readable: self.unified,
            above: OnceLock::new(),
        }))
    }

    fn refuse(&self, why: &str) {
        if !self.refused.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                "[K3-GPU] reading experts straight into upload staging failed ({why}); reading them into host memory from now on"
            );
        }
    }
}

/// One lent buffer: `len` bytes from `lead` on.
pub(crate) struct LentStaging {
    buf: wgpu::Buffer,
    /// The mapping while the region is the reader's; `None` once the device has it.
    view: Mutex<Option<wgpu::BufferViewMut>>,
    lead: usize,
    len: usize,
    pool: Weak<Mutex<Pool>>,
    /// [`StagingLender::new`]'s `readable`.
    readable: bool,
    /// Whether a byte of the ranges [`LentStaging::any_byte_above`] scanned exceeded its
    /// limit, once scanned.
    above: OnceLock<bool>,
}

impl LentStaging {
    /// Whether any byte in `ranges` (of the region) exceeds `limit`: scanned while the
    /// region is still mapped in readable memory, the answer kept for later calls; `None`
    /// when it cannot be read cheaply (a discrete GPU's mapping, or already handed to the
    /// device unscanned). A region holds one expert, so one answer serves every call.
    pub(crate) fn any_byte_above(&self, ranges: &[Range<u64>], limit: u8) -> Option<bool> {
        if let Some(&a) = self.above.get() {
            return Some(a);
        }
        if !self.readable {
            return None;
        }
        let mut v = self.view.lock().unwrap_or_else(|e| e.into_inner());
        let view = v.as_mut()?;
        let base = view.slice(..).as_raw_element_ptr();
        let mut above = false;
        for r in ranges {
            let (start, end) = (r.start as usize, r.end as usize);
            if start > end || end > self.len {
                return None;
            }
            // SAFETY: the view keeps the buffer mapped while the lock is held, `lend`
            // checked `lead + len` against the mapped size and `end <= len` holds; the
            // region's only writer is the reader, whose `&mut` borrow ended when the read
            // returned the expert, and the bytes are only read here.
            let bytes = unsafe {
                std::slice::from_raw_parts(base.as_ptr().add(self.lead + start), end - start)
            };
            above |= bytes
                .chunks(64)
                .any(|c| c.iter().fold(0u8, |m, &b| m.max(b)) > limit);
        }
        Some(*self.above.get_or_init(|| above))
    }

    /// The buffer, unmapped for the device, and the offset of the region in it. The copies
    /// recorded from it must be submitted before the expert is dropped.
    pub(crate) fn for_device(&self) -> (&wgpu::Buffer, u64) {
        let mut v = self.view.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(view) = v.take() {
            drop(view);
            self.buf.unmap();
        }
        (&self.buf, self.lead as u64)
    }
}

impl LentRegion for LentStaging {
    fn bytes_mut(&mut self) -> &mut [u8] {
        let (lead, len) = (self.lead, self.len);
        let Some(view) = self
            .view
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .as_mut()
        else {
            return &mut [];
        };
        let base = view.slice(..).as_raw_element_ptr();
        // SAFETY: the view keeps the buffer mapped while it lives in `self`, and it lives at
        // least as long as this `&mut self` borrow; `lend` checked `lead + len` against the
        // mapped size; the borrow of `self` is exclusive, so no other reference reaches these
        // bytes. Mapped memory may be write-combined: reads from it are slow but defined.
        unsafe { std::slice::from_raw_parts_mut(base.as_ptr().add(lead), len) }
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

impl Drop for LentStaging {
    fn drop(&mut self) {
        let Some(pool) = self.pool.upgrade() else {
            return;
        };
        let view = self
            .view
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(view) = view {
            // Never handed to the device: still mapped, lend it again as it is.
            give_back(&pool, self.buf.clone(), view);
            return;
        }
        lock(&pool).remapping += 1;
        let (back, buf) = (Arc::downgrade(&pool), self.buf.clone());
        self.buf.map_async(wgpu::MapMode::Write, .., move |r| {
            let Some(pool) = back.upgrade() else {
                return;
            };
            let view = r.ok().and_then(|()| buf.get_mapped_range_mut(..).ok());
            {
                let mut p = lock(&pool);
                p.remapping = p.remapping.saturating_sub(1);
                if view.is_none() {
                    p.made = p.made.saturating_sub(1);
                }
            }
            if let Some(view) = view {
                give_back(&pool, buf, view);
            }
        });
    }
}

/// Puts a mapped buffer on the free list, or drops it when the list is full.
fn give_back(pool: &Mutex<Pool>, buf: wgpu::Buffer, view: wgpu::BufferViewMut) {
    let mut p = lock(pool);
    if p.free.len() < MAX_FREE {
        p.free.push((buf, view));
    } else {
        p.made = p.made.saturating_sub(1);
        drop(p);
        drop(view);
        buf.destroy();
    }
}
