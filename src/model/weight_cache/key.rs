//! The key of a cache file: what its bytes depend on — the layout version, the format
//! policy, config.json's bytes, and each shard's content identity: its name, size,
//! modification time, device and inode, change time, and a hash of its header and sampled
//! blocks ([`crate::checkpoint::shards::Shard::sampled`]). The change time catches a shard
//! rewritten in place with its modification time restored; the directory is not part of
//! it, so the same snapshot through another path (a symlink) is the same key.

use super::FORMAT_VERSION;
use crate::checkpoint::file_stamp::FileStamp;
use crate::checkpoint::{Checkpoint, CONFIG_FILE};
use crate::model::format_policy::FormatPolicy;
use crate::platform::input_file::{self, FileKind};
use crate::quant::DenseFormat;
use anyhow::Result;
use serde::{Deserialize, Serialize};
use std::path::Path;
use std::time::UNIX_EPOCH;
use xxhash_rust::xxh3::xxh3_64;

/// What the key of a cache file records.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct Key {
    pub(super) version: u32,
    /// The format of each class of matrix, e.g. `dense=int4 mla=int8 head=int8`.
    pub(super) policy: String,
    /// `config.json` and every shard, in the checkpoint's order.
    pub(super) files: Vec<FileKey>,
}

/// A source file's content identity.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct FileKey {
    /// The file's name, without its directory.
    name: String,
    len: u64,
    /// Seconds and nanoseconds since the Unix epoch, where the filesystem records it.
    modified: Option<(u64, u32)>,
    /// Device and inode (Unix).
    id: Option<(u64, u64)>,
    /// The inode's change time (Unix).
    changed: Option<(i64, i64)>,
    /// A hash of the bytes: all of config.json, a shard's header and sampled blocks.
    content: u64,
}
/// The name a matrix format goes by in the key and the table.
pub(super) fn format_name(f: DenseFormat) -> &'static str {
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

/// The key of the file at `path` with identity `stamp` and content hash `content`.
pub(super) fn file_key(path: &Path, stamp: &FileStamp, content: u64) -> FileKey {
    FileKey {
        name: path.file_name().map_or_else(
            || path.display().to_string(),
            |n| n.to_string_lossy().into_owned(),
        ),
        len: stamp.len,
        modified: stamp
            .modified
            .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
            .map(|d| (d.as_secs(), d.subsec_nanos())),
        id: stamp.id,
        changed: stamp.changed,
        content,
    }
}

/// The formats' part of the cache file's name, e.g. `int4-int8-int8` (dense, MLA, head), so
/// the caches of several `--bits` settings live side by side.
pub(super) fn policy_tag(p: &FormatPolicy) -> String {
    format!(
        "{}-{}-{}",
        format_name(p.dense),
        format_name(p.mla),
        format_name(p.head)
    )
}

pub(super) fn key_of(ckpt: &Checkpoint, policy: &FormatPolicy) -> Result<Key> {
    let config = ckpt.dir.join(CONFIG_FILE);
    let bytes = input_file::read(&config, FileKind::ModelConfig)?;
    // The whole file is hashed: its identity needs no stamp of its own.
    let config_key = FileKey {
        name: CONFIG_FILE.to_string(),
        len: bytes.len() as u64,
        modified: None,
        id: None,
        changed: None,
        content: xxh3_64(&bytes),
    };
    let mut files = vec![config_key];
    for i in 0..ckpt.shard_count() {
        files.push(file_key(
            ckpt.shard_path(i),
            &ckpt.shard_stamp(i),
            ckpt.shard_sampled(i),
        ));
    }
    Ok(Key {
        version: FORMAT_VERSION,
        policy: policy_text(policy),
        files,
    })
}

/// The weight cache's stamp of a model: a hash of its key (the config's bytes, every
/// shard's content identity, and the load-time formats), so other caches (the prompt
/// cache) can name the exact weights their contents were computed with.
pub fn model_stamp(ckpt: &Checkpoint, policy: &FormatPolicy) -> Result<u64> {
    let key = key_of(ckpt, policy)?;
    Ok(xxh3_64(&serde_json::to_vec(&key)?))
}

/// Why `found` is not `want`, in a few words.
pub(super) fn key_difference(found: &Key, want: &Key) -> String {
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
        match found.files.iter().find(|f| f.name == w.name) {
            Some(f) if f == w => {}
            Some(f) => return format!("{} changed ({})", w.name, what_changed(f, w)),
            None => return format!("made without {}", w.name),
        }
    }
    "made from other files".to_string()
}

/// Which part of a file's identity differs, in words.
fn what_changed(found: &FileKey, want: &FileKey) -> &'static str {
    if found.len != want.len {
        "its size"
    } else if found.content != want.content {
        "its bytes"
    } else if found.id != want.id {
        "another file (inode)"
    } else if found.modified != want.modified {
        "its modification time"
    } else {
        "its change time: written or touched since"
    }
}
