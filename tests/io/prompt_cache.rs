//! The prompt cache on disk: a state stored at the end of a prompt and loaded by a later
//! session gives the logits a fresh prefill gives, bit for bit (CPU and GPU); stale,
//! truncated and corrupt entries are refused and removed; concurrent readers all load the
//! same entry; the directory stays within its bound; `k3 run` shares it across processes.

use crate::support;

use k3::backend::gpu::GpuOptions;
use k3::backend::Backend;
use k3::model::prompt_cache::{entry_file, PromptCache, PromptCacheConfig};
use k3::model::{FormatPolicy, Runner, RuntimeSettings};
use k3::session::{DecodeOptions, Flow, Generation, Session, MAX_WINDOW};
use std::path::Path;
use std::process::Command;
use std::sync::Arc;

/// A prompt of `n` tokens the tiny model knows.
fn prompt(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i * 37 + salt * 11 + 5) % 1000)
        .collect()
}

fn cache(dir: &Path, identity: &str) -> PromptCache {
    PromptCache::open(
        PromptCacheConfig {
            dir: dir.to_path_buf(),
            max_bytes: 1 << 30,
            min_tokens: 8,
        },
        identity,
    )
    .unwrap()
}

/// Generates one token after `ids` in a fresh session with `chunk`: the generation and the
/// logits that token was picked from.
fn logits_after<B: Backend>(m: &Runner<B>, ids: &[u32], chunk: usize) -> (Generation, Vec<f32>) {
    let mut s = Session::with_max_window(m, chunk).unwrap();
    let mut seen = Vec::new();
    let g = s
        .generate(
            ids,
            &DecodeOptions {
                max_tokens: 1,
                ..DecodeOptions::default()
            },
            &mut |l, _| {
                seen = l.to_vec();
                0
            },
            &mut |_| Ok(Flow::Continue),
        )
        .unwrap();
    (g, seen)
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// How a restored state's logits must match a fresh prefill's.
#[derive(Clone, Copy)]
enum Match {
    /// Bit for bit.
    Bits,
    /// Within the relative L2 error windows of another size already have on the GPU
    /// (`tests/gpu/gpu_model.rs`): a stored prefix cuts the prompt where a fresh prefill's one
    /// window does not.
    Within(f64),
}

fn check(got: &[f32], want: &[f32], how: Match, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    match how {
        Match::Bits => assert_eq!(bits(got), bits(want), "{what}"),
        Match::Within(tol) => {
            let e = support::rel_l2(got, want);
            assert!(e <= tol, "{what}: rel L2 {e:e} > {tol:e}");
        }
    }
}

/// Stores `p`, then checks that a prompt extending it loads it and gives a fresh
/// prefill's logits (as `how` says), and that `p` itself loads whole, bit for bit.
fn restore_matches_fresh<B: Backend>(m: &mut Runner<B>, chunk: usize, how: Match) {
    let dir = tempfile::tempdir().unwrap();
    with_cache(m, None);
    let (p, rest) = (prompt(24, 1), prompt(9, 2));
    let whole: Vec<u32> = p.iter().chain(&rest).copied().collect();
    let (fresh_p, l_p) = logits_after(m, &p, chunk);
    let (_, l_whole) = logits_after(m, &whole, chunk);
    assert_eq!(fresh_p.disk_cached_tokens, 0);

    with_cache(m, Some(cache(dir.path(), "restore")));
    let (stored, l_stored) = logits_after(m, &p, chunk);
    assert_eq!(stored.disk_cached_tokens, 0, "nothing was stored yet");
    assert_eq!(bits(&l_stored), bits(&l_p));
    m.rt.prompt_cache().unwrap().wait();
    assert!(m.rt.prompt_cache().unwrap().entry_path(&p).exists());

    let (g, l) = logits_after(m, &whole, chunk);
    assert_eq!((g.disk_cached_tokens, g.cached_tokens), (24, 24));
    assert_eq!(g.prefilled_tokens, 9);
    check(&l, &l_whole, how, "restored + suffix vs a fresh prefill");
    // The whole prompt was stored in turn; the stored prefix alone loads whole.
    m.rt.prompt_cache().unwrap().wait();
    let (g, l) = logits_after(m, &p, chunk);
    assert_eq!((g.disk_cached_tokens, g.prefilled_tokens), (24, 0));
    assert_eq!(bits(&l), bits(&l_p));
}

/// Gives `m` a runtime of serial streaming with the prompt cache `pc`.
fn with_cache<B: Backend>(m: &mut Runner<B>, pc: Option<PromptCache>) {
    support::new_runtime(
        m,
        RuntimeSettings {
            prompt_cache: pc.map(Arc::new),
            ..support::stream_settings(support::serial_stream())
        },
    );
}

#[test]
fn a_restored_state_gives_a_fresh_prefills_logits_on_the_cpu() {
    let mut m = support::cpu_model(
        &support::tiny(0),
        FormatPolicy::default(),
        support::serial_stream(),
    );
    // Windows of 5 tokens, and the default: the whole prompt in one window, layer-major,
    // where the restored run feeds only the suffix. The CPU gives the same bits either way,
    // which is why the prompt cache's key leaves the window out.
    restore_matches_fresh(&mut m, 5, Match::Bits);
    restore_matches_fresh(&mut m, MAX_WINDOW, Match::Bits);
}

#[test]
fn a_restored_state_gives_a_fresh_prefills_logits_on_the_gpu() {
    let Some(mut m) = support::gpu_model(
        &support::tiny(0),
        GpuOptions::default(),
        support::serial_stream(),
    ) else {
        return;
    };
    // The stored prefix is whole windows of 8, so both prefills cut the prompt alike.
    restore_matches_fresh(&mut m, 8, Match::Bits);
    // One window of the whole prompt against the stored prefix and a window of the rest.
    restore_matches_fresh(&mut m, MAX_WINDOW, Match::Within(1e-5));
}

/// One greedy token after `ids` in `s`, fed with a message boundary at `boundary`: the
/// generation and the logits the token was picked from.
fn logits_with_boundary<B: Backend>(
    s: &mut Session<'_, B>,
    ids: &[u32],
    boundary: usize,
) -> (Generation, Vec<f32>) {
    let mut seen = Vec::new();
    let g = s
        .generate(
            ids,
            &DecodeOptions {
                max_tokens: 1,
                boundaries: &[boundary],
                ..DecodeOptions::default()
            },
            &mut |l, _| {
                seen = l.to_vec();
                0
            },
            &mut |_| Ok(Flow::Continue),
        )
        .unwrap();
    (g, seen)
}

#[test]
fn a_shared_preamble_is_stored_at_its_boundary_and_a_new_session_loads_it() {
    let dir = tempfile::tempdir().unwrap();
    let mut m = support::cpu_model(
        &support::tiny(0),
        FormatPolicy::default(),
        support::serial_stream(),
    );
    let preamble = prompt(40, 3);
    let with =
        |salt: u32| -> Vec<u32> { preamble.iter().chain(&prompt(7, salt)).copied().collect() };
    let (a, b, c) = (with(4), with(5), with(6));
    let (_, fresh_b) = logits_after(&m, &b, MAX_WINDOW);
    let (_, fresh_c) = logits_after(&m, &c, MAX_WINDOW);

    with_cache(&mut m, Some(cache(dir.path(), "boundaries")));
    // The first session stores the preamble's state and its whole prompt's.
    let mut s = Session::new(&m).unwrap();
    let (g, _) = logits_with_boundary(&mut s, &a, preamble.len());
    assert_eq!((g.cached_tokens, g.prefilled_tokens), (0, a.len()));
    let pc = m.rt.prompt_cache().unwrap();
    pc.wait();
    assert!(pc.entry_path(&preamble).exists(), "the boundary's entry");
    assert!(pc.entry_path(&a).exists(), "the prompt's end");

    // A new session (as after a restart: nothing in RAM) with another first message
    // loads the preamble and prefills only its own message, with a fresh prefill's bits.
    let mut s = Session::new(&m).unwrap();
    let (g, l) = logits_with_boundary(&mut s, &b, preamble.len());
    assert_eq!(g.disk_cached_tokens, preamble.len());
    assert_eq!(g.prefilled_tokens, b.len() - preamble.len());
    assert_eq!(bits(&l), bits(&fresh_b));

    // The same session switching to a third conversation returns to the preamble's
    // snapshot in RAM once snapshots are on.
    with_cache(&mut m, None);
    let mut s = Session::new(&m).unwrap();
    s.set_snapshot_limits(k3::session::SnapshotLimits {
        count: 4,
        bytes: 4 * (m.snapshot_bytes() + m.vocab_size() * 4),
    });
    let (g, _) = logits_with_boundary(&mut s, &b, preamble.len());
    assert_eq!(g.cached_tokens, 0);
    let (g, l) = logits_with_boundary(&mut s, &c, preamble.len());
    assert_eq!((g.cached_tokens, g.disk_cached_tokens), (preamble.len(), 0));
    assert_eq!(bits(&l), bits(&fresh_c));
}

/// A CPU model with a prompt cache in `dir`, and an entry of `p` stored there.
fn stored(dir: &Path, p: &[u32]) -> (Runner<k3::backend::cpu::CpuBackend>, std::path::PathBuf) {
    let mut m = support::cpu_model(
        &support::tiny(0),
        FormatPolicy::default(),
        support::serial_stream(),
    );
    with_cache(&mut m, Some(cache(dir, "faults")));
    logits_after(&m, p, 32);
    let pc = m.rt.prompt_cache().unwrap();
    pc.wait();
    let path = pc.entry_path(p);
    assert!(path.exists());
    (m, path)
}

#[test]
fn stale_truncated_and_corrupt_entries_are_refused_removed_and_prefilled_instead() {
    let dir = tempfile::tempdir().unwrap();
    let p = prompt(20, 3);
    let (m, path) = stored(dir.path(), &p);
    let good = std::fs::read(&path).unwrap();
    let (_, want) = {
        let plain = support::cpu_model(
            &support::tiny(0),
            FormatPolicy::default(),
            support::serial_stream(),
        );
        logits_after(&plain, &p, 32)
    };
    let mut damaged: Vec<(&str, Vec<u8>)> = Vec::new();
    let mut flipped = good.clone();
    let at = good.len() - 10;
    flipped[at] ^= 0x40;
    damaged.push(("a flipped bit in the last layer", flipped));
    damaged.push(("cut in half", good[..good.len() / 2].to_vec()));
    damaged.push(("cut at the end", good[..good.len() - 1].to_vec()));
    let mut version = good.clone();
    version[8] = 99;
    damaged.push(("another layout version", version));
    let mut longer = good.clone();
    longer.push(0);
    damaged.push(("a byte too many", longer));
    for (what, bytes) in damaged {
        std::fs::write(&path, &bytes).unwrap();
        let (g, l) = logits_after(&m, &p, 32);
        assert_eq!(
            g.disk_cached_tokens, 0,
            "{what}: a damaged entry was loaded"
        );
        assert_eq!(bits(&l), bits(&want), "{what}");
        // It was removed, then this run stored a good one again.
        m.rt.prompt_cache().unwrap().wait();
        assert_eq!(std::fs::read(&path).unwrap(), good, "{what}");
    }
    // The same file under another model's key is refused as stale.
    let other = cache(dir.path(), "another model");
    let moved = other.entry_path(&p);
    std::fs::copy(&path, &moved).unwrap();
    assert!(other.lookup(&p, 0, &m.state_shape()).is_none());
    assert!(!moved.exists(), "a stale entry was kept");
}

/// An entry's bytes: header `h`, then `parts` (tokens, logits, layers), each with its
/// length and checksum, as a writer that trusted its header would leave them.
fn entry_bytes(h: &entry_file::Header, parts: &[Vec<u8>]) -> Vec<u8> {
    let mut out = entry_file::MAGIC.to_vec();
    out.extend(entry_file::VERSION.to_le_bytes());
    let header = serde_json::to_vec(h).unwrap();
    for p in std::iter::once(&header).chain(parts) {
        out.extend((p.len() as u64).to_le_bytes());
        out.extend(xxhash_rust::xxh3::xxh3_64(p).to_le_bytes());
        out.extend(p);
    }
    out
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

#[test]
fn entries_that_do_not_fit_the_model_are_refused_removed_and_prefilled_instead() {
    let dir = tempfile::tempdir().unwrap();
    let p = prompt(20, 12);
    let (m, path) = stored(dir.path(), &p);
    let key = m.rt.prompt_cache().unwrap().key();
    let good = std::fs::read(&path).unwrap();
    let e = {
        let mut r = good.as_slice();
        let h = entry_file::read_header(&mut r, key, p.len()).unwrap();
        entry_file::read_body(&mut r, &h, &p).unwrap()
    };
    let (_, want) = logits_after(
        &support::cpu_model(
            &support::tiny(0),
            FormatPolicy::default(),
            support::serial_stream(),
        ),
        &p,
        32,
    );
    let tokens: Vec<u8> = p.iter().flat_map(|t| t.to_le_bytes()).collect();
    let layers: Vec<Vec<u8>> = e
        .state
        .layers
        .iter()
        .map(|l| f32_bytes(l.values()))
        .collect();
    // Every case: a header whose checksums all match, with logits and layers as given.
    let case = |vocab: usize, logits: Vec<u8>, layers: Vec<Vec<u8>>, sizes: Vec<(bool, usize)>| {
        let h = entry_file::Header {
            model_key: key,
            tokens: p.len(),
            vocab,
            layers: sizes,
        };
        let mut parts = vec![tokens.clone(), logits];
        parts.extend(layers);
        entry_bytes(&h, &parts)
    };
    let sizes = e.header(key).layers;
    let mut cases: Vec<(&str, Vec<u8>, &str)> = vec![
        (
            "vocab 0",
            case(0, Vec::new(), layers.clone(), sizes.clone()),
            "a vocabulary of 0",
        ),
        (
            "a small vocab",
            case(5, f32_bytes(&e.logits[..5]), layers.clone(), sizes.clone()),
            "a vocabulary of 5",
        ),
        (
            // vocab * 4 wraps to 4 bytes: one logit.
            "a vocab whose bytes wrap",
            case(
                usize::MAX / 4 + 2,
                f32_bytes(&e.logits[..1]),
                layers.clone(),
                sizes.clone(),
            ),
            "a vocabulary of 4611686018427387905",
        ),
    ];
    let mut nan_logits = e.logits.clone();
    nan_logits[3] = f32::NAN;
    cases.push((
        "a NaN logit",
        case(
            e.logits.len(),
            f32_bytes(&nan_logits),
            layers.clone(),
            sizes.clone(),
        ),
        "the logit part holds NaN at value 3",
    ));
    for (i, l) in e.state.layers.iter().enumerate() {
        let mut v = l.values().to_vec();
        v[1] = if i % 2 == 0 { f32::NAN } else { f32::INFINITY };
        let mut bad = layers.clone();
        bad[i] = f32_bytes(&v);
        cases.push((
            "a non-finite state value",
            case(e.logits.len(), f32_bytes(&e.logits), bad, sizes.clone()),
            "at value 1",
        ));
    }
    // A layer of another size, its header agreeing with it.
    let mut short = layers.clone();
    let n = short[0].len() - 4;
    short[0].truncate(n);
    let mut short_sizes = sizes.clone();
    short_sizes[0].1 -= 1;
    cases.push((
        "a layer one value short",
        case(e.logits.len(), f32_bytes(&e.logits), short, short_sizes),
        "layer 0 is a",
    ));
    let shape = m.state_shape();
    for (what, bytes, words) in cases {
        // The check names what is wrong.
        let mut r = bytes.as_slice();
        let err = entry_file::read_header(&mut r, key, p.len())
            .and_then(|h| entry_file::check_shape(&h, &shape).map(|_| h))
            .and_then(|h| entry_file::read_body(&mut r, &h, &p))
            .unwrap_err();
        let err = format!("{err:#}");
        assert!(
            err.starts_with("corrupt:") && err.contains(words),
            "{what}: {err}"
        );
        // A session never loads it: it prefills, removes the entry and stores a good one.
        std::fs::write(&path, &bytes).unwrap();
        let (g, l) = logits_after(&m, &p, 32);
        assert_eq!(g.disk_cached_tokens, 0, "{what}: the entry was loaded");
        assert_eq!(bits(&l), bits(&want), "{what}");
        m.rt.prompt_cache().unwrap().wait();
        assert_eq!(std::fs::read(&path).unwrap(), good, "{what}: not replaced");
    }
}

#[test]
fn the_entry_checks_name_what_is_wrong() {
    let dir = tempfile::tempdir().unwrap();
    let p = prompt(12, 4);
    let (m, path) = stored(dir.path(), &p);
    let key = m.rt.prompt_cache().unwrap().key();
    let good = std::fs::read(&path).unwrap();
    let check = |bytes: &[u8], key: u64| -> String {
        let mut r = bytes;
        let r = entry_file::read_header(&mut r, key, p.len())
            .and_then(|h| entry_file::read_body(&mut r, &h, &p));
        format!("{:#}", r.unwrap_err())
    };
    assert!(check(&good, key ^ 1).starts_with("stale: written for model key"));
    assert!(check(&good[..good.len() - 4], key).starts_with("truncated: the layer"));
    let mut bad = good.clone();
    bad[30] ^= 1;
    let e = check(&bad, key);
    assert!(e.starts_with("corrupt:") && e.contains("checksum"), "{e}");
    assert!(check(b"not an entry at all", key).starts_with("corrupt: not a k3"));
    let mut r = good.as_slice();
    let h = entry_file::read_header(&mut r, key, p.len()).unwrap();
    let e = format!(
        "{:#}",
        entry_file::read_body(&mut r, &h, &prompt(12, 5)).unwrap_err()
    );
    assert!(e.starts_with("stale: its tokens differ"), "{e}");
}

#[test]
fn concurrent_readers_all_load_the_same_entry() {
    let dir = tempfile::tempdir().unwrap();
    let p = prompt(30, 6);
    let (m, _) = stored(dir.path(), &p);
    let pc = m.rt.prompt_cache().unwrap();
    let shape = m.state_shape();
    let want = pc.lookup(&p, 0, &shape).unwrap();
    std::thread::scope(|s| {
        let readers: Vec<_> = (0..6)
            .map(|_| s.spawn(|| pc.lookup(&p, 0, &shape)))
            .collect();
        for r in readers {
            assert_eq!(r.join().unwrap().as_ref(), Some(&want));
        }
    });
}

#[test]
fn the_directory_keeps_within_its_bound_least_recently_used_out() {
    let dir = tempfile::tempdir().unwrap();
    let (p1, p2, p3) = (prompt(16, 7), prompt(16, 8), prompt(16, 9));
    let (mut m, path1) = stored(dir.path(), &p1);
    let one = std::fs::metadata(&path1).unwrap().len();
    // Room for two entries of this size.
    let pc = PromptCache::open(
        PromptCacheConfig {
            dir: dir.path().to_path_buf(),
            max_bytes: 2 * one + one / 2,
            min_tokens: 8,
        },
        "faults",
    )
    .unwrap();
    with_cache(&mut m, Some(pc));
    std::thread::sleep(std::time::Duration::from_millis(20));
    logits_after(&m, &p2, 32);
    m.rt.prompt_cache().unwrap().wait();
    // A hit makes p1 the most recently used: p2 goes first.
    std::thread::sleep(std::time::Duration::from_millis(20));
    assert!(m
        .rt
        .prompt_cache()
        .unwrap()
        .lookup(&p1, 0, &m.state_shape())
        .is_some());
    std::thread::sleep(std::time::Duration::from_millis(20));
    logits_after(&m, &p3, 32);
    let pc = m.rt.prompt_cache().unwrap();
    pc.wait();
    assert!(pc.entry_path(&p1).exists());
    assert!(
        !pc.entry_path(&p2).exists(),
        "the least recently used entry was kept"
    );
    assert!(pc.entry_path(&p3).exists());
}

#[test]
fn an_entry_larger_than_the_bound_is_not_stored() {
    let dir = tempfile::tempdir().unwrap();
    let mut m = support::cpu_model(
        &support::tiny(0),
        FormatPolicy::default(),
        support::serial_stream(),
    );
    let pc = PromptCache::open(
        PromptCacheConfig {
            dir: dir.path().to_path_buf(),
            max_bytes: 1000,
            min_tokens: 8,
        },
        "small",
    )
    .unwrap();
    with_cache(&mut m, Some(pc));
    logits_after(&m, &prompt(16, 10), 32);
    m.rt.prompt_cache().unwrap().wait();
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
}

/// Sets the modification time of `path` to `ago` before now.
#[cfg(unix)]
fn age(path: &Path, ago: std::time::Duration) {
    let f = std::fs::File::options().write(true).open(path).unwrap();
    f.set_modified(std::time::SystemTime::now() - ago).unwrap();
}

#[cfg(unix)]
#[test]
fn the_bound_counts_entries_being_written_and_removes_abandoned_ones() {
    let dir = tempfile::tempdir().unwrap();
    let (p1, p2) = (prompt(16, 12), prompt(16, 13));
    let (mut m, path1) = stored(dir.path(), &p1);
    let one = std::fs::metadata(&path1).unwrap().len();
    let pc = PromptCache::open(
        PromptCacheConfig {
            dir: dir.path().to_path_buf(),
            max_bytes: 2 * one + one / 2,
            min_tokens: 8,
        },
        "faults",
    )
    .unwrap();
    // Another process (alive: this test's parent) writes an entry of the same size.
    let writer = std::os::unix::process::parent_id();
    let live = pc
        .entry_path(&prompt(16, 14))
        .with_extension(format!("k3pc.{writer}.0000000a.partial"));
    std::fs::write(&live, vec![0u8; one as usize]).unwrap();
    // A writer that is gone (no process has this PID) left one ten minutes ago and more.
    let dead = pc
        .entry_path(&prompt(16, 15))
        .with_extension("k3pc.4000000000.0000000b.partial");
    std::fs::write(&dead, vec![0u8; one as usize]).unwrap();
    age(&dead, k3::atomic_file::DEAD_WRITER_GRACE * 2);
    with_cache(&mut m, Some(pc));
    logits_after(&m, &p2, 32);
    let pc = m.rt.prompt_cache().unwrap();
    pc.wait();
    assert!(!dead.exists(), "an abandoned temporary was kept");
    assert!(live.exists(), "a live writer's temporary was removed");
    assert!(pc.entry_path(&p2).exists());
    assert!(
        !path1.exists(),
        "the entry being written was not counted against the bound"
    );
}

#[cfg(unix)]
#[test]
fn a_fifo_at_an_entrys_old_temporary_name_does_not_hang_the_store() {
    let dir = tempfile::tempdir().unwrap();
    let p = prompt(16, 16);
    let entry = cache(dir.path(), "faults").entry_path(&p);
    let name = entry.file_name().unwrap().to_str().unwrap();
    let fifo = entry.with_file_name(format!("{name}.partial"));
    assert!(Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap()
        .success());
    let (tx, rx) = std::sync::mpsc::channel();
    let d = dir.path().to_path_buf();
    std::thread::spawn(move || {
        let _ = tx.send(stored(&d, &p).1);
    });
    let path = rx
        .recv_timeout(std::time::Duration::from_secs(60))
        .expect("storing an entry beside a FIFO did not end");
    assert_eq!(path, entry);
    use std::os::unix::fs::FileTypeExt;
    assert!(std::fs::symlink_metadata(&fifo)
        .unwrap()
        .file_type()
        .is_fifo());
}

#[test]
fn a_directory_named_like_an_entry_is_skipped_not_claimed_removed() {
    let dir = tempfile::tempdir().unwrap();
    let ids: Vec<String> = prompt(300, 17).iter().map(u32::to_string).collect();
    let ids = ids.join(",");
    let model = support::tiny(0);
    let args = [
        "run",
        model.to_str().unwrap(),
        "--ids",
        &ids,
        "--ngen",
        "2",
        "--quiet",
        "--no-weight-cache",
        "--prompt-cache",
        dir.path().to_str().unwrap(),
    ];
    let (cold, _) = k3(&args);
    let entry = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|x| x == "k3pc"))
        .expect("the first run stored an entry");
    std::fs::remove_file(&entry).unwrap();
    std::fs::create_dir(&entry).unwrap();
    let (again, err) = k3(&args);
    assert_eq!(again, cold);
    assert!(
        !err.contains("removed") && !err.contains("loaded 300"),
        "{err}"
    );
    assert!(entry.is_dir(), "a directory k3 did not make was removed");
}

