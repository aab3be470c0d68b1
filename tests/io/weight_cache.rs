//! The quantized-weight cache (a hit gives the logits of a fresh quantization, on the CPU
//! and the GPU; a corrupt, truncated or stale file is detected and rebuilt; an unwritable
//! place is a warning) and the C engine's repacked container (U8 values with `.qs` f32
//! scales load without re-quantizing, as the values they encode).

use crate::support;

use k3::backend::cpu::CpuBackend;
use k3::backend::gpu::{GpuBackend, GpuOptions};
use k3::backend::Backend;
use k3::checkpoint::schema::dense_tensors;
use k3::checkpoint::{Checkpoint, TensorSpec};
use k3::model::loader::{LoadOptions, Loader};
use k3::model::weight_cache::{file_name, WeightCache, WeightCacheSetting};
use k3::model::{FormatPolicy, K3Model, Logits, Runner};
use k3::quant::DenseFormat;
use k3::stats::Stats;
use safetensors::tensor::TensorView as StView;
use safetensors::Dtype as StDtype;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The cache file of the default formats.
fn cache_file() -> String {
    file_name(&FormatPolicy::default())
}

const IDS: [u32; 5] = [1, 7, 3, 12, 5];

fn opts(setting: WeightCacheSetting) -> LoadOptions {
    LoadOptions {
        progress: false,
        weight_cache: setting,
        announce: false,
    }
}

fn logits<B: Backend>(m: K3Model<B>) -> Vec<u32> {
    let m = Runner::new(m, support::stream_settings(support::serial_stream())).unwrap();
    let mut st = m.new_state().unwrap();
    let out = m
        .forward(&mut st, &IDS, Logits::All, &mut Stats::default(), None)
        .unwrap();
    out.iter().map(|v| v.to_bits()).collect()
}

fn cpu_logits(dir: &Path, policy: FormatPolicy, setting: WeightCacheSetting) -> Vec<u32> {
    let ck = Checkpoint::open(dir, &[]).unwrap();
    logits(K3Model::load_with(ck, CpuBackend::new(), policy, &opts(setting)).unwrap())
}

/// What the cache in `dir` answers now: the start-up words of a load that only looks.
fn state(snap: &Path, policy: FormatPolicy, dir: &Path) -> String {
    let ck = Checkpoint::open(snap, &[]).unwrap();
    let c = WeightCache::open(&ck, &policy, &WeightCacheSetting::Dirs(vec![dir.into()]));
    c.finish().0
}

/// A snapshot copy with a cache built in `cache/`; returns (snapshot, cache dir).
fn built(policy: FormatPolicy) -> (tempfile::TempDir, tempfile::TempDir, Vec<u32>) {
    let snap = support::copy_dir(&support::tiny(0));
    let cache = tempfile::tempdir().unwrap();
    let fresh = cpu_logits(snap.path(), policy, WeightCacheSetting::Off);
    let setting = WeightCacheSetting::Dirs(vec![cache.path().into()]);
    assert_eq!(cpu_logits(snap.path(), policy, setting), fresh);
    assert!(cache.path().join(file_name(&policy)).is_file());
    (snap, cache, fresh)
}

#[test]
fn a_hit_gives_the_logits_of_a_fresh_quantization_on_the_cpu() {
    for policy in [
        FormatPolicy::default(),
        FormatPolicy::from_bits(8, 4, 4).unwrap(),
    ] {
        let (snap, cache, fresh) = built(policy);
        let s = state(snap.path(), policy, cache.path());
        assert!(s.starts_with("hit"), "{s}");
        let setting = WeightCacheSetting::Dirs(vec![cache.path().into()]);
        assert_eq!(cpu_logits(snap.path(), policy, setting), fresh);
    }
}

#[test]
fn a_hit_gives_the_logits_of_a_fresh_quantization_on_the_gpu() {
    let gpu = || match GpuBackend::new(&GpuOptions {
        allow_cpu_adapter: true,
        ..Default::default()
    }) {
        Ok(g) => Some(g),
        Err(e) => {
            support::skip_gpu_tests(&e);
            None
        }
    };
    let Some(g) = gpu() else { return };
    let policy = FormatPolicy::default();
    let (snap, cache, _) = built(policy);
    let load = |g: GpuBackend, setting| {
        let ck = Checkpoint::open(snap.path(), &[]).unwrap();
        logits(K3Model::load_with(ck, g, policy, &opts(setting)).unwrap())
    };
    let fresh = load(g, WeightCacheSetting::Off);
    let Some(g) = gpu() else { return };
    let hit = load(g, WeightCacheSetting::Dirs(vec![cache.path().into()]));
    assert_eq!(hit, fresh);
}

