//! The quantized-weight cache: the dense matrices that load-time quantization produced
//! (int4 groups of 64, int8 per row), kept in one file so a later start reads them instead
//! of quantizing again.
//!
//! The file lives next to the snapshot when that directory is writable, else under the
//! user's cache directory ([`crate::platform::cache_dir`]). It is keyed by what the bytes
//! depend on — the cache format version, the format policy (`K3_BITS`, `K3_MLA_BITS`,
//! `K3_HEAD_BITS`) and the size and modification time of `config.json` and of every shard —
//! and each matrix carries a checksum. A file whose key differs (stale) or whose bytes do
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
use crate::checkpoint::{Checkpoint, CONFIG_FILE};
use crate::quant::{DenseData, DenseFormat, DenseMatrix};
use anyhow::{anyhow, Context, Result};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use xxhash_rust::xxh3::xxh3_64;

mod file_format;
mod write_queue;

use file_format::{parallel_copy, Builder, Reader};
use write_queue::{Queue, WriterGone, MAX_BACKLOG};

/// Version of the cache layout and of the encodings it holds; a file of another version is
/// stale.
pub const FORMAT_VERSION: u32 = 1;
/// The cache's file name in the snapshot directory.
pub const FILE_NAME: &str = "k3-weights.cache";
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

/// What the key of a cache file records.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct Key {
    version: u32,
    /// The format of each class of matrix, e.g. `dense=int4 mla=int8 head=int8`.
    policy: String,
    /// `config.json` and every shard, in the checkpoint's order.
    files: Vec<FileKey>,
}

/// A source file's path, size and modification time.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct FileKey {
    path: String,
    len: u64,
    /// Seconds and nanoseconds since the Unix epoch, where the filesystem records it.
    modified: Option<(u64, u32)>,
}

fn format_name(f: DenseFormat) -> &'static str {
    match f {
        DenseFormat::Int4 => "int4",
        DenseFormat::Int8 => "int8",
        DenseFormat::Bf16 => "bf16",
        DenseFormat::F32 => "f32",
    }
}

fn policy_text(p: &FormatPolicy) -> String {
    format!(
        "dense={} mla={} head={}",
        format_name(p.dense),
        format_name(p.mla),
        format_name(p.head)
    )
}

fn file_key(path: &Path, len: u64, modified: Option<SystemTime>) -> FileKey {
    FileKey {
        path: path.display().to_string(),
        len,
        modified: modified
            .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
            .map(|d| (d.as_secs(), d.subsec_nanos())),
    }
}

fn key_of(ckpt: &Checkpoint, policy: &FormatPolicy) -> Result<Key> {
    let config = ckpt.dir.join(CONFIG_FILE);
    let meta = std::fs::metadata(&config)
        .with_context(|| format!("{}: cannot stat the model config", config.display()))?;
    let mut files = vec![file_key(&config, meta.len(), meta.modified().ok())];
    for i in 0..ckpt.shard_count() {
        let s = ckpt.shard_stamp(i);
        files.push(file_key(ckpt.shard_path(i), s.len, s.modified));
    }
    Ok(Key {
        version: FORMAT_VERSION,
        policy: policy_text(policy),
        files,
    })
}

/// The weight cache's stamp of a model: a hash of its key (the config's and every shard's
/// path, size and modification time, and the load-time formats), so other caches (the
/// prompt cache) can name the exact weights their contents were computed with.
pub fn model_stamp(ckpt: &Checkpoint, policy: &FormatPolicy) -> Result<u64> {
    let key = key_of(ckpt, policy)?;
    Ok(xxh3_64(&serde_json::to_vec(&key)?))
}

/// Why `found` is not `want`, in a few words.
fn key_difference(found: &Key, want: &Key) -> String {
    if found.version != want.version {
        return format!(
            "written by cache format {} (this k3 uses {})",
            found.version, want.version
        );
    }
    if found.policy != want.policy {
        return format!("made for {} (now {})", found.policy, want.policy);
    }
    for w in &want.files {
        match found.files.iter().find(|f| f.path == w.path) {
            Some(f) if f == w => {}
            Some(_) => return format!("{} changed (size or modification time)", w.path),
            None => return format!("made without {}", w.path),
        }
    }
    "made from other files".to_string()
}

