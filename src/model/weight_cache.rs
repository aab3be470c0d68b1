//! The quantized-weight cache: the dense matrices that load-time quantization produced
//! (int4 groups of 64, int8 per row), kept in one file so a later start reads them instead
//! of quantizing again.
//!
//! The file lives next to the snapshot when that directory is writable, else under the
//! user's cache directory ([`crate::platform::cache_dir`]), its name carrying the format
//! policy (`K3_BITS`, `K3_MLA_BITS`, `K3_HEAD_BITS`), so each policy has its own file. It is
//! keyed by what the bytes depend on — the cache format version, the format policy,
//! `config.json`'s bytes and every shard's content identity (size, times, inode and a hash
//! of sampled bytes, `key`) — and each matrix carries a checksum. A file whose key differs (stale) or whose bytes do
//! not check out (corrupt, truncated) is reported on one line, never used, and rebuilt.
//!
//! Layout (little-endian): a 16-byte header (`K3WCACHE`, the version, 4 zero bytes), the
//! matrices (each part starting on a 64-byte boundary), a JSON table (the key and, for each
//! matrix, its name, format, shape, and the offset, length and xxh3 of its values and of
//! its scales), and a 32-byte trailer (table offset, table length, xxh3 of the table,
//! `K3WCEND\0`). The trailer lets the file be written in one pass as matrices are made.
//!
//! A start that builds the cache does not wait for the disk: copies of the matrices go to a
//! writer thread as they are quantized, and the model is ready once the last one is queued.
//! The writer then drops to the lowest CPU and disk priority the OS offers, finishes the
//! file, syncs it and renames it into place while the model runs ([`PendingWrite`]); a
//! process that ends first waits for it with a progress line, so the next start finds the
//! whole file or, after a failure that is reported, none.

use super::format_policy::FormatPolicy;
use crate::checkpoint::Checkpoint;
use crate::quant::{DenseData, DenseFormat, DenseMatrix};
use anyhow::Result;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::Arc;
use std::time::Instant;
use xxhash_rust::xxh3::xxh3_64;

mod file_format;
mod key;
mod pending_write;
mod write_queue;

use file_format::{parallel_copy, Builder, Reader};
pub use key::model_stamp;
use key::{format_name, key_of};
pub use pending_write::{PendingWrite, WriteReport};
use write_queue::Queue;

/// Version of the cache layout, its key and the encodings it holds; a file of another
/// version is stale.
pub const FORMAT_VERSION: u32 = 2;

/// The cache's file name in the snapshot directory for `policy`'s formats, e.g.
/// `k3-weights-int4-int8-int8.cache` (dense, MLA, head): the caches of several `--bits`
/// settings live side by side instead of evicting each other.
pub fn file_name(policy: &FormatPolicy) -> String {
    format!("k3-weights-{}.cache", key::policy_tag(policy))
}
/// Whether, and where, the loader keeps the quantized-weight cache.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WeightCacheSetting {
    /// Quantize at every start (`--no-weight-cache`).
    Off,
    /// Next to the snapshot when writable, else under the user's cache directory.
    Auto,
    /// These directories in order of preference (the file is found or made in the first
    /// that allows it).
    Dirs(Vec<PathBuf>),
}

/// Where the cache of `ckpt` in `policy`'s formats may be, in order of preference.
fn candidates(
    ckpt: &Checkpoint,
    setting: &WeightCacheSetting,
    policy: &FormatPolicy,
) -> Vec<PathBuf> {
    let name = file_name(policy);
    match setting {
        WeightCacheSetting::Off => Vec::new(),
        WeightCacheSetting::Dirs(dirs) => dirs.iter().map(|d| d.join(&name)).collect(),
        WeightCacheSetting::Auto => {
            let mut out = vec![ckpt.dir.join(&name)];
            if let Some(user) = crate::platform::cache_dir::user_cache_dir() {
                // One file per snapshot directory: its name carries a hash of the path.
                let dir = std::fs::canonicalize(&ckpt.dir).unwrap_or_else(|_| ckpt.dir.clone());
                let tag = xxh3_64(dir.display().to_string().as_bytes());
                let base = dir
                    .file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_default();
                out.push(user.join("weights").join(format!(
                    "{base}-{tag:016x}-{}.cache",
                    key::policy_tag(policy)
                )));
            }
            out
        }
    }
}

