//! The whole `tiny` model on the GPU against the CPU oracle: per-layer hidden states,
//! greedy tokens, chunked prefill; and the CPU fallback when no adapter can start.

use crate::support;

use k3::sampling::argmax_lowest;
use support::rel_l2;

use k3::backend::gpu::{GpuBackend, GpuOptions, ReadStaging};
use k3::backend::{Backend, ExpertResidency};
use k3::experts::{IoMode, StreamConfig};
use k3::generate::prefill;
use k3::model::trace::Trace;
use k3::model::{FormatPolicy, Logits, Runner};
use k3::stats::Stats;
use std::process::Command;

const PROMPT: [u32; 11] = [768, 5, 300, 17, 17, 999, 42, 0, 511, 7, 88];
const LAYER_TOL: f64 = 1e-4;
const CHUNK_TOL: f64 = 1e-5;
const GREEDY_STEPS: usize = 16;

/// The GPU model, or None (skip) without an adapter; under CI=true a missing adapter fails.
fn gpu_model() -> Option<Runner<GpuBackend>> {
    gpu_model_with(ReadStaging::Auto)
}

fn gpu_model_with(read_staging: ReadStaging) -> Option<Runner<GpuBackend>> {
    let opts = GpuOptions {
        read_staging,
        ..Default::default()
    };
    support::gpu_model(&support::tiny(0), opts, support::serial_stream())
}

fn read_f32(p: &std::path::Path) -> Vec<f32> {
    bytemuck::pod_collect_to_vec(&std::fs::read(p).unwrap())
}

/// Greedy continuation: prefill, then one token at a time.
fn greedy<B: Backend>(m: &Runner<B>) -> Vec<u32> {
    greedy_stats(m).0
}

/// Greedy continuation and the run's counters.
fn greedy_stats<B: Backend>(m: &Runner<B>) -> (Vec<u32>, Stats) {
    let mut st = m.new_state().unwrap();
    let mut stats = Stats::default();
    let mut logits = prefill(m, &mut st, &PROMPT, 4, false, &mut stats, None).unwrap();
    let mut out = Vec::new();
    for _ in 0..GREEDY_STEPS {
        let t = argmax_lowest(&logits);
        out.push(t);
        logits = m
            .forward(&mut st, &[t], Logits::Last, &mut stats, None)
            .unwrap();
    }
    (out, stats)
}

#[test]
fn gpu_model_matches_cpu_layer_by_layer_and_in_greedy_tokens() {
    let Some(gm) = gpu_model() else { return };
    let cm = support::cpu_model(
        &support::tiny(0),
        FormatPolicy::default(),
        support::serial_stream(),
    );
    let dirs = [tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap()];
    let tg = Trace::create(dirs[0].path()).unwrap();
    let tc = Trace::create(dirs[1].path()).unwrap();
    let gl = prefill(
        &gm,
        &mut gm.new_state().unwrap(),
        &PROMPT,
        4,
        true,
        &mut Stats::default(),
        Some(&tg),
    )
    .unwrap();
    let cl = prefill(
        &cm,
        &mut cm.new_state().unwrap(),
        &PROMPT,
        4,
        true,
        &mut Stats::default(),
        Some(&tc),
    )
    .unwrap();
    let layers = cm.ckpt.config.num_hidden_layers;
    assert_eq!(tg.finish().unwrap(), layers);
    assert_eq!(tc.finish().unwrap(), layers);
    for i in 0..layers {
        let g = read_f32(&Trace::layer_file(dirs[0].path(), i));
        let c = read_f32(&Trace::layer_file(dirs[1].path(), i));
        assert_eq!(
            g.len(),
            PROMPT.len() * cm.ckpt.config.hidden_size,
            "layer {i} dump size"
        );
        let e = rel_l2(&g, &c);
        assert!(
            e <= LAYER_TOL,
            "layer {i}: hidden rel L2 {e:e} > {LAYER_TOL:e}"
        );
    }
    let e = rel_l2(&gl, &cl);
    assert!(e <= LAYER_TOL, "prompt logits rel L2 {e:e}");
    assert_eq!(
        greedy(&gm),
        greedy(&cm),
        "greedy tokens differ between GPU and CPU"
    );
}

#[test]
fn gpu_chunked_prefill_matches_token_by_token() {
    let Some(gm) = gpu_model() else { return };
    let one = prefill(
        &gm,
        &mut gm.new_state().unwrap(),
        &PROMPT,
        1,
        true,
        &mut Stats::default(),
        None,
    )
    .unwrap();
    for chunk in [3, 32] {
        let got = prefill(
            &gm,
            &mut gm.new_state().unwrap(),
            &PROMPT,
            chunk,
            true,
            &mut Stats::default(),
            None,
        )
        .unwrap();
        let e = rel_l2(&got, &one);
        assert!(
            e <= CHUNK_TOL,
            "chunk {chunk}: logits rel L2 {e:e} vs token by token"
        );
    }
}

