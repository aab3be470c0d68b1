//! Whether guessing a MoE layer's experts pays, judged per layer from what its guesses did.
//!
//! A guess round costs the next layer's router run early (a matmul and, on a GPU, a
//! readback: `router` time) and, for every guessed read a loader started that the layer
//! then did not need, its disk time where the disk was busy: a share `u` of it, `u` being
//! the share of the time the disk had a read in flight lately. It saves, for every read a
//! loader started early that the layer did need, its disk time where the disk would
//! otherwise have idled: a share `1 - u`. A disk that never rests gains nothing from
//! reading a needed expert earlier and loses a read's time to each wrong guess; an idle one
//! the reverse. Bytes become seconds at the disk's measured rate, and a layer keeps
//! guessing while, over its recent rounds, the saved side is the larger. A layer that stops guessing does no router work for it and
//! reads nothing (the floor is zero guesses); every [`RETEST_EVERY`]-th pass it guesses
//! once more, so a layer whose routing became predictable is found again.
//!
//! Guesses never change which experts a layer computes with, so the gate changes speed
//! only, never logits.

use std::time::{Duration, Instant};

/// A layer that does not guess tries one round in every this many of its passes.
pub(crate) const RETEST_EVERY: u32 = 16;

/// Weight of the past per pass of the layer when a round's outcome is added: about the last
/// eight passes count, so a re-test after [`RETEST_EVERY`] idle passes is judged mostly on
/// its own outcome.
const DECAY: f64 = 0.875;

/// What one guess round for a layer did, as [`crate::experts::plan::prefetch::Prefetcher::settle`] saw it.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct RoundOutcome {
    /// Bytes of guessed reads a loader had started that the layer needed.
    pub useful_bytes: u64,
    /// Bytes of guessed reads a loader had started that the layer did not need.
    pub wasted_bytes: u64,
    /// Time spent scoring the layer's router ahead to make the guesses.
    pub router: Duration,
    /// Guessed reads the round queued (none when every guess was held already).
    pub queued: usize,
}

/// What the disk did lately, as the gate weighs a round with it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct DiskLoad {
    /// Bytes per second while a read is in flight.
    pub rate: f64,
    /// Share of the time a read was in flight (0..=1).
    pub busy_share: f64,
}

/// The disk's busy share between samples of its cumulative busy time, smoothed over about
/// the last five samples (one per MoE layer pass).
#[derive(Debug, Default)]
pub(crate) struct BusyShare {
    last: Option<(Instant, Duration)>,
    share: Option<f64>,
}

impl BusyShare {
    /// Adds a sample of the disk's cumulative busy time at `now`; returns the smoothed
    /// share (`None` until two samples span some time).
    pub(crate) fn sample(&mut self, now: Instant, busy: Duration) -> Option<f64> {
        if let Some((t, b)) = self.last {
            let wall = now.saturating_duration_since(t).as_secs_f64();
            if wall > 0.0 {
                let u = (busy.saturating_sub(b).as_secs_f64() / wall).clamp(0.0, 1.0);
                self.share = Some(self.share.map_or(u, |s| 0.8 * s + 0.2 * u));
            }
        }
        self.last = Some((now, busy));
        self.share
    }
}

#[derive(Clone, Debug, Default)]
struct LayerRecord {
    /// Decayed disk-seconds saved by useful guesses.
    saved_s: f64,
    /// Decayed disk-seconds (and router seconds) the guesses cost.
    cost_s: f64,
    /// Passes since the layer last guessed.
    idle_passes: u32,
    /// Passes since the last outcome was added.
    passes_since_outcome: i32,
    /// Whether the layer has guessed at least once.
    tried: bool,
}

impl LayerRecord {
    /// Whether the layer's guesses pay: yes until it has a record, then while the saved
    /// side is the larger.
    fn pays(&self) -> bool {
        !self.tried || self.saved_s > self.cost_s
    }
}

/// Per-layer judgement of whether guessing pays; see the module comment for the rule.
#[derive(Debug, Default)]
pub(crate) struct PrefetchGate {
    layers: Vec<LayerRecord>,
}