/// One matrix on its way to the writer thread: name, format, shape, value and scale bytes.
struct Parts {
    name: String,
    format: &'static str,
    rows: usize,
    cols: usize,
    q: Vec<u8>,
    scale: Vec<u8>,
}

impl Parts {
    fn bytes(&self) -> u64 {
        (self.q.len() + self.scale.len()) as u64
    }
}

/// What the writer thread has done so far, for the progress line.
#[derive(Default)]
struct Progress {
    written: AtomicU64,
    syncing: AtomicBool,
}

/// What the writer thread returns: the file's bytes and path, and when it was committed.
type Written = Result<(u64, PathBuf, Instant)>;

/// A cache being written on its own thread, so that writing overlaps quantizing and the run.
struct Building {
    queue: Arc<Queue>,
    progress: Arc<Progress>,
    writer: std::thread::JoinHandle<Written>,
    path: PathBuf,
    /// Bytes of matrices sent to the writer.
    sent: u64,
    started: Instant,
    /// Why the previous file was not used, for the report.
    replaced: Option<String>,
}

enum State {
    Off,
    Hit(Reader),
    Build(Building),
    /// The cache could not be written; the load goes on without it.
    Failed(String),
}

/// The quantized-weight cache of one load: answers [`WeightCache::take`] from a valid file,
/// or records every matrix given to [`WeightCache::store`] into a new one.
pub struct WeightCache {
    state: State,
    /// Lines printed once the load is over (a problem found along the way).
    notes: Vec<String>,
}

impl WeightCache {
    /// A cache that never reads nor writes.
    pub fn off() -> WeightCache {
        WeightCache {
            state: State::Off,
            notes: Vec::new(),
        }
    }

    /// Finds a valid cache file for `ckpt` loaded with `policy`, or starts writing one.
    /// Nothing here fails the load: a file that cannot be read or written is reported.
    pub fn open(ckpt: &Checkpoint, policy: &FormatPolicy, setting: &WeightCacheSetting) -> Self {
        let paths = candidates(ckpt, setting, policy);
        if paths.is_empty() {
            return Self::off();
        }
        let key = match key_of(ckpt, policy) {
            Ok(k) => k,
            Err(e) => {
                return WeightCache {
                    state: State::Failed(format!("{e:#}")),
                    notes: Vec::new(),
                }
            }
        };
        let mut replaced: Option<(PathBuf, String)> = None;
        for p in &paths {
            if !p.exists() {
                continue;
            }
            match Reader::open(p, &key) {
                Ok(r) => {
                    // A start that finds the cache valid never rebuilds it: temporaries
                    // that killed writers left beside it go now, not at a rebuild.
                    crate::atomic_file::remove_leftovers(p);
                    return WeightCache {
                        state: State::Hit(r),
                        notes: Vec::new(),
                    };
                }
                Err(why) => {
                    if replaced.is_none() {
                        replaced = Some((p.clone(), format!("{why:#}")));
                    }
                }
            }
        }
        // Rebuild where the unusable file was, else in the first place that takes a file.
        let order: Vec<&PathBuf> = replaced
            .as_ref()
            .map(|(p, _)| p)
            .into_iter()
            .chain(paths.iter())
            .collect();
        let mut failures = Vec::new();
        for p in order {
            match Builder::create(p, key.clone()) {
                Ok(b) => {
                    return WeightCache {
                        state: State::Build(b.spawn(replaced.map(|(_, why)| why))),
                        notes: Vec::new(),
                    };
                }
                Err(e) => failures.push(format!("{e:#}")),
            }
        }
        failures.dedup();
        WeightCache {
            state: State::Failed(failures.join("; ")),
            notes: Vec::new(),
        }
    }

    /// Whether matrices in `fmt` are kept in the cache (the quantized formats: the others
    /// are the checkpoint's own bits or a plain widening, as fast to make as to read).
    pub fn holds(fmt: DenseFormat) -> bool {
        matches!(fmt, DenseFormat::Int4 | DenseFormat::Int8)
    }

