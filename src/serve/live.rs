//! The engine's figures over its last generated tokens — decode rate, expert hit rate,
//! disk rate — for the web page's live chart (`/health` reports them).

use crate::stats::Stats;
use serde::Serialize;
use std::collections::VecDeque;
use std::sync::Mutex;

/// Tokens the figures average over.
pub(crate) const WINDOW: usize = 16;

/// The last [`WINDOW`] decode steps: seconds and counters of each.
#[derive(Default)]
pub struct LiveFigures {
    steps: Mutex<VecDeque<(f64, Stats)>>,
}

/// The figures at one moment.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct LiveSnapshot {
    /// Steps the figures cover (0 before the first decode step).
    pub tokens: usize,
    /// Tokens per second over those steps.
    pub tokens_per_s: f64,
    /// Experts found cached, in percent of those needed.
    pub expert_hit_percent: f64,
    /// Expert bytes read per second of those steps, in GB/s.
    pub disk_gb_per_s: f64,
}

impl LiveFigures {
    /// Records one decode step.
    pub fn push(&self, secs: f64, stats: &Stats) {
        if let Ok(mut s) = self.steps.lock() {
            if s.len() == WINDOW {
                s.pop_front();
            }
            s.push_back((secs, stats.clone()));
        }
    }

    /// The figures over the steps held.
    pub fn snapshot(&self) -> LiveSnapshot {
        let Ok(s) = self.steps.lock() else {
            return LiveSnapshot::default();
        };
        let secs: f64 = s.iter().map(|(t, _)| t).sum();
        let total = s.iter().fold(Stats::default(), |acc, (_, st)| acc.plus(st));
        let per_s = |x: f64| if secs > 0.0 { x / secs } else { 0.0 };
        LiveSnapshot {
            tokens: s.len(),
            tokens_per_s: per_s(s.len() as f64),
            expert_hit_percent: total.hit_percent(),
            disk_gb_per_s: per_s(total.bytes_streamed as f64 / 1e9),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_window_keeps_the_last_steps() {
        let live = LiveFigures::default();
        assert_eq!(live.snapshot().tokens, 0);
        let slow = Stats {
            expert_lookups: 10,
            expert_hits: 0,
            ..Stats::default()
        };
        for _ in 0..WINDOW {
            live.push(1.0, &slow);
        }
        let fast = Stats {
            expert_lookups: 10,
            expert_hits: 10,
            bytes_streamed: 1_000_000_000,
            ..Stats::default()
        };
        for _ in 0..WINDOW {
            live.push(0.5, &fast);
        }
        let s = live.snapshot();
        assert_eq!(s.tokens, WINDOW);
        assert!((s.tokens_per_s - 2.0).abs() < 1e-9, "{s:?}");
        assert!((s.expert_hit_percent - 100.0).abs() < 1e-9, "{s:?}");
        assert!((s.disk_gb_per_s - 2.0).abs() < 1e-9, "{s:?}");
    }
}
