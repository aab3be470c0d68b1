//! Cache policies and usage pins: no policy or budget changes a logit; pins learnt in one
//! run are there in the next; a corrupt usage history is reported and ignored; the offline
//! optimum is never below a policy, and on the fitted routing model no policy beats the best
//! fixed set.

use crate::support;

use k3::experts::cache::cache_policy::{CacheSetup, PolicyKind};
use k3::experts::cache::usage_history::UsageHistory;
use k3::experts::lab::cache_policy_sim::{replay, replay_best_fixed_set, replay_optimal, usage_of};
use k3::experts::lab::cache_policy_synth::{self as synth, TraceShape, FITTED};
use k3::experts::telemetry::route_trace::{RouteTrace, TraceHeader, TraceRecord};
use k3::experts::{IoMode, StreamConfig};
use k3::generate::prefill;
use k3::model::FormatPolicy;
use k3::stats::Stats;
use rand::{Rng, SeedableRng};
use std::collections::HashMap;
use std::path::Path;
use std::process::{Command, Output};
use std::sync::Arc;

const PROMPT: [u32; 10] = [768, 5, 300, 17, 17, 999, 42, 0, 511, 9];

fn logits(kind: PolicyKind, slots: usize, pins: &[u32]) -> (Vec<f32>, Stats) {
    let stream = StreamConfig {
        mode: IoMode::Buffered,
        pipe: true,
        load_threads: 2,
        slots_per_layer: slots,
    };
    let c = k3::checkpoint::Checkpoint::open(&support::tiny(0), &[])
        .unwrap()
        .config;
    let pins: HashMap<usize, Vec<u32>> = (0..c.num_hidden_layers)
        .filter(|&l| c.is_moe_layer(l))
        .map(|l| (l, pins.to_vec()))
        .collect();
    let m = support::cpu_model_with(
        &support::tiny(0),
        FormatPolicy::default(),
        k3::model::RuntimeSettings {
            cache: CacheSetup {
                kind,
                pins: Arc::new(pins),
            },
            ..support::stream_settings(stream)
        },
    );
    let mut st = m.new_state().unwrap();
    let mut stats = Stats::default();
    let l = prefill(&m, &mut st, &PROMPT, 2, true, &mut stats, None).unwrap();
    (l, stats)
}

#[test]
fn no_policy_or_budget_changes_a_logit() {
    let (want, _) = logits(PolicyKind::Lru, 0, &[]);
    let mut hit_rates = Vec::new();
    for kind in PolicyKind::ALL {
        for slots in [1, 2, 3, 5, 8] {
            for pins in [&[][..], &[0, 3][..]] {
                let (got, s) = logits(kind, slots, pins);
                assert!(
                    got.iter()
                        .zip(&want)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{kind}, {slots} slots, pins {pins:?}: logits differ"
                );
                hit_rates.push(s.expert_hits);
            }
        }
    }
    assert!(
        hit_rates.iter().any(|&h| h != hit_rates[0]),
        "the settings must change what the cache holds"
    );
}

fn k3(dir: &Path, usage: &Path, mode: &str) -> Output {
    // 200 prompt tokens: enough selections (400 a layer over 8 experts) for pins.
    let ids: Vec<String> = (0..200).map(|i| ((i * 37) % 1000).to_string()).collect();
    Command::new(env!("CARGO_BIN_EXE_k3"))
        .args(["run", dir.to_str().unwrap(), "--ids", &ids.join(",")])
        .args(["--ngen", "2", "--ignore-eos", "--quiet", "--backend", "cpu"])
        .args(["--expert-gb", "1000", "--usage-pins", mode, "--usage-file"])
        .arg(usage)
        .env("RAYON_NUM_THREADS", "2")
        .output()
        .unwrap()
}

fn stderr(o: &Output) -> String {
    let e = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(o.status.success(), "{e}");
    e
}

/// Experts pinned, from the `[K3] usage pins: N experts ...` line.
fn pinned(err: &str) -> Option<usize> {
    let line = err.lines().find(|l| l.starts_with("[K3] usage pins: "))?;
    line["[K3] usage pins: ".len()..]
        .split(' ')
        .next()?
        .parse()
        .ok()
}

