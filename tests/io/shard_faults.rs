//! Shards that go bad under a running engine, or hold bytes no real checkpoint holds: each
//! gives an error naming the file, never output computed from wrong bytes.

use crate::support;

use k3::experts::{IoMode, StreamConfig};
use k3::generate::prefill;
use k3::model::FormatPolicy;
use k3::stats::Stats;
use serde_json::Value;
use std::path::Path;

const PROMPT: [u32; 6] = [768, 5, 300, 17, 999, 42];

fn stream(mode: IoMode, pipe: bool) -> StreamConfig {
    StreamConfig {
        mode,
        pipe,
        load_threads: 2,
        slots_per_layer: 0,
    }
}

/// Every routed-expert tensor of the shard at `path` whose stored name ends with `suffix`:
/// its absolute byte range in the file.
fn expert_ranges(path: &Path, suffix: &str) -> Vec<std::ops::Range<usize>> {
    let buf = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(buf[..8].try_into().unwrap()) as usize;
    let header: Value = serde_json::from_slice(&buf[8..8 + n]).unwrap();
    header
        .as_object()
        .unwrap()
        .iter()
        .filter(|(k, _)| k.contains(".experts.") && k.ends_with(suffix))
        .map(|(_, v)| {
            let o = &v["data_offsets"];
            8 + n + o[0].as_u64().unwrap() as usize..8 + n + o[1].as_u64().unwrap() as usize
        })
        .collect()
}

fn shards(dir: &Path) -> Vec<std::path::PathBuf> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect()
}

/// The prefill error of the tiny model when `spoil` runs on each shard before (`early`) or
/// after the model loads.
fn prefill_error(sc: StreamConfig, early: bool, spoil: impl Fn(&Path)) -> String {
    let copy = support::copy_dir(&support::tiny(0));
    let dir = copy.path().to_path_buf();
    if early {
        shards(&dir).iter().for_each(|p| spoil(p));
    }
    let m = support::cpu_model(&dir, FormatPolicy::default(), sc);
    if !early {
        shards(&dir).iter().for_each(|p| spoil(p));
    }
    let mut st = m.new_state().unwrap();
    let e = prefill(&m, &mut st, &PROMPT, 32, false, &mut Stats::default(), None).unwrap_err();
    format!("{e:#}")
}

#[test]
fn an_e8m0_nan_scale_in_an_expert_is_reported_with_the_tensor() {
    for pipe in [false, true] {
        let msg = prefill_error(stream(IoMode::Buffered, pipe), true, |p| {
            let mut bytes = std::fs::read(p).unwrap();
            for r in expert_ranges(p, "weight_scale") {
                bytes[r].fill(0xFF);
            }
            std::fs::write(p, bytes).unwrap();
        });
        assert!(msg.contains("E8M0 reserves for NaN"), "{msg}");
        assert!(
            msg.contains(".safetensors") && msg.contains("weight_scale"),
            "{msg}"
        );
        assert!(msg.contains("of layer"), "{msg}");
    }
}

#[test]
fn a_shard_overwritten_in_place_while_experts_stream_is_reported() {
    for (mode, pipe) in [(IoMode::Buffered, false), (IoMode::Direct, true)] {
        let msg = prefill_error(stream(mode, pipe), false, |p| {
            // Same size, the expert bytes zeroed, as a copy over the file would leave it.
            let mut bytes = std::fs::read(p).unwrap();
            for r in expert_ranges(p, "") {
                bytes[r].fill(0);
            }
            std::fs::write(p, &bytes).unwrap();
            let later = std::time::SystemTime::now() + std::time::Duration::from_secs(5);
            std::fs::File::options()
                .write(true)
                .open(p)
                .unwrap()
                .set_modified(later)
                .unwrap();
        });
        assert!(msg.contains("changed while k3 was running"), "{msg}");
        assert!(
            msg.contains(".safetensors") && msg.contains("offset"),
            "{msg}"
        );
    }
}

#[test]
fn a_non_finite_hidden_state_stops_the_run_naming_the_layer() {
    let copy = support::with_nan_tensor("model.layers.1.post_attention_layernorm.weight");
    let m = support::cpu_model(
        copy.path(),
        FormatPolicy::default(),
        stream(IoMode::Buffered, false),
    );
    let mut st = m.new_state().unwrap();
    let e = prefill(&m, &mut st, &PROMPT, 32, false, &mut Stats::default(), None).unwrap_err();
    let msg = format!("{e:#}");
    assert!(msg.contains("layer 1 produced a non-finite value"), "{msg}");
}

