//! Where experts live on the GPU backend: the chunk carry (a prefill chunk's uploads kept
//! for the next chunk of the layer), the VRAM tier and the host cache, exclusive, with
//! promotion and demotion between them. Every split gives the logits of the plain path
//! bit for bit, and the counters say exactly where each expert came from.

use crate::support;

use k3::backend::gpu::{GpuBackend, GpuOptions};
use k3::experts::{IoMode, StreamConfig};
use k3::generate::prefill;
use k3::model::{Logits, Runner, RuntimeSettings};
use k3::sampling::argmax_lowest;
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
/// adapter fails. The discrete GPU's tiers even on unified memory (lavapipe), whose single
/// pool tests/gpu/unified_pool.rs covers.
fn gpu_model() -> Option<Runner<GpuBackend>> {
    let opts = GpuOptions {
        expert_pool: Some(false),
        ..GpuOptions::default()
    };
    support::gpu_model(&support::tiny(0), opts, stream(false, 0))
}

/// Logits of a chunked prefill (chunks of `chunk`) and six greedy steps, and the counters
/// of the prefill and of the decode apart.
fn run(m: &Runner<GpuBackend>, chunk: usize) -> (Vec<f32>, Stats, Stats) {
    let mut st = m.new_state().unwrap();
    let mut pre = Stats::default();
    let mut logits = prefill(m, &mut st, &PROMPT, chunk, false, &mut pre, None).unwrap();
    let mut all = logits.clone();
    let mut dec = Stats::default();
    for _ in 0..6 {
        let t = argmax_lowest(&logits);
        logits = m
            .forward(&mut st, &[t], Logits::Last, &mut dec, None)
            .unwrap();
        all.extend_from_slice(&logits);
    }
    (all, pre, dec)
}

/// Sizes the tier to `slots` experts and the carry to `carry` bytes.
fn configure(m: &Runner<GpuBackend>, slots: usize, carry: u64) {
    support::size_expert_tier(m, slots);
    m.backend.set_chunk_carry_budget(carry).unwrap();
}

