//! Which expert a full layer cache gives up: the eviction policies, over expert ids only, so
//! the engine's [`super::expert_cache::LayerCache`] and the cache simulator
//! (`cache_policy_sim.rs`) run the same code.
//!
//! Every policy sees the same calls, in the engine's order: one [`SlotPolicy::lookup`] per
//! distinct expert a layer needs for a chunk (all of them first, in load order), then one
//! [`SlotPolicy::insert`] per miss that was read, in load order.

use anyhow::{bail, Result};
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};
use std::fmt;
use std::str::FromStr;

/// The eviction policies a layer cache can run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum PolicyKind {
    /// Least recently used goes first.
    #[default]
    Lru,
    /// Frequency with exponential decay: the expert with the lowest decayed use count goes
    /// first, and a newly read expert whose count is lower than every held one is not kept.
    LfuDecay,
    /// 2Q: a first use enters a small FIFO; only an expert asked for again after leaving it
    /// (remembered in a ghost list) enters the main LRU, so one-off experts cannot flush it.
    TwoQ,
}

impl PolicyKind {
    /// Every policy, in the order reports list them.
    pub const ALL: [PolicyKind; 3] = [PolicyKind::Lru, PolicyKind::LfuDecay, PolicyKind::TwoQ];

    /// The name `--cache-policy` takes.
    pub fn name(self) -> &'static str {
        match self {
            PolicyKind::Lru => "lru",
            PolicyKind::LfuDecay => "lfu-decay",
            PolicyKind::TwoQ => "2q",
        }
    }
}

impl fmt::Display for PolicyKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for PolicyKind {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Self> {
        let t = s.trim().to_ascii_lowercase();
        match PolicyKind::ALL.iter().find(|k| k.name() == t) {
            Some(&k) => Ok(k),
            None => bail!("unknown cache policy {s:?}: expected one of lru, lfu-decay, 2q"),
        }
    }
}

/// How every layer cache of an expert source runs: the policy and each layer's pins.
#[derive(Clone, Debug, Default)]
pub struct CacheSetup {
    /// The eviction policy of every layer.
    pub kind: PolicyKind,
    /// Pinned experts by layer (from the usage history), heaviest first.
    pub pins: std::sync::Arc<HashMap<usize, Vec<u32>>>,
}

impl CacheSetup {
    /// The pins of `layer` (none when the history has none).
    pub fn pins_for(&self, layer: usize) -> &[u32] {
        self.pins.get(&layer).map_or(&[], Vec::as_slice)
    }
}

/// Half-life of LFU-decay's use counts, in lookups of the layer (a decode token makes 16).
pub const LFU_HALF_LIFE_LOOKUPS: f64 = 64.0;

/// What [`SlotPolicy::insert`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Inserted {
    /// The expert is held now.
    pub held: bool,
    /// The expert given up to make room.
    pub evicted: Option<u32>,
}

/// One layer's eviction state: which experts are held and which goes next. Pinned experts
/// (from the usage history) keep their own slots, outside the policy's.
#[derive(Clone, Debug)]
pub struct SlotPolicy {
    pins: HashSet<u32>,
    pinned_held: BTreeSet<u32>,
    inner: Inner,
}

#[derive(Clone, Debug)]
enum Inner {
    Lru(Lru),
    Lfu(LfuDecay),
    TwoQ(TwoQ),
}

impl SlotPolicy {
    /// A policy for `capacity` slots, `pins` (at most half of them, the rest are ignored by
    /// the caller's choice) reserved for the pinned experts.
    pub fn new(kind: PolicyKind, capacity: usize, pins: &[u32]) -> Self {
        let pins: HashSet<u32> = pins.iter().copied().take(capacity / 2).collect();
        let free = capacity - pins.len();
        let inner = match kind {
            PolicyKind::Lru => Inner::Lru(Lru::new(free)),
            PolicyKind::LfuDecay => Inner::Lfu(LfuDecay::new(free, LFU_HALF_LIFE_LOOKUPS)),
            PolicyKind::TwoQ => Inner::TwoQ(TwoQ::new(free)),
        };
        Self {
            pins,
            pinned_held: BTreeSet::new(),
            inner,
        }
    }

    /// Experts held.
    pub fn len(&self) -> usize {
        self.pinned_held.len()
            + match &self.inner {
                Inner::Lru(p) => p.len(),
                Inner::Lfu(p) => p.len(),
                Inner::TwoQ(p) => p.len(),
            }
    }

    /// True when nothing is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether `id` is held, without counting a use.
    pub fn contains(&self, id: u32) -> bool {
        self.pinned_held.contains(&id)
            || match &self.inner {
                Inner::Lru(p) => p.contains(id),
                Inner::Lfu(p) => p.contains(id),
                Inner::TwoQ(p) => p.contains(id),
            }
    }

    /// A use of `id`: true when it is held (a hit).
    pub fn lookup(&mut self, id: u32) -> bool {
        if self.pinned_held.contains(&id) {
            return true;
        }
        match &mut self.inner {
            Inner::Lru(p) => p.lookup(id),
            Inner::Lfu(p) => p.lookup(id),
            Inner::TwoQ(p) => p.lookup(id),
        }
    }

