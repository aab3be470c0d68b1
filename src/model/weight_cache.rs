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

use super::format_policy::FormatPolicy;
use crate::atomic_file::AtomicFile;
use crate::checkpoint::{Checkpoint, CONFIG_FILE};
use crate::quant::{int4, DenseData, DenseFormat, DenseMatrix};
use anyhow::{anyhow, bail, Context, Result};
use memmap2::Mmap;
use rayon::prelude::*;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};
use xxhash_rust::xxh3::xxh3_64;

/// Version of the cache layout and of the encodings it holds; a file of another version is
/// stale.
pub const FORMAT_VERSION: u32 = 1;
/// The cache's file name in the snapshot directory.
pub const FILE_NAME: &str = "k3-weights.cache";
const MAGIC: &[u8; 8] = b"K3WCACHE";
const END_MAGIC: &[u8; 8] = b"K3WCEND\0";
const HEADER_BYTES: u64 = 16;
const TRAILER_BYTES: u64 = 32;
const ALIGN: u64 = 64;
/// Largest table accepted: the full model's table is well under a megabyte.
const MAX_TABLE_BYTES: u64 = 64 << 20;
/// Bytes one thread copies at a time out of the map.
const COPY_CHUNK: usize = 4 << 20;

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

/// One cached matrix.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct Entry {
    name: String,
    format: String,
    rows: usize,
    cols: usize,
    q: Part,
    scale: Part,
}

/// A byte range of the file and its xxh3.
#[derive(Clone, Copy, Debug, Serialize, Deserialize)]
struct Part {
    offset: u64,
    len: u64,
    xxh3: u64,
}

#[derive(Debug, Serialize, Deserialize)]
struct Table {
    key: Key,
    entries: Vec<Entry>,
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

/// A cache file that checked out: its map and table.
struct Reader {
    path: PathBuf,
    map: Mmap,
    entries: Vec<Entry>,
    used: usize,
    bytes: u64,
}

/// A cache file being written as the matrices are quantized.
struct Builder {
    file: AtomicFile,
    key: Key,
    entries: Vec<Entry>,
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

/// A cache being written on its own thread, so that writing overlaps quantizing.
struct Building {
    tx: std::sync::mpsc::SyncSender<Parts>,
    writer: std::thread::JoinHandle<Result<(u64, PathBuf)>>,
    /// Why the previous file was not used, for the report.
    replaced: Option<String>,
}

/// Matrices queued for the writer thread beyond the one it writes: the queue holds copies,
/// so it is short.
const WRITE_QUEUE: usize = 1;

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
    /// that fails ends the cache with a warning at [`Self::finish`]; the load goes on.
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
        // A send fails only once the writer thread has ended, which `finish` reports.
        let _ = b.tx.send(parts);
    }

    /// Ends the load: completes a cache being written and returns the start-up line's
    /// words (`hit (…)`, `built (N MB, …)`, `stale (…), rebuilt (N MB, …)`, `off`), with any
    /// notes gathered on the way.
    pub fn finish(self) -> (String, Vec<String>) {
        let mb = |b: u64| b as f64 / 1e6;
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
                let Building {
                    tx,
                    writer,
                    replaced,
                } = b;
                drop(tx);
                let done = writer
                    .join()
                    .unwrap_or_else(|_| Err(anyhow!("the cache writer thread panicked")));
                match done {
                    Ok((bytes, path)) => {
                        let built = format!("built ({:.0} MB, {})", mb(bytes), path.display());
                        match replaced {
                            Some(why) => format!("stale or corrupt ({why}), rebuilt: {built}"),
                            None => built,
                        }
                    }
                    Err(e) => format!("off: cannot be written ({e:#}); quantized this start only"),
                }
            }
        };
        (line, self.notes)
    }
}

fn read_u64(b: &[u8]) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[..8]);
    u64::from_le_bytes(a)
}

