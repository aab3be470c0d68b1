//! `k3 synth` output checks on the tiny preset: reproducibility, the published layout,
//! agreement with the checkpoint schema and config parser.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::Path;

use k3::checkpoint::schema::{dense_tensors, expert_tensors, LANGUAGE_MODEL_PREFIX};
use k3::config::Config;
use k3::synth::{preset_config, synthesize, synthesize_over, Preset, SynthOptions};
use safetensors::SafeTensors;
use serde_json::Value;

fn tiny(seed: u64) -> SynthOptions {
    SynthOptions {
        preset: Preset::Tiny,
        layers: None,
        experts: None,
        seed,
        progress: false,
    }
}

/// Every file of a directory, by name, with its bytes.
fn read_all(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            (
                e.file_name().to_string_lossy().into_owned(),
                fs::read(e.path()).unwrap(),
            )
        })
        .collect()
}

fn shard_names(files: &BTreeMap<String, Vec<u8>>) -> Vec<String> {
    files
        .keys()
        .filter(|n| n.ends_with(".safetensors"))
        .cloned()
        .collect()
}

/// Where a stored tensor lives: shard index, dtype, shape, data offsets.
#[derive(Debug)]
struct Loc {
    shard: usize,
    dtype: safetensors::Dtype,
    shape: Vec<usize>,
    start: usize,
    end: usize,
}

fn locate(files: &BTreeMap<String, Vec<u8>>) -> BTreeMap<String, Loc> {
    let mut out = BTreeMap::new();
    for (i, name) in shard_names(files).iter().enumerate() {
        let (_, meta) = SafeTensors::read_metadata(&files[name]).unwrap();
        for (t, info) in meta.tensors() {
            let prev = out.insert(
                t.clone(),
                Loc {
                    shard: i,
                    dtype: info.dtype,
                    shape: info.shape.clone(),
                    start: info.data_offsets.0,
                    end: info.data_offsets.1,
                },
            );
            assert!(prev.is_none(), "{t} stored twice");
        }
    }
    out
}

fn config_of(files: &BTreeMap<String, Vec<u8>>) -> Config {
    Config::from_json_str(std::str::from_utf8(&files["config.json"]).unwrap(), "test").unwrap()
}

#[test]
fn same_seed_same_bytes_other_seed_other_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b, c) = (
        dir.path().join("a"),
        dir.path().join("b"),
        dir.path().join("c"),
    );
    let sa = synthesize(&tiny(0), &a).unwrap();
    let sb = synthesize(&tiny(0), &b).unwrap();
    synthesize(&tiny(1), &c).unwrap();
    assert_eq!(sa, sb);
    let (fa, fb, fc) = (read_all(&a), read_all(&b), read_all(&c));
    assert_eq!(fa, fb);
    let shards = shard_names(&fa);
    assert_eq!(sa.shards, shards.len());
    let total: u64 = shards.iter().map(|s| fa[s].len() as u64).sum();
    assert_eq!(sa.bytes, total);
    // Every shard's contents depend on the seed (its header may not).
    for s in &shards {
        assert_ne!(fa[s], fc[s], "{s} does not depend on the seed");
    }
    assert_eq!(fa["config.json"], fc["config.json"]);
}

#[test]
fn every_schema_tensor_is_present_as_published() {
    let dir = tempfile::tempdir().unwrap();
    let summary = synthesize(&tiny(3), dir.path()).unwrap();
    let files = read_all(dir.path());
    let cfg = config_of(&files);
    let locs = locate(&files);
    assert_eq!(summary.tensors, locs.len());

    let mut expected = dense_tensors(&cfg);
    for layer in (0..cfg.num_hidden_layers).filter(|&l| cfg.is_moe_layer(l)) {
        for e in 0..cfg.num_experts {
            expected.extend(expert_tensors(&cfg, layer, e));
        }
    }
    for spec in &expected {
        let name = format!("{LANGUAGE_MODEL_PREFIX}{}", spec.name);
        let loc = locs.get(&name).unwrap_or_else(|| panic!("{name} missing"));
        assert_eq!(loc.shape, spec.shape, "{name}");
        assert_eq!(
            loc.dtype.to_string(),
            spec.dtype.safetensors_name(),
            "{name}"
        );
    }
    // The rest is the vision part, alone in the last shard.
    let extra: Vec<(&String, &Loc)> = locs
        .iter()
        .filter(|(n, _)| !n.starts_with(LANGUAGE_MODEL_PREFIX))
        .collect();
    assert_eq!(locs.len(), expected.len() + extra.len());
    assert!(!extra.is_empty());
    for (name, loc) in &extra {
        assert!(name.starts_with("vision_tower.") || name.starts_with("mm_projector."));
        assert_eq!(loc.shard, summary.shards - 1, "{name}");
    }
    assert!(locs
        .iter()
        .filter(|(_, l)| l.shard == summary.shards - 1)
        .all(|(n, _)| !n.starts_with(LANGUAGE_MODEL_PREFIX)));

    // Every stored tensor parses and its bytes decode to finite values.
    for name in shard_names(&files) {
        let st = SafeTensors::deserialize(&files[&name]).unwrap();
        for (t, view) in st.tensors() {
            if view.dtype() == safetensors::Dtype::BF16 {
                let finite = view
                    .data()
                    .chunks_exact(2)
                    .all(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32().is_finite());
                assert!(finite, "{t} holds a non-finite value");
            }
        }
    }
}

