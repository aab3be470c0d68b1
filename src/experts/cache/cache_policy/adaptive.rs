//! `auto`: a layer cache that gives up experts as LRU or as lfu-decay, whichever would have
//! hit more over the layer's recent lookups.
//!
//! Neither policy wins everywhere (docs/tuning.md, routing traces and cache policies):
//! lfu-decay keeps a stable working set that LRU would flush, and loses where routing moves
//! from topic to topic, because a newly read expert scores below the last topic's experts
//! until their counts decay, and misses again meanwhile. Both policies also run as ghosts
//! (expert ids only, the same slot count) beside the held set; every lookup scores which
//! ghost hit, and the held set is evicted by the one ahead.

use super::{Inserted, LfuDecay, Lru, LFU_HALF_LIFE_LOOKUPS};
use std::collections::{BTreeSet, HashSet};

/// Lookups over which the ghosts' hit difference halves: a decode token makes 16 a layer.
const JUDGE_HALF_LIFE_LOOKUPS: f64 = 256.0;

/// Decayed hits by which one ghost must lead before the held set follows it (so a tie does
/// not flip the policy at every lookup).
const SWITCH_MARGIN: f64 = 2.0;

/// The held set under whichever policy leads, and the two ghosts that judge them.
#[derive(Clone, Debug)]
pub(super) struct Adaptive {
    /// The held set, kept with lfu-decay's counts (which score every expert seen).
    lfu: LfuDecay,
    /// The held experts by the tick of their last use (LRU's order over the same set; the
    /// ticks are lfu-decay's, as in its `last`).
    recent: BTreeSet<(u64, u32)>,
    ghost_lru: Lru,
    ghost_lfu: LfuDecay,
    /// Ghost misses not inserted yet: the engine reads a pass's misses after all of its
    /// lookups, so a ghost inserts them when the pass's inserts begin or a new pass starts.
    pending_lru: Vec<u32>,
    pending_lfu: Vec<u32>,
    /// Experts looked up since the ghosts last inserted (a repeat means a new pass).
    pass: HashSet<u32>,
    /// Decayed (LRU ghost hits − lfu-decay ghost hits).
    lead: f64,
    /// What `lead` keeps of itself a lookup (half-life [`JUDGE_HALF_LIFE_LOOKUPS`]).
    decay: f64,
    /// Whether the held set is evicted least recently used first.
    recency: bool,
}

impl Adaptive {
    pub(super) fn new(capacity: usize) -> Self {
        Self {
            lfu: LfuDecay::new(capacity, LFU_HALF_LIFE_LOOKUPS),
            recent: BTreeSet::new(),
            ghost_lru: Lru::new(capacity),
            ghost_lfu: LfuDecay::new(capacity, LFU_HALF_LIFE_LOOKUPS),
            pending_lru: Vec::new(),
            pending_lfu: Vec::new(),
            pass: HashSet::new(),
            lead: 0.0,
            decay: (-1.0 / JUDGE_HALF_LIFE_LOOKUPS).exp2(),
            recency: false,
        }
    }

    pub(super) fn len(&self) -> usize {
        self.lfu.len()
    }

    pub(super) fn contains(&self, id: u32) -> bool {
        self.lfu.contains(id)
    }

    /// Whether the held set follows LRU now (else lfu-decay).
    pub(super) fn follows_recency(&self) -> bool {
        self.recency
    }

    /// Inserts the ghosts' pending misses, in lookup order.
    fn flush_ghosts(&mut self) {
        for id in std::mem::take(&mut self.pending_lru) {
            if !self.ghost_lru.contains(id) {
                self.ghost_lru.insert(id);
            }
        }
        for id in std::mem::take(&mut self.pending_lfu) {
            if !self.ghost_lfu.contains(id) {
                self.ghost_lfu.insert(id);
            }
        }
        self.pass.clear();
    }

    /// Scores the ghosts on a lookup of `id` and picks the policy the held set follows.
    fn judge(&mut self, id: u32) {
        if !self.pass.insert(id) {
            self.flush_ghosts();
            self.pass.insert(id);
        }
        let by_lru = self.ghost_lru.lookup(id);
        let by_lfu = self.ghost_lfu.lookup(id);
        if !by_lru {
            self.pending_lru.push(id);
        }
        if !by_lfu {
            self.pending_lfu.push(id);
        }
        self.lead =
            self.lead * self.decay + f64::from(u8::from(by_lru)) - f64::from(u8::from(by_lfu));
        if self.lead > SWITCH_MARGIN {
            self.recency = true;
        } else if self.lead < -SWITCH_MARGIN {
            self.recency = false;
        }
    }

    /// Drops held `id` from the recency order (before lfu-decay forgets its tick).
    fn forget(&mut self, id: u32) {
        if let Some(&t) = self.lfu.last.get(&id) {
            self.recent.remove(&(t, id));
        }
    }

    pub(super) fn lookup(&mut self, id: u32) -> bool {
        self.judge(id);
        self.forget(id);
        let hit = self.lfu.lookup(id);
        if hit {
            self.recent.insert((self.lfu.tick, id));
        }
        hit
    }

    pub(super) fn insert(&mut self, id: u32) -> Inserted {
        self.flush_ghosts();
        if self.lfu.capacity == 0 {
            return Inserted {
                held: false,
                evicted: None,
            };
        }
        let mut evicted = None;
        if self.recency && self.len() >= self.lfu.capacity {
            // LRU admits every read expert: make room by recency, then lfu-decay has a
            // free slot and keeps it.
            if let Some((_, victim)) = self.recent.pop_first() {
                self.lfu.remove(victim);
                evicted = Some(victim);
            }
        }
        // The expert lfu-decay gives up if it needs room: its lowest, with its last tick.
        let lowest = self.lfu.held.first().map(|&(_, t, victim)| (t, victim));
        let r = self.lfu.insert(id);
        if let (Some(victim), Some(lowest)) = (r.evicted, lowest) {
            debug_assert_eq!(victim, lowest.1);
            self.recent.remove(&lowest);
        }
        if r.held {
            self.recent.insert((self.lfu.tick, id));
        }
        Inserted {
            held: r.held,
            evicted: evicted.or(r.evicted),
        }
    }

    pub(super) fn order(&self) -> Vec<u32> {
        if self.recency {
            self.recent.iter().map(|&(_, id)| id).collect()
        } else {
            self.lfu.order()
        }
    }

    pub(super) fn remove(&mut self, id: u32) -> bool {
        self.forget(id);
        self.lfu.remove(id)
    }
}
