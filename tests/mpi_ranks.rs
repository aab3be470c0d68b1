//! Expert parallel over MPI ranks (`--features mpi`, Open MPI's `mpirun` on PATH): 2 and 3
//! ranks on one machine give a single process's ids and logits bit for bit on the CPU, over
//! prefill windows, decode and a prompt-cache restore, and within the GPU tolerance on the
//! GPU (lavapipe in CI; skipped without an adapter, except under CI=true); a worker holding
//! only its own shards gives the same logits; a served job shows its ranks in `/health` and
//! `/metrics`; a rank without its shards, with another checkpoint or other flags stops the
//! job at start naming it, and a killed rank ends the job, within 20 s.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

const K3: &str = env!("CARGO_BIN_EXE_k3");

/// Writes a synthetic checkpoint of `preset` with `seed` into `dir/name`.
fn synth(dir: &Path, name: &str, preset: &str, seed: u64) -> PathBuf {
    let out = dir.join(name);
    let o = Command::new(K3)
        .args(["synth", "--preset", preset, "--seed", &seed.to_string()])
        .arg(&out)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    out
}

/// `mpirun` with the flags a test machine needs (root in containers, fewer cores than ranks).
fn mpirun() -> Command {
    let mut c = Command::new("mpirun");
    c.args(["--allow-run-as-root", "--oversubscribe"])
        .env("RAYON_NUM_THREADS", "1")
        .env_remove("K3_EXPERT_GB");
    c
}

/// Runs `k3 run` with `args`, in one process (`ranks` 1) or over `ranks` ranks.
fn run(ranks: usize, args: &[&str]) -> Output {
    let o = if ranks == 1 {
        Command::new(K3)
            .arg("run")
            .args(args)
            .env("RAYON_NUM_THREADS", "1")
            .env_remove("K3_EXPERT_GB")
            .output()
            .unwrap()
    } else {
        mpirun()
            .args(["-np", &ranks.to_string(), K3, "run"])
            .args(args)
            .output()
            .unwrap()
    };
    assert!(
        o.status.success(),
        "{ranks} rank(s): {}",
        String::from_utf8_lossy(&o.stderr)
    );
    o
}

fn ids(n: usize) -> String {
    (1..=n).map(|i| i.to_string()).collect::<Vec<_>>().join(",")
}

#[test]
fn ranks_give_the_single_process_logits_bit_for_bit() {
    let tmp = tempfile::tempdir().unwrap();
    for preset in ["tiny", "small"] {
        let model = synth(tmp.path(), preset, preset, 3);
        let m = model.to_str().unwrap();
        let prompt = ids(11);
        // Windows of 4 tokens: three prefill passes, then decode.
        let base = [
            m,
            "--backend",
            "cpu",
            "--ids",
            &prompt,
            "--ngen",
            "6",
            "--ignore-eos",
            "--chunk",
            "4",
            "--no-prompt-cache",
            "--quiet",
        ];
        let dump = |name: &str| tmp.path().join(format!("{preset}-{name}.bin"));
        let one_path = dump("1");
        let mut a = base.to_vec();
        a.extend(["--dump-logits", one_path.to_str().unwrap()]);
        let one = run(1, &a);
        let want = std::fs::read(&one_path).unwrap();
        assert!(!want.is_empty());
        for ranks in [2, 3] {
            let path = dump(&ranks.to_string());
            let mut a = base.to_vec();
            a.extend(["--dump-logits", path.to_str().unwrap()]);
            let got = run(ranks, &a);
            assert_eq!(
                got.stdout, one.stdout,
                "{preset}, {ranks} ranks: ids differ"
            );
            let err = String::from_utf8_lossy(&got.stderr);
            assert!(
                err.contains(&format!("rank {} of {ranks}", ranks - 1)),
                "no rank lines: {err}"
            );
            assert!(
                err.contains("GB/s (measured at start)"),
                "no measured rates: {err}"
            );
            assert!(
                err.contains("[K3] ranks: rank 0 (")
                    && err.contains(&format!("all {ranks} ranks hit")),
                "no ranks stats line: {err}"
            );
            assert!(
                std::fs::read(&path).unwrap() == want,
                "{preset}, {ranks} ranks: logits differ from one process's"
            );
        }
    }
}

