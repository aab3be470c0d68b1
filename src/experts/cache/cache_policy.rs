//! Which expert a full layer cache gives up: the eviction policies, over expert ids only, so
//! the engine's `LayerCache` (`expert_cache.rs`) and the cache simulator
//! (`cache_policy_sim.rs`) run the same code.
//!
//! Every policy sees the same calls, in the engine's order: one [`SlotPolicy::lookup`] per
//! distinct expert a layer needs for a chunk (all of them first, in load order), then one
//! [`SlotPolicy::insert`] per miss that was read, in load order.

use anyhow::{bail, Result};
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};
use std::fmt;
use std::str::FromStr;

/// The eviction policies a layer cache can run. The default, [`PolicyKind::Auto`], is the
/// one default of every layer: `--cache-policy`, the engine's `CacheConfig` and a bare
/// [`CacheSetup`] take it from here.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum PolicyKind {
    /// Least recently used goes first.
    Lru,
    /// Frequency with exponential decay: the expert with the lowest decayed use count goes
    /// first, and a newly read expert whose count is lower than every held one is not kept.
    LfuDecay,
    /// 2Q: a first use enters a small FIFO; only an expert asked for again after leaving it
    /// (remembered in a ghost list) enters the main LRU, so one-off experts cannot flush it.
    TwoQ,
    /// LRU or lfu-decay, whichever would have hit more over the layer's recent lookups:
    /// both run beside the held set on expert ids alone (`Adaptive`).
    #[default]
    Auto,
}

impl PolicyKind {
    /// Every policy, in the order reports list them.
    pub const ALL: [PolicyKind; 4] = [
        PolicyKind::Lru,
        PolicyKind::LfuDecay,
        PolicyKind::TwoQ,
        PolicyKind::Auto,
    ];

    /// The name `--cache-policy` takes.
    pub fn name(self) -> &'static str {
        match self {
            PolicyKind::Lru => "lru",
            PolicyKind::LfuDecay => "lfu-decay",
            PolicyKind::TwoQ => "2q",
            PolicyKind::Auto => "auto",
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
            None => bail!("unknown cache policy {s:?}: expected one of lru, lfu-decay, 2q, auto"),
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
    Auto(Box<Adaptive>),
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
            PolicyKind::Auto => Inner::Auto(Box::new(Adaptive::new(free))),
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
                Inner::Auto(p) => p.len(),
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
                Inner::Auto(p) => p.contains(id),
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
            Inner::Auto(p) => p.lookup(id),
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
            Inner::Auto(p) => p.insert(id),
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
            Inner::Auto(p) => p.remove(id),
        }
    }

    /// For the `auto` policy, whether it evicts least recently used first now (else by
    /// lfu-decay); `None` for the other policies.
    pub fn follows_recency(&self) -> Option<bool> {
        match &self.inner {
            Inner::Auto(p) => Some(p.follows_recency()),
            _ => None,
        }
    }

    /// Held experts, the next to be evicted first; pinned ones (never evicted) last, by id.
    pub fn eviction_order(&self) -> Vec<u32> {
        let mut v = match &self.inner {
            Inner::Lru(p) => p.order(),
            Inner::Lfu(p) => p.order(),
            Inner::TwoQ(p) => p.order(),
            Inner::Auto(p) => p.order(),
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

mod adaptive;
use adaptive::Adaptive;

#[cfg(test)]
mod tests;
