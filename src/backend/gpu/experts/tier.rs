//! The VRAM expert tier's device side: its pools of expert slots, sized by
//! `configure_tier_op` and written by `upload_to_slot`.

use super::arena::{Arena, ArenaSet};
use super::carry::Carry;
use super::BLOCK;
use crate::backend::gpu::experts::expert_bytes::ExpertSrc;
use crate::backend::gpu::experts::expert_tier::ExpertTier;
use crate::backend::gpu::GpuBackend;
use anyhow::{ensure, Result};
use std::collections::HashSet;

/// The VRAM expert tier: bookkeeping plus its device pools (allocated as slots fill).
#[derive(Default)]
pub(in crate::backend::gpu) struct TierState {
    /// Which expert sits in which slot.
    pub(in crate::backend::gpu) book: ExpertTier,
    pub(super) pools: Vec<ArenaSet>,
    /// Slots whose expert may hold a scale above
    /// [`FAST_SCALE_MAX`](crate::backend::gpu::experts::expert_bytes::FAST_SCALE_MAX) (its scale bytes had one, or
    /// never passed through host memory).
    pub(super) huge: HashSet<usize>,
}

/// Free VRAM the chunk carry leaves to everything else, at least (as the tier's default
/// margin does): activations, the MLA cache and other programs.
const CARRY_MARGIN_MIN_BYTES: u64 = 2_000_000_000;

/// The chunk carry's budget: the VRAM free after loading, less the tier's `tier_bytes` and
/// a margin of max(2 GB, 10 % of free); 0 where free VRAM cannot be measured (the memory
/// of CPU-type and integrated adapters is host RAM, where a carry would be a second copy).
pub(super) fn carry_budget(free: Option<u64>, tier_bytes: u64) -> u64 {
    free.map_or(0, |f| {
        f.saturating_sub(CARRY_MARGIN_MIN_BYTES.max(f / 10))
            .saturating_sub(tier_bytes)
    })
}

/// Device bytes of one `[I, D]` expert's six tensors.
pub(super) fn expert_bytes(i: usize, d: usize) -> u64 {
    let m = (i * d) as u64;
    3 * m / 2 + 3 * m / BLOCK as u64
}

impl GpuBackend {
    /// Sizes the VRAM expert tier: `bytes / expert bytes` slots, at most `experts`, for
    /// `[I, D]` experts, and gives the chunk carry the free VRAM the tier leaves (see
    /// [`carry_budget`]). Drops whatever the tier and the carry held.
    pub(in crate::backend::gpu) fn configure_tier_op(
        &self,
        bytes: u64,
        experts: usize,
        i: usize,
        d: usize,
    ) -> Result<usize> {
        let slots = self.size_tier(bytes, experts, i, d)?;
        self.experts.exchange.reset(slots)?;
        *self.experts.carry()? = Carry::default();
        let free = self.free_vram_now()?;
        let tier_bytes = slots as u64 * expert_bytes(i, d);
        *self.experts.carry()? = Carry::new(carry_budget(free, tier_bytes));
        Ok(slots)
    }

    /// Free device-local VRAM now, once dropped buffers have gone back to the driver.
    fn free_vram_now(&self) -> Result<Option<u64>> {
        self.ctx.finish()?;
        Ok(crate::backend::gpu::experts::vram_budget::free_device_local_bytes(&self.ctx.adapter))
    }

    /// Sets the byte budget of the chunk carry (what a prefill chunk leaves on the device for
    /// the next chunk of its layer) and drops what it held; 0 keeps nothing.
    pub fn set_chunk_carry_budget(&self, bytes: u64) -> Result<()> {
        *self.experts.carry()? = Carry::new(bytes);
        Ok(())
    }

    /// The chunk carry's byte budget.
    pub fn chunk_carry_budget(&self) -> Result<u64> {
        Ok(self.experts.carry()?.budget)
    }

    /// Experts written to the device (tier slots and transient arenas) and experts used from
    /// the chunk carry instead, since the tier or the carry was last configured.
    pub fn expert_uploads(&self) -> Result<(u64, u64)> {
        let c = self.experts.carry()?;
        Ok((c.uploads, c.hits))
    }

    /// Whether the VRAM tier holds expert `id` of `layer` now.
    pub fn tier_holds(&self, layer: usize, id: u32) -> Result<bool> {
        Ok(self
            .experts
            .tier()?
            .book
            .holds(crate::routed_expert::ExpertKey { layer, id }))
    }

    /// Experts in the VRAM tier now whose slot may hold a scale above the MXFP4 kernel's
    /// fast path (their dispatches keep the per-element path).
    pub fn tier_slots_with_huge_scales(&self) -> Result<usize> {
        let t = self.experts.tier()?;
        Ok(t.huge.len())
    }

    /// Experts the chunk carry holds now, and their device bytes.
    pub fn carried_experts(&self) -> Result<(usize, u64)> {
        let c = self.experts.carry()?;
        Ok((c.experts(), c.held()))
    }

    fn size_tier(&self, bytes: u64, experts: usize, i: usize, d: usize) -> Result<usize> {
        let per_expert = expert_bytes(i, d);
        if bytes < per_expert.max(1) || experts == 0 {
            *self.experts.tier()? = TierState::default();
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
        *self.experts.tier()? = TierState {
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

#[cfg(test)]
mod tests {
    use super::carry_budget;

    const G: u64 = 1_000_000_000;

    #[test]
    fn the_carry_takes_what_the_tier_and_the_margin_leave() {
        assert_eq!(carry_budget(None, 0), 0);
        assert_eq!(carry_budget(Some(100 * G), 0), 90 * G);
        assert_eq!(carry_budget(Some(100 * G), 30 * G), 60 * G);
        assert_eq!(carry_budget(Some(100 * G), 95 * G), 0);
        assert_eq!(carry_budget(Some(8 * G), 0), 6 * G);
        assert_eq!(carry_budget(Some(G), 0), 0);
    }
}
