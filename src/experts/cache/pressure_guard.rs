//! The memory-pressure guard: when the OS says memory is short
//! ([`crate::platform::memory_pressure`]), the expert cache hands part of itself back
//! instead of letting the machine compress and swap (on macOS the compressor slows every
//! phase 3-5x, docs/platforms.md). A warning keeps 3/4 of the cache, a critical signal
//! half; after a shrink the signal gets [`SETTLE`] to fall before the next one. The cache
//! never grows back during the run: the memory went to something else on the machine.

use crate::platform::memory_pressure::{PressureLevel, PressureSource};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Least time between two polls of the source (a poll reads a file or an atomic).
pub const POLL_EVERY: Duration = Duration::from_secs(1);
/// Time a shrink is given to show in the signal before the next one (PSI's shortest
/// average spans 10 s).
pub const SETTLE: Duration = Duration::from_secs(10);

/// The expert cache the guard shrinks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CacheSize {
    /// The host cache: slots in every MoE layer.
    PerLayer(usize),
    /// The unified pool: slots shared by every MoE layer.
    Pool(usize),
}

impl CacheSize {
    fn slots(self) -> usize {
        match self {
            CacheSize::PerLayer(n) | CacheSize::Pool(n) => n,
        }
    }

    fn with_slots(self, n: usize) -> Self {
        match self {
            CacheSize::PerLayer(_) => CacheSize::PerLayer(n),
            CacheSize::Pool(_) => CacheSize::Pool(n),
        }
    }
}

/// One shrink the guard asks for.
#[derive(Clone, Debug, PartialEq)]
pub struct Shrink {
    /// The level that asked for it.
    pub level: PressureLevel,
    /// What the level was read from.
    pub from: String,
    /// The cache's size before.
    pub before: CacheSize,
    /// The size to shrink to.
    pub after: CacheSize,
}

/// The slots a cache of `slots` keeps at `level`, never below `floor` (nor above `slots`).
pub fn shrunk_slots(slots: usize, level: PressureLevel, floor: usize) -> usize {
    let keep = match level {
        PressureLevel::Normal => slots,
        PressureLevel::Warning => slots * 3 / 4,
        PressureLevel::Critical => slots / 2,
    };
    keep.max(floor).min(slots)
}

struct GuardState {
    size: CacheSize,
    last_poll: Option<Instant>,
    last_shrink: Option<Instant>,
}

/// Polls a pressure source and decides when the expert cache shrinks, and to what.
pub struct PressureGuard {
    source: Box<dyn PressureSource>,
    /// The fewest slots the cache keeps (one per layer: a layer's call must fit).
    floor: usize,
    state: Mutex<GuardState>,
}

impl PressureGuard {
    /// A guard over `source` for a cache of `size`, which keeps at least `floor` slots.
    pub fn new(source: Box<dyn PressureSource>, size: CacheSize, floor: usize) -> Self {
        Self {
            source,
            floor,
            state: Mutex::new(GuardState {
                size,
                last_poll: None,
                last_shrink: None,
            }),
        }
    }

    /// The cache's size as the guard last set it.
    pub fn size(&self) -> CacheSize {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).size
    }

    /// At `now`: the shrink to apply, if the source reports pressure, the last poll is
    /// [`POLL_EVERY`] old, the last shrink [`SETTLE`] old and the cache above its floor.
    pub fn poll(&self, now: Instant) -> Option<Shrink> {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let since =
            |t: Option<Instant>| t.map_or(Duration::MAX, |t| now.saturating_duration_since(t));
        if since(st.last_poll) < POLL_EVERY || since(st.last_shrink) < SETTLE {
            return None;
        }
        st.last_poll = Some(now);
        if st.size.slots() <= self.floor {
            return None;
        }
        let (level, from) = self.source.level();
        let keep = shrunk_slots(st.size.slots(), level, self.floor);
        if keep == st.size.slots() {
            return None;
        }
        let before = st.size;
        st.size = before.with_slots(keep);
        st.last_shrink = Some(now);
        Some(Shrink {
            level,
            from,
            before,
            after: st.size,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU8, Ordering};
    use std::sync::Arc;

    /// A source whose level the test sets.
    struct Simulated(Arc<AtomicU8>);

    impl PressureSource for Simulated {
        fn level(&self) -> (PressureLevel, String) {
            let l = match self.0.load(Ordering::Relaxed) {
                0 => PressureLevel::Normal,
                1 => PressureLevel::Warning,
                _ => PressureLevel::Critical,
            };
            (l, "simulated".into())
        }
    }

    #[test]
    fn warnings_keep_three_quarters_critical_half_never_below_the_floor() {
        assert_eq!(shrunk_slots(100, PressureLevel::Normal, 1), 100);
        assert_eq!(shrunk_slots(100, PressureLevel::Warning, 1), 75);
        assert_eq!(shrunk_slots(100, PressureLevel::Critical, 1), 50);
        assert_eq!(shrunk_slots(100, PressureLevel::Critical, 92), 92);
        assert_eq!(
            shrunk_slots(50, PressureLevel::Critical, 92),
            50,
            "never grows"
        );
    }

    #[test]
    fn the_guard_shrinks_on_pressure_then_lets_it_settle() {
        let level = Arc::new(AtomicU8::new(0));
        let g = PressureGuard::new(
            Box::new(Simulated(level.clone())),
            CacheSize::Pool(1000),
            92,
        );
        let t0 = Instant::now();
        assert_eq!(g.poll(t0), None, "no pressure: nothing");
        level.store(2, Ordering::Relaxed);
        assert_eq!(
            g.poll(t0 + Duration::from_millis(500)),
            None,
            "polled too soon"
        );
        let s = g.poll(t0 + POLL_EVERY).unwrap();
        assert_eq!(
            (s.level, s.before, s.after),
            (
                PressureLevel::Critical,
                CacheSize::Pool(1000),
                CacheSize::Pool(500)
            )
        );
        assert_eq!(s.from, "simulated");
        // Still critical, but the shrink gets SETTLE to show.
        assert_eq!(g.poll(t0 + POLL_EVERY + SETTLE / 2), None);
        let t1 = t0 + POLL_EVERY + SETTLE;
        assert_eq!(g.poll(t1).unwrap().after, CacheSize::Pool(250));
        level.store(1, Ordering::Relaxed);
        let t2 = t1 + SETTLE;
        assert_eq!(g.poll(t2).unwrap().after, CacheSize::Pool(187));
        // Down to the floor and no further.
        let mut t = t2;
        level.store(2, Ordering::Relaxed);
        for _ in 0..4 {
            t += SETTLE;
            g.poll(t);
        }
        assert_eq!(g.size(), CacheSize::Pool(92));
        assert_eq!(g.poll(t + SETTLE), None);
        // A host cache keeps its kind.
        let h = PressureGuard::new(Box::new(Simulated(level)), CacheSize::PerLayer(8), 1);
        assert_eq!(h.poll(t0).unwrap().after, CacheSize::PerLayer(4));
    }
}
