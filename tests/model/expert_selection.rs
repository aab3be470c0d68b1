//! Fewer experts where the user allows it: the exact default is untouched, and every expert
//! left out is counted exactly.

use crate::support;

use k3::experts::plan::expert_selection::ExpertSelection;
use k3::experts::{IoMode, StreamConfig};
use k3::generate::prefill;
use k3::model::{FormatPolicy, RuntimeSettings};
use k3::stats::Stats;

const PROMPT: [u32; 9] = [768, 5, 300, 17, 17, 999, 42, 0, 511];

/// The tiny preset cut to `layers` layers, synthesized once per layer count.
fn tiny_with(layers: usize) -> std::path::PathBuf {
    static DIRS: std::sync::Mutex<Vec<(usize, tempfile::TempDir)>> =
        std::sync::Mutex::new(Vec::new());
    let mut dirs = DIRS.lock().unwrap();
    if let Some((_, d)) = dirs.iter().find(|(l, _)| *l == layers) {
        return d.path().to_path_buf();
    }
    let d = tempfile::tempdir().unwrap();
    let opts = k3::synth::SynthOptions {
        preset: k3::synth::Preset::Tiny,
        layers: Some(layers),
        experts: None,
        top_k: None,
        routing: k3::synth::Routing::Random,
        seed: 0,
        progress: false,
    };
    k3::synth::synthesize(&opts, d.path()).unwrap();
    let p = d.path().to_path_buf();
    dirs.push((layers, d));
    p
}

fn run(sel: ExpertSelection, slots: usize) -> (Vec<f32>, Stats) {
    run_on(&support::tiny(0), sel, slots)
}

fn run_on(dir: &std::path::Path, sel: ExpertSelection, slots: usize) -> (Vec<f32>, Stats) {
    let m = support::cpu_model_with(
        dir,
        FormatPolicy::default(),
        RuntimeSettings {
            selection: sel,
            ..support::stream_settings(StreamConfig {
                mode: IoMode::Buffered,
                pipe: false,
                load_threads: 1,
                slots_per_layer: slots,
            })
        },
    );
    let mut st = m.new_state().unwrap();
    let mut stats = Stats::default();
    // Two chunks, so the second finds experts the first cached.
    let logits = prefill(&m, &mut st, &PROMPT, 4, true, &mut stats, None).unwrap();
    (logits, stats)
}

#[test]
fn the_exact_selection_changes_nothing() {
    let (a, sa) = run(ExpertSelection::exact(), 4);
    let (b, sb) = run(
        ExpertSelection {
            top_p: None,
            skip_uncached_below: None,
        },
        4,
    );
    assert_eq!(a, b);
    assert_eq!(sa.experts_skipped, 0);
    assert_eq!(sb.expert_lookups, sa.expert_lookups);
}

#[test]
fn top_p_and_skipping_count_every_expert_left_out() {
    // One dense layer, then one MoE layer: its routing is the same with and without the
    // selection (nothing before it changes), so the counts must add up exactly.
    let dir = tiny_with(2);
    let (exact, se) = run_on(&dir, ExpertSelection::exact(), 0);
    for sel in [
        ExpertSelection {
            top_p: Some(0.5),
            skip_uncached_below: None,
        },
        ExpertSelection {
            top_p: None,
            skip_uncached_below: Some(0.6),
        },
    ] {
        let (got, s) = run_on(&dir, sel, 0);
        assert!(s.experts_skipped > 0, "{sel:?}: nothing skipped");
        assert_eq!(
            s.expert_lookups + s.experts_skipped,
            se.expert_lookups,
            "{sel:?}"
        );
        assert_eq!(s.bytes_skipped % s.experts_skipped, 0);
        assert_ne!(got, exact, "{sel:?}: leaving experts out changed nothing");
        assert!(got.iter().all(|v| v.is_finite()));
    }
}

#[test]
fn cached_experts_are_never_skipped_for_being_light() {
    // With every expert cached after the first chunk, skipping can only touch misses.
    let (_, all) = run(
        ExpertSelection {
            top_p: None,
            skip_uncached_below: Some(10.0),
        },
        4,
    );
    let (_, none_cached) = run(
        ExpertSelection {
            top_p: None,
            skip_uncached_below: Some(10.0),
        },
        0,
    );
    assert!(all.experts_skipped < none_cached.experts_skipped);
}