impl PrefetchGate {
    fn record(&mut self, layer: usize) -> &mut LayerRecord {
        if self.layers.len() <= layer {
            self.layers.resize_with(layer + 1, LayerRecord::default);
        }
        &mut self.layers[layer]
    }

    /// Whether `layer` guesses on this pass; counts the pass either way. A layer guesses
    /// until it has a record, then while its saved side exceeds its cost, and on every
    /// [`RETEST_EVERY`]-th pass otherwise.
    pub(crate) fn should_guess(&mut self, layer: usize) -> bool {
        let r = self.record(layer);
        r.passes_since_outcome = r.passes_since_outcome.saturating_add(1);
        let pays = r.pays();
        let retest = r.idle_passes + 1 >= RETEST_EVERY;
        if pays || retest {
            r.idle_passes = 0;
            true
        } else {
            r.idle_passes += 1;
            false
        }
    }

    /// Adds a round's outcome for `layer`, weighed with what the disk did lately. Before the
    /// disk has a rate and a busy share (`None`, the run's first passes) a round that started
    /// reads says nothing of what they saved or cost, so it is not counted and the layer
    /// keeps guessing. A round that queued none (every guess already held, as when every
    /// expert fits the caches and the disk is never read) saved nothing and cost its router
    /// time, whatever the disk did.
    pub(crate) fn observe(&mut self, layer: usize, round: RoundOutcome, disk: Option<DiskLoad>) {
        let d = match disk {
            Some(d) => d,
            None if round.queued == 0 => DiskLoad {
                rate: 1.0,
                busy_share: 0.0,
            },
            None => return,
        };
        let to_s = |bytes: u64, share: f64| bytes as f64 / d.rate.max(1.0) * share;
        let u = d.busy_share.clamp(0.0, 1.0);
        let r = self.record(layer);
        let keep = DECAY.powi(r.passes_since_outcome.max(1));
        r.passes_since_outcome = 0;
        r.tried = true;
        r.saved_s = r.saved_s * keep + to_s(round.useful_bytes, 1.0 - u);
        r.cost_s = r.cost_s * keep + to_s(round.wasted_bytes, u) + round.router.as_secs_f64();
    }