/// Damages the built cache with `damage`, then checks that the next load reports it,
/// rebuilds it and still gives the fresh logits, and that the rebuilt file is a hit.
fn detected_and_rebuilt(damage: impl Fn(&Path, &Path), policy: FormatPolicy, words: &str) {
    let (snap, cache, _) = built(FormatPolicy::default());
    damage(snap.path(), &cache.path().join(cache_file()));
    let fresh = cpu_logits(snap.path(), policy, WeightCacheSetting::Off);
    let s = state(snap.path(), policy, cache.path());
    assert!(s.contains(words) && s.contains("rebuilt"), "{s}");
    // That look rebuilt it; damage it again and load through the model this time.
    damage(snap.path(), &cache.path().join(cache_file()));
    let setting = WeightCacheSetting::Dirs(vec![cache.path().into()]);
    assert_eq!(cpu_logits(snap.path(), policy, setting), fresh);
    let s = state(snap.path(), policy, cache.path());
    assert!(s.starts_with("hit"), "{s}");
}

fn flip_byte(at: impl Fn(u64) -> u64) -> impl Fn(&Path, &Path) {
    move |_, file| {
        let mut b = std::fs::read(file).unwrap();
        let i = at(b.len() as u64) as usize;
        b[i] ^= 0x10;
        std::fs::write(file, b).unwrap();
    }
}

#[test]
fn a_corrupted_value_byte_is_detected_and_rebuilt() {
    detected_and_rebuilt(
        flip_byte(|_| 16 + 64 * 3 + 5),
        FormatPolicy::default(),
        "checksum",
    );
}

#[test]
fn a_corrupted_table_byte_is_detected_and_rebuilt() {
    detected_and_rebuilt(
        flip_byte(|len| len - 32 - 40),
        FormatPolicy::default(),
        "table checksum",
    );
}

#[test]
fn a_truncated_file_is_detected_and_rebuilt() {
    let cut = |_: &Path, file: &Path| {
        let f = std::fs::OpenOptions::new().write(true).open(file).unwrap();
        let len = f.metadata().unwrap().len();
        f.set_len(len - 100).unwrap();
    };
    detected_and_rebuilt(cut, FormatPolicy::default(), "truncated");
    let empty = |_: &Path, file: &Path| std::fs::write(file, b"K3WC").unwrap();
    detected_and_rebuilt(empty, FormatPolicy::default(), "truncated");
}

#[test]
fn a_changed_shard_modification_time_makes_it_stale() {
    let touch = |snap: &Path, _: &Path| {
        let shard = snap.join("model-00002-of-00006.safetensors");
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(&shard)
            .unwrap();
        let was = f.metadata().unwrap().modified().unwrap();
        f.set_modified(was + std::time::Duration::from_secs(7))
            .unwrap();
    };
    detected_and_rebuilt(touch, FormatPolicy::default(), "model-00002-of-00006");
}

#[test]
fn each_format_policy_keeps_its_own_file() {
    let int8 = FormatPolicy::from_bits(8, 8, 8).unwrap();
    let (snap, cache, _) = built(FormatPolicy::default());
    // --bits 8 builds its own file beside --bits 4's instead of replacing it.
    let s = state(snap.path(), int8, cache.path());
    assert!(!s.starts_with("hit") && !s.contains("stale"), "{s}");
    assert!(cache.path().join(file_name(&int8)).is_file());
    assert_ne!(file_name(&int8), cache_file());
    for policy in [FormatPolicy::default(), int8] {
        let s = state(snap.path(), policy, cache.path());
        assert!(s.starts_with("hit"), "{s}");
    }
}

