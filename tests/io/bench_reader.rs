//! `k3 bench reader`: the decode-shaped pattern's report, and a clear error naming the flag
//! for each bad value of its flags.

use std::path::Path;
use std::process::{Command, Output};

fn k3(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_k3"))
        .args(args)
        .env_remove("K3_LOAD_THREADS")
        .output()
        .expect("running k3")
}

fn text(o: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

/// The tiny model, written under the crate's directory rather than the temp dir (which may
/// be a tmpfs that refuses direct reads; the bench needs them).
fn tiny_model() -> tempfile::TempDir {
    let dir = tempfile::tempdir_in(env!("CARGO_MANIFEST_DIR")).unwrap();
    let o = k3(&["synth", "--force", dir.path().to_str().unwrap()]);
    assert!(o.status.success(), "synth: {}", text(&o).1);
    dir
}

fn bench(model: &Path, extra: &[&str]) -> Output {
    let mut args = vec!["bench", "reader", model.to_str().unwrap()];
    args.extend_from_slice(extra);
    k3(&args)
}

#[test]
fn the_decode_pattern_reports_each_engine_variant_beside_the_plain_reads() {
    let dir = tiny_model();
    let o = bench(
        dir.path(),
        &[
            "--pattern",
            "decode",
            "--tokens",
            "2",
            "--per-layer",
            "3",
            "--gap-ms",
            "1",
            "--rounds",
            "2",
            "--load-threads",
            "2",
            "--piece-kib",
            "0,4",
        ],
    );
    let (out, err) = text(&o);
    if !o.status.success() {
        // A filesystem that takes no direct reads is the one acceptable failure.
        assert!(err.contains("fell back to buffered"), "{err}");
        return;
    }
    assert!(
        err.contains("decode, 2 tokens x") && err.contains("x 3 experts"),
        "{err}"
    );
    for row in [
        "| engine, read piece whole |",
        "| engine, read piece 4 KiB |",
        ", decode shape, whole experts |",
        ", back to back (ceiling) | ",
    ] {
        assert!(out.contains(row), "no row {row:?} in:\n{out}");
    }
    // Two rounds of each of the four runs.
    assert_eq!(err.matches("  round ").count(), 8, "{err}");
    assert!(out.contains("(medians of 2 rounds"), "{out}");
}

#[test]
fn bad_values_of_the_reader_flags_are_refused_naming_the_flag() {
    let dir = tiny_model();
    let cases: [(&[&str], &str); 7] = [
        (
            &["--piece-kib", "3"],
            "--piece-kib: 3 is not a multiple of 4 KiB",
        ),
        (
            &["--piece-kib", "2048,x"],
            "--piece-kib: \"x\" is not a whole number of KiB",
        ),
        (&["--rounds", "0"], "--rounds must be at least 1"),
        (
            &["--pattern", "decode", "--tokens", "0"],
            "--tokens must be at least 1",
        ),
        (
            &["--pattern", "decode", "--per-layer", "0"],
            "--per-layer must be 1..=",
        ),
        (
            &["--pattern", "decode", "--per-layer", "100000"],
            "--per-layer must be 1..=",
        ),
        (
            &["--pattern", "random"],
            "invalid value 'random' for '--pattern",
        ),
    ];
    for (args, want) in cases {
        let o = bench(dir.path(), args);
        let err = text(&o).1;
        assert!(!o.status.success(), "{args:?} was accepted");
        assert!(err.contains(want), "{args:?}: {err}");
    }
    let o = Command::new(env!("CARGO_BIN_EXE_k3"))
        .args([
            "bench",
            "reader",
            dir.path().to_str().unwrap(),
            "--limit",
            "1",
        ])
        .env("K3_LOAD_THREADS", "0")
        .output()
        .unwrap();
    let err = text(&o).1;
    assert!(!o.status.success());
    assert!(
        err.contains("K3_LOAD_THREADS / --load-threads must be 1..=16"),
        "{err}"
    );
}