    /// Whether `layer` currently judges its guesses to pay.
    #[cfg(test)]
    fn pays(&self, layer: usize) -> bool {
        self.layers.get(layer).is_some_and(LayerRecord::pays)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A disk at 1 GB/s, busy half the time.
    const RATE: Option<DiskLoad> = Some(DiskLoad {
        rate: 1e9,
        busy_share: 0.5,
    });

    fn disk(busy_share: f64) -> Option<DiskLoad> {
        Some(DiskLoad {
            rate: 1e9,
            busy_share,
        })
    }

    /// A round that queued one guessed read.
    fn round(useful: u64, wasted: u64, router_ms: u64) -> RoundOutcome {
        RoundOutcome {
            useful_bytes: useful,
            wasted_bytes: wasted,
            router: Duration::from_millis(router_ms),
            queued: 1,
        }
    }

    #[test]
    fn a_layer_guesses_first_and_keeps_guessing_while_guesses_pay() {
        let mut g = PrefetchGate::default();
        assert!(g.should_guess(3));
        for _ in 0..50 {
            g.observe(3, round(30_000_000, 10_000_000, 1), RATE);
            assert!(g.should_guess(3));
        }
        assert!(g.pays(3));
    }

    #[test]
    fn wasted_reads_stop_a_layer_and_it_retests_every_sixteenth_pass() {
        let mut g = PrefetchGate::default();
        assert!(g.should_guess(1));
        g.observe(1, round(10_000_000, 40_000_000, 1), RATE);
        let guessed: Vec<bool> = (0..2 * RETEST_EVERY).map(|_| g.should_guess(1)).collect();
        let on: Vec<usize> = guessed
            .iter()
            .enumerate()
            .filter_map(|(i, &b)| b.then_some(i))
            .collect();
        assert_eq!(on, vec![15, 31]);
        assert!(!g.pays(1));
    }

    #[test]
    fn guesses_that_read_nothing_stop_a_layer_before_the_disk_has_a_rate() {
        let mut g = PrefetchGate::default();
        // A round that started reads is not judged without the disk: the layer guesses on.
        assert!(g.should_guess(4));
        g.observe(4, round(5_000_000, 0, 1), None);
        assert!(g.should_guess(4));
        // Every guess held already (all experts cached, the disk never read): nothing queued
        // or saved, the router's time spent, so the layer stops and retests every sixteenth
        // pass.
        let held = RoundOutcome {
            queued: 0,
            ..round(0, 0, 1)
        };
        g.observe(4, held, None);
        let on: Vec<bool> = (0..RETEST_EVERY).map(|_| g.should_guess(4)).collect();
        assert_eq!(on.iter().filter(|&&b| b).count(), 1);
        assert_eq!(on.last(), Some(&true));
        assert!(!g.pays(4));
    }

    #[test]
    fn router_time_alone_can_outweigh_the_reads_saved() {
        let mut g = PrefetchGate::default();
        g.should_guess(0);
        // 2 MB saved at 1 GB/s, half of it idle time, is 1 ms; the router took 5 ms.
        g.observe(0, round(2_000_000, 0, 5), RATE);
        assert!(!g.should_guess(0));
    }

    #[test]
    fn the_same_guesses_pay_on_an_idle_disk_and_not_on_a_saturated_one() {
        // 70 % of the guessed bytes used, as on the random-routing slice.
        let r = round(70_000_000, 30_000_000, 0);
        let mut idle = PrefetchGate::default();
        let mut busy = PrefetchGate::default();
        for _ in 0..4 {
            idle.should_guess(1);
            idle.observe(1, r, disk(0.4));
            busy.should_guess(1);
            busy.observe(1, r, disk(0.95));
        }
        assert!(idle.pays(1));
        assert!(!busy.pays(1));
    }

    #[test]
    fn the_busy_share_is_busy_time_over_wall_time_smoothed() {
        let t0 = Instant::now();
        let mut b = BusyShare::default();
        assert_eq!(b.sample(t0, Duration::ZERO), None);
        let s = b.sample(t0 + Duration::from_secs(1), Duration::from_millis(500));
        assert_eq!(s, Some(0.5));
        // A second fully busy: 0.8 x 0.5 + 0.2 x 1.
        let s = b
            .sample(t0 + Duration::from_secs(2), Duration::from_millis(1500))
            .unwrap();
        assert!((s - 0.6).abs() < 1e-12, "{s}");
    }

    #[test]
    fn a_layer_that_becomes_predictable_is_found_again_at_a_retest() {
        let mut g = PrefetchGate::default();
        g.should_guess(2);
        g.observe(2, round(0, 20_000_000, 0), RATE);
        let mut passes = 0;
        while !g.should_guess(2) {
            passes += 1;
        }
        assert_eq!(passes, RETEST_EVERY - 1);
        // The re-test's guesses were all used; the old round, sixteen passes back, weighs
        // about a tenth of it.
        g.observe(2, round(20_000_000, 0, 0), RATE);
        assert!(g.should_guess(2) && g.pays(2));
    }

    #[test]
    fn a_round_before_the_disk_is_measured_does_not_stop_a_layer() {
        let mut g = PrefetchGate::default();
        g.should_guess(4);
        g.observe(4, round(0, 0, 50), None);
        assert!(g.should_guess(4) && g.pays(4));
    }

    #[test]
    fn layers_are_judged_apart() {
        let mut g = PrefetchGate::default();
        g.should_guess(1);
        g.should_guess(2);
        g.observe(1, round(0, 1_000_000, 0), RATE);
        g.observe(2, round(1_000_000, 0, 0), RATE);
        assert!(!g.should_guess(1));
        assert!(g.should_guess(2));
        assert!(!g.pays(1) && g.pays(2));
    }
}