/// The tiny model with element 0 of every stored tensor ending in `suffix` set to `value`.
fn with_first_value(suffix: &str, value: f32) -> tempfile::TempDir {
    let (copy, hits) = support::with_edited_tensors(|k, v, data| {
        if !k.ends_with(suffix) {
            return false;
        }
        match v["dtype"].as_str() {
            Some("BF16") => data[..2].copy_from_slice(&half::bf16::from_f32(value).to_le_bytes()),
            Some("F32") => data[..4].copy_from_slice(&value.to_le_bytes()),
            other => panic!("{k}: dtype {other:?}"),
        }
        true
    });
    assert!(hits > 0, "no tensor ends with {suffix}");
    copy
}

#[test]
fn a_non_finite_router_weight_or_bias_is_refused_at_load_on_every_backend() {
    use k3::backend::cpu::CpuBackend;
    use k3::backend::gpu::GpuOptions;
    use k3::checkpoint::Checkpoint;
    use k3::model::K3Model;
    for suffix in ["gate.weight", "gate.e_score_correction_bias"] {
        for value in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let copy = with_first_value(suffix, value);
            let load_err = |e: anyhow::Error| format!("{e:#}");
            let ck = Checkpoint::open(copy.path(), &[]).unwrap();
            let cpu = K3Model::load(ck, CpuBackend::new(), FormatPolicy::default(), false)
                .err()
                .map(load_err)
                .unwrap_or_else(|| panic!("{suffix} = {value}: the CPU loaded it"));
            assert!(
                cpu.contains(suffix) && cpu.contains("element 0") && cpu.contains(".safetensors"),
                "{suffix} = {value}: {cpu}"
            );
            // The check is the loader's, before any backend sees the values: one GPU case.
            if !value.is_nan() {
                continue;
            }
            if let Some(g) = support::gpu_backend(GpuOptions::default()) {
                let ck = Checkpoint::open(copy.path(), &[]).unwrap();
                let gpu = K3Model::load(ck, g, FormatPolicy::default(), false)
                    .err()
                    .map(load_err)
                    .unwrap_or_else(|| panic!("{suffix} = {value}: the GPU loaded it"));
                assert!(gpu.contains(suffix), "{suffix} = {value}: {gpu}");
            }
        }
    }
}

#[test]
fn an_embedding_stored_transposed_is_refused_at_load_naming_it() {
    use k3::backend::cpu::CpuBackend;
    use k3::checkpoint::Checkpoint;
    use k3::model::K3Model;
    let copy = support::copy_dir(&support::tiny(0));
    let name = "model.embed_tokens.weight";
    let stored = format!("{}{name}", k3::checkpoint::schema::LANGUAGE_MODEL_PREFIX);
    let path = support::tiny_ckpt::shard_holding(copy.path(), &stored);
    let mut bytes = std::fs::read(&path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut header: Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let shape = header[&stored]["shape"].as_array_mut().unwrap();
    shape.swap(0, 1);
    let mut text = serde_json::to_vec(&header).unwrap();
    assert!(text.len() <= n, "the edited header grew");
    text.resize(n, b' ');
    bytes[8..8 + n].copy_from_slice(&text);
    std::fs::write(&path, bytes).unwrap();
    let ck = Checkpoint::open(copy.path(), &[]).unwrap();
    let e = match K3Model::load(ck, CpuBackend::new(), FormatPolicy::default(), false) {
        Ok(_) => panic!("a transposed embedding loaded"),
        Err(e) => format!("{e:#}"),
    };
    assert!(e.contains(name) && e.contains("expected"), "{e}");
}

/// The shard of `dir` that holds the embedding table.
fn embedding_shard(dir: &Path) -> std::path::PathBuf {
    let stored = format!(
        "{}model.embed_tokens.weight",
        k3::checkpoint::schema::LANGUAGE_MODEL_PREFIX
    );
    support::tiny_ckpt::shard_holding(dir, &stored)
}

/// The prefill error after `spoil` runs on the embedding's shard once the model loaded.
fn prefill_error_after_embedding_shard(spoil: impl Fn(&Path)) -> String {
    let copy = support::copy_dir(&support::tiny(0));
    let m = support::cpu_model(
        copy.path(),
        FormatPolicy::default(),
        stream(IoMode::Buffered, false),
    );
    spoil(&embedding_shard(copy.path()));
    let mut st = m.new_state().unwrap();
    match prefill(&m, &mut st, &PROMPT, 32, false, &mut Stats::default(), None) {
        Ok(_) => panic!("a prefill over a changed embedding shard succeeded"),
        Err(e) => format!("{e:#}"),
    }
}

#[test]
fn an_embedding_shard_rewritten_in_place_with_its_time_restored_is_reported() {
    let msg = prefill_error_after_embedding_shard(|p| {
        let was = std::fs::metadata(p).unwrap().modified().unwrap();
        let bytes = std::fs::read(p).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(20));
        std::fs::write(p, &bytes).unwrap();
        std::fs::File::options()
            .write(true)
            .open(p)
            .unwrap()
            .set_modified(was)
            .unwrap();
    });
    assert!(msg.contains("changed while k3 was running"), "{msg}");
    assert!(
        msg.contains(".safetensors") && msg.contains("offset"),
        "{msg}"
    );
}