#[test]
fn ranks_restore_a_prompt_cache_entry_as_one_process_does() {
    let tmp = tempfile::tempdir().unwrap();
    let model = synth(tmp.path(), "tiny", "tiny", 5);
    let m = model.to_str().unwrap();
    let mut answers = Vec::new();
    for ranks in [1, 2] {
        let cache = tmp.path().join(format!("pc{ranks}"));
        let c = cache.to_str().unwrap();
        // The prompt cache keeps prompts of 256 tokens and more.
        let (first, second) = (ids(300), ids(310));
        let flags = |p: &str| -> Vec<String> {
            [
                m,
                "--backend",
                "cpu",
                "--ngen",
                "8",
                "--ignore-eos",
                "--chunk",
                "64",
            ]
            .iter()
            .map(|s| s.to_string())
            .chain(["--prompt-cache", c, "--ids", p].map(String::from))
            .collect()
        };
        let a = flags(&first);
        run(ranks, &a.iter().map(String::as_str).collect::<Vec<_>>());
        let a = flags(&second);
        let o = run(ranks, &a.iter().map(String::as_str).collect::<Vec<_>>());
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(
            err.contains("prompt cache: loaded 300 of 310"),
            "{ranks} rank(s) did not restore: {err}"
        );
        answers.push(o.stdout);
    }
    assert_eq!(answers[0], answers[1], "the restored run's ids differ");
}

/// Runs an MPMD job: rank 0 in `wdir0`, rank 1 in `wdir1`, each `k3 run` with its `args`.
fn mpmd_output(wdir0: &Path, args0: &[&str], wdir1: &Path, args1: &[&str]) -> Output {
    mpirun()
        .args(["-np", "1", "-wdir"])
        .arg(wdir0)
        .args([K3, "run"])
        .args(args0)
        .args([":", "-np", "1", "-wdir"])
        .arg(wdir1)
        .args([K3, "run"])
        .args(args1)
        .output()
        .unwrap()
}

/// [`mpmd_output`] for a job that must fail: its stderr and how long it took.
fn mpmd(wdir0: &Path, args0: &[&str], wdir1: &Path, args1: &[&str]) -> (String, Duration) {
    let t = Instant::now();
    let o = mpmd_output(wdir0, args0, wdir1, args1);
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(!o.status.success(), "the job ran: {err}");
    (err, t.elapsed())
}

/// The flags of the MPMD fault tests: the even split, so which rank owns which shard does
/// not depend on the read rates measured at start.
const RUN: [&str; 10] = [
    "m",
    "--backend",
    "cpu",
    "--ids",
    "1,2,3",
    "--ngen",
    "2",
    "--no-prompt-cache",
    "--rank-read-gbps",
    "1,1",
];

#[test]
fn a_rank_without_its_shards_stops_the_job_naming_rank_host_and_file() {
    let tmp = tempfile::tempdir().unwrap();
    let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
    std::fs::create_dir_all(&a).unwrap();
    std::fs::create_dir_all(&b).unwrap();
    let ma = synth(&a, "m", "tiny", 1);
    let mb = synth(&b, "m", "tiny", 1);
    // A shard of the tiny layout that holds routed experts of both ranks.
    let gone = mb.join("model-00003-of-00006.safetensors");
    std::fs::remove_file(&gone).unwrap();
    let (err, took) = mpmd(&a, &RUN, &b, &RUN);
    let file = gone.file_name().unwrap().to_string_lossy().into_owned();
    assert!(
        err.contains("rank 1 on host") && err.contains("could not start") && err.contains(&file),
        "{err}"
    );
    assert!(took < Duration::from_secs(20), "took {took:?}");
    drop(ma);
}

/// The shard files `k3 inspect --ranks 2` lists for rank `rank` of `model`.
fn inspect_files(model: &Path, rank: usize, rates: &str) -> Vec<String> {
    let o = Command::new(K3)
        .arg("inspect")
        .arg(model)
        .args(["--ranks", "2", "--rank-read-gbps", rates])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    let mut files = Vec::new();
    let mut inside = false;
    for line in out.lines() {
        if line.starts_with("rank ") {
            inside = line.starts_with(&format!("rank {rank}"));
        } else if inside {
            if let Some(name) = line.trim().split(':').next() {
                if name.ends_with(".safetensors") {
                    files.push(name.to_string());
                }
            }
        }
    }
    files
}

