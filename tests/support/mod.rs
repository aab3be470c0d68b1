//! Shared test helpers: synthetic checkpoints made once per test binary, hand-built tiny
//! snapshots ([`tiny_ckpt`]), and the relative L2 distance every numeric check uses.

#![allow(dead_code)]

use k3::backend::cpu::CpuBackend;
use k3::backend::gpu::{GpuBackend, GpuOptions};
use k3::backend::Backend;
use k3::checkpoint::Checkpoint;
use k3::experts::{IoMode, StreamConfig};
use k3::model::{FormatPolicy, K3Model, Logits, Runner, RuntimeSettings, Segment, State};
use k3::synth::{synthesize, Preset, Routing, SynthOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

pub(crate) mod batch_scenario;
pub(crate) mod read_faults;
pub(crate) mod tiny_ckpt;

/// Relative L2 distance of `got` from `want`, in f64 (the absolute distance when `want` is
/// all zeros).
pub(crate) fn rel_l2<A: Copy + Into<f64>, B: Copy + Into<f64>>(got: &[A], want: &[B]) -> f64 {
    assert_eq!(got.len(), want.len(), "lengths differ");
    let (mut num, mut den) = (0f64, 0f64);
    for (&g, &w) in got.iter().zip(want) {
        let (g, w): (f64, f64) = (g.into(), w.into());
        num += (g - w).powi(2);
        den += w.powi(2);
    }
    if den == 0.0 {
        num.sqrt()
    } else {
        (num / den).sqrt()
    }
}

/// A `tiny` checkpoint with `seed`, synthesized once per test binary under target's tmp
/// (`CARGO_TARGET_TMPDIR`).
pub(crate) fn tiny(seed: u64) -> PathBuf {
    static DIRS: OnceLock<std::sync::Mutex<std::collections::HashMap<u64, PathBuf>>> =
        OnceLock::new();
    let map = DIRS.get_or_init(Default::default);
    let mut map = map.lock().unwrap();
    map.entry(seed)
        .or_insert_with(|| {
            // Kept for the whole test binary (tests share it), so it is never deleted: it
            // goes under cargo's target tmp, not the system's.
            let dir = tempfile::Builder::new()
                .prefix("k3-tiny-")
                .tempdir_in(env!("CARGO_TARGET_TMPDIR"))
                .unwrap()
                .keep();
            let opts = SynthOptions {
                preset: Preset::Tiny,
                layers: None,
                experts: None,
                top_k: None,
                routing: Routing::Random,
                seed,
                progress: false,
            };
            synthesize(&opts, &dir).unwrap();
            dir
        })
        .clone()
}

/// Streaming with no concurrency: buffered reads, no pipe, one loader thread, no host slots
/// beyond the default, so counters and read order are the same on every run.
pub(crate) fn serial_stream() -> StreamConfig {
    StreamConfig {
        mode: IoMode::Buffered,
        pipe: false,
        load_threads: 1,
        slots_per_layer: 0,
    }
}

/// Loads a CPU model from `dir` with `policy` and streaming settings `sc`.
pub(crate) fn cpu_model(dir: &Path, policy: FormatPolicy, sc: StreamConfig) -> Runner<CpuBackend> {
    cpu_model_with(dir, policy, stream_settings(sc))
}

/// Runtime settings that read experts as `sc` says and leave the rest at the default.
pub(crate) fn stream_settings(sc: StreamConfig) -> RuntimeSettings {
    RuntimeSettings {
        stream: sc,
        ..RuntimeSettings::default()
    }
}

/// Loads a CPU model from `dir` with `policy` and the runtime of `settings`.
pub(crate) fn cpu_model_with(
    dir: &Path,
    policy: FormatPolicy,
    settings: RuntimeSettings,
) -> Runner<CpuBackend> {
    let ck = Checkpoint::open(dir, &[]).unwrap();
    let m = K3Model::load(ck, CpuBackend::new(), policy, false).unwrap();
    Runner::new(m, settings).unwrap()
}

/// Whether this is CI's run (`CI=true`), which installs what every test needs.
pub(crate) fn in_ci() -> bool {
    std::env::var("CI").as_deref() == Ok("true")
}

/// Says that `group` of this test binary cannot run here, why, and what installs what it
/// needs: one line per binary and group, however many of its tests skip. Under CI=true it
/// fails the calling test instead.
///
/// libtest keeps what a test prints through `print!` / `eprint!` and shows it only when the
/// test fails; a write to the stderr handle itself is not captured (rust-lang/rust#90785),
/// so the line shows in a plain `cargo test` (README.md, "Run the tests").
pub(crate) fn skip_group(group: &str, why: &str, install: &str) {
    assert!(!in_ci(), "CI=true but {group} cannot run: {why}");
    say_skipped(group, why, install);
}

/// Says that `group` of this test binary is compiled out on this operating system, why, and
/// on which ones it runs (`elsewhere`), in [`skip_group`]'s line. No install brings what it
/// needs, so CI=true does not fail it: the Windows run under Wine
/// (`tools/windows_under_wine.sh`) shows these lines.
pub(crate) fn skip_on_this_os(group: &str, why: &str, elsewhere: &str) {
    say_skipped(group, why, elsewhere);
}

/// Writes the skip line of `group` once per test binary.
fn say_skipped(group: &str, why: &str, install: &str) {
    static SAID: Mutex<Vec<String>> = Mutex::new(Vec::new());
    let mut said = SAID.lock().unwrap_or_else(|e| e.into_inner());
    if said.iter().any(|g| g == group) {
        return;
    }
    said.push(group.to_string());
    // The first line of the cause: a driver's error can run to many.
    let why = why.lines().next().unwrap_or_default();
    let _ = writeln!(
        std::io::stderr().lock(),
        "SKIPPED {}: {group}: {why}; to run them: {install}",
        env!("CARGO_CRATE_NAME")
    );
}

/// [`skip_group`] for the tests that need a GPU adapter, after `GpuBackend::new` failed with `e`.
pub(crate) fn skip_gpu_tests(e: &anyhow::Error) {
    skip_group(
        "the GPU tests",
        &format!("no usable GPU adapter ({e:#})"),
        "apt-get install mesa-vulkan-drivers (a software Vulkan driver; macOS has Metal, Windows DX12)",
    );
}

/// A GPU backend with `opts` on any adapter (lavapipe included), or None (the test skips,
/// [`skip_gpu_tests`]) without one; under CI=true a missing adapter fails the test instead.
pub(crate) fn gpu_backend(opts: GpuOptions) -> Option<GpuBackend> {
    let opts = GpuOptions {
        allow_cpu_adapter: true,
        ..opts
    };
    match GpuBackend::new(&opts) {
        Ok(g) => Some(g),
        Err(e) => {
            skip_gpu_tests(&e);
            None
        }
    }
}

/// The model at `dir` on the GPU with `opts` plus reused buffers poisoned with NaN (a kernel
/// that leaves part of its output unwritten shows in the comparison), streaming `sc`; None
/// as [`gpu_backend`].
pub(crate) fn gpu_model(
    dir: &Path,
    opts: GpuOptions,
    sc: StreamConfig,
) -> Option<Runner<GpuBackend>> {
    gpu_model_with(dir, opts, stream_settings(sc))
}

/// [`gpu_model`] with the runtime of `settings`.
pub(crate) fn gpu_model_with(
    dir: &Path,
    opts: GpuOptions,
    settings: RuntimeSettings,
) -> Option<Runner<GpuBackend>> {
    let g = gpu_backend(GpuOptions {
        poison_reused: true,
        ..opts
    })?;
    let ck = Checkpoint::open(dir, &[]).unwrap();
    let m = K3Model::load(ck, g, FormatPolicy::default(), false).unwrap();
    Some(Runner::new(m, settings).unwrap())
}

/// Sizes `m`'s VRAM expert tier (or unified pool) to `slots` experts, as the engine does from
/// its budgets, and checks it got them (at most every expert).
pub(crate) fn size_expert_tier(m: &K3Model<GpuBackend>, slots: usize) {
    let cfg = &m.ckpt.config;
    let all = cfg.num_experts * cfg.moe_layer_count();
    let got = k3::engine::tiers::size_expert_tier(m, (slots * cfg.expert_bytes()) as u64).unwrap();
    assert_eq!(got, Some(slots.min(all)));
}

/// A copy of the tiny model with every value of the stored tensor whose name ends with
/// `suffix` set to bf16 NaN.
pub(crate) fn with_nan_tensor(suffix: &str) -> tempfile::TempDir {
    let (copy, hits) = with_edited_tensors(|k, v, data| {
        if !k.ends_with(suffix) {
            return false;
        }
        assert_eq!(v["dtype"], "BF16", "{k}");
        for pair in data.chunks_exact_mut(2) {
            pair.copy_from_slice(&0x7FC0u16.to_le_bytes());
        }
        true
    });
    assert!(hits > 0, "no tensor ends with {suffix}");
    copy
}

/// A copy of the tiny model whose stored tensors `edit` may change in place: it is called
/// with each tensor's name, header entry and bytes, and says whether it changed them.
/// Returns the copy and the number of tensors changed.
pub(crate) fn with_edited_tensors(
    mut edit: impl FnMut(&str, &serde_json::Value, &mut [u8]) -> bool,
) -> (tempfile::TempDir, usize) {
    let copy = copy_dir(&tiny(0));
    let mut hits = 0;
    for e in std::fs::read_dir(copy.path()).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_none_or(|x| x != "safetensors") {
            continue;
        }
        let mut bytes = std::fs::read(&p).unwrap();
        let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
        for (k, v) in header.as_object().unwrap() {
            let o = &v["data_offsets"];
            let (Some(a), Some(b)) = (o[0].as_u64(), o[1].as_u64()) else {
                continue; // __metadata__
            };
            if edit(k, v, &mut bytes[8 + n + a as usize..8 + n + b as usize]) {
                hits += 1;
            }
        }
        std::fs::write(&p, bytes).unwrap();
    }
    (copy, hits)
}

