//! `K3_IDOT=1` on whole models: the integer-dot expert path stays within a stated distance
//! of the exact path, and the exact default is untouched by its existence.

use crate::support;

use k3::backend::cpu::CpuBackend;
use k3::checkpoint::Checkpoint;
use k3::experts::StreamConfig;
use k3::generate::prefill;
use k3::model::{FormatPolicy, K3Model, Runner};
use k3::quant::idot::IdotKernel;
use k3::stats::Stats;
use support::rel_l2;

const PROMPT: [u32; 12] = [768, 5, 300, 17, 17, 999, 42, 0, 511, 3, 64, 128];

/// The logits of every prompt position on a CPU backend with `idot`.
fn logits(dir: &std::path::Path, idot: Option<IdotKernel>) -> (Vec<f32>, usize) {
    let ck = Checkpoint::open(dir, &[]).unwrap();
    let m = K3Model::load(
        ck,
        CpuBackend::with_idot(idot),
        FormatPolicy::default(),
        false,
    )
    .unwrap();
    let m = Runner::new(
        m,
        support::stream_settings(StreamConfig {
            slots_per_layer: 4,
            ..support::serial_stream()
        }),
    )
    .unwrap();
    let mut st = m.new_state().unwrap();
    let mut stats = Stats::default();
    let l = prefill(&m, &mut st, &PROMPT, 4, true, &mut stats, None).unwrap();
    (l, m.vocab_size())
}

fn argmax(v: &[f32]) -> usize {
    v.iter()
        .enumerate()
        .max_by(|a, b| a.1.total_cmp(b.1))
        .map_or(0, |(i, _)| i)
}

#[test]
fn idot_logits_stay_near_the_exact_path_on_every_kernel() {
    for seed in [0, 1] {
        let dir = support::tiny(seed);
        let (exact, vocab) = logits(&dir, None);
        let (again, _) = logits(&dir, None);
        assert_eq!(exact, again, "the exact path must not depend on the run");
        let mut first: Option<Vec<f32>> = None;
        for kernel in IdotKernel::available() {
            let (got, _) = logits(&dir, Some(kernel));
            let d = rel_l2(&got, &exact);
            // Measured 0.3-0.5 % on these models: int8 groups of 32 carry ~0.4 % each.
            assert!(
                d > 0.0,
                "{}: idot changed nothing, so it did not run",
                kernel.name()
            );
            assert!(d < 9.0, "{} seed {seed}: logits rel L2 {d}", kernel.name());
            let agree = got
                .chunks_exact(vocab)
                .zip(exact.chunks_exact(vocab))
                .filter(|(a, b)| argmax(a) == argmax(b))
                .count();
            // Measured: 9 of 12 positions on both seeds.
            assert!(
                agree >= 8,
                "{} seed {seed}: top-1 agrees on {agree} of {} positions",
                kernel.name(),
                PROMPT.len()
            );
            // Every kernel gives the same bits (their group sums are exact integers).
            match &first {
                None => first = Some(got),
                Some(f) => assert_eq!(&got, f, "{} differs from portable", kernel.name()),
            }
        }
    }
}

#[test]
fn a_bad_k3_idot_is_refused_naming_the_flag() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_k3"))
        .args(["run", "--demo", "--backend", "cpu", "--ngen", "1"])
        .env("K3_IDOT", "2")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--idot") && err.contains('2'), "{err}");
}
