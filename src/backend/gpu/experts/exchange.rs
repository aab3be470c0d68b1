//! The VRAM tier's side of the exchange with the host cache ([`TierExchange`]): an expert
//! lives in one of them. An expert uploaded into a slot is promoted (the host cache drops
//! its copy); an expert evicted from a slot is demoted: its slot is copied into a readback
//! buffer before the new expert overwrites it, and once that copy has landed the mapped
//! buffer itself goes to the host cache, which reads the expert there (no host copy of
//! 17.5 MB on the engine thread) and gives the buffer back for the next demotion when it
//! drops the expert. A download over the bus costs no disk read, where dropping the expert
//! would cost one on its next use, and keeping a host copy while it sits in VRAM would hold
//! it twice. The copy is only read once the GPU has finished it (every MoE layer waits for
//! its routing readback, so by the next layer it has), never waited for here.

use super::tier::TierState;
use super::BLOCK;
use crate::backend::gpu::GpuBackend;
use crate::backend::{TierExchange, TierMoves};
use crate::routed_expert::ExpertKey;
use crate::routed_expert::{HostBytes, LoadedExpert};
use anyhow::{anyhow, Result};
use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

/// A demotion's readback: not done, done, failed.
const WAITING: u8 = 0;
const MAPPED: u8 = 1;
const FAILED: u8 = 2;

/// One evicted expert on its way back to host memory.
struct Pending {
    key: ExpertKey,
    buf: wgpu::Buffer,
    state: Arc<AtomicU8>,
    lens: [usize; 6],
}

#[derive(Default)]
struct Moves {
    promoted: Vec<ExpertKey>,
    pending: Vec<Pending>,
}

/// Readback buffers kept for reuse, at most.
const FREE_READBACKS: usize = 64;

/// Unmapped readback buffers for the next demotions: making a mapped buffer of an expert's
/// size for each one costs more than its copy.
#[derive(Default)]
struct FreeReadbacks {
    bufs: Mutex<Vec<wgpu::Buffer>>,
    /// Readback buffers made so far.
    made: AtomicU64,
    /// Readbacks whose expert is alive (held by the host cache or in use).
    held: AtomicU64,
}

impl FreeReadbacks {
    /// A free buffer of `size` bytes, if one is kept.
    fn take(&self, size: u64) -> Option<wgpu::Buffer> {
        let mut f = self.bufs.lock().unwrap_or_else(|e| e.into_inner());
        let at = f.iter().position(|b| b.size() == size)?;
        Some(f.swap_remove(at))
    }

    /// Keeps `buf` (unmapped) for a later demotion, while fewer than [`FREE_READBACKS`] are.
    fn give(&self, buf: wgpu::Buffer) {
        let mut f = self.bufs.lock().unwrap_or_else(|e| e.into_inner());
        if f.len() < FREE_READBACKS {
            f.push(buf);
        }
    }

    fn len(&self) -> usize {
        self.bufs.lock().unwrap_or_else(|e| e.into_inner()).len()
    }
}

/// A demoted expert's bytes where the GPU copied them: a mapped readback buffer, unmapped
/// and kept for the next demotion once the host cache drops the expert.
struct Readback {
    view: Option<wgpu::BufferView>,
    buf: wgpu::Buffer,
    free: Arc<FreeReadbacks>,
}

impl HostBytes for Readback {
    fn bytes(&self) -> &[u8] {
        self.view.as_deref().unwrap_or(&[])
    }
}

impl Drop for Readback {
    fn drop(&mut self) {
        // The view goes first: a buffer unmaps only without views.
        self.view = None;
        self.buf.unmap();
        self.free.held.fetch_sub(1, Ordering::Relaxed);
        self.free.give(self.buf.clone());
    }
}

/// Counts of the demotions' readback buffers ([`GpuBackend::demotion_readbacks`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Readbacks {
    /// Made since the backend started.
    pub made: u64,
    /// Holding a demoted expert's bytes now (the host cache reads them there).
    pub held: u64,
    /// Unmapped, kept for the next demotions.
    pub free: u64,
}

/// Promotions and demotions of the VRAM tier, waiting for the expert source to take them.
pub(in crate::backend::gpu) struct Mailbox {
    device: wgpu::Device,
    /// The tier has slots.
    takes: AtomicBool,
    /// The host cache wants evicted experts back.
    demote: AtomicBool,
    moves: Mutex<Moves>,
    /// The experts the tier's slots hold, as the prefetcher asks about them: kept here so
    /// the question neither waits for the tier's lock nor pins or marks an expert used.
    resident: Mutex<HashSet<ExpertKey>>,
    /// Shared with the readbacks the host cache holds, which give their buffers back here.
    free: Arc<FreeReadbacks>,
}

impl Mailbox {
    /// A mailbox for the tier of `device`: no slots, no demotions until told.
    pub(in crate::backend::gpu) fn new(device: wgpu::Device) -> Self {
        Self {
            device,
            takes: AtomicBool::new(false),
            demote: AtomicBool::new(false),
            moves: Mutex::default(),
            resident: Mutex::default(),
            free: Arc::default(),
        }
    }