fn k3(args: &[&str]) -> (String, String) {
    k3_with(args, &[])
}

/// [`k3`] with the environment variables `env` set.
fn k3_with(args: &[&str], env: &[(&str, &str)]) -> (String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_k3"))
        .args(args)
        .envs(env.iter().copied())
        .env("RAYON_NUM_THREADS", "2")
        .env_remove("K3_EXPERT_GB")
        .env_remove("K3_MAXT")
        .env_remove("K3_NO_PROMPT_CACHE")
        .env_remove("K3_PROMPT_CACHE")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{err}");
    (String::from_utf8_lossy(&out.stdout).into_owned(), err)
}

#[test]
fn a_second_run_loads_the_first_runs_prompt_and_prints_the_same_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let ids: Vec<String> = prompt(300, 11).iter().map(u32::to_string).collect();
    let ids = ids.join(",");
    let model = support::tiny(0);
    let args = [
        "run",
        model.to_str().unwrap(),
        "--ids",
        &ids,
        "--ngen",
        "4",
        "--quiet",
        "--no-weight-cache",
        "--prompt-cache",
        dir.path().to_str().unwrap(),
    ];
    let (cold, err) = k3(&args);
    assert!(
        err.contains("[K3] prompt cache: stored 300 tokens"),
        "{err}"
    );
    let (warm, err) = k3(&args);
    assert_eq!(warm, cold);
    assert!(
        err.contains("[K3] prompt cache: loaded 300 of 300 prompt tokens")
            && err.contains("300 of 300 prompt tokens loaded, 0 prefilled"),
        "{err}"
    );
    let mut off = args.to_vec();
    off.push("--no-prompt-cache");
    let (plain, err) = k3(&off);
    assert_eq!(plain, cold);
    assert!(
        err.contains("[K3] prompt cache: off") && !err.contains("prompt tokens loaded"),
        "{err}"
    );
}

