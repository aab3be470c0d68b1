//! The one way k3 opens a file for reading. A FIFO would block the open (or the first read)
//! until some writer appears, and `/dev/zero` or `/dev/urandom` never end, so anything but a
//! regular file (or a symlink to one) is refused before a byte is read, and no file is read
//! past the bound of its [`FileKind`]. Every error names the file, its kind and the bound.

use anyhow::{bail, Context, Result};
use std::fs::{File, Metadata};
use std::io::Read;
use std::path::Path;

/// What a file k3 reads holds; each kind has its own size bound.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FileKind {
    /// `config.json` of a snapshot.
    ModelConfig,
    /// `model.safetensors.index.json`.
    ShardIndex,
    /// A safetensors shard (read a tensor at a time, never whole).
    Shard,
    /// `tiktoken.model`.
    TiktokenModel,
    /// `tokenizer_config.json`.
    TokenizerConfig,
    /// A Hugging Face `tokenizer.json`.
    TokenizerJson,
    /// The quantized-weight cache, `k3-weights-*.cache` (memory-mapped).
    WeightCache,
    /// An entry of the on-disk prompt cache.
    PromptCache,
    /// The expert usage history.
    UsageHistory,
    /// A `--route-trace` file replayed by `k3 bench cache`.
    RouteTrace,
    /// A WGSL file a tool composes a shader variant from.
    ShaderSource,
}

impl FileKind {
    /// The kind's name in errors.
    pub fn name(self) -> &'static str {
        match self {
            FileKind::ModelConfig => "model config",
            FileKind::ShardIndex => "shard index",
            FileKind::Shard => "safetensors shard",
            FileKind::TiktokenModel => "tiktoken.model",
            FileKind::TokenizerConfig => "tokenizer_config.json",
            FileKind::TokenizerJson => "tokenizer.json",
            FileKind::WeightCache => "weight cache",
            FileKind::PromptCache => "prompt cache entry",
            FileKind::UsageHistory => "usage history",
            FileKind::RouteTrace => "route trace",
            FileKind::ShaderSource => "WGSL shader source",
        }
    }

    /// The most bytes k3 reads of a file of this kind.
    pub const fn max_bytes(self) -> u64 {
        match self {
            // Kimi K3's is a few KB; a larger one costs many times its size as a JSON tree.
            FileKind::ModelConfig => 4 << 20,
            // The release's lists every expert tensor and is a few MB.
            FileKind::ShardIndex => 64 << 20,
            // The release's shards are a few GB each; read a tensor at a time.
            FileKind::Shard => 1 << 40,
            // Kimi K3's is about 2.6 MB: 163584 short lines.
            FileKind::TiktokenModel => 64 << 20,
            // Kimi K3's is a few KB, templates included.
            FileKind::TokenizerConfig => 16 << 20,
            // The largest byte-level BPE ones shipped are near 20 MB.
            FileKind::TokenizerJson => 64 << 20,
            // The dense weights of the full model, quantized, are tens of GB; mapped.
            FileKind::WeightCache => 1 << 40,
            // A state at the end of a long prompt: MLA latents of every token, KDA states.
            FileKind::PromptCache => 256 << 30,
            // 4 bytes per (layer, expert) plus a header; layers × experts is at most 2^18.
            FileKind::UsageHistory => 16 << 20,
            // One JSON line per routed token; a day of traffic is well below this.
            FileKind::RouteTrace => 4 << 30,
            // The largest kernel file is tens of KB.
            FileKind::ShaderSource => 4 << 20,
        }
    }
}

/// An opened regular file and its metadata, taken from the opened descriptor.
pub struct InputFile {
    /// The open file, positioned at its start.
    pub file: File,
    /// Its metadata (regular file, length within the kind's bound).
    pub meta: Metadata,
}

/// What a non-regular file is, for errors.
pub fn describe_type(meta: &Metadata) -> &'static str {
    let t = meta.file_type();
    if t.is_dir() {
        return "a directory";
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if t.is_fifo() {
            return "a FIFO";
        }
        if t.is_char_device() || t.is_block_device() {
            return "a device";
        }
        if t.is_socket() {
            return "a socket";
        }
    }
    "neither a file nor a directory"
}

/// Whether anything (a file, a FIFO, a dangling symlink, ...) is at `path`: the test for
/// "this snapshot has such a file", so a special file there is opened and reported as what
/// it is rather than called missing.
pub fn is_present(path: &Path) -> bool {
    std::fs::symlink_metadata(path).is_ok()
}

fn refuse_special(path: &Path, kind: FileKind, meta: &Metadata) -> Result<()> {
    if !meta.is_file() {
        bail!(
            "{}: is {}, not a regular file: a {} must be a regular file",
            path.display(),
            describe_type(meta),
            kind.name()
        );
    }
    let (len, limit) = (meta.len(), kind.max_bytes());
    if len > limit {
        bail!(
            "{}: {len} bytes is too large for a {} (the limit is {limit} bytes)",
            path.display(),
            kind.name()
        );
    }
    Ok(())
}

#[cfg(unix)]
fn open_nonblocking(path: &Path) -> std::io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    // O_NONBLOCK: a FIFO swapped in after the stat opens at once instead of waiting for a
    // writer; the descriptor's own type is checked next.
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
}

#[cfg(unix)]
fn clear_nonblocking(file: &File) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let fd = file.as_raw_fd();
    // SAFETY: `fd` is open for the life of `file`; F_GETFL/F_SETFL only read and set its
    // status flags.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if flags < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: as above.
    if unsafe { libc::fcntl(fd, libc::F_SETFL, flags & !libc::O_NONBLOCK) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(not(unix))]
