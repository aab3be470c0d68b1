//! The loader and `inspect` on broken or unusual snapshots: each case must give a
//! specific error naming the file, tensor or field, and never panic.

use crate::support;

use support::tiny_ckpt;

use k3::checkpoint::schema::{dense_tensors, expert_tensor_name};
use k3::checkpoint::{inspect, Checkpoint, Dtype};
use k3::config::Config;
use std::path::{Path, PathBuf};
use tiny_ckpt::*;

fn open_err(dir: &Path, extra: &[PathBuf]) -> String {
    match Checkpoint::open(dir, extra) {
        Ok(_) => panic!("{} opened", dir.display()),
        Err(e) => format!("{e:#}"),
    }
}

fn tiny_cfg() -> Config {
    Config::tiny()
}

#[test]
fn full_snapshot_opens_with_and_without_prefix() {
    for prefix in [true, false] {
        let (tmp, cfg) = tiny_snapshot(&Layout {
            prefix,
            ..Layout::default()
        });
        let ck = Checkpoint::open(tmp.path(), &[]).unwrap();
        for spec in dense_tensors(&cfg) {
            let t = ck.tensor_spec(&spec).unwrap();
            assert_eq!(t.bytes, fill(&spec).as_slice(), "{}", spec.name);
        }
        // Either spelling finds the tensor.
        assert!(ck.tensor("language_model.model.norm.weight").is_ok());
        assert!(ck.tensor("model.norm.weight").is_ok());
        let table = ck.experts();
        assert_eq!(table.len(), 2 * 4);
        assert_eq!(table.contiguous_count(), 8);
        let data = ck.expert(2, 3).unwrap();
        let w = data.weights();
        assert_eq!(
            (w.w1.rows, w.w1.cols, w.w2.rows, w.w2.cols),
            (32, 64, 64, 32)
        );
        let spec = k3::checkpoint::schema::expert_tensors(&cfg, 2, 3);
        assert_eq!(w.w3.packed, fill(&spec[4]).as_slice());
        assert_eq!(w.w2.scales, fill(&spec[3]).as_slice());
        let loc = table.get(2, 3).unwrap();
        assert_eq!(loc.span().end - loc.span().start, cfg.expert_bytes() as u64);
        assert!(table.get(0, 0).is_none(), "layer 0 is dense");
        let report = inspect(tmp.path(), &[]).unwrap();
        assert!(report.is_ok(), "{report}");
        assert_eq!(report.experts_contiguous, 8);
        assert!(report.to_string().contains("OK: every expected tensor"));
    }
}

#[test]
fn single_unindexed_file_loads() {
    let (tmp, _) = tiny_snapshot(&Layout {
        shards: 1,
        index: false,
        vision: false,
        prefix: false,
    });
    assert!(tmp.path().join("model.safetensors").exists());
    let ck = Checkpoint::open(tmp.path(), &[]).unwrap();
    assert_eq!(ck.shard_count(), 1);
    assert!(ck.tensor("lm_head.weight").is_ok());
}

#[test]
fn vision_tensors_and_vision_only_shards_are_ignored() {
    let (tmp, _) = tiny_snapshot(&Layout::default());
    // The vision-only shard is in the index but was never written: opening it would fail.
    let index = std::fs::read_to_string(tmp.path().join("model.safetensors.index.json")).unwrap();
    assert!(index.contains("model-00003-of-00003.safetensors"));
    assert!(!tmp.path().join("model-00003-of-00003.safetensors").exists());
    let ck = Checkpoint::open(tmp.path(), &[]).unwrap();
    assert_eq!(ck.shard_count(), 2);
    assert!(ck.tensor_names().all(|n| !n.starts_with("vision_tower.")));
    let e = format!(
        "{:#}",
        ck.tensor("vision_tower.patch_embed.pos").unwrap_err()
    );
    assert!(
        e.contains("tensor `vision_tower.patch_embed.pos` is not in the checkpoint"),
        "{e}"
    );
}

#[test]
fn missing_config_field_is_named() {
    let (tmp, _) = tiny_snapshot(&Layout::default());
    let mut cfg = tiny_config_json();
    cfg["text_config"]
        .as_object_mut()
        .unwrap()
        .remove("attn_res_block_size");
    std::fs::write(tmp.path().join("config.json"), cfg.to_string()).unwrap();
    let e = open_err(tmp.path(), &[]);
    assert!(
        e.contains("config.json: missing field `text_config.attn_res_block_size`"),
        "{e}"
    );
}

