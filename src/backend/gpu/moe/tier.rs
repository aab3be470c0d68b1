//! The VRAM expert tier's device side: its pools of expert slots, sized by
//! `configure_tier_op` and written by `upload_to_slot`.

use super::super::expert_bytes::ExpertSrc;
use super::super::expert_tier::ExpertTier;
use super::super::GpuBackend;
use super::arena::{Arena, ArenaSet};
use super::BLOCK;
use anyhow::{ensure, Result};
use std::collections::HashSet;

/// The VRAM expert tier: bookkeeping plus its device pools (allocated as slots fill).
#[derive(Default)]
pub(in crate::backend::gpu) struct TierState {
    /// Which expert sits in which slot.
    pub(in crate::backend::gpu) book: ExpertTier,
    pub(super) pools: Vec<ArenaSet>,
    /// Slots whose expert may hold a scale above
    /// [`FAST_SCALE_MAX`](crate::backend::gpu::expert_bytes::FAST_SCALE_MAX) (its scale bytes had one, or
    /// never passed through host memory).
    pub(super) huge: HashSet<usize>,
}

/// Device bytes of one `[I, D]` expert's six tensors.
pub(super) fn expert_bytes(i: usize, d: usize) -> u64 {
    let m = (i * d) as u64;
    3 * m / 2 + 3 * m / BLOCK as u64
}

impl GpuBackend {
    /// Sizes the VRAM expert tier: `bytes / expert bytes` slots, at most `experts`, for
    /// `[I, D]` experts. Drops whatever the tier held.
    pub(in crate::backend::gpu) fn configure_tier_op(
        &self,
        bytes: u64,
        experts: usize,
        i: usize,
        d: usize,
    ) -> Result<usize> {
        let per_expert = expert_bytes(i, d);
        if bytes < per_expert.max(1) || experts == 0 {
            *self.tier()? = TierState::default();
            return Ok(0);
        }
        ensure!(
            per_expert > 0 && d % BLOCK == 0 && i % BLOCK == 0 && (i * d) % (4 * BLOCK) == 0,
            "GPU expert tier: expert shape [{i}, {d}] does not give 4-byte aligned MXFP4 tensors"
        );
        let per_pool = (self.ctx.max_binding / (i * d) as u64) as usize;
        ensure!(
            per_pool > 0,
            "GPU expert tier: one expert's gate+up ({} B) exceeds the adapter's binding limit of {} B",
            i * d,
            self.ctx.max_binding
        );
        let capacity = ((bytes / per_expert) as usize).min(experts);
        *self.tier()? = TierState {
            book: ExpertTier::new(capacity, per_pool, (i, d)),
            pools: Vec::new(),
            huge: HashSet::new(),
        };
        Ok(capacity)
    }

    /// Writes expert `w` into slot `slot` of the tier, straight from where its bytes are.
    pub(super) fn upload_to_slot(
        &self,
        t: &mut TierState,
        slot: usize,
        w: &ExpertSrc<'_>,
    ) -> Result<()> {
        let (i, d) = t.book.dims();
        let per_pool = t.book.per_pool();
        let (p, ls) = (slot / per_pool, (slot % per_pool) as u64);
        while t.pools.len() <= p {
            let n = t.book.pool_slots(t.pools.len()) as u64;
            let m = (i * d) as u64;
            let blk = BLOCK as u64;
            let arena = |packed: u64, scales: u64, what: &str| Arena {
                packed: self
                    .ctx
                    .buffer(n * packed, &format!("expert tier {what} packed")),
                scales: self
                    .ctx
                    .buffer(n * scales, &format!("expert tier {what} scales")),
                // A call's copy of a pool says whether the slots it reads may have huge
                // scales (`TierState::huge`).
                huge: true,
            };
            t.pools.push(ArenaSet {
                up: arena(m, 2 * m / blk, "gate|up"),
                down: arena(m / 2, m / blk, "down"),
            });
        }
        if w.may_have_huge_scales() {
            t.huge.insert(slot);
        } else {
            t.huge.remove(&slot);
        }
        let pool = &t.pools[p];
        let m = (i * d) as u64;
        let (hp, hs) = (m / 2, m / BLOCK as u64);
        // Queue writes are ordered after everything recorded so far (`write` submits first),
        // so work already recorded against an evicted slot still sees its old expert.
        self.write_srcs(
            &pool.up.packed,
            &[(ls * 2 * hp, w.w1.packed), (ls * 2 * hp + hp, w.w3.packed)],
        );
        self.write_srcs(
            &pool.up.scales,
            &[(ls * 2 * hs, w.w1.scales), (ls * 2 * hs + hs, w.w3.scales)],
        );
        self.write_srcs(&pool.down.packed, &[(ls * hp, w.w2.packed)]);
        self.write_srcs(&pool.down.scales, &[(ls * hs, w.w2.scales)]);
        Ok(())
    }
}