#[test]
fn a_worker_holding_only_its_shards_gives_the_single_process_logits() {
    let tmp = tempfile::tempdir().unwrap();
    let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
    std::fs::create_dir_all(&a).unwrap();
    std::fs::create_dir_all(b.join("m")).unwrap();
    let full = synth(&a, "m", "tiny", 4);
    // The worker's host holds the config, the index and its own shards, nothing else.
    let own = inspect_files(&full, 1, "1,1");
    let all = std::fs::read_dir(&full)
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .unwrap()
                .file_name()
                .to_string_lossy()
                .ends_with(".safetensors")
        })
        .count();
    assert!(!own.is_empty() && own.len() < all, "{own:?} of {all}");
    for f in own
        .iter()
        .map(String::as_str)
        .chain(["config.json", "model.safetensors.index.json"])
    {
        std::fs::copy(full.join(f), b.join("m").join(f)).unwrap();
    }
    let one_path = tmp.path().join("one.bin");
    let two_path = tmp.path().join("two.bin");
    let args = |dump: &Path| -> Vec<String> {
        [
            "m",
            "--backend",
            "cpu",
            "--ids",
            "1,2,3,4,5,6,7",
            "--ngen",
            "5",
            "--ignore-eos",
            "--chunk",
            "3",
            "--no-prompt-cache",
            "--rank-read-gbps",
            "1,1",
            "--dump-logits",
            dump.to_str().unwrap(),
        ]
        .map(String::from)
        .to_vec()
    };
    let one_args = args(&one_path);
    let one = Command::new(K3)
        .current_dir(&a)
        .arg("run")
        .args(&one_args)
        .env("RAYON_NUM_THREADS", "1")
        .env_remove("K3_EXPERT_GB")
        .output()
        .unwrap();
    assert!(
        one.status.success(),
        "{}",
        String::from_utf8_lossy(&one.stderr)
    );
    let two_args = args(&two_path);
    let two_args: Vec<&str> = two_args.iter().map(String::as_str).collect();
    let two = mpmd_output(&a, &two_args, &b, &two_args);
    let err = String::from_utf8_lossy(&two.stderr);
    assert!(two.status.success(), "{err}");
    assert!(err.contains("no dense weights"), "{err}");
    // The flag overrides the read probe.
    assert!(err.contains("1.00, 1.00 GB/s (--rank-read-gbps)"), "{err}");
    assert_eq!(two.stdout, one.stdout, "ids differ: {err}");
    assert!(
        std::fs::read(&two_path).unwrap() == std::fs::read(&one_path).unwrap(),
        "logits differ from one process's"
    );
    // A shard the worker owns, gone: the job stops naming rank, host and file.
    std::fs::remove_file(b.join("m").join(&own[0])).unwrap();
    let (err, took) = mpmd(&a, &two_args, &b, &two_args);
    assert!(
        err.contains("rank 1 on host") && err.contains("could not start") && err.contains(&own[0]),
        "{err}"
    );
    assert!(took < Duration::from_secs(20), "took {took:?}");
}

#[test]
fn a_rank_on_another_checkpoint_or_with_other_flags_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
    std::fs::create_dir_all(&a).unwrap();
    std::fs::create_dir_all(&b).unwrap();
    synth(&a, "m", "tiny", 1);
    synth(&b, "m", "tiny", 2);
    let (err, took) = mpmd(&a, &RUN, &b, &RUN);
    assert!(
        err.contains("rank 1 on host") && err.contains("different checkpoint"),
        "{err}"
    );
    assert!(err.contains(".safetensors"), "names no file: {err}");
    assert!(took < Duration::from_secs(20), "took {took:?}");
    let mut other = RUN.to_vec();
    other[6] = "3";
    let (err, _) = mpmd(&a, &RUN, &a, &other);
    assert!(
        err.contains("rank 1 on host") && err.contains("other flags") && err.contains("`3`"),
        "{err}"
    );
}