/// Rewrites the file at `p` with `edit` applied to its bytes, in place (same inode), and
/// sets its modification time back to what it was, as `cp -p` or `rsync -t` leave it.
fn rewrite_keeping_mtime(p: &Path, edit: impl FnOnce(&mut Vec<u8>)) {
    let was = std::fs::metadata(p).unwrap().modified().unwrap();
    let mut bytes = std::fs::read(p).unwrap();
    edit(&mut bytes);
    std::thread::sleep(std::time::Duration::from_millis(20));
    std::fs::write(p, &bytes).unwrap();
    std::fs::File::options()
        .write(true)
        .open(p)
        .unwrap()
        .set_modified(was)
        .unwrap();
}

/// A dense BF16 projection of some shard of `snap`: the shard and the tensor's byte range.
fn dense_projection(snap: &Path) -> (PathBuf, std::ops::Range<usize>) {
    let mut shards: Vec<PathBuf> = std::fs::read_dir(snap)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    shards.sort();
    for p in shards {
        let buf = std::fs::read(&p).unwrap();
        let n = u64::from_le_bytes(buf[..8].try_into().unwrap()) as usize;
        let header: serde_json::Value = serde_json::from_slice(&buf[8..8 + n]).unwrap();
        let mut names: Vec<_> = header.as_object().unwrap().iter().collect();
        names.sort_by(|a, b| a.0.cmp(b.0));
        for (k, v) in names {
            if k.contains("proj") && !k.contains("experts") && v["dtype"] == "BF16" {
                let o = &v["data_offsets"];
                let r = 8 + n + o[0].as_u64().unwrap() as usize
                    ..8 + n + o[1].as_u64().unwrap() as usize;
                return (p, r);
            }
        }
    }
    panic!("no dense projection in {}", snap.display());
}

#[test]
fn a_shard_rewritten_in_place_with_its_time_restored_makes_it_stale() {
    let policy = FormatPolicy::default();
    let (snap, cache, before) = built(policy);
    let (shard, range) = dense_projection(snap.path());
    // Every value's sign flipped: finite, and other answers.
    rewrite_keeping_mtime(&shard, |b| {
        for i in range.step_by(2) {
            b[i + 1] ^= 0x80;
        }
    });
    let fresh = cpu_logits(snap.path(), policy, WeightCacheSetting::Off);
    assert_ne!(fresh, before, "the edit changed nothing");
    let name = shard.file_name().unwrap().to_string_lossy().into_owned();
    let s = state(snap.path(), policy, cache.path());
    assert!(
        s.contains("stale") && s.contains(&name) && s.contains("rebuilt"),
        "{s}"
    );
    // That look left an empty cache, which the next load drops and the one after fills.
    let setting = WeightCacheSetting::Dirs(vec![cache.path().into()]);
    for _ in 0..2 {
        assert_eq!(cpu_logits(snap.path(), policy, setting.clone()), fresh);
    }
    let s = state(snap.path(), policy, cache.path());
    assert!(s.starts_with("hit"), "{s}");
    // The same bytes written back, the time restored again: the change time still tells.
    rewrite_keeping_mtime(&shard, |_| {});
    let s = state(snap.path(), policy, cache.path());
    assert!(s.contains("stale") && s.contains("change time"), "{s}");
}

#[cfg(unix)]
#[test]
fn the_same_snapshot_through_another_path_hits() {
    let (snap, cache, _) = built(FormatPolicy::default());
    let other = tempfile::tempdir().unwrap();
    let link = other.path().join("snapshot");
    std::os::unix::fs::symlink(snap.path(), &link).unwrap();
    let s = state(&link, FormatPolicy::default(), cache.path());
    assert!(s.starts_with("hit"), "{s}");
}

#[test]
fn an_unwritable_place_is_a_warning_and_the_load_works() {
    let snap = support::copy_dir(&support::tiny(0));
    let policy = FormatPolicy::default();
    let fresh = cpu_logits(snap.path(), policy, WeightCacheSetting::Off);
    // A directory under a regular file can never be created, even by root.
    let blocker = snap.path().join("config.json").join("cache");
    let s = state(snap.path(), policy, &blocker);
    assert!(s.starts_with("off: cannot be written"), "{s}");
    let setting = WeightCacheSetting::Dirs(vec![blocker.clone()]);
    assert_eq!(cpu_logits(snap.path(), policy, setting), fresh);
    // Off writes nothing anywhere.
    let ck = Checkpoint::open(snap.path(), &[]).unwrap();
    let (s, _) = WeightCache::open(&ck, &policy, &WeightCacheSetting::Off).finish();
    assert_eq!(s, "off");
}