#[test]
fn another_cpu_kernel_set_or_a_shard_rewritten_in_place_is_another_key() {
    let dir = tempfile::tempdir().unwrap();
    let ids: Vec<String> = prompt(300, 13).iter().map(u32::to_string).collect();
    let ids = ids.join(",");
    let model = support::copy_dir(&support::tiny(0));
    let args = [
        "run",
        model.path().to_str().unwrap(),
        "--ids",
        &ids,
        "--ngen",
        "2",
        "--quiet",
        "--no-weight-cache",
        "--prompt-cache",
        dir.path().to_str().unwrap(),
    ];
    let loaded = |err: &str| err.contains("prompt tokens loaded");
    let (_, err) = k3_with(&args, &[("K3_SIMD", "auto")]);
    assert!(err.contains("prompt cache: stored 300 tokens"), "{err}");
    let (_, err) = k3_with(&args, &[("K3_SIMD", "auto")]);
    assert!(loaded(&err), "{err}");
    // The portable kernels give other bits than the detected ones: not this state.
    if k3::quant::simd::SimdLevel::detect().name() != "portable" {
        let (_, err) = k3_with(&args, &[("K3_SIMD", "portable")]);
        assert!(!loaded(&err), "another kernel set loaded the entry: {err}");
    }
    // A shard rewritten in place with its modification time set back: other weights.
    let embed = format!(
        "{}model.embed_tokens.weight",
        k3::checkpoint::schema::LANGUAGE_MODEL_PREFIX
    );
    let shard = support::tiny_ckpt::shard_holding(model.path(), &embed);
    let was = std::fs::metadata(&shard).unwrap().modified().unwrap();
    let bytes = std::fs::read(&shard).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(20));
    std::fs::write(&shard, &bytes).unwrap();
    std::fs::File::options()
        .write(true)
        .open(&shard)
        .unwrap()
        .set_modified(was)
        .unwrap();
    let (_, err) = k3_with(&args, &[("K3_SIMD", "auto")]);
    assert!(
        !loaded(&err),
        "the entry of the old shard was loaded: {err}"
    );
}

