//! The weight cache's file: its layout (see the parent module), the reader that maps and
//! checks a file through before any of it is used, and the builder that writes one in a
//! single pass as matrices arrive.

use super::key::{key_difference, Key};
use super::{Parts, FORMAT_VERSION};
use crate::atomic_file::AtomicFile;
use crate::platform::input_file::{self, FileKind};
use crate::quant::{int4, DenseData, DenseFormat, DenseMatrix};
use anyhow::{anyhow, bail, Context, Result};
use memmap2::Mmap;
use rayon::prelude::*;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use xxhash_rust::xxh3::xxh3_64;

pub(super) const MAGIC: &[u8; 8] = b"K3WCACHE";
pub(super) const END_MAGIC: &[u8; 8] = b"K3WCEND\0";
pub(super) const HEADER_BYTES: u64 = 16;
pub(super) const TRAILER_BYTES: u64 = 32;
pub(super) const ALIGN: u64 = 64;
/// Largest table accepted: the full model's table is well under a megabyte.
pub(super) const MAX_TABLE_BYTES: u64 = 64 << 20;
/// Bytes one thread copies at a time out of the map.
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

/// A cache file that checked out: its map and table.
pub(super) struct Reader {
    pub(super) path: PathBuf,
    pub(super) map: Mmap,
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
    /// Maps `path` and checks it through: header, trailer, table, key, every range and
    /// every checksum. Any failure says what was wrong.
    pub(super) fn open(path: &Path, key: &Key) -> Result<Reader> {
        let file = input_file::open(path, FileKind::WeightCache)?.file;
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
    pub(super) fn matrix(&self, e: &Entry, fmt: DenseFormat) -> DenseMatrix {
        let part = |p: &Part| &self.map[p.offset as usize..(p.offset + p.len) as usize];
        let scale: Vec<f32> = part(&e.scale)
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        let copy = |dst: &mut [u8]| copy_in_parallel(dst, part(&e.q));
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
