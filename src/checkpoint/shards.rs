//! Shard discovery and safetensors headers: which files hold the text model, where they
//! live (snapshot directory or `K3_DIRS`), and the validated byte range of every tensor.

use super::file_stamp::FileStamp;
use super::schema::canonical_name;
use super::tensor::Dtype;
use crate::platform::input_file::{self, FileKind, InputFile};
use crate::platform::positional_read;
use anyhow::{anyhow, bail, Context, Result};
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};
use xxhash_rust::xxh3::Xxh3;

/// Dimensions a tensor's `shape` may list (k3's tensors have at most 3).
pub const MAX_DIMS: usize = 8;

/// Index file of a sharded snapshot.
pub const INDEX_FILE: &str = "model.safetensors.index.json";
/// The one file of an unsharded snapshot.
pub const SINGLE_FILE: &str = "model.safetensors";
/// Largest safetensors header accepted; the K3 release's largest is a few MB.
const MAX_HEADER_BYTES: u64 = 100_000_000;
/// Largest `model.safetensors.index.json` read: the K3 release's lists every expert tensor
/// and is a few MB; a larger file would cost many times its size as a JSON tree.
pub const MAX_INDEX_BYTES: u64 = FileKind::ShardIndex.max_bytes();
/// Bytes of the little-endian header length that starts every safetensors file.
const LEN_BYTES: u64 = 8;

/// One shard, opened once: every read of its bytes goes through [`Shard::read`], a
/// positional read of this descriptor checked against the stamp. Shards are read, never
/// memory-mapped, so a file cut short under a running engine is an error naming it rather
/// than a SIGBUS.
pub struct Shard {
    /// Where the file was found.
    pub path: PathBuf,
    /// The file, as the checked opener opened it.
    pub file: File,
    /// Its identity when it was opened (size, modification time, inode, change time).
    pub stamp: FileStamp,
    /// A hash of its header and of [`SAMPLES`] blocks of [`SAMPLE_BYTES`] spread over the
    /// file: with the stamp, the cheap content identity the caches are keyed by.
    pub sampled: u64,
}

/// Blocks of a shard hashed into [`Shard::sampled`] besides its header.
pub const SAMPLES: u64 = 8;
/// Bytes of each sampled block.
pub const SAMPLE_BYTES: u64 = 4096;

impl Shard {
    /// The bytes of `range` (`what` names them in errors), read from the open file, then
    /// checked: a file that changed (in place, truncated, or replaced at its path) while
    /// they were read is an error naming the shard and the offset, and so is a read that
    /// ends early.
    pub fn read(&self, range: std::ops::Range<u64>, what: &str) -> Result<Vec<u8>> {
        let len = usize::try_from(range.end.saturating_sub(range.start))
            .with_context(|| format!("{}: {what} is too large to read", self.path.display()))?;
        let mut buf = vec![0u8; len];
        let read = positional_read::read_exact_at(&self.file, &mut buf, range.start);
        // A changed file explains a short read better than the short read does.
        self.stamp.check_file(&self.file, &self.path, range.start)?;
        read.with_context(|| {
            format!(
                "{}: reading {what} ({len} bytes at offset {}; was the shard truncated?)",
                self.path.display(),
                range.start
            )
        })?;
        Ok(buf)
    }
}

/// A text-model tensor found in a shard header, validated against the file.
#[derive(Clone, Debug)]
pub struct Entry {
    /// Index into the shard list.
    pub shard: usize,
    /// Stored element type.
    pub dtype: Dtype,
    /// Stored shape.
    pub shape: Vec<usize>,
    /// Absolute byte range in the shard file.
    pub range: std::ops::Range<u64>,
}

/// The shards of the text model and every tensor they hold, by canonical name.
pub struct ShardSet {
    /// Open shards, in index order.
    pub shards: Vec<Shard>,
    /// Canonical name → location.
    pub entries: HashMap<String, Entry>,
}

/// Checks that a directory exists and can be listed.
pub fn check_dir(dir: &Path, what: &str) -> Result<()> {
    std::fs::read_dir(dir)
        .map(|_| ())
        .with_context(|| format!("{what} {}: cannot read the directory", dir.display()))
}

/// The snapshot's index (canonical tensor name → shard file name), `None` for an unsharded
/// snapshot: which files hold which tensors, known without opening a shard.
pub fn index_map(dir: &Path) -> Result<Option<BTreeMap<String, String>>> {
    let index_path = dir.join(INDEX_FILE);
    if input_file::is_present(&index_path) {
        Ok(Some(read_index(&index_path)?.1))
    } else {
        Ok(None)
    }
}