#[test]
fn a_killed_rank_ends_the_job_naming_it() {
    let tmp = tempfile::tempdir().unwrap();
    let model = synth(tmp.path(), "tiny", "tiny", 1);
    let mut child = mpirun()
        .args(["-np", "2", K3, "chat"])
        .arg(&model)
        .args(["--backend", "cpu", "--no-prompt-cache", "--quiet"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let stderr = child.stderr.take().unwrap();
    // The head names each rank's pid once every rank has started.
    let (tx, rx) = std::sync::mpsc::channel();
    let reader = std::thread::spawn(move || {
        use std::io::{BufRead, BufReader};
        let mut all = String::new();
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if let Some(at) = line.find("rank 1 of 2 on ") {
                let pid: String = line[at..]
                    .split("(pid ")
                    .nth(1)
                    .unwrap_or("")
                    .chars()
                    .take_while(char::is_ascii_digit)
                    .collect();
                let _ = tx.send(pid);
            }
            all.push_str(&line);
            all.push('\n');
        }
        all
    });
    let pid = rx
        .recv_timeout(Duration::from_secs(60))
        .expect("no rank line");
    let t = Instant::now();
    let killed = Command::new("kill").args(["-9", &pid]).status().unwrap();
    assert!(killed.success());
    // A turn the dead rank would have to serve.
    let _ = stdin.write_all(b"hello\n");
    loop {
        if child.try_wait().unwrap().is_some() {
            break;
        }
        if t.elapsed() > Duration::from_secs(20) {
            let _ = child.kill();
            panic!("the job still runs 20 s after rank 1 died");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    drop(stdin);
    let err = reader.join().unwrap();
    assert!(err.contains("rank 1"), "the end names no rank: {err}");
    assert!(!child.wait().unwrap().success());
}

/// An HTTP client that returns every status as it came.
fn agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(120)))
        .build()
        .into()
}

/// The value of the `/metrics` sample `name{rank="R",...}` for rank `rank`.
fn rank_sample(metrics: &str, name: &str, rank: usize) -> Option<f64> {
    let head = format!("{name}{{rank=\"{rank}\",");
    metrics
        .lines()
        .find(|l| l.starts_with(&head))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

#[test]
fn a_served_job_shows_its_ranks_in_health_and_metrics() {
    let tmp = tempfile::tempdir().unwrap();
    let model = synth(tmp.path(), "tiny", "tiny", 6);
    let mut child = mpirun()
        .args(["-np", "2", K3, "serve"])
        .arg(&model)
        .args(["--port", "0", "--backend", "cpu", "--no-prompt-cache"])
        .env_remove("K3_API_KEY")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let reader = std::thread::spawn(move || {
        use std::io::{BufRead, BufReader};
        let mut all = String::new();
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if let Some(at) = line.find("listening on http://") {
                let rest = &line[at + "listening on http://".len()..];
                let _ = tx.send(rest.split_whitespace().next().unwrap_or("").to_string());
            }
            all.push_str(&line);
            all.push('\n');
        }
        all
    });
    let addr = rx.recv_timeout(Duration::from_secs(120));
    let checks = addr.as_ref().map(|addr| {
        let a = agent();
        let body = serde_json::json!({
            "messages": [{"role": "user", "content": "hello there"}],
            "max_tokens": 4,
        });
        let mut r = a
            .post(&format!("http://{addr}/v1/chat/completions"))
            .header("Content-Type", "application/json")
            .send(body.to_string())
            .unwrap();
        let chat = (r.status().as_u16(), r.body_mut().read_to_string().unwrap());
        let mut r = a.get(&format!("http://{addr}/health")).call().unwrap();
        let health: serde_json::Value =
            serde_json::from_str(&r.body_mut().read_to_string().unwrap()).unwrap();
        let mut r = a.get(&format!("http://{addr}/metrics")).call().unwrap();
        let metrics = r.body_mut().read_to_string().unwrap();
        (chat, health, metrics)
    });
    // mpirun passes SIGTERM on to the ranks.
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    let t = Instant::now();
    while child.try_wait().unwrap().is_none() && t.elapsed() < Duration::from_secs(20) {
        std::thread::sleep(Duration::from_millis(100));
    }
    let _ = child.kill();
    let _ = child.wait();
    let log = reader.join().unwrap();
    let (chat, health, metrics) = checks.unwrap_or_else(|_| panic!("no address: {log}"));
    assert_eq!(chat.0, 200, "{}: {log}", chat.1);
    let ranks = health["ranks"]
        .as_array()
        .unwrap_or_else(|| panic!("{health}"));
    assert_eq!(ranks.len(), 2, "{health}");
    for (r, v) in ranks.iter().enumerate() {
        assert_eq!(v["rank"], r, "{health}");
        assert!(
            v["host"].as_str().is_some_and(|h| !h.is_empty()),
            "{health}"
        );
        // Each rank owns half of every layer's experts: a request looks some up on each.
        assert!(v["expert_lookups"].as_u64().unwrap_or(0) > 0, "{health}");
        let hit = v["expert_hit_percent"].as_f64().unwrap();
        assert!((0.0..=100.0).contains(&hit), "{health}");
        let lookups = rank_sample(&metrics, "k3_rank_expert_lookups_total", r);
        assert_eq!(lookups, v["expert_lookups"].as_f64(), "{metrics}");
        for name in [
            "k3_rank_expert_hit_ratio",
            "k3_rank_streamed_bytes_total",
            "k3_rank_disk_gigabytes_per_second",
        ] {
            assert!(
                rank_sample(&metrics, name, r).is_some(),
                "{name}: {metrics}"
            );
        }
    }
    assert!(rank_sample(&metrics, "k3_rank_expert_lookups_total", 2).is_none());
}

