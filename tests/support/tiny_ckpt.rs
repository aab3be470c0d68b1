//! Writes tiny K3-shaped snapshots (config.json + safetensors shards) for loader tests,
//! from the same schema the loader checks against.

#![allow(dead_code)]

use k3::checkpoint::schema::{dense_tensors, expert_tensors, TensorSpec};
use k3::checkpoint::Dtype;
use k3::config::Config;
use safetensors::tensor::TensorView as StView;
use safetensors::Dtype as StDtype;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// A small, valid K3 config: 3 layers (KDA, KDA, MLA), layer 0 dense, 4 experts
/// ([`k3::config::tiny_json`]).
pub(crate) fn tiny_config_json() -> Value {
    k3::config::tiny_json()
}

/// How to lay a tiny snapshot out on disk.
pub(crate) struct Layout {
    /// Store names with the `language_model.` prefix (as the release does).
    pub prefix: bool,
    /// Number of text shards (1 without an index file writes `model.safetensors`).
    pub shards: usize,
    /// Write an index even for one shard.
    pub index: bool,
    /// Add vision tensors: one (I64) inside the first text shard, and a vision-only shard
    /// that is listed in the index but never written (opening it would fail).
    pub vision: bool,
}

impl Default for Layout {
    fn default() -> Self {
        Layout {
            prefix: true,
            shards: 2,
            index: true,
            vision: true,
        }
    }
}

/// The tensors a tiny snapshot holds: every dense tensor and every expert's six.
pub(crate) fn all_specs(cfg: &Config) -> Vec<Vec<TensorSpec>> {
    let mut groups: Vec<Vec<TensorSpec>> =
        dense_tensors(cfg).into_iter().map(|s| vec![s]).collect();
    for layer in (0..cfg.num_hidden_layers).filter(|&l| cfg.is_moe_layer(l)) {
        for e in 0..cfg.num_experts {
            groups.push(expert_tensors(cfg, layer, e).to_vec());
        }
    }
    groups
}

fn st_dtype(d: Dtype) -> StDtype {
    match d {
        Dtype::Bf16 => StDtype::BF16,
        Dtype::F16 => StDtype::F16,
        Dtype::F32 => StDtype::F32,
        Dtype::U8 => StDtype::U8,
    }
}

/// Deterministic, name-dependent bytes so reads can be checked.
pub(crate) fn fill(spec: &TensorSpec) -> Vec<u8> {
    let seed = spec
        .name
        .bytes()
        .fold(7u32, |h, b| h.wrapping_mul(31).wrapping_add(b as u32));
    let n: usize = spec.shape.iter().product();
    match spec.dtype {
        Dtype::U8 => (0..n).map(|i| (seed as usize + i) as u8).collect(),
        Dtype::Bf16 | Dtype::F16 | Dtype::F32 => (0..n)
            .flat_map(|i| {
                let x = ((seed as usize + i) % 17) as f32 / 8.0 - 1.0;
                match spec.dtype {
                    Dtype::F32 => x.to_le_bytes().to_vec(),
                    Dtype::F16 => half::f16::from_f32(x).to_bits().to_le_bytes().to_vec(),
                    _ => half::bf16::from_f32(x).to_bits().to_le_bytes().to_vec(),
                }
            })
            .collect(),
    }
}

