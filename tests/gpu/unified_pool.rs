//! The single expert pool of a unified-memory adapter (lavapipe stands in for Apple
//! Silicon): the expert budget becomes tier slots, reads land in lent GPU-visible staging
//! and one device copy puts them in their slot, the host cache keeps nothing between layers
//! and an expert the pool evicts is dropped, never read back. Every budget gives the plain
//! GPU path's logits bit for bit and the CPU oracle's tokens, and the counters follow an
//! LRU of the recorded routing exactly.

use crate::support;

use k3::backend::cpu::CpuBackend;
use k3::backend::gpu::{GpuBackend, GpuOptions, ReadStaging};
use k3::backend::{Backend, ExpertResidency};
use k3::experts::telemetry::route_trace::{RouteTap, RouteTrace, TraceHeader};
use k3::experts::{IoMode, StreamConfig};
use k3::generate::prefill;
use k3::model::{FormatPolicy, Logits, Runner, RuntimeSettings};
use k3::stats::Stats;
use std::collections::HashSet;
use std::sync::Arc;

const PROMPT: [u32; 11] = [768, 5, 300, 17, 17, 999, 42, 0, 511, 7, 88];
const STEPS: usize = 6;

fn stream(pipe: bool) -> StreamConfig {
    StreamConfig {
        mode: IoMode::Buffered,
        pipe,
        load_threads: 2,
        // The pool is the only expert cache: no host slots.
        slots_per_layer: 0,
    }
}

/// The tiny model on the GPU as the pool (`pool`) or as today's plain path (no pool, reads
/// into host memory), or None (skip) without an adapter; under CI=true that fails.
fn gpu_model(pool: bool) -> Option<Runner<GpuBackend>> {
    support::gpu_model(&support::tiny(0), options(pool), stream(false))
}

/// GPU options for the pool (reads into lent staging) or for today's plain path (no pool,
/// reads into host memory).
fn options(pool: bool) -> GpuOptions {
    GpuOptions {
        expert_pool: Some(pool),
        read_staging: if pool {
            ReadStaging::Auto
        } else {
            ReadStaging::Off
        },
        ..GpuOptions::default()
    }
}

/// Logits of a chunked prefill (chunks of `chunk`) and greedy steps, the greedy tokens, and
/// the counters of the whole run.
fn run<B: Backend>(m: &Runner<B>, chunk: usize) -> (Vec<f32>, Vec<u32>, Stats) {
    let mut st = m.new_state().unwrap();
    let mut stats = Stats::default();
    let mut logits = prefill(m, &mut st, &PROMPT, chunk, false, &mut stats, None).unwrap();
    let mut all = logits.clone();
    let mut tokens = Vec::new();
    for _ in 0..STEPS {
        let t = k3::sampling::argmax_lowest(&logits);
        tokens.push(t);
        logits = m
            .forward(&mut st, &[t], Logits::Last, &mut stats, None)
            .unwrap();
        all.extend_from_slice(&logits);
    }
    (all, tokens, stats)
}

/// Sizes the pool to `slots` experts, as the CLI does from the RAM clamp's grant.
fn size_pool(m: &Runner<GpuBackend>, slots: usize) {
    support::size_expert_tier(m, slots);
    let cfg = &m.ckpt.config;
    let all = cfg.num_experts * cfg.moe_layer_count();
    assert_eq!(m.backend.expert_tier_slots().unwrap(), slots.min(all));
}

fn moe_layers(m: &Runner<GpuBackend>) -> Vec<usize> {
    let cfg = &m.ckpt.config;
    (0..cfg.num_hidden_layers)
        .filter(|&l| cfg.is_moe_layer(l))
        .collect()
}

/// Experts the host cache holds over every MoE layer.
fn host_held(m: &Runner<GpuBackend>) -> usize {
    let ids: Vec<u32> = (0..m.ckpt.config.num_experts as u32).collect();
    moe_layers(m)
        .into_iter()
        .map(|l| {
            let c = m.rt.experts().cached(l, &ids).unwrap();
            c.iter().filter(|&&h| h).count()
        })
        .sum()
}

