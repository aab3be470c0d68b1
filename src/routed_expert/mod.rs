//! The vocabulary every layer that touches a routed expert shares: its name, its route,
//! its bytes as read (host, lent or handed over) and as the kernels see them. It imports
//! only the quantized formats, the config and the platform, so the checkpoint, the backends
//! and the expert source all build on it without importing each other.

mod lent_memory;
mod loaded;

pub use lent_memory::{LentRegion, ReadLender};
pub use loaded::{ExpertBytes, HostBytes, LoadedExpert};

use crate::quant::Mxfp4View;

/// The native MXFP4 bytes of one routed expert, borrowed from a shard or a cache slot.
#[derive(Clone, Copy, Debug)]
pub struct ExpertWeights<'a> {
    /// Gate projection `[I, D]`.
    pub w1: Mxfp4View<'a>,
    /// Down projection `[D, I]`.
    pub w2: Mxfp4View<'a>,
    /// Up projection `[I, D]`.
    pub w3: Mxfp4View<'a>,
}

/// A routed expert read into memory its backend lent for the read (see
/// [`ReadLender`]), which only that backend can use: the lent region, the
/// expert's `(I, D)`, and where its six tensors lie in the region (w1 packed, w1 scales, w2
/// packed, w2 scales, w3 packed, w3 scales).
#[derive(Clone, Debug)]
pub struct StagedExpert<'a> {
    /// The region, for its lender to recognize.
    pub region: &'a dyn std::any::Any,
    /// `(I, D)`: intermediate and latent widths.
    pub dims: (usize, usize),
    /// Byte ranges of the six tensors in the region.
    pub parts: [std::ops::Range<u64>; 6],
}

/// Where a routed expert's bytes are when a backend runs it: the one answer the source, the
/// model and both backends match on.
#[derive(Clone, Debug)]
pub enum ExpertPayload<'a> {
    /// Host views of its three matrices (read into our memory, or handed over by the backend).
    Host(ExpertWeights<'a>),
    /// Read into memory the running backend lent for the read; only it can use them.
    Staged(StagedExpert<'a>),
    /// Held by the backend already (its VRAM tier, or carried from the last chunk): nothing
    /// was read.
    Resident,
}

/// Names one routed expert of the model: its MoE layer and its id within the layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ExpertKey {
    /// Layer index.
    pub layer: usize,
    /// Expert id within the layer.
    pub id: u32,
}

/// The chosen experts of one token: `(expert id, weight)`, best first.
pub type Route = Vec<(u32, f32)>;