#[test]
fn the_chunk_carry_uploads_each_expert_once_and_keeps_the_logits() {
    let Some(mut m) = gpu_model() else { return };
    for pipe in [false, true] {
        support::new_runtime(&mut m, support::stream_settings(stream(pipe, 0)));
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
fn held(m: &Runner<GpuBackend>) -> (usize, usize, usize) {
    let cfg = &m.ckpt.config;
    let ids: Vec<u32> = (0..cfg.num_experts as u32).collect();
    let (mut host, mut tier, mut both) = (0, 0, 0);
    for layer in (0..cfg.num_hidden_layers).filter(|&l| cfg.is_moe_layer(l)) {
        let cached = m.rt.experts().cached(layer, &ids).unwrap();
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
fn settle(m: &Runner<GpuBackend>) -> Stats {
    m.backend.ctx.finish().unwrap();
    let mut s = Stats::default();
    m.rt.experts().settle_tier_moves(&mut s).unwrap();
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
            support::new_runtime(&mut m, support::stream_settings(stream(pipe, host)));
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
    support::new_runtime(&mut m, support::stream_settings(stream(true, 2)));
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
/// and writes the per-tier counters to `--stats-json`. It keeps the two tiers on lavapipe
/// with `K3_LAB_EXPERT_POOL=off`, which the binary reads in a lab build only.
#[cfg(feature = "lab")]
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
        .env("K3_LAB_EXPERT_POOL", "off")
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

/// A demoted expert is read where the GPU copied it back: the host cache holds the mapped
/// readback itself, not a copy, and gives the buffer back when it drops the expert, so
/// demotions reuse buffers rather than make one each; the logits stay those of the plain
/// path.
#[test]
fn demoted_experts_stay_in_their_readback_buffers() {
    let Some(mut m) = gpu_model() else { return };
    let layers = m.ckpt.config.moe_layer_count();
    configure(&m, 0, 0);
    let (want, _, _) = run(&m, 4);
    let (host, tier) = (1, 2);
    support::new_runtime(&mut m, support::stream_settings(stream(true, host)));
    configure(&m, tier, 0);
    let made0 = m.backend.demotion_readbacks().made;
    let mut demotions = 0;
    for pass in 0..4 {
        let (got, pre, dec) = run(&m, 4);
        assert_eq!(got, want, "pass {pass}: logits changed");
        demotions += pre.plus(&dec).tier_demotions + settle(&m).tier_demotions;
        let (h, t, both) = held(&m);
        assert_eq!(both, 0, "pass {pass}: an expert held by both tiers");
        assert!(
            h <= host * layers && t <= tier,
            "pass {pass}: {h} in RAM, {t} in VRAM"
        );
        // While the tier takes every upload, the host cache holds only demoted experts.
        let rb = m.backend.demotion_readbacks();
        assert!(h > 0, "pass {pass}: nothing demoted into the host cache");
        assert_eq!(
            rb.held, h as u64,
            "pass {pass}: {rb:?} for {h} demoted experts"
        );
    }
    let rb = m.backend.demotion_readbacks();
    let made = rb.made - made0;
    assert!(
        demotions > 2 * (host * layers + tier) as u64,
        "{demotions} demotions: the test needs more churn"
    );
    assert!(
        made * 2 <= demotions,
        "{made} readback buffers made for {demotions} demotions"
    );
    // Dropping the host cache gives every buffer back.
    support::new_runtime(&mut m, support::stream_settings(stream(true, 0)));
    assert_eq!(m.backend.demotion_readbacks().held, 0);
}

/// Prefetch asks the VRAM tier as well as the host cache which experts it holds, and a
/// guess about an expert the tier holds is not read; asking pins nothing and marks nothing
/// used, so a run that asks about every expert between steps evicts exactly as one that
/// does not.
#[test]
fn prefetch_skips_what_the_tier_holds_and_asking_changes_nothing() {
    let Some(mut m) = gpu_model() else { return };
    let cfg = m.ckpt.config.clone();
    let layers: Vec<usize> = (0..cfg.num_hidden_layers)
        .filter(|&l| cfg.is_moe_layer(l))
        .collect();
    let all = cfg.num_experts * layers.len();
    let ids: Vec<u32> = (0..cfg.num_experts as u32).collect();
    configure(&m, 0, 0);
    let (want, _, _) = run(&m, 4);
    // Everything fits the tier: once warm, nothing is guessed and nothing is read.
    support::new_runtime(
        &mut m,
        RuntimeSettings {
            prefetch: true,
            ..support::stream_settings(stream(true, 0))
        },
    );
    configure(&m, all, 0);
    let (first, _, _) = run(&m, 4);
    assert_eq!(first, want);
    let (second, pre, dec) = run(&m, 4);
    assert_eq!(second, want);
    let s = pre.plus(&dec);
    assert_eq!(s.gpu_expert_hits, s.expert_lookups, "{s:?}");
    assert_eq!(s.prefetch_guesses, 0, "guessed what the tier holds: {s:?}");
    assert_eq!(s.bytes_streamed + s.prefetch_wasted_bytes, 0, "{s:?}");
    // What the source says the tier holds is what the tier holds.
    for &l in &layers {
        let nowhere = m.rt.experts().held_nowhere(l, &ids).unwrap();
        assert!(nowhere.is_empty(), "layer {l}: {nowhere:?}");
    }
    // A small tier that evicts: asking about every expert between the steps changes no
    // count, so it moved no expert's recency and pinned none. No host cache and no pipe:
    // when a demotion lands and how a layer's experts arrive in batches depend on timing,
    // the tier's evictions of one batch a layer do not.
    let mut counts = Vec::new();
    for ask in [false, true] {
        support::new_runtime(&mut m, support::stream_settings(stream(false, 0)));
        configure(&m, all / 2, 0);
        let mut st = m.new_state().unwrap();
        let mut s = Stats::default();
        let mut logits = prefill(&m, &mut st, &PROMPT, 4, false, &mut s, None).unwrap();
        let mut got = logits.clone();
        for _ in 0..6 {
            if ask {
                for &l in &layers {
                    let nowhere = m.rt.experts().held_nowhere(l, &ids).unwrap();
                    for id in &ids {
                        let in_tier = m.backend.tier_holds(l, *id).unwrap();
                        let cached = m.rt.experts().cached(l, &[*id]).unwrap()[0];
                        assert_eq!(
                            nowhere.contains(id),
                            !in_tier && !cached,
                            "layer {l} expert {id}"
                        );
                    }
                }
            }
            let t = argmax_lowest(&logits);
            logits = m
                .forward(&mut st, &[t], Logits::Last, &mut s, None)
                .unwrap();
            got.extend_from_slice(&logits);
        }
        assert_eq!(got, want, "asking {ask}: logits changed");
        counts.push((s.gpu_expert_hits, s.tier_promotions, s.bytes_streamed));
    }
    let c = counts[0];
    assert!(
        c.0 > 0 && c.1 > all as u64 / 2,
        "no hits or no evictions: {c:?}"
    );
    assert_eq!(counts[0], counts[1], "asking moved experts");
}