#[test]
fn lavapipe_runs_the_pool_by_default_and_the_switch_turns_it_off() {
    let Some(g) = support::gpu_backend(GpuOptions::default()) else {
        return;
    };
    // The adapter's own fact, or the Apple profile's (K3_GPU_LIMITS) on any adapter.
    let unified = k3::backend::gpu::device::upload_path::unified_memory(g.ctx.info.device_type)
        || g.ctx.profile != k3::backend::gpu::LimitsProfile::Native;
    assert_eq!(
        g.ctx.unified_memory, unified,
        "{:?}",
        g.ctx.info.device_type
    );
    assert_eq!(g.unified_pool(), unified, "{:?}", g.ctx.info.device_type);
    let Some(off) = support::gpu_backend(GpuOptions {
        expert_pool: Some(false),
        ..GpuOptions::default()
    }) else {
        return;
    };
    assert!(!off.unified_pool());
    // The CPU backend has no tier, so no pool.
    assert!(!CpuBackend::new().unified_pool());
}

#[test]
fn the_pool_keeps_the_logits_for_every_budget_and_holds_nothing_on_the_host() {
    let (Some(mut pool), Some(plain)) = (gpu_model(true), gpu_model(false)) else {
        return;
    };
    let cpu = support::cpu_model(&support::tiny(0), FormatPolicy::default(), stream(false));
    let layers = moe_layers(&pool).len();
    let all = pool.ckpt.config.num_experts * layers;
    let eb = pool.ckpt.config.expert_bytes() as u64;
    size_pool(&plain, 0);
    let (want, want_tokens, _) = run(&plain, 4);
    assert!(want.iter().all(|v| v.is_finite()));
    let (_, cpu_tokens, _) = run(&cpu, 4);
    assert_eq!(
        want_tokens, cpu_tokens,
        "the plain GPU path and the CPU oracle"
    );
    for pipe in [false, true] {
        support::new_runtime(&mut pool, support::stream_settings(stream(pipe)));
        // Everything fits, a few slots a layer, one slot a layer.
        for slots in [all, 2 * layers, layers] {
            size_pool(&pool, slots);
            let what = format!("pipe {pipe}, pool of {slots}");
            for pass in 0..2 {
                let (got, tokens, s) = run(&pool, 4);
                assert_eq!(got, want, "{what}, pass {pass}: logits changed");
                assert_eq!(tokens, cpu_tokens, "{what}: tokens differ from the CPU's");
                let misses = s.expert_lookups - s.expert_hits;
                assert_eq!(s.ram_expert_hits(), 0, "{what}: a hit outside the pool");
                assert_eq!(s.bytes_streamed, misses * eb, "{what}: bytes per miss");
                assert_eq!(s.tier_demotions, 0, "{what}: the pool demoted");
                pool.backend.ctx.finish().unwrap();
                let mut late = Stats::default();
                pool.rt.experts().settle_tier_moves(&mut late).unwrap();
                assert_eq!(late.tier_demotions, 0, "{what}: a readback landed later");
                assert_eq!(host_held(&pool), 0, "{what}: the host cache kept an expert");
                assert!(pool.backend.resident_experts().unwrap() <= slots);
                if slots == all && pass == 1 {
                    assert_eq!(s.bytes_streamed, 0, "{what}: everything fits, nothing read");
                    assert_eq!(s.gpu_expert_hits, s.expert_lookups, "{what}");
                }
            }
        }
    }
    assert!(
        pool.backend.lent_buffers() > 0,
        "no read landed in lent staging"
    );
}

/// The engine's pool on one recorded routing: per MoE call, experts in load order are hits
/// when held (and become the most recent), else take a free slot or the least recent one no
/// expert of the same call holds; when every slot holds one of the call's experts the
/// expert runs from a transient upload and is not kept. Returns (hits, misses, kept).
fn lru_pool(trace: &RouteTrace, slots: usize) -> (u64, u64, u64) {
    let mut order: Vec<(usize, u32)> = Vec::new(); // least recent first
    let (mut hits, mut misses, mut kept) = (0, 0, 0);
    for r in &trace.records {
        let call: HashSet<(usize, u32)> = r.load.iter().map(|&id| (r.layer, id)).collect();
        let held_before: HashSet<(usize, u32)> = order.iter().copied().collect();
        for &id in &r.load {
            let key = (r.layer, id);
            if held_before.contains(&key) {
                hits += 1;
                order.retain(|&k| k != key);
                order.push(key);
                continue;
            }
            misses += 1;
            if order.len() < slots {
                order.push(key);
                kept += 1;
            } else if let Some(at) = order.iter().position(|k| !call.contains(k)) {
                order.remove(at);
                order.push(key);
                kept += 1;
            }
        }
    }
    (hits, misses, kept)
}