#[test]
fn index_and_configs_match_the_shards() {
    let dir = tempfile::tempdir().unwrap();
    synthesize(&tiny(0), dir.path()).unwrap();
    let files = read_all(dir.path());
    let locs = locate(&files);
    let shards = shard_names(&files);
    let index: Value = serde_json::from_slice(&files["model.safetensors.index.json"]).unwrap();
    let map = index["weight_map"].as_object().unwrap();
    assert_eq!(map.len(), locs.len());
    for (name, loc) in &locs {
        assert_eq!(map[name].as_str().unwrap(), shards[loc.shard], "{name}");
    }
    let total: usize = locs.values().map(|l| l.end - l.start).sum();
    assert_eq!(
        index["metadata"]["total_size"].as_u64().unwrap(),
        total as u64
    );
    let n = shards.len();
    for (i, s) in shards.iter().enumerate() {
        assert_eq!(*s, format!("model-{:05}-of-{n:05}.safetensors", i + 1));
    }

    let root: Value = serde_json::from_slice(&files["config.json"]).unwrap();
    assert_eq!(root, preset_config(&tiny(0)).unwrap());
    assert_eq!(root["model_type"], "kimi_k3");
    assert_eq!(root["architectures"][0], "KimiK3ForConditionalGeneration");
    assert_eq!(
        (root["bos_token_id"].as_u64(), root["eos_token_id"].as_u64()),
        (Some(768), Some(770))
    );
    assert_eq!(root["pad_token_id"], 1023);
    let text = &root["text_config"];
    assert_eq!(text["model_type"], "kimi_linear");
    assert_eq!(text["num_key_value_heads"], text["num_attention_heads"]);
    assert_eq!(
        text["linear_attn_config"]["full_attn_layers"],
        serde_json::json!([3, 6])
    );
    assert_eq!(
        text["linear_attn_config"]["kda_layers"],
        serde_json::json!([1, 2, 4, 5])
    );
    assert_eq!(
        text["quantization_config"]["format"],
        "mxfp4-pack-quantized"
    );

    let cfg = config_of(&files);
    assert_eq!(
        (cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size),
        (64, 6, 1024)
    );
    assert_eq!((cfg.num_experts, cfg.num_experts_per_token), (8, 2));
    assert_eq!(cfg.eos_token_ids, vec![770]);

    let generation: Value = serde_json::from_slice(&files["generation_config.json"]).unwrap();
    assert_eq!(generation["eos_token_id"], 770);
}

#[test]
fn experts_are_contiguous_shuffled_and_spread() {
    let dir = tempfile::tempdir().unwrap();
    synthesize(&tiny(0), dir.path()).unwrap();
    let files = read_all(dir.path());
    let cfg = config_of(&files);
    let locs = locate(&files);
    let mut expert_shards = BTreeSet::new();
    for layer in (0..cfg.num_hidden_layers).filter(|&l| cfg.is_moe_layer(l)) {
        let mut starts = Vec::new();
        for e in 0..cfg.num_experts {
            let parts = expert_tensors(&cfg, layer, e);
            let loc = |k: usize| &locs[&format!("{LANGUAGE_MODEL_PREFIX}{}", parts[k].name)];
            for (k, part) in parts.iter().enumerate().skip(1) {
                assert_eq!(loc(k).shard, loc(0).shard);
                assert_eq!(
                    loc(k).start,
                    loc(k - 1).end,
                    "{} not back to back",
                    part.name
                );
            }
            expert_shards.insert(loc(0).shard);
            starts.push((loc(0).shard, loc(0).start, e));
        }
        starts.sort();
        let disk_order: Vec<usize> = starts.iter().map(|s| s.2).collect();
        assert_ne!(
            disk_order,
            (0..cfg.num_experts).collect::<Vec<_>>(),
            "layer {layer} in id order"
        );
    }
    assert!(expert_shards.len() >= 2, "experts in {expert_shards:?}");
}