    fn lock(&self) -> Result<MutexGuard<'_, Moves>> {
        self.moves
            .lock()
            .map_err(|_| anyhow!("GPU tier exchange poisoned by an earlier panic"))
    }

    /// The tier now has `slots` slots; what it reported and held before is forgotten.
    pub(in crate::backend::gpu) fn reset(&self, slots: usize) -> Result<()> {
        self.takes.store(slots > 0, Ordering::Relaxed);
        *self.lock()? = Moves::default();
        self.resident_set().clear();
        Ok(())
    }

    /// `key` was uploaded into a slot; a demotion of it still on its way is dropped (the
    /// tier holds it again).
    fn promoted(&self, key: ExpertKey) -> Result<()> {
        self.resident_set().insert(key);
        let mut m = self.lock()?;
        m.pending.retain(|p| p.key != key);
        m.promoted.push(key);
        Ok(())
    }

    /// `key` left its slot.
    fn evicted(&self, key: ExpertKey) {
        self.resident_set().remove(&key);
    }

    fn resident_set(&self) -> MutexGuard<'_, HashSet<ExpertKey>> {
        // A set of keys is whole after any panic: a poisoned lock is taken as it is.
        self.resident.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn demotes(&self) -> bool {
        self.demote.load(Ordering::Relaxed)
    }

    /// The expert of a finished readback, its bytes left in the mapped buffer.
    fn landed(&self, p: Pending) -> Result<LoadedExpert> {
        let view = p.buf.get_mapped_range(..).map_err(|e| {
            anyhow!(
                "reading back expert {} of layer {}: {e:?}",
                p.key.id,
                p.key.layer
            )
        })?;
        self.free.held.fetch_add(1, Ordering::Relaxed);
        let mem = Readback {
            view: Some(view),
            buf: p.buf,
            free: self.free.clone(),
        };
        LoadedExpert::from_handed(p.key.id, Box::new(mem), p.lens)
    }
}

impl TierExchange for Mailbox {
    fn takes_uploads(&self) -> bool {
        self.takes.load(Ordering::Relaxed)
    }

    fn want_demotions(&self, yes: bool) {
        self.demote.store(yes, Ordering::Relaxed);
    }

    fn holds(&self, layer: usize, ids: &[u32]) -> Vec<bool> {
        let r = self.resident_set();
        ids.iter()
            .map(|&id| r.contains(&ExpertKey { layer, id }))
            .collect()
    }

    fn take_moves(&self) -> Result<TierMoves> {
        // Runs the callbacks of readbacks the GPU has finished; waits for nothing.
        let _ = self.device.poll(wgpu::PollType::Poll);
        let mut m = self.lock()?;
        let promoted = std::mem::take(&mut m.promoted);
        let mut demoted = Vec::new();
        let mut waiting = Vec::new();
        for p in std::mem::take(&mut m.pending) {
            match p.state.load(Ordering::Acquire) {
                MAPPED => demoted.push((p.key.layer, self.landed(p)?)),
                // A failed readback loses the expert: its next use reads it from disk.
                FAILED => {}
                _ => waiting.push(p),
            }
        }
        m.pending = waiting;
        Ok(TierMoves { promoted, demoted })
    }
}

impl GpuBackend {
    /// The demotions' readback buffers: made since the backend started, holding a demoted
    /// expert now, and kept free for the next demotions.
    pub fn demotion_readbacks(&self) -> Readbacks {
        let f = &self.experts.exchange.free;
        Readbacks {
            made: f.made.load(Ordering::Relaxed),
            held: f.held.load(Ordering::Relaxed),
            free: f.len() as u64,
        }
    }

    /// Records that `key` went into a tier slot.
    pub(super) fn note_promoted(&self, key: ExpertKey) -> Result<()> {
        self.experts.exchange.promoted(key)
    }

    /// Copies the expert `victim` out of slot `slot` before it is overwritten, when the host
    /// cache wants it back; its bytes reach the host cache through the exchange.
    pub(super) fn demote_from_slot(
        &self,
        t: &TierState,
        slot: usize,
        victim: ExpertKey,
    ) -> Result<()> {
        self.experts.exchange.evicted(victim);
        if !self.experts.exchange.demotes() {
            return Ok(());
        }
        let (i, d) = t.book.dims();
        let per_pool = t.book.per_pool();
        let (p, ls) = (slot / per_pool, (slot % per_pool) as u64);
        let Some(pool) = t.pools.get(p) else {
            return Err(anyhow!(
                "internal: GPU expert tier slot {slot} has no device pool"
            ));
        };
        let m = (i * d) as u64;
        let (hp, hs) = (m / 2, m / BLOCK as u64);
        let size = 3 * (hp + hs);
        let buf = self.experts.exchange.free.take(size).unwrap_or_else(|| {
            self.experts
                .exchange
                .free
                .made
                .fetch_add(1, Ordering::Relaxed);
            self.ctx.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("expert tier demotion"),
                size,
                usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            })
        });
        // Laid out as LoadedExpert::weights reads its parts: w1, w2, w3, packed then scales.
        let (up, down) = (&pool.up, &pool.down);
        let copies = [
            (&up.packed, ls * 2 * hp, hp),
            (&up.scales, ls * 2 * hs, hs),
            (&down.packed, ls * hp, hp),
            (&down.scales, ls * hs, hs),
            (&up.packed, ls * 2 * hp + hp, hp),
            (&up.scales, ls * 2 * hs + hs, hs),
        ];
        let mut at = 0;
        for (src, off, len) in copies {
            self.ctx.copy(src, off, &buf, at, len);
            at += len;
        }
        // Mapping waits for a submission: the copies go out now, ahead of the new upload.
        self.ctx.flush();
        let state = Arc::new(AtomicU8::new(WAITING));
        let s = state.clone();
        buf.slice(..).map_async(wgpu::MapMode::Read, move |r| {
            s.store(if r.is_ok() { MAPPED } else { FAILED }, Ordering::Release);
        });
        let (hp, hs) = (hp as usize, hs as usize);
        self.experts.exchange.lock()?.pending.push(Pending {
            key: victim,
            buf,
            state,
            lens: [hp, hs, hp, hs, hp, hs],
        });
        Ok(())
    }
}