#[test]
fn the_pools_counters_follow_an_lru_of_the_recorded_routing() {
    let Some(mut m) = gpu_model(true) else { return };
    let cfg = m.ckpt.config.clone();
    let layers = moe_layers(&m);
    let all = cfg.num_experts * layers.len();
    let header = TraceHeader::new(
        cfg.num_hidden_layers,
        layers.clone(),
        cfg.num_experts,
        cfg.num_experts_per_token,
        cfg.expert_bytes() as u64,
        "test".into(),
    );
    let dir = tempfile::tempdir().unwrap();
    for slots in [layers.len(), 2 * layers.len() + 1, all] {
        for chunk in [3, 4] {
            // One call per layer and chunk (no pipe), so the sequence is the trace's.
            let path = dir.path().join(format!("{slots}-{chunk}.jsonl"));
            let tap = Arc::new(RouteTap::new(header.clone(), Some(path.clone())));
            support::new_runtime(
                &mut m,
                RuntimeSettings {
                    route_tap: Some(tap.clone()),
                    ..support::stream_settings(stream(false))
                },
            );
            size_pool(&m, slots);
            let (_, _, s) = run(&m, chunk);
            tap.write_trace().unwrap();
            let trace = RouteTrace::read(&path).unwrap();
            let (hits, misses, kept) = lru_pool(&trace, slots);
            let what = format!("pool of {slots}, chunks of {chunk}");
            assert_eq!(s.expert_lookups, hits + misses, "{what}");
            assert_eq!(
                (s.gpu_expert_hits, s.expert_hits, s.tier_promotions),
                (hits, hits, kept),
                "{what}: (pool hits, hits, read into the pool)"
            );
            // Each miss is uploaded once, into its slot or for its call only; the pool
            // never takes more than it holds.
            let (uploads, carried) = m.backend.expert_uploads().unwrap();
            assert_eq!((uploads, carried), (misses, 0), "{what}: uploads");
            assert!(m.backend.resident_experts().unwrap() as u64 <= kept.min(slots as u64));
            if slots == all {
                // Everything fits: each expert is read and uploaded once in the whole run,
                // so no chunk uploads what an earlier chunk uploaded.
                let distinct: HashSet<(usize, u32)> = trace
                    .records
                    .iter()
                    .flat_map(|r| r.load.iter().map(move |&id| (r.layer, id)))
                    .collect();
                assert_eq!(misses, distinct.len() as u64, "{what}");
                assert!(hits > 0, "{what}: the chunks share no expert");
            }
        }
    }
}

