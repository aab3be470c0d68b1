//! Routed experts other processes own: the hook through which a MoE layer hands rows to
//! the ranks of an expert-parallel job (`src/ranks/`) and takes back each expert's output.
//! The model calls it through a trait object, so it knows nothing of the transport.

use crate::stats::Stats;
use anyhow::Result;
use std::collections::HashMap;

/// One expert's work for a rank: its id and the rows of the layer's latent `z` that chose
/// it, in increasing order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExpertRows {
    /// The expert's id within its layer.
    pub id: u32,
    /// Row indices into the layer's `z`.
    pub rows: Vec<usize>,
}

/// Each expert's output rows as a rank returned them: `rows.len() × cols` values, unweighted.
pub(crate) type ExpertOutputs = HashMap<u32, Vec<f32>>;

/// Experts of every MoE layer split over ranks; rank 0 is this process.
pub trait RemoteExperts: Send + Sync {
    /// The rank that owns expert `id` of MoE layer `layer` (0: this process).
    fn owner(&self, layer: usize, id: u32) -> usize;
    /// Sends each rank in `work` its experts of `layer` with the rows of `z` (`cols` values a
    /// row) they need, to every rank before waiting on any.
    fn send(
        &self,
        layer: usize,
        z: &[f32],
        cols: usize,
        work: &[(usize, Vec<ExpertRows>)],
    ) -> Result<()>;
    /// Waits (bounded) for the answers to the last [`RemoteExperts::send`]; the ranks'
    /// hits and lookups are added to `stats` (their bytes and disk time stay theirs: the
    /// stats lines' disk figures are this process's disk).
    fn receive(&self, layer: usize, stats: &mut Stats) -> Result<ExpertOutputs>;
}
