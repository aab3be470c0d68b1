//! A full disk while k3 writes: the real binary runs under a file-size limit
//! (`RLIMIT_FSIZE`, with SIGXFSZ ignored so a write past it fails with EFBIG, as a full
//! disk fails with ENOSPC). Each write that fails names the file and the byte offset, and
//! leaves nothing under the real name that loads as valid afterwards.
#![cfg(target_os = "linux")]

use crate::support;

use k3::checkpoint::Checkpoint;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Output};

/// Runs `k3 ARGS` with every file it writes limited to `limit` bytes.
fn k3_limited(limit: u64, args: &[&str]) -> Output {
    k3_limited_with(limit, args, libc::SIG_IGN)
}

/// [`k3_limited`] with SIGXFSZ at `disposition` when k3 starts: `SIG_DFL` is what a user's
/// shell under `ulimit -f` gives, which k3 must turn into an error itself.
fn k3_limited_with(limit: u64, args: &[&str], disposition: libc::sighandler_t) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_k3"));
    cmd.args(args)
        .env("RAYON_NUM_THREADS", "2")
        .env_remove("K3_EXPERT_GB")
        .env_remove("K3_TRACE")
        .env_remove("K3_MAXT");
    // SAFETY: between fork and exec the closure calls only async-signal-safe functions
    // (signal, setrlimit) and touches no memory the parent's other threads could hold locked.
    unsafe {
        cmd.pre_exec(move || {
            libc::signal(libc::SIGXFSZ, disposition);
            let lim = libc::rlimit {
                rlim_cur: limit,
                rlim_max: limit,
            };
            if libc::setrlimit(libc::RLIMIT_FSIZE, &lim) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    cmd.output().unwrap()
}

/// The file names in `dir`, sorted.
fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

/// Asserts the run failed with a write error naming `file` and a byte offset.
fn assert_write_error(out: &Output, file: &str) -> String {
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "the run succeeded: {err}");
    assert!(err.contains(file), "the error does not name {file}: {err}");
    assert!(err.contains("at byte"), "no byte offset: {err}");
    assert!(err.contains("disk full?"), "{err}");
    err
}

#[test]
fn synth_on_a_full_disk_names_the_shard_and_leaves_no_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("m");
    // The tiny preset's second shard is 274,244 bytes, its first 261,436.
    let run = k3_limited(
        270_000,
        &["synth", "--preset", "tiny", out.to_str().unwrap()],
    );
    assert_write_error(&run, "model-00002-of-00006.safetensors");
    let files = names(&out);
    assert!(files.iter().all(|f| !f.ends_with(".partial")), "{files:?}");
    assert!(
        !files
            .iter()
            .any(|f| f == "model-00002-of-00006.safetensors"),
        "a cut shard under its real name: {files:?}"
    );
    assert!(Checkpoint::open(&out, &[]).is_err(), "{files:?} opened");
}

#[test]
fn synth_force_on_a_full_disk_never_leaves_old_and_new_shards_under_one_index() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("m");
    let ok = k3_limited(
        u64::MAX,
        &["synth", "--preset", "tiny", out.to_str().unwrap()],
    );
    assert!(
        ok.status.success(),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );
    Checkpoint::open(&out, &[]).unwrap();
    // Seed 1 over seed 0: shard 1 is replaced, shard 2 fails; the old index would list
    // the new shard 1 beside the old rest, and load.
    let run = k3_limited(
        270_000,
        &[
            "synth",
            "--preset",
            "tiny",
            "--seed",
            "1",
            "--force",
            out.to_str().unwrap(),
        ],
    );
    assert_write_error(&run, "model-00002-of-00006.safetensors");
    assert!(
        Checkpoint::open(&out, &[]).is_err(),
        "a mix of two seeds opened: {:?}",
        names(&out)
    );
}

