//! Where experts live on the GPU backend: the chunk carry (a prefill chunk's uploads kept
//! for the next chunk of the layer), the VRAM tier and the host cache, exclusive, with
//! promotion and demotion between them. Every split gives the logits of the plain path
//! bit for bit, and the counters say exactly where each expert came from.

mod support;

use k3::backend::gpu::{GpuBackend, GpuOptions};
use k3::backend::ExpertResidency;
use k3::experts::{IoMode, StreamConfig};
use k3::generate::prefill;
use k3::model::{K3Model, Logits};
use k3::stats::Stats;

const PROMPT: [u32; 11] = [768, 5, 300, 17, 17, 999, 42, 0, 511, 7, 88];

fn stream(pipe: bool, slots: usize) -> StreamConfig {
    StreamConfig {
        mode: IoMode::Buffered,
        pipe,
        load_threads: 2,
        slots_per_layer: slots,
    }
}

/// The tiny model on the GPU, or None (skip) without an adapter; under CI=true a missing
/// adapter fails.
fn gpu_model() -> Option<K3Model<GpuBackend>> {
    support::gpu_model(&support::tiny(0), GpuOptions::default(), stream(false, 0))
}

fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best as u32
}

/// Logits of a chunked prefill (chunks of `chunk`) and six greedy steps, and the counters
/// of the prefill and of the decode apart.
fn run(m: &K3Model<GpuBackend>, chunk: usize) -> (Vec<f32>, Stats, Stats) {
    let mut st = m.new_state().unwrap();
    let mut pre = Stats::default();
    let mut logits = prefill(m, &mut st, &PROMPT, chunk, false, &mut pre, None).unwrap();
    let mut all = logits.clone();
    let mut dec = Stats::default();
    for _ in 0..6 {
        let t = argmax(&logits);
        logits = m
            .forward(&mut st, &[t], Logits::Last, &mut dec, None)
            .unwrap();
        all.extend_from_slice(&logits);
    }
    (all, pre, dec)
}

/// Sizes the tier to `slots` experts and the carry to `carry` bytes.
fn configure(m: &K3Model<GpuBackend>, slots: usize, carry: u64) {
    let cfg = &m.ckpt.config;
    let (i, d) = (cfg.moe_intermediate_size, cfg.routed_expert_hidden_size);
    let all = cfg.num_experts * cfg.moe_layer_count();
    let got = m
        .backend
        .configure_expert_tier((slots * cfg.expert_bytes()) as u64, all, i, d)
        .unwrap();
    assert_eq!(got, Some(slots.min(all)));
    m.backend.set_chunk_carry_budget(carry).unwrap();
}

#[test]
fn the_chunk_carry_uploads_each_expert_once_and_keeps_the_logits() {
    let Some(mut m) = gpu_model() else { return };
    for pipe in [false, true] {
        m.set_streaming(stream(pipe, 0)).unwrap();
        // The plain path: no tier, no carry: every expert of every chunk is uploaded.
        configure(&m, 0, 0);
        let (want, pre0, dec0) = run(&m, 3);
        assert!(want.iter().all(|v| v.is_finite()));
        let (up0, hits0) = m.backend.expert_uploads().unwrap();
        assert_eq!(hits0, 0);
        assert_eq!(up0, pre0.expert_lookups + dec0.expert_lookups);
        assert_eq!(m.backend.carried_experts().unwrap().0, 0);
        // A carry that fits: bit-identical logits, and each lookup is either an upload or a
        // carry hit, counted as a device hit and never read from disk.
        configure(&m, 0, 1 << 30);
        let (got, pre, dec) = run(&m, 3);
        assert_eq!(got, want, "pipe {pipe}: the chunk carry changed the logits");
        let (up, hits) = m.backend.expert_uploads().unwrap();
        assert!(
            hits > 0,
            "pipe {pipe}: 4 experts, top-2, 3-token chunks: no carry hit"
        );
        assert_eq!(up + hits, pre.expert_lookups + dec.expert_lookups);
        assert_eq!(hits, pre.gpu_expert_hits + dec.gpu_expert_hits);
        assert!(pre.bytes_streamed < pre0.bytes_streamed);
        // Decode keeps nothing: after the first step the carry is empty.
        assert_eq!(m.backend.carried_experts().unwrap(), (0, 0));
        // A carry too small for one chunk's experts keeps nothing and changes nothing.
        configure(&m, 0, 1);
        let (small, _, _) = run(&m, 3);
        assert_eq!(small, want, "pipe {pipe}: a full carry changed the logits");
        assert_eq!(m.backend.expert_uploads().unwrap(), (up0, 0));
    }
}

#[test]
fn one_token_chunks_keep_no_carry() {
    let Some(m) = gpu_model() else { return };
    configure(&m, 0, 1 << 30);
    let (_, pre, dec) = run(&m, 1);
    let (up, hits) = m.backend.expert_uploads().unwrap();
    assert_eq!((hits, up), (0, pre.expert_lookups + dec.expert_lookups));
}

