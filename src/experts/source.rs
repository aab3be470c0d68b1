//! Supplies a MoE layer's chosen experts, in canonical (shard, offset) order, in batches.

use super::direct_reader::{DirectReader, LoadedExpert};
use crate::checkpoint::Checkpoint;
use crate::stats::Stats;
use anyhow::{anyhow, Result};
use std::time::Instant;

/// Where experts come from: for now straight from the shards, every expert read each time.
#[derive(Default)]
pub struct ExpertSource {
    reader: DirectReader,
}

impl ExpertSource {
    /// A source that reads every expert from its shard.
    pub fn direct() -> Self {
        Self { reader: DirectReader::new() }
    }

    /// Sorts expert ids of `layer` into the order every path consumes them: by shard and
    /// offset. One global order keeps each row's sum over its experts independent of chunking,
    /// caching and overlap.
    pub fn canonical_order(ck: &Checkpoint, layer: usize, ids: &mut [u32]) -> Result<()> {
        let mut keyed = Vec::with_capacity(ids.len());
        for &e in ids.iter() {
            let loc = ck.experts().get(layer, e as usize).ok_or_else(|| {
                anyhow!("expert {e} of layer {layer} is not in the checkpoint's expert table")
            })?;
            keyed.push(((loc.shard, loc.span().start), e));
        }
        keyed.sort_unstable();
        for (slot, (_, e)) in ids.iter_mut().zip(keyed) {
            *slot = e;
        }
        Ok(())
    }

    /// Loads the experts `ids` (already in canonical order) of `layer` and hands them to
    /// `consume` in that order, in one or more batches, counting loads in `stats`.
    pub fn stream(
        &self,
        ck: &Checkpoint,
        layer: usize,
        ids: &[u32],
        stats: &mut Stats,
        consume: &mut dyn FnMut(&[&LoadedExpert]) -> Result<()>,
    ) -> Result<()> {
        let t0 = Instant::now();
        let loaded: Vec<LoadedExpert> =
            ids.iter().map(|&e| self.reader.read(ck, layer, e)).collect::<Result<_>>()?;
        stats.eload += t0.elapsed();
        stats.expert_lookups += loaded.len() as u64;
        stats.bytes_streamed += loaded.iter().map(|l| l.len() as u64).sum::<u64>();
        let refs: Vec<&LoadedExpert> = loaded.iter().collect();
        consume(&refs)
    }
}
