use super::*;

/// Runs the engine's call order for one chunk: every lookup, then the misses inserted.
fn chunk(p: &mut SlotPolicy, ids: &[u32]) -> Vec<u32> {
    let misses: Vec<u32> = ids.iter().copied().filter(|&i| !p.lookup(i)).collect();
    let mut out = Vec::new();
    for m in misses {
        if let Some(e) = p.insert(m).evicted {
            out.push(e);
        }
    }
    out
}

#[test]
fn a_bare_cache_setup_runs_the_default_policy_auto() {
    assert_eq!(PolicyKind::default(), PolicyKind::Auto);
    assert_eq!(CacheSetup::default().kind, PolicyKind::default());
}

#[test]
fn names_round_trip_and_unknown_is_refused() {
    for k in PolicyKind::ALL {
        assert_eq!(k.name().parse::<PolicyKind>().unwrap(), k);
    }
    assert_eq!(" LRU ".parse::<PolicyKind>().unwrap(), PolicyKind::Lru);
    let e = "arc".parse::<PolicyKind>().unwrap_err().to_string();
    assert!(e.contains("\"arc\"") && e.contains("lfu-decay"), "{e}");
}

#[test]
fn lru_evicts_least_recent() {
    let mut p = SlotPolicy::new(PolicyKind::Lru, 3, &[]);
    assert!(chunk(&mut p, &[1, 2, 3]).is_empty());
    assert!(p.lookup(1));
    assert_eq!(p.eviction_order(), vec![2, 3, 1]);
    assert_eq!(chunk(&mut p, &[4]), vec![2]);
    assert_eq!(chunk(&mut p, &[5, 1]), vec![3]);
    assert_eq!(
        p.eviction_order(),
        vec![4, 1, 5],
        "1 was looked up before 5 went in"
    );
    assert_eq!(p.insert(9).evicted, Some(4));
}

#[test]
fn lfu_decay_keeps_the_frequent_and_refuses_a_one_off() {
    let mut p = SlotPolicy::new(PolicyKind::LfuDecay, 2, &[]);
    chunk(&mut p, &[1, 2]);
    for _ in 0..3 {
        assert!(p.lookup(1));
    }
    assert_eq!(p.eviction_order(), vec![2, 1]);
    // 3 is new: one use now outweighs 2's one older, decayed use.
    assert_eq!(chunk(&mut p, &[3]), vec![2]);
    assert_eq!(p.eviction_order(), vec![3, 1]);
    // 4's single use is below both held counts: it is read but not kept.
    assert!(p.lookup(3));
    assert!(p.lookup(3));
    assert!(!p.lookup(4));
    let r = p.insert(4);
    assert_eq!(
        r,
        Inserted {
            held: false,
            evicted: None
        }
    );
    assert!(p.contains(1) && p.contains(3) && !p.contains(4));
}

#[test]
fn lfu_decay_forgets_old_uses() {
    let mut p = LfuDecay::new(1, 4.0);
    p.lookup(1);
    p.insert(1);
    for _ in 0..8 {
        p.lookup(1);
    }
    // 9 uses, then 200 lookups of other experts (50 half-lives): 1's count falls below one
    // fresh use, so a newcomer used twice takes its slot.
    for i in 0..200 {
        p.lookup(1000 + i);
    }
    p.lookup(7);
    p.lookup(7);
    assert_eq!(p.insert(7).evicted, Some(1));
}

#[test]
fn two_q_keeps_reused_experts_over_one_offs() {
    let mut p = TwoQ::new(4); // kin 1, kout 2
    for id in [1, 2, 3, 4] {
        assert!(!p.lookup(id));
        p.insert(id);
    }
    // Full with am empty: the oldest first use leaves to the ghosts.
    assert!(!p.lookup(5));
    assert_eq!(p.insert(5).evicted, Some(1));
    assert_eq!(p.ghosts(), vec![1]);
    // 1 asked for again: it enters am, evicting a1in's oldest (2).
    assert!(!p.lookup(1));
    assert_eq!(p.insert(1).evicted, Some(2));
    assert!(p.am.contains(1));
    // A stream of one-offs now cycles through a1in and never evicts 1.
    for id in 10..30 {
        assert!(!p.lookup(id));
        assert_ne!(p.insert(id).evicted, Some(1));
    }
    assert!(p.lookup(1), "the reused expert survived the scan");
    assert_eq!(p.ghosts().len(), 2, "ghosts are bounded");
}

#[test]
fn pins_keep_their_slots_and_are_never_evicted() {
    // Pins beyond half the slots are dropped.
    let mut p = SlotPolicy::new(PolicyKind::Lru, 4, &[7, 8, 9]);
    assert!(chunk(&mut p, &[7]).is_empty());
    for id in 100..120 {
        assert!(!p.lookup(id));
        let r = p.insert(id);
        assert_ne!(r.evicted, Some(7));
    }
    assert!(p.lookup(7));
    assert_eq!(p.len(), 3, "two LRU slots and the one pin held so far");
    assert_ne!(p.insert(9).evicted, Some(7));
    assert!(!p.pins.contains(&9), "only half the slots are pinned");
    assert!(
        chunk(&mut p, &[8]).is_empty(),
        "a pin takes its reserved slot"
    );
    assert_eq!(p.len(), 4);
}

