//! The cache simulator behind `k3 bench cache`: replays a routing trace through the layer
//! caches' own [`SlotPolicy`], in the engine's order (per layer and chunk: every distinct
//! expert looked up in load order, then the misses offered in that order), and counts hits
//! and bytes read.

use super::cache_policy::{PolicyKind, SlotPolicy};
use super::usage_history::UsageHistory;
use crate::model::route_trace::RouteTrace;
use std::collections::HashMap;

/// What one replay counted.
#[derive(Clone, Debug, PartialEq)]
pub struct SimResult {
    /// Distinct experts looked up (per layer per chunk, as the engine's `expert_lookups`).
    pub lookups: u64,
    /// Of them, found in the cache (the engine's `expert_hits`).
    pub hits: u64,
    /// Tokens the trace covers.
    pub tokens: usize,
    /// Bytes of one expert.
    pub expert_bytes: u64,
}

impl SimResult {
    /// Hit rate in percent (0 when nothing was looked up).
    pub fn hit_percent(&self) -> f64 {
        if self.lookups == 0 {
            0.0
        } else {
            100.0 * self.hits as f64 / self.lookups as f64
        }
    }

    /// Expert bytes read from disk per token.
    pub fn bytes_per_token(&self) -> f64 {
        (self.lookups - self.hits) as f64 * self.expert_bytes as f64 / self.tokens.max(1) as f64
    }
}

/// The distinct experts of a record in lookup order: its `load` list, or (a trace without
/// one) the distinct experts in id order.
fn load_order(load: &[u32], experts: &[Vec<u32>]) -> Vec<u32> {
    if !load.is_empty() || experts.iter().all(|r| r.is_empty()) {
        return load.to_vec();
    }
    let mut v: Vec<u32> = experts.iter().flatten().copied().collect();
    v.sort_unstable();
    v.dedup();
    v
}

/// Replays `trace` through caches of `slots` per layer run by `kind`, each layer pinning
/// what `history` gives it for that many slots (none without a history).
pub fn replay(
    trace: &RouteTrace,
    kind: PolicyKind,
    slots: usize,
    history: Option<&UsageHistory>,
) -> SimResult {
    let mut caches: HashMap<usize, SlotPolicy> = HashMap::new();
    let (mut lookups, mut hits) = (0u64, 0u64);
    let mut misses = Vec::new();
    for r in &trace.records {
        let cache = caches.entry(r.layer).or_insert_with(|| {
            let pins = history.map(|h| h.pins(r.layer, slots)).unwrap_or_default();
            SlotPolicy::new(kind, slots, &pins)
        });
        misses.clear();
        for id in load_order(&r.load, &r.experts) {
            lookups += 1;
            if cache.lookup(id) {
                hits += 1;
            } else {
                misses.push(id);
            }
        }
        for &id in &misses {
            cache.insert(id);
        }
    }
    SimResult {
        lookups,
        hits,
        tokens: trace.tokens(),
        expert_bytes: trace.header.expert_bytes,
    }
}

/// The offline optimum (Belady's MIN, which may also decline to keep a read expert): with
/// the whole trace known, a full cache gives up the expert needed again furthest ahead. No
/// policy can beat it, so it bounds what any policy can gain over LRU on a trace.
pub fn replay_optimal(trace: &RouteTrace, slots: usize) -> SimResult {
    // Per layer, the chunk index of each record, then each (record, expert)'s next use.
    let mut by_layer: HashMap<usize, Vec<Vec<u32>>> = HashMap::new();
    for r in &trace.records {
        by_layer
            .entry(r.layer)
            .or_default()
            .push(load_order(&r.load, &r.experts));
    }
    let (mut lookups, mut hits) = (0u64, 0u64);
    for chunks in by_layer.values() {
        // next[c][i]: the chunk where chunks[c][i] is needed next (usize::MAX: never).
        let mut next: Vec<Vec<usize>> = chunks.iter().map(|c| vec![usize::MAX; c.len()]).collect();
        let mut seen: HashMap<u32, usize> = HashMap::new();
        for (c, ids) in chunks.iter().enumerate().rev() {
            for (i, id) in ids.iter().enumerate() {
                if let Some(&n) = seen.get(id) {
                    next[c][i] = n;
                }
            }
            for &id in ids {
                seen.insert(id, c);
            }
        }
        // Held experts keyed by next use: (next chunk, id).
        let mut held: std::collections::BTreeSet<(usize, u32)> = Default::default();
        let mut next_of: HashMap<u32, usize> = HashMap::new();
        for (c, ids) in chunks.iter().enumerate() {
            let mut misses = Vec::new();
            for (i, &id) in ids.iter().enumerate() {
                lookups += 1;
                if let Some(n) = next_of.remove(&id) {
                    hits += 1;
                    held.remove(&(n, id));
                    held.insert((next[c][i], id));
                    next_of.insert(id, next[c][i]);
                } else {
                    misses.push((id, next[c][i]));
                }
            }
            for (id, n) in misses {
                if slots == 0 || n == usize::MAX {
                    continue;
                }
                if held.len() >= slots {
                    let Some(&(far, victim)) = held.last() else {
                        continue;
                    };
                    if far <= n {
                        continue;
                    }
                    held.remove(&(far, victim));
                    next_of.remove(&victim);
                }
                held.insert((n, id));
                next_of.insert(id, n);
            }
        }
    }
    SimResult {
        lookups,
        hits,
        tokens: trace.tokens(),
        expert_bytes: trace.header.expert_bytes,
    }
}

