//! The VRAM tier's side of the exchange with the host cache ([`TierExchange`]): an expert
//! lives in one of them. An expert uploaded into a slot is promoted (the host cache drops
//! its copy); an expert evicted from a slot is demoted: its slot is copied into a readback
//! buffer before the new expert overwrites it, and once that copy has landed the bytes go
//! back to the host cache. A download over the bus costs no disk read, where dropping the
//! expert would cost one on its next use, and keeping a host copy while it sits in VRAM
//! would hold it twice. The copy is only read once the GPU has finished it (every MoE layer
//! waits for its routing readback, so by the next layer it has), never waited for here.

use super::super::GpuBackend;
use super::tier::TierState;
use super::BLOCK;
use crate::backend::{ExpertKey, TierExchange, TierKey, TierMoves};
use crate::experts::LoadedExpert;
use anyhow::{anyhow, Result};
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
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
    promoted: Vec<TierKey>,
    pending: Vec<Pending>,
    /// Readback buffers whose bytes have been taken, unmapped, for the next demotions:
    /// making a mapped buffer of an expert's size for each one costs more than its copy.
    free: Vec<wgpu::Buffer>,
}

/// Readback buffers kept for reuse, at most.
const FREE_READBACKS: usize = 64;

/// Promotions and demotions of the VRAM tier, waiting for the expert source to take them.
pub(in crate::backend::gpu) struct Mailbox {
    device: wgpu::Device,
    /// The tier has slots.
    takes: AtomicBool,
    /// The host cache wants evicted experts back.
    demote: AtomicBool,
    moves: Mutex<Moves>,
}

impl Mailbox {
    /// A mailbox for the tier of `device`: no slots, no demotions until told.
    pub(in crate::backend::gpu) fn new(device: wgpu::Device) -> Self {
        Self {
            device,
            takes: AtomicBool::new(false),
            demote: AtomicBool::new(false),
            moves: Mutex::default(),
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
        Ok(())
    }

    /// `key` was uploaded into a slot; a demotion of it still on its way is dropped (the
    /// tier holds it again).
    fn promoted(&self, key: ExpertKey) -> Result<()> {
        let mut m = self.lock()?;
        m.pending.retain(|p| p.key != key);
        m.promoted.push((key.layer, key.id));
        Ok(())
    }

    fn demotes(&self) -> bool {
        self.demote.load(Ordering::Relaxed)
    }
}

impl TierExchange for Mailbox {
    fn takes_uploads(&self) -> bool {
        self.takes.load(Ordering::Relaxed)
    }

    fn want_demotions(&self, yes: bool) {
        self.demote.store(yes, Ordering::Relaxed);
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
                MAPPED => {
                    let got = p.buf.get_mapped_range(..).map_err(|e| {
                        anyhow!(
                            "reading back expert {} of layer {}: {e:?}",
                            p.key.id,
                            p.key.layer
                        )
                    });
                    let e = got.and_then(|view| LoadedExpert::from_parts(p.key.id, &view, p.lens));
                    p.buf.unmap();
                    if m.free.len() < FREE_READBACKS {
                        m.free.push(p.buf);
                    }
                    demoted.push((p.key.layer, e?));
                }
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
    /// Records that `key` went into a tier slot.
    pub(super) fn note_promoted(&self, key: ExpertKey) -> Result<()> {
        self.exchange.promoted(key)
    }

    /// Copies the expert `victim` out of slot `slot` before it is overwritten, when the host
    /// cache wants it back; its bytes reach the host cache through the exchange.
    pub(super) fn demote_from_slot(
        &self,
        t: &TierState,
        slot: usize,
        victim: ExpertKey,
    ) -> Result<()> {
        if !self.exchange.demotes() {
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
        let kept = {
            let mut m = self.exchange.lock()?;
            let at = m.free.iter().position(|b| b.size() == size);
            at.map(|k| m.free.swap_remove(k))
        };
        let buf = kept.unwrap_or_else(|| {
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
        self.exchange.lock()?.pending.push(Pending {
            key: victim,
            buf,
            state,
            lens: [hp, hs, hp, hs, hp, hs],
        });
        Ok(())
    }
}