/// Where shard file `name` is: in `dir`, else in the first of `extra_dirs` holding it
/// (an error naming the file and every directory searched when none does).
pub fn find_shard(name: &str, dir: &Path, extra_dirs: &[PathBuf]) -> Result<PathBuf> {
    locate(name, dir, extra_dirs).map(|(p, _)| p)
}

/// Reads the snapshot's shard list, opens every shard that holds text-model tensors (or,
/// with `only`, those of its files the index names; an unsharded snapshot's one file is
/// always opened) and validates its header.
pub fn open_shards(
    dir: &Path,
    extra_dirs: &[PathBuf],
    only: Option<&BTreeSet<String>>,
) -> Result<ShardSet> {
    let index_path = dir.join(INDEX_FILE);
    let (shard_names, indexed) = if input_file::is_present(&index_path) {
        let (mut names, mut map) = read_index(&index_path)?;
        if let Some(only) = only {
            names.retain(|n| only.contains(n));
            map.retain(|_, file| only.contains(file));
        }
        (names, Some(map))
    } else if input_file::is_present(&dir.join(SINGLE_FILE)) {
        (vec![SINGLE_FILE.to_string()], None)
    } else {
        bail!(
            "{}: neither {INDEX_FILE} nor {SINGLE_FILE} is there (is this a K3 snapshot directory?)",
            dir.display()
        );
    };

    let mut per_extra = vec![0usize; extra_dirs.len()];
    let mut shards = Vec::with_capacity(shard_names.len());
    for name in &shard_names {
        let (path, from) = locate(name, dir, extra_dirs)?;
        if let Some(k) = from {
            per_extra[k] += 1;
        }
        shards.push(open_shard(path)?);
    }
    for (k, n) in per_extra.iter().enumerate() {
        if *n > 0 {
            tracing::info!("[SPLIT] +{} -> {n} shard(s)", extra_dirs[k].display());
        }
    }

    let mut entries = HashMap::new();
    for (i, shard) in shards.iter().enumerate() {
        read_header(i, shard, &mut entries)?;
    }
    // The headers were read from the files as stamped.
    for s in &shards {
        s.stamp.check_file(&s.file, &s.path, 0)?;
    }
    if let Some(map) = indexed {
        for (name, file) in map {
            let held = entries
                .get(&name)
                .map(|e| shard_names[e.shard] == file)
                .unwrap_or(false);
            if !held {
                bail!(
                    "{}: lists tensor `{name}` in {file}, but that shard's header does not hold it (index and shards disagree; re-download the snapshot)",
                    index_path.display()
                );
            }
        }
    }
    Ok(ShardSet { shards, entries })
}

/// Reads the index with [`parse_index`].
fn read_index(path: &Path) -> Result<(Vec<String>, BTreeMap<String, String>)> {
    let text = input_file::read_text(path, FileKind::ShardIndex)?;
    parse_index(&text, path)
}

/// Parses index text: shard file names holding text tensors (sorted) and canonical
/// tensor name → shard file name; `path` names the index in errors.
pub fn parse_index(text: &str, path: &Path) -> Result<(Vec<String>, BTreeMap<String, String>)> {
    let root: Value = crate::unique_json::parse_str(text)
        .with_context(|| format!("{}: not valid JSON", path.display()))?;
    let map = root
        .get("weight_map")
        .and_then(Value::as_object)
        .ok_or_else(|| anyhow!("{}: missing object `weight_map`", path.display()))?;
    let mut names: Vec<String> = Vec::new();
    let mut by_tensor = BTreeMap::new();
    for (stored, file) in map {
        let Some(canon) = canonical_name(stored) else {
            continue;
        };
        let file = file.as_str().ok_or_else(|| {
            anyhow!(
                "{}: weight_map[`{stored}`]: expected a shard file name, got {file}",
                path.display()
            )
        })?;
        if file.is_empty() || file.contains(['/', '\\']) || file == "." || file == ".." {
            bail!(
                "{}: weight_map[`{stored}`]: `{file}` is not a plain file name",
                path.display()
            );
        }
        if by_tensor
            .insert(canon.to_string(), file.to_string())
            .is_some()
        {
            bail!(
                "{}: tensor `{canon}` is listed twice (with and without the language_model. prefix)",
                path.display()
            );
        }
        if !names.iter().any(|n| n == file) {
            names.push(file.to_string());
        }
    }
    names.sort();
    Ok((names, by_tensor))
}