fn open_nonblocking(path: &Path) -> std::io::Result<File> {
    File::open(path)
}

#[cfg(not(unix))]
fn clear_nonblocking(_file: &File) -> std::io::Result<()> {
    Ok(())
}

/// Opens `path` as a file of `kind`: refused unless it is a regular file (symlinks followed)
/// of at most the kind's bound; the error of a missing file keeps its `NotFound` source.
pub fn open(path: &Path, kind: FileKind) -> Result<InputFile> {
    let cannot = || format!("{}: cannot read the {}", path.display(), kind.name());
    // Stat first: a directory or device is named without opening it (Windows cannot open a
    // directory as a file at all).
    let meta = std::fs::metadata(path).with_context(cannot)?;
    refuse_special(path, kind, &meta)?;
    let file = open_nonblocking(path).with_context(cannot)?;
    // The path may have been replaced between the stat and the open: judge what was opened.
    let meta = file.metadata().with_context(cannot)?;
    refuse_special(path, kind, &meta)?;
    clear_nonblocking(&file).with_context(cannot)?;
    Ok(InputFile { file, meta })
}

/// Whether `a` and `b` are descriptors of the same file (device and inode on Unix). A
/// second descriptor opened by path (the uncached one of a shard) is checked against the
/// first, so a file swapped in between the two opens is refused instead of read. Windows
/// keeps no FIFO or device under a file path, and its open pins the file, so it has nothing
/// to compare there and says yes.
pub fn same_file(a: &File, b: &File) -> std::io::Result<bool> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        let (ma, mb) = (a.metadata()?, b.metadata()?);
        Ok(ma.dev() == mb.dev() && ma.ino() == mb.ino())
    }
    #[cfg(not(unix))]
    {
        let _ = (a, b);
        Ok(true)
    }
}

/// Reads all of `path` as a file of `kind` ([`open`]'s checks), never more than its bound
/// even if it grows while it is read.
pub fn read(path: &Path, kind: FileKind) -> Result<Vec<u8>> {
    let InputFile { file, meta } = open(path, kind)?;
    let limit = kind.max_bytes();
    let mut bytes = Vec::with_capacity(meta.len() as usize);
    file.take(limit + 1)
        .read_to_end(&mut bytes)
        .with_context(|| format!("{}: cannot read the {}", path.display(), kind.name()))?;
    if bytes.len() as u64 > limit {
        bail!(
            "{}: grew past {limit} bytes while it was read: too large for a {}",
            path.display(),
            kind.name()
        );
    }
    Ok(bytes)
}

/// [`read`] for a text file: invalid UTF-8 is refused naming the file and its kind.
pub fn read_text(path: &Path, kind: FileKind) -> Result<String> {
    String::from_utf8(read(path, kind)?)
        .with_context(|| format!("{}: the {} is not UTF-8 text", path.display(), kind.name()))
}

/// [`read`] for a file that may be absent: `Ok(None)` when nothing is at `path`.
pub fn read_optional(path: &Path, kind: FileKind) -> Result<Option<Vec<u8>>> {
    if !is_present(path) {
        return Ok(None);
    }
    read(path, kind).map(Some)
}

/// Whether `err` (from this module) means the file was not there.
pub fn is_not_found(err: &anyhow::Error) -> bool {
    err.chain().any(|c| {
        c.downcast_ref::<std::io::Error>()
            .is_some_and(|e| e.kind() == std::io::ErrorKind::NotFound)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_file_tells_two_opens_of_one_file_from_two_files() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (dir.path().join("a"), dir.path().join("b"));
        std::fs::write(&a, b"a").unwrap();
        std::fs::write(&b, b"b").unwrap();
        let fa = File::open(&a).unwrap();
        assert!(same_file(&fa, &File::open(&a).unwrap()).unwrap());
        #[cfg(unix)]
        assert!(!same_file(&fa, &File::open(&b).unwrap()).unwrap());
    }

    #[test]
    fn a_regular_file_and_a_symlink_to_one_are_read() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("config.json");
        std::fs::write(&p, b"{}").unwrap();
        assert_eq!(read(&p, FileKind::ModelConfig).unwrap(), b"{}");
        #[cfg(unix)]
        {
            let link = dir.path().join("link.json");
            std::os::unix::fs::symlink(&p, &link).unwrap();
            assert_eq!(read_text(&link, FileKind::ModelConfig).unwrap(), "{}");
        }
    }

    #[test]
    fn a_file_past_its_bound_is_refused_naming_kind_and_bound() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("usage");
        let f = File::create(&p).unwrap();
        f.set_len(FileKind::UsageHistory.max_bytes() + 1).unwrap();
        let e = format!("{:#}", read(&p, FileKind::UsageHistory).unwrap_err());
        assert!(e.contains("usage history") && e.contains("16777216"), "{e}");
    }

    #[test]
    fn a_directory_is_refused_and_a_missing_file_is_not_found() {
        let dir = tempfile::tempdir().unwrap();
        let e = read(dir.path(), FileKind::ShardIndex).unwrap_err();
        let msg = format!("{e:#}");
        assert!(
            msg.contains("is a directory, not a regular file") && msg.contains("shard index"),
            "{msg}"
        );
        assert!(!is_not_found(&e));
        let missing = dir.path().join("nope");
        assert!(is_not_found(
            &read(&missing, FileKind::ShardIndex).unwrap_err()
        ));
        assert!(read_optional(&missing, FileKind::UsageHistory)
            .unwrap()
            .is_none());
    }
}