#[test]
fn the_first_writable_place_gets_the_cache() {
    let snap = support::copy_dir(&support::tiny(0));
    let good = tempfile::tempdir().unwrap();
    let bad: PathBuf = snap.path().join("config.json").join("x");
    let policy = FormatPolicy::default();
    let setting = WeightCacheSetting::Dirs(vec![bad, good.path().into()]);
    let ck = Checkpoint::open(snap.path(), &[]).unwrap();
    drop(K3Model::load_with(ck, CpuBackend::new(), policy, &opts(setting)).unwrap());
    assert!(good.path().join(cache_file()).is_file());
}

// ---- the C engine's repacked container ----

/// The C engine's load-time quantizers as its repack tool documents them: scale
/// `max(max|w| / 127, 1e-20)` per row (int8) or `max(max|w| / 7, 1e-20)` per 64 columns
/// (int4), values `rint(w · (1 / scale))` (ties to even) clamped to ±127 or -8..7, int4
/// nibbles stored as `value + 8`.
fn c_quantize(rows: usize, cols: usize, w: &[f32], int4: bool) -> (Vec<u8>, Vec<f32>) {
    let (mut q, mut s) = (Vec::new(), Vec::new());
    for r in w.chunks(cols) {
        let group = if int4 { 64 } else { cols };
        let mut vals = Vec::new();
        for g in r.chunks(group) {
            let am = g.iter().fold(0f32, |m, v| m.max(v.abs()));
            let sc = (am / if int4 { 7.0 } else { 127.0 }).max(1e-20);
            s.push(sc);
            let inv = 1.0 / sc;
            for &v in g {
                let x = (v * inv).round_ties_even();
                vals.push(if int4 {
                    x.clamp(-8.0, 7.0) as i32
                } else {
                    x.clamp(-127.0, 127.0) as i32
                });
            }
        }
        if int4 {
            q.extend(
                vals.chunks(2)
                    .map(|p| ((p[0] + 8) as u8) | (((p[1] + 8) as u8) << 4)),
            );
        } else {
            q.extend(vals.iter().map(|&v| v as i8 as u8));
        }
    }
    assert_eq!(q.len(), if int4 { rows * cols / 2 } else { rows * cols });
    (q, s)
}

/// Which matrices the repack tool quantizes (the big projections and the head), and
/// whether in int4 (`K3_BITS` class) or int8 (MLA and head classes).
fn repacked_as(name: &str) -> Option<bool> {
    let leaf = name.rsplit('.').nth(1)?;
    if name.ends_with("lm_head.weight") {
        return Some(false);
    }
    if ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj"].contains(&leaf) {
        return Some(false);
    }
    let int4 = [
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "g_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
        "routed_expert_down_proj",
        "routed_expert_up_proj",
    ];
    int4.contains(&leaf).then_some(true)
}