/// Experts held by the host cache and by the VRAM tier, and how many are held by both.
fn held(m: &K3Model<GpuBackend>) -> (usize, usize, usize) {
    let cfg = &m.ckpt.config;
    let ids: Vec<u32> = (0..cfg.num_experts as u32).collect();
    let (mut host, mut tier, mut both) = (0, 0, 0);
    for layer in (0..cfg.num_hidden_layers).filter(|&l| cfg.is_moe_layer(l)) {
        let cached = m.experts().cached(layer, &ids).unwrap();
        for (&id, &h) in ids.iter().zip(&cached) {
            let t = m.backend.tier_holds(layer, id).unwrap();
            host += h as usize;
            tier += t as usize;
            both += (h && t) as usize;
        }
    }
    (host, tier, both)
}

/// Lets the demotions still on their way land in the host cache.
fn settle(m: &K3Model<GpuBackend>) -> Stats {
    m.backend.ctx.finish().unwrap();
    let mut s = Stats::default();
    m.experts().settle_tier_moves(&mut s).unwrap();
    s
}

#[test]
fn exclusive_tiers_keep_the_logits_for_every_split_and_hold_each_expert_once() {
    let Some(mut m) = gpu_model() else { return };
    let cfg = m.ckpt.config.clone();
    let layers = cfg.moe_layer_count();
    let all = cfg.num_experts * layers;
    let eb = cfg.expert_bytes() as u64;
    configure(&m, 0, 0);
    let (want, _, _) = run(&m, 4);
    for pipe in [false, true] {
        for (host, tier) in [
            (0, 1),
            (1, 1),
            (1, 3),
            (2, 2),
            (2, 4),
            (4, 0),
            (0, all),
            (4, all),
        ] {
            m.set_streaming(stream(pipe, host)).unwrap();
            configure(&m, tier, 0);
            let what = format!("pipe {pipe}, host {host} a layer, tier {tier}");
            for pass in 0..2 {
                let (got, pre, dec) = run(&m, 4);
                assert_eq!(got, want, "{what}, pass {pass}: logits changed");
                let s = pre.plus(&dec);
                let misses = s.expert_lookups - s.expert_hits;
                assert_eq!(s.bytes_streamed, misses * eb, "{what}: bytes read per miss");
                assert_eq!(
                    s.gpu_expert_hits + s.ram_expert_hits() + misses,
                    s.expert_lookups,
                    "{what}"
                );
                if tier == 0 {
                    assert_eq!(s.gpu_expert_hits + s.tier_promotions, 0, "{what}");
                }
                let moved = settle(&m);
                let (h, t, both) = held(&m);
                assert_eq!(both, 0, "{what}: an expert held by both tiers");
                assert!(
                    t <= tier && h <= host * layers,
                    "{what}: {h} in RAM, {t} in VRAM"
                );
                if pass == 1 && host * layers + tier >= all {
                    assert_eq!(s.bytes_streamed, 0, "{what}: everything fits, nothing read");
                }
                let _ = moved;
            }
        }
    }
    // Capacity is the sum: 2 slots a layer and 4 in VRAM hold more than either alone.
    m.set_streaming(stream(true, 2)).unwrap();
    configure(&m, 4, 0);
    let (_, pre, dec) = run(&m, 4);
    let s = pre.plus(&dec);
    let moved = settle(&m);
    let (h, t, _) = held(&m);
    assert!(
        s.tier_demotions + moved.tier_demotions > 0,
        "a full tier demotes"
    );
    assert!(s.tier_promotions > 0);
    assert!(h + t > (2 * layers).max(4), "{h} in RAM + {t} in VRAM");
}

/// `k3 run` on the GPU says what the two tiers keep together, prints the `[K3] tiers` line
/// and writes the per-tier counters to `--stats-json`.
#[test]
fn the_run_reports_each_tier() {
    if gpu_model().is_none() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("stats.json");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_k3"))
        .arg("run")
        .arg(support::tiny(0))
        .args([
            "--ids",
            "1,2,3,4,5",
            "--ngen",
            "3",
            "--quiet",
            "--backend",
            "gpu",
        ])
        .args([
            "--expert-gb",
            "0",
            "--gpu-expert-gb",
            "0.00001",
            "--stats-json",
        ])
        .arg(&json)
        .env("K3_DIRECT", "0")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    // 1e4 B: three slots of 3264 B; the host cache keeps one a layer.
    let ck = k3::checkpoint::Checkpoint::open(&support::tiny(0), &[]).unwrap();
    let host = ck.config.moe_layer_count();
    let line = format!(
        "expert tier: 3 slots (0.0 GB; asked 0.00001 GB) | with the host cache's {host}: {} experts",
        host + 3
    );
    assert!(err.contains(&line), "{line} in {err}");
    assert!(err.contains("[K3] tiers: VRAM hits "), "{err}");
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    let t = &v["total"];
    let n = |k: &str| t[k].as_u64().unwrap_or_else(|| panic!("{k}: {v}"));
    assert_eq!(n("gpu_hits") + n("ram_hits"), n("expert_hits"));
    assert!(n("tier_promotions") > 0, "{v}");
    let _ = n("tier_demotions");
}
