//! Whole-model behaviour on the CPU oracle: chunking, streaming settings, bad input.

use crate::support;

use k3::experts::telemetry::route_trace::{RouteTap, TraceHeader};
use k3::experts::{IoMode, StreamConfig};
use k3::generate::{prefill, MAX_WINDOW};
use k3::model::FormatPolicy;
use k3::stats::Stats;
use std::sync::Arc;

const PROMPT: [u32; 11] = [768, 5, 300, 17, 17, 999, 42, 0, 511, 7, 88];

fn logits_with(sc: StreamConfig, chunk: usize, policy: FormatPolicy) -> Vec<f32> {
    let m = support::cpu_model(&support::tiny(0), policy, sc);
    let mut st = m.new_state().unwrap();
    prefill(
        &m,
        &mut st,
        &PROMPT,
        chunk,
        true,
        &mut Stats::default(),
        None,
    )
    .unwrap()
}

#[test]
fn chunk_sizes_give_bit_identical_logits() {
    let one = logits_with(support::serial_stream(), 1, FormatPolicy::default());
    assert_eq!(one.len(), PROMPT.len() * 1024);
    assert!(one.iter().all(|v| v.is_finite()), "logits must be finite");
    for chunk in [3, 32] {
        assert_eq!(
            logits_with(support::serial_stream(), chunk, FormatPolicy::default()),
            one,
            "chunk {chunk}"
        );
    }
}

/// A prompt long enough that the tiny model's 8 experts a layer are routed many times.
fn long_prompt() -> Vec<u32> {
    (0..60).map(|i| (i * 37 % 700) as u32).collect()
}

#[test]
fn a_whole_prompt_window_matches_token_by_token() {
    let long = long_prompt();
    let m = support::cpu_model(
        &support::tiny(0),
        FormatPolicy::default(),
        support::serial_stream(),
    );
    let run = |m: &k3::model::Runner<_>, chunk: usize| {
        let mut st = m.new_state().unwrap();
        prefill(m, &mut st, &long, chunk, true, &mut Stats::default(), None).unwrap()
    };
    let one = run(&m, 1);
    // The default bound: one window of the whole prompt, layer-major.
    assert_eq!(run(&m, MAX_WINDOW), one, "whole-prompt window");
    assert_eq!(run(&m, 16), one, "windows of 16");
}

#[test]
fn a_window_reads_each_routed_expert_once_a_layer() {
    let long = long_prompt();
    // No host cache beyond the layer's own pass: what a chunk reads, the next reads again.
    let m = support::cpu_model(
        &support::tiny(0),
        FormatPolicy::default(),
        support::serial_stream(),
    );
    let cfg = m.ckpt.config.clone();
    let header = TraceHeader::new(
        cfg.num_hidden_layers,
        (0..cfg.num_hidden_layers)
            .filter(|&l| cfg.is_moe_layer(l))
            .collect(),
        cfg.num_experts,
        cfg.num_experts_per_token,
        cfg.expert_bytes() as u64,
        "test".into(),
    );
    let mut m = m;
    let tap = Arc::new(RouteTap::new(header, None));
    support::new_runtime(
        &mut m,
        k3::model::RuntimeSettings {
            route_tap: Some(tap.clone()),
            ..support::stream_settings(support::serial_stream())
        },
    );
    let mut whole = Stats::default();
    prefill(
        &m,
        &mut m.new_state().unwrap(),
        &long,
        MAX_WINDOW,
        false,
        &mut whole,
        None,
    )
    .unwrap();
    let distinct = tap.usage().unwrap().iter().filter(|&&c| c > 0.0).count() as u64;
    assert!(distinct > 0);
    assert_eq!(
        whole.bytes_streamed,
        distinct * cfg.expert_bytes() as u64,
        "one window reads each (layer, expert) it routes to exactly once"
    );
    let mut chunked = Stats::default();
    prefill(
        &m,
        &mut m.new_state().unwrap(),
        &long,
        4,
        false,
        &mut chunked,
        None,
    )
    .unwrap();
    assert!(
        chunked.bytes_streamed > whole.bytes_streamed,
        "chunks of 4 read experts again: {} vs {} bytes",
        chunked.bytes_streamed,
        whole.bytes_streamed
    );
}