#[test]
fn run_dumps_on_a_full_disk_name_the_file_and_are_not_left_behind() {
    let model = support::tiny(0);
    let model = model.to_str().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let ids = ["--ids", "768,5,300,17,999,42", "--ngen", "3", "--quiet"];

    let logits = tmp.path().join("logits.f32");
    let mut args = vec!["run", model, "--dump-logits", logits.to_str().unwrap()];
    args.extend(ids);
    let run = k3_limited(4096, &args);
    assert_write_error(&run, "logits.f32");
    assert!(!logits.exists(), "a cut logits dump");

    let stats = tmp.path().join("stats.json");
    let mut args = vec!["run", model, "--stats-json", stats.to_str().unwrap()];
    args.extend(ids);
    let run = k3_limited(64, &args);
    assert_write_error(&run, "stats.json");
    assert!(!stats.exists(), "a cut stats file");

    let trace = tmp.path().join("trace");
    let mut args = vec!["run", model, "--trace", trace.to_str().unwrap()];
    args.extend(ids);
    let run = k3_limited(1000, &args);
    assert_write_error(&run, "layer_000.f32");
    let left = names(&trace);
    assert!(
        left.is_empty(),
        "a trace that stops short was left: {left:?}"
    );

    // The same runs without the limit write every file.
    let mut args = vec!["run", model, "--dump-logits", logits.to_str().unwrap()];
    args.extend(["--stats-json", stats.to_str().unwrap()]);
    args.extend(["--trace", trace.to_str().unwrap()]);
    args.extend(ids);
    let run = k3_limited(u64::MAX, &args);
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    assert!(std::fs::metadata(&logits).unwrap().len() > 4096);
    serde_json::from_slice::<serde_json::Value>(&std::fs::read(&stats).unwrap()).unwrap();
    assert!(names(&trace)
        .iter()
        .all(|f| f.starts_with("layer_") && f.ends_with(".f32")));
    assert!(!names(&trace).is_empty());
}

#[test]
fn under_ulimit_f_with_the_default_signal_writes_fail_with_an_error_not_a_signal() {
    use std::os::unix::process::ExitStatusExt;
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("m");
    let run = k3_limited_with(
        270_000,
        &["synth", "--preset", "tiny", out.to_str().unwrap()],
        libc::SIG_DFL,
    );
    assert_eq!(run.status.signal(), None, "synth died of a signal");
    assert_write_error(&run, "model-00002-of-00006.safetensors");
    let files = names(&out);
    assert!(files.iter().all(|f| !f.ends_with(".partial")), "{files:?}");

    let model = support::tiny(0);
    let logits = tmp.path().join("logits.f32");
    let run = k3_limited_with(
        4096,
        &[
            "run",
            model.to_str().unwrap(),
            "--dump-logits",
            logits.to_str().unwrap(),
            "--ids",
            "768,5,300,17,999,42",
            "--ngen",
            "1",
            "--quiet",
        ],
        libc::SIG_DFL,
    );
    assert_eq!(
        run.status.signal(),
        None,
        "run --dump-logits died of a signal"
    );
    assert_write_error(&run, "logits.f32");
    assert!(names(tmp.path()).iter().all(|f| !f.ends_with(".partial")));
    assert!(!logits.exists(), "a cut logits dump");
}

#[test]
fn a_route_trace_on_a_full_disk_names_the_file_and_is_not_left_behind() {
    let model = support::tiny(0);
    let tmp = tempfile::tempdir().unwrap();
    let routes = tmp.path().join("routes.jsonl");
    let args = [
        "run",
        model.to_str().unwrap(),
        "--route-trace",
        routes.to_str().unwrap(),
        "--ids",
        "768,5,300,17,999,42",
        "--ngen",
        "3",
        "--quiet",
    ];
    let run = k3_limited(u64::MAX, &args);
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let whole = std::fs::metadata(&routes).unwrap().len();
    std::fs::remove_file(&routes).unwrap();
    let run = k3_limited(whole / 2, &args);
    assert_write_error(&run, "routes.jsonl");
    assert!(!routes.exists(), "a cut route trace");
    assert!(names(tmp.path()).is_empty(), "{:?}", names(tmp.path()));
}

/// Runs `args` without a limit, then with half the size of the file `written` it wrote:
/// the limited run still succeeds (these files are a cache and a history, never the job's
/// result) with a warning naming the file, and leaves neither it nor its partial behind.
fn optional_file_on_a_full_disk(args: &[&str], written: &Path, warning: &str) {
    let run = k3_limited(u64::MAX, args);
    let err = String::from_utf8_lossy(&run.stderr).into_owned();
    assert!(run.status.success(), "{err}");
    let whole = std::fs::metadata(written)
        .unwrap_or_else(|e| panic!("{} not written: {e}\n{err}", written.display()))
        .len();
    std::fs::remove_file(written).unwrap();
    let limited = k3_limited(whole / 2, args);
    let err = String::from_utf8_lossy(&limited.stderr).into_owned();
    assert!(
        limited.status.success(),
        "a full disk failed the run: {err}"
    );
    assert_eq!(limited.stdout, run.stdout, "the job's output changed");
    assert!(err.contains(warning), "no '{warning}' warning: {err}");
    let name = written.file_name().unwrap().to_string_lossy().into_owned();
    assert!(err.contains(&name) && err.contains("at byte"), "{err}");
    assert!(!written.exists(), "a cut {name} was left");
    let dir = written.parent().unwrap();
    assert!(
        names(dir).iter().all(|f| !f.ends_with(".partial")),
        "{:?}",
        names(dir)
    );
}

