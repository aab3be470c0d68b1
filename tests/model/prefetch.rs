//! Next-layer expert prefetch (`--prefetch`): the same logits with it on and off on both
//! backends, for every pipe and cache setting, and counters that account for every guess.

use crate::support;

use k3::backend::gpu::{GpuBackend, GpuOptions};
use k3::backend::{Backend, ExpertResidency};
use k3::checkpoint::Checkpoint;
use k3::experts::{IoMode, StreamConfig};
use k3::generate::prefill;
use k3::model::{FormatPolicy, K3Model, Logits, Runner, RuntimeSettings};
use k3::stats::Stats;
use std::process::Command;

const PROMPT: [u32; 11] = [768, 5, 300, 17, 17, 999, 42, 0, 511, 7, 88];
const DECODE_STEPS: usize = 8;

/// Prompt logits (chunks of 4) and the logits of greedy decode steps, flattened, with the
/// counters of the whole run.
fn logits_run<B: Backend>(m: &Runner<B>) -> (Vec<f32>, Stats) {
    let mut st = m.new_state().unwrap();
    let mut stats = Stats::default();
    let mut logits = prefill(m, &mut st, &PROMPT, 4, false, &mut stats, None).unwrap();
    let mut all = logits.clone();
    for _ in 0..DECODE_STEPS {
        let t = k3::sampling::argmax_lowest(&logits);
        logits = m
            .forward(&mut st, &[t], Logits::Last, &mut stats, None)
            .unwrap();
        all.extend_from_slice(&logits);
    }
    (all, stats)
}

/// Streaming `sc` with prefetch `on` (and `always`, past the gate).
fn prefetching(sc: StreamConfig, on: bool, always: bool) -> RuntimeSettings {
    RuntimeSettings {
        prefetch: on,
        prefetch_always: always,
        ..support::stream_settings(sc)
    }
}

fn configs() -> Vec<StreamConfig> {
    let mut v = Vec::new();
    for (mode, load_threads, slots_per_layer) in [
        (IoMode::Direct, 1, 0),
        (IoMode::Buffered, 3, 2),
        (IoMode::Direct, 2, 8),
    ] {
        v.push(StreamConfig {
            mode,
            pipe: true,
            load_threads,
            slots_per_layer,
        });
    }
    v
}

/// Every guess ends as a hit, dropped unread or wasted bytes; the cache sees the same
/// lookups and hits; the disk reads the bytes of prefetch off plus at most the waste.
fn check_accounting(on: &Stats, off: &Stats, expert_bytes: u64, what: &str) {
    assert!(on.prefetch_guesses > 0, "{what}: nothing was guessed");
    assert_eq!(off.prefetch_guesses, 0, "{what}: prefetch off guessed");
    assert_eq!(
        on.prefetch_hits + on.prefetch_unread + on.prefetch_wasted_bytes / expert_bytes,
        on.prefetch_guesses,
        "{what}: {on:?}"
    );
    assert_eq!(on.prefetch_wasted_bytes % expert_bytes, 0, "{what}");
    assert_eq!(
        (on.expert_lookups, on.expert_hits),
        (off.expert_lookups, off.expert_hits),
        "{what}: prefetch changed what the cache held"
    );
    assert!(
        on.bytes_streamed >= off.bytes_streamed
            && on.bytes_streamed <= off.bytes_streamed + on.prefetch_wasted_bytes,
        "{what}: read {} with prefetch, {} without, {} wasted",
        on.bytes_streamed,
        off.bytes_streamed,
        on.prefetch_wasted_bytes
    );
}

#[test]
fn cpu_prefetch_on_and_off_give_identical_logits_and_count_every_guess() {
    let dir = support::tiny(0);
    let mut m = support::cpu_model(&dir, FormatPolicy::default(), configs()[0]);
    let eb = m.ckpt.config.expert_bytes() as u64;
    for sc in configs() {
        support::new_runtime(&mut m, prefetching(sc, false, false));
        let (want, off) = logits_run(&m);
        assert!(want.iter().all(|v| v.is_finite()));
        support::new_runtime(&mut m, prefetching(sc, true, false));
        let (got, on) = logits_run(&m);
        assert_eq!(got, want, "{sc:?}");
        check_accounting(&on, &off, eb, &format!("{sc:?}"));
        // Guessing on every pass, whatever the gate judges: the same logits, and as many
        // judged passes as the gated run, none of them skipped.
        support::new_runtime(&mut m, prefetching(sc, true, true));
        let (got, always) = logits_run(&m);
        assert_eq!(got, want, "always, {sc:?}");
        check_accounting(&always, &off, eb, &format!("always, {sc:?}"));
        assert_eq!(always.prefetch_rounds_skipped, 0, "{always:?}");
        assert_eq!(
            always.prefetch_rounds,
            on.prefetch_rounds + on.prefetch_rounds_skipped,
            "{sc:?}"
        );
    }
}