    /// Offers `id`, just read after a missed lookup, to the cache.
    pub fn insert(&mut self, id: u32) -> Inserted {
        if self.contains(id) {
            return Inserted {
                held: true,
                evicted: None,
            };
        }
        if self.pins.contains(&id) {
            self.pinned_held.insert(id);
            return Inserted {
                held: true,
                evicted: None,
            };
        }
        match &mut self.inner {
            Inner::Lru(p) => p.insert(id),
            Inner::Lfu(p) => p.insert(id),
            Inner::TwoQ(p) => p.insert(id),
        }
    }

    /// Stops holding `id` (it moved to another tier), keeping what the policy learned of
    /// its uses; true when it was held.
    pub fn remove(&mut self, id: u32) -> bool {
        if self.pinned_held.remove(&id) {
            return true;
        }
        match &mut self.inner {
            Inner::Lru(p) => p.remove(id),
            Inner::Lfu(p) => p.remove(id),
            Inner::TwoQ(p) => p.remove(id),
        }
    }

    /// Held experts, the next to be evicted first; pinned ones (never evicted) last, by id.
    pub fn eviction_order(&self) -> Vec<u32> {
        let mut v = match &self.inner {
            Inner::Lru(p) => p.order(),
            Inner::Lfu(p) => p.order(),
            Inner::TwoQ(p) => p.order(),
        };
        v.extend(self.pinned_held.iter().copied());
        v
    }
}

/// Least recently used: a tick per use, the lowest tick goes.
#[derive(Clone, Debug)]
struct Lru {
    capacity: usize,
    tick: u64,
    by_tick: BTreeMap<u64, u32>,
    tick_of: HashMap<u32, u64>,
}

impl Lru {
    fn new(capacity: usize) -> Self {
        Self {
            capacity,
            tick: 0,
            by_tick: BTreeMap::new(),
            tick_of: HashMap::new(),
        }
    }
    fn len(&self) -> usize {
        self.tick_of.len()
    }
    fn contains(&self, id: u32) -> bool {
        self.tick_of.contains_key(&id)
    }
    fn touch(&mut self, id: u32) {
        self.tick += 1;
        if let Some(old) = self.tick_of.insert(id, self.tick) {
            self.by_tick.remove(&old);
        }
        self.by_tick.insert(self.tick, id);
    }
    fn lookup(&mut self, id: u32) -> bool {
        let hit = self.contains(id);
        if hit {
            self.touch(id);
        } else {
            self.tick += 1;
        }
        hit
    }
    fn pop_oldest(&mut self) -> Option<u32> {
        let (_, id) = self.by_tick.pop_first()?;
        self.tick_of.remove(&id);
        Some(id)
    }
    fn insert(&mut self, id: u32) -> Inserted {
        if self.capacity == 0 {
            return Inserted {
                held: false,
                evicted: None,
            };
        }
        let evicted = if self.len() >= self.capacity {
            self.pop_oldest()
        } else {
            None
        };
        self.touch(id);
        Inserted {
            held: true,
            evicted,
        }
    }
    fn order(&self) -> Vec<u32> {
        self.by_tick.values().copied().collect()
    }
    fn remove(&mut self, id: u32) -> bool {
        match self.tick_of.remove(&id) {
            Some(t) => self.by_tick.remove(&t).is_some(),
            None => false,
        }
    }
}

/// A key that orders f64 totally (scores are finite).
#[derive(Clone, Copy, Debug, PartialEq)]
struct Score(f64);
impl Eq for Score {}
impl PartialOrd for Score {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Score {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        self.0.total_cmp(&o.0)
    }
}

/// Frequency with decay. A use count `c` decays as `c · 2^(-Δ/half_life)` over `Δ`
/// lookups; it is kept as the time-free key `log2(c) + t/half_life` (t: the tick of its last
/// update), so comparing keys compares decayed counts at any common time and the held set
/// stays ordered without rescoring.
#[derive(Clone, Debug)]
struct LfuDecay {
    capacity: usize,
    half_life: f64,
    tick: u64,
    /// Key of every expert seen in this layer, held or not (at most the layer's experts).
    key: HashMap<u32, f64>,
    held: BTreeSet<(Score, u64, u32)>,
    /// Tick of each held expert's last use (ties go to the older).
    last: HashMap<u32, u64>,
}