/// Rewrites every shard of the snapshot copy at `dir` as a repacked container; the
/// int4 candidates whose width is not a multiple of 64 become int8. Returns each
/// repacked tensor's dequantized values (`q · scale`, as the C engine computes them).
fn repack(dir: &Path, allow_int4: bool) -> BTreeMap<String, (bool, Vec<f32>)> {
    let mut dequantized = BTreeMap::new();
    let index_path = dir.join("model.safetensors.index.json");
    let mut index: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&index_path).unwrap()).unwrap();
    for e in std::fs::read_dir(dir).unwrap() {
        let path = e.unwrap().path();
        if path.extension().and_then(|x| x.to_str()) != Some("safetensors") {
            continue;
        }
        let bytes = std::fs::read(&path).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let mut out: Vec<(String, StDtype, Vec<usize>, Vec<u8>)> = Vec::new();
        for (name, t) in st.tensors() {
            let shape = t.shape().to_vec();
            let canon = name.strip_prefix("language_model.").unwrap_or(&name);
            match (repacked_as(canon), t.dtype(), shape.as_slice()) {
                (Some(int4), StDtype::BF16, &[rows, cols]) => {
                    let int4 = allow_int4 && int4 && cols % 64 == 0;
                    let w: Vec<f32> = t
                        .data()
                        .chunks_exact(2)
                        .map(|b| f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16))
                        .collect();
                    let (q, s) = c_quantize(rows, cols, &w, int4);
                    let deq: Vec<f32> = (0..rows * cols)
                        .map(|i| {
                            let (r, c) = (i / cols, i % cols);
                            if int4 {
                                let b = q[(r * cols + c) / 2];
                                let n = if c % 2 == 0 { b & 15 } else { b >> 4 };
                                (i32::from(n) - 8) as f32 * s[r * (cols / 64) + c / 64]
                            } else {
                                f32::from(q[i] as i8) * s[r]
                            }
                        })
                        .collect();
                    dequantized.insert(canon.to_string(), (int4, deq));
                    let qshape = vec![rows, if int4 { cols / 2 } else { cols }];
                    let sshape = if int4 {
                        vec![rows, cols / 64]
                    } else {
                        vec![rows]
                    };
                    out.push((name.clone(), StDtype::U8, qshape, q));
                    let sb: Vec<u8> = s.iter().flat_map(|v| v.to_le_bytes()).collect();
                    let qs = format!("{name}.qs");
                    let file = path.file_name().unwrap().to_str().unwrap().to_string();
                    index["weight_map"][&qs] = serde_json::Value::String(file);
                    out.push((qs, StDtype::F32, sshape, sb));
                }
                _ => out.push((name.clone(), t.dtype(), shape, t.data().to_vec())),
            }
        }
        let views: Vec<(String, StView)> = out
            .iter()
            .map(|(n, d, s, b)| (n.clone(), StView::new(*d, s.clone(), b).unwrap()))
            .collect();
        safetensors::serialize_to_file(views, None, &path).unwrap();
    }
    std::fs::write(&index_path, serde_json::to_vec(&index).unwrap()).unwrap();
    dequantized
}

/// The schema entry of dense tensor `name` of `ck`.
fn spec(ck: &Checkpoint, name: &str) -> TensorSpec {
    let found = dense_tensors(&ck.config)
        .into_iter()
        .find(|s| s.name == name);
    found.unwrap_or_else(|| panic!("{name} is not a dense tensor"))
}

#[test]
fn a_repacked_container_loads_the_values_it_encodes() {
    let snap = support::copy_dir(&support::tiny(0));
    let want = repack(snap.path(), true);
    assert!(want.values().any(|(int4, _)| *int4) && want.values().any(|(int4, _)| !*int4));
    let ck = Checkpoint::open(snap.path(), &[]).unwrap();
    let cpu = CpuBackend::new();
    let ld = Loader::new(&ck, &cpu, false);
    for (name, (int4, deq)) in &want {
        // Whatever format is asked, a container matrix loads as stored (f32 excepted).
        let m = ld.host_matrix(&spec(&ck, name), DenseFormat::Bf16).unwrap();
        let stored = if *int4 {
            DenseFormat::Int4
        } else {
            DenseFormat::Int8
        };
        assert_eq!(m.format(), stored, "{name}");
        let got: Vec<u32> = m.dequantize().iter().map(|v| v.to_bits()).collect();
        let want: Vec<u32> = deq.iter().map(|v| v.to_bits()).collect();
        assert_eq!(got, want, "{name}");
        let f = ld.host_matrix(&spec(&ck, name), DenseFormat::F32).unwrap();
        assert_eq!(f.format(), DenseFormat::F32);
        assert_eq!(f.dequantize(), m.dequantize(), "{name}");
    }
    let lines = ld.finish();
    assert!(
        lines.iter().any(|l| l.contains("repacked container")),
        "{lines:?}"
    );
}

#[test]
fn a_whole_model_runs_on_an_int8_container_as_on_its_own_int8() {
    // On the tiny random model int4 noise alone moves the logits by most of their norm, so
    // the whole-model comparison is at int8, where the two quantizers differ only at
    // rounding ties and in multiplying by the scale's reciprocal.
    let snap = support::copy_dir(&support::tiny(0));
    let want = repack(snap.path(), false);
    assert!(want.values().all(|(int4, _)| !*int4));
    let policy = FormatPolicy::from_bits(8, 8, 8).unwrap();
    let container = cpu_logits(snap.path(), policy, WeightCacheSetting::Off);
    let own = cpu_logits(&support::tiny(0), policy, WeightCacheSetting::Off);
    let exact = cpu_logits(
        &support::tiny(0),
        FormatPolicy::exact(),
        WeightCacheSetting::Off,
    );
    let f = |v: &[u32]| v.iter().map(|b| f32::from_bits(*b)).collect::<Vec<f32>>();
    let d = support::rel_l2(&f(&container), &f(&own));
    let noise = support::rel_l2(&f(&own), &f(&exact));
    assert!(
        d < noise / 4.0,
        "an int8 container's logits differ from k3's own int8 by {d} (int8 against f32: {noise})"
    );
}