#[test]
fn wrong_config_type_is_named() {
    let (tmp, _) = tiny_snapshot(&Layout::default());
    let mut cfg = tiny_config_json();
    cfg["text_config"]["linear_attn_config"]["num_heads"] = serde_json::json!([2]);
    std::fs::write(tmp.path().join("config.json"), cfg.to_string()).unwrap();
    let e = open_err(tmp.path(), &[]);
    assert!(
        e.contains("text_config.linear_attn_config.num_heads: expected a non-negative integer, got a list ([2])"),
        "{e}"
    );
}

#[test]
fn inconsistent_layer_lists_are_refused() {
    let (tmp, _) = tiny_snapshot(&Layout::default());
    let mut cfg = tiny_config_json();
    cfg["text_config"]["linear_attn_config"]["full_attn_layers"] = serde_json::json!([2, 3]);
    std::fs::write(tmp.path().join("config.json"), cfg.to_string()).unwrap();
    let e = open_err(tmp.path(), &[]);
    assert!(
        e.contains(
            "full_attn_layers: layer 2 is also in text_config.linear_attn_config.kda_layers"
        ),
        "{e}"
    );
}

#[test]
fn missing_tensors_are_all_listed_by_inspect_and_named_by_the_loader() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = tiny_cfg();
    let gone = [
        "model.layers.1.self_attn.g_proj.weight",
        "model.norm.weight",
    ];
    let lost_expert = expert_tensor_name(1, 2, 2);
    let groups: Vec<Vec<_>> = all_specs(&cfg)
        .into_iter()
        .map(|g| {
            g.into_iter()
                .filter(|s| !gone.contains(&s.name.as_str()) && s.name != lost_expert)
                .collect::<Vec<_>>()
        })
        .filter(|g| !g.is_empty())
        .collect();
    write_snapshot(tmp.path(), &tiny_config_json(), &groups, &Layout::default());
    let ck = Checkpoint::open(tmp.path(), &[]).unwrap();
    let spec = dense_tensors(&cfg)
        .into_iter()
        .find(|s| s.name == gone[0])
        .unwrap();
    let e = format!("{:#}", ck.tensor_spec(&spec).unwrap_err());
    assert!(
        e.contains(&format!(
            "tensor `{}` is not in the checkpoint at {}",
            gone[0],
            tmp.path().display()
        )),
        "{e}"
    );
    let e = format!("{:#}", ck.expert(1, 2).unwrap_err());
    assert!(
        e.contains("expert 2 of layer 1") && e.contains(&lost_expert),
        "{e}"
    );
    assert!(ck.expert(1, 1).is_ok());

    let report = inspect(tmp.path(), &[]).unwrap();
    assert!(!report.is_ok());
    let names: Vec<&str> = report.problems.iter().map(|p| p.name.as_str()).collect();
    assert_eq!(names.len(), 3, "{report}");
    for n in gone.iter().copied().chain([lost_expert.as_str()]) {
        assert!(names.contains(&n), "{n} not reported:\n{report}");
    }
    assert!(report
        .to_string()
        .contains("model.norm.weight: expected BF16 [64], found missing"));
    assert_eq!(report.experts_present, 7);
}

#[test]
fn wrong_shape_and_dtype_are_named_with_expected_and_found() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = tiny_cfg();
    let mut groups = all_specs(&cfg);
    for g in &mut groups {
        for s in g.iter_mut() {
            if s.name == "model.layers.0.self_attn.o_proj.weight" {
                s.shape = vec![16, 64]; // transposed
            }
            if s.name == "model.layers.2.self_attn.q_a_layernorm.weight" {
                s.dtype = Dtype::F32;
            }
            if s.name == expert_tensor_name(2, 0, 1) {
                s.shape = vec![32, 4];
            }
            // Documented alternatives must still be accepted.
            if s.name == "model.layers.0.self_attn.q_conv1d.weight" {
                s.shape = vec![16, 4];
            }
            if s.name == "model.layers.1.self_attn.A_log" {
                s.shape = vec![128];
                s.dtype = Dtype::F32;
            }
        }
    }
    write_snapshot(tmp.path(), &tiny_config_json(), &groups, &Layout::default());
    let ck = Checkpoint::open(tmp.path(), &[]).unwrap();
    let specs = dense_tensors(&cfg);
    let get = |n: &str| specs.iter().find(|s| s.name == n).unwrap();
    let e = format!(
        "{:#}",
        ck.tensor_spec(get("model.layers.0.self_attn.o_proj.weight"))
            .unwrap_err()
    );
    assert!(e.contains("tensor `model.layers.0.self_attn.o_proj.weight`: expected BF16 [64, 16], found BF16 [16, 64]"), "{e}");
    assert!(e.contains(".safetensors"), "names the file: {e}");
    let e = format!(
        "{:#}",
        ck.tensor_spec(get("model.layers.2.self_attn.q_a_layernorm.weight"))
            .unwrap_err()
    );
    assert!(e.contains("expected BF16 [16], found F32 [16]"), "{e}");
    assert!(ck
        .tensor_spec(get("model.layers.0.self_attn.q_conv1d.weight"))
        .is_ok());
    let a_log = ck
        .tensor_spec(get("model.layers.1.self_attn.A_log"))
        .unwrap();
    assert_eq!(a_log.to_f32().unwrap().len(), 128);
    let e = format!("{:#}", ck.expert(2, 0).unwrap_err());
    assert!(
        e.contains("w1.weight_scale`: expected U8 [32, 2], found U8 [32, 4]"),
        "{e}"
    );

    let report = inspect(tmp.path(), &[]).unwrap();
    assert_eq!(report.problems.len(), 3, "{report}");
}

