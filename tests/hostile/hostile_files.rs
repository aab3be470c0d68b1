//! Every file k3 reads, replaced by each kind of special file (a FIFO, a symlink to
//! `/dev/zero` and to `/dev/urandom`, a directory, a socket): each load ends at once with an
//! error naming the file and what it is, instead of hanging on the FIFO or reading the device
//! until memory runs out. Run as a table: one row per (file, special kind).

#![cfg(unix)]

use crate::support;

use k3::checkpoint::Checkpoint;
use k3::config::Config;
use k3::experts::cache::usage_history::UsageHistory;
use k3::experts::telemetry::route_trace::RouteTrace;
use k3::model::weight_cache::{file_name, WeightCache, WeightCacheSetting};
use k3::model::FormatPolicy;
use k3::tokenizer::Tokenizer;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::Duration;

/// A special file to put where k3 expects a regular one, and the words that name it.
#[derive(Clone, Copy, Debug)]
enum Special {
    Fifo,
    DevZero,
    DevUrandom,
    Directory,
    Socket,
}

const SPECIALS: [Special; 5] = [
    Special::Fifo,
    Special::DevZero,
    Special::DevUrandom,
    Special::Directory,
    Special::Socket,
];

impl Special {
    /// What the error calls it.
    fn named(self) -> &'static str {
        match self {
            Special::Fifo => "is a FIFO",
            Special::DevZero | Special::DevUrandom => "is a device",
            Special::Directory => "is a directory",
            Special::Socket => "is a socket",
        }
    }

    /// Replaces whatever is at `path` by this special file.
    fn put(self, path: &Path) {
        let _ = std::fs::remove_file(path);
        match self {
            Special::Fifo => {
                let ok = std::process::Command::new("mkfifo")
                    .arg(path)
                    .status()
                    .unwrap()
                    .success();
                assert!(ok, "mkfifo {}", path.display());
            }
            Special::DevZero => std::os::unix::fs::symlink("/dev/zero", path).unwrap(),
            Special::DevUrandom => std::os::unix::fs::symlink("/dev/urandom", path).unwrap(),
            Special::Directory => std::fs::create_dir(path).unwrap(),
            Special::Socket => {
                // The listener is dropped; the socket file stays.
                std::os::unix::net::UnixListener::bind(path).unwrap();
            }
        }
    }
}

/// Runs `load` on a thread and returns its error text; a load that does not end within the
/// limit is the hang this file guards against.
fn error_within_limit(what: &str, load: impl FnOnce() -> String + Send + 'static) -> String {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(load());
    });
    rx.recv_timeout(Duration::from_secs(30))
        .unwrap_or_else(|_| panic!("{what}: the load hung"))
}

fn err_of<T>(r: anyhow::Result<T>) -> String {
    match r {
        Ok(_) => "loaded".to_string(),
        Err(e) => format!("{e:#}"),
    }
}

/// A copy of the tiny snapshot.
fn snapshot() -> tempfile::TempDir {
    support::copy_dir(&support::tiny(0))
}

fn first_shard(dir: &Path) -> PathBuf {
    let mut shards: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    shards.sort();
    shards.remove(0)
}

/// Where in a snapshot a row's file is.
type Target = fn(&Path) -> PathBuf;

/// One row: the file `name` in a fresh snapshot replaced by `special`, loaded by `load`.
fn row(
    file: &str,
    special: Special,
    target: impl FnOnce(&Path) -> PathBuf,
    load: impl FnOnce(PathBuf) -> String + Send + 'static,
) {
    let snap = snapshot();
    let path = target(snap.path());
    special.put(&path);
    let root = snap.path().to_path_buf();
    let e = error_within_limit(&format!("{file} as {special:?}"), move || load(root));
    let shown = path.file_name().unwrap().to_string_lossy().to_string();
    assert!(
        e.contains(&shown) && e.contains(special.named()) && e.contains("not a regular file"),
        "{file} as {special:?}: {e}"
    );
    assert!(
        !e.contains("has no"),
        "{file} as {special:?} called missing: {e}"
    );
    drop(snap);
}

#[test]
fn snapshot_files_replaced_by_special_files_are_named_as_what_they_are() {
    let cases: [(&str, Target); 5] = [
        ("config.json", |d| d.join("config.json")),
        ("index", |d| d.join(k3::checkpoint::shards::INDEX_FILE)),
        ("shard", first_shard),
        ("tiktoken.model", |d| d.join("tiktoken.model")),
        ("tokenizer_config.json", |d| d.join("tokenizer_config.json")),
    ];
    for (file, target) in cases {
        for special in SPECIALS {
            let tokenizer = file.starts_with("tok") || file.starts_with("tik");
            row(file, special, target, move |dir| {
                if tokenizer {
                    err_of(Tokenizer::from_dir(&dir))
                } else {
                    err_of(Checkpoint::open(&dir, &[]))
                }
            });
        }
    }
    // config.json read alone, as `k3 inspect` does first.
    for special in SPECIALS {
        row(
            "config.json",
            special,
            |d| d.join("config.json"),
            |d| err_of(Config::from_file(&d.join("config.json"))),
        );
    }
}