    /// The cached matrix `name` in `fmt` and shape `[rows, cols]`, when this load reads a
    /// valid cache that holds it. A valid cache that lacks it is removed at the end (it does
    /// not match this engine's schedule), and the matrix is quantized as without a cache.
    pub fn take(
        &mut self,
        name: &str,
        fmt: DenseFormat,
        rows: usize,
        cols: usize,
    ) -> Option<DenseMatrix> {
        let State::Hit(r) = &mut self.state else {
            return None;
        };
        let found = r.entries.iter().find(|e| e.name == name).cloned();
        match found {
            Some(e) if e.format == format_name(fmt) && e.rows == rows && e.cols == cols => {
                match r.matrix(&e, fmt) {
                    Ok(m) => {
                        r.used += 1;
                        Some(m)
                    }
                    Err(why) => {
                        // Cut short or rewritten under the load: what was taken checked
                        // out, the rest is quantized.
                        self.notes.push(format!(
                            "[K3] weight cache: {why:#}: removed, the rest of this load \
                             quantizes and the next start rebuilds it"
                        ));
                        let _ = std::fs::remove_file(&r.path);
                        self.state = State::Off;
                        None
                    }
                }
            }
            other => {
                let why = match other {
                    Some(e) => format!(
                        "holds `{name}` as {} [{}, {}], this load wants {} [{rows}, {cols}]",
                        e.format,
                        e.rows,
                        e.cols,
                        format_name(fmt)
                    ),
                    None => format!("lacks `{name}`"),
                };
                self.notes.push(format!(
                    "[K3] weight cache: {} {why}: removed, the next start rebuilds it",
                    r.path.display()
                ));
                let _ = std::fs::remove_file(&r.path);
                self.state = State::Off;
                None
            }
        }
    }

    /// Records a matrix this load quantized: a copy goes to the writer thread. A write
    /// that fails ends the cache with a warning once the write is waited for; the load
    /// goes on.
    pub fn store(&mut self, name: &str, m: &DenseMatrix) {
        let State::Build(b) = &mut self.state else {
            return;
        };
        let (format, q, scale): (_, &[u8], &[f32]) = match &m.data {
            DenseData::Int8 { q, scale } => ("int8", bytemuck::cast_slice(q), scale),
            DenseData::Int4 { q, scale } => ("int4", q, scale),
            _ => return,
        };
        let parts = Parts {
            name: name.to_string(),
            format,
            rows: m.rows,
            cols: m.cols,
            q: parallel_copy(q),
            scale: bytemuck::cast_slice(scale).to_vec(),
        };
        b.sent += parts.bytes();
        // Once the writer thread has ended the copy is dropped; its end is reported.
        b.queue.send(parts);
    }

    /// Ends the load and waits for a cache being written; returns the start-up line's
    /// words (`hit (…)`, `built (N MB, …)`, `stale (…), rebuilt: built (N MB, …)`, `off`),
    /// with any notes gathered on the way.
    pub fn finish(self) -> (String, Vec<String>) {
        let (line, notes, pending) = self.finish_in_background(false);
        match pending {
            Some(p) => (p.wait().line, notes),
            None => (line, notes),
        }
    }

    /// Ends the load without waiting for the disk: returns the start-up line's words, the
    /// notes, and the write still under way, if any (`announce`: it prints its progress and,
    /// when dropped unwaited, its outcome on stderr).
    pub fn finish_in_background(
        self,
        announce: bool,
    ) -> (String, Vec<String>, Option<PendingWrite>) {
        let line = match self.state {
            State::Off => "off".to_string(),
            State::Hit(r) => format!(
                "hit ({} matrices, {:.0} MB, {})",
                r.used,
                mb(r.bytes),
                r.path.display()
            ),
            State::Failed(why) => {
                format!("off: cannot be written ({why}); quantized this start only")
            }
            State::Build(b) => {
                b.queue.close();
                let writing = format!(
                    "writing {:.0} MB to {} in the background",
                    mb(b.sent),
                    b.path.display()
                );
                let line = match &b.replaced {
                    Some(why) => format!("stale or corrupt ({why}), rebuilding: {writing}"),
                    None => writing,
                };
                let pending = PendingWrite {
                    building: Some(b),
                    ready: Instant::now(),
                    announce,
                };
                return (line, self.notes, Some(pending));
            }
        };
        (line, self.notes, None)
    }
}

fn mb(b: u64) -> f64 {
    b as f64 / 1e6
}

#[cfg(test)]
mod tests;