/// Runs `k3 chat` on the tiny model (6-token answers, no think channel, quiet) with `extra`
/// flags and `input` on standard input.
pub(crate) fn chat(extra: &[&str], input: &[u8]) -> std::process::Output {
    use std::io::Write;
    use std::process::{Command, Stdio};
    let dir = tiny(0);
    let mut child = Command::new(env!("CARGO_BIN_EXE_k3"))
        .args([
            "chat",
            dir.to_str().unwrap(),
            "--max-answer",
            "6",
            "--think",
            "0",
            "--quiet",
        ])
        .args(extra)
        .env("RAYON_NUM_THREADS", "2")
        .env_remove("K3_EXPERT_GB")
        .env_remove("K3_THINK")
        .env_remove("K3_MAXT")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(input).unwrap();
    child.wait_with_output().unwrap()
}

/// Copies a checkpoint directory (so a test may damage its copy).
pub(crate) fn copy_dir(src: &Path) -> tempfile::TempDir {
    let dst = tempfile::Builder::new()
        .prefix("k3-copy-")
        .tempdir()
        .unwrap();
    for e in std::fs::read_dir(src).unwrap() {
        let p = e.unwrap().path();
        // The checkpoint's files only: another test of the same binary may have left a
        // weight cache (or its temporary) beside a shared model, which a copy must not carry.
        let name = p.file_name().unwrap().to_string_lossy().into_owned();
        if !p.is_file() || name.ends_with(".cache") || name.ends_with(".partial") {
            continue;
        }
        std::fs::copy(&p, dst.path().join(&name)).unwrap();
    }
    dst
}