#[test]
fn pins_survive_a_restart_and_a_corrupt_history_is_ignored() {
    let dir = support::tiny(0);
    let tmp = tempfile::tempdir().unwrap();
    let usage = tmp.path().join("usage");
    let e = stderr(&k3(&dir, &usage, "on"));
    assert!(e.contains("no history at"), "{e}");
    assert!(usage.exists(), "the first run writes the history");
    let e = stderr(&k3(&dir, &usage, "on"));
    let n = pinned(&e).unwrap_or(0);
    assert!(n > 0, "the second run pins from the first: {e}");
    // Read-only: pins from the history (now two runs long), the file untouched, so a
    // second read-only run pins the same.
    let before = std::fs::read(&usage).unwrap();
    let e = stderr(&k3(&dir, &usage, "read-only"));
    let ro = pinned(&e);
    assert!(ro.is_some_and(|p| p >= n), "{e}");
    assert!(e.contains("read-only"), "{e}");
    assert_eq!(std::fs::read(&usage).unwrap(), before);
    let e = stderr(&k3(&dir, &usage, "read-only"));
    assert_eq!(pinned(&e), ro, "{e}");
    assert_eq!(std::fs::read(&usage).unwrap(), before);
    // Corrupt: reported naming the file, ignored, and replaced by a good history.
    let mut bad = before.clone();
    let at = bad.len() / 2;
    bad[at] ^= 0xff;
    std::fs::write(&usage, &bad).unwrap();
    let e = stderr(&k3(&dir, &usage, "on"));
    assert!(
        e.contains("checksum mismatch")
            && e.contains("ignored")
            && e.contains(&*usage.to_string_lossy()),
        "{e}"
    );
    assert_eq!(pinned(&e), None, "nothing pinned from a damaged file: {e}");
    let e = stderr(&k3(&dir, &usage, "read-only"));
    assert!(
        pinned(&e).is_some_and(|p| p > 0),
        "rewritten after the damaged one: {e}"
    );
}

/// A random trace over `layers` MoE layers of 12 experts, top 3: chunks of 1 to 4 tokens,
/// each token reusing an expert of the previous one with probability `reuse` per pick.
fn random_trace(seed: u64, layers: usize, chunks: usize, reuse: f64) -> RouteTrace {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let moe: Vec<usize> = (1..=layers).collect();
    let mut t = RouteTrace::new(TraceHeader::new(
        layers + 1,
        moe.clone(),
        12,
        3,
        100,
        "random".into(),
    ));
    let mut prev: Vec<Vec<u32>> = vec![vec![0, 1, 2]; layers + 1];
    let mut pos = 0;
    for _ in 0..chunks {
        let n = rng.random_range(1..5);
        for &layer in &moe {
            let mut experts = Vec::new();
            for _ in 0..n {
                let mut row: Vec<u32> = Vec::new();
                while row.len() < 3 {
                    let e = if rng.random::<f64>() < reuse {
                        prev[layer][rng.random_range(0..prev[layer].len())]
                    } else {
                        rng.random_range(0..12)
                    };
                    if !row.contains(&e) {
                        row.push(e);
                    }
                }
                prev[layer] = row.clone();
                experts.push(row);
            }
            // Lookups in first-use order, not id order, as a recorded trace may have them.
            let mut load: Vec<u32> = Vec::new();
            for &e in experts.iter().flatten() {
                if !load.contains(&e) {
                    load.push(e);
                }
            }
            t.records.push(TraceRecord {
                pos,
                layer,
                load,
                weights: experts.iter().map(|r| vec![1.0 / 3.0; r.len()]).collect(),
                experts,
            });
        }
        pos += n;
    }
    t
}

#[test]
fn the_optimum_is_never_below_any_policy_on_random_traces() {
    let mut checked = 0;
    for seed in 0..40 {
        let reuse = [0.0, 0.3, 0.7][seed as usize % 3];
        let t = random_trace(seed, 2, 60, reuse);
        // A history from another trace of the same shape, weighted to pin at full quota.
        let other = random_trace(seed + 1000, 2, 60, reuse);
        let mut h = UsageHistory::empty(3, 12);
        let heavy: Vec<f64> = usage_of(&other).iter().map(|c| c * 100.0).collect();
        h.merge(&heavy).unwrap();
        for slots in 0..9 {
            let opt = replay_optimal(&t, slots);
            for kind in PolicyKind::ALL {
                for hist in [None, Some(&h)] {
                    let r = replay(&t, kind, slots, hist);
                    assert_eq!(r.lookups, opt.lookups);
                    assert!(
                        opt.hits >= r.hits,
                        "seed {seed}, {slots} slots, {kind} (pins: {}): optimum {} < {}",
                        hist.is_some(),
                        opt.hits,
                        r.hits
                    );
                    checked += usize::from(r.hits > 0);
                }
            }
        }
    }
    assert!(checked > 1000, "most replays must hit something: {checked}");
}

