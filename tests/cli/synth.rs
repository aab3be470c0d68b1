//! `k3 synth` output checks on the tiny preset: reproducibility, the published layout,
//! agreement with the checkpoint schema and config parser.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::Path;

use k3::checkpoint::schema::{dense_tensors, expert_tensors, LANGUAGE_MODEL_PREFIX};
use k3::config::Config;
use k3::synth::{preset_config, synthesize, synthesize_over, Preset, Routing, SynthOptions};
use safetensors::SafeTensors;
use serde_json::Value;

fn tiny(seed: u64) -> SynthOptions {
    SynthOptions {
        preset: Preset::Tiny,
        layers: None,
        experts: None,
        top_k: None,
        routing: Routing::Random,
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

fn k3_synth(args: &[&str], out: &Path) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_k3"))
        .arg("synth")
        .args(args)
        .arg(out)
        .env("RAYON_NUM_THREADS", "2")
        .output()
        .unwrap()
}

fn synth_ok(args: &[&str], out: &Path) {
    let o = k3_synth(args, out);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

#[test]
fn routing_random_is_the_default_and_local_adds_topics_to_embedding_router_and_head_rows() {
    let dir = tempfile::tempdir().unwrap();
    let (default, random, local) = (
        dir.path().join("default"),
        dir.path().join("random"),
        dir.path().join("local"),
    );
    synth_ok(&[], &default);
    synth_ok(&["--routing", "random"], &random);
    synth_ok(&["--routing", "local"], &local);
    let (default, random, local) = (read_all(&default), read_all(&random), read_all(&local));
    assert_eq!(
        default, random,
        "--routing random must write the default bytes"
    );

    // Local is the random checkpoint with topic parts added to exactly the rows that route
    // (embedding, routers, head): every other tensor keeps its bytes.
    assert_eq!(default["config.json"], local["config.json"]);
    let (rl, ll) = (locate(&random), locate(&local));
    assert_eq!(rl.keys().collect::<Vec<_>>(), ll.keys().collect::<Vec<_>>());
    let names = shard_names(&random);
    let bytes = |files: &BTreeMap<String, Vec<u8>>, l: &Loc| -> Vec<u8> {
        let data = &files[&names[l.shard]];
        let (n, _) = SafeTensors::read_metadata(data).unwrap();
        data[8 + n + l.start..8 + n + l.end].to_vec()
    };
    let mut changed = BTreeSet::new();
    for (name, l) in &rl {
        if bytes(&random, l) != bytes(&local, &ll[name]) {
            changed.insert(name.strip_prefix(LANGUAGE_MODEL_PREFIX).unwrap_or(name));
        }
    }
    let cfg = config_of(&random);
    let mut want: BTreeSet<String> = ["model.embed_tokens.weight", "lm_head.weight"]
        .into_iter()
        .map(String::from)
        .collect();
    want.extend(
        (0..cfg.num_hidden_layers)
            .filter(|&l| cfg.is_moe_layer(l))
            .map(|l| format!("model.layers.{l}.block_sparse_moe.gate.weight")),
    );
    assert_eq!(
        changed,
        want.iter().map(String::as_str).collect::<BTreeSet<_>>()
    );
    let marker: Value = serde_json::from_slice(&local[".k3-synth.json"]).unwrap();
    assert_eq!(marker["routing"], "local");
}

#[test]
fn a_bad_routing_or_top_k_is_refused_naming_the_flag() {
    let dir = tempfile::tempdir().unwrap();
    for (args, words) in [
        (
            &["--routing", "topical"][..],
            "--routing \"topical\": expected one of random, local",
        ),
        (&["--top-k", "0"][..], "--top-k 0: need 1 to 8"),
        (
            &["--experts", "16", "--top-k", "17"][..],
            "--top-k 17: need 1 to 16",
        ),
    ] {
        let out = dir.path().join("out");
        let o = k3_synth(args, &out);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(
            !o.status.success() && err.contains(words),
            "{args:?}: {err}"
        );
        assert!(!out.exists(), "{args:?}: nothing is written");
    }
    let out = dir.path().join("k16");
    synth_ok(&["--experts", "64", "--top-k", "16"], &out);
    let cfg = config_of(&read_all(&out));
    assert_eq!((cfg.num_experts, cfg.num_experts_per_token), (64, 16));
}

/// Selected over distinct experts of whole 32-token chunks of a route trace's tokens, in
/// position order, over every MoE layer.
fn dedup_of_32_token_chunks(trace: &Path) -> f64 {
    let text = fs::read_to_string(trace).unwrap();
    let mut rows: BTreeMap<u64, BTreeMap<u64, Vec<u64>>> = BTreeMap::new();
    for line in text.lines().skip(1) {
        let r: Value = serde_json::from_str(line).unwrap();
        let pos = r["pos"].as_u64().unwrap();
        for (i, e) in r["experts"].as_array().unwrap().iter().enumerate() {
            let ids = e.as_array().unwrap().iter().map(|x| x.as_u64().unwrap());
            rows.entry(r["layer"].as_u64().unwrap())
                .or_default()
                .insert(pos + i as u64, ids.collect());
        }
    }
    let (mut selected, mut distinct) = (0usize, 0usize);
    for tokens in rows.values() {
        let tokens: Vec<&Vec<u64>> = tokens.values().collect();
        for chunk in tokens.chunks_exact(32) {
            selected += chunk.iter().map(|t| t.len()).sum::<usize>();
            distinct += chunk
                .iter()
                .copied()
                .flatten()
                .collect::<BTreeSet<_>>()
                .len();
        }
    }
    assert!(distinct > 0, "the trace has no whole 32-token chunk");
    selected as f64 / distinct as f64
}

#[test]
fn local_routing_reuses_experts_within_32_token_chunks_of_the_text_it_writes() {
    let dir = tempfile::tempdir().unwrap();
    let mut dedup = Vec::new();
    for routing in ["random", "local"] {
        let ckpt = dir.path().join(routing);
        // 64 experts, 4 a token: room for topic sets apart from the rest.
        synth_ok(
            &["--experts", "64", "--top-k", "4", "--routing", routing],
            &ckpt,
        );
        let trace = dir.path().join(format!("{routing}.jsonl"));
        let o = std::process::Command::new(env!("CARGO_BIN_EXE_k3"))
            .args(["run", ckpt.to_str().unwrap(), "--ids", "5,300,17"])
            .args([
                "--ngen",
                "130",
                "--ignore-eos",
                "--quiet",
                "--backend",
                "cpu",
            ])
            .arg("--route-trace")
            .arg(&trace)
            .env("RAYON_NUM_THREADS", "2")
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        dedup.push(dedup_of_32_token_chunks(&trace));
    }
    // Independent routing of 4 of 64 over 32 tokens: 128 picks touch about 56 experts, 2.3x.
    let (random, local) = (dedup[0], dedup[1]);
    assert!(random < 2.8, "random routing dedups {random:.2}x");
    assert!(
        local > 1.3 * random,
        "local {local:.2}x against random {random:.2}x"
    );
}
