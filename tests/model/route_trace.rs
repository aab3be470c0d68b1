//! Routing traces: what `--route-trace` records replays, in the cache simulator, to exactly
//! the hits and lookups the engine counted on the run that recorded it.

use crate::support;

use k3::experts::cache::cache_policy::{CacheSetup, PolicyKind};
use k3::experts::lab::cache_policy_sim::replay;
use k3::experts::telemetry::route_trace::{RouteTap, RouteTrace, TraceHeader};
use k3::experts::{IoMode, StreamConfig};
use k3::generate::{generate, GenerateOptions};
use k3::model::{FormatPolicy, RuntimeSettings};
use std::process::Command;
use std::sync::Arc;

const PROMPT: [u32; 11] = [768, 5, 300, 17, 17, 999, 42, 0, 511, 64, 3];

fn header(m: &k3::model::Runner<k3::backend::cpu::CpuBackend>) -> TraceHeader {
    let c = &m.ckpt.config;
    TraceHeader::new(
        c.num_hidden_layers,
        (0..c.num_hidden_layers)
            .filter(|&l| c.is_moe_layer(l))
            .collect(),
        c.num_experts,
        c.num_experts_per_token,
        c.expert_bytes() as u64,
        "test".into(),
    )
}

#[test]
fn simulator_reproduces_the_engines_hits_on_the_recorded_run() {
    let dir = tempfile::tempdir().unwrap();
    for kind in PolicyKind::ALL {
        for (slots, pipe) in [(1, false), (3, true), (5, false)] {
            let stream = StreamConfig {
                mode: IoMode::Buffered,
                pipe,
                load_threads: 2,
                slots_per_layer: slots,
            };
            let mut m = support::cpu_model(&support::tiny(0), FormatPolicy::default(), stream);
            let path = dir.path().join(format!("{kind}-{slots}.jsonl"));
            let tap = Arc::new(RouteTap::new(header(&m), Some(path.clone())));
            support::new_runtime(
                &mut m,
                RuntimeSettings {
                    cache: CacheSetup {
                        kind,
                        ..CacheSetup::default()
                    },
                    route_tap: Some(tap.clone()),
                    ..support::stream_settings(stream)
                },
            );
            let opts = GenerateOptions {
                ngen: 8,
                max_window: Some(4),
                all_logits: false,
                stop_ids: &[],
                trace: None,
            };
            let mut greedy = |l: &[f32], _: &[u32]| k3::sampling::argmax_lowest(l);
            let g = generate(&m, &PROMPT, &opts, &mut greedy, &mut |_| Ok(())).unwrap();
            let total = g.prefill_stats.plus(&g.decode_stats);
            tap.write_trace().unwrap();
            let t = RouteTrace::read(&path).unwrap();
            // The last generated token is never fed back: prompt + ngen - 1 positions.
            assert_eq!(t.tokens(), PROMPT.len() + 7);
            let sim = replay(&t, kind, slots, None);
            assert!(total.expert_hits > 0, "{kind} {slots}: the run must hit");
            assert_eq!(
                (sim.hits, sim.lookups),
                (total.expert_hits, total.expert_lookups),
                "{kind}, {slots} slots, pipe {pipe}"
            );
        }
    }
}

#[test]
fn the_cli_writes_a_trace_that_bench_cache_replays() {
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("t.jsonl");
    let o = Command::new(env!("CARGO_BIN_EXE_k3"))
        .args(["run", support::tiny(0).to_str().unwrap()])
        .args([
            "--ids",
            "768,5,300,17,17,999",
            "--ngen",
            "4",
            "--ignore-eos",
        ])
        .args(["--quiet", "--backend", "cpu", "--route-trace"])
        .arg(&trace)
        .env("RAYON_NUM_THREADS", "2")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(err.contains("[K3] route trace: "), "{err}");
    let t = RouteTrace::read(&trace).unwrap();
    assert_eq!(t.tokens(), 6 + 3);
    let o = Command::new(env!("CARGO_BIN_EXE_k3"))
        .args(["bench", "cache"])
        .arg(&trace)
        .args(["--expert-gb", "0,1"])
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    for p in ["| lru |", "| lfu-decay |", "| 2q |", "| auto |"] {
        assert_eq!(out.matches(p).count(), 2, "{out}");
    }
    // A damaged trace is refused naming the file and line.
    std::fs::write(&trace, "{\"format\":\"k3-route-trace\"}\n").unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_k3"))
        .args(["bench", "cache"])
        .arg(&trace)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(err.contains("line 1") && err.contains("t.jsonl"), "{err}");
}