#[test]
fn no_policy_beats_the_best_fixed_set_on_the_fitted_model() {
    // The fitted model's tokens are independent given a fixed working set, so the most used
    // experts, held from the start, bound what any policy keeps (docs/tuning.md). The
    // tighter bound, the state oracle, is tested in cache_policy_synth.rs.
    let shape = TraceShape {
        moe_layers: 8,
        prompt: 128,
        chunk: 32,
        decode: 500,
        seed: 5,
    };
    let t = synth::generate(&FITTED, &shape);
    let sessions: Vec<RouteTrace> = (0..2)
        .map(|i| {
            synth::generate(
                &FITTED,
                &TraceShape {
                    seed: 900 + i,
                    ..shape
                },
            )
        })
        .collect();
    let mut h = UsageHistory::empty(t.header.layers, t.header.experts);
    for s in &sessions {
        h.merge(&usage_of(s)).unwrap();
    }
    for gb in [18.0, 75.0, 188.0] {
        let slots = synth::k3_slots(gb);
        let fixed = replay_best_fixed_set(&t, slots).hit_percent();
        for kind in PolicyKind::ALL {
            for hist in [None, Some(&h)] {
                let r = replay(&t, kind, slots, hist).hit_percent();
                assert!(
                    r <= fixed,
                    "{gb} GB, {kind}: {r:.2} % over the bound {fixed:.2} %"
                );
            }
        }
    }
}

fn bench_cache(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_k3"))
        .args([
            "bench", "cache", "--layers", "2", "--prompt", "32", "--decode", "20",
        ])
        .args(["--history-sessions", "1"])
        .args(args)
        .output()
        .unwrap()
}

#[test]
fn bench_cache_prints_the_bounds_and_refuses_a_bad_routing_model() {
    let o = bench_cache(&["--expert-gb", "18", "--routing", "16,0,0.6,0.6"]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    for row in [
        "optimal (offline bound)",
        "knows the model's state",
        "best fixed set",
        "lfu-decay+pins",
        "auto+pins",
    ] {
        assert!(out.contains(row), "{row}: {out}");
    }
    assert!(out.contains("sigma 0.6 set 16"), "{out}");
    for (flag, value, names) in [
        ("--routing", "16,0,0.6,9", "SIGMA"),
        ("--routing", "16,0", "SET,DRIFT,REUSE[,SIGMA]"),
        ("--routing", "16,0,1.5", "[0, 1]"),
        ("--expert-gb", "18,lots", "not a number of GB"),
    ] {
        let o = bench_cache(&[flag, value]);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "{flag} {value} was accepted");
        assert!(
            err.contains(flag) && err.contains(names),
            "{flag} {value}: {err}"
        );
    }
}

/// `k3 run` on the tiny checkpoint with a small host cache and `policy` (None: the default).
fn run_with_policy(policy: Option<&str>, stats: &Path) -> String {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_k3"));
    cmd.args(["run", support::tiny(0).to_str().unwrap()])
        .args([
            "--ids",
            "768,5,300,17",
            "--ngen",
            "6",
            "--ignore-eos",
            "--quiet",
        ])
        .args(["--backend", "cpu", "--expert-gb", "0.0001", "--stats-json"])
        .arg(stats)
        .env_remove("K3_CACHE_POLICY");
    if let Some(p) = policy {
        cmd.args(["--cache-policy", p]);
    }
    stderr(&cmd.output().unwrap())
}

#[test]
fn the_default_auto_policy_reports_what_each_layer_follows() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("stats.json");
    let err = run_with_policy(None, &json);
    let line = err
        .lines()
        .find(|l| l.starts_with("[K3] cache policy auto: "))
        .unwrap_or_else(|| panic!("no policy line: {err}"));
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let layers = v["cache_policy_auto"]["layers"].as_u64().unwrap();
    let recency = v["cache_policy_auto"]["layers_evicting_by_recency"]
        .as_u64()
        .unwrap();
    assert!(layers > 0 && recency <= layers, "{v}");
    assert!(
        line.contains(&format!("{recency} of {layers} MoE layers")),
        "{line}"
    );
    let err = run_with_policy(Some("lru"), &json);
    assert!(!err.contains("[K3] cache policy auto"), "{err}");
    assert!(err.contains("[K3] expert cache policy: lru"), "{err}");
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert!(v.get("cache_policy_auto").is_none(), "{v}");
}
