//! The weight cache's file: its layout (see the parent module), the reader that reads and
//! checks a file through before any of it is used, and the builder that writes one in a
//! single pass as matrices arrive.

use super::key::{key_difference, Key};
use super::{Parts, FORMAT_VERSION};
use crate::atomic_file::AtomicFile;
use crate::platform::input_file::{self, FileKind};
use crate::platform::positional_read;
use crate::quant::{int4, DenseData, DenseFormat, DenseMatrix};
use anyhow::{anyhow, bail, Context, Result};
use rayon::prelude::*;
use serde::{Deserialize, Serialize};
use std::fs::File;
use std::path::{Path, PathBuf};
use xxhash_rust::xxh3::{xxh3_64, Xxh3};

pub(super) const MAGIC: &[u8; 8] = b"K3WCACHE";
pub(super) const END_MAGIC: &[u8; 8] = b"K3WCEND\0";
pub(super) const HEADER_BYTES: u64 = 16;
pub(super) const TRAILER_BYTES: u64 = 32;
pub(super) const ALIGN: u64 = 64;
/// Largest table accepted: the full model's table is well under a megabyte.
pub(super) const MAX_TABLE_BYTES: u64 = 64 << 20;
/// Bytes one thread reads at a time.
pub(super) const COPY_CHUNK: usize = 4 << 20;

/// One cached matrix.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(super) struct Entry {
    pub(super) name: String,
    pub(super) format: String,
    pub(super) rows: usize,
    pub(super) cols: usize,
    pub(super) q: Part,
    pub(super) scale: Part,
}

/// A byte range of the file and its xxh3.
#[derive(Clone, Copy, Debug, Serialize, Deserialize)]
pub(super) struct Part {
    pub(super) offset: u64,
    pub(super) len: u64,
    xxh3: u64,
}

#[derive(Debug, Serialize, Deserialize)]
pub(super) struct Table {
    pub(super) key: Key,
    pub(super) entries: Vec<Entry>,
}

/// A cache file that checked out: its open file and table. The file is read, never
/// mapped: a file cut short while k3 reads it is a read error naming it, not a SIGBUS.
pub(super) struct Reader {
    pub(super) path: PathBuf,
    file: File,
    pub(super) entries: Vec<Entry>,
    pub(super) used: usize,
    pub(super) bytes: u64,
}

/// A cache file being written as the matrices are quantized.
pub(super) struct Builder {
    pub(super) file: AtomicFile,
    pub(super) key: Key,
    pub(super) entries: Vec<Entry>,
}

pub(super) fn read_u64(b: &[u8]) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[..8]);
    u64::from_le_bytes(a)
}

impl Reader {
    /// Opens `path` and checks it through: header, trailer, table, key, every range and
    /// every checksum. Any failure says what was wrong.
    pub(super) fn open(path: &Path, key: &Key) -> Result<Reader> {
        Self::open_checked(path, key, || {})
    }

