//! The `k3` binary as a user meets it: commands, stats lines, exit codes, error messages.

use crate::support;

use std::process::{Command, Output};

fn k3(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_k3"))
        .args(args)
        .env("RAYON_NUM_THREADS", "2")
        .env_remove("K3_EXPERT_GB")
        .output()
        .expect("running k3")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// A build without the `lab` feature leaves the lab's tests out (their modules'
/// `#[cfg(feature = "lab")]`, and the cases that set `K3_LAB_*` on the binary); the run says so.
#[cfg(not(feature = "lab"))]
#[test]
fn a_build_without_the_lab_feature_says_it_leaves_the_lab_tests_out() {
    support::skip_group(
        "the lab tests (io::cache_policy, model::route_trace; the K3_LAB_* cases of cli, gpu_model, expert_tiers, unified_pool)",
        "built without the lab feature",
        "cargo test --release --features lab",
    );
}

#[test]
fn run_prints_ids_and_the_stats_lines_users_parse() {
    let dir = support::tiny(0);
    // Its handle closed: k3 renames its output over the file, which Wine (and Windows
    // before 10) refuse while another handle holds it open.
    let logits = tempfile::NamedTempFile::new().unwrap().into_temp_path();
    let o = k3(&[
        "run",
        dir.to_str().unwrap(),
        "--ids",
        "768,5,6,7",
        "--ngen",
        "5",
        "--ignore-eos",
        "--quiet",
        "--dump-logits",
        logits.to_str().unwrap(),
    ]);
    let err = stderr(&o);
    assert!(o.status.success(), "{err}");
    let out = String::from_utf8_lossy(&o.stdout);
    let ids: Vec<u32> = out.trim().split(',').map(|t| t.parse().unwrap()).collect();
    assert_eq!(ids.len(), 5);
    assert!(ids.iter().all(|&i| i < 1024));
    let line = |prefix: &str| {
        err.lines()
            .find(|l| l.starts_with(prefix))
            .unwrap_or_else(|| panic!("no {prefix} in {err}"))
    };
    assert_eq!(
        line("[K3] prompt:"),
        "[K3] prompt: 4 tokens | ngen 5 | temp 0.00"
    );
    assert!(line("[K3] prefill done in ").ends_with(" tok/s)"));
    assert!(line("[K3] decode 5 tokens in ").contains("| expert hit "));
    assert!(line("[K3] time: attn ").contains(" | RSS "));
    assert!(line("[K3][RAM_GB=").contains("GB for experts; cache "));
    assert!(line("[K3] disk: ").ends_with(" GB/s)"));
    assert_eq!(
        std::fs::metadata(&logits).unwrap().len(),
        4 * 1024 * 4,
        "[positions x vocab] f32"
    );
}

/// `--chunk` bounds the windows `k3 run` prefills in (through the engine's prefill
/// window): a window of one token looks each token's experts up on their own, more lookups
/// than one window over the whole prompt.
#[test]
fn chunk_bounds_the_windows_run_prefills_in() {
    let dir = support::tiny(0);
    let ids: Vec<String> = (0..32).map(|i| (768 + i).to_string()).collect();
    let ids = ids.join(",");
    let lookups = |extra: &[&str]| {
        // Its handle closed, as `logits` in run_prints_ids_and_the_stats_lines_users_parse.
        let stats = tempfile::NamedTempFile::new().unwrap().into_temp_path();
        let mut args = vec![
            "run",
            dir.to_str().unwrap(),
            "--ids",
            &ids,
            "--ngen",
            "1",
            "--quiet",
            "--stats-json",
            stats.to_str().unwrap(),
        ];
        args.extend_from_slice(extra);
        let o = k3(&args);
        assert!(o.status.success(), "{}", stderr(&o));
        let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&stats).unwrap()).unwrap();
        (v["prefill"]["expert_lookups"].as_u64().unwrap(), stderr(&o))
    };
    let (whole, _) = lookups(&[]);
    let (one, err) = lookups(&["--chunk", "1"]);
    assert!(
        err.contains("[K3] prefill window: 1 tokens a pass"),
        "{err}"
    );
    assert!(
        one > whole,
        "--chunk 1: {one} lookups, whole prompt: {whole}"
    );
}