/// Where the cache of `ckpt` may be, in order of preference.
fn candidates(ckpt: &Checkpoint, setting: &WeightCacheSetting) -> Vec<PathBuf> {
    match setting {
        WeightCacheSetting::Off => Vec::new(),
        WeightCacheSetting::Dirs(dirs) => dirs.iter().map(|d| d.join(FILE_NAME)).collect(),
        WeightCacheSetting::Auto => {
            let mut out = vec![ckpt.dir.join(FILE_NAME)];
            if let Some(user) = crate::platform::cache_dir::user_cache_dir() {
                // One file per snapshot directory: its name carries a hash of the path.
                let dir = std::fs::canonicalize(&ckpt.dir).unwrap_or_else(|_| ckpt.dir.clone());
                let tag = xxh3_64(dir.display().to_string().as_bytes());
                let base = dir
                    .file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_default();
                out.push(
                    user.join("weights")
                        .join(format!("{base}-{tag:016x}.cache")),
                );
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
        let paths = candidates(ckpt, setting);
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
                    return WeightCache {
                        state: State::Hit(r),
                        notes: Vec::new(),
                    }
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
                r.used += 1;
                Some(r.matrix(&e, fmt))
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

/// Seconds between progress lines while a process waits for the cache write.
const PROGRESS_EVERY: Duration = Duration::from_secs(5);

/// A cache file still being written after the load: the writer thread finishes it while
/// the model runs. [`PendingWrite::wait`] (or dropping it) waits for the file to be whole
/// and in place, or for the write to fail, which leaves no file.
pub struct PendingWrite {
    building: Option<Building>,
    /// When the load handed the rest of the write to the background.
    ready: Instant,
    announce: bool,
}

/// How a background cache write ended.
#[derive(Clone, Debug, PartialEq)]
pub struct WriteReport {
    /// The cache's words for the stats line: `built (N MB, path)`, `stale or corrupt (…),
    /// rebuilt: built (…)`, or `off: cannot be written (…)`.
    pub line: String,
    /// Whether the file is whole and in place.
    pub built: bool,
    /// The file's bytes (0 when it was not written).
    pub bytes: u64,
    /// Seconds from the writer's start (the load's first matrix) to the file in place.
    pub write_s: f64,
    /// Of those, seconds after the model was ready.
    pub after_ready_s: f64,
    /// Seconds the process waited for the write (it ended before the writer).
    pub waited_s: f64,
}

impl WriteReport {
    /// `[K3] weight cache: built (…) in Ws, As of it after the model was ready, Ps waited for`
    pub fn stats_line(&self) -> String {
        if self.built {
            format!(
                "[K3] weight cache: {} in {:.1}s, {:.1}s of it after the model was ready, {:.1}s waited for",
                self.line, self.write_s, self.after_ready_s, self.waited_s
            )
        } else {
            format!("[K3] weight cache: {}", self.line)
        }
    }
}

impl PendingWrite {
    /// Whether the writer thread is done (the file in place, or the write failed).
    pub fn is_done(&self) -> bool {
        self.building
            .as_ref()
            .is_none_or(|b| b.writer.is_finished())
    }

    /// Waits for the write to end (with a progress line on stderr when announced and it is
    /// still under way) and says how it ended.
    pub fn wait(mut self) -> WriteReport {
        self.end()
    }

    fn end(&mut self) -> WriteReport {
        let Some(b) = self.building.take() else {
            return WriteReport {
                line: "off".to_string(),
                built: false,
                bytes: 0,
                write_s: 0.0,
                after_ready_s: 0.0,
                waited_s: 0.0,
            };
        };
        let waiting = Instant::now();
        let mut shown = None::<Instant>;
        while !b.writer.is_finished() {
            if self.announce && shown.is_none_or(|t| t.elapsed() >= PROGRESS_EVERY) {
                let written = b.progress.written.load(Ordering::Relaxed);
                let step = if b.progress.syncing.load(Ordering::Relaxed) {
                    "syncing it to disk".to_string()
                } else {
                    format!("{:.0} MB written", mb(written))
                };
                eprintln!(
                    "[K3] weight cache: finishing the write of {:.0} MB to {} ({step}) ...",
                    mb(b.sent),
                    b.path.display()
                );
                shown = Some(Instant::now());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let waited_s = waiting.elapsed().as_secs_f64();
        let done = b
            .writer
            .join()
            .unwrap_or_else(|_| Err(anyhow!("the cache writer thread panicked")));
        match done {
            Ok((bytes, path, at)) => {
                let built = format!("built ({:.0} MB, {})", mb(bytes), path.display());
                WriteReport {
                    line: match b.replaced {
                        Some(why) => format!("stale or corrupt ({why}), rebuilt: {built}"),
                        None => built,
                    },
                    built: true,
                    bytes,
                    write_s: at.saturating_duration_since(b.started).as_secs_f64(),
                    after_ready_s: at.saturating_duration_since(self.ready).as_secs_f64(),
                    waited_s,
                }
            }
            Err(e) => WriteReport {
                line: format!(
                    "off: cannot be written ({e:#}); quantized this start only, the next start \
                     quantizes again"
                ),
                built: false,
                bytes: 0,
                write_s: waiting.saturating_duration_since(b.started).as_secs_f64(),
                after_ready_s: 0.0,
                waited_s,
            },
        }
    }
}

impl Drop for PendingWrite {
    /// A write nobody waited for is waited for here, so a process never ends with the file
    /// half written; its outcome is printed when the load was announced.
    fn drop(&mut self) {
        if self.building.is_some() {
            let r = self.end();
            if self.announce {
                eprintln!("{}", r.stats_line());
            }
        }
    }
}

impl Builder {
    /// Moves the file to a writer thread that writes each matrix it is sent, then the table,
    /// and commits once the queue is closed. After an error it stops taking matrices and
    /// returns the error (the partial file is removed).
    fn spawn(mut self, replaced: Option<String>) -> Building {
        let queue = Arc::new(Queue::new(MAX_BACKLOG));
        let progress = Arc::new(Progress::default());
        let path = self.file.path().to_path_buf();
        let (q, prog) = (Arc::clone(&queue), Arc::clone(&progress));
        let writer = std::thread::spawn(move || {
            let _gone = WriterGone(Arc::clone(&q));
            // While the load runs it may wait for this thread (a full backlog), so the thread
            // keeps its priority; once the model is ready its reads and compute come first
            // and this file can wait (a process that ends before it waits for it).
            let mut background = false;
            while let Some(parts) = q.recv() {
                if !background && q.is_closed() {
                    crate::platform::thread_priority::to_background();
                    background = true;
                }
                self.add(parts)?;
                prog.written.store(self.file.written(), Ordering::Relaxed);
            }
            if !background {
                crate::platform::thread_priority::to_background();
            }
            prog.syncing.store(true, Ordering::Relaxed);
            let (bytes, path) = self.commit()?;
            Ok((bytes, path, Instant::now()))
        });
        Building {
            queue,
            progress,
            writer,
            path,
            sent: 0,
            started: Instant::now(),
            replaced,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key() -> Key {
        Key {
            version: FORMAT_VERSION,
            policy: "dense=int4 mla=int8 head=int8".into(),
            files: vec![file_key(Path::new("/nowhere/config.json"), 1, None)],
        }
    }

    /// An int8 matrix of `rows` x `cols` with recognisable bytes.
    fn parts(name: &str, rows: usize, cols: usize) -> Parts {
        Parts {
            name: name.into(),
            format: "int8",
            rows,
            cols,
            q: (0..rows * cols).map(|i| (i % 251) as u8).collect(),
            scale: (0..rows).flat_map(|r| (r as f32).to_le_bytes()).collect(),
        }
    }

    fn pause(b: &Building, on: bool) {
        b.queue.set_paused(on);
    }

    fn building(path: &Path) -> Building {
        Builder::create(path, key()).unwrap().spawn(None)
    }

    fn ends_before_writer(path: &Path) -> (WriteReport, bool) {
        let mut b = building(path);
        pause(&b, true);
        for (i, rows) in [64usize, 128, 32].into_iter().enumerate() {
            let p = parts(&format!("m{i}"), rows, 4096);
            b.sent += p.bytes();
            b.queue.send(p);
        }
        let cache = WeightCache {
            state: State::Build(b),
            notes: Vec::new(),
        };
        let (line, _, pending) = cache.finish_in_background(false);
        assert!(line.starts_with("writing 1 MB to "), "{line}");
        let pending = pending.unwrap();
        let running = !pending.is_done();
        assert!(
            !path.exists(),
            "the file is in place before the writer wrote it"
        );
        let b = pending.building.as_ref().unwrap();
        let queue = Arc::clone(&b.queue);
        let resume = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            queue.set_paused(false);
        });
        let r = pending.wait();
        resume.join().unwrap();
        (r, running)
    }

    #[test]
    fn a_process_that_ends_while_the_writer_writes_waits_for_a_whole_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(FILE_NAME);
        let (r, running) = ends_before_writer(&path);
        assert!(running, "the writer was done before the load ended");
        assert!(r.built, "{}", r.line);
        assert!(r.waited_s >= 0.09, "did not wait: {r:?}");
        assert_eq!(r.bytes, std::fs::metadata(&path).unwrap().len());
        assert!(!crate::atomic_file::partial_path(&path).exists());
        let read = Reader::open(&path, &key()).unwrap();
        assert_eq!(read.entries.len(), 3);
        let m = read.matrix(&read.entries[1], DenseFormat::Int8);
        let DenseData::Int8 { q, scale } = m.data else {
            panic!("not int8")
        };
        let want = parts("m1", 128, 4096);
        assert_eq!(bytemuck::cast_slice::<i8, u8>(&q), &want.q[..]);
        assert_eq!(bytemuck::cast_slice::<f32, u8>(&scale), &want.scale[..]);
    }

    #[test]
    fn dropping_the_pending_write_waits_for_it_too() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(FILE_NAME);
        let mut b = building(&path);
        pause(&b, true);
        let p = parts("m", 256, 4096);
        b.sent += p.bytes();
        b.queue.send(p);
        let queue = Arc::clone(&b.queue);
        let cache = WeightCache {
            state: State::Build(b),
            notes: Vec::new(),
        };
        let (_, _, pending) = cache.finish_in_background(false);
        let resume = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            queue.set_paused(false);
        });
        drop(pending);
        resume.join().unwrap();
        assert!(Reader::open(&path, &key()).is_ok());
        assert!(!crate::atomic_file::partial_path(&path).exists());
    }

    #[test]
    fn a_write_that_fails_after_the_load_leaves_no_file_and_says_so() {
        let dir = tempfile::tempdir().unwrap();
        // The destination turns into a non-empty directory while the writer waits: its
        // rename into place fails after everything was written and synced.
        let path = dir.path().join(FILE_NAME);
        let mut b = building(&path);
        pause(&b, true);
        let p = parts("m", 16, 4096);
        b.sent += p.bytes();
        b.queue.send(p);
        std::fs::create_dir(&path).unwrap();
        std::fs::write(path.join("x"), b"x").unwrap();
        pause(&b, false);
        let cache = WeightCache {
            state: State::Build(b),
            notes: Vec::new(),
        };
        let (_, _, pending) = cache.finish_in_background(false);
        let r = pending.unwrap().wait();
        assert!(!r.built && r.bytes == 0, "{r:?}");
        assert!(
            r.line.contains("cannot be written") && r.line.contains("renaming"),
            "{}",
            r.line
        );
        assert!(r.stats_line().starts_with("[K3] weight cache: off: "));
        assert!(!crate::atomic_file::partial_path(&path).exists());
    }

    #[test]
    fn the_load_waits_only_for_a_backlog_past_its_bound() {
        let q = Arc::new(Queue::new(1000));
        q.set_paused(true);
        // A first matrix larger than the bound is taken at once (nothing is queued).
        let big = 2000;
        q.send(Parts {
            name: "big".into(),
            format: "int8",
            rows: 1,
            cols: big,
            q: vec![0; big],
            scale: vec![0; 4],
        });
        let q2 = Arc::clone(&q);
        let second = std::thread::spawn(move || q2.send(parts("small", 1, 64)));
        std::thread::sleep(Duration::from_millis(50));
        assert!(!second.is_finished(), "a full backlog took more");
        q.set_paused(false);
        assert_eq!(q.recv().map(|p| p.name), Some("big".to_string()));
        second.join().unwrap();
        q.close();
        assert_eq!(q.recv().map(|p| p.name), Some("small".to_string()));
        assert!(q.recv().is_none());
    }
}
