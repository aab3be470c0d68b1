//! The VRAM expert tier: routed experts kept on the device between calls in fixed slots,
//! least recently used evicted first, so a hit skips both the disk read and the upload.
//!
//! Slots live in pools of device buffers laid out exactly as the batched MoE kernel reads an
//! arena (gate+up rows of each slot back to back, then the down rows in a second arena), so
//! a resident expert is used in place by its slot index, with no copy.

use crate::routed_expert::ExpertKey;
use std::collections::{HashMap, HashSet};

/// Bookkeeping of the tier: which expert sits in which slot, recency, pins.
#[derive(Debug, Default)]
pub(crate) struct ExpertTier {
    capacity: usize,
    per_pool: usize,
    /// `(I, D)` of the experts the slots are sized for.
    dims: (usize, usize),
    slots: HashMap<ExpertKey, (usize, u64)>,
    /// Slots never filled yet, handed out before any eviction.
    fresh: usize,
    pinned: HashSet<ExpertKey>,
    tick: u64,
    /// The expert the last [`ExpertTier::reserve`] evicted, until taken.
    evicted: Option<ExpertKey>,
}

impl ExpertTier {
    /// A tier of `capacity` slots for `[I, D]` experts, `per_pool` slots per device pool.
    pub(crate) fn new(capacity: usize, per_pool: usize, dims: (usize, usize)) -> Self {
        Self {
            capacity,
            per_pool: per_pool.max(1),
            dims,
            ..Default::default()
        }
    }

    /// Slots in all.
    pub(crate) fn capacity(&self) -> usize {
        self.capacity
    }

    /// Slots per device pool.
    pub(crate) fn per_pool(&self) -> usize {
        self.per_pool
    }

    /// `(I, D)` the slots are sized for.
    pub(crate) fn dims(&self) -> (usize, usize) {
        self.dims
    }

    /// Slots in pool `p` (the last pool may be short).
    pub(crate) fn pool_slots(&self, p: usize) -> usize {
        self.capacity
            .saturating_sub(p * self.per_pool)
            .min(self.per_pool)
    }

    /// The slot of `key`, marked most recently used.
    pub(crate) fn lookup(&mut self, key: ExpertKey) -> Option<usize> {
        self.tick += 1;
        let tick = self.tick;
        self.slots.get_mut(&key).map(|(s, t)| {
            *t = tick;
            *s
        })
    }

    /// Replaces the pins with the resident experts among `ids` of `layer`; returns one
    /// residency flag per id.
    pub(crate) fn pin(&mut self, layer: usize, ids: &[u32]) -> Vec<bool> {
        self.pinned.clear();
        ids.iter()
            .map(|&id| {
                let key = ExpertKey { layer, id };
                let hit = self.lookup(key).is_some();
                if hit {
                    self.pinned.insert(key);
                }
                hit
            })
            .collect()
    }

    /// A slot for `key`: a never-used one, else the least recently used slot that is not
    /// pinned and not in `busy` (slots the current call already uses). `None` when every
    /// slot is taken that way; the caller then uploads the expert for this call only.
    pub(crate) fn reserve(&mut self, key: ExpertKey, busy: &HashSet<usize>) -> Option<usize> {
        if self.capacity == 0 {
            return None;
        }
        let slot = if self.fresh < self.capacity {
            self.fresh += 1;
            self.fresh - 1
        } else {
            let victim = self
                .slots
                .iter()
                .filter(|(k, (s, _))| !self.pinned.contains(k) && !busy.contains(s))
                .min_by_key(|(_, (_, t))| *t)
                .map(|(&k, &(s, _))| (k, s))?;
            self.slots.remove(&victim.0);
            self.evicted = Some(victim.0);
            victim.1
        };
        self.tick += 1;
        self.slots.insert(key, (slot, self.tick));
        Some(slot)
    }

    /// The expert the last reservation evicted from its slot, once.
    pub(crate) fn take_evicted(&mut self) -> Option<ExpertKey> {
        self.evicted.take()
    }

    /// Whether `key` is held, without marking it used.
    pub(crate) fn holds(&self, key: ExpertKey) -> bool {
        self.slots.contains_key(&key)
    }

    /// Experts held.
    pub(crate) fn len(&self) -> usize {
        self.slots.len()
    }

    #[cfg(test)]
    /// True when no expert is held.
    pub(crate) fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn k(layer: usize, id: u32) -> ExpertKey {
        ExpertKey { layer, id }
    }

    #[test]
    fn fills_fresh_slots_then_evicts_the_least_recent_unpinned() {
        let mut t = ExpertTier::new(2, 1, (32, 64));
        let none = HashSet::new();
        assert_eq!(t.reserve(k(0, 1), &none), Some(0));
        assert_eq!(t.reserve(k(0, 2), &none), Some(1));
        assert_eq!(t.lookup(k(0, 1)), Some(0));
        assert_eq!(t.take_evicted(), None, "fresh slots evict nothing");
        // 2 is the least recent: evicted for 3.
        assert_eq!(t.reserve(k(1, 3), &none), Some(1));
        assert_eq!(t.take_evicted(), Some(k(0, 2)));
        assert_eq!(t.take_evicted(), None, "taken once");
        assert!(t.holds(k(1, 3)) && !t.holds(k(0, 2)));
        assert_eq!(t.lookup(k(0, 2)), None);
        // Pin 1 (layer 0): 3 must go even though it is more recent.
        assert_eq!(t.pin(0, &[1, 2]), vec![true, false]);
        assert_eq!(t.reserve(k(0, 2), &none), Some(1));
        // Both slots pinned or busy: no slot.
        let busy: HashSet<usize> = [1].into();
        assert_eq!(t.reserve(k(0, 4), &busy), None);
        assert_eq!(t.len(), 2);
    }

    #[test]
    fn zero_capacity_never_reserves_and_pools_split_the_slots() {
        let mut t = ExpertTier::new(0, 4, (32, 64));
        assert_eq!(t.reserve(k(0, 0), &HashSet::new()), None);
        assert!(t.is_empty());
        let t = ExpertTier::new(10, 4, (32, 64));
        assert_eq!(
            (
                t.pool_slots(0),
                t.pool_slots(1),
                t.pool_slots(2),
                t.pool_slots(3)
            ),
            (4, 4, 2, 0)
        );
    }
}
