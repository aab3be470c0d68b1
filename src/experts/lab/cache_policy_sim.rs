//! The cache simulator behind `k3 bench cache`: replays a routing trace through the layer
//! caches' own [`SlotPolicy`], in the engine's order (per layer and chunk: every distinct
//! expert looked up in load order, then the misses offered in that order), and counts hits
//! and bytes read.

use crate::experts::cache::cache_policy::{PolicyKind, SlotPolicy};
use crate::experts::cache::usage_history::UsageHistory;
use crate::experts::telemetry::route_trace::RouteTrace;
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

/// The best fixed set in hindsight: each layer holds, from the first chunk on and without
/// reading them, the `slots` experts its chunks look up most often (ties to the lower id).
///
/// When a trace's chunks are independent draws given a context that does not change (the
/// fitted routing model of `cache_policy_synth.rs`, drift 0), this bounds every online
/// policy, prefetching included: what a cache holds at a chunk depends only on earlier
/// chunks, so its expected hits there are at most those of the most likely `slots` experts,
/// and on the trace itself the most used set scores at least as well as the most likely one.
/// On a trace whose context moves it bounds nothing (an adaptive policy can beat it).
pub fn replay_best_fixed_set(trace: &RouteTrace, slots: usize) -> SimResult {
    let mut uses: HashMap<usize, HashMap<u32, u64>> = HashMap::new();
    let mut lookups = 0u64;
    for r in &trace.records {
        let layer = uses.entry(r.layer).or_default();
        for id in load_order(&r.load, &r.experts) {
            lookups += 1;
            *layer.entry(id).or_default() += 1;
        }
    }
    let hits = uses
        .values()
        .map(|layer| {
            let mut counts: Vec<(u64, u32)> = layer.iter().map(|(&id, &n)| (n, id)).collect();
            counts.sort_unstable_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
            counts.iter().take(slots).map(|&(n, _)| n).sum::<u64>()
        })
        .sum();
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
    use crate::experts::telemetry::route_trace::{TraceHeader, TraceRecord};

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

    #[test]
    fn the_best_fixed_set_holds_the_most_used_from_the_start() {
        // Distinct lookups: chunk 1 {1, 2, 3}, chunk 2 {3, 4}: 3 is used twice, the rest once.
        let t = trace(&[&[&[1, 2], &[2, 3]], &[&[3, 4]]]);
        let one = replay_best_fixed_set(&t, 1);
        assert_eq!(
            (one.lookups, one.hits),
            (5, 2),
            "{{3}}, its first use a hit too"
        );
        assert_eq!(
            replay_best_fixed_set(&t, 2).hits,
            3,
            "{{3, 1}}: ties go to the lower id"
        );
        assert_eq!(replay_best_fixed_set(&t, 0).hits, 0);
        assert_eq!(replay_best_fixed_set(&t, 9).hits, 5);
    }

    /// The most hits any schedule of held sets can get: after each chunk's lookups the cache
    /// may keep any subset of what it held and what the chunk read, up to `slots`.
    fn exhaustive(chunks: &[u32], slots: usize) -> u64 {
        fn best(
            chunks: &[u32],
            slots: usize,
            c: usize,
            held: u32,
            memo: &mut HashMap<(usize, u32), u64>,
        ) -> u64 {
            let Some(&now) = chunks.get(c) else {
                return 0;
            };
            if let Some(&v) = memo.get(&(c, held)) {
                return v;
            }
            let hits = u64::from((held & now).count_ones());
            let pool = held | now;
            // Every subset of the pool, by the standard submask walk.
            let mut sub = pool;
            let mut top = 0;
            loop {
                if sub.count_ones() as usize <= slots {
                    top = top.max(best(chunks, slots, c + 1, sub, memo));
                }
                if sub == 0 {
                    break;
                }
                sub = (sub - 1) & pool;
            }
            memo.insert((c, held), hits + top);
            hits + top
        }
        best(chunks, slots, 0, 0, &mut HashMap::new())
    }

    #[test]
    fn the_optimum_equals_an_exhaustive_search_on_small_traces() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(23);
        for _ in 0..300 {
            // 4 to 9 chunks over 7 experts, one token each of 1 to 4 distinct experts.
            let chunks: Vec<Vec<u32>> = (0..rng.random_range(4..10))
                .map(|_| {
                    let mut row: Vec<u32> = (0..rng.random_range(1..5))
                        .map(|_| rng.random_range(0..7))
                        .collect();
                    row.sort_unstable();
                    row.dedup();
                    row
                })
                .collect();
            let rows: Vec<Vec<&[u32]>> = chunks.iter().map(|r| vec![r.as_slice()]).collect();
            let refs: Vec<&[&[u32]]> = rows.iter().map(Vec::as_slice).collect();
            let t = trace(&refs);
            let masks: Vec<u32> = chunks
                .iter()
                .map(|r| r.iter().fold(0, |m, &e| m | 1 << e))
                .collect();
            for slots in 0..5 {
                assert_eq!(
                    replay_optimal(&t, slots).hits,
                    exhaustive(&masks, slots),
                    "{chunks:?}, {slots} slots"
                );
            }
        }
    }
}