/// Replaces tensor `name`'s header entry in the shard holding it by `edit`'s.
fn edit_header(dir: &Path, stored: &str, edit: impl Fn(&mut serde_json::Value)) {
    let path = support::tiny_ckpt::shard_holding(dir, stored);
    let bytes = std::fs::read(&path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut h: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    edit(&mut h);
    let mut text = serde_json::to_vec(&h).unwrap();
    text.resize(n.max(text.len()), b' ');
    assert_eq!(text.len(), n, "the edited header must keep its length");
    let mut out = bytes[..8].to_vec();
    out.extend_from_slice(&text);
    out.extend_from_slice(&bytes[8 + n..]);
    std::fs::write(&path, out).unwrap();
}

#[test]
fn a_bad_container_tensor_is_refused_naming_it() {
    let name = "model.layers.0.self_attn.q_proj.weight";
    let stored = format!("language_model.{name}");
    let load_err = |dir: &Path| {
        let ck = Checkpoint::open(dir, &[]).unwrap();
        let cpu = CpuBackend::new();
        let e = Loader::new(&ck, &cpu, false)
            .host_matrix(&spec(&ck, name), DenseFormat::Int4)
            .unwrap_err();
        format!("{e:#}")
    };
    // Scales missing: rename the sidecar.
    let snap = support::copy_dir(&support::tiny(0));
    repack(snap.path(), true);
    edit_header(snap.path(), &stored, |h| {
        let v = h[format!("{stored}.qs")].take();
        h.as_object_mut().unwrap().remove(&format!("{stored}.qs"));
        h["language_model.x.qz"] = v;
    });
    let index_path = snap.path().join("model.safetensors.index.json");
    let mut index: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&index_path).unwrap()).unwrap();
    let map = index["weight_map"].as_object_mut().unwrap();
    map.remove(&format!("{stored}.qs"));
    std::fs::write(&index_path, serde_json::to_vec(&index).unwrap()).unwrap();
    let e = load_err(snap.path());
    assert!(
        e.contains(&format!("`{name}` is U8")) && e.contains("scales"),
        "{e}"
    );
    // Scales of the wrong count: the sidecar declared as two values.
    let snap = support::copy_dir(&support::tiny(0));
    repack(snap.path(), true);
    edit_header(snap.path(), &stored, |h| {
        let qs = &mut h[format!("{stored}.qs")];
        qs["shape"] = serde_json::json!([2]);
        let start = qs["data_offsets"][0].as_u64().unwrap();
        qs["data_offsets"] = serde_json::json!([start, start + 8]);
    });
    let e = load_err(snap.path());
    assert!(
        e.contains(&format!("repacked tensor `{name}`")) && e.contains("matches neither"),
        "{e}"
    );
    // A scale that is not finite.
    let snap = support::copy_dir(&support::tiny(0));
    repack(snap.path(), true);
    let path = support::tiny_ckpt::shard_holding(snap.path(), &stored);
    let bytes = std::fs::read(&path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let qs = st.tensor(&format!("{stored}.qs")).unwrap();
    let at = qs.data().as_ptr() as usize - bytes.as_ptr() as usize + 4;
    let mut bytes = bytes.clone();
    bytes[at..at + 4].copy_from_slice(&f32::NAN.to_le_bytes());
    std::fs::write(&path, bytes).unwrap();
    let e = load_err(snap.path());
    assert!(e.contains("scale 1 of its `.qs` is NaN"), "{e}");
}

/// `k3 run` on a snapshot copy: (stdout, stderr), with `env` set.
fn k3_run(dir: &Path, extra: &[&str], env: &[(&str, &str)]) -> (String, String) {
    let mut c = std::process::Command::new(env!("CARGO_BIN_EXE_k3"));
    c.args([
        "run",
        dir.to_str().unwrap(),
        "--backend",
        "cpu",
        "--ids",
        "1,7,3",
    ])
    .args(["--ngen", "4", "--quiet"])
    .args(extra)
    .env_remove("K3_NO_WEIGHT_CACHE");
    for (k, v) in env {
        c.env(k, v);
    }
    let o = c.output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(o.status.success(), "{err}");
    (String::from_utf8_lossy(&o.stdout).into_owned(), err)
}