/// Writes `config` and tensors `groups` (each group stays in one shard) into `dir`.
pub(crate) fn write_snapshot(
    dir: &Path,
    config: &Value,
    groups: &[Vec<TensorSpec>],
    layout: &Layout,
) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_string_pretty(config).unwrap(),
    )
    .unwrap();
    let nshards = layout.shards.max(1);
    let use_index = layout.index || nshards > 1;
    let total = nshards + usize::from(layout.vision);
    let shard_name = |k: usize| {
        if use_index {
            format!("model-{:05}-of-{:05}.safetensors", k + 1, total)
        } else {
            "model.safetensors".to_string()
        }
    };
    let stored = |n: &str| {
        if layout.prefix {
            format!("language_model.{n}")
        } else {
            n.to_string()
        }
    };
    let mut weight_map = BTreeMap::new();
    let per = groups.len().div_ceil(nshards);
    for k in 0..nshards {
        let chunk: Vec<&TensorSpec> = groups.iter().skip(k * per).take(per).flatten().collect();
        let data: Vec<(String, Vec<u8>, &TensorSpec)> = chunk
            .iter()
            .map(|s| (stored(&s.name), fill(s), *s))
            .collect();
        let mut views: Vec<(String, StView<'_>)> = data
            .iter()
            .map(|(n, b, s)| {
                (
                    n.clone(),
                    StView::new(st_dtype(s.dtype), s.shape.clone(), b).unwrap(),
                )
            })
            .collect();
        let vision_bytes = vec![0u8; 16];
        if layout.vision && k == 0 {
            views.push((
                "vision_tower.patch_embed.pos".to_string(),
                StView::new(StDtype::I64, vec![2], &vision_bytes).unwrap(),
            ));
        }
        for (n, _) in &views {
            weight_map.insert(n.clone(), shard_name(k));
        }
        safetensors::serialize_to_file(views, None, &dir.join(shard_name(k))).unwrap();
    }
    if layout.vision {
        weight_map.insert(
            "vision_tower.blocks.0.attn.qkv.weight".into(),
            shard_name(nshards),
        );
        weight_map.insert("mm_projector.proj.0.weight".into(), shard_name(nshards));
    }
    if use_index {
        let index = json!({"metadata": {"total_size": 0}, "weight_map": weight_map});
        std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
    }
}

/// Writes the full tiny snapshot with `layout` into a fresh temp dir.
pub(crate) fn tiny_snapshot(layout: &Layout) -> (tempfile::TempDir, Config) {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = Config::tiny();
    write_snapshot(tmp.path(), &tiny_config_json(), &all_specs(&cfg), layout);
    (tmp, cfg)
}

/// Swaps the data ranges (and bytes) of two equal-length tensors in a shard, so that a
/// writer's sorted order can be broken on purpose.
pub(crate) fn swap_tensor_data(path: &Path, a: &str, b: &str) {
    let buf = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(buf[..8].try_into().unwrap()) as usize;
    let mut header: Value = serde_json::from_slice(&buf[8..8 + n]).unwrap();
    let off = |h: &Value, k: &str| -> (usize, usize) {
        let o = &h[k]["data_offsets"];
        (
            o[0].as_u64().unwrap() as usize,
            o[1].as_u64().unwrap() as usize,
        )
    };
    let (ra, rb) = (off(&header, a), off(&header, b));
    assert_eq!(ra.1 - ra.0, rb.1 - rb.0, "swap needs equal lengths");
    let mut data = buf[8 + n..].to_vec();
    let old = data.clone();
    data[ra.0..ra.1].copy_from_slice(&old[rb.0..rb.1]);
    data[rb.0..rb.1].copy_from_slice(&old[ra.0..ra.1]);
    header[a]["data_offsets"] = json!([rb.0, rb.1]);
    header[b]["data_offsets"] = json!([ra.0, ra.1]);
    let mut hb = header.to_string().into_bytes();
    hb.resize(hb.len().div_ceil(8) * 8, b' ');
    let mut out = (hb.len() as u64).to_le_bytes().to_vec();
    out.extend(hb);
    out.extend(data);
    std::fs::write(path, out).unwrap();
}

/// The shard file (under `dir`) whose header holds `stored_name`.
pub(crate) fn shard_holding(dir: &Path, stored_name: &str) -> PathBuf {
    let index: Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("model.safetensors.index.json")).unwrap(),
    )
    .unwrap();
    dir.join(index["weight_map"][stored_name].as_str().unwrap())
}