/// `k3 run` on lavapipe: the RAM clamp sizes one pool from `--expert-gb` plus
/// `--gpu-expert-gb`, the start-up line and `[K3] tiers:` say "unified pool" and count it,
/// and `--stats-json` names it; `K3_LAB_EXPERT_POOL=off` keeps the two tiers.
#[test]
fn the_run_sizes_and_reports_the_unified_pool() {
    let Some(g) = support::gpu_backend(GpuOptions::default()) else {
        return;
    };
    if !g.unified_pool() {
        eprintln!("skipping: the adapter does not share memory with the CPU");
        return;
    }
    drop(g);
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("stats.json");
    let k3 = |env: &[(&str, &str)]| {
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_k3"));
        cmd.arg("run")
            .arg(support::tiny(0))
            .args(["--ids", "1,2,3,4,5", "--ngen", "3", "--quiet"])
            .args(["--backend", "gpu", "--stats-json"])
            .arg(&json)
            .env("K3_DIRECT", "0")
            .env_remove("K3_GPU_GB")
            .env_remove("K3_VK_GB");
        for (k, v) in env {
            cmd.env(k, v);
        }
        let out = cmd.output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(out.status.success(), "{err}");
        err
    };
    let ck = k3::checkpoint::Checkpoint::open(&support::tiny(0), &[]).unwrap();
    let eb = ck.config.expert_bytes() as f64;
    let layers = ck.config.moe_layer_count();
    let all = ck.config.num_experts * layers;
    // 2 x 10 kB of 3264-byte experts: one pool of 6 (counted once, not 3 + 3 nor per layer).
    let want = ((2e4 / eb) as usize).clamp(layers, all);
    let err = k3(&[("K3_EXPERT_GB", "0.00001"), ("K3_GPU_GB", "0.00001")]);
    let ram = err
        .lines()
        .find(|l| l.starts_with("[K3][RAM_GB="))
        .unwrap_or_else(|| panic!("no RAM line in {err}"));
    assert!(
        ram.contains(&format!("unified pool {want}->{want} slots")),
        "{ram}"
    );
    let start = format!("[K3-GPU] expert tier: unified pool of {want} slots");
    assert!(err.contains(&start), "{start} in {err}");
    let tiers = format!("[K3] tiers: unified pool of {want} slots | hits ");
    assert!(err.contains(&tiers), "{tiers} in {err}");
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    assert_eq!(v["expert_tiers"], "unified pool", "{v}");
    assert_eq!(v["pool_slots"].as_u64(), Some(want as u64), "{v}");
    let t = &v["total"];
    let n = |k: &str| t[k].as_u64().unwrap_or_else(|| panic!("{k}: {v}"));
    assert_eq!(n("gpu_hits"), n("expert_hits"), "every hit is a pool hit");
    assert_eq!(n("tier_demotions"), 0);
    assert!(n("tier_promotions") > 0, "{v}");
    assert!(!err.contains("--cache-policy and --usage-pins"), "{err}");
    // A host-cache policy is said not to apply to the pool.
    let err = k3(&[("K3_EXPERT_GB", "0.00001"), ("K3_CACHE_POLICY", "lru")]);
    assert!(
        err.contains("--cache-policy and --usage-pins choose for the host cache, which the unified pool replaces"),
        "{err}"
    );
    // The switch keeps the host cache + VRAM tier of a discrete GPU (a lab build's binary
    // reads it; the product's keeps the pool).
    if !cfg!(feature = "lab") {
        return;
    }
    let err = k3(&[
        ("K3_EXPERT_GB", "0.00001"),
        ("K3_GPU_GB", "0.00001"),
        ("K3_LAB_EXPERT_POOL", "off"),
    ]);
    assert!(!err.contains("unified pool"), "{err}");
    assert!(err.contains("[K3-GPU] expert tier: 3 slots"), "{err}");
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    assert_eq!(v["expert_tiers"], "host cache + VRAM tier", "{v}");
}

/// A copy of the tiny model whose experts' gate and up scales are tiny (E8M0 70) and whose
/// down matrices have a scale of 241 in every 7th block: above the MXFP4 kernel's fast path,
/// with outputs of the usual order.
fn with_huge_down_scales() -> tempfile::TempDir {
    let (copy, hits) = support::with_edited_tensors(|k, _, scales| {
        if !k.contains(".experts.") || !k.ends_with(".weight_scale") {
            return false;
        }
        if k.ends_with(".w2.weight_scale") {
            scales.iter_mut().skip(3).step_by(7).for_each(|s| *s = 241);
        } else {
            scales.fill(70);
        }
        true
    });
    assert!(hits > 0, "no expert scales in the tiny model");
    copy
}

/// Slots filled from lent staging keep the fast MXFP4 path unless their scales need the
/// per-element one: the pool scans them while they are mapped, as host bytes are scanned.
#[test]
fn the_pool_scans_lent_scales_for_the_per_element_path() {
    let huge = with_huge_down_scales();
    for (dir, want_huge) in [(support::tiny(0), false), (huge.path().to_path_buf(), true)] {
        let model = |pool: bool| support::gpu_model(&dir, options(pool), stream(true));
        let (Some(pool), Some(plain)) = (model(true), model(false)) else {
            return;
        };
        let layers = moe_layers(&pool).len();
        let all = pool.ckpt.config.num_experts * layers;
        size_pool(&plain, 0);
        let (want, _, _) = run(&plain, 4);
        assert!(want.iter().all(|v| v.is_finite()));
        size_pool(&pool, all);
        for pass in 0..2 {
            let (got, _, _) = run(&pool, 4);
            assert_eq!(got, want, "huge {want_huge}, pass {pass}: logits changed");
        }
        let resident = pool.backend.resident_experts().unwrap();
        assert!(resident > 0 && pool.backend.lent_buffers() > 0);
        let flagged = pool.backend.tier_slots_with_huge_scales().unwrap();
        assert_eq!(
            flagged,
            if want_huge { resident } else { 0 },
            "huge {want_huge}: {flagged} of {resident} slots take the per-element path"
        );
    }
}
