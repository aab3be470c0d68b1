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

use crate::experts::aligned_buf::IO_ALIGN;
use crate::experts::{LentRegion, ReadLender};
use std::any::Any;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

/// Buffers on their way back (unmapped, their map requested) past which `lend` makes no
/// new one: the read goes to host memory instead, so a GPU slower than the disk cannot make
/// the lender grow without bound.
const MAX_REMAPPING: usize = 8;
/// Free buffers kept for the next reads; more are dropped (a smaller host cache, a new
/// source, would otherwise leave their memory held here).
const MAX_FREE: usize = 16;

/// Lends mapped upload buffers to the expert readers.
pub struct StagingLender {
    device: wgpu::Device,
    pool: Arc<Mutex<Pool>>,
    refused: AtomicBool,
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
    /// A lender of buffers made on `device`.
    pub fn new(device: wgpu::Device) -> Self {
        Self {
            device,
            pool: Arc::default(),
            refused: AtomicBool::new(false),
        }
    }

    /// Buffers alive now (lent, free, or on their way back).
    pub fn buffers_alive(&self) -> usize {
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
            // Let finished maps come back before making another buffer.
            let _ = self.device.poll(wgpu::PollType::Poll);
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
        }))
    }

    fn refuse(&self, why: &str) {
        if !self.refused.swap(true, Ordering::Relaxed) {
            eprintln!(
                "[K3-GPU] reading experts straight into upload staging failed ({why}); reading them into host memory from now on"
            );
        }
    }
}

/// One lent buffer: `len` bytes from `lead` on.
pub struct LentStaging {
    buf: wgpu::Buffer,
    /// The mapping while the region is the reader's; `None` once the device has it.
    view: Mutex<Option<wgpu::BufferViewMut>>,
    lead: usize,
    len: usize,
    pool: Weak<Mutex<Pool>>,
}

impl LentStaging {
    /// The buffer, unmapped for the device, and the offset of the region in it. The copies
    /// recorded from it must be submitted before the expert is dropped.
    pub fn for_device(&self) -> (&wgpu::Buffer, u64) {
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