/// Finds a shard: the snapshot directory first, then the extra directories in order.
/// Returns the path and, when an extra directory supplied it, that directory's index.
/// Something that exists under a shard's name but is not a regular file (a directory, a
/// FIFO, a device) is reported as what it is rather than skipped.
fn locate(name: &str, dir: &Path, extra_dirs: &[PathBuf]) -> Result<(PathBuf, Option<usize>)> {
    let candidates = std::iter::once((dir, None)).chain(
        extra_dirs
            .iter()
            .enumerate()
            .map(|(k, d)| (d.as_path(), Some(k))),
    );
    for (d, from) in candidates {
        let p = d.join(name);
        // A special file is opened, judged and named by the shard's own open.
        if std::fs::metadata(&p).is_ok() {
            return Ok((p, from));
        }
    }
    let searched: Vec<String> = std::iter::once(dir)
        .chain(extra_dirs.iter().map(PathBuf::as_path))
        .map(|d| d.display().to_string())
        .collect();
    bail!(
        "shard {name} not found; searched {} (add the directory that holds it to K3_DIRS / --dirs)",
        searched.join(", ")
    )
}

fn open_shard(path: PathBuf) -> Result<Shard> {
    let InputFile { file, meta } = input_file::open(&path, FileKind::Shard)?;
    let len = meta.len();
    if len < LEN_BYTES {
        bail!(
            "{}: {len} bytes is too short to be a safetensors file (truncated download?)",
            path.display()
        );
    }
    let stamp = FileStamp::of_file(&file)
        .with_context(|| format!("{}: cannot read the file's identity", path.display()))?;
    let mut shard = Shard {
        path,
        file,
        stamp,
        sampled: 0,
    };
    shard.sampled = sample_hash(&shard)?;
    Ok(shard)
}

/// The bytes of the header (its length and JSON; only the length when that is absurd, for
/// [`parse_header_start`] to refuse).
fn header_bytes(shard: &Shard) -> Result<Vec<u8>> {
    let len_bytes = shard.read(0..LEN_BYTES, "the header length")?;
    let mut n = [0u8; LEN_BYTES as usize];
    n.copy_from_slice(&len_bytes);
    let header_len = u64::from_le_bytes(n);
    if header_len > MAX_HEADER_BYTES || header_len > shard.stamp.len - LEN_BYTES {
        return Ok(len_bytes);
    }
    shard.read(0..LEN_BYTES + header_len, "the header")
}

/// A hash of `shard`'s header and of [`SAMPLES`] blocks spread evenly from its start to its
/// end: a cheap fingerprint of its content that does not read the whole file.
fn sample_hash(shard: &Shard) -> Result<u64> {
    let mut h = Xxh3::new();
    h.update(&header_bytes(shard)?);
    let len = shard.stamp.len;
    let block = SAMPLE_BYTES.min(len);
    let span = len - block;
    for i in 0..SAMPLES {
        let at = span / (SAMPLES - 1) * i;
        let at = if i == SAMPLES - 1 { span } else { at };
        h.update(&shard.read(at..at + block, "a sampled block")?);
    }
    Ok(h.digest())
}

/// Validates a shard's header and records every text-model tensor it holds.
fn read_header(index: usize, shard: &Shard, entries: &mut HashMap<String, Entry>) -> Result<()> {
    let head = header_bytes(shard)?;
    parse_header_start(index, &head, shard.stamp.len, &shard.path, entries)
}

/// Validates the safetensors header at the start of `file` (a whole shard's bytes) and
/// records every text-model tensor it holds as shard `index`; `path` names it in errors.
pub fn parse_header(
    index: usize,
    file: &[u8],
    path: &Path,
    entries: &mut HashMap<String, Entry>,
) -> Result<()> {
    parse_header_start(index, file, file.len() as u64, path, entries)
}