#[test]
fn zero_capacity_holds_nothing() {
    for k in PolicyKind::ALL {
        let mut p = SlotPolicy::new(k, 0, &[1]);
        assert!(!p.lookup(1));
        assert!(!p.insert(1).held, "{k}");
        assert!(p.is_empty());
    }
}

/// Runs `passes` through a fresh policy in the engine's call order: the hits, the policy.
fn run_passes(kind: PolicyKind, capacity: usize, passes: &[Vec<u32>]) -> (usize, SlotPolicy) {
    let mut p = SlotPolicy::new(kind, capacity, &[]);
    let mut hits = 0;
    for pass in passes {
        let misses: Vec<u32> = pass.iter().copied().filter(|&i| !p.lookup(i)).collect();
        hits += pass.len() - misses.len();
        for m in misses {
            p.insert(m);
        }
    }
    (hits, p)
}

fn follows_recency(p: &SlotPolicy) -> bool {
    p.follows_recency().expect("an auto policy")
}

/// Topics of four experts, each used for eight passes, then the next topic: lfu-decay keeps
/// the last topic's experts (higher counts) while the new ones miss; LRU takes them at once.
fn topic_runs() -> Vec<Vec<u32>> {
    (0..40u32)
        .flat_map(|topic| (0..8).map(move |_| (0..4).map(|i| topic * 4 + i).collect()))
        .collect()
}

/// A hot set of three in every pass, and two experts no pass uses again: LRU lets each
/// pass's second one-off evict a hot expert; lfu-decay keeps the hot set.
fn hot_set_with_one_offs() -> Vec<Vec<u32>> {
    (0..300u32)
        .map(|k| vec![1, 2, 3, 100 + 2 * k, 101 + 2 * k])
        .collect()
}

#[test]
fn only_auto_reports_a_mode() {
    for k in PolicyKind::ALL {
        let p = SlotPolicy::new(k, 4, &[]);
        assert_eq!(p.follows_recency().is_some(), k == PolicyKind::Auto, "{k}");
    }
}

#[test]
fn auto_follows_lru_where_topics_move() {
    let passes = topic_runs();
    let (lru, _) = run_passes(PolicyKind::Lru, 6, &passes);
    let (lfu, _) = run_passes(PolicyKind::LfuDecay, 6, &passes);
    let (auto, p) = run_passes(PolicyKind::Auto, 6, &passes);
    assert!(lru > lfu + 100, "the trace must favour LRU: {lru} vs {lfu}");
    assert!(follows_recency(&p));
    assert!(
        auto + 12 >= lru && auto > lfu + 80,
        "auto {auto}, lru {lru}, lfu-decay {lfu}"
    );
}

#[test]
fn auto_follows_lfu_decay_where_a_hot_set_stays() {
    let passes = hot_set_with_one_offs();
    let (lru, _) = run_passes(PolicyKind::Lru, 4, &passes);
    let (lfu, _) = run_passes(PolicyKind::LfuDecay, 4, &passes);
    let (auto, p) = run_passes(PolicyKind::Auto, 4, &passes);
    assert!(
        lfu > lru + 200,
        "the trace must favour lfu-decay: {lfu} vs {lru}"
    );
    assert!(!follows_recency(&p));
    assert!(auto + 6 >= lfu, "auto {auto}, lfu-decay {lfu}, lru {lru}");
}

#[test]
fn auto_switches_back_and_keeps_its_held_set_consistent() {
    // Topic runs, then a hot set, then topic runs again: the mode follows each phase, and
    // the held set stays within capacity with one order listing exactly what is held.
    let mut passes = topic_runs();
    passes.extend(hot_set_with_one_offs());
    let (_, p) = run_passes(PolicyKind::Auto, 4, &passes);
    assert!(
        !follows_recency(&p),
        "the hot-set phase ends under lfu-decay"
    );
    passes.extend(
        topic_runs()
            .into_iter()
            .map(|v| v.iter().map(|i| i + 10_000).collect()),
    );
    let (_, mut p) = run_passes(PolicyKind::Auto, 4, &passes);
    assert!(follows_recency(&p), "the last topic phase ends under LRU");
    let order = p.eviction_order();
    assert_eq!(order.len(), p.len());
    assert!(p.len() <= 4);
    let mut sorted = order.clone();
    sorted.sort_unstable();
    sorted.dedup();
    assert_eq!(sorted.len(), order.len(), "no expert listed twice");
    assert!(order.iter().all(|&id| p.contains(id)));
    let first = order[0];
    assert!(p.remove(first) && !p.contains(first) && p.len() == order.len() - 1);
}
