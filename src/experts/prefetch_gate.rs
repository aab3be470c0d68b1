//! Whether guessing a MoE layer's experts pays, judged per layer from what its guesses did.
//!
//! A guess round costs the next layer's router run early (a matmul and, on a GPU, a
//! readback: `router` time) and the disk time of every guessed read a loader started that
//! the layer then did not need. It saves the reads a loader started early that the layer
//! did need: those ran while no demand read was waiting (guesses only take idle loaders),
//! so the layer waits that much less. Both sides are turned into disk-seconds with the
//! disk's measured rate, and a layer keeps guessing while, over its recent rounds, the
//! saved side is the larger. A layer that stops guessing does no router work for it and
//! reads nothing (the floor is zero guesses); every [`RETEST_EVERY`]-th pass it guesses
//! once more, so a layer whose routing became predictable is found again.
//!
//! Guesses never change which experts a layer computes with, so the gate changes speed
//! only, never logits.

use std::time::Duration;

/// A layer that does not guess tries one round in every this many of its passes.
pub const RETEST_EVERY: u32 = 16;

/// Weight of the past per pass of the layer when a round's outcome is added: about the last
/// eight passes count, so a re-test after [`RETEST_EVERY`] idle passes is judged mostly on
/// its own outcome.
const DECAY: f64 = 0.875;

/// What one guess round for a layer did, as [`super::prefetch::Prefetcher::settle`] saw it.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct RoundOutcome {
    /// Bytes of guessed reads a loader had started that the layer needed.
    pub useful_bytes: u64,
    /// Bytes of guessed reads a loader had started that the layer did not need.
    pub wasted_bytes: u64,
    /// Time spent scoring the layer's router ahead to make the guesses.
    pub router: Duration,
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

/// Per-layer judgement of whether guessing pays; see the module comment for the rule.
#[derive(Debug, Default)]
pub struct PrefetchGate {
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
    pub fn should_guess(&mut self, layer: usize) -> bool {
        let r = self.record(layer);
        r.passes_since_outcome = r.passes_since_outcome.saturating_add(1);
        let pays = !r.tried || r.saved_s > r.cost_s;
        let retest = r.idle_passes + 1 >= RETEST_EVERY;
        if pays || retest {
            r.idle_passes = 0;
            true
        } else {
            r.idle_passes += 1;
            false
        }
    }

    /// Adds a round's outcome for `layer`, with the disk's measured rate in bytes per second
    /// (`None` before anything was read: the round then counts its router time only).
    pub fn observe(&mut self, layer: usize, round: RoundOutcome, disk_rate: Option<f64>) {
        let to_s = |bytes: u64| disk_rate.map_or(0.0, |r| bytes as f64 / r.max(1.0));
        let r = self.record(layer);
        let keep = DECAY.powi(r.passes_since_outcome.max(1));
        r.passes_since_outcome = 0;
        r.tried = true;
        r.saved_s = r.saved_s * keep + to_s(round.useful_bytes);
        r.cost_s = r.cost_s * keep + to_s(round.wasted_bytes) + round.router.as_secs_f64();
    }

    /// Whether `layer` currently judges its guesses to pay (for the stats line).
    pub fn pays(&self, layer: usize) -> bool {
        self.layers
            .get(layer)
            .is_some_and(|r| !r.tried || r.saved_s > r.cost_s)
    }

    /// Layers with a record, and how many of them guess now.
    pub fn layers_guessing(&self) -> (usize, usize) {
        let tried: Vec<&LayerRecord> = self.layers.iter().filter(|r| r.tried).collect();
        let on = tried.iter().filter(|r| r.saved_s > r.cost_s).count();
        (tried.len(), on)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const RATE: Option<f64> = Some(1e9);

    fn round(useful: u64, wasted: u64, router_ms: u64) -> RoundOutcome {
        RoundOutcome {
            useful_bytes: useful,
            wasted_bytes: wasted,
            router: Duration::from_millis(router_ms),
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
        assert_eq!(g.layers_guessing(), (1, 0));
    }

    #[test]
    fn router_time_alone_can_outweigh_the_reads_saved() {
        let mut g = PrefetchGate::default();
        g.should_guess(0);
        // 1 MB saved at 1 GB/s is 1 ms; the router took 5 ms.
        g.observe(0, round(1_000_000, 0, 5), RATE);
        assert!(!g.should_guess(0));
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
    fn layers_are_judged_apart() {
        let mut g = PrefetchGate::default();
        g.should_guess(1);
        g.should_guess(2);
        g.observe(1, round(0, 1_000_000, 0), RATE);
        g.observe(2, round(1_000_000, 0, 0), RATE);
        assert!(!g.should_guess(1));
        assert!(g.should_guess(2));
        assert_eq!(g.layers_guessing(), (2, 1));
    }
}
