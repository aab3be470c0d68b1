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