impl LfuDecay {
    fn new(capacity: usize, half_life: f64) -> Self {
        Self {
            capacity,
            half_life,
            tick: 0,
            key: HashMap::new(),
            held: BTreeSet::new(),
            last: HashMap::new(),
        }
    }
    fn len(&self) -> usize {
        self.last.len()
    }
    fn contains(&self, id: u32) -> bool {
        self.last.contains_key(&id)
    }
    fn now(&self) -> f64 {
        self.tick as f64 / self.half_life
    }
    /// Adds one use at the current tick: c' = c·2^-(Δ/h) + 1, in key form.
    fn bump(&mut self, id: u32) -> f64 {
        let now = self.now();
        let k = match self.key.get(&id) {
            // log2(2^(k - now) + 1) + now, computed without overflow for large k - now.
            Some(&k) => {
                let d = k - now;
                now + if d > 0.0 {
                    d + (1.0 + (-d).exp2()).log2()
                } else {
                    (d.exp2() + 1.0).log2()
                }
            }
            None => now,
        };
        self.key.insert(id, k);
        k
    }
    fn lookup(&mut self, id: u32) -> bool {
        self.tick += 1;
        let old = self.key.get(&id).copied();
        let k = self.bump(id);
        match (self.last.get(&id).copied(), old) {
            (Some(t), Some(o)) => {
                self.held.remove(&(Score(o), t, id));
                self.held.insert((Score(k), self.tick, id));
                self.last.insert(id, self.tick);
                true
            }
            _ => false,
        }
    }
    fn insert(&mut self, id: u32) -> Inserted {
        if self.capacity == 0 {
            return Inserted {
                held: false,
                evicted: None,
            };
        }
        // A lookup counted this use already; an insert without one counts it here.
        let k = match self.key.get(&id) {
            Some(&k) => k,
            None => {
                self.tick += 1;
                self.bump(id)
            }
        };
        let mut evicted = None;
        if self.len() >= self.capacity {
            let Some(&(low, t, victim)) = self.held.first() else {
                return Inserted {
                    held: false,
                    evicted: None,
                };
            };
            if Score(k) < low {
                // Used less than every held expert: keeping it would evict a better one.
                return Inserted {
                    held: false,
                    evicted: None,
                };
            }
            self.held.remove(&(low, t, victim));
            self.last.remove(&victim);
            evicted = Some(victim);
        }
        self.held.insert((Score(k), self.tick, id));
        self.last.insert(id, self.tick);
        Inserted {
            held: true,
            evicted,
        }
    }
    fn order(&self) -> Vec<u32> {
        self.held.iter().map(|&(_, _, id)| id).collect()
    }
    fn remove(&mut self, id: u32) -> bool {
        let (Some(t), Some(&k)) = (self.last.remove(&id), self.key.get(&id)) else {
            return false;
        };
        self.held.remove(&(Score(k), t, id))
    }
}

/// 2Q (Johnson and Shasha): `a1in` a FIFO of first uses (a quarter of the slots), `a1out`
/// the ids that recently left it (no bytes, half the slots), `am` an LRU of experts used
/// again after leaving `a1in`.
#[derive(Clone, Debug)]
struct TwoQ {
    capacity: usize,
    kin: usize,
    kout: usize,
    a1in: VecDeque<u32>,
    a1out: VecDeque<u32>,
    am: Lru,
}

impl TwoQ {
    fn new(capacity: usize) -> Self {
        Self {
            capacity,
            kin: (capacity / 4).max(1),
            kout: (capacity / 2).max(1),
            a1in: VecDeque::new(),
            a1out: VecDeque::new(),
            am: Lru::new(capacity),
        }
    }
    fn len(&self) -> usize {
        self.a1in.len() + self.am.len()
    }
    fn contains(&self, id: u32) -> bool {
        self.am.contains(id) || self.a1in.contains(&id)
    }
    fn lookup(&mut self, id: u32) -> bool {
        if self.am.contains(id) {
            self.am.lookup(id)
        } else {
            // A hit in a1in leaves it where it is: a burst of uses is one use.
            self.a1in.contains(&id)
        }
    }
    fn make_room(&mut self) -> Option<u32> {
        if self.len() < self.capacity {
            return None;
        }
        if self.a1in.len() > self.kin || self.am.len() == 0 {
            let id = self.a1in.pop_front()?;
            self.a1out.push_back(id);
            if self.a1out.len() > self.kout {
                self.a1out.pop_front();
            }
            Some(id)
        } else {
            self.am.pop_oldest()
        }
    }
    fn insert(&mut self, id: u32) -> Inserted {
        if self.capacity == 0 {
            return Inserted {
                held: false,
                evicted: None,
            };
        }
        let evicted = self.make_room();
        if let Some(at) = self.a1out.iter().position(|&g| g == id) {
            self.a1out.remove(at);
            self.am.touch(id);
        } else {
            self.a1in.push_back(id);
        }
        Inserted {
            held: true,
            evicted,
        }
    }
    fn order(&self) -> Vec<u32> {
        // Which queue yields next depends on their sizes then; this lists a1in (oldest
        // first) then am (least recent first), the order when a1in is over its share.
        self.a1in.iter().copied().chain(self.am.order()).collect()
    }
    fn remove(&mut self, id: u32) -> bool {
        if let Some(at) = self.a1in.iter().position(|&g| g == id) {
            self.a1in.remove(at);
            return true;
        }
        self.am.remove(id)
    }
    #[cfg(test)]
    fn ghosts(&self) -> Vec<u32> {
        self.a1out.iter().copied().collect()
    }
}

#[cfg(test)]
mod tests {
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
}