#[test]
fn experts_the_cache_holds_are_never_guessed() {
    let dir = support::tiny(0);
    let sc = StreamConfig {
        mode: IoMode::Buffered,
        pipe: true,
        load_threads: 2,
        slots_per_layer: 8,
    };
    let m = support::cpu_model_with(&dir, FormatPolicy::default(), prefetching(sc, true, false));
    let (first, s1) = logits_run(&m);
    assert!(s1.prefetch_guesses > 0);
    // The first run leaves every expert of the tiny model (8 a layer) in the cache.
    let (second, s2) = logits_run(&m);
    assert_eq!(second, first);
    assert_eq!(s2.expert_hits, s2.expert_lookups, "{s2:?}");
    assert_eq!(s2.prefetch_guesses, 0, "{s2:?}");
    assert_eq!(s2.bytes_streamed, 0);
}

#[test]
fn without_the_pipe_prefetch_reads_nothing_ahead() {
    let dir = support::tiny(0);
    let sc = StreamConfig {
        mode: IoMode::Buffered,
        pipe: false,
        load_threads: 1,
        slots_per_layer: 2,
    };
    let mut m = support::cpu_model(&dir, FormatPolicy::default(), sc);
    let (want, _) = logits_run(&m);
    support::new_runtime(&mut m, prefetching(sc, true, false));
    let (got, s) = logits_run(&m);
    assert_eq!(got, want);
    assert_eq!(s.prefetch_guesses, 0);
}

/// The GPU model, or None (skip) without an adapter; under CI=true a missing adapter fails.
fn gpu_model() -> Option<Runner<GpuBackend>> {
    let g = support::gpu_backend(GpuOptions {
        poison_reused: true,
        ..Default::default()
    })?;
    let ck = Checkpoint::open(&support::tiny(0), &[]).unwrap();
    let m = K3Model::load(ck, g, FormatPolicy::default(), false).unwrap();
    Some(Runner::new(m, RuntimeSettings::default()).unwrap())
}

#[test]
fn gpu_prefetch_on_and_off_give_identical_logits_and_count_every_guess() {
    let Some(mut m) = gpu_model() else {
        return;
    };
    let cfg = m.ckpt.config.clone();
    let (i, d) = (cfg.moe_intermediate_size, cfg.routed_expert_hidden_size);
    let all = cfg.num_experts * cfg.moe_layer_count();
    let eb = cfg.expert_bytes() as u64;
    // No VRAM tier, and a tier of 3 slots (a guess skips the experts the tier holds).
    for tier in [0usize, 3] {
        for sc in configs() {
            let mut runs = Vec::new();
            for on in [false, true] {
                support::new_runtime(&mut m, prefetching(sc, on, false));
                m.backend
                    .configure_expert_tier((tier * cfg.expert_bytes()) as u64, all, i, d)
                    .unwrap();
                runs.push(logits_run(&m));
            }
            let what = format!("tier {tier}, {sc:?}");
            assert!(runs[0].0.iter().all(|v| v.is_finite()), "{what}");
            assert_eq!(runs[1].0, runs[0].0, "{what}");
            if tier == 0 {
                check_accounting(&runs[1].1, &runs[0].1, eb, &what);
            } else {
                assert!(runs[1].1.prefetch_guesses > 0, "{what}");
            }
        }
    }
}

fn k3_run(args: &[&str], env: &[(&str, &str)]) -> (bool, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_k3"));
    cmd.arg("run")
        .arg(support::tiny(0))
        .args(["--ids", "768,5,300,17", "--ngen", "4", "--quiet"])
        .args(["--backend", "cpu", "--expert-gb", "0"])
        .args(args)
        .env_remove("K3_PREFETCH");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn cli_prints_prefetch_and_overlap_and_refuses_a_bad_value() {
    let (ok, err) = k3_run(&["--prefetch", "on"], &[]);
    assert!(ok, "{err}");
    assert!(err.contains("| prefetch on"), "{err}");
    assert!(err.contains("[K3] prefetch decode: "), "{err}");
    assert!(
        err.contains("[K3] overlap: decode wall / max(disk busy, compute) = "),
        "{err}"
    );
    let (ok, err) = k3_run(&[], &[("K3_PREFETCH", "off")]);
    assert!(ok, "{err}");
    assert!(err.contains("| prefetch off"), "{err}");
    assert!(!err.contains("[K3] prefetch "), "{err}");
    let (ok, err) = k3_run(&["--prefetch", "always"], &[]);
    assert!(ok, "{err}");
    assert!(err.contains("| prefetch always"), "{err}");
    assert!(err.contains("[K3] prefetch decode: "), "{err}");
    let (ok, err) = k3_run(&["--prefetch", "maybe"], &[]);
    assert!(!ok);
    assert!(err.contains("--prefetch") && err.contains("maybe"), "{err}");
}
