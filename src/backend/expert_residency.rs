//! Where routed experts may live besides the host expert cache: a backend's own resident
//! tier (VRAM on a GPU) and the memory it lends for reads. The model asks these questions
//! of every backend; one without device memory keeps the defaults (no tier, host reads).

use crate::routed_expert::{ExpertKey, LoadedExpert, ReadLender};
use anyhow::Result;
use std::sync::Arc;

/// Experts that moved between a backend's tier and the host cache since the last report.
#[derive(Default)]
pub struct TierMoves {
    /// Taken into the tier from host bytes: the host cache drops its copy.
    pub promoted: Vec<ExpertKey>,
    /// Evicted from the tier, their bytes brought back to host memory: the host cache takes
    /// them as it takes an expert just read.
    pub demoted: Vec<(usize, LoadedExpert)>,
}

/// How the expert source and a backend's tier keep one expert in one place: the backend
/// reports what it took and what it gave back, the source moves its host copies to match.
pub trait TierExchange: Send + Sync {
    /// Whether the tier takes every expert the backend is handed (it has slots): the source
    /// then keeps a read expert in host memory only when the tier gives it back.
    fn takes_uploads(&self) -> bool;
    /// Whether evicted experts should come back to host memory (the host cache has slots).
    fn want_demotions(&self, yes: bool);
    /// Which of `ids` (experts of `layer`) the tier holds now, one flag per id, without
    /// pinning them or marking them used: a guess about a later layer must not change what
    /// the running layer may evict.
    fn holds(&self, layer: usize, ids: &[u32]) -> Vec<bool>;
    /// The moves since the last call; demotions whose bytes have not arrived yet wait for a
    /// later call.
    fn take_moves(&self) -> Result<TierMoves>;
}

/// What a backend can say about its free device memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FreeDeviceMemory {
    /// Bytes free now.
    Bytes(u64),
    /// The backend cannot measure it, and why (for the start-up line).
    Unknown(&'static str),
}

/// A backend's resident expert tier and read memory; the defaults describe a backend whose
/// only expert memory is the host cache.
pub trait ExpertResidency {
    /// Sizes the backend's resident expert tier to `bytes`, at most `experts` slots (the
    /// model's routed experts), for experts of shape `[I, D]` (`intermediate`, `hidden`);
    /// drops what it held. Returns its slots, or `None` for a backend without one.
    fn configure_expert_tier(
        &self,
        bytes: u64,
        experts: usize,
        intermediate: usize,
        hidden: usize,
    ) -> Result<Option<usize>> {
        let _ = (bytes, experts, intermediate, hidden);
        Ok(None)
    }
    /// Which of `ids` (experts of `layer`) the backend holds resident, one flag per id. The
    /// resident ones are pinned until the next call, so they stay resident while the layer
    /// runs and may be passed to [`super::Backend::moe_accumulate`] without host weights.
    fn pin_resident_experts(&self, layer: usize, ids: &[u32]) -> Result<Vec<bool>> {
        let _ = layer;
        Ok(vec![false; ids.len()])
    }
    /// Memory this backend lends for expert reads, so they land where it uploads from;
    /// `None` (the default) when reads into host memory serve it as well.
    fn read_lender(&self) -> Option<Arc<dyn ReadLender>> {
        None
    }
    /// The exchange between this backend's tier and the host cache, `None` (the default)
    /// for a backend without a tier.
    fn tier_exchange(&self) -> Option<Arc<dyn TierExchange>> {
        None
    }
    /// Whether the resident tier is the single expert pool of a unified-memory adapter: its
    /// slots are host RAM, so the expert budget sizes them and the host cache keeps nothing
    /// between layers (an expert the pool evicts is dropped, not demoted).
    fn unified_pool(&self) -> bool {
        false
    }
    /// Slots of the resident tier as last configured (0 for a backend without one).
    fn expert_tier_slots(&self) -> Result<usize> {
        Ok(0)
    }
    /// Device memory free now, after everything allocated so far; it sizes the expert tier
    /// when no size is asked for. A backend without device memory keeps the default.
    fn free_device_memory(&self) -> Result<FreeDeviceMemory> {
        Ok(FreeDeviceMemory::Unknown(
            "the backend has no device memory",
        ))
    }
}
