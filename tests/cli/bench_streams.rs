//! `k3 bench streams`: streams decoded together against one at a time, the tokens checked.

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

#[test]
fn bench_streams_reports_each_count_and_checks_the_tokens() {
    let dir = support::tiny(0);
    let d = dir.to_str().unwrap();
    let out = tempfile::tempdir().unwrap();
    let json = out.path().join("streams.json");
    let o = k3(&[
        "bench",
        "streams",
        d,
        "--streams",
        "1,3",
        "--ngen",
        "4",
        "--backend",
        "cpu",
        "--json",
        json.to_str().unwrap(),
    ]);
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(stdout.contains("| 3 one at a time |"), "{stdout}");
    assert!(stdout.contains("| 3 together |"), "{stdout}");
    assert!(stdout.contains("every stream's tokens equal its tokens alone"));
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    assert_eq!(v["tokens_match_alone"], true);
    assert_eq!(v["cases"].as_array().unwrap().len(), 3);
}

#[test]
fn bench_streams_names_a_bad_flag() {
    let dir = support::tiny(0);
    let d = dir.to_str().unwrap();
    for (args, want) in [
        (&["--streams", "0"][..], "--streams: 0 streams"),
        (&["--streams", "x"][..], "--streams: \"x\" is not a number"),
        (&["--streams", ""][..], "--streams is empty"),
        (&["--ngen", "0"][..], "--ngen must be at least 1"),
        (&["--rounds", "0"][..], "--rounds must be at least 1"),
    ] {
        let mut all = vec!["bench", "streams", d, "--backend", "cpu"];
        all.extend_from_slice(args);
        let o = k3(&all);
        let e = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success() && e.contains(want), "{args:?}: {e}");
    }
}