#[test]
fn a_weight_cache_on_a_full_disk_is_a_warning_and_is_not_left_behind() {
    let copy = support::copy_dir(&support::tiny(0));
    let model = copy.path().to_str().unwrap();
    let args = [
        "run",
        model,
        "--ids",
        "768,5,300,17,999,42",
        "--ngen",
        "3",
        "--quiet",
    ];
    let name = k3::model::weight_cache::file_name(&k3::model::FormatPolicy::default());
    optional_file_on_a_full_disk(&args, &copy.path().join(name), "weight cache");
    // The next start finds no cut file to trust: it builds the cache again.
    let run = k3_limited(u64::MAX, &args);
    let err = String::from_utf8_lossy(&run.stderr);
    assert!(
        run.status.success() && err.contains("weight cache: built"),
        "{err}"
    );
}

#[test]
fn a_usage_history_on_a_full_disk_is_a_warning_and_is_not_left_behind() {
    let model = support::tiny(0);
    let tmp = tempfile::tempdir().unwrap();
    let usage = tmp.path().join("usage.bin");
    let args = [
        "run",
        model.to_str().unwrap(),
        "--no-weight-cache",
        "--usage-pins",
        "on",
        "--usage-file",
        usage.to_str().unwrap(),
        "--ids",
        "768,5,300,17,999,42",
        "--ngen",
        "3",
        "--quiet",
    ];
    optional_file_on_a_full_disk(&args, &usage, "usage history not saved");
}

#[test]
fn a_prompt_cache_on_a_full_disk_is_a_warning_and_is_not_left_behind() {
    let model = support::tiny(0);
    let tmp = tempfile::tempdir().unwrap();
    let ids: Vec<String> = (0..300u32)
        .map(|i| ((i * 37 + 5) % 1000).to_string())
        .collect();
    let ids = ids.join(",");
    let args = [
        "run",
        model.to_str().unwrap(),
        "--no-weight-cache",
        "--prompt-cache",
        tmp.path().to_str().unwrap(),
        "--ids",
        &ids,
        "--ngen",
        "3",
        "--quiet",
    ];
    let run = k3_limited(u64::MAX, &args);
    let err = String::from_utf8_lossy(&run.stderr).into_owned();
    assert!(run.status.success(), "{err}");
    let entries = names(tmp.path());
    assert_eq!(entries.len(), 1, "{entries:?}");
    let entry = tmp.path().join(&entries[0]);
    let whole = std::fs::metadata(&entry).unwrap().len();
    std::fs::remove_file(&entry).unwrap();
    let limited = k3_limited(whole / 2, &args);
    let err = String::from_utf8_lossy(&limited.stderr).into_owned();
    assert!(
        limited.status.success(),
        "a full disk failed the run: {err}"
    );
    assert_eq!(limited.stdout, run.stdout, "the job's output changed");
    assert!(
        err.contains("[K3] prompt cache: not stored")
            && err.contains(&entries[0])
            && err.contains("at byte")
            && err.contains("the run goes on"),
        "{err}"
    );
    assert!(names(tmp.path()).is_empty(), "{:?}", names(tmp.path()));
    // An unwritable directory is a warning too: a file stands where the directory would be.
    let file = tmp.path().join("not-a-dir");
    std::fs::write(&file, b"x").unwrap();
    let mut args = args.to_vec();
    args[4] = file.to_str().unwrap();
    let run2 = k3_limited(u64::MAX, &args);
    let err = String::from_utf8_lossy(&run2.stderr).into_owned();
    assert!(run2.status.success(), "{err}");
    assert_eq!(run2.stdout, run.stdout);
    assert!(
        err.contains("[K3] prompt cache: off (creating the prompt cache directory"),
        "{err}"
    );
}
