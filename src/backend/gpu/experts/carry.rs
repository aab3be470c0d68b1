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
use crate::routed_expert::ExpertKey;
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::gpu::{GpuBackend, GpuOptions};

    fn set(g: &GpuBackend, bytes: u64) -> ArenaSet {
        let a = || crate::backend::gpu::experts::Arena {
            packed: g.ctx.buffer(bytes, "test packed"),
            scales: g.ctx.buffer(16, "test scales"),
            huge: false,
        };
        ArenaSet { up: a(), down: a() }
    }

    /// A pass keeps what it used and made; the next pass of the layer sees it, the one after
    /// only what that pass used again; over budget nothing is kept.
    #[test]
    fn generations_follow_the_passes_of_a_layer() {
        let opts = GpuOptions {
            allow_cpu_adapter: true,
            ..Default::default()
        };
        let Ok(g) = GpuBackend::new(&opts) else {
            assert!(
                std::env::var("CI").as_deref() != Ok("true"),
                "CI=true but no GPU adapter"
            );
            return;
        };
        let mut c = Carry::new(1 << 20);
        let key = |id| ExpertKey { layer: 3, id };
        assert_eq!(c.pin(3, &[1, 2]), vec![false, false]);
        let (a, b) = (c.new_set_id(), c.new_set_id());
        assert!(c.keep(
            3,
            (32, 64),
            &HashSet::new(),
            vec![(a, set(&g, 64), vec![(1, 0), (2, 1)])]
        ));
        assert!(
            c.find(key(1)).is_none(),
            "kept for the next pass, not this one"
        );
        assert_eq!(c.pin(3, &[1, 2, 5]), vec![true, true, false]);
        assert_eq!(c.pin(4, &[1]), vec![false], "another layer holds nothing");
        let (set_a, slot, _) = c.find(key(2)).unwrap();
        assert_eq!((set_a, slot), (a, 1));
        // This pass reuses set a and makes b for expert 5.
        let reused: HashSet<u64> = [a].into();
        assert!(c.keep(3, (32, 64), &reused, vec![(b, set(&g, 64), vec![(5, 0)])]));
        assert_eq!(c.experts(), 3);
        assert_eq!(c.pin(3, &[5, 1]), vec![true, true]);
        // A pass that keeps nothing (decode) leaves nothing for the next one.
        assert_eq!(c.pin(3, &[5, 1]), vec![false, false]);
        assert_eq!((c.experts(), c.held()), (0, 0));
        // Over budget: not kept.
        let mut small = Carry::new(100);
        let id = small.new_set_id();
        assert!(!small.keep(
            3,
            (32, 64),
            &HashSet::new(),
            vec![(id, set(&g, 4096), vec![(1, 0)])]
        ));
        assert_eq!(small.pin(3, &[1]), vec![false]);
        assert!(!Carry::default().keep(3, (32, 64), &HashSet::new(), Vec::new()));
    }
}