#[test]
fn the_run_command_builds_then_hits_the_cache_next_to_the_snapshot() {
    let snap = support::copy_dir(&support::tiny(0));
    let (off, e) = k3_run(snap.path(), &["--no-weight-cache"], &[]);
    assert!(e.contains("weight cache: off"), "{e}");
    assert!(!snap.path().join(cache_file()).exists());
    let (_, e) = k3_run(snap.path(), &[], &[("K3_NO_WEIGHT_CACHE", "1")]);
    assert!(e.contains("weight cache: off"), "{e}");
    let (built, e) = k3_run(snap.path(), &[], &[]);
    assert!(e.contains("weight cache: built ("), "{e}");
    assert!(snap.path().join(cache_file()).is_file());
    let (hit, e) = k3_run(snap.path(), &[], &[]);
    assert!(e.contains("weight cache: hit ("), "{e}");
    assert_eq!(built, off);
    assert_eq!(hit, off);
}

#[test]
fn a_model_dropped_while_its_cache_is_written_leaves_the_whole_file() {
    let snap = support::copy_dir(&support::tiny(0));
    let cache = tempfile::tempdir().unwrap();
    let policy = FormatPolicy::default();
    let setting = WeightCacheSetting::Dirs(vec![cache.path().into()]);
    let ck = Checkpoint::open(snap.path(), &[]).unwrap();
    let m = K3Model::load_with(ck, CpuBackend::new(), policy, &opts(setting)).unwrap();
    let words = m.startup().cache.clone();
    assert!(words.starts_with("writing "), "{words}");
    // Dropped at once, the write perhaps still under way: the drop waits for it.
    drop(m);
    let s = state(snap.path(), policy, cache.path());
    assert!(s.starts_with("hit ("), "{s}");
    let left: Vec<_> = std::fs::read_dir(cache.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(left, vec![cache_file()]);
}

#[test]
fn the_run_reports_its_start_up_and_the_cache_write_apart() {
    let snap = support::copy_dir(&support::tiny(0));
    let out = tempfile::tempdir().unwrap();
    let json = out.path().join("stats.json");
    let args = ["--stats-json", json.to_str().unwrap()];
    let startup = |e: &str| -> serde_json::Value {
        assert!(e.contains("[K3] start-up: ready in "), "{e}");
        let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
        v["startup"].clone()
    };
    let (_, e) = k3_run(snap.path(), &args, &[]);
    let s = startup(&e);
    assert!(e.contains("weight cache: built ("), "{e}");
    let (ready, dense) = (
        s["ready_s"].as_f64().unwrap(),
        s["dense_load_s"].as_f64().unwrap(),
    );
    assert!(ready > 0.0 && dense > 0.0 && dense <= ready, "{s}");
    assert!(
        s["weight_cache"].as_str().unwrap().starts_with("writing "),
        "{s}"
    );
    let w = &s["weight_cache_write"];
    assert_eq!(w["built"], true, "{s}");
    let len = std::fs::metadata(snap.path().join(cache_file()))
        .unwrap()
        .len();
    assert_eq!(w["bytes"].as_u64(), Some(len), "{s}");
    let (write, after, waited) = (
        w["write_s"].as_f64().unwrap(),
        w["after_ready_s"].as_f64().unwrap(),
        w["waited_s"].as_f64().unwrap(),
    );
    assert!(
        write > 0.0 && (0.0..=write).contains(&after) && waited >= 0.0,
        "{s}"
    );
    // The warm start reads it and writes nothing.
    let (_, e) = k3_run(snap.path(), &args, &[]);
    let s = startup(&e);
    assert!(
        s["weight_cache"].as_str().unwrap().starts_with("hit ("),
        "{s}"
    );
    assert!(s["weight_cache_write"].is_null(), "{s}");
    // Without the cache there is nothing to write either.
    let (_, e) = k3_run(snap.path(), &["--no-weight-cache", args[0], args[1]], &[]);
    let s = startup(&e);
    assert_eq!(s["weight_cache"], "off", "{s}");
    assert!(s["weight_cache_write"].is_null(), "{s}");
}