#[test]
fn a_special_file_as_tokenizer_json_is_named_as_what_it_is() {
    for special in SPECIALS {
        let snap = snapshot();
        std::fs::remove_file(snap.path().join("tiktoken.model")).unwrap();
        let json = snap.path().join("tokenizer.json");
        special.put(&json);
        let dir = snap.path().to_path_buf();
        let e = error_within_limit("tokenizer.json", move || err_of(Tokenizer::from_dir(&dir)));
        assert!(
            e.contains("tokenizer.json") && e.contains(special.named()),
            "{special:?}: {e}"
        );
    }
}

#[test]
fn a_special_file_as_the_weight_cache_is_reported_and_never_read() {
    for special in SPECIALS {
        let snap = support::tiny(0);
        let cache = tempfile::tempdir().unwrap();
        let name = file_name(&FormatPolicy::default());
        special.put(&cache.path().join(&name));
        let dir = cache.path().to_path_buf();
        let words = error_within_limit("weight cache", move || {
            let ck = Checkpoint::open(&snap, &[]).unwrap();
            let c = WeightCache::open(
                &ck,
                &FormatPolicy::default(),
                &WeightCacheSetting::Dirs(vec![dir]),
            );
            c.finish().0
        });
        assert!(
            words.contains(&name)
                && words
                    .to_lowercase()
                    .contains(&special.named().to_lowercase()),
            "{special:?}: {words}"
        );
    }
}

#[test]
fn a_special_file_as_usage_history_or_route_trace_is_named() {
    for special in SPECIALS {
        let dir = tempfile::tempdir().unwrap();
        let usage = dir.path().join(".k3_usage");
        special.put(&usage);
        let e = error_within_limit("usage history", move || {
            err_of(UsageHistory::load(&usage, 4, 8))
        });
        assert!(
            e.contains(".k3_usage") && e.contains(special.named()) && e.contains("usage history"),
            "{special:?}: {e}"
        );
        let trace = dir.path().join("routes.jsonl");
        special.put(&trace);
        let e = error_within_limit("route trace", move || err_of(RouteTrace::read(&trace)));
        assert!(
            e.contains("routes.jsonl") && e.contains(special.named()) && e.contains("route trace"),
            "{special:?}: {e}"
        );
    }
}

/// `k3 run` on `model` (its weight cache in the snapshot), ended within the limit: stderr.
fn run_within_limit(what: &str, model: &Path) -> String {
    let model = model.to_path_buf();
    error_within_limit(what, move || {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_k3"))
            .args([
                "run",
                model.to_str().unwrap(),
                "--ids",
                "768,5,300",
                "--ngen",
                "2",
                "--quiet",
            ])
            .env("RAYON_NUM_THREADS", "2")
            .env_remove("K3_NO_WEIGHT_CACHE")
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(out.status.success(), "{err}");
        err
    })
}

/// The weight cache's file name at the default formats, which these runs load in.
fn cache_file() -> String {
    file_name(&FormatPolicy::default())
}

#[test]
fn a_fifo_or_symlink_at_the_weight_caches_old_temporary_name_is_never_opened() {
    let snap = snapshot();
    let partial = snap.path().join(format!("{}.partial", cache_file()));
    Special::Fifo.put(&partial);
    let err = run_within_limit("a start beside a FIFO", snap.path());
    assert!(err.contains("weight cache: built"), "{err}");
    use std::os::unix::fs::FileTypeExt;
    assert!(std::fs::symlink_metadata(&partial)
        .unwrap()
        .file_type()
        .is_fifo());

    let snap = snapshot();
    let outside = tempfile::tempdir().unwrap();
    let victim = outside.path().join("victim");
    std::fs::write(&victim, b"keep me").unwrap();
    let partial = snap.path().join(format!("{}.partial", cache_file()));
    std::os::unix::fs::symlink(&victim, &partial).unwrap();
    let err = run_within_limit("a start beside a symlink", snap.path());
    assert!(err.contains("weight cache: built"), "{err}");
    assert_eq!(
        std::fs::read(&victim).unwrap(),
        b"keep me",
        "written through the link"
    );
    assert!(snap.path().join(cache_file()).is_file());
}

#[test]
fn temporaries_killed_writers_left_go_when_the_weight_cache_is_used() {
    let snap = snapshot();
    let err = run_within_limit("the first start", snap.path());
    assert!(err.contains("weight cache: built"), "{err}");
    let old = |name: String, ago| {
        let p = snap.path().join(name);
        std::fs::write(&p, b"cut short").unwrap();
        let f = std::fs::File::options().write(true).open(&p).unwrap();
        f.set_modified(std::time::SystemTime::now() - ago).unwrap();
        p
    };
    let grace = k3::atomic_file::DEAD_WRITER_GRACE * 2;
    // No process has this PID; the older fixed name carries none.
    let dead = old(
        format!("{}.4000000000.0000000c.partial", cache_file()),
        grace,
    );
    let legacy = old(
        format!("{}.partial", cache_file()),
        k3::atomic_file::UNKNOWN_WRITER_AGE * 2,
    );
    let fresh = old(
        format!("{}.4000000000.0000000d.partial", cache_file()),
        Duration::ZERO,
    );
    let err = run_within_limit("a start on the cache", snap.path());
    assert!(
        !err.contains("weight cache: built"),
        "the cache was rebuilt: {err}"
    );
    assert!(!dead.exists() && !legacy.exists(), "leftovers were kept");
    assert!(
        fresh.exists(),
        "a temporary written moments ago was removed"
    );
}