#[test]
fn truncated_shard_names_file_tensor_and_sizes() {
    let (tmp, _) = tiny_snapshot(&Layout::default());
    let shard = tmp.path().join("model-00002-of-00003.safetensors");
    let len = std::fs::metadata(&shard).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&shard)
        .unwrap()
        .set_len(len - 10)
        .unwrap();
    let e = open_err(tmp.path(), &[]);
    assert!(e.contains(&shard.display().to_string()), "{e}");
    assert!(e.contains("tensor `language_model."), "{e}");
    assert!(
        e.contains(&format!(
            "but the file has {} bytes: the shard is truncated",
            len - 10
        )),
        "{e}"
    );
}

#[test]
fn absurd_header_length_names_the_file() {
    let (tmp, _) = tiny_snapshot(&Layout::default());
    let shard = tmp.path().join("model-00001-of-00003.safetensors");
    let mut bytes = std::fs::read(&shard).unwrap();
    bytes[..8].copy_from_slice(&u64::MAX.to_le_bytes());
    std::fs::write(&shard, &bytes).unwrap();
    let e = open_err(tmp.path(), &[]);
    assert!(
        e.contains(&shard.display().to_string())
            && e.contains("header length")
            && e.contains("absurd"),
        "{e}"
    );
    std::fs::write(&shard, [1u8, 2, 3]).unwrap();
    let e = open_err(tmp.path(), &[]);
    assert!(
        e.contains("3 bytes is too short to be a safetensors file"),
        "{e}"
    );
}

#[test]
fn unreadable_directories_are_named() {
    let tmp = tempfile::tempdir().unwrap();
    let nowhere = tmp.path().join("no-such-snapshot");
    let e = open_err(&nowhere, &[]);
    assert!(
        e.contains(&format!(
            "snapshot directory {}: cannot read",
            nowhere.display()
        )),
        "{e}"
    );
    let (snap, _) = tiny_snapshot(&Layout::default());
    let e = open_err(snap.path(), std::slice::from_ref(&nowhere));
    assert!(
        e.contains("extra shard directory") && e.contains(&nowhere.display().to_string()),
        "{e}"
    );
    // A directory without config.json.
    let e = open_err(tmp.path(), &[]);
    assert!(
        e.contains("config.json: cannot read the model config"),
        "{e}"
    );
    // With config but no shards.
    std::fs::write(
        tmp.path().join("config.json"),
        tiny_config_json().to_string(),
    )
    .unwrap();
    let e = open_err(tmp.path(), &[]);
    assert!(
        e.contains("neither model.safetensors.index.json nor model.safetensors"),
        "{e}"
    );
}

#[test]
fn missing_shard_is_searched_in_extra_dirs() {
    let (tmp, _) = tiny_snapshot(&Layout::default());
    let extra_a = tempfile::tempdir().unwrap();
    let extra_b = tempfile::tempdir().unwrap();
    let name = "model-00002-of-00003.safetensors";
    std::fs::rename(tmp.path().join(name), extra_b.path().join(name)).unwrap();
    let e = open_err(tmp.path(), &[extra_a.path().to_path_buf()]);
    assert!(
        e.contains(&format!(
            "shard {name} not found; searched {}, {}",
            tmp.path().display(),
            extra_a.path().display()
        )),
        "{e}"
    );
    assert!(e.contains("K3_DIRS"), "{e}");
    let extra = [extra_a.path().to_path_buf(), extra_b.path().to_path_buf()];
    let ck = Checkpoint::open(tmp.path(), &extra).unwrap();
    let loc = ck.experts().get(2, 3).unwrap();
    assert_eq!(ck.shard_path(loc.shard), extra_b.path().join(name));
}