/// [`parse_header`] over `file`, the first bytes of a shard of `file_len` bytes: at least
/// its header length and, unless that length is refused, the whole header.
fn parse_header_start(
    index: usize,
    file: &[u8],
    file_len: u64,
    path: &Path,
    entries: &mut HashMap<String, Entry>,
) -> Result<()> {
    let path = path.display();
    if file_len < LEN_BYTES || (file.len() as u64) < LEN_BYTES {
        bail!("{path}: {file_len} bytes is too short to be a safetensors file");
    }
    let mut len_bytes = [0u8; LEN_BYTES as usize];
    len_bytes.copy_from_slice(&file[..LEN_BYTES as usize]);
    let header_len = u64::from_le_bytes(len_bytes);
    if header_len > MAX_HEADER_BYTES || header_len > file_len - LEN_BYTES {
        bail!(
            "{path}: header length {header_len} is absurd (file is {file_len} bytes, limit {MAX_HEADER_BYTES}): corrupt or not a safetensors file"
        );
    }
    let data_start = LEN_BYTES + header_len;
    let data_len = file_len - data_start;
    let header = file
        .get(LEN_BYTES as usize..data_start as usize)
        .ok_or_else(|| anyhow!("{path}: the file ends inside its {header_len}-byte header"))?;
    let header: Value = crate::unique_json::parse_slice(header)
        .with_context(|| format!("{path}: the safetensors header is not valid JSON"))?;
    let header = header
        .as_object()
        .ok_or_else(|| anyhow!("{path}: the safetensors header is not a JSON object"))?;
    let mut ranges: Vec<(std::ops::Range<u64>, &str)> = Vec::new();
    for (stored, info) in header {
        if stored == "__metadata__" {
            continue;
        }
        let Some(canon) = canonical_name(stored) else {
            continue;
        };
        let entry = parse_entry(index, info, data_start, data_len)
            .with_context(|| format!("{path}: tensor `{stored}`"))?;
        ranges.push((entry.range.clone(), stored));
        if entries.insert(canon.to_string(), entry).is_some() {
            bail!(
                "{path}: tensor `{canon}` appears twice in the checkpoint (with and without the language_model. prefix, or in two shards)"
            );
        }
    }
    // Two tensors over the same bytes would load each other's values.
    ranges.retain(|(r, _)| !r.is_empty());
    ranges.sort_by_key(|(r, _)| (r.start, r.end));
    for w in ranges.windows(2) {
        let ((a, an), (b, bn)) = (&w[0], &w[1]);
        if b.start < a.end {
            bail!(
                "{path}: tensors `{an}` (bytes {}..{}) and `{bn}` (bytes {}..{}) overlap: corrupt header",
                a.start,
                a.end,
                b.start,
                b.end
            );
        }
    }
    Ok(())
}

fn parse_entry(shard: usize, info: &Value, data_start: u64, data_len: u64) -> Result<Entry> {
    let dtype_name = info
        .get("dtype")
        .and_then(Value::as_str)
        .ok_or_else(|| anyhow!("missing `dtype`"))?;
    let dtype = Dtype::from_safetensors_name(dtype_name).ok_or_else(|| {
        let shown: String = dtype_name.chars().take(32).collect();
        anyhow!("dtype {shown:?} is not supported (expected BF16, F16, F32 or U8)")
    })?;
    let dims = info
        .get("shape")
        .and_then(Value::as_array)
        .ok_or_else(|| anyhow!("missing `shape`"))?;
    // Refused before any is read, so no error quotes a shape of a thousand entries.
    if dims.len() > MAX_DIMS {
        bail!(
            "`shape` has {} entries; a tensor has at most {MAX_DIMS}",
            dims.len()
        );
    }
    let shape = dims
        .iter()
        .map(|d| {
            d.as_u64()
                .and_then(|x| usize::try_from(x).ok())
                .ok_or_else(|| anyhow!("shape entry {d} is not a dimension"))
        })
        .collect::<Result<Vec<usize>>>()?;
    let offsets = info
        .get("data_offsets")
        .and_then(Value::as_array)
        .filter(|o| o.len() == 2)
        .ok_or_else(|| anyhow!("missing `data_offsets` [begin, end]"))?;
    let (Some(begin), Some(end)) = (offsets[0].as_u64(), offsets[1].as_u64()) else {
        bail!("data_offsets {offsets:?} are not byte offsets");
    };
    if begin > end {
        bail!("data_offsets [{begin}, {end}] run backwards");
    }
    if end > data_len {
        bail!(
            "data ends at byte {} but the file has {} bytes: the shard is truncated (re-download it)",
            data_start + end,
            data_start + data_len
        );
    }
    let want = shape
        .iter()
        .try_fold(dtype.size(), |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| anyhow!("shape {shape:?} overflows"))?;
    if want as u64 != end - begin {
        bail!(
            "{dtype} {shape:?} needs {want} bytes but data_offsets give {}",
            end - begin
        );
    }
    Ok(Entry {
        shard,
        dtype,
        shape,
        range: data_start + begin..data_start + end,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shape_of_too_many_entries_is_refused_short() {
        let info = serde_json::json!({
            "dtype": "F32",
            "shape": vec![1; 100_000],
            "data_offsets": [0, 4],
        });
        let e = format!("{:#}", parse_entry(0, &info, 0, 4).unwrap_err());
        assert!(e.contains("100000 entries") && e.len() < 200, "{e}");
        let info =
            serde_json::json!({"dtype": "x".repeat(100_000), "shape": [1], "data_offsets": [0, 4]});
        let e = format!("{:#}", parse_entry(0, &info, 0, 4).unwrap_err());
        assert!(e.len() < 200, "{e}");
    }
}
