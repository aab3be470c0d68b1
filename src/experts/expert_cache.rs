//! Per-layer expert cache: slots of one expert each, least recently used evicted first.

use super::expert_reader::LoadedExpert;
use std::collections::HashMap;
use std::sync::Arc;

/// The cache of one MoE layer.
pub struct LayerCache {
    capacity: usize,
    tick: u64,
    slots: HashMap<u32, (Arc<LoadedExpert>, u64)>,
}

impl LayerCache {
    /// An empty cache of `capacity` slots (0 disables caching).
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity,
            tick: 0,
            slots: HashMap::new(),
        }
    }

    /// Slots this layer may fill.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Experts currently held.
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    /// True when nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// Whether expert `id` is held, without marking it used.
    pub fn contains(&self, id: u32) -> bool {
        self.slots.contains_key(&id)
    }

    /// The cached expert `id`, marked most recently used.
    pub fn get(&mut self, id: u32) -> Option<Arc<LoadedExpert>> {
        self.tick += 1;
        let tick = self.tick;
        self.slots.get_mut(&id).map(|(e, t)| {
            *t = tick;
            e.clone()
        })
    }

    /// Caches `e`, evicting the least recently used expert when full.
    pub fn insert(&mut self, e: Arc<LoadedExpert>) {
        if self.capacity == 0 {
            return;
        }
        if self.slots.len() >= self.capacity && !self.slots.contains_key(&e.id) {
            if let Some(victim) = self
                .slots
                .iter()
                .min_by_key(|(_, (_, t))| *t)
                .map(|(&id, _)| id)
            {
                self.slots.remove(&victim);
            }
        }
        self.tick += 1;
        self.slots.insert(e.id, (e, self.tick));
    }

    /// Ids held, least recently used first (for tests and diagnostics).
    pub fn lru_order(&self) -> Vec<u32> {
        let mut v: Vec<(u64, u32)> = self.slots.iter().map(|(&id, (_, t))| (*t, id)).collect();
        v.sort_unstable();
        v.into_iter().map(|(_, id)| id).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::experts::expert_reader::tests_support::fake_expert;

    #[test]
    fn evicts_the_least_recently_used() {
        let mut c = LayerCache::new(2);
        c.insert(fake_expert(1));
        c.insert(fake_expert(2));
        assert!(c.get(1).is_some(), "touching 1 makes 2 the oldest");
        c.insert(fake_expert(3));
        assert_eq!(c.lru_order(), vec![1, 3]);
        assert!(c.get(2).is_none());
        c.insert(fake_expert(3));
        assert_eq!(c.len(), 2, "re-inserting a held expert evicts nothing");
    }

    #[test]
    fn zero_capacity_caches_nothing() {
        let mut c = LayerCache::new(0);
        c.insert(fake_expert(7));
        assert!(c.is_empty() && c.get(7).is_none());
    }
}