impl Reader {
    /// Maps `path` and checks it through: header, trailer, table, key, every range and
    /// every checksum. Any failure says what was wrong.
    fn open(path: &Path, key: &Key) -> Result<Reader> {
        let file = std::fs::File::open(path).context("cannot open it")?;
        // SAFETY: the map is read-only. k3 replaces a cache file only by renaming a new one
        // over it, which leaves this mapping's file intact; a process that truncated the file
        // in place would be writing where only k3 writes.
        // Populated: every page is read in with the mapping rather than one fault at a time.
        let map = unsafe { memmap2::MmapOptions::new().populate().map(&file) }
            .context("cannot map it")?;
        let len = map.len() as u64;
        if len < HEADER_BYTES + TRAILER_BYTES {
            bail!("truncated: {len} bytes");
        }
        if &map[..8] != MAGIC {
            bail!("not a k3 weight cache (bad magic)");
        }
        let t = &map[(len - TRAILER_BYTES) as usize..];
        if &t[24..32] != END_MAGIC {
            bail!("truncated or corrupt: no end marker");
        }
        let (table_off, table_len, table_hash) =
            (read_u64(t), read_u64(&t[8..]), read_u64(&t[16..]));
        if table_len > MAX_TABLE_BYTES
            || table_off < HEADER_BYTES
            || table_off.checked_add(table_len) != Some(len - TRAILER_BYTES)
        {
            bail!(
                "corrupt: the table at {table_off} (+{table_len}) does not fit the {len}-byte file"
            );
        }
        let table = &map[table_off as usize..(table_off + table_len) as usize];
        if xxh3_64(table) != table_hash {
            bail!("corrupt: table checksum mismatch");
        }
        let table: Table = serde_json::from_slice(table).context("corrupt: table is not valid")?;
        if table.key != *key {
            bail!("stale: {}", key_difference(&table.key, key));
        }
        for e in &table.entries {
            check_entry(e, table_off).with_context(|| format!("corrupt: entry `{}`", e.name))?;
        }
        table.entries.par_iter().try_for_each(|e| {
            for (what, p) in [("values", &e.q), ("scales", &e.scale)] {
                let bytes = &map[p.offset as usize..(p.offset + p.len) as usize];
                if xxh3_64(bytes) != p.xxh3 {
                    return Err(anyhow!(
                        "corrupt: checksum of `{}` {what} (bytes {}..{}) mismatch",
                        e.name,
                        p.offset,
                        p.offset + p.len
                    ));
                }
            }
            Ok(())
        })?;
        Ok(Reader {
            path: path.to_path_buf(),
            map,
            entries: table.entries,
            used: 0,
            bytes: len,
        })
    }

    /// Copies entry `e` (checked at open) out of the map, in parallel: a start from the
    /// cache is this copy, and the pages it touches fault in on every core at once.
    fn matrix(&self, e: &Entry, fmt: DenseFormat) -> DenseMatrix {
        let part = |p: &Part| &self.map[p.offset as usize..(p.offset + p.len) as usize];
        let scale: Vec<f32> = part(&e.scale)
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        let copy = |dst: &mut [u8]| {
            dst.par_chunks_mut(COPY_CHUNK)
                .zip(part(&e.q).par_chunks(COPY_CHUNK))
                .for_each(|(d, s)| d.copy_from_slice(s));
        };
        let data = match fmt {
            DenseFormat::Int8 => {
                let mut q = vec![0i8; e.q.len as usize];
                copy(bytemuck::cast_slice_mut(&mut q));
                DenseData::Int8 { q, scale }
            }
            _ => {
                let mut q = vec![0u8; e.q.len as usize];
                copy(&mut q);
                DenseData::Int4 { q, scale }
            }
        };
        DenseMatrix {
            rows: e.rows,
            cols: e.cols,
            data,
        }
    }
}

/// A copy of `src`, made by every core.
fn parallel_copy(src: &[u8]) -> Vec<u8> {
    let mut out = vec![0u8; src.len()];
    out.par_chunks_mut(COPY_CHUNK)
        .zip(src.par_chunks(COPY_CHUNK))
        .for_each(|(d, s)| d.copy_from_slice(s));
    out
}