    /// [`Reader::open`], calling `before_data` once the table checked out and before the
    /// matrices' bytes are read (a test cuts the file there).
    pub(super) fn open_checked(
        path: &Path,
        key: &Key,
        before_data: impl FnOnce(),
    ) -> Result<Reader> {
        let file = input_file::open(path, FileKind::WeightCache)?.file;
        let len = file.metadata().context("cannot stat it")?.len();
        if len < HEADER_BYTES + TRAILER_BYTES {
            bail!("truncated: {len} bytes");
        }
        let mut head = [0u8; HEADER_BYTES as usize];
        let mut t = [0u8; TRAILER_BYTES as usize];
        read_exact(&file, path, &mut head, 0, "the header")?;
        if &head[..8] != MAGIC {
            bail!("not a k3 weight cache (bad magic)");
        }
        read_exact(&file, path, &mut t, len - TRAILER_BYTES, "the trailer")?;
        if &t[24..32] != END_MAGIC {
            bail!("truncated or corrupt: no end marker");
        }
        let (table_off, table_len, table_hash) =
            (read_u64(&t), read_u64(&t[8..]), read_u64(&t[16..]));
        if table_len > MAX_TABLE_BYTES
            || table_off < HEADER_BYTES
            || table_off.checked_add(table_len) != Some(len - TRAILER_BYTES)
        {
            bail!(
                "corrupt: the table at {table_off} (+{table_len}) does not fit the {len}-byte file"
            );
        }
        // The bound above keeps the table's length well within usize.
        let mut table = vec![0u8; table_len as usize];
        read_exact(&file, path, &mut table, table_off, "the table")?;
        if xxh3_64(&table) != table_hash {
            bail!("corrupt: table checksum mismatch");
        }
        let table: Table = serde_json::from_slice(&table).context("corrupt: table is not valid")?;
        if table.key != *key {
            bail!("stale: {}", key_difference(&table.key, key));
        }
        for e in &table.entries {
            check_entry(e, table_off).with_context(|| format!("corrupt: entry `{}`", e.name))?;
        }
        before_data();
        // Every part is read and hashed once here, so a damaged file is rebuilt at this
        // start; the reads fill the page cache that `matrix` then copies from.
        table.entries.par_iter().try_for_each(|e| {
            for (what, p) in [("values", &e.q), ("scales", &e.scale)] {
                if hash_part(&file, path, p, &e.name, what)? != p.xxh3 {
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
            file,
            entries: table.entries,
            used: 0,
            bytes: len,
        })
    }

    /// Reads entry `e` (checked at open) into memory, in parallel, and checks its bytes
    /// again: a file cut short or rewritten since the open is an error naming it.
    pub(super) fn matrix(&self, e: &Entry, fmt: DenseFormat) -> Result<DenseMatrix> {
        let q = self.part(e, &e.q, "values")?;
        let scale: Vec<f32> = self
            .part(e, &e.scale, "scales")?
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        let data = match fmt {
            DenseFormat::Int8 => DenseData::Int8 {
                // Collected in place: the same allocation, reinterpreted byte for byte.
                q: q.into_iter().map(|b| b as i8).collect(),
                scale,
            },
            _ => DenseData::Int4 { q, scale },
        };
        Ok(DenseMatrix {
            rows: e.rows,
            cols: e.cols,
            data,
        })
    }

    /// The bytes of part `p` of entry `e`, read over every core and checked against the
    /// part's checksum.
    fn part(&self, e: &Entry, p: &Part, what: &str) -> Result<Vec<u8>> {
        // check_entry bounded the part by the file's length, which was read into memory
        // as a u64; a part too large for usize is refused rather than truncated.
        let len = usize::try_from(p.len).with_context(|| {
            format!("{}: `{}` {what} is too large", self.path.display(), e.name)
        })?;
        let mut out = vec![0u8; len];
        out.par_chunks_mut(COPY_CHUNK)
            .enumerate()
            .try_for_each(|(i, chunk)| {
                let at = p.offset + (i * COPY_CHUNK) as u64;
                read_exact(
                    &self.file,
                    &self.path,
                    chunk,
                    at,
                    &format!("`{}` {what}", e.name),
                )
            })?;
        if xxh3_64(&out) != p.xxh3 {
            bail!(
                "{}: `{}` {what} (bytes {}..{}) changed since the file was checked; was it \
                 rewritten while k3 loaded it?",
                self.path.display(),
                e.name,
                p.offset,
                p.offset + p.len
            );
        }
        Ok(out)
    }
}

/// Fills `buf` from `offset` of the cache file at `path`: a short read (the file cut
/// short) is an error naming the file, `what` was read and where.
fn read_exact(file: &File, path: &Path, buf: &mut [u8], offset: u64, what: &str) -> Result<()> {
    positional_read::read_exact_at(file, buf, offset).with_context(|| {
        format!(
            "{}: reading {what} ({} bytes at offset {offset}; was the file truncated?)",
            path.display(),
            buf.len()
        )
    })
}

/// The xxh3 of part `p`, read in [`COPY_CHUNK`] pieces through one buffer.
fn hash_part(file: &File, path: &Path, p: &Part, name: &str, what: &str) -> Result<u64> {
    let mut hasher = Xxh3::new();
    let mut buf = vec![0u8; COPY_CHUNK.min(usize::try_from(p.len).unwrap_or(COPY_CHUNK))];
    let mut at = p.offset;
    let end = p.offset + p.len;
    while at < end {
        let n = buf
            .len()
            .min(usize::try_from(end - at).unwrap_or(usize::MAX));
        read_exact(file, path, &mut buf[..n], at, &format!("`{name}` {what}"))?;
        hasher.update(&buf[..n]);
        at += n as u64;
    }
    Ok(hasher.digest())
}

/// A copy of `src`, made by every core.
pub(super) fn parallel_copy(src: &[u8]) -> Vec<u8> {
    let mut out = vec![0u8; src.len()];
    copy_in_parallel(&mut out, src);
    out
}

/// Copies `src` into `dst` (the same length) in [`COPY_CHUNK`] pieces over every core.
fn copy_in_parallel(dst: &mut [u8], src: &[u8]) {
    dst.par_chunks_mut(COPY_CHUNK)
        .zip(src.par_chunks(COPY_CHUNK))
        .for_each(|(d, s)| d.copy_from_slice(s));
}

/// The value and scale byte counts of a `[rows, cols]` matrix in `format`.
pub(super) fn part_lens(format: &str, rows: usize, cols: usize) -> Option<(u64, u64)> {
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

pub(super) fn check_entry(e: &Entry, data_end: u64) -> Result<()> {
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
    pub(super) fn create(path: &Path, key: Key) -> Result<Builder> {
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

    pub(super) fn part(&mut self, bytes: &[u8]) -> Result<Part> {
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

    pub(super) fn add(&mut self, p: Parts) -> Result<()> {
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

    pub(super) fn commit(mut self) -> Result<(u64, PathBuf)> {
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