#[test]
fn an_embedding_shard_replaced_by_rename_is_reported() {
    support::where_open_files_can_be_replaced(crate::REPLACED_WHILE_OPEN, || {
        let msg = prefill_error_after_embedding_shard(|p| {
            // What a re-download does: a complete new file renamed over the old one, here
            // with the same bytes and modification time.
            let was = std::fs::metadata(p).unwrap().modified().unwrap();
            let tmp = p.with_extension("incomplete");
            std::fs::copy(p, &tmp).unwrap();
            std::fs::File::options()
                .write(true)
                .open(&tmp)
                .unwrap()
                .set_modified(was)
                .unwrap();
            std::fs::rename(&tmp, p).unwrap();
        });
        assert!(msg.contains("changed while k3 was running"), "{msg}");
        assert!(msg.contains(".safetensors"), "{msg}");
    });
}

/// Every handle k3 keeps on a shard lets another program delete or replace the file (on
/// Windows, a share mode with `FILE_SHARE_DELETE`): a re-download or a cleanup while k3
/// runs is k3's to notice, never refused by the OS.
#[test]
fn the_shards_k3_holds_open_can_be_deleted() {
    for (mode, pipe) in [(IoMode::Buffered, false), (IoMode::Direct, true)] {
        let copy = support::copy_dir(&support::tiny(0));
        let m = support::cpu_model(copy.path(), FormatPolicy::default(), stream(mode, pipe));
        let mut st = m.new_state().unwrap();
        prefill(&m, &mut st, &PROMPT, 32, false, &mut Stats::default(), None).unwrap();
        for p in shards(copy.path()) {
            if let Err(e) = std::fs::remove_file(&p) {
                panic!(
                    "{mode:?}: {} is held open against deletion: {e}",
                    p.display()
                );
            }
        }
        drop(m);
    }
}

#[test]
fn a_shard_truncated_before_the_dense_weights_load_is_an_error_not_a_signal() {
    use k3::backend::cpu::CpuBackend;
    use k3::checkpoint::Checkpoint;
    use k3::model::K3Model;
    let copy = support::copy_dir(&support::tiny(0));
    // Opened (headers validated), then every shard cut to its header and a little more:
    // the dense load's copies would touch pages past the end of a mapping.
    let ck = Checkpoint::open(copy.path(), &[]).unwrap();
    for p in shards(copy.path()) {
        let bytes = std::fs::read(&p).unwrap();
        let n = u64::from_le_bytes(bytes[..8].try_into().unwrap());
        std::fs::File::options()
            .write(true)
            .open(&p)
            .unwrap()
            .set_len(8 + n + 16)
            .unwrap();
    }
    let e = match K3Model::load(ck, CpuBackend::new(), FormatPolicy::default(), false) {
        Ok(_) => panic!("a model loaded from truncated shards"),
        Err(e) => format!("{e:#}"),
    };
    assert!(e.contains(".safetensors"), "{e}");
    assert!(e.contains("changed while k3 was running"), "{e}");
    assert!(e.contains("its size went from"), "{e}");
}