/// Runs `k3 run` on `model` with `flag` and checks that it is refused with `want`, before
/// the load: no backend was started for it.
fn refused_before_load(model: &Path, flag: &str, want: &str) {
    let out = Command::new(env!("CARGO_BIN_EXE_k3"))
        .args([
            "run",
            model.to_str().unwrap(),
            "--ids",
            "5,6",
            "--ngen",
            "1",
        ])
        .args(["--quiet", "--no-weight-cache", flag])
        .env("RAYON_NUM_THREADS", "2")
        .env_remove("K3_NO_PROMPT_CACHE")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{flag}: {err}");
    assert!(err.contains(want), "{flag}: {err}");
    assert!(
        !err.contains("[K3] backend:"),
        "{flag}: refused after the load: {err}"
    );
}

#[test]
fn a_bad_prompt_cache_bound_is_refused_naming_the_flag() {
    let model = support::tiny(0);
    for bad in ["-1", "NaN", "inf"] {
        refused_before_load(
            &model,
            &format!("--prompt-cache-gb={bad}"),
            "--prompt-cache-gb / K3_PROMPT_CACHE_GB must be a number of GB >= 0",
        );
    }
}

#[test]
fn bad_engine_flags_are_refused_before_the_model_loads() {
    let model = support::tiny(0);
    refused_before_load(
        &model,
        "--expert-gb=-1",
        "K3_EXPERT_GB / --expert-gb must be a number of GB >= 0",
    );
    refused_before_load(
        &model,
        "--expert-top-p=2",
        "--expert-top-p / K3_TOPP must be a share between 0 and 1",
    );
}