/// Relative L2 distance of `a` from `b`.
fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    let (mut d, mut n) = (0.0f64, 0.0f64);
    for (x, y) in a.iter().zip(b) {
        d += (f64::from(*x) - f64::from(*y)).powi(2);
        n += f64::from(*y).powi(2);
    }
    (d / n.max(1e-30)).sqrt()
}

fn read_f32(p: &Path) -> Vec<f32> {
    std::fs::read(p)
        .unwrap()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

#[test]
fn gpu_ranks_give_the_single_process_logits_within_tolerance() {
    // The GPU tests' tolerance on logits (tests/gpu/gpu_model.rs).
    const TOL: f64 = 1e-4;
    let tmp = tempfile::tempdir().unwrap();
    let model = synth(tmp.path(), "tiny", "tiny", 7);
    let m = model.to_str().unwrap();
    let args = |dump: &Path| -> Vec<String> {
        [
            m,
            "--backend",
            "gpu",
            "--ids",
            &ids(9),
            "--ngen",
            "4",
            "--ignore-eos",
            "--chunk",
            "4",
            "--no-prompt-cache",
            "--quiet",
            "--dump-logits",
            dump.to_str().unwrap(),
        ]
        .map(String::from)
        .to_vec()
    };
    let one_path = tmp.path().join("one.bin");
    let one = Command::new(K3)
        .arg("run")
        .args(args(&one_path))
        .env("RAYON_NUM_THREADS", "1")
        .env_remove("K3_EXPERT_GB")
        .output()
        .unwrap();
    if !one.status.success() {
        let err = String::from_utf8_lossy(&one.stderr);
        let no_adapter = err.contains("no GPU adapter");
        assert!(
            no_adapter && std::env::var("CI").as_deref() != Ok("true"),
            "one process on the GPU failed: {err}"
        );
        eprintln!("skipped: no GPU adapter ({err})");
        return;
    }
    let two_path = tmp.path().join("two.bin");
    let two = mpirun()
        .args(["-np", "2", K3, "run"])
        .args(args(&two_path))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&two.stderr);
    assert!(two.status.success(), "{err}");
    assert!(err.contains("rank 1 of 2") && err.contains("gpu"), "{err}");
    let (a, b) = (read_f32(&two_path), read_f32(&one_path));
    assert!(
        !b.is_empty() && a.len() == b.len(),
        "{} vs {} logits",
        a.len(),
        b.len()
    );
    let e = rel_l2(&a, &b);
    assert!(
        e <= TOL,
        "2 GPU ranks: logits rel L2 {e:e} > {TOL:e} vs one process"
    );
    assert_eq!(two.stdout, one.stdout, "ids differ");
}