#[test]
fn earlier_extra_dir_wins_and_snapshot_comes_first() {
    let (tmp, _) = tiny_snapshot(&Layout::default());
    let first = tempfile::tempdir().unwrap();
    let second = tempfile::tempdir().unwrap();
    let name = "model-00002-of-00003.safetensors";
    std::fs::copy(tmp.path().join(name), second.path().join(name)).unwrap();
    std::fs::rename(tmp.path().join(name), first.path().join(name)).unwrap();
    let extra = [first.path().to_path_buf(), second.path().to_path_buf()];
    let ck = Checkpoint::open(tmp.path(), &extra).unwrap();
    let loc = ck.experts().get(2, 0).unwrap();
    assert_eq!(ck.shard_path(loc.shard), first.path().join(name));
    // Once the snapshot has its own copy, that one is used.
    std::fs::copy(first.path().join(name), tmp.path().join(name)).unwrap();
    let ck = Checkpoint::open(tmp.path(), &extra).unwrap();
    let loc = ck.experts().get(2, 0).unwrap();
    assert_eq!(ck.shard_path(loc.shard), tmp.path().join(name));
}

#[test]
fn contiguity_is_read_from_offsets_per_expert() {
    let (tmp, _) = tiny_snapshot(&Layout::default());
    let scale1 = format!("language_model.{}", expert_tensor_name(2, 1, 1));
    let scale3 = format!("language_model.{}", expert_tensor_name(2, 1, 5));
    let shard = shard_holding(tmp.path(), &scale1);
    swap_tensor_data(&shard, &scale1, &scale3);
    let ck = Checkpoint::open(tmp.path(), &[]).unwrap();
    let table = ck.experts();
    assert_eq!(table.len(), 8);
    assert_eq!(table.contiguous_count(), 7);
    assert!(!table.get(2, 1).unwrap().contiguous);
    assert!(table.get(2, 0).unwrap().contiguous);
    // The bytes still follow the names, wherever they lie.
    let cfg = tiny_cfg();
    let spec = k3::checkpoint::schema::expert_tensors(&cfg, 2, 1);
    let data = ck.expert(2, 1).unwrap();
    let w = data.weights();
    assert_eq!(w.w1.scales, fill(&spec[1]).as_slice());
    assert_eq!(w.w3.scales, fill(&spec[5]).as_slice());
    let report = inspect(tmp.path(), &[]).unwrap();
    assert!(report.is_ok());
    assert!(
        report
            .to_string()
            .contains("8 of 8 present, 7 contiguous, 1 split"),
        "{report}"
    );
}

#[test]
fn index_naming_a_tensor_its_shard_lacks_is_refused() {
    let (tmp, _) = tiny_snapshot(&Layout::default());
    let path = tmp.path().join("model.safetensors.index.json");
    let mut index: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    index["weight_map"]["language_model.model.layers.0.extra.weight"] =
        "model-00001-of-00003.safetensors".into();
    std::fs::write(&path, index.to_string()).unwrap();
    let e = open_err(tmp.path(), &[]);
    assert!(
        e.contains("model.safetensors.index.json") && e.contains("`model.layers.0.extra.weight`"),
        "{e}"
    );
}

#[test]
fn a_directory_or_fifo_in_place_of_a_shard_is_reported_as_what_it_is() {
    let name = "model-00002-of-00003.safetensors";
    let (tmp, _) = tiny_snapshot(&Layout::default());
    let shard = tmp.path().join(name);
    std::fs::remove_file(&shard).unwrap();
    std::fs::create_dir(&shard).unwrap();
    let e = open_err(tmp.path(), &[]);
    assert!(e.contains(&shard.display().to_string()), "{e}");
    assert!(e.contains("is a directory, not a regular file"), "{e}");

    // FIFOs are Unix's (tests/hostile/main.rs says so on other systems).
    #[cfg(unix)]
    {
        std::fs::remove_dir(&shard).unwrap();
        let status = std::process::Command::new("mkfifo")
            .arg(&shard)
            .status()
            .unwrap();
        assert!(status.success());
        // Opening a FIFO for reading would block until a writer came: it must be refused first.
        let e = open_err(tmp.path(), &[]);
        assert!(e.contains("is a FIFO, not a regular file"), "{e}");
    }
}