#[test]
fn bad_inputs_exit_nonzero_with_a_message_that_names_the_cause() {
    let dir = support::tiny(0);
    let d = dir.to_str().unwrap();
    let o = k3(&["run", d, "--ids", "1,2000", "--ngen", "1", "--quiet"]);
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("token id 2000 is out of range"),
        "{}",
        stderr(&o)
    );
    let o = k3(&["run", d, "--ids", "1,x", "--quiet"]);
    assert!(
        !o.status.success() && stderr(&o).contains("\"x\" is not a token id"),
        "{}",
        stderr(&o)
    );
    let o = k3(&["run", d, "--ids", "1", "--quiet", "--chunk", "0"]);
    assert!(
        !o.status.success() && stderr(&o).contains("K3_CHUNK"),
        "{}",
        stderr(&o)
    );
    let o = k3(&["run", d, "--ids", "1", "--quiet", "--bits", "5"]);
    assert!(
        !o.status.success() && stderr(&o).contains("K3_BITS"),
        "{}",
        stderr(&o)
    );
    for p in ["2", "-0.5", "NaN"] {
        let flag = format!("--expert-top-p={p}");
        let o = k3(&["run", d, "--ids", "1", "--quiet", &flag]);
        assert!(
            !o.status.success() && stderr(&o).contains("--expert-top-p"),
            "--expert-top-p {p}: {}",
            stderr(&o)
        );
    }
    let o = k3(&["run", d, "--ids", "1", "--quiet", "--gpu-profile", "2"]);
    assert!(
        !o.status.success() && stderr(&o).contains("--gpu-profile"),
        "{}",
        stderr(&o)
    );
    // An experiment switch's bad value names its variable (a lab build's binary reads them).
    if cfg!(feature = "lab") {
        let o = Command::new(env!("CARGO_BIN_EXE_k3"))
            .args(["run", d, "--ids", "1", "--quiet"])
            .env("RAYON_NUM_THREADS", "2")
            .env("K3_LAB_CHUNK_FROM", "-1")
            .output()
            .expect("running k3");
        assert!(
            !o.status.success() && stderr(&o).contains("K3_LAB_CHUNK_FROM"),
            "{}",
            stderr(&o)
        );
    }
    let o = k3(&["run", "/nonexistent/k3-model", "--ids", "1"]);
    assert!(
        !o.status.success() && stderr(&o).contains("/nonexistent/k3-model"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn too_small_ram_budget_exits_2_unless_overcommitted() {
    let dir = support::tiny(0);
    let d = dir.to_str().unwrap();
    let o = k3(&[
        "run", d, "--ids", "1", "--ngen", "1", "--quiet", "--ram-gb", "1",
    ]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("K3_RAM_OVERCOMMIT=1"), "{}", stderr(&o));
    let o = k3(&[
        "run",
        d,
        "--ids",
        "1",
        "--ngen",
        "1",
        "--quiet",
        "--ram-gb",
        "1",
        "--ram-overcommit",
        "1",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
}

#[test]
fn inspect_passes_a_good_snapshot_and_lists_what_a_bad_one_lacks() {
    let dir = support::tiny(0);
    let o = k3(&["inspect", dir.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("    0  KDA  dense  bank"), "{out}");
    assert!(out.contains("    2  MLA  MoE    bank"), "{out}");
    // Rename one tensor inside its shard header (same length, so the header stays valid) and
    // in the index: the expected tensor is then missing, and inspect must say which.
    let copy = support::copy_dir(&dir);
    let bad = copy.path();
    let idx = bad.join("model.safetensors.index.json");
    let text = std::fs::read_to_string(&idx).unwrap();
    let name = "language_model.model.layers.3.post_attention_layernorm.weight";
    let renamed = "language_model.model.layers.3.post_attention_layernorX.weight";
    let json: serde_json::Value = serde_json::from_str(&text).unwrap();
    let shard = bad.join(json["weight_map"][name].as_str().unwrap());
    let bytes = std::fs::read(&shard).unwrap();
    let at = bytes
        .windows(name.len())
        .position(|w| w == name.as_bytes())
        .unwrap();
    let mut patched = bytes.clone();
    patched[at..at + name.len()].copy_from_slice(renamed.as_bytes());
    std::fs::write(&shard, patched).unwrap();
    std::fs::write(&idx, text.replace(name, renamed)).unwrap();
    let o = k3(&["inspect", bad.to_str().unwrap()]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(!o.status.success(), "{out}");
    assert!(
        out.contains("model.layers.3.post_attention_layernorm.weight")
            || stderr(&o).contains("layers.3.post_attention_layernorm"),
        "{out}{}",
        stderr(&o)
    );
}

#[test]
fn inspect_ranks_lists_each_ranks_shards_and_refuses_bad_counts() {
    let dir = support::tiny(0);
    let d = dir.to_str().unwrap();
    let o = k3(&["inspect", d, "--ranks", "2"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("rank 0 (head): "), "{out}");
    assert!(out.contains("rank 1: "), "{out}");
    assert!(out.contains("+ dense weights"), "{out}");
    assert!(!out.contains("rank 2"), "{out}");
    assert!(out.contains("a rank opens only the files listed"), "{out}");
    assert!(!out.contains("whole snapshot"), "{out}");
    // The worker's list names no file holding only dense weights.
    let worker = out.split("rank 1: ").nth(1).unwrap();
    let worker = worker.split("a rank opens").next().unwrap();
    assert!(!worker.contains("dense"), "{out}");
    assert!(worker.contains("with config.json"), "{out}");
    // The tiny model's 8 experts a layer: 4 and 4 equal, 2 and 6 at rates 1 and 3.
    let o = k3(&["inspect", d, "--ranks", "2", "--rank-read-gbps", "1,3"]);
    let out = String::from_utf8_lossy(&o.stdout);
    let experts = |rank: &str| -> usize {
        let line = out.lines().find(|l| l.starts_with(rank)).unwrap();
        line.split(": ")
            .nth(1)
            .unwrap()
            .split(' ')
            .next()
            .unwrap()
            .parse()
            .unwrap()
    };
    assert_eq!(3 * experts("rank 0"), experts("rank 1"), "{out}");
    let o = k3(&["inspect", d, "--ranks", "0"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("--ranks 0"), "{}", stderr(&o));
    let o = k3(&["inspect", d, "--ranks", "3", "--rank-read-gbps", "1,2"]);
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("2 rates for --ranks 3"),
        "{}",
        stderr(&o)
    );
    let o = k3(&["inspect", d, "--ranks", "2", "--rank-read-gbps", "1,x"]);
    assert!(stderr(&o).contains("`x` (rank 1)"), "{}", stderr(&o));
}

#[test]
fn text_prompt_chat_and_tokenize_round_trip() {
    let dir = support::tiny(0);
    let d = dir.to_str().unwrap();
    let o = k3(&["tokenize", d, "Hello, world"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let ids = String::from_utf8_lossy(&o.stdout).trim().to_string();
    let o = k3(&["detokenize", d, "--ids", &ids]);
    assert_eq!(
        String::from_utf8_lossy(&o.stdout).trim_end_matches('\n'),
        "Hello, world"
    );
    let o = k3(&["run", d, "--chat", "Hi", "--ngen", "4", "--quiet"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        out.starts_with("[think] "),
        "chat output starts in the think channel: {out:?}"
    );
}

#[test]
fn a_prompt_longer_than_the_context_is_refused_and_generation_stops_at_it() {
    let dir = support::tiny(0);
    let d = dir.to_str().unwrap();
    let o = k3(&[
        "run",
        d,
        "--ids",
        "5,6,7,8,9",
        "--max-tokens",
        "4",
        "--quiet",
    ]);
    assert!(!o.status.success());
    let err = stderr(&o);
    assert!(
        err.contains("context full") && err.contains("--max-tokens"),
        "{err}"
    );

    let o = k3(&[
        "run",
        d,
        "--ids",
        "5,6,7",
        "--ngen",
        "50",
        "--ignore-eos",
        "--max-tokens",
        "6",
        "--quiet",
    ]);
    let err = stderr(&o);
    assert!(o.status.success(), "{err}");
    let out = String::from_utf8_lossy(&o.stdout);
    assert_eq!(out.trim().split(',').count(), 4, "{out}");
    assert!(
        err.contains("[K3] context full: stopped after 4 tokens"),
        "{err}"
    );

    for bad in ["0", "99999999999"] {
        let o = k3(&["run", d, "--ids", "5", "--max-tokens", bad, "--quiet"]);
        assert!(!o.status.success());
        assert!(stderr(&o).contains("--max-tokens"), "{}", stderr(&o));
    }
}

#[test]
fn bench_prefill_reads_each_routed_expert_once_in_the_default_window() {
    let dir = support::tiny(0);
    let d = dir.to_str().unwrap();
    let o = k3(&[
        "bench",
        "prefill",
        d,
        "--tokens",
        "300",
        "--chunks",
        "8",
        "--backend",
        "cpu",
        "--expert-gb",
        "0",
        "--direct",
        "0",
    ]);
    let err = stderr(&o);
    assert!(o.status.success(), "{err}");
    assert!(err.contains("[K3] prefill window:"), "{err}");
    assert!(err.contains("[K3] prefill: 300/300 tokens"), "{err}");
    let out = String::from_utf8_lossy(&o.stdout);
    let ratio = |case: &str| -> f64 {
        let line = out
            .lines()
            .find(|l| l.starts_with(case))
            .unwrap_or_else(|| panic!("no {case} row in:\n{out}"));
        line.split('|').nth(8).unwrap().trim().parse().unwrap()
    };
    assert_eq!(ratio("| default"), 1.0, "{out}");
    assert!(ratio("| --chunk 8") > 1.0, "{out}");
    for (args, want) in [
        (&["--tokens", "0"][..], "--tokens must be at least 1"),
        (&["--chunks", "x"][..], "--chunks: \"x\" is not a number"),
        (&["--ids", "1,x"][..], "\"x\" is not a token id"),
    ] {
        let mut all = vec!["bench", "prefill", d, "--backend", "cpu"];
        all.extend_from_slice(args);
        let o = k3(&all);
        assert!(
            !o.status.success() && stderr(&o).contains(want),
            "{args:?}: {}",
            stderr(&o)
        );
    }
}

/// Makes a FIFO at `path` and reads it on a thread; [`release`] ends a read still waiting.
#[cfg(unix)]
fn fifo_reader(path: &std::path::Path) -> std::thread::JoinHandle<Vec<u8>> {
    let ok = Command::new("mkfifo").arg(path).status().unwrap().success();
    assert!(ok, "mkfifo {}", path.display());
    let p = path.to_path_buf();
    std::thread::spawn(move || std::fs::read(p).unwrap())
}

/// Opens and closes the FIFO at `path` for writing without waiting, so a reader that k3
/// never wrote to sees the end instead of hanging the test.
#[cfg(unix)]
fn release(path: &std::path::Path) {
    use std::os::unix::fs::OpenOptionsExt;
    let _ = std::fs::OpenOptions::new()
        .write(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path);
}

#[cfg(unix)]
#[test]
fn outputs_go_into_fifos_stdout_and_through_symlinks() {
    use std::os::unix::fs::FileTypeExt;
    let model = support::tiny(0);
    let tmp = tempfile::tempdir().unwrap();
    let fifo = tmp.path().join("stats.fifo");
    let reader = fifo_reader(&fifo);
    let real = tmp.path().join("logits.bin");
    std::fs::write(&real, b"old").unwrap();
    let link = tmp.path().join("logits-link");
    std::os::unix::fs::symlink(&real, &link).unwrap();
    // A symlink to a FIFO, as /dev/stdout is to a pipe (a real device here would be
    // replaced by a file if this ran against a writer that renames over it, as root).
    let routes = tmp.path().join("routes.fifo");
    let routes_reader = fifo_reader(&routes);
    let routes_link = tmp.path().join("routes-link");
    std::os::unix::fs::symlink(&routes, &routes_link).unwrap();
    let o = k3(&[
        "run",
        model.to_str().unwrap(),
        "--ids",
        "768,5,6",
        "--ngen",
        "2",
        "--quiet",
        "--stats-json",
        fifo.to_str().unwrap(),
        "--dump-logits",
        link.to_str().unwrap(),
        "--route-trace",
        routes_link.to_str().unwrap(),
    ]);
    release(&fifo);
    release(&routes);
    let err = stderr(&o);
    assert!(o.status.success(), "{err}");
    let stats: serde_json::Value = serde_json::from_slice(&reader.join().unwrap()).unwrap();
    assert!(stats.get("startup").is_some(), "{stats}");
    assert!(std::fs::symlink_metadata(&fifo)
        .unwrap()
        .file_type()
        .is_fifo());
    assert!(std::fs::symlink_metadata(&link)
        .unwrap()
        .file_type()
        .is_symlink());
    assert_eq!(
        std::fs::metadata(&real).unwrap().len(),
        3 * 1024 * 4,
        "[3 × vocab] f32"
    );
    let trace = String::from_utf8(routes_reader.join().unwrap()).unwrap();
    assert!(trace.lines().count() > 1, "{trace}");
    assert!(std::fs::symlink_metadata(&routes)
        .unwrap()
        .file_type()
        .is_fifo());
    let left: Vec<_> = std::fs::read_dir(tmp.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(left.len(), 5, "{left:?}");

    // `-` is standard output: the JSON follows the generated ids.
    let o = k3(&[
        "run",
        model.to_str().unwrap(),
        "--ids",
        "768,5,6",
        "--ngen",
        "2",
        "--quiet",
        "--stats-json",
        "-",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    let json = &out[out.find('{').expect("no JSON on stdout")..];
    let stats: serde_json::Value = serde_json::from_str(json).unwrap();
    assert!(stats.get("startup").is_some(), "{out}");
    assert!(!std::path::Path::new("-").exists());
}

#[cfg(unix)]
#[test]
fn a_usage_file_that_is_a_fifo_is_refused_not_replaced() {
    use std::os::unix::fs::FileTypeExt;
    let snap = support::copy_dir(&support::tiny(0));
    let tmp = tempfile::tempdir().unwrap();
    let fifo = tmp.path().join("usage.fifo");
    assert!(Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap()
        .success());
    let o = k3(&[
        "run",
        snap.path().to_str().unwrap(),
        "--ids",
        "768,5,6",
        "--ngen",
        "2",
        "--quiet",
        "--usage-pins",
        "on",
        "--usage-file",
        fifo.to_str().unwrap(),
    ]);
    let err = stderr(&o);
    assert!(o.status.success(), "{err}");
    assert!(
        err.contains("usage history not saved") && err.contains("usage.fifo is a FIFO"),
        "{err}"
    );
    assert!(std::fs::symlink_metadata(&fifo)
        .unwrap()
        .file_type()
        .is_fifo());
}

/// K3_LOG (else RUST_LOG) filters the engine's log lines, which keep their exact text; the
/// stats lines of `k3 run` stay at every level, and a bad filter is refused by name.
#[test]
fn k3_log_filters_the_log_lines_but_not_the_stats_lines() {
    let dir = support::tiny(0);
    let cache = tempfile::tempdir().unwrap();
    let run = |vars: &[(&str, &str)]| {
        let mut c = Command::new(env!("CARGO_BIN_EXE_k3"));
        c.args([
            "run",
            dir.to_str().unwrap(),
            "--ids",
            "768,5,6",
            "--ngen",
            "2",
        ])
        .args([
            "--backend",
            "cpu",
            "--prompt-cache",
            cache.path().to_str().unwrap(),
        ])
        .env("RAYON_NUM_THREADS", "2")
        .env_remove("K3_EXPERT_GB")
        .env_remove("K3_LOG")
        .env_remove("RUST_LOG");
        for (k, v) in vars {
            c.env(k, v);
        }
        c.output().expect("running k3")
    };
    let has = |err: &str, prefix: &str| err.lines().any(|l| l.starts_with(prefix));
    let stats = [
        "[K3] prompt: 3 tokens",
        "[K3] decode 2 tokens in ",
        "[K3] disk: ",
    ];

    let o = run(&[]);
    let default = stderr(&o);
    assert!(o.status.success(), "{default}");
    assert!(has(&default, "[K3] backend: cpu ("), "{default}");
    assert!(
        !has(&default, "[K3] prompt cache: no stored prefix"),
        "{default}"
    );

    for vars in [&[("K3_LOG", "warn")][..], &[("RUST_LOG", "warn")][..]] {
        let o = run(vars);
        let err = stderr(&o);
        assert!(o.status.success(), "{vars:?}: {err}");
        assert!(!has(&err, "[K3] backend: "), "{vars:?}: {err}");
        for s in stats {
            assert!(has(&err, s), "{vars:?}: no {s} in {err}");
        }
    }

    // K3_LOG wins over RUST_LOG; debug adds lines the default leaves out.
    let o = run(&[("K3_LOG", "debug"), ("RUST_LOG", "warn")]);
    let err = stderr(&o);
    assert!(o.status.success(), "{err}");
    assert!(has(&err, "[K3] backend: cpu ("), "{err}");
    assert!(
        has(
            &err,
            "[K3] prompt cache: no stored prefix of the prompt's 3 tokens"
        ),
        "{err}"
    );

    for (var, value) in [("K3_LOG", "k3=loud"), ("RUST_LOG", "serve=noisy")] {
        let o = run(&[(var, value)]);
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(1), "{var}={value}: {err}");
        assert!(
            err.contains(&format!(
                "k3: error: {var}: \"{value}\" is not a log filter"
            )),
            "{var}={value}: {err}"
        );
    }
}
