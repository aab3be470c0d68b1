//! The key of a cache file: what its bytes depend on (the layout version, the format
//! policy, and the size and modification time of config.json and of every shard).

use super::FORMAT_VERSION;
use crate::checkpoint::{Checkpoint, CONFIG_FILE};
use crate::model::format_policy::FormatPolicy;
use crate::quant::DenseFormat;
use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};
use std::path::Path;
use std::time::{SystemTime, UNIX_EPOCH};
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

/// A source file's path, size and modification time.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct FileKey {
    path: String,
    len: u64,
    /// Seconds and nanoseconds since the Unix epoch, where the filesystem records it.
    modified: Option<(u64, u32)>,
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

pub(super) fn file_key(path: &Path, len: u64, modified: Option<SystemTime>) -> FileKey {
    FileKey {
        path: path.display().to_string(),
        len,
        modified: modified
            .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
            .map(|d| (d.as_secs(), d.subsec_nanos())),
    }
}

pub(super) fn key_of(ckpt: &Checkpoint, policy: &FormatPolicy) -> Result<Key> {
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
        match found.files.iter().find(|f| f.path == w.path) {
            Some(f) if f == w => {}
            Some(_) => return format!("{} changed (size or modification time)", w.path),
            None => return format!("made without {}", w.path),
        }
    }
    "made from other files".to_string()
}
