//! Several sequences in one forward pass (`forward_batch`): each segment's logits equal
//! its own pass's bit for bit, bad input names its segment, a raised cancel stops the pass,
//! and each routed expert is read once a pass for every segment routed to it.

use crate::support;
use support::batch_scenario;

use k3::experts::telemetry::route_trace::{RouteTap, TraceHeader};
use k3::model::{FormatPolicy, Logits, Runner, RuntimeSettings};
use k3::stats::Stats;
use k3::synth::{synthesize, Preset, Routing, SynthOptions};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

fn tiny() -> Runner<k3::backend::cpu::CpuBackend> {
    support::cpu_model(
        &support::tiny(0),
        FormatPolicy::default(),
        support::serial_stream(),
    )
}

fn assert_batch_equals_alone(m: &Runner<k3::backend::cpu::CpuBackend>, what: &str) {
    let alone = batch_scenario::run(m, false);
    let together = batch_scenario::run(m, true);
    let v = m.vocab_size();
    assert_eq!(
        alone[2][0].len(),
        5 * v,
        "{what}: a prefill wanting all rows"
    );
    for (s, (a, t)) in alone.iter().zip(&together).enumerate() {
        for step in 0..2 {
            assert!(a[step].iter().all(|x| x.is_finite()));
            assert_eq!(t[step], a[step], "{what}: segment {s}, step {step}");
        }
    }
    // The sequences differ, so a segment given another's rows or state would show.
    assert_ne!(
        alone[0][1], alone[1][1],
        "{what}: sequences give different logits"
    );
}

#[test]
fn segments_get_their_own_logits_bit_for_bit_on_the_tiny_model() {
    let m = tiny();
    assert_batch_equals_alone(&m, "tiny");
}

#[test]
fn segments_get_their_own_logits_bit_for_bit_on_a_small_model() {
    let dir = tempfile::tempdir().unwrap();
    let opts = SynthOptions {
        preset: Preset::Small,
        layers: Some(4),
        experts: Some(16),
        top_k: None,
        routing: Routing::Random,
        seed: 3,
        progress: false,
    };
    synthesize(&opts, dir.path()).unwrap();
    let m = support::cpu_model(
        dir.path(),
        FormatPolicy::default(),
        support::serial_stream(),
    );
    assert_batch_equals_alone(&m, "small");
}

#[test]
fn an_out_of_range_id_names_its_segment() {
    let m = tiny();
    let mut states: Vec<_> = (0..3).map(|_| m.new_state().unwrap()).collect();
    let ids: [&[u32]; 3] = [&[1], &[2, 3], &[4, 5, 1_000_000]];
    let mut segs = support::last_row_segments(&mut states, &ids);
    let e = m
        .forward_batch(&mut segs, &mut Stats::default(), None, None)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("token id 1000000 of segment 2, at position 2, is out of range"),
        "{e}"
    );
    assert!(states.iter().all(|s| s.pos == 0), "nothing ran");
}

#[test]
fn a_raised_cancel_stops_the_batch_before_its_layers() {
    let m = tiny();
    let mut states: Vec<_> = (0..2).map(|_| m.new_state().unwrap()).collect();
    let ids: [&[u32]; 2] = [&[1], &[2, 3, 4]];
    let cancel = AtomicBool::new(true);
    let mut segs = support::last_row_segments(&mut states, &ids);
    let out = m
        .forward_batch(&mut segs, &mut Stats::default(), None, Some(&cancel))
        .unwrap();
    assert!(out.is_none(), "a raised cancel returns no logits");
    assert!(states.iter().all(|s| s.pos == 0), "no state advances");
    let mut segs = support::last_row_segments(&mut states, &ids);
    cancel.store(false, std::sync::atomic::Ordering::SeqCst);
    let out = m
        .forward_batch(&mut segs, &mut Stats::default(), None, Some(&cancel))
        .unwrap()
        .unwrap();
    assert_eq!(out.len(), 2);
}

/// The tiny model's serial streaming with the routing tap `tap`.
fn tapped(tap: &Arc<RouteTap>) -> RuntimeSettings {
    RuntimeSettings {
        route_tap: Some(tap.clone()),
        ..support::stream_settings(support::serial_stream())
    }
}

/// The (layer, expert) pairs a tap saw routed.
fn used(tap: &RouteTap) -> Vec<bool> {
    tap.usage().unwrap().iter().map(|&c| c > 0.0).collect()
}