/// The usage a trace teaches: selections per (layer, expert), `layers × experts`.
pub fn usage_of(trace: &RouteTrace) -> Vec<f64> {
    let e = trace.header.experts;
    let mut u = vec![0.0; trace.header.layers * e];
    for r in &trace.records {
        for &x in r.experts.iter().flatten() {
            if let Some(c) = u.get_mut(r.layer * e + x as usize) {
                *c += 1.0;
            }
        }
    }
    u
}

/// Routed expert picks of a trace over its distinct lookups: how many times fewer experts
/// chunking reads than tokens route to.
pub fn dedup_factor(trace: &RouteTrace) -> f64 {
    let picks: usize = trace
        .records
        .iter()
        .map(|r| r.experts.iter().map(Vec::len).sum::<usize>())
        .sum();
    let distinct: usize = trace
        .records
        .iter()
        .map(|r| load_order(&r.load, &r.experts).len())
        .sum();
    picks as f64 / distinct.max(1) as f64
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::route_trace::{TraceHeader, TraceRecord};

    fn trace(chunks: &[&[&[u32]]]) -> RouteTrace {
        let mut t = RouteTrace::new(TraceHeader::new(1, vec![0], 8, 2, 10, "t".into()));
        let mut pos = 0;
        for c in chunks {
            let experts: Vec<Vec<u32>> = c.iter().map(|r| r.to_vec()).collect();
            t.records.push(TraceRecord {
                pos,
                layer: 0,
                load: Vec::new(),
                weights: experts.iter().map(|r| vec![0.5; r.len()]).collect(),
                experts,
            });
            pos += c.len();
        }
        t
    }

    #[test]
    fn counts_distinct_lookups_per_chunk_and_lru_hits() {
        // Chunk 1 routes 1,2 and 2,3 (3 distinct); chunk 2 routes 3,4: with 2 LRU slots the
        // cache holds 2,3 after chunk 1, so 3 hits.
        let t = trace(&[&[&[1, 2], &[2, 3]], &[&[3, 4]]]);
        let r = replay(&t, PolicyKind::Lru, 2, None);
        assert_eq!((r.lookups, r.hits, r.tokens), (5, 1, 3));
        assert_eq!(r.bytes_per_token(), 4.0 * 10.0 / 3.0);
        assert!((dedup_factor(&t) - 6.0 / 5.0).abs() < 1e-12);
        let none = replay(&t, PolicyKind::Lru, 0, None);
        assert_eq!(none.hits, 0);
        // One slot: only 3 is needed again, and both LRU and the optimum keep it.
        let opt = replay_optimal(&t, 1);
        assert_eq!((opt.lookups, opt.hits), (5, 1));
        let lru1 = replay(&t, PolicyKind::Lru, 1, None);
        assert_eq!(lru1.hits, 1, "LRU with one slot keeps 3, the last read");
        let t2 = trace(&[&[&[1, 2]], &[&[3, 4]], &[&[1, 5]]]);
        assert_eq!(replay(&t2, PolicyKind::Lru, 1, None).hits, 0);
        assert_eq!(replay_optimal(&t2, 1).hits, 1, "MIN keeps 1 for its reuse");
    }
}