#[test]
fn gpu_whole_prompt_window_in_row_parts_matches_token_by_token() {
    let long: Vec<u32> = (0..40).map(|i| (i * 37 % 700) as u32).collect();
    // Activation parts of 7 rows in a window of the whole prompt; then an 8 KiB binding
    // cap: parts of a few rows, the head a row or two at a time, the routed experts' pairs
    // over several calls, and windows of a few tokens.
    for (max_binding, part_rows) in [(None, Some(7)), (Some(8192), None)] {
        let opts = GpuOptions {
            max_binding,
            part_rows,
            ..Default::default()
        };
        let Some(gm) = support::gpu_model(&support::tiny(0), opts, support::serial_stream()) else {
            return;
        };
        if max_binding.is_none() {
            assert!(gm.rt.prefill_window() >= long.len());
            assert_eq!(gm.backend.part_rows(), 7);
        } else {
            assert!(gm.backend.part_rows() < long.len() && gm.rt.prefill_window() < long.len());
        }
        let one = prefill(
            &gm,
            &mut gm.new_state().unwrap(),
            &long,
            1,
            true,
            &mut Stats::default(),
            None,
        )
        .unwrap();
        let got = prefill(
            &gm,
            &mut gm.new_state().unwrap(),
            &long,
            k3::generate::MAX_WINDOW,
            true,
            &mut Stats::default(),
            None,
        )
        .unwrap();
        let e = rel_l2(&got, &one);
        assert!(
            e <= CHUNK_TOL,
            "binding {max_binding:?}: logits rel L2 {e:e} vs token by token"
        );
    }
}

#[test]
fn gpu_expert_tier_keeps_the_tokens_and_skips_the_disk_on_hits() {
    let Some(gm) = gpu_model() else { return };
    let cfg = gm.ckpt.config.clone();
    let cm = support::cpu_model(
        &support::tiny(0),
        FormatPolicy::default(),
        support::serial_stream(),
    );
    let want = greedy(&cm);
    let (off, s_off) = greedy_stats(&gm);
    assert_eq!(off, want, "GPU without the tier vs CPU");
    assert_eq!(s_off.gpu_expert_hits, 0, "no tier, no GPU hits");
    let (i, d) = (cfg.moe_intermediate_size, cfg.routed_expert_hidden_size);
    let all = cfg.num_experts * cfg.moe_layer_count();
    let slots = gm
        .backend
        .configure_expert_tier((all * cfg.expert_bytes()) as u64, all, i, d)
        .unwrap();
    assert_eq!(slots, Some(all));
    let (first, s1) = greedy_stats(&gm);
    assert_eq!(first, want, "GPU with a tier holding every expert vs CPU");
    assert!(s1.bytes_streamed > 0, "a cold tier reads from disk");
    let (second, s2) = greedy_stats(&gm);
    assert_eq!(second, want, "second pass over the same prompt");
    assert_eq!(s2.bytes_streamed, 0, "every expert should be a GPU hit");
    assert!(s2.expert_lookups > 0);
    assert_eq!(s2.gpu_expert_hits, s2.expert_lookups);
    assert_eq!(s2.expert_hits, s2.expert_lookups);
    // One slot: most experts run transient, the one slot churns; tokens unchanged.
    let one = gm
        .backend
        .configure_expert_tier(cfg.expert_bytes() as u64, all, i, d)
        .unwrap();
    assert_eq!(one, Some(1));
    let (tokens, s1) = greedy_stats(&gm);
    assert_eq!(tokens, want, "GPU with a one-slot tier vs CPU");
    assert!(s1.gpu_expert_hits < s1.expert_lookups);
    assert_eq!(gm.backend.resident_experts().unwrap(), 1);
}

fn run_k3(args: &[&str], env: &[(&str, &str)]) -> (bool, String) {
    let (ok, _, err) = run_k3_out(args, env);
    (ok, err)
}