/// A small object schema (a string, an integer range, an enum, a boolean; all required, no
/// others) that constrained-output tests validate against.
pub(crate) fn cat_schema() -> serde_json::Value {
    serde_json::json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 30},
            "color": {"enum": ["black", "white", "tabby"]},
            "indoor": {"type": "boolean"}
        },
        "required": ["name", "age", "color", "indoor"],
        "additionalProperties": false
    })
}

/// Asserts that `v` validates against the JSON schema `schema`, listing every error.
pub(crate) fn assert_valid(schema: &serde_json::Value, v: &serde_json::Value) {
    let validator = jsonschema::validator_for(schema).unwrap();
    let errors: Vec<String> = validator.iter_errors(v).map(|e| e.to_string()).collect();
    assert!(errors.is_empty(), "{v} does not validate: {errors:?}");
}

/// Why this OS cannot do what a re-download or a cleanup does to a shard that k3 holds
/// open, or `None` where it can: rename a new file over it, and delete it so that its name
/// is gone at once. Linux, macOS and Windows 10 and later (POSIX rename and delete
/// semantics, which Rust's standard library asks for) do both; Wine 8 refuses the rename and
/// keeps a deleted file's name until its last handle closes, whatever the handle's share
/// mode. The probe holds its file open as the standard library's `File::open` does, as k3's
/// shard handles are.
pub(crate) fn open_file_replace_refused() -> Option<String> {
    let dir = tempfile::tempdir().ok()?;
    let (held, new) = (dir.path().join("held"), dir.path().join("new"));
    std::fs::write(&held, b"old").ok()?;
    std::fs::write(&new, b"new").ok()?;
    let handle = std::fs::File::open(&held).ok()?;
    let mut refused = Vec::new();
    if let Err(e) = std::fs::rename(&new, &held) {
        refused.push(format!(
            "refuses to rename a file over one that is open ({e})"
        ));
    }
    match std::fs::remove_file(&held) {
        Err(e) => refused.push(format!("refuses to delete a file that is open ({e})")),
        Ok(()) if held.exists() => {
            refused.push("keeps a deleted file's name until its last handle closes".to_string())
        }
        Ok(()) => {}
    }
    drop(handle);
    (!refused.is_empty()).then(|| format!("this OS {}", refused.join(" and ")))
}

/// Runs `test` unless [`open_file_replace_refused`] says this OS cannot; then it writes the
/// skip line of `group`, the tests that replace or delete shards k3 holds open.
pub(crate) fn where_open_files_can_be_replaced(group: &str, test: impl FnOnce()) {
    match open_file_replace_refused() {
        None => test(),
        Some(why) => skip_on_this_os(
            group,
            &why,
            "Linux, macOS or Windows 10 and later (not Wine)",
        ),
    }
}

/// Gives `m` a fresh runtime built from `settings` (a test compares settings on one loaded
/// model; the old runtime and its caches go).
pub(crate) fn new_runtime<B: k3::backend::Backend>(m: &mut Runner<B>, settings: RuntimeSettings) {
    m.rt = k3::model::Runtime::new(&m.ckpt.config, &m.backend, settings).unwrap();
}

/// One segment a state: `states[i]` on `ids[i]`, each wanting its last row's logits (a
/// decode step of several sequences, or their prompts' slices).
pub(crate) fn last_row_segments<'a, B: Backend, I: AsRef<[u32]>>(
    states: &'a mut [State<B>],
    ids: &'a [I],
) -> Vec<Segment<'a, B>> {
    states
        .iter_mut()
        .zip(ids)
        .map(|(state, ids)| Segment {
            state,
            ids: ids.as_ref(),
            want: Logits::Last,
        })
        .collect()
}
