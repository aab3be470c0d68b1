//! Per-layer expert cache: slots of one expert each; which expert leaves a full cache is the
//! layer's [`SlotPolicy`] (`--cache-policy`), the same code the cache simulator replays.

use crate::experts::cache::cache_policy::{PolicyKind, SlotPolicy};
use crate::routed_expert::LoadedExpert;
use std::collections::HashMap;
use std::sync::Arc;

/// The cache of one MoE layer.
pub(crate) struct LayerCache {
    capacity: usize,
    policy: SlotPolicy,
    slots: HashMap<u32, Arc<LoadedExpert>>,
}

impl LayerCache {
    /// An empty least-recently-used cache of `capacity` slots (0 disables caching).
    pub(crate) fn new(capacity: usize) -> Self {
        Self::with_policy(capacity, PolicyKind::Lru, &[])
    }

    /// An empty cache of `capacity` slots run by `kind`, with `pins` (at most half the slots)
    /// never evicted once read.
    pub(crate) fn with_policy(capacity: usize, kind: PolicyKind, pins: &[u32]) -> Self {
        Self {
            capacity,
            policy: SlotPolicy::new(kind, capacity, pins),
            slots: HashMap::new(),
        }
    }

    #[cfg(test)]
    /// Slots this layer may fill.
    pub(crate) fn capacity(&self) -> usize {
        self.capacity
    }

    /// Experts currently held.
    pub(crate) fn len(&self) -> usize {
        self.slots.len()
    }

    #[cfg(test)]
    /// True when nothing is cached.
    pub(crate) fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// For the `auto` policy, whether it evicts least recently used first now.
    pub(crate) fn follows_recency(&self) -> Option<bool> {
        self.policy.follows_recency()
    }

    /// Whether expert `id` is held, without marking it used.
    pub(crate) fn contains(&self, id: u32) -> bool {
        self.slots.contains_key(&id)
    }

    /// The cached expert `id`; the lookup counts as a use for the policy, hit or miss.
    pub(crate) fn get(&mut self, id: u32) -> Option<Arc<LoadedExpert>> {
        if self.policy.lookup(id) {
            self.slots.get(&id).cloned()
        } else {
            None
        }
    }

    /// Offers `e`, just read, to the cache; the policy decides what it evicts (or that `e`
    /// is not kept).
    pub(crate) fn insert(&mut self, e: Arc<LoadedExpert>) {
        let r = self.policy.insert(e.id);
        if let Some(victim) = r.evicted {
            self.slots.remove(&victim);
        }
        if r.held {
            self.slots.insert(e.id, e);
        }
    }

    /// Drops expert `id` (it moved to the backend's tier); true when it was held.
    pub(crate) fn remove(&mut self, id: u32) -> bool {
        self.policy.remove(id);
        self.slots.remove(&id).is_some()
    }

    #[cfg(test)]
    /// Ids held, the next to be evicted first (for tests and diagnostics).
    pub(crate) fn eviction_order(&self) -> Vec<u32> {
        self.policy.eviction_order()
    }

    /// This cache cut to `capacity` slots run by `kind` with `pins`: the experts the policy
    /// would evict last are offered to the smaller cache, least valuable first, and the
    /// rest are dropped (memory pressure). A capacity at or above this one keeps it whole.
    pub(crate) fn shrunk(mut self, capacity: usize, kind: PolicyKind, pins: &[u32]) -> Self {
        if capacity >= self.capacity {
            return self;
        }
        let order = self.policy.eviction_order();
        let keep = &order[order.len().saturating_sub(capacity)..];
        let mut next = Self::with_policy(capacity, kind, pins);
        for id in keep {
            if let Some(e) = self.slots.remove(id) {
                next.insert(e);
            }
        }
        next
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn evicts_the_least_recently_used() {
        let mut c = LayerCache::new(2);
        c.insert(std::sync::Arc::new(LoadedExpert::empty(1)));
        c.insert(std::sync::Arc::new(LoadedExpert::empty(2)));
        assert!(c.get(1).is_some(), "touching 1 makes 2 the oldest");
        c.insert(std::sync::Arc::new(LoadedExpert::empty(3)));
        assert_eq!(c.eviction_order(), vec![1, 3]);
        assert!(c.get(2).is_none());
        c.insert(std::sync::Arc::new(LoadedExpert::empty(3)));
        assert_eq!(c.len(), 2, "re-inserting a held expert evicts nothing");
        c.insert(std::sync::Arc::new(LoadedExpert::empty(4)));
        let order = c.eviction_order();
        let small = c.shrunk(1, PolicyKind::Lru, &[]);
        assert_eq!((small.capacity(), small.len()), (1, 1));
        assert_eq!(
            small.eviction_order(),
            vec![order[1]],
            "the most recent stays"
        );
    }

    #[test]
    fn a_removed_expert_leaves_its_slot_to_the_next() {
        for kind in PolicyKind::ALL {
            let mut c = LayerCache::with_policy(2, kind, &[]);
            for id in [1, 2] {
                assert!(c.get(id).is_none());
                c.insert(std::sync::Arc::new(LoadedExpert::empty(id)));
            }
            let before = c.len();
            assert!(c.remove(1), "{kind}");
            assert!(!c.remove(1), "{kind}: removed once");
            assert!(!c.contains(1) && c.get(1).is_none(), "{kind}");
            assert_eq!(c.len(), before - 1, "{kind}");
            assert!(!c.eviction_order().contains(&1), "{kind}");
            if c.get(3).is_none() {
                c.insert(std::sync::Arc::new(LoadedExpert::empty(3)));
            }
            assert!(c.len() <= 2, "{kind}");
        }
    }

    #[test]
    fn zero_capacity_caches_nothing() {
        let mut c = LayerCache::new(0);
        c.insert(std::sync::Arc::new(LoadedExpert::empty(7)));
        assert!(c.is_empty() && c.get(7).is_none());
    }

    #[test]
    fn bytes_follow_the_policy() {
        for kind in PolicyKind::ALL {
            let mut c = LayerCache::with_policy(3, kind, &[5]);
            for id in [5, 1, 2, 3, 4, 6] {
                if c.get(id).is_none() {
                    c.insert(std::sync::Arc::new(LoadedExpert::empty(id)));
                }
                let mut held: Vec<u32> = c.eviction_order();
                held.sort_unstable();
                let mut slots: Vec<u32> = c.slots.keys().copied().collect();
                slots.sort_unstable();
                assert_eq!(held, slots, "{kind}: the policy and the bytes agree");
                assert!(c.len() <= 3);
            }
            assert!(c.contains(5), "{kind}: the pin stays");
        }
    }
}
