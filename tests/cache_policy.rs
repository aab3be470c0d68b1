//! Cache policies and usage pins: no policy or budget changes a logit; pins learnt in one
//! run are there in the next; a corrupt usage history is reported and ignored.

mod support;

use k3::experts::cache_policy::{CacheSetup, PolicyKind};
use k3::experts::{IoMode, StreamConfig};
use k3::generate::prefill;
use k3::model::FormatPolicy;
use k3::stats::Stats;
use std::collections::HashMap;
use std::path::Path;
use std::process::{Command, Output};
use std::sync::Arc;

const PROMPT: [u32; 10] = [768, 5, 300, 17, 17, 999, 42, 0, 511, 9];

fn logits(kind: PolicyKind, slots: usize, pins: &[u32]) -> (Vec<f32>, Stats) {
    let mut m = support::cpu_model(
        &support::tiny(0),
        FormatPolicy::default(),
        StreamConfig {
            mode: IoMode::Buffered,
            pipe: true,
            load_threads: 2,
            slots_per_layer: slots,
        },
    );
    let c = m.ckpt.config.clone();
    let pins: HashMap<usize, Vec<u32>> = (0..c.num_hidden_layers)
        .filter(|&l| c.is_moe_layer(l))
        .map(|l| (l, pins.to_vec()))
        .collect();
    m.experts_mut()
        .set_cache_setup(CacheSetup {
            kind,
            pins: Arc::new(pins),
        })
        .unwrap();
    let mut st = m.new_state().unwrap();
    let mut stats = Stats::default();
    let l = prefill(&m, &mut st, &PROMPT, 2, true, &mut stats, None).unwrap();
    (l, stats)
}

#[test]
fn no_policy_or_budget_changes_a_logit() {
    let (want, _) = logits(PolicyKind::Lru, 0, &[]);
    let mut hit_rates = Vec::new();
    for kind in PolicyKind::ALL {
        for slots in [1, 2, 3, 5, 8] {
            for pins in [&[][..], &[0, 3][..]] {
                let (got, s) = logits(kind, slots, pins);
                assert!(
                    got.iter()
                        .zip(&want)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{kind}, {slots} slots, pins {pins:?}: logits differ"
                );
                hit_rates.push(s.expert_hits);
            }
        }
    }
    assert!(
        hit_rates.iter().any(|&h| h != hit_rates[0]),
        "the settings must change what the cache holds"
    );
}

fn k3(dir: &Path, usage: &Path, mode: &str) -> Output {
    // 200 prompt tokens: enough selections (400 a layer over 8 experts) for pins.
    let ids: Vec<String> = (0..200).map(|i| ((i * 37) % 1000).to_string()).collect();
    Command::new(env!("CARGO_BIN_EXE_k3"))
        .args(["run", dir.to_str().unwrap(), "--ids", &ids.join(",")])
        .args(["--ngen", "2", "--ignore-eos", "--quiet", "--backend", "cpu"])
        .args(["--expert-gb", "1000", "--usage-pins", mode, "--usage-file"])
        .arg(usage)
        .env("RAYON_NUM_THREADS", "2")
        .output()
        .unwrap()
}

fn stderr(o: &Output) -> String {
    let e = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(o.status.success(), "{e}");
    e
}

/// Experts pinned, from the `[K3] usage pins: N experts ...` line.
fn pinned(err: &str) -> Option<usize> {
    let line = err.lines().find(|l| l.starts_with("[K3] usage pins: "))?;
    line["[K3] usage pins: ".len()..]
        .split(' ')
        .next()?
        .parse()
        .ok()
}

#[test]
fn pins_survive_a_restart_and_a_corrupt_history_is_ignored() {
    let dir = support::tiny(0);
    let tmp = tempfile::tempdir().unwrap();
    let usage = tmp.path().join("usage");
    let e = stderr(&k3(&dir, &usage, "on"));
    assert!(e.contains("no history at"), "{e}");
    assert!(usage.exists(), "the first run writes the history");
    let e = stderr(&k3(&dir, &usage, "on"));
    let n = pinned(&e).unwrap_or(0);
    assert!(n > 0, "the second run pins from the first: {e}");
    // Read-only: pins from the history (now two runs long), the file untouched, so a
    // second read-only run pins the same.
    let before = std::fs::read(&usage).unwrap();
    let e = stderr(&k3(&dir, &usage, "read-only"));
    let ro = pinned(&e);
    assert!(ro.is_some_and(|p| p >= n), "{e}");
    assert!(e.contains("read-only"), "{e}");
    assert_eq!(std::fs::read(&usage).unwrap(), before);
    let e = stderr(&k3(&dir, &usage, "read-only"));
    assert_eq!(pinned(&e), ro, "{e}");
    assert_eq!(std::fs::read(&usage).unwrap(), before);
    // Corrupt: reported naming the file, ignored, and replaced by a good history.
    let mut bad = before.clone();
    let at = bad.len() / 2;
    bad[at] ^= 0xff;
    std::fs::write(&usage, &bad).unwrap();
    let e = stderr(&k3(&dir, &usage, "on"));
    assert!(
        e.contains("checksum mismatch")
            && e.contains("ignored")
            && e.contains(&*usage.to_string_lossy()),
        "{e}"
    );
    assert_eq!(pinned(&e), None, "nothing pinned from a damaged file: {e}");
    let e = stderr(&k3(&dir, &usage, "read-only"));
    assert!(
        pinned(&e).is_some_and(|p| p > 0),
        "rewritten after the damaged one: {e}"
    );
}
