//! Experts a prefill chunk uploaded outside the VRAM tier, kept on the device for the next
//! chunk of the same layer: without it each chunk uploads every one of its experts again.
//!
//! A layer's carry lives in two generations. `next` collects what the chunk now running
//! places outside the tier (its new uploads and the carried experts it uses again); `prev`
//! is what the previous chunk left, reported resident by `pin_resident_experts` so the
//! model neither reads nor hands over those experts. Each pin of the layer makes `next` the
//! new `prev`, so what a chunk did not use is dropped. One-token calls (decode) keep nothing:
//! the first decode step still finds the last chunk's experts, the next one nothing. The
//! carry is bounded by a byte budget; a chunk whose uploads do not fit is not kept.

use super::arena::ArenaSet;
use crate::backend::ExpertKey;
use std::collections::{HashMap, HashSet};

/// One generation of a layer's carry: arena sets by id, and where each expert sits.
#[derive(Default)]
pub(super) struct Generation {
    pub(super) sets: HashMap<u64, ArenaSet>,
    pub(super) at: HashMap<u32, (u64, u32)>,
}

/// Arena sets a call made, to be kept: each set's id, the set, and its experts' ids and
/// slots.
pub(super) type MadeSets = Vec<(u64, ArenaSet, Vec<(u32, u32)>)>;

/// The carry of every layer, its budget and its counters.
#[derive(Default)]
pub(in crate::backend::gpu) struct Carry {
    /// Bytes the carry may hold (0: nothing is kept).
    pub(super) budget: u64,
    /// `(I, D)` of the experts held.
    pub(super) dims: Option<(usize, usize)>,
    layers: HashMap<usize, (Generation, Generation)>,
    next_set: u64,
    /// Experts written to the device (tier slots and transient arenas) since the start.
    pub(super) uploads: u64,
    /// Experts used from the carry instead of an upload.
    pub(super) hits: u64,
}

/// Device bytes of one arena set.
fn set_bytes(s: &ArenaSet) -> u64 {
    s.up.packed.size() + s.up.scales.size() + s.down.packed.size() + s.down.scales.size()
}

impl Carry {
    /// An empty carry of `budget` bytes; counters restart.
    pub(super) fn new(budget: u64) -> Self {
        Self {
            budget,
            ..Default::default()
        }
    }

    /// Starts a new pass of `layer`: what the last pass kept becomes the generation this one
    /// may use. Returns which of `ids` it holds.
    pub(in crate::backend::gpu) fn pin(&mut self, layer: usize, ids: &[u32]) -> Vec<bool> {
        let Some((prev, next)) = self.layers.get_mut(&layer) else {
            return vec![false; ids.len()];
        };
        *prev = std::mem::take(next);
        let held: Vec<bool> = ids.iter().map(|id| prev.at.contains_key(id)).collect();
        if prev.at.is_empty() {
            self.layers.remove(&layer);
        }
        held
    }

    /// Where the carry holds `key` for the pass now running: its set and slot.
    pub(super) fn find(&self, key: ExpertKey) -> Option<(u64, u32, &ArenaSet)> {
        let (prev, _) = self.layers.get(&key.layer)?;
        let &(set, slot) = prev.at.get(&key.id)?;
        Some((set, slot, prev.sets.get(&set)?))
    }

    /// A fresh set id.
    pub(super) fn new_set_id(&mut self) -> u64 {
        self.next_set += 1;
        self.next_set
    }

    /// Bytes held now (a set in both generations counted once).
    pub(super) fn held(&self) -> u64 {
        self.layers
            .values()
            .map(|(p, n)| {
                let mut ids: HashSet<u64> = p.sets.keys().copied().collect();
                ids.extend(n.sets.keys());
                ids.iter()
                    .filter_map(|id| p.sets.get(id).or_else(|| n.sets.get(id)))
                    .map(set_bytes)
                    .sum::<u64>()
            })
            .sum()
    }

    /// Keeps, for `layer`'s next pass, the carried sets `reused` (their experts stay where
    /// they are) and the new sets `made` of `[I, D]` (`dims`) experts with the experts placed in them, when the carry
    /// then stays within its budget. Returns whether it kept them.
    pub(super) fn keep(
        &mut self,
        layer: usize,
        dims: (usize, usize),
        reused: &HashSet<u64>,
        made: MadeSets,
    ) -> bool {
        if self.budget == 0 {
            return false;
        }
        if self.dims.is_some_and(|d| d != dims) {
            // Experts of another shape (another model on this backend): start over.
            self.layers.clear();
        }
        self.dims = Some(dims);
        let before = self.held();
        let grow: u64 = made.iter().map(|(_, s, _)| set_bytes(s)).sum();
        if before + grow > self.budget {
            return false;
        }
        let (prev, next) = self.layers.entry(layer).or_default();
        for &id in reused {
            if let Some(s) = prev.sets.get(&id) {
                next.sets.insert(id, s.clone());
                for (&e, &(set, slot)) in &prev.at {
                    if set == id {
                        next.at.insert(e, (set, slot));
                    }
                }
            }
        }
        for (id, s, experts) in made {
            next.sets.insert(id, s);
            for (e, slot) in experts {
                next.at.insert(e, (id, slot));
            }
        }
        true
    }

    /// Experts the carry holds now, over all layers and both generations.
    pub(super) fn experts(&self) -> usize {
        self.layers
            .values()
            .map(|(p, n)| {
                let mut ids: HashSet<u32> = p.at.keys().copied().collect();
                ids.extend(n.at.keys());
                ids.len()
            })
            .sum()
    }
}