#[test]
fn pipe_direct_io_and_cache_sizes_do_not_change_logits() {
    let base = logits_with(support::serial_stream(), 4, FormatPolicy::exact());
    for sc in [
        StreamConfig {
            mode: IoMode::Direct,
            pipe: true,
            load_threads: 4,
            slots_per_layer: 0,
        },
        StreamConfig {
            mode: IoMode::Direct,
            pipe: true,
            load_threads: 1,
            slots_per_layer: 1,
        },
        StreamConfig {
            mode: IoMode::Buffered,
            pipe: true,
            load_threads: 3,
            slots_per_layer: 3,
        },
        StreamConfig {
            mode: IoMode::Direct,
            pipe: false,
            load_threads: 1,
            slots_per_layer: 8,
        },
    ] {
        assert_eq!(logits_with(sc, 4, FormatPolicy::exact()), base, "{sc:?}");
    }
}

#[test]
fn cache_counts_hits_per_unique_expert() {
    let sc = StreamConfig {
        mode: IoMode::Buffered,
        pipe: true,
        load_threads: 2,
        slots_per_layer: 8,
    };
    let m = support::cpu_model(&support::tiny(0), FormatPolicy::default(), sc);
    let mut st = m.new_state().unwrap();
    let mut s1 = Stats::default();
    prefill(&m, &mut st, &PROMPT, 32, false, &mut s1, None).unwrap();
    assert_eq!(s1.expert_hits, 0, "a cold cache has no hits");
    assert!(s1.expert_lookups > 0 && s1.bytes_streamed > 0);
    // With every expert cached, a second pass reads nothing.
    let mut st = m.new_state().unwrap();
    let mut s2 = Stats::default();
    let mut seen_all = Stats::default();
    // Warm the cache with every expert of every layer by routing a long prompt.
    let long: Vec<u32> = (0..200).map(|i| (i * 37 % 700) as u32).collect();
    prefill(&m, &mut st, &long, 32, false, &mut seen_all, None).unwrap();
    let mut st = m.new_state().unwrap();
    prefill(&m, &mut st, &PROMPT, 32, false, &mut s2, None).unwrap();
    assert!(s2.expert_hits > 0);
    assert_eq!(
        s2.expert_hits + (s2.bytes_streamed / m.ckpt.config.expert_bytes() as u64),
        s2.expert_lookups
    );
}

#[test]
fn token_id_out_of_range_is_a_clear_error() {
    let m = support::cpu_model(
        &support::tiny(0),
        FormatPolicy::default(),
        support::serial_stream(),
    );
    let mut st = m.new_state().unwrap();
    let e = prefill(
        &m,
        &mut st,
        &[1, 1024],
        32,
        false,
        &mut Stats::default(),
        None,
    )
    .unwrap_err();
    let msg = format!("{e:#}");
    assert!(
        msg.contains("1024") && msg.contains("vocab_size is 1024"),
        "{msg}"
    );
}

/// The prefill error after the tiny model loads and `spoil` then runs on each of its
/// safetensors shards.
fn prefill_error_after_start_up(spoil: impl Fn(&std::path::Path)) -> String {
    let copy = support::copy_dir(&support::tiny(0));
    let dir = copy.path().to_path_buf();
    let m = support::cpu_model(&dir, FormatPolicy::default(), support::serial_stream());
    for e in std::fs::read_dir(&dir).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "safetensors") {
            spoil(&p);
        }
    }
    let mut st = m.new_state().unwrap();
    let e = prefill(&m, &mut st, &PROMPT, 32, false, &mut Stats::default(), None).unwrap_err();
    format!("{e:#}")
}

#[test]
fn shard_truncated_after_start_up_names_file_and_offset() {
    // Every shard holding experts cut to half its size after loading.
    let msg = prefill_error_after_start_up(|p| {
        let len = std::fs::metadata(p).unwrap().len();
        std::fs::OpenOptions::new()
            .write(true)
            .open(p)
            .unwrap()
            .set_len(len / 2)
            .unwrap();
    });
    assert!(
        msg.contains(".safetensors") && msg.contains("offset"),
        "{msg}"
    );
}

#[test]
fn shard_deleted_after_start_up_names_the_file() {
    support::where_open_files_can_be_replaced(
        "a shard deleted while k3 holds it open (model_cpu::shard_deleted_after_start_up_names_the_file)",
        || {
            let msg = prefill_error_after_start_up(|p| std::fs::remove_file(p).unwrap());
            assert!(msg.contains(".safetensors"), "{msg}");
        },
    );
}
