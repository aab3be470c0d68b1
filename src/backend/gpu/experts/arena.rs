//! Expert arenas: the device copies of a run of experts' matrices (packed nibbles and
//! scale bytes), made per call or written into buffers kept from earlier calls.

use crate::backend::gpu::experts::expert_bytes::{all_host, MatSrc, PartSrc};
use crate::backend::gpu::GpuBackend;
use anyhow::{anyhow, Result};

/// The device copy of a run of experts' matrices: packed nibbles and scale bytes, expert
/// after expert, each expert's matrices stacked row-wise.
#[derive(Clone)]
pub(in crate::backend::gpu) struct Arena {
    pub(super) packed: wgpu::Buffer,
    pub(super) scales: wgpu::Buffer,
    /// Whether a matrix this call reads from it may hold a scale above
    /// [`FAST_SCALE_MAX`](crate::backend::gpu::experts::expert_bytes::FAST_SCALE_MAX): its kernels then keep the
    /// per-element path (`SPECIAL` 1), which costs the batched matvec bandwidth
    /// (docs/perf.md#kernels).
    pub(super) huge: bool,
}

/// Transient arenas kept for reuse: the first few of a call, each up to
/// [`REUSED_ARENA_BYTES`]. A decode step's 16 experts (≈ 180 + 90 MB) fit, so streaming
/// allocates nothing per layer; a large prefill call's arenas are made for it and dropped
/// after.
pub(super) const REUSED_ARENAS: usize = 4;
/// The largest packed (or scale) buffer a reused arena keeps.
pub(super) const REUSED_ARENA_BYTES: u64 = 256 << 20;

/// One set of expert arenas: gate+up rows and down rows, slot-indexed alike.
#[derive(Clone)]
pub(super) struct ArenaSet {
    pub(super) up: Arena,
    pub(super) down: Arena,
}

impl ArenaSet {
    /// This set for one call whose experts in it may (`huge`) hold huge scales.
    pub(super) fn marked(&self, huge: bool) -> Self {
        Self {
            up: Arena {
                huge,
                ..self.up.clone()
            },
            down: Arena {
                huge,
                ..self.down.clone()
            },
        }
    }
}

impl GpuBackend {
    /// Uploads matrices stacked row-wise as one arena, straight from where their bytes are.
    /// Arena `reuse` of a call (below [`REUSED_ARENAS`], bytes within
    /// [`REUSED_ARENA_BYTES`], 4-byte sizes) is written into buffers kept from earlier calls;
    /// queue writes are ordered after the work already submitted against them, device
    /// copies after the work recorded. Others are made for this call.
    pub(super) fn arena(&self, mats: &[MatSrc<'_>], reuse: Option<usize>) -> Result<Arena> {
        let huge = mats.iter().any(MatSrc::may_have_huge_scales);
        let (mut packed, mut scales) = (Vec::new(), Vec::new());
        let (mut po, mut so) = (0u64, 0u64);
        for m in mats {
            packed.push((po, m.packed));
            po += m.packed.len();
            scales.push((so, m.scales));
            so += m.scales.len();
        }
        // Queue writes need 4-byte offsets and sizes.
        let aligned = mats
            .iter()
            .all(|m| m.packed.len() % 4 == 0 && m.scales.len() % 4 == 0);
        let slot =
            reuse.filter(|&k| k < REUSED_ARENAS && aligned && po.max(so) <= REUSED_ARENA_BYTES);
        let Some(k) = slot else {
            // A new buffer written through the queue, as the tier's slots are: a buffer
            // mapped at creation costs wgpu a zero-filled staging copy of its whole size.
            // Queue writes need 4-byte sizes; other host parts are written at creation.
            let made = |size: u64, parts: &[(u64, PartSrc<'_>)], label: &str| match all_host(parts)
                .filter(|_| !aligned)
            {
                Some(h) => self.ctx.buffer_from_parts(size, &h, label),
                None => {
                    let b = self.ctx.buffer(size, label);
                    self.write_srcs(&b, parts);
                    Ok(b)
                }
            };
            return Ok(Arena {
                packed: made(po, &packed, "expert packed")?,
                scales: made(so, &scales, "expert scales")?,
                huge,
            });
        };
        let a = {
            let mut pool = self
                .experts
                .transient
                .lock()
                .map_err(|_| anyhow!("GPU transient arenas poisoned by an earlier panic"))?;
            if pool.len() <= k {
                pool.resize_with(k + 1, || None);
            }
            let fits = pool[k]
                .as_ref()
                .is_some_and(|a| a.packed.size() >= po && a.scales.size() >= so);
            if !fits {
                pool[k] = Some(Arena {
                    packed: self.ctx.buffer(
                        REUSED_ARENA_BYTES.min(po.max(1).next_power_of_two()),
                        "expert packed (reused)",
                    ),
                    scales: self.ctx.buffer(
                        REUSED_ARENA_BYTES.min(so.max(1).next_power_of_two()),
                        "expert scales (reused)",
                    ),
                    huge: true,
                });
            }
            let kept = pool[k]
                .clone()
                .ok_or_else(|| anyhow!("internal: transient arena {k} missing"))?;
            Arena { huge, ..kept }
        };
        // One staging copy per buffer for host bytes: the parts lie back to back.
        self.write_srcs(&a.packed, &packed);
        self.write_srcs(&a.scales, &scales);
        Ok(a)
    }
}
