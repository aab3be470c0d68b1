//! The prompt cache on disk: the state at the end of a prompt (every KDA state, every MLA
//! cache up to its last token, and the logits after it), kept under a key of the model's
//! identity and the token prefix, so a later request or process whose prompt starts with a
//! stored prefix loads the longest one and prefills only the rest. `k3 run`, `k3 chat` and
//! `k3 serve` share it through the runtime ([`crate::model::RuntimeSettings::prompt_cache`]).
//!
//! An entry is one file, `{model key}-{tokens}-{prefix hash}.k3pc`, written through
//! [`AtomicFile`] on a background thread (the state is copied to the host first), each part
//! checksummed ([`entry_file`]). A stale, truncated or corrupt entry is reported, removed
//! and never loaded; a full disk or an unwritable directory is a warning and the run goes
//! on. The directory is bounded in bytes: storing an entry removes the least recently used
//! ones (by modification time, which a hit refreshes) until it fits, counting the
//! temporaries of entries other writers are writing and removing those whose writer is
//! gone. A directory under an entry's name is skipped, never loaded nor removed.

pub mod entry_file;

use crate::atomic_file::{self, AtomicFile};
use crate::platform::input_file::{self, FileKind};
use anyhow::{Context, Result};
use entry_file::{Entry, StateShape};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::thread::JoinHandle;
use std::time::{Instant, SystemTime};
use xxhash_rust::xxh3::xxh3_64;

/// The extension of an entry's file.
pub const EXTENSION: &str = "k3pc";
/// Prompts shorter than this are not stored: the session's own prefix reuse serves short
/// conversations, and an agent's preamble is thousands of tokens.
pub const MIN_TOKENS: usize = 256;

/// Where the cache lives and how much it may hold.
#[derive(Clone, Debug, PartialEq)]
pub struct PromptCacheConfig {
    /// The directory of the entries.
    pub dir: PathBuf,
    /// Bytes the entries may take together.
    pub max_bytes: u64,
    /// Prompts shorter than this many tokens are not stored.
    pub min_tokens: usize,
}

/// An entry file found in the directory.
#[derive(Clone, Debug)]
struct Found {
    path: PathBuf,
    tokens: usize,
    hash: u64,
}

/// The prompt cache of one model and its settings.
pub struct PromptCache {
    cfg: PromptCacheConfig,
    key: u64,
    /// The entry being written, if any; a new write waits for it.
    writer: Mutex<Option<JoinHandle<()>>>,
}

/// The hash of a token prefix in its entry's name.
fn prefix_hash(tokens: &[u32]) -> u64 {
    xxh3_64(bytemuck::cast_slice(tokens))
}

impl PromptCache {
    /// The cache in `cfg.dir` (created when missing) for the model and settings `identity`
    /// names (the weight-cache stamp, the backend, anything else that changes the state).
    pub fn open(cfg: PromptCacheConfig, identity: &str) -> Result<Self> {
        std::fs::create_dir_all(&cfg.dir).with_context(|| {
            format!("creating the prompt cache directory {}", cfg.dir.display())
        })?;
        Ok(Self {
            key: xxh3_64(identity.as_bytes()),
            cfg,
            writer: Mutex::new(None),
        })
    }

    /// The key of the model and settings: the first part of every entry's name.
    pub fn key(&self) -> u64 {
        self.key
    }

    /// Bytes the entries may take together (`--prompt-cache-gb`).
    pub fn max_bytes(&self) -> u64 {
        self.cfg.max_bytes
    }

    /// The directory of the entries.
    pub fn dir(&self) -> &Path {
        &self.cfg.dir
    }

    /// Where the entry of `tokens` lives.
    pub fn entry_path(&self, tokens: &[u32]) -> PathBuf {
        self.cfg.dir.join(format!(
            "{:016x}-{}-{:016x}.{EXTENSION}",
            self.key,
            tokens.len(),
            prefix_hash(tokens)
        ))
    }

    /// This model's entries in the directory (unreadable names are skipped).
    fn entries(&self) -> Vec<Found> {
        let Ok(rd) = std::fs::read_dir(&self.cfg.dir) else {
            return Vec::new();
        };
        let want = format!("{:016x}", self.key);
        rd.filter_map(|e| {
            let e = e.ok()?;
            // A directory under an entry's name is not an entry, and is not k3's to remove.
            if e.file_type().ok()?.is_dir() {
                return None;
            }
            let name = e.file_name();
            let stem = name.to_str()?.strip_suffix(&format!(".{EXTENSION}"))?;
            let mut it = stem.split('-');
            if it.next()? != want {
                return None;
            }
            let tokens = it.next()?.parse().ok()?;
            let hash = u64::from_str_radix(it.next()?, 16).ok()?;
            Some(Found {
                path: e.path(),
                tokens,
                hash,
            })
        })
        .collect()
    }