#[test]
fn four_decoding_segments_read_only_the_union_of_their_experts() {
    let mut m = tiny();
    let cfg = m.ckpt.config.clone();
    let header = || {
        TraceHeader::new(
            cfg.num_hidden_layers,
            (0..cfg.num_hidden_layers)
                .filter(|&l| cfg.is_moe_layer(l))
                .collect(),
            cfg.num_experts,
            cfg.num_experts_per_token,
            cfg.expert_bytes() as u64,
            "test".into(),
        )
    };
    let tokens: [u32; 4] = [11, 222, 333, 444];
    // Alone: each sequence's own experts, and the bytes four separate steps read.
    let mut union: Vec<bool> = Vec::new();
    let mut alone_bytes = 0;
    for &t in &tokens {
        let tap = Arc::new(RouteTap::new(header(), None));
        support::new_runtime(&mut m, tapped(&tap));
        let mut stats = Stats::default();
        m.forward(
            &mut m.new_state().unwrap(),
            &[t],
            Logits::Last,
            &mut stats,
            None,
        )
        .unwrap();
        alone_bytes += stats.bytes_streamed;
        let u = used(&tap);
        union = if union.is_empty() {
            u
        } else {
            union.iter().zip(&u).map(|(a, b)| *a || *b).collect()
        };
    }
    let tap = Arc::new(RouteTap::new(header(), None));
    support::new_runtime(&mut m, tapped(&tap));
    let mut states: Vec<_> = (0..4).map(|_| m.new_state().unwrap()).collect();
    let ids: Vec<[u32; 1]> = tokens.iter().map(|&t| [t]).collect();
    let mut segs = support::last_row_segments(&mut states, &ids);
    let mut stats = Stats::default();
    m.forward_batch(&mut segs, &mut stats, None, None)
        .unwrap()
        .unwrap();
    assert_eq!(
        used(&tap),
        union,
        "the batch routes as its sequences do alone"
    );
    let distinct = union.iter().filter(|&&u| u).count() as u64;
    assert_eq!(
        stats.bytes_streamed,
        distinct * cfg.expert_bytes() as u64,
        "each (layer, expert) of the union is read once"
    );
    assert!(
        stats.bytes_streamed < alone_bytes,
        "shared experts are read once, not once per sequence: {} vs {alone_bytes}",
        stats.bytes_streamed
    );
}

#[test]
fn decode_steps_run_as_two_halves_keep_each_sequence_bit_for_bit() {
    split_steps_keep_each_sequence_bit_for_bit();
}

#[test]
fn decode_steps_run_as_parts_across_a_wide_pool_keep_each_sequence_bit_for_bit() {
    // Four compute threads: on a machine of four cores or more a step of five sequences runs
    // as parts across the partner crew (`Runner::forward_batch`); on fewer, as two halves.
    rayon::ThreadPoolBuilder::new()
        .num_threads(4)
        .build()
        .unwrap()
        .install(split_steps_keep_each_sequence_bit_for_bit);
}

fn split_steps_keep_each_sequence_bit_for_bit() {
    // A host cache that holds every expert: a decode step of several sequences then runs as
    // passes of a part of the sequences each at once (`Runner::forward_batch`).
    let mut m = tiny();
    let cfg = m.ckpt.config.clone();
    support::new_runtime(
        &mut m,
        support::stream_settings(k3::experts::StreamConfig {
            slots_per_layer: cfg.num_experts,
            ..support::serial_stream()
        }),
    );
    let v = cfg.vocab_size as u32;
    let prompt = |s: u32| -> Vec<u32> { (0..24).map(|k| (s * 97 + k * 31 + 5) % v).collect() };
    let fresh = |m: &Runner<k3::backend::cpu::CpuBackend>| -> Vec<_> {
        (0..5u32)
            .map(|s| {
                let mut st = m.new_state().unwrap();
                m.forward(
                    &mut st,
                    &prompt(s),
                    Logits::Last,
                    &mut Stats::default(),
                    None,
                )
                .unwrap();
                st
            })
            .collect()
    };
    let mut alone = fresh(&m);
    let mut together = fresh(&m);
    let moe_layers = (0..cfg.num_hidden_layers).filter(|&l| cfg.is_moe_layer(l));
    assert!(
        m.rt.experts()
            .holds_every_expert(moe_layers, cfg.num_experts)
            .unwrap(),
        "the prompts route to every expert, so the steps below split"
    );
    for step in 0..3u32 {
        let ids: Vec<[u32; 1]> = (0..5u32).map(|s| [(s * 13 + step * 7 + 1) % v]).collect();
        let want: Vec<Vec<f32>> = alone
            .iter_mut()
            .zip(&ids)
            .map(|(st, id)| {
                m.forward(st, id, Logits::Last, &mut Stats::default(), None)
                    .unwrap()
            })
            .collect();
        let mut segs = support::last_row_segments(&mut together, &ids);
        let mut stats = Stats::default();
        let got = m
            .forward_batch(&mut segs, &mut stats, None, None)
            .unwrap()
            .unwrap();
        assert_eq!(got, want, "step {step}: each sequence's logits as alone");
        assert_eq!(stats.bytes_streamed, 0, "step {step}: no expert read");
        assert_eq!(
            stats.expert_lookups, stats.expert_hits,
            "step {step}: every expert a hit"
        );
    }
    assert!(together.iter().all(|s| s.pos == 27));
    // A bad id in the second half: refused before any layer, named as in the step.
    let ids: Vec<[u32; 1]> = (0..5u32).map(|s| [if s == 3 { v } else { s }]).collect();
    let mut segs = support::last_row_segments(&mut together, &ids);
    let e = m
        .forward_batch(&mut segs, &mut Stats::default(), None, None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("of segment 3, at position 27"), "{e}");
    assert!(together.iter().all(|s| s.pos == 27), "no sequence advanced");
}