/// `k3 run` of the tiny model: success, stdout (the tokens) and stderr.
fn run_k3_out(args: &[&str], env: &[(&str, &str)]) -> (bool, String, String) {
    let dir = support::tiny(0);
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_k3"));
    cmd.arg("run")
        .arg(&dir)
        .args(["--ids", "1,2,3", "--ngen", "2", "--quiet"])
        .args(args);
    for v in [
        "K3_GPU",
        "K3_METAL",
        "K3_VK",
        "WGPU_BACKEND",
        "K3_GPU_GB",
        "K3_VK_GB",
        "K3_LAB_INT4_DECODE",
        "K3_LAB_STAGE_X",
        "K3_LAB_EXPERT_POOL",
    ] {
        cmd.env_remove(v);
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The experiment switches `K3_LAB_INT4_DECODE` (how int4 matvecs meet x) and
/// `K3_LAB_STAGE_X` (whether x is staged): every choice gives the same greedy tokens, and a
/// bad value names the variable. The binary reads the switches in a lab build only.
#[cfg(feature = "lab")]
#[test]
fn int4_decode_choices_give_the_same_tokens() {
    if gpu_model().is_none() {
        return;
    }
    let gpu = |extra: &[&str], env: &[(&str, &str)]| {
        let mut args = vec!["--backend", "gpu", "--ignore-eos"];
        args.extend_from_slice(extra);
        let (ok, out, err) = run_k3_out(&args, env);
        assert!(ok, "{extra:?} {env:?}: {err}");
        out
    };
    let auto = gpu(&[], &[]);
    assert!(!auto.trim().is_empty());
    for choice in ["digits", "float", "auto"] {
        assert_eq!(
            gpu(&[], &[("K3_LAB_INT4_DECODE", choice)]),
            auto,
            "{choice}"
        );
    }
    let (ok, _, err) = run_k3_out(&["--backend", "gpu"], &[("K3_LAB_INT4_DECODE", "half")]);
    assert!(!ok && err.contains("K3_LAB_INT4_DECODE"), "{err}");
    assert_eq!(gpu(&[], &[("K3_LAB_STAGE_X", "off")]), auto);
    assert_eq!(
        gpu(
            &[],
            &[("K3_LAB_INT4_DECODE", "float"), ("K3_LAB_STAGE_X", "off")]
        ),
        auto
    );
    let (ok, _, err) = run_k3_out(&["--backend", "gpu"], &[("K3_LAB_STAGE_X", "maybe")]);
    assert!(!ok && err.contains("K3_LAB_STAGE_X"), "{err}");
}

/// The discrete GPU's tier (lavapipe would otherwise run the unified pool: tests/gpu/unified_pool.rs);
/// a switch of the lab build.
#[cfg(feature = "lab")]
const TWO_TIERS: (&str, &str) = ("K3_LAB_EXPERT_POOL", "off");

#[cfg(feature = "lab")]
#[test]
fn cli_prints_the_tier_on_the_gpu_and_the_cpu_ignores_it() {
    if gpu_model().is_none() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("stats.json");
    let j = json.to_str().unwrap();
    let (ok, err) = run_k3(
        &[
            "--backend",
            "gpu",
            "--gpu-expert-gb",
            "1",
            "--stats-json",
            j,
        ],
        &[TWO_TIERS],
    );
    assert!(ok, "{err}");
    assert!(err.contains("[K3-GPU] expert tier: "), "{err}");
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    assert!(v["total"]["gpu_hits"].is_u64(), "{v}");
    // Experts went through the backend and every MoE layer waited for its routing.
    for key in ["expert_handoff_s", "router_wait_s"] {
        assert!(
            v["total"][key].as_f64().is_some_and(|t| t > 0.0),
            "{key}: {v}"
        );
    }
    let (ok, err) = run_k3(&["--backend", "gpu"], &[("K3_VK_GB", "0"), TWO_TIERS]);
    assert!(ok, "{err}");
    assert!(err.contains("[K3-GPU] expert tier: 0 slots"), "{err}");
    // No size asked: the line says how the default was decided (free VRAM, or why not).
    let (ok, err) = run_k3(&["--backend", "gpu"], &[TWO_TIERS]);
    assert!(ok, "{err}");
    assert!(
        err.contains("expert tier: ") && err.contains("default"),
        "{err}"
    );
    let (ok, err) = run_k3(&["--backend", "cpu"], &[("K3_GPU_GB", "1")]);
    assert!(ok, "{err}");
    assert!(!err.contains("expert tier"), "the CPU has no tier: {err}");
    let (ok, err) = run_k3(&["--backend", "gpu", "--gpu-expert-gb=-1"], &[]);
    assert!(!ok && err.contains("--gpu-expert-gb"), "{err}");
}

#[test]
fn auto_falls_back_to_the_cpu_with_the_failed_line() {
    // No adapter can start: a backend that does not exist on this OS, or a name nothing has.
    let missing_backend = if cfg!(target_os = "macos") {
        "dx12"
    } else {
        "metal"
    };
    for (args, env) in [
        (
            vec!["--backend", "auto"],
            vec![("WGPU_BACKEND", missing_backend)],
        ),
        (
            vec!["--backend", "auto", "--adapter", "no-such-adapter-xyz"],
            vec![],
        ),
        (
            vec![],
            vec![("K3_GPU", "1"), ("WGPU_BACKEND", missing_backend)],
        ),
    ] {
        let (ok, err) = run_k3(&args, &env);
        assert!(ok, "{args:?} {env:?} should run on the CPU: {err}");
        assert!(
            err.contains("[K3-GPU] FAILED — CPU only: "),
            "{args:?} {env:?}: no FAILED line in: {err}"
        );
        assert!(err.contains("[K3] backend: cpu"), "{args:?} {env:?}: {err}");
    }
    let (ok, err) = run_k3(
        &["--backend", "gpu", "--adapter", "no-such-adapter-xyz"],
        &[],
    );
    assert!(!ok, "--backend gpu with no matching adapter must fail");
    assert!(
        err.contains("no-such-adapter-xyz"),
        "the error names the adapter: {err}"
    );
}

#[test]
fn devices_lists_each_adapter_with_its_upload_path() {
    if gpu_model().is_none() {
        return;
    }
    let out = Command::new(env!("CARGO_BIN_EXE_k3"))
        .arg("devices")
        .env_remove("WGPU_BACKEND")
        .output()
        .unwrap();
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    let adapters = text.lines().filter(|l| l.starts_with('[')).count();
    assert!(adapters > 0, "{text}");
    for key in ["backend: ", "limits: ", "features: ", "uploads: "] {
        assert_eq!(
            text.matches(key).count(),
            adapters,
            "one {key:?} line per adapter: {text}"
        );
    }
    // A CPU-type adapter (lavapipe in CI) computes in host memory.
    if text.contains("type: Cpu") {
        assert!(text.contains("uploads: CPU and GPU share memory"), "{text}");
    }
}

/// Prompt logits and six greedy tokens' logits, flattened.
fn logits_run<B: Backend>(m: &Runner<B>) -> Vec<f32> {
    let mut st = m.new_state().unwrap();
    let mut stats = Stats::default();
    let mut logits = prefill(m, &mut st, &PROMPT, 4, false, &mut stats, None).unwrap();
    let mut all = logits.clone();
    for _ in 0..6 {
        let t = argmax_lowest(&logits);
        logits = m
            .forward(&mut st, &[t], Logits::Last, &mut stats, None)
            .unwrap();
        all.extend_from_slice(&logits);
    }
    all
}

#[test]
fn experts_read_into_lent_staging_give_the_same_logits() {
    let (Some(mut on), Some(mut off)) = (
        gpu_model_with(ReadStaging::On),
        gpu_model_with(ReadStaging::Off),
    ) else {
        return;
    };
    let cfg = on.ckpt.config.clone();
    let (i, d) = (cfg.moe_intermediate_size, cfg.routed_expert_hidden_size);
    let all = cfg.num_experts * cfg.moe_layer_count();
    // Pipe on and off; no host cache (each lent buffer goes back and is mapped again) and
    // a cache of every expert (lent buffers copied to the device again on hits); no VRAM
    // tier (transient arenas) and a tier of 3 slots (uploads into slots, churning).
    for (pipe, slots, tier) in [
        (false, 0, 0),
        (true, 0, 0),
        (true, cfg.num_experts, 0),
        (true, 0, 3),
        (false, cfg.num_experts, 3),
    ] {
        let sc = StreamConfig {
            mode: IoMode::Direct,
            pipe,
            load_threads: 2,
            slots_per_layer: slots,
        };
        let mut got = Vec::new();
        for m in [&mut on, &mut off] {
            support::new_runtime(m, support::stream_settings(sc));
            m.backend
                .configure_expert_tier((tier * cfg.expert_bytes()) as u64, all, i, d)
                .unwrap();
            got.push(logits_run(m));
        }
        assert!(got[0].iter().all(|v| v.is_finite()));
        assert_eq!(
            got[0], got[1],
            "pipe {pipe}, cache {slots}, tier {tier}: lent reads changed the logits"
        );
    }
    // The last run's cache holds lent buffers; the rest stay within what the lender keeps:
    // the cached experts, the reads in flight, 8 on their way back and 16 free.
    let alive = on.backend.lent_buffers();
    assert!(alive > 0, "no read was lent");
    assert!(alive <= all + 2 * 2 + 8 + 16, "{alive} lent buffers alive");
    assert_eq!(off.backend.lent_buffers(), 0);
}