/// The value and scale byte counts of a `[rows, cols]` matrix in `format`.
fn part_lens(format: &str, rows: usize, cols: usize) -> Option<(u64, u64)> {
    let (q, s) = match format {
        "int8" => (rows.checked_mul(cols)?, rows),
        "int4" => (
            rows.checked_mul(int4::row_bytes(cols))?,
            rows.checked_mul(int4::row_groups(cols))?,
        ),
        _ => return None,
    };
    Some((q as u64, (s as u64).checked_mul(4)?))
}

fn check_entry(e: &Entry, data_end: u64) -> Result<()> {
    let (q, s) = part_lens(&e.format, e.rows, e.cols)
        .ok_or_else(|| anyhow!("format {} [{}, {}] is not cached", e.format, e.rows, e.cols))?;
    for (p, want) in [(&e.q, q), (&e.scale, s)] {
        if p.len != want {
            bail!(
                "{} bytes where {} [{}, {}] needs {want}",
                p.len,
                e.format,
                e.rows,
                e.cols
            );
        }
        let end = p.offset.saturating_add(p.len);
        if p.offset < HEADER_BYTES || end > data_end {
            bail!(
                "bytes {}..{end} lie outside the data (which ends at {data_end})",
                p.offset
            );
        }
    }
    Ok(())
}

impl Builder {
    fn create(path: &Path, key: Key) -> Result<Builder> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        }
        let mut file = AtomicFile::create(path)?;
        let mut header = Vec::with_capacity(HEADER_BYTES as usize);
        header.extend_from_slice(MAGIC);
        header.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
        header.extend_from_slice(&[0u8; 4]);
        file.write_all(&header)?;
        Ok(Builder {
            file,
            key,
            entries: Vec::new(),
        })
    }

    fn part(&mut self, bytes: &[u8]) -> Result<Part> {
        let pad = (ALIGN - self.file.written() % ALIGN) % ALIGN;
        self.file
            .write_all(&[0u8; ALIGN as usize][..pad as usize])?;
        let offset = self.file.written();
        self.file.write_all(bytes)?;
        Ok(Part {
            offset,
            len: bytes.len() as u64,
            xxh3: xxh3_64(bytes),
        })
    }

    fn add(&mut self, p: Parts) -> Result<()> {
        let q = self.part(&p.q)?;
        let scale = self.part(&p.scale)?;
        self.entries.push(Entry {
            name: p.name,
            format: p.format.to_string(),
            rows: p.rows,
            cols: p.cols,
            q,
            scale,
        });
        Ok(())
    }

    /// Moves the file to a writer thread that writes each matrix it is sent, then the table,
    /// and commits once the sender is dropped. After an error it drains the queue and
    /// returns the error (the partial file is removed).
    fn spawn(mut self, replaced: Option<String>) -> Building {
        let (tx, rx) = std::sync::mpsc::sync_channel::<Parts>(WRITE_QUEUE);
        let writer = std::thread::spawn(move || {
            let mut failed = None;
            for parts in rx {
                if failed.is_none() {
                    failed = self.add(parts).err();
                }
            }
            match failed {
                Some(e) => Err(e),
                None => self.commit(),
            }
        });
        Building {
            tx,
            writer,
            replaced,
        }
    }

    fn commit(mut self) -> Result<(u64, PathBuf)> {
        let table = serde_json::to_vec(&Table {
            key: self.key.clone(),
            entries: std::mem::take(&mut self.entries),
        })?;
        let table_off = self.file.written();
        self.file.write_all(&table)?;
        let mut trailer = Vec::with_capacity(TRAILER_BYTES as usize);
        trailer.extend_from_slice(&table_off.to_le_bytes());
        trailer.extend_from_slice(&(table.len() as u64).to_le_bytes());
        trailer.extend_from_slice(&xxh3_64(&table).to_le_bytes());
        trailer.extend_from_slice(END_MAGIC);
        self.file.write_all(&trailer)?;
        let path = self.file.path().to_path_buf();
        let bytes = self.file.commit()?;
        Ok((bytes, path))
    }
}