#[test]
fn mxfp4_codes_and_scales_are_varied_and_sized_to_fan_in() {
    let dir = tempfile::tempdir().unwrap();
    synthesize(&tiny(0), dir.path()).unwrap();
    let files = read_all(dir.path());
    let cfg = config_of(&files);
    let mut codes = BTreeSet::new();
    let mut scales = BTreeSet::new();
    let (mut sum_sq, mut count) = (0f64, 0usize);
    const E2M1: [f64; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];
    for name in shard_names(&files) {
        let st = SafeTensors::deserialize(&files[&name]).unwrap();
        for (t, packed) in st.tensors() {
            let Some(base) = t.strip_suffix(".w1.weight_packed") else {
                continue;
            };
            let scale = st.tensor(&format!("{base}.w1.weight_scale")).unwrap();
            let cols = packed.shape()[1] * 2;
            for (i, &b) in packed.data().iter().enumerate() {
                for (j, nib) in [b & 15, b >> 4].into_iter().enumerate() {
                    codes.insert(nib);
                    let (row, col) = ((2 * i + j) / cols, (2 * i + j) % cols);
                    let s = scale.data()[row * (cols / 32) + col / 32];
                    scales.insert(s);
                    let mag = E2M1[usize::from(nib & 7)] * 2f64.powi(i32::from(s) - 127);
                    sum_sq += mag * mag;
                    count += 1;
                }
            }
        }
    }
    assert_eq!(codes.len(), 16, "codes {codes:?}");
    assert!(scales.len() >= 3, "scales {scales:?}");
    // w1 is [I, D]: its fan-in is D; target std 1/sqrt(D), within the exponent rounding.
    let std_sqrt_in =
        (sum_sq / count as f64).sqrt() * (cfg.routed_expert_hidden_size as f64).sqrt();
    assert!(
        (0.6..1.7).contains(&std_sqrt_in),
        "std·sqrt(in) = {std_sqrt_in}"
    );
}

#[test]
fn output_directory_rules() {
    let dir = tempfile::tempdir().unwrap();
    let foreign = dir.path().join("foreign");
    fs::create_dir(&foreign).unwrap();
    fs::write(foreign.join("notes.txt"), "mine").unwrap();
    let err = synthesize(&tiny(0), &foreign).unwrap_err().to_string();
    assert!(err.contains("not empty"), "{err}");
    assert_eq!(fs::read(foreign.join("notes.txt")).unwrap(), b"mine");

    // A stray marker makes no difference: the directory is still refused, and its shard
    // is still there.
    fs::write(foreign.join(".k3-synth.json"), "{}").unwrap();
    fs::write(foreign.join("model-00001-of-00002.safetensors"), "user's").unwrap();
    let err = synthesize(&tiny(0), &foreign).unwrap_err().to_string();
    assert!(
        err.contains("not empty") && err.contains("--force"),
        "{err}"
    );
    assert_eq!(
        fs::read(foreign.join("model-00001-of-00002.safetensors")).unwrap(),
        b"user's"
    );

    // A previous output is refused too; with --force the files this run writes replace
    // theirs, and nothing it does not write is deleted.
    let out = dir.path().join("out");
    let first = synthesize(
        &SynthOptions {
            layers: Some(3),
            ..tiny(0)
        },
        &out,
    )
    .unwrap();
    assert!(synthesize(&tiny(0), &out).is_err());
    fs::write(out.join("notes.txt"), "mine").unwrap();
    let second = synthesize_over(&tiny(0), &out).unwrap();
    let files = read_all(&out);
    assert_ne!(first, second);
    assert_eq!(config_of(&files).num_hidden_layers, 6);
    assert_eq!(files["notes.txt"], b"mine");
    assert!(
        shard_names(&files).len() >= second.shards,
        "{:?}",
        shard_names(&files)
    );
    assert!(!files.keys().any(|k| k.ends_with(".partial")), "{files:?}");
    k3::checkpoint::Checkpoint::open(&out, &[]).unwrap();
}

#[test]
fn the_checkpoint_loader_accepts_the_output() {
    let dir = tempfile::tempdir().unwrap();
    synthesize(&tiny(0), dir.path()).unwrap();
    let report = k3::checkpoint::inspect(dir.path(), &[]).unwrap();
    assert!(report.is_ok(), "{:?}", report.problems);
    assert!(report.unexpected.is_empty(), "{:?}", report.unexpected);
    let cfg = &report.config;
    let experts = cfg.moe_layer_count() * cfg.num_experts;
    assert_eq!(report.experts_expected, experts);
    assert_eq!(report.experts_present, experts);
    assert_eq!(report.experts_contiguous, experts);
}