    /// The longest stored prefix of `prompt` longer than `beyond` tokens, loaded and
    /// checked against `shape` (the model's vocabulary and layer states) and for finite
    /// values; entries that fail a check are reported and removed.
    pub fn lookup(&self, prompt: &[u32], beyond: usize, shape: &StateShape) -> Option<Entry> {
        let mut found: Vec<Found> = self
            .entries()
            .into_iter()
            .filter(|f| f.tokens > beyond && f.tokens <= prompt.len())
            .filter(|f| prefix_hash(&prompt[..f.tokens]) == f.hash)
            .collect();
        found.sort_by_key(|f| std::cmp::Reverse(f.tokens));
        for f in found {
            let t = Instant::now();
            match self.load(&f.path, &prompt[..f.tokens], shape) {
                Ok(e) => {
                    touch(&f.path);
                    tracing::info!(
                        "[K3] prompt cache: loaded {} of {} prompt tokens from {} ({:.1} MB in {:.2} s)",
                        f.tokens,
                        prompt.len(),
                        f.path.display(),
                        e.file_bytes() as f64 / 1e6,
                        t.elapsed().as_secs_f64()
                    );
                    return Some(e);
                }
                Err(e) => match std::fs::remove_file(&f.path) {
                    Ok(()) => tracing::warn!(
                        "[K3] prompt cache: {}: {e:#}; ignored and removed",
                        f.path.display()
                    ),
                    Err(why) => tracing::warn!(
                        "[K3] prompt cache: {}: {e:#}; ignored (not removed: {why})",
                        f.path.display()
                    ),
                },
            }
        }
        tracing::debug!(
            "[K3] prompt cache: no stored prefix of the prompt's {} tokens longer than {beyond}",
            prompt.len()
        );
        None
    }

    /// Reads and checks the entry at `path`, which must hold `tokens` in a state of `shape`.
    fn load(&self, path: &Path, tokens: &[u32], shape: &StateShape) -> Result<Entry> {
        let file = input_file::open(path, FileKind::PromptCache)?.file;
        let mut r = std::io::BufReader::with_capacity(1 << 20, file);
        let h = entry_file::read_header(&mut r, self.key, tokens.len())?;
        entry_file::check_shape(&h, shape)?;
        entry_file::read_body(&mut r, &h, tokens)
    }

    /// Whether `tokens` are worth storing and not stored already.
    pub fn wants(&self, tokens: &[u32]) -> bool {
        tokens.len() >= self.cfg.min_tokens && !self.entry_path(tokens).exists()
    }

    /// Stores `e` on a background thread (after the previous store finishes), making room
    /// by removing the least recently used entries; failures are warnings.
    pub fn store(&self, e: Entry) {
        let bytes = e.file_bytes();
        if bytes > self.cfg.max_bytes {
            tracing::warn!(
                "[K3] prompt cache: the state of {} tokens takes {:.1} MB, more than --prompt-cache-gb {:.2}; not stored",
                e.tokens.len(),
                bytes as f64 / 1e6,
                self.cfg.max_bytes as f64 / 1e9
            );
            return;
        }
        let path = self.entry_path(&e.tokens);
        let (dir, max) = (self.cfg.dir.clone(), self.cfg.max_bytes);
        let key = self.key;
        let mut w = self.writer.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(h) = w.take() {
            let _ = h.join();
        }
        *w = Some(std::thread::spawn(move || {
            make_room(&dir, max.saturating_sub(bytes));
            match write_entry(&path, &e, key) {
                Ok(n) => tracing::info!(
                    "[K3] prompt cache: stored {} tokens in {} ({:.1} MB)",
                    e.tokens.len(),
                    path.display(),
                    n as f64 / 1e6
                ),
                Err(err) => {
                    tracing::warn!(
                        "[K3] prompt cache: not stored ({err:#}); the run goes on without it"
                    )
                }
            }
        }));
    }

    /// Waits for the entry being written, if any.
    pub fn wait(&self) {
        let h = self.writer.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(h) = h {
            let _ = h.join();
        }
    }
}

impl Drop for PromptCache {
    fn drop(&mut self) {
        self.wait();
    }
}

/// Writes `e` to `path` through the atomic writer; returns the bytes written.
fn write_entry(path: &Path, e: &Entry, key: u64) -> Result<u64> {
    let mut f = AtomicFile::create(path)?;
    entry_file::write(&mut |b| f.write_all(b), e, key)?;
    f.commit()
}

/// Marks an entry as just used, for the least-recently-used order. Opened without
/// following a symlink and without blocking: a FIFO swapped in after the entry was read
/// answers at once.
fn touch(path: &Path) {
    let mut o = std::fs::File::options();
    o.write(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        o.custom_flags(libc::O_NONBLOCK | libc::O_NOFOLLOW);
    }
    if let Ok(f) = o.open(path) {
        let _ = f.set_modified(SystemTime::now());
    }
}

/// Removes the least recently used entries of `dir` (of every model) until they take at
/// most `keep` bytes. Temporaries of entries being written count too: those of writers that
/// are gone are removed first ([`crate::atomic_file::is_abandoned`]), the others' bytes are
/// held until their writers finish, so the entries make room for them.
fn make_room(dir: &Path, keep: u64) {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return;
    };
    let mut in_flight: u64 = 0;
    let mut files: Vec<(SystemTime, u64, PathBuf)> = Vec::new();
    for e in rd.flatten() {
        let p = e.path();
        let Ok(m) = std::fs::symlink_metadata(&p) else {
            continue;
        };
        if !m.is_file() {
            continue;
        }
        let name = e.file_name();
        let partial = name
            .to_str()
            .and_then(atomic_file::parse_partial)
            .filter(|(dest, _)| dest.ends_with(&format!(".{EXTENSION}")));
        if let Some((_, pid)) = partial {
            if !(atomic_file::is_abandoned(&p, pid, &m) && std::fs::remove_file(&p).is_ok()) {
                in_flight += m.len();
            }
            continue;
        }
        if p.extension().is_some_and(|x| x == EXTENSION) {
            if let Ok(t) = m.modified() {
                files.push((t, m.len(), p));
            }
        }
    }
    let mut total: u64 = in_flight + files.iter().map(|f| f.1).sum::<u64>();
    files.sort_by_key(|f| f.0);
    for (_, len, p) in files {
        if total <= keep {
            break;
        }
        if std::fs::remove_file(&p).is_ok() {
            total -= len;
        }
    }
}
